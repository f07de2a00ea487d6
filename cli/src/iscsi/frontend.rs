//! The iSCSI front-end of one reactor: connections in the full-feature phase (RFC 7143
//! §4.2), their sessions, and the SCSI tasks they carry, driven from the reactor loop.
//!
//! Each loop turn ([`IscsiFrontend::poll`]) the front-end adopts connections the login
//! threads finished, retries array submissions the reactor refused (`QueueFull`), and for
//! every connection sends what is staged, reads and acts on whole PDUs, and stages the
//! replies. A SCSI command becomes a *task* with one pool buffer for its whole life: data-out
//! (immediate, unsolicited, R2T-solicited) is gathered into it, the array reads into it,
//! data-in is sent from it.
//!
//! # Limits and memory
//! Tasks and buffers are allocated when the front-end is built; a connection's receive and
//! send buffers by its login thread. Replies are staged (copied) into the connection's
//! fixed send buffer; a connection whose send buffer lacks room for the largest reply it
//! could produce stops reading until it drains, and one that finds no free task or buffer
//! leaves the command in its receive buffer until one frees. Commands are windowed per
//! session ([`CMD_WINDOW`] CmdSNs, §4.2.2.1).
//!
//! # Error recovery level 0
//! A header digest error, a data segment beyond MaxRecvDataSegmentLength, or Data-Out at
//! an offset out of order or beyond what was solicited drops the connection (its tasks are
//! terminated, §7.1.4.1). A data digest error on a command or Data-Out is answered with a
//! Reject (reason "data digest error", §7.8) and the PDU is discarded; the task then gets
//! CHECK CONDITION once its data is complete or it is aborted. A Data-Out whose DataSN is
//! not the one expected means an earlier Data-Out was lost to a digest error the target
//! did not see (§7.9, "sequence errors"), handled as §7.8 says for ERL 0: the PDU's data
//! is discarded and the task ends with CHECK CONDITION, ABORTED COMMAND / PROTOCOL SERVICE
//! CRC ERROR, once its current data sequence is over — the connection stays up. An unknown
//! opcode gets Reject "command not supported". A non-immediate command outside the CmdSN
//! window is silently ignored, as §4.2.2.1 requires.
//!
//! # Ending a connection
//! A connection ended gracefully (a logout, or a shutdown once its tasks are answered)
//! shuts down its sending side once every reply is sent, then lingers: it discards what
//! the initiator still sends until the initiator closes its side (at most [`LINGER`]), so
//! the initiator reads every reply and then the end of stream, never a reset. Errors (a
//! digest or framing error, a stall, an unanswered NOP-In), a reinstated session and an
//! expired drain grace period close at once.

use std::collections::VecDeque;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crossbeam_queue::ArrayQueue;
use engine::array::{ArrayCompletion, ArrayError, ArrayOp, ArrayRequest};
use engine::device::{Channel, IoBuf};
use engine::reactor::{pop_if_any, Frontend, Io};
use tracing::{debug, info, warn};

use super::login::{NewConn, SessionParams};
use super::pdu::{self, op, Bhs, Framing, Header, BHS_BYTES};
use super::pr::{Nexus, Outcome, Verdict, View};
use super::scsi::{self, status, Plan, Sense};
use super::xcopy::{self, CopyResult, CopyState, ListIdUsage};
use super::{text, Shared};
use crate::nbd::conn::{discard_unread, Discarded, Stream, LINGER};
use crate::nbd::pool::{BufId, BufPool};

/// CmdSNs a session may have beyond ExpCmdSN (MaxCmdSN = ExpCmdSN + CMD_WINDOW − 1).
pub const CMD_WINDOW: u32 = 64;
/// Most R2Ts outstanding per task (MaxOutstandingR2T is negotiated down to it).
pub const MAX_OUTSTANDING_R2T: u32 = 16;
/// Largest data-in segment sent, bytes (further bounded by the initiator's
/// MaxRecvDataSegmentLength).
const MAX_SEND_SEGMENT: u32 = 64 << 10;
/// Bytes of a connection's send staging buffer: a few whole data-in segments.
pub(crate) const TX_BYTES: usize = 4 * (MAX_SEND_SEGMENT as usize + 128);
/// Free send-buffer bytes a connection needs before it reads another PDU: the largest
/// reply one PDU can produce directly (a NOP-In echo of a full segment, a Reject).
fn tx_reserve(rx: &Framing) -> usize {
    pdu::pdu_bytes(rx.max_recv_data as usize, rx) + 2 * BHS_BYTES + 64
}
/// Tag bit that marks array requests as this front-end's (bit 45; the NBD front-end on the
/// same reactor uses tags below 2^16, the NVMe/TCP one bit 44). Tags below
/// [`engine::reactor::WHOLE_TAG_LIMIT`] let a request inside one stripe travel between
/// reactors without a parent entry.
pub const TAG_BIT: u64 = 1 << 45;
/// Task slots beyond one per buffer: commands that find no buffer still get a slot to be
/// answered TASK SET FULL from.
pub(crate) const BARE_TASKS: usize = 256;
/// PDUs one connection may process per loop turn before the others get theirs.
const PDUS_PER_TURN: u32 = 64;
/// Bytes beyond PDU headers (data segments: immediate data, Data-Out, their padding and
/// digests) the front-end receives in one loop turn, all connections together — the NBD
/// front-end's rule (issue 24, docs/PACING.md "Front door"): receiving is a copy out of the
/// socket, so this bounds a turn's receive work to some tens of µs and a SCSI READ on
/// another connection waits at most that long behind bulk writes' data, instead of behind
/// a receive buffer's worth of it per connection. Headers are never held back: a PDU
/// without a data segment (a READ command, a NOP-Out) is taken in every turn. The
/// connection that used the budget up goes last in the next turn.
const PAYLOAD_BYTES_PER_TURN: usize = 256 << 10;
/// Loop turns between clock reads for keepalive and stall checks.
const CLOCK_EVERY: u32 = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Receiving data-out.
    DataOut,
    /// Queued for or in the array.
    Array,
    /// Reply queued.
    Reply,
}

/// One SCSI task.
#[derive(Clone, Copy, Debug)]
struct Task {
    live: bool,
    in_array: bool,
    in_pending: bool,
    queued_out: bool,
    /// Waiting for its APTPL save (the persister thread's ticket in `pr_waits`).
    in_pr: bool,
    aborted: bool,
    stage: Stage,
    conn: u16,
    /// Session slot of the connection (task management scope).
    session: usize,
    itt: u32,
    plan: Plan,
    buf: BufId,
    buf_len: u32,
    /// Expected data transfer length from the command, bytes.
    edtl: u32,
    /// Data-out bytes kept (min(EDTL, what the command uses)).
    need: u32,
    /// Data-out bytes received, in order.
    got: u32,
    /// End of the data the initiator may send now (unsolicited or solicited), bytes.
    allowed: u32,
    /// Whether the unsolicited part is over.
    unsol_done: bool,
    /// Where the solicited data starts (the end of the unsolicited part), bytes. Burst
    /// `k` (R2TSN `k`) covers `sol_base + k·MaxBurstLength` up to the next or `need`.
    sol_base: u32,
    /// R2Ts decided, sent, and whose data sequence is complete.
    r2t_sn: u32,
    r2t_sent: u32,
    r2t_done: u32,
    /// DataSN expected next in the current data sequence.
    exp_data_sn: u32,
    /// A Data-Out was lost (data digest error, or a DataSN gap that implies one): answer
    /// CHECK CONDITION once the data is in.
    data_error: bool,
    /// Multi-step progress (blocks written, descriptor index).
    step: u64,
    status: u8,
    sense: Option<Sense>,
    /// Data-in bytes to send, sent so far, next DataSN.
    din: u32,
    /// Most data-in bytes the initiator takes (EDTL with the R bit, else 0).
    din_max: u32,
    sent: u32,
    data_sn: u32,
    /// Bytes the command would have transferred (residual computation).
    xfer: u64,
    /// READ/WRITE longer than the task buffer: the transfer offset, bytes, where the
    /// buffer's window starts (buffer byte `i` is transfer byte `win + i`). Zero for
    /// every other task. Windows are `buf_len` bytes and follow each other.
    win: u32,
}

impl Task {
    /// Bytes of the READ/WRITE transfer the array moves (the Data-Out kept, or the blocks
    /// read); 0 for other plans.
    fn rw_bytes(&self, bs: u32) -> u32 {
        match self.plan {
            Plan::Write { .. } => self.need,
            Plan::Read { blocks, .. } => blocks * bs,
            _ => 0,
        }
    }

    /// End of the current buffer window, transfer bytes: `win + buf_len` (saturated).
    fn win_end(&self) -> u32 {
        self.win.saturating_add(self.buf_len)
    }
}

const NO_BUF: BufId = BufId::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Life {
    Open,
    /// Logged out or shutting down: no new commands; ends (as [`Life::Lingering`]) when
    /// replies are sent.
    Draining,
    /// Every reply sent and our side shut down (`shutdown(SHUT_WR)`): the socket stays
    /// open only to discard what the initiator still sends, until it closes its side or
    /// [`LINGER`] passes (a reinstated or revoked session, or an expired drain grace
    /// period, cuts it sooner). Closing a socket with unread bytes makes the kernel reset
    /// the connection (RFC 1122 section 4.2.2.13), and a reset throws away the replies
    /// still in our send queue and the initiator's receive queue.
    Lingering,
    Closed,
}

struct Conn {
    id: u64,
    peer: String,
    stream: Option<Stream>,
    life: Life,
    session: usize,
    cid: u16,
    rx: Framing,
    tx: Framing,
    rbuf: Box<[u8]>,
    rstart: usize,
    rend: usize,
    tbuf: Box<[u8]>,
    tstart: usize,
    tend: usize,
    out: VecDeque<u16>,
    stat_sn: u32,
    tasks: u32,
    last_rx: Instant,
    /// Data-Out PDUs accepted (the stall check compares it between clock reads).
    data_pdus: u64,
    /// While tasks wait for solicited data: the `data_pdus` count and when it was last
    /// seen to move.
    stall_mark: Option<(u64, Instant)>,
    nop_sent: Option<Instant>,
    next_ttt: u32,
    local: String,
    /// When a [`Life::Lingering`] connection is closed whether or not its initiator closed
    /// its side.
    linger_until: Option<Instant>,
}

struct Session {
    tsih: u16,
    conns: u32,
    exp_cmd_sn: u32,
    params: SessionParams,
    revoked: Arc<std::sync::atomic::AtomicBool>,
    /// The I_T nexus (initiator name + ISID) of reservations.
    nexus: Nexus,
    /// The reservation view of `nexus` and the epoch it was taken at (see [`super::pr`]).
    pr_seen: u64,
    pr_view: View,
    /// [`View::aborts`] acted on: a larger count in a fresh view means a PREEMPT AND
    /// ABORT removed this nexus, and its tasks are aborted.
    pr_aborts: u64,
    /// EXTENDED COPY results held for RECEIVE COPY RESULTS (SPC-4 §6.18.3), fixed size.
    copies: xcopy::Held,
}

impl Session {
    fn max_cmd_sn(&self) -> u32 {
        self.exp_cmd_sn.wrapping_add(CMD_WINDOW - 1)
    }
}

/// The iSCSI front-end of one reactor (see the module docs). Built by
/// [`super::IscsiServerBuilder::start`], one per reactor.
pub struct IscsiFrontend {
    reactor: usize,
    shared: Arc<Shared>,
    inbox: Arc<ArrayQueue<NewConn>>,
    conns: Vec<Option<Conn>>,
    /// The slots of `conns` that hold a connection, in adoption order (capacity: every
    /// slot, allocated once): a turn visits these, not every slot of the table.
    live: Vec<u16>,
    /// A slot was freed this turn: `live` drops it after the turn's walk.
    live_freed: bool,
    sessions: Vec<Option<Session>>,
    active: usize,
    tasks: Vec<Task>,
    free_tasks: Vec<u16>,
    pool: BufPool,
    pending: VecDeque<u16>,
    drain_deadline: Option<Instant>,
    finished: bool,
    turns: u32,
    /// Data-segment bytes this turn may still receive ([`PAYLOAD_BYTES_PER_TURN`]).
    payload_budget: usize,
    /// The position in `live` served first this turn (the one after the last turn's
    /// budget spender).
    first: usize,
    /// The reservation epoch this front end last looked at in its turn.
    pr_turn_epoch: u64,
    /// `Shared::lun_resets` this front end has acted on.
    lun_resets_seen: u64,
    /// Tasks waiting for their APTPL save: (task, the persister's ticket).
    pr_waits: Vec<(u16, Arc<AtomicU8>)>,
}

