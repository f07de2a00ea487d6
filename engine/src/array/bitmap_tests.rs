//! The write-intent bitmap in the array, on simulated members in virtual time: bits are
//! durable on every online member before a data write is issued, a crash leaves every
//! written region marked, idle regions are cleared lazily, and nothing is cleared while
//! degraded. With 1, 2 and 4 shards.

use std::sync::Arc;

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::bitmap::{NeedsSync, WriteIntent};
use crate::device::BlockDevice;
use crate::geometry::{Geometry, Layout};
use crate::metadata::bitmap::{bit_location, Bitmap, BitmapSuper};
use crate::metadata::Uuid;
use crate::shard::ShardedArray;
use crate::sim::{IoEventKind, IoLog, Profile, SimChannel, SimClock, SimDevice};

/// Data area start on every member (bitmap at 8 KiB, as mdadm places it).
const DATA_OFFSET: u64 = 64 << 10;
const BITMAP_START: u64 = 8 << 10;
const DAEMON_SLEEP_S: u32 = 5;
const SEC: u64 = 1_000_000_000;

struct World {
    arr: ShardedArray<SimChannel>,
    devs: Vec<SimDevice>,
    clock: SimClock,
    intent: Arc<WriteIntent>,
    log: IoLog,
    area_len: usize,
    super_: BitmapSuper,
}

fn world(
    level: Level,
    members: u16,
    shards: usize,
    chunk: u64,
    stripes: u64,
    bm_chunk: u32,
) -> World {
    let g = Geometry::new(level, Layout::LeftSymmetric, members, chunk, 512).unwrap();
    let geo = ArrayGeometry::new(g, stripes).unwrap();
    let clock = SimClock::new();
    let member_sectors = stripes * chunk / 512;
    let super_ = BitmapSuper::new(Uuid([5; 16]), member_sectors, bm_chunk, DAEMON_SLEEP_S);
    let bitmap = Bitmap::new(super_.clone(), false);
    let area = bitmap.to_area(false);
    assert!(BITMAP_START + area.len() as u64 <= DATA_OFFSET);
    let log = IoLog::new(BITMAP_START..BITMAP_START + area.len() as u64);
    let devs: Vec<SimDevice> = (0..members)
        .map(|i| {
            let d = SimDevice::new(
                &format!("d{i}"),
                DATA_OFFSET + stripes * chunk,
                512,
                Profile::fixed(20_000),
                clock.clone(),
                u64::from(i) + 1,
            )
            .unwrap();
            d.poke(BITMAP_START, &area);
            d.attach_log(&log, usize::from(i));
            d
        })
        .collect();
    let intent = Arc::new(WriteIntent::new(&bitmap, BITMAP_START, &geo, NeedsSync::None).unwrap());
    let cfg = ArrayConfig {
        requests: 64,
        stripe_ops: 16,
        data_offset_bytes: DATA_OFFSET,
        ..ArrayConfig::default()
    };
    let arrays = (0..shards)
        .map(|k| {
            let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
            let mut a = Array::new(geo, chans, Parity::new(), cfg).unwrap();
            a.attach_bitmap(Arc::clone(&intent), k == 0);
            a
        })
        .collect();
    World {
        arr: ShardedArray::new(arrays, 256),
        devs,
        clock,
        intent,
        log,
        area_len: area.len(),
        super_,
    }
}

impl World {
    /// One executor turn: process, collect completions, advance the clock to the next
    /// event no later than `limit`. Returns false when nothing can happen before `limit`.
    fn turn(&mut self, done: &mut Vec<(u64, Result<(), ArrayError>)>, limit: u64) -> bool {
        self.arr.set_now(self.clock.now_ns());
        let progressed = self.arr.process();
        let mut out = [ArrayCompletion {
            tag: 0,
            status: Ok(()),
        }; 16];
        let n = self.arr.poll(&mut out);
        done.extend(out[..n].iter().map(|c| (c.tag, c.status)));
        if progressed || n > 0 {
            return true;
        }
        let next = self
            .arr
            .shards()
            .iter()
            .flat_map(|s| s.channels().filter_map(|c| c.next_completion_ns()))
            .chain(self.arr.next_deadline_ns())
            .min();
        match next {
            Some(t) if t <= limit => {
                self.clock.advance_to(t.max(self.clock.now_ns()));
                true
            }
            _ => false,
        }
    }

