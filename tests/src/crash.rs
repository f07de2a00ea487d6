//! The simulated crash world shared by the model test's crash phase (`tests/model.rs`,
//! issue 17) and the write-hole test (`tests/write_hole.rs`, issue 19): simulated members
//! on a virtual clock holding md's write-intent bitmap area, a [`ShardedArray`] of 1, 2 or
//! 4 shards over them ([`CrashWorld::array`]), the workload that runs until a crash with
//! torn member writes ([`run_to_crash`]), the per-block model of the versions a block may
//! hold afterwards ([`Versions`]), and the executor helpers (reading the whole array back,
//! idling, running a background process, finding inconsistent stripes).
//!
//! The crash: torn writes are armed on some members at a seeded request count, and the
//! array is dropped, without a shutdown, in the loop turn where the first torn member
//! write reaches the media: member writes that completed are on the media, torn ones in
//! part, the rest not at all, and nothing completed in that turn counts as acknowledged.
//!
//! Half the seeds ([`CrashCase::volatile`]) give some members (at least one) a volatile
//! write cache: a member write that completed without FUA stays volatile until a flush
//! sent after it completes, and the crash loses any of those it likes
//! ([`SimDevice::crash_volatile`]: whole writes or some of their blocks, in any order). The
//! version model follows: a client write acknowledged without FUA and with no client flush
//! sent after its acknowledgement completed may read back old or new, as one in flight.

use std::cell::Cell;
use std::ptr::NonNull;
use std::rc::Rc;

use engine::array::{Array, ArrayCompletion, ArrayConfig, ArrayOp, ArrayRequest, ArrayStats};
use engine::bitmap::WriteIntent;
use engine::buf::AlignedBuf;
use engine::device::{BlockDevice, IoBuf};
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use engine::metadata::{Bitmap, BitmapSuper, Uuid};
use engine::parity::Parity;
use engine::shard::ShardedArray;
use engine::sim::{
    Fault, FaultRule, IoLog, OpFilter, Profile, SimChannel, SimClock, SimDevice, VolatileLoss,
};

use crate::{Oracle, Rng};

/// Whether byte ranges `(offset, len)` `a` and `b` overlap.
pub fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// Submits `op` over `len` bytes at array offset `off` with tag `tag`; an op with data
/// reads or writes the first `len` bytes of `buf`.
///
/// # Safety
/// `buf`'s memory must stay allocated and untouched until the request's completion is
/// handled.
unsafe fn submit(
    arr: &mut ShardedArray<SimChannel>,
    tag: u64,
    op: ArrayOp,
    off: u64,
    len: u64,
    buf: &mut AlignedBuf,
) {
    let io = if op.has_buffer() {
        // SAFETY: the caller keeps `buf` alive and untouched until completion.
        unsafe { IoBuf::from_raw(NonNull::new(buf.as_mut_ptr()).unwrap(), len as u32, None) }
    } else {
        IoBuf::NONE
    };
    arr.submit(ArrayRequest {
        tag,
        op,
        offset_bytes: off,
        len_bytes: len as u32,
        buf: io,
    })
    .unwrap();
}

/// Reads the whole array through the engine, 1 MiB at a time; `ctx` names the run.
pub fn read_whole(arr: &mut ShardedArray<SimChannel>, clock: &SimClock, ctx: &str) -> AlignedBuf {
    let cap = arr.geometry().capacity_bytes();
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 16];
    let mut whole = AlignedBuf::zeroed(cap as usize);
    let mut off = 0u64;
    while off < cap {
        let len = (cap - off).min(1 << 20);
        // SAFETY: `whole` outlives the request, which completes before the next loop turn.
        let io = unsafe {
            IoBuf::from_raw(
                NonNull::new(whole.as_mut_ptr().add(off as usize)).unwrap(),
                len as u32,
                None,
            )
        };
        arr.submit(ArrayRequest {
            tag: 0,
            op: ArrayOp::Read,
            offset_bytes: off,
            len_bytes: len as u32,
            buf: io,
        })
        .unwrap();
        loop {
            arr.set_now(clock.now_ns());
            let progressed = arr.process();
            if arr.poll(&mut out) == 1 {
                assert_eq!(out[0].status, Ok(()), "{ctx}: read-back failed");
                break;
            }
            if !progressed {
                let t = next_event(arr).expect("pending I/O");
                clock.advance_to(t.max(clock.now_ns()));
            }
        }
        off += len;
    }
    whole
}

