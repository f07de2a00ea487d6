//! One whole NBD conversation driven in one thread: the stateful fuzz target `nbd_conn`
//! (`fuzz_targets/nbd_conn.rs`) and the seed replay test (`tests/tests/nbd_conversation.rs`,
//! which includes this file) both run [`run`].
//!
//! The server is the real one ([`ferroraid::nbd::local::LocalServer`]: the handshake state
//! machine and the reactor front-end), its front-end on a reactor that this thread turns
//! ([`engine::reactor::run_local`]) over an in-memory RAID5/RAID6 array (`mem` members).
//! The client is one end of a non-blocking Unix socket pair, sending the input's byte
//! stream in pieces whose sizes the input chooses, and reading (and checking) everything
//! the server sends.
//!
//! # Input
//! - byte 0, the setup: bits 0–1 the array (RAID5 × 3 with 512-byte blocks; RAID6 × 4;
//!   RAID5 × 3 with 4096-byte blocks; RAID5 × 3 without trim and write-zeroes), bit 2
//!   small buffers (reads and writes over 16 KiB split into pieces, few buffers), bits
//!   3–4 requests in flight per connection (1, 2, 8, 128), bit 5 how the client ends
//!   (0: shuts down its sending side and reads until the server closes; 1: closes the
//!   socket), bit 6 server shutdown requested once the client sent everything, bit 7 a
//!   slow client (it reads at most 4 KiB per loop turn, and the server's send buffer is
//!   the smallest the kernel allows);
//! - bytes 1–2, the fragmentation: 0 sends the stream as it is; any other value seeds the
//!   generator of piece sizes (1 byte to 64 KiB);
//! - byte 3, TLS ([`TlsSetup`]): bits 0–1 the server's `--tls` mode (off; `allow`;
//!   `require`; `require` with client certificates of the test CA, which the client
//!   presents), bit 2 an eager client (after `NBD_OPT_STARTTLS` it goes on in the clear
//!   without waiting for the reply and never starts TLS: the server's TLS layer gets
//!   plaintext NBD), bit 3 the client offers TLS 1.2 only (else 1.3 is agreed), bits 4–7
//!   `k`: when not 0 the client's ciphertext byte at offset 293 × (`k` − 1) + 1 is
//!   flipped (in the handshake for small `k`, in the records after it otherwise);
//! - the rest: what the client sends, from its handshake flags on: options, then requests
//!   and write payloads. A seed is a valid whole conversation; mutations give options in
//!   any order, unknown ones, bad magic, odd lengths, and truncation ends it at any byte.
//!
//! # TLS
//! The stream is plaintext NBD whatever the TLS byte says: no TLS bytes are in the input.
//! The client sends it in the clear up to the end of the next `NBD_OPT_STARTTLS` and waits
//! for its reply; after the acknowledgement (`NBD_REP_ACK`) a rustls `ClientConnection`
//! (trusting the test CA, server name `localhost`) makes the TLS handshake on the same
//! non-blocking socket, then the rest of the stream is handed to the TLS writer in the
//! input's piece sizes and the ciphertext sent in the input's piece sizes too; the
//! server's bytes go through the session before the checker parses them. At the end the
//! client sends close_notify (unless it drops the socket). The certificates (a CA, a
//! server and a client certificate of it) are made with rcgen once per process and the
//! rustls configurations cached (a `OnceLock`): an execution pays for a TLS handshake,
//! not for key generation. The handshakes use fresh randomness, so a conversation with
//! TLS is not byte-for-byte repeatable on the wire (its plaintext is).
//!
//! # What must hold (a panic otherwise)
//! - no panic in the server;
//! - the server's bytes parse as NBD: the greeting, then option replies to the options
//!   sent, in order (each with the option's number, a known reply type, an `NBD_REP_INFO`
//!   export size equal to the export's), or the `NBD_OPT_EXPORT_NAME` reply; then simple
//!   replies and structured reply chunks whose handle belongs to a request sent and not yet
//!   answered (a simple reply to a read only without structured replies; read data within
//!   the read's range; error chunks well formed), and nothing after an `NBD_OPT_ABORT`
//!   acknowledgement;
//! - TLS (proto.md "TLS support", `NBD_OPT_STARTTLS`): `NBD_OPT_STARTTLS` gets
//!   `NBD_REP_ERR_POLICY` with TLS off, `NBD_REP_ERR_INVALID` with data or once TLS is on,
//!   else `NBD_REP_ACK`; with TLS required every other option but `NBD_OPT_ABORT` gets
//!   `NBD_REP_ERR_TLS_REQD` before TLS, and `NBD_OPT_EXPORT_NAME` is closed without a
//!   byte of export data (a shutting-down server's `NBD_REP_ERR_SHUTDOWN` excepted);
//!   structured replies negotiated before STARTTLS do not survive it; the server's TLS
//!   records always verify (a TLS failure on the client's side is a server bug unless the
//!   client flipped a byte of its own);
//! - every request is answered before the server closes, when nothing allowed it to close
//!   early: the client's stream ended at a message boundary (or with `NBD_CMD_DISC`),
//!   with no bad magic and no write payload beyond 2^25 bytes, the client shut down only
//!   its sending side, the server was not asked to shut down and no TLS byte was flipped
//!   nor plaintext sent where TLS was due;
//! - no hang: at most `TURNS_FIXED + TURNS_PER_BYTE` × input bytes loop turns in all, and
//!   never [`IDLE_TURNS`] turns in a row in which nothing moves before the conversation
//!   is over;
//! - afterwards a server shutdown drains the front-end: no connection, no buffer and no
//!   connection slot is left taken.
//!

#[path = "harness.rs"]
mod harness;

use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use engine::array::ArrayConfig;
use engine::geometry::Level;
use engine::parity::Parity;
use engine::reactor::{run_local, Frontend};
use ferroraid::nbd::local::{HandshakeState, LocalServer};
use ferroraid::nbd::proto;
use ferroraid::nbd::{BufferClass, ExportConfig, ServerConfig};

/// Bytes of the input before the client's stream (setup, fragmentation and TLS).
pub const HEADER_BYTES: usize = 4;
/// Loop turns every conversation may take, whatever its length.
pub const TURNS_FIXED: u64 = 2_000;
/// Loop turns each input byte may add.
pub const TURNS_PER_BYTE: u64 = 64;
/// Loop turns in a row without any progress that count as a hang.
pub const IDLE_TURNS: u32 = 256;
/// Longest option data the server reads and parses (`nbd::handshake::MAX_OPTION_BYTES`);
/// longer data is skipped and answered `NBD_REP_ERR_TOO_BIG`.
const OPTION_PARSE_LIMIT: u32 = 64 << 10;
/// Chunk size of the array, bytes.
const CHUNK: u64 = 4096;
/// Stripes of the array (a small export: 128 KiB).
const STRIPES: u64 = 16;
/// What a slow client reads per loop turn, bytes.
const SLOW_READ: usize = 4096;
/// Longest write payload the server consumes (it is `max(max block, 2^25)`; the largest
/// buffer here is far below 2^25).
const DISCARD_CAP: u64 = proto::DOS_FLOOR_BYTES as u64;

