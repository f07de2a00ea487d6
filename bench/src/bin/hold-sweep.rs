//! Sweep of the write-pass hold bound (`ArrayConfig::write_hold_ns`, issue 17): how long a
//! pass that would pre-read may wait for more writes of its stripe, measured on the
//! simulator's device profiles. Deterministic: simulated members in virtual time
//! (`engine::sim`), one shard, seeded.
//!
//! ```text
//! cargo run --release -p bench --bin hold-sweep -- [--holds-us 0,25,50,100,200,500,1000,2000]
//!     [--profiles nvme,sata-bounded,hdd] [--levels 5,6] [--workloads ...] [--seconds 0.5]
//!     [--hdd-seconds 5] [--link-mb-s 1200] [--writer-span-mib 3072] [--jobs 2] [--quick]
//! ```
//!
//! Arrays: RAID5 over 5 members and RAID6 over 6 (4 data chunks each), 64 KiB chunk,
//! 1 GiB per member (allocated lazily), the engine's default configuration
//! (`ArrayConfig::default()`: 32 stripe operations, 64 cache entries, ferroraid's depth
//! control) but for the hold bound. Profiles: `nvme-ssd`, `sata-ssd-bounded-cache`
//! (writes acknowledged from a 64 MiB cache in 25 µs while it has room, destaged at
//! 500 MB/s), `hdd-7200-ncq` (NCQ 32); also `sata-cached` (the unbounded cache: without
//! flushes its writes never pay for the media, so its write MB/s mean nothing) and
//! `hdd-qd1` on request.
//!
//! Workloads: sequential writes of 4 KiB at QD32, 64 KiB at QD8, 16 KiB at QD4 and 4 KiB
//! at QD1 from offset 0 over `--writer-span-mib` (3 GiB; wrapping), each as a local
//! client (a free slot is refilled at once) and as a network client (`net-`: one request
//! reaches the array per `bytes / --link-mb-s`, the time the front end needs to receive
//! its payload: 64 KiB in 55 µs at the default 1200 MB/s, a 10 Gb/s link); and the 64 KiB
//! QD8 writer (local, `mixed`, and network, `net-mixed`) beside a QD1 4 KiB random reader
//! of the array's last GiB.
//!
//! Per cell: writer throughput (MB/s of virtual time), write latency p50/p99, the median
//! write latency of member 0 (device submission to completion: what the hold waits for
//! when the client's next writes wait for the completion of its earlier ones), member bytes
//! read per client byte written (`write_read_bytes / pass_written_bytes`), member requests
//! per client write, writes per pass, held passes (share of passes) and mean hold, expired
//! holds, and for the mixed workloads the reader's p50/p99. Output: one Markdown table per
//! profile × workload (rows: level, hold bound) on stdout, progress on stderr.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use engine::array::{new_latency_histogram, Array, ArrayConfig, ArrayStats};
use engine::device::{BlockDevice, Op};
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use engine::parity::Parity;
use engine::qos::DepthConfig;
use engine::sim::workload::{run, Job, JobKind, JobStats};
use engine::sim::{IoEventKind, IoLog, Profile, Seek, SimChannel, SimClock, SimDevice};
use hdrhistogram::Histogram;

const US: u64 = 1_000;
const S: u64 = 1_000_000_000;
const CHUNK: u64 = 64 << 10;
/// Stripes of every array: 1 GiB per member.
const STRIPES: u64 = 16384;
/// Where the reader of the mixed workloads reads, to the end of the array (the last GiB);
/// the writers write from offset 0 up to `--writer-span-mib`, at most this.
const READER_OFFSET: u64 = 3 << 30;

