//! Scenario: a stream of full-stripe writes must not starve a concurrent partial-stripe
//! writer (issue 3). In virtual time on simulated NVMe members, a full-stripe writer keeps
//! `FULL_QD` writes in flight over every stripe while a partial writer issues 4 KiB writes
//! (one at a time) to random places in the same stripes. Stripe operations run in arrival
//! order on each stripe, so a partial write waits at most for the full-stripe writes that
//! arrived before it: its worst latency is bounded by (FULL_QD + 1) full-stripe write
//! service times plus its own RMW — asserted below on virtual time.

use engine::array::{Array, ArrayCompletion, ArrayConfig, ArrayOp, ArrayRequest};
use engine::buf::AlignedBuf;
use engine::device::{BlockDevice, IoBuf};
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use engine::parity::Parity;
use engine::sim::{Profile, SimChannel, SimClock, SimDevice};
use ferroraid_tests::Rng;

const FULL_QD: usize = 8;
const CHUNK: u64 = 16384;
const STRIPES: u64 = 32;
const PARTIAL_WRITES: usize = 2000;

struct World {
    arr: Array<SimChannel>,
    clock: SimClock,
}

fn world() -> World {
    let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 6, CHUNK, 512).unwrap();
    let geo = ArrayGeometry::new(g, STRIPES).unwrap();
    let clock = SimClock::new();
    let devs: Vec<SimDevice> = (0..6)
        .map(|i| {
            SimDevice::new(
                &format!("nvme{i}"),
                STRIPES * CHUNK,
                512,
                Profile::nvme_ssd(),
                clock.clone(),
                i,
            )
            .unwrap()
        })
        .collect();
    let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
    let cfg = ArrayConfig {
        requests: 32,
        stripe_ops: 16,
        ..ArrayConfig::default()
    };
    World {
        arr: Array::new(geo, chans, Parity::new(), cfg).unwrap(),
        clock,
    }
}

fn lend(b: &mut AlignedBuf) -> IoBuf {
    // SAFETY: every buffer lives in the test until its request completes and is not touched
    // meanwhile.
    unsafe { IoBuf::from_slice(b) }
}

/// Runs the scenario; returns (partial-write latencies, full-stripe-write latencies), ns.
fn run(with_full: bool, with_partial: bool) -> (Vec<u64>, Vec<u64>) {
    let mut w = world();
    let stripe_bytes = w.arr.geometry().geometry().stripe_data_bytes();
    let mut full_bufs: Vec<AlignedBuf> = (0..FULL_QD)
        .map(|_| AlignedBuf::zeroed(stripe_bytes as usize))
        .collect();
    let mut full_started = [None::<u64>; FULL_QD];
    let mut next_stripe = 0u64;
    let mut partial = AlignedBuf::zeroed(4096);
    let mut partial_started: Option<u64> = None;
    let mut partial_done = 0usize;
    let mut rng = Rng::new(9);
    let (mut lat_partial, mut lat_full) = (Vec::new(), Vec::new());
    let full_target = if with_partial {
        usize::MAX
    } else {
        PARTIAL_WRITES
    };
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 32];
    let goal = |pd: usize, fd: usize| {
        if with_partial {
            pd >= PARTIAL_WRITES
        } else {
            fd >= full_target
        }
    };
    while !goal(partial_done, lat_full.len()) {
        let now = w.clock.now_ns();
        if with_full {
            for (i, started) in full_started.iter_mut().enumerate() {
                if started.is_none() {
                    let io = lend(&mut full_bufs[i]);
                    let off = (next_stripe % STRIPES) * stripe_bytes;
                    next_stripe += 1;
                    w.arr
                        .submit(ArrayRequest {
                            tag: i as u64,
                            op: ArrayOp::Write { fua: false },
                            offset_bytes: off,
                            len_bytes: io.len(),
                            buf: io,
                        })
                        .unwrap();
                    *started = Some(now);
                }
            }
        }
        if with_partial && partial_started.is_none() {
            let off = 4096 * rng.below(STRIPES * stripe_bytes / 4096);
            let io = lend(&mut partial);
            w.arr
                .submit(ArrayRequest {
                    tag: 1000,
                    op: ArrayOp::Write { fua: false },
                    offset_bytes: off,
                    len_bytes: 4096,
                    buf: io,
                })
                .unwrap();
            partial_started = Some(now);
        }
        let progressed = w.arr.process();
        let n = w.arr.poll(&mut out);
        let now = w.clock.now_ns();
        for c in &out[..n] {
            assert_eq!(c.status, Ok(()));
            if c.tag == 1000 {
                lat_partial.push(now - partial_started.take().unwrap());
                partial_done += 1;
            } else {
                lat_full.push(now - full_started[c.tag as usize].take().unwrap());
            }
        }
        if !progressed && n == 0 {
            let t = w
                .arr
                .channels()
                .filter_map(|c| c.next_completion_ns())
                .min()
                .expect("I/O pending");
            w.clock.advance_to(t.max(now));
        }
    }
    (lat_partial, lat_full)
}

#[test]
fn full_stripe_stream_does_not_starve_a_partial_writer() {
    let (alone, _) = run(false, true);
    let (_, full_alone) = run(true, false);
    let (mixed, full_mixed) = run(true, true);
    let max = |v: &[u64]| *v.iter().max().unwrap();
    let full_service = max(&full_alone);
    // Bound: the partial write may queue behind every full-stripe write already in flight on
    // its stripe (at most FULL_QD, each no slower than a full-stripe write at this load) plus
    // the one being served, then pay its own RMW.
    let bound = (FULL_QD as u64 + 1) * full_service + max(&alone);
    eprintln!(
        "partial alone max {} µs; full-stripe alone max {} µs; mixed: partial max {} µs (bound {} µs), \
         full-stripe max {} µs, {} partial and {} full-stripe writes",
        max(&alone) / 1000,
        full_service / 1000,
        max(&mixed) / 1000,
        bound / 1000,
        max(&full_mixed) / 1000,
        mixed.len(),
        full_mixed.len()
    );
    assert_eq!(mixed.len(), PARTIAL_WRITES, "every partial write completed");
    assert!(
        max(&mixed) <= bound,
        "a partial write waited {} ns, beyond the bound {bound} ns",
        max(&mixed)
    );
    assert!(
        full_mixed.len() > PARTIAL_WRITES,
        "the full-stripe stream kept flowing"
    );
}
