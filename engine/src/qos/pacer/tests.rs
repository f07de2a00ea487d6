//! Pacers against a small device model in virtual time: background operations of
//! `OP_BYTES` per member take `BG_NS` each (up to `MAX_BG` in flight); a QD1 foreground
//! client's latency grows with the background in flight when it is issued.

use super::*;

const MS: u64 = 1_000_000;
const OP_BYTES: u64 = 256 << 10;
const BG_NS: u64 = 2 * MS;
const MAX_BG: usize = 16;
const STEP_NS: u64 = 10_000;

struct Run {
    /// (completion time, bytes per member) of background operations.
    bg: Vec<(u64, u64)>,
    /// (completion time, latency) of foreground requests.
    fg: Vec<(u64, u64)>,
    /// Admissions answered `AfterCompletion` while foreground was present.
    waited_for_completion: u64,
}

impl Run {
    fn bg_rate(&self, from: u64, to: u64) -> u64 {
        let bytes: u64 = self
            .bg
            .iter()
            .filter(|&&(t, _)| t >= from && t < to)
            .map(|&(_, b)| b)
            .sum();
        bytes * NS_PER_S / (to - from)
    }

    fn fg_p99(&self, from: u64, to: u64) -> u64 {
        self.fg_quantile(from, to, 99)
    }

    /// Latencies of the foreground requests completed in `from..to`, ns (at least one).
    fn fg_latencies(&self, from: u64, to: u64) -> Vec<u64> {
        let l: Vec<u64> = self
            .fg
            .iter()
            .filter(|&&(t, _)| t >= from && t < to)
            .map(|&(_, l)| l)
            .collect();
        assert!(!l.is_empty(), "foreground ran in {from}..{to}");
        l
    }

    /// The `pct`-th percentile of foreground latency completed in `from..to`, ns.
    fn fg_quantile(&self, from: u64, to: u64, pct: usize) -> u64 {
        let mut l = self.fg_latencies(from, to);
        l.sort_unstable();
        l[(l.len() * pct).div_ceil(100) - 1]
    }

    /// The mean foreground latency of requests completed in `from..to`, ns.
    fn fg_mean(&self, from: u64, to: u64) -> f64 {
        let l = self.fg_latencies(from, to);
        l.iter().sum::<u64>() as f64 / l.len() as f64
    }
}

/// Runs `pacer` until `until`; foreground (QD1, latency `fg_base + fg_per_bg × background
/// in flight`) is active while `fg_on(now)`.
fn simulate(
    pacer: &mut dyn Pacer,
    until: u64,
    fg_on: impl Fn(u64) -> bool,
    fg_base: u64,
    fg_per_bg: u64,
) -> Run {
    simulate_with(pacer, until, fg_on, |_, _, bg| fg_base + fg_per_bg * bg)
}

