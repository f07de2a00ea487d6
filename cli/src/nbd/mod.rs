//! The NBD server: an array exported over the Network Block Device protocol, served on the
//! reactors.
//!
//! The protocol is the NBD project's `doc/proto.md`, fixed newstyle negotiation only, with
//! optional TLS (`NBD_OPT_STARTTLS`). The pieces:
//! - [`proto`]: the wire format, pure (parsing, encoding, the request rules);
//! - `handshake`: one thread owning the listening sockets (TCP and Unix) and every
//!   negotiation in progress, multiplexed with non-blocking sockets and `poll(2)` off the
//!   reactors; the handshake timeout, the handshake table and the connection limit;
//! - [`tls`]: TLS with rustls ([`TlsConfig`], [`TlsMode`]: `off`, `allow`, `require`):
//!   the TLS handshake runs inside the handshake thread's state machine, non-blocking;
//!   the finished rustls session moves with its socket to the reactor, where the
//!   connection's receive and send go through it (plaintext connections keep the
//!   zero-copy path; what TLS costs is in [`tls`]);
//! - [`NbdFrontend`]: one per reactor (an `engine::reactor::Frontend`), running the
//!   transmission phase of its connections with non-blocking sockets, a preallocated
//!   buffer pool and no locks;
//! - [`NbdServerBuilder`] / [`NbdServer`]: configuration, start and shutdown;
//! - [`local`]: the same server without listeners or threads, driven by the caller (the
//!   stateful fuzz target, deterministic tests).
//!
//! What the export offers (proto.md "Transmission flags"): read, write with FUA, flush,
//! trim and write-zeroes (each switchable, see [`ExportConfig`]), fast-zero requests
//! (always refused at once with `NBD_ENOTSUP`, which proto.md allows), and multi-conn: a
//! flush goes through the array to every member, whichever connection sent it, so its
//! effect is global. Structured replies are offered, and block status (proto.md
//! "Metadata querying"): the metadata context `base:allocation`
//! (`NBD_OPT_LIST_META_CONTEXT`, `NBD_OPT_SET_META_CONTEXT`, see `handshake`) and
//! `NBD_CMD_BLOCK_STATUS`, answered on the reactor from the array's zero map
//! (`engine::zero_map`: stripes known to read as zeroes are `NBD_STATE_HOLE |
//! NBD_STATE_ZERO`, the rest data) without an array request or an allocation, at most
//! [`proto::MAX_BLOCK_DESCRIPTORS`] descriptors a reply; switchable with
//! [`ExportConfig::block_status`] (`ferroraid serve --nbd-block-status on|off`).
//!
//! # Request sizes (proto.md "Block size constraints")
//! - Reads and writes up to 2^25 bytes (32 MiB) are served whatever maximum block size was
//!   advertised ("any payload not exceeding 2^25 (33,554,432) bytes SHOULD NOT be
//!   considered a denial of service attack, even if that length is larger than the
//!   advertised maximum payload size"): the front end splits a request longer than its
//!   largest buffer into pieces of that size, one in the array at a time, and keeps the
//!   pieces of one reply together on the wire. Longer ones get `NBD_EINVAL` (a write's
//!   payload consumed up to 2^25 bytes, beyond that a hard disconnect).
//! - Clients that agreed no block size (`NBD_OPT_EXPORT_NAME`, or `NBD_OPT_GO` without
//!   `NBD_INFO_BLOCK_SIZE`) are admitted, and a request of theirs off the array's blocks
//!   gets `NBD_EINVAL` (payload consumed), as anyone's does: proto.md lets a server that
//!   admits such clients "cleanly error commands that fall outside the constraints
//!   without corrupting data". Refusing them at `NBD_OPT_GO` with
//!   `NBD_REP_ERR_BLOCK_SIZE_REQD` would lock out the kernel's `nbd-client` (it sends GO
//!   with no information request and gives up on that error), which only ever sends whole
//!   sectors; libnbd and qemu ask for the block sizes and obey them. Byte-granular
//!   requests (a read-modify-write of the partial blocks, serialised against other writes
//!   to them) are not served yet.
//!
//! # Use
//! ```no_run
//! # use ferroraid::nbd::{ExportConfig, NbdServer};
//! # fn demo(geo: engine::geometry::ArrayGeometry) -> Result<(), Box<dyn std::error::Error>> {
//! let export = ExportConfig::for_array("disk", &geo, 4 << 20);
//! let (server, frontends) = NbdServer::builder(export)
//!     .listen_tcp("127.0.0.1:10809".parse()?)
//!     .start(2)?;
//! // engine::reactor::Reactors::start(..., frontends) — one front-end per reactor.
//! // ... later: request shutdown first, then stop the reactors.
//! server.shutdown();
//! # drop(frontends); Ok(()) }
//! ```

pub(crate) mod conn;
pub mod frontend;
pub mod handshake;
pub mod local;
pub(crate) mod pool;
pub mod proto;
pub mod tls;

