//! Member lifecycle: failing members, degraded state, re-adding and rebuilding members, and
//! replacement devices.

use arrayvec::ArrayVec;

#[cfg(doc)]
use crate::bitmap::WriteIntent;
use crate::device::{Channel, IoError, Op};
use crate::geometry::ArrayGeometry;
use crate::process::{ProcessError, ProcessKind, ProcessRequest, ProcessState};

#[cfg(doc)]
use super::ArrayConfig;
use super::{Array, Member, MemberState, ReplaceInfo, ReplaceState, MEMBER_BITS, NO_ENTRY};

/// Whether a device described by `info` can serve member `slot` of an array of `geo`
/// whose data area starts at `data_offset_bytes` on every member: its block size divides
/// the array's, the data offset is a multiple of its block size, it holds the data offset
/// plus the data area, and its largest transfer is at least one block.
///
/// # Errors
/// [`ProcessError::Unfit`] naming what does not fit.
pub fn device_fits(
    geo: &ArrayGeometry,
    data_offset_bytes: u64,
    slot: u16,
    info: &crate::device::DeviceInfo,
) -> Result<(), ProcessError> {
    let unfit = |why| Err(ProcessError::Unfit { member: slot, why });
    let g = geo.geometry();
    if info.block_bytes == 0 || !g.block_bytes().is_multiple_of(info.block_bytes) {
        return unfit("its block size does not divide the array's");
    }
    if !data_offset_bytes.is_multiple_of(u64::from(info.block_bytes)) {
        return unfit("the data offset is not a multiple of its block size");
    }
    if info.capacity_bytes < data_offset_bytes.saturating_add(geo.member_data_bytes()) {
        return unfit("it is smaller than the data offset plus the data area");
    }
    if info.max_transfer_bytes < info.block_bytes {
        return unfit("its largest transfer is below one block");
    }
    Ok(())
}

impl<C: Channel> Array<C> {
    /// Marks a member failed (as if it had returned `err`): a failure detected outside
    /// this shard's data path (another reactor's, a vanished device).
    ///
    /// # Panics
    /// If `member` is not a member index.
    pub fn fail_member(&mut self, member: u16, err: IoError) {
        self.set_failed(member, MemberState::Failed(err));
    }

    /// Marks a member faulty on the operator's request ([`MemberState::FailedByOperator`]).
    ///
    /// # Panics
    /// If `member` is not a member index.
    pub fn fail_member_by_operator(&mut self, member: u16) {
        self.set_failed(member, MemberState::FailedByOperator);
    }

    fn set_failed(&mut self, member: u16, state: MemberState) {
        debug_assert!(state.is_failed());
        assert!(
            usize::from(member) < self.slots(),
            "member {member} of a {}-member array",
            self.slots()
        );
        if let Some(g) = &self.gate {
            g.note_failed(member);
        }
        let m = &mut self.members[usize::from(member)];
        match m.state {
            MemberState::Online => {
                m.state = state;
                self.failed_members += 1;
                self.stats.member_failures += 1;
            }
            // Already counted as missing for the redundancy.
            MemberState::Rebuilding => {
                m.state = state;
                self.stats.member_failures += 1;
            }
            MemberState::Failed(_) | MemberState::FailedByOperator => {}
        }
        self.cache.invalidate_all();
        // Nothing is cleared from the write-intent bitmap while a member is missing: its
        // dirty regions are what a returning member must be rebuilt over.
        self.note_degraded();
    }

    /// Tells the write-intent bitmap whether this shard has a member failed or being
    /// recovered ([`WriteIntent::shard_degraded`]): the daemon clears no bit while any
    /// shard has. Called whenever `failed_members` changes.
    pub(super) fn note_degraded(&mut self) {
        let now = self.failed_members > 0;
        if let Some(i) = &mut self.intent {
            i.shared.shard_degraded(now, i.degraded);
            i.degraded = now;
        }
    }