/// [`simulate`] with the foreground's latency given by `fg_latency(now, request number,
/// background in flight)` when a request is issued.
fn simulate_with(
    pacer: &mut dyn Pacer,
    until: u64,
    fg_on: impl Fn(u64) -> bool,
    fg_latency: impl Fn(u64, u64, u64) -> u64,
) -> Run {
    let mut run = Run {
        bg: Vec::new(),
        fg: Vec::new(),
        waited_for_completion: 0,
    };
    let mut bg: Vec<(u64, u64)> = Vec::new(); // (done at, started at)
    let mut fg: Option<(u64, u64)> = None;
    let mut wait_until = 0;
    let mut wait_completion = false;
    let mut started = 0u64;
    let mut fg_issued = 0u64;
    let mut now = 0;
    while now < until {
        // Completions.
        let before = bg.len();
        bg.retain(|&(done, start)| {
            if done <= now {
                pacer.background_done(now, now - start, OP_BYTES);
                run.bg.push((now, OP_BYTES));
                false
            } else {
                true
            }
        });
        if bg.len() < before {
            wait_completion = false;
        }
        if let Some((done, start)) = fg {
            if done <= now {
                pacer.foreground_done(now, now - start, 4096, true);
                run.fg.push((now, now - start));
                fg = None;
            }
        }
        // Foreground issues.
        if fg.is_none() && fg_on(now) {
            pacer.foreground_submitted(now);
            fg = Some((now + fg_latency(now, fg_issued, bg.len() as u64), now));
            fg_issued += 1;
        }
        // Background asks.
        while bg.len() < MAX_BG && now >= wait_until && !wait_completion {
            match pacer.admit(now, OP_BYTES, bg.len() as u32) {
                Admission::Now => {
                    // Service times vary a little (deterministically), so completions
                    // do not arrive in lockstep.
                    started += 1;
                    bg.push((now + BG_NS + (started % 7) * 50_000, now));
                }
                Admission::NotBefore(t) => {
                    assert!(t > now, "NotBefore must lie in the future");
                    wait_until = t;
                }
                Admission::AfterCompletion => {
                    assert!(!bg.is_empty(), "AfterCompletion with nothing in flight");
                    if fg.is_some() || fg_on(now) {
                        run.waited_for_completion += 1;
                    }
                    wait_completion = true;
                }
            }
        }
        now += STEP_NS;
    }
    run
}

/// [`simulate_with`] for 2 s of foreground that never stops, with `fg_latency(request
/// number, background in flight)`, under the default pacer with limits 1..10,000 MB/s.
fn busy_2s(fg_latency: impl Fn(u64, u64) -> u64) -> (FerroraidPacer, Run) {
    let mut p = ferro(limits(1, 10_000));
    let r = simulate_with(&mut p, 2000 * MS, |_| true, |_, i, bg| fg_latency(i, bg));
    (p, r)
}

fn limits(min_mb: u64, max_mb: u64) -> SpeedLimits {
    SpeedLimits::from_mb_per_s(min_mb, max_mb)
}

/// `ns` × (1 + the default tolerance): the latency the default pacer allows over a quiet
/// latency of `ns`, ns.
fn within_tolerance(ns: u64) -> u64 {
    (ns as f64 * (1.0 + FerroraidPacerConfig::default().tolerance)) as u64
}

fn ferro(l: SpeedLimits) -> FerroraidPacer {
    FerroraidPacer::new(FerroraidPacerConfig {
        limits: l,
        ..FerroraidPacerConfig::default()
    })
}

#[test]
fn ferroraid_respects_the_ceiling_when_alone() {
    let mut p = ferro(limits(10, 500));
    // Device limit: 16 × 256 KiB / 2 ms ≈ 2 GB/s; the ceiling is 500 MB/s.
    let r = simulate(&mut p, 1000 * MS, |_| false, 100_000, 0);
    let rate = r.bg_rate(100 * MS, 1000 * MS);
    assert!(rate <= 500_000_000 * 102 / 100, "{rate}");
    assert!(rate >= 500_000_000 * 90 / 100, "{rate}");
}

#[test]
fn ferroraid_keeps_the_floor_under_heavy_interference() {
    // Every background operation in flight costs the foreground 5× its quiet latency.
    let mut p = ferro(limits(20, 1000));
    let r = simulate(&mut p, 3000 * MS, |_| true, 100_000, 500_000);
    let rate = r.bg_rate(500 * MS, 3000 * MS);
    assert!(rate >= 20_000_000 * 95 / 100, "floor: {rate}");
    assert!(
        rate <= 20_000_000 * 2,
        "no more than the floor needs: {rate}"
    );
}