/// The setup byte, decoded (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    /// 0..4: the array and export variant.
    pub array: u8,
    /// Few, small buffers.
    pub small_buffers: bool,
    /// Requests in flight per connection.
    pub max_inflight: u32,
    /// The client closes its socket at the end instead of shutting down its sending side.
    pub drop_client: bool,
    /// Server shutdown requested once the client sent everything.
    pub server_shutdown: bool,
    /// The client reads slowly and the server's send buffer is minimal.
    pub slow_client: bool,
}

impl Setup {
    /// Decodes byte 0.
    pub fn from_byte(b: u8) -> Self {
        Self {
            array: b & 3,
            small_buffers: b & 4 != 0,
            max_inflight: [1, 2, 8, 128][usize::from((b >> 3) & 3)],
            drop_client: b & 0x20 != 0,
            server_shutdown: b & 0x40 != 0,
            slow_client: b & 0x80 != 0,
        }
    }
}

/// What a conversation showed (for the seed replay test).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The server entered the transmission phase.
    pub transmission: bool,
    /// Requests answered (a reply, or a final chunk).
    pub answered: usize,
    /// The "every request is answered" rule applied (the conversation ended cleanly).
    pub clean: bool,
    /// The checker gave up because two different unanswered requests shared a handle
    /// (nothing was checked after that reply).
    pub ambiguous: bool,
    /// The client's TLS handshake completed (after an acknowledged `NBD_OPT_STARTTLS`).
    pub tls: bool,
    /// Loop turns taken.
    pub turns: u64,
}

/// Piece sizes from a 16-bit seed (xorshift32).
struct Pieces(u32);

impl Pieces {
    fn next(&mut self) -> usize {
        if self.0 == 0 {
            return usize::MAX;
        }
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 17;
        self.0 ^= self.0 << 5;
        const SIZES: [usize; 16] = [
            1, 1, 2, 3, 4, 7, 15, 16, 27, 28, 29, 100, 511, 4096, 4097, 65536,
        ];
        SIZES[(self.0 >> 8) as usize % SIZES.len()]
    }
}

/// The smallest send buffer the kernel allows on `s`.
fn shrink_send_buffer(s: &UnixStream) {
    let v: libc::c_int = 1;
    // SAFETY: `v` outlives the call and its size is passed; the descriptor is open.
    let _ = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
}

