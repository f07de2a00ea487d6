//! The running target: members assembled from their md superblocks, reactors, the NBD
//! export, and the superblock bookkeeping of a live array.
//!
//! [`Target::start`] opens every device (io_uring, `O_DIRECT`), reads its md v1.2
//! superblock, and lets [`engine::metadata::assemble`] decide — superblocks, not the order
//! the devices were named in, say which device serves which role. An absent role is run
//! degraded (a placeholder device that refuses everything, listed as failed). Before the
//! first request the array is marked *active* on every member (`events` + 1,
//! `resync_offset` = 0, md's `super_1_sync` for a dirty array), with absent roles recorded
//! faulty in that same generation, so a crash leaves members that say "resync needed" and
//! a device left out can never pass for current again. Members `force` brought in out of
//! date are first brought up to the newest generation, as `mdadm --assemble --force` does. A monitor thread records members the reactors fail as faulty
//! in the survivors' superblocks. [`Target::stop`] shuts the NBD listener, drains every
//! connection's requests, stops the reactors, flushes every member and marks the array
//! clean (`resync_offset` = `MaxSector`) — or leaves it dirty if it needed a resync when
//! it started (resync is a later issue's).

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, ensure, Context, Result};
use drivers::any::{open_member, AnyDevice, MemberConfig};
use drivers::metadata_io;
use engine::array::{ArrayConfig, MemberState};
use engine::bitmap::{NeedsSync, WriteIntent};
use engine::device::BlockDevice;
use engine::geometry::ArrayGeometry;
use engine::metadata::bitmap::{bitmap_start_sector, BITMAP_STATE_STALE};
use engine::metadata::{
    assemble, next_generation, AssembleOptions, Assembly, DevRole, FullRebuildReason, MdTime,
    Resync, Superblock, Update, MAX_SECTOR,
};
use engine::parity::Parity;
use engine::reactor::{Extras, Mode, ReactorConfig, ReactorHandle, ReactorSet, Reactors};
use tracing::{info, warn};

use crate::frontends::{Attacher, ExportSpec, TargetFrontend};
use crate::iscsi::IscsiConfig;
use crate::metrics::{MetricsServer, MetricsSource, Scrape};
use crate::nbd::DEFAULT_MAX_BLOCK_BYTES;
use crate::rpc::{Handler, RpcError, RpcServer};
use crate::status::{
    ArrayInfo, ArrayState, ExportProtocol, ExportRemoveReport, ExportReport, MemberReport,
    ProcessKind, ProcessReport, QueueWaitReport, ReactorLoadReport, ReactorsReport, StatsReport,
    StatusReport,
};

mod exports;
mod lifecycle;

pub use exports::{ExportError, DRAIN_WAIT};

/// How often the monitor looks for newly failed members, to record them on disk.
const MONITOR_INTERVAL: Duration = Duration::from_millis(50);
/// Longest wait for the bitmap owner to write the bitmap superblock before an md superblock
/// update: a member whose bitmap write hangs is failed by the command timeout anyway.
const BITMAP_SUPER_WAIT: Duration = Duration::from_secs(5);

/// What `ferroraid serve` runs.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// Member devices in any order: files, block devices, NVMe generic devices
    /// (`/dev/ngXnY`, io_uring passthrough) or NVMe controllers bound to vfio-pci
    /// (`vfio:DDDD:BB:DD.F`).
    pub devices: Vec<PathBuf>,
    /// CPU cores of the reactors (one reactor each). Empty: `reactors` reactors on cores
    /// chosen by `drivers::topology::choose_cores` (hwloc with the `hwloc` feature, else
    /// the kernel's sysfs topology: one per physical core, the members' NUMA node first).
    pub cores: Vec<usize>,
    /// Reactors when `cores` is empty (at least 1).
    pub reactors: usize,
    /// Idle behaviour of the reactors.
    pub mode: Mode,
    /// Serve NBD from the start: on `nbd_tcp` and `nbd_unix`, or on 127.0.0.1:10809 when
    /// both are empty. `false` (`serve --nbd none`): no NBD export until
    /// [`Target::export_add`].
    pub nbd: bool,
    /// NBD listening TCP addresses.
    pub nbd_tcp: Vec<SocketAddr>,
    /// NBD listening Unix socket paths.
    pub nbd_unix: Vec<PathBuf>,
    /// Largest NBD request, bytes.
    pub max_block_bytes: u32,
    /// NBD server tunables: connection limit, handshake and idle timeouts, handshakes at
    /// once (its `buffers` stay empty: derived from `max_block_bytes`).
    pub nbd_config: crate::nbd::ServerConfig,
    /// NBD over TLS: mode and credentials (`None`: TLS off).
    pub nbd_tls: Option<crate::nbd::TlsConfig>,
    /// Offer NBD block status (the `base:allocation` metadata context,
    /// [`crate::nbd::ExportConfig::block_status`]).
    pub nbd_block_status: bool,
    /// Start although members are missing or out of date, or dirty and degraded (mdadm
    /// `--force`; implies [`ServeOptions::run`]).
    pub force: bool,
    /// Start although members the array still counts as active were not given (mdadm
    /// `--run`); a dirty degraded array without a PPL still needs `force`.
    pub run: bool,
    /// Command timeout of member requests.
    pub io_timeout: Duration,
    /// Requests in flight per reactor per member (io_uring queue depth).
    pub queue_depth: u32,
    /// Stripe operations per reactor (each holds one chunk per member).
    pub stripe_ops: usize,
    /// Stripe cache per reactor and member, bytes (`ArrayConfig::stripe_cache_entries`
    /// is this over the chunk size); `None`: the engine's default entries.
    pub stripe_cache_bytes: Option<u64>,
    /// Shortest bound of the hold of a sub-stripe write for more writes of its stripe
    /// (`ArrayConfig::write_hold_ns`; the bound scales with the measured write latency).
    pub write_hold: Duration,
    /// Per-member queue-depth control (`engine::qos::depth`): policy and optional
    /// read-latency target.
    pub depth: engine::qos::DepthConfig,
    /// JSON-RPC management socket, if any.
    pub rpc: Option<PathBuf>,
    /// Metrics endpoint (Prometheus/OpenMetrics text on `GET /metrics`,
    /// [`crate::metrics`]), if any.
    pub metrics: Option<SocketAddr>,
    /// iSCSI listening addresses (empty: no iSCSI target). The target is
    /// `iqn.2026-11.org.ferroraid:<array name>`, LUN 0.
    pub iscsi: Vec<SocketAddr>,
    /// iSCSI tunables and CHAP secrets.
    pub iscsi_config: IscsiConfig,
    /// NVMe/TCP listening addresses (empty: no NVMe/TCP target). The subsystem is
    /// `nqn.2026-11.org.ferroraid:<array name>` (docs/NVMF.md), namespace 1; every
    /// address also serves the discovery controller.
    pub nvmf: Vec<SocketAddr>,
    /// NVMe/TCP tunables.
    pub nvmf_config: crate::nvmf::NvmfConfig,
    /// Host NQNs allowed to connect to the NVMe/TCP subsystem (empty: any host;
    /// [`crate::nvmf::NvmfServerBuilder::allow_host`]).
    pub nvmf_allow_hosts: Vec<String>,
    /// Background pacer of every reactor (`engine::qos::pacer`).
    pub pacer: engine::qos::pacer::PacerKind,
    /// Its floor and ceiling, bytes/s per member (md's `speed_limit_min/max`).
    pub speed_limits: engine::qos::pacer::SpeedLimits,
    /// ferroraid's pacer: foreground latency background may add, as a fraction of the
    /// quiet latency (`engine::qos::pacer::FerroraidPacerConfig::tolerance`).
    pub pacer_tolerance: f64,
}

impl ServeOptions {
    /// The exports these options start an array with: NBD unless `nbd` is off (no
    /// address: the NBD default, [`crate::nbd::DEFAULT_LISTEN`]), iSCSI and NVMe/TCP
    /// when they have addresses.
    pub fn export_specs(&self) -> Vec<ExportSpec> {
        exports::initial_specs(self)
    }

    /// Defaults for `devices`: one reactor, polled, NBD on 127.0.0.1:10809, 4 MiB
    /// requests, no force, 30 s command timeout, queue depth 128, 64 stripe operations,
    /// ferroraid's depth controller with a derived target, ferroraid's pacer with md's
    /// default speed limits (1000 and 200000 KiB/s per member).
    pub fn new(devices: Vec<PathBuf>) -> Self {
        Self {
            devices,
            cores: Vec::new(),
            reactors: 1,
            mode: Mode::Polled,
            nbd: true,
            nbd_tcp: Vec::new(),
            nbd_unix: Vec::new(),
            max_block_bytes: DEFAULT_MAX_BLOCK_BYTES,
            nbd_config: crate::nbd::ServerConfig::default(),
            nbd_tls: None,
            nbd_block_status: true,
            force: false,
            run: false,
            io_timeout: Duration::from_secs(30),
            queue_depth: 128,
            stripe_ops: 64,
            stripe_cache_bytes: None,
            write_hold: Duration::from_nanos(engine::array::DEFAULT_WRITE_HOLD_NS),
            depth: engine::qos::DepthConfig::default(),
            rpc: None,
            metrics: None,
            iscsi: Vec::new(),
            iscsi_config: IscsiConfig::default(),
            nvmf: Vec::new(),
            nvmf_config: crate::nvmf::NvmfConfig::default(),
            nvmf_allow_hosts: Vec::new(),
            pacer: engine::qos::pacer::PacerKind::default(),
            speed_limits: engine::qos::pacer::SpeedLimits::default(),
            pacer_tolerance: engine::qos::pacer::FerroraidPacerConfig::default().tolerance,
        }
    }
}

/// One member's (or spare's) on-disk state as the target keeps it.
#[derive(Clone)]
struct MemberMeta {
    /// The role it serves; `None` for a spare.
    role: Option<u16>,
    path: PathBuf,
    sb: Superblock,
    /// Still receives superblock updates (not failed).
    active: bool,
    /// A spare's opened device, handed to the reactors when it replaces a failed member
    /// (or a replacement's, resumed after the reactors start).
    spare: Option<Arc<AnyDevice>>,
    /// It replaces the member of its role (`ferroraid replace`, md's `Replacement` flag):
    /// the member of the role is another device until the replace completes.
    replacement: bool,
}

impl std::fmt::Debug for MemberMeta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemberMeta")
            .field("role", &self.role)
            .field("path", &self.path)
            .field("dev_number", &self.sb.dev_number)
            .field("events", &self.sb.events)
            .field("active", &self.active)
            .field("replacement", &self.replacement)
            .finish_non_exhaustive()
    }
}

