//! Member I/O: issuing, pumping and reaping member requests, their completions, and
//! timeouts.

use crate::device::{Channel, Completion, IoBuf, IoError, IoSeg, Op, Request, SubmitError};
use crate::qos::IoClass;

use super::{Array, Phase, MEMBER_BITS, NO_ENTRY};

impl<C: Channel> Array<C> {
    // ---- member I/O --------------------------------------------------------------------

    /// Advances every member's depth controller to now, once per clock value: the rounds
    /// of one [`Array::process`] call share a `now`, and a window that was open at the
    /// first round is still open at the next (a window shortened meanwhile by a
    /// calibration closes at the next tick).
    pub(super) fn tick_members(&mut self) {
        if self.ticked_at == Some(self.now) {
            return;
        }
        self.ticked_at = Some(self.now);
        for m in &mut self.members {
            m.queue.tick(self.now);
        }
        // The share's figures reach `ArrayStats` when the stats are read (`Array::stats`),
        // not copied here every turn.
        self.bulk_share.tick(self.now, self.bulk_reqs > 0);
    }

    /// Hands queued requests to the channels (class order, within the limits).
    pub(super) fn resubmit(&mut self) -> bool {
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

    pub(super) fn reap(&mut self) -> bool {
        let mut any = false;
        while let Some(c) = self.synthetic.pop_front() {
            self.member_done(c, None);
            any = true;
        }
        for mi in 0..self.members.len() {
            loop {
                let n = self.members[mi].ch.poll(&mut self.scratch);
                for i in 0..n {
                    // The tag, then the status only where it is an error: the back end has
                    // just written the entry with stores of its own widths, and a load
                    // across two of them (the whole entry, or a success's status with its
                    // unused payload) misses store-to-load forwarding, a stall per
                    // completion.
                    let tag = self.scratch[i].tag;
                    let status = match self.scratch[i].status {
                        Ok(()) => Ok(()),
                        Err(_) => self.scratch[i].status,
                    };
                    let device_ns = self.members[mi].queue.completed(tag, self.now);
                    self.member_done(Completion { tag, status }, device_ns);
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
    pub(super) fn tag_of(&self, s: u32, entry: u16) -> u64 {
        (u64::from(s) << MEMBER_BITS) | u64::from(self.members[usize::from(entry)].id)
    }

    /// The device id of entry `entry`.
    pub(super) fn id_of(&self, entry: u16) -> usize {
        usize::from(self.members[usize::from(entry)].id)
    }

    /// The entry of the device with tag id `id`, if one holds it.
    pub(super) fn entry_of_id(&self, id: u16) -> Option<u16> {
        self.entry_of
            .get(usize::from(id))
            .copied()
            .filter(|&e| e != NO_ENTRY)
    }

    /// A member request completed; `device_ns`: its time in the device (hand-over to the
    /// channel → reaped), when it went through the member queue.
    #[inline]
    fn member_done(&mut self, c: Completion, device_ns: Option<u64>) {
        let s = (c.tag >> MEMBER_BITS) as u32;
        let id = (c.tag & ((1 << MEMBER_BITS) - 1)) as u16;
        let Some(member) = self.entry_of_id(id) else {
            self.stats.stray_completions += 1;
            return;
        };
        // The tag spaces are disjoint (stripe operations, the bitmap's, the PPL logs',
        // then the fast-path reads'): the data path's most common completion first.
        if let Some(ri) = self.fast_req_of(s) {
            return self.fast_read_done(s, ri, member, id, c.status, device_ns);
        }
        if s == self.bitmap_sop() {
            return self.bitmap_write_done(member, c.status);
        }
        if let Some(l) = self.ppl_log_of(s) {
            return self.ppl_io_done(l, member, id, c.status);
        }
        let known = (s as usize) < self.sops.len() && self.sops[s as usize].outstanding > 0;
        if !known {
            self.stats.stray_completions += 1;
            return;
        }
        if let (Some(d), None) = (device_ns, self.sops[s as usize].bg.as_ref()) {
            // The request's slowest member request so far: what of its latency the
            // devices took (the bulk share measures the rest, [`crate::qos::share`]).
            if let Some(r) = self.reqs.get_mut(self.sops[s as usize].req) {
                r.device_ns = r.device_ns.max(d);
            }
        }
        {
            let sop = &mut self.sops[s as usize];
            let pm = &mut sop.per_member[usize::from(id)];
            debug_assert!(*pm > 0, "completion from a member with nothing outstanding");
            *pm = pm.saturating_sub(1);
            let m = &mut self.members[usize::from(member)];
            // Saturates at the histogram's top (one hour); never allocates.
            m.latency
                .record(self.now.saturating_sub(sop.issued_ns).max(1));
            m.counters.errors += u64::from(c.status.is_err());
            if matches!(sop.phase, Phase::Flushing | Phase::ZeroFlush) {
                m.flushing = m.flushing.saturating_sub(1);
            }
            // Whatever its status, a write may have reached the device's volatile cache.
            m.unflushed |= matches!(
                sop.phase,
                Phase::Writing | Phase::Repair | Phase::Zeroing | Phase::BgWrite | Phase::PassWrite
            );
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
                Phase::DirectRead
                    | Phase::DegradedRead
                    | Phase::WriteRead(_)
                    | Phase::PassRead(_)
                    | Phase::BgRead
                    | Phase::CombineRead
                    | Phase::CombineDegradedRead
            );
            // A latent sector error on a read: rebuild the range from redundancy and
            // rewrite it; the member stays in service (md's read-error handling).
            // A phase may have several requests on one member (a pass reads each run of
            // missing blocks, large ranges go out in pieces): a second latent error on a
            // member already marked bad in this operation is the same case.
            if e == IoError::Medium && reading && sop.bad.contains(&member) {
                self.stats.medium_errors += 1;
            } else if e == IoError::Medium && reading && !sop.bad.is_full() {
                sop.bad.push(member);
                self.stats.medium_errors += 1;
            } else {
                self.fail_member(member, e);
            }
        }
        let sop = &mut self.sops[s as usize];
        sop.outstanding -= 1;
        if sop.outstanding == 0 {
            if std::mem::take(&mut sop.write_in_io) {
                self.write_ops_in_io -= 1;
            }
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
            Phase::DirectRead
                | Phase::DegradedRead
                | Phase::WriteRead(_)
                | Phase::PassRead(_)
                | Phase::BgRead
                | Phase::CombineRead
                | Phase::CombineDegradedRead
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
        let req = self.reqs.get(sop.req).expect("live request");
        if req.op.is_read() {
            IoClass::ForegroundRead
        } else {
            IoClass::ForegroundWrite
        }
    }

    /// Issues one member I/O for stripe operation `s`: `len` bytes at `chunk_off` of the
    /// member's chunk in the operation's stripe, to/from `ptr`.
    /// A write to the member being replaced goes to its replacement as well (md writes a
    /// slot's `rdev` and `replacement` alike).
    #[inline]
    pub(super) fn io(
        &mut self,
        s: u32,
        member: u16,
        op: Op,
        chunk_off: u32,
        len: u32,
        ptr: *mut u8,
    ) {
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
    pub(super) fn io_write(
        &mut self,
        s: u32,
        member: u16,
        op: Op,
        chunk_off: u32,
        len: u32,
        ptr: *mut u8,
    ) {
        for m in self.write_targets(member, op).into_iter().flatten() {
            self.io_dev(s, m, op, chunk_off, len, ptr);
        }
    }

    /// The device entries a write of member `member`'s chunk goes to ([`Self::io_write`]):
    /// the member and, while it is being replaced, its replacement; the replacement alone
    /// when the member has failed; none when it has failed without one.
    pub(super) fn write_targets(&self, member: u16, op: Op) -> [Option<u16>; 2] {
        if !self.is_failed(member) {
            [Some(member), self.mirror_of(member, op)]
        } else {
            [self.replacement_of(member), None]
        }
    }

    /// [`Self::io_write`] of a gathered write: the `count` pieces listed at `list`, `len`
    /// bytes in all, to chunk offset `chunk_off` of the member (and its replacement), as one
    /// request ([`IoBuf::gather`]). The caller checked that every device entry's channel
    /// gathers and takes `len` bytes at once ([`Self::gathers`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn io_write_gathered(
        &mut self,
        s: u32,
        member: u16,
        fua: bool,
        chunk_off: u32,
        len: u32,
        list: std::ptr::NonNull<IoSeg>,
        count: u16,
    ) {
        let op = Op::Write { fua };
        let targets = self.write_targets(member, op);
        // Counted once per chunk that goes anywhere (not for a member failed meanwhile
        // without a replacement).
        self.stats.gathered_writes += u64::from(targets[0].is_some());
        for m in targets.into_iter().flatten() {
            debug_assert!(!self.is_failed(m), "I/O planned on a failed member");
            debug_assert!(len <= self.members[usize::from(m)].max_transfer);
            let g = self.geo.geometry();
            let stripe = self.sops[s as usize].stripe;
            let base = self.data_offset + stripe * u64::from(g.chunk_bytes());
            // SAFETY: the list is the leader's `pass_gather` entry of this member, in the
            // operation table allocated at start and left alone until the pass completes,
            // which is after this request's completion; its pieces are ranges of the pass's
            // callers' buffers, lent until their requests complete (also after this one),
            // which nothing writes meanwhile; `find_direct` built them to add up to `len`.
            let buf = unsafe { IoBuf::gather(list, count, len) };
            let req = Request {
                tag: self.tag_of(s, m),
                op,
                offset_bytes: base + u64::from(chunk_off),
                len_bytes: len,
                buf,
            };
            self.count_issue(s, m, op, len);
            let class = self.class_of(s, op);
            self.send(m, class, req);
        }
    }

    /// [`Self::io`] to device entry `member` alone (a member, or the replacement).
    pub(super) fn io_dev(
        &mut self,
        s: u32,
        member: u16,
        op: Op,
        chunk_off: u32,
        len: u32,
        ptr: *mut u8,
    ) {
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
    #[inline]
    pub(super) fn send(&mut self, member: u16, class: IoClass, req: Request) {
        let now = self.now;
        let m = &mut self.members[usize::from(member)];
        let synthetic = &mut self.synthetic;
        m.queue.send(class, req, &mut m.ch, now, |req, e| {
            synthetic.push_back(refusal(req.tag, e));
        });
    }

    pub(super) fn io_flush(&mut self, s: u32, member: u16) {
        let req = Request {
            tag: self.tag_of(s, member),
            op: Op::Flush,
            offset_bytes: 0,
            len_bytes: 0,
            buf: IoBuf::NONE,
        };
        self.count_issue(s, member, Op::Flush, 0);
        self.members[usize::from(member)].flushing += 1;
        self.send(member, IoClass::Flush, req);
    }

    /// Issues one bufferless member request (`WriteZeroes`, `Discard`) over the whole chunk
    /// of operation `s`'s stripe, split at the member's largest transfer.
    pub(super) fn io_nodata(&mut self, s: u32, member: u16, op: Op) {
        self.io_nodata_dev(s, member, op);
        if let Some(r) = self.mirror_of(member, op) {
            self.io_nodata_dev(s, r, op);
        }
    }

    /// [`Self::io_nodata`] to device entry `member` alone.
    pub(super) fn io_nodata_dev(&mut self, s: u32, member: u16, op: Op) {
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
    #[inline]
    fn count_issue(&mut self, s: u32, member: u16, op: Op, len: u32) {
        if self.sops[s as usize].outstanding == 0 {
            let sop = &self.sops[s as usize];
            let mut write = false;
            if sop.bg.is_none() {
                if let Some(r) = self.reqs.get_mut(sop.req) {
                    write = r.op.is_write() && !sop.foreign;
                    if !std::mem::replace(&mut r.issued, true) {
                        // Saturates at the histogram's top (one hour); never allocates.
                        self.queue_wait[r.class.index()]
                            .record(self.now.saturating_sub(r.submit_ns));
                    }
                }
            }
            let sop = &mut self.sops[s as usize];
            sop.issued_ns = self.now;
            sop.write_in_io = write;
            self.write_ops_in_io += u32::from(write);
        }
        let sop = &mut self.sops[s as usize];
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
    pub(super) fn check_timeouts(&mut self) -> bool {
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
        any | self.fast_read_timeouts() | self.ppl_timeouts()
    }

    /// Operation `s`'s requests to `member` ran past the command timeout: the member is
    /// failed, its queued requests complete with [`IoError::Timeout`] at once and those in
    /// the device are aborted (their completions, if any, come back as timeouts too).
    pub(super) fn time_out(&mut self, s: u32, member: u16) {
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
    pub(super) fn fail_entry(&mut self, entry: u16, e: IoError) {
        if usize::from(entry) < self.slots() {
            self.fail_member(entry, e);
        } else if self.replacement_entry() == Some(entry) {
            self.fail_replacement_entry(e);
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
