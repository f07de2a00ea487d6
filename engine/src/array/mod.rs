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
//! A read of healthy members goes straight into the caller's buffer; one inside a single
//! chunk, with nothing it must not overtake queued ahead of it, needs no stripe operation
//! at all (`read.rs`, "the fast path"). If a member of the
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
//!
//! # Where things are
//! Following the life of a stripe operation:
//! - `mod.rs` (here): the public types, the array's state, construction, accessors,
//!   [`Array::submit`] and validation, [`Array::process`] / [`Array::poll`], and `advance`,
//!   the phase dispatcher that moves an operation on when its member I/O is done.
//! - `ops.rs`: request and operation lifecycle: splitting requests into stripe operations,
//!   stripe ordering and the gate, starting, moving and finishing operations and requests,
//!   flushes.
//! - `read.rs`: direct reads of healthy members, the fast path (single-chunk reads without
//!   a stripe operation), and reads served from a write pass.
//! - `degraded.rs`: degraded reads, rebuilding lost data from parity.
//! - `write.rs`: writes and parity generation; write-zeroes and discard.
//! - `bitmap.rs`: the write-intent bitmap.
//! - `io.rs`: member I/O: issuing, pumping and reaping member requests, timeouts.
//! - `members.rs`: failing members, re-adding and rebuilding them, replacement devices.
//! - `background.rs`: background processes (rebuild, resync, check/repair, replace) and
//!   shard, gate and pacer setup.
//! - `locks.rs`: the per-stripe operation locks.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arrayvec::ArrayVec;
use thiserror::Error;

use crate::bitmap::{BitmapOwner, BitmapWrite, WriteIntent};
use crate::buf::AlignedBuf;
use crate::device::{Channel, Completion, IoBuf, IoError};
use crate::geometry::{ArrayGeometry, StripeLayout, MAX_RAID6_MEMBERS};
use crate::parity::Parity;
use crate::process::{ProcessKind, ProcessState, ShardWalk, MAX_BACKGROUND_OPS};
use crate::qos::dispatch::MemberQueue;
use crate::qos::share::{BulkShare, BulkShareState};
#[cfg(doc)]
use crate::qos::Admission;
use crate::qos::{DepthConfig, IoClass, QosState};
use crate::qos::{Pacer, Unpaced};
use crate::shard::{owner, StripeGate};
use crate::stripe::{ChunkRange, StripeWrite, WriteMode};
use crate::zero_map::ZeroMap;
use cache::StripeCache;
use locks::StripeLocks;

pub use members::device_fits;

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
    /// Atomic compare-and-write of `len_bytes` at `offset_bytes` (SBC-4 §5.3 COMPARE AND
    /// WRITE). The buffer is `2 × len_bytes` long: the verify data (`len_bytes`) followed
    /// by the write data (`len_bytes`). The range must lie inside one stripe (else
    /// [`ArrayError::Invalid`]). The stripe's owner holds the stripe exclusively from the
    /// read of the old data through the compare to the end of the write, so no other write
    /// of that stripe runs in between. If the old data differs from the verify data the
    /// request completes with [`ArrayError::Miscompare`] (the first differing byte) and
    /// writes nothing. With `fua`, the write is durable on every member it touched before
    /// completion.
    CompareAndWrite {
        /// Force unit access.
        fua: bool,
    },
    /// OR-write of `len_bytes` at `offset_bytes` (SBC-4 §5.9 ORWRITE): the range becomes
    /// its old contents OR the buffer (`len_bytes`). Each stripe piece reads, combines and
    /// writes under an exclusive hold of its stripe (atomic per stripe, not across
    /// stripes). The engine combines **in place**: on completion the buffer holds what
    /// was written (on a failure its contents are unspecified). With `fua`, durable on
    /// every member it touched before completion.
    OrWrite {
        /// Force unit access.
        fua: bool,
    },
}

impl ArrayOp {
    /// Whether the request moves data through its buffer (read, write, compare-and-write,
    /// OR-write).
    #[inline]
    pub fn has_buffer(self) -> bool {
        matches!(
            self,
            ArrayOp::Read
                | ArrayOp::Write { .. }
                | ArrayOp::CompareAndWrite { .. }
                | ArrayOp::OrWrite { .. }
        )
    }

    /// Whether the request is a read.
    #[inline]
    pub fn is_read(self) -> bool {
        matches!(self, ArrayOp::Read)
    }

    /// Whether the request is a flush.
    #[inline]
    pub fn is_flush(self) -> bool {
        matches!(self, ArrayOp::Flush)
    }

    /// Whether the request changes the array's contents (write, write-zeroes, discard,
    /// compare-and-write, OR-write).
    #[inline]
    pub fn is_write(self) -> bool {
        matches!(
            self,
            ArrayOp::Write { .. }
                | ArrayOp::WriteZeroes { .. }
                | ArrayOp::Discard
                | ArrayOp::CompareAndWrite { .. }
                | ArrayOp::OrWrite { .. }
        )
    }

    /// Bytes of buffer a request of this op over `len_bytes` carries: twice the range for
    /// [`ArrayOp::CompareAndWrite`] (verify data, then write data), the range for the
    /// other ops with a buffer, none otherwise.
    pub fn buf_len(self, len_bytes: u32) -> u64 {
        match self {
            ArrayOp::CompareAndWrite { .. } => 2 * u64::from(len_bytes),
            op if op.has_buffer() => u64::from(len_bytes),
            _ => 0,
        }
    }

    /// Whether the op reads the old contents and combines them under the stripe's
    /// exclusive hold before writing (compare-and-write, OR-write).
    pub fn combines(self) -> bool {
        matches!(
            self,
            ArrayOp::CompareAndWrite { .. } | ArrayOp::OrWrite { .. }
        )
    }