/// How the internal bitmap's superblock follows the md superblocks: md writes the bitmap
/// superblock with the new `events` before the md superblocks (`md_update_sb` →
/// `md_bitmap_update_sb`), so a bitmap is never older than the superblock that announces
/// it (else md and ferroraid take it for stale).
#[derive(Debug)]
enum BitmapSync {
    /// No internal bitmap.
    None,
    /// The reactors are not running: rewrite each member's bitmap superblock directly.
    /// `clear_stale`: also clear its stale flag (the array is clean, so the old bits do
    /// not matter and every later write sets its own).
    Offline { clear_stale: bool },
    /// The owner reactor writes the bitmap: ask it, and wait.
    Online(Arc<WriteIntent>),
}

/// The superblocks of the running array, and the rule for changing them.
#[derive(Debug)]
struct Meta {
    members: Vec<MemberMeta>,
    /// Roles already recorded faulty (a role leaves the list when a device replaces it).
    recorded_failed: Vec<u16>,
    /// Roles recorded faulty because their device's superblock could not be written
    /// ([`Meta::record_with`]), for the monitor to fail on the reactors too.
    unwritable: Vec<u16>,
    /// Background process bookkeeping of the monitor.
    book: lifecycle::ProcessBook,
    bitmap: BitmapSync,
}

/// Role and recovery changes of one superblock generation, beside failures and
/// `resync_offset` ([`Update::roles`], [`Update::recovery`], [`Update::features`]).
#[derive(Default)]
struct RoleChanges {
    roles: Vec<(u32, u16)>,
    recovery: Vec<(u32, Option<u64>)>,
    features: Vec<(u32, engine::metadata::Feature, bool)>,
}

impl Meta {
    /// Writes the next generation (md's update rule) to every active member; a member whose
    /// superblock cannot be written is failed in the generation after (rule 3 of
    /// `engine::metadata::update`). A failed role with no device (missing at assembly) is
    /// recorded faulty in the slot `dev_roles` gives it. Returns the new `events`.
    ///
    /// # Errors
    /// No member is left to write, or no member's superblock could be written: then no
    /// role counts as recorded faulty (`recorded_failed` is unchanged).
    fn record(&mut self, failed_roles: &[u16], resync: Option<Resync>) -> Result<u64> {
        self.record_with(failed_roles, resync, RoleChanges::default())
    }

    /// [`Meta::record`] with role assignments and rebuild progress in the same generation.
    fn record_with(
        &mut self,
        failed_roles: &[u16],
        resync: Option<Resync>,
        mut changes: RoleChanges,
    ) -> Result<u64> {
        let mut failed: Vec<u16> = failed_roles.to_vec();
        // Every role failed in some generation of this call.
        let mut recorded: Vec<u16> = Vec::new();
        loop {
            let current: Vec<Superblock> = self
                .members
                .iter()
                .filter(|m| m.active)
                .map(|m| m.sb.clone())
                .collect();
            let newest = current.iter().max_by_key(|sb| sb.events);
            // The member of the role, never its replacement.
            let replacements: Vec<u32> = self
                .members
                .iter()
                .filter(|m| m.replacement)
                .map(|m| m.sb.dev_number)
                .collect();
            let slots: Vec<u32> = failed
                .iter()
                .filter_map(|r| {
                    match self
                        .members
                        .iter()
                        .find(|m| m.role == Some(*r) && m.active && !m.replacement)
                    {
                        Some(m) => Some(m.sb.dev_number),
                        None => newest?
                            .dev_roles
                            .iter()
                            .enumerate()
                            .position(|(slot, x)| x == r && !replacements.contains(&(slot as u32)))
                            .map(|slot| slot as u32),
                    }
                })
                .collect();
            ensure!(
                !current.is_empty(),
                "no member left to record the array state on"
            );
            let update = Update {
                utime: md_now(),
                failed: slots,
                resync,
                roles: std::mem::take(&mut changes.roles),
                recovery: std::mem::take(&mut changes.recovery),
                features: std::mem::take(&mut changes.features),
            };
            let next = next_generation(&current, &update).context("building superblocks")?;
            if let Some(ev) = next.iter().flatten().map(|sb| sb.events).max() {
                self.bitmap_events(ev);
            }
            let mut write_failed = Vec::new();
            let active: Vec<usize> = (0..self.members.len())
                .filter(|&i| self.members[i].active)
                .collect();
            let mut events = 0;
            let mut written = 0;
            for (i, sb) in active.into_iter().zip(next) {
                let m = &mut self.members[i];
                match sb {
                    None => m.active = false,
                    Some(sb) => match metadata_io::write_superblock(&m.path, &sb) {
                        Ok(()) => {
                            events = sb.events;
                            written += 1;
                            m.sb = sb;
                        }
                        Err(e) => {
                            warn!(member = %m.path.display(), "superblock write failed: {e}");
                            match m.role {
                                // A replacement is not its role's device: it is dropped
                                // (the monitor cancels its replace, `tend_replace`);
                                // failing the role would record the member it copies
                                // faulty.
                                Some(_) if m.replacement => m.active = false,
                                Some(r) => write_failed.push(r),
                                // A spare that cannot be written is dropped.
                                None => m.active = false,
                            }
                        }
                    },
                }
            }
            recorded.extend_from_slice(&failed);
            for r in &write_failed {
                if !self.unwritable.contains(r) {
                    self.unwritable.push(*r);
                }
            }
            if write_failed.is_empty() {
                // Recorded only once a device took the last generation: the monitor holds
                // writes until then (`unrecorded_roles`).
                ensure!(
                    written > 0,
                    "no member's superblock could be written: nothing is recorded"
                );
                for r in recorded {
                    if !self.recorded_failed.contains(&r) {
                        self.recorded_failed.push(r);
                    }
                }
                return Ok(events);
            }
            failed = write_failed;
        }
    }
}

impl Meta {
    /// Brings the bitmap superblock to `events` before the md superblocks get it (see
    /// [`BitmapSync`]). Failures are logged, not fatal: a bitmap left behind reads as stale
    /// later, which costs a full resync after a crash but never loses a dirty region.
    fn bitmap_events(&mut self, events: u64) {
        match &self.bitmap {
            BitmapSync::None => {}
            BitmapSync::Online(i) => {
                i.set_events(events);
                let start = std::time::Instant::now();
                while i.super_written_events() < events {
                    if start.elapsed() > BITMAP_SUPER_WAIT {
                        warn!(
                            events,
                            written = i.super_written_events(),
                            "the bitmap superblock was not written in time; the bitmap will \
                             read as stale"
                        );
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            BitmapSync::Offline { clear_stale } => {
                let clear = *clear_stale;
                for m in self.members.iter().filter(|m| m.active) {
                    if bitmap_start_sector(&m.sb).is_none() {
                        continue;
                    }
                    let r = metadata_io::read_bitmap(&m.path, &m.sb).and_then(|mut b| {
                        b.super_.events = b.super_.events.max(events);
                        if clear {
                            b.super_.state &= !BITMAP_STATE_STALE;
                        }
                        metadata_io::write_bitmap_area(&m.path, &m.sb, &b.to_area(false))
                    });
                    if let Err(e) = r {
                        warn!(member = %m.path.display(), "bitmap superblock update failed: {e}");
                    }
                }
            }
        }
    }
}

/// Share of the machine's memory ([`machine_memory_bytes`]) the default stripe cache of one
/// array may take: 1/64 (384 MiB of 24 GiB).
const DEFAULT_STRIPE_CACHE_MEMORY_SHARE: u64 = 64;

/// The most memory the default stripe cache of one array takes, bytes, all reactors.
const DEFAULT_STRIPE_CACHE_MAX_BYTES: u64 = 1 << 30;

/// The stripe cache of an array served without `--stripe-cache`, entries per reactor
/// (each holds one chunk per member: `members × chunk_bytes` bytes). A random writer over
/// a region stops reading its members only once the cache holds the region (its old data
/// and P/Q), so the default is sized to the machine rather than to md's 1 MiB per member:
/// every stripe of the reactor's shard (`ceil(stripes / reactors)`: more could never be
/// used), within 1/64 of `memory_bytes` and at most 1 GiB for the array over all
/// `reactors` — but never fewer than [`engine::array::DEFAULT_STRIPE_CACHE_ENTRIES`] (the
/// former default) where the shard has that many stripes. The engine raises it to the
/// stripe operations at least (`ArrayConfig::stripe_cache_entries`).
fn default_stripe_cache_entries(geo: &ArrayGeometry, reactors: usize, memory_bytes: u64) -> usize {
    let g = geo.geometry();
    let entry = u64::from(g.members()) * u64::from(g.chunk_bytes());
    let reactors = reactors.max(1) as u64;
    let shard_stripes = geo.stripes().div_ceil(reactors);
    let budget = (memory_bytes / DEFAULT_STRIPE_CACHE_MEMORY_SHARE)
        .min(DEFAULT_STRIPE_CACHE_MAX_BYTES)
        / reactors
        / entry.max(1);
    let entries = budget
        .max(engine::array::DEFAULT_STRIPE_CACHE_ENTRIES as u64)
        .min(shard_stripes);
    usize::try_from(entries).unwrap_or(usize::MAX)
}

/// The memory this process may use, bytes: the machine's physical memory
/// (`sysconf(_SC_PHYS_PAGES)`), or the cgroup v2 limit of the process
/// (`/sys/fs/cgroup/memory.max` of its cgroup) when that is lower. 4 GiB when neither can
/// be read.
fn machine_memory_bytes() -> u64 {
    // SAFETY: sysconf reads a configuration value; no memory is passed.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let phys = match (u64::try_from(pages), u64::try_from(page)) {
        (Ok(n), Ok(p)) if n > 0 && p > 0 => n.saturating_mul(p),
        _ => 4 << 30,
    };
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("0::").map(str::to_owned))
        })
        .and_then(|path| {
            std::fs::read_to_string(format!(
                "/sys/fs/cgroup{}/memory.max",
                path.trim_end_matches('/')
            ))
            .ok()
        })
        .and_then(|s| s.trim().parse::<u64>().ok());
    cgroup.map_or(phys, |c| c.min(phys))
}

/// `utime` for a superblock update: whole seconds, microseconds 0, as the kernel writes it
/// (see [`MdTime`]: md reads the whole field as seconds).
fn md_now() -> MdTime {
    let d = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    MdTime::new(d.as_secs(), 0)
}

