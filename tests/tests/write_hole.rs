//! The RAID write hole (issue 19), deterministic in the simulator.
//!
//! Each run drives the crash workload of the model test (`ferroraid_tests::crash`: small
//! sequential and random overlapping sub-stripe writes, write-zeroes, discards, FUA and
//! flushes at queue depth 16–32, on RAID5 or RAID6 over 1, 2 or 4 shards) until a seeded
//! request count, arms torn writes on some members and crashes in the loop turn where the
//! first torn member write reaches the media. Then one member (RAID5) or one or two
//! (RAID6) are removed, and the array restarts from the member images degraded and dirty,
//! with no resync (a degraded array cannot resync: the dirty-degraded start md refuses
//! without `--force`). Every block is read back and judged against the per-block version
//! model: a block that no write in flight at the crash covered ("untouched") must equal
//! the reference. With the bitmap policy it need not: a stripe the crash left with parity
//! that does not match its data rebuilds the missing member's untouched blocks from that
//! stale parity — the write hole. Blocks that a write in flight covered may hold their old
//! or new bytes, or (on a missing member whose write the crash cut) neither, with any
//! policy (md's PPL is not a journal); they are counted, not judged.
//!
//! Half the seeds give some members a volatile write cache (`CrashCase::volatile`): the
//! crash also loses any member writes no flush or FUA made durable (whole or some of their
//! blocks, in any order), and a client write acknowledged without FUA and not covered by a
//! later client flush counts as in flight. PPL must hold there too: that is where md's
//! rule that a log's next record waits until the previous record's writes are flushed,
//! and the RAID6 deferral rule (`engine/src/array/ppl.rs`), matter.
//!
//! Checked on every run, whatever the policy: untouched blocks on the members still
//! present read back exactly (they are read directly; only a missing member's blocks are
//! rebuilt), and, where the oracle is present, its reconstruction of the member images
//! with the same members missing equals what the engine read back (so the corruption
//! counted is the member images' own, not a degraded-read bug).
//!
//! [`Policy::Bitmap`] is the negative control: over the seeds the test must find corrupted
//! untouched blocks, proving the check can fail; it prints how many, per level and shard
//! count. [`Policy::Ppl`] runs the same seeds with the Partial Parity Log on — md's on
//! RAID5, ferroraid's two-log extension on RAID6 (docs/FORMAT.md) — and must find zero
//! (see [`start`], the one place the policy is attached).
//!
//! `FERRORAID_WRITE_HOLE_OPS` sets the requests per run (default 600),
//! `FERRORAID_WRITE_HOLE_SEEDS` the seeds per level and shard count (default 8);
//! `FERRORAID_SEED=N` runs only the configuration with seed N (printed on any failure).

use std::sync::{Arc, Mutex};

use engine::bitmap::{NeedsSync, WriteIntent};
use engine::geometry::Level;
use engine::metadata::ppl::signature;
use engine::metadata::Uuid;
use engine::ppl::{recover, reinit_areas, PplLayout, PplShared};
use engine::shard::ShardedArray;
use engine::sim::{SimChannel, SimMedia};
use ferroraid_tests::crash::{
    crash_cases, each_case, inconsistent_stripes, read_whole, run_to_crash, CrashCase, CrashWorld,
    Outcome, CRASH_BITMAP_START, CRASH_DATA_OFFSET, CRASH_PPL_BYTES, CRASH_PPL_START,
};
use ferroraid_tests::{Oracle, Rng};

/// How the array keeps its stripes consistent across a crash (md's
/// `--consistency-policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Policy {
    /// md's write-intent bitmap: after a crash a resync makes the dirty regions' parity
    /// consistent — which needs every member, so a member missing at the restart leaves
    /// the write hole open.
    Bitmap,
    /// The Partial Parity Log: every write logged on its stripe's parity member (RAID6:
    /// on both, partial P and partial Q) before it goes out; after a crash the newest
    /// record of every present member's log makes the stripes it describes consistent
    /// with their current data, rebuilding from the partial parity what a missing member
    /// held outside the write.
    Ppl,
}

/// Seeds are numbered from here (+1), [`seeds_per_config`] per level and shard count.
const FIRST_SEED: u64 = 19_000;

