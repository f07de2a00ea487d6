//! `nvmf-load`: an NVMe/TCP load generator and verifier of our own (issue 22), for
//! benchmarks and checks on hosts without the kernel's `nvme-tcp` initiator. It is a test
//! tool, not a substitute for the kernel host.
//!
//! It connects like the Linux host does (admin queue: Connect, CC.EN, Identify, Set
//! Features Number of Queues; then one TCP connection per I/O queue), finds the subsystem
//! through the discovery log when `--nqn` is not given, and runs one thread per I/O queue
//! keeping `--qd` commands in flight: 4 KiB random reads or writes, or 128 KiB sequential
//! reads or writes (`--workload`), for `--seconds`. With `--verify`, every block written
//! holds a pattern derived from its LBA alone, so any read of a block this tool (or an
//! earlier `--verify` run over the same range) wrote can be checked: `randrw` writes and
//! reads at random and checks every read of a block written before. Prints IOPS, MiB/s
//! and latency percentiles (µs) as one JSON line.
//!
//! Example: `nvmf-load --addr 127.0.0.1:4420 --queues 2 --qd 32 --workload randread
//! --seconds 10`.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use ferroraid::nvmf::host::{ConnectParams, Data, Event, HostQueue};
use ferroraid::nvmf::pdu::Sqe;
use ferroraid::nvmf::spec::{admin, feature, io, DISCOVERY_NQN};
use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Workload {
    /// 4 KiB random reads.
    Randread,
    /// 4 KiB random writes.
    Randwrite,
    /// 4 KiB random reads and writes, half each.
    Randrw,
    /// 128 KiB sequential reads (each queue its own part of the range).
    Seqread,
    /// 128 KiB sequential writes.
    Seqwrite,
}

/// NVMe/TCP load generator (see the module docs).
#[derive(Parser, Debug)]
struct Args {
    /// Target address (a portal; also asked for the discovery log without --nqn).
    #[arg(long, default_value = "127.0.0.1:4420")]
    addr: SocketAddr,
    /// Subsystem NQN (default: the first subsystem in the discovery log).
    #[arg(long)]
    nqn: Option<String>,
    /// I/O queues (one TCP connection and one thread each).
    #[arg(long, default_value_t = 1)]
    queues: u16,
    /// Commands in flight per queue.
    #[arg(long, default_value_t = 32)]
    qd: u16,
    #[arg(long, value_enum, default_value = "randread")]
    workload: Workload,
    /// Run time, seconds.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Bytes of the namespace used from LBA 0 (default: all of it).
    #[arg(long)]
    range_mib: Option<u64>,
    /// Check every read block against the pattern of its LBA (see the module docs).
    #[arg(long)]
    verify: bool,
    /// Header and data digests.
    #[arg(long)]
    digests: bool,
    /// FUA on writes.
    #[arg(long)]
    fua: bool,
    /// Random seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:6e766d66-6c6f-6164-0000-000000000001";

fn params(subnqn: &str, kato_ms: u32) -> ConnectParams {
    ConnectParams {
        subnqn: subnqn.into(),
        hostnqn: HOSTNQN.into(),
        hostid: *b"nvmf-load-host01",
        kato_ms,
    }
}

/// The pattern of block `lba` (`bs` bytes): 8-byte words `lba << 20 | word index`.
fn fill(lba: u64, out: &mut [u8]) {
    for (i, w) in out.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&((lba << 20) | i as u64).to_le_bytes());
    }
}

fn admin_exec(q: &mut HostQueue, sqe: Sqe, data: Data<'_>, what: &str) -> Result<(u32, Vec<u8>)> {
    let (c, d) = q.exec(sqe, data).with_context(|| what.to_string())?;
    if c.status != 0 {
        bail!("{what}: status {:#06x}", c.status);
    }
    Ok((c.dw0, d))
}

fn discover(addr: SocketAddr, digests: bool) -> Result<String> {
    let mut q = HostQueue::open(addr, digests, digests)?;
    let c = q.connect(0, 31, 0xFFFF, &params(DISCOVERY_NQN, 0))?;
    if c.status != 0 {
        bail!("discovery Connect: status {:#06x}", c.status);
    }
    q.enable()?;
    let numd = 2048 / 4 - 1;
    let sqe = Sqe {
        opcode: admin::GET_LOG_PAGE,
        cid: 5,
        cdw10: 0x70 | (numd << 16),
        ..Sqe::default()
    };
    let (_, log) = admin_exec(&mut q, sqe, Data::In(2048), "discovery log")?;
    if u64::from_le_bytes(log[8..16].try_into()?) == 0 {
        bail!("the discovery log lists no subsystem");
    }
    let f = &log[1024 + 256..1024 + 512];
    let end = f.iter().position(|&b| b == 0).unwrap_or(f.len());
    Ok(String::from_utf8_lossy(&f[..end]).into_owned())
}

