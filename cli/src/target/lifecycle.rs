//! Member lifecycle and background processes of a running target.
//!
//! - **Adding a device** (`member_add`, md's `mdadm --add`): the device gets a superblock
//!   of its own for a free slot (`dev_number`, the first unused from `raid_disks` on, as md's
//!   `bind_rdev_to_array` picks one); if a role is failed, it takes the lowest such role
//!   with `MD_FEATURE_RECOVERY_OFFSET` and `recovery_offset` 0 on every member's
//!   superblock, and the reactors rebuild onto it; otherwise it stands by as a spare
//!   (`dev_roles` = `0xffff`) and replaces the next member that fails (hot spare).
//! - **Rebuild progress** is written to the superblocks every [`CHECKPOINT_INTERVAL`] and at
//!   stop (`recovery_offset`, 512-byte sectors from the data offset, as md's
//!   `super_1_sync`); when the rebuild completes on every reactor the member is written in
//!   sync (feature bit cleared).
//! - **Resync** runs by itself when the array was not shut down cleanly (and is not
//!   degraded: a rebuild runs first, as md's `md_check_recovery` orders them), resuming at
//!   the `resync_offset` a clean stop wrote; a clean stop during a resync writes its
//!   position there. While the array is served its superblocks say "dirty" (md writes
//!   `resync_offset` 0 while it is not in sync), so a crash resyncs from the start.
//! - **Check / repair** run on request (`process_start`); md keeps no checkpoint for them
//!   and neither does ferroraid: a stopped or interrupted check starts again from 0.

use engine::process::{ProcessKind as EngineKind, ProcessRequest, ProcessState};
use engine::reactor::ArraySnapshot;

use super::*;
use crate::status::MemberState as ReportState;

/// How often rebuild progress is written to the superblocks: a crash redoes at most this
/// much of a rebuild.
pub(super) const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(5);

/// How long to let every reactor take a command and publish its new state.
const PUBLISH_SETTLE: Duration = Duration::from_millis(250);

/// How long a stop waits for the background operations in flight to finish.
const PROCESS_STOP_WAIT: Duration = Duration::from_secs(10);

/// The engine's process kind for a report kind (`None` for idle).
fn engine_kind(kind: ProcessKind) -> Option<EngineKind> {
    match kind {
        ProcessKind::Idle => None,
        ProcessKind::Resync => Some(EngineKind::Resync),
        ProcessKind::Rebuild => Some(EngineKind::Rebuild),
        ProcessKind::Check => Some(EngineKind::Check),
        ProcessKind::Repair => Some(EngineKind::Repair),
    }
}

/// The report kind of an engine process kind.
fn report_kind(kind: EngineKind) -> ProcessKind {
    match kind {
        EngineKind::Resync => ProcessKind::Resync,
        EngineKind::Rebuild => ProcessKind::Rebuild,
        EngineKind::Check => ProcessKind::Check,
        EngineKind::Repair => ProcessKind::Repair,
    }
}

/// What the monitor remembers about background processes between turns.
#[derive(Debug, Default)]
pub(super) struct ProcessBook {
    /// The (kind, state) last seen, to log transitions once.
    last: Option<(EngineKind, ProcessState)>,
    /// The operator stopped a resync: do not restart it by itself.
    resync_held: bool,
    /// Roles that were being rebuilt and whose completion is still to be written.
    rebuilding: Vec<u16>,
    /// Roles handed a new device that the reactors have not swapped in yet: the failed
    /// state they still publish is the old device's, not the new one's.
    pub(super) swapping: Vec<u16>,
}

impl ProcessBook {
    /// The book of a target whose `roles` were assembled partly rebuilt.
    pub(super) fn resuming(roles: Vec<u16>) -> Self {
        ProcessBook {
            rebuilding: roles,
            ..ProcessBook::default()
        }
    }
}

