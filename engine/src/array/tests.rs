//! Model-based tests: random concurrent reads and writes against a flat reference image, on
//! simulated members in virtual time, with member failures up to the redundancy.

use std::ptr::NonNull;

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::device::BlockDevice;
use crate::geometry::{Geometry, Layout};
use crate::sim::{Fault, FaultRule, OpFilter, Profile, SimChannel, SimClock, SimDevice};

/// Failures injected during a run.
#[derive(Clone, Copy, Debug)]
enum Failures {
    None,
    /// Members disappear (up to the redundancy), at random points.
    Disappear,
    /// RAID6: one member disappears and another starts returning I/O errors.
    DisappearAndErrors,
}

struct Case {
    level: Level,
    layout: Layout,
    members: u16,
    chunk: u64,
    stripes: u64,
    ops: usize,
    depth: usize,
    failures: Failures,
    seed: u64,
}

struct Inflight {
    tag: u64,
    write: bool,
    off: u64,
    len: u64,
    buf: AlignedBuf,
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// Runs one configuration; panics with the seed on any mismatch.
fn run(c: &Case) -> (Array<SimChannel>, Vec<SimDevice>, Vec<u8>) {
    let g = Geometry::new(c.level, c.layout, c.members, c.chunk, 512).unwrap();
    let geo = ArrayGeometry::new(g, c.stripes).unwrap();
    let clock = SimClock::new();
    let data_offset = 8192;
    let devs: Vec<SimDevice> = (0..c.members)
        .map(|i| {
            SimDevice::new(
                &format!("sim{i}"),
                data_offset + c.stripes * c.chunk,
                512,
                Profile::nvme_ssd(),
                clock.clone(),
                c.seed ^ u64::from(i),
            )
            .unwrap()
        })
        .collect();
    let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
    let cfg = ArrayConfig {
        requests: 16,
        stripe_ops: 8,
        data_offset_bytes: data_offset,
    };
    let mut arr = Array::new(geo, chans, Parity::new(), cfg).unwrap();
    let cap = geo.capacity_bytes();
    let mut reference = vec![0u8; cap as usize];
    let mut rng = ChaCha8Rng::seed_from_u64(c.seed);
    let stripe_bytes = g.stripe_data_bytes();
    let redundancy = u64::from(g.parity_chunks());
    // When to inject each failure (op index), and on which member.
    let mut fail_at: Vec<(usize, u16, bool)> = Vec::new();
    match c.failures {
        Failures::None => {}
        Failures::Disappear => {
            // Two members two apart: never both parity-only, even in parity-first/last.
            let first = (c.seed % u64::from(c.members)) as u16;
            for i in 0..redundancy {
                fail_at.push((
                    c.ops / 4 * (i as usize + 1),
                    (first + 2 * i as u16) % c.members,
                    false,
                ));
            }
        }
        Failures::DisappearAndErrors => {
            fail_at.push((c.ops / 4, 1 % c.members, false));
            fail_at.push((c.ops / 2, 2 % c.members, true));
        }
    }
    let mut inflight: Vec<Inflight> = Vec::new();
    let mut issued = 0usize;
    let mut completed = 0usize;
    let mut next_tag = 1u64;
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 16];
    let ctx = |c: &Case| {
        format!(
            "{} {} members={} chunk={} seed={}",
            c.level, c.layout, c.members, c.chunk, c.seed
        )
    };
    while completed < c.ops {
        // Inject failures.
        while let Some(&(at, m, errors)) = fail_at.first() {
            if issued < at {
                break;
            }
            fail_at.remove(0);
            if errors {
                devs[usize::from(m)].add_fault(FaultRule {
                    filter: OpFilter::Any,
                    range: None,
                    fault: Fault::Error(IoError::Io { errno: 5 }),
                    probability: 1.0,
                    count: None,
                });
            } else {
                devs[usize::from(m)].disappear();
            }
        }
        // Keep `depth` requests in flight.
        while issued < c.ops && inflight.len() < c.depth {
            let write = rng.next_u32() % 2 == 0;
            // Half small (1..=8 blocks: RMW territory), half up to three stripes (RCW,
            // full-stripe writes, multi-stripe requests).
            let max_blocks = if rng.next_u32() % 2 == 0 {
                8
            } else {
                (3 * stripe_bytes / 512).min(cap / 512)
            };
            let blocks = 1 + u64::from(rng.next_u32()) % max_blocks;
            let len = blocks * 512;
            let off = (u64::from(rng.next_u32()) * 512) % (cap - len + 512);
            let off = off.min(cap - len);
            // Reads never overlap in-flight writes, writes never overlap in-flight reads:
            // their outcome would be legitimately either. Writes may overlap writes: the
            // array must apply them in submission order.
            let clash = inflight
                .iter()
                .any(|f| f.write != write && overlaps((f.off, f.len), (off, len)));
            if clash {
                break;
            }
            let mut buf = AlignedBuf::zeroed(len as usize);
            if write {
                rng.fill_bytes(&mut buf);
                reference[off as usize..(off + len) as usize].copy_from_slice(&buf);
            }
            let tag = next_tag;
            next_tag += 1;
            // SAFETY: the buffer lives in `inflight` until its completion is handled and is
            // not touched meanwhile (AlignedBuf's heap memory does not move with the Vec).
            let io = unsafe {
                IoBuf::from_raw(NonNull::new(buf.as_mut_ptr()).unwrap(), len as u32, None)
            };
            arr.submit(ArrayRequest {
                tag,
                op: if write {
                    ArrayOp::Write {
                        fua: rng.next_u32() % 8 == 0,
                    }
                } else {
                    ArrayOp::Read
                },
                offset_bytes: off,
                len_bytes: len as u32,
                buf: io,
            })
            .unwrap();
            inflight.push(Inflight {
                tag,
                write,
                off,
                len,
                buf,
            });
            issued += 1;
        }
        let progressed = arr.process();
        let n = arr.poll(&mut out);
        for done in &out[..n] {
            let i = inflight
                .iter()
                .position(|f| f.tag == done.tag)
                .expect("known tag");
            let f = inflight.swap_remove(i);
            assert_eq!(done.status, Ok(()), "{}: request {} failed", ctx(c), f.tag);
            if !f.write {
                let want = &reference[f.off as usize..(f.off + f.len) as usize];
                if f.buf[..] != *want {
                    let at = f.buf.iter().zip(want).position(|(a, b)| a != b).unwrap();
                    panic!(
                        "{}: read {}+{} differs from the reference at byte {} (array offset {})",
                        ctx(c),
                        f.off,
                        f.len,
                        at,
                        f.off + at as u64
                    );
                }
            }
            completed += 1;
        }
        if !progressed && n == 0 {
            let next = arr
                .channels()
                .filter_map(|ch| ch.next_completion_ns())
                .min();
            match next {
                Some(t) => clock.advance_to(t.max(clock.now_ns())),
                None => assert!(
                    !inflight.is_empty() || issued < c.ops,
                    "{}: stalled with nothing in flight",
                    ctx(c)
                ),
            }
            if next.is_none() && !inflight.is_empty() {
                panic!(
                    "{}: {} requests in flight but no member I/O pending",
                    ctx(c),
                    inflight.len()
                );
            }
        }
    }
    // Read the whole array back through the engine.
    let mut whole = AlignedBuf::zeroed(cap as usize);
    let mut off = 0u64;
    while off < cap {
        let len = (cap - off).min(1 << 20);
        // SAFETY: `whole` outlives the request, which completes before the next loop turn.
        let io = unsafe {
            IoBuf::from_raw(
                NonNull::new(whole.as_mut_ptr().add(off as usize)).unwrap(),
                len as u32,
                None,
            )
        };
        arr.submit(ArrayRequest {
            tag: 0,
            op: ArrayOp::Read,
            offset_bytes: off,
            len_bytes: len as u32,
            buf: io,
        })
        .unwrap();
        loop {
            let progressed = arr.process();
            if arr.poll(&mut out) == 1 {
                assert_eq!(out[0].status, Ok(()), "{}: final read failed", ctx(c));
                break;
            }
            if !progressed {
                let t = arr
                    .channels()
                    .filter_map(|ch| ch.next_completion_ns())
                    .min()
                    .expect("pending I/O");
                clock.advance_to(t.max(clock.now_ns()));
            }
        }
        off += len;
    }
    assert!(
        whole[..] == reference[..],
        "{}: final read-back differs",
        ctx(c)
    );
    (arr, devs, reference)
}

