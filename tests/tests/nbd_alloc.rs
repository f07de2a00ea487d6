//! The NBD data path allocates nothing: a counting global allocator, armed only while a
//! reactor runs the NBD front-end (`poll` — which includes receiving requests, submitting
//! them through `Io::submit` into the engine, and sending replies — and `complete`),
//! must count zero allocations over thousands of pipelined reads and writes once the
//! connection is established. Half the writes continue a sequential stream of 4 KiB
//! writes, so write passes batch, hold and re-plan from the stripe cache (issue 17) while
//! the allocator counts; the test checks they did. Some requests are longer than the
//! largest buffer, so the front end's split path (pieces through one buffer) is counted
//! too. With structured replies, every 13th request is a block status (the zero map's
//! walk and the reply from the connection's descriptor buffer are counted too).
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
use ferroraid::nbd::proto::{self, Request};
use ferroraid::nbd::{ExportConfig, NbdServer};
use ferroraid_tests::alloc_count::{allocations, Armed, Counting};
use ferroraid_tests::Rng;

#[global_allocator]
static GLOBAL: Counting = Counting;

fn option(s: &mut TcpStream, opt: u32, data: &[u8]) {
    s.write_all(&proto::encode_option_header(opt, data.len() as u32))
        .unwrap();
    s.write_all(data).unwrap();
    loop {
        let mut h = [0u8; proto::OPTION_REPLY_HEADER_BYTES];
        s.read_exact(&mut h).unwrap();
        let h = proto::parse_option_reply_header(&h).unwrap();
        let mut d = vec![0u8; h.length as usize];
        s.read_exact(&mut d).unwrap();
        if h.reply == proto::REP_ACK {
            return;
        }
        assert!(
            matches!(h.reply, proto::REP_INFO | proto::REP_META_CONTEXT),
            "option {opt} failed"
        );
    }
}

/// Bytes of the long requests: longer than the pool's largest buffer.
const BIG: u32 = (5 << 20) / 2;

/// Pipelined random reads and writes at depth `depth`; checks every reply.
fn traffic(s: &mut TcpStream, structured: bool, ops: u64, depth: u64, seed: u64) {
    let mut rng = Rng::new(seed);
    let payload = rng.bytes(BIG as usize);
    let mut pending: HashMap<u64, (u16, u32)> = HashMap::new();
    let mut data = vec![0u8; BIG as usize + 8];
    let mut sent = 0;
    let mut done = 0;
    // The sequential stream's next offset (from seed-dependent start, in the 24 MiB).
    let mut cursor = 4096 * rng.below((16 << 20) / 4096);
    // Until every reply is in: a flush sent with the last requests may be answered after
    // them (replies leave in completion order).
    while done < ops || !pending.is_empty() {
        while sent < ops && (sent - done) < depth {
            // Every 40th request is 2.5 MiB: longer than the largest buffer (1 MiB), so
            // the front end splits it into pieces.
            let mut len = if sent % 40 == 39 {
                BIG
            } else {
                4096 * (1 + rng.below(64)) as u32
            };
            let mut offset = 4096 * rng.below((24 << 20) / 4096);
            let command = if structured && sent % 13 == 5 {
                // Block status (answered from the zero map into the connection's
                // descriptor buffer).
                proto::CMD_BLOCK_STATUS
            } else if rng.below(2) == 0 {
                proto::CMD_READ
            } else {
                proto::CMD_WRITE
            };
            if command == proto::CMD_WRITE && rng.below(2) == 0 {
                len = 4096;
                offset = cursor;
                cursor = (cursor + 4096) % (24 << 20);
            }
            let r = Request {
                flags: if sent % 7 == 0 {
                    proto::CMD_FLAG_FUA
                } else {
                    0
                },
                command,
                handle: sent,
                offset,
                length: len,
            };
            s.write_all(&proto::encode_request(&r)).unwrap();
            if command == proto::CMD_WRITE {
                s.write_all(&payload[..len as usize]).unwrap();
            }
            pending.insert(sent, (command, len));
            sent += 1;
            if sent % 50 == 0 {
                s.write_all(&proto::encode_request(&Request {
                    flags: 0,
                    command: proto::CMD_FLUSH,
                    handle: u64::MAX - sent,
                    offset: 0,
                    length: 0,
                }))
                .unwrap();
                pending.insert(u64::MAX - sent, (proto::CMD_FLUSH, 0));
            }
        }
        let mut h = [0u8; 20];
        s.read_exact(&mut h[..4]).unwrap();
        let magic = u32::from_be_bytes(h[..4].try_into().unwrap());
        let n = if magic == proto::SIMPLE_REPLY_MAGIC {
            16
        } else {
            20
        };
        s.read_exact(&mut h[4..n]).unwrap();
        let (hdr, _) = proto::parse_reply_header(&h[..n]).unwrap();
        let handle = match hdr {
            proto::ReplyHeader::Simple { error, handle } => {
                assert_eq!(error, 0);
                let (cmd, len) = pending[&handle];
                if cmd == proto::CMD_READ {
                    s.read_exact(&mut data[..len as usize]).unwrap();
                }
                handle
            }
            proto::ReplyHeader::Structured {
                flags,
                kind,
                handle,
                length,
            } => {
                assert!(structured);
                assert!(
                    matches!(
                        kind,
                        proto::REPLY_TYPE_OFFSET_DATA | proto::REPLY_TYPE_BLOCK_STATUS
                    ),
                    "chunk type {kind}"
                );
                s.read_exact(&mut data[..length as usize]).unwrap();
                if flags & proto::REPLY_FLAG_DONE == 0 {
                    // A piece of a split read: more chunks follow.
                    continue;
                }
                handle
            }
        };
        let (cmd, _) = pending.remove(&handle).expect("known handle");
        if cmd != proto::CMD_FLUSH {
            done += 1;
        }
    }
    assert!(pending.is_empty());
}