/// Runs the conversation of `input` (see the module docs); panics when a rule breaks.
pub fn run(input: &[u8]) -> Outcome {
    let Some(&setup) = input.first() else {
        return Outcome::default();
    };
    let setup = Setup::from_byte(setup);
    let seed = u32::from(u16::from_be_bytes([
        input.get(1).copied().unwrap_or(0),
        input.get(2).copied().unwrap_or(0),
    ]));
    let tls_setup = TlsSetup::from_byte(input.get(3).copied().unwrap_or(0));
    let stream = input.get(HEADER_BYTES..).unwrap_or_default();
    let (level, members, block, ops) = match setup.array {
        0 => (Level::Raid5, 3, 512, true),
        1 => (Level::Raid6, 4, 512, true),
        2 => (Level::Raid5, 3, 4096, true),
        _ => (Level::Raid5, 3, 512, false),
    };
    let (geo, devices) = harness::mem_array(level, members, CHUNK, block, STRIPES);
    let mut export = ExportConfig::for_array("fuzz", &geo, 64 << 10);
    export.trim = ops;
    export.write_zeroes = ops;
    let buffers = if setup.small_buffers {
        vec![
            BufferClass {
                bytes: 4096,
                count: 2,
            },
            BufferClass {
                bytes: 16 << 10,
                count: 1,
            },
        ]
    } else {
        vec![
            BufferClass {
                bytes: 8 << 10,
                count: 8,
            },
            BufferClass {
                bytes: 64 << 10,
                count: 2,
            },
        ]
    };
    let config = ServerConfig {
        buffers,
        max_inflight_per_connection: setup.max_inflight,
        ..ServerConfig::default()
    };
    let (server, frontend) = match server_tls(tls_setup.mode) {
        Some(tls) => LocalServer::with_tls(export, config, tls),
        None => LocalServer::new(export, config),
    }
    .expect("server");
    let export_size = server.export().size_bytes;
    let array_cfg = ArrayConfig {
        requests: 64,
        stripe_ops: 8,
        io_timeout_ns: 0,
        background_ops: 0,
        stripe_cache_entries: 8,
        write_hold_ns: 0,
        ..ArrayConfig::default()
    };
    let (ours, theirs) = UnixStream::pair().expect("socket pair");
    ours.set_nonblocking(true).expect("non-blocking");
    if setup.slow_client {
        shrink_send_buffer(&theirs);
    }
    let mut handshake = server.accept(theirs).expect("accept");
    let budget = TURNS_FIXED + TURNS_PER_BYTE * input.len() as u64;
    let (outcome, _frontend) = run_local(
        &devices,
        geo,
        Parity::new(),
        array_cfg,
        64,
        frontend,
        |r| {
            let mut check = Checker::new(stream, export_size);
            check.tls_mode = tls_setup.mode;
            let mut tls: Option<ClientTls> = None;
            let mut pieces = Pieces(if seed == 0 { 0 } else { seed | (seed << 16) });
            let mut client = Some(ours);
            let mut delivered = 0usize;
            let mut piece_left = 0usize;
            let mut ended = false;
            let mut send_failed = false;
            let mut eof = false;
            let mut hs = HandshakeState::Writing;
            let mut turns = 0u64;
            let mut idle = 0u32;
            let mut rbuf = vec![0u8; 64 << 10];
            loop {
                turns += 1;
                assert!(
                    turns <= budget,
                    "hang: {turns} loop turns for {} input bytes (handshake {hs:?}, {delivered} of {} bytes sent)",
                    input.len(),
                    stream.len()
                );
                let mut moved = false;
                // The client sends its next piece: in the clear up to an
                // `NBD_OPT_STARTTLS` whose reply it waits for (unless eager), through its
                // TLS session once one was acknowledged.
                let barrier = if tls_setup.eager || tls.is_some() {
                    None
                } else {
                    check.starttls_barrier()
                };
                let limit = barrier.unwrap_or(stream.len()).min(stream.len());
                if let Some(c) = client.as_ref() {
                    if !ended {
                        match tls.as_mut() {
                            None if delivered < limit => {
                                if piece_left == 0 {
                                    piece_left = pieces.next().min(limit - delivered);
                                }
                                match harness::send(c, &stream[delivered..delivered + piece_left]) {
                                    Some(n) => {
                                        delivered += n;
                                        piece_left -= n;
                                        moved |= n > 0;
                                    }
                                    None => send_failed = true,
                                }
                            }
                            None => {}
                            Some(t) => {
                                if !t.pending() && !t.conn.is_handshaking() && delivered < limit {
                                    let n = pieces.next().min(limit - delivered);
                                    let taken = t
                                        .conn
                                        .writer()
                                        .write(&stream[delivered..delivered + n])
                                        .unwrap_or(0);
                                    delivered += taken;
                                    moved |= taken > 0;
                                }
                                t.collect();
                                if t.pending() {
                                    let left = t.out.len() - t.out_at;
                                    if piece_left == 0 {
                                        piece_left = pieces.next();
                                    }
                                    piece_left = piece_left.min(left);
                                    match harness::send(c, &t.out[t.out_at..t.out_at + piece_left]) {
                                        Some(n) => {
                                            t.out_at += n;
                                            piece_left -= n;
                                            moved |= n > 0;
                                        }
                                        None => send_failed = true,
                                    }
                                }
                            }
                        }
                    }
                }
                check.delivered = delivered;
                // Everything sent: not while the reply to a STARTTLS is awaited, nor while
                // the TLS session has bytes for the socket (close_notify first).
                let waiting = barrier == Some(delivered);
                let quiet = tls
                    .as_ref()
                    .is_none_or(|t| t.broken || (!t.pending() && !t.conn.is_handshaking()));
                if !ended && ((delivered == stream.len() && !waiting && quiet) || send_failed) {
                    match tls.as_mut() {
                        Some(t) if !t.closing && !t.broken && !send_failed && !setup.drop_client => {
                            t.conn.send_close_notify();
                            t.closing = true;
                            t.collect();
                            moved = true;
                        }
                        _ => {
                            ended = true;
                            moved = true;
                            if setup.server_shutdown {
                                server.shutdown();
                            }
                            if setup.drop_client {
                                client = None;
                            } else if let Some(c) = client.as_ref() {
                                let _ = c.shutdown(std::net::Shutdown::Write);
                            }
                        }
                    }
                }
                // The server: the handshake thread's work, then a reactor turn.
                if matches!(hs, HandshakeState::Reading | HandshakeState::Writing) {
                    let now = handshake.drive(&server);
                    moved |= now != hs;
                    hs = now;
                }
                moved |= r.turn();
                // The client reads what came.
                if let Some(c) = client.as_mut() {
                    let mut room = if setup.slow_client {
                        SLOW_READ
                    } else {
                        usize::MAX
                    };
                    while room > 0 && !eof {
                        let want = room.min(rbuf.len());
                        match c.read(&mut rbuf[..want]) {
                            Ok(0) => eof = true,
                            Ok(n) => {
                                receive(&mut check, &mut tls, tls_setup, ended, &rbuf[..n]);
                                room -= n;
                                moved = true;
                            }
                            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                            Err(e) if e.kind() == ErrorKind::Interrupted => {}
                            // ECONNRESET: the server closed with our bytes unread.
                            Err(_) => eof = true,
                        }
                    }
                }
                let server_done = match hs {
                    HandshakeState::Ended => true,
                    HandshakeState::Transmission => r.frontend().connections() == 0,
                    _ => false,
                };
                let done = if client.is_some() {
                    eof
                } else {
                    server_done
                };
                if done {
                    break;
                }
                if moved {
                    idle = 0;
                } else {
                    idle += 1;
                    assert!(
                        idle < IDLE_TURNS,
                        "hang: nothing moved for {IDLE_TURNS} loop turns (handshake {hs:?}, \
                         {delivered} of {} bytes sent, client ended: {ended}, {} connection(s), \
                         {} array request(s) in flight)",
                        stream.len(),
                        r.frontend().connections(),
                        r.in_flight()
                    );
                }
            }
            let clean = client.is_some()
                && !setup.server_shutdown
                && !check.tls_lost
                && tls.as_ref().is_none_or(|t| !t.tampered && !t.broken)
                && check.phase == Phase::Transmission
                && matches!(check.stop, Some(Stop::End | Stop::Disc));
            check.at_close(clean);
            // The client saw the end of stream and closes its socket, as real clients do: a
            // server that ended its side gracefully lingers until then.
            drop(client.take());
            // Shut down: the front-end drains and gives everything back.
            server.shutdown();
            let mut n = 0u64;
            while !r.frontend().finished() || r.in_flight() > 0 {
                r.turn();
                n += 1;
                assert!(
                    n < u64::from(IDLE_TURNS) * 16,
                    "the front-end did not drain after shutdown: {} connection(s), {} array request(s) in flight",
                    r.frontend().connections(),
                    r.in_flight()
                );
            }
            assert_eq!(r.frontend().connections(), 0, "connections left after shutdown");
            assert_eq!(
                r.frontend().free_buffers(),
                r.frontend().buffers(),
                "buffers left taken after shutdown"
            );
            Outcome {
                transmission: hs == HandshakeState::Transmission,
                answered: check.answered,
                clean,
                ambiguous: check.lost,
                tls: tls.as_ref().is_some_and(|t| !t.conn.is_handshaking()),
                turns: turns + n,
            }
        },
    )
    .expect("reactor");
    drop(handshake);
    assert_eq!(
        server.stats().connections,
        0,
        "connection slots left taken after the conversation"
    );
    outcome
}

/// Where the server's side of the conversation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Greeting,
    Options,
    ExportReply,
    Transmission,
    /// After the `NBD_OPT_ABORT` acknowledgement: nothing more may come.
    Aborted,
    /// `NBD_OPT_EXPORT_NAME` in the clear with TLS required: the server closes without a
    /// byte of export data.
    Refused,
}

/// Why the model of the client's requests stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// The stream ends exactly after a request.
    End,
    /// The stream ends inside a request or its payload.
    Truncated,
    /// A request header without the request magic (the server must hang up).
    BadMagic,
    /// `NBD_CMD_DISC`: nothing after it is read.
    Disc,
    /// A write payload beyond what the server consumes (it must hang up).
    TooLong,
}

