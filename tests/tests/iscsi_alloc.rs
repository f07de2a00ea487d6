//! The iSCSI data path allocates nothing: a counting global allocator, armed only while a
//! reactor runs the iSCSI front-end (`poll` — receiving PDUs, gathering Data-Out,
//! submitting through `Io::submit` into the engine, staging Data-In, R2T and responses —
//! and `complete`), must count zero allocations over thousands of pipelined reads, writes
//! (immediate data plus several R2T bursts each), cache flushes and NOP pings once the
//! connection is established.
//!
//! A separate test binary because it replaces the global allocator.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use drivers::mem::MemDevice;
use engine::array::ArrayConfig;
use engine::geometry::{ArrayGeometry, Geometry, Layout as RaidLayout, Level};
use engine::parity::Parity;
use engine::reactor::{Mode, ReactorConfig, Reactors};
use ferroraid::iscsi::pdu::{self, op, Bhs, Framing, Header};
use ferroraid::iscsi::{lun_info, text, IscsiConfig, IscsiServer};
use ferroraid_tests::alloc_count::{allocations, Armed, Counting};
use ferroraid_tests::Rng;

#[global_allocator]
static GLOBAL: Counting = Counting;

const PLAIN: Framing = Framing {
    header_digest: false,
    data_digest: false,
    max_recv_data: 1 << 24,
};
/// The target's MaxRecvDataSegmentLength (its default) and the bursts we ask for.
const SEGMENT: usize = 64 << 10;
const BURST: u32 = 64 << 10;

fn send(s: &mut TcpStream, h: &Header, data: &[u8]) {
    let mut buf = vec![0u8; pdu::pdu_bytes(data.len(), &PLAIN)];
    let n = pdu::write_pdu(&mut buf, h, data, &PLAIN);
    s.write_all(&buf[..n]).unwrap();
}

fn read(s: &mut TcpStream, data: &mut Vec<u8>) -> Bhs {
    let mut h = [0u8; 48];
    s.read_exact(&mut h).unwrap();
    let bhs = Bhs::parse(&h).unwrap();
    data.resize(bhs.wire_bytes(false, false) - 48, 0);
    s.read_exact(data).unwrap();
    data.truncate(bhs.data_len() as usize);
    bhs
}

fn login(port: u16, target: &str) -> (TcpStream, u32) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut kv = Vec::new();
    for (k, v) in [
        ("InitiatorName", "iqn.2026-11.org.ferroraid:alloc-test"),
        ("SessionType", "Normal"),
        ("TargetName", target),
        ("AuthMethod", "None"),
        ("MaxRecvDataSegmentLength", "262144"),
        ("MaxBurstLength", &BURST.to_string()),
        ("FirstBurstLength", &BURST.to_string()),
        ("ImmediateData", "Yes"),
        ("InitialR2T", "Yes"),
        ("MaxOutstandingR2T", "4"),
    ] {
        text::put(&mut kv, k, v);
    }
    let h = Header::new(op::LOGIN_REQ | 0x40, 0x80 | 0x03, kv.len() as u32, 1)
        .bytes(8, &[0x80, 0, 0, 0xab, 0xcd, 0xef])
        .u32(24, 1);
    send(&mut s, &h, &kv);
    let mut d = Vec::new();
    let b = read(&mut s, &mut d);
    assert_eq!(b.opcode(), op::LOGIN_RESP);
    assert_eq!(
        u16::from_be_bytes([b.raw[36], b.raw[37]]),
        0,
        "login refused"
    );
    (s, b.u32_at(28))
}

