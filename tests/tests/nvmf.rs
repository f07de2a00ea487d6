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
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferroraid::nvmf::host::{ConnectParams, Data, Event, HostQueue};
use ferroraid::nvmf::pdu::{Cqe, Sqe};
use ferroraid::nvmf::spec::{self, admin, io, sc, sct};
use ferroraid_tests::{run_tool, show_output};

const MIB: u64 = 1 << 20;
const TOOL_TIMEOUT: Duration = Duration::from_secs(120);
const START_TIMEOUT: Duration = Duration::from_secs(30);
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding 127.0.0.1:0")
        .port()
}

fn ferroraid_cmd<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut c = Command::new(ferroraid_tests::ferroraid_bin());
    c.args(args).env("RUST_LOG", "info").env("NO_COLOR", "1");
    c
}

/// A created RAID5 array of three 16 MiB members, 64 KiB chunks.
struct Array {
    name: String,
    members: Vec<PathBuf>,
    uuid_hex: String,
}

fn create(dir: &Path, name: &str) -> Array {
    let members: Vec<PathBuf> = (0..3)
        .map(|i| {
            let p = dir.join(format!("{name}{i}.img"));
            fs::File::create(&p)
                .and_then(|f| f.set_len(16 * MIB))
                .unwrap();
            p
        })
        .collect();
    let mut cmd = ferroraid_cmd(["create", "--level", "5", "--chunk", "64K", "--name", name]);
    cmd.args(&members);
    let out = run_tool(&mut cmd, dir, TOOL_TIMEOUT);
    assert!(out.status.success(), "create: {}", show_output(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let uuid_hex = text
        .split("(UUID ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap_or_else(|| panic!("no UUID in {text}"))
        .replace(':', "");
    Array {
        name: name.into(),
        members,
        uuid_hex,
    }
}

/// `ferroraid serve --nvmf` on two free ports (two portals).
struct Server {
    child: Option<Child>,
    rpc: PathBuf,
    stderr: PathBuf,
    ports: [u16; 2],
    nqn: String,
}

impl Server {
    fn start(dir: &Path, a: &Array, reactors: usize) -> Server {
        let ports = [free_port(), free_port()];
        let mut args: Vec<OsString> = vec!["serve".into(), "--adaptive".into()];
        args.extend(["--reactors".into(), reactors.to_string().into()]);
        args.extend(["--nbd".into(), format!("127.0.0.1:{}", free_port()).into()]);
        for p in ports {
            args.extend(["--nvmf".into(), format!("127.0.0.1:{p}").into()]);
        }
        args.extend(["--rpc".into(), dir.join("rpc.sock").into_os_string()]);
        args.extend(a.members.iter().map(|m| m.as_os_str().to_owned()));
        let stderr = dir.join("serve.err");
        let mut cmd = ferroraid_cmd(&args);
        // SAFETY: prctl is async-signal-safe; the server dies with the test process.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(fs::File::create(dir.join("serve.out")).unwrap())
            .stderr(fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("starting ferroraid serve");
        let s = Server {
            child: Some(child),
            rpc: dir.join("rpc.sock"),
            stderr,
            ports,
            nqn: format!("nqn.2026-11.org.ferroraid:{}", a.name),
        };
        let deadline = Instant::now() + START_TIMEOUT;
        while TcpStream::connect(("127.0.0.1", ports[1])).is_err() {
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
        SocketAddr::from(([127, 0, 0, 1], self.ports[i]))
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// `ferroraid status --json` over the management socket.
    fn status(&self, dir: &Path) -> serde_json::Value {
        let out = run_tool(
            ferroraid_cmd(["status", "--json", "--rpc"]).arg(&self.rpc),
            dir,
            TOOL_TIMEOUT,
        );
        assert!(out.status.success(), "status: {}", show_output(&out));
        serde_json::from_slice(&out.stdout).expect("status --json is JSON")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
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
    let st = srv.status(dir.path());
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
