//! Member reads beside member writes through the io_uring driver, one thread as a reactor
//! drives it (issue 24): where do a small reader's member reads wait?
//!
//! ```text
//! cargo run --release -p bench --bin member-read-probe -- --dir /dev/shm/probe
//!     [--files 6] [--file-mib 256] [--write-kib 64] [--write-qd 48] [--read-kib 4]
//!     [--seconds 3] [--runs 3] [--cpu 1] [--buffered]
//! ```
//!
//! Creates `--files` member files of `--file-mib` MiB in `--dir` (removed at the end),
//! filled once, opens each as a [`UringDevice`] and one channel per file on this thread
//! (pinned to `--cpu`, so the driver keeps io-wq off it as in a reactor). Then, per run and
//! per mode, for `--seconds`: `--write-qd` writes of `--write-kib` KiB in flight, round
//! robin over the files (sequential within each), and one `--read-kib` KiB random read at a
//! time; the thread busy-polls, as a polled reactor does. Modes, alternating within each
//! run: `io_uring` ([`UringConfig::inline_reads`] off: every read through io_uring) and
//! `inline` (on: the driver serves small reads of memory-backed files itself). On a file
//! system io_uring reads without io-wq (ext4, xfs with `O_DIRECT`) both modes take the same
//! path.
//!
//! Output (stdout, Markdown): per mode, the medians over the runs of the read latency
//! (submit to completion, µs) p50 / p99 / p99.9 / max, reads per second, write MB/s, and
//! the reads the driver served inline.

use std::path::PathBuf;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use drivers::uring::{UringChannel, UringConfig, UringDevice};
use engine::buf::AlignedBuf;
use engine::device::{BlockDevice, Channel, Completion, IoBuf, Op, Request};
use hdrhistogram::Histogram;

#[derive(Parser, Debug)]
#[command(about = "Member reads beside member writes through the io_uring driver")]
struct Args {
    /// Directory for the member files (created if missing; the files are removed).
    #[arg(long)]
    dir: PathBuf,
    /// Member files.
    #[arg(long, default_value_t = 6)]
    files: usize,
    /// Size of each file, MiB.
    #[arg(long, default_value_t = 256)]
    file_mib: u64,
    /// Size of each write, KiB.
    #[arg(long, default_value_t = 64)]
    write_kib: u32,
    /// Writes in flight over all files.
    #[arg(long, default_value_t = 48)]
    write_qd: usize,
    /// Size of each read, KiB.
    #[arg(long, default_value_t = 4)]
    read_kib: u32,
    /// Seconds per mode and run.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Runs (modes alternate within each).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// CPU for this thread (the driver keeps io-wq workers on the others).
    #[arg(long, default_value_t = 1)]
    cpu: usize,
    /// Open the files without `O_DIRECT` (page cache).
    #[arg(long)]
    buffered: bool,
}

/// One mode's figures of one run.
#[derive(Clone, Copy, Default)]
struct Figures {
    /// Read latency, µs: p50, p99, p99.9, max.
    read_us: [u64; 4],
    reads_per_s: f64,
    write_mb_s: f64,
    inline_reads: u64,
}

/// Write tags are `WRITE_TAG + buffer index`; the read's tag is `READ_TAG`.
const READ_TAG: u64 = 1 << 40;
const WRITE_TAG: u64 = 1 << 41;

fn main() -> Result<()> {
    let a = Args::parse();
    if a.files == 0 || a.write_qd == 0 || a.write_kib == 0 || a.read_kib == 0 {
        bail!("--files, --write-qd, --write-kib and --read-kib must be at least 1");
    }
    let file_bytes = a.file_mib << 20;
    let (wlen, rlen) = (u64::from(a.write_kib) << 10, u64::from(a.read_kib) << 10);
    if wlen > file_bytes || rlen > file_bytes || wlen > 1 << 20 || rlen > 1 << 20 {
        bail!("reads and writes must fit a file and be at most 1 MiB");
    }
    if !core_affinity::set_for_current(core_affinity::CoreId { id: a.cpu }) {
        bail!("cannot pin this thread to CPU {}", a.cpu);
    }
    std::fs::create_dir_all(&a.dir).with_context(|| format!("mkdir {}", a.dir.display()))?;
    let dir = tempfile::tempdir_in(&a.dir).context("temporary directory")?;
    let fill = vec![0x5au8; 1 << 20];
    let paths: Vec<PathBuf> = (0..a.files)
        .map(|i| {
            let p = dir.path().join(format!("m{i}.img"));
            let mut f = std::fs::File::create(&p)?;
            for _ in 0..a.file_mib {
                std::io::Write::write_all(&mut f, &fill)?;
            }
            f.sync_all()?;
            Ok(p)
        })
        .collect::<std::io::Result<_>>()
        .context("filling the member files")?;

    let mut results: [Vec<Figures>; 2] = [Vec::new(), Vec::new()];
    for run in 0..a.runs {
        for (m, inline) in [false, true].into_iter().enumerate() {
            let cfg = UringConfig {
                direct: !a.buffered,
                inline_reads: inline,
                ..UringConfig::default()
            };
            let devs = paths
                .iter()
                .map(|p| UringDevice::open(p, &cfg).with_context(|| format!("{}", p.display())))
                .collect::<Result<Vec<_>>>()?;
            let f = measure(&a, &devs, wlen, rlen, file_bytes, run as u64)?;
            eprintln!(
                "run {} {}: read p50 {} p99.9 {} µs, {:.0} reads/s, {:.0} MB/s written",
                run + 1,
                mode_name(inline),
                f.read_us[0],
                f.read_us[2],
                f.reads_per_s,
                f.write_mb_s
            );
            results[m].push(f);
        }
    }
    println!(
        "- command: `member-read-probe --dir {} --files {} --file-mib {} --write-kib {} \
         --write-qd {} --read-kib {} --seconds {} --runs {} --cpu {}{}`",
        a.dir.display(),
        a.files,
        a.file_mib,
        a.write_kib,
        a.write_qd,
        a.read_kib,
        a.seconds,
        a.runs,
        a.cpu,
        if a.buffered { " --buffered" } else { "" }
    );
    println!("- medians of {} runs, modes alternating", a.runs);
    println!();
    println!("| reads | read p50 / p99 / p99.9 / max µs | reads/s | writes MB/s | served inline |");
    println!("|---|---|---:|---:|---:|");
    for (m, inline) in [false, true].into_iter().enumerate() {
        let r = &results[m];
        let med = |f: &dyn Fn(&Figures) -> f64| {
            let mut v: Vec<f64> = r.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        println!(
            "| {} | {:.0} / {:.0} / {:.0} / {:.0} | {:.0} | {:.0} | {:.0} |",
            mode_name(inline),
            med(&|f| f.read_us[0] as f64),
            med(&|f| f.read_us[1] as f64),
            med(&|f| f.read_us[2] as f64),
            med(&|f| f.read_us[3] as f64),
            med(&|f| f.reads_per_s),
            med(&|f| f.write_mb_s),
            med(&|f| f.inline_reads as f64),
        );
    }
    Ok(())
}

fn mode_name(inline: bool) -> &'static str {
    if inline {
        "inline (pread in submit where the driver may)"
    } else {
        "io_uring"
    }
}

