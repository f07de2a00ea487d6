//! Array benchmark in the manner of SPDK's bdevperf: every reactor runs an in-process load
//! generator (fixed queue depth, block size, pattern, duration) as its front-end, against a
//! RAID5/RAID6 of `null` or `mem` members; beside each figure, the same load run directly
//! on one member in the same run, and the ratio.
//!
//! ```text
//! cargo run --release -p bench --bin array-bench -- [--device null|mem] [--reactors 1,2]
//! ```
//!
//! Workloads: `randread` and `randwrite` (4 KiB random), `seqwrite` (full-stripe
//! sequential writes), `degraded-randread` (4 KiB random reads with one member failed),
//! and the sub-stripe writes of the stripe-cache issue: `seqwrite-4k` (sequential 4 KiB
//! writes at `--qd`), `seqwrite-64k` (sequential 64 KiB writes at QD 8, whatever `--qd`),
//! `rewrite` (seed 003: the first `--rewrite-mib` MiB of each generator's region written
//! once with sequential 4 KiB writes, untimed, then written again and again, timed).
//! Figures: IOPS, GB/s (10^9 bytes/s), reactor CPU time per I/O (µs, thread CPU clock),
//! member I/O requests per array request, and stripe writes per write pass (batching).
//!
//! `--arrays N` (N > 1): many arrays on one reactor set (`engine::reactor::ReactorSet`,
//! `Reactors::start_on`). Each repetition runs, per reactor count, one array and then N
//! arrays of the same shape side by side on one set of that many reactors, each array on
//! members of its own and with load generators of its own (one per reactor at `--qd`: the
//! same load per array as alone); it prints per-array IOPS and GB/s, their sum, the
//! reactors' CPU µs per I/O over all arrays, and the ratios N arrays ÷ 1 array (per array
//! and total, paired within a repetition) beside the ideal on saturated reactors (1/N per
//! array, 1.00 in total). Example: `--device null --level 5 --workload randread,randwrite
//! --reactors 2 --arrays 2 --repeat 5`.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, ValueEnum};
use drivers::mem::MemDevice;
use drivers::null::NullDevice;
use engine::array::{ArrayCompletion, ArrayConfig, ArrayOp, ArrayRequest};
use engine::device::{BlockDevice, Channel, Completion, IoBuf, Op, Request, SubmitError};
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use engine::parity::Parity;
use engine::qos::{Pacer, Unpaced};
use engine::reactor::{Extras, Frontend, Io, Mode, ReactorConfig, ReactorSet, Reactors};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DeviceKind {
    Null,
    Mem,
    /// Sparse files in `--dir`, through io_uring with O_DIRECT (the production back end).
    File,
}

/// How parity is kept consistent across a crash (mdadm's `--consistency-policy` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Policy {
    /// Nothing logged (the bitmap's cost is not measured here).
    Resync,
    /// The Partial Parity Log: every stripe write logged on its parity member first (md's
    /// on RAID5; on RAID6 ferroraid's extension, logged on P's and Q's members;
    /// `engine::ppl`).
    Ppl,
}

impl Policy {
    /// What a row's workload cell adds: nothing for `resync`, ` (ppl)` for `ppl`.
    fn label(self) -> &'static str {
        match self {
            Policy::Resync => "",
            Policy::Ppl => " (ppl)",
        }
    }
}

/// Where the PPL area starts on every member (mdadm's v1.2 place: 8 sectors after the
/// superblock at sector 8), its size (mdadm's 2048 sectors) and where the data starts
/// (mdadm's data offset for a PPL array), bytes. Every policy uses the same layout.
const PPL_AREA_OFFSET: u64 = 16 * 512;
const PPL_AREA_BYTES: u64 = 2048 * 512;
const DATA_OFFSET: u64 = 4096 * 512;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Workload {
    Randread,
    Randwrite,
    Seqwrite,
    DegradedRandread,
    #[value(name = "seqwrite-4k")]
    Seqwrite4k,
    #[value(name = "seqwrite-64k")]
    Seqwrite64k,
    Rewrite,
}

impl Workload {
    /// Whether the generator walks its region sequentially in `bs` steps.
    fn sequential(self) -> bool {
        matches!(
            self,
            Workload::Seqwrite | Workload::Seqwrite4k | Workload::Seqwrite64k | Workload::Rewrite
        )
    }

    /// Request size, bytes, on an array whose stripes hold `stripe_bytes` of data.
    fn block_bytes(self, stripe_bytes: u64) -> u64 {
        match self {
            Workload::Seqwrite => stripe_bytes,
            Workload::Seqwrite64k => 64 << 10,
            _ => 4096,
        }
    }

    /// Requests in flight per generator.
    fn depth(self, qd: usize) -> usize {
        if self == Workload::Seqwrite64k {
            8
        } else {
            qd
        }
    }
}

#[derive(Parser, Debug)]
#[command(about = "bdevperf-style array benchmark on null/mem members")]
struct Args {
    /// Member device kind.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "null,mem")]
    device: Vec<DeviceKind>,
    /// Reactor counts to run.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    reactors: Vec<usize>,
    /// Workloads.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "randread,randwrite,seqwrite,degraded-randread"
    )]
    workload: Vec<Workload>,
    /// Levels (5 runs with 5 members, 6 with 6).
    #[arg(long, value_delimiter = ',', default_value = "5,6")]
    level: Vec<u32>,
    /// Chunk size, KiB.
    #[arg(long, default_value_t = 64)]
    chunk_kib: u64,
    /// Member size, MiB.
    #[arg(long, default_value_t = 256)]
    member_mib: u64,
    /// Requests in flight per reactor.
    #[arg(long, default_value_t = 32)]
    qd: usize,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Send every read to its stripe's owner (no foreign reads; for comparison).
    #[arg(long)]
    no_foreign_reads: bool,
    /// Each reactor's generator addresses only the stripes its own reactor owns: no request
    /// moves between reactors (for comparison: what the hops cost).
    #[arg(long)]
    local_only: bool,
    /// Measurements per figure: each repetition runs every reactor count back to back;
    /// tables give the median (and min–max) over repetitions, scaling as the median of the
    /// ratios paired within a repetition.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=99))]
    repeat: u32,
    /// `rewrite`: the region each generator writes once and then rewrites, MiB.
    #[arg(long, default_value_t = 64)]
    rewrite_mib: u64,
    /// Consistency policies to run (each row names its own).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "resync")]
    consistency: Vec<Policy>,
    /// Directory for `--device file` members (created and removed per measurement).
    #[arg(long, default_value = "/var/tmp")]
    dir: std::path::PathBuf,
    /// Arrays side by side on one reactor set (`ReactorSet`, `Reactors::start_on`): with
    /// N > 1, every configuration runs N arrays of the same shape, each on members of its
    /// own and with load generators of its own (one per reactor, `--qd` each: every array
    /// gets the load one array gets alone), all on one set of `--reactors` threads for the
    /// same `--seconds`; each repetition runs 1 array and then the N arrays on a set of
    /// that size, and the tables give per-array and total IOPS, and the ratios N ÷ 1
    /// paired within a repetition. (The raw member references are not run in this mode.)
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    arrays: u32,
    /// Also measure the raw-member reference through a reactor: the same load generator,
    /// hosted on a reactor beside an idle array, submitting straight to one member's
    /// channel. The table gains two columns, its IOPS and the ns per I/O the array adds
    /// over it (1e9/array IOPS − 1e9/reference IOPS, per reactor): like for like with
    /// SPDK's added ns, whose raw reference runs through bdevperf and the bdev layer as its
    /// RAID run does. (Not run with `--arrays`.)
    #[arg(long)]
    reactor_raw: bool,
    /// KiB of bulk-write stripe operations one reactor turn admits
    /// (`ArrayConfig::bulk_bytes_per_turn`; without the option the engine's
    /// `BULK_BYTES_PER_TURN`, 256 KiB; docs/PACING.md, "Parity and copy work per turn");
    /// `max`: no bound. The bound holds only for `TURN_BOUND_HOLD_NS` (1 s) after a request
    /// that is not a bulk write, so a writer of 128 KiB or larger requests alone never
    /// meets it.
    #[arg(long, value_parser = parse_turn_bound)]
    bulk_kib_per_turn: Option<TurnBound>,
}