    /// Whether `member` is failed: no I/O is sent to it. A member being rebuilt is not
    /// failed (it is written), though it may be missing for a stripe ([`Self::missing`]).
    pub(super) fn is_failed(&self, member: u16) -> bool {
        self.members[usize::from(member)].state.is_failed()
    }

    /// Whether a write completed on device entry `member` may still sit in a volatile
    /// write cache, so that it is durable only after a flush: the member is in service
    /// and its device reports a volatile cache. The PPL's end of turn and the bitmap's
    /// clearing batches flush exactly these.
    pub(super) fn needs_flush(&self, member: u16) -> bool {
        !self.is_failed(member) && self.members[usize::from(member)].ch.info().volatile_cache
    }

    /// Whether no member can be missing for operation `s` ([`Self::missing`] is false for
    /// every member), known without asking each: none is failed or being rebuilt (both
    /// count in `failed_members`) and the operation met no unrecovered read error. `false`
    /// says only that some member may be missing.
    pub(super) fn none_missing(&self, s: u32) -> bool {
        self.failed_members == 0 && self.sops[s as usize].bad.is_empty()
    }

    /// Whether operation `s` must do without `member`: failed, being rebuilt and not yet
    /// rebuilt at the operation's stripe, or it returned an unrecovered read error to
    /// this operation.
    pub(super) fn missing(&self, s: u32, member: u16) -> bool {
        let m = &self.members[usize::from(member)];
        let sop = &self.sops[s as usize];
        match m.state {
            MemberState::Online => sop.bad.contains(&member),
            MemberState::Rebuilding => sop.stripe >= m.recovery_stripe || sop.bad.contains(&member),
            MemberState::Failed(_) | MemberState::FailedByOperator => true,
        }
    }

    pub(super) fn array_failed(&self) -> bool {
        self.failed_members > self.geo.geometry().parity_chunks()
    }

    /// The live replacement entry of `member`, if it has one.
    pub(super) fn replacement_of(&self, member: u16) -> Option<u16> {
        match self.replace {
            Some(ReplaceInfo {
                member: m,
                state: ReplaceState::Copying,
                ..
            }) if m == member => self.replacement_entry(),
            _ => None,
        }
    }

    /// The replacement entry that must also get `op` when it goes to `member`: writes to
    /// the member being replaced, while the replacement is live.
    pub(super) fn mirror_of(&self, member: u16, op: Op) -> Option<u16> {
        match self.replace {
            Some(ReplaceInfo {
                member: m,
                state: ReplaceState::Copying,
                ..
            }) if m == member && !matches!(op, Op::Read | Op::Flush) => self.replacement_entry(),
            _ => None,
        }
    }

    /// `slot` is a member slot of an array that has not failed.
    ///
    /// # Errors
    /// [`ProcessError::NoSuchMember`], [`ProcessError::ArrayFailed`].
    fn check_live_slot(&self, slot: u16) -> Result<(), ProcessError> {
        let members = self.geo.geometry().members();
        if slot >= members {
            return Err(ProcessError::NoSuchMember {
                member: slot,
                members,
            });
        }
        if self.array_failed() {
            return Err(ProcessError::ArrayFailed);
        }
        Ok(())
    }

    /// Whether [`Self::replace_member`] would accept a device described by `info` into
    /// `slot` now.
    ///
    /// # Errors
    /// As [`Self::replace_member`].
    pub fn check_replace(
        &self,
        slot: u16,
        info: &crate::device::DeviceInfo,
    ) -> Result<(), ProcessError> {
        self.check_live_slot(slot)?;
        let m = &self.members[usize::from(slot)];
        if !m.state.is_failed() {
            return Err(ProcessError::NotFailed { member: slot });
        }
        // A failed member being replaced is still being copied onto its replacement
        // (rebuilt from the others): that device takes the slot when it is done.
        if self.replacement_entry().is_some() && self.replace.is_some_and(|r| r.member == slot) {
            return Err(ProcessError::ReplaceBusy { member: slot });
        }
        if self.entry_busy(slot) {
            return Err(ProcessError::MemberBusy { member: slot });
        }
        device_fits(&self.geo, self.data_offset, slot, info)
    }

