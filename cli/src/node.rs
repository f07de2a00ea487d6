//! One appliance process, many arrays (issue 21): a [`Node`] pins one set of reactor
//! threads ([`engine::reactor::ReactorSet`]) and serves any number of arrays on them,
//! each a [`Target`] with its own members, superblock bookkeeping and exports, started
//! and stopped while the others serve (`array_start`, `array_stop`, `array_create` over
//! JSON-RPC, docs/MANAGEMENT.md). Every array has a shard on every reactor; member
//! devices are claimed per array (`flock`), so two arrays never share a device — and
//! therefore never share a pacer or a depth controller, which are per shard and member.
//!
//! The management socket and the metrics endpoint are the node's: a request naming an
//! array (`{"array": NAME}`) goes to that array; one that names none goes to the only
//! array when there is exactly one (a process of one array answers as a single-array
//! target always did), and is refused with [`codes::ARRAY_NOT_NAMED`] otherwise.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use anyhow::{Context, Result};
use engine::geometry::{Geometry, Layout, Level};
use engine::metadata::{BitmapChoice, ConsistencyPolicy};
use engine::reactor::ReactorSet;
use serde_json::Value;
use tracing::{info, warn};

use crate::create::ZeroProgress;
use crate::frontends::ExportSpec;
use crate::metrics::{MetricsServer, MetricsSource, Scrape};
use crate::nvmf::spec::AnaState;
use crate::nvmf::{PortalAddReport, PortalListReport, PortalRemoveReport, PortalSetAnaReport};
use crate::rpc::{
    codes, ArrayCreateParams, ArrayCreateReport, ArrayStartParams, ArrayStopReport,
    CreateProgressReport, ExportParams, Handler, RpcError, RpcServer,
};
use crate::status::{
    ExportProtocol, ExportRemoveReport, ExportReport, MemberReport, ProcessKind, ProcessReport,
    StatusReport,
};
use crate::target::{reactor_cores, ServeOptions, Target};

/// What a [`Node`] runs.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    /// Every array's options but its devices and exports (queue depth, timeouts, stripe
    /// cache, pacer, depth control, NBD/iSCSI/NVMe-oF tunables), and the reactors'
    /// layout (`cores`, `reactors`, `mode`). Its `devices` only guide the choice of cores
    /// (their NUMA node); its `rpc` and `metrics` are the node's.
    pub defaults: ServeOptions,
    /// The arrays to start at once, each with its devices and exports (the rest as
    /// `defaults`). Empty: an appliance that starts arrays over JSON-RPC later (needs
    /// `defaults.rpc`).
    pub arrays: Vec<ServeOptions>,
}

/// The `--config` keys of the node's own settings: they shape the reactors, the
/// management socket and the metrics endpoint, which keep them while the node runs.
pub const NODE_SETTINGS: [&str; 5] = ["cores", "reactors", "mode", "rpc", "metrics"];

/// Settings of how the configuration's own arrays are assembled (mdadm's `--force` and
/// `--run`): per start, as mdadm's flags are, so they apply to the arrays `serve` starts
/// from its configuration (at start and at a reload) and never to a `ferroraid start` or
/// `array_create`, which give their own.
pub const CONFIG_START_SETTINGS: [&str; 2] = ["force", "run"];

/// What a reloaded configuration changed ([`Node::reload_defaults`]), by `--config` key.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ChangedSettings {
    /// Node settings ([`NODE_SETTINGS`]) that differ from the node's start: not applied
    /// until `serve` restarts.
    pub node: Vec<&'static str>,
    /// Array settings that differ from the last configuration: arrays started from now
    /// on get them, running arrays keep their own.
    pub arrays: Vec<&'static str>,
    /// [`CONFIG_START_SETTINGS`] that differ from the last configuration: the arrays the
    /// configuration starts from now on are assembled with them.
    pub config_starts: Vec<&'static str>,
}

/// `o`'s settings by `--config` key (several keys where one option holds them), each
/// with its value in `Debug` form — to compare, never to show (CHAP secrets are among
/// them). Devices and exports are left out: they are each array's, not settings.
fn settings(o: &ServeOptions) -> [(&'static str, String); 22] {
    [
        ("cores", format!("{:?}", o.cores)),
        ("reactors", format!("{:?}", o.reactors)),
        ("mode", format!("{:?}", o.mode)),
        ("rpc", format!("{:?}", o.rpc)),
        ("metrics", format!("{:?}", o.metrics)),
        ("max_block", format!("{:?}", o.max_block_bytes)),
        (
            "nbd_max_connections, nbd_handshake_timeout_ms, nbd_max_handshakes, \
             nbd_idle_timeout_s",
            format!("{:?}", o.nbd_config),
        ),
        // The files' contents, not only their names: a certificate renewed in place is
        // a change.
        (
            "tls, tls_cert, tls_key, tls_ca",
            format!(
                "{:?} {:?}",
                o.nbd_tls,
                o.nbd_tls
                    .as_ref()
                    .map(crate::nbd::TlsConfig::credentials_id)
            ),
        ),
        ("nbd_block_status", format!("{:?}", o.nbd_block_status)),
        ("force", format!("{:?}", o.force)),
        ("run", format!("{:?}", o.run)),
        ("io_timeout_ms", format!("{:?}", o.io_timeout)),
        ("queue_depth", format!("{:?}", o.queue_depth)),
        ("stripe_ops", format!("{:?}", o.stripe_ops)),
        ("stripe_cache", format!("{:?}", o.stripe_cache_bytes)),
        ("write_hold_us", format!("{:?}", o.write_hold)),
        ("qos, qos_target_us", format!("{:?}", o.depth)),
        // The secrets too (by hash): `ChapConfig`'s Debug hides them, and a changed
        // secret is a change.
        (
            "iscsi_chap",
            format!("{:?} {:?}", o.iscsi_config, chap_secrets_id(o)),
        ),
        (
            "nvmf_allow_hosts",
            format!("{:?} {:?}", o.nvmf_allow_hosts, o.nvmf_config),
        ),
        ("pacer", format!("{:?}", o.pacer)),
        ("speed_min, speed_max", format!("{:?}", o.speed_limits)),
        ("pacer_tolerance", format!("{:?}", o.pacer_tolerance)),
    ]
}

/// A hash of the CHAP secrets in `o` (none: `None`), for [`settings`] to see a secret
/// change that the redacting `Debug` of [`crate::iscsi::ChapConfig`] hides. Never shown.
fn chap_secrets_id(o: &ServeOptions) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let chap = o.iscsi_config.chap.as_ref()?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    chap.secret.hash(&mut h);
    chap.mutual.as_ref().map(|(_, s)| s).hash(&mut h);
    Some(h.finish())
}

