//! Power cuts during and after a replace on an array with a PPL (a reviewing session's
//! tests of c8fbfb0/5238d16, which found two ways recovery could replay the wrong
//! records or none after the replacement took the slot; both fixed by zeroing a joining
//! device's area and rewinding the slot's log at the swap, `crate::ppl::PplLog::rewind`):
//! after recovery every FUA or flushed byte is there and P (and Q) of every stripe is
//! consistent. Cached members (volatile write caches lost at the crash), 1–3 shards,
//! RAID5 and RAID6. Child of `ppl_tests` (uses its helpers). Knobs:
//! FERRORAID_PPL_REPLACE_FROM / _SEEDS (default 0 / 20), FERRORAID_PPL_REPLACE_LEVEL=5|6.

use super::*;
use crate::metadata::ppl::PplHeader;
use crate::ppl::{recover, PplLayout, PplMedia};

struct Media<'a>(Vec<&'a SimDevice>);
impl PplMedia for Media<'_> {
    fn read(&mut self, m: u16, off: u64, buf: &mut [u8]) -> Result<(), IoError> {
        self.0[usize::from(m)].peek(off, buf);
        Ok(())
    }
    fn write(&mut self, m: u16, off: u64, buf: &[u8]) -> Result<(), IoError> {
        self.0[usize::from(m)].poke(off, buf);
        Ok(())
    }
    fn flush(&mut self, _: u16) -> Result<(), IoError> {
        Ok(())
    }
}

fn cached() -> Profile {
    Profile {
        write_cache_latency_ns: Some(10_000),
        ..Profile::fixed(10_000)
    }
}

/// [`world`] on cached members, each area holding the empty header assembly writes.
fn world_cached(
    level: Level,
    members: u16,
    chunk: u64,
    stripes: u64,
    shards: usize,
    seed: u64,
) -> World {
    let w = world_with(level, members, chunk, stripes, shards, seed, cached());
    let hdr = PplHeader::empty(&w.uuid).encode().unwrap();
    for d in &w.devs {
        d.poke(AREA_OFFSET, &hdr);
    }
    w
}

/// Writes 512 bytes of `fill` at `off` (FUA when `fua`) under `tag`, waits for it, then
/// lets the log's turn end (its flushes) before the caller's next write.
fn write_and_settle(w: &mut World, tag: u64, off: u64, fua: bool, fill: u8) {
    let mut b = AlignedBuf::zeroed(512);
    b.fill(fill);
    assert_eq!(run_one(w, tag, ArrayOp::Write { fua }, off, &mut b), Ok(()));
    for _ in 0..50 {
        if w.arr.shards().iter().all(|s| !s.busy()) {
            break;
        }
        step(w, &mut Vec::new());
    }
}

/// The first stripe whose parity lies on `slot`, and a fresh (zeroed) replacement device
/// for a world of `stripes` stripes of `chunk`-byte chunks (the CLI zeroes a joining
/// device's area, `wipe_ppl`).
fn parity_stripe_and_replacement(
    w: &World,
    slot: u16,
    stripes: u64,
    chunk: u64,
) -> (u64, SimDevice) {
    let g = *w.arr.geometry().geometry();
    let s1 = (0..stripes)
        .find(|&s| g.stripe(s).p_member() == slot)
        .unwrap();
    let new = SimDevice::new(
        "r",
        DATA_OFFSET + stripes * chunk,
        512,
        Profile::nvme_ssd(),
        w.clock.clone(),
        9,
    )
    .unwrap();
    (s1, new)
}

