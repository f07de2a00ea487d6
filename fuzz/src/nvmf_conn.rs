//! Whole NVMe/TCP connections driven in one thread: the stateful fuzz target `nvmf_conn`
//! (`fuzz_targets/nvmf_conn.rs`) and the seed replay test (`tests/tests/nvmf_conn.rs`,
//! which includes this file) both run [`run`].
//!
//! The target is the real one ([`ferroraid::nvmf::local::LocalServer`]: the reactor
//! front-end that serves every queue pair from ICReq to close — admin queue, discovery
//! controller, I/O queues), on a reactor that this thread turns
//! ([`engine::reactor::run_local`]) over an in-memory RAID5/RAID6 array (`mem` members).
//! Each host connection is one end of a non-blocking Unix socket pair handed to the
//! target as its TCP connection; the input says what each host sends and when it goes
//! away. The driver's host answers every R2T with H2CData itself (the input cannot know
//! the transfer tags), unless the setup says it withholds them.
//!
//! # Input
//! - byte 0, the setup ([`Setup`]): bit 0 the array (RAID5 × 3 with 512-byte blocks, or
//!   RAID6 × 4 with 4096-byte blocks); bit 1 few data buffers (2 per reactor, else 8);
//!   bit 2 the host withholds R2T data (never answers an R2T); bits 3–4 how the hosts end
//!   ([`Ending`]); bit 5 H2CData in 4096-byte PDUs (else up to MAXH2CDATA);
//! - byte 1, the fragmentation seed: 0 sends every queued byte as the socket takes it,
//!   else each send is a piece of `1..=2^(1 + seed % 12)` bytes drawn from a generator
//!   seeded with it;
//! - then actions, each an opcode byte whose low 3 bits choose ([`Action`]):
//!   - 0 `send`: a 2-byte big-endian length `n` follows, then `n` bytes (fewer at the
//!     input's end) that the current connection sends: host PDUs (ICReq, CapsuleCmd,
//!     H2CData, H2CTermReq) or anything else;
//!   - 1 `wait`: loop turns until nothing moved for two turns in a row (at most
//!     [`WAIT_TURNS`]);
//!   - 2 `connect`: a new connection (at most [`MAX_CONNS`]) becomes current;
//!   - 3 `select`: connection `(op >> 3) mod count` becomes current;
//!   - 4 `drop`: the current connection closes its socket now (unsent bytes are lost: a
//!     disconnect at any byte);
//!   - 5 `half-close`: the current connection shuts down its sending side once its
//!     queue is sent;
//!   - 6 `shutdown`: server shutdown requested;
//!   - 7 `settle`: loop turns until the current connection's stream is sent and every
//!     command of it that must be answered is (at most [`SETTLE_TURNS`] plus its unsent
//!     bytes; not an error when
//!     it is not: see the end check). A host waits so for its Connect's answer (the target
//!     has one command context before Connect: a second capsule is a fatal PDU sequence
//!     error). Used before an I/O queue's Connect, which needs the admin queue's CC.EN.
//!
//!   Connection 0 exists from the start. The first controller a run creates gets CNTLID
//!   1, the next 2, …, so an input can name its admin queue's controller in an I/O queue's
//!   Connect.
//!
//! # What must hold (a panic otherwise)
//! - no panic in the target;
//! - everything the target sends parses as controller-to-host PDUs (ICResp first, with
//!   the digests the ICReq asked for; then CapsuleResp, C2HData, R2T, C2HTermReq) with
//!   right header and data digests once negotiated;
//! - every CapsuleResp's CID, every C2HData's and R2T's CCCID is that of a command the
//!   connection sent (whole) and that is not yet completed; C2HData and R2T stay inside
//!   the transfer (SGL length) of a command in progress with that CID (any of them when
//!   the host reused a CID), an R2T asks for at least one byte;
//! - bounded work: at most `TURNS_FIXED + TURNS_PER_BYTE` × input bytes loop turns, plus
//!   one per byte of H2CData the host sent in answer to R2Ts (it may go a byte per turn);
//! - no stuck command: with [`Ending::HalfClose`] and no server shutdown, once the
//!   input is done, every connection whose stream was sent whole, ends at a PDU boundary,
//!   parses as host PDUs, was neither dropped nor half-closed by an action, got no
//!   C2HTermReq and was not closed by the target has, within [`END_TURNS`] loop turns
//!   (plus one per byte the hosts still had to send),
//!   every command answered except the ones that legitimately wait ([`Rec::exempt`]):
//!   Asynchronous Event Requests on an admin queue (held until an event; at most
//!   `AER_LIMIT` of them), commands after a Fabrics Disconnect (the queue stops reading),
//!   and, when the host withholds R2T data, the commands whose R2T it withheld and every
//!   command that needs a pool buffer (buffers are held by the withheld ones);
//! - once every host closed (no shutdown), within [`CLOSE_TURNS`] loop turns the
//!   front-end holds no connection, every pool buffer is free, no array request is in
//!   flight and no controller is registered; then a server shutdown finishes the
//!   front-end.

