//! Request and stripe-operation lifecycle: splitting requests, ordering and starting
//! operations on their stripes, the stripe gate, finishing operations and requests,
//! flushes.

use crate::device::Channel;
use crate::process::ProcessError;
use crate::shard::owner;
use crate::stripe::StripeWrite;

use super::{
    Array, ArrayCompletion, ArrayError, ArrayOp, ArrayRequest, GateHold, MemberState, Phase,
    ReplaceState, RequestClass,
};

impl<C: Channel> Array<C> {
    // ---- request and operation lifecycle -------------------------------------------------

    pub(super) fn split_backlog(&mut self) -> bool {
        let mut any = false;
        let stripe_bytes = self.geo.geometry().stripe_data_bytes();
        // Front-door scheduling (issue 24): bulk writes take at most the bulk share's cap
        // of stripe operations; a request behind bulk writes that wait for that cap goes ahead of
        // them unless it overlaps one of them (overlapping requests keep their order, so
        // later bytes still win and a read sees what some prefix of the submission order
        // wrote).
        let mut i = 0;
        // Bulk writes in `backlog[..i]` (passed over by the scan, still waiting).
        let mut bulk_before = 0;
        self.fast_blocked = false;
        debug_assert_eq!(
            self.backlog_bulk as usize,
            self.backlog
                .iter()
                .filter(|&&r| {
                    self.reqs.get(r).expect("backlogged").class == RequestClass::BulkWrite
                })
                .count()
        );
        while i < self.backlog.len() {
            let ri = self.backlog[i];
            let Some(s) = self.free_sops.last().copied() else {
                break;
            };
            let cap_spent = self.bulk_sops >= self.bulk_share.cap();
            let bytes_spent = self.turn_bulk_bytes >= self.turn_bulk_limit;
            if (cap_spent || bytes_spent)
                && self.backlog.len() - i == (self.backlog_bulk - bulk_before) as usize
            {
                // Only bulk writes are left and none of them may start now: stop here
                // with what passing over each of them (below) would have recorded.
                if self.free_sops.len() == 1 && self.fast_in_flight > 0 {
                    self.fast_blocked = true;
                } else if !cap_spent {
                    self.turn_bulk_deferred = true;
                }
                break;
            }
            let req = self.reqs.get(ri).expect("backlogged request");
            if req.op.is_flush() {
                // A flush covers what completed before it: it may pass queued writes.
                remove_at(&mut self.backlog, i);
                self.backlog_writes -= 1;
                self.start_flush(ri);
                any = true;
                continue;
            }
            if self.free_sops.len() == 1 && self.fast_in_flight > 0 && !req.retry_held {
                // The last free operation is kept for a failed fast-path read's retry
                // (`read.rs`): the read keeps its stripe hold until an operation takes it
                // over, and every other operation may be waiting for that stripe. Until
                // the fast-path reads in flight are done, no new one goes out.
                self.fast_blocked = true;
                break;
            }
            let bulk = req.class == RequestClass::BulkWrite;
            if bulk && cap_spent {
                bulk_before += 1;
                i += 1;
                continue;
            }
            // The turn's bulk bytes (`ArrayConfig::bulk_bytes_per_turn`, while the bound
            // holds) are spent: the rest of the bulk work waits for the next `process`
            // call, and what is behind it may go ahead.
            if bulk && bytes_spent {
                self.turn_bulk_deferred = true;
                bulk_before += 1;
                i += 1;
                continue;
            }
            if i > 0 && self.overlaps_earlier(i) {
                // Waits for the data of an earlier request, not for a stripe operation:
                // not the bulk share's signal.
                self.reqs.get_mut(ri).expect("backlogged").ordered = true;
                bulk_before += u32::from(bulk);
                i += 1;
                continue;
            }
            let req = self.reqs.get_mut(ri).expect("backlogged request");
            let read = req.op.is_read();
            let (stripe, start) = self.geo.stripe_of(req.offset + req.split);
            let end = (start + (req.len - req.split)).min(stripe_bytes);
            let buf_off = req.split;
            // A fast-path read that met an unrecovered read error runs again without the
            // member that returned it (`read.rs`).
            let retry_bad = std::mem::replace(&mut req.retry_bad, super::NO_ENTRY);
            let retry_held = req.retry_held;
            req.split += end - start;
            req.pending += 1;
            let fully = req.split == req.len;
            self.free_sops.pop();
            self.bulk_sops += u32::from(bulk);
            if bulk {
                self.turn_bulk_bytes += end - start;
            }
            let layout = self.geo.stripe(stripe);
            let g = self.geo.geometry();
            let fp = StripeWrite::from_range(g.data_chunks(), g.chunk_bytes(), start, end);
            let sop = &mut self.sops[s as usize];
            sop.req = ri;
            sop.stripe = stripe;
            sop.layout = layout;
            sop.start = start;
            sop.end = end;
            sop.fp = fp;
            sop.buf_off = buf_off;
            sop.phase = Phase::Queued;
            sop.outstanding = 0;
            sop.io_error = false;
            sop.unsupported = false;
            sop.bad.clear();
            if retry_bad != super::NO_ENTRY {
                sop.bad.push(retry_bad);
            }
            sop.regions = 0..0;
            sop.foreign = self.shards > 1 && owner(stripe, self.shards) != self.shard;
            sop.gate = GateHold::None;
            sop.next = super::cache::NONE;
            sop.bulk = bulk;
            if fully {
                remove_at(&mut self.backlog, i);
                self.backlog_writes -= u32::from(!read);
                self.backlog_bulk -= u32::from(bulk);
                if i > 0 {
                    self.stats.overtaking_requests += 1;
                }
            }
            any = true;
            if retry_held {
                // A failed fast-path read (inside one stripe, so split whole): its stripe
                // operation takes over the stripe hold it kept and starts at once, ahead of
                // what arrived after it and waits for the stripe.
                debug_assert!(fully && read);
                self.retry_fast_read(ri, s);
                continue;
            }
            if read && self.waiting.is_empty() && !self.locked.conflicts(stripe, false) {
                self.locked.take(stripe, s, false);
                self.start_sop(s);
            } else if read
                && !self
                    .waiting
                    .iter()
                    .any(|&w| self.sops[w as usize].stripe == stripe)
                && self.read_from_pass(s)
            {
                // Served from the pass holding the stripe (no earlier operation of the
                // stripe waits, so the per-stripe order holds).
            } else {
                if read
                    && (self.locked.conflicts(stripe, false)
                        || self
                            .waiting
                            .iter()
                            .any(|&w| self.sops[w as usize].stripe == stripe))
                {
                    // Waits for its stripe (an earlier operation of it): ordering, whose
                    // length the devices decide — not the bulk share's signal.
                    self.reqs.get_mut(ri).expect("live").ordered = true;
                }
                self.waiting.push_back(s);
            }
        }
        any
    }