use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use engine::geometry::ArrayGeometry;
use thiserror::Error;
use tracing::info;

pub use frontend::NbdFrontend;
pub use pool::BufferClass;
pub use tls::{TlsConfig, TlsError, TlsMode};

use handshake::{Inboxes, Listener};
use proto::ExportLimits;

/// The default NBD port (IANA), proto.md "Newstyle negotiation".
pub const DEFAULT_PORT: u16 = 10809;
/// Where the server listens when no address is given: loopback, the NBD port.
pub const DEFAULT_LISTEN: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
    std::net::Ipv4Addr::LOCALHOST,
    DEFAULT_PORT,
));
/// Default maximum block size, bytes: the longest read or write a client may send (4 MiB;
/// proto.md asks for at least 1 MiB when the export is that large).
pub const DEFAULT_MAX_BLOCK_BYTES: u32 = 4 << 20;

/// What is exported and how clients must address it (proto.md "Block size constraints").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportConfig {
    /// Export name (at most 4096 bytes, no NUL). The empty name, the "default export",
    /// also selects this export.
    pub name: String,
    /// Description for humans (`NBD_OPT_LIST`, `NBD_INFO_DESCRIPTION`); at most 4096 bytes.
    pub description: String,
    /// Export size, bytes (a multiple of `min_block_bytes`).
    pub size_bytes: u64,
    /// Minimum block size, bytes: offsets and lengths must be multiples of it. A power of
    /// two, at most 65536: the array's block size.
    pub min_block_bytes: u32,
    /// Preferred block size, bytes: the smallest request the array serves without
    /// read-modify-write. A power of two, at least `max(min_block_bytes, 512)`.
    pub preferred_block_bytes: u32,
    /// Maximum block size, bytes: the longest `NBD_CMD_READ`/`NBD_CMD_WRITE`. A multiple of
    /// the minimum, at least the preferred size (or the export size if smaller), and no
    /// larger than the largest buffer of the pool.
    pub max_block_bytes: u32,
    /// Advertise `NBD_FLAG_SEND_TRIM` (trims become `ArrayOp::Discard`).
    pub trim: bool,
    /// Advertise `NBD_FLAG_SEND_WRITE_ZEROES` and `NBD_FLAG_SEND_FAST_ZERO` (write-zeroes
    /// become `ArrayOp::WriteZeroes`; fast-zero requests are refused with `NBD_ENOTSUP`).
    pub write_zeroes: bool,
    /// Offer the `base:allocation` metadata context (proto.md "Metadata querying") and
    /// with it `NBD_CMD_BLOCK_STATUS`, answered from the array's zero map
    /// (`engine::zero_map`). Off: `NBD_OPT_LIST_META_CONTEXT` lists no context and
    /// `NBD_OPT_SET_META_CONTEXT` selects none (`ferroraid serve --nbd-block-status off`).
    pub block_status: bool,
}

impl ExportConfig {
    /// The export of an array: minimum block = the array's block size; preferred = one
    /// full stripe of data when that is a power of two no larger than `max_block_bytes`
    /// (a full-stripe write needs no parity reads), else one chunk (else the largest power
    /// of two that fits); maximum = `max_block_bytes` rounded down to whole blocks.
    /// Trim, write-zeroes and block status are on; the description names the array's
    /// shape.
    pub fn for_array(name: impl Into<String>, geo: &ArrayGeometry, max_block_bytes: u32) -> Self {
        let g = geo.geometry();
        let block = g.block_bytes();
        let max = (max_block_bytes / block * block).max(block);
        let stripe = g.stripe_data_bytes();
        let chunk = u64::from(g.chunk_bytes());
        let preferred = if stripe.is_power_of_two() && stripe <= u64::from(max) {
            stripe
        } else if chunk <= u64::from(max) {
            chunk
        } else {
            1u64 << (31 - max.leading_zeros())
        };
        let preferred = (preferred as u32).max(block).max(512);
        Self {
            name: name.into(),
            description: format!(
                "ferroraid RAID{} {} members, {} KiB chunk",
                g.level().md_level(),
                g.members(),
                g.chunk_bytes() / 1024
            ),
            size_bytes: geo.capacity_bytes(),
            min_block_bytes: block,
            preferred_block_bytes: preferred,
            max_block_bytes: max,
            trim: true,
            write_zeroes: true,
            block_status: true,
        }
    }