#[path = "harness.rs"]
mod harness;

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use engine::array::ArrayConfig;
use engine::geometry::Level;
use engine::parity::Parity;
use engine::reactor::{run_local, Frontend};
use ferroraid::nvmf::local::LocalServer;
use ferroraid::nvmf::pdu::{
    check_icresp, Framing, H2cDataHdr, IcReq, Parse, Pdu, PduParser, RecvLimits, Role, SglKind,
};
use ferroraid::nvmf::spec::{admin, fctype, Subsystem, ADMIN_IN_CAPSULE, AER_LIMIT, MAX_TRANSFER};
use ferroraid::nvmf::NvmfConfig;

/// Loop turns every run may take, whatever its length.
pub const TURNS_FIXED: u64 = 6_000;
/// Loop turns each input byte may add.
pub const TURNS_PER_BYTE: u64 = 64;
/// Most loop turns of one `wait` action.
pub const WAIT_TURNS: u32 = 48;
/// Most loop turns of one `settle` action.
pub const SETTLE_TURNS: u32 = 256;
/// Loop turns the target gets at the end to answer every command that must be.
pub const END_TURNS: u32 = 1_024;
/// Loop turns the target gets, after every host closed, to release everything.
pub const CLOSE_TURNS: u32 = 2_048;
/// Most connections an input opens.
pub const MAX_CONNS: usize = 4;
/// Chunk size of the array, bytes.
const CHUNK: u64 = 16 << 10;
/// Stripes of the array.
const STRIPES: u64 = 8;
/// Transfers above this need a pool buffer (the front-end's per-command buffer).
const SMALL: u32 = 4096;

/// How the hosts end once the input is done (setup bits 3–4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Every host waits for its answers (the no-stuck-command check), then shuts down its
    /// sending side.
    HalfClose,
    /// Every host closes its socket at once (bytes still queued are lost).
    Drop,
    /// Server shutdown with whatever is in progress, then the hosts close.
    Shutdown,
    /// Every host shuts down its sending side at once, without waiting.
    HalfCloseNow,
}

/// The setup byte, decoded (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    /// RAID6 × 4 with 4096-byte blocks (else RAID5 × 3 with 512-byte blocks).
    pub raid6_4k: bool,
    /// 2 pool buffers (else 8).
    pub small_buffers: bool,
    /// The host never answers an R2T.
    pub withhold: bool,
    /// How the hosts end.
    pub ending: Ending,
    /// H2CData PDUs of at most 4096 bytes.
    pub small_h2c: bool,
}

impl Setup {
    /// Decodes byte 0.
    pub fn from_byte(b: u8) -> Self {
        Self {
            raid6_4k: b & 1 != 0,
            small_buffers: b & 2 != 0,
            withhold: b & 4 != 0,
            ending: match (b >> 3) & 3 {
                0 => Ending::HalfClose,
                1 => Ending::Drop,
                2 => Ending::Shutdown,
                _ => Ending::HalfCloseNow,
            },
            small_h2c: b & 0x20 != 0,
        }
    }
}