/// Per-slot state of one queue's commands in flight (slot = CID).
struct Slots {
    rng: rand_chacha::ChaCha8Rng,
    bufs: Vec<Vec<u8>>,
    lba: Vec<u64>,
    write: Vec<bool>,
    started: Vec<Instant>,
    next_seq: u64,
    seq_lo: u64,
    seq_hi: u64,
    seq: bool,
    /// I/O-sized units in the range.
    span: u64,
    /// Blocks per I/O.
    nlb: u64,
    bs: u64,
    io_bytes: u64,
}

impl Slots {
    /// Issues the next command in slot `s`.
    fn issue(&mut self, args: &Args, q: &mut HostQueue, s: usize) -> Result<()> {
        let unit = if self.seq {
            let u = self.next_seq;
            self.next_seq += 1;
            if self.next_seq >= self.seq_hi {
                self.next_seq = self.seq_lo;
            }
            u
        } else {
            self.rng.gen_range(0..self.span)
        };
        let lba = unit * self.nlb;
        let write = match args.workload {
            Workload::Randwrite | Workload::Seqwrite => true,
            Workload::Randrw => self.rng.gen_bool(0.5),
            _ => false,
        };
        self.lba[s] = lba;
        self.write[s] = write;
        self.started[s] = Instant::now();
        let sqe = Sqe {
            opcode: if write { io::WRITE } else { io::READ },
            cid: s as u16,
            nsid: 1,
            cdw10: lba as u32,
            cdw11: (lba >> 32) as u32,
            cdw12: (self.nlb as u32 - 1) | (u32::from(write && args.fua) << 30),
            ..Sqe::default()
        };
        if write {
            for (k, b) in self.bufs[s].chunks_exact_mut(self.bs as usize).enumerate() {
                fill(lba + k as u64, b);
            }
            q.submit(
                sqe,
                Data::Out {
                    data: &self.bufs[s],
                    in_capsule: self.io_bytes <= 4096,
                },
            )?;
        } else {
            q.submit(sqe, Data::In(self.io_bytes as u32))?;
        }
        Ok(())
    }
}

struct Totals {
    ops: u64,
    bytes: u64,
    verified: u64,
    hist: Histogram<u64>,
}