/// The stripes whose P (or Q) does not match their data on the member images now, with
/// which of the two mismatches first ("P" or "Q").
pub fn inconsistent_stripes(
    g: &Geometry,
    stripes: u64,
    devs: &[SimDevice],
    data_offset: usize,
) -> Vec<(u64, &'static str)> {
    let imgs: Vec<Vec<u8>> = devs.iter().map(|d| d.contents()).collect();
    let chunk = g.chunk_bytes() as usize;
    let par = Parity::new().streaming(false);
    let mut p = AlignedBuf::zeroed(chunk);
    let mut q = AlignedBuf::zeroed(chunk);
    let mut data: Vec<AlignedBuf> = (0..g.data_chunks())
        .map(|_| AlignedBuf::zeroed(chunk))
        .collect();
    let mut bad = Vec::new();
    for s in 0..stripes {
        let st = g.stripe(s);
        let at = data_offset + s as usize * chunk;
        for k in 0..g.data_chunks() {
            let m = usize::from(st.data_member(k));
            data[usize::from(st.q_slot(k))].copy_from_slice(&imgs[m][at..at + chunk]);
        }
        let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
        par.gen_pq(&refs, &mut p, &mut q);
        if p[..] != imgs[usize::from(st.p_member())][at..at + chunk] {
            bad.push((s, "P"));
        } else if st
            .q_member()
            .is_some_and(|qm| q[..] != imgs[usize::from(qm)][at..at + chunk])
        {
            bad.push((s, "Q"));
        }
    }
    bad
}

/// The next virtual time anything happens: a member completion or a command timeout.
pub fn next_event(arr: &ShardedArray<SimChannel>) -> Option<u64> {
    arr.shards()
        .iter()
        .flat_map(|s| s.channels())
        .filter_map(|ch| ch.next_completion_ns())
        .chain(arr.next_deadline_ns())
        .min()
}

/// Every shard's stats, summed.
pub fn stats(arr: &ShardedArray<SimChannel>) -> ArrayStats {
    let mut t = ArrayStats::default();
    for s in arr.shards() {
        t.add(&s.stats());
    }
    t
}

/// Runs `f` over the cases on two worker threads (simulations are single-threaded each).
pub fn each_case<C: Sync>(cases: Vec<C>, f: impl Fn(&C) + Sync) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|sc| {
        for _ in 0..2 {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(c) = cases.get(i) else { break };
                f(c);
            });
        }
    });
}

/// Where the crash test's members hold their write-intent bitmap (4 KiB-aligned: written
/// in 4 KiB units, as mdadm places it), their Partial Parity Log area (room for a 4 KiB
/// header and a few records of the largest chunk's partial parity; used by the PPL
/// policy of the write-hole test) and where their data starts.
pub const CRASH_BITMAP_START: u64 = 4096;
pub const CRASH_PPL_START: u64 = 8192;
pub const CRASH_PPL_BYTES: u64 = 64 << 10;
pub const CRASH_DATA_OFFSET: u64 = CRASH_PPL_START + CRASH_PPL_BYTES;
/// The bitmap's `daemon_sleep`, s. An idle gap lasts four of them: the daemon clears a
/// region at its second quiet pass.
pub const CRASH_DAEMON_SLEEP_S: u32 = 1;
/// One second of virtual time, ns.
pub const SEC: u64 = 1_000_000_000;

/// One configuration of a crash test, drawn from its seed by [`crash_cases`].
#[derive(Debug)]
pub struct CrashCase {
    pub level: Level,
    pub layout: Layout,
    pub members: u16,
    pub chunk: u64,
    pub stripes: u64,
    /// Bytes of each member one bitmap region covers: half a chunk (a stripe spans two
    /// regions), one chunk, or two (a region spans two stripes).
    pub bm_chunk: u32,
    /// Requests per run (how a test spreads them over its crashes is its own).
    pub ops: usize,
    /// Requests kept in flight.
    pub depth: usize,
    /// Shards of the [`ShardedArray`].
    pub reactors: usize,
    /// Whether members may have a volatile write cache (which ones: [`CrashWorld::cached`])
    /// whose unflushed writes the crash may lose.
    pub volatile: bool,
    pub seed: u64,
}

impl CrashCase {
    /// The configuration and how to replay it, for failure messages.
    pub fn ctx(&self) -> String {
        format!(
            "crash: {} {} members={} chunk={} stripes={} bitmap_chunk={} depth={} reactors={} \
             volatile_caches={} seed={} (replay: FERRORAID_SEED={})",
            self.level,
            self.layout,
            self.members,
            self.chunk,
            self.stripes,
            self.bm_chunk,
            self.depth,
            self.reactors,
            self.volatile,
            self.seed,
            self.seed
        )
    }
}

