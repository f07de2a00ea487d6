//! Seed scenario of issue 5: foreground 4 KiB random reads on a RAID6 whose resync (or
//! rebuild) is running, with md's two throttle rules and ferroraid's pacer side by side.
//! Deterministic: simulated members in virtual time (`engine::sim`), one shard.
//!
//! ```text
//! cargo run --release -p bench --bin pacing-scenario -- [--plots docs]
//! ```
//!
//! Array: RAID6 of 4 members, 512 KiB chunk (mdadm's default), 4 GiB per member. Background:
//! a resync of the whole array (the members are zero, so parity is consistent and a resync
//! reads every chunk and writes nothing, as md's does), or a rebuild of member 3 (a blank
//! replacement: every chunk read from the three survivors, the fourth written). The shard
//! may keep 64 background stripe operations in flight (the engine's bound; md keeps up to
//! its stripe cache of them): how many it really does is the pacer's call.
//!
//! Foreground: 4 KiB random reads over the whole array, at queue depth 1 (one job) or 64
//! jobs × QD1 (a closed-loop job of 64 independent slots is the same thing).
//!
//! Pacers: md before 4.1 (`MdPre41Pacer`), md since 4.1 (`Md41Pacer`), ferroraid's
//! (`FerroraidPacer`), all with the same guard rails: md's default `speed_min` (1000 KiB/s
//! per member) and a `speed_max` that does not bind (10,000,000 KiB/s per member, as
//! users set `dev.raid.speed_limit_max` to let a resync run at device speed; md's default
//! of 200,000 KiB/s would cap the NVMe idle rate at 6 % of the device). Baselines:
//! foreground alone (no background process) and background alone (its idle rate).
//!
//! Profiles: `nvme-ssd` (32 parallel units, queue depth 1023) and `hdd-7200-ncq` (one head,
//! NCQ 32). Each run: a warm-up (0.3 s SSD, 2 s HDD), then the measured interval (0.7 s SSD,
//! 10 s HDD). Depth control (`engine::qos::depth`) is off in every run so the pacers are
//! compared alone (md has no such controller; `--depth ferroraid` runs ferroraid's pacer
//! with its depth controller too, as `ferroraid serve` does).
//!
//! Time series (SSD): foreground on 0–300 ms, off 300–500 ms, on 500–800 ms, off
//! 800–1000 ms, background running throughout. From 1 ms samples: background rate and
//! foreground IOPS per 10 ms window; **regained** = how long after foreground stops until
//! every 10 ms window of the next 100 ms has background at ≥ 90 % of its idle rate;
//! **protected** = how long after foreground resumes until every 10 ms window of the next
//! 100 ms has foreground at ≥ its target share of baseline IOPS (90 % QD1, 85 % 64 jobs).
//!
//! Output: Markdown tables on stdout (pasted into `docs/BENCHMARKS.md`), SVG plots of the
//! time series (`pacing-<process>-<load>-timeline.svg`), and an exit status of 1 when
//! ferroraid misses one of the issue's targets (the md rules are reported, not judged).

use anyhow::{Context, Result};
use bench::pacer_trace::TracedPacer;
use clap::Parser;
use engine::array::{Array, ArrayConfig};
use engine::device::BlockDevice;
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use engine::parity::Parity;
use engine::process::{ProcessKind, ProcessRequest, MAX_BACKGROUND_OPS};
use engine::qos::pacer::{
    FerroraidPacer, FerroraidPacerConfig, Md41Pacer, MdPre41Pacer, SpeedLimits, MD_SPEED_MIN,
};
use engine::qos::{DepthConfig, DepthPolicy, Pacer, Unpaced};
use engine::sim::workload::{run, Job, JobKind};
use engine::sim::{Profile, SimChannel, SimClock, SimDevice};
use hdrhistogram::Histogram;
use plotters::prelude::*;

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;
/// 4 GiB per member: more than the background moves in any run (a resync that finished
/// would stop competing).
/// Bytes per member.
const MEMBER_BYTES: u64 = 4 << 30;
const MEMBERS: u16 = 4;
/// The member being rebuilt.
const REBUILT: u16 = 3;
/// Time-series sampling, and the window rates are computed over.
const SAMPLE_NS: u64 = MS;
const WINDOW_NS: u64 = 10 * MS;
/// A recovery holds when every window of this span after it meets the threshold.
const HOLD_NS: u64 = 100 * MS;
/// Share of the idle rate that counts as "full speed" again.
const FULL_SPEED: f64 = 0.90;

