//! PDU layer tests. The byte vectors are written out from the layouts of TCP 1.0
//! §3.6.2.x (field by field, little-endian), not produced by the encoder.

use super::*;
use rand::{Rng, SeedableRng};

const LIMITS: RecvLimits = RecvLimits {
    max_in_capsule: 8192,
    max_data_pdu: 131072,
};

const DIGESTS: Framing = Framing {
    hdgst: true,
    ddgst: true,
    pda: 0,
};

/// ICReq as the Linux 6.1 host sends it: PFV 0, HPDA 0, DGST as given, MAXR2T 0.
fn icreq_bytes(dgst: u8) -> Vec<u8> {
    let mut b = vec![0x00, 0x00, 128, 0, 128, 0, 0, 0];
    b.extend_from_slice(&[0, 0]); // PFV
    b.push(0); // HPDA
    b.push(dgst); // DGST
    b.extend_from_slice(&[0, 0, 0, 0]); // MAXR2T
    b.resize(128, 0);
    b
}

/// A controller parser past ICReq, with `framing`.
fn controller(framing: Framing) -> PduParser {
    let mut p = PduParser::new(Role::Controller, LIMITS);
    let b = icreq_bytes(u8::from(framing.hdgst) | (u8::from(framing.ddgst) << 1));
    assert!(matches!(p.parse(&b), Ok(Parse::Pdu(_))));
    p.set_framing(framing);
    p
}

/// A host parser past ICResp, with `framing`.
fn host(framing: Framing) -> PduParser {
    let mut p = PduParser::new(Role::Host, LIMITS);
    let mut b = vec![0x01, 0x00, 128, 0, 128, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    b.resize(128, 0);
    assert!(matches!(p.parse(&b), Ok(Parse::Pdu(_))));
    p.set_framing(framing);
    p
}

fn pdu<'a>(p: &mut PduParser, b: &'a [u8]) -> Received<'a> {
    match p.parse(b) {
        Ok(Parse::Pdu(r)) => r,
        other => panic!("expected a PDU, got {other:?}"),
    }
}

fn err(p: &mut PduParser, b: &[u8]) -> PduError {
    match p.parse(b) {
        Err(e) => e,
        other => panic!("expected an error, got {other:?}"),
    }
}

fn crc(b: &[u8]) -> [u8; 4] {
    crc32c::crc32c(b).to_le_bytes()
}

/// A Write of one block at LBA 0x10 (CID 0x1234, NSID 1), SGL as given: the 64 SQE bytes.
fn write_sqe_bytes(sgl_len: u32, sgl_id: u8) -> Vec<u8> {
    let mut b = vec![0x01, 0x40, 0x34, 0x12, 1, 0, 0, 0]; // OPC, PSDT=01b, CID, NSID
    b.extend_from_slice(&[0; 8]); // CDW2-3
    b.extend_from_slice(&[0; 8]); // MPTR
    b.extend_from_slice(&[0; 8]); // SGL1 address
    b.extend_from_slice(&sgl_len.to_le_bytes()); // SGL1 length
    b.extend_from_slice(&[0, 0, 0, sgl_id]); // reserved, SGL identifier
    b.extend_from_slice(&[0x10, 0, 0, 0]); // CDW10: SLBA low
    b.extend_from_slice(&[0; 20]); // CDW11-15
    assert_eq!(b.len(), 64);
    b
}

fn write_sqe(sgl: SglDescriptor) -> Sqe {
    Sqe {
        opcode: 0x01,
        flags: 0x40,
        cid: 0x1234,
        nsid: 1,
        dptr: sgl,
        cdw10: 0x10,
        ..Sqe::default()
    }
}

#[test]
fn crc32c_is_castagnoli() {
    // The CRC-32C check value (RFC 3720 B.4 / the Castagnoli catalogue).
    assert_eq!(digest(b"123456789"), 0xE306_9283);
    assert_eq!(digest_append(digest(b"1234"), b"56789"), 0xE306_9283);
}

#[test]
fn icreq_decodes() {
    let mut p = PduParser::new(Role::Controller, LIMITS);
    let b = icreq_bytes(0x03);
    let r = pdu(&mut p, &b);
    assert_eq!(r.len, 128);
    assert_eq!(
        r.pdu,
        Pdu::IcReq(IcReq {
            pfv: 0,
            hpda: 0,
            hdgst_enable: true,
            ddgst_enable: true,
            maxr2t: 0
        })
    );
    assert!(p.ic_done());
    let mut out = [0u8; 128];
    assert_eq!(r.pdu.encode(&DIGESTS, &mut out), Ok(128));
    assert_eq!(out[..], b[..], "ICReq is never digested");
}