/// Recomputes every stripe's parity from the member images (no member may be missing).
fn assert_parity_consistent(g: &Geometry, stripes: u64, devs: &[SimDevice], data_offset: usize) {
    let imgs: Vec<Vec<u8>> = devs.iter().map(|d| d.contents()).collect();
    let chunk = g.chunk_bytes() as usize;
    let par = Parity::new().streaming(false);
    let mut p = AlignedBuf::zeroed(chunk);
    let mut q = AlignedBuf::zeroed(chunk);
    let data: Vec<AlignedBuf> = (0..g.data_chunks())
        .map(|_| AlignedBuf::zeroed(chunk))
        .collect();
    let mut data = data;
    for s in 0..stripes {
        let st = g.stripe(s);
        let at = data_offset + s as usize * chunk;
        for k in 0..g.data_chunks() {
            let m = usize::from(st.data_member(k));
            data[usize::from(st.q_slot(k))].copy_from_slice(&imgs[m][at..at + chunk]);
        }
        let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
        par.gen_pq(&refs, &mut p, &mut q);
        assert!(
            p[..] == imgs[usize::from(st.p_member())][at..at + chunk],
            "stripe {s}: P inconsistent"
        );
        if let Some(qm) = st.q_member() {
            assert!(
                q[..] == imgs[usize::from(qm)][at..at + chunk],
                "stripe {s}: Q inconsistent"
            );
        }
    }
}

