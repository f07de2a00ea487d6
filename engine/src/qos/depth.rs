//! Per-member queue-depth control: how many write-class requests (foreground writes and
//! background I/O) a shard keeps in a member's device queue, so that reads queued behind
//! them inside the device keep their latency.
//!
//! One [`DepthController`] per member per shard. The array feeds it every member
//! completion ([`DepthController::on_complete`]: class and device latency, ns from the
//! request's hand-over to the channel to its reaping) and calls
//! [`DepthController::tick`] each loop turn; it answers [`DepthController::limit`] per
//! class. Reads and flushes are never limited (they are what the controller protects);
//! [`IoClass::ForegroundWrite`] and [`IoClass::Background`] together may hold at most
//! `depth_limit` requests in the device, background at most half of that (at least one),
//! so no class is ever held at zero and none can deadlock.
//!
//! Three policies ([`DepthPolicy`]):
//! - [`DepthPolicy::Off`]: no limit beyond the device's queue depth.
//! - [`DepthPolicy::WbtLike`]: Linux blk-wbt's algorithm (block/blk-wbt.c and
//!   block/blk-rq-qos.c, Jens Axboe 2016): 100 ms window shrunk to
//!   `100 ms / sqrt(scale_step + 1)`; the window's minimum read latency against a fixed
//!   target (`wb_lat_usec`, 2 ms non-rotational / 75 ms rotational); step down on
//!   `LAT_EXCEEDED` (min over target, or a read outstanding longer than the window),
//!   up on `LAT_OK` and on write-only windows (`LAT_UNKNOWN_WRITES`, step may go negative
//!   for a deeper queue, capped at 3/4 of the queue depth), back to step 0 after
//!   `RWB_UNKNOWN_BUMP` (5) windows without data; depth `1 + ((16 - 1) >> step)` from a
//!   default of 16 (`RWB_DEF_DEPTH`); a QD=1 device gets 2 at step ≤ 0 and 1 when
//!   scaled down (`rq_depth_calc_max_depth`). Foreground writes use `wb_normal`
//!   (`(max_depth + 1) / 2`), background `wb_background` (`(max_depth + 3) / 4`), as
//!   `calc_wb_limits` sets them. For benchmarking against.
//! - [`DepthPolicy::Ferroraid`]: ferroraid's controller, described on [`DepthPolicy`]
//!   and in `docs/PACING.md`.
//!
//! Everything is preallocated: the window histograms are fixed-size HDR histograms (ns,
//! 2 significant digits) reset in place; nothing allocates per I/O or per window.

use crate::latency::LatencyHistogram;

use super::law::ProbeLaw;
use super::IoClass;

/// Which depth controller a member runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DepthPolicy {
    /// No control: every class may fill the device's queue.
    Off,
    /// Linux blk-wbt's algorithm (see the module docs), as a baseline for benchmarks.
    WbtLike,
    /// ferroraid's controller (the control law and its reasoning: `docs/PACING.md`):
    /// per-class device latency in HDR histograms over short windows (10 ms, or 16 target
    /// latencies on slow devices, at most 1 s). A window *misses* when its minimum read
    /// latency exceeds the target (a standing queue: CoDel's signal) or its p99 exceeds
    /// 1.5 × the target; a miss divides the write-class depth by 2 per doubling of the
    /// latency over target (1 to 4 halvings), and a read dispatched after the last change
    /// that takes over 4 × the target acts at once. A window whose p99 meets the target
    /// counts towards a *probe* (a quarter deeper, halved after each failed probe: a
    /// binary search) after `probe_after` good windows; a read missing during a probe
    /// reverts it at once and doubles `probe_after` (up to 512 windows). Windows without
    /// reads, or without write-class I/O, double the depth back towards the device's
    /// queue depth; writes that start while reads are served begin at depth 4 and double
    /// per good window (slow start). The target is 1.25 × the p99 of reads that found the
    /// device quiet (no write-class request in it or queued), recalibrated every 64 such
    /// reads, never below 50 µs (devices whose reads stay under it are left alone);
    /// [`DepthConfig::target_latency_ns`] overrides it. A device of queue depth 1 is
    /// never limited below 2 (one in the device, one ready behind it). `scale_step`
    /// reports the depth as halvings from the device's queue depth.
    #[default]
    Ferroraid,
}