#[test]
fn icresp_encodes_to_the_spec_layout() {
    let req = IcReq {
        hdgst_enable: true,
        ..IcReq::default()
    };
    let n = negotiate(&req, &IcPolicy::new(131072).unwrap()).unwrap();
    assert_eq!(check_icresp(&req, &n.resp), Ok(()));
    assert!(n.rx.hdgst && !n.rx.ddgst && n.tx.hdgst && !n.tx.ddgst);
    assert_eq!(n.max_r2t, 1);
    let mut want = vec![0x01, 0x00, 128, 0, 128, 0, 0, 0]; // CH
    want.extend_from_slice(&[0, 0, 0, 0x01]); // PFV, CPDA, DGST: HDGST_ENABLE
    want.extend_from_slice(&[0x00, 0x00, 0x02, 0x00]); // MAXH2CDATA 128 KiB
    want.resize(128, 0);
    let mut out = [0xffu8; 128];
    assert_eq!(Pdu::IcResp(n.resp).encode(&n.tx, &mut out), Ok(128));
    assert_eq!(out[..], want[..]);
    let mut h = PduParser::new(Role::Host, LIMITS);
    assert_eq!(pdu(&mut h, &want).pdu, Pdu::IcResp(n.resp));
}

#[test]
fn capsule_cmd_with_in_capsule_data() {
    let mut b = vec![0x04, 0x00, 72, 72, 76, 0, 0, 0];
    b.extend_from_slice(&write_sqe_bytes(4, 0x01));
    b.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
    let mut p = controller(Framing::default());
    let r = pdu(&mut p, &b);
    let Pdu::CapsuleCmd { sqe, data } = r.pdu else {
        panic!("{:?}", r.pdu)
    };
    assert_eq!(sqe, write_sqe(SglDescriptor::in_capsule(4)));
    assert_eq!((sqe.psdt(), sqe.fuse()), (PSDT_SGL, 0));
    assert_eq!(sqe.dptr.kind(), SglKind::InCapsule);
    assert_eq!(data, [0xde, 0xad, 0xbe, 0xef]);
    assert_eq!((r.len, r.data_digest_ok), (76, true));
    let mut out = [0u8; 76];
    assert_eq!(r.pdu.encode(&Framing::default(), &mut out), Ok(76));
    assert_eq!(out[..], b[..]);
}

#[test]
fn capsule_cmd_with_digests() {
    // CH: HDGSTF|DDGSTF, PDO = 72 + 4, PLEN = 76 + 4 data + 4 DDGST.
    let mut b = vec![0x04, 0x03, 72, 76, 84, 0, 0, 0];
    b.extend_from_slice(&write_sqe_bytes(4, 0x01));
    let h = crc(&b);
    b.extend_from_slice(&h);
    b.extend_from_slice(&[1, 2, 3, 4]);
    b.extend_from_slice(&crc(&[1, 2, 3, 4]));
    let mut p = controller(DIGESTS);
    let r = pdu(&mut p, &b);
    assert_eq!(
        r.pdu,
        Pdu::CapsuleCmd {
            sqe: write_sqe(SglDescriptor::in_capsule(4)),
            data: &[1, 2, 3, 4]
        }
    );
    assert!(r.data_digest_ok);
    let mut out = [0u8; 84];
    assert_eq!(r.pdu.encode(&DIGESTS, &mut out), Ok(84));
    assert_eq!(out[..], b[..]);

    // A wrong data digest is not fatal: the PDU comes with data_digest_ok false.
    let mut bad = b.clone();
    bad[83] ^= 1;
    let r = pdu(&mut controller(DIGESTS), &bad);
    assert!(!r.data_digest_ok);
    // A wrong header digest is.
    let mut bad = b.clone();
    bad[74] ^= 0x80;
    let e = err(&mut controller(DIGESTS), &bad);
    assert!(matches!(e, PduError::HeaderDigest { .. }), "{e:?}");
    assert_eq!((e.fes(), e.fei()), (Fes::HeaderDigestError, 0));
    // So is a header byte changed under a correct-looking digest.
    let mut bad = b.clone();
    bad[9] ^= 1;
    assert!(matches!(
        err(&mut controller(DIGESTS), &bad),
        PduError::HeaderDigest { .. }
    ));
}

