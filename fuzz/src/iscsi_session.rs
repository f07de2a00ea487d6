//! Whole iSCSI sessions driven in one thread: the stateful fuzz target `iscsi_session`
//! (`fuzz_targets/iscsi_session.rs`) and the seed replay test
//! (`tests/tests/iscsi_session.rs`, which includes this file) both run [`run`].
//!
//! The target is the real one ([`ferroraid::iscsi::local::LocalServer`]: the login state
//! machine a login thread runs — security negotiation with AuthMethod=None or CHAP,
//! operational negotiation, discovery sessions with SendTargets — and the reactor
//! front-end's full-feature phase), its front-end on a reactor that this thread turns
//! ([`engine::reactor::run_local`]) over an in-memory RAID5/RAID6 array (`mem` members).
//! Each initiator connection is one end of a non-blocking Unix socket pair; the input
//! says what the initiators send, when they read, and when they go away.
//!
//! # Input
//! - byte 0, the setup ([`Setup`]): bits 0–1 the array (RAID5 × 3 with 512-byte blocks;
//!   RAID6 × 4; RAID5 × 3 with 4096-byte blocks; RAID6 × 5), bit 2 digests offered
//!   (CRC32C accepted), bits 3–4 CHAP (none; one-way; mutual allowed; mutual required:
//!   [`CHAP_USER`]/[`CHAP_SECRET`], target [`CHAP_TARGET_USER`]/[`CHAP_TARGET_SECRET`]),
//!   bit 5 few, small task buffers (so commands wait for buffers or get TASK SET FULL),
//!   bit 6 a 512-byte MaxRecvDataSegmentLength on the target (else 8192), bit 7 a
//!   4096-byte MaxBurstLength limit (else 64 KiB);
//! - then actions, each an opcode byte whose low 3 bits choose ([`Action`]):
//!   - 0 `send`: a 2-byte big-endian length `n` follows, then `n` bytes (fewer at the
//!     input's end) that the current connection sends (queued; sent as the socket takes
//!     them, in pieces of at most `16 << (op >> 5)` bytes per loop turn for `op >> 5 < 7`,
//!     else whole);
//!   - 1 `wait`: loop turns until nothing moved for two turns in a row (at most
//!     [`WAIT_TURNS`]);
//!   - 2 `half-close`: the current connection shuts down its sending side once its queue
//!     is sent;
//!   - 3 `drop`: the current connection closes its socket now (unsent bytes are lost: a
//!     disconnect at any byte);
//!   - 4 `connect`: a new connection (at most [`MAX_CONNS`] in all) becomes current;
//!   - 5 `select`: connection `(op >> 3) mod count` becomes current;
//!   - 6 `shutdown`: server shutdown requested;
//!   - 7 `stop-reading`: the current connection stops (or, again, resumes) reading what
//!     the target sends (its send buffer fills).
//!
//!   Connection 0 exists from the start. Connection `k` is the server's connection number
//!   `k + 1`, which fixes its CHAP challenge (`ferroraid::iscsi::local`).
//!
//! # What must hold (a panic otherwise)
//! - no panic in the target;
//! - what the target sends parses as iSCSI PDUs with target opcodes, and once a
//!   connection's login negotiated digests, every header and data digest it sends is
//!   right;
//! - bounded work: at most `TURNS_FIXED + TURNS_PER_BYTE` × input bytes loop turns;
//! - no stuck command: once the input is done and every client socket is closed, within
//!   [`CLOSE_TURNS`] loop turns (with no server shutdown) every login ends, the front-end
//!   holds no connection, every buffer is back in its pool, no array request is in flight
//!   and no session stays registered;
//! - then a server shutdown finishes the front-end.

#[path = "harness.rs"]
mod harness;

use std::io::{ErrorKind, Read};
use std::os::unix::net::UnixStream;

use engine::array::ArrayConfig;
use engine::geometry::Level;
use engine::parity::Parity;
use engine::reactor::{run_local, Frontend};
use ferroraid::iscsi::local::{LocalLogin, LocalServer, LoginState};
use ferroraid::iscsi::pdu::{self, op, BHS_BYTES};
use ferroraid::iscsi::{lun_info, ChapConfig, IscsiConfig};
use ferroraid::nbd::BufferClass;

