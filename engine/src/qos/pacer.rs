//! Background pacers: [`Pacer`] implementations that decide when a background stripe
//! operation (resync, rebuild, check, repair) may start on a shard.
//!
//! - [`FerroraidPacer`]: ferroraid's feedback controller on what foreground I/O
//!   experiences (the control law and its reasoning: `docs/PACING.md`).
//! - [`MdPre41Pacer`]: Linux md before 4.1: throttle to `speed_min` whenever the array is
//!   not idle.
//! - [`Md41Pacer`]: Linux md since 4.1: when not idle, wait until the resync's own pending
//!   requests have completed, then continue.
//!
//! All three see only the [`Pacer`] calls of their own shard and the executor's clock
//! (ns), so they run per reactor with no shared state, in virtual time under test and in
//! real time on the reactors. Rates are **bytes per second per member** (md's
//! `sync_speed_min`/`sync_speed_max` are KiB/s per member device: 1000 and 200000 by
//! default, [`MD_SPEED_MIN`], [`MD_SPEED_MAX`]). Nothing allocates after construction.

use hdrhistogram::Histogram;

use crate::latency::LatencyHistogram;

use super::{Admission, Pacer};

/// md's default `speed_limit_min`: 1000 KiB/s per member (drivers/md/md.c
/// `sysctl_speed_limit_min`), bytes/s.
pub const MD_SPEED_MIN: u64 = 1000 * 1024;
/// md's default `speed_limit_max`: 200000 KiB/s per member (`sysctl_speed_limit_max`),
/// bytes/s.
pub const MD_SPEED_MAX: u64 = 200_000 * 1024;

/// Guard rails shared by every pacer, bytes/s per member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpeedLimits {
    /// Floor: background always progresses at least this fast (when it has work).
    pub speed_min: u64,
    /// Ceiling: background never runs faster.
    pub speed_max: u64,
}

impl Default for SpeedLimits {
    /// md's defaults: [`MD_SPEED_MIN`], [`MD_SPEED_MAX`].
    fn default() -> Self {
        Self {
            speed_min: MD_SPEED_MIN,
            speed_max: MD_SPEED_MAX,
        }
    }
}

impl SpeedLimits {
    /// The share of these limits one of `shards` shards gets: each shard paces its own
    /// stripes with a pacer of its own, so the array's limits (md's are for the whole
    /// array, per member device) are divided among them — rounded up, so a floor stays
    /// above zero. `shards` 0 counts as 1.
    pub fn per_shard(self, shards: usize) -> Self {
        let n = u64::try_from(shards.max(1)).unwrap_or(u64::MAX);
        Self {
            speed_min: self.speed_min.div_ceil(n),
            speed_max: self.speed_max.div_ceil(n),
        }
    }

    /// Limits from MB/s (10^6 bytes/s) per member, the unit of the `speed_min`/`speed_max`
    /// settings. A maximum below the minimum is raised to it.
    pub fn from_mb_per_s(min: u64, max: u64) -> Self {
        let min = min.saturating_mul(1_000_000);
        Self {
            speed_min: min,
            speed_max: max.saturating_mul(1_000_000).max(min),
        }
    }
}

const NS_PER_S: u64 = 1_000_000_000;

/// `bytes` at `rate` bytes/s, ns (rounded up; a zero rate waits a second).
fn ns_for(bytes: u64, rate: u64) -> u64 {
    if rate == 0 {
        return NS_PER_S;
    }
    let ns = (u128::from(bytes) * u128::from(NS_PER_S)).div_ceil(u128::from(rate));
    u64::try_from(ns).unwrap_or(u64::MAX)
}

/// Bytes earned at `rate` bytes/s over `ns`.
fn bytes_for(ns: u64, rate: u64) -> u64 {
    let b = u128::from(ns) * u128::from(rate) / u128::from(NS_PER_S);
    u64::try_from(b).unwrap_or(u64::MAX)
}

// ---- md's rules ---------------------------------------------------------------------------

/// md's resync speed estimate (drivers/md/md.c `md_do_sync`): `SYNC_MARKS` (10) marks
/// taken every `SYNC_MARK_STEP` (3 s); the speed is the progress since the oldest mark
/// over the time since it, `currspeed = done / (elapsed_s + 1) + 1` KiB/s (whole seconds,
/// as md computes it), here in bytes/s.
#[derive(Clone, Copy, Debug)]
struct MdSpeed {
    mark_ns: [u64; MD_SYNC_MARKS],
    mark_done: [u64; MD_SYNC_MARKS],
    last_mark: usize,
    /// `resync_mark`, `resync_mark_cnt`.
    resync_mark_ns: u64,
    resync_mark_done: u64,
    /// Bytes per member completed (md: `io_sectors - recovery_active`).
    done: u64,
    started: bool,
}

const MD_SYNC_MARKS: usize = 10;
const MD_SYNC_MARK_STEP_NS: u64 = 3 * NS_PER_S;

impl MdSpeed {
    fn new() -> Self {
        Self {
            mark_ns: [0; MD_SYNC_MARKS],
            mark_done: [0; MD_SYNC_MARKS],
            last_mark: 0,
            resync_mark_ns: 0,
            resync_mark_done: 0,
            done: 0,
            started: false,
        }
    }

    /// Takes marks as md's loop does (`if time_after_eq(jiffies, mark[last_mark] +
    /// SYNC_MARK_STEP)`), and returns `currspeed`, bytes/s.
    fn speed(&mut self, now: u64) -> u64 {
        if !self.started {
            self.started = true;
            self.mark_ns = [now; MD_SYNC_MARKS];
            self.mark_done = [self.done; MD_SYNC_MARKS];
            self.resync_mark_ns = now;
            self.resync_mark_done = self.done;
        }
        if now >= self.mark_ns[self.last_mark] + MD_SYNC_MARK_STEP_NS {
            let next = (self.last_mark + 1) % MD_SYNC_MARKS;
            self.resync_mark_ns = self.mark_ns[next];
            self.resync_mark_done = self.mark_done[next];
            self.mark_ns[next] = now;
            self.mark_done[next] = self.done;
            self.last_mark = next;
        }
        let secs = (now - self.resync_mark_ns) / NS_PER_S + 1;
        (self.done - self.resync_mark_done) / secs + 1024
    }
}