#[test]
fn capsule_cmd_without_data_and_digest() {
    // A Flush: Transport SGL Data Block of length 0, HDGST only (no data, no DDGSTF).
    let mut sqe = write_sqe_bytes(0, 0x5A);
    sqe[0] = 0x00;
    let mut b = vec![0x04, 0x01, 72, 0, 76, 0, 0, 0];
    b.extend_from_slice(&sqe);
    let h = crc(&b);
    b.extend_from_slice(&h);
    let r = pdu(&mut controller(DIGESTS), &b);
    let Pdu::CapsuleCmd { sqe, data } = r.pdu else {
        panic!()
    };
    assert_eq!(
        (sqe.opcode, sqe.dptr.kind(), data.len()),
        (0, SglKind::Transport, 0)
    );
    let mut out = [0u8; 76];
    assert_eq!(r.pdu.encode(&DIGESTS, &mut out), Ok(76));
    assert_eq!(out[..], b[..]);
}

#[test]
fn h2c_data_decodes() {
    let mut b = vec![0x06, 0x04, 24, 24, 32, 0, 0, 0]; // LAST_PDU, PDO 24, PLEN 32
    b.extend_from_slice(&[0x34, 0x12, 0x07, 0x00]); // CCCID, TTAG
    b.extend_from_slice(&[0, 0x10, 0, 0]); // DATAO 4096
    b.extend_from_slice(&[8, 0, 0, 0]); // DATAL
    b.extend_from_slice(&[0; 4]);
    b.extend_from_slice(b"abcdefgh");
    let r = pdu(&mut controller(Framing::default()), &b);
    let hdr = H2cDataHdr {
        cccid: 0x1234,
        ttag: 7,
        datao: 4096,
        last: true,
    };
    assert_eq!(
        r.pdu,
        Pdu::H2cData {
            hdr,
            data: b"abcdefgh"
        }
    );
    let mut out = [0u8; 32];
    assert_eq!(r.pdu.encode(&Framing::default(), &mut out), Ok(32));
    assert_eq!(out[..], b[..]);
}

#[test]
fn h2c_term_req_decodes() {
    let mut b = vec![0x02, 0x00, 24, 0, 32, 0, 0, 0];
    b.extend_from_slice(&[0x01, 0x00, 0x02, 0, 0, 0]); // FES 1, FEI 2
    b.extend_from_slice(&[0; 10]);
    b.extend_from_slice(&[0x05, 0, 99, 0, 24, 0, 0, 0]); // the offending header
                                                         // Allowed before ICReq and with digests negotiated alike: never digested.
    for mut p in [
        PduParser::new(Role::Controller, LIMITS),
        controller(DIGESTS),
    ] {
        let r = pdu(&mut p, &b);
        assert_eq!(
            r.pdu,
            Pdu::H2cTermReq(TermReq {
                fes: 1,
                fei: 2,
                data: &b[24..]
            })
        );
    }
}

#[test]
fn capsule_resp_encodes_to_the_spec_layout() {
    let cqe = Cqe {
        dw0: 0x0001_0002,
        dw1: 0,
        sqhd: 5,
        sqid: 1,
        cid: 0x1234,
        status: Cqe::status_word(0, 0x22, false),
    };
    assert_eq!(
        (cqe.sct(), cqe.sc(), cqe.dnr(), cqe.phase()),
        (0, 0x22, false, false)
    );
    let mut want = vec![0x05, 0x01, 24, 0, 28, 0, 0, 0]; // HDGSTF; PLEN 24 + 4
    want.extend_from_slice(&[2, 0, 1, 0, 0, 0, 0, 0, 5, 0, 1, 0, 0x34, 0x12, 0x44, 0x00]);
    let h = crc(&want);
    want.extend_from_slice(&h);
    let mut out = [0u8; 28];
    assert_eq!(Pdu::CapsuleResp(cqe).encode(&DIGESTS, &mut out), Ok(28));
    assert_eq!(out[..], want[..]);
    assert_eq!(pdu(&mut host(DIGESTS), &want).pdu, Pdu::CapsuleResp(cqe));
    let s = Cqe {
        status: Cqe::status_word(1, 0x82, true) | 1,
        ..cqe
    };
    assert_eq!(
        (s.sct(), s.sc(), s.dnr(), s.phase(), s.more(), s.crd()),
        (1, 0x82, true, true, false, 0)
    );
}

