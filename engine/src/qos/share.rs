//! The bulk share: how many of a shard's stripe operations bulk writes
//! ([`crate::array::RequestClass::BulkWrite`]) may hold, adapted from the latency small
//! reads see (issue 24, docs/PACING.md, "Front door").
//!
//! One [`BulkShare`] per shard. The array reports every small read's submission and
//! completion (latency from `Array::submit` to its completion, ns: everything the reader
//! waits for inside the target and in the devices) and calls [`BulkShare::tick`] each
//! loop turn with whether bulk work is in flight; it reads [`BulkShare::cap`], in stripe
//! operations (each moves at most one stripe's data, so the cap bounds bulk bytes in
//! flight at `cap × stripe data bytes`).
//!
//! **Signal.** Per window (10 ms, extended to at least 8 small reads, at most 100 ms),
//! the small reads slower than the *allowed latency* `A = 2 × B` (at least 50 µs), where
//! `B`, the baseline, is the lowest window median over the last one to two seconds. Why
//! this baseline: a median ignores host stalls hitting fewer than half of the reads, and
//! the lowest window finds the least-disturbed stretch whether or not bulk work was
//! absent — on tmpfs members the depth controller's "quiet" p99 already held CPU
//! scheduling delays (targets of 9–14 ms, docs/BENCHMARKS.md, issue 24) and never held
//! the writer back. To have a low-share window in every span, once a second while small
//! reads and bulk work are both present (and before the first baseline) the share drops
//! to its floor for one window (a *measurement*: ~1 % of the time at the floor).
//!
//! **Law.** The window misses when more reads are past `A` than the pacer's statistical
//! p99 test allows ([`super::law::slow_allowance`]: 1 % plus the share the baseline window
//! itself had past its own double — 1 % until a baseline window of 64 reads measures it —
//! plus 3 σ); the share is then cut by the depth
//! controller's law ([`super::law::ProbeLaw::miss`]: halved per doubling of the p99
//! over `A`, 1–4 halvings), otherwise counted as met (probe a quarter higher after
//! `probe_after` good windows; a probe that hurts is reverted at once). Reads submitted
//! after the last change that take over 4 × `A` (or over 2 × `A` during a probe), two in a
//! row, act at once (one alone may be a stall of the host). Windows without small reads, or without bulk work, double the share back towards
//! the pool: with no small reads, bulk gets every stripe operation.
//!
//! **Bounds.** Floor: [`BULK_FLOOR_BYTES`] of stripes (at least one operation) — bulk is
//! never starved. Ceiling: the whole pool, less one operation while small reads are
//! present (submitted within the last window, or in flight), so that a QD1 reader always
//! finds one free; deeper readers that still wait show up in the signal and cut the share.
//!
//! Nothing allocates after construction (a fixed-size HDR histogram, reset in place).

use crate::latency::LatencyHistogram;

use super::law::{slow_allowance, ProbeLaw};

/// Window length, ns (as the depth controller's: ~75–200 reads of a QD1 SSD reader).
pub const WINDOW_NS: u64 = 10_000_000;
/// Small reads a window waits for (up to [`MAX_WINDOW_NS`]) before its verdict.
pub const WINDOW_READS: u64 = 8;
/// Longest window, ns.
pub const MAX_WINDOW_NS: u64 = 100_000_000;
/// Span of the baseline, ns: the lowest window median of the current and the previous
/// span counts; a measurement window opens each span.
pub const EPOCH_NS: u64 = 1_000_000_000;
/// Allowed small-read latency over the baseline (the target: p99.9 beside a
/// bulk writer ≤ 2 × alone).
pub const ALLOWED_FACTOR: u64 = 2;
/// Smallest allowed latency, ns: below it the reactor's own scheduling noise dominates
/// (the depth controller's floor on its target).
pub const MIN_ALLOWED_NS: u64 = 50_000;
/// Bulk writes always may hold this many bytes of stripes (1 MiB: one typical bulk
/// request at full width), at least one operation.
pub const BULK_FLOOR_BYTES: u64 = 1 << 20;
/// Share of a window's reads allowed past `A` beyond the noise (the p99).
const TAIL_SHARE: f64 = 0.01;
/// The host's noise assumed (share of reads past twice the baseline with no bulk work's
/// doing) until a baseline window holds [`NOISE_READS`] reads to measure it: 1 %.
const NOISE_PRIOR: f64 = 0.01;
/// Reads a baseline window needs for its noise to be measured rather than assumed (with
/// fewer, the pseudo-counts of `(x + 1) / (n + 2)` alone would allow 3 slow reads of 8).
const NOISE_READS: u64 = 64;
/// Noise margin, binomial standard deviations.
const NOISE_SIGMAS: f64 = 3.0;
/// Reads in a row past 4 × the allowed latency (2 × during a probe), submitted after the
/// last change, that cut the share at once instead of at the window's end.
const LATE_RUN: u32 = 2;

