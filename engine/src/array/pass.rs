//! Write passes: every write (and write-zeroes written as data) to a healthy stripe runs
//! as a **pass** — one write plan over the union of the writes that wait for the stripe,
//! one parity computation, one set of member I/Os, all of them completed together when it
//! is durable. md does the same with the bios attached to a `stripe_head`
//! (`../shared/research/md-batching-and-ppl.md` §1.3); here the stripe's owner does it,
//! per core, without locks.
//!
//! # Life of a pass
//! 1. **Gather.** The operation that takes the stripe (the *leader*) collects every write
//!    of the same stripe waiting behind it, in submission order, up to the first operation
//!    of the stripe that is not such a write (a read, a discard, a background operation) —
//!    so the per-stripe FIFO holds and a read never sees part of a pass. The gathered
//!    operations (*followers*) hang off the leader (`Sop::next`); they hold nothing
//!    themselves: the leader holds the stripe, its gate and its bitmap regions.
//! 2. **Plan** ([`Array::plan_pass`]) over the union: per member, the blocks the pass
//!    writes; RMW reads the old data of the written blocks and P/Q of the touched rows,
//!    RCW the other data of the touched rows; blocks the stripe cache holds
//!    ([`super::cache`]) are not read. The plan reading fewer blocks wins; a tie goes to
//!    RMW (see [`crate::stripe`]) unless neither reads anything: then RCW (fewer bytes
//!    moved).
//! 3. **Hold** (coalescing, [`Array::may_hold`]): a pass that would read waits while more
//!    writes for its stripe arrive — only while the clients can still send more: some
//!    other client write has member I/O in flight (its completion frees a slot of the
//!    client's queue), or fewer writes are in flight on the shard than the most it has
//!    seen (the clients' write depth: they have free slots, their writes are on the way).
//!    With neither, every client waits on us and a hold would wait for writes nobody can
//!    send (a lone QD1 writer is never held). A hold that reaches its bound without the
//!    writes it waited for lowers the remembered depth to what is in flight then (a client
//!    that went from QD8 to QD1 costs one hold). At most
//!    [`Array::hold_bound_ns`] (3 × the shard's measured write latency, between
//!    [`ArrayConfig::write_hold_ns`] and 10 ms), never with a FUA write in the pass, never once a
//!    flush has arrived behind it, never while a read of the stripe waits, and never while
//!    requests wait for a free stripe operation. When the writes gathered meanwhile make
//!    the plan read nothing (a full stripe, or everything else cached) it goes at once.
//! 4. **Read** the missing blocks into the cache entry (a pass of a sequential stream that
//!    must read at all reads every data block of the stripe it lacks and writes RCW,
//!    [`Array::prefetch_stripe`]: the stream's following passes on the stripe read nothing); **compute** (the new data is
//!    copied into the entry in submission order, later bytes winning; RMW keeps a copy of
//!    the old rows in the leader's buffers for the deltas); **write** the written blocks
//!    and P/Q of the touched rows from the entry, FUA if any write of the pass is.
//!    A data chunk that one write covers over every touched row, or that several writes
//!    cover one after the other (a stream of small writes moving on: [`Gathered`]), is not
//!    copied: parity takes it from the writes' buffers and its member write goes out from
//!    them (one gathered request, `IORING_OP_WRITEV`), and the entry does not hold its new
//!    data.
//! 5. **Finish**: on success the written blocks become valid in the cache; every
//!    operation of the pass completes with the pass's status. A pass of a stream of
//!    sub-stripe writes that has left its stripe makes the entry the next one recycled
//!    (`recycle_first`, the cache's "Recency" docs).
//!
//! A member I/O error while reading ends the gathering: the followers go back to the head
//! of the stripe's waiting operations (in order) and the leader is planned again alone
//! (degraded if a member was lost). A degraded stripe takes the single-operation path
//! (`write_out`), and its cache entry is dropped.

use arrayvec::ArrayVec;

use super::cache::{self, NONE};
use super::ops::remove_at;
use super::{Array, ArrayError, ArrayOp, Phase};
use crate::device::{Channel, IoSeg, Op};
use crate::geometry::{Role, MAX_RAID6_MEMBERS};
use crate::parity::{Delta, MAX_DATA_CHUNKS};
use crate::stripe::WriteMode;

/// A lone write up to this size (bytes) is copied into the stripe cache after its RMW;
/// a larger one is written from the caller's buffer and not cached: small sequential
/// writes are what a following pass re-reads, and the copy of a large one costs more than
/// it saves.
const LONE_COPY_MAX: usize = 16 << 10;

/// A hold's bound in the shard's write latencies ([`Array::hold_bound_ns`]): the sim sweep
/// needed up to 2.3 (HDD profile) for the writes of a client that writes again on each
/// completion to arrive (docs/BENCHMARKS.md, "Write passes", hold-sweep).
pub(super) const HOLD_WRITE_LATENCIES: u64 = 3;

/// Upper end of the scaled hold bound, ns (10 ms): beyond it a hold costs more than any
/// device's pre-read.
pub(super) const MAX_HOLD_NS: u64 = 10_000_000;

/// A random sub-stripe write is admitted to the stripe cache (`StripeCache::bypassed_lately`)
/// only while the shard's measured write latency is at least this, ns (5 µs): caching it
/// costs a copy of its data into the entry and a pass's bookkeeping (about 1 µs of
/// reactor CPU, and 9 % of `null` RAID5 random-write IOPS when every member completes
/// within the reactor turn that issued it), and saves member reads that take time only
/// on real devices (NVMe flash 10–100 µs, a shared virtio disk hundreds of µs; RAM and
/// `null` members complete in the turn they were issued, a measured latency of 0).
/// docs/BENCHMARKS.md, "Random rewrites through the stripe cache".
pub(super) const CACHE_ADMIT_WRITE_LATENCY_NS: u64 = 5_000;

/// Write request ends remembered for the stream test at submission: enough for a few
/// sequential streams interleaved with other writes, few enough to scan on every write.
pub(super) const RECENT_WRITES: usize = 8;

/// Most members of any array (pointer tables on the stack).
const MAX_MEMBERS: usize = MAX_RAID6_MEMBERS as usize;

/// Most pieces of one gathered member write ([`Gathered`]): a 128 KiB chunk written 4 KiB
/// at a time. A chunk written in more pieces is copied into the cache entry instead.
pub(super) const MAX_GATHER: usize = 32;

/// A data chunk that a pass writes straight from its writes' buffers, several writes
/// together (one write alone uses `pass_direct`): their ranges follow each other in
/// submission order without gap or overlap and cover every row the pass touches, so
/// the member write is one gathered request ([`IoBuf::gather`]) and parity takes each
/// row piece from the buffer that holds it. Nothing is copied into the cache entry, which
/// then does not hold the chunk's new data (the next pass of a sequential stream, which
/// writes other chunks of the stripe, is a read-modify-write against the old data of
/// those, still cached). Only on members whose channels all gather, and not with a
/// Partial Parity Log (its records are built from contiguous row ranges).
#[derive(Default)]
pub(super) struct Gathered {
    /// Chunk offset of the first piece, bytes.
    pub(super) start: u32,
    /// The pieces, in chunk order (the buffers of the pass's writes, lent until they
    /// complete, which is after the member write).
    pub(super) segs: ArrayVec<IoSeg, MAX_GATHER>,
}

