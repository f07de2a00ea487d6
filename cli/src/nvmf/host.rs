//! A small blocking NVMe/TCP host (initiator), for tests and the `nvmf-load` load
//! generator: ICReq/ICResp, Fabrics Connect, Property Get/Set, admin and I/O commands with
//! in-capsule data, R2T/H2CData and C2HData, pipelined submission. Not a production
//! initiator (the kernel's `nvme-tcp` is the real client): it checks what the target sends
//! strictly and reports any deviation as an error.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use super::pdu::{
    check_icresp, Cqe, Framing, H2cDataHdr, IcReq, Parse, Pdu, PduParser, R2t, RecvLimits, Role,
    SglDescriptor, Sqe, PSDT_SGL,
};
use super::spec::{admin, fctype, feature, prop, MAX_TRANSFER};

/// What the host sends with a command.
#[derive(Debug, Clone, Copy)]
pub enum Data<'a> {
    /// No data.
    None,
    /// Host → controller data: in the capsule when `in_capsule`, else by R2T/H2CData.
    Out {
        /// The data.
        data: &'a [u8],
        /// Send it in the capsule.
        in_capsule: bool,
    },
    /// Controller → host data of this many bytes (C2HData).
    In(u32),
}

/// One event from the controller.
#[derive(Debug)]
pub enum Event {
    /// A completion.
    Resp(Cqe),
    /// Data for command `cid` at `offset`.
    C2h {
        /// Command identifier.
        cid: u16,
        /// Offset in the command's data, bytes.
        offset: u32,
        /// The data.
        data: Vec<u8>,
    },
    /// The controller asks for write data.
    R2t(R2t),
    /// The controller ended the connection with a C2HTermReq.
    Term {
        /// FES.
        fes: u16,
        /// FEI.
        fei: u32,
    },
}

/// One queue pair (one TCP connection).
pub struct HostQueue {
    sock: TcpStream,
    parser: PduParser,
    tx: Framing,
    rx: Vec<u8>,
    start: usize,
    end: usize,
    /// Bytes per H2CData PDU (from ICResp).
    pub maxh2cdata: u32,
}

/// Connect Fabrics parameters.
#[derive(Debug, Clone)]
pub struct ConnectParams {
    /// Subsystem NQN.
    pub subnqn: String,
    /// Host NQN.
    pub hostnqn: String,
    /// Host identifier.
    pub hostid: [u8; 16],
    /// Keep-alive timeout, ms.
    pub kato_ms: u32,
}

