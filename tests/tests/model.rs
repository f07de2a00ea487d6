//! Model-based test of the stripe engine (issue 3): random concurrent reads and writes —
//! block-aligned, from one block to three stripes, overlapping — against a flat reference
//! image, on simulated members in virtual time, over RAID5 and RAID6, every layout, two
//! member counts and chunk sizes, and 1, 2 and 4 reactors (shards), while members fail up
//! to the redundancy (RAID6 also with I/O errors on a survivor). Every read must equal the
//! reference; healthy runs end with the oracle verifying the member images.
//!
//! A quarter of the writes continue a sequential stream of small writes and flushes are
//! mixed in, so that writes of one stripe meet in write passes (batched, coalesced while
//! held, re-planned from the stripe cache — issue 17) under every failure pattern: the
//! healthy runs assert that passes served several writes, held, and hit the cache.
//!
//! `FERRORAID_MODEL_OPS` sets the operations per configuration (default 10000);
//! `FERRORAID_SEED=N` runs only the configuration with seed N (printed on failure).

use std::ptr::NonNull;

use engine::array::{
    Array, ArrayCompletion, ArrayConfig, ArrayOp, ArrayRequest, ArrayStats, MemberState,
};
use engine::buf::AlignedBuf;
use engine::device::{BlockDevice, IoBuf, IoError};
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level, Role};
use engine::parity::Parity;
use engine::shard::ShardedArray;
use engine::sim::{Fault, FaultRule, OpFilter, Profile, SimChannel, SimClock, SimDevice};
use ferroraid_tests::{Oracle, Rng};

/// Failures injected during a run.
#[derive(Clone, Copy, Debug)]
enum Failures {
    None,
    /// Members disappear (up to the redundancy), at random points.
    Disappear,
    /// RAID6: one member disappears and another starts returning I/O errors.
    DisappearAndErrors,
    /// Latent sector errors scattered over one member (and, RAID6, another member
    /// disappears): reads must be rebuilt and the sectors rewritten, the member kept.
    Latent,
}

