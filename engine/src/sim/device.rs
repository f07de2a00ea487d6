//! A simulated block device on virtual time.

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::ops::Range;
use std::rc::Rc;

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::clock::SimClock;
use super::profile::{Profile, Seek};
use crate::device::{
    check_memory_shape, validate, validate_gather, BlockDevice, Channel, Completion, DeviceError,
    DeviceInfo, IoError, Op, Request, SubmitError,
};

/// Which requests a [`FaultRule`] applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpFilter {
    /// Reads.
    Read,
    /// Writes, write-zeroes and discards (anything that changes data).
    Write,
    /// Flushes.
    Flush,
    /// Every request.
    Any,
}

impl OpFilter {
    fn matches(self, op: Op) -> bool {
        match self {
            OpFilter::Any => true,
            OpFilter::Read => op == Op::Read,
            OpFilter::Write => matches!(op, Op::Write { .. } | Op::WriteZeroes | Op::Discard),
            OpFilter::Flush => op == Op::Flush,
        }
    }
}

/// What an injected fault does to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The request fails with this error and has no effect.
    Error(IoError),
    /// A torn write: only the first `blocks` logical blocks reach the media, then the write
    /// fails with an I/O error (power cut or link reset mid-transfer).
    Torn {
        /// Blocks applied before the failure.
        blocks: u32,
    },
    /// The request is accepted and never completes (a hung command: firmware stall, lost
    /// completion) until the caller aborts it ([`Channel::abort`]), which completes it
    /// with [`IoError::Timeout`] and no effect.
    Hang,
}

/// A fault-injection rule: requests matching `filter` and overlapping `range` fail with
/// `fault`, each with probability `probability` (drawn from the device's seeded RNG), at
/// most `count` times (`None`: without limit).
#[derive(Clone, Debug, PartialEq)]
pub struct FaultRule {
    /// Which operations.
    pub filter: OpFilter,
    /// Byte range on the device (`None`: anywhere).
    pub range: Option<Range<u64>>,
    /// The fault.
    pub fault: Fault,
    /// Chance of firing on each matching request, 0.0..=1.0.
    pub probability: f64,
    /// Firings left (`None`: unlimited).
    pub count: Option<u32>,
}

/// Whether an [`IoEvent`] is a request reaching a device or its completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoEventKind {
    /// The request was accepted by the device (`submit`).
    Submit,
    /// The request completed (its effect, if any, is on the media).
    Complete,
}

/// One entry of an [`IoLog`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IoEvent {
    /// The device's index given to [`SimDevice::attach_log`].
    pub device: usize,
    /// Submission or completion.
    pub kind: IoEventKind,
    /// The request's operation.
    pub op: Op,
    /// Byte offset on the device.
    pub offset_bytes: u64,
    /// Length, bytes.
    pub len_bytes: u32,
    /// Virtual time, ns.
    pub at_ns: u64,
    /// Completion status (`true` for submissions).
    pub ok: bool,
    /// For successful write completions overlapping the log's capture range: the device's
    /// bytes over that overlap after the write, starting at `captured_at`.
    pub data: Vec<u8>,
    /// Device byte offset of `data`.
    pub captured_at: u64,
}

/// A log of requests across several simulated devices, in the one order they happened
/// (submissions and completions interleaved): what ordering tests (e.g. "a bitmap bit is
/// durable on every member before the data write is issued") check. Writes overlapping
/// the capture range also record the bytes they left there. Test support: it allocates.
#[derive(Clone, Default)]
pub struct IoLog {
    inner: Rc<RefCell<(Vec<IoEvent>, Range<u64>)>>,
}

impl IoLog {
    /// An empty log capturing written bytes within `capture` (device byte range).
    pub fn new(capture: Range<u64>) -> Self {
        IoLog {
            inner: Rc::new(RefCell::new((Vec::new(), capture))),
        }
    }

    /// The events so far.
    pub fn events(&self) -> Vec<IoEvent> {
        self.inner.borrow().0.clone()
    }

    fn push(&self, e: IoEvent) {
        self.inner.borrow_mut().0.push(e);
    }

    fn capture(&self) -> Range<u64> {
        self.inner.borrow().1.clone()
    }
}

/// Counters of what a simulated device did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Read requests completed (any status).
    pub reads: u64,
    /// Write, write-zeroes and discard requests completed.
    pub writes: u64,
    /// Flushes completed.
    pub flushes: u64,
    /// Bytes read successfully.
    pub bytes_read: u64,
    /// Bytes written successfully (torn writes count what was applied).
    pub bytes_written: u64,
    /// Requests failed by an injected fault, a latent sector error or disappearance.
    pub failed: u64,
}

struct State {
    info: DeviceInfo,
    profile: Profile,
    data: Vec<u8>,
    /// busy-until time of each parallel unit (at most `MAX_UNITS` tracked).
    units: Vec<u64>,
    /// Where the head is (end of the last request), for seek modelling.
    head: u64,
    /// Bytes sitting in the volatile write cache (unbounded cache model).
    dirty_bytes: u64,
    /// Bounded cache model: when everything written to the cache so far will have been
    /// destaged to the media, ns.
    destaged_at: u64,
    /// Requests in the device (all channels).
    queued: u32,
    faults: Vec<FaultRule>,
    /// Latent sector errors: reads overlapping them fail until a write covers them.
    latent: Vec<Range<u64>>,
    gone: bool,
    /// Whether channels take gathered writes ([`SimDevice::set_gather`]).
    gather: bool,
    slowdown: u32,
    rng: ChaCha8Rng,
    stats: SimStats,
    log: Option<(IoLog, usize)>,
    /// What the volatile write cache holds that the media may not (profiles with a write
    /// cache only; see [`SimDevice::crash_volatile`]).
    cache: Option<VolatileCache>,
}

/// The content model of a volatile write cache: every completed write that is not yet
/// durable, oldest first, with the bytes it overwrote (its pre-image). A crash
/// ([`SimDevice::crash_volatile`]) puts pre-images back; a flush drops the entries it
/// covers; a durable write (FUA, or [`SimDevice::poke`]) over an entry's range updates the
/// entry's pre-image there, so no later revert can undo it.
struct VolatileCache {
    writes: VecDeque<VolatileWrite>,
    /// Pre-image bytes held (the sum of `writes[..].pre.len()`).
    bytes: usize,
    /// Volatile writes applied so far: the sequence number of the newest.
    seq: u64,
}

/// One completed write that a crash may still lose.
struct VolatileWrite {
    /// Its place in the order writes were applied (1, 2, ...).
    seq: u64,
    /// Byte offset on the device.
    offset: u64,
    /// The device's bytes over `offset..offset + pre.len()` before the write.
    pre: Vec<u8>,
}