impl IscsiFrontend {
    pub(crate) fn new(
        reactor: usize,
        shared: Arc<Shared>,
        inbox: Arc<ArrayQueue<NewConn>>,
    ) -> Self {
        let pool = BufPool::new(&shared.config.buffers);
        let n = pool.len() + BARE_TASKS;
        debug_assert_eq!(n, shared.tasks_per_reactor);
        let blank = Task {
            live: false,
            in_array: false,
            in_pending: false,
            queued_out: false,
            in_pr: false,
            aborted: false,
            stage: Stage::Reply,
            conn: 0,
            session: 0,
            itt: 0,
            plan: Plan::Good,
            buf: NO_BUF,
            buf_len: 0,
            edtl: 0,
            need: 0,
            got: 0,
            allowed: 0,
            unsol_done: true,
            sol_base: 0,
            r2t_sn: 0,
            r2t_sent: 0,
            r2t_done: 0,
            exp_data_sn: 0,
            data_error: false,
            step: 0,
            status: 0,
            sense: None,
            din: 0,
            din_max: 0,
            sent: 0,
            data_sn: 0,
            xfer: 0,
            win: 0,
        };
        let maxc = shared.config.max_connections_per_reactor;
        Self {
            reactor,
            inbox,
            conns: (0..maxc).map(|_| None).collect(),
            live: Vec::with_capacity(maxc),
            live_freed: false,
            sessions: (0..maxc).map(|_| None).collect(),
            active: 0,
            tasks: vec![blank; n],
            free_tasks: (0..n as u16).rev().collect(),
            pool,
            pending: VecDeque::with_capacity(n),
            shared,
            drain_deadline: None,
            finished: false,
            turns: 0,
            payload_budget: PAYLOAD_BYTES_PER_TURN,
            first: 0,
            pr_turn_epoch: 0,
            lun_resets_seen: 0,
            pr_waits: Vec::new(),
        }
    }

    /// Connections this front-end holds.
    pub fn connections(&self) -> usize {
        self.active
    }

    /// Buffers in this front-end's pool.
    pub fn buffers(&self) -> usize {
        self.pool.len()
    }

    /// Buffers free (all of them once every task finished).
    pub fn free_buffers(&self) -> usize {
        self.pool.free_count()
    }

    /// A connection this front-end turned away: its session is forgotten unless it has
    /// connections here (the login thread registered it).
    fn forget_if_unknown(&self, tsih: u16) {
        if !self.sessions.iter().flatten().any(|s| s.tsih == tsih) {
            self.shared.forget_session(tsih);
        }
    }

    fn adopt(&mut self, nc: NewConn) {
        if self.finished || self.drain_deadline.is_some() {
            info!(conn = nc.id, "closing: the server is shutting down");
            self.forget_if_unknown(nc.tsih);
            return;
        }
        let Some(slot) = self.conns.iter().position(Option::is_none) else {
            warn!(conn = nc.id, "closing: reactor connection table full");
            self.forget_if_unknown(nc.tsih);
            return;
        };
        let sidx = match self
            .sessions
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.tsih == nc.tsih))
        {
            Some(i) => i,
            None => {
                let Some(i) = self.sessions.iter().position(Option::is_none) else {
                    warn!(conn = nc.id, "closing: reactor session table full");
                    self.forget_if_unknown(nc.tsih);
                    return;
                };
                let nexus = Nexus::new(&nc.initiator, nc.isid);
                // Once per session, off the data path.
                let (pr_seen, pr_view) = {
                    let mut st = self.shared.pr_lock();
                    st.attach(&nexus);
                    (
                        self.shared.pr_epoch.load(Ordering::Acquire),
                        st.view(&nexus),
                    )
                };
                self.sessions[i] = Some(Session {
                    tsih: nc.tsih,
                    conns: 0,
                    exp_cmd_sn: nc.cmd_sn,
                    params: nc.params,
                    revoked: Arc::clone(&nc.revoked),
                    nexus,
                    pr_seen,
                    pr_aborts: pr_view.aborts,
                    pr_view,
                    copies: xcopy::Held::default(),
                });
                i
            }
        };
        let s = self.sessions[sidx].as_mut().expect("just found");
        // A connection that reinstates one with the same CID replaces it (§6.3.4 at ERL 0:
        // the old connection's tasks are terminated).
        for c in self.conns.iter_mut().flatten() {
            if c.session == sidx && c.cid == nc.cid && c.life != Life::Closed {
                info!(conn = c.id, "connection reinstated: closing the old one");
                c.stream = None;
                c.life = Life::Closed;
            }
        }
        s.conns += 1;
        if let Err(e) = nc.stream.set_nonblocking(true) {
            warn!(conn = nc.id, "closing: {e}");
            s.conns -= 1;
            return;
        }
        let local = match &nc.stream {
            Stream::Tcp(t) => t.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            Stream::Unix(_) => String::new(),
        };
        info!(conn = nc.id, peer = %nc.peer, initiator = %nc.initiator, tsih = nc.tsih,
            cid = nc.cid, reactor = self.reactor, "iSCSI full-feature phase");
        debug_assert!(nc.rbuf.len() >= 2 * nc.rx.max_pdu_bytes());
        debug_assert!(nc.tbuf.len() >= TX_BYTES && nc.out.capacity() >= self.tasks.len());
        self.conns[slot] = Some(Conn {
            id: nc.id,
            peer: nc.peer,
            stream: Some(nc.stream),
            life: Life::Open,
            session: sidx,
            cid: nc.cid,
            rx: nc.rx,
            tx: nc.tx,
            rbuf: nc.rbuf,
            rstart: 0,
            rend: 0,
            tbuf: nc.tbuf,
            tstart: 0,
            tend: 0,
            out: nc.out,
            stat_sn: nc.stat_sn,
            tasks: 0,
            last_rx: Instant::now(),
            data_pdus: 0,
            stall_mark: None,
            nop_sent: None,
            next_ttt: 1,
            local,
            linger_until: None,
        });
        self.active += 1;
        debug_assert!(self.live.len() < self.live.capacity());
        self.live.push(slot as u16);
    }
}

/// Why a connection stops being read this turn.
enum ReadEnd {
    Paused,
    /// The turn's payload budget is spent ([`PAYLOAD_BYTES_PER_TURN`]); more may wait.
    Budget,
    Eof,
    Kill(String),
}

/// Stages a PDU into the connection's send buffer (room was checked by the caller).
fn stage(c: &mut Conn, h: &Header, data: &[u8]) {
    let n = pdu::pdu_bytes(data.len(), &c.tx);
    if c.tbuf.len() - c.tend < n {
        c.tbuf.copy_within(c.tstart..c.tend, 0);
        c.tend -= c.tstart;
        c.tstart = 0;
    }
    assert!(
        c.tbuf.len() - c.tend >= n,
        "send buffer room checked by the caller"
    );
    let w = pdu::write_pdu(&mut c.tbuf[c.tend..], h, data, &c.tx);
    debug_assert_eq!(w, n);
    c.tend += w;
}

fn tx_free(c: &Conn) -> usize {
    c.tbuf.len() - (c.tend - c.tstart)
}

/// StatSN for a PDU that carries status (and advances it).
fn next_stat(c: &mut Conn) -> u32 {
    let s = c.stat_sn;
    c.stat_sn = c.stat_sn.wrapping_add(1);
    s
}

impl IscsiFrontend {
    /// A task slot and, when one is free, a buffer of at least `len` bytes (`NO_BUF`
    /// otherwise: the command is answered TASK SET FULL). `None` when no slot is free.
    fn take_task(&mut self, len: u32) -> Option<(u16, BufId, u32)> {
        let len = len.max(scsi::MAX_PAGE_BYTES as u32);
        let t = self.free_tasks.pop()?;
        match self.pool.take(len) {
            Some(b) => Some((t, b, self.pool.buf(b).len() as u32)),
            None => Some((t, NO_BUF, 0)),
        }
    }

    /// Returns a task slot (and its buffer) never used.
    fn untake(&mut self, t: u16, buf: BufId) {
        if buf != NO_BUF {
            self.pool.give(buf);
        }
        self.free_tasks.push(t);
    }

    /// Releases task `t` once nothing refers to it.
    fn maybe_release(&mut self, t: u16) {
        let task = &mut self.tasks[usize::from(t)];
        if !task.live || task.in_array || task.in_pending || task.queued_out || task.in_pr {
            return;
        }
        task.live = false;
        if task.buf != NO_BUF {
            self.pool.give(task.buf);
            task.buf = NO_BUF;
        }
        let ci = usize::from(task.conn);
        if let Some(c) = self.conns[ci].as_mut() {
            c.tasks -= 1;
        }
        self.free_tasks.push(t);
    }

    fn lend(&mut self, t: u16, from: u32, len: u32) -> IoBuf {
        let task = self.tasks[usize::from(t)];
        let b = &mut self.pool.buf_mut(task.buf)[from as usize..(from + len) as usize];
        let ptr = NonNull::new(b.as_mut_ptr()).expect("pool buffers are allocated");
        // SAFETY: the buffer belongs to task `t` alone from the command's acceptance until
        // its release; while the request is in the array (`in_array`) nothing here touches
        // it, and the task is released (its buffer reused) only after the completion
        // arrived, also when the connection is gone. The pool outlives every request (the
        // reactor drops its front-end only when nothing is in flight). `from + len` ≤ the
        // buffer length; `from` is a multiple of the block size, the buffer 4096-aligned.
        unsafe { IoBuf::from_raw(ptr, len, None) }
    }

    /// Submits the next array request of task `t`, or finishes it when none is left.
    fn advance<C: Channel>(&mut self, t: u16, io: &mut Io<'_, C>) {
        let req = match self.next_request(t) {
            Ok(Some(r)) => r,
            Ok(None) => return self.reply(t),
            Err(s) => {
                let task = &mut self.tasks[usize::from(t)];
                task.status = status::CHECK_CONDITION;
                task.sense = Some(s);
                task.din = 0;
                return self.reply(t);
            }
        };
        if !self.pending.is_empty() {
            self.tasks[usize::from(t)].in_pending = true;
            self.pending.push_back(t);
            return;
        }
        match io.submit(req) {
            Ok(()) => self.tasks[usize::from(t)].in_array = true,
            Err(ArrayError::QueueFull) => {
                self.tasks[usize::from(t)].in_pending = true;
                self.pending.push_back(t);
            }
            Err(e) => self.failed(t, e),
        }
    }

    fn failed(&mut self, t: u16, e: ArrayError) {
        if matches!(self.tasks[usize::from(t)].plan, Plan::ExtendedCopy { .. }) {
            self.xcopy_finish(t, CopyState::Failed);
        }
        let task = &mut self.tasks[usize::from(t)];
        let write = matches!(
            task.plan,
            Plan::Write { .. }
                | Plan::WriteSame { .. }
                | Plan::Unmap { .. }
                | Plan::CompareAndWrite { .. }
                | Plan::OrWrite { .. }
        ) || matches!(task.plan, Plan::ExtendedCopy { .. }
                if xcopy::Cursor::unpack(task.step).is_some_and(|c| c.writing));
        if let ArrayError::Miscompare { offset } = e {
            // Not a failure: the compare found other data (SBC-4 §5.3), nothing written.
            task.status = status::CHECK_CONDITION;
            task.sense = Some(Sense {
                info: Some(offset),
                ..Sense::MISCOMPARE
            });
            task.din = 0;
            return self.reply(t);
        }
        let sense = match e {
            ArrayError::Unrecoverable { .. } if write => Sense::WRITE_ERROR,
            ArrayError::Unrecoverable { .. } => Sense::UNRECOVERED_READ,
            ArrayError::Failed | ArrayError::QueueFull => Sense::INTERNAL_FAILURE,
            ArrayError::Invalid(_) => Sense::INVALID_FIELD_CDB,
            ArrayError::Miscompare { .. } => unreachable!("answered above"),
        };
        warn!(itt = task.itt, plan = ?task.plan, "array request failed: {e}");
        task.status = status::CHECK_CONDITION;
        task.sense = Some(sense);
        task.din = 0;
        self.reply(t);
    }

