//! The iSCSI target (RFC 7143): an array exported as LUN 0 of the target
//! `iqn.2026-11.org.ferroraid:<array name>`, served on the reactors beside NBD.
//!
//! The pieces:
//! - [`pdu`]: the PDU wire format and CRC32C digests, pure;
//! - [`text`]: text keys (login and text negotiation), pure;
//! - [`scsi`]: the SCSI block device (SBC-4/SPC-5 subset): CDB decoding, sense data, the
//!   pages answered without the array, pure;
//! - `login`: listener and login threads (parameter negotiation, CHAP one-way and mutual,
//!   discovery sessions with SendTargets), blocking I/O off the reactors;
//! - [`IscsiFrontend`]: one per reactor, the full-feature phase with non-blocking
//!   sockets, a preallocated task and buffer pool and no locks.
//!
//! - [`pr`]: persistent reservations, RESERVE/RELEASE(6) and unit attentions, pure; one
//!   state for the LUN behind a mutex in the shared state, read per command through an
//!   epoch and each session's cached view (see its docs); [`pr_store`]: where the state is
//!   kept while APTPL is set, saved by a persister thread of the server, never on a
//!   reactor.
//!
//! Error recovery level 0 only; one LUN; no protection information.
//! What is and is not implemented, and the compliance-suite results, are in
//! `docs/ISCSI.md`.

pub mod frontend;
pub mod local;
pub mod login;
pub mod member_store;
pub mod pdu;
pub mod pr;
pub mod pr_store;
pub mod scsi;
pub mod text;
pub mod xcopy;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use engine::geometry::ArrayGeometry;
use thiserror::Error;
use tracing::info;

pub use frontend::IscsiFrontend;

use crate::nbd::BufferClass;
use login::NewConn;
use pr::PrState;
use pr_store::ReservationStore;
use scsi::LunInfo;

/// The iSCSI port (IANA, RFC 7143 §13.4 "well-known port 3260").
pub const DEFAULT_PORT: u16 = 3260;
/// Prefix of every target name: the array name follows.
pub const IQN_PREFIX: &str = "iqn.2026-11.org.ferroraid:";

/// CHAP credentials (RFC 7143 §12.1.3, RFC 1994).
#[derive(Clone, PartialEq, Eq)]
pub struct ChapConfig {
    /// The name the initiator must give (CHAP_N).
    pub user: String,
    /// The secret the initiator proves it knows (12 to 16 bytes recommended, §9.2.1).
    pub secret: String,
    /// For mutual CHAP: the target's name and secret, answered when the initiator
    /// challenges (must differ from the initiator's secret).
    pub mutual: Option<(String, String)>,
    /// Refuse initiators that do not challenge the target (only with `mutual`).
    pub require_mutual: bool,
}

impl std::fmt::Debug for ChapConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChapConfig")
            .field("user", &self.user)
            .field("secret", &"<redacted>")
            .field("mutual", &self.mutual.as_ref().map(|(u, _)| u))
            .field("require_mutual", &self.require_mutual)
            .finish()
    }
}

/// Server tunables.
#[derive(Clone, Debug)]
pub struct IscsiConfig {
    /// CHAP authentication; `None`: AuthMethod=None.
    pub chap: Option<ChapConfig>,
    /// Offer CRC32C header and data digests (else only None).
    pub digests: bool,
    /// Our MaxRecvDataSegmentLength, bytes (512..=2^24−1).
    pub max_recv_data: u32,
    /// Largest MaxBurstLength accepted, bytes.
    pub max_burst: u32,
    /// Largest MaxConnections per session.
    pub max_connections: u32,
    /// Data buffer classes of each reactor's pool (one buffer per task). Empty: 128 of
    /// 64 KiB, 32 of 1 MiB, 4 of 4 MiB.
    pub buffers: Vec<BufferClass>,
    /// Largest READ/WRITE, bytes (the Block Limits page's MAXIMUM TRANSFER LENGTH, SBC-4
    /// §6.6.4); longer ones are refused with INVALID FIELD IN CDB. A READ or WRITE longer
    /// than the largest buffer moves through that buffer in buffer-sized windows (a WRITE
    /// solicits each window's Data-Out with R2Ts after writing the previous one). With a
    /// largest buffer below 64 KiB (the default FirstBurstLength) the limit is that buffer.
    pub max_transfer_bytes: u32,
    /// Connections one reactor serves at once.
    pub max_connections_per_reactor: usize,
    /// Longest wait for one login read or write.
    pub login_timeout: Duration,
    /// Longest whole login.
    pub login_deadline: Duration,
    /// After shutdown is requested, how long connections get to finish.
    pub drain_grace: Duration,
    /// Idle time after which the target pings with NOP-In (zero: never).
    pub nop_interval: Duration,
    /// How long a ping may go unanswered before the connection is cut.
    pub nop_timeout: Duration,
    /// How long a connection may leave solicited data (R2Ts) unanswered, holding its
    /// tasks' buffers, before it is cut.
    pub stall_timeout: Duration,
}