    fn fua(self) -> bool {
        matches!(
            self,
            ArrayOp::Write { fua: true }
                | ArrayOp::WriteZeroes { fua: true }
                | ArrayOp::CompareAndWrite { fua: true }
                | ArrayOp::OrWrite { fua: true }
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

impl ArrayRequest {
    /// A flush with tag `tag`: completes once every write completed before it was
    /// submitted is durable on the members (NBD proto.md `NBD_CMD_FLUSH`).
    pub fn flush(tag: u64) -> Self {
        Self {
            tag,
            op: ArrayOp::Flush,
            offset_bytes: 0,
            len_bytes: 0,
            buf: IoBuf::NONE,
        }
    }
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
    /// A [`ArrayOp::CompareAndWrite`] found data different from its verify data: nothing
    /// was written.
    #[error("compare-and-write miscompare at byte {offset}")]
    Miscompare {
        /// Offset of the first differing byte from the start of the request's range,
        /// bytes.
        offset: u32,
    },
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
    /// Stripe reads served straight from the members (fast-path reads included).
    pub direct_reads: u64,
    /// Reads issued at submission as one member read, without a stripe operation
    /// ([`Array::submit`]'s fast path: a read inside one chunk of an online member, with no
    /// write or flush queued ahead of it, no operation waiting for its stripe and no write
    /// holding it).
    pub fast_reads: u64,
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
    /// Write passes issued on healthy stripes ([`crate::array`] module docs, "Writes"):
    /// each one plan, one parity computation, one set of member I/Os.
    pub write_passes: u64,
    /// Stripe writes (pieces of client writes and write-zeroes) those passes served:
    /// `batched_writes / write_passes` is the batching factor.
    pub batched_writes: u64,
    /// Member bytes the passes read before writing (RMW/RCW pre-reads; what the stripe
    /// cache held is not read).
    pub write_read_bytes: u64,
    /// Client bytes the passes wrote (write-zeroes count their range):
    /// `write_read_bytes / pass_written_bytes` is the member bytes read per client byte
    /// written.
    pub pass_written_bytes: u64,
    /// Passes that found their stripe in the cache with valid blocks.
    pub cache_hit_stripes: u64,
    /// Member bytes the passes would have read without the stripe cache.
    pub cache_hit_bytes: u64,
    /// Random sub-stripe writes admitted to the stripe cache: they came back to a stripe
    /// written around the cache lately and ran as a pass through it
    /// (`StripeCache::bypassed_lately`), so their stripe stays cached.
    pub cache_admitted_writes: u64,
    /// Reads served from the stripe cache: every block they asked for was valid in their
    /// stripe's entry, so no member was read (`array/read.rs`, `Array::cache_read`). Not
    /// counted in `direct_reads` or `fast_reads`.
    pub cache_reads: u64,
    /// Data chunks the passes wrote gathered from several writes' buffers, one member
    /// request each, nothing copied into the stripe cache (a stream of small writes that
    /// moves on; `array/pass.rs`, `Gathered`).
    pub gathered_writes: u64,
    /// PPL records written (each made durable before the writes it describes).
    pub ppl_records: u64,
    /// Bytes of those records: 4 KiB headers and partial parity.
    pub ppl_bytes: u64,
    /// Passes held for more writes before reading (coalescing).
    pub held_passes: u64,
    /// Total time passes were held, ns (array clock).
    pub held_ns: u64,
    /// Requests that took a stripe operation ahead of earlier bulk writes waiting for
    /// their share of the pool (front-door scheduling, [`RequestClass`]).
    pub overtaking_requests: u64,
    /// Stripe reads of a stripe a write pass held, served from the pass's own new data and
    /// its cache entry instead of waiting for the pass's member writes
    /// ([`Array::read_from_pass`]).
    pub pass_reads: u64,
    /// Holds that reached their bound still needing reads (the writes
    /// waited for did not come; each lowers the shard's remembered client write depth).
    pub expired_holds: u64,
    /// Stripe operations bulk writes may hold now ([`crate::qos::share`], the bulk
    /// share): a gauge, summed over shards when merged.
    pub bulk_share_ops: u64,
    /// The shards' stripe operations (the pool the share is of): a gauge, summed.
    pub bulk_share_pool: u64,
    /// Cuts of the bulk share (small reads slower than allowed).
    pub bulk_share_cuts: u64,
    /// Raises of the bulk share (probes, and returns towards the pool).
    pub bulk_share_raises: u64,
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

/// One class's queue waits, ns ([`Array::queue_wait`]). A request that issues its first
/// member request in the loop turn that accepted it waited 0 ns by the array's clock
/// (read once per turn): on a lightly loaded array that is nearly every request, so those
/// are counted here and added to the histogram (as 1 ns, the histogram's floor) only when
/// it is read — a counter costs a fraction of a histogram record on the per-request path.
struct QueueWait {
    /// The waits over 0 ns, ns.
    hist: hdrhistogram::Histogram<u64>,
    /// How many waits were 0 ns.
    same_turn: u64,
}

impl QueueWait {
    fn new() -> Self {
        QueueWait {
            hist: new_latency_histogram(),
            same_turn: 0,
        }
    }

    /// Records one wait of `wait_ns` (saturates at the histogram's top, one hour; never
    /// allocates).
    #[inline]
    fn record(&mut self, wait_ns: u64) {
        if wait_ns == 0 {
            self.same_turn += 1;
        } else {
            self.record_waited(wait_ns);
        }
    }

    /// [`Self::record`]'s histogram path, out of line: a fast-path read never waits, and
    /// the histogram's code inlined at every call kept `record` a call.
    #[inline(never)]
    fn record_waited(&mut self, wait_ns: u64) {
        self.hist.saturating_record(wait_ns);
    }

    /// Resets `out` and adds every wait to it, the 0 ns ones as 1 ns.
    fn fill(&self, out: &mut hdrhistogram::Histogram<u64>) {
        out.reset();
        // Same bounds (both from `new_latency_histogram`): cannot fail or allocate.
        let _ = out.add(&self.hist);
        out.saturating_record_n(1, self.same_turn);
    }
}

/// The classes of client requests for front-door scheduling (issue 24, docs/PACING.md, "Front door"),
/// decided from what the shard sees of each request: its op, its size and whether it
/// continues a sequential stream of writes — never from client hints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestClass {
    /// A read of at most [`BULK_MIN_BYTES`]: what latency-sensitive clients wait on.
    SmallRead,
    /// A write (or write-zeroes, discard) of at least [`BULK_MIN_BYTES`], or one that
    /// continues a sequential stream of writes: throughput work that can wait.
    BulkWrite,
    /// Everything else: large reads, small random writes, flushes.
    Other,
}

impl RequestClass {
    /// Every class, in the order of [`Array::queue_wait`]'s index.
    pub const ALL: [RequestClass; 3] = [Self::SmallRead, Self::BulkWrite, Self::Other];

    /// The class's index in [`Self::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The class's name in status output (`small_read`, `bulk_write`, `other`).
    pub fn name(self) -> &'static str {
        match self {
            Self::SmallRead => "small_read",
            Self::BulkWrite => "bulk_write",
            Self::Other => "other",
        }
    }

    /// Whether a request that changes the array when `writes` (a write, write-zeroes,
    /// discard, compare-and-write, OR-write), of `len_bytes` bytes, is a bulk write by its
    /// size alone (at least [`BULK_MIN_BYTES`]): [`RequestClass::BulkWrite`] whatever the
    /// stream it belongs to. The reactors' turn hold counts every other request
    /// (`reactor::waits_on_turns`), as they see no streams.
    #[inline]
    pub fn bulk_sized_write(writes: bool, len_bytes: u64) -> bool {
        writes && len_bytes >= BULK_MIN_BYTES
    }

    /// The class of a request of `op` over `len_bytes` bytes; `sequential`: it starts
    /// where one of the shard's recent write requests ended.
    pub fn of(op: ArrayOp, len_bytes: u64, sequential: bool) -> Self {
        if op.is_read() && len_bytes <= BULK_MIN_BYTES {
            Self::SmallRead
        } else if Self::bulk_sized_write(op.is_write(), len_bytes) || (op.is_write() && sequential)
        {
            Self::BulkWrite
        } else {
            Self::Other
        }
    }
}

/// Requests of at least this many bytes are bulk ([`RequestClass`]): 128 KiB, the
/// largest request Linux's default `max_sectors_kb` lets a single small I/O grow to and
/// two 64 KiB chunks — a read this size still costs one or two member reads.
pub const BULK_MIN_BYTES: u64 = 128 << 10;

/// Bytes of bulk-write stripe operations (client bytes of their stripes' ranges) one
/// [`Array::process`] call admits; the first operation of a call is always admitted, so
/// bulk work never starves and a stripe wider than this still moves one per call. Each
/// admitted bulk operation is a copy of its data and a parity computation done in that
/// call (RAID6 parity runs at ~20 GB/s on the bench machine, docs/BENCHMARKS.md: ~13 µs
/// per 256 KiB, plus the copy of the data into the stripe), so this bounds the
/// parity and copy work a reactor turn does ahead of a small read that arrives meanwhile.
/// 256 KiB: the NBD and iSCSI front ends' receive budget per turn
/// (`PAYLOAD_BYTES_PER_TURN`, docs/PACING.md), so admission keeps pace with what a turn
/// receives. The bound holds while there is something to protect: for
/// [`TURN_BOUND_HOLD_NS`] after a request that is not a bulk write.
pub const BULK_BYTES_PER_TURN: u64 = 256 << 10;

/// How long the per-turn bulk bound ([`BULK_BYTES_PER_TURN`]) holds after the shard
/// accepted a request other than a bulk write ([`RequestClass`]: a small read, a write
/// under [`BULK_MIN_BYTES`] that continues no stream, a large read; not a flush), or
/// after its executor saw one elsewhere ([`Array::set_turn_bound_held`]; the reactors
/// count every read and every write under [`BULK_MIN_BYTES`], stream or not), ns: 1 s.
/// With none within it, a turn admits as many bulk operations as the bulk share allows:
/// the bound's fixed cost per turn (~0.5 µs per 256 KiB stripe, docs/BENCHMARKS.md) then
/// buys nothing, and the first small request after the quiet spell waits for at most one
/// such loop pass on each reactor thread it passes through before the bound is back
/// (from the turn that notes it: the reactors note a request when the front end parses
/// it, `reactor::Io::note_arrival`). A second, not the bulk share's 10 ms window, so
/// that a reader that comes back every few hundred ms still finds every turn bounded. Linux's
/// writeback throttling likewise lets writes deepen past its default while only writes
/// are seen (`block/blk-wbt.c`: with writes and no read samples, the window's verdict
/// scales up, and the scaling step may go negative).
pub const TURN_BOUND_HOLD_NS: u64 = 1_000_000_000;

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
    /// Stripe cache entries per shard ([`crate::array`] "Writes"): each caches one chunk
    /// per member of a recently written stripe, so memory is `entries × members × chunk`
    /// bytes, allocated at construction. The cache always has at least `stripe_ops`
    /// entries (every running pass uses one as its working set); 0 keeps nothing between
    /// passes. md's `stripe_cache_size` counts 4 KiB rows per member (default 256); this
    /// counts whole chunk-stripes.
    pub stripe_cache_entries: usize,
    /// Most stripe writes one pass serves (1: no batching).
    pub write_batch: u32,
    /// Shortest bound of the hold of a pass that would pre-read, ns (0: never held): the
    /// bound is 3 × the shard's measured write latency, at least this and at most 10 ms
    /// (or this, if higher). Held only while the clients can still send more writes (see
    /// [`pass`]), never with FUA or behind a flush.
    pub write_hold_ns: u64,
    /// Share of `stripe_ops` that bulk writes ([`RequestClass::BulkWrite`]) may hold:
    /// `None` (the default) adapts it to the latency small reads see
    /// ([`crate::qos::share`], docs/PACING.md, "Front door"); `Some(p)` pins it at `p`
    /// percent of the pool (1..=100, at least one operation; 100: no reserve for other
    /// requests) — for tests and comparisons.
    pub bulk_share_percent: Option<usize>,
    /// Bytes of bulk-write stripe operations one [`Array::process`] call admits (the first
    /// of a call always) while the bound holds ([`TURN_BOUND_HOLD_NS`] after a request
    /// that is not a bulk write): default [`BULK_BYTES_PER_TURN`]; `u64::MAX` removes it
    /// (comparisons, and simulator tests of the bulk share alone: in virtual time a turn
    /// costs nothing, so the bound only changes which requests of one instant go first).
    pub bulk_bytes_per_turn: u64,
}

/// Default background operations in flight per shard: four chunk-wide stripe operations
/// keep every member busy with large sequential requests while leaving the depth to
/// foreground (md's raid5 resync likewise keeps a handful of stripes in flight).
pub const DEFAULT_BACKGROUND_OPS: usize = 4;

/// Default stripe cache entries per shard: 64 chunk-stripes (with 64 KiB chunks, 4 MiB
/// per member), twice the default stripe operations, so that a sequential writer's last
/// stripes and a re-writer's working set stay cached. md's default (256 rows of 4 KiB
/// per member, `NR_STRIPES`) is 1 MiB per member.
pub const DEFAULT_STRIPE_CACHE_ENTRIES: usize = 64;

/// Default most stripe writes per pass: every stripe operation of a default pool could
/// join one pass; the bound keeps one pass's copy and parity work per loop turn finite.
pub const DEFAULT_WRITE_BATCH: u32 = 256;

/// Default shortest hold bound of a pass that would pre-read: 200 µs, what a network
/// client needs to deliver the rest of a stripe's 64 KiB writes (see docs/BENCHMARKS.md,
/// "Write passes", for the measurements that chose it). The bound grows with the measured
/// write latency; the hold also ends as soon as the clients have every write they can send
/// in flight (see [`pass`]).
pub const DEFAULT_WRITE_HOLD_NS: u64 = 200_000;

/// Default command timeout: 30 s, the Linux block layer's and NVMe driver's default.
pub const DEFAULT_IO_TIMEOUT_NS: u64 = 30_000_000_000;

impl ArrayStats {
    /// Adds `o` into `self` (merging shards).
    pub fn add(&mut self, o: &ArrayStats) {
        self.direct_reads += o.direct_reads;
        self.fast_reads += o.fast_reads;
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
        self.write_passes += o.write_passes;
        self.batched_writes += o.batched_writes;
        self.write_read_bytes += o.write_read_bytes;
        self.pass_written_bytes += o.pass_written_bytes;
        self.cache_hit_stripes += o.cache_hit_stripes;
        self.cache_hit_bytes += o.cache_hit_bytes;
        self.cache_admitted_writes += o.cache_admitted_writes;
        self.cache_reads += o.cache_reads;
        self.gathered_writes += o.gathered_writes;
        self.ppl_records += o.ppl_records;
        self.ppl_bytes += o.ppl_bytes;
        self.held_passes += o.held_passes;
        self.held_ns += o.held_ns;
        self.expired_holds += o.expired_holds;
        self.overtaking_requests += o.overtaking_requests;
        self.pass_reads += o.pass_reads;
        self.bulk_share_ops += o.bulk_share_ops;
        self.bulk_share_pool += o.bulk_share_pool;
        self.bulk_share_cuts += o.bulk_share_cuts;
        self.bulk_share_raises += o.bulk_share_raises;
    }
}

impl ArrayConfig {
    /// The state each of an array's `members` starts in under this configuration, as
    /// [`Array::new`] sets it: failed for `failed_members` (as [`Array::fail_member`]
    /// with [`IoError::Gone`]), being rebuilt for `rebuilding`, online otherwise. Entries
    /// `Array::new` would refuse (out of range, or both failed and being rebuilt) count
    /// as failed, the worse state. What an executor reports before its shards have
    /// reported anything: reporting such a member online would let a caller record it in
    /// sync.
    pub fn initial_member_states(&self, members: u16) -> Vec<MemberState> {
        let mut out = vec![MemberState::Online; usize::from(members)];
        for (m, _) in self.rebuilding.into_iter().flatten() {
            if let Some(s) = out.get_mut(usize::from(m)) {
                *s = MemberState::Rebuilding;
            }
        }
        for m in self.failed_members.into_iter().flatten() {
            if let Some(s) = out.get_mut(usize::from(m)) {
                *s = MemberState::Failed(IoError::Gone);
            }
        }
        out
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
            stripe_cache_entries: DEFAULT_STRIPE_CACHE_ENTRIES,
            write_batch: DEFAULT_WRITE_BATCH,
            write_hold_ns: DEFAULT_WRITE_HOLD_NS,
            bulk_share_percent: None,
            bulk_bytes_per_turn: BULK_BYTES_PER_TURN,
        }
    }
}