/// Configuration of one member's depth controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct DepthConfig {
    /// The policy.
    pub policy: DepthPolicy,
    /// Read-latency target, ns (like wbt's `wb_lat_usec`). `None`: derived from
    /// quiet-device latency (ferroraid) or wbt's defaults (2 ms; 75 ms when
    /// `rotational`).
    pub target_latency_ns: Option<u64>,
    /// The device is a rotational disk (only the wbt-like default target uses it).
    pub rotational: bool,
}

/// A controller's state, for status and tests. Latencies are µs (ns resolution).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct QosState {
    /// The policy running.
    pub policy: DepthPolicy,
    /// Write-class (foreground write + background) requests allowed in the device.
    pub depth_limit: u32,
    /// Scaling step: 0 = unthrottled, each step halves the depth; negative (wbt-like
    /// only) = deeper than default.
    pub scale_step: i32,
    /// Read-latency target, µs (0 while not yet derived).
    pub target_latency_us: f64,
    /// Last finished window's read latency median, µs (0: no reads in it).
    pub read_p50_us: f64,
    /// Last finished window's read latency 99th percentile, µs.
    pub read_p99_us: f64,
    /// Last finished window's smallest read latency, µs.
    pub read_min_us: f64,
    /// Depth changes so far.
    pub changes: u64,
}

impl QosState {
    /// Merges the state of the same member on another shard (reactor) into `self`: depth
    /// limits add up (each shard has its own queue pair to the device), the step, target
    /// and read percentiles take the larger, the minimum the smaller non-zero one, changes
    /// add up. Merging into `QosState::default()` copies.
    pub fn merge(&mut self, o: &QosState) {
        if self.depth_limit == 0 {
            *self = *o;
            return;
        }
        self.depth_limit = self.depth_limit.saturating_add(o.depth_limit);
        self.scale_step = self.scale_step.max(o.scale_step);
        self.target_latency_us = self.target_latency_us.max(o.target_latency_us);
        self.read_p50_us = self.read_p50_us.max(o.read_p50_us);
        self.read_p99_us = self.read_p99_us.max(o.read_p99_us);
        // 0 means "no reads in the window": the other shard's value stands.
        self.read_min_us = if self.read_min_us <= 0.0 {
            o.read_min_us
        } else if o.read_min_us <= 0.0 {
            self.read_min_us
        } else {
            self.read_min_us.min(o.read_min_us)
        };
        self.changes += o.changes;
    }
}

/// ferroraid's base window, ns: short enough to react within a few reads of a QD1 reader
/// on an SSD (~75 reads at 130 µs), long enough for a p99.
const WINDOW_NS: u64 = 10_000_000;
/// A window lasts at least this many quiet read latencies (HDDs: ~16 × 13 ms).
const WINDOW_READS: u64 = 16;
/// Longest window, ns.
const MAX_WINDOW_NS: u64 = 1_000_000_000;
/// Targets below this are raised to it: a device whose reads stay under 50 µs under load
/// is fast enough and left alone (scheduling noise of a polled reactor is of this order).
const MIN_TARGET_NS: u64 = 50_000;
/// Quiet reads per target recalibration.
const QUIET_SAMPLES: u64 = 64;
// The p99 of `QUIET_SAMPLES` samples by nearest rank (the ⌈0.99 n⌉-th smallest) is their
// largest while n < 100 (⌈0.99 n⌉ = n): the controller keeps the running maximum, not the samples.
const _: () = assert!((QUIET_SAMPLES * 99).div_ceil(100) == QUIET_SAMPLES);
/// Target = quiet p99 × 5/4.
const TARGET_NUM: u64 = 5;
const TARGET_DEN: u64 = 4;
/// Write-class depth a writer starts at while reads are served (slow start).
const SLOW_START_DEPTH: u32 = 4;
/// wbt: `RWB_WINDOW_NSEC`, `RWB_DEF_DEPTH`, `RWB_MIN_WRITE_SAMPLES`, `RWB_UNKNOWN_BUMP`.
const WBT_WINDOW_NS: u64 = 100_000_000;
const WBT_DEF_DEPTH: u32 = 16;
const WBT_MIN_WRITE_SAMPLES: u64 = 3;
const WBT_UNKNOWN_BUMP: u32 = 5;
/// wbt's default targets (`wbt_default_latency_nsec`).
const WBT_LAT_NONROT_NS: u64 = 2_000_000;
const WBT_LAT_ROT_NS: u64 = 75_000_000;