#[test]
fn c2h_data_encodes_to_the_spec_layout() {
    let data = [9u8; 10];
    let p = Pdu::C2hData {
        hdr: C2hDataHdr {
            cccid: 0x0042,
            datao: 0x200,
            last: true,
            success: false,
        },
        data: &data,
    };
    // Digests on, HPDA 1 (8-byte alignment): header 24 + HDGST 4 = 28, PDO 32.
    let f = Framing { pda: 1, ..DIGESTS };
    let mut want = vec![0x07, 0x07, 24, 32, 46, 0, 0, 0];
    want.extend_from_slice(&[0x42, 0, 0, 0, 0x00, 0x02, 0, 0, 10, 0, 0, 0, 0, 0, 0, 0]);
    let h = crc(&want);
    want.extend_from_slice(&h);
    want.extend_from_slice(&[0; 4]); // PAD
    want.extend_from_slice(&data);
    want.extend_from_slice(&crc(&data));
    let mut out = [0u8; 64];
    assert_eq!(p.encode(&f, &mut out), Ok(46));
    assert_eq!(p.encoded_len(&f), 46);
    assert_eq!(out[..46], want[..]);
    assert_eq!(pdu(&mut host(f), &want).pdu, p);
    // The header alone, for data sent from the caller's buffers.
    let mut head = [0u8; 32];
    assert_eq!(p.encode_header(&f, data.len(), &mut head), Ok(32));
    assert_eq!(head[..], want[..32]);
}

#[test]
fn r2t_encodes_to_the_spec_layout() {
    let r = R2t {
        cccid: 3,
        ttag: 0x0102,
        r2to: 0,
        r2tl: 0x0002_0000,
    };
    let want = [
        0x09, 0, 24, 0, 24, 0, 0, 0, 3, 0, 0x02, 0x01, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0,
    ];
    let mut out = [0u8; 24];
    assert_eq!(Pdu::R2t(r).encode(&Framing::default(), &mut out), Ok(24));
    assert_eq!(out, want);
    assert_eq!(pdu(&mut host(Framing::default()), &want).pdu, Pdu::R2t(r));
}

#[test]
fn c2h_term_req_from_an_error() {
    // An H2CData whose HLEN is wrong: FES 1, FEI 2, the offending header echoed.
    let mut b = vec![0x06, 0x00, 23, 24, 32, 0, 0, 0];
    b.resize(40, 0xab);
    let e = err(&mut controller(Framing::default()), &b);
    assert_eq!((e.fes(), e.fei()), (Fes::InvalidHeaderField, 2));
    let t = e.term_req(&b);
    assert_eq!(t.data, &b[..23]);
    let mut want = vec![0x03, 0x00, 24, 0, 47, 0, 0, 0, 0x01, 0x00, 2, 0, 0, 0];
    want.resize(24, 0);
    want.extend_from_slice(&b[..23]);
    let mut out = [0u8; 152];
    // Digests never apply to a TermReq.
    assert_eq!(Pdu::C2hTermReq(t).encode(&DIGESTS, &mut out), Ok(47));
    assert_eq!(out[..47], want[..]);
    // At most 128 header bytes.
    let big = [0x04u8, 0, 200, 0, 0, 0, 0, 0].repeat(40);
    assert_eq!(e.term_req(&big).data.len(), 128);
    let long = [0u8; 129];
    let t = TermReq {
        fes: 1,
        fei: 0,
        data: &long,
    };
    assert_eq!(
        Pdu::C2hTermReq(t).encode(&DIGESTS, &mut out),
        Err(EncodeError::DataTooLong { len: 129, max: 128 })
    );
}

#[test]
fn encoder_refuses_a_short_buffer() {
    let mut out = [0u8; 27];
    assert_eq!(
        Pdu::CapsuleResp(Cqe::default()).encode(&DIGESTS, &mut out),
        Err(EncodeError::BufferTooSmall { need: 28, have: 27 })
    );
    assert_eq!(out, [0; 27], "nothing written");
}