fn cases(failures: Failures, ops: usize) -> Vec<Case> {
    let mut v = Vec::new();
    let mut seed = 1000;
    for level in [Level::Raid5, Level::Raid6] {
        if matches!(failures, Failures::DisappearAndErrors) && level == Level::Raid5 {
            continue;
        }
        for layout in Layout::ALL {
            // The wider configuration has enough data chunks that RMW beats RCW for small
            // writes (RAID6 needs 5: 1 + 2 reads < 4).
            for (members, chunk) in [
                (level.min_members(), 4096u64),
                (level.min_members() + 3, 16384),
            ] {
                seed += 1;
                v.push(Case {
                    level,
                    layout,
                    members,
                    chunk,
                    stripes: 3 * u64::from(members) + 1,
                    ops,
                    depth: 6,
                    failures,
                    seed,
                });
            }
        }
    }
    v
}

#[test]
fn healthy_arrays_match_reference_and_keep_parity() {
    let mut total = ArrayStats::default();
    for c in cases(Failures::None, 1500) {
        let (arr, devs, _) = run(&c);
        assert!(arr.member_states().all(|s| s == MemberState::Online));
        assert_parity_consistent(arr.geometry().geometry(), c.stripes, &devs, 8192);
        let st = arr.stats();
        assert!(
            st.full_stripe_writes > 0 && st.rcw_writes > 0 && st.direct_reads > 0,
            "seed {}: {st:?}",
            c.seed
        );
        total.rmw_writes += st.rmw_writes;
        let g = arr.geometry().geometry();
        if g.data_chunks() > g.parity_chunks() + 2 {
            assert!(
                st.rmw_writes > 0,
                "seed {}: RMW should win small writes here: {st:?}",
                c.seed
            );
        }
        assert_eq!(st.degraded_reads + st.degraded_writes, 0);
    }
    assert!(total.rmw_writes > 100, "RMW exercised: {total:?}");
}