/// md's idleness test (drivers/md/md.c `is_mddev_idle`, before 6.x): the array is not
/// idle when more than 64 sectors (32 KiB) of non-resync I/O happened since the last time
/// it was found not idle (md compares each member disk's sector count, less the resync's
/// own, with `last_events`, and moves `last_events` only when the difference exceeds 64).
/// Here the shard's foreground bytes stand for the members' non-resync sectors, spread
/// evenly over `members` member disks (a small random read touches one member): the
/// array is not idle once more than `members × 64` sectors of foreground happened since
/// the last "not idle" (`members` 1 unless set with `with_members`: every foreground byte
/// counts against one disk's threshold, md's rule at its most sensitive).
#[derive(Clone, Copy, Debug, Default)]
struct MdIdle {
    events: u64,
    last_events: u64,
    /// Member disks the foreground spreads over (0 is taken as 1).
    members: u64,
}

const MD_IDLE_BYTES: u64 = 64 * 512;

impl MdIdle {
    fn foreground(&mut self, bytes: u64) {
        self.events += bytes;
    }

    fn is_idle(&mut self) -> bool {
        if self.events - self.last_events > MD_IDLE_BYTES * self.members.max(1) {
            self.last_events = self.events;
            false
        } else {
            true
        }
    }
}

/// Linux md's throttle before 4.1 (drivers/md/md.c `md_do_sync`, e.g. v4.0):
///
/// ```text
/// if (currspeed > speed_min(mddev)) {
///     if ((currspeed > speed_max(mddev)) || !is_mddev_idle(mddev, 0)) {
///         msleep(500);
///         goto repeat;
///     }
/// }
/// ```
///
/// So with any foreground I/O the resync runs at `speed_min` (averaged over md's ~30 s
/// speed window) — it crawls.
#[derive(Clone, Copy, Debug)]
pub struct MdPre41Pacer {
    limits: SpeedLimits,
    speed: MdSpeed,
    idle: MdIdle,
}

/// md's `msleep(500)`, ns.
const MD_SLEEP_NS: u64 = 500_000_000;

impl MdPre41Pacer {
    /// A pacer with md's guard rails `limits`.
    pub fn new(limits: SpeedLimits) -> Self {
        Self {
            limits,
            speed: MdSpeed::new(),
            idle: MdIdle::default(),
        }
    }

    /// Counts foreground against `members` member disks in md's idle test (see
    /// `is_mddev_idle`: md keeps its 64-sector threshold per member disk), instead of
    /// against one.
    pub fn with_members(mut self, members: u16) -> Self {
        self.idle.members = u64::from(members);
        self
    }
}

impl Pacer for MdPre41Pacer {
    fn foreground_submitted(&mut self, _now_ns: u64) {}
    fn foreground_done(&mut self, _now_ns: u64, _latency_ns: u64, bytes: u64, _read: bool) {
        self.idle.foreground(bytes);
    }
    fn background_done(&mut self, _now_ns: u64, _latency_ns: u64, bytes_per_member: u64) {
        self.speed.done += bytes_per_member;
    }
    fn admit(&mut self, now_ns: u64, _bytes_per_member: u64, _in_flight: u32) -> Admission {
        let currspeed = self.speed.speed(now_ns);
        if currspeed > self.limits.speed_min
            && (currspeed > self.limits.speed_max || !self.idle.is_idle())
        {
            return Admission::NotBefore(now_ns + MD_SLEEP_NS);
        }
        Admission::Now
    }
}

/// Linux md's throttle since 4.1 (commit ac8fa4196d20, NeilBrown, "md: allow resync to
/// go faster when there is competing IO"; drivers/md/md.c `md_do_sync`):
///
/// ```text
/// if (currspeed > speed_min(mddev)) {
///     if (currspeed > speed_max(mddev)) {
///         msleep(500);
///         goto repeat;
///     }
///     if (!is_mddev_idle(mddev, 0)) {
///         /* Give other IO more of a chance.
///          * The faster the devices, the less we wait. */
///         wait_event(mddev->recovery_wait, !atomic_read(&mddev->recovery_active));
///     }
/// }
/// ```
///
/// When not idle, the resync waits until its own requests in flight have completed
/// ([`Admission::AfterCompletion`]), then continues: it waits only as long as its own
/// requests took, so on fast devices it hardly yields at all.
#[derive(Clone, Copy, Debug)]
pub struct Md41Pacer {
    limits: SpeedLimits,
    speed: MdSpeed,
    idle: MdIdle,
    /// Found not idle with requests in flight: wait for them all to complete.
    draining: bool,
}

impl Md41Pacer {
    /// A pacer with md's guard rails `limits`.
    pub fn new(limits: SpeedLimits) -> Self {
        Self {
            limits,
            speed: MdSpeed::new(),
            idle: MdIdle::default(),
            draining: false,
        }
    }

    /// Counts foreground against `members` member disks in md's idle test, as
    /// [`MdPre41Pacer::with_members`].
    pub fn with_members(mut self, members: u16) -> Self {
        self.idle.members = u64::from(members);
        self
    }
}

impl Pacer for Md41Pacer {
    fn foreground_submitted(&mut self, _now_ns: u64) {}
    fn foreground_done(&mut self, _now_ns: u64, _latency_ns: u64, bytes: u64, _read: bool) {
        self.idle.foreground(bytes);
    }
    fn background_done(&mut self, _now_ns: u64, _latency_ns: u64, bytes_per_member: u64) {
        self.speed.done += bytes_per_member;
    }
    fn admit(&mut self, now_ns: u64, _bytes_per_member: u64, in_flight: u32) -> Admission {
        if self.draining {
            if in_flight > 0 {
                return Admission::AfterCompletion;
            }
            // wait_event returned: md goes on to the next sync_request.
            self.draining = false;
            return Admission::Now;
        }
        let currspeed = self.speed.speed(now_ns);
        if currspeed > self.limits.speed_min {
            if currspeed > self.limits.speed_max {
                return Admission::NotBefore(now_ns + MD_SLEEP_NS);
            }
            if !self.idle.is_idle() && in_flight > 0 {
                self.draining = true;
                return Admission::AfterCompletion;
            }
        }
        Admission::Now
    }
}