    /// Whether the backlogged request at `i` overlaps (array bytes) one queued before it.
    fn overlaps_earlier(&self, i: usize) -> bool {
        let r = self.reqs.get(self.backlog[i]).expect("backlogged");
        let (a, b) = (r.offset + r.split, r.offset + r.len);
        self.backlog.iter().take(i).any(|&e| {
            let e = self.reqs.get(e).expect("backlogged");
            !e.op.is_flush() && e.offset + e.split < b && a < e.offset + e.len
        })
    }

    /// Starts every waiting operation its stripe admits, oldest first: a write when
    /// nothing runs on the stripe, a read when only reads run there; and never one with an
    /// older operation of its stripe still waiting (per-stripe FIFO, see the module docs).
    pub(super) fn start_waiting(&mut self) -> bool {
        let mut started = false;
        let mut i = 0;
        self.held.clear();
        while i < self.waiting.len() {
            let s = self.waiting[i];
            let stripe = self.sops[s as usize].stripe;
            // A background operation waits for its stripe like a write (below: reads may
            // then join it).
            let writes = self.sops[s as usize].bg.is_some() || self.sop_req(s).op.is_write();
            let blocked = self.held.contains(&stripe) || self.locked.conflicts(stripe, writes);
            if blocked && !writes && !self.held.contains(&stripe) && self.read_from_pass(s) {
                // The first waiting operation of its stripe, a read, served from the pass
                // that holds the stripe.
                remove_at(&mut self.waiting, i);
                started = true;
                continue;
            }
            if blocked {
                if !self.held.contains(&stripe) {
                    // Bounded by the waiting operations, which the capacity covers.
                    self.held.push(stripe);
                }
                i += 1;
                continue;
            }
            remove_at(&mut self.waiting, i);
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

    #[inline]
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
            if !self.foreign_read_gate(self.sops[s as usize].stripe) {
                return self.move_sop(s);
            }
            self.sops[s as usize].gate = GateHold::Read;
            self.stats.foreign_reads += 1;
            return self.dispatch_sop(s);
        }
        if self.bitmap_gate(s) {
            return;
        }
        self.dispatch_sop(s);
    }

