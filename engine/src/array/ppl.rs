//! The Partial Parity Log's write side: a stripe write whose parity is computed waits in
//! [`Phase::PplWait`] until a record describing it is durable on the stripe's parity
//! member — on RAID6 on both parity members, P's log and Q's log (ferroraid's extension,
//! docs/FORMAT.md) — then issues its data and parity writes; a log's next record waits
//! until those writes are durable. The rules and the cross-shard turns are in
//! [`crate::ppl`]; the record format is md's ([`crate::metadata::ppl`]).
//!
//! Partial parity is computed when the record is built, from what the write is about to
//! write: over the rows of an entry whose modified data chunks are `D_k`,
//! `PP = P_new ⊕ ⊕ D_k,new` — equal to the XOR of the chunks the write leaves alone (md's
//! definition, raid5-ppl.rst), whichever way (RMW, RCW, degraded) P was computed; on
//! RAID6 the Q log's record carries partial Q, `PQ = Q_new ⊕ Σ g^slot(k)·D_k,new`, the Q
//! syndrome of the chunks left alone.
//!
//! # RAID6: two logs per write, taken in member order
//! A RAID6 write joins the log of the lower-numbered of its stripe's two parity members
//! first, and the other log only once it is in a record of the first (that turn held):
//! a shard holding a turn on log `a` waits only for logs `b > a`, so turns cannot wait on
//! each other in a cycle (lock ordering). Its two records may be in flight together; its
//! member writes go out once both are durable.
//!
//! What recovery relies on ([`crate::ppl::recover`]): a write with member writes not yet
//! durable is in the newest record of both its logs, so newest records that disagree
//! about a stripe mean the stripe is consistent on stable media. Mostly that follows from
//! a turn ending only once every member its record's writes reached is flushed: a later
//! write of the stripe enters a log's next record only after the earlier write, which was
//! in that log too, is durable. Where the earlier write was logged in one log only (the
//! other parity member was out of service and has come back since), it does not; so a
//! write of a stripe is not queued for any log while an earlier write of the same stripe
//! is in a record whose turn has not ended (`deferred`). The deterministic crash tests
//! (volatile member caches lost at the crash, `tests/tests/write_hole.rs`) do not reach
//! that corner; removing the rule fails none of them.
//!
//! # A member being replaced
//! Its log stays on the member until the replacement takes the slot
//! (`Array::complete_replace`); then the log's next record starts the area again
//! ([`crate::ppl::PplLog::rewind`]): the replacement's area was zeroed when it joined, and
//! recovery walks a log from the area's start. Records written to the replacement during
//! the copy would not help: they could not be walked to, and a record of a write logged
//! before its member failed mid-replace would be replayed over the later unlogged writes
//! of its stripe (a reviewing session's reproduction). A log's requests in flight are
//! known by device id, so one still out to the replaced device when it leaves its slot
//! completes normally, and the leaving device stays attached until it is back
//! (`entry_busy`).

use std::collections::VecDeque;
use std::sync::Arc;

use arrayvec::ArrayVec;

use super::{Array, Phase};
use crate::buf::AlignedBuf;
use crate::device::{Channel, IoBuf, IoError, Op, Request};
use crate::metadata::ppl::{
    pp_checksum, PplEntry, PplHeader, PPL_HDR_MAX_ENTRIES, PPL_HEADER_SIZE, PPL_SPACE_SIZE,
};
use crate::parity::MAX_DATA_CHUNKS;
use crate::ppl::{entries_for_range, PplShared};
use crate::qos::IoClass;
use crate::stripe::WriteMode;

/// Which path issues a logged operation's member writes once its record is durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Logged {
    /// A write pass ([`super::pass`]).
    Pass,
    /// The single-operation path ([`super::write`]).
    Single,
    /// Native write-zeroes or discard of a whole stripe (`op`): logged as md logs a
    /// full-stripe write (no partial parity), so recovery recomputes its parity from
    /// whatever each member holds after a crash — and so an older record of the stripe
    /// is never replayed over the zeroes.
    Zeroing(Op),
}

/// A shard's side of one member's log.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum LogState {
    /// No turn held or asked for.
    Idle,
    /// Waiting for the turn of `ticket`.
    Waiting { ticket: u64 },
    /// The record write is in flight.
    Writing { ticket: u64 },
    /// The record's stripe writes are in flight (`left` of them).
    Draining { ticket: u64, left: u32 },
    /// Flushes of the members the record's writes reached are in flight (`left`).
    Flushing { ticket: u64, left: u32 },
}