// ---- ferroraid's pacer --------------------------------------------------------------------

/// Tunables of [`FerroraidPacer`]; the defaults are what `docs/PACING.md` argues for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FerroraidPacerConfig {
    /// Floor and ceiling.
    pub limits: SpeedLimits,
    /// Control window, ns (10 ms: a QD1 SSD reader completes ~80 requests in it).
    pub window_ns: u64,
    /// Foreground is absent after this long without a foreground request in flight or
    /// completing, ns (5 ms); then background runs at `speed_max`.
    pub absent_ns: u64,
    /// Foreground latency allowed over its quiet p99 (the baseline), as a fraction: the
    /// p99 of each window is to stay within `baseline × (1 + tolerance)`, up to the quiet
    /// device's own noise (0.15: the foreground keeps ≥ ~85 % of its quiet-device speed,
    /// the pacing scenario's target beside 64 readers; 0.10 until
    /// 2026-12-05, which held a healthy array's 64 readers at 99.7 % and the resync below
    /// its 30 %: `docs/BENCHMARKS.md`, "The pacing scenario's 64-job rows, measured
    /// further").
    pub tolerance: f64,
    /// Most background operations in flight while foreground is present (the controller
    /// moves between 1 and this).
    pub max_depth: u32,
    /// Re-measure the quiet baseline after this long with foreground present, ns (5 s):
    /// background pauses for `quiet_probe_ns` (floor permitting).
    pub rebaseline_ns: u64,
    /// Longest quiet probe, ns (250 ms: 16 reads of a seeking disk); a probe ends as soon
    /// as it has its samples (~2 ms for a QD1 SSD reader).
    pub quiet_probe_ns: u64,
}

/// Largest foreground latency tolerance an operator may give
/// ([`FerroraidPacerConfig::tolerance_from_percent`]), percent: 10× the quiet latency.
pub const MAX_TOLERANCE_PERCENT: u64 = 1000;

impl FerroraidPacerConfig {
    /// [`FerroraidPacerConfig::tolerance`] from a whole percentage (`ferroraid serve
    /// --pacer-tolerance`): 15 gives 0.15, the default.
    ///
    /// # Errors
    /// A message naming the accepted range for 0 (nothing would be allowed over the quiet
    /// latency, not even the device's own noise in the median) or more than
    /// [`MAX_TOLERANCE_PERCENT`].
    pub fn tolerance_from_percent(percent: u64) -> Result<f64, String> {
        if percent == 0 || percent > MAX_TOLERANCE_PERCENT {
            return Err(format!(
                "pacer tolerance {percent} %: expected 1 to {MAX_TOLERANCE_PERCENT} (percent of the \
                 foreground's quiet latency that background may add)"
            ));
        }
        Ok(percent as f64 / 100.0)
    }
}

impl Default for FerroraidPacerConfig {
    fn default() -> Self {
        Self {
            limits: SpeedLimits::default(),
            window_ns: 10_000_000,
            absent_ns: 5_000_000,
            tolerance: 0.15,
            max_depth: 64,
            rebaseline_ns: 5 * NS_PER_S,
            quiet_probe_ns: 250_000_000,
        }
    }
}

/// What [`FerroraidPacer`] decided at the end of a control window (tracing:
/// [`FerroraidPacer::last_window`]; `pacing-realtime --trace` prints every one).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PacerWindow {
    /// When the window closed, ns (the executor's clock).
    pub end_ns: u64,
    /// Foreground requests completed in the window.
    pub samples: u64,
    /// Of them, slower than `allowed_ns`.
    pub over: u64,
    /// How many may be ([`FerroraidPacer::allowance`]); more is a miss.
    pub allowance: f64,
    /// The window's median foreground latency, ns.
    pub p50_ns: u64,
    /// The median allowed: the quiet reference's median × (1 + tolerance), ns.
    pub allowed_p50_ns: u64,
    /// The window's mean foreground latency, each request counted at most at
    /// `allowed_ns` (winsorized), ns.
    pub mean_ns: u64,
    /// The mean allowed: the quiet reference's mean (winsorized the same way) ×
    /// (1 + tolerance), plus three standard errors of a window this size, ns.
    pub allowed_mean_ns: u64,
    /// The window's 99th-percentile foreground latency, ns.
    pub p99_ns: u64,
    /// The window's slowest foreground request, ns.
    pub max_ns: u64,
    /// The quiet baseline the window was judged against, ns.
    pub baseline_ns: u64,
    /// The latency allowed while background runs, ns.
    pub allowed_ns: u64,
    /// The quiet reference's share of requests slower than `allowed_ns` (estimated).
    pub quiet_over: f64,
    /// Background operations in flight when the window closed.
    pub bg_in_flight: u32,
    /// The verdict.
    pub verdict: WindowVerdict,
    /// Rate `R` after the verdict, bytes/s per member.
    pub rate: u64,
    /// Depth cap `D` after the verdict, operations.
    pub depth: u32,
}

/// A control window's verdict ([`PacerWindow::verdict`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WindowVerdict {
    /// No verdict: foreground absent, no baseline yet, the window after foreground
    /// resumed, or too few samples.
    #[default]
    None,
    /// Within the allowance; no change (waiting for `probe_after` good windows).
    Met,
    /// Within the allowance; the rate and depth were raised (a probe).
    Probe,
    /// Over the allowance; the rate and depth were cut.
    Miss,
}

