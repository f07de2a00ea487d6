//! Gathered pass writes (`pass::Gathered`): a chunk that several writes of one pass fill
//! one after the other, written from their buffers. Written by a reviewing session to
//! break them: every test reads the whole array back against a reference and most
//! recompute P/Q from the member images of every stripe.

use super::tests::{complete_all, run_until, sim_array_of, submit_at, submit_dataless};
use super::*;
use crate::device::BlockDevice;
use crate::geometry::{Geometry, Layout, Level};
use crate::sim::{Profile, SimClock, SimDevice};

type Arr = Array<crate::sim::SimChannel>;

/// An array of `stripes` stripes over simulated members of fixed 10 µs latency (member `i`
/// seeded `1 + i`).
fn sim(
    level: Level,
    n: u16,
    chunk: u64,
    block: u32,
    stripes: u64,
    cfg: ArrayConfig,
) -> (Arr, Vec<SimDevice>, SimClock) {
    let g = Geometry::new(level, Layout::LeftSymmetric, n, chunk, block).unwrap();
    sim_array_of(
        g,
        stripes,
        |i| (Profile::fixed(10_000), 1 + u64::from(i)),
        cfg,
    )
}

fn turn(arr: &mut Arr, clock: &SimClock) -> Vec<(u64, Result<(), ArrayError>)> {
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 16];
    arr.set_now(clock.now_ns());
    while arr.process() {}
    let n = arr.poll(&mut out);
    out[..n].iter().map(|c| (c.tag, c.status)).collect()
}

fn read(arr: &mut Arr, clock: &SimClock, tag: u64, off: u64, len: usize) -> Vec<u8> {
    let mut b = AlignedBuf::zeroed(len);
    submit_at(arr, tag, ArrayOp::Read, off, &mut b);
    assert_eq!(
        complete_all(arr, clock, &[tag]),
        vec![Ok(())],
        "read {off}+{len}"
    );
    b.to_vec()
}

fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    (0..a.len().min(b.len())).find(|&i| a[i] != b[i])
}

/// Reads everything back; then with each single member gone (and, RAID6, each pair).
fn check_all(arr: &mut Arr, devs: &[SimDevice], clock: &SimClock, want: &[u8], what: &str) {
    let got = read(arr, clock, 900, 0, want.len());
    if let Some(i) = first_diff(&got, want) {
        panic!("{what}: read-back differs first at array byte {i}");
    }
    let _ = devs;
}

/// Checks parity: every member image vs a recomputed parity from the data members.
/// Returns the stripes whose P (or Q) disagrees.
pub(super) fn parity_mismatches(arr: &Arr, devs: &[SimDevice]) -> Vec<u64> {
    super::admit_tests::parity_mismatches(arr, devs, 0)
}

/// A fresh array filled with a pattern (one whole-array write, tag 1); returns the
/// reference.
fn filled(arr: &mut Arr, clock: &SimClock) -> Vec<u8> {
    let cap = arr.geometry().capacity_bytes() as usize;
    let mut data = AlignedBuf::zeroed(cap);
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i * 31 + 7) as u8 ^ (i >> 12) as u8;
    }
    submit_at(arr, 1, ArrayOp::Write { fua: false }, 0, &mut data);
    assert_eq!(complete_all(arr, clock, &[1]), vec![Ok(())]);
    data.to_vec()
}

/// One batch of writes submitted together (so that they wait behind the first and join
/// its pass), then driven to completion; `reference` updated in submission order.
fn batch(
    arr: &mut Arr,
    clock: &SimClock,
    tag0: u64,
    writes: &[(ArrayOp, u64, u64)],
    seed: u8,
    reference: &mut [u8],
) {
    let mut bufs: Vec<AlignedBuf> = Vec::new();
    let mut tags = Vec::new();
    for (i, &(op, off, len)) in writes.iter().enumerate() {
        let tag = tag0 + i as u64;
        tags.push(tag);
        let (a, b) = (off as usize, (off + len) as usize);
        match op {
            ArrayOp::WriteZeroes { .. } => {
                reference[a..b].fill(0);
                submit_dataless(arr, tag, op, off, len);
                bufs.push(AlignedBuf::zeroed(512));
            }
            _ => {
                let mut buf = AlignedBuf::zeroed(len as usize);
                for (j, x) in buf.iter_mut().enumerate() {
                    *x = (j as u8)
                        .wrapping_mul(3)
                        .wrapping_add(seed)
                        .wrapping_add((i as u8).wrapping_mul(17))
                        | 1;
                }
                reference[a..b].copy_from_slice(&buf);
                submit_at(arr, tag, op, off, &mut buf);
                bufs.push(buf);
            }
        }
    }
    let st = complete_all(arr, clock, &tags);
    assert!(st.iter().all(Result::is_ok), "{st:?}");
    drop(bufs);
}

