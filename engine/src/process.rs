//! Background processes: resync, rebuild, check and repair.
//!
//! A background process walks stripes and runs one **background stripe operation** on each
//! (see [`crate::array`]): it takes the stripe through the same per-stripe ordering as a
//! write (so foreground writes on that stripe are ordered by the stripe's owner, no locks;
//! foreground reads may run beside it, as md serves aligned reads past a resync: it writes
//! only parity or a member being rebuilt, which such a read does not read), reads every
//! surviving chunk of the stripe whole, then
//!
//! - **check** computes P (and Q) from the data and compares them with the stored parity,
//!   counting mismatches; it writes nothing;
//! - **repair** does the same and rewrites the parity that mismatches;
//! - **resync** is repair under another name: md's raid5 resync (`handle_parity_checks5/6`
//!   in `drivers/md/raid5.c`, with `MD_RECOVERY_CHECK` clear) reads every block of a
//!   stripe, checks parity and writes parity only where it mismatches — a resync of a
//!   consistent stripe writes nothing. The mismatches it meets are counted too, as md does;
//! - **rebuild** (md's "recovery") reconstructs the chunk of every member being rebuilt
//!   from the survivors and writes it; a member re-added by bitmap is rebuilt only over
//!   the bitmap's dirty regions (the process's stripe ranges);
//! - **replace** (md's `want_replacement` recovery) copies a member's chunk onto its
//!   replacement device while the member stays in service: it reads only the member's
//!   chunk and writes it to the replacement; where the member returns an unrecovered read
//!   error (or has failed meanwhile), it reads the other members instead and writes the
//!   chunk rebuilt from them (md's `handle_stripe` with `s.replacing`: the block is read
//!   from the old device when `R5_Insync`, else computed).
//!
//! # Sharding
//! Every shard (reactor) walks only the stripes it owns (`stripe mod shards == shard`), in
//! ascending order, within the process's stripe ranges (a resync may be given the dirty
//! regions of a write-intent bitmap; the default is the whole array). A shard has a bounded
//! number of background operations in flight ([`crate::array::ArrayConfig::background_ops`],
//! from a pool of their own: foreground's stripe operations are never taken, and how fast
//! background goes is decided by the shard's pacer, [`crate::qos::Pacer`]),
//! so they may complete out of order; its **position** is the lowest stripe of its own it has
//! not finished (every own stripe in the ranges below it is done), so it only grows. The
//! array's position ([`ProcessSnapshot::position_stripes`]) is the minimum over the shards:
//! every stripe below it, in the ranges, is done — what is checkpointed (md's
//! `resync_offset` / `recovery_offset`, in member sectors: [`ProcessSnapshot::position_sectors`])
//! and given back as the resume position after a restart.
//!
//! # `mismatch_cnt`
//! Counted as md counts it: md's stripe cache works in 4 KiB pages (`STRIPE_SIZE`, the
//! default `conf->stripe_size`), and for every page-wide slice of a stripe whose P or Q
//! does not match the data it adds `STRIPE_SECTORS` (`conf->stripe_sectors` in newer
//! kernels: 8 sectors of 512 bytes) to `resync_mismatches`, once per slice whichever of P
//! and Q mismatched (`handle_parity_checks5`, `handle_parity_checks6` in
//! `drivers/md/raid5.c`). So `mismatch_cnt` is in 512-byte sectors, 8 per mismatching
//! 4 KiB slice.
//!
//! # Rebuild and foreground writes
//! A member being rebuilt ([`crate::array::MemberState::Rebuilding`]) is treated as md
//! treats a recovering device (`analyse_stripe` in raid5.c: `R5_Insync` only when
//! `sh->sector + STRIPE_SECTORS <= rdev->recovery_offset`): it is in sync for the stripes
//! below its recovery position and missing above it, so reads of stripes above it are
//! served from redundancy; foreground writes are sent to it on every stripe, below and
//! above the position (md sets `R5_Wantwrite` on every locked block of a write, in sync or
//! not, and `ops_run_io` skips only Faulty devices). A write above the position is
//! harmless: the rebuild, which takes the stripe exclusively, rewrites the whole chunk
//! later from the survivors, which already hold that write.

use std::ops::Range;

use arrayvec::ArrayVec;
use thiserror::Error;

use crate::geometry::ArrayGeometry;

