//! The NVMe/TCP target end to end: `ferroraid serve --nvmf` as a process, driven over
//! loopback by the project's own host ([`ferroraid::nvmf::host`]; this machine has no
//! kernel `nvme-tcp`): discovery log, Connect, Identify fields, write + read verify (in
//! capsule and by R2T, with and without digests), FUA and Flush, Write Zeroes and
//! deallocate reading back zeroes, Compare, out-of-range and bad-opcode statuses, a
//! malformed PDU answered by a C2HTermReq while another connection keeps working, and the
//! keep-alive timeout ending the association. Every server is killed when its test ends.

use std::ffi::OsString;
use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferroraid::nvmf::host::{ConnectParams, Data, Event, HostQueue};
use ferroraid::nvmf::pdu::{Cqe, Sqe};
use ferroraid::nvmf::spec::{self, admin, io, sc, sct, AnaState};
use ferroraid::rpc::{codes, ClientError, RpcClient};
use ferroraid_tests::target::{self as fixture, free_port};

const MIB: u64 = 1 << 20;
const START_TIMEOUT: Duration = Duration::from_secs(30);
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001";

/// A created RAID5 array of three 16 MiB members, 64 KiB chunks.
struct Array {
    name: String,
    members: Vec<PathBuf>,
    uuid_hex: String,
}