impl Gathered {
    /// Whether the pass writes this chunk gathered.
    pub(super) fn is_set(&self) -> bool {
        !self.segs.is_empty()
    }

    /// A cursor at the first piece, for [`Gathered::piece`].
    pub(super) fn cursor(&self) -> GatherCursor {
        GatherCursor {
            i: 0,
            base: self.start,
        }
    }

    /// The piece holding chunk byte `off` as (address of that byte, bytes from it to the
    /// piece's end); `None` outside the pieces. Offsets asked through one cursor must
    /// ascend (the cursor only moves forward).
    pub(super) fn piece(&self, off: u32, c: &mut GatherCursor) -> Option<(*const u8, u32)> {
        if off < c.base {
            return None;
        }
        while let Some(s) = self.segs.get(c.i) {
            let end = c.base + s.len as u32;
            if off < end {
                let at = s.base.wrapping_add((off - c.base) as usize);
                return Some((at.cast_const(), end - off));
            }
            c.base = end;
            c.i += 1;
        }
        None
    }

    /// [`Gathered::piece`] with a fresh cursor.
    pub(super) fn find(&self, off: u32) -> Option<(*const u8, u32)> {
        self.piece(off, &mut self.cursor())
    }
}

/// Where an ascending walk over a [`Gathered`]'s pieces is: piece `i`, which starts at
/// chunk byte `base`.
pub(super) struct GatherCursor {
    i: usize,
    base: u32,
}

/// What [`Array::find_direct`] learns of one data chunk's writers in a pass.
#[derive(Clone, Copy)]
struct Writers {
    /// How many operations write the chunk.
    n: u32,
    /// The last of them.
    last: u32,
    /// Chunk byte where the first one starts and the last one ends.
    start: u32,
    end: u32,
    /// Each starts where the one before ended, all block-aligned.
    follow: bool,
    /// The chunk is written gathered.
    gather: bool,
}

impl<C: Channel> Array<C> {
    /// Whether operation `s` (waiting, not yet started) may join a pass: a client write,
    /// or a write-zeroes that would be written as data (FUA, not a whole stripe, or
    /// members without native write-zeroes).
    pub(super) fn batchable(&self, s: u32) -> bool {
        let sop = &self.sops[s as usize];
        if sop.bg.is_some() || sop.foreign {
            return false;
        }
        match self.reqs.get(sop.req).expect("live request").op {
            ArrayOp::Write { .. } => true,
            ArrayOp::WriteZeroes { fua } => {
                fua || !self.footprint(s).is_full_stripe() || !self.members_support(Op::WriteZeroes)
            }
            _ => false,
        }
    }

    /// Whether any member of operation `s`'s stripe is missing for it (failed, not yet
    /// rebuilt there, or an unrecovered read error in this operation).
    fn stripe_degraded(&self, s: u32) -> bool {
        if self.none_missing(s) {
            return false;
        }
        (0..self.geo.geometry().members()).any(|m| self.missing(s, m))
    }

    /// A write operation `s` holds its stripe (bits durable, gate clear): a pass on a
    /// healthy stripe, the single-operation path on a degraded one.
    pub(super) fn start_write(&mut self, s: u32) {
        if self.stripe_degraded(s) {
            let stripe = self.sops[s as usize].stripe;
            self.cache.invalidate(stripe);
            return self.start_write_single(s);
        }
        self.start_pass(s);
    }

    /// Starts a pass led by `s`: pins the stripe's cache entry, gathers, plans, and holds
    /// or issues.
    fn start_pass(&mut self, s: u32) {
        let stripe = self.sops[s as usize].stripe;
        // A write the cache cannot help — a whole stripe, or a write that neither continues
        // a stream nor finds its stripe cached nor comes back to a stripe written around
        // the cache lately (random writes over a region larger than the cache) — takes
        // the single-operation path: no copy, its working set at the front of its own
        // buffers (cache-hot whatever the offset). Writes of the stripe waiting behind it
        // (rare for such writes) form the next pass. Decided without scanning the waiting
        // operations: this runs for every write, and a random writer keeps a queue's
        // worth waiting. A random write that comes back to its stripe while the cache
        // remembers the first one (`StripeCache::bypassed_lately`) runs as a pass, and
        // what it read and wrote stays cached for the writes after it — on members whose
        // writes take time ([`CACHE_ADMIT_WRITE_LATENCY_NS`]).
        let full = self.footprint(s).is_full_stripe();
        let admits = self.write_latency_ns >= CACHE_ADMIT_WRITE_LATENCY_NS;
        let streams = self.continues_stream(s);
        let admitted = !streams && admits && self.cache.bypassed_lately(stripe);
        if full || !(streams || admitted || self.cache.holds(stripe)) {
            if full {
                self.cache.invalidate(stripe);
            } else if admits {
                self.cache.note_bypass(stripe);
            }
            let sop = &self.sops[s as usize];
            self.stats.write_passes += 1;
            self.stats.batched_writes += 1;
            self.stats.pass_written_bytes += sop.end - sop.start;
            return self.start_write_single(s);
        }
        // Admitted by the filter: not for a stripe the cache held anyway.
        self.stats.cache_admitted_writes += u64::from(admitted && !self.cache.holds(stripe));
        let fua = self.sop_fua(s);
        let flushes_before = self.sop_req(s).flushes_before;
        {
            let sop = &mut self.sops[s as usize];
            debug_assert_eq!(sop.next, NONE);
            sop.pass_entry = NONE;
            sop.pass_writes = 1;
            sop.pass_fua = fua;
            sop.held_ns = None;
            // Not the count now: a flush that arrived while this write waited for its
            // stripe (or for an operation) is behind it too.
            sop.flushes_seen = flushes_before;
            sop.io_error = false;
            for d in &mut sop.dirty {
                d.clear();
            }
            sop.pass_direct.fill(0);
            for g in &mut sop.pass_gather {
                g.segs.clear();
            }
            sop.rows.clear();
            sop.ppl_lo = sop.start;
            sop.ppl_hi = sop.end;
        }
        self.add_to_pass(s, s);
        self.gather(s);
        let (e, valid) = self.cache.pin(stripe);
        self.stats.cache_hit_stripes += u64::from(valid > 0);
        self.sops[s as usize].pass_entry = e;
        self.plan_and_go(s);
    }

    /// Whether operation `s` is a FUA write (or write-zeroes).
    pub(super) fn sop_fua(&self, s: u32) -> bool {
        self.sop_req(s).op.fua()
    }

    /// Adds operation `f`'s footprint to the dirty blocks of the pass led by `lead`.
    fn add_to_pass(&mut self, lead: u32, f: u32) {
        let g = *self.geo.geometry();
        let st = self.layout(lead);
        let unit = g.block_bytes();
        let w = self.footprint(f);
        let (start, end) = (self.sops[f as usize].start, self.sops[f as usize].end);
        let sop = &mut self.sops[lead as usize];
        sop.ppl_lo = sop.ppl_lo.min(start);
        sop.ppl_hi = sop.ppl_hi.max(end);
        for (k, x) in w.chunks() {
            let (a, b) = (x.start / unit, x.end / unit);
            sop.dirty[usize::from(st.data_member(k))].insert_range(a, b);
            sop.rows.insert_range(a, b);
        }
    }