/// Member-tag layout: stripe operation index in the high bits, the device id
/// ([`Member::id`]) in the low 16.
const MEMBER_BITS: u32 = 16;
const _: () = assert!((MAX_RAID6_MEMBERS as u64 + 1) < (1 << MEMBER_BITS));
/// `entry_of` value of a device id no entry holds.
const NO_ENTRY: u16 = u16::MAX;
/// [`ReqCtx::fast_dev`] of a request that is not a fast-path read in flight.
const NO_FAST_DEV: u16 = u16::MAX;

/// The operation indices member tags carry, for `total_sops` stripe operations, `slots`
/// members and `requests` requests: the stripe operations (`0..total_sops`), the bitmap
/// owner's batch (`total_sops`), one Partial Parity Log per member (the next `slots`), and
/// one fast-path read per request (the last `requests`).
fn tag_ops(total_sops: usize, slots: usize, requests: usize) -> usize {
    total_sops + 1 + slots + requests
}

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
    /// Only in a reactor snapshot ([`crate::reactor::ArraySnapshot::replacement`]): every
    /// shard has copied the member onto the replacement, and the swap waits for
    /// [`crate::reactor::ReactorHandle::complete_replace`]
    /// ([`crate::reactor::Extras::confirm_replace`]). Until then it is [`Self::Copying`]
    /// in effect: every write to the member still reaches both devices, reads the member.
    Copied,
}

impl ReplaceState {
    /// Whether the replacement is still live beside its member ([`Self::Copying`] or
    /// [`Self::Copied`]): written with it, not yet in its slot.
    #[must_use]
    pub fn is_live(self) -> bool {
        matches!(self, Self::Copying | Self::Copied)
    }
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
    /// A write of this shard to the device completed since this shard last sent it a
    /// flush (or none was sent yet): a client flush flushes only such devices, since a
    /// flush need only make durable what completed before it (NBD proto.md "Ordering of
    /// messages and writes"; NVMe base spec 2.0 §7.1 Flush covers the volatile write
    /// cache as a whole).
    unflushed: bool,
    /// Flushes this shard sent the device that have not completed. A flush arriving
    /// meanwhile sends its own: the one in flight was sent before `unflushed` was last
    /// cleared, and answering the new flush without waiting for a device flush sent after
    /// its writes completed would acknowledge them before they are durable.
    flushing: u16,
    /// Completion latency of this shard's requests to the member, ns, measured from the
    /// start of the issuing phase to the loop turn that reaped it.
    latency: crate::latency::LatencyHistogram,
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
    /// `total_sops` stripe operations of `chunk`-byte chunks and `tag_ops` operation
    /// indices in tags ([`tag_ops`]).
    fn new(
        ch: C,
        id: u16,
        cfg: &ArrayConfig,
        total_sops: usize,
        tag_ops: usize,
        chunk: usize,
    ) -> Self {
        let i = ch.info();
        let max_transfer = i.max_transfer_bytes / i.block_bytes * i.block_bytes;
        let queue_depth = i.queue_depth;
        Member {
            ch,
            state: MemberState::Online,
            // A chunk split at the largest transfer: room for every piece of every
            // operation (foreground, background, the bitmap owner's batch), in any one
            // class, and for every request's fast-path read and every log's record.
            queue: MemberQueue::new(
                cfg.depth,
                queue_depth,
                (total_sops + 1) * (chunk / max_transfer as usize + 1) + tag_ops - (total_sops + 1),
                tag_ops,
                MEMBER_BITS,
            ),
            max_transfer,
            counters: MemberCounters::default(),
            unflushed: true,
            flushing: 0,
            latency: crate::latency::LatencyHistogram::new(),
            recovery_stripe: 0,
            bitmap_recovery: false,
            id,
        }
    }
}

