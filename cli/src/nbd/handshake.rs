//! Listening sockets and the fixed newstyle handshake, off the reactors.
//!
//! One listener thread per listening socket waits for connections (`poll(2)` with a short
//! timeout, so it notices shutdown) and gives each accepted connection its own short-lived
//! handshake thread, so a slow or hostile client cannot hold up the others. The handshake
//! uses blocking I/O with a per-read timeout and an overall deadline (it is not the data
//! path). When the client enters the transmission phase, its socket is made non-blocking and
//! handed, as a fully built connection, to a reactor's inbox (round-robin over reactors).
//!
//! Protocol (proto.md "Fixed newstyle negotiation", "Option types"):
//! - the server sends `NBDMAGIC`, `IHAVEOPT` and `NBD_FLAG_FIXED_NEWSTYLE |
//!   NBD_FLAG_NO_ZEROES`; client flags other than the two matching ones close the
//!   connection ("the server MUST drop the TCP connection if the client sets an unknown
//!   flag");
//! - options: `NBD_OPT_GO`/`NBD_OPT_INFO` (`NBD_INFO_EXPORT` and `NBD_INFO_BLOCK_SIZE`
//!   always, `NBD_INFO_NAME`/`NBD_INFO_DESCRIPTION` when asked), `NBD_OPT_EXPORT_NAME`,
//!   `NBD_OPT_LIST`, `NBD_OPT_ABORT`, `NBD_OPT_STRUCTURED_REPLY`; `NBD_OPT_STARTTLS` and
//!   every other option get `NBD_REP_ERR_UNSUP` (NOTLS mode); malformed option data gets
//!   `NBD_REP_ERR_INVALID`, an unknown export `NBD_REP_ERR_UNKNOWN` (or, after
//!   `NBD_OPT_EXPORT_NAME`, which cannot carry an error, a disconnect);
//! - option data longer than [`MAX_OPTION_BYTES`] is skipped and answered with
//!   `NBD_REP_ERR_TOO_BIG`; longer than [`OPTION_SKIP_LIMIT`], or more than
//!   [`MAX_OPTIONS`] options, is treated as a denial of service (hard disconnect, which
//!   proto.md allows for it);
//! - while the server shuts down, options other than `NBD_OPT_ABORT` get
//!   `NBD_REP_ERR_SHUTDOWN`.

use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use thiserror::Error;
use tracing::{debug, info, warn};

use super::conn::{Conn, Stream};
use super::proto::{self, ClientOption, ExportLimits, InfoRequest};
use super::Shared;

/// Largest option data read and parsed, bytes: an `NBD_OPT_GO` with a 4096-byte name and
/// every information request fits many times over.
pub const MAX_OPTION_BYTES: u32 = 64 << 10;
/// Largest option data skipped (answered `NBD_REP_ERR_TOO_BIG`), bytes; beyond it the
/// client is disconnected.
pub const OPTION_SKIP_LIMIT: u32 = 1 << 20;
/// Most options one connection may send before the server gives up on it.
pub const MAX_OPTIONS: u32 = 1024;
/// Handshakes in progress at once per listening socket; further connections are closed.
pub const MAX_HANDSHAKES: usize = 256;
/// How often a listener looks at the shutdown flag while idle.
const LISTEN_POLL: Duration = Duration::from_millis(100);

