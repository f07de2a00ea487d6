//! Reads of healthy members, straight into the caller's buffer; and reads of a stripe a
//! write pass holds, served from the pass's own data.

use crate::device::{Channel, Op};
use crate::geometry::Role;

use super::cache::NONE;
use super::{ppl, Array, Phase};

impl<C: Channel> Array<C> {
    // ---- reads -----------------------------------------------------------------------------

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
            let direct = pass.pass_direct[m];
            let dst = self.client_ptr(s, u64::from(k) * c + u64::from(r.start));
            for b in r.start / unit..r.end.div_ceil(unit) {
                let (x, y) = (r.start.max(b * unit), r.end.min((b + 1) * unit));
                // The new data of a block the pass writes from one caller's buffer is
                // there (the entry keeps the old rows); every other block is in the entry.
                let src = if direct != 0 && pass.dirty[m].contains(b) {
                    (direct as *const u8).wrapping_add(x as usize)
                } else {
                    entry.bufs[m].as_ptr().wrapping_add(x as usize)
                };
                // SAFETY: src addresses chunk bytes x..y of member m's chunk: in the
                // pinned entry's chunk buffer (chunk bytes long), or in the caller's buffer
                // of the write whose range covers every block the pass writes in that
                // chunk (`find_direct`; lent until that write completes, which it has not:
                // the pass still holds the stripe). dst is this read's own buffer for the
                // same bytes (client_ptr, inside the request's buffer). `copy` (memmove)
                // stays defined even if a client lent overlapping buffers.
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
        let op = self.reqs[w.req as usize].as_ref().map(|q| q.op);
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
        if let Some(r) = self.reqs[ri as usize].as_mut() {
            if !std::mem::replace(&mut r.issued, true) {
                // As `count_issue` records it when a request's first member I/O goes out.
                self.queue_wait[r.class.index()].record(self.now.saturating_sub(r.submit_ns));
            }
        }
        self.stats.pass_reads += 1;
        self.finish_sop(s, Ok(()));
    }
}