fn create(dir: &Path, name: &str) -> Array {
    let members = fixture::member_files(dir, name, 3, 16 * MIB);
    let (a, text) = fixture::create_with(
        dir,
        5,
        "left-symmetric",
        name,
        &members,
        fixture::CHUNK,
        &[],
    );
    let uuid_hex = text
        .split("(UUID ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap_or_else(|| panic!("no UUID in {text}"))
        .replace(':', "");
    Array {
        name: a.name,
        members: a.members,
        uuid_hex,
    }
}

/// `ferroraid serve --nvmf` on two free ports (two portals), with an NBD port and a
/// management socket, on the target fixture's process handling (killed with the test).
struct Server {
    srv: fixture::Server,
    ports: [u16; 2],
    ips: [[u8; 4]; 2],
    nqn: String,
}

impl Server {
    fn start(dir: &Path, a: &Array, reactors: usize) -> Server {
        Self::start_on(dir, a, reactors, [[127, 0, 0, 1]; 2], &[])
    }

    /// Two portals on `ips` (free ports), with `extra` serve arguments.
    fn start_on(
        dir: &Path,
        a: &Array,
        reactors: usize,
        ips: [[u8; 4]; 2],
        extra: &[&str],
    ) -> Server {
        let ports = [free_port(), free_port()];
        let nbd = free_port();
        let mut args: Vec<OsString> = vec!["serve".into(), "--adaptive".into()];
        args.extend(["--reactors".into(), reactors.to_string().into()]);
        args.extend(["--nbd".into(), format!("127.0.0.1:{nbd}").into()]);
        for (ip, p) in ips.iter().zip(ports) {
            let ip = std::net::Ipv4Addr::from(*ip);
            args.extend(["--nvmf".into(), format!("{ip}:{p}").into()]);
        }
        args.extend(extra.iter().map(OsString::from));
        args.extend(["--rpc".into(), dir.join("rpc.sock").into_os_string()]);
        args.extend(a.members.iter().map(|m| m.as_os_str().to_owned()));
        let srv = fixture::Server::spawn(dir, "serve", &args, &a.name, nbd, None);
        let s = Server {
            srv,
            ports,
            ips,
            nqn: format!("nqn.2026-11.org.ferroraid:{}", a.name),
        };
        let deadline = Instant::now() + START_TIMEOUT;
        while TcpStream::connect(s.addr(1)).is_err() {
            assert!(
                Instant::now() < deadline,
                "NVMe/TCP port never opened:\n{}",
                s.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        s
    }

    fn addr(&self, i: usize) -> SocketAddr {
        SocketAddr::from((self.ips[i], self.ports[i]))
    }

    fn rpc(&self) -> RpcClient {
        RpcClient::connect(self.srv.rpc.as_ref().expect("--rpc")).unwrap()
    }

    fn log(&self) -> String {
        self.srv.log()
    }

    /// `ferroraid status --json` over the management socket (a healthy array: exit 0).
    fn status(&self) -> serde_json::Value {
        let (v, code) = self.srv.status();
        assert_eq!(code, Some(0), "status: {v}\n{}", self.log());
        v
    }
}

fn params(subnqn: &str, kato_ms: u32) -> ConnectParams {
    ConnectParams {
        subnqn: subnqn.into(),
        hostnqn: HOSTNQN.into(),
        hostid: [7; 16],
        kato_ms,
    }
}

fn ok(c: &Cqe, what: &str) {
    assert_eq!(
        c.status,
        0,
        "{what}: status {:#06x} (SCT {} SC {:#x})",
        c.status,
        c.sct(),
        c.sc()
    );
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}
fn field(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).trim_end().to_string()
}

fn identify(q: &mut HostQueue, cid: u16, cns: u8, nsid: u32) -> (Cqe, Vec<u8>) {
    let sqe = Sqe {
        opcode: admin::IDENTIFY,
        cid,
        nsid,
        cdw10: u32::from(cns),
        ..Sqe::default()
    };
    q.exec(sqe, Data::In(4096)).unwrap()
}

fn get_log(q: &mut HostQueue, cid: u16, lid: u8, len: u32, offset: u64) -> (Cqe, Vec<u8>) {
    let numd = len / 4 - 1;
    let sqe = Sqe {
        opcode: admin::GET_LOG_PAGE,
        cid,
        nsid: 0xFFFF_FFFF,
        cdw10: u32::from(lid) | ((numd & 0xFFFF) << 16),
        cdw11: numd >> 16,
        cdw12: offset as u32,
        cdw13: (offset >> 32) as u32,
        ..Sqe::default()
    };
    q.exec(sqe, Data::In(len)).unwrap()
}

/// An admin queue connected and enabled, with `queues` I/O queues granted; returns the
/// CNTLID and the LBA size (bytes).
fn admin_queue(srv: &Server, kato_ms: u32, queues: u16, digests: bool) -> (HostQueue, u16, u64) {
    let mut q = HostQueue::open(srv.addr(0), digests, digests).unwrap();
    let c = q
        .connect(0, 31, 0xFFFF, &params(&srv.nqn, kato_ms))
        .unwrap();
    ok(&c, "admin Connect");
    let cntlid = c.dw0 as u16;
    q.enable().unwrap();
    let n = u32::from(queues - 1);
    let sqe = Sqe {
        opcode: admin::SET_FEATURES,
        cid: 3,
        cdw10: u32::from(spec::feature::NUMBER_OF_QUEUES),
        cdw11: n | (n << 16),
        ..Sqe::default()
    };
    let (c, _) = q.exec(sqe, Data::None).unwrap();
    ok(&c, "Set Features Number of Queues");
    assert_eq!(c.dw0, n | (n << 16));
    let (c, ns) = identify(&mut q, 4, 0, 1);
    ok(&c, "Identify namespace");
    (q, cntlid, 1 << ns[130])
}

fn io_queue(srv: &Server, portal: usize, cntlid: u16, qid: u16, digests: bool) -> HostQueue {
    let mut q = HostQueue::open(srv.addr(portal), digests, digests).unwrap();
    let c = q.connect(qid, 127, cntlid, &params(&srv.nqn, 0)).unwrap();
    ok(&c, "I/O Connect");
    q
}

fn rw(op: u8, cid: u16, slba: u64, blocks: u32, fua: bool) -> Sqe {
    Sqe {
        opcode: op,
        cid,
        nsid: 1,
        cdw10: slba as u32,
        cdw11: (slba >> 32) as u32,
        cdw12: (blocks - 1) | (u32::from(fua) << 30),
        ..Sqe::default()
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn discovery_log_lists_every_portal() {
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "disc");
    let srv = Server::start(dir.path(), &a, 1);
    let mut q = HostQueue::open(srv.addr(1), false, false).unwrap();
    let c = q
        .connect(0, 31, 0xFFFF, &params(spec::DISCOVERY_NQN, 0))
        .unwrap();
    ok(&c, "discovery Connect");
    let cntlid = c.dw0 as u16;
    q.enable().unwrap();
    let (c, id) = identify(&mut q, 4, 1, 0);
    ok(&c, "Identify discovery controller");
    assert_eq!(id[111], 2, "CNTRLTYPE discovery");
    assert_eq!(field(&id[768..1024]), spec::DISCOVERY_NQN);
    assert_eq!(le16(&id, 78), cntlid);
    // libnvme's order: the header, then the whole log in 4 KiB pieces.
    let (c, head) = get_log(&mut q, 5, 0x70, 1024, 0);
    ok(&c, "discovery log header");
    let numrec = le64(&head, 8);
    assert_eq!(numrec, 2);
    let (c, whole) = get_log(&mut q, 6, 0x70, 1024 * 3, 0);
    ok(&c, "discovery log");
    assert_eq!(le64(&whole, 0), le64(&head, 0), "GENCTR stable");
    for (i, port) in srv.ports.iter().enumerate() {
        let e = &whole[1024 * (i + 1)..1024 * (i + 2)];
        assert_eq!(e[0], 3, "TRTYPE TCP");
        assert_eq!(e[1], 1, "ADRFAM IPv4");
        assert_eq!(e[2], 2, "SUBTYPE NVM subsystem");
        assert_eq!(le16(e, 6), 0xFFFF, "CNTLID dynamic");
        assert_eq!(field(&e[32..64]), port.to_string());
        assert_eq!(field(&e[256..512]), srv.nqn);
        assert_eq!(field(&e[512..768]), "127.0.0.1");
    }
    // An offset past the log is an error.
    let (c, _) = get_log(&mut q, 7, 0x70, 1024, 4096);
    assert_eq!((c.sct(), c.sc()), (sct::GENERIC, sc::INVALID_FIELD));
}

#[test]
fn connect_identify_and_io() {
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "ident");
    let srv = Server::start(dir.path(), &a, 2);
    let (mut q, cntlid, _) = admin_queue(&srv, 30_000, 2, false);
    // Unknown subsystem: Connect Invalid Parameters pointing at SUBNQN in the data.
    let mut bad = HostQueue::open(srv.addr(0), false, false).unwrap();
    let c = bad
        .connect(0, 31, 0xFFFF, &params("nqn.2026-11.org.example:nope", 0))
        .unwrap();
    assert_eq!(
        (c.sct(), c.sc()),
        (sct::COMMAND, sc::CONNECT_INVALID_PARAMETERS)
    );
    assert_eq!(c.dw0, (1 << 16) | 256);

    let cap = q.prop_get(spec::prop::CAP).unwrap();
    assert_eq!(cap & 0xFFFF, u64::from(spec::MQES));
    assert_eq!(q.prop_get(spec::prop::VS).unwrap(), 0x0001_0300);
    let (c, id) = identify(&mut q, 4, 1, 0);
    ok(&c, "Identify controller");
    assert_eq!(le16(&id, 78), cntlid, "CNTLID as Connect's");
    assert_eq!(id[111], 1, "CNTRLTYPE I/O");
    assert_ne!(le16(&id, 320), 0, "KAS");
    assert_eq!(le32(&id, 536) & 1, 1, "SGLS");
    assert_eq!(le16(&id, 1800), 0, "ICDOFF");
    assert_eq!(id[77], spec::MDTS);
    assert_eq!(le32(&id, 516), 1, "NN");
    assert_eq!(field(&id[768..1024]), srv.nqn);
    assert_eq!(le32(&id, 1792), (64 + 4096) / 16, "IOCCSZ");
    assert_eq!(&id[4..24], &a.uuid_hex.as_bytes()[..20], "SN from the UUID");
    assert!(field(&id[24..64]).starts_with("ferroraid RAID5"));

    let (c, ns) = identify(&mut q, 5, 0, 1);
    ok(&c, "Identify namespace");
    let lbads = ns[130];
    let bs = 1u64 << lbads;
    let nsze = le64(&ns, 0);
    // RAID5 of three 16 MiB members: two members' data (less metadata).
    assert!(
        nsze * bs > 28 * MIB && nsze * bs <= 32 * MIB,
        "NSZE {nsze} × {bs}"
    );
    assert_eq!(le64(&ns, 8), nsze, "NCAP");
    assert_eq!(ns[24] & (1 << 4), 1 << 4, "NSFEAT OPTPERF");
    let stripe_blocks = (128 * 1024 / bs) as u16;
    assert_eq!(le16(&ns, 64), stripe_blocks - 1, "NPWG = the stripe");
    assert_eq!(le16(&ns, 72), stripe_blocks - 1, "NOWS = the stripe");
    assert_eq!(le16(&ns, 46), (64 * 1024 / bs) as u16, "NOIOB = the chunk");
    let uuid: Vec<u8> = (0..16)
        .map(|i| u8::from_str_radix(&a.uuid_hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    assert_eq!(&ns[104..120], &uuid[..], "NGUID = the array UUID");
    let (c, list) = identify(&mut q, 6, 2, 0);
    ok(&c, "active NS list");
    assert_eq!((le32(&list, 0), le32(&list, 4)), (1, 0));
    let (c, desc) = identify(&mut q, 7, 3, 1);
    ok(&c, "NS descriptors");
    assert_eq!((desc[0], desc[1]), (2, 16));
    assert_eq!(&desc[4..20], &uuid[..]);
    assert_eq!((desc[20], desc[21]), (3, 16));
    let (c, _) = identify(&mut q, 8, 0x42, 0);
    assert_eq!((c.sct(), c.sc()), (sct::GENERIC, sc::INVALID_FIELD));
    let (c, changed) = get_log(&mut q, 9, 0x04, 4096, 0);
    ok(&c, "changed NS list");
    assert!(changed.iter().all(|&b| b == 0));
    let (c, _) = get_log(&mut q, 10, 0x01, 64, 0);
    ok(&c, "error log");
    let (c, _) = get_log(&mut q, 11, 0x7E, 512, 0);
    assert_eq!((c.sct(), c.sc()), (sct::COMMAND, sc::INVALID_LOG_PAGE));

    // Two I/O queues, one per portal (spread over the two reactors).
    let mut q1 = io_queue(&srv, 0, cntlid, 1, false);
    let mut q2 = io_queue(&srv, 1, cntlid, 2, false);
    // A QID past the granted count, and one already connected.
    let mut q3 = HostQueue::open(srv.addr(0), false, false).unwrap();
    let c = q3.connect(3, 127, cntlid, &params(&srv.nqn, 0)).unwrap();
    assert_eq!(
        (c.sct(), c.sc()),
        (sct::COMMAND, sc::CONNECT_INVALID_PARAMETERS)
    );
    let mut q4 = HostQueue::open(srv.addr(0), false, false).unwrap();
    let c = q4.connect(1, 127, cntlid, &params(&srv.nqn, 0)).unwrap();
    assert_eq!((c.sct(), c.sc()), (sct::GENERIC, sc::SEQUENCE));

    let blocks_of = |bytes: u64| (bytes / bs) as u32;
    // 4 KiB in the capsule, 4 KiB by R2T, 64 KiB and 128 KiB by R2T.
    for (k, (len, in_capsule)) in [
        (4096u64, true),
        (4096, false),
        (65536, false),
        (131072, false),
    ]
    .into_iter()
    .enumerate()
    {
        let q = if k % 2 == 0 { &mut q1 } else { &mut q2 };
        let slba = u64::from(blocks_of(MIB + k as u64 * 256 * 1024));
        let data = pattern(k as u64, len as usize);
        let (c, _) = q
            .exec(
                rw(io::WRITE, 20, slba, blocks_of(len), k == 2),
                Data::Out {
                    data: &data,
                    in_capsule,
                },
            )
            .unwrap();
        ok(&c, "Write");
        let (c, got) = q
            .exec(
                rw(io::READ, 21, slba, blocks_of(len), false),
                Data::In(len as u32),
            )
            .unwrap();
        ok(&c, "Read");
        assert!(got == data, "read back differs ({len} bytes)");
    }
    let flush = Sqe {
        opcode: io::FLUSH,
        cid: 22,
        nsid: 1,
        ..Sqe::default()
    };
    ok(&q1.exec(flush, Data::None).unwrap().0, "Flush");

    // Write Zeroes over written data reads back zeroes.
    let slba = blocks_of(MIB) as u64;
    let (c, _) = q1
        .exec(
            rw(io::WRITE_ZEROES, 23, slba, blocks_of(8192), false),
            Data::None,
        )
        .unwrap();
    ok(&c, "Write Zeroes");
    let (c, got) = q1
        .exec(
            rw(io::READ, 24, slba, blocks_of(8192), false),
            Data::In(8192),
        )
        .unwrap();
    ok(&c, "Read after Write Zeroes");
    assert!(got.iter().all(|&b| b == 0), "Write Zeroes did not zero");

    // Deallocate a whole stripe (the array deallocates whole stripes only).
    let stripe = 128 * 1024u64;
    let slba = blocks_of(4 * MIB) as u64;
    let data = pattern(99, stripe as usize);
    ok(
        &q2.exec(
            rw(io::WRITE, 25, slba, blocks_of(stripe), false),
            Data::Out {
                data: &data,
                in_capsule: false,
            },
        )
        .unwrap()
        .0,
        "Write before deallocate",
    );
    let mut ranges = vec![0u8; 4096];
    ranges[4..8].copy_from_slice(&blocks_of(stripe).to_le_bytes());
    ranges[8..16].copy_from_slice(&slba.to_le_bytes());
    let dsm = Sqe {
        opcode: io::DSM,
        cid: 26,
        nsid: 1,
        cdw10: 0,
        cdw11: 1 << 2,
        ..Sqe::default()
    };
    ok(
        &q2.exec(
            dsm,
            Data::Out {
                data: &ranges,
                in_capsule: true,
            },
        )
        .unwrap()
        .0,
        "Dataset Management deallocate",
    );
    let (c, got) = q2
        .exec(
            rw(io::READ, 27, slba, blocks_of(stripe), false),
            Data::In(stripe as u32),
        )
        .unwrap();
    ok(&c, "Read after deallocate");
    assert!(
        got.iter().all(|&b| b == 0),
        "deallocated stripe does not read zeroes"
    );
    // A range past the end: LBA Out of Range.
    ranges[8..16].copy_from_slice(&nsze.to_le_bytes());
    let c = q2
        .exec(
            Sqe { cid: 28, ..dsm },
            Data::Out {
                data: &ranges,
                in_capsule: true,
            },
        )
        .unwrap()
        .0;
    assert_eq!((c.sct(), c.sc()), (sct::GENERIC, sc::LBA_OUT_OF_RANGE));

    // Compare: match, then miscompare.
    let slba = blocks_of(6 * MIB) as u64;
    let data = pattern(5, 8192);
    ok(
        &q1.exec(
            rw(io::WRITE, 29, slba, blocks_of(8192), false),
            Data::Out {
                data: &data,
                in_capsule: false,
            },
        )
        .unwrap()
        .0,
        "Write before Compare",
    );
    let c = q1
        .exec(
            rw(io::COMPARE, 30, slba, blocks_of(8192), false),
            Data::Out {
                data: &data,
                in_capsule: false,
            },
        )
        .unwrap()
        .0;
    ok(&c, "Compare (match)");
    let mut other = data.clone();
    other[5000] ^= 1;
    let c = q1
        .exec(
            rw(io::COMPARE, 31, slba, blocks_of(8192), false),
            Data::Out {
                data: &other,
                in_capsule: false,
            },
        )
        .unwrap()
        .0;
    assert_eq!((c.sct(), c.sc()), (sct::MEDIA, sc::COMPARE_FAILURE));
    let small = &data[..4096];
    let c = q1
        .exec(
            rw(io::COMPARE, 32, slba, blocks_of(4096), false),
            Data::Out {
                data: small,
                in_capsule: true,
            },
        )
        .unwrap()
        .0;
    ok(&c, "Compare in capsule (match)");

    // Out of range and bad opcode.
    let (c, _) = q1
        .exec(
            rw(io::READ, 33, nsze - 1, 2, false),
            Data::In(2 * bs as u32),
        )
        .unwrap();
    assert_eq!(
        (c.sct(), c.sc(), c.dnr()),
        (sct::GENERIC, sc::LBA_OUT_OF_RANGE, true)
    );
    let (c, _) = q1
        .exec(
            Sqe {
                opcode: 0x7E,
                cid: 34,
                nsid: 1,
                ..Sqe::default()
            },
            Data::None,
        )
        .unwrap();
    assert_eq!((c.sct(), c.sc()), (sct::GENERIC, sc::INVALID_OPCODE));
    let (c, _) = q1
        .exec(
            Sqe {
                nsid: 2,
                ..rw(io::READ, 35, 0, 1, false)
            },
            Data::In(bs as u32),
        )
        .unwrap();
    assert_eq!((c.sct(), c.sc()), (sct::GENERIC, sc::INVALID_NS));

    // status --json shows the controller, its two I/O queues and their counters.
    let st = srv.status();
    let ctrls = st["nvmf"]["controllers"]
        .as_array()
        .expect("nvmf controllers");
    let me = ctrls
        .iter()
        .find(|c| c["cntlid"] == u64::from(cntlid))
        .unwrap_or_else(|| panic!("controller {cntlid} not in {st}"));
    assert_eq!(me["kind"], "io");
    assert_eq!(me["hostnqn"], HOSTNQN);
    let qs = me["queues"].as_array().unwrap();
    assert_eq!(
        qs.iter()
            .map(|q| q["qid"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [1, 2]
    );
    let sum = |k: &str| qs.iter().map(|q| q[k].as_u64().unwrap()).sum::<u64>();
    assert!(sum("reads") >= 4 && sum("writes") >= 4, "{me}");
    assert!(sum("errors") >= 3, "{me}");
    assert!(sum("bytes_written") >= 4096 * 2 + 65536 + 131072, "{me}");

    // SMART counts what went through the I/O queues.
    let (c, smart) = get_log(&mut q, 12, 0x02, 512, 0);
    ok(&c, "SMART log");
    assert!(le64(&smart, 64) >= 4, "host read commands");
    assert!(le64(&smart, 80) >= 4, "host write commands");

    // Shutdown: CC.SHN → CSTS.SHST complete.
    let cc = q.prop_get(spec::prop::CC).unwrap() as u32;
    q.prop_set(spec::prop::CC, cc | (1 << 14)).unwrap();
    let csts = q.prop_get(spec::prop::CSTS).unwrap();
    assert_eq!(csts & 0b1100, 0b1000, "SHST complete, CSTS {csts:#x}");
    drop((q3, q4, bad));
    let _ = srv.log();
}

#[test]
fn digests_and_pipelined_io() {
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "dgst");
    let srv = Server::start(dir.path(), &a, 1);
    let (_q, cntlid, bs) = admin_queue(&srv, 30_000, 1, true);
    let mut q1 = io_queue(&srv, 0, cntlid, 1, true);
    // 32 writes in flight of mixed sizes, then 32 reads, each checked.
    let lens = [4096usize, 131072, 8192, 4096, 65536];
    let mut datas = Vec::new();
    for i in 0..32u16 {
        let len = lens[usize::from(i) % lens.len()];
        datas.push(pattern(u64::from(i) + 1000, len));
    }
    for (i, d) in datas.iter().enumerate() {
        let slba = i as u64 * 256 * 1024 / bs;
        q1.submit(
            rw(
                io::WRITE,
                i as u16,
                slba,
                (d.len() as u64 / bs) as u32,
                false,
            ),
            Data::Out {
                data: d,
                in_capsule: d.len() <= 4096,
            },
        )
        .unwrap();
    }
    let mut done = 0;
    while done < datas.len() {
        match q1.next_event().unwrap() {
            Event::R2t(r) => q1.answer_r2t(&r, &datas[usize::from(r.cccid)]).unwrap(),
            Event::Resp(c) => {
                ok(&c, "pipelined Write");
                done += 1;
            }
            e => panic!("unexpected {e:?}"),
        }
    }
    for (i, d) in datas.iter().enumerate() {
        let slba = i as u64 * 256 * 1024 / bs;
        q1.submit(
            rw(
                io::READ,
                i as u16,
                slba,
                (d.len() as u64 / bs) as u32,
                false,
            ),
            Data::In(d.len() as u32),
        )
        .unwrap();
    }
    let mut got: Vec<Vec<u8>> = datas.iter().map(|d| vec![0; d.len()]).collect();
    let mut done = 0;
    while done < datas.len() {
        let ev = q1
            .next_event_with(&mut |cid, off, d| {
                got[usize::from(cid)][off as usize..off as usize + d.len()].copy_from_slice(d)
            })
            .unwrap();
        match ev {
            Event::Resp(c) => {
                ok(&c, "pipelined Read");
                done += 1;
            }
            Event::C2h { .. } => {}
            e => panic!("unexpected {e:?}"),
        }
    }
    for (i, (g, d)) in got.iter().zip(&datas).enumerate() {
        assert!(g == d, "read {i} differs");
    }
}

#[test]
fn malformed_pdu_gets_a_term_req_and_others_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "term");
    let srv = Server::start(dir.path(), &a, 1);
    let (_q, cntlid, bs) = admin_queue(&srv, 30_000, 2, false);
    let blocks = (4096 / bs) as u32;
    let mut good = io_queue(&srv, 0, cntlid, 1, false);
    let mut evil = io_queue(&srv, 0, cntlid, 2, false);
    // A CapsuleCmd with HLEN 70 (must be 72): Invalid PDU Header Field at byte 2.
    let mut pdu = [0u8; 72];
    pdu[0] = 0x04;
    pdu[2] = 70;
    pdu[4..8].copy_from_slice(&72u32.to_le_bytes());
    evil.socket().write_all(&pdu).unwrap();
    match evil.next_event().unwrap() {
        Event::Term { fes, fei } => assert_eq!((fes, fei), (1, 2)),
        e => panic!("expected a C2HTermReq, got {e:?}"),
    }
    // Then the controller closes the connection.
    let mut rest = [0u8; 16];
    evil.socket()
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert_eq!(
        evil.socket().read(&mut rest).unwrap_or(0),
        0,
        "connection not closed"
    );
    // The other queue of the same controller is unaffected.
    let data = pattern(1, 4096);
    ok(
        &good
            .exec(
                rw(io::WRITE, 1, 8, blocks, false),
                Data::Out {
                    data: &data,
                    in_capsule: true,
                },
            )
            .unwrap()
            .0,
        "Write on the other queue",
    );
    let (c, got) = good
        .exec(rw(io::READ, 2, 8, blocks, false), Data::In(4096))
        .unwrap();
    ok(&c, "Read on the other queue");
    assert_eq!(got, data);
    // An H2CData for no R2T: fatal too (TTAG at byte 10).
    let mut q3 = io_queue(&srv, 1, cntlid, 2, false);
    let mut h = [0u8; 24 + 4];
    h[0] = 0x06;
    h[1] = 1 << 2;
    h[2] = 24;
    h[3] = 24;
    h[4..8].copy_from_slice(&28u32.to_le_bytes());
    h[10..12].copy_from_slice(&77u16.to_le_bytes());
    h[16..20].copy_from_slice(&4u32.to_le_bytes());
    q3.socket().write_all(&h).unwrap();
    match q3.next_event().unwrap() {
        Event::Term { fes, fei } => assert_eq!((fes, fei), (1, 10)),
        e => panic!("expected a C2HTermReq, got {e:?}"),
    }
}

#[test]
fn keep_alive_timeout_ends_the_association() {
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "kato");
    let srv = Server::start(dir.path(), &a, 1);
    let (mut q, cntlid, bs) = admin_queue(&srv, 1000, 1, false);
    let mut q1 = io_queue(&srv, 0, cntlid, 1, false);
    // Kept alive for 2.5 s (every 400 ms), the association stays.
    for i in 0..6 {
        std::thread::sleep(Duration::from_millis(400));
        let ka = Sqe {
            opcode: admin::KEEP_ALIVE,
            cid: 10 + i,
            ..Sqe::default()
        };
        ok(&q.exec(ka, Data::None).unwrap().0, "Keep Alive");
    }
    ok(
        &q1.exec(rw(io::READ, 1, 0, 1, false), Data::In(bs as u32))
            .unwrap()
            .0,
        "Read while kept alive",
    );
    // Then silence: both queues are closed within KATO (1 s) plus the check's slack.
    let t = Instant::now();
    q.socket()
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut b = [0u8; 64];
    assert_eq!(
        q.socket().read(&mut b).unwrap_or(0),
        0,
        "admin queue not closed"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    q1.socket()
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert_eq!(
        q1.socket().read(&mut b).unwrap_or(0),
        0,
        "I/O queue not closed"
    );
    assert!(srv.log().contains("keep-alive timeout"), "{}", srv.log());
    // The CNTLID is gone: an I/O queue cannot join it any more.
    let mut q2 = HostQueue::open(srv.addr(0), false, false).unwrap();
    let c = q2.connect(1, 127, cntlid, &params(&srv.nqn, 0)).unwrap();
    assert_eq!(
        (c.sct(), c.sc()),
        (sct::COMMAND, sc::CONNECT_INVALID_PARAMETERS)
    );
}

/// A CapsuleCmd as raw bytes, SQE as given (DPTR included), no digests (TCP 1.0
/// §3.6.2.6: CH 8 bytes, SQE 64, PDO 72 when data follows).
fn raw_capsule(sqe: &Sqe, data: &[u8]) -> Vec<u8> {
    let mut b = vec![0u8; 72];
    b[0] = 0x04;
    b[2] = 72;
    b[3] = if data.is_empty() { 0 } else { 72 };
    b[4..8].copy_from_slice(&((72 + data.len()) as u32).to_le_bytes());
    b[8..72].copy_from_slice(&sqe.encode());
    b.extend_from_slice(data);
    b
}

/// The next CapsuleResp (C2HData before it skipped); panics on anything else.
fn resp(q: &mut HostQueue, what: &str) -> Cqe {
    loop {
        match q.next_event() {
            Ok(Event::Resp(c)) => return c,
            Ok(Event::C2h { .. }) => {}
            other => panic!("{what}: expected a response, got {other:?}"),
        }
    }
}

/// A 4 KiB write then read back on `q` at `slba` (the target still serves, data intact).
fn still_serves(q: &mut HostQueue, cid: u16, slba: u64, bs: u64, seed: u64) {
    let blocks = (4096 / bs) as u32;
    let data = pattern(seed, 4096);
    ok(
        &q.exec(
            rw(io::WRITE, cid, slba, blocks, false),
            Data::Out {
                data: &data,
                in_capsule: false,
            },
        )
        .unwrap()
        .0,
        "Write after the attack",
    );
    let (c, got) = q
        .exec(rw(io::READ, cid + 1, slba, blocks, false), Data::In(4096))
        .unwrap();
    ok(&c, "Read after the attack");
    assert_eq!(got, data, "data read back after the attack");
}

/// Removing the export under a host that streams writes ends its I/O queue gracefully.
/// The host keeps its queue full of 4 KiB in-capsule writes (as fast as responses free
/// its slots) and the export is removed after the first response: the target stops
/// receiving, answers the commands it had and ends the connection with the host's bytes
/// still unread (the commands each response let the host send). The host must read every
/// response and then the end of stream, and must be able to send all it had: the rest
/// of its 16384 writes (64 MiB over the first 4 MiB, far more than the socket buffers
/// hold), sent after the end of stream as by a host whose submitting thread has not yet
/// seen it. A target that closes instead resets the connection under them (EPIPE; with
/// bytes unread at the close, RFC 1122 4.2.2.13, a reset that can also lose responses
/// still queued), so the target shuts its side down and discards what still comes until
/// the host closes.
#[test]
fn an_export_removal_ends_with_every_response_then_the_end_of_stream_not_a_reset() {
    const N: u32 = 16384;
    const LEN: usize = 4096;
    const REGIONS: u32 = 1024;
    // Commands outstanding at most: the queue's 128 entries (SQ size 127, 0's based), less
    // one.
    const DEPTH: u32 = 127;
    const RESP: usize = 24;
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "linger");
    let srv = Server::start(dir.path(), &a, 1);
    let (admin_q, cntlid, bs) = admin_queue(&srv, 0, 1, false);
    let mut q = io_queue(&srv, 0, cntlid, 1, false);
    let mut rx = q.socket().try_clone().unwrap();
    let mut tx = q.socket().try_clone().unwrap();
    let (credit, credits_in) = std::sync::mpsc::channel::<u32>();
    let sender = std::thread::spawn(move || {
        let data = vec![0x5au8; LEN];
        let blocks = (LEN as u64 / bs) as u32;
        let mut left = DEPTH;
        let mut sent = 0u32;
        while sent < N {
            if left == 0 {
                match credits_in.recv() {
                    Ok(k) => left += k,
                    // The reader hung up: the target ended, the rest goes out unlimited.
                    Err(_) => left = N,
                }
                continue;
            }
            let mut sqe = rw(
                io::WRITE,
                sent as u16,
                u64::from(sent % REGIONS) * u64::from(blocks),
                blocks,
                false,
            );
            sqe.flags = ferroraid::nvmf::pdu::PSDT_SGL << 6;
            sqe.dptr = ferroraid::nvmf::pdu::SglDescriptor::in_capsule(LEN as u32);
            if let Err(e) = tx.write_all(&raw_capsule(&sqe, &data)) {
                let _ = tx.shutdown(std::net::Shutdown::Write);
                return (sent, Some(e));
            }
            sent += 1;
            left -= 1;
        }
        // Everything sent: our side ends.
        let _ = tx.shutdown(std::net::Shutdown::Write);
        (sent, None)
    });
    let mut all = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    let mut remover = None;
    let end = loop {
        let before = all.len() / RESP;
        match rx.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(k) => all.extend_from_slice(&buf[..k]),
            Err(e) => break Err(e),
        }
        let now = all.len() / RESP;
        let _ = credit.send((now - before) as u32);
        if now > 0 && remover.is_none() {
            let path = srv.srv.rpc.clone().expect("--rpc");
            remover = Some(std::thread::spawn(move || {
                RpcClient::connect(path)
                    .unwrap()
                    .call("export_remove", serde_json::json!({"protocol": "nvmf"}))
            }));
        }
    };
    // The host saw the end: its admin queue goes, and its writer sends the rest.
    drop(admin_q);
    drop(credit);
    let (sent, write_error) = sender.join().unwrap();
    let removed = remover.expect("a first response").join().unwrap().unwrap();
    let answered = all.len() / RESP;
    assert!(
        end.is_ok(),
        "the connection was reset instead of ended after {answered} responses: {end:?}"
    );
    assert_eq!(
        all.len() % RESP,
        0,
        "a response cut short: {} bytes",
        all.len()
    );
    // The target took (and threw away) what the host still sent until it ended its side,
    // rather than resetting the connection under it.
    assert!(
        write_error.is_none() && sent == N,
        "the host could not send all it had: {write_error:?} after {sent}\n{}",
        srv.log()
    );
    let mut cids = Vec::new();
    for r in all.chunks(RESP) {
        assert_eq!(
            (r[0], r[2], r[4]),
            (0x05, 24, 24),
            "not a CapsuleResp: {r:?}"
        );
        let c = Cqe::decode(r[8..].try_into().unwrap());
        ok(&c, "write");
        cids.push(u32::from(c.cid));
    }
    // One response per accepted write, none twice, none for a write never sent.
    cids.sort_unstable();
    cids.dedup();
    assert_eq!(cids.len(), answered, "a response sent twice");
    assert!(cids.iter().all(|&c| c < sent), "{cids:?} of {sent} sent");
    assert!(
        (answered as u32) < N,
        "the drain answered every write: nothing was cut"
    );
    assert_eq!(removed["drained"], true, "{removed}\n{}", srv.log());
    eprintln!("{sent} writes sent, {answered} answered before the end of stream");
    assert!(!srv.log().contains("panicked"), "{}", srv.log());
}

#[test]
fn reserved_dwords_set_do_not_crash_the_target() {
    // Flush's CDW10/11 and DSM's CDW11 upper bits are not an LBA: garbage there must not
    // reach the block arithmetic (NVM Command Set 1.0 §3.2.3 Dataset Management: CDW10 NR,
    // CDW11 attributes; §3.2.? Flush: CDW10–15 reserved).
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "rsvd");
    let srv = Server::start(dir.path(), &a, 1);
    let (_admin, cntlid, bs) = admin_queue(&srv, 30_000, 1, false);
    let mut q = io_queue(&srv, 0, cntlid, 1, false);
    let flush = Sqe {
        opcode: io::FLUSH,
        cid: 1,
        nsid: 1,
        cdw10: 0xFFFF_FFFF,
        cdw11: 0xFFFF_FFFF,
        ..Sqe::default()
    };
    let c = q
        .exec(flush, Data::None)
        .unwrap_or_else(|e| panic!("Flush, reserved dwords set: {e}\n{}", srv.log()));
    ok(&c.0, "Flush, reserved dwords set");
    // DSM deallocate, NR 0 (one range), every attribute bit set; the range is valid.
    let mut range = [0u8; 16];
    range[4..8].copy_from_slice(&8u32.to_le_bytes());
    range[8..16].copy_from_slice(&64u64.to_le_bytes());
    let dsm = Sqe {
        opcode: io::DSM,
        cid: 2,
        nsid: 1,
        cdw10: 0,
        cdw11: 0xFFFF_FFFF,
        ..Sqe::default()
    };
    let c = q
        .exec(
            dsm,
            Data::Out {
                data: &range,
                in_capsule: true,
            },
        )
        .unwrap_or_else(|e| panic!("DSM, attributes all ones: {e}\n{}", srv.log()));
    ok(&c.0, "DSM, attribute dword all ones");
    still_serves(&mut q, 3, 128, bs, 11);
}