/// Why a handshake ended without a connection (logged, never shown to the client).
#[derive(Debug, Error)]
pub(crate) enum HandshakeError {
    #[error("socket: {0}")]
    Io(#[from] io::Error),
    #[error("client flags {0:#x} not offered by the server")]
    ClientFlags(u32),
    #[error("{0}")]
    Proto(#[from] proto::ProtoError),
    #[error("NBD_OPT_EXPORT_NAME for unknown export {0:?}")]
    UnknownExport(String),
    #[error("option data of {0} bytes is a denial of service")]
    OptionTooLong(u32),
    #[error("more than {MAX_OPTIONS} options")]
    TooManyOptions,
    #[error("handshake deadline passed")]
    Deadline,
    #[error("server shutting down")]
    Shutdown,
}

/// A listening socket.
pub(crate) enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Listener {
    fn fd(&self) -> RawFd {
        match self {
            Listener::Tcp(l) => l.as_raw_fd(),
            Listener::Unix(l, _) => l.as_raw_fd(),
        }
    }

    fn accept(&self) -> io::Result<(Stream, String)> {
        match self {
            Listener::Tcp(l) => {
                let (s, a) = l.accept()?;
                Ok((Stream::Tcp(s), a.to_string()))
            }
            Listener::Unix(l, p) => {
                let (s, _) = l.accept()?;
                Ok((Stream::Unix(s), format!("unix:{}", p.display())))
            }
        }
    }

    pub(crate) fn tcp_addr(&self) -> Option<SocketAddr> {
        match self {
            Listener::Tcp(l) => l.local_addr().ok(),
            Listener::Unix(..) => None,
        }
    }
}

/// Waits until `fd` is readable or `timeout` passes. Returns whether it is readable.
fn wait_readable(fd: RawFd, timeout: Duration) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `p` is one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(e)
        };
    }
    Ok(n > 0)
}

/// Where handshaken connections go: one inbox per reactor, chosen round-robin.
pub(crate) struct Inboxes {
    pub(crate) queues: Vec<Arc<ArrayQueue<Conn>>>,
    pub(crate) next: AtomicUsize,
}

/// The listener thread's body: accept until shutdown, a handshake thread per connection;
/// at shutdown, cut the handshakes still running and join them.
pub(crate) fn listen(listener: Listener, shared: Arc<Shared>, inboxes: Arc<Inboxes>) {
    if let Listener::Tcp(l) = &listener {
        let _ = l.set_nonblocking(true);
    } else if let Listener::Unix(l, _) = &listener {
        let _ = l.set_nonblocking(true);
    }
    let mut workers: Vec<(JoinHandle<()>, Stream)> = Vec::new();
    while !shared.shutdown.load(Ordering::Acquire) {
        // Reap finished handshakes.
        let mut i = 0;
        while i < workers.len() {
            if workers[i].0.is_finished() {
                let (h, _) = workers.swap_remove(i);
                let _ = h.join();
            } else {
                i += 1;
            }
        }
        match wait_readable(listener.fd(), LISTEN_POLL) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(e) => {
                warn!("listener poll: {e}");
                std::thread::sleep(LISTEN_POLL);
                continue;
            }
        }
        let (stream, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                // E.g. out of file descriptors: back off rather than spin.
                warn!("accept: {e}");
                std::thread::sleep(LISTEN_POLL);
                continue;
            }
        };
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        if workers.len() >= MAX_HANDSHAKES {
            warn!(conn = id, %peer, "closing: {MAX_HANDSHAKES} handshakes already in progress");
            continue;
        }
        let Ok(clone) = stream.try_clone() else {
            warn!(conn = id, %peer, "closing: cannot duplicate the socket");
            continue;
        };
        let sh = Arc::clone(&shared);
        let ib = Arc::clone(&inboxes);
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-handshake-{id}"))
            .spawn(move || handshake(stream, id, peer, &sh, &ib));
        match spawned {
            Ok(h) => workers.push((h, clone)),
            Err(e) => warn!(conn = id, "closing: cannot start a handshake thread: {e}"),
        }
    }
    for (_, s) in &workers {
        s.shutdown();
    }
    for (h, _) in workers {
        let _ = h.join();
    }
    if let Listener::Unix(_, p) = &listener {
        let _ = std::fs::remove_file(p);
    }
}