impl Shared {
    /// Devices standing by as spares.
    pub(super) fn spare_paths(&self) -> Vec<PathBuf> {
        self.meta()
            .members
            .iter()
            .filter(|m| m.active && m.role.is_none())
            .map(|m| m.path.clone())
            .collect()
    }

    pub(super) fn meta(&self) -> std::sync::MutexGuard<'_, Meta> {
        self.meta
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The background process as `status` shows it: the running one, or `idle` with the
    /// last check's or repair's `mismatch_cnt`.
    pub(super) fn process_report(&self) -> ProcessReport {
        let Some(p) = self.handle.process_snapshot() else {
            return ProcessReport::idle();
        };
        let g = self.geo.geometry();
        let stripe_bytes = g.stripe_data_bytes();
        let capacity = self.geo.capacity_bytes();
        let mismatch_cnt = if matches!(p.kind, EngineKind::Check | EngineKind::Repair) {
            p.mismatch_cnt
        } else {
            0
        };
        if p.state != ProcessState::Running {
            return ProcessReport {
                mismatch_cnt,
                ..ProcessReport::idle()
            };
        }
        // The engine's rate is per member; the array moves data_chunks times as much.
        let rate = p.rate_bytes_per_s.unwrap_or(0.0) * f64::from(g.data_chunks());
        ProcessReport {
            kind: report_kind(p.kind),
            position_bytes: p.done_stripes.saturating_mul(stripe_bytes).min(capacity),
            size_bytes: p.total_stripes.saturating_mul(stripe_bytes).min(capacity),
            rate_bytes_per_s: rate as u64,
            eta_s: p.eta_s.map(|e| e.ceil() as u64),
            mismatch_cnt,
        }
    }

    /// `process_start`: check, repair or resync over the whole array (a resync the
    /// array still owes resumes at its checkpoint).
    pub(super) fn process_start(&self, kind: ProcessKind) -> Result<ProcessReport, RpcError> {
        let Some(k) = engine_kind(kind).filter(|k| *k != EngineKind::Rebuild) else {
            return Err(RpcError::invalid_params(format!(
                "{kind} cannot be started: one of check, repair, resync"
            )));
        };
        if let Some(p) = self.handle.process_snapshot() {
            if p.state == ProcessState::Running {
                return Err(RpcError::process_refused(format!(
                    "a {} is running ({} of {} stripes done); stop it first",
                    p.kind, p.done_stripes, p.total_stripes
                )));
            }
        }
        let req = if k == EngineKind::Resync {
            let mut meta = self.meta();
            meta.book.resync_held = false;
            // Asked for by the operator: the whole array, whatever the bitmap says.
            ProcessRequest {
                ranges: None,
                ..self.resync_request(&meta)
            }
        } else {
            ProcessRequest::whole(k)
        };
        self.handle
            .start_process(req)
            .map_err(RpcError::process_refused)?;
        info!(process = %k, "background process started on request");
        // Every reactor takes the command and publishes at once: give them a moment, so
        // the report is the new process and not the last one.
        std::thread::sleep(PUBLISH_SETTLE);
        Ok(self.process_report())
    }

    /// `process_stop`: stops the running process (a resync is then not restarted by
    /// itself until asked for).
    pub(super) fn process_stop(&self) -> ProcessReport {
        if let Some(p) = self.handle.process_snapshot() {
            if p.state == ProcessState::Running {
                if p.kind == EngineKind::Resync {
                    self.meta().book.resync_held = true;
                }
                self.handle.stop_process();
                info!(process = %p.kind, "background process stopped on request");
                self.wait_process_idle(PROCESS_STOP_WAIT);
            }
        }
        self.process_report()
    }