/// The defaults of arrays started on a node (`Inner::defaults`): `o`'s settings, with the
/// node's own (`cores`, `reactors`, `mode`) from `node`, and no devices, management
/// socket or metrics endpoint (those are each array's, or the node's).
fn array_defaults(o: &ServeOptions, node: &ServeOptions) -> ServeOptions {
    let mut d = o.clone();
    d.devices.clear();
    d.cores.clone_from(&node.cores);
    d.reactors = node.reactors;
    d.mode = node.mode;
    d.rpc = None;
    d.metrics = None;
    d
}

fn lock_defaults(m: &Mutex<ServeOptions>) -> MutexGuard<'_, ServeOptions> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A running node: the reactors, the arrays on them, the management socket and the
/// metrics endpoint.
pub struct Node {
    inner: Arc<Inner>,
    rpc: Option<RpcServer>,
    metrics: Option<MetricsServer>,
}

struct Inner {
    set: ReactorSet,
    /// The node's options as it started: what a reload compares the node-wide settings
    /// ([`NODE_SETTINGS`]) with.
    started: ServeOptions,
    /// What an array started from now on gets beside its devices and exports: the
    /// start's options, with the array settings of the last reload
    /// ([`Node::reload_defaults`]).
    defaults: Mutex<ServeOptions>,
    /// The running arrays by short name ([`Target::name`]).
    arrays: Mutex<BTreeMap<String, Target>>,
    /// Serializes array starts and stops (they claim devices and names); requests to
    /// running arrays do not wait for it.
    lifecycle: Mutex<()>,
    /// `array_create`s in progress, and the last one of each name.
    creates: Mutex<BTreeMap<String, CreateJob>>,
}

/// One `array_create` ([`Handler::array_create_progress`]).
struct CreateJob {
    progress: Arc<ZeroProgress>,
    state: &'static str,
    error: Option<String>,
    began: Instant,
}

/// The node's JSON-RPC handler and metrics source (set once the node is up; requests
/// before that wait up to 30 s).
struct NodeHandler(OnceLock<Arc<Inner>>);

impl Node {
    /// Starts the reactors, the management socket and the metrics endpoint, then every
    /// array of `opts.arrays` in order. A failure stops what was started (arrays already
    /// up are stopped cleanly) and is returned.
    ///
    /// # Errors
    /// The management socket or metrics address cannot be bound (before any device is
    /// touched); no reactor thread can start; an array cannot start (as
    /// [`Target::start`]); two arrays with one name.
    pub fn start(opts: &NodeOptions) -> Result<Node> {
        anyhow::ensure!(
            !opts.arrays.is_empty() || opts.defaults.rpc.is_some(),
            "no array to serve and no management socket to start one through: name \
             member devices, [[array]] tables, or --rpc"
        );
        match crate::nbd::raise_open_files_limit() {
            Ok(n) => info!(limit = n, "open files limit (RLIMIT_NOFILE soft = hard)"),
            Err(e) => warn!("cannot raise the open files limit: {e}"),
        }
        let handler = Arc::new(NodeHandler(OnceLock::new()));
        let rpc = match &opts.defaults.rpc {
            Some(path) => Some(
                RpcServer::bind(path, Arc::clone(&handler) as Arc<dyn Handler>)
                    .with_context(|| format!("opening the management socket {}", path.display()))?,
            ),
            None => None,
        };
        let metrics = match opts.defaults.metrics {
            Some(addr) => {
                let m = MetricsServer::bind(addr, Arc::clone(&handler) as Arc<dyn MetricsSource>)?;
                info!(address = %m.local_addr(), "metrics endpoint listening (GET /metrics)");
                Some(m)
            }
            None => None,
        };
        let mut layout = opts.defaults.clone();
        if layout.devices.is_empty() {
            if let Some(first) = opts.arrays.first() {
                layout.devices = first.devices.clone();
            }
        }
        let set = ReactorSet::start(&reactor_cores(&layout), opts.defaults.mode)
            .context("starting the reactors")?;
        info!(reactors = set.reactors(), cores = ?set.cores(), "reactors running");
        let defaults = array_defaults(&opts.defaults, &opts.defaults);
        let inner = Arc::new(Inner {
            set,
            started: opts.defaults.clone(),
            defaults: Mutex::new(defaults),
            arrays: Mutex::new(BTreeMap::new()),
            lifecycle: Mutex::new(()),
            creates: Mutex::new(BTreeMap::new()),
        });
        let mut node = Node {
            inner,
            rpc: None,
            metrics,
        };
        for a in &opts.arrays {
            if let Err(e) = node.inner.start_array(a) {
                let _ = node.stop_inner();
                return Err(e);
            }
        }
        if let Some(path) = &opts.defaults.rpc {
            info!(socket = %path.display(), "JSON-RPC management socket listening");
        }
        let _ = handler.0.set(Arc::clone(&node.inner));
        node.rpc = rpc;
        Ok(node)
    }

    /// Starts one more array (its devices and exports in `opts`; its other options are
    /// taken as given). Returns its name.
    ///
    /// # Errors
    /// As [`Target::start`]; an array of that name already runs.
    pub fn start_array(&self, opts: &ServeOptions) -> Result<String> {
        self.inner.start_array(opts)
    }