impl Default for IscsiConfig {
    /// No CHAP, digests offered, 64 KiB segments, 1 MiB bursts, 4 connections per
    /// session, 64 MiB transfers, 256 connections per reactor, 10 s/60 s login, 10 s drain,
    /// 30 s/15 s keepalive, 30 s for solicited data.
    fn default() -> Self {
        Self {
            chap: None,
            digests: true,
            max_recv_data: 64 << 10,
            max_burst: 1 << 20,
            max_connections: 4,
            buffers: Vec::new(),
            max_transfer_bytes: 64 << 20,
            max_connections_per_reactor: 256,
            login_timeout: Duration::from_secs(10),
            login_deadline: Duration::from_secs(60),
            drain_grace: Duration::from_secs(10),
            nop_interval: Duration::from_secs(30),
            nop_timeout: Duration::from_secs(15),
            stall_timeout: Duration::from_secs(30),
        }
    }
}

/// Invalid iSCSI configuration or a listener that could not start.
#[derive(Debug, Error)]
pub enum IscsiError {
    /// Tunables out of range.
    #[error("iSCSI: {0}")]
    Config(String),
    /// A listening socket could not be bound.
    #[error("iSCSI listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The listener thread could not start.
    #[error("starting the iSCSI listener: {0}")]
    Spawn(std::io::Error),
    /// The persistent-reservation state (APTPL) could not be read or decoded: the target
    /// does not start (the store is left as it is).
    #[error(
        "iSCSI persistent-reservation state (APTPL, SPC-4 §5.14.5) from the reservation store: {0}"
    )]
    Reservations(String),
}

/// One APTPL save for the persister thread: the bytes, and where the task that waits for
/// it learns the result ([`SAVE_PENDING`], [`SAVE_DONE`], [`SAVE_FAILED`]).
pub(crate) struct SaveJob {
    pub(crate) bytes: Vec<u8>,
    pub(crate) ticket: Arc<AtomicU8>,
}

/// A [`SaveJob`] not yet durable.
pub(crate) const SAVE_PENDING: u8 = 0;
/// A [`SaveJob`] durable.
pub(crate) const SAVE_DONE: u8 = 1;
/// A [`SaveJob`] that failed.
pub(crate) const SAVE_FAILED: u8 = 2;

/// The persister thread: saves jobs in order until every sender is gone (the server's
/// shared state dropped).
fn persist(store: Arc<dyn ReservationStore>, jobs: mpsc::Receiver<SaveJob>) {
    while let Ok(j) = jobs.recv() {
        let r = match store.save(&j.bytes) {
            Ok(()) => SAVE_DONE,
            Err(e) => {
                tracing::error!("saving the persistent-reservation state (APTPL): {e}");
                SAVE_FAILED
            }
        };
        j.ticket.store(r, Ordering::Release);
    }
}

/// A registered session (login threads look sessions up to add connections and to
/// reinstate them).
pub(crate) struct SessionEntry {
    pub(crate) isid: [u8; 6],
    pub(crate) initiator: String,
    pub(crate) revoked: Arc<AtomicBool>,
}