/// `--bulk-kib-per-turn`'s value, bytes (`u64::MAX`: no bound).
#[derive(Clone, Copy, Debug)]
struct TurnBound(u64);

/// Parses `--bulk-kib-per-turn`: a KiB count of at least 1, or `max`.
fn parse_turn_bound(s: &str) -> Result<TurnBound, String> {
    if s == "max" {
        return Ok(TurnBound(u64::MAX));
    }
    match s.parse::<u64>() {
        Ok(k) if (1..=u64::MAX >> 10).contains(&k) => Ok(TurnBound(k << 10)),
        _ => Err(format!("{s}: expected a KiB count of at least 1, or `max`")),
    }
}

/// Thread CPU time, ns (CLOCK_THREAD_CPUTIME_ID).
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into valid memory we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// What one load generator measured.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    /// Timed requests completed.
    ios: u64,
    /// Member requests issued over the whole run (warm-up and drain included).
    member_ios: u64,
    /// Stripe reads and writes the array served over the whole run.
    requests: u64,
    /// Write passes and the stripe writes they served (whole run).
    passes: u64,
    batched: u64,
    bytes: u64,
    errors: u64,
    wall: Duration,
    cpu_ns: u64,
}

impl Tally {
    /// Adds one generator's timed figures (requests, bytes, errors, CPU time; the longest
    /// wall time).
    fn add_timed(&mut self, g: &Tally) {
        self.ios += g.ios;
        self.bytes += g.bytes;
        self.errors += g.errors;
        self.cpu_ns += g.cpu_ns;
        self.wall = self.wall.max(g.wall);
    }
}

/// The stripes one reactor owns (`stripe % reactors == me`, [`engine::shard::owner`]).
#[derive(Clone, Copy, Debug)]
struct OwnStripes {
    me: u64,
    reactors: u64,
    /// Data bytes per stripe.
    stripe_bytes: u64,
    /// How many stripes the reactor owns.
    count: u64,
}

impl OwnStripes {
    fn new(me: usize, reactors: usize, stripe_bytes: u64, stripes: u64) -> Self {
        let (me, reactors) = (me as u64, reactors as u64);
        Self {
            me,
            reactors,
            stripe_bytes,
            count: stripes.saturating_sub(me).div_ceil(reactors),
        }
    }

    /// Byte offset of the `k`-th stripe the reactor owns.
    fn offset(&self, k: u64) -> u64 {
        (self.me + k * self.reactors) * self.stripe_bytes
    }
}

/// Bytes of a huge page on x86-64 (where the request buffers start, [`ClientBufs`]).
const HUGE_PAGE: usize = 2 << 20;

/// A load generator's request buffers: `count` buffers of `len` bytes each, back to back in
/// one anonymous mapping that starts on a 2 MiB boundary and asks for transparent huge
/// pages before the first touch (as bdevperf's buffers come from DPDK's huge pages; in
/// THP's `madvise` mode only an advised mapping gets them), every page faulted in here:
/// a full-stripe write then reads 256 KiB of client data through a few TLB entries, not
/// 64. Where the kernel gives no huge pages the buffers are ordinary pages.
struct ClientBufs {
    /// Owns the mapping. Not dereferenced after `new`: the buffers go out as raw pointers
    /// (`ptr`), and a slice over the whole mapping would alias the buffers of requests in
    /// flight.
    _map: memmap2::MmapMut,
    /// Start of buffer 0 (the mapping's first 2 MiB boundary).
    base: NonNull<u8>,
    /// Bytes per buffer (a multiple of 4 KiB: `bs`).
    len: usize,
    count: usize,
}

// SAFETY: `base` points into the mapping that `_map` owns (moving the struct moves that
// ownership, the address stays); the struct hands out only raw pointers, whose use the
// generator's slot discipline governs (one request per buffer at a time).
unsafe impl Send for ClientBufs {}

impl ClientBufs {
    fn new(count: usize, len: usize) -> Result<Self> {
        let mut map = memmap2::MmapOptions::new()
            .len(count * len + HUGE_PAGE)
            .map_anon()
            .context("mapping the request buffers")?;
        // Advisory: without huge pages the buffers still work.
        let _ = map.advise(memmap2::Advice::HugePage);
        let off = (map.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - map.as_ptr() as usize;
        // Fault every page in now, not inside the timed run.
        map[off..off + count * len].fill(0);
        // `off` < HUGE_PAGE and the mapping is `count * len + HUGE_PAGE` bytes: in bounds.
        let base = NonNull::new(map[off..].as_mut_ptr()).expect("a mapping is not at 0");
        Ok(Self {
            _map: map,
            base,
            len,
            count,
        })
    }

    /// Buffer `i` (< `count`): `len` bytes, 4 KiB aligned.
    fn ptr(&self, i: usize) -> NonNull<u8> {
        assert!(i < self.count, "buffer {i} of {}", self.count);
        // SAFETY: i * len + len <= count * len bytes from `base` lie inside the mapping.
        unsafe { self.base.add(i * self.len) }
    }
}

/// The per-reactor load generator (front-end).
struct LoadGen {
    workload: Workload,
    bs: u64,
    /// Blocks of `bs` bytes random workloads draw from, starting at `random_from`: the
    /// whole array on the array path (divided once here, not per request).
    blocks: u64,
    /// Byte offset of the first block random workloads draw (0 on the array path; the
    /// reactor's own share of the member for the raw reference through a reactor).
    random_from: u64,
    /// Region of the array this generator covers (sequential writes: disjoint per reactor).
    region: (u64, u64),
    next_seq: u64,
    /// `rewrite`: bytes of the region rewritten (the untimed first write covers them once).
    rewrite_len: u64,
    /// `rewrite`: the first write is still going.
    warming: bool,
    /// `rewrite`: bytes of the first write issued.
    warm_sent: u64,
    /// `--local-only`: only the stripes its own reactor owns.
    own: Option<OwnStripes>,
    bufs: ClientBufs,
    free: Vec<usize>,
    /// Offsets of random workloads: a cheap generator (xoshiro256++, as bdevperf uses
    /// `rand_r`), so the generator's cost does not hide the array's.
    rng: SmallRng,
    /// Timed length of the run, ns of the reactor's clock.
    duration_ns: u64,
    /// Start of the timed run: wall clock, thread CPU ns, reactor clock ns.
    start: Option<(Instant, u64, u64)>,
    tally: Tally,
    stopping: bool,
    /// Side by side runs (`--arrays`): submit nothing until the flag is set, so that every
    /// array's generators start together once all arrays' shards are up; `None` (one
    /// array, and after the flag was seen): start at the first poll.
    go: Option<Arc<AtomicBool>>,
}

impl LoadGen {
    fn request(&mut self, slot: usize) -> ArrayRequest {
        let (off, op) = match (self.workload, self.own) {
            // bs is one stripe's data: one own stripe after the other.
            (Workload::Seqwrite, Some(own)) => {
                let off = own.offset(self.next_seq);
                self.next_seq = (self.next_seq + 1) % own.count;
                (off, ArrayOp::Write { fua: false })
            }
            (w, None) if w.sequential() => {
                let span = if w == Workload::Rewrite {
                    self.rewrite_len
                } else {
                    self.region.1 - self.region.0
                };
                let off = self.region.0 + self.next_seq;
                self.next_seq = (self.next_seq + self.bs) % span;
                (off, ArrayOp::Write { fua: false })
            }
            (w, own) => {
                let off = match own {
                    Some(own) => {
                        let stripe = own.offset(self.rng.gen_range(0..own.count));
                        stripe + self.rng.gen_range(0..own.stripe_bytes / self.bs) * self.bs
                    }
                    None => self.random_from + self.rng.gen_range(0..self.blocks) * self.bs,
                };
                let op = if w == Workload::Randwrite {
                    ArrayOp::Write { fua: false }
                } else {
                    ArrayOp::Read
                };
                (off, op)
            }
        };
        self.request_at(slot, off, op)
    }