    /// Stops the array `name` (drain, flush, mark clean) while the others serve.
    /// Returns whether it was left clean.
    ///
    /// # Errors
    /// No such array; the stop's own errors ([`Target::stop`]).
    pub fn stop_array(&self, name: &str) -> Result<bool> {
        self.inner.stop_array(name)
    }

    /// The running arrays' names, sorted.
    pub fn array_names(&self) -> Vec<String> {
        self.inner.names()
    }

    /// Runs `f` with the running array `name`, if there is one.
    pub fn with_array<R>(&self, name: &str, f: impl FnOnce(&Target) -> R) -> Option<R> {
        self.inner.lock().get(name).map(f)
    }

    /// Runs `f` with every running array, in name order.
    pub fn for_each_array(&self, mut f: impl FnMut(&Target)) {
        for t in self.inner.lock().values() {
            f(t);
        }
    }

    /// The reactors' cores, in reactor order (`None`: not pinned).
    pub fn cores(&self) -> Vec<Option<usize>> {
        self.inner.set.cores().to_vec()
    }

    /// The options an array started with [`Node::start_array`] or over JSON-RPC gets
    /// beside its devices and exports.
    pub fn defaults(&self) -> ServeOptions {
        lock_defaults(&self.inner.defaults).clone()
    }

    /// Takes the array settings of a reloaded configuration (`new`, SIGHUP) as the
    /// defaults of the arrays started from now on — by the reload, `ferroraid start` or
    /// `array_create` — and returns what changed, by `--config` key: `node` lists the
    /// settings of the node itself ([`NODE_SETTINGS`]: the reactors, the management
    /// socket, the metrics endpoint), which keep their values until `serve` restarts
    /// (compared with the start, so every reload names them again); `arrays` lists the
    /// settings the arrays started from now on get, which running arrays do not (they
    /// keep theirs until stopped and started again). Values are never returned: some
    /// are secrets (CHAP).
    pub fn reload_defaults(&self, new: &ServeOptions) -> ChangedSettings {
        let mut d = lock_defaults(&self.inner.defaults);
        let before = settings(&d);
        let started = settings(&self.inner.started);
        let after = settings(new);
        let mut changed = ChangedSettings::default();
        for ((key, old), ((_, first), (_, now))) in before.iter().zip(started.iter().zip(&after)) {
            if NODE_SETTINGS.contains(key) {
                if first != now {
                    changed.node.push(key);
                }
            } else if CONFIG_START_SETTINGS.contains(key) {
                if old != now {
                    changed.config_starts.push(key);
                }
            } else if old != now {
                changed.arrays.push(key);
            }
        }
        *d = array_defaults(new, &self.inner.started);
        changed
    }