/// State shared by the listener, login threads and front-ends.
pub(crate) struct Shared {
    pub(crate) config: IscsiConfig,
    pub(crate) lun: LunInfo,
    pub(crate) target_name: String,
    pub(crate) shutdown: AtomicBool,
    pub(crate) next_conn: AtomicU64,
    pub(crate) next_tsih: AtomicU16,
    /// Sessions by TSIH. Locked by login threads and by a reactor when a session ends —
    /// never per I/O.
    pub(crate) sessions: Mutex<HashMap<u16, SessionEntry>>,
    pub(crate) inboxes: Vec<Arc<ArrayQueue<NewConn>>>,
    pub(crate) largest_buf: u32,
    pub(crate) write_same_buf: u32,
    /// Task slots of each front-end (buffers + spare slots).
    pub(crate) tasks_per_reactor: usize,
    /// Reservations and unit attentions of the LUN ([`pr`]). Locked by PR IN/OUT,
    /// RESERVE/RELEASE(6), task management, session start and end, and a command that
    /// reports a unit attention — never by a plain command.
    pub(crate) pr: Mutex<PrState>,
    /// Bumped (under `pr`) on every change of `pr`: sessions refresh their cached view
    /// only when it moved, so the per-command check is one atomic load.
    pub(crate) pr_epoch: AtomicU64,
    /// The persister thread's queue (`None` without a reservation store: APTPL refused).
    pub(crate) pr_saver: Option<mpsc::Sender<SaveJob>>,
    /// The store's [`ReservationStore::capacity_bytes`].
    pub(crate) pr_capacity: Option<usize>,
    /// LOGICAL UNIT RESETs and TARGET WARM/COLD RESETs so far: each front end aborts its
    /// tasks when it sees this move (with `pr_epoch`).
    pub(crate) lun_resets: AtomicU64,
}

impl Shared {
    /// Locks the reservation state.
    pub(crate) fn pr_lock(&self) -> std::sync::MutexGuard<'_, PrState> {
        self.pr.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn forget_session(&self, tsih: u16) {
        let mut reg = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        reg.remove(&tsih);
    }
}

/// The target name of an array.
pub fn target_name(array: &str) -> String {
    format!("{IQN_PREFIX}{}", array.to_ascii_lowercase())
}

/// The logical unit facts of an array: block size, capacity, a full stripe as the optimal
/// granularity, transfer limits from `cfg`.
pub fn lun_info(array: &str, geo: &ArrayGeometry, uuid: [u8; 16], cfg: &IscsiConfig) -> LunInfo {
    let g = geo.geometry();
    let bs = g.block_bytes();
    let stripe = g.stripe_data_bytes();
    let gran = u32::try_from(stripe / u64::from(bs)).unwrap_or(0);
    let max_blocks = cfg.max_transfer_bytes / bs;
    LunInfo {
        block_bytes: bs,
        blocks: geo.capacity_bytes() / u64::from(bs),
        max_transfer_blocks: max_blocks,
        granularity_blocks: gran,
        optimal_blocks: if gran > 0 && gran <= max_blocks {
            max_blocks / gran * gran
        } else {
            max_blocks
        },
        // One block: a longer COMPARE AND WRITE could cross a stripe boundary into a
        // stripe another reactor owns, and the engine's compare-and-write is atomic only
        // inside one stripe (docs/ISCSI.md, "COMPARE AND WRITE").
        max_compare_write_blocks: u8::from(max_blocks >= 2),
        // WRITE SAME / UNMAP ranges become one WriteZeroes (len_bytes is a u32): 512 MiB,
        // at most 2^20 blocks (initiators treat larger MAXIMUM UNMAP LBA COUNTs as bogus).
        max_write_same_blocks: ((512u32 << 20) / bs).clamp(1, 1 << 20),
        uuid,
        product: format!("RAID{} array", g.level().md_level()),
        target_name: target_name(array),
    }
}