/// What the target's threads (monitor, management) share about the running array.
struct Shared {
    name: String,
    geo: ArrayGeometry,
    assembly: Assembly,
    /// Device path of each role (`None`: missing); a replacement takes its role's entry.
    /// Shared with the iSCSI target's persistent-reservation store (it writes every member).
    paths: Arc<Mutex<Vec<Option<PathBuf>>>>,
    meta: Mutex<Meta>,
    /// How member devices are opened (for devices added while serving).
    member_cfg: MemberConfig,
    /// Start of every member's data area, bytes.
    data_offset_bytes: u64,
    /// Exclusive `flock`s on every device in the array (canonical path, lock; `None` for
    /// devices with no file to lock, vfio controllers), held while the target runs; a
    /// device leaving the array is released.
    locks: Mutex<Vec<(PathBuf, Option<Claim>)>>,
    /// The array needs a resync that has not finished yet (unclean shutdown).
    resync_pending: AtomicBool,
    /// When rebuild progress was last written to the superblocks.
    last_checkpoint: Mutex<std::time::Instant>,
    handle: ReactorHandle,
    cores: Vec<Option<usize>>,
    mode: Mode,
    /// The live servers and the reactors' front-end inboxes.
    exports: Mutex<exports::Exports>,
    /// Roles whose (faulty) device the operator removed.
    removed: Mutex<Vec<u16>>,
}

impl Shared {
    /// The live exports (lock held briefly: never while taking another of the target's
    /// locks).
    fn exports(&self) -> std::sync::MutexGuard<'_, exports::Exports> {
        self.exports
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Fails the member in `role` and records it faulty on the survivors' superblocks.
    fn fail_role(&self, role: u16) -> Result<()> {
        let mut m = self
            .meta
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // The old member of a replace whose swap is recorded is out already; failing the
        // role now would fail the replacement on the reactors that swapped, and the
        // record would name the replacement faulty.
        ensure!(
            !m.book.swap_recorded_for(role),
            "the member of slot {role} is being replaced and is already recorded out of the \
             array: its replacement is taking the slot (fail the replacement to fail the slot)"
        );
        self.handle.fail_member(role)?;
        if !m.recorded_failed.contains(&role) {
            m.record(&[role], None)?;
        }
        Ok(())
    }

    /// The device path of each role.
    fn paths(&self) -> Vec<Option<PathBuf>> {
        self.paths
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The device path serving `role`, if any.
    fn path_of(&self, role: u16) -> Option<PathBuf> {
        self.paths
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(usize::from(role))
            .cloned()
            .flatten()
    }

    fn events(&self) -> u64 {
        let m = self
            .meta
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        m.members
            .iter()
            .filter(|x| x.active)
            .map(|x| x.sb.events)
            .max()
            .unwrap_or(0)
    }

    /// The role a management request names: a slot number or a member's device path (as
    /// given, or canonicalised).
    fn role_of(&self, selector: &str) -> Option<u16> {
        let paths = self.paths();
        if let Some(slot) = crate::status::parse_slot(selector) {
            return (usize::from(slot) < paths.len()).then_some(slot);
        }
        let want = Path::new(selector);
        let canon = std::fs::canonicalize(want).ok();
        paths
            .iter()
            .position(|p| {
                p.as_deref().is_some_and(|p| {
                    p == want || canon.is_some() && std::fs::canonicalize(p).ok() == canon
                })
            })
            .map(|r| r as u16)
    }

    fn member_report(&self, snap: &engine::reactor::ArraySnapshot, role: u16) -> MemberReport {
        use crate::status::MemberState as S;
        let removed = self
            .removed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&role);
        let r = usize::from(role);
        let path = self.path_of(role);
        match (&path, removed) {
            (_, true) => MemberReport::idle(Some(role), None, S::Removed),
            (None, _) => MemberReport::idle(Some(role), None, S::Missing),
            (Some(p), _) => {
                MemberReport::from_snapshot(role, Some(p.display().to_string()), &snap.members[r])
            }
        }
    }

    fn status(&self) -> StatusReport {
        self.status_of(&self.handle.snapshot())
    }

    /// The status report of one snapshot of the reactors' statistics.
    fn status_of(&self, snap: &engine::reactor::ArraySnapshot) -> StatusReport {
        // The exports' figures first, and their lock let go before any other is taken.
        let (export_reports, nbd_stats, nvmf_report) = {
            let e = self.exports();
            (
                e.reports(),
                e.nbd.as_ref().map(|n| n.stats().into()),
                e.nvmf.as_ref().map(|t| t.stats_handle().report()),
            )
        };
        let g = self.geo.geometry();
        let working = snap
            .members
            .iter()
            .filter(|m| m.state == MemberState::Online)
            .count() as u16;
        StatusReport {
            array: ArrayInfo {
                name: self.name.clone(),
                array_uuid: self.assembly.uuid.to_string(),
                level: g.level().md_level() as u8,
                layout: g.layout().name().to_string(),
                chunk_bytes: u64::from(g.chunk_bytes()),
                raid_devices: g.members(),
                size_bytes: self.geo.capacity_bytes(),
                // Marked dirty while it serves (md's "active"); clean once stopped.
                state: ArrayState::derive(g.members(), g.parity_chunks(), working, false),
                events: self.events(),
                consistency_policy: if self.assembly.ppl.is_some() {
                    "ppl"
                } else if self.assembly.bitmap.is_some() {
                    "bitmap"
                } else {
                    "resync"
                }
                .to_string(),
            },
            members: (0..g.members())
                .flat_map(|r| {
                    std::iter::once(self.member_report(snap, r))
                        .chain(self.replacement_report(snap, r))
                })
                .chain(self.spare_paths().into_iter().map(|p| {
                    MemberReport::idle(
                        None,
                        Some(p.display().to_string()),
                        crate::status::MemberState::Spare,
                    )
                }))
                .collect(),
            reactors: ReactorsReport {
                count: self.cores.len(),
                cores: self.cores.clone(),
                mode: self.mode.into(),
                load: self
                    .handle
                    .reactor_loads()
                    .iter()
                    .map(ReactorLoadReport::from)
                    .collect(),
            },
            stats: StatsReport {
                zero_stripes: snap.zero_stripes,
                ..StatsReport::from(&snap.stats)
            },
            requests_in_flight: snap.requests_in_flight as u64,
            writes_awaiting_record: snap.writes_held as u64,
            exports: export_reports,
            process: self.process_report(),
            bitmap: self.bitmap_report(),
            queue_wait_us: QueueWaitReport::from_histograms_ns(&snap.queue_wait),
            nbd: nbd_stats,
            nvmf: nvmf_report,
        }
    }
}

/// The management socket's view of the target. The socket is bound first thing in
/// [`Target::start`] (a second target on the same socket is refused before anything is
/// touched); requests that arrive while the array is still being assembled wait for it.
struct TargetHandler(OnceLock<Arc<Shared>>);

impl TargetHandler {
    fn shared(&self) -> Result<&Arc<Shared>, RpcError> {
        crate::rpc::wait_started(&self.0)
    }
}

impl TargetHandler {
    /// The NVMe/TCP target's handle, or [`RpcError::no_nvmf`].
    fn nvmf(&self) -> Result<crate::nvmf::StatsHandle, RpcError> {
        self.shared()?
            .exports()
            .nvmf
            .as_ref()
            .map(crate::nvmf::NvmfServer::stats_handle)
            .ok_or_else(RpcError::no_nvmf)
    }
}

impl MetricsSource for TargetHandler {
    /// The one array this target serves, once assembled.
    fn scrape(&self) -> Option<Vec<Scrape>> {
        let s = self.0.get()?;
        let snapshot = s.handle.snapshot();
        Some(vec![Scrape {
            status: s.status_of(&snapshot),
            snapshot,
            reactor_loads: s.handle.reactor_loads(),
        }])
    }
}

impl Handler for TargetHandler {
    fn status(&self) -> StatusReport {
        match self.shared() {
            Ok(s) => s.status(),
            // A handler panic is answered as a JSON-RPC internal error.
            Err(e) => panic!("{}", e.message),
        }
    }