#[derive(Parser, Debug)]
#[command(
    about = "issue-5 seed scenario: foreground reads vs. resync/rebuild under md's two throttle rules and ferroraid's pacer"
)]
struct Args {
    /// Directory for the SVG plots (none written if absent).
    #[arg(long)]
    plots: Option<std::path::PathBuf>,
    /// Seed of the readers' offsets.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// `speed_min`, KiB/s per member (md's sysctl unit; md's default 1000).
    #[arg(long, default_value_t = MD_SPEED_MIN / 1024)]
    speed_min_kib: u64,
    /// `speed_max`, KiB/s per member (default: high enough not to bind).
    #[arg(long, default_value_t = 10_000_000)]
    speed_max_kib: u64,
    /// Depth control in the ferroraid runs: off (pacer alone) or ferroraid.
    #[arg(long, default_value = "off", value_parser = ["off", "ferroraid"])]
    depth: String,
    /// Skip the time series (tables only).
    #[arg(long)]
    no_timeline: bool,
    /// Chunk size, KiB (every background stripe operation moves one chunk per member);
    /// default 64 on the SSD profile, 512 on the HDD profile (see the module docs).
    #[arg(long)]
    chunk_kib: Option<u64>,
    /// Only this profile (nvme-ssd or hdd-7200-ncq).
    #[arg(long)]
    profile: Option<String>,
    /// Log ferroraid's pacer on stderr: every control window's inputs and verdict and
    /// every probe undone at once, in every ferroraid run.
    #[arg(long)]
    trace: bool,
    /// ferroraid's pacer: foreground latency allowed over its quiet baseline, as a
    /// fraction (the pacer's default, `FerroraidPacerConfig::default().tolerance`); for
    /// experiments.
    #[arg(long, default_value_t = FerroraidPacerConfig::default().tolerance)]
    tolerance: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PacerKind {
    /// No background process (the foreground baseline) or no foreground (idle rate).
    Unpaced,
    MdPre41,
    Md41,
    Ferroraid,
}

impl PacerKind {
    fn name(self) -> &'static str {
        match self {
            PacerKind::Unpaced => "unpaced",
            PacerKind::MdPre41 => "md pre-4.1",
            PacerKind::Md41 => "md 4.1+",
            PacerKind::Ferroraid => "ferroraid",
        }
    }
}

const PACERS: [PacerKind; 3] = [PacerKind::MdPre41, PacerKind::Md41, PacerKind::Ferroraid];
const COLORS: [RGBColor; 3] = [
    RGBColor(200, 30, 30),
    RGBColor(30, 90, 200),
    RGBColor(20, 150, 60),
];

#[derive(Clone, Copy)]
struct Env {
    limits: SpeedLimits,
    ferro_depth: DepthPolicy,
    seed: u64,
    /// Chunk, bytes.
    chunk: u64,
    /// `--trace`.
    trace: bool,
    /// `--tolerance`.
    tolerance: f64,
}

/// One simulated run.
struct Spec<'a> {
    profile: &'a Profile,
    /// Background process (None: foreground alone).
    process: Option<ProcessKind>,
    /// Member `REBUILT` missing (the rebuild's foreground baseline: degraded, no rebuild).
    degraded: bool,
    pacer: PacerKind,
    /// Foreground jobs' depth (0: none).
    fg_depth: u32,
    /// Foreground on-intervals, ns.
    fg_on: &'a [(u64, u64)],
    end_ns: u64,
}

struct Outcome {
    /// Per foreground on-interval: its latency histogram and ops.
    fg: Vec<(Histogram<u64>, u64)>,
    /// (time ns, foreground ops so far, background bytes per member so far), every 1 ms.
    trace: Vec<(u64, u64, u64)>,
}