/// Pre-image bytes a volatile cache model keeps at most, per device (64 MiB): past it the
/// oldest volatile writes count as destaged (durable), as a real cache of that size would
/// have written them back by then. Bounds the model's memory whatever the workload.
const VOLATILE_LIMIT_BYTES: usize = 64 << 20;

/// What [`SimDevice::crash_volatile`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VolatileLoss {
    /// Volatile writes the crash let survive whole (they had been destaged).
    pub kept: u64,
    /// Volatile writes lost whole (every block back to what it held before).
    pub lost: u64,
    /// Volatile writes torn by the crash: some of their blocks lost, the others kept.
    pub torn: u64,
    /// Blocks put back to their earlier contents, over all writes.
    pub blocks_reverted: u64,
}

/// Parallel units modelled individually; devices with more (or "unlimited") parallelism
/// are modelled as this many, enough that requests never wait for one in the engine's
/// tests (queue depths stay below it per device).
const MAX_UNITS: usize = 256;

/// A simulated block device. Cheap to clone; clones share the device (its data, queue,
/// faults and counters).
#[derive(Clone)]
pub struct SimDevice {
    state: Rc<RefCell<State>>,
    /// The device's facts, immutable after `new`, kept outside the RefCell so `info()` can
    /// hand out a plain reference.
    info: Rc<DeviceInfo>,
    clock: SimClock,
}

impl SimDevice {
    /// A zero-filled device of `capacity_bytes` with `block_bytes` blocks, timed by
    /// `profile` on `clock`; `seed` drives the probabilistic faults.
    ///
    /// # Errors
    /// [`DeviceError::Unusable`] for a block size other than 512/4096 or a capacity that
    /// is zero, not a multiple of the block size, or too large for memory.
    pub fn new(
        name: &str,
        capacity_bytes: u64,
        block_bytes: u32,
        profile: Profile,
        clock: SimClock,
        seed: u64,
    ) -> Result<Self, DeviceError> {
        let len = check_memory_shape(name, capacity_bytes, block_bytes)?;
        let units = (profile.parallelism as usize).clamp(1, MAX_UNITS);
        let cached = profile.write_cache_latency_ns.is_some();
        let info = DeviceInfo {
            name: name.to_string(),
            block_bytes,
            capacity_bytes,
            queue_depth: profile.queue_depth,
            max_transfer_bytes: 1 << 20,
            volatile_cache: cached,
            write_zeroes: true,
            discard: true,
            rotational: matches!(profile.seek, Seek::Disk { .. }),
        };
        Ok(Self {
            info: Rc::new(info.clone()),
            state: Rc::new(RefCell::new(State {
                info,
                profile,
                data: vec![0; len],
                units: vec![0; units],
                head: 0,
                dirty_bytes: 0,
                destaged_at: 0,
                queued: 0,
                faults: Vec::new(),
                latent: Vec::new(),
                gone: false,
                gather: true,
                slowdown: 1,
                rng: ChaCha8Rng::seed_from_u64(seed),
                stats: SimStats::default(),
                log: None,
                cache: cached.then(|| VolatileCache {
                    writes: VecDeque::new(),
                    bytes: 0,
                    seq: 0,
                }),
            })),
            clock,
        })
    }

    /// Adds a fault-injection rule (checked in the order added; the first that fires wins).
    pub fn add_fault(&self, rule: FaultRule) {
        self.state.borrow_mut().faults.push(rule);
    }

    /// Removes every fault rule and latent sector error (the "faults stop" phase of a
    /// simulation).
    pub fn clear_faults(&self) {
        let mut s = self.state.borrow_mut();
        s.faults.clear();
        s.latent.clear();
    }

    /// Marks `range` (bytes) as a latent sector error: reads overlapping it fail with
    /// [`IoError::Medium`] until a successful write covers it.
    pub fn add_latent_error(&self, range: Range<u64>) {
        self.state.borrow_mut().latent.push(range);
    }

    /// The latent sector errors still on the device (byte ranges, in the order added): one
    /// leaves when a successful write covers it whole.
    pub fn latent_errors(&self) -> Vec<Range<u64>> {
        self.state.borrow().latent.clone()
    }

    /// Makes the device disappear: requests in flight complete with [`IoError::Gone`] at the
    /// next poll, and `submit` refuses everything from now on.
    pub fn disappear(&self) {
        self.state.borrow_mut().gone = true;
    }

    /// Records every request of this device (as device `index`) in `log`.
    pub fn attach_log(&self, log: &IoLog, index: usize) {
        self.state.borrow_mut().log = Some((log.clone(), index));
    }

    /// Whether the device's channels take gathered writes ([`Channel::gathers`]; the
    /// default, `true`, as the io_uring, RAM and null back ends do). `false` models a back
    /// end that does not (NVMe passthrough, vfio): the array then copies a write's pieces
    /// into one buffer, and a gathered request is refused as invalid.
    pub fn set_gather(&self, gather: bool) {
        self.state.borrow_mut().gather = gather;
    }

    /// Multiplies every service time by `factor` (≥ 1): a slow member.
    pub fn set_slowdown(&self, factor: u32) {
        self.state.borrow_mut().slowdown = factor.max(1);
    }

    /// What the device did so far.
    pub fn stats(&self) -> SimStats {
        self.state.borrow().stats
    }

    /// A copy of the device's contents.
    pub fn contents(&self) -> Vec<u8> {
        self.state.borrow().data.clone()
    }

    /// Copies bytes at `offset` into `buf` directly (no timing, no faults): what the media
    /// holds, for checks and for synchronous work at assembly ([`SimMedia`]).
    ///
    /// # Panics
    /// If the range exceeds the capacity.
    pub fn peek(&self, offset: u64, buf: &mut [u8]) {
        let s = self.state.borrow();
        let off = usize::try_from(offset).expect("offset fits in memory");
        buf.copy_from_slice(&s.data[off..off + buf.len()]);
    }

    /// Overwrites bytes at `offset` directly (no timing, no faults): for building a test's
    /// starting state, for silent corruption, or for synchronous work at assembly
    /// ([`SimMedia`]). The bytes are durable at once: a later
    /// [`crash_volatile`](Self::crash_volatile) does not undo them.
    ///
    /// # Panics
    /// If the range exceeds the capacity.
    pub fn poke(&self, offset: u64, bytes: &[u8]) {
        let mut s = self.state.borrow_mut();
        let s = &mut *s;
        let off = usize::try_from(offset).expect("offset fits in memory");
        s.data[off..off + bytes.len()].copy_from_slice(bytes);
        if let Some(c) = &mut s.cache {
            c.durable_write(offset, bytes);
        }
    }

    /// Bytes of completed writes that are not durable yet: held only in the volatile write
    /// cache (0 for a profile without one).
    pub fn volatile_bytes(&self) -> usize {
        self.state.borrow().cache.as_ref().map_or(0, |c| c.bytes)
    }

