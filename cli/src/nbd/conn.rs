//! One NBD connection in the transmission phase: its socket, receive buffer, the request
//! being received, and the replies waiting to be sent.
//!
//! A connection is built by the handshake thread (all of its memory is allocated there,
//! and it carries the connection slot reserved there)
//! and then owned by one reactor's [`super::NbdFrontend`], which drives it with
//! non-blocking reads and writes; see the front-end for the state machine.
//!
//! A connection that negotiated TLS carries its rustls session: [`Conn::recv`] and
//! [`Conn::send`] go through it (one copy each way, `super::tls`), the others keep the
//! plain socket calls.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

use rustls::ServerConnection;

use super::proto::{self, ExportLimits};
use super::tls;

/// Bytes of each connection's receive buffer: request headers and small write payloads
/// are read through it in batches (one `recv` can bring several requests); payloads
/// larger than half of it are received straight into their data buffer.
pub(crate) const RBUF_BYTES: usize = 32 << 10;

/// A connected socket, TCP or Unix.
#[derive(Debug)]
pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Shuts down the sending side (`shutdown(SHUT_WR)`): the peer reads every byte
    /// already sent, then the end of stream, while this side can still read what it
    /// sends. How the NBD and iSCSI front-ends end a connection gracefully.
    ///
    /// # Errors
    /// The `shutdown` call's (`ENOTCONN` once the peer reset the connection).
    pub(crate) fn shutdown_write(&self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Write),
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Write),
        }
    }

    pub(crate) fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nonblocking(on),
            Stream::Unix(s) => s.set_nonblocking(on),
        }
    }

    /// Disables Nagle's algorithm on TCP (proto.md "Protocol phases": "both the client and
    /// server SHOULD disable Nagle's algorithm"); nothing to do on Unix sockets.
    pub(crate) fn set_nodelay(&self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nodelay(true),
            Stream::Unix(_) => Ok(()),
        }
    }

    /// Sends all of `buf`, blocking (up to the socket's send timeout), with `MSG_NOSIGNAL`:
    /// for the handshake, which may run in a program that does not ignore `SIGPIPE`.
    pub(crate) fn send_all_blocking(&self, mut buf: &[u8]) -> io::Result<()> {
        while !buf.is_empty() {
            let n = send_vectored(self.as_raw_fd(), &[IoSlice::new(buf)], 0)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "peer took no bytes",
                ));
            }
            buf = &buf[n..];
        }
        Ok(())
    }

    /// Sends `bufs` in one `sendmsg` with `MSG_NOSIGNAL` (a vanished peer yields `EPIPE`,
    /// never `SIGPIPE`, whatever the embedding program does with signals) and
    /// `MSG_DONTWAIT`. Returns the bytes sent.
    pub(crate) fn send_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        send_vectored(self.as_raw_fd(), bufs, libc::MSG_DONTWAIT)
    }
}

