//! Seed scenario of issue 6: a heavy sequential writer and a QD1 random reader on one
//! array, with per-member depth control off, wbt-like (Linux blk-wbt's algorithm) and
//! ferroraid's, side by side; and a pure streaming write on QD=1 disks. Deterministic:
//! simulated members in virtual time (`engine::sim`), one shard.
//!
//! ```text
//! cargo run --release -p bench --bin qos-scenario -- [--seconds 10] [--plots docs]
//! ```
//!
//! Array: RAID5 of 4 members, 64 KiB chunk, 1 GiB per member. Writer: full-stripe
//! (192 KiB) sequential writes, 64 in flight, wrapping over the first 256 MiB (a log on a
//! large array). Reader: 4 KiB random reads at queue depth 1 over the rest of the array
//! (other data than the writer's, as a reader of other files would: a read of a stripe
//! the writer holds waits for that write whatever the member queues do). The reader runs alone
//! for 2 s (its *quiet* latency), then with the writer; figures under the writer are
//! given for the whole writer phase and for its steady state (from 1 s after the writer
//! starts). Profiles: `sata-ssd-bounded-cache` (64 MiB write cache destaging at
//! 500 MB/s, 4 parallel units, NCQ 32), `nvme-ssd` (32 units, QD 1023), `hdd-7200-qd1`.
//!
//! Output: a Markdown table on stdout (pasted into `docs/BENCHMARKS.md`) and SVG plots
//! (reader latency percentiles per policy, and the depth limit over time).

use anyhow::{Context, Result};
use clap::Parser;
use engine::array::{Array, ArrayConfig};
use engine::device::BlockDevice;
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use engine::parity::Parity;
use engine::qos::{DepthConfig, DepthPolicy};
use engine::sim::workload::{run, Job, JobKind, JobStats};
use engine::sim::{Profile, SimChannel, SimClock, SimDevice};
use hdrhistogram::Histogram;
use plotters::prelude::*;

const MS: u64 = 1_000_000;
/// The writer's region, from offset 0; the reader reads the rest of the array.
const WRITER_SPAN: u64 = 256 << 20;
const S: u64 = 1_000_000_000;
const CHUNK: u64 = 64 << 10;
const STRIPES: u64 = 16384;
const QUIET_NS: u64 = 2 * S;
const WARMUP_NS: u64 = S;
const SAMPLE_NS: u64 = 50 * MS;

#[derive(Parser, Debug)]
#[command(
    about = "issue-6 seed scenario: reader latency under a heavy writer, depth control off / wbt-like / ferroraid"
)]
struct Args {
    /// Virtual seconds the writer runs (after 2 s of quiet reads).
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Directory for the SVG plots (none written if absent).
    #[arg(long)]
    plots: Option<std::path::PathBuf>,
    /// Seed of the reader's offsets.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the timeline (member-0 depth limit, reader p99 per 50 ms) of each run.
    #[arg(long)]
    trace: bool,
}

