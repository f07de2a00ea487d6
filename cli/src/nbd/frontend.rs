//! The NBD front-end of one reactor: connections in the transmission phase, driven from
//! the reactor loop.
//!
//! Each loop turn ([`Frontend::poll`]) the front-end
//! 1. adopts connections the handshake thread finished (a lock-free inbox);
//! 2. retries array submissions the reactor refused with `QueueFull`, in order;
//! 3. for every connection: sends queued replies (one `sendmsg` gathers several, partial
//!    sends resume next turn), then reads and judges request headers, receives write
//!    payloads, and submits array requests (partial reads resume next turn);
//! 4. frees connections that are closed and no longer referenced by any request.
//!
//! Completions ([`Frontend::complete`]) queue the reply on the request's connection;
//! replies leave in completion order, so they may overtake each other (the client matches
//! them by handle, proto.md "Transmission").
//!
//! # Limits and memory
//! Everything is allocated when the front-end is built (contexts, buffers, the
//! connection table) or when a connection is built by the handshake thread (receive buffer,
//! reply queue). The data path takes and returns contexts and buffers from free lists;
//! sockets are non-blocking. A connection holding its `max_inflight` requests, or finding no
//! free buffer or context, simply stops reading until some complete.
//!
//! # Buffers are lent to the array
//! A request's buffer belongs to its context from the moment the header is accepted until
//! the reply is sent. If the client vanishes meanwhile, the socket is closed at once but
//! the context (and its buffer) is only released when the array's completion arrives, so
//! the array never writes into a buffer that was given to another request. A closed
//! connection's slot is reused only once no context refers to it.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use arrayvec::ArrayVec;
use crossbeam_queue::ArrayQueue;
use engine::array::{ArrayCompletion, ArrayError, ArrayOp, ArrayRequest};
use engine::device::{Channel, IoBuf};
use engine::reactor::{pop_if_any, Frontend, Io};
use tracing::{debug, info, warn};

use super::conn::{Conn, Life, Reply, Rx, LINGER, NO_CTX, RBUF_BYTES, STATUS_CTX};
use super::pool::{BufId, BufPool};
use super::proto::{self, Verdict};
use super::Shared;

/// Requests one connection may receive in one loop turn before the others get theirs.
const REQUESTS_PER_TURN: u32 = 64;
/// Write payload bytes the front-end receives in one loop turn, all connections together
/// (issue 24): receiving is a copy out of the socket at a few GB/s, so this bounds a turn's
/// receive work to some tens of µs — a 4 KiB read on another connection waits at most that
/// long behind bulk writes' payloads, instead of behind every buffer's worth of them (8 ×
/// 4 MiB by default). Headers are never held back by it: requests without a payload
/// (reads, flushes) are taken in every turn. The connection that used the budget up goes
/// last in the next turn.
const PAYLOAD_BYTES_PER_TURN: usize = 256 << 10;
/// Most reply pieces one `sendmsg` gathers (each reply has up to four).
const IOV_PER_SEND: usize = 64;
/// Bytes of the sink a rejected write's payload is read into and dropped.
const SCRATCH_BYTES: usize = 64 << 10;
/// Contexts for requests without data (flush, trim, write-zeroes), beyond one per buffer.
pub(crate) const DATALESS_CONTEXTS: usize = 64;

/// What a context asks of the array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Read,
    Write {
        fua: bool,
    },
    Flush,
    /// Discard; with `fua`, a flush follows before the reply (proto.md "Command flags":
    /// no reply "until all write operations (if any) associated with that command have
    /// been completed and persisted").
    Trim {
        fua: bool,
    },
    WriteZeroes {
        fua: bool,
    },
}

/// One accepted request that needs the array.
#[derive(Clone, Copy, Debug)]
struct Ctx {
    live: bool,
    /// Submitted and not yet completed: only then may a completion name this context.
    in_array: bool,
    conn: u16,
    handle: u64,
    op: Op,
    /// Byte offset and length in the export (the whole request).
    offset: u64,
    len: u32,
    /// Reads and writes longer than the largest buffer go to the array in pieces, one
    /// after the other through the same buffer: bytes of the request already done, and
    /// the length of the current piece (`len` for everything else).
    done: u32,
    piece: u32,
    /// Data buffer (reads and writes), else `NO_BUF`.
    buf: BufId,
}

const NO_BUF: BufId = BufId::MAX;

/// Contexts, buffers and the submission backlog: everything a connection's requests use
/// that is not the connection itself.
struct Core {
    ctxs: Vec<Ctx>,
    free_ctx: Vec<u16>,
    pool: BufPool,
    /// Contexts waiting for `Io::submit` (it said `QueueFull`), in arrival order.
    pending: VecDeque<u16>,
    scratch: Box<[u8]>,
    /// Write payload bytes this turn may still receive ([`PAYLOAD_BYTES_PER_TURN`]).
    payload_budget: usize,
}

