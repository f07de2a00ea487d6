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
//! - **Replace** (`member_replace`, md's `mdadm --replace OLD --with NEW`): NEW gets a
//!   superblock of its own in a free slot with OLD's role, `MD_FEATURE_REPLACEMENT` and
//!   `recovery_offset` 0 (so every superblock's `dev_roles` gives the role twice: mdadm
//!   shows `R`); the reactors write every write of OLD to NEW too and copy OLD onto it,
//!   rebuilding what OLD cannot read; progress is checkpointed as NEW's
//!   `recovery_offset` every [`CHECKPOINT_INTERVAL`] and at stop, and a restart resumes
//!   it. When it is done, NEW takes the role (flag and offset cleared) and OLD's slot is
//!   recorded faulty — md's `raid5_spare_active` marks the replaced device Faulty "so that
//!   it is never re-added" — and OLD's own superblock is written once more with that
//!   generation, so OLD itself says it is out: md leaves it as it was (it writes no faulty
//!   device), which keeps it claiming the role one generation behind, within md's
//!   assembly margin, for kernels and mdadm versions that trust a device's own role.
//!   If OLD fails meanwhile the replace goes on as a rebuild from the others; if NEW
//!   fails, its slot is recorded faulty and the array is as it was.
//! - **Re-add** (`member_add` of a device that left its role, md's `--re-add`): when its
//!   superblock still gives it a role no device serves, its `events` are not below the
//!   bitmap's `events_cleared` and the bitmap is current (`readd_recovery`), it rejoins
//!   that role with `MD_FEATURE_RECOVERY_BITMAP` and is rebuilt only over the regions the
//!   bitmap has set; otherwise it is added as a new device (full rebuild or spare).

use engine::process::{ProcessKind as EngineKind, ProcessRequest, ProcessState};
use engine::reactor::ArraySnapshot;

use super::*;
use crate::status::{BitmapReport, MemberState as ReportState, ProcessRunState};
use engine::array::ReplaceState;
use engine::metadata::{Feature, DEV_ROLE_FAULTY, DEV_ROLE_SPARE};

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
        ProcessKind::Replace => Some(EngineKind::Replace),
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
        EngineKind::Replace => ProcessKind::Replace,
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
    /// The replace in progress, if any.
    pub(super) replacing: Option<ReplaceBook>,
}

/// A device the operator gave, opened and checked ([`Shared::open_new`]).
struct NewDevice {
    path: PathBuf,
    canon: PathBuf,
    lock: Option<super::Claim>,
    dev: AnyDevice,
    info: engine::device::DeviceInfo,
    /// Its superblock, if it has one of this array.
    own_sb: Option<Superblock>,
}

/// A replace in progress ([`Shared::replace`]).
#[derive(Clone, Debug)]
pub(super) struct ReplaceBook {
    /// The role (slot) being replaced.
    pub(super) role: u16,
    /// The reactors' serial for it.
    pub(super) serial: u64,
    /// The replacement device's `dev_number` and path.
    pub(super) dev_number: u32,
    pub(super) path: PathBuf,
    /// `recovery_offset` last written for it, sectors.
    pub(super) checkpoint: u64,
    /// The reactors' last refusal when it started: a different one about this replace
    /// later means a reactor could not take it.
    pub(super) error_at_start: Option<engine::reactor::ControlError>,
    /// The superblocks already record the swap (the replacement in the role, the old
    /// member's slot faulty) and the reactors were asked to make it: the old member's index
    /// in `Meta::members` (`None`: no old member, it had failed), or `None` outside.
    pub(super) swap_recorded: Option<Option<usize>>,
}

impl ReplaceBook {
    /// The state of this replacement in `snap`, merged over the reactors; `None` when they
    /// report another replacement or none.
    pub(super) fn state_in(&self, snap: &ArraySnapshot) -> Option<ReplaceState> {
        snap.replacement
            .as_ref()
            .filter(|r| r.info.serial == self.serial)
            .map(|r| r.info.state)
    }
}

/// Whether a reactor's refusal `e` is about a replace of `role` (it could not open the
/// device, or its shard refused the start).
fn concerns_replace(e: &engine::reactor::ControlError, role: u16) -> bool {
    use engine::process::ProcessError as P;
    use engine::reactor::ControlError as C;
    match e {
        C::Open { member, .. } | C::DeviceType { member } => *member == role,
        C::Process(p) => {
            matches!(
                p,
                P::ReplaceBusy { .. }
                    | P::NotInService { .. }
                    | P::Degraded {
                        kind: EngineKind::Replace,
                        ..
                    }
                    | P::Busy { .. }
                    | P::NoSlots
                    | P::BadResume { .. }
            ) || matches!(p, P::Unfit { member, .. } if *member == role)
        }
        // Answered to the caller of `complete_replace`, never published by a reactor.
        C::NoSuchMember { .. } | C::NotCopied { .. } => false,
    }
}

impl ProcessBook {
    /// Whether a replace of `role` has its swap recorded in the superblocks
    /// ([`ReplaceBook::swap_recorded`]): the role's old member is out already.
    pub(super) fn swap_recorded_for(&self, role: u16) -> bool {
        self.recorded_swap(role).is_some()
    }

    /// The replace of `role` whose swap the superblocks record
    /// ([`Self::swap_recorded_for`]), if any.
    pub(super) fn recorded_swap(&self, role: u16) -> Option<&ReplaceBook> {
        self.replacing
            .as_ref()
            .filter(|b| b.role == role && b.swap_recorded.is_some())
    }