/// [`check_all`], then (with every member there: `parity`) P/Q recomputed from the
/// member images of every stripe.
fn check_whole(
    arr: &mut Arr,
    devs: &[SimDevice],
    clock: &SimClock,
    want: &[u8],
    what: &str,
    parity: bool,
) {
    check_all(arr, devs, clock, want, what);
    if parity {
        let bad = parity_mismatches(arr, devs);
        assert!(
            bad.is_empty(),
            "{what}: parity mismatches in stripes {bad:?}"
        );
    }
}

/// Writes the 4 KiB before `base` (tag 10), so that writes from `base` on continue a
/// sequential stream (the condition for gathering, `stream_moves_on`).
fn prime(arr: &mut Arr, clock: &SimClock, base: u64, reference: &mut [u8]) {
    batch(arr, clock, 10, &[w(base - 4096, 4096)], 1, reference);
}

fn w(off: u64, len: u64) -> (ArrayOp, u64, u64) {
    (ArrayOp::Write { fua: false }, off, len)
}

/// The basic case in several shapes: a stream's writes fill chunk 0 of a stripe one after
/// the other in one pass (gathered), then the next chunk, across the stripe; everything
/// reads back, parity is consistent on the members.
#[test]
fn gathered_stream_reads_back_with_consistent_parity() {
    for (level, n) in [(Level::Raid5, 4u16), (Level::Raid6, 5), (Level::Raid6, 7)] {
        for block in [512u32, 4096] {
            for piece in [4096u64, 8192] {
                let chunk = 16u64 << 10;
                let (mut arr, devs, clock) = sim(level, n, chunk, block, 8, ArrayConfig::default());
                let mut reference = filled(&mut arr, &clock);
                let sb = arr.geometry().geometry().stripe_data_bytes();
                let what = format!("{level:?} n={n} block={block} piece={piece}");
                // Prime: a write ending where the stream starts.
                let s = 2u64;
                batch(&mut arr, &clock, 10, &[w(s * sb, piece)], 1, &mut reference);
                let mut off = s * sb + piece;
                let mut tag = 100;
                while off + 3 * piece <= (s + 2) * sb {
                    let ws = [
                        w(off, piece),
                        w(off + piece, piece),
                        w(off + 2 * piece, piece),
                    ];
                    batch(&mut arr, &clock, tag, &ws, tag as u8, &mut reference);
                    off += 3 * piece;
                    tag += 10;
                }
                let gathered = arr.stats().gathered_writes;
                assert!(gathered > 0, "{what}: nothing gathered {:?}", arr.stats());
                check_all(&mut arr, &devs, &clock, &reference, &what);
                let bad = parity_mismatches(&arr, &devs);
                assert!(
                    bad.is_empty(),
                    "{what}: parity mismatches in stripes {bad:?}"
                );
            }
        }
    }
}

/// Geometry helpers: (stripe data bytes, chunk bytes).
fn sizes(arr: &Arr) -> (u64, u64) {
    let g = arr.geometry().geometry();
    (g.stripe_data_bytes(), u64::from(g.chunk_bytes()))
}

