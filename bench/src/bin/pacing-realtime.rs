//! Real-time variant of issue 5's seed scenario (`pacing-scenario` is the deterministic
//! one): a RAID6 of 4 `mem` members (RAM, `drivers::mem`) behind an injected latency model,
//! driven on the wall clock by one busy-polling loop (as one polled reactor runs a shard),
//! a resync running, a QD1 reader of random 4 KiB blocks, and the three pacers side by
//! side. What virtual time leaves out is in here: the CPU time of parity, copies and the
//! engine itself, the host's scheduling noise, and the pacers' reaction to real timer
//! granularity.
//!
//! ```text
//! cargo run --release -p bench --bin pacing-realtime -- [--seconds 1] [--repeat 3] [--pacers ferroraid] [--trace]
//! ```
//!
//! Latency model ([`Delayed`]): the members move their data at once (RAM); each request's
//! completion is held back until the time the profile gives it: `Profile::sata_ssd_cached`
//! read timing (100 µs + transfer at 137.5 MB/s per unit, 4 parallel units, queue depth 32;
//! the earliest-free unit serves each request, as `engine::sim` does). The SATA-SSD model
//! (≈ 550 MB/s per member) keeps the resync's parity work within one core here; the NVMe
//! model of the deterministic scenario (≈ 3 GB/s per member) would make the CPU, not the
//! model, the bottleneck. Members: 1 GiB each (4 GiB of RAM, touched at start), 64 KiB
//! chunk. Each run: `--warmup-ms` (300) then `--seconds` measured, wall clock.
//!
//! A machine shared with other work moves the reader's IOPS from run to run, so every
//! repetition (`--repeat`) measures the idle rate (resync alone), then a baseline (reader
//! alone) before and after each pacer's run: a pacer's reader is compared with the mean
//! of the two baselines around it. Every repetition is printed, then the median of the
//! repetitions' shares per pacer.
//!
//! **Checked target** (issue 5, SSD, QD1; ferroraid's pacer): the median over the
//! repetitions of (reader IOPS / mean of its two baselines) ≥ 90 % and the median of
//! (resync MB/s / the repetition's idle rate) ≥ 50 %. The program exits with status 1
//! when either median misses (status 0 otherwise, also when ferroraid is not among
//! `--pacers`).

use std::time::Instant;

use anyhow::{bail, Result};
use bench::median;
use bench::pacer_trace::TracedPacer;
use clap::Parser;
use drivers::mem::{MemChannel, MemDevice};
use engine::array::{
    new_latency_histogram, Array, ArrayCompletion, ArrayConfig, ArrayOp, ArrayRequest,
};
use engine::buf::AlignedBuf;
use engine::device::{
    BlockDevice, Channel, Completion, DeviceInfo, IoBuf, Op, Request, SubmitError,
};
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use engine::parity::Parity;
use engine::process::{ProcessKind, ProcessRequest, MAX_BACKGROUND_OPS};
use engine::qos::pacer::{FerroraidPacer, FerroraidPacerConfig, PacerKind, SpeedLimits};
use engine::qos::{DepthConfig, DepthPolicy, Pacer, Unpaced};
use engine::sim::Profile;
use hdrhistogram::Histogram;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;
const MEMBERS: u16 = 4;
const MEMBER_BYTES: u64 = 1 << 30;
const CHUNK: u64 = 64 << 10;

#[derive(Parser, Debug)]
#[command(
    about = "issue-5 seed scenario in real time: mem members behind a latency model, QD1 reader vs resync, three pacers"
)]
struct Args {
    /// Measured seconds per run (after the warm-up).
    #[arg(long, default_value_t = 1)]
    seconds: u64,
    /// Warm-up before the measured interval, ms.
    #[arg(long, default_value_t = 300)]
    warmup_ms: u64,
    /// Repetitions of the whole set of runs.
    #[arg(long, default_value_t = 3)]
    repeat: u32,
    /// `speed_min`, KiB/s per member.
    #[arg(long, default_value_t = 1000)]
    speed_min_kib: u64,
    /// `speed_max`, KiB/s per member (default: does not bind).
    #[arg(long, default_value_t = 10_000_000)]
    speed_max_kib: u64,
    /// Pacers to run beside the baselines, comma-separated (md-min, md-pending,
    /// ferroraid).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "md-min,md-pending,ferroraid"
    )]
    pacers: Vec<PacerKind>,
    /// Seed of the reader's offsets.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// ferroraid's pacer: foreground latency allowed over its quiet baseline, as a
    /// fraction (the pacer's default, `FerroraidPacerConfig::default().tolerance`); for
    /// experiments.
    #[arg(long, default_value_t = FerroraidPacerConfig::default().tolerance)]
    tolerance: f64,
    /// Log ferroraid's pacer on stderr: every control window's inputs and verdict (samples,
    /// slow ones, p50/p99/max, baseline, allowance, rate and depth after it) and every probe
    /// undone at once.
    #[arg(long)]
    trace: bool,
}

