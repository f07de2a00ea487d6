//! The NVMe/TCP front-end of one reactor: every connection (queue pair) it adopted, from
//! ICReq to close.
//!
//! Each loop turn ([`Frontend::poll`]): adopt new connections from the inbox; for each
//! connection, close it if its controller is gone, its keep-alive expired or it has not
//! connected a queue within the connect timeout, retry array
//! submissions the reactor refused (`QueueFull`) and commands waiting for a data buffer,
//! send what is queued (one `sendmsg` gathers several PDUs; a partial send resumes next
//! turn), then receive and handle PDUs (at most [`PDUS_PER_TURN`]).
//!
//! # Ending a connection
//! A connection ended gracefully (a Fabrics Disconnect, or a shutdown with every command
//! answered) shuts down its sending side once every PDU is sent, then lingers: it discards
//! what the host still sends until the host closes its side (at most [`LINGER`]), so the
//! host reads every response and then the end of stream, never a reset. A fatal transport
//! error (C2HTermReq), a keep-alive or connect timeout, a removed portal or an ended
//! association close at once.
//!
//! # Memory
//! A connection's receive buffer is allocated at accept (it holds one whole PDU: an
//! H2CData of MAXH2CDATA, or a capsule with 8 KiB of in-capsule data); its command
//! contexts, their 4 KiB buffers and its send queue are allocated at Fabrics Connect (SQ
//! size + 1 contexts). Transfers above 4 KiB take a buffer from the reactor's pool, a
//! connection at most a quarter of them ([`buffer_cap`]); a command that finds none (or
//! its connection at the cap) waits in its queue's FIFO while the queue keeps receiving
//! (so an R2T's data never waits behind a command that waits for a buffer). A context is only
//! freed once its response is in the socket, and a closed connection's slot only once no
//! array request refers to it.
//!
//! # Tags
//! Array requests carry [`TAG_BIT`] | slot << 16 | context.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Read};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrayvec::ArrayVec;
use engine::array::{ArrayCompletion, ArrayError, ArrayOp, ArrayRequest};
use engine::buf::AlignedBuf;
use engine::device::{Channel, IoBuf};
use engine::reactor::{pop_if_any, Frontend, Io};
use tracing::{debug, info, warn};

use super::pdu::{
    self, C2hDataHdr, Cqe, Framing, H2cDataHdr, H2cExpect, IcPolicy, Parse, Pdu, PduError,
    PduParser, PduType, R2t, RecvLimits, Role, SglKind, Sqe, SHORT_HLEN, TERM_MAX_DATA,
};
use super::spec::{
    self, admin, csts, fctype, feature, io as iop, log, prop, sc, sct, AnaState, CtrlKind,
    ADMIN_IN_CAPSULE, AEC_ANA_CHANGE, AEN_ANA_CHANGE, AER_LIMIT, IDENTIFY_BYTES, IO_IN_CAPSULE,
    MAX_TRANSFER, MQES,
};
use super::{Ctrl, NewConn, PortalConn, QueueStats, Shared};
use crate::nbd::conn::{discard_unread, Discarded, LINGER};
use crate::nbd::pool::{BufId, BufPool};
use crate::nbd::BufferClass;

/// Bit 44 marks the NVMe/TCP front-end's array tags (iSCSI uses bit 45, NBD tags are
/// below 2^16); slot << 16 | context stays below 2^32 (at most 0xFFFF connections per
/// reactor, `local.rs`), so every tag is below [`engine::reactor::WHOLE_TAG_LIMIT`].
pub const TAG_BIT: u64 = 1 << 44;
/// PDUs one connection handles in one loop turn before the others get theirs.
pub const PDUS_PER_TURN: usize = 64;
/// Per-command buffer, bytes: transfers up to this size need no pool buffer.
const SMALL: usize = 4096;
/// Receive buffer: the largest PDU (an H2CData of MAXH2CDATA with header, digests) and
/// room to read ahead.
pub(crate) const RX_BYTES: usize = MAX_TRANSFER as usize + 8192;
/// Most iovecs one `sendmsg` gathers.
const IOV_PER_SEND: usize = 64;
/// Largest Discard piece, bytes (the request's length is 32 bits).
const DISCARD_PIECE: u64 = 1 << 30;
/// How long a draining connection may take to finish its commands at shutdown.
const DRAIN_GRACE: Duration = Duration::from_secs(5);
const NONE: u16 = u16::MAX;

/// Where a context's data lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Buf {
    None,
    /// The context's own 4 KiB buffer.
    Small,
    /// A pool buffer.
    Big(BufId),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    /// Waiting for pool buffer(s).
    WaitBuf,
    /// R2T sent, receiving H2CData.
    WaitData,
    /// Waiting for the reactor to take the array request.
    Pending,
    InArray,
    /// Its response (and data) is queued for sending.
    Replying,
    /// An Asynchronous Event Request held until an event (or the connection's end).
    Held,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Read,
    Write {
        fua: bool,
    },
    Flush,
    WriteZeroes {
        fua: bool,
    },
    /// Dataset Management with Attribute Deallocate: `nr` ranges in the buffer.
    Dsm {
        nr: u16,
    },
    /// Compare: host data in `buf`, array data read into `buf2`.
    Compare,
    /// An admin command answered from data the controller makes (C2HData then CQE).
    AdminData,
    /// Property Set of CC.SHN: the array is flushed, then CSTS.SHST reads complete.
    Shutdown,
}

#[derive(Clone, Copy, Debug)]
struct Cmd {
    state: State,
    kind: Kind,
    sqe: Sqe,
    /// Byte offset in the namespace.
    offset: u64,
    /// Data length, bytes (the transfer; for Write Zeroes the range).
    len: u32,
    buf: Buf,
    buf2: Buf,
    /// Data comes by R2T (else it was in the capsule, or there is none).
    r2t: bool,
    h2c: Option<H2cExpect>,
    digest_bad: bool,
    /// DSM progress: range index and blocks of it done.
    dsm_range: u16,
    dsm_done: u64,
}

impl Cmd {
    const FREE: Cmd = Cmd {
        state: State::Free,
        kind: Kind::Flush,
        sqe: Sqe {
            opcode: 0,
            flags: 0,
            cid: 0,
            nsid: 0,
            cdw2: 0,
            cdw3: 0,
            mptr: 0,
            dptr: pdu::SglDescriptor {
                address: 0,
                length: 0,
                reserved: [0; 3],
                sgl_identifier: 0,
            },
            cdw10: 0,
            cdw11: 0,
            cdw12: 0,
            cdw13: 0,
            cdw14: 0,
            cdw15: 0,
        },
        offset: 0,
        len: 0,
        buf: Buf::None,
        buf2: Buf::None,
        r2t: false,
        h2c: None,
        digest_bad: false,
        dsm_range: 0,
        dsm_done: 0,
    };
}

/// One PDU to send: a header (CH, PSH, HDGST), optional data from a context's buffer,
/// optional data digest.
struct Tx {
    head: [u8; SHORT_HLEN + 4 + TERM_MAX_DATA],
    head_len: u16,
    /// Context whose data follows the header (`NONE`: no data), and how much.
    data_cmd: u16,
    data_off: u32,
    data_len: u32,
    tail: [u8; 4],
    tail_len: u8,
    /// Context freed once this PDU is in the socket.
    release: u16,
    /// Close the connection once this PDU is in the socket (a C2HTermReq).
    close_after: bool,
}

impl Tx {
    /// A PDU with nothing encoded yet and no data or digest: the caller writes its
    /// header into `head` and sets `head_len`.
    fn empty(release: u16, close_after: bool) -> Tx {
        Tx {
            head: [0; SHORT_HLEN + 4 + TERM_MAX_DATA],
            head_len: 0,
            data_cmd: NONE,
            data_off: 0,
            data_len: 0,
            tail: [0; 4],
            tail_len: 0,
            release,
            close_after,
        }
    }
}

/// Admin-queue state of the controller it belongs to (only its reactor touches it).
struct Admin {
    cc: u32,
    csts: u32,
    /// KATO, ms (0: none).
    kato_ms: u32,
    last_ka: Instant,
    aec: u32,
    /// Asynchronous Event Requests held (their contexts), oldest first.
    aers: ArrayVec<u16, AER_LIMIT>,
    /// The portal's ANA change count this controller last accounted for.
    ana_seen: u64,
    /// An ANA change notice waits for an AER to carry it.
    ana_event: bool,
}