#[test]
fn degraded_arrays_serve_every_byte() {
    for c in cases(Failures::Disappear, 1500) {
        let (arr, _, _) = run(&c);
        let st = arr.stats();
        // A failed member that holds data in some stripe forces degraded reads; every
        // failure forces degraded writes.
        let g = *arr.geometry().geometry();
        let holds_data = arr.member_states().enumerate().any(|(m, s)| {
            s != MemberState::Online
                && (0..u64::from(g.members()))
                    .any(|st| matches!(g.stripe(st).role(m as u16), Role::Data { .. }))
        });
        assert!(st.degraded_writes > 0, "seed {}: {st:?}", c.seed);
        assert_eq!(st.degraded_reads > 0, holds_data, "seed {}: {st:?}", c.seed);
        let failed = arr
            .member_states()
            .filter(|s| *s != MemberState::Online)
            .count();
        assert_eq!(
            failed,
            usize::from(arr.geometry().geometry().parity_chunks()),
            "seed {}",
            c.seed
        );
    }
}

#[test]
fn raid6_survives_a_lost_member_plus_io_errors() {
    for c in cases(Failures::DisappearAndErrors, 1500) {
        let (arr, _, _) = run(&c);
        assert_eq!(
            arr.member_states()
                .filter(|s| *s != MemberState::Online)
                .count(),
            2,
            "seed {}",
            c.seed
        );
    }
}

#[test]
fn beyond_redundancy_is_an_error_never_wrong_data() {
    let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 4, 4096, 512).unwrap();
    let geo = ArrayGeometry::new(g, 8).unwrap();
    let clock = SimClock::new();
    let devs: Vec<SimDevice> = (0..4)
        .map(|i| {
            SimDevice::new(
                &format!("d{i}"),
                8 * 4096,
                512,
                Profile::fixed(1000),
                clock.clone(),
                1,
            )
            .unwrap()
        })
        .collect();
    let mut arr = Array::new(
        geo,
        devs.iter().map(|d| d.open_channel().unwrap()).collect(),
        Parity::new(),
        ArrayConfig::default(),
    )
    .unwrap();
    devs[0].disappear();
    devs[2].disappear();
    let mut buf = AlignedBuf::zeroed(4096 * 3);
    // SAFETY: buf outlives the request.
    let io = unsafe {
        IoBuf::from_raw(
            NonNull::new(buf.as_mut_ptr()).unwrap(),
            buf.len() as u32,
            None,
        )
    };
    arr.submit(ArrayRequest {
        tag: 7,
        op: ArrayOp::Read,
        offset_bytes: 0,
        len_bytes: io.len(),
        buf: io,
    })
    .unwrap();
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 1];
    for _ in 0..100 {
        arr.process();
        if arr.poll(&mut out) == 1 {
            break;
        }
        if let Some(t) = arr.channels().filter_map(|c| c.next_completion_ns()).min() {
            clock.advance_to(t.max(clock.now_ns()));
        }
    }
    assert_eq!(out[0].tag, 7);
    assert!(
        matches!(
            out[0].status,
            Err(ArrayError::Unrecoverable { .. } | ArrayError::Failed)
        ),
        "{:?}",
        out[0]
    );
    // Malformed requests complete with a clear error instead of panicking.
    for (off, len, why) in [
        (100u64, 512u32, "multiple"),
        (geo.capacity_bytes(), 512, "beyond"),
    ] {
        let mut b = AlignedBuf::zeroed(len as usize);
        // SAFETY: b outlives the request (refused at once).
        let io = unsafe { IoBuf::from_raw(NonNull::new(b.as_mut_ptr()).unwrap(), len, None) };
        arr.submit(ArrayRequest {
            tag: 9,
            op: ArrayOp::Read,
            offset_bytes: off,
            len_bytes: len,
            buf: io,
        })
        .unwrap();
        arr.process();
        assert_eq!(arr.poll(&mut out), 1);
        assert!(
            matches!(out[0].status, Err(ArrayError::Invalid(m)) if m.contains(why)),
            "{:?}",
            out[0]
        );
    }
}