/// One member's log as this shard sees it.
struct ShardLog {
    /// Writes waiting for the log (their parity computed), in order.
    queue: VecDeque<u32>,
    /// The writes of the record in flight.
    record: Vec<u32>,
    /// The stripes of the record, until its turn ends (the deferral rule above).
    stripes: Vec<u64>,
    state: LogState,
    /// The record: header, then partial parity (`PPL_HEADER_SIZE + space` bytes).
    buf: AlignedBuf,
    /// Members the record's writes reached (bit per member slot).
    written: u64,
    /// Devices with a request of this log in flight (the record write, or the turn-end
    /// flushes of the members and a live replacement; at most one each), by device id
    /// (`Member::id`, not slot: a replaced member leaving its slot keeps its id until its
    /// requests are back), and when the latest was sent (array clock, ns): for the
    /// command timeout, and to recognise a late completion of an aborted request.
    in_flight: u128,
    issued_ns: u64,
}

/// A shard's write side of the array's PPL.
pub(super) struct PplShard {
    shared: Arc<PplShared>,
    logs: Vec<ShardLog>,
    /// Reused for each record's entries (no allocation per record).
    entries: Vec<PplEntry>,
    /// Partial parity bytes a record may carry.
    space: usize,
    /// Writes waiting for an earlier write of their stripe to leave its records' turns
    /// (the deferral rule in the module docs), in arrival order.
    deferred: VecDeque<u32>,
}

impl PplShard {
    /// Member slot `slot`'s device changed: its log's next record starts the area again
    /// ([`crate::ppl::PplLog::rewind`], the module docs).
    pub(super) fn rewind_log(&self, slot: usize) {
        self.shared.log(slot).rewind();
    }
}

impl<C: Channel> Array<C> {
    /// Attaches the array's Partial Parity Log (md's on RAID5, ferroraid's extension on
    /// RAID6): from now on every write of a stripe is logged on each of its parity members
    /// in service before it goes out (see the module docs). Every shard of the array attaches the same `shared`. Attach before
    /// submitting requests; the area must hold two 4 KiB headers plus the partial parity
    /// of one chunk, and must have been recovered and re-initialised at this assembly (md
    /// zeroes it and writes an empty header at every start, `ppl_load_distributed`): the
    /// records start again at generation 1 at the area's start, and a record of an earlier
    /// run lying past them would otherwise look newer to recovery.
    ///
    /// # Panics
    /// If a log or bitmap is already attached, requests are in flight, or the area is too
    /// small — programmer errors (assembly checks all of it).
    pub fn attach_ppl(&mut self, shared: Arc<PplShared>) {
        let g = *self.geo.geometry();
        assert!(self.ppl.is_none(), "a PPL is already attached");
        assert!(
            self.intent.is_none(),
            "PPL and the write-intent bitmap exclude each other"
        );
        assert!(!self.busy(), "attach the PPL before submitting requests");
        assert_eq!(shared.members(), self.slots(), "one log per member");
        // One bit per member slot in `written`, per device id (members and a
        // replacement) in `in_flight`.
        assert!(
            self.slots() <= usize::from(crate::ppl::MAX_PPL_MEMBERS),
            "a PPL supports at most {} members",
            crate::ppl::MAX_PPL_MEMBERS
        );
        const _: () = assert!((crate::ppl::MAX_PPL_MEMBERS as u32) < u128::BITS);
        let chunk = g.chunk_bytes() as usize;
        let space = PPL_SPACE_SIZE.max(chunk);
        // A record ends more than one header before the area's end
        // (`crate::ppl::PplLog::place_record`).
        assert!(
            shared.area_bytes >= crate::ppl::min_area_bytes(g.chunk_bytes()),
            "the PPL area cannot hold one chunk's partial parity"
        );
        let space = space.min(shared.area_bytes as usize - 3 * PPL_HEADER_SIZE);
        let logs = (0..self.slots())
            .map(|_| ShardLog {
                queue: VecDeque::with_capacity(self.sops.len()),
                record: Vec::with_capacity(self.sops.len()),
                stripes: Vec::with_capacity(self.sops.len()),
                state: LogState::Idle,
                buf: AlignedBuf::zeroed(PPL_HEADER_SIZE + space),
                written: 0,
                in_flight: 0,
                issued_ns: 0,
            })
            .collect();
        self.ppl = Some(PplShard {
            shared,
            logs,
            entries: Vec::with_capacity(PPL_HDR_MAX_ENTRIES),
            space,
            deferred: VecDeque::with_capacity(self.sops.len()),
        });
    }