/// Checks the tunables, fills in the default buffer classes and builds the state shared by
/// the login side and `reactors` front-ends (with their inboxes): what
/// [`IscsiServerBuilder::start`] and [`local::LocalServer::new`] both run.
fn prepare(
    lun: LunInfo,
    mut config: IscsiConfig,
    reactors: usize,
    store: Option<Arc<dyn ReservationStore>>,
) -> Result<Arc<Shared>, IscsiError> {
    let bs = lun.block_bytes;
    if reactors == 0 {
        return Err(IscsiError::Config("no reactors".into()));
    }
    if !(512..(1 << 24)).contains(&config.max_recv_data)
        || config.max_burst < 512
        || config.max_transfer_bytes < bs
        || config.max_connections == 0
        || config.max_connections_per_reactor == 0
    {
        return Err(IscsiError::Config(format!(
            "tunables out of range: {config:?}"
        )));
    }
    if let Some(c) = &config.chap {
        if c.user.is_empty() || c.secret.is_empty() {
            return Err(IscsiError::Config(
                "CHAP user and secret must be set".into(),
            ));
        }
        if let Some((u, s)) = &c.mutual {
            if u.is_empty() || s.is_empty() || *s == c.secret {
                return Err(IscsiError::Config(
                    "mutual CHAP needs its own user and a secret different from the initiator's (RFC 7143 §12.1.3)".into(),
                ));
            }
        }
    }
    if config.buffers.is_empty() {
        // The largest class holds a COMPARE AND WRITE of 255 blocks (twice, + slack).
        let max = (4u32 << 20).max(3 * 255 * bs.min(4096)) / bs * bs;
        config.buffers = vec![
            BufferClass {
                bytes: 64 << 10,
                count: 128,
            },
            BufferClass {
                bytes: 1 << 20,
                count: 32,
            },
            BufferClass {
                bytes: max,
                count: 4,
            },
        ];
    }
    let largest = config.buffers.iter().map(|c| c.bytes).max().unwrap_or(0);
    let total: usize = config.buffers.iter().map(|c| usize::from(c.count)).sum();
    if total == 0
        || total + frontend::BARE_TASKS >= usize::from(u16::MAX)
        || config.buffers.len() > 255
        || config
            .buffers
            .iter()
            .any(|c| c.bytes < scsi::MAX_PAGE_BYTES as u32 || !c.bytes.is_multiple_of(bs))
    {
        return Err(IscsiError::Config(
            "buffers: 1..65535 buffers, each a multiple of the block size and ≥ 4 KiB".into(),
        ));
    }
    let mut pr_state = PrState::new();
    if let Some(store) = &store {
        let saved = store
            .load()
            .map_err(|e| IscsiError::Reservations(format!("load: {e}")))?;
        if let Some(b) = saved.filter(|b| !b.is_empty()) {
            pr_state = PrState::decode(&b).map_err(|e| {
                IscsiError::Reservations(format!("{e} ({} bytes; left as they are)", b.len()))
            })?;
            info!(
                generation = pr_state.generation(),
                "persistent reservations restored (APTPL)"
            );
        }
        pr_state.set_ptpl_capable(true);
    }
    let pr_capacity = store.as_ref().and_then(|s| s.capacity_bytes());
    let pr_saver = match store {
        Some(store) => {
            let (tx, rx) = mpsc::channel();
            // Detached: it ends when the shared state (every sender) is dropped, after
            // the front-ends, so no save a task waits for is cut off.
            std::thread::Builder::new()
                .name("iscsi-pr-save".into())
                .spawn(move || persist(store, rx))
                .map_err(IscsiError::Spawn)?;
            Some(tx)
        }
        None => None,
    };
    let mut lun = lun;
    // Transfers beyond the largest buffer go in windows, whose unsolicited data must fit
    // the first window: not with a buffer below the default FirstBurstLength (64 KiB).
    let max_bytes = if largest < 65_536 {
        config.max_transfer_bytes.min(largest)
    } else {
        config.max_transfer_bytes
    };
    lun.max_transfer_blocks = lun.max_transfer_blocks.min(max_bytes / bs).max(1);
    // OPTIMAL TRANSFER LENGTH: what one buffer holds (no windows), whole stripes if any.
    let buf_blocks = largest / bs;
    if lun.optimal_blocks > buf_blocks {
        let g = lun.granularity_blocks;
        lun.optimal_blocks = if g > 0 && g <= buf_blocks {
            buf_blocks / g * g
        } else {
            buf_blocks
        };
    }
    lun.max_compare_write_blocks =
        u8::try_from((largest / bs / 2).min(u32::from(lun.max_compare_write_blocks)))
            .unwrap_or(255);
    // A reactor's inbox holds as many connections as its connection table: a login that
    // finds it full would find the table full too. A smaller inbox closed logged-in
    // connections the table had room for whenever the reactor was slow to adopt (a
    // loaded machine), as NVMe/TCP's 64-entry inbox did.
    let inboxes: Vec<Arc<ArrayQueue<NewConn>>> = (0..reactors)
        .map(|_| Arc::new(ArrayQueue::new(config.max_connections_per_reactor)))
        .collect();
    Ok(Arc::new(Shared {
        pr: Mutex::new(pr_state),
        pr_epoch: AtomicU64::new(1),
        pr_saver,
        pr_capacity,
        lun_resets: AtomicU64::new(0),
        target_name: lun.target_name.clone(),
        write_same_buf: (1u32 << 20).min(largest) / bs * bs,
        lun,
        config,
        shutdown: AtomicBool::new(false),
        next_conn: AtomicU64::new(1),
        next_tsih: AtomicU16::new(1),
        sessions: Mutex::new(HashMap::new()),
        inboxes,
        largest_buf: largest,
        tasks_per_reactor: total + frontend::BARE_TASKS,
    }))
}

