//! The array: turns array requests into member I/O on one reactor's channels.
//!
//! An [`Array`] owns one channel to each member and runs every stripe operation it is given
//! as an explicit state machine driven by member completions. It is the per-reactor core of
//! the stripe engine: with several reactors, each runs an `Array` over its own channels and
//! receives the requests for the stripes it owns, plus reads of other reactors' stripes
//! that it serves itself (foreign reads, see below; the routing between reactors lives in
//! the reactor layer). Everything here is single-threaded and lock-free by construction;
//! the only state shared with other shards is the [`StripeGate`] (atomics).
//!
//! # Foreign reads
//! A read of a stripe another shard owns ([`Array::set_gate`]) is served here when the
//! gate admits it (no write of the owner holds the stripe; this shard's view of failed
//! members is not behind the owner's); it then holds the stripe in the gate until its
//! member I/O is done, and the owner's writes to that stripe wait for it
//! (phase `GateWait`). It goes to the owner instead ([`Array::take_moved`]) when the
//! gate refuses, while a member is being rebuilt or a replacement copied here (only the
//! owner knows its stripes' positions), or when a latent sector error must be rewritten.
//!
//! # Ordering
//! A request is split at stripe boundaries into stripe operations. Operations on one
//! stripe start in arrival order (the stripe's owner orders them): a write (or write-zeroes,
//! discard) runs alone on its stripe, reads of a stripe run together while no write is
//! running or waiting ahead of them. So overlapping writes land in submission order, a
//! read never sees half of a write, and a stream of reads cannot starve a write (a waiting
//! write holds back every later operation on its stripe). Requests are split in arrival
//! order too, so a request cannot overtake an earlier one on any stripe.
//!
//! # Reads
//! A read of healthy members goes straight into the caller's buffer. If a member of the
//! stripe has failed, or a read fails (which fails that member), the stripe's surviving
//! chunks are read over the needed range and the lost data is rebuilt from parity.
//!
//! # Writes
//! Planned by [`crate::stripe::plan_write`]: full-stripe, RMW, RCW or degraded
//! reconstruct-write. A member write that fails fails the member; the write still succeeds
//! while the stripe keeps enough members to rebuild it (the parity written with it covers
//! the lost chunk). The client sees an error only when data is unrecoverable.
//!
//! # Replacement (md's `want_replacement`)
//! A member may get a **replacement device** ([`Array::start_replace`]): an extra device
//! entry beside the member's, written by every write to the member (md sends writes to a
//! slot's `rdev` and its `replacement` alike, `ops_run_io`) and filled by the replace
//! process ([`ProcessKind::Replace`]); reads keep going to the member. Member requests
//! carry a device id in their tags, not the slot, so when the replace completes the two
//! devices swap places ([`Array::complete_replace`]) with requests still in flight on
//! either: completions find their device by id.
//!
//! # Write-intent bitmap
//! With a bitmap attached ([`Array::attach_bitmap`], `crate::bitmap`), a write,
//! write-zeroes or discard operation waits in [`Phase`] `BitmapWait` — holding its stripe —
//! until the bits of the regions its stripe covers are durable on every online member;
//! reads never wait. The owner shard writes the bitmap sectors (a member I/O kind of its
//! own, at absolute member offsets outside the data area) and runs the lazy-clear daemon
//! on the array clock. Without a bitmap nothing changes.
//!
//! # Limits
//! Every pool is sized at construction ([`ArrayConfig`]); the data path allocates nothing.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use arrayvec::ArrayVec;
use thiserror::Error;

use crate::bitmap::{BitmapOwner, BitmapWrite, WriteIntent};
use crate::buf::AlignedBuf;
use crate::device::{Channel, Completion, IoBuf, IoError, Op, Request, SubmitError};
use crate::geometry::{ArrayGeometry, Level, Role, MAX_RAID6_MEMBERS};
use crate::parity::{ChunkId, Parity, MAX_DATA_CHUNKS};
use crate::process::{
    ProcessError, ProcessKind, ProcessRequest, ProcessState, ShardProgress, ShardWalk,
    MAX_BACKGROUND_OPS, MD_STRIPE_PAGE_BYTES, SECTOR_BYTES,
};
use crate::qos::dispatch::MemberQueue;
use crate::qos::{Admission, Pacer, Unpaced};
use crate::qos::{DepthConfig, IoClass, QosState};
use crate::shard::{owner, StripeGate};
use crate::stripe::{plan_write, ChunkRange, StripeWrite, WriteMode};
use locks::StripeLocks;

/// What an array request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArrayOp {
    /// Read `len_bytes` at `offset_bytes` into the buffer.
    Read,
    /// Write the buffer; with `fua`, durable on every member it touched before completion.
    Write {
        /// Force unit access.
        fua: bool,
    },
    /// Flush every member.
    Flush,
    /// Make `len_bytes` at `offset_bytes` read back as zeroes, parity kept consistent
    /// (carries no buffer: [`IoBuf::NONE`], `len_bytes` is the range). With `fua`, durable
    /// on every member it touched before completion.
    WriteZeroes {
        /// Force unit access.
        fua: bool,
    },
    /// Advisory deallocation of `len_bytes` at `offset_bytes` (no buffer). Only whole
    /// stripes inside the range are deallocated on the members; the contents of the range
    /// afterwards are unspecified by the caller's contract but parity stays consistent.
    Discard,
}

impl ArrayOp {
    /// Whether the request moves data through its buffer (read, write).
    pub fn has_buffer(self) -> bool {
        matches!(self, ArrayOp::Read | ArrayOp::Write { .. })
    }

    /// Whether the request changes the array's contents (write, write-zeroes, discard).
    pub fn is_write(self) -> bool {
        matches!(
            self,
            ArrayOp::Write { .. } | ArrayOp::WriteZeroes { .. } | ArrayOp::Discard
        )
    }

    fn fua(self) -> bool {
        matches!(
            self,
            ArrayOp::Write { fua: true } | ArrayOp::WriteZeroes { fua: true }
        )
    }
}

/// An array request.
#[derive(Clone, Copy, Debug)]
pub struct ArrayRequest {
    /// Caller's tag, returned in the completion.
    pub tag: u64,
    /// What to do.
    pub op: ArrayOp,
    /// Logical byte offset (multiple of the block size; 0 for `Flush`).
    pub offset_bytes: u64,
    /// Length in bytes (multiple of the block size; 0 for `Flush`); equals `buf.len()` for
    /// reads and writes.
    pub len_bytes: u32,
    /// Data buffer, 64-byte aligned (4 KiB for O_DIRECT members); [`IoBuf::NONE`] for
    /// `Flush`, `WriteZeroes` and `Discard`.
    pub buf: IoBuf,
}

/// Why an array request failed or was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum ArrayError {
    /// Malformed request (range, alignment, buffer length).
    #[error("invalid request: {0}")]
    Invalid(&'static str),
    /// The request pool is full: poll completions, then retry.
    #[error("array request queue is full")]
    QueueFull,
    /// More members of the stripe are lost than its redundancy: its data cannot be served.
    #[error("stripe {stripe} has lost more members than its redundancy: data unrecoverable")]
    Unrecoverable {
        /// The stripe.
        stripe: u64,
    },
    /// The array has lost more members than its redundancy and is failed.
    #[error("the array has failed")]
    Failed,
}

/// A finished array request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArrayCompletion {
    /// The request's tag.
    pub tag: u64,
    /// Outcome.
    pub status: Result<(), ArrayError>,
}

/// Health of a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemberState {
    /// Serving I/O.
    Online,
    /// Failed by the error shown; never used again until replaced (rebuild: issue 5).
    Failed(IoError),
    /// Marked faulty by the operator (`ferroraid fail`); never used again until replaced.
    FailedByOperator,
    /// A new device in a failed member's slot, being rebuilt ([`Array::replace_member`]):
    /// written by every foreground write, read only for the stripes the rebuild has
    /// already covered on this shard (md's rule for a recovering device; see
    /// [`crate::process`]). Counts as missing for the array's redundancy until the
    /// rebuild has finished on every shard ([`Array::complete_rebuild`]).
    Rebuilding,
}

impl MemberState {
    /// Whether the member is failed (never used again until replaced).
    pub fn is_failed(self) -> bool {
        matches!(self, MemberState::Failed(_) | MemberState::FailedByOperator)
    }
}

/// Counters of what the array did, by path: what a benchmark or test reads to know which
/// strategies ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ArrayStats {
    /// Stripe reads served straight from the members.
    pub direct_reads: u64,
    /// Stripe reads that rebuilt data from parity.
    pub degraded_reads: u64,
    /// Stripe writes by strategy.
    pub full_stripe_writes: u64,
    /// Read-modify-write stripe writes.
    pub rmw_writes: u64,
    /// Reconstruct-write stripe writes.
    pub rcw_writes: u64,
    /// Degraded reconstruct-writes.
    pub degraded_writes: u64,
    /// Members failed by I/O errors or disappearance.
    pub member_failures: u64,
    /// Unrecovered read errors (latent sector errors) absorbed: the range was rebuilt from
    /// redundancy for the operation, and the member kept in service.
    pub medium_errors: u64,
    /// Ranges rewritten after a degraded read rebuilt them from redundancy.
    pub read_errors_repaired: u64,
    /// Completions with a tag the array never issued (a back-end bug): counted, ignored.
    pub stray_completions: u64,
    /// Whole stripes zeroed with member write-zeroes (data and parity alike: the parity
    /// of all-zero data is zero).
    pub zeroed_stripes: u64,
    /// Whole stripes deallocated with member discards.
    pub discarded_stripes: u64,
    /// Stripe pieces of discard requests left alone (partial stripes, or members that do
    /// not promise zeroes after a discard): discard is advisory.
    pub discards_skipped: u64,
    /// Member requests that outlived the command timeout (each failed its member).
    pub timeouts: u64,
    /// Reads of stripes another shard owns served by this one ([`crate::shard::StripeGate`]).
    pub foreign_reads: u64,
    /// Foreign reads handed to the stripe's owner instead ([`Array::take_moved`]): a write
    /// held the stripe, a member was being rebuilt, or the read met an error to repair.
    pub moved_reads: u64,
    /// Owner writes that waited for foreign reads of their stripe to finish.
    pub gate_waits: u64,
}

/// What one shard sent to one member, for status and statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemberCounters {
    /// Read requests issued.
    pub reads: u64,
    /// Write, write-zeroes and discard requests issued.
    pub writes: u64,
    /// Flush requests issued.
    pub flushes: u64,
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes written (write-zeroes and discards count their range).
    pub write_bytes: u64,
    /// Requests that completed with an error (any kind).
    pub errors: u64,
}

impl MemberCounters {
    /// Adds `o` into `self` (merging shards).
    pub fn add(&mut self, o: &MemberCounters) {
        self.reads += o.reads;
        self.writes += o.writes;
        self.flushes += o.flushes;
        self.read_bytes += o.read_bytes;
        self.write_bytes += o.write_bytes;
        self.errors += o.errors;
    }
}

/// A member-latency histogram: ns, 1 ns to one hour, 2 significant digits (fixed size,
/// so recording never allocates).
pub fn new_latency_histogram() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000_000, 2).expect("valid bounds")
}

/// Pool sizes, fixed at construction.
#[derive(Clone, Copy, Debug)]
pub struct ArrayConfig {
    /// Array requests in flight at once.
    pub requests: usize,
    /// Stripe operations in flight or waiting at once; each holds one chunk buffer per
    /// member, so memory is `stripe_ops × members × chunk`.
    pub stripe_ops: usize,
    /// Byte offset of the data area on every member (md's `data_offset`).
    pub data_offset_bytes: u64,
    /// Members known to be failed when the array starts (assembled degraded).
    pub failed_members: [Option<u16>; 2],
    /// Command timeout, ns: a member request outstanding longer than this (counted from
    /// the start of its operation's phase, on the clock given to [`Array::set_now`]) fails
    /// its member, is aborted ([`Channel::abort`]) and the operation continues from
    /// redundancy. 0 disables timeouts.
    pub io_timeout_ns: u64,
    /// Background stripe operations (resync, rebuild, check, repair) one shard may have in
    /// flight at once, at most [`MAX_BACKGROUND_OPS`]. They come from a pool of their own
    /// (each with one chunk buffer per member plus two of scratch), so background work
    /// never takes one of foreground's `stripe_ops`, and always can progress as far as
    /// the pacer admits it. 0 disables background processes.
    pub background_ops: usize,
    /// Members assembled as being rebuilt ([`MemberState::Rebuilding`]), each with its
    /// recovery position in stripes (md's `recovery_offset` divided by the chunk size in
    /// sectors): in sync below it. [`Array::pending_rebuild`] gives the rebuild that
    /// resumes them.
    pub rebuilding: [Option<(u16, u64)>; 2],
    /// Members of `rebuilding` that returned after a short absence and need only the
    /// write-intent bitmap's dirty regions rebuilt (md's `Bitmap_sync` re-add,
    /// `MD_FEATURE_RECOVERY_BITMAP`); honoured only with a bitmap attached
    /// ([`Array::attach_bitmap`]) that was not forced all-dirty at start.
    pub bitmap_recovery: [Option<u16>; 2],
    /// Per-member queue-depth control ([`crate::qos::depth`]), the same for every member.
    pub depth: DepthConfig,
}

/// Default background operations in flight per shard: four chunk-wide stripe operations
/// keep every member busy with large sequential requests while leaving the depth to
/// foreground (md's raid5 resync likewise keeps a handful of stripes in flight).
pub const DEFAULT_BACKGROUND_OPS: usize = 4;

/// Default command timeout: 30 s, the Linux block layer's and NVMe driver's default.
pub const DEFAULT_IO_TIMEOUT_NS: u64 = 30_000_000_000;

impl ArrayStats {
    /// Adds `o` into `self` (merging shards).
    pub fn add(&mut self, o: &ArrayStats) {
        self.direct_reads += o.direct_reads;
        self.degraded_reads += o.degraded_reads;
        self.full_stripe_writes += o.full_stripe_writes;
        self.rmw_writes += o.rmw_writes;
        self.rcw_writes += o.rcw_writes;
        self.degraded_writes += o.degraded_writes;
        self.member_failures += o.member_failures;
        self.medium_errors += o.medium_errors;
        self.read_errors_repaired += o.read_errors_repaired;
        self.stray_completions += o.stray_completions;
        self.zeroed_stripes += o.zeroed_stripes;
        self.discarded_stripes += o.discarded_stripes;
        self.discards_skipped += o.discards_skipped;
        self.timeouts += o.timeouts;
        self.foreign_reads += o.foreign_reads;
        self.moved_reads += o.moved_reads;
        self.gate_waits += o.gate_waits;
    }
}

impl Default for ArrayConfig {
    /// 256 requests, 32 stripe operations, data at offset 0, no member failed, 30 s
    /// command timeout, [`DEFAULT_BACKGROUND_OPS`] background operations, ferroraid's depth
    /// controller with a derived target.
    fn default() -> Self {
        Self {
            requests: 256,
            stripe_ops: 32,
            data_offset_bytes: 0,
            failed_members: [None, None],
            io_timeout_ns: DEFAULT_IO_TIMEOUT_NS,
            background_ops: DEFAULT_BACKGROUND_OPS,
            rebuilding: [None, None],
            bitmap_recovery: [None, None],
            depth: DepthConfig::default(),
        }
    }
}

/// Member-tag layout: stripe operation index in the high bits, the device id
/// ([`Member::id`]) in the low 16.
const MEMBER_BITS: u32 = 16;
const _: () = assert!((MAX_RAID6_MEMBERS as u64 + 1) < (1 << MEMBER_BITS));
/// `entry_of` value of a device id no entry holds.
const NO_ENTRY: u16 = u16::MAX;

/// Where a member's replacement stands on one shard ([`Array::replacement`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplaceState {
    /// The replacement is written by every write to its member and filled by the replace
    /// process.
    Copying,
    /// The replacement device failed (the error it returned): the replace stopped, the
    /// member keeps its slot, the array is as it was.
    Failed(IoError),
    /// The replacement took the member's slot ([`Array::complete_replace`]); the old
    /// device is out of the array.
    Done,
}

/// A member's replacement on one shard: which member, the caller's serial for it (so
/// late messages about an earlier replacement are ignored), and its state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplaceInfo {
    /// The member (slot) being replaced.
    pub member: u16,
    /// The caller's serial number of this replacement.
    pub serial: u64,
    /// Its state.
    pub state: ReplaceState,
}

struct Member<C> {
    ch: C,
    state: MemberState,
    /// Requests waiting for the channel, one queue per I/O class, dispatched in class
    /// order within the depth controller's limits ([`crate::qos::dispatch`]).
    queue: MemberQueue,
    /// Largest request the member takes, bytes (a multiple of its block size).
    max_transfer: u32,
    counters: MemberCounters,
    /// Completion latency of this shard's requests to the member, ns, measured from the
    /// start of the issuing phase to the loop turn that reaped it.
    latency: hdrhistogram::Histogram<u64>,
    /// While [`MemberState::Rebuilding`]: this shard's stripes below it are rebuilt (the
    /// member is read there); above it the member counts as missing.
    recovery_stripe: u64,
    /// While [`MemberState::Rebuilding`]: only the write-intent bitmap's dirty regions need
    /// rebuilding (a re-add, [`ArrayConfig::bitmap_recovery`]).
    bitmap_recovery: bool,
    /// The device id in this device's request tags. It stays with the device (channel)
    /// when a replacement swaps entries, so requests in flight find it ([`Array`]'s
    /// `entry_of`).
    id: u16,
}