    /// Whether a client's export name selects this export (its name, or the empty
    /// default name).
    pub fn matches(&self, name: &[u8]) -> bool {
        name.is_empty() || name == self.name.as_bytes()
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |why: String| Err(ConfigError::Export(why));
        for (what, s) in [("name", &self.name), ("description", &self.description)] {
            if s.len() > proto::MAX_STRING_BYTES || s.contains('\0') {
                return bad(format!(
                    "export {what} must be at most 4096 bytes without NUL"
                ));
            }
        }
        let (min, pref, max) = (
            self.min_block_bytes,
            self.preferred_block_bytes,
            self.max_block_bytes,
        );
        if !min.is_power_of_two() || min > 65536 {
            return bad(format!(
                "minimum block size {min} must be a power of two ≤ 65536"
            ));
        }
        if !pref.is_power_of_two() || pref < min.max(512) {
            return bad(format!(
                "preferred block size {pref} must be a power of two ≥ max(minimum, 512)"
            ));
        }
        if max == 0
            || !max.is_multiple_of(min)
            || u64::from(max) < u64::from(pref).min(self.size_bytes)
        {
            return bad(format!(
                "maximum block size {max} must be a multiple of the minimum and at least the preferred size"
            ));
        }
        if self.size_bytes == 0 || !self.size_bytes.is_multiple_of(u64::from(min)) {
            return bad(format!(
                "export size {} must be a nonzero multiple of the minimum block size",
                self.size_bytes
            ));
        }
        Ok(())
    }

    fn limits(&self) -> ExportLimits {
        ExportLimits {
            size_bytes: self.size_bytes,
            min_block_bytes: self.min_block_bytes,
            max_block_bytes: self.max_block_bytes,
            trim: self.trim,
            write_zeroes: self.write_zeroes,
            fast_zero: self.write_zeroes,
            structured: false,
            block_status: false,
        }
    }
}

/// Server tunables (all per reactor unless said otherwise).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Data buffer classes of each reactor's pool. Empty: derived from the maximum block
    /// size (64 of min(128 KiB, max) and 8 of max). At most 65535 − 64 buffers.
    pub buffers: Vec<BufferClass>,
    /// Connections one reactor serves at once: its connection table, preallocated at start
    /// (raised to fit `max_connections` when that is larger than all tables together).
    /// A connection gets a slot at handshake time or is refused there, never after.
    pub max_connections_per_reactor: usize,
    /// Connections in the transmission phase the export serves at once (counting those a
    /// successful `NBD_OPT_INFO` reserved). `None`: every slot of the reactors' tables.
    /// Beyond it `NBD_OPT_GO`/`NBD_OPT_INFO` get `NBD_REP_ERR_POLICY` with a message and
    /// `NBD_OPT_EXPORT_NAME` is closed (proto.md "Option types").
    pub max_connections: Option<usize>,
    /// Requests one connection may have accepted and not yet answered; it stops reading
    /// beyond that.
    pub max_inflight_per_connection: u32,
    /// Longest whole handshake, from accept to the transmission phase; a connection that
    /// has not finished negotiating by then is closed (half-open clients).
    pub handshake_timeout: Duration,
    /// Handshakes in progress at once over all listeners; a new connection beyond it closes
    /// the oldest handshake (never the newcomer). Each costs a socket and its current
    /// message (at most 64 KiB, a few hundred bytes normally).
    pub max_handshakes: usize,
    /// How long a connection in the transmission phase may sit with no request in flight
    /// and no byte from its client before it is closed. `None` (the default): never — the
    /// kernel's NBD client and qemu keep a connection idle for as long as a disk is
    /// attached and unused (hours), and the kernel client does not reconnect unless run
    /// with `-persist`, so cutting it would break the device. A connection holding buffers
    /// without progress is cut by `stall_timeout` instead.
    pub idle_timeout: Option<Duration>,
    /// After a shutdown request, how long connections get to finish and send their
    /// replies before being cut.
    pub drain_grace: Duration,
    /// How long a connection may hold buffers (replies its client does not read, a write
    /// payload its client does not finish sending) without moving a byte before it is
    /// cut: one stuck client must not starve the others of buffers.
    pub stall_timeout: Duration,
}

/// Default connection table of one reactor (issue 18: 1000 idle clients on a 1-reactor
/// target must not fill it). A free slot costs one `Option<Conn>` word-sized tag plus the
/// struct (a few hundred bytes); a connection's 32 KiB receive buffer is allocated only
/// when it arrives; the reactor scans only up to the highest slot in use.
pub const DEFAULT_CONNECTIONS_PER_REACTOR: usize = 1024;
/// Default longest handshake (10 s: a client on a slow link needs a few round trips).
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most handshakes in progress at once that may be configured (the handshake table is
/// preallocated: a few hundred bytes a slot).
pub const MAX_HANDSHAKES_LIMIT: usize = 65536;
/// Default handshakes in progress at once (1024: more than a burst of real clients ever
/// needs, small enough that a flood costs at most 1024 sockets).
pub const DEFAULT_MAX_HANDSHAKES: usize = 1024;

impl Default for ServerConfig {
    /// Derived buffers, 1024 connections per reactor, no per-export limit below the
    /// tables, 128 requests per connection, 10 s handshake, 1024 handshakes at once, no
    /// idle timeout, 10 s drain, 30 s stall.
    fn default() -> Self {
        Self {
            buffers: Vec::new(),
            max_connections_per_reactor: DEFAULT_CONNECTIONS_PER_REACTOR,
            max_connections: None,
            max_inflight_per_connection: 128,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
            idle_timeout: None,
            drain_grace: Duration::from_secs(10),
            stall_timeout: Duration::from_secs(30),
        }
    }
}

/// Invalid server configuration.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The export's facts break a proto.md rule.
    #[error("export: {0}")]
    Export(String),
    /// The server tunables are inconsistent.
    #[error("server: {0}")]
    Server(String),
    /// A listening socket could not be set up.
    #[error("listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// The handshake thread could not be started.
    #[error("starting the handshake thread: {0}")]
    Spawn(std::io::Error),
}