/// An option the client sent.
#[derive(Debug, Clone, Copy)]
struct Opt {
    option: u32,
    length: u32,
    /// Offset in the client's stream just past its data.
    end: usize,
}

/// A request the client sent.
#[derive(Debug, Clone, Copy)]
struct Req {
    command: u16,
    flags: u16,
    handle: u64,
    offset: u64,
    length: u32,
    /// Offset in the client's stream just past its header.
    header_end: usize,
    answered: bool,
}

/// The client's view: its own stream (what it sent) and a parser of what the server sends.
struct Checker<'a> {
    stream: &'a [u8],
    /// Bytes of `stream` sent so far.
    delivered: usize,
    export_size: u64,
    rx: Vec<u8>,
    phase: Phase,
    opts: Vec<Opt>,
    /// Where the next option starts in `stream` (None once the options stop parsing).
    opt_next: Option<usize>,
    /// The option being answered.
    k: usize,
    structured: bool,
    /// The option being answered got an `NBD_REP_META_CONTEXT` reply.
    meta_listed: bool,
    /// The context id of `base:allocation` once an `NBD_OPT_SET_META_CONTEXT` selected it.
    context: Option<u32>,
    reqs: Vec<Req>,
    /// Where the next request starts in `stream`.
    req_next: usize,
    stop: Option<Stop>,
    answered: usize,
    lost: bool,
    /// The server's TLS mode.
    tls_mode: TlsSetting,
    /// Options are answered inside TLS (an `NBD_OPT_STARTTLS` was acknowledged).
    secure: bool,
    /// The `NBD_OPT_STARTTLS` acknowledgement was just parsed: what follows it is TLS
    /// (the client takes the rest of `rx` into its session).
    starttls_ack: bool,
    /// The client did not start TLS after the acknowledgement (eager, or it had ended):
    /// the server's bytes are TLS records no more checked.
    tls_lost: bool,
    /// The first option not yet looked at for STARTTLS, and the next STARTTLS found
    /// (index, end of its data).
    starttls_scan: usize,
    starttls_next: Option<(usize, usize)>,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl<'a> Checker<'a> {
    fn new(stream: &'a [u8], export_size: u64) -> Self {
        Self {
            stream,
            delivered: 0,
            export_size,
            rx: Vec::new(),
            phase: Phase::Greeting,
            opts: Vec::new(),
            opt_next: Some(4),
            k: 0,
            structured: false,
            meta_listed: false,
            context: None,
            reqs: Vec::new(),
            req_next: 0,
            stop: None,
            answered: 0,
            lost: false,
            tls_mode: TlsSetting::Off,
            secure: false,
            starttls_ack: false,
            tls_lost: false,
            starttls_scan: 0,
            starttls_next: None,
        }
    }

    /// The client's flags asked for no zeroes after the `NBD_OPT_EXPORT_NAME` reply.
    fn no_zeroes(&self) -> bool {
        self.stream.len() >= 4 && be32(self.stream, 0) & proto::FLAG_C_NO_ZEROES != 0
    }

    /// The option `k`, parsed from the client's stream if it is there.
    fn option(&mut self, k: usize) -> Option<Opt> {
        while self.opts.len() <= k {
            let at = self.opt_next?;
            let s = self.stream;
            if at + proto::OPTION_HEADER_BYTES > s.len() || be64(s, at) != proto::IHAVEOPT {
                self.opt_next = None;
                return None;
            }
            let length = be32(s, at + 12);
            let end = at + proto::OPTION_HEADER_BYTES + length as usize;
            self.opts.push(Opt {
                option: be32(s, at + 8),
                length,
                end,
            });
            self.opt_next = (end <= s.len()).then_some(end);
        }
        Some(self.opts[k])
    }

    /// Parses the client's requests from `req_next` on, up to where its model stops.
    fn parse_requests(&mut self) {
        let s = self.stream;
        while self.stop.is_none() {
            let at = self.req_next;
            if at == s.len() {
                self.stop = Some(Stop::End);
                break;
            }
            if at + proto::REQUEST_BYTES > s.len() {
                self.stop = Some(Stop::Truncated);
                break;
            }
            let Ok(r) = proto::parse_request(&s[at..]) else {
                self.stop = Some(Stop::BadMagic);
                break;
            };
            let header_end = at + proto::REQUEST_BYTES;
            self.reqs.push(Req {
                command: r.command,
                flags: r.flags,
                handle: r.handle,
                offset: r.offset,
                length: r.length,
                header_end,
                answered: false,
            });
            if r.command == proto::CMD_DISC {
                self.stop = Some(Stop::Disc);
                break;
            }
            let payload = u64::from(r.payload_bytes());
            if payload > DISCARD_CAP {
                self.stop = Some(Stop::TooLong);
                break;
            }
            let end = header_end as u64 + payload;
            if end > s.len() as u64 {
                self.stop = Some(Stop::Truncated);
                break;
            }
            self.req_next = end as usize;
        }
    }

    /// Unanswered requests with `handle` whose header the client sent (DISC excluded: it
    /// gets no reply).
    fn candidates(&self, handle: u64) -> impl Iterator<Item = usize> + '_ {
        self.reqs.iter().enumerate().filter_map(move |(i, r)| {
            (!r.answered
                && r.handle == handle
                && r.header_end <= self.delivered
                && r.command != proto::CMD_DISC)
                .then_some(i)
        })
    }

    /// Whether a reply to any of `cands` (unanswered requests sharing a handle) may be
    /// taken as the reply to the first: they are the same request. Otherwise which one it
    /// answers is ambiguous (and with it what follows on the wire): the checker stops
    /// checking (`lost`).
    fn interchangeable(&mut self, cands: &[usize]) -> bool {
        let key = |r: &Req| (r.command, r.offset, r.length);
        let first = key(&self.reqs[cands[0]]);
        if cands.iter().all(|&i| key(&self.reqs[i]) == first) {
            return true;
        }
        self.lost = true;
        false
    }

    fn answer(&mut self, i: usize) {
        self.reqs[i].answered = true;
        self.answered += 1;
    }

    /// Takes bytes the server sent.
    fn feed(&mut self, b: &[u8]) {
        if self.lost || self.tls_lost {
            return;
        }
        self.rx.extend_from_slice(b);
        let rx = std::mem::take(&mut self.rx);
        let mut at = 0;
        while !self.lost && !self.starttls_ack {
            match self.message(&rx[at..]) {
                Some(n) => at += n,
                None => break,
            }
        }
        self.rx = rx;
        self.rx.drain(..at);
    }

    /// After the greeting or an option's final reply: an `NBD_OPT_EXPORT_NAME` next is
    /// answered by the export data, not an option reply.
    fn next_option(&mut self) {
        if self.phase == Phase::Options {
            if let Some(next) = self.option(self.k) {
                if next.option == proto::OPT_EXPORT_NAME {
                    self.phase = if self.plaintext_refused() {
                        Phase::Refused
                    } else {
                        Phase::ExportReply
                    };
                }
            }
        }
    }

    /// Checks the complete message at the start of `b` and returns its length, or `None`
    /// when it is not all there yet.
    fn message(&mut self, b: &[u8]) -> Option<usize> {
        match self.phase {
            Phase::Greeting => {
                if b.len() < proto::GREETING_BYTES {
                    return None;
                }
                assert_eq!(
                    b[..proto::GREETING_BYTES],
                    proto::greeting(proto::SERVER_HANDSHAKE_FLAGS),
                    "bad greeting"
                );
                self.phase = Phase::Options;
                self.next_option();
                Some(proto::GREETING_BYTES)
            }
            Phase::Options => {
                if b.len() < proto::OPTION_REPLY_HEADER_BYTES {
                    return None;
                }
                let h = proto::parse_option_reply_header(b)
                    .unwrap_or_else(|e| panic!("bad option reply header {:02x?}: {e}", &b[..20]));
                let Some(opt) = self.option(self.k) else {
                    panic!(
                        "option reply {:#x} to option {} with no option {} sent",
                        h.reply, h.option, self.k
                    );
                };
                assert!(
                    opt.end <= self.delivered,
                    "reply to option {} before its data was sent",
                    opt.option
                );
                assert_eq!(
                    h.option, opt.option,
                    "option reply names option {} while option {} is being answered",
                    h.option, opt.option
                );
                assert!(h.length <= 1 << 20, "option reply of {} bytes", h.length);
                let total = proto::OPTION_REPLY_HEADER_BYTES + h.length as usize;
                if b.len() < total {
                    return None;
                }
                let data = &b[proto::OPTION_REPLY_HEADER_BYTES..total];
                self.check_tls_reply(opt, h.reply);
                match h.reply {
                    proto::REP_ACK => {
                        assert_eq!(h.length, 0, "acknowledgement with data");
                        self.k += 1;
                        match opt.option {
                            proto::OPT_LIST_META_CONTEXT => {}
                            proto::OPT_SET_META_CONTEXT if !self.meta_listed => self.context = None,
                            proto::OPT_SET_META_CONTEXT => {}
                            proto::OPT_GO => {
                                self.phase = Phase::Transmission;
                                self.req_next = opt.end;
                            }
                            proto::OPT_STRUCTURED_REPLY => self.structured = true,
                            proto::OPT_STARTTLS => {
                                // proto.md: no negotiation state survives STARTTLS.
                                self.structured = false;
                                self.secure = true;
                                self.starttls_ack = true;
                            }
                            proto::OPT_ABORT => self.phase = Phase::Aborted,
                            proto::OPT_LIST | proto::OPT_INFO => {}
                            o => panic!("option {o} acknowledged"),
                        }
                    }
                    proto::REP_META_CONTEXT => {
                        let set = opt.option == proto::OPT_SET_META_CONTEXT;
                        assert!(
                            set || opt.option == proto::OPT_LIST_META_CONTEXT,
                            "NBD_REP_META_CONTEXT for {opt:?}"
                        );
                        assert!(
                            self.structured || !set,
                            "context selected without structured replies"
                        );
                        assert!(
                            data.len() > 4 && &data[4..] == proto::BASE_ALLOCATION.as_bytes(),
                            "NBD_REP_META_CONTEXT data {data:?}"
                        );
                        let id = be32(data, 0);
                        assert_eq!(id == 0, !set, "context id {id} in a reply to {opt:?}");
                        assert!(!self.meta_listed, "a context listed twice");
                        self.meta_listed = true;
                        if set {
                            self.context = Some(id);
                        }
                    }
                    proto::REP_SERVER => {
                        assert_eq!(opt.option, proto::OPT_LIST, "NBD_REP_SERVER for {opt:?}");
                        assert!(
                            data.len() >= 4 && be32(data, 0) as usize + 4 <= data.len(),
                            "bad NBD_REP_SERVER data"
                        );
                    }
                    proto::REP_INFO => {
                        assert!(
                            matches!(opt.option, proto::OPT_INFO | proto::OPT_GO),
                            "NBD_REP_INFO for {opt:?}"
                        );
                        assert!(data.len() >= 2, "NBD_REP_INFO without a type");
                        match be16(data, 0) {
                            proto::INFO_EXPORT => {
                                assert_eq!(data.len(), 12, "NBD_INFO_EXPORT length");
                                assert_eq!(be64(data, 2), self.export_size, "export size");
                            }
                            proto::INFO_BLOCK_SIZE => {
                                assert_eq!(data.len(), 14, "NBD_INFO_BLOCK_SIZE length");
                                let (min, pref, max) =
                                    (be32(data, 2), be32(data, 6), be32(data, 10));
                                assert!(
                                    min.is_power_of_two()
                                        && pref.is_power_of_two()
                                        && min <= pref
                                        && max % min == 0,
                                    "block sizes {min} {pref} {max}"
                                );
                            }
                            proto::INFO_NAME | proto::INFO_DESCRIPTION => {}
                            t => panic!("unknown NBD_REP_INFO type {t}"),
                        }
                    }
                    r if r & (1 << 31) != 0 => {
                        assert!(
                            (proto::REP_ERR_UNSUP..=proto::REP_ERR_TOO_BIG).contains(&r),
                            "unknown error reply {r:#x}"
                        );
                        if opt.option == proto::OPT_SET_META_CONTEXT {
                            // A failed SET leaves nothing selected.
                            self.context = None;
                        }
                        self.k += 1;
                    }
                    r => panic!("unknown option reply type {r:#x}"),
                }
                if h.reply != proto::REP_META_CONTEXT {
                    self.meta_listed = false;
                }
                self.next_option();
                Some(total)
            }
            Phase::ExportReply => {
                let opt = self.opts[self.k];
                let n = 10
                    + if self.no_zeroes() {
                        0
                    } else {
                        proto::EXPORT_NAME_ZEROES
                    };
                if b.is_empty() {
                    return None;
                }
                assert!(
                    opt.end <= self.delivered && opt.length <= 64 << 10,
                    "NBD_OPT_EXPORT_NAME reply before its data, or to one of {} bytes",
                    opt.length
                );
                if b.len() < n {
                    return None;
                }
                assert_eq!(be64(b, 0), self.export_size, "export size");
                assert!(
                    be16(b, 8) & proto::TFLAG_HAS_FLAGS != 0,
                    "transmission flags"
                );
                assert!(b[10..n].iter().all(|&z| z == 0), "zeroes");
                self.phase = Phase::Transmission;
                self.req_next = opt.end;
                Some(n)
            }
            Phase::Refused if b.is_empty() => None,
            Phase::Refused => panic!(
                "{} bytes for NBD_OPT_EXPORT_NAME in the clear with TLS required",
                b.len()
            ),
            Phase::Aborted if b.is_empty() => None,
            Phase::Aborted => panic!("{} bytes after the NBD_OPT_ABORT acknowledgement", b.len()),
            Phase::Transmission => self.reply(b),
        }
    }

    /// A transmission reply at the start of `b`.
    fn reply(&mut self, b: &[u8]) -> Option<usize> {
        self.parse_requests();
        if b.len() < 4 {
            return None;
        }
        match be32(b, 0) {
            proto::SIMPLE_REPLY_MAGIC => {
                if b.len() < proto::SIMPLE_REPLY_BYTES {
                    return None;
                }
                let (error, handle) = (be32(b, 4), be64(b, 8));
                let cands: Vec<usize> = self.candidates(handle).collect();
                assert!(
                    !cands.is_empty(),
                    "simple reply (error {error}) for handle {handle:#x}, which no unanswered request carries"
                );
                let data = |r: &Req| {
                    if r.command == proto::CMD_READ && error == 0 {
                        r.length as usize
                    } else {
                        0
                    }
                };
                let cands: Vec<usize> = if self.structured {
                    let c: Vec<usize> = cands
                        .into_iter()
                        .filter(|&i| self.reqs[i].command != proto::CMD_READ)
                        .collect();
                    assert!(
                        !c.is_empty(),
                        "simple reply to a read (handle {handle:#x}) with structured replies on"
                    );
                    c
                } else {
                    cands
                };
                if !self.interchangeable(&cands) {
                    return None;
                }
                let pick = cands[0];
                let n = data(&self.reqs[pick]);
                let total = proto::SIMPLE_REPLY_BYTES + n;
                if b.len() < total {
                    return None;
                }
                self.answer(pick);
                Some(total)
            }
            proto::STRUCTURED_REPLY_MAGIC => {
                if b.len() < proto::STRUCTURED_HEADER_BYTES {
                    return None;
                }
                assert!(
                    self.structured,
                    "structured reply chunk without structured replies"
                );
                let (flags, kind, handle, length) =
                    (be16(b, 4), be16(b, 6), be64(b, 8), be32(b, 16));
                assert!(
                    u64::from(length) <= DISCARD_CAP + 8,
                    "chunk of {length} bytes"
                );
                let total = proto::STRUCTURED_HEADER_BYTES + length as usize;
                if b.len() < total {
                    return None;
                }
                let p = &b[proto::STRUCTURED_HEADER_BYTES..total];
                let cands: Vec<usize> = self.candidates(handle).collect();
                assert!(
                    !cands.is_empty(),
                    "chunk type {kind} for handle {handle:#x}, which no unanswered request carries"
                );
                if !self.interchangeable(&cands) {
                    return None;
                }
                let req = self.reqs[cands[0]];
                match kind {
                    proto::REPLY_TYPE_NONE => {
                        assert_eq!(length, 0, "NBD_REPLY_TYPE_NONE with data");
                        assert!(flags & proto::REPLY_FLAG_DONE != 0, "NONE chunk not final");
                    }
                    proto::REPLY_TYPE_OFFSET_DATA => {
                        assert!(length > 8, "OFFSET_DATA chunk of {length} bytes");
                        assert_eq!(req.command, proto::CMD_READ, "data chunk for {req:?}");
                        let off = be64(p, 0);
                        let end = off + u64::from(length - 8);
                        assert!(
                            off >= req.offset && end <= req.offset + u64::from(req.length),
                            "data chunk {off}..{end} outside {req:?}"
                        );
                    }
                    proto::REPLY_TYPE_ERROR | proto::REPLY_TYPE_ERROR_OFFSET => {
                        assert!(length >= 6, "error chunk of {length} bytes");
                        assert_ne!(be32(p, 0), 0, "error chunk with error 0");
                        let msg = usize::from(be16(p, 4));
                        let tail = if kind == proto::REPLY_TYPE_ERROR {
                            0
                        } else {
                            8
                        };
                        assert_eq!(6 + msg + tail, p.len(), "error chunk length");
                        assert!(
                            std::str::from_utf8(&p[6..6 + msg]).is_ok(),
                            "error message not UTF-8"
                        );
                    }
                    proto::REPLY_TYPE_OFFSET_HOLE => assert_eq!(length, 12, "hole chunk"),
                    proto::REPLY_TYPE_BLOCK_STATUS => {
                        // A context id and at least one (length, flags) pair: only for a
                        // selected context, describing at most the request's range.
                        assert_eq!(
                            req.command,
                            proto::CMD_BLOCK_STATUS,
                            "block status for {req:?}"
                        );
                        assert!(
                            length >= 12 && (length - 4) % 8 == 0,
                            "block status chunk of {length} bytes"
                        );
                        assert!(
                            flags & proto::REPLY_FLAG_DONE != 0,
                            "block status chunk not final"
                        );
                        assert_eq!(Some(be32(p, 0)), self.context, "block status context id");
                        let n = (p.len() - 4) / 8;
                        if req.flags & proto::CMD_FLAG_REQ_ONE != 0 {
                            assert_eq!(n, 1, "REQ_ONE answered with {n} descriptors");
                        }
                        assert!(n <= proto::MAX_BLOCK_DESCRIPTORS, "{n} descriptors");
                        let mut sum = 0u64;
                        for i in 0..n {
                            let (len, st) = (be32(p, 4 + 8 * i), be32(p, 8 + 8 * i));
                            assert!(len > 0, "empty extent");
                            assert!(
                                st == 0 || st == proto::STATE_HOLE | proto::STATE_ZERO,
                                "extent flags {st:#x}"
                            );
                            sum += u64::from(len);
                        }
                        assert!(
                            sum <= u64::from(req.length),
                            "extents of {sum} bytes for {req:?}"
                        );
                    }
                    k => panic!("unknown chunk type {k}"),
                }
                if flags & proto::REPLY_FLAG_DONE != 0 {
                    self.answer(cands[0]);
                }
                Some(total)
            }
            m => panic!("reply with magic {m:#010x}"),
        }
    }

    /// TLS is required and not on: options but STARTTLS and ABORT are refused.
    fn plaintext_refused(&self) -> bool {
        !self.secure
            && matches!(
                self.tls_mode,
                TlsSetting::Require | TlsSetting::RequireClientCert
            )
    }

    /// The TLS rules for the reply `reply` to `opt` (proto.md "TLS support" and
    /// `NBD_OPT_STARTTLS`), a shutting-down server's `NBD_REP_ERR_SHUTDOWN` excepted.
    fn check_tls_reply(&self, opt: Opt, reply: u32) {
        // Option data beyond what the server parses (64 KiB) is skipped unread and answered
        // `NBD_REP_ERR_TOO_BIG` whatever the option and the TLS state: the reply to its
        // framing, which tells a plaintext client nothing.
        if reply == proto::REP_ERR_SHUTDOWN
            || (reply == proto::REP_ERR_TOO_BIG && opt.length > OPTION_PARSE_LIMIT)
        {
            return;
        }
        if opt.option == proto::OPT_STARTTLS {
            let want = if opt.length != 0 || self.secure {
                // Data with the option, or TLS already on.
                proto::REP_ERR_INVALID
            } else if self.tls_mode == TlsSetting::Off {
                proto::REP_ERR_POLICY
            } else {
                proto::REP_ACK
            };
            assert_eq!(
                reply, want,
                "reply {reply:#x} to NBD_OPT_STARTTLS ({} bytes of data, TLS {:?}, on: {})",
                opt.length, self.tls_mode, self.secure
            );
        } else if opt.option != proto::OPT_ABORT && self.plaintext_refused() {
            assert_eq!(
                reply,
                proto::REP_ERR_TLS_REQD,
                "reply {reply:#x} to option {} in the clear with TLS required",
                opt.option
            );
        }
    }

    /// Where the client must stop sending in the clear: the end of the next
    /// `NBD_OPT_STARTTLS` not yet answered (its reply decides whether TLS follows).
    fn starttls_barrier(&mut self) -> Option<usize> {
        if !matches!(self.phase, Phase::Greeting | Phase::Options) || self.secure {
            return None;
        }
        if let Some((j, end)) = self.starttls_next {
            if j >= self.k {
                return Some(end);
            }
            self.starttls_next = None;
        }
        self.starttls_scan = self.starttls_scan.max(self.k);
        while let Some(o) = self.option(self.starttls_scan) {
            let j = self.starttls_scan;
            self.starttls_scan += 1;
            if o.option == proto::OPT_EXPORT_NAME {
                // Options end there.
                break;
            }
            if o.option == proto::OPT_STARTTLS {
                self.starttls_next = Some((j, o.end));
                return Some(o.end);
            }
        }
        None
    }

    /// The server closed: with a clean end, every request sent must have been answered,
    /// and no reply may be cut short.
    fn at_close(&mut self, clean: bool) {
        if self.lost || !clean {
            return;
        }
        assert!(
            self.rx.is_empty(),
            "the server closed inside a reply ({} bytes of it came)",
            self.rx.len()
        );
        if let Some(r) = self
            .reqs
            .iter()
            .find(|r| !r.answered && r.command != proto::CMD_DISC)
        {
            panic!("the server closed without answering {r:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// TLS: the server's `--tls` mode, the test certificates and the client's TLS transport.
// ---------------------------------------------------------------------------------------

/// The server's TLS mode from the TLS byte's bits 0–1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsSetting {
    /// `--tls off`: `NBD_OPT_STARTTLS` is refused with `NBD_REP_ERR_POLICY`.
    Off,
    /// `--tls allow`: plaintext and TLS clients.
    Allow,
    /// `--tls require`: every option but STARTTLS and ABORT refused in the clear.
    Require,
    /// `--tls require --tls-ca`: as `Require`, and the client must present a certificate
    /// of the test CA (it does).
    RequireClientCert,
}

/// The TLS byte (byte 3), decoded (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct TlsSetup {
    /// The server's mode.
    pub mode: TlsSetting,
    /// The client does not wait for the `NBD_OPT_STARTTLS` reply and never starts TLS:
    /// the rest of its stream reaches the server's TLS layer in the clear.
    pub eager: bool,
    /// The client offers TLS 1.2 only (else 1.2 and 1.3, and 1.3 is agreed).
    pub tls12: bool,
    /// The client's ciphertext byte at this offset is flipped (bits 4–7, `k` > 0: offset
    /// 293 × (`k` − 1) + 1, in the handshake for small `k`, in records after it otherwise).
    pub tamper: Option<usize>,
}

impl TlsSetup {
    /// Decodes the TLS byte.
    pub fn from_byte(b: u8) -> Self {
        let k = usize::from(b >> 4);
        Self {
            mode: [
                TlsSetting::Off,
                TlsSetting::Allow,
                TlsSetting::Require,
                TlsSetting::RequireClientCert,
            ][usize::from(b & 3)],
            eager: b & 4 != 0,
            tls12: b & 8 != 0,
            tamper: (k > 0).then(|| 293 * (k - 1) + 1),
        }
    }
}

/// The test certificates and the rustls configurations, made once per process (key
/// generation and certificate signing would otherwise dominate each execution): a CA, a
/// server certificate of it for `localhost`, a client certificate of it. Made with rcgen
/// at run time (no key is checked in); they exist only in this process's memory.
struct Pki {
    /// The server's TLS without and with client certificates required.
    server: ferroraid::nbd::TlsConfig,
    server_mtls: ferroraid::nbd::TlsConfig,
    /// The client's: [with a client certificate][TLS 1.2 only].
    client: [[std::sync::Arc<rustls::ClientConfig>; 2]; 2],
}

fn pki() -> &'static Pki {
    static PKI: std::sync::OnceLock<Pki> = std::sync::OnceLock::new();
    PKI.get_or_init(|| {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, KeyUsagePurpose,
        };
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
        use std::sync::Arc;

        let mut p = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        p.distinguished_name
            .push(DnType::CommonName, "nbd_conn fuzz CA");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key = KeyPair::generate().expect("CA key");
        let ca = p.self_signed(&ca_key).expect("CA certificate");
        let issuer = Issuer::new(p, ca_key);
        let leaf = |name: &str, purpose: ExtendedKeyUsagePurpose| {
            let mut p = CertificateParams::new(vec![name.to_string()]).expect("leaf parameters");
            p.distinguished_name.push(DnType::CommonName, name);
            p.extended_key_usages = vec![purpose];
            let key = KeyPair::generate().expect("leaf key");
            let cert = p.signed_by(&key, &issuer).expect("leaf certificate");
            (
                cert.der().clone(),
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )
        };
        let (server_cert, server_key) = leaf("localhost", ExtendedKeyUsagePurpose::ServerAuth);
        let (client_cert, client_key) = leaf("fuzz client", ExtendedKeyUsagePurpose::ClientAuth);
        let ca_der: CertificateDer<'static> = ca.der().clone();
        let server = |client_ca: Option<Vec<CertificateDer<'static>>>| {
            ferroraid::nbd::TlsConfig::from_der(
                ferroraid::nbd::TlsMode::Require,
                vec![server_cert.clone()],
                server_key.clone_key(),
                client_ca,
            )
            .expect("server TLS configuration")
        };
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca_der.clone()).expect("CA in the client's roots");
        let roots = Arc::new(roots);
        let client = |with_cert: bool, tls12: bool| {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let b = rustls::ClientConfig::builder_with_provider(provider);
            let b = if tls12 {
                b.with_protocol_versions(&[&rustls::version::TLS12])
            } else {
                b.with_safe_default_protocol_versions()
            }
            .expect("client protocol versions")
            .with_root_certificates(Arc::clone(&roots));
            Arc::new(if with_cert {
                b.with_client_auth_cert(vec![client_cert.clone()], client_key.clone_key())
                    .expect("client certificate")
            } else {
                b.with_no_client_auth()
            })
        };
        Pki {
            server: server(None),
            server_mtls: server(Some(vec![ca_der.clone()])),
            client: [
                [client(false, false), client(false, true)],
                [client(true, false), client(true, true)],
            ],
        }
    })
}