/// A probe [`FerroraidPacer`] undid at once because a foreground request missed during it
/// ([`FerroraidPacer::last_revert`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PacerRevert {
    /// When, ns (the executor's clock).
    pub at_ns: u64,
    /// The foreground request's latency, ns.
    pub latency_ns: u64,
    /// The latency allowed, ns.
    pub allowed_ns: u64,
    /// Whether a background operation was in flight at any time during the request (if
    /// not, background cannot have slowed it down).
    pub overlapped_background: bool,
}

/// Quiet samples for a first baseline, and new ones a re-measurement waits for.
const BASELINE_SAMPLES: u64 = 16;
/// The quiet reference keeps the last `REFERENCE_EPOCH..2 × REFERENCE_EPOCH` quiet
/// requests (two epochs). A p99 and the share of quiet requests past the allowance need
/// hundreds of samples (the p99 of 16 samples is their maximum); 512 is ~70 ms of a QD1
/// SSD reader, and one epoch still drops requests older than a few re-measurements.
const REFERENCE_EPOCH: u64 = 512;
/// Requests of the quiet reference that may lie above its baseline however small the
/// reference is (2: one or two stalls of the host among the first 16 quiet requests do
/// not set the baseline).
const REFERENCE_TRIM: f64 = 2.0;
/// Longest wait between increases after failed ones, windows.
const MAX_PROBE_AFTER: u32 = 64;
/// Foreground samples a window needs for a verdict.
const WINDOW_SAMPLES: u64 = 4;
/// Share of foreground requests background may push past the allowed latency: the
/// quantile the control law keeps within tolerance is `1 − TAIL_SHARE` (the p99).
const TAIL_SHARE: f64 = 0.01;
/// Smallest factor one window's miss multiplies the rate and depth by (AIMD's halving).
const MAX_CUT: f64 = 0.5;
/// Width of the noise margin, standard deviations of the count of slow requests a quiet
/// device gives a window (3: a window of a quiet device passes ~99.9 % of the time).
const NOISE_SIGMAS: f64 = 3.0;

/// ferroraid's background pacer; the control law is in `docs/PACING.md`.
///
/// In short: while foreground is absent (nothing in flight or completed for
/// `absent_ns`), background runs at `speed_max`. While present, a token bucket at rate
/// `R` and a depth cap `D` admit background. The *allowed latency* is the p99 of
/// foreground requests that ran with no background in flight (the quiet reference, the
/// last 512–1024 of them) × `1 + tolerance`; every window, the foreground requests slower
/// than that are counted, and the window *misses* only when there are more of them than
/// 1 % of the window plus what the quiet device itself gives (the quiet reference's share
/// past the allowed latency, with a 3-sigma binomial margin): a statistical test of
/// "background kept the p99 within tolerance", which the odd slow request of a noisy
/// host does not fail. A window also misses when its median is over the quiet median ×
/// `1 + tolerance` (a host stalling more than 1 % of requests makes the quiet p99 a
/// stall), and when its mean, each request counted at most at the allowed latency, is over
/// the quiet mean (counted the same way) × `1 + tolerance` plus three standard errors of
/// the window's mean (latencies at a few levels — one or two service times of a deep
/// queue — let background cost the foreground throughput while every quantile stays
/// put). A miss cuts `R` and `D` in proportion to how far the window's allowed quantile,
/// median or mean is over the line (at most by half). Good windows raise whichever of `R`
/// and `D` held background back: at once while the step stays below the level that
/// last missed (doubling below half of it, or before any miss; else a quarter more `R`,
/// one more `D`), after `probe_after` good windows when it reaches that level (a probe of
/// the frontier, undone as soon as it shows; each failed step doubles `probe_after`, each
/// step that holds halves it). `R`
/// stays in `speed_min..=speed_max`; a floor bucket at `speed_min` admits background even
/// past `D` when it has fallen behind the floor. When foreground resumes, the last
/// present-state `R` and `D` apply at once.
pub struct FerroraidPacer {
    cfg: FerroraidPacerConfig,
    rate: u64,
    depth: u32,
    tokens: i64,
    floor_tokens: i64,
    last_refill: u64,
    fg_in_flight: u32,
    fg_last_ns: u64,
    fg_seen: bool,
    bg_in_flight: u32,
    /// Last time background had something in flight, ns.
    bg_busy_ns: u64,
    window_start: u64,
    window: LatencyHistogram,
    /// Requests of the window slower than `allowed_ns`; the last window's sample count.
    window_over: u64,
    /// Sum of the window's latencies, each at most `allowed_ns` (winsorized), ns.
    window_sum_ns: u64,
    last_window_samples: u64,
    /// Quiet requests: the current and the previous epoch, and both merged (the
    /// reference; kept to avoid allocating when it is recomputed).
    quiet_cur: LatencyHistogram,
    quiet_prev: LatencyHistogram,
    reference: Histogram<u64>,
    /// Quiet requests since the reference was last recomputed.
    quiet_new: u64,
    /// The reference's p99 (the baseline), ns; 0 before the first.
    baseline_ns: u64,
    /// The allowed latency: `baseline_ns × (1 + tolerance)`, ns.
    allowed_ns: u64,
    /// The allowed median: the reference's median × (1 + tolerance), ns.
    allowed_median_ns: u64,
    /// The allowed mean: the reference's mean, each request counted at most at
    /// `allowed_ns`, × (1 + tolerance), ns; and the standard deviation of one such
    /// (winsorized) quiet request, ns, for the window's noise margin.
    allowed_mean_ns: f64,
    quiet_sd_ns: f64,
    /// The reference's share of quiet requests slower than `allowed_ns` (estimated with
    /// one pseudo-observation each way, so a small reference is not taken for a
    /// noiseless device).
    quiet_over: f64,
    /// When the last baseline was taken; until when background holds for a quiet probe.
    baseline_at: u64,
    quiet_until: u64,
    last_bytes: u64,
    /// Good windows since the last change, in a row overall; windows to wait before an
    /// increase; the last window increased.
    met_run: u32,
    good_run: u32,
    probe_after: u32,
    probing: bool,
    before_rate: u64,
    before_depth: u32,
    /// The rate and depth that last missed (a window's, or a probe's that was undone; 0:
    /// none yet): steps up to below them are free, steps reaching them are probes.
    miss_rate: u64,
    miss_depth: u32,
    /// The depth cap, or the rate, held background back in this window (only a limit
    /// that binds is raised).
    depth_limited: bool,
    rate_limited: bool,
    /// The window after foreground resumed: no verdict.
    grace: bool,
    /// The last window's verdict, and how many windows and probe reverts there were.
    last_window: PacerWindow,
    windows: u64,
    last_revert: PacerRevert,
    reverts: u64,
}