#[derive(Parser, Debug)]
#[command(
    about = "issue-17 hold sweep: write_hold_ns × device profile × workload, simulated members"
)]
struct Args {
    /// Hold bounds to sweep, µs (0: never held).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0,25,50,100,200,500,1000,2000"
    )]
    holds_us: Vec<u64>,
    /// Profiles: nvme, sata-bounded (64 MiB write cache), sata-cached (unbounded write
    /// cache: writes never pay for the media without a flush, 17–20 GB/s of full stripes
    /// here, and the slowest cells to simulate), hdd (NCQ 32), hdd-qd1.
    #[arg(long, value_delimiter = ',', default_value = "nvme,sata-bounded,hdd")]
    profiles: Vec<String>,
    /// RAID levels: 5 (5 members) and/or 6 (6 members).
    #[arg(long, value_delimiter = ',', default_value = "5,6")]
    levels: Vec<u8>,
    /// Workloads (default: all): seq4k-qd32, seq64k-qd8, seq16k-qd4, seq4k-qd1, the same
    /// with a `net-` prefix, mixed, net-mixed.
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// Virtual seconds per cell on the SSD profiles.
    #[arg(long, default_value_t = 0.5)]
    seconds: f64,
    /// Virtual seconds per cell on the HDD profiles (a disk does less per second, and
    /// costs less wall time per virtual second).
    #[arg(long, default_value_t = 5.0)]
    hdd_seconds: f64,
    /// Link speed of the network client (`net-` workloads), MB/s: one request reaches the
    /// array every `bytes / link` seconds at most.
    #[arg(long, default_value_t = 1200)]
    link_mb_s: u64,
    /// Holds 0, 200 and 2000 µs, a quarter of the virtual time.
    #[arg(long)]
    quick: bool,
    /// Seed of the mixed workloads' reader.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The writers' region from offset 0, MiB (at most 3072). The default is large enough
    /// that no writer wraps at the default durations: a wrap restarts the stream at offset
    /// 0, which is not sequential to the shard, a few passes that may not be held, enough
    /// to move a disk out of its full-stripe rhythm (with 64 MiB, wrapping every ~0.2 s,
    /// HDD 64 KiB QD8 ran at 175 MB/s instead of 581). Only the pages written are
    /// allocated.
    #[arg(long, default_value_t = 3072)]
    writer_span_mib: u64,
    /// Cells simulated at once (threads; the figures do not depend on it).
    #[arg(long, default_value_t = 1)]
    jobs: usize,
}

/// One client workload.
#[derive(Clone, Copy, Debug)]
struct Workload {
    name: &'static str,
    block_bytes: u32,
    depth: u32,
    /// Requests spaced by the link's receive time.
    net: bool,
    /// A QD1 4 KiB random reader beside the writer.
    reader: bool,
}

const WORKLOADS: [Workload; 10] = [
    Workload::seq("seq4k-qd32", 4, 32, false),
    Workload::seq("seq64k-qd8", 64, 8, false),
    Workload::seq("seq16k-qd4", 16, 4, false),
    Workload::seq("seq4k-qd1", 4, 1, false),
    Workload::seq("net-seq4k-qd32", 4, 32, true),
    Workload::seq("net-seq64k-qd8", 64, 8, true),
    Workload::seq("net-seq16k-qd4", 16, 4, true),
    Workload::seq("net-seq4k-qd1", 4, 1, true),
    Workload {
        reader: true,
        ..Workload::seq("mixed", 64, 8, false)
    },
    Workload {
        reader: true,
        ..Workload::seq("net-mixed", 64, 8, true)
    },
];

impl Workload {
    const fn seq(name: &'static str, kib: u32, depth: u32, net: bool) -> Self {
        Self {
            name,
            block_bytes: kib << 10,
            depth,
            net,
            reader: false,
        }
    }
}

fn profile(name: &str) -> Result<Profile> {
    Ok(match name {
        "nvme" => Profile::nvme_ssd(),
        "sata-cached" => Profile::sata_ssd_cached(),
        "sata-bounded" => Profile::sata_ssd_bounded_cache(),
        "hdd" => Profile::hdd_7200(true),
        "hdd-qd1" => Profile::hdd_7200(false),
        _ => bail!("unknown profile {name:?} (nvme, sata-bounded, sata-cached, hdd, hdd-qd1)"),
    })
}

/// An array of `level` over simulated `profile` members, member 0's requests recorded in
/// the returned log (for its write latency).
fn array(profile: &Profile, level: u8, hold_ns: u64) -> (Array<SimChannel>, SimClock, IoLog) {
    let (lvl, members) = if level == 6 {
        (Level::Raid6, 6)
    } else {
        (Level::Raid5, 5)
    };
    let g = Geometry::new(lvl, Layout::LeftSymmetric, members, CHUNK, 4096).expect("geometry");
    let geo = ArrayGeometry::new(g, STRIPES).expect("geometry");
    let clock = SimClock::new();
    // Records requests, no data (empty capture range).
    let log = IoLog::new(0..0);
    let chans = (0..members)
        .map(|i| {
            let dev = SimDevice::new(
                &format!("m{i}"),
                STRIPES * CHUNK,
                4096,
                profile.clone(),
                clock.clone(),
                u64::from(i),
            )
            .expect("sim device");
            if i == 0 {
                dev.attach_log(&log, 0);
            }
            dev.open_channel().expect("channel")
        })
        .collect();
    let cfg = ArrayConfig {
        depth: DepthConfig {
            rotational: matches!(profile.seek, Seek::Disk { .. }),
            ..DepthConfig::default()
        },
        write_hold_ns: hold_ns,
        ..ArrayConfig::default()
    };
    (
        Array::new(geo, chans, Parity::new(), cfg).expect("array"),
        clock,
        log,
    )
}