    fn member_fail(&self, sel: &str) -> Result<MemberReport, RpcError> {
        let s = self.shared()?;
        if let Some(report) = s.fail_replacement(sel) {
            return Ok(report);
        }
        let role = s
            .role_of(sel)
            .ok_or_else(|| RpcError::no_such_member(sel))?;
        let removed = s
            .removed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&role);
        if removed || s.path_of(role).is_none() {
            // Nothing is there to fail: the slot is empty (removed, or missing at start).
            return Err(RpcError::no_such_member(sel));
        }
        let snap = s.handle.snapshot();
        let g = s.geo.geometry();
        let state = snap.members[usize::from(role)].state;
        // A member being rebuilt adds no redundancy yet: failing it loses nothing.
        if state == MemberState::Online {
            let lost = snap
                .members
                .iter()
                .filter(|m| m.state != MemberState::Online)
                .count();
            if lost >= usize::from(g.parity_chunks()) {
                return Err(RpcError::array_would_fail(
                    sel,
                    format!(
                        "{lost} of {} members are already lost and RAID{} survives {}",
                        g.members(),
                        g.level().md_level(),
                        g.parity_chunks()
                    ),
                ));
            }
        }
        if s.meta().book.swap_recorded_for(role) {
            return Err(RpcError::process_refused(format!(
                "{sel} is being replaced and is already recorded out of the array: its \
                 replacement is taking slot {role} (fail the replacement to fail the slot)"
            )));
        }
        if !state.is_failed() {
            s.fail_role(role)
                .map_err(|e| RpcError::internal(crate::error_text(&e)))?;
        }
        // Every reactor takes the command within a loop turn; report what they publish.
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        loop {
            let snap = s.handle.snapshot();
            if snap.members[usize::from(role)].state.is_failed()
                || std::time::Instant::now() > deadline
            {
                return Ok(s.member_report(&snap, role));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn member_remove(&self, sel: &str) -> Result<MemberReport, RpcError> {
        let s = self.shared()?;
        if let Some(report) = s.remove_spare(sel)? {
            return Ok(report);
        }
        let role = s
            .role_of(sel)
            .ok_or_else(|| RpcError::no_such_member(sel))?;
        let snap = s.handle.snapshot();
        if s.path_of(role).is_some() && !snap.members[usize::from(role)].state.is_failed() {
            return Err(RpcError::member_not_faulty(sel));
        }
        {
            let mut r = s
                .removed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if !r.contains(&role) {
                r.push(role);
            }
        }
        Ok(s.member_report(&snap, role))
    }

    fn member_add(&self, path: &str) -> Result<MemberReport, RpcError> {
        RpcError::require_absolute(std::path::Path::new(path))?;
        self.shared()?.add_device(path)
    }

    fn member_replace(&self, old: &str, new: &str) -> Result<MemberReport, RpcError> {
        RpcError::require_absolute(std::path::Path::new(new))?;
        self.shared()?.replace(old, new)
    }

    fn process_start(&self, kind: ProcessKind) -> Result<ProcessReport, RpcError> {
        self.shared()?.process_start(kind)
    }

    fn process_stop(&self) -> Result<ProcessReport, RpcError> {
        self.shared()?.process_stop()
    }

    fn nvmf_portal_list(&self) -> Result<crate::nvmf::PortalListReport, RpcError> {
        Ok(self.nvmf()?.portal_list())
    }

    fn nvmf_portal_set_ana(
        &self,
        portal: &str,
        state: crate::nvmf::spec::AnaState,
    ) -> Result<crate::nvmf::PortalSetAnaReport, RpcError> {
        self.nvmf()?
            .portal_set_ana(portal, state)
            .map_err(|e| RpcError::portal(&e))
    }

    fn nvmf_portal_remove(
        &self,
        portal: &str,
    ) -> Result<crate::nvmf::PortalRemoveReport, RpcError> {
        self.nvmf()?
            .portal_remove(portal)
            .map_err(|e| RpcError::portal(&e))
    }

    fn export_add(&self, spec: &ExportSpec) -> Result<Vec<ExportReport>, RpcError> {
        self.shared()?
            .export_add(spec)
            .map_err(|e| RpcError::export(&e))
    }

    fn export_remove(&self, protocol: ExportProtocol) -> Result<ExportRemoveReport, RpcError> {
        self.shared()?
            .export_remove(protocol)
            .map_err(|e| RpcError::export(&e))
    }

    fn export_list(&self) -> Result<Vec<ExportReport>, RpcError> {
        Ok(self.shared()?.exports().reports())
    }

    fn nvmf_portal_add(
        &self,
        portal: &str,
        state: Option<crate::nvmf::spec::AnaState>,
    ) -> Result<crate::nvmf::PortalAddReport, RpcError> {
        self.nvmf()?
            .portal_add(portal, state)
            .map_err(|e| RpcError::portal(&e))
    }
}

/// A running array.
pub struct Target {
    shared: Arc<Shared>,
    reactors: Option<Reactors<TargetFrontend>>,
    rpc: Option<RpcServer>,
    metrics: Option<MetricsServer>,
    stop_monitor: Arc<AtomicBool>,
    monitor: Option<JoinHandle<()>>,
    /// The running write-intent bitmap, when the array has one.
    intent: Option<Arc<WriteIntent>>,
}

impl Target {
    /// Assembles the array from `opts.devices`, marks it active and starts serving it.
    ///
    /// # Errors
    /// A device that cannot be opened or read; an assembly refusal (named device and
    /// reason: another array's member, bad checksum, unsupported feature, too few members
    /// without `force`...); members with different data offsets; no usable cores; a socket
    /// that cannot be bound; a failed superblock write.
    pub fn start(opts: &ServeOptions) -> Result<Target> {
        Self::start_on(opts, None)
    }

    /// [`Target::start`] on the reactors of `set` when given (shared with the other
    /// arrays of the process, `crate::node`; `opts.cores`, `opts.reactors` and
    /// `opts.mode` are then the set's business, not read), else on reactors of its own.
    ///
    /// # Errors
    /// As [`Target::start`].
    pub fn start_on(opts: &ServeOptions, set: Option<&ReactorSet>) -> Result<Target> {
        Self::start_unless_named(opts, set, &|_| false)
    }

    /// [`Target::start_on`], refused when `taken(name)` says the array's name (the newest
    /// superblock's short name) is already served: checked right after the superblocks
    /// are read, before anything is written to a member or bound (a node's second array
    /// of one name could not be told apart by its exports or by the `array` parameter).
    ///
    /// # Errors
    /// As [`Target::start`]; a taken name.
    pub fn start_unless_named(
        opts: &ServeOptions,
        set: Option<&ReactorSet>,
        taken: &dyn Fn(&str) -> bool,
    ) -> Result<Target> {
        ensure!(!opts.devices.is_empty(), "no member devices given");
        match crate::nbd::raise_open_files_limit() {
            Ok(n) => info!(limit = n, "open files limit (RLIMIT_NOFILE soft = hard)"),
            Err(e) => warn!("cannot raise the open files limit: {e}"),
        }
        // The management socket first: a target already running on it is refused before
        // any device is opened or marked.
        let handler = Arc::new(TargetHandler(OnceLock::new()));
        let rpc = match &opts.rpc {
            Some(path) => Some(
                RpcServer::bind(path, Arc::clone(&handler) as Arc<dyn Handler>)
                    .with_context(|| format!("opening the management socket {}", path.display()))?,
            ),
            None => None,
        };
        // The metrics endpoint too: an address in use is refused before anything is
        // touched; scrapes before the array is up are answered 503.
        let metrics = match opts.metrics {
            Some(addr) => {
                let m = MetricsServer::bind(addr, Arc::clone(&handler) as Arc<dyn MetricsSource>)?;
                info!(address = %m.local_addr(), "metrics endpoint listening (GET /metrics)");
                Some(m)
            }
            None => None,
        };
        let mcfg = MemberConfig::with_queue_depth(opts.queue_depth);
        let mut opened: Vec<Option<AnyDevice>> = Vec::new();
        let mut candidates = Vec::new();
        // One device given twice (another path, a symlink, a hard link) would take two
        // roles; said so here, before the second claim calls it "in use".
        crate::create::check_distinct(&opts.devices)?;
        // Claim every device first: two targets writing the same members would corrupt them.
        let mut locks = Vec::with_capacity(opts.devices.len());
        for p in &opts.devices {
            let canon = std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
            locks.push((canon, claim(p)?));
        }
        for p in &opts.devices {
            let dev =
                open_member(p, &mcfg).with_context(|| format!("opening member {}", p.display()))?;
            candidates.push(
                metadata_io::read_candidate(p)
                    .with_context(|| format!("reading the superblock of {}", p.display()))?,
            );
            opened.push(Some(dev));
        }
        let block_bytes = opened
            .iter()
            .flatten()
            .map(|d| d.info().block_bytes)
            .max()
            .unwrap_or(512);
        let mut assembly = assemble(
            &candidates,
            AssembleOptions {
                force: opts.force,
                block_bytes,
            },
        )
        .context("assembling the array")?;
        if let Ok(newest) = &candidates[assembly.newest].superblock {
            let name = newest.short_name();
            ensure!(
                !taken(&name),
                "an array named {name:?} is already running: a second one could not be told \
                 apart (nothing was written to {})",
                opts.devices
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        // md's rule (`mdadm --assemble` without `--run`): a role whose member the newest
        // superblock still counts as active, but whose device was not given, is a device
        // forgotten on the command line or gone missing — starting without it would record
        // it faulty and degrade the array for good. Refuse unless forced; roles already
        // recorded faulty (a known degraded array) start as they are.
        if !opts.force && !opts.run {
            let newest = candidates[assembly.newest]
                .superblock
                .as_ref()
                .map_err(|e| anyhow::anyhow!("the newest superblock: {e}"))?;
            let returning = readd_plan(&assembly);
            let absent: Vec<u16> = assembly
                .missing_roles
                .iter()
                .copied()
                .filter(|&r| {
                    newest
                        .dev_roles
                        .iter()
                        .any(|&raw| DevRole::from_raw(raw) == DevRole::Active(r))
                        && !returning.iter().any(|x| x.0 == r)
                })
                .collect();
            if !absent.is_empty() {
                let excluded = if assembly.excluded.is_empty() {
                    String::new()
                } else {
                    format!(
                        " (not used: {})",
                        assembly
                            .excluded
                            .iter()
                            .map(|e| format!("{}: {}", e.device, e.reason))
                            .collect::<Vec<_>>()
                            .join("; ")
                    )
                };
                bail!(
                    "array {:?}: no device given for role(s) {absent:?}, which the array still \
                     counts as active{excluded}; name every member, or start degraded with \
                     --run (the absent members are then recorded faulty and need a rebuild \
                     to return; a dirty array needs --force too unless it has a PPL)",
                    newest.short_name()
                );
            }
        }
        for note in assembly.notes() {
            warn!("{note}");
        }
        let geo = assembly.array;
        let g = *geo.geometry();
        let offsets: Vec<u64> = assembly
            .members
            .iter()
            .flatten()
            .map(|m| m.data_offset_sectors)
            .collect();
        let data_offset_sectors = offsets[0];
        if offsets.iter().any(|&o| o != data_offset_sectors) {
            bail!(
                "members have different data offsets ({offsets:?} sectors): ferroraid serves \
                 arrays whose members share one data offset"
            );
        }
        let data_offset_bytes = data_offset_sectors * 512;
        let member_bytes = data_offset_bytes + geo.member_data_bytes();
        // Every device that takes a role must hold the data area its superblock gives (md
        // refuses a device smaller than data_size too): checked before anything is
        // written. Found only by the reactors, it was reported at stop, after the start
        // had said "started" and clients had hung on the array.
        let returning = readd_plan(&assembly);
        for (role, m) in assembly.members.iter().enumerate() {
            let c = match m {
                Some(m) => Some(m.candidate),
                None => returning
                    .iter()
                    .find(|r| usize::from(r.0) == role)
                    .map(|r| r.1),
            };
            let Some(dev) = c.and_then(|c| opened[c].as_ref().map(|d| (c, d))) else {
                continue;
            };
            let (c, dev) = dev;
            let info = dev.info();
            if let Err(e) = engine::array::device_fits(&geo, data_offset_bytes, role as u16, info) {
                let why = match e {
                    engine::process::ProcessError::Unfit { why, .. } => why,
                    _ => "it cannot serve the array",
                };
                bail!(
                    "{} (role {role}): {why} — {} bytes, and the superblock's data area ends \
                     at byte {member_bytes}; nothing was written (give the member's own \
                     device, or leave it out and rebuild onto one that fits)",
                    opts.devices[c].display(),
                    info.capacity_bytes
                );
            }
        }
        let mut devices = Vec::with_capacity(usize::from(g.members()));
        let mut paths = Vec::with_capacity(usize::from(g.members()));
        let mut metas = Vec::new();
        let mut failed = [None, None];
        let mut nfailed = 0;
        // Members only partly rebuilt (MD_FEATURE_RECOVERY_OFFSET): the rebuild resumes at
        // their recovery_offset, as md's does.
        let mut rebuilding = [None, None];
        let mut bitmap_recovery = [None, None];
        let mut resumed_roles = Vec::new();
        // The first generation's role and recovery changes (re-added members, finished or
        // abandoned replacements).
        let mut first = RoleChanges::default();
        let newest_sb = candidates[assembly.newest]
            .superblock
            .clone()
            .map_err(|e| anyhow::anyhow!("the newest superblock: {e}"))?;
        let readds = readd_plan(&assembly);
        let bitmap_current = assembly.bitmap.as_ref().is_some_and(|b| !b.stale);
        for (role, m) in assembly.members.iter().enumerate() {
            let readd = readds.iter().find(|r| usize::from(r.0) == role);
            match m {
                None if readd.is_some() => {
                    // md's re-add: the device that left this role comes back to it, rebuilt
                    // over the bitmap's dirty regions (or in full, as assembly decided).
                    let &(_, c, by_bitmap) = readd.expect("checked");
                    let by_bitmap = by_bitmap && bitmap_current;
                    let dev = opened[c].take().context("a device serves one role")?;
                    ensure!(
                        resumed_roles.len() < 2,
                        "more members being rebuilt than any RAID level survives"
                    );
                    rebuilding[resumed_roles.len()] = Some((role as u16, 0));
                    if by_bitmap {
                        bitmap_recovery[resumed_roles.len()] = Some(role as u16);
                    }
                    resumed_roles.push(role as u16);
                    let mut sb = candidates[c]
                        .superblock
                        .clone()
                        .context("a re-added device has a superblock")?;
                    let dev_number = sb.dev_number;
                    // Brought up to the newest generation (it missed some), as md's re-add
                    // writes it with the array's state.
                    sb.events = newest_sb.events;
                    sb.resync_offset = newest_sb.resync_offset;
                    sb.dev_roles.clone_from(&newest_sb.dev_roles);
                    first.roles.push((dev_number, role as u16));
                    first.recovery.push((dev_number, Some(0)));
                    first.features.push((
                        dev_number,
                        engine::metadata::Feature::RecoveryBitmap,
                        by_bitmap,
                    ));
                    first.features.push((
                        dev_number,
                        engine::metadata::Feature::Replacement,
                        false,
                    ));
                    info!(
                        role,
                        device = %opts.devices[c].display(),
                        recovery = if by_bitmap { "bitmap" } else { "full" },
                        "member re-added: it rejoins its role and is rebuilt"
                    );
                    devices.push(dev);
                    let path = opts.devices[c].clone();
                    metas.push(MemberMeta {
                        role: Some(role as u16),
                        path: path.clone(),
                        sb,
                        active: true,
                        spare: None,
                        replacement: false,
                    });
                    paths.push(Some(path));
                }
                Some(m) => {
                    if m.was_replacement {
                        first.features.push((
                            m.dev_number,
                            engine::metadata::Feature::Replacement,
                            false,
                        ));
                    }

                    let dev = opened[m.candidate]
                        .take()
                        .context("a device serves one role")?;
                    if let Some(sectors) = m.recovery_offset {
                        ensure!(
                            resumed_roles.len() < 2,
                            "more members being rebuilt than any RAID level survives"
                        );
                        let stripe = sectors.saturating_mul(512) / u64::from(g.chunk_bytes());
                        rebuilding[resumed_roles.len()] = Some((role as u16, stripe));
                        // A re-add in progress stays bitmap-based while the bitmap is
                        // current (MD_FEATURE_RECOVERY_BITMAP).
                        if m.bitmap_recovery && bitmap_current {
                            bitmap_recovery[resumed_roles.len()] = Some(role as u16);
                        }
                        resumed_roles.push(role as u16);
                        info!(
                            role,
                            device = %opts.devices[m.candidate].display(),
                            recovery_offset = sectors,
                            by_bitmap = m.bitmap_recovery && bitmap_current,
                            "member partly rebuilt: the rebuild resumes"
                        );
                    }
                    devices.push(dev);
                    let path = opts.devices[m.candidate].clone();
                    let sb = candidates[m.candidate]
                        .superblock
                        .clone()
                        .context("an assembled member has a superblock")?;
                    metas.push(MemberMeta {
                        role: Some(role as u16),
                        path: path.clone(),
                        sb,
                        active: true,
                        spare: None,
                        replacement: false,
                    });
                    paths.push(Some(path));
                }
                None => {
                    devices.push(AnyDevice::missing(
                        &format!("missing role {role}"),
                        member_bytes,
                        block_bytes,
                    ));
                    paths.push(None);
                    ensure!(
                        nfailed < 2,
                        "more roles missing than any RAID level survives"
                    );
                    failed[nfailed] = Some(role as u16);
                    nfailed += 1;
                }
            }
        }
        // Spares: kept open, to replace the next member that fails (or a missing one).
        for &c in &assembly.spares {
            let (Some(dev), Ok(sb)) = (opened[c].take(), candidates[c].superblock.clone()) else {
                continue;
            };
            info!(device = %opts.devices[c].display(), slot = sb.dev_number, "spare");
            metas.push(MemberMeta {
                role: None,
                path: opts.devices[c].clone(),
                sb,
                active: true,
                spare: Some(Arc::new(dev)),
                replacement: false,
            });
        }
        // Devices whose role another device serves now: they stand by as spares (md
        // hot-adds such a device as a new spare).
        for r in assembly.re_add.iter().filter(|r| {
            r.recovery == engine::metadata::Recovery::Full(FullRebuildReason::RoleTaken)
        }) {
            let (Some(dev), Ok(sb)) = (
                opened[r.candidate].take(),
                candidates[r.candidate].superblock.clone(),
            ) else {
                continue;
            };
            let dev_number = sb.dev_number;
            first
                .roles
                .push((dev_number, engine::metadata::DEV_ROLE_SPARE));
            first.recovery.push((dev_number, None));
            first
                .features
                .push((dev_number, engine::metadata::Feature::Replacement, false));
            let mut sb = sb;
            sb.events = newest_sb.events;
            sb.resync_offset = newest_sb.resync_offset;
            sb.dev_roles.clone_from(&newest_sb.dev_roles);
            info!(device = %r.device, "its role is served by another device: it becomes a spare");
            metas.push(MemberMeta {
                role: None,
                path: opts.devices[r.candidate].clone(),
                sb,
                active: true,
                spare: Some(Arc::new(dev)),
                replacement: false,
            });
        }
        // A replacement in progress resumes once the reactors run (one at a time; on a
        // degraded array md would give the device to the missing role first: it becomes a
        // spare, and the hot-spare logic does just that).
        let mut resume_replace: Option<(u16, usize, u64)> = None;
        for (k, rp) in assembly.replacements.iter().enumerate() {
            let (Some(dev), Ok(sb)) = (
                opened[rp.candidate].take(),
                candidates[rp.candidate].superblock.clone(),
            ) else {
                continue;
            };
            let keep = k == 0 && !assembly.degraded;
            if !keep {
                first
                    .roles
                    .push((rp.dev_number, engine::metadata::DEV_ROLE_SPARE));
                first.recovery.push((rp.dev_number, None));
                first
                    .features
                    .push((rp.dev_number, engine::metadata::Feature::Replacement, false));
                warn!(
                    device = %rp.device,
                    role = rp.role,
                    "replacement not resumed (the array is degraded, or another replace comes                      first): it becomes a spare"
                );
            } else {
                let sectors = rp.recovery_offset.min(geo.member_data_bytes() / 512);
                let stripe = sectors.saturating_mul(512) / u64::from(g.chunk_bytes());
                resume_replace = Some((rp.role, metas.len(), stripe));
                info!(
                    device = %rp.device,
                    role = rp.role,
                    recovery_offset = rp.recovery_offset,
                    "replacement in progress: the replace resumes"
                );
            }
            metas.push(MemberMeta {
                role: keep.then_some(rp.role),
                path: opts.devices[rp.candidate].clone(),
                sb,
                active: true,
                spare: Some(Arc::new(dev)),
                replacement: keep,
            });
        }
        let name = candidates[assembly.newest]
            .superblock
            .as_ref()
            .map(Superblock::short_name)
            .unwrap_or_default();
        // Members `force` brought in although out of date (or recorded faulty): as
        // `mdadm --assemble --force` does, bring their superblocks up to the newest
        // generation and give them back their roles in every member's `dev_roles`, so the
        // generations written from now on include them (assembly has said a resync is due).
        if let Ok(newest) = &candidates[assembly.newest].superblock {
            let forced: Vec<(usize, u16)> = assembly
                .members
                .iter()
                .enumerate()
                .filter_map(|(role, m)| {
                    m.as_ref()
                        .filter(|m| m.forced)
                        .map(|m| (m.dev_number as usize, role as u16))
                })
                .collect();
            for m in &mut metas {
                if forced
                    .iter()
                    .any(|&(slot, _)| slot == m.sb.dev_number as usize)
                {
                    m.sb.events = newest.events;
                    m.sb.resync_offset = newest.resync_offset;
                    m.sb.dev_roles.clone_from(&newest.dev_roles);
                }
                for &(slot, role) in &forced {
                    if let Some(r) = m.sb.dev_roles.get_mut(slot) {
                        *r = role;
                    }
                }
            }
        }
        // The Partial Parity Log: recovered (after an unclean shutdown) and re-initialised
        // before anything is written, as md's `raid5_run` → `ppl_init_log` does.
        let ppl = match assembly.ppl {
            None => None,
            Some(area) => Some(prepare_ppl(
                &geo,
                area,
                data_offset_bytes,
                assembly.uuid,
                &paths,
                &rebuilding,
                &mut assembly.resync_needed,
            )?),
        };
        let cores: Vec<Option<usize>> = match set {
            Some(set) => set.cores().to_vec(),
            None => reactor_cores(opts),
        };
        let n = cores.len();

        let role_paths = Arc::new(Mutex::new(paths));
        // Every export `opts` asks for, built as `export_add` builds one.
        let export_ctx = exports::ExportContext {
            name: name.clone(),
            geo,
            uuid: assembly.uuid,
            paths: Arc::clone(&role_paths),
            opts: opts.clone(),
            reactors: n,
        };
        let mut servers = Vec::new();
        let mut initial = Vec::new();
        for spec in exports::initial_specs(opts) {
            let (s, f) = exports::start_server(&export_ctx, &spec)?;
            servers.push(s);
            initial.push(f);
        }
        let (attacher, frontends) =
            Attacher::new(n, initial).context("attaching the front-ends")?;
        // Mark the array active before the first write can reach it — only once the sockets
        // are bound, so a start that fails on its address leaves the array as it was — and
        // record the roles that have no member faulty (as md does for a degraded start): a
        // device left out now misses every write from here on, and must never count as
        // current again, even if a crash leaves the others only one generation ahead of it.
        // The internal bitmap: read it whole from the device whose bitmap assembly chose, and
        // decide which regions a resync still needs (all of them when it is stale).
        let mut bitmap = match &assembly.bitmap {
            None => None,
            Some(ab) => {
                let path = &opts.devices[ab.source];
                let sb = candidates[ab.source]
                    .superblock
                    .as_ref()
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
                let b = metadata_io::read_bitmap(path, sb)
                    .with_context(|| format!("reading the bitmap of {}", path.display()))?;
                let needs = match (assembly.resync_needed, ab.stale) {
                    (false, _) => NeedsSync::None,
                    (true, false) => NeedsSync::OnDisk,
                    (true, true) => NeedsSync::All,
                };
                Some((b, needs))
            }
        };
        let mut meta = Meta {
            members: metas,
            recorded_failed: Vec::new(),
            unwritable: Vec::new(),
            book: lifecycle::ProcessBook::resuming(resumed_roles.clone()),
            bitmap: match &bitmap {
                None => BitmapSync::None,
                Some(_) => BitmapSync::Offline {
                    clear_stale: !assembly.resync_needed,
                },
            },
        };
        // While served the array is dirty on disk (md writes `resync_offset` 0 while it is
        // not in sync); where an owed resync resumes is kept in memory (the assembly).
        let still_missing: Vec<u16> = assembly
            .missing_roles
            .iter()
            .copied()
            .filter(|r| !resumed_roles.contains(r))
            .collect();
        let events = meta.record_with(&still_missing, Some(Resync::Dirty), first)?;
        let intent = match bitmap.take() {
            None => None,
            Some((mut b, needs)) => {
                // What the offline update just wrote.
                b.super_.events = b.super_.events.max(events);
                if !assembly.resync_needed {
                    b.super_.state &= !BITMAP_STATE_STALE;
                }
                let sb = &meta.members[0].sb;
                let start = bitmap_start_sector(sb).context("the array has a bitmap")? * 512;
                let i = WriteIntent::new(&b, start, &geo, needs)
                    .context("setting up the write-intent bitmap")?;
                info!(
                    regions = i.regions(),
                    chunk_bytes = i.chunk_bytes(),
                    dirty = i.dirty_on_disk(),
                    needed = ?needs,
                    "write-intent bitmap"
                );
                Some(Arc::new(i))
            }
        };
        info!(
            array = %name,
            level = g.level().md_level(),
            members = g.members(),
            chunk_bytes = g.chunk_bytes(),
            size_bytes = geo.capacity_bytes(),
            events,
            "array assembled and marked active"
        );

        // The replace to resume: its device goes to the reactors with the members, so the
        // replacement gets every write from the first one.
        let resumed = resume_replace.and_then(|(role, idx, stripe)| {
            meta.members[idx].spare.take().map(|device| ResumedReplace {
                role,
                idx,
                stripe,
                device,
            })
        });
        let array_cfg = ArrayConfig {
            requests: 1024,
            stripe_ops: opts.stripe_ops.max(1),
            data_offset_bytes,
            failed_members: failed,
            rebuilding,
            bitmap_recovery,
            io_timeout_ns: u64::try_from(opts.io_timeout.as_nanos()).unwrap_or(u64::MAX),
            depth: opts.depth,
            stripe_cache_entries: opts.stripe_cache_bytes.map_or_else(
                || default_stripe_cache_entries(&geo, n, machine_memory_bytes()),
                |b| {
                    usize::try_from(b / u64::from(geo.geometry().chunk_bytes()))
                        .unwrap_or(usize::MAX)
                },
            ),
            write_hold_ns: u64::try_from(opts.write_hold.as_nanos()).unwrap_or(u64::MAX),
            ..ArrayConfig::default()
        };
        info!(
            stripes_per_reactor = array_cfg.stripe_cache_entries.max(array_cfg.stripe_ops),
            mib = (array_cfg.stripe_cache_entries.max(array_cfg.stripe_ops) as u64
                * n as u64
                * u64::from(geo.geometry().members())
                * u64::from(geo.geometry().chunk_bytes()))
                >> 20,
            sized = if opts.stripe_cache_bytes.is_some() {
                "--stripe-cache"
            } else {
                "default"
            },
            "stripe cache"
        );
        let rcfg = ReactorConfig {
            cores: cores.clone(),
            mode: opts.mode,
            requests: 1024,
            foreign_reads: true,
        };
        // The operator's limits are the array's (md's, per member device); each reactor's
        // shard paces its own stripes, so each gets its share.
        let (pacer, limits, tolerance) = (
            opts.pacer,
            opts.speed_limits.per_shard(n),
            opts.pacer_tolerance,
        );
        let members = geo.geometry().members();
        let extras = Extras {
            pacer: move |_| pacer.build(limits, members, tolerance),
            bitmap: intent.clone(),
            ppl,
            replace: resumed.as_ref().map(|r| engine::reactor::ResumeReplace {
                member: r.role,
                device: Arc::clone(&r.device) as Arc<dyn std::any::Any + Send + Sync>,
                resume_stripe: r.stripe,
            }),
            // The superblocks record a replace's swap before the reactors make it
            // (lifecycle.rs, `tend_replace`).
            confirm_replace: true,
            // Writes completed while a member failure is unrecorded wait for the monitor
            // to record it (`monitor`): a crash before the record would reassemble with
            // the failed member, stale, as current.
            confirm_failures: true,
        };
        let devices = Arc::new(devices);
        let started = match set {
            Some(set) => Reactors::start_on(
                set,
                devices,
                geo,
                Parity::new(),
                array_cfg,
                &rcfg,
                frontends,
                extras,
            ),
            None => Reactors::start_with(
                devices,
                geo,
                Parity::new(),
                array_cfg,
                rcfg,
                frontends,
                extras,
            ),
        };
        if let (Ok(_), Some(r)) = (&started, &resumed) {
            let m = &meta.members[r.idx];
            let chunk_sectors = u64::from(g.chunk_sectors());
            meta.book.replacing = Some(lifecycle::ReplaceBook {
                role: r.role,
                serial: engine::reactor::RESUMED_REPLACE_SERIAL,
                dev_number: m.sb.dev_number,
                path: m.path.clone(),
                checkpoint: r.stripe * chunk_sectors,
                error_at_start: None,
                swap_recorded: None,
            });
        }
        if let (Ok(_), Some(i)) = (&started, &intent) {
            meta.bitmap = BitmapSync::Online(Arc::clone(i));
        }
        if started.is_err() && !assembly.resync_needed {
            // Nothing was written: leave the array clean, as it was found.
            if let Err(e) = meta.record(&[], Some(Resync::Clean)) {
                warn!("marking the array clean again: {}", crate::error_text(&e));
            }
        }
        let reactors = started.context("starting the reactors")?;
        let handle = reactors.handle();
        let resync_pending = AtomicBool::new(assembly.resync_needed);
        let shared = Arc::new(Shared {
            name,
            geo,
            assembly,
            paths: role_paths,
            meta: Mutex::new(meta),
            member_cfg: mcfg,
            data_offset_bytes,
            locks: Mutex::new(locks),
            resync_pending,
            last_checkpoint: Mutex::new(std::time::Instant::now()),
            handle,
            cores,
            mode: opts.mode,
            exports: Mutex::new(exports::Exports::new(export_ctx, attacher, servers)),
            removed: Mutex::new(Vec::new()),
        });
        let stop_monitor = Arc::new(AtomicBool::new(false));
        let monitor = {
            let (shared, stop) = (Arc::clone(&shared), Arc::clone(&stop_monitor));
            std::thread::Builder::new()
                .name("member-monitor".into())
                .spawn(move || monitor(&shared, &stop))
                .context("starting the member monitor")?
        };
        // Woken by the reactors' failures; registered here, before anything can wait on it.
        let thread = monitor.thread().clone();
        let watching = shared.handle.watch_failures(move || thread.unpark());
        debug_assert!(watching, "one monitor per array's reactors");
        let mut target = Target {
            intent: intent.clone(),
            shared: Arc::clone(&shared),
            reactors: Some(reactors),
            rpc: None,
            metrics,
            stop_monitor,
            monitor: Some(monitor),
        };
        if let Some(path) = &opts.rpc {
            info!(socket = %path.display(), "JSON-RPC management socket listening");
        }
        let _ = handler.0.set(shared);
        target.rpc = rpc;
        Ok(target)
    }

    /// The array's write-intent bitmap while it runs (`None` without one): what a resync
    /// reads to touch only the regions left dirty by an unclean shutdown
    /// ([`WriteIntent::dirty_regions`], in stripes; [`WriteIntent::chunk_stripes`]) and
    /// reports back with [`WriteIntent::sync_done`].
    pub fn write_intent(&self) -> Option<&Arc<WriteIntent>> {
        self.intent.as_ref()
    }

    /// A JSON-RPC handler for this array (what the management socket of a process
    /// serving several arrays routes a request naming it to, `crate::node`).
    pub fn handler(&self) -> Arc<dyn Handler> {
        Arc::new(TargetHandler(OnceLock::from(Arc::clone(&self.shared))))
    }

    /// The array's figures for the metrics endpoint now.
    pub fn scrape(&self) -> Option<Scrape> {
        TargetHandler(OnceLock::from(Arc::clone(&self.shared)))
            .scrape()
            .and_then(|mut v| v.pop())
    }

    /// The array's (short) name: the NBD export name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The array's geometry.
    pub fn geometry(&self) -> &ArrayGeometry {
        &self.shared.geo
    }

    /// What assembly decided.
    pub fn assembly(&self) -> &Assembly {
        &self.shared.assembly
    }

    /// The device serving each role (`None`: missing).
    pub fn member_paths(&self) -> Vec<Option<PathBuf>> {
        self.shared.paths()
    }

    /// Management handle of the reactors.
    pub fn handle(&self) -> &ReactorHandle {
        &self.shared.handle
    }

    /// NBD TCP addresses actually bound (empty: NBD not exported now).
    pub fn nbd_tcp_addrs(&self) -> Vec<SocketAddr> {
        let e = self.shared.exports();
        e.nbd
            .as_ref()
            .map(|n| n.tcp_addrs().to_vec())
            .unwrap_or_default()
    }

    /// iSCSI addresses actually bound (empty: iSCSI not exported now).
    pub fn iscsi_addrs(&self) -> Vec<SocketAddr> {
        let e = self.shared.exports();
        e.iscsi
            .as_ref()
            .map(|i| i.addrs().to_vec())
            .unwrap_or_default()
    }

    /// NBD Unix socket paths (empty: NBD not exported now).
    pub fn nbd_unix_paths(&self) -> Vec<PathBuf> {
        let e = self.shared.exports();
        e.nbd
            .as_ref()
            .map(|n| n.unix_paths().to_vec())
            .unwrap_or_default()
    }

    /// Starts an export while the array serves: the server is built as [`Target::start`]
    /// builds it from [`ServeOptions`] (same settings), its listeners bound, and its
    /// per-reactor front-ends handed to the running reactors, which serve it from their
    /// next turn. Returns its listen addresses (bound ports) and name. Callable from any
    /// thread while serving.
    ///
    /// # Errors
    /// [`ExportError::BadSpec`] (no address, a duplicate, a name for iSCSI/NVMe/TCP);
    /// [`ExportError::Exists`] when the protocol is exported (one server per protocol per
    /// array); [`ExportError::Draining`] while its previous server still drains;
    /// [`ExportError::Start`] (cannot bind); [`ExportError::Stopping`].
    pub fn export_add(&self, spec: &ExportSpec) -> Result<Vec<ExportReport>, ExportError> {
        self.shared.export_add(spec)
    }

    /// Removes the export of `protocol`: its listeners stop (the ports refuse), every
    /// connection finishes the requests it accepted, sends their replies and closes; waits
    /// up to [`exports::DRAIN_WAIT`] (5 s) for the reactors to let the front-ends go,
    /// after which the protocol can be added again. Callable from any thread.
    ///
    /// # Errors
    /// [`ExportError::NotExported`]; [`ExportError::Stopping`].
    pub fn export_remove(
        &self,
        protocol: ExportProtocol,
    ) -> Result<ExportRemoveReport, ExportError> {
        self.shared.export_remove(protocol)
    }

    /// The live exports: every listen address of every protocol, with its export name.
    pub fn exports(&self) -> Vec<ExportReport> {
        self.shared.exports().reports()
    }

    /// The status report (what `ferroraid status` shows).
    pub fn status(&self) -> StatusReport {
        self.shared.status()
    }

    /// Current `events` of the array (the newest superblock written).
    pub fn events(&self) -> u64 {
        self.shared.events()
    }

    /// Fails the member in `role` (operator request) and records it faulty on the
    /// survivors' superblocks before returning.
    ///
    /// # Errors
    /// No such role; the superblock update failed.
    pub fn fail_role(&self, role: u16) -> Result<()> {
        self.shared.fail_role(role)
    }

    /// Stops serving: no new connections, in-flight requests drained and answered, the
    /// reactors stopped, every member flushed, the array marked clean.
    ///
    /// # Errors
    /// A reactor setup error surfacing at stop, a flush or superblock write that failed.
    pub fn stop(self) -> Result<()> {
        self.stop_clean().map(drop)
    }

    /// [`Target::stop`], saying whether the array was marked clean (`false`: a resync or
    /// rebuild was owed at the stop and resumes at the next start).
    ///
    /// # Errors
    /// As [`Target::stop`].
    pub fn stop_clean(mut self) -> Result<bool> {
        if let Some(mut rpc) = self.rpc.take() {
            rpc.shutdown();
        }
        if let Some(mut m) = self.metrics.take() {
            m.shutdown();
        }
        // Every live export: listeners stop, connections drain; no export is added after.
        self.shared.exports().shut_all();
        // Where a rebuild or resync got to, before the reactors go.
        let resync_owed = self.shared.checkpoint_at_stop();
        if let Some(r) = self.reactors.take() {
            r.stop().context("stopping the reactors")?;
        }
        self.stop_monitor.store(true, Ordering::Release);
        if let Some(m) = self.monitor.take() {
            m.thread().unpark();
            let _ = m.join();
        }
        // Record any failure the monitor had not yet written, then flush and mark clean.
        let snap = self.shared.handle.snapshot();
        let mut meta = self
            .shared
            .meta
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !matches!(meta.bitmap, BitmapSync::None) {
            // The owner reactor is gone: its last bitmap write completed before it stopped.
            meta.bitmap = BitmapSync::Offline { clear_stale: false };
        }
        let newly: Vec<u16> = failed_roles(&snap, &meta);
        for m in meta.members.iter().filter(|m| m.active) {
            if m.role.is_some_and(|r| newly.contains(&r)) {
                continue;
            }
            flush(&m.path)?;
        }
        let resync = match resync_owed {
            None => Resync::Clean,
            Some(at) => Resync::At(at),
        };
        let events = meta.record(&newly, Some(resync))?;
        info!(
            array = %self.shared.name,
            events,
            resync_offset = resync.offset(),
            clean = resync == Resync::Clean,
            "array stopped"
        );
        Ok(resync == Resync::Clean)
    }
}

/// The reactors' cores for `opts`: `opts.cores` as given, else `opts.reactors` cores
/// chosen by `drivers::topology::choose_cores` near the first member's NUMA node
/// (unpinned when the topology cannot be read).
pub fn reactor_cores(opts: &ServeOptions) -> Vec<Option<usize>> {
    if opts.cores.is_empty() {
        let node = opts
            .devices
            .first()
            .and_then(|p| drivers::topology::device_numa_node(p));
        match drivers::topology::choose_cores(opts.reactors.max(1), node) {
            Ok(choice) => {
                let near = match node {
                    Some(n) => format!("NUMA node {n} first"),
                    None => "the members' NUMA node unknown".to_string(),
                };
                info!(
                    "reactor cores {:?} chosen by {} topology (one hardware thread per physical core, {near})",
                    choice.cores, choice.method
                );
                choice.cores.into_iter().map(Some).collect()
            }
            Err(e) => {
                warn!("{e}; running {} unpinned reactors", opts.reactors.max(1));
                vec![None; opts.reactors.max(1)]
            }
        }
    } else {
        info!("reactor cores {:?} as given (--cores)", opts.cores);
        opts.cores.iter().copied().map(Some).collect()
    }
}

/// A replace found in progress at assembly, resumed by the reactors from the start.
struct ResumedReplace {
    role: u16,
    /// Its entry in the target's [`Meta::members`].
    idx: usize,
    stripe: u64,
    device: Arc<AnyDevice>,
}

/// The devices assembly found returning to a role that no device serves now (md's re-add
/// decision, [`Assembly::re_add`]): `(role, candidate, by bitmap)`, one per role.
fn readd_plan(assembly: &Assembly) -> Vec<(u16, usize, bool)> {
    let mut out: Vec<(u16, usize, bool)> = Vec::new();
    for r in &assembly.re_add {
        let taken = assembly
            .members
            .get(usize::from(r.role))
            .is_none_or(Option::is_some);
        if taken
            || r.recovery == engine::metadata::Recovery::Full(FullRebuildReason::RoleTaken)
            || out.iter().any(|x| x.0 == r.role)
        {
            continue;
        }
        out.push((
            r.role,
            r.candidate,
            r.recovery == engine::metadata::Recovery::Bitmap,
        ));
    }
    out
}

/// Roles the reactors failed whose failure the superblocks do not hold yet while they still
/// name an active device in the role: a crash now would reassemble with that device as
/// current, stale. A spare being promoted into a failed role (`swapping`) is recorded in
/// it already, to be rebuilt.
fn unrecorded_roles<'a>(
    snap: &'a engine::reactor::ArraySnapshot,
    meta: &'a Meta,
) -> impl Iterator<Item = u16> + 'a {
    snap.members
        .iter()
        .enumerate()
        .filter(|(r, m)| {
            m.state.is_failed()
                && !meta.recorded_failed.contains(&(*r as u16))
                && !meta.book.swapping.contains(&(*r as u16))
                && meta
                    .members
                    .iter()
                    .any(|x| x.role == Some(*r as u16) && x.active)
        })
        .map(|(r, _)| r as u16)
}

/// The [`unrecorded_roles`] to record faulty now. Not the slot of a replace whose swap is
/// recorded: its old member is recorded out already and the swap makes the slot whole (a
/// replacement failing after it fails the slot, recorded once the replace ends).
fn failed_roles(snap: &engine::reactor::ArraySnapshot, meta: &Meta) -> Vec<u16> {
    unrecorded_roles(snap, meta)
        .filter(|&r| !meta.book.swap_recorded_for(r))
        .collect()
}

/// Records members the reactors failed as faulty on the survivors' superblocks, tends the
/// background processes (hot spares, rebuild checkpoints, a replace, an owed resync), then
/// lets the reactors complete the writes they held meanwhile ([`Extras::confirm_failures`])
/// once no failed member or replacement is left unrecorded. A record that fails keeps the
/// writes held; it is tried again every turn (md retries its superblock update the same
/// way while `MD_SB_CHANGE_PENDING` holds writes).
///
/// Besides its turn every [`MONITOR_INTERVAL`], a reactor that publishes a new failure or
/// starts holding writes for one wakes it ([`ReactorHandle::watch_failures`], registered
/// by its spawner), so a failure is recorded, and its held writes released, without
/// waiting out the interval.
fn monitor(shared: &Shared, stop: &AtomicBool) {
    // A record that keeps failing is retried every turn, reported once per interval.
    let mut failing_record = Repeating::new(RECORD_FAILURE_REPORT_INTERVAL);
    while !stop.load(Ordering::Acquire) {
        std::thread::park_timeout(MONITOR_INTERVAL);
        let mut m = shared.meta();
        // Before the snapshot: every failure they count is failed in it.
        let marks = shared.handle.failure_marks();
        let snap = shared.handle.snapshot();
        let newly = failed_roles(&snap, &m);
        let mut recorded = true;
        if !newly.is_empty() {
            let due = failing_record.due(Instant::now());
            if due.is_some() {
                for r in &newly {
                    warn!(role = r, state = ?snap.members[usize::from(*r)].state, "member failed; recording it faulty");
                }
            }
            match m.record(&newly, None) {
                Ok(_) => failing_record.reset(),
                Err(e) => {
                    recorded = false;
                    if let Some(left_out) = due {
                        warn!(
                            left_out,
                            "recording failed members (writes wait until it is recorded; \
                             retried every {} ms, reported every {} s): {}",
                            MONITOR_INTERVAL.as_millis(),
                            RECORD_FAILURE_REPORT_INTERVAL.as_secs(),
                            crate::error_text(&e)
                        );
                    }
                }
            }
        }
        // A member whose superblock could not be written is recorded faulty; the reactors
        // stop using it too (md fails a member whose superblock write fails).
        for r in std::mem::take(&mut m.unwritable) {
            warn!(
                role = r,
                "the member's superblock could not be written: it is recorded faulty and failed"
            );
            match m.book.recorded_swap(r) {
                // The slot is the replacement's: failed on every reactor, swapped or not
                // (failing the role would fail the old member where it is not swapped yet).
                Some(b) => shared.handle.fail_replacement(b.serial),
                None => {
                    if let Err(e) = shared.handle.fail_member(r) {
                        warn!(role = r, "failing the member: {e}");
                    }
                }
            }
        }
        shared.tend_processes(&mut m, &snap);
        if recorded
            && unrecorded_roles(&snap, &m).next().is_none()
            && !m.book.replacement_failure_unrecorded(&snap)
        {
            shared.handle.failures_recorded(&marks);
        }
    }
}

/// How often [`monitor`] reports again a record of failed members that keeps failing (it
/// retries every [`MONITOR_INTERVAL`]; with no superblock writable that is for good).
const RECORD_FAILURE_REPORT_INTERVAL: Duration = Duration::from_secs(10);

/// A condition seen on every monitor turn, reported at its first turn and then at most
/// once per interval, with the count of turns left out since the last report.
#[derive(Debug)]
struct Repeating {
    every: Duration,
    last: Option<Instant>,
    left_out: u64,
}

impl Repeating {
    fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            left_out: 0,
        }
    }