/// A bulk share's state, for status and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BulkShareState {
    /// Stripe operations bulk writes may hold now.
    pub cap_ops: u32,
    /// The shard's stripe operations.
    pub pool_ops: u32,
    /// The least bulk writes may hold.
    pub floor_ops: u32,
    /// Fixed by configuration (no control).
    pub fixed: bool,
    /// Baseline small-read latency, µs (0: not measured yet).
    pub baseline_us: f64,
    /// Cuts of the share so far.
    pub cuts: u64,
    /// Raises of the share so far.
    pub raises: u64,
    /// Measurement windows (share at the floor for one window) so far.
    pub measurements: u64,
}

/// Lowest window median of a span, and the share of that window's reads past twice its
/// median (the host's own noise at that latency).
#[derive(Clone, Copy, Debug)]
struct Best {
    median_ns: u64,
    noise: f64,
}

const NO_BEST: Best = Best {
    median_ns: u64::MAX,
    noise: 0.0,
};

/// One shard's bulk-share controller; see the module docs.
pub struct BulkShare {
    pool: u32,
    fixed: Option<u32>,
    law: ProbeLaw,
    cap: u32,
    now: u64,
    window_start: u64,
    window: LatencyHistogram,
    /// Bulk work was in flight at some tick of the window.
    bulk_busy: bool,
    /// The window after an immediate action: no verdict.
    grace: bool,
    /// This window runs at the floor to measure the baseline.
    measuring: bool,
    reads_in_flight: u32,
    /// When the oldest small read in flight was submitted (approximately: when the count
    /// last rose from zero).
    read_since: u64,
    last_read_ns: Option<u64>,
    epoch_start: u64,
    best_cur: Best,
    best_prev: Best,
    last_change_ns: u64,
    /// Reads in a row far over the allowed latency (immediate action at [`LATE_RUN`]).
    late_run: u32,
    state: BulkShareState,
}

impl BulkShare {
    /// A controller for a pool of `pool_ops` stripe operations of `stripe_bytes` of data
    /// each; `fixed_percent`: pin the share at that percentage of the pool (1..=100, at
    /// least one operation) instead of adapting it.
    pub fn new(pool_ops: u32, stripe_bytes: u64, fixed_percent: Option<usize>) -> Self {
        let pool = pool_ops.max(1);
        let floor = BULK_FLOOR_BYTES
            .div_ceil(stripe_bytes.max(1))
            .clamp(1, u64::from(pool)) as u32;
        let fixed = fixed_percent
            .map(|p| ((u64::from(pool) * p.clamp(1, 100) as u64 / 100) as u32).clamp(1, pool));
        let mut s = Self {
            pool,
            fixed,
            law: ProbeLaw::new(floor, pool),
            cap: pool,
            now: 0,
            window_start: 0,
            window: LatencyHistogram::new(),
            bulk_busy: false,
            grace: false,
            measuring: false,
            reads_in_flight: 0,
            read_since: 0,
            last_read_ns: None,
            epoch_start: 0,
            best_cur: NO_BEST,
            best_prev: NO_BEST,
            last_change_ns: 0,
            late_run: 0,
            state: BulkShareState {
                pool_ops: pool,
                floor_ops: floor,
                fixed: fixed.is_some(),
                ..BulkShareState::default()
            },
        };
        s.update_cap();
        s
    }