/// RAID5 and RAID6, 1, 2 and 4 reactors, `per_config` seeds each (numbered from
/// `first_seed + 1`), `ops` requests a run; each seed draws the layout, the member count,
/// the chunk, the bitmap chunk, the size, the queue depth and whether members may have a
/// volatile write cache (half the seeds). `FERRORAID_SEED=N` keeps only the case with
/// seed N.
pub fn crash_cases(first_seed: u64, per_config: usize, ops: usize) -> Vec<CrashCase> {
    let only: Option<u64> = std::env::var("FERRORAID_SEED")
        .ok()
        .and_then(|v| v.parse().ok());
    let mut v = Vec::new();
    let mut seed = first_seed;
    for level in [Level::Raid5, Level::Raid6] {
        for reactors in [1, 2, 4] {
            for _ in 0..per_config {
                seed += 1;
                if only.is_some_and(|s| s != seed) {
                    continue;
                }
                let mut rng = Rng::new(seed);
                let chunk = [4096u64, 16384][rng.below(2) as usize];
                let bm_chunk = match rng.below(3) {
                    0 => chunk / 2,
                    1 => chunk,
                    _ => 2 * chunk,
                };
                v.push(CrashCase {
                    level,
                    layout: Layout::ALL[rng.below(Layout::ALL.len() as u64) as usize],
                    members: level.min_members() + rng.below(4) as u16,
                    chunk,
                    stripes: 24 + rng.below(17),
                    bm_chunk: bm_chunk as u32,
                    ops,
                    depth: 16 + rng.below(17) as usize,
                    reactors,
                    volatile: rng.below(2) == 0,
                    seed,
                });
            }
        }
    }
    v
}

/// One write as the array holds it once applied: its range and its bytes (zeroes for a
/// write-zeroes or the whole stripes of a discard).
pub struct Version {
    seq: u64,
    off: u64,
    data: Vec<u8>,
    /// Written with FUA: durable once acknowledged.
    fua: bool,
    acked: Cell<bool>,
    /// Acknowledged and durable: no crash can take it back.
    durable: Cell<bool>,
    /// [`Versions::acks`] when it was acknowledged.
    acked_at: Cell<u64>,
}

impl Version {
    fn blocks(&self) -> std::ops::Range<usize> {
        (self.off / 512) as usize..((self.off + self.data.len() as u64) / 512) as usize
    }

    fn block(&self, b: usize) -> &[u8] {
        let at = b * 512 - self.off as usize;
        &self.data[at..at + 512]
    }
}

/// The crash model's reference: for each 512-byte block of the array, the writes whose
/// bytes it may hold after a crash — the last durable write over it (none: the block may
/// still hold `base`, the array's contents at the start) and every write over it
/// submitted after that one. A write is durable once acknowledged on members without a
/// volatile cache; with volatile caches ([`Versions::new`]'s `volatile`), once
/// acknowledged if it had FUA, else once a client flush submitted after its
/// acknowledgement completes ([`Versions::flush_done`]). Writes to one block are applied
/// in submission order, so nothing older than the last durable write may show, and a
/// block is atomic on a member (a torn member write applies a prefix of whole blocks).
pub struct Versions {
    base: Vec<u8>,
    blocks: Vec<Vec<Rc<Version>>>,
    /// Members may have a volatile write cache: acknowledged is not durable.
    volatile: bool,
    /// Acknowledged writes not durable yet, oldest acknowledgement first.
    unflushed: Vec<Rc<Version>>,
    /// Acknowledgements so far.
    acks: u64,
}

/// How a block read back after the crash relates to its versions.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// No write over it was in flight: it equals the reference.
    Definite,
    /// A write over it was in flight (or not durable) and did not reach it.
    Old,
    /// A write over it was in flight (or not durable) and reached it.
    New,
}

impl Versions {
    /// No write yet over `base`, the array's contents at the start (durable); `volatile`:
    /// members may have a volatile write cache, so an acknowledged write without FUA is
    /// durable only after a client flush.
    pub fn new(base: Vec<u8>, volatile: bool) -> Self {
        Self {
            blocks: (0..base.len() / 512).map(|_| Vec::new()).collect(),
            base,
            volatile,
            unflushed: Vec::new(),
            acks: 0,
        }
    }

    /// `v` was submitted.
    pub fn submit(&mut self, v: &Rc<Version>) {
        for b in v.blocks() {
            self.blocks[b].push(Rc::clone(v));
        }
    }