#[derive(Clone, Copy)]
struct ReqCtx {
    /// The slot holds a request (accepted, not yet finished); a free slot keeps its last
    /// request's fields ([`ReqSlots`]).
    live: bool,
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
    /// The shard's flush count when it accepted the request (`Array::flushes`): a write
    /// pass is not held once a flush arrived after any of its writes ([`pass`]).
    flushes_before: u64,
    /// Whether the pacer was told of the request (reads and writes, not flushes).
    paced: bool,
    /// A write that starts where one of the shard's last write requests ended: it
    /// continues a sequential stream ([`pass`]: only such writes are held to coalesce).
    sequential: bool,
    /// A write's stream length through its last byte, bytes: the stream it continues
    /// plus its own length (its own length when it continues none); 0 for other
    /// requests. While the stripe cache is cautious only a stream longer than the cache
    /// recycles the stripes it leaves ([`pass`], `recycle_first`).
    stream_bytes: u64,
    /// Its class ([`RequestClass`]).
    class: RequestClass,
    /// Its first member request was issued (its queue wait is recorded).
    issued: bool,
    /// Device time of its slowest member request so far, ns.
    device_ns: u64,
    /// It waited for an earlier request's data (overlap in the backlog, or its stripe
    /// held): its latency is not the bulk share's signal ([`crate::qos::share`]).
    ordered: bool,
    /// A read served from the stripe cache (`read.rs`, [`Array::cache_read`]): no member
    /// I/O, so its latency is no sample for the pacer or the bulk share.
    from_cache: bool,
    /// The device id of its one member read while it is a fast-path read in flight
    /// (`read.rs`, [`Array::submit`]); [`NO_FAST_DEV`] otherwise.
    fast_dev: u16,
    /// When that member read was issued (or last timed out, as a stripe operation's
    /// `issued_ns`), ns (array clock).
    fast_ns: u64,
    /// It holds the stripe gate for a fast-path read of a stripe another shard owns
    /// (counted in `fast_foreign_reads`).
    fast_foreign: bool,
    /// Its fast-path read failed and it waits in the backlog for a stripe operation to run
    /// it again, still holding the read's stripe hold (and gate hold): the operation takes
    /// them over, so nothing that arrived after the read runs on its stripe first.
    retry_held: bool,
    /// A member (slot) that returned an unrecovered read error to its fast-path read: the
    /// stripe operation that runs it again does without it and rewrites the range
    /// ([`NO_ENTRY`]: none).
    retry_bad: u16,
}

impl ReqCtx {
    /// A slot that never held a request.
    const FREE: ReqCtx = ReqCtx {
        live: false,
        tag: 0,
        op: ArrayOp::Read,
        buf: IoBuf::NONE,
        offset: 0,
        len: 0,
        split: 0,
        pending: 0,
        error: None,
        submit_ns: 0,
        flushes_before: 0,
        paced: false,
        sequential: false,
        stream_bytes: 0,
        class: RequestClass::Other,
        issued: false,
        device_ns: 0,
        ordered: false,
        from_cache: false,
        fast_dev: NO_FAST_DEV,
        fast_ns: 0,
        fast_foreign: false,
        retry_held: false,
        retry_bad: NO_ENTRY,
    };
}

/// The shard's request slots: one [`ReqCtx`] per request it can hold, indexed by the
/// request index (`ri`, the index [`Array::accept`] takes from `free_reqs`). A context
/// stays in its slot for the shard's life and is never moved in or out whole: a free
/// slot is marked not live, and [`Array::accept`] sets every field of the one it takes
/// (a whole 144-byte context written per request, as `Option::insert` did, is a
/// `memcpy` call, ~5 ns of a ~100 ns read over `null` members).
struct ReqSlots(Vec<ReqCtx>);

impl ReqSlots {
    /// `n` free slots.
    fn new(n: usize) -> Self {
        Self(vec![ReqCtx::FREE; n])
    }

    /// Slots, free or live.
    fn len(&self) -> usize {
        self.0.len()
    }

    /// Request `ri`, if its slot is live.
    ///
    /// # Panics
    /// `ri` out of range (request indexes come from `free_reqs`, which holds only slots').
    #[inline]
    fn get(&self, ri: u32) -> Option<&ReqCtx> {
        let r = &self.0[ri as usize];
        r.live.then_some(r)
    }

    /// Request `ri`, if its slot is live, for changes.
    ///
    /// # Panics
    /// As [`Self::get`].
    #[inline]
    fn get_mut(&mut self, ri: u32) -> Option<&mut ReqCtx> {
        let r = &mut self.0[ri as usize];
        if r.live {
            Some(r)
        } else {
            None
        }
    }

    /// The live requests, in slot order.
    fn live(&self) -> impl Iterator<Item = &ReqCtx> {
        self.0.iter().filter(|r| r.live)
    }

    /// Frees slot `ri`, returning its request's fields as they were (marked not live;
    /// `None`: it was free).
    ///
    /// # Panics
    /// As [`Self::get`].
    #[inline]
    fn take(&mut self, ri: u32) -> Option<ReqCtx> {
        let r = &mut self.0[ri as usize];
        if !r.live {
            return None;
        }
        r.live = false;
        Some(*r)
    }

    /// Free slot `ri`, taken for a request: the caller sets every field (and `live`).
    ///
    /// # Panics
    /// As [`Self::get`]; in debug builds, a live slot.
    #[inline]
    fn claim(&mut self, ri: u32) -> &mut ReqCtx {
        let r = &mut self.0[ri as usize];
        debug_assert!(!r.live, "request slot {ri} taken twice");
        r
    }
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
    /// A FUA write-zeroes whose native zeroing has completed: flushing the members with a
    /// volatile write cache (member write-zeroes carry no FUA bit) before it completes.
    ZeroFlush,
    /// A background operation reading every surviving chunk of its stripe whole.
    BgRead,
    /// A background operation writing rebuilt chunks or corrected parity.
    BgWrite,
    /// A write waiting for its write-intent bits to be durable (no I/O outstanding).
    BitmapWait,
    /// An owner's write waiting for foreign reads of its stripe to finish (no I/O
    /// outstanding; [`crate::shard::StripeGate`]).
    GateWait,
    /// A write that joined another operation's pass ([`pass`]): it issues nothing and
    /// completes with the pass.
    Batched,
    /// A pass held for more writes to its stripe (no I/O outstanding).
    PassHeld,
    /// A pass reading what it lacks into its cache entry.
    PassRead(WriteMode),
    /// A pass writing its data and parity.
    PassWrite,
    /// A compare-and-write or OR-write reading the old data of its range into its
    /// buffers, holding its stripe exclusively (`write.rs`, "combining writes").
    CombineRead,
    /// The same, reading the survivors of a degraded stripe to rebuild the old data.
    CombineDegradedRead,
    /// A write whose parity is computed (or a native zeroing of a whole stripe), waiting
    /// for its Partial Parity Log record to be durable (no I/O outstanding; [`ppl`]).
    PplWait(ppl::Logged),
}