/// Sends `bufs` on socket `fd` in one `sendmsg(2)` with `MSG_NOSIGNAL` added to `flags`
/// (a vanished peer yields `EPIPE`, never `SIGPIPE`), retried on `EINTR`. Returns the bytes
/// sent; `flags` may add `MSG_DONTWAIT`.
///
/// # Errors
/// The `sendmsg` error (`WouldBlock` when non-blocking and the send buffer is full).
pub(crate) fn send_vectored(
    fd: RawFd,
    bufs: &[IoSlice<'_>],
    flags: libc::c_int,
) -> io::Result<usize> {
    // SAFETY: msghdr is plain old data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is guaranteed ABI-compatible with `struct iovec` on Unix; sendmsg only reads
    // the array and the memory it describes, which `bufs` borrows for this call.
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len() as _;
    loop {
        // SAFETY: fd is an open socket owned by the caller's stream; msg describes
        // `bufs.len()` valid iovecs borrowed for the duration of the call.
        let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | flags) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// "No context": a reply without data.
pub(crate) const NO_CTX: u16 = u16::MAX;
/// A reply whose data is the connection's block status descriptors ([`Conn::status`]),
/// not a request context's buffer (context numbers stay below `u16::MAX - 1`: the
/// server's configuration check keeps buffers + dataless contexts under `u16::MAX`).
pub(crate) const STATUS_CTX: u16 = u16::MAX - 1;

/// A reply ready to send: a head (simple reply, structured chunk header), an optional
/// static message and tail (structured error chunks), and optional data taken from a
/// request context's buffer (read replies). Plain data: queued without allocation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reply {
    head: [u8; 28],
    head_len: u8,
    message: &'static str,
    tail: [u8; 8],
    tail_len: u8,
    /// Context whose buffer holds the data (released once the reply is sent, unless
    /// `more`).
    pub(crate) data_ctx: u16,
    pub(crate) data_len: u32,
    /// A piece of a read split over several array requests that is not the last: once
    /// sent, the context reads its next piece instead of being released.
    pub(crate) more: bool,
}

impl Reply {
    fn with_head(h: &[u8]) -> Self {
        let mut head = [0u8; 28];
        head[..h.len()].copy_from_slice(h);
        Self {
            head,
            head_len: h.len() as u8,
            message: "",
            tail: [0; 8],
            tail_len: 0,
            data_ctx: NO_CTX,
            data_len: 0,
            more: false,
        }
    }

    /// Success without data: a simple reply (allowed for every command but a read, even
    /// with structured replies: proto.md "Simple reply message").
    pub(crate) fn ok(handle: u64) -> Self {
        Self::with_head(&proto::simple_reply(0, handle))
    }

    /// A successful zero-length read: a simple reply, or a final `NBD_REPLY_TYPE_NONE`
    /// chunk (a read "MUST NOT" get a simple reply once structured replies are on).
    pub(crate) fn empty_read(structured: bool, handle: u64) -> Self {
        if structured {
            Self::with_head(&proto::none_chunk(handle))
        } else {
            Self::ok(handle)
        }
    }

    /// A successful read of `len` bytes at `offset` (at least 1), sent from the buffer of
    /// context `ctx`: a simple reply followed by the data, or one
    /// `NBD_REPLY_TYPE_OFFSET_DATA` chunk (final when `last`). A read split into pieces
    /// sends one such reply per piece: with simple replies only the `first` carries the
    /// header (the others are bare data that must follow it on the wire); with structured
    /// replies each piece is its own chunk and only the `last` is final.
    pub(crate) fn read_data(
        structured: bool,
        handle: u64,
        offset: u64,
        ctx: u16,
        len: u32,
        first: bool,
        last: bool,
    ) -> Self {
        let mut r = if structured {
            Self::with_head(&proto::offset_data_head(handle, offset, len, last))
        } else if first {
            Self::ok(handle)
        } else {
            Self::with_head(&[])
        };
        r.data_ctx = ctx;
        r.data_len = len;
        r.more = !last;
        r
    }

    /// A block status reply (proto.md "`NBD_REPLY_TYPE_BLOCK_STATUS`"): one final chunk
    /// for context [`proto::BASE_ALLOCATION_ID`] whose `descriptors` block descriptors
    /// (at least one) are in the connection's [`Conn::status`] buffer.
    pub(crate) fn block_status(handle: u64, descriptors: u32) -> Self {
        debug_assert!(descriptors >= 1);
        let mut r = Self::with_head(&proto::block_status_head(
            handle,
            proto::BASE_ALLOCATION_ID,
            descriptors,
        ));
        r.data_ctx = STATUS_CTX;
        r.data_len = descriptors * proto::BLOCK_DESCRIPTOR_BYTES as u32;
        r
    }

    /// An error: a simple reply carrying `error`, or with structured replies a final error
    /// chunk with the message (`NBD_REPLY_TYPE_ERROR_OFFSET` when `offset` is given).
    pub(crate) fn error(
        structured: bool,
        handle: u64,
        error: u32,
        message: &'static str,
        offset: Option<u64>,
    ) -> Self {
        debug_assert_ne!(error, 0);
        if !structured {
            return Self::with_head(&proto::simple_reply(error, handle));
        }
        // Strings are at most 4096 bytes (proto.md "Conventions"); ours are short.
        let message = &message[..floor_char_boundary(message, proto::MAX_STRING_BYTES)];
        let mut r = Self::with_head(&proto::error_chunk_head(
            handle,
            error,
            message.len() as u16,
            offset.is_some(),
        ));
        r.message = message;
        if let Some(o) = offset {
            r.tail = proto::error_offset_tail(o);
            r.tail_len = 8;
        }
        r
    }

    /// Bytes on the wire.
    pub(crate) fn total(&self) -> usize {
        usize::from(self.head_len)
            + self.message.len()
            + usize::from(self.tail_len)
            + self.data_len as usize
    }

    /// The reply's pieces after skipping `skip` bytes (already sent), given its data.
    pub(crate) fn pieces<'a>(
        &'a self,
        data: &'a [u8],
        mut skip: usize,
        out: &mut impl FnMut(&'a [u8]) -> bool,
    ) -> bool {
        let parts: [&'a [u8]; 4] = [
            &self.head[..usize::from(self.head_len)],
            self.message.as_bytes(),
            &self.tail[..usize::from(self.tail_len)],
            &data[..self.data_len as usize],
        ];
        for p in parts {
            if skip >= p.len() {
                skip -= p.len();
                continue;
            }
            if !out(&p[skip..]) {
                return false;
            }
            skip = 0;
        }
        true
    }
}

fn floor_char_boundary(s: &str, max: usize) -> usize {
    if s.len() <= max {
        return s.len();
    }
    let mut i = max;
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// What the receive side is in the middle of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rx {
    /// Waiting for a 28-byte request header.
    Header,
    /// Receiving a write payload into context `ctx`'s buffer; `got` bytes so far.
    Payload { ctx: u16, got: u32 },
    /// A write split into pieces: the piece received into context `ctx`'s buffer is in
    /// the array; the rest of its payload is received once that piece completes.
    Piece { ctx: u16 },
    /// Consuming the payload of a rejected write (`left` bytes to go), then replying
    /// `error` to `handle`.
    Discard {
        left: u32,
        handle: u64,
        error: u32,
        message: &'static str,
    },
}

/// Life of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Life {
    /// Reading requests.
    Open,
    /// No new requests (client sent `NBD_CMD_DISC`, closed its side, or the server is
    /// shutting down): finish what was accepted, send the replies, close.
    Draining,
    /// Every reply sent and our side shut down (`shutdown(SHUT_WR)`, after a TLS
    /// `close_notify`): the socket stays open only to discard what the client still sends,
    /// until it closes its side or [`LINGER`] passes. Closing a socket with unread bytes
    /// makes the kernel reset the connection (RFC 1122 section 4.2.2.13), and a reset
    /// throws away the replies still in our send queue and the client's receive queue.
    Lingering,
    /// Socket closed. The slot stays taken until no request context refers to it (the
    /// array may still be using one of its buffers).
    Closed,
}