/// One member's depth controller (one per shard); see the module docs.
pub struct DepthController {
    cfg: DepthConfig,
    /// The device's queue depth (channel capacity).
    queue_depth: u32,
    /// Largest write-class depth (step 0).
    base: u32,
    step: i32,
    depth: u32,
    target_ns: u64,
    window_start: u64,
    window_len: u64,
    reads: LatencyHistogram,
    writes: u64,
    /// Reads that found the device quiet since the last calibration, and the largest of
    /// their latencies, ns: their p99 by nearest rank once there are `QUIET_SAMPLES`
    /// (see the assertion there). A list of the samples and a selection over it cost
    /// some ten instructions per read more.
    quiet_reads: u64,
    quiet_max_ns: u64,
    /// Reads in the device now, and since when the device had one (wbt's `sync_issue`).
    reads_in_flight: u32,
    read_since: u64,
    /// Smallest read latency ever seen (fallback target before calibration), ns.
    best_read_ns: u64,
    /// ferroraid: the depth and its control law (AIMD with probe-revert, shared with
    /// the bulk-share controller: [`super::law`]).
    law: ProbeLaw,
    /// No write-class I/O in the last window.
    write_idle: bool,
    /// The window after an abandoned probe: no verdict.
    grace: bool,
    last_change: u64,
    /// wbt: windows in a row without data; `scaled_max`.
    unknown_cnt: u32,
    scaled_max: bool,
    last: QosState,
    changes: u64,
}

impl DepthController {
    /// A controller for a member whose channel holds `queue_depth` requests.
    pub fn new(cfg: DepthConfig, queue_depth: u32) -> Self {
        let queue_depth = queue_depth.max(1);
        let (base, floor) = match cfg.policy {
            DepthPolicy::Off => (queue_depth, queue_depth),
            DepthPolicy::WbtLike => (WBT_DEF_DEPTH.min(queue_depth), 1),
            // QD=1 devices keep two: one in the device and one ready behind it, so the
            // device never idles between requests (wbt's lesson).
            DepthPolicy::Ferroraid => (queue_depth.max(2), if queue_depth <= 1 { 2 } else { 1 }),
        };
        let target_ns = match (cfg.policy, cfg.target_latency_ns) {
            (_, Some(t)) => t.max(1),
            (DepthPolicy::WbtLike, None) if cfg.rotational => WBT_LAT_ROT_NS,
            (DepthPolicy::WbtLike, None) => WBT_LAT_NONROT_NS,
            _ => 0,
        };
        let mut c = Self {
            cfg,
            queue_depth,
            base,
            step: 0,
            depth: base,
            target_ns,
            window_start: 0,
            window_len: if cfg.policy == DepthPolicy::WbtLike {
                WBT_WINDOW_NS
            } else {
                WINDOW_NS
            },
            reads: LatencyHistogram::new(),
            writes: 0,
            quiet_reads: 0,
            quiet_max_ns: 0,
            reads_in_flight: 0,
            read_since: 0,
            best_read_ns: u64::MAX,
            law: ProbeLaw::new(floor, base),
            write_idle: true,
            grace: false,
            last_change: 0,
            unknown_cnt: 0,
            scaled_max: false,
            last: QosState::default(),
            changes: 0,
        };
        c.depth = c.calc_depth();
        c
    }

    /// The policy running.
    pub fn policy(&self) -> DepthPolicy {
        self.cfg.policy
    }

