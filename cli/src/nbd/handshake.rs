//! Listening sockets and the fixed newstyle handshake, off the reactors.
//!
//! # One thread, every handshake multiplexed
//! One thread (`nbd-handshake`) owns every listening socket and every connection still
//! negotiating. Each connection's negotiation is a small state machine ([`Negotiation`])
//! fed with non-blocking reads and drained with non-blocking writes; one `poll(2)` over
//! the listeners and the connections wakes the thread when any of them can move. So:
//! - a client that connects and sends nothing (half-open), or stops half-way through a
//!   message, costs a socket and a few hundred bytes, never a thread, and delays nobody:
//!   the others' bytes are served in the same loop turn they arrive;
//! - the whole handshake has one deadline ([`super::ServerConfig::handshake_timeout`],
//!   default 10 s) after which the connection is closed;
//! - at most [`super::ServerConfig::max_handshakes`] negotiate at once; when a new
//!   connection arrives at a full table, the **oldest** handshake is closed to make room
//!   (as a SYN cache does), never the newcomer: to keep a legitimate client out, an
//!   attacker would have to open that many connections within the few milliseconds the
//!   client needs to negotiate, instead of once per timeout.
//!
//! Why not a thread per handshake (the design before issue 18) or a pool: a thread per
//! handshake bounded at N lets N half-open connections hold every thread until their
//! timeout, so newcomers wait or are refused (the issue 4 note measured 10 s with 500);
//! a pool of blocking workers has the same limit at its size. The negotiation is a few
//! small messages, so one thread serves thousands of them; the state machine is also what
//! a fuzzer can drive byte by byte.
//!
//! Reads take exactly the bytes the current message still needs, so nothing of what a
//! client sends after `NBD_OPT_GO`/`NBD_OPT_EXPORT_NAME` is taken from the transmission
//! phase. While replies wait to be sent (the client does not read them), nothing more is
//! read: a client cannot make the server queue unbounded replies. One negotiation reads
//! at most 64 KiB per loop turn, so a client streaming options cannot hold the thread.
//!
//! When the client enters the transmission phase, its (already non-blocking) socket is
//! handed, as a fully built connection holding a reserved slot of a reactor's connection
//! table ([`super::Slot`]), to that reactor's inbox.
//!
//! Protocol (proto.md "Fixed newstyle negotiation", "Option types"):
//! - the server sends `NBDMAGIC`, `IHAVEOPT` and `NBD_FLAG_FIXED_NEWSTYLE |
//!   NBD_FLAG_NO_ZEROES`; client flags other than the two matching ones close the
//!   connection ("the server MUST drop the TCP connection if the client sets an unknown
//!   flag");
//! - options: `NBD_OPT_GO`/`NBD_OPT_INFO` (`NBD_INFO_EXPORT` and `NBD_INFO_BLOCK_SIZE`
//!   always, `NBD_INFO_NAME`/`NBD_INFO_DESCRIPTION` when asked), `NBD_OPT_EXPORT_NAME`,
//!   `NBD_OPT_LIST`, `NBD_OPT_ABORT`, `NBD_OPT_STRUCTURED_REPLY`,
//!   `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT` (the one context,
//!   `base:allocation`, when the export offers block status), `NBD_OPT_STARTTLS` (as
//!   the TLS mode says, [`super::tls`]: the TLS handshake runs in this state machine too,
//!   non-blocking, and the options after it are read and answered through TLS); every
//!   other option gets `NBD_REP_ERR_UNSUP`; malformed option data gets
//!   `NBD_REP_ERR_INVALID`, an unknown export `NBD_REP_ERR_UNKNOWN` (or, after
//!   `NBD_OPT_EXPORT_NAME`, which cannot carry an error, a disconnect);
//! - **connection limit**: `NBD_OPT_GO` and `NBD_OPT_INFO` reserve a slot of the export's
//!   connection limit and of a reactor's table; when none is left they are answered
//!   `NBD_REP_ERR_POLICY` ("server-side policy forbids the server to allow the option")
//!   with a message naming the limit, which clients show (`nbdinfo` prints it), and the
//!   client may try again later. `NBD_OPT_INFO` reserves too because proto.md asks a
//!   `NBD_OPT_GO` right after a successful `NBD_OPT_INFO` to get the same answer; the slot
//!   it holds is given back at the next other option or when the connection closes.
//!   `NBD_OPT_EXPORT_NAME` cannot carry an error: "If the server is unwilling to allow the
//!   export, it MUST terminate the session" — the connection is closed (and logged);
//! - option data longer than [`MAX_OPTION_BYTES`] is skipped and answered with
//!   `NBD_REP_ERR_TOO_BIG`; longer than [`OPTION_SKIP_LIMIT`], or more than
//!   [`MAX_OPTIONS`] options, is treated as a denial of service (hard disconnect, which
//!   proto.md allows for it);
//! - while the server shuts down, options other than `NBD_OPT_ABORT` get
//!   `NBD_REP_ERR_SHUTDOWN` (the handshake thread then closes every negotiation at once).

use std::io::{self, IoSlice, Read};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use thiserror::Error;
use tracing::{debug, info, warn};

use rustls::ServerConnection;

use super::conn::{Conn, Stream};
use super::proto::{self, ClientOption, ExportLimits, InfoRequest};
use super::tls::{self, TlsMode};
use super::{Shared, Slot};

/// Largest option data read and parsed, bytes: an `NBD_OPT_GO` with a 4096-byte name and
/// every information request fits many times over.
pub const MAX_OPTION_BYTES: u32 = 64 << 10;
/// Largest option data skipped (answered `NBD_REP_ERR_TOO_BIG`), bytes; beyond it the
/// client is disconnected.
pub const OPTION_SKIP_LIMIT: u32 = 1 << 20;
/// Most options one connection may send before the server gives up on it.
pub const MAX_OPTIONS: u32 = 1024;
/// How often the handshake thread looks at the shutdown flag while nothing happens.
const LISTEN_POLL: Duration = Duration::from_millis(100);
/// Connections accepted from one listener per loop turn, so that a flood on one listener
/// does not keep the thread from the negotiations already under way.
const ACCEPTS_PER_TURN: usize = 64;
/// Bytes of oversized option data skipped per read.
const SKIP_CHUNK: u32 = 4096;
/// Bytes one negotiation may read per loop turn before the others get theirs: a client
/// streaming options (up to [`MAX_OPTIONS`] × [`OPTION_SKIP_LIMIT`]) cannot hold the thread.
const READ_BYTES_PER_TURN: usize = 64 << 10;