    /// The array request task `t` needs next (by plan and step), `None` when done.
    fn next_request(&mut self, t: u16) -> Result<Option<ArrayRequest>, Sense> {
        let task = self.tasks[usize::from(t)];
        let bs = self.shared.lun.block_bytes;
        let tag = TAG_BIT | u64::from(t);
        let off = |lba: u64| lba * u64::from(bs);
        let mk = |op, offset_bytes, len_bytes, buf| ArrayRequest {
            tag,
            op,
            offset_bytes,
            len_bytes,
            buf,
        };
        Ok(match task.plan {
            // A transfer longer than the buffer moves one window per step (`win`); FUA
            // applies to every window written.
            Plan::Read { lba, .. } if task.step == 0 => {
                let len = (task.rw_bytes(bs) - task.win).min(task.buf_len);
                Some(mk(
                    ArrayOp::Read,
                    off(lba) + u64::from(task.win),
                    len,
                    self.lend(t, 0, len),
                ))
            }
            Plan::Write { lba, fua, .. } if task.step == 0 => {
                let len = (task.rw_bytes(bs) - task.win).min(task.buf_len);
                Some(mk(
                    ArrayOp::Write { fua },
                    off(lba) + u64::from(task.win),
                    len,
                    self.lend(t, 0, len),
                ))
            }
            Plan::Flush if task.step == 0 => Some(mk(ArrayOp::Flush, 0, 0, IoBuf::NONE)),
            Plan::Verify {
                lba,
                blocks,
                bytchk,
            } => match task.step {
                0 => {
                    let at = match bytchk {
                        1 => blocks * bs,
                        3 => bs,
                        _ => 0,
                    };
                    let len = blocks * bs;
                    Some(mk(ArrayOp::Read, off(lba), len, self.lend(t, at, len)))
                }
                _ => {
                    let b = self.pool.buf(task.buf);
                    let n = (blocks * bs) as usize;
                    let first = match bytchk {
                        1 => (0..n).find(|&i| b[i] != b[n + i]),
                        3 => (0..n).find(|&i| b[i % bs as usize] != b[bs as usize + i]),
                        _ => None,
                    };
                    if let Some(i) = first {
                        return Err(Sense {
                            info: Some(i as u32),
                            ..Sense::MISCOMPARE
                        });
                    }
                    None
                }
            },
            // Atomic in the engine: the stripe's owner reads, compares and writes holding
            // the stripe; the buffer is the Data-Out as received, verify then write data.
            Plan::CompareAndWrite { lba, blocks, fua } if task.step == 0 => {
                let n = blocks * bs;
                Some(mk(
                    ArrayOp::CompareAndWrite { fua },
                    off(lba),
                    n,
                    self.lend(t, 0, 2 * n),
                ))
            }
            Plan::OrWrite { lba, blocks, fua } if task.step == 0 => {
                let len = blocks * bs;
                Some(mk(
                    ArrayOp::OrWrite { fua },
                    off(lba),
                    len,
                    self.lend(t, 0, len),
                ))
            }
            Plan::WriteSame {
                lba,
                blocks,
                ndob,
                unmap,
            } => {
                let done = task.step;
                if done >= u64::from(blocks) {
                    return Ok(None);
                }
                // UNMAP: the range is deallocated, which reads back zeroes (LBPRZ=1),
                // whatever the data block holds (SBC-4 §4.7.3.4).
                let zero = ndob
                    || unmap
                    || self.pool.buf(task.buf)[..bs as usize]
                        .iter()
                        .all(|&b| b == 0);
                if zero {
                    // The whole range at once (bounded by max_write_same_blocks).
                    Some(mk(
                        ArrayOp::WriteZeroes { fua: false },
                        off(lba),
                        blocks * bs,
                        IoBuf::NONE,
                    ))
                } else {
                    if done == 0 {
                        // Replicate the block through the buffer once.
                        let bl = task.buf_len as usize / bs as usize * bs as usize;
                        let b = self.pool.buf_mut(task.buf);
                        let mut at = bs as usize;
                        while at < bl {
                            let n = (bl - at).min(at);
                            b.copy_within(0..n, at);
                            at += n;
                        }
                    }
                    let per = u64::from(task.buf_len / bs);
                    let n = (u64::from(blocks) - done).min(per) as u32;
                    Some(mk(
                        ArrayOp::Write { fua: false },
                        off(lba + done),
                        n * bs,
                        self.lend(t, 0, n * bs),
                    ))
                }
            }
            Plan::Unmap { .. } => {
                let b = self.pool.buf(task.buf);
                let data = &b[..task.need as usize];
                let count = scsi::unmap_descriptors(data, &self.shared.lun)?;
                let mut i = task.step as usize;
                while i < count && scsi::unmap_descriptor(data, i).1 == 0 {
                    i += 1;
                }
                self.tasks[usize::from(t)].step = i as u64;
                if i >= count {
                    return Ok(None);
                }
                let (lba, n) = scsi::unmap_descriptor(data, i);
                // Deallocated blocks read back zeroes (LBPRZ=1).
                Some(mk(
                    ArrayOp::WriteZeroes { fua: false },
                    off(lba),
                    n * bs,
                    IoBuf::NONE,
                ))
            }
            Plan::ModeSelect { ten, .. } => {
                let b = self.pool.buf(task.buf);
                scsi::mode_select(&b[..task.need as usize], ten)?;
                None
            }
            Plan::ExtendedCopy { param_bytes } => return self.xcopy_request(t, param_bytes),
            Plan::CopyStatus { list_id, alloc } => return self.copy_status(t, list_id, alloc),
            _ => None,
        })
    }

    /// The next read or write of EXTENDED COPY task `t` (SPC-4 §6.4), `None` when every
    /// segment is copied. Its first call checks the parameter list (in the task buffer,
    /// [`xcopy::parse`]) and admits the copy; then the copy runs in pieces through the work
    /// area after the list ([`xcopy::work_offset`]), a read and a write per piece.
    fn xcopy_request(&mut self, t: u16, param_bytes: u32) -> Result<Option<ArrayRequest>, Sense> {
        let task = self.tasks[usize::from(t)];
        let bs = self.shared.lun.block_bytes;
        let off = xcopy::work_offset(param_bytes, bs);
        let per = (task.buf_len.saturating_sub(off) / bs).min(self.shared.lun.max_transfer_blocks);
        let cur = match xcopy::Cursor::unpack(task.step) {
            Some(c) => c,
            None => {
                let data = &self.pool.buf(task.buf)[..task.need as usize];
                let header = xcopy::parse(data, &self.shared.lun)?.header;
                if per == 0 {
                    // The task buffer has no room for one block after the list (a pool
                    // configured below 8 KiB buffers).
                    return Err(Sense::INTERNAL_FAILURE);
                }
                self.xcopy_admit(t, header)?;
                xcopy::Cursor::START
            }
        };
        let data = &self.pool.buf(task.buf)[..task.need as usize];
        let list = xcopy::ParamList::of_checked(data);
        let (step, cur) = xcopy::next_step(&list, data, cur, per);
        self.tasks[usize::from(t)].step = cur.pack();
        let (op, lba, blocks) = match step {
            xcopy::Step::Done => {
                self.xcopy_finish(t, CopyState::Done);
                return Ok(None);
            }
            xcopy::Step::Read { lba, blocks } => (ArrayOp::Read, lba, blocks),
            xcopy::Step::Write { lba, blocks } => (ArrayOp::Write { fua: false }, lba, blocks),
        };
        let len = blocks * bs;
        Ok(Some(ArrayRequest {
            tag: TAG_BIT | u64::from(t),
            op,
            offset_bytes: lba * u64::from(bs),
            len_bytes: len,
            buf: self.lend(t, off, len),
        }))
    }

    /// Admits EXTENDED COPY task `t` with `header`: its list identifier must not be in use
    /// by a copy in progress on the same I_T nexus (OPERATION IN PROGRESS), and at most
    /// [`xcopy::MAX_CONCURRENT_COPIES`] run there at once (INSUFFICIENT RESOURCES). A held
    /// result with the same identifier is discarded (SPC-4 §6.18.3 b). A scan of the task
    /// table, once per EXTENDED COPY, not per I/O.
    fn xcopy_admit(&mut self, t: u16, header: xcopy::Header) -> Result<(), Sense> {
        let session = self.tasks[usize::from(t)].session;
        let mut running = 0u8;
        for (i, k) in self.tasks.iter().enumerate() {
            if i == usize::from(t) || !self.xcopy_running(k, session) {
                continue;
            }
            running = running.saturating_add(1);
            let other = xcopy::ParamList::of_checked(self.pool.buf(k.buf)).header;
            if header.usage != ListIdUsage::None
                && other.usage != ListIdUsage::None
                && other.list_id == header.list_id
            {
                return Err(xcopy::senses::OPERATION_IN_PROGRESS);
            }
        }
        if running >= xcopy::MAX_CONCURRENT_COPIES {
            return Err(xcopy::senses::INSUFFICIENT_RESOURCES);
        }
        if header.usage != ListIdUsage::None {
            if let Some(s) = self.sessions[session].as_mut() {
                s.copies.forget(header.list_id);
            }
        }
        Ok(())
    }

    /// Whether task `k` is an EXTENDED COPY of session slot `session` that has started and
    /// not yet finished.
    fn xcopy_running(&self, k: &Task, session: usize) -> bool {
        k.live
            && !k.aborted
            && k.session == session
            && k.stage == Stage::Array
            && matches!(k.plan, Plan::ExtendedCopy { .. })
            && xcopy::Cursor::unpack(k.step).is_some()
    }

    /// Records how EXTENDED COPY task `t` ended for COPY STATUS, when it had started and its
    /// LIST ID USAGE asks for that (00b).
    fn xcopy_finish(&mut self, t: u16, state: CopyState) {
        let task = self.tasks[usize::from(t)];
        let Some(cur) = xcopy::Cursor::unpack(task.step) else {
            return;
        };
        let data = &self.pool.buf(task.buf)[..task.need as usize];
        let list = xcopy::ParamList::of_checked(data);
        if list.header.usage != ListIdUsage::Hold {
            return;
        }
        let (segments, blocks) = match state {
            CopyState::Done => (list.segments, list.total_blocks(data)),
            _ => (cur.seg, list.blocks_done(data, cur)),
        };
        let r = CopyResult {
            list_id: list.header.list_id,
            state,
            segments,
            bytes: blocks * u64::from(self.shared.lun.block_bytes),
        };
        if let Some(s) = self.sessions[task.session].as_mut() {
            s.copies.record(r);
        }
    }

    /// RECEIVE COPY RESULTS, COPY STATUS (SPC-4 §6.18.3) for task `t`: the copy `list_id`
    /// of the same I_T nexus in progress, else its held result (then discarded); written
    /// into the task buffer as data-in. INVALID FIELD IN CDB when there is neither.
    fn copy_status(
        &mut self,
        t: u16,
        list_id: u8,
        alloc: u32,
    ) -> Result<Option<ArrayRequest>, Sense> {
        let session = self.tasks[usize::from(t)].session;
        let bs = u64::from(self.shared.lun.block_bytes);
        let running = self.tasks.iter().find_map(|k| {
            if !self.xcopy_running(k, session) {
                return None;
            }
            let cur = xcopy::Cursor::unpack(k.step)?;
            let data = &self.pool.buf(k.buf)[..k.need as usize];
            let list = xcopy::ParamList::of_checked(data);
            (list.header.usage != ListIdUsage::None && list.header.list_id == list_id).then(|| {
                CopyResult {
                    list_id,
                    state: CopyState::InProgress,
                    segments: cur.seg,
                    bytes: list.blocks_done(data, cur) * bs,
                }
            })
        });
        let r = match running {
            Some(r) => r,
            None => self.sessions[session]
                .as_mut()
                .and_then(|s| s.copies.take(list_id))
                .ok_or(Sense::INVALID_FIELD_CDB)?,
        };
        let task = &mut self.tasks[usize::from(t)];
        let n = xcopy::copy_status(&r, self.pool.buf_mut(task.buf)) as u32;
        task.xfer = u64::from(n.min(alloc));
        task.din = n.min(alloc).min(task.din_max);
        Ok(None)
    }

    /// Step bookkeeping after an array completion.
    fn step_done(&mut self, t: u16) {
        let bs = u64::from(self.shared.lun.block_bytes);
        let task = &mut self.tasks[usize::from(t)];
        match task.plan {
            Plan::WriteSame {
                blocks,
                ndob,
                unmap,
                ..
            } => {
                let zero = ndob
                    || unmap
                    || self.pool.buf(task.buf)[..bs as usize]
                        .iter()
                        .all(|&b| b == 0);
                if zero {
                    task.step = u64::from(blocks);
                } else {
                    let per = u64::from(task.buf_len) / bs;
                    task.step += (u64::from(blocks) - task.step).min(per);
                }
            }
            Plan::Read { .. } | Plan::Write { .. } | Plan::Flush => task.step = u64::MAX,
            Plan::ExtendedCopy { .. } => {
                if let Some(c) = xcopy::Cursor::unpack(task.step) {
                    task.step = c.completed().pack();
                }
            }
            _ => task.step += 1,
        }
    }

    /// Queues task `t`'s reply (data-in and/or status) on its connection.
    fn reply(&mut self, t: u16) {
        let task = &mut self.tasks[usize::from(t)];
        task.stage = Stage::Reply;
        let ci = usize::from(task.conn);
        let alive = self.conns[ci]
            .as_ref()
            .is_some_and(|c| c.life != Life::Closed);
        if task.aborted || !alive {
            self.maybe_release(t);
            return;
        }
        // Already queued (for R2Ts it no longer needs, after lost data): that entry sends
        // the reply now that the stage is Reply.
        if !std::mem::replace(&mut task.queued_out, true) {
            self.conns[ci].as_mut().expect("checked").out.push_back(t);
        }
    }
}