/// One connection in the transmission phase.
pub(crate) struct Conn {
    /// Server-wide connection number (for logs).
    pub(crate) id: u64,
    /// Peer address (for logs).
    pub(crate) peer: String,
    pub(crate) stream: Option<Stream>,
    /// The TLS session, when the client negotiated TLS (`NBD_OPT_STARTTLS`): every byte of
    /// the transmission phase goes through it.
    pub(crate) tls: Option<Box<ServerConnection>>,
    /// Structured replies negotiated.
    pub(crate) structured: bool,
    /// The limits requests are judged against (with `structured` filled in).
    pub(crate) limits: ExportLimits,
    pub(crate) life: Life,
    pub(crate) rbuf: Box<[u8]>,
    pub(crate) rstart: usize,
    pub(crate) rend: usize,
    pub(crate) rx: Rx,
    /// Replies waiting to be sent, in completion order; capacity `max_inflight`, which the
    /// number of accepted requests never exceeds.
    pub(crate) replies: VecDeque<Reply>,
    /// Bytes of the front reply already sent.
    pub(crate) tx_sent: usize,
    /// The block descriptors of the block status reply being sent
    /// ([`proto::MAX_BLOCK_DESCRIPTORS`] × 8 bytes, allocated with the connection when it
    /// selected `base:allocation`, else empty): one block status reply at a time is
    /// queued; the next request waits until it is sent (`status_busy`).
    pub(crate) status: Box<[u8]>,
    /// A reply in `replies` uses `status`.
    pub(crate) status_busy: bool,
    /// A read split into pieces whose first piece is on the wire: nothing but its next
    /// pieces is sent until its last one is (`NO_CTX`: none). Simple replies need this
    /// (the data must follow its header); structured chunks could interleave, but keeping
    /// one reply's chunks together costs little and spares clients the reassembly.
    pub(crate) stream_ctx: u16,
    /// Requests accepted (header consumed) whose reply is not yet fully sent.
    pub(crate) outstanding: u32,
    /// Most requests accepted and not yet answered at once.
    pub(crate) max_inflight: u32,
    /// Request contexts referring to this connection.
    pub(crate) ctx_held: u32,
    /// Requests accepted, for the closing log line.
    pub(crate) requests: u64,
    /// Bytes of read data sent and write payload received, for the closing log line.
    pub(crate) bytes_read: u64,
    pub(crate) bytes_written: u64,
    /// Since when the connection has held buffers without its client moving a byte.
    pub(crate) stalled_since: Option<std::time::Instant>,
    /// Since when the connection has had nothing in flight and its client sent nothing
    /// (kept only when an idle timeout is configured).
    pub(crate) idle_since: Option<std::time::Instant>,
    /// When a [`Life::Lingering`] connection is closed whether or not its client closed
    /// its side.
    pub(crate) linger_until: Option<std::time::Instant>,
    /// Its place in the export's connection limit and its reactor's table, given back when
    /// the connection is dropped.
    pub(crate) _slot: super::Slot,
}