#[test]
fn the_nbd_data_path_allocates_nothing() {
    for reactors in [1usize, 2] {
        let g = Geometry::new(Level::Raid6, RaidLayout::LeftSymmetric, 6, 64 << 10, 512).unwrap();
        let geo = ArrayGeometry::new(g, 128).unwrap();
        let devices: Arc<Vec<MemDevice>> = Arc::new(
            (0..6)
                .map(|i| MemDevice::new(&format!("mem{i}"), 8 << 20, 512, 64).unwrap())
                .collect(),
        );
        let (server, frontends) = NbdServer::builder(ExportConfig::for_array("a", &geo, 1 << 20))
            .listen_tcp("127.0.0.1:0".parse().unwrap())
            .start(reactors)
            .unwrap();
        let port = server.tcp_addrs()[0].port();
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
        for structured in [false, true] {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut g = [0u8; proto::GREETING_BYTES];
            s.read_exact(&mut g).unwrap();
            s.write_all(&3u32.to_be_bytes()).unwrap();
            if structured {
                option(&mut s, proto::OPT_STRUCTURED_REPLY, &[]);
                option(
                    &mut s,
                    proto::OPT_SET_META_CONTEXT,
                    &proto::encode_meta_context_request(b"a", &[proto::BASE_ALLOCATION.as_bytes()]),
                );
            }
            option(
                &mut s,
                proto::OPT_GO,
                &proto::encode_info_request(b"a", &[proto::INFO_BLOCK_SIZE]),
            );
            // Warm-up (the connection is adopted by its reactor during this).
            traffic(&mut s, structured, 200, 16, 1);
            let before = allocations();
            traffic(&mut s, structured, 3000, 24, 2);
            let allocated = allocations() - before;
            assert_eq!(
                allocated, 0,
                "{reactors} reactors, structured {structured}: the NBD data path allocated {allocated} times"
            );
        }
        // The measured traffic went through write passes that batched and found their
        // stripe cached (published at most PUBLISH_INTERVAL late).
        std::thread::sleep(engine::reactor::PUBLISH_INTERVAL * 2);
        let st = running.handle().snapshot().stats;
        assert!(
            st.batched_writes > st.write_passes && st.cache_hit_stripes > 0,
            "{reactors} reactors: no batched or cached write pass: {st:?}"
        );
        server.shutdown();
        running.stop().unwrap();
    }
}