impl FerroraidPacer {
    /// A pacer with `cfg`.
    pub fn new(cfg: FerroraidPacerConfig) -> Self {
        let rate = cfg.limits.speed_min.max(1);
        Self {
            cfg,
            rate,
            depth: 1,
            tokens: 0,
            floor_tokens: 0,
            last_refill: 0,
            fg_in_flight: 0,
            fg_last_ns: 0,
            fg_seen: false,
            bg_in_flight: 0,
            bg_busy_ns: 0,
            window_start: 0,
            window: LatencyHistogram::new(),
            window_over: 0,
            window_sum_ns: 0,
            last_window_samples: 0,
            quiet_cur: LatencyHistogram::new(),
            quiet_prev: LatencyHistogram::new(),
            reference: crate::array::new_latency_histogram(),
            quiet_new: 0,
            baseline_ns: 0,
            allowed_ns: 0,
            allowed_median_ns: 0,
            allowed_mean_ns: 0.0,
            quiet_sd_ns: 0.0,
            quiet_over: 0.0,
            baseline_at: 0,
            quiet_until: 0,
            last_bytes: 0,
            met_run: 0,
            good_run: 0,
            probe_after: 1,
            probing: false,
            before_rate: rate,
            before_depth: 1,
            miss_rate: 0,
            miss_depth: 0,
            depth_limited: false,
            rate_limited: false,
            grace: false,
            last_window: PacerWindow::default(),
            windows: 0,
            last_revert: PacerRevert::default(),
            reverts: 0,
        }
    }

    /// Whether foreground I/O is present at `now_ns`.
    pub fn foreground_present(&self, now_ns: u64) -> bool {
        self.fg_seen
            && (self.fg_in_flight > 0
                || now_ns.saturating_sub(self.fg_last_ns) < self.cfg.absent_ns)
    }

    /// The rate background is admitted at now, bytes/s per member (`speed_max` while
    /// foreground is absent).
    pub fn rate(&self, now_ns: u64) -> u64 {
        if self.foreground_present(now_ns) {
            self.rate
        } else {
            self.cfg.limits.speed_max
        }
    }

    /// Background operations allowed in flight while foreground is present.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// The foreground's quiet-baseline p99 latency, ns (0: not measured yet).
    pub fn baseline_ns(&self) -> u64 {
        self.baseline_ns
    }

    /// The foreground latency allowed while background runs, ns: the quiet baseline ×
    /// (1 + tolerance) (0: no baseline yet).
    pub fn allowed_ns(&self) -> u64 {
        self.allowed_ns
    }

    /// How many of a window's `samples` foreground requests may be slower than
    /// [`FerroraidPacer::allowed_ns`] before the window misses: 1 % of them (the p99),
    /// plus the share the quiet device itself has past that line, plus 3 standard
    /// deviations of that share's count (binomial).
    pub fn allowance(&self, samples: u64) -> f64 {
        super::law::slow_allowance(samples, self.quiet_over, TAIL_SHARE, NOISE_SIGMAS)
    }

    /// The last control window's verdict and inputs.
    pub fn last_window(&self) -> &PacerWindow {
        &self.last_window
    }

    /// Control windows closed so far (a new [`FerroraidPacer::last_window`] each).
    pub fn windows(&self) -> u64 {
        self.windows
    }

    /// Probes undone at once because a foreground request missed during them.
    pub fn reverts(&self) -> u64 {
        self.reverts
    }

    /// The last probe undone at once, and the request that undid it.
    pub fn last_revert(&self) -> &PacerRevert {
        &self.last_revert
    }

    fn refill(&mut self, now: u64) {
        let dt = now.saturating_sub(self.last_refill);
        self.last_refill = now.max(self.last_refill);
        let rate = self.rate(now);
        // Burst: 10 ms at the rate, at least one operation.
        let burst = bytes_for(10_000_000, rate).max(self.last_bytes) as i64;
        self.tokens = (self.tokens + bytes_for(dt, rate) as i64).min(burst);
        let floor_cap = bytes_for(NS_PER_S, self.cfg.limits.speed_min).max(self.last_bytes) as i64;
        self.floor_tokens =
            (self.floor_tokens + bytes_for(dt, self.cfg.limits.speed_min) as i64).min(floor_cap);
    }

    /// The next rate up, and whether it stays below the last rate that missed: double
    /// while below half of it (or before any miss), else a quarter more (and the floor's
    /// rate over one window, so the floor itself climbs).
    fn next_rate(&self) -> (u64, bool) {
        let r = self.rate;
        let next = if self.miss_rate == 0 || r.saturating_mul(2) < self.miss_rate {
            r.saturating_mul(2)
        } else {
            r + r / 4 + bytes_for(self.cfg.window_ns, self.cfg.limits.speed_min)
        }
        .min(self.cfg.limits.speed_max);
        (next, self.miss_rate == 0 || next < self.miss_rate)
    }

    /// The next depth up, and whether it stays below the last depth that missed: double
    /// while below half of it (or before any miss), else one more.
    fn next_depth(&self) -> (u32, bool) {
        let d = self.depth;
        let next = if self.miss_depth == 0 || d.saturating_mul(2) < self.miss_depth {
            d.saturating_mul(2)
        } else {
            d + 1
        }
        .min(self.cfg.max_depth);
        (next, self.miss_depth == 0 || next < self.miss_depth)
    }