fn array(profile: &Profile, policy: DepthPolicy) -> (Array<SimChannel>, SimClock) {
    let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 4, CHUNK, 4096).expect("geometry");
    let geo = ArrayGeometry::new(g, STRIPES).expect("geometry");
    let clock = SimClock::new();
    let chans = (0..4)
        .map(|i| {
            SimDevice::new(
                &format!("m{i}"),
                STRIPES * CHUNK,
                4096,
                profile.clone(),
                clock.clone(),
                i,
            )
            .expect("sim device")
            .open_channel()
            .expect("channel")
        })
        .collect();
    let cfg = ArrayConfig {
        requests: 256,
        stripe_ops: 256,
        depth: DepthConfig {
            policy,
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

fn reader(start_ns: u64, stop_ns: u64) -> Job {
    Job {
        kind: JobKind::RandRead,
        block_bytes: 4096,
        depth: 1,
        start_ns,
        stop_ns,
        // Other data than the writer's (another file): no stripe shared with it.
        offset_bytes: WRITER_SPAN,
        span_bytes: 0,
        submit_gap_ns: 0,
    }
}

fn writer(start_ns: u64, stop_ns: u64) -> Job {
    Job {
        kind: JobKind::SeqWrite,
        block_bytes: 3 * CHUNK as u32,
        depth: 64,
        start_ns,
        stop_ns,
        offset_bytes: 0,
        span_bytes: WRITER_SPAN,
        submit_gap_ns: 0,
    }
}

/// One reader+writer run.
struct Mixed {
    quiet: Histogram<u64>,
    loaded: Histogram<u64>,
    steady: Histogram<u64>,
    reader_iops: f64,
    writer_mb_s: f64,
    /// (time s, member-0 depth limit, reader p99 µs over the last sample interval).
    trace: Vec<(f64, u32, f64)>,
}

fn mixed(profile: &Profile, policy: DepthPolicy, seconds: u64, seed: u64) -> Mixed {
    let (mut arr, clock) = array(profile, policy);
    let end = QUIET_NS + seconds * S;
    let jobs = [
        reader(0, QUIET_NS),
        reader(QUIET_NS, QUIET_NS + WARMUP_NS),
        reader(QUIET_NS + WARMUP_NS, end),
        writer(QUIET_NS, end),
    ];
    let mut trace = Vec::new();
    let mut last: Option<Histogram<u64>> = None;
    let st = run(
        &mut arr,
        &clock,
        &jobs,
        end,
        seed,
        SAMPLE_NS,
        |now, a, s| {
            let mut all = s[0].latency.clone();
            all.add(&s[1].latency).expect("same bounds");
            all.add(&s[2].latency).expect("same bounds");
            let mut interval = all.clone();
            if let Some(prev) = &last {
                interval.subtract(prev).expect("monotonic");
            }
            let p99 = if interval.is_empty() {
                0.0
            } else {
                interval.value_at_quantile(0.99) as f64 / 1000.0
            };
            trace.push((now as f64 / S as f64, a.member_qos(0).depth_limit, p99));
            last = Some(all);
        },
    );
    let errors: u64 = st.iter().map(|s| s.errors).sum();
    assert_eq!(errors, 0, "the scenario must not fail I/O");
    let mut loaded = st[1].latency.clone();
    loaded.add(&st[2].latency).expect("same bounds");
    let reads = st[1].ops + st[2].ops;
    Mixed {
        quiet: st[0].latency.clone(),
        loaded,
        steady: st[2].latency.clone(),
        reader_iops: reads as f64 / seconds as f64,
        writer_mb_s: mb_s(&st[3], seconds * S),
        trace,
    }
}

fn mb_s(s: &JobStats, ns: u64) -> f64 {
    s.bytes as f64 / (ns as f64 / S as f64) / 1e6
}

fn hdd_stream(policy: DepthPolicy, seconds: u64) -> f64 {
    let (mut arr, clock) = array(&Profile::hdd_7200(false), policy);
    let end = seconds * S;
    let st = run(&mut arr, &clock, &[writer(0, end)], end, 1, 0, |_, _, _| {});
    mb_s(&st[0], end)
}

const QUANTILES: [(f64, &str); 6] = [
    (0.5, "p50"),
    (0.9, "p90"),
    (0.99, "p99"),
    (0.999, "p99.9"),
    (0.9999, "p99.99"),
    (1.0, "max"),
];

fn us(h: &Histogram<u64>, q: f64) -> f64 {
    let v = if q >= 1.0 {
        h.max()
    } else {
        h.value_at_quantile(q)
    };
    v as f64 / 1000.0
}

fn row(label: &str, h: &Histogram<u64>, iops: Option<f64>, mbs: Option<f64>) -> String {
    let mut s = format!("| {label} |");
    for (q, _) in QUANTILES {
        s += &format!(" {:.0} |", us(h, q));
    }
    s += &match iops {
        Some(v) => format!(" {v:.0} |"),
        None => " |".into(),
    };
    s += &match mbs {
        Some(v) => format!(" {v:.0} |"),
        None => " |".into(),
    };
    s
}

fn policy_name(p: DepthPolicy) -> &'static str {
    match p {
        DepthPolicy::Off => "off",
        DepthPolicy::WbtLike => "wbt-like",
        DepthPolicy::Ferroraid => "ferroraid",
    }
}

const POLICIES: [DepthPolicy; 3] = [
    DepthPolicy::Off,
    DepthPolicy::WbtLike,
    DepthPolicy::Ferroraid,
];
const COLORS: [RGBColor; 3] = [
    RGBColor(200, 30, 30),
    RGBColor(30, 90, 200),
    RGBColor(20, 150, 60),
];

fn plot_percentiles(
    path: &std::path::Path,
    title: &str,
    runs: &[(DepthPolicy, Mixed)],
) -> Result<()> {
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let top = runs
        .iter()
        .map(|(_, m)| us(&m.loaded, 1.0))
        .fold(1.0f64, f64::max)
        * 1.5;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0usize..5usize, (50.0f64..top).log_scale())?;
    chart
        .configure_mesh()
        .x_labels(6)
        .x_label_formatter(&|i| QUANTILES.get(*i).map_or("", |q| q.1).to_string())
        .y_desc("reader latency, µs (log)")
        .draw()?;
    let series = |h: &Histogram<u64>| -> Vec<(usize, f64)> {
        QUANTILES
            .iter()
            .enumerate()
            .map(|(i, &(q, _))| (i, us(h, q).max(50.0)))
            .collect()
    };
    chart
        .draw_series(LineSeries::new(
            series(&runs[0].1.quiet),
            BLACK.stroke_width(2),
        ))?
        .label("quiet device (no writer)")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK));
    for (k, (p, m)) in runs.iter().enumerate() {
        let c = COLORS[k];
        chart
            .draw_series(LineSeries::new(series(&m.loaded), c.stroke_width(2)))?
            .label(format!("under writer, {}", policy_name(*p)))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], c));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    root.present()?;
    Ok(())
}