/// md's stripe-cache page (`STRIPE_SIZE`), bytes: the unit `mismatch_cnt` counts in.
pub const MD_STRIPE_PAGE_BYTES: u32 = 4096;
/// Sector size of md's counters and offsets (`resync_offset`, `recovery_offset`,
/// `mismatch_cnt`), bytes.
pub const SECTOR_BYTES: u64 = 512;
/// Most background stripe operations one shard may have in flight (the bound of
/// [`crate::array::ArrayConfig::background_ops`]): enough to keep a deep NVMe queue busy
/// with chunk-sized reads on every member.
pub const MAX_BACKGROUND_OPS: usize = 64;

/// What a background process does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProcessKind {
    /// Make parity consistent with the data (after an unclean shutdown); writes parity only
    /// where it mismatches.
    Resync,
    /// Reconstruct the members being rebuilt from the survivors (md's "recovery").
    Rebuild,
    /// Scrub: count parity mismatches, write nothing.
    Check,
    /// Scrub and rewrite mismatching parity.
    Repair,
    /// Copy a member onto its replacement device while the member keeps serving (md's
    /// `mdadm --replace`); chunks the member cannot read are rebuilt from the others.
    Replace,
}

impl ProcessKind {
    /// md's name for the action (`sync_action`: resync, recover, check, repair), except that
    /// a rebuild is called "rebuild" (ferroraid's vocabulary).
    pub fn name(self) -> &'static str {
        match self {
            ProcessKind::Resync => "resync",
            ProcessKind::Rebuild => "rebuild",
            ProcessKind::Check => "check",
            ProcessKind::Repair => "repair",
            ProcessKind::Replace => "replace",
        }
    }

    /// Whether the process rewrites mismatching parity (repair, resync).
    pub fn rewrites_parity(self) -> bool {
        matches!(self, ProcessKind::Resync | ProcessKind::Repair)
    }
}

impl std::fmt::Display for ProcessKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a process could not start, or why it ended early; also the refusals of member
/// replacement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum ProcessError {
    /// The array has lost more members than its redundancy: it stays failed; nothing
    /// (no rebuild, no added member) brings it back.
    #[error("the array has failed (more members lost than its redundancy): it stays failed")]
    ArrayFailed,
    /// A scrub or resync needs every member in sync; this one is not.
    #[error("{kind} needs every member in sync, and member {member} is not")]
    Degraded {
        /// The process asked for.
        kind: ProcessKind,
        /// A member that is failed or being rebuilt.
        member: u16,
    },
    /// A rebuild was asked for, but no member is being rebuilt.
    #[error("nothing to rebuild: no member is being rebuilt")]
    NothingToRebuild,
    /// Another process is running (or still has operations in flight).
    #[error("a {running} is already running: stop it first")]
    Busy {
        /// The running process.
        running: ProcessKind,
    },
    /// A stripe range is empty or beyond the array.
    #[error("stripe range {start}..{end} is empty or beyond the array's {stripes} stripes")]
    BadRange {
        /// First stripe of the range.
        start: u64,
        /// One past its last stripe.
        end: u64,
        /// Stripes in the array.
        stripes: u64,
    },
    /// The stripe ranges overlap or are out of order.
    #[error("stripe ranges must be sorted and disjoint")]
    UnsortedRanges,
    /// The resume position lies beyond the array.
    #[error("resume position {stripe} is beyond the array's {stripes} stripes")]
    BadResume {
        /// The resume position, stripes.
        stripe: u64,
        /// Stripes in the array.
        stripes: u64,
    },
    /// The shard was configured without background operations (`background_ops` 0).
    #[error("the array was configured without background operations (background_ops 0)")]
    NoSlots,
    /// No such member slot.
    #[error("member {member} does not exist: the array has {members} members")]
    NoSuchMember {
        /// The slot asked for.
        member: u16,
        /// Members of the array.
        members: u16,
    },
    /// Only the slot of a failed member can take a new device.
    #[error("member {member} is not failed: only a failed member's slot can be replaced")]
    NotFailed {
        /// The slot.
        member: u16,
    },
    /// The failed member still has requests outstanding (aborted requests not yet back):
    /// retry once they are.
    #[error("member {member} still has requests outstanding: retry")]
    MemberBusy {
        /// The slot.
        member: u16,
    },
    /// The new device cannot serve the array.
    #[error("the new device for member {member} is unfit: {why}")]
    Unfit {
        /// The slot.
        member: u16,
        /// What does not fit.
        why: &'static str,
    },
    /// Every member being rebuilt failed: the rebuild stopped (the members stay failed,
    /// the array is as degraded as before, no data lost).
    #[error("rebuild target member {member} failed")]
    TargetFailed {
        /// The (first) target.
        member: u16,
    },
    /// The replacement device of a member failed: the replace stopped, the member keeps
    /// its slot and the array is as it was (md fails the replacement, not the array).
    #[error("the replacement device of member {member} failed: the replace stopped, the array is unchanged")]
    ReplacementFailed {
        /// The member being replaced.
        member: u16,
    },
    /// A replace was asked for, but no member has a replacement device.
    #[error("nothing to replace: no member has a replacement device")]
    NoReplacement,
    /// A member already has a replacement device (one replacement at a time per array;
    /// md allows one per slot and would refuse a second for the same slot).
    #[error("member {member} is already being replaced: one replacement at a time")]
    ReplaceBusy {
        /// The member being replaced.
        member: u16,
    },
    /// The member cannot be replaced because it is not in service (failed or being
    /// rebuilt: add a device to rebuild it instead).
    #[error("member {member} is not in service (failed or being rebuilt): add a device to rebuild it instead of replacing it")]
    NotInService {
        /// The member.
        member: u16,
    },
    /// A member failed during a check, repair or resync: the process stopped (it cannot
    /// verify parity on a degraded stripe).
    #[error("member {member} failed during the {kind}")]
    MemberFailed {
        /// The process.
        kind: ProcessKind,
        /// The member.
        member: u16,
    },
    /// A stripe lost more members than its redundancy during the process.
    #[error("stripe {stripe} lost more members than its redundancy")]
    Unrecoverable {
        /// The stripe.
        stripe: u64,
    },
}