#[test]
fn ferroraid_protects_foreground_and_recovers_within_50_ms() {
    // Foreground on 0..1 s, off 1..1.3 s, on 1.3..2 s; interference 8 µs per background
    // operation on a 100 µs foreground.
    let on = |t: u64| t < 1000 * MS || (1300 * MS..2000 * MS).contains(&t);
    let mut p = ferro(limits(1, 2000));
    let r = simulate(&mut p, 2000 * MS, on, 100_000, 8_000);
    assert!(p.baseline_ns() >= 100_000 && p.baseline_ns() < 102_000);
    // Protected: foreground within tolerance of its quiet latency (once the controller has
    // found its depth), while background still progresses well above the floor.
    let fg = r.fg_p99(300 * MS, 1000 * MS);
    assert!(fg <= within_tolerance(100_000), "foreground p99 {fg} ns");
    let shared = r.bg_rate(300 * MS, 1000 * MS);
    // (One operation in flight at a time serves ~115 MB/s in this model.)
    assert!(
        shared >= 80_000_000,
        "background while shared: {shared} B/s"
    );
    // Foreground stops at 1 s: full speed (the device's 16 in flight) from 1.05 s.
    let full = MAX_BG as u64 * OP_BYTES * NS_PER_S / BG_NS;
    let alone = r.bg_rate(1050 * MS, 1300 * MS);
    assert!(alone >= full * 90 / 100, "alone {alone} of {full}");
    // Foreground resumes at 1.3 s: protected again from 1.35 s.
    let fg = r.fg_p99(1350 * MS, 2000 * MS);
    assert!(
        fg <= within_tolerance(100_000),
        "foreground p99 after resuming {fg} ns"
    );
}

/// The device model's most background: `MAX_BG` operations in flight, bytes/s per member.
const DEVICE_MAX: u64 = MAX_BG as u64 * OP_BYTES * NS_PER_S / BG_NS;

#[test]
fn ferroraid_is_not_pinned_at_the_floor_by_a_noisy_host() {
    // Background costs this foreground nothing, but the host is noisy: one request in 9
    // takes 110 µs instead of 100, and one in 250 stalls for 5 ms (a preempted reactor),
    // background or not. The p99 of a 10 ms window (~95 requests) is then its slowest
    // request, and a third of the windows hold a stall; comparing that with the quiet
    // p99 pinned the old law at the floor (issue 5's real-time shortfall).
    let (p, r) = busy_2s(|i, _| match i {
        _ if i % 250 == 7 => 5 * MS,
        _ if i % 9 == 4 => 110_000,
        _ => 100_000,
    });
    let rate = r.bg_rate(300 * MS, 2000 * MS);
    assert!(
        rate >= DEVICE_MAX * 80 / 100,
        "background {rate} B/s of {DEVICE_MAX}: held back by noise it does not cause"
    );
    // The stalls are the quiet device's own: the windows that hold one pass.
    assert!(p.allowance(95) >= 1.5, "{}", p.allowance(95));
}

#[test]
fn ferroraid_cuts_background_when_it_starts_to_hurt() {
    // Background is free until 1 s; from then on each operation in flight costs the
    // foreground 10 µs (100 µs quiet, allowed 115 µs: one operation in flight fits).
    let hurts = 1000 * MS;
    let mut p = ferro(limits(1, 10_000));
    let r = simulate_with(
        &mut p,
        2000 * MS,
        |_| true,
        |now, _, bg| 100_000 + if now >= hurts { 10_000 * bg } else { 0 },
    );
    let before = r.bg_rate(300 * MS, hurts);
    assert!(before >= DEVICE_MAX * 80 / 100, "before: {before} B/s");
    // Cut within 50 ms: the foreground's p90 is within tolerance again, and its p99
    // close (uncontrolled, 16 in flight: 260 µs).
    let p90 = r.fg_quantile(hurts + 50 * MS, 2000 * MS, 90);
    let p99 = r.fg_p99(hurts + 50 * MS, 2000 * MS);
    assert!(p90 <= within_tolerance(100_000), "p90 {p90} ns");
    assert!(p99 <= 120_000, "p99 {p99} ns");
    // Background still progresses well above the floor, far below where it was.
    let after = r.bg_rate(hurts + 100 * MS, 2000 * MS);
    assert!(after >= 50_000_000, "after: {after} B/s");
    assert!(
        after <= before / 4,
        "after: {after} B/s, before {before} B/s"
    );
}