/// Runs one handshake and hands the connection to a reactor.
fn handshake(mut stream: Stream, id: u64, peer: String, shared: &Shared, inboxes: &Inboxes) {
    debug!(conn = id, %peer, "connected");
    let structured = match negotiate(&mut stream, shared) {
        Ok(Some(s)) => s,
        Ok(None) => {
            debug!(conn = id, %peer, "client ended the negotiation");
            return;
        }
        Err(e) => {
            info!(conn = id, %peer, "handshake failed: {e}");
            return;
        }
    };
    if shared.shutdown.load(Ordering::Acquire) {
        info!(conn = id, %peer, "closing: server shutting down");
        return;
    }
    if let Err(e) = stream
        .set_timeouts(None)
        .and_then(|_| stream.set_nonblocking(true))
        .and_then(|_| stream.set_nodelay())
    {
        warn!(conn = id, %peer, "closing: socket setup: {e}");
        return;
    }
    let conn = Conn::new(
        id,
        peer,
        stream,
        structured,
        shared.limits,
        shared.config.max_inflight_per_connection,
    );
    let k = inboxes.next.fetch_add(1, Ordering::Relaxed) % inboxes.queues.len();
    if let Err(c) = inboxes.queues[k].push(conn) {
        warn!(conn = c.id, reactor = k, "closing: reactor inbox full");
    }
}

/// Blocking reads and writes with the per-read timeout, bounded by the overall deadline.
struct Wire<'a> {
    s: &'a mut Stream,
    deadline: Instant,
    step: Duration,
}

impl Wire<'_> {
    fn arm(&mut self) -> Result<(), HandshakeError> {
        let now = Instant::now();
        if now >= self.deadline {
            return Err(HandshakeError::Deadline);
        }
        self.s
            .set_timeouts(Some(self.step.min(self.deadline - now)))?;
        Ok(())
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), HandshakeError> {
        self.arm()?;
        self.s.read_exact(buf)?;
        Ok(())
    }

    fn write_all(&mut self, buf: &[u8]) -> Result<(), HandshakeError> {
        self.arm()?;
        self.s.send_all_blocking(buf)?;
        Ok(())
    }

    fn skip(&mut self, mut n: u32) -> Result<(), HandshakeError> {
        let mut sink = [0u8; 4096];
        while n > 0 {
            let k = (n as usize).min(sink.len());
            self.read_exact(&mut sink[..k])?;
            n -= k as u32;
        }
        Ok(())
    }

    fn reply(&mut self, option: u32, reply: u32, data: &[u8]) -> Result<(), HandshakeError> {
        let mut v = Vec::with_capacity(proto::OPTION_REPLY_HEADER_BYTES + data.len());
        v.extend_from_slice(&proto::option_reply_header(
            option,
            reply,
            data.len() as u32,
        ));
        v.extend_from_slice(data);
        self.write_all(&v)
    }
}

