//! Degraded reads: reading the survivors of a stripe and rebuilding lost data from parity.

use arrayvec::ArrayVec;

use crate::buf::AlignedBuf;
use crate::device::{Channel, Op};
use crate::geometry::{Level, Role};
use crate::parity::{ChunkId, MAX_DATA_CHUNKS};
use crate::stripe::ChunkRange;

use super::{Array, ArrayError, Phase};

impl<C: Channel> Array<C> {
    /// Reads the surviving members of the stripe that the rebuild needs into the
    /// operation's chunk buffers, over the operation's range (`sop.range`, set here): for a
    /// degraded write (or compare-and-write) its parity range; for a degraded read
    /// ([`Phase::DegradedRead`]) the hull of what it wants of its lost chunks
    /// ([`degraded_read_range`]), with what it wants of surviving chunks outside that
    /// hull read straight into the caller's buffer. A degraded read started again (a
    /// member erred) keeps at least the range of its earlier rounds: the members that
    /// returned unrecovered read errors in them are rewritten over this range
    /// ([`Phase::Repair`]), which must cover what they were read over.
    pub(super) fn start_degraded(&mut self, s: u32, phase: Phase) {
        let g = *self.geo.geometry();
        let st = self.layout(s);
        // One pass over the members: which are missing, and what they hold here.
        let (mut lost, mut lost_data, mut p_lost) = (0usize, 0usize, false);
        let mut lost_members: ArrayVec<u16, 2> = ArrayVec::new();
        for m in 0..g.members() {
            if !self.missing(s, m) {
                continue;
            }
            lost += 1;
            if !lost_members.is_full() {
                lost_members.push(m);
            }
            match st.role(m) {
                Role::P => p_lost = true,
                Role::Q => {}
                Role::Data { .. } => lost_data += 1,
            }
        }
        if lost > usize::from(g.parity_chunks()) {
            let stripe = st.stripe();
            return self.finish_sop(s, Err(ArrayError::Unrecoverable { stripe }));
        }
        // Read only the parity the rebuild needs: P for one lost data chunk, Q as well for
        // two (or for one when P is lost too); none when only parity is lost (a degraded
        // write regenerates P/Q from the data anyway).
        let need_p = lost_data > 0;
        let need_q = lost_data == 2 || (lost_data == 1 && p_lost);
        let w = self.footprint(s);
        let range = if phase == Phase::DegradedRead {
            let r = degraded_read_range(&w, &st, &lost_members);
            let sop = &self.sops[s as usize];
            if sop.phase == Phase::DegradedRead {
                // Another round of this read: its lost set may have shrunk (a member being
                // rebuilt passed the stripe), but members marked bad in earlier rounds
                // were read over the earlier range, and their repair must cover it.
                r.hull(&sop.range)
            } else {
                r
            }
        } else {
            w.parity_range()
        };
        let sop = &mut self.sops[s as usize];
        sop.phase = phase;
        sop.range = range;
        sop.io_error = false;
        sop.lost = lost_members.clone();
        for m in 0..g.members() {
            let needed = match st.role(m) {
                Role::P => need_p,
                Role::Q => need_q,
                Role::Data { .. } => true,
            };
            if needed && !lost_members.contains(&m) {
                let ptr = self.sops[s as usize].bufs[usize::from(m)].as_mut_ptr();
                self.io(s, m, Op::Read, range.start, range.len(), ptr);
            }
        }
        if phase == Phase::DegradedRead {
            // What the read wants of surviving chunks outside the rebuilt range goes
            // straight into the caller's buffer (`finish_degraded_read` copies the rest).
            let c = u64::from(g.chunk_bytes());
            for (k, r) in w.chunks() {
                let m = st.data_member(k);
                if !lost_members.contains(&m) && !range.contains(&r) {
                    let ptr = self.client_ptr(s, u64::from(k) * c + u64::from(r.start));
                    self.io(s, m, Op::Read, r.start, r.len(), ptr);
                }
            }
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// Rebuilds the failed members' chunks over the operation's range (`sop.range`: the
    /// parity range, or a degraded read's hull) from the survivors in its buffers.
    pub(super) fn rebuild_in_buffers(&mut self, s: u32) -> Result<(), ArrayError> {
        self.rebuild_into(s, None)
    }

    /// [`Self::rebuild_in_buffers`], except that lost data slot `slot` of `into` is
    /// rebuilt into the caller's buffer at `ptr` (the parity range's length, 64-byte
    /// aligned) instead of the operation's own buffer, which is left as it was.
    fn rebuild_into(&mut self, s: u32, into: Option<(u16, *mut u8)>) -> Result<(), ArrayError> {
        let g = *self.geo.geometry();
        let st = self.layout(s);
        let sop = &mut self.sops[s as usize];
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
        if let Some((slot, ptr)) = into {
            debug_assert!(lost.contains(&ChunkId::Data(slot as u8)));
            debug_assert!((ptr as usize).is_multiple_of(crate::parity::ALIGN));
            // SAFETY: ptr addresses the caller's buffer for exactly the parity range of
            // data slot `slot` (`finish_degraded_read`: a read of that one chunk, the parity
            // range being its range), lent until the request completes and used by this
            // operation alone; it does not overlap the operation's own buffers (the
            // reconstruction's inputs). The slice lives only for this call.
            data[usize::from(slot)] =
                unsafe { std::slice::from_raw_parts_mut(ptr, r.len() as usize) };
        }
        // Rebuilt data is read again at once (copied to the caller, or fed to the new parity):
        // ordinary stores keep it in cache.
        self.parity
            .streaming(false)
            .reconstruct(&mut data, p, q, &lost)
            .map_err(|_| ArrayError::Unrecoverable { stripe: sop.stripe })
    }

    pub(super) fn finish_degraded_read(&mut self, s: u32) {
        if self.sops[s as usize].foreign && !self.sops[s as usize].bad.is_empty() {
            // Rewriting the unreadable range is the owner's to do (two reactors must not
            // write one range): it reads again, rebuilds and repairs.
            return self.move_sop(s);
        }
        self.stats.degraded_reads += 1;
        let g = *self.geo.geometry();
        let st = self.layout(s);
        let w = self.footprint(s);
        let c = u64::from(g.chunk_bytes());
        // A read of one chunk, lost, with nothing to repair (the common degraded read):
        // its range is the parity range, so the lost data is rebuilt straight into the
        // caller's buffer and nothing is copied (raid5f likewise XORs into the request's
        // buffers). A read touching survivors, or with ranges to rewrite, is rebuilt in
        // the operation's buffers over the rebuilt range (`degraded_read_range`) and
        // copied out; survivors' ranges outside it were read into the caller's buffer.
        if w.touched() == 1 && self.sops[s as usize].bad.is_empty() {
            let (k, r) = w.chunks().next().expect("one chunk touched");
            let m = st.data_member(k);
            if self.sops[s as usize].lost.contains(&m) {
                debug_assert_eq!(r, self.sops[s as usize].range);
                let dst = self.client_ptr(s, u64::from(k) * c + u64::from(r.start));
                let status = self.rebuild_into(s, Some((st.q_slot(k), dst)));
                return self.finish_sop(s, status);
            }
        }
        if let Err(e) = self.rebuild_in_buffers(s) {
            return self.finish_sop(s, Err(e));
        }
        let range = self.sops[s as usize].range;
        for (k, r) in w.chunks() {
            let m = st.data_member(k);
            if !range.contains(&r) {
                // A survivor's range read straight into the caller's buffer
                // (`start_degraded`); lost chunks' ranges are inside the rebuilt range.
                debug_assert!(!self.sops[s as usize].lost.contains(&m));
                continue;
            }
            let dst = self.client_ptr(s, u64::from(k) * c + u64::from(r.start));
            let src = &self.sops[s as usize].bufs[usize::from(m)]
                [(r.start - range.start) as usize..(r.end - range.start) as usize];
            // SAFETY: dst is the caller's buffer range for these bytes (lent until the
            // request completes, used by this operation alone); src is our own buffer.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        }
        // Rewrite what the members with unrecovered read errors could not return: the
        // device remaps the sectors, and the member stays in service.
        let bad = self.sops[s as usize].bad.clone();
        if bad.is_empty() {
            return self.finish_sop(s, Ok(()));
        }
        let r = self.sops[s as usize].range;
        self.cache.invalidate(self.sops[s as usize].stripe);
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
}

/// The chunk range a degraded read reads from every survivor and rebuilds: the hull of
/// what the read wants of its lost data chunks (`lost`: the stripe's missing members, at
/// most two), so that a read crossing chunk boundaries reads the survivors only where the
/// lost data lies (md's `stripe_head` works in 4 KiB pages and likewise reads only the
/// survivors' pages under the lost sectors); the read's whole parity range when it wants
/// nothing of a lost chunk (a retry whose only missing members hold chunks the read does
/// not touch, or parity: a device leaving at a replacement's swap, an untouched member
/// that returned an unrecovered read error).
fn degraded_read_range(
    w: &crate::stripe::StripeWrite,
    st: &crate::geometry::StripeLayout,
    lost: &[u16],
) -> ChunkRange {
    w.chunks()
        .filter(|&(k, _)| lost.contains(&st.data_member(k)))
        .map(|(_, r)| r)
        .reduce(|h, r| h.hull(&r))
        .unwrap_or_else(|| w.parity_range())
}

/// Splits one operation's member buffers into slot-ordered data views (pushed onto
/// `data`, which the caller owns: returning a 255-entry `ArrayVec` by value would copy all
/// of it), and returns P and Q, each over the operation's range `r` (which sits at the front of
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