    /// The condition holds at `now`: `Some(turns left out since the last report)` when it
    /// is to be reported now, else `None` (counted).
    fn due(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(t) if now.saturating_duration_since(t) < self.every => {
                self.left_out += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.left_out))
            }
        }
    }

    /// The condition ended: its next occurrence is reported at once.
    fn reset(&mut self) {
        self.last = None;
        self.left_out = 0;
    }
}

/// What holds a member device for one array while it is served ([`claim`]): every file
/// kept open with its lock; dropped, they are released.
#[derive(Debug)]
pub struct Claim {
    _held: Vec<File>,
}

/// Takes an exclusive advisory lock (`flock(LOCK_EX | LOCK_NB)`) on a member device, held as
/// long as the returned [`Claim`] lives: a second array (in this process or another
/// `ferroraid`, or a `create`) on the same device is refused instead of corrupting it. A
/// block device is also opened `O_EXCL` (the kernel's claim: refused while it, a partition
/// or its whole disk is mounted or claimed, as md's members are), and a loop device's
/// backing file is locked too (the file may be another array's member).
///
/// # Errors
/// The device cannot be opened, another array or process holds a lock on it or its
/// backing file, or the kernel refuses the exclusive open (`EBUSY`).
///
/// A vfio member (`vfio:BDF`) has no file to lock: VFIO itself lets one process at a time
/// open its IOMMU group, so a second target is refused when it opens the device; `None`.
pub fn claim(path: &Path) -> Result<Option<Claim>> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
    if drivers::any::is_vfio_spec(path) {
        return Ok(None);
    }
    let lock = |p: &Path, what: &str| -> Result<File> {
        let f = File::open(p).with_context(|| format!("opening {}", p.display()))?;
        // SAFETY: flock takes a file descriptor we own and plain flags.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                bail!(
                    "{} is in use{what}: another array or ferroraid process holds its lock",
                    path.display()
                );
            }
            return Err(e).with_context(|| format!("locking {}", p.display()));
        }
        Ok(f)
    };
    let mut held = vec![lock(path, "")?];
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if meta.file_type().is_block_device() {
        // The kernel's own exclusive claim (what md and mkfs take): refused while the
        // device, a partition of it or its whole disk is mounted or claimed — aliases a
        // lock on the path cannot see.
        let excl = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_EXCL)
            .open(path)
            .map_err(|e| {
                if e.raw_os_error() == Some(libc::EBUSY) {
                    anyhow::anyhow!(
                        "{} is in use: the kernel says it (or a partition or whole disk of it) \
                         is mounted or held exclusively",
                        path.display()
                    )
                } else {
                    anyhow::Error::new(e).context(format!("opening {} exclusively", path.display()))
                }
            })?;
        held.push(excl);
        // A loop device serves a file: that file may be another array's member.
        let rdev = meta.rdev();
        let (major, minor) = (libc::major(rdev), libc::minor(rdev));
        let backing = format!("/sys/dev/block/{major}:{minor}/loop/backing_file");
        if let Ok(b) = std::fs::read_to_string(&backing) {
            let file = PathBuf::from(b.trim_end());
            if file.exists() {
                held.push(lock(
                    &file,
                    &format!(" (its backing file {})", file.display()),
                )?);
            }
        }
    }
    Ok(Some(Claim { _held: held }))
}