    /// Whether the timed run goes on at `now` (ns of the reactor's turn clock): the first
    /// call starts it, and the first call `duration_ns` later ends it (then `false` for
    /// good). The reactor's turn clock decides when the run ends (one clock read per turn,
    /// as bdevperf's run timer reads its reactor's tick count); the wall time and CPU time
    /// the figures divide by are read once at each end.
    fn running(&mut self, now: u64) -> bool {
        let (t0, _, t0_ns) = *self
            .start
            .get_or_insert_with(|| (Instant::now(), thread_cpu_ns(), now));
        if now.saturating_sub(t0_ns) >= self.duration_ns {
            if !self.stopping {
                self.stopping = true;
                self.tally.wall = t0.elapsed();
                self.tally.cpu_ns = thread_cpu_ns() - self.start.expect("started").1;
            }
            return false;
        }
        true
    }

    /// The request of buffer `slot` came back, `ok` or failed: counted (inside the timed
    /// run) and its buffer free again.
    fn done(&mut self, slot: usize, ok: bool) {
        if !ok {
            self.tally.errors += 1;
        }
        if !self.stopping && !self.warming {
            self.tally.ios += 1;
            self.tally.bytes += self.bs;
        }
        self.free.push(slot);
    }

    /// Request `op` at byte `off` with buffer `slot`.
    fn request_at(&mut self, slot: usize, off: u64, op: ArrayOp) -> ArrayRequest {
        let len = self.bufs.len as u32;
        // SAFETY: buffer `slot` is owned by this generator and untouched until its request
        // completes (the slot returns to `free` only then).
        let buf = unsafe { IoBuf::from_raw(self.bufs.ptr(slot), len, None) };
        ArrayRequest {
            tag: slot as u64,
            op,
            offset_bytes: off,
            len_bytes: len,
            buf,
        }
    }
}

impl Frontend for LoadGen {
    fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
        if let Some(go) = &self.go {
            if !go.load(Ordering::Acquire) {
                return false;
            }
            self.go = None;
        }
        if self.warming {
            // `rewrite`: write the region once, untimed; the timed run starts when every
            // write of it is back.
            let mut any = false;
            while self.warm_sent < self.rewrite_len {
                let Some(slot) = self.free.pop() else { break };
                let off = self.region.0 + self.warm_sent;
                let r = self.request_at(slot, off, ArrayOp::Write { fua: false });
                if io.submit(r).is_err() {
                    self.free.push(slot);
                    break;
                }
                self.warm_sent += self.bs;
                any = true;
            }
            if self.warm_sent >= self.rewrite_len && self.free.len() == self.bufs.count {
                self.warming = false;
            }
            return any;
        }
        if !self.running(io.now_ns()) {
            return false;
        }
        let mut any = false;
        while let Some(slot) = self.free.pop() {
            let r = self.request(slot);
            if io.submit(r).is_err() {
                self.free.push(slot);
                break;
            }
            any = true;
        }
        any
    }

    fn complete(&mut self, c: ArrayCompletion) {
        self.done(c.tag as usize, c.status.is_ok());
    }

    fn finished(&self) -> bool {
        self.stopping && self.free.len() == self.bufs.count
    }
}

/// The raw-member reference through a reactor (`--reactor-raw`): a [`LoadGen`] hosted on a
/// reactor as the array's generators are, whose requests go straight to a channel of one
/// member (opened by [`run_reactor_raw`], moved to the reactor with the generator)
/// instead of through the array. The reactor hosts an idle array beside it, so each turn
/// costs what it costs in the array run; the difference to the array run is then the
/// array's own cost, as SPDK's raw reference (bdevperf over a raw bdev, through the bdev
/// layer) leaves only raid5f's.
struct RawGen<Ch: Channel> {
    gen: LoadGen,
    ch: Ch,
    /// Completions reaped per poll (the reactor reaps member channels in batches of 64).
    comps: Vec<Completion>,
}

impl<Ch: Channel + Send + 'static> Frontend for RawGen<Ch> {
    fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
        let ch = &mut self.ch;
        // Completions, then new requests: as on the array path, each buffer makes at most
        // one round trip per turn.
        let mut any = false;
        let n = ch.poll(&mut self.comps);
        for c in &self.comps[..n] {
            self.gen.done(c.tag as usize, c.status.is_ok());
            any = true;
        }
        if !self.gen.running(io.now_ns()) {
            return any;
        }
        while let Some(slot) = self.gen.free.pop() {
            let r = self.gen.request(slot);
            let op = match r.op {
                ArrayOp::Read => Op::Read,
                _ => Op::Write { fua: false },
            };
            let req = Request {
                tag: r.tag,
                op,
                offset_bytes: r.offset_bytes,
                len_bytes: r.len_bytes,
                buf: r.buf,
            };
            match ch.submit(req) {
                Ok(()) => {}
                Err(SubmitError::QueueFull) => {
                    self.gen.free.push(slot);
                    break;
                }
                // Refused for good (e.g. over the member's largest transfer): counted as
                // failed, so the run ends with an error instead of measuring nothing. The
                // buffer is free again at once: no more submissions this turn.
                Err(_) => {
                    self.gen.done(slot, false);
                    break;
                }
            }
            any = true;
        }
        ch.kick();
        any
    }

    fn complete(&mut self, c: ArrayCompletion) {
        // Nothing goes through the array; a completion from it would be a bug here.
        debug_assert!(false, "the raw reference submits no array request");
        self.gen.done(c.tag as usize, c.status.is_ok());
    }

    fn finished(&self) -> bool {
        // Every buffer back: nothing in the member's channel.
        self.gen.finished()
    }
}