    /// Requests of `class` allowed in the device at once, given what is there now:
    /// unlimited (`u32::MAX`) for reads and flushes; for foreground writes the write-class
    /// depth; for background half of it (at least 1). The caller also keeps
    /// foreground writes + background within [`DepthController::depth_limit`].
    #[inline]
    pub fn limit(&self, class: IoClass) -> u32 {
        match (self.cfg.policy, class) {
            (DepthPolicy::Off, _) | (_, IoClass::ForegroundRead | IoClass::Flush) => u32::MAX,
            (DepthPolicy::WbtLike, IoClass::ForegroundWrite) => {
                if self.depth <= 2 {
                    self.depth
                } else {
                    self.depth.div_ceil(2)
                }
            }
            (DepthPolicy::WbtLike, IoClass::Background) => {
                if self.depth <= 2 {
                    1
                } else {
                    // wbt: (max_depth + 3) / 4
                    self.depth.div_ceil(4)
                }
            }
            (DepthPolicy::Ferroraid, IoClass::ForegroundWrite) => self.depth,
            (DepthPolicy::Ferroraid, IoClass::Background) => self.depth.div_ceil(2).max(1),
        }
    }

    /// Write-class requests (foreground writes + background) allowed in the device (with
    /// no control, the device's queue depth).
    pub fn depth_limit(&self) -> u32 {
        self.depth
    }

    /// A request of `class` was handed to the device at `now_ns`.
    #[inline]
    pub fn on_dispatch(&mut self, now_ns: u64, class: IoClass) {
        if class == IoClass::ForegroundRead {
            if self.reads_in_flight == 0 {
                self.read_since = now_ns;
            }
            self.reads_in_flight += 1;
        } else if class.is_write_class()
            && self.cfg.policy == DepthPolicy::Ferroraid
            && std::mem::take(&mut self.write_idle)
        {
            let reads_present =
                self.reads_in_flight > 0 || !self.reads.is_empty() || self.last.read_p50_us > 0.0;
            if reads_present && self.law.start_slow(SLOW_START_DEPTH) {
                // Writes start while reads are being served: begin shallow and double
                // per good window (slow start), so a writer's first burst cannot bury
                // the reads before the controller has seen one.
                self.sync_depth(now_ns, "writes start: slow start");
            }
        }
    }

    /// A request of `class` completed after `latency_ns` in the device; `quiet`: it was
    /// a read that found no write-class request in the device when dispatched.
    #[inline]
    pub fn on_complete(&mut self, now_ns: u64, class: IoClass, latency_ns: u64, quiet: bool) {
        let lat = latency_ns.max(1);
        match class {
            IoClass::ForegroundRead => {
                self.reads_in_flight = self.reads_in_flight.saturating_sub(1);
                self.read_since = now_ns;
                self.reads.record(lat);
                self.best_read_ns = self.best_read_ns.min(lat);
                if quiet && self.cfg.target_latency_ns.is_none() {
                    self.quiet_reads += 1;
                    self.quiet_max_ns = self.quiet_max_ns.max(lat);
                    if self.quiet_reads == QUIET_SAMPLES {
                        self.calibrate();
                    }
                }
                let target = self.effective_target();
                if self.cfg.policy == DepthPolicy::Ferroraid
                    && target > 0
                    && ((self.law.probing() && lat > target + target / 2)
                        || (lat > 4 * target && now_ns.saturating_sub(lat) >= self.last_change))
                {
                    // A probe made a read miss, or a read dispatched after the last change
                    // took over four times the target (a writer just started): act now
                    // rather than at the window's end, and give the next window (which
                    // still sees the extra writes drain) grace.
                    self.ferro_miss(now_ns, lat);
                    self.grace = true;
                    self.start_window(now_ns);
                }
            }
            IoClass::ForegroundWrite | IoClass::Background => self.writes += 1,
            IoClass::Flush => {}
        }
    }