/// Expects a C2HTermReq, then the connection closed; returns the FES.
fn expect_term(q: &mut HostQueue, what: &str) -> u16 {
    let fes = match q.next_event() {
        Ok(Event::Term { fes, .. }) => fes,
        other => panic!("{what}: expected a C2HTermReq, got {other:?}"),
    };
    q.socket()
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut rest = [0u8; 16];
    assert_eq!(
        q.socket().read(&mut rest).unwrap_or(0),
        0,
        "{what}: connection not closed after the C2HTermReq"
    );
    fes
}

fn status_of(c: &Cqe) -> (u8, u8) {
    (c.sct(), c.sc())
}

#[test]
fn hostile_host_gets_errors_and_the_target_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "evil");
    let srv = Server::start(dir.path(), &a, 1);
    let (mut adm, cntlid, bs) = admin_queue(&srv, 30_000, 16, false);
    let (c, ns) = identify(&mut adm, 20, 0, 1);
    ok(&c, "Identify namespace");
    let nsze = le64(&ns, 0);
    let mut good = io_queue(&srv, 0, cntlid, 1, false);
    still_serves(&mut good, 1, 0, bs, 1);
    let mut evil = io_queue(&srv, 0, cntlid, 2, false);

    // --- Command-level errors: a status, the queue goes on. ---
    let wz = Sqe {
        opcode: io::WRITE_ZEROES,
        ..rw(io::WRITE_ZEROES, 1, nsze - 1, 2, false)
    };
    let c = evil.exec(wz, Data::None).unwrap().0;
    assert_eq!(
        status_of(&c),
        (sct::GENERIC, sc::LBA_OUT_OF_RANGE),
        "WZ past the end"
    );
    let c = evil
        .exec(rw(io::READ, 2, u64::MAX, 1, false), Data::In(bs as u32))
        .unwrap()
        .0;
    assert_eq!(
        status_of(&c),
        (sct::GENERIC, sc::LBA_OUT_OF_RANGE),
        "Read at SLBA 2^64-1"
    );
    // DSM NR=255 (256 ranges), the last past the end: nothing deallocated.
    let keep = pattern(77, 4096);
    ok(
        &evil
            .exec(
                rw(io::WRITE, 3, 0x100, (4096 / bs) as u32, false),
                Data::Out {
                    data: &keep,
                    in_capsule: true,
                },
            )
            .unwrap()
            .0,
        "Write before DSM",
    );
    let mut ranges = vec![0u8; 4096];
    for i in 0..256usize {
        let (slba, nlb) = if i == 255 {
            (nsze - 1, 2u32)
        } else {
            (0x100u64, 8u32)
        };
        ranges[i * 16 + 4..i * 16 + 8].copy_from_slice(&nlb.to_le_bytes());
        ranges[i * 16 + 8..i * 16 + 16].copy_from_slice(&slba.to_le_bytes());
    }
    let dsm = Sqe {
        opcode: io::DSM,
        cid: 4,
        nsid: 1,
        cdw10: 255,
        cdw11: 1 << 2,
        ..Sqe::default()
    };
    let c = evil
        .exec(
            dsm,
            Data::Out {
                data: &ranges,
                in_capsule: false,
            },
        )
        .unwrap()
        .0;
    assert_eq!(
        status_of(&c),
        (sct::GENERIC, sc::LBA_OUT_OF_RANGE),
        "DSM past the end"
    );
    let (c, got) = evil
        .exec(
            rw(io::READ, 5, 0x100, (4096 / bs) as u32, false),
            Data::In(4096),
        )
        .unwrap();
    ok(&c, "Read after the refused DSM");
    assert_eq!(got, keep, "a refused DSM deallocated data");
    // SGL descriptor types NVMe/TCP does not use: SGL Descriptor Type Invalid.
    for (cid, id) in [(6u16, 0x00u8), (7, 0x40), (8, 0xF0), (9, 0x20)] {
        let mut sqe = rw(io::READ, cid, 0, 1, false);
        sqe.flags = 1 << 6;
        sqe.dptr.sgl_identifier = id;
        sqe.dptr.length = bs as u32;
        evil.socket().write_all(&raw_capsule(&sqe, &[])).unwrap();
        let c = resp(&mut evil, "unsupported SGL");
        assert_eq!(c.cid, cid);
        assert_eq!(
            status_of(&c),
            (sct::GENERIC, sc::SGL_TYPE_INVALID),
            "SGL id {id:#x}"
        );
    }
    // PRP data pointer (PSDT 0) on a fabrics queue: Invalid Field.
    let mut sqe = rw(io::READ, 10, 0, 1, false);
    sqe.dptr = ferroraid::nvmf::pdu::SglDescriptor::transport(bs as u32);
    evil.socket().write_all(&raw_capsule(&sqe, &[])).unwrap();
    assert_eq!(
        status_of(&resp(&mut evil, "PSDT 0")),
        (sct::GENERIC, sc::INVALID_FIELD)
    );
    // Transport SGL length not the command's: SGL Data Block Length Invalid.
    let c = evil
        .exec(rw(io::READ, 11, 0, 2, false), Data::In(bs as u32))
        .unwrap()
        .0;
    assert_eq!(status_of(&c), (sct::GENERIC, sc::SGL_LENGTH_INVALID));
    // An admin opcode on an I/O queue; a namespace that does not exist.
    let idf = Sqe {
        opcode: admin::IDENTIFY,
        cid: 12,
        cdw10: 1,
        ..Sqe::default()
    };
    let c = evil.exec(idf, Data::In(4096)).unwrap().0;
    assert_eq!(status_of(&c), (sct::GENERIC, sc::INVALID_OPCODE));
    let mut r = rw(io::READ, 13, 0, 1, false);
    r.nsid = 2;
    let c = evil.exec(r, Data::In(bs as u32)).unwrap().0;
    assert_eq!(status_of(&c), (sct::GENERIC, sc::INVALID_NS));
    // Duplicate CIDs in flight: both complete.
    evil.submit(rw(io::READ, 50, 0, 1, false), Data::In(bs as u32))
        .unwrap();
    evil.submit(rw(io::READ, 50, 8, 1, false), Data::In(bs as u32))
        .unwrap();
    for _ in 0..2 {
        let c = resp(&mut evil, "duplicate CID");
        assert_eq!(c.cid, 50);
        ok(&c, "Read with a duplicate CID");
    }
    still_serves(&mut evil, 60, 0x200, bs, 2);

    // --- Admin queue. ---
    let w = Sqe {
        opcode: io::WRITE,
        cid: 30,
        nsid: 1,
        ..Sqe::default()
    };
    let c = adm.exec(w, Data::None).unwrap().0;
    assert_eq!(
        status_of(&c),
        (sct::GENERIC, sc::INVALID_OPCODE),
        "Write on the admin queue"
    );
    for cns in [0x10u8, 0x11, 0x1F, 0xFF] {
        let (c, _) = identify(&mut adm, 31, cns, 0);
        assert_eq!(
            status_of(&c),
            (sct::GENERIC, sc::INVALID_FIELD),
            "CNS {cns:#x}"
        );
    }
    // Get Log Page: NUMD 2^32 for a 4 KiB buffer; huge offsets.
    let glp = Sqe {
        opcode: admin::GET_LOG_PAGE,
        cid: 32,
        nsid: 0xFFFF_FFFF,
        cdw10: 0x02 | 0xFFFF_0000,
        cdw11: 0xFFFF,
        ..Sqe::default()
    };
    let c = adm.exec(glp, Data::In(4096)).unwrap().0;
    assert_ne!(c.status, 0, "Get Log Page NUMD 2^32 into 4 KiB");
    for off in [4096u64, 1 << 40, u64::MAX - 3] {
        let (c, data) = get_log(&mut adm, 33, 0x02, 512, off);
        if c.status == 0 {
            assert!(data.iter().all(|&b| b == 0), "SMART past its end is zeroes");
        }
    }
    // Keep-Alive with KATO 0: Keep Alive Timeout Invalid; then back to 30 s.
    let set_kato = |ms: u32, cid: u16| Sqe {
        opcode: admin::SET_FEATURES,
        cid,
        cdw10: u32::from(spec::feature::KEEP_ALIVE_TIMER),
        cdw11: ms,
        ..Sqe::default()
    };
    ok(&adm.exec(set_kato(0, 34), Data::None).unwrap().0, "KATO 0");
    let ka = Sqe {
        opcode: admin::KEEP_ALIVE,
        cid: 35,
        ..Sqe::default()
    };
    let c = adm.exec(ka, Data::None).unwrap().0;
    assert_eq!(status_of(&c), (sct::GENERIC, sc::KEEP_ALIVE_INVALID));
    ok(
        &adm.exec(set_kato(30_000, 36), Data::None).unwrap().0,
        "KATO back",
    );
    // QID 0 twice on one connection.
    let c = adm
        .connect(0, 31, 0xFFFF, &params(&srv.nqn, 30_000))
        .unwrap();
    assert_eq!(
        status_of(&c),
        (sct::GENERIC, sc::SEQUENCE),
        "second Connect"
    );

    // --- Before and around Connect. ---
    let mut pre = HostQueue::open(srv.addr(0), false, false).unwrap();
    let (c, _) = identify(&mut pre, 1, 1, 0);
    assert_eq!(
        status_of(&c),
        (sct::GENERIC, sc::SEQUENCE),
        "Identify before Connect"
    );
    let c = pre
        .exec(rw(io::READ, 2, 0, 1, false), Data::In(bs as u32))
        .unwrap()
        .0;
    assert_eq!(
        status_of(&c),
        (sct::GENERIC, sc::SEQUENCE),
        "Read before Connect"
    );
    let c = pre.connect(3, 31, 0x4242, &params(&srv.nqn, 0)).unwrap();
    assert_eq!(
        status_of(&c),
        (sct::COMMAND, sc::CONNECT_INVALID_PARAMETERS),
        "no CNTLID"
    );
    let mut other = params(&srv.nqn, 0);
    other.hostnqn = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000ff".into();
    let c = pre.connect(3, 31, cntlid, &other).unwrap();
    assert_eq!(
        status_of(&c),
        (sct::COMMAND, sc::CONNECT_INVALID_PARAMETERS),
        "other host"
    );
    // Property Set CC with every reserved bit: an answer, and the controller still reads.
    let mut adm2 = HostQueue::open(srv.addr(1), false, false).unwrap();
    ok(
        &adm2
            .connect(0, 31, 0xFFFF, &params(&srv.nqn, 30_000))
            .unwrap(),
        "Connect 2",
    );
    let _ = adm2.prop_set(spec::prop::CC, 0xFF00_000E);
    let _ = adm2.prop_get(spec::prop::CSTS).unwrap();

    // --- Fatal transport errors: C2HTermReq, then closed. ---
    let mut qid = 3u16;
    let mut fresh = |srv: &Server| {
        qid += 1;
        io_queue(srv, 0, cntlid, qid - 1, false)
    };
    // In-capsule data above IOCCSZ (4 KiB + 1 on an I/O queue).
    let mut q = fresh(&srv);
    let big = vec![0u8; 4096 + 512];
    let mut sqe = rw(io::WRITE, 1, 0, 1, false);
    sqe.flags = 1 << 6;
    sqe.dptr = ferroraid::nvmf::pdu::SglDescriptor::in_capsule(big.len() as u32);
    q.socket().write_all(&raw_capsule(&sqe, &big)).unwrap();
    expect_term(&mut q, "in-capsule data above the grant");
    // PLEN lies: shorter than the header; 2 GiB.
    for plen in [8u32, 64, 0x7FFF_FFFF, u32::MAX] {
        let mut q = fresh(&srv);
        let mut b = raw_capsule(&rw(io::READ, 1, 0, 1, false), &[]);
        b[4..8].copy_from_slice(&plen.to_le_bytes());
        q.socket().write_all(&b).unwrap();
        expect_term(&mut q, &format!("PLEN {plen}"));
    }
    // PDO lie: data said to start inside the header.
    let mut q = fresh(&srv);
    let mut b = raw_capsule(&rw(io::WRITE, 1, 0, 1, false), &vec![0u8; bs as usize]);
    b[3] = 16;
    q.socket().write_all(&b).unwrap();
    expect_term(&mut q, "PDO 16");
    // H2CData past the R2T's window, and with a wrong TTAG.
    for (datao, ttag_delta) in [(4096u32, 0u16), (0, 1), (0, 0x8000)] {
        let mut q = fresh(&srv);
        q.submit(
            rw(io::WRITE, 9, 0x300, (4096 / bs) as u32, false),
            Data::Out {
                data: &[0u8; 4096],
                in_capsule: false,
            },
        )
        .unwrap();
        let r = match q.next_event().unwrap() {
            Event::R2t(r) => r,
            e => panic!("expected an R2T, got {e:?}"),
        };
        let mut h = vec![0u8; 24];
        h[0] = 0x06;
        h[1] = 1 << 2;
        h[2] = 24;
        h[3] = 24;
        h[4..8].copy_from_slice(&(24u32 + 4096).to_le_bytes());
        h[8..10].copy_from_slice(&r.cccid.to_le_bytes());
        h[10..12].copy_from_slice(&r.ttag.wrapping_add(ttag_delta).to_le_bytes());
        h[12..16].copy_from_slice(&datao.to_le_bytes());
        h[16..20].copy_from_slice(&4096u32.to_le_bytes());
        h.extend_from_slice(&[0xAB; 4096]);
        q.socket().write_all(&h).unwrap();
        expect_term(&mut q, &format!("H2CData DATAO {datao} TTAG+{ttag_delta}"));
    }
    // A wrong header digest on a connection that negotiated them.
    let mut q = HostQueue::open(srv.addr(0), true, false).unwrap();
    let mut b = raw_capsule(&rw(io::READ, 1, 0, 1, false), &[]);
    b[1] = 1; // HDGSTF
    b[4..8].copy_from_slice(&76u32.to_le_bytes());
    b.extend_from_slice(&[0xDE, 0xAD, 0xBE, 0xEF]);
    q.socket().write_all(&b).unwrap();
    assert_eq!(
        expect_term(&mut q, "header digest"),
        3,
        "FES Header Digest Error"
    );
    // Truncated PDUs, then the host goes away.
    for cut in [1usize, 7, 8, 40, 71] {
        let mut q = HostQueue::open(srv.addr(0), false, false).unwrap();
        let b = raw_capsule(&rw(io::READ, 1, 0, 1, false), &[]);
        q.socket().write_all(&b[..cut]).unwrap();
    }

    // --- Closed mid-R2T and mid-C2HData, more times than the reactor has 128 KiB
    // buffers: none may leak. ---
    let big_blocks = (131_072 / bs) as u32;
    let mut qid = 20u16;
    for i in 0..150 {
        qid = if qid >= 16 { 3 } else { qid + 1 };
        let mut q = loop {
            let mut q = HostQueue::open(srv.addr(0), false, false).unwrap();
            let c = q.connect(qid, 127, cntlid, &params(&srv.nqn, 0)).unwrap();
            if c.status == 0 {
                break q;
            }
            // The previous connection of this QID is still being closed.
            assert_eq!(status_of(&c), (sct::GENERIC, sc::SEQUENCE));
            std::thread::sleep(Duration::from_millis(5));
        };
        if i % 2 == 0 {
            q.submit(
                rw(io::WRITE, 1, 0x400, big_blocks, false),
                Data::Out {
                    data: &vec![0u8; 131_072],
                    in_capsule: false,
                },
            )
            .unwrap();
            assert!(matches!(q.next_event().unwrap(), Event::R2t(_)));
            // Half the data, then gone.
            let mut h = vec![0u8; 24];
            h[0] = 0x06;
            h[2] = 24;
            h[3] = 24;
            h[4..8].copy_from_slice(&(24u32 + 65536).to_le_bytes());
            h[8..10].copy_from_slice(&1u16.to_le_bytes());
            h[16..20].copy_from_slice(&65536u32.to_le_bytes());
            h.extend_from_slice(&[1u8; 65536]);
            q.socket().write_all(&h[..24 + 1000]).unwrap();
        } else {
            q.submit(rw(io::READ, 1, 0x400, big_blocks, false), Data::In(131_072))
                .unwrap();
            let mut some = [0u8; 100];
            q.socket().read_exact(&mut some).unwrap();
        }
    }
    // 128 KiB transfers still get buffers (all of them at once on 16 queues... one here).
    let big = pattern(5, 131_072);
    ok(
        &good
            .exec(
                rw(io::WRITE, 70, 0x800, big_blocks, false),
                Data::Out {
                    data: &big,
                    in_capsule: false,
                },
            )
            .unwrap()
            .0,
        "128 KiB write after the drops",
    );
    let (c, got) = good
        .exec(
            rw(io::READ, 71, 0x800, big_blocks, false),
            Data::In(131_072),
        )
        .unwrap();
    ok(&c, "128 KiB read after the drops");
    assert_eq!(got, big);
    // 64 pool buffers: 64 reads of 128 KiB in flight at once on one queue all complete.
    for k in 0..80u16 {
        good.submit(
            rw(io::READ, 100 + k, 0x800, big_blocks, false),
            Data::In(131_072),
        )
        .unwrap();
    }
    let mut done = 0;
    while done < 80 {
        if let Event::Resp(c) = good.next_event().unwrap() {
            ok(&c, "one of 80 reads of 128 KiB");
            done += 1;
        }
    }
    still_serves(&mut good, 300, 0, bs, 3);
    still_serves(&mut evil, 302, 0x900, bs, 4);
    let log = srv.log();
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn a_host_past_its_sq_size_gets_a_term_req_not_a_hang() {
    // SQSIZE 1 (two entries). Five writes by R2T at once: the host is past its SQ size;
    // the target must not wait forever for a context while the H2CData that would free
    // one sits behind the excess capsule (a fatal PDU Sequence Error, TCP 1.0 §3.6.2.3,
    // as nvmet ends such a queue).
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "sqfull");
    let srv = Server::start(dir.path(), &a, 1);
    let (_adm, cntlid, bs) = admin_queue(&srv, 30_000, 2, false);
    let mut good = io_queue(&srv, 0, cntlid, 1, false);
    let mut q = HostQueue::open(srv.addr(0), false, false).unwrap();
    ok(
        &q.connect(2, 1, cntlid, &params(&srv.nqn, 0)).unwrap(),
        "I/O Connect SQSIZE 1",
    );
    let data = pattern(9, 4096);
    for cid in 0..5u16 {
        q.submit(
            rw(
                io::WRITE,
                cid,
                0x100 + 8 * u64::from(cid),
                (4096 / bs) as u32,
                false,
            ),
            Data::Out {
                data: &data,
                in_capsule: false,
            },
        )
        .unwrap();
    }
    q.socket()
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut responses = 0;
    let ended = loop {
        match q.next_event() {
            Ok(Event::R2t(r)) => q.answer_r2t(&r, &data).unwrap(),
            Ok(Event::Resp(_)) => {
                responses += 1;
                if responses == 5 {
                    break "all completed";
                }
            }
            Ok(Event::Term { fes, .. }) => {
                assert_eq!(fes, 2, "FES PDU Sequence Error");
                break "terminated";
            }
            Ok(e) => panic!("unexpected {e:?}"),
            Err(e) => panic!("no answer after {responses} responses: {e}"),
        }
    };
    assert!(ended == "terminated" || ended == "all completed");
    still_serves(&mut good, 1, 0, bs, 8);
}