/// What a run showed (for the seed replay test).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// ICResps received.
    pub icresp: usize,
    /// ICResps with header (data) digests on.
    pub hdgst: usize,
    /// See [`Outcome::hdgst`].
    pub ddgst: usize,
    /// Successful Fabrics Connects (admin and I/O queues).
    pub connects: usize,
    /// CapsuleResps with status 0, and with another status.
    pub ok: usize,
    /// See [`Outcome::ok`].
    pub errors: usize,
    /// Successful I/O commands (Read, Write, Flush, Write Zeroes, DSM, Compare) on an
    /// I/O queue.
    pub io_ok: usize,
    /// C2HData PDUs.
    pub c2h_data: usize,
    /// R2Ts received, and H2CData PDUs sent in answer.
    pub r2t: usize,
    /// See [`Outcome::r2t`].
    pub h2c_data: usize,
    /// Bytes of those H2CData PDUs.
    pub h2c_bytes: u64,
    /// C2HTermReqs received.
    pub term: usize,
    /// Connections on which the no-stuck-command check ran.
    pub checked: usize,
    /// AERs held at the end of a checked connection.
    pub aers_held: usize,
    /// Loop turns taken.
    pub turns: u64,
}

/// One action of the input (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action<'a> {
    /// Bytes to send.
    Send(&'a [u8]),
    /// Turn until quiet.
    Wait,
    /// A new connection.
    Connect,
    /// Make a connection current.
    Select(u8),
    /// Close the socket.
    Drop,
    /// Shut down the sending side.
    HalfClose,
    /// Server shutdown.
    Shutdown,
    /// Turn until the current connection's commands are answered.
    Settle,
}

/// Splits the actions off the input after its two setup bytes.
pub fn actions(mut b: &[u8]) -> Vec<Action<'_>> {
    let mut v = Vec::new();
    while let Some((&op, rest)) = b.split_first() {
        b = rest;
        v.push(match op & 7 {
            0 => {
                let d = harness::take_prefixed(&mut b);
                Action::Send(d)
            }
            1 => Action::Wait,
            2 => Action::Connect,
            3 => Action::Select(op >> 3),
            4 => Action::Drop,
            5 => Action::HalfClose,
            6 => Action::Shutdown,
            _ => Action::Settle,
        });
    }
    v
}

/// A command the host sent, as the checker sees it.
#[derive(Debug, Clone, Copy)]
struct Rec {
    /// FCTYPE of a Fabrics command.
    fctype: Option<u8>,
    /// Bytes of the transfer (SGL1 length).
    len: u32,
    /// Sent on an I/O queue (the connection's Connect asked for QID > 0).
    io_queue: bool,
    /// An AER on an admin queue: held by the target until an event.
    aer: bool,
    /// Follows a Fabrics Disconnect on its queue: never read.
    after_disconnect: bool,
    /// An R2T for it came and the host withheld the data.
    withheld: bool,
}

impl Rec {
    /// Whether the command may legitimately stay unanswered while its connection is
    /// open (see the module docs); `withholding`: some R2T's data is withheld anywhere.
    fn exempt(&self, withholding: bool) -> bool {
        self.aer || self.after_disconnect || self.withheld || (withholding && self.len > SMALL)
    }
}

/// A PDU boundary of the host's stream and the command that ends there, if any.
struct Boundary {
    end: usize,
    cmd: Option<(u16, Rec)>,
}