impl<C: Channel> Member<C> {
    /// A device entry for `ch`, online, with tag id `id` and queues sized for
    /// `total_sops` stripe operations of `chunk`-byte chunks.
    fn new(ch: C, id: u16, cfg: &ArrayConfig, total_sops: usize, chunk: usize) -> Self {
        let i = ch.info();
        let max_transfer = i.max_transfer_bytes / i.block_bytes * i.block_bytes;
        let queue_depth = i.queue_depth;
        Member {
            ch,
            state: MemberState::Online,
            // A chunk split at the largest transfer: room for every piece of every
            // operation (foreground, background, the bitmap owner's batch), in any one
            // class.
            queue: MemberQueue::new(
                cfg.depth,
                queue_depth,
                (total_sops + 1) * (chunk / max_transfer as usize + 1),
                total_sops + 1,
                MEMBER_BITS,
            ),
            max_transfer,
            counters: MemberCounters::default(),
            latency: new_latency_histogram(),
            recovery_stripe: 0,
            bitmap_recovery: false,
            id,
        }
    }
}

struct ReqCtx {
    tag: u64,
    op: ArrayOp,
    buf: IoBuf,
    offset: u64,
    len: u64,
    /// Bytes already split into stripe operations.
    split: u64,
    /// Stripe operations not yet finished.
    pending: u32,
    error: Option<ArrayError>,
    /// When the shard accepted the request, ns (array clock): the pacer's latency.
    submit_ns: u64,
    /// Whether the pacer was told of the request (reads and writes, not flushes).
    paced: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Queued,
    DirectRead,
    DegradedRead,
    WriteRead(WriteMode),
    Writing,
    /// Rewriting ranges that returned unrecovered read errors, after a degraded read.
    Repair,
    Flushing,
    /// Member write-zeroes or discards over a whole stripe.
    Zeroing,
    /// A background operation reading every surviving chunk of its stripe whole.
    BgRead,
    /// A background operation writing rebuilt chunks or corrected parity.
    BgWrite,
    /// A write waiting for its write-intent bits to be durable (no I/O outstanding).
    BitmapWait,
    /// An owner's write waiting for foreign reads of its stripe to finish (no I/O
    /// outstanding; [`crate::shard::StripeGate`]).
    GateWait,
}

struct Sop {
    req: u32,
    stripe: u64,
    /// Range within the stripe's logical data, bytes.
    start: u64,
    end: u64,
    /// Where `start` lies in the request's buffer, bytes.
    buf_off: u64,
    phase: Phase,
    outstanding: u32,
    /// A member I/O of the current phase failed.
    io_error: bool,
    /// Parity range of the current write or degraded read.
    range: ChunkRange,
    /// Strategy of the current write.
    mode: WriteMode,
    /// Members that returned an unrecovered read error in this operation: treated as
    /// missing for it, and rewritten from redundancy.
    bad: ArrayVec<u16, 2>,
    /// Members a degraded phase did without (missing when it started): exactly what the
    /// rebuild reconstructs. A member failed by another operation after this one read it
    /// successfully is not among them — its data in our buffers is good.
    lost: ArrayVec<u16, 2>,
    /// One chunk buffer per member. Byte `i` of a member's buffer holds byte
    /// `range.start + i` of its chunk: the parity range sits at the front, so small
    /// operations keep their working set small and cache-hot whatever their offset.
    bufs: Vec<AlignedBuf>,
    /// Member requests outstanding, per device id (for timeouts: whom to fail and abort).
    per_member: Vec<u16>,
    /// When the current phase issued its first member request, ns (array clock).
    issued_ns: u64,
    /// A member refused a write-zeroes/discard of a `Zeroing` phase as unsupported.
    unsupported: bool,
    /// A background stripe operation of this kind (it has no request: `req` is unused).
    bg: Option<ProcessKind>,
    /// Its scratch pair (computed P and Q) in `bg_scratch`: `2*bg_slot`, `2*bg_slot + 1`.
    bg_slot: u8,
    /// When the background operation was issued, ns (for the pacer).
    bg_start_ns: u64,
    /// Write-intent regions this operation counts in flight (empty: none).
    regions: Range<u64>,
    /// A read of a stripe another shard owns (a foreign read).
    foreign: bool,
    /// What the operation holds in the stripe gate.
    gate: GateHold,
}

/// What a stripe operation counts in the [`StripeGate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GateHold {
    None,
    /// A foreign read.
    Read,
    /// An owner's write.
    Write,
}

/// A shard's part of the write-intent bitmap.
struct IntentShard {
    shared: Arc<WriteIntent>,
    /// The owner's state, on the owner shard only.
    owner: Option<BitmapOwner>,
    /// Operations in `BitmapWait`, in arrival order.
    waiting: VecDeque<u32>,
    /// `generation` when the waiting operations were last checked.
    seen: u64,
    /// The owner's batch writes (capacity fixed at attach).
    writes: Vec<BitmapWrite>,
    /// Member requests of the owner's batch outstanding, in all and per device id.
    outstanding: u32,
    per_member: Vec<u16>,
    /// Whether this shard reported itself degraded ([`WriteIntent::shard_degraded`]).
    degraded: bool,
    /// When the batch was issued (array clock), for command timeouts.
    issued_ns: u64,
}

/// One shard's background process.
struct Proc {
    kind: ProcessKind,
    state: ProcessState,
    walk: ShardWalk,
    /// Stripes with a background operation issued and not finished.
    in_flight: ArrayVec<u64, MAX_BACKGROUND_OPS>,
    /// Lowest stripe whose operation did not complete (the position stays below it).
    hold: Option<u64>,
    done: u64,
    total: u64,
    mismatch_cnt: u64,
    targets: ArrayVec<u16, 2>,
}

impl Proc {
    /// Lowest own stripe not yet done (see [`ShardProgress::position_stripes`]).
    fn position(&self, stripes: u64) -> u64 {
        let mut pos = self.walk.peek().unwrap_or(stripes);
        for &x in &self.in_flight {
            pos = pos.min(x);
        }
        if let Some(h) = self.hold {
            pos = pos.min(h);
        }
        pos
    }
}

/// How long a shard waits before asking the pacer again when it answered
/// [`Admission::AfterCompletion`] with no background operation in flight (a pacer that
/// would otherwise never be asked again), ns.
const BG_RETRY_NS: u64 = 1_000_000;

/// One reactor's view of an array; see the module docs.
pub struct Array<C: Channel> {
    geo: ArrayGeometry,
    data_offset: u64,
    parity: Parity,
    members: Vec<Member<C>>,
    reqs: Vec<Option<ReqCtx>>,
    free_reqs: Vec<u32>,
    sops: Vec<Sop>,
    free_sops: Vec<u32>,
    /// Stripes with an operation running, shared or exclusive.
    locked: StripeLocks,
    /// Scratch for `start_waiting`: stripes with an operation still waiting ahead.
    held: Vec<u64>,
    /// Operations waiting for their stripe, in arrival order.
    waiting: VecDeque<u32>,
    /// Operations whose phase finished, to advance.
    ready: VecDeque<u32>,
    /// Requests not yet fully split (waiting for free stripe operations), in order.
    backlog: VecDeque<u32>,
    done: VecDeque<ArrayCompletion>,
    /// Member completions synthesised for requests a channel refused for good.
    synthetic: VecDeque<Completion>,
    scratch: Vec<Completion>,
    failed_members: u16,
    zero: AlignedBuf,
    stats: ArrayStats,
    /// The executor's clock, ns ([`Array::set_now`]).
    now: u64,
    /// The clock value the members' depth controllers were last advanced to.
    ticked_at: Option<u64>,
    io_timeout_ns: u64,
    /// Next time the operations are scanned for timeouts, ns.
    next_timeout_scan: u64,
    /// This shard's index among `shards` (stripe `s` is ours when `s % shards == shard`).
    shard: usize,
    shards: usize,
    /// Admits background operations; fed foreground submissions and completions.
    pacer: Box<dyn Pacer>,
    /// The background process, if one was started (kept after it ends, for its state).
    proc: Option<Proc>,
    /// Scratch for computed P and Q, two chunk buffers per background slot.
    bg_scratch: Vec<AlignedBuf>,
    /// Free background slots.
    bg_free: ArrayVec<u8, MAX_BACKGROUND_OPS>,
    background_ops: usize,
    /// Free stripe operations of the background pool (indices after the foreground's).
    bg_sops: ArrayVec<u32, MAX_BACKGROUND_OPS>,
    /// The pacer said: not before this time (ns).
    bg_not_before: u64,
    /// The pacer said: after a background completion.
    bg_wait: bool,
    /// The write-intent bitmap, when the array has one.
    intent: Option<IntentShard>,
    /// Shared with the other shards when there are several ([`Array::set_shard`]).
    gate: Option<Arc<StripeGate>>,
    /// Owner writes in [`Phase::GateWait`], in arrival order.
    gate_waiting: VecDeque<u32>,
    /// Foreign reads handed back for the owner ([`Array::take_moved`]).
    moved: VecDeque<ArrayRequest>,
    /// Device entry (index into `members`) of each device id; [`NO_ENTRY`] for an unused
    /// id. `members` holds the array's members at their slots and, at index `members()`,
    /// at most one extra device: a live replacement, or a device leaving (a failed
    /// replacement or a replaced member) until its requests in flight are back.
    entry_of: Vec<u16>,
    /// The last replacement started on this shard (kept after it ends, for its state).
    replace: Option<ReplaceInfo>,
    /// The bitmap's [`WriteIntent::write_all`] ticket the replacement waits for.
    replace_bitmap_ticket: u64,
    /// Replacement failures on this shard (an executor spreads them to the others).
    replacement_failures: u64,
    /// The configuration it was built with (for device entries added later).
    cfg: ArrayConfig,
}

/// Why an [`Array`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ArrayBuildError {
    /// Channel count differs from the member count.
    #[error("{got} member channels for a {expected}-member array")]
    Members {
        /// Members of the geometry.
        expected: u16,
        /// Channels given.
        got: usize,
    },
    /// A pool size of zero.
    #[error("array pools must hold at least one request and one stripe operation")]
    EmptyPool,
    /// More background operations than [`MAX_BACKGROUND_OPS`].
    #[error("{0} background operations per shard: at most {MAX_BACKGROUND_OPS}")]
    BackgroundOps(usize),
    /// A member cannot serve this array.
    #[error("member {member} ({name}): {why}")]
    Member {
        /// Member index.
        member: usize,
        /// Device name.
        name: String,
        /// What does not fit.
        why: String,
    },
}

impl<C: Channel> Array<C> {
    /// An array over `channels` (one per member, in member order), all members online.
    ///
    /// # Errors
    /// [`ArrayBuildError`] on a channel count that does not match, an empty pool, or a
    /// member that cannot serve the geometry: its block size does not divide the array's,
    /// the data offset is not a multiple of its block size, or it is smaller than the data
    /// offset plus the data area.
    pub fn new(
        geo: ArrayGeometry,
        channels: Vec<C>,
        parity: Parity,
        cfg: ArrayConfig,
    ) -> Result<Self, ArrayBuildError> {
        let g = *geo.geometry();
        if channels.len() != usize::from(g.members()) {
            return Err(ArrayBuildError::Members {
                expected: g.members(),
                got: channels.len(),
            });
        }
        if cfg.requests == 0 || cfg.stripe_ops == 0 {
            return Err(ArrayBuildError::EmptyPool);
        }
        if cfg.background_ops > MAX_BACKGROUND_OPS {
            return Err(ArrayBuildError::BackgroundOps(cfg.background_ops));
        }
        for (member, ch) in channels.iter().enumerate() {
            let i = ch.info();
            let bad = |why: String| ArrayBuildError::Member {
                member,
                name: i.name.clone(),
                why,
            };
            if i.block_bytes == 0 || !g.block_bytes().is_multiple_of(i.block_bytes) {
                return Err(bad(format!(
                    "its {}-byte blocks do not divide the array's {}-byte blocks",
                    i.block_bytes,
                    g.block_bytes()
                )));
            }
            if !cfg
                .data_offset_bytes
                .is_multiple_of(u64::from(i.block_bytes))
            {
                return Err(bad(format!(
                    "data offset {} is not a multiple of its {}-byte blocks",
                    cfg.data_offset_bytes, i.block_bytes
                )));
            }
            let need = cfg
                .data_offset_bytes
                .saturating_add(geo.member_data_bytes());
            if i.capacity_bytes < need {
                return Err(bad(format!(
                    "{} bytes is less than the data offset plus data area, {need} bytes",
                    i.capacity_bytes
                )));
            }
            if i.max_transfer_bytes < i.block_bytes {
                return Err(bad(format!(
                    "largest transfer {} bytes is below one block",
                    i.max_transfer_bytes
                )));
            }
        }
        let chunk = g.chunk_bytes() as usize;
        let n = channels.len();
        // Foreground stripe operations, then the background pool: background work never
        // takes a foreground slot.
        let total_sops = cfg.stripe_ops + cfg.background_ops;
        let mut array = Self {
            geo,
            data_offset: cfg.data_offset_bytes,
            parity,
            members: {
                // Room for a replacement beside the members, reserved now.
                let mut v = Vec::with_capacity(n + 1);
                for (id, ch) in channels.into_iter().enumerate() {
                    v.push(Member::new(ch, id as u16, &cfg, total_sops, chunk));
                }
                v
            },
            reqs: (0..cfg.requests).map(|_| None).collect(),
            free_reqs: (0..cfg.requests as u32).rev().collect(),
            sops: (0..total_sops)
                .map(|_| Sop {
                    req: 0,
                    stripe: 0,
                    start: 0,
                    end: 0,
                    buf_off: 0,
                    phase: Phase::Queued,
                    outstanding: 0,
                    io_error: false,
                    range: ChunkRange::default(),
                    mode: WriteMode::FullStripe,
                    bad: ArrayVec::new(),
                    lost: ArrayVec::new(),
                    bufs: (0..n).map(|_| AlignedBuf::zeroed(chunk)).collect(),
                    // One per device id: the members and a replacement.
                    per_member: vec![0; n + 1],
                    issued_ns: 0,
                    unsupported: false,
                    bg: None,
                    bg_slot: 0,
                    bg_start_ns: 0,
                    regions: 0..0,
                    foreign: false,
                    gate: GateHold::None,
                })
                .collect(),
            free_sops: (0..cfg.stripe_ops as u32).rev().collect(),
            locked: StripeLocks::new(total_sops),
            held: Vec::with_capacity(total_sops),
            waiting: VecDeque::with_capacity(total_sops),
            ready: VecDeque::with_capacity(total_sops),
            backlog: VecDeque::with_capacity(cfg.requests),
            done: VecDeque::with_capacity(cfg.requests),
            synthetic: VecDeque::with_capacity(total_sops * n),
            scratch: vec![Completion::EMPTY; 64],
            failed_members: 0,
            zero: AlignedBuf::zeroed(chunk),
            stats: ArrayStats::default(),
            now: 0,
            ticked_at: None,
            io_timeout_ns: cfg.io_timeout_ns,
            next_timeout_scan: 0,
            shard: 0,
            shards: 1,
            pacer: Box::new(Unpaced),
            proc: None,
            bg_scratch: (0..2 * cfg.background_ops)
                .map(|_| AlignedBuf::zeroed(chunk))
                .collect(),
            bg_free: (0..cfg.background_ops as u8).rev().collect(),
            background_ops: cfg.background_ops,
            // The background pool follows the foreground one.
            bg_sops: (cfg.stripe_ops as u32..total_sops as u32).rev().collect(),
            bg_not_before: 0,
            bg_wait: false,
            intent: None,
            gate: None,
            gate_waiting: VecDeque::with_capacity(total_sops),
            moved: VecDeque::with_capacity(cfg.requests),
            entry_of: (0..=n as u16)
                .map(|id| if usize::from(id) < n { id } else { NO_ENTRY })
                .collect(),
            replace: None,
            replace_bitmap_ticket: 0,
            replacement_failures: 0,
            cfg,
        };
        for m in cfg.failed_members.into_iter().flatten() {
            if usize::from(m) >= n {
                return Err(ArrayBuildError::Member {
                    member: usize::from(m),
                    name: String::new(),
                    why: format!("listed as failed but the array has {n} members"),
                });
            }
            array.fail_member(m, IoError::Gone);
        }
        for (m, recovery) in cfg.rebuilding.into_iter().flatten() {
            if usize::from(m) >= n || cfg.failed_members.contains(&Some(m)) {
                return Err(ArrayBuildError::Member {
                    member: usize::from(m),
                    name: String::new(),
                    why: format!(
                        "listed as being rebuilt but the array has {n} members or it is listed as failed"
                    ),
                });
            }
            let mem = &mut array.members[usize::from(m)];
            if mem.state == MemberState::Online {
                mem.state = MemberState::Rebuilding;
                mem.recovery_stripe = recovery.min(geo.stripes());
                mem.bitmap_recovery = cfg.bitmap_recovery.contains(&Some(m));
                array.failed_members += 1;
            }
        }
        Ok(array)
    }

    /// Members of the array (slots), whatever extra device entry exists.
    fn slots(&self) -> usize {
        usize::from(self.geo.geometry().members())
    }

    /// The array's geometry.
    pub fn geometry(&self) -> &ArrayGeometry {
        &self.geo
    }