#[test]
fn header_field_errors() {
    let good = {
        let mut b = vec![0x04, 0x00, 72, 72, 76, 0, 0, 0];
        b.extend_from_slice(&write_sqe_bytes(4, 0x01));
        b.extend_from_slice(&[1, 2, 3, 4]);
        b
    };
    let case = |edit: &dyn Fn(&mut Vec<u8>), fei: u32| {
        let mut b = good.clone();
        edit(&mut b);
        let e = err(&mut controller(Framing::default()), &b);
        assert_eq!((e.fes(), e.fei()), (Fes::InvalidHeaderField, fei), "{e}");
        // Found from the common header alone (HLEN, PDO, PLEN, flags, type).
        assert_eq!(err(&mut controller(Framing::default()), &b[..8]), e);
    };
    case(&|b| b[2] = 24, 2); // HLEN of another type
    case(&|b| b[2] = 128, 2);
    case(&|b| b[4] = 60, 4); // PLEN < HLEN
    case(&|b| b[3] = 80, 3); // PDO past the header end
    case(&|b| b[3] = 0, 3); // PDO 0 with data
    case(&|b| b[3] = 76, 3); // PDO beyond PLEN
    case(&|b| b[1] = FLAG_HDGSTF, 1); // header digest not negotiated
    case(&|b| b[1] = FLAG_DDGSTF, 1); // data digest not negotiated
    case(&|b| b[0] = 0x08, 0); // reserved type
    case(&|b| b[0] = 0x0a, 0);
    case(&|b| b[0] = 0xff, 0);
    case(&|b| b[0] = 0x05, 0); // a controller-to-host type
    case(&|b| b[0] = 0x01, 0);

    // With digests negotiated: HDGSTF and DDGSTF must be set.
    let mut b = good.clone();
    b[3] = 76;
    b[4] = 84;
    assert_eq!(err(&mut controller(DIGESTS), &b[..8]).fei(), 1);
    b[1] = FLAG_HDGSTF;
    assert_eq!(err(&mut controller(DIGESTS), &b[..8]).fei(), 1);

    // ICReq of the wrong length, TermReq over 152 bytes, R2TL 0, SUCCESS without LAST.
    let mut ic = icreq_bytes(0);
    ic[4] = 132;
    let e = err(&mut PduParser::new(Role::Controller, LIMITS), &ic);
    assert_eq!((e.fes(), e.fei()), (Fes::InvalidHeaderField, 4));
    let term = [0x02, 0, 24, 0, 153, 0, 0, 0];
    assert_eq!(err(&mut controller(DIGESTS), &term).fei(), 4);
    let mut r2t = [0u8; 24];
    r2t[..8].copy_from_slice(&[0x09, 0, 24, 0, 24, 0, 0, 0]);
    assert_eq!(err(&mut host(Framing::default()), &r2t).fei(), 16);
    let c2h = [0x07, FLAG_SUCCESS, 24, 24, 28, 0, 0, 0];
    assert_eq!(err(&mut host(Framing::default()), &c2h).fei(), 1);
    // A data PDU without data; DATAL not the data length.
    let mut h2c = vec![0x06, 0x04, 24, 24, 24, 0, 0, 0];
    h2c.resize(24, 0);
    assert_eq!(err(&mut controller(Framing::default()), &h2c).fei(), 4);
    h2c[4] = 32;
    h2c[16] = 9;
    h2c.resize(32, 0);
    assert_eq!(err(&mut controller(Framing::default()), &h2c).fei(), 16);
}

#[test]
fn data_limits() {
    let limits = RecvLimits {
        max_in_capsule: 1024,
        max_data_pdu: 4096,
    };
    // H2CData of 4097 bytes with MAXH2CDATA 4096: refused from the CH alone.
    let mut p = controller(Framing::default());
    p.set_limits(limits);
    let plen = (24u32 + 4097).to_le_bytes();
    let b = [0x06, 0x04, 24, 24, plen[0], plen[1], plen[2], plen[3]];
    let e = err(&mut p, &b);
    assert_eq!(
        e,
        PduError::DataLimitExceeded {
            fei: 16,
            len: 4097,
            limit: 4096
        }
    );
    assert_eq!(e.fes(), Fes::DataTransferLimitExceeded);
    // 4096 bytes are fine: the parser then asks for the PSH.
    let plen = (24u32 + 4096).to_le_bytes();
    let b = [0x06, 0x04, 24, 24, plen[0], plen[1], plen[2], plen[3]];
    assert_eq!(p.parse(&b), Ok(Parse::Need(16)));
    // In-capsule data above the limit; a PLEN near 4 GiB.
    let plen = (72u32 + 1025).to_le_bytes();
    let b = [0x04, 0, 72, 72, plen[0], plen[1], plen[2], plen[3]];
    assert_eq!(err(&mut p, &b).fei(), 4);
    let b = [0x04, 0, 72, 72, 0xff, 0xff, 0xff, 0xff];
    assert_eq!(err(&mut p, &b).fes(), Fes::DataTransferLimitExceeded);
}