/// A failure to inject.
#[derive(Clone, Copy, Debug)]
enum Action {
    Disappear,
    Errors,
    Latent,
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
    reactors: usize,
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
fn run(c: &Case) -> (ShardedArray<SimChannel>, Vec<SimDevice>, Vec<u8>) {
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
    let cfg = ArrayConfig {
        requests: 16,
        stripe_ops: 8,
        data_offset_bytes: data_offset,
        ..ArrayConfig::default()
    };
    // One shard per reactor, each with its own channel to every member.
    let shards = (0..c.reactors)
        .map(|_| {
            let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
            Array::new(geo, chans, Parity::new(), cfg).unwrap()
        })
        .collect();
    let mut arr = ShardedArray::new(shards, 16);
    let cap = geo.capacity_bytes();
    let mut reference = vec![0u8; cap as usize];
    let mut rng = Rng::new(c.seed);
    let stripe_bytes = g.stripe_data_bytes();
    let redundancy = u64::from(g.parity_chunks());
    // When to inject each failure (op index), and on which member.
    let mut fail_at: Vec<(usize, u16, Action)> = Vec::new();
    match c.failures {
        Failures::None => {}
        Failures::Disappear => {
            // Two members two apart: never both parity-only, even in parity-first/last.
            let first = (c.seed % u64::from(c.members)) as u16;
            for i in 0..redundancy {
                fail_at.push((
                    c.ops / 4 * (i as usize + 1),
                    (first + 2 * i as u16) % c.members,
                    Action::Disappear,
                ));
            }
        }
        Failures::DisappearAndErrors => {
            fail_at.push((c.ops / 4, 1 % c.members, Action::Disappear));
            fail_at.push((c.ops / 2, 2 % c.members, Action::Errors));
        }
        Failures::Latent => {
            // Late, so that fewer writes overwrite (and so heal) the bad sectors before reads
            // meet them; on a member holding data in stripe 0 (always data in the
            // parity-first/last layouts).
            let m = g.stripe(0).data_member(0);
            fail_at.push((c.ops * 3 / 4, m, Action::Latent));
            if c.level == Level::Raid6 {
                fail_at.push((c.ops / 2, (m + 1) % c.members, Action::Disappear));
            }
        }
    }
    let mut inflight: Vec<Inflight> = Vec::new();
    // The sequential stream's next offset.
    let mut cursor = 0u64;
    let mut issued = 0usize;
    let mut completed = 0usize;
    let mut next_tag = 1u64;
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 16];
    let ctx = |c: &Case| {
        format!(
            "{} {} members={} chunk={} reactors={} failures={:?} seed={} (replay: FERRORAID_SEED={})",
            c.level, c.layout, c.members, c.chunk, c.reactors, c.failures, c.seed, c.seed
        )
    };
    while completed < c.ops {
        // Inject failures.
        while let Some(&(at, m, action)) = fail_at.first() {
            if issued < at {
                break;
            }
            fail_at.remove(0);
            let dev = &devs[usize::from(m)];
            match action {
                Action::Errors => dev.add_fault(FaultRule {
                    filter: OpFilter::Any,
                    range: None,
                    fault: Fault::Error(IoError::Io { errno: 5 }),
                    probability: 1.0,
                    count: None,
                }),
                Action::Disappear => dev.disappear(),
                Action::Latent => {
                    for _ in 0..32 {
                        let at = data_offset + 512 * rng.below(c.stripes * c.chunk / 512);
                        dev.add_latent_error(at..at + 512);
                    }
                }
            }
        }
        // Keep `depth` requests in flight.
        while issued < c.ops && inflight.len() < c.depth {
            if rng.below(32) == 0 {
                // A flush: completes once every write acknowledged before it is durable;
                // orders nothing in the model (reads only ever meet completed writes).
                let tag = next_tag;
                next_tag += 1;
                arr.submit(ArrayRequest {
                    tag,
                    op: ArrayOp::Flush,
                    offset_bytes: 0,
                    len_bytes: 0,
                    buf: IoBuf::NONE,
                })
                .unwrap();
                inflight.push(Inflight {
                    tag,
                    write: true,
                    off: 0,
                    len: 0,
                    buf: AlignedBuf::zeroed(0),
                });
                issued += 1;
                continue;
            }
            let write = rng.below(2) == 0;
            let sequential = write && rng.below(2) == 0;
            // Half small (1..=8 blocks: RMW territory), half up to three stripes (RCW,
            // full-stripe writes, multi-stripe requests).
            let max_blocks = if rng.below(2) == 0 {
                8
            } else {
                (3 * stripe_bytes / 512).min(cap / 512)
            };
            let blocks = 1 + rng.below(max_blocks);
            let len = blocks * 512;
            let off = if sequential {
                // Small writes continuing the stream (wrapping at the end of the array).
                let len = len.min(8 * 512);
                if cursor + len > cap {
                    cursor = 0;
                }
                cursor
            } else {
                512 * rng.below((cap - len) / 512 + 1)
            };
            let len = if sequential { len.min(8 * 512) } else { len };
            // Reads never overlap in-flight writes, writes never overlap in-flight reads:
            // their outcome would be legitimately either. Writes may overlap writes: the
            // array must apply them in submission order.
            let clash = inflight
                .iter()
                .any(|f| f.write != write && overlaps((f.off, f.len), (off, len)));
            if clash {
                break;
            }
            if sequential {
                cursor = off + len;
            }
            let mut buf = AlignedBuf::zeroed(len as usize);
            // One write in 16 is a write-zeroes, one in 16 a discard.
            let op = match (write, rng.below(16)) {
                (false, _) => ArrayOp::Read,
                (true, 0) => ArrayOp::WriteZeroes {
                    fua: rng.below(4) == 0,
                },
                (true, 1) => ArrayOp::Discard,
                (true, _) => ArrayOp::Write {
                    fua: rng.below(8) == 0,
                },
            };
            match op {
                ArrayOp::Write { .. } => {
                    rng.fill(&mut buf);
                    reference[off as usize..(off + len) as usize].copy_from_slice(&buf);
                }
                ArrayOp::WriteZeroes { .. } => {
                    reference[off as usize..(off + len) as usize].fill(0)
                }
                ArrayOp::Discard => {
                    // The documented rule: whole stripes inside the range are deallocated on
                    // every member (sim members read zeroes after a discard), partial
                    // stripes are left alone.
                    let first = off.div_ceil(stripe_bytes) * stripe_bytes;
                    let last = (off + len) / stripe_bytes * stripe_bytes;
                    if first < last {
                        reference[first as usize..last as usize].fill(0);
                    }
                }
                _ => {}
            }
            let tag = next_tag;
            next_tag += 1;
            let io = if op.has_buffer() {
                // SAFETY: the buffer lives in `inflight` until its completion is handled and
                // is not touched meanwhile (AlignedBuf's heap memory does not move with the
                // Vec).
                unsafe {
                    IoBuf::from_raw(NonNull::new(buf.as_mut_ptr()).unwrap(), len as u32, None)
                }
            } else {
                IoBuf::NONE
            };
            arr.submit(ArrayRequest {
                tag,
                op,
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
        arr.set_now(clock.now_ns());
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
            let next = next_event(&arr);
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
                let t = next_event(&arr).expect("pending I/O");
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

/// Earliest completion time over every shard's member channels.
/// The next virtual time anything happens: a member completion or a command timeout.
fn next_event(arr: &ShardedArray<SimChannel>) -> Option<u64> {
    arr.shards()
        .iter()
        .flat_map(|s| s.channels())
        .filter_map(|ch| ch.next_completion_ns())
        .chain(arr.next_deadline_ns())
        .min()
}

fn stats(arr: &ShardedArray<SimChannel>) -> ArrayStats {
    let mut t = ArrayStats::default();
    for s in arr.shards() {
        t.add(&s.stats());
    }
    t
}

/// Members that some shard saw fail (each shard detects failures on its own channels).
fn failed_members(arr: &ShardedArray<SimChannel>) -> Vec<usize> {
    let n = arr.geometry().geometry().members() as usize;
    (0..n)
        .filter(|&m| {
            arr.shards()
                .iter()
                .any(|s| s.member_states().nth(m) != Some(MemberState::Online))
        })
        .collect()
}

fn ops() -> usize {
    std::env::var("FERRORAID_MODEL_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

fn cases(failures: Failures) -> Vec<Case> {
    let only: Option<u64> = std::env::var("FERRORAID_SEED")
        .ok()
        .and_then(|v| v.parse().ok());
    let mut v = Vec::new();
    let mut seed = match failures {
        Failures::None => 1000,
        Failures::Disappear => 2000,
        Failures::DisappearAndErrors => 3000,
        Failures::Latent => 4000,
    };
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
                for reactors in [1, 2, 4] {
                    seed += 1;
                    if only.is_some_and(|s| s != seed) {
                        continue;
                    }
                    v.push(Case {
                        level,
                        layout,
                        members,
                        chunk,
                        stripes: 3 * u64::from(members) + 1,
                        ops: ops(),
                        depth: 6,
                        failures,
                        reactors,
                        seed,
                    });
                }
            }
        }
    }
    v
}

/// Runs `f` over the cases on two worker threads (simulations are single-threaded each).
fn each_case(cases: Vec<Case>, f: impl Fn(&Case) + Sync) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|sc| {
        for _ in 0..2 {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(c) = cases.get(i) else { break };
                f(c);
            });
        }
    });
}