/// One host connection.
struct Host {
    sock: Option<UnixStream>,
    /// Everything queued for sending (never cleared: offsets are absolute).
    stream: Vec<u8>,
    sent: usize,
    /// The host's stream as the target parses it (a controller-side parser), run as
    /// bytes are queued.
    mirror: PduParser,
    parsed: usize,
    /// The mirror failed: nothing after `parsed` is a command.
    malformed: bool,
    boundaries: VecDeque<Boundary>,
    /// The stream's last PDU boundary that has been sent.
    at_boundary: bool,
    icreq: Option<IcReq>,
    /// QID of this queue's Connect (from the stream).
    qid: Option<u16>,
    disconnect: bool,
    /// H2CData PDUs to send (whole), and bytes of the front one sent.
    answers: VecDeque<Vec<u8>>,
    answer_sent: usize,
    half_close: bool,
    /// An action dropped or half-closed it.
    ended_by_input: bool,
    eof: bool,
    /// Commands sent and not completed, by CID (oldest first).
    outstanding: HashMap<u16, Vec<Rec>>,
    /// The target's stream.
    rx: Vec<u8>,
    parser: PduParser,
    tx_framing: Framing,
    maxh2cdata: u32,
    term: bool,
    withhold: bool,
    small_h2c: bool,
}

impl Host {
    fn new(server: &LocalServer, setup: &Setup) -> Self {
        let (ours, theirs) = UnixStream::pair().expect("socket pair");
        ours.set_nonblocking(true).expect("non-blocking");
        server.accept(theirs).expect("accept");
        let limits = RecvLimits {
            max_in_capsule: ADMIN_IN_CAPSULE,
            max_data_pdu: MAX_TRANSFER,
        };
        Self {
            sock: Some(ours),
            stream: Vec::new(),
            sent: 0,
            mirror: PduParser::new(Role::Controller, limits),
            parsed: 0,
            malformed: false,
            boundaries: VecDeque::new(),
            at_boundary: true,
            icreq: None,
            qid: None,
            disconnect: false,
            answers: VecDeque::new(),
            answer_sent: 0,
            half_close: false,
            ended_by_input: false,
            eof: false,
            outstanding: HashMap::new(),
            rx: Vec::new(),
            parser: PduParser::new(
                Role::Host,
                RecvLimits {
                    max_in_capsule: 0,
                    max_data_pdu: MAX_TRANSFER,
                },
            ),
            tx_framing: Framing::default(),
            maxh2cdata: MAX_TRANSFER,
            term: false,
            withhold: setup.withhold,
            small_h2c: setup.small_h2c,
        }
    }

    /// Queues bytes and runs the mirror over what is complete.
    fn queue(&mut self, b: &[u8]) {
        self.stream.extend_from_slice(b);
        let stream = std::mem::take(&mut self.stream);
        while !self.malformed {
            match self.mirror.parse(&stream[self.parsed..]) {
                Ok(Parse::Pdu(r)) => {
                    let cmd = self.mirrored(&r.pdu);
                    self.parsed += r.len;
                    self.boundaries.push_back(Boundary {
                        end: self.parsed,
                        cmd,
                    });
                }
                Ok(Parse::Need(_)) => break,
                Err(_) => self.malformed = true,
            }
        }
        self.stream = stream;
    }

    /// What one host PDU means to the checker.
    fn mirrored(&mut self, p: &Pdu<'_>) -> Option<(u16, Rec)> {
        match *p {
            Pdu::IcReq(req) => {
                self.icreq = Some(req);
                self.mirror.set_framing(Framing {
                    hdgst: req.hdgst_enable,
                    ddgst: req.ddgst_enable,
                    pda: 0,
                });
                None
            }
            Pdu::CapsuleCmd { sqe, .. } => {
                let fabrics = sqe.opcode == admin::FABRICS;
                let fct = fabrics.then_some(sqe.nsid as u8);
                if fct == Some(fctype::CONNECT) && self.qid.is_none() {
                    self.qid = Some((sqe.cdw10 >> 16) as u16);
                }
                let io_queue = self.qid.is_some_and(|q| q > 0);
                let len = match sqe.dptr.kind() {
                    SglKind::InCapsule | SglKind::Transport => sqe.dptr.length,
                    SglKind::Other(_) => 0,
                };
                let rec = Rec {
                    fctype: fct,
                    len,
                    io_queue,
                    aer: !fabrics && sqe.opcode == admin::AER && self.qid == Some(0),
                    after_disconnect: self.disconnect,
                    withheld: false,
                };
                if fct == Some(fctype::DISCONNECT) {
                    self.disconnect = true;
                }
                Some((sqe.cid, rec))
            }
            _ => None,
        }
    }