/// Byte range `[start, end)` of task `t`'s solicited burst `k` (R2TSN `k`): bursts of
/// MaxBurstLength from where the unsolicited data ended, up to the data the task keeps.
/// A WRITE longer than its buffer has its bursts cut at the buffer windows' boundaries
/// (multiples of `buf_len`), so that no burst spans two windows: each window's bursts
/// start at the window (the first window's at `sol_base`).
fn burst(t: &Task, k: u32, max_burst: u32) -> (u32, u32) {
    let need = u64::from(t.need);
    let mb = u64::from(max_burst.max(1));
    let w = u64::from(t.buf_len);
    let base = u64::from(t.sol_base);
    let k = u64::from(k);
    let (start, end) = if w == 0 || need <= w {
        let s = base + k * mb;
        (s, s + mb)
    } else {
        // Window of sol_base, and the bursts left in it.
        let w0 = base / w;
        let first = ((w0 + 1) * w - base).div_ceil(mb);
        if k < first {
            let s = base + k * mb;
            (s, (s + mb).min((w0 + 1) * w))
        } else {
            let per = w.div_ceil(mb);
            let j = k - first;
            let wi = w0 + 1 + j / per;
            let s = wi * w + (j % per) * mb;
            (s, (s + mb).min((wi + 1) * w))
        }
    };
    (start.min(need) as u32, end.min(need) as u32)
}

/// The Target Transfer Tag of task `t`'s R2T `k`: the task slot in the high 16 bits (so
/// a Data-Out finds its task without a search), the R2TSN's low 16 bits below. Never the
/// reserved 0xffffffff: slots are below 65535.
fn r2t_ttt(t: u16, k: u32) -> u32 {
    (u32::from(t) << 16) | (k & 0xffff)
}

/// Residual flags and count (§11.4.5): overflow when the command wanted more than EDTL,
/// underflow when it used less.
fn residual(task: &Task) -> (u8, u32) {
    let e = u64::from(task.edtl);
    if task.xfer > e {
        (0x04, (task.xfer - e).min(u64::from(u32::MAX)) as u32)
    } else if task.xfer < e {
        (0x02, (e - task.xfer) as u32)
    } else {
        (0, 0)
    }
}

impl IscsiFrontend {
    /// Serialises queued replies into the send buffer while they fit.
    fn pump(&mut self, ci: usize) {
        loop {
            let conn = self.conns[ci].as_mut().expect("open connection");
            let Some(&t) = conn.out.front() else {
                return;
            };
            let task = self.tasks[usize::from(t)];
            let (exp, max) = {
                let s = self.sessions[conn.session].as_ref().expect("session stays");
                (s.exp_cmd_sn, s.max_cmd_sn())
            };
            if task.aborted {
                conn.out.pop_front();
                self.tasks[usize::from(t)].queued_out = false;
                self.maybe_release(t);
                continue;
            }
            if task.stage == Stage::DataOut {
                // The R2Ts decided and not yet sent (§11.8), in R2TSN order.
                let mb = self.sessions[conn.session]
                    .as_ref()
                    .expect("session")
                    .params
                    .max_burst;
                while self.tasks[usize::from(t)].r2t_sent < self.tasks[usize::from(t)].r2t_sn {
                    if tx_free(conn) < pdu::pdu_bytes(0, &conn.tx) {
                        return;
                    }
                    let tk = &mut self.tasks[usize::from(t)];
                    let k = tk.r2t_sent;
                    let (start, end) = burst(tk, k, mb);
                    let h = Header::new(op::R2T, 0x80, 0, tk.itt)
                        .u32(20, r2t_ttt(t, k))
                        .u32(24, conn.stat_sn)
                        .u32(28, exp)
                        .u32(32, max)
                        .u32(36, k)
                        .u32(40, start)
                        .u32(44, end - start);
                    stage(conn, &h, &[]);
                    tk.r2t_sent += 1;
                }
                conn.out.pop_front();
                self.tasks[usize::from(t)].queued_out = false;
                continue;
            }
            let seg_max = conn.tx.max_recv_data.min(MAX_SEND_SEGMENT);
            let (rflags, rcount) = residual(&task);
            if task.sent < task.din && task.sent >= task.win_end() {
                // A READ longer than its buffer: this window is sent (staged), read the
                // next into the same buffer; the reply is queued again when it is in.
                conn.out.pop_front();
                let tk = &mut self.tasks[usize::from(t)];
                tk.queued_out = false;
                tk.win = tk.win_end();
                tk.step = 0;
                tk.stage = Stage::Array;
                tk.in_pending = true;
                self.pending.push_back(t);
                continue;
            }
            if task.sent < task.din {
                let seg = (task.din - task.sent)
                    .min(seg_max)
                    .min(task.win_end() - task.sent);
                if tx_free(conn) < pdu::pdu_bytes(seg as usize, &conn.tx) {
                    return;
                }
                let last = task.sent + seg == task.din;
                let with_status = last && task.sense.is_none();
                let mut flags = if last { 0x80 } else { 0 };
                let mut h_stat = conn.stat_sn;
                if with_status {
                    flags |= 0x01 | rflags;
                    h_stat = next_stat(conn);
                }
                let h = Header::new(op::DATA_IN, flags, seg, task.itt)
                    .byte(3, if with_status { task.status } else { 0 })
                    .u32(20, pdu::RESERVED_TAG)
                    .u32(24, if with_status { h_stat } else { 0 })
                    .u32(28, exp)
                    .u32(32, max)
                    .u32(36, task.data_sn)
                    .u32(40, task.sent)
                    .u32(44, if with_status { rcount } else { 0 });
                let b = self.pool.buf(task.buf);
                let at = (task.sent - task.win) as usize;
                let data = &b[at..at + seg as usize];
                stage(conn, &h, data);
                let tk = &mut self.tasks[usize::from(t)];
                tk.sent += seg;
                tk.data_sn += 1;
                if with_status {
                    conn.out.pop_front();
                    tk.queued_out = false;
                    self.maybe_release(t);
                }
                continue;
            }
            // SCSI Response.
            let sense = task.sense.map(|s| s.fixed());
            let dlen = sense.map_or(0, |s| 2 + s.len());
            if tx_free(conn) < pdu::pdu_bytes(dlen, &conn.tx) {
                return;
            }
            let mut data = [0u8; 20];
            if let Some(s) = sense {
                data[..2].copy_from_slice(&(s.len() as u16).to_be_bytes());
                data[2..20].copy_from_slice(&s);
            }
            let st = next_stat(conn);
            let h = Header::new(op::SCSI_RESP, 0x80 | rflags, dlen as u32, task.itt)
                .byte(2, 0)
                .byte(3, task.status)
                .u32(24, st)
                .u32(28, exp)
                .u32(32, max)
                .u32(36, if task.din > 0 { task.data_sn } else { 0 })
                .u32(44, rcount);
            stage(conn, &h, &data[..dlen]);
            conn.out.pop_front();
            self.tasks[usize::from(t)].queued_out = false;
            self.maybe_release(t);
        }
    }

    /// Sends what is staged. Returns whether bytes moved.
    fn flush(conn: &mut Conn) -> io::Result<bool> {
        let mut moved = false;
        while conn.tstart < conn.tend {
            let s = conn.stream.as_ref().expect("open connection");
            match s.send_vectored(&[io::IoSlice::new(&conn.tbuf[conn.tstart..conn.tend])]) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "peer took nothing",
                    ))
                }
                Ok(n) => {
                    conn.tstart += n;
                    moved = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        if conn.tstart == conn.tend {
            conn.tstart = 0;
            conn.tend = 0;
        }
        Ok(moved)
    }

    /// Reads and handles whole PDUs of connection `ci`.
    fn read_pdus<C: Channel>(&mut self, ci: usize, io: &mut Io<'_, C>) -> (bool, ReadEnd) {
        let mut progress = false;
        let mut budget = PDUS_PER_TURN;
        loop {
            let conn = self.conns[ci].as_mut().expect("open connection");
            // A draining connection is still read: Data-Out for its tasks in progress
            // (they could not end otherwise) and the initiator's close.
            if conn.life == Life::Closed || budget == 0 {
                return (progress, ReadEnd::Paused);
            }
            if tx_free(conn) < tx_reserve(&conn.rx) {
                return (progress, ReadEnd::Paused);
            }
            let framed = conn.rx.frame(&conn.rbuf[conn.rstart..conn.rend]);
            let n = match framed {
                Err(e) => return (progress, ReadEnd::Kill(format!("{e}"))),
                Ok(Some(n)) => n,
                Ok(None) => {
                    // Need more bytes: make room and read.
                    if conn.rstart > 0 {
                        conn.rbuf.copy_within(conn.rstart..conn.rend, 0);
                        conn.rend -= conn.rstart;
                        conn.rstart = 0;
                    }
                    // The header is always read; what follows it only within the turn's
                    // payload budget.
                    let header_left = conn
                        .rx
                        .header_bytes(&conn.rbuf[..conn.rend])
                        .saturating_sub(conn.rend);
                    let room = conn.rbuf.len() - conn.rend;
                    let cap = room.min(header_left.max(self.payload_budget));
                    if cap == 0 {
                        debug_assert_eq!(self.payload_budget, 0, "a framed PDU fits the buffer");
                        return (progress, ReadEnd::Budget);
                    }
                    let s = conn.stream.as_mut().expect("open connection");
                    let end = conn.rend + cap;
                    match crate::nbd::conn::read_retrying(s, &mut conn.rbuf[conn.rend..end]) {
                        Ok(0) => return (progress, ReadEnd::Eof),
                        Ok(k) => {
                            self.payload_budget = self
                                .payload_budget
                                .saturating_sub(k.saturating_sub(header_left));
                            conn.rend += k;
                            conn.last_rx = Instant::now();
                            conn.nop_sent = None;
                            progress = true;
                            continue;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            return (progress, ReadEnd::Paused)
                        }
                        Err(e) => return (progress, ReadEnd::Kill(format!("receive: {e}"))),
                    }
                }
            };
            let (start, end) = (conn.rstart, conn.rstart + n);
            match self.handle(ci, start, end, io) {
                Handled::Consumed => {
                    let conn = self.conns[ci].as_mut().expect("open connection");
                    conn.rstart += n;
                    if conn.rstart == conn.rend {
                        conn.rstart = 0;
                        conn.rend = 0;
                    }
                    budget -= 1;
                    progress = true;
                }
                Handled::Wait => return (progress, ReadEnd::Paused),
                Handled::Kill(why) => return (progress, ReadEnd::Kill(why)),
            }
        }
    }
}

enum Handled {
    Consumed,
    /// Out of tasks or buffers: leave the PDU buffered and try again later.
    Wait,
    Kill(String),
}

impl IscsiFrontend {
    fn reject(&mut self, ci: usize, reason: u8, bhs: &Bhs) {
        let conn = self.conns[ci].as_mut().expect("open");
        let s = self.sessions[conn.session].as_ref().expect("session");
        let (exp, max) = (s.exp_cmd_sn, s.max_cmd_sn());
        let st = next_stat(conn);
        let h = Header::new(op::REJECT, 0x80, BHS_BYTES as u32, pdu::RESERVED_TAG)
            .byte(2, reason)
            .u32(24, st)
            .u32(28, exp)
            .u32(32, max);
        stage(conn, &h, &bhs.raw);
    }

    /// CmdSN check for a non-immediate PDU (§4.2.2.1): advances ExpCmdSN, or says the
    /// PDU must be ignored.
    fn cmd_sn_ok(&mut self, ci: usize, bhs: &Bhs) -> bool {
        let conn = self.conns[ci].as_ref().expect("open");
        let s = self.sessions[conn.session].as_mut().expect("session");
        let sn = bhs.u32_at(24);
        if bhs.immediate() {
            return true;
        }
        if sn == s.exp_cmd_sn {
            s.exp_cmd_sn = s.exp_cmd_sn.wrapping_add(1);
            return true;
        }
        // Out of order within the window: accepted (SIMPLE tasks; ERL 0 has no gaps to
        // wait for on one connection, and connections of a session may interleave).
        if pdu::sn_lt(s.exp_cmd_sn, sn) && pdu::sn_le(sn, s.max_cmd_sn()) {
            return true;
        }
        debug!(
            conn = conn.id,
            cmd_sn = sn,
            exp = s.exp_cmd_sn,
            "CmdSN outside the window: ignored"
        );
        false
    }