impl Conn {
    /// Builds a connection for the reactors (allocates its receive buffer and reply queue:
    /// called on the handshake thread, never on a reactor); `limits.structured` says whether
    /// structured replies were negotiated.
    pub(crate) fn new(
        id: u64,
        peer: String,
        stream: Stream,
        tls: Option<Box<ServerConnection>>,
        limits: ExportLimits,
        max_inflight: u32,
        slot: super::Slot,
    ) -> Self {
        Self {
            id,
            peer,
            stream: Some(stream),
            tls,
            structured: limits.structured,
            limits,
            life: Life::Open,
            rbuf: vec![0u8; RBUF_BYTES].into_boxed_slice(),
            rstart: 0,
            rend: 0,
            rx: Rx::Header,
            replies: VecDeque::with_capacity(max_inflight as usize),
            tx_sent: 0,
            status: if limits.block_status {
                vec![0u8; proto::MAX_BLOCK_DESCRIPTORS * proto::BLOCK_DESCRIPTOR_BYTES]
                    .into_boxed_slice()
            } else {
                Box::default()
            },
            status_busy: false,
            stream_ctx: NO_CTX,
            outstanding: 0,
            max_inflight,
            ctx_held: 0,
            requests: 0,
            bytes_read: 0,
            bytes_written: 0,
            stalled_since: None,
            idle_since: None,
            linger_until: None,
            _slot: slot,
        }
    }

    /// Unconsumed bytes in the receive buffer.
    pub(crate) fn buffered(&self) -> &[u8] {
        &self.rbuf[self.rstart..self.rend]
    }