/// Seeds per level and shard count: `FERRORAID_WRITE_HOLE_SEEDS`, default 8 (48 runs per
/// policy, a few seconds; more for a longer hunt).
fn seeds_per_config() -> usize {
    std::env::var("FERRORAID_WRITE_HOLE_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8)
}

fn ops() -> usize {
    std::env::var("FERRORAID_WRITE_HOLE_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600)
}

/// Starts the array on `w`'s members with `missing` absent (listed failed at assembly),
/// under `policy`; `unclean`: after the crash (the bitmap's bits on disk are dirty). The
/// one place the consistency policy is attached: the PPL variant attaches its log here
/// (and runs its recovery at assembly, before the first request).
fn start(
    policy: Policy,
    w: &CrashWorld,
    missing: &[u16],
    unclean: bool,
) -> (ShardedArray<SimChannel>, Option<Arc<WriteIntent>>) {
    let mut failed = [None; 2];
    for (f, &m) in failed.iter_mut().zip(missing) {
        *f = Some(m);
    }
    match policy {
        Policy::Bitmap => {
            // The bitmap as a member still present holds it, as `ferroraid serve --force`
            // reads it after an unclean shutdown; nothing resyncs it here.
            let src = (0..w.c.members).find(|m| !missing.contains(m)).unwrap();
            let needs = if unclean {
                NeedsSync::OnDisk
            } else {
                NeedsSync::None
            };
            let intent = Arc::new(
                WriteIntent::new(
                    &w.bitmap(usize::from(src)),
                    CRASH_BITMAP_START,
                    &w.geo,
                    needs,
                )
                .unwrap(),
            );
            let arr = w.array(failed, |k, a| a.attach_bitmap(Arc::clone(&intent), k == 0));
            (arr, Some(intent))
        }
        Policy::Ppl => {
            // As `ferroraid serve` assembles a PPL array: recovery from the present
            // members' logs when it was not shut down cleanly, the areas re-initialised,
            // then the log attached to every shard.
            let layout = PplLayout {
                area_offset_bytes: CRASH_PPL_START,
                area_bytes: CRASH_PPL_BYTES,
                data_offset_bytes: CRASH_DATA_OFFSET,
            };
            let present: Vec<bool> = (0..w.c.members).map(|m| !missing.contains(&m)).collect();
            if unclean {
                let rep = recover(&w.geo, &layout, &PPL_UUID, &present, &mut SimMedia(&w.devs))
                    .unwrap_or_else(|e| panic!("{}: PPL recovery failed: {e}", w.ctx));
                assert!(
                    rep.clean(),
                    "{}: PPL recovery found mismatches: {rep:?}",
                    w.ctx
                );
                assert_eq!(rep.logs as usize, present.iter().filter(|&&p| p).count());
            }
            reinit_areas(&layout, &PPL_UUID, &present, &mut SimMedia(&w.devs))
                .unwrap_or_else(|e| panic!("{}: PPL areas not re-initialised: {e}", w.ctx));
            let shared = Arc::new(PplShared::new(
                usize::from(w.c.members),
                CRASH_PPL_START,
                CRASH_PPL_BYTES,
                signature(&PPL_UUID),
            ));
            let arr = w.array(failed, |_, a| a.attach_ppl(Arc::clone(&shared)));
            (arr, None)
        }
    }
}

/// The array UUID of the PPL policy's records (their signature).
const PPL_UUID: Uuid = Uuid([7; 16]);

/// What runs saw (summed over runs).
#[derive(Clone, Debug, Default)]
struct Count {
    runs: u64,
    /// Stripes whose parity did not match their data after the crash.
    inconsistent_stripes: u64,
    /// Blocks no write in flight at the crash covered, and of those the ones on a missing
    /// member (rebuilt from parity).
    untouched: u64,
    untouched_missing: u64,
    /// Untouched blocks that read back wrong (the write hole), and the runs with any.
    corrupted: u64,
    runs_corrupted: u64,
    /// Blocks a write in flight (or acknowledged, not durable) covered that read back old,
    /// new, or neither.
    old: u64,
    new: u64,
    neither: u64,
    /// Runs with volatile member caches, and the member writes their crashes lost (whole
    /// or torn).
    volatile_runs: u64,
    volatile_lost: u64,
}

/// One run of case `c` under `policy`: the workload to the crash, members removed, the
/// degraded restart without a resync, every block read back and judged. Panics with the
/// seed if an untouched block on a member still present is wrong, or if the engine's
/// read-back differs from the oracle's reconstruction.
fn run(c: &CrashCase, policy: Policy, oracle: Option<&Oracle>) -> Count {
    let w = CrashWorld::new(c, oracle);
    let ctx = format!("write hole, policy {policy:?}: {}", w.ctx);
    let (g, geo) = (&w.g, w.geo);
    let mut rng = Rng::new(c.seed ^ 0x19_19);
    let (arr, intent) = start(policy, &w, &[], false);
    let base = vec![0u8; geo.capacity_bytes() as usize];
    let crashed = run_to_crash(&w, &ctx, arr, intent.as_deref(), &mut rng, c.ops, base);
    drop(intent);
    let inconsistent = inconsistent_stripes(g, c.stripes, &w.devs, CRASH_DATA_OFFSET as usize);
    // The members lost before the restart: one for RAID5, one or two for RAID6.
    let lose = match c.level {
        Level::Raid5 => 1,
        Level::Raid6 => 1 + rng.below(2),
    };
    let mut missing: Vec<u16> = Vec::new();
    while (missing.len() as u64) < lose {
        let m = rng.below(u64::from(c.members)) as u16;
        if !missing.contains(&m) {
            missing.push(m);
        }
    }
    missing.sort_unstable();
    for &m in &missing {
        w.devs[usize::from(m)].disappear();
    }
    let ctx = format!("{ctx}, members {missing:?} missing at the restart");
    let (mut arr, _intent) = start(policy, &w, &missing, true);
    let whole = read_whole(&mut arr, &w.clock, &ctx);
    drop(arr);
    if let Some(oracle) = oracle {
        let rebuilt = oracle_extract(oracle, &w, &missing, &ctx);
        assert_eq!(rebuilt.len(), whole.len(), "{ctx}: the oracle's array size");
        if let Some(at) = rebuilt.iter().zip(whole.iter()).position(|(a, b)| a != b) {
            panic!("{ctx}: the engine's degraded read-back differs from the oracle's at array offset {at}");
        }
    }
    let mut n = Count {
        runs: 1,
        inconsistent_stripes: inconsistent.len() as u64,
        volatile_runs: u64::from(c.volatile),
        volatile_lost: crashed.volatile.lost + crashed.volatile.torn,
        ..Count::default()
    };
    let stripe_bytes = g.stripe_data_bytes();
    let mut first = None;
    for b in 0..(geo.capacity_bytes() / 512) as usize {
        let got = &whole[b * 512..(b + 1) * 512];
        let off = b as u64 * 512;
        let k = (off % stripe_bytes / u64::from(g.chunk_bytes())) as u16;
        let stripe = off / stripe_bytes;
        let member = g.stripe(stripe).data_member(k);
        let on_missing = missing.contains(&member);
        let judged = crashed.versions.judge(b, got);
        if crashed.versions.in_flight(b) {
            match judged {
                Ok(Outcome::Old) => n.old += 1,
                Ok(_) => n.new += 1,
                Err(_) => n.neither += 1,
            }
            continue;
        }
        n.untouched += 1;
        n.untouched_missing += u64::from(on_missing);
        if let Err(e) = judged {
            // Only the write hole may corrupt an untouched block: on a missing member, in a
            // stripe the crash left inconsistent.
            assert!(
                on_missing && inconsistent.iter().any(|&(s, _)| s == stripe),
                "{ctx}: untouched block on member {member} of stripe {stripe} reads back \
                 wrong, but the member is present or the stripe was consistent: {e}"
            );
            n.corrupted += 1;
            first.get_or_insert(e);
        }
    }
    if let Some(e) = first {
        n.runs_corrupted = 1;
        eprintln!(
            "{ctx}: {} untouched blocks corrupted ({} stripes inconsistent after the crash), \
             the first: {e}",
            n.corrupted, n.inconsistent_stripes
        );
    }
    n
}

/// The oracle's reconstruction of the array from `w`'s member images with `missing` absent.
fn oracle_extract(oracle: &Oracle, w: &CrashWorld, missing: &[u16], ctx: &str) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["extract".to_string()];
    for (i, d) in w.devs.iter().enumerate() {
        if missing.contains(&(i as u16)) {
            args.push("missing".into());
            continue;
        }
        let p = dir.path().join(format!("m{i}.img"));
        std::fs::write(&p, d.contents()).unwrap();
        args.push(p.display().to_string());
    }
    let out = dir.path().join("array.img");
    args.extend([
        "--level".to_string(),
        w.g.level().md_level().to_string(),
        "--layout".into(),
        w.g.layout().name().into(),
        "--chunk".into(),
        w.g.chunk_bytes().to_string(),
        "--data-offset".into(),
        CRASH_DATA_OFFSET.to_string(),
        "--stripes".into(),
        w.c.stripes.to_string(),
        "--out".into(),
        out.display().to_string(),
    ]);
    oracle
        .run_ok(&args)
        .unwrap_or_else(|e| panic!("{ctx}: {e}"));
    std::fs::read(&out).unwrap()
}

/// Runs every case under `policy` on two threads; prints the counts per level and shard
/// count and returns each run's (level, shards, counts).
fn run_all(policy: Policy, oracle: Option<&Oracle>) -> Vec<(Level, usize, Count)> {
    let all = crash_cases(FIRST_SEED, seeds_per_config(), ops());
    let runs = Mutex::new(Vec::new());
    each_case(all, |c| {
        let n = run(c, policy, oracle);
        runs.lock().unwrap().push((c.level, c.reactors, n));
    });
    let runs = runs.into_inner().unwrap();
    let mut configs: Vec<(Level, usize)> = runs.iter().map(|&(l, r, _)| (l, r)).collect();
    configs.sort_by_key(|&(l, r)| (l.md_level(), r));
    configs.dedup();
    for (level, shards) in configs {
        let sum = |f: fn(&Count) -> u64| -> u64 {
            runs.iter()
                .filter(|&&(l, r, _)| (l, r) == (level, shards))
                .map(|(_, _, n)| f(n))
                .sum()
        };
        eprintln!(
            "policy {policy:?}, {level}, {shards} shards: {} runs, {} of them with corrupted \
             untouched blocks; {} untouched blocks corrupted of {} ({} on missing members); \
             {} stripes inconsistent after the crashes; blocks under writes in flight (or \
             not durable) read back old {}, new {}, neither {}; {} runs with volatile member \
             caches, whose crashes lost {} member writes",
            sum(|n| n.runs),
            sum(|n| n.runs_corrupted),
            sum(|n| n.corrupted),
            sum(|n| n.untouched),
            sum(|n| n.untouched_missing),
            sum(|n| n.inconsistent_stripes),
            sum(|n| n.old),
            sum(|n| n.new),
            sum(|n| n.neither),
            sum(|n| n.volatile_runs),
            sum(|n| n.volatile_lost)
        );
    }
    let corrupted: u64 = runs.iter().map(|(_, _, n)| n.corrupted).sum();
    let with: u64 = runs.iter().map(|(_, _, n)| n.runs_corrupted).sum();
    eprintln!(
        "policy {policy:?}, total: {corrupted} untouched blocks corrupted in {with} of {} runs",
        runs.len()
    );
    runs
}

/// The negative control: with the bitmap policy (today's engine, no PPL), a crash with
/// torn writes followed by a dirty degraded restart returns corrupted blocks that no
/// write in flight touched — at least one over the seeds, which proves the check can
/// fail. When PPL lands, the same seeds run with `Policy::Ppl` and must give zero.
#[test]
fn without_ppl_a_dirty_degraded_restart_corrupts_untouched_blocks_ppl_must_give_zero() {
    let oracle = Oracle::locate_or_skip(
        "without_ppl_a_dirty_degraded_restart_corrupts_untouched_blocks_ppl_must_give_zero",
    );
    let runs = run_all(Policy::Bitmap, oracle.as_ref());
    let corrupted: u64 = runs.iter().map(|(_, _, n)| n.corrupted).sum();
    if runs.len() > 1 {
        assert!(
            corrupted > 0,
            "no untouched block was corrupted over {} runs: the write-hole check cannot \
             fail as built",
            runs.len()
        );
    }
}

/// The write hole closed: the same seeds with the Partial Parity Log (md's on RAID5,
/// ferroraid's two-log extension on RAID6) — every write logged on its stripe's parity
/// member(s) first, the newest records replayed at the restart with the missing member
/// (RAID6: one or two) absent — read back every untouched block exactly.
#[test]
fn with_ppl_a_dirty_degraded_restart_reads_back_every_untouched_block() {
    let oracle = Oracle::locate_or_skip(
        "with_ppl_a_dirty_degraded_restart_reads_back_every_untouched_block",
    );
    let runs = run_all(Policy::Ppl, oracle.as_ref());
    assert!(!runs.is_empty() || std::env::var("FERRORAID_SEED").is_ok());
    for (level, shards, n) in &runs {
        assert_eq!(
            n.corrupted, 0,
            "PPL, {level}, {shards} shards: {} untouched blocks corrupted",
            n.corrupted
        );
    }
}