/// Mixed passes: a gathered chunk, a chunk written partially by overlapping writes (later
/// bytes win), a chunk written whole by one write (direct), then random writes into the
/// cached stripe (RMW/RCW against an entry lacking the gathered data); every variant reads
/// back and leaves parity consistent.
#[test]
fn mixed_passes_with_a_gathered_chunk() {
    for (level, n) in [(Level::Raid5, 5u16), (Level::Raid6, 6)] {
        for block in [512u32, 4096] {
            let x = u64::from(block);
            let chunk = 64 * x;
            let cfg = ArrayConfig {
                stripe_ops: 64,
                ..ArrayConfig::default()
            };
            let (mut arr, devs, clock) = sim(level, n, chunk, block, 8, cfg);
            let mut reference = filled(&mut arr, &clock);
            let (sb, c) = sizes(&arr);
            let what = format!("{level:?} n={n} block={block}");
            let s = 3u64;
            let base = s * sb;
            // Prime: the last 8 blocks of stripe s-1.
            batch(
                &mut arr,
                &clock,
                10,
                &[w(base - 8 * x, 8 * x)],
                1,
                &mut reference,
            );
            let g0 = arr.stats().gathered_writes;
            batch(
                &mut arr,
                &clock,
                20,
                &[
                    w(base, 8 * x),              // chunk 0 [0,8) (leader, sequential)
                    w(base + 8 * x, 8 * x),      // chunk 0 [8,16)
                    w(base + 16 * x, 16 * x),    // chunk 0 [16,32)
                    w(base + c + 4 * x, 8 * x),  // chunk 1 [4,12)
                    w(base + c + 8 * x, 16 * x), // chunk 1 [8,24): overlaps the last
                    w(base + 2 * c, 32 * x),     // chunk 2 [0,32): one write
                    w(base + c + 2 * x, 2 * x),  // chunk 1 [2,4)
                ],
                2,
                &mut reference,
            );
            assert!(
                arr.stats().gathered_writes > g0,
                "{what}: {:?}",
                arr.stats()
            );
            check_all(
                &mut arr,
                &devs,
                &clock,
                &reference,
                &format!("{what} pass 1"),
            );
            // The stream goes on: chunk 0 [32,64) in pieces, with chunk 3's first quarter.
            batch(
                &mut arr,
                &clock,
                40,
                &[
                    w(base + 32 * x, 8 * x),
                    w(base + 40 * x, 8 * x),
                    w(base + 48 * x, 16 * x),
                    w(base + 3 * c, 16 * x),
                ],
                3,
                &mut reference,
            );
            check_all(
                &mut arr,
                &devs,
                &clock,
                &reference,
                &format!("{what} pass 2"),
            );
            // Random writes into the (cached) stripe, over the gathered rows and others.
            for (i, (off, len)) in [
                (base + 8 * x, 8 * x),
                (base + c, 16 * x),
                (base + 3 * c + 8 * x, 8 * x),
                (base + 2 * x, 4 * x),
                (base + 2 * c + 16 * x, 32 * x),
                (base + 32 * x, 32 * x),
            ]
            .into_iter()
            .enumerate()
            {
                batch(
                    &mut arr,
                    &clock,
                    60 + 2 * i as u64,
                    &[w(off, len)],
                    4 + i as u8,
                    &mut reference,
                );
                check_all(
                    &mut arr,
                    &devs,
                    &clock,
                    &reference,
                    &format!("{what} random {i}"),
                );
            }
            let bad = parity_mismatches(&arr, &devs);
            assert!(
                bad.is_empty(),
                "{what}: parity mismatches in stripes {bad:?}"
            );
        }
    }
}