/// Nanoseconds since `epoch`.
fn ns_since(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// A `mem` channel whose completions are held back until the latency model says the
/// request is done. Preallocated for the queue depth: nothing allocates per request.
struct Delayed {
    inner: MemChannel,
    info: DeviceInfo,
    epoch: Instant,
    profile: Profile,
    /// Busy-until time of each parallel unit, ns since `epoch`.
    units: Vec<u64>,
    /// Completions waiting for their time (ns since `epoch`).
    held: Vec<(u64, Completion)>,
}

impl Delayed {
    fn new(dev: &MemDevice, profile: &Profile, epoch: Instant) -> Result<Self> {
        let inner = dev.open_channel()?;
        let mut info = inner.info().clone();
        info.queue_depth = info.queue_depth.min(profile.queue_depth);
        Ok(Self {
            inner,
            epoch,
            units: vec![0; profile.parallelism.max(1) as usize],
            held: Vec::with_capacity(info.queue_depth as usize),
            info,
            profile: profile.clone(),
        })
    }

    /// Service time of `req` on one unit, ns: fixed latency plus transfer.
    fn service_ns(&self, req: &Request) -> u64 {
        let p = &self.profile;
        let (lat, bw) = match req.op {
            Op::Read => (p.read_latency_ns, p.read_bytes_per_s),
            Op::Flush => return 0,
            _ => (p.write_latency_ns, p.write_bytes_per_s),
        };
        let xfer = u128::from(req.len_bytes) * u128::from(S) / u128::from(bw.max(1));
        lat + u64::try_from(xfer).unwrap_or(u64::MAX)
    }
}

impl Channel for Delayed {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
        if self.held.len() >= self.info.queue_depth as usize {
            return Err(SubmitError::QueueFull);
        }
        let service = self.service_ns(&req);
        let tag = req.tag;
        // The data moves now (RAM: inside `submit`, or for a read at the `poll` below);
        // only the completion waits.
        self.inner.submit(req)?;
        let mut c = [Completion {
            tag: 0,
            status: Ok(()),
        }];
        let n = self.inner.poll(&mut c);
        assert!(n == 1 && c[0].tag == tag, "mem completes by its next poll");
        let now = ns_since(self.epoch);
        let (i, free) = self
            .units
            .iter()
            .copied()
            .enumerate()
            .min_by_key(|&(_, t)| t)
            .expect("at least one unit");
        let done = free.max(now) + service;
        self.units[i] = done;
        self.held.push((done, c[0]));
        Ok(())
    }

    fn kick(&mut self) {}

    fn poll(&mut self, out: &mut [Completion]) -> usize {
        let now = ns_since(self.epoch);
        let mut n = 0;
        let mut i = 0;
        while i < self.held.len() && n < out.len() {
            if self.held[i].0 <= now {
                out[n] = self.held.swap_remove(i).1;
                n += 1;
            } else {
                i += 1;
            }
        }
        n
    }

    fn in_flight(&self) -> usize {
        self.held.len()
    }
}

/// What one run measured over its measured interval.
struct Row {
    fg_iops: f64,
    fg_p99_us: f64,
    bg_mb_s: f64,
}