    /// Stripe operations bulk writes may hold now.
    pub fn cap(&self) -> u32 {
        self.cap
    }

    /// The baseline small-read latency, ns (0: none yet).
    #[inline]
    pub fn baseline_ns(&self) -> u64 {
        let b = self.best_cur.median_ns.min(self.best_prev.median_ns);
        if b == u64::MAX {
            0
        } else {
            b
        }
    }

    /// The small-read latency allowed beside bulk work, ns (0: no baseline yet).
    #[inline]
    pub fn allowed_ns(&self) -> u64 {
        match self.baseline_ns() {
            0 => 0,
            b => b.saturating_mul(ALLOWED_FACTOR).max(MIN_ALLOWED_NS),
        }
    }

    /// The controller's state now.
    pub fn state(&self) -> BulkShareState {
        BulkShareState {
            cap_ops: self.cap,
            baseline_us: self.baseline_ns() as f64 / 1000.0,
            ..self.state
        }
    }

    /// A small read was accepted at `now_ns`.
    #[inline]
    pub fn small_read_submitted(&mut self, now_ns: u64) {
        let first = self.reads_in_flight == 0;
        if first {
            self.read_since = now_ns;
        }
        self.reads_in_flight += 1;
        self.last_read_ns = Some(now_ns);
        self.now = self.now.max(now_ns);
        // Reads already in flight: the cap was computed with reads present (at the
        // submission that made them present, or since by `tick`/`apply`, which recompute
        // it on every change of the law, the fixed share or the measuring state), and one
        // more read changes none of its inputs.
        if first {
            self.update_cap();
        }
        debug_assert_eq!(self.cap, self.cap_now());
    }

    /// A small read accepted at `submit_ns` completed at `now_ns`, `device_ns` of that in
    /// its slowest member request's device (hand-over → reaped); `ok`: it moved data
    /// (failed reads, and reads that waited for an earlier request's data — ordering,
    /// whose length the devices decide — count as done but give no latency). The signal
    /// is the rest, the read's time inside the target: device time is the depth
    /// controller's to control.
    #[inline(always)]
    pub fn small_read_done(&mut self, now_ns: u64, submit_ns: u64, device_ns: u64, ok: bool) {
        self.reads_in_flight = self.reads_in_flight.saturating_sub(1);
        if self.reads_in_flight > 0 {
            self.read_since = now_ns;
        }
        if !ok || self.fixed.is_some() {
            return;
        }
        let lat = now_ns
            .saturating_sub(submit_ns)
            .saturating_sub(device_ns)
            .max(1);
        self.window.record(lat);
        let a = self.allowed_ns();
        if a == 0 || self.measuring || self.grace || submit_ns < self.last_change_ns {
            return;
        }
        if lat > 4 * a || (self.law.probing() && lat > 2 * a) {
            self.late_run += 1;
        } else {
            self.late_run = 0;
        }
        if self.late_run >= LATE_RUN {
            // Reads after the last change far over the line, in a row: the writer just
            // started or a probe hurt — act now, and give the next window (still draining
            // the bulk work admitted before) no verdict. One late read alone may be a
            // stall of the host and waits for the window's test.
            self.late_run = 0;
            self.apply(now_ns, |l| l.miss(lat / a));
            self.grace = true;
            self.start_window(now_ns);
        }
    }

    /// Advances to `now_ns` (each loop turn); `bulk_active`: bulk writes are accepted and
    /// not finished. Closes the window when it is over.
    pub fn tick(&mut self, now_ns: u64, bulk_active: bool) {
        self.now = self.now.max(now_ns);
        self.bulk_busy |= bulk_active;
        if self.fixed.is_some() {
            return;
        }
        let elapsed = self.now.saturating_sub(self.window_start);
        let n = self.window.len();
        let short = n < WINDOW_READS && (n > 0 || self.reads_in_flight > 0);
        if elapsed < WINDOW_NS || (short && elapsed < MAX_WINDOW_NS) {
            self.update_cap();
            return;
        }
        self.close_window(bulk_active);
        self.update_cap();
    }