    /// Runs until every tag in `tags` completed.
    fn complete(&mut self, tags: &[u64]) -> Vec<(u64, Result<(), ArrayError>)> {
        let mut done = Vec::new();
        for _ in 0..1_000_000 {
            if tags.iter().all(|t| done.iter().any(|(d, _)| d == t)) {
                return done;
            }
            assert!(self.turn(&mut done, u64::MAX), "stalled: {done:?}");
        }
        panic!("requests never completed");
    }

    /// Runs the executor (no requests) until virtual time `t`.
    fn idle_until(&mut self, t: u64) {
        let mut done = Vec::new();
        while self.turn(&mut done, t) {}
        if self.clock.now_ns() < t {
            self.clock.advance_to(t);
            self.arr.set_now(t);
            self.arr.process();
        }
        while self.turn(&mut done, t) {}
    }

    /// The bitmap area as it is on device `d` now.
    fn on_disk(&self, d: usize) -> Bitmap {
        let c = self.devs[d].contents();
        Bitmap::decode(&c[BITMAP_START as usize..BITMAP_START as usize + self.area_len]).unwrap()
    }

    fn submit_write(&mut self, tag: u64, off: u64, buf: &mut AlignedBuf) {
        // SAFETY: the buffers outlive their requests (the test keeps them until the end).
        let io = unsafe { IoBuf::from_slice(buf) };
        self.arr
            .submit(ArrayRequest {
                tag,
                op: ArrayOp::Write { fua: false },
                offset_bytes: off,
                len_bytes: io.len(),
                buf: io,
            })
            .unwrap();
    }
}

/// Random block-aligned writes (1..=3 stripes' worth or a few blocks) over the array.
fn random_writes(w: &World, rng: &mut ChaCha8Rng, n: usize) -> Vec<(u64, AlignedBuf)> {
    let cap = w.arr.geometry().capacity_bytes();
    let stripe = w.arr.geometry().geometry().stripe_data_bytes();
    (0..n)
        .map(|_| {
            let len = if rng.next_u32().is_multiple_of(3) {
                stripe * (1 + u64::from(rng.next_u32() % 3))
            } else {
                512 * (1 + u64::from(rng.next_u32() % 16))
            };
            let len = len.min(cap);
            let off = (u64::from(rng.next_u32()) * 512) % (cap - len + 1) / 512 * 512;
            let mut b = AlignedBuf::zeroed(len as usize);
            rng.fill_bytes(&mut b);
            (off, b)
        })
        .collect()
}

/// Regions a member data write at device byte `off`, `len` bytes, touches.
fn member_regions(w: &World, off: u64, len: u32) -> std::ops::Range<u64> {
    let c = u64::from(w.super_.chunksize);
    let a = off - DATA_OFFSET;
    a / c..(a + u64::from(len) - 1) / c + 1
}

fn bit(area: &[u8], r: u64) -> bool {
    let (byte, mask) = bit_location(r);
    area[byte as usize] & mask != 0
}

/// Replays the log: at every member data write's submission, every region it touches must
/// be set in the bitmap as completed on every member (`online`). Returns the number of
/// data writes checked.
fn check_bits_durable_before_data_writes(w: &World, online: &[usize]) -> usize {
    let init = Bitmap::new(w.super_.clone(), false).to_area(false);
    let mut images: Vec<Vec<u8>> = vec![init; w.devs.len()];
    let mut checked = 0;
    for e in w.log.events() {
        let writes = matches!(e.op, Op::Write { .. } | Op::WriteZeroes | Op::Discard);
        match e.kind {
            IoEventKind::Complete if e.ok && !e.data.is_empty() => {
                let at = (e.captured_at - BITMAP_START) as usize;
                images[e.device][at..at + e.data.len()].copy_from_slice(&e.data);
            }
            IoEventKind::Submit if writes && e.offset_bytes >= DATA_OFFSET => {
                checked += 1;
                for r in member_regions(w, e.offset_bytes, e.len_bytes) {
                    for &d in online {
                        assert!(
                            bit(&images[d], r),
                            "data write to device {} at {} (region {r}) issued before the bit \
                             was durable on device {d}",
                            e.device,
                            e.offset_bytes
                        );
                    }
                }
            }
            IoEventKind::Submit if writes => {
                // Only the bitmap area is written outside the data area, FUA.
                assert!(e.offset_bytes >= BITMAP_START);
                assert!(
                    e.offset_bytes + u64::from(e.len_bytes) <= BITMAP_START + w.area_len as u64
                );
                assert_eq!(e.op, Op::Write { fua: true });
            }
            _ => {}
        }
    }
    checked
}