/// The server's TLS configuration for `mode` (`None`: no TLS configured, `--tls off`).
fn server_tls(mode: TlsSetting) -> Option<ferroraid::nbd::TlsConfig> {
    let (base, m) = match mode {
        TlsSetting::Off => return None,
        TlsSetting::Allow => (&pki().server, ferroraid::nbd::TlsMode::Allow),
        TlsSetting::Require => (&pki().server, ferroraid::nbd::TlsMode::Require),
        TlsSetting::RequireClientCert => (&pki().server_mtls, ferroraid::nbd::TlsMode::Require),
    };
    let mut c = base.clone();
    c.mode = m;
    Some(c)
}

/// The client's TLS session once `NBD_OPT_STARTTLS` was acknowledged: plaintext from the
/// input goes in, ciphertext waits in `out` for the socket (sent in the input's pieces),
/// the server's ciphertext comes in and its plaintext goes to the checker.
struct ClientTls {
    conn: rustls::ClientConnection,
    /// Ciphertext not yet sent, from `out_at` on.
    out: Vec<u8>,
    out_at: usize,
    /// Ciphertext bytes produced so far (for tampering).
    produced: usize,
    tamper: Option<usize>,
    /// A byte was flipped.
    tampered: bool,
    /// close_notify queued.
    closing: bool,
    /// The session failed on the client's side (an alert from the server, or the
    /// server's records did not verify after tampering): nothing more is checked.
    broken: bool,
}