/// The serve process's resident memory, KiB.
fn rss_kib(srv: &Server) -> u64 {
    let pid = srv.srv.pid();
    let s = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

#[test]
fn connection_churn_frees_slots_and_buffers() {
    // Thousands of connections opened and dropped (before ICReq, after it, after Connect):
    // every slot and its 136 KiB receive buffer must come back, so that as many queues as
    // the reactor serves (256 by default) can still connect at once.
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "churn");
    let srv = Server::start(dir.path(), &a, 1);
    let (_adm, cntlid, bs) = admin_queue(&srv, 30_000, 2, false);
    let mut good = io_queue(&srv, 0, cntlid, 1, false);
    let warm = rss_kib(&srv);
    for i in 0..1500 {
        match i % 3 {
            0 => drop(TcpStream::connect(srv.addr(i % 2)).unwrap()),
            1 => drop(HostQueue::open(srv.addr(i % 2), i % 2 == 0, true).unwrap()),
            _ => {
                let mut q = HostQueue::open(srv.addr(0), false, false).unwrap();
                let c = q.connect(0, 31, 0xFFFF, &params(&srv.nqn, 0)).unwrap();
                ok(&c, "churn Connect");
            }
        }
    }
    // The reactor frees closed connections on its next turns.
    std::thread::sleep(Duration::from_millis(500));
    let mut held = Vec::new();
    for i in 0..250 {
        let mut q = HostQueue::open(srv.addr(i % 2), false, false)
            .unwrap_or_else(|e| panic!("connection {i} after the churn: {e}\n{}", srv.log()));
        let (c, _) = identify(&mut q, 1, 1, 0);
        assert_eq!((c.sct(), c.sc()), (sct::GENERIC, sc::SEQUENCE));
        held.push(q);
    }
    drop(held);
    std::thread::sleep(Duration::from_millis(500));
    let after = rss_kib(&srv);
    assert!(
        after < warm + 96 * 1024,
        "RSS grew from {warm} KiB to {after} KiB over the churn"
    );
    still_serves(&mut good, 1, 0, bs, 21);
}

