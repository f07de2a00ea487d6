//! The background data path allocates nothing: with a counting global allocator armed
//! around the executor's calls into the engine (`submit`, `process`, `poll`), a repair
//! that finds and rewrites mismatching parity, and a replace (writes mirrored to the
//! replacement, the copy, the swap at completion), beside client reads and writes on 2
//! shards, writes logged in the Partial Parity Log (RAID5 and RAID6), and a stream of
//! sub-stripe writes through the stripe cache, must count zero allocations. A separate test binary because it replaces the global allocator.

use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use engine::array::{Array, ArrayCompletion, ArrayConfig, ArrayOp, ArrayRequest, ReplaceState};
use engine::buf::AlignedBuf;
use engine::device::{BlockDevice, IoBuf};
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use engine::parity::Parity;
use engine::process::{ProcessKind, ProcessRequest, ProcessState};
use engine::shard::ShardedArray;
use engine::sim::{Profile, SimChannel, SimClock, SimDevice};

struct Counting;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
}
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; the bookkeeping touches
// only a const-initialised thread-local Cell and an atomic (neither allocates).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: AllocLayout) -> *mut u8 {
        if ARMED.with(Cell::get) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: AllocLayout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: AllocLayout, n: usize) -> *mut u8 {
        if ARMED.with(Cell::get) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn armed<T>(f: impl FnOnce() -> T) -> T {
    ARMED.with(|a| a.set(true));
    let r = f();
    ARMED.with(|a| a.set(false));
    r
}

/// Simulated NVMe SSD `i` of `bytes` bytes, 512-byte sectors, on `clock`.
fn nvme(clock: &SimClock, i: u64, bytes: u64) -> SimDevice {
    SimDevice::new(
        &format!("d{i}"),
        bytes,
        512,
        Profile::nvme_ssd(),
        clock.clone(),
        i,
    )
    .unwrap()
}

/// 4 KiB client requests, as many as `drive` wants: random reads and writes over `cap`
/// bytes from seed `x`, until 2000 have gone out.
fn random_io(cap: u64, mut x: u64) -> impl FnMut(u64) -> Option<(ArrayOp, u64)> {
    move |issued| {
        if issued > 2000 {
            return None;
        }
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let off = (x >> 20) % (cap / 4096) * 4096;
        let op = if x & 1 == 0 {
            ArrayOp::Read
        } else {
            ArrayOp::Write { fua: false }
        };
        Some((op, off))
    }
}

#[test]
fn repair_beside_client_io_allocates_nothing() {
    const CHUNK: u64 = 16384;
    const STRIPES: u64 = 256;
    let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 6, CHUNK, 512).unwrap();
    let geo = ArrayGeometry::new(g, STRIPES).unwrap();
    let clock = SimClock::new();
    let devs: Vec<SimDevice> = (0..6).map(|i| nvme(&clock, i, STRIPES * CHUNK)).collect();
    // Parity that matches nothing: every stripe of this never-written array holds random
    // P/Q bytes, so the repair rewrites parity everywhere.
    for (i, d) in devs.iter().enumerate() {
        let junk: Vec<u8> = (0..STRIPES * CHUNK)
            .map(|x| (x as u8) ^ (i as u8 * 37))
            .collect();
        d.poke(0, &junk);
    }
    let shards = (0..2)
        .map(|_| {
            let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
            Array::new(geo, chans, Parity::new(), ArrayConfig::default()).unwrap()
        })
        .collect();
    let mut arr = ShardedArray::new(shards, 64);
    arr.start_process(&ProcessRequest::whole(ProcessKind::Repair))
        .unwrap();
    let cap = geo.capacity_bytes();
    let issued = drive(&mut arr, &clock, random_io(cap, 12345), |a, _| {
        a.process_snapshot()
            .is_some_and(|s| s.state == ProcessState::Finished)
    });
    let snap = arr.process_snapshot().unwrap();
    assert_eq!(snap.state, ProcessState::Finished);
    assert!(snap.mismatch_cnt > 0);
    assert!(issued > 50, "{issued} client requests");
    assert_eq!(
        ALLOCATIONS.load(Ordering::Relaxed),
        0,
        "allocations on the background data path"
    );
}