    /// Records a quiet request (no background in flight at any time during it).
    fn quiet_sample(&mut self, now: u64, lat: u64) {
        self.quiet_cur.record(lat);
        self.quiet_new += 1;
        if self.quiet_cur.len() >= REFERENCE_EPOCH {
            std::mem::swap(&mut self.quiet_cur, &mut self.quiet_prev);
            self.quiet_cur.reset();
        }
        if self.quiet_new >= BASELINE_SAMPLES {
            self.quiet_new = 0;
            self.update_reference(now);
        }
    }

    /// Recomputes the baseline, the allowed latency and the quiet share past it from the
    /// quiet reference; ends a quiet probe.
    fn update_reference(&mut self, now: u64) {
        self.reference.reset();
        // Same bounds: adding never fails (nor allocates).
        self.quiet_prev.add_to(&mut self.reference);
        self.quiet_cur.add_to(&mut self.reference);
        let r = &self.reference;
        let n = r.len();
        if n == 0 {
            return;
        }
        // The p99, or in a reference too small for one, the value with
        // `REFERENCE_TRIM` requests above it: one stalled request among the first 16
        // would otherwise be the baseline, and a baseline too high lets background
        // run so fast that no quiet request comes to correct it.
        let q = (1.0 - TAIL_SHARE).min(1.0 - REFERENCE_TRIM / n as f64);
        self.baseline_ns = r.value_at_quantile(q.max(0.5));
        let allowed = (self.baseline_ns as f64 * (1.0 + self.cfg.tolerance)) as u64;
        // The last value of its histogram bucket: "slower than allowed" means the same in
        // the reference (bucket counts) and in the window (each request).
        self.allowed_ns = r.highest_equivalent(allowed.max(1));
        let median = (r.value_at_quantile(0.5) as f64 * (1.0 + self.cfg.tolerance)) as u64;
        self.allowed_median_ns = r.highest_equivalent(median.max(1));
        let over = r.count_between(self.allowed_ns + 1, u64::MAX);
        self.quiet_over = (over as f64 + 1.0) / (n as f64 + 2.0);
        // The winsorized mean and spread: a quiet request slower than `allowed_ns`
        // counts as `allowed_ns` (the tail is the p99 test's; a host stall must not move
        // the mean). Iterating the recorded buckets does not allocate.
        let (mut sum, mut sum_sq) = (0.0f64, 0.0f64);
        for v in r.iter_recorded() {
            let x = v.value_iterated_to().min(self.allowed_ns) as f64;
            let c = v.count_at_value() as f64;
            sum += x * c;
            sum_sq += x * x * c;
        }
        let mean = sum / n as f64;
        self.quiet_sd_ns = (sum_sq / n as f64 - mean * mean).max(0.0).sqrt();
        self.allowed_mean_ns = mean * (1.0 + self.cfg.tolerance);
        self.baseline_at = now;
        self.quiet_until = 0;
    }

    /// Starts a quiet probe: background holds (floor permitting) until
    /// `BASELINE_SAMPLES` new quiet requests are in, at most `quiet_probe_ns`.
    fn start_quiet_probe(&mut self, now: u64) {
        self.quiet_until = now + self.cfg.quiet_probe_ns;
        self.baseline_at = now;
        self.quiet_new = 0;
    }

    /// Undoes the probe in force: a foreground request showed it over the allowance.
    fn revert_probe(&mut self, now: u64, lat: u64, quiet: bool) {
        self.probing = false;
        self.reverts += 1;
        self.last_revert = PacerRevert {
            at_ns: now,
            latency_ns: lat,
            allowed_ns: self.allowed_ns,
            overlapped_background: !quiet,
        };
        self.probe_after = (self.probe_after * 2).min(MAX_PROBE_AFTER);
        self.met_run = 0;
        self.good_run = 0;
        // What the probe raised missed: from now on, approach it slowly.
        if self.rate > self.before_rate {
            self.miss_rate = self.rate;
        }
        if self.depth > self.before_depth {
            self.miss_depth = self.depth;
        }
        self.rate = self.before_rate;
        self.depth = self.before_depth;
        // That was this window's verdict; the next one judges the state restored.
        self.window.reset();
        self.window_over = 0;
        self.window_sum_ns = 0;
        self.window_start = now;
    }

    /// The mean a window of `samples` requests may have: the allowed mean plus
    /// `NOISE_SIGMAS` standard errors of the quiet requests' mean over that many, ns.
    fn allowed_window_mean(&self, samples: u64) -> f64 {
        self.allowed_mean_ns + NOISE_SIGMAS * self.quiet_sd_ns / (samples.max(1) as f64).sqrt()
    }

