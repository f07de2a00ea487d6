//! The PPL write side on simulated members: every write is served, records are written,
//! and each member's newest record is one md's recovery would read — its partial parity,
//! XORed with the current data of the modified chunks as `plan_recovery` (an independent
//! transcription of `ppl_recover_entry`) names them, gives the parity on the media.

use std::ptr::NonNull;
use std::sync::Arc;

use super::*;
use crate::device::BlockDevice;
use crate::geometry::{Geometry, Layout, Level};
use crate::metadata::ppl::{plan_recovery, scan_area, signature};
use crate::metadata::Uuid;
use crate::ppl::PplShared;
use crate::shard::ShardedArray;
use crate::sim::{Profile, SimChannel, SimClock, SimDevice};

const AREA_OFFSET: u64 = 4096;
const AREA_BYTES: u64 = 64 << 10;
const DATA_OFFSET: u64 = AREA_OFFSET + AREA_BYTES;

struct World {
    arr: ShardedArray<SimChannel>,
    devs: Vec<SimDevice>,
    clock: SimClock,
    uuid: Uuid,
}

fn world(level: Level, members: u16, chunk: u64, stripes: u64, shards: usize, seed: u64) -> World {
    world_with(
        level,
        members,
        chunk,
        stripes,
        shards,
        seed,
        Profile::nvme_ssd(),
    )
}

/// [`world`] on members of profile `profile`.
fn world_with(
    level: Level,
    members: u16,
    chunk: u64,
    stripes: u64,
    shards: usize,
    seed: u64,
    profile: Profile,
) -> World {
    let g = Geometry::new(level, Layout::LeftSymmetric, members, chunk, 512).unwrap();
    let geo = ArrayGeometry::new(g, stripes).unwrap();
    let clock = SimClock::new();
    let devs: Vec<SimDevice> = (0..members)
        .map(|i| {
            SimDevice::new(
                &format!("d{i}"),
                DATA_OFFSET + stripes * chunk,
                512,
                profile.clone(),
                clock.clone(),
                seed ^ u64::from(i),
            )
            .unwrap()
        })
        .collect();
    let uuid = Uuid([7; 16]);
    let shared = Arc::new(PplShared::new(
        usize::from(members),
        AREA_OFFSET,
        AREA_BYTES,
        signature(&uuid),
    ));
    let cfg = ArrayConfig {
        requests: 32,
        stripe_ops: 16,
        data_offset_bytes: DATA_OFFSET,
        ..ArrayConfig::default()
    };
    let parts = (0..shards)
        .map(|_| {
            let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
            let mut a = Array::new(geo, chans, Parity::new(), cfg).unwrap();
            a.attach_ppl(Arc::clone(&shared));
            a
        })
        .collect();
    let mut arr = ShardedArray::new(parts, 32);
    arr.set_now(clock.now_ns());
    World {
        arr,
        devs,
        clock,
        uuid,
    }
}

/// Runs until nothing is in flight, collecting completions into `done`.
fn step(w: &mut World, done: &mut Vec<ArrayCompletion>) {
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 16];
    w.arr.set_now(w.clock.now_ns());
    let progressed = w.arr.process();
    let n = w.arr.poll(&mut out);
    done.extend_from_slice(&out[..n]);
    if !progressed && n == 0 {
        let next = w
            .arr
            .shards()
            .iter()
            .flat_map(|s| s.channels().filter_map(|c| c.next_completion_ns()))
            .chain(w.arr.next_deadline_ns())
            .min()
            .expect("something pending");
        w.clock.advance_to(next.max(w.clock.now_ns()));
    }
}

/// Submits one request with nothing else in flight and steps until it completes (the
/// completion must be its own, and the only one); returns its status.
fn run_one(
    w: &mut World,
    tag: u64,
    op: ArrayOp,
    off: u64,
    buf: &mut [u8],
) -> Result<(), ArrayError> {
    submit(w, tag, op, off, buf);
    let mut done = Vec::new();
    while done.is_empty() {
        step(w, &mut done);
    }
    assert_eq!(done.len(), 1, "other requests were in flight: {done:?}");
    assert_eq!(done[0].tag, tag);
    done[0].status
}