impl Core {
    fn take_ctx(
        &mut self,
        conn: &mut Conn,
        ci: u16,
        handle: u64,
        op: Op,
        offset: u64,
        len: u32,
    ) -> Option<u16> {
        // A request longer than the largest buffer is served in pieces of that size.
        let piece = match op {
            Op::Read | Op::Write { .. } => len.min(self.pool.largest()),
            _ => len,
        };
        let buf = match op {
            Op::Read | Op::Write { .. } => Some(self.pool.take(piece)?),
            _ => None,
        };
        let Some(c) = self.free_ctx.pop() else {
            if let Some(b) = buf {
                self.pool.give(b);
            }
            return None;
        };
        self.ctxs[usize::from(c)] = Ctx {
            live: true,
            in_array: false,
            conn: ci,
            handle,
            op,
            offset,
            len,
            done: 0,
            piece,
            buf: buf.unwrap_or(NO_BUF),
        };
        conn.ctx_held += 1;
        Some(c)
    }

    fn release(&mut self, c: u16, conn: &mut Conn) {
        let ctx = &mut self.ctxs[usize::from(c)];
        debug_assert!(ctx.live, "context {c} released twice");
        ctx.live = false;
        if ctx.buf != NO_BUF {
            self.pool.give(ctx.buf);
            ctx.buf = NO_BUF;
        }
        // Capacity is the context count: never reallocates.
        self.free_ctx.push(c);
        conn.ctx_held -= 1;
    }

    fn request(&mut self, c: u16) -> ArrayRequest {
        let ctx = self.ctxs[usize::from(c)];
        let (op, buf) = match ctx.op {
            Op::Read => (ArrayOp::Read, self.lend(ctx.buf, ctx.piece)),
            Op::Write { fua } => (ArrayOp::Write { fua }, self.lend(ctx.buf, ctx.piece)),
            Op::Flush => return ArrayRequest::flush(u64::from(c)),
            Op::Trim { .. } => (ArrayOp::Discard, IoBuf::NONE),
            Op::WriteZeroes { fua } => (ArrayOp::WriteZeroes { fua }, IoBuf::NONE),
        };
        ArrayRequest {
            tag: u64::from(c),
            op,
            offset_bytes: ctx.offset + u64::from(ctx.done),
            len_bytes: ctx.piece,
            buf,
        }
    }

    fn lend(&mut self, id: BufId, len: u32) -> IoBuf {
        let b = &mut self.pool.buf_mut(id)[..len as usize];
        let ptr = NonNull::new(b.as_mut_ptr()).expect("pool buffers are allocated");
        // SAFETY: the buffer belongs to this context alone from acceptance to reply; while
        // the request is in the array nothing here reads or writes it (the context is
        // released — and the buffer reused — only after `complete` delivered the
        // request's completion, also when the client has vanished), and the pool's memory
        // outlives every request (the reactor returns its front-end only when nothing is
        // in flight). `len` ≤ the buffer's length; the pool's buffers are 4096-aligned.
        unsafe { IoBuf::from_raw(ptr, len, None) }
    }

    /// Moves a split read or write on to its next piece (the current one is done).
    fn next_piece(&mut self, c: u16) {
        let bytes = self.pool.buf(self.ctxs[usize::from(c)].buf).len() as u32;
        let ctx = &mut self.ctxs[usize::from(c)];
        ctx.done += ctx.piece;
        ctx.piece = (ctx.len - ctx.done).min(bytes);
        debug_assert!(ctx.piece > 0, "no piece left");
    }

    /// Submits context `c`, or queues it behind earlier ones when the reactor is full.
    fn submit<C: Channel>(&mut self, c: u16, io: &mut Io<'_, C>, conns: &mut [Option<Conn>]) {
        if !self.pending.is_empty() {
            self.pending.push_back(c);
            return;
        }
        let r = self.request(c);
        match io.submit(r) {
            Ok(()) => self.ctxs[usize::from(c)].in_array = true,
            Err(ArrayError::QueueFull) => self.pending.push_back(c),
            Err(e) => self.finish(c, Err(e), conns),
        }
    }

    /// Retries queued submissions in order; stops at the first refusal.
    fn retry<C: Channel>(&mut self, io: &mut Io<'_, C>, conns: &mut [Option<Conn>]) -> bool {
        let mut progress = false;
        while let Some(&c) = self.pending.front() {
            let ci = usize::from(self.ctxs[usize::from(c)].conn);
            let conn = conns[ci].as_mut().expect("a context's connection stays");
            if matches!(conn.life, Life::Closed | Life::Lingering) {
                // Nobody to answer, never reached the array: release now.
                self.pending.pop_front();
                self.release(c, conn);
                progress = true;
                continue;
            }
            let r = self.request(c);
            match io.submit(r) {
                Ok(()) => {
                    self.ctxs[usize::from(c)].in_array = true;
                    self.pending.pop_front();
                    progress = true;
                }
                Err(ArrayError::QueueFull) => break,
                Err(e) => {
                    self.pending.pop_front();
                    self.finish(c, Err(e), conns);
                    progress = true;
                }
            }
        }
        progress
    }