/// Runs `workload`'s load ([`LoadGen`]; the caller gives 4 KiB reads for
/// `degraded-randread`) on `reactors` reactors straight on member 1 of `devices` (one
/// channel per reactor, opened here), beside an idle array of `geo` over `devices` (built
/// for `workload` with no consistency policy whatever the row's): the raw-member reference
/// through a reactor ([`RawGen`]). As the bare-loop reference ([`raw_load`]) with one
/// reactor: random offsets over the member's capacity, sequential ones through all of it
/// (`rewrite` with no untimed first pass). With more, each reactor's generator keeps to its
/// own share of the member (an equal part, disjoint from the others'): the shares make up
/// the member, and no two reactors touch the same bytes.
///
/// # Errors
/// A channel that cannot be opened, reactors that cannot start, or requests that failed.
fn run_reactor_raw<D>(
    devices: Arc<Vec<D>>,
    geo: ArrayGeometry,
    workload: Workload,
    reactors: usize,
    args: &Args,
) -> Result<Tally>
where
    D: BlockDevice + Send + Sync + 'static,
    D::Channel: Send + 'static,
{
    let cap = devices[1].info().capacity_bytes;
    let gens = load_gens(geo, workload, reactors, args, None)?
        .into_iter()
        .enumerate()
        .map(|(i, mut gen)| {
            // Each reactor its own share of the member: two reactors writing the same
            // member bytes at once would race (a `mem` member's store is plain memory).
            let share = cap / reactors as u64 / gen.bs * gen.bs;
            ensure!(
                share > 0,
                "the member is smaller than one request per reactor"
            );
            gen.blocks = share / gen.bs;
            gen.random_from = share * i as u64;
            gen.region = (gen.random_from, gen.random_from + share);
            gen.own = None;
            gen.warming = false;
            gen.rewrite_len = share;
            gen.next_seq = 0;
            let ch = devices[1]
                .open_channel()
                .context("a raw member channel for a reactor")?;
            Ok(RawGen {
                gen,
                ch,
                comps: vec![Completion::EMPTY; 64],
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let cfg = array_config(workload, args);
    let (done, _) = run_frontends(devices, geo, cfg, Policy::Resync, gens, args)
        .context("the raw reference through a reactor")?;
    let mut t = Tally::default();
    for g in done {
        t.add_timed(&g.gen.tally);
    }
    if t.errors > 0 {
        bail!("{} raw reference requests failed", t.errors);
    }
    Ok(t)
}

/// The same load straight on member channels (no array): round-robin over `devs` (one
/// device: the "raw member" reference; all members: the same memory footprint as the
/// array). `part`: (this thread's index, threads): the thread keeps to its own share of
/// each device (an equal part, disjoint from the other threads'; the shares make up the
/// device), so no two threads touch the same bytes. Requests the device refused for good,
/// or that completed with an error, count in [`Tally::errors`] (the caller fails the run).
fn raw_load<D: BlockDevice>(
    devs: &[D],
    workload: Workload,
    bs: u64,
    qd: usize,
    duration: Duration,
    part: (u64, u64),
) -> Tally {
    let mut chans: Vec<D::Channel> = devs
        .iter()
        .map(|d| d.open_channel().expect("raw channel"))
        .collect();
    let cap = devs[0].info().capacity_bytes;
    // The same kind of buffers as the array's generators use.
    let bufs = ClientBufs::new(qd, bs as usize).expect("mapping the raw load's buffers");
    let mut free: Vec<usize> = (0..qd).collect();
    let mut rng = SmallRng::seed_from_u64(7 + part.0);
    let mut seq = 0u64;
    let blocks = (cap / part.1 / bs).max(1);
    let base = blocks * bs * part.0;
    let mut next = 0usize;
    let mut comps = vec![Completion::EMPTY; 64];
    let mut t = Tally::default();
    let (t0, c0) = (Instant::now(), thread_cpu_ns());
    while t0.elapsed() < duration {
        while let Some(slot) = free.pop() {
            let off = base
                + if workload.sequential() {
                    seq = (seq + bs) % (blocks * bs);
                    seq
                } else {
                    rng.gen_range(0..blocks) * bs
                };
            let op = match workload {
                Workload::Randread | Workload::DegradedRandread => Op::Read,
                _ => Op::Write { fua: false },
            };
            // SAFETY: buffer `slot` is untouched until its completion returns the slot.
            let buf = unsafe { IoBuf::from_raw(bufs.ptr(slot), bs as u32, None) };
            next = (next + 1) % chans.len();
            let req = Request {
                tag: slot as u64,
                op,
                offset_bytes: off,
                len_bytes: bs as u32,
                buf,
            };
            match chans[next].submit(req) {
                Ok(()) => {}
                Err(SubmitError::QueueFull) => {
                    free.push(slot);
                    break;
                }
                // Refused for good (e.g. over the device's largest transfer): the run
                // fails rather than measuring nothing.
                Err(_) => {
                    free.push(slot);
                    t.errors += 1;
                    break;
                }
            }
        }
        for ch in &mut chans {
            ch.kick();
            let n = ch.poll(&mut comps);
            for c in &comps[..n] {
                if c.status.is_ok() {
                    t.ios += 1;
                    t.bytes += bs;
                } else {
                    t.errors += 1;
                }
                free.push(c.tag as usize);
            }
        }
        if t.errors > 0 {
            break;
        }
    }
    t.wall = t0.elapsed();
    t.cpu_ns = thread_cpu_ns() - c0;
    for ch in &mut chans {
        while ch.in_flight() > 0 {
            ch.poll(&mut comps);
        }
    }
    t
}

/// One load generator per reactor for an array of `geo` (`--qd` requests in flight each,
/// or the workload's own depth), seeded per reactor; `go` as [`LoadGen::go`].
fn load_gens(
    geo: ArrayGeometry,
    workload: Workload,
    reactors: usize,
    args: &Args,
    go: Option<&Arc<AtomicBool>>,
) -> Result<Vec<LoadGen>> {
    let g = geo.geometry();
    let bs = workload.block_bytes(g.stripe_data_bytes());
    let qd = workload.depth(args.qd);
    let cap = geo.capacity_bytes();
    if args.local_only && geo.stripes() < reactors as u64 {
        bail!(
            "--local-only: {} stripes cannot give each of {reactors} reactors one of its own",
            geo.stripes()
        );
    }
    let share = cap / reactors as u64 / g.stripe_data_bytes() * g.stripe_data_bytes();
    let rewrite_len = (args.rewrite_mib << 20).min(share) / bs * bs;
    (0..reactors)
        .map(|i| {
            Ok(LoadGen {
                workload,
                bs,
                blocks: cap / bs,
                random_from: 0,
                region: (i as u64 * share, (i as u64 + 1) * share),
                next_seq: 0,
                rewrite_len,
                warming: workload == Workload::Rewrite,
                warm_sent: 0,
                own: args
                    .local_only
                    .then(|| OwnStripes::new(i, reactors, g.stripe_data_bytes(), geo.stripes())),
                bufs: ClientBufs::new(qd, bs as usize)?,
                free: (0..qd).collect(),
                rng: SmallRng::seed_from_u64(100 + i as u64),
                duration_ns: (args.seconds * 1e9) as u64,
                start: None,
                tally: Tally::default(),
                stopping: false,
                go: go.cloned(),
            })
        })
        .collect()
}

/// The array configuration every run uses: tables sized for `--qd`, member 0 failed for
/// `degraded-randread`.
fn array_config(workload: Workload, args: &Args) -> ArrayConfig {
    ArrayConfig {
        requests: args.qd * 2,
        stripe_ops: args.qd * 2,
        data_offset_bytes: DATA_OFFSET,
        bulk_bytes_per_turn: args
            .bulk_kib_per_turn
            .map_or(engine::array::BULK_BYTES_PER_TURN, |b| b.0),
        failed_members: [
            if workload == Workload::DegradedRandread {
                Some(0)
            } else {
                None
            },
            None,
        ],
        ..ArrayConfig::default()
    }
}

/// `reactors` polled reactors pinned to the allowed CPUs in turn ([`cpu`]).
fn reactor_config(reactors: usize, args: &Args) -> ReactorConfig {
    ReactorConfig {
        cores: (0..reactors).map(|i| Some(cpu(i))).collect(),
        mode: Mode::Polled,
        requests: args.qd * 2,
        foreign_reads: !args.no_foreign_reads,
    }
}

/// What [`Reactors::start_with`] adds for `policy`: no pacing, no bitmap, and for `ppl` a
/// Partial Parity Log of the array's own.
fn extras_for(
    policy: Policy,
    geo: ArrayGeometry,
) -> Extras<impl Fn(usize) -> Box<dyn Pacer> + Send + Sync + 'static> {
    let ppl = (policy == Policy::Ppl).then(|| {
        Arc::new(engine::ppl::PplShared::new(
            usize::from(geo.geometry().members()),
            PPL_AREA_OFFSET,
            PPL_AREA_BYTES,
            0x5eed,
        ))
    });
    Extras {
        pacer: |_| Box::new(Unpaced) as Box<dyn Pacer>,
        bitmap: None,
        ppl,
        replace: None,
        confirm_replace: false,
        confirm_failures: false,
    }
}

fn run_array<D>(
    devices: Arc<Vec<D>>,
    geo: ArrayGeometry,
    workload: Workload,
    reactors: usize,
    policy: Policy,
    args: &Args,
) -> Result<Tally>
where
    D: BlockDevice + Send + Sync + 'static,
{
    let gens = load_gens(geo, workload, reactors, args, None)?;
    let cfg = array_config(workload, args);
    let (done, snap) = run_frontends(devices, geo, cfg, policy, gens, args)?;
    let mut t = Tally::default();
    for g in done {
        t.add_timed(&g.tally);
    }
    for m in &snap.members {
        t.member_ios += m.counters.reads + m.counters.writes;
    }
    t.requests = snap.stats.direct_reads
        + snap.stats.degraded_reads
        + snap.stats.batched_writes
        + snap.stats.degraded_writes;
    t.passes = snap.stats.write_passes;
    t.batched = snap.stats.batched_writes;
    if t.errors > 0 {
        bail!("{} requests failed", t.errors);
    }
    Ok(t)
}

/// Runs `gens` on as many reactors ([`reactor_config`]), one each, over an array of
/// `geo` on `devices` built with `cfg` and `policy`'s extras, until every one has
/// finished; returns them and the array's figures at the end.
fn run_frontends<F, D>(
    devices: Arc<Vec<D>>,
    geo: ArrayGeometry,
    cfg: ArrayConfig,
    policy: Policy,
    gens: Vec<F>,
    args: &Args,
) -> Result<(Vec<F>, engine::reactor::ArraySnapshot)>
where
    F: Frontend,
    D: BlockDevice + Send + Sync + 'static,
{
    let running = Reactors::start_with(
        devices,
        geo,
        Parity::new(),
        cfg,
        reactor_config(gens.len(), args),
        gens,
        extras_for(policy, geo),
    )
    .context("starting reactors")?;
    let handle = running.handle();
    let done = running.stop().context("stopping reactors")?;
    Ok((done, handle.snapshot()))
}

/// The CPUs this process may run on (its affinity mask, as `taskset` sets it), ascending:
/// reactors and raw-load threads are pinned to them in turn, so `taskset -c 1 array-bench`
/// runs on CPU 1 (pinning to `0..n` ignored the mask and escaped it).
fn allowed_cpus() -> &'static [usize] {
    static CPUS: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();
    CPUS.get_or_init(|| {
        let mut ids: Vec<usize> = core_affinity::get_core_ids()
            .unwrap_or_default()
            .into_iter()
            .map(|c| c.id)
            .collect();
        ids.sort_unstable();
        if ids.is_empty() {
            // The mask could not be read: every CPU the system reports.
            let n = std::thread::available_parallelism().map_or(1, |n| n.get());
            ids = (0..n).collect();
        }
        ids
    })
}

/// CPUs this process may run on.
fn num_cpus() -> usize {
    allowed_cpus().len()
}

/// The CPU for thread `i` of a run (reactor or raw-load thread `i`): the allowed CPUs in
/// turn.
fn cpu(i: usize) -> usize {
    let cpus = allowed_cpus();
    cpus[i % cpus.len()]
}

fn raw_parallel<D: BlockDevice + Sync>(
    dev: &[D],
    workload: Workload,
    bs: u64,
    qd: usize,
    threads: usize,
    duration: Duration,
) -> Tally {
    let tallies: Vec<Tally> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|i| {
                // Named apart from the reactors, so `perf report --comm reactor-N` holds
                // only the array's samples (without `--reactor-raw`, whose reference
                // runs on reactors too).
                std::thread::Builder::new()
                    .name(format!("raw-{i}"))
                    .spawn_scoped(s, move || {
                        core_affinity::set_for_current(core_affinity::CoreId { id: cpu(i) });
                        raw_load(dev, workload, bs, qd, duration, (i as u64, threads as u64))
                    })
                    .expect("spawning a raw-load thread")
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("raw thread"))
            .collect()
    });
    let mut t = Tally::default();
    for x in tallies {
        t.ios += x.ios;
        t.bytes += x.bytes;
        t.errors += x.errors;
        t.cpu_ns += x.cpu_ns;
        t.wall = t.wall.max(x.wall);
    }
    t
}