    /// Whether device entry `entry` has requests outstanding on this shard: queued,
    /// on the device, or completed with a refusal not yet taken.
    fn entry_busy(&self, entry: u16) -> bool {
        let id = self.id_of(entry);
        self.members[usize::from(entry)].queue.queued() > 0
            || self.sops.iter().any(|s| s.per_member[id] > 0)
            || self.reqs.live().any(|r| usize::from(r.fast_dev) == id)
            || self
                .synthetic
                .iter()
                .any(|c| (c.tag & ((1 << MEMBER_BITS) - 1)) as usize == id)
            || self.intent.as_ref().is_some_and(|i| i.per_member[id] > 0)
            || self.ppl_in_flight_to(id)
    }

    /// Puts a new device's channel into the slot of failed member `slot`; the member is
    /// then [`MemberState::Rebuilding`], in sync nowhere yet, written by foreground writes,
    /// and a rebuild ([`Self::start_process`] with [`ProcessKind::Rebuild`]) recovers it.
    /// Returns the old channel. Every shard must be given a channel to the same device.
    ///
    /// # Errors
    /// [`ProcessError::NoSuchMember`]; [`ProcessError::ArrayFailed`] when the array has
    /// failed (it stays failed: a new device cannot bring it back);
    /// [`ProcessError::NotFailed`] for a member that is online or already being rebuilt;
    /// [`ProcessError::MemberBusy`] while requests to the old device are outstanding (retry
    /// after processing); [`ProcessError::Unfit`] for a device too small or of a larger
    /// block size. Nothing changes on error (the new channel is dropped).
    pub fn replace_member(&mut self, slot: u16, ch: C) -> Result<C, ProcessError> {
        self.check_replace(slot, ch.info())?;
        let i = ch.info();
        let max_transfer = i.max_transfer_bytes / i.block_bytes * i.block_bytes;
        if let Some(p) = &self.ppl {
            // The slot's log goes on at the start of the new device's (zeroed) area.
            p.rewind_log(usize::from(slot));
        }
        let m = &mut self.members[usize::from(slot)];
        let old = std::mem::replace(&mut m.ch, ch);
        m.state = MemberState::Rebuilding;
        if let Some(g) = &self.gate {
            g.note_replaced(slot);
        }
        m.recovery_stripe = 0;
        m.bitmap_recovery = false;
        m.max_transfer = max_transfer;
        self.cache.invalidate_all();
        // A rebuild verifying the parity it left unread gives way to the rebuild this
        // member now needs: it stops (its operations in flight finish first), and what it
        // would have found is left to the next check or repair.
        if let Some(p) = self.proc.as_mut() {
            if p.verifying && p.state == ProcessState::Running {
                p.state = ProcessState::Stopped;
                tracing::info!(
                    shard = self.shard,
                    member = slot,
                    "parity verification stopped: a replaced member needs a rebuild"
                );
            }
        }
        if let Some(i) = &self.intent {
            i.shared.write_all();
        }
        tracing::info!(
            shard = self.shard,
            member = slot,
            "member replaced: rebuilding"
        );
        Ok(old)
    }