    /// Marks `n` buffered bytes consumed.
    pub(crate) fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.rend - self.rstart);
        self.rstart += n;
        if self.rstart == self.rend {
            self.rstart = 0;
            self.rend = 0;
        }
    }

    /// Reads what the socket has into the receive buffer (non-blocking). `Ok(0)` is end of
    /// stream; `WouldBlock` means nothing is there.
    pub(crate) fn fill(&mut self) -> io::Result<usize> {
        if self.rstart > 0 && self.rbuf.len() - self.rend < proto::REQUEST_BYTES {
            self.rbuf.copy_within(self.rstart..self.rend, 0);
            self.rend -= self.rstart;
            self.rstart = 0;
        }
        debug_assert!(self.rend < self.rbuf.len());
        recv_on(&mut self.stream, &mut self.tls, &mut self.rbuf[self.rend..])
            .inspect(|&n| self.rend += n)
    }

    /// Reads what the client sent into `buf` (non-blocking): straight from the socket, or
    /// decrypted through the TLS session. `Ok(0)` is end of stream (also a closed
    /// connection); `WouldBlock` means nothing is there.
    pub(crate) fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        recv_on(&mut self.stream, &mut self.tls, buf)
    }

    /// Sends `bufs` (non-blocking): in one `sendmsg`, or through the TLS session (which
    /// takes at most [`tls::TLS_BUFFER_BYTES`] at a time). Returns the bytes taken;
    /// `WouldBlock` when the socket is full.
    pub(crate) fn send(
        stream: &Stream,
        tls: Option<&mut ServerConnection>,
        bufs: &[IoSlice<'_>],
    ) -> io::Result<usize> {
        match tls {
            None => stream.send_vectored(bufs),
            Some(t) => tls::send(t, stream, bufs),
        }
    }

    /// Sends what the TLS session still holds for the socket (a reply's tail, a key
    /// update): without TLS, nothing to do. `WouldBlock` when the socket is full.
    pub(crate) fn flush_tls(&mut self) -> io::Result<()> {
        match (self.tls.as_deref_mut(), self.stream.as_ref()) {
            (Some(t), Some(s)) => tls::flush(t, s),
            _ => Ok(()),
        }
    }

    /// Whether the TLS session holds bytes the socket has not taken yet (replies count as
    /// sent once the session took them).
    pub(crate) fn tls_pending(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| t.wants_write())
    }

    /// Closes the socket (a TLS session is ended with close_notify first, best effort).
    pub(crate) fn close_socket(&mut self) {
        if let (Some(t), Some(s)) = (self.tls.as_deref_mut(), self.stream.as_ref()) {
            tls::close(t, s);
        }
        self.stream = None;
    }
}

/// How long a connection that was ended gracefully waits for its client to close its side
/// ([`Life::Lingering`]; the iSCSI and NVMe/TCP front-ends' lingering states too) before
/// its socket is closed regardless.
pub(crate) const LINGER: std::time::Duration = std::time::Duration::from_secs(2);

/// Receive buffers' worth of bytes a lingering connection discards per reactor turn.
const LINGER_READS_PER_TURN: usize = 8;

impl Conn {
    /// Ends our side of the connection gracefully: a TLS session's `close_notify` (best
    /// effort), then `shutdown(SHUT_WR)`, so the client reads every reply already sent and
    /// then the end of stream. Returns `false` when the socket is gone or refused the
    /// shutdown (the caller closes it at once).
    pub(crate) fn shutdown_send(&mut self) -> bool {
        let Some(s) = self.stream.as_ref() else {
            return false;
        };
        if let Some(t) = self.tls.as_deref_mut() {
            tls::close(t, s);
        }
        s.shutdown_write().is_ok()
    }

    /// Reads and throws away what a [`Life::Lingering`] connection's client still sends
    /// (raw bytes: the TLS session has ended). Returns `true` once the client closed its
    /// side or the socket failed, `false` while it may send more (at most
    /// [`LINGER_READS_PER_TURN`] receive buffers are read per call, so a client that keeps
    /// sending cannot hold the reactor).
    pub(crate) fn discard_input(&mut self) -> bool {
        self.stream
            .as_mut()
            .is_none_or(|s| discard_unread(s, &mut self.rbuf) == Discarded::Ended)
    }
}