    fn close_window(&mut self, bulk_active: bool) {
        let now = self.now;
        let n = self.window.len();
        let measured = std::mem::take(&mut self.measuring);
        let grace = std::mem::take(&mut self.grace);
        if n >= WINDOW_READS {
            let w = self.window.histogram();
            let median = w.value_at_quantile(0.5);
            if median < self.best_cur.median_ns {
                let over =
                    w.count_between(w.highest_equivalent(median.saturating_mul(2)) + 1, u64::MAX);
                let noise = if n >= NOISE_READS {
                    (over as f64 + 1.0) / (n as f64 + 2.0)
                } else {
                    NOISE_PRIOR
                };
                self.best_cur = Best {
                    median_ns: median,
                    noise,
                };
            }
        }
        let present = n > 0 || self.reads_in_flight > 0;
        let busy = self.bulk_busy;
        if now.saturating_sub(self.epoch_start) >= EPOCH_NS {
            self.best_prev = self.best_cur;
            self.best_cur = NO_BEST;
            self.epoch_start = now;
            self.measuring = present && busy;
        }
        if self.baseline_ns() == 0 && present && busy {
            self.measuring = true;
        }
        if self.measuring {
            self.state.measurements += 1;
        }
        if !present || !busy {
            // Nothing to protect, or nothing held back: back towards the whole pool.
            self.apply(now, ProbeLaw::relax);
        } else if !(measured || grace) && self.baseline_ns() > 0 {
            let a = self.allowed_ns();
            if n == 0 {
                // No read finished: one is in flight — late, or not yet.
                let waited = now.saturating_sub(self.read_since);
                if waited > 2 * a {
                    self.apply(now, |l| l.miss(waited / a));
                }
            } else {
                let w = self.window.histogram();
                let slow = w.count_between(w.highest_equivalent(a) + 1, u64::MAX);
                let best = if self.best_cur.median_ns <= self.best_prev.median_ns {
                    self.best_cur
                } else {
                    self.best_prev
                };
                if slow as f64 > slow_allowance(n, best.noise, TAIL_SHARE, NOISE_SIGMAS) {
                    let p99 = self.window.histogram().value_at_quantile(0.99);
                    self.apply(now, |l| l.miss(p99 / a));
                } else {
                    self.apply(now, ProbeLaw::met);
                }
            }
        }
        self.start_window(now);
        self.bulk_busy = bulk_active;
    }

    fn start_window(&mut self, now_ns: u64) {
        self.window_start = now_ns;
        self.window.reset();
    }

    /// Applies one step of the law, counting the change.
    fn apply(&mut self, now_ns: u64, step: impl FnOnce(&mut ProbeLaw) -> Option<&'static str>) {
        let before = self.law.value();
        if let Some(why) = step(&mut self.law) {
            let after = self.law.value();
            self.last_change_ns = now_ns;
            if after < before {
                self.state.cuts += 1;
            } else {
                self.state.raises += 1;
            }
            tracing::debug!(
                why,
                from = before,
                to = after,
                baseline_ns = self.baseline_ns(),
                "qos: bulk share changed"
            );
        }
        self.update_cap();
    }

    fn update_cap(&mut self) {
        self.cap = self.cap_now();
    }