    fn calibrate(&mut self) {
        debug_assert_eq!(self.quiet_reads, QUIET_SAMPLES);
        // p99 by nearest rank: with `QUIET_SAMPLES` samples, the largest.
        let p99 = std::mem::take(&mut self.quiet_max_ns);
        self.quiet_reads = 0;
        if self.cfg.policy != DepthPolicy::Ferroraid {
            return;
        }
        let t = (p99.saturating_mul(TARGET_NUM) / TARGET_DEN).max(MIN_TARGET_NS);
        if t != self.target_ns {
            tracing::debug!(
                target_ns = t,
                quiet_p99_ns = p99,
                "qos: read-latency target derived"
            );
        }
        self.target_ns = t;
        self.window_len = (t.saturating_mul(WINDOW_READS) * TARGET_DEN / TARGET_NUM)
            .clamp(WINDOW_NS, MAX_WINDOW_NS);
    }

    /// Advances the controller to `now_ns`: closes the window when it is over.
    /// `write_class_busy`: write-class requests are in the device or waiting for it.
    pub fn tick(&mut self, now_ns: u64, write_class_busy: bool) {
        if self.cfg.policy == DepthPolicy::Off {
            return;
        }
        let len = self.current_window();
        if now_ns < self.window_start.saturating_add(len) {
            return;
        }
        self.record_last();
        match self.cfg.policy {
            DepthPolicy::WbtLike => self.wbt_window(now_ns, write_class_busy),
            DepthPolicy::Ferroraid => self.ferro_window(now_ns, write_class_busy),
            DepthPolicy::Off => {}
        }
        self.start_window(now_ns);
    }

    fn current_window(&self) -> u64 {
        match self.cfg.policy {
            // rwb_arm_timer: win_nsec << 4 / int_sqrt((step + 1) << 8).
            DepthPolicy::WbtLike if self.step > 0 => {
                let s = ((self.step as u64 + 1) << 8).isqrt().max(1);
                (WBT_WINDOW_NS << 4) / s
            }
            _ => self.window_len,
        }
    }

    fn start_window(&mut self, now_ns: u64) {
        self.window_start = now_ns;
        self.reads.reset();
        self.writes = 0;
    }

    fn record_last(&mut self) {
        let us = |ns: u64| ns as f64 / 1000.0;
        let (p50, p99, min) = if self.reads.is_empty() {
            (0.0, 0.0, 0.0)
        } else {
            let h = self.reads.histogram();
            (
                us(h.value_at_quantile(0.5)),
                us(h.value_at_quantile(0.99)),
                us(h.min()),
            )
        };
        self.last.read_p50_us = p50;
        self.last.read_p99_us = p99;
        self.last.read_min_us = min;
    }

    /// The effective target, ns: the derived or configured one, or (before calibration)
    /// twice the best read seen.
    #[inline]
    fn effective_target(&self) -> u64 {
        if self.target_ns > 0 {
            self.target_ns
        } else if self.best_read_ns != u64::MAX {
            self.best_read_ns.saturating_mul(2).max(MIN_TARGET_NS)
        } else {
            0
        }
    }

    fn ferro_window(&mut self, now_ns: u64, busy: bool) {
        if self.reads.is_empty() && self.reads_in_flight > 0 {
            // No read finished, but one is in the device: late (a miss) or not yet.
            let waited = now_ns.saturating_sub(self.read_since);
            let target = self.effective_target();
            if target > 0 && waited > 2 * target && (busy || self.writes > 0) {
                self.ferro_miss(now_ns, waited);
            }
            return;
        }
        if !busy && self.writes == 0 {
            self.write_idle = true;
        }
        if self.reads.is_empty() || (!busy && self.writes == 0) {
            // Reads absent (nothing to protect) or no write-class I/O (the limit holds
            // nothing back): return to full depth, doubling per window.
            let why = if self.reads.is_empty() {
                "reads absent"
            } else {
                "writes absent"
            };
            self.law.relax();
            self.sync_depth(now_ns, why);
            return;
        }
        let target = self.effective_target();
        if target == 0 {
            return;
        }
        let h = self.reads.histogram();
        let (min, p99) = (h.min(), h.value_at_quantile(0.99));
        if std::mem::take(&mut self.grace) {
            return;
        }
        if min > target || p99 > target + target / 2 {
            self.ferro_miss(now_ns, min.max(p99 / 2));
        } else if p99 <= target {
            if let Some(why) = self.law.met() {
                self.sync_depth(now_ns, why);
            }
        } else {
            self.law.hold();
        }
    }