    /// The "operation index" in the tags of log `log`'s record writes and flushes: past
    /// the stripe operations and the bitmap's slot.
    fn ppl_sop(&self, log: usize) -> u32 {
        self.bitmap_sop() + 1 + log as u32
    }

    /// Whether tag operation index `s` is one of the logs'; returns the log.
    pub(super) fn ppl_log_of(&self, s: u32) -> Option<usize> {
        let base = self.bitmap_sop() + 1;
        (s >= base && ((s - base) as usize) < self.slots() && self.ppl.is_some())
            .then(|| (s - base) as usize)
    }

    /// Called where write operation `s` would issue its member writes (parity computed,
    /// or a whole stripe to zero natively; `kind` says which path issues them): with a PPL
    /// and a parity member of the stripe in service, queues it for its first log (or
    /// defers it, see the module docs) and returns `true` (it then waits in
    /// [`Phase::PplWait`]).
    pub(super) fn ppl_gate(&mut self, s: u32, kind: Logged, mode: WriteMode) -> bool {
        if self.ppl.is_none() {
            return false;
        }
        let st = self.layout(s);
        // md logs only while the parity device is in sync; RAID6 logs on each parity
        // member in service, lower member first.
        let mut logs = [NO_LOG; 2];
        let mut n = 0;
        for m in [Some(st.p_member()), st.q_member()].into_iter().flatten() {
            if !self.members[usize::from(m)].state.is_failed() {
                logs[n] = m;
                n += 1;
            }
        }
        if n == 0 {
            return false;
        }
        if n == 2 && logs[1] < logs[0] {
            logs.swap(0, 1);
        }
        let sop = &mut self.sops[s as usize];
        sop.phase = Phase::PplWait(kind);
        sop.mode = mode;
        sop.ppl_logs = logs;
        sop.ppl_durable = 0;
        self.ppl_enqueue(s);
        true
    }

    /// Queues gated write `s` for its first log, or defers it while an earlier write of
    /// its stripe is in a record whose turn has not ended.
    fn ppl_enqueue(&mut self, s: u32) {
        let sop = &self.sops[s as usize];
        let (stripe, first) = (sop.stripe, sop.ppl_logs[0]);
        let p = self.ppl.as_mut().expect("attached");
        if p.logs.iter().any(|l| l.stripes.contains(&stripe)) {
            p.deferred.push_back(s);
        } else {
            p.logs[usize::from(first)].queue.push_back(s);
        }
    }

    /// The logs' turn in the loop: take tickets, write records whose turn came.
    pub(super) fn ppl_work(&mut self) -> bool {
        let Some(p) = &mut self.ppl else {
            return false;
        };
        let mut any = false;
        for l in 0..p.logs.len() {
            let p = self.ppl.as_mut().expect("attached");
            let log = &mut p.logs[l];
            match log.state {
                LogState::Idle if !log.queue.is_empty() => {
                    log.state = LogState::Waiting {
                        ticket: p.shared.log(l).take_ticket(),
                    };
                    any = true;
                }
                _ => {}
            }
            let p = self.ppl.as_mut().expect("attached");
            if let LogState::Waiting { ticket } = p.logs[l].state {
                if p.shared.log(l).serving() == ticket {
                    self.write_record(l, ticket);
                    any = true;
                }
            }
        }
        any
    }

    /// Whether a log holds or waits for a turn (its record, its writes or its flushes in
    /// flight): the shard is not idle.
    pub(super) fn ppl_busy(&self) -> bool {
        self.ppl.as_ref().is_some_and(|p| {
            !p.deferred.is_empty() || p.logs.iter().any(|l| l.state != LogState::Idle)
        })
    }

    /// Whether a log has a request in flight to the device with id `id`.
    pub(super) fn ppl_in_flight_to(&self, id: usize) -> bool {
        self.ppl
            .as_ref()
            .is_some_and(|p| p.logs.iter().any(|l| l.in_flight & (1 << id) != 0))
    }

    /// Whether some log waits for its turn (the executor must keep polling).
    pub fn ppl_waiting(&self) -> bool {
        self.ppl.as_ref().is_some_and(|p| {
            p.logs
                .iter()
                .any(|l| matches!(l.state, LogState::Waiting { .. }))
        })
    }