fn submit(w: &mut World, tag: u64, op: ArrayOp, off: u64, buf: &mut [u8]) {
    // SAFETY: the caller keeps `buf` alive and untouched until the request completes.
    let io = unsafe {
        IoBuf::from_raw(
            NonNull::new(buf.as_mut_ptr()).unwrap(),
            buf.len() as u32,
            None,
        )
    };
    w.arr
        .submit(ArrayRequest {
            tag,
            op,
            offset_bytes: off,
            len_bytes: buf.len() as u32,
            buf: io,
        })
        .unwrap();
}

/// A write in flight: tag, array offset and length (bytes), its data.
type Inflight = (u64, u64, u64, AlignedBuf);

/// Applies the completed writes in `done` to `reference` (writes in flight never overlap).
fn retire(
    done: &mut Vec<ArrayCompletion>,
    inflight: &mut Vec<Inflight>,
    reference: &mut [u8],
    seed: u64,
) {
    for c in done.drain(..) {
        assert_eq!(c.status, Ok(()), "seed {seed}: write failed");
        let i = inflight.iter().position(|x| x.0 == c.tag).unwrap();
        let (_, off, len, buf) = inflight.swap_remove(i);
        reference[off as usize..(off + len) as usize].copy_from_slice(&buf[..]);
    }
}

/// Random non-overlapping-in-flight writes (sequential runs and random pieces, inside
/// and across stripes) at queue depth 16, then a read of everything.
/// Submits a write of `len` random bytes (from `next`) at `off`, FUA when `fua`, under tag
/// `*tag` — unless it overlaps a write in flight (the reference could not tell which
/// landed last); returns whether it did.
fn submit_unless_overlapping(
    w: &mut World,
    inflight: &mut Vec<Inflight>,
    tag: &mut u64,
    (off, len, fua): (u64, u64, bool),
    next: &mut impl FnMut() -> u64,
) -> bool {
    if inflight.iter().any(|x| x.1 < off + len && off < x.1 + x.2) {
        return false;
    }
    let mut buf = AlignedBuf::zeroed(len as usize);
    for b in buf.iter_mut() {
        *b = next() as u8;
    }
    submit(w, *tag, ArrayOp::Write { fua }, off, &mut buf);
    inflight.push((*tag, off, len, buf));
    *tag += 1;
    true
}

/// Completes every write in flight, then reads the whole `cap` bytes back and checks
/// them against `reference` (`what` names the case).
fn drain_and_check_read_back(
    w: &mut World,
    done: &mut Vec<ArrayCompletion>,
    inflight: &mut Vec<Inflight>,
    reference: &mut [u8],
    seed: u64,
    what: &str,
) {
    while !inflight.is_empty() {
        step(w, done);
        retire(done, inflight, reference, seed);
    }
    let mut whole = AlignedBuf::zeroed(reference.len());
    submit(w, 0, ArrayOp::Read, 0, &mut whole);
    while done.is_empty() {
        step(w, done);
    }
    assert_eq!(done[0].status, Ok(()), "{what}");
    assert!(whole[..] == reference[..], "{what}: read-back differs");
}

/// Every shard's counters added up.
fn total_stats(w: &World) -> ArrayStats {
    w.arr
        .shards()
        .iter()
        .fold(ArrayStats::default(), |mut a, s| {
            a.add(&s.stats());
            a
        })
}

/// A xorshift64 generator seeded from `seed`: the tests' reproducible random stream.
fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    }
}