/// Hands the member images (data area only) to the oracle's `verify` (nothing to do
/// without the oracle: [`Oracle::locate_or_skip`] said so once).
fn oracle_verify(oracle: Option<&Oracle>, c: &Case, devs: &[SimDevice], data_offset: usize) {
    let Some(oracle) = oracle else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["verify".to_string()];
    for (i, d) in devs.iter().enumerate() {
        let p = dir.path().join(format!("m{i}.img"));
        std::fs::write(&p, &d.contents()[data_offset..]).unwrap();
        args.push(p.display().to_string());
    }
    args.extend([
        "--level".to_string(),
        c.level.md_level().to_string(),
        "--layout".into(),
        c.layout.name().into(),
        "--chunk".into(),
        c.chunk.to_string(),
    ]);
    let out = oracle
        .run_ok(&args)
        .unwrap_or_else(|e| panic!("seed {}: {e}", c.seed));
    assert!(out.contains("mismatches 0"), "seed {}: {out}", c.seed);
}

#[test]
fn healthy_arrays_match_reference_and_pass_the_oracle() {
    let held = std::sync::atomic::AtomicU64::new(0);
    let hits = std::sync::atomic::AtomicU64::new(0);
    let oracle = Oracle::locate_or_skip("healthy_arrays_match_reference_and_pass_the_oracle");
    each_case(cases(Failures::None), |c| {
        let (arr, devs, _) = run(c);
        assert!(failed_members(&arr).is_empty());
        assert_parity_consistent(arr.geometry().geometry(), c.stripes, &devs, 8192);
        oracle_verify(oracle.as_ref(), c, &devs, 8192);
        let st = stats(&arr);
        assert!(
            st.full_stripe_writes > 0
                && st.rcw_writes > 0
                && st.direct_reads > 0
                && st.zeroed_stripes > 0
                && st.discarded_stripes > 0
                && st.discards_skipped > 0,
            "seed {}: {st:?}",
            c.seed
        );
        let g = arr.geometry().geometry();
        if g.data_chunks() > g.parity_chunks() + 2 {
            assert!(
                st.rmw_writes > 0,
                "seed {}: RMW should win small writes here: {st:?}",
                c.seed
            );
        }
        assert_eq!(st.degraded_reads + st.degraded_writes, 0);
        // Writes of one stripe met in passes (the stream makes sure they do).
        assert!(
            st.batched_writes > st.write_passes,
            "seed {}: no pass served two writes: {st:?}",
            c.seed
        );
        held.fetch_add(st.held_passes, std::sync::atomic::Ordering::Relaxed);
        hits.fetch_add(st.cache_hit_stripes, std::sync::atomic::Ordering::Relaxed);
        if c.reactors > 1 {
            // Reads are served by the shard that received them; writes waited for such
            // reads of their stripe (the gate was exercised both ways).
            assert!(
                st.foreign_reads > 0 && st.gate_waits > 0,
                "seed {}: {st:?}",
                c.seed
            );
        } else {
            assert_eq!(st.foreign_reads + st.moved_reads + st.gate_waits, 0);
        }
    });
    let (held, hits) = (held.into_inner(), hits.into_inner());
    eprintln!("passes held: {held}, passes that found their stripe cached: {hits}");
    assert!(held > 0 && hits > 0, "held {held}, cache hits {hits}");
}