    /// Builds log `l`'s record from its queue (as many writes as fit) and writes it.
    fn write_record(&mut self, l: usize, ticket: u64) {
        let g = *self.geo.geometry();
        let c = u64::from(g.chunk_bytes());
        let nd = g.data_chunks();
        let sector = |x: u64| x / 512;
        let mut p = self.ppl.take().expect("attached");
        p.entries.clear();
        let mut pp_len = 0usize;
        let log = &mut p.logs[l];
        log.record.clear();
        debug_assert!(log.stripes.is_empty(), "a turn's stripes outlived it");
        log.written = 0;
        while let Some(&s) = log.queue.front() {
            let sop = &self.sops[s as usize];
            let (lo, hi) = (sop.ppl_lo, sop.ppl_hi);
            let rects = entries_for_range(lo, hi, g.chunk_bytes());
            let need: usize = rects.iter().map(|r| r.pp_bytes(nd) as usize).sum();
            if !log.record.is_empty()
                && (p.entries.len() + rects.len() > PPL_HDR_MAX_ENTRIES || pp_len + need > p.space)
            {
                break;
            }
            log.queue.pop_front();
            log.record.push(s);
            log.stripes.push(sop.stripe);
            let st = sop.layout;
            // This log is the stripe's P member's, or (RAID6) its Q member's.
            let q_log = usize::from(st.p_member()) != l;
            debug_assert!(!q_log || st.q_member() == Some(l as u16));
            for r in &rects {
                let pp = r.pp_bytes(nd) as usize;
                let first = (sop.stripe * u64::from(nd) + u64::from(r.first_chunk)) * c
                    + u64::from(r.row_start);
                let mut checksum = 0;
                if pp > 0 {
                    let dst = &mut log.buf[PPL_HEADER_SIZE + pp_len..PPL_HEADER_SIZE + pp_len + pp];
                    if q_log {
                        self.partial_q(s, r.row_start, r.first_chunk, r.chunks, dst);
                    } else {
                        self.partial_parity(s, r.row_start, r.first_chunk, r.chunks, dst);
                    }
                    checksum = pp_checksum(dst);
                }
                pp_len += pp;
                p.entries.push(PplEntry {
                    data_sector: sector(first),
                    pp_size: pp as u32,
                    data_size: r.row_bytes * u32::from(r.chunks),
                    parity_disk: l as u32,
                    checksum,
                });
            }
            // The members the writes reach: the modified chunks', P and Q (flushed before
            // the turn passes on, when they have a volatile cache).
            for r in &rects {
                for k in r.first_chunk..r.first_chunk + r.chunks {
                    log.written |= 1 << st.data_member(k);
                }
            }
            for m in [Some(st.p_member()), st.q_member()].into_iter().flatten() {
                log.written |= 1 << m;
            }
        }
        // RAID6: the record's writes whose other log is a higher member's join that log
        // now — holding this turn, a write may wait for a higher log's (the module docs)
        // — so both records can be in flight at once.
        for i in 0..p.logs[l].record.len() {
            let s = p.logs[l].record[i];
            let [first, second] = self.sops[s as usize].ppl_logs;
            if usize::from(first) == l && second != NO_LOG {
                p.logs[usize::from(second)].queue.push_back(s);
            }
        }
        let record_bytes = (PPL_HEADER_SIZE + pp_len) as u64;
        let (generation, off) = p
            .shared
            .log(l)
            .place_record(record_bytes, p.shared.area_bytes);
        let header = PplHeader {
            signature: p.shared.signature,
            generation,
            entries: std::mem::take(&mut p.entries),
        };
        let log = &mut p.logs[l];
        let block: &mut [u8; PPL_HEADER_SIZE] = (&mut log.buf[..PPL_HEADER_SIZE])
            .try_into()
            .expect("the record buffer starts with a header");
        header
            .encode_into(block)
            .expect("the record's entries fit the header");
        p.entries = header.entries;
        log.state = LogState::Writing { ticket };
        let ptr = log.buf.as_mut_ptr();
        let offset = p.shared.area_offset_bytes + off;
        self.ppl = Some(p);
        self.stats.ppl_records += 1;
        self.stats.ppl_bytes += record_bytes;
        // SAFETY: the record buffer belongs to this log and is not touched again until
        // the record write completes (the log stays in `Writing` until then).
        let buf = unsafe {
            IoBuf::from_raw(
                std::ptr::NonNull::new(ptr).expect("non-null buffer"),
                record_bytes as u32,
                None,
            )
        };
        self.ppl_send(
            l,
            l as u16,
            Op::Write { fua: true },
            offset,
            record_bytes as u32,
            buf,
        );
    }

