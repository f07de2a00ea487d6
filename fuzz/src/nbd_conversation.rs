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
//! - the rest: what the client sends, from its handshake flags on: options, then requests
//!   and write payloads. A seed is a valid whole conversation; mutations give options in
//!   any order, unknown ones, bad magic, odd lengths, and truncation ends it at any byte.
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
//! - every request is answered before the server closes, when nothing allowed it to close
//!   early: the client's stream ended at a message boundary (or with `NBD_CMD_DISC`),
//!   with no bad magic and no write payload beyond 2^25 bytes, the client shut down only
//!   its sending side and the server was not asked to shut down;
//! - no hang: at most `TURNS_FIXED + TURNS_PER_BYTE` × input bytes loop turns in all, and
//!   never [`IDLE_TURNS`] turns in a row in which nothing moves before the conversation
//!   is over;
//! - afterwards a server shutdown drains the front-end: no connection, no buffer and no
//!   connection slot is left taken.
//!
//! STARTTLS is not negotiated here yet: [`Setup`] is where a TLS option would go (a bit of
//! byte 0 turning `--tls` on, with the client side doing its TLS handshake after the
//! `NBD_OPT_STARTTLS` acknowledgement through the same piece-wise sender).

use std::io::{ErrorKind, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use drivers::mem::MemDevice;
use engine::array::ArrayConfig;
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use engine::parity::Parity;
use engine::reactor::{run_local, Frontend};
use ferroraid::nbd::local::{HandshakeState, LocalServer};
use ferroraid::nbd::proto;
use ferroraid::nbd::{BufferClass, ExportConfig, ServerConfig};

/// Bytes of the input before the client's stream (setup and fragmentation).
pub const HEADER_BYTES: usize = 3;
/// Loop turns every conversation may take, whatever its length.
pub const TURNS_FIXED: u64 = 2_000;
/// Loop turns each input byte may add.
pub const TURNS_PER_BYTE: u64 = 64;
/// Loop turns in a row without any progress that count as a hang.
pub const IDLE_TURNS: u32 = 256;
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

/// Sends without blocking and without `SIGPIPE` (the fuzzer's process does not ignore
/// it). `None`: the server has closed.
fn send(s: &UnixStream, b: &[u8]) -> Option<usize> {
    // SAFETY: `b` is a valid slice for the call; the descriptor is open (owned by `s`).
    let n = unsafe {
        libc::send(
            s.as_raw_fd(),
            b.as_ptr().cast(),
            b.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if n >= 0 {
        return Some(n as usize);
    }
    match std::io::Error::last_os_error().kind() {
        ErrorKind::WouldBlock | ErrorKind::Interrupted => Some(0),
        _ => None,
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
    let stream = input.get(HEADER_BYTES..).unwrap_or_default();
    let (level, members, block, ops) = match setup.array {
        0 => (Level::Raid5, 3, 512, true),
        1 => (Level::Raid6, 4, 512, true),
        2 => (Level::Raid5, 3, 4096, true),
        _ => (Level::Raid5, 3, 512, false),
    };
    let g = Geometry::new(level, Layout::LeftSymmetric, members, CHUNK, block).expect("geometry");
    let geo = ArrayGeometry::new(g, STRIPES).expect("array geometry");
    let devices: Vec<MemDevice> = (0..members)
        .map(|i| MemDevice::new(&format!("m{i}"), STRIPES * CHUNK, block, 32).expect("mem"))
        .collect();
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
    let (server, frontend) = LocalServer::new(export, config).expect("server");
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
                // The client sends its next piece.
                if let Some(c) = client.as_ref() {
                    if !ended && delivered < stream.len() {
                        if piece_left == 0 {
                            piece_left = pieces.next().min(stream.len() - delivered);
                        }
                        match send(c, &stream[delivered..delivered + piece_left]) {
                            Some(n) => {
                                delivered += n;
                                piece_left -= n;
                                moved |= n > 0;
                            }
                            None => send_failed = true,
                        }
                    }
                }
                check.delivered = delivered;
                if !ended && (delivered == stream.len() || send_failed) {
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
                                check.feed(&rbuf[..n]);
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
                && check.phase == Phase::Transmission
                && matches!(check.stop, Some(Stop::End | Stop::Disc));
            check.at_close(clean);
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
        if self.lost {
            return;
        }
        self.rx.extend_from_slice(b);
        let rx = std::mem::take(&mut self.rx);
        let mut at = 0;
        while !self.lost {
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
                    self.phase = Phase::ExportReply;
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