/// What a process is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessState {
    /// Working (or draining its last operations).
    Running,
    /// Every stripe in its ranges is done.
    Finished,
    /// Stopped on request; its position is where to resume.
    Stopped,
    /// Ended early; its position is where it stopped (every stripe below is done).
    Failed(ProcessError),
}

/// What to run: the kind, the stripes to cover and where to resume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessRequest {
    /// What to do.
    pub kind: ProcessKind,
    /// Stripe ranges to cover, sorted and disjoint (`None`: the whole array). A resync
    /// after an unclean shutdown gets the write-intent bitmap's dirty regions here.
    pub ranges: Option<Vec<Range<u64>>>,
    /// Resume position, stripes: every stripe below it is taken as done (a checkpoint
    /// from an earlier run; 0 to start from the beginning). For a rebuild, the members
    /// being rebuilt are taken as in sync below it (md's `recovery_offset`).
    pub resume_stripe: u64,
}

impl ProcessRequest {
    /// The whole array, from the beginning.
    pub fn whole(kind: ProcessKind) -> Self {
        Self {
            kind,
            ranges: None,
            resume_stripe: 0,
        }
    }

    /// Checks the request against `geo`.
    ///
    /// # Errors
    /// [`ProcessError::BadRange`], [`ProcessError::UnsortedRanges`] or
    /// [`ProcessError::BadResume`].
    pub fn validate(&self, geo: &ArrayGeometry) -> Result<(), ProcessError> {
        let stripes = geo.stripes();
        if self.resume_stripe > stripes {
            return Err(ProcessError::BadResume {
                stripe: self.resume_stripe,
                stripes,
            });
        }
        if let Some(ranges) = &self.ranges {
            let mut prev_end = 0;
            for r in ranges {
                if r.start >= r.end || r.end > stripes {
                    return Err(ProcessError::BadRange {
                        start: r.start,
                        end: r.end,
                        stripes,
                    });
                }
                if r.start < prev_end {
                    return Err(ProcessError::UnsortedRanges);
                }
                prev_end = r.end;
            }
        }
        Ok(())
    }
}

/// One shard's walk over its own stripes within the ranges, in ascending order.
#[derive(Clone, Debug)]
pub(crate) struct ShardWalk {
    /// Sorted, disjoint stripe ranges (the whole array when none were given).
    ranges: Vec<Range<u64>>,
    /// Index of the range the cursor is in.
    range_idx: usize,
    /// Next candidate stripe (owned by this shard).
    cursor: u64,
    shard: u64,
    shards: u64,
}

impl ShardWalk {
    pub(crate) fn new(
        ranges: Vec<Range<u64>>,
        resume: u64,
        shard: usize,
        shards: usize,
    ) -> ShardWalk {
        let shards = shards as u64;
        let shard = shard as u64;
        let mut w = ShardWalk {
            ranges,
            range_idx: 0,
            cursor: 0,
            shard,
            shards,
        };
        w.cursor = w.own_at_or_after(resume);
        w
    }