/// Pipelined random READ(10)/WRITE(10) of 4 KiB–256 KiB at `depth`, a SYNCHRONIZE CACHE
/// every 50 commands and a NOP-Out ping every 100; checks every status.
fn traffic(s: &mut TcpStream, cmd_sn: &mut u32, ops: u32, depth: u32, seed: u64) {
    let mut rng = Rng::new(seed);
    let payload = rng.bytes(256 << 10);
    // ITT → (is a write, bytes).
    let mut pending: HashMap<u32, (bool, u32)> = HashMap::new();
    let mut data = Vec::with_capacity(300 << 10);
    let mut sent = 0;
    let mut itt = seed as u32 * 1_000_000;
    while sent < ops || !pending.is_empty() {
        while sent < ops && (pending.len() as u32) < depth {
            itt += 1;
            let blocks = 8 * (1 + rng.below(64)) as u16;
            let lba = (8 * rng.below((20 << 20) / 4096)) as u32;
            let len = u32::from(blocks) * 512;
            let mut cdb = [0u8; 16];
            let (flags, imm) = if sent % 50 == 49 {
                cdb[0] = 0x35; // SYNCHRONIZE CACHE(10), whole LUN
                (0x80, 0)
            } else if rng.below(2) == 0 {
                cdb[0] = 0x2a;
                (0x80 | 0x20, len.min(BURST))
            } else {
                cdb[0] = 0x28;
                (0x80 | 0x40, 0)
            };
            if cdb[0] != 0x35 {
                cdb[2..6].copy_from_slice(&lba.to_be_bytes());
                cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
            }
            let edtl = if cdb[0] == 0x35 { 0 } else { len };
            let h = Header::new(op::SCSI_CMD, flags, imm, itt)
                .u32(20, edtl)
                .u32(24, *cmd_sn)
                .bytes(32, &cdb);
            *cmd_sn = cmd_sn.wrapping_add(1);
            send(s, &h, &payload[..imm as usize]);
            pending.insert(itt, (cdb[0] == 0x2a, edtl));
            sent += 1;
            if sent % 100 == 0 {
                let h = Header::new(op::NOP_OUT | 0x40, 0x80, 4, 0x7fff_0000 + sent)
                    .u32(20, pdu::RESERVED_TAG)
                    .u32(24, *cmd_sn);
                send(s, &h, b"ping");
                pending.insert(0x7fff_0000 + sent, (false, 0));
            }
        }
        let b = read(s, &mut data);
        match b.opcode() {
            op::R2T => {
                let (offset, len) = (b.u32_at(40), b.u32_at(44));
                let chunks = (len as usize).div_ceil(SEGMENT);
                for c in 0..chunks {
                    let o = offset as usize + c * SEGMENT;
                    let n = SEGMENT.min(offset as usize + len as usize - o);
                    let h = Header::new(
                        op::DATA_OUT,
                        if c + 1 == chunks { 0x80 } else { 0 },
                        n as u32,
                        b.itt(),
                    )
                    .u32(20, b.u32_at(20))
                    .u32(36, c as u32)
                    .u32(40, o as u32);
                    send(s, &h, &payload[o..o + n]);
                }
            }
            op::DATA_IN => {
                if b.flags() & 0x01 != 0 {
                    assert_eq!(b.raw[3], 0, "read status");
                    pending.remove(&b.itt()).expect("known ITT");
                }
            }
            op::SCSI_RESP => {
                assert_eq!(b.raw[3], 0, "status of ITT {:#x}", b.itt());
                pending.remove(&b.itt()).expect("known ITT");
            }
            op::NOP_IN => {
                assert_eq!(data, b"ping");
                pending.remove(&b.itt()).expect("known ping");
            }
            o => panic!("unexpected opcode {o:#x}"),
        }
    }
}

#[test]
fn the_iscsi_data_path_allocates_nothing() {
    for reactors in [1usize, 2] {
        let g = Geometry::new(Level::Raid6, RaidLayout::LeftSymmetric, 6, 64 << 10, 512).unwrap();
        let geo = ArrayGeometry::new(g, 128).unwrap();
        let devices: Arc<Vec<MemDevice>> = Arc::new(
            (0..6)
                .map(|i| MemDevice::new(&format!("mem{i}"), 8 << 20, 512, 64).unwrap())
                .collect(),
        );
        let config = IscsiConfig::default();
        let lun = lun_info("a", &geo, [3; 16], &config);
        let target = lun.target_name.clone();
        let (server, frontends) = IscsiServer::builder(lun)
            .config(config)
            .listen("127.0.0.1:0".parse().unwrap())
            .start(reactors)
            .unwrap();
        let port = server.addrs()[0].port();
        let running = Reactors::start(
            Arc::clone(&devices),
            geo,
            Parity::new(),
            ArrayConfig::default(),
            ReactorConfig {
                cores: vec![None; reactors],
                mode: Mode::Adaptive,
                requests: 256,
                foreign_reads: true,
            },
            frontends.into_iter().map(Armed).collect(),
        )
        .unwrap();
        // Two sessions, so with two reactors both front-ends serve one.
        for session in 0..2u64 {
            let (mut s, mut cmd_sn) = login(port, &target);
            // Warm-up (the connection is adopted by its reactor during this).
            traffic(&mut s, &mut cmd_sn, 200, 16, 1 + session);
            let before = allocations();
            traffic(&mut s, &mut cmd_sn, 3000, 24, 10 + session);
            let allocated = allocations() - before;
            assert_eq!(
                allocated, 0,
                "{reactors} reactors, session {session}: the iSCSI data path allocated {allocated} times"
            );
        }
        server.shutdown();
        running.stop().unwrap();
    }
}
