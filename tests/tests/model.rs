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
//! The crash phase (issue 17: torn writes at a crash, then the bitmap resync) runs the
//! same kind of workload — half small sequential writes, so passes batch, hold and hit the
//! stripe cache, plus random overlapping writes, write-zeroes, discards, FUA and flushes,
//! at queue depth 16–32 — on RAID5 and RAID6 with a write-intent bitmap, 1, 2 and 4
//! reactors, members of unequal speed. Idle gaps let the bitmap daemon clear every bit, the
//! last one shortly before the crash. Then torn writes are armed on some members and the
//! array is dropped, without a shutdown, in the loop turn where the first torn member
//! write reaches the media: member writes that completed are on the media, torn ones in
//! part, the rest not at all, and nothing completed in that turn counts as acknowledged.
//! The model keeps, per 512-byte block, the versions it may hold: the last acknowledged
//! write over it, and every later write over it in flight at the crash. Checked at each
//! crash: batched passes were issued while the torn writes were armed; every member data
//! write in flight or torn has its regions set in every member's bitmap (md's rule: the
//! bit is durable before the write goes out); every stripe left inconsistent lies in the
//! dirty regions. The restart builds a new array on the same member images with the
//! bitmap read back from one member (`NeedsSync::OnDisk`, as `ferroraid serve` does after
//! an unclean shutdown) and resyncs its dirty regions; half the time another crash
//! interrupts that resync (tearing one member's writes), and the restart after it must
//! find those regions still dirty. Once a resync finished: every block reads back one of its
//! versions (acknowledged writes exactly), parity is consistent on every stripe, the oracle
//! verifies the member images, the daemon clears every bit, and with as many members
//! failed as the redundancy allows the array reads back the same bytes. Each run crashes
//! four times, each restart continuing from what the last one left.
//!
//! The simulated world, the workload up to the crash and the version model are shared
//! with the write-hole test (`ferroraid_tests::crash`).
//!
//! Half the seeds give some members a volatile write cache (`CrashCase::volatile`): each
//! crash (the one that interrupts a resync too) loses any member writes no flush or FUA
//! made durable, and a client write acknowledged without FUA and not covered by a later
//! client flush may read back old or new. Then md's clearing rule matters too: a bit is
//! cleared on disk only after the writes of its region are durable.
//!
//! Not covered: a member missing at the restart (the write hole: a bitmap resync cannot
//! rebuild a torn stripe's lost chunk; `tests/write_hole.rs` shows it, and that md's
//! Partial Parity Log must close it), and member failures before the crash (the failure
//! would have to be recorded in the superblocks, which the engine alone does not write).
//!
//! `FERRORAID_MODEL_OPS` sets the operations per configuration (default 10000; a crash run
//! spreads them over its four crashes; below the default, which paths each configuration took
//! is checked over all configurations together, and not for one alone); `FERRORAID_SEED=N`
//! runs only the configuration with
//! seed N (printed on failure).

use std::sync::Arc;

use engine::array::{Array, ArrayConfig, ArrayOp, MemberState};
use engine::bitmap::{NeedsSync, WriteIntent};
use engine::buf::AlignedBuf;
use engine::device::{BlockDevice, IoError, Op};
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level, Role};
use engine::parity::Parity;
use engine::process::{ProcessKind, ProcessRequest, ProcessState};
use engine::shard::ShardedArray;
use engine::sim::{
    Fault, FaultRule, IoEventKind, OpFilter, Profile, SimChannel, SimClock, SimDevice,
};
use engine::zero_map::ZeroMap;
use ferroraid_tests::crash::{
    completions_checked, crash_cases, each_case, idle_until, inconsistent_stripes, issue,
    issue_flush, next_event, overlaps, read_whole, run_process, run_to_crash, stats, CrashCase,
    CrashWorld, Crashed, Outcome, Pending, CRASH_BITMAP_START, CRASH_DAEMON_SLEEP_S,
    CRASH_DATA_OFFSET, SEC,
};
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

/// What each 512-byte block of the array may read as while writes over it are in flight.
/// Reads may overlap writes in flight (issue 24: a read of a stripe a write holds is served
/// from the write's data once that data is final); each block of a read must then hold a
/// value some write (or the initial contents) gave it, no older than the newest write over
/// it that completed before the read was issued: never stale, never invented, never part
/// of a block. Without such writes that is exactly the reference.
struct BlockHistory {
    /// Per block: (tag of the write, hash of the 512 bytes it wrote), ascending tags; tag 0
    /// is the initial contents.
    values: Vec<Vec<(u64, u64)>>,
    /// Per block: the tag of the newest completed write over it.
    floor: Vec<u64>,
    /// Per read in flight (tag): its first block and the floors of its blocks at issue.
    reads: std::collections::HashMap<u64, (usize, Vec<u64>)>,
    /// Per write in flight (tag): the blocks it changes.
    writes: std::collections::HashMap<u64, std::ops::Range<usize>>,
    /// Reads issued over a block a write in flight changes.
    overlapping_reads: u64,
}

fn block_hash(b: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    b.hash(&mut h);
    h.finish()
}