    /// Waits (up to `limit`) until no process runs; returns its last snapshot.
    pub(super) fn wait_process_idle(
        &self,
        limit: Duration,
    ) -> Option<engine::process::ProcessSnapshot> {
        let deadline = std::time::Instant::now() + limit;
        std::thread::sleep(PUBLISH_SETTLE);
        loop {
            let p = self.handle.process_snapshot();
            match &p {
                Some(s) if s.state == ProcessState::Running => {}
                _ => return p,
            }
            if std::time::Instant::now() > deadline {
                warn!("background process still draining after {limit:?}");
                return p;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The resync the array owes: the write-intent bitmap's dirty regions when it has one
    /// (md's bitmap-driven resync), from the checkpoint a clean stop wrote.
    fn resync_request(&self, meta: &Meta) -> ProcessRequest {
        let g = self.geo.geometry();
        let offset = self.assembly.resync_offset;
        let resume = if offset == MAX_SECTOR {
            0
        } else {
            (offset.saturating_mul(512) / u64::from(g.chunk_bytes())).min(self.geo.stripes())
        };
        let ranges = match &meta.bitmap {
            BitmapSync::Online(i) => Some(i.dirty_regions()),
            _ => None,
        };
        ProcessRequest {
            kind: EngineKind::Resync,
            ranges,
            resume_stripe: resume,
        }
    }

    /// `member_add`: a replacement for the lowest failed role, or a spare.
    pub(super) fn add_device(&self, path: &str) -> Result<MemberReport, RpcError> {
        let p = PathBuf::from(path);
        // vfio controllers (`vfio:BDF`) are not paths: they compare as given.
        let canon = std::fs::canonicalize(&p).unwrap_or_else(|_| p.clone());
        let same = |q: &Path| std::fs::canonicalize(q).ok().as_deref() == Some(canon.as_path());
        {
            let meta = self.meta();
            if meta.members.iter().any(|m| m.active && same(&m.path))
                || self.paths().iter().flatten().any(|q| same(q))
            {
                return Err(RpcError::device_in_use(path));
            }
        }
        let lock = claim(&p).map_err(|e| RpcError::device_unusable(path, format!("{e:#}")))?;
        let dev = drivers::any::open_member(&p, &self.member_cfg)
            .map_err(|e| RpcError::device_unusable(path, e))?;
        let info = dev.info().clone();
        engine::array::device_fits(&self.geo, self.data_offset_bytes, 0, &info).map_err(|e| {
            let why = match e {
                engine::process::ProcessError::Unfit { why, .. } => why.to_string(),
                other => other.to_string(),
            };
            RpcError::device_unusable(
                path,
                format!(
                    "{why} ({} bytes, block {} bytes; the array needs {} bytes per member)",
                    info.capacity_bytes,
                    info.block_bytes,
                    self.data_offset_bytes + self.geo.member_data_bytes()
                ),
            )
        })?;
        if let Ok(sb) = metadata_io::read_superblock(&p) {
            if sb.set_uuid != self.assembly.uuid {
                return Err(RpcError::device_unusable(
                    path,
                    format!(
                        "it holds a superblock of another array ({} {}); wipe it first \
                         (wipefs -a) if its data is no longer needed",
                        sb.short_name(),
                        sb.set_uuid
                    ),
                ));
            }
        }
        let mut meta = self.meta();
        let newest = meta
            .members
            .iter()
            .filter(|m| m.active)
            .max_by_key(|m| m.sb.events)
            .map(|m| m.sb.clone())
            .ok_or_else(|| RpcError::internal("no member left to take the array state from"))?;
        let raid_disks = newest.raid_disks;
        let slot = (raid_disks..)
            .find(|n| meta.members.iter().all(|m| m.sb.dev_number != *n))
            .ok_or_else(|| RpcError::internal("no free slot"))?;
        let data_size = (info.capacity_bytes - self.data_offset_bytes) / 512;
        let sb = engine::metadata::joining_member(
            &newest,
            slot,
            engine::metadata::Uuid::random(&mut rand::thread_rng()),
            data_size,
        );
        metadata_io::write_superblock(&p, &sb)
            .map_err(|e| RpcError::device_unusable(path, format!("writing its superblock: {e}")))?;
        meta.members.push(MemberMeta {
            role: None,
            path: p.clone(),
            sb,
            active: true,
            spare: Some(Arc::new(dev)),
        });
        let idx = meta.members.len() - 1;
        self.locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((canon.clone(), lock));
        let snap = self.handle.snapshot();
        match self.failed_role_to_replace(&meta, &snap) {
            Some(role) => {
                self.promote(&mut meta, idx, role)
                    .map_err(|e| RpcError::internal(format!("{e:#}")))?;
                drop(meta);
                // Every reactor swaps the device in within a loop turn (once the old one
                // has nothing outstanding): report what they publish.
                let deadline = std::time::Instant::now() + Duration::from_secs(2);
                loop {
                    let snap = self.handle.snapshot();
                    if !snap.members[usize::from(role)].state.is_failed()
                        || std::time::Instant::now() > deadline
                    {
                        return Ok(self.member_report(&snap, role));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            None => {
                meta.record_with(
                    &[],
                    None,
                    RoleChanges {
                        roles: vec![(slot, engine::metadata::DEV_ROLE_SPARE)],
                        recovery: Vec::new(),
                    },
                )
                .map_err(|e| RpcError::internal(format!("{e:#}")))?;
                info!(device = %p.display(), slot, "device added as a spare");
                Ok(MemberReport::idle(
                    None,
                    Some(path.to_string()),
                    ReportState::Spare,
                ))
            }
        }
    }

    /// `member_remove` of a spare: `Some(report)` when `sel` names one (it is taken out
    /// and its slot recorded unused), `None` when it names no spare.
    pub(super) fn remove_spare(&self, sel: &str) -> Result<Option<MemberReport>, RpcError> {
        let want = Path::new(sel);
        let canon = std::fs::canonicalize(want).ok();
        let mut meta = self.meta();
        let Some(i) = meta.members.iter().position(|m| {
            m.active
                && m.role.is_none()
                && (m.path == want
                    || canon.is_some() && std::fs::canonicalize(&m.path).ok() == canon)
        }) else {
            return Ok(None);
        };
        let slot = meta.members[i].sb.dev_number;
        let path = meta.members[i].path.clone();
        meta.members[i].active = false;
        meta.members[i].spare = None;
        // md writes the slot of a device no longer in the array as faulty (super_1_sync).
        meta.record_with(
            &[],
            None,
            RoleChanges {
                roles: vec![(slot, engine::metadata::DEV_ROLE_FAULTY)],
                recovery: Vec::new(),
            },
        )
        .map_err(|e| RpcError::internal(format!("{e:#}")))?;
        self.release_lock(&path);
        info!(device = %path.display(), "spare removed");
        Ok(Some(MemberReport::idle(
            None,
            Some(path.display().to_string()),
            ReportState::Removed,
        )))
    }

    /// Releases the `flock` of a device leaving the array.
    pub(super) fn release_lock(&self, path: &Path) {
        let canon = std::fs::canonicalize(path).ok();
        let mut locks = self
            .locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        locks.retain(|(p, _)| !(p == path || canon.is_some() && canon.as_deref() == Some(p)));
    }

    /// The lowest failed role no device is rebuilding yet, if the array can still be
    /// rebuilt (a failed array stays failed).
    fn failed_role_to_replace(&self, meta: &Meta, snap: &ArraySnapshot) -> Option<u16> {
        let g = self.geo.geometry();
        let lost = snap.members.iter().filter(|m| m.state.is_failed()).count()
            + snap
                .members
                .iter()
                .filter(|m| m.state == MemberState::Rebuilding)
                .count();
        if lost > usize::from(g.parity_chunks()) {
            return None;
        }
        (0..g.members()).find(|&r| {
            snap.members[usize::from(r)].state.is_failed()
                && !meta
                    .members
                    .iter()
                    .any(|m| m.active && m.role == Some(r) && m.sb.recovering().is_some())
        })
    }

    /// Puts spare `idx` of `meta` into failed `role`: its role and `recovery_offset` 0 on
    /// every superblock first, then the reactors swap it in and rebuild it. If the reactors
    /// refuse, it is written back as a spare.
    fn promote(&self, meta: &mut Meta, idx: usize, role: u16) -> Result<()> {
        let slot = meta.members[idx].sb.dev_number;
        let dev = meta.members[idx]
            .spare
            .take()
            .context("a spare has its device open")?;
        let path = meta.members[idx].path.clone();
        meta.members[idx].role = Some(role);
        meta.record_with(
            &[],
            None,
            RoleChanges {
                roles: vec![(slot, role)],
                recovery: vec![(slot, Some(0))],
            },
        )?;
        if let Err(e) = self.handle.replace_member(role, dev.clone()) {
            warn!(device = %path.display(), role, "cannot rebuild onto the device: {e}");
            meta.members[idx].role = None;
            meta.members[idx].spare = Some(dev);
            meta.record_with(
                &[],
                None,
                RoleChanges {
                    roles: vec![(slot, engine::metadata::DEV_ROLE_SPARE)],
                    recovery: vec![(slot, None)],
                },
            )?;
            bail!("the reactors refused the device for role {role}: {e}");
        }
        let old = {
            let mut paths = self
                .paths
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            paths[usize::from(role)].replace(path.clone())
        };
        if let Some(old) = old {
            // The failed device is out of the array for good: let it go.
            self.release_lock(&old);
        }
        self.removed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .retain(|r| *r != role);
        meta.recorded_failed.retain(|r| *r != role);
        meta.book.rebuilding.push(role);
        meta.book.swapping.push(role);
        *self
            .last_checkpoint
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = std::time::Instant::now();
        info!(device = %path.display(), role, slot, "rebuilding onto the device");
        Ok(())
    }

    /// One monitor turn for processes: hot spares into failed roles, rebuild checkpoints
    /// and completion, a pending resync started when the array is healthy, transitions
    /// logged.
    pub(super) fn tend_processes(&self, meta: &mut Meta, snap: &ArraySnapshot) {
        meta.book
            .swapping
            .retain(|&r| snap.members[usize::from(r)].state.is_failed());
        // Hot spares.
        while let Some(role) = self.failed_role_to_replace(meta, snap) {
            let Some(idx) = meta
                .members
                .iter()
                .position(|m| m.active && m.role.is_none() && m.spare.is_some())
            else {
                break;
            };
            if let Err(e) = self.promote(meta, idx, role) {
                warn!("hot spare: {e:#}");
                break;
            }
        }
        let p = self.handle.process_snapshot();
        // Rebuild completion and checkpoints.
        let due = self
            .last_checkpoint
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .elapsed()
            >= CHECKPOINT_INTERVAL;
        let (changes, done_roles) = Self::rebuild_changes(meta, snap, p.as_ref(), due);
        meta.book.rebuilding.retain(|r| !done_roles.contains(r));
        if !changes.recovery.is_empty() {
            if due {
                *self
                    .last_checkpoint
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = std::time::Instant::now();
            }
            if let Err(e) = meta.record_with(&[], None, changes) {
                warn!("recording rebuild progress: {e:#}");
            }
        }
        // Transitions.
        if let Some(p) = &p {
            let now = (p.kind, p.state);
            if meta.book.last != Some(now) {
                meta.book.last = Some(now);
                match p.state {
                    ProcessState::Running => {
                        info!(process = %p.kind, stripes = p.total_stripes, "background process running")
                    }
                    ProcessState::Finished => {
                        if p.kind == EngineKind::Resync {
                            self.resync_pending.store(false, Ordering::Release);
                            // Every region it covered is consistent: the bitmap daemon may
                            // clear them.
                            if let BitmapSync::Online(i) = &meta.bitmap {
                                i.sync_done(0..self.geo.stripes());
                            }
                        }
                        info!(process = %p.kind, mismatch_cnt = p.mismatch_cnt, "background process finished")
                    }
                    ProcessState::Stopped => {
                        info!(process = %p.kind, position_sectors = p.position_sectors, "background process stopped")
                    }
                    ProcessState::Failed(e) => {
                        warn!(process = %p.kind, position_sectors = p.position_sectors, "background process ended early: {e}")
                    }
                }
            }
        }
        // A resync the array owes, once nothing else runs and it is whole.
        let idle = p.as_ref().is_none_or(|p| p.state != ProcessState::Running);
        let whole = snap.members.iter().all(|m| m.state == MemberState::Online);
        if idle && whole && self.resync_pending.load(Ordering::Acquire) && !meta.book.resync_held {
            let req = self.resync_request(meta);
            if req.ranges.as_ref().is_some_and(Vec::is_empty) {
                // The bitmap says nothing was being written: nothing to resync.
                self.resync_pending.store(false, Ordering::Release);
                info!("no resync needed: the write-intent bitmap has no dirty region");
            } else {
                let regions = req.ranges.as_ref().map(Vec::len);
                match self.handle.start_process(req) {
                    Ok(()) => {
                        meta.book.last = None;
                        info!(
                            bitmap_ranges = ?regions,
                            "resync started: the array was not shut down cleanly"
                        );
                    }
                    Err(e) => warn!("starting the resync: {e}"),
                }
            }
        }
    }

    /// At stop: ends the running process and writes where it got to — `recovery_offset`
    /// of members being rebuilt, and the resync position as `resync_offset` (returned:
    /// `None` when no resync is owed any more).
    pub(super) fn checkpoint_at_stop(&self) -> Option<u64> {
        // The monitor must not start an owed resync again behind our back.
        self.meta().book.resync_held = true;
        self.handle.stop_process();
        let p = self.wait_process_idle(PROCESS_STOP_WAIT);
        let mut meta = self.meta();
        let snap = self.handle.snapshot();
        let (changes, done) = Self::rebuild_changes(&meta, &snap, p.as_ref(), true);
        meta.book.rebuilding.retain(|r| !done.contains(r));
        if !changes.recovery.is_empty() {
            if let Err(e) = meta.record_with(&[], None, changes) {
                warn!("recording rebuild progress at stop: {e:#}");
            }
        }
        if !self.resync_pending.load(Ordering::Acquire) {
            return None;
        }
        let owed_from = if self.assembly.resync_offset == MAX_SECTOR {
            0
        } else {
            self.assembly.resync_offset
        };
        let at = p
            .filter(|p| p.kind == EngineKind::Resync)
            .map_or(owed_from, |p| p.position_sectors);
        Some(at)
    }

    /// The superblock changes for the members being rebuilt: in sync once the reactors
    /// put them online (those roles are returned), else — with `checkpoint` — the
    /// rebuild's position as their `recovery_offset`.
    fn rebuild_changes(
        meta: &Meta,
        snap: &ArraySnapshot,
        p: Option<&engine::process::ProcessSnapshot>,
        checkpoint: bool,
    ) -> (RoleChanges, Vec<u16>) {
        let mut changes = RoleChanges::default();
        let mut done = Vec::new();
        for &role in &meta.book.rebuilding {
            let Some(m) = meta
                .members
                .iter()
                .find(|m| m.active && m.role == Some(role))
            else {
                continue;
            };
            match snap.members[usize::from(role)].state {
                MemberState::Online => {
                    changes.recovery.push((m.sb.dev_number, None));
                    done.push(role);
                    info!(role, device = %m.path.display(), "rebuild complete: member in sync");
                }
                MemberState::Rebuilding if checkpoint => {
                    if let Some(p) = p.filter(|p| {
                        p.kind == EngineKind::Rebuild
                            && p.targets.contains(&role)
                            && m.sb.recovering() != Some(p.position_sectors)
                    }) {
                        changes
                            .recovery
                            .push((m.sb.dev_number, Some(p.position_sectors)));
                    }
                }
                _ => {}
            }
        }
        (changes, done)
    }
}