    fn handle<C: Channel>(
        &mut self,
        ci: usize,
        start: usize,
        end: usize,
        io: &mut Io<'_, C>,
    ) -> Handled {
        let conn = self.conns[ci].as_ref().expect("open");
        let rx = conn.rx;
        let p = match rx.split(&conn.rbuf[start..end]) {
            Ok(p) => p,
            Err(e) => return Handled::Kill(format!("{e}")),
        };
        let bhs = p.bhs;
        let dlen = p.data.len();
        let digest_ok = p.data_digest_ok;
        let data_at = end - pdu::pad4(dlen) - if rx.data_digest && dlen > 0 { 4 } else { 0 };
        if conn.life == Life::Draining && bhs.opcode() != op::DATA_OUT {
            // Logged out or shutting down: the tasks in progress still get their data,
            // nothing new starts (the PDU is dropped).
            return Handled::Consumed;
        }
        match bhs.opcode() {
            op::SCSI_CMD => self.scsi_command(ci, bhs, data_at, dlen, digest_ok, io),
            op::DATA_OUT => {
                if !digest_ok {
                    self.reject(ci, pdu::reject::DATA_DIGEST, &bhs);
                    // The task can no longer complete its data: fail it.
                    if let Some(t) = self.find_task(ci, bhs.itt()) {
                        self.tasks[usize::from(t)].data_error = true;
                    }
                    return Handled::Consumed;
                }
                self.data_out(ci, bhs, data_at, dlen, io)
            }
            op::NOP_OUT => {
                if !digest_ok {
                    self.reject(ci, pdu::reject::DATA_DIGEST, &bhs);
                    return Handled::Consumed;
                }
                if !self.cmd_sn_ok(ci, &bhs) {
                    return Handled::Consumed;
                }
                if bhs.itt() == pdu::RESERVED_TAG {
                    // The answer to our NOP-In ping.
                    return Handled::Consumed;
                }
                let conn = self.conns[ci].as_mut().expect("open");
                let s = self.sessions[conn.session].as_ref().expect("session");
                let (exp, max) = (s.exp_cmd_sn, s.max_cmd_sn());
                let st = next_stat(conn);
                let h = Header::new(op::NOP_IN, 0x80, dlen as u32, bhs.itt())
                    .u64(8, bhs.lun_raw())
                    .u32(20, pdu::RESERVED_TAG)
                    .u32(24, st)
                    .u32(28, exp)
                    .u32(32, max);
                // Copy the ping data out of the receive buffer first (both live in conn).
                let (rbuf, tconn) = (std::mem::take(&mut conn.rbuf), &mut *conn);
                stage(tconn, &h, &rbuf[data_at..data_at + dlen]);
                conn.rbuf = rbuf;
                Handled::Consumed
            }
            op::TMF_REQ => {
                if !self.cmd_sn_ok(ci, &bhs) {
                    return Handled::Consumed;
                }
                self.task_management(ci, &bhs);
                Handled::Consumed
            }
            op::LOGOUT_REQ => {
                if !self.cmd_sn_ok(ci, &bhs) {
                    return Handled::Consumed;
                }
                // Terminate this connection's tasks (ERL 0), answer, then close. Reason 0
                // (close the session) closes the session's other connections too (§11.14.1).
                self.abort_where(|t, c| t.conn as usize == c, ci);
                let session = self.conns[ci].as_ref().expect("open").session;
                if bhs.flags() & 0x7f == 0 {
                    for other in 0..self.conns.len() {
                        let same = self.conns[other]
                            .as_ref()
                            .is_some_and(|c| c.session == session && c.life != Life::Closed);
                        if other != ci && same {
                            self.close(other, "");
                        }
                    }
                }
                let conn = self.conns[ci].as_mut().expect("open");
                let s = self.sessions[conn.session].as_ref().expect("session");
                let (exp, max) = (s.exp_cmd_sn, s.max_cmd_sn());
                let st = next_stat(conn);
                let h = Header::new(op::LOGOUT_RESP, 0x80, 0, bhs.itt())
                    .u32(24, st)
                    .u32(28, exp)
                    .u32(32, max);
                stage(conn, &h, &[]);
                conn.life = Life::Draining;
                info!(conn = conn.id, "iSCSI logout");
                Handled::Consumed
            }
            op::TEXT_REQ => {
                if !self.cmd_sn_ok(ci, &bhs) {
                    return Handled::Consumed;
                }
                let conn = self.conns[ci].as_mut().expect("open");
                let keys = text::parse(&conn.rbuf[data_at..data_at + dlen]).unwrap_or_default();
                let mut reply = Vec::new();
                for (k, v) in &keys {
                    if k == "SendTargets" {
                        if v == "All" || *v == self.shared.target_name || v.is_empty() {
                            text::put(&mut reply, "TargetName", &self.shared.target_name);
                            text::put(&mut reply, "TargetAddress", &format!("{},1", conn.local));
                        }
                    } else {
                        text::put(&mut reply, k, "NotUnderstood");
                    }
                }
                reply.truncate((conn.tx.max_recv_data as usize).min(rx.max_recv_data as usize));
                let s = self.sessions[conn.session].as_ref().expect("session");
                let (exp, max) = (s.exp_cmd_sn, s.max_cmd_sn());
                let st = next_stat(conn);
                let h = Header::new(op::TEXT_RESP, 0x80, reply.len() as u32, bhs.itt())
                    .u64(8, bhs.lun_raw())
                    .u32(20, pdu::RESERVED_TAG)
                    .u32(24, st)
                    .u32(28, exp)
                    .u32(32, max);
                stage(conn, &h, &reply);
                Handled::Consumed
            }
            op::SNACK => {
                // ERL 0 has no SNACK (§11.16): reject.
                self.reject(ci, pdu::reject::PROTOCOL_ERROR, &bhs);
                Handled::Consumed
            }
            _ => {
                self.reject(ci, pdu::reject::NOT_SUPPORTED, &bhs);
                Handled::Consumed
            }
        }
    }

    fn find_task(&self, ci: usize, itt: u32) -> Option<u16> {
        // Linear in the pool: Data-Out for a task is found through the connection's tasks
        // (a few hundred at most).
        self.tasks
            .iter()
            .position(|t| t.live && usize::from(t.conn) == ci && t.itt == itt && !t.aborted)
            .map(|i| i as u16)
    }

    fn scsi_command<C: Channel>(
        &mut self,
        ci: usize,
        bhs: Bhs,
        data_at: usize,
        dlen: usize,
        digest_ok: bool,
        io: &mut Io<'_, C>,
    ) -> Handled {
        let lun_raw = bhs.lun_raw();
        let cdb = *bhs.cdb();
        let edtl = bhs.u32_at(20);
        let write_flag = bhs.flags() & 0x20 != 0;
        let read_flag = bhs.flags() & 0x40 != 0;
        // Size the buffer before taking anything: a decode into scratch is cheap.
        let lun = &self.shared.lun;
        let mut scratch = [0u8; scsi::MAX_PAGE_BYTES];
        let plan0 = scsi::decode(&cdb, lun, &mut scratch);
        let bs = lun.block_bytes;
        // COMPARE AND WRITE: a Data-Out length other than twice NUMBER OF LOGICAL BLOCKS
        // (SBC-4 §5.3) is an INVALID FIELD IN CDB — also for NUMBER OF LOGICAL BLOCKS 0
        // with data (libiscsi's CompareAndWrite.InvalidDataOutSize).
        let plan0 = match plan0 {
            Plan::Check(_) => plan0,
            _ if cdb[0] == scsi::opc::COMPARE_AND_WRITE => {
                let want = 2 * u64::from(cdb[13]) * u64::from(bs);
                let sent = if write_flag { u64::from(edtl) } else { 0 };
                if sent == want {
                    plan0
                } else {
                    Plan::Check(Sense::INVALID_FIELD_CDB)
                }
            }
            _ => plan0,
        };
        let out_bytes = plan0.data_out_bytes(bs);
        let largest = self.shared.largest_buf;
        // READ and WRITE longer than the largest buffer go through it in windows.
        let need_buf = match plan0 {
            Plan::Read { blocks, .. } => {
                (u64::from(blocks) * u64::from(bs)).min(u64::from(largest))
            }
            Plan::Write { .. } => out_bytes.min(u64::from(largest)),
            Plan::Verify { blocks, bytchk, .. } => {
                u64::from(blocks) * u64::from(bs)
                    + out_bytes.min(u64::from(blocks) * u64::from(bs)) * u64::from(bytchk != 0)
            }
            Plan::CompareAndWrite { blocks, .. } => 2 * u64::from(blocks) * u64::from(bs),
            Plan::PrIn { alloc, .. } => u64::from(alloc),
            Plan::WriteSame { blocks, .. } => {
                (u64::from(blocks) * u64::from(bs)).min(u64::from(self.shared.write_same_buf))
            }
            // The parameter list, then a work area for the copy's pieces.
            Plan::ExtendedCopy { param_bytes } => (u64::from(xcopy::work_offset(param_bytes, bs))
                + u64::from(self.shared.write_same_buf))
            .min(u64::from(self.shared.largest_buf)),
            _ => out_bytes,
        };
        let plan = if need_buf > u64::from(largest) {
            Plan::Check(Sense::INVALID_FIELD_CDB)
        } else {
            plan0
        };
        if !digest_ok {
            // §7.8: reject and discard; the command never happened (its CmdSN is not
            // consumed, the initiator retries at a higher ERL or times out).
            self.reject(ci, pdu::reject::DATA_DIGEST, &bhs);
            return Handled::Consumed;
        }
        // Before any wait for a task or buffer: the reactor's turns stay bounded for what
        // is about to wait here (`Io::note_arrival`; a command served without the array
        // waits for the turn too).
        let (writes, len) = match plan {
            Plan::Write { .. } => (true, out_bytes),
            Plan::WriteSame { blocks, .. } => (true, u64::from(blocks) * u64::from(bs)),
            _ => (false, 0),
        };
        if !matches!(plan, Plan::Flush) {
            io.note_arrival(writes, len);
        }
        let Some((t, buf, buf_len)) = self.take_task(need_buf as u32) else {
            return Handled::Wait;
        };
        if !self.cmd_sn_ok(ci, &bhs) {
            self.untake(t, buf);
            return Handled::Consumed;
        }
        let conn = self.conns[ci].as_mut().expect("open");
        if conn.life != Life::Open {
            self.untake(t, buf);
            return Handled::Consumed;
        }
        conn.tasks += 1;
        let params = self.sessions[conn.session]
            .as_ref()
            .expect("session")
            .params;
        // LUN 0 only (single-level LUN structure, §11.2.1.4 / SAM-5).
        let lun_ok = lun_raw == 0;
        let mut plan = plan;
        let mut din = 0;
        if !lun_ok {
            plan = match cdb[0] {
                scsi::opc::REPORT_LUNS => plan,
                scsi::opc::INQUIRY if matches!(plan, Plan::Data { .. }) => {
                    // Peripheral qualifier 3: no logical unit here.
                    scratch[0] = 0x7f;
                    plan
                }
                scsi::opc::REQUEST_SENSE => plan,
                _ => Plan::Check(Sense::LUN_NOT_SUPPORTED),
            };
        }
        // Reservations and unit attentions (one atomic load when nothing changed).
        if lun_ok && buf != NO_BUF {
            let sidx = self.conns[ci].as_ref().expect("open").session;
            plan = self.pr_gate(sidx, &cdb, plan, &mut scratch);
        }
        // No buffer free: the command is answered TASK SET FULL (SAM-5 §5.3.1) and the
        // initiator retries it later. Never waiting for a buffer with the command still in
        // the receive buffer keeps the Data-Out behind it flowing: tasks that hold buffers
        // wait for exactly that data, so waiting could deadlock.
        let busy = buf == NO_BUF;
        if busy {
            plan = Plan::Good;
        }
        if let Plan::Data { len } = plan {
            self.pool.buf_mut(buf)[..len as usize].copy_from_slice(&scratch[..len as usize]);
            din = len;
        }
        let xfer = match plan {
            Plan::Read { blocks, .. } => u64::from(blocks) * u64::from(bs),
            Plan::Data { len } => u64::from(len),
            _ => out_bytes,
        };
        // Data-out the initiator will send (§11.4.5.1: with EDTL below what the CDB asks,
        // a write covers the whole blocks EDTL carries and reports the rest as residual
        // overflow; beyond it, the surplus is received and dropped: underflow).
        let sendable = if write_flag { u64::from(edtl) } else { 0 };
        if let Plan::Write { lba, fua, .. } = plan {
            if sendable < out_bytes {
                let whole = (sendable / u64::from(bs)) as u32;
                plan = if whole == 0 {
                    Plan::Good
                } else {
                    Plan::Write {
                        lba,
                        blocks: whole,
                        fua,
                    }
                };
            }
        }
        let out_used = plan.data_out_bytes(bs);
        let mut need = out_used.min(sendable) as u32;
        let mut early: Option<Sense> = None;
        // Other commands cannot run on part of their parameter data.
        if out_used > sendable {
            early = Some(Sense::INVALID_FIELD_CDB);
        }
        // A WRITE SAME carries exactly one logical block (SBC-4 §5.42, §5.44): more
        // Data-Out than that means the initiator and the CDB disagree on the command, and
        // which block was meant cannot be told — refused, as LIO refuses write-type
        // commands whose data length differs from the CDB's.
        if matches!(plan, Plan::WriteSame { ndob: false, .. }) && sendable != out_used {
            early = Some(Sense::INVALID_FIELD_CDB);
        }
        // Data-in the initiator takes: EDTL, and nothing without the R bit (the rest is
        // residual overflow).
        let din_max = if read_flag { edtl } else { 0 };
        if let Plan::Check(s) = plan {
            early = Some(s);
        }
        if early.is_some() {
            need = 0;
        }
        let task = Task {
            live: true,
            in_array: false,
            in_pending: false,
            queued_out: false,
            in_pr: false,
            aborted: false,
            stage: Stage::DataOut,
            conn: ci as u16,
            session: self.conns[ci].as_ref().expect("open").session,
            itt: bhs.itt(),
            plan,
            buf,
            buf_len,
            edtl,
            need,
            got: 0,
            allowed: 0,
            unsol_done: false,
            sol_base: 0,
            r2t_sn: 0,
            r2t_sent: 0,
            r2t_done: 0,
            exp_data_sn: 0,
            data_error: false,
            step: 0,
            status: status::GOOD,
            sense: early,
            din: if early.is_some() { 0 } else { din.min(din_max) },
            din_max,
            sent: 0,
            data_sn: 0,
            xfer,
            win: 0,
        };
        self.tasks[usize::from(t)] = task;
        if busy {
            debug!(
                conn = self.conns[ci].as_ref().map_or(0, |c| c.id),
                itt = bhs.itt(),
                "no task buffer free: TASK SET FULL"
            );
            self.tasks[usize::from(t)].status = status::TASK_SET_FULL;
        }
        // Immediate data.
        let unsol_limit = if params.initial_r2t {
            0
        } else {
            params.first_burst.min(edtl)
        };
        let imm = if params.immediate_data {
            dlen as u32
        } else {
            0
        };
        if dlen > 0
            && (!params.immediate_data || !write_flag || dlen as u32 > params.first_burst.min(edtl))
        {
            // Data the negotiation does not allow: a protocol error (§7.1.4.1 → drop).
            return Handled::Kill("immediate data not allowed here".into());
        }
        {
            let tk = &mut self.tasks[usize::from(t)];
            let take = imm.min(tk.need);
            let conn = self.conns[ci].as_ref().expect("open");
            if take > 0 {
                let src = &conn.rbuf[data_at..data_at + take as usize];
                self.pool.buf_mut(buf)[..take as usize].copy_from_slice(src);
            }
            tk.got = imm;
            tk.allowed = unsol_limit.max(imm);
            // F bit: no unsolicited Data-Out follow.
            tk.unsol_done = bhs.final_bit() || tk.allowed <= tk.got;
        }
        self.data_progress(t, io);
        Handled::Consumed
    }