    /// The array finished context `c` (or refused it outright): queue the reply.
    fn finish(&mut self, c: u16, status: Result<(), ArrayError>, conns: &mut [Option<Conn>]) {
        let ctx = self.ctxs[usize::from(c)];
        let conn = conns[usize::from(ctx.conn)]
            .as_mut()
            .expect("a context's connection stays");
        if matches!(conn.life, Life::Closed | Life::Lingering) {
            self.release(c, conn);
            return;
        }
        let reply = match status {
            Ok(()) => match ctx.op {
                Op::Trim { fua: true } => {
                    // Persist the discard before replying.
                    self.ctxs[usize::from(c)].op = Op::Flush;
                    self.pending.push_back(c);
                    return;
                }
                Op::Read => {
                    conn.bytes_read += u64::from(ctx.piece);
                    // The context (and its buffer) is released once the data is sent, or
                    // reads the next piece then (see `send_replies`).
                    let r = Reply::read_data(
                        conn.structured,
                        ctx.handle,
                        ctx.offset + u64::from(ctx.done),
                        c,
                        ctx.piece,
                        ctx.done == 0,
                        ctx.done + ctx.piece == ctx.len,
                    );
                    if conn.stream_ctx == c {
                        // The next piece of the reply on the wire: nothing else
                        // went out since the last piece (tx_sent is 0), it goes first.
                        debug_assert_eq!(conn.tx_sent, 0);
                        conn.replies.push_front(r);
                    } else {
                        conn.replies.push_back(r);
                    }
                    return;
                }
                Op::Write { .. } if ctx.done + ctx.piece < ctx.len => {
                    // A piece of a split write: receive the next one into the buffer.
                    debug_assert_eq!(conn.rx, Rx::Piece { ctx: c });
                    self.next_piece(c);
                    conn.rx = Rx::Payload { ctx: c, got: 0 };
                    return;
                }
                Op::Write { .. } => {
                    if conn.rx == (Rx::Piece { ctx: c }) {
                        // The last piece of a split write.
                        conn.rx = Rx::Header;
                    }
                    Reply::ok(ctx.handle)
                }
                _ => Reply::ok(ctx.handle),
            },
            Err(e) if ctx.op == Op::Read && ctx.done > 0 && !conn.structured => {
                // Part of this read's simple reply is on the wire and cannot carry an
                // error: a hard disconnect is the only way (proto.md "Structured reply
                // chunk message": "a hard disconnect must be initiated").
                warn!(
                    conn = conn.id,
                    handle = ctx.handle,
                    offset = ctx.offset + u64::from(ctx.done),
                    "array request failed inside a split read's simple reply: {e}"
                );
                close(conn, self);
                self.release(c, conn);
                return;
            }
            Err(e) if matches!(ctx.op, Op::Write { .. }) && conn.rx == (Rx::Piece { ctx: c }) => {
                // A piece of a split write failed: consume the rest of its payload, then
                // reply with the error.
                let (error, message) = nbd_error(e);
                warn!(
                    conn = conn.id,
                    handle = ctx.handle,
                    offset = ctx.offset + u64::from(ctx.done),
                    len = ctx.piece,
                    "array request failed: {e}"
                );
                let left = ctx.len - ctx.done - ctx.piece;
                self.release(c, conn);
                if left > 0 {
                    conn.rx = Rx::Discard {
                        left,
                        handle: ctx.handle,
                        error,
                        message,
                    };
                } else {
                    conn.rx = Rx::Header;
                    let at = (error == proto::EIO).then_some(ctx.offset + u64::from(ctx.done));
                    conn.replies.push_back(Reply::error(
                        conn.structured,
                        ctx.handle,
                        error,
                        message,
                        at,
                    ));
                }
                return;
            }
            Err(e) => {
                let (error, message) = nbd_error(e);
                // An I/O error on a ranged command names its offset (the whole request is
                // suspect: the array does not say which part failed).
                let at = (error == proto::EIO && ctx.op != Op::Flush)
                    .then_some(ctx.offset + u64::from(ctx.done));
                if error == proto::EIO {
                    warn!(conn = conn.id, handle = ctx.handle, op = ?ctx.op, offset = ctx.offset,
                        len = ctx.len, "array request failed: {e}");
                }
                Reply::error(conn.structured, ctx.handle, error, message, at)
            }
        };
        self.release(c, conn);
        conn.replies.push_back(reply);
    }
}

/// Maps an array error to an NBD error value and message (proto.md "Error values").
fn nbd_error(e: ArrayError) -> (u32, &'static str) {
    match e {
        // Ranges and alignment were checked before submission, so this is the engine
        // refusing the operation itself (e.g. one it does not implement yet).
        ArrayError::Invalid(why) => (proto::EINVAL, why),
        ArrayError::Unrecoverable { .. } => (
            proto::EIO,
            "data unrecoverable: the stripe lost more members than its redundancy",
        ),
        ArrayError::Failed => (proto::EIO, "the array has failed"),
        // Never delivered as a completion (submission retries it); not a client error.
        ArrayError::QueueFull => (proto::EIO, "array queue full"),
        // NBD sends no compare-and-write.
        ArrayError::Miscompare { .. } => (proto::EIO, "compare-and-write miscompare"),
    }
}

/// The NBD front-end of one reactor (see the module docs). Built by
/// [`super::NbdServerBuilder::start`], one per reactor, and handed to
/// `engine::reactor::Reactors::start`.
pub struct NbdFrontend {
    reactor: usize,
    shared: Arc<Shared>,
    inbox: Arc<ArrayQueue<Conn>>,
    conns: Vec<Option<Conn>>,
    active: usize,
    core: Core,
    drain_deadline: Option<Instant>,
    finished: bool,
    /// The connection slot served first in the next turn (the one after the connection
    /// that spent the last turn's payload budget).
    first: usize,
    /// One past the highest slot in use: a turn scans `conns[..hi]` only, so a large,
    /// mostly empty table costs nothing (slots are filled lowest first).
    hi: usize,
}