    /// Stops serving: the management socket and metrics endpoint close, every array is
    /// stopped (drained, flushed, marked clean), then the reactors.
    ///
    /// # Errors
    /// The first array stop that failed (the others are still stopped).
    pub fn stop(mut self) -> Result<()> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<()> {
        if let Some(mut rpc) = self.rpc.take() {
            rpc.shutdown();
        }
        if let Some(mut m) = self.metrics.take() {
            m.shutdown();
        }
        let mut first_err = None;
        for name in self.inner.names() {
            if let Err(e) = self.inner.stop_array(&name) {
                warn!(array = %name, "stopping: {}", crate::error_text(&e));
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Inner {
    fn creates(&self) -> MutexGuard<'_, BTreeMap<String, CreateJob>> {
        self.creates
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Moves the create of `name` to `state` (with `error` when it failed).
    fn create_state(&self, name: &str, state: &'static str, error: Option<String>) {
        if let Some(j) = self.creates().get_mut(name) {
            j.state = state;
            j.error = error;
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Target>> {
        self.arrays
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn names(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    fn start_array(&self, opts: &ServeOptions) -> Result<String> {
        let _serial = self
            .lifecycle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut o = opts.clone();
        o.rpc = None;
        o.metrics = None;
        let t = Target::start_unless_named(&o, Some(&self.set), &|name| {
            self.lock().contains_key(name)
        })?;
        let name = t.name().to_string();
        if self.lock().contains_key(&name) {
            // Its devices differ (they were claimed): a second array of the same name,
            // which the exports (NBD name, IQN, NQN) and the `array` parameter could not
            // tell apart.
            let stopped = t.stop();
            anyhow::bail!(
                "an array named {name:?} is already running: a second one cannot be \
                 told apart (it was stopped again{})",
                match stopped {
                    Ok(()) => String::new(),
                    Err(e) => format!(", with an error: {}", crate::error_text(&e)),
                }
            );
        }
        info!(array = %name, "array started");
        self.lock().insert(name.clone(), t);
        Ok(name)
    }

    fn stop_array(&self, name: &str) -> Result<bool> {
        let _serial = self
            .lifecycle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let t = self
            .lock()
            .remove(name)
            .with_context(|| format!("no running array is named {name:?}"))?;
        let clean = t.stop_clean()?;
        info!(array = %name, clean, "array stopped");
        Ok(clean)
    }

    /// The running array `want` names: its short name ([`Target::name`], the key)
    /// exactly, else md's full `set_name` (`host:name`) exactly. Never a partial match: a
    /// short name may itself hold a `:`.
    fn resolve(&self, want: &str) -> Option<String> {
        let arrays = self.lock();
        if arrays.contains_key(want) {
            return Some(want.to_string());
        }
        arrays
            .iter()
            .find(|(_, t)| t.assembly().name == want)
            .map(|(k, _)| k.clone())
    }

    /// The one array a request that names none is for.
    fn only(&self, method: &str) -> Result<Arc<dyn Handler>, RpcError> {
        let arrays = self.lock();
        match arrays.values().next() {
            Some(t) if arrays.len() == 1 => Ok(t.handler()),
            _ => Err(RpcError::array_not_named(
                method,
                &arrays.keys().cloned().collect::<Vec<_>>(),
            )),
        }
    }

    /// The options of an array started over JSON-RPC.
    fn array_options(&self, devices: Vec<PathBuf>, e: &ExportParams) -> ServeOptions {
        let mut o = lock_defaults(&self.defaults).clone();
        o.devices = devices;
        o.nbd_tcp = e.nbd.clone();
        o.nbd_unix = e.nbd_unix.clone();
        // No NBD address asked for: no NBD export (not the single-array default port,
        // which the first array of the process may hold).
        o.nbd = !(e.nbd.is_empty() && e.nbd_unix.is_empty());
        o.iscsi = e.iscsi.clone();
        o.nvmf = e.nvmf.clone();
        o
    }

    fn status_of(&self, name: &str) -> Result<StatusReport, RpcError> {
        self.lock()
            .get(name)
            .map(Target::status)
            .ok_or_else(|| RpcError::no_such_array(name, &self.names()))
    }
}

impl NodeHandler {
    fn inner(&self) -> Result<&Arc<Inner>, RpcError> {
        crate::rpc::wait_started(&self.0)
    }

    fn only(&self, method: &str) -> Result<Arc<dyn Handler>, RpcError> {
        self.inner()?.only(method)
    }
}

impl MetricsSource for NodeHandler {
    fn scrape(&self) -> Option<Vec<Scrape>> {
        let inner = self.0.get()?;
        let arrays = inner.lock();
        Some(arrays.values().filter_map(Target::scrape).collect())
    }
}

impl Handler for NodeHandler {
    fn status(&self) -> StatusReport {
        match self.status_checked() {
            Ok(s) => s,
            // A handler panic is answered as a JSON-RPC internal error.
            Err(e) => panic!("{}", e.message),
        }
    }

    fn status_checked(&self) -> Result<StatusReport, RpcError> {
        self.only("array_status")?.status_checked()
    }

    fn member_fail(&self, sel: &str) -> Result<MemberReport, RpcError> {
        self.only("member_fail")?.member_fail(sel)
    }

    fn member_remove(&self, sel: &str) -> Result<MemberReport, RpcError> {
        self.only("member_remove")?.member_remove(sel)
    }

    fn member_add(&self, path: &str) -> Result<MemberReport, RpcError> {
        self.only("member_add")?.member_add(path)
    }

    fn member_replace(&self, old: &str, new: &str) -> Result<MemberReport, RpcError> {
        self.only("member_replace")?.member_replace(old, new)
    }

    fn process_start(&self, kind: ProcessKind) -> Result<ProcessReport, RpcError> {
        self.only("process_start")?.process_start(kind)
    }

    fn process_stop(&self) -> Result<ProcessReport, RpcError> {
        self.only("process_stop")?.process_stop()
    }

    fn nvmf_portal_list(&self) -> Result<PortalListReport, RpcError> {
        self.only("nvmf_portal_list")?.nvmf_portal_list()
    }

    fn nvmf_portal_set_ana(
        &self,
        portal: &str,
        state: AnaState,
    ) -> Result<PortalSetAnaReport, RpcError> {
        self.only("nvmf_portal_set_ana")?
            .nvmf_portal_set_ana(portal, state)
    }

    fn nvmf_portal_remove(&self, portal: &str) -> Result<PortalRemoveReport, RpcError> {
        self.only("nvmf_portal_remove")?.nvmf_portal_remove(portal)
    }

    fn nvmf_portal_add(
        &self,
        portal: &str,
        state: Option<AnaState>,
    ) -> Result<PortalAddReport, RpcError> {
        self.only("nvmf_portal_add")?.nvmf_portal_add(portal, state)
    }

    fn export_add(&self, spec: &ExportSpec) -> Result<Vec<ExportReport>, RpcError> {
        self.only("export_add")?.export_add(spec)
    }

    fn export_remove(&self, protocol: ExportProtocol) -> Result<ExportRemoveReport, RpcError> {
        self.only("export_remove")?.export_remove(protocol)
    }

    fn export_list(&self) -> Result<Vec<ExportReport>, RpcError> {
        self.only("export_list")?.export_list()
    }

    fn array_create_progress(&self) -> Result<Vec<CreateProgressReport>, RpcError> {
        let inner = self.inner()?;
        let jobs = inner.creates();
        Ok(jobs
            .iter()
            .map(|(name, j)| CreateProgressReport {
                array: name.clone(),
                state: j.state.to_string(),
                zeroed_bytes: j.progress.done_bytes.load(Ordering::Relaxed),
                total_bytes: j.progress.total_bytes.load(Ordering::Relaxed),
                elapsed_s: j.began.elapsed().as_secs_f64(),
                error: j.error.clone(),
            })
            .collect())
    }

    fn route(
        &self,
        array: &str,
        f: &mut dyn FnMut(&dyn Handler) -> Result<Value, RpcError>,
    ) -> Option<Result<Value, RpcError>> {
        let inner = match self.inner() {
            Ok(i) => i,
            Err(e) => return Some(Err(e)),
        };
        let found = inner
            .resolve(array)
            .and_then(|name| inner.lock().get(&name).map(Target::handler));
        Some(match found {
            Some(h) => f(&*h),
            None => Err(RpcError::no_such_array(array, &inner.names())),
        })
    }

    fn array_list(&self) -> Result<Vec<StatusReport>, RpcError> {
        Ok(self.inner()?.lock().values().map(Target::status).collect())
    }

    fn array_start(&self, p: ArrayStartParams) -> Result<StatusReport, RpcError> {
        let inner = self.inner()?;
        for d in &p.devices {
            RpcError::require_absolute(d)?;
        }
        let o = inner.array_options(p.devices, &p.exports);
        let o = ServeOptions {
            force: p.force,
            run: p.run,
            ..o
        };
        let name = inner.start_array(&o).map_err(start_error)?;
        inner.status_of(&name)
    }

    fn array_stop(&self, array: &str) -> Result<ArrayStopReport, RpcError> {
        let inner = self.inner()?;
        let name = inner.resolve(array);
        let Some(name) = name else {
            return Err(RpcError::no_such_array(array, &inner.names()));
        };
        match inner.stop_array(&name) {
            Ok(clean) => Ok(ArrayStopReport { array: name, clean }),
            Err(e) => Err(RpcError::new(
                codes::ARRAY_STOP_FAILED,
                format!(
                    "array {name:?} stopped with an error: {}",
                    crate::error_text(&e)
                ),
            )),
        }
    }

    fn array_create(&self, p: ArrayCreateParams) -> Result<ArrayCreateReport, RpcError> {
        for d in &p.devices {
            RpcError::require_absolute(d)?;
        }
        let inner = self.inner()?;
        let level = match p.level {
            5 => Level::Raid5,
            6 => Level::Raid6,
            l => {
                return Err(RpcError::invalid_params(format!(
                    "array_create: level {l}: 5 or 6"
                )))
            }
        };
        let layout: Layout = match &p.layout {
            None => Layout::LeftSymmetric,
            Some(l) => l
                .parse()
                .map_err(|e| RpcError::invalid_params(format!("array_create: layout: {e}")))?,
        };
        let n = u16::try_from(p.devices.len())
            .map_err(|_| RpcError::invalid_params("array_create: too many devices"))?;
        let geometry = Geometry::new(level, layout, n, p.chunk_bytes.unwrap_or(64 << 10), 512)
            .map_err(|e| RpcError::invalid_params(format!("array_create: {e}")))?;
        let bitmap = match p.bitmap.as_deref() {
            None if p.bitmap_chunk_bytes.is_some() => BitmapChoice::Internal,
            None => BitmapChoice::default(),
            Some("internal") => BitmapChoice::Internal,
            Some("none") => BitmapChoice::None,
            Some(b) => {
                return Err(RpcError::invalid_params(format!(
                    "array_create: bitmap {b:?}: \"internal\" or \"none\""
                )))
            }
        };
        let consistency_policy: Option<ConsistencyPolicy> = match p.consistency_policy.as_deref() {
            None => None,
            Some(c) => Some(c.parse().map_err(|e| {
                RpcError::invalid_params(format!("array_create: consistency_policy: {e}"))
            })?),
        };
        // The name the array will run under (md's rule: the part after `host:`).
        let short = p.name.split_once(':').map_or(p.name.as_str(), |(_, s)| s);
        if short.is_empty() {
            return Err(RpcError::invalid_params(format!(
                "array_create: name {:?} has an empty array name (after `host:`)",
                p.name
            )));
        }
        let running = inner.lock().contains_key(short);
        if running || inner.resolve(&p.name).is_some() {
            // Named as it runs: `host:gamma` would run as `gamma`.
            return Err(RpcError::new(
                codes::ARRAY_NAME_IN_USE,
                format!(
                    "an array named {short:?} is already running ({:?} would run under that \
                     name)",
                    p.name
                ),
            ));
        }
        let progress = Arc::new(ZeroProgress::default());
        {
            let mut jobs = inner.creates();
            if jobs
                .get(&p.name)
                .is_some_and(|j| j.state == "zeroing" || j.state == "starting")
            {
                return Err(RpcError::new(
                    codes::ARRAY_NAME_IN_USE,
                    format!("an array named {:?} is being created already", p.name),
                ));
            }
            jobs.insert(
                p.name.clone(),
                CreateJob {
                    progress: Arc::clone(&progress),
                    state: "zeroing",
                    error: None,
                    began: Instant::now(),
                },
            );
        }
        let created = crate::create::create(&crate::create::CreateOptions {
            geometry,
            name: p.name.clone(),
            devices: p.devices.clone(),
            assume_clean: p.assume_clean,
            force: p.force,
            progress: false,
            zero_progress: Some(progress),
            bitmap,
            bitmap_chunk_bytes: p.bitmap_chunk_bytes,
            consistency_policy,
        })
        .map_err(|e| {
            let msg = format!("array_create {:?}: {}", p.name, crate::error_text(&e));
            inner.create_state(&p.name, "failed", Some(msg.clone()));
            RpcError::new(codes::ARRAY_CREATE_FAILED, msg)
        })?;
        let status = if p.start {
            inner.create_state(&p.name, "starting", None);
            let o = inner.array_options(p.devices.clone(), &p.exports);
            let started = inner
                .start_array(&o)
                .map_err(start_error)
                .and_then(|name| inner.status_of(&name));
            match started {
                Ok(s) => Some(s),
                Err(mut e) => {
                    // The members carry the new array now: say so, and how to go on (a
                    // second create would be refused on those superblocks without force).
                    e.message = format!(
                        "array_create {:?}: the array was created (uuid {}) but did not \
                         start: {}; start it with `ferroraid start {}` (array_start) once \
                         that is fixed",
                        p.name,
                        created.uuid,
                        e.message,
                        p.devices
                            .iter()
                            .map(|d| d.display().to_string())
                            .collect::<Vec<_>>()
                            .join(" ")
                    );
                    inner.create_state(&p.name, "failed", Some(e.message.clone()));
                    return Err(e);
                }
            }
        } else {
            None
        };
        inner.create_state(&p.name, "done", None);
        Ok(ArrayCreateReport {
            array: p.name,
            uuid: created.uuid.to_string(),
            size_bytes: created.size_bytes,
            data_offset_bytes: created.data_offset_bytes,
            status,
        })
    }
}

/// An array start's failure as a JSON-RPC error: a name in use, or anything else with
/// its reason.
fn start_error(e: anyhow::Error) -> RpcError {
    let msg = crate::error_text(&e);
    if msg.contains("is already running") {
        RpcError::new(codes::ARRAY_NAME_IN_USE, msg)
    } else {
        RpcError::new(codes::ARRAY_START_FAILED, format!("array_start: {msg}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::handle_request;

    /// `array_start` of `devs` (paths) through `h`, no export: the JSON-RPC answer.
    fn start_on(h: &NodeHandler, devs: &[String]) -> serde_json::Value {
        handle_request(
            h,
            format!(
                r#"{{"jsonrpc":"2.0","method":"array_start","params":{{"devices":{devs:?}}},"id":1}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    /// `n` empty (sparse) member files `{prefix}{i}.img` of 16 MiB in `dir`, by path.
    fn blank_members(dir: &std::path::Path, prefix: &str, n: u16) -> Vec<String> {
        (0..n)
            .map(|i| {
                let p = dir.join(format!("{prefix}{i}.img"));
                std::fs::File::create(&p)
                    .and_then(|f| f.set_len(16 << 20))
                    .unwrap();
                p.display().to_string()
            })
            .collect()
    }

    /// `members` member files `{prefix}{i}.img` of 16 MiB in `dir`, made a RAID5 named
    /// `name` (64 KiB chunks).
    fn created_array(
        dir: &std::path::Path,
        prefix: &str,
        members: u16,
        name: &str,
    ) -> Vec<PathBuf> {
        let devices: Vec<PathBuf> = blank_members(dir, prefix, members)
            .into_iter()
            .map(PathBuf::from)
            .collect();
        crate::create::create(&crate::create::CreateOptions {
            geometry: Geometry::new(Level::Raid5, Layout::LeftSymmetric, members, 64 << 10, 512)
                .unwrap(),
            name: name.into(),
            devices: devices.clone(),
            assume_clean: false,
            force: false,
            progress: false,
            zero_progress: None,
            bitmap: BitmapChoice::None,
            bitmap_chunk_bytes: None,
            consistency_policy: None,
        })
        .unwrap();
        devices
    }

    /// A node serving one RAID5 over four member files in `dir`, no export, adaptive
    /// reactors; its handler.
    fn node_with_one_array(dir: &std::path::Path) -> (Node, Arc<NodeHandler>) {
        let devices = created_array(dir, "m", 4, "alpha");
        let mut defaults = ServeOptions::new(Vec::new());
        defaults.mode = engine::reactor::Mode::Adaptive;
        defaults.reactors = 2;
        let mut a = defaults.clone();
        a.devices = devices;
        a.nbd = false;
        let node = Node::start(&NodeOptions {
            defaults,
            arrays: vec![a],
        })
        .unwrap();
        let h = Arc::new(NodeHandler(OnceLock::from(Arc::clone(&node.inner))));
        (node, h)
    }

    /// A reload's settings (SIGHUP): array settings that changed are named and become
    /// what arrays started from now on get (over JSON-RPC too); node settings that
    /// changed are named on every reload (they wait for a restart) and never reach the
    /// arrays' defaults; a reload that changes nothing names nothing.
    #[test]
    fn a_reload_names_what_it_changed_and_starts_arrays_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let (node, h) = node_with_one_array(dir.path());
        let mut new = ServeOptions::new(Vec::new());
        new.mode = engine::reactor::Mode::Adaptive;
        new.reactors = 2;
        assert_eq!(node.reload_defaults(&new), ChangedSettings::default());
        new.reactors = 4;
        new.rpc = Some(dir.path().join("node.sock"));
        new.queue_depth = 32;
        new.stripe_cache_bytes = Some(8 << 20);
        let changed = node.reload_defaults(&new);
        assert_eq!(changed.node, ["reactors", "rpc"]);
        assert_eq!(changed.arrays, ["queue_depth", "stripe_cache"]);
        let d = node.defaults();
        assert_eq!((d.queue_depth, d.stripe_cache_bytes), (32, Some(8 << 20)));
        assert_eq!(
            (d.reactors, d.rpc.clone()),
            (2, None),
            "the node's own stay"
        );
        let o =
            h.0.get()
                .unwrap()
                .array_options(Vec::new(), &ExportParams::default());
        assert_eq!((o.queue_depth, o.stripe_cache_bytes), (32, Some(8 << 20)));
        // The same configuration again: the node settings still wait for a restart.
        let again = node.reload_defaults(&new);
        assert_eq!(again.node, ["reactors", "rpc"]);
        assert!(again.arrays.is_empty(), "{again:?}");
        // `force` and `run` are how the configuration's own arrays start, named apart.
        new.run = true;
        let run = node.reload_defaults(&new);
        assert_eq!(
            (run.arrays.len(), run.config_starts.as_slice()),
            (0, &["run"][..])
        );
        node.stop().unwrap();
    }

    /// A certificate renewed in place (the same paths, other bytes) is a changed TLS
    /// setting; the same files read again are not.
    #[test]
    fn a_reload_names_a_certificate_renewed_in_place() {
        use crate::nbd::{TlsConfig, TlsMode};
        let dir = tempfile::tempdir().unwrap();
        let (node, _h) = node_with_one_array(dir.path());
        let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        let issue = || {
            let c = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
            std::fs::write(&cert, c.cert.pem()).unwrap();
            std::fs::write(&key, c.signing_key.serialize_pem()).unwrap();
        };
        let load = || {
            let mut o = ServeOptions::new(Vec::new());
            o.mode = engine::reactor::Mode::Adaptive;
            o.reactors = 2;
            o.nbd_tls =
                Some(TlsConfig::from_pem_files(TlsMode::Require, &cert, &key, None).unwrap());
            o
        };
        issue();
        let first = node.reload_defaults(&load());
        assert_eq!(first.arrays, ["tls, tls_cert, tls_key, tls_ca"]);
        let same = node.reload_defaults(&load());
        assert!(same.arrays.is_empty(), "the same files again: {same:?}");
        issue();
        let renewed = node.reload_defaults(&load());
        assert_eq!(renewed.arrays, ["tls, tls_cert, tls_key, tls_ca"]);
        assert!(renewed.node.is_empty(), "{renewed:?}");
        node.stop().unwrap();
    }

    /// A second array whose superblocks carry a running array's name is refused before
    /// anything is written to its members or bound: its member files are byte-identical
    /// afterwards and its NBD address stays free.
    #[test]
    fn a_start_under_a_running_name_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (node, h) = node_with_one_array(dir.path());
        let devices = created_array(dir.path(), "twin", 3, "alpha");
        let contents =
            || -> Vec<Vec<u8>> { devices.iter().map(|p| std::fs::read(p).unwrap()).collect() };
        let before = contents();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let devs: Vec<String> = devices.iter().map(|p| p.display().to_string()).collect();
        let v = handle_request(
            &*h,
            format!(
                r#"{{"jsonrpc":"2.0","method":"array_start","params":{{"devices":{devs:?},"nbd":["127.0.0.1:{port}"]}},"id":1}}"#
            )
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(v["error"]["code"], codes::ARRAY_NAME_IN_USE, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("nothing was written"),
            "{v}"
        );
        assert!(before == contents(), "the twin's members were written");
        std::net::TcpListener::bind(("127.0.0.1", port)).expect("its NBD address was never bound");
        assert_eq!(node.array_names(), ["alpha"]);
        node.stop().unwrap();
    }

    /// A create whose start fails (its NBD address is taken) says the array exists now
    /// and how to start it; `array_start` then starts it.
    #[test]
    fn a_create_that_cannot_start_says_it_created() {
        let dir = tempfile::tempdir().unwrap();
        let (node, h) = node_with_one_array(dir.path());
        let devs = blank_members(dir.path(), "n", 3);
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let call = |line: String| handle_request(&*h, line.as_bytes()).unwrap();
        let v = call(format!(
            r#"{{"jsonrpc":"2.0","method":"array_create","params":{{"name":"n","level":5,"devices":{devs:?},"assume_clean":true,"nbd":["127.0.0.1:{port}"]}},"id":1}}"#
        ));
        assert_eq!(v["error"]["code"], codes::ARRAY_START_FAILED, "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("the array was created (uuid ")
                && msg.contains(&format!("ferroraid start {}", devs.join(" "))),
            "{msg}"
        );
        drop(taken);
        let v = start_on(&h, &devs);
        assert_eq!(v["result"]["array"]["name"], "n", "{v}");
        node.stop().unwrap();
    }

    /// A start refused by assembly names its reason once: the assembly error quotes the
    /// superblock error it wraps, which anyhow's `{:#}` printed a second time.
    #[test]
    fn a_refused_start_says_why_once() {
        let dir = tempfile::tempdir().unwrap();
        let (node, h) = node_with_one_array(dir.path());
        let devs = blank_members(dir.path(), "z", 3);
        let v = start_on(&h, &devs);
        let msg = v["error"]["message"].as_str().unwrap();
        assert_eq!(msg.matches("no md superblock").count(), 1, "{msg}");
        node.stop().unwrap();
    }

    /// Relative device paths are refused by the node (it would resolve them in its own
    /// working directory, not the client's) before anything is written.
    #[test]
    fn relative_device_paths_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (node, h) = node_with_one_array(dir.path());
        let call = |line: &str| handle_request(&*h, line.as_bytes()).unwrap();
        for line in [
            r#"{"jsonrpc":"2.0","method":"array_create","params":{"name":"r","level":5,"devices":["r0.img","r1.img","r2.img"]},"id":1}"#,
            r#"{"jsonrpc":"2.0","method":"array_start","params":{"devices":["r0.img","r1.img","r2.img"]},"id":1}"#,
            r#"{"jsonrpc":"2.0","method":"member_add","params":{"array":"alpha","device":"r0.img"},"id":1}"#,
        ] {
            let v = call(line);
            assert_eq!(v["error"]["code"], codes::INVALID_PARAMS, "{line}: {v}");
            assert!(
                v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("is a relative path"),
                "{v}"
            );
        }
        assert!(!std::path::Path::new("r0.img").exists());
        node.stop().unwrap();
    }

    /// A member smaller than the data area its superblock gives is refused at assembly,
    /// before anything is written (it was "started", clients hung on it, and the error
    /// came at stop, with the member recorded missing).
    #[test]
    fn a_member_too_small_for_its_data_area_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (node, h) = node_with_one_array(dir.path());
        let devices = created_array(dir.path(), "s", 3, "small");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&devices[2])
            .and_then(|f| f.set_len(8 << 20))
            .unwrap();
        let contents =
            || -> Vec<Vec<u8>> { devices.iter().map(|p| std::fs::read(p).unwrap()).collect() };
        let before = contents();
        let devs: Vec<String> = devices.iter().map(|p| p.display().to_string()).collect();
        let v = start_on(&h, &devs);
        assert_eq!(v["error"]["code"], codes::ARRAY_START_FAILED, "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("s2.img (role 2): it is smaller than the data offset plus the data area")
                && msg.contains("nothing was written"),
            "{msg}"
        );
        assert!(before == contents(), "the members were written");
        assert_eq!(node.array_names(), ["alpha"]);
        node.stop().unwrap();
    }

    /// A member given twice under another name (a hard link) is refused as the same
    /// device, not as "in use" by another process.
    #[test]
    fn a_member_given_twice_is_named_the_same_device() {
        let dir = tempfile::tempdir().unwrap();
        let (node, h) = node_with_one_array(dir.path());
        let devices = created_array(dir.path(), "s", 3, "twice");
        let link = dir.path().join("s0-again.img");
        std::fs::hard_link(&devices[0], &link).unwrap();
        let mut devs: Vec<String> = devices.iter().map(|p| p.display().to_string()).collect();
        devs.push(link.display().to_string());
        let v = start_on(&h, &devs);
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("are the same device"), "{msg}");
        node.stop().unwrap();
    }

    /// A changed CHAP secret (initiator's or mutual) is a changed `iscsi_chap` setting,
    /// though `ChapConfig`'s Debug shows neither secret.
    #[test]
    fn a_reload_names_a_changed_chap_secret() {
        use crate::iscsi::ChapConfig;
        let dir = tempfile::tempdir().unwrap();
        let (node, _h) = node_with_one_array(dir.path());
        let with = |secret: &str, mutual: &str| {
            let mut o = ServeOptions::new(Vec::new());
            o.mode = engine::reactor::Mode::Adaptive;
            o.reactors = 2;
            o.iscsi_config.chap = Some(ChapConfig {
                user: "u".into(),
                secret: secret.into(),
                mutual: Some(("t".into(), mutual.into())),
                require_mutual: false,
            });
            o
        };
        assert_eq!(
            node.reload_defaults(&with("initiator-1", "target-1"))
                .arrays,
            ["iscsi_chap"]
        );
        assert!(node
            .reload_defaults(&with("initiator-1", "target-1"))
            .arrays
            .is_empty());
        for (secret, mutual) in [("initiator-2", "target-1"), ("initiator-2", "target-2")] {
            let changed = node.reload_defaults(&with(secret, mutual));
            assert_eq!(changed.arrays, ["iscsi_chap"], "{secret} {mutual}");
        }
        node.stop().unwrap();
    }

    /// Routing by name is exact: a short name holding a `:` (`q:b:c` runs as `b:c`) never
    /// answers for another array's name (`c`), and md's full `host:name` works too; a
    /// create whose name would run under a running array's name is refused before it
    /// writes anything, and an empty name after `host:` is refused.
    #[test]
    fn names_route_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let (node, h) = node_with_one_array(dir.path());
        let files = |prefix: &str| -> Vec<String> {
            (0..3)
                .map(|i| {
                    let p = dir.path().join(format!("{prefix}{i}.img"));
                    std::fs::File::create(&p)
                        .and_then(|f| f.set_len(16 << 20))
                        .unwrap();
                    p.display().to_string()
                })
                .collect()
        };
        let call = |line: String| handle_request(&*h, line.as_bytes()).unwrap();
        let create = |name: &str, devs: &[String]| {
            call(format!(
                r#"{{"jsonrpc":"2.0","method":"array_create","params":{{"name":{name:?},"level":5,"devices":{devs:?}}},"id":1}}"#
            ))
        };
        let c = files("c");
        let v = create("c", &c);
        assert_eq!(v["result"]["array"], "c", "{v}");
        let v = create("q:b:c", &files("e"));
        assert_eq!(v["result"]["status"]["array"]["name"], "b:c", "{v}");
        assert_eq!(node.array_names(), ["alpha", "b:c", "c"]);
        let status_of = |want: &str| {
            call(format!(
                r#"{{"jsonrpc":"2.0","method":"array_status","params":{{"array":{want:?}}},"id":1}}"#
            ))
        };
        let uuid = |v: serde_json::Value| v["result"]["array"]["array_uuid"].clone();
        let c_uuid = uuid(status_of("c"));
        let bc_uuid = uuid(status_of("b:c"));
        assert_ne!(c_uuid, bc_uuid);
        assert_eq!(uuid(status_of("q:b:c")), bc_uuid);
        assert_eq!(status_of("b")["error"]["code"], codes::NO_SUCH_ARRAY);
        // Would run as `c`: refused, and c's members untouched (its devices were not
        // even opened: the refusal comes first).
        let fresh = files("f");
        let v = create("other:c", &fresh);
        assert_eq!(v["error"]["code"], codes::ARRAY_NAME_IN_USE, "{v}");
        assert!(matches!(
            crate::examine::examine_device(std::path::Path::new(&fresh[0])),
            crate::examine::ExamineEntry::Failure(_)
        ));
        let v = create("h:", &fresh);
        assert_eq!(v["error"]["code"], codes::INVALID_PARAMS, "{v}");
        // Stopping `c` stops c, not b:c.
        let v =
            call(r#"{"jsonrpc":"2.0","method":"array_stop","params":{"array":"c"},"id":1}"#.into());
        assert_eq!(v["result"]["array"], "c", "{v}");
        assert_eq!(node.array_names(), ["alpha", "b:c"]);
        node.stop().unwrap();
    }

    /// Mutated and random requests for the process methods (`array_start`, `array_stop`,
    /// `array_create`, `array_list`, `array_create_progress`) and routed per-array methods
    /// against a running node: every answer is a JSON-RPC response, none an internal
    /// error, and the running array is untouched (still listed, still clean of failures).
    #[test]
    fn garbage_requests_leave_the_running_array_alone() {
        let dir = tempfile::tempdir().unwrap();
        let (node, h) = node_with_one_array(dir.path());
        let d = dir.path().display();
        let valid: Vec<String> = vec![
            format!(r#"{{"jsonrpc":"2.0","method":"array_start","params":{{"devices":["{d}/m0.img","{d}/m1.img"],"force":true,"nbd":["127.0.0.1:1"]}},"id":1}}"#),
            r#"{"jsonrpc":"2.0","method":"array_stop","params":{"array":"zz-nope"},"id":2}"#.into(),
            r#"{"jsonrpc":"2.0","method":"array_create","params":{"name":"zz-new","level":5,"devices":["/nonexistent/q0","/nonexistent/q1","/nonexistent/q2"],"chunk_bytes":65536},"id":3}"#.into(),
            r#"[{"jsonrpc":"2.0","method":"array_list","id":4},{"jsonrpc":"2.0","method":"array_create_progress","id":5}]"#.into(),
            r#"{"jsonrpc":"2.0","method":"process_stop","params":{"array":"zz-nope"},"id":6}"#.into(),
            r#"{"jsonrpc":"2.0","method":"array_status","params":{"array":"alpha"},"id":7}"#.into(),
        ];
        let lines: Vec<&[u8]> = valid.iter().map(|l| l.as_bytes()).collect();
        crate::rpc::tests::feed_garbage(&*h, &lines, 3000, 0x2545_f491_4f6c_dd1d);
        // The unmutated requests: each refused with its own clear error.
        let first = |line: &str| handle_request(&*h, line.as_bytes()).unwrap();
        let v = first(&valid[0]);
        assert_eq!(v["error"]["code"], codes::ARRAY_START_FAILED, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("in use"),
            "{v}"
        );
        let v = first(&valid[1]);
        assert_eq!(v["error"]["code"], codes::NO_SUCH_ARRAY, "{v}");
        let v = first(&valid[2]);
        assert_eq!(v["error"]["code"], codes::ARRAY_CREATE_FAILED, "{v}");
        assert_eq!(node.array_names(), ["alpha"]);
        let st = node.with_array("alpha", Target::status).unwrap();
        assert!(st
            .members
            .iter()
            .all(|m| m.state == crate::status::MemberState::Active));
        node.stop().unwrap();
    }
}