fn run_random_writes(
    level: Level,
    members: u16,
    shards: usize,
    chunk: u64,
    bm_chunk: u32,
    seed: u64,
) {
    let mut w = world(level, members, shards, chunk, 64, bm_chunk);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut writes = random_writes(&w, &mut rng, 48);
    let mut tags = Vec::new();
    for (i, (off, buf)) in writes.iter_mut().enumerate() {
        w.submit_write(i as u64, *off, buf);
        tags.push(i as u64);
    }
    for (_, st) in w.complete(&tags) {
        assert_eq!(st, Ok(()));
    }
    let all: Vec<usize> = (0..w.devs.len()).collect();
    let checked = check_bits_durable_before_data_writes(&w, &all);
    assert!(checked > 48, "{checked} member data writes");
    let stats = w.intent.stats();
    assert!(stats.bits_set > 0 && stats.flushes > 0, "{stats:?}");
    // Every region written is set on disk on every member (nothing cleared yet: the
    // daemon needs two quiet passes of 5 s).
    for d in 0..w.devs.len() {
        let b = w.on_disk(d);
        for (off, buf) in &writes {
            let g = w.arr.geometry().geometry();
            let first = off / g.stripe_data_bytes();
            let last = (off + buf.len() as u64 - 1) / g.stripe_data_bytes();
            for s in first..=last {
                for r in w.intent.stripe_regions(s) {
                    assert!(
                        b.is_set(r),
                        "region {r} of stripe {s} not set on device {d}"
                    );
                }
            }
        }
    }
}

#[test]
fn bits_are_durable_on_every_member_before_data_writes_one_shard() {
    run_random_writes(Level::Raid6, 5, 1, 4096, 8192, 1);
}

#[test]
fn bits_are_durable_on_every_member_before_data_writes_two_shards() {
    run_random_writes(Level::Raid6, 4, 2, 4096, 8192, 2);
    run_random_writes(Level::Raid5, 4, 2, 16384, 4096, 3);
}

#[test]
fn bits_are_durable_on_every_member_before_data_writes_four_shards() {
    run_random_writes(Level::Raid6, 6, 4, 4096, 16384, 4);
    run_random_writes(Level::Raid5, 3, 4, 8192, 4096, 5);
}

#[test]
fn reads_never_wait_for_the_bitmap() {
    let mut w = world(Level::Raid6, 4, 2, 4096, 64, 8192);
    let mut bufs: Vec<AlignedBuf> = (0..8).map(|_| AlignedBuf::zeroed(8192)).collect();
    let mut tags = Vec::new();
    for (i, b) in bufs.iter_mut().enumerate() {
        // SAFETY: the buffers outlive the requests.
        let io = unsafe { IoBuf::from_slice(b) };
        w.arr
            .submit(ArrayRequest {
                tag: i as u64,
                op: ArrayOp::Read,
                offset_bytes: i as u64 * 8192,
                len_bytes: io.len(),
                buf: io,
            })
            .unwrap();
        tags.push(i as u64);
    }
    w.complete(&tags);
    let s = w.intent.stats();
    assert_eq!((s.waits, s.flushes, s.bits_set), (0, 0, 0));
}