impl NbdFrontend {
    pub(crate) fn new(reactor: usize, shared: Arc<Shared>, inbox: Arc<ArrayQueue<Conn>>) -> Self {
        let cfg = &shared.config;
        let pool = BufPool::new(&cfg.buffers);
        let nctx = pool.len() + DATALESS_CONTEXTS;
        debug_assert!(nctx < usize::from(u16::MAX));
        Self {
            reactor,
            inbox,
            conns: (0..cfg.max_connections_per_reactor).map(|_| None).collect(),
            active: 0,
            core: Core {
                ctxs: vec![
                    Ctx {
                        live: false,
                        in_array: false,
                        conn: 0,
                        handle: 0,
                        op: Op::Flush,
                        offset: 0,
                        len: 0,
                        done: 0,
                        piece: 0,
                        buf: NO_BUF,
                    };
                    nctx
                ],
                free_ctx: (0..nctx as u16).rev().collect(),
                pool,
                pending: VecDeque::with_capacity(nctx),
                scratch: vec![0u8; SCRATCH_BYTES].into_boxed_slice(),
                payload_budget: PAYLOAD_BYTES_PER_TURN,
            },
            shared,
            drain_deadline: None,
            finished: false,
            first: 0,
            hi: 0,
        }
    }

    /// Connections this front-end holds (open, draining, or closed with requests still in
    /// the array).
    pub fn connections(&self) -> usize {
        self.active
    }

    /// Data buffers currently free (all of them once every request has finished; tests use
    /// this to check that nothing leaked).
    pub fn free_buffers(&self) -> usize {
        self.core.pool.free_count()
    }

    /// Data buffers in this front-end's pool.
    pub fn buffers(&self) -> usize {
        self.core.pool.len()
    }

    fn adopt(&mut self, mut conn: Conn) {
        if self.finished {
            info!(conn = conn.id, "closing: the server has shut down");
            return;
        }
        // The connection holds a slot of this table (reserved at its handshake), so there
        // is a free one; the check only guards against miscounting.
        let Some(slot) = self.conns.iter().position(Option::is_none) else {
            warn!(conn = conn.id, peer = %conn.peer, reactor = self.reactor,
                "closing: reactor connection table full");
            return;
        };
        self.hi = self.hi.max(slot + 1);
        info!(conn = conn.id, peer = %conn.peer, reactor = self.reactor,
            structured = conn.structured, "transmission phase");
        if self.drain_deadline.is_some() {
            conn.life = Life::Draining;
        }
        self.conns[slot] = Some(conn);
        self.active += 1;
    }
}

/// Closes a connection's socket at once (hard disconnect); requests in the array keep their
/// contexts until they complete.
fn kill(conn: &mut Conn, core: &mut Core, why: &dyn std::fmt::Display) {
    if conn.life == Life::Closed {
        return;
    }
    warn!(conn = conn.id, peer = %conn.peer, "closing connection: {why}");
    close(conn, core);
}

fn close(conn: &mut Conn, core: &mut Core) {
    let lingered = conn.life == Life::Lingering;
    conn.close_socket();
    conn.life = Life::Closed;
    conn.linger_until = None;
    if !lingered {
        release_all(conn, core);
    }
    info!(
        conn = conn.id,
        requests = conn.requests,
        bytes_read = conn.bytes_read,
        bytes_written = conn.bytes_written,
        "connection closed"
    );
}

/// Ends a connection with every accepted request answered: our side is shut down so the
/// client reads all replies and then the end of stream, and the socket lingers
/// ([`Life::Lingering`]) until the client closes its side or [`LINGER`] passes.
/// Closing at once with the client's unread bytes (requests sent after the drain began,
/// a write payload) would reset the connection and could lose replies already sent.
fn end_gracefully(conn: &mut Conn, core: &mut Core, now: Instant) {
    debug_assert_eq!(conn.outstanding, 0, "ended with requests unanswered");
    if !conn.shutdown_send() {
        close(conn, core);
        return;
    }
    release_all(conn, core);
    conn.life = Life::Lingering;
    conn.linger_until = Some(now + LINGER);
}

/// A lingering connection's turn: discards what its client sends and closes the socket
/// once the client closed its side or the linger time passed (a drain grace period that
/// expires cuts it sooner). Returns whether the connection closed.
fn linger(conn: &mut Conn, core: &mut Core) -> bool {
    debug_assert_eq!(conn.life, Life::Lingering);
    let done = conn.discard_input() || conn.linger_until.is_none_or(|t| Instant::now() >= t);
    if done {
        close(conn, core);
    }
    done
}

/// Gives back what a connection that stops serving holds (a partial write payload's
/// context, queued replies' data).
fn release_all(conn: &mut Conn, core: &mut Core) {
    // A context receiving a payload is not in the array (one in `Rx::Piece` is: its
    // completion releases it).
    if let Rx::Payload { ctx, .. } = conn.rx {
        core.release(ctx, conn);
    }
    conn.rx = Rx::Header;
    conn.stream_ctx = NO_CTX;
    while let Some(r) = conn.replies.pop_front() {
        if r.data_ctx != NO_CTX && r.data_ctx != STATUS_CTX {
            core.release(r.data_ctx, conn);
        }
    }
    conn.status_busy = false;
    conn.outstanding = 0;
    conn.tx_sent = 0;
}