    /// The first stripe owned by this shard at or after `x`.
    fn own_at_or_after(&self, x: u64) -> u64 {
        let r = x % self.shards;
        x + (self.shard + self.shards - r) % self.shards
    }

    /// The next stripe to process and the index of its range.
    fn locate(&self) -> Option<(usize, u64)> {
        let mut i = self.range_idx;
        while let Some(r) = self.ranges.get(i) {
            let c = if self.cursor < r.start {
                self.own_at_or_after(r.start)
            } else {
                self.cursor
            };
            if c < r.end {
                return Some((i, c));
            }
            i += 1;
        }
        None
    }

    /// The next stripe to process, without taking it.
    pub(crate) fn peek(&self) -> Option<u64> {
        self.locate().map(|(_, s)| s)
    }

    /// Takes the next stripe.
    pub(crate) fn take(&mut self) -> Option<u64> {
        let (i, s) = self.locate()?;
        self.range_idx = i;
        self.cursor = s + self.shards;
        Some(s)
    }

    /// Own stripes within the ranges (the shard's total work).
    pub(crate) fn total_own(&self) -> u64 {
        self.ranges
            .iter()
            .map(|r| self.own_in(r.start, r.end))
            .sum()
    }

    /// Own stripes in `a..b`.
    fn own_in(&self, a: u64, b: u64) -> u64 {
        let first = self.own_at_or_after(a);
        if first >= b {
            0
        } else {
            (b - first).div_ceil(self.shards)
        }
    }

    /// Own stripes within the ranges below `x` (work a resume at `x` skips).
    pub(crate) fn own_below(&self, x: u64) -> u64 {
        self.ranges
            .iter()
            .map(|r| self.own_in(r.start, r.end.min(x).max(r.start)))
            .sum()
    }
}

/// One shard's progress in its process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardProgress {
    /// The process.
    pub kind: ProcessKind,
    /// Its state on this shard.
    pub state: ProcessState,
    /// Lowest own stripe not yet done (every own stripe below it, in the ranges, is done);
    /// the array's stripe count once finished.
    pub position_stripes: u64,
    /// Own stripes done (including those a resume position skipped).
    pub done_stripes: u64,
    /// Own stripes in the ranges: the shard's whole work.
    pub total_stripes: u64,
    /// Mismatches found, 512-byte sectors, counted as md does (module docs).
    pub mismatch_cnt: u64,
    /// Background stripe operations in flight.
    pub in_flight: u32,
    /// Members being rebuilt by this process (rebuild), or the member being replaced
    /// (replace).
    pub targets: ArrayVec<u16, 2>,
    /// Own stripes whose parity the rebuild's verification walk has checked: a RAID6
    /// rebuild of one member on members that do not seek leaves the parity chunk it does
    /// not use unread, and reads it once the rebuild proper is done (every stripe of the
    /// ranges, so that an unrecovered read error there is still found and rewritten).
    /// Not counted in `done_stripes`.
    pub verify_done_stripes: u64,
    /// Own stripes that walk covers; 0 when the process has none.
    pub verify_total_stripes: u64,
}

/// A process over every shard: what status shows and what the superblock checkpoints.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessSnapshot {
    /// The process.
    pub kind: ProcessKind,
    /// Failed if any shard failed (the first reason), else Running if any shard runs,
    /// else Stopped if any stopped, else Finished.
    pub state: ProcessState,
    /// Minimum of the shards' positions, stripes: every stripe below it, in the ranges,
    /// is done. The checkpoint to resume from.
    pub position_stripes: u64,
    /// The same position in bytes of each member's data area, relative to the data offset
    /// (`position_stripes × chunk_bytes`).
    pub position_member_bytes: u64,
    /// The same position in 512-byte member sectors relative to the data offset: the
    /// unit of md's `resync_offset` and `recovery_offset`.
    pub position_sectors: u64,
    /// Stripes of the array.
    pub size_stripes: u64,
    /// Bytes of each member's data area (`stripes × chunk_bytes`).
    pub size_member_bytes: u64,
    /// Stripes done, over every shard.
    pub done_stripes: u64,
    /// Stripes the process covers, over every shard.
    pub total_stripes: u64,
    /// Per-member bytes done (`done_stripes × chunk_bytes`).
    pub done_member_bytes: u64,
    /// Per-member bytes the process covers (`total_stripes × chunk_bytes`).
    pub total_member_bytes: u64,
    /// Mismatches found, 512-byte sectors (md's `mismatch_cnt`).
    pub mismatch_cnt: u64,
    /// Members being rebuilt (rebuild), or the member being replaced (replace).
    pub targets: ArrayVec<u16, 2>,
    /// Stripes whose unread parity a rebuild has verified, over every shard
    /// ([`ShardProgress::verify_done_stripes`]).
    pub verify_done_stripes: u64,
    /// Stripes that verification covers, over every shard; 0 when there is none.
    pub verify_total_stripes: u64,
    /// Progress rate, per-member bytes per second, over the last window (`None` until two
    /// samples exist; filled in by [`RateWindow`] users such as the reactor handle).
    pub rate_bytes_per_s: Option<f64>,
    /// Seconds to finish at that rate (`None` without a rate, or at a zero rate).
    pub eta_s: Option<f64>,
}