    /// [`Self::replace_member`] for a device that **is** the member that left `slot`
    /// (md's re-add): it comes back in sync except where writes missed it, which the
    /// attached write-intent bitmap marks — its rebuild ([`Self::pending_rebuild`]) covers
    /// only the regions set on disk (md's `Bitmap_sync` recovery). The caller has checked
    /// that it may (md's `super_1_validate`: the device's `events` is not below the
    /// bitmap's `events_cleared`, [`WriteIntent::events_cleared`]). Without a bitmap, or
    /// with one forced all-dirty at start, it is rebuilt in full.
    ///
    /// # Errors
    /// As [`Self::replace_member`].
    pub fn readd_member(&mut self, slot: u16, ch: C) -> Result<C, ProcessError> {
        let old = self.replace_member(slot, ch)?;
        self.members[usize::from(slot)].bitmap_recovery = true;
        tracing::info!(
            shard = self.shard,
            member = slot,
            "member re-added: only the bitmap's dirty regions are rebuilt"
        );
        Ok(old)
    }

    /// After a rebuild finished on every shard: its targets that are still
    /// [`MemberState::Rebuilding`] become [`MemberState::Online`] (in sync on every
    /// stripe). Returns them; empty when this shard's rebuild has not finished (or was
    /// completed already). The process's progress keeps listing them as its targets. Calling it before every shard has finished is a caller bug
    /// the shard cannot see: other shards' stripes would be read from the member.
    pub fn complete_rebuild(&mut self) -> ArrayVec<u16, 2> {
        let mut out = ArrayVec::new();
        let Some(p) = self.proc.as_mut() else {
            return out;
        };
        if p.kind != ProcessKind::Rebuild || p.state != ProcessState::Finished {
            return out;
        }
        // The targets stay in the process's progress: what the finished rebuild brought in.
        let targets = p.targets.clone();
        for t in targets {
            if self.set_member_online(t) {
                out.push(t);
            }
        }
        out
    }

    /// The rebuild that members being rebuilt and not yet rebuilt on this shard need:
    /// the whole array from the lowest of their recovery positions (what a replacement, or
    /// an assembly with [`ArrayConfig::rebuilding`], resumes from); `None` if there is none.
    ///
    /// When every such member returned by bitmap ([`Self::readd_member`],
    /// [`ArrayConfig::bitmap_recovery`]) and a bitmap is attached that was not forced
    /// all-dirty, the rebuild covers only the regions set on disk
    /// ([`WriteIntent::on_disk_regions`]; allocates: a control path).
    pub fn pending_rebuild(&self) -> Option<ProcessRequest> {
        let stripes = self.geo.stripes();
        let waiting = || {
            self.members[..self.slots()]
                .iter()
                .filter(|m| m.state == MemberState::Rebuilding && m.recovery_stripe < stripes)
        };
        let resume = waiting().map(|m| m.recovery_stripe).min()?;
        let ranges = match &self.intent {
            Some(i) if !i.shared.forced_all() && waiting().all(|m| m.bitmap_recovery) => {
                Some(i.shared.on_disk_regions())
            }
            _ => None,
        };
        Some(ProcessRequest {
            kind: ProcessKind::Rebuild,
            ranges,
            resume_stripe: resume,
        })
    }

    /// Members being rebuilt that this shard has rebuilt on all its stripes (its rebuild
    /// finished with them as targets): once every shard reports a member here, it may go
    /// online everywhere ([`Self::set_member_online`]).
    pub fn rebuilt_members(&self) -> ArrayVec<u16, 2> {
        let mut out = ArrayVec::new();
        debug_assert_eq!(
            usize::from(self.failed_members),
            self.members[..self.slots()]
                .iter()
                .filter(|m| m.state != MemberState::Online)
                .count(),
            "failed_members counts the members not online"
        );
        // Every member online: none being rebuilt. Asked every reactor turn, so the
        // members' states (a cache line each) are read only while some member is not.
        if self.failed_members == 0 {
            return out;
        }
        let stripes = self.geo.stripes();
        for (m, mem) in self.members[..self.slots()].iter().enumerate() {
            if mem.state == MemberState::Rebuilding && mem.recovery_stripe >= stripes {
                // At most the redundancy (2) members are being rebuilt.
                let _ = out.try_push(m as u16);
            }
        }
        out
    }