    /// After data-out arrived (or none is due): solicit more, or start the task.
    fn data_progress<C: Channel>(&mut self, t: u16, io: &mut Io<'_, C>) {
        let task = self.tasks[usize::from(t)];
        let want = if task.sense.is_some() { 0 } else { task.need };
        // Unsolicited data still in flight.
        if !task.unsol_done && task.got < task.allowed {
            return;
        }
        if task.data_error && task.got < want {
            // Data was lost (§7.8): solicit nothing more, take back R2Ts decided but not
            // yet sent, and answer once every R2T already sent has had its data.
            let tk = &mut self.tasks[usize::from(t)];
            tk.unsol_done = true;
            tk.r2t_sn = tk.r2t_sent;
            if tk.r2t_done < tk.r2t_sent {
                return;
            }
        } else if task.got < want && task.got < task.win_end() {
            return self.solicit(t);
        } else if task.got < want {
            // A WRITE longer than its buffer, its window full: write it; `complete` moves
            // the window on and solicits the next part.
            self.tasks[usize::from(t)].stage = Stage::Array;
            return self.advance(t, io);
        }
        // All data in.
        let tk = &mut self.tasks[usize::from(t)];
        tk.stage = Stage::Array;
        if tk.data_error {
            tk.status = status::CHECK_CONDITION;
            tk.sense = Some(Sense::PROTOCOL_CRC);
            tk.din = 0;
        }
        if tk.sense.is_some() {
            tk.status = status::CHECK_CONDITION;
            tk.din = 0;
            return self.reply(t);
        }
        match tk.plan {
            Plan::Data { .. } | Plan::Good | Plan::ConditionMet => {
                if tk.plan == Plan::ConditionMet {
                    tk.status = status::CONDITION_MET;
                }
                self.reply(t)
            }
            Plan::Read { blocks, .. } => {
                tk.din = (blocks * self.shared.lun.block_bytes).min(tk.din_max);
                self.advance(t, io)
            }
            Plan::Conflict => {
                tk.status = status::RESERVATION_CONFLICT;
                self.reply(t)
            }
            Plan::PrIn { .. } | Plan::PrOut { .. } | Plan::Reserve6 | Plan::Release6 => {
                self.pr_execute(t)
            }
            _ => self.advance(t, io),
        }
    }

    /// Keeps up to MaxOutstandingR2T bursts of task `t` solicited (§11.8; sequences arrive
    /// in order: DataSequenceInOrder=Yes), none beyond the current buffer window.
    fn solicit(&mut self, t: u16) {
        let task = self.tasks[usize::from(t)];
        let conn = self.conns[usize::from(task.conn)].as_mut().expect("open");
        let params = self.sessions[conn.session]
            .as_ref()
            .expect("session")
            .params;
        let tk = &mut self.tasks[usize::from(t)];
        if tk.r2t_sn == 0 {
            tk.sol_base = tk.got;
            tk.unsol_done = true;
            tk.exp_data_sn = 0;
        }
        let win_end = tk.win_end();
        let mut added = false;
        // R2TSN is 32 bits; the Target Transfer Tag carries its low 16 (r2t_ttt), which
        // is unambiguous with at most MaxOutstandingR2T (≤ 65535) bursts outstanding.
        while tk.r2t_sn - tk.r2t_done < params.max_outstanding_r2t {
            let (start, end) = burst(tk, tk.r2t_sn, params.max_burst);
            if start >= end || start >= win_end {
                break;
            }
            tk.r2t_sn += 1;
            tk.allowed = end;
            added = true;
        }
        if added && !tk.queued_out {
            tk.queued_out = true;
            conn.out.push_back(t);
        }
    }

    fn data_out<C: Channel>(
        &mut self,
        ci: usize,
        bhs: Bhs,
        data_at: usize,
        dlen: usize,
        io: &mut Io<'_, C>,
    ) -> Handled {
        // A PREEMPT AND ABORT or reset done on another reactor since this turn began ends
        // its tasks before their data is taken (the task looked up below is then gone).
        self.pr_catch_up();
        let ttt = bhs.u32_at(20);
        let solicited = ttt != pdu::RESERVED_TAG;
        let found = if solicited {
            let t = (ttt >> 16) as u16;
            self.tasks
                .get(usize::from(t))
                .filter(|k| k.live && !k.aborted && usize::from(k.conn) == ci && k.itt == bhs.itt())
                .map(|_| t)
        } else {
            self.find_task(ci, bhs.itt())
        };
        let Some(t) = found else {
            // Data for a task already answered or aborted: dropped (§11.7).
            return Handled::Consumed;
        };
        let task = self.tasks[usize::from(t)];
        if task.stage != Stage::DataOut {
            return Handled::Consumed;
        }
        let data_sn = bhs.u32_at(36);
        let offset = bhs.u32_at(40);
        let mb = {
            let conn = self.conns[ci].as_ref().expect("open");
            self.sessions[conn.session]
                .as_ref()
                .expect("session")
                .params
                .max_burst
        };
        // The end of the data sequence this PDU belongs to.
        let seq_end = if solicited {
            let k = ttt & 0xffff;
            if task.r2t_done >= task.r2t_sent || k != task.r2t_done & 0xffff {
                return Handled::Kill(format!(
                    "Data-Out for R2T {k}, expected the oldest outstanding {} of {}",
                    task.r2t_done, task.r2t_sent
                ));
            }
            burst(&task, task.r2t_done, mb).1
        } else {
            if task.unsol_done {
                return Handled::Kill("unsolicited Data-Out after the unsolicited part".into());
            }
            task.allowed
        };
        if offset != task.got || offset as u64 + dlen as u64 > u64::from(seq_end) {
            return Handled::Kill(format!(
                "Data-Out at {offset}+{dlen} outside the expected {}..{seq_end}",
                task.got
            ));
        }
        // A DataSN gap: an earlier Data-Out of this sequence was lost to a digest error we
        // did not see (§7.9). ERL 0 has no recovery R2T, so §7.8's other choice: discard
        // the data, follow the sequence to its end (DataSN resynchronised on this PDU) and
        // then terminate the task with "protocol service CRC error". The offset still had
        // to be the expected one (DataPDUInOrder=Yes): that is checked above.
        let lost = data_sn != task.exp_data_sn;
        if lost {
            warn!(
                itt = task.itt,
                data_sn,
                expected = task.exp_data_sn,
                "Data-Out DataSN gap: data discarded, the task fails with a protocol CRC error"
            );
            self.tasks[usize::from(t)].data_error = true;
        }
        let keep_end = (offset + dlen as u32).min(task.need);
        if keep_end > offset && (offset < task.win || keep_end > task.win_end()) {
            // Bursts never cross a window and unsolicited data (≤ FirstBurstLength, which
            // login keeps within the largest buffer) lies in the first one.
            return Handled::Kill(format!(
                "Data-Out at {offset}+{dlen} outside the buffer window {}..{}",
                task.win,
                task.win_end()
            ));
        }
        if keep_end > offset && !lost && !task.data_error {
            let conn = self.conns[ci].as_ref().expect("open");
            let n = (keep_end - offset) as usize;
            let src = &conn.rbuf[data_at..data_at + n];
            let at = (offset - task.win) as usize;
            self.pool.buf_mut(task.buf)[at..at + n].copy_from_slice(src);
        }
        self.conns[ci].as_mut().expect("open").data_pdus += 1;
        let tk = &mut self.tasks[usize::from(t)];
        tk.got += dlen as u32;
        tk.exp_data_sn = data_sn.wrapping_add(1);
        if bhs.final_bit() {
            if solicited {
                if tk.got != seq_end {
                    return Handled::Kill("R2T burst ended short".into());
                }
                tk.r2t_done += 1;
            } else {
                tk.unsol_done = true;
            }
            tk.exp_data_sn = 0;
        }
        self.data_progress(t, io);
        Handled::Consumed
    }

    /// Aborts every live task matching `pred(task, ci)`: no reply is sent for them; those in
    /// the array are released when they complete. Returns how many it aborted.
    fn abort_where(&mut self, pred: impl Fn(&Task, usize) -> bool, ci: usize) -> usize {
        let mut n = 0;
        for i in 0..self.tasks.len() {
            let t = &mut self.tasks[i];
            if t.live && !t.aborted && pred(t, ci) {
                t.aborted = true;
                n += 1;
                self.maybe_release(i as u16);
            }
        }
        n
    }

    fn task_management(&mut self, ci: usize, bhs: &Bhs) {
        let function = bhs.flags() & 0x7f;
        let rtt = bhs.u32_at(20);
        let session = self.conns[ci].as_ref().expect("open").session;
        let ref_cmd_sn = bhs.u32_at(32);
        let response = match function {
            // ABORT TASK (RFC 7143 §11.5.1): "Function complete" when the task was found
            // and terminated before its status was decided, or when it was never received
            // (RefCmdSN inside the CmdSN window: it is considered received, rule b);
            // "Task does not exist" (§11.6.1 response 1) when it has finished — its
            // status is decided (a reply queued or sent) and RefCmdSN is behind the window
            // (rule c) — so the initiator never gets both its status and an abort.
            1 => {
                let found = self.abort_where(
                    |t, _| t.session == session && t.itt == rtt && t.stage != Stage::Reply,
                    ci,
                );
                let s = self.sessions[session].as_ref().expect("session");
                let in_window =
                    pdu::sn_le(s.exp_cmd_sn, ref_cmd_sn) && pdu::sn_le(ref_cmd_sn, s.max_cmd_sn());
                if found > 0 || in_window {
                    0
                } else {
                    1
                }
            }
            // ABORT TASK SET, CLEAR TASK SET: this session's tasks.
            2 | 4 => {
                self.abort_where(|t, _| t.session == session, ci);
                0
            }
            // LOGICAL UNIT RESET, TARGET WARM RESET: every task of the logical unit, on
            // this reactor now and on the others in their next turn (TAS=0: other
            // sessions' tasks end without status, SAM-5 §5.6); RESERVE(6) released, the
            // other nexuses get BUS DEVICE RESET FUNCTION OCCURRED (SPC-4 §5.13.1).
            5 | 6 => {
                self.abort_where(|_, _| true, ci);
                self.pr_reset(session);
                0
            }
            // TARGET COLD RESET (§11.5.1): a warm reset, then every connection of every
            // session closes (this one once the response is sent).
            7 => {
                self.abort_where(|_, _| true, ci);
                self.pr_reset(session);
                self.cold_reset(session);
                0
            }
            // CLEAR ACA (no ACA): not supported; TASK REASSIGN: not at ERL 0 (§11.6.1
            // response 4).
            3 => 5,
            8 => 4,
            _ => 255,
        };
        let conn = self.conns[ci].as_mut().expect("open");
        let s = self.sessions[conn.session].as_ref().expect("session");
        let (exp, max) = (s.exp_cmd_sn, s.max_cmd_sn());
        let st = next_stat(conn);
        let h = Header::new(op::TMF_RESP, 0x80, 0, bhs.itt())
            .byte(2, response)
            .u32(24, st)
            .u32(28, exp)
            .u32(32, max);
        stage(conn, &h, &[]);
        if function == 7 {
            conn.life = Life::Draining;
        }
        info!(conn = conn.id, function, response, "task management");
    }

