//! NVMe over TCP (NVMe/TCP transport specification 1.0): the array exported as namespace 1
//! of one NVM subsystem, served on the reactors beside NBD and iSCSI, with a discovery
//! controller on every portal.
//!
//! The pieces:
//! - [`pdu`]: the PDU layer as pure code (every PDU type, SQE/SGL/CQE, the incremental
//!   allocation-free parser with digests and fatal-error reporting, encoders, ICReq/ICResp
//!   negotiation).
//! - [`spec`]: command-level facts, pure: status codes, properties, Identify data, log
//!   pages, the discovery log.
//! - a listener thread per portal: accepts TCP connections and hands each to a reactor
//!   (round robin), nothing else — the ICReq, Connect and everything after run on the
//!   reactor.
//! - [`NvmfFrontend`]: one per reactor; each TCP connection is one queue pair (TCP 1.0
//!   §3.2), served entirely by the reactor that adopted it: the admin queue (Fabrics
//!   Connect/Property Get/Set, Identify, Get Log Page, features, Keep Alive with timeout
//!   enforcement, AER held), the discovery controller, and I/O queues (Read, Write with
//!   FUA, Flush, Write Zeroes, Dataset Management deallocate, Compare) against the array.
//!   Contexts and buffers are allocated when a queue connects; the data path takes them
//!   from free lists.
//! - [`host`]: a small blocking NVMe/TCP host (initiator) for tests and the `nvmf-load`
//!   load generator in `bench/`.
//!
//! Controllers are the only state shared between reactors: a registry behind a mutex,
//! touched by Connect and by the admin queue, never per I/O; an I/O queue checks its
//! controller's `dead` flag once per loop turn. What is built and the spec section of each
//! rule: `docs/NVMF.md`.

pub mod frontend;
pub mod host;
pub mod local;
pub mod pdu;
pub mod spec;

use std::collections::{HashMap, HashSet};
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{
    AtomicBool, AtomicU16, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tracing::{info, warn};

pub use frontend::NvmfFrontend;
use spec::{AnaState, CtrlKind, IoCounters, Portal, Subsystem};

/// The IANA port for NVMe/TCP I/O controllers (TCP 1.0 §3.1.2).
pub const DEFAULT_PORT: u16 = 4420;
/// The IANA port for NVMe/TCP discovery (TCP 1.0 §3.1.2; `nvme discover`'s default).
pub const DISCOVERY_PORT: u16 = 8009;

/// Tunables of the NVMe/TCP target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmfConfig {
    /// Connections (queue pairs) one reactor serves at most; more are refused at accept.
    pub max_connections_per_reactor: usize,
    /// Data buffers of [`spec::MAX_TRANSFER`] bytes per reactor, for transfers above
    /// 4 KiB (smaller ones use the queue's own 4 KiB per-command buffers). One connection
    /// holds at most a quarter of them (at least 2), so a host that withholds the data of
    /// its writes cannot starve the reactor's other queues. A command that finds none
    /// waits (in order) without stopping its queue's receive path.
    pub buffers_per_reactor: u16,
    /// Discovery controllers connected with KATO 0 are closed after this long (nvmet's
    /// 120 s rule for non-persistent discovery controllers).
    pub discovery_idle: Duration,
    /// A connection that has not completed its Fabrics Connect this long after accept is
    /// closed, so idle sockets cannot hold the connection table (a host sends ICReq and
    /// Connect at once; Linux's `nvme connect` well within a second even under QEMU's
    /// emulation). The same role as NBD's handshake timeout.
    pub connect_timeout: Duration,
}