/// Median write latency in `log` (device submission to completion), µs.
fn member_write_p50_us(log: &IoLog) -> f64 {
    let mut h = new_latency_histogram();
    let mut open: HashMap<(u64, u32), VecDeque<u64>> = HashMap::new();
    for e in log.events() {
        if !matches!(e.op, Op::Write { .. }) {
            continue;
        }
        let k = (e.offset_bytes, e.len_bytes);
        match e.kind {
            IoEventKind::Submit => open.entry(k).or_default().push_back(e.at_ns),
            IoEventKind::Complete => {
                if let Some(t) = open.get_mut(&k).and_then(VecDeque::pop_front) {
                    h.saturating_record(e.at_ns.saturating_sub(t).max(1));
                }
            }
        }
    }
    if h.is_empty() {
        0.0
    } else {
        quantile_us(&h, 0.5)
    }
}

/// What one cell measured.
struct Cell {
    writer_mb_s: f64,
    write_p50_us: f64,
    write_p99_us: f64,
    stats: ArrayStats,
    /// Member requests (reads and writes) of the whole run.
    member_ios: u64,
    writes: u64,
    /// Median write latency of member 0 (device submission to completion), µs.
    member_write_p50_us: f64,
    /// The reader's (p50, p99), µs, and IOPS.
    reader: Option<(f64, f64, f64)>,
}

fn quantile_us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / US as f64
}

/// What every cell of a sweep shares.
struct Setup {
    /// Virtual time per cell, ns.
    ns: u64,
    /// Link speed of the network client, MB/s.
    link_mb_s: u64,
    /// Seed of the reader's offsets.
    seed: u64,
    /// The writer's region from offset 0, bytes.
    span_bytes: u64,
}