    /// State of every member, in member order.
    pub fn member_states(&self) -> impl Iterator<Item = MemberState> + '_ {
        self.members[..self.slots()].iter().map(|m| m.state)
    }

    /// The device channels: every member's, and a replacement's or leaving device's (for
    /// an executor that needs to know when they next complete).
    pub fn channels(&self) -> impl Iterator<Item = &C> {
        self.members.iter().map(|m| &m.ch)
    }

    /// What the array did so far.
    pub fn stats(&self) -> ArrayStats {
        self.stats
    }

    /// What this shard sent to member `m` so far.
    ///
    /// # Panics
    /// If `m` is not a member index.
    pub fn member_counters(&self, m: u16) -> MemberCounters {
        self.members[usize::from(m)].counters
    }

    /// Completion latency of this shard's requests to member `m`, ns.
    ///
    /// # Panics
    /// If `m` is not a member index.
    pub fn member_latency(&self, m: u16) -> &hdrhistogram::Histogram<u64> {
        &self.members[usize::from(m)].latency
    }

    /// The last replacement started on this shard, if any: its member, serial and state
    /// ([`Array::start_replace`]).
    pub fn replacement(&self) -> Option<ReplaceInfo> {
        self.replace
    }

    /// What this shard sent to the live replacement device, with its latency histogram
    /// (ns); `None` without a live replacement.
    pub fn replacement_io(&self) -> Option<(MemberCounters, &hdrhistogram::Histogram<u64>)> {
        let e = self.replacement_entry()?;
        let m = &self.members[usize::from(e)];
        Some((m.counters, &m.latency))
    }

    /// Replacement devices this shard has seen fail (an executor spreads each failure to
    /// the other shards with [`Array::fail_replacement`]).
    pub fn replacement_failures(&self) -> u64 {
        self.replacement_failures
    }

    /// The depth controller's state for member `m` on this shard.
    ///
    /// # Panics
    /// If `m` is not a member index.
    pub fn member_qos(&self, m: u16) -> QosState {
        self.members[usize::from(m)].queue.state()
    }

    /// Requests of `class` this shard has in member `m`'s device now.
    ///
    /// # Panics
    /// If `m` is not a member index.
    pub fn member_in_device(&self, m: u16, class: IoClass) -> u32 {
        self.members[usize::from(m)].queue.in_device(class)
    }

    /// Sets the array's clock (ns, monotonic, any epoch): what command timeouts are
    /// measured on. A reactor passes real time, a virtual-time executor its virtual clock.
    /// Never set: timeouts never fire.
    pub fn set_now(&mut self, now_ns: u64) {
        debug_assert!(now_ns >= self.now, "the array clock went backwards");
        self.now = self.now.max(now_ns);
    }

    /// The earliest time (array clock, ns) at which a command timeout can fire, if any
    /// member request is outstanding and timeouts are on: a virtual-time executor advances
    /// its clock no further than this while waiting for completions.
    ///
    /// Also the time a background process waits for its pacer ([`Admission::NotBefore`]),
    /// so an executor wakes for it.
    pub fn next_deadline_ns(&self) -> Option<u64> {
        let pacer = self
            .proc
            .as_ref()
            .filter(|p| p.state == ProcessState::Running && self.bg_not_before > self.now)
            .map(|_| self.bg_not_before);
        let daemon = self
            .intent
            .as_ref()
            .and_then(|i| i.owner.as_ref())
            .and_then(BitmapOwner::next_deadline_ns);
        let own = pacer.into_iter().chain(daemon).min();
        if self.io_timeout_ns == 0 {
            return own;
        }
        // The owner's bitmap batch times out like a stripe operation's requests.
        let batch = self
            .intent
            .as_ref()
            .filter(|i| i.outstanding > 0)
            .map(|i| i.issued_ns.saturating_add(self.io_timeout_ns));
        self.sops
            .iter()
            .filter(|s| s.outstanding > 0)
            .map(|s| s.issued_ns.saturating_add(self.io_timeout_ns))
            .chain(own)
            .chain(batch)
            .min()
    }

    /// Whether any request is still in progress (or, on the bitmap owner, a bitmap write).
    pub fn busy(&self) -> bool {
        self.free_reqs.len() != self.reqs.len()
            || !self.moved.is_empty()
            || self
                .intent
                .as_ref()
                .and_then(|i| i.owner.as_ref())
                .is_some_and(BitmapOwner::busy)
    }

    /// Attaches the array's write-intent bitmap (see the module docs): from now on every
    /// write operation waits until its regions' bits are durable. `owner`: this shard
    /// writes the bitmap sectors and runs the clearing daemon (exactly one shard per
    /// array: shard 0). Attach before submitting requests.
    ///
    /// # Panics
    /// If a bitmap is already attached, requests are in flight, or a second owner is
    /// claimed ([`WriteIntent::owner`]) — programmer errors.
    pub fn attach_bitmap(&mut self, intent: Arc<WriteIntent>, owner: bool) {
        assert!(self.intent.is_none(), "a bitmap is already attached");
        assert!(!self.busy(), "attach the bitmap before submitting requests");
        let owner = owner.then(|| intent.owner());
        let units = owner.as_ref().map_or(0, |_| {
            (intent.regions().div_ceil(8) as usize + 256).div_ceil(512) + 1
        });
        self.intent = Some(IntentShard {
            seen: intent.generation(),
            shared: intent,
            owner,
            waiting: VecDeque::with_capacity(self.sops.len()),
            writes: Vec::with_capacity(units),
            outstanding: 0,
            per_member: vec![0; self.slots() + 1],
            issued_ns: 0,
            degraded: false,
        });
        self.note_degraded();
        // Members joining (assembled partly rebuilt, or re-added) get the whole bitmap.
        if self.members[..self.slots()]
            .iter()
            .any(|m| m.state == MemberState::Rebuilding)
        {
            self.intent.as_ref().expect("attached").shared.write_all();
        }
    }

    /// The attached write-intent bitmap's shared state.
    pub fn bitmap(&self) -> Option<&Arc<WriteIntent>> {
        self.intent.as_ref().map(|i| &i.shared)
    }

    /// Marks a member failed (as if it had returned `err`): a failure detected outside
    /// this shard's data path (another reactor's, a vanished device).
    ///
    /// # Panics
    /// If `member` is not a member index.
    pub fn fail_member(&mut self, member: u16, err: IoError) {
        self.set_failed(member, MemberState::Failed(err));
    }

    /// Marks a member faulty on the operator's request ([`MemberState::FailedByOperator`]).
    ///
    /// # Panics
    /// If `member` is not a member index.
    pub fn fail_member_by_operator(&mut self, member: u16) {
        self.set_failed(member, MemberState::FailedByOperator);
    }

    fn set_failed(&mut self, member: u16, state: MemberState) {
        debug_assert!(state.is_failed());
        assert!(
            usize::from(member) < self.slots(),
            "member {member} of a {}-member array",
            self.slots()
        );
        if let Some(g) = &self.gate {
            g.note_failed(member);
        }
        let m = &mut self.members[usize::from(member)];
        match m.state {
            MemberState::Online => {
                m.state = state;
                self.failed_members += 1;
                self.stats.member_failures += 1;
            }
            // Already counted as missing for the redundancy.
            MemberState::Rebuilding => {
                m.state = state;
                self.stats.member_failures += 1;
            }
            MemberState::Failed(_) | MemberState::FailedByOperator => {}
        }
        // Nothing is cleared from the write-intent bitmap while a member is missing: its
        // dirty regions are what a returning member must be rebuilt over.
        self.note_degraded();
    }

    /// Tells the write-intent bitmap whether this shard has a member failed or being
    /// recovered ([`WriteIntent::shard_degraded`]): the daemon clears no bit while any
    /// shard has. Called whenever `failed_members` changes.
    fn note_degraded(&mut self) {
        let now = self.failed_members > 0;
        if let Some(i) = &mut self.intent {
            i.shared.shard_degraded(now, i.degraded);
            i.degraded = now;
        }
    }

    /// Whether `member` is failed: no I/O is sent to it. A member being rebuilt is not
    /// failed (it is written), though it may be missing for a stripe ([`Self::missing`]).
    fn is_failed(&self, member: u16) -> bool {
        self.members[usize::from(member)].state.is_failed()
    }

    /// Whether operation `s` must do without `member`: failed, being rebuilt and not yet
    /// rebuilt at the operation's stripe, or it returned an unrecovered read error to
    /// this operation.
    fn missing(&self, s: u32, member: u16) -> bool {
        let m = &self.members[usize::from(member)];
        let sop = &self.sops[s as usize];
        match m.state {
            MemberState::Online => sop.bad.contains(&member),
            MemberState::Rebuilding => sop.stripe >= m.recovery_stripe || sop.bad.contains(&member),
            MemberState::Failed(_) | MemberState::FailedByOperator => true,
        }
    }

    fn array_failed(&self) -> bool {
        self.failed_members > self.geo.geometry().parity_chunks()
    }

    /// Accepts a request. Malformed requests complete at once with
    /// [`ArrayError::Invalid`] (returned by `poll`), never panic.
    ///
    /// # Errors
    /// [`ArrayError::QueueFull`] when the request pool is exhausted: poll, then retry.
    pub fn submit(&mut self, r: ArrayRequest) -> Result<(), ArrayError> {
        let Some(idx) = self.free_reqs.pop() else {
            return Err(ArrayError::QueueFull);
        };
        let mut invalid = self.validate(&r).err();
        if invalid.is_none() && r.op != ArrayOp::Flush && !self.may_serve(&r) {
            invalid = Some(ArrayError::Invalid(
                "a request for a stripe another reactor owns must be a read within one stripe",
            ));
        }
        let paced = invalid.is_none() && r.op != ArrayOp::Flush;
        if paced {
            self.pacer.foreground_submitted(self.now);
        }
        self.reqs[idx as usize] = Some(ReqCtx {
            tag: r.tag,
            op: r.op,
            buf: r.buf,
            offset: r.offset_bytes,
            len: u64::from(r.len_bytes),
            split: 0,
            pending: 0,
            error: invalid,
            submit_ns: self.now,
            paced,
        });
        if invalid.is_some() {
            self.finish_req(idx);
        } else if r.op == ArrayOp::Flush {
            self.start_flush(idx);
        } else {
            self.backlog.push_back(idx);
        }
        Ok(())
    }

    /// Whether this shard may serve `r` (validated): its own stripes always; a stripe
    /// another shard owns only as a foreign read — a read within that one stripe, with
    /// the stripe gate attached ([`Array::set_gate`]).
    fn may_serve(&self, r: &ArrayRequest) -> bool {
        if self.shards == 1 {
            return true;
        }
        let (first, within) = self.geo.stripe_of(r.offset_bytes);
        if owner(first, self.shards) == self.shard {
            return true;
        }
        let single = within + u64::from(r.len_bytes) <= self.geo.geometry().stripe_data_bytes();
        r.op == ArrayOp::Read && single && self.gate.is_some()
    }

    /// Checks a request against the array: buffer length and alignment, block alignment,
    /// range.
    ///
    /// # Errors
    /// [`ArrayError::Invalid`] naming the problem.
    pub fn validate(&self, r: &ArrayRequest) -> Result<(), ArrayError> {
        if r.op == ArrayOp::Flush {
            return if r.len_bytes == 0 {
                Ok(())
            } else {
                Err(ArrayError::Invalid("flush carries no range"))
            };
        }
        if r.len_bytes == 0 {
            return Err(ArrayError::Invalid("zero-length request"));
        }
        if r.op.has_buffer() {
            if r.buf.len() != r.len_bytes {
                return Err(ArrayError::Invalid(
                    "buffer length differs from request length",
                ));
            }
            if !(r.buf.as_ptr() as usize).is_multiple_of(crate::parity::ALIGN) {
                return Err(ArrayError::Invalid("buffer not 64-byte aligned"));
            }
        } else if !r.buf.is_empty() {
            return Err(ArrayError::Invalid(
                "write-zeroes and discard carry no buffer",
            ));
        }
        self.geo
            .map_range(r.offset_bytes, u64::from(r.len_bytes))
            .map(|_| ())
            .map_err(|e| match e {
                crate::geometry::GeometryError::Misaligned { .. } => {
                    ArrayError::Invalid("offset or length not a multiple of the block size")
                }
                _ => ArrayError::Invalid("request beyond the end of the array"),
            })
    }

    /// Runs the state machines: resubmits, reaps member completions, advances stripe
    /// operations, starts waiting ones, and kicks the channels. Returns whether anything
    /// happened (an executor idles when it returns false).
    pub fn process(&mut self) -> bool {
        let mut progress = false;
        self.tick_members();
        loop {
            let mut round = false;
            round |= self.check_timeouts();
            round |= self.resubmit();
            round |= self.reap();
            round |= self.bitmap_work();
            round |= self.gate_work();
            while let Some(s) = self.ready.pop_front() {
                self.advance(s);
                round = true;
            }
            round |= self.split_backlog();
            round |= self.issue_background();
            round |= self.start_waiting();
            if self.members.len() > self.slots() {
                round |= self.drop_leaving_device();
            }
            for m in &mut self.members {
                m.ch.kick();
            }
            if !round {
                break;
            }
            progress = true;
        }
        progress
    }

    /// Moves up to `out.len()` finished requests into `out`; returns how many.
    pub fn poll(&mut self, out: &mut [ArrayCompletion]) -> usize {
        let n = self.done.len().min(out.len());
        for (o, c) in out.iter_mut().zip(self.done.drain(..n)) {
            *o = c;
        }
        n
    }

    // ---- member I/O --------------------------------------------------------------------

    /// Advances every member's depth controller to now, once per clock value: the rounds
    /// of one [`Array::process`] call share a `now`, and a window that was open at the
    /// first round is still open at the next (a window shortened meanwhile by a
    /// calibration closes at the next tick).
    fn tick_members(&mut self) {
        if self.ticked_at == Some(self.now) {
            return;
        }
        self.ticked_at = Some(self.now);
        for m in &mut self.members {
            m.queue.tick(self.now);
        }
    }

    /// Hands queued requests to the channels (class order, within the limits).
    fn resubmit(&mut self) -> bool {
        let mut any = false;
        for mi in 0..self.members.len() {
            any |= self.pump(mi);
        }
        any
    }

    /// Dispatches member `mi`'s queued requests; returns whether any left the queues.
    fn pump(&mut self, mi: usize) -> bool {
        let now = self.now;
        let m = &mut self.members[mi];
        let synthetic = &mut self.synthetic;
        let mut refused = 0;
        let p = m.queue.pump(&mut m.ch, now, |req, e| {
            refused += 1;
            synthetic.push_back(refusal(req.tag, e));
        });
        p.submitted > 0 || refused > 0
    }

    fn reap(&mut self) -> bool {
        let mut any = false;
        while let Some(c) = self.synthetic.pop_front() {
            self.member_done(c);
            any = true;
        }
        for mi in 0..self.members.len() {
            loop {
                let n = self.members[mi].ch.poll(&mut self.scratch);
                for i in 0..n {
                    let c = self.scratch[i];
                    self.members[mi].queue.completed(c.tag, self.now);
                    self.member_done(c);
                }
                any |= n > 0;
                if n < self.scratch.len() {
                    break;
                }
            }
        }
        any
    }

    /// The tag of operation `s`'s requests to device entry `entry`.
    fn tag_of(&self, s: u32, entry: u16) -> u64 {
        (u64::from(s) << MEMBER_BITS) | u64::from(self.members[usize::from(entry)].id)
    }

    /// The device id of entry `entry`.
    fn id_of(&self, entry: u16) -> usize {
        usize::from(self.members[usize::from(entry)].id)
    }

    /// The entry of the device with tag id `id`, if one holds it.
    fn entry_of_id(&self, id: u16) -> Option<u16> {
        self.entry_of
            .get(usize::from(id))
            .copied()
            .filter(|&e| e != NO_ENTRY)
    }

    fn member_done(&mut self, c: Completion) {
        let s = (c.tag >> MEMBER_BITS) as u32;
        let id = (c.tag & ((1 << MEMBER_BITS) - 1)) as u16;
        let Some(member) = self.entry_of_id(id) else {
            self.stats.stray_completions += 1;
            return;
        };
        if s == self.bitmap_sop() {
            return self.bitmap_write_done(member, c.status);
        }
        let known = (s as usize) < self.sops.len() && self.sops[s as usize].outstanding > 0;
        if !known {
            self.stats.stray_completions += 1;
            return;
        }
        {
            let sop = &mut self.sops[s as usize];
            let pm = &mut sop.per_member[usize::from(id)];
            debug_assert!(*pm > 0, "completion from a member with nothing outstanding");
            *pm = pm.saturating_sub(1);
            let m = &mut self.members[usize::from(member)];
            // Saturates at the histogram's top (one hour); never allocates.
            m.latency
                .saturating_record(self.now.saturating_sub(sop.issued_ns).max(1));
            m.counters.errors += u64::from(c.status.is_err());
        }
        if c.status == Err(IoError::Unsupported) && self.sops[s as usize].phase == Phase::Zeroing {
            // The member cannot zero or deallocate natively (support can vanish at run
            // time): the stripe is rewritten with zero buffers instead; not a failure.
            self.sops[s as usize].unsupported = true;
        } else if let (Err(e), true) = (c.status, usize::from(member) >= self.slots()) {
            // The replacement, or a device leaving the array: never fails a member.
            self.extra_error(s, member, e);
        } else if let Err(e) = c.status {
            let sop = &mut self.sops[s as usize];
            sop.io_error = true;
            let reading = matches!(
                sop.phase,
                Phase::DirectRead | Phase::DegradedRead | Phase::WriteRead(_) | Phase::BgRead
            );
            // A latent sector error on a read: rebuild the range from redundancy and
            // rewrite it; the member stays in service (md's read-error handling).
            if e == IoError::Medium && reading && !sop.bad.contains(&member) && !sop.bad.is_full() {
                sop.bad.push(member);
                self.stats.medium_errors += 1;
            } else {
                self.fail_member(member, e);
            }
        }
        let sop = &mut self.sops[s as usize];
        sop.outstanding -= 1;
        if sop.outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// A request of operation `s` to the extra device entry `entry` failed with `e`: the
    /// live replacement fails (the replace stops; the operation's outcome never depends
    /// on it); a device leaving the array (a replaced member whose reads were in flight
    /// at the swap) only makes a reading phase run again from the current devices.
    fn extra_error(&mut self, s: u32, entry: u16, e: IoError) {
        if self.replacement_entry() == Some(entry) {
            self.fail_replacement_entry(e);
            return;
        }
        let sop = &mut self.sops[s as usize];
        if matches!(
            sop.phase,
            Phase::DirectRead | Phase::DegradedRead | Phase::WriteRead(_) | Phase::BgRead
        ) {
            sop.io_error = true;
        }
    }

    /// The I/O class of operation `s`'s member request `op`: flushes and FUA writes are
    /// [`IoClass::Flush`]; otherwise background operations are [`IoClass::Background`],
    /// client reads (including the reads and rewrites of a degraded read)
    /// [`IoClass::ForegroundRead`], and client writes, write-zeroes and discards (with
    /// their read-modify-write reads) [`IoClass::ForegroundWrite`].
    fn class_of(&self, s: u32, op: Op) -> IoClass {
        let sop = &self.sops[s as usize];
        if matches!(op, Op::Flush | Op::Write { fua: true }) {
            return IoClass::Flush;
        }
        if sop.bg.is_some() {
            return IoClass::Background;
        }
        let req = self.reqs[sop.req as usize].as_ref().expect("live request");
        if req.op == ArrayOp::Read {
            IoClass::ForegroundRead
        } else {
            IoClass::ForegroundWrite
        }
    }

    /// Issues one member I/O for stripe operation `s`: `len` bytes at `chunk_off` of the
    /// member's chunk in the operation's stripe, to/from `ptr`.
    /// A write to the member being replaced goes to its replacement as well (md writes a
    /// slot's `rdev` and `replacement` alike).
    fn io(&mut self, s: u32, member: u16, op: Op, chunk_off: u32, len: u32, ptr: *mut u8) {
        self.io_dev(s, member, op, chunk_off, len, ptr);
        if let Some(r) = self.mirror_of(member, op) {
            self.io_dev(s, r, op, chunk_off, len, ptr);
        }
    }

    /// A write of a stripe chunk's range: to the member (and its replacement, [`Self::io`]);
    /// to the replacement alone when the member being replaced has failed — the write
    /// was planned around the failed member, and the new contents of its chunk over the
    /// range are in the operation's buffers (or the caller's), which the replacement
    /// must get where it already holds the member's data; nowhere when the member is
    /// failed without a replacement.
    fn io_write(&mut self, s: u32, member: u16, op: Op, chunk_off: u32, len: u32, ptr: *mut u8) {
        if !self.is_failed(member) {
            self.io(s, member, op, chunk_off, len, ptr);
        } else if let Some(r) = self.replacement_of(member) {
            self.io_dev(s, r, op, chunk_off, len, ptr);
        }
    }

    /// The live replacement entry of `member`, if it has one.
    fn replacement_of(&self, member: u16) -> Option<u16> {
        match self.replace {
            Some(ReplaceInfo {
                member: m,
                state: ReplaceState::Copying,
                ..
            }) if m == member => self.replacement_entry(),
            _ => None,
        }
    }

    /// The replacement entry that must also get `op` when it goes to `member`: writes to
    /// the member being replaced, while the replacement is live.
    fn mirror_of(&self, member: u16, op: Op) -> Option<u16> {
        match self.replace {
            Some(ReplaceInfo {
                member: m,
                state: ReplaceState::Copying,
                ..
            }) if m == member && !matches!(op, Op::Read | Op::Flush) => self.replacement_entry(),
            _ => None,
        }
    }

    /// [`Self::io`] to device entry `member` alone (a member, or the replacement).
    fn io_dev(&mut self, s: u32, member: u16, op: Op, chunk_off: u32, len: u32, ptr: *mut u8) {
        debug_assert!(!self.is_failed(member), "I/O planned on a failed member");
        let g = self.geo.geometry();
        let stripe = self.sops[s as usize].stripe;
        let base = self.data_offset + stripe * u64::from(g.chunk_bytes()) + u64::from(chunk_off);
        let tag = self.tag_of(s, member);
        let class = self.class_of(s, op);
        // Requests larger than the member takes go out in pieces (each counted).
        let max = self.members[usize::from(member)].max_transfer;
        let mut done = 0u32;
        while done < len {
            let piece = (len - done).min(max);
            // SAFETY: every pointer passed here is either a chunk buffer of this operation
            // (owned by the Array, untouched until the operation's I/O completes: the state
            // machine only reads its buffers after `outstanding` reaches 0) or a range of the
            // caller's request buffer, which the caller lent until the request completes
            // (ArrayRequest contract) and which this operation alone uses for that range.
            // `done + piece <= len` keeps the piece inside that range.
            let buf = unsafe {
                IoBuf::from_raw(
                    std::ptr::NonNull::new(ptr.wrapping_add(done as usize))
                        .expect("non-null buffer"),
                    piece,
                    None,
                )
            };
            let req = Request {
                tag,
                op,
                offset_bytes: base + u64::from(done),
                len_bytes: piece,
                buf,
            };
            done += piece;
            self.count_issue(s, member, op, piece);
            self.send(member, class, req);
        }
    }

    /// Queues `req` in the member's queue of `class` and dispatches what the channel and
    /// the depth controller admit.
    fn send(&mut self, member: u16, class: IoClass, req: Request) {
        let now = self.now;
        let m = &mut self.members[usize::from(member)];
        let synthetic = &mut self.synthetic;
        m.queue.send(class, req, &mut m.ch, now, |req, e| {
            synthetic.push_back(refusal(req.tag, e));
        });
    }

    fn io_flush(&mut self, s: u32, member: u16) {
        let req = Request {
            tag: self.tag_of(s, member),
            op: Op::Flush,
            offset_bytes: 0,
            len_bytes: 0,
            buf: IoBuf::NONE,
        };
        self.count_issue(s, member, Op::Flush, 0);
        self.send(member, IoClass::Flush, req);
    }

    /// Issues one bufferless member request (`WriteZeroes`, `Discard`) over the whole chunk
    /// of operation `s`'s stripe, split at the member's largest transfer.
    fn io_nodata(&mut self, s: u32, member: u16, op: Op) {
        self.io_nodata_dev(s, member, op);
        if let Some(r) = self.mirror_of(member, op) {
            self.io_nodata_dev(s, r, op);
        }
    }

    /// [`Self::io_nodata`] to device entry `member` alone.
    fn io_nodata_dev(&mut self, s: u32, member: u16, op: Op) {
        let g = self.geo.geometry();
        let chunk = g.chunk_bytes();
        let base = self.data_offset + self.sops[s as usize].stripe * u64::from(chunk);
        let tag = self.tag_of(s, member);
        let class = self.class_of(s, op);
        let max = self.members[usize::from(member)].max_transfer;
        let mut done = 0u32;
        while done < chunk {
            let piece = (chunk - done).min(max);
            let req = Request {
                tag,
                op,
                offset_bytes: base + u64::from(done),
                len_bytes: piece,
                buf: IoBuf::NONE,
            };
            done += piece;
            self.count_issue(s, member, op, piece);
            self.send(member, class, req);
        }
    }

    /// Accounts one member request of operation `s` about to be sent: `op` over `len`
    /// bytes.
    fn count_issue(&mut self, s: u32, member: u16, op: Op, len: u32) {
        let sop = &mut self.sops[s as usize];
        if sop.outstanding == 0 {
            sop.issued_ns = self.now;
        }
        sop.outstanding += 1;
        sop.per_member[usize::from(self.members[usize::from(member)].id)] += 1;
        let c = &mut self.members[usize::from(member)].counters;
        match op {
            Op::Read => {
                c.reads += 1;
                c.read_bytes += u64::from(len);
            }
            Op::Flush => c.flushes += 1,
            Op::Write { .. } | Op::WriteZeroes | Op::Discard => {
                c.writes += 1;
                c.write_bytes += u64::from(len);
            }
        }
    }

    /// Fails members whose requests outlived the command timeout: their requests still
    /// waiting in our class queues complete with [`IoError::Timeout`] at once, those on
    /// the device are aborted (best effort; see [`Channel::abort`]), and the operation
    /// goes on from redundancy once they are back. Scans at most every 1/16 of the
    /// timeout.
    fn check_timeouts(&mut self) -> bool {
        if self.io_timeout_ns == 0 || self.now < self.next_timeout_scan {
            return false;
        }
        self.next_timeout_scan = self.now + (self.io_timeout_ns / 16).max(1);
        let mut any = false;
        for s in 0..self.sops.len() as u32 {
            let sop = &self.sops[s as usize];
            if sop.outstanding == 0 || self.now - sop.issued_ns < self.io_timeout_ns {
                continue;
            }
            // Abort again only after another full timeout.
            self.sops[s as usize].issued_ns = self.now;
            for member in 0..self.members.len() as u16 {
                if self.sops[s as usize].per_member[self.id_of(member)] == 0 {
                    continue;
                }
                any = true;
                self.time_out(s, member);
            }
        }
        any
    }

    /// Operation `s`'s requests to `member` ran past the command timeout: the member is
    /// failed, its queued requests complete with [`IoError::Timeout`] at once and those in
    /// the device are aborted (their completions, if any, come back as timeouts too).
    fn time_out(&mut self, s: u32, member: u16) {
        self.stats.timeouts += 1;
        self.fail_entry(member, IoError::Timeout);
        let tag = self.tag_of(s, member);
        let m = &mut self.members[usize::from(member)];
        for _ in 0..m.queue.remove_tag(tag) {
            self.synthetic.push_back(Completion {
                tag,
                status: Err(IoError::Timeout),
            });
        }
        self.members[usize::from(member)].ch.abort(tag);
    }

    /// Fails device entry `entry` with `e`: a member ([`Self::fail_member`]), the live
    /// replacement (the replace stops), or nothing for a device leaving the array.
    fn fail_entry(&mut self, entry: u16, e: IoError) {
        if usize::from(entry) < self.slots() {
            self.fail_member(entry, e);
        } else if self.replacement_entry() == Some(entry) {
            self.fail_replacement_entry(e);
        }
    }

    // ---- request and operation lifecycle -------------------------------------------------

    fn split_backlog(&mut self) -> bool {
        let mut any = false;
        let stripe_bytes = self.geo.geometry().stripe_data_bytes();
        while let Some(&ri) = self.backlog.front() {
            let Some(s) = self.free_sops.last().copied() else {
                break;
            };
            if self.reqs[ri as usize]
                .as_ref()
                .expect("backlogged request")
                .op
                == ArrayOp::Flush
            {
                self.backlog.pop_front();
                self.start_flush(ri);
                any = true;
                continue;
            }
            let req = self.reqs[ri as usize].as_mut().expect("backlogged request");
            let (stripe, start) = self.geo.stripe_of(req.offset + req.split);
            let end = (start + (req.len - req.split)).min(stripe_bytes);
            let buf_off = req.split;
            req.split += end - start;
            req.pending += 1;
            let fully = req.split == req.len;
            self.free_sops.pop();
            let sop = &mut self.sops[s as usize];
            sop.req = ri;
            sop.stripe = stripe;
            sop.start = start;
            sop.end = end;
            sop.buf_off = buf_off;
            sop.phase = Phase::Queued;
            sop.outstanding = 0;
            sop.io_error = false;
            sop.unsupported = false;
            sop.bad.clear();
            sop.regions = 0..0;
            sop.foreign = self.shards > 1 && owner(stripe, self.shards) != self.shard;
            sop.gate = GateHold::None;
            if fully {
                self.backlog.pop_front();
            }
            any = true;
            let read = self.reqs[ri as usize].as_ref().expect("live").op == ArrayOp::Read;
            if read && self.waiting.is_empty() && !self.locked.conflicts(stripe, false) {
                self.locked.take(stripe, s, false);
                self.start_sop(s);
            } else {
                self.waiting.push_back(s);
            }
        }
        any
    }

    /// Starts every waiting operation its stripe admits, oldest first: a write when
    /// nothing runs on the stripe, a read when only reads run there; and never one with an
    /// older operation of its stripe still waiting (per-stripe FIFO, see the module docs).
    fn start_waiting(&mut self) -> bool {
        let mut started = false;
        let mut i = 0;
        self.held.clear();
        while i < self.waiting.len() {
            let s = self.waiting[i];
            let stripe = self.sops[s as usize].stripe;
            // A background operation waits for its stripe like a write (below: reads may
            // then join it).
            let writes = self.sops[s as usize].bg.is_some()
                || self.reqs[self.sops[s as usize].req as usize]
                    .as_ref()
                    .expect("live request")
                    .op
                    .is_write();
            let blocked = self.held.contains(&stripe) || self.locked.conflicts(stripe, writes);
            if blocked {
                if !self.held.contains(&stripe) {
                    // Bounded by the waiting operations, which the capacity covers.
                    self.held.push(stripe);
                }
                i += 1;
                continue;
            }
            self.waiting.remove(i);
            // A background operation waits for the stripe like a write and excludes writes
            // while it runs, but lets reads run beside it: it writes only parity (resync,
            // repair) or a member being rebuilt, which a read of this stripe (above the
            // recovery position) does not read; md likewise serves aligned reads past a
            // resync (`raid5_read_one_chunk`). Foreground reads therefore never wait for a
            // whole background stripe operation (docs/PACING.md).
            let excl = writes && self.sops[s as usize].bg.is_none();
            self.locked.take(stripe, s, excl);
            started = true;
            if excl {
                if let Some(gate) = &self.gate {
                    // Foreign reads of the stripe from now on go to us; those in flight
                    // must finish before any member is written.
                    self.sops[s as usize].gate = GateHold::Write;
                    if !gate.begin_write(stripe) {
                        self.sops[s as usize].phase = Phase::GateWait;
                        self.gate_waiting.push_back(s);
                        self.stats.gate_waits += 1;
                        continue;
                    }
                }
            }
            self.start_sop(s);
        }
        started
    }

    fn start_sop(&mut self, s: u32) {
        if self.sops[s as usize].bg.is_some() {
            if self.array_failed() {
                return self.finish_bg(s, Err(ProcessError::ArrayFailed));
            }
            return self.start_bg(s);
        }
        if self.array_failed() {
            return self.finish_sop(s, Err(ArrayError::Failed));
        }
        if self.sops[s as usize].foreign {
            // Only the owner knows how far its stripes are rebuilt; while this shard still
            // copies a replacement, an owner that has already swapped it in writes only the
            // new device (this shard would read the old one); and a write holding the
            // stripe goes first: in each case the owner serves the read.
            let stripe = self.sops[s as usize].stripe;
            let copying = self
                .replace
                .is_some_and(|r| r.state == ReplaceState::Copying);
            let gate = self.gate.as_ref().expect("foreign reads only with a gate");
            if self.rebuilding() || copying || !gate.try_read(stripe) {
                return self.move_sop(s);
            }
            self.sops[s as usize].gate = GateHold::Read;
            let members = &self.members;
            if gate.lagging(|m| members[usize::from(m)].state.is_failed()) {
                return self.move_sop(s);
            }
            self.stats.foreign_reads += 1;
            return self.dispatch_sop(s);
        }
        if self.bitmap_gate(s) {
            return;
        }
        self.dispatch_sop(s);
    }

    /// Whether a member is being rebuilt.
    fn rebuilding(&self) -> bool {
        self.members
            .iter()
            .any(|m| m.state == MemberState::Rebuilding)
    }

    /// Starts the owner writes waiting in [`Phase::GateWait`] whose stripes no foreign read
    /// holds any more.
    fn gate_work(&mut self) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.gate_waiting.len() {
            let s = self.gate_waiting[i];
            let stripe = self.sops[s as usize].stripe;
            let clear = self.gate.as_ref().is_some_and(|g| g.readers_clear(stripe));
            if clear {
                self.gate_waiting.remove(i);
                self.sops[s as usize].phase = Phase::Queued;
                self.start_sop(s);
                any = true;
            } else {
                i += 1;
            }
        }
        any
    }

    /// Releases what operation `s` holds in the stripe gate.
    fn release_gate(&mut self, s: u32) {
        let sop = &mut self.sops[s as usize];
        let hold = std::mem::replace(&mut sop.gate, GateHold::None);
        let Some(gate) = &self.gate else {
            debug_assert_eq!(hold, GateHold::None);
            return;
        };
        match hold {
            GateHold::None => {}
            GateHold::Read => gate.end_read(sop.stripe),
            GateHold::Write => gate.end_write(sop.stripe),
        }
    }

    /// Hands foreign read `s` (its request's only operation, with no I/O outstanding) to
    /// the stripe's owner: the request leaves this shard unfinished and is given back by
    /// [`Array::take_moved`].
    fn move_sop(&mut self, s: u32) {
        debug_assert!(self.sops[s as usize].foreign);
        debug_assert_eq!(self.sops[s as usize].outstanding, 0);
        self.release_gate(s);
        self.locked.release(s);
        let ri = self.sops[s as usize].req;
        self.free_sops.push(s);
        let req = self.reqs[ri as usize].take().expect("live request");
        debug_assert!(req.pending == 1 && req.split == req.len);
        if req.paced {
            self.pacer.foreground_done(
                self.now,
                self.now.saturating_sub(req.submit_ns),
                req.len,
                true,
            );
        }
        self.moved.push_back(ArrayRequest {
            tag: req.tag,
            op: req.op,
            offset_bytes: req.offset,
            // A foreign request lies within one stripe (checked at submit).
            len_bytes: req.len as u32,
            buf: req.buf,
        });
        self.free_reqs.push(ri);
        self.stats.moved_reads += 1;
    }

    /// Starts operation `s`'s first phase (its stripe is held, its bits durable).
    fn dispatch_sop(&mut self, s: u32) {
        let req = self.reqs[self.sops[s as usize].req as usize]
            .as_ref()
            .expect("live request");
        match req.op {
            ArrayOp::Read => self.start_read(s),
            ArrayOp::Write { .. } => self.start_write(s),
            ArrayOp::WriteZeroes { fua } => self.start_zeroes(s, fua),
            ArrayOp::Discard => self.start_discard(s),
            ArrayOp::Flush => unreachable!("flushes are not stripe operations"),
        }
    }

    fn finish_sop(&mut self, s: u32, status: Result<(), ArrayError>) {
        let regions = std::mem::replace(&mut self.sops[s as usize].regions, 0..0);
        if !regions.is_empty() {
            let i = self
                .intent
                .as_ref()
                .expect("regions are counted only with a bitmap");
            i.shared.end_write(regions);
        }
        self.release_gate(s);
        let sop = &self.sops[s as usize];
        debug_assert_eq!(sop.outstanding, 0);
        self.locked.release(s);
        let ri = sop.req;
        self.free_sops.push(s);
        let req = self.reqs[ri as usize].as_mut().expect("live request");
        if let Err(e) = status {
            req.error.get_or_insert(e);
        }
        req.pending -= 1;
        if req.pending == 0 && req.split == req.len {
            self.finish_req(ri);
        }
    }

    fn finish_req(&mut self, ri: u32) {
        let req = self.reqs[ri as usize].take().expect("live request");
        if req.paced {
            self.pacer.foreground_done(
                self.now,
                self.now.saturating_sub(req.submit_ns),
                req.len,
                req.op == ArrayOp::Read,
            );
        }
        self.done.push_back(ArrayCompletion {
            tag: req.tag,
            status: req.error.map_or(Ok(()), Err),
        });
        self.free_reqs.push(ri);
    }

    fn start_flush(&mut self, ri: u32) {
        let Some(s) = self.free_sops.pop() else {
            // No operation free: wait in the backlog, in order with the other requests.
            self.backlog.push_back(ri);
            return;
        };
        let req = self.reqs[ri as usize].as_mut().expect("live request");
        req.pending = 1;
        let sop = &mut self.sops[s as usize];
        sop.req = ri;
        sop.regions = 0..0;
        sop.phase = Phase::Flushing;
        sop.outstanding = 0;
        sop.io_error = false;
        for m in 0..self.members.len() as u16 {
            if !self.is_failed(m) {
                self.io_flush(s, m);
            }
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// Pointer to stripe-data byte `x` of operation `s` in the caller's buffer.
    fn client_ptr(&self, s: u32, x: u64) -> *mut u8 {
        let sop = &self.sops[s as usize];
        let req = self.reqs[sop.req as usize].as_ref().expect("live request");
        debug_assert!(sop.start <= x && x <= sop.end);
        if !req.op.has_buffer() {
            // Write-zeroes (or a discard rewritten as zeroes) takes its data from the
            // chunk-sized zero buffer: stripe byte x lies at x % chunk in its chunk, and
            // every range the engine reads from here stays inside that chunk. Only ever
            // read through this pointer.
            let c = u64::from(self.geo.geometry().chunk_bytes());
            return self.zero.as_ptr().wrapping_add((x % c) as usize).cast_mut();
        }
        // In bounds: buf_off + (x - start) <= request length = buffer length.
        req.buf
            .as_ptr()
            .wrapping_add((sop.buf_off + x - sop.start) as usize)
    }

    fn footprint(&self, s: u32) -> StripeWrite {
        let g = self.geo.geometry();
        let sop = &self.sops[s as usize];
        StripeWrite::from_range(g.data_chunks(), g.chunk_bytes(), sop.start, sop.end)
    }

    // ---- write-zeroes and discard ---------------------------------------------------------

    /// Whether every surviving member supports `op` natively (`WriteZeroes` or a `Discard`
    /// that leaves zeroes).
    fn members_support(&self, op: Op) -> bool {
        self.members.iter().all(|m| {
            m.state.is_failed()
                || match op {
                    Op::WriteZeroes => m.ch.info().write_zeroes,
                    _ => m.ch.info().discard,
                }
        })
    }

    /// Zeroes a whole stripe on every surviving member with `op` (data and parity: the P
    /// and Q of all-zero data are zero, so the stripe stays consistent).
    fn zero_stripe(&mut self, s: u32, op: Op) {
        let g = *self.geo.geometry();
        self.sops[s as usize].phase = Phase::Zeroing;
        self.sops[s as usize].io_error = false;
        self.sops[s as usize].unsupported = false;
        for m in 0..g.members() {
            if !self.is_failed(m) {
                self.io_nodata(s, m, op);
            } else if let Some(r) = self.replacement_of(m) {
                self.io_nodata_dev(s, r, op);
            }
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// Write-zeroes of one stripe piece: a whole stripe without FUA goes to the members
    /// as write-zeroes; anything else is an ordinary write whose data is the zero buffer
    /// (RMW/RCW keep parity right; FUA writes are durable on completion).
    fn start_zeroes(&mut self, s: u32, fua: bool) {
        if !fua && self.footprint(s).is_full_stripe() && self.members_support(Op::WriteZeroes) {
            self.stats.zeroed_stripes += 1;
            self.zero_stripe(s, Op::WriteZeroes)
        } else {
            self.start_write(s)
        }
    }

    /// Discard of one stripe piece: a whole stripe is deallocated on every member when all
    /// promise zeroes afterwards (parity of zeroes is zero); partial stripes, and arrays
    /// whose members make no such promise, are left alone (discard is advisory; md's
    /// raid456 likewise discards only whole stripes).
    fn start_discard(&mut self, s: u32) {
        if self.footprint(s).is_full_stripe() && self.members_support(Op::Discard) {
            self.stats.discarded_stripes += 1;
            self.zero_stripe(s, Op::Discard)
        } else {
            self.stats.discards_skipped += 1;
            self.finish_sop(s, Ok(()))
        }
    }

    // ---- reads -----------------------------------------------------------------------------

    fn start_read(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let st = self.geo.stripe(self.sops[s as usize].stripe);
        let w = self.footprint(s);
        let healthy = w.chunks().all(|(k, _)| !self.missing(s, st.data_member(k)));
        if !healthy {
            return self.start_degraded(s, Phase::DegradedRead);
        }
        self.sops[s as usize].phase = Phase::DirectRead;
        self.sops[s as usize].io_error = false;
        let c = u64::from(g.chunk_bytes());
        for (k, r) in w.chunks() {
            let ptr = self.client_ptr(s, u64::from(k) * c + u64::from(r.start));
            self.io(s, st.data_member(k), Op::Read, r.start, r.len(), ptr);
        }
    }

    /// Reads every surviving member of the stripe over the operation's parity range into
    /// its chunk buffers, for a degraded read or write.
    fn start_degraded(&mut self, s: u32, phase: Phase) {
        let g = *self.geo.geometry();
        let st = self.geo.stripe(self.sops[s as usize].stripe);
        let lost = (0..g.members()).filter(|&m| self.missing(s, m)).count();
        if lost > usize::from(g.parity_chunks()) {
            let stripe = st.stripe();
            return self.finish_sop(s, Err(ArrayError::Unrecoverable { stripe }));
        }
        // Read only the parity the rebuild needs: P for one lost data chunk, Q as well for
        // two (or for one when P is lost too); none when only parity is lost (a degraded
        // write regenerates P/Q from the data anyway).
        let lost_data = (0..g.data_chunks())
            .filter(|&k| self.missing(s, st.data_member(k)))
            .count();
        let p_lost = self.missing(s, st.p_member());
        let need_p = lost_data > 0;
        let need_q = lost_data == 2 || (lost_data == 1 && p_lost);
        let range = self.footprint(s).parity_range();
        let mut lost_members: ArrayVec<u16, 2> = ArrayVec::new();
        for m in 0..g.members() {
            if self.missing(s, m) {
                lost_members.push(m); // at most the redundancy (checked above)
            }
        }
        let sop = &mut self.sops[s as usize];
        sop.phase = phase;
        sop.range = range;
        sop.io_error = false;
        sop.lost = lost_members;
        for m in 0..g.members() {
            let needed = match st.role(m) {
                Role::P => need_p,
                Role::Q => need_q,
                Role::Data { .. } => true,
            };
            if needed && !self.missing(s, m) {
                let ptr = self.sops[s as usize].bufs[usize::from(m)].as_mut_ptr();
                self.io(s, m, Op::Read, range.start, range.len(), ptr);
            }
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// Rebuilds the failed members' chunks over the parity range from the survivors in the
    /// operation's buffers.
    fn rebuild_in_buffers(&mut self, s: u32) -> Result<(), ArrayError> {
        let g = *self.geo.geometry();
        let sop = &mut self.sops[s as usize];
        let st = self.geo.stripe(sop.stripe);
        let r = sop.range;
        let mut lost: ArrayVec<ChunkId, 2> = ArrayVec::new();
        for &m in &sop.lost {
            lost.push(match st.role(m) {
                Role::P => ChunkId::P,
                Role::Q => ChunkId::Q,
                Role::Data { slot, .. } => ChunkId::Data(slot as u8),
            });
        }
        if lost.is_empty() {
            return Ok(());
        }
        let mut data = ArrayVec::new();
        let (p, q) = views(&mut sop.bufs, &st, g.data_chunks(), g.level(), r, &mut data);
        // Rebuilt data is read again at once (copied to the caller, or fed to the new parity):
        // ordinary stores keep it in cache.
        self.parity
            .streaming(false)
            .reconstruct(&mut data, p, q, &lost)
            .map_err(|_| ArrayError::Unrecoverable { stripe: sop.stripe })
    }

    fn finish_degraded_read(&mut self, s: u32) {
        if self.sops[s as usize].foreign && !self.sops[s as usize].bad.is_empty() {
            // Rewriting the unreadable range is the owner's to do (two reactors must not
            // write one range): it reads again, rebuilds and repairs.
            return self.move_sop(s);
        }
        self.stats.degraded_reads += 1;
        if let Err(e) = self.rebuild_in_buffers(s) {
            return self.finish_sop(s, Err(e));
        }
        let g = *self.geo.geometry();
        let st = self.geo.stripe(self.sops[s as usize].stripe);
        let w = self.footprint(s);
        let c = u64::from(g.chunk_bytes());
        for k in 0..g.data_chunks() {
            if let Some(r) = w.written(k) {
                let dst = self.client_ptr(s, u64::from(k) * c + u64::from(r.start));
                let base = self.sops[s as usize].range.start;
                let src = &self.sops[s as usize].bufs[usize::from(st.data_member(k))]
                    [(r.start - base) as usize..(r.end - base) as usize];
                // SAFETY: dst is the caller's buffer range for these bytes (lent until the
                // request completes, used by this operation alone); src is our own buffer.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
            }
        }
        // Rewrite what the members with unrecovered read errors could not return: the
        // device remaps the sectors, and the member stays in service.
        let bad = self.sops[s as usize].bad.clone();
        if bad.is_empty() {
            return self.finish_sop(s, Ok(()));
        }
        let r = self.sops[s as usize].range;
        self.sops[s as usize].phase = Phase::Repair;
        self.sops[s as usize].io_error = false;
        for m in bad {
            if !self.is_failed(m) {
                self.stats.read_errors_repaired += 1;
                let ptr = self.sops[s as usize].bufs[usize::from(m)].as_mut_ptr();
                self.io(s, m, Op::Write { fua: false }, r.start, r.len(), ptr);
            }
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    // ---- write-intent bitmap -------------------------------------------------------------

    /// Counts a write operation in its regions (W1/W2, `crate::bitmap`); returns `true`
    /// when it must wait for its bits (it is then in `BitmapWait`).
    fn bitmap_gate(&mut self, s: u32) -> bool {
        let Some(i) = &mut self.intent else {
            return false;
        };
        let sop = &mut self.sops[s as usize];
        let writes = self.reqs[sop.req as usize]
            .as_ref()
            .expect("live request")
            .op
            .is_write();
        if !writes {
            return false;
        }
        let regions = i.shared.stripe_regions(sop.stripe);
        debug_assert!(sop.regions.is_empty());
        sop.regions = regions.clone();
        if i.shared.begin_write(regions) {
            return false;
        }
        sop.phase = Phase::BitmapWait;
        i.waiting.push_back(s);
        true
    }

    /// The bitmap's turn in the loop: the owner's batch and daemon, then the waiting writes
    /// whose bits became durable.
    fn bitmap_work(&mut self) -> bool {
        let mut any = self.bitmap_timeouts();
        let Some(i) = &mut self.intent else {
            return false;
        };
        if let Some(o) = &mut i.owner {
            if !o.busy() {
                o.poll(&i.shared, self.now, &mut i.writes);
                if o.busy() {
                    any = true;
                    self.issue_bitmap_batch();
                }
            }
        }
        let Some(i) = &mut self.intent else {
            return any;
        };
        let gen = i.shared.generation();
        if gen == i.seen || i.waiting.is_empty() {
            return any;
        }
        i.seen = gen;
        let mut k = 0;
        loop {
            let i = self.intent.as_ref().expect("the bitmap stays attached");
            let Some(&s) = i.waiting.get(k) else {
                break;
            };
            if i.shared.all_durable(self.sops[s as usize].regions.clone()) {
                self.intent
                    .as_mut()
                    .expect("the bitmap stays attached")
                    .waiting
                    .remove(k);
                self.ready_after_bitmap(s);
                any = true;
            } else {
                k += 1;
            }
        }
        any
    }

    fn ready_after_bitmap(&mut self, s: u32) {
        debug_assert_eq!(self.sops[s as usize].phase, Phase::BitmapWait);
        if self.array_failed() {
            return self.finish_sop(s, Err(ArrayError::Failed));
        }
        self.dispatch_sop(s);
    }

    /// The "operation index" in the tags of the owner shard's bitmap writes: one past the
    /// stripe operations (foreground and background pools), so the member queues account
    /// for them in a slot of their own.
    fn bitmap_sop(&self) -> u32 {
        self.sops.len() as u32
    }

    /// Issues the owner's batch on every online member: FUA writes at absolute member
    /// offsets (the bitmap area lies between the superblock and the data).
    fn issue_bitmap_batch(&mut self) {
        let i = self.intent.as_mut().expect("owner has a bitmap");
        let o = i.owner.as_mut().expect("owner");
        let base = o.buffer().as_mut_ptr();
        let nwrites = i.writes.len();
        let mut sent = 0u32;
        for w in 0..nwrites {
            let bw = self.intent.as_ref().expect("bitmap").writes[w];
            for member in 0..self.members.len() as u16 {
                if self.is_failed(member) {
                    continue;
                }
                let max = self.members[usize::from(member)].max_transfer;
                let mut done = 0u32;
                while done < bw.len_bytes {
                    let piece = (bw.len_bytes - done).min(max);
                    // SAFETY: the batch buffer is the owner's snapshot, allocated at attach
                    // and not written again until `batch_done` — after every request of the
                    // batch has completed; `buf_offset + done + piece <= len` of the area
                    // (the owner built the writes inside it).
                    let buf = unsafe {
                        IoBuf::from_raw(
                            std::ptr::NonNull::new(
                                base.wrapping_add(bw.buf_offset + done as usize),
                            )
                            .expect("non-null buffer"),
                            piece,
                            None,
                        )
                    };
                    let req = Request {
                        tag: self.tag_of(self.bitmap_sop(), member),
                        op: Op::Write { fua: true },
                        offset_bytes: bw.offset_bytes + u64::from(done),
                        len_bytes: piece,
                        buf,
                    };
                    done += piece;
                    let m = &mut self.members[usize::from(member)];
                    let id = usize::from(m.id);
                    m.counters.writes += 1;
                    m.counters.write_bytes += u64::from(piece);
                    sent += 1;
                    let i = self.intent.as_mut().expect("bitmap");
                    if i.outstanding == 0 {
                        i.issued_ns = self.now;
                    }
                    i.outstanding += 1;
                    i.per_member[id] += 1;
                    self.send(member, IoClass::Flush, req);
                }
            }
        }
        if sent == 0 {
            // No member online: the array has failed; nothing can be made durable.
            self.finish_bitmap_batch(false);
        }
    }

    fn bitmap_write_done(&mut self, member: u16, status: Result<(), IoError>) {
        let Some(i) = &mut self.intent else {
            self.stats.stray_completions += 1;
            return;
        };
        if i.outstanding == 0 || i.owner.is_none() {
            self.stats.stray_completions += 1;
            return;
        }
        i.outstanding -= 1;
        let pm = &mut i.per_member[usize::from(self.members[usize::from(member)].id)];
        debug_assert!(
            *pm > 0,
            "bitmap completion from a member with nothing outstanding"
        );
        *pm = pm.saturating_sub(1);
        let done = i.outstanding == 0;
        if let Err(e) = status {
            self.members[usize::from(member)].counters.errors += 1;
            // md fails a member whose bitmap write fails (md_super_write → md_error).
            self.fail_entry(member, e);
        }
        if done {
            let ok = !self.array_failed();
            self.finish_bitmap_batch(ok);
        }
    }

    /// The owner's bitmap writes are member commands too: one outstanding longer than the
    /// command timeout fails its member (as [`Array::check_timeouts`] does for stripe
    /// operations), is aborted, and the batch completes on the other members.
    fn bitmap_timeouts(&mut self) -> bool {
        let Some(i) = &mut self.intent else {
            return false;
        };
        if self.io_timeout_ns == 0
            || i.outstanding == 0
            || self.now.saturating_sub(i.issued_ns) < self.io_timeout_ns
        {
            return false;
        }
        // Abort again only after another full timeout.
        i.issued_ns = self.now;
        for member in 0..self.members.len() as u16 {
            let id = self.id_of(member);
            if self.intent.as_ref().expect("bitmap").per_member[id] == 0 {
                continue;
            }
            self.time_out(self.bitmap_sop(), member);
        }
        true
    }

    fn finish_bitmap_batch(&mut self, ok: bool) {
        let i = self.intent.as_mut().expect("bitmap");
        let o = i.owner.as_mut().expect("owner");
        o.batch_done(&i.shared, ok);
    }

    // ---- writes ----------------------------------------------------------------------------

    fn start_write(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let st = self.geo.stripe(self.sops[s as usize].stripe);
        let w = self.footprint(s);
        let plan = plan_write(&w, &st, |m| self.missing(s, m));
        let r = plan.range;
        self.sops[s as usize].range = r;
        self.sops[s as usize].io_error = false;
        match plan.mode {
            WriteMode::FullStripe => self.write_out(s, WriteMode::FullStripe),
            WriteMode::Degraded => self.start_degraded(s, Phase::WriteRead(WriteMode::Degraded)),
            mode @ (WriteMode::Rmw | WriteMode::Rcw) => {
                self.sops[s as usize].phase = Phase::WriteRead(mode);
                for k in 0..g.data_chunks() {
                    let written = w.written(k);
                    let read = match mode {
                        WriteMode::Rmw => written.is_some(),
                        _ => !written.is_some_and(|x| x.contains(&r)),
                    };
                    if read {
                        let m = st.data_member(k);
                        let ptr = self.sops[s as usize].bufs[usize::from(m)].as_mut_ptr();
                        self.io(s, m, Op::Read, r.start, r.len(), ptr);
                    }
                }
                if mode == WriteMode::Rmw {
                    for m in [Some(st.p_member()), st.q_member()].into_iter().flatten() {
                        let ptr = self.sops[s as usize].bufs[usize::from(m)].as_mut_ptr();
                        self.io(s, m, Op::Read, r.start, r.len(), ptr);
                    }
                }
                if self.sops[s as usize].outstanding == 0 {
                    self.ready.push_back(s);
                }
            }
        }
    }

    /// Computes the new parity for `mode` from what the read phase left in the buffers and
    /// the caller's data, then issues the data and parity writes.
    fn write_out(&mut self, s: u32, mode: WriteMode) {
        let g = *self.geo.geometry();
        let st = self.geo.stripe(self.sops[s as usize].stripe);
        let w = self.footprint(s);
        let r = self.sops[s as usize].range;
        let c = u64::from(g.chunk_bytes());
        let nd = g.data_chunks();
        // Buffer positions: the parity range starts at byte 0 of each member buffer.
        let base = r.start;
        let (ri, rl) = (0usize, r.len() as usize);
        let fua = self.reqs[self.sops[s as usize].req as usize]
            .as_ref()
            .expect("live")
            .op
            .fua();

        // Pointers to the caller's data of each touched chunk, at the start of its range.
        let client =
            |this: &Self, k: u16, from: u32| this.client_ptr(s, u64::from(k) * c + u64::from(from));

        match mode {
            WriteMode::FullStripe | WriteMode::Rcw => {
                // Overlay partial new data onto the chunks read (RCW), then regenerate P/Q
                // from the complete new data over R.
                let mut srcs: ArrayVec<*const u8, MAX_DATA_CHUNKS> = ArrayVec::new();
                for _ in 0..nd {
                    srcs.push(std::ptr::null());
                }
                for k in 0..nd {
                    let m = usize::from(st.data_member(k));
                    let slot = usize::from(st.q_slot(k));
                    match w.written(k) {
                        Some(x) if x.contains(&r) => {
                            srcs[slot] = client(self, k, r.start) as *const u8
                        }
                        written => {
                            if let Some(x) = written {
                                let src = client(self, k, x.start);
                                let dst = self.sops[s as usize].bufs[m]
                                    .as_mut_ptr()
                                    .wrapping_add((x.start - base) as usize);
                                // SAFETY: src is the caller's range for chunk k (lent); dst our buffer.
                                unsafe {
                                    std::ptr::copy_nonoverlapping(src, dst, x.len() as usize)
                                };
                            }
                            srcs[slot] = self.sops[s as usize].bufs[m].as_ptr().wrapping_add(ri);
                        }
                    }
                }
                self.gen_parity_from(s, &st, &srcs, r);
            }
            WriteMode::Rmw => {
                // P ⊕= Σ (old ⊕ new), Q ⊕= Σ g^slot·(old ⊕ new) over R, in one kernel pass.
                // A chunk written over all of R (every single-chunk write) gives the kernel
                // its old data and the caller's new data as they are. A chunk written over
                // part of R has its old data turned into Δ = old ⊕ new in place (zero where
                // not written), given to the kernel against zeroes.
                let mut direct: ArrayVec<Option<*const u8>, MAX_DATA_CHUNKS> = ArrayVec::new();
                for k in 0..nd {
                    direct.push(None);
                    if let Some(x) = w.written(k) {
                        let src = client(self, k, x.start);
                        if x == r {
                            direct[usize::from(k)] = Some(src);
                            continue;
                        }
                        let m = usize::from(st.data_member(k));
                        let buf = &mut self.sops[s as usize].bufs[m];
                        let (xs, xe) = ((x.start - base) as usize, (x.end - base) as usize);
                        buf[ri..xs].fill(0);
                        buf[xe..rl].fill(0);
                        // SAFETY: src is the caller's range for chunk k, x.len() bytes (lent).
                        let new = unsafe { std::slice::from_raw_parts(src, x.len() as usize) };
                        for (b, n) in buf[xs..xe].iter_mut().zip(new) {
                            *b ^= n;
                        }
                    }
                }
                let sop = &mut self.sops[s as usize];
                let zero = &self.zero[ri..rl];
                let mut deltas: ArrayVec<crate::parity::Delta<'_>, MAX_DATA_CHUNKS> =
                    ArrayVec::new();
                let mut p_buf: Option<&mut [u8]> = None;
                let mut q_buf: Option<&mut [u8]> = None;
                for (m, b) in sop.bufs.iter_mut().enumerate() {
                    match st.role(m as u16) {
                        Role::P => p_buf = Some(&mut b[ri..rl]),
                        Role::Q => q_buf = Some(&mut b[ri..rl]),
                        Role::Data { index, slot } => match direct[usize::from(index)] {
                            Some(src) => deltas.push(crate::parity::Delta {
                                slot: slot as u8,
                                old: &b[ri..rl],
                                // SAFETY: the caller's range for this chunk, which is all of
                                // R: rl − ri bytes (lent for the request's life).
                                new: unsafe { std::slice::from_raw_parts(src, rl - ri) },
                            }),
                            None if w.written(index).is_some() => {
                                deltas.push(crate::parity::Delta {
                                    slot: slot as u8,
                                    old: zero,
                                    new: &b[ri..rl],
                                });
                            }
                            None => {}
                        },
                    }
                }
                let p = p_buf.expect("stripe has P");
                match q_buf {
                    Some(q) => self.parity.update_pq(&deltas, p, q),
                    None => self.parity.update_p(&deltas, p),
                }
            }
            WriteMode::Degraded => {
                if let Err(e) = self.rebuild_in_buffers(s) {
                    return self.finish_sop(s, Err(e));
                }
                let mut srcs: ArrayVec<*const u8, MAX_DATA_CHUNKS> = ArrayVec::new();
                for _ in 0..nd {
                    srcs.push(std::ptr::null());
                }
                for k in 0..nd {
                    let m = usize::from(st.data_member(k));
                    if let Some(x) = w.written(k) {
                        let src = client(self, k, x.start);
                        let dst = self.sops[s as usize].bufs[m]
                            .as_mut_ptr()
                            .wrapping_add((x.start - base) as usize);
                        // SAFETY: src is the caller's range for chunk k (lent); dst our buffer.
                        unsafe { std::ptr::copy_nonoverlapping(src, dst, x.len() as usize) };
                    }
                    srcs[usize::from(st.q_slot(k))] =
                        self.sops[s as usize].bufs[m].as_ptr().wrapping_add(ri);
                }
                self.gen_parity_from(s, &st, &srcs, r);
            }
        }

        // Issue the writes: touched data chunks from the caller's buffer, then P/Q over R.
        self.sops[s as usize].phase = Phase::Writing;
        self.sops[s as usize].mode = mode;
        self.sops[s as usize].io_error = false;
        for k in 0..nd {
            let m = st.data_member(k);
            if let Some(x) = w.written(k) {
                let ptr = client(self, k, x.start);
                self.io_write(s, m, Op::Write { fua }, x.start, x.len(), ptr);
            }
        }
        for m in [Some(st.p_member()), st.q_member()].into_iter().flatten() {
            let ptr = self.sops[s as usize].bufs[usize::from(m)]
                .as_mut_ptr()
                .wrapping_add(ri);
            self.io_write(s, m, Op::Write { fua }, r.start, r.len(), ptr);
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// P (and Q) over `r` from data pointers in slot order, into the P/Q members' buffers.
    fn gen_parity_from(
        &mut self,
        s: u32,
        st: &crate::geometry::StripeLayout,
        srcs: &[*const u8],
        r: ChunkRange,
    ) {
        let len = r.len() as usize;
        let mut data: ArrayVec<&[u8], MAX_DATA_CHUNKS> = ArrayVec::new();
        for &p in srcs {
            // SAFETY: each pointer is either the caller's buffer range for a fully written
            // chunk (lent, len bytes from R's start lie inside the written range) or one of
            // this operation's chunk buffers at its start, where R begins (len <= chunk).
            data.push(unsafe { std::slice::from_raw_parts(p, len) });
        }
        let sop = &mut self.sops[s as usize];
        let (ri, rl) = (0usize, r.len() as usize);
        let pm = usize::from(st.p_member());
        match st.q_member() {
            Some(qm) => {
                let qm = usize::from(qm);
                let (a, b) = if pm < qm {
                    let (lo, hi) = sop.bufs.split_at_mut(qm);
                    (&mut lo[pm], &mut hi[0])
                } else {
                    let (lo, hi) = sop.bufs.split_at_mut(pm);
                    (&mut hi[0], &mut lo[qm])
                };
                self.parity.gen_pq(&data, &mut a[ri..rl], &mut b[ri..rl]);
            }
            None => self.parity.gen_p(&data, &mut sop.bufs[pm][ri..rl]),
        }
    }

    fn advance(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let sop = &self.sops[s as usize];
        let failed = sop.io_error;
        match sop.phase {
            Phase::Queued => unreachable!("queued operations have no I/O"),
            // A read failed: the member is failed (or marked bad for this operation), and
            // the survivors are read again without it.
            Phase::BgRead if failed => self.start_bg(s),
            Phase::BgRead => self.bg_compute(s),
            // A rebuild whose every target failed (its write, or another operation's) did
            // not rebuild this stripe.
            Phase::BgWrite => {
                let status = self.rebuild_target_left();
                self.finish_bg(s, status)
            }
            Phase::BitmapWait => unreachable!("operations waiting for their bits have no I/O"),
            Phase::GateWait => unreachable!("operations waiting for the gate have no I/O"),
            Phase::Flushing => {
                let ri = sop.req;
                self.free_sops.push(s);
                let req = self.reqs[ri as usize].as_mut().expect("live request");
                if self.failed_members > g.parity_chunks() {
                    req.error.get_or_insert(ArrayError::Failed);
                }
                req.pending = 0;
                self.finish_req(ri);
            }
            // A foreign read goes on from redundancy under the gate (the owner writes
            // nothing meanwhile), unless a member is now being rebuilt.
            Phase::DirectRead | Phase::DegradedRead
                if failed && sop.foreign && self.rebuilding() =>
            {
                self.move_sop(s)
            }
            Phase::DirectRead if failed => self.start_degraded(s, Phase::DegradedRead),
            Phase::DirectRead => {
                self.stats.direct_reads += 1;
                self.finish_sop(s, Ok(()))
            }
            Phase::DegradedRead if failed => self.start_degraded(s, Phase::DegradedRead),
            Phase::DegradedRead => self.finish_degraded_read(s),
            // The read was served from redundancy; a failed rewrite failed the member.
            Phase::Repair => self.finish_sop(s, Ok(())),
            Phase::WriteRead(_) if failed => self.start_write(s),
            Phase::WriteRead(mode) => self.write_out(s, mode),
            Phase::Zeroing if sop.unsupported => {
                // Some member could not zero natively: write the whole stripe from the zero
                // buffer (data and parity), which needs no reads.
                self.sops[s as usize].unsupported = false;
                self.sops[s as usize].range = ChunkRange {
                    start: 0,
                    end: g.chunk_bytes(),
                };
                self.write_out(s, WriteMode::FullStripe)
            }
            Phase::Zeroing => {
                let st = self.geo.stripe(sop.stripe);
                let lost = (0..g.members()).filter(|&m| self.is_failed(m)).count();
                let status = if lost > usize::from(g.parity_chunks()) {
                    Err(ArrayError::Unrecoverable {
                        stripe: st.stripe(),
                    })
                } else {
                    Ok(())
                };
                self.finish_sop(s, status)
            }
            Phase::Writing => {
                let st = self.geo.stripe(sop.stripe);
                match sop.mode {
                    WriteMode::FullStripe => self.stats.full_stripe_writes += 1,
                    WriteMode::Rmw => self.stats.rmw_writes += 1,
                    WriteMode::Rcw => self.stats.rcw_writes += 1,
                    WriteMode::Degraded => self.stats.degraded_writes += 1,
                }
                let lost = (0..g.members()).filter(|&m| self.is_failed(m)).count();
                let status = if lost > usize::from(g.parity_chunks()) {
                    Err(ArrayError::Unrecoverable {
                        stripe: st.stripe(),
                    })
                } else {
                    Ok(())
                };
                self.finish_sop(s, status)
            }
        }
    }
}

/// The completion of a request the member's channel refused for good with `e`.
fn refusal(tag: u64, e: SubmitError) -> Completion {
    debug_assert!(
        !matches!(e, SubmitError::Invalid(_)),
        "the array built a request its member refuses: {e}"
    );
    let err = match e {
        SubmitError::Gone => IoError::Gone,
        // The engine built a request the device refuses: treat the member as failed
        // rather than lose the I/O.
        _ => IoError::Io { errno: 22 },
    };
    Completion {
        tag,
        status: Err(err),
    }
}

/// Splits one operation's member buffers into slot-ordered data views (pushed onto
/// `data`, which the caller owns: returning a 255-entry `ArrayVec` by value would copy all
/// of it), and returns P and Q, each over the parity range `r` (which sits at the front of
/// every buffer).
fn views<'a>(
    bufs: &'a mut [AlignedBuf],
    st: &crate::geometry::StripeLayout,
    nd: u16,
    level: Level,
    r: ChunkRange,
    data: &mut ArrayVec<&'a mut [u8], MAX_DATA_CHUNKS>,
) -> (&'a mut [u8], Option<&'a mut [u8]>) {
    let (ri, rl) = (0usize, r.len() as usize);
    let mut by_slot: ArrayVec<Option<&'a mut [u8]>, MAX_DATA_CHUNKS> = ArrayVec::new();
    for _ in 0..nd {
        by_slot.push(None);
    }
    let mut p = None;
    let mut q = None;
    for (m, b) in bufs.iter_mut().enumerate() {
        match st.role(m as u16) {
            Role::P => p = Some(&mut b[ri..rl]),
            Role::Q => q = Some(&mut b[ri..rl]),
            Role::Data { slot, .. } => by_slot[usize::from(slot)] = Some(&mut b[ri..rl]),
        }
    }
    data.extend(
        by_slot
            .iter_mut()
            .map(|x| x.take().expect("every slot has a member")),
    );
    debug_assert_eq!(q.is_some(), level == Level::Raid6);
    (p.expect("stripe has P"), q)
}

// ---- background processes and member lifecycle -----------------------------------------

/// Whether a device described by `info` can serve member `slot` of an array of `geo`
/// whose data area starts at `data_offset_bytes` on every member: its block size divides
/// the array's, the data offset is a multiple of its block size, it holds the data offset
/// plus the data area, and its largest transfer is at least one block.
///
/// # Errors
/// [`ProcessError::Unfit`] naming what does not fit.
pub fn device_fits(
    geo: &ArrayGeometry,
    data_offset_bytes: u64,
    slot: u16,
    info: &crate::device::DeviceInfo,
) -> Result<(), ProcessError> {
    let unfit = |why| Err(ProcessError::Unfit { member: slot, why });
    let g = geo.geometry();
    if info.block_bytes == 0 || !g.block_bytes().is_multiple_of(info.block_bytes) {
        return unfit("its block size does not divide the array's");
    }
    if !data_offset_bytes.is_multiple_of(u64::from(info.block_bytes)) {
        return unfit("the data offset is not a multiple of its block size");
    }
    if info.capacity_bytes < data_offset_bytes.saturating_add(geo.member_data_bytes()) {
        return unfit("it is smaller than the data offset plus the data area");
    }
    if info.max_transfer_bytes < info.block_bytes {
        return unfit("its largest transfer is below one block");
    }
    Ok(())
}

impl<C: Channel> Array<C> {
    /// Tells the shard which stripes it owns: stripe `s` is its when
    /// `s % shards == shard` (see [`crate::shard::owner`]). A process walks only these.
    /// Defaults to `(0, 1)`: one shard owning everything. Call before starting a process.
    ///
    /// # Panics
    /// If `shard >= shards` (a programmer error).
    pub fn set_shard(&mut self, shard: usize, shards: usize) {
        assert!(shard < shards, "shard {shard} of {shards}");
        self.shard = shard;
        self.shards = shards;
    }

    /// Shares the stripe gate of an array with several shards ([`StripeGate`]): this shard
    /// then serves reads of other shards' stripes (foreign reads, each within one stripe)
    /// and makes its own writes wait for foreign reads of their stripe. Every shard of the
    /// array must get the same gate (or none). Foreign reads it cannot serve come back
    /// from [`Array::take_moved`] for the owner.
    ///
    /// # Panics
    /// If requests are in flight (a programmer error).
    pub fn set_gate(&mut self, gate: Option<Arc<StripeGate>>) {
        assert!(!self.busy(), "set the gate before submitting requests");
        self.gate = gate;
    }

    /// Stripe operations in the shard's pools (foreground and background): the most it
    /// can hold in a [`StripeGate`] at once.
    pub fn stripe_op_capacity(&self) -> usize {
        self.sops.len()
    }

    /// A foreign read this shard handed back: submit it to the stripe's owner (same tag
    /// and buffer). Nothing of it has been completed here.
    pub fn take_moved(&mut self) -> Option<ArrayRequest> {
        self.moved.pop_front()
    }

    /// Replaces the pacer that admits background operations ([`Unpaced`] by default).
    pub fn set_pacer(&mut self, pacer: Box<dyn Pacer>) {
        self.pacer = pacer;
    }

    /// Starts a background process on this shard's stripes (every shard of the array must
    /// be given the same request). A rebuild rebuilds every member in
    /// [`MemberState::Rebuilding`] at once (two on RAID6); resync, check and repair need
    /// every member online.
    ///
    /// # Errors
    /// [`ProcessError::ArrayFailed`] on a failed array; [`ProcessError::Busy`] while a
    /// process runs or still has operations in flight; [`ProcessError::NoSlots`] when the
    /// array was configured without background operations;
    /// [`ProcessError::NothingToRebuild`], [`ProcessError::Degraded`]; the request's own
    /// errors ([`ProcessRequest::validate`]). Nothing changes on error.
    pub fn start_process(&mut self, req: &ProcessRequest) -> Result<(), ProcessError> {
        let targets = self.check_process(req)?;
        let stripes = self.geo.stripes();
        let ranges = req
            .ranges
            .clone()
            .unwrap_or_else(|| std::iter::once(0..stripes).collect());
        let walk = ShardWalk::new(ranges, req.resume_stripe, self.shard, self.shards);
        let p = Proc {
            kind: req.kind,
            state: ProcessState::Running,
            done: walk.own_below(req.resume_stripe),
            total: walk.total_own(),
            walk,
            in_flight: ArrayVec::new(),
            hold: None,
            mismatch_cnt: 0,
            targets,
        };
        // The resume position is a checkpoint: the targets are in sync below it (and
        // wherever this shard has rebuilt them already).
        let pos = p.position(stripes);
        for &t in &p.targets {
            let m = &mut self.members[usize::from(t)];
            m.recovery_stripe = m.recovery_stripe.max(pos);
        }
        self.proc = Some(p);
        self.bg_not_before = 0;
        self.bg_wait = false;
        tracing::debug!(shard = self.shard, kind = %req.kind, resume = req.resume_stripe, "process started");
        Ok(())
    }

    /// Whether [`Self::start_process`] would accept `req` now; returns the members a
    /// rebuild would rebuild.
    ///
    /// # Errors
    /// As [`Self::start_process`].
    pub fn check_process(&self, req: &ProcessRequest) -> Result<ArrayVec<u16, 2>, ProcessError> {
        req.validate(&self.geo)?;
        if self.array_failed() {
            return Err(ProcessError::ArrayFailed);
        }
        if let Some(p) = &self.proc {
            if p.state == ProcessState::Running || !p.in_flight.is_empty() {
                return Err(ProcessError::Busy { running: p.kind });
            }
            // A replace finished here waits for the others to swap the replacement in; its
            // state is how they know.
            if p.kind == ProcessKind::Replace
                && p.state == ProcessState::Finished
                && self.replacement_entry().is_some()
            {
                return Err(ProcessError::Busy { running: p.kind });
            }
        }
        if self.background_ops == 0 {
            return Err(ProcessError::NoSlots);
        }
        let mut targets: ArrayVec<u16, 2> = ArrayVec::new();
        if req.kind == ProcessKind::Replace {
            // Members failed meanwhile are read around (the chunk is rebuilt from the
            // others); the replacement must be live.
            return match (self.replace, self.replacement_entry()) {
                (Some(r), Some(_)) => {
                    targets.push(r.member);
                    Ok(targets)
                }
                _ => Err(ProcessError::NoReplacement),
            };
        }
        for (m, mem) in self.members[..self.slots()].iter().enumerate() {
            match (req.kind, mem.state) {
                (_, MemberState::Online) => {}
                (ProcessKind::Rebuild, MemberState::Rebuilding) => {
                    // At most the redundancy (2) members are missing on a live array.
                    if targets.try_push(m as u16).is_err() {
                        return Err(ProcessError::ArrayFailed);
                    }
                }
                (ProcessKind::Rebuild, _) => {}
                (kind, _) => {
                    return Err(ProcessError::Degraded {
                        kind,
                        member: m as u16,
                    })
                }
            }
        }
        if req.kind == ProcessKind::Rebuild && targets.is_empty() {
            return Err(ProcessError::NothingToRebuild);
        }
        Ok(targets)
    }

    /// Stops the running process: no new background operation starts; those in flight
    /// finish. Its position is then where to resume. Returns whether one was running.
    pub fn stop_process(&mut self) -> bool {
        match &mut self.proc {
            Some(p) if p.state == ProcessState::Running => {
                p.state = ProcessState::Stopped;
                true
            }
            _ => false,
        }
    }

    /// This shard's progress in the last process started, if any.
    pub fn process_progress(&self) -> Option<ShardProgress> {
        let p = self.proc.as_ref()?;
        Some(ShardProgress {
            kind: p.kind,
            state: p.state,
            position_stripes: p.position(self.geo.stripes()),
            done_stripes: p.done,
            total_stripes: p.total,
            mismatch_cnt: p.mismatch_cnt,
            in_flight: p.in_flight.len() as u32,
            targets: p.targets.clone(),
        })
    }

    /// Whether background operations are still in flight (a stopped or failed process
    /// drains them).
    pub fn background_busy(&self) -> bool {
        self.proc.as_ref().is_some_and(|p| !p.in_flight.is_empty())
    }

    /// `slot` is a member slot of an array that has not failed.
    ///
    /// # Errors
    /// [`ProcessError::NoSuchMember`], [`ProcessError::ArrayFailed`].
    fn check_live_slot(&self, slot: u16) -> Result<(), ProcessError> {
        let members = self.geo.geometry().members();
        if slot >= members {
            return Err(ProcessError::NoSuchMember {
                member: slot,
                members,
            });
        }
        if self.array_failed() {
            return Err(ProcessError::ArrayFailed);
        }
        Ok(())
    }

    /// Whether [`Self::replace_member`] would accept a device described by `info` into
    /// `slot` now.
    ///
    /// # Errors
    /// As [`Self::replace_member`].
    pub fn check_replace(
        &self,
        slot: u16,
        info: &crate::device::DeviceInfo,
    ) -> Result<(), ProcessError> {
        self.check_live_slot(slot)?;
        let m = &self.members[usize::from(slot)];
        if !m.state.is_failed() {
            return Err(ProcessError::NotFailed { member: slot });
        }
        // A failed member being replaced is still being copied onto its replacement
        // (rebuilt from the others): that device takes the slot when it is done.
        if self.replacement_entry().is_some() && self.replace.is_some_and(|r| r.member == slot) {
            return Err(ProcessError::ReplaceBusy { member: slot });
        }
        if self.entry_busy(slot) {
            return Err(ProcessError::MemberBusy { member: slot });
        }
        device_fits(&self.geo, self.data_offset, slot, info)
    }

    /// Whether device entry `entry` has requests outstanding on this shard: queued,
    /// on the device, or completed with a refusal not yet taken.
    fn entry_busy(&self, entry: u16) -> bool {
        let id = self.id_of(entry);
        self.members[usize::from(entry)].queue.queued() > 0
            || self.sops.iter().any(|s| s.per_member[id] > 0)
            || self
                .synthetic
                .iter()
                .any(|c| (c.tag & ((1 << MEMBER_BITS) - 1)) as usize == id)
            || self.intent.as_ref().is_some_and(|i| i.per_member[id] > 0)
    }

    /// Puts a new device's channel into the slot of failed member `slot`; the member is
    /// then [`MemberState::Rebuilding`], in sync nowhere yet, written by foreground writes,
    /// and a rebuild ([`Self::start_process`] with [`ProcessKind::Rebuild`]) recovers it.
    /// Returns the old channel. Every shard must be given a channel to the same device.
    ///
    /// # Errors
    /// [`ProcessError::NoSuchMember`]; [`ProcessError::ArrayFailed`] when the array has
    /// failed (it stays failed: a new device cannot bring it back);
    /// [`ProcessError::NotFailed`] for a member that is online or already being rebuilt;
    /// [`ProcessError::MemberBusy`] while requests to the old device are outstanding (retry
    /// after processing); [`ProcessError::Unfit`] for a device too small or of a larger
    /// block size. Nothing changes on error (the new channel is dropped).
    pub fn replace_member(&mut self, slot: u16, ch: C) -> Result<C, ProcessError> {
        self.check_replace(slot, ch.info())?;
        let i = ch.info();
        let max_transfer = i.max_transfer_bytes / i.block_bytes * i.block_bytes;
        let m = &mut self.members[usize::from(slot)];
        let old = std::mem::replace(&mut m.ch, ch);
        m.state = MemberState::Rebuilding;
        if let Some(g) = &self.gate {
            g.note_replaced(slot);
        }
        m.recovery_stripe = 0;
        m.bitmap_recovery = false;
        m.max_transfer = max_transfer;
        if let Some(i) = &self.intent {
            i.shared.write_all();
        }
        tracing::info!(
            shard = self.shard,
            member = slot,
            "member replaced: rebuilding"
        );
        Ok(old)
    }

    /// [`Self::replace_member`] for a device that **is** the member that left `slot`
    /// (md's re-add): it comes back in sync except where writes missed it, which the
    /// attached write-intent bitmap marks — its rebuild ([`Self::pending_rebuild`]) covers
    /// only the regions set on disk (md's `Bitmap_sync` recovery). The caller has checked
    /// that it may (md's `super_1_validate`: the device's `events` is not below the
    /// bitmap's `events_cleared`, [`WriteIntent::events_cleared`]). Without a bitmap, or
    /// with one forced all-dirty at start, it is rebuilt in full.
    ///
    /// # Errors
    /// As [`Self::replace_member`].
    pub fn readd_member(&mut self, slot: u16, ch: C) -> Result<C, ProcessError> {
        let old = self.replace_member(slot, ch)?;
        self.members[usize::from(slot)].bitmap_recovery = true;
        tracing::info!(
            shard = self.shard,
            member = slot,
            "member re-added: only the bitmap's dirty regions are rebuilt"
        );
        Ok(old)
    }

    /// After a rebuild finished on every shard: its targets that are still
    /// [`MemberState::Rebuilding`] become [`MemberState::Online`] (in sync on every
    /// stripe). Returns them; empty when this shard's rebuild has not finished (or was
    /// completed already). The process's progress keeps listing them as its targets. Calling it before every shard has finished is a caller bug
    /// the shard cannot see: other shards' stripes would be read from the member.
    pub fn complete_rebuild(&mut self) -> ArrayVec<u16, 2> {
        let mut out = ArrayVec::new();
        let Some(p) = self.proc.as_mut() else {
            return out;
        };
        if p.kind != ProcessKind::Rebuild || p.state != ProcessState::Finished {
            return out;
        }
        // The targets stay in the process's progress: what the finished rebuild brought in.
        let targets = p.targets.clone();
        for t in targets {
            if self.set_member_online(t) {
                out.push(t);
            }
        }
        out
    }

    /// The rebuild that members being rebuilt and not yet rebuilt on this shard need:
    /// the whole array from the lowest of their recovery positions (what a replacement, or
    /// an assembly with [`ArrayConfig::rebuilding`], resumes from); `None` if there is none.
    ///
    /// When every such member returned by bitmap ([`Self::readd_member`],
    /// [`ArrayConfig::bitmap_recovery`]) and a bitmap is attached that was not forced
    /// all-dirty, the rebuild covers only the regions set on disk
    /// ([`WriteIntent::on_disk_regions`]; allocates: a control path).
    pub fn pending_rebuild(&self) -> Option<ProcessRequest> {
        let stripes = self.geo.stripes();
        let waiting = || {
            self.members[..self.slots()]
                .iter()
                .filter(|m| m.state == MemberState::Rebuilding && m.recovery_stripe < stripes)
        };
        let resume = waiting().map(|m| m.recovery_stripe).min()?;
        let ranges = match &self.intent {
            Some(i) if !i.shared.forced_all() && waiting().all(|m| m.bitmap_recovery) => {
                Some(i.shared.on_disk_regions())
            }
            _ => None,
        };
        Some(ProcessRequest {
            kind: ProcessKind::Rebuild,
            ranges,
            resume_stripe: resume,
        })
    }

    /// Members being rebuilt that this shard has rebuilt on all its stripes (its rebuild
    /// finished with them as targets): once every shard reports a member here, it may go
    /// online everywhere ([`Self::set_member_online`]).
    pub fn rebuilt_members(&self) -> ArrayVec<u16, 2> {
        let stripes = self.geo.stripes();
        let mut out = ArrayVec::new();
        for (m, mem) in self.members[..self.slots()].iter().enumerate() {
            if mem.state == MemberState::Rebuilding && mem.recovery_stripe >= stripes {
                // At most the redundancy (2) members are being rebuilt.
                let _ = out.try_push(m as u16);
            }
        }
        out
    }

    /// Puts member `m` online if it is being rebuilt and this shard has rebuilt it on all
    /// its stripes; returns whether it did. For the executor, once every shard has
    /// reported `m` in [`Self::rebuilt_members`].
    ///
    /// # Panics
    /// If `m` is not a member index.
    pub fn set_member_online(&mut self, m: u16) -> bool {
        let stripes = self.geo.stripes();
        let mem = &mut self.members[usize::from(m)];
        if mem.state != MemberState::Rebuilding || mem.recovery_stripe < stripes {
            return false;
        }
        mem.state = MemberState::Online;
        mem.bitmap_recovery = false;
        self.failed_members -= 1;
        self.note_degraded();
        tracing::info!(shard = self.shard, member = m, "member rebuilt: online");
        true
    }

    // ---- replacement (md's `mdadm --replace`) ---------------------------------------------

    /// The entry of the live replacement device, if any.
    fn replacement_entry(&self) -> Option<u16> {
        match self.replace {
            Some(ReplaceInfo {
                state: ReplaceState::Copying,
                ..
            }) if self.members.len() > self.slots() => Some(self.slots() as u16),
            _ => None,
        }
    }

    /// Whether [`Self::start_replace`] would accept a device described by `info` as the
    /// replacement of member `slot` now.
    ///
    /// # Errors
    /// As [`Self::start_replace`].
    pub fn check_start_replace(
        &self,
        slot: u16,
        info: &crate::device::DeviceInfo,
    ) -> Result<(), ProcessError> {
        self.check_live_slot(slot)?;
        if let (Some(r), Some(_)) = (self.replace, self.replacement_entry()) {
            return Err(ProcessError::ReplaceBusy { member: r.member });
        }
        if self.members[usize::from(slot)].state != MemberState::Online {
            return Err(ProcessError::NotInService { member: slot });
        }
        // md would give a new device to a missing member first (`raid5_add_disk` fills an
        // empty slot before it takes a replacement): rebuild that one instead.
        if let Some(m) = self.members[..self.slots()]
            .iter()
            .position(|m| m.state != MemberState::Online)
        {
            return Err(ProcessError::Degraded {
                kind: ProcessKind::Replace,
                member: m as u16,
            });
        }
        // The device a previous replacement left behind still has requests in flight.
        if self.members.len() > self.slots() {
            return Err(ProcessError::MemberBusy { member: slot });
        }
        if let Some(p) = &self.proc {
            if p.state == ProcessState::Running || !p.in_flight.is_empty() {
                return Err(ProcessError::Busy { running: p.kind });
            }
        }
        if self.background_ops == 0 {
            return Err(ProcessError::NoSlots);
        }
        device_fits(&self.geo, self.data_offset, slot, info)
    }

    /// Gives member `slot` a replacement device (md's `want_replacement` with a spare as
    /// its replacement) and starts the replace process ([`ProcessKind::Replace`]) from
    /// `resume_stripe` (a checkpoint: the replacement holds the member's data below it).
    /// From now on every write to the member goes to the replacement too; reads stay on
    /// the member. When the process has finished on every shard, the executor calls
    /// [`Self::complete_replace`] on each; if the replacement fails, the replace stops and
    /// the array is as it was ([`ReplaceState::Failed`]). Every shard must be given a
    /// channel to the same device and the same `serial`.
    ///
    /// # Errors
    /// [`ProcessError::NoSuchMember`]; [`ProcessError::ArrayFailed`];
    /// [`ProcessError::ReplaceBusy`] while a replacement is live;
    /// [`ProcessError::NotInService`] for a member failed or being rebuilt;
    /// [`ProcessError::Degraded`] while any member is (md would rebuild it first);
    /// [`ProcessError::MemberBusy`] while the device a previous replace left has requests
    /// in flight (retry); [`ProcessError::Busy`] while another process runs;
    /// [`ProcessError::NoSlots`]; [`ProcessError::Unfit`]; [`ProcessError::BadResume`].
    /// Nothing changes on error.
    pub fn start_replace(
        &mut self,
        slot: u16,
        ch: C,
        serial: u64,
        resume_stripe: u64,
    ) -> Result<(), ProcessError> {
        self.check_start_replace(slot, ch.info())?;
        let req = ProcessRequest {
            kind: ProcessKind::Replace,
            ranges: None,
            resume_stripe,
        };
        req.validate(&self.geo)?;
        let id = self
            .entry_of
            .iter()
            .position(|&e| e == NO_ENTRY)
            .expect("one id is free while no extra device exists");
        let chunk = self.geo.geometry().chunk_bytes() as usize;
        let dev = Member::new(ch, id as u16, &self.cfg, self.sops.len(), chunk);
        let entry = self.slots() as u16;
        // The last process (a previous replace, finished and swapped in, among others) is
        // over (checked above); it must not stand for this one: a finished replace process
        // is how `replace_finished` knows the copy is done.
        let prev_proc = self.proc.take();
        let prev_replace = self.replace;
        self.members.push(dev);
        self.entry_of[id] = entry;
        self.replace = Some(ReplaceInfo {
            member: slot,
            serial,
            state: ReplaceState::Copying,
        });
        if let Err(e) = self.start_process(&req) {
            // Nothing changes on error.
            self.members.pop();
            self.entry_of[id] = NO_ENTRY;
            self.replace = prev_replace;
            self.proc = prev_proc;
            return Err(e);
        }
        debug_assert!(self
            .proc
            .as_ref()
            .is_some_and(|p| p.kind == ProcessKind::Replace && p.state == ProcessState::Running));
        self.replace_bitmap_ticket = self.intent.as_ref().map_or(0, |i| i.shared.write_all());
        tracing::info!(
            shard = self.shard,
            member = slot,
            resume = resume_stripe,
            "replace started: writes to the member go to its replacement too"
        );
        Ok(())
    }

    /// The live replacement failed with `e`: it gets no more I/O, the replace process
    /// stops ([`ProcessError::ReplacementFailed`]) and the member keeps its slot.
    fn fail_replacement_entry(&mut self, e: IoError) {
        let Some(entry) = self.replacement_entry() else {
            return;
        };
        self.members[usize::from(entry)].state = MemberState::Failed(e);
        let r = self.replace.as_mut().expect("a live replacement");
        r.state = ReplaceState::Failed(e);
        let member = r.member;
        self.replacement_failures += 1;
        if let Some(p) = self.proc.as_mut() {
            if p.kind == ProcessKind::Replace
                && matches!(p.state, ProcessState::Running | ProcessState::Stopped)
            {
                p.state = ProcessState::Failed(ProcessError::ReplacementFailed { member });
            }
        }
        tracing::warn!(
            shard = self.shard,
            member,
            error = %e,
            "replacement device failed: replace stopped, the member keeps its slot"
        );
    }

    /// Fails the live replacement numbered `serial` (a failure another shard saw, or the
    /// operator's); returns whether it was live here.
    pub fn fail_replacement(&mut self, serial: u64, e: IoError) -> bool {
        if self.replacement_entry().is_none() || self.replace.is_none_or(|r| r.serial != serial) {
            return false;
        }
        self.fail_replacement_entry(e);
        true
    }

    /// Whether this shard's part of replacement `serial` is done: its replace process
    /// finished and the bitmap area was written to the replacement in full. Once every
    /// shard says so, the executor calls [`Self::complete_replace`] on each.
    pub fn replace_finished(&self, serial: u64) -> bool {
        self.replacement_entry().is_some()
            && self.replace.is_some_and(|r| r.serial == serial)
            && self.proc.as_ref().is_some_and(|p| {
                p.kind == ProcessKind::Replace && p.state == ProcessState::Finished
            })
            && self
                .intent
                .as_ref()
                .is_none_or(|i| i.shared.all_written() >= self.replace_bitmap_ticket)
    }

    /// After replacement `serial` finished on every shard ([`Self::replace_finished`]):
    /// the replacement takes its member's slot and the old device leaves the array (md's
    /// `raid5_spare_active` + `raid5_remove_disk`: the replaced device is marked faulty
    /// so that it is never re-added). Requests in flight to either device complete
    /// normally. A member that had failed during the replace is whole again. Returns
    /// whether it swapped.
    pub fn complete_replace(&mut self, serial: u64) -> bool {
        if !self.replace_finished(serial) {
            return false;
        }
        let r = self.replace.expect("checked");
        let (slot, extra) = (usize::from(r.member), self.slots());
        self.members.swap(slot, extra);
        let (a, b) = (self.members[slot].id, self.members[extra].id);
        self.entry_of[usize::from(a)] = slot as u16;
        self.entry_of[usize::from(b)] = extra as u16;
        let old = std::mem::replace(
            &mut self.members[extra].state,
            MemberState::Failed(IoError::Gone),
        );
        if old.is_failed() {
            self.failed_members -= 1;
            self.note_degraded();
        }
        self.replace = Some(ReplaceInfo {
            state: ReplaceState::Done,
            ..r
        });
        tracing::info!(
            shard = self.shard,
            member = r.member,
            "replace complete: the replacement holds the member's slot"
        );
        true
    }

    /// Drops the device a replacement left behind (a failed replacement, or the replaced
    /// member) once none of its requests is in flight; returns whether it did.
    fn drop_leaving_device(&mut self) -> bool {
        let extra = self.slots();
        if self.members.len() <= extra
            || self.replacement_entry().is_some()
            || self.entry_busy(extra as u16)
        {
            return false;
        }
        let dev = self.members.pop().expect("an extra device");
        self.entry_of[usize::from(dev.id)] = NO_ENTRY;
        true
    }

    /// Issues background operations while the process, the pacer and the slots allow.
    fn issue_background(&mut self) -> bool {
        let failed = self.array_failed();
        let stripes = self.geo.stripes();
        let chunk = u64::from(self.geo.geometry().chunk_bytes());
        let Some(p) = self.proc.as_mut() else {
            return false;
        };
        if p.state != ProcessState::Running {
            return false;
        }
        let mut any = false;
        loop {
            if p.walk.peek().is_none() {
                if p.in_flight.is_empty() && p.hold.is_none() {
                    p.state = ProcessState::Finished;
                    any = true;
                    tracing::debug!(shard = self.shard, kind = %p.kind, "process finished");
                    let pos = p.position(stripes);
                    for &t in &p.targets {
                        let m = &mut self.members[usize::from(t)];
                        m.recovery_stripe = m.recovery_stripe.max(pos);
                    }
                }
                break;
            }
            if failed {
                p.state = ProcessState::Failed(ProcessError::ArrayFailed);
                any = true;
                break;
            }
            // Background operations come from their own pool (foreground's slots are
            // never taken); how fast they go is the pacer's call.
            if self.bg_sops.is_empty() || self.bg_wait || self.now < self.bg_not_before {
                break;
            }
            match self.pacer.admit(self.now, chunk, p.in_flight.len() as u32) {
                Admission::Now => {}
                Admission::NotBefore(t) => {
                    self.bg_not_before = t.max(self.now + 1);
                    break;
                }
                Admission::AfterCompletion if p.in_flight.is_empty() => {
                    self.bg_not_before = self.now + BG_RETRY_NS;
                    break;
                }
                Admission::AfterCompletion => {
                    self.bg_wait = true;
                    break;
                }
            }
            let stripe = p.walk.take().expect("peeked");
            let s = self.bg_sops.pop().expect("checked above");
            let slot = self.bg_free.pop().expect("one per background operation");
            p.in_flight.push(stripe);
            let sop = &mut self.sops[s as usize];
            sop.req = u32::MAX;
            sop.stripe = stripe;
            sop.start = 0;
            sop.end = 0;
            sop.buf_off = 0;
            sop.phase = Phase::Queued;
            sop.outstanding = 0;
            sop.io_error = false;
            sop.unsupported = false;
            sop.bad.clear();
            sop.lost.clear();
            sop.bg = Some(p.kind);
            sop.bg_slot = slot;
            sop.bg_start_ns = self.now;
            self.waiting.push_back(s);
            any = true;
        }
        any
    }

    /// Reads every surviving chunk of the stripe whole, once the operation holds it.
    fn start_bg(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let kind = self.sops[s as usize].bg.expect("background operation");
        let stripe = self.sops[s as usize].stripe;
        if self.array_failed() {
            return self.finish_bg(s, Err(ProcessError::ArrayFailed));
        }
        if let Err(e) = self.rebuild_target_left() {
            return self.finish_bg(s, Err(e));
        }
        let chunk = g.chunk_bytes();
        if kind == ProcessKind::Replace {
            let slot = self.replace.expect("a replace has a replacement").member;
            if !self.missing(s, slot) {
                // Copy: the member's chunk alone. A read error sends the operation back
                // here with the member missing for it: then the chunk is rebuilt.
                let sop = &mut self.sops[s as usize];
                sop.phase = Phase::BgRead;
                sop.io_error = false;
                sop.range = ChunkRange {
                    start: 0,
                    end: chunk,
                };
                sop.lost.clear();
                let ptr = sop.bufs[usize::from(slot)].as_mut_ptr();
                self.io(s, slot, Op::Read, 0, chunk, ptr);
                return;
            }
        }
        let mut lost: ArrayVec<u16, 2> = ArrayVec::new();
        for m in 0..g.members() {
            if self.missing(s, m) {
                if lost.try_push(m).is_err() || lost.len() > usize::from(g.parity_chunks()) {
                    return self.finish_bg(s, Err(ProcessError::Unrecoverable { stripe }));
                }
                // A scrub cannot verify a stripe with a member gone (unrecovered read
                // errors alone are rebuilt and rewritten).
                if !matches!(kind, ProcessKind::Rebuild | ProcessKind::Replace)
                    && self.members[usize::from(m)].state.is_failed()
                {
                    return self.finish_bg(s, Err(ProcessError::MemberFailed { kind, member: m }));
                }
            }
        }
        if lost.len() > usize::from(g.parity_chunks()) {
            return self.finish_bg(s, Err(ProcessError::Unrecoverable { stripe }));
        }
        let sop = &mut self.sops[s as usize];
        sop.phase = Phase::BgRead;
        sop.io_error = false;
        sop.range = ChunkRange {
            start: 0,
            end: chunk,
        };
        sop.lost = lost;
        for m in 0..g.members() {
            if !self.missing(s, m) {
                let ptr = self.sops[s as usize].bufs[usize::from(m)].as_mut_ptr();
                self.io(s, m, Op::Read, 0, chunk, ptr);
            }
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// For a rebuild: `Ok` while one of its targets is still being rebuilt, else
    /// [`ProcessError::TargetFailed`]. `Ok` for the other processes.
    fn rebuild_target_left(&self) -> Result<(), ProcessError> {
        let Some(p) = self.proc.as_ref() else {
            return Ok(());
        };
        if p.kind == ProcessKind::Replace {
            return match self.replacement_entry() {
                Some(_) => Ok(()),
                None => Err(ProcessError::ReplacementFailed {
                    member: p.targets.first().copied().unwrap_or(0),
                }),
            };
        }
        if p.kind != ProcessKind::Rebuild
            || p.targets
                .iter()
                .any(|&t| self.members[usize::from(t)].state == MemberState::Rebuilding)
        {
            return Ok(());
        }
        Err(ProcessError::TargetFailed {
            member: p.targets.first().copied().unwrap_or(0),
        })
    }

    /// After the reads: rebuilds, or computes and compares parity; issues the writes.
    fn bg_compute(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let kind = self.sops[s as usize].bg.expect("background operation");
        if kind == ProcessKind::Replace {
            return self.replace_compute(s);
        }
        let st = self.geo.stripe(self.sops[s as usize].stripe);
        let chunk = g.chunk_bytes();
        self.sops[s as usize].phase = Phase::BgWrite;
        self.sops[s as usize].io_error = false;
        let lost = self.sops[s as usize].lost.clone();
        if !lost.is_empty() {
            // Rebuild the missing chunks: the rebuild's targets, and ranges that returned
            // unrecovered read errors (rewritten so the device remaps them).
            if let Err(e) = self.rebuild_in_buffers(s) {
                let stripe = st.stripe();
                debug_assert!(matches!(e, ArrayError::Unrecoverable { .. }));
                return self.finish_bg(s, Err(ProcessError::Unrecoverable { stripe }));
            }
            if let Err(e) = self.rebuild_target_left() {
                return self.finish_bg(s, Err(e));
            }
            let targets = self
                .proc
                .as_ref()
                .map(|p| p.targets.clone())
                .unwrap_or_default();
            for m in lost {
                let state = self.members[usize::from(m)].state;
                let write = if self.sops[s as usize].bad.contains(&m) {
                    !state.is_failed()
                } else {
                    state == MemberState::Rebuilding && targets.contains(&m)
                };
                if self.sops[s as usize].bad.contains(&m) && write {
                    self.stats.read_errors_repaired += 1;
                }
                if write {
                    let ptr = self.sops[s as usize].bufs[usize::from(m)].as_mut_ptr();
                    self.io(s, m, Op::Write { fua: false }, 0, chunk, ptr);
                }
            }
        } else if kind != ProcessKind::Rebuild {
            self.scrub(s, kind);
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// A replace's stripe after its reads: the member's chunk (read, or rebuilt from the
    /// others where the member could not give it) is written to the replacement. Members
    /// that returned unrecovered read errors are rewritten (they stay in service); a
    /// rewrite of the member being replaced reaches the replacement too.
    fn replace_compute(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let stripe = self.sops[s as usize].stripe;
        let chunk = g.chunk_bytes();
        self.sops[s as usize].phase = Phase::BgWrite;
        self.sops[s as usize].io_error = false;
        let lost = self.sops[s as usize].lost.clone();
        if !lost.is_empty() && self.rebuild_in_buffers(s).is_err() {
            return self.finish_bg(s, Err(ProcessError::Unrecoverable { stripe }));
        }
        if let Err(e) = self.rebuild_target_left() {
            return self.finish_bg(s, Err(e));
        }
        let slot = self.replace.expect("a replace has a replacement").member;
        let mut mirrored = false;
        for m in lost {
            if self.sops[s as usize].bad.contains(&m) && !self.is_failed(m) {
                self.stats.read_errors_repaired += 1;
                let ptr = self.sops[s as usize].bufs[usize::from(m)].as_mut_ptr();
                self.io(s, m, Op::Write { fua: false }, 0, chunk, ptr);
                mirrored |= m == slot;
            }
        }
        if !mirrored {
            let r = self.replacement_entry().expect("checked live");
            let ptr = self.sops[s as usize].bufs[usize::from(slot)].as_mut_ptr();
            self.io_dev(s, r, Op::Write { fua: false }, 0, chunk, ptr);
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// Check / repair / resync of a stripe whose every chunk was read: computes P (and Q)
    /// from the data, counts mismatching 4 KiB slices as md does (8 sectors each), and for
    /// repair and resync writes the computed parity over the first to the last mismatching
    /// slice of each parity chunk that mismatches.
    fn scrub(&mut self, s: u32, kind: ProcessKind) {
        let g = *self.geo.geometry();
        let st = self.geo.stripe(self.sops[s as usize].stripe);
        let chunk = g.chunk_bytes() as usize;
        let page = (MD_STRIPE_PAGE_BYTES as usize).min(chunk);
        let slot = usize::from(self.sops[s as usize].bg_slot);
        let pm = usize::from(st.p_member());
        let qm = st.q_member().map(usize::from);
        let mut p_bad: Option<(usize, usize)> = None;
        let mut q_bad: Option<(usize, usize)> = None;
        let mut mismatched_pages = 0u64;
        {
            let sop = &self.sops[s as usize];
            let mut data: ArrayVec<&[u8], MAX_DATA_CHUNKS> = ArrayVec::new();
            for _ in 0..g.data_chunks() {
                data.push(&[]);
            }
            for (m, b) in sop.bufs.iter().enumerate() {
                if let Role::Data { slot, .. } = st.role(m as u16) {
                    data[usize::from(slot)] = &b[..chunk];
                }
            }
            let (lo, hi) = self.bg_scratch.split_at_mut(2 * slot + 1);
            let (sp, sq) = (&mut lo[2 * slot][..chunk], &mut hi[0][..chunk]);
            match qm {
                Some(_) => self.parity.gen_pq(&data, sp, sq),
                None => self.parity.gen_p(&data, sp),
            }
            let widen = |r: &mut Option<(usize, usize)>, i: usize| {
                *r = Some(r.map_or((i, i), |(a, _)| (a, i)));
            };
            for i in 0..chunk.div_ceil(page) {
                let at = i * page..((i + 1) * page).min(chunk);
                let p_mis = sop.bufs[pm][at.clone()] != sp[at.clone()];
                let q_mis = qm.is_some_and(|q| sop.bufs[q][at.clone()] != sq[at.clone()]);
                if p_mis {
                    widen(&mut p_bad, i);
                }
                if q_mis {
                    widen(&mut q_bad, i);
                }
                mismatched_pages += u64::from(p_mis || q_mis);
            }
        }
        let sectors_per_page = page as u64 / SECTOR_BYTES;
        if let Some(p) = self.proc.as_mut() {
            p.mismatch_cnt += mismatched_pages * sectors_per_page;
        }
        if mismatched_pages > 0 {
            tracing::debug!(
                shard = self.shard,
                stripe = st.stripe(),
                pages = mismatched_pages,
                %kind,
                "parity mismatch"
            );
        }
        if !kind.rewrites_parity() {
            return;
        }
        for (m, bad, sc) in [(Some(pm), p_bad, 2 * slot), (qm, q_bad, 2 * slot + 1)] {
            let (Some(m), Some((a, b))) = (m, bad) else {
                continue;
            };
            let from = a * page;
            let to = ((b + 1) * page).min(chunk);
            let ptr = self.bg_scratch[sc].as_mut_ptr().wrapping_add(from);
            self.io(
                s,
                m as u16,
                Op::Write { fua: false },
                from as u32,
                (to - from) as u32,
                ptr,
            );
        }
    }

    /// Ends background operation `s`: frees its stripe and slots, accounts it, and moves
    /// the process (position, targets' recovery positions, end states).
    fn finish_bg(&mut self, s: u32, status: Result<(), ProcessError>) {
        let stripes = self.geo.stripes();
        let chunk = u64::from(self.geo.geometry().chunk_bytes());
        let sop = &mut self.sops[s as usize];
        debug_assert_eq!(sop.outstanding, 0);
        let stripe = sop.stripe;
        let slot = sop.bg_slot;
        let latency = self.now.saturating_sub(sop.bg_start_ns);
        sop.bg = None;
        self.locked.release(s);
        self.bg_sops.push(s);
        self.bg_free.push(slot);
        self.bg_wait = false;
        self.pacer.background_done(self.now, latency, chunk);
        let p = self
            .proc
            .as_mut()
            .expect("a background operation belongs to a process");
        let i = p
            .in_flight
            .iter()
            .position(|&x| x == stripe)
            .expect("in flight");
        p.in_flight.swap_remove(i);
        match status {
            Ok(()) => p.done += 1,
            Err(e) => {
                p.hold = Some(p.hold.map_or(stripe, |h| h.min(stripe)));
                if matches!(p.state, ProcessState::Running | ProcessState::Stopped) {
                    tracing::warn!(shard = self.shard, kind = %p.kind, stripe, error = %e, "process failed");
                    p.state = ProcessState::Failed(e);
                }
            }
        }
        if p.kind == ProcessKind::Rebuild {
            if p.state == ProcessState::Running
                && p.targets
                    .iter()
                    .all(|&t| self.members[usize::from(t)].state != MemberState::Rebuilding)
            {
                let member = p.targets[0];
                tracing::warn!(
                    shard = self.shard,
                    member,
                    "rebuild target failed: rebuild stopped"
                );
                p.state = ProcessState::Failed(ProcessError::TargetFailed { member });
            }
            let pos = p.position(stripes);
            for &t in &p.targets {
                let m = &mut self.members[usize::from(t)];
                if m.state == MemberState::Rebuilding {
                    m.recovery_stripe = m.recovery_stripe.max(pos);
                }
            }
        }
    }
}

mod locks;

#[cfg(test)]
mod bitmap_tests;
#[cfg(test)]
mod tests;