impl Default for NvmfConfig {
    fn default() -> Self {
        Self {
            max_connections_per_reactor: 256,
            buffers_per_reactor: 64,
            discovery_idle: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// Why the target could not start.
#[derive(Debug, Error)]
pub enum NvmfError {
    /// A listen address could not be bound.
    #[error("NVMe/TCP listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: io::Error,
    },
    /// A thread could not start.
    #[error("starting the NVMe/TCP listener: {0}")]
    Spawn(io::Error),
    /// Bad tunables.
    #[error("NVMe/TCP configuration: {0}")]
    Config(String),
}

/// Per-queue counters, written by the reactor serving the queue (relaxed, on their own
/// cache line per queue) and read by the admin queue (SMART log) and `status`.
#[derive(Debug, Default)]
pub struct QueueStats {
    /// Bytes read by Read commands.
    pub bytes_read: AtomicU64,
    /// Bytes written by Write commands.
    pub bytes_written: AtomicU64,
    /// Read commands completed successfully.
    pub reads: AtomicU64,
    /// Write commands completed successfully.
    pub writes: AtomicU64,
    /// Commands completed with an error status.
    pub errors: AtomicU64,
}

/// A controller: one host association (admin queue plus its I/O queues), dynamic model
/// (Base 2.0 §3.1.1: the controller is created by the admin queue's Connect).
pub(crate) struct Ctrl {
    pub(crate) cntlid: u16,
    pub(crate) kind: CtrlKind,
    pub(crate) hostnqn: String,
    pub(crate) hostid: [u8; 16],
    /// CSTS.RDY: I/O queues may connect.
    pub(crate) ready: AtomicBool,
    /// The association is over (admin queue closed, keep-alive expired): every queue of
    /// it closes on its reactor's next turn.
    pub(crate) dead: AtomicBool,
    /// I/O queues granted by Set Features Number of Queues (0: not yet set).
    pub(crate) io_queues: AtomicU16,
    /// Connected I/O queues, by QID, with their counters.
    pub(crate) queues: Mutex<HashMap<u16, Arc<QueueStats>>>,
    /// The portal the admin queue's Connect came in through: its ANA state is the one
    /// this controller reports and enforces (contract: ANA state per portal).
    pub(crate) portal: Arc<PortalState>,
    /// Asynchronous Event Configuration (Set Features 0Bh CDW11), written by the admin
    /// queue's reactor; read by `nvmf_portal_set_ana` to count the controllers notified.
    pub(crate) aec: AtomicU32,
    /// An ANA change notice was sent (or is queued) and the host has not yet read log
    /// 0Ch without RAE: further ANA notices are masked (Base 2.0 §5.2).
    pub(crate) ana_masked: AtomicBool,
}

impl Ctrl {
    pub(crate) fn queues(&self) -> MutexGuard<'_, HashMap<u16, Arc<QueueStats>>> {
        self.queues
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The I/O queues' counters summed.
    pub(crate) fn counters(&self) -> IoCounters {
        let mut c = IoCounters::default();
        for q in self.queues().values() {
            c.bytes_read += q.bytes_read.load(Ordering::Relaxed);
            c.bytes_written += q.bytes_written.load(Ordering::Relaxed);
            c.reads += q.reads.load(Ordering::Relaxed);
            c.writes += q.writes.load(Ordering::Relaxed);
        }
        c
    }
}

/// The controller registry.
pub(crate) struct Ctrls {
    next: u16,
    by_id: HashMap<u16, Arc<Ctrl>>,
}

/// One portal (a listen address) of the subsystem: its ANA state and what the reactors
/// need to know of it. The state is read once per I/O command (an atomic load, never a
/// lock); the management plane writes it.
pub(crate) struct PortalState {
    /// The bound address (the portal's name is its `Display`).
    pub(crate) addr: SocketAddr,
    /// Port ID in the discovery log (assigned at add, never reused).
    pub(crate) portid: u16,
    /// [`AnaState`] as its log-page code.
    pub(crate) ana: AtomicU8,
    /// ANA change count of this portal (Base 2.0 §5.16.1.13): the subsystem-wide count
    /// of ANA changes at this portal's last change (or creation), so it never goes back,
    /// even for a portal removed and added again.
    pub(crate) chgcnt: AtomicU64,
    /// Removed over JSON-RPC: its listener stops, and every connection accepted on it
    /// closes on its reactor's next turn.
    pub(crate) removed: AtomicBool,
    /// Connections accepted on it and not yet freed (see [`PortalConn`]).
    pub(crate) conns: AtomicUsize,
}

impl PortalState {
    /// The ANA state now.
    pub(crate) fn ana(&self) -> AnaState {
        AnaState::from_code(self.ana.load(Ordering::Acquire)).unwrap_or(AnaState::Inaccessible)
    }
}

/// A connection's hold on its portal: counts in [`PortalState::conns`] until dropped
/// (with the connection's slot, or with a connection never adopted).
pub(crate) struct PortalConn(pub(crate) Arc<PortalState>);

impl PortalConn {
    fn new(p: &Arc<PortalState>) -> Self {
        p.conns.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(p))
    }
}

impl Drop for PortalConn {
    fn drop(&mut self) {
        self.0.conns.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A listening portal: its state and its listener thread.
struct PortalEntry {
    state: Arc<PortalState>,
    thread: Option<JoinHandle<()>>,
}

/// State shared by the listeners and the front-ends.
pub(crate) struct Shared {
    pub(crate) subsystem: Subsystem,
    pub(crate) config: NvmfConfig,
    /// The portals listening now, in the order they were added (discovery log entries;
    /// wildcards are replaced by the address the host reached). Locked by the management
    /// plane, listener start/stop and discovery log reads, never per I/O.
    portals: Mutex<Vec<PortalEntry>>,
    /// Subsystem-wide ANA change counter ([`PortalState::chgcnt`]).
    ana_chgcnt: AtomicU64,
    /// Discovery log GENCTR: bumped at every portal added or removed.
    pub(crate) disc_genctr: AtomicU64,
    next_portid: AtomicU16,
    /// Host NQNs allowed to connect to the subsystem (empty: any host).
    pub(crate) allow_hosts: Vec<String>,
    /// Host NQNs whose refused Connect was logged (each is logged once).
    refused_logged: Mutex<HashSet<String>>,
    pub(crate) shutdown: AtomicBool,
    pub(crate) ctrls: Mutex<Ctrls>,
    pub(crate) inboxes: Vec<Arc<ArrayQueue<NewConn>>>,
    /// Connections held per reactor (adopted and not yet freed).
    pub(crate) held: Vec<AtomicUsize>,
    pub(crate) next_conn: AtomicU64,
}

/// Host NQNs remembered as "refusal logged" at most (beyond it, refusals are logged
/// every time rather than the set growing without bound).
const REFUSED_LOG_MAX: usize = 1024;

impl Shared {
    /// The state of a target for `subsystem` with `reactors` front-ends, no portal yet.
    pub(crate) fn new(
        subsystem: Subsystem,
        config: NvmfConfig,
        allow_hosts: Vec<String>,
        reactors: usize,
    ) -> Self {
        let inbox_capacity = config.max_connections_per_reactor.max(1);
        Shared {
            subsystem,
            config,
            portals: Mutex::new(Vec::new()),
            ana_chgcnt: AtomicU64::new(0),
            disc_genctr: AtomicU64::new(0),
            next_portid: AtomicU16::new(1),
            allow_hosts,
            refused_logged: Mutex::new(HashSet::new()),
            shutdown: AtomicBool::new(false),
            ctrls: Mutex::new(Ctrls {
                next: 1,
                by_id: HashMap::new(),
            }),
            // A reactor's inbox holds its whole connection limit, as NBD's do: `held`
            // counts the connections in the inbox and in the front-end's table together,
            // and the listeners push only below the limit, so a push finds the inbox full
            // only when two portals' listeners race for the last slot. With a smaller
            // inbox, a reactor that was slow to adopt (a loaded machine, its first turns)
            // made the listener close connections it had room for.
            inboxes: (0..reactors)
                .map(|_| Arc::new(ArrayQueue::new(inbox_capacity)))
                .collect(),
            held: (0..reactors).map(|_| AtomicUsize::new(0)).collect(),
            next_conn: AtomicU64::new(1),
        }
    }

    pub(crate) fn ctrls(&self) -> MutexGuard<'_, Ctrls> {
        self.ctrls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn portal_list(&self) -> MutexGuard<'_, Vec<PortalEntry>> {
        self.portals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether `hostnqn` may connect to the subsystem (the allow-list; empty: any host).
    pub(crate) fn host_allowed(&self, hostnqn: &str) -> bool {
        self.allow_hosts.is_empty() || self.allow_hosts.iter().any(|h| h == hostnqn)
    }

    /// Logs a refused Connect of `hostnqn`, once per host NQN.
    pub(crate) fn log_refused(&self, hostnqn: &str, peer: SocketAddr) {
        let mut g = self
            .refused_logged
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if g.contains(hostnqn) {
            return;
        }
        if g.len() < REFUSED_LOG_MAX {
            g.insert(hostnqn.to_string());
        }
        warn!(%peer, hostnqn,
            "NVMe/TCP Connect refused: host not on the allow-list (logged once per host)");
    }

    /// Creates a controller for a new association; `None` when every CNTLID (1..=FFEFh,
    /// Base 2.2 §6.3) is in use.
    pub(crate) fn new_ctrl(
        &self,
        kind: CtrlKind,
        hostnqn: String,
        hostid: [u8; 16],
        portal: Arc<PortalState>,
    ) -> Option<Arc<Ctrl>> {
        let mut g = self.ctrls();
        for _ in 0..0xFFEF {
            let id = g.next;
            g.next = if g.next >= 0xFFEF { 1 } else { g.next + 1 };
            if let std::collections::hash_map::Entry::Vacant(v) = g.by_id.entry(id) {
                let c = Arc::new(Ctrl {
                    cntlid: id,
                    kind,
                    hostnqn,
                    hostid,
                    ready: AtomicBool::new(false),
                    dead: AtomicBool::new(false),
                    io_queues: AtomicU16::new(0),
                    queues: Mutex::new(HashMap::new()),
                    portal,
                    aec: AtomicU32::new(0),
                    ana_masked: AtomicBool::new(false),
                });
                v.insert(Arc::clone(&c));
                return Some(c);
            }
        }
        None
    }

    pub(crate) fn find_ctrl(&self, cntlid: u16) -> Option<Arc<Ctrl>> {
        self.ctrls().by_id.get(&cntlid).cloned()
    }

    /// Ends an association: its queues close on their next turn, its CNTLID is free.
    pub(crate) fn drop_ctrl(&self, c: &Ctrl) {
        c.dead.store(true, Ordering::Release);
        c.ready.store(false, Ordering::Release);
        self.ctrls().by_id.remove(&c.cntlid);
    }

    /// The discovery log portals as seen from a host connected to `local`.
    pub(crate) fn portals(&self, local: SocketAddr) -> Vec<Portal> {
        self.portal_list()
            .iter()
            .map(|e| {
                let a = e.state.addr;
                let ip = if a.ip().is_unspecified() {
                    local.ip()
                } else {
                    a.ip()
                };
                Portal {
                    traddr: ip.to_string(),
                    trsvcid: a.port(),
                    ipv6: ip.is_ipv6(),
                    portid: e.state.portid,
                }
            })
            .collect()
    }

    /// Binds `addr` and starts its listener thread, as a portal in state `ana`; returns
    /// the bound address (the real port when 0 was asked).
    fn add_portal(
        self: &Arc<Self>,
        addr: SocketAddr,
        ana: AnaState,
    ) -> Result<SocketAddr, NvmfError> {
        let l = TcpListener::bind(addr).map_err(|source| NvmfError::Listen { addr, source })?;
        let bound = l
            .local_addr()
            .map_err(|source| NvmfError::Listen { addr, source })?;
        let state = self.new_portal_state(bound, ana);
        let sh = Arc::clone(self);
        let st = Arc::clone(&state);
        let t = std::thread::Builder::new()
            .name("nvmf-listen".into())
            .spawn(move || accept_loop(l, sh, st))
            .map_err(NvmfError::Spawn)?;
        self.register_portal(state, Some(t));
        Ok(bound)
    }

    /// A portal's state at `addr` in state `ana`, with the next port ID, not yet listed.
    fn new_portal_state(&self, addr: SocketAddr, ana: AnaState) -> Arc<PortalState> {
        Arc::new(PortalState {
            addr,
            portid: self.next_portid.fetch_add(1, Ordering::Relaxed),
            ana: AtomicU8::new(ana.code()),
            chgcnt: AtomicU64::new(self.ana_chgcnt.load(Ordering::Acquire)),
            removed: AtomicBool::new(false),
            conns: AtomicUsize::new(0),
        })
    }

    /// Lists a portal (discovery log, management) with its listener thread, if any.
    fn register_portal(&self, state: Arc<PortalState>, thread: Option<JoinHandle<()>>) {
        self.portal_list().push(PortalEntry { state, thread });
        self.disc_genctr.fetch_add(1, Ordering::AcqRel);
    }

    /// Stops every listener (shutdown), joining their threads.
    fn stop_listeners(&self) {
        let threads: Vec<JoinHandle<()>> = self
            .portal_list()
            .iter_mut()
            .filter_map(|e| e.thread.take())
            .collect();
        for t in threads {
            let _ = t.join();
        }
    }
}

/// A connection accepted by a listener, for a reactor to adopt.
pub(crate) struct NewConn {
    pub(crate) id: u64,
    pub(crate) stream: TcpStream,
    pub(crate) peer: SocketAddr,
    pub(crate) local: SocketAddr,
    /// The portal it was accepted on.
    pub(crate) portal: PortalConn,
    /// The connection's receive buffer ([`frontend::RX_BYTES`]), allocated here so the
    /// reactor does not.
    pub(crate) rx: Box<[u8]>,
}

fn accept_loop(l: TcpListener, shared: Arc<Shared>, portal: Arc<PortalState>) {
    if let Err(e) = l.set_nonblocking(true) {
        warn!("NVMe/TCP listener: {e}");
        return;
    }
    let mut next_reactor = 0usize;
    while !shared.shutdown.load(Ordering::Acquire) && !portal.removed.load(Ordering::Acquire) {
        match l.accept() {
            Ok((s, peer)) => {
                let local = s.local_addr().unwrap_or(peer);
                if let Err(e) = s.set_nonblocking(true).and_then(|()| s.set_nodelay(true)) {
                    warn!(%peer, "NVMe/TCP connection setup: {e}");
                    continue;
                }
                let n = shared.inboxes.len();
                // Round robin, skipping reactors at their connection limit.
                let Some(r) = (0..n).map(|k| (next_reactor + k) % n).find(|&r| {
                    shared.held[r].load(Ordering::Acquire)
                        < shared.config.max_connections_per_reactor
                }) else {
                    warn!(%peer, "closing: every reactor is at its NVMe/TCP connection limit");
                    continue;
                };
                next_reactor = (r + 1) % n;
                let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
                shared.held[r].fetch_add(1, Ordering::AcqRel);
                if shared.inboxes[r]
                    .push(NewConn {
                        id,
                        stream: s,
                        peer,
                        local,
                        portal: PortalConn::new(&portal),
                        rx: vec![0u8; frontend::RX_BYTES].into_boxed_slice(),
                    })
                    .is_err()
                {
                    // The inbox holds the limit's worth: only two portals' listeners
                    // racing for a reactor's last slot (each read `held` below the limit)
                    // can overfill it.
                    shared.held[r].fetch_sub(1, Ordering::AcqRel);
                    warn!(%peer, reactor = r, "closing: reactor inbox full");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => {
                warn!("NVMe/TCP accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// One portal as `nvmf_portal_list` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortalReport {
    /// The portal's name: its bound address (`127.0.0.1:4420`).
    pub portal: String,
    /// Its ANA state.
    pub ana_state: AnaState,
    /// I/O controllers whose association (admin queue Connect) came in through it.
    pub controllers: usize,
    /// TCP connections (queue pairs of any kind) accepted on it and still open.
    pub connections: usize,
}

/// The result of `nvmf_portal_list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortalListReport {
    /// The portals, in the order they were added.
    pub portals: Vec<PortalReport>,
}

/// The result of `nvmf_portal_set_ana`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortalSetAnaReport {
    /// The portal.
    pub portal: String,
    /// Its ANA state now.
    pub ana_state: AnaState,
    /// I/O controllers of the portal that were sent (or will be sent, at their next
    /// Asynchronous Event Request) an ANA change notice: those that enabled the notice
    /// (Set Features 0Bh bit 11) and had no earlier one unacknowledged. 0 when the state
    /// did not change.
    pub notified: usize,
}

/// The result of `nvmf_portal_remove`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortalRemoveReport {
    /// The portal.
    pub portal: String,
    /// Connections of the portal that were closed.
    pub closed: usize,
}

/// The result of `nvmf_portal_add`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortalAddReport {
    /// The portal (the bound address).
    pub portal: String,
    /// Its ANA state.
    pub ana_state: AnaState,
}

/// Why a portal operation was refused.
#[derive(Debug, Error)]
pub enum PortalError {
    /// The portal is not an `IP:PORT` address.
    #[error("portal {0:?} is not an address IP:PORT (e.g. 127.0.0.1:4420)")]
    BadAddress(String),
    /// No portal listens on that address.
    #[error("no NVMe/TCP portal {0}")]
    Unknown(String),
    /// `portal_add` of an address already listening.
    #[error("NVMe/TCP portal {0} is already present")]
    Exists(String),
    /// `portal_add` could not bind the address.
    #[error("cannot listen on {portal}: {source}")]
    Bind {
        /// The address.
        portal: String,
        /// Why.
        source: io::Error,
    },
    /// The listener thread could not start.
    #[error("starting the listener of {portal}: {source}")]
    Spawn {
        /// The address.
        portal: String,
        /// Why.
        source: io::Error,
    },
}

/// How long `portal_remove` waits for the reactors to close the portal's connections.
const REMOVE_WAIT: Duration = Duration::from_secs(5);

fn parse_portal(portal: &str) -> Result<SocketAddr, PortalError> {
    portal
        .trim()
        .parse()
        .map_err(|_| PortalError::BadAddress(portal.to_string()))
}

/// Reads the target's controllers and queue counters, and manages its portals, from
/// anywhere (the management socket): the registry and portal-list locks only, never a
/// reactor.
#[derive(Clone)]
pub struct StatsHandle(Arc<Shared>);

impl StatsHandle {
    fn find(&self, portal: &str) -> Result<Arc<PortalState>, PortalError> {
        let addr = parse_portal(portal)?;
        self.0
            .portal_list()
            .iter()
            .find(|e| e.state.addr == addr)
            .map(|e| Arc::clone(&e.state))
            .ok_or_else(|| PortalError::Unknown(addr.to_string()))
    }

    /// I/O controllers whose association came in through `p`.
    fn ctrls_of(&self, p: &Arc<PortalState>) -> Vec<Arc<Ctrl>> {
        self.0
            .ctrls()
            .by_id
            .values()
            .filter(|c| c.kind == CtrlKind::Io && Arc::ptr_eq(&c.portal, p))
            .cloned()
            .collect()
    }

    /// The portals now (`nvmf_portal_list`).
    pub fn portal_list(&self) -> PortalListReport {
        let states: Vec<Arc<PortalState>> = self
            .0
            .portal_list()
            .iter()
            .map(|e| Arc::clone(&e.state))
            .collect();
        PortalListReport {
            portals: states
                .iter()
                .map(|p| PortalReport {
                    portal: p.addr.to_string(),
                    ana_state: p.ana(),
                    controllers: self.ctrls_of(p).len(),
                    connections: p.conns.load(Ordering::Acquire),
                })
                .collect(),
        }
    }

    /// Sets the ANA state of a portal (`nvmf_portal_set_ana`). On a change, every I/O
    /// controller of the portal with ANA change notices enabled gets one Asynchronous
    /// Event (type 2h notice, info 03h, log 0Ch) on its reactor's next turn, or at its
    /// next AER if none is outstanding; I/O through the portal in state inaccessible
    /// completes with SCT 3h / SC 02h from then on.
    ///
    /// # Errors
    /// [`PortalError::BadAddress`], [`PortalError::Unknown`].
    pub fn portal_set_ana(
        &self,
        portal: &str,
        state: AnaState,
    ) -> Result<PortalSetAnaReport, PortalError> {
        let p = self.find(portal)?;
        let old = p.ana.swap(state.code(), Ordering::AcqRel);
        let mut notified = 0;
        if old != state.code() {
            // Counted before the change is published: once it is, a reactor may already
            // have sent the notice and masked the next one.
            notified = self
                .ctrls_of(&p)
                .iter()
                .filter(|c| {
                    !c.dead.load(Ordering::Acquire)
                        && c.aec.load(Ordering::Acquire) & spec::AEC_ANA_CHANGE != 0
                        && !c.ana_masked.load(Ordering::Acquire)
                })
                .count();
            // The state first (above), then the count the reactors watch (Release): a
            // reactor that sees the new count reads the new state.
            let n = self.0.ana_chgcnt.fetch_add(1, Ordering::AcqRel) + 1;
            p.chgcnt.store(n, Ordering::Release);
            info!(portal = %p.addr, from = ?AnaState::from_code(old), to = ?state, notified,
                "NVMe/TCP portal ANA state changed");
        }
        Ok(PortalSetAnaReport {
            portal: p.addr.to_string(),
            ana_state: state,
            notified,
        })
    }

    /// Removes a portal (`nvmf_portal_remove`): its listener stops (new connections are
    /// refused), and every connection accepted on it is closed (their controllers end);
    /// waits up to 5 s for the reactors to close them.
    ///
    /// # Errors
    /// [`PortalError::BadAddress`], [`PortalError::Unknown`].
    pub fn portal_remove(&self, portal: &str) -> Result<PortalRemoveReport, PortalError> {
        let addr = parse_portal(portal)?;
        let entry = {
            let mut g = self.0.portal_list();
            let i = g
                .iter()
                .position(|e| e.state.addr == addr)
                .ok_or_else(|| PortalError::Unknown(addr.to_string()))?;
            g.remove(i)
        };
        self.0.disc_genctr.fetch_add(1, Ordering::AcqRel);
        // Counted before the reactors see the flag (they close at once); the listener
        // may still accept one more before it stops, which is then closed too.
        let before = entry.state.conns.load(Ordering::Acquire);
        entry.state.removed.store(true, Ordering::Release);
        if let Some(t) = entry.thread {
            let _ = t.join();
        }
        let closed = before.max(entry.state.conns.load(Ordering::Acquire));
        let deadline = std::time::Instant::now() + REMOVE_WAIT;
        while entry.state.conns.load(Ordering::Acquire) > 0 && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        info!(portal = %addr, closed, "NVMe/TCP portal removed");
        Ok(PortalRemoveReport {
            portal: addr.to_string(),
            closed,
        })
    }

    /// Adds a portal (`nvmf_portal_add`): listens on `portal` in ANA state `state`
    /// (default optimized).
    ///
    /// # Errors
    /// [`PortalError::BadAddress`], [`PortalError::Exists`], [`PortalError::Bind`],
    /// [`PortalError::Spawn`].
    pub fn portal_add(
        &self,
        portal: &str,
        state: Option<AnaState>,
    ) -> Result<PortalAddReport, PortalError> {
        let addr = parse_portal(portal)?;
        if self.0.portal_list().iter().any(|e| e.state.addr == addr) {
            return Err(PortalError::Exists(addr.to_string()));
        }
        let state = state.unwrap_or(AnaState::Optimized);
        let bound = self.0.add_portal(addr, state).map_err(|e| match e {
            NvmfError::Spawn(source) => PortalError::Spawn {
                portal: addr.to_string(),
                source,
            },
            NvmfError::Listen { source, .. } => PortalError::Bind {
                portal: addr.to_string(),
                source,
            },
            NvmfError::Config(m) => PortalError::Bind {
                portal: addr.to_string(),
                source: io::Error::other(m),
            },
        })?;
        info!(portal = %bound, ?state, "NVMe/TCP portal added");
        Ok(PortalAddReport {
            portal: bound.to_string(),
            ana_state: state,
        })
    }

    /// The controllers now, by CNTLID, each with its I/O queues by QID.
    pub fn report(&self) -> crate::status::NvmfReport {
        let ctrls: Vec<Arc<Ctrl>> = self.0.ctrls().by_id.values().cloned().collect();
        let mut controllers: Vec<crate::status::NvmfControllerReport> = ctrls
            .iter()
            .map(|c| {
                let mut queues: Vec<crate::status::NvmfQueueReport> = c
                    .queues()
                    .iter()
                    .map(|(&qid, s)| crate::status::NvmfQueueReport {
                        qid,
                        reads: s.reads.load(Ordering::Relaxed),
                        writes: s.writes.load(Ordering::Relaxed),
                        bytes_read: s.bytes_read.load(Ordering::Relaxed),
                        bytes_written: s.bytes_written.load(Ordering::Relaxed),
                        errors: s.errors.load(Ordering::Relaxed),
                    })
                    .collect();
                queues.sort_by_key(|q| q.qid);
                crate::status::NvmfControllerReport {
                    cntlid: c.cntlid,
                    kind: match c.kind {
                        CtrlKind::Io => "io".into(),
                        CtrlKind::Discovery => "discovery".into(),
                    },
                    hostnqn: c.hostnqn.clone(),
                    queues,
                }
            })
            .collect();
        controllers.sort_by_key(|c| c.cntlid);
        crate::status::NvmfReport { controllers }
    }
}

/// Builds an [`NvmfServer`].
pub struct NvmfServerBuilder {
    subsystem: Subsystem,
    config: NvmfConfig,
    listen: Vec<SocketAddr>,
    allow_hosts: Vec<String>,
}

impl NvmfServerBuilder {
    /// Listens on a TCP address (port 0 picks a free one; see [`NvmfServer::addrs`]).
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen.push(addr);
        self
    }

    /// Replaces the tunables.
    pub fn config(mut self, config: NvmfConfig) -> Self {
        self.config = config;
        self
    }

    /// Allows `hostnqn` to connect to the subsystem (repeatable). With no host allowed
    /// explicitly, any host may connect; with some, a Connect (admin or I/O queue) from
    /// any other host fails with Connect Invalid Host (SCT 1h, SC 84h; NVMe-oF 1.1
    /// §3.3.1) and the discovery log page lists the subsystem only to allowed hosts
    /// (discovery controllers themselves accept any host, as Linux nvmet's do).
    pub fn allow_host(mut self, hostnqn: impl Into<String>) -> Self {
        self.allow_hosts.push(hostnqn.into());
        self
    }

    /// Binds the sockets, starts the listener threads and returns the server with
    /// `reactors` front-ends (one per reactor, in reactor order).
    ///
    /// # Errors
    /// [`NvmfError`] for bad tunables, an address that cannot be bound, a thread that
    /// cannot start.
    pub fn start(self, reactors: usize) -> Result<(NvmfServer, Vec<NvmfFrontend>), NvmfError> {
        if reactors == 0 || self.config.max_connections_per_reactor == 0 {
            return Err(NvmfError::Config(
                "needs at least one reactor and one connection per reactor".into(),
            ));
        }
        if self.config.max_connections_per_reactor > 0xFFFF {
            return Err(NvmfError::Config(
                "at most 65535 connections per reactor".into(),
            ));
        }
        for h in &self.allow_hosts {
            if h.is_empty() || h.len() > spec::NQN_MAX {
                return Err(NvmfError::Config(format!(
                    "allowed host NQN {h:?}: must be 1 to {} bytes",
                    spec::NQN_MAX
                )));
            }
        }
        let listen = if self.listen.is_empty() {
            vec![SocketAddr::from(([127, 0, 0, 1], DEFAULT_PORT))]
        } else {
            self.listen
        };
        let shared = Arc::new(Shared::new(
            self.subsystem,
            self.config,
            self.allow_hosts,
            reactors,
        ));
        let mut addrs = Vec::new();
        for a in listen {
            match shared.add_portal(a, AnaState::Optimized) {
                Ok(b) => addrs.push(b),
                Err(e) => {
                    shared.shutdown.store(true, Ordering::Release);
                    shared.stop_listeners();
                    return Err(e);
                }
            }
        }
        info!(nqn = %shared.subsystem.nqn, ?addrs, reactors, "NVMe/TCP target listening");
        let frontends = (0..reactors)
            .map(|i| NvmfFrontend::new(i, Arc::clone(&shared)))
            .collect();
        Ok((NvmfServer { shared, addrs }, frontends))
    }
}

/// A running NVMe/TCP target's listeners. Shut it down **before** stopping the reactors
/// (as with the NBD and iSCSI servers): front-ends finish once shutdown was requested and
/// their connections are done.
pub struct NvmfServer {
    shared: Arc<Shared>,
    addrs: Vec<SocketAddr>,
}

impl NvmfServer {
    /// A builder for `subsystem` with default tunables (listening on 127.0.0.1:4420
    /// unless given addresses).
    pub fn builder(subsystem: Subsystem) -> NvmfServerBuilder {
        NvmfServerBuilder {
            subsystem,
            config: NvmfConfig::default(),
            listen: Vec::new(),
            allow_hosts: Vec::new(),
        }
    }

    /// The addresses bound at start (real ports when 0 was asked; portals added or
    /// removed later are in [`StatsHandle::portal_list`]).
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// The subsystem NQN.
    pub fn nqn(&self) -> &str {
        &self.shared.subsystem.nqn
    }

    /// A handle that reads the controllers and their queue counters (for `status`).
    pub fn stats_handle(&self) -> StatsHandle {
        StatsHandle(Arc::clone(&self.shared))
    }

    /// Requests shutdown (listeners stop; connections finish their commands and close)
    /// and joins the listener threads.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.stop_listeners();
    }
}

impl Drop for NvmfServer {
    fn drop(&mut self) {
        self.stop();
    }
}