/// State shared by the handshake thread and the front-ends.
pub(crate) struct Shared {
    pub(crate) export: ExportConfig,
    pub(crate) config: ServerConfig,
    /// TLS mode and credentials (`None`: TLS off).
    pub(crate) tls: Option<TlsConfig>,
    pub(crate) limits: ExportLimits,
    /// Longest write payload consumed and dropped when the write is refused, bytes;
    /// beyond it the connection is cut (proto.md "Block size constraints": lengths under
    /// 2^25 are not a denial of service).
    pub(crate) discard_cap: u32,
    pub(crate) shutdown: AtomicBool,
    pub(crate) next_conn: AtomicU64,
    /// Connection slots taken, per reactor (each at most `max_connections_per_reactor`).
    pub(crate) taken: Vec<AtomicUsize>,
    /// Connection slots taken in all (at most `max_connections`).
    pub(crate) taken_total: AtomicUsize,
    /// The export's connection limit (the configured one, or every table slot).
    pub(crate) max_connections: usize,
    /// Where the next reservation starts looking (round-robin over reactors).
    pub(crate) next_reactor: AtomicUsize,
    pub(crate) stats: Counters,
}

/// The server's counters (atomics updated off the data path: at handshakes and closes).
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) handshakes: AtomicUsize,
    pub(crate) refused: AtomicU64,
    pub(crate) handshake_timeouts: AtomicU64,
    pub(crate) handshakes_evicted: AtomicU64,
    pub(crate) idle_closed: AtomicU64,
}

impl Shared {
    fn nbd_stats(&self) -> NbdStats {
        let c = &self.stats;
        NbdStats {
            connections: self.taken_total.load(Ordering::Relaxed),
            max_connections: self.max_connections,
            handshakes: c.handshakes.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            handshake_timeouts: c.handshake_timeouts.load(Ordering::Relaxed),
            handshakes_evicted: c.handshakes_evicted.load(Ordering::Relaxed),
            idle_closed: c.idle_closed.load(Ordering::Relaxed),
        }
    }
}

/// A snapshot of the server's connection counters ([`NbdServer::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NbdStats {
    /// Connections holding a slot now: in the transmission phase, on their way to a
    /// reactor, or reserved by a successful `NBD_OPT_INFO`.
    pub connections: usize,
    /// The export's connection limit.
    pub max_connections: usize,
    /// Handshakes in progress now.
    pub handshakes: usize,
    /// `NBD_OPT_GO`/`NBD_OPT_INFO` refused and `NBD_OPT_EXPORT_NAME` closed because the
    /// connection limit was reached, since start.
    pub refused: u64,
    /// Connections closed because their handshake did not finish within the timeout.
    pub handshake_timeouts: u64,
    /// Handshakes closed to make room for a newer connection (too many at once).
    pub handshakes_evicted: u64,
    /// Connections closed by the idle timeout.
    pub idle_closed: u64,
}

/// One reserved slot of the export's connection limit and of reactor `reactor`'s
/// connection table. Taken at handshake time (`NBD_OPT_GO`, `NBD_OPT_INFO`,
/// `NBD_OPT_EXPORT_NAME`), carried by the connection to its reactor, and given back when
/// dropped — wherever the connection ends, so the counts cannot drift. Dropping it is two
/// atomic decrements (no allocation, no lock).
pub(crate) struct Slot {
    shared: Arc<Shared>,
    reactor: usize,
}