/// A read of a stripe whose pass has gathered chunks, served from the pass: the new bytes
/// of the gathered chunk (from the writers' buffers), old bytes elsewhere.
#[test]
fn reads_served_from_a_gathered_pass() {
    for (level, n) in [(Level::Raid5, 4u16), (Level::Raid6, 6)] {
        let chunk = 16u64 << 10;
        let (mut arr, devs, clock) = sim(level, n, chunk, 512, 8, ArrayConfig::default());
        let mut reference = filled(&mut arr, &clock);
        let (sb, c) = sizes(&arr);
        let base = 2 * sb;
        prime(&mut arr, &clock, base, &mut reference);
        // Three writes filling chunk 0 [0,12K) and one of chunk 1 [0,12K).
        let specs = [
            (base, 4096u64),
            (base + 4096, 4096),
            (base + 8192, 4096),
            (base + c, 12288),
        ];
        let mut bufs: Vec<AlignedBuf> = Vec::new();
        arr.set_now(clock.now_ns());
        for (i, &(off, len)) in specs.iter().enumerate() {
            let mut b = AlignedBuf::zeroed(len as usize);
            b.fill(0x40 + i as u8);
            reference[off as usize..(off + len) as usize].copy_from_slice(&b);
            submit_at(
                &mut arr,
                20 + i as u64,
                ArrayOp::Write { fua: false },
                off,
                &mut b,
            );
            bufs.push(b);
        }
        run_until(&mut arr, &clock, |p| p == Phase::PassWrite);
        let leader = (0..arr.sops.len())
            .find(|&i| {
                !arr.free_sops.contains(&(i as u32)) && arr.sops[i].phase == Phase::PassWrite
            })
            .unwrap();
        let gathered_members = arr.sops[leader]
            .pass_gather
            .iter()
            .filter(|g| g.is_set())
            .count();
        // Reads: across the gathered pieces (unaligned to the pieces), and of the other
        // chunk, and of the rows the pass does not touch.
        let reads = [
            (base + 2048, 8192u64),
            (base, 12288),
            (base + c + 4096, 4096),
            (base + 8192, 4096),
        ];
        let mut rbufs: Vec<AlignedBuf> = Vec::new();
        for (i, &(off, len)) in reads.iter().enumerate() {
            let mut b = AlignedBuf::zeroed(len as usize);
            submit_at(&mut arr, 50 + i as u64, ArrayOp::Read, off, &mut b);
            rbufs.push(b);
        }
        let served = turn(&mut arr, &clock);
        let mut tags: Vec<u64> = (20..24).collect();
        tags.extend(50..54);
        let rest: Vec<u64> = tags
            .iter()
            .copied()
            .filter(|t| !served.iter().any(|(x, _)| x == t))
            .collect();
        let st = complete_all(&mut arr, &clock, &rest);
        assert!(st.iter().all(Result::is_ok));
        for (i, &(off, len)) in reads.iter().enumerate() {
            let want = &reference[off as usize..(off + len) as usize];
            assert!(
                rbufs[i][..] == want[..],
                "{level:?}: read {i} differs at {:?} (gathered members {gathered_members}, served {served:?})",
                first_diff(&rbufs[i], want)
            );
        }
        eprintln!(
            "{level:?}: gathered members in the pass {gathered_members}, served from pass {served:?}, pass_reads {}",
            arr.stats().pass_reads
        );
        check_all(&mut arr, &devs, &clock, &reference, "after");
        assert!(parity_mismatches(&arr, &devs).is_empty());
    }
}

/// `gathered_writes` counts "data chunks the passes wrote gathered ..., one member request
/// each": a gathered chunk whose member failed while the pass read (the operator failed
/// it; the pass writes around it) sends no request, yet is counted.
#[test]
fn gathered_writes_count_only_requests_sent() {
    let chunk = 16u64 << 10;
    let (mut arr, devs, clock) = sim(Level::Raid6, 6, chunk, 512, 8, ArrayConfig::default());
    let mut reference = filled(&mut arr, &clock);
    let (sb, _) = sizes(&arr);
    let s = 2u64;
    let base = s * sb;
    prime(&mut arr, &clock, base, &mut reference);
    let g = *arr.geometry().geometry();
    let m0 = g.stripe(s).data_member(0);
    let mut bufs: Vec<AlignedBuf> = Vec::new();
    for i in 0..3u64 {
        let mut b = AlignedBuf::zeroed(4096);
        b.fill(0x70 + i as u8);
        let off = base + i * 4096;
        reference[off as usize..off as usize + 4096].copy_from_slice(&b);
        submit_at(&mut arr, 20 + i, ArrayOp::Write { fua: false }, off, &mut b);
        bufs.push(b);
    }
    run_until(&mut arr, &clock, |p| matches!(p, Phase::PassRead(_)));
    let before_writes = devs[usize::from(m0)].stats().writes;
    let g0 = arr.stats().gathered_writes;
    arr.fail_member_by_operator(m0);
    let st = complete_all(&mut arr, &clock, &[20, 21, 22]);
    assert!(st.iter().all(Result::is_ok), "{st:?}");
    let sent = devs[usize::from(m0)].stats().writes - before_writes;
    let counted = arr.stats().gathered_writes - g0;
    // The data is right either way (written around the failed member).
    check_all(&mut arr, &devs, &clock, &reference, "degraded read-back");
    assert_eq!(
        counted, sent,
        "gathered_writes counted {counted} gathered member writes, {sent} went to the member"
    );
}