    /// A power cut's effect on the volatile write cache: reverts completed writes that
    /// were not durable yet, drawn from `seed` (the same seed and the same history give the
    /// same result, so a failing seed replays); returns what it did. A profile without a
    /// write cache loses nothing. Call it on a device no channel is using (after the array
    /// over it was dropped); requests still in flight are not affected.
    ///
    /// # The cache model
    /// A non-FUA write (and a write-zeroes or discard, which carry no FUA) that completes
    /// is readable at once but *volatile* until a flush **submitted after it completed**
    /// completes successfully (NVMe Base 2.0 §7.1: a flush covers the commands completed
    /// before it was submitted, on any queue). A FUA write is durable when it completes,
    /// and only that write: it makes its own blocks durable with its bytes (an older
    /// volatile write over the same blocks can no longer take them back), but older
    /// volatile data of *other* blocks stays volatile, as on real devices. A write that
    /// fails (torn) is volatile whatever its FUA bit: the blocks it applied may be lost.
    ///
    /// At the crash, one draw picks how many of the volatile writes survived (none, a
    /// quarter, half or three quarters, on average); then every volatile write, newest
    /// first, independently survives whole (it had been destaged), is lost whole, or — one
    /// lost write in four — is torn, each of its blocks lost or kept by a coin. A lost
    /// block gets back the bytes the write overwrote. Reverting newest first means each
    /// block ends holding the bytes of some prefix of the writes to *it* (its durable bytes,
    /// or one of its volatile versions), while different blocks and different writes are
    /// lost independently, in no order at all: what a drive destaging its cache in any
    /// order may leave, and at least as hostile as md's rules assume (a flush is the only
    /// ordering a volatile cache keeps).
    ///
    /// Memory: one pre-image per volatile write, dropped when a flush covers it, and at
    /// most [`VOLATILE_LIMIT_BYTES`] per device (the oldest count as destaged past it).
    pub fn crash_volatile(&self, seed: u64) -> VolatileLoss {
        let mut s = self.state.borrow_mut();
        let s = &mut *s;
        let mut loss = VolatileLoss::default();
        let Some(cache) = &mut s.cache else {
            return loss;
        };
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let survive_quarters = rng.next_u32() % 4;
        let block = s.info.block_bytes as usize;
        while let Some(w) = cache.writes.pop_back() {
            if rng.next_u32() % 4 < survive_quarters {
                loss.kept += 1;
                continue;
            }
            let torn = rng.next_u32() % 4 == 0;
            let off = usize::try_from(w.offset).expect("offset fits in memory");
            let blocks = w.pre.len() / block;
            let mut reverted = 0;
            for (i, pre) in w.pre.chunks(block).enumerate() {
                if torn && rng.next_u32() % 2 == 0 {
                    continue;
                }
                s.data[off + i * block..off + (i + 1) * block].copy_from_slice(pre);
                reverted += 1;
            }
            match reverted {
                0 => loss.kept += 1,
                n if n == blocks => loss.lost += 1,
                _ => loss.torn += 1,
            }
            loss.blocks_reverted += reverted as u64;
        }
        cache.bytes = 0;
        loss
    }
}

impl VolatileCache {
    /// A write that completed into the cache, whose range held `pre` before: volatile
    /// from now on. Past [`VOLATILE_LIMIT_BYTES`], the oldest writes count as destaged.
    fn volatile_write(&mut self, offset: u64, pre: Vec<u8>) {
        self.seq += 1;
        self.bytes += pre.len();
        self.writes.push_back(VolatileWrite {
            seq: self.seq,
            offset,
            pre,
        });
        while self.bytes > VOLATILE_LIMIT_BYTES {
            let w = self.writes.pop_front().expect("bytes are held by writes");
            self.bytes -= w.pre.len();
        }
    }

    /// `bytes` at `offset` became durable (a FUA write, a poke): no volatile write may
    /// take them back, so they become the pre-image of every volatile write over them.
    fn durable_write(&mut self, offset: u64, bytes: &[u8]) {
        let end = offset + bytes.len() as u64;
        for w in &mut self.writes {
            let w_end = w.offset + w.pre.len() as u64;
            let (lo, hi) = (offset.max(w.offset), end.min(w_end));
            if lo < hi {
                let (a, b) = ((lo - w.offset) as usize, (hi - w.offset) as usize);
                let at = (lo - offset) as usize;
                w.pre[a..b].copy_from_slice(&bytes[at..at + (b - a)]);
            }
        }
    }

    /// A flush submitted when the newest volatile write was `covers` completed: every
    /// write up to it is durable.
    fn flushed(&mut self, covers: u64) {
        while self.writes.front().is_some_and(|w| w.seq <= covers) {
            let w = self.writes.pop_front().expect("checked");
            self.bytes -= w.pre.len();
        }
    }
}

impl BlockDevice for SimDevice {
    type Channel = SimChannel;

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn open_channel(&self) -> Result<SimChannel, DeviceError> {
        let qd = self.info.queue_depth as usize;
        Ok(SimChannel {
            dev: self.clone(),
            slots: (0..qd).map(|_| None).collect(),
            free: (0..qd).rev().collect(),
            ready: BinaryHeap::with_capacity(qd),
            seq: 0,
        })
    }
}

/// One request inside the simulated device.
struct InFlight {
    req: Request,
    outcome: Outcome,
    /// For a flush on a device with a volatile cache: the newest volatile write completed
    /// when it was submitted (what it makes durable); 0 otherwise.
    covers: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    Fail(IoError),
    Torn(u32),
    Hang,
}

/// Completion time of a hung request: never, until aborted.
const NEVER: u64 = u64::MAX;

/// A channel of a [`SimDevice`]: completions become visible when the clock reaches their
/// completion time, in (time, submission) order.
pub struct SimChannel {
    dev: SimDevice,
    /// In-flight requests by slot; sized to the queue depth at open.
    slots: Vec<Option<InFlight>>,
    free: Vec<usize>,
    /// (done_at, submission sequence, slot), earliest first.
    ready: BinaryHeap<Reverse<(u64, u64, usize)>>,
    seq: u64,
}

impl SimChannel {
    /// Virtual time at which the next request of this channel completes, if any. The
    /// executor advances the clock to the earliest of these when nothing else can run.
    pub fn next_completion_ns(&self) -> Option<u64> {
        if self.dev.state.borrow().gone && !self.ready.is_empty() {
            return Some(self.dev.clock.now_ns());
        }
        self.ready
            .peek()
            .map(|Reverse((t, _, _))| *t)
            .filter(|&t| t != NEVER)
    }
}