    /// Sends one of log `l`'s requests (record write or flush) to device entry `member`
    /// (a member slot, or a live replacement).
    fn ppl_send(&mut self, l: usize, member: u16, op: Op, offset: u64, len: u32, buf: IoBuf) {
        let req = Request {
            tag: self.tag_of(self.ppl_sop(l), member),
            op,
            offset_bytes: offset,
            len_bytes: len,
            buf,
        };
        let m = &mut self.members[usize::from(member)];
        if matches!(op, Op::Write { .. }) {
            m.counters.writes += 1;
            m.counters.write_bytes += u64::from(len);
        } else {
            m.counters.flushes += 1;
        }
        let id = m.id;
        let log = &mut self.ppl.as_mut().expect("attached").logs[l];
        debug_assert_eq!(log.in_flight & (1 << id), 0, "one request per device");
        log.in_flight |= 1 << id;
        log.issued_ns = self.now;
        self.send(member, IoClass::Flush, req);
    }

    /// The new contents of write `s` over `row_start..row_start + len` (chunk bytes):
    /// returns the address of parity member `parity`'s rows (its new P or Q) and pushes
    /// onto `data` (empty), for modified chunks `first..first + n`, each one's Q slot and
    /// the address of its new rows. `data` is the caller's, filled in place: returned by
    /// value, a 255-entry `ArrayVec` is a 4 KiB copy per entry (0.3 µs of a 4 KiB write's
    /// 3 µs on `null` members, `perf`).
    #[allow(clippy::too_many_arguments)]
    fn new_rows(
        &self,
        s: u32,
        row_start: u32,
        first: u16,
        n: u16,
        parity: u16,
        len: usize,
        data: &mut ArrayVec<(u8, *const u8), MAX_DATA_CHUNKS>,
    ) -> *const u8 {
        debug_assert!(data.is_empty());
        let c = u64::from(self.geo.geometry().chunk_bytes());
        let sop = &self.sops[s as usize];
        let st = sop.layout;
        if sop.phase == Phase::PplWait(Logged::Pass) {
            let ent = self.cache.entry(sop.pass_entry);
            let par = ent.bufs[usize::from(parity)]
                .as_ptr()
                .wrapping_add(row_start as usize);
            for k in first..first + n {
                let m = usize::from(st.data_member(k));
                // No gathered chunks with a PPL (`Array::gathers`).
                debug_assert!(!sop.pass_gather[m].is_set());
                let direct = sop.pass_direct[m];
                let base = if direct != 0 {
                    direct as *const u8
                } else {
                    ent.bufs[m].as_ptr()
                };
                data.push((st.q_slot(k) as u8, base.wrapping_add(row_start as usize)));
            }
            par
        } else {
            let r = sop.range;
            debug_assert!(r.start <= row_start && row_start as usize + len <= r.end as usize);
            let par = sop.bufs[self.parity_buf(s, parity, sop.mode)]
                .as_ptr()
                .wrapping_add((row_start - r.start) as usize);
            for k in first..first + n {
                let ptr = self.client_ptr(s, u64::from(k) * c + u64::from(row_start));
                data.push((st.q_slot(k) as u8, ptr.cast_const()));
            }
            par
        }
    }

    /// Partial parity of write `s` over `row_start..row_start + dst.len()` (chunk bytes)
    /// for modified chunks `first..first + n`: `P_new ⊕ ⊕ D_k,new`, into `dst`.
    fn partial_parity(&self, s: u32, row_start: u32, first: u16, n: u16, dst: &mut [u8]) {
        let len = dst.len();
        let pm = self.layout(s).p_member();
        let mut mods = ArrayVec::new();
        let par = self.new_rows(s, row_start, first, n, pm, len, &mut mods);
        let mut data: ArrayVec<&[u8], { MAX_DATA_CHUNKS + 1 }> = ArrayVec::new();
        for ptr in std::iter::once(par).chain(mods.iter().map(|&(_, p)| p)) {
            // SAFETY: each pointer addresses `len` bytes of the rows being logged
            // (`new_rows`): the new P in the pass's pinned cache entry or the operation's P
            // buffer (the parity range starts at buffer byte 0), and the new data of a
            // modified chunk — the entry's chunk buffer, or the caller's buffer whose
            // written range covers these rows (entries only name rows a chunk is modified
            // in). None of them is `dst` (the log's record buffer).
            data.push(unsafe { std::slice::from_raw_parts(ptr, len) });
        }
        // Cached stores: the checksum reads the partial parity next, then the record
        // write (streaming stores would send it to memory and make both read it back).
        self.parity.streaming(false).gen_p(&data, dst);
    }