    fn close_window(&mut self, now: u64) {
        if now < self.window_start + self.cfg.window_ns {
            return;
        }
        let present = self.foreground_present(now);
        let grace = std::mem::take(&mut self.grace);
        let n = self.window.len();
        let allowance = self.allowance(n);
        // The window's mean, each request counted at most at `allowed_ns`, and the mean
        // it may have (ns; 0 for an empty window).
        let mean = self.window_sum_ns as f64 / n.max(1) as f64;
        let allowed_mean = self.allowed_window_mean(n);
        let mut verdict = WindowVerdict::None;
        if present && !grace && self.baseline_ns > 0 && n >= WINDOW_SAMPLES {
            // The body of the latency too: the window's median within tolerance of the
            // quiet median. The p99 test alone protects nothing on a host whose stalls
            // are more than 1 % of requests (its quiet p99 is a stall).
            let median = self.window.histogram().value_at_quantile(0.5);
            // And the mean: what a closed-loop client's throughput follows. Quantiles
            // are blind where latencies sit at a few levels (one or two service times
            // of a deep queue): background can move requests from the fast level to
            // the slow one, costing the foreground a fifth of its throughput, while
            // the median and p99 stay where they were.
            if self.window_over as f64 <= allowance
                && median <= self.allowed_median_ns
                && mean <= allowed_mean
            {
                verdict = WindowVerdict::Met;
                if std::mem::take(&mut self.probing) {
                    // The last step held: the next probe comes twice as soon (after a
                    // spurious miss, the climb back past the frontier accelerates).
                    self.probe_after = (self.probe_after / 2).max(1);
                }
                self.good_run += 1;
                if self.good_run >= 64.max(4 * self.probe_after) {
                    self.probe_after = (self.probe_after / 2).max(1);
                    self.good_run = 0;
                }
                self.met_run += 1;
                // Raise what held background back. A step that stays below the level
                // that last missed is taken at once (doubling while below half of it, or
                // before any miss); one that reaches or passes it (a probe of the
                // frontier) waits `probe_after` good windows.
                let (rate, rate_free) = self.next_rate();
                let (depth, depth_free) = self.next_depth();
                let raise_rate = self.rate_limited
                    && rate > self.rate
                    && (rate_free || self.met_run >= self.probe_after);
                let raise_depth = self.depth_limited
                    && depth > self.depth
                    && (depth_free || self.met_run >= self.probe_after);
                if raise_rate || raise_depth {
                    verdict = WindowVerdict::Probe;
                    self.met_run = 0;
                    self.probing = true;
                    self.before_rate = self.rate;
                    self.before_depth = self.depth;
                    if raise_rate {
                        self.rate = rate;
                    }
                    if raise_depth {
                        self.depth = depth;
                    }
                }
            } else {
                verdict = WindowVerdict::Miss;
                if std::mem::take(&mut self.probing) {
                    // The last increase hurt: wait twice as long before the next.
                    self.probe_after = (self.probe_after * 2).min(MAX_PROBE_AFTER);
                }
                self.met_run = 0;
                self.good_run = 0;
                self.miss_rate = self.rate;
                self.miss_depth = self.depth;
                // Cut in proportion to the overshoot of the allowed quantile: the latency
                // of the first request past the allowance (the k-th slowest), not the
                // slowest one, which a single stall of the host decides; at most by half
                // a window (a request queued behind one background operation is slower by
                // that operation's whole service time, however little background there
                // is: the overshoot overstates the excess).
                let k = (allowance.floor() as u64 + 1).min(n);
                let q = ((n - k) as f64 + 0.5) / n as f64;
                let over = self
                    .window
                    .histogram()
                    .value_at_quantile(q)
                    .max(self.allowed_ns + 1);
                let f = (self.allowed_ns as f64 / over as f64)
                    .min(self.allowed_median_ns as f64 / median as f64)
                    .min(allowed_mean / mean)
                    .max(MAX_CUT);
                self.rate = ((self.rate as f64 * f) as u64).max(self.cfg.limits.speed_min);
                self.depth = ((f64::from(self.depth) * f) as u32).max(1);
                tracing::trace!(
                    over = self.window_over,
                    allowance,
                    allowed_ns = self.allowed_ns,
                    rate = self.rate,
                    depth = self.depth,
                    "pacer: foreground over its allowance"
                );
            }
        }
        let w = self.window.histogram();
        self.last_window = PacerWindow {
            end_ns: now,
            samples: n,
            over: self.window_over,
            allowance,
            p50_ns: w.value_at_quantile(0.5),
            allowed_p50_ns: self.allowed_median_ns,
            mean_ns: mean as u64,
            allowed_mean_ns: allowed_mean as u64,
            p99_ns: w.value_at_quantile(0.99),
            max_ns: w.max(),
            baseline_ns: self.baseline_ns,
            allowed_ns: self.allowed_ns,
            quiet_over: self.quiet_over,
            bg_in_flight: self.bg_in_flight,
            verdict,
            rate: self.rate,
            depth: self.depth,
        };
        self.windows += 1;
        // Re-measure the baseline every `rebaseline_ns`, or retry soon after a probe that
        // ended without enough samples.
        let due = if self.baseline_ns > 0 {
            self.cfg.rebaseline_ns
        } else {
            4 * self.cfg.quiet_probe_ns
        };
        if present && now.saturating_sub(self.baseline_at) >= due && self.quiet_until < now {
            // Re-measure the quiet baseline: hold background briefly.
            self.start_quiet_probe(now);
        }
        self.window.reset();
        self.window_over = 0;
        self.window_sum_ns = 0;
        self.depth_limited = false;
        self.rate_limited = false;
        self.last_window_samples = n;
        self.window_start = now;
    }
}

impl Pacer for FerroraidPacer {
    fn foreground_submitted(&mut self, now_ns: u64) {
        if !self.foreground_present(now_ns) {
            if self.baseline_ns == 0 {
                // Foreground arrives with no baseline: measure one first.
                self.start_quiet_probe(now_ns);
            }
            // Foreground resumes: the present-state rate and depth apply from now; the
            // first window (background admitted at full speed still draining) gets no
            // verdict.
            self.window.reset();
            self.window_over = 0;
            self.window_sum_ns = 0;
            self.window_start = now_ns;
            self.grace = true;
            self.probing = false;
            self.tokens = self.tokens.min(0);
        }
        self.fg_seen = true;
        self.fg_in_flight += 1;
        self.fg_last_ns = now_ns;
    }

    fn foreground_done(&mut self, now_ns: u64, latency_ns: u64, _bytes: u64, _read: bool) {
        self.fg_in_flight = self.fg_in_flight.saturating_sub(1);
        self.fg_last_ns = now_ns;
        let lat = latency_ns.max(1);
        self.window.record(lat);
        let capped = if self.baseline_ns > 0 {
            lat.min(self.allowed_ns)
        } else {
            lat
        };
        self.window_sum_ns = self.window_sum_ns.saturating_add(capped);
        // Quiet: no background in flight at any time during this request.
        let quiet = self.bg_in_flight == 0 && self.bg_busy_ns <= now_ns.saturating_sub(lat);
        if self.baseline_ns > 0 && lat > self.allowed_ns {
            self.window_over += 1;
            // During a probe, undo it as soon as the window has more slow requests than
            // a whole window (as long as the last one) may have: its verdict is known.
            let expected = self.window.len().max(self.last_window_samples);
            if self.probing && self.window_over as f64 > self.allowance(expected) {
                self.revert_probe(now_ns, lat, quiet);
            }
        }
        if quiet {
            self.quiet_sample(now_ns, lat);
        }
        self.close_window(now_ns);
    }