impl Slot {
    /// Reserves a slot on the first reactor with room, round-robin.
    ///
    /// # Errors
    /// The message for the client when the export's limit (or, if configured above the
    /// tables, every reactor's table) is full; counted in [`NbdStats::refused`].
    pub(crate) fn reserve(shared: &Arc<Shared>) -> Result<Slot, String> {
        let max = shared.max_connections;
        let refuse = |why: String| {
            shared.stats.refused.fetch_add(1, Ordering::Relaxed);
            Err(why)
        };
        if shared
            .taken_total
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_err()
        {
            return refuse(format!(
                "export {:?} is serving its limit of {max} connection{}; try again later",
                shared.export.name,
                if max == 1 { "" } else { "s" }
            ));
        }
        let cap = shared.config.max_connections_per_reactor;
        let n = shared.taken.len();
        let start = shared.next_reactor.fetch_add(1, Ordering::Relaxed);
        for k in (0..n).map(|i| (start + i) % n) {
            if shared.taken[k]
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                    (t < cap).then_some(t + 1)
                })
                .is_ok()
            {
                return Ok(Slot {
                    shared: Arc::clone(shared),
                    reactor: k,
                });
            }
        }
        shared.taken_total.fetch_sub(1, Ordering::AcqRel);
        refuse(format!(
            "every reactor's connection table ({n} × {cap}) is full; try again later"
        ))
    }

    /// The reactor whose table holds this slot.
    pub(crate) fn reactor(&self) -> usize {
        self.reactor
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.shared.taken[self.reactor].fetch_sub(1, Ordering::AcqRel);
        self.shared.taken_total.fetch_sub(1, Ordering::AcqRel);
    }
}

enum ListenSpec {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

/// Configures and starts an [`NbdServer`].
pub struct NbdServerBuilder {
    export: ExportConfig,
    config: ServerConfig,
    tls: Option<TlsConfig>,
    listen: Vec<ListenSpec>,
}

impl NbdServerBuilder {
    /// Listens on a TCP address (port 0 picks a free port; see [`NbdServer::tcp_addrs`]).
    pub fn listen_tcp(mut self, addr: SocketAddr) -> Self {
        self.listen.push(ListenSpec::Tcp(addr));
        self
    }

    /// Listens on a Unix socket at `path` (a stale socket file there is replaced; any other
    /// file is an error). The file is removed at shutdown.
    pub fn listen_unix(mut self, path: impl Into<PathBuf>) -> Self {
        self.listen.push(ListenSpec::Unix(path.into()));
        self
    }

    /// Turns TLS on (`NBD_OPT_STARTTLS`) with these credentials, in `tls.mode` (a
    /// [`TlsMode::Off`] config keeps TLS off). Default: off.
    pub fn tls(mut self, tls: TlsConfig) -> Self {
        self.tls = (tls.mode != TlsMode::Off).then_some(tls);
        self
    }

    /// Replaces the server tunables.
    pub fn config(mut self, config: ServerConfig) -> Self {
        self.config = config;
        self
    }