    /// Whether the stream was sent whole, ends at a PDU boundary and parses.
    fn clean(&self) -> bool {
        !self.malformed && self.sent == self.stream.len() && self.parsed == self.stream.len()
    }

    /// Sends what is queued (answers at PDU boundaries of the stream), reads and checks
    /// what came; true when something moved.
    fn step(&mut self, rbuf: &mut [u8], pieces: &mut Pieces, o: &mut Outcome) -> bool {
        let Some(s) = self.sock.take() else {
            return false;
        };
        let mut moved = false;
        loop {
            let (buf, answer) =
                if !self.answers.is_empty() && (self.at_boundary || self.answer_sent > 0) {
                    (&self.answers[0][self.answer_sent..], true)
                } else if self.sent < self.stream.len() {
                    (&self.stream[self.sent..], false)
                } else {
                    break;
                };
            let n = buf.len().min(pieces.next());
            let Some(k) = harness::send(&s, &buf[..n]) else {
                // The target closed: nothing more goes out.
                self.sent = self.stream.len();
                self.answers.clear();
                self.answer_sent = 0;
                break;
            };
            if k == 0 {
                break;
            }
            moved = true;
            if answer {
                self.answer_sent += k;
                if self.answer_sent == self.answers[0].len() {
                    self.answers.pop_front();
                    self.answer_sent = 0;
                }
            } else {
                self.sent += k;
                self.at_boundary = false;
                while let Some(b) = self.boundaries.front() {
                    if b.end > self.sent {
                        break;
                    }
                    self.at_boundary = b.end == self.sent;
                    if let Some((cid, rec)) = self.boundaries.pop_front().and_then(|b| b.cmd) {
                        self.outstanding.entry(cid).or_default().push(rec);
                    }
                }
            }
            if pieces.fragmenting() {
                break;
            }
        }
        if self.half_close && self.sent == self.stream.len() && self.answers.is_empty() {
            let _ = s.shutdown(std::net::Shutdown::Write);
            self.half_close = false;
            moved = true;
        }
        while !self.eof {
            match (&s).read(rbuf) {
                Ok(0) => {
                    self.eof = true;
                    moved = true;
                }
                Ok(n) => {
                    self.rx.extend_from_slice(&rbuf[..n]);
                    self.take(o);
                    moved = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // ECONNRESET: the target closed with our bytes unread.
                Err(_) => self.eof = true,
            }
        }
        self.sock = Some(s);
        moved
    }

    /// The commands in progress with CID `cid` (more than one when the host reused it),
    /// oldest first, or a panic.
    fn cmds(&mut self, cid: u16, what: &str) -> &mut Vec<Rec> {
        self.outstanding
            .get_mut(&cid)
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| panic!("{what} for CID {cid:#x}, not a command in progress"))
    }

    /// The first command in progress with CID `cid` whose transfer reaches byte `end`,
    /// or a panic.
    fn within(&mut self, cid: u16, end: u64, what: &str) -> &mut Rec {
        let v = self.cmds(cid, what);
        let longest = v.iter().map(|r| r.len).max().unwrap_or(0);
        v.iter_mut()
            .find(|r| end <= u64::from(r.len))
            .unwrap_or_else(|| {
                panic!("{what} of CID {cid:#x} up to byte {end}, past its {longest}-byte transfer")
            })
    }