/// The handshake proper. `Ok(Some(structured))`: enter transmission; `Ok(None)`: the
/// client aborted.
fn negotiate(stream: &mut Stream, shared: &Shared) -> Result<Option<bool>, HandshakeError> {
    let cfg = &shared.config;
    let mut w = Wire {
        s: stream,
        deadline: Instant::now() + cfg.handshake_deadline,
        step: cfg.handshake_timeout,
    };
    w.write_all(&proto::greeting(proto::SERVER_HANDSHAKE_FLAGS))?;
    let mut f = [0u8; 4];
    w.read_exact(&mut f)?;
    let client_flags = u32::from_be_bytes(f);
    proto::check_client_flags(client_flags, proto::SERVER_HANDSHAKE_FLAGS)
        .map_err(HandshakeError::ClientFlags)?;
    let no_zeroes = client_flags & proto::FLAG_C_NO_ZEROES != 0;
    let export = &shared.export;
    let mut structured = false;
    let mut data = Vec::new();
    for _ in 0..MAX_OPTIONS {
        let mut h = [0u8; proto::OPTION_HEADER_BYTES];
        w.read_exact(&mut h)?;
        let h = proto::parse_option_header(&h)?;
        if h.length > MAX_OPTION_BYTES {
            if h.option == proto::OPT_EXPORT_NAME || h.length > OPTION_SKIP_LIMIT {
                return Err(HandshakeError::OptionTooLong(h.length));
            }
            w.skip(h.length)?;
            w.reply(h.option, proto::REP_ERR_TOO_BIG, b"option data too long")?;
            continue;
        }
        data.resize(h.length as usize, 0);
        w.read_exact(&mut data)?;
        if shared.shutdown.load(Ordering::Acquire) && h.option != proto::OPT_ABORT {
            if h.option == proto::OPT_EXPORT_NAME {
                return Err(HandshakeError::Shutdown);
            }
            w.reply(h.option, proto::REP_ERR_SHUTDOWN, b"server shutting down")?;
            continue;
        }
        let opt = match proto::parse_option(h.option, &data) {
            Ok(o) => o,
            Err(e) if h.option == proto::OPT_EXPORT_NAME => return Err(e.into()),
            Err(e) => {
                w.reply(h.option, proto::REP_ERR_INVALID, e.to_string().as_bytes())?;
                continue;
            }
        };
        let limits = ExportLimits {
            structured,
            ..shared.limits
        };
        match opt {
            ClientOption::ExportName(name) => {
                if !export.matches(name) {
                    return Err(HandshakeError::UnknownExport(
                        String::from_utf8_lossy(name).into_owned(),
                    ));
                }
                let (b, n) = proto::export_name_reply(
                    export.size_bytes,
                    limits.transmission_flags(),
                    no_zeroes,
                );
                w.write_all(&b[..n])?;
                return Ok(Some(structured));
            }
            ClientOption::Abort => {
                // The client may already have gone (proto.md: handle it gracefully).
                let _ = w.reply(h.option, proto::REP_ACK, &[]);
                return Ok(None);
            }
            ClientOption::List => {
                w.reply(
                    h.option,
                    proto::REP_SERVER,
                    &proto::rep_server_data(export.name.as_bytes(), export.description.as_bytes()),
                )?;
                w.reply(h.option, proto::REP_ACK, &[])?;
            }
            ClientOption::StartTls => {
                w.reply(h.option, proto::REP_ERR_UNSUP, b"TLS is not supported")?;
            }
            ClientOption::Info(r) | ClientOption::Go(r) => {
                if !export.matches(r.name) {
                    w.reply(h.option, proto::REP_ERR_UNKNOWN, b"no such export")?;
                    continue;
                }
                send_info(&mut w, h.option, &r, shared, &limits)?;
                w.reply(h.option, proto::REP_ACK, &[])?;
                if matches!(opt, ClientOption::Go(_)) {
                    return Ok(Some(structured));
                }
            }
            ClientOption::StructuredReply => {
                structured = true;
                w.reply(h.option, proto::REP_ACK, &[])?;
            }
            ClientOption::Unknown(_) => {
                w.reply(h.option, proto::REP_ERR_UNSUP, b"option not supported")?;
            }
        }
    }
    Err(HandshakeError::TooManyOptions)
}

/// The `NBD_REP_INFO` replies to `NBD_OPT_INFO`/`NBD_OPT_GO`: `NBD_INFO_EXPORT` (mandatory),
/// `NBD_INFO_BLOCK_SIZE` always — this export's constraints are not the defaults (minimum
/// 1), and proto.md allows information the client did not ask for — and the name and
/// description when asked.
fn send_info(
    w: &mut Wire<'_>,
    option: u32,
    r: &InfoRequest<'_>,
    shared: &Shared,
    limits: &ExportLimits,
) -> Result<(), HandshakeError> {
    let e = &shared.export;
    w.reply(
        option,
        proto::REP_INFO,
        &proto::info_export(e.size_bytes, limits.transmission_flags()),
    )?;
    w.reply(
        option,
        proto::REP_INFO,
        &proto::info_block_size(
            e.min_block_bytes,
            e.preferred_block_bytes,
            e.max_block_bytes,
        ),
    )?;
    if r.asked(proto::INFO_NAME) {
        w.reply(
            option,
            proto::REP_INFO,
            &proto::info_string(proto::INFO_NAME, e.name.as_bytes()),
        )?;
    }
    if r.asked(proto::INFO_DESCRIPTION) && !e.description.is_empty() {
        w.reply(
            option,
            proto::REP_INFO,
            &proto::info_string(proto::INFO_DESCRIPTION, e.description.as_bytes()),
        )?;
    }
    Ok(())
}