/// Runs `arr` with 4 KiB client requests, 4 in flight (buffers allocated up front; a
/// write's filled with a byte of its number), each from `next` given the requests issued
/// so far (`None`: no more for now), until `done` — given whether `next` said `None` —
/// holds with none in flight; the allocator is armed around every call into the engine.
/// Returns the client requests issued.
fn drive(
    arr: &mut ShardedArray<SimChannel>,
    clock: &SimClock,
    mut next: impl FnMut(u64) -> Option<(ArrayOp, u64)>,
    mut done: impl FnMut(&ShardedArray<SimChannel>, bool) -> bool,
) -> u64 {
    let mut bufs: Vec<AlignedBuf> = (0..4).map(|_| AlignedBuf::zeroed(4096)).collect();
    let mut busy = [false; 4];
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 16];
    let mut issued = 0u64;
    let mut exhausted = false;
    for _ in 0..5_000_000 {
        if done(arr, exhausted) && busy.iter().all(|b| !b) {
            break;
        }
        for (slot, b) in bufs.iter_mut().enumerate() {
            if busy[slot] {
                continue;
            }
            let Some((op, off)) = next(issued) else {
                exhausted = true;
                continue;
            };
            if op.is_write() {
                b.fill(issued as u8);
            }
            // SAFETY: the buffer stays in `bufs`, untouched, until its request completes
            // (its slot is busy until then).
            let io = unsafe { IoBuf::from_slice(b) };
            let r = ArrayRequest {
                tag: slot as u64,
                op,
                offset_bytes: off,
                len_bytes: 4096,
                buf: io,
            };
            armed(|| arr.submit(r)).unwrap();
            busy[slot] = true;
            issued += 1;
        }
        arr.set_now(clock.now_ns());
        let progressed = armed(|| arr.process());
        let n = armed(|| arr.poll(&mut out));
        for c in &out[..n] {
            assert_eq!(c.status, Ok(()));
            busy[c.tag as usize] = false;
        }
        if !progressed && n == 0 {
            let next = arr
                .shards()
                .iter()
                .flat_map(|s| s.channels().filter_map(|c| c.next_completion_ns()))
                .chain(arr.next_deadline_ns())
                .min();
            clock.advance_to(next.unwrap_or(clock.now_ns() + 1000).max(clock.now_ns()));
        }
    }
    assert!(
        done(arr, exhausted),
        "still not done after 5,000,000 rounds"
    );
    issued
}

#[test]
fn replace_beside_client_io_allocates_nothing() {
    const CHUNK: u64 = 16384;
    const STRIPES: u64 = 128;
    let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 4, CHUNK, 512).unwrap();
    let geo = ArrayGeometry::new(g, STRIPES).unwrap();
    let clock = SimClock::new();
    let dev = |i: u64| nvme(&clock, i, STRIPES * CHUNK);
    let devs: Vec<SimDevice> = (0..4).map(dev).collect();
    let new = dev(9);
    let shards = (0..2)
        .map(|_| {
            let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
            Array::new(geo, chans, Parity::new(), ArrayConfig::default()).unwrap()
        })
        .collect();
    let mut arr = ShardedArray::new(shards, 64);
    // The control path (a new device entry, its queues) may allocate: not armed.
    let chans = (0..2).map(|_| new.open_channel().unwrap()).collect();
    arr.start_replace(1, chans, 0).unwrap();
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    let issued = drive(
        &mut arr,
        &clock,
        random_io(geo.capacity_bytes(), 777),
        |a, _| {
            a.replacement()
                .is_some_and(|r| r.state != ReplaceState::Copying)
                && !a.process_active()
        },
    );
    assert_eq!(arr.replacement().unwrap().state, ReplaceState::Done);
    assert!(issued > 50, "{issued} client requests");
    assert_eq!(
        ALLOCATIONS.load(Ordering::Relaxed) - before,
        0,
        "allocations on the replace's data path"
    );
}

/// The stripe cache's write path allocates nothing: sequential 4 KiB writes (4 in
/// flight) stream over an array four times the cache, so passes batch, recycle the stripes
/// the stream leaves (its chunks written gathered from the writes' buffers) and remember
/// them in the ghost ring; then a region of eight stripes
/// (half the cache) is rewritten in laps, so the second lap misses on ghosts, the cache
/// turns cautious and later laps hit cached stripes; then random reads and writes over the
/// whole array, whose writes that come back to a stripe go through the cache.
#[test]
fn stripe_cache_streams_and_laps_allocate_nothing() {
    const CHUNK: u64 = 16384;
    const STRIPES: u64 = 64;
    let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 4, CHUNK, 512).unwrap();
    let geo = ArrayGeometry::new(g, STRIPES).unwrap();
    let clock = SimClock::new();
    let devs: Vec<SimDevice> = (0..4).map(|i| nvme(&clock, i, STRIPES * CHUNK)).collect();
    let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
    let cfg = ArrayConfig {
        stripe_cache_entries: 16,
        stripe_ops: 8,
        ..ArrayConfig::default()
    };
    let shards = vec![Array::new(geo, chans, Parity::new(), cfg).unwrap()];
    let mut arr = ShardedArray::new(shards, 64);
    let stripe = g.stripe_data_bytes();
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    // Two passes over the whole array, then eight over its first eight stripes.
    let written = stream(&mut arr, &clock, 0, STRIPES * stripe, 2);
    let hits_before = arr.shards()[0].stats().cache_hit_stripes;
    let rewritten = stream(&mut arr, &clock, 0, 8 * stripe, 8);
    // Random 4 KiB reads and writes over the whole array: a write that comes back to a
    // stripe written around the cache lately runs as a pass through it.
    let hits_before_random = arr.shards()[0].stats().cache_hit_stripes;
    drive(
        &mut arr,
        &clock,
        random_io(STRIPES * stripe, 7),
        |_, exhausted| exhausted,
    );
    assert_eq!(
        ALLOCATIONS.load(Ordering::Relaxed) - before,
        0,
        "allocations on the stripe cache's write path"
    );
    let st = arr.shards()[0].stats();
    assert_eq!(written + rewritten, (2 * STRIPES + 64) * stripe / 4096);
    assert!(st.batched_writes > st.write_passes, "{st:?}");
    assert!(st.gathered_writes > 0, "no chunk written gathered: {st:?}");
    assert!(
        st.cache_hit_stripes > hits_before,
        "the rewritten region stays cached: {st:?}"
    );
    assert!(
        st.cache_hit_stripes > hits_before_random,
        "random writes coming back to their stripes found them cached: {st:?}"
    );
}