struct Queue {
    ctrl: Arc<Ctrl>,
    qid: u16,
    /// SQ size, 0's based.
    sqsize: u16,
    sqhd: u16,
    stats: Arc<QueueStats>,
    admin: Option<Admin>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Life {
    /// Waiting for ICReq.
    Init,
    Open,
    /// No more receiving: close once the send queue is empty (after a TermReq, a
    /// Disconnect, or at shutdown once the commands are done).
    Closing,
    /// Ended gracefully (a Disconnect, or shutdown with every command answered): every
    /// PDU sent and our side shut down (`shutdown(SHUT_WR)`); the socket stays open only
    /// to discard what the host still sends, until it closes its side or [`LINGER`]
    /// passes (an expired drain grace period or the portal's removal cuts it sooner).
    /// Closing a socket with unread bytes makes the kernel reset the connection (RFC 1122
    /// section 4.2.2.13), which throws away the responses still in our send queue and the
    /// host's receive queue. A connection ended by a C2HTermReq closes at once.
    Lingering,
    Closed,
}

struct Rx {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

struct Conn {
    id: u64,
    peer: SocketAddr,
    local: SocketAddr,
    /// The portal it was accepted on (closed when the portal is removed).
    portal: PortalConn,
    sock: Option<TcpStream>,
    life: Life,
    parser: PduParser,
    tx_framing: Framing,
    tx: VecDeque<Tx>,
    /// Bytes of the front PDU already sent.
    tx_sent: usize,
    q: Option<Queue>,
    cmds: Vec<Cmd>,
    free: Vec<u16>,
    small: AlignedBuf,
    wait_buf: VecDeque<u16>,
    pending: VecDeque<u16>,
    /// Array requests in flight for this connection: its slot stays until 0.
    in_array: u32,
    /// When the reactor adopted it: it must complete Connect within
    /// [`super::NvmfConfig::connect_timeout`].
    adopted: Instant,
    /// Pool buffers this connection's commands hold.
    pool_held: usize,
    /// The most pool buffers it may hold ([`buffer_cap`]).
    pool_cap: usize,
    /// When a [`Life::Lingering`] connection is closed whether or not its host closed its
    /// side.
    linger_until: Option<Instant>,
}

/// The most of a reactor's `total` pool buffers one connection may hold: a quarter, at
/// least two (a Compare needs two). A command past it waits in its queue's FIFO like one
/// that finds the pool empty. Without a cap, a host that sends write commands and
/// withholds their data (R2T answered never) holds every buffer of its reactor, and a
/// large read of any other queue there waits forever; with it, such a host takes a
/// quarter (test `a_host_withholding_r2t_data_does_not_starve_other_queues`).
fn buffer_cap(total: usize) -> usize {
    (total / 4).max(2)
}

/// The NVMe/TCP front-end of one reactor (see the module docs). Built by
/// [`super::NvmfServerBuilder::start`], one per reactor.
pub struct NvmfFrontend {
    reactor: usize,
    shared: Arc<Shared>,
    conns: Vec<Option<(Conn, Rx)>>,
    hi: usize,
    active: usize,
    pool: BufPool,
    finished: bool,
    drain_deadline: Option<Instant>,
    policy: IcPolicy,
}

fn status(sct_: u8, sc_: u8) -> u16 {
    // DNR for everything but transient errors: retrying cannot change the outcome.
    Cqe::status_word(sct_, sc_, sc_ != sc::TRANSIENT_TRANSPORT)
}

const OK: u16 = 0;

fn array_status(kind: Kind, e: ArrayError) -> u16 {
    match e {
        ArrayError::Miscompare { .. } => status(sct::MEDIA, sc::COMPARE_FAILURE),
        ArrayError::Invalid(_) => status(sct::GENERIC, sc::INVALID_FIELD),
        ArrayError::QueueFull => status(sct::GENERIC, sc::INTERNAL),
        ArrayError::Unrecoverable { .. } | ArrayError::Failed => match kind {
            Kind::Read | Kind::Compare => status(sct::MEDIA, sc::UNRECOVERED_READ),
            Kind::Write { .. } | Kind::WriteZeroes { .. } => status(sct::MEDIA, sc::WRITE_FAULT),
            _ => status(sct::GENERIC, sc::INTERNAL),
        },
    }
}

impl Conn {
    fn new(n: NewConn, max_in_capsule: u32, pool_cap: usize) -> Self {
        Self {
            id: n.id,
            peer: n.peer,
            local: n.local,
            portal: n.portal,
            sock: Some(n.stream),
            life: Life::Init,
            parser: PduParser::new(
                Role::Controller,
                RecvLimits {
                    max_in_capsule,
                    max_data_pdu: MAX_TRANSFER,
                },
            ),
            tx_framing: Framing::default(),
            tx: VecDeque::with_capacity(4),
            tx_sent: 0,
            q: None,
            // One context for the Connect; Connect sizes them for the queue.
            cmds: vec![Cmd::FREE; 1],
            free: vec![0],
            small: AlignedBuf::zeroed(SMALL),
            wait_buf: VecDeque::with_capacity(1),
            pending: VecDeque::with_capacity(1),
            in_array: 0,
            adopted: Instant::now(),
            pool_held: 0,
            pool_cap,
            linger_until: None,
        }
    }

    /// A pool buffer of `len` bytes for this connection: `None` when the pool has none
    /// or the connection holds its cap.
    fn take_big(&mut self, pool: &mut BufPool, len: u32) -> Option<BufId> {
        if self.pool_held >= self.pool_cap {
            return None;
        }
        let id = pool.take(len)?;
        self.pool_held += 1;
        Some(id)
    }

    /// Sizes the contexts for an SQ of `entries` (at Connect: not the data path).
    fn size_for(&mut self, entries: usize) {
        let n = entries + 1;
        self.cmds = vec![Cmd::FREE; n];
        self.free = (0..n as u16).rev().collect();
        self.small = AlignedBuf::zeroed(n * SMALL);
        // Up to three PDUs per context (C2HData, CapsuleResp; R2T) plus a TermReq; what
        // is still queued (the ICResp, if the socket has not taken it) stays in front.
        let old = std::mem::replace(&mut self.tx, VecDeque::with_capacity(3 * n + 2));
        self.tx.extend(old);
        self.wait_buf = VecDeque::with_capacity(n);
        self.pending = VecDeque::with_capacity(n);
    }

    fn small_buf(&mut self, c: u16) -> &mut [u8] {
        let at = usize::from(c) * SMALL;
        &mut self.small[at..at + SMALL]
    }

    fn push_tx(&mut self, t: Tx) {
        // Capacity holds every PDU the contexts can have queued: never reallocates
        // (a connection whose capacity is exceeded has a bug, not a slow path).
        debug_assert!(self.tx.len() < self.tx.capacity() || self.tx.capacity() < 8);
        self.tx.push_back(t);
    }

    fn tx_pdu(&mut self, p: &Pdu<'_>, data: Option<(u16, u32, u32)>, release: u16) {
        let mut t = Tx::empty(release, false);
        let dlen = data.map_or(0, |d| d.2 as usize);
        let n = p
            .encode_header(&self.tx_framing, dlen, &mut t.head)
            .expect("headers fit the buffer");
        t.head_len = n as u16;
        if let Some((c, off, len)) = data {
            t.data_cmd = c;
            t.data_off = off;
            t.data_len = len;
        }
        self.push_tx(t);
    }