/// One measurement of one configuration.
#[derive(Clone, Copy, Debug)]
struct Sample {
    iops: f64,
    gb_per_s: f64,
    cpu_us_per_io: f64,
    raw_iops: f64,
    spread_iops: f64,
    /// The raw-member reference through a reactor (`--reactor-raw`, [`RawGen`]).
    reactor_raw_iops: Option<f64>,
    /// Member requests per array stripe request (whole run).
    member_ios_per_io: f64,
    /// Stripe writes per write pass (whole run; 0 without writes).
    writes_per_pass: f64,
}

/// `median` alone for one run, `median (min–max)` for several.
fn show(mut v: Vec<f64>, digits: usize, scale: f64, unit: &str) -> String {
    let n = v.len();
    // Sorts `v` in place: min and max are then its ends.
    let med = bench::median(&mut v);
    let (lo, hi) = (v[0], v[n - 1]);
    if n == 1 {
        format!("{:.*}{unit}", digits, med * scale)
    } else {
        format!(
            "{:.*}{unit} ({:.*}–{:.*})",
            digits,
            med * scale,
            digits,
            lo * scale,
            digits,
            hi * scale
        )
    }
}

/// `n` sparse member files of `member` bytes, `DIR/PREFIX{i}.img`, created and opened
/// through io_uring with O_DIRECT (queue depth 256).
fn file_members(
    dir: &std::path::Path,
    prefix: &str,
    n: u16,
    member: u64,
) -> Result<Vec<drivers::any::AnyDevice>> {
    let cfg = drivers::any::MemberConfig::with_queue_depth(256);
    (0..n)
        .map(|i| {
            let p = dir.join(format!("{prefix}{i}.img"));
            std::fs::File::create(&p)
                .and_then(|f| f.set_len(member))
                .with_context(|| format!("creating {}", p.display()))?;
            drivers::any::open_member(&p, &cfg).with_context(|| format!("opening {}", p.display()))
        })
        .collect()
}