impl State {
    /// Schedules `req` on the earliest-free parallel unit; returns its completion time, ns.
    fn schedule(&mut self, req: &Request, now: u64) -> u64 {
        let p = &self.profile;
        let len = u64::from(req.len_bytes);
        let positioning = match p.seek {
            Seek::Disk {
                avg_seek_ns,
                rotation_ns,
            } if req.op != Op::Flush && req.offset_bytes != self.head => {
                avg_seek_ns + rotation_ns / 2
            }
            _ => 0,
        };
        let service = match req.op {
            Op::Read => {
                p.read_latency_ns + positioning + Profile::transfer_ns(len, p.read_bytes_per_s)
            }
            Op::Write { fua } => match p.write_cache_latency_ns {
                Some(cache) if !fua => {
                    self.dirty_bytes += len;
                    cache
                }
                _ => {
                    p.write_latency_ns
                        + positioning
                        + Profile::transfer_ns(len, p.write_bytes_per_s)
                }
            },
            // A bounded cache destages continuously: the flush waits for the destage.
            Op::Flush if p.write_cache_bytes.is_some() => p.write_latency_ns / 4,
            Op::Flush => {
                let dirty = std::mem::take(&mut self.dirty_bytes);
                let units = self.units.len() as u64;
                p.write_latency_ns / 4
                    + Profile::transfer_ns(dirty, p.write_bytes_per_s.saturating_mul(units))
            }
            Op::WriteZeroes | Op::Discard => p.write_latency_ns + positioning,
        };
        if req.op != Op::Flush {
            self.head = req.offset_bytes + len;
        }
        let service = service.saturating_mul(u64::from(self.slowdown));
        // The earliest-free unit serves it.
        let (i, free_at) = self
            .units
            .iter()
            .copied()
            .enumerate()
            .min_by_key(|&(_, t)| t)
            .expect("at least one unit");
        let start = free_at.max(now);
        let done = match (p.write_cache_bytes, req.op) {
            (Some(cap), Op::Write { fua: false }) if p.write_cache_latency_ns.is_some() => {
                // Bounded cache: the write enters once the destage has made room for it,
                // holding its unit (its command slot) while it waits.
                let rate = p.write_bytes_per_s.saturating_mul(self.units.len() as u64);
                let drained = self.destaged_at.max(start);
                let entry = start.max(
                    (drained + Profile::transfer_ns(len, rate))
                        .saturating_sub(Profile::transfer_ns(cap, rate)),
                );
                self.destaged_at = drained + Profile::transfer_ns(len, rate);
                entry.saturating_add(service)
            }
            (Some(_), Op::Flush) => start.saturating_add(service).max(self.destaged_at),
            _ => start.saturating_add(service),
        };
        self.units[i] = done;
        done
    }

    fn inject(&mut self, req: &Request) -> Outcome {
        let end = req.offset_bytes + u64::from(req.len_bytes);
        for i in 0..self.faults.len() {
            let rule = &self.faults[i];
            if !rule.filter.matches(req.op) || rule.count == Some(0) {
                continue;
            }
            if let Some(r) = &rule.range {
                if !(r.start < end && req.offset_bytes < r.end) || req.op == Op::Flush {
                    continue;
                }
            }
            let p = rule.probability;
            if p < 1.0 {
                // 53 random bits -> uniform in [0, 1).
                let draw = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                if draw >= p {
                    continue;
                }
            }
            let fault = rule.fault;
            if let Some(c) = self.faults[i].count.as_mut() {
                *c -= 1;
            }
            return match fault {
                Fault::Error(e) => Outcome::Fail(e),
                Fault::Torn { blocks } if matches!(req.op, Op::Write { .. }) => {
                    Outcome::Torn(blocks.min(req.len_bytes / self.info.block_bytes))
                }
                Fault::Torn { .. } => Outcome::Fail(IoError::Io { errno: 5 }),
                Fault::Hang => Outcome::Hang,
            };
        }
        Outcome::Ok
    }

    /// Applies a finished request to the media and the caller's buffer.
    fn apply(&mut self, f: &InFlight) -> Result<(), IoError> {
        let req = &f.req;
        let off = req.offset_bytes as usize;
        let len = req.len_bytes as usize;
        let is_write = matches!(req.op, Op::Write { .. } | Op::WriteZeroes | Op::Discard);
        // Latent sector errors are judged when the read reaches the media, after any write
        // that completed before it has remapped the sectors.
        let end = req.offset_bytes + len as u64;
        let latent = req.op == Op::Read
            && self
                .latent
                .iter()
                .any(|r| r.start < end && req.offset_bytes < r.end);
        let outcome = if latent && f.outcome == Outcome::Ok {
            Outcome::Fail(IoError::Medium)
        } else {
            f.outcome
        };
        match req.op {
            Op::Flush => self.stats.flushes += 1,
            Op::Read => self.stats.reads += 1,
            _ => self.stats.writes += 1,
        }
        let applied = match outcome {
            Outcome::Hang => unreachable!("hung requests complete only when aborted"),
            Outcome::Ok => len,
            Outcome::Torn(blocks) => blocks as usize * self.info.block_bytes as usize,
            Outcome::Fail(e) => {
                self.stats.failed += 1;
                return Err(e);
            }
        };
        match req.op {
            Op::Read => {
                // SAFETY: validate() bounded off+len by the capacity (= data.len()); the
                // request buffer is valid, exclusive memory of len bytes until this
                // completion is returned (IoBuf::from_raw contract); data is our own Vec,
                // so the two do not overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.data.as_ptr().add(off),
                        req.buf.as_ptr(),
                        len,
                    )
                };
                self.stats.bytes_read += len as u64;
            }
            Op::Write { .. } | Op::WriteZeroes | Op::Discard if applied > 0 => {
                // The volatile cache model: a write that completes whole with FUA is
                // durable; any other keeps what it overwrote until a flush covers it.
                let durable = req.op == (Op::Write { fua: true }) && outcome == Outcome::Ok;
                if let (Some(c), false) = (&mut self.cache, durable) {
                    c.volatile_write(req.offset_bytes, self.data[off..off + applied].to_vec());
                }
                if let (Op::Write { .. }, Some(segs)) = (req.op, req.buf.segments()) {
                    // A gathered write: its pieces in order, the first `applied` bytes.
                    let mut at = 0;
                    for seg in segs {
                        let n = seg.len.min(applied - at);
                        // SAFETY: validate_gather() checked the pieces add up to len and
                        // bounded off+len by the capacity (= data.len()); each piece is
                        // valid memory of seg.len bytes until this completion is returned
                        // (IoBuf::gather contract), apart from our own Vec; at+n <= applied.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                seg.base,
                                self.data.as_mut_ptr().add(off + at),
                                n,
                            )
                        };
                        at += n;
                        if at == applied {
                            break;
                        }
                    }
                } else if let Op::Write { .. } = req.op {
                    // SAFETY: as above; `applied <= len`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            req.buf.as_ptr(),
                            self.data.as_mut_ptr().add(off),
                            applied,
                        )
                    };
                } else {
                    self.data[off..off + applied].fill(0);
                }
                if let (Some(c), true) = (&mut self.cache, durable) {
                    c.durable_write(req.offset_bytes, &self.data[off..off + applied]);
                }
            }
            Op::Write { .. } | Op::WriteZeroes | Op::Discard => {}
            Op::Flush => {
                if let Some(c) = &mut self.cache {
                    c.flushed(f.covers);
                }
            }
        }
        if is_write {
            self.stats.bytes_written += applied as u64;
            let (start, end) = (req.offset_bytes, req.offset_bytes + applied as u64);
            // Rewritten sectors are remapped: their latent errors are gone.
            self.latent.retain(|r| !(start <= r.start && r.end <= end));
        }
        match outcome {
            Outcome::Torn(_) => {
                self.stats.failed += 1;
                Err(IoError::Io { errno: 5 })
            }
            _ => Ok(()),
        }
    }
}