/// A crash with writes in flight: every region a member write was issued to is set on
/// every member's bitmap, and a bitmap read back after the crash asks a resync of them.
#[test]
fn crash_mid_writes_leaves_every_written_region_marked() {
    for (shards, seed) in [(2usize, 11u64), (4, 12)] {
        let mut w = world(Level::Raid6, 5, shards, 4096, 64, 8192);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut writes = random_writes(&w, &mut rng, 40);
        for (i, (off, buf)) in writes.iter_mut().enumerate() {
            w.submit_write(i as u64, *off, buf);
        }
        // Run until some, not all, requests completed, then drop everything.
        let mut done = Vec::new();
        while done.len() < 10 {
            assert!(w.turn(&mut done, u64::MAX));
        }
        assert!(done.len() < 40, "the crash must come with writes in flight");
        let images: Vec<Bitmap> = (0..w.devs.len()).map(|d| w.on_disk(d)).collect();
        let mut issued = 0;
        for e in w.log.events() {
            if e.kind == IoEventKind::Submit
                && matches!(e.op, Op::Write { .. })
                && e.offset_bytes >= DATA_OFFSET
            {
                issued += 1;
                for r in member_regions(&w, e.offset_bytes, e.len_bytes) {
                    for (d, b) in images.iter().enumerate() {
                        assert!(b.is_set(r), "region {r} written but clear on device {d}");
                    }
                }
            }
        }
        assert!(issued > 0);
        // After the "restart": the bitmap read from any member asks a resync of at least
        // every stripe that had a write in flight.
        let geo = *w.arr.geometry();
        let back = WriteIntent::new(&images[0], BITMAP_START, &geo, NeedsSync::OnDisk).unwrap();
        let dirty = back.dirty_regions();
        let stripe_bytes = geo.geometry().stripe_data_bytes();
        let completed: Vec<u64> = done.iter().map(|(t, _)| *t).collect();
        for (i, (off, buf)) in writes.iter().enumerate() {
            if completed.contains(&(i as u64)) {
                continue;
            }
            // In flight or not started; a started one is covered (not-started ones may be).
            let first = off / stripe_bytes;
            let last = (off + buf.len() as u64 - 1) / stripe_bytes;
            for s in first..=last {
                let started = w.log.events().iter().any(|e| {
                    e.kind == IoEventKind::Submit
                        && e.offset_bytes >= DATA_OFFSET
                        && (e.offset_bytes - DATA_OFFSET) / geo.geometry().chunk_bytes() as u64 == s
                });
                if started {
                    assert!(
                        dirty.iter().any(|r| r.contains(&s)),
                        "stripe {s} had writes in flight but is not in {dirty:?}"
                    );
                }
            }
        }
    }
}

/// md's daemon: bits of idle regions are cleared after two quiet passes (5–10 s here), not
/// sooner than one, on every member, and `events_cleared` is written.
#[test]
fn idle_regions_are_cleared_lazily_on_disk() {
    for shards in [2usize, 4] {
        let mut w = world(Level::Raid6, 4, shards, 4096, 64, 8192);
        w.intent.set_events(7);
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        let mut writes = random_writes(&w, &mut rng, 16);
        let tags: Vec<u64> = (0..16).collect();
        for (i, (off, buf)) in writes.iter_mut().enumerate() {
            w.submit_write(i as u64, *off, buf);
        }
        w.complete(&tags);
        let t0 = w.clock.now_ns();
        let set = w.on_disk(0).dirty_count();
        assert!(set > 0);
        // Less than one daemon period of quiet: nothing cleared.
        w.idle_until(t0 + SEC * u64::from(DAEMON_SLEEP_S) - 1);
        for d in 0..4 {
            assert_eq!(w.on_disk(d).dirty_count(), set, "cleared too early on {d}");
        }
        // Two more periods: all cleared, on every member, with events_cleared recorded.
        w.idle_until(t0 + 3 * SEC * u64::from(DAEMON_SLEEP_S) + SEC);
        for d in 0..4 {
            let b = w.on_disk(d);
            assert_eq!(b.dirty_count(), 0, "device {d} still has bits set");
            assert_eq!(b.super_.events, 7);
            assert_eq!(b.super_.events_cleared, 7);
        }
        assert_eq!(w.intent.stats().bits_cleared, set);
        assert_eq!(w.intent.dirty_on_disk(), 0);
        // A new write sets its bit again before it goes out.
        let mut b = AlignedBuf::zeroed(4096);
        w.submit_write(100, 0, &mut b);
        w.complete(&[100]);
        assert!(w.on_disk(0).is_set(0));
        let all: Vec<usize> = (0..4).collect();
        check_bits_durable_before_data_writes(&w, &all);
        assert!(!w.arr.shards()[0].busy());
    }
}