impl ProcessSnapshot {
    /// Merges the shards' progress (all of one process) over `geo`; `None` for no shards.
    pub fn merge(shards: &[ShardProgress], geo: &ArrayGeometry) -> Option<ProcessSnapshot> {
        let first = shards.first()?;
        let chunk = u64::from(geo.geometry().chunk_bytes());
        let mut state = ProcessState::Finished;
        for s in shards {
            state = match (state, s.state) {
                (ProcessState::Failed(e), _) => ProcessState::Failed(e),
                (_, ProcessState::Failed(e)) => ProcessState::Failed(e),
                (_, ProcessState::Running) | (ProcessState::Running, _) => ProcessState::Running,
                (_, ProcessState::Stopped) | (ProcessState::Stopped, _) => ProcessState::Stopped,
                _ => ProcessState::Finished,
            };
        }
        let position = shards
            .iter()
            .map(|s| s.position_stripes)
            .min()
            .unwrap_or(0)
            .min(geo.stripes());
        let done: u64 = shards.iter().map(|s| s.done_stripes).sum();
        let total: u64 = shards.iter().map(|s| s.total_stripes).sum();
        Some(ProcessSnapshot {
            kind: first.kind,
            state,
            position_stripes: position,
            position_member_bytes: position * chunk,
            position_sectors: position * chunk / SECTOR_BYTES,
            size_stripes: geo.stripes(),
            size_member_bytes: geo.member_data_bytes(),
            done_stripes: done,
            total_stripes: total,
            done_member_bytes: done * chunk,
            total_member_bytes: total * chunk,
            mismatch_cnt: shards.iter().map(|s| s.mismatch_cnt).sum(),
            targets: first.targets.clone(),
            verify_done_stripes: shards.iter().map(|s| s.verify_done_stripes).sum(),
            verify_total_stripes: shards.iter().map(|s| s.verify_total_stripes).sum(),
            rate_bytes_per_s: None,
            eta_s: None,
        })
    }
}

/// Samples kept by a [`RateWindow`]: one per observation, oldest dropped first.
pub const RATE_SAMPLES: usize = 64;

/// Progress rate over a sliding window of (time, bytes done) samples: what `status`
/// shows as `rate_bytes_per_s` and `eta_s`. Bounded: at most [`RATE_SAMPLES`] samples,
/// none older than the window.
#[derive(Clone, Debug)]
pub struct RateWindow {
    window_ns: u64,
    samples: std::collections::VecDeque<(u64, u64)>,
}

impl RateWindow {
    /// A window of `window_ns` nanoseconds (at least 1 ns).
    pub fn new(window_ns: u64) -> Self {
        Self {
            window_ns: window_ns.max(1),
            samples: std::collections::VecDeque::with_capacity(RATE_SAMPLES),
        }
    }

    /// Forgets every sample (a new process started).
    pub fn reset(&mut self) {
        self.samples.clear();
    }