impl Channel for SimChannel {
    fn info(&self) -> &DeviceInfo {
        &self.dev.info
    }

    fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
        let now = self.dev.clock.now_ns();
        let mut s = self.dev.state.borrow_mut();
        if s.gone {
            return Err(SubmitError::Gone);
        }
        if s.gather {
            validate_gather(&s.info, &req)?;
        } else {
            validate(&s.info, &req)?;
        }
        // Each channel (queue pair) holds up to the device's queue depth; requests of
        // several channels beyond what the device serves at once wait inside it for a
        // parallel unit, as a host's block layer would queue them.
        let Some(slot) = self.free.pop() else {
            return Err(SubmitError::QueueFull);
        };
        s.queued += 1;
        let outcome = s.inject(&req);
        let done_at = if outcome == Outcome::Hang {
            NEVER
        } else {
            s.schedule(&req, now)
        };
        if let Some((log, device)) = &s.log {
            log.push(IoEvent {
                device: *device,
                kind: IoEventKind::Submit,
                op: req.op,
                offset_bytes: req.offset_bytes,
                len_bytes: req.len_bytes,
                at_ns: now,
                ok: true,
                data: Vec::new(),
                captured_at: 0,
            });
        }
        let covers = match (&s.cache, req.op) {
            (Some(c), Op::Flush) => c.seq,
            _ => 0,
        };
        self.slots[slot] = Some(InFlight {
            req,
            outcome,
            covers,
        });
        self.seq += 1;
        self.ready.push(Reverse((done_at, self.seq, slot)));
        Ok(())
    }

    fn kick(&mut self) {}

    fn poll(&mut self, out: &mut [Completion]) -> usize {
        let now = self.dev.clock.now_ns();
        let mut s = self.dev.state.borrow_mut();
        let mut n = 0;
        while n < out.len() {
            let Some(&Reverse((t, _, slot))) = self.ready.peek() else {
                break;
            };
            if t > now && !s.gone {
                break;
            }
            self.ready.pop();
            let f = self.slots[slot]
                .take()
                .expect("queued slot holds a request");
            self.free.push(slot);
            s.queued -= 1;
            let status = if s.gone {
                s.stats.failed += 1;
                Err(IoError::Gone)
            } else if f.outcome == Outcome::Hang {
                // Only an abort brings a hung request back (see `abort`).
                s.stats.failed += 1;
                Err(IoError::Timeout)
            } else {
                s.apply(&f)
            };
            if let Some((log, device)) = &s.log {
                let r = &f.req;
                let cap = log.capture();
                let (lo, hi) = (
                    r.offset_bytes.max(cap.start),
                    (r.offset_bytes + u64::from(r.len_bytes)).min(cap.end),
                );
                let data = if status.is_ok() && r.op != Op::Read && r.op != Op::Flush && lo < hi {
                    s.data[lo as usize..hi as usize].to_vec()
                } else {
                    Vec::new()
                };
                log.push(IoEvent {
                    device: *device,
                    kind: IoEventKind::Complete,
                    op: r.op,
                    offset_bytes: r.offset_bytes,
                    len_bytes: r.len_bytes,
                    at_ns: now,
                    ok: status.is_ok(),
                    data,
                    captured_at: lo,
                });
            }
            out[n] = Completion {
                tag: f.req.tag,
                status,
            };
            n += 1;
        }
        n
    }

    fn in_flight(&self) -> usize {
        self.ready.len()
    }

    /// As set by [`SimDevice::set_gather`] (default `true`).
    fn gathers(&self) -> bool {
        self.dev.state.borrow().gather
    }

    /// Aborts hung requests with `tag`: they complete now with [`IoError::Timeout`]. A
    /// request that is merely slow is not abortable (it is "on the media") and completes
    /// when its time comes, as a real device's in-progress command would.
    fn abort(&mut self, tag: u64) {
        let now = self.dev.clock.now_ns();
        let slots = &self.slots;
        let mut entries = std::mem::take(&mut self.ready).into_vec();
        for Reverse((t, _, slot)) in &mut entries {
            let hung = slots[*slot]
                .as_ref()
                .is_some_and(|f| f.req.tag == tag && f.outcome == Outcome::Hang);
            if hung && *t == NEVER {
                *t = now;
            }
        }
        self.ready = entries.into();
    }
}

/// Simulated members as [`crate::ppl::PplMedia`]: synchronous access to their media for
/// work done at assembly, before an array serves (PPL recovery). A member that has
/// disappeared returns [`IoError::Io`].
pub struct SimMedia<'a>(pub &'a [SimDevice]);