/// Why a handshake ended without a connection (logged, never shown to the client).
#[derive(Debug, Error)]
pub(crate) enum HandshakeError {
    #[error("socket: {0}")]
    Io(#[from] io::Error),
    #[error("client closed the connection")]
    Closed,
    #[error("client flags {0:#x} not offered by the server")]
    ClientFlags(u32),
    #[error("{0}")]
    Proto(#[from] proto::ProtoError),
    #[error("NBD_OPT_EXPORT_NAME for unknown export {0:?}")]
    UnknownExport(String),
    #[error("NBD_OPT_EXPORT_NAME refused: {0}")]
    ExportFull(String),
    #[error("option data of {0} bytes is a denial of service")]
    OptionTooLong(u32),
    #[error("more than {MAX_OPTIONS} options")]
    TooManyOptions,
    #[error("server shutting down")]
    Shutdown,
    #[error("NBD_OPT_EXPORT_NAME without TLS, which this server requires")]
    TlsRequired,
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
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

    fn set_nonblocking(&self) -> io::Result<()> {
        match self {
            Listener::Tcp(l) => l.set_nonblocking(true),
            Listener::Unix(l, _) => l.set_nonblocking(true),
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

/// Where handshaken connections go: one inbox per reactor, each as large as the reactor's
/// connection table (a connection only gets here holding a [`Slot`] of that table, so an
/// inbox never overflows).
pub(crate) struct Inboxes {
    pub(crate) queues: Vec<Arc<ArrayQueue<Conn>>>,
}

/// What a negotiation is in the middle of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for the client's 32-bit flags.
    Flags,
    /// Waiting for a 16-byte option header.
    Header,
    /// Waiting for the data of `option`.
    Data { option: u32 },
    /// Skipping `left` bytes of oversized data of `option`.
    Skip { option: u32, left: u32 },
    /// Negotiated: enter transmission once the replies are sent (`block_status`: the
    /// `base:allocation` context is selected).
    Enter {
        structured: bool,
        block_status: bool,
    },
    /// The client sent `NBD_OPT_ABORT`: close once the acknowledgement is sent.
    Abort,
    /// `NBD_OPT_STARTTLS` was acknowledged: once the acknowledgement is sent (in
    /// plaintext), the TLS handshake runs; then options continue inside TLS.
    TlsHandshake,
}

/// What [`Negotiation::drive`] leaves the connection waiting for.
#[derive(Debug, PartialEq, Eq)]
enum Wait {
    /// More bytes from the client.
    Read,
    /// Room in the socket's send buffer.
    Write,
    /// Nothing from the socket: bytes already decrypted wait in the TLS session, so the
    /// negotiation is driven again at once (the socket may never become readable).
    Ready,
    /// Nothing: the negotiation is over ([`Negotiation::phase`] says how).
    Done,
}

/// One connection's negotiation as a state machine over a non-blocking socket. Memory:
/// the current message (at most [`MAX_OPTION_BYTES`]) and the replies to one option.
struct Negotiation {
    phase: Phase,
    /// The current message; `want` bytes are needed, `got` are there.
    buf: Vec<u8>,
    got: usize,
    /// Replies not yet sent (`sent` bytes of them are).
    out: Vec<u8>,
    sent: usize,
    no_zeroes: bool,
    structured: bool,
    /// `base:allocation` selected by the last `NBD_OPT_SET_META_CONTEXT`.
    block_status: bool,
    options: u32,
    /// The connection slot reserved by `NBD_OPT_INFO` or `NBD_OPT_GO`.
    slot: Option<Slot>,
    /// Connection number, for the log.
    id: u64,
    /// The TLS session once `NBD_OPT_STARTTLS` was acknowledged; `secure` once its
    /// handshake finished (from then on every byte goes through it).
    tls: Option<Box<ServerConnection>>,
    secure: bool,
}

impl Negotiation {
    /// A negotiation of connection `id` with the server's greeting queued.
    fn new(id: u64) -> Self {
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(&proto::greeting(proto::SERVER_HANDSHAKE_FLAGS));
        Self {
            phase: Phase::Flags,
            buf: vec![0; 4],
            got: 0,
            out,
            sent: 0,
            no_zeroes: false,
            structured: false,
            block_status: false,
            options: 0,
            slot: None,
            id,
            tls: None,
            secure: false,
        }
    }

    /// Sends the queued replies (through TLS once it is on). `Ok(false)`: the socket is
    /// full, some are still queued (or, with TLS, held by the session).
    fn send_out(&mut self, s: &mut Stream) -> Result<bool, HandshakeError> {
        match self.tls.as_deref_mut() {
            Some(t) if self.secure => {
                while self.sent < self.out.len() {
                    match tls::send(t, s, &[IoSlice::new(&self.out[self.sent..])]) {
                        Ok(n) => self.sent += n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                        Err(e) => return Err(e.into()),
                    }
                }
                match tls::flush(t, s) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                    Err(e) => return Err(e.into()),
                }
            }
            _ => {
                while self.sent < self.out.len() {
                    match s.send_vectored(&[IoSlice::new(&self.out[self.sent..])]) {
                        Ok(0) => return Err(HandshakeError::Closed),
                        Ok(n) => self.sent += n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
        self.out.clear();
        self.sent = 0;
        Ok(true)
    }

    /// Runs the TLS handshake as far as the socket allows; once it is done, options
    /// continue inside TLS.
    fn tls_handshake(
        &mut self,
        s: &mut Stream,
        budget: &mut usize,
    ) -> Result<Option<Wait>, HandshakeError> {
        let t = self
            .tls
            .as_deref_mut()
            .expect("the TLS handshake phase has a session");
        loop {
            match tls::flush(t, s) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Some(Wait::Write)),
                Err(e) => return Err(e.into()),
            }
            if !t.is_handshaking() {
                let (version, suite, client) = tls::describe(t);
                info!(conn = self.id, %version, %suite, %client, "TLS established");
                self.secure = true;
                self.phase = Phase::Header;
                self.expect(proto::OPTION_HEADER_BYTES);
                return Ok(None);
            }
            if *budget == 0 {
                return Ok(Some(Wait::Ready));
            }
            match tls::pull(t, s) {
                Ok(0) => return Err(HandshakeError::Closed),
                Ok(n) => *budget = budget.saturating_sub(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Some(Wait::Read)),
                Err(e) => {
                    // The alert went out (best effort); name what rustls refused.
                    let why = e
                        .get_ref()
                        .and_then(|i| i.downcast_ref::<rustls::Error>())
                        .cloned();
                    return Err(why.map_or_else(|| e.into(), HandshakeError::Tls));
                }
            }
        }
    }

    fn expect(&mut self, bytes: usize) {
        self.buf.resize(bytes, 0);
        self.got = 0;
    }

    fn reply(&mut self, option: u32, reply: u32, data: &[u8]) {
        self.out.extend_from_slice(&proto::option_reply_header(
            option,
            reply,
            data.len() as u32,
        ));
        self.out.extend_from_slice(data);
    }

    /// Moves the negotiation as far as the socket allows: sends queued replies, reads the
    /// next message, handles it, and so on until the socket would block or it is over.
    fn drive(&mut self, s: &mut Stream, shared: &Arc<Shared>) -> Result<Wait, HandshakeError> {
        let mut budget = READ_BYTES_PER_TURN;
        loop {
            if !self.send_out(s)? {
                return Ok(Wait::Write);
            }
            if matches!(self.phase, Phase::Enter { .. } | Phase::Abort) {
                return Ok(Wait::Done);
            }
            if self.phase == Phase::TlsHandshake {
                if let Some(w) = self.tls_handshake(s, &mut budget)? {
                    return Ok(w);
                }
                continue;
            }
            if self.got < self.buf.len() {
                if budget == 0 {
                    // More may be waiting: `poll` reports the socket readable at once; with
                    // TLS, decrypted bytes may wait in the session instead.
                    return Ok(if self.secure { Wait::Ready } else { Wait::Read });
                }
                let end = self.buf.len().min(self.got + budget);
                let r = match self.tls.as_deref_mut() {
                    Some(t) if self.secure => tls::read(t, s, &mut self.buf[self.got..end]),
                    _ => s.read(&mut self.buf[self.got..end]),
                };
                match r {
                    Ok(0) => return Err(HandshakeError::Closed),
                    Ok(n) => {
                        self.got += n;
                        budget -= n;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Wait::Read),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                }
                if self.got < self.buf.len() {
                    continue;
                }
            }
            self.step(shared)?;
        }
    }

    /// Handles the complete message in `buf`.
    fn step(&mut self, shared: &Arc<Shared>) -> Result<(), HandshakeError> {
        match self.phase {
            Phase::Flags => {
                let flags =
                    u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]);
                proto::check_client_flags(flags, proto::SERVER_HANDSHAKE_FLAGS)
                    .map_err(HandshakeError::ClientFlags)?;
                self.no_zeroes = flags & proto::FLAG_C_NO_ZEROES != 0;
                self.phase = Phase::Header;
                self.expect(proto::OPTION_HEADER_BYTES);
            }
            Phase::Header => {
                let h = proto::parse_option_header(&self.buf)?;
                self.options += 1;
                if h.option == proto::OPT_SET_META_CONTEXT {
                    // proto.md NBD_CMD_BLOCK_STATUS: the client may ask only if the last
                    // NBD_OPT_SET_META_CONTEXT returned a context "without error". So any
                    // SET drops the earlier selection first, whatever answers it: too long,
                    // malformed, refused in the clear or at shutdown, or answered.
                    self.block_status = false;
                }
                if self.options > MAX_OPTIONS {
                    return Err(HandshakeError::TooManyOptions);
                }
                if h.length > MAX_OPTION_BYTES {
                    if h.option == proto::OPT_EXPORT_NAME || h.length > OPTION_SKIP_LIMIT {
                        return Err(HandshakeError::OptionTooLong(h.length));
                    }
                    self.phase = Phase::Skip {
                        option: h.option,
                        left: h.length,
                    };
                    self.expect(h.length.min(SKIP_CHUNK) as usize);
                } else {
                    self.phase = Phase::Data { option: h.option };
                    self.expect(h.length as usize);
                }
            }
            Phase::Skip { option, left } => {
                let left = left - self.buf.len() as u32;
                if left == 0 {
                    // Under FORCEDTLS the refusal in the clear comes first, whatever the
                    // option's length (proto.md "TLS support").
                    if !self.refuse_in_the_clear(option, shared) {
                        self.reply(option, proto::REP_ERR_TOO_BIG, b"option data too long");
                    }
                    self.phase = Phase::Header;
                    self.expect(proto::OPTION_HEADER_BYTES);
                } else {
                    self.phase = Phase::Skip { option, left };
                    self.expect(left.min(SKIP_CHUNK) as usize);
                }
            }
            Phase::Data { option } => {
                let data = std::mem::take(&mut self.buf);
                let r = self.option(option, &data, shared);
                self.buf = data;
                if !matches!(
                    self.phase,
                    Phase::Enter { .. } | Phase::Abort | Phase::TlsHandshake
                ) {
                    self.phase = Phase::Header;
                    self.expect(proto::OPTION_HEADER_BYTES);
                }
                r?;
            }
            Phase::Enter { .. } | Phase::Abort | Phase::TlsHandshake => {
                unreachable!("a finished negotiation reads nothing")
            }
        }
        Ok(())
    }

    /// FORCEDTLS (proto.md "TLS support"): whether `option` must be refused because TLS
    /// is required and not yet up (anything but STARTTLS and ABORT in the clear).
    fn tls_required(&self, option: u32, shared: &Shared) -> bool {
        let mode = shared.tls.as_ref().map_or(TlsMode::Off, |t| t.mode);
        mode == TlsMode::Require
            && !self.secure
            && option != proto::OPT_STARTTLS
            && option != proto::OPT_ABORT
    }

    /// Answers `option` with `NBD_REP_ERR_TLS_REQD` when [`Self::tls_required`]; whether
    /// it did.
    fn refuse_in_the_clear(&mut self, option: u32, shared: &Shared) -> bool {
        if !self.tls_required(option, shared) {
            return false;
        }
        self.reply(
            option,
            proto::REP_ERR_TLS_REQD,
            b"this server requires TLS: send NBD_OPT_STARTTLS first",
        );
        true
    }

    /// Answers one option.
    fn option(
        &mut self,
        option: u32,
        data: &[u8],
        shared: &Arc<Shared>,
    ) -> Result<(), HandshakeError> {
        if shared.shutdown.load(Ordering::Acquire) && option != proto::OPT_ABORT {
            if option == proto::OPT_EXPORT_NAME {
                return Err(HandshakeError::Shutdown);
            }
            self.reply(option, proto::REP_ERR_SHUTDOWN, b"server shutting down");
            return Ok(());
        }
        if option == proto::OPT_EXPORT_NAME && self.tls_required(option, shared) {
            // NBD_OPT_EXPORT_NAME cannot be refused, so it ends the session.
            return Err(HandshakeError::TlsRequired);
        }
        if self.refuse_in_the_clear(option, shared) {
            return Ok(());
        }
        if option != proto::OPT_GO {
            // A slot reserved by NBD_OPT_INFO is kept only for the NBD_OPT_GO right after it.
            self.slot = None;
        }
        let opt = match proto::parse_option(option, data) {
            Ok(o) => o,
            Err(e) if option == proto::OPT_EXPORT_NAME => return Err(e.into()),
            Err(e) => {
                self.reply(option, proto::REP_ERR_INVALID, e.to_string().as_bytes());
                return Ok(());
            }
        };
        let export = &shared.export;
        let limits = ExportLimits {
            structured: self.structured,
            ..shared.limits
        };
        match opt {
            ClientOption::ExportName(name) => {
                if !export.matches(name) {
                    return Err(HandshakeError::UnknownExport(
                        String::from_utf8_lossy(name).into_owned(),
                    ));
                }
                match Slot::reserve(shared) {
                    Ok(s) => self.slot = Some(s),
                    Err(why) => return Err(HandshakeError::ExportFull(why)),
                }
                let (b, n) = proto::export_name_reply(
                    export.size_bytes,
                    limits.transmission_flags(),
                    self.no_zeroes,
                );
                self.out.extend_from_slice(&b[..n]);
                self.phase = Phase::Enter {
                    structured: self.structured,
                    block_status: self.block_status,
                };
            }
            ClientOption::Abort => {
                // The client may already have gone (proto.md: handle it gracefully).
                self.reply(option, proto::REP_ACK, &[]);
                self.phase = Phase::Abort;
            }
            ClientOption::List => {
                self.reply(
                    option,
                    proto::REP_SERVER,
                    &proto::rep_server_data(export.name.as_bytes(), export.description.as_bytes()),
                );
                self.reply(option, proto::REP_ACK, &[]);
            }
            ClientOption::StartTls => match &shared.tls {
                _ if self.secure => {
                    self.reply(option, proto::REP_ERR_INVALID, b"TLS is already on");
                }
                Some(t) if t.mode != TlsMode::Off => {
                    let session = t.session()?;
                    self.reply(option, proto::REP_ACK, &[]);
                    // proto.md NBD_OPT_STARTTLS: "the server MUST NOT preserve any
                    // negotiation state ... issued before this command".
                    self.structured = false;
                    self.block_status = false;
                    self.slot = None;
                    self.tls = Some(session);
                    self.phase = Phase::TlsHandshake;
                }
                _ => {
                    self.reply(
                        option,
                        proto::REP_ERR_POLICY,
                        b"TLS is off on this server (ferroraid serve --tls)",
                    );
                }
            },
            ClientOption::Info(ref r) | ClientOption::Go(ref r) => {
                if !export.matches(r.name) {
                    self.slot = None;
                    self.reply(option, proto::REP_ERR_UNKNOWN, b"no such export");
                    return Ok(());
                }
                if self.slot.is_none() {
                    match Slot::reserve(shared) {
                        Ok(s) => self.slot = Some(s),
                        Err(why) => {
                            info!(export = %export.name, "refused {}: {why}",
                                if option == proto::OPT_GO { "NBD_OPT_GO" } else { "NBD_OPT_INFO" });
                            self.reply(option, proto::REP_ERR_POLICY, why.as_bytes());
                            return Ok(());
                        }
                    }
                }
                self.send_info(option, r, shared, &limits);
                self.reply(option, proto::REP_ACK, &[]);
                if matches!(opt, ClientOption::Go(_)) {
                    self.phase = Phase::Enter {
                        structured: self.structured,
                        block_status: self.block_status,
                    };
                }
            }
            ClientOption::StructuredReply => {
                self.structured = true;
                self.reply(option, proto::REP_ACK, &[]);
            }
            ClientOption::ListMetaContext(ref r) | ClientOption::SetMetaContext(ref r) => {
                self.meta_context(option, r, export);
            }
            ClientOption::Unknown(_) => {
                self.reply(option, proto::REP_ERR_UNSUP, b"option not supported");
            }
        }
        Ok(())
    }

    /// Answers `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT` (proto.md "Option
    /// types", "Metadata querying"). The one context is `base:allocation`, offered when
    /// [`super::ExportConfig::block_status`] is on: listed (id 0) for no query, `base:`
    /// or its name; selected (id [`proto::BASE_ALLOCATION_ID`]) by its name. Unknown
    /// queries are silently not selected. SET needs structured replies
    /// (`NBD_REP_ERR_INVALID` otherwise) and replaces any earlier selection, also when
    /// it fails (the option's header already dropped it, so every error path, this
    /// function's and those before it, leaves nothing selected); a name that is not the
    /// export's gets `NBD_REP_ERR_UNKNOWN`.
    fn meta_context(
        &mut self,
        option: u32,
        r: &proto::MetaContextRequest<'_>,
        export: &super::ExportConfig,
    ) {
        let set = option == proto::OPT_SET_META_CONTEXT;
        if set {
            // Dropped at the option's header already (`step`); again here, so this function
            // stands on its own.
            self.block_status = false;
            if !self.structured {
                self.reply(
                    option,
                    proto::REP_ERR_INVALID,
                    b"NBD_OPT_SET_META_CONTEXT needs structured replies: send NBD_OPT_STRUCTURED_REPLY first",
                );
                return;
            }
        }
        if !export.matches(r.name) {
            self.reply(option, proto::REP_ERR_UNKNOWN, b"no such export");
            return;
        }
        if export.block_status && r.names_base_allocation(!set) {
            let id = if set { proto::BASE_ALLOCATION_ID } else { 0 };
            self.reply(
                option,
                proto::REP_META_CONTEXT,
                &proto::rep_meta_context_data(id, proto::BASE_ALLOCATION),
            );
            if set {
                self.block_status = true;
            }
        }
        self.reply(option, proto::REP_ACK, &[]);
    }

    /// The `NBD_REP_INFO` replies to `NBD_OPT_INFO`/`NBD_OPT_GO`: `NBD_INFO_EXPORT`
    /// (mandatory), `NBD_INFO_BLOCK_SIZE` always — this export's constraints are not the
    /// defaults (minimum 1), and proto.md allows information the client did not ask for —
    /// and the name and description when asked.
    fn send_info(
        &mut self,
        option: u32,
        r: &InfoRequest<'_>,
        shared: &Shared,
        limits: &ExportLimits,
    ) {
        let e = &shared.export;
        self.reply(
            option,
            proto::REP_INFO,
            &proto::info_export(e.size_bytes, limits.transmission_flags()),
        );
        self.reply(
            option,
            proto::REP_INFO,
            &proto::info_block_size(
                e.min_block_bytes,
                e.preferred_block_bytes,
                e.max_block_bytes,
            ),
        );
        if r.asked(proto::INFO_NAME) {
            self.reply(
                option,
                proto::REP_INFO,
                &proto::info_string(proto::INFO_NAME, e.name.as_bytes()),
            );
        }
        if r.asked(proto::INFO_DESCRIPTION) && !e.description.is_empty() {
            self.reply(
                option,
                proto::REP_INFO,
                &proto::info_string(proto::INFO_DESCRIPTION, e.description.as_bytes()),
            );
        }
    }
}

/// A connection being negotiated.
pub(crate) struct Pending {
    stream: Stream,
    id: u64,
    peer: String,
    started: Instant,
    wait: Wait,
    neg: Negotiation,
}

/// The handshake thread's body: accepts on every listener and runs every negotiation
/// until shutdown, then closes what is still negotiating and removes Unix socket files.
pub(crate) fn run(listeners: Vec<Listener>, shared: Arc<Shared>, inboxes: Arc<Inboxes>) {
    for l in &listeners {
        if let Err(e) = l.set_nonblocking() {
            warn!("listener: cannot make it non-blocking: {e}");
        }
    }
    let cfg = &shared.config;
    let max = cfg.max_handshakes;
    let mut pending: Vec<Pending> = Vec::with_capacity(max);
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(max + listeners.len());
    let gauge = &shared.stats.handshakes;
    while !shared.shutdown.load(Ordering::Acquire) {
        // Deadlines first: what is expired does not get polled.
        let now = Instant::now();
        let mut next = now + LISTEN_POLL;
        pending.retain(|p| {
            let deadline = p.started + cfg.handshake_timeout;
            if now >= deadline {
                shared
                    .stats
                    .handshake_timeouts
                    .fetch_add(1, Ordering::Relaxed);
                info!(conn = p.id, peer = %p.peer,
                    "closing: handshake not finished within {:?}", cfg.handshake_timeout);
                return false;
            }
            next = next.min(deadline);
            true
        });
        gauge.store(pending.len(), Ordering::Relaxed);
        fds.clear();
        for l in &listeners {
            fds.push(libc::pollfd {
                fd: l.fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        for p in &pending {
            fds.push(libc::pollfd {
                fd: p.stream.as_raw_fd(),
                events: match p.wait {
                    Wait::Write => libc::POLLOUT,
                    _ => libc::POLLIN,
                },
                revents: 0,
            });
        }
        let ms = if pending.iter().any(|p| p.wait == Wait::Ready) {
            0
        } else {
            next.saturating_duration_since(now)
                .as_millis()
                .clamp(1, LISTEN_POLL.as_millis()) as libc::c_int
        };
        // SAFETY: `fds` is a valid, exclusively borrowed array of `fds.len()` pollfds for
        // the duration of the call; the descriptors are open (owned by `listeners` and
        // `pending`, which are not touched meanwhile).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                warn!("handshake poll: {e}");
                std::thread::sleep(LISTEN_POLL);
            }
            continue;
        }
        if n == 0 && ms != 0 {
            continue;
        }
        // Negotiations that can move (before accepting, so that indices still match).
        let mut i = pending.len();
        while i > 0 {
            i -= 1;
            if fds[listeners.len() + i].revents == 0 && pending[i].wait != Wait::Ready {
                continue;
            }
            let p = &mut pending[i];
            match p.neg.drive(&mut p.stream, &shared) {
                Ok(Wait::Done) => {
                    let p = pending.swap_remove(i);
                    finish(p, &shared, &inboxes);
                }
                Ok(w) => p.wait = w,
                Err(e) => end(&pending.swap_remove(i), &e),
            }
        }
        for (li, l) in listeners.iter().enumerate() {
            if fds[li].revents == 0 {
                continue;
            }
            for _ in 0..ACCEPTS_PER_TURN {
                let (stream, peer) = match l.accept() {
                    Ok(x) => x,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        // E.g. out of file descriptors: back off rather than spin.
                        warn!("accept: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                        break;
                    }
                };
                let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
                debug!(conn = id, %peer, "connected");
                if let Err(e) = stream.set_nonblocking(true) {
                    warn!(conn = id, %peer, "closing: socket setup: {e}");
                    continue;
                }
                if pending.len() >= max {
                    // Make room by closing the oldest negotiation, never the newcomer.
                    if let Some(oldest) = (0..pending.len()).min_by_key(|&k| pending[k].started) {
                        let o = pending.swap_remove(oldest);
                        shared
                            .stats
                            .handshakes_evicted
                            .fetch_add(1, Ordering::Relaxed);
                        info!(conn = o.id, peer = %o.peer, age = ?o.started.elapsed(),
                            "closing the oldest handshake: {max} handshakes in progress");
                    }
                }
                let mut p = Pending::new(stream, id, peer);
                // The greeting fits an empty send buffer: this sends it at once (and a quick
                // client may already have sent more, even all of its negotiation).
                match p.neg.drive(&mut p.stream, &shared) {
                    Ok(Wait::Done) => {
                        finish(p, &shared, &inboxes);
                    }
                    Ok(w) => {
                        p.wait = w;
                        pending.push(p);
                    }
                    Err(e) => end(&p, &e),
                }
            }
        }
        gauge.store(pending.len(), Ordering::Relaxed);
    }
    if !pending.is_empty() {
        info!(handshakes = pending.len(), "closing: server shutting down");
    }
    drop(pending);
    gauge.store(0, Ordering::Relaxed);
    for l in &listeners {
        if let Listener::Unix(_, p) = l {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// How a negotiation driven outside the handshake thread ([`super::local`]) stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeState {
    /// Negotiating: waiting for more bytes from the client.
    Reading,
    /// Negotiating: waiting for room in the socket's send buffer (replies are queued).
    Writing,
    /// Negotiated: the connection is in its reactor's inbox, in the transmission phase.
    Transmission,
    /// Over without a connection: the client aborted, closed, broke the protocol, or was
    /// refused; the socket is closed.
    Ended,
}

impl Pending {
    /// A new negotiation of connection `id` from `peer` on `stream` (already
    /// non-blocking), with the greeting queued.
    pub(crate) fn new(stream: Stream, id: u64, peer: String) -> Self {
        Pending {
            stream,
            id,
            peer,
            started: Instant::now(),
            wait: Wait::Write,
            neg: Negotiation::new(id),
        }
    }
}

/// Moves negotiation `p` as far as its socket allows, as the handshake thread does when
/// the socket is ready (the handshake timeout is the caller's). While it goes on, `p`
/// comes back; once over it is consumed: handed to its reactor's inbox
/// ([`HandshakeState::Transmission`]) or closed ([`HandshakeState::Ended`]).
pub(crate) fn drive_one(
    mut p: Pending,
    shared: &Arc<Shared>,
    inboxes: &Inboxes,
) -> (Option<Pending>, HandshakeState) {
    match p.neg.drive(&mut p.stream, shared) {
        Ok(Wait::Done) => {
            let state = if finish(p, shared, inboxes) {
                HandshakeState::Transmission
            } else {
                HandshakeState::Ended
            };
            (None, state)
        }
        Ok(w) => {
            let state = if w == Wait::Write {
                HandshakeState::Writing
            } else {
                HandshakeState::Reading
            };
            p.wait = w;
            (Some(p), state)
        }
        Err(e) => {
            end(&p, &e);
            (None, HandshakeState::Ended)
        }
    }
}

/// Logs why a negotiation ended without a connection (the socket closes when `p` drops).
fn end(p: &Pending, e: &HandshakeError) {
    match e {
        // After NBD_OPT_ABORT the client may close without reading the acknowledgement
        // (proto.md: both sides handle that gracefully).
        _ if p.neg.phase == Phase::Abort => {
            debug!(conn = p.id, peer = %p.peer, "client ended the negotiation")
        }
        HandshakeError::Closed => {
            debug!(conn = p.id, peer = %p.peer, "client closed during the handshake")
        }
        HandshakeError::ExportFull(_) => info!(conn = p.id, peer = %p.peer, "closing: {e}"),
        e => info!(conn = p.id, peer = %p.peer, "handshake failed: {e}"),
    }
}

/// Hands a negotiated connection to the reactor whose slot it holds (or closes it after
/// `NBD_OPT_ABORT`). Whether it was handed over.
fn finish(p: Pending, shared: &Shared, inboxes: &Inboxes) -> bool {
    let Pending {
        stream,
        id,
        peer,
        mut neg,
        ..
    } = p;
    let Phase::Enter {
        structured,
        block_status,
    } = neg.phase
    else {
        debug!(conn = id, %peer, "client ended the negotiation");
        return false;
    };
    let Some(slot) = neg.slot.take() else {
        unreachable!("a negotiation enters transmission only holding a slot");
    };
    let tls = if neg.secure { neg.tls.take() } else { None };
    if let Err(e) = stream.set_nodelay() {
        warn!(conn = id, %peer, "closing: socket setup: {e}");
        return false;
    }
    let k = slot.reactor();
    let conn = Conn::new(
        id,
        peer,
        stream,
        tls,
        ExportLimits {
            structured,
            block_status,
            ..shared.limits
        },
        shared.config.max_inflight_per_connection,
        slot,
    );
    if let Err(c) = inboxes.queues[k].push(conn) {
        // Cannot happen while slots are counted right (an inbox holds a table's worth).
        warn!(conn = c.id, reactor = k, "closing: reactor inbox full");
        return false;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nbd::{ExportConfig, NbdServer};
    use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};

    /// Feeds `bytes` to `n` in pieces of `piece` bytes, handling each complete message.
    fn feed(n: &mut Negotiation, shared: &Arc<Shared>, bytes: &[u8], piece: usize) {
        let mut rest = bytes;
        loop {
            while n.got == n.buf.len() && !matches!(n.phase, Phase::Enter { .. } | Phase::Abort) {
                n.step(shared).unwrap();
            }
            if rest.is_empty() {
                return;
            }
            let k = piece.min(rest.len()).min(n.buf.len() - n.got);
            n.buf[n.got..n.got + k].copy_from_slice(&rest[..k]);
            n.got += k;
            rest = &rest[k..];
        }
    }

    /// A client that sends its flags, `NBD_OPT_LIST`, an oversized option and `NBD_OPT_GO`
    /// in pieces of any size gets the same replies and ends in the same state as one that
    /// sends them at once; the `NBD_OPT_GO` holds a connection slot.
    #[test]
    fn negotiation_takes_messages_in_any_pieces() {
        let server = test_server(None);
        let shared = Arc::clone(&server.shared);
        let mut msg = Vec::new();
        msg.extend_from_slice(&proto::FLAG_C_FIXED_NEWSTYLE.to_be_bytes());
        msg.extend_from_slice(&proto::encode_option_header(proto::OPT_LIST, 0));
        let big = MAX_OPTION_BYTES + 5000;
        msg.extend_from_slice(&proto::encode_option_header(99, big));
        msg.extend(std::iter::repeat_n(7u8, big as usize));
        let go = proto::encode_info_request(b"x", &[]);
        msg.extend_from_slice(&proto::encode_option_header(proto::OPT_GO, go.len() as u32));
        msg.extend_from_slice(&go);
        let mut whole = Negotiation::new(0);
        feed(&mut whole, &shared, &msg, usize::MAX);
        assert_eq!(
            whole.phase,
            Phase::Enter {
                structured: false,
                block_status: false
            }
        );
        assert!(whole.slot.is_some());
        for piece in [1, 3, 16, 4097] {
            let mut n = Negotiation::new(0);
            feed(&mut n, &shared, &msg, piece);
            assert_eq!(n.phase, whole.phase, "pieces of {piece}");
            assert_eq!(n.out, whole.out, "pieces of {piece}");
        }
        let too_big = proto::option_reply_header(99, proto::REP_ERR_TOO_BIG, 20);
        assert!(whole.out.windows(too_big.len()).any(|w| w == too_big));
        assert!(whole.out.ends_with(&proto::option_reply_header(
            proto::OPT_GO,
            proto::REP_ACK,
            0
        )));
        // Only the slots still held count (the negotiations above dropped theirs).
        assert_eq!(server.stats().connections, 1);
        drop(whole);
        assert_eq!(server.stats().connections, 0);
        server.shutdown();
    }

    /// Replies in `out`: (option, reply type, data) each.
    fn replies(out: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
        let mut v = Vec::new();
        let mut r = out;
        while !r.is_empty() {
            v.push(reply_of(&mut r));
        }
        v
    }

    /// Sends `opts` after the flags and returns the replies to them.
    fn negotiate(
        n: &mut Negotiation,
        shared: &Arc<Shared>,
        opts: &[(u32, Vec<u8>)],
    ) -> Vec<(u32, u32, Vec<u8>)> {
        let mut msg = Vec::new();
        for (o, d) in opts {
            msg.extend_from_slice(&proto::encode_option_header(*o, d.len() as u32));
            msg.extend_from_slice(d);
        }
        n.out.clear();
        feed(n, shared, &msg, usize::MAX);
        replies(&n.out)
    }

    /// `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`: LIST offers
    /// `base:allocation` (id 0) for no query, `base:` or the name, and nothing for other
    /// queries; SET before structured replies is invalid; SET selects it (id 1) only by
    /// name, silently skips unknown contexts, refuses another export, replaces an earlier
    /// selection; malformed data is invalid with the stream still in sync; the selection
    /// survives to `NBD_OPT_GO`; an export with block status off offers nothing.
    #[test]
    fn meta_context_negotiation() {
        use proto::{encode_meta_context_request as mc, OPT_LIST_META_CONTEXT as LIST};
        use proto::{OPT_SET_META_CONTEXT as SET, REP_ACK, REP_META_CONTEXT};
        let server = test_server(None);
        let shared = Arc::clone(&server.shared);
        let mut n = Negotiation::new(0);
        feed(
            &mut n,
            &shared,
            &proto::FLAG_C_FIXED_NEWSTYLE.to_be_bytes(),
            usize::MAX,
        );
        let ctx = |id: u32| {
            (
                REP_META_CONTEXT,
                proto::rep_meta_context_data(id, "base:allocation"),
            )
        };
        let kinds = |r: Vec<(u32, u32, Vec<u8>)>| -> Vec<(u32, Vec<u8>)> {
            r.into_iter().map(|(_, t, d)| (t, d)).collect()
        };
        for q in [
            &[][..],
            &[&b"base:"[..]],
            &[&b"base:allocation"[..], b"x:y"],
        ] {
            let r = kinds(negotiate(&mut n, &shared, &[(LIST, mc(b"x", q))]));
            assert_eq!(r, vec![ctx(0), (REP_ACK, vec![])], "{q:?}");
        }
        let r = kinds(negotiate(&mut n, &shared, &[(LIST, mc(b"", &[b"qemu:"]))]));
        assert_eq!(r, vec![(REP_ACK, vec![])]);
        let r = negotiate(&mut n, &shared, &[(LIST, mc(b"nope", &[]))]);
        assert_eq!(r[0].1, proto::REP_ERR_UNKNOWN);
        // SET needs structured replies.
        let r = negotiate(&mut n, &shared, &[(SET, mc(b"x", &[b"base:allocation"]))]);
        assert_eq!((r.len(), r[0].1), (1, proto::REP_ERR_INVALID));
        assert!(!n.block_status);
        negotiate(&mut n, &shared, &[(proto::OPT_STRUCTURED_REPLY, vec![])]);
        let r = kinds(negotiate(
            &mut n,
            &shared,
            &[(SET, mc(b"x", &[b"base:allocation"]))],
        ));
        assert_eq!(r, vec![ctx(1), (REP_ACK, vec![])]);
        assert!(n.block_status);
        // A later SET replaces it: unknown contexts (and `base:`) select nothing.
        let r = kinds(negotiate(
            &mut n,
            &shared,
            &[(SET, mc(b"", &[b"base:", b"a:b"]))],
        ));
        assert_eq!(r, vec![(REP_ACK, vec![])]);
        assert!(!n.block_status);
        negotiate(&mut n, &shared, &[(SET, mc(b"", &[b"base:allocation"]))]);
        assert!(n.block_status);
        // Another export's name; then malformed data (the stream stays in sync: the next
        // option is answered).
        let r = negotiate(&mut n, &shared, &[(SET, mc(b"y", &[b"base:allocation"]))]);
        assert_eq!(r[0].1, proto::REP_ERR_UNKNOWN);
        assert!(!n.block_status);
        let r = negotiate(
            &mut n,
            &shared,
            &[
                (SET, mc(b"x", &[b"base:allocation"])),
                (SET, vec![0, 0, 0, 0, 0, 0, 0, 5, 1]),
            ],
        );
        assert_eq!(r.last().unwrap().1, proto::REP_ERR_INVALID);
        // A failed SET drops the earlier selection, whichever way it fails (proto.md
        // NBD_CMD_BLOCK_STATUS: only a last SET answered without error selects).
        assert!(!n.block_status, "selection kept past a malformed SET");
        negotiate(&mut n, &shared, &[(SET, mc(b"x", &[b"base:allocation"]))]);
        assert!(n.block_status);
        let r = negotiate(
            &mut n,
            &shared,
            &[(SET, vec![0; MAX_OPTION_BYTES as usize + 1])],
        );
        assert_eq!(r[0].1, proto::REP_ERR_TOO_BIG);
        assert!(!n.block_status, "selection kept past an oversized SET");
        let r = negotiate(
            &mut n,
            &shared,
            &[
                (SET, vec![0, 0, 0, 0, 0, 0, 0, 5, 1]),
                (SET, mc(b"x", &[b"base:allocation"])),
            ],
        );
        assert_eq!(r[0].1, proto::REP_ERR_INVALID);
        assert_eq!(r.last().unwrap().1, REP_ACK);
        assert!(n.block_status);
        negotiate(
            &mut n,
            &shared,
            &[(proto::OPT_GO, proto::encode_info_request(b"x", &[]))],
        );
        assert_eq!(
            n.phase,
            Phase::Enter {
                structured: true,
                block_status: true
            }
        );
        drop(n);
        server.shutdown();

        // Block status off: nothing offered, nothing selected.
        let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 3, 64 << 10, 512).unwrap();
        let geo = ArrayGeometry::new(g, 16).unwrap();
        let mut e = ExportConfig::for_array("x", &geo, 1 << 20);
        e.block_status = false;
        let (off, _fe) = NbdServer::builder(e)
            .listen_tcp("127.0.0.1:0".parse().unwrap())
            .start(1)
            .unwrap();
        let mut n = Negotiation::new(0);
        feed(
            &mut n,
            &off.shared,
            &proto::FLAG_C_FIXED_NEWSTYLE.to_be_bytes(),
            usize::MAX,
        );
        let r = kinds(negotiate(
            &mut n,
            &off.shared,
            &[
                (LIST, mc(b"", &[])),
                (proto::OPT_STRUCTURED_REPLY, vec![]),
                (SET, mc(b"", &[b"base:allocation"])),
            ],
        ));
        assert_eq!(
            r,
            vec![(REP_ACK, vec![]), (REP_ACK, vec![]), (REP_ACK, vec![])]
        );
        assert!(!n.block_status);
        off.shutdown();
    }

    /// A server of export `x` (RAID5, 3 members, 1 MiB) on a free port, TLS as given.
    fn test_server(tls: Option<tls::TlsConfig>) -> NbdServer {
        let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 3, 64 << 10, 512).unwrap();
        let geo = ArrayGeometry::new(g, 16).unwrap();
        let mut b = NbdServer::builder(ExportConfig::for_array("x", &geo, 1 << 20))
            .listen_tcp("127.0.0.1:0".parse().unwrap());
        if let Some(t) = tls {
            b = b.tls(t);
        }
        b.start(1).unwrap().0
    }

    fn tls_server(mode: TlsMode, dir: &std::path::Path) -> (NbdServer, tls::test_pki::Pki) {
        let pki = tls::test_pki::make(dir);
        let cfg = tls::TlsConfig::from_pem_files(mode, &pki.cert, &pki.key, None).unwrap();
        (test_server(Some(cfg)), pki)
    }

    /// Reads one option reply: (option, reply type, data).
    fn reply_of(r: &mut impl Read) -> (u32, u32, Vec<u8>) {
        let mut h = [0u8; 20];
        r.read_exact(&mut h).unwrap();
        let be = |i: usize| u32::from_be_bytes(h[i..i + 4].try_into().unwrap());
        let mut d = vec![0u8; be(16) as usize];
        r.read_exact(&mut d).unwrap();
        (be(8), be(12), d)
    }

    /// STARTTLS end to end in process: a rustls client on one end of a socket pair, the
    /// negotiation state machine driven non-blocking on the other. Structured replies
    /// agreed before STARTTLS are forgotten (proto.md), options after it travel inside
    /// TLS, a second STARTTLS is invalid, and `NBD_OPT_GO` ends in the transmission phase
    /// with the TLS session.
    #[test]
    fn starttls_negotiation_with_a_rustls_client() {
        use std::io::Write as _;
        let dir = tempfile::tempdir().unwrap();
        let (server, pki) = tls_server(TlsMode::Allow, dir.path());
        let shared = Arc::clone(&server.shared);
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut s = Stream::Unix(a);
        let ca = pki.ca_der.clone();
        let client = std::thread::spawn(move || {
            let mut b = b;
            b.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut g = [0u8; 18];
            b.read_exact(&mut g).unwrap();
            let opt = |o: u32, d: &[u8]| {
                let mut m = proto::encode_option_header(o, d.len() as u32).to_vec();
                m.extend_from_slice(d);
                m
            };
            b.write_all(&proto::FLAG_C_FIXED_NEWSTYLE.to_be_bytes())
                .unwrap();
            b.write_all(&opt(proto::OPT_STRUCTURED_REPLY, &[])).unwrap();
            assert_eq!(reply_of(&mut b).1, proto::REP_ACK);
            b.write_all(&opt(proto::OPT_STARTTLS, &[])).unwrap();
            assert_eq!(reply_of(&mut b).1, proto::REP_ACK);
            let mut roots = rustls::RootCertStore::empty();
            roots.add(ca).unwrap();
            let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
            let conn =
                rustls::ClientConnection::new(Arc::new(cfg), "localhost".try_into().unwrap())
                    .unwrap();
            let mut t = rustls::StreamOwned::new(conn, b);
            t.write_all(&opt(proto::OPT_STARTTLS, &[])).unwrap();
            assert_eq!(reply_of(&mut t).1, proto::REP_ERR_INVALID);
            t.write_all(&opt(proto::OPT_LIST, &[])).unwrap();
            let (_, ty, data) = reply_of(&mut t);
            // Name length 1, the name, then the description.
            assert_eq!((ty, &data[..5]), (proto::REP_SERVER, &b"\0\0\0\x01x"[..]));
            assert_eq!(reply_of(&mut t).1, proto::REP_ACK);
            t.write_all(&opt(proto::OPT_GO, &proto::encode_info_request(b"x", &[])))
                .unwrap();
            let mut types = Vec::new();
            loop {
                let (o, ty, _) = reply_of(&mut t);
                assert_eq!(o, proto::OPT_GO);
                types.push(ty);
                if ty == proto::REP_ACK {
                    return (types, t);
                }
            }
        });
        let mut n = Negotiation::new(1);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match n.drive(&mut s, &shared) {
                Ok(Wait::Done) => break,
                Ok(_) => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => panic!("negotiation failed: {e}"),
            }
            assert!(
                Instant::now() < deadline,
                "negotiation stuck in {:?}",
                n.phase
            );
        }
        let (types, _t) = client.join().unwrap();
        assert_eq!(
            types,
            [proto::REP_INFO, proto::REP_INFO, proto::REP_ACK],
            "NBD_INFO_EXPORT, NBD_INFO_BLOCK_SIZE, ACK"
        );
        // The structured replies agreed in the clear were dropped by STARTTLS.
        assert_eq!(
            n.phase,
            Phase::Enter {
                structured: false,
                block_status: false
            }
        );
        assert!(n.secure && n.tls.is_some() && n.slot.is_some());
        server.shutdown();
    }

    /// FORCEDTLS: before TLS every option but STARTTLS and ABORT is refused with
    /// `NBD_REP_ERR_TLS_REQD`, `NBD_OPT_EXPORT_NAME` ends the session, no slot is taken;
    /// with TLS off, STARTTLS gets `NBD_REP_ERR_POLICY`.
    #[test]
    fn tls_required_refuses_plaintext_options() {
        let dir = tempfile::tempdir().unwrap();
        let (server, _pki) = tls_server(TlsMode::Require, dir.path());
        let shared = Arc::clone(&server.shared);
        let mut msg = proto::FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        let go = proto::encode_info_request(b"x", &[]);
        let meta = proto::encode_meta_context_request(b"x", &[proto::BASE_ALLOCATION.as_bytes()]);
        let big = vec![0u8; MAX_OPTION_BYTES as usize + 1];
        for (o, d) in [
            (proto::OPT_LIST, &[][..]),
            (proto::OPT_STRUCTURED_REPLY, &[]),
            (proto::OPT_INFO, &go),
            (proto::OPT_GO, &go),
            (proto::OPT_LIST_META_CONTEXT, &meta),
            (proto::OPT_SET_META_CONTEXT, &meta),
            (77, &[]),
            // Longer than an option may be: skipped, and still refused for TLS first.
            (78, &big),
        ] {
            msg.extend_from_slice(&proto::encode_option_header(o, d.len() as u32));
            msg.extend_from_slice(d);
        }
        let mut n = Negotiation::new(0);
        feed(&mut n, &shared, &msg, usize::MAX);
        assert_eq!(n.phase, Phase::Header);
        assert!(n.slot.is_none() && !n.structured && !n.block_status);
        let mut want = Vec::new();
        let text = b"this server requires TLS: send NBD_OPT_STARTTLS first";
        for o in [
            proto::OPT_LIST,
            proto::OPT_STRUCTURED_REPLY,
            proto::OPT_INFO,
            proto::OPT_GO,
            proto::OPT_LIST_META_CONTEXT,
            proto::OPT_SET_META_CONTEXT,
            77,
            78,
        ] {
            want.extend_from_slice(&proto::option_reply_header(
                o,
                proto::REP_ERR_TLS_REQD,
                text.len() as u32,
            ));
            want.extend_from_slice(text);
        }
        assert_eq!(&n.out[n.out.len() - want.len()..], &want[..]);
        n.buf = proto::encode_option_header(proto::OPT_EXPORT_NAME, 1).to_vec();
        n.got = n.buf.len();
        n.step(&shared).unwrap();
        n.buf = b"x".to_vec();
        n.got = 1;
        assert!(matches!(n.step(&shared), Err(HandshakeError::TlsRequired)));
        assert_eq!(server.stats().connections, 0);
        server.shutdown();
        // TLS off: STARTTLS is refused by policy.
        let off = test_server(None);
        let mut msg = proto::FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        msg.extend_from_slice(&proto::encode_option_header(proto::OPT_STARTTLS, 0));
        let mut n = Negotiation::new(0);
        feed(&mut n, &off.shared, &msg, usize::MAX);
        assert!(n.tls.is_none());
        let text = b"TLS is off on this server (ferroraid serve --tls)";
        let mut want = proto::option_reply_header(
            proto::OPT_STARTTLS,
            proto::REP_ERR_POLICY,
            text.len() as u32,
        )
        .to_vec();
        want.extend_from_slice(text);
        assert!(n.out.ends_with(&want));
        off.shutdown();
    }
}
