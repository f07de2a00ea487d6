//! NBD block status (`NBD_CMD_BLOCK_STATUS`, metadata context `base:allocation`) end to
//! end: real reactor threads over sparse member files (io_uring), the NBD front-end on a
//! random 127.0.0.1 port, driven by
//!
//! - a raw client: the negotiation (`NBD_OPT_LIST_META_CONTEXT`,
//!   `NBD_OPT_SET_META_CONTEXT` before structured replies, unknown contexts, another
//!   export's name) and the command (`NBD_CMD_FLAG_REQ_ONE`, out of range, no context,
//!   the per-reply descriptor cap), the connection in sync after each;
//! - `nbdinfo --map`, `qemu-img map` and `qemu-io` (skipped with a printed reason when not
//!   installed, unless `FERRORAID_REQUIRE_TOOLS=1`): a fresh array is all hole/zero;
//!   written stripes are data and the rest zero; a whole-stripe write-zeroes makes its
//!   stripe zero again; every range reported zero reads as zeroes.
//!
//! No timing is asserted.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use drivers::uring::{UringConfig, UringDevice};
use engine::array::ArrayConfig;
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use engine::parity::Parity;
use engine::reactor::{Mode, ReactorConfig, Reactors};
use ferroraid::nbd::proto::{self, Request};
use ferroraid::nbd::{ExportConfig, NbdFrontend, NbdServer};
use ferroraid_tests::{run_tool, show_output, tool, Rng};

const NAME: &str = "bs";
const MEMBERS: u16 = 6;
const CHUNK: u64 = 64 << 10;
/// Data bytes of one stripe (RAID6 over 6: 4 data chunks).
const STRIPE: u64 = 4 * CHUNK;
/// 512 stripes: the export is 128 MiB, the sparse members 32 MiB each.
const STRIPES: u64 = 512;
const TOOL_TIMEOUT: Duration = Duration::from_secs(120);
const HOLE_ZERO: u32 = proto::STATE_HOLE | proto::STATE_ZERO;

struct Target {
    server: Option<NbdServer>,
    reactors: Option<Reactors<NbdFrontend>>,
    port: u16,
    dir: tempfile::TempDir,
    size: u64,
}

impl Target {
    /// RAID6 over 6 fresh sparse member files, one reactor; `block_status` as given.
    fn start(block_status: bool) -> Self {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, MEMBERS, CHUNK, 512).unwrap();
        let geo = ArrayGeometry::new(g, STRIPES).unwrap();
        let devices: Vec<UringDevice> = (0..MEMBERS)
            .map(|i| {
                let p = dir.path().join(format!("m{i}.img"));
                std::fs::File::create(&p)
                    .unwrap()
                    .set_len(STRIPES * CHUNK)
                    .unwrap();
                UringDevice::open(&p, &UringConfig::default()).unwrap()
            })
            .collect();
        let mut export = ExportConfig::for_array(NAME, &geo, 1 << 20);
        export.block_status = block_status;
        let (server, frontends) = NbdServer::builder(export)
            .listen_tcp("127.0.0.1:0".parse().unwrap())
            .start(1)
            .unwrap();
        let port = server.tcp_addrs()[0].port();
        let cfg = ReactorConfig {
            cores: vec![None],
            mode: Mode::Adaptive,
            requests: 256,
            foreign_reads: true,
        };
        let reactors = Reactors::start(
            Arc::new(devices),
            geo,
            Parity::new(),
            ArrayConfig::default(),
            cfg,
            frontends,
        )
        .unwrap();
        Self {
            server: Some(server),
            reactors: Some(reactors),
            port,
            dir,
            size: geo.capacity_bytes(),
        }
    }

    fn uri(&self) -> String {
        format!("nbd://127.0.0.1:{}/{NAME}", self.port)
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
        if let Some(r) = self.reactors.take() {
            let fes = r.stop().unwrap();
            if !std::thread::panicking() {
                for f in fes {
                    assert_eq!(f.free_buffers(), f.buffers(), "buffers left taken");
                }
            }
        }
    }
}