    /// Puts member `m` online if it is being rebuilt and this shard has rebuilt it on all
    /// its stripes; returns whether it did. For the executor, once every shard has
    /// reported `m` in [`Self::rebuilt_members`].
    ///
    /// # Panics
    /// If `m` is not a member index.
    pub fn set_member_online(&mut self, m: u16) -> bool {
        let stripes = self.geo.stripes();
        let mem = &mut self.members[usize::from(m)];
        if mem.state != MemberState::Rebuilding || mem.recovery_stripe < stripes {
            return false;
        }
        mem.state = MemberState::Online;
        mem.bitmap_recovery = false;
        self.failed_members -= 1;
        self.cache.invalidate_all();
        self.note_degraded();
        tracing::info!(shard = self.shard, member = m, "member rebuilt: online");
        true
    }

    // ---- replacement (md's `mdadm --replace`) ---------------------------------------------

    /// The entry of the live replacement device, if any.
    pub(super) fn replacement_entry(&self) -> Option<u16> {
        match self.replace {
            Some(ReplaceInfo {
                state: ReplaceState::Copying,
                ..
            }) if self.members.len() > self.slots() => Some(self.slots() as u16),
            _ => None,
        }
    }

    /// Whether [`Self::start_replace`] would accept a device described by `info` as the
    /// replacement of member `slot` now.
    ///
    /// # Errors
    /// As [`Self::start_replace`].
    pub fn check_start_replace(
        &self,
        slot: u16,
        info: &crate::device::DeviceInfo,
    ) -> Result<(), ProcessError> {
        self.check_live_slot(slot)?;
        if let (Some(r), Some(_)) = (self.replace, self.replacement_entry()) {
            return Err(ProcessError::ReplaceBusy { member: r.member });
        }
        if self.members[usize::from(slot)].state != MemberState::Online {
            return Err(ProcessError::NotInService { member: slot });
        }
        // md would give a new device to a missing member first (`raid5_add_disk` fills an
        // empty slot before it takes a replacement): rebuild that one instead.
        if let Some(m) = self.members[..self.slots()]
            .iter()
            .position(|m| m.state != MemberState::Online)
        {
            return Err(ProcessError::Degraded {
                kind: ProcessKind::Replace,
                member: m as u16,
            });
        }
        // The device a previous replacement left behind still has requests in flight.
        if self.members.len() > self.slots() {
            return Err(ProcessError::MemberBusy { member: slot });
        }
        if let Some(p) = &self.proc {
            if p.state == ProcessState::Running || !p.in_flight.is_empty() {
                return Err(ProcessError::Busy { running: p.kind });
            }
        }
        if self.background_ops == 0 {
            return Err(ProcessError::NoSlots);
        }
        device_fits(&self.geo, self.data_offset, slot, info)
    }