impl BlockHistory {
    fn new(initial: &[u8]) -> Self {
        Self {
            values: initial
                .chunks(512)
                .map(|b| vec![(0, block_hash(b))])
                .collect(),
            floor: vec![0; initial.len() / 512],
            reads: Default::default(),
            writes: Default::default(),
            overlapping_reads: 0,
        }
    }

    /// Write `tag` changes `blocks`, to what `reference` (already updated) holds there.
    fn write_issued(&mut self, tag: u64, blocks: std::ops::Range<usize>, reference: &[u8]) {
        for b in blocks.clone() {
            self.values[b].push((tag, block_hash(&reference[b * 512..(b + 1) * 512])));
        }
        self.writes.insert(tag, blocks);
    }

    fn read_issued(&mut self, tag: u64, blocks: std::ops::Range<usize>) {
        if self
            .writes
            .values()
            .any(|w| w.start < blocks.end && blocks.start < w.end)
        {
            self.overlapping_reads += 1;
        }
        self.reads
            .insert(tag, (blocks.start, self.floor[blocks].to_vec()));
    }

    fn write_done(&mut self, tag: u64) {
        if let Some(blocks) = self.writes.remove(&tag) {
            for b in blocks {
                self.floor[b] = self.floor[b].max(tag);
            }
        }
    }

    /// Whether block `b` may hold the value hashing to `h` for an observer whose floor
    /// (newest write over `b` completed before it looked) is `floor`.
    fn may_hold(&self, b: usize, floor: u64, h: u64) -> bool {
        self.values[b]
            .iter()
            .rev()
            .take_while(|&&(t, _)| t >= floor)
            .any(|&(_, v)| v == h)
    }

    /// Block status may call blocks `blocks` zeroes now (the zero map has their stripe):
    /// zeroes must be a value some write (or the initial contents) gave each of them since
    /// the newest write over it that has completed — exactly what a read issued and
    /// answered at this instant may return.
    fn check_zero_claim(&self, blocks: std::ops::Range<usize>, zero_hash: u64, ctx: &str) {
        for b in blocks {
            let floor = self.floor[b];
            assert!(
                self.may_hold(b, floor, zero_hash),
                "{ctx}: block status calls the block at array offset {} zeroes, but no \
                 write since write {floor} (the newest completed) zeroed it",
                b * 512
            );
        }
    }

    fn check_read(&mut self, f: &Pending, ctx: &str) {
        let (first, floors) = self.reads.remove(&f.tag).expect("read issued");
        for (i, (blk, &floor)) in f.buf.chunks(512).zip(&floors).enumerate() {
            let b = first + i;
            assert!(
                self.may_hold(b, floor, block_hash(blk)),
                "{ctx}: read {} ({}+{}) block at array offset {} holds no value a write \
                 gave it since write {floor} (the newest completed at its issue); writes \
                 over it since: {:?}",
                f.tag,
                f.off,
                f.len,
                b * 512,
                self.values[b]
                    .iter()
                    .filter(|&&(t, _)| t >= floor)
                    .map(|&(t, _)| t)
                    .collect::<Vec<_>>()
            );
        }
    }
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
    // The simulated members start zero-filled and unallocated: every stripe starts zero
    // in the zero map (block status), and each write must clear its stripes.
    let zero_map = Arc::new(ZeroMap::from_allocation(
        &geo,
        data_offset,
        &vec![Some(Vec::new()); devs.len()],
    ));
    assert_eq!(zero_map.zero_stripes(), geo.stripes());
    // One shard per reactor, each with its own channel to every member.
    let shards = (0..c.reactors)
        .map(|_| {
            let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
            let mut a = Array::new(geo, chans, Parity::new(), cfg).unwrap();
            a.set_zero_map(Arc::clone(&zero_map));
            a
        })
        .collect();
    let mut arr = ShardedArray::new(shards, 16);
    let cap = geo.capacity_bytes();
    let mut reference = vec![0u8; cap as usize];
    let mut history = BlockHistory::new(&reference);
    let zero_hash = block_hash(&[0u8; 512]);
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
    let mut inflight: Vec<Pending> = Vec::new();
    // The sequential stream's next offset.
    let mut cursor = 0u64;
    let mut issued = 0usize;
    let mut completed = 0usize;
    let mut next_tag = 1u64;
    let ctx = |c: &Case| {
        format!(
            "{} {} members={} chunk={} reactors={} failures={:?} seed={} (replay: FERRORAID_SEED={})",
            c.level, c.layout, c.members, c.chunk, c.reactors, c.failures, c.seed, c.seed
        )
    };
    let name = ctx(c);
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
                issue_flush(&mut arr, &mut inflight, tag);
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
            // Writes never overlap in-flight reads. Reads may overlap writes in flight
            // (checked by `history`: old or new per block, never older than what completed
            // before them). Writes may overlap writes: the array must apply them in
            // submission order.
            let clash = write
                && inflight
                    .iter()
                    .any(|f| !f.write && overlaps((f.off, f.len), (off, len)));
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
            let blocks = (off / 512) as usize..((off + len) / 512) as usize;
            match op {
                ArrayOp::Read => history.read_issued(tag, blocks),
                ArrayOp::Discard => {
                    let first = off.div_ceil(stripe_bytes) * stripe_bytes;
                    let last = (off + len) / stripe_bytes * stripe_bytes;
                    let zeroed = (first / 512) as usize..(last.max(first) / 512) as usize;
                    history.write_issued(tag, zeroed, &reference);
                }
                _ => history.write_issued(tag, blocks, &reference),
            }
            // SAFETY: the buffer lives in `inflight` until its completion is handled and is
            // not touched meanwhile.
            unsafe { issue(&mut arr, &mut inflight, tag, op, off, buf, None) };
            issued += 1;
        }
        arr.set_now(clock.now_ns());
        let progressed = arr.process();
        let done = completions_checked(&mut arr, &mut inflight, &name, |f| {
            history.check_read(f, &name)
        });
        for f in &done {
            if f.write {
                history.write_done(f.tag);
            }
        }
        // Block status at this instant: every stripe the zero map calls zeroes.
        let blocks_per_stripe = (stripe_bytes / 512) as usize;
        for s in (0..geo.stripes()).filter(|&s| zero_map.is_zero(s)) {
            let first = s as usize * blocks_per_stripe;
            history.check_zero_claim(first..first + blocks_per_stripe, zero_hash, &name);
        }
        let n = done.len();
        completed += n;
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
    let whole = read_whole(&mut arr, &clock, &ctx(c));
    assert!(
        whole[..] == reference[..],
        "{}: final read-back differs",
        ctx(c)
    );
    (arr, devs, reference)
}