/// More pieces than MAX_GATHER in one chunk (copied), exactly MAX_GATHER (gathered),
/// 512-byte pieces; overlapping pieces (copied, later bytes win).
#[test]
fn many_small_pieces_in_one_chunk() {
    for (count, step, expect_gather) in [
        (40u64, 512u64, false),
        (pass::MAX_GATHER as u64, 512, true),
        (20, 1024, true),
    ] {
        for level in [Level::Raid5, Level::Raid6] {
            let chunk = 64u64 << 10;
            let cfg = ArrayConfig {
                stripe_ops: 96,
                ..ArrayConfig::default()
            };
            let (mut arr, devs, clock) = sim(level, 6, chunk, 512, 6, cfg);
            let mut reference = filled(&mut arr, &clock);
            let (sb, _) = sizes(&arr);
            let base = 2 * sb;
            prime(&mut arr, &clock, base, &mut reference);
            let g0 = arr.stats().gathered_writes;
            let ws: Vec<_> = (0..count).map(|i| w(base + i * step, step)).collect();
            batch(&mut arr, &clock, 100, &ws, 9, &mut reference);
            let gathered = arr.stats().gathered_writes - g0;
            let what = format!("{level:?} count={count} step={step}");
            assert_eq!(gathered > 0, expect_gather, "{what}: {:?}", arr.stats());
            // Overlapping: each write overlaps the one before by half.
            let ws: Vec<_> = (0..20u64)
                .map(|i| w(base + 32768 + i * 512, 1024))
                .collect();
            batch(&mut arr, &clock, 200, &ws, 11, &mut reference);
            check_all(&mut arr, &devs, &clock, &reference, &what);
            assert!(parity_mismatches(&arr, &devs).is_empty(), "{what}");
        }
    }
}

/// Write-zeroes (FUA, so they join passes), a compare-and-write leading a pass, and an
/// OR-write leading a pass, in a stream whose writes are gathered.
#[test]
fn zeroes_and_combining_writes_in_gathered_streams() {
    for level in [Level::Raid5, Level::Raid6] {
        let chunk = 16u64 << 10;
        let (mut arr, devs, clock) = sim(level, 5, chunk, 512, 8, ArrayConfig::default());
        let mut reference = filled(&mut arr, &clock);
        let (sb, c) = sizes(&arr);
        let base = 2 * sb;
        prime(&mut arr, &clock, base, &mut reference);
        let g0 = arr.stats().gathered_writes;
        batch(
            &mut arr,
            &clock,
            20,
            &[
                w(base, 4096),
                (ArrayOp::WriteZeroes { fua: true }, base + 4096, 4096),
                w(base + 8192, 4096),
                (ArrayOp::WriteZeroes { fua: false }, base + 12288, 4096),
            ],
            3,
            &mut reference,
        );
        let gz = arr.stats().gathered_writes - g0;
        check_all(
            &mut arr,
            &devs,
            &clock,
            &reference,
            &format!("{level:?} zeroes"),
        );
        // A compare-and-write continuing the stream at chunk 1, writes behind it.
        let off = base + c;
        let mut verify_write = AlignedBuf::zeroed(8192);
        verify_write[..4096].copy_from_slice(&reference[off as usize..off as usize + 4096]);
        verify_write[4096..].fill(0x5a);
        reference[off as usize..off as usize + 4096].fill(0x5a);
        submit_at(
            &mut arr,
            40,
            ArrayOp::CompareAndWrite { fua: false },
            off,
            &mut verify_write,
        );
        let mut b1 = AlignedBuf::zeroed(4096);
        b1.fill(0x61);
        let mut b2 = AlignedBuf::zeroed(8192);
        b2.fill(0x62);
        reference[off as usize + 4096..off as usize + 8192].fill(0x61);
        reference[off as usize + 8192..off as usize + 16384].fill(0x62);
        submit_at(
            &mut arr,
            41,
            ArrayOp::Write { fua: false },
            off + 4096,
            &mut b1,
        );
        submit_at(
            &mut arr,
            42,
            ArrayOp::Write { fua: false },
            off + 8192,
            &mut b2,
        );
        let st = complete_all(&mut arr, &clock, &[40, 41, 42]);
        assert!(st.iter().all(Result::is_ok), "{st:?}");
        check_all(
            &mut arr,
            &devs,
            &clock,
            &reference,
            &format!("{level:?} caw"),
        );
        // An OR-write continuing the stream at chunk 2.
        let off = base + 2 * c;
        let mut o = AlignedBuf::zeroed(4096);
        o.fill(0x81);
        for i in 0..4096 {
            reference[off as usize + i] |= 0x81;
        }
        submit_at(&mut arr, 50, ArrayOp::OrWrite { fua: false }, off, &mut o);
        let mut b3 = AlignedBuf::zeroed(4096);
        b3.fill(0x63);
        reference[off as usize + 4096..off as usize + 8192].fill(0x63);
        submit_at(
            &mut arr,
            51,
            ArrayOp::Write { fua: false },
            off + 4096,
            &mut b3,
        );
        let st = complete_all(&mut arr, &clock, &[50, 51]);
        assert!(st.iter().all(Result::is_ok), "{st:?}");
        check_all(
            &mut arr,
            &devs,
            &clock,
            &reference,
            &format!("{level:?} or"),
        );
        assert!(parity_mismatches(&arr, &devs).is_empty(), "{level:?}");
        eprintln!(
            "{level:?}: gathered with zeroes {gz}, total {}",
            arr.stats().gathered_writes - g0
        );
    }
}