/// While a member is failed, md keeps every bit: the member's recovery needs them.
#[test]
fn nothing_is_cleared_while_degraded() {
    let mut w = world(Level::Raid6, 5, 2, 4096, 64, 8192);
    w.devs[2].disappear();
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    let mut writes = random_writes(&w, &mut rng, 12);
    let tags: Vec<u64> = (0..12).collect();
    for (i, (off, buf)) in writes.iter_mut().enumerate() {
        w.submit_write(i as u64, *off, buf);
    }
    for (_, st) in w.complete(&tags) {
        assert_eq!(st, Ok(()));
    }
    assert!(w.intent.degraded());
    let set = w.on_disk(0).dirty_count();
    assert!(set > 0);
    let t0 = w.clock.now_ns();
    w.idle_until(t0 + 10 * SEC * u64::from(DAEMON_SLEEP_S));
    for d in [0usize, 1, 3, 4] {
        assert_eq!(w.on_disk(d).dirty_count(), set);
    }
    // The surviving members got the bits before the data, the lost one is exempt.
    check_bits_durable_before_data_writes(&w, &[0, 1, 3, 4]);
}

/// Regions pinned for a resync are not cleared until the resync reports them done.
#[test]
fn needed_regions_wait_for_sync_done() {
    let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 3, 4096, 512).unwrap();
    let geo = ArrayGeometry::new(g, 64).unwrap();
    let s = BitmapSuper::new(Uuid([1; 16]), 64 * 8, 8192, 1);
    let mut b = Bitmap::new(s, false);
    b.set(3, true);
    b.set(10, true);
    let i = WriteIntent::new(&b, BITMAP_START, &geo, NeedsSync::OnDisk).unwrap();
    assert_eq!(i.chunk_stripes(), Some(2));
    assert_eq!(i.dirty_regions(), vec![6..8, 20..22]);
    i.sync_done(0..8);
    assert_eq!(i.dirty_regions(), vec![20..22]);
    let all = WriteIntent::new(&b, BITMAP_START, &geo, NeedsSync::All).unwrap();
    assert_eq!(all.dirty_regions(), vec![0..64]);
}

/// A region written more often than every `daemon_sleep` is never cleared (md resets a
/// region's idle count on every write), while an idle neighbour is.
#[test]
fn regions_written_more_often_than_the_daemon_period_stay_set() {
    let mut w = world(Level::Raid5, 3, 2, 4096, 64, 8192);
    let mut busy = AlignedBuf::zeroed(4096);
    let mut idle = AlignedBuf::zeroed(4096);
    // Stripe 0 → region 0 (busy); stripe 40 → region 20 (written once).
    w.submit_write(1, 0, &mut busy);
    w.submit_write(2, 40 * 8192, &mut idle);
    w.complete(&[1, 2]);
    let t0 = w.clock.now_ns();
    for k in 1..=12u64 {
        w.idle_until(t0 + k * 3 * SEC);
        w.submit_write(10 + k, 0, &mut busy);
        w.complete(&[10 + k]);
        assert!(
            w.on_disk(0).is_set(0),
            "busy region cleared after {} s",
            k * 3
        );
    }
    assert!(
        !w.on_disk(0).is_set(20),
        "the idle region was never cleared"
    );
    assert_eq!(w.intent.stats().bits_cleared, 1);
}

/// A bitmap write that hangs is a member command like any other: at the command timeout
/// its member is failed and aborted, the batch completes on the others, and the waiting
/// write goes out (RAID6 survives the member).
#[test]
fn hung_bitmap_write_fails_its_member_at_the_timeout() {
    use crate::sim::{Fault, FaultRule, OpFilter};
    let mut w = world(Level::Raid6, 5, 2, 4096, 64, 8192);
    w.devs[1].add_fault(FaultRule {
        filter: OpFilter::Write,
        range: Some(BITMAP_START..DATA_OFFSET),
        fault: Fault::Hang,
        probability: 1.0,
        count: Some(1),
    });
    let mut b = AlignedBuf::zeroed(8192);
    w.submit_write(1, 0, &mut b);
    let done = w.complete(&[1]);
    assert_eq!(done[0].1, Ok(()));
    assert!(
        w.clock.now_ns() >= DEFAULT_IO_TIMEOUT_NS,
        "completed before the timeout?"
    );
    let stats: u64 = w.arr.shards().iter().map(|s| s.stats().timeouts).sum();
    assert!(stats >= 1);
    assert!(matches!(
        w.arr.shards()[0].member_states().nth(1),
        Some(MemberState::Failed(IoError::Timeout))
    ));
    check_bits_durable_before_data_writes(&w, &[0, 2, 3, 4]);
    assert!(w.on_disk(0).is_set(0));
}