    /// Whether the replace in progress has a replacement the reactors failed whose failure
    /// the superblocks do not hold yet ([`Shared::abandon_replace`] records it): a
    /// restart would resume the replace onto it, taking the stripes below its checkpoint
    /// as copied though they missed the writes since. Not after the swap is recorded (a
    /// replacement failing then fails its slot, an unrecorded role until recorded).
    pub(super) fn replacement_failure_unrecorded(&self, snap: &ArraySnapshot) -> bool {
        self.replacing.as_ref().is_some_and(|b| {
            b.swap_recorded.is_none() && matches!(b.state_in(snap), Some(ReplaceState::Failed(_)))
        })
    }

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
        // A replace whose old member failed goes on rebuilding from the others.
        let kind = match p.kind {
            EngineKind::Replace
                if p.targets.first().is_some_and(|&t| {
                    self.handle.snapshot().members[usize::from(t)]
                        .state
                        .is_failed()
                }) =>
            {
                ProcessKind::Rebuild
            }
            k => report_kind(k),
        };
        let position_bytes = p.done_stripes.saturating_mul(stripe_bytes).min(capacity);
        let size_bytes = p.total_stripes.saturating_mul(stripe_bytes).min(capacity);
        match p.state {
            ProcessState::Running => {}
            ProcessState::Failed(e) => {
                return ProcessReport {
                    kind,
                    state: ProcessRunState::Failed,
                    position_bytes,
                    size_bytes,
                    mismatch_cnt,
                    error: Some(e.to_string()),
                    ..ProcessReport::idle()
                }
            }
            ProcessState::Finished | ProcessState::Stopped => {
                return ProcessReport {
                    mismatch_cnt,
                    ..ProcessReport::idle()
                }
            }
        }
        // The engine's rate is per member; the array moves data_chunks times as much.
        let rate = p.rate_bytes_per_s.unwrap_or(0.0) * f64::from(g.data_chunks());
        ProcessReport {
            kind,
            state: ProcessRunState::Running,
            position_bytes,
            size_bytes,
            rate_bytes_per_s: rate as u64,
            eta_s: p.eta_s.map(|e| e.ceil() as u64),
            mismatch_cnt,
            error: None,
            verify_position_bytes: p
                .verify_done_stripes
                .saturating_mul(stripe_bytes)
                .min(capacity),
            verify_size_bytes: p
                .verify_total_stripes
                .saturating_mul(stripe_bytes)
                .min(capacity),
        }
    }

    /// The write-intent bitmap as `status` shows it (`None` without one).
    pub(super) fn bitmap_report(&self) -> Option<BitmapReport> {
        let meta = self.meta();
        let BitmapSync::Online(i) = &meta.bitmap else {
            return None;
        };
        Some(BitmapReport {
            chunk_bytes: i.chunk_bytes(),
            regions: i.regions(),
            dirty_regions: i.dirty_on_disk(),
            events_cleared: i.events_cleared(),
            clearing: !i.degraded(),
        })
    }

    /// The replacement device of `role` as `status` lists it (right after its slot).
    pub(super) fn replacement_report(
        &self,
        snap: &ArraySnapshot,
        role: u16,
    ) -> Option<MemberReport> {
        let b = self.meta().book.replacing.clone()?;
        if b.role != role {
            return None;
        }
        let mut r = MemberReport::idle(
            Some(role),
            Some(b.path.display().to_string()),
            ReportState::Replacing,
        );
        if let Some(x) = snap
            .replacement
            .as_ref()
            .filter(|x| x.info.serial == b.serial)
        {
            r.io = crate::status::IoReport::from(&x.counters);
            r.latency_us = MemberReport::latency_from(&x.latency);
        }
        Some(r)
    }

    /// `process_start`: check, repair or resync over the whole array (a resync the
    /// array still owes resumes at its checkpoint).
    pub(super) fn process_start(&self, kind: ProcessKind) -> Result<ProcessReport, RpcError> {
        let Some(k) =
            engine_kind(kind).filter(|k| !matches!(k, EngineKind::Rebuild | EngineKind::Replace))
        else {
            return Err(RpcError::invalid_params(format!(
                "{kind} cannot be started: one of check, repair, resync"
            )));
        };
        if let Some(b) = &self.meta().book.replacing {
            return Err(RpcError::process_refused(format!(
                "member {} is being replaced by {}: wait for it to finish",
                b.role,
                b.path.display()
            )));
        }
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
    /// itself until asked for). A replace cannot be paused: it is cancelled by failing
    /// the new device.
    pub(super) fn process_stop(&self) -> Result<ProcessReport, RpcError> {
        if let Some(b) = &self.meta().book.replacing {
            return Err(RpcError::new(
                crate::rpc::codes::PROCESS_REFUSED,
                format!(
                    "a replace of member {} cannot be paused; to cancel it, fail the new \
                     device (ferroraid fail {})",
                    b.role,
                    b.path.display()
                ),
            ));
        }
        Ok(self.stop_any())
    }

    /// Stops whatever runs (the target's own stop, and `process_stop`).
    fn stop_any(&self) -> ProcessReport {
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

    /// Opens a device the operator gives to the array (`member_add`, `member_replace`):
    /// not in use by the array (`returning`: the device of a failed role may be given
    /// back — its lock is let go), claimed, large enough, and no other array's member.
    fn open_new(&self, path: &str, returning: bool) -> Result<NewDevice, RpcError> {
        let p = PathBuf::from(path);
        // vfio controllers (`vfio:BDF`) are not paths: they compare as given.
        let canon = std::fs::canonicalize(&p).unwrap_or_else(|_| p.clone());
        let same = |q: &Path| std::fs::canonicalize(q).ok().as_deref() == Some(canon.as_path());
        let snap = self.handle.snapshot();
        let back = self.paths().iter().enumerate().find_map(|(r, q)| {
            q.as_deref()
                .filter(|q| returning && same(q) && snap.members[r].state.is_failed())
                .map(|q| (r, q.to_path_buf()))
        });
        {
            let meta = self.meta();
            let serving = self.paths().iter().enumerate().any(|(r, q)| {
                q.as_deref().is_some_and(&same) && back.as_ref().is_none_or(|b| b.0 != r)
            });
            if serving
                || meta.members.iter().any(|m| m.active && same(&m.path))
                || meta.book.replacing.as_ref().is_some_and(|b| same(&b.path))
            {
                return Err(RpcError::device_in_use(path));
            }
        }
        if let Some((_, old)) = &back {
            // Out of service: its channels are closed once a new device takes the role.
            self.release_lock(old);
        }
        let lock = claim(&p).map_err(|e| RpcError::device_unusable(path, crate::error_text(&e)))?;
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
        let own_sb = metadata_io::read_superblock(&p).ok();
        if let Some(sb) = &own_sb {
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
        Ok(NewDevice {
            path: p,
            canon,
            lock,
            dev,
            info,
            own_sb,
        })
    }

    /// On an array with a Partial Parity Log, zeroes the PPL area of device `p` (the
    /// user's `path`), which joins the array with superblock `sb`
    /// ([`metadata_io::wipe_ppl`]): records the device holds from an earlier life in this
    /// array (same signature) could otherwise look newer than this run's to recovery (md
    /// writes an empty header when a device joins a log, raid5-ppl.c `ppl_modify_log` →
    /// `ppl_write_empty_header`). Not an empty header: the array's log goes on wherever it
    /// stands, past the area's start, and an empty header there would read as a clean,
    /// empty log and hide those records from recovery's walk; a zeroed start reads as no
    /// log (a mismatch, so a dirty array is resynced) until the log comes back to it —
    /// the engine rewinds it there when the device takes its slot
    /// (`engine::ppl::PplLog::rewind`). Call it before the engine can write the device.
    /// Nothing without a PPL.
    ///
    /// # Errors
    /// [`RpcError`] `device_unusable` when the write fails.
    fn init_joining_ppl(&self, p: &Path, sb: &Superblock, path: &str) -> Result<(), RpcError> {
        if self.assembly.ppl.is_none() {
            return Ok(());
        }
        metadata_io::wipe_ppl(p, sb)
            .map_err(|e| RpcError::device_unusable(path, format!("initialising its PPL area: {e}")))
    }

    /// A free slot (`dev_number`) for a device joining, and the newest superblock.
    fn free_slot(meta: &Meta) -> Result<(u32, Superblock), RpcError> {
        let newest = meta
            .members
            .iter()
            .filter(|m| m.active)
            .max_by_key(|m| m.sb.events)
            .map(|m| m.sb.clone())
            .ok_or_else(|| RpcError::internal("no member left to take the array state from"))?;
        let raid_disks = newest.raid_disks;
        // md's `bind_rdev_to_array`: the first number no device of the array uses.
        let slot = (raid_disks..)
            .find(|n| meta.members.iter().all(|m| m.sb.dev_number != *n))
            .ok_or_else(|| RpcError::internal("no free slot"))?;
        Ok((slot, newest))
    }

    /// `member_add`: the device that left a role back into it by bitmap (a re-add), else
    /// a replacement for the lowest failed role, or a spare.
    pub(super) fn add_device(&self, path: &str) -> Result<MemberReport, RpcError> {
        let nd = self.open_new(path, true)?;
        let mut meta = self.meta();
        if let Some(role) = nd
            .own_sb
            .as_ref()
            .and_then(|sb| self.readd_role(&meta, sb, path))
        {
            return self.readd(meta, nd, role, path);
        }
        let NewDevice {
            path: p,
            canon,
            lock,
            dev,
            info,
            ..
        } = nd;
        let (slot, newest) = Self::free_slot(&meta)?;
        let data_size = (info.capacity_bytes - self.data_offset_bytes) / 512;
        let sb = engine::metadata::joining_member(
            &newest,
            slot,
            engine::metadata::Uuid::random(&mut rand::thread_rng()),
            data_size,
        );
        self.init_joining_ppl(&p, &sb, path)?;
        metadata_io::write_superblock(&p, &sb)
            .map_err(|e| RpcError::device_unusable(path, format!("writing its superblock: {e}")))?;
        meta.members.push(MemberMeta {
            role: None,
            path: p.clone(),
            sb,
            active: true,
            spare: Some(Arc::new(dev)),
            replacement: false,
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
                    .map_err(|e| RpcError::internal(crate::error_text(&e)))?;
                drop(meta);
                Ok(self.report_when_swapped(role))
            }
            None => {
                meta.record_with(
                    &[],
                    None,
                    RoleChanges {
                        roles: vec![(slot, DEV_ROLE_SPARE)],
                        ..RoleChanges::default()
                    },
                )
                .map_err(|e| RpcError::internal(crate::error_text(&e)))?;
                info!(device = %p.display(), slot, "device added as a spare");
                Ok(MemberReport::idle(
                    None,
                    Some(path.to_string()),
                    ReportState::Spare,
                ))
            }
        }
    }

    /// Every reactor swaps a device into `role` within a loop turn (once the old one has
    /// nothing outstanding): the member's report as they publish it (after at most 2 s).
    fn report_when_swapped(&self, role: u16) -> MemberReport {
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        loop {
            let snap = self.handle.snapshot();
            if !snap.members[usize::from(role)].state.is_failed()
                || std::time::Instant::now() > deadline
            {
                return self.member_report(&snap, role);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The role a returning device (its superblock `sb`) goes back to by bitmap, if md's
    /// re-add rule allows it ([`engine::metadata::readd_recovery`]): its own superblock
    /// holds a role of this array that no device serves now, that role is failed here,
    /// and the bitmap covers what it missed. Logs why not otherwise.
    fn readd_role(&self, meta: &Meta, sb: &Superblock, path: &str) -> Option<u16> {
        let DevRole::Active(role) = sb.role() else {
            return None;
        };
        let newest = meta
            .members
            .iter()
            .filter(|m| m.active)
            .max_by_key(|m| m.sb.events)?;
        let snap = self.handle.snapshot();
        let same_shape = sb.ctime == newest.sb.ctime
            && sb.level == newest.sb.level
            && sb.layout == newest.sb.layout
            && sb.chunksize == newest.sb.chunksize
            && sb.raid_disks == newest.sb.raid_disks
            && sb.size == newest.sb.size;
        let role_free = snap
            .members
            .get(usize::from(role))
            .is_some_and(|m| m.state.is_failed())
            && !meta
                .members
                .iter()
                .any(|m| m.active && m.role == Some(role))
            && meta.book.replacing.as_ref().is_none_or(|b| b.role != role);
        // Its slot must not be another device's now.
        let slot_free = !matches!(newest.sb.role_of(sb.dev_number), DevRole::Active(_))
            && !meta
                .members
                .iter()
                .any(|m| m.active && m.sb.dev_number == sb.dev_number);
        if !same_shape || !slot_free {
            return None;
        }
        let bitmap = match &meta.bitmap {
            BitmapSync::Online(i) => Some(engine::metadata::ReaddBitmap {
                events_cleared: i.events_cleared(),
                stale: i.forced_all(),
            }),
            _ => None,
        };
        match engine::metadata::readd_recovery(sb, bitmap, !role_free) {
            engine::metadata::Recovery::Bitmap => Some(role),
            engine::metadata::Recovery::Full(why) => {
                info!(
                    device = path,
                    role,
                    events = sb.events,
                    "the device was a member of this array but cannot return by bitmap \
                     ({why}): it is added as a new device"
                );
                None
            }
        }
    }

    /// Re-adds `nd` (a device that left `role`) to its role: its superblock brought to
    /// the current generation with the role, `recovery_offset` 0 and
    /// `MD_FEATURE_RECOVERY_BITMAP`; the reactors rebuild it over the bitmap's dirty
    /// regions only.
    fn readd(
        &self,
        mut meta: std::sync::MutexGuard<'_, Meta>,
        nd: NewDevice,
        role: u16,
        path: &str,
    ) -> Result<MemberReport, RpcError> {
        let NewDevice {
            path: p,
            canon,
            lock,
            dev,
            own_sb,
            ..
        } = nd;
        let mut sb = own_sb.expect("a returning device has a superblock");
        let newest = meta
            .members
            .iter()
            .filter(|m| m.active)
            .max_by_key(|m| m.sb.events)
            .map(|m| m.sb.clone())
            .ok_or_else(|| RpcError::internal("no member left to take the array state from"))?;
        let dev_number = sb.dev_number;
        let events = sb.events;
        sb.events = newest.events;
        sb.resync_offset = newest.resync_offset;
        sb.dev_roles.clone_from(&newest.dev_roles);
        self.init_joining_ppl(&p, &sb, path)?;
        meta.members.push(MemberMeta {
            role: Some(role),
            path: p.clone(),
            sb,
            active: true,
            spare: None,
            replacement: false,
        });
        self.locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((canon, lock));
        let dirty = match &meta.bitmap {
            BitmapSync::Online(i) => i.dirty_on_disk(),
            _ => 0,
        };
        meta.record_with(
            &[],
            None,
            RoleChanges {
                roles: vec![(dev_number, role)],
                recovery: vec![(dev_number, Some(0))],
                features: vec![(dev_number, Feature::RecoveryBitmap, true)],
            },
        )
        .map_err(|e| RpcError::internal(crate::error_text(&e)))?;
        let dev = Arc::new(dev);
        if let Err(e) = self.handle.readd_member(role, dev) {
            warn!(device = %p.display(), role, "cannot re-add the device: {e}");
            if let Some(m) = meta.members.iter_mut().rev().find(|m| m.path == p) {
                m.role = None;
            }
            let _ = meta.record_with(
                &[],
                None,
                RoleChanges {
                    roles: vec![(dev_number, DEV_ROLE_FAULTY)],
                    recovery: vec![(dev_number, None)],
                    ..RoleChanges::default()
                },
            );
            self.release_lock(&p);
            return Err(RpcError::process_refused(format!(
                "the reactors refused {path} for member {role}: {e}"
            )));
        }
        self.took_role(&mut meta, role, &p);
        meta.book.rebuilding.push(role);
        meta.book.swapping.push(role);
        info!(
            device = %p.display(),
            role,
            events,
            dirty_regions = dirty,
            "member re-added: rebuilt over the bitmap's dirty regions only"
        );
        drop(meta);
        Ok(self.report_when_swapped(role))
    }

    /// `role` is served by the device at `path` now: paths, removals and recorded
    /// failures follow, and the device that held it before is let go.
    fn took_role(&self, meta: &mut Meta, role: u16, path: &Path) {
        let old = {
            let mut paths = self
                .paths
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            paths[usize::from(role)].replace(path.to_path_buf())
        };
        if let Some(old) = old.filter(|o| o != path) {
            // The old device is out of the array for good: let it go.
            self.release_lock(&old);
        }
        self.removed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .retain(|r| *r != role);
        meta.recorded_failed.retain(|r| *r != role);
        // A superblock write that failed for the device before is not this one's.
        meta.unwritable.retain(|r| *r != role);
        *self
            .last_checkpoint
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = std::time::Instant::now();
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
                roles: vec![(slot, DEV_ROLE_FAULTY)],
                ..RoleChanges::default()
            },
        )
        .map_err(|e| RpcError::internal(crate::error_text(&e)))?;
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
                // A member failed during its replace: the replacement takes its role.
                && meta.book.replacing.as_ref().is_none_or(|b| b.role != r)
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
        // A spare known since assembly has not had its log emptied in this run.
        if let Err(e) =
            self.init_joining_ppl(&path, &meta.members[idx].sb, &path.display().to_string())
        {
            meta.members[idx].spare = Some(dev);
            bail!("{}: {}", path.display(), e.message);
        }
        meta.members[idx].role = Some(role);
        meta.record_with(
            &[],
            None,
            RoleChanges {
                roles: vec![(slot, role)],
                recovery: vec![(slot, Some(0))],
                ..RoleChanges::default()
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
                    roles: vec![(slot, DEV_ROLE_SPARE)],
                    recovery: vec![(slot, None)],
                    ..RoleChanges::default()
                },
            )?;
            bail!("the reactors refused the device for role {role}: {e}");
        }
        self.took_role(meta, role, &path);
        meta.book.rebuilding.push(role);
        meta.book.swapping.push(role);
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
                warn!("hot spare: {}", crate::error_text(&e));
                break;
            }
        }
        let p = self.handle.process_snapshot();
        self.tend_replace(meta, snap, p.as_ref());
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
                warn!("recording rebuild progress: {}", crate::error_text(&e));
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
                        info!(process = %p.kind, stripes = p.total_stripes, mismatch_cnt = p.mismatch_cnt, "background process finished")
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
        // A resync the array owes, once nothing else runs and it is whole. Never while a
        // replace is booked: one resumed at assembly may not show as running yet, and the
        // reactors' refusal of the resync ("a replace is already running") would read as a
        // refusal of the replace, which was then cancelled (kill -9 during a replace).
        let idle = p.as_ref().is_none_or(|p| p.state != ProcessState::Running);
        let whole = snap.members.iter().all(|m| m.state == MemberState::Online);
        if idle
            && whole
            && meta.book.replacing.is_none()
            && self.resync_pending.load(Ordering::Acquire)
            && !meta.book.resync_held
        {
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
    /// of members being rebuilt and of a replacement, and the resync position as
    /// `resync_offset` (returned: `None` when no resync is owed any more).
    pub(super) fn checkpoint_at_stop(&self) -> Option<u64> {
        // The monitor must not start an owed resync again behind our back.
        self.meta().book.resync_held = true;
        self.handle.stop_process();
        let p = self.wait_process_idle(PROCESS_STOP_WAIT);
        let mut meta = self.meta();
        let snap = self.handle.snapshot();
        // A replace that completed or failed meanwhile is recorded first; one still
        // copying records where it got to (it resumes there after a restart).
        self.tend_replace(&mut meta, &snap, p.as_ref());
        if let Some(b) = meta
            .book
            .replacing
            .clone()
            .filter(|b| b.swap_recorded.is_none())
        {
            if let Some(pos) = p
                .as_ref()
                .filter(|p| p.kind == EngineKind::Replace)
                .map(|p| p.position_sectors)
            {
                if pos != b.checkpoint {
                    let _ = Self::checkpoint_replace(&mut meta, &b, pos);
                }
            }
        }
        let (changes, done) = Self::rebuild_changes(&meta, &snap, p.as_ref(), true);
        meta.book.rebuilding.retain(|r| !done.contains(r));
        if !changes.recovery.is_empty() {
            if let Err(e) = meta.record_with(&[], None, changes) {
                warn!(
                    "recording rebuild progress at stop: {}",
                    crate::error_text(&e)
                );
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

    /// `member_replace`: `new` replaces the member `old` names while it keeps serving (md's
    /// `mdadm --replace OLD --with NEW`).
    pub(super) fn replace(&self, old: &str, new: &str) -> Result<MemberReport, RpcError> {
        let role = self
            .role_of(old)
            .ok_or_else(|| RpcError::no_such_member(old))?;
        let removed = self
            .removed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&role);
        if removed || self.path_of(role).is_none() {
            return Err(RpcError::no_such_member(old));
        }
        if let Some(b) = &self.meta().book.replacing {
            return Err(RpcError::process_refused(if b.role == role {
                format!(
                    "member {old} (slot {role}) is already being replaced by {}",
                    b.path.display()
                )
            } else {
                format!(
                    "member {} is being replaced by {}: one replace at a time",
                    b.role,
                    b.path.display()
                )
            }));
        }
        let snap = self.handle.snapshot();
        let word = |s: MemberState| match s {
            MemberState::Rebuilding => "being rebuilt",
            _ => "faulty",
        };
        let state = snap.members[usize::from(role)].state;
        if state != MemberState::Online {
            return Err(RpcError::process_refused(format!(
                "member {old} (slot {role}) is {}: a replace copies a member in service; \
                 add {new} to rebuild it instead (ferroraid add {new})",
                word(state)
            )));
        }
        if let Some((m, x)) = snap
            .members
            .iter()
            .enumerate()
            .find(|(_, x)| x.state != MemberState::Online)
        {
            return Err(RpcError::process_refused(format!(
                "the array is degraded (member {m} is {}): md would give a new device to the \
                 missing member first (raid5_add_disk fills an empty slot before it takes a \
                 replacement), so add {new} to rebuild member {m} instead",
                word(x.state)
            )));
        }
        // A hot spare of this array may be the new device (md's `--replace` takes a spare).
        let spare = {
            let want = Path::new(new);
            let canon = std::fs::canonicalize(want).ok();
            self.meta().members.iter().position(|m| {
                m.active
                    && m.role.is_none()
                    && m.spare.is_some()
                    && (m.path == want
                        || canon.is_some() && std::fs::canonicalize(&m.path).ok() == canon)
            })
        };
        let (p, dev, dev_number, mut meta) = match spare {
            Some(idx) => {
                let mut meta = self.meta();
                let dev = meta.members[idx]
                    .spare
                    .take()
                    .ok_or_else(|| RpcError::internal("the spare has no device"))?;
                if let Err(e) = self.handle.check_start_replace(role, dev.info(), 0) {
                    meta.members[idx].spare = Some(dev);
                    return Err(RpcError::process_refused(e));
                }
                if let Err(e) =
                    self.init_joining_ppl(&meta.members[idx].path, &meta.members[idx].sb, new)
                {
                    meta.members[idx].spare = Some(dev);
                    return Err(e);
                }
                let m = &mut meta.members[idx];
                m.role = Some(role);
                m.replacement = true;
                let (p, dev_number) = (m.path.clone(), m.sb.dev_number);
                (p, dev, dev_number, meta)
            }
            None => {
                let nd = self.open_new(new, false)?;
                self.handle
                    .check_start_replace(role, &nd.info, 0)
                    .map_err(RpcError::process_refused)?;
                let NewDevice {
                    path: p,
                    canon,
                    lock,
                    dev,
                    info,
                    ..
                } = nd;
                let mut meta = self.meta();
                let (dev_number, newest) = Self::free_slot(&meta)?;
                let data_size = (info.capacity_bytes - self.data_offset_bytes) / 512;
                let sb = engine::metadata::joining_member(
                    &newest,
                    dev_number,
                    engine::metadata::Uuid::random(&mut rand::thread_rng()),
                    data_size,
                );
                self.init_joining_ppl(&p, &sb, new)?;
                metadata_io::write_superblock(&p, &sb).map_err(|e| {
                    RpcError::device_unusable(new, format!("writing its superblock: {e}"))
                })?;
                meta.members.push(MemberMeta {
                    role: Some(role),
                    path: p.clone(),
                    sb,
                    active: true,
                    spare: None,
                    replacement: true,
                });
                self.locks
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push((canon, lock));
                (p, Arc::new(dev), dev_number, meta)
            }
        };
        let error_at_start = self.handle.snapshot().control_error;
        // Every superblock says it first: role `role` twice, the new device a replacement
        // copied up to sector 0 (md's `super_1_sync` for a `Replacement` rdev).
        meta.record_with(
            &[],
            None,
            RoleChanges {
                roles: vec![(dev_number, role)],
                recovery: vec![(dev_number, Some(0))],
                features: vec![(dev_number, Feature::Replacement, true)],
            },
        )
        .map_err(|e| RpcError::internal(crate::error_text(&e)))?;
        let serial = match self.handle.start_replace(role, Arc::clone(&dev), 0) {
            Ok(s) => s,
            Err(e) => {
                warn!(device = %p.display(), role, "cannot replace onto the device: {e}");
                // A spare stays a spare; a new device leaves again.
                let back = spare.and_then(|idx| meta.members.get_mut(idx));
                let roles = match back {
                    Some(m) => {
                        m.role = None;
                        m.replacement = false;
                        m.spare = Some(dev);
                        vec![(dev_number, DEV_ROLE_SPARE)]
                    }
                    None => {
                        self.release_lock(&p);
                        vec![(dev_number, DEV_ROLE_FAULTY)]
                    }
                };
                let _ = meta.record_with(
                    &[],
                    None,
                    RoleChanges {
                        roles,
                        recovery: vec![(dev_number, None)],
                        features: vec![(dev_number, Feature::Replacement, false)],
                    },
                );
                return Err(RpcError::process_refused(e));
            }
        };
        meta.book.replacing = Some(ReplaceBook {
            role,
            serial,
            dev_number,
            path: p.clone(),
            checkpoint: 0,
            error_at_start,
            swap_recorded: None,
        });
        *self
            .last_checkpoint
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = std::time::Instant::now();
        info!(
            old = %self.path_of(role).map(|x| x.display().to_string()).unwrap_or_default(),
            new = %p.display(),
            role,
            dev_number,
            "replace started: the member keeps serving while it is copied"
        );
        Ok(MemberReport::idle(
            Some(role),
            Some(new.to_string()),
            ReportState::Replacing,
        ))
    }

    /// `member_fail` of the replacement device: the replace is cancelled (md fails the
    /// replacement; the member keeps its slot) — unless the superblocks already record it
    /// in the slot ([`Self::record_replace`]): then the slot fails (the array degraded,
    /// the old device already out). `None` when `sel` names no replacement.
    pub(super) fn fail_replacement(&self, sel: &str) -> Option<MemberReport> {
        let b = self.meta().book.replacing.clone()?;
        let want = Path::new(sel);
        let same = b.path == want
            || std::fs::canonicalize(want).ok().is_some_and(|c| {
                std::fs::canonicalize(&b.path).ok().as_deref() == Some(c.as_path())
            });
        if !same {
            return None;
        }
        self.handle.fail_replacement(b.serial);
        if b.swap_recorded.is_some() {
            warn!(device = %b.path.display(), role = b.role, "replacement failed by the operator after the superblocks recorded it in the slot: the slot fails");
        } else {
            info!(device = %b.path.display(), role = b.role, "replacement failed by the operator: replace cancelled");
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while std::time::Instant::now() < deadline {
            let snap = self.handle.snapshot();
            if matches!(b.state_in(&snap), Some(ReplaceState::Failed(_)))
                || b.swap_recorded.is_some() && snap.members[usize::from(b.role)].state.is_failed()
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Some(MemberReport::idle(
            Some(b.role),
            Some(b.path.display().to_string()),
            ReportState::Faulty,
        ))
    }

    /// Writes the replacement's progress (`recovery_offset`, sectors).
    fn checkpoint_replace(meta: &mut Meta, b: &ReplaceBook, sectors: u64) -> Result<()> {
        meta.record_with(
            &[],
            None,
            RoleChanges {
                recovery: vec![(b.dev_number, Some(sectors))],
                ..RoleChanges::default()
            },
        )?;
        if let Some(x) = meta.book.replacing.as_mut() {
            x.checkpoint = sectors;
        }
        Ok(())
    }

    /// One monitor turn for a replace: progress checkpoints; once every reactor has copied
    /// the replacement, the superblocks record the swap and then the reactors make it
    /// ([`Self::record_replace`]); once they have, the old device is let go; when the
    /// replacement failed (or the replace cannot finish), its slot is recorded faulty.
    pub(super) fn tend_replace(
        &self,
        meta: &mut Meta,
        snap: &ArraySnapshot,
        p: Option<&engine::process::ProcessSnapshot>,
    ) {
        let Some(b) = meta.book.replacing.clone() else {
            return;
        };
        if b.swap_recorded.is_some() {
            // The superblocks name the replacement in the slot: the swap is made whatever
            // happens now (a replacement failing since fails the slot on every reactor,
            // `Array::complete_replace`); never undone, since a reactor may have swapped
            // already and written only the new device.
            let done = b.state_in(snap) == Some(ReplaceState::Done);
            if done {
                self.finish_replace(meta, &b);
            } else {
                self.record_replace(meta, &b);
            }
            return;
        }
        // The replacement's superblock could not be written (`Meta::record_with` dropped
        // it): the replace cannot go on. Asked until the reactors report it failed; it is
        // abandoned then (below).
        if !meta.members.iter().any(|m| m.active && m.replacement)
            && b.state_in(snap)
                .is_some_and(|s| !matches!(s, ReplaceState::Failed(_)))
        {
            warn!(
                role = b.role,
                device = %b.path.display(),
                "the replacement's superblock could not be written: cancelling the replace"
            );
            self.handle.fail_replacement(b.serial);
            return;
        }
        // A reactor that could not take the replace: it cannot complete.
        if let Some(e) = snap
            .control_error
            .as_ref()
            .filter(|e| Some(*e) != b.error_at_start.as_ref() && concerns_replace(e, b.role))
        {
            warn!(
                role = b.role,
                "a reactor refused the replace ({e}): cancelling it"
            );
            self.handle.fail_replacement(b.serial);
            if snap
                .replacement
                .as_ref()
                .is_none_or(|r| r.info.serial != b.serial)
            {
                // No reactor has it at all: nothing to wait for.
                return self.abandon_replace(meta, &b, &e.to_string());
            }
            if let Some(x) = meta.book.replacing.as_mut() {
                x.error_at_start = Some(e.clone());
            }
        }
        let Some(r) = snap
            .replacement
            .as_ref()
            .filter(|r| r.info.serial == b.serial)
        else {
            return;
        };
        match r.info.state {
            ReplaceState::Copying => {
                let replace = p.filter(|p| p.kind == EngineKind::Replace);
                if let Some(ProcessState::Failed(e)) = replace.map(|p| p.state) {
                    if !matches!(e, engine::process::ProcessError::ReplacementFailed { .. }) {
                        warn!(
                            role = b.role,
                            "the replace cannot finish ({e}): cancelling it"
                        );
                        self.handle.fail_replacement(b.serial);
                        return;
                    }
                }
                let due = self
                    .last_checkpoint
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .elapsed()
                    >= CHECKPOINT_INTERVAL;
                if let Some(pos) = replace.map(|p| p.position_sectors) {
                    if due && pos != b.checkpoint {
                        if let Err(e) = Self::checkpoint_replace(meta, &b, pos) {
                            warn!("recording replace progress: {}", crate::error_text(&e));
                        }
                    }
                }
            }
            ReplaceState::Copied => self.record_replace(meta, &b),
            ReplaceState::Done => self.finish_replace(meta, &b),
            ReplaceState::Failed(e) => self.abandon_replace(meta, &b, &e.to_string()),
        }
    }

    /// The replace stopped without completing (`why`): the replacement's slot is recorded
    /// faulty and the device let go; the array is as it was. Never after the swap was
    /// recorded ([`Self::tend_replace`]).
    fn abandon_replace(&self, meta: &mut Meta, b: &ReplaceBook, why: &str) {
        debug_assert!(b.swap_recorded.is_none());
        warn!(
            device = %b.path.display(),
            role = b.role,
            error = why,
            "replace stopped: the replacement is out; the array is unchanged"
        );
        if let Err(e) = meta.record_with(
            &[],
            None,
            RoleChanges {
                roles: vec![(b.dev_number, DEV_ROLE_FAULTY)],
                ..RoleChanges::default()
            },
        ) {
            // Kept: tried again next turn, writes held meanwhile (a restart now would
            // resume the replace onto the device that missed them).
            warn!(
                "recording the failed replacement (writes wait until it is recorded): {}",
                crate::error_text(&e)
            );
            return;
        }
        for m in meta.members.iter_mut().filter(|m| m.replacement) {
            m.active = false;
            m.replacement = false;
            m.role = None;
        }
        self.release_lock(&b.path);
        meta.book.replacing = None;
    }

    /// Every reactor has copied the replacement ([`ReplaceState::Copied`]): the
    /// superblocks record the swap ([`Self::record_replace_swap`]), then the reactors are
    /// asked to make it ([`engine::reactor::ReactorHandle::complete_replace`]; asked again
    /// each turn until they have). In this order a crash restarts on devices that hold
    /// every acknowledged write: before the record on the old member (every write still
    /// reaches it, and the replace resumes from its checkpoint), after it on the
    /// replacement (every write reached it too, and its superblock's sync flushed the
    /// copy). Swapping first, as the reactors did before, left a window in which writes
    /// reached only the new device while the superblocks still named the old one. A
    /// record that fails is retried next turn. Once recorded the swap is never undone: a
    /// replacement failing now fails the slot on every reactor (degraded, recorded as any
    /// member failure is, within a monitor turn).
    fn record_replace(&self, meta: &mut Meta, b: &ReplaceBook) {
        if b.swap_recorded.is_none() {
            let Some(old) = Self::record_replace_swap(meta, b) else {
                return;
            };
            if let Some(x) = meta.book.replacing.as_mut() {
                x.swap_recorded = Some(old);
            }
        }
        if let Err(e) = self.handle.complete_replace(b.serial) {
            warn!(
                role = b.role,
                "asking the reactors to swap the replacement in: {e}"
            );
        }
    }

    /// The replacement holds its role on every reactor: the swap is recorded if it was not
    /// yet ([`Self::record_replace`]), and the old device is let go.
    fn finish_replace(&self, meta: &mut Meta, b: &ReplaceBook) {
        let old = match b.swap_recorded {
            Some(old) => old,
            None => match Self::record_replace_swap(meta, b) {
                Some(old) => old,
                None => return,
            },
        };
        let path = b.path.clone();
        self.took_role(meta, b.role, &path);
        meta.book.replacing = None;
        let old_path = old.map(|i| meta.members[i].path.display().to_string());
        info!(
            role = b.role,
            new = %b.path.display(),
            old = %old_path.unwrap_or_else(|| "(failed)".into()),
            "replace complete: the replacement holds the slot, the old device is out of the array"
        );
    }

    /// Records a replacement in its role: its superblock loses the replacement flag and
    /// recovery offset, the old member's slot is recorded faulty, and the old device itself
    /// is told it is out (see the module docs). Returns the old member's index in
    /// `meta.members` (`Some(None)`: it had no device left), or `None` when the
    /// superblocks could not be written (logged; the monitor tries again next turn).
    fn record_replace_swap(meta: &mut Meta, b: &ReplaceBook) -> Option<Option<usize>> {
        let old = meta
            .members
            .iter()
            .position(|m| m.active && m.role == Some(b.role) && !m.replacement);
        let mut changes = RoleChanges {
            recovery: vec![(b.dev_number, None)],
            features: vec![(b.dev_number, Feature::Replacement, false)],
            ..RoleChanges::default()
        };
        let old_meta = old.map(|i| meta.members[i].clone());
        if let Some(o) = &old_meta {
            changes.roles.push((o.sb.dev_number, DEV_ROLE_FAULTY));
        }
        // Cleared first: a superblock write failing in this generation fails the role's
        // device, which is the replacement now (`Meta::record_with` never picks one).
        let flagged: Vec<usize> = (0..meta.members.len())
            .filter(|&i| meta.members[i].replacement)
            .collect();
        for &i in &flagged {
            meta.members[i].replacement = false;
        }
        let events = match meta.record_with(&[], None, changes) {
            Ok(ev) => ev,
            Err(e) => {
                warn!("recording the completed replace: {}", crate::error_text(&e));
                for &i in &flagged {
                    meta.members[i].replacement = true;
                }
                return None;
            }
        };
        if let (Some(o), Some(i)) = (&old_meta, old) {
            // The old device's own superblock: this generation, its slot faulty.
            let newest = meta
                .members
                .iter()
                .filter(|m| m.active)
                .max_by_key(|m| m.sb.events)
                .map(|m| m.sb.clone());
            if let Some(n) = newest {
                let mut sb = o.sb.clone();
                sb.events = events;
                sb.utime = n.utime;
                sb.resync_offset = n.resync_offset;
                sb.dev_roles.clone_from(&n.dev_roles);
                match metadata_io::write_superblock(&o.path, &sb) {
                    Ok(()) => meta.members[i].sb = sb,
                    Err(e) => {
                        // Then it must not pass for one generation behind: one more.
                        warn!(device = %o.path.display(), "writing the replaced device's superblock: {e}");
                        if let Err(e) = meta.record(&[], None) {
                            warn!(
                                "one more generation after the replace: {}",
                                crate::error_text(&e)
                            );
                        }
                    }
                }
            }
        }
        info!(
            role = b.role,
            "replace copied: the superblocks record the replacement in the slot; swapping it in"
        );
        Some(old)
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
                .find(|m| m.active && m.role == Some(role) && !m.replacement)
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