    /// Binds the listening sockets, starts the handshake thread, and returns the
    /// server with `reactors` front-ends (one per reactor, in reactor order) for
    /// `engine::reactor::Reactors::start`. Connections that finish their handshake before
    /// the reactors run wait in the reactors' inboxes.
    ///
    /// # Errors
    /// [`ConfigError`] for an invalid export or configuration, a socket that cannot be
    /// bound, or a thread that cannot start.
    pub fn start(self, reactors: usize) -> Result<(NbdServer, Vec<NbdFrontend>), ConfigError> {
        let (shared, inboxes) = prepare(self.export, self.config, self.tls, reactors)?;
        let mut listen = self.listen;
        if listen.is_empty() {
            listen.push(ListenSpec::Tcp(DEFAULT_LISTEN));
        }
        let mut listeners = Vec::new();
        let mut tcp = Vec::new();
        let mut unix = Vec::new();
        for spec in listen {
            let bound = match spec {
                ListenSpec::Tcp(a) => {
                    TcpListener::bind(a)
                        .map(Listener::Tcp)
                        .map_err(|source| ConfigError::Listen {
                            addr: a.to_string(),
                            source,
                        })
                }
                ListenSpec::Unix(p) => match bind_unix(&p) {
                    Ok(l) => {
                        unix.push(p.clone());
                        Ok(Listener::Unix(l, p))
                    }
                    Err(source) => Err(ConfigError::Listen {
                        addr: p.display().to_string(),
                        source,
                    }),
                },
            };
            let l = match bound {
                Ok(l) => l,
                Err(e) => {
                    // Leave no socket file behind for listeners that will never run.
                    for p in &unix {
                        let _ = std::fs::remove_file(p);
                    }
                    return Err(e);
                }
            };
            if let Some(a) = l.tcp_addr() {
                tcp.push(a);
            }
            listeners.push(l);
        }
        let mut threads = Vec::new();
        let sh = Arc::clone(&shared);
        let ib = Arc::clone(&inboxes);
        match std::thread::Builder::new()
            .name("nbd-handshake".into())
            .spawn(move || handshake::run(listeners, sh, ib))
        {
            Ok(t) => threads.push(t),
            Err(e) => {
                for p in &unix {
                    let _ = std::fs::remove_file(p);
                }
                return Err(ConfigError::Spawn(e));
            }
        }
        let e = &shared.export;
        let tls = shared.tls.as_ref().map_or(TlsMode::Off, |t| t.mode);
        let client_certs = shared.tls.as_ref().is_some_and(|t| t.client_auth);
        info!(export = %e.name, size_bytes = e.size_bytes, min = e.min_block_bytes,
            preferred = e.preferred_block_bytes, max = e.max_block_bytes, ?tcp, ?unix,
            reactors, %tls, client_certs, "NBD server listening");
        let frontends = inboxes
            .queues
            .iter()
            .enumerate()
            .map(|(i, q)| NbdFrontend::new(i, Arc::clone(&shared), Arc::clone(q)))
            .collect();
        Ok((
            NbdServer {
                shared,
                threads,
                tcp,
                unix,
            },
            frontends,
        ))
    }
}

/// Checks the export and the tunables (filling in derived buffers and lowering the
/// advertised maximum block size to the largest buffer) and builds the state the
/// handshake and the front-ends share, with one inbox per reactor: everything
/// [`NbdServerBuilder::start`] does short of listening ([`local::LocalServer`] runs the
/// same server without listeners or threads).
fn prepare(
    mut export: ExportConfig,
    mut config: ServerConfig,
    tls: Option<TlsConfig>,
    reactors: usize,
) -> Result<(Arc<Shared>, Arc<Inboxes>), ConfigError> {
    export.validate()?;
    if reactors == 0 {
        return Err(ConfigError::Server("no reactors".into()));
    }
    if config.buffers.is_empty() {
        let small = export.max_block_bytes.min(128 << 10);
        config.buffers.push(BufferClass {
            bytes: small,
            count: 64,
        });
        if small < export.max_block_bytes {
            config.buffers.push(BufferClass {
                bytes: export.max_block_bytes,
                count: 8,
            });
        }
    }
    let largest = config.buffers.iter().map(|c| c.bytes).max().unwrap_or(0);
    let total: usize = config.buffers.iter().map(|c| usize::from(c.count)).sum();
    if config.buffers.len() > 255
        || total == 0
        || total + frontend::DATALESS_CONTEXTS >= usize::from(u16::MAX)
    {
        return Err(ConfigError::Server(format!(
            "{total} buffers in {} classes: need 1..{} buffers in at most 255 classes",
            config.buffers.len(),
            usize::from(u16::MAX) - frontend::DATALESS_CONTEXTS
        )));
    }
    if let Some(c) = config
        .buffers
        .iter()
        .find(|c| c.bytes == 0 || !c.bytes.is_multiple_of(export.min_block_bytes))
    {
        return Err(ConfigError::Server(format!(
            "buffer size {} is not a multiple of the minimum block size",
            c.bytes
        )));
    }
    if largest < export.max_block_bytes {
        // The advertised maximum is the largest request the pool can hold.
        export.max_block_bytes = largest;
        export.validate()?;
    }
    if let Some(m) = config.max_connections {
        // The tables grow to hold the export's limit (they are preallocated; a slot
        // costs a few hundred bytes until a connection fills it).
        config.max_connections_per_reactor =
            config.max_connections_per_reactor.max(m.div_ceil(reactors));
    }
    if config.max_connections_per_reactor == 0
        || config.max_connections_per_reactor > usize::from(u16::MAX)
        || config.max_inflight_per_connection == 0
        || config.max_connections == Some(0)
        || !(1..=MAX_HANDSHAKES_LIMIT).contains(&config.max_handshakes)
        || config.handshake_timeout.is_zero()
        || config.idle_timeout.is_some_and(|t| t.is_zero())
    {
        return Err(ConfigError::Server(
            "connections per reactor must be 1..=65535 (export limit / reactors), \
             handshakes at once 1..=65536, the connection limit and requests per \
             connection ≥ 1, and the handshake and idle timeouts nonzero"
                .into(),
        ));
    }
    let limits = export.limits();
    let max_connections = config
        .max_connections
        .unwrap_or(reactors * config.max_connections_per_reactor);
    let table = config.max_connections_per_reactor;
    let shared = Arc::new(Shared {
        discard_cap: export.max_block_bytes.max(proto::DOS_FLOOR_BYTES),
        export,
        config,
        tls,
        limits,
        shutdown: AtomicBool::new(false),
        next_conn: AtomicU64::new(1),
        taken: (0..reactors).map(|_| AtomicUsize::new(0)).collect(),
        taken_total: AtomicUsize::new(0),
        max_connections,
        next_reactor: AtomicUsize::new(0),
        stats: Counters::default(),
    });
    let inboxes = Arc::new(Inboxes {
        queues: (0..reactors)
            .map(|_| Arc::new(ArrayQueue::new(table)))
            .collect(),
    });
    Ok((shared, inboxes))
}

/// Raises this process's soft limit of open files (`RLIMIT_NOFILE`) to its hard limit, as
/// servers such as nginx do, and returns the new soft limit. Each NBD client holds one
/// descriptor (and one more while negotiating); the usual soft limit of 1024 would cut a
/// target at about 1000 clients with `EMFILE` at `accept`, while the hard limit (often
/// 524288 with systemd) is what the administrator allows. `ferroraid serve` calls it at
/// start. An unlimited hard limit is capped at 1 << 20.
pub fn raise_open_files_limit() -> std::io::Result<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let r = getrlimit(Resource::Nofile);
    let hard = r.maximum.unwrap_or(1 << 20);
    if r.current.is_some_and(|c| c >= hard) {
        return Ok(r.current.unwrap_or(hard));
    }
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(hard),
            maximum: r.maximum,
        },
    )?;
    Ok(hard)
}