#[test]
fn degraded_arrays_serve_every_byte() {
    each_case(cases(Failures::Disappear), |c| {
        let (arr, _, _) = run(c);
        let g = *arr.geometry().geometry();
        let failed = failed_members(&arr);
        assert_eq!(
            failed.len(),
            usize::from(g.parity_chunks()),
            "seed {}",
            c.seed
        );
        // A failed member that holds data in some stripe forces degraded reads; every
        // failure forces degraded writes.
        let holds_data = failed.iter().any(|&m| {
            (0..u64::from(g.members()))
                .any(|s| matches!(g.stripe(s).role(m as u16), Role::Data { .. }))
        });
        let st = stats(&arr);
        assert!(st.degraded_writes > 0, "seed {}: {st:?}", c.seed);
        assert_eq!(st.degraded_reads > 0, holds_data, "seed {}: {st:?}", c.seed);
    });
}

#[test]
fn raid6_survives_a_lost_member_plus_io_errors() {
    each_case(cases(Failures::DisappearAndErrors), |c| {
        let (arr, _, _) = run(c);
        assert_eq!(failed_members(&arr).len(), 2, "seed {}", c.seed);
    });
}

#[test]
fn latent_sector_errors_are_repaired_and_the_member_kept() {
    let met = std::sync::atomic::AtomicUsize::new(0);
    let moved = std::sync::atomic::AtomicUsize::new(0);
    let all = cases(Failures::Latent);
    let n = all.len();
    each_case(all, |c| {
        let (arr, _, _) = run(c);
        let g = *arr.geometry().geometry();
        let m = usize::from(g.stripe(0).data_member(0));
        let failed = failed_members(&arr);
        let expect: Vec<usize> = if c.level == Level::Raid6 {
            vec![(m + 1) % usize::from(c.members)]
        } else {
            vec![]
        };
        assert_eq!(
            failed, expect,
            "seed {}: only the disappeared member may fail",
            c.seed
        );
        let medium: u64 = arr.shards().iter().map(|s| s.stats().medium_errors).sum();
        if medium > 0 {
            met.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        moved.fetch_add(
            stats(&arr).moved_reads as usize,
            std::sync::atomic::Ordering::Relaxed,
        );
    });
    // Foreign reads that met a bad sector went to the owner, which rewrote it.
    assert!(
        moved.into_inner() > 0,
        "no foreign read met a latent sector error"
    );
    // Writes heal bad sectors before some runs read them; most runs must still meet them.
    let met = met.into_inner();
    eprintln!("{met} of {n} runs met latent sector errors");
    assert!(
        met * 2 >= n,
        "only {met} of {n} runs met a latent sector error"
    );
}