/// Sends as many queued replies as the socket takes. Returns whether anything was sent.
fn send_replies(conn: &mut Conn, core: &mut Core) -> io::Result<bool> {
    let mut progress = false;
    if conn.tls.is_some() {
        // What the TLS session still holds goes first (it may hold bytes although no
        // reply is queued: the tail of the last one, a key update).
        match conn.flush_tls() {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) => return Err(e),
        }
    }
    while let Some(front) = conn.replies.front() {
        if conn.stream_ctx != NO_CTX && front.data_ctx != conn.stream_ctx {
            // A split read's simple reply is on the wire: its next piece goes first.
            return Ok(progress);
        }
        let Some(stream) = conn.stream.as_ref() else {
            return Ok(progress);
        };
        let sent = {
            let mut iov: ArrayVec<IoSlice<'_>, IOV_PER_SEND> = ArrayVec::new();
            let mut skip = conn.tx_sent;
            for r in &conn.replies {
                let data = if r.data_ctx == NO_CTX {
                    &[][..]
                } else if r.data_ctx == STATUS_CTX {
                    &conn.status[..]
                } else {
                    core.pool.buf(core.ctxs[usize::from(r.data_ctx)].buf)
                };
                let complete = r.pieces(data, skip, &mut |p| {
                    if iov.is_full() {
                        return false;
                    }
                    iov.push(IoSlice::new(p));
                    true
                });
                skip = 0;
                if !complete || r.more {
                    // A split read's piece: nothing may follow it but its next piece,
                    // which is not read yet.
                    break;
                }
            }
            match Conn::send(stream, conn.tls.as_deref_mut(), &iov) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(progress),
                Err(e) => return Err(e),
            }
        };
        if sent == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "peer took no bytes",
            ));
        }
        progress = true;
        // Retire the replies the send completed.
        let mut left = conn.tx_sent + sent;
        while let Some(r) = conn.replies.front() {
            let total = r.total();
            if left < total {
                break;
            }
            left -= total;
            let r = conn.replies.pop_front().expect("front exists");
            if r.more {
                // A split read's piece: the context reads its next piece (submitted at the
                // start of the next turn), and nothing else goes out until that piece is
                // sent.
                core.next_piece(r.data_ctx);
                core.pending.push_back(r.data_ctx);
                conn.stream_ctx = r.data_ctx;
                continue;
            }
            if r.data_ctx == STATUS_CTX {
                conn.status_busy = false;
            } else if r.data_ctx != NO_CTX {
                if conn.stream_ctx == r.data_ctx {
                    conn.stream_ctx = NO_CTX;
                }
                core.release(r.data_ctx, conn);
            }
            conn.outstanding -= 1;
        }
        conn.tx_sent = left;
    }
    Ok(progress)
}

/// Fills `conn.status` with the block descriptors of `req` (a checked
/// `NBD_CMD_BLOCK_STATUS`: in range, nonzero length) from the array's zero map
/// (`Io::block_status`: answered at once, no array request, no allocation) and returns
/// how many: zero-reading runs get `NBD_STATE_HOLE | NBD_STATE_ZERO`, the others 0; at
/// most [`proto::MAX_BLOCK_DESCRIPTORS`] (one with `req_one`), so the reply may describe
/// less than the range (proto.md allows it: the client asks again from where it ends).
/// Each run is clipped to the request, so its length fits the request's 32 bits, and the
/// lengths sum to at most the request's length.
fn block_status<C: Channel>(
    conn: &mut Conn,
    io: &Io<'_, C>,
    req: &proto::Request,
    req_one: bool,
) -> u32 {
    let cap = if req_one {
        1
    } else {
        proto::MAX_BLOCK_DESCRIPTORS
    };
    let cap = cap.min(conn.status.len() / proto::BLOCK_DESCRIPTOR_BYTES);
    let buf = &mut conn.status;
    let mut n = 0usize;
    io.block_status(req.offset, u64::from(req.length), |len, zero| {
        if n >= cap {
            return false;
        }
        let len = u32::try_from(len).unwrap_or(req.length).min(req.length);
        let flags = if zero {
            proto::STATE_HOLE | proto::STATE_ZERO
        } else {
            0
        };
        let at = n * proto::BLOCK_DESCRIPTOR_BYTES;
        buf[at..at + proto::BLOCK_DESCRIPTOR_BYTES]
            .copy_from_slice(&proto::block_descriptor(len, flags));
        n += 1;
        n < cap
    });
    if n == 0 {
        // Nothing from the map (cannot happen for a range inside the export): the whole
        // range as data is always a correct answer.
        buf[..proto::BLOCK_DESCRIPTOR_BYTES]
            .copy_from_slice(&proto::block_descriptor(req.length, 0));
        n = 1;
    }
    n as u32
}

/// Outcome of reading requests on one connection this turn.
enum ReadEnd {
    /// Nothing more to read now (would block, budget or limits reached).
    Paused,
    /// The client closed its side at a message boundary: drain.
    Eof,
    /// The turn's payload budget is spent ([`PAYLOAD_BYTES_PER_TURN`]); more may wait.
    Budget,
    /// Protocol violation or socket error: hard disconnect.
    Kill(String),
}