fn bind_unix(p: &Path) -> std::io::Result<UnixListener> {
    if let Ok(m) = std::fs::symlink_metadata(p) {
        if m.file_type().is_socket() {
            // Only a stale socket (nobody accepts on it: a server that died) is replaced;
            // a live one — another export, the management socket, another program — is
            // refused, never taken over.
            match std::os::unix::net::UnixStream::connect(p) {
                Ok(_) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::AddrInUse,
                        "a server is listening on this socket",
                    ))
                }
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    std::fs::remove_file(p)?;
                }
                Err(e) => return Err(e),
            }
        }
    }
    UnixListener::bind(p)
}

/// A running NBD server: its handshake thread and the shutdown switch its front-ends
/// watch. Dropping it shuts it down.
///
/// Shut the server down **before** stopping the reactors: a front-end is finished only
/// once shutdown was requested and its connections drained, and the reactors stop only
/// when every front-end is finished.
pub struct NbdServer {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    tcp: Vec<SocketAddr>,
    unix: Vec<PathBuf>,
}

/// Reads a server's connection counters from anywhere ([`NbdServer::stats_handle`]).
#[derive(Clone)]
pub struct StatsHandle(Arc<Shared>);

impl StatsHandle {
    /// The counters now.
    pub fn get(&self) -> NbdStats {
        self.0.nbd_stats()
    }
}

/// Requests shutdown of a server from anywhere (a signal handler thread, an RPC).
#[derive(Clone)]
pub struct ShutdownHandle(Arc<Shared>);

impl ShutdownHandle {
    /// Requests shutdown: listeners stop accepting, handshakes in progress are cut, and
    /// every connection stops reading requests, finishes those accepted, sends their
    /// replies and closes (cut after the drain grace period).
    pub fn request(&self) {
        self.0.shutdown.store(true, Ordering::Release);
    }

    /// Whether shutdown was requested.
    pub fn requested(&self) -> bool {
        self.0.shutdown.load(Ordering::Acquire)
    }
}

impl NbdServer {
    /// A builder for `export`, with default tunables; it listens on [`DEFAULT_LISTEN`]
    /// unless given addresses.
    pub fn builder(export: ExportConfig) -> NbdServerBuilder {
        NbdServerBuilder {
            export,
            config: ServerConfig::default(),
            tls: None,
            listen: Vec::new(),
        }
    }

    /// The bound TCP addresses (with the real port when 0 was asked).
    pub fn tcp_addrs(&self) -> &[SocketAddr] {
        &self.tcp
    }

    /// The Unix socket paths.
    pub fn unix_paths(&self) -> &[PathBuf] {
        &self.unix
    }

    /// The export as served (its maximum block size may have been lowered to the largest
    /// buffer).
    pub fn export(&self) -> &ExportConfig {
        &self.shared.export
    }

    /// The connection counters now (cheap: a few atomic loads).
    pub fn stats(&self) -> NbdStats {
        self.shared.nbd_stats()
    }

    /// A handle that reads the connection counters from elsewhere (the status report).
    pub fn stats_handle(&self) -> StatsHandle {
        StatsHandle(Arc::clone(&self.shared))
    }