    /// Gives member `slot` a replacement device (md's `want_replacement` with a spare as
    /// its replacement) and starts the replace process ([`ProcessKind::Replace`]) from
    /// `resume_stripe` (a checkpoint: the replacement holds the member's data below it).
    /// From now on every write to the member goes to the replacement too; reads stay on
    /// the member. When the process has finished on every shard, the executor calls
    /// [`Self::complete_replace`] on each; if the replacement fails, the replace stops and
    /// the array is as it was ([`ReplaceState::Failed`]). Every shard must be given a
    /// channel to the same device and the same `serial`.
    ///
    /// # Errors
    /// [`ProcessError::NoSuchMember`]; [`ProcessError::ArrayFailed`];
    /// [`ProcessError::ReplaceBusy`] while a replacement is live;
    /// [`ProcessError::NotInService`] for a member failed or being rebuilt;
    /// [`ProcessError::Degraded`] while any member is (md would rebuild it first);
    /// [`ProcessError::MemberBusy`] while the device a previous replace left has requests
    /// in flight (retry); [`ProcessError::Busy`] while another process runs;
    /// [`ProcessError::NoSlots`]; [`ProcessError::Unfit`]; [`ProcessError::BadResume`].
    /// Nothing changes on error.
    pub fn start_replace(
        &mut self,
        slot: u16,
        ch: C,
        serial: u64,
        resume_stripe: u64,
    ) -> Result<(), ProcessError> {
        self.check_start_replace(slot, ch.info())?;
        let req = ProcessRequest {
            kind: ProcessKind::Replace,
            ranges: None,
            resume_stripe,
        };
        req.validate(&self.geo)?;
        let id = self
            .entry_of
            .iter()
            .position(|&e| e == NO_ENTRY)
            .expect("one id is free while no extra device exists");
        let chunk = self.geo.geometry().chunk_bytes() as usize;
        let tag_ops = super::tag_ops(self.sops.len(), self.slots(), self.reqs.len());
        let dev = Member::new(ch, id as u16, &self.cfg, self.sops.len(), tag_ops, chunk);
        let entry = self.slots() as u16;
        // The last process (a previous replace, finished and swapped in, among others) is
        // over (checked above); it must not stand for this one: a finished replace process
        // is how `replace_finished` knows the copy is done.
        let prev_proc = self.proc.take();
        let prev_replace = self.replace;
        self.members.push(dev);
        self.entry_of[id] = entry;
        self.replace = Some(ReplaceInfo {
            member: slot,
            serial,
            state: ReplaceState::Copying,
        });
        if let Err(e) = self.start_process(&req) {
            // Nothing changes on error.
            self.members.pop();
            self.entry_of[id] = NO_ENTRY;
            self.replace = prev_replace;
            self.proc = prev_proc;
            return Err(e);
        }
        debug_assert!(self
            .proc
            .as_ref()
            .is_some_and(|p| p.kind == ProcessKind::Replace && p.state == ProcessState::Running));
        self.replace_bitmap_ticket = self.intent.as_ref().map_or(0, |i| i.shared.write_all());
        tracing::info!(
            shard = self.shard,
            member = slot,
            resume = resume_stripe,
            "replace started: writes to the member go to its replacement too"
        );
        Ok(())
    }

    /// The live replacement failed with `e`: it gets no more I/O, the replace process
    /// stops ([`ProcessError::ReplacementFailed`]) and the member keeps its slot.
    pub(super) fn fail_replacement_entry(&mut self, e: IoError) {
        let Some(entry) = self.replacement_entry() else {
            return;
        };
        self.members[usize::from(entry)].state = MemberState::Failed(e);
        let r = self.replace.as_mut().expect("a live replacement");
        r.state = ReplaceState::Failed(e);
        let member = r.member;
        self.replacement_failures += 1;
        if let Some(p) = self.proc.as_mut() {
            if p.kind == ProcessKind::Replace
                && matches!(p.state, ProcessState::Running | ProcessState::Stopped)
            {
                p.state = ProcessState::Failed(ProcessError::ReplacementFailed { member });
            }
        }
        tracing::warn!(
            shard = self.shard,
            member,
            error = %e,
            "replacement device failed: replace stopped, the member keeps its slot"
        );
    }

    /// Fails the live replacement numbered `serial` (a failure another shard saw, or the
    /// operator's); returns whether it was live here. A replacement this shard has already
    /// swapped in ([`Self::complete_replace`]) holds the member's slot: the member fails
    /// (with `e`), as it does on the shards that had not swapped yet when it failed, so
    /// that the slot is failed on every shard rather than served by the new device on some
    /// and by the old one, which misses their writes, on others.
    pub fn fail_replacement(&mut self, serial: u64, e: IoError) -> bool {
        if let Some(r) = self
            .replace
            .filter(|r| r.serial == serial && r.state == ReplaceState::Done)
        {
            if self.members[usize::from(r.member)].state.is_failed() {
                return false;
            }
            tracing::warn!(
                shard = self.shard,
                member = r.member,
                error = %e,
                "the replacement failed after this shard swapped it in: the member fails"
            );
            self.fail_member(r.member, e);
            return true;
        }
        if self.replacement_entry().is_none() || self.replace.is_none_or(|r| r.serial != serial) {
            return false;
        }
        self.fail_replacement_entry(e);
        true
    }