    /// Partial Q of RAID6 write `s` over `row_start..row_start + dst.len()` (chunk bytes)
    /// for modified chunks `first..first + n`: `Q_new ⊕ Σ g^slot(k)·D_k,new`, into `dst`
    /// — the Q syndrome of the chunks the write leaves alone — in one pass
    /// ([`crate::parity::Parity::fold_q`]).
    fn partial_q(&self, s: u32, row_start: u32, first: u16, n: u16, dst: &mut [u8]) {
        let len = dst.len();
        let qm = self
            .geo
            .stripe(self.sops[s as usize].stripe)
            .q_member()
            .expect("partial Q is RAID6's");
        let mut mods = ArrayVec::new();
        let par = self.new_rows(s, row_start, first, n, qm, len, &mut mods);
        // SAFETY: as in `partial_parity`: `len` bytes of the new Q rows, not `dst`.
        let q_new = unsafe { std::slice::from_raw_parts(par, len) };
        let mut data: ArrayVec<(u8, &[u8]), MAX_DATA_CHUNKS> = ArrayVec::new();
        for &(slot, ptr) in &mods {
            // SAFETY: as in `partial_parity`: `len` bytes of a modified chunk's new rows,
            // not `dst` (the log's record buffer).
            data.push((slot, unsafe { std::slice::from_raw_parts(ptr, len) }));
        }
        // Cached stores: the checksum reads the partial Q next (as in `partial_parity`).
        self.parity.streaming(false).fold_q(&data, q_new, dst);
    }

    /// A record write or flush of log `l` to device entry `member` (device id `id`) is
    /// back.
    pub(super) fn ppl_io_done(
        &mut self,
        l: usize,
        member: u16,
        id: u16,
        status: Result<(), IoError>,
    ) {
        let log = &mut self.ppl.as_mut().expect("attached").logs[l];
        if log.in_flight & (1 << id) == 0 {
            // The late completion of a request already timed out and counted.
            self.stats.stray_completions += 1;
            return;
        }
        log.in_flight &= !(1 << id);
        if let Err(e) = status {
            self.members[usize::from(member)].counters.errors += 1;
            // md fails the log's member when its record write fails (`ppl_log_endio`);
            // the writes then go out unlogged (no parity member to protect). A failed
            // flush fails its member too (`ppl_flush_endio`).
            self.fail_entry(member, e);
        }
        let p = self.ppl.as_mut().expect("attached");
        match p.logs[l].state {
            LogState::Writing { ticket } => {
                let record = std::mem::take(&mut p.logs[l].record);
                let n = record.len() as u32;
                p.logs[l].state = LogState::Draining { ticket, left: n };
                for &s in &record {
                    let sop = &mut self.sops[s as usize];
                    sop.ppl_durable += 1;
                    let logs = sop.ppl_logs.iter().filter(|&&n| n != NO_LOG).count();
                    // Out only once every record holding it is durable (RAID6: both).
                    if usize::from(sop.ppl_durable) == logs {
                        self.issue_logged(s);
                    }
                }
                self.ppl.as_mut().expect("attached").logs[l].record = record;
            }
            LogState::Flushing { ticket, left } if left > 1 => {
                p.logs[l].state = LogState::Flushing {
                    ticket,
                    left: left - 1,
                };
            }
            LogState::Flushing { ticket, .. } => self.end_turn(l, ticket),
            _ => self.stats.stray_completions += 1,
        }
    }

    /// Issues the member writes of logged operation `s`.
    fn issue_logged(&mut self, s: u32) {
        let mode = self.sops[s as usize].mode;
        match self.sops[s as usize].phase {
            Phase::PplWait(Logged::Pass) => self.issue_pass_writes(s, mode),
            Phase::PplWait(Logged::Single) => self.issue_single_writes(s, mode),
            Phase::PplWait(Logged::Zeroing(op)) => self.issue_zeroing(s, op),
            ph => unreachable!("operation in {ph:?} in a PPL record"),
        }
    }