#[test]
fn sequence_errors() {
    let mut cmd = vec![0x04, 0x00, 72, 0, 72, 0, 0, 0];
    cmd.extend_from_slice(&write_sqe_bytes(0, 0x5A));
    let mut p = PduParser::new(Role::Controller, LIMITS);
    let e = err(&mut p, &cmd);
    assert_eq!((e.fes(), e.fei()), (Fes::PduSequenceError, 0));
    assert_eq!(err(&mut p, &cmd[..8]), e, "from the CH alone");
    let ic = icreq_bytes(0);
    pdu(&mut p, &ic);
    pdu(&mut p, &cmd);
    assert_eq!(err(&mut p, &ic).fes(), Fes::PduSequenceError);
}

#[test]
fn need_counts() {
    let mut p = controller(DIGESTS);
    assert_eq!(p.parse(&[]), Ok(Parse::Need(8)));
    assert_eq!(p.parse(&[0x04, 3, 72]), Ok(Parse::Need(5)));
    let mut b = vec![0x04, 0x03, 72, 76, 84, 0, 0, 0];
    assert_eq!(p.parse(&b), Ok(Parse::Need(68)), "PSH and HDGST");
    b.extend_from_slice(&write_sqe_bytes(4, 0x01));
    let h = crc(&b);
    b.extend_from_slice(&h);
    assert_eq!(p.parse(&b), Ok(Parse::Need(8)), "data and DDGST");
}

#[test]
fn negotiation_rules() {
    let policy = IcPolicy::new(4096).unwrap();
    assert!(IcPolicy::new(4095).is_none());
    assert!(IcPolicy::new(4098).is_none());
    assert_eq!(IcPolicy::new(1 << 20).unwrap().maxh2cdata(), 1 << 20);
    let req = IcReq {
        hpda: 3,
        ddgst_enable: true,
        maxr2t: 7,
        ..IcReq::default()
    };
    let n = negotiate(&req, &policy).unwrap();
    assert_eq!(
        n.resp,
        IcResp {
            pfv: 0,
            cpda: 0,
            hdgst_enable: false,
            ddgst_enable: true,
            maxh2cdata: 4096
        }
    );
    assert_eq!((n.tx.pda, n.rx.pda, n.max_r2t), (3, 0, 8));
    let e = negotiate(&IcReq { pfv: 1, ..req }, &policy).unwrap_err();
    assert_eq!((e.fes(), e.fei()), (Fes::InvalidHeaderField, 8));
    let e = negotiate(&IcReq { hpda: 32, ..req }, &policy).unwrap_err();
    assert_eq!((e.fes(), e.fei()), (Fes::InvalidHeaderField, 10));
    // What the 6.1 host refuses.
    let ok = n.resp;
    assert_eq!(
        check_icresp(&req, &IcResp { pfv: 1, ..ok }),
        Err(IcRespRejected::Pfv(1))
    );
    assert_eq!(
        check_icresp(
            &req,
            &IcResp {
                ddgst_enable: false,
                ..ok
            }
        ),
        Err(IcRespRejected::DigestMismatch)
    );
    assert_eq!(
        check_icresp(
            &req,
            &IcResp {
                hdgst_enable: true,
                ..ok
            }
        ),
        Err(IcRespRejected::DigestMismatch)
    );
    assert_eq!(
        check_icresp(&req, &IcResp { cpda: 1, ..ok }),
        Err(IcRespRejected::Cpda(1))
    );
    for m in [0, 2048, 4094, 4097] {
        assert_eq!(
            check_icresp(
                &req,
                &IcResp {
                    maxh2cdata: m,
                    ..ok
                }
            ),
            Err(IcRespRejected::MaxH2cData(m))
        );
    }
}

