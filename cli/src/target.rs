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
use std::time::{Duration, SystemTime};

use anyhow::{bail, ensure, Context, Result};
use drivers::any::AnyDevice;
use drivers::metadata_io;
use drivers::uring::{UringConfig, UringDevice};
use engine::array::{ArrayConfig, MemberState};
use engine::device::BlockDevice;
use engine::geometry::ArrayGeometry;
use engine::metadata::{
    assemble, next_generation, AssembleOptions, Assembly, DevRole, MdTime, Resync, Superblock,
    Update, MAX_SECTOR,
};
use engine::parity::Parity;
use engine::reactor::{Mode, ReactorConfig, ReactorHandle, Reactors};
use tracing::{info, warn};

use crate::frontends::TargetFrontend;
use crate::iscsi::{IscsiConfig, IscsiServer};
use crate::nbd::{ExportConfig, NbdServer, DEFAULT_MAX_BLOCK_BYTES};
use crate::rpc::{Handler, RpcError, RpcServer};
use crate::status::{
    ArrayInfo, ArrayState, ExportProtocol, ExportReport, MemberReport, ProcessReport,
    ReactorsReport, StatsReport, StatusReport,
};

/// How often the monitor looks for newly failed members, to record them on disk.
const MONITOR_INTERVAL: Duration = Duration::from_millis(50);

/// What `ferroraid serve` runs.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// Member devices (files or block devices), any order.
    pub devices: Vec<PathBuf>,
    /// CPU cores of the reactors (one reactor each). Empty: `reactors` reactors on cores
    /// chosen with hwloc (one per physical core, the members' NUMA node first).
    pub cores: Vec<usize>,
    /// Reactors when `cores` is empty (at least 1).
    pub reactors: usize,
    /// Idle behaviour of the reactors.
    pub mode: Mode,
    /// NBD listening TCP addresses.
    pub nbd_tcp: Vec<SocketAddr>,
    /// NBD listening Unix socket paths.
    pub nbd_unix: Vec<PathBuf>,
    /// Largest NBD request, bytes.
    pub max_block_bytes: u32,
    /// Start although members are missing or out of date (mdadm `--force`).
    pub force: bool,
    /// Command timeout of member requests.
    pub io_timeout: Duration,
    /// Requests in flight per reactor per member (io_uring queue depth).
    pub queue_depth: u32,
    /// Stripe operations per reactor (each holds one chunk per member).
    pub stripe_ops: usize,
    /// JSON-RPC management socket, if any.
    pub rpc: Option<PathBuf>,
    /// iSCSI listening addresses (empty: no iSCSI target). The target is
    /// `iqn.2026-11.org.ferroraid:<array name>`, LUN 0.
    pub iscsi: Vec<SocketAddr>,
    /// iSCSI tunables and CHAP secrets.
    pub iscsi_config: IscsiConfig,
}

impl ServeOptions {
    /// Defaults for `devices`: one reactor, polled, NBD on 127.0.0.1:10809, 4 MiB
    /// requests, no force, 30 s command timeout, queue depth 128, 64 stripe operations.
    pub fn new(devices: Vec<PathBuf>) -> Self {
        Self {
            devices,
            cores: Vec::new(),
            reactors: 1,
            mode: Mode::Polled,
            nbd_tcp: Vec::new(),
            nbd_unix: Vec::new(),
            max_block_bytes: DEFAULT_MAX_BLOCK_BYTES,
            force: false,
            io_timeout: Duration::from_secs(30),
            queue_depth: 128,
            stripe_ops: 64,
            rpc: None,
            iscsi: Vec::new(),
            iscsi_config: IscsiConfig::default(),
        }
    }
}

/// One member's on-disk state as the target keeps it.
#[derive(Clone, Debug)]
struct MemberMeta {
    role: u16,
    path: PathBuf,
    sb: Superblock,
    /// Still receives superblock updates (not failed).
    active: bool,
}

/// The superblocks of the running array, and the rule for changing them.
#[derive(Debug)]
struct Meta {
    members: Vec<MemberMeta>,
    /// Roles already recorded faulty.
    recorded_failed: Vec<u16>,
}