    /// `v` was acknowledged; if that makes it durable, whatever was written over its
    /// blocks before it is gone.
    pub fn ack(&mut self, v: &Rc<Version>) {
        v.acked.set(true);
        v.acked_at.set(self.acks);
        self.acks += 1;
        if self.volatile && !v.fua {
            self.unflushed.push(Rc::clone(v));
        } else {
            self.durable(v);
        }
    }

    /// Acknowledgements so far: a client flush submitted now covers exactly these (pass
    /// the value to [`Versions::flush_done`] when it completes).
    pub fn acks(&self) -> u64 {
        self.acks
    }

    /// A client flush completed that was submitted when [`Versions::acks`] returned
    /// `covers`: every write acknowledged before it is durable.
    pub fn flush_done(&mut self, covers: u64) {
        let (done, left): (Vec<_>, Vec<_>) = std::mem::take(&mut self.unflushed)
            .into_iter()
            .partition(|v| v.acked_at.get() < covers);
        self.unflushed = left;
        for v in &done {
            self.durable(v);
        }
    }

    fn durable(&mut self, v: &Version) {
        v.durable.set(true);
        for b in v.blocks() {
            self.blocks[b].retain(|x| x.seq >= v.seq);
        }
    }

    /// Whether a write that a crash may still undo covers block `b`: one in flight at the
    /// crash, or acknowledged but not durable (a volatile cache lost it, or not).
    pub fn in_flight(&self, b: usize) -> bool {
        self.blocks[b].iter().any(|v| !v.durable.get())
    }

    /// Judges block `b` read back as `got`; `Err` describes the loss.
    pub fn judge(&self, b: usize, got: &[u8]) -> Result<Outcome, String> {
        let list = &self.blocks[b];
        let base = list.iter().find(|v| v.durable.get());
        let base_bytes = base.map_or(&self.base[b * 512..(b + 1) * 512], |v| v.block(b));
        let pending: Vec<&Rc<Version>> = list.iter().filter(|v| !v.durable.get()).collect();
        if got == base_bytes {
            return Ok(if pending.is_empty() {
                Outcome::Definite
            } else {
                Outcome::Old
            });
        }
        if pending.iter().any(|v| v.block(b) == got) {
            return Ok(Outcome::New);
        }
        Err(format!(
            "block {b} (array offset {}) holds none of its versions: durable {}, in flight \
             or not durable at the crash (tag, offset, length, acknowledged) {:?}",
            b * 512,
            base.map_or("none (the contents at the start)".to_string(), |v| format!(
                "write {} at {}+{}",
                v.seq,
                v.off,
                v.data.len()
            )),
            pending
                .iter()
                .map(|v| (v.seq, v.off, v.data.len(), v.acked.get()))
                .collect::<Vec<_>>()
        ))
    }
}

/// A request the crash test has in flight.
pub struct Pending {
    pub tag: u64,
    /// A write (or write-zeroes, discard, flush): it may change blocks.
    pub write: bool,
    pub off: u64,
    pub len: u64,
    pub buf: AlignedBuf,
    /// What it writes, for requests that change data.
    pub version: Option<Rc<Version>>,
}

/// Submits `op` tagged `tag` over `buf.len()` bytes at array offset `off` (an op with
/// data reads or writes `buf`; a flush: offset 0, an empty buffer) and keeps it, with the
/// `version` it writes, in `inflight` until [`completions`] hands it back.
///
/// # Safety
/// `inflight` keeps the request's buffer: it must not drop or touch it until the
/// completion is handled or `arr` is dropped (AlignedBuf's heap memory does not move with
/// the Vec).
pub unsafe fn issue(
    arr: &mut ShardedArray<SimChannel>,
    inflight: &mut Vec<Pending>,
    tag: u64,
    op: ArrayOp,
    off: u64,
    mut buf: AlignedBuf,
    version: Option<Rc<Version>>,
) {
    let len = buf.len() as u64;
    if matches!(op, ArrayOp::Flush) {
        arr.submit(ArrayRequest::flush(tag)).unwrap();
    } else {
        // SAFETY: the caller keeps `buf` alive and untouched until completion.
        unsafe { submit(arr, tag, op, off, len, &mut buf) };
    }
    inflight.push(Pending {
        tag,
        write: !matches!(op, ArrayOp::Read),
        off,
        len,
        buf,
        version,
    });
}

/// Submits a flush tagged `tag` and keeps it in `inflight` until [`completions`] hands
/// it back.
pub fn issue_flush(arr: &mut ShardedArray<SimChannel>, inflight: &mut Vec<Pending>, tag: u64) {
    // SAFETY: a flush has no buffer.
    unsafe {
        issue(
            arr,
            inflight,
            tag,
            ArrayOp::Flush,
            0,
            AlignedBuf::zeroed(0),
            None,
        )
    };
}