    /// A miss with latency signal `signal_ns` (the window minimum, or half its p99):
    /// [`ProbeLaw::miss`] with the signal's ratio to the target.
    fn ferro_miss(&mut self, now_ns: u64, signal_ns: u64) {
        let target = self.effective_target().max(1);
        let why = self.law.miss(signal_ns / target).unwrap_or("target missed");
        self.sync_depth(now_ns, why);
    }

    /// wb_timer_fn + latency_exceeded.
    fn wbt_window(&mut self, now_ns: u64, busy: bool) {
        let target = self.target_ns;
        // A read outstanding longer than the window, or over target with no read
        // completed: exceeded.
        let sync_lat = if self.reads_in_flight > 0 {
            now_ns.saturating_sub(self.read_since)
        } else {
            0
        };
        let exceeded = sync_lat > self.current_window()
            || (sync_lat > target && self.reads.is_empty())
            || (!self.reads.is_empty()
                && self.writes >= WBT_MIN_WRITE_SAMPLES
                && self.reads.histogram().min() > target);
        let valid = !self.reads.is_empty() && self.writes >= WBT_MIN_WRITE_SAMPLES;
        if exceeded {
            self.wbt_scale_down(now_ns, true);
        } else if valid {
            self.wbt_scale_up(now_ns);
        } else if self.writes > 0 || busy {
            // LAT_UNKNOWN_WRITES
            self.wbt_scale_up(now_ns);
        } else {
            self.unknown_cnt += 1;
            if self.unknown_cnt >= WBT_UNKNOWN_BUMP {
                if self.step > 0 {
                    self.wbt_scale_up(now_ns);
                } else if self.step < 0 {
                    self.wbt_scale_down(now_ns, false);
                }
            }
        }
    }

    fn wbt_scale_up(&mut self, now_ns: u64) {
        if self.scaled_max {
            return;
        }
        self.step -= 1;
        self.unknown_cnt = 0;
        self.apply(now_ns, "scale up");
    }

    fn wbt_scale_down(&mut self, now_ns: u64, hard: bool) {
        if self.depth == 1 {
            return;
        }
        if self.step < 0 && hard {
            self.step = 0;
        } else {
            self.step += 1;
        }
        self.scaled_max = false;
        self.unknown_cnt = 0;
        self.apply(now_ns, "scale down");
    }

    /// ferroraid: applies the law's depth (within floor..=base); the step is the number of
    /// halvings from the base it amounts to, rounded up.
    fn sync_depth(&mut self, now_ns: u64, why: &'static str) {
        let d = self.law.value();
        let mut step = 0;
        while (self.base >> step) > d {
            step += 1;
        }
        self.step = step;
        self.apply(now_ns, why);
    }

    fn apply(&mut self, now_ns: u64, why: &'static str) {
        let before = self.depth;
        self.depth = self.calc_depth();
        self.last_change = now_ns;
        if before != self.depth {
            self.changes += 1;
            tracing::debug!(
                why,
                step = self.step,
                depth_limit = self.depth,
                target_ns = self.effective_target(),
                read_p99_us = self.last.read_p99_us,
                "qos: member depth changed"
            );
        }
    }

    /// `rq_depth_calc_max_depth` for wbt; halving from the base for ferroraid. Sets
    /// `scaled_max` (wbt) when the depth cannot grow further.
    fn calc_depth(&mut self) -> u32 {
        match self.cfg.policy {
            DepthPolicy::Off => self.queue_depth,
            DepthPolicy::WbtLike => {
                if self.queue_depth == 1 {
                    if self.step > 0 {
                        1
                    } else {
                        self.scaled_max = true;
                        2
                    }
                } else {
                    let d = self.base;
                    if self.step > 0 {
                        1 + ((d - 1) >> self.step.min(31))
                    } else if self.step < 0 {
                        let maxd = (3 * self.queue_depth / 4).max(1);
                        let sh = (-self.step).min(31) as u32;
                        let deep = 1u64 + (u64::from(d - 1) << sh);
                        if deep >= u64::from(maxd) {
                            self.scaled_max = true;
                            maxd
                        } else {
                            self.scaled_max = false;
                            deep as u32
                        }
                    } else {
                        self.scaled_max = false;
                        d
                    }
                }
            }
            DepthPolicy::Ferroraid => self.law.value(),
        }
    }