    /// Moves the batchable writes of the leader's stripe that wait behind it into its pass,
    /// in order, up to the first operation of the stripe that cannot join (or the batch
    /// limit).
    fn gather(&mut self, lead: u32) {
        let stripe = self.sops[lead as usize].stripe;
        let mut tail = lead;
        while self.sops[tail as usize].next != NONE {
            tail = self.sops[tail as usize].next;
        }
        let mut i = 0;
        while i < self.waiting.len() {
            if self.sops[lead as usize].pass_writes >= self.write_batch {
                break;
            }
            let f = self.waiting[i];
            if self.sops[f as usize].stripe != stripe {
                i += 1;
                continue;
            }
            if !self.batchable(f) {
                break;
            }
            // With a PPL the pass's writes stay one contiguous range of the stripe, so
            // every row's modified chunks are consecutive, as md's entries require
            // (`crate::ppl`); a write apart from it starts the next pass.
            let (lead_op, f_op) = (&self.sops[lead as usize], &self.sops[f as usize]);
            if self.ppl.is_some() && (f_op.end < lead_op.ppl_lo || f_op.start > lead_op.ppl_hi) {
                break;
            }
            remove_at(&mut self.waiting, i);
            let fua = self.sop_fua(f);
            let flushes_before = self.sop_req(f).flushes_before;
            self.sops[f as usize].phase = Phase::Batched;
            self.sops[tail as usize].next = f;
            tail = f;
            let sop = &mut self.sops[lead as usize];
            sop.pass_writes += 1;
            sop.pass_fua |= fua;
            sop.flushes_seen = sop.flushes_seen.min(flushes_before);
            self.add_to_pass(lead, f);
        }
    }

    /// Plans the pass led by `s` over everything gathered so far: fills `need` with the
    /// blocks to read per member and returns the mode and how many blocks it reads.
    pub(super) fn plan_pass(&mut self, s: u32) -> (WriteMode, u32) {
        let g = *self.geo.geometry();
        let st = self.layout(s);
        let nd = g.data_chunks();
        let sop = &mut self.sops[s as usize];
        let ent = self.cache.entry(sop.pass_entry);
        let rows = &sop.rows;
        // RMW: old data of the written blocks and P/Q of the touched rows, less what is
        // cached. RCW: the other data of the touched rows, less what is cached.
        let mut rmw = 0u32;
        let mut rcw = 0u32;
        let mut covers_all = true;
        for k in 0..nd {
            let m = usize::from(st.data_member(k));
            let d = &sop.dirty[m];
            let n = &mut sop.need[m];
            n.set_difference(d, &ent.valid[m]);
            rmw += n.count();
            n.set_difference2(rows, d, &ent.valid[m]);
            rcw += n.count();
            covers_all &= d.is_superset(rows);
        }
        let parity = [Some(st.p_member()), st.q_member()];
        for &m in parity.iter().flatten() {
            let m = usize::from(m);
            sop.need[m].set_difference(rows, &ent.valid[m]);
            rmw += sop.need[m].count();
        }
        // Equal reads: RMW when both read (it reads the very blocks it then writes, as
        // `crate::stripe` explains); RCW when neither does — everything is cached, and
        // regenerating P/Q from the entry moves fewer bytes than saving the old rows and
        // applying deltas (measured on `seqwrite-4k`, docs/BENCHMARKS.md "Write passes").
        let mode = if rmw < rcw || (rmw == rcw && rmw > 0 && !covers_all) {
            WriteMode::Rmw
        } else if covers_all && rows.count() == rows.capacity() {
            WriteMode::FullStripe
        } else {
            WriteMode::Rcw
        };
        // Fill `need` for the chosen mode (the loops above left RCW's data sets and RMW's
        // parity sets in place).
        match mode {
            WriteMode::Rmw => {
                for k in 0..nd {
                    let m = usize::from(st.data_member(k));
                    let (d, v) = (&sop.dirty[m], &ent.valid[m]);
                    sop.need[m].set_difference(d, v);
                }
            }
            _ => {
                for &m in parity.iter().flatten() {
                    sop.need[usize::from(m)].clear();
                }
            }
        }
        let reads = if mode == WriteMode::Rmw { rmw } else { rcw };
        (mode, reads)
    }

    /// Blocks the pass led by `s` would read in `mode` with nothing cached.
    fn uncached_reads(&self, s: u32, mode: WriteMode) -> u32 {
        let g = self.geo.geometry();
        let st = self.layout(s);
        let sop = &self.sops[s as usize];
        let rows = sop.rows.count();
        match mode {
            WriteMode::Rmw => {
                (0..g.data_chunks())
                    .map(|k| sop.dirty[usize::from(st.data_member(k))].count())
                    .sum::<u32>()
                    + rows * u32::from(g.parity_chunks())
            }
            _ => (0..g.data_chunks())
                .map(|k| rows - sop.dirty[usize::from(st.data_member(k))].count())
                .sum(),
        }
    }

    /// Plans the pass led by `s`; holds it (see the module docs) or issues it.
    fn plan_and_go(&mut self, s: u32) {
        let (mode, reads) = self.plan_pass(s);
        if reads > 0 && self.may_hold(s) {
            if self.sops[s as usize].held_ns.is_none() {
                self.sops[s as usize].held_ns = Some(self.now);
                self.stats.held_passes += 1;
                self.held_passes.push_back(s);
            }
            self.sops[s as usize].phase = Phase::PassHeld;
            return;
        }
        if reads > 0 && self.hold_expired(s) {
            // Held to the bound and still reading: the writes it waited for did not come,
            // so the clients' depth is what they have in flight now (it grows again with
            // their next submissions).
            self.write_depth = self.writes_in_flight;
            self.stats.expired_holds += 1;
        }
        self.unhold(s);
        self.issue_pass(s, mode, reads);
    }

    /// Whether the pass led by `s` has been held for [`Self::hold_bound_ns`].
    fn hold_expired(&self, s: u32) -> bool {
        self.sops[s as usize]
            .held_ns
            .is_some_and(|t| self.now >= t + self.hold_bound_ns())
    }

    /// The longest hold now, ns: [`HOLD_WRITE_LATENCIES`] times the shard's measured write
    /// latency (a client that writes again as soon as a write completes sends the
    /// stripe's next writes about one write latency later), at least
    /// [`ArrayConfig::write_hold_ns`] (which also covers clients whose writes arrive
    /// spaced by the network: three 64 KiB payloads take ~160 µs on 10 Gb/s) and at most
    /// [`MAX_HOLD_NS`] (unless the configured floor is higher). The rule and the figures
    /// that chose it: docs/BENCHMARKS.md, "Write passes", hold-sweep.
    pub(super) fn hold_bound_ns(&self) -> u64 {
        let scaled = (HOLD_WRITE_LATENCIES * self.write_latency_ns).min(MAX_HOLD_NS);
        scaled.max(self.write_hold_ns)
    }

    /// Feeds one write phase's latency (issue of its first member write to the last
    /// completion, ns) into the shard's write latency: an exponentially weighted mean
    /// (weight 1/16 per sample; the first sample is taken as it is).
    pub(super) fn note_write_latency(&mut self, ns: u64) {
        self.write_latency_ns = if self.write_latency_ns == 0 {
            ns
        } else {
            let old = self.write_latency_ns as i64;
            (old + (ns as i64 - old) / 16) as u64
        };
    }