    fn foreground_done_unmeasured(&mut self, now_ns: u64, _bytes: u64, _read: bool) {
        // Present, no longer in flight; not in the window (a cache hit's latency would
        // dilute the members' signal) nor a quiet sample.
        self.fg_in_flight = self.fg_in_flight.saturating_sub(1);
        self.fg_last_ns = now_ns;
        self.close_window(now_ns);
    }

    fn background_done(&mut self, now_ns: u64, _latency_ns: u64, _bytes_per_member: u64) {
        self.bg_in_flight = self.bg_in_flight.saturating_sub(1);
        self.bg_busy_ns = now_ns;
    }

    fn admit(&mut self, now_ns: u64, bytes_per_member: u64, in_flight: u32) -> Admission {
        self.last_bytes = self.last_bytes.max(bytes_per_member);
        self.bg_in_flight = in_flight;
        self.refill(now_ns);
        self.close_window(now_ns);
        let bytes = bytes_per_member as i64;
        // Behind the floor: admit whatever the controller says.
        if self.floor_tokens >= bytes {
            return self.admitted(now_ns, bytes);
        }
        let present = self.foreground_present(now_ns);
        // Never promise to wait past the point where foreground could have gone absent
        // (then background may run at full speed at once).
        let recheck = now_ns + self.cfg.absent_ns.max(1);
        if present && now_ns < self.quiet_until {
            return Admission::NotBefore(self.quiet_until.min(recheck));
        }
        if present && in_flight >= self.depth {
            self.depth_limited = true;
            return Admission::AfterCompletion;
        }
        if self.tokens >= bytes || (self.tokens >= 0 && in_flight == 0) {
            return self.admitted(now_ns, bytes);
        }
        self.rate_limited |= present;
        let need = (bytes - self.tokens.max(0)) as u64;
        let mut wait = ns_for(need, self.rate(now_ns)).max(1);
        if present {
            // Wake at the floor's deadline if it comes first.
            wait = wait.min(ns_for(
                (bytes - self.floor_tokens) as u64,
                self.cfg.limits.speed_min,
            ));
        }
        Admission::NotBefore((now_ns + wait).min(recheck))
    }
}

impl FerroraidPacer {
    fn admitted(&mut self, now_ns: u64, bytes: i64) -> Admission {
        self.tokens -= bytes;
        self.floor_tokens -= bytes;
        // Debt is bounded: at most a second at the floor.
        let floor_debt = -(bytes_for(NS_PER_S, self.cfg.limits.speed_min) as i64);
        self.floor_tokens = self.floor_tokens.max(floor_debt);
        self.bg_in_flight += 1;
        self.bg_busy_ns = now_ns;
        Admission::Now
    }
}

// ---- choosing a pacer ---------------------------------------------------------------------

/// Which background pacer a target runs (`ferroraid serve --pacer`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PacerKind {
    /// [`FerroraidPacer`] (the default).
    #[default]
    Ferroraid,
    /// [`MdPre41Pacer`]: md's "minimum speed when not idle" rule.
    MdMin,
    /// [`Md41Pacer`]: md's (4.1+) "wait for own pending requests" rule.
    MdPending,
}

impl PacerKind {
    /// The name `--pacer` takes: `ferroraid`, `md-min`, `md-pending`.
    pub fn name(self) -> &'static str {
        match self {
            PacerKind::Ferroraid => "ferroraid",
            PacerKind::MdMin => "md-min",
            PacerKind::MdPending => "md-pending",
        }
    }

    /// A pacer of this kind with guard rails `limits`, for one shard of an array of
    /// `members` member devices (md's idle test counts foreground per member);
    /// `tolerance` is [`FerroraidPacerConfig::tolerance`] (md's pacers have none and
    /// ignore it).
    pub fn build(self, limits: SpeedLimits, members: u16, tolerance: f64) -> Box<dyn Pacer> {
        match self {
            PacerKind::Ferroraid => Box::new(FerroraidPacer::new(FerroraidPacerConfig {
                limits,
                tolerance,
                ..FerroraidPacerConfig::default()
            })),
            PacerKind::MdMin => Box::new(MdPre41Pacer::new(limits).with_members(members)),
            PacerKind::MdPending => Box::new(Md41Pacer::new(limits).with_members(members)),
        }
    }
}

impl std::str::FromStr for PacerKind {
    type Err = String;

    /// Parses [`PacerKind::name`]; an unknown name is refused with the list of names.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ferroraid" => Ok(PacerKind::Ferroraid),
            "md-min" => Ok(PacerKind::MdMin),
            "md-pending" => Ok(PacerKind::MdPending),
            _ => Err(format!(
                "pacer {s:?}: expected \"ferroraid\", \"md-min\" or \"md-pending\""
            )),
        }
    }
}

impl SpeedLimits {
    /// Limits from md's sysctl unit, KiB/s per member (`speed_limit_min`,
    /// `speed_limit_max`; md's defaults are 1000 and 200000).
    ///
    /// # Errors
    /// A message for a minimum of 0 (background must always progress), a maximum below
    /// the minimum, or values whose byte rate does not fit in 64 bits.
    pub fn from_kib_per_s(min_kib: u64, max_kib: u64) -> Result<Self, String> {
        if min_kib == 0 {
            return Err("speed_min 0: expected at least 1 KiB/s per member (the floor that keeps background progressing)".into());
        }
        if max_kib < min_kib {
            return Err(format!(
                "speed_max {max_kib} KiB/s is below speed_min {min_kib} KiB/s"
            ));
        }
        let bytes = |k: u64, what: &str| {
            k.checked_mul(1024)
                .ok_or_else(|| format!("{what} {k} KiB/s is too large"))
        };
        Ok(Self {
            speed_min: bytes(min_kib, "speed_min")?,
            speed_max: bytes(max_kib, "speed_max")?,
        })
    }
}

#[cfg(test)]
mod tests;