#[test]
fn ferroraid_keeps_the_median_when_the_hosts_stalls_are_the_p99() {
    // One request in 40 stalls for 4 ms (a host that busy: 2.5 % of requests), so the
    // quiet p99 is a stall and the p99 test allows 4.6 ms. Each background operation in
    // flight costs the foreground 100 µs: without a check on the body of the latency,
    // background would fill the device and every request take ~1.7 ms.
    let (p, r) = busy_2s(|i, bg| {
        if i % 40 == 7 {
            4 * MS
        } else {
            100_000 + 100_000 * bg
        }
    });
    assert!(
        p.baseline_ns() >= 4 * MS,
        "the p99 is the stall: {}",
        p.baseline_ns()
    );
    let p50 = r.fg_quantile(300 * MS, 2000 * MS, 50);
    assert!(p50 <= within_tolerance(100_000), "median {p50} ns");
    let floor = r.bg_rate(300 * MS, 2000 * MS);
    assert!(floor >= 1_000_000 * 95 / 100, "floor: {floor} B/s");
}

#[test]
fn ferroraid_keeps_the_mean_when_latencies_sit_at_two_levels() {
    // A foreground whose requests take one service time (20 µs) or two (40 µs: queued
    // behind another, or a reconstruction reading two members): 5 % are slow when
    // background is quiet, and each background operation in flight makes 3 % more of
    // them slow (at most 49 %). Median (20 µs) and p99 (40 µs, within the allowed
    // 46 µs) never move, yet at 16 operations in flight the mean is 41 % over the quiet
    // one — a closed-loop client loses 29 % of its throughput. The pacing scenario's
    // rebuild beside 64 readers is this case (docs/PACING.md, "Deep, mixed foreground").
    let (_, r) = busy_2s(|i, bg| {
        if (i * 37) % 100 < (5 + 3 * bg).min(49) {
            40_000
        } else {
            20_000
        }
    });
    let (from, to) = (300 * MS, 2000 * MS);
    let mean = r.fg_mean(from, to);
    // Quiet mean 21 µs; within tolerance plus a little of the window's noise margin.
    assert!(
        mean <= within_tolerance(21_000) as f64 * 1.03,
        "foreground mean {mean} ns"
    );
    assert_eq!(
        r.fg_quantile(from, to, 50),
        20_000,
        "the median never moves"
    );
    // Background is cut to what the mean allows (~1 + (21 × 0.15 / 20) / 3 % ≈ 5
    // operations in flight), not to the floor.
    let rate = r.bg_rate(from, to);
    assert!(
        rate >= DEVICE_MAX / 8,
        "background {rate} B/s of {DEVICE_MAX}"
    );
}

/// `n` QD1 foreground requests with no background at all, request `i` taking `lat(i)`.
fn feed_quiet(p: &mut FerroraidPacer, n: u64, lat: impl Fn(u64) -> u64) {
    let mut now = 0;
    for i in 0..n {
        p.foreground_submitted(now);
        now += lat(i);
        p.foreground_done(now, lat(i), 4096, true);
    }
}

