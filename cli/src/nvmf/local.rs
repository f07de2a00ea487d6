//! The NVMe/TCP target without listeners or threads, driven by the caller: for the
//! whole-connection fuzz target (`fuzz/fuzz_targets/nvmf_conn.rs`) and tests that must not
//! depend on thread timing.
//!
//! It is the real target, not a model: [`LocalServer::new`] checks the tunables as
//! [`super::NvmfServerBuilder::start`] does (for one reactor) and returns the same
//! [`NvmfFrontend`]; [`LocalServer::accept`] hands a connected socket to that front-end's
//! inbox exactly as a listener thread hands an accepted TCP connection (with its receive
//! buffer, counted against the connection limit), and the front-end's next `poll` adopts
//! it. Run the front-end on a reactor driven by the caller's thread
//! (`engine::reactor::run_local`). What the caller does not get: the listener thread and
//! its round robin over reactors (there is one).
//!
//! The socket may be one end of a Unix stream socket pair: the front-end only reads,
//! writes (`sendmsg`) and shuts down its socket, which a connected stream socket of either
//! family does alike, so the pair stands in for a TCP connection without ports, without
//! TIME-WAIT and with deterministic delivery. Its addresses are reported as
//! [`LocalServer::PEER`] and the portal address.
//!
//! ```
//! # use std::os::unix::net::UnixStream;
//! # use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
//! # use ferroraid::nvmf::{local::LocalServer, spec::Subsystem, NvmfConfig};
//! let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 3, 64 << 10, 512).unwrap();
//! let geo = ArrayGeometry::new(g, 16).unwrap();
//! let sub = Subsystem::for_array("x", [7; 16], &geo);
//! let (server, frontend) = LocalServer::new(sub, NvmfConfig::default()).unwrap();
//! let (_host, theirs) = UnixStream::pair().unwrap();
//! server.accept(theirs).unwrap();
//! // Adopted by the front-end's next poll.
//! assert_eq!(frontend.connections(), 0);
//! ```

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::spec::{AnaState, Subsystem};
use super::{
    frontend, NewConn, NvmfConfig, NvmfError, NvmfFrontend, PortalConn, PortalState, Shared,
    StatsHandle, DEFAULT_PORT,
};

/// An NVMe/TCP target with one reactor's front-end and no listener or thread (see the
/// module docs). Dropping it does not stop the front-end: request shutdown with
/// [`LocalServer::shutdown`] and keep turning the reactor until the front-end finishes.
pub struct LocalServer {
    shared: Arc<Shared>,
    /// Its one portal ([`LocalServer::PORTAL`]), listed but without a listener.
    portal: Arc<PortalState>,
}

impl LocalServer {
    /// The peer address every connection of a local server reports (logs only).
    pub const PEER: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
        std::net::Ipv4Addr::LOCALHOST,
        0,
    ));

    /// The portal a local server reports (discovery log, local address of every
    /// connection): 127.0.0.1:4420.
    pub const PORTAL: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
        std::net::Ipv4Addr::LOCALHOST,
        DEFAULT_PORT,
    ));

    /// The target for `subsystem` with tunables `config`, and the front-end of its one
    /// reactor.
    ///
    /// # Errors
    /// [`NvmfError::Config`] for the tunables [`super::NvmfServerBuilder::start`] refuses.
    pub fn new(
        subsystem: Subsystem,
        config: NvmfConfig,
    ) -> Result<(Self, NvmfFrontend), NvmfError> {
        if config.max_connections_per_reactor == 0 {
            return Err(NvmfError::Config(
                "needs at least one connection per reactor".into(),
            ));
        }
        if config.max_connections_per_reactor > 0xFFFF {
            return Err(NvmfError::Config(
                "at most 65535 connections per reactor".into(),
            ));
        }
        let shared = Arc::new(Shared::new(subsystem, config, Vec::new(), 1));
        // The one portal, listed (discovery log, ANA) but with no listener thread.
        let portal = shared.new_portal_state(Self::PORTAL, AnaState::Optimized);
        shared.register_portal(Arc::clone(&portal), None);
        let frontend = NvmfFrontend::new(0, Arc::clone(&shared));
        Ok((Self { shared, portal }, frontend))
    }

    /// Hands a connected socket (the target's end; made non-blocking here) to the
    /// front-end, as a listener thread hands an accepted connection: the front-end's next
    /// `poll` adopts it and expects an ICReq. Returns the connection's number (as in the
    /// target's logs).
    ///
    /// # Errors
    /// The socket cannot be made non-blocking; the front-end holds
    /// [`NvmfConfig::max_connections_per_reactor`] connections (the listener closes such
    /// a connection at once), or its inbox is full, which the limit rules out (the inbox
    /// holds the limit's worth) ([`io::ErrorKind::WouldBlock`] for both).
    pub fn accept(&self, stream: UnixStream) -> io::Result<u64> {
        stream.set_nonblocking(true)?;
        let held = &self.shared.held[0];
        if held.load(Ordering::Acquire) >= self.shared.config.max_connections_per_reactor {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "the front-end is at its connection limit",
            ));
        }
        let id = self.shared.next_conn.fetch_add(1, Ordering::Relaxed);
        held.fetch_add(1, Ordering::AcqRel);
        let conn = NewConn {
            id,
            stream: TcpStream::from(OwnedFd::from(stream)),
            peer: Self::PEER,
            local: Self::PORTAL,
            portal: PortalConn::new(&self.portal),
            rx: vec![0u8; frontend::RX_BYTES].into_boxed_slice(),
        };
        if self.shared.inboxes[0].push(conn).is_err() {
            held.fetch_sub(1, Ordering::AcqRel);
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "the front-end's inbox is full",
            ));
        }
        Ok(id)
    }

    /// Controllers registered now (associations whose admin queue is connected).
    pub fn controllers(&self) -> usize {
        self.shared.ctrls().by_id.len()
    }

    /// A handle that reads the controllers and their queue counters (as `status`).
    pub fn stats_handle(&self) -> StatsHandle {
        StatsHandle(Arc::clone(&self.shared))
    }

    /// The subsystem served.
    pub fn subsystem(&self) -> &Subsystem {
        &self.shared.subsystem
    }

    /// Requests shutdown, as [`super::NvmfServer::shutdown`]: the front-end lets its
    /// connections finish their commands, closes them and then reports itself finished.
    pub fn shutdown(&self) {
        self.shared.shutdown.store(true, Ordering::Release);
    }
}