/// mode 0: crash mid-replace (old member in the slot); mode 1: crash after the swap, the
/// CLI's superblock record modelled as a flush of every device right after the swap
/// (sync_data), then more writes; mode 2: crash after the swap with no flush at all.
/// `fail`: 0 none, 1 the replacement fails (errors) mid-replace, 2 the old member fails.
/// Returns whether the swap happened.
pub(super) fn crash_replace_case(
    level: Level,
    n: u16,
    shards: usize,
    seed: u64,
    mode: u32,
    fail: u32,
) -> bool {
    use crate::sim::{Fault, FaultRule, OpFilter};
    let (chunk, stripes) = (4096u64, 8u64);
    let mut w = world_cached(level, n, chunk, stripes, shards, seed);
    let g = *w.arr.geometry().geometry();
    let geo = *w.arr.geometry();
    let cap = geo.capacity_bytes();
    let sb = g.stripe_data_bytes();
    let mut next = xorshift(seed + 1000 * u64::from(mode) + 77);
    let what = format!("{level:?} n={n} shards={shards} seed={seed} mode={mode} fail={fail}");
    // Fill and flush.
    let mut reference: Vec<u8> = (0..cap as usize).map(|i| (i * 29 + 3) as u8).collect();
    let mut done = Vec::new();
    {
        let mut fb = AlignedBuf::zeroed(cap as usize);
        fb.copy_from_slice(&reference);
        let st = run_one(&mut w, 1, ArrayOp::Write { fua: false }, 0, &mut fb);
        assert_eq!(st, Ok(()));
        assert_eq!(run_one(&mut w, 2, ArrayOp::Flush, 0, &mut []), Ok(()));
    }
    let mut must: Vec<Option<u8>> = reference.iter().map(|&b| Some(b)).collect();
    let mut inflight: Vec<(u64, u64, u64, AlignedBuf, bool)> = Vec::new();
    let mut tag = 10u64;
    let slot = (next() % u64::from(n)) as u16;
    let new = SimDevice::new(
        "r",
        DATA_OFFSET + stripes * chunk,
        512,
        cached(),
        w.clock.clone(),
        seed + 7,
    )
    .unwrap();
    // The CLI zeroes a joining device's area (`wipe_ppl`): the fresh device is zeroes.
    let start_at = 2 + next() % 20;
    let crash_after = next() % 60; // steps after replace start (mode 0) or after swap
    let fail_at = 1 + next() % 40;
    let (mut started, mut swapped, mut steps_since, mut flushed_swap) = (false, false, 0u64, false);
    let mut iter = 0u64;
    let (mut old_ok, mut old_failed_seen) = (true, false);
    let t0 = w.clock.now_ns();
    loop {
        iter += 1;
        assert!(
            w.clock.now_ns() - t0 < 20 * DEFAULT_IO_TIMEOUT_NS,
            "{what}: stall (iter {iter}, started {started}, swapped {swapped}, inflight {})",
            inflight.len()
        );
        if mode == 3 && iter > 30 + crash_after {
            break;
        }
        if mode != 3 && !started && iter == start_at {
            let chans = (0..shards).map(|_| new.open_channel().unwrap()).collect();
            w.arr.start_replace(slot, chans, 0).unwrap();
            started = true;
        }
        if started && !swapped && fail != 0 && steps_since == fail_at {
            let d = if fail == 1 {
                &new
            } else {
                &w.devs[usize::from(slot)]
            };
            d.add_fault(FaultRule {
                filter: OpFilter::Write,
                range: None,
                fault: Fault::Error(IoError::Io { errno: 5 }),
                probability: 1.0,
                count: None,
            });
        }
        if inflight.len() < 10 {
            let len = 512 * (1 + next() % 16);
            let off = (next() % ((cap - len) / 512)) * 512;
            let fua = next().is_multiple_of(3);
            if !inflight.iter().any(|x| x.1 < off + len && off < x.1 + x.2) {
                let mut buf = AlignedBuf::zeroed(len as usize);
                for b in buf.iter_mut() {
                    *b = next() as u8;
                }
                submit(&mut w, tag, ArrayOp::Write { fua }, off, &mut buf);
                for m in &mut must[off as usize..(off + len) as usize] {
                    *m = None;
                }
                inflight.push((tag, off, len, buf, fua));
                tag += 1;
            }
        }
        step(&mut w, &mut done);
        for c in done.drain(..) {
            let i = inflight.iter().position(|x| x.0 == c.tag).unwrap();
            let (_, off, len, buf, fua) = inflight.swap_remove(i);
            assert_eq!(c.status, Ok(()), "{what}: write failed");
            let (a, b) = (off as usize, (off + len) as usize);
            reference[a..b].copy_from_slice(&buf);
            if fua {
                for i in a..b {
                    must[i] = Some(reference[i]);
                }
            }
        }
        if started {
            steps_since += 1;
        }
        if !swapped && w.arr.member_states()[usize::from(slot)].is_failed() {
            old_failed_seen = true;
        }
        let rs = w.arr.replacement().map(|r| r.state);
        if !swapped && rs == Some(ReplaceState::Done) {
            old_ok = fail != 2 || !old_failed_seen;
            swapped = true;
            steps_since = 0;
            if mode == 1 && !flushed_swap {
                // The CLI records the swap with sync_data on every member: flush what
                // completed so far (drain the writes first, then an array flush).
                while !inflight.is_empty() {
                    step(&mut w, &mut done);
                    for c in done.drain(..) {
                        let i = inflight.iter().position(|x| x.0 == c.tag).unwrap();
                        let (_, off, len, buf, _) = inflight.swap_remove(i);
                        assert_eq!(c.status, Ok(()), "{what}");
                        reference[off as usize..(off + len) as usize].copy_from_slice(&buf);
                    }
                }
                assert_eq!(run_one(&mut w, 5, ArrayOp::Flush, 0, &mut []), Ok(()));
                for (m, r) in must.iter_mut().zip(&reference) {
                    *m = Some(*r);
                }
                flushed_swap = true;
            }
        }
        let replace_over = matches!(rs, Some(ReplaceState::Failed(_)));
        if mode == 0 && started && (steps_since >= crash_after || swapped || replace_over) {
            break;
        }
        if mode != 0 && (swapped || replace_over) && steps_since >= crash_after {
            break;
        }
    }
    let states = w.arr.member_states();
    // Whether the old device of `slot` was in service when it left (mode 0 at the swap).
    let states_old_ok = old_ok;
    // Power cut.
    let World { arr, devs, .. } = w;
    drop(arr);
    for (i, d) in devs.iter().chain(std::iter::once(&new)).enumerate() {
        d.crash_volatile(seed * 13 + i as u64 + 1000 * u64::from(mode));
    }
    // Mode 0 crashes at the swap at the latest: the superblocks still name the old device.
    let use_new = swapped && mode != 0;
    let mut members: Vec<&SimDevice> = devs.iter().collect();
    if use_new {
        members[usize::from(slot)] = &new;
    }
    let present: Vec<bool> = (0..n)
        .map(|m| {
            if use_new && m == slot {
                true
            } else if m == slot && swapped {
                states_old_ok
            } else {
                !states[usize::from(m)].is_failed()
            }
        })
        .collect();
    let layout = PplLayout {
        area_offset_bytes: AREA_OFFSET,
        area_bytes: AREA_BYTES,
        data_offset_bytes: DATA_OFFSET,
    };
    let rep = recover(
        &geo,
        &layout,
        &w.uuid,
        &present,
        &mut Media(members.clone()),
    )
    .unwrap();
    let bad_present = present.iter().filter(|p| !**p).count();
    // Data that must survive (on present members).
    let c = chunk as usize;
    for (i, v) in must.iter().enumerate().take(cap as usize) {
        let Some(v) = *v else { continue };
        let s = i as u64 / sb;
        let k = ((i as u64 % sb) / chunk) as u16;
        let m = g.stripe(s).data_member(k);
        if !present[usize::from(m)] {
            continue;
        }
        let mut b = [0u8; 1];
        members[usize::from(m)].peek(DATA_OFFSET + s * chunk + (i % c) as u64, &mut b);
        assert_eq!(b[0], v, "{what}: byte {i} (stripe {s}, member {m}, swapped {swapped}, slot {slot}) lost; rep {rep:?}");
    }
    // Parity consistent everywhere (all members present).
    if bad_present == 0 {
        let parity = Parity::new();
        for s in 0..stripes {
            let st = g.stripe(s);
            let nd = g.data_chunks();
            let mut rows: Vec<AlignedBuf> = (0..nd).map(|_| AlignedBuf::zeroed(c)).collect();
            for k in 0..nd {
                members[usize::from(st.data_member(k))].peek(
                    DATA_OFFSET + s * chunk,
                    &mut rows[usize::from(st.q_slot(k))],
                );
            }
            let srcs: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
            let mut p = AlignedBuf::zeroed(c);
            let mut q = AlignedBuf::zeroed(c);
            let mut on = AlignedBuf::zeroed(c);
            members[usize::from(st.p_member())].peek(DATA_OFFSET + s * chunk, &mut on);
            if let Some(qm) = st.q_member() {
                parity.gen_pq(&srcs, &mut p, &mut q);
                let mut onq = AlignedBuf::zeroed(c);
                members[usize::from(qm)].peek(DATA_OFFSET + s * chunk, &mut onq);
                assert!(onq[..] == q[..], "{what}: stripe {s} Q inconsistent after recovery (swapped {swapped}, slot {slot}, q {qm}); rep {rep:?}");
            } else {
                parity.gen_p(&srcs, &mut p);
            }
            assert!(on[..] == p[..], "{what}: stripe {s} P inconsistent after recovery (swapped {swapped}, slot {slot}, p {}); rep {rep:?}", st.p_member());
        }
    }
    swapped
}