/// Runs one configuration: the array, then the same load on one raw member and spread
/// over all members, on fresh devices; with `--reactor-raw` also the raw member through a
/// reactor ([`run_reactor_raw`]).
#[allow(clippy::too_many_arguments)]
fn measure(
    kind: DeviceKind,
    n: u16,
    member: u64,
    geo: ArrayGeometry,
    w: Workload,
    r: usize,
    policy: Policy,
    args: &Args,
) -> Result<Sample> {
    let g = geo.geometry();
    let bs = w.block_bytes(g.stripe_data_bytes());
    let raw_w = if w == Workload::DegradedRandread {
        Workload::Randread
    } else {
        w
    };
    let duration = Duration::from_secs_f64(args.seconds);
    // The array, then the same load on one raw member and spread over all of them.
    type Load = (Workload, Workload, u64, usize, Duration, Policy);
    fn run_all<D>(
        devs: Vec<D>,
        geo: ArrayGeometry,
        (w, raw_w, bs, r, duration, policy): Load,
        args: &Args,
    ) -> Result<(Tally, Tally, Tally, Option<Tally>)>
    where
        D: BlockDevice + Send + Sync + 'static,
        D::Channel: Send + 'static,
    {
        let devs = Arc::new(devs);
        let t = run_array(Arc::clone(&devs), geo, w, r, policy, args)?;
        let raw = raw_parallel(&devs[1..2], raw_w, bs, w.depth(args.qd), r, duration);
        let spread = raw_parallel(&devs[..], raw_w, bs, w.depth(args.qd), r, duration);
        for (x, what) in [(&raw, "raw member"), (&spread, "all members")] {
            if x.errors > 0 {
                bail!(
                    "{} requests of the {what} reference failed or were refused ({bs}-byte \
                     requests; a member takes at most {} bytes per request)",
                    x.errors,
                    devs[1].info().max_transfer_bytes
                );
            }
        }
        let reactor_raw = if args.reactor_raw {
            Some(run_reactor_raw(Arc::clone(&devs), geo, raw_w, r, args)?)
        } else {
            None
        };
        Ok((t, raw, spread, reactor_raw))
    }
    let load = (w, raw_w, bs, r, duration, policy);
    let member = DATA_OFFSET + member;
    let (t, raw, spread, reactor_raw) = match kind {
        DeviceKind::Null => run_all(
            (0..n)
                .map(|i| NullDevice::new(&format!("null{i}"), member, 512, 1024))
                .collect::<Result<_, _>>()?,
            geo,
            load,
            args,
        )?,
        DeviceKind::Mem => run_all(
            (0..n)
                .map(|i| MemDevice::new(&format!("mem{i}"), member, 512, 1024))
                .collect::<Result<_, _>>()?,
            geo,
            load,
            args,
        )?,
        DeviceKind::File => {
            let dir = tempfile::Builder::new()
                .prefix("array-bench-")
                .tempdir_in(&args.dir)
                .with_context(|| format!("a directory in {}", args.dir.display()))?;
            run_all(file_members(dir.path(), "m", n, member)?, geo, load, args)?
        }
    };
    let secs = t.wall.as_secs_f64();
    Ok(Sample {
        iops: t.ios as f64 / secs,
        gb_per_s: t.bytes as f64 / secs / 1e9,
        cpu_us_per_io: t.cpu_ns as f64 / 1e3 / t.ios.max(1) as f64,
        raw_iops: raw.ios as f64 / raw.wall.as_secs_f64(),
        spread_iops: spread.ios as f64 / spread.wall.as_secs_f64(),
        reactor_raw_iops: reactor_raw.map(|t| t.ios as f64 / t.wall.as_secs_f64()),
        member_ios_per_io: t.member_ios as f64 / t.requests.max(1) as f64,
        writes_per_pass: t.batched as f64 / t.passes.max(1) as f64,
    })
}

/// What one array of a side-by-side run (`--arrays`) did.
#[derive(Clone, Copy, Debug)]
struct ArrayFigures {
    iops: f64,
    /// 10^9 bytes per second.
    gb_per_s: f64,
}

/// One side-by-side run of arrays on one reactor set.
#[derive(Clone, Debug)]
struct SetSample {
    /// Each array's figures, in start order.
    arrays: Vec<ArrayFigures>,
    /// The reactor threads' CPU time over the run (per thread, from the first of its
    /// generators' start to the last one's end; thread CPU clock) ÷ all arrays' requests,
    /// µs. Not per array: a reactor's CPU clock counts every shard it turns.
    cpu_us_per_io: f64,
}

impl SetSample {
    fn total_iops(&self) -> f64 {
        self.arrays.iter().map(|a| a.iops).sum()
    }

    fn total_gb_per_s(&self) -> f64 {
        self.arrays.iter().map(|a| a.gb_per_s).sum()
    }
}

/// Runs one array per entry of `arrays` (each that array's members, member order), all of
/// shape `geo`, side by side on one [`ReactorSet`] of `reactors` polled threads pinned as
/// [`reactor_config`]: each array with its own load generators (one per reactor,
/// [`load_gens`]) and its own PPL for `ppl`. The generators wait until every reactor hosts
/// every array's shard, then all start together and run `--seconds`.
fn run_set<D>(
    arrays: Vec<Arc<Vec<D>>>,
    geo: ArrayGeometry,
    workload: Workload,
    reactors: usize,
    policy: Policy,
    args: &Args,
) -> Result<SetSample>
where
    D: BlockDevice + Send + Sync + 'static,
{
    let cfg = reactor_config(reactors, args);
    let set = ReactorSet::start(&cfg.cores, cfg.mode).context("starting the reactor set")?;
    let go = Arc::new(AtomicBool::new(false));
    let mut running = Vec::with_capacity(arrays.len());
    let mut first_err: Option<anyhow::Error> = None;
    for (k, devices) in arrays.into_iter().enumerate() {
        let started = load_gens(geo, workload, reactors, args, Some(&go)).and_then(|gens| {
            Reactors::start_on(
                &set,
                devices,
                geo,
                Parity::new(),
                array_config(workload, args),
                &cfg,
                gens,
                extras_for(policy, geo),
            )
            .with_context(|| format!("starting array {}", k + 1))
        });
        match started {
            Ok(r) => running.push(r),
            Err(e) => {
                first_err = Some(e);
                break;
            }
        }
    }
    // Each reactor builds its shards between turns; a shard that cannot be built never
    // counts, and its array's stop says why (hence the deadline).
    let deadline = Instant::now() + Duration::from_secs(10);
    while first_err.is_none()
        && set.hosted().iter().any(|&h| h < running.len())
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    go.store(true, Ordering::Release);
    let mut figures = Vec::with_capacity(running.len());
    // Per reactor: the earliest generator start and the latest end on its CPU clock.
    let mut spans: Vec<Option<(u64, u64)>> = vec![None; reactors];
    let mut ios_all = 0u64;
    // Every array is stopped, even after an error: the set shuts down only once none is
    // left on it.
    for (k, r) in running.into_iter().enumerate() {
        match r.stop() {
            Ok(gens) => {
                let (mut ios, mut bytes, mut errors, mut wall) = (0u64, 0u64, 0u64, Duration::ZERO);
                for (i, g) in gens.iter().enumerate() {
                    ios += g.tally.ios;
                    bytes += g.tally.bytes;
                    errors += g.tally.errors;
                    wall = wall.max(g.tally.wall);
                    if let Some((_, c0, _)) = g.start {
                        let c1 = c0 + g.tally.cpu_ns;
                        spans[i] = Some(spans[i].map_or((c0, c1), |(a, b)| (a.min(c0), b.max(c1))));
                    }
                }
                if errors > 0 {
                    first_err.get_or_insert_with(|| {
                        anyhow::anyhow!("array {}: {errors} requests failed", k + 1)
                    });
                }
                let secs = wall.as_secs_f64().max(f64::MIN_POSITIVE);
                ios_all += ios;
                figures.push(ArrayFigures {
                    iops: ios as f64 / secs,
                    gb_per_s: bytes as f64 / secs / 1e9,
                });
            }
            Err(e) => {
                first_err.get_or_insert_with(|| {
                    anyhow::Error::new(e).context(format!("array {}", k + 1))
                });
            }
        }
    }
    set.shutdown();
    if let Some(e) = first_err {
        return Err(e);
    }
    let cpu_ns: u64 = spans.iter().flatten().map(|&(a, b)| b - a).sum();
    Ok(SetSample {
        arrays: figures,
        cpu_us_per_io: cpu_ns as f64 / 1e3 / ios_all.max(1) as f64,
    })
}