    /// Whether this shard's part of replacement `serial` is done: its replace process
    /// finished and the bitmap area was written to the replacement in full. Once every
    /// shard says so, the executor calls [`Self::complete_replace`] on each.
    pub fn replace_finished(&self, serial: u64) -> bool {
        self.replacement_entry().is_some()
            && self.replace.is_some_and(|r| r.serial == serial)
            && self.proc.as_ref().is_some_and(|p| {
                p.kind == ProcessKind::Replace && p.state == ProcessState::Finished
            })
            && self
                .intent
                .as_ref()
                .is_none_or(|i| i.shared.all_written() >= self.replace_bitmap_ticket)
    }

    /// After replacement `serial` finished on every shard ([`Self::replace_finished`]):
    /// the replacement takes its member's slot and the old device leaves the array (md's
    /// `raid5_spare_active` + `raid5_remove_disk`: the replaced device is marked faulty
    /// so that it is never re-added). Requests in flight to either device complete
    /// normally. A member that had failed during the replace is whole again. Returns
    /// whether it swapped.
    ///
    /// The executor asks only once every shard had finished, so a replacement that failed
    /// here since then failed after its copy — on another shard it may already hold the
    /// slot, and the caller may have recorded it there: the slot takes the failure (the
    /// member fails with the replacement's error, [`ReplaceState::Done`]), so that it is
    /// failed on every shard alike (see [`Self::fail_replacement`]); returns `true` then
    /// too.
    pub fn complete_replace(&mut self, serial: u64) -> bool {
        if let Some(r) = self.replace.filter(|r| r.serial == serial) {
            if let ReplaceState::Failed(e) = r.state {
                tracing::warn!(
                    shard = self.shard,
                    member = r.member,
                    error = %e,
                    "the replacement failed after every shard copied it: the member fails"
                );
                if !self.members[usize::from(r.member)].state.is_failed() {
                    self.fail_member(r.member, e);
                }
                self.replace = Some(ReplaceInfo {
                    state: ReplaceState::Done,
                    ..r
                });
                return true;
            }
        }
        if !self.replace_finished(serial) {
            return false;
        }
        let r = self.replace.expect("checked");
        let (slot, extra) = (usize::from(r.member), self.slots());
        self.cache.invalidate_all();
        if let Some(p) = &self.ppl {
            // The slot's log goes on at the start of the replacement's (zeroed) area.
            p.rewind_log(slot);
        }
        self.members.swap(slot, extra);
        let (a, b) = (self.members[slot].id, self.members[extra].id);
        self.entry_of[usize::from(a)] = slot as u16;
        self.entry_of[usize::from(b)] = extra as u16;
        let old = std::mem::replace(
            &mut self.members[extra].state,
            MemberState::Failed(IoError::Gone),
        );
        if old.is_failed() {
            self.failed_members -= 1;
            self.note_degraded();
        }
        self.replace = Some(ReplaceInfo {
            state: ReplaceState::Done,
            ..r
        });
        tracing::info!(
            shard = self.shard,
            member = r.member,
            "replace complete: the replacement holds the member's slot"
        );
        true
    }

    /// Drops the device a replacement left behind (a failed replacement, or the replaced
    /// member) once none of its requests is in flight; returns whether it did.
    pub(super) fn drop_leaving_device(&mut self) -> bool {
        let extra = self.slots();
        if self.members.len() <= extra
            || self.replacement_entry().is_some()
            || self.entry_busy(extra as u16)
        {
            return false;
        }
        let dev = self.members.pop().expect("an extra device");
        self.entry_of[usize::from(dev.id)] = NO_ENTRY;
        true
    }
}