fn plot_trace(path: &std::path::Path, title: &str, runs: &[(DepthPolicy, Mixed)]) -> Result<()> {
    let root = SVGBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let (upper, lower) = root.split_vertically(300);
    let end = runs[0].1.trace.last().map_or(1.0, |t| t.0);
    let max_depth = runs
        .iter()
        .flat_map(|(_, m)| m.trace.iter().map(|t| t.1))
        .filter(|&d| d < u32::MAX)
        .max()
        .unwrap_or(1) as f64;
    let mut c1 = ChartBuilder::on(&upper)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..end, (1.0..max_depth * 1.5).log_scale())?;
    c1.configure_mesh()
        .y_desc("member 0 write depth limit")
        .draw()?;
    let mut c2 = ChartBuilder::on(&lower)
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(
            0.0..end,
            (50.0..runs
                .iter()
                .flat_map(|(_, m)| m.trace.iter().map(|t| t.2))
                .fold(100.0f64, f64::max)
                * 1.5)
                .log_scale(),
        )?;
    c2.configure_mesh()
        .x_desc("virtual time, s (writer from 2 s)")
        .y_desc("reader p99 per 50 ms, µs")
        .draw()?;
    for (k, (p, m)) in runs.iter().enumerate() {
        let c = COLORS[k];
        if *p != DepthPolicy::Off {
            c1.draw_series(LineSeries::new(
                m.trace.iter().map(|t| (t.0, f64::from(t.1))),
                c.stroke_width(2),
            ))?
            .label(policy_name(*p))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], c));
        }
        c2.draw_series(LineSeries::new(
            m.trace
                .iter()
                .filter(|t| t.2 > 0.0)
                .map(|t| (t.0, t.2.max(50.0))),
            c.stroke_width(2),
        ))?
        .label(policy_name(*p))
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], c));
    }
    c1.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    c2.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let header = "| run | p50 µs | p90 µs | p99 µs | p99.9 µs | p99.99 µs | max µs | reader IOPS | writer MB/s |\n|---|---|---|---|---|---|---|---|---|";
    for profile in [Profile::sata_ssd_bounded_cache(), Profile::nvme_ssd()] {
        let runs: Vec<(DepthPolicy, Mixed)> = POLICIES
            .iter()
            .map(|&p| (p, mixed(&profile, p, args.seconds, args.seed)))
            .collect();
        println!(
            "\n### {} — QD1 4 KiB random reader, sequential writer (64 × 192 KiB) from 2 s, {} s\n",
            profile.name, args.seconds
        );
        println!("{header}");
        if args.trace {
            for (p, m) in &runs {
                for t in &m.trace {
                    eprintln!(
                        "{} {} t={:.2}s depth={} reader_p99={:.0}us",
                        profile.name,
                        policy_name(*p),
                        t.0,
                        t.1,
                        t.2
                    );
                }
            }
        }
        let q = &runs[0].1;
        let quiet_iops = q.quiet.len() as f64 / (QUIET_NS as f64 / S as f64);
        println!(
            "{}",
            row(
                "quiet device (reader alone)",
                &q.quiet,
                Some(quiet_iops),
                None
            )
        );
        for (p, m) in &runs {
            println!(
                "{}",
                row(
                    &format!("{}: whole writer phase", policy_name(*p)),
                    &m.loaded,
                    Some(m.reader_iops),
                    Some(m.writer_mb_s)
                )
            );
            println!(
                "{}",
                row(
                    &format!("{}: steady state (from 3 s)", policy_name(*p)),
                    &m.steady,
                    None,
                    None
                )
            );
        }
        let quiet999 = us(&q.quiet, 0.999);
        let off = &runs[0].1;
        let wbt = &runs[1].1;
        let fr = &runs[2].1;
        println!(
            "\nTargets (ferroraid): p99.9 under writer {:.0} µs vs 2 × quiet p99.9 = {:.0} µs (steady state {:.0} µs); \
             p99.99 {:.0} µs vs off {:.0} µs, wbt-like {:.0} µs; writer {:.1}% of uncontrolled throughput.",
            us(&fr.loaded, 0.999),
            2.0 * quiet999,
            us(&fr.steady, 0.999),
            us(&fr.loaded, 0.9999),
            us(&off.loaded, 0.9999),
            us(&wbt.loaded, 0.9999),
            100.0 * fr.writer_mb_s / off.writer_mb_s
        );
        if let Some(dir) = &args.plots {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            let p = dir.join(format!("qos-{}-percentiles.svg", profile.name));
            plot_percentiles(
                &p,
                &format!("{}: reader latency percentiles", profile.name),
                &runs,
            )?;
            let t = dir.join(format!("qos-{}-timeline.svg", profile.name));
            plot_trace(
                &t,
                &format!("{}: depth limit and reader p99 over time", profile.name),
                &runs,
            )?;
            eprintln!("wrote {} and {}", p.display(), t.display());
        }
    }
    println!(
        "\n### hdd-7200-qd1 — pure streaming write (64 × 192 KiB full stripes), {} s\n",
        args.seconds
    );
    println!("| policy | writer MB/s | vs off |\n|---|---|---|");
    let off = hdd_stream(DepthPolicy::Off, args.seconds);
    for p in POLICIES {
        let v = if p == DepthPolicy::Off {
            off
        } else {
            hdd_stream(p, args.seconds)
        };
        println!(
            "| {} | {:.1} | {:+.2}% |",
            policy_name(p),
            v,
            100.0 * (v / off - 1.0)
        );
    }
    Ok(())
}