impl ClientTls {
    fn new(setup: TlsSetup) -> Self {
        let with_cert = setup.mode == TlsSetting::RequireClientCert;
        let cfg =
            std::sync::Arc::clone(&pki().client[usize::from(with_cert)][usize::from(setup.tls12)]);
        let name = rustls::pki_types::ServerName::try_from("localhost").expect("server name");
        Self {
            conn: rustls::ClientConnection::new(cfg, name).expect("client TLS session"),
            out: Vec::new(),
            out_at: 0,
            produced: 0,
            tamper: setup.tamper,
            tampered: false,
            closing: false,
            broken: false,
        }
    }

    /// Moves what rustls has for the socket into `out` (flipping the tampered byte).
    fn collect(&mut self) {
        if self.out_at == self.out.len() {
            self.out.clear();
            self.out_at = 0;
        }
        while self.conn.wants_write() {
            let start = self.out.len();
            match self.conn.write_tls(&mut self.out) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if let Some(t) = self.tamper {
                        if (self.produced..self.produced + n).contains(&t) {
                            self.out[start + t - self.produced] ^= 0x5a;
                            self.tampered = true;
                        }
                    }
                    self.produced += n;
                }
            }
        }
    }

    /// Ciphertext is waiting for the socket.
    fn pending(&self) -> bool {
        self.out_at < self.out.len()
    }

    /// Takes the server's ciphertext `raw` and feeds its plaintext to `check`. `Err`: the
    /// session failed (the caller decides whether that breaks a rule).
    fn receive(&mut self, mut raw: &[u8], check: &mut Checker<'_>) -> Result<(), rustls::Error> {
        let mut plain = [0u8; 16 << 10];
        let mut stalled = false;
        while !raw.is_empty() && !self.broken {
            let before = raw.len();
            // An error: rustls' buffer is full of records not yet processed (done below).
            let _ = self.conn.read_tls(&mut raw);
            if raw.len() == before {
                if stalled {
                    // rustls takes nothing more (after the server's close_notify).
                    break;
                }
                stalled = true;
            } else {
                stalled = false;
            }
            if let Err(e) = self.conn.process_new_packets() {
                self.broken = true;
                return Err(e);
            }
            loop {
                match self.conn.reader().read(&mut plain) {
                    Ok(0) => break,
                    Ok(n) => check.feed(&plain[..n]),
                    Err(_) => break,
                }
            }
        }
        // Handshake messages and alerts rustls owes the server.
        self.collect();
        Ok(())
    }
}