    fn retry<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
        let mut progress = false;
        while let Some(&t) = self.pending.front() {
            let task = self.tasks[usize::from(t)];
            if task.aborted {
                self.pending.pop_front();
                self.tasks[usize::from(t)].in_pending = false;
                self.maybe_release(t);
                progress = true;
                continue;
            }
            let req = match self.next_request(t) {
                Ok(Some(r)) => r,
                Ok(None) => {
                    self.pending.pop_front();
                    self.tasks[usize::from(t)].in_pending = false;
                    self.reply(t);
                    progress = true;
                    continue;
                }
                Err(s) => {
                    self.pending.pop_front();
                    let tk = &mut self.tasks[usize::from(t)];
                    tk.in_pending = false;
                    tk.status = status::CHECK_CONDITION;
                    tk.sense = Some(s);
                    tk.din = 0;
                    self.reply(t);
                    progress = true;
                    continue;
                }
            };
            match io.submit(req) {
                Ok(()) => {
                    self.pending.pop_front();
                    let tk = &mut self.tasks[usize::from(t)];
                    tk.in_pending = false;
                    tk.in_array = true;
                    progress = true;
                }
                Err(ArrayError::QueueFull) => break,
                Err(e) => {
                    self.pending.pop_front();
                    self.tasks[usize::from(t)].in_pending = false;
                    self.failed(t, e);
                    progress = true;
                }
            }
        }
        progress
    }

    fn close(&mut self, ci: usize, why: &str) {
        let conn = self.conns[ci].as_mut().expect("present");
        if conn.life == Life::Closed {
            return;
        }
        if why.is_empty() {
            debug!(conn = conn.id, "closing connection");
        } else {
            warn!(conn = conn.id, peer = %conn.peer, "closing iSCSI connection: {why}");
        }
        conn.stream = None;
        conn.life = Life::Closed;
        conn.linger_until = None;
        // Its tasks are terminated (ERL 0); replies queued for it are dropped.
        while let Some(t) = conn.out.pop_front() {
            self.tasks[usize::from(t)].queued_out = false;
        }
        self.abort_where(|t, c| usize::from(t.conn) == c, ci);
    }

    /// Ends connection `ci`, every task of which was answered (drained, logged out):
    /// our side is shut down so the initiator reads every reply and then the end of
    /// stream, and the socket lingers ([`Life::Lingering`]) until the initiator closes its
    /// side or [`LINGER`] passes. Closing at once with the initiator's unread bytes
    /// (commands sent after the drain began, their immediate data) would reset the
    /// connection and could lose replies already sent.
    fn end_gracefully(&mut self, ci: usize) {
        let conn = self.conns[ci].as_mut().expect("present");
        debug_assert!(conn.tasks == 0 && conn.out.is_empty() && conn.tstart == conn.tend);
        let shut = conn
            .stream
            .as_ref()
            .is_some_and(|s| s.shutdown_write().is_ok());
        if !shut {
            self.close(ci, "");
            return;
        }
        debug!(conn = conn.id, "every reply sent: our side shut down");
        conn.life = Life::Lingering;
        conn.linger_until = Some(Instant::now() + LINGER);
    }

    /// A lingering connection's turn: discards what its initiator sends and closes the
    /// socket once the initiator closed its side, [`LINGER`] passed, or `cut` (a drain
    /// grace period expired, the session was reinstated or revoked). Returns whether
    /// anything moved (bytes discarded, the socket closed).
    fn linger(&mut self, ci: usize, cut: bool) -> bool {
        let conn = self.conns[ci].as_mut().expect("present");
        debug_assert_eq!(conn.life, Life::Lingering);
        let seen = match conn.stream.as_mut() {
            Some(s) if !cut => discard_unread(s, &mut conn.rbuf),
            _ => Discarded::Ended,
        };
        let done = match seen {
            Discarded::Ended => true,
            Discarded::Bytes(_) => conn.linger_until.is_none_or(|t| Instant::now() >= t),
        };
        if done {
            self.close(ci, "");
        }
        done || seen != Discarded::Bytes(0)
    }

    /// Frees a closed connection's slot once no task refers to it, and its session with
    /// its last connection.
    fn reap(&mut self, ci: usize) -> bool {
        let conn = self.conns[ci].as_ref().expect("present");
        if conn.life != Life::Closed || conn.tasks > 0 {
            return false;
        }
        let sidx = conn.session;
        self.conns[ci] = None;
        self.live_freed = true;
        self.active -= 1;
        let s = self.sessions[sidx].as_mut().expect("session");
        s.conns -= 1;
        if s.conns == 0 {
            let tsih = s.tsih;
            // Nexus loss: its RESERVE(6) goes, registrations stay (SPC-4 §5.13.1).
            {
                let mut st = self.shared.pr_lock();
                if st.detach(&s.nexus) {
                    self.shared.pr_epoch.fetch_add(1, Ordering::AcqRel);
                }
            }
            self.sessions[sidx] = None;
            // Off the hot path: a session ends at most once per login.
            self.shared.forget_session(tsih);
            info!(tsih, "iSCSI session ended");
        }
        true
    }

    fn latch_finished(&mut self) {
        if !self.finished && self.shared.shutdown.load(Ordering::Acquire) {
            debug_assert_eq!(self.free_tasks.len(), self.tasks.len());
            debug_assert_eq!(self.pool.free_count(), self.pool.len());
            info!(reactor = self.reactor, "iSCSI front-end drained");
            self.finished = true;
        }
    }
}

/// Reservations ([`super::pr`]): the per-command gate and the reservation commands.
impl IscsiFrontend {
    /// The reservation verdict on a command of session `sidx` (SPC-4 §5.13, SAM-5 §5.14):
    /// `plan` unchanged, [`Plan::Conflict`], or a pending unit attention as CHECK
    /// CONDITION (REQUEST SENSE gets it as its data). One atomic load when the state did
    /// not change since this session last looked; the mutex only when it did, or to take a
    /// unit attention.
    fn pr_gate(&mut self, sidx: usize, cdb: &[u8; 16], plan: Plan, scratch: &mut [u8]) -> Plan {
        let shared = &self.shared;
        let s = self.sessions[sidx].as_mut().expect("session");
        let epoch = shared.pr_epoch.load(Ordering::Acquire);
        if epoch != s.pr_seen {
            let st = shared.pr_lock();
            s.pr_view = st.view(&s.nexus);
            s.pr_seen = shared.pr_epoch.load(Ordering::Acquire);
        }
        let take_ua = match s.pr_view.check(cdb) {
            Verdict::Go => s.pr_view.ua && cdb[0] == scsi::opc::REQUEST_SENSE,
            Verdict::Conflict => return Plan::Conflict,
            Verdict::UnitAttention => true,
        };
        if !take_ua {
            return plan;
        }
        let pending = {
            let mut st = shared.pr_lock();
            let u = st.take_ua(&s.nexus);
            s.pr_view = st.view(&s.nexus);
            u
        };
        let Some(sense) = pending else {
            // Taken meanwhile (another session of the nexus): judge again.
            return match s.pr_view.check(cdb) {
                Verdict::Conflict => Plan::Conflict,
                _ => plan,
            };
        };
        debug!(
            tsih = s.tsih,
            asc = sense.asc,
            ascq = sense.ascq,
            "unit attention"
        );
        if cdb[0] != scsi::opc::REQUEST_SENSE {
            return Plan::Check(sense);
        }
        // REQUEST SENSE returns the unit attention as its sense data (SPC-4 §6.29).
        let alloc = u32::from(cdb[4]);
        let n = if cdb[1] & 1 != 0 {
            scratch[..8].fill(0);
            scratch[0] = 0x72;
            scratch[1] = sense.key;
            scratch[2] = sense.asc;
            scratch[3] = sense.ascq;
            8
        } else {
            scratch[..18].copy_from_slice(&sense.fixed());
            18
        };
        Plan::Data { len: alloc.min(n) }
    }

    /// Runs a reservation command whose data-out (if any) is in: under the state's mutex,
    /// then GOOD, RESERVATION CONFLICT or CHECK CONDITION — or, when APTPL needs a save,
    /// the task waits for the persister thread ([`IscsiFrontend::pr_saved`]).
    fn pr_execute(&mut self, t: u16) {
        let task = self.tasks[usize::from(t)];
        let nexus = self.sessions[task.session]
            .as_ref()
            .expect("session")
            .nexus
            .clone();
        // The task keeps no CDB: the plan carries what the state machine reads of it.
        let mut cdb = [0u8; 16];
        match task.plan {
            Plan::PrIn { sa, .. } => cdb[1] = sa,
            Plan::PrOut {
                param_bytes,
                sa,
                scope_type,
            } => {
                cdb[1] = sa;
                cdb[2] = scope_type;
                cdb[5..9].copy_from_slice(&param_bytes.to_be_bytes());
            }
            _ => {}
        }
        let outcome = {
            let mut st = self.shared.pr_lock();
            let o = match task.plan {
                Plan::PrIn { alloc, .. } => match st.pr_in(&cdb) {
                    Ok(data) => {
                        let n = (data.len() as u32).min(alloc).min(task.din_max);
                        self.pool.buf_mut(task.buf)[..n as usize]
                            .copy_from_slice(&data[..n as usize]);
                        let tk = &mut self.tasks[usize::from(t)];
                        tk.din = n;
                        tk.xfer = u64::from((data.len() as u32).min(alloc));
                        Outcome::Good { save: None }
                    }
                    Err(s) => Outcome::Check(s),
                },
                Plan::PrOut { .. } => {
                    let param = &self.pool.buf(task.buf)[..task.need as usize];
                    // A rare management command: the copy lets a change the store cannot
                    // keep be undone whole.
                    let before = self.shared.pr_capacity.map(|_| st.clone());
                    match st.pr_out(&nexus, &cdb, param) {
                        Outcome::Good { save: Some(b) }
                            if self.shared.pr_capacity.is_some_and(|c| b.len() > c) =>
                        {
                            *st = before.expect("cloned when a capacity is set");
                            warn!(
                                bytes = b.len(),
                                "persistent-reservation state too large for the store: refused"
                            );
                            Outcome::Check(super::pr::INSUFFICIENT_REGISTRATION)
                        }
                        o => o,
                    }
                }
                Plan::Reserve6 => st.reserve6(&nexus, &cdb),
                Plan::Release6 => st.release6(&nexus, &cdb),
                _ => Outcome::Check(Sense::INVALID_OPCODE),
            };
            if !matches!(task.plan, Plan::PrIn { .. }) && matches!(o, Outcome::Good { .. }) {
                self.shared.pr_epoch.fetch_add(1, Ordering::AcqRel);
            }
            // Queued under the lock: saves reach the store in the order of the changes.
            if let Outcome::Good { save: Some(bytes) } = &o {
                let ticket = Arc::new(AtomicU8::new(super::SAVE_PENDING));
                let job = super::SaveJob {
                    bytes: bytes.clone(),
                    ticket: Arc::clone(&ticket),
                };
                match self.shared.pr_saver.as_ref().map(|s| s.send(job)) {
                    Some(Ok(())) => {
                        self.tasks[usize::from(t)].in_pr = true;
                        self.pr_waits.push((t, ticket));
                        return;
                    }
                    _ => Outcome::Check(super::pr::SAVE_FAILED),
                }
            } else {
                o
            }
        };
        self.pr_finish(t, outcome);
    }

    fn pr_finish(&mut self, t: u16, o: Outcome) {
        let tk = &mut self.tasks[usize::from(t)];
        match o {
            Outcome::Good { .. } => tk.status = status::GOOD,
            Outcome::Conflict => {
                tk.status = status::RESERVATION_CONFLICT;
                tk.din = 0;
            }
            Outcome::Check(s) => {
                tk.status = status::CHECK_CONDITION;
                tk.sense = Some(s);
                tk.din = 0;
            }
        }
        self.reply(t);
    }