    /// Whether a read of `stripe`, which another shard owns, may read the members here,
    /// taking the stripe gate (counted until [`StripeGate::end_read`]; the owner writes
    /// nothing of the stripe meanwhile). Not when: a member is being rebuilt (only the
    /// owner knows how far its stripes are); this shard still copies a replacement (an
    /// owner that has already swapped it in writes only the new device, and this shard
    /// would read the old one); a write holds the stripe (it goes first); or some shard
    /// has failed a member this one has not. `false`: nothing is counted, and the owner
    /// serves the read.
    ///
    /// [`StripeGate::end_read`]: crate::shard::StripeGate::end_read
    pub(super) fn foreign_read_gate(&self, stripe: u64) -> bool {
        let gate = self.gate.as_ref().expect("foreign reads only with a gate");
        let copying = self
            .replace
            .is_some_and(|r| r.state == ReplaceState::Copying);
        if self.rebuilding() || copying || !gate.try_read(stripe) {
            return false;
        }
        let members = &self.members;
        if gate.lagging(|m| members[usize::from(m)].state.is_failed()) {
            gate.end_read(stripe);
            return false;
        }
        true
    }

    /// Whether a member is being rebuilt.
    pub(super) fn rebuilding(&self) -> bool {
        self.members
            .iter()
            .any(|m| m.state == MemberState::Rebuilding)
    }

