//! The write-intent bitmap in the array, on simulated members in virtual time: bits are
//! durable on every online member before a data write is issued, a crash leaves every
//! written region marked, idle regions are cleared lazily, and nothing is cleared while
//! degraded. With 1, 2 and 4 shards.

use std::sync::Arc;

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::bitmap::{NeedsSync, WriteIntent};
use crate::device::{BlockDevice, Op};
use crate::geometry::{Geometry, Layout, Level, Role};
use crate::metadata::bitmap::{bit_location, Bitmap, BitmapSuper};
use crate::metadata::Uuid;
use crate::process::ProcessRequest;
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
    world_with(level, members, shards, chunk, stripes, bm_chunk, |_| {
        Profile::fixed(20_000)
    })
}

/// [`world`] with member `i` timed (and cached, or not) by `profile(i)`.
fn world_with(
    level: Level,
    members: u16,
    shards: usize,
    chunk: u64,
    stripes: u64,
    bm_chunk: u32,
    profile: impl Fn(u16) -> Profile,
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
                profile(i),
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

    /// Submits `writes` (tagged by index) and runs until all completed; returns the
    /// completions.
    fn write_and_complete(
        &mut self,
        writes: &mut [(u64, AlignedBuf)],
    ) -> Vec<(u64, Result<(), ArrayError>)> {
        for (i, (off, buf)) in writes.iter_mut().enumerate() {
            self.submit_write(i as u64, *off, buf);
        }
        let tags: Vec<u64> = (0..writes.len() as u64).collect();
        self.complete(&tags)
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
        w.write_and_complete(&mut writes);
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

/// md's clearing rule with volatile write caches (`crate::bitmap` rule 2, md's
/// `REQ_PREFLUSH` on bitmap writes): the batch that clears bits goes out only after every
/// member with a volatile cache was flushed, so the cleared regions' writes are durable
/// first; members without a cache get no flush.
#[test]
fn cleared_bits_are_written_only_after_the_members_caches_are_flushed() {
    let cached = [1u16, 3];
    let mut w = world_with(Level::Raid5, 4, 2, 4096, 64, 8192, |i| {
        if cached.contains(&i) {
            Profile {
                write_cache_latency_ns: Some(5_000),
                ..Profile::fixed(20_000)
            }
        } else {
            Profile::fixed(20_000)
        }
    });
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let mut writes = random_writes(&w, &mut rng, 16);
    w.write_and_complete(&mut writes);
    assert!(cached
        .iter()
        .all(|&m| w.devs[usize::from(m)].volatile_bytes() > 0));
    let t0 = w.clock.now_ns();
    w.idle_until(t0 + 3 * SEC * u64::from(DAEMON_SLEEP_S) + SEC);
    for d in 0..4 {
        assert_eq!(
            w.on_disk(d).dirty_count(),
            0,
            "device {d} still has bits set"
        );
        assert_eq!(
            w.devs[d].volatile_bytes(),
            0,
            "device {d}: nothing left volatile"
        );
    }
    let ev = w.log.events();
    let is_data = |e: &crate::sim::IoEvent| e.offset_bytes >= DATA_OFFSET && e.op != Op::Flush;
    let last_data = ev.iter().rposition(is_data).expect("data writes");
    let clearing = last_data
        + ev[last_data..]
            .iter()
            .position(|e| e.kind == IoEventKind::Submit && e.op == Op::Write { fua: true })
            .expect("the clearing batch");
    for d in 0..4usize {
        let flushes: Vec<usize> = (0..ev.len())
            .filter(|&k| {
                ev[k].device == d && ev[k].op == Op::Flush && ev[k].kind == IoEventKind::Complete
            })
            .collect();
        if cached.contains(&(d as u16)) {
            assert!(
                flushes.iter().any(|&k| last_data < k && k < clearing),
                "member {d}'s cache was flushed before the clearing batch: {flushes:?}, \
                 data until {last_data}, clearing at {clearing}"
            );
        } else {
            assert!(flushes.is_empty(), "member {d} has no cache to flush");
        }
    }
}

/// While a member is failed, md keeps every bit: the member's recovery needs them.
#[test]
fn nothing_is_cleared_while_degraded() {
    let mut w = world(Level::Raid6, 5, 2, 4096, 64, 8192);
    w.devs[2].disappear();
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    let mut writes = random_writes(&w, &mut rng, 12);
    for (_, st) in w.write_and_complete(&mut writes) {
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

// ---- re-add by bitmap (md's `Bitmap_sync` recovery) ------------------------------------

/// Whether every stripe's P (and Q) match its data on the members' storage now.
fn inconsistent_stripes(w: &World) -> Vec<u64> {
    let geo = *w.arr.geometry();
    let g = *geo.geometry();
    let c = g.chunk_bytes() as usize;
    let imgs: Vec<AlignedBuf> = w
        .devs
        .iter()
        .map(|d| {
            let v = d.contents();
            let mut b = AlignedBuf::zeroed(v.len() - DATA_OFFSET as usize);
            b.copy_from_slice(&v[DATA_OFFSET as usize..]);
            b
        })
        .collect();
    let parity = Parity::new();
    let mut bad = Vec::new();
    for s in 0..geo.stripes() {
        let st = g.stripe(s);
        let on = s as usize * c;
        let mut data: Vec<&[u8]> = vec![&[]; usize::from(g.data_chunks())];
        for m in 0..g.members() {
            if let Role::Data { slot, .. } = st.role(m) {
                data[usize::from(slot)] = &imgs[usize::from(m)][on..on + c];
            }
        }
        let mut p = AlignedBuf::zeroed(c);
        let mut q = AlignedBuf::zeroed(c);
        let ok = match st.q_member() {
            Some(qm) => {
                parity.gen_pq(&data, &mut p, &mut q);
                p[..] == imgs[usize::from(st.p_member())][on..on + c]
                    && q[..] == imgs[usize::from(qm)][on..on + c]
            }
            None => {
                parity.gen_p(&data, &mut p);
                p[..] == imgs[usize::from(st.p_member())][on..on + c]
            }
        };
        if !ok {
            bad.push(s);
        }
    }
    bad
}

/// Reads the whole array through the engine; returns its bytes.
fn read_all(w: &mut World) -> Vec<u8> {
    let cap = w.arr.geometry().capacity_bytes() as usize;
    let mut buf = AlignedBuf::zeroed(cap);
    let step = 16 * 1024;
    let mut tags = Vec::new();
    for (i, at) in (0..cap).step_by(step).enumerate() {
        let len = step.min(cap - at);
        // SAFETY: `buf` outlives the requests (completed below before it is read).
        let io = unsafe { IoBuf::from_slice(&mut buf[at..at + len]) };
        w.arr
            .submit(ArrayRequest {
                tag: 10_000 + i as u64,
                op: ArrayOp::Read,
                offset_bytes: at as u64,
                len_bytes: io.len(),
                buf: io,
            })
            .unwrap();
        tags.push(10_000 + i as u64);
    }
    for (_, st) in w.complete(&tags) {
        assert_eq!(st, Ok(()));
    }
    buf.to_vec()
}

/// Member requests as (stripe, bytes) pairs.
type StripeIo = Vec<(u64, u32)>;

/// Member `m`'s data-area writes and the data-area reads of the others since log event
/// `from`.
fn data_io_since(w: &World, from: usize, m: usize) -> (StripeIo, StripeIo) {
    let chunk = u64::from(w.arr.geometry().geometry().chunk_bytes());
    let mut writes = Vec::new();
    let mut reads = Vec::new();
    for e in &w.log.events()[from..] {
        if e.kind != IoEventKind::Submit || e.offset_bytes < DATA_OFFSET {
            continue;
        }
        let stripe = (e.offset_bytes - DATA_OFFSET) / chunk;
        match e.op {
            Op::Read if e.device != m => reads.push((stripe, e.len_bytes)),
            Op::Write { .. } if e.device == m => writes.push((stripe, e.len_bytes)),
            _ => {}
        }
    }
    (writes, reads)
}

/// Fills the array with random data (whole stripes), lets the daemon clear every bit,
/// then fails member `gone` (its storage kept: a short absence) and writes `stripes`
/// while it is away. Returns the array's expected contents.
fn absence(w: &mut World, gone: u16, stripes: &[u64], seed: u64) -> Vec<u8> {
    let geo = *w.arr.geometry();
    let sb = geo.geometry().stripe_data_bytes();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut model = vec![0u8; geo.capacity_bytes() as usize];
    let mut bufs: Vec<AlignedBuf> = (0..geo.stripes())
        .map(|_| {
            let mut b = AlignedBuf::zeroed(sb as usize);
            rng.fill_bytes(&mut b);
            b
        })
        .collect();
    let mut tags = Vec::new();
    for (i, b) in bufs.iter_mut().enumerate() {
        model[i * sb as usize..(i + 1) * sb as usize].copy_from_slice(b);
        w.submit_write(i as u64, i as u64 * sb, b);
        tags.push(i as u64);
    }
    w.complete(&tags);
    let t0 = w.clock.now_ns();
    w.idle_until(t0 + 4 * SEC * u64::from(DAEMON_SLEEP_S));
    assert_eq!(
        w.on_disk(0).dirty_count(),
        0,
        "the daemon cleared every bit"
    );
    w.arr.fail_member(gone, IoError::Gone);
    let mut tags = Vec::new();
    let mut small: Vec<AlignedBuf> = stripes
        .iter()
        .map(|_| {
            let mut b = AlignedBuf::zeroed(1024);
            rng.fill_bytes(&mut b);
            b
        })
        .collect();
    for (i, (&s, b)) in stripes.iter().zip(small.iter_mut()).enumerate() {
        // A partial write inside the stripe (its data, and parity, change).
        let off = s * sb + 512 * (i as u64 % 4);
        model[off as usize..off as usize + 1024].copy_from_slice(b);
        w.submit_write(1000 + i as u64, off, b);
        tags.push(1000 + i as u64);
    }
    for (_, st) in w.complete(&tags) {
        assert_eq!(st, Ok(()));
    }
    model
}

/// A member that returns after a short absence is rebuilt only where the bitmap says it
/// missed writes: with 1, 2 and 4 shards, its data-area writes are exactly the chunks of
/// the dirty regions' stripes (2 stripes per 8 KiB region of 4 KiB chunks), the others
/// read only those stripes; afterwards every stripe is consistent, the array reads back
/// what was written, and — the array whole again — the daemon clears the bits.
#[test]
fn readd_rebuilds_only_the_bitmap_dirty_regions() {
    for shards in [1usize, 2, 4] {
        let mut w = world(Level::Raid6, 5, shards, 4096, 64, 8192);
        let model = absence(&mut w, 2, &[3, 17, 18, 50], 40 + shards as u64);
        // Regions 1, 8, 9, 25: stripes 2..4, 16..20, 50..52.
        let dirty = w.intent.on_disk_regions();
        assert_eq!(dirty, vec![2..4, 16..20, 50..52], "shards {shards}");
        assert!(w.intent.degraded());
        let from = w.log.events().len();
        let chans = (0..shards)
            .map(|_| w.devs[2].open_channel().unwrap())
            .collect();
        w.arr.readd_member(2, chans).unwrap();
        run_process(&mut w);
        let p = w.arr.process_snapshot().unwrap();
        assert_eq!(p.kind, ProcessKind::Rebuild);
        assert_eq!(p.state, ProcessState::Finished, "shards {shards}");
        assert_eq!(p.total_stripes, 8);
        assert!(w
            .arr
            .member_states()
            .iter()
            .all(|s| *s == MemberState::Online));
        let (writes, reads) = data_io_since(&w, from, 2);
        let in_dirty = |s: u64| dirty.iter().any(|r| r.contains(&s));
        assert!(writes.iter().all(|&(s, _)| in_dirty(s)), "{writes:?}");
        assert!(reads.iter().all(|&(s, _)| in_dirty(s)), "{reads:?}");
        let written: u64 = writes.iter().map(|&(_, l)| u64::from(l)).sum();
        assert_eq!(written, 8 * 4096, "shards {shards}");
        assert_eq!(inconsistent_stripes(&w), Vec::<u64>::new());
        assert!(read_all(&mut w) == model, "shards {shards}: data differs");
        // Whole again: the daemon clears the bits (md clears once not degraded).
        assert!(!w.intent.degraded());
        let t0 = w.clock.now_ns();
        w.idle_until(t0 + 4 * SEC * u64::from(DAEMON_SLEEP_S));
        assert_eq!(w.on_disk(0).dirty_count(), 0, "shards {shards}");
        assert_eq!(
            w.on_disk(2).dirty_count(),
            0,
            "the re-added member's bitmap"
        );
        eprintln!(
            "re-add, {shards} shard(s): {written} bytes written to the member, {} bytes read \
             from the others",
            reads.iter().map(|&(_, l)| u64::from(l)).sum::<u64>()
        );
    }
}

/// The same absence with the device put back as a new one (a stale member, or an array
/// without a usable bitmap: md's full recovery): every chunk is rebuilt. The I/O the
/// bitmap saves is the difference.
#[test]
fn a_member_put_back_without_the_bitmap_is_rebuilt_in_full() {
    let mut w = world(Level::Raid6, 5, 2, 4096, 64, 8192);
    let model = absence(&mut w, 2, &[3, 17, 18, 50], 77);
    let from = w.log.events().len();
    let chans = (0..2).map(|_| w.devs[2].open_channel().unwrap()).collect();
    w.arr.replace_member(2, chans).unwrap();
    run_process(&mut w);
    assert_eq!(w.arr.process_snapshot().unwrap().total_stripes, 64);
    let (writes, reads) = data_io_since(&w, from, 2);
    let written: u64 = writes.iter().map(|&(_, l)| u64::from(l)).sum();
    assert_eq!(written, 64 * 4096);
    assert_eq!(inconsistent_stripes(&w), Vec::<u64>::new());
    assert!(read_all(&mut w) == model);
    eprintln!(
        "full rebuild: {written} bytes written to the member, {} bytes read from the others",
        reads.iter().map(|&(_, l)| u64::from(l)).sum::<u64>()
    );
}

/// A re-added member is written by client writes during its recovery, everywhere; a
/// member joining gets the whole bitmap area written (md's `md_bitmap_write_all`).
#[test]
fn readd_under_client_writes_and_the_bitmap_area_is_rewritten() {
    let mut w = world(Level::Raid5, 4, 2, 4096, 64, 8192);
    let mut model = absence(&mut w, 1, &[9, 30], 5);
    // Scribble over member 1's bitmap area: the re-add must write all of it.
    w.devs[1].poke(BITMAP_START + 300, &[0xff; 64]);
    let chans = (0..2).map(|_| w.devs[1].open_channel().unwrap()).collect();
    w.arr.readd_member(1, chans).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let mut writes = random_writes(&w, &mut rng, 24);
    let mut tags = Vec::new();
    for (i, (off, buf)) in writes.iter_mut().enumerate() {
        model[*off as usize..*off as usize + buf.len()].copy_from_slice(buf);
        w.submit_write(5000 + i as u64, *off, buf);
        tags.push(5000 + i as u64);
    }
    w.complete(&tags);
    run_process(&mut w);
    assert!(w
        .arr
        .member_states()
        .iter()
        .all(|s| *s == MemberState::Online));
    assert_eq!(inconsistent_stripes(&w), Vec::<u64>::new());
    assert!(read_all(&mut w) == model);
    assert_eq!(
        w.on_disk(1).bytes,
        w.on_disk(0).bytes,
        "bitmap area rewritten"
    );
}