    /// Takes the pass led by `s` off the held list, if it is there, counting the time.
    fn unhold(&mut self, s: u32) {
        if let Some(t) = self.sops[s as usize].held_ns.take() {
            self.stats.held_ns += self.now.saturating_sub(t);
            if let Some(i) = self.held_passes.iter().position(|&x| x == s) {
                self.held_passes.remove(i);
            }
        }
    }

    /// Whether the pass led by `s`, which would read, may wait for more writes now.
    fn may_hold(&self, s: u32) -> bool {
        let sop = &self.sops[s as usize];
        if self.write_hold_ns == 0
            || sop.pass_fua
            || sop.flushes_seen != self.flushes
            || sop.pass_writes >= self.write_batch
            || self.hold_expired(s)
            // A compare-and-write or OR-write has already read under its hold: it goes on.
            || self.reqs.get(sop.req).is_some_and(|r| r.op.combines())
            // Requests waiting for a stripe operation (none free, or bulk writes at their
            // share of the pool): they may be the writes this pass waits for.
            || (!self.backlog.is_empty()
                && (self.free_sops.is_empty() || self.bulk_sops >= self.bulk_share.cap()))
            // Only while the clients can send more writes: they have free slots (fewer
            // writes in flight than the most seen since the last futile hold), or writes
            // of theirs are in member I/O, whose completions free slots. Otherwise every
            // client waits on us and holding would wait for writes nobody can send.
            || (self.write_ops_in_io == 0 && self.writes_in_flight >= self.write_depth)
        {
            return false;
        }
        // Only a pass that continues a stream of writes (one of its writes starts where a
        // recent write request ended): random writes never coalesce, and holding them
        // only delays them.
        if !self.continues_stream(s) {
            return false;
        }
        // Only when the clients could still make the pass read nothing: their remaining
        // write depth, in writes the size of this pass's, covers the stripe's data that is
        // neither written by the pass nor cached. A stream whose depth cannot (4 KiB at
        // QD32 against 256 KiB of stripe data) would only line its queue up behind the
        // hold (measured: NVMe profile −5 to −16 %, docs/BENCHMARKS.md "hold-sweep").
        if !self.clients_could_fill(s) {
            return false;
        }
        // Nothing of the stripe that cannot join may wait behind it (a read, say).
        let stripe = sop.stripe;
        !self
            .waiting
            .iter()
            .any(|&w| self.sops[w as usize].stripe == stripe)
    }

    /// Whether writes the clients may still send could cover what the pass led by `s`
    /// lacks: (write depth − writes in the pass) × the pass's bytes per write ≥ the data
    /// blocks of the stripe neither written by the pass nor cached.
    fn clients_could_fill(&self, s: u32) -> bool {
        let g = self.geo.geometry();
        let st = self.layout(s);
        let sop = &self.sops[s as usize];
        let ent = self.cache.entry(sop.pass_entry);
        let (mut written, mut missing) = (0u64, 0u64);
        for k in 0..g.data_chunks() {
            let m = usize::from(st.data_member(k));
            written += u64::from(sop.dirty[m].count());
            missing += u64::from(cache::BlockSet::count_neither(&sop.dirty[m], &ent.valid[m]));
        }
        let writes = u64::from(sop.pass_writes.max(1));
        let more = u64::from(self.write_depth).saturating_sub(writes);
        more * written >= missing * writes
    }

    /// Whether the write leading the pass `s` continues a sequential stream: its request
    /// started where one of the shard's last [`RECENT_WRITES`] write requests ended when it
    /// was submitted ([`Array::note_write_end`]; tested at submission, where the stream's
    /// previous write is at most a few requests back whatever the client's queue depth).
    fn continues_stream(&self, s: u32) -> bool {
        self.reqs
            .get(self.sops[s as usize].req)
            .is_some_and(|r| r.sequential)
    }

    /// Remembers where a write request accepted by this shard ends (array byte offset)
    /// and its stream's length through that end (bytes), for [`Self::continues_stream`]
    /// and [`Self::stream_through`]: the last [`RECENT_WRITES`] of them.
    pub(super) fn note_write_end(&mut self, end: u64, stream_bytes: u64) {
        let i = self.recent_write_next % RECENT_WRITES;
        self.recent_write_ends[i] = (end, stream_bytes);
        self.recent_write_next = self.recent_write_next.wrapping_add(1);
    }

    /// A write of `len` bytes at array byte `offset`, tested at submission: whether it
    /// continues a sequential stream (it starts where one of the last [`RECENT_WRITES`]
    /// write requests ended), and the stream's length through its end, bytes.
    pub(super) fn stream_through(&self, offset: u64, len: u64) -> (bool, u64) {
        match self
            .recent_write_ends
            .iter()
            .find(|&&(end, _)| end == offset)
        {
            Some(&(_, before)) => (true, before.saturating_add(len)),
            None => (false, len),
        }
    }

    /// Whether pass `s`'s cache entry should be the next one recycled once the pass is
    /// done: its leading write is smaller than a stripe and continues a sequential
    /// stream, and the pass reaches the stripe's last data block (the stream has left the
    /// stripe). The stream's next stripe then works in buffers the CPU's caches still
    /// hold instead of the least recently used entry's (docs/BENCHMARKS.md, "Stripes a
    /// stream has left"). While the cache is [`cache::StripeCache::cautious`] (a stream
    /// lately came back to a stripe it had left: a region rewritten in laps that the
    /// cache can hold), only a stream longer than the whole cache recycles: it could not
    /// find the stripe cached again before recency evicted it anyway. A stream of writes
    /// of a stripe or more takes entries only for the stripes its writes share at their
    /// ends (the rest are full-stripe writes), far fewer than its bytes suggest: those
    /// stay in recency order.
    fn recycle_first(&self, s: u32) -> bool {
        if !self.stream_moves_on(s) {
            return false;
        }
        let g = self.geo.geometry();
        let last = usize::from(self.layout(s).data_member(g.data_chunks() - 1));
        let dirty = &self.sops[s as usize].dirty[last];
        dirty.contains(dirty.capacity() - 1)
    }

    /// Whether pass `s` belongs to a stream that will not find what the pass leaves in
    /// the cache again: its leading write is smaller than a stripe and continues a
    /// sequential stream, and the cache is not [`cache::StripeCache::cautious`] (or the
    /// stream is longer than the whole cache). What such a pass writes need not be cached:
    /// the stream's later passes of the stripe write other chunks, and it does not come
    /// back ([`Self::recycle_first`], and [`Gathered`]: gathered writes cache nothing).
    fn stream_moves_on(&self, s: u32) -> bool {
        let sop = &self.sops[s as usize];
        let Some(r) = self.reqs.get(sop.req) else {
            return false;
        };
        let g = self.geo.geometry();
        let after = if self.cache.cautious() {
            self.cache.len() as u64 * g.stripe_data_bytes()
        } else {
            0
        };
        r.sequential && r.len < g.stripe_data_bytes() && r.stream_bytes > after
    }