/// A host that sends 128 KiB writes by R2T and never sends their data holds at most a
/// quarter of its reactor's 64 transfer buffers (16 R2Ts come back, no more); a 128 KiB
/// read on another queue of the same reactor still completes. Without the per-connection
/// cap the hostile queue took all 64 and the read waited forever.
#[test]
fn a_host_withholding_r2t_data_does_not_starve_other_queues() {
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "r2thog");
    let srv = Server::start(dir.path(), &a, 1);
    let (_adm, cntlid, bs) = admin_queue(&srv, 30_000, 3, false);
    let mut hog = io_queue(&srv, 0, cntlid, 1, false);
    let mut good = io_queue(&srv, 0, cntlid, 2, false);
    let big = 128 * 1024;
    let data = pattern(21, big);
    let blocks = (big as u64 / bs) as u32;
    for cid in 0..70u16 {
        hog.submit(
            rw(
                io::WRITE,
                cid,
                u64::from(cid) * u64::from(blocks),
                blocks,
                false,
            ),
            Data::Out {
                data: &data,
                in_capsule: false,
            },
        )
        .unwrap();
    }
    // The R2Ts the target sends: one per buffer it gave the hog.
    hog.socket()
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut r2ts = 0;
    loop {
        match hog.next_event() {
            Ok(Event::R2t(_)) => r2ts += 1,
            Ok(e) => panic!("unexpected {e:?}"),
            Err(_) => break,
        }
    }
    assert_eq!(
        r2ts, 16,
        "R2Ts (buffers held) for a host that withholds its data"
    );
    good.socket()
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let (c, got) = good
        .exec(rw(io::READ, 1, 0x4000, blocks, false), Data::In(big as u32))
        .unwrap_or_else(|e| panic!("a 128 KiB read beside the hog: {e}"));
    ok(&c, "128 KiB read beside a host withholding R2T data");
    assert_eq!(got.len(), big);
    still_serves(&mut good, 2, 0x8000, bs, 22);
}