#[test]
fn h2c_data_against_its_r2t() {
    let r2t = R2t {
        cccid: 9,
        ttag: 4,
        r2to: 8192,
        r2tl: 8192,
    };
    let hdr = |datao, last| H2cDataHdr {
        cccid: 9,
        ttag: 4,
        datao,
        last,
    };
    let mut x = H2cExpect::new(r2t);
    assert_eq!(x.accept(&hdr(8192, false), 4096), Ok(false));
    assert_eq!(x.accept(&hdr(12288, true), 4096), Ok(true));

    let fes = |h: H2cDataHdr, datal| {
        H2cExpect::new(r2t)
            .accept(&h, datal)
            .map_err(|e| (e.fes(), e.fei()))
    };
    assert_eq!(
        fes(
            H2cDataHdr {
                ttag: 5,
                ..hdr(8192, true)
            },
            8192
        ),
        Err((Fes::InvalidHeaderField, 10))
    );
    assert_eq!(
        fes(
            H2cDataHdr {
                cccid: 1,
                ..hdr(8192, true)
            },
            8192
        ),
        Err((Fes::InvalidHeaderField, 8))
    );
    assert_eq!(
        fes(hdr(0, false), 4096),
        Err((Fes::DataTransferOutOfRange, 12))
    );
    assert_eq!(
        fes(hdr(16384, true), 1),
        Err((Fes::DataTransferOutOfRange, 12))
    );
    assert_eq!(
        fes(hdr(8192, true), 8193),
        Err((Fes::DataTransferOutOfRange, 16))
    );
    assert_eq!(
        fes(hdr(12288, true), 4096),
        Err((Fes::PduSequenceError, 12))
    );
    assert_eq!(fes(hdr(8192, true), 4096), Err((Fes::PduSequenceError, 1)));
    assert_eq!(fes(hdr(8192, false), 8192), Err((Fes::PduSequenceError, 1)));
}

/// Every PDU type, for round trips and streams.
fn samples(data: &[u8]) -> Vec<Pdu<'_>> {
    let small = &data[..data.len().min(100)];
    vec![
        Pdu::CapsuleCmd {
            sqe: write_sqe(SglDescriptor::in_capsule(data.len() as u32)),
            data,
        },
        Pdu::CapsuleCmd {
            sqe: Sqe {
                opcode: 0x7f,
                nsid: 0x01,
                mptr: u64::MAX,
                cdw2: 1,
                cdw3: 2,
                cdw11: 3,
                cdw12: 4,
                cdw13: 5,
                cdw14: 6,
                cdw15: 7,
                dptr: SglDescriptor {
                    address: 0x1122_3344_5566_7788,
                    length: 0,
                    reserved: [1, 2, 3],
                    sgl_identifier: 0x20,
                },
                ..Sqe::default()
            },
            data: &[],
        },
        Pdu::H2cData {
            hdr: H2cDataHdr {
                cccid: 1,
                ttag: 2,
                datao: 3,
                last: false,
            },
            data,
        },
        Pdu::H2cTermReq(TermReq {
            fes: 6,
            fei: 11,
            data: small,
        }),
        Pdu::CapsuleResp(Cqe {
            dw0: 1,
            dw1: 2,
            sqhd: 3,
            sqid: 4,
            cid: 5,
            status: 0xffff,
        }),
        Pdu::C2hData {
            hdr: C2hDataHdr {
                cccid: 7,
                datao: 8,
                last: true,
                success: true,
            },
            data,
        },
        Pdu::R2t(R2t {
            cccid: 1,
            ttag: 2,
            r2to: 3,
            r2tl: 4,
        }),
        Pdu::C2hTermReq(TermReq {
            fes: 1,
            fei: 2,
            data: small,
        }),
    ]
}

#[test]
fn round_trips() {
    let data: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
    for hdgst in [false, true] {
        for ddgst in [false, true] {
            for pda in [0, 1, 7, 31] {
                let f = Framing { hdgst, ddgst, pda };
                for p in samples(&data) {
                    let mut out = vec![0u8; p.encoded_len(&f)];
                    assert_eq!(p.encode(&f, &mut out), Ok(out.len()));
                    let mut parser = if p.pdu_type().from_host() {
                        controller(f)
                    } else {
                        host(f)
                    };
                    let r = pdu(&mut parser, &out);
                    assert_eq!(
                        (r.pdu, r.len, r.data_digest_ok),
                        (p, out.len(), true),
                        "{f:?}"
                    );
                }
            }
        }
    }
}

/// Parse `stream` fed `chunk` bytes at a time; the framing switches to `after_ic` once
/// the ICReq is through. Returns what came out, in order, as text, and the ending.
fn run(stream: &[u8], after_ic: Framing, chunk: usize) -> (Vec<String>, String) {
    let mut p = PduParser::new(Role::Controller, LIMITS);
    let mut out = Vec::new();
    let (mut start, mut fed) = (0, 0);
    let mut need_until = 0;
    loop {
        match p.parse(&stream[start..fed]) {
            Ok(Parse::Need(n)) => {
                assert!(n >= 1);
                need_until = fed + n;
                if fed == stream.len() {
                    return (out, format!("need {n}"));
                }
                fed = (fed + chunk).min(stream.len());
            }
            Ok(Parse::Pdu(r)) => {
                assert!(
                    fed >= need_until,
                    "a PDU before the bytes it said it needed"
                );
                out.push(format!("{:?} {} {}", r.pdu, r.len, r.data_digest_ok));
                if matches!(r.pdu, Pdu::IcReq(_)) {
                    p.set_framing(after_ic);
                }
                start += r.len;
                fed = fed.max(start);
            }
            Err(e) => {
                assert!(
                    fed >= need_until,
                    "an error before the bytes it said it needed"
                );
                return (out, format!("error {e:?}"));
            }
        }
    }
}

