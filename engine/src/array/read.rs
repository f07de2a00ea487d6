//! Reads of healthy members, straight into the caller's buffer; and reads of a stripe a
//! write pass holds, served from the pass's own data.
//!
//! # The fast path
//! A read that lies inside one chunk of an online member (the array may be degraded: only
//! the lost chunks need reconstruction), submitted with nothing queued ahead of it that it
//! must not overtake and no write holding its stripe, needs none of a stripe operation's
//! machinery: it is one member read into the caller's buffer. [`Array::submit`]
//! issues it at once ([`Array::fast_read`]) with the request itself as the member
//! request's context (its operation index in the tag is one of the requests', past the
//! stripe operations'; `tag_ops` in `mod.rs`), and the member read's completion completes
//! the request. The guarantees stay those of a stripe operation's read:
//! - *Ordering*: the read holds its stripe shared in the stripe holds (under its own
//!   operation index) from issue to completion, so a write of the stripe waits for it as
//!   for any read, and it is issued only when no write holds the stripe, no operation
//!   waits for the stripe (a waiting write holds back every later operation of its
//!   stripe) and no write or flush waits in the backlog, so it overtakes nothing but
//!   reads (which need no order among themselves).
//! - *Foreign stripes*: on a stripe another shard owns, the read also holds the stripe
//!   gate ([`crate::shard::StripeGate`]) from issue to completion, exactly as a foreign
//!   stripe operation's read does, so the owner writes no member of the stripe meanwhile;
//!   when the gate refuses (the owner is writing the stripe), the read takes a stripe
//!   operation, which goes to the owner.
//! - *Errors*: a member error fails the member (an unrecovered read error only marks it
//!   bad for the read, as a stripe operation does), and the request runs again as a
//!   stripe operation — a degraded read from redundancy, which rewrites the bad range —
//!   that takes over the read's stripe hold (and gate hold): the failed read keeps them,
//!   waiting first in the backlog for a free stripe operation, so nothing submitted after
//!   it runs on its stripe first. One stripe operation is kept free for such a retry while
//!   fast-path reads are in flight (`split_backlog`): the operations that would otherwise
//!   free one may all be waiting for the read's stripe. Its completion is never reported
//!   from the failed read.
//! - *Timeouts*: [`Array::check_timeouts`] times out fast-path reads like stripe
//!   operations' requests (the member is failed and its request aborted; the read then
//!   runs again as above).
//! - Replacement and member swaps: the member read carries the device id, as every
//!   member request does, so a read in flight to a device swapped out completes against
//!   it (its data was current) or, failing, runs again from the current devices.
//!
//! # From the stripe cache
//! On members whose writes take time, a fast-path read of a stripe this shard owns whose
//! blocks are all valid in the stripe's cache entry is copied from it and completed at
//! submission ([`Array::cache_read`]): no member read, no stripe hold (nothing can write
//! the stripe before it completes), no member error to handle (a latent sector error
//! under a cached block is found by the next member read of it, as on md). Its latency is
//! no sample for the pacer or the bulk share.

use crate::device::{Channel, IoError, Op, Request};
use crate::geometry::Role;
use crate::qos::IoClass;
use crate::shard::owner;

use super::cache::NONE;
use super::pass::CACHE_ADMIT_WRITE_LATENCY_NS;
use super::{
    ppl, Array, ArrayError, GateHold, MemberState, Phase, MEMBER_BITS, NO_ENTRY, NO_FAST_DEV,
};

impl<C: Channel> Array<C> {
    // ---- reads -----------------------------------------------------------------------------

    /// The operation index in the tags (and the stripe hold) of request `ri`'s fast-path
    /// read: past the stripe operations, the bitmap's slot and the logs' ([`super::tag_ops`]).
    #[inline]
    fn fast_op(&self, ri: u32) -> u32 {
        self.bitmap_sop() + 1 + self.slots() as u32 + ri
    }