/// Runs the executor until no background process is active.
fn run_process(w: &mut World) {
    let mut done = Vec::new();
    for _ in 0..10_000_000 {
        if !w.arr.process_active() {
            return;
        }
        assert!(w.turn(&mut done, u64::MAX), "process stalled");
    }
    panic!("process never finished");
}

/// The resync after an unclean shutdown, driven by the bitmap read back from the members
/// (md's bitmap-based resync): it reads only the stripes of dirty regions, makes a torn
/// stripe inside them consistent, and leaves a torn stripe in a clean region alone — a
/// check afterwards finds exactly that one (8 sectors: one 4 KiB page of one stripe).
#[test]
fn resync_after_a_crash_covers_only_bitmap_dirty_regions() {
    for shards in [1usize, 2, 4] {
        let mut w = world(Level::Raid6, 5, shards, 4096, 64, 8192);
        let stripe_bytes = w.arr.geometry().geometry().stripe_data_bytes();
        // Writes to stripes 3 and 40 (regions 1 and 20: 2 stripes per 8 KiB region).
        let mut bufs: Vec<AlignedBuf> = (0..2)
            .map(|i| {
                let mut b = AlignedBuf::zeroed(stripe_bytes as usize);
                b.fill(0x30 + i as u8);
                b
            })
            .collect();
        let (a, b) = bufs.split_at_mut(1);
        w.submit_write(1, 3 * stripe_bytes, &mut a[0]);
        w.submit_write(2, 40 * stripe_bytes, &mut b[0]);
        let done = w.complete(&[1, 2]);
        assert!(done.iter().all(|(_, s)| s.is_ok()), "{done:?}");
        // "Crash" before the daemon clears anything; tear stripes 3 (dirty region) and 20
        // (clean region): member 0's chunk no longer matches the parity.
        let images: Vec<Bitmap> = (0..w.devs.len()).map(|d| w.on_disk(d)).collect();
        for s in [3u64, 20] {
            w.devs[0].poke(DATA_OFFSET + s * 4096, &[0xee; 4096]);
        }
        let geo = *w.arr.geometry();
        let back = WriteIntent::new(&images[0], BITMAP_START, &geo, NeedsSync::OnDisk).unwrap();
        let dirty = back.dirty_regions();
        assert_eq!(dirty, vec![2..4, 40..42], "shards {shards}");
        // The restarted array: same members, the bitmap as read back.
        let intent = Arc::new(back);
        let cfg = ArrayConfig {
            requests: 64,
            stripe_ops: 16,
            data_offset_bytes: DATA_OFFSET,
            ..ArrayConfig::default()
        };
        let arrays = (0..shards)
            .map(|k| {
                let chans = w.devs.iter().map(|d| d.open_channel().unwrap()).collect();
                let mut a = Array::new(geo, chans, Parity::new(), cfg).unwrap();
                a.attach_bitmap(Arc::clone(&intent), k == 0);
                a.set_shard(k, shards);
                a
            })
            .collect();
        w.arr = ShardedArray::new(arrays, 256);
        w.intent = intent;
        let before = w.log.events().len();
        w.arr
            .start_process(&ProcessRequest {
                kind: ProcessKind::Resync,
                ranges: Some(dirty.clone()),
                resume_stripe: 0,
            })
            .unwrap();
        run_process(&mut w);
        let p = w.arr.process_snapshot().unwrap();
        assert_eq!(p.state, ProcessState::Finished, "shards {shards}");
        assert_eq!(p.total_stripes, 4);
        assert_eq!(p.mismatch_cnt, 8, "stripe 3 was torn: one 4 KiB page");
        // Every member read of the resync lies in a dirty stripe.
        for e in &w.log.events()[before..] {
            if e.kind == IoEventKind::Submit && e.op == Op::Read && e.offset_bytes >= DATA_OFFSET {
                let s = (e.offset_bytes - DATA_OFFSET) / 4096;
                assert!(
                    dirty.iter().any(|r| r.contains(&s)),
                    "resync read stripe {s} outside {dirty:?}"
                );
            }
        }
        // A check of the whole array finds the clean region's torn stripe, and only it.
        w.arr
            .start_process(&ProcessRequest::whole(ProcessKind::Check))
            .unwrap();
        run_process(&mut w);
        let p = w.arr.process_snapshot().unwrap();
        assert_eq!(p.state, ProcessState::Finished);
        assert_eq!(
            p.mismatch_cnt, 8,
            "shards {shards}: only stripe 20 is left torn"
        );
    }
}