#[test]
fn ferroraid_allowance_is_a_p99_plus_the_quiet_devices_own_noise() {
    // A noiseless quiet device (every request 100 µs): a window of 100 may have one
    // request past the allowed latency (its p99), plus the margin that a reference of
    // 512–1024 quiet requests cannot rule out (one pseudo-observation: ≤ 0.2 %).
    let mut p = ferro(limits(1, 10_000));
    feed_quiet(&mut p, 2000, |_| 100_000);
    assert!(p.baseline_ns() >= 100_000 && p.baseline_ns() < 102_000);
    let a = p.allowed_ns();
    assert!(
        a >= within_tolerance(100_000) && a < within_tolerance(102_000),
        "allowed {a} ns"
    );
    let a = p.allowance(100);
    assert!((1.0..2.5).contains(&a), "noiseless: {a}");
    // One quiet request in 200 stalls (2 ms): the window may hold its share of stalls
    // too (~0.5), and 3 standard deviations of that count (~2.1).
    let mut p = ferro(limits(1, 10_000));
    feed_quiet(
        &mut p,
        2000,
        |i| if i % 200 == 0 { 2 * MS } else { 100_000 },
    );
    assert!(p.baseline_ns() < 102_000, "the stalls are past the p99");
    let a = p.allowance(100);
    assert!((3.0..4.5).contains(&a), "noisy: {a}");
    // A stall among the first 16 quiet requests is not the baseline (it would allow
    // background 40× the foreground's latency, and leave no quiet request to correct it).
    let mut p = ferro(limits(1, 10_000));
    feed_quiet(&mut p, 16, |i| if i == 5 { 4 * MS } else { 100_000 });
    assert!(p.baseline_ns() < 102_000, "{}", p.baseline_ns());
    // A small reference is not taken for a noiseless device: its first 16 requests.
    let mut p = ferro(limits(1, 10_000));
    feed_quiet(&mut p, 16, |_| 100_000);
    let a = p.allowance(100);
    assert!(a >= 10.0, "16 quiet requests: {a}");
}

#[test]
fn md_pre_4_1_crawls_at_the_floor_with_any_foreground() {
    let mut p = MdPre41Pacer::new(limits(1, 200));
    let r = simulate(&mut p, 20_000 * MS, |_| true, 100_000, 8_000);
    // md's speed window: after its first seconds, the resync averages speed_min.
    let rate = r.bg_rate(5_000 * MS, 20_000 * MS);
    assert!(rate <= 2_000_000, "{rate}");
    assert!(rate >= 500_000, "{rate}");
    // Alone, it runs to its ceiling.
    let mut p = MdPre41Pacer::new(limits(1, 200));
    let r = simulate(&mut p, 5_000 * MS, |_| false, 100_000, 8_000);
    let rate = r.bg_rate(1_000 * MS, 5_000 * MS);
    assert!((150_000_000..=260_000_000).contains(&rate), "{rate}");
}

#[test]
fn md_4_1_only_waits_for_its_own_requests() {
    let mut p = Md41Pacer::new(limits(1, 100_000));
    let r = simulate(&mut p, 2_000 * MS, |_| true, 100_000, 8_000);
    assert!(
        r.waited_for_completion > 0,
        "waits for its pending requests"
    );
    // It yields only as long as its own requests take: background stays fast (two
    // orders of magnitude above the pre-4.1 rule's floor).
    let rate = r.bg_rate(500 * MS, 2_000 * MS);
    assert!(rate >= 50_000_000, "{rate}");
}

#[test]
fn md_speed_is_mds_marks_arithmetic() {
    let mut s = MdSpeed::new();
    assert_eq!(s.speed(0), 1024, "currspeed starts at +1 KiB/s");
    s.done = 10 << 20;
    // 2.5 s: (10 MiB) / (2 + 1) s + 1 KiB.
    assert_eq!(s.speed(2_500 * MS), (10 << 20) / 3 + 1024);
    let mut idle = MdIdle::default();
    idle.foreground(64 * 512);
    assert!(idle.is_idle(), "64 sectors is still idle");
    idle.foreground(512);
    assert!(!idle.is_idle());
    assert!(idle.is_idle(), "last_events moved");
}

#[test]
fn md_idle_threshold_is_per_member() {
    // md keeps 64 sectors per member disk: four members spread foreground over four
    // thresholds.
    let mut idle = MdIdle {
        members: 4,
        ..MdIdle::default()
    };
    idle.foreground(4 * 64 * 512);
    assert!(
        idle.is_idle(),
        "4 × 64 sectors over four members is still idle"
    );
    idle.foreground(512);
    assert!(!idle.is_idle());
    assert!(idle.is_idle(), "last_events moved");
}