impl Meta {
    /// Writes the next generation (md's update rule) to every active member; a member whose
    /// superblock cannot be written is failed in the generation after (rule 3 of
    /// `engine::metadata::update`). A failed role with no device (missing at assembly) is
    /// recorded faulty in the slot `dev_roles` gives it. Returns the new `events`.
    fn record(&mut self, failed_roles: &[u16], resync: Option<Resync>) -> Result<u64> {
        let mut failed: Vec<u16> = failed_roles.to_vec();
        loop {
            let current: Vec<Superblock> = self
                .members
                .iter()
                .filter(|m| m.active)
                .map(|m| m.sb.clone())
                .collect();
            let newest = current.iter().max_by_key(|sb| sb.events);
            let slots: Vec<u32> = failed
                .iter()
                .filter_map(|r| match self.members.iter().find(|m| m.role == *r) {
                    Some(m) => Some(m.sb.dev_number),
                    None => newest?
                        .dev_roles
                        .iter()
                        .position(|x| x == r)
                        .map(|slot| slot as u32),
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
            };
            let next = next_generation(&current, &update).context("building superblocks")?;
            let mut write_failed = Vec::new();
            let active: Vec<usize> = (0..self.members.len())
                .filter(|&i| self.members[i].active)
                .collect();
            let mut events = 0;
            for (i, sb) in active.into_iter().zip(next) {
                let m = &mut self.members[i];
                match sb {
                    None => m.active = false,
                    Some(sb) => match metadata_io::write_superblock(&m.path, &sb) {
                        Ok(()) => {
                            events = sb.events;
                            m.sb = sb;
                        }
                        Err(e) => {
                            warn!(member = %m.path.display(), "superblock write failed: {e}");
                            write_failed.push(m.role);
                        }
                    },
                }
            }
            for r in &failed {
                if !self.recorded_failed.contains(r) {
                    self.recorded_failed.push(*r);
                }
            }
            if write_failed.is_empty() {
                return Ok(events);
            }
            failed = write_failed;
        }
    }
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
    /// Device path of each role (`None`: missing).
    paths: Vec<Option<PathBuf>>,
    meta: Mutex<Meta>,
    handle: ReactorHandle,
    cores: Vec<Option<usize>>,
    mode: Mode,
    exports: Vec<ExportReport>,
    /// Roles whose (faulty) device the operator removed.
    removed: Mutex<Vec<u16>>,
}

impl Shared {
    /// Fails the member in `role` and records it faulty on the survivors' superblocks.
    fn fail_role(&self, role: u16) -> Result<()> {
        self.handle.fail_member(role)?;
        let mut m = self
            .meta
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !m.recorded_failed.contains(&role) {
            m.record(&[role], None)?;
        }
        Ok(())
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
        if let Some(slot) = crate::status::parse_slot(selector) {
            return (usize::from(slot) < self.paths.len()).then_some(slot);
        }
        let want = Path::new(selector);
        let canon = std::fs::canonicalize(want).ok();
        self.paths
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
        match (&self.paths[r], removed) {
            (_, true) => MemberReport::idle(Some(role), None, S::Removed),
            (None, _) => MemberReport::idle(Some(role), None, S::Missing),
            (Some(p), _) => {
                MemberReport::from_snapshot(role, Some(p.display().to_string()), &snap.members[r])
            }
        }
    }

    fn status(&self) -> StatusReport {
        let snap = self.handle.snapshot();
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
            },
            members: (0..g.members())
                .map(|r| self.member_report(&snap, r))
                .collect(),
            reactors: ReactorsReport {
                count: self.cores.len(),
                cores: self.cores.clone(),
                mode: self.mode.into(),
            },
            stats: StatsReport::from(&snap.stats),
            requests_in_flight: snap.requests_in_flight as u64,
            exports: self.exports.clone(),
            process: ProcessReport::idle(),
        }
    }
}

/// The management socket's view of the target. The socket is bound first thing in
/// [`Target::start`] (a second target on the same socket is refused before anything is
/// touched); requests that arrive while the array is still being assembled wait for it.
struct TargetHandler(OnceLock<Arc<Shared>>);