    /// Queues the CapsuleResp of context `c` with `status`, DW0 `dw0`; the context is
    /// freed once it is sent.
    fn respond(&mut self, c: u16, status_: u16, dw0: u32, dw1: u32, stats_err: bool) {
        let cmd = &mut self.cmds[usize::from(c)];
        cmd.state = State::Replying;
        let cid = cmd.sqe.cid;
        let (sqhd, sqid) = self.q.as_ref().map_or((0, 0), |q| (q.sqhd, q.qid));
        if status_ != OK && stats_err {
            if let Some(q) = &self.q {
                q.stats.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        let cqe = Cqe {
            dw0,
            dw1,
            sqhd,
            sqid,
            cid,
            status: status_,
        };
        self.tx_pdu(&Pdu::CapsuleResp(cqe), None, c);
    }
}

/// A context's data buffer (small or pool), for the data path.
fn buf_mut<'a>(small: &'a mut AlignedBuf, pool: &'a mut BufPool, b: Buf, c: u16) -> &'a mut [u8] {
    match b {
        Buf::Small => {
            let at = usize::from(c) * SMALL;
            &mut small[at..at + SMALL]
        }
        Buf::Big(id) => pool.buf_mut(id),
        Buf::None => &mut [],
    }
}

fn buf_ref<'a>(small: &'a AlignedBuf, pool: &'a BufPool, b: Buf, c: u16) -> &'a [u8] {
    match b {
        Buf::Small => {
            let at = usize::from(c) * SMALL;
            &small[at..at + SMALL]
        }
        Buf::Big(id) => pool.buf(id),
        Buf::None => &[],
    }
}

/// What handling a received PDU asks of the caller.
enum Handled {
    Ok,
    Fatal(PduError),
    /// Close without a TermReq (the host sent H2CTermReq).
    Close,
}

impl NvmfFrontend {
    pub(crate) fn new(reactor: usize, shared: Arc<Shared>) -> Self {
        let pool = BufPool::new(&[BufferClass {
            bytes: MAX_TRANSFER,
            count: shared.config.buffers_per_reactor,
        }]);
        let n = shared.config.max_connections_per_reactor;
        Self {
            reactor,
            conns: (0..n).map(|_| None).collect(),
            hi: 0,
            active: 0,
            pool,
            finished: false,
            drain_deadline: None,
            policy: IcPolicy::new(MAX_TRANSFER).expect("128 KiB is a valid MAXH2CDATA"),
            shared,
        }
    }

    /// Connections this front-end holds.
    pub fn connections(&self) -> usize {
        self.active
    }

    /// Pool buffers free (all of them when no command is in flight).
    pub fn free_buffers(&self) -> usize {
        self.pool.free_count()
    }

    fn adopt(&mut self, mut n: NewConn) {
        let Some(slot) = self.conns.iter().position(Option::is_none) else {
            warn!(
                conn = n.id,
                "closing: reactor NVMe/TCP connection table full"
            );
            self.shared.held[self.reactor].fetch_sub(1, Ordering::AcqRel);
            return;
        };
        debug!(conn = n.id, peer = %n.peer, reactor = self.reactor, "NVMe/TCP connection");
        let rx = Rx {
            buf: std::mem::take(&mut n.rx),
            start: 0,
            end: 0,
        };
        let conn = Conn::new(
            n,
            ADMIN_IN_CAPSULE,
            buffer_cap(usize::from(self.shared.config.buffers_per_reactor)),
        );
        self.conns[slot] = Some((conn, rx));
        self.hi = self.hi.max(slot + 1);
        self.active += 1;
    }
}

/// Closes the connection's socket; contexts in the array stay until they complete.
fn close(conn: &mut Conn, pool: &mut BufPool, shared: &Shared, why: &dyn std::fmt::Display) {
    if conn.life == Life::Closed {
        return;
    }
    info!(conn = conn.id, peer = %conn.peer, "NVMe/TCP connection closed: {why}");
    if let Some(s) = conn.sock.take() {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    let lingered = conn.life == Life::Lingering;
    conn.life = Life::Closed;
    conn.linger_until = None;
    if !lingered {
        release(conn, pool, shared);
    }
}

/// Ends a connection whose every command was answered (a Disconnect, or shutdown):
/// our side is shut down so the host reads every response and then the end of stream,
/// what the connection holds is given back (its controller association ends with its
/// admin queue), and the socket lingers ([`Life::Lingering`]) until the host closes its
/// side or [`LINGER`] passes. Closing at once with the host's unread bytes (commands sent
/// after the drain began, their data) would reset the connection and could lose responses
/// already sent.
fn end_gracefully(conn: &mut Conn, pool: &mut BufPool, shared: &Shared, now: Instant) {
    debug_assert!(
        conn.tx.is_empty() && !busy(conn),
        "ended with commands unanswered"
    );
    let shut = conn
        .sock
        .as_ref()
        .is_some_and(|s| s.shutdown(std::net::Shutdown::Write).is_ok());
    if !shut {
        close(conn, pool, shared, &"closing");
        return;
    }
    debug!(conn = conn.id, "every response sent: our side shut down");
    release(conn, pool, shared);
    conn.life = Life::Lingering;
    conn.linger_until = Some(now + LINGER);
}

/// A lingering connection's turn: discards what its host sends (into its receive buffer)
/// and closes the socket once the host closed its side, [`LINGER`] passed, the portal was
/// removed or `expired` (the drain grace period). Returns whether anything moved (bytes
/// discarded, the socket closed).
fn linger(
    conn: &mut Conn,
    rx: &mut Rx,
    pool: &mut BufPool,
    shared: &Shared,
    expired: bool,
) -> bool {
    debug_assert_eq!(conn.life, Life::Lingering);
    let mut seen = Discarded::Bytes(0);
    let why = if expired {
        Some("shutdown grace period expired")
    } else if conn.portal.0.removed.load(Ordering::Acquire) {
        Some("its portal was removed")
    } else {
        seen = conn
            .sock
            .as_mut()
            .map_or(Discarded::Ended, |s| discard_unread(s, &mut rx.buf));
        match seen {
            Discarded::Ended => Some("host closed its side"),
            Discarded::Bytes(_) if conn.linger_until.is_none_or(|t| Instant::now() >= t) => {
                Some("host did not close its side in time")
            }
            Discarded::Bytes(_) => None,
        }
    };
    match why {
        Some(why) => {
            close(conn, pool, shared, &why);
            true
        }
        None => seen != Discarded::Bytes(0),
    }
}

/// Gives back what a connection that stops serving holds: its queued PDUs, the contexts
/// not in the array (with their buffers), and its queue's place in its controller (the
/// association ends with its admin queue).
fn release(conn: &mut Conn, pool: &mut BufPool, shared: &Shared) {
    conn.tx.clear();
    conn.tx_sent = 0;
    conn.wait_buf.clear();
    conn.pending.clear();
    for i in 0..conn.cmds.len() {
        let c = conn.cmds[i];
        if c.state != State::Free && c.state != State::InArray {
            release_bufs(conn, pool, i as u16);
            conn.cmds[i].state = State::Free;
            conn.free.push(i as u16);
        }
    }
    if let Some(q) = &conn.q {
        if q.admin.is_some() {
            // The association ends with its admin queue (research note §1.7, Disconnect).
            shared.drop_ctrl(&q.ctrl);
        } else {
            q.ctrl.queues().remove(&q.qid);
        }
    }
}

fn release_bufs(conn: &mut Conn, pool: &mut BufPool, c: u16) {
    let cmd = &mut conn.cmds[usize::from(c)];
    for b in [&mut cmd.buf, &mut cmd.buf2] {
        if let Buf::Big(id) = *b {
            pool.give(id);
            debug_assert!(conn.pool_held > 0, "a pool buffer the connection held");
            conn.pool_held = conn.pool_held.saturating_sub(1);
        }
        *b = Buf::None;
    }
}

fn free_cmd(conn: &mut Conn, pool: &mut BufPool, c: u16) {
    release_bufs(conn, pool, c);
    conn.cmds[usize::from(c)].state = State::Free;
    conn.free.push(c);
}

/// Sends queued PDUs. `Err` on a socket error.
fn send(conn: &mut Conn, pool: &mut BufPool) -> io::Result<bool> {
    let mut progress = false;
    loop {
        if conn.tx.is_empty() {
            return Ok(progress);
        }
        let Some(sock) = conn.sock.as_mut() else {
            return Ok(progress);
        };
        let sent = {
            let mut iov: ArrayVec<IoSlice<'_>, IOV_PER_SEND> = ArrayVec::new();
            let mut skip = conn.tx_sent;
            'items: for t in &conn.tx {
                let data: &[u8] = if t.data_cmd == NONE {
                    &[]
                } else {
                    let cmd = &conn.cmds[usize::from(t.data_cmd)];
                    let b = buf_ref(&conn.small, pool, cmd.buf, t.data_cmd);
                    &b[t.data_off as usize..(t.data_off + t.data_len) as usize]
                };
                for piece in [
                    &t.head[..usize::from(t.head_len)],
                    data,
                    &t.tail[..usize::from(t.tail_len)],
                ] {
                    if piece.len() <= skip {
                        skip -= piece.len();
                        continue;
                    }
                    if iov.is_full() {
                        break 'items;
                    }
                    iov.push(IoSlice::new(&piece[skip..]));
                    skip = 0;
                }
            }
            // sendmsg with MSG_NOSIGNAL rather than writev: a host gone before the send
            // gives EPIPE here, never a SIGPIPE to a program that embeds the target.
            match crate::nbd::conn::send_vectored(sock.as_raw_fd(), &iov, libc::MSG_DONTWAIT) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(progress),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        };
        if sent == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "socket took nothing",
            ));
        }
        progress = true;
        conn.tx_sent += sent;
        while let Some(t) = conn.tx.front() {
            let len = usize::from(t.head_len) + t.data_len as usize + usize::from(t.tail_len);
            if conn.tx_sent < len {
                break;
            }
            conn.tx_sent -= len;
            let (release, close_after) = (t.release, t.close_after);
            conn.tx.pop_front();
            if release != NONE {
                free_cmd(conn, pool, release);
            }
            if close_after {
                return Err(io::Error::other(
                    "fatal transport error reported (C2HTermReq)",
                ));
            }
        }
    }
}

impl NvmfFrontend {
    fn tag(slot: usize, c: u16) -> u64 {
        TAG_BIT | ((slot as u64) << 16) | u64::from(c)
    }
}

/// Queues a C2HTermReq for `e` (header of the offending PDU from `received`) and stops
/// receiving; the connection closes once it is sent.
fn fatal(conn: &mut Conn, e: &PduError, received: &[u8]) {
    warn!(conn = conn.id, peer = %conn.peer, fes = e.fes() as u16, fei = e.fei(),
        "NVMe/TCP fatal transport error: {e}");
    // Drop what has not started going out: the TermReq follows the PDU on the wire.
    let keep = usize::from(conn.tx_sent > 0);
    while conn.tx.len() > keep {
        conn.tx.pop_back();
    }
    let term = e.term_req(received);
    let mut t = Tx::empty(NONE, true);
    let n = Pdu::C2hTermReq(term)
        .encode(&conn.tx_framing, &mut t.head)
        .expect("a TermReq fits 152 bytes");
    t.head_len = n as u16;
    if conn.tx.capacity() == conn.tx.len() {
        // Before Connect the queue has room for a few: make sure (not the data path).
        conn.tx.reserve(1);
    }
    conn.tx.push_back(t);
    conn.life = Life::Closing;
}

struct Ctx<'a, 'b, C: Channel> {
    shared: &'a Shared,
    pool: &'a mut BufPool,
    io: &'a mut Io<'b, C>,
    slot: usize,
    policy: IcPolicy,
}

fn handle<C: Channel>(x: &mut Ctx<'_, '_, C>, conn: &mut Conn, r: pdu::Received<'_>) -> Handled {
    match r.pdu {
        Pdu::IcReq(req) => match pdu::negotiate(&req, &x.policy) {
            Ok(n) => {
                conn.parser.set_framing(n.rx);
                conn.tx_framing = n.tx;
                let mut t = Tx::empty(NONE, false);
                // ICResp is never digested and goes out whole in one write (its 128
                // bytes are copied into one header buffer, research note §1.2).
                let mut ic = [0u8; pdu::IC_LEN];
                Pdu::IcResp(n.resp)
                    .encode(&Framing::default(), &mut ic)
                    .expect("ICResp fits 128 bytes");
                t.head[..pdu::IC_LEN].copy_from_slice(&ic);
                t.head_len = pdu::IC_LEN as u16;
                conn.tx.push_back(t);
                conn.life = Life::Open;
                Handled::Ok
            }
            Err(e) => Handled::Fatal(e),
        },
        Pdu::H2cTermReq(t) => {
            info!(
                conn = conn.id,
                fes = t.fes,
                fei = t.fei,
                "host terminated the connection"
            );
            Handled::Close
        }
        Pdu::CapsuleCmd { sqe, data } => {
            capsule(x, conn, sqe, data, r.data_digest_ok);
            Handled::Ok
        }
        Pdu::H2cData { hdr, data } => h2c_data(x, conn, hdr, data, r.data_digest_ok),
        _ => Handled::Fatal(PduError::InvalidHeaderField {
            fei: 0,
            reason: "PDU type not sent by a host",
        }),
    }
}

fn h2c_data<C: Channel>(
    x: &mut Ctx<'_, '_, C>,
    conn: &mut Conn,
    hdr: H2cDataHdr,
    data: &[u8],
    digest_ok: bool,
) -> Handled {
    let c = hdr.ttag;
    let Some(cmd) = conn.cmds.get(usize::from(c)).copied() else {
        return Handled::Fatal(PduError::InvalidHeaderField {
            fei: 10,
            reason: "TTAG of no outstanding R2T",
        });
    };
    let Some(mut exp) = cmd.h2c.filter(|_| cmd.state == State::WaitData) else {
        return Handled::Fatal(PduError::InvalidHeaderField {
            fei: 10,
            reason: "TTAG of no outstanding R2T",
        });
    };
    let done = match exp.accept(&hdr, data.len() as u32) {
        Ok(d) => d,
        Err(e) => return Handled::Fatal(e),
    };
    let b = buf_mut(&mut conn.small, x.pool, cmd.buf, c);
    b[hdr.datao as usize..hdr.datao as usize + data.len()].copy_from_slice(data);
    let m = &mut conn.cmds[usize::from(c)];
    m.h2c = Some(exp);
    m.digest_bad |= !digest_ok;
    if done {
        m.h2c = None;
        if m.digest_bad {
            conn.respond(c, status(sct::GENERIC, sc::TRANSIENT_TRANSPORT), 0, 0, true);
        } else {
            m.state = State::Pending;
            start_array(x, conn, c);
        }
    }
    Handled::Ok
}

/// Takes the context for a capsule (the caller made sure one is free).
fn capsule<C: Channel>(
    x: &mut Ctx<'_, '_, C>,
    conn: &mut Conn,
    sqe: Sqe,
    data: &[u8],
    digest_ok: bool,
) {
    let Some(c) = conn.free.pop() else {
        // Checked before parsing; a host past its SQ size gets a C2HTermReq.
        return;
    };
    conn.cmds[usize::from(c)] = Cmd {
        state: State::Replying,
        sqe,
        ..Cmd::FREE
    };
    if let Some(q) = conn.q.as_mut() {
        q.sqhd = if q.sqhd >= q.sqsize { 0 } else { q.sqhd + 1 };
    }
    if !digest_ok {
        conn.respond(c, status(sct::GENERIC, sc::TRANSIENT_TRANSPORT), 0, 0, true);
        return;
    }
    if sqe.psdt() != pdu::PSDT_SGL || sqe.fuse() != 0 {
        conn.respond(c, status(sct::GENERIC, sc::INVALID_FIELD), 0, 0, true);
        return;
    }
    // The one SGL descriptor (TCP 1.0 §3.3.2, Fig. 14).
    match sqe.dptr.kind() {
        SglKind::InCapsule => {
            if sqe.dptr.address != 0 {
                conn.respond(c, status(sct::GENERIC, sc::SGL_OFFSET_INVALID), 0, 0, true);
                return;
            }
            if sqe.dptr.length as usize != data.len() {
                conn.respond(c, status(sct::GENERIC, sc::SGL_LENGTH_INVALID), 0, 0, true);
                return;
            }
        }
        SglKind::Transport => {
            if !data.is_empty() {
                conn.respond(c, status(sct::GENERIC, sc::SGL_LENGTH_INVALID), 0, 0, true);
                return;
            }
        }
        SglKind::Other(_) => {
            conn.respond(c, status(sct::GENERIC, sc::SGL_TYPE_INVALID), 0, 0, true);
            return;
        }
    }
    if sqe.opcode == admin::FABRICS {
        fabrics(x, conn, c, data);
        return;
    }
    let Some(q) = conn.q.as_ref() else {
        // Nothing but Connect before Connect (Base 2.0 §6.3).
        conn.respond(c, status(sct::GENERIC, sc::SEQUENCE), 0, 0, true);
        return;
    };
    if q.admin.is_some() {
        admin_cmd(x, conn, c, data);
    } else {
        io_cmd(x, conn, c, data);
    }
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn le64(b: &[u8], at: usize) -> u64 {
    u64::from(le32(b, at)) | (u64::from(le32(b, at + 4)) << 32)
}

/// The NUL-terminated string of a fixed NQN field.
fn nqn_field(b: &[u8]) -> &str {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    std::str::from_utf8(&b[..end]).unwrap_or("")
}

/// Connect Invalid Parameters (SCT 1, SC 82h) with IATTR (DW0 bit 16: in the data) and
/// IPO (byte offset) (Base 2.2 §6.3, Fig. 380).
fn connect_invalid(conn: &mut Conn, c: u16, in_data: bool, ipo: u16) {
    // As nvmet's IPO_IATTR_CONNECT_DATA/_SQE: IATTR in bit 16, IPO in bits 15:0.
    let dw0 = (u32::from(in_data) << 16) | u32::from(ipo);
    conn.respond(
        c,
        status(sct::COMMAND, sc::CONNECT_INVALID_PARAMETERS),
        dw0,
        0,
        true,
    );
}

fn fabrics<C: Channel>(x: &mut Ctx<'_, '_, C>, conn: &mut Conn, c: u16, data: &[u8]) {
    let sqe = conn.cmds[usize::from(c)].sqe;
    let fct = (sqe.nsid & 0xFF) as u8;
    match fct {
        fctype::CONNECT => connect(x, conn, c, data),
        fctype::PROPERTY_GET | fctype::PROPERTY_SET => {
            let Some(a) = conn.q.as_mut().and_then(|q| q.admin.as_mut()) else {
                let st = if conn.q.is_none() {
                    sc::SEQUENCE
                } else {
                    sc::INVALID_FIELD
                };
                conn.respond(c, status(sct::GENERIC, st), 0, 0, true);
                return;
            };
            // ATTRIB (CDW10 bits 2:0): 0 = 4-byte, 1 = 8-byte property; OFST in CDW11.
            let eight = sqe.cdw10 & 0b111 == 1;
            let ofst = sqe.cdw11;
            if fct == fctype::PROPERTY_GET {
                let v = match (ofst, eight) {
                    (prop::CAP, true) => Some(spec::CAP_VALUE),
                    (prop::VS, false) => Some(u64::from(spec::VERSION)),
                    (prop::CC, false) => Some(u64::from(a.cc)),
                    (prop::CSTS, false) => Some(u64::from(a.csts)),
                    _ => None,
                };
                match v {
                    Some(v) => conn.respond(c, OK, v as u32, (v >> 32) as u32, false),
                    None => conn.respond(c, status(sct::GENERIC, sc::INVALID_FIELD), 0, 0, true),
                }
            } else {
                let value = sqe.cdw12;
                if ofst != prop::CC || eight {
                    conn.respond(c, status(sct::GENERIC, sc::INVALID_FIELD), 0, 0, true);
                    return;
                }
                set_cc(x, conn, c, value);
            }
        }
        fctype::DISCONNECT => {
            conn.respond(c, OK, 0, 0, false);
            conn.life = Life::Closing;
        }
        _ => conn.respond(c, status(sct::GENERIC, sc::INVALID_OPCODE), 0, 0, true),
    }
}

/// Property Set CC (Base §3.1.3.5, the state machine of §3.6): EN 0→1 checks the entry
/// sizes and sets CSTS.RDY (or CSTS.CFS); EN 1→0 clears RDY; SHN ≠ 0 flushes the array,
/// then CSTS.SHST reads "complete" and the command completes.
fn set_cc<C: Channel>(x: &mut Ctx<'_, '_, C>, conn: &mut Conn, c: u16, value: u32) {
    let q = conn.q.as_mut().expect("admin queue");
    let ctrl = Arc::clone(&q.ctrl);
    let a = q.admin.as_mut().expect("admin queue");
    let was = a.cc;
    a.cc = value;
    if value & spec::cc::EN != 0 && was & spec::cc::EN == 0 {
        if spec::cc_valid(value) {
            a.csts = (a.csts & !csts::CFS) | csts::RDY;
            a.csts &= !csts::SHST_MASK;
            ctrl.ready.store(true, Ordering::Release);
        } else {
            a.csts |= csts::CFS;
        }
    } else if value & spec::cc::EN == 0 && was & spec::cc::EN != 0 {
        a.csts &= !(csts::RDY | csts::SHST_MASK);
        ctrl.ready.store(false, Ordering::Release);
    }
    let shn = (value >> spec::cc::SHN_SHIFT) & 0b11;
    if shn != 0 && (was >> spec::cc::SHN_SHIFT) & 0b11 == 0 {
        a.csts = (a.csts & !csts::SHST_MASK) | csts::SHST_OCCURRING;
        ctrl.ready.store(false, Ordering::Release);
        if ctrl.kind == CtrlKind::Io {
            let m = &mut conn.cmds[usize::from(c)];
            m.kind = Kind::Shutdown;
            m.state = State::Pending;
            start_array(x, conn, c);
            return;
        }
        a.csts = (a.csts & !csts::SHST_MASK) | csts::SHST_COMPLETE;
    }
    conn.respond(c, OK, 0, 0, false);
}

fn connect<C: Channel>(x: &mut Ctx<'_, '_, C>, conn: &mut Conn, c: u16, data: &[u8]) {
    let sqe = conn.cmds[usize::from(c)].sqe;
    if conn.q.is_some() {
        conn.respond(c, status(sct::GENERIC, sc::SEQUENCE), 0, 0, true);
        return;
    }
    // CDW10: RECFMT (15:0), QID (31:16); CDW11: SQSIZE (15:0), CATTR (23:16); CDW12: KATO.
    let recfmt = sqe.cdw10 & 0xFFFF;
    let qid = (sqe.cdw10 >> 16) as u16;
    let sqsize = (sqe.cdw11 & 0xFFFF) as u16;
    let kato = sqe.cdw12;
    if recfmt != 0 {
        conn.respond(
            c,
            status(sct::COMMAND, sc::CONNECT_INCOMPATIBLE_FORMAT),
            0,
            0,
            true,
        );
        return;
    }
    if data.len() < 1024 {
        conn.respond(c, status(sct::GENERIC, sc::SGL_LENGTH_INVALID), 0, 0, true);
        return;
    }
    // Connect data (Base 2.2 Fig. 379): HOSTID 0..16, CNTLID 16..18, SUBNQN 256..512,
    // HOSTNQN 512..768.
    let mut hostid = [0u8; 16];
    hostid.copy_from_slice(&data[..16]);
    let cntlid = u16::from_le_bytes([data[16], data[17]]);
    let subnqn = nqn_field(&data[256..512]);
    let hostnqn = nqn_field(&data[512..768]);
    let kind = if subnqn == spec::DISCOVERY_NQN {
        CtrlKind::Discovery
    } else if subnqn == x.shared.subsystem.nqn {
        CtrlKind::Io
    } else {
        warn!(conn = conn.id, subnqn, "Connect to an unknown subsystem");
        connect_invalid(conn, c, true, 256);
        return;
    };
    if kind == CtrlKind::Io && !x.shared.host_allowed(hostnqn) {
        // Connect Invalid Host with IATTR/IPO naming HOSTNQN, DNR set (as nvmet's
        // nvmet_alloc_ctrl; NVMe-oF 1.1 §3.3.1): the host gives up rather than retrying.
        x.shared.log_refused(hostnqn, conn.peer);
        conn.respond(
            c,
            status(sct::COMMAND, sc::CONNECT_INVALID_HOST),
            (1 << 16) | 512,
            0,
            true,
        );
        return;
    }
    if sqsize == 0 || sqsize > MQES {
        // SQSIZE is in CDW11, byte 44 of the SQE.
        connect_invalid(conn, c, false, 44);
        return;
    }
    if qid == 0 {
        if cntlid != 0xFFFF {
            // Dynamic controller model: the host asks for any controller.
            connect_invalid(conn, c, true, 16);
            return;
        }
        let portal = Arc::clone(&conn.portal.0);
        let ana_seen = portal.chgcnt.load(Ordering::Acquire);
        let Some(ctrl) = x.shared.new_ctrl(kind, hostnqn.to_string(), hostid, portal) else {
            conn.respond(c, status(sct::COMMAND, 0x81), 0, 0, true);
            return;
        };
        let kato_ms = if kind == CtrlKind::Discovery && kato == 0 {
            x.shared.config.discovery_idle.as_millis() as u32
        } else {
            kato
        };
        info!(conn = conn.id, peer = %conn.peer, cntlid = ctrl.cntlid, ?kind, hostnqn,
            kato_ms, "NVMe/TCP controller created");
        let cntlid = ctrl.cntlid;
        conn.size_for(usize::from(sqsize) + 1);
        conn.cmds[usize::from(c)] = Cmd {
            state: State::Replying,
            sqe,
            ..Cmd::FREE
        };
        conn.free.retain(|&f| f != c);
        conn.q = Some(Queue {
            ctrl,
            qid: 0,
            sqsize,
            sqhd: 1,
            stats: Arc::new(QueueStats::default()),
            admin: Some(Admin {
                cc: 0,
                csts: 0,
                kato_ms,
                last_ka: Instant::now(),
                aec: 0,
                aers: ArrayVec::new(),
                ana_seen,
                ana_event: false,
            }),
        });
        conn.respond(c, OK, u32::from(cntlid), 0, false);
        return;
    }
    let Some(ctrl) = x.shared.find_ctrl(cntlid) else {
        connect_invalid(conn, c, true, 16);
        return;
    };
    if ctrl.hostnqn != hostnqn || ctrl.kind != CtrlKind::Io {
        connect_invalid(conn, c, true, 512);
        return;
    }
    if !ctrl.ready.load(Ordering::Acquire) {
        conn.respond(c, status(sct::GENERIC, sc::SEQUENCE), 0, 0, true);
        return;
    }
    if qid > ctrl.io_queues.load(Ordering::Acquire) {
        // QID is in CDW10 bits 31:16: byte 42.
        connect_invalid(conn, c, false, 42);
        return;
    }
    let stats = Arc::new(QueueStats::default());
    {
        let mut qs = ctrl.queues();
        if qs.contains_key(&qid) {
            drop(qs);
            conn.respond(c, status(sct::GENERIC, sc::SEQUENCE), 0, 0, true);
            return;
        }
        qs.insert(qid, Arc::clone(&stats));
    }
    debug!(
        conn = conn.id,
        cntlid, qid, sqsize, "NVMe/TCP I/O queue connected"
    );
    conn.size_for(usize::from(sqsize) + 1);
    conn.cmds[usize::from(c)] = Cmd {
        state: State::Replying,
        sqe,
        ..Cmd::FREE
    };
    conn.free.retain(|&f| f != c);
    conn.parser.set_limits(RecvLimits {
        max_in_capsule: IO_IN_CAPSULE.max(1024),
        max_data_pdu: MAX_TRANSFER,
    });
    conn.q = Some(Queue {
        ctrl,
        qid,
        sqsize,
        sqhd: 1,
        stats,
        admin: None,
    });
    conn.respond(c, OK, u32::from(cntlid), 0, false);
}

/// Gets the buffer a data-in admin command of `len` bytes fills; `None` when it must wait
/// for a pool buffer (the context is queued).
fn admin_buffer(pool: &mut BufPool, conn: &mut Conn, c: u16, len: u32) -> Option<Buf> {
    if len as usize <= SMALL {
        return Some(Buf::Small);
    }
    match conn.take_big(pool, len) {
        Some(id) => Some(Buf::Big(id)),
        None => {
            conn.cmds[usize::from(c)].state = State::WaitBuf;
            conn.wait_buf.push_back(c);
            None
        }
    }
}

fn admin_cmd<C: Channel>(x: &mut Ctx<'_, '_, C>, conn: &mut Conn, c: u16, data: &[u8]) {
    let sqe = conn.cmds[usize::from(c)].sqe;
    let q = conn.q.as_mut().expect("admin queue");
    let kind = q.ctrl.kind;
    let ctrl = Arc::clone(&q.ctrl);
    let a = q.admin.as_mut().expect("admin queue");
    let ready = a.csts & csts::RDY != 0;
    match sqe.opcode {
        admin::KEEP_ALIVE => {
            a.last_ka = Instant::now();
            if a.kato_ms == 0 && kind == CtrlKind::Io {
                conn.respond(c, status(sct::GENERIC, sc::KEEP_ALIVE_INVALID), 0, 0, true);
            } else {
                conn.respond(c, OK, 0, 0, false);
            }
        }
        admin::AER => {
            if a.aers.try_push(c).is_err() {
                conn.respond(c, status(sct::COMMAND, sc::AER_LIMIT_EXCEEDED), 0, 0, true);
            } else {
                // Held until an event (an ANA change notice may be waiting for it) or
                // the connection's end.
                conn.cmds[usize::from(c)].state = State::Held;
                ana_notice(conn);
            }
        }
        admin::ABORT => conn.respond(c, OK, 1, 0, false),
        admin::SET_FEATURES => {
            let fid = (sqe.cdw10 & 0xFF) as u8;
            match fid {
                feature::NUMBER_OF_QUEUES => {
                    let nsqr = sqe.cdw11 & 0xFFFF;
                    let ncqr = sqe.cdw11 >> 16;
                    if nsqr == 0xFFFF || ncqr == 0xFFFF || kind != CtrlKind::Io {
                        conn.respond(c, status(sct::GENERIC, sc::INVALID_FIELD), 0, 0, true);
                        return;
                    }
                    if !ctrl.queues().is_empty() {
                        conn.respond(c, status(sct::GENERIC, sc::SEQUENCE), 0, 0, true);
                        return;
                    }
                    let want = (nsqr.min(ncqr) + 1).min(u32::from(spec::MAX_IO_QUEUES)) as u16;
                    ctrl.io_queues.store(want, Ordering::Release);
                    let g = u32::from(want - 1);
                    conn.respond(c, OK, g | (g << 16), 0, false);
                }
                feature::ASYNC_EVENT_CONFIG => {
                    a.aec = sqe.cdw11;
                    ctrl.aec.store(sqe.cdw11, Ordering::Release);
                    conn.respond(c, OK, 0, 0, false);
                }
                feature::KEEP_ALIVE_TIMER => {
                    a.kato_ms = sqe.cdw11;
                    a.last_ka = Instant::now();
                    conn.respond(c, OK, 0, 0, false);
                }
                feature::VOLATILE_WRITE_CACHE | feature::HOST_IDENTIFIER => conn.respond(
                    c,
                    status(sct::COMMAND, sc::FEATURE_NOT_CHANGEABLE),
                    0,
                    0,
                    true,
                ),
                _ => conn.respond(c, status(sct::GENERIC, sc::INVALID_FIELD), 0, 0, true),
            }
            let _ = data;
        }
        admin::GET_FEATURES => {
            let fid = (sqe.cdw10 & 0xFF) as u8;
            let v = match fid {
                feature::NUMBER_OF_QUEUES if kind == CtrlKind::Io => {
                    let n = u32::from(ctrl.io_queues.load(Ordering::Acquire).max(1) - 1);
                    Some(n | (n << 16))
                }
                feature::ASYNC_EVENT_CONFIG => Some(a.aec),
                feature::KEEP_ALIVE_TIMER => Some(a.kato_ms),
                feature::VOLATILE_WRITE_CACHE if kind == CtrlKind::Io => Some(1),
                feature::HOST_IDENTIFIER => {
                    // 128-bit host identifier (EXHID, CDW11 bit 0), returned as data.
                    if sqe.cdw11 & 1 == 0 || sqe.dptr.length < 16 {
                        conn.respond(c, status(sct::GENERIC, sc::INVALID_FIELD), 0, 0, true);
                        return;
                    }
                    let hostid = ctrl.hostid;
                    let m = &mut conn.cmds[usize::from(c)];
                    m.buf = Buf::Small;
                    conn.small_buf(c)[..16].copy_from_slice(&hostid);
                    conn.respond_data_any(x.pool, c, 16);
                    return;
                }
                _ => None,
            };
            match v {
                Some(v) => conn.respond(c, OK, v, 0, false),
                None => conn.respond(c, status(sct::GENERIC, sc::INVALID_FIELD), 0, 0, true),
            }
        }
        admin::IDENTIFY | admin::GET_LOG_PAGE => {
            if !ready {
                conn.respond(c, status(sct::GENERIC, sc::SEQUENCE), 0, 0, true);
                return;
            }
            let len = sqe.dptr.length;
            if sqe.dptr.kind() != SglKind::Transport || len > MAX_TRANSFER {
                conn.respond(c, status(sct::GENERIC, sc::SGL_LENGTH_INVALID), 0, 0, true);
                return;
            }
            conn.cmds[usize::from(c)].kind = Kind::AdminData;
            conn.cmds[usize::from(c)].len = len;
            let Some(b) = admin_buffer(x.pool, conn, c, len) else {
                return;
            };
            conn.cmds[usize::from(c)].buf = b;
            admin_data(x, conn, c);
        }
        _ => conn.respond(c, status(sct::GENERIC, sc::INVALID_OPCODE), 0, 0, true),
    }
}

/// Fills and sends the data of an Identify or Get Log Page whose buffer is ready.
fn admin_data<C: Channel>(x: &mut Ctx<'_, '_, C>, conn: &mut Conn, c: u16) {
    let cmd = conn.cmds[usize::from(c)];
    let sqe = cmd.sqe;
    let len = cmd.len;
    let q = conn.q.as_ref().expect("admin queue");
    let ctrl = Arc::clone(&q.ctrl);
    let s = &x.shared.subsystem;
    let local = conn.local;
    let out = &mut buf_mut(&mut conn.small, x.pool, cmd.buf, c)[..len as usize];
    let mut tmp = [0u8; IDENTIFY_BYTES];
    let mut ana_log_read = false;
    let result: Result<(), u16> = if sqe.opcode == admin::IDENTIFY {
        let cns = (sqe.cdw10 & 0xFF) as u8;
        let r = match (cns, ctrl.kind) {
            (0x01, k) => {
                spec::identify_controller(s, k, ctrl.cntlid, &mut tmp);
                Ok(())
            }
            (0x00, CtrlKind::Io) if sqe.nsid == 1 => {
                spec::identify_namespace(s, &mut tmp);
                Ok(())
            }
            (0x00, CtrlKind::Io) if sqe.nsid == 0 || sqe.nsid == 0xFFFF_FFFF => {
                Err(status(sct::GENERIC, sc::INVALID_NS))
            }
            // An inactive NSID: all zeroes (Base §5.17.2.1, as nvmet).
            (0x00, CtrlKind::Io) => Ok(()),
            (0x02, CtrlKind::Io) if sqe.nsid < 0xFFFF_FFFE => {
                spec::active_ns_list(sqe.nsid, &mut tmp);
                Ok(())
            }
            (0x03, CtrlKind::Io) if sqe.nsid == 1 => {
                spec::ns_descriptors(s, &mut tmp);
                Ok(())
            }
            (0x03, CtrlKind::Io) => Err(status(sct::GENERIC, sc::INVALID_NS)),
            // I/O Command Set specific controller data (CSI 0): nothing beyond zeroes.
            (0x06, CtrlKind::Io) if (sqe.cdw11 >> 24) == 0 => Ok(()),
            _ => Err(status(sct::GENERIC, sc::INVALID_FIELD)),
        };
        let n = (len as usize).min(IDENTIFY_BYTES);
        out.fill(0);
        out[..n].copy_from_slice(&tmp[..n]);
        r
    } else {
        // Get Log Page (Base §5.16): LID CDW10 7:0, NUMDL 31:16, NUMDU CDW11 15:0, LPO
        // CDW12/13 (dword aligned).
        let lid = (sqe.cdw10 & 0xFF) as u8;
        let numd = ((sqe.cdw10 >> 16) | ((sqe.cdw11 & 0xFFFF) << 16)) as u64 + 1;
        let lpo = u64::from(sqe.cdw12) | (u64::from(sqe.cdw13) << 32);
        out.fill(0);
        if numd * 4 != u64::from(len) || lpo % 4 != 0 {
            Err(status(sct::GENERIC, sc::INVALID_FIELD))
        } else {
            match (lid, ctrl.kind) {
                (log::DISCOVERY, CtrlKind::Discovery) => {
                    // The subsystem is listed only to hosts allowed to connect to it
                    // (nvmet's discovery_log_entries + nvmet_host_allowed).
                    let portals = if x.shared.host_allowed(&ctrl.hostnqn) {
                        x.shared.portals(local)
                    } else {
                        Vec::new()
                    };
                    let total = (spec::DISC_ENTRY_BYTES * (1 + portals.len())) as u64;
                    if lpo >= total {
                        Err(status(sct::GENERIC, sc::INVALID_FIELD))
                    } else {
                        let genctr = x.shared.disc_genctr.load(Ordering::Acquire);
                        spec::discovery_log(genctr, &s.nqn, &portals, lpo, out);
                        Ok(())
                    }
                }
                (log::ERROR | log::FW_SLOT | log::CHANGED_NS, CtrlKind::Io) => Ok(()),
                (log::ANA, CtrlKind::Io) => {
                    // LSP (CDW10 11:8) bit 0 RGO; RAE (CDW10 bit 15): keep the event.
                    let rgo = (sqe.cdw10 >> 8) & spec::ANA_LSP_RGO != 0;
                    let rae = sqe.cdw10 & (1 << 15) != 0;
                    if lpo >= spec::ana_log_len(rgo) as u64 {
                        Err(status(sct::GENERIC, sc::INVALID_FIELD))
                    } else {
                        let p = &ctrl.portal;
                        // The count first (Acquire), then the state it goes with.
                        let chgcnt = p.chgcnt.load(Ordering::Acquire);
                        spec::ana_log(chgcnt, p.ana(), rgo, lpo, out);
                        if !rae {
                            ana_log_read = true;
                        }
                        Ok(())
                    }
                }
                (log::SMART, CtrlKind::Io) => {
                    if lpo == 0 {
                        let mut page = [0u8; 512];
                        spec::smart_log(&ctrl.counters(), &mut page);
                        let n = out.len().min(512);
                        out[..n].copy_from_slice(&page[..n]);
                    }
                    Ok(())
                }
                _ => Err(status(sct::COMMAND, sc::INVALID_LOG_PAGE)),
            }
        }
    };
    if ana_log_read {
        // Reading log 0Ch without RAE clears the ANA change event (Base 2.0 §5.2): the
        // next change is notified again; a notice not yet carried is moot.
        ctrl.ana_masked.store(false, Ordering::Release);
        if let Some(a) = conn.q.as_mut().and_then(|q| q.admin.as_mut()) {
            a.ana_event = false;
        }
    }
    match result {
        Ok(()) => conn.respond_data_any(x.pool, c, len),
        Err(st) => {
            release_bufs(conn, x.pool, c);
            conn.respond(c, st, 0, 0, true);
        }
    }
}

/// Raises and delivers ANA change notices of an I/O controller's admin queue: a change
/// of its portal's ANA change count since it last looked becomes an event when the host
/// enabled the notice (AEC bit 11) and no earlier one is unacknowledged (masked until
/// log 0Ch is read without RAE); an event completes the oldest AER held with DW0
/// [`AEN_ANA_CHANGE`], or waits for the next AER. One atomic load when nothing changed.
fn ana_notice(conn: &mut Conn) {
    let Some(q) = conn.q.as_mut() else {
        return;
    };
    let Some(a) = q.admin.as_mut() else {
        return;
    };
    if q.ctrl.kind != CtrlKind::Io {
        return;
    }
    let cc = q.ctrl.portal.chgcnt.load(Ordering::Acquire);
    if cc != a.ana_seen {
        a.ana_seen = cc;
        if a.aec & AEC_ANA_CHANGE != 0 && !q.ctrl.ana_masked.swap(true, Ordering::AcqRel) {
            a.ana_event = true;
        }
    }
    if a.ana_event && !a.aers.is_empty() {
        a.ana_event = false;
        let c = a.aers.remove(0);
        debug!(
            conn = conn.id,
            cntlid = q.ctrl.cntlid,
            "ANA change notice sent"
        );
        conn.respond(c, OK, AEN_ANA_CHANGE, 0, false);
    }
}

impl Conn {
    /// Like [`Conn::respond_data`] for data in either kind of buffer.
    fn respond_data_any(&mut self, pool: &BufPool, c: u16, len: u32) {
        let cid = self.cmds[usize::from(c)].sqe.cid;
        if len > 0 {
            let hdr = C2hDataHdr {
                cccid: cid,
                datao: 0,
                last: true,
                success: false,
            };
            self.tx_pdu(&Pdu::C2hData { hdr, data: &[] }, Some((c, 0, len)), NONE);
            if self.tx_framing.ddgst {
                let b = buf_ref(&self.small, pool, self.cmds[usize::from(c)].buf, c);
                let d = pdu::digest(&b[..len as usize]);
                let t = self.tx.back_mut().expect("just queued");
                t.tail = d.to_le_bytes();
                t.tail_len = 4;
            }
        }
        self.respond(c, OK, 0, 0, false);
    }
}

fn io_cmd<C: Channel>(x: &mut Ctx<'_, '_, C>, conn: &mut Conn, c: u16, data: &[u8]) {
    let sqe = conn.cmds[usize::from(c)].sqe;
    let s = &x.shared.subsystem;
    let bs = u64::from(s.block_bytes);
    let bad = |conn: &mut Conn, st: u16| conn.respond(c, st, 0, 0, true);
    let opcode = sqe.opcode;
    if !matches!(
        opcode,
        iop::FLUSH | iop::WRITE | iop::READ | iop::COMPARE | iop::WRITE_ZEROES | iop::DSM
    ) {
        bad(conn, status(sct::GENERIC, sc::INVALID_OPCODE));
        return;
    }
    let ns_ok = sqe.nsid == 1 || (opcode == iop::FLUSH && sqe.nsid == 0xFFFF_FFFF);
    if !ns_ok {
        bad(conn, status(sct::GENERIC, sc::INVALID_NS));
        return;
    }
    // The path's ANA state (one atomic load): through an inaccessible portal, Asymmetric
    // Access Inaccessible without DNR, so the host fails over to another path (Base 2.0
    // §8.1.3; nvmet_check_ana_state). Non-optimized serves I/O normally.
    if conn
        .q
        .as_ref()
        .is_some_and(|q| q.ctrl.portal.ana.load(Ordering::Acquire) == AnaState::Inaccessible.code())
    {
        bad(
            conn,
            Cqe::status_word(sct::PATH, sc::ANA_INACCESSIBLE, false),
        );
        return;
    }
    let slba = u64::from(sqe.cdw10) | (u64::from(sqe.cdw11) << 32);
    let nlb = u64::from(sqe.cdw12 & 0xFFFF) + 1;
    let fua = sqe.cdw12 & (1 << 30) != 0;
    let in_range = slba.checked_add(nlb).is_some_and(|e| e <= s.blocks);
    let (kind, len) = match opcode {
        iop::FLUSH => (Kind::Flush, 0u64),
        iop::READ => (Kind::Read, nlb * bs),
        iop::WRITE => (Kind::Write { fua }, nlb * bs),
        iop::COMPARE => (Kind::Compare, nlb * bs),
        iop::WRITE_ZEROES => (Kind::WriteZeroes { fua }, nlb * bs),
        _ => {
            let nr = (sqe.cdw10 & 0xFF) as u16 + 1;
            if sqe.cdw11 & (1 << 2) == 0 {
                // No Attribute Deallocate: the ranges are hints only (NVM §3.2.3).
                conn.respond(c, OK, 0, 0, false);
                return;
            }
            (Kind::Dsm { nr }, u64::from(nr) * 16)
        }
    };
    if matches!(
        kind,
        Kind::Read | Kind::Write { .. } | Kind::Compare | Kind::WriteZeroes { .. }
    ) && !in_range
    {
        bad(conn, status(sct::GENERIC, sc::LBA_OUT_OF_RANGE));
        return;
    }
    let xfer = match kind {
        Kind::Read | Kind::Write { .. } | Kind::Compare => len,
        Kind::Dsm { .. } => u64::from(sqe.dptr.length),
        _ => 0,
    };
    if xfer > u64::from(MAX_TRANSFER) {
        bad(conn, status(sct::GENERIC, sc::INVALID_FIELD));
        return;
    }
    match kind {
        Kind::Read | Kind::Write { .. } | Kind::Compare if u64::from(sqe.dptr.length) != len => {
            bad(conn, status(sct::GENERIC, sc::SGL_LENGTH_INVALID));
            return;
        }
        Kind::Dsm { .. } if xfer < len => {
            bad(conn, status(sct::GENERIC, sc::SGL_LENGTH_INVALID));
            return;
        }
        Kind::Read if sqe.dptr.kind() != SglKind::Transport => {
            bad(conn, status(sct::GENERIC, sc::SGL_TYPE_INVALID));
            return;
        }
        _ => {}
    }
    {
        let m = &mut conn.cmds[usize::from(c)];
        m.kind = kind;
        // Only Read/Write/Compare/Write Zeroes have an SLBA (checked in range above, so
        // this cannot overflow); in Flush and DSM CDW10/11 are reserved or NR/attributes
        // (NVM Command Set 1.0 §3.2.3, §3.3.2) and may hold anything.
        m.offset = if in_range { slba * bs } else { 0 };
        m.len = if matches!(kind, Kind::Dsm { .. }) {
            xfer as u32
        } else {
            len as u32
        };
    }
    // Before any wait for a buffer or request slot: the reactor's turns stay bounded for
    // what is about to wait here (`Io::note_arrival`). A deallocate's length is that of
    // its range list, so it counts as small.
    if !matches!(kind, Kind::Flush) {
        let writes = matches!(
            kind,
            Kind::Write { .. } | Kind::WriteZeroes { .. } | Kind::Dsm { .. }
        );
        x.io.note_arrival(writes, len);
    }
    let needs_host_data = matches!(kind, Kind::Write { .. } | Kind::Compare | Kind::Dsm { .. });
    if needs_host_data && !data.is_empty() {
        // In-capsule data (≤ 4 KiB on an I/O queue): into the context's own buffer.
        conn.small_buf(c)[..data.len()].copy_from_slice(data);
        conn.cmds[usize::from(c)].buf = Buf::Small;
    } else if needs_host_data {
        conn.cmds[usize::from(c)].r2t = true;
    }
    conn.cmds[usize::from(c)].state = State::WaitBuf;
    conn.wait_buf.push_back(c);
    serve_waiting(x, conn);
}

/// Gives buffers to waiting contexts in order and starts them; stops at the first that
/// cannot get one.
fn serve_waiting<C: Channel>(x: &mut Ctx<'_, '_, C>, conn: &mut Conn) -> bool {
    let mut progress = false;
    while let Some(&c) = conn.wait_buf.front() {
        let cmd = conn.cmds[usize::from(c)];
        let admin = cmd.kind == Kind::AdminData;
        let len = cmd.len;
        let small_ok = len as usize <= SMALL;
        // Buffer for the transfer (host data or read data).
        let mut got = true;
        if cmd.buf == Buf::None && !matches!(cmd.kind, Kind::Flush | Kind::WriteZeroes { .. }) {
            if small_ok {
                conn.cmds[usize::from(c)].buf = Buf::Small;
            } else if let Some(id) = conn.take_big(x.pool, len) {
                conn.cmds[usize::from(c)].buf = Buf::Big(id);
            } else {
                got = false;
            }
        }
        // Compare reads the array into a second (pool) buffer.
        if got && cmd.kind == Kind::Compare && conn.cmds[usize::from(c)].buf2 == Buf::None {
            match conn.take_big(x.pool, len) {
                Some(id) => conn.cmds[usize::from(c)].buf2 = Buf::Big(id),
                None => got = false,
            }
        }
        if !got {
            return progress;
        }
        conn.wait_buf.pop_front();
        progress = true;
        if admin {
            admin_data(x, conn, c);
            continue;
        }
        let m = &mut conn.cmds[usize::from(c)];
        if m.r2t {
            // Ask for all of it in one R2T (MAXH2CDATA ≥ MDTS: one H2CData with Linux).
            let r = R2t {
                cccid: m.sqe.cid,
                ttag: c,
                r2to: 0,
                r2tl: m.len,
            };
            m.h2c = Some(H2cExpect::new(r));
            m.state = State::WaitData;
            conn.tx_pdu(&Pdu::R2t(r), None, NONE);
        } else {
            m.state = State::Pending;
            start_array(x, conn, c);
        }
    }
    progress
}

/// The next array request of context `c`, or its final status when there is none left.
fn next_request(
    s: &spec::Subsystem,
    conn: &mut Conn,
    pool: &mut BufPool,
    c: u16,
    slot: usize,
) -> Result<ArrayRequest, u16> {
    let tag = NvmfFrontend::tag(slot, c);
    let cmd = conn.cmds[usize::from(c)];
    let lend = |conn: &mut Conn, pool: &mut BufPool, b: Buf| -> IoBuf {
        let bytes = buf_mut(&mut conn.small, pool, b, c);
        let ptr = NonNull::new(bytes.as_mut_ptr()).expect("buffers are allocated");
        // SAFETY: the buffer belongs to context `c` from its acceptance until its
        // response is sent; while the request is in the array nothing here touches it
        // (the context is InArray, and a connection closed meanwhile keeps InArray
        // contexts and their buffers — and its slot — until the completion arrives), and
        // the memory outlives every request (the reactor returns its front-end only when
        // nothing is in flight). `cmd.len` ≤ the buffer's length (4 KiB or MAX_TRANSFER,
        // checked at acceptance); both kinds of buffer are 4096-aligned (AlignedBuf).
        unsafe { IoBuf::from_raw(ptr, cmd.len, None) }
    };
    let (op, buf, offset, len) = match cmd.kind {
        Kind::Read => (
            ArrayOp::Read,
            lend(conn, pool, cmd.buf),
            cmd.offset,
            cmd.len,
        ),
        Kind::Write { fua } => (
            ArrayOp::Write { fua },
            lend(conn, pool, cmd.buf),
            cmd.offset,
            cmd.len,
        ),
        Kind::Compare => (
            ArrayOp::Read,
            lend(conn, pool, cmd.buf2),
            cmd.offset,
            cmd.len,
        ),
        Kind::Flush | Kind::Shutdown => return Ok(ArrayRequest::flush(tag)),
        Kind::WriteZeroes { fua } => (
            ArrayOp::WriteZeroes { fua },
            IoBuf::NONE,
            cmd.offset,
            cmd.len,
        ),
        Kind::Dsm { nr } => {
            // Next (piece of a) range: {context attributes u32, NLB u32, SLBA u64}
            // (NVM §3.2.3, Fig. 39); every range was checked before the first.
            let bs = u64::from(s.block_bytes);
            let ranges = buf_ref(&conn.small, pool, cmd.buf, c);
            let (mut i, mut done) = (cmd.dsm_range, cmd.dsm_done);
            loop {
                if i >= nr {
                    return Err(OK);
                }
                let at = usize::from(i) * 16;
                let nlb = u64::from(le32(ranges, at + 4));
                let slba = le64(ranges, at + 8);
                if done < nlb {
                    let piece = (nlb - done).min(DISCARD_PIECE / bs);
                    let m = &mut conn.cmds[usize::from(c)];
                    m.dsm_range = i;
                    m.dsm_done = done + piece;
                    break (
                        ArrayOp::Discard,
                        IoBuf::NONE,
                        (slba + done) * bs,
                        (piece * bs) as u32,
                    );
                }
                i += 1;
                done = 0;
            }
        }
        Kind::AdminData => return Err(status(sct::GENERIC, sc::INTERNAL)),
    };
    Ok(ArrayRequest {
        tag,
        op,
        offset_bytes: offset,
        len_bytes: len,
        buf,
    })
}

/// Whether every DSM range lies inside the namespace (checked before the first discard).
fn dsm_ranges_ok(s: &spec::Subsystem, ranges: &[u8], nr: u16) -> bool {
    (0..usize::from(nr)).all(|i| {
        let nlb = u64::from(le32(ranges, i * 16 + 4));
        let slba = le64(ranges, i * 16 + 8);
        slba.checked_add(nlb).is_some_and(|e| e <= s.blocks)
    })
}

/// Starts context `c` (state Pending): submits its array request, or queues it behind
/// earlier ones when the reactor is full.
fn start_array<C: Channel>(x: &mut Ctx<'_, '_, C>, conn: &mut Conn, c: u16) {
    let cmd = conn.cmds[usize::from(c)];
    if let Kind::Dsm { nr } = cmd.kind {
        if cmd.dsm_range == 0 && cmd.dsm_done == 0 {
            let ranges = buf_ref(&conn.small, x.pool, cmd.buf, c);
            if !dsm_ranges_ok(&x.shared.subsystem, ranges, nr) {
                release_bufs(conn, x.pool, c);
                conn.respond(c, status(sct::GENERIC, sc::LBA_OUT_OF_RANGE), 0, 0, true);
                return;
            }
        }
    }
    if !conn.pending.is_empty() || !submit_one(x, conn, c) {
        conn.pending.push_back(c);
    }
}

/// Submits the next array request of `c`; false when the reactor is full (nothing
/// changed). A context with nothing left to submit gets its response.
fn submit_one<C: Channel>(x: &mut Ctx<'_, '_, C>, conn: &mut Conn, c: u16) -> bool {
    let saved = {
        let m = &conn.cmds[usize::from(c)];
        (m.dsm_range, m.dsm_done)
    };
    let r = match next_request(&x.shared.subsystem, conn, x.pool, c, x.slot) {
        Ok(r) => r,
        Err(st) => {
            release_bufs(conn, x.pool, c);
            conn.respond(c, st, 0, 0, st != OK);
            return true;
        }
    };
    match x.io.submit(r) {
        Ok(()) => {
            conn.cmds[usize::from(c)].state = State::InArray;
            conn.in_array += 1;
            true
        }
        Err(ArrayError::QueueFull) => {
            let m = &mut conn.cmds[usize::from(c)];
            (m.dsm_range, m.dsm_done) = saved;
            false
        }
        Err(e) => {
            let kind = conn.cmds[usize::from(c)].kind;
            release_bufs(conn, x.pool, c);
            conn.respond(c, array_status(kind, e), 0, 0, true);
            true
        }
    }
}

/// The array finished a request of context `c`.
fn on_complete(conn: &mut Conn, pool: &mut BufPool, c: u16, result: Result<(), ArrayError>) {
    conn.in_array -= 1;
    if matches!(conn.life, Life::Closed | Life::Lingering) {
        free_cmd(conn, pool, c);
        return;
    }
    let cmd = conn.cmds[usize::from(c)];
    if let Err(e) = result {
        if cmd.kind == Kind::Shutdown {
            warn!(conn = conn.id, "flush at controller shutdown failed: {e}");
        } else {
            warn!(conn = conn.id, kind = ?cmd.kind, offset = cmd.offset, len = cmd.len,
                "array request failed: {e}");
            release_bufs(conn, pool, c);
            conn.respond(c, array_status(cmd.kind, e), 0, 0, true);
            return;
        }
    }
    let stats = conn.q.as_ref().map(|q| Arc::clone(&q.stats));
    match cmd.kind {
        Kind::Read => {
            if let Some(s) = &stats {
                s.reads.fetch_add(1, Ordering::Relaxed);
                s.bytes_read
                    .fetch_add(u64::from(cmd.len), Ordering::Relaxed);
            }
            conn.respond_data_any(pool, c, cmd.len);
        }
        Kind::Write { .. } => {
            if let Some(s) = &stats {
                s.writes.fetch_add(1, Ordering::Relaxed);
                s.bytes_written
                    .fetch_add(u64::from(cmd.len), Ordering::Relaxed);
            }
            release_bufs(conn, pool, c);
            conn.respond(c, OK, 0, 0, false);
        }
        Kind::Compare => {
            let n = cmd.len as usize;
            let same = buf_ref(&conn.small, pool, cmd.buf, c)[..n]
                == buf_ref(&conn.small, pool, cmd.buf2, c)[..n];
            release_bufs(conn, pool, c);
            let st = if same {
                OK
            } else {
                status(sct::MEDIA, sc::COMPARE_FAILURE)
            };
            conn.respond(c, st, 0, 0, !same);
        }
        Kind::Dsm { .. } => {
            // The next range (or the response) on the next turn, where the reactor is.
            conn.cmds[usize::from(c)].state = State::Pending;
            conn.pending.push_back(c);
        }
        Kind::Shutdown => {
            if let Some(a) = conn.q.as_mut().and_then(|q| q.admin.as_mut()) {
                a.csts = (a.csts & !csts::SHST_MASK) | csts::SHST_COMPLETE;
            }
            info!(
                conn = conn.id,
                "controller shutdown complete (array flushed)"
            );
            conn.respond(c, OK, 0, 0, false);
        }
        Kind::Flush | Kind::WriteZeroes { .. } | Kind::AdminData => {
            conn.respond(c, OK, 0, 0, false);
        }
    }
}

/// Whether a context is doing anything (an AER held is not).
fn busy(conn: &Conn) -> bool {
    conn.cmds
        .iter()
        .any(|m| !matches!(m.state, State::Free | State::Held))
}

/// Receives and handles PDUs. Returns whether anything moved.
fn receive<C: Channel>(x: &mut Ctx<'_, '_, C>, conn: &mut Conn, rx: &mut Rx) -> bool {
    let mut progress = false;
    let mut handled = 0;
    while handled < PDUS_PER_TURN && matches!(conn.life, Life::Init | Life::Open) {
        if rx.end > rx.start
            && rx.buf[rx.start] == PduType::CapsuleCmd as u8
            && conn.free.is_empty()
        {
            // Every context is taken (SQ size + 1 of them): the host is past its SQ size.
            // Waiting would hang the queue when the data that frees a context (H2CData)
            // is behind this capsule: a fatal PDU Sequence Error (TCP 1.0 §3.6.2.3; nvmet
            // ends such a queue too).
            let e = PduError::PduSequence {
                fei: 0,
                reason: "capsule past the SQ size",
            };
            fatal(conn, &e, &rx.buf[rx.start..rx.end]);
            progress = true;
            break;
        }
        match conn.parser.parse(&rx.buf[rx.start..rx.end]) {
            Ok(Parse::Pdu(r)) => {
                let len = r.len;
                let h = handle(x, conn, r);
                let at = rx.start;
                rx.start += len;
                handled += 1;
                progress = true;
                match h {
                    Handled::Ok => {}
                    Handled::Fatal(e) => {
                        fatal(conn, &e, &rx.buf[at..rx.end]);
                        break;
                    }
                    Handled::Close => {
                        close(conn, x.pool, x.shared, &"host sent H2CTermReq");
                        break;
                    }
                }
            }
            Ok(Parse::Need(n)) => {
                if rx.start == rx.end {
                    rx.start = 0;
                    rx.end = 0;
                } else if rx.end + n > rx.buf.len() {
                    rx.buf.copy_within(rx.start..rx.end, 0);
                    rx.end -= rx.start;
                    rx.start = 0;
                }
                let Some(sock) = conn.sock.as_mut() else {
                    break;
                };
                match sock.read(&mut rx.buf[rx.end..]) {
                    Ok(0) => {
                        let why = if rx.end > rx.start {
                            "host closed the connection inside a PDU"
                        } else {
                            "host closed the connection"
                        };
                        close(conn, x.pool, x.shared, &why);
                        break;
                    }
                    Ok(k) => {
                        rx.end += k;
                        progress = true;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        close(conn, x.pool, x.shared, &format_args!("receive: {e}"));
                        break;
                    }
                }
            }
            Err(e) => {
                fatal(conn, &e, &rx.buf[rx.start..rx.end]);
                break;
            }
        }
    }
    progress
}

impl Frontend for NvmfFrontend {
    fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
        let mut progress = false;
        while let Some(n) = pop_if_any(&self.shared.inboxes[self.reactor]) {
            if self.finished {
                self.shared.held[self.reactor].fetch_sub(1, Ordering::AcqRel);
                continue;
            }
            self.adopt(n);
            progress = true;
        }
        let mut expired = false;
        if self.shared.shutdown.load(Ordering::Acquire) {
            let now = Instant::now();
            match self.drain_deadline {
                None => {
                    self.drain_deadline = Some(now + DRAIN_GRACE);
                    for (conn, _) in self.conns.iter_mut().flatten() {
                        if matches!(conn.life, Life::Init | Life::Open) {
                            conn.life = Life::Closing;
                        }
                    }
                    progress = true;
                }
                Some(d) => expired = now >= d,
            }
        }
        let draining = self.drain_deadline.is_some();
        let Self {
            conns,
            pool,
            shared,
            policy,
            reactor,
            ..
        } = self;
        let mut now: Option<Instant> = None;
        for (slot, entry) in conns.iter_mut().enumerate().take(self.hi) {
            let Some((conn, rx)) = entry.as_mut() else {
                continue;
            };
            if conn.life == Life::Lingering {
                progress |= linger(conn, rx, pool, shared, expired);
            } else if conn.life != Life::Closed {
                if expired {
                    close(conn, pool, shared, &"shutdown grace period expired");
                } else if conn.portal.0.removed.load(Ordering::Acquire) {
                    close(conn, pool, shared, &"its portal was removed");
                } else if let Some(q) = &conn.q {
                    // At shutdown (export removal) a draining queue still answers what it
                    // took when its admin queue drained first and ended the association
                    // (the drain grace period bounds it), unless a command waits for data
                    // that a queue no longer receiving never gets.
                    let drains = || {
                        conn.life == Life::Closing
                            && draining
                            && !conn.cmds.iter().any(|m| m.state == State::WaitData)
                    };
                    if q.ctrl.dead.load(Ordering::Acquire) && !drains() {
                        close(conn, pool, shared, &"controller association ended");
                    } else if let Some(a) = &q.admin {
                        if a.kato_ms > 0 {
                            let t = *now.get_or_insert_with(Instant::now);
                            // KATO rounded up to whole seconds, as nvmet does (Base §3.9:
                            // the controller may round up).
                            let limit = Duration::from_secs(u64::from(a.kato_ms).div_ceil(1000));
                            if t.duration_since(a.last_ka) > limit {
                                let why = format!(
                                    "keep-alive timeout ({} ms without Keep Alive)",
                                    a.kato_ms
                                );
                                close(conn, pool, shared, &why);
                            }
                        }
                    }
                } else {
                    let t = *now.get_or_insert_with(Instant::now);
                    let limit = shared.config.connect_timeout;
                    if t.duration_since(conn.adopted) > limit {
                        let why = format!("no Fabrics Connect within {limit:?} of accept");
                        close(conn, pool, shared, &why);
                    }
                }
            }
            if !matches!(conn.life, Life::Closed | Life::Lingering) {
                let mut x = Ctx {
                    shared,
                    pool,
                    io,
                    slot,
                    policy: *policy,
                };
                while let Some(&c) = conn.pending.front() {
                    if !submit_one(&mut x, conn, c) {
                        break;
                    }
                    conn.pending.pop_front();
                    progress = true;
                }
                progress |= serve_waiting(&mut x, conn);
                ana_notice(conn);
                let mut moved = match send(conn, x.pool) {
                    Ok(p) => p,
                    Err(e) => {
                        close(conn, x.pool, x.shared, &e);
                        true
                    }
                };
                if conn.life != Life::Closed {
                    moved |= receive(&mut x, conn, rx);
                }
                if conn.life != Life::Closed && !conn.tx.is_empty() {
                    match send(conn, x.pool) {
                        Ok(p) => moved |= p,
                        Err(e) => close(conn, x.pool, x.shared, &e),
                    }
                }
                if conn.life == Life::Closing && conn.tx.is_empty() && !busy(conn) {
                    let t = *now.get_or_insert_with(Instant::now);
                    end_gracefully(conn, x.pool, x.shared, t);
                    moved = true;
                }
                progress |= moved;
            }
            if conn.life == Life::Closed && conn.in_array == 0 {
                *entry = None;
                self.active -= 1;
                shared.held[*reactor].fetch_sub(1, Ordering::AcqRel);
                progress = true;
            }
        }
        while self.hi > 0 && self.conns[self.hi - 1].is_none() {
            self.hi -= 1;
        }
        if self.active == 0 && self.shared.shutdown.load(Ordering::Acquire) && !self.finished {
            debug_assert_eq!(self.pool.free_count(), self.pool.len());
            info!(reactor = self.reactor, "NVMe/TCP front-end drained");
            self.finished = true;
        }
        progress
    }

    fn complete(&mut self, done: ArrayCompletion) {
        let slot = ((done.tag & !TAG_BIT) >> 16) as usize;
        let c = (done.tag & 0xFFFF) as u16;
        let Some(Some((conn, _))) = self.conns.get_mut(slot) else {
            warn!(tag = done.tag, "NVMe/TCP completion for no connection");
            return;
        };
        if conn.cmds.get(usize::from(c)).map(|m| m.state) != Some(State::InArray) {
            warn!(
                tag = done.tag,
                "NVMe/TCP completion for a context not in the array"
            );
            return;
        }
        on_complete(conn, &mut self.pool, c, done.status);
    }

    fn finished(&self) -> bool {
        self.finished
    }
}