/// Loop turns every session may take, whatever its length.
pub const TURNS_FIXED: u64 = 4_000;
/// Loop turns each input byte may add.
pub const TURNS_PER_BYTE: u64 = 64;
/// Most loop turns of one `wait` action.
pub const WAIT_TURNS: u32 = 48;
/// Loop turns the target gets, after every client closed, to release everything.
pub const CLOSE_TURNS: u32 = 2_048;
/// Most connections an input opens.
pub const MAX_CONNS: usize = 6;
/// The initiator's CHAP name and secret.
pub const CHAP_USER: &str = "fuzz-initiator";
/// See [`CHAP_USER`].
pub const CHAP_SECRET: &str = "initiator-secret";
/// The target's CHAP name and secret (mutual CHAP).
pub const CHAP_TARGET_USER: &str = "fuzz-target";
/// See [`CHAP_TARGET_USER`].
pub const CHAP_TARGET_SECRET: &str = "target-secret-01";
/// Chunk size of the array, bytes.
const CHUNK: u64 = 16 << 10;
/// Stripes of the array.
const STRIPES: u64 = 8;

/// The setup byte, decoded (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    /// 0..4: the array.
    pub array: u8,
    /// CRC32C digests accepted.
    pub digests: bool,
    /// 0 none, 1 one-way, 2 mutual allowed, 3 mutual required.
    pub chap: u8,
    /// Few, small buffers.
    pub small_buffers: bool,
    /// The target's MaxRecvDataSegmentLength is 512 (else 8192).
    pub small_segments: bool,
    /// MaxBurstLength at most 4096 (else 64 KiB).
    pub small_bursts: bool,
}

impl Setup {
    /// Decodes byte 0.
    pub fn from_byte(b: u8) -> Self {
        Self {
            array: b & 3,
            digests: b & 4 != 0,
            chap: (b >> 3) & 3,
            small_buffers: b & 0x20 != 0,
            small_segments: b & 0x40 != 0,
            small_bursts: b & 0x80 != 0,
        }
    }
}

/// What a session showed (for the seed replay test).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Connections handed to the front-end (full-feature phase of a normal session).
    pub full_feature: usize,
    /// Login Responses with status 0 that entered the full-feature phase (normal and
    /// discovery).
    pub logins: usize,
    /// Login Responses with a failure status.
    pub login_failures: usize,
    /// SCSI Responses with status GOOD, and with another status.
    pub scsi_good: usize,
    /// See [`Outcome::scsi_good`].
    pub scsi_other: usize,
    /// Data-In PDUs.
    pub data_in: usize,
    /// R2Ts.
    pub r2t: usize,
    /// Task management responses, NOP-Ins, Text Responses, Logout Responses, Rejects.
    pub tmf: usize,
    /// See [`Outcome::tmf`].
    pub nop_in: usize,
    /// See [`Outcome::tmf`].
    pub text: usize,
    /// See [`Outcome::tmf`].
    pub logout: usize,
    /// See [`Outcome::tmf`].
    pub reject: usize,
    /// SendTargets answers naming the target.
    pub send_targets: usize,
    /// Loop turns taken.
    pub turns: u64,
}

/// One action of the input (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action<'a> {
    /// Bytes to send, and the most bytes per loop turn.
    Send(&'a [u8], usize),
    /// Turn until quiet.
    Wait,
    /// Shut down the sending side.
    HalfClose,
    /// Close the socket.
    Drop,
    /// A new connection.
    Connect,
    /// Make a connection current.
    Select(u8),
    /// Server shutdown.
    Shutdown,
    /// Stop or resume reading.
    ToggleReading,
}

/// Splits the actions off the input after its setup byte.
pub fn actions(mut b: &[u8]) -> Vec<Action<'_>> {
    let mut v = Vec::new();
    while let Some((&op, rest)) = b.split_first() {
        b = rest;
        v.push(match op & 7 {
            0 => {
                let d = harness::take_prefixed(&mut b);
                let piece = match op >> 5 {
                    7 => usize::MAX,
                    k => 16 << k,
                };
                Action::Send(d, piece)
            }
            1 => Action::Wait,
            2 => Action::HalfClose,
            3 => Action::Drop,
            4 => Action::Connect,
            5 => Action::Select(op >> 3),
            6 => Action::Shutdown,
            _ => Action::ToggleReading,
        });
    }
    v
}