fn run(level: Level, members: u16, shards: usize, seed: u64) {
    let chunk = 8192;
    let stripes = 24;
    let mut w = world(level, members, chunk, stripes, shards, seed);
    let cap = w.arr.geometry().capacity_bytes();
    let mut reference = vec![0u8; cap as usize];
    let mut next = xorshift(seed);
    let mut inflight: Vec<Inflight> = Vec::new();
    let mut done = Vec::new();
    let mut tag = 1u64;
    let mut seq = 0u64;
    for _ in 0..600 {
        while inflight.len() >= 16 {
            step(&mut w, &mut done);
            retire(&mut done, &mut inflight, &mut reference, seed);
        }
        let (off, len) = if next().is_multiple_of(2) {
            let len = 512 * (1 + next() % 8);
            if seq + len > cap {
                seq = 0;
            }
            seq += len;
            (seq - len, len)
        } else {
            let len = 512 * (1 + next() % 40);
            ((next() % ((cap - len) / 512)) * 512, len)
        };
        let fua = next().is_multiple_of(8);
        submit_unless_overlapping(&mut w, &mut inflight, &mut tag, (off, len, fua), &mut next);
    }
    let what = format!("seed {seed}");
    drain_and_check_read_back(
        &mut w,
        &mut done,
        &mut inflight,
        &mut reference,
        seed,
        &what,
    );

    let stats = total_stats(&w);
    assert!(stats.ppl_records > 0, "no PPL record written");
    // Idle: the member queues count nothing in the devices, record writes and flushes
    // (their tags' operation indices lie past the stripe operations') included.
    for (i, shard) in w.arr.shards().iter().enumerate() {
        for m in 0..members {
            for class in crate::qos::IoClass::ALL {
                assert_eq!(
                    shard.member_in_device(m, class),
                    0,
                    "seed {seed}: shard {i} member {m} {class:?}"
                );
            }
        }
    }

    let images: Vec<Vec<u8>> = w.devs.iter().map(SimDevice::contents).collect();
    let geo = *w.arr.geometry();
    if level == Level::Raid6 {
        return check_raid6_records(&images, &geo, &w.uuid, seed);
    }
    // Every member's newest record: PP ⊕ modified data = parity on the media.
    let mut checked = 0;
    for (m, img) in images.iter().enumerate() {
        let area = &img[AREA_OFFSET as usize..(AREA_OFFSET + AREA_BYTES) as usize];
        let scan = scan_area(area, AREA_BYTES / 512, &w.uuid);
        let Some(rec) = scan.newest else {
            continue;
        };
        assert!(rec.header.generation >= 1);
        let mut pp_at = AREA_OFFSET as usize + rec.offset_sectors as usize * 512 + 4096;
        for e in &rec.header.entries {
            assert_eq!(e.parity_disk as usize, m);
            let pp = &img[pp_at..pp_at + e.pp_size as usize];
            assert!(e.pp_matches(pp), "seed {seed}: member {m}: PP checksum");
            let plan = plan_recovery(e, &geo, m as u16, |_, _| false).unwrap();
            let bs = plan.block_bytes as usize;
            for row in &plan.rows {
                let mut acc = match row.pp_offset_bytes {
                    Some(o) => pp[o as usize..o as usize + bs].to_vec(),
                    None => vec![0; bs],
                };
                for d in &row.data {
                    let at = (DATA_OFFSET + d.offset_bytes) as usize;
                    let src = &images[usize::from(d.member)][at..at + bs];
                    acc.iter_mut().zip(src).for_each(|(a, b)| *a ^= b);
                }
                let at = (DATA_OFFSET + row.parity.offset_bytes) as usize;
                assert!(
                    images[usize::from(row.parity.member)][at..at + bs] == acc[..],
                    "seed {seed}: member {m}: partial parity does not give the parity at \
                     array sector {}",
                    row.array_sector
                );
                checked += 1;
            }
            pp_at += e.pp_size as usize;
        }
    }
    assert!(checked > 0, "seed {seed}: no row checked");
}