fn err(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

impl HostQueue {
    /// Opens a TCP connection and exchanges ICReq/ICResp with the digests asked for.
    ///
    /// # Errors
    /// Socket errors; an ICResp the Linux host would refuse.
    pub fn open(addr: SocketAddr, hdgst: bool, ddgst: bool) -> io::Result<Self> {
        let sock = TcpStream::connect(addr)?;
        sock.set_nodelay(true)?;
        sock.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut q = Self {
            sock,
            parser: PduParser::new(
                Role::Host,
                RecvLimits {
                    max_in_capsule: 0,
                    max_data_pdu: u32::MAX / 2,
                },
            ),
            tx: Framing::default(),
            rx: vec![0; 2 * MAX_TRANSFER as usize + 4096],
            start: 0,
            end: 0,
            maxh2cdata: 0,
        };
        let req = IcReq {
            pfv: 0,
            hpda: 0,
            hdgst_enable: hdgst,
            ddgst_enable: ddgst,
            maxr2t: 0,
        };
        q.send_pdu(&Pdu::IcReq(req))?;
        let resp = q.recv_with(|p, _| match p {
            Pdu::IcResp(r) => Some(r),
            _ => None,
        })?;
        let Some(resp) = resp else {
            return Err(err("expected ICResp"));
        };
        check_icresp(&req, &resp).map_err(|e| err(e.to_string()))?;
        q.maxh2cdata = resp.maxh2cdata;
        let f = Framing {
            hdgst,
            ddgst,
            pda: 0,
        };
        q.tx = f;
        q.parser.set_framing(f);
        Ok(q)
    }

    /// The socket (tests send raw bytes through it).
    pub fn socket(&mut self) -> &mut TcpStream {
        &mut self.sock
    }

    fn send_pdu(&mut self, p: &Pdu<'_>) -> io::Result<()> {
        let mut out = vec![0u8; p.encoded_len(&self.tx)];
        let n = p
            .encode(&self.tx, &mut out)
            .map_err(|e| err(e.to_string()))?;
        self.sock.write_all(&out[..n])
    }

    /// Receives one PDU and hands it to `f` (its data borrows the receive buffer).
    fn recv_with<T>(&mut self, f: impl FnOnce(Pdu<'_>, bool) -> T) -> io::Result<T> {
        loop {
            match self
                .parser
                .parse(&self.rx[self.start..self.end])
                .map_err(|e| err(e.to_string()))?
            {
                Parse::Pdu(r) => {
                    let len = r.len;
                    let out = f(r.pdu, r.data_digest_ok);
                    self.start += len;
                    return Ok(out);
                }
                Parse::Need(n) => {
                    if self.start == self.end {
                        self.start = 0;
                        self.end = 0;
                    } else if self.end + n > self.rx.len() {
                        self.rx.copy_within(self.start..self.end, 0);
                        self.end -= self.start;
                        self.start = 0;
                    }
                    if self.end + n > self.rx.len() {
                        return Err(err("PDU larger than the host's buffer"));
                    }
                    let k = self.sock.read(&mut self.rx[self.end..])?;
                    if k == 0 {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "controller closed the connection",
                        ));
                    }
                    self.end += k;
                }
            }
        }
    }

    /// Sends a command with `data` (the SGL descriptor is set from it).
    ///
    /// # Errors
    /// Socket errors.
    pub fn submit(&mut self, mut sqe: Sqe, data: Data<'_>) -> io::Result<()> {
        sqe.flags = (sqe.flags & 0x3F) | (PSDT_SGL << 6);
        let capsule_data: &[u8] = match data {
            Data::None => {
                sqe.dptr = SglDescriptor::transport(0);
                &[]
            }
            Data::In(n) => {
                sqe.dptr = SglDescriptor::transport(n);
                &[]
            }
            Data::Out { data, in_capsule } => {
                if in_capsule {
                    sqe.dptr = SglDescriptor::in_capsule(data.len() as u32);
                    data
                } else {
                    sqe.dptr = SglDescriptor::transport(data.len() as u32);
                    &[]
                }
            }
        };
        self.send_pdu(&Pdu::CapsuleCmd {
            sqe,
            data: capsule_data,
        })
    }

    /// Answers an R2T with H2CData PDUs from `data` (the command's whole data).
    ///
    /// # Errors
    /// Socket errors; an R2T outside the data.
    pub fn answer_r2t(&mut self, r: &R2t, data: &[u8]) -> io::Result<()> {
        let end = r.r2to as usize + r.r2tl as usize;
        if end > data.len() {
            return Err(err("R2T beyond the command's data"));
        }
        let mut off = r.r2to as usize;
        while off < end {
            let n = (end - off).min(self.maxh2cdata as usize);
            let hdr = H2cDataHdr {
                cccid: r.cccid,
                ttag: r.ttag,
                datao: off as u32,
                last: off + n == end,
            };
            self.send_pdu(&Pdu::H2cData {
                hdr,
                data: &data[off..off + n],
            })?;
            off += n;
        }
        Ok(())
    }

    /// The next event from the controller; C2HData's data goes to `on_data(cid, offset,
    /// data)` (the event then carries an empty `data`).
    ///
    /// # Errors
    /// Socket errors, malformed PDUs, a bad data digest.
    pub fn next_event_with(
        &mut self,
        on_data: &mut dyn FnMut(u16, u32, &[u8]),
    ) -> io::Result<Event> {
        self.recv_with(|p, ok| {
            if !ok {
                return Err(err("data digest error from the controller"));
            }
            Ok(match p {
                Pdu::CapsuleResp(c) => Event::Resp(c),
                Pdu::C2hData { hdr, data } => {
                    on_data(hdr.cccid, hdr.datao, data);
                    Event::C2h {
                        cid: hdr.cccid,
                        offset: hdr.datao,
                        data: Vec::new(),
                    }
                }
                Pdu::R2t(r) => Event::R2t(r),
                Pdu::C2hTermReq(t) => Event::Term {
                    fes: t.fes,
                    fei: t.fei,
                },
                _ => return Err(err("unexpected PDU from the controller")),
            })
        })?
    }

    /// The next event from the controller, C2HData's data copied into the event.
    ///
    /// # Errors
    /// As [`HostQueue::next_event_with`].
    pub fn next_event(&mut self) -> io::Result<Event> {
        let mut got: Option<Vec<u8>> = None;
        let ev = self.next_event_with(&mut |_, _, d| got = Some(d.to_vec()))?;
        Ok(match ev {
            Event::C2h { cid, offset, .. } => Event::C2h {
                cid,
                offset,
                data: got.unwrap_or_default(),
            },
            e => e,
        })
    }

    /// Runs one command to completion (no other command outstanding): returns its CQE
    /// and the data read (for [`Data::In`]).
    ///
    /// # Errors
    /// Socket errors, protocol errors, a TermReq.
    pub fn exec(&mut self, sqe: Sqe, data: Data<'_>) -> io::Result<(Cqe, Vec<u8>)> {
        self.submit(sqe, data)?;
        let mut got = match data {
            Data::In(n) => vec![0u8; n as usize],
            _ => Vec::new(),
        };
        let mut received = 0usize;
        loop {
            match self.next_event()? {
                Event::Resp(c) => {
                    if c.cid != sqe.cid {
                        return Err(err(format!("CQE for CID {} (expected {})", c.cid, sqe.cid)));
                    }
                    if c.status == 0 && received != got.len() {
                        return Err(err(format!(
                            "short data-in: got {received} of {}",
                            got.len()
                        )));
                    }
                    return Ok((c, got));
                }
                Event::C2h { cid, offset, data } => {
                    if cid != sqe.cid || offset as usize != received {
                        return Err(err("C2HData out of order"));
                    }
                    let end = offset as usize + data.len();
                    if end > got.len() {
                        return Err(err("C2HData beyond the transfer"));
                    }
                    got[offset as usize..end].copy_from_slice(&data);
                    received = end;
                }
                Event::R2t(r) => match data {
                    Data::Out { data, .. } => self.answer_r2t(&r, data)?,
                    _ => return Err(err("R2T for a command without write data")),
                },
                Event::Term { fes, fei } => {
                    return Err(err(format!("C2HTermReq FES {fes} FEI {fei}")))
                }
            }
        }
    }

    /// Fabrics Connect of queue `qid` with SQ size `sqsize` (0's based) to controller
    /// `cntlid` (FFFFh: a new one). Returns the CQE (DW0 = CNTLID on success).
    ///
    /// # Errors
    /// As [`HostQueue::exec`].
    pub fn connect(
        &mut self,
        qid: u16,
        sqsize: u16,
        cntlid: u16,
        p: &ConnectParams,
    ) -> io::Result<Cqe> {
        let mut d = vec![0u8; 1024];
        d[..16].copy_from_slice(&p.hostid);
        d[16..18].copy_from_slice(&cntlid.to_le_bytes());
        d[256..256 + p.subnqn.len()].copy_from_slice(p.subnqn.as_bytes());
        d[512..512 + p.hostnqn.len()].copy_from_slice(p.hostnqn.as_bytes());
        let sqe = Sqe {
            opcode: admin::FABRICS,
            cid: 0,
            nsid: u32::from(fctype::CONNECT),
            cdw10: u32::from(qid) << 16,
            cdw11: u32::from(sqsize),
            cdw12: if qid == 0 { p.kato_ms } else { 0 },
            ..Sqe::default()
        };
        Ok(self
            .exec(
                sqe,
                Data::Out {
                    data: &d,
                    in_capsule: true,
                },
            )?
            .0)
    }

    /// Property Get at `offset` (8 bytes for CAP, else 4).
    ///
    /// # Errors
    /// As [`HostQueue::exec`]; a failed status.
    pub fn prop_get(&mut self, offset: u32) -> io::Result<u64> {
        let sqe = Sqe {
            opcode: admin::FABRICS,
            cid: 1,
            nsid: u32::from(fctype::PROPERTY_GET),
            cdw10: u32::from(offset == prop::CAP),
            cdw11: offset,
            ..Sqe::default()
        };
        let (c, _) = self.exec(sqe, Data::None)?;
        if c.status != 0 {
            return Err(err(format!(
                "Property Get {offset:#x}: status {:#x}",
                c.status
            )));
        }
        Ok(u64::from(c.dw0) | (u64::from(c.dw1) << 32))
    }

    /// Property Set (4 bytes) at `offset`.
    ///
    /// # Errors
    /// As [`HostQueue::prop_get`].
    pub fn prop_set(&mut self, offset: u32, value: u32) -> io::Result<()> {
        let sqe = Sqe {
            opcode: admin::FABRICS,
            cid: 2,
            nsid: u32::from(fctype::PROPERTY_SET),
            cdw11: offset,
            cdw12: value,
            ..Sqe::default()
        };
        let (c, _) = self.exec(sqe, Data::None)?;
        if c.status != 0 {
            return Err(err(format!(
                "Property Set {offset:#x}: status {:#x}",
                c.status
            )));
        }
        Ok(())
    }

    /// The admin queue bring-up of the Linux host (research note §1.7): CC.EN = 0 then
    /// CC.EN = 1 with the entry sizes, wait for CSTS.RDY.
    ///
    /// # Errors
    /// As [`HostQueue::prop_get`]; RDY not set within 5 s.
    pub fn enable(&mut self) -> io::Result<()> {
        self.prop_set(prop::CC, 0)?;
        let cc = 1 | (6 << 16) | (4 << 20);
        self.prop_set(prop::CC, cc)?;
        for _ in 0..500 {
            if self.prop_get(prop::CSTS)? & 1 == 1 {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(err("CSTS.RDY never set"))
    }

    /// Get Log Page of log `lid` (Base 2.0 §5.16): `len` bytes (a multiple of 4) from byte
    /// `offset`, with LSP `lsp` (CDW10 11:8) and RAE (CDW10 bit 15). Returns the CQE and
    /// the data.
    ///
    /// # Errors
    /// As [`HostQueue::exec`].
    pub fn get_log_page(
        &mut self,
        cid: u16,
        lid: u8,
        lsp: u8,
        rae: bool,
        len: u32,
        offset: u64,
    ) -> io::Result<(Cqe, Vec<u8>)> {
        let numd = (len / 4).max(1) - 1;
        let sqe = Sqe {
            opcode: admin::GET_LOG_PAGE,
            cid,
            nsid: 0xFFFF_FFFF,
            cdw10: u32::from(lid)
                | (u32::from(lsp & 0xF) << 8)
                | (u32::from(rae) << 15)
                | ((numd & 0xFFFF) << 16),
            cdw11: numd >> 16,
            cdw12: offset as u32,
            cdw13: (offset >> 32) as u32,
            ..Sqe::default()
        };
        self.exec(sqe, Data::In(len))
    }

    /// Set Features `fid` with CDW11 `value` (e.g. Asynchronous Event Configuration 0Bh,
    /// bit 11 for ANA change notices). Returns the CQE.
    ///
    /// # Errors
    /// As [`HostQueue::exec`].
    pub fn set_features(&mut self, cid: u16, fid: u8, value: u32) -> io::Result<Cqe> {
        let sqe = Sqe {
            opcode: admin::SET_FEATURES,
            cid,
            cdw10: u32::from(fid),
            cdw11: value,
            ..Sqe::default()
        };
        Ok(self.exec(sqe, Data::None)?.0)
    }

    /// Enables the asynchronous events of `mask` (Set Features 0Bh).
    ///
    /// # Errors
    /// As [`HostQueue::set_features`]; a failed status.
    pub fn enable_events(&mut self, cid: u16, mask: u32) -> io::Result<()> {
        let c = self.set_features(cid, feature::ASYNC_EVENT_CONFIG, mask)?;
        if c.status != 0 {
            return Err(err(format!("Set Features AEC: status {:#x}", c.status)));
        }
        Ok(())
    }

    /// Submits an Asynchronous Event Request with CID `cid` (it completes when the
    /// controller has an event: read it with [`HostQueue::next_event`]).
    ///
    /// # Errors
    /// Socket errors.
    pub fn submit_aer(&mut self, cid: u16) -> io::Result<()> {
        let sqe = Sqe {
            opcode: admin::AER,
            cid,
            ..Sqe::default()
        };
        self.submit(sqe, Data::None)
    }
}