/// The server's bytes `raw` reached the client: through its TLS session once one is up,
/// else to the checker directly, switching to TLS after the `NBD_OPT_STARTTLS`
/// acknowledgement (the bytes after it in `raw` are the server's first TLS bytes).
fn receive(
    check: &mut Checker<'_>,
    tls: &mut Option<ClientTls>,
    setup: TlsSetup,
    ended: bool,
    raw: &[u8],
) {
    let rest = match tls.as_mut() {
        Some(t) => {
            let r = t.receive(raw, check);
            tls_failed(t, r);
            return;
        }
        None => {
            check.feed(raw);
            if !std::mem::take(&mut check.starttls_ack) {
                return;
            }
            std::mem::take(&mut check.rx)
        }
    };
    if setup.eager || ended {
        check.tls_lost = true;
        return;
    }
    let t = tls.insert(ClientTls::new(setup));
    t.collect();
    if !rest.is_empty() {
        let r = t.receive(&rest, check);
        tls_failed(t, r);
    }
}

/// A TLS failure on the client's side is the server's fault unless the client tampered
/// with its own records (the server's alert then ends the session).
fn tls_failed(t: &ClientTls, r: Result<(), rustls::Error>) {
    if let Err(e) = r {
        assert!(t.tampered, "the server's TLS records failed: {e}");
    }
}