/// RAID6 (ferroraid's extension, docs/FORMAT.md): every member's newest record holds,
/// per entry, the partial P (a P log) or partial Q (a Q log) of the chunks the logged
/// write left alone — recomputed here from the media, where nothing has changed those
/// chunks since (a later write of the stripe would be in a newer record of both logs).
fn check_raid6_records(images: &[Vec<u8>], geo: &ArrayGeometry, uuid: &Uuid, seed: u64) {
    let g = geo.geometry();
    let (chunk, nd) = (u64::from(g.chunk_bytes()), g.data_chunks());
    let stripe_bytes = chunk * u64::from(nd);
    let parity = Parity::new();
    let (mut p_entries, mut q_entries) = (0, 0);
    for (m, img) in images.iter().enumerate() {
        let area = &img[AREA_OFFSET as usize..(AREA_OFFSET + AREA_BYTES) as usize];
        let Some(rec) = scan_area(area, AREA_BYTES / 512, uuid).newest else {
            continue;
        };
        let mut pp_at = AREA_OFFSET as usize + rec.offset_sectors as usize * 512 + 4096;
        for e in &rec.header.entries {
            assert_eq!(e.parity_disk as usize, m);
            let at = e.data_sector * 512;
            let (stripe, within) = (at / stripe_bytes, at % stripe_bytes);
            let st = geo.stripe(stripe);
            let (first, row_start) = ((within / chunk) as u16, (within % chunk) as usize);
            let row_bytes = if e.pp_size == 0 {
                (e.data_size / u32::from(nd)) as usize
            } else {
                e.pp_size as usize
            };
            let chunks = (e.data_size as usize / row_bytes) as u16;
            let is_q = st.q_member() == Some(m as u16);
            assert!(
                is_q || st.p_member() == m as u16,
                "seed {seed}: log of a data member"
            );
            if is_q {
                q_entries += 1;
            } else {
                p_entries += 1;
            }
            if e.pp_size == 0 {
                assert_eq!((first, chunks), (0, nd), "seed {seed}: full entry");
                continue;
            }
            let pp = &img[pp_at..pp_at + row_bytes];
            pp_at += row_bytes;
            assert!(e.pp_matches(pp), "seed {seed}: member {m}: PP checksum");
            // The unmodified chunks' rows from the media, zeroes for the modified, in Q
            // slot order.
            let mut rows: Vec<AlignedBuf> =
                (0..nd).map(|_| AlignedBuf::zeroed(row_bytes)).collect();
            for k in (0..nd).filter(|&k| k < first || k >= first + chunks) {
                let dm = usize::from(st.data_member(k));
                let off = (DATA_OFFSET + stripe * chunk) as usize + row_start;
                rows[usize::from(st.q_slot(k))].copy_from_slice(&images[dm][off..off + row_bytes]);
            }
            let srcs: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
            let mut want = AlignedBuf::zeroed(row_bytes);
            if is_q {
                parity.gen_q(&srcs, &mut want);
            } else {
                parity.gen_p(&srcs, &mut want);
            }
            assert!(
                pp == &want[..],
                "seed {seed}: member {m} ({}): the partial parity of stripe {stripe} rows \
                 {row_start}+{row_bytes} is not the unmodified chunks'",
                if is_q { "Q log" } else { "P log" }
            );
        }
    }
    assert!(
        p_entries > 0 && q_entries > 0,
        "seed {seed}: P entries {p_entries}, Q {q_entries}"
    );
}

#[test]
fn every_write_is_logged_and_the_newest_records_recover_the_parity_on_the_media() {
    for seed in 1..=4 {
        for shards in [1, 2, 4] {
            run(Level::Raid5, 5, shards, seed);
            run(Level::Raid5, 3, shards, seed + 100);
        }
    }
}

/// RAID6: every write is logged in its P member's and its Q member's logs (lower member
/// first) without the turns deadlocking across shards, everything reads back, and each
/// member's newest record carries the partial P or partial Q of what the media hold.
#[test]
fn raid6_writes_are_logged_in_both_parity_logs_on_one_to_four_shards() {
    for seed in 1..=4 {
        for shards in [1, 2, 4] {
            run(Level::Raid6, 6, shards, seed);
            run(Level::Raid6, 4, shards, seed + 100);
        }
    }
}