/// One run: `pacer` (None: no resync), a QD1 reader when `reader`.
fn run_once(
    devs: &[MemDevice],
    args: &Args,
    limits: SpeedLimits,
    pacer: Option<PacerKind>,
    reader: bool,
) -> Result<Row> {
    let profile = Profile::sata_ssd_cached();
    let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, MEMBERS, CHUNK, 4096)?;
    let geo = ArrayGeometry::new(g, MEMBER_BYTES / CHUNK)?;
    let epoch = Instant::now();
    let chans = devs
        .iter()
        .map(|d| Delayed::new(d, &profile, epoch))
        .collect::<Result<Vec<_>>>()?;
    let cfg = ArrayConfig {
        requests: 64,
        stripe_ops: 16,
        background_ops: MAX_BACKGROUND_OPS,
        depth: DepthConfig {
            policy: DepthPolicy::Off,
            target_latency_ns: None,
            rotational: false,
        },
        ..ArrayConfig::default()
    };
    let mut arr = Array::new(geo, chans, Parity::new(), cfg)?;
    let p: Box<dyn Pacer> = match pacer {
        Some(PacerKind::Ferroraid) => {
            let inner = FerroraidPacer::new(FerroraidPacerConfig {
                limits,
                tolerance: args.tolerance,
                ..FerroraidPacerConfig::default()
            });
            if args.trace && reader {
                Box::new(TracedPacer::new(inner, "ferroraid pacer, QD1 reader"))
            } else {
                Box::new(inner)
            }
        }
        Some(k) => k.build(limits, MEMBERS, args.tolerance),
        None => Box::new(Unpaced),
    };
    arr.set_pacer(p);
    arr.set_now(ns_since(epoch));
    if pacer.is_some() {
        arr.start_process(&ProcessRequest::whole(ProcessKind::Resync))?;
    }
    let warm = args.warmup_ms * MS;
    let end = warm + args.seconds * S;
    let capacity = geo.capacity_bytes();
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut buf = AlignedBuf::zeroed(4096);
    let mut busy = false;
    let mut issued_at = 0u64;
    let mut lat: Histogram<u64> = new_latency_histogram();
    let mut ops = 0u64;
    let mut bg_at_warm = None;
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 16];
    loop {
        let now = ns_since(epoch);
        arr.set_now(now);
        if bg_at_warm.is_none() && now >= warm {
            bg_at_warm = Some(arr.process_progress().map_or(0, |p| p.done_stripes));
        }
        if now >= end {
            break;
        }
        if reader && !busy {
            let off = rng.next_u64() % (capacity / 4096) * 4096;
            // SAFETY: `buf` outlives the request (the loop drains it before returning) and
            // is not touched while it is outstanding (`busy`).
            let io = unsafe { IoBuf::from_slice(&mut buf) };
            arr.submit(ArrayRequest {
                tag: 1,
                op: ArrayOp::Read,
                offset_bytes: off,
                len_bytes: 4096,
                buf: io,
            })?;
            busy = true;
            issued_at = now;
        }
        arr.process();
        let n = arr.poll(&mut out);
        for c in &out[..n] {
            if let Err(e) = c.status {
                bail!("read failed: {e}");
            }
            busy = false;
            if issued_at >= warm {
                let done = ns_since(epoch);
                lat.saturating_record(done.saturating_sub(issued_at).max(1));
                ops += 1;
            }
        }
    }
    let bg_end = arr.process_progress().map_or(0, |p| p.done_stripes);
    if let Some(p) = arr.process_progress() {
        if p.done_stripes >= p.total_stripes {
            bail!("the resync finished inside the run: make --seconds shorter");
        }
    }
    // Drain what is outstanding (the reader's request, background operations).
    arr.stop_process();
    while busy || arr.background_busy() {
        arr.set_now(ns_since(epoch));
        arr.process();
        let n = arr.poll(&mut out);
        if n > 0 {
            busy = false;
        }
    }
    let secs = (args.seconds * S) as f64 / S as f64;
    Ok(Row {
        fg_iops: ops as f64 / secs,
        fg_p99_us: if lat.is_empty() {
            0.0
        } else {
            lat.value_at_quantile(0.99) as f64 / 1e3
        },
        bg_mb_s: (bg_end - bg_at_warm.unwrap_or(0)) as f64 * CHUNK as f64 / secs / 1e6,
    })
}