/// Polls `arr` and hands back the requests of `inflight` that completed, each checked to
/// have succeeded, reads checked against `reference`; `ctx` names the run.
pub fn completions(
    arr: &mut ShardedArray<SimChannel>,
    inflight: &mut Vec<Pending>,
    reference: &[u8],
    ctx: &str,
) -> Vec<Pending> {
    completions_checked(arr, inflight, ctx, |f| {
        let want = &reference[f.off as usize..(f.off + f.len) as usize];
        if let Some(at) = f.buf.iter().zip(want).position(|(a, b)| a != b) {
            panic!(
                "{ctx}: read {}+{} differs from the reference at array offset {}",
                f.off,
                f.len,
                f.off + at as u64
            );
        }
    })
}

/// [`completions`] with reads checked by `check_read` (which panics on a wrong read).
pub fn completions_checked(
    arr: &mut ShardedArray<SimChannel>,
    inflight: &mut Vec<Pending>,
    ctx: &str,
    mut check_read: impl FnMut(&Pending),
) -> Vec<Pending> {
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 16];
    let n = arr.poll(&mut out);
    out[..n]
        .iter()
        .map(|done| {
            let i = inflight
                .iter()
                .position(|f| f.tag == done.tag)
                .expect("known tag");
            let f = inflight.swap_remove(i);
            assert_eq!(done.status, Ok(()), "{ctx}: request {} failed", f.tag);
            if !f.write {
                check_read(&f);
            }
            f
        })
        .collect()
}

/// Runs the executor with no requests in flight until virtual time `t` (the bitmap
/// daemon's passes fall inside).
pub fn idle_until(arr: &mut ShardedArray<SimChannel>, clock: &SimClock, t: u64) {
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 16];
    loop {
        arr.set_now(clock.now_ns());
        let progressed = arr.process();
        assert_eq!(arr.poll(&mut out), 0, "idle: nothing was in flight");
        if progressed {
            continue;
        }
        match next_event(arr) {
            Some(e) if e <= t => clock.advance_to(e.max(clock.now_ns())),
            _ if clock.now_ns() < t => clock.advance_to(t),
            _ => return,
        }
    }
}

/// Runs the executor until no background process is active.
pub fn run_process(arr: &mut ShardedArray<SimChannel>, clock: &SimClock, ctx: &str) {
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 16];
    for _ in 0..10_000_000 {
        if !arr.process_active() {
            return;
        }
        arr.set_now(clock.now_ns());
        let progressed = arr.process();
        assert_eq!(arr.poll(&mut out), 0, "{ctx}: no request was in flight");
        if !progressed {
            let t = next_event(arr).unwrap_or_else(|| panic!("{ctx}: the process stalled"));
            clock.advance_to(t.max(clock.now_ns()));
        }
    }
    panic!("{ctx}: the process never finished");
}

/// The simulated members of a crash run and what never changes between its crashes:
/// `c.members` zero-filled members of unequal speed, each holding a clear write-intent
/// bitmap area at [`CRASH_BITMAP_START`], a zeroed PPL area at [`CRASH_PPL_START`] and its
/// data from [`CRASH_DATA_OFFSET`]; with [`CrashCase::volatile`], some of them (at least
/// one, each with chance 3/4) have a volatile write cache ([`cached_nvme`]).
pub struct CrashWorld<'a> {
    pub c: &'a CrashCase,
    /// [`CrashCase::ctx`], and the members with a volatile write cache.
    pub ctx: String,
    /// The members with a volatile write cache.
    pub cached: Vec<u16>,
    pub g: Geometry,
    pub geo: ArrayGeometry,
    pub clock: SimClock,
    pub devs: Vec<SimDevice>,
    /// Bytes of the bitmap area (superblock and bits).
    area_len: usize,
    /// The oracle, if present ([`Oracle::locate_or_skip`]).
    pub oracle: Option<&'a Oracle>,
}