/// A record write that never completes times out like any member command: the log's
/// member is failed, and the writes it described go out without it (no parity member to
/// protect); they complete and read back.
#[test]
fn a_hung_record_write_times_out_and_fails_its_member() {
    use crate::sim::{Fault, FaultRule, OpFilter};
    let mut w = world(Level::Raid5, 5, 8192, 8, 1, 3);
    // Stripe 0's parity member (left-symmetric: the last member for stripe 0).
    let st = w.arr.geometry().stripe(0);
    let pm = st.p_member();
    w.devs[usize::from(pm)].add_fault(FaultRule {
        filter: OpFilter::Write,
        range: Some(AREA_OFFSET..AREA_OFFSET + AREA_BYTES),
        fault: Fault::Hang,
        probability: 1.0,
        count: None,
    });
    let t0 = w.clock.now_ns();
    let mut data = AlignedBuf::zeroed(4096);
    data.iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = i as u8 ^ 0x5a);
    submit(&mut w, 1, ArrayOp::Write { fua: false }, 0, &mut data);
    let mut done = Vec::new();
    while done.is_empty() {
        assert!(
            w.clock.now_ns() - t0 < 3 * DEFAULT_IO_TIMEOUT_NS,
            "the write hangs behind its record"
        );
        step(&mut w, &mut done);
    }
    assert_eq!(done[0].status, Ok(()));
    let waited = w.clock.now_ns() - t0;
    assert!(
        (DEFAULT_IO_TIMEOUT_NS..2 * DEFAULT_IO_TIMEOUT_NS).contains(&waited),
        "the write took {waited} ns"
    );
    assert_eq!(
        w.arr.member_states()[usize::from(pm)],
        MemberState::Failed(IoError::Timeout)
    );
    let mut back = AlignedBuf::zeroed(4096);
    assert_eq!(run_one(&mut w, 2, ArrayOp::Read, 0, &mut back), Ok(()));
    assert!(back[..] == data[..]);
    assert!(w.arr.shards().iter().all(|s| !s.busy()));
}

/// Review of 8e1e28d: full-stripe writes with the PPL on, healthy or with a member lost
/// before or during the writes (stripes losing their P log, their Q log or both), mixed
/// with partial writes of the same stripes: every write completes, everything reads back,
/// and the survivors hold the parity of the data.
#[test]
fn full_stripe_writes_with_ppl_degraded() {
    for (level, members) in [(Level::Raid5, 4), (Level::Raid6, 5), (Level::Raid6, 4)] {
        let mut losses: Vec<Vec<u16>> = vec![vec![]];
        for a in 0..members {
            losses.push(vec![a]);
            if level == Level::Raid6 {
                losses.push(vec![a, (a + 1) % members]);
            }
        }
        for lost in losses {
            for shards in [1, 2] {
                full_stripe_ppl_case(level, members, shards, &lost);
            }
        }
    }
}

fn full_stripe_ppl_case(level: Level, members: u16, shards: usize, lost: &[u16]) {
    let chunk = 8192u64;
    let stripes = 12u64;
    let seed = 11 + u64::from(members) + lost.iter().map(|&m| u64::from(m) * 7).sum::<u64>();
    let what = format!("{level:?} n={members} shards={shards} lost {lost:?}");
    let mut w = world(level, members, chunk, stripes, shards, seed);
    let g = *w.arr.geometry().geometry();
    let sb = g.stripe_data_bytes();
    let cap = w.arr.geometry().capacity_bytes();
    let mut reference = vec![0u8; cap as usize];
    let mut next = xorshift(seed);
    let mut inflight: Vec<Inflight> = Vec::new();
    let mut done = Vec::new();
    let mut tag = 1u64;
    for i in 0..200u64 {
        if i == 20 {
            for &m in lost {
                w.devs[usize::from(m)].disappear();
            }
        }
        while inflight.len() >= 12 {
            step(&mut w, &mut done);
            retire(&mut done, &mut inflight, &mut reference, seed);
        }
        let (off, len) = match next() % 4 {
            // one or two whole stripes
            0 | 1 => {
                let n = 1 + next() % 2;
                let s = next() % (stripes - n + 1);
                (s * sb, n * sb)
            }
            // a partial piece
            _ => {
                let len = 512 * (1 + next() % 24);
                ((next() % ((cap - len) / 512)) * 512, len)
            }
        };
        let fua = next().is_multiple_of(4);
        submit_unless_overlapping(&mut w, &mut inflight, &mut tag, (off, len, fua), &mut next);
    }
    drain_and_check_read_back(
        &mut w,
        &mut done,
        &mut inflight,
        &mut reference,
        seed,
        &what,
    );
    // Media: survivors' data and parity.
    let images: Vec<Vec<u8>> = w.devs.iter().map(SimDevice::contents).collect();
    let parity = Parity::new();
    let c = chunk as usize;
    let nd = g.data_chunks();
    for s in 0..stripes {
        let st = g.stripe(s);
        let at = DATA_OFFSET as usize + s as usize * c;
        let mut owned: Vec<AlignedBuf> = (0..nd).map(|_| AlignedBuf::zeroed(c)).collect();
        for k in 0..nd {
            let d = &reference[(s as usize * usize::from(nd) + usize::from(k)) * c..][..c];
            owned[usize::from(st.q_slot(k))].copy_from_slice(d);
            let m = st.data_member(k);
            if !lost.contains(&m) {
                assert!(
                    images[usize::from(m)][at..at + c] == d[..],
                    "{what}: stripe {s} data {k}"
                );
            }
        }
        let rows: Vec<&[u8]> = owned.iter().map(|b| &b[..]).collect();
        let (mut p, mut q) = (AlignedBuf::zeroed(c), AlignedBuf::zeroed(c));
        match st.q_member() {
            Some(_) => parity.gen_pq(&rows, &mut p, &mut q),
            None => parity.gen_p(&rows, &mut p),
        }
        let pm = st.p_member();
        if !lost.contains(&pm) {
            assert!(
                images[usize::from(pm)][at..at + c] == p[..],
                "{what}: stripe {s} P on {pm}"
            );
        }
        if let Some(qm) = st.q_member().filter(|qm| !lost.contains(qm)) {
            assert!(
                images[usize::from(qm)][at..at + c] == q[..],
                "{what}: stripe {s} Q on {qm}"
            );
        }
    }
    if lost.is_empty() {
        let geo = *w.arr.geometry();
        if level == Level::Raid6 {
            check_raid6_records(&images, &geo, &w.uuid, seed);
        }
    }
}

