//! Writes (full-stripe, RMW, RCW, degraded) and parity generation; write-zeroes and
//! discard; combining writes (compare-and-write, OR-write).
//!
//! # Combining writes
//! [`ArrayOp::CompareAndWrite`] and [`ArrayOp::OrWrite`] hold their stripe exclusively
//! like any write (the stripe's owner runs them; a pass never gathers them, so a write
//! queued behind one waits for it). Holding the stripe, the operation reads the old data
//! of its range into its own chunk buffers ([`Phase::CombineRead`]; from the stripe cache
//! when every block is valid there; rebuilt from parity on a degraded stripe,
//! [`Phase::CombineDegradedRead`]), then `combine`s: a compare-and-write compares it with
//! its verify data and completes with [`ArrayError::Miscompare`] at the first differing
//! byte, writing nothing; an OR-write ORs it into the caller's buffer in place. The
//! operation then goes on as an ordinary write of the same stripe operation (a pass or
//! the single-operation path) without ever letting go of the stripe: read, compare and
//! write are one uninterrupted series for that stripe.

use arrayvec::ArrayVec;

use crate::device::{Channel, Op};
use crate::geometry::Role;
use crate::parity::MAX_DATA_CHUNKS;
use crate::stripe::{plan_write, ChunkRange, WriteMode};

use super::ppl::Logged;
use super::{Array, ArrayError, ArrayOp, Phase};

impl<C: Channel> Array<C> {
    // ---- write-zeroes and discard ---------------------------------------------------------

    /// Whether every surviving member supports `op` natively (`WriteZeroes` or a `Discard`
    /// that leaves zeroes).
    pub(super) fn members_support(&self, op: Op) -> bool {
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
        self.cache.invalidate(self.sops[s as usize].stripe);
        let stripe_bytes = self.geo.geometry().stripe_data_bytes();
        let sop = &mut self.sops[s as usize];
        (sop.ppl_lo, sop.ppl_hi) = (0, stripe_bytes);
        if self.ppl_gate(s, Logged::Zeroing(op), WriteMode::FullStripe) {
            return;
        }
        self.issue_zeroing(s, op);
    }