/// Sockets that never send ICReq fill a reactor's connection table (256): a real host is
/// then turned away. The target closes each one that has not connected a queue within
/// the connect timeout (10 s), and the host gets in.
#[test]
fn idle_sockets_are_closed_at_the_connect_timeout() {
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "idle");
    let srv = Server::start(dir.path(), &a, 1);
    // Paced, so that the reactor's inbox of new connections never overflows.
    let mut idle: Vec<std::net::TcpStream> = (0..256)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(3));
            std::net::TcpStream::connect(srv.addr(0)).unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    // All still open (a read would block): they hold the table.
    for s in &idle {
        s.set_nonblocking(true).unwrap();
        let mut b = [0u8; 1];
        let e = s
            .peek(&mut b)
            .expect_err("an idle socket closed before the timeout");
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
        s.set_nonblocking(false).unwrap();
    }
    // The table is full: a host's ICReq gets no answer (the socket is closed).
    let turned_away = HostQueue::open(srv.addr(0), false, false)
        .and_then(|mut q| q.connect(0, 31, 0xFFFF, &params(&srv.nqn, 30_000)));
    assert!(turned_away.is_err(), "a host got in past a full table");
    // Each idle socket is closed by the target (EOF) within the timeout and a margin.
    let t = std::time::Instant::now();
    for s in &mut idle {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut b = [0u8; 1];
        let n = s.read(&mut b);
        assert!(
            matches!(n, Ok(0)) || n.is_err() && t.elapsed() < Duration::from_secs(20),
            "an idle socket still open after {:?}: {n:?}",
            t.elapsed()
        );
    }
    assert!(
        t.elapsed() >= Duration::from_secs(8),
        "closed before the timeout"
    );
    let (mut adm, _cntlid, _bs) = admin_queue(&srv, 30_000, 2, false);
    let (c, _) = identify(&mut adm, 9, 1, 0);
    ok(&c, "Identify controller once the idle sockets are gone");
}