    /// The request whose fast-path read tag operation index `op` is, if it is one.
    #[inline]
    pub(super) fn fast_req_of(&self, op: u32) -> Option<u32> {
        let base = self.bitmap_sop() + 1 + self.slots() as u32;
        op.checked_sub(base)
            .filter(|&ri| (ri as usize) < self.reqs.len())
    }

    /// Issues request `ri` (a valid read, just accepted) as a fast-path read (module docs)
    /// if it may be one: the array has not failed, the read's member is online (the
    /// array may be degraded: a surviving chunk is read alike), no write (or
    /// flush) waits in the backlog (reads waiting there for a stripe operation need no
    /// order against this one), no operation waits for the read's stripe, the read lies
    /// inside one chunk, within the member's largest transfer, no write holds the stripe,
    /// and on a stripe another shard owns, the stripe gate admits it. Returns whether it
    /// was issued; `false` leaves the request untouched (it takes the backlog).
    #[inline]
    pub(super) fn fast_read(&mut self, ri: u32) -> bool {
        if self.backlog_writes != 0 || self.fast_blocked || self.array_failed() {
            return false;
        }
        let req = self.reqs.get(ri).expect("accepted request");
        let chunk = u64::from(self.geo.geometry().chunk_bytes());
        let (stripe, within) = self.geo.stripe_of(req.offset);
        // Chunk sizes are powers of two (`Geometry::new`).
        let (k, off) = (within >> chunk.trailing_zeros(), within & (chunk - 1));
        if off + req.len > chunk
            || self.locked.conflicts(stripe, false)
            || self
                .waiting
                .iter()
                .any(|&w| self.sops[w as usize].stripe == stripe)
        {
            return false;
        }
        let member = self.geo.stripe(stripe).data_member(k as u16);
        let m = &self.members[usize::from(member)];
        // A member being rebuilt (or failed) is left to stripe operations, which know
        // where its rebuild stands; an online member's chunk is read alike in a degraded
        // stripe, and background work beside the read writes only parity or the member
        // being rebuilt (`start_waiting`).
        if m.state != MemberState::Online || req.len > u64::from(m.max_transfer) {
            return false;
        }
        let foreign = self.shards > 1 && owner(stripe, self.shards) != self.shard;
        // The stripe cache serves reads only on members whose writes take time
        // (`cache_read`'s docs): tested here, so that on RAM-speed members the read
        // skips the call.
        if !foreign
            && self.write_latency_ns >= CACHE_ADMIT_WRITE_LATENCY_NS
            && self.cache_read(ri, stripe, member, off)
        {
            return true;
        }
        let req = self.reqs.get(ri).expect("accepted request");
        let m = &self.members[usize::from(member)];
        let op = self.fast_op(ri);
        let request = Request {
            tag: (u64::from(op) << MEMBER_BITS) | u64::from(m.id),
            op: Op::Read,
            offset_bytes: self.data_offset + stripe * chunk + off,
            // Inside one chunk (checked above), so it fits.
            len_bytes: req.len as u32,
            // The caller's buffer, lent until the request completes (ArrayRequest
            // contract), whole: the member read is the request. Its registered region
            // (if any) comes with it.
            buf: req.buf,
        };
        let id = m.id;
        if foreign && !self.fast_foreign_gate(stripe) {
            return false;
        }
        let now = self.now;
        let req = self.reqs.get_mut(ri).expect("accepted request");
        req.split = req.len;
        req.pending = 1;
        req.fast_dev = id;
        req.fast_ns = now;
        req.fast_foreign = foreign;
        req.issued = true;
        // As `count_issue` records it when a request's first member I/O goes out.
        self.queue_wait[req.class.index()].record(now.saturating_sub(req.submit_ns));
        self.locked.take(stripe, op, false);
        self.fast_in_flight += 1;
        self.stats.foreign_reads += u64::from(foreign);
        let c = &mut self.members[usize::from(member)].counters;
        c.reads += 1;
        c.read_bytes += u64::from(request.len_bytes);
        self.send(member, IoClass::ForegroundRead, request);
        true
    }