/// Issue 5's SSD QD1 targets for ferroraid's pacer: the reader keeps this share of its
/// baseline IOPS ...
const FG_TARGET: f64 = 0.90;
/// ... while the resync keeps this share of its idle rate.
const BG_TARGET: f64 = 0.50;

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.tolerance.is_finite() && args.tolerance >= 0.0,
        "--tolerance is a fraction of the quiet latency, 0 or more (got {})",
        args.tolerance
    );
    let limits = SpeedLimits::from_kib_per_s(args.speed_min_kib, args.speed_max_kib)
        .map_err(anyhow::Error::msg)?;
    let devs = (0..MEMBERS)
        .map(|i| MemDevice::new(&format!("m{i}"), MEMBER_BYTES, 4096, 256))
        .collect::<Result<Vec<_>, _>>()?;
    println!(
        "\n### real time, mem members behind the sata-ssd-cached read model — resync, QD1 reader ({} s measured after {} ms)\n",
        args.seconds, args.warmup_ms
    );
    println!("| run | pacer | fg IOPS | vs baseline | fg p99 µs | resync MB/s | vs idle | target |\n|---|---|---|---|---|---|---|---|");
    // Per pacer: (fg share, bg share) of every repetition.
    let mut shares: Vec<Vec<(f64, f64)>> = vec![Vec::new(); args.pacers.len()];
    for rep in 1..=args.repeat {
        let idle = run_once(&devs, &args, limits, Some(PacerKind::Ferroraid), false)?;
        println!(
            "| {rep} | idle rate (no reader, ferroraid) | | | | {:.1} | 100% | |",
            idle.bg_mb_s
        );
        // Every pacer run sits between two baseline runs; its baseline is their mean (the
        // host's load drifts between runs).
        let mut before = run_once(&devs, &args, limits, None, true)?;
        println!(
            "| {rep} | baseline (no resync) | {:.0} | 100% | {:.0} | | | |",
            before.fg_iops, before.fg_p99_us
        );
        for (i, &k) in args.pacers.iter().enumerate() {
            let r = run_once(&devs, &args, limits, Some(k), true)?;
            let after = run_once(&devs, &args, limits, None, true)?;
            let base = (before.fg_iops + after.fg_iops) / 2.0;
            let (fg, bg) = (r.fg_iops / base, r.bg_mb_s / idle.bg_mb_s);
            shares[i].push((fg, bg));
            let target = if k == PacerKind::Ferroraid {
                verdict(fg, bg)
            } else {
                String::new()
            };
            println!(
                "| {rep} | {} | {:.0} | {:.1}% | {:.0} | {:.1} | {:.1}% | {target} |",
                k.name(),
                r.fg_iops,
                100.0 * fg,
                r.fg_p99_us,
                r.bg_mb_s,
                100.0 * bg,
            );
            println!(
                "| {rep} | baseline (no resync) | {:.0} | 100% | {:.0} | | | |",
                after.fg_iops, after.fg_p99_us
            );
            before = after;
        }
    }
    println!(
        "\n| pacer | median fg vs baseline | median resync vs idle | target |\n|---|---|---|---|"
    );
    let mut missed = false;
    for (i, &k) in args.pacers.iter().enumerate() {
        let fg = median(&mut shares[i].iter().map(|s| s.0).collect::<Vec<_>>());
        let bg = median(&mut shares[i].iter().map(|s| s.1).collect::<Vec<_>>());
        let target = if k == PacerKind::Ferroraid {
            missed |= fg < FG_TARGET || bg < BG_TARGET;
            verdict(fg, bg)
        } else {
            String::new()
        };
        println!(
            "| {} | {:.1}% | {:.1}% | {target} |",
            k.name(),
            100.0 * fg,
            100.0 * bg
        );
    }
    if missed {
        println!("\nferroraid's pacer missed its target (median over the repetitions).");
        std::process::exit(1);
    }
    Ok(())
}

/// The target column: issue 5's SSD QD1 target for these shares.
fn verdict(fg: f64, bg: f64) -> String {
    format!(
        "fg ≥ {:.0}%, resync ≥ {:.0}%: {}",
        100.0 * FG_TARGET,
        100.0 * BG_TARGET,
        if fg >= FG_TARGET && bg >= BG_TARGET {
            "met"
        } else {
            "MISSED"
        }
    )
}