    /// Parses and checks what the target sent.
    fn take(&mut self, o: &mut Outcome) {
        let mut at = 0;
        let mut rx = std::mem::take(&mut self.rx);
        while !self.term {
            let r = match self.parser.parse(&rx[at..]) {
                Ok(Parse::Pdu(r)) => r,
                Ok(Parse::Need(_)) => break,
                Err(e) => panic!("the target sent an unparseable PDU: {e}"),
            };
            assert!(r.data_digest_ok, "the target sent a wrong data digest");
            let len = r.len;
            match r.pdu {
                Pdu::IcResp(resp) => {
                    o.icresp += 1;
                    let req = self.icreq.expect("an ICResp without an ICReq");
                    check_icresp(&req, &resp).expect("an ICResp the host accepts");
                    o.hdgst += usize::from(resp.hdgst_enable);
                    o.ddgst += usize::from(resp.ddgst_enable);
                    self.parser.set_framing(Framing {
                        hdgst: resp.hdgst_enable,
                        ddgst: resp.ddgst_enable,
                        pda: req.hpda,
                    });
                    self.tx_framing = Framing {
                        hdgst: resp.hdgst_enable,
                        ddgst: resp.ddgst_enable,
                        pda: resp.cpda,
                    };
                    self.maxh2cdata = resp.maxh2cdata;
                }
                Pdu::CapsuleResp(cqe) => {
                    let v = self
                        .outstanding
                        .get_mut(&cqe.cid)
                        .filter(|v| !v.is_empty())
                        .unwrap_or_else(|| {
                            panic!(
                                "a completion for CID {:#x}, not a command in progress",
                                cqe.cid
                            )
                        });
                    let rec = v.remove(0);
                    if v.is_empty() {
                        self.outstanding.remove(&cqe.cid);
                    }
                    if cqe.status >> 1 == 0 {
                        o.ok += 1;
                        if rec.fctype == Some(fctype::CONNECT) {
                            o.connects += 1;
                        } else if rec.io_queue && rec.fctype.is_none() {
                            o.io_ok += 1;
                        }
                    } else {
                        o.errors += 1;
                    }
                }
                Pdu::C2hData { hdr, data } => {
                    o.c2h_data += 1;
                    let end = u64::from(hdr.datao) + data.len() as u64;
                    self.within(hdr.cccid, end, "C2HData");
                    if hdr.last && hdr.success {
                        // SUCCESS: no CapsuleResp follows (TCP 1.0 §3.6.2.9).
                        let v = self.outstanding.get_mut(&hdr.cccid).expect("checked");
                        v.remove(0);
                        if v.is_empty() {
                            self.outstanding.remove(&hdr.cccid);
                        }
                        o.ok += 1;
                    }
                }
                Pdu::R2t(t) => {
                    o.r2t += 1;
                    let withhold = self.withhold;
                    assert!(t.r2tl > 0, "an R2T of no bytes");
                    let end = u64::from(t.r2to) + u64::from(t.r2tl);
                    let rec = self.within(t.cccid, end, "R2T");
                    if withhold {
                        rec.withheld = true;
                    } else {
                        self.answer(t.cccid, t.ttag, t.r2to, t.r2tl, o);
                    }
                }
                Pdu::C2hTermReq(t) => {
                    if std::env::var_os("NVMF_CONN_DEBUG").is_some() {
                        eprintln!("C2HTermReq FES {:#x} FEI {}", t.fes, t.fei);
                    }
                    o.term += 1;
                    self.term = true;
                }
                p => panic!("the target sent a host PDU: {:?}", p.pdu_type()),
            }
            at += len;
        }
        rx.drain(..at);
        self.rx = rx;
    }

    /// Queues the H2CData PDUs that answer an R2T (pattern data).
    fn answer(&mut self, cccid: u16, ttag: u16, r2to: u32, r2tl: u32, o: &mut Outcome) {
        let piece = if self.small_h2c {
            4096
        } else {
            self.maxh2cdata.max(4096)
        };
        let mut off = 0;
        while off < r2tl {
            let n = piece.min(r2tl - off);
            let data: Vec<u8> = (0..n).map(|i| (r2to + off + i) as u8 ^ 0xa5).collect();
            let hdr = H2cDataHdr {
                cccid,
                ttag,
                datao: r2to + off,
                last: off + n == r2tl,
            };
            let p = Pdu::H2cData { hdr, data: &data };
            let mut out = vec![0u8; p.encoded_len(&self.tx_framing)];
            let k = p
                .encode(&self.tx_framing, &mut out)
                .expect("H2CData encodes");
            out.truncate(k);
            o.h2c_bytes += out.len() as u64;
            self.answers.push_back(out);
            o.h2c_data += 1;
            off += n;
        }
    }