    /// Logged operation `s`'s writes are back (whatever their status): counts them in the
    /// drain of each record holding it; when one was its record's last, flush the members
    /// the record's writes reached, then pass that log's turn on.
    pub(super) fn ppl_write_done(&mut self, s: u32) {
        let logs = std::mem::replace(&mut self.sops[s as usize].ppl_logs, [NO_LOG; 2]);
        for l in logs.into_iter().filter(|&l| l != NO_LOG) {
            self.ppl_drained(usize::from(l));
        }
    }

    /// One write of log `l`'s record is back.
    fn ppl_drained(&mut self, l: usize) {
        let p = self.ppl.as_mut().expect("attached");
        let LogState::Draining { ticket, left } = p.logs[l].state else {
            unreachable!("a logged write finished outside its record's drain");
        };
        if left > 1 {
            p.logs[l].state = LogState::Draining {
                ticket,
                left: left - 1,
            };
            return;
        }
        let written = p.logs[l].written;
        let mut flushes = 0;
        for m in 0..self.slots() as u16 {
            if written & (1 << m) == 0 {
                continue;
            }
            // The devices the record's writes to slot `m` went to: the member, and its
            // replacement while one is live (alone once the member has failed).
            for dev in self
                .write_targets(m, Op::Write { fua: false })
                .into_iter()
                .flatten()
            {
                if self.needs_flush(dev) {
                    flushes += 1;
                    self.ppl_send(l, dev, Op::Flush, 0, 0, IoBuf::NONE);
                }
            }
        }
        let p = self.ppl.as_mut().expect("attached");
        if flushes == 0 {
            self.end_turn(l, ticket);
        } else {
            p.logs[l].state = LogState::Flushing {
                ticket,
                left: flushes,
            };
        }
    }

    /// The logs' requests are member commands too: one outstanding past the command
    /// timeout fails its member and is aborted (as [`Array::check_timeouts`] does for
    /// stripe operations); its completion then comes back as a timeout.
    pub(super) fn ppl_timeouts(&mut self) -> bool {
        let Some(p) = &self.ppl else {
            return false;
        };
        if self.io_timeout_ns == 0 {
            return false;
        }
        let mut any = false;
        for l in 0..p.logs.len() {
            let log = &mut self.ppl.as_mut().expect("attached").logs[l];
            if log.in_flight == 0 || self.now.saturating_sub(log.issued_ns) < self.io_timeout_ns {
                continue;
            }
            // Abort again only after another full timeout.
            log.issued_ns = self.now;
            let mask = log.in_flight;
            for id in 0..u128::BITS as u16 {
                if mask & (1 << id) == 0 {
                    continue;
                }
                // Every device with a request in flight keeps its entry
                // (`Self::entry_busy`).
                if let Some(m) = self.entry_of_id(id) {
                    any = true;
                    self.time_out(self.ppl_sop(l), m);
                }
            }
        }
        any
    }

    /// When the oldest request of a log times out, ns (array clock).
    pub(super) fn ppl_deadline_ns(&self) -> Option<u64> {
        let p = self.ppl.as_ref()?;
        (self.io_timeout_ns > 0)
            .then(|| {
                p.logs
                    .iter()
                    .filter(|l| l.in_flight != 0)
                    .map(|l| l.issued_ns.saturating_add(self.io_timeout_ns))
                    .min()
            })
            .flatten()
    }

    fn end_turn(&mut self, l: usize, ticket: u64) {
        let p = self.ppl.as_mut().expect("attached");
        p.logs[l].state = LogState::Idle;
        p.logs[l].record.clear();
        p.logs[l].stripes.clear();
        p.shared.log(l).pass_turn(ticket);
        // Writes deferred behind this turn's stripes may queue now.
        for _ in 0..p.deferred.len() {
            let s = self
                .ppl
                .as_mut()
                .expect("attached")
                .deferred
                .pop_front()
                .expect("counted");
            self.ppl_enqueue(s);
        }
    }
}

/// How often a shard waiting for its turn on a log looks again when it has nothing else
/// to do, ns (the executor's deadline; 20 µs: a fraction of a record write).
pub(super) const TURN_POLL_NS: u64 = 20_000;

/// `Sop::ppl_logs` entry naming no log.
pub(super) const NO_LOG: u16 = u16::MAX;