struct Sop {
    req: u32,
    stripe: u64,
    /// The member roles of `stripe` (`ArrayGeometry::stripe`), set with it: the per-request
    /// path reads them several times per operation.
    layout: StripeLayout,
    /// The footprint of `start..end` in the stripe ([`StripeWrite::from_range`]), set with
    /// them (client operations; a background operation has no range).
    fp: StripeWrite,
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
    /// The current phase's member I/O counts in `write_ops_in_io` (a client write).
    write_in_io: bool,
    /// A member refused a write-zeroes/discard of a `Zeroing` phase as unsupported.
    unsupported: bool,
    /// A background stripe operation of this kind (it has no request: `req` is unused).
    bg: Option<ProcessKind>,
    /// Its scratch pair (computed P and Q) in `bg_scratch`: `2*bg_slot`, `2*bg_slot + 1`.
    bg_slot: u8,
    /// When the background operation was issued, ns (for the pacer).
    bg_start_ns: u64,
    /// A rebuild's parity-verification operation ([`Proc::tail`]): it reads the one
    /// parity chunk the stripe's rebuild left unread, and rewrites it from the others
    /// only if that read fails.
    bg_verify: bool,
    /// Write-intent regions this operation counts in flight (empty: none).
    regions: Range<u64>,
    /// A read of a stripe another shard owns (a foreign read).
    foreign: bool,
    /// What the operation holds in the stripe gate.
    gate: GateHold,
    /// The next operation of the pass this one leads or follows ([`cache::NONE`]: none).
    next: u32,
    /// It counts in `bulk_sops` (an operation of a [`RequestClass::BulkWrite`] request).
    bulk: bool,
    /// The pass's pinned cache entry (leader only; [`cache::NONE`] otherwise).
    pass_entry: u32,
    /// Stripe writes in the pass (leader only).
    pass_writes: u32,
    /// Whether any write of the pass is FUA (leader only).
    pass_fua: bool,
    /// Since when the pass is held for more writes, ns (leader only).
    held_ns: Option<u64>,
    /// The fewest flushes the shard had accepted when any write of the pass was accepted
    /// (leader only): a flush since then ends any hold.
    flushes_seen: u64,
    /// Per member: the blocks of its chunk the pass writes (data members; leader only).
    dirty: Vec<cache::BlockSet>,
    /// The touched rows (blocks of a chunk written on any data member; leader only).
    rows: cache::BlockSet,
    /// Per member: the blocks the pass reads (leader only).
    need: Vec<cache::BlockSet>,
    /// Per member: the address of chunk offset 0 in the caller's buffer when the pass
    /// writes that data chunk straight from it (0: from the cache entry; leader only).
    pass_direct: Vec<usize>,
    /// Per member: the pieces of the callers' buffers the pass writes that data chunk from
    /// when several of its writes cover every touched row of it together (a gathered
    /// member write; empty: not gathered; leader only). See [`pass::Gathered`].
    pass_gather: Vec<pass::Gathered>,
    /// The write's range of the stripe's logical data, bytes (a pass: the union of its
    /// writes, kept contiguous while a PPL is attached): what its PPL entries describe.
    ppl_lo: u64,
    ppl_hi: u64,
    /// The PPL logs (members) whose records hold or will hold this write, in the order
    /// they are taken (ascending member index; [`ppl::NO_LOG`] for none): P's on RAID5,
    /// P's and Q's on RAID6.
    ppl_logs: [u16; 2],
    /// How many of `ppl_logs`' records are durable.
    ppl_durable: u8,
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
    /// The owner's batch clears bits and waits for the flushes of the members with a
    /// volatile cache (`outstanding` counts them) before its writes go out.
    preflush: bool,
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
    /// A RAID6 rebuild of one member that leaves a parity chunk unread where it need not
    /// read it ([`Array::start_bg`]): the walk over the same stripes that reads those
    /// chunks afterwards (so an unrecovered read error on one is still found and
    /// rewritten), taken when the rebuild's own walk is done. It covers every stripe of the
    /// ranges, below a resume position too (the run that got there may have stopped before
    /// its own verification).
    tail: Option<ShardWalk>,
    /// The rebuild left a parity chunk unread somewhere on this shard: without that, the
    /// verification walk has nothing to do and is not taken.
    skipped: bool,
    /// The walk is the verification walk (the rebuild proper is done: the position is
    /// the end, and finished operations count in `verify_done`).
    verifying: bool,
    verify_done: u64,
    verify_total: u64,
}