    /// The passes being held: gather what arrived, and issue those that need no reads any
    /// more or may not wait longer.
    pub(super) fn held_work(&mut self) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.held_passes.len() {
            let s = self.held_passes[i];
            if self.stripe_degraded(s) {
                // A member was lost while the pass waited: the leader goes on alone on the
                // degraded path, its followers after it.
                self.unhold(s);
                self.abort_pass(s);
                self.start_write(s);
                any = true;
                continue;
            }
            let before = self.sops[s as usize].pass_writes;
            self.gather(s);
            let (_, reads) = self.plan_pass(s);
            if reads > 0 && self.may_hold(s) {
                any |= self.sops[s as usize].pass_writes != before;
                i += 1;
                continue;
            }
            // plan_and_go takes it off the list.
            self.plan_and_go(s);
            any = true;
        }
        any
    }

    /// The earliest time a held pass must go, ns (array clock).
    pub(super) fn hold_deadline_ns(&self) -> Option<u64> {
        self.held_passes
            .iter()
            .filter_map(|&s| self.sops[s as usize].held_ns)
            .min()
            .map(|t| t + self.hold_bound_ns())
    }

    /// Issues the pass's reads (into its cache entry), or goes straight to compute and
    /// write when it needs none.
    fn issue_pass(&mut self, s: u32, mode: WriteMode, reads: u32) {
        let unit = self.geo.geometry().block_bytes();
        self.stats.write_passes += 1;
        self.stats.batched_writes += u64::from(self.sops[s as usize].pass_writes);
        self.stats.cache_hit_bytes +=
            u64::from(self.uncached_reads(s, mode) - reads) * u64::from(unit);
        let mut f = s;
        while f != NONE {
            let sop = &self.sops[f as usize];
            self.stats.pass_written_bytes += sop.end - sop.start;
            f = sop.next;
        }
        if reads == 0 {
            return self.pass_write(s, mode);
        }
        let (mode, reads) = if mode != WriteMode::FullStripe && self.continues_stream(s) {
            (WriteMode::Rcw, self.prefetch_stripe(s))
        } else {
            (mode, reads)
        };
        self.stats.write_read_bytes += u64::from(reads) * u64::from(unit);
        let e = self.sops[s as usize].pass_entry;
        self.sops[s as usize].phase = Phase::PassRead(mode);
        self.sops[s as usize].io_error = false;
        for m in 0..self.slots() {
            let mut at = 0;
            while let Some((a, b)) = self.sops[s as usize].need[m].run_from(at) {
                at = b;
                let ptr = self.cache.entry_mut(e).bufs[m]
                    .as_mut_ptr()
                    .wrapping_add((a * unit) as usize);
                self.io(s, m as u16, Op::Read, a * unit, (b - a) * unit, ptr);
            }
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// Plans the reads of a pass of a sequential stream that must read anyway as a read of
    /// all the stripe's data it lacks — every block of every data chunk neither cached nor
    /// written by the pass, except the rest of the chunk the stream is writing (it will be
    /// overwritten before any parity needs it) — to be written RCW: one larger read per member now, instead of
    /// a small read for each following write of the stream (a QD1 stream of 4 KiB writes
    /// would read three 4 KiB blocks for every block it writes, RAID6; with the stripe
    /// cached the rest of the stripe's writes read nothing). Returns the blocks to read.
    fn prefetch_stripe(&mut self, s: u32) -> u32 {
        let g = *self.geo.geometry();
        let st = self.layout(s);
        // Where the stream's front is: the end of the pass's furthest write (stripe data
        // bytes). The stream overwrites the rest of that chunk before it needs its old
        // data for another chunk's parity, so those blocks are not read (unless a row the
        // pass writes needs them now).
        let mut front = 0;
        let mut f = s;
        while f != NONE {
            front = front.max(self.sops[f as usize].end);
            f = self.sops[f as usize].next;
        }
        let chunk = u64::from(g.chunk_bytes());
        let unit = u64::from(g.block_bytes());
        let front_k = ((front.max(1) - 1) / chunk) as u16;
        let front_block = (front - u64::from(front_k) * chunk).div_ceil(unit) as u32;
        let sop = &mut self.sops[s as usize];
        let ent = self.cache.entry(sop.pass_entry);
        let mut reads = 0;
        for k in 0..g.data_chunks() {
            let m = usize::from(st.data_member(k));
            let n = &mut sop.need[m];
            n.set_neither(&sop.dirty[m], &ent.valid[m]);
            if k == front_k {
                n.remove_range(front_block, n.capacity());
                n.union_difference2(&sop.rows, &sop.dirty[m], &ent.valid[m]);
            }
            reads += n.count();
        }
        for m in [Some(st.p_member()), st.q_member()].into_iter().flatten() {
            sop.need[usize::from(m)].clear();
        }
        reads
    }

    /// The pass's reads are back: on an error the pass ends its gathering (followers back
    /// to the head of the waiting operations) and the leader is planned again alone;
    /// otherwise what was read becomes valid and the pass computes and writes.
    pub(super) fn pass_read_done(&mut self, s: u32, mode: WriteMode) {
        if self.sops[s as usize].io_error {
            self.abort_pass(s);
            return self.start_write(s);
        }
        let e = self.sops[s as usize].pass_entry;
        if self.cache.current(e) {
            for m in 0..self.slots() {
                let n = &self.sops[s as usize].need[m];
                self.cache.entry_mut(e).valid[m].union_with(n);
            }
        }
        self.pass_write(s, mode);
    }

    /// Undoes the pass led by `s` before any write went out: its followers return to the
    /// head of the waiting operations in their order, its cache entry is unpinned and
    /// forgotten, and `s` is a lone operation again.
    fn abort_pass(&mut self, s: u32) {
        let mut chain: ArrayVec<u32, 256> = ArrayVec::new();
        let mut f = std::mem::replace(&mut self.sops[s as usize].next, NONE);
        while f != NONE {
            let next = std::mem::replace(&mut self.sops[f as usize].next, NONE);
            self.sops[f as usize].phase = Phase::Queued;
            // A pass holds at most every stripe operation.
            if chain.try_push(f).is_err() {
                unreachable!("more followers than stripe operations");
            }
            f = next;
        }
        for &f in chain.iter().rev() {
            self.waiting.push_front(f);
        }
        let e = std::mem::replace(&mut self.sops[s as usize].pass_entry, NONE);
        self.cache.unpin(e, false);
        self.sops[s as usize].phase = Phase::Queued;
    }

    /// Marks the data chunks of the pass that one operation alone writes, over every
    /// touched row: their parity sources and member writes come straight from that
    /// operation's buffer (no copy into the entry; full-stripe and chunk-sized writes cost
    /// what they cost without a cache), and the entry does not hold their new data.
    /// `pass_direct[m]` is then the address of chunk offset 0 of member `m`'s chunk in the
    /// caller's buffer (only ever dereferenced inside that write's range).
    ///
    /// Chunks that several operations write, one after the other in submission order
    /// without gap or overlap, over every touched row are marked the same way through
    /// `pass_gather` ([`Gathered`]) when every member's channel gathers, no Partial Parity
    /// Log is kept, and the pass belongs to a stream of small writes that moves on
    /// ([`Self::stream_moves_on`]): a region rewritten in laps the cache can hold, or
    /// large writes sharing a stripe at their ends, find their stripes cached again only
    /// if the pass copies.
    fn find_direct(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let c = u64::from(g.chunk_bytes());
        let unit = g.block_bytes();
        let st = self.layout(s);
        let Some((first, _)) = self.sops[s as usize].rows.run_from(0) else {
            return;
        };
        let mut last = first;
        let mut at = 0;
        while let Some((_, b)) = self.sops[s as usize].rows.run_from(at) {
            at = b;
            last = b;
        }
        let (lo, hi) = (first * unit, last * unit);
        // Per data chunk: how many operations write it, the last one, the first one's
        // start, the last one's end, and whether they follow each other block-aligned.
        let mut writers: ArrayVec<Writers, MAX_DATA_CHUNKS> = ArrayVec::new();
        for _ in 0..g.data_chunks() {
            writers.push(Writers {
                n: 0,
                last: NONE,
                start: 0,
                end: 0,
                follow: true,
                gather: false,
            });
        }
        let mut f = s;
        while f != NONE {
            for (k, x) in self.footprint(f).chunks() {
                let w = &mut writers[usize::from(k)];
                if w.n == 0 {
                    w.start = x.start;
                } else {
                    w.follow &= x.start == w.end;
                }
                w.follow &= x.start.is_multiple_of(unit) && x.end.is_multiple_of(unit);
                w.n += 1;
                w.last = f;
                w.end = x.end;
            }
            f = self.sops[f as usize].next;
        }
        // Pass-level conditions of gathering, asked once.
        let may_gather = self.stream_moves_on(s) && self.gathers(hi - lo);
        for k in 0..g.data_chunks() {
            let w = &mut writers[usize::from(k)];
            let m = usize::from(st.data_member(k));
            if w.n == 1 && w.start <= lo && w.end >= hi {
                let p = self.client_ptr(w.last, u64::from(k) * c + u64::from(w.start));
                self.sops[s as usize].pass_direct[m] = (p as usize).wrapping_sub(w.start as usize);
            } else if may_gather
                && w.n > 1
                && w.n as usize <= MAX_GATHER
                && w.follow
                && w.start == lo
                && w.end == hi
            {
                self.sops[s as usize].pass_gather[m].start = lo;
                w.gather = true;
            }
        }
        if !writers.iter().any(|w| w.gather) {
            return;
        }
        // The pieces of the gathered chunks, in submission order (= chunk order).
        let mut f = s;
        while f != NONE {
            for (k, x) in self.footprint(f).chunks() {
                let m = usize::from(st.data_member(k));
                if writers[usize::from(k)].gather {
                    let p = self.client_ptr(f, u64::from(k) * c + u64::from(x.start));
                    let seg = IoSeg {
                        base: p,
                        len: x.len() as usize,
                    };
                    self.sops[s as usize].pass_gather[m].segs.push(seg);
                }
            }
            f = self.sops[f as usize].next;
        }
    }

    /// Whether a data chunk's `len` bytes may go out as one gathered write: every device
    /// entry's channel gathers and takes `len` bytes in one request, and no Partial Parity
    /// Log is kept.
    fn gathers(&self, len: u32) -> bool {
        self.ppl.is_none()
            && self
                .members
                .iter()
                .all(|m| m.ch.gathers() && m.max_transfer >= len)
    }

    /// A cursor at the first piece of every member's gathered chunk of the pass led by `s`
    /// (indexed by member; unused for chunks not gathered).
    fn gather_cursors(&self, s: u32) -> ArrayVec<GatherCursor, MAX_MEMBERS> {
        self.sops[s as usize]
            .pass_gather
            .iter()
            .map(Gathered::cursor)
            .collect()
    }

    /// Whether the pass led by `s` writes member `m`'s chunk from its callers' buffers
    /// (one, `pass_direct`, or several, `pass_gather`) rather than from its cache entry.
    pub(super) fn writes_direct(&self, s: u32, m: usize) -> bool {
        let sop = &self.sops[s as usize];
        sop.pass_direct[m] != 0 || sop.pass_gather[m].is_set()
    }

    /// The new data the pass led by `s` writes at chunk byte `off` of member `m` when it
    /// writes that chunk from its callers' buffers ([`Self::writes_direct`]): the address
    /// of that byte and how many bytes follow it contiguously (at least to the end of the
    /// block; up to the piece's end when gathered). `None` when not written direct or
    /// outside what the pass writes there.
    pub(super) fn direct_data(&self, s: u32, m: usize, off: u32) -> Option<(*const u8, u32)> {
        let sop = &self.sops[s as usize];
        let direct = sop.pass_direct[m];
        if direct != 0 {
            return Some(((direct as *const u8).wrapping_add(off as usize), u32::MAX));
        }
        sop.pass_gather[m].find(off)
    }

    /// Copies the new data of every operation of the pass into the cache entry, in
    /// submission order (later bytes win).
    fn overlay(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let c = u64::from(g.chunk_bytes());
        let st = self.layout(s);
        let e = self.sops[s as usize].pass_entry;
        let mut f = s;
        while f != NONE {
            let w = self.footprint(f);
            for (k, x) in w.chunks() {
                if self.writes_direct(s, usize::from(st.data_member(k))) {
                    // Written straight from the callers' buffers (see `find_direct`).
                    continue;
                }
                let src = self.client_ptr(f, u64::from(k) * c + u64::from(x.start));
                let dst = self.cache.entry_mut(e).bufs[usize::from(st.data_member(k))]
                    .as_mut_ptr()
                    .wrapping_add(x.start as usize);
                // SAFETY: src is the caller's buffer range for these bytes of chunk k (lent
                // until the request completes; or the chunk-sized zero buffer for
                // write-zeroes), dst the pinned cache entry's chunk buffer at the same
                // chunk offset, x.len() bytes inside the chunk; they never overlap.
                unsafe { std::ptr::copy_nonoverlapping(src, dst, x.len() as usize) };
            }
            f = self.sops[f as usize].next;
        }
    }

    /// Computes the pass's parity in its cache entry and issues its writes.
    fn pass_write(&mut self, s: u32, mode: WriteMode) {
        let g = *self.geo.geometry();
        let unit = g.block_bytes();
        let nd = g.data_chunks();
        let st = self.layout(s);
        let e = self.sops[s as usize].pass_entry;
        let members = self.slots();
        // Pointers to the entry's member buffers: P/Q are written while data is read, and
        // the borrow checker cannot split one Vec that way.
        let mut eb: ArrayVec<*mut u8, MAX_MEMBERS> = ArrayVec::new();
        for m in 0..members {
            eb.push(self.cache.entry_mut(e).bufs[m].as_mut_ptr());
        }
        let pm = usize::from(st.p_member());
        let qm = st.q_member().map(usize::from);
        let lone = self.sops[s as usize].next == NONE && self.footprint(s).touched() == 1;
        // The written blocks and P/Q rows are not valid until the writes are durable.
        {
            let sop = &self.sops[s as usize];
            let ent = self.cache.entry_mut(e);
            for k in 0..nd {
                let m = usize::from(st.data_member(k));
                for (a, b) in sop.dirty[m].runs() {
                    ent.valid[m].remove_range(a, b);
                }
            }
            for m in [Some(pm), qm].into_iter().flatten() {
                for (a, b) in sop.rows.runs() {
                    ent.valid[m].remove_range(a, b);
                }
            }
        }
        match mode {
            WriteMode::Rmw if lone => {
                // One write inside one chunk: old data from the entry, new from the caller,
                // straight into the kernel; then the new data goes into the entry.
                let c = u64::from(g.chunk_bytes());
                let (k, x) = self.footprint(s).chunks().next().expect("one chunk");
                let src = self.client_ptr(s, u64::from(k) * c + u64::from(x.start));
                let m = usize::from(st.data_member(k));
                let (a, len) = (x.start as usize, x.len() as usize);
                // SAFETY: eb[m], eb[pm], eb[qm] are distinct members' chunk buffers of the
                // pinned entry (chunk bytes each; a..a+len lies in the chunk); src is the
                // caller's range for exactly these bytes (lent for the request's life).
                unsafe {
                    let old = std::slice::from_raw_parts(eb[m].add(a), len);
                    let new = std::slice::from_raw_parts(src, len);
                    let deltas = [Delta {
                        slot: st.q_slot(k) as u8,
                        old,
                        new,
                    }];
                    let q = qm.map(|q| eb[q]);
                    parity_into(&self.parity, eb[pm], q, a, len, ParityWork::Update(&deltas));
                    if len <= LONE_COPY_MAX {
                        std::ptr::copy_nonoverlapping(src, eb[m].add(a), len);
                    }
                }
                if len > LONE_COPY_MAX {
                    // Written from the caller's buffer, not cached.
                    let sop = &mut self.sops[s as usize];
                    sop.pass_direct[m] = (src as usize).wrapping_sub(a);
                }
            }
            WriteMode::Rmw => {
                // Keep the old contents of the touched rows of every written chunk in the
                // leader's own buffers (same chunk offsets), overlay, then P/Q ⊕= Δ per
                // run of touched rows. Blocks of a row the pass does not write have
                // old = new there, so their Δ is zero. A chunk written from the callers'
                // buffers (`find_direct`; only for a stream that moves on, which will not
                // read the new data from the entry again) keeps its old contents in the
                // entry and takes its new ones from those buffers, piece by piece.
                if self.stream_moves_on(s) {
                    self.find_direct(s);
                }
                let mut at = 0;
                while let Some((a, b)) = self.sops[s as usize].rows.run_from(at) {
                    at = b;
                    let (off, len) = ((a * unit) as usize, ((b - a) * unit) as usize);
                    for k in 0..nd {
                        let m = usize::from(st.data_member(k));
                        let direct = self.writes_direct(s, m);
                        let sop = &mut self.sops[s as usize];
                        if sop.dirty[m].any_in(a, b) && !direct {
                            // SAFETY: eb[m] is the pinned entry's chunk buffer of member m
                            // and sop.bufs[m] the leader's own chunk buffer: distinct
                            // allocations, off+len inside both.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    eb[m].add(off),
                                    sop.bufs[m].as_mut_ptr().add(off),
                                    len,
                                )
                            };
                        }
                    }
                }
                self.overlay(s);
                let mut at = 0;
                while let Some((a, b)) = self.sops[s as usize].rows.run_from(at) {
                    at = b;
                    let (mut pos, end) = (a * unit, b * unit);
                    let sop = &self.sops[s as usize];
                    let mut cursors = self.gather_cursors(s);
                    while pos < end {
                        // The piece from `pos` over which every source is contiguous.
                        let mut news: ArrayVec<(usize, u16, *const u8), MAX_DATA_CHUNKS> =
                            ArrayVec::new();
                        let mut piece_end = end;
                        for k in 0..nd {
                            let m = usize::from(st.data_member(k));
                            if !sop.dirty[m].any_in(a, b) {
                                continue;
                            }
                            let new = if sop.pass_gather[m].is_set() {
                                let (p, n) = sop.pass_gather[m]
                                    .piece(pos, &mut cursors[m])
                                    .expect("gathered pieces cover every touched row");
                                piece_end = piece_end.min(pos + n);
                                p
                            } else if sop.pass_direct[m] != 0 {
                                (sop.pass_direct[m] as *const u8).wrapping_add(pos as usize)
                            } else {
                                eb[m].wrapping_add(pos as usize).cast_const()
                            };
                            news.push((m, k, new));
                        }
                        let (off, len) = (pos as usize, (piece_end - pos) as usize);
                        let mut deltas: ArrayVec<Delta<'_>, MAX_DATA_CHUNKS> = ArrayVec::new();
                        for &(m, k, new) in &news {
                            let old = if self.writes_direct(s, m) {
                                // SAFETY: the entry's buffer of data member m (its old
                                // contents: nothing is copied into a direct chunk), off+len
                                // inside the chunk; only P/Q buffers are written below.
                                unsafe { std::slice::from_raw_parts(eb[m].add(off), len) }
                            } else {
                                &sop.bufs[m][off..off + len]
                            };
                            deltas.push(Delta {
                                slot: st.q_slot(k) as u8,
                                old,
                                // SAFETY: the entry's buffer of data member m, or the
                                // caller's buffer holding chunk bytes off..off+len of it
                                // (`find_direct`: lent until the writes complete;
                                // `piece_end` keeps the range inside one piece); only
                                // P/Q buffers are written below.
                                new: unsafe { std::slice::from_raw_parts(new, len) },
                            });
                        }
                        let (p, q) = (eb[pm], qm.map(|q| eb[q]));
                        // SAFETY: P's and Q's entry buffers (chunk bytes, off+len inside),
                        // distinct from the data buffers the deltas read and from the
                        // leader's buffers.
                        unsafe {
                            parity_into(&self.parity, p, q, off, len, ParityWork::Update(&deltas))
                        };
                        pos = piece_end;
                    }
                }
            }
            WriteMode::Rcw | WriteMode::FullStripe => {
                self.find_direct(s);
                self.overlay(s);
                // Per Q slot: chunk offset 0 of the data (entry, or the one caller's buffer),
                // or the member whose chunk is gathered.
                let mut data: ArrayVec<(*const u8, usize), MAX_DATA_CHUNKS> = ArrayVec::new();
                for _ in 0..nd {
                    data.push((std::ptr::null(), usize::MAX));
                }
                for k in 0..nd {
                    let m = usize::from(st.data_member(k));
                    let sop = &self.sops[s as usize];
                    data[usize::from(st.q_slot(k))] = if sop.pass_gather[m].is_set() {
                        (std::ptr::null(), m)
                    } else if sop.pass_direct[m] != 0 {
                        (sop.pass_direct[m] as *const u8, usize::MAX)
                    } else {
                        (eb[m].cast_const(), usize::MAX)
                    };
                }
                let mut at = 0;
                while let Some((a, b)) = self.sops[s as usize].rows.run_from(at) {
                    at = b;
                    let (mut pos, end) = (a * unit, b * unit);
                    let sop = &self.sops[s as usize];
                    let mut cursors = self.gather_cursors(s);
                    while pos < end {
                        // The piece from `pos` over which every source is contiguous.
                        let mut ptrs: ArrayVec<*const u8, MAX_DATA_CHUNKS> = ArrayVec::new();
                        let mut piece_end = end;
                        for &(p, m) in &data {
                            if m == usize::MAX {
                                ptrs.push(p.wrapping_add(pos as usize));
                            } else {
                                let (p, n) = sop.pass_gather[m]
                                    .piece(pos, &mut cursors[m])
                                    .expect("gathered pieces cover every touched row");
                                piece_end = piece_end.min(pos + n);
                                ptrs.push(p);
                            }
                        }
                        let (off, len) = (pos as usize, (piece_end - pos) as usize);
                        let mut srcs: ArrayVec<&[u8], MAX_DATA_CHUNKS> = ArrayVec::new();
                        for &p in &ptrs {
                            // SAFETY: each pointer addresses chunk byte `off` of a data
                            // chunk: in the entry's buffer (the whole chunk), in the
                            // caller's buffer of the one write that covers every touched
                            // row of that chunk, or in the piece of a gathered chunk that
                            // holds it, `piece_end` keeping off..off+len inside that piece
                            // (`find_direct`; callers' buffers are lent until the writes
                            // complete); P/Q (written below) are other members' entry
                            // buffers.
                            srcs.push(unsafe { std::slice::from_raw_parts(p, len) });
                        }
                        let (p, q) = (eb[pm], qm.map(|q| eb[q]));
                        // SAFETY: P's and Q's entry buffers (chunk bytes, off+len inside),
                        // distinct from every data source.
                        unsafe {
                            parity_into(&self.parity, p, q, off, len, ParityWork::Gen(&srcs))
                        };
                        pos = piece_end;
                    }
                }
            }
            WriteMode::Degraded => unreachable!("degraded stripes take the single path"),
        }
        if self.ppl_gate(s, super::ppl::Logged::Pass, mode) {
            return;
        }
        self.issue_pass_writes(s, mode);
    }

    /// Issues the pass's member writes from its cache entry: the written blocks of every
    /// data member, P/Q over the touched rows; FUA if any write of the pass is.
    pub(super) fn issue_pass_writes(&mut self, s: u32, mode: WriteMode) {
        let g = *self.geo.geometry();
        let unit = g.block_bytes();
        let st = self.layout(s);
        let e = self.sops[s as usize].pass_entry;
        let fua = self.sops[s as usize].pass_fua;
        let sop = &mut self.sops[s as usize];
        sop.phase = Phase::PassWrite;
        sop.mode = mode;
        sop.io_error = false;
        for m in 0..self.slots() {
            let set_is_rows = !matches!(st.role(m as u16), Role::Data { .. });
            let mut at = 0;
            loop {
                let sop = &self.sops[s as usize];
                let set = if set_is_rows {
                    &sop.rows
                } else {
                    &sop.dirty[m]
                };
                let Some((a, b)) = set.run_from(at) else {
                    break;
                };
                at = b;
                if !set_is_rows && self.sops[s as usize].pass_gather[m].is_set() {
                    let g = &self.sops[s as usize].pass_gather[m];
                    debug_assert_eq!((g.start, g.segs.len() > 1), (a * unit, true));
                    let list = std::ptr::NonNull::from(&g.segs[0]);
                    let count = g.segs.len() as u16;
                    self.io_write_gathered(s, m as u16, fua, a * unit, (b - a) * unit, list, count);
                    continue;
                }
                let direct = self.sops[s as usize].pass_direct[m];
                let base = if direct != 0 && !set_is_rows {
                    direct as *mut u8
                } else {
                    self.cache.entry_mut(e).bufs[m].as_mut_ptr()
                };
                let ptr = base.wrapping_add((a * unit) as usize);
                self.io_write(
                    s,
                    m as u16,
                    Op::Write { fua },
                    a * unit,
                    (b - a) * unit,
                    ptr,
                );
            }
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// A write (pass or single) of operation `s` is back: counts it by mode, and returns
    /// its status — [`ArrayError::Unrecoverable`] when the array has lost more members than
    /// its redundancy, so the stripe's data is gone — and how many members are failed.
    pub(super) fn write_done(&mut self, s: u32) -> (Result<(), ArrayError>, usize) {
        let g = *self.geo.geometry();
        match self.sops[s as usize].mode {
            WriteMode::FullStripe => self.stats.full_stripe_writes += 1,
            WriteMode::Rmw => self.stats.rmw_writes += 1,
            WriteMode::Rcw => self.stats.rcw_writes += 1,
            WriteMode::Degraded => self.stats.degraded_writes += 1,
        }
        let lost = (0..g.members()).filter(|&m| self.is_failed(m)).count();
        let status = if lost > usize::from(g.parity_chunks()) {
            Err(ArrayError::Unrecoverable {
                stripe: self.sops[s as usize].stripe,
            })
        } else {
            Ok(())
        };
        (status, lost)
    }

    /// The pass's writes are back: counts it, marks what it wrote valid in the cache (when
    /// every write succeeded and nothing invalidated the cache meanwhile), and completes
    /// every operation of the pass with its status.
    pub(super) fn pass_written(&mut self, s: u32) {
        let st = self.layout(s);
        let (status, lost) = self.write_done(s);
        let e = std::mem::replace(&mut self.sops[s as usize].pass_entry, NONE);
        let ok = !self.sops[s as usize].io_error && lost == 0 && self.cache.current(e);
        if ok {
            let sop = &self.sops[s as usize];
            let ent = self.cache.entry_mut(e);
            for m in 0..ent.valid.len() {
                let set = match st.role(m as u16) {
                    // Written from the caller's buffer: the entry does not hold it.
                    Role::Data { .. } if sop.pass_direct[m] != 0 || sop.pass_gather[m].is_set() => {
                        continue
                    }
                    Role::Data { .. } => &sop.dirty[m],
                    _ => &sop.rows,
                };
                ent.valid[m].union_with(set);
            }
        }
        let recycle = self.recycle_first(s);
        self.cache.unpin(e, ok);
        if recycle {
            self.cache.demote(e);
        }
        let mut f = std::mem::replace(&mut self.sops[s as usize].next, NONE);
        while f != NONE {
            let next = std::mem::replace(&mut self.sops[f as usize].next, NONE);
            self.finish_sop(f, status);
            f = next;
        }
        self.finish_sop(s, status);
    }
}

/// What [`parity_into`] computes into P (and Q).
enum ParityWork<'a, 'b> {
    /// P/Q regenerated from every data chunk, in Q slot order.
    Gen(&'a [&'b [u8]]),
    /// Read-modify-write deltas applied to the old P/Q in place.
    Update(&'a [Delta<'b>]),
}

/// Computes `work` into P (and, RAID6, Q) over bytes `off..off + len` of a pass's cache
/// entry buffers `p` and `q`.
///
/// # Safety
/// `p` and `q` are distinct chunk buffers of the pass's pinned cache entry, each at least
/// `off + len` bytes, and no slice in `work` overlaps either of them.
unsafe fn parity_into(
    parity: &crate::parity::Parity,
    p: *mut u8,
    q: Option<*mut u8>,
    off: usize,
    len: usize,
    work: ParityWork<'_, '_>,
) {
    // SAFETY: the caller's contract: in bounds, distinct, not aliased by `work`.
    let p = unsafe { std::slice::from_raw_parts_mut(p.add(off), len) };
    // SAFETY: as above.
    let q = q.map(|q| unsafe { std::slice::from_raw_parts_mut(q.add(off), len) });
    match (work, q) {
        (ParityWork::Gen(d), Some(q)) => parity.gen_pq(d, p, q),
        (ParityWork::Gen(d), None) => parity.gen_p(d, p),
        (ParityWork::Update(d), Some(q)) => parity.update_pq(d, p, q),
        (ParityWork::Update(d), None) => parity.update_p(d, p),
    }
}