fn cell(p: &Profile, level: u8, w: &Workload, hold_ns: u64, setup: &Setup) -> Cell {
    let (mut arr, clock, log) = array(p, level, hold_ns);
    let ns = setup.ns;
    let gap = if w.net {
        u64::from(w.block_bytes) * S / (setup.link_mb_s * 1_000_000)
    } else {
        0
    };
    let mut jobs = vec![Job {
        kind: JobKind::SeqWrite,
        block_bytes: w.block_bytes,
        depth: w.depth,
        start_ns: 0,
        stop_ns: ns,
        offset_bytes: 0,
        span_bytes: setup.span_bytes,
        submit_gap_ns: gap,
    }];
    if w.reader {
        jobs.push(Job {
            kind: JobKind::RandRead,
            block_bytes: 4096,
            depth: 1,
            start_ns: 0,
            stop_ns: ns,
            // Other data than the writer's (another file): no stripe shared with it.
            offset_bytes: READER_OFFSET,
            span_bytes: 0,
            submit_gap_ns: 0,
        });
    }
    let st: Vec<JobStats> = run(&mut arr, &clock, &jobs, ns, setup.seed, 0, |_, _, _| {});
    let errors: u64 = st.iter().map(|s| s.errors).sum();
    assert_eq!(errors, 0, "the sweep must not fail I/O");
    let members = arr.geometry().geometry().members();
    let member_ios = (0..members)
        .map(|m| {
            let c = arr.member_counters(m);
            c.reads + c.writes
        })
        .sum();
    let secs = ns as f64 / S as f64;
    Cell {
        writer_mb_s: st[0].bytes as f64 / secs / 1e6,
        write_p50_us: quantile_us(&st[0].latency, 0.5),
        write_p99_us: quantile_us(&st[0].latency, 0.99),
        stats: arr.stats(),
        member_ios,
        writes: st[0].ops,
        member_write_p50_us: member_write_p50_us(&log),
        reader: st.get(1).map(|r| {
            (
                quantile_us(&r.latency, 0.5),
                quantile_us(&r.latency, 0.99),
                r.ops as f64 / secs,
            )
        }),
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// MB/s with three significant digits at least (disks write a few MB/s here).
fn mb_s(v: f64) -> String {
    if v < 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

fn row(level: u8, hold_us: u64, c: &Cell) -> String {
    let s = &c.stats;
    let mut r = format!(
        "| raid{level} | {hold_us} | {} | {:.0} | {:.0} | {:.0} | {:.3} | {:.2} | {:.2} | {} ({:.0} %) | {:.0} | {} |",
        mb_s(c.writer_mb_s),
        c.write_p50_us,
        c.write_p99_us,
        c.member_write_p50_us,
        ratio(s.write_read_bytes, s.pass_written_bytes),
        ratio(c.member_ios, c.writes),
        ratio(s.batched_writes, s.write_passes),
        s.held_passes,
        100.0 * ratio(s.held_passes, s.write_passes),
        ratio(s.held_ns, s.held_passes) / US as f64,
        s.expired_holds,
    );
    if let Some((p50, p99, iops)) = c.reader {
        r += &format!(" {p50:.0} | {p99:.0} | {iops:.0} |");
    }
    r
}

fn header(reader: bool) -> String {
    let mut h = "| level | hold µs | MB/s | write p50 µs | write p99 µs | member write p50 µs | read B / written B | member I/O per write | writes per pass | held passes | mean hold µs | expired holds |".to_string();
    let mut sep = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|".to_string();
    if reader {
        h += " reader p50 µs | reader p99 µs | reader IOPS |";
        sep += "---:|---:|---:|";
    }
    format!("{h}\n{sep}")
}

fn main() -> Result<()> {
    let mut args = Args::parse();
    if args.quick {
        args.holds_us = vec![0, 200, 2000];
        args.seconds /= 4.0;
        args.hdd_seconds /= 4.0;
    }
    let profiles = args
        .profiles
        .iter()
        .map(|n| profile(n))
        .collect::<Result<Vec<_>>>()?;
    for &l in &args.levels {
        if l != 5 && l != 6 {
            bail!("level {l}: 5 or 6");
        }
    }
    let workloads: Vec<Workload> = if args.workloads.is_empty() {
        WORKLOADS.to_vec()
    } else {
        args.workloads
            .iter()
            .map(|n| {
                WORKLOADS
                    .iter()
                    .find(|w| w.name == n)
                    .copied()
                    .with_context(|| format!("unknown workload {n:?}"))
            })
            .collect::<Result<_>>()?
    };
    if args.link_mb_s == 0 {
        bail!("--link-mb-s must be positive");
    }
    if args.writer_span_mib == 0 || args.writer_span_mib << 20 > READER_OFFSET {
        bail!("--writer-span-mib: 1 to {}", READER_OFFSET >> 20);
    }
    // Every cell, in output order: (profile, workload, level, hold).
    let mut cells = Vec::new();
    for (pi, p) in profiles.iter().enumerate() {
        let secs = if matches!(p.seek, Seek::Disk { .. }) {
            args.hdd_seconds
        } else {
            args.seconds
        };
        let ns = (secs * S as f64) as u64;
        for (wi, _) in workloads.iter().enumerate() {
            for &l in &args.levels {
                for &h in &args.holds_us {
                    cells.push((pi, wi, l, h, ns));
                }
            }
        }
    }
    let results: Vec<Mutex<Option<Cell>>> = cells.iter().map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    std::thread::scope(|sc| {
        for _ in 0..args.jobs.max(1) {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(pi, wi, l, h, ns)) = cells.get(i) else {
                    break;
                };
                let t = Instant::now();
                let setup = Setup {
                    ns,
                    link_mb_s: args.link_mb_s,
                    seed: args.seed,
                    span_bytes: args.writer_span_mib << 20,
                };
                let c = cell(&profiles[pi], l, &workloads[wi], h * US, &setup);
                eprintln!(
                    "[{:>4}/{}] {} {} raid{l} hold {h} µs: {:.0} MB/s ({:.1} s)",
                    i + 1,
                    cells.len(),
                    profiles[pi].name,
                    workloads[wi].name,
                    c.writer_mb_s,
                    t.elapsed().as_secs_f64()
                );
                *results[i].lock().expect("no poisoned cell") = Some(c);
            });
        }
    });
    eprintln!("sweep: {:.0} s wall", started.elapsed().as_secs_f64());
    let results: Vec<Cell> = results
        .into_iter()
        .map(|m| {
            m.into_inner()
                .expect("no poisoned cell")
                .expect("every cell ran")
        })
        .collect();
    println!(
        "Hold sweep: RAID5 over 5 / RAID6 over 6 simulated members, 64 KiB chunk; \
         {} s per SSD cell, {} s per HDD cell (virtual); writers over the first {} MiB; \
         network link {} MB/s.\n",
        args.seconds, args.hdd_seconds, args.writer_span_mib, args.link_mb_s
    );
    let mut i = 0;
    while i < cells.len() {
        let (pi, wi, ..) = cells[i];
        let w = &workloads[wi];
        let gap = if w.net {
            format!(
                ", one request per {:.1} µs at most",
                f64::from(w.block_bytes) * 1e3 / (args.link_mb_s as f64 * 1e6) * 1e3
            )
        } else {
            String::new()
        };
        println!(
            "### {} — {} ({} KiB, QD{}{}{})\n",
            profiles[pi].name,
            w.name,
            w.block_bytes >> 10,
            w.depth,
            gap,
            if w.reader {
                ", beside a QD1 4 KiB random reader"
            } else {
                ""
            }
        );
        println!("{}", header(w.reader));
        while i < cells.len() && cells[i].0 == pi && cells[i].1 == wi {
            let (_, _, l, h, _) = cells[i];
            println!("{}", row(l, h, &results[i]));
            i += 1;
        }
        println!();
    }
    Ok(())
}