    /// Serves request `ri` (a fast-path read of `off..off + len` of `member`'s chunk in
    /// `stripe`, which this shard owns, on the checks of [`Self::fast_read`]: no write
    /// holds the stripe or waits for it) from the stripe cache when the stripe's entry
    /// holds every block of it: copied into the caller's buffer and completed at once, no
    /// member read. The entry's valid blocks equal the member (cache.rs, "Rules"), and no
    /// pass is writing the stripe, so the read returns what a member read would. Called
    /// only on members whose writes take time ([`CACHE_ADMIT_WRITE_LATENCY_NS`], the rule
    /// that admits random writes; `fast_read` checks it): on RAM-speed members the copy
    /// costs what the read would. Returns whether it did.
    fn cache_read(&mut self, ri: u32, stripe: u64, member: u16, off: u64) -> bool {
        debug_assert!(self.write_latency_ns >= CACHE_ADMIT_WRITE_LATENCY_NS);
        let Some(e) = self.cache.lookup(stripe) else {
            return false;
        };
        let unit = u64::from(self.geo.geometry().block_bytes());
        let req = self.reqs.get_mut(ri).expect("accepted request");
        let len = req.len;
        let m = usize::from(member);
        let ent = self.cache.entry(e);
        // A fast-path read lies inside one chunk and is block-aligned (`submit`).
        if len == 0
            || !ent.valid[m].contains_range((off / unit) as u32, (off + len).div_ceil(unit) as u32)
        {
            return false;
        }
        let src = &ent.bufs[m][off as usize..(off + len) as usize];
        // SAFETY: `req.buf` is the caller's buffer of `len` bytes (`ArrayRequest`: lent
        // until the request completes, which it does below); `src` is the cache's own
        // buffer, `len` bytes inside one chunk (checked by `fast_read`).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), req.buf.as_ptr(), src.len()) };
        req.issued = true;
        req.from_cache = true;
        let now = self.now;
        self.queue_wait[req.class.index()].record(now.saturating_sub(req.submit_ns));
        self.stats.cache_reads += 1;
        self.cache.touch(e);
        self.finish_req(ri);
        true
    }

    /// Whether a fast-path read of `stripe`, which another shard owns, may read the
    /// members here: fewer fast-path reads hold the gate on this shard than it has stripe
    /// operations (the gate's counts are sized for twice the stripe operations), and the
    /// gate admits it as it admits a foreign stripe operation's read
    /// ([`Self::foreign_read_gate`]; counted from here until the read completes).
    /// `false`: nothing is counted, and the read takes a stripe operation (which goes to
    /// the owner).
    fn fast_foreign_gate(&mut self, stripe: u64) -> bool {
        if self.gate.is_none()
            || self.fast_foreign_reads as usize >= self.sops.len()
            || !self.foreign_read_gate(stripe)
        {
            return false;
        }
        self.fast_foreign_reads += 1;
        true
    }