/// What one [`discard_unread`] call saw of a lingering connection's client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Discarded {
    /// The client closed its side (end of stream), or the socket failed: nothing more can
    /// come, and closing the socket now resets nothing.
    Ended,
    /// This many bytes were read and thrown away (0: none were waiting); the client may
    /// still send more.
    Bytes(usize),
}

/// Reads and throws away, into `buf`, what the client of a connection ended gracefully
/// still sends (any protocol: its requests are no longer served), on a non-blocking
/// socket: at most [`LINGER_READS_PER_TURN`] reads of `buf.len()` bytes per call, so a
/// client that keeps sending cannot hold the reactor. Used by the NBD, iSCSI and NVMe/TCP
/// front-ends while a connection lingers before its close (RFC 1122 section 4.2.2.13:
/// closing with bytes unread resets the connection). A read error other than
/// `WouldBlock` (`EINTR` is retried) counts as [`Discarded::Ended`].
pub(crate) fn discard_unread(r: &mut impl Read, buf: &mut [u8]) -> Discarded {
    let mut n = 0;
    let mut reads = 0;
    while reads < LINGER_READS_PER_TURN {
        match r.read(buf) {
            Ok(0) => return Discarded::Ended,
            Ok(k) => {
                n += k;
                reads += 1;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(_) => return Discarded::Ended,
        }
    }
    Discarded::Bytes(n)
}

/// [`Conn::recv`] on a connection's socket and TLS session.
fn recv_on(
    stream: &mut Option<Stream>,
    tls: &mut Option<Box<ServerConnection>>,
    buf: &mut [u8],
) -> io::Result<usize> {
    let Some(s) = stream.as_mut() else {
        return Ok(0);
    };
    match tls.as_deref_mut() {
        None => read_retrying(s, buf),
        Some(t) => tls::read(t, s, buf),
    }
}

/// `read` that retries `EINTR`.
pub(crate) fn read_retrying(s: &mut Stream, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match s.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(r: &Reply, data: &[u8], skip: usize) -> Vec<u8> {
        let mut v = Vec::new();
        r.pieces(data, skip, &mut |p| {
            v.extend_from_slice(p);
            true
        });
        v
    }

    #[test]
    fn reply_pieces_and_skipping() {
        let data = [7u8; 10];
        let r = Reply::read_data(true, 1, 4096, 3, 10, true, true);
        assert_eq!(r.total(), 28 + 10);
        let all = collect(&r, &data, 0);
        assert_eq!(all.len(), 38);
        assert_eq!(&all[28..], &data);
        for skip in 0..38 {
            assert_eq!(collect(&r, &data, skip), all[skip..].to_vec());
        }
        let e = Reply::error(true, 2, proto::EIO, "boom", Some(512));
        let b = collect(&e, &[], 0);
        assert_eq!(b.len(), 26 + 4 + 8);
        assert_eq!(&b[26..30], b"boom");
        assert_eq!(&b[30..], &512u64.to_be_bytes());
        let s = Reply::error(false, 2, proto::EIO, "boom", None);
        assert_eq!(s.total(), 16);
        let d = [
            proto::block_descriptor(4096, 3),
            proto::block_descriptor(512, 0),
        ]
        .concat();
        let b = Reply::block_status(9, 2);
        let all = collect(&b, &d, 0);
        assert_eq!(all.len(), 20 + 4 + 16);
        assert_eq!(&all[20..24], &proto::BASE_ALLOCATION_ID.to_be_bytes());
        assert_eq!(&all[24..], &d[..]);
        let (h, _) = proto::parse_reply_header(&all).unwrap();
        assert_eq!(
            h,
            proto::ReplyHeader::Structured {
                flags: proto::REPLY_FLAG_DONE,
                kind: proto::REPLY_TYPE_BLOCK_STATUS,
                handle: 9,
                length: 20
            }
        );
    }
}