/// A parser of what the target sends on one connection.
#[derive(Default)]
struct Parser {
    rx: Vec<u8>,
    header_digest: bool,
    data_digest: bool,
    /// Digests the login negotiated, in force after its last Login Response.
    pending_digests: (bool, bool),
    /// The stream stopped parsing (a login failure's close, or garbage after which
    /// nothing is checked: never happens for a correct target).
    stopped: bool,
}

impl Parser {
    fn feed(&mut self, b: &[u8], o: &mut Outcome) {
        if self.stopped {
            return;
        }
        self.rx.extend_from_slice(b);
        let mut at = 0;
        while self.rx.len() - at >= BHS_BYTES {
            let h = &self.rx[at..];
            let opcode = h[0] & 0x3f;
            let ahs = usize::from(h[4]) * 4;
            let dlen = (usize::from(h[5]) << 16) | (usize::from(h[6]) << 8) | usize::from(h[7]);
            let hd = if self.header_digest { 4 } else { 0 };
            let dd = if self.data_digest && dlen > 0 { 4 } else { 0 };
            let whole = BHS_BYTES + ahs + hd + pdu::pad4(dlen) + dd;
            if h.len() < whole {
                break;
            }
            let h = &h[..whole];
            assert!(
                matches!(
                    opcode,
                    op::NOP_IN
                        | op::SCSI_RESP
                        | op::TMF_RESP
                        | op::LOGIN_RESP
                        | op::TEXT_RESP
                        | op::DATA_IN
                        | op::LOGOUT_RESP
                        | op::R2T
                        | op::REJECT
                ),
                "the target sent opcode {opcode:#04x}"
            );
            if self.header_digest {
                let hl = BHS_BYTES + ahs;
                let got = u32::from_le_bytes(h[hl..hl + 4].try_into().expect("4"));
                assert_eq!(got, pdu::crc32c(&h[..hl]), "wrong header digest sent");
            }
            let data_at = BHS_BYTES + ahs + hd;
            let data = &h[data_at..data_at + dlen];
            if dd > 0 {
                let p = pdu::pad4(dlen);
                let got =
                    u32::from_le_bytes(h[data_at + p..data_at + p + 4].try_into().expect("4"));
                assert_eq!(
                    got,
                    pdu::crc32c(&h[data_at..data_at + p]),
                    "wrong data digest sent"
                );
            }
            match opcode {
                op::LOGIN_RESP => {
                    let status = u16::from_be_bytes([h[36], h[37]]);
                    for kv in data.split(|&c| c == 0) {
                        match kv {
                            b"HeaderDigest=CRC32C" => self.pending_digests.0 = true,
                            b"HeaderDigest=None" => self.pending_digests.0 = false,
                            b"DataDigest=CRC32C" => self.pending_digests.1 = true,
                            b"DataDigest=None" => self.pending_digests.1 = false,
                            _ => {}
                        }
                    }
                    if status != 0 {
                        o.login_failures += 1;
                        self.stopped = true;
                        break;
                    }
                    // T bit and NSG = full feature phase.
                    if h[1] & 0x80 != 0 && h[1] & 3 == 3 {
                        o.logins += 1;
                        (self.header_digest, self.data_digest) = self.pending_digests;
                    }
                }
                op::SCSI_RESP => {
                    if h[3] == 0 && h[2] == 0 {
                        o.scsi_good += 1;
                    } else {
                        o.scsi_other += 1;
                    }
                }
                op::DATA_IN => {
                    o.data_in += 1;
                    // S bit with GOOD status: the command's response.
                    if h[1] & 1 != 0 {
                        if h[3] == 0 {
                            o.scsi_good += 1;
                        } else {
                            o.scsi_other += 1;
                        }
                    }
                }
                op::R2T => o.r2t += 1,
                op::TMF_RESP => o.tmf += 1,
                op::NOP_IN => o.nop_in += 1,
                op::TEXT_RESP => {
                    o.text += 1;
                    if data.starts_with(b"TargetName=iqn.") {
                        o.send_targets += 1;
                    }
                }
                op::LOGOUT_RESP => o.logout += 1,
                _ => o.reject += 1,
            }
            at += whole;
        }
        self.rx.drain(..at);
    }
}