// ---- Multipath (ANA), portal management and the host allow-list (issue 22, Build 1/2) ----

/// The two portals of a multipath server: 127.0.0.1 and 127.0.0.2 (loopback accepts the
/// whole 127/8).
const TWO_IPS: [[u8; 4]; 2] = [[127, 0, 0, 1], [127, 0, 0, 2]];
/// Completion DW0 of an ANA change notice: type 2h, info 03h, log 0Ch.
const ANA_AEN: u32 = 0x000C_0302;
/// The AER's CID (the Linux host uses 31 too).
const AER_CID: u16 = 31;

fn params_as(subnqn: &str, hostnqn: &str, kato_ms: u32) -> ConnectParams {
    ConnectParams {
        subnqn: subnqn.into(),
        hostnqn: hostnqn.into(),
        hostid: [7; 16],
        kato_ms,
    }
}

/// An enabled admin queue through `portal` with one I/O queue granted, ANA change notices
/// enabled and an AER outstanding; returns it and its CNTLID.
fn ana_admin(srv: &Server, portal: usize) -> (HostQueue, u16) {
    let mut q = HostQueue::open(srv.addr(portal), false, false).unwrap();
    let c = q.connect(0, 31, 0xFFFF, &params(&srv.nqn, 0)).unwrap();
    ok(&c, "admin Connect");
    q.enable().unwrap();
    let c = q
        .set_features(3, spec::feature::NUMBER_OF_QUEUES, 0)
        .unwrap();
    ok(&c, "Set Features Number of Queues");
    q.enable_events(4, spec::AEC_ANA_CHANGE).unwrap();
    q.submit_aer(AER_CID).unwrap();
    let cntlid = {
        let (c, id) = identify(&mut q, 5, 1, 0);
        ok(&c, "Identify controller");
        le16(&id, 78)
    };
    (q, cntlid)
}

/// The ANA log page (52 bytes, no RGO, RAE as asked): (CHGCNT, group state).
fn ana_log(q: &mut HostQueue, cid: u16, rae: bool) -> (u64, u8) {
    let (c, d) = q.get_log_page(cid, spec::log::ANA, 0, rae, 52, 0).unwrap();
    ok(&c, "Get Log Page ANA");
    assert_eq!(le16(&d, 8), 1, "NGRPS");
    assert_eq!(le32(&d, 16), 1, "ANAGRPID");
    assert_eq!(le32(&d, 20), 1, "NNSID");
    assert_eq!(le64(&d, 24), le64(&d, 0), "group CHGCNT = header CHGCNT");
    assert_eq!(le32(&d, 48), 1, "NSID list");
    (le64(&d, 0), d[32] & 0xF)
}

/// No event arrives on `q` within `ms` milliseconds.
fn no_event(q: &mut HostQueue, ms: u64, what: &str) {
    q.socket()
        .set_read_timeout(Some(Duration::from_millis(ms)))
        .unwrap();
    match q.next_event() {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) => {}
        other => panic!("{what}: expected no event, got {other:?}"),
    }
    q.socket()
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
}

/// The AEN of `q`'s outstanding AER.
fn aen(q: &mut HostQueue, what: &str) -> Cqe {
    let c = resp(q, what);
    assert_eq!(c.cid, AER_CID, "{what}: the AER completes");
    ok(&c, what);
    c
}

/// A 4 KiB write + read on `q`: `Ok` or the write's status (SCT, SC, DNR).
fn try_io(q: &mut HostQueue, slba: u64, bs: u64, seed: u64) -> Result<(), (u8, u8, bool)> {
    let blocks = (4096 / bs) as u32;
    let data = pattern(seed, 4096);
    let (c, _) = q
        .exec(
            rw(io::WRITE, 1, slba, blocks, false),
            Data::Out {
                data: &data,
                in_capsule: true,
            },
        )
        .unwrap();
    if c.status != 0 {
        return Err((c.sct(), c.sc(), c.status & 0x8000 != 0));
    }
    let (c, got) = q
        .exec(rw(io::READ, 2, slba, blocks, false), Data::In(4096))
        .unwrap();
    if c.status != 0 {
        return Err((c.sct(), c.sc(), c.status & 0x8000 != 0));
    }
    assert_eq!(got, data, "data read back");
    Ok(())
}

fn rpc_code(r: Result<impl std::fmt::Debug, ClientError>) -> (i64, String) {
    match r {
        Err(ClientError::Rpc(e)) => (e.code, e.message),
        other => panic!("expected an RPC error, got {other:?}"),
    }
}