/// [`run_set`] of `count` arrays of `n` fresh `kind` members of `member` data bytes each.
#[allow(clippy::too_many_arguments)]
fn measure_set(
    kind: DeviceKind,
    n: u16,
    member: u64,
    geo: ArrayGeometry,
    w: Workload,
    r: usize,
    count: usize,
    policy: Policy,
    args: &Args,
) -> Result<SetSample> {
    let member = DATA_OFFSET + member;
    match kind {
        DeviceKind::Null => {
            let arrays = (0..count)
                .map(|a| {
                    (0..n)
                        .map(|i| NullDevice::new(&format!("a{a}-null{i}"), member, 512, 1024))
                        .collect::<Result<Vec<_>, _>>()
                        .map(Arc::new)
                })
                .collect::<Result<Vec<_>, _>>()?;
            run_set(arrays, geo, w, r, policy, args)
        }
        DeviceKind::Mem => {
            let arrays = (0..count)
                .map(|a| {
                    (0..n)
                        .map(|i| MemDevice::new(&format!("a{a}-mem{i}"), member, 512, 1024))
                        .collect::<Result<Vec<_>, _>>()
                        .map(Arc::new)
                })
                .collect::<Result<Vec<_>, _>>()?;
            run_set(arrays, geo, w, r, policy, args)
        }
        DeviceKind::File => {
            let dir = tempfile::Builder::new()
                .prefix("array-bench-")
                .tempdir_in(&args.dir)
                .with_context(|| format!("a directory in {}", args.dir.display()))?;
            let arrays = (0..count)
                .map(|a| file_members(dir.path(), &format!("a{a}-m"), n, member).map(Arc::new))
                .collect::<Result<Vec<_>>>()?;
            run_set(arrays, geo, w, r, policy, args)
        }
    }
}