    /// The controller's state now (the `read_*` fields are the last finished window's).
    pub fn state(&self) -> QosState {
        let us = |ns: u64| ns as f64 / 1000.0;
        QosState {
            policy: self.cfg.policy,
            depth_limit: self.depth_limit(),
            scale_step: self.step,
            target_latency_us: us(self.effective_target()),
            changes: self.changes,
            ..self.last
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ferro(qd: u32) -> DepthController {
        DepthController::new(DepthConfig::default(), qd)
    }

    /// Feeds one window of `reads` reads of `lat` ns plus some writes, then closes it.
    fn window(c: &mut DepthController, now: &mut u64, reads: u32, lat: u64, quiet: bool) {
        for _ in 0..reads {
            c.on_dispatch(*now, IoClass::ForegroundRead);
            *now += lat;
            c.on_complete(*now, IoClass::ForegroundRead, lat, quiet);
        }
        for _ in 0..3 {
            c.on_complete(*now, IoClass::ForegroundWrite, 1_000_000, false);
        }
        *now = (*now).max(c.window_start + c.current_window());
        c.tick(*now, true);
    }

    /// The target is 5/4 of the p99, by nearest rank, of each run of 64 quiet reads: their
    /// largest, whatever their order; reads that found writes in the device do not count.
    #[test]
    fn target_is_the_p99_of_each_64_quiet_reads() {
        let mut c = ferro(32);
        let read = |c: &mut DepthController, at: u64, lat: u64, quiet: bool| {
            c.on_dispatch(at, IoClass::ForegroundRead);
            c.on_complete(at + lat, IoClass::ForegroundRead, lat, quiet);
        };
        // 63 quiet reads of 100 µs with one of 300 µs among them, and 1 s reads that were
        // not quiet between them.
        for i in 0..64u64 {
            let lat = if i == 17 { 300_000 } else { 100_000 };
            read(&mut c, i * 1_000, lat, true);
            read(&mut c, i * 1_000, 1_000_000_000, false);
        }
        assert_eq!(c.effective_target(), 375_000, "5/4 of the largest of 64");
        // The next 64 start afresh: their largest alone sets the target.
        for i in 0..63u64 {
            read(&mut c, 100_000 + i, 200_000 - i * 1_000, true);
            assert_eq!(c.effective_target(), 375_000, "recalibrated only at 64");
        }
        read(&mut c, 200_000, 80_000, true);
        assert_eq!(c.effective_target(), 250_000);
    }

    #[test]
    fn target_is_derived_from_quiet_reads() {
        let mut c = ferro(32);
        let mut now = 0;
        for _ in 0..4 {
            window(&mut c, &mut now, 100, 100_000, true);
        }
        let t = c.state().target_latency_us;
        assert!(
            (125.0..127.0).contains(&t),
            "1.25 × quiet p99 (2 significant digits): {t}"
        );
        assert_eq!(c.depth_limit(), 32, "met: left alone");
    }

    #[test]
    fn override_target_and_steps_down_then_up() {
        let cfg = DepthConfig {
            target_latency_ns: Some(200_000),
            ..DepthConfig::default()
        };
        let mut c = DepthController::new(cfg, 32);
        let mut now = 0;
        // Reads at twice the target: one halving per window.
        window(&mut c, &mut now, 10, 400_000, false);
        assert_eq!((c.depth_limit(), c.state().scale_step), (16, 1));
        window(&mut c, &mut now, 10, 400_000, false);
        assert_eq!((c.depth_limit(), c.state().scale_step), (8, 2));
        // Met: probe a quarter deeper.
        window(&mut c, &mut now, 10, 100_000, false);
        assert_eq!((c.depth_limit(), c.state().scale_step), (10, 2));
        // The probe makes a read miss: abandoned at once, back to 8; the next probe
        // waits two good windows and goes half as far.
        window(&mut c, &mut now, 10, 350_000, false);
        assert_eq!(c.depth_limit(), 8);
        window(&mut c, &mut now, 10, 100_000, false);
        assert_eq!(c.depth_limit(), 8);
        window(&mut c, &mut now, 10, 100_000, false);
        assert_eq!(c.depth_limit(), 9);
        // Reads absent: doubling back to the full depth.
        window(&mut c, &mut now, 0, 0, false);
        assert_eq!(c.depth_limit(), 18);
        window(&mut c, &mut now, 0, 0, false);
        assert_eq!(c.depth_limit(), 32);
        assert_eq!(c.state().scale_step, 0);
    }

    #[test]
    fn a_writer_start_is_met_within_a_window() {
        let cfg = DepthConfig {
            target_latency_ns: Some(100_000),
            ..DepthConfig::default()
        };
        let mut c = DepthController::new(cfg, 256);
        // A read 16 × over target half a window in: four halvings at once.
        c.on_dispatch(0, IoClass::ForegroundRead);
        c.on_complete(6_000_000, IoClass::ForegroundRead, 1_600_000, false);
        assert_eq!(c.depth_limit(), 16);
    }

    #[test]
    fn shard_states_merge() {
        let a = QosState {
            policy: DepthPolicy::Ferroraid,
            depth_limit: 4,
            scale_step: 3,
            target_latency_us: 150.0,
            read_p50_us: 120.0,
            read_p99_us: 130.0,
            read_min_us: 0.0,
            changes: 2,
        };
        let b = QosState {
            depth_limit: 8,
            scale_step: 2,
            read_p99_us: 180.0,
            read_min_us: 110.0,
            changes: 1,
            ..a
        };
        let mut m = QosState::default();
        m.merge(&a);
        assert_eq!(m, a, "merging into the default copies");
        m.merge(&b);
        assert_eq!((m.depth_limit, m.scale_step, m.changes), (12, 3, 3));
        assert_eq!((m.read_p99_us, m.read_min_us), (180.0, 110.0));
    }

    #[test]
    fn qd1_device_keeps_two() {
        let cfg = DepthConfig {
            target_latency_ns: Some(1_000),
            ..DepthConfig::default()
        };
        let mut c = DepthController::new(cfg, 1);
        let mut now = 0;
        for _ in 0..10 {
            window(&mut c, &mut now, 4, 10_000_000, false);
        }
        assert_eq!(c.depth_limit(), 2);
        assert_eq!(c.limit(IoClass::ForegroundWrite), 2);
        assert!(c.limit(IoClass::Background) >= 1);
    }

    #[test]
    fn never_limits_a_class_to_zero() {
        for policy in [DepthPolicy::Ferroraid, DepthPolicy::WbtLike] {
            let cfg = DepthConfig {
                policy,
                target_latency_ns: Some(1_000),
                rotational: false,
            };
            let mut c = DepthController::new(cfg, 64);
            let mut now = 0;
            for _ in 0..40 {
                window(&mut c, &mut now, 4, 3_000, false);
                for class in IoClass::ALL {
                    assert!(c.limit(class) >= 1, "{policy:?} {class:?}");
                }
            }
            assert_eq!(c.depth_limit(), 1, "{policy:?} scales down to 1");
        }
    }

    #[test]
    fn wbt_goes_negative_on_write_only_windows() {
        let cfg = DepthConfig {
            policy: DepthPolicy::WbtLike,
            ..DepthConfig::default()
        };
        let mut c = DepthController::new(cfg, 128);
        assert_eq!(c.depth_limit(), 16);
        let mut now = 0;
        for _ in 0..5 {
            window(&mut c, &mut now, 0, 0, false);
        }
        // 1 + 15 << 1 = 31, 61, then capped at 3/4 of 128 = 96.
        assert_eq!(c.depth_limit(), 96);
        // A read over target: hard throttle resets to step 0, then down.
        window(&mut c, &mut now, 3, 5_000_000, false);
        assert_eq!(c.state().scale_step, 0);
        assert_eq!(c.depth_limit(), 16);
        window(&mut c, &mut now, 3, 5_000_000, false);
        assert_eq!(c.depth_limit(), 8);
    }
}