#[test]
fn pacer_kinds_parse_and_build() {
    for k in [PacerKind::Ferroraid, PacerKind::MdMin, PacerKind::MdPending] {
        assert_eq!(k.name().parse::<PacerKind>(), Ok(k));
        let mut p = k.build(SpeedLimits::default(), 4, 0.15);
        // Nothing in flight, no foreground: every pacer admits at once.
        assert_eq!(p.admit(0, 64 << 10, 0), Admission::Now, "{}", k.name());
    }
    assert_eq!(PacerKind::default(), PacerKind::Ferroraid);
    let e = "fast".parse::<PacerKind>().unwrap_err();
    assert!(e.contains("md-pending"), "{e}");
}

#[test]
fn tolerance_from_percent_is_checked() {
    assert_eq!(FerroraidPacerConfig::tolerance_from_percent(15), Ok(0.15));
    assert_eq!(
        FerroraidPacerConfig::tolerance_from_percent(15),
        Ok(FerroraidPacerConfig::default().tolerance),
        "the default is a whole percentage"
    );
    assert_eq!(FerroraidPacerConfig::tolerance_from_percent(1000), Ok(10.0));
    for bad in [0, 1001, u64::MAX] {
        let e = FerroraidPacerConfig::tolerance_from_percent(bad).unwrap_err();
        assert!(e.contains("1 to 1000"), "{bad}: {e}");
    }
}

#[test]
fn speed_limits_from_kib_are_checked() {
    let l = SpeedLimits::from_kib_per_s(1000, 200_000).unwrap();
    assert_eq!(l, SpeedLimits::default(), "md's defaults");
    assert!(SpeedLimits::from_kib_per_s(0, 10).is_err(), "no floor");
    assert!(SpeedLimits::from_kib_per_s(10, 9).is_err(), "max below min");
    assert!(
        SpeedLimits::from_kib_per_s(1, u64::MAX).is_err(),
        "overflow"
    );
    assert_eq!(
        SpeedLimits::from_kib_per_s(5, 5).unwrap().speed_max,
        5 * 1024
    );
}

/// Each of n shards gets 1/n of the array's limits (rounded up: a floor never reaches
/// zero), so n reactors together honour what the operator set.
#[test]
fn speed_limits_are_shared_among_the_shards() {
    let l = SpeedLimits::from_kib_per_s(1000, 200_000).unwrap();
    assert_eq!(l.per_shard(1), l);
    assert_eq!(l.per_shard(0), l);
    let half = l.per_shard(2);
    assert_eq!(
        (half.speed_min, half.speed_max),
        (500 * 1024, 100_000 * 1024)
    );
    let tiny = SpeedLimits::from_kib_per_s(1, 1).unwrap().per_shard(3);
    assert_eq!((tiny.speed_min, tiny.speed_max), (342, 342));
    assert!(3 * tiny.speed_max >= 1024 && 3 * (tiny.speed_max - 1) < 1024);
}

/// Reads served from the stripe cache (`foreground_done_unmeasured`) are no samples: a
/// window of measured requests with as many cache hits beside them counts the measured
/// ones alone, and its median is theirs, while the hits still end the requests' time in
/// flight.
#[test]
fn ferroraid_takes_no_sample_from_requests_served_without_a_member() {
    let mut p = ferro(limits(10, 500));
    let window = FerroraidPacerConfig::default().window_ns;
    let (mut now, mut measured) = (0u64, 0u64);
    while p.windows() == 0 {
        p.foreground_submitted(now);
        p.foreground_submitted(now);
        now += 100_000;
        p.foreground_done(now, 100_000, 4096, true);
        measured += 1;
        p.foreground_done_unmeasured(now, 4096, true);
        assert!(now < 10 * window, "no window closed");
    }
    let w = p.last_window();
    assert_eq!(w.samples, measured, "{w:?}");
    assert!(w.p50_ns >= 90_000, "{w:?}");
}