/// Lends `buf` to one request.
fn lend(buf: &mut AlignedBuf, len: u64) -> IoBuf {
    let ptr = NonNull::new(buf.as_mut_ptr()).expect("non-null");
    // SAFETY: each buffer serves one request at a time and is neither touched nor freed
    // until that request's completion came back (or the channels, which wait for their
    // requests on drop, are gone: they are dropped before the buffers below).
    unsafe { IoBuf::from_raw(ptr, len as u32, None) }
}

/// One mode of one run: the writes and the reader for `args.seconds`.
fn measure(
    args: &Args,
    devs: &[UringDevice],
    wlen: u64,
    rlen: u64,
    file_bytes: u64,
    seed: u64,
) -> Result<Figures> {
    let mut wbufs: Vec<AlignedBuf> = (0..args.write_qd)
        .map(|i| AlignedBuf::from_slice(&vec![i as u8; wlen as usize]))
        .collect();
    let mut rbuf = AlignedBuf::zeroed(rlen as usize);
    let mut chans = devs
        .iter()
        .map(|d| d.open_channel().context("channel"))
        .collect::<Result<Vec<UringChannel>>>()?;
    let mut hist = Histogram::<u64>::new(3).context("histogram")?;
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ seed;
    let (mut wfile, mut woff) = (0usize, 0u64);
    let mut free: Vec<usize> = (0..args.write_qd).collect();
    let mut read_sent: Option<Instant> = None;
    let mut written = 0u64;
    let mut out = [Completion::EMPTY; 64];
    let start = Instant::now();
    let run_for = Duration::from_secs_f64(args.seconds);
    let mut stopping = false;
    loop {
        if !stopping && start.elapsed() >= run_for {
            stopping = true;
        }
        if stopping && free.len() == args.write_qd && read_sent.is_none() {
            break;
        }
        while !stopping && !free.is_empty() {
            let b = free.pop().expect("not empty");
            let req = Request {
                tag: WRITE_TAG + b as u64,
                op: Op::Write { fua: false },
                offset_bytes: woff,
                len_bytes: wlen as u32,
                buf: lend(&mut wbufs[b], wlen),
            };
            chans[wfile].submit(req).context("submit write")?;
            wfile += 1;
            if wfile == chans.len() {
                wfile = 0;
                woff = if woff + 2 * wlen > file_bytes {
                    0
                } else {
                    woff + wlen
                };
            }
        }
        if !stopping && read_sent.is_none() {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let f = (rng >> 33) as usize % chans.len();
            let off = rng % (file_bytes / rlen) * rlen;
            let req = Request {
                tag: READ_TAG,
                op: Op::Read,
                offset_bytes: off,
                len_bytes: rlen as u32,
                buf: lend(&mut rbuf, rlen),
            };
            read_sent = Some(Instant::now());
            chans[f].submit(req).context("submit read")?;
        }
        for ch in chans.iter_mut() {
            ch.kick();
            let n = ch.poll(&mut out);
            for c in &out[..n] {
                if let Err(e) = c.status {
                    bail!("request {:#x} failed: {e}", c.tag);
                }
                if c.tag == READ_TAG {
                    let sent = read_sent.take().expect("a read in flight");
                    hist.record(sent.elapsed().as_micros() as u64)?;
                } else {
                    free.push((c.tag - WRITE_TAG) as usize);
                    written += wlen;
                }
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let inline_reads = chans.iter().map(|c| c.stats().inline_reads).sum();
    drop(chans);
    Ok(Figures {
        read_us: [
            hist.value_at_quantile(0.5),
            hist.value_at_quantile(0.99),
            hist.value_at_quantile(0.999),
            hist.max(),
        ],
        reads_per_s: hist.len() as f64 / secs,
        write_mb_s: written as f64 / secs / 1e6,
        inline_reads,
    })
}