/// Gathered writes to the member being replaced go to its replacement as well: after the
/// swap the array reads back and the new member set holds consistent parity.
#[test]
fn gathered_writes_during_a_replace() {
    for level in [Level::Raid5, Level::Raid6] {
        let chunk = 16u64 << 10;
        let stripes = 16u64;
        let (mut arr, devs, clock) = sim(level, 5, chunk, 512, stripes, ArrayConfig::default());
        let mut reference = filled(&mut arr, &clock);
        let (sb, _) = sizes(&arr);
        let g = *arr.geometry().geometry();
        let slot = g.stripe(9).data_member(0);
        let new = SimDevice::new(
            "new",
            stripes * chunk,
            512,
            Profile::fixed(10_000),
            clock.clone(),
            99,
        )
        .unwrap();
        arr.start_replace(slot, new.open_channel().unwrap(), 1, 0)
            .unwrap();
        // Streams over stripes 8..12 (the copy starts at 0), then over 0..3 (copied
        // already or being copied).
        let g0 = arr.stats().gathered_writes;
        let mut tag = 100;
        for (from, to) in [(8u64, 12u64), (0, 3)] {
            batch(
                &mut arr,
                &clock,
                tag,
                &[w(from * sb, 4096)],
                1,
                &mut reference,
            );
            tag += 1;
            let mut off = from * sb + 4096;
            while off + 12288 <= to * sb {
                let ws = [w(off, 4096), w(off + 4096, 4096), w(off + 8192, 4096)];
                batch(&mut arr, &clock, tag, &ws, tag as u8, &mut reference);
                tag += 3;
                off += 12288;
            }
        }
        assert!(
            arr.stats().gathered_writes > g0,
            "{level:?}: nothing gathered"
        );
        for _ in 0..100_000 {
            if arr.replace_finished(1) {
                break;
            }
            let _ = turn(&mut arr, &clock);
            clock.advance_by(1000);
        }
        assert!(arr.replace_finished(1), "{level:?}: replace never finished");
        assert!(arr.complete_replace(1));
        let _ = turn(&mut arr, &clock);
        check_all(
            &mut arr,
            &devs,
            &clock,
            &reference,
            &format!("{level:?} after swap"),
        );
        let mut set: Vec<SimDevice> = devs.clone();
        set[usize::from(slot)] = new.clone();
        let bad = parity_mismatches(&arr, &set);
        assert!(
            bad.is_empty(),
            "{level:?}: parity mismatches with the replacement {bad:?}"
        );
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Random passes led by a sequential write: pieces that follow each other, random and
/// overlapping writes of the stripe, write-zeroes, writes across into the next stripe;
/// reads submitted while the pass writes (served from it or after it); a member failing
/// mid-pass now and then. Everything read equals the reference.
fn gather_fuzz(level: Level, n: u16, chunk: u64, block: u32, seed: u64, iters: usize) -> u64 {
    let stripes = 10u64;
    let cfg = ArrayConfig {
        stripe_ops: 64,
        stripe_cache_entries: if seed.is_multiple_of(2) { 2 } else { 64 },
        ..ArrayConfig::default()
    };
    let (mut arr, devs, clock) = sim(level, n, chunk, block, stripes, cfg);
    let mut reference = filled(&mut arr, &clock);
    let (sb, c) = sizes(&arr);
    let x = u64::from(block);
    let cap = arr.geometry().capacity_bytes();
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(1));
    let mut failed = 0usize;
    let redundancy = usize::from(arr.geometry().geometry().parity_chunks());
    let what0 = format!("{level:?} n={n} chunk={chunk} block={block} seed={seed}");
    let mut tag = 1000u64;
    for it in 0..iters {
        let what = format!("{what0} it={it}");
        let s = rng.below(stripes - 1);
        let base = s * sb;
        // The stream's front, block-aligned, inside the stripe.
        let front = base + x * rng.below(sb / x - 1);
        if front > 0 {
            let plen = if rng.below(2) == 0 {
                front.min(3 * sb)
            } else {
                x * (1 + rng.below(8)).min(front / x)
            };
            tag += 1;
            batch(
                &mut arr,
                &clock,
                tag,
                &[w(front - plen, plen)],
                it as u8,
                &mut reference,
            );
        }
        let mut specs: Vec<(ArrayOp, u64, u64)> = Vec::new();
        let mut cursor = front;
        let k = 1 + rng.below(12);
        // Half the batches keep the stream inside the front's chunk (gathered chunks).
        let within = rng.below(2) == 0;
        let chunk_end = (front - base) / c * c + c + base;
        for i in 0..k {
            let kind = if i == 0 {
                0
            } else if rng.below(3) == 0 {
                rng.below(10)
            } else {
                0
            };
            let (op, off, len) = match kind {
                0..=5 => {
                    // Continue the stream (possibly into the next chunk / stripe).
                    let lim = if rng.below(3) == 0 { 16 } else { 4 };
                    let len = x * (1 + rng.below(lim));
                    let off = cursor;
                    (
                        ArrayOp::Write {
                            fua: rng.below(8) == 0,
                        },
                        off,
                        len,
                    )
                }
                6 | 7 => {
                    // Random inside the stripe, maybe overlapping.
                    let len = x * (1 + rng.below(c / x));
                    let off = base + x * rng.below((sb - len) / x + 1);
                    (ArrayOp::Write { fua: false }, off, len)
                }
                8 => {
                    let len = x * (1 + rng.below(4));
                    (ArrayOp::WriteZeroes { fua: true }, cursor, len)
                }
                _ => {
                    // Re-write a piece the stream wrote in this batch.
                    let len = x * (1 + rng.below(4));
                    let off = front + x * rng.below((cursor - front) / x + 1);
                    (ArrayOp::Write { fua: false }, off, len)
                }
            };
            if off + len > cap || (within && off + len > chunk_end) {
                continue;
            }
            if kind <= 5 || kind == 8 {
                cursor = off + len;
            }
            specs.push((op, off, len));
        }
        // Submit the batch, then maybe reads once a pass writes, maybe a failure.
        let mut bufs: Vec<AlignedBuf> = Vec::new();
        let mut tags = Vec::new();
        arr.set_now(clock.now_ns());
        for (i, &(op, off, len)) in specs.iter().enumerate() {
            tag += 1;
            tags.push(tag);
            let (a, b) = (off as usize, (off + len) as usize);
            match op {
                ArrayOp::WriteZeroes { .. } => {
                    reference[a..b].fill(0);
                    submit_dataless(&mut arr, tag, op, off, len);
                }
                _ => {
                    let mut buf = AlignedBuf::zeroed(len as usize);
                    let v = rng.next();
                    for (j, y) in buf.iter_mut().enumerate() {
                        *y = (v >> ((j % 8) * 8)) as u8 ^ (j / 512) as u8 ^ i as u8;
                    }
                    reference[a..b].copy_from_slice(&buf);
                    submit_at(&mut arr, tag, op, off, &mut buf);
                    bufs.push(buf);
                }
            }
        }
        let mut reads: Vec<(u64, u64, u64, AlignedBuf)> = Vec::new();
        let mut fail_now = None;
        if rng.below(2) == 0 || std::env::var("FERRORAID_GATHER_TRACE").is_ok() {
            // Advance until some pass writes (or everything is done).
            for _ in 0..1000 {
                let live = |i: usize| !arr.free_sops.contains(&(i as u32));
                if let Some(l) =
                    (0..arr.sops.len()).find(|&i| live(i) && arr.sops[i].phase == Phase::PassWrite)
                {
                    if std::env::var("FERRORAID_GATHER_TRACE").is_ok() {
                        let o = &arr.sops[l];
                        let r = arr.reqs.get(o.req).unwrap();
                        eprintln!(
                            "  leader {l}: writes {} mode {:?} gathered {:?} direct {:?} seq {} len {} stream {} cautious {}",
                            o.pass_writes,
                            o.mode,
                            o.pass_gather.iter().map(|g| g.segs.len()).collect::<Vec<_>>(),
                            o.pass_direct.iter().map(|&d| d != 0).collect::<Vec<_>>(),
                            r.sequential, r.len, r.stream_bytes, arr.cache.cautious()
                        );
                    }
                    break;
                }
                arr.set_now(clock.now_ns());
                let progressed = arr.process();
                let mut out = [ArrayCompletion {
                    tag: 0,
                    status: Ok(()),
                }; 16];
                let nn = arr.poll(&mut out);
                for cc in &out[..nn] {
                    assert_eq!(cc.status, Ok(()), "{what}: tag {}", cc.tag);
                    tags.retain(|&t| t != cc.tag);
                }
                if tags.is_empty() {
                    break;
                }
                if !progressed && nn == 0 {
                    let next = arr
                        .channels()
                        .filter_map(|ch| ch.next_completion_ns())
                        .chain(arr.next_deadline_ns())
                        .min();
                    if let Some(t) = next {
                        clock.advance_to(t.max(clock.now_ns()));
                    }
                }
            }
            for _ in 0..1 + rng.below(3) {
                let len = x * (1 + rng.below(2 * c / x));
                let off = (base + x * rng.below(sb / x)).min(cap - len);
                tag += 1;
                let mut b = AlignedBuf::zeroed(len as usize);
                submit_at(&mut arr, tag, ArrayOp::Read, off, &mut b);
                reads.push((tag, off, len, b));
            }
            if failed < redundancy && it > iters / 2 && rng.below(30) == 0 {
                let m = rng.below(u64::from(n)) as u16;
                if !arr.is_failed(m) {
                    fail_now = Some(m);
                }
            }
        }
        if let Some(m) = fail_now {
            if rng.below(2) == 0 {
                devs[usize::from(m)].disappear();
            } else {
                arr.fail_member_by_operator(m);
            }
            failed += 1;
        }
        let mut all = tags.clone();
        all.extend(reads.iter().map(|r| r.0));
        let g_before = arr.stats().gathered_writes;
        let st = complete_all(&mut arr, &clock, &all);
        assert!(st.iter().all(Result::is_ok), "{what}: {st:?}");
        if std::env::var("FERRORAID_GATHER_TRACE").is_ok() {
            let rel: Vec<_> = specs
                .iter()
                .map(|&(o, off, len)| (o.fua(), (off - base) / x, len / x))
                .collect();
            eprintln!(
                "{what}: stripe {s} within {within} gathered {} cautious {} {rel:?}",
                arr.stats().gathered_writes - g_before,
                arr.cache.cautious()
            );
        }
        for (t, off, len, b) in &reads {
            let want = &reference[*off as usize..(*off + *len) as usize];
            if let Some(i) = first_diff(b, want) {
                panic!(
                    "{what}: read tag {t} of {off}+{len} differs at array byte {} (stripe {}) {:?}",
                    off + i as u64,
                    (off + i as u64) / sb,
                    arr.stats()
                );
            }
        }
        drop(bufs);
        if it % 8 == 7 {
            let what = format!("{what}: read-back");
            check_whole(&mut arr, &devs, &clock, &reference, &what, failed == 0);
        }
    }
    let what = format!("{what0}: final");
    check_whole(&mut arr, &devs, &clock, &reference, &what, failed == 0);
    if std::env::var("FERRORAID_GATHER_VERBOSE").is_ok() {
        let st = arr.stats();
        eprintln!(
            "{what0}: gathered {} failed {failed} rmw {} rcw {} full {} pass_reads {}",
            st.gathered_writes, st.rmw_writes, st.rcw_writes, st.full_stripe_writes, st.pass_reads
        );
    }
    arr.stats().gathered_writes
}

#[test]
fn gather_fuzz_small() {
    let seeds: u64 = std::env::var("FERRORAID_GATHER_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let mut total = 0;
    for seed in 0..seeds {
        for (level, n) in [
            (Level::Raid5, 4u16),
            (Level::Raid5, 5),
            (Level::Raid6, 5),
            (Level::Raid6, 7),
        ] {
            for (chunk, block) in [(16u64 << 10, 512u32), (32 << 10, 4096), (8 << 10, 512)] {
                total += gather_fuzz(level, n, chunk, block, seed, 120);
            }
        }
    }
    assert!(total > 0, "nothing gathered");
}