    /// Commands that must still be answered.
    fn owed(&self, withholding: bool) -> usize {
        self.outstanding
            .values()
            .flatten()
            .filter(|r| !r.exempt(withholding))
            .count()
    }
}

/// Piece sizes of the hosts' sends (byte 1 of the input).
struct Pieces {
    state: u32,
    max: usize,
}

impl Pieces {
    fn new(seed: u8) -> Self {
        Self {
            state: u32::from(seed) | 0x100,
            max: if seed == 0 {
                usize::MAX
            } else {
                2 << (seed % 12)
            },
        }
    }

    fn fragmenting(&self) -> bool {
        self.max != usize::MAX
    }

    /// The next piece's most bytes.
    fn next(&mut self) -> usize {
        if !self.fragmenting() {
            return usize::MAX;
        }
        self.state = self.state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        1 + (self.state >> 8) as usize % self.max
    }
}

/// Runs the conversation of `input` (see the module docs); panics when a rule breaks.
pub fn run(input: &[u8]) -> Outcome {
    let [setup, seed, rest @ ..] = input else {
        return Outcome::default();
    };
    let setup = Setup::from_byte(*setup);
    let acts = actions(rest);
    let (level, members, block) = if setup.raid6_4k {
        (Level::Raid6, 4, 4096)
    } else {
        (Level::Raid5, 3, 512)
    };
    let (geo, devices) = harness::mem_array(level, members, CHUNK, block, STRIPES);
    let buffers: u16 = if setup.small_buffers { 2 } else { 8 };
    let config = NvmfConfig {
        max_connections_per_reactor: MAX_CONNS,
        buffers_per_reactor: buffers,
        // No timer may fire: a run must not depend on time.
        discovery_idle: Duration::from_secs(3600),
        connect_timeout: Duration::from_secs(3600),
    };
    let sub = Subsystem::for_array("fuzz", [0x5a; 16], &geo);
    let (server, frontend) = LocalServer::new(sub, config).expect("server");
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
            let mut hosts = vec![Host::new(&server, &setup)];
            let mut current = 0usize;
            let mut rbuf = vec![0u8; 64 << 10];
            let mut pieces = Pieces::new(*seed);
            let mut turns = 0u64;
            let mut shutdown = false;
            // One loop turn: the hosts, then the reactor.
            let mut turn = |hosts: &mut Vec<Host>,
                            r: &mut engine::reactor::LocalReactor<'_, _, _>,
                            o: &mut Outcome|
             -> bool {
                turns += 1;
                // A host's H2CData may go a byte per turn.
                assert!(
                    turns <= budget + o.h2c_bytes,
                    "hang: {turns} loop turns for {} input bytes and {} bytes of H2CData",
                    input.len(),
                    o.h2c_bytes
                );
                let mut moved = false;
                for h in hosts.iter_mut() {
                    moved |= h.step(&mut rbuf, &mut pieces, o);
                }
                moved |= r.turn();
                moved
            };
            let withholding = |hosts: &Vec<Host>| {
                hosts
                    .iter()
                    .any(|h| h.outstanding.values().flatten().any(|r| r.withheld))
            };
            for a in acts {
                match a {
                    Action::Send(d) => {
                        hosts[current].queue(d);
                        turn(&mut hosts, r, &mut o);
                    }
                    Action::Wait => {
                        harness::turn_until_quiet(WAIT_TURNS, || turn(&mut hosts, r, &mut o));
                    }
                    Action::Connect => {
                        if hosts.len() < MAX_CONNS {
                            hosts.push(Host::new(&server, &setup));
                            current = hosts.len() - 1;
                        }
                    }
                    Action::Select(k) => current = usize::from(k) % hosts.len(),
                    Action::Drop => {
                        let h = &mut hosts[current];
                        h.sock = None;
                        h.ended_by_input = true;
                        turn(&mut hosts, r, &mut o);
                    }
                    Action::HalfClose => {
                        let h = &mut hosts[current];
                        h.half_close = true;
                        h.ended_by_input = true;
                        turn(&mut hosts, r, &mut o);
                    }
                    Action::Shutdown => {
                        if !shutdown {
                            shutdown = true;
                            server.shutdown();
                        }
                    }
                    Action::Settle => {
                        // Each turn sends at least a byte unless the socket is full.
                        let h = &hosts[current];
                        let most = SETTLE_TURNS as usize + (h.stream.len() - h.sent);
                        for _ in 0..most {
                            let w = withholding(&hosts);
                            let h = &hosts[current];
                            if h.sock.is_none()
                                || h.eof
                                || h.sent == h.stream.len()
                                    && h.owed(w) == 0
                                    && h.answers.is_empty()
                            {
                                break;
                            }
                            turn(&mut hosts, r, &mut o);
                        }
                    }
                }
            }
            match setup.ending {
                Ending::HalfClose if !shutdown => {
                    // No stuck command: every connection that must answer everything does.
                    let must = |h: &Host| {
                        h.sock.is_some() && !h.ended_by_input && !h.term && !h.eof && h.clean()
                    };
                    // Each turn sends at least a byte of what is queued.
                    let queued: u64 = hosts
                        .iter()
                        .map(|h| {
                            (h.stream.len() - h.sent) as u64
                                + h.answers.iter().map(|a| a.len() as u64).sum::<u64>()
                        })
                        .sum();
                    let h2c_before = o.h2c_bytes;
                    let mut n = 0u64;
                    loop {
                        let w = withholding(&hosts);
                        let owed: Vec<usize> = hosts
                            .iter()
                            .map(|h| if must(h) { h.owed(w) } else { 0 })
                            .collect();
                        if owed.iter().all(|&k| k == 0) {
                            break;
                        }
                        n += 1;
                        assert!(
                            n < u64::from(END_TURNS) + queued + (o.h2c_bytes - h2c_before),
                            "stuck commands: {owed:?} per connection still unanswered: {:?}",
                            hosts
                                .iter()
                                .map(|h| h.outstanding.clone())
                                .collect::<Vec<_>>()
                        );
                        turn(&mut hosts, r, &mut o);
                    }
                    for h in &hosts {
                        if must(h) {
                            o.checked += 1;
                            let aers = h.outstanding.values().flatten().filter(|r| r.aer).count();
                            assert!(aers <= AER_LIMIT, "{aers} AERs held, more than {AER_LIMIT}");
                            o.aers_held += aers;
                        }
                    }
                    for h in hosts.iter_mut() {
                        h.half_close = true;
                    }
                }
                Ending::HalfClose | Ending::HalfCloseNow => {
                    for h in hosts.iter_mut() {
                        h.half_close = true;
                    }
                }
                Ending::Drop => {
                    for h in hosts.iter_mut() {
                        h.sock = None;
                    }
                }
                Ending::Shutdown => {
                    server.shutdown();
                }
            }
            // Let the ending play out, then every host goes away.
            harness::turn_until_quiet(WAIT_TURNS, || turn(&mut hosts, r, &mut o));
            for h in hosts.iter_mut() {
                h.sock = None;
            }
            let total = usize::from(buffers);
            let mut n = 0u32;
            loop {
                let fe = r.frontend();
                if fe.connections() == 0
                    && fe.free_buffers() == total
                    && r.in_flight() == 0
                    && server.controllers() == 0
                {
                    break;
                }
                n += 1;
                assert!(
                    n < CLOSE_TURNS,
                    "stuck after every host closed: {} connection(s), {} of {total} buffers \
                     free, {} array request(s) in flight, {} controller(s) registered",
                    fe.connections(),
                    fe.free_buffers(),
                    r.in_flight(),
                    server.controllers(),
                );
                r.turn();
            }
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
            assert_eq!(server.controllers(), 0, "controllers left after shutdown");
            o.turns = turns + u64::from(n) + u64::from(m);
            o
        })
        .expect("reactor");
    outcome
}