    /// The cap the current state gives: the fixed share; the law's floor while
    /// measuring; else the law's value, kept below the whole pool (and at least the
    /// floor) while small reads are present (in flight, or one accepted within the last
    /// window).
    fn cap_now(&self) -> u32 {
        if let Some(f) = self.fixed {
            f
        } else if self.measuring {
            self.law.floor()
        } else {
            let present = self.reads_in_flight > 0
                || self
                    .last_read_ns
                    .is_some_and(|t| self.now.saturating_sub(t) < WINDOW_NS);
            let v = self.law.value();
            if present {
                v.min(self.pool - 1).max(self.law.floor())
            } else {
                v
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1000;
    const MS: u64 = 1_000_000;

    /// Feeds `reads` small reads of `lat` ns spread over one window from `*now`, with bulk
    /// work active, then ticks past the window's end.
    fn window(s: &mut BulkShare, now: &mut u64, reads: u64, lat: u64) {
        let step = WINDOW_NS / reads;
        for _ in 0..reads {
            s.small_read_submitted(*now);
            s.small_read_done(*now + lat, *now, 0, true);
            *now += step;
            s.tick(*now, true);
        }
        *now += 1;
        s.tick(*now, true);
    }

    #[test]
    fn fixed_share_is_a_percentage_of_the_pool() {
        let s = BulkShare::new(64, 192 << 10, Some(75));
        assert_eq!(s.cap(), 48);
        assert!(s.state().fixed);
        assert_eq!(BulkShare::new(64, 192 << 10, Some(0)).cap(), 1);
        assert_eq!(BulkShare::new(4, 192 << 10, Some(100)).cap(), 4);
    }

    #[test]
    fn bulk_gets_everything_without_small_reads() {
        let mut s = BulkShare::new(64, 192 << 10, None);
        assert_eq!(s.state().floor_ops, 6, "1 MiB of 192 KiB stripes");
        for t in 0..100 {
            s.tick(t * MS, true);
        }
        assert_eq!(s.cap(), 64);
        assert_eq!(s.state().cuts, 0);
    }

    #[test]
    fn slow_reads_cut_the_share_and_good_ones_raise_it() {
        let mut s = BulkShare::new(64, 192 << 10, None);
        let mut now = 0;
        // The first window with reads sets the baseline.
        window(&mut s, &mut now, 50, 100 * US);
        assert_eq!(s.baseline_ns() / US, 100);
        assert_eq!(s.allowed_ns() / US, 200);
        let top = s.cap();
        assert_eq!(top, 63, "one operation kept for the reads");
        // Reads at 4× the baseline: cut (p99 2× over the allowed latency: one halving).
        window(&mut s, &mut now, 50, 400 * US);
        assert!(s.cap() < top, "cut: {}", s.cap());
        assert!(s.state().cuts >= 1);
        let low = s.cap();
        // Good windows: the share climbs back.
        for _ in 0..40 {
            window(&mut s, &mut now, 50, 100 * US);
        }
        assert!(s.cap() > low, "raised: {} from {low}", s.cap());
        assert!(s.state().raises >= 1);
        // Once a second, one window at the floor measures the baseline afresh.
        let mut floor_seen = false;
        for _ in 0..100 {
            window(&mut s, &mut now, 50, 100 * US);
            floor_seen |= s.cap() == 6;
        }
        assert!(floor_seen && s.state().measurements >= 1);
        // Never below the floor.
        for _ in 0..20 {
            window(&mut s, &mut now, 50, 5 * MS);
        }
        assert_eq!(s.cap(), 6);
    }

    #[test]
    fn a_noisy_minority_of_reads_does_not_cut() {
        let mut s = BulkShare::new(64, 192 << 10, None);
        let mut now = 0;
        window(&mut s, &mut now, 50, 100 * US);
        window(&mut s, &mut now, 50, 100 * US);
        let top = s.cap();
        // One read in 200 of a window at 10 ms (a host stall): within the allowance.
        for _ in 0..10 {
            let step = WINDOW_NS / 200;
            for i in 0..200 {
                let lat = if i == 7 { 10 * MS } else { 100 * US };
                s.small_read_submitted(now);
                s.small_read_done(now + lat, now, 0, true);
                now += step;
                s.tick(now, true);
            }
            now += 1;
            s.tick(now, true);
        }
        assert_eq!(s.state().cuts, 0);
        assert_eq!(s.cap(), top);
    }
}