fn build(
    profile: &Profile,
    process: Option<ProcessKind>,
    depth: DepthPolicy,
    chunk: u64,
    degraded: bool,
) -> (Array<SimChannel>, SimClock) {
    let g =
        Geometry::new(Level::Raid6, Layout::LeftSymmetric, MEMBERS, chunk, 4096).expect("geometry");
    let geo = ArrayGeometry::new(g, MEMBER_BYTES / chunk).expect("geometry");
    let clock = SimClock::new();
    let chans = (0..MEMBERS)
        .map(|i| {
            SimDevice::new(
                &format!("m{i}"),
                MEMBER_BYTES,
                4096,
                profile.clone(),
                clock.clone(),
                u64::from(i),
            )
            .expect("sim device")
            .open_channel()
            .expect("channel")
        })
        .collect();
    let cfg = ArrayConfig {
        requests: 256,
        stripe_ops: 32,
        background_ops: MAX_BACKGROUND_OPS,
        failed_members: [degraded.then_some(REBUILT), None],
        rebuilding: if process == Some(ProcessKind::Rebuild) {
            [Some((REBUILT, 0)), None]
        } else {
            [None, None]
        },
        depth: DepthConfig {
            policy: depth,
            target_latency_ns: None,
            rotational: matches!(profile.seek, engine::sim::Seek::Disk { .. }),
        },
        ..ArrayConfig::default()
    };
    (
        Array::new(geo, chans, Parity::new(), cfg).expect("array"),
        clock,
    )
}

fn simulate(env: &Env, spec: &Spec) -> Outcome {
    let depth = if spec.pacer == PacerKind::Ferroraid {
        env.ferro_depth
    } else {
        DepthPolicy::Off
    };
    let (mut arr, clock) = build(spec.profile, spec.process, depth, env.chunk, spec.degraded);
    let pacer: Box<dyn Pacer> = match spec.pacer {
        PacerKind::Unpaced => Box::new(Unpaced),
        PacerKind::MdPre41 => Box::new(MdPre41Pacer::new(env.limits).with_members(MEMBERS)),
        PacerKind::Md41 => Box::new(Md41Pacer::new(env.limits).with_members(MEMBERS)),
        PacerKind::Ferroraid => {
            let p = FerroraidPacer::new(FerroraidPacerConfig {
                limits: env.limits,
                tolerance: env.tolerance,
                ..FerroraidPacerConfig::default()
            });
            if env.trace {
                let label = format!(
                    "{} {} fg depth {} on {:?} ms",
                    spec.profile.name,
                    spec.process.map_or("none", |k| k.name()),
                    spec.fg_depth,
                    spec.fg_on
                        .iter()
                        .map(|&(a, b)| (a / MS, b / MS))
                        .collect::<Vec<_>>()
                );
                Box::new(TracedPacer::new(p, &label))
            } else {
                Box::new(p)
            }
        }
    };
    arr.set_pacer(pacer);
    if let Some(kind) = spec.process {
        let req = if kind == ProcessKind::Rebuild {
            arr.pending_rebuild().expect("member 3 is being rebuilt")
        } else {
            ProcessRequest::whole(kind)
        };
        arr.start_process(&req).expect("process starts");
    }
    let jobs: Vec<Job> = if spec.fg_depth == 0 {
        Vec::new()
    } else {
        spec.fg_on
            .iter()
            .map(|&(start_ns, stop_ns)| Job {
                kind: JobKind::RandRead,
                block_bytes: 4096,
                depth: spec.fg_depth,
                start_ns,
                stop_ns,
                offset_bytes: 0,
                span_bytes: 0,
                submit_gap_ns: 0,
            })
            .collect()
    };
    let mut trace = Vec::with_capacity((spec.end_ns / SAMPLE_NS) as usize + 2);
    trace.push((0, 0, 0));
    let st = run(
        &mut arr,
        &clock,
        &jobs,
        spec.end_ns,
        env.seed,
        SAMPLE_NS,
        |now, a, s| {
            if now > spec.end_ns {
                return;
            }
            let ops = s.iter().map(|j| j.ops).sum();
            let bg = a
                .process_progress()
                .map_or(0, |p| p.done_stripes * env.chunk);
            trace.push((now, ops, bg));
        },
    );
    let errors: u64 = st.iter().map(|s| s.errors).sum();
    assert_eq!(errors, 0, "the scenario must not fail I/O");
    if let Some(p) = arr.process_progress() {
        assert!(
            p.done_stripes < p.total_stripes,
            "the background process must still be running at the end ({} of {} stripes)",
            p.done_stripes,
            p.total_stripes
        );
    }
    Outcome {
        fg: st.into_iter().map(|j| (j.latency, j.ops)).collect(),
        trace,
    }
}