/// Configures and starts an [`IscsiServer`].
pub struct IscsiServerBuilder {
    lun: LunInfo,
    config: IscsiConfig,
    listen: Vec<SocketAddr>,
    store: Option<Arc<dyn ReservationStore>>,
}

impl IscsiServerBuilder {
    /// Listens on a TCP address (port 0 picks a free one; see [`IscsiServer::addrs`]).
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen.push(addr);
        self
    }

    /// Replaces the tunables.
    pub fn config(mut self, config: IscsiConfig) -> Self {
        self.config = config;
        self
    }

    /// Where the persistent-reservation state is kept while APTPL is set (SPC-4
    /// §5.14.5): loaded at start, saved by the server's persister thread before a PR OUT
    /// that changed it completes. Without a store, APTPL=1 is refused (PTPL_C=0).
    pub fn reservation_store(mut self, store: Arc<dyn ReservationStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// Binds the sockets, starts the listener threads and returns the server with
    /// `reactors` front-ends (one per reactor, in reactor order).
    ///
    /// # Errors
    /// [`IscsiError`] for bad tunables, a socket that cannot be bound, a thread that
    /// cannot start.
    pub fn start(self, reactors: usize) -> Result<(IscsiServer, Vec<IscsiFrontend>), IscsiError> {
        let shared = prepare(self.lun, self.config, reactors, self.store)?;
        let listen = if self.listen.is_empty() {
            vec![SocketAddr::from(([127, 0, 0, 1], DEFAULT_PORT))]
        } else {
            self.listen
        };
        let mut bound = Vec::new();
        for a in listen {
            let l =
                TcpListener::bind(a).map_err(|source| IscsiError::Listen { addr: a, source })?;
            bound.push(l);
        }
        let addrs: Vec<SocketAddr> = bound.iter().filter_map(|l| l.local_addr().ok()).collect();
        let mut threads = Vec::new();
        for l in bound {
            let sh = Arc::clone(&shared);
            match std::thread::Builder::new()
                .name("iscsi-listen".into())
                .spawn(move || login::listen(l, sh))
            {
                Ok(t) => threads.push(t),
                Err(e) => {
                    shared.shutdown.store(true, Ordering::Release);
                    for t in threads {
                        let _ = t.join();
                    }
                    return Err(IscsiError::Spawn(e));
                }
            }
        }
        info!(target = %shared.target_name, ?addrs, reactors, "iSCSI target listening");
        let frontends = shared
            .inboxes
            .iter()
            .enumerate()
            .map(|(i, q)| IscsiFrontend::new(i, Arc::clone(&shared), Arc::clone(q)))
            .collect();
        Ok((
            IscsiServer {
                shared,
                threads,
                addrs,
            },
            frontends,
        ))
    }
}

/// A running iSCSI target's listeners. Shut it down **before** stopping the reactors (as
/// with the NBD server): front-ends finish only after shutdown was requested and their
/// connections drained.
pub struct IscsiServer {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    addrs: Vec<SocketAddr>,
}

impl IscsiServer {
    /// A builder for the LUN `lun` with default tunables (listening on 127.0.0.1:3260
    /// unless given addresses).
    pub fn builder(lun: LunInfo) -> IscsiServerBuilder {
        IscsiServerBuilder {
            lun,
            config: IscsiConfig::default(),
            listen: Vec::new(),
            store: None,
        }
    }

    /// The bound addresses (real ports when 0 was asked).
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// The target name.
    pub fn target_name(&self) -> &str {
        &self.shared.target_name
    }

    /// Requests shutdown (listeners stop, logins are cut, connections drain) and joins
    /// the listener threads.
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

impl Drop for IscsiServer {
    fn drop(&mut self) {
        self.stop();
    }
}