fn read_requests<C: Channel>(
    ci: usize,
    conns: &mut [Option<Conn>],
    core: &mut Core,
    io: &mut Io<'_, C>,
    discard_cap: u32,
) -> (bool, ReadEnd) {
    let mut progress = false;
    let mut budget = REQUESTS_PER_TURN;
    loop {
        let conn = conns[ci].as_mut().expect("serviced connection exists");
        match conn.rx {
            Rx::Header => {
                if conn.life != Life::Open {
                    return (progress, ReadEnd::Paused);
                }
                if budget == 0 || conn.outstanding >= conn.max_inflight {
                    return (progress, ReadEnd::Paused);
                }
                if conn.buffered().len() < proto::REQUEST_BYTES {
                    match conn.fill() {
                        Ok(0) if conn.buffered().is_empty() => return (progress, ReadEnd::Eof),
                        Ok(0) => {
                            return (
                                progress,
                                ReadEnd::Kill("end of stream inside a request header".into()),
                            )
                        }
                        Ok(_) => {
                            progress = true;
                            continue;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            return (progress, ReadEnd::Paused)
                        }
                        Err(e) => return (progress, ReadEnd::Kill(format!("receive: {e}"))),
                    }
                }
                let req = match proto::parse_request(conn.buffered()) {
                    Ok(r) => r,
                    Err(e) => return (progress, ReadEnd::Kill(format!("bad request: {e}"))),
                };
                let verdict = proto::check_request(&req, &conn.limits);
                if matches!(verdict, Verdict::BlockStatus { .. }) && conn.status_busy {
                    // The descriptor buffer holds a reply not yet sent: read on once it is.
                    return (progress, ReadEnd::Paused);
                }
                let op = match verdict {
                    Verdict::Read => Some(Op::Read),
                    Verdict::Write { fua } => Some(Op::Write { fua }),
                    Verdict::Flush => Some(Op::Flush),
                    Verdict::Trim { fua } => Some(Op::Trim { fua }),
                    Verdict::WriteZeroes { fua } => Some(Op::WriteZeroes { fua }),
                    _ => None,
                };
                if let Some(op) = op {
                    // Before any wait for a buffer or context: the reactor's turns stay
                    // bounded for what is about to queue here (`Io::note_arrival`).
                    let writes = matches!(
                        op,
                        Op::Write { .. } | Op::Trim { .. } | Op::WriteZeroes { .. }
                    );
                    if op != Op::Flush {
                        io.note_arrival(writes, u64::from(req.length));
                    }
                }
                let ctx = match op {
                    Some(op) => {
                        let Some(c) =
                            core.take_ctx(conn, ci as u16, req.handle, op, req.offset, req.length)
                        else {
                            // No buffer or context free: leave the header where it is and
                            // read on once a request completes.
                            return (progress, ReadEnd::Paused);
                        };
                        Some(c)
                    }
                    None => None,
                };
                conn.consume(proto::REQUEST_BYTES);
                progress = true;
                budget -= 1;
                if verdict == Verdict::Disconnect {
                    debug!(conn = conn.id, "client sent NBD_CMD_DISC");
                    conn.life = Life::Draining;
                    continue;
                }
                conn.outstanding += 1;
                conn.requests += 1;
                match (verdict, ctx) {
                    (Verdict::Write { .. }, Some(c)) => conn.rx = Rx::Payload { ctx: c, got: 0 },
                    (_, Some(c)) => core.submit(c, io, conns),
                    (Verdict::BlockStatus { req_one }, None) => {
                        let n = block_status(conn, io, &req, req_one);
                        conn.status_busy = true;
                        conn.replies.push_back(Reply::block_status(req.handle, n));
                    }
                    (Verdict::Noop, None) => {
                        let r = if req.command == proto::CMD_READ {
                            Reply::empty_read(conn.structured, req.handle)
                        } else {
                            Reply::ok(req.handle)
                        };
                        conn.replies.push_back(r);
                    }
                    (Verdict::Reject { error, message }, None) => {
                        let payload = req.payload_bytes();
                        if payload > discard_cap {
                            return (
                                progress,
                                ReadEnd::Kill(format!(
                                    "write payload of {payload} bytes beyond the {discard_cap}-byte limit"
                                )),
                            );
                        }
                        debug!(
                            conn = conn.id,
                            handle = req.handle,
                            command = req.command,
                            offset = req.offset,
                            length = req.length,
                            error,
                            "rejected: {message}"
                        );
                        if payload > 0 {
                            conn.rx = Rx::Discard {
                                left: payload,
                                handle: req.handle,
                                error,
                                message,
                            };
                        } else {
                            conn.replies.push_back(Reply::error(
                                conn.structured,
                                req.handle,
                                error,
                                message,
                                None,
                            ));
                        }
                    }
                    _ => unreachable!("verdicts with an op have a context, the others none"),
                }
            }
            Rx::Piece { .. } => return (progress, ReadEnd::Paused),
            Rx::Payload { ctx, got } => {
                let c = core.ctxs[usize::from(ctx)];
                // The current piece (the whole payload unless it is longer than the buffer).
                let len = c.piece;
                let mut got = got;
                // Bytes already buffered first.
                let take = conn.buffered().len().min((len - got) as usize);
                if take > 0 {
                    let dst = &mut core.pool.buf_mut(c.buf)[got as usize..got as usize + take];
                    dst.copy_from_slice(&conn.buffered()[..take]);
                    conn.consume(take);
                    got += take as u32;
                    progress = true;
                }
                while got < len {
                    if core.payload_budget == 0 {
                        // This turn's receive budget is spent: the rest comes next turn,
                        // after the other connections had their turn.
                        conn.rx = Rx::Payload { ctx, got };
                        return (progress, ReadEnd::Budget);
                    }
                    let left = ((len - got) as usize).min(core.payload_budget);
                    let r = if left <= RBUF_BYTES / 2 {
                        // Small remainder: batch it with whatever follows.
                        match conn.fill() {
                            Ok(n) if n > 0 => {
                                let take = conn.buffered().len().min(left);
                                let dst = &mut core.pool.buf_mut(c.buf)
                                    [got as usize..got as usize + take];
                                dst.copy_from_slice(&conn.buffered()[..take]);
                                conn.consume(take);
                                Ok(take)
                            }
                            r => r,
                        }
                    } else {
                        let end = got as usize + left;
                        conn.recv(&mut core.pool.buf_mut(c.buf)[got as usize..end])
                    };
                    match r {
                        Ok(0) => {
                            return (
                                progress,
                                ReadEnd::Kill("end of stream inside a write payload".into()),
                            )
                        }
                        Ok(n) => {
                            got += n as u32;
                            core.payload_budget = core.payload_budget.saturating_sub(n);
                            progress = true;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            conn.rx = Rx::Payload { ctx, got };
                            return (progress, ReadEnd::Paused);
                        }
                        Err(e) => return (progress, ReadEnd::Kill(format!("receive: {e}"))),
                    }
                }
                conn.bytes_written += u64::from(len);
                conn.rx = if c.done + len < c.len {
                    // More pieces follow: receive them once this one is written.
                    Rx::Piece { ctx }
                } else {
                    Rx::Header
                };
                core.submit(ctx, io, conns);
            }
            Rx::Discard {
                left,
                handle,
                error,
                message,
            } => {
                let mut left = left;
                let take = conn.buffered().len().min(left as usize);
                conn.consume(take);
                left -= take as u32;
                while left > 0 {
                    let n = (left as usize).min(core.scratch.len());
                    match conn.recv(&mut core.scratch[..n]) {
                        Ok(0) => {
                            return (
                                progress,
                                ReadEnd::Kill("end of stream inside a write payload".into()),
                            )
                        }
                        Ok(n) => {
                            left -= n as u32;
                            progress = true;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            conn.rx = Rx::Discard {
                                left,
                                handle,
                                error,
                                message,
                            };
                            return (progress, ReadEnd::Paused);
                        }
                        Err(e) => return (progress, ReadEnd::Kill(format!("receive: {e}"))),
                    }
                }
                conn.rx = Rx::Header;
                conn.replies
                    .push_back(Reply::error(conn.structured, handle, error, message, None));
                progress = true;
            }
        }
    }
}