#[test]
fn ana_two_portals_identify_log_and_change_notices() {
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "ana");
    let srv = Server::start_on(dir.path(), &a, 2, TWO_IPS, &[]);
    let names = [srv.addr(0).to_string(), srv.addr(1).to_string()];
    let mut admins = Vec::new();
    let mut ios = Vec::new();
    let mut nguids = Vec::new();
    let mut bs = 0;
    for p in 0..2 {
        let (mut q, cntlid) = ana_admin(&srv, p);
        let (c, id) = identify(&mut q, 6, 1, 0);
        ok(&c, "Identify controller");
        assert_eq!(id[76], 0b1011, "CMIC: multi-port, multi-controller, ANA");
        assert_ne!(le32(&id, 92) & (1 << 11), 0, "OAES bit 11");
        assert_eq!(id[342], 10, "ANATT");
        assert_eq!(id[343], 0b0100_0111, "ANACAP");
        assert_eq!(le32(&id, 344), 1, "ANAGRPMAX");
        assert_eq!(le32(&id, 348), 1, "NANAGRPID");
        assert_eq!(le32(&id, 540), 1, "MNAN");
        assert!(le32(&id, 540) <= le32(&id, 516), "MNAN ≤ NN");
        assert_eq!(
            field(&id[768..1024]),
            srv.nqn,
            "one subsystem on both portals"
        );
        let (c, ns) = identify(&mut q, 7, 0, 1);
        ok(&c, "Identify namespace");
        assert_eq!(ns[30] & 1, 1, "NMIC shared");
        assert_eq!(le32(&ns, 92), 1, "ANAGRPID");
        nguids.push(ns[104..120].to_vec());
        bs = 1u64 << ns[130];
        let (c0, st) = ana_log(&mut q, 8, false);
        assert_eq!(st, 1, "portal {p} starts optimized");
        assert_eq!(c0, 0, "no ANA change yet");
        // RGO: the group without its NSID list.
        let (c, d) = q.get_log_page(9, spec::log::ANA, 1, false, 48, 0).unwrap();
        ok(&c, "ANA log with RGO");
        assert_eq!((le32(&d, 20), d[32]), (0, 1), "RGO: NNSID 0, state");
        admins.push(q);
        ios.push(io_queue(&srv, p, cntlid, 1, false));
    }
    assert_eq!(nguids[0], nguids[1], "identical NGUID on both paths");
    for (p, q) in ios.iter_mut().enumerate() {
        try_io(q, 8 * p as u64, bs, 1).expect("I/O on both optimized paths");
    }
    let list = srv.rpc().nvmf_portal_list().unwrap();
    assert_eq!(list.portals.len(), 2, "{list:?}");
    for (p, r) in list.portals.iter().enumerate() {
        assert_eq!(r.portal, names[p]);
        assert_eq!(r.ana_state, AnaState::Optimized);
        assert_eq!((r.controllers, r.connections), (1, 2), "{r:?}");
    }

    // Portal 1 inaccessible: its controller alone is notified; its I/O fails over.
    let r = srv
        .rpc()
        .nvmf_portal_set_ana(&names[1], AnaState::Inaccessible)
        .unwrap();
    assert_eq!(
        (r.ana_state, r.notified),
        (AnaState::Inaccessible, 1),
        "{r:?}"
    );
    assert_eq!(aen(&mut admins[1], "ANA AEN").dw0, ANA_AEN);
    no_event(&mut admins[0], 300, "the other portal's controller");
    assert_eq!(
        try_io(&mut ios[1], 16, bs, 2),
        Err((sct::PATH, sc::ANA_INACCESSIBLE, false)),
        "I/O through the inaccessible portal: SCT 3 / SC 2, DNR clear"
    );
    try_io(&mut ios[0], 16, bs, 3).expect("I/O through the other portal");
    // Read with RAE: the event stays, further notices are masked.
    let (cnt1, st) = ana_log(&mut admins[1], 10, true);
    assert_eq!(st, 3, "log shows inaccessible");
    assert!(cnt1 > 0, "change count advanced");
    let (cnt0, st0) = ana_log(&mut admins[0], 10, false);
    assert_eq!((cnt0, st0), (0, 1), "the other portal's log is unchanged");
    admins[1].submit_aer(AER_CID).unwrap();
    let r = srv
        .rpc()
        .nvmf_portal_set_ana(&names[1], AnaState::NonOptimized)
        .unwrap();
    assert_eq!(
        r.notified, 0,
        "masked until the log is read without RAE: {r:?}"
    );
    no_event(&mut admins[1], 300, "masked notice");
    try_io(&mut ios[1], 24, bs, 4).expect("non-optimized serves I/O");
    // Read without RAE: unmasked; the next change is notified.
    let (cnt2, st) = ana_log(&mut admins[1], 11, false);
    assert_eq!(st, 2, "log shows non-optimized");
    assert!(cnt2 > cnt1, "change count advanced again");
    let r = srv
        .rpc()
        .nvmf_portal_set_ana(&names[1], AnaState::Optimized)
        .unwrap();
    assert_eq!(r.notified, 1, "{r:?}");
    assert_eq!(aen(&mut admins[1], "second ANA AEN").dw0, ANA_AEN);
    let (_, st) = ana_log(&mut admins[1], 12, false);
    assert_eq!(st, 1);
    try_io(&mut ios[1], 32, bs, 5).expect("optimized again: I/O works");
    // The same state again is no change: nobody notified.
    admins[1].submit_aer(AER_CID).unwrap();
    let r = srv
        .rpc()
        .nvmf_portal_set_ana(&names[1], AnaState::Optimized)
        .unwrap();
    assert_eq!(r.notified, 0);
    no_event(&mut admins[1], 200, "no change, no notice");
    assert!(srv.log().contains("ANA state changed"), "{}", srv.log());
}

#[test]
fn portal_remove_add_and_rpc_errors() {
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "portals");
    let srv = Server::start_on(dir.path(), &a, 1, TWO_IPS, &[]);
    let names = [srv.addr(0).to_string(), srv.addr(1).to_string()];
    let (mut admin0, id0) = ana_admin(&srv, 0);
    let (mut admin1, id1) = ana_admin(&srv, 1);
    let mut io0 = io_queue(&srv, 0, id0, 1, false);
    let _io1 = io_queue(&srv, 1, id1, 1, false);
    let (c, ns) = identify(&mut admin0, 6, 0, 1);
    ok(&c, "Identify namespace");
    let bs = 1u64 << ns[130];
    let mut rpc = srv.rpc();

    // Errors change nothing.
    let unknown = "127.0.0.3:4420";
    let (code, msg) = rpc_code(rpc.nvmf_portal_set_ana(unknown, AnaState::Inaccessible));
    assert_eq!(code, codes::NO_SUCH_PORTAL, "{msg}");
    assert!(msg.contains(unknown), "{msg}");
    let (code, msg) = rpc_code(rpc.nvmf_portal_remove(unknown));
    assert_eq!(code, codes::NO_SUCH_PORTAL, "{msg}");
    let (code, msg) = rpc_code(rpc.call(
        "nvmf_portal_set_ana",
        serde_json::json!({"portal": names[1], "ana_state": "sleepy"}),
    ));
    assert_eq!(code, codes::INVALID_PARAMS, "{msg}");
    assert!(
        msg.contains("sleepy") && msg.contains("inaccessible"),
        "{msg}"
    );
    let (code, msg) = rpc_code(rpc.nvmf_portal_remove("not-an-address"));
    assert_eq!(code, codes::INVALID_PARAMS, "{msg}");
    let (code, msg) = rpc_code(rpc.nvmf_portal_add(&names[0], None));
    assert_eq!(code, codes::PORTAL_EXISTS, "{msg}");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_addr = busy.local_addr().unwrap().to_string();
    let (code, msg) = rpc_code(rpc.nvmf_portal_add(&busy_addr, None));
    assert_eq!(code, codes::PORTAL_BIND_FAILED, "{msg}");
    assert!(msg.contains(&busy_addr), "{msg}");
    let list = rpc.nvmf_portal_list().unwrap();
    assert_eq!(list.portals.len(), 2, "errors disturb nothing: {list:?}");
    try_io(&mut io0, 0, bs, 1).expect("I/O after the refused requests");
    no_event(&mut admin1, 100, "no notice from refused requests");

    // Remove portal 1: its connections close, new ones are refused, portal 0 serves.
    let r = rpc.nvmf_portal_remove(&names[1]).unwrap();
    assert_eq!(
        (r.portal.as_str(), r.closed),
        (names[1].as_str(), 2),
        "{r:?}"
    );
    admin1
        .socket()
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    match admin1.next_event() {
        Err(e) => assert_ne!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}"),
        Ok(ev) => panic!("the removed portal's admin queue got {ev:?}, not a close"),
    }
    let refused = TcpStream::connect_timeout(&srv.addr(1), Duration::from_secs(2));
    assert!(refused.is_err(), "the removed portal still accepts");
    let list = rpc.nvmf_portal_list().unwrap();
    assert_eq!(list.portals.len(), 1, "{list:?}");
    assert_eq!(list.portals[0].portal, names[0]);
    try_io(&mut io0, 8, bs, 2).expect("I/O through the remaining portal");
    let (code, _) = rpc_code(rpc.nvmf_portal_remove(&names[1]));
    assert_eq!(code, codes::NO_SUCH_PORTAL, "removed twice");

    // Add it back, non-optimized: a host connects again and sees the state.
    let r = rpc
        .nvmf_portal_add(&names[1], Some(AnaState::NonOptimized))
        .unwrap();
    assert_eq!(
        (r.portal.as_str(), r.ana_state),
        (names[1].as_str(), AnaState::NonOptimized)
    );
    let (mut admin1, id1) = ana_admin(&srv, 1);
    let (_, st) = ana_log(&mut admin1, 9, false);
    assert_eq!(st, 2, "the re-added portal's state");
    let mut io1 = io_queue(&srv, 1, id1, 1, false);
    try_io(&mut io1, 16, bs, 3).expect("I/O through the re-added portal");
    let list = rpc.nvmf_portal_list().unwrap();
    assert_eq!(list.portals.len(), 2, "{list:?}");
    assert_eq!(list.portals[1].ana_state, AnaState::NonOptimized);
    drop(busy);
}

#[test]
fn allow_list_refuses_unlisted_hosts() {
    const OTHER: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000002";
    let dir = tempfile::tempdir().unwrap();
    let a = create(dir.path(), "allow");
    let srv = Server::start_on(
        dir.path(),
        &a,
        1,
        [[127, 0, 0, 1]; 2],
        &["--nvmf-allow-host", HOSTNQN],
    );
    // The listed host connects (admin and I/O queue) and does I/O.
    let (_admin, cntlid, bs) = admin_queue(&srv, 0, 1, false);
    let mut io_ok = io_queue(&srv, 1, cntlid, 1, false);
    try_io(&mut io_ok, 0, bs, 1).expect("I/O of the allowed host");
    // An unlisted host: Connect Invalid Host (SCT 1, SC 84h, DNR) on the admin queue...
    let mut q = HostQueue::open(srv.addr(0), false, false).unwrap();
    let c = q
        .connect(0, 31, 0xFFFF, &params_as(&srv.nqn, OTHER, 0))
        .unwrap();
    assert_eq!(
        (c.sct(), c.sc(), c.status & 0x8000 != 0),
        (sct::COMMAND, sc::CONNECT_INVALID_HOST, true),
        "admin Connect of an unlisted host"
    );
    assert_eq!(c.dw0, (1 << 16) | 512, "IATTR + IPO name HOSTNQN");
    // ... and on an I/O queue of the allowed host's controller.
    let mut q = HostQueue::open(srv.addr(1), false, false).unwrap();
    let c = q
        .connect(2, 127, cntlid, &params_as(&srv.nqn, OTHER, 0))
        .unwrap();
    assert_eq!(
        (c.sct(), c.sc()),
        (sct::COMMAND, sc::CONNECT_INVALID_HOST),
        "I/O Connect of an unlisted host"
    );
    // Discovery: any host connects; only the listed one sees the subsystem.
    for (host, entries) in [(HOSTNQN, 2u64), (OTHER, 0)] {
        let mut d = HostQueue::open(srv.addr(0), false, false).unwrap();
        let c = d
            .connect(0, 31, 0xFFFF, &params_as(spec::DISCOVERY_NQN, host, 0))
            .unwrap();
        ok(&c, "discovery Connect");
        d.enable().unwrap();
        let (c, log) = get_log(&mut d, 5, spec::log::DISCOVERY, 1024, 0);
        ok(&c, "discovery log");
        assert_eq!(le64(&log, 8), entries, "NUMREC for {host}");
    }
    try_io(&mut io_ok, 8, bs, 2).expect("the allowed host still served");
    let log = srv.log();
    assert_eq!(
        log.matches("not on the allow-list").count(),
        1,
        "the refused host is logged once:\n{log}"
    );
}