/// One initiator connection.
struct Client {
    sock: Option<UnixStream>,
    login: LocalLogin,
    queue: Vec<u8>,
    sent: usize,
    piece: usize,
    half_close: bool,
    reading: bool,
    eof: bool,
    parser: Parser,
}

impl Client {
    fn new(server: &LocalServer) -> Self {
        let (ours, theirs) = UnixStream::pair().expect("socket pair");
        ours.set_nonblocking(true).expect("non-blocking");
        Self {
            sock: Some(ours),
            login: server.accept(theirs).expect("accept"),
            queue: Vec::new(),
            sent: 0,
            piece: usize::MAX,
            half_close: false,
            reading: true,
            eof: false,
            parser: Parser::default(),
        }
    }

    /// Sends what is queued (a piece), reads what came; true when something moved.
    fn step(&mut self, rbuf: &mut [u8], o: &mut Outcome) -> bool {
        let Some(s) = self.sock.as_ref() else {
            return false;
        };
        let mut moved = false;
        if self.sent < self.queue.len() {
            let end = self.queue.len().min(self.sent.saturating_add(self.piece));
            match harness::send(s, &self.queue[self.sent..end]) {
                Some(n) => {
                    self.sent += n;
                    moved |= n > 0;
                }
                // The target closed: what is left is never sent.
                None => self.sent = self.queue.len(),
            }
        }
        if self.sent == self.queue.len() {
            self.queue.clear();
            self.sent = 0;
            if self.half_close {
                let _ = s.shutdown(std::net::Shutdown::Write);
                self.half_close = false;
                moved = true;
            }
        }
        while self.reading && !self.eof {
            match (&*s).read(rbuf) {
                Ok(0) => {
                    self.eof = true;
                    moved = true;
                }
                Ok(n) => {
                    self.parser.feed(&rbuf[..n], o);
                    moved = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // ECONNRESET: the target closed with our bytes unread.
                Err(_) => self.eof = true,
            }
        }
        moved
    }
}

/// Runs the session of `input` (see the module docs); panics when a rule breaks.
pub fn run(input: &[u8]) -> Outcome {
    let Some((&setup, rest)) = input.split_first() else {
        return Outcome::default();
    };
    let setup = Setup::from_byte(setup);
    let acts = actions(rest);
    let (level, members, block) = match setup.array {
        0 => (Level::Raid5, 3, 512),
        1 => (Level::Raid6, 4, 512),
        2 => (Level::Raid5, 3, 4096),
        _ => (Level::Raid6, 5, 512),
    };
    let (geo, devices) = harness::mem_array(level, members, CHUNK, block, STRIPES);
    let chap = match setup.chap {
        0 => None,
        k => Some(ChapConfig {
            user: CHAP_USER.into(),
            secret: CHAP_SECRET.into(),
            mutual: (k >= 2).then(|| (CHAP_TARGET_USER.into(), CHAP_TARGET_SECRET.into())),
            require_mutual: k == 3,
        }),
    };
    let buffers = if setup.small_buffers {
        vec![
            BufferClass {
                bytes: 4096.max(block),
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
    let config = IscsiConfig {
        chap,
        digests: setup.digests,
        max_recv_data: if setup.small_segments { 512 } else { 8192 },
        max_burst: if setup.small_bursts { 4096 } else { 64 << 10 },
        max_connections: 4,
        buffers,
        max_transfer_bytes: 64 << 10,
        max_connections_per_reactor: 4,
        // No timer may fire: a run must not depend on time.
        nop_interval: std::time::Duration::ZERO,
        stall_timeout: std::time::Duration::from_secs(3600),
        drain_grace: std::time::Duration::from_secs(3600),
        ..IscsiConfig::default()
    };
    let lun = lun_info("fuzz", &geo, [0x5a; 16], &config);
    let (server, frontend) = LocalServer::new(lun, config).expect("server");
    let array_cfg = ArrayConfig {
        requests: 64,
        stripe_ops: 8,
        io_timeout_ns: 0,
        background_ops: 0,
        stripe_cache_entries: 8,
        write_hold_ns: 0,
        ..ArrayConfig::default()
    };
    let budget = TURNS_FIXED + TURNS_PER_BYTE * input.len() as u64;
    let (outcome, _frontend) =
        run_local(&devices, geo, Parity::new(), array_cfg, 64, frontend, |r| {
            let mut o = Outcome::default();
            let mut clients = vec![Client::new(&server)];
            let mut current = 0usize;
            let mut rbuf = vec![0u8; 64 << 10];
            let mut turns = 0u64;
            let mut shutdown = false;
            // One loop turn: the clients, the logins, the reactor.
            let mut turn = |clients: &mut Vec<Client>,
                            r: &mut engine::reactor::LocalReactor<'_, _, _>,
                            o: &mut Outcome|
             -> bool {
                turns += 1;
                assert!(
                    turns <= budget,
                    "hang: {turns} loop turns for {} input bytes",
                    input.len()
                );
                let mut moved = false;
                for c in clients.iter_mut() {
                    moved |= c.step(&mut rbuf, o);
                    let before = c.login.state();
                    let now = c.login.drive(&server);
                    moved |= now != before;
                    if now == LoginState::FullFeature && before != now {
                        o.full_feature += 1;
                    }
                }
                moved |= r.turn();
                moved
            };
            for a in acts {
                match a {
                    Action::Send(d, piece) => {
                        let c = &mut clients[current];
                        c.queue.extend_from_slice(d);
                        c.piece = piece;
                        turn(&mut clients, r, &mut o);
                    }
                    Action::Wait => {
                        harness::turn_until_quiet(WAIT_TURNS, || turn(&mut clients, r, &mut o));
                    }
                    Action::HalfClose => {
                        clients[current].half_close = true;
                        turn(&mut clients, r, &mut o);
                    }
                    Action::Drop => {
                        clients[current].sock = None;
                        turn(&mut clients, r, &mut o);
                    }
                    Action::Connect => {
                        if clients.len() < MAX_CONNS {
                            clients.push(Client::new(&server));
                            current = clients.len() - 1;
                        }
                    }
                    Action::Select(k) => current = usize::from(k) % clients.len(),
                    Action::Shutdown => {
                        if !shutdown {
                            shutdown = true;
                            server.shutdown();
                        }
                    }
                    Action::ToggleReading => {
                        let c = &mut clients[current];
                        c.reading = !c.reading;
                    }
                }
            }
            // Every client goes away: the target must give everything back by itself.
            for c in clients.iter_mut() {
                c.sock = None;
            }
            let mut n = 0u32;
            loop {
                let logins_done = clients.iter().all(|c| {
                    matches!(c.login.state(), LoginState::FullFeature | LoginState::Ended)
                });
                let fe = r.frontend();
                if logins_done
                    && fe.connections() == 0
                    && fe.free_buffers() == fe.buffers()
                    && r.in_flight() == 0
                    && server.sessions() == 0
                {
                    break;
                }
                n += 1;
                assert!(
                    n < CLOSE_TURNS,
                    "stuck after every client closed: {} connection(s), {} of {} buffers free, \
                     {} array request(s) in flight, {} session(s) registered, logins {:?}",
                    fe.connections(),
                    fe.free_buffers(),
                    fe.buffers(),
                    r.in_flight(),
                    server.sessions(),
                    clients.iter().map(|c| c.login.state()).collect::<Vec<_>>()
                );
                for c in clients.iter_mut() {
                    c.login.drive(&server);
                }
                r.turn();
            }
            // Shut down: the front-end finishes.
            server.shutdown();
            let mut m = 0u32;
            while !r.frontend().finished() || r.in_flight() > 0 {
                r.turn();
                m += 1;
                assert!(
                    m < CLOSE_TURNS,
                    "the front-end did not finish after shutdown"
                );
            }
            o.turns = turns + u64::from(n) + u64::from(m);
            o
        })
        .expect("reactor");
    outcome
}