    /// Records `done_bytes` at `now_ns` and returns (rate in bytes/s, seconds to reach
    /// `total_bytes`), each `None` while not computable (fewer than two samples, no time
    /// elapsed, or a zero rate for the ETA).
    pub fn observe(
        &mut self,
        now_ns: u64,
        done_bytes: u64,
        total_bytes: u64,
    ) -> (Option<f64>, Option<f64>) {
        if let Some(&(t, d)) = self.samples.back() {
            if now_ns < t || done_bytes < d {
                // A restart of the counters: start over.
                self.samples.clear();
            }
        }
        if self.samples.len() == RATE_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back((now_ns, done_bytes));
        while self.samples.len() > 2 && now_ns.saturating_sub(self.samples[1].0) >= self.window_ns {
            self.samples.pop_front();
        }
        let (t0, d0) = self.samples[0];
        if now_ns <= t0 {
            return (None, None);
        }
        let rate = (done_bytes - d0) as f64 * 1e9 / (now_ns - t0) as f64;
        let eta = (rate > 0.0).then(|| total_bytes.saturating_sub(done_bytes) as f64 / rate);
        (Some(rate), eta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{Geometry, Layout, Level};

    fn one(r: Range<u64>) -> Vec<Range<u64>> {
        std::iter::once(r).collect()
    }

    #[test]
    fn walks_own_stripes_within_ranges_in_order() {
        let mut w = ShardWalk::new(vec![0..3, 5..9, 20..21], 0, 1, 2);
        let got: Vec<u64> = std::iter::from_fn(|| w.take()).collect();
        assert_eq!(got, [1, 5, 7]);
        let w = ShardWalk::new(vec![0..3, 5..9, 20..21], 0, 0, 2);
        assert_eq!(w.total_own(), 2 + 2 + 1);
        assert_eq!(w.own_below(7), 2 + 1);
        let mut w = ShardWalk::new(one(0..100), 10, 3, 4);
        assert_eq!(w.take(), Some(11));
        assert_eq!(w.take(), Some(15));
        let mut all = ShardWalk::new(one(0..4), 0, 0, 1);
        assert_eq!(std::iter::from_fn(|| all.take()).count(), 4);
    }

    #[test]
    fn requests_are_validated() {
        let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 4, 4096, 512).unwrap();
        let geo = ArrayGeometry::new(g, 10).unwrap();
        let mut r = ProcessRequest::whole(ProcessKind::Resync);
        assert_eq!(r.validate(&geo), Ok(()));
        r.ranges = Some(vec![0..2, 1..3]);
        assert_eq!(r.validate(&geo), Err(ProcessError::UnsortedRanges));
        r.ranges = Some(one(5..11));
        assert!(matches!(
            r.validate(&geo),
            Err(ProcessError::BadRange { .. })
        ));
        r.ranges = Some(one(Range { start: 3, end: 3 }));
        assert!(matches!(
            r.validate(&geo),
            Err(ProcessError::BadRange { .. })
        ));
        r.ranges = None;
        r.resume_stripe = 11;
        assert!(matches!(
            r.validate(&geo),
            Err(ProcessError::BadResume { .. })
        ));
    }

    #[test]
    fn merged_position_is_the_minimum_in_every_unit() {
        let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 5, 65536, 512).unwrap();
        let geo = ArrayGeometry::new(g, 100).unwrap();
        let shard = |pos, state| ShardProgress {
            kind: ProcessKind::Check,
            state,
            position_stripes: pos,
            done_stripes: pos / 2,
            total_stripes: 50,
            mismatch_cnt: 8,
            in_flight: 0,
            targets: ArrayVec::new(),
            verify_done_stripes: 3,
            verify_total_stripes: 50,
        };
        let s = ProcessSnapshot::merge(
            &[
                shard(12, ProcessState::Running),
                shard(9, ProcessState::Finished),
            ],
            &geo,
        )
        .unwrap();
        assert_eq!(s.state, ProcessState::Running);
        assert_eq!(s.position_stripes, 9);
        assert_eq!(s.position_member_bytes, 9 * 65536);
        assert_eq!(s.position_sectors, 9 * 128);
        assert_eq!(s.mismatch_cnt, 16);
        assert_eq!(s.size_member_bytes, 100 * 65536);
        assert_eq!((s.verify_done_stripes, s.verify_total_stripes), (6, 100));
        let failed = ProcessState::Failed(ProcessError::ArrayFailed);
        let s = ProcessSnapshot::merge(&[shard(1, ProcessState::Running), shard(1, failed)], &geo)
            .unwrap();
        assert_eq!(s.state, failed);
    }

    #[test]
    fn rate_over_the_window() {
        let mut w = RateWindow::new(1_000_000_000);
        assert_eq!(w.observe(0, 0, 1000), (None, None));
        let (rate, eta) = w.observe(500_000_000, 100, 1000);
        assert_eq!(rate, Some(200.0));
        assert_eq!(eta, Some(4.5));
        // Old samples fall out of the window: the rate follows the recent pace.
        w.observe(2_000_000_000, 100, 1000);
        let (rate, _) = w.observe(3_000_000_000, 300, 1000);
        assert_eq!(rate, Some(200.0));
    }
}