    /// Starts the owner writes waiting in [`Phase::GateWait`] whose stripes no foreign read
    /// holds any more.
    pub(super) fn gate_work(&mut self) -> bool {
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
    #[inline]
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
    pub(super) fn move_sop(&mut self, s: u32) {
        debug_assert!(self.sops[s as usize].foreign);
        debug_assert_eq!(self.sops[s as usize].outstanding, 0);
        self.release_gate(s);
        self.locked.release(s);
        let ri = self.sops[s as usize].req;
        debug_assert!(!self.sops[s as usize].bulk, "a foreign read is never bulk");
        self.free_sops.push(s);
        let req = self.reqs.take(ri).expect("live request");
        debug_assert!(req.pending == 1 && req.split == req.len);
        if req.paced {
            if req.class == RequestClass::SmallRead {
                // Leaves this shard unfinished: no latency of ours to measure.
                self.bulk_share
                    .small_read_done(self.now, req.submit_ns, 0, false);
            }
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
    #[inline]
    pub(super) fn dispatch_sop(&mut self, s: u32) {
        let req = self.sop_req(s);
        if req.op.is_write() {
            // Before any member I/O: once this write completes, block status must not
            // call its stripe a hole (a whole-stripe zeroing sets the bit again as it
            // completes).
            if let Some(z) = &self.zero_map {
                z.clear(self.sops[s as usize].stripe);
            }
        }
        match req.op {
            ArrayOp::Read => self.start_read(s),
            ArrayOp::Write { .. } => self.start_write(s),
            ArrayOp::WriteZeroes { .. } => self.start_zeroes(s),
            ArrayOp::Discard => self.start_discard(s),
            ArrayOp::CompareAndWrite { .. } | ArrayOp::OrWrite { .. } => self.start_combine(s),
            ArrayOp::Flush => unreachable!("flushes are not stripe operations"),
        }
    }

    #[inline]
    pub(super) fn finish_sop(&mut self, s: u32, status: Result<(), ArrayError>) {
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
        if std::mem::take(&mut self.sops[s as usize].bulk) {
            self.bulk_sops -= 1;
        }
        let req = self.reqs.get_mut(ri).expect("live request");
        if let Err(e) = status {
            req.error.get_or_insert(e);
        }
        req.pending -= 1;
        if req.pending == 0 && req.split == req.len {
            self.finish_req(ri);
        }
    }

    #[inline]
    pub(super) fn finish_req(&mut self, ri: u32) {
        // The fields used below, read in place: `ReqSlots::take` copied the whole slot
        // (every field of `ReqCtx`) per request for these ten.
        let req = {
            let r = self.reqs.get_mut(ri).expect("live request");
            r.live = false;
            Finished {
                tag: r.tag,
                op: r.op,
                len: r.len,
                error: r.error,
                submit_ns: r.submit_ns,
                device_ns: r.device_ns,
                paced: r.paced,
                class: r.class,
                ordered: r.ordered,
                from_cache: r.from_cache,
            }
        };
        if req.op.is_write() {
            self.writes_in_flight -= 1;
        }
        if req.paced {
            match req.class {
                RequestClass::SmallRead => self.bulk_share.small_read_done(
                    self.now,
                    req.submit_ns,
                    req.device_ns,
                    req.error.is_none() && !req.ordered && !req.from_cache,
                ),
                RequestClass::BulkWrite => self.bulk_reqs -= 1,
                RequestClass::Other => {}
            }
            if req.from_cache {
                self.pacer
                    .foreground_done_unmeasured(self.now, req.len, req.op.is_read());
            } else {
                self.pacer.foreground_done(
                    self.now,
                    self.now.saturating_sub(req.submit_ns),
                    req.len,
                    req.op.is_read(),
                );
            }
        }
        // A write completed while a failure is unrecorded waits for the record, keeping
        // its request slot (`hold_writes_until_recorded`).
        if req.op.is_write() && self.writes_held() {
            let status = req.error.map_or(Ok(()), Err);
            self.held_writes.push_back((
                ri,
                ArrayCompletion {
                    tag: req.tag,
                    status,
                },
            ));
            return;
        }
        // One push per outcome: a status chosen first and copied in was assembled on the
        // stack and reloaded wider than it was stored (a store-to-load forwarding stall).
        match req.error {
            None => self.done.push_back(ArrayCompletion {
                tag: req.tag,
                status: Ok(()),
            }),
            Some(e) => self.done.push_back(ArrayCompletion {
                tag: req.tag,
                status: Err(e),
            }),
        }
        self.free_reqs.push(ri);
    }

    pub(super) fn start_flush(&mut self, ri: u32) {
        let Some(s) = self.free_sops.pop() else {
            // No operation free: wait in the backlog, in order with the other requests.
            self.backlog_writes += 1;
            self.backlog.push_back(ri);
            return;
        };
        let req = self.reqs.get_mut(ri).expect("live request");
        req.pending = 1;
        let sop = &mut self.sops[s as usize];
        sop.req = ri;
        sop.regions = 0..0;
        sop.phase = Phase::Flushing;
        sop.outstanding = 0;
        sop.io_error = false;
        // Only devices this shard wrote since it last flushed them: a write completed
        // before the flush arrived has set `unflushed`; one completing after this flush is
        // sent sets it again for the next flush. A device with a flush still in flight
        // gets another: that one may be answered before this one's writes are durable.
        for m in 0..self.members.len() as u16 {
            let dev = &mut self.members[usize::from(m)];
            let send = std::mem::take(&mut dev.unflushed) | (dev.flushing > 0);
            if send && !self.is_failed(m) {
                self.io_flush(s, m);
            }
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// The client request foreground operation `s` serves.
    ///
    /// # Panics
    /// If it has none live (a background operation, or a finished request): an engine bug.
    #[inline]
    pub(super) fn sop_req(&self, s: u32) -> &super::ReqCtx {
        self.reqs
            .get(self.sops[s as usize].req)
            .expect("live request")
    }

    /// Pointer to stripe-data byte `x` of operation `s` in the caller's buffer.
    pub(super) fn client_ptr(&self, s: u32, x: u64) -> *mut u8 {
        let sop = &self.sops[s as usize];
        let req = self.reqs.get(sop.req).expect("live request");
        debug_assert!(sop.start <= x && x <= sop.end);
        if !req.op.has_buffer() {
            // Write-zeroes (or a discard rewritten as zeroes) takes its data from the
            // chunk-sized zero buffer: stripe byte x lies at x % chunk in its chunk, and
            // every range the engine reads from here stays inside that chunk. Only ever
            // read through this pointer.
            let c = u64::from(self.geo.geometry().chunk_bytes());
            return self.zero.as_ptr().wrapping_add((x % c) as usize).cast_mut();
        }
        // A compare-and-write's data to write is the second half of its buffer (the
        // first is the verify data, read by `combine` alone).
        let data = if matches!(req.op, ArrayOp::CompareAndWrite { .. }) {
            req.len
        } else {
            0
        };
        // In bounds: data + buf_off + (x - start) <= data + request length <= buffer
        // length.
        req.buf
            .as_ptr()
            .wrapping_add((data + sop.buf_off + x - sop.start) as usize)
    }

    /// The footprint of client operation `s` in its stripe (set with its range).
    pub(super) fn footprint(&self, s: u32) -> StripeWrite {
        let sop = &self.sops[s as usize];
        debug_assert!(sop.bg.is_none(), "a background operation has no footprint");
        debug_assert_eq!(
            sop.fp,
            StripeWrite::from_range(
                self.geo.geometry().data_chunks(),
                self.geo.geometry().chunk_bytes(),
                sop.start,
                sop.end
            )
        );
        sop.fp
    }

    /// The member roles of operation `s`'s stripe (set with the stripe).
    pub(super) fn layout(&self, s: u32) -> crate::geometry::StripeLayout {
        let sop = &self.sops[s as usize];
        debug_assert_eq!(sop.layout, self.geo.stripe(sop.stripe));
        sop.layout
    }
}

/// Removes `q[i]` (which exists), keeping the order of the rest: `pop_front` when it is
/// the first — the common case on the per-request path, where `VecDeque::remove`'s
/// general move costs more.
pub(super) fn remove_at(q: &mut std::collections::VecDeque<u32>, i: usize) {
    if i == 0 {
        q.pop_front();
    } else {
        q.remove(i);
    }
}

/// The fields of a request slot that [`Array::finish_req`] reads when it frees the slot.
struct Finished {
    tag: u64,
    op: ArrayOp,
    len: u64,
    error: Option<ArrayError>,
    submit_ns: u64,
    device_ns: u64,
    paced: bool,
    class: RequestClass,
    ordered: bool,
    from_cache: bool,
}