fn run_ok(cmd: &mut Command, dir: &Path) -> String {
    let out = run_tool(cmd, dir, TOOL_TIMEOUT);
    assert!(out.status.success(), "{cmd:?}: {}", show_output(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

// ---------------------------------------------------------------------------------------
// A raw client.
// ---------------------------------------------------------------------------------------

struct Raw {
    s: TcpStream,
    next: u64,
}

/// What came back for one request: an error (0: none) and the block descriptors.
#[derive(Debug)]
struct Answer {
    error: u32,
    /// (context id, [(length, flags)]) of a block status chunk.
    status: Option<(u32, Vec<(u32, u32)>)>,
    data: Vec<u8>,
}

fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_nodelay(true).unwrap();
    let mut s = s;
    let mut g = [0u8; proto::GREETING_BYTES];
    s.read_exact(&mut g).unwrap();
    s.write_all(&(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    s
}

/// Sends an option and reads its replies up to the final one: (reply type, data) each.
fn option(s: &mut TcpStream, opt: u32, data: &[u8]) -> Vec<(u32, Vec<u8>)> {
    s.write_all(&proto::encode_option_header(opt, data.len() as u32))
        .unwrap();
    s.write_all(data).unwrap();
    let mut out = Vec::new();
    loop {
        let mut h = [0u8; proto::OPTION_REPLY_HEADER_BYTES];
        s.read_exact(&mut h).unwrap();
        let h = proto::parse_option_reply_header(&h).unwrap();
        assert_eq!(h.option, opt);
        let mut d = vec![0u8; h.length as usize];
        s.read_exact(&mut d).unwrap();
        let last = !matches!(
            h.reply,
            proto::REP_SERVER | proto::REP_INFO | proto::REP_META_CONTEXT
        );
        out.push((h.reply, d));
        if last {
            return out;
        }
    }
}

fn meta(name: &str, queries: &[&str]) -> Vec<u8> {
    let q: Vec<&[u8]> = queries.iter().map(|q| q.as_bytes()).collect();
    proto::encode_meta_context_request(name.as_bytes(), &q)
}

fn ctx_reply(id: u32) -> (u32, Vec<u8>) {
    (
        proto::REP_META_CONTEXT,
        proto::rep_meta_context_data(id, proto::BASE_ALLOCATION),
    )
}

fn ack() -> (u32, Vec<u8>) {
    (proto::REP_ACK, Vec::new())
}

impl Raw {
    /// Structured replies, `base:allocation` selected when `select`, then `NBD_OPT_GO`.
    fn go(port: u16, select: bool) -> Self {
        let mut s = connect(port);
        assert_eq!(option(&mut s, proto::OPT_STRUCTURED_REPLY, &[]), [ack()]);
        if select {
            let r = option(
                &mut s,
                proto::OPT_SET_META_CONTEXT,
                &meta(NAME, &[proto::BASE_ALLOCATION]),
            );
            assert_eq!(r, [ctx_reply(proto::BASE_ALLOCATION_ID), ack()]);
        }
        let r = option(
            &mut s,
            proto::OPT_GO,
            &proto::encode_info_request(NAME.as_bytes(), &[proto::INFO_BLOCK_SIZE]),
        );
        assert_eq!(r.last().unwrap().0, proto::REP_ACK, "{r:?}");
        Raw { s, next: 1 }
    }

    fn call(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Answer {
        let handle = self.next;
        self.next += 1;
        let r = Request {
            flags,
            command,
            handle,
            offset,
            length,
        };
        self.s.write_all(&proto::encode_request(&r)).unwrap();
        self.s.write_all(payload).unwrap();
        let mut a = Answer {
            error: 0,
            status: None,
            data: Vec::new(),
        };
        loop {
            let mut hb = [0u8; 20];
            self.s.read_exact(&mut hb[..4]).unwrap();
            if u32::from_be_bytes(hb[..4].try_into().unwrap()) == proto::SIMPLE_REPLY_MAGIC {
                self.s.read_exact(&mut hb[4..16]).unwrap();
                let (h, _) = proto::parse_reply_header(&hb[..16]).unwrap();
                let proto::ReplyHeader::Simple { error, handle: h } = h else {
                    unreachable!()
                };
                assert_eq!(h, handle);
                assert_ne!(
                    command,
                    proto::CMD_READ,
                    "simple reply to a structured read"
                );
                a.error = error;
                return a;
            }
            self.s.read_exact(&mut hb[4..20]).unwrap();
            let (h, _) = proto::parse_reply_header(&hb).unwrap();
            let proto::ReplyHeader::Structured {
                flags,
                kind,
                handle: h,
                length,
            } = h
            else {
                unreachable!()
            };
            assert_eq!(h, handle);
            let mut p = vec![0u8; length as usize];
            self.s.read_exact(&mut p).unwrap();
            let be = |i: usize| u32::from_be_bytes(p[i..i + 4].try_into().unwrap());
            match kind {
                proto::REPLY_TYPE_BLOCK_STATUS => {
                    assert_eq!(command, proto::CMD_BLOCK_STATUS);
                    assert!(p.len() >= 12 && (p.len() - 4).is_multiple_of(8), "{p:?}");
                    assert!(flags & proto::REPLY_FLAG_DONE != 0, "one final chunk");
                    let d = (4..p.len())
                        .step_by(8)
                        .map(|i| (be(i), be(i + 4)))
                        .collect();
                    a.status = Some((be(0), d));
                }
                proto::REPLY_TYPE_OFFSET_DATA => a.data.extend_from_slice(&p[8..]),
                proto::REPLY_TYPE_NONE => {}
                proto::REPLY_TYPE_ERROR | proto::REPLY_TYPE_ERROR_OFFSET => a.error = be(0),
                k => panic!("chunk type {k}"),
            }
            if flags & proto::REPLY_FLAG_DONE != 0 {
                return a;
            }
        }
    }

    /// Block status of `[offset, offset + len)`: the descriptors, checked against the
    /// protocol's rules (context id, at least one, first nonzero, sum ≤ len, one with
    /// `req_one`).
    fn status(&mut self, offset: u64, len: u32, req_one: bool) -> Vec<(u32, u32)> {
        let flags = if req_one { proto::CMD_FLAG_REQ_ONE } else { 0 };
        let a = self.call(proto::CMD_BLOCK_STATUS, flags, offset, len, &[]);
        assert_eq!(a.error, 0, "{a:?}");
        let (id, d) = a.status.expect("a block status chunk");
        assert_eq!(id, proto::BASE_ALLOCATION_ID);
        assert!(!d.is_empty() && d[0].0 > 0, "{d:?}");
        assert!(d.iter().map(|x| u64::from(x.0)).sum::<u64>() <= u64::from(len));
        assert!(d.iter().all(|x| x.1 == 0 || x.1 == HOLE_ZERO), "{d:?}");
        if req_one {
            assert_eq!(d.len(), 1);
        }
        d
    }

    /// The map of the whole export, asking again from where each reply ended.
    fn map(&mut self, size: u64) -> Vec<(u64, u64, bool)> {
        let mut out: Vec<(u64, u64, bool)> = Vec::new();
        let mut at = 0;
        while at < size {
            let len = (size - at).min(u64::from(u32::MAX) / 512 * 512) as u32;
            for (l, f) in self.status(at, len, false) {
                let zero = f == HOLE_ZERO;
                match out.last_mut() {
                    Some(last) if last.2 == zero && last.0 + last.1 == at => last.1 += u64::from(l),
                    _ => out.push((at, u64::from(l), zero)),
                }
                at += u64::from(l);
            }
        }
        out
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let a = self.call(proto::CMD_WRITE, 0, offset, data.len() as u32, data);
        assert_eq!(a.error, 0);
    }

    fn read(&mut self, offset: u64, len: u32) -> Vec<u8> {
        let a = self.call(proto::CMD_READ, 0, offset, len, &[]);
        assert_eq!(a.error, 0);
        assert_eq!(a.data.len(), len as usize);
        a.data
    }

    /// A write and a read back: the connection is in sync.
    fn check_alive(&mut self, offset: u64) {
        let d = Rng::new(offset).bytes(4096);
        self.write(offset, &d);
        assert!(self.read(offset, 4096) == d);
    }
}

/// Stripes reported zero by `map` (each whole stripe inside a zero run).
fn zero_stripes(map: &[(u64, u64, bool)]) -> Vec<bool> {
    let mut z = vec![false; STRIPES as usize];
    for &(off, len, zero) in map {
        if zero {
            assert!(
                off % STRIPE == 0 && len % STRIPE == 0,
                "zero run {off}+{len}"
            );
            for s in off / STRIPE..(off + len) / STRIPE {
                z[s as usize] = true;
            }
        }
    }
    z
}

// ---------------------------------------------------------------------------------------
// Tests.
// ---------------------------------------------------------------------------------------

#[test]
fn negotiation_of_the_base_allocation_context() {
    let t = Target::start(true);
    let mut s = connect(t.port);
    let list = proto::OPT_LIST_META_CONTEXT;
    let set = proto::OPT_SET_META_CONTEXT;
    // LIST: no query, `base:` and the name list it (id 0); another namespace nothing.
    assert_eq!(
        option(&mut s, list, &meta(NAME, &[])),
        [ctx_reply(0), ack()]
    );
    assert_eq!(
        option(&mut s, list, &meta("", &["base:"])),
        [ctx_reply(0), ack()]
    );
    assert_eq!(
        option(
            &mut s,
            list,
            &meta(NAME, &["qemu:dirty-bitmap:a", "base:allocation"])
        ),
        [ctx_reply(0), ack()]
    );
    assert_eq!(option(&mut s, list, &meta(NAME, &["qemu:"])), [ack()]);
    // Another export's name; malformed lengths (payload consumed: the next option works).
    assert_eq!(
        option(&mut s, list, &meta("other", &[]))[0].0,
        proto::REP_ERR_UNKNOWN
    );
    assert_eq!(
        option(&mut s, set, &[0, 0, 0, 0, 0, 0, 0, 3, 0, 0])[0].0,
        proto::REP_ERR_INVALID
    );
    // SET before structured replies is invalid.
    let r = option(&mut s, set, &meta(NAME, &[proto::BASE_ALLOCATION]));
    assert_eq!((r.len(), r[0].0), (1, proto::REP_ERR_INVALID));
    assert_eq!(option(&mut s, proto::OPT_STRUCTURED_REPLY, &[]), [ack()]);
    // Unknown contexts are silently not selected; `base:` selects nothing.
    assert_eq!(
        option(&mut s, set, &meta(NAME, &["nope:x", "base:"])),
        [ack()]
    );
    assert_eq!(
        option(&mut s, set, &meta("other", &[proto::BASE_ALLOCATION]))[0].0,
        proto::REP_ERR_UNKNOWN
    );
    assert_eq!(
        option(&mut s, set, &meta("", &["nope:x", proto::BASE_ALLOCATION])),
        [ctx_reply(proto::BASE_ALLOCATION_ID), ack()]
    );
    // NBD_OPT_EXPORT_NAME keeps the selection: block status works.
    s.write_all(&proto::encode_option_header(proto::OPT_EXPORT_NAME, 0))
        .unwrap();
    let mut r = [0u8; 10];
    s.read_exact(&mut r).unwrap();
    let mut c = Raw { s, next: 1 };
    assert_eq!(c.status(0, 1 << 20, false), [(1 << 20, HOLE_ZERO)]);
    c.check_alive(0);

    // With block status off: nothing listed, nothing selected, the command refused.
    let off = Target::start(false);
    let mut s = connect(off.port);
    assert_eq!(option(&mut s, list, &meta(NAME, &[])), [ack()]);
    assert_eq!(option(&mut s, proto::OPT_STRUCTURED_REPLY, &[]), [ack()]);
    assert_eq!(
        option(&mut s, set, &meta(NAME, &[proto::BASE_ALLOCATION])),
        [ack()]
    );
    let mut c = Raw::go(off.port, false);
    let a = c.call(proto::CMD_BLOCK_STATUS, 0, 0, 4096, &[]);
    assert_eq!(a.error, proto::EINVAL);
    c.check_alive(4096);
}

#[test]
fn block_status_command_rules_and_the_map_after_writes() {
    let t = Target::start(true);
    let size = t.size;
    assert_eq!(size, STRIPES * STRIPE);
    // Without a selected context: EINVAL, in sync.
    let mut plain = Raw::go(t.port, false);
    assert_eq!(
        plain.call(proto::CMD_BLOCK_STATUS, 0, 0, 4096, &[]).error,
        proto::EINVAL
    );
    plain.check_alive(STRIPE * 7);

    let mut c = Raw::go(t.port, true);
    // Stripe 7 was written by `plain`; everything else reads as zeroes (fresh sparse
    // members).
    let m = c.map(size);
    let mut want = vec![true; STRIPES as usize];
    want[7] = false;
    assert_eq!(zero_stripes(&m), want, "{m:?}");
    // REQ_ONE: one descriptor, clipped to the request.
    assert_eq!(c.status(0, 4096, true), [(4096, HOLE_ZERO)]);
    assert_eq!(
        c.status(STRIPE * 6, (STRIPE * 3) as u32, true),
        [(STRIPE as u32, HOLE_ZERO)]
    );
    assert_eq!(
        c.status(STRIPE * 6 + 512, (STRIPE * 3) as u32, false),
        [
            (STRIPE as u32 - 512, HOLE_ZERO),
            (STRIPE as u32, 0),
            (STRIPE as u32 + 512, HOLE_ZERO)
        ]
    );
    // Out of range, misaligned, a bad flag: EINVAL, in sync; zero length: success.
    for (off, len, flags) in [
        (size, 512, 0),
        (size - 512, 1024, 0),
        (u64::MAX - 511, 512, 0),
        (100, 512, 0),
        (0, 512, proto::CMD_FLAG_DF),
    ] {
        let a = c.call(proto::CMD_BLOCK_STATUS, flags, off, len, &[]);
        assert_eq!(a.error, proto::EINVAL, "{off} {len} {flags}");
        assert!(a.status.is_none());
    }
    assert_eq!(c.call(proto::CMD_BLOCK_STATUS, 0, 0, 0, &[]).error, 0);
    c.check_alive(STRIPE * 7 + 8192);

    // Writes: every other stripe of the first 300 gets 4 KiB → 300 runs over them; a
    // reply carries at most 256 descriptors, the map is whole when asked again.
    let d = Rng::new(3).bytes(4096);
    for s in (0..300).step_by(2) {
        c.write(s * STRIPE + 8192, &d);
    }
    let a = c.status(0, size as u32, false);
    assert_eq!(a.len(), proto::MAX_BLOCK_DESCRIPTORS);
    let m = c.map(size);
    let mut want = vec![true; STRIPES as usize];
    for s in (0..300).step_by(2) {
        want[s] = false;
    }
    want[7] = false;
    assert_eq!(zero_stripes(&m), want);
    // Pipelined block status requests with writes between them: all answered, in sync.
    for k in 0..16u64 {
        let handle = 1000 + k;
        let r = Request {
            flags: 0,
            command: proto::CMD_BLOCK_STATUS,
            handle,
            offset: 0,
            length: (STRIPE * 64) as u32,
        };
        c.s.write_all(&proto::encode_request(&r)).unwrap();
    }
    let mut seen = HashMap::new();
    for _ in 0..16 {
        let mut hb = [0u8; 20];
        c.s.read_exact(&mut hb).unwrap();
        let (h, _) = proto::parse_reply_header(&hb).unwrap();
        let proto::ReplyHeader::Structured {
            kind,
            handle,
            length,
            ..
        } = h
        else {
            panic!("{h:?}")
        };
        assert_eq!(kind, proto::REPLY_TYPE_BLOCK_STATUS);
        let mut p = vec![0u8; length as usize];
        c.s.read_exact(&mut p).unwrap();
        seen.insert(handle, p);
    }
    assert_eq!(seen.len(), 16);
    assert!(seen.values().all(|p| p == &seen[&1000]));
    c.check_alive(STRIPE * 400);

    // A whole-stripe write-zeroes makes stripe 2 zero again; a partial one (stripe 4)
    // and a completed write (stripe 400) stay data.
    let wz = |c: &mut Raw, off: u64, len: u64| {
        assert_eq!(
            c.call(proto::CMD_WRITE_ZEROES, 0, off, len as u32, &[])
                .error,
            0
        );
    };
    wz(&mut c, 2 * STRIPE, STRIPE);
    wz(&mut c, 4 * STRIPE, STRIPE / 2);
    let z = zero_stripes(&c.map(size));
    assert!(z[2] && !z[4] && !z[400] && !z[0]);
    // Every range reported zero reads as zeroes; data stripes read what was written.
    for (off, len, zero) in c.map(size) {
        let mut at = off;
        while at < off + len {
            let n = (off + len - at).min(1 << 20) as u32;
            let b = c.read(at, n);
            if zero {
                assert!(
                    b.iter().all(|&x| x == 0),
                    "zero run {off}+{len} reads data at {at}"
                );
            }
            at += u64::from(n);
        }
    }
    assert!(c.read(6 * STRIPE + 8192, 4096) == d);
}

/// qemu-img map of the export: (start, length, zero) runs.
fn qemu_map(uri: &str, dir: &Path) -> Vec<(u64, u64, bool)> {
    let qimg = tool("qemu-img").unwrap();
    let out = run_ok(
        Command::new(qimg).args(["map", "--output=json", "-f", "raw", uri]),
        dir,
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut runs: Vec<(u64, u64, bool)> = Vec::new();
    for e in v.as_array().unwrap() {
        let (start, len) = (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap());
        let zero = e["zero"].as_bool().unwrap() && !e["data"].as_bool().unwrap();
        match runs.last_mut() {
            Some(l) if l.2 == zero && l.0 + l.1 == start => l.1 += len,
            _ => runs.push((start, len, zero)),
        }
    }
    runs
}

#[test]
fn real_clients_see_holes_data_and_rezeroed_stripes() {
    let (Some(_), Some(_), Some(qemu_io), Some(_)) = (
        tool("nbdinfo"),
        tool("qemu-img"),
        tool("qemu-io"),
        tool("nbdsh"), // python3-libnbd comes with it
    ) else {
        return;
    };
    let t = Target::start(true);
    let dir = t.dir.path();
    let uri = t.uri();
    // Fresh: all hole and zero.
    assert_eq!(qemu_map(&uri, dir), [(0, t.size, true)]);
    let out = run_ok(Command::new("nbdinfo").args(["--map", &uri]), dir);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "{out}");
    assert!(lines[0].contains("hole,zero"), "{out}");
    // Writes into stripes 1, 10 and 11 (one spans both), then a whole-stripe
    // write-zeroes of stripe 10.
    let io = |cmd: &str| {
        run_ok(
            Command::new(&qemu_io).args(["-f", "raw", "-c", cmd, &uri]),
            dir,
        )
    };
    io(&format!("write -P 0x5a {} 4096", STRIPE + 4096));
    io(&format!("write -P 0x33 {} {}", 11 * STRIPE - 65536, 131072));
    let m = qemu_map(&uri, dir);
    assert_eq!(
        m,
        [
            (0, STRIPE, true),
            (STRIPE, STRIPE, false),
            (2 * STRIPE, 8 * STRIPE, true),
            (10 * STRIPE, 2 * STRIPE, false),
            (12 * STRIPE, t.size - 12 * STRIPE, true)
        ]
    );
    // The whole-stripe zeroing through libnbd (`NBD_CMD_WRITE_ZEROES` of one stripe, no
    // flags); qemu-io's `write -z` (with FUA: qemu is writethrough by default) below.
    run_ok(
        // python3-libnbd lives in the system's python3.
        Command::new("/usr/bin/python3").args([
            "-c",
            &format!(
                "import nbd; h = nbd.NBD(); h.connect_uri({uri:?}); h.zero({}, {}); h.shutdown()",
                STRIPE,
                10 * STRIPE
            ),
        ]),
        dir,
    );
    let m = qemu_map(&uri, dir);
    assert_eq!(
        m,
        [
            (0, STRIPE, true),
            (STRIPE, STRIPE, false),
            (2 * STRIPE, 9 * STRIPE, true),
            (11 * STRIPE, STRIPE, false),
            (12 * STRIPE, t.size - 12 * STRIPE, true)
        ]
    );
    let out = run_ok(Command::new("nbdinfo").args(["--map", &uri]), dir);
    assert_eq!(
        out.lines().filter(|l| l.contains("data")).count(),
        2,
        "{out}"
    );
    // The data agrees: what was written reads back, the zeroed stripe reads zeroes.
    io(&format!("read -P 0x5a {} 4096", STRIPE + 4096));
    io(&format!("read -P 0x33 {} 65536", 11 * STRIPE));
    io(&format!("read -P 0 {} {}", 10 * STRIPE, STRIPE));
    // qemu-io's whole-stripe `write -z` carries FUA: the engine zeroes natively and then
    // flushes the members, and the stripe is a hole again.
    io(&format!("write -z {} {}", 11 * STRIPE, STRIPE));
    let m = qemu_map(&uri, dir);
    assert_eq!(
        m,
        [
            (0, STRIPE, true),
            (STRIPE, STRIPE, false),
            (2 * STRIPE, t.size - 2 * STRIPE, true)
        ]
    );
    io(&format!("read -P 0 {} {}", 11 * STRIPE, STRIPE));
}
