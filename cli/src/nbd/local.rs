//! The NBD server without listeners or threads, driven by the caller: for the stateful
//! fuzz target (`fuzz/fuzz_targets/nbd_conn.rs`) and tests that must not depend on thread
//! timing.
//!
//! It is the real server, not a model: [`LocalServer::new`] checks the export and the
//! tunables as [`super::NbdServerBuilder::start`] does (for one reactor) and returns the
//! same [`NbdFrontend`]; [`LocalServer::accept`] starts the same negotiation state machine
//! the handshake thread runs for an accepted socket, and [`LocalHandshake::drive`] moves
//! it as that thread does when the socket is ready. A negotiated connection goes to the
//! front-end's inbox, where its next `poll` adopts it; run the front-end on a reactor
//! driven by the caller's thread (`engine::reactor::run_local`). What the caller does
//! not get: the handshake timeout (the caller decides how long to drive a negotiation)
//! and the handshake table (one [`LocalHandshake`] per client).
//!
//! ```
//! # use std::os::unix::net::UnixStream;
//! # use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
//! # use ferroraid::nbd::{ExportConfig, ServerConfig};
//! # use ferroraid::nbd::local::{HandshakeState, LocalServer};
//! let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 3, 64 << 10, 512).unwrap();
//! let geo = ArrayGeometry::new(g, 16).unwrap();
//! let export = ExportConfig::for_array("x", &geo, 1 << 20);
//! let (server, _frontend) = LocalServer::new(export, ServerConfig::default()).unwrap();
//! let (_client, theirs) = UnixStream::pair().unwrap();
//! let mut h = server.accept(theirs).unwrap();
//! // The greeting went out; the client has sent nothing yet.
//! assert_eq!(h.drive(&server), HandshakeState::Reading);
//! ```

use std::io;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::conn::Stream;
use super::handshake::{drive_one, Inboxes, Pending};
use super::{
    prepare, ConfigError, ExportConfig, NbdFrontend, NbdStats, ServerConfig, Shared, TlsConfig,
};

pub use super::handshake::HandshakeState;

/// An NBD server with one reactor's front-end and no listener or thread (see the module
/// docs). Dropping it does not stop the front-end: request shutdown with
/// [`LocalServer::shutdown`] and keep turning the reactor until the front-end finishes.
pub struct LocalServer {
    shared: Arc<Shared>,
    inboxes: Arc<Inboxes>,
}

impl LocalServer {
    /// The server for `export` with tunables `config`, and the front-end of its one
    /// reactor. The export is served as [`super::NbdServerBuilder::start`] serves it (its
    /// maximum block size lowered to the largest buffer).
    ///
    /// # Errors
    /// [`ConfigError`] for an invalid export or configuration, as
    /// [`super::NbdServerBuilder::start`].
    pub fn new(
        export: ExportConfig,
        config: ServerConfig,
    ) -> Result<(Self, NbdFrontend), ConfigError> {
        Self::start(export, config, None)
    }

    /// As [`LocalServer::new`], with TLS as `tls` says (`ferroraid serve --tls`): its mode
    /// decides what `NBD_OPT_STARTTLS` gets and whether plaintext options are refused, and
    /// after an acknowledged `NBD_OPT_STARTTLS` the TLS handshake runs inside
    /// [`LocalHandshake::drive`] on the same socket (a Unix socket here, as for the
    /// server's `--unix` listener), the rest of the negotiation and the transmission phase
    /// inside TLS.
    ///
    /// # Errors
    /// As [`LocalServer::new`].
    pub fn with_tls(
        export: ExportConfig,
        config: ServerConfig,
        tls: TlsConfig,
    ) -> Result<(Self, NbdFrontend), ConfigError> {
        Self::start(export, config, Some(tls))
    }

    fn start(
        export: ExportConfig,
        config: ServerConfig,
        tls: Option<TlsConfig>,
    ) -> Result<(Self, NbdFrontend), ConfigError> {
        let (shared, inboxes) = prepare(export, config, tls, 1)?;
        let frontend = NbdFrontend::new(0, Arc::clone(&shared), Arc::clone(&inboxes.queues[0]));
        Ok((Self { shared, inboxes }, frontend))
    }

    /// Starts the negotiation of a client connected over `stream` (the server's end of a
    /// socket pair, made non-blocking here), with the greeting queued: the first
    /// [`LocalHandshake::drive`] sends it.
    ///
    /// # Errors
    /// The socket cannot be made non-blocking.
    pub fn accept(&self, stream: UnixStream) -> io::Result<LocalHandshake> {
        stream.set_nonblocking(true)?;
        let id = self.shared.next_conn.fetch_add(1, Ordering::Relaxed);
        Ok(LocalHandshake {
            pending: Some(Pending::new(Stream::Unix(stream), id, "local".into())),
            state: HandshakeState::Writing,
        })
    }

    /// The export as served.
    pub fn export(&self) -> &ExportConfig {
        &self.shared.export
    }

    /// The connection counters now.
    pub fn stats(&self) -> NbdStats {
        self.shared.nbd_stats()
    }

    /// Requests shutdown, as [`super::ShutdownHandle::request`]: the front-end drains its
    /// connections and then reports itself finished; negotiations still driven get
    /// `NBD_REP_ERR_SHUTDOWN`.
    pub fn shutdown(&self) {
        self.shared.shutdown.store(true, Ordering::Release);
    }
}

/// One client's negotiation with a [`LocalServer`].
pub struct LocalHandshake {
    pending: Option<Pending>,
    state: HandshakeState,
}

impl LocalHandshake {
    /// Sends what is queued, reads and answers what the client sent, as far as the socket
    /// allows without blocking. Once [`HandshakeState::Transmission`] or
    /// [`HandshakeState::Ended`] it stays there (later calls do nothing).
    pub fn drive(&mut self, server: &LocalServer) -> HandshakeState {
        if let Some(p) = self.pending.take() {
            let (p, state) = drive_one(p, &server.shared, &server.inboxes);
            self.pending = p;
            self.state = state;
        }
        self.state
    }

    /// Where the negotiation stands after the last [`LocalHandshake::drive`].
    pub fn state(&self) -> HandshakeState {
        self.state
    }
}