/// Writes `laps` times the range `start..end` of `arr` sequentially in 4 KiB writes,
/// 4 in flight, with the allocator armed around the engine's calls; returns the writes.
fn stream(
    arr: &mut ShardedArray<SimChannel>,
    clock: &SimClock,
    start: u64,
    end: u64,
    laps: u64,
) -> u64 {
    let total = (end - start) / 4096 * laps;
    let next = |i: u64| {
        (i < total).then(|| {
            (
                ArrayOp::Write { fua: false },
                start + i * 4096 % (end - start),
            )
        })
    };
    drive(arr, clock, next, |_, exhausted| exhausted)
}

/// The Partial Parity Log's write path allocates nothing: every write logged before it goes
/// out (records built in preallocated buffers, turns taken across 2 shards), on RAID5 (md's
/// PPL) and RAID6 (two logs per write), beside client reads.
#[test]
fn ppl_logged_writes_allocate_nothing() {
    use std::sync::Arc;

    use engine::metadata::ppl::signature;
    use engine::metadata::Uuid;
    use engine::ppl::PplShared;

    const CHUNK: u64 = 16384;
    const STRIPES: u64 = 256;
    const AREA_OFFSET: u64 = 4096;
    const AREA_BYTES: u64 = 64 << 10;
    const DATA_OFFSET: u64 = AREA_OFFSET + AREA_BYTES;
    for (level, members) in [(Level::Raid5, 5u16), (Level::Raid6, 6)] {
        let g = Geometry::new(level, Layout::LeftSymmetric, members, CHUNK, 512).unwrap();
        let geo = ArrayGeometry::new(g, STRIPES).unwrap();
        let clock = SimClock::new();
        let devs: Vec<SimDevice> = (0..members)
            .map(|i| nvme(&clock, u64::from(i), DATA_OFFSET + STRIPES * CHUNK))
            .collect();
        let shared = Arc::new(PplShared::new(
            usize::from(members),
            AREA_OFFSET,
            AREA_BYTES,
            signature(&Uuid([3; 16])),
        ));
        let cfg = ArrayConfig {
            data_offset_bytes: DATA_OFFSET,
            ..ArrayConfig::default()
        };
        let shards = (0..2)
            .map(|_| {
                let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
                let mut a = Array::new(geo, chans, Parity::new(), cfg).unwrap();
                a.attach_ppl(Arc::clone(&shared));
                a
            })
            .collect();
        let mut arr = ShardedArray::new(shards, 64);
        let records = |a: &ShardedArray<SimChannel>| -> u64 {
            a.shards().iter().map(|s| s.stats().ppl_records).sum()
        };
        let io = random_io(geo.capacity_bytes(), 777);
        let issued = drive(&mut arr, &clock, io, |a, _| records(a) >= 300);
        assert!(records(&arr) >= 300, "{level}: {} records", records(&arr));
        assert!(issued > 300, "{level}: {issued} client requests");
        assert_eq!(
            ALLOCATIONS.load(Ordering::Relaxed),
            0,
            "{level}: allocations on the PPL write path"
        );
    }
}

/// ferroraid's pacer allocates nothing on its calls: quiet requests (the reference
/// recomputed every 16, its winsorized mean iterated from the histogram), windows closed
/// with and without background, misses and probes.
#[test]
fn ferroraid_pacer_allocates_nothing() {
    use engine::qos::pacer::{FerroraidPacer, FerroraidPacerConfig};
    use engine::qos::{Admission, Pacer};
    let mut p = FerroraidPacer::new(FerroraidPacerConfig::default());
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    let (mut now, mut in_flight, mut windows) = (0u64, 0u32, 0u64);
    armed(|| {
        for i in 0..200_000u64 {
            p.foreground_submitted(now);
            // Two latency levels; background in flight makes more requests slow.
            let slow = (i * 37) % 100 < 5 + 3 * u64::from(in_flight);
            let lat = if slow { 40_000 } else { 20_000 };
            now += lat;
            p.foreground_done(now, lat, 4096, true);
            if i % 8 == 0 && in_flight > 0 {
                in_flight -= 1;
                p.background_done(now, 2_000_000, 256 << 10);
            }
            if let Admission::Now = p.admit(now, 256 << 10, in_flight) {
                in_flight += 1;
            }
        }
        windows = p.windows();
    });
    assert!(windows > 100, "windows closed: {windows}");
    assert_eq!(ALLOCATIONS.load(Ordering::Relaxed) - before, 0);
}
