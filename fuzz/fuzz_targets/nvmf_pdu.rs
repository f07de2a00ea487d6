//! Fuzz target: the NVMe/TCP PDU layer (`ferroraid::nvmf::pdu`).
//!
//! Input: byte 0 chooses the setup — bit 0 header digests, bit 1 data digests, bit 2 the
//! host's parser (C2H PDUs) instead of the controller's, bit 3 start past connection
//! initialization (else the stream's ICReq/ICResp switches the digests on), bits 4–5 the
//! data alignment (PDA 0, 1, 3, 31), bit 6 small receive limits; byte 1 seeds the sizes
//! of the pieces the stream arrives in; the rest is the stream.
//!
//! Checked: no panic; the stream parsed in pieces gives the same PDUs, lengths, digest
//! verdicts and ending (error or bytes needed) as parsed whole, and no PDU or error comes
//! before the bytes the parser said it needed; every PDU re-encodes (with the framing it
//! was parsed with) to PLEN bytes that parse back to the same PDU with good digests; every
//! error's FES/FEI and offending header encode as a TermReq that the other side parses
//! back; ICReq/ICResp go through the negotiation checks and H2CData through an R2T check.
#![no_main]

use ferroraid::nvmf::pdu::{
    check_icresp, negotiate, Framing, H2cExpect, IcPolicy, IcReq, IcResp, Parse, Pdu, PduError,
    PduParser, R2t, RecvLimits, Role,
};
use libfuzzer_sys::fuzz_target;

struct Setup {
    role: Role,
    framing: Framing,
    started: bool,
    limits: RecvLimits,
}

fn parser(s: &Setup) -> PduParser {
    let mut p = PduParser::new(s.role, s.limits);
    if s.started {
        let mut ic = [0u8; 128];
        let pdu = match s.role {
            Role::Controller => Pdu::IcReq(IcReq::default()),
            Role::Host => Pdu::IcResp(IcResp {
                maxh2cdata: 4096,
                ..IcResp::default()
            }),
        };
        pdu.encode(&Framing::default(), &mut ic)
            .expect("IC PDU fits");
        assert!(matches!(p.parse(&ic), Ok(Parse::Pdu(_))));
        p.set_framing(s.framing);
    }
    p
}

/// One parse outcome, owned, to compare runs.
#[derive(Debug, PartialEq)]
enum Outcome {
    Pdu(String, usize, bool),
    Error(PduError),
    Need(usize),
}

/// Parse `stream` in pieces of the sizes `next_chunk` gives; check each PDU and error.
fn run(s: &Setup, stream: &[u8], mut next_chunk: impl FnMut() -> usize) -> Vec<Outcome> {
    let mut p = parser(s);
    let mut out = Vec::new();
    let (mut start, mut fed, mut need_until) = (0usize, 0usize, 0usize);
    loop {
        let before = p.clone();
        let buf = &stream[start..fed];
        match p.parse(buf) {
            Ok(Parse::Need(n)) => {
                assert!(n >= 1);
                need_until = fed + n;
                if fed == stream.len() {
                    out.push(Outcome::Need(n));
                    return out;
                }
                fed = (fed + next_chunk()).min(stream.len());
            }
            Ok(Parse::Pdu(r)) => {
                assert!(fed >= need_until, "PDU before the bytes said to be needed");
                assert!(r.len >= 8 && r.len <= buf.len());
                check_pdu(s, &before, &r.pdu, r.len);
                out.push(Outcome::Pdu(
                    format!("{:?}", r.pdu),
                    r.len,
                    r.data_digest_ok,
                ));
                if matches!(r.pdu, Pdu::IcReq(_) | Pdu::IcResp(_)) && !s.started {
                    p.set_framing(s.framing);
                }
                start += r.len;
                fed = fed.max(start);
            }
            Err(e) => {
                assert!(
                    fed >= need_until,
                    "error before the bytes said to be needed"
                );
                check_error(s, &e, buf);
                out.push(Outcome::Error(e));
                return out;
            }
        }
    }
}

fn check_pdu(s: &Setup, before: &PduParser, pdu: &Pdu<'_>, len: usize) {
    let f = before.framing();
    let n = pdu.encoded_len(&f);
    assert_eq!(n, len, "re-encoded PLEN differs");
    let mut buf = vec![0u8; n];
    assert_eq!(pdu.encode(&f, &mut buf), Ok(n));
    let mut again = before.clone();
    match again.parse(&buf) {
        Ok(Parse::Pdu(r)) => {
            assert_eq!(r.pdu, *pdu, "re-parse differs");
            assert_eq!(r.len, n);
            assert!(r.data_digest_ok);
        }
        other => panic!("re-encoded PDU does not parse: {other:?}"),
    }
    let policy = IcPolicy::new(65536).expect("valid policy");
    match *pdu {
        Pdu::IcReq(req) => {
            if let Ok(neg) = negotiate(&req, &policy) {
                assert_eq!(check_icresp(&req, &neg.resp), Ok(()));
            }
        }
        Pdu::IcResp(resp) => {
            let _ = check_icresp(&IcReq::default(), &resp);
        }
        Pdu::H2cData { hdr, data } => {
            let mut x = H2cExpect::new(R2t {
                cccid: hdr.cccid,
                ttag: hdr.ttag,
                r2to: hdr.datao & !0xfff,
                r2tl: s.limits.max_data_pdu,
            });
            let _ = x.accept(&hdr, data.len() as u32);
        }
        _ => {}
    }
}

fn check_error(s: &Setup, e: &PduError, buf: &[u8]) {
    let _ = e.to_string();
    let t = e.term_req(buf);
    assert!(t.data.len() <= 128 && t.data.len() <= buf.len());
    assert_eq!(t.fes, e.fes() as u16);
    let (pdu, other) = match s.role {
        Role::Controller => (Pdu::C2hTermReq(t), Role::Host),
        Role::Host => (Pdu::H2cTermReq(t), Role::Controller),
    };
    let mut out = [0u8; 152];
    let n = pdu
        .encode(&s.framing, &mut out)
        .expect("a TermReq fits 152 bytes");
    let mut p = PduParser::new(other, s.limits);
    match p.parse(&out[..n]) {
        Ok(Parse::Pdu(r)) => assert_eq!(r.pdu, pdu),
        other => panic!("TermReq does not parse: {other:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let cfg = data[0];
    let setup = Setup {
        role: if cfg & 4 != 0 {
            Role::Host
        } else {
            Role::Controller
        },
        framing: Framing {
            hdgst: cfg & 1 != 0,
            ddgst: cfg & 2 != 0,
            pda: [0, 1, 3, 31][usize::from((cfg >> 4) & 3)],
        },
        started: cfg & 8 != 0,
        limits: if cfg & 0x40 != 0 {
            RecvLimits {
                max_in_capsule: 1024,
                max_data_pdu: 4096,
            }
        } else {
            RecvLimits {
                max_in_capsule: 8192,
                max_data_pdu: 131072,
            }
        },
    };
    let stream = &data[2..];
    let whole = run(&setup, stream, || stream.len().max(1));
    let mut state = u32::from(data[1]) | 0x100;
    let pieces = run(&setup, stream, || {
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12345);
        1 + ((state >> 16) as usize % 97)
    });
    assert_eq!(pieces, whole, "pieces and whole differ");
    let bytewise = run(&setup, stream, || 1);
    assert_eq!(bytewise, whole, "byte at a time and whole differ");
});