    /// Issues a whole-stripe zeroing's member requests (see [`Self::zero_stripe`]).
    pub(super) fn issue_zeroing(&mut self, s: u32, op: Op) {
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

    /// Write-zeroes of one stripe piece: a whole stripe goes to the members as
    /// write-zeroes (with FUA, followed by a flush of the members with a volatile cache,
    /// [`Phase::ZeroFlush`]: member write-zeroes carry no FUA bit); anything else is an
    /// ordinary write whose data is the zero buffer (RMW/RCW keep parity right; FUA writes
    /// are durable on completion).
    pub(super) fn start_zeroes(&mut self, s: u32) {
        if self.footprint(s).is_full_stripe() && self.members_support(Op::WriteZeroes) {
            self.stats.zeroed_stripes += 1;
            self.zero_stripe(s, Op::WriteZeroes)
        } else {
            self.start_write(s)
        }
    }

    /// A FUA write-zeroes' native zeroing of its stripe has completed: flushes every
    /// member in service with a volatile write cache (the replacement included) so the
    /// zeroes are durable before the operation completes ([`Phase::ZeroFlush`]).
    pub(super) fn zero_flush(&mut self, s: u32) {
        self.sops[s as usize].phase = Phase::ZeroFlush;
        self.sops[s as usize].io_error = false;
        for m in 0..self.members.len() as u16 {
            if self.needs_flush(m) {
                self.io_flush(s, m);
            }
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// Discard of one stripe piece: a whole stripe is deallocated on every member when all
    /// promise zeroes afterwards (parity of zeroes is zero); partial stripes, and arrays
    /// whose members make no such promise, are left alone (discard is advisory; md's
    /// raid456 likewise discards only whole stripes).
    pub(super) fn start_discard(&mut self, s: u32) {
        if self.footprint(s).is_full_stripe() && self.members_support(Op::Discard) {
            self.stats.discarded_stripes += 1;
            self.zero_stripe(s, Op::Discard)
        } else {
            self.stats.discards_skipped += 1;
            self.finish_sop(s, Ok(()))
        }
    }

    // ---- combining writes (module docs) ----------------------------------------------------

    /// Compare-and-write or OR-write operation `s` holds its stripe exclusively: reads the
    /// old data of its range into its chunk buffers (from the stripe cache when it holds
    /// every block; rebuilt from parity on a degraded stripe), then `combine`s. The data
    /// of chunk `k` over range `x` lands at `x.start - range.start` of the data member's
    /// buffer, `range` being the footprint's parity range (the layout
    /// [`Self::start_degraded`] leaves).
    pub(super) fn start_combine(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let stripe = self.sops[s as usize].stripe;
        let st = self.layout(s);
        let w = self.footprint(s);
        let range = w.parity_range();
        self.sops[s as usize].range = range;
        self.sops[s as usize].io_error = false;
        let healthy = w.chunks().all(|(k, _)| !self.missing(s, st.data_member(k)));
        if !healthy {
            return self.start_degraded(s, Phase::CombineDegradedRead);
        }
        let unit = g.block_bytes();
        if let Some(e) = self.cache.lookup(stripe) {
            let ent = self.cache.entry(e);
            let cached = w.chunks().all(|(k, x)| {
                let m = usize::from(st.data_member(k));
                (x.start / unit..x.end.div_ceil(unit)).all(|b| ent.valid[m].contains(b))
            });
            if cached {
                for (k, x) in w.chunks() {
                    let m = usize::from(st.data_member(k));
                    let (a, b) = (x.start as usize, x.end as usize);
                    let at = (x.start - range.start) as usize;
                    let src = &self.cache.entry(e).bufs[m][a..b];
                    self.sops[s as usize].bufs[m][at..at + (b - a)].copy_from_slice(src);
                }
                self.stats.cache_hit_bytes +=
                    w.chunks().map(|(_, x)| u64::from(x.len())).sum::<u64>();
                return self.combine(s);
            }
        }
        self.sops[s as usize].phase = Phase::CombineRead;
        for (k, x) in w.chunks() {
            let m = st.data_member(k);
            let ptr = self.sops[s as usize].bufs[usize::from(m)]
                .as_mut_ptr()
                .wrapping_add((x.start - range.start) as usize);
            self.io(s, m, Op::Read, x.start, x.len(), ptr);
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// The old data a combining operation `s` read from healthy members (it holds the
    /// stripe: the data equals the members) goes into the stripe cache, so the write that
    /// follows runs as a pass that reads only what the cache lacks (P/Q for RMW) instead
    /// of reading the same blocks again.
    pub(super) fn cache_combined(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let unit = g.block_bytes();
        let stripe = self.sops[s as usize].stripe;
        let st = self.layout(s);
        let w = self.footprint(s);
        let base = self.sops[s as usize].range.start;
        let (e, _) = self.cache.pin(stripe);
        for (k, x) in w.chunks() {
            let m = usize::from(st.data_member(k));
            let (a, b) = (x.start as usize, x.end as usize);
            let at = (x.start - base) as usize;
            let src = &self.sops[s as usize].bufs[m][at..at + (b - a)];
            let ent = self.cache.entry_mut(e);
            ent.bufs[m][a..b].copy_from_slice(src);
            ent.valid[m].insert_range(x.start / unit, x.end / unit);
        }
        self.cache.unpin(e, true);
    }

    /// The old data of combining operation `s` is in its buffers ([`Self::start_combine`]):
    /// a compare-and-write compares it with the verify data (a difference completes the
    /// operation with [`ArrayError::Miscompare`], nothing written); an OR-write ORs it
    /// into the caller's buffer. Then the write proceeds, the stripe still held.
    pub(super) fn combine(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let c = u64::from(g.chunk_bytes());
        let st = self.layout(s);
        let w = self.footprint(s);
        let (req_op, req_buf) = {
            let r = self.sop_req(s);
            (r.op, r.buf)
        };
        let (start, buf_off, base) = {
            let sop = &self.sops[s as usize];
            (sop.start, sop.buf_off, sop.range.start)
        };
        // Chunks in order: stripe bytes ascend with them, so the first difference found
        // is the first in the range.
        for (k, x) in w.chunks() {
            let m = usize::from(st.data_member(k));
            let at = (x.start - base) as usize;
            let len = x.len() as usize;
            // Offset of these bytes from the start of the request's range.
            let rel = buf_off + u64::from(k) * c + u64::from(x.start) - start;
            match req_op {
                ArrayOp::CompareAndWrite { .. } => {
                    // SAFETY: the verify data is the first `len` bytes of the request's
                    // buffer (lent until completion; validated to be twice the range);
                    // rel + len lies inside the range.
                    let verify = unsafe {
                        std::slice::from_raw_parts(req_buf.as_ptr().add(rel as usize), len)
                    };
                    let old = &self.sops[s as usize].bufs[m][at..at + len];
                    if let Some(i) = old.iter().zip(verify).position(|(a, b)| a != b) {
                        let offset = (rel + i as u64) as u32;
                        return self.finish_sop(s, Err(ArrayError::Miscompare { offset }));
                    }
                }
                ArrayOp::OrWrite { .. } => {
                    let dst = self.client_ptr(s, u64::from(k) * c + u64::from(x.start));
                    // SAFETY: dst is the caller's buffer for these bytes (lent until the
                    // request completes, used by this operation alone); the source is
                    // this operation's own buffer.
                    let new = unsafe { std::slice::from_raw_parts_mut(dst, len) };
                    for (n, o) in new
                        .iter_mut()
                        .zip(&self.sops[s as usize].bufs[m][at..at + len])
                    {
                        *n |= o;
                    }
                }
                _ => unreachable!("only combining writes combine"),
            }
        }
        self.start_write(s);
    }

    // ---- writes ----------------------------------------------------------------------------

    /// A write of one operation alone: degraded stripes (every write of a healthy stripe
    /// runs as a pass, [`super::pass`]), and write-zeroes falling back to data writes.
    pub(super) fn start_write_single(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let st = self.layout(s);
        let w = self.footprint(s);
        // Nothing missing: the planner's per-member test compiles away.
        let plan = if self.none_missing(s) {
            plan_write(&w, &st, |_| false)
        } else {
            plan_write(&w, &st, |m| self.missing(s, m))
        };
        let r = plan.range;
        let sop = &mut self.sops[s as usize];
        (sop.ppl_lo, sop.ppl_hi) = (sop.start, sop.end);
        self.stats.write_read_bytes += u64::from(plan.reads) * u64::from(r.len());
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
    pub(super) fn write_out(&mut self, s: u32, mode: WriteMode) {
        let g = *self.geo.geometry();
        let st = self.layout(s);
        let w = self.footprint(s);
        let r = self.sops[s as usize].range;
        let c = u64::from(g.chunk_bytes());
        let nd = g.data_chunks();
        // Buffer positions: the parity range starts at byte 0 of each member buffer.
        let base = r.start;
        let (ri, rl) = (0usize, r.len() as usize);

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
                self.gen_parity_from(s, &st, &srcs, r, mode);
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
                // The touched chunks' members and Q slots, found from the footprint (one
                // chunk for most RMW writes) rather than by asking every member its role.
                let mut touched: ArrayVec<(usize, u16, u16), MAX_DATA_CHUNKS> = ArrayVec::new();
                for (k, _) in w.chunks() {
                    touched.push((usize::from(st.data_member(k)), k, st.q_slot(k)));
                }
                let (pm, qm) = (usize::from(st.p_member()), st.q_member().map(usize::from));
                let sop = &mut self.sops[s as usize];
                let zero = &self.zero[ri..rl];
                let mut deltas: ArrayVec<crate::parity::Delta<'_>, MAX_DATA_CHUNKS> =
                    ArrayVec::new();
                let mut p_buf: Option<&mut [u8]> = None;
                let mut q_buf: Option<&mut [u8]> = None;
                for (m, b) in sop.bufs.iter_mut().enumerate() {
                    if m == pm {
                        p_buf = Some(&mut b[ri..rl]);
                    } else if Some(m) == qm {
                        q_buf = Some(&mut b[ri..rl]);
                    } else if let Some(&(_, index, slot)) = touched.iter().find(|t| t.0 == m) {
                        debug_assert_eq!(
                            st.role(m as u16),
                            Role::Data { index, slot },
                            "footprint member"
                        );
                        match direct[usize::from(index)] {
                            Some(src) => deltas.push(crate::parity::Delta {
                                slot: slot as u8,
                                old: &b[ri..rl],
                                // SAFETY: the caller's range for this chunk, which is all of
                                // R: rl − ri bytes (lent for the request's life).
                                new: unsafe { std::slice::from_raw_parts(src, rl - ri) },
                            }),
                            None => deltas.push(crate::parity::Delta {
                                slot: slot as u8,
                                old: zero,
                                new: &b[ri..rl],
                            }),
                        }
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
                self.gen_parity_from(s, &st, &srcs, r, mode);
            }
        }

        if self.ppl_gate(s, Logged::Single, mode) {
            return;
        }
        self.issue_single_writes(s, mode);
    }

    /// Issues the writes of a single-operation write whose parity is computed: touched
    /// data chunks from the caller's buffer, then P/Q over the parity range.
    pub(super) fn issue_single_writes(&mut self, s: u32, mode: WriteMode) {
        let (fua, w) = (self.sop_fua(s), self.footprint(s));
        let (st, r) = (self.layout(s), self.sops[s as usize].range);
        let c = u64::from(self.geo.geometry().chunk_bytes());
        let client =
            |this: &Self, k: u16, from: u32| this.client_ptr(s, u64::from(k) * c + u64::from(from));
        self.sops[s as usize].phase = Phase::Writing;
        self.sops[s as usize].mode = mode;
        self.sops[s as usize].io_error = false;
        for (k, x) in w.chunks() {
            let ptr = client(self, k, x.start);
            self.io_write(
                s,
                st.data_member(k),
                Op::Write { fua },
                x.start,
                x.len(),
                ptr,
            );
        }
        for m in [Some(st.p_member()), st.q_member()].into_iter().flatten() {
            // The parity range starts at byte 0 of the parity's buffer.
            let b = self.parity_buf(s, m, mode);
            let ptr = self.sops[s as usize].bufs[b].as_mut_ptr();
            self.io_write(s, m, Op::Write { fua }, r.start, r.len(), ptr);
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// Which of operation `s`'s chunk buffers holds the new rows of parity member `m` for
    /// a single-operation write in `mode`. A full-stripe write takes every data source from
    /// the caller's buffer (or the zero buffer), so nothing its parity computation reads
    /// lies in its buffers (a degraded compare-and-write or OR-write read survivors into
    /// them, but `combine` has used them up before `write_out`), so its P goes into buffer 0 and
    /// its Q into buffer 1 whatever members P and Q rotate onto: the parity it generates
    /// lands in the same one or two buffers of each operation, stripe after stripe, not in
    /// one of `members` buffers (each store's line is then more often still in cache). The
    /// other modes read old parity (RMW) or survivors (degraded) into the member's own
    /// buffer and compute there.
    pub(super) fn parity_buf(&self, s: u32, m: u16, mode: WriteMode) -> usize {
        if mode == WriteMode::FullStripe {
            usize::from(Some(m) == self.layout(s).q_member())
        } else {
            usize::from(m)
        }
    }

    /// P (and Q) over `r` from data pointers in slot order, into the buffers
    /// [`Self::parity_buf`] names for `mode`.
    fn gen_parity_from(
        &mut self,
        s: u32,
        st: &crate::geometry::StripeLayout,
        srcs: &[*const u8],
        r: ChunkRange,
        mode: WriteMode,
    ) {
        let len = r.len() as usize;
        let mut data: ArrayVec<&[u8], MAX_DATA_CHUNKS> = ArrayVec::new();
        for &p in srcs {
            // SAFETY: each pointer is either the caller's buffer range for a fully written
            // chunk (lent, len bytes from R's start lie inside the written range) or one of
            // this operation's chunk buffers at its start, where R begins (len <= chunk).
            data.push(unsafe { std::slice::from_raw_parts(p, len) });
        }
        let pm = self.parity_buf(s, st.p_member(), mode);
        let qm = st.q_member().map(|q| self.parity_buf(s, q, mode));
        let sop = &mut self.sops[s as usize];
        let (ri, rl) = (0usize, r.len() as usize);
        match qm {
            Some(qm) => {
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
}