    /// A handle that can request shutdown from elsewhere.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle(Arc::clone(&self.shared))
    }

    /// Requests shutdown (see [`ShutdownHandle::request`]) and joins the handshake thread.
    /// The front-ends finish draining on their reactors; stop the reactors afterwards.
    pub fn shutdown(mut self) {
        self.stop_listeners();
    }

    fn stop_listeners(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        self.stop_listeners();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stale socket file is replaced; a live one (another export, the management
    /// socket) is refused and keeps serving.
    #[test]
    fn unix_listen_replaces_only_a_stale_socket() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s.nbd");
        let live = UnixListener::bind(&p).unwrap();
        let e = bind_unix(&p).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse, "{e}");
        assert!(std::os::unix::net::UnixStream::connect(&p).is_ok());
        drop(live);
        // The file stays behind, nobody listening: stale.
        assert!(p.exists());
        let _l = bind_unix(&p).unwrap();
        assert!(std::os::unix::net::UnixStream::connect(&p).is_ok());
    }
    use engine::geometry::{Geometry, Layout, Level};

    fn export(level: Level, members: u16, chunk: u64, max: u32) -> ExportConfig {
        let g = Geometry::new(level, Layout::LeftSymmetric, members, chunk, 512).unwrap();
        let e = ExportConfig::for_array("x", &ArrayGeometry::new(g, 16).unwrap(), max);
        e.validate().unwrap();
        e
    }

    #[test]
    fn preferred_block_is_a_full_stripe_a_chunk_or_what_fits() {
        // 4 data chunks of 64 KiB: the full stripe.
        let e = export(Level::Raid6, 6, 64 << 10, 4 << 20);
        assert_eq!(
            (e.min_block_bytes, e.preferred_block_bytes),
            (512, 256 << 10)
        );
        assert_eq!(e.max_block_bytes, 4 << 20);
        assert_eq!(e.size_bytes, 16 * 4 * (64 << 10));
        // 3 data chunks: not a power of two, so one chunk.
        assert_eq!(
            export(Level::Raid5, 4, 64 << 10, 4 << 20).preferred_block_bytes,
            64 << 10
        );
        // A stripe larger than the maximum: one chunk.
        assert_eq!(
            export(Level::Raid6, 10, 1 << 20, 4 << 20).preferred_block_bytes,
            1 << 20
        );
        // A chunk larger than the maximum: the largest power of two that fits.
        assert_eq!(
            export(Level::Raid5, 3, 16 << 20, 3 << 20).preferred_block_bytes,
            2 << 20
        );
    }

    #[test]
    fn invalid_exports_are_refused() {
        let good = export(Level::Raid6, 6, 64 << 10, 1 << 20);
        let bad = [
            ExportConfig {
                min_block_bytes: 3000,
                ..good.clone()
            },
            ExportConfig {
                min_block_bytes: 1 << 17,
                ..good.clone()
            },
            ExportConfig {
                preferred_block_bytes: 256,
                ..good.clone()
            },
            ExportConfig {
                preferred_block_bytes: 3 << 10,
                ..good.clone()
            },
            ExportConfig {
                max_block_bytes: 1000,
                ..good.clone()
            },
            ExportConfig {
                max_block_bytes: 128 << 10,
                ..good.clone()
            },
            ExportConfig {
                size_bytes: 1000,
                ..good.clone()
            },
            ExportConfig {
                size_bytes: 0,
                ..good.clone()
            },
            ExportConfig {
                name: "a\0b".into(),
                ..good.clone()
            },
            ExportConfig {
                description: "d".repeat(5000),
                ..good.clone()
            },
        ];
        for e in bad {
            assert!(e.validate().is_err(), "{e:?}");
        }
        assert!(good.matches(b"x") && good.matches(b"") && !good.matches(b"y"));
    }

    #[test]
    fn builder_refuses_bad_tunables_and_lowers_the_maximum_to_the_pool() {
        let e = export(Level::Raid6, 6, 64 << 10, 4 << 20);
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let bad = ServerConfig {
            buffers: vec![BufferClass {
                bytes: 1000,
                count: 4,
            }],
            ..ServerConfig::default()
        };
        assert!(NbdServer::builder(e.clone())
            .listen_tcp(addr)
            .config(bad)
            .start(1)
            .is_err());
        assert!(NbdServer::builder(e.clone())
            .listen_tcp(addr)
            .start(0)
            .is_err());
        for bad in [
            ServerConfig {
                max_connections: Some(0),
                ..ServerConfig::default()
            },
            ServerConfig {
                // 2 reactors × 65535 slots at most.
                max_connections: Some(2 * 65535 + 1),
                ..ServerConfig::default()
            },
            ServerConfig {
                max_handshakes: 0,
                ..ServerConfig::default()
            },
            ServerConfig {
                max_handshakes: MAX_HANDSHAKES_LIMIT + 1,
                ..ServerConfig::default()
            },
            ServerConfig {
                handshake_timeout: Duration::ZERO,
                ..ServerConfig::default()
            },
            ServerConfig {
                idle_timeout: Some(Duration::ZERO),
                ..ServerConfig::default()
            },
        ] {
            assert!(
                NbdServer::builder(e.clone())
                    .listen_tcp(addr)
                    .config(bad.clone())
                    .start(2)
                    .is_err(),
                "{bad:?}"
            );
        }
        // A limit above the default tables grows them: 3000 over 2 reactors.
        let (big, _fe) = NbdServer::builder(e.clone())
            .listen_tcp(addr)
            .config(ServerConfig {
                max_connections: Some(3000),
                ..ServerConfig::default()
            })
            .start(2)
            .unwrap();
        assert_eq!(big.stats().max_connections, 3000);
        assert_eq!(big.shared.config.max_connections_per_reactor, 1500);
        big.shutdown();
        let small = ServerConfig {
            buffers: vec![BufferClass {
                bytes: 512 << 10,
                count: 4,
            }],
            ..ServerConfig::default()
        };
        let (server, fe) = NbdServer::builder(e)
            .listen_tcp(addr)
            .config(small)
            .start(2)
            .unwrap();
        assert_eq!(server.export().max_block_bytes, 512 << 10);
        assert_eq!(fe.len(), 2);
        assert_eq!(fe[0].buffers(), 4);
        server.shutdown();
    }
}