impl Frontend for NbdFrontend {
    fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
        let mut progress = false;
        while let Some(conn) = pop_if_any(&self.inbox) {
            self.adopt(conn);
            progress = true;
        }
        let mut expired = false;
        if self.shared.shutdown.load(Ordering::Acquire) {
            let now = Instant::now();
            match self.drain_deadline {
                None => {
                    self.drain_deadline = Some(now + self.shared.config.drain_grace);
                    for conn in self.conns.iter_mut().flatten() {
                        if conn.life == Life::Open {
                            conn.life = Life::Draining;
                        }
                    }
                    progress = true;
                }
                Some(d) => expired = now >= d,
            }
        }
        if self.active == 0 && self.core.pending.is_empty() {
            self.latch_finished();
            return progress;
        }
        progress |= self.core.retry(io, &mut self.conns);
        let discard_cap = self.shared.discard_cap;
        let stall_timeout = self.shared.config.stall_timeout;
        // One clock read per turn, only when an idle timeout is configured.
        let idle = self.shared.config.idle_timeout.map(|t| (t, Instant::now()));
        self.core.payload_budget = PAYLOAD_BYTES_PER_TURN;
        let slots = self.hi;
        if self.first >= slots {
            self.first = 0;
        }
        let first = self.first;
        let mut spent = false;
        for k in 0..slots {
            let ci = (first + k) % slots;
            let Some(conn) = self.conns[ci].as_mut() else {
                continue;
            };
            if expired && conn.life != Life::Closed {
                kill(conn, &mut self.core, &"shutdown grace period expired");
            }
            if conn.life == Life::Lingering {
                progress |= linger(conn, &mut self.core);
                progress |= self.drop_if_done(ci);
                continue;
            }
            // Whether this connection's client moved any bytes this turn.
            let mut moved = false;
            if conn.life != Life::Closed {
                match send_replies(conn, &mut self.core) {
                    Ok(p) => moved |= p,
                    Err(e) => {
                        kill(conn, &mut self.core, &format_args!("send: {e}"));
                        progress = true;
                    }
                }
            }
            let conn = self.conns[ci].as_mut().expect("still there");
            if conn.life != Life::Closed {
                let budget_before = self.core.payload_budget;
                let (p, end) = read_requests(ci, &mut self.conns, &mut self.core, io, discard_cap);
                moved |= p;
                if budget_before > 0 && self.core.payload_budget == 0 && !spent {
                    // This connection spent the turn's budget: it goes last next turn.
                    spent = true;
                    self.first = (ci + 1) % slots;
                }
                let conn = self.conns[ci].as_mut().expect("still there");
                match end {
                    ReadEnd::Paused => {}
                    ReadEnd::Budget => {
                        // Paused by us, not by its client: not a stall. More is waiting:
                        // the next turn comes without a rest.
                        moved = true;
                        progress = true;
                    }
                    ReadEnd::Eof => {
                        if conn.life == Life::Open {
                            debug!(conn = conn.id, "client closed its side");
                            conn.life = Life::Draining;
                        }
                    }
                    ReadEnd::Kill(why) => {
                        kill(conn, &mut self.core, &why);
                        progress = true;
                    }
                }
                // Replies produced while reading (rejections) go out in the same turn.
                if conn.life != Life::Closed && !conn.replies.is_empty() {
                    match send_replies(conn, &mut self.core) {
                        Ok(p) => moved |= p,
                        Err(e) => kill(conn, &mut self.core, &format_args!("send: {e}")),
                    }
                }
            }
            progress |= moved;
            let conn = self.conns[ci].as_mut().expect("still there");
            // A client that holds buffers (unsent replies, a partial write payload) but
            // moves no bytes for the stall timeout is cut, so it cannot starve the
            // reactor's other connections of buffers. Only stalled connections read the
            // clock.
            if conn.life != Life::Closed {
                // A split write waiting for the array to take its piece is not the client's
                // stall.
                let holding = !conn.replies.is_empty()
                    || !matches!(conn.rx, Rx::Header | Rx::Piece { .. })
                    || conn.tls_pending();
                if moved || !holding {
                    conn.stalled_since = None;
                } else {
                    let now = Instant::now();
                    match conn.stalled_since {
                        None => conn.stalled_since = Some(now),
                        Some(t) if now.duration_since(t) >= stall_timeout => {
                            kill(
                                conn,
                                &mut self.core,
                                &format_args!("client made no progress for {stall_timeout:?}"),
                            );
                            progress = true;
                        }
                        Some(_) => {}
                    }
                }
            }
            // A connection with nothing in flight whose client sends nothing is idle; with
            // an idle timeout configured, it is closed once idle that long.
            if let Some((idle_timeout, now)) = idle {
                let busy = conn.outstanding > 0 || conn.rx != Rx::Header;
                if moved || busy || conn.life != Life::Open {
                    conn.idle_since = None;
                } else {
                    match conn.idle_since {
                        None => conn.idle_since = Some(now),
                        Some(t) if now.duration_since(t) >= idle_timeout => {
                            self.shared
                                .stats
                                .idle_closed
                                .fetch_add(1, Ordering::Relaxed);
                            info!(conn = conn.id, peer = %conn.peer,
                                "closing: idle for {idle_timeout:?} (idle timeout)");
                            end_gracefully(conn, &mut self.core, now);
                            progress = true;
                        }
                        Some(_) => {}
                    }
                }
            }
            if conn.life == Life::Draining
                && conn.outstanding == 0
                && matches!(conn.rx, Rx::Header)
                && !conn.tls_pending()
            {
                end_gracefully(conn, &mut self.core, Instant::now());
                progress = true;
            }
            progress |= self.drop_if_done(ci);
        }
        while self.hi > 0 && self.conns[self.hi - 1].is_none() {
            self.hi -= 1;
        }
        if self.active == 0 && self.core.pending.is_empty() {
            self.latch_finished();
        }
        progress
    }

    fn complete(&mut self, c: ArrayCompletion) {
        let Ok(idx) = u16::try_from(c.tag) else {
            warn!(
                tag = c.tag,
                "completion with a tag this front-end never issued"
            );
            return;
        };
        let Some(ctx) = self.core.ctxs.get_mut(usize::from(idx)) else {
            warn!(
                tag = c.tag,
                "completion with a tag this front-end never issued"
            );
            return;
        };
        if !(ctx.live && ctx.in_array) {
            warn!(
                tag = c.tag,
                "completion for a context that is not in the array"
            );
            return;
        }
        ctx.in_array = false;
        self.core.finish(idx, c.status, &mut self.conns);
    }

    fn finished(&self) -> bool {
        self.finished
    }
}

impl NbdFrontend {
    /// Drops the connection in slot `ci` once its socket is closed and no request context
    /// refers to it, which gives its slot back to the handshake thread. Returns whether it
    /// was dropped.
    fn drop_if_done(&mut self, ci: usize) -> bool {
        let done = self.conns[ci]
            .as_ref()
            .is_some_and(|c| c.life == Life::Closed && c.ctx_held == 0);
        if done {
            self.conns[ci] = None;
            self.active -= 1;
        }
        done
    }

    /// Once shut down with nothing left, the front-end is finished for good: connections
    /// that still arrive are closed on adoption.
    fn latch_finished(&mut self) {
        if !self.finished && self.shared.shutdown.load(Ordering::Acquire) {
            debug_assert_eq!(self.core.free_ctx.len(), self.core.ctxs.len());
            debug_assert_eq!(self.core.pool.free_count(), self.core.pool.len());
            info!(reactor = self.reactor, "NBD front-end drained");
            self.finished = true;
        }
    }
}