impl Proc {
    /// Lowest own stripe not yet done (see [`ShardProgress::position_stripes`]).
    fn position(&self, stripes: u64) -> u64 {
        if self.verifying {
            // The rebuild proper is done on every stripe; its verification walk does not
            // move the checkpoint (a restart there resumes nothing).
            return stripes;
        }
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
    reqs: ReqSlots,
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
    /// Requests in `backlog` that are not reads (writes of any kind, flushes): while there
    /// are none, a fast-path read overtakes nothing it must not (reads need no order among
    /// themselves; `read.rs`).
    backlog_writes: u32,
    /// Requests in `backlog` of [`RequestClass::BulkWrite`]: when the bulk share or the
    /// turn's bulk bytes are spent and only these are left behind the scan's position,
    /// `split_backlog` stops instead of walking past each of them (a load of a request
    /// slot apiece, every `process` call).
    backlog_bulk: u32,
    /// Fast-path reads holding the stripe gate (requests with `fast_foreign`): at most the
    /// stripe operations, so the gate's counts stay within what its callers size it for
    /// ([`crate::shard::StripeGate::new`]).
    fast_foreign_reads: u32,
    /// Fast-path reads in flight or waiting, failed, for a stripe operation to run them
    /// again (`retry_held`). While there are any, `split_backlog` keeps the last free
    /// stripe operation for such a retry: a failed read keeps its stripe hold, and the
    /// operations that would free a stripe operation may all be waiting for that stripe.
    fast_in_flight: u32,
    /// `split_backlog` kept the last free stripe operation from a request: no new
    /// fast-path read goes out until the ones in flight are done and the request has it.
    fast_blocked: bool,
    done: VecDeque<ArrayCompletion>,
    /// Failures of this shard that the caller has recorded durably
    /// ([`Array::hold_writes_until_recorded`]): write completions are held while
    /// [`Array::failures_to_record`] is ahead of it. `None`: never held.
    failures_recorded: Option<Arc<AtomicU64>>,
    /// Completions of writes held until the failures before them are recorded, in
    /// completion order, each with its request slot: a held write keeps its slot (the
    /// shard admits no more than its table holds, and [`Self::busy`] stays true), so the
    /// queue never outgrows its capacity of every request.
    held_writes: VecDeque<(u32, ArrayCompletion)>,
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
    /// The Partial Parity Log's write side, when the array has one.
    ppl: Option<ppl::PplShard>,
    /// Shared with the other shards when there are several ([`Array::set_shard`]).
    gate: Option<Arc<StripeGate>>,
    /// Stripes known to read as zeroes, shared by every shard (block status); `None`
    /// until [`Array::set_zero_map`].
    zero_map: Option<Arc<ZeroMap>>,
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
    /// The owner's stripe cache ([`cache`]).
    cache: StripeCache,
    /// Passes held for more writes, oldest first ([`pass`]).
    held_passes: VecDeque<u32>,
    /// Flushes accepted so far (a pass started before the latest flush is not held).
    flushes: u64,
    /// [`ArrayConfig::write_batch`], at least 1.
    write_batch: u32,
    /// [`ArrayConfig::write_hold_ns`].
    write_hold_ns: u64,
    /// The shard's write latency, ns: mean of its write phases (`note_write_latency`).
    write_latency_ns: u64,
    /// Where the last write requests ended (array bytes) and the length of the stream
    /// each ended (bytes, [`ReqCtx::stream_bytes`]), a ring ([`pass`]).
    recent_write_ends: [(u64, u64); pass::RECENT_WRITES],
    recent_write_next: usize,
    /// Client write operations (not background, not reads) with member I/O outstanding:
    /// their completions let the clients send more writes ([`pass`]).
    write_ops_in_io: u32,
    /// Write requests (write, write-zeroes, discard) accepted and not yet completed.
    writes_in_flight: u32,
    /// Queue wait per [`RequestClass`], ns ([`Array::queue_wait`]).
    queue_wait: [QueueWait; 3],
    /// Stripe operations of bulk writes now; the most they may take is `bulk_share`'s
    /// cap: the rest is kept for other requests, which pass queued bulk writes they do
    /// not overlap.
    bulk_sops: u32,
    /// Bytes of bulk-write stripe operations admitted in this [`Array::process`] call (a
    /// reactor turn): at most `turn_bulk_limit` (or one operation) per call.
    turn_bulk_bytes: u64,
    /// A bulk write waited for the next call because this call's bulk bytes were spent:
    /// `process` reports progress so the executor calls again.
    turn_bulk_deferred: bool,
    /// [`ArrayConfig::bulk_bytes_per_turn`] (at least 1).
    bulk_bytes_per_turn: u64,
    /// This [`Array::process`] call's bound on `turn_bulk_bytes`: `bulk_bytes_per_turn`
    /// while the bound holds ([`TURN_BOUND_HOLD_NS`]), else `u64::MAX`.
    turn_bulk_limit: u64,
    /// `now` when the shard last accepted a paced request that is not a bulk write
    /// (`None`: never).
    last_unbulk_ns: Option<u64>,
    /// The executor's word that the bound holds whatever the shard accepted
    /// ([`Array::set_turn_bound_held`]).
    turn_bound_held: bool,
    /// The bulk share's controller ([`crate::qos::share`]).
    bulk_share: BulkShare,
    /// Bulk-write requests accepted and not finished.
    bulk_reqs: u32,
    /// Reads of a stripe a write holds may be served from the write's data
    /// ([`Array::read_from_pass`]); off only in tests that measure what it saves.
    pass_reads_on: bool,
    /// The clients' apparent write depth on this shard: the most write requests seen in
    /// flight since a hold last expired ([`pass`]: a pass is held only while fewer writes
    /// than this are in flight, i.e. while the clients can still send more).
    write_depth: u32,
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
        let tag_ops = tag_ops(total_sops, n, cfg.requests);
        // Blocks of a chunk: the stripe cache's and the passes' unit.
        let blocks = g.chunk_bytes() / g.block_bytes();
        let mut array = Self {
            geo,
            data_offset: cfg.data_offset_bytes,
            parity,
            members: {
                // Room for a replacement beside the members, reserved now.
                let mut v = Vec::with_capacity(n + 1);
                for (id, ch) in channels.into_iter().enumerate() {
                    v.push(Member::new(ch, id as u16, &cfg, total_sops, tag_ops, chunk));
                }
                v
            },
            reqs: ReqSlots::new(cfg.requests),
            free_reqs: (0..cfg.requests as u32).rev().collect(),
            sops: (0..total_sops)
                .map(|_| Sop {
                    req: 0,
                    stripe: 0,
                    layout: geo.stripe(0),
                    fp: StripeWrite::from_range(g.data_chunks(), g.chunk_bytes(), 0, 1),
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
                    write_in_io: false,
                    unsupported: false,
                    bg: None,
                    bg_slot: 0,
                    bg_start_ns: 0,
                    bg_verify: false,
                    regions: 0..0,
                    foreign: false,
                    gate: GateHold::None,
                    next: cache::NONE,
                    bulk: false,
                    pass_entry: cache::NONE,
                    pass_writes: 0,
                    pass_fua: false,
                    held_ns: None,
                    flushes_seen: 0,
                    dirty: (0..n).map(|_| cache::BlockSet::new(blocks)).collect(),
                    rows: cache::BlockSet::new(blocks),
                    need: (0..n).map(|_| cache::BlockSet::new(blocks)).collect(),
                    pass_direct: vec![0; n],
                    pass_gather: (0..n).map(|_| pass::Gathered::default()).collect(),
                    ppl_lo: 0,
                    ppl_hi: 0,
                    ppl_logs: [ppl::NO_LOG; 2],
                    ppl_durable: 0,
                })
                .collect(),
            free_sops: (0..cfg.stripe_ops as u32).rev().collect(),
            // Every operation index a hold may carry: stripe operations and fast-path reads.
            locked: StripeLocks::new(tag_ops),
            held: Vec::with_capacity(total_sops),
            waiting: VecDeque::with_capacity(total_sops),
            ready: VecDeque::with_capacity(total_sops),
            backlog: VecDeque::with_capacity(cfg.requests),
            backlog_writes: 0,
            backlog_bulk: 0,
            fast_foreign_reads: 0,
            fast_in_flight: 0,
            fast_blocked: false,
            done: VecDeque::with_capacity(cfg.requests),
            failures_recorded: None,
            held_writes: VecDeque::new(),
            synthetic: VecDeque::with_capacity((total_sops + cfg.requests) * (n + 1)),
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
            ppl: None,
            gate: None,
            zero_map: None,
            gate_waiting: VecDeque::with_capacity(total_sops),
            moved: VecDeque::with_capacity(cfg.requests),
            entry_of: (0..=n as u16)
                .map(|id| if usize::from(id) < n { id } else { NO_ENTRY })
                .collect(),
            replace: None,
            replace_bitmap_ticket: 0,
            cache: StripeCache::new(
                cfg.stripe_cache_entries.max(cfg.stripe_ops),
                n,
                g.chunk_bytes(),
                g.block_bytes(),
                cfg.stripe_cache_entries > 0,
            ),
            held_passes: VecDeque::with_capacity(total_sops),
            flushes: 0,
            write_batch: cfg.write_batch.max(1),
            write_hold_ns: cfg.write_hold_ns,
            write_latency_ns: 0,
            recent_write_ends: [(u64::MAX, 0); pass::RECENT_WRITES],
            recent_write_next: 0,
            write_ops_in_io: 0,
            writes_in_flight: 0,
            queue_wait: std::array::from_fn(|_| QueueWait::new()),
            bulk_sops: 0,
            turn_bulk_bytes: 0,
            turn_bulk_deferred: false,
            bulk_bytes_per_turn: cfg.bulk_bytes_per_turn.max(1),
            turn_bulk_limit: cfg.bulk_bytes_per_turn.max(1),
            last_unbulk_ns: None,
            turn_bound_held: false,
            pass_reads_on: true,
            bulk_share: BulkShare::new(
                cfg.stripe_ops as u32,
                g.stripe_data_bytes(),
                cfg.bulk_share_percent,
            ),
            bulk_reqs: 0,
            write_depth: 0,
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

    /// Holds the completion of every write (any [`ArrayOp::is_write`] request) that
    /// finishes while this shard has failures the caller has not yet recorded durably:
    /// `recorded` is the caller's count of them, compared with this shard's
    /// [`Self::failures_to_record`]. The held completions come out of [`Self::poll`] once
    /// `recorded` reaches it (stored with `Release`; the caller then wakes the reactor).
    /// Reads, flushes and the writes of a shard with no unrecorded failure are not held.
    ///
    /// Why: a write completed while a member is failed skips that member. Until the
    /// superblocks say the member is faulty, a crash reassembles the array with it as
    /// current, and its stale chunks then stand for data and parity that were
    /// acknowledged: md holds such writes the same way until its superblock update is
    /// written (`MD_SB_CHANGE_PENDING`, raid1's `bio_end_io_list`, raid5's `handle_stripe`).
    /// A failed replacement is the same: until the superblocks drop it, a restart resumes
    /// the replace from its checkpoint and takes the stripes below it, which missed the
    /// writes since, as copied.
    ///
    /// # Panics
    /// If requests are in flight (attach before submitting any).
    pub fn hold_writes_until_recorded(&mut self, recorded: Arc<AtomicU64>) {
        assert!(
            self.free_reqs.len() == self.reqs.len(),
            "the write hold is attached before any request"
        );
        self.held_writes = VecDeque::with_capacity(self.reqs.len());
        self.failures_recorded = Some(recorded);
    }

    /// Failures this shard has seen that a caller keeping superblocks records: members it
    /// had in service that failed ([`ArrayStats::member_failures`], once per member) and
    /// live replacements that failed ([`Self::replacement_failures`]). Only grows.
    pub fn failures_to_record(&self) -> u64 {
        self.stats.member_failures + self.replacement_failures
    }

    /// Whether a write finishing now is held ([`Self::hold_writes_until_recorded`]).
    #[inline]
    pub(super) fn writes_held(&self) -> bool {
        self.failures_recorded
            .as_ref()
            .is_some_and(|r| r.load(Ordering::Acquire) < self.failures_to_record())
    }

    /// Write completions held for an unrecorded member or replacement failure
    /// ([`Self::hold_writes_until_recorded`]).
    pub fn held_writes(&self) -> usize {
        self.held_writes.len()
    }

    /// What the array did so far.
    pub fn stats(&self) -> ArrayStats {
        let share = self.bulk_share.state();
        ArrayStats {
            bulk_share_ops: u64::from(share.cap_ops),
            bulk_share_pool: u64::from(share.pool_ops),
            bulk_share_cuts: share.cuts,
            bulk_share_raises: share.raises,
            ..self.stats
        }
    }

    /// Members this shard has failed so far ([`ArrayStats::member_failures`]), without
    /// assembling the whole [`ArrayStats`] (a reactor looks every turn).
    pub fn member_failures(&self) -> u64 {
        self.stats.member_failures
    }

    /// What this shard sent to member `m` so far.
    ///
    /// # Panics
    /// If `m` is not a member index.
    pub fn member_counters(&self, m: u16) -> MemberCounters {
        self.members[usize::from(m)].counters
    }

    /// How long this shard's requests of class `c` waited inside the array, ns: from
    /// [`Array::submit`] to their first member request (requests that issue none — served
    /// from nothing, failed, flushes to clean members — are not counted).
    ///
    /// A copy (it allocates): for tests and reports. [`Array::queue_wait_into`] fills a
    /// histogram of the caller's without allocating.
    pub fn queue_wait(&self, c: RequestClass) -> hdrhistogram::Histogram<u64> {
        let mut h = new_latency_histogram();
        self.queue_wait_into(c, &mut h);
        h
    }

    /// [`Array::queue_wait`] into `out` (reset first; no allocation when `out` has the
    /// bounds of [`new_latency_histogram`]).
    pub fn queue_wait_into(&self, c: RequestClass, out: &mut hdrhistogram::Histogram<u64>) {
        self.queue_wait[c.index()].fill(out);
    }

    /// The bulk share now: how many stripe operations bulk writes may hold, and why
    /// ([`crate::qos::share`]).
    pub fn bulk_share(&self) -> BulkShareState {
        self.bulk_share.state()
    }

    /// Completion latency of this shard's requests to member `m`, ns
    /// ([`crate::latency::LatencyHistogram::fill`] copies it into a plain histogram).
    ///
    /// # Panics
    /// If `m` is not a member index.
    pub fn member_latency(&self, m: u16) -> &crate::latency::LatencyHistogram {
        &self.members[usize::from(m)].latency
    }

    /// The last replacement started on this shard, if any: its member, serial and state
    /// ([`Array::start_replace`]).
    pub fn replacement(&self) -> Option<ReplaceInfo> {
        self.replace
    }

    /// What this shard sent to the live replacement device, with its latency histogram
    /// (ns); `None` without a live replacement.
    pub fn replacement_io(&self) -> Option<(MemberCounters, &crate::latency::LatencyHistogram)> {
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

    /// The array's clock as last set ([`Self::set_now`]), ns; 0 before the first set.
    pub fn now_ns(&self) -> u64 {
        self.now
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
        let own = pacer
            .into_iter()
            .chain(daemon)
            .chain(self.hold_deadline_ns())
            // A shard waiting for its turn on a PPL log polls for it (another shard passes
            // the turn on; nothing here completes when it does).
            .chain(self.ppl_waiting().then(|| self.now + ppl::TURN_POLL_NS))
            .min();
        if self.io_timeout_ns == 0 {
            return own;
        }
        // The owner's bitmap batch times out like a stripe operation's requests.
        let batch = self
            .intent
            .as_ref()
            .filter(|i| i.outstanding > 0)
            .map(|i| i.issued_ns.saturating_add(self.io_timeout_ns));
        // Stripe operations', fast-path reads' and logs' timeouts fire at a scan
        // (`check_timeouts` scans at most every 1/16 of the timeout): a deadline that
        // passes between two scans is acted on at the next one. Naming it earlier would
        // wake an executor with nothing to do until then (a reactor spins, a virtual
        // clock stops).
        let scanned = self
            .sops
            .iter()
            .filter(|s| s.outstanding > 0)
            .map(|s| s.issued_ns.saturating_add(self.io_timeout_ns))
            .chain(self.fast_read_deadline_ns())
            .chain(self.ppl_deadline_ns())
            .min()
            .map(|d| d.max(self.next_timeout_scan));
        scanned.into_iter().chain(own).chain(batch).min()
    }

    /// Whether any request is still in progress (or, on the bitmap owner, a bitmap write;
    /// or a PPL log's record, writes or flushes).
    pub fn busy(&self) -> bool {
        self.free_reqs.len() != self.reqs.len()
            || !self.moved.is_empty()
            || self.ppl_busy()
            || self
                .intent
                .as_ref()
                .and_then(|i| i.owner.as_ref())
                .is_some_and(BitmapOwner::busy)
    }

    /// Accepts a request. Malformed requests complete at once with
    /// [`ArrayError::Invalid`] (returned by `poll`), never panic. A read that may take the
    /// fast path (inside one chunk of an online member, nothing it must not overtake queued
    /// ahead; `read.rs`) is issued to its member here; every other request waits for
    /// [`Array::process`].
    ///
    /// # Errors
    /// [`ArrayError::QueueFull`] when the request pool is exhausted: poll, then retry.
    pub fn submit(&mut self, r: ArrayRequest) -> Result<(), ArrayError> {
        let mut invalid = self.validate(&r).err();
        if invalid.is_none() && !r.op.is_flush() && !self.may_serve(&r) {
            invalid = Some(ArrayError::Invalid(
                "a request for a stripe another reactor owns must be a read within one stripe",
            ));
        }
        self.accept(r, invalid)
    }

    /// [`Self::submit`] for a piece of a request the caller has already validated with
    /// [`Self::validate`] (a reactor's pieces: each a sub-range of a validated request, in
    /// its buffer) and routed: the checks are not run a second time on the per-request
    /// path. The reactors route a piece here only when this shard may serve it — its own
    /// stripes, or (with the gate attached, which the reactors do exactly when foreign
    /// reads are on) a read within one stripe (`Reactor::route`, `shard::split`,
    /// `shard::one_piece`); debug builds check it.
    ///
    /// # Errors
    /// [`ArrayError::QueueFull`] when the request pool is exhausted: poll, then retry.
    pub(crate) fn submit_piece(&mut self, r: ArrayRequest) -> Result<(), ArrayError> {
        debug_assert_eq!(self.validate(&r), Ok(()), "a piece of a validated request");
        debug_assert!(
            r.op.is_flush() || self.may_serve(&r),
            "a piece routed to a shard that may not serve it"
        );
        self.accept(r, None)
    }

    /// Takes request `r` into the pool; `invalid`: what [`Self::validate`] found wrong
    /// with it (it then completes at once with that error).
    fn accept(&mut self, r: ArrayRequest, invalid: Option<ArrayError>) -> Result<(), ArrayError> {
        let Some(idx) = self.free_reqs.pop() else {
            return Err(ArrayError::QueueFull);
        };
        let paced = invalid.is_none() && !r.op.is_flush();
        let (sequential, stream_bytes) = if r.op.is_write() {
            self.stream_through(r.offset_bytes, u64::from(r.len_bytes))
        } else {
            (false, 0)
        };
        let class = RequestClass::of(r.op, u64::from(r.len_bytes), sequential);
        if paced {
            self.pacer.foreground_submitted(self.now);
            match class {
                RequestClass::SmallRead => self.bulk_share.small_read_submitted(self.now),
                RequestClass::BulkWrite => self.bulk_reqs += 1,
                RequestClass::Other => {}
            }
            if class != RequestClass::BulkWrite {
                self.last_unbulk_ns = Some(self.now);
            }
        }
        // Filled field by field in its slot (`ReqSlots`): a whole `Some(ReqCtx { .. })`
        // was assembled on the stack and copied over, and the copy stalled on
        // store-to-load forwarding; a whole constant written first is a `memcpy` call.
        // The pattern names every field, so a field added to `ReqCtx` must be set here.
        let now = self.now;
        let flushes = self.flushes;
        let ReqCtx {
            live,
            tag,
            op,
            buf,
            offset,
            len,
            split,
            pending,
            error,
            submit_ns,
            flushes_before,
            paced: q_paced,
            sequential: q_sequential,
            stream_bytes: q_stream_bytes,
            class: q_class,
            issued,
            device_ns,
            ordered,
            from_cache,
            fast_dev,
            fast_ns,
            fast_foreign,
            retry_held,
            retry_bad,
        } = self.reqs.claim(idx);
        *live = true;
        *tag = r.tag;
        *op = r.op;
        *buf = r.buf;
        *offset = r.offset_bytes;
        *len = u64::from(r.len_bytes);
        *error = invalid;
        *submit_ns = now;
        *flushes_before = flushes;
        *q_paced = paced;
        *q_sequential = sequential;
        *q_stream_bytes = stream_bytes;
        *q_class = class;
        // Nothing split, pending or issued, no fast-path read, no retry.
        *split = 0;
        *pending = 0;
        *issued = false;
        *device_ns = 0;
        *ordered = false;
        *from_cache = false;
        *fast_dev = NO_FAST_DEV;
        *fast_ns = 0;
        *fast_foreign = false;
        *retry_held = false;
        *retry_bad = NO_ENTRY;
        if r.op.is_write() {
            self.writes_in_flight += 1;
            if invalid.is_none() {
                self.write_depth = self.write_depth.max(self.writes_in_flight);
            }
        }
        if invalid.is_some() {
            self.finish_req(idx);
        } else if r.op.is_flush() {
            self.flushes += 1;
            self.start_flush(idx);
        } else if r.op.is_read() && self.fast_read(idx) {
            // Issued: one member read, no stripe operation (`read.rs`).
        } else {
            if r.op.is_write() {
                self.note_write_end(r.offset_bytes + u64::from(r.len_bytes), stream_bytes);
            }
            self.backlog_writes += u32::from(!r.op.is_read());
            self.backlog_bulk += u32::from(class == RequestClass::BulkWrite);
            self.backlog.push_back(idx);
        }
        Ok(())
    }

    /// Whether this shard may serve `r` (validated): with one shard, anything; with more,
    /// a request within one stripe — any request of a stripe it owns, and of a stripe
    /// another shard owns only a read, with the stripe gate attached ([`Array::set_gate`]:
    /// a foreign read). Consecutive stripes have different owners ([`owner`]), so a
    /// request over two stripes always reaches into another shard's.
    fn may_serve(&self, r: &ArrayRequest) -> bool {
        if self.shards == 1 {
            return true;
        }
        self.geo
            .single_stripe(r.offset_bytes, r.len_bytes)
            .is_some_and(|s| {
                owner(s, self.shards) == self.shard || (r.op.is_read() && self.gate.is_some())
            })
    }

    /// Checks a request against the array: buffer length and alignment, block alignment,
    /// range.
    ///
    /// # Errors
    /// [`ArrayError::Invalid`] naming the problem.
    pub fn validate(&self, r: &ArrayRequest) -> Result<(), ArrayError> {
        if r.op.is_flush() {
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
            if u64::from(r.buf.len()) != r.op.buf_len(r.len_bytes) {
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
        if matches!(r.op, ArrayOp::CompareAndWrite { .. })
            && self
                .geo
                .single_stripe(r.offset_bytes, r.len_bytes)
                .is_none()
        {
            return Err(ArrayError::Invalid(
                "a compare-and-write must lie inside one stripe",
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

    /// Whether the per-turn bulk bound ([`BULK_BYTES_PER_TURN`]) holds in the following
    /// [`Self::process`] calls whatever this shard accepted: `true` while the executor saw,
    /// within [`TURN_BOUND_HOLD_NS`], a request that waits for this shard's turns and is
    /// not a bulk write by the executor's rule — whether or not this shard accepts it: one
    /// served by another shard, or by another array driven by the same thread (the
    /// reactors set it before each turn's `process`, `reactor::TurnHold`). The shard's own
    /// record of what it accepted counts either way.
    pub fn set_turn_bound_held(&mut self, held: bool) {
        self.turn_bound_held = held;
    }

    /// What the executor last said through [`Self::set_turn_bound_held`].
    #[cfg(test)]
    pub(crate) fn turn_bound_held(&self) -> bool {
        self.turn_bound_held
    }

    /// Runs the state machines: resubmits, reaps member completions, advances stripe
    /// operations, starts waiting ones, and kicks the channels. Returns whether anything
    /// happened (an executor idles when it returns false).
    ///
    /// Bulk writes are admitted to stripe operations at most [`BULK_BYTES_PER_TURN`] bytes
    /// per call (at least one operation): each admitted operation is copy and parity work
    /// done inside this call, so a call's length — what a small request arriving at the
    /// front door waits for — stays bounded however much bulk work is queued. When bulk
    /// work waits for the next call for that reason, the call reports progress. The
    /// bound holds for [`TURN_BOUND_HOLD_NS`] after the shard accepted a request that is
    /// not a bulk write, or while the executor says so ([`Self::set_turn_bound_held`]);
    /// otherwise only the bulk share limits admission.
    pub fn process(&mut self) -> bool {
        let mut progress = false;
        self.turn_bulk_bytes = 0;
        self.turn_bulk_deferred = false;
        let bound_holds = self.turn_bound_held
            || self
                .last_unbulk_ns
                .is_some_and(|t| self.now.saturating_sub(t) < TURN_BOUND_HOLD_NS);
        self.turn_bulk_limit = if bound_holds {
            self.bulk_bytes_per_turn
        } else {
            u64::MAX
        };
        self.tick_members();
        loop {
            let mut round = false;
            round |= self.check_timeouts();
            round |= self.resubmit();
            round |= self.reap();
            round |= self.bitmap_work();
            round |= self.ppl_work();
            round |= self.gate_work();
            while let Some(s) = self.ready.pop_front() {
                self.advance(s);
                round = true;
            }
            round |= self.split_backlog();
            round |= self.issue_background();
            round |= self.held_work();
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
        progress || self.turn_bulk_deferred
    }

    /// Moves up to `out.len()` finished requests into `out`; returns how many. Writes held
    /// for an unrecorded failure ([`Self::hold_writes_until_recorded`]) come out once it
    /// is recorded.
    pub fn poll(&mut self, out: &mut [ArrayCompletion]) -> usize {
        if !self.held_writes.is_empty() && !self.writes_held() {
            // Within `done`'s capacity: held and done together are at most every request
            // (each holds a request slot until it leaves here).
            for (ri, c) in self.held_writes.drain(..) {
                self.done.push_back(c);
                self.free_reqs.push(ri);
            }
        }
        let n = self.done.len().min(out.len());
        for (o, c) in out.iter_mut().zip(self.done.drain(..n)) {
            *o = c;
        }
        n
    }

    /// How a whole-stripe zeroing of operation `s` ended: done unless more members are
    /// lost than the parity covers (the stripe's zeroes stand on the survivors).
    fn zeroing_status(&self, s: u32) -> Result<(), ArrayError> {
        let g = self.geo.geometry();
        let lost = (0..g.members()).filter(|&m| self.is_failed(m)).count();
        if lost > usize::from(g.parity_chunks()) {
            Err(ArrayError::Unrecoverable {
                stripe: self.sops[s as usize].stripe,
            })
        } else {
            Ok(())
        }
    }

    fn advance(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let sop = &self.sops[s as usize];
        let failed = sop.io_error;
        if !failed && matches!(sop.phase, Phase::PassWrite | Phase::Writing) {
            self.note_write_latency(self.now.saturating_sub(sop.issued_ns));
        }
        if matches!(
            self.sops[s as usize].phase,
            Phase::PassWrite | Phase::Writing | Phase::Zeroing
        ) {
            self.ppl_write_done(s);
        }
        let sop = &self.sops[s as usize];
        match sop.phase {
            Phase::Queued => unreachable!("queued operations have no I/O"),
            Phase::PplWait(_) => unreachable!("operations waiting for their log have no I/O"),
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
                let req = self.reqs.get_mut(ri).expect("live request");
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
            Phase::Batched => unreachable!("a batched write issues nothing"),
            Phase::PassHeld => unreachable!("a held pass has no I/O"),
            Phase::PassRead(mode) => self.pass_read_done(s, mode),
            Phase::CombineRead | Phase::CombineDegradedRead if failed => {
                self.start_degraded(s, Phase::CombineDegradedRead)
            }
            Phase::CombineRead => {
                self.cache_combined(s);
                self.combine(s)
            }
            Phase::CombineDegradedRead => match self.rebuild_in_buffers(s) {
                Ok(()) => self.combine(s),
                Err(e) => self.finish_sop(s, Err(e)),
            },
            Phase::PassWrite => self.pass_written(s),
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
                let status = self.zeroing_status(s);
                if status.is_ok() {
                    // Every surviving member zeroed its chunk (or deallocated it with the
                    // promise of zeroes): the stripe, parity included, reads as zeroes.
                    if let Some(z) = &self.zero_map {
                        z.set_zero(sop.stripe);
                    }
                }
                let fua = matches!(
                    self.reqs.get(sop.req).map(|r| r.op),
                    Some(ArrayOp::WriteZeroes { fua: true })
                );
                if status.is_ok() && fua {
                    self.zero_flush(s)
                } else {
                    self.finish_sop(s, status)
                }
            }
            // A flush that failed failed its member: the zeroes stand on the others.
            Phase::ZeroFlush => self.finish_sop(s, self.zeroing_status(s)),
            Phase::Writing => {
                let (status, _) = self.write_done(s);
                self.finish_sop(s, status)
            }
        }
    }
}

mod background;
mod bitmap;
mod cache;
mod degraded;
mod io;
mod locks;
mod members;
mod ops;
mod pass;
mod ppl;
mod read;
mod write;

#[cfg(test)]
mod admit_tests;
#[cfg(test)]
mod bitmap_tests;
#[cfg(test)]
mod gather_tests;
#[cfg(test)]
mod ppl_tests;
#[cfg(test)]
mod tests;