fn seeds() -> (u64, u64) {
    let from = std::env::var("FERRORAID_PPL_REPLACE_FROM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let n = std::env::var("FERRORAID_PPL_REPLACE_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    (from, n)
}

fn run_mode(mode: u32, fail: u32) {
    let (from, n) = seeds();
    let lvl: Vec<(Level, u16)> = match std::env::var("FERRORAID_PPL_REPLACE_LEVEL").as_deref() {
        Ok("6") => vec![(Level::Raid6, 5)],
        Ok("5") => vec![(Level::Raid5, 4)],
        _ => vec![(Level::Raid5, 4), (Level::Raid6, 5)],
    };
    let mut swaps = 0;
    for seed in from..from + n {
        for &(l, m) in &lvl {
            let shards = 1 + (seed % 3) as usize;
            swaps += u32::from(crash_replace_case(l, m, shards, seed, mode, fail));
        }
    }
    if mode == 1 {
        assert!(swaps > 0, "no case got to the swap");
    }
}

#[test]
fn power_cut_without_a_replace() {
    run_mode(3, 0);
}
#[test]
fn power_cut_during_a_replace() {
    run_mode(0, 0);
}
#[test]
fn power_cut_after_the_replacement_took_the_slot() {
    run_mode(1, 0);
}
#[test]
fn power_cut_after_the_replacement_failed() {
    run_mode(0, 1);
}
#[test]
fn power_cut_after_a_replace_whose_old_member_failed() {
    run_mode(1, 2);
}

/// RAID5 4 members with a PPL, 3 writes logged on member 1, member 1 replaced (no
/// writes during the replace), swap, one more write logged on the slot (now the
/// replacement): recovery's walk of the replacement's area (`scan_area`, from the start,
/// as `recover` and md's `ppl_load_distributed`) finds that record — the slot's log was
/// rewound at the swap. It once lay where the log stood, behind an empty header the join
/// had written at the area's start, and the walk took that header as a clean, empty log.
#[test]
fn records_after_the_swap_are_walked_from_the_area_start() {
    let (members, chunk, stripes, slot) = (4u16, 8192u64, 8u64, 1u16);
    let mut w = world(Level::Raid5, members, chunk, stripes, 1, 1);
    let g = *w.arr.geometry().geometry();
    let sb = g.stripe_data_bytes();
    let (s1, new) = parity_stripe_and_replacement(&w, slot, stripes, chunk);
    let wr = |w: &mut World, tag: u64| write_and_settle(w, tag, s1 * sb, false, tag as u8);
    for t in 1..=3 {
        wr(&mut w, t);
    }
    w.arr
        .start_replace(slot, vec![new.open_channel().unwrap()], 0)
        .unwrap();
    while w.arr.replacement().unwrap().state != ReplaceState::Done {
        step(&mut w, &mut Vec::new());
    }
    wr(&mut w, 4); // logged on the slot's new device only
    let usable = AREA_BYTES / 512;
    let mut area = vec![0u8; AREA_BYTES as usize];
    new.peek(AREA_OFFSET, &mut area);
    let walk = scan_area(&area, usable, &w.uuid);
    let mut max_gen = (0u64, 0u64);
    for off in 0..usable - 8 {
        let b: &[u8; 4096] = area[(off * 512) as usize..(off * 512) as usize + 4096]
            .try_into()
            .unwrap();
        if let Ok(h) = PplHeader::decode_for(b, &w.uuid) {
            if h.generation > max_gen.0 {
                max_gen = (h.generation, off);
            }
        }
    }
    let got = walk
        .newest
        .as_ref()
        .map(|r| (r.header.generation, r.offset_sectors));
    assert_eq!(got, Some(max_gen), "the replacement's newest record (generation {} at sector {}) is not what recovery's walk finds (walk: {:?}, stopped {:?})", max_gen.0, max_gen.1, got, walk.end);
}

/// The member being replaced fails mid-replace (the replace goes on as a rebuild onto the
/// replacement). A write logged while it was in service; a later write of the same stripe
/// rows while it was failed, not logged (`ppl_gate`: its parity member is failed); the
/// swap; an unclean shutdown (every write durable: no cache at all). Recovery must not
/// replay the first write's record over the later data: when records were copied to the
/// replacement during the replace, it did, and the parity went wrong.
#[test]
fn no_record_of_a_member_failed_mid_replace_is_replayed_over_later_writes() {
    let (members, chunk, stripes, slot) = (4u16, 8192u64, 8u64, 1u16);
    let mut w = world(Level::Raid5, members, chunk, stripes, 1, 1);
    let g = *w.arr.geometry().geometry();
    let geo = *w.arr.geometry();
    let sb = g.stripe_data_bytes();
    let (s1, new) = parity_stripe_and_replacement(&w, slot, stripes, chunk);
    for d in &w.devs {
        d.poke(AREA_OFFSET, &PplHeader::empty(&w.uuid).encode().unwrap()); // reinit_areas
    }
    let wr = |w: &mut World, tag: u64, off: u64| {
        write_and_settle(w, tag, off, true, tag as u8 ^ 0xa5);
    };
    // The log is at the area start: the record mirrored to the replacement lands at offset
    // 0, over the empty header, so recovery's walk reaches it (not the other defect).
    w.arr
        .start_replace(slot, vec![new.open_channel().unwrap()], 0)
        .unwrap();
    wr(&mut w, 1, s1 * sb); // data chunk 0 of stripe s1, logged on member 1 and mirrored
    w.arr.fail_member(slot, IoError::Io { errno: 5 });
    wr(&mut w, 2, s1 * sb + chunk); // data chunk 1, same rows: unlogged (parity member failed)
    let t0 = w.clock.now_ns();
    while w.arr.replacement().unwrap().state != ReplaceState::Done {
        assert!(
            w.clock.now_ns() - t0 < DEFAULT_IO_TIMEOUT_NS,
            "replace does not finish"
        );
        step(&mut w, &mut Vec::new());
    }
    while w.arr.shards().iter().any(|s| s.busy()) {
        step(&mut w, &mut Vec::new());
    }
    // Unclean shutdown here (nothing volatile), then PPL recovery with the replacement in
    // the slot, as assembly would after the swap was recorded.
    let World {
        arr, devs, uuid, ..
    } = w;
    drop(arr);
    let mut m: Vec<&SimDevice> = devs.iter().collect();
    m[usize::from(slot)] = &new;
    let check = |m: &[&SimDevice]| {
        let c = chunk as usize;
        let st = g.stripe(s1);
        let mut p = vec![0u8; c];
        for k in 0..g.data_chunks() {
            let mut d = vec![0u8; c];
            m[usize::from(st.data_member(k))].peek(DATA_OFFSET + s1 * chunk, &mut d);
            p.iter_mut().zip(&d).for_each(|(a, b)| *a ^= b);
        }
        let mut on = vec![0u8; c];
        m[usize::from(st.p_member())].peek(DATA_OFFSET + s1 * chunk, &mut on);
        on == p
    };
    assert!(check(&m), "parity already inconsistent before recovery");
    let layout = PplLayout {
        area_offset_bytes: AREA_OFFSET,
        area_bytes: AREA_BYTES,
        data_offset_bytes: DATA_OFFSET,
    };
    let rep = recover(&geo, &layout, &uuid, &[true; 4], &mut Media(m.clone())).unwrap();
    // The replacement holds no record from before it took the slot: recovery replays nothing (its log reads as missing until a record lies at its start).
    assert!(check(&m), "stripe {s1}: recovery made the parity inconsistent (replayed a stale record from the replacement's log); {rep:?}");
}

/// A failed member's slot given a new device (`replace_member`, then a rebuild onto it):
/// the slot's log is rewound, so the first write logged on the slot puts its record at
/// the start of the new device's zeroed area, where recovery's walk begins, and the walk
/// finds it. 1 and 2 shards.
#[test]
fn a_rebuilt_slot_logs_from_the_start_of_the_new_device() {
    for shards in [1usize, 2] {
        let (members, chunk, stripes, slot) = (4u16, 8192u64, 8u64, 2u16);
        let mut w = world(Level::Raid5, members, chunk, stripes, shards, 5);
        let sb = w.arr.geometry().geometry().stripe_data_bytes();
        let (s1, new) = parity_stripe_and_replacement(&w, slot, stripes, chunk);
        // Records on the slot's log first, so that it stands past the area's start.
        for t in 1..=3 {
            write_and_settle(&mut w, t, s1 * sb, false, t as u8);
        }
        w.arr.fail_member(slot, IoError::Io { errno: 5 });
        write_and_settle(&mut w, 4, s1 * sb + 512, false, 4);
        let chans = (0..shards).map(|_| new.open_channel().unwrap()).collect();
        w.arr.replace_member(slot, chans).unwrap();
        write_and_settle(&mut w, 5, s1 * sb + 1024, true, 5);
        let mut area = vec![0u8; AREA_BYTES as usize];
        new.peek(AREA_OFFSET, &mut area);
        let walked = scan_area(&area, AREA_BYTES / 512, &w.uuid).newest;
        let walked = walked.unwrap_or_else(|| panic!("{shards} shards: no log on the new device"));
        assert_eq!(walked.offset_sectors, 0, "{shards} shards");
        assert!(walked.header.generation >= 4, "{shards} shards: {walked:?}");
    }
}