/// A cumulative counter of the trace.
#[derive(Clone, Copy, Debug)]
enum Counter {
    /// Foreground requests completed.
    FgOps,
    /// Background bytes per member done.
    BgBytes,
}

/// Counter `c` of the trace at time `t` ns (the last sample at or before it).
fn at(trace: &[(u64, u64, u64)], t: u64, c: Counter) -> u64 {
    let i = trace.partition_point(|s| s.0 <= t).saturating_sub(1);
    let s = trace[i];
    match c {
        Counter::FgOps => s.1,
        Counter::BgBytes => s.2,
    }
}

/// Rate of counter `c` over `[a, b)` ns, per second.
fn rate(trace: &[(u64, u64, u64)], a: u64, b: u64, c: Counter) -> f64 {
    (at(trace, b, c) - at(trace, a, c)) as f64 / ((b - a) as f64 / S as f64)
}

/// Time after `event` (ns) until every window of the `HOLD_NS` after has counter `c`'s
/// rate at or above `threshold` (per second), ns; `None` if that never happens before
/// `limit`.
fn recovery(
    trace: &[(u64, u64, u64)],
    event: u64,
    limit: u64,
    c: Counter,
    threshold: f64,
) -> Option<u64> {
    let mut t = event;
    while t + HOLD_NS <= limit {
        let ok = (0..HOLD_NS / WINDOW_NS).all(|w| {
            let a = t + w * WINDOW_NS;
            rate(trace, a, a + WINDOW_NS, c) >= threshold
        });
        if ok {
            return Some(t - event);
        }
        t += SAMPLE_NS;
    }
    None
}

/// Timing of a profile's table runs.
struct Timing {
    warm_ns: u64,
    measure_ns: u64,
    /// Bins for the lowest background rate (the floor check), ns.
    floor_bin_ns: u64,
}

fn timing(profile: &Profile) -> Timing {
    if matches!(profile.seek, engine::sim::Seek::Disk { .. }) {
        Timing {
            warm_ns: 2 * S,
            measure_ns: 10 * S,
            floor_bin_ns: S,
        }
    } else {
        Timing {
            warm_ns: 300 * MS,
            measure_ns: 700 * MS,
            floor_bin_ns: 100 * MS,
        }
    }
}

/// What a table run measured over its measured interval.
struct Row {
    fg_iops: f64,
    fg_p99_us: f64,
    bg_mb_s: f64,
    /// Lowest background rate over `floor_bin_ns` bins, MB/s per member.
    bg_min_mb_s: f64,
}

fn table_run(
    env: &Env,
    profile: &Profile,
    process: Option<ProcessKind>,
    degraded: bool,
    pacer: PacerKind,
    fg_depth: u32,
) -> Row {
    let t = timing(profile);
    let end = t.warm_ns + t.measure_ns;
    let on = [(0, t.warm_ns), (t.warm_ns, end)];
    let o = simulate(
        env,
        &Spec {
            profile,
            process,
            degraded,
            pacer,
            fg_depth,
            fg_on: &on,
            end_ns: end,
        },
    );
    let secs = t.measure_ns as f64 / S as f64;
    let (fg_iops, fg_p99_us) = match o.fg.get(1) {
        Some((h, ops)) if *ops > 0 => (*ops as f64 / secs, h.value_at_quantile(0.99) as f64 / 1e3),
        _ => (0.0, 0.0),
    };
    let bg_mb_s = rate(&o.trace, t.warm_ns, end, Counter::BgBytes) / 1e6;
    let bins = t.measure_ns / t.floor_bin_ns;
    let bg_min_mb_s = (0..bins)
        .map(|i| {
            let a = t.warm_ns + i * t.floor_bin_ns;
            rate(&o.trace, a, a + t.floor_bin_ns, Counter::BgBytes) / 1e6
        })
        .fold(f64::INFINITY, f64::min);
    Row {
        fg_iops,
        fg_p99_us,
        bg_mb_s,
        bg_min_mb_s,
    }
}