impl crate::ppl::PplMedia for SimMedia<'_> {
    fn read(&mut self, member: u16, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        let d = &self.0[usize::from(member)];
        if d.state.borrow().gone {
            return Err(IoError::Io { errno: 6 });
        }
        d.peek(offset, buf);
        Ok(())
    }

    fn write(&mut self, member: u16, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        let d = &self.0[usize::from(member)];
        if d.state.borrow().gone {
            return Err(IoError::Io { errno: 6 });
        }
        d.poke(offset, buf);
        Ok(())
    }

    fn flush(&mut self, _member: u16) -> Result<(), IoError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buf::AlignedBuf;
    use crate::device::IoBuf;

    fn io(buf: &mut AlignedBuf) -> IoBuf {
        // SAFETY: test buffers outlive their requests and are not touched while in flight.
        unsafe { IoBuf::from_slice(buf) }
    }

    fn rw(tag: u64, op: Op, off: u64, buf: IoBuf) -> Request {
        Request {
            tag,
            op,
            offset_bytes: off,
            len_bytes: buf.len(),
            buf,
        }
    }

    fn run_until_idle(
        clock: &SimClock,
        ch: &mut SimChannel,
        out: &mut Vec<(u64, u64, Result<(), IoError>)>,
    ) {
        let mut c = [Completion::EMPTY; 8];
        while let Some(t) = ch.next_completion_ns() {
            clock.advance_to(t.max(clock.now_ns()));
            let n = ch.poll(&mut c);
            for x in &c[..n] {
                out.push((clock.now_ns(), x.tag, x.status));
            }
        }
    }

    #[test]
    fn data_moves_at_completion_time_in_order() {
        let clock = SimClock::new();
        let dev = SimDevice::new(
            "sim0",
            1 << 20,
            4096,
            Profile::fixed(1000),
            clock.clone(),
            1,
        )
        .unwrap();
        let mut ch = dev.open_channel().unwrap();
        let mut w = AlignedBuf::from_slice(&[7u8; 4096]);
        let mut r = AlignedBuf::zeroed(4096);
        ch.submit(rw(1, Op::Write { fua: false }, 8192, io(&mut w)))
            .unwrap();
        let mut c = [Completion::EMPTY; 4];
        assert_eq!(ch.poll(&mut c), 0, "nothing completes before its time");
        clock.advance_by(1000);
        assert_eq!(ch.poll(&mut c), 1);
        ch.submit(rw(2, Op::Read, 8192, io(&mut r))).unwrap();
        let mut done = Vec::new();
        run_until_idle(&clock, &mut ch, &mut done);
        assert_eq!(done, vec![(2000, 2, Ok(()))]);
        assert_eq!(&r[..], &w[..]);
        assert_eq!(dev.stats().bytes_written, 4096);
    }

    #[test]
    fn hdd_seeks_and_queue_depth_one() {
        let clock = SimClock::new();
        let dev = SimDevice::new(
            "hdd",
            64 << 20,
            512,
            Profile::hdd_7200(false),
            clock.clone(),
            1,
        )
        .unwrap();
        let mut ch = dev.open_channel().unwrap();
        let mut a = AlignedBuf::zeroed(4096);
        let mut b = AlignedBuf::zeroed(4096);
        ch.submit(rw(1, Op::Read, 1 << 20, io(&mut a))).unwrap();
        assert_eq!(
            ch.submit(rw(2, Op::Read, 0, io(&mut b))),
            Err(SubmitError::QueueFull)
        );
        let mut done = Vec::new();
        run_until_idle(&clock, &mut ch, &mut done);
        let random = done[0].0;
        assert!(
            random > 12_000_000,
            "random read pays seek + half a rotation: {random}"
        );
        // Sequential continuation pays no positioning.
        ch.submit(rw(3, Op::Read, (1 << 20) + 4096, io(&mut b)))
            .unwrap();
        run_until_idle(&clock, &mut ch, &mut done);
        assert!(done[1].0 - random < 1_000_000);
    }

    #[test]
    fn parallel_units_overlap_requests() {
        let clock = SimClock::new();
        let dev = SimDevice::new(
            "nvme",
            64 << 20,
            4096,
            Profile::nvme_ssd(),
            clock.clone(),
            1,
        )
        .unwrap();
        let mut ch = dev.open_channel().unwrap();
        let mut bufs: Vec<AlignedBuf> = (0..8).map(|_| AlignedBuf::zeroed(4096)).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            ch.submit(rw(i as u64, Op::Read, i as u64 * 4096, io(b)))
                .unwrap();
        }
        let mut done = Vec::new();
        run_until_idle(&clock, &mut ch, &mut done);
        // Eight reads on 32 units finish together, not one after the other.
        assert_eq!(done.len(), 8);
        assert_eq!(done.first().unwrap().0, done.last().unwrap().0);
    }

    #[test]
    fn bounded_cache_fills_then_writes_and_reads_wait_for_the_destage() {
        let clock = SimClock::new();
        let mut p = Profile::sata_ssd_bounded_cache();
        p.write_cache_bytes = Some(4 << 20);
        let dev = SimDevice::new("sata", 64 << 20, 4096, p, clock.clone(), 1).unwrap();
        let mut ch = dev.open_channel().unwrap();
        let mut w = AlignedBuf::zeroed(1 << 20);
        let mut r = AlignedBuf::zeroed(4096);
        let mut done = Vec::new();
        // Four MiB fit: acknowledged at cache speed.
        for t in 0..4 {
            ch.submit(rw(t, Op::Write { fua: false }, t << 20, io(&mut w)))
                .unwrap();
            run_until_idle(&clock, &mut ch, &mut done);
        }
        assert!(done.iter().all(|d| d.0 < 200_000), "{done:?}");
        // The cache is full: the next writes wait for room (1 MiB at 500 MB/s ≈ 2.1 ms
        // each), holding all four units, and a read queues behind them.
        let t0 = clock.now_ns();
        for t in 4..8 {
            ch.submit(rw(t, Op::Write { fua: false }, t << 20, io(&mut w)))
                .unwrap();
        }
        ch.submit(rw(99, Op::Read, 0, io(&mut r))).unwrap();
        run_until_idle(&clock, &mut ch, &mut done);
        let read_at = done.iter().find(|d| d.1 == 99).unwrap().0;
        assert!(
            read_at - t0 > 1_000_000,
            "read waited behind the full cache: {}",
            read_at - t0
        );
        let last_write = done.iter().filter(|d| d.1 < 8).map(|d| d.0).max().unwrap();
        assert!(last_write - t0 > 6_000_000, "writes paced by the destage");
        // A flush waits for the destage of all eight MiB.
        ch.submit(Request {
            tag: 100,
            op: Op::Flush,
            offset_bytes: 0,
            len_bytes: 0,
            buf: IoBuf::NONE,
        })
        .unwrap();
        run_until_idle(&clock, &mut ch, &mut done);
        assert!(done.last().unwrap().0 >= 8 * Profile::transfer_ns(1 << 20, 500_000_000));
    }

    #[test]
    fn cached_writes_are_fast_and_flush_pays() {
        let clock = SimClock::new();
        let dev = SimDevice::new(
            "sata",
            64 << 20,
            4096,
            Profile::sata_ssd_cached(),
            clock.clone(),
            1,
        )
        .unwrap();
        let mut ch = dev.open_channel().unwrap();
        let mut w = AlignedBuf::zeroed(1 << 20);
        ch.submit(rw(1, Op::Write { fua: false }, 0, io(&mut w)))
            .unwrap();
        let mut done = Vec::new();
        run_until_idle(&clock, &mut ch, &mut done);
        assert_eq!(done[0].0, 25_000);
        ch.submit(Request {
            tag: 2,
            op: Op::Flush,
            offset_bytes: 0,
            len_bytes: 0,
            buf: IoBuf::NONE,
        })
        .unwrap();
        run_until_idle(&clock, &mut ch, &mut done);
        assert!(
            done[1].0 - 25_000 > 1_000_000,
            "flush writes the cached MiB: {:?}",
            done
        );
        ch.submit(rw(3, Op::Write { fua: true }, 0, io(&mut w)))
            .unwrap();
        run_until_idle(&clock, &mut ch, &mut done);
        assert!(done[2].0 - done[1].0 > 1_000_000, "FUA bypasses the cache");
    }

    #[test]
    fn faults_fire_by_rule_and_by_seed() {
        let clock = SimClock::new();
        let dev = SimDevice::new("f", 1 << 20, 512, Profile::fixed(10), clock.clone(), 42).unwrap();
        dev.add_fault(FaultRule {
            filter: OpFilter::Read,
            range: Some(4096..8192),
            fault: Fault::Error(IoError::Io { errno: 5 }),
            probability: 1.0,
            count: Some(1),
        });
        dev.add_latent_error(65536..66048);
        let mut ch = dev.open_channel().unwrap();
        let mut b = AlignedBuf::zeroed(4096);
        let mut done = Vec::new();
        for (tag, off) in [(1, 4096), (2, 4096), (3, 65536)] {
            ch.submit(rw(tag, Op::Read, off, io(&mut b))).unwrap();
            run_until_idle(&clock, &mut ch, &mut done);
        }
        let st: Vec<_> = done.iter().map(|d| d.2).collect();
        assert_eq!(
            st,
            vec![Err(IoError::Io { errno: 5 }), Ok(()), Err(IoError::Medium)]
        );
        // Rewriting the latent sector clears it.
        ch.submit(rw(4, Op::Write { fua: false }, 65536, io(&mut b)))
            .unwrap();
        ch.submit(rw(5, Op::Read, 65536, io(&mut b))).unwrap();
        run_until_idle(&clock, &mut ch, &mut done);
        assert_eq!(
            done[3..].iter().map(|d| d.2).collect::<Vec<_>>(),
            vec![Ok(()), Ok(())]
        );

        // Probabilistic faults replay exactly from the seed.
        let fire_pattern = |seed| {
            let clock = SimClock::new();
            let dev =
                SimDevice::new("p", 1 << 20, 512, Profile::fixed(1), clock.clone(), seed).unwrap();
            dev.add_fault(FaultRule {
                filter: OpFilter::Any,
                range: None,
                fault: Fault::Error(IoError::Io { errno: 5 }),
                probability: 0.3,
                count: None,
            });
            let mut ch = dev.open_channel().unwrap();
            let mut b = AlignedBuf::zeroed(512);
            let mut done = Vec::new();
            for i in 0..64 {
                ch.submit(rw(i, Op::Read, 0, io(&mut b))).unwrap();
                run_until_idle(&clock, &mut ch, &mut done);
            }
            done.iter().map(|d| d.2.is_err()).collect::<Vec<_>>()
        };
        let a = fire_pattern(7);
        assert_eq!(a, fire_pattern(7));
        assert_ne!(a, fire_pattern(8));
        let fired = a.iter().filter(|&&x| x).count();
        assert!((8..=32).contains(&fired), "about 30% of 64: {fired}");
    }

    #[test]
    fn torn_write_applies_a_prefix_and_fails() {
        let clock = SimClock::new();
        let dev = SimDevice::new("t", 1 << 20, 512, Profile::fixed(10), clock.clone(), 1).unwrap();
        dev.add_fault(FaultRule {
            filter: OpFilter::Write,
            range: None,
            fault: Fault::Torn { blocks: 3 },
            probability: 1.0,
            count: Some(1),
        });
        let mut ch = dev.open_channel().unwrap();
        let mut w = AlignedBuf::from_slice(&[0xabu8; 4096]);
        ch.submit(rw(1, Op::Write { fua: false }, 0, io(&mut w)))
            .unwrap();
        let mut done = Vec::new();
        run_until_idle(&clock, &mut ch, &mut done);
        assert_eq!(done[0].2, Err(IoError::Io { errno: 5 }));
        let img = dev.contents();
        assert!(img[..1536].iter().all(|&b| b == 0xab));
        assert!(img[1536..4096].iter().all(|&b| b == 0));
    }

    #[test]
    fn disappearing_device_fails_in_flight_and_refuses_new() {
        let clock = SimClock::new();
        let dev = SimDevice::new(
            "g",
            1 << 20,
            512,
            Profile::fixed(1_000_000),
            clock.clone(),
            1,
        )
        .unwrap();
        let mut ch = dev.open_channel().unwrap();
        let mut b = AlignedBuf::zeroed(512);
        ch.submit(rw(1, Op::Read, 0, io(&mut b))).unwrap();
        dev.disappear();
        let mut c = [Completion::EMPTY; 2];
        assert_eq!(ch.poll(&mut c), 1);
        assert_eq!(c[0].status, Err(IoError::Gone));
        assert_eq!(
            ch.submit(rw(2, Op::Read, 0, io(&mut b))),
            Err(SubmitError::Gone)
        );
        assert_eq!(dev.stats().failed, 1);
    }

    #[test]
    fn slow_member_takes_longer() {
        let clock = SimClock::new();
        let dev =
            SimDevice::new("s", 1 << 20, 512, Profile::fixed(1000), clock.clone(), 1).unwrap();
        dev.set_slowdown(10);
        let mut ch = dev.open_channel().unwrap();
        let mut b = AlignedBuf::zeroed(512);
        ch.submit(rw(1, Op::Read, 0, io(&mut b))).unwrap();
        assert_eq!(ch.next_completion_ns(), Some(10_000));
    }

    fn flush_req(tag: u64) -> Request {
        Request {
            tag,
            op: Op::Flush,
            offset_bytes: 0,
            len_bytes: 0,
            buf: IoBuf::NONE,
        }
    }

    fn cached_dev(clock: &SimClock) -> SimDevice {
        SimDevice::new(
            "cache",
            1 << 20,
            512,
            Profile::sata_ssd_cached(),
            clock.clone(),
            1,
        )
        .unwrap()
    }

    /// What block `b` of `img` holds: the fill byte of a block written whole with one
    /// byte value (0: never written, or reverted to that).
    fn fill(img: &[u8], b: usize) -> u8 {
        let blk = &img[b * 512..(b + 1) * 512];
        assert!(blk.iter().all(|&x| x == blk[0]), "block {b} is mixed");
        blk[0]
    }

    #[test]
    fn flush_makes_writes_completed_before_it_durable_and_no_others() {
        for seed in 0..32 {
            let clock = SimClock::new();
            let dev = cached_dev(&clock);
            let mut ch = dev.open_channel().unwrap();
            let mut a = AlignedBuf::from_slice(&[1u8; 4096]);
            let mut b = AlignedBuf::from_slice(&[2u8; 4096]);
            let mut done = Vec::new();
            ch.submit(rw(1, Op::Write { fua: false }, 0, io(&mut a)))
                .unwrap();
            run_until_idle(&clock, &mut ch, &mut done);
            assert_eq!(dev.volatile_bytes(), 4096);
            // The flush is submitted after `a` completed; `b` is submitted with it and
            // completes (from the cache) long before it: the flush covers `a` only.
            ch.submit(flush_req(2)).unwrap();
            ch.submit(rw(3, Op::Write { fua: false }, 8192, io(&mut b)))
                .unwrap();
            run_until_idle(&clock, &mut ch, &mut done);
            assert_eq!(done.last().unwrap().1, 2, "the flush completes last");
            assert_eq!(dev.volatile_bytes(), 4096, "b is still volatile");
            let loss = dev.crash_volatile(seed);
            assert_eq!(loss.kept + loss.lost + loss.torn, 1);
            let img = dev.contents();
            for blk in 0..8 {
                assert_eq!(fill(&img, blk), 1, "seed {seed}: the flushed write stays");
                assert!([0, 2].contains(&fill(&img, 16 + blk)), "seed {seed}");
            }
            assert_eq!(dev.volatile_bytes(), 0);
        }
    }

    #[test]
    fn crash_reverts_unflushed_writes_newest_first_and_seeds_replay() {
        // Three overlapping volatile writes: blocks 0..8 get 1, then 4..12 get 2, then
        // 0..2 get 3. After a crash every block holds a prefix of its own writes.
        let run = |seed| {
            let clock = SimClock::new();
            let dev = cached_dev(&clock);
            let mut ch = dev.open_channel().unwrap();
            let mut done = Vec::new();
            for (tag, (off, len, v)) in [(0u64, 4096, 1u8), (2048, 4096, 2), (0, 1024, 3)]
                .into_iter()
                .enumerate()
            {
                let mut w = AlignedBuf::from_slice(&vec![v; len]);
                ch.submit(rw(tag as u64, Op::Write { fua: false }, off, io(&mut w)))
                    .unwrap();
                run_until_idle(&clock, &mut ch, &mut done);
            }
            assert_eq!(dev.volatile_bytes(), 4096 + 4096 + 1024);
            let loss = dev.crash_volatile(seed);
            (dev.contents(), loss)
        };
        let mut outcomes = std::collections::HashSet::new();
        let mut torn = 0;
        for seed in 0..200 {
            let (img, loss) = run(seed);
            assert_eq!((img.clone(), loss), run(seed), "seed {seed} replays");
            torn += loss.torn;
            for b in 0..12 {
                let got = fill(&img, b);
                let allowed: &[u8] = match b {
                    0..=1 => &[0, 1, 3],
                    2..=3 => &[0, 1],
                    4..=7 => &[0, 1, 2],
                    _ => &[0, 2],
                };
                assert!(allowed.contains(&got), "seed {seed}: block {b} holds {got}");
            }
            assert!(img[12 * 512..].iter().all(|&x| x == 0));
            outcomes.insert(img);
        }
        assert!(torn > 0, "some writes are torn");
        assert!(
            outcomes.len() > 8,
            "seeds draw different losses: {}",
            outcomes.len()
        );
        // Everything lost, and everything kept, both happen.
        assert!(outcomes.iter().any(|i| i.iter().all(|&x| x == 0)));
        assert!(outcomes.iter().any(|i| (0..12)
            .map(|b| fill(i, b))
            .eq([3, 3, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2])));
    }

    #[test]
    fn fua_write_is_durable_alone_and_failed_flush_makes_nothing_durable() {
        for seed in 0..32 {
            let clock = SimClock::new();
            let dev = cached_dev(&clock);
            dev.add_fault(FaultRule {
                filter: OpFilter::Flush,
                range: None,
                fault: Fault::Error(IoError::Io { errno: 5 }),
                probability: 1.0,
                count: Some(1),
            });
            let mut ch = dev.open_channel().unwrap();
            let mut done = Vec::new();
            let mut v = AlignedBuf::from_slice(&[1u8; 4096]);
            let mut f = AlignedBuf::from_slice(&[9u8; 2048]);
            ch.submit(rw(1, Op::Write { fua: false }, 0, io(&mut v)))
                .unwrap();
            run_until_idle(&clock, &mut ch, &mut done);
            ch.submit(flush_req(2)).unwrap();
            run_until_idle(&clock, &mut ch, &mut done);
            assert!(done[1].2.is_err(), "the flush failed");
            assert_eq!(
                dev.volatile_bytes(),
                4096,
                "a failed flush makes nothing durable"
            );
            // FUA over the first half: durable with its bytes; the second half of the
            // older write stays volatile.
            ch.submit(rw(3, Op::Write { fua: true }, 0, io(&mut f)))
                .unwrap();
            run_until_idle(&clock, &mut ch, &mut done);
            assert_eq!(dev.volatile_bytes(), 4096, "FUA adds nothing volatile");
            dev.crash_volatile(seed);
            let img = dev.contents();
            for b in 0..4 {
                assert_eq!(fill(&img, b), 9, "seed {seed}: the FUA write stays");
            }
            for b in 4..8 {
                assert!([0, 1].contains(&fill(&img, b)), "seed {seed}");
            }
        }
    }

    #[test]
    fn poke_is_durable_and_devices_without_a_cache_lose_nothing() {
        let clock = SimClock::new();
        let mut done = Vec::new();
        let mut w = AlignedBuf::from_slice(&[1u8; 1024]);
        let mut lost = false;
        for seed in 0..16 {
            let dev = cached_dev(&clock);
            let mut ch = dev.open_channel().unwrap();
            ch.submit(rw(1, Op::Write { fua: false }, 0, io(&mut w)))
                .unwrap();
            run_until_idle(&clock, &mut ch, &mut done);
            dev.poke(0, &[5u8; 512]);
            dev.crash_volatile(seed);
            let img = dev.contents();
            assert_eq!(fill(&img, 0), 5, "seed {seed}: the poked block stays");
            assert!([0, 1].contains(&fill(&img, 1)));
            lost |= fill(&img, 1) == 0;
        }
        assert!(lost, "some seed loses the volatile block");

        let plain =
            SimDevice::new("nvme", 1 << 20, 512, Profile::nvme_ssd(), clock.clone(), 1).unwrap();
        let mut ch = plain.open_channel().unwrap();
        ch.submit(rw(1, Op::Write { fua: false }, 0, io(&mut w)))
            .unwrap();
        run_until_idle(&clock, &mut ch, &mut done);
        assert_eq!(plain.volatile_bytes(), 0);
        assert_eq!(plain.crash_volatile(7), VolatileLoss::default());
        assert_eq!(fill(&plain.contents(), 1), 1);
    }
}
