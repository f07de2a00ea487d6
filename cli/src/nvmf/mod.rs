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

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use thiserror::Error;
use tracing::{info, warn};

pub use frontend::NvmfFrontend;
use spec::{CtrlKind, IoCounters, Portal, Subsystem};

/// The IANA port for NVMe/TCP I/O controllers (TCP 1.0 §3.1.2).
pub const DEFAULT_PORT: u16 = 4420;
/// The IANA port for NVMe/TCP discovery (TCP 1.0 §3.1.2; `nvme discover`'s default).
pub const DISCOVERY_PORT: u16 = 8009;
/// Connections handed to one reactor waiting to be adopted.
const INBOX_CAPACITY: usize = 64;

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

/// State shared by the listeners and the front-ends.
pub(crate) struct Shared {
    pub(crate) subsystem: Subsystem,
    pub(crate) config: NvmfConfig,
    /// The bound listen addresses (discovery log portals; wildcards are replaced by the
    /// address the host reached).
    pub(crate) listen: Vec<SocketAddr>,
    pub(crate) shutdown: AtomicBool,
    pub(crate) ctrls: Mutex<Ctrls>,
    pub(crate) inboxes: Vec<Arc<ArrayQueue<NewConn>>>,
    /// Connections held per reactor (adopted and not yet freed).
    pub(crate) held: Vec<AtomicUsize>,
    pub(crate) next_conn: AtomicU64,
}

impl Shared {
    pub(crate) fn ctrls(&self) -> MutexGuard<'_, Ctrls> {
        self.ctrls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Creates a controller for a new association; `None` when every CNTLID (1..=FFEFh,
    /// Base 2.2 §6.3) is in use.
    pub(crate) fn new_ctrl(
        &self,
        kind: CtrlKind,
        hostnqn: String,
        hostid: [u8; 16],
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
        self.listen
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let ip = if a.ip().is_unspecified() {
                    local.ip()
                } else {
                    a.ip()
                };
                Portal {
                    traddr: ip.to_string(),
                    trsvcid: a.port(),
                    ipv6: ip.is_ipv6(),
                    portid: (i + 1) as u16,
                }
            })
            .collect()
    }
}

/// A connection accepted by a listener, for a reactor to adopt.
pub(crate) struct NewConn {
    pub(crate) id: u64,
    pub(crate) stream: TcpStream,
    pub(crate) peer: SocketAddr,
    pub(crate) local: SocketAddr,
    /// The connection's receive buffer ([`frontend::RX_BYTES`]), allocated here so the
    /// reactor does not.
    pub(crate) rx: Box<[u8]>,
}

fn accept_loop(l: TcpListener, shared: Arc<Shared>) {
    if let Err(e) = l.set_nonblocking(true) {
        warn!("NVMe/TCP listener: {e}");
        return;
    }
    let mut next_reactor = 0usize;
    while !shared.shutdown.load(Ordering::Acquire) {
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
                        rx: vec![0u8; frontend::RX_BYTES].into_boxed_slice(),
                    })
                    .is_err()
                {
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

/// Reads the target's controllers and queue counters from anywhere (the management
/// socket): the registry lock only, never a reactor.
#[derive(Clone)]
pub struct StatsHandle(Arc<Shared>);

impl StatsHandle {
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
        let listen = if self.listen.is_empty() {
            vec![SocketAddr::from(([127, 0, 0, 1], DEFAULT_PORT))]
        } else {
            self.listen
        };
        let mut bound = Vec::new();
        for a in listen {
            let l = TcpListener::bind(a).map_err(|source| NvmfError::Listen { addr: a, source })?;
            bound.push(l);
        }
        let addrs: Vec<SocketAddr> = bound.iter().filter_map(|l| l.local_addr().ok()).collect();
        let shared = Arc::new(Shared {
            subsystem: self.subsystem,
            config: self.config,
            listen: addrs.clone(),
            shutdown: AtomicBool::new(false),
            ctrls: Mutex::new(Ctrls {
                next: 1,
                by_id: HashMap::new(),
            }),
            inboxes: (0..reactors)
                .map(|_| Arc::new(ArrayQueue::new(INBOX_CAPACITY)))
                .collect(),
            held: (0..reactors).map(|_| AtomicUsize::new(0)).collect(),
            next_conn: AtomicU64::new(1),
        });
        let mut threads = Vec::new();
        for l in bound {
            let sh = Arc::clone(&shared);
            match std::thread::Builder::new()
                .name("nvmf-listen".into())
                .spawn(move || accept_loop(l, sh))
            {
                Ok(t) => threads.push(t),
                Err(e) => {
                    shared.shutdown.store(true, Ordering::Release);
                    for t in threads {
                        let _ = t.join();
                    }
                    return Err(NvmfError::Spawn(e));
                }
            }
        }
        info!(nqn = %shared.subsystem.nqn, ?addrs, reactors, "NVMe/TCP target listening");
        let frontends = (0..reactors)
            .map(|i| NvmfFrontend::new(i, Arc::clone(&shared)))
            .collect();
        Ok((
            NvmfServer {
                shared,
                threads,
                addrs,
            },
            frontends,
        ))
    }
}

/// A running NVMe/TCP target's listeners. Shut it down **before** stopping the reactors
/// (as with the NBD and iSCSI servers): front-ends finish once shutdown was requested and
/// their connections are done.
pub struct NvmfServer {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
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
        }
    }

    /// The bound addresses (real ports when 0 was asked).
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
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for NvmfServer {
    fn drop(&mut self) {
        self.stop();
    }
}