/// The foreground share of baseline the issue asks for at `fg_depth`, SSD.
fn fg_target(profile: &Profile, fg_depth: u32) -> f64 {
    if is_hdd(profile) {
        0.85
    } else if fg_depth == 1 {
        0.90
    } else {
        0.85
    }
}

fn is_hdd(profile: &Profile) -> bool {
    matches!(profile.seek, engine::sim::Seek::Disk { .. })
}

/// The background share of its idle rate the issue asks for (SSD; HDD: the floor).
fn bg_target(fg_depth: u32) -> f64 {
    if fg_depth == 1 {
        0.50
    } else {
        0.30
    }
}

fn load_name(fg_depth: u32) -> String {
    if fg_depth == 1 {
        "QD1 (1 job)".into()
    } else {
        format!("{fg_depth} jobs × QD1")
    }
}

/// A time-series run.
struct Series {
    pacer: PacerKind,
    /// (time s, background MB/s per member, foreground IOPS) per 10 ms window.
    points: Vec<(f64, f64, f64)>,
    regained_ms: Vec<Option<f64>>,
    protected_ms: Vec<Option<f64>>,
}

const TS_ON: [(u64, u64); 2] = [(0, 300 * MS), (500 * MS, 800 * MS)];
const TS_END: u64 = 1000 * MS;