fn stream(f: Framing, data: &[u8]) -> Vec<u8> {
    let mut s = icreq_bytes(u8::from(f.hdgst) | (u8::from(f.ddgst) << 1));
    for p in samples(data) {
        if p.pdu_type().from_host() {
            let at = s.len();
            s.resize(at + p.encoded_len(&f), 0);
            p.encode(&f, &mut s[at..]).unwrap();
        }
    }
    s
}

#[test]
fn byte_at_a_time_equals_whole() {
    let data: Vec<u8> = (0..777u32).map(|i| (i ^ 0x5a) as u8).collect();
    for f in [Framing::default(), DIGESTS] {
        let s = stream(f, &data);
        let whole = run(&s, f, s.len());
        assert_eq!(whole.0.len(), 5, "{whole:?}");
        assert_eq!(whole.1, "need 8");
        for chunk in [1, 2, 3, 7, 64] {
            assert_eq!(run(&s, f, chunk), whole, "chunk {chunk}");
        }
    }
}

#[test]
fn corrupted_streams_never_panic_and_split_like_whole() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(22);
    let data: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
    for _ in 0..3000 {
        let f = Framing {
            hdgst: rng.gen(),
            ddgst: rng.gen(),
            pda: rng.gen_range(0..3),
        };
        let mut s = stream(f, &data);
        for _ in 0..rng.gen_range(1..4) {
            let i = rng.gen_range(0..s.len());
            s[i] = rng.gen();
        }
        if rng.gen_bool(0.3) {
            s.truncate(rng.gen_range(0..s.len()));
        }
        let whole = run(&s, f, s.len());
        let chunk = rng.gen_range(1..40);
        assert_eq!(run(&s, f, chunk), whole);
    }
}

/// The fuzz seeds are written by an independent encoder (fuzz/gen_nvmf_pdu_seeds.py, its
/// own CRC32C): each parses through to its last PDU.
#[test]
fn python_built_streams() {
    let seeds: [(&[u8], Role, usize); 5] = [
        (
            include_bytes!("../../../../fuzz/seeds/nvmf_pdu/ctrl-plain"),
            Role::Controller,
            7,
        ),
        (
            include_bytes!("../../../../fuzz/seeds/nvmf_pdu/ctrl-digests"),
            Role::Controller,
            7,
        ),
        (
            include_bytes!("../../../../fuzz/seeds/nvmf_pdu/ctrl-termreq"),
            Role::Controller,
            1,
        ),
        (
            include_bytes!("../../../../fuzz/seeds/nvmf_pdu/host-digests"),
            Role::Host,
            6,
        ),
        (
            include_bytes!("../../../../fuzz/seeds/nvmf_pdu/host-started-pda1"),
            Role::Host,
            5,
        ),
    ];
    for (seed, role, count) in seeds {
        let cfg = seed[0];
        let f = Framing {
            hdgst: cfg & 1 != 0,
            ddgst: cfg & 2 != 0,
            pda: [0, 1, 3, 31][usize::from((cfg >> 4) & 3)],
        };
        let mut p = match (role, cfg & 8 != 0) {
            (Role::Controller, true) => controller(f),
            (Role::Host, true) => host(f),
            _ => PduParser::new(role, LIMITS),
        };
        let mut s = &seed[2..];
        let mut n = 0;
        while !s.is_empty() {
            let r = pdu(&mut p, s);
            assert!(r.data_digest_ok);
            if matches!(r.pdu, Pdu::IcReq(_) | Pdu::IcResp(_)) {
                p.set_framing(f);
            }
            if let Pdu::H2cData { hdr, data } = r.pdu {
                assert_eq!((hdr.cccid, hdr.ttag, data.len()), (2, 1, 4096));
            }
            s = &s[r.len..];
            n += 1;
        }
        assert_eq!(n, count);
    }
}