    /// Request `ri`'s fast-path read (tag operation index `op`) came back from device entry
    /// `member` (device id `id`) with `status`; `device_ns`: its time in the device, when
    /// it went through the member queue. Completes the request, or — on an error — runs
    /// it again as a stripe operation (module docs).
    pub(super) fn fast_read_done(
        &mut self,
        op: u32,
        ri: u32,
        member: u16,
        id: u16,
        status: Result<(), IoError>,
        device_ns: Option<u64>,
    ) {
        let now = self.now;
        let Some(req) = self.reqs.get_mut(ri).filter(|r| r.fast_dev == id) else {
            self.stats.stray_completions += 1;
            return;
        };
        req.fast_dev = NO_FAST_DEV;
        if let Some(d) = device_ns {
            req.device_ns = req.device_ns.max(d);
        }
        let m = &mut self.members[usize::from(member)];
        // Saturates at the histogram's top (one hour); never allocates.
        m.latency.record(now.saturating_sub(req.fast_ns).max(1));
        let Err(e) = status else {
            if std::mem::take(&mut req.fast_foreign) {
                // Done with the members: the owner may write the stripe.
                let (stripe, _) = self.geo.stripe_of(req.offset);
                self.end_fast_foreign(stripe);
            }
            self.locked.release(op);
            self.fast_in_flight -= 1;
            self.stats.direct_reads += 1;
            self.stats.fast_reads += 1;
            return self.finish_req(ri);
        };
        m.counters.errors += 1;
        let mut retry_bad = NO_ENTRY;
        if usize::from(member) >= self.slots() {
            // A device that left the array (a replaced member read before the swap; a
            // read never goes to a replacement): only run again from the current devices.
            debug_assert_ne!(self.replacement_entry(), Some(member));
        } else if e == IoError::Medium {
            // A latent sector error: the stripe operation rebuilds the range from
            // redundancy and rewrites it; the member stays in service (md's read-error
            // handling, as in `member_done`).
            self.stats.medium_errors += 1;
            retry_bad = member;
        } else {
            self.fail_member(member, e);
        }
        let req = self.reqs.get_mut(ri).expect("live request");
        req.retry_bad = retry_bad;
        req.split = 0;
        req.pending = 0;
        // It keeps its stripe hold (and gate hold) until the stripe operation that runs
        // it again takes them over (`split_backlog`, `retry_fast_read`): a write submitted
        // after it and waiting for the stripe must not run first. First in the backlog:
        // it was accepted before everything there, and nothing ahead of it may block it.
        req.retry_held = true;
        self.backlog.push_front(ri);
    }

    /// The fast-path read of request `ri` failed and its request got stripe operation `s`
    /// (set up for its range, not started; `split_backlog`, which keeps the last free stripe
    /// operation for this while fast-path reads are in flight): `s` takes over the read's
    /// stripe hold, and its gate hold on a stripe another shard owns, and runs the read
    /// again — from redundancy without a failed or bad member, from the current devices
    /// after a member swap; a foreign read goes to the owner when a member is being
    /// rebuilt (as a foreign stripe operation's failed read does in `advance`).
    pub(super) fn retry_fast_read(&mut self, ri: u32, s: u32) {
        let req = self.reqs.get_mut(ri).expect("live request");
        debug_assert!(req.retry_held && req.fast_dev == NO_FAST_DEV);
        req.retry_held = false;
        self.fast_in_flight -= 1;
        let foreign = std::mem::take(&mut req.fast_foreign);
        let stripe = self.sops[s as usize].stripe;
        debug_assert_eq!(foreign, self.sops[s as usize].foreign);
        self.locked.release(self.fast_op(ri));
        self.locked.take(stripe, s, false);
        if foreign {
            // The gate's count stays; the operation holds it now.
            self.fast_foreign_reads -= 1;
            self.sops[s as usize].gate = GateHold::Read;
        }
        if self.array_failed() {
            return self.finish_sop(s, Err(ArrayError::Failed));
        }
        if foreign && self.rebuilding() {
            return self.move_sop(s);
        }
        self.start_read(s);
    }

    /// A fast-path read of `stripe` (another shard's) is done with the members: it lets go
    /// of the stripe gate.
    fn end_fast_foreign(&mut self, stripe: u64) {
        self.fast_foreign_reads -= 1;
        self.gate
            .as_ref()
            .expect("foreign reads only with a gate")
            .end_read(stripe);
    }

    /// Times out the fast-path reads whose member read outlived the command timeout
    /// (as [`Self::check_timeouts`] does stripe operations' requests); returns whether any
    /// did.
    pub(super) fn fast_read_timeouts(&mut self) -> bool {
        let mut any = false;
        for ri in 0..self.reqs.len() as u32 {
            let Some(req) = self.reqs.get_mut(ri) else {
                continue;
            };
            if req.fast_dev == NO_FAST_DEV || self.now - req.fast_ns < self.io_timeout_ns {
                continue;
            }
            // Abort again only after another full timeout.
            req.fast_ns = self.now;
            let id = req.fast_dev;
            if let Some(entry) = self.entry_of_id(id) {
                any = true;
                self.time_out(self.fast_op(ri), entry);
            }
        }
        any
    }