impl TargetHandler {
    fn shared(&self) -> Result<&Arc<Shared>, RpcError> {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(s) = self.0.get() {
                return Ok(s);
            }
            if std::time::Instant::now() > deadline {
                return Err(RpcError::internal("the target is still starting"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
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
        let role = s
            .role_of(sel)
            .ok_or_else(|| RpcError::no_such_member(sel))?;
        let removed = s
            .removed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&role);
        if removed || s.paths[usize::from(role)].is_none() {
            // Nothing is there to fail: the slot is empty (removed, or missing at start).
            return Err(RpcError::no_such_member(sel));
        }
        let snap = s.handle.snapshot();
        let g = s.geo.geometry();
        if snap.members[usize::from(role)].state == MemberState::Online {
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
            s.fail_role(role)
                .map_err(|e| RpcError::internal(format!("{e:#}")))?;
        }
        // Every reactor takes the command within a loop turn; report what they publish.
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        loop {
            let snap = s.handle.snapshot();
            if snap.members[usize::from(role)].state != MemberState::Online
                || std::time::Instant::now() > deadline
            {
                return Ok(s.member_report(&snap, role));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn member_remove(&self, sel: &str) -> Result<MemberReport, RpcError> {
        let s = self.shared()?;
        let role = s
            .role_of(sel)
            .ok_or_else(|| RpcError::no_such_member(sel))?;
        let snap = s.handle.snapshot();
        if s.paths[usize::from(role)].is_some()
            && snap.members[usize::from(role)].state == MemberState::Online
        {
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

    fn member_add(&self, _path: &str) -> Result<MemberReport, RpcError> {
        Err(RpcError::not_supported(
            "adding members (hot spares, replacements) arrives with the rebuild process: \
             nothing could rebuild onto the device yet",
        ))
    }
}

/// A running array.
pub struct Target {
    /// Exclusive `flock`s on every device, held while the target runs.
    _locks: Vec<File>,
    shared: Arc<Shared>,
    nbd: Option<NbdServer>,
    iscsi: Option<IscsiServer>,
    reactors: Option<Reactors<TargetFrontend>>,
    rpc: Option<RpcServer>,
    stop_monitor: Arc<AtomicBool>,
    monitor: Option<JoinHandle<()>>,
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
        ensure!(!opts.devices.is_empty(), "no member devices given");
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
        let ucfg = UringConfig {
            queue_depth: opts.queue_depth,
            ..UringConfig::default()
        };
        let mut opened: Vec<Option<UringDevice>> = Vec::new();
        let mut candidates = Vec::new();
        // Claim every device first: two targets writing the same members would corrupt them.
        let mut locks = Vec::with_capacity(opts.devices.len());
        for p in &opts.devices {
            locks.push(claim(p)?);
        }
        for p in &opts.devices {
            let dev = UringDevice::open(p, &ucfg)
                .with_context(|| format!("opening member {}", p.display()))?;
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
        let assembly = assemble(
            &candidates,
            AssembleOptions {
                force: opts.force,
                block_bytes,
            },
        )
        .context("assembling the array")?;
        // md's rule (`mdadm --assemble` without `--run`): a role whose member the newest
        // superblock still counts as active, but whose device was not given, is a device
        // forgotten on the command line or gone missing — starting without it would record
        // it faulty and degrade the array for good. Refuse unless forced; roles already
        // recorded faulty (a known degraded array) start as they are.
        if !opts.force {
            let newest = candidates[assembly.newest]
                .superblock
                .as_ref()
                .map_err(|e| anyhow::anyhow!("the newest superblock: {e}"))?;
            let absent: Vec<u16> = assembly
                .missing_roles
                .iter()
                .copied()
                .filter(|&r| {
                    newest
                        .dev_roles
                        .iter()
                        .any(|&raw| DevRole::from_raw(raw) == DevRole::Active(r))
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
                     --force (the absent members are then recorded faulty and need a \
                     rebuild to return)",
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
        let mut devices = Vec::with_capacity(usize::from(g.members()));
        let mut paths = Vec::with_capacity(usize::from(g.members()));
        let mut metas = Vec::new();
        let mut failed = [None, None];
        let mut nfailed = 0;
        for (role, m) in assembly.members.iter().enumerate() {
            match m {
                Some(m) => {
                    let dev = opened[m.candidate]
                        .take()
                        .context("a device serves one role")?;
                    devices.push(AnyDevice::Uring(dev));
                    let path = opts.devices[m.candidate].clone();
                    let sb = candidates[m.candidate]
                        .superblock
                        .clone()
                        .context("an assembled member has a superblock")?;
                    metas.push(MemberMeta {
                        role: role as u16,
                        path: path.clone(),
                        sb,
                        active: true,
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
        let cores: Vec<Option<usize>> = if opts.cores.is_empty() {
            let node = opts
                .devices
                .first()
                .and_then(|p| drivers::topology::device_numa_node(p));
            match drivers::topology::choose_cores(opts.reactors.max(1), node) {
                Ok(c) => c.into_iter().map(Some).collect(),
                Err(e) => {
                    warn!("{e}; running {} unpinned reactors", opts.reactors.max(1));
                    vec![None; opts.reactors.max(1)]
                }
            }
        } else {
            opts.cores.iter().copied().map(Some).collect()
        };
        let n = cores.len();

        let export = ExportConfig::for_array(name.clone(), &geo, opts.max_block_bytes);
        let mut builder = NbdServer::builder(export);
        for a in &opts.nbd_tcp {
            builder = builder.listen_tcp(*a);
        }
        for p in &opts.nbd_unix {
            builder = builder.listen_unix(p);
        }
        let (nbd, nbd_frontends) = builder.start(n).context("starting the NBD server")?;
        let (iscsi, mut iscsi_frontends) = if opts.iscsi.is_empty() {
            (None, Vec::new())
        } else {
            let lun = crate::iscsi::lun_info(&name, &geo, assembly.uuid.0, &opts.iscsi_config);
            let mut b = IscsiServer::builder(lun).config(opts.iscsi_config.clone());
            for a in &opts.iscsi {
                b = b.listen(*a);
            }
            let (s, f) = b.start(n).context("starting the iSCSI target")?;
            (Some(s), f)
        };
        iscsi_frontends.reverse();
        let frontends: Vec<TargetFrontend> = nbd_frontends
            .into_iter()
            .map(|nbd| TargetFrontend {
                nbd,
                iscsi: iscsi_frontends.pop(),
            })
            .collect();
        // Mark the array active before the first write can reach it — only once the sockets
        // are bound, so a start that fails on its address leaves the array as it was — and
        // record the roles that have no member faulty (as md does for a degraded start): a
        // device left out now misses every write from here on, and must never count as
        // current again, even if a crash leaves the others only one generation ahead of it.
        let mut meta = Meta {
            members: metas,
            recorded_failed: Vec::new(),
        };
        let resync = (assembly.resync_offset == MAX_SECTOR).then_some(Resync::Dirty);
        let events = meta.record(&assembly.missing_roles, resync)?;
        info!(
            array = %name,
            level = g.level().md_level(),
            members = g.members(),
            chunk_bytes = g.chunk_bytes(),
            size_bytes = geo.capacity_bytes(),
            events,
            "array assembled and marked active"
        );

        let array_cfg = ArrayConfig {
            requests: 1024,
            stripe_ops: opts.stripe_ops.max(1),
            data_offset_bytes,
            failed_members: failed,
            io_timeout_ns: u64::try_from(opts.io_timeout.as_nanos()).unwrap_or(u64::MAX),
        };
        let rcfg = ReactorConfig {
            cores: cores.clone(),
            mode: opts.mode,
            requests: 1024,
        };
        let started = Reactors::start(
            Arc::new(devices),
            geo,
            Parity::new(),
            array_cfg,
            rcfg,
            frontends,
        );
        if started.is_err() && !assembly.resync_needed {
            // Nothing was written: leave the array clean, as it was found.
            if let Err(e) = meta.record(&[], Some(Resync::Clean)) {
                warn!("marking the array clean again: {e:#}");
            }
        }
        let reactors = started.context("starting the reactors")?;
        let handle = reactors.handle();
        let mut exports = Vec::new();
        for a in nbd.tcp_addrs() {
            info!(address = %a, export = %name, "NBD export listening");
            exports.push(ExportReport {
                protocol: ExportProtocol::Nbd,
                address: a.to_string(),
                name: name.clone(),
            });
        }
        for p in nbd.unix_paths() {
            info!(socket = %p.display(), export = %name, "NBD export listening");
            exports.push(ExportReport {
                protocol: ExportProtocol::Nbd,
                address: p.display().to_string(),
                name: name.clone(),
            });
        }
        if let Some(i) = &iscsi {
            for a in i.addrs() {
                info!(address = %a, target = %i.target_name(), "iSCSI target listening");
                exports.push(ExportReport {
                    protocol: ExportProtocol::Iscsi,
                    address: a.to_string(),
                    name: i.target_name().to_string(),
                });
            }
        }
        let shared = Arc::new(Shared {
            name,
            geo,
            assembly,
            paths,
            meta: Mutex::new(meta),
            handle,
            cores,
            mode: opts.mode,
            exports,
            removed: Mutex::new(Vec::new()),
        });
        let stop_monitor = Arc::new(AtomicBool::new(false));
        let monitor = {
            let (shared, stop) = (Arc::clone(&shared), Arc::clone(&stop_monitor));
            std::thread::Builder::new()
                .name("member-monitor".into())
                .spawn(move || monitor(&shared.meta, &shared.handle, &stop))
                .context("starting the member monitor")?
        };
        let mut target = Target {
            _locks: locks,
            shared: Arc::clone(&shared),
            nbd: Some(nbd),
            iscsi,
            reactors: Some(reactors),
            rpc: None,
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
    pub fn member_paths(&self) -> &[Option<PathBuf>] {
        &self.shared.paths
    }

    /// Management handle of the reactors.
    pub fn handle(&self) -> &ReactorHandle {
        &self.shared.handle
    }

    /// NBD TCP addresses actually bound.
    pub fn nbd_tcp_addrs(&self) -> Vec<SocketAddr> {
        self.nbd
            .as_ref()
            .map(|n| n.tcp_addrs().to_vec())
            .unwrap_or_default()
    }

    /// iSCSI addresses actually bound.
    pub fn iscsi_addrs(&self) -> Vec<SocketAddr> {
        self.iscsi
            .as_ref()
            .map(|i| i.addrs().to_vec())
            .unwrap_or_default()
    }

    /// NBD Unix socket paths.
    pub fn nbd_unix_paths(&self) -> Vec<PathBuf> {
        self.nbd
            .as_ref()
            .map(|n| n.unix_paths().to_vec())
            .unwrap_or_default()
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
    pub fn stop(mut self) -> Result<()> {
        if let Some(mut rpc) = self.rpc.take() {
            rpc.shutdown();
        }
        if let Some(nbd) = self.nbd.take() {
            nbd.shutdown();
        }
        if let Some(i) = self.iscsi.take() {
            i.shutdown();
        }
        if let Some(r) = self.reactors.take() {
            r.stop().context("stopping the reactors")?;
        }
        self.stop_monitor.store(true, Ordering::Release);
        if let Some(m) = self.monitor.take() {
            let _ = m.join();
        }
        // Record any failure the monitor had not yet written, then flush and mark clean.
        let snap = self.shared.handle.snapshot();
        let mut meta = self
            .shared
            .meta
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let newly: Vec<u16> = failed_roles(&snap, &meta);
        for m in meta.members.iter().filter(|m| m.active) {
            if newly.contains(&m.role) {
                continue;
            }
            flush(&m.path)?;
        }
        let resync = (!self.shared.assembly.resync_needed).then_some(Resync::Clean);
        let events = meta.record(&newly, resync)?;
        info!(array = %self.shared.name, events, clean = resync.is_some(), "array stopped");
        Ok(())
    }
}

fn failed_roles(snap: &engine::reactor::ArraySnapshot, meta: &Meta) -> Vec<u16> {
    snap.members
        .iter()
        .enumerate()
        .filter(|(r, m)| {
            m.state != MemberState::Online
                && !meta.recorded_failed.contains(&(*r as u16))
                && meta.members.iter().any(|x| x.role == *r as u16 && x.active)
        })
        .map(|(r, _)| r as u16)
        .collect()
}

/// Records members the reactors failed as faulty on the survivors' superblocks.
fn monitor(meta: &Mutex<Meta>, handle: &ReactorHandle, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(MONITOR_INTERVAL);
        let snap = handle.snapshot();
        let mut m = meta
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let newly = failed_roles(&snap, &m);
        if newly.is_empty() {
            continue;
        }
        for r in &newly {
            warn!(role = r, state = ?snap.members[usize::from(*r)].state, "member failed; recording it faulty");
        }
        if let Err(e) = m.record(&newly, None) {
            warn!("recording failed members: {e:#}");
        }
    }
}

/// Takes an exclusive advisory lock (`flock(LOCK_EX | LOCK_NB)`) on a member device, held as
/// long as the returned file is open: a second `ferroraid serve` (or `create`) on the same
/// device is refused instead of corrupting it.
///
/// # Errors
/// The device cannot be opened, or another process holds the lock.
pub fn claim(path: &Path) -> Result<File> {
    use std::os::fd::AsRawFd;
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock takes a file descriptor we own and plain flags.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            bail!(
                "{} is in use by another ferroraid process (it holds the device's lock)",
                path.display()
            );
        }
        return Err(e).with_context(|| format!("locking {}", path.display()));
    }
    Ok(f)
}

/// Makes everything written to `path` durable (`fdatasync`).
fn flush(path: &Path) -> Result<()> {
    File::options()
        .write(true)
        .open(path)
        .and_then(|f| f.sync_data())
        .with_context(|| format!("flushing {}", path.display()))
}