impl<'a> CrashWorld<'a> {
    /// The members of case `c`, as created.
    pub fn new(c: &'a CrashCase, oracle: Option<&'a Oracle>) -> Self {
        let g = Geometry::new(c.level, c.layout, c.members, c.chunk, 512).unwrap();
        let geo = ArrayGeometry::new(g, c.stripes).unwrap();
        let clock = SimClock::new();
        let data_bytes = c.stripes * c.chunk;
        let super_ = BitmapSuper::new(
            Uuid([7; 16]),
            data_bytes / 512,
            c.bm_chunk,
            CRASH_DAEMON_SLEEP_S,
        );
        let area = Bitmap::new(super_, false).to_area(false);
        assert!(CRASH_BITMAP_START + area.len() as u64 <= CRASH_PPL_START);
        let mut cached = Vec::new();
        if c.volatile {
            let mut rng = Rng::new(c.seed ^ 0xcac4e);
            cached = (0..c.members).filter(|_| rng.below(4) != 0).collect();
            if cached.is_empty() {
                cached.push(rng.below(u64::from(c.members)) as u16);
            }
        }
        let devs: Vec<SimDevice> = (0..c.members)
            .map(|i| {
                let profile = if cached.contains(&i) {
                    cached_nvme()
                } else {
                    Profile::nvme_ssd()
                };
                let d = SimDevice::new(
                    &format!("sim{i}"),
                    CRASH_DATA_OFFSET + data_bytes,
                    512,
                    profile,
                    clock.clone(),
                    c.seed ^ u64::from(i),
                )
                .unwrap();
                d.poke(CRASH_BITMAP_START, &area);
                // Members of unequal speed: a pass's member writes complete at different
                // times, so a crash finds some of them done and others not.
                d.set_slowdown(1 + (c.seed / 3 + u64::from(i)) as u32 % 3);
                d
            })
            .collect();
        let ctx = if cached.is_empty() {
            c.ctx()
        } else {
            format!("{} cached_members={cached:?}", c.ctx())
        };
        CrashWorld {
            c,
            ctx,
            cached,
            g,
            geo,
            clock,
            devs,
            area_len: area.len(),
            oracle,
        }
    }

    /// A power cut's loss of the members' volatile write caches
    /// ([`SimDevice::crash_volatile`], seeded from `rng`), summed over the members; nothing
    /// (and no draw from `rng`) without [`CrashCase::volatile`]. Call it with no array over
    /// the members.
    pub fn lose_volatile(&self, rng: &mut Rng) -> VolatileLoss {
        let mut sum = VolatileLoss::default();
        if !self.c.volatile {
            return sum;
        }
        for d in &self.devs {
            let l = d.crash_volatile(rng.next_u64());
            sum.kept += l.kept;
            sum.lost += l.lost;
            sum.torn += l.torn;
            sum.blocks_reverted += l.blocks_reverted;
        }
        sum
    }

    /// The bitmap as member `d` holds it now.
    pub fn bitmap(&self, d: usize) -> Bitmap {
        let img = self.devs[d].contents();
        let at = CRASH_BITMAP_START as usize;
        Bitmap::decode(&img[at..at + self.area_len]).unwrap()
    }

    /// The array over the members: `c.reactors` shards, each with its own channels,
    /// assembled with the members `failed` missing, `setup(k, shard)` run on shard `k`
    /// before any request (attaching the consistency policy), the clock set to `clock`'s
    /// time (before the first request: command timeouts count from it).
    pub fn array(
        &self,
        failed: [Option<u16>; 2],
        mut setup: impl FnMut(usize, &mut Array<SimChannel>),
    ) -> ShardedArray<SimChannel> {
        let cfg = ArrayConfig {
            requests: 64,
            stripe_ops: 16,
            data_offset_bytes: CRASH_DATA_OFFSET,
            failed_members: failed,
            ..ArrayConfig::default()
        };
        let shards = (0..self.c.reactors)
            .map(|k| {
                let chans = self
                    .devs
                    .iter()
                    .map(|d| d.open_channel().unwrap())
                    .collect();
                let mut a = Array::new(self.geo, chans, Parity::new(), cfg).unwrap();
                setup(k, &mut a);
                a
            })
            .collect();
        let mut arr = ShardedArray::new(shards, 64);
        arr.set_now(self.clock.now_ns());
        arr
    }
}

/// An NVMe SSD with a volatile write cache (a consumer drive without power-loss
/// protection): [`Profile::nvme_ssd`], but writes without FUA are acknowledged from the
/// cache in 10 µs and paid for at the next flush.
pub fn cached_nvme() -> Profile {
    Profile {
        name: "nvme-ssd-cached",
        write_cache_latency_ns: Some(10_000),
        ..Profile::nvme_ssd()
    }
}