/// A member replaced under random writes on an array with a PPL: a record write or flush
/// still in flight to the leaving device when it leaves its slot completes normally (it
/// once came back as a stray completion there and its log waited for it forever,
/// stalling every write of the stripe); and once the replacement holds the slot, the
/// slot's next record lies at the start of its area, where recovery's walk begins (the
/// log is rewound at the swap), so the walk finds the newest record there is. Both shard
/// counts; the seeds include swaps with a log request in flight to the leaving device
/// (asserted, so the case cannot go untested).
#[test]
fn a_replaced_member_hands_its_log_to_the_replacement() {
    let mut swaps_with_log_io = 0;
    for seed in 0..24u64 {
        let shards = 1 + (seed % 2) as usize;
        swaps_with_log_io += replace_under_writes(shards, seed);
    }
    assert!(
        swaps_with_log_io > 0,
        "no swap found a log request in flight to the leaving device"
    );
}

/// One case of [`a_replaced_member_hands_its_log_to_the_replacement`]; returns how many
/// shards swapped with a log request still in flight to the leaving device.
fn replace_under_writes(shards: usize, seed: u64) -> u32 {
    let (members, chunk, stripes) = (5u16, 8192u64, 8u64);
    let mut w = world(Level::Raid5, members, chunk, stripes, shards, seed);
    let cap = w.arr.geometry().capacity_bytes();
    let mut reference = vec![0u8; cap as usize];
    let mut next = xorshift(seed + 100);
    let (mut inflight, mut done, mut tag) = (Vec::new(), Vec::new(), 1u64);
    let slot = (seed % u64::from(members)) as u16;
    let new = SimDevice::new(
        "r",
        DATA_OFFSET + stripes * chunk,
        512,
        Profile::nvme_ssd(),
        w.clock.clone(),
        seed + 7,
    )
    .unwrap();
    let chans = (0..shards).map(|_| new.open_channel().unwrap()).collect();
    let what = format!("seed {seed} shards {shards} slot {slot}");
    // Writes under way before the replace starts, and all through it.
    let mut write = |w: &mut World, inflight: &mut Vec<Inflight>, tag: &mut u64| {
        let len = 512 * (1 + next() % 24);
        let off = (next() % ((cap - len) / 512)) * 512;
        let fua = next().is_multiple_of(4);
        submit_unless_overlapping(w, inflight, tag, (off, len, fua), &mut next);
    };
    for _ in 0..8 {
        write(&mut w, &mut inflight, &mut tag);
    }
    w.arr.start_replace(slot, chans, 0).unwrap();
    let mut with_log_io = 0;
    let t0 = w.clock.now_ns();
    while w.arr.replacement().unwrap().state != ReplaceState::Done {
        assert!(
            w.clock.now_ns() - t0 < DEFAULT_IO_TIMEOUT_NS,
            "{what}: the replace does not finish"
        );
        if inflight.len() < 12 {
            write(&mut w, &mut inflight, &mut tag);
        }
        step(&mut w, &mut done);
        retire(&mut done, &mut inflight, &mut reference, seed);
    }
    let old = w.devs[usize::from(slot)].clone();
    for sh in w.arr.shards() {
        // The leaving device is the extra entry until its requests are back.
        if sh.members.len() > sh.slots() {
            let id = sh.members[sh.slots()].id;
            with_log_io += u32::from(sh.ppl_in_flight_to(usize::from(id)));
        }
    }
    let t1 = w.clock.now_ns();
    while !inflight.is_empty() {
        assert!(
            w.clock.now_ns() - t1 < DEFAULT_IO_TIMEOUT_NS,
            "{what}: writes stall after the swap"
        );
        step(&mut w, &mut done);
        retire(&mut done, &mut inflight, &mut reference, seed);
    }
    let stats = total_stats(&w);
    assert_eq!(stats.stray_completions, 0, "{what}");
    assert_eq!(stats.timeouts, 0, "{what}");
    // The replacement holds no record from before it took the slot (its area was zeroed
    // when it joined; records are not copied to it); the slot's log was rewound at the
    // swap, so a write logged on the slot now puts its record at the area's start, where
    // recovery's walk begins, and the walk finds the newest record there is.
    let g = *w.arr.geometry();
    let on_slot = (0..stripes)
        .find(|&s| g.stripe(s).p_member() == slot)
        .expect("some stripe has its parity on the slot");
    let off = on_slot * g.geometry().stripe_data_bytes();
    let mut buf = AlignedBuf::zeroed(512);
    buf.fill(0x6b);
    submit(&mut w, 9_999, ArrayOp::Write { fua: true }, off, &mut buf);
    while done.is_empty() {
        step(&mut w, &mut done);
    }
    assert_eq!(done[0].status, Ok(()), "{what}");
    done.clear();
    reference[off as usize..off as usize + 512].copy_from_slice(&buf);
    let usable = AREA_BYTES / 512;
    let mut area = vec![0u8; AREA_BYTES as usize];
    new.peek(AREA_OFFSET, &mut area);
    let newest_anywhere = (0..usable - 8)
        .filter_map(|s| {
            let at = (s * 512) as usize;
            crate::metadata::ppl::PplHeader::decode_for(
                &area[at..at + crate::metadata::ppl::PPL_HEADER_SIZE],
                &w.uuid,
            )
            .ok()
            .map(|h| (h.generation, s))
        })
        .max()
        .unwrap_or_else(|| panic!("{what}: no record on the replacement"));
    let walked = scan_area(&area, usable, &w.uuid)
        .newest
        .map(|r| (r.header.generation, r.offset_sectors));
    assert_eq!(
        walked,
        Some(newest_anywhere),
        "{what}: recovery's walk misses the replacement's newest record"
    );
    let mut old_area = vec![0u8; AREA_BYTES as usize];
    old.peek(AREA_OFFSET, &mut old_area);
    assert!(
        scan_area(&old_area, usable, &w.uuid).newest.is_some(),
        "{what}: the replaced member logged nothing"
    );
    w.devs[usize::from(slot)] = new;
    let mut whole = AlignedBuf::zeroed(cap as usize);
    submit(&mut w, 0, ArrayOp::Read, 0, &mut whole);
    while done.is_empty() {
        step(&mut w, &mut done);
    }
    assert_eq!(done[0].status, Ok(()), "{what}");
    assert!(whole[..] == reference[..], "{what}: read-back differs");
    assert!(w.arr.shards().iter().all(|s| !s.busy()), "{what}");
    with_log_io
}

#[path = "ppl_replace_tests.rs"]
mod replace_tests;