/// `--arrays N` (N > 1): for every device, level, workload and policy, each repetition
/// runs, per reactor count, 1 array and then N arrays on a reactor set of that size;
/// prints per-array and total figures, then the ratios N arrays ÷ 1 array paired within a
/// repetition, beside what they would be if the reactors were the only limit.
fn side_by_side(args: &Args) -> Result<()> {
    let count = args.arrays as usize;
    let chunk = args.chunk_kib * 1024;
    let member = args.member_mib << 20;
    println!(
        "| device | level | workload | reactors | arrays | array | IOPS | GB/s | CPU µs/IO (all arrays) |"
    );
    println!("|---|---|---|---:|---:|---|---:|---:|---:|");
    let mut ratios: Vec<String> = Vec::new();
    for &kind in &args.device {
        for &level in &args.level {
            let (lvl, n) = match level {
                5 => (Level::Raid5, 5u16),
                6 => (Level::Raid6, 6u16),
                other => bail!("--level {other}: expected 5 or 6"),
            };
            let g = Geometry::new(lvl, Layout::LeftSymmetric, n, chunk, 512)?;
            let geo = g.with_members(&vec![member; usize::from(n)], 0)?;
            for &w in &args.workload {
                for &policy in &args.consistency {
                    // samples[rep][i]: (1 array, N arrays) on args.reactors[i] reactors.
                    let mut samples: Vec<Vec<(SetSample, SetSample)>> = Vec::new();
                    for _ in 0..args.repeat {
                        let mut rep = Vec::new();
                        for &r in &args.reactors {
                            let one = measure_set(kind, n, member, geo, w, r, 1, policy, args)?;
                            let many =
                                measure_set(kind, n, member, geo, w, r, count, policy, args)?;
                            rep.push((one, many));
                        }
                        samples.push(rep);
                    }
                    let col = |f: &dyn Fn(&(SetSample, SetSample)) -> f64, i: usize| -> Vec<f64> {
                        samples.iter().map(|rep| f(&rep[i])).collect()
                    };
                    let label = policy.label();
                    for (i, &r) in args.reactors.iter().enumerate() {
                        println!(
                            "| {kind:?} | raid{level} | {w:?}{label} | {r} | 1 | 1 | {} | {} | {} |",
                            show(col(&|s| s.0.arrays[0].iops, i), 0, 1.0, ""),
                            show(col(&|s| s.0.arrays[0].gb_per_s, i), 2, 1.0, ""),
                            show(col(&|s| s.0.cpu_us_per_io, i), 2, 1.0, ""),
                        );
                        for k in 0..count {
                            println!(
                                "| {kind:?} | raid{level} | {w:?}{label} | {r} | {count} | {} | {} | {} | |",
                                k + 1,
                                show(col(&|s| s.1.arrays[k].iops, i), 0, 1.0, ""),
                                show(col(&|s| s.1.arrays[k].gb_per_s, i), 2, 1.0, ""),
                            );
                        }
                        println!(
                            "| {kind:?} | raid{level} | {w:?}{label} | {r} | {count} | sum | {} | {} | {} |",
                            show(col(&|s| s.1.total_iops(), i), 0, 1.0, ""),
                            show(col(&|s| s.1.total_gb_per_s(), i), 2, 1.0, ""),
                            show(col(&|s| s.1.cpu_us_per_io, i), 2, 1.0, ""),
                        );
                        let per_array: Vec<String> = (0..count)
                            .map(|k| {
                                show(
                                    col(&|s| s.1.arrays[k].iops / s.0.arrays[0].iops, i),
                                    2,
                                    1.0,
                                    "×",
                                )
                            })
                            .collect();
                        ratios.push(format!(
                            "| {kind:?} | raid{level} | {w:?}{label} | {r} | {count} | {} | {} | {} | {} | {:.2}× / 1.00× |",
                            per_array.join("; "),
                            show(
                                col(
                                    &|s| {
                                        s.1.arrays.iter().map(|a| a.iops).fold(f64::MAX, f64::min)
                                            / s.1.arrays.iter().map(|a| a.iops).fold(0.0, f64::max)
                                    },
                                    i
                                ),
                                2,
                                1.0,
                                ""
                            ),
                            show(col(&|s| s.1.total_iops() / s.0.arrays[0].iops, i), 2, 1.0, "×"),
                            show(col(&|s| s.1.cpu_us_per_io / s.0.cpu_us_per_io, i), 2, 1.0, "×"),
                            1.0 / count as f64,
                        ));
                    }
                }
            }
        }
    }
    println!(
        "\n| device | level | workload | reactors | arrays | per-array IOPS ÷ 1-array IOPS (array 1; 2; …) \
         | slowest ÷ fastest array | total IOPS ÷ 1-array IOPS | CPU µs/IO ÷ 1-array | ideal on saturated reactors (per array / total) |"
    );
    println!("|---|---|---|---:|---:|---|---:|---:|---:|---:|");
    for row in ratios {
        println!("{row}");
    }
    println!(
        "\n- Ideal: when the reactors' CPU is the limit (null members always; the load \
         generators run on the reactors, bdevperf-style, so their cost is the reactors' too), \
         {count} arrays on the same reactors share their time: each array gets ≈ 1/{count} of \
         what one array alone gets (per-array ratio ≈ {:.2}×) and the total stays ≈ 1.00×; \
         a total below 1.00× (and CPU µs/IO above 1.00×) is what hosting {count} shards per \
         reactor costs. When the members are the limit instead, per-array ratios up to 1.00× \
         are possible.",
        1.0 / count as f64
    );
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let chunk = args.chunk_kib * 1024;
    let member = args.member_mib << 20;
    println!("# ferroraid array benchmark (bdevperf-style)\n");
    println!(
        "- CPU: {} ({} cores available); reactors polled, pinned; qd {} per reactor{}; {} s per run; chunk {} KiB; members {} MiB{}{}\n",
        bench::cpu_model(),
        num_cpus(),
        args.qd,
        if args.arrays > 1 {
            format!(
                " and array; --arrays {}: each run is 1 array, then {} arrays side by side on \
                 one reactor set of the same size, each on members of its own",
                args.arrays, args.arrays
            )
        } else {
            String::new()
        },
        args.seconds,
        args.chunk_kib,
        args.member_mib,
        if args.repeat > 1 {
            format!(
                "; {} repetitions: median (min–max), ratios paired within a repetition",
                args.repeat
            )
        } else {
            String::new()
        },
        if args.local_only {
            "; --local-only: each generator addresses its own reactor's stripes"
        } else {
            ""
        }
    );
    let round_trip = || {
        if num_cpus() < 2 {
            return "one core only".to_string();
        }
        match bench::core_round_trip_ns(cpu(0), cpu(1), 200_000) {
            Some(ns) => format!("{ns:.0} ns"),
            None => "not measured (cores cannot be pinned)".to_string(),
        }
    };
    println!(
        "- cache-line round trip between cores 0 and 1 (the reactors' cores) at the start: {}\n",
        round_trip()
    );
    if args.arrays > 1 {
        side_by_side(&args)?;
        println!(
            "\n- cache-line round trip between cores 0 and 1 at the end: {}",
            round_trip()
        );
        return Ok(());
    }
    println!(
        "| device | level | workload | reactors | IOPS | GB/s | CPU µs/IO | raw member IOPS (same threads) | array ÷ raw \
         | raw spread over all members | array ÷ spread | member I/O per request | writes per pass |{}",
        if args.reactor_raw {
            " raw member through a reactor, IOPS | ns per I/O added over it (per reactor) |"
        } else {
            ""
        }
    );
    println!(
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|{}",
        if args.reactor_raw { "---:|---:|" } else { "" }
    );
    let base = *args.reactors.iter().min().expect("clap requires a value");
    // Scaling rows, printed after the main table.
    let mut scaling: Vec<String> = Vec::new();
    for &kind in &args.device {
        for &level in &args.level {
            let (lvl, n) = match level {
                5 => (Level::Raid5, 5u16),
                6 => (Level::Raid6, 6u16),
                other => bail!("--level {other}: expected 5 or 6"),
            };
            let g = Geometry::new(lvl, Layout::LeftSymmetric, n, chunk, 512)?;
            let geo = g.with_members(&vec![member; usize::from(n)], 0)?;
            for &w in &args.workload {
                for &policy in &args.consistency {
                    // samples[rep][i]: repetition rep, reactor count args.reactors[i].
                    let mut samples: Vec<Vec<Sample>> = Vec::new();
                    for _ in 0..args.repeat {
                        let mut rep = Vec::new();
                        for &r in &args.reactors {
                            rep.push(measure(kind, n, member, geo, w, r, policy, &args)?);
                        }
                        samples.push(rep);
                    }
                    let col = |i: usize, f: &dyn Fn(&Sample) -> f64| -> Vec<f64> {
                        samples.iter().map(|rep| f(&rep[i])).collect()
                    };
                    for (i, &r) in args.reactors.iter().enumerate() {
                        let reactor_raw = if args.reactor_raw {
                            let per = r as f64 * 1e9;
                            format!(
                                " {} | {} |",
                                show(col(i, &|s| s.reactor_raw_iops.unwrap_or(0.0)), 0, 1.0, ""),
                                show(
                                    col(i, &|s| {
                                        per / s.iops - per / s.reactor_raw_iops.unwrap_or(f64::NAN)
                                    }),
                                    1,
                                    1.0,
                                    ""
                                ),
                            )
                        } else {
                            String::new()
                        };
                        println!(
                        "| {kind:?} | raid{level} | {w:?}{} | {r} | {} | {} | {} | {} | {} | {} | {} | {} | {} |{reactor_raw}",
                        policy.label(),
                        show(col(i, &|s| s.iops), 0, 1.0, ""),
                        show(col(i, &|s| s.gb_per_s), 2, 1.0, ""),
                        show(col(i, &|s| s.cpu_us_per_io), 2, 1.0, ""),
                        show(col(i, &|s| s.raw_iops), 0, 1.0, ""),
                        show(col(i, &|s| s.iops / s.raw_iops), 0, 100.0, "%"),
                        show(col(i, &|s| s.spread_iops), 0, 1.0, ""),
                        show(col(i, &|s| s.iops / s.spread_iops), 0, 100.0, "%"),
                        show(col(i, &|s| s.member_ios_per_io), 2, 1.0, ""),
                        show(col(i, &|s| s.writes_per_pass), 1, 1.0, ""),
                    );
                    }
                    let b = args
                        .reactors
                        .iter()
                        .position(|&r| r == base)
                        .expect("base is one of them");
                    for (i, &r) in args.reactors.iter().enumerate() {
                        if r != base {
                            let ratios = samples.iter().map(|rep| rep[i].iops / rep[b].iops);
                            scaling.push(format!(
                                "| {kind:?} | raid{level} | {w:?}{} | {r} | {} |",
                                policy.label(),
                                show(ratios.collect(), 2, 1.0, "×")
                            ));
                        }
                    }
                }
            }
        }
    }
    println!(
        "\n- cache-line round trip between cores 0 and 1 at the end: {}",
        round_trip()
    );
    if !scaling.is_empty() {
        println!("\n| device | level | workload | reactors | IOPS vs {base} reactor(s) |");
        println!("|---|---|---|---:|---:|");
        for row in scaling {
            println!("{row}");
        }
    }
    Ok(())
}
