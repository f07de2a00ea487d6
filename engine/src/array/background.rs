//! Background processes (rebuild, resync, check/repair, replace) and shard/gate/pacer
//! setup.

use std::sync::Arc;

use arrayvec::ArrayVec;

use crate::device::{Channel, Op};
use crate::geometry::Role;
use crate::parity::MAX_DATA_CHUNKS;
use crate::process::{
    ProcessError, ProcessKind, ProcessRequest, ProcessState, ShardProgress, ShardWalk,
    MD_STRIPE_PAGE_BYTES, SECTOR_BYTES,
};
#[cfg(doc)]
use crate::qos::Unpaced;
use crate::qos::{Admission, Pacer};
use crate::shard::StripeGate;
use crate::stripe::ChunkRange;
use crate::zero_map::ZeroMap;

use super::{Array, ArrayError, ArrayRequest, MemberState, Phase, Proc, BG_RETRY_NS};

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

    /// Shares the array's zero map with this shard (every shard of an array gets the same
    /// one): the shard clears a stripe's bit as a write of it starts and sets it when a
    /// whole-stripe zeroing completes ([`ZeroMap`]).
    ///
    /// # Panics
    /// If requests are in flight, or the map is not sized for this array (programmer
    /// errors).
    pub fn set_zero_map(&mut self, map: Arc<ZeroMap>) {
        assert!(!self.busy(), "set the zero map before submitting requests");
        assert_eq!(
            map.stripes(),
            self.geo.stripes(),
            "zero map of another array"
        );
        self.zero_map = Some(map);
    }

    /// The array's zero map, if one was set ([`Array::set_zero_map`]).
    pub fn zero_map(&self) -> Option<&Arc<ZeroMap>> {
        self.zero_map.as_ref()
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
        // A RAID6 rebuild of one member leaves unread, in each stripe, the parity chunk the
        // rebuild does not use, where that member does not seek (`Self::start_bg`); a
        // verification walk reads those chunks afterwards.
        let g = *self.geo.geometry();
        let tail = (req.kind == ProcessKind::Rebuild
            && g.parity_chunks() == 2
            && targets.len() == 1
            && (0..g.members()).any(|m| m != targets[0] && !self.seeks(m)))
        .then(|| ShardWalk::new(ranges.clone(), 0, self.shard, self.shards));
        let verify_total = tail.as_ref().map_or(0, ShardWalk::total_own);
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
            tail,
            skipped: false,
            verifying: false,
            verify_done: 0,
            verify_total,
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
            verify_done_stripes: p.verify_done,
            verify_total_stripes: p.verify_total,
        })
    }

    /// Whether background operations are still in flight (a stopped or failed process
    /// drains them).
    pub fn background_busy(&self) -> bool {
        self.proc.as_ref().is_some_and(|p| !p.in_flight.is_empty())
    }

    /// Issues background operations while the process, the pacer and the slots allow.
    pub(super) fn issue_background(&mut self) -> bool {
        let failed = self.array_failed();
        let stripes = self.geo.stripes();
        let chunk = u64::from(self.geo.geometry().chunk_bytes());
        let members = self.geo.geometry().members();
        let slots = self.slots();
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
                    // The rebuild proper is done on this shard: its targets are in sync
                    // (`rebuilt_members`) while the parity it left unread is verified —
                    // if it left any, and unless another member waits for a rebuild of
                    // its own, which the walk would hold back (the verification is then
                    // the next check's or repair's).
                    let waiting = self.members[..slots].iter().enumerate().any(|(m, mem)| {
                        mem.state == MemberState::Rebuilding && !p.targets.contains(&(m as u16))
                    });
                    let tail = p.tail.take().filter(|_| p.skipped);
                    if tail.is_some() && waiting {
                        tracing::info!(
                            shard = self.shard,
                            "parity verification skipped: another member waits for a rebuild \
                             (a check or repair covers the parity the rebuild did not read)"
                        );
                    }
                    if let Some(tail) = tail.filter(|_| !waiting) {
                        p.walk = tail;
                        p.verifying = true;
                        for &t in &p.targets {
                            let m = &mut self.members[usize::from(t)];
                            m.recovery_stripe = m.recovery_stripe.max(stripes);
                        }
                        tracing::debug!(
                            shard = self.shard,
                            "rebuild done: verifying the parity it did not read"
                        );
                        any = true;
                        continue;
                    }
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
            let cost = bg_cost(chunk, members, p.verifying);
            match self.pacer.admit(self.now, cost, p.in_flight.len() as u32) {
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
            let layout = self.geo.stripe(stripe);
            let sop = &mut self.sops[s as usize];
            sop.req = u32::MAX;
            sop.stripe = stripe;
            sop.layout = layout;
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
            sop.bg_verify = p.verifying;
            self.waiting.push_back(s);
            any = true;
        }
        any
    }

    /// Reads the surviving chunks of the stripe whole, once the operation holds it: every
    /// one, except the parity chunk that rebuilding a RAID6 stripe's one lost chunk does
    /// not use, on a member that does not seek. A verification operation reads that chunk
    /// alone ([`Self::start_verify`]).
    pub(super) fn start_bg(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let kind = self.sops[s as usize].bg.expect("background operation");
        let stripe = self.sops[s as usize].stripe;
        // Resync, repair and rebuild write members without the cache.
        self.cache.invalidate(stripe);
        if self.array_failed() {
            return self.finish_bg(s, Err(ProcessError::ArrayFailed));
        }
        if let Err(e) = self.rebuild_target_left() {
            return self.finish_bg(s, Err(e));
        }
        // A verified chunk that was unreadable goes on below: every other chunk is read,
        // and it is rebuilt and rewritten as any unrecovered read error (`bg_compute`).
        if self.sops[s as usize].bg_verify && self.sops[s as usize].bad.is_empty() {
            return self.start_verify(s);
        }
        let chunk = g.chunk_bytes();
        if kind == ProcessKind::Replace {
            let slot = self.replace.expect("a replace has a replacement").member;
            if !self.missing(s, slot) {
                // Copy: the member's chunk alone. A read error sends the operation back
                // here with the member missing for it: then the chunk is rebuilt.
                return self.read_one_chunk(s, slot);
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
        // A RAID6 stripe with one chunk lost, a rebuild target, is rebuilt from n − 2 of its
        // n − 1 survivors (`Parity::reconstruct`): a lost data chunk from the other data
        // and P, a lost P or Q from the data alone. The parity chunk that rebuild does not
        // use is left unread when its member does not seek — a third less survivor time
        // per stripe on 4 members, a fifth on 6 (md reads every survivor while
        // recovering) — and the verification walk reads it later, so an unrecovered read
        // error there is still found and rewritten. On a disk the skipped chunk would
        // break the member's sequential run with a seek. A read error on a survivor
        // brings the operation back here with two chunks lost: then every survivor is
        // read.
        let skip = match &lost[..] {
            [t] if kind == ProcessKind::Rebuild
                && !self.sops[s as usize].bg_verify
                && self
                    .proc
                    .as_ref()
                    .is_some_and(|p| p.tail.is_some() && p.targets.contains(t)) =>
            {
                self.skippable_parity(s, *t)
            }
            _ => None,
        };
        if skip.is_some() {
            if let Some(p) = self.proc.as_mut() {
                p.skipped = true;
            }
        }
        self.begin_bg_read(s, lost);
        for m in 0..g.members() {
            if !self.missing(s, m) && Some(m) != skip {
                let ptr = self.sops[s as usize].bufs[usize::from(m)].as_mut_ptr();
                self.io(s, m, Op::Read, 0, chunk, ptr);
            }
        }
        if self.sops[s as usize].outstanding == 0 {
            self.ready.push_back(s);
        }
    }

    /// A verification operation of a rebuild ([`Proc::tail`]): reads, whole, the parity
    /// chunk the stripe's rebuild left unread. A read that fails brings the operation back
    /// to [`Self::start_bg`], which rebuilds that chunk from the others and rewrites it.
    /// With nothing to read — the rebuild read the chunk (its member seeks), or the member
    /// is gone since — the operation is done at once.
    fn start_verify(&mut self, s: u32) {
        let target = self.proc.as_ref().and_then(|p| p.targets.first().copied());
        let unread = target
            .and_then(|t| self.skippable_parity(s, t))
            .filter(|&u| !self.missing(s, u));
        match unread {
            Some(u) => self.read_one_chunk(s, u),
            None => self.finish_bg(s, Ok(())),
        }
    }

    /// Background operation `s` reads member `m`'s chunk of its stripe, whole, and nothing
    /// else (a replace's copy, a verification).
    fn read_one_chunk(&mut self, s: u32, m: u16) {
        let chunk = self.geo.geometry().chunk_bytes();
        self.begin_bg_read(s, ArrayVec::new());
        let ptr = self.sops[s as usize].bufs[usize::from(m)].as_mut_ptr();
        self.io(s, m, Op::Read, 0, chunk, ptr);
    }

    /// Background operation `s` enters its read phase over whole chunks, with the members
    /// in `lost` to rebuild from what it reads.
    fn begin_bg_read(&mut self, s: u32, lost: ArrayVec<u16, 2>) {
        let chunk = self.geo.geometry().chunk_bytes();
        let sop = &mut self.sops[s as usize];
        sop.phase = Phase::BgRead;
        sop.io_error = false;
        sop.range = ChunkRange {
            start: 0,
            end: chunk,
        };
        sop.lost = lost;
    }

    /// The RAID6 parity chunk that rebuilding member `lost`'s chunk of operation `s`'s
    /// stripe does not use: P where `lost` holds Q, else Q. `None` on RAID5.
    fn unused_parity(&self, s: u32, lost: u16) -> Option<u16> {
        let st = self.layout(s);
        let q = st.q_member()?;
        Some(if lost == q { st.p_member() } else { q })
    }

    /// The parity chunk a rebuild of member `lost`'s chunk in operation `s`'s stripe leaves
    /// unread: the one it does not use ([`Self::unused_parity`]), where that member does
    /// not seek. The rebuild's skip and its verification both decide by it.
    fn skippable_parity(&self, s: u32, lost: u16) -> Option<u16> {
        self.unused_parity(s, lost).filter(|&u| !self.seeks(u))
    }

    /// Whether member `m`'s device seeks ([`crate::device::DeviceInfo::rotational`]).
    fn seeks(&self, m: u16) -> bool {
        self.members[usize::from(m)].ch.info().rotational
    }

    /// For a rebuild: `Ok` while one of its targets is still being rebuilt (or once it is
    /// verifying: its targets are rebuilt), else [`ProcessError::TargetFailed`]. `Ok` for
    /// the other processes.
    pub(super) fn rebuild_target_left(&self) -> Result<(), ProcessError> {
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
            || p.verifying
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
    pub(super) fn bg_compute(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let kind = self.sops[s as usize].bg.expect("background operation");
        if kind == ProcessKind::Replace {
            return self.replace_compute(s);
        }
        let st = self.layout(s);
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
            let data_lost = lost
                .iter()
                .any(|&m| matches!(st.role(m), Role::Data { .. }));
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
            // A scrub still checks the parity it could read against the data as now
            // rebuilt: in a torn stripe (a crash between data and parity writes) the
            // readable parity is stale too, and a resync must leave the stripe consistent.
            // An unreadable data chunk was rebuilt from P (from Q when P is lost too); on
            // RAID6 with Q readable, a Q that disagrees says the stripe was torn and the
            // rebuilt chunk may not hold what was last written there (one erasure and one
            // wrong chunk are beyond two parities to correct), which is worth a warning.
            if kind != ProcessKind::Rebuild {
                let mismatched = self.scrub(s, kind);
                if data_lost && mismatched > 0 {
                    tracing::warn!(
                        shard = self.shard,
                        stripe = st.stripe(),
                        %kind,
                        "an unreadable data chunk was rebuilt from parity that the other \
                         parity contradicts (a torn stripe): its contents may be stale"
                    );
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

    /// Check / repair / resync of a stripe whose every chunk is in the operation's buffers
    /// (read, or rebuilt where unreadable): computes P (and Q) from the data, counts
    /// mismatching 4 KiB slices as md does (8 sectors each), and for repair and resync
    /// writes the computed parity over the first to the last mismatching slice of each
    /// parity chunk that mismatches. Returns the mismatching slices.
    fn scrub(&mut self, s: u32, kind: ProcessKind) -> u64 {
        let g = *self.geo.geometry();
        let st = self.layout(s);
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
            return mismatched_pages;
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
        mismatched_pages
    }

    /// Ends background operation `s`: frees its stripe and slots, accounts it, and moves
    /// the process (position, targets' recovery positions, end states).
    pub(super) fn finish_bg(&mut self, s: u32, status: Result<(), ProcessError>) {
        let stripes = self.geo.stripes();
        let chunk = u64::from(self.geo.geometry().chunk_bytes());
        let members = self.geo.geometry().members();
        let sop = &mut self.sops[s as usize];
        debug_assert_eq!(sop.outstanding, 0);
        let cost = bg_cost(chunk, members, sop.bg_verify);
        let stripe = sop.stripe;
        let slot = sop.bg_slot;
        let latency = self.now.saturating_sub(sop.bg_start_ns);
        sop.bg = None;
        self.locked.release(s);
        self.bg_sops.push(s);
        self.bg_free.push(slot);
        self.bg_wait = false;
        self.pacer.background_done(self.now, latency, cost);
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
            Ok(()) if p.verifying => p.verify_done += 1,
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
            // While verifying, the targets are rebuilt: they may be online already, and
            // one failing now is a new failure, not this rebuild's.
            if p.state == ProcessState::Running
                && !p.verifying
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

/// What one background operation counts for with the pacer, bytes per member: a chunk for
/// the stripe it moves (md's per-device progress: `speed_min`/`speed_max` are per member),
/// and for a rebuild's verification operation, which reads one chunk of one of the
/// `members − 1` survivors, that chunk spread over them — so the walk runs at the member
/// load the limits allow a rebuild rather than at a rebuild's stripe rate.
fn bg_cost(chunk: u64, members: u16, verify: bool) -> u64 {
    if verify {
        chunk.div_ceil(u64::from(members.saturating_sub(1).max(1)))
    } else {
        chunk
    }
}