/// What a crash left: the array's stats at the crash and when the torn writes were
/// armed, the requests in flight at the crash, the versions each block may hold, and the
/// log of every member request since the last idle gap.
pub struct Crashed {
    pub stats: ArrayStats,
    pub at_arming: ArrayStats,
    /// What the members' volatile caches lost at the crash (all zero without
    /// [`CrashCase::volatile`]).
    pub volatile: VolatileLoss,
    /// Requests in flight at the crash (the array is gone: their buffers are free).
    pub pending: Vec<Pending>,
    pub versions: Versions,
    pub log: IoLog,
}

/// Runs the crash workload on `arr` (started clean on `w`'s members, holding `base`)
/// until it crashes: half small sequential writes (they meet in write passes, are held
/// and hit the stripe cache), random overlapping writes, reads (each checked), write-
/// zeroes, discards, FUA and flushes, `w.c.depth` requests in flight; idle gaps (with a
/// bitmap `intent`, the daemon clears every bit in each) at two random points and at most
/// two queues' worth of requests before the crash; from a request count drawn in
/// `ops / 2..=ops` torn writes armed on some members, and the crash in the loop turn
/// where the first one reaches the media. The array is dropped, without a shutdown, the
/// faults cleared, and the members' volatile caches lose what the crash takes
/// ([`CrashWorld::lose_volatile`]). `ctx` names the run in failure messages; `rng` draws
/// everything.
pub fn run_to_crash(
    w: &CrashWorld,
    ctx: &str,
    mut arr: ShardedArray<SimChannel>,
    intent: Option<&WriteIntent>,
    rng: &mut Rng,
    ops: usize,
    base: Vec<u8>,
) -> Crashed {
    let (c, g, geo, clock, devs) = (w.c, &w.g, w.geo, &w.clock, &w.devs[..]);
    let data_bytes = c.stripes * c.chunk;
    let cap = geo.capacity_bytes();
    let stripe_bytes = g.stripe_data_bytes();
    let mut reference = base.clone();
    let mut versions = Versions::new(base, c.volatile);
    // Client flushes in flight: (tag, the acknowledgements they cover).
    let mut flushes: Vec<(u64, u64)> = Vec::new();
    // The crash comes after `crash_at` requests (then at the first torn member write);
    // idle gaps fall at two random points before it and at most two queues' worth of
    // requests before it, so a bitmap at the crash holds only the last writes' regions.
    let crash_at = ops / 2 + rng.below(ops as u64 / 2 + 1) as usize;
    let last_gap = crash_at.saturating_sub(rng.below(2 * c.depth as u64) as usize);
    let mut gaps = vec![
        rng.below(last_gap as u64 + 1) as usize,
        rng.below(last_gap as u64 + 1) as usize,
        last_gap,
    ];
    gaps.sort_unstable();
    let log = IoLog::new(0..0);
    let mut inflight: Vec<Pending> = Vec::new();
    let mut cursor = 512 * rng.below(cap / 512);
    let mut issued = 0usize;
    let mut next_tag = 1u64;
    let mut armed = false;
    let mut at_arming = ArrayStats::default();
    // Member requests failed so far (by earlier crashes): the next is this crash's.
    let failed_before: u64 = devs.iter().map(|d| d.stats().failed).sum();
    loop {
        let gap = gaps.first().is_some_and(|&at| issued >= at);
        if gap && inflight.is_empty() {
            let last = gaps.len() == 1;
            gaps.remove(0);
            let t = clock.now_ns() + 4 * u64::from(CRASH_DAEMON_SLEEP_S) * SEC;
            idle_until(&mut arr, clock, t);
            if let Some(intent) = intent {
                assert_eq!(
                    intent.dirty_on_disk(),
                    0,
                    "{ctx}: the daemon cleared every bit while idle"
                );
            }
            if last {
                // Nothing is in flight: every member write from here on is in the log.
                for (i, d) in devs.iter().enumerate() {
                    d.attach_log(&log, i);
                }
            }
            continue;
        }
        if !armed && gaps.is_empty() && issued >= crash_at {
            // Torn writes on some members: each data write there from now on applies a
            // prefix of its blocks (and fails), with probability 1/2 or always.
            armed = true;
            at_arming = stats(&arr);
            let probability = [0.5, 1.0][rng.below(2) as usize];
            let mut torn: Vec<u16> = (0..c.members).filter(|_| rng.below(2) == 0).collect();
            if torn.is_empty() {
                torn.push(rng.below(u64::from(c.members)) as u16);
            }
            for m in torn {
                devs[usize::from(m)].add_fault(FaultRule {
                    filter: OpFilter::Write,
                    range: Some(CRASH_DATA_OFFSET..CRASH_DATA_OFFSET + data_bytes),
                    fault: Fault::Torn {
                        blocks: rng.below(c.chunk / 512) as u32,
                    },
                    probability,
                    count: None,
                });
            }
        }
        // Keep `depth` requests in flight (none during a gap's drain).
        while !gap && inflight.len() < c.depth {
            let tag = next_tag;
            if rng.below(32) == 0 {
                next_tag += 1;
                flushes.push((tag, versions.acks()));
                issue_flush(&mut arr, &mut inflight, tag);
                issued += 1;
                continue;
            }
            // Half small sequential writes (they meet in passes, are held and hit the
            // stripe cache), then random writes, reads, write-zeroes and discards over the
            // array, overlapping.
            let pick = rng.below(16);
            let small = rng.below(2) == 0;
            let blocks = if pick < 8 || small {
                1 + rng.below(8)
            } else {
                1 + rng.below((2 * stripe_bytes / 512).min(cap / 512))
            };
            let len = blocks * 512;
            let off = if pick < 8 {
                if cursor + len > cap {
                    cursor = 0;
                }
                cursor
            } else {
                512 * rng.below((cap - len) / 512 + 1)
            };
            let op = match pick {
                0..=10 => ArrayOp::Write {
                    fua: rng.below(8) == 0,
                },
                11..=13 => ArrayOp::Read,
                14 => ArrayOp::WriteZeroes {
                    fua: rng.below(4) == 0,
                },
                _ => ArrayOp::Discard,
            };
            let write = op.is_write();
            // As in `run`: reads and writes never overlap each other in flight.
            if inflight
                .iter()
                .any(|f| f.write != write && f.len > 0 && overlaps((f.off, f.len), (off, len)))
            {
                break;
            }
            if pick < 8 {
                cursor = off + len;
            }
            next_tag += 1;
            let mut buf = AlignedBuf::zeroed(len as usize);
            let version = match op {
                ArrayOp::Write { .. } => {
                    rng.fill(&mut buf);
                    reference[off as usize..(off + len) as usize].copy_from_slice(&buf);
                    Some((off, buf.to_vec()))
                }
                ArrayOp::WriteZeroes { .. } => {
                    reference[off as usize..(off + len) as usize].fill(0);
                    Some((off, vec![0; len as usize]))
                }
                ArrayOp::Discard => {
                    // Whole stripes inside the range read zeroes afterwards; partial
                    // stripes are left alone.
                    let first = off.div_ceil(stripe_bytes) * stripe_bytes;
                    let last = (off + len) / stripe_bytes * stripe_bytes;
                    (first < last).then(|| {
                        reference[first as usize..last as usize].fill(0);
                        (first, vec![0; (last - first) as usize])
                    })
                }
                _ => None,
            }
            .map(|(off, data)| {
                let v = Rc::new(Version {
                    seq: tag,
                    off,
                    data,
                    fua: matches!(
                        op,
                        ArrayOp::Write { fua: true } | ArrayOp::WriteZeroes { fua: true }
                    ),
                    acked: Cell::new(false),
                    durable: Cell::new(false),
                    acked_at: Cell::new(0),
                });
                versions.submit(&v);
                v
            });
            // SAFETY: the buffer lives in `inflight` until its completion is handled (or
            // until after the crashed array is dropped) and is not touched meanwhile.
            unsafe { issue(&mut arr, &mut inflight, tag, op, off, buf, version) };
            issued += 1;
        }
        arr.set_now(clock.now_ns());
        let progressed = arr.process();
        // The crash: the first torn member write reached the media in this turn. Nothing
        // the array completed in this turn is acknowledged (a power cut takes the
        // replies with it).
        if armed && devs.iter().map(|d| d.stats().failed).sum::<u64>() > failed_before {
            break;
        }
        let done = completions(&mut arr, &mut inflight, &reference, ctx);
        for f in &done {
            if let Some(v) = &f.version {
                versions.ack(v);
            } else if let Some(i) = flushes.iter().position(|&(t, _)| t == f.tag) {
                versions.flush_done(flushes.swap_remove(i).1);
            }
        }
        let n = done.len();
        if !progressed && n == 0 {
            let t = next_event(&arr).expect("pending member I/O or a deadline");
            clock.advance_to(t.max(clock.now_ns()));
            assert!(
                clock.now_ns() < 100_000 * SEC,
                "{ctx}: stalled with {} requests in flight",
                inflight.len()
            );
        }
    }
    let stats = stats(&arr);
    drop(arr);
    for d in devs {
        d.clear_faults();
    }
    let volatile = w.lose_volatile(rng);
    Crashed {
        stats,
        at_arming,
        volatile,
        pending: inflight,
        versions,
        log,
    }
}