    /// Finishes tasks whose APTPL save completed: GOOD once durable, CHECK CONDITION
    /// MEDIUM ERROR / WRITE ERROR when it failed ([`super::pr::SAVE_FAILED`]).
    fn pr_saved(&mut self) -> bool {
        let mut progress = false;
        let mut i = 0;
        while i < self.pr_waits.len() {
            let (t, ref ticket) = self.pr_waits[i];
            let r = ticket.load(Ordering::Acquire);
            if r == super::SAVE_PENDING {
                i += 1;
                continue;
            }
            self.pr_waits.swap_remove(i);
            progress = true;
            let tk = &mut self.tasks[usize::from(t)];
            tk.in_pr = false;
            if tk.aborted {
                self.maybe_release(t);
                continue;
            }
            let o = if r == super::SAVE_DONE {
                Outcome::Good { save: None }
            } else {
                Outcome::Check(super::pr::SAVE_FAILED)
            };
            self.pr_finish(t, o);
        }
        progress
    }

    /// Aborts the tasks of sessions whose nexus a PREEMPT AND ABORT removed since they
    /// last looked (SPC-4 §5.13.11.5; no status is sent for them, TAS = 0), refreshing
    /// every session's view. Returns whether any task was aborted.
    fn pr_preempt_aborts(&mut self) -> bool {
        let mut any = false;
        {
            let st = self.shared.pr_lock();
            let epoch = self.shared.pr_epoch.load(Ordering::Acquire);
            for s in self.sessions.iter_mut().flatten() {
                s.pr_view = st.view(&s.nexus);
                s.pr_seen = epoch;
                any |= s.pr_view.aborts > s.pr_aborts;
            }
        }
        if !any {
            return false;
        }
        let mut n = 0;
        for sidx in 0..self.sessions.len() {
            let Some(s) = self.sessions[sidx].as_mut() else {
                continue;
            };
            if s.pr_view.aborts <= s.pr_aborts {
                continue;
            }
            s.pr_aborts = s.pr_view.aborts;
            let tsih = s.tsih;
            n += self.abort_where(|t, _| t.session == sidx, 0);
            info!(
                tsih,
                "PREEMPT AND ABORT: the preempted nexus's tasks aborted"
            );
        }
        n > 0
    }

    /// Acts on reservation changes and resets made on other reactors since this front end
    /// last looked (one atomic load when there are none): tasks of a nexus that a PREEMPT
    /// AND ABORT removed end without status (SPC-4 §5.13.11.5), and so does every task after
    /// a LOGICAL UNIT RESET / TARGET WARM RESET (SAM-5 §6.3, TAS = 0). Run at the start of
    /// every turn and before any solicited or unsolicited data is taken: the initiator
    /// that sent the PREEMPT AND ABORT may have its GOOD status, and the preempted
    /// initiator's late Data-Out, before this reactor's next turn. Returns whether a task
    /// was aborted.
    fn pr_catch_up(&mut self) -> bool {
        let epoch = self.shared.pr_epoch.load(Ordering::Acquire);
        if epoch == self.pr_turn_epoch {
            return false;
        }
        self.pr_turn_epoch = epoch;
        let mut aborted = self.pr_preempt_aborts();
        let resets = self.shared.lun_resets.load(Ordering::Acquire);
        if resets != self.lun_resets_seen {
            self.lun_resets_seen = resets;
            let n = self.abort_where(|_, _| true, 0);
            info!(
                reactor = self.reactor,
                aborted = n,
                "logical unit reset on another reactor: tasks aborted"
            );
            aborted = true;
        }
        aborted
    }

    /// LOGICAL UNIT RESET / TARGET RESET from session `sidx` (SPC-4 §5.13.1, SAM-5 §6.3).
    fn pr_reset(&mut self, sidx: usize) {
        let s = self.sessions[sidx].as_ref().expect("session");
        let mut st = self.shared.pr_lock();
        st.reset(&s.nexus);
        // The other reactors abort their tasks in their next turn (seeing the epoch move);
        // this one has already.
        self.lun_resets_seen = self.shared.lun_resets.fetch_add(1, Ordering::AcqRel) + 1;
        self.shared.pr_epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// TARGET COLD RESET: every other session (on every reactor) is revoked, this
    /// session's other connections close.
    fn cold_reset(&mut self, sidx: usize) {
        let tsih = self.sessions[sidx].as_ref().expect("session").tsih;
        {
            let reg = self
                .shared
                .sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            for (t, e) in reg.iter() {
                if *t != tsih {
                    e.revoked.store(true, Ordering::Release);
                }
            }
        }
        info!(tsih, "target cold reset: closing every other session");
    }
}

impl Frontend for IscsiFrontend {
    fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
        let mut progress = false;
        while let Some(nc) = pop_if_any(&self.inbox) {
            self.adopt(nc);
            progress = true;
        }
        if !self.pr_waits.is_empty() {
            progress |= self.pr_saved();
        }
        // One atomic load per turn: a reservation change (another reactor's PREEMPT AND
        // ABORT) is looked at here rather than at its victims' next commands.
        progress |= self.pr_catch_up();
        self.turns = self.turns.wrapping_add(1);
        let clock = self.turns.is_multiple_of(CLOCK_EVERY) && self.active > 0;
        let now = if clock { Some(Instant::now()) } else { None };
        let mut expired = false;
        if self.shared.shutdown.load(Ordering::Acquire) {
            let now = Instant::now();
            match self.drain_deadline {
                None => {
                    self.drain_deadline = Some(now + self.shared.config.drain_grace);
                    for c in self.conns.iter_mut().flatten() {
                        if c.life == Life::Open {
                            c.life = Life::Draining;
                        }
                    }
                    progress = true;
                }
                Some(d) => expired = now >= d,
            }
        }
        if self.active == 0 && self.pending.is_empty() {
            self.latch_finished();
            return progress;
        }
        progress |= self.retry(io);
        self.payload_budget = PAYLOAD_BYTES_PER_TURN;
        // Only the occupied slots are visited (a table walk would touch every slot's
        // cache lines each turn); `live` changes only in `adopt` (above) and in `reap`,
        // whose freed slots are dropped from it after the walk.
        let n = self.live.len();
        let mut at = if n == 0 { 0 } else { self.first % n };
        let mut spent = false;
        for _ in 0..n {
            let li = at;
            at += 1;
            if at == n {
                at = 0;
            }
            let ci = usize::from(self.live[li]);
            let Some(conn) = self.conns[ci].as_mut() else {
                continue;
            };
            if conn.life == Life::Lingering {
                let s = self.sessions[conn.session].as_ref().expect("session");
                let cut = expired || s.revoked.load(Ordering::Acquire);
                progress |= self.linger(ci, cut);
                progress |= self.reap(ci);
                continue;
            }
            if conn.life != Life::Closed {
                let s = self.sessions[conn.session].as_ref().expect("session");
                if s.revoked.load(Ordering::Acquire) {
                    self.close(ci, "session reinstated or revoked");
                    progress = true;
                } else if expired {
                    self.close(ci, "shutdown grace period expired");
                    progress = true;
                }
            }
            let conn = self.conns[ci].as_mut().expect("present");
            if conn.life != Life::Closed {
                self.pump(ci);
                let conn = self.conns[ci].as_mut().expect("present");
                match Self::flush(conn) {
                    Ok(p) => progress |= p,
                    Err(e) => {
                        self.close(ci, &format!("send: {e}"));
                        progress = true;
                    }
                }
            }
            let conn = self.conns[ci].as_mut().expect("present");
            if conn.life != Life::Closed {
                let budget_before = self.payload_budget;
                let (p, end) = self.read_pdus(ci, io);
                progress |= p;
                if budget_before > 0 && self.payload_budget == 0 && !spent {
                    // This connection spent the turn's budget: it goes last next turn.
                    spent = true;
                    self.first = li + 1;
                }
                match end {
                    ReadEnd::Paused => {}
                    // Paused by us, not by the initiator: more is waiting, so the next
                    // turn comes without a rest (and this is no stall).
                    ReadEnd::Budget => progress = true,
                    ReadEnd::Eof => {
                        let c = self.conns[ci].as_mut().expect("present");
                        debug!(conn = c.id, "initiator closed its side");
                        self.close(ci, "");
                        progress = true;
                    }
                    ReadEnd::Kill(why) => {
                        self.close(ci, &why);
                        progress = true;
                    }
                }
                let conn = self.conns[ci].as_mut().expect("present");
                if conn.life != Life::Closed {
                    self.pump(ci);
                    let conn = self.conns[ci].as_mut().expect("present");
                    if let Err(e) = Self::flush(conn) {
                        self.close(ci, &format!("send: {e}"));
                    }
                }
            }
            // Solicited data that never comes: tasks waiting for it hold their buffers, so
            // a connection whose initiator sends no Data-Out for the stall timeout while
            // R2Ts are outstanding is cut (its tasks end, the buffers come back).
            if let Some(now) = now {
                let waiting = self.tasks.iter().any(|t| {
                    t.live
                        && usize::from(t.conn) == ci
                        && t.stage == Stage::DataOut
                        && t.r2t_sent > t.r2t_done
                });
                let stall = self.shared.config.stall_timeout;
                let conn = self.conns[ci].as_mut().expect("present");
                if conn.life == Life::Closed || !waiting {
                    conn.stall_mark = None;
                } else {
                    match conn.stall_mark {
                        Some((n, since)) if n == conn.data_pdus => {
                            if now.duration_since(since) >= stall {
                                self.close(ci, &format!("no solicited Data-Out for {stall:?}"));
                                progress = true;
                            }
                        }
                        _ => conn.stall_mark = Some((conn.data_pdus, now)),
                    }
                }
            }
            // Keepalive: an idle connection gets a NOP-In ping; no answer in time: cut.
            if let Some(now) = now {
                let ka = self.shared.config.nop_interval;
                let conn = self.conns[ci].as_mut().expect("present");
                if conn.life == Life::Open && !ka.is_zero() {
                    let idle = now.duration_since(conn.last_rx);
                    match conn.nop_sent {
                        Some(t) if now.duration_since(t) >= self.shared.config.nop_timeout => {
                            self.close(ci, "no answer to NOP-In");
                        }
                        None if idle >= ka && tx_free(conn) >= pdu::pdu_bytes(0, &conn.tx) => {
                            let s = self.sessions[conn.session].as_ref().expect("session");
                            let (exp, max) = (s.exp_cmd_sn, s.max_cmd_sn());
                            let ttt = conn.next_ttt;
                            conn.next_ttt = conn.next_ttt.wrapping_add(1).max(1);
                            let h = Header::new(op::NOP_IN, 0x80, 0, pdu::RESERVED_TAG)
                                .u32(20, ttt)
                                .u32(24, conn.stat_sn)
                                .u32(28, exp)
                                .u32(32, max);
                            stage(conn, &h, &[]);
                            conn.nop_sent = Some(now);
                        }
                        _ => {}
                    }
                }
            }
            let conn = self.conns[ci].as_mut().expect("present");
            if conn.life == Life::Draining && conn.tasks == 0 && conn.tstart == conn.tend {
                self.end_gracefully(ci);
                progress = true;
            }
            progress |= self.reap(ci);
        }
        if self.live_freed {
            self.live_freed = false;
            let conns = &self.conns;
            self.live.retain(|&ci| conns[usize::from(ci)].is_some());
        }
        debug_assert_eq!(self.live.len(), self.active);
        if self.active == 0 && self.pending.is_empty() {
            self.latch_finished();
        }
        progress
    }

    fn complete(&mut self, c: ArrayCompletion) {
        let idx = (c.tag & !TAG_BIT) as usize;
        let Some(task) = self.tasks.get_mut(idx) else {
            warn!(
                tag = c.tag,
                "completion with a tag this front-end never issued"
            );
            return;
        };
        if !(task.live && task.in_array) {
            warn!(
                tag = c.tag,
                "completion for a task that is not in the array"
            );
            return;
        }
        task.in_array = false;
        let t = idx as u16;
        if task.aborted {
            self.maybe_release(t);
            return;
        }
        if let Err(e) = c.status {
            self.failed(t, e);
            return;
        }
        self.step_done(t);
        let bs = self.shared.lun.block_bytes;
        let tk = &mut self.tasks[idx];
        if matches!(tk.plan, Plan::Write { .. }) && tk.win_end() < tk.rw_bytes(bs) {
            // A WRITE longer than its buffer: this window is written; receive the next.
            tk.win = tk.win_end();
            tk.step = 0;
            tk.stage = Stage::DataOut;
            self.solicit(t);
            return;
        }
        // The next step (if any) is submitted from poll: `complete` has no `Io`.
        let tk = &mut self.tasks[idx];
        tk.in_pending = true;
        self.pending.push_back(t);
    }

    fn finished(&self) -> bool {
        self.finished
    }
}