#[allow(clippy::too_many_arguments)]
fn worker(
    args: &Args,
    nqn: &str,
    cntlid: u16,
    qid: u16,
    bs: u64,
    blocks: u64,
    stop: &AtomicBool,
) -> Result<Totals> {
    let mut q = HostQueue::open(args.addr, args.digests, args.digests)?;
    let c = q.connect(qid, args.qd.max(16), cntlid, &params(nqn, 0))?;
    if c.status != 0 {
        bail!("queue {qid}: Connect status {:#06x}", c.status);
    }
    let seq = matches!(args.workload, Workload::Seqread | Workload::Seqwrite);
    let io_bytes: u64 = if seq { 128 * 1024 } else { 4096 };
    let nlb = io_bytes / bs;
    let span = blocks / nlb; // I/O-sized units in the range
    if span == 0 {
        bail!("range smaller than one I/O");
    }
    let rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed ^ u64::from(qid));
    // Sequential: each queue walks its own part.
    let part = span / u64::from(args.queues);
    let qd = usize::from(args.qd);
    let mut st = Slots {
        rng,
        bufs: (0..qd).map(|_| vec![0u8; io_bytes as usize]).collect(),
        lba: vec![0; qd],
        write: vec![false; qd],
        started: vec![Instant::now(); qd],
        next_seq: part * u64::from(qid - 1),
        seq_lo: part * u64::from(qid - 1),
        seq_hi: part * u64::from(qid),
        seq,
        span,
        nlb,
        bs,
        io_bytes,
    };
    let mut written: HashSet<u64> = HashSet::new();
    let mut t = Totals {
        ops: 0,
        bytes: 0,
        verified: 0,
        hist: Histogram::new_with_bounds(1, 60_000_000, 3)?,
    };
    for s in 0..qd {
        st.issue(args, &mut q, s)?;
    }
    let mut expect = vec![0u8; bs as usize];
    loop {
        let bufs = &mut st.bufs;
        let ev = q.next_event_with(&mut |cid, off, d| {
            if let Some(b) = bufs.get_mut(usize::from(cid)) {
                let end = (off as usize + d.len()).min(b.len());
                b[off as usize..end].copy_from_slice(&d[..end - off as usize]);
            }
        })?;
        match ev {
            Event::R2t(r) => {
                let s = usize::from(r.cccid);
                q.answer_r2t(&r, &st.bufs[s])?;
            }
            Event::C2h { .. } => {}
            Event::Term { fes, fei } => bail!("queue {qid}: C2HTermReq FES {fes} FEI {fei}"),
            Event::Resp(c) => {
                let s = usize::from(c.cid);
                if s >= qd {
                    bail!("queue {qid}: CQE for unknown CID {}", c.cid);
                }
                if c.status != 0 {
                    bail!(
                        "queue {qid}: command at LBA {} failed: status {:#06x}",
                        st.lba[s],
                        c.status
                    );
                }
                let us = st.started[s].elapsed().as_micros().max(1) as u64;
                t.hist.record(us.min(60_000_000))?;
                t.ops += 1;
                t.bytes += io_bytes;
                let lba = st.lba[s];
                if args.verify {
                    if st.write[s] {
                        for k in 0..nlb {
                            written.insert(lba + k);
                        }
                    } else {
                        let check_all = !matches!(args.workload, Workload::Randrw);
                        for (k, b) in st.bufs[s].chunks_exact(bs as usize).enumerate() {
                            let l = lba + k as u64;
                            if check_all || written.contains(&l) {
                                fill(l, &mut expect);
                                if b != expect.as_slice() {
                                    bail!("queue {qid}: verify failed at LBA {l}");
                                }
                                t.verified += 1;
                            }
                        }
                    }
                }
                if stop.load(Ordering::Relaxed) {
                    // Drain: stop issuing; done once nothing is in flight.
                    st.lba[s] = u64::MAX;
                    if st.lba.iter().all(|&l| l == u64::MAX) {
                        return Ok(t);
                    }
                } else {
                    st.issue(args, &mut q, s)?;
                }
            }
        }
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.qd == 0 || args.qd > 127 || args.queues == 0 {
        bail!("--qd must be 1..=127 and --queues at least 1");
    }
    let nqn = match &args.nqn {
        Some(n) => n.clone(),
        None => discover(args.addr, args.digests).context("discovery")?,
    };
    let mut aq = HostQueue::open(args.addr, args.digests, args.digests)?;
    let c = aq.connect(0, 31, 0xFFFF, &params(&nqn, 30_000))?;
    if c.status != 0 {
        bail!("admin Connect to {nqn}: status {:#06x}", c.status);
    }
    let cntlid = c.dw0 as u16;
    aq.enable()?;
    let n = u32::from(args.queues - 1);
    let sqe = Sqe {
        opcode: admin::SET_FEATURES,
        cid: 3,
        cdw10: u32::from(feature::NUMBER_OF_QUEUES),
        cdw11: n | (n << 16),
        ..Sqe::default()
    };
    let (dw0, _) = admin_exec(&mut aq, sqe, Data::None, "Set Features Number of Queues")?;
    if (dw0 & 0xFFFF) < n {
        bail!("the controller granted {} I/O queues", (dw0 & 0xFFFF) + 1);
    }
    let sqe = Sqe {
        opcode: admin::IDENTIFY,
        cid: 4,
        nsid: 1,
        ..Sqe::default()
    };
    let (_, ns) = admin_exec(&mut aq, sqe, Data::In(4096), "Identify namespace")?;
    let nsze = u64::from_le_bytes(ns[0..8].try_into()?);
    let bs = 1u64 << ns[130];
    let blocks = match args.range_mib {
        Some(m) => (m << 20) / bs,
        None => nsze,
    }
    .min(nsze);
    let stop = Arc::new(AtomicBool::new(false));
    let args = Arc::new(args);
    let t0 = Instant::now();
    let handles: Vec<_> = (1..=args.queues)
        .map(|qid| {
            let (args, stop, nqn) = (Arc::clone(&args), Arc::clone(&stop), nqn.clone());
            std::thread::spawn(move || worker(&args, &nqn, cntlid, qid, bs, blocks, &stop))
        })
        .collect();
    // Keep the association alive while the workers run (KATO 30 s, Keep Alive every 5 s).
    let deadline = t0 + Duration::from_secs_f64(args.seconds);
    let mut last_ka = Instant::now();
    while Instant::now() < deadline && !handles.iter().all(|h| h.is_finished()) {
        std::thread::sleep(Duration::from_millis(50));
        if last_ka.elapsed() >= Duration::from_secs(5) {
            let ka = Sqe {
                opcode: admin::KEEP_ALIVE,
                cid: 6,
                ..Sqe::default()
            };
            admin_exec(&mut aq, ka, Data::None, "Keep Alive")?;
            last_ka = Instant::now();
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut all = Totals {
        ops: 0,
        bytes: 0,
        verified: 0,
        hist: Histogram::new_with_bounds(1, 60_000_000, 3)?,
    };
    for h in handles {
        let t = h.join().map_err(|_| anyhow::anyhow!("worker panicked"))??;
        all.ops += t.ops;
        all.bytes += t.bytes;
        all.verified += t.verified;
        all.hist.add(&t.hist)?;
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "{{\"workload\":\"{:?}\",\"queues\":{},\"qd\":{},\"seconds\":{secs:.3},\"ops\":{},\"iops\":{:.0},\"mib_s\":{:.1},\"lat_us\":{{\"p50\":{},\"p99\":{},\"p999\":{},\"max\":{}}},\"verified_blocks\":{}}}",
        args.workload,
        args.queues,
        args.qd,
        all.ops,
        all.ops as f64 / secs,
        all.bytes as f64 / secs / f64::from(1 << 20),
        all.hist.value_at_quantile(0.5),
        all.hist.value_at_quantile(0.99),
        all.hist.value_at_quantile(0.999),
        all.hist.max(),
        all.verified,
    );
    Ok(())
}