/// Makes everything written to `path` durable (`fdatasync`).
fn flush(path: &Path) -> Result<()> {
    if metadata_io::uses_back_end(path) {
        return metadata_io::flush_member(path)
            .with_context(|| format!("flushing {}", path.display()));
    }
    File::options()
        .write(true)
        .open(path)
        .and_then(|f| f.sync_data())
        .with_context(|| format!("flushing {}", path.display()))
}

/// The PPL at assembly: after an unclean shutdown (`*resync_needed`), md's recovery from
/// the newest record of every present member's log ([`engine::ppl::recover`]); when it
/// finds no mismatch the array is consistent and owes no resync (`*resync_needed` cleared,
/// md's `ppl_init_log`). Then every present member's area is re-initialised
/// ([`engine::ppl::reinit_areas`]) and the shared log state is returned for the reactors.
/// Members being rebuilt (`rebuilding`) count as missing: their data is not current.
///
/// # Errors
/// A member that cannot be opened or read or written (md fails it and recovers nothing
/// from it; here the start stops, naming it).
fn prepare_ppl(
    geo: &ArrayGeometry,
    area: engine::metadata::ppl::PplArea,
    data_offset_bytes: u64,
    uuid: engine::metadata::Uuid,
    paths: &[Option<PathBuf>],
    rebuilding: &[Option<(u16, u64)>; 2],
    resync_needed: &mut bool,
) -> Result<Arc<engine::ppl::PplShared>> {
    use drivers::ppl_io::PplFiles;
    use engine::ppl::{recover, reinit_areas, PplLayout, PplShared};
    let members = usize::from(geo.geometry().members());
    if members > usize::from(engine::ppl::MAX_PPL_MEMBERS) {
        anyhow::bail!(
            "the array has {members} members and a partial parity log: a PPL supports at \
             most {} (md's limit, raid5-ppl.c ppl_init_log); switch it to the resync \
             policy (ferroraid grow --consistency-policy resync)",
            engine::ppl::MAX_PPL_MEMBERS
        );
    }
    let present: Vec<bool> = (0..members)
        .map(|r| {
            paths.get(r).is_some_and(Option::is_some)
                && !rebuilding
                    .iter()
                    .flatten()
                    .any(|&(role, _)| usize::from(role) == r)
        })
        .collect();
    let open: Vec<Option<PathBuf>> = (0..members)
        .map(|r| present[r].then(|| paths[r].clone()).flatten())
        .collect();
    let layout = PplLayout {
        area_offset_bytes: area.start_sector * 512,
        area_bytes: area.usable_sectors * 512,
        data_offset_bytes,
    };
    let mut files = PplFiles::open(&open).context("opening the members for the PPL")?;
    let described = |files: &PplFiles, e: engine::ppl::RecoverError| match files.first_error() {
        Some(d) => anyhow::anyhow!("{e}: {d}"),
        None => anyhow::anyhow!("{e}"),
    };
    if *resync_needed {
        let t = std::time::Instant::now();
        let rep = recover(geo, &layout, &uuid, &present, &mut files)
            .map_err(|e| described(&files, e))
            .context("PPL recovery")?;
        info!(
            logs = rep.logs,
            records = rep.records,
            entries = rep.entries,
            rows_repaired = rep.rows_repaired,
            rows_skipped = rep.rows_skipped,
            stripes_skipped = rep.stripes_skipped,
            entries_paired = rep.entries_paired,
            entries_settled = rep.entries_settled,
            rows_unrecoverable = rep.rows_unrecoverable,
            mismatches = rep.mismatches,
            elapsed_ms = t.elapsed().as_millis() as u64,
            "PPL recovery after an unclean shutdown"
        );
        if rep.stripes_skipped > 0 {
            warn!(
                stripes = rep.stripes_skipped,
                "PPL recovery skipped rows whose written member is missing: the region being \
                 written there at the crash reads back as the other members reconstruct it"
            );
        }
        if rep.clean() {
            *resync_needed = false;
            info!("PPL recovery made every logged stripe consistent: no resync needed");
        } else {
            warn!(
                mismatches = rep.mismatches,
                "PPL recovery found logs or entries it could not trust: the array stays \
                 dirty and is resynced (where every member is present)"
            );
        }
    }
    reinit_areas(&layout, &uuid, &present, &mut files)
        .map_err(|e| described(&files, e))
        .context("re-initialising the PPL areas")?;
    Ok(Arc::new(PplShared::new(
        members,
        layout.area_offset_bytes,
        layout.area_bytes,
        engine::metadata::ppl::signature(&uuid),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::geometry::{Geometry, Layout, Level};

    #[test]
    fn a_repeated_condition_is_reported_once_per_interval_with_what_was_left_out() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut r = Repeating::new(Duration::from_secs(10));
        assert_eq!(r.due(t0), Some(0), "the first turn is reported");
        assert_eq!(r.due(t0 + s), None);
        assert_eq!(r.due(t0 + 9 * s), None);
        assert_eq!(
            r.due(t0 + 10 * s),
            Some(2),
            "ten seconds on, with the two left out"
        );
        assert_eq!(r.due(t0 + 11 * s), None);
        r.reset();
        assert_eq!(
            r.due(t0 + 12 * s),
            Some(0),
            "a new episode is reported at once"
        );
    }

    fn raid6(member_bytes: u64) -> ArrayGeometry {
        let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 6, 65536, 512).unwrap();
        ArrayGeometry::new(g, member_bytes / 65536).unwrap()
    }

    /// The default cache holds the whole shard where memory allows, is bounded by 1/64 of
    /// memory and 1 GiB over all reactors, and keeps the former 64 stripes as a floor.
    #[test]
    fn the_default_stripe_cache_follows_the_array_and_the_memory() {
        const GIB: u64 = 1 << 30;
        let entry: u64 = 6 * 65536;
        // 6 × 64 MiB members: every stripe (1024), on 24 GiB; two reactors, half each.
        assert_eq!(
            default_stripe_cache_entries(&raid6(64 << 20), 1, 24 * GIB),
            1024
        );
        assert_eq!(
            default_stripe_cache_entries(&raid6(64 << 20), 2, 24 * GIB),
            512
        );
        // The demo's array (6 × 256 MiB, 4096 stripes): 1/64 of 24 GiB = 384 MiB.
        assert_eq!(
            default_stripe_cache_entries(&raid6(256 << 20), 1, 24 * GIB) as u64,
            (384 << 20) / entry
        );
        // At most 1 GiB for the array, whatever the memory, split over the reactors.
        assert_eq!(
            default_stripe_cache_entries(&raid6(64 * GIB), 4, 256 * GIB) as u64,
            GIB / 4 / entry
        );
        // A small machine: never below the former default.
        assert_eq!(default_stripe_cache_entries(&raid6(64 * GIB), 1, GIB), 64);
        // A small array: its stripes.
        assert_eq!(
            default_stripe_cache_entries(&raid6(9 << 20), 1, 24 * GIB),
            144
        );
        assert!(machine_memory_bytes() > 0);
    }
}