/// Recomputes every stripe's parity from the member images (no member may be missing).
/// `ctx` names the run.
fn assert_parity_consistent(
    g: &Geometry,
    stripes: u64,
    devs: &[SimDevice],
    data_offset: usize,
    ctx: &str,
) {
    let bad = inconsistent_stripes(g, stripes, devs, data_offset);
    if let Some(&(s, what)) = bad.first() {
        panic!(
            "{ctx}: stripe {s}: {what} inconsistent ({} stripes in all)",
            bad.len()
        );
    }
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

/// Operations per configuration when `FERRORAID_MODEL_OPS` is not set.
const DEFAULT_OPS: usize = 10_000;

fn ops() -> usize {
    std::env::var("FERRORAID_MODEL_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_OPS)
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

/// Hands the member images (data area only) to the oracle's `verify` (nothing to do
/// without the oracle: [`Oracle::locate_or_skip`] said so once).
fn oracle_verify(
    oracle: Option<&Oracle>,
    g: &Geometry,
    seed: u64,
    devs: &[SimDevice],
    data_offset: usize,
) {
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
        g.level().md_level().to_string(),
        "--layout".into(),
        g.layout().name().into(),
        "--chunk".into(),
        g.chunk_bytes().to_string(),
    ]);
    let out = oracle
        .run_ok(&args)
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    assert!(out.contains("mismatches 0"), "seed {seed}: {out}");
}

#[test]
fn healthy_arrays_match_reference_and_pass_the_oracle() {
    let held = std::sync::atomic::AtomicU64::new(0);
    let hits = std::sync::atomic::AtomicU64::new(0);
    let pass_reads = std::sync::atomic::AtomicU64::new(0);
    let gathered = std::sync::atomic::AtomicU64::new(0);
    let covered: [std::sync::atomic::AtomicU64; 6] = Default::default();
    let rmw = std::sync::atomic::AtomicU64::new(0);
    let per_case = ops() >= DEFAULT_OPS;
    let oracle = Oracle::locate_or_skip("healthy_arrays_match_reference_and_pass_the_oracle");
    each_case(cases(Failures::None), |c| {
        let (arr, devs, _) = run(c);
        assert!(failed_members(&arr).is_empty());
        assert_parity_consistent(
            arr.geometry().geometry(),
            c.stripes,
            &devs,
            8192,
            &format!("seed {}", c.seed),
        );
        oracle_verify(
            oracle.as_ref(),
            arr.geometry().geometry(),
            c.seed,
            &devs,
            8192,
        );
        let st = stats(&arr);
        // Which paths the run took. A reduced run (`FERRORAID_MODEL_OPS` below the
        // default) may miss one in some configuration — a few hundred operations need not
        // zero or discard a whole stripe — so there the paths are required of the cases
        // together (below), and of each case only at the default length.
        for (sum, n) in covered.iter().zip([
            st.full_stripe_writes,
            st.rcw_writes,
            st.direct_reads,
            st.zeroed_stripes,
            st.discarded_stripes,
            st.discards_skipped,
        ]) {
            sum.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
        let g = arr.geometry().geometry();
        if g.data_chunks() > g.parity_chunks() + 2 {
            rmw.fetch_add(st.rmw_writes, std::sync::atomic::Ordering::Relaxed);
        }
        if per_case {
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
            if g.data_chunks() > g.parity_chunks() + 2 {
                assert!(
                    st.rmw_writes > 0,
                    "seed {}: RMW should win small writes here: {st:?}",
                    c.seed
                );
            }
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
        pass_reads.fetch_add(st.pass_reads, std::sync::atomic::Ordering::Relaxed);
        gathered.fetch_add(st.gathered_writes, std::sync::atomic::Ordering::Relaxed);
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
    let pass_reads = pass_reads.into_inner();
    let gathered = gathered.into_inner();
    eprintln!(
        "passes held: {held}, passes that found their stripe cached: {hits}, reads served \
         from a write holding their stripe: {pass_reads}, chunks written gathered: {gathered}"
    );
    assert!(
        held > 0 && hits > 0 && pass_reads > 0 && gathered > 0,
        "held {held}, cache hits {hits}, reads from writes {pass_reads}, gathered {gathered}"
    );
    let covered = covered.map(|a| a.into_inner());
    let names = [
        "full-stripe writes",
        "RCW writes",
        "direct reads",
        "zeroed stripes",
        "discarded stripes",
        "skipped discards",
    ];
    if std::env::var("FERRORAID_SEED").is_err() {
        // Every configuration ran (one alone, reduced, is checked for its data only).
        for (n, name) in covered.iter().zip(names) {
            assert!(*n > 0, "no configuration took a path: {name}");
        }
        assert!(rmw.into_inner() > 0, "no wide configuration wrote by RMW");
    }
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

// ---- the crash phase: torn writes at a crash, then the bitmap resync -------------------

/// What the crash runs saw, for the totals (summed over crashes).
#[derive(Debug, Default)]
struct CrashReport {
    crashes: u64,
    /// Stats of the arrays at their crash.
    passes: u64,
    batched: u64,
    held: u64,
    cache_hits: u64,
    /// Data chunks written gathered from several writes' buffers.
    gathered: u64,
    /// Passes issued between the arming of the torn writes and the crash (only their
    /// member writes can tear), and the writes they served.
    window_passes: u64,
    window_batched: u64,
    /// Client writes (and write-zeroes, discards) in flight at the crash.
    writes_in_flight: u64,
    /// Of those, writes that shared a stripe with another in-flight write.
    writes_sharing_a_stripe: u64,
    /// Member data writes submitted and not completed at the crash (lost), and those that
    /// completed torn.
    member_writes_lost: u64,
    member_writes_torn: u64,
    /// Stripes whose parity was inconsistent after the crash; stripes dirty in the
    /// bitmap read back; stripes of the array.
    inconsistent: u64,
    dirty_stripes: u64,
    stripes: u64,
    /// The final resyncs' `mismatch_cnt` (sectors; an interrupted one's is not counted).
    mismatch_cnt: u64,
    /// Resyncs a crash interrupted (each followed by a restart and a whole resync), and
    /// of those, the ones the crash found still running.
    resyncs_interrupted: u64,
    resyncs_cut: u64,
    /// Blocks a write in flight (or acknowledged, not durable) covered, read back old or
    /// new.
    blocks_old: u64,
    blocks_new: u64,
    /// Crashes with volatile member caches; member writes they lost (whole or torn) and
    /// left.
    volatile_crashes: u64,
    volatile_lost: u64,
    volatile_kept: u64,
}

impl CrashReport {
    fn add(&mut self, o: &CrashReport) {
        self.crashes += o.crashes;
        self.passes += o.passes;
        self.batched += o.batched;
        self.held += o.held;
        self.cache_hits += o.cache_hits;
        self.gathered += o.gathered;
        self.window_passes += o.window_passes;
        self.window_batched += o.window_batched;
        self.writes_in_flight += o.writes_in_flight;
        self.writes_sharing_a_stripe += o.writes_sharing_a_stripe;
        self.member_writes_lost += o.member_writes_lost;
        self.member_writes_torn += o.member_writes_torn;
        self.inconsistent += o.inconsistent;
        self.dirty_stripes += o.dirty_stripes;
        self.stripes += o.stripes;
        self.mismatch_cnt += o.mismatch_cnt;
        self.resyncs_interrupted += o.resyncs_interrupted;
        self.resyncs_cut += o.resyncs_cut;
        self.blocks_old += o.blocks_old;
        self.blocks_new += o.blocks_new;
        self.volatile_crashes += o.volatile_crashes;
        self.volatile_lost += o.volatile_lost;
        self.volatile_kept += o.volatile_kept;
    }
}

/// Crashes per run: each starts from the member images the previous one left (after its
/// resync), as a clean restart.
const CRASHES_PER_RUN: usize = 4;

/// A crash run: [`CRASHES_PER_RUN`] times, the workload on a bitmap array (assembled
/// clean from the member images) until a random point, torn writes armed on some
/// members, the crash at the first torn member write, the restart from the member images
/// (the bitmap read back from one member decides what the resync covers), the resync and
/// the checks. Panics with the seed on any loss.
fn run_crash(c: &CrashCase, oracle: Option<&Oracle>) -> CrashReport {
    let w = CrashWorld::new(c, oracle);
    let mut rep = CrashReport::default();
    // What the array holds (all zeroes as created; after each crash, what was read back).
    let mut base = vec![0u8; w.geo.capacity_bytes() as usize];
    for crash in 0..CRASHES_PER_RUN {
        base = crash_once(&w, crash, base, &mut rep);
    }
    rep
}

/// One crash of a run, starting from the members as the last one left them, whose
/// array holds `base`; returns what it holds after the crash and the resync.
fn crash_once(w: &CrashWorld, crash: usize, base: Vec<u8>, rep: &mut CrashReport) -> Vec<u8> {
    let (c, g, geo, clock, devs) = (w.c, &w.g, w.geo, &w.clock, &w.devs[..]);
    let ctx = format!("{} crash {crash}", w.ctx);
    let data_bytes = c.stripes * c.chunk;
    // A clean start: the bitmap on disk is clear, nothing needs a resync.
    let start = w.bitmap(0);
    assert_eq!(start.dirty_count(), 0, "{ctx}: a clean start");
    let intent =
        Arc::new(WriteIntent::new(&start, CRASH_BITMAP_START, &geo, NeedsSync::None).unwrap());
    let arr = w.array([None; 2], |k, a| {
        a.attach_bitmap(Arc::clone(&intent), k == 0)
    });
    let cap = geo.capacity_bytes();
    let stripe_bytes = g.stripe_data_bytes();
    let mut rng = Rng::new(c.seed ^ (0x5eed << crash));
    let ops = (c.ops / CRASHES_PER_RUN).max(4 * c.depth);
    let Crashed {
        stats: st,
        at_arming,
        volatile,
        pending: inflight,
        versions,
        log,
    } = run_to_crash(w, &ctx, arr, Some(&intent), &mut rng, ops, base);
    // ---- crashed: no clean shutdown, the member images are what they are.
    assert!(
        st.write_passes > 0 && st.batched_writes > st.write_passes,
        "{ctx}: the crash must come after batched passes: {st:?}"
    );
    rep.crashes += 1;
    rep.volatile_crashes += u64::from(c.volatile);
    rep.volatile_lost += volatile.lost + volatile.torn;
    rep.volatile_kept += volatile.kept;
    rep.window_passes += st.write_passes - at_arming.write_passes;
    rep.window_batched += st.batched_writes - at_arming.batched_writes;
    rep.passes += st.write_passes;
    rep.batched += st.batched_writes;
    rep.held += st.held_passes;
    rep.cache_hits += st.cache_hit_stripes;
    rep.gathered += st.gathered_writes;
    rep.stripes += c.stripes;
    let in_flight_writes: Vec<&Pending> = inflight.iter().filter(|f| f.version.is_some()).collect();
    rep.writes_in_flight += in_flight_writes.len() as u64;
    let stripes_of = |x: &Pending| (x.off / stripe_bytes, (x.off + x.len - 1) / stripe_bytes);
    rep.writes_sharing_a_stripe += in_flight_writes
        .iter()
        .filter(|f| {
            let (a, b) = stripes_of(f);
            in_flight_writes.iter().any(|o| {
                let (x, y) = stripes_of(o);
                o.tag != f.tag && x <= b && a <= y
            })
        })
        .count() as u64;
    // Member data writes in flight at the crash (never completed: lost) and torn.
    let mut open: std::collections::HashMap<(usize, u64, u32), i64> = Default::default();
    let mut torn = Vec::new();
    for e in log.events() {
        if e.offset_bytes < CRASH_DATA_OFFSET
            || !matches!(e.op, Op::Write { .. } | Op::WriteZeroes | Op::Discard)
        {
            continue;
        }
        let key = (e.device, e.offset_bytes, e.len_bytes);
        match e.kind {
            IoEventKind::Submit => *open.entry(key).or_default() += 1,
            IoEventKind::Complete => {
                *open.entry(key).or_default() -= 1;
                if !e.ok {
                    torn.push(key);
                }
            }
        }
    }
    let lost: Vec<(usize, u64, u32)> = open
        .iter()
        .filter(|&(_, &n)| n > 0)
        .map(|(&k, _)| k)
        .collect();
    rep.member_writes_lost += open.values().filter(|&&n| n > 0).sum::<i64>() as u64;
    rep.member_writes_torn += torn.len() as u64;
    assert!(!torn.is_empty(), "{ctx}: the crash tears a write");
    // md's rule 1: every member data write issued (and not known complete) had its
    // regions' bits durable on every member.
    let bm_chunk = u64::from(c.bm_chunk);
    for d in 0..devs.len() {
        let b = w.bitmap(d);
        for &(m, off, len) in lost.iter().chain(&torn) {
            let at = off - CRASH_DATA_OFFSET;
            for r in at / bm_chunk..=(at + u64::from(len) - 1) / bm_chunk {
                assert!(
                    b.is_set(r),
                    "{ctx}: member {m} had a write at {off}+{len} in flight at the crash, but \
                     region {r} is clear in member {d}'s bitmap"
                );
            }
        }
    }
    // ---- the restart: the bitmap as read back from one member decides the resync. Half
    // the time another crash interrupts that resync (tearing a write of one member, if it
    // writes there): the restart after it must find every region still dirty.
    let bad = inconsistent_stripes(g, c.stripes, devs, CRASH_DATA_OFFSET as usize);
    rep.inconsistent += bad.len() as u64;
    let mut interrupt = rng.below(2) == 0;
    let mut before: Option<Vec<std::ops::Range<u64>>> = None;
    // The members' bitmaps may differ after a crash (a batch of bits in flight reached
    // some of them), but only in regions no data write was issued to yet (checked above):
    // any member's will do. The same member after an interrupted resync (its bits are
    // compared with what it had).
    let src = ((c.seed + crash as u64) % u64::from(c.members)) as usize;
    let (intent, mut arr) = loop {
        let intent = Arc::new(
            WriteIntent::new(&w.bitmap(src), CRASH_BITMAP_START, &geo, NeedsSync::OnDisk).unwrap(),
        );
        let dirty = intent.dirty_regions();
        let dirty_stripes: u64 = dirty.iter().map(|r| r.end - r.start).sum();
        if let Some(before) = &before {
            for r in before {
                assert!(
                    dirty.iter().any(|d| d.start <= r.start && r.end <= d.end),
                    "{ctx}: the resync interrupted by a crash lost dirty stripes {r:?}: \
                     {dirty:?} after it"
                );
            }
        } else {
            rep.dirty_stripes += dirty_stripes;
        }
        for &(s, what) in &bad {
            assert!(
                dirty.iter().any(|r| r.contains(&s)),
                "{ctx}: stripe {s}'s {what} is inconsistent after the crash but outside the \
                 bitmap's dirty stripes {dirty:?}"
            );
        }
        let mut arr = w.array([None; 2], |k, a| {
            a.attach_bitmap(Arc::clone(&intent), k == 0)
        });
        if dirty.is_empty() {
            break (intent, arr);
        }
        arr.start_process(&ProcessRequest {
            kind: ProcessKind::Resync,
            ranges: Some(dirty.clone()),
            resume_stripe: 0,
        })
        .unwrap();
        if !interrupt {
            run_process(&mut arr, clock, &ctx);
            let p = arr.process_snapshot().unwrap();
            assert_eq!(p.state, ProcessState::Finished, "{ctx}");
            assert_eq!(p.total_stripes, dirty_stripes, "{ctx}");
            rep.mismatch_cnt += p.mismatch_cnt;
            break (intent, arr);
        }
        interrupt = false;
        rep.resyncs_interrupted += 1;
        let m = rng.below(u64::from(c.members)) as usize;
        devs[m].add_fault(FaultRule {
            filter: OpFilter::Write,
            range: Some(CRASH_DATA_OFFSET..CRASH_DATA_OFFSET + data_bytes),
            fault: Fault::Torn {
                blocks: rng.below(c.chunk / 512) as u32,
            },
            probability: 1.0,
            count: None,
        });
        let failed_before: u64 = devs.iter().map(|d| d.stats().failed).sum();
        for _ in 0..1 + rng.below(4 * dirty_stripes) {
            if !arr.process_active() {
                break;
            }
            arr.set_now(clock.now_ns());
            if !arr.process() {
                let t = next_event(&arr).expect("pending I/O");
                clock.advance_to(t.max(clock.now_ns()));
            }
            if devs.iter().map(|d| d.stats().failed).sum::<u64>() > failed_before {
                break;
            }
        }
        rep.resyncs_cut += u64::from(arr.process_active());
        drop(arr);
        devs[m].clear_faults();
        // The power cut takes the members' volatile caches with it (the resync's writes
        // are not flushed yet).
        let lost = w.lose_volatile(&mut rng);
        rep.volatile_lost += lost.lost + lost.torn;
        before = Some(dirty);
    };
    // As the target does once the resync finished: the regions are in sync.
    intent.sync_done(0..c.stripes);
    // Every block holds a version it may hold: acknowledged writes whole, writes in
    // flight at the crash old or new block by block.
    let whole = read_whole(&mut arr, clock, &ctx);
    for b in 0..(cap / 512) as usize {
        match versions.judge(b, &whole[b * 512..(b + 1) * 512]) {
            Ok(Outcome::Definite) => {}
            Ok(Outcome::Old) => rep.blocks_old += 1,
            Ok(Outcome::New) => rep.blocks_new += 1,
            Err(e) => panic!("{ctx}: {e}"),
        }
    }
    assert_parity_consistent(g, c.stripes, devs, CRASH_DATA_OFFSET as usize, &ctx);
    oracle_verify(w.oracle, g, c.seed, devs, CRASH_DATA_OFFSET as usize);
    // Idle, the daemon clears the regions the resync covered, on every member.
    let t = clock.now_ns() + 4 * u64::from(CRASH_DAEMON_SLEEP_S) * SEC;
    idle_until(&mut arr, clock, t);
    for d in 0..devs.len() {
        assert_eq!(
            w.bitmap(d).dirty_count(),
            0,
            "{ctx}: member {d}'s bitmap after the resync"
        );
    }
    // Then members fail (as many as the redundancy): reads rebuilt from the parity the
    // resync left return the same bytes. (Reads only: the member images stay as they are
    // for the next crash, which assembles every member again.)
    for i in 0..g.parity_chunks() {
        arr.fail_member((src as u16 + 2 * i) % c.members, IoError::Gone);
    }
    let degraded = read_whole(&mut arr, clock, &ctx);
    if let Some(at) = degraded.iter().zip(whole.iter()).position(|(a, b)| a != b) {
        panic!("{ctx}: degraded read-back differs at array offset {at}");
    }
    whole.to_vec()
}

/// Issue 17's crash phase: batched, held and cached write passes (small sequential writes
/// at queue depth 16–32, random overlapping writes, write-zeroes, discards, FUA, flushes)
/// on a bitmap array crash with member writes in flight and some torn; after the restart
/// the bitmap read back from a member drives the resync, and every block holds what it
/// may, parity is consistent everywhere (the oracle agrees), the bits clear, and reads
/// with members failed return the same bytes.
#[test]
fn a_crash_with_torn_pass_writes_is_made_whole_by_the_bitmap_resync() {
    let oracle =
        Oracle::locate_or_skip("a_crash_with_torn_pass_writes_is_made_whole_by_the_bitmap_resync");
    let all = crash_cases(5000, 6, ops());
    let n = all.len();
    let total = std::sync::Mutex::new(CrashReport::default());
    each_case(all, |c| {
        let r = run_crash(c, oracle.as_ref());
        total.lock().unwrap().add(&r);
    });
    let t = total.into_inner().unwrap();
    eprintln!(
        "{n} runs, {} crashes. At the crashes {} writes had taken the pass path in {} passes \
         ({} held, {} found their stripe cached, {} chunks written gathered); between the arming of torn writes and the \
         crash {} passes served {} writes; {} client writes were in flight ({} sharing a \
         stripe with another), {} member writes lost and {} torn; {} stripes inconsistent, \
         {} of {} stripes dirty in the bitmap; {} resyncs interrupted by another crash ({} \
         still running); the final resyncs found {} mismatched sectors; blocks under writes \
         in flight or not durable read back old {} times, new {} times; {} crashes with \
         volatile member caches lost {} member writes (whole or torn) and left {}",
        t.crashes,
        t.batched,
        t.passes,
        t.held,
        t.cache_hits,
        t.gathered,
        t.window_passes,
        t.window_batched,
        t.writes_in_flight,
        t.writes_sharing_a_stripe,
        t.member_writes_lost,
        t.member_writes_torn,
        t.inconsistent,
        t.dirty_stripes,
        t.stripes,
        t.resyncs_interrupted,
        t.resyncs_cut,
        t.mismatch_cnt,
        t.blocks_old,
        t.blocks_new,
        t.volatile_crashes,
        t.volatile_lost,
        t.volatile_kept
    );
    if n > 1 {
        // Batched passes were issued in the crash windows (their member writes are the
        // ones that tore), and writes of one stripe were in flight together.
        assert!(t.window_batched > t.window_passes, "{t:?}");
        assert!(t.writes_sharing_a_stripe > 0, "{t:?}");
        // Some of those passes wrote chunks gathered from the writes' buffers.
        assert!(t.gathered > 0, "{t:?}");
        // The crashes left work for the resync, and the bitmap spared it some.
        assert!(t.inconsistent > 0 && t.mismatch_cnt > 0, "{t:?}");
        assert!(t.dirty_stripes < t.stripes, "{t:?}");
        assert!(t.blocks_old > 0 && t.blocks_new > 0, "{t:?}");
        assert!(t.resyncs_cut > 0, "{t:?}");
        // Volatile caches lost writes at some crashes.
        assert!(t.volatile_crashes > 0 && t.volatile_lost > 0, "{t:?}");
    }
}

/// Compare-and-write races (issue 20): rounds of two to four compare-and-writes of one
/// range (one to eight blocks inside one stripe), each expecting the range's current
/// contents and bringing its own new data, submitted together to a sharded array (2 and 4
/// reactors; the pieces go to the stripe's owner, as every reactor routes them), with a
/// plain write elsewhere in the same stripe and a read of the range racing them. Exactly
/// one wins each round — the first submitted, since the owner runs a stripe's writes in
/// order and holds the stripe from the compare's read through its write — the others
/// complete with a miscompare at the first byte where the winner's data differs from what
/// they expected; the racing read sees the old data or the winner's, never a loser's; the
/// range reads back the winner's data. Half the configurations lose a member a quarter of
/// the way in (reads rebuild from parity). The whole array equals the reference at the
/// end.
#[test]
fn compare_and_write_races_have_exactly_one_winner() {
    use engine::array::{ArrayCompletion, ArrayError, ArrayRequest};
    use engine::device::IoBuf;
    use std::collections::HashMap;
    use std::ptr::NonNull;

    for (reactors, degraded, seed) in [
        (2usize, false, 11u64),
        (4, false, 12),
        (2, true, 13),
        (4, true, 14),
    ] {
        let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 5, 4096, 512).unwrap();
        let geo = ArrayGeometry::new(g, 32).unwrap();
        let clock = SimClock::new();
        let devs: Vec<SimDevice> = (0..5)
            .map(|i| {
                SimDevice::new(
                    &format!("caw{i}"),
                    32 * 4096,
                    512,
                    Profile::nvme_ssd(),
                    clock.clone(),
                    seed ^ i,
                )
                .unwrap()
            })
            .collect();
        let cfg = ArrayConfig {
            requests: 16,
            stripe_ops: 8,
            ..ArrayConfig::default()
        };
        let shards = (0..reactors)
            .map(|_| {
                let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
                Array::new(geo, chans, Parity::new(), cfg).unwrap()
            })
            .collect();
        let mut arr = ShardedArray::new(shards, 16);
        let ctx = format!("reactors={reactors} degraded={degraded} seed={seed}");
        let stripe = g.stripe_data_bytes();
        let cap = geo.capacity_bytes();
        let mut reference = vec![0u8; cap as usize];
        let mut rng = Rng::new(seed);
        let submit = |arr: &mut ShardedArray<SimChannel>,
                      tag,
                      op,
                      off: u64,
                      len: u64,
                      buf: &mut AlignedBuf| {
            // SAFETY: every buffer lives until the round's completions are all polled.
            let io = unsafe {
                IoBuf::from_raw(
                    NonNull::new(buf.as_mut_ptr()).unwrap(),
                    buf.len() as u32,
                    None,
                )
            };
            arr.submit(ArrayRequest {
                tag,
                op,
                offset_bytes: off,
                len_bytes: len as u32,
                buf: io,
            })
            .unwrap();
        };
        let mut tag = 1u64;
        let mut wins = 0;
        for round in 0..200 {
            if degraded && round == 50 {
                devs[(seed % 5) as usize].disappear();
            }
            // The contested range, inside one stripe.
            let blocks = 1 + rng.below(8);
            let st = rng.below(geo.stripes());
            let within = 512 * rng.below(stripe / 512 - blocks + 1);
            let (off, len) = (st * stripe + within, blocks * 512);
            let old = reference[off as usize..(off + len) as usize].to_vec();
            // (tag, op, offset, length, buffer), in submission order.
            let mut bufs: Vec<(u64, ArrayOp, u64, u64, AlignedBuf)> = Vec::new();
            // A plain write elsewhere in the stripe (or nowhere, when the range fills it).
            if within >= 512 {
                let mut w = AlignedBuf::zeroed(512);
                rng.fill(&mut w);
                let at = st * stripe + 512 * rng.below(within / 512);
                reference[at as usize..at as usize + 512].copy_from_slice(&w);
                bufs.push((tag, ArrayOp::Write { fua: false }, at, 512, w));
                tag += 1;
            }
            let racers = 2 + rng.below(3) as usize;
            let first_caw = bufs.len();
            for _ in 0..racers {
                let mut b = AlignedBuf::zeroed(2 * len as usize);
                b[..len as usize].copy_from_slice(&old);
                rng.fill(&mut b[len as usize..]);
                let fua = rng.below(4) == 0;
                bufs.push((tag, ArrayOp::CompareAndWrite { fua }, off, len, b));
                tag += 1;
            }
            bufs.push((
                tag,
                ArrayOp::Read,
                off,
                len,
                AlignedBuf::zeroed(len as usize),
            ));
            tag += 1;
            for (t, op, at, l, b) in &mut bufs {
                submit(&mut arr, *t, *op, *at, *l, b);
            }
            // Drive until the round is done.
            let mut status: HashMap<u64, Result<(), ArrayError>> = HashMap::new();
            let mut out = [ArrayCompletion {
                tag: 0,
                status: Ok(()),
            }; 16];
            while status.len() < bufs.len() {
                arr.set_now(clock.now_ns());
                let progressed = arr.process();
                let n = arr.poll(&mut out);
                for c in &out[..n] {
                    status.insert(c.tag, c.status);
                }
                if !progressed && n == 0 {
                    let t = next_event(&arr).unwrap_or_else(|| panic!("{ctx}: stalled"));
                    clock.advance_to(t.max(clock.now_ns()));
                }
            }
            let caws = &bufs[first_caw..first_caw + racers];
            let winners: Vec<usize> = caws
                .iter()
                .enumerate()
                .filter(|(_, (t, ..))| status[t].is_ok())
                .map(|(i, _)| i)
                .collect();
            assert_eq!(winners, vec![0], "{ctx} round {round}: {status:?}");
            wins += 1;
            let new = caws[0].4[len as usize..].to_vec();
            let first_diff = new.iter().zip(&old).position(|(a, b)| a != b);
            for (t, ..) in &caws[1..] {
                let expect = match first_diff {
                    Some(i) => Err(ArrayError::Miscompare { offset: i as u32 }),
                    None => Ok(()),
                };
                assert_eq!(status[t], expect, "{ctx} round {round}: loser {t}");
            }
            let (rt, .., read) = bufs.last().unwrap();
            assert_eq!(status[rt], Ok(()), "{ctx} round {round}: read");
            assert!(
                read[..] == old[..] || read[..] == new[..],
                "{ctx} round {round}: the racing read saw neither the old data nor the winner's"
            );
            reference[off as usize..(off + len) as usize].copy_from_slice(&new);
            // The range reads back the winner's data.
            let mut back = AlignedBuf::zeroed(len as usize);
            submit(&mut arr, tag, ArrayOp::Read, off, len, &mut back);
            let t = tag;
            tag += 1;
            loop {
                arr.set_now(clock.now_ns());
                let progressed = arr.process();
                let n = arr.poll(&mut out);
                if out[..n].iter().any(|c| c.tag == t && c.status == Ok(())) {
                    break;
                }
                if !progressed && n == 0 {
                    let t = next_event(&arr).unwrap_or_else(|| panic!("{ctx}: stalled"));
                    clock.advance_to(t.max(clock.now_ns()));
                }
            }
            assert!(
                back[..] == new[..],
                "{ctx} round {round}: read-back is not the winner's"
            );
        }
        assert_eq!(wins, 200);
        let whole = read_whole(&mut arr, &clock, &ctx);
        assert!(whole[..] == reference[..], "{ctx}: final read-back differs");
    }
}