fn timeline(
    env: &Env,
    profile: &Profile,
    process: ProcessKind,
    pacer: PacerKind,
    fg_depth: u32,
    idle_b_s: f64,
    base_iops: f64,
) -> Series {
    let o = simulate(
        env,
        &Spec {
            profile,
            process: Some(process),
            degraded: false,
            pacer,
            fg_depth,
            fg_on: &TS_ON,
            end_ns: TS_END,
        },
    );
    let points = (0..TS_END / WINDOW_NS)
        .map(|i| {
            let a = i * WINDOW_NS;
            let b = a + WINDOW_NS;
            (
                b as f64 / S as f64,
                rate(&o.trace, a, b, Counter::BgBytes) / 1e6,
                rate(&o.trace, a, b, Counter::FgOps),
            )
        })
        .collect();
    let regained_ms = [TS_ON[0].1, TS_ON[1].1]
        .iter()
        .zip([TS_ON[1].0, TS_END])
        .map(|(&stop, limit)| {
            recovery(
                &o.trace,
                stop,
                limit,
                Counter::BgBytes,
                FULL_SPEED * idle_b_s,
            )
            .map(|d| d as f64 / 1e6)
        })
        .collect();
    let protected_ms = [TS_ON[1]]
        .iter()
        .map(|&(start, stop)| {
            recovery(
                &o.trace,
                start,
                stop,
                Counter::FgOps,
                fg_target(profile, fg_depth) * base_iops,
            )
            .map(|d| d as f64 / 1e6)
        })
        .collect();
    Series {
        pacer,
        points,
        regained_ms,
        protected_ms,
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or("never".into(), |v| format!("{v:.0} ms"))
}

fn plot(
    path: &std::path::Path,
    title: &str,
    series: &[Series],
    idle_mb_s: f64,
    base_iops: f64,
) -> Result<()> {
    let root = SVGBackend::new(path, (900, 620)).into_drawing_area();
    root.fill(&WHITE)?;
    let (upper, lower) = root.split_vertically(310);
    let end = TS_END as f64 / S as f64;
    let bg_top = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(idle_mb_s, f64::max)
        * 1.1;
    let fg_top = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.2))
        .fold(base_iops, f64::max)
        * 1.1;
    let mut c1 = ChartBuilder::on(&upper)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..end, 0.0..bg_top)?;
    c1.configure_mesh()
        .y_desc("background MB/s per member")
        .draw()?;
    let mut c2 = ChartBuilder::on(&lower)
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..end, 0.0..fg_top)?;
    c2.configure_mesh()
        .x_desc("virtual time, s (foreground on 0–0.3 s and 0.5–0.8 s; 10 ms windows)")
        .y_desc("foreground IOPS")
        .draw()?;
    c1.draw_series(LineSeries::new(
        [(0.0, idle_mb_s), (end, idle_mb_s)],
        BLACK.stroke_width(1),
    ))?
    .label("idle rate")
    .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK));
    c2.draw_series(LineSeries::new(
        [(0.0, base_iops), (end, base_iops)],
        BLACK.stroke_width(1),
    ))?
    .label("baseline (no background)")
    .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK));
    for (k, s) in series.iter().enumerate() {
        let c = COLORS[k % COLORS.len()];
        c1.draw_series(LineSeries::new(
            s.points.iter().map(|p| (p.0, p.1)),
            c.stroke_width(2),
        ))?
        .label(s.pacer.name())
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], c));
        c2.draw_series(LineSeries::new(
            s.points.iter().map(|p| (p.0, p.2)),
            c.stroke_width(2),
        ))?
        .label(s.pacer.name())
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], c));
    }
    for c in [&mut c1, &mut c2] {
        c.configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.tolerance.is_finite() && args.tolerance >= 0.0,
        "--tolerance is a fraction of the quiet latency, 0 or more (got {})",
        args.tolerance
    );
    let env = Env {
        limits: SpeedLimits {
            speed_min: args.speed_min_kib.saturating_mul(1024),
            speed_max: args
                .speed_max_kib
                .saturating_mul(1024)
                .max(args.speed_min_kib.saturating_mul(1024)),
        },
        ferro_depth: if args.depth == "ferroraid" {
            DepthPolicy::Ferroraid
        } else {
            DepthPolicy::Off
        },
        seed: args.seed,
        chunk: 0,
        trace: args.trace,
        tolerance: args.tolerance,
    };
    let speed_min_mb = env.limits.speed_min as f64 / 1e6;
    let speed_min = env.limits.speed_min;
    let mut misses: Vec<String> = Vec::new();
    let profiles = [Profile::nvme_ssd(), Profile::hdd_7200(true)];
    for profile in profiles
        .iter()
        .filter(|p| args.profile.as_deref().is_none_or(|n| n == p.name))
    {
        let hdd = is_hdd(profile);
        let t = timing(profile);
        let env = Env {
            chunk: args.chunk_kib.unwrap_or(if hdd { 512 } else { 64 }) << 10,
            ..env
        };
        let env = &env;
        for process in [ProcessKind::Resync, ProcessKind::Rebuild] {
            let idle = table_run(env, profile, Some(process), false, PacerKind::Unpaced, 0);
            println!(
                "\n### {} — {}: idle rate {:.1} MB/s per member; measured over {} s after {} s warm-up\n",
                profile.name,
                process.name(),
                idle.bg_mb_s,
                t.measure_ns as f64 / S as f64,
                t.warm_ns as f64 / S as f64
            );
            println!(
                "| foreground | pacer | fg IOPS | vs baseline | fg p99 µs | {} MB/s | vs idle | lowest per {} ms | target |\n|---|---|---|---|---|---|---|---|---|",
                process.name(),
                t.floor_bin_ns / MS
            );
            for fg_depth in [1u32, 64] {
                let base = table_run(
                    env,
                    profile,
                    None,
                    process == ProcessKind::Rebuild,
                    PacerKind::Unpaced,
                    fg_depth,
                );
                println!(
                    "| {} | baseline ({}) | {:.0} | 100% | {:.0} | | | | |",
                    load_name(fg_depth),
                    if process == ProcessKind::Rebuild {
                        "member 3 missing, no rebuild".to_string()
                    } else {
                        format!("no {}", process.name())
                    },
                    base.fg_iops,
                    base.fg_p99_us
                );
                for pacer in PACERS {
                    let r = table_run(env, profile, Some(process), false, pacer, fg_depth);
                    let fg_share = r.fg_iops / base.fg_iops;
                    let bg_share = r.bg_mb_s / idle.bg_mb_s;
                    let target = if pacer != PacerKind::Ferroraid {
                        String::new()
                    } else if hdd && fg_depth != 1 {
                        "(the issue sets HDD targets for QD1)".to_string()
                    } else if hdd {
                        // Never below the floor, to within one stripe operation per bin.
                        let floor_mb_s = (speed_min as f64 * (t.floor_bin_ns as f64 / S as f64)
                            - env.chunk as f64)
                            / (t.floor_bin_ns as f64 / S as f64)
                            / 1e6;
                        let ok =
                            fg_share >= fg_target(profile, fg_depth) && r.bg_min_mb_s >= floor_mb_s;
                        let t = format!(
                            "fg ≥ {:.0}%, {} ≥ speed_min ({:.2} MB/s): {}",
                            100.0 * fg_target(profile, fg_depth),
                            process.name(),
                            speed_min_mb,
                            if ok { "met" } else { "MISSED" }
                        );
                        if !ok {
                            misses.push(format!(
                                "{} {} {}: {t}",
                                profile.name,
                                process.name(),
                                load_name(fg_depth)
                            ));
                        }
                        t
                    } else {
                        let ok = fg_share >= fg_target(profile, fg_depth)
                            && bg_share >= bg_target(fg_depth);
                        let t = format!(
                            "fg ≥ {:.0}%, {} ≥ {:.0}%: {}",
                            100.0 * fg_target(profile, fg_depth),
                            process.name(),
                            100.0 * bg_target(fg_depth),
                            if ok { "met" } else { "MISSED" }
                        );
                        if !ok {
                            misses.push(format!(
                                "{} {} {}: {t}",
                                profile.name,
                                process.name(),
                                load_name(fg_depth)
                            ));
                        }
                        t
                    };
                    println!(
                        "| {} | {} | {:.0} | {:.1}% | {:.0} | {:.1} | {:.1}% | {:.2} | {} |",
                        load_name(fg_depth),
                        pacer.name(),
                        r.fg_iops,
                        100.0 * fg_share,
                        r.fg_p99_us,
                        r.bg_mb_s,
                        100.0 * bg_share,
                        r.bg_min_mb_s,
                        target
                    );
                }
            }
            if hdd || args.no_timeline {
                continue;
            }
            for fg_depth in [1u32, 64] {
                // Baseline IOPS over the same on-interval length as the series' windows.
                let base = table_run(
                    env,
                    profile,
                    None,
                    process == ProcessKind::Rebuild,
                    PacerKind::Unpaced,
                    fg_depth,
                );
                let series: Vec<Series> = PACERS
                    .iter()
                    .map(|&p| {
                        timeline(
                            env,
                            profile,
                            process,
                            p,
                            fg_depth,
                            idle.bg_mb_s * 1e6,
                            base.fg_iops,
                        )
                    })
                    .collect();
                println!(
                    "\n#### {} — {}, {}: foreground on 0–300 ms and 500–800 ms\n",
                    profile.name,
                    process.name(),
                    load_name(fg_depth)
                );
                println!("| pacer | full speed after fg stops (300 ms) | (800 ms) | protected after fg resumes (500 ms) |\n|---|---|---|---|");
                for s in &series {
                    println!(
                        "| {} | {} | {} | {} |",
                        s.pacer.name(),
                        ms(s.regained_ms[0]),
                        ms(s.regained_ms[1]),
                        ms(s.protected_ms[0])
                    );
                    if s.pacer == PacerKind::Ferroraid {
                        let bad = s
                            .regained_ms
                            .iter()
                            .chain(&s.protected_ms)
                            .any(|v| v.is_none_or(|v| v > 50.0));
                        if bad {
                            misses.push(format!(
                                "{} {} {}: recovery over 50 ms (regained {:?}, protected {:?})",
                                profile.name,
                                process.name(),
                                load_name(fg_depth),
                                s.regained_ms,
                                s.protected_ms
                            ));
                        }
                    }
                }
                if let Some(dir) = &args.plots {
                    std::fs::create_dir_all(dir)
                        .with_context(|| format!("creating {}", dir.display()))?;
                    let load = if fg_depth == 1 {
                        "qd1".to_string()
                    } else {
                        format!("{fg_depth}jobs")
                    };
                    let p = dir.join(format!("pacing-{}-{}-timeline.svg", process.name(), load));
                    plot(
                        &p,
                        &format!(
                            "{}: {} under {}, foreground on/off",
                            profile.name,
                            process.name(),
                            load_name(fg_depth)
                        ),
                        &series,
                        idle.bg_mb_s,
                        base.fg_iops,
                    )?;
                    eprintln!("wrote {}", p.display());
                }
            }
        }
    }
    if misses.is_empty() {
        println!("\nferroraid's pacer met every target of issue 5.");
        Ok(())
    } else {
        println!("\nferroraid's pacer missed:");
        for m in &misses {
            println!("- {m}");
        }
        std::process::exit(1);
    }
}