    /// When the oldest fast-path read in flight times out, ns (array clock).
    pub(super) fn fast_read_deadline_ns(&self) -> Option<u64> {
        self.reqs
            .live()
            .filter(|r| r.fast_dev != NO_FAST_DEV)
            .map(|r| r.fast_ns.saturating_add(self.io_timeout_ns))
            .min()
    }

    pub(super) fn start_read(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let st = self.layout(s);
        let w = self.footprint(s);
        let healthy =
            self.none_missing(s) || w.chunks().all(|(k, _)| !self.missing(s, st.data_member(k)));
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

    /// Serves read operation `s` (queued, holding nothing, no earlier operation of its
    /// stripe waiting) from the write pass that holds its stripe, and completes it; `false`
    /// (nothing done) when it cannot be, and the read waits for the pass as before.
    ///
    /// A read must not see part of a pass (module docs of [`super::pass`]): it waits until
    /// the pass's member writes are done. Once the pass has its new data in memory — its
    /// phase is [`Phase::PassWrite`], or it waits for its Partial Parity Log record — that
    /// data is exactly what the members will hold: every block the pass writes is in the
    /// pass's cache entry or in the one caller buffer that writes its chunk
    /// (`pass_direct`), and the entry's valid blocks equal the members (nothing else writes
    /// the stripe while the pass holds it). A read whose every block is one of those is
    /// served from them at once, as if it had run right after the pass — what a reader
    /// arriving then may see (its submission came after the pass's writes). Issue 24: a
    /// small read landing on a stripe of a bulk writer's 1 MiB pass waited for the whole
    /// pass (tens of ms behind the writer's queue); now it costs a copy.
    ///
    /// Only the stripe's owner does this (a foreign read goes to the owner as before), and
    /// only while the cache has not been invalidated since the pass pinned its entry (a
    /// member failing or joining meanwhile).
    pub(super) fn read_from_pass(&mut self, s: u32) -> bool {
        let sop = &self.sops[s as usize];
        if sop.foreign || sop.bg.is_some() || !self.pass_reads_on {
            return false;
        }
        let stripe = sop.stripe;
        let Some(h) = self.locked.exclusive_holder(stripe) else {
            return false;
        };
        let pass = &self.sops[h as usize];
        if matches!(
            pass.phase,
            Phase::WriteRead(_) | Phase::Writing | Phase::PplWait(ppl::Logged::Single)
        ) {
            return self.read_from_single(s, h);
        }
        if !matches!(
            pass.phase,
            Phase::PassWrite | Phase::PplWait(ppl::Logged::Pass)
        ) || pass.pass_entry == NONE
            || !self.cache.current(pass.pass_entry)
        {
            return false;
        }
        let g = *self.geo.geometry();
        let unit = g.block_bytes();
        let c = u64::from(g.chunk_bytes());
        let st = self.layout(s);
        let w = self.footprint(s);
        let entry = self.cache.entry(pass.pass_entry);
        for (k, r) in w.chunks() {
            let m = usize::from(st.data_member(k));
            debug_assert!(matches!(st.role(m as u16), Role::Data { .. }));
            let covered = (r.start / unit..r.end.div_ceil(unit))
                .all(|b| pass.dirty[m].contains(b) || entry.valid[m].contains(b));
            if !covered {
                return false;
            }
        }
        for (k, r) in w.chunks() {
            let m = usize::from(st.data_member(k));
            let direct = self.writes_direct(h, m);
            let dst = self.client_ptr(s, u64::from(k) * c + u64::from(r.start));
            for b in r.start / unit..r.end.div_ceil(unit) {
                let (x, y) = (r.start.max(b * unit), r.end.min((b + 1) * unit));
                // The new data of a block the pass writes from its callers' buffers is
                // there (the entry keeps the old rows); every other block is in the entry.
                let src = if direct && pass.dirty[m].contains(b) {
                    match self.direct_data(h, m, x) {
                        Some((p, n)) if n >= y - x => p,
                        // Not one of the pass's pieces (cannot happen: `find_direct` covers
                        // every written block, block-aligned): the read waits for the pass
                        // (what it copied so far is overwritten then).
                        _ => {
                            debug_assert!(false, "a directly written block outside its pieces");
                            return false;
                        }
                    }
                } else {
                    entry.bufs[m].as_ptr().wrapping_add(x as usize)
                };
                // SAFETY: src addresses chunk bytes x..y of member m's chunk: in the
                // pinned entry's chunk buffer (chunk bytes long), or in the callers'
                // buffers the pass writes that chunk from (`find_direct`: one write's range
                // covering every block the pass writes there, or the block-aligned piece
                // of one write holding block b; lent until those writes complete, which
                // they have not: the pass still holds the stripe). dst is this read's own
                // buffer for the same bytes (client_ptr, inside the request's buffer).
                // `copy` (memmove) stays defined even if a client lent overlapping buffers.
                unsafe {
                    std::ptr::copy(
                        src,
                        dst.wrapping_add((x - r.start) as usize),
                        (y - x) as usize,
                    )
                };
            }
        }
        self.served_from_pass(s);
        true
    }

    /// [`Self::read_from_pass`] for a write on the single-operation path (a whole stripe,
    /// a random write, a degraded stripe) reading what it needs, writing, or waiting for
    /// its log record: its new data is the caller's buffer from the start and never
    /// changes, and nothing else of the stripe is in memory, so only a read inside the
    /// write's range is served.
    fn read_from_single(&mut self, s: u32, h: u32) -> bool {
        let (w, r) = (&self.sops[h as usize], &self.sops[s as usize]);
        let op = self.reqs.get(w.req).map(|q| q.op);
        let zeroes = matches!(op, Some(super::ArrayOp::WriteZeroes { .. }));
        let data = matches!(op, Some(super::ArrayOp::Write { .. }));
        if w.bg.is_some() || !(zeroes || data) || r.start < w.start || r.end > w.end {
            return false;
        }
        let (start, len) = (r.start, (r.end - r.start) as usize);
        let dst = self.client_ptr(s, start);
        if zeroes {
            // SAFETY: dst is the read's buffer for stripe bytes start..start+len.
            unsafe { std::ptr::write_bytes(dst, 0, len) };
        } else {
            let src = self.client_ptr(h, start);
            // SAFETY: src is the write's caller buffer for stripe bytes start..start+len
            // (lent until the write completes, which it has not: it holds the stripe); dst
            // is the read's buffer for the same bytes. `copy` (memmove) stays defined even
            // if a client lent overlapping buffers.
            unsafe { std::ptr::copy(src, dst, len) };
        }
        self.served_from_pass(s);
        true
    }

    /// Reads wait for the write holding their stripe, as before [`Self::read_from_pass`]
    /// (tests comparing the two).
    #[cfg(test)]
    pub(crate) fn disable_pass_reads(&mut self) {
        self.pass_reads_on = false;
    }

    /// Read operation `s`, its data copied in: records its queue wait and completes it.
    fn served_from_pass(&mut self, s: u32) {
        let ri = self.sops[s as usize].req;
        if let Some(r) = self.reqs.get_mut(ri) {
            if !std::mem::replace(&mut r.issued, true) {
                // As `count_issue` records it when a request's first member I/O goes out.
                self.queue_wait[r.class.index()].record(self.now.saturating_sub(r.submit_ns));
            }
        }
        self.stats.pass_reads += 1;
        self.finish_sop(s, Ok(()));
    }
}
