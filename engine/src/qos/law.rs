//! The control law the feedback controllers share (docs/PACING.md).
//!
//! - [`ProbeLaw`]: AIMD with probe-revert on an integer limit between a floor and a
//!   ceiling — the per-member depth controller's law ([`super::depth`], the write-class
//!   depth in requests) and the bulk-share controller's ([`super::share`], stripe
//!   operations bulk writes may hold). A miss divides the limit by 2 per doubling of the
//!   latency over target (1 to 4 halvings); good windows probe a quarter higher after
//!   `probe_after` of them; a probe that misses is reverted at once and doubles
//!   `probe_after` (up to [`MAX_PROBE_AFTER`] windows) while halving the next probe's
//!   step (a binary search for the highest limit that keeps the protected class on
//!   target); windows where the limit protects or holds back nothing double it back
//!   towards the ceiling; slow start doubles from a low start per good window until the
//!   first miss.
//! - [`slow_allowance`]: the background pacer's and the bulk-share controller's window
//!   test — how many of a window's requests may be past the allowed latency before the
//!   window counts as a miss (the p99 made statistical against the host's own noise).
//!
//! Pure arithmetic on integers and floats: nothing allocates, nothing reads a clock.

/// Windows met in a row (and at least four probe intervals) after which the probe
/// back-off halves (the load may have changed).
pub const GOOD_RUN_RELAX: u32 = 64;
/// Largest back-off between probes, windows.
pub const MAX_PROBE_AFTER: u32 = 512;

/// AIMD with probe-revert on an integer limit (module docs). The caller decides what a
/// window's verdict is and calls [`ProbeLaw::miss`], [`ProbeLaw::met`],
/// [`ProbeLaw::hold`] or [`ProbeLaw::relax`]; each returns why the limit changed (for
/// tracing) when it did.
#[derive(Clone, Debug)]
pub struct ProbeLaw {
    floor: u32,
    ceiling: u32,
    value: u32,
    /// Windows met in a row since the last change or miss; since the last miss.
    met_run: u32,
    good_run: u32,
    /// Good windows to wait before the next probe.
    probe_after: u32,
    /// A probe (or a slow-start doubling) is on trial.
    probing: bool,
    before_probe: u32,
    /// How much higher the next probe goes (capped at a quarter of the limit).
    probe_step: u32,
    slow_start: bool,
}

impl ProbeLaw {
    /// A law between `floor` and `ceiling` (a floor above the ceiling is lowered to it; a
    /// ceiling of 0 is raised to 1), starting at the ceiling.
    pub fn new(floor: u32, ceiling: u32) -> Self {
        let ceiling = ceiling.max(1);
        let floor = floor.clamp(1, ceiling);
        Self {
            floor,
            ceiling,
            value: ceiling,
            met_run: 0,
            good_run: 0,
            probe_after: 1,
            probing: false,
            before_probe: ceiling,
            probe_step: u32::MAX,
            slow_start: false,
        }
    }

    /// The limit now, `floor..=ceiling`.
    pub fn value(&self) -> u32 {
        self.value
    }

    /// The lowest limit.
    pub fn floor(&self) -> u32 {
        self.floor
    }

    /// The highest limit.
    pub fn ceiling(&self) -> u32 {
        self.ceiling
    }

    /// Whether a step up is on trial (a miss now reverts it).
    pub fn probing(&self) -> bool {
        self.probing
    }

    /// Sets the limit (clamped to `floor..=ceiling`).
    pub fn set(&mut self, v: u32) {
        self.value = v.clamp(self.floor, self.ceiling);
    }

    /// The limited work starts while the protected class is served: begin at `start`
    /// (if the limit is above it) and double per good window until the first miss.
    /// Returns whether the limit changed.
    pub fn start_slow(&mut self, start: u32) -> bool {
        if self.value > start.max(self.floor) {
            self.slow_start = true;
            self.set(start);
            true
        } else {
            false
        }
    }

    /// A window where the limit protects nothing (the protected class absent) or holds
    /// nothing back (the limited work absent): double back towards the ceiling.
    pub fn relax(&mut self) -> Option<&'static str> {
        self.probing = false;
        self.slow_start = false;
        self.met_run = 0;
        self.change(self.value.saturating_mul(2), "relaxed")
    }

    /// A window neither met nor missed (between target and the miss line): hold.
    pub fn hold(&mut self) {
        self.met_run = 0;
    }

    /// A window that met its target: count it; in slow start double, else probe a step
    /// higher after `probe_after` good windows in a row.
    pub fn met(&mut self) -> Option<&'static str> {
        self.probing = false;
        self.met_run += 1;
        self.good_run += 1;
        if self.good_run >= GOOD_RUN_RELAX.max(4 * self.probe_after) {
            // A long good run: the load may have changed, probe sooner and in bigger
            // steps again.
            self.probe_after = (self.probe_after / 2).max(1);
            self.probe_step = self.probe_step.saturating_mul(2);
            self.good_run = 0;
        }
        if self.slow_start {
            // Slow start: double while on target; the first miss reverts the last
            // doubling and hands over to probing.
            self.probing = true;
            self.before_probe = self.value;
            self.met_run = 0;
            let why = self.change(self.value.saturating_mul(2), "slow start");
            if self.value >= self.ceiling {
                self.slow_start = false;
                self.probing = false;
            }
            why
        } else if self.value < self.ceiling && self.met_run >= self.probe_after {
            // Probe: higher by the probe step (a quarter of the limit, halved after each
            // failed probe).
            self.met_run = 0;
            self.probing = true;
            self.before_probe = self.value;
            let v = self.value + self.probe_step.clamp(1, (self.value / 4).max(1));
            self.change(v, "target met: probe")
        } else {
            None
        }
    }

    /// A miss, the latency `ratio` times the target (≥ 1): a probe on trial is reverted
    /// (and the next one waits twice as long and goes half as far); otherwise the limit
    /// is halved once per doubling of the ratio, 1 to 4 times (a standing queue's delay
    /// scales with its depth, so one step lands near the right limit).
    pub fn miss(&mut self, ratio: u64) -> Option<&'static str> {
        self.met_run = 0;
        self.good_run = 0;
        self.slow_start = false;
        if std::mem::take(&mut self.probing) {
            self.probe_after = (self.probe_after * 2).min(MAX_PROBE_AFTER);
            self.probe_step = (self.value.saturating_sub(self.before_probe) / 2).max(1);
            return self.change(self.before_probe, "probe missed");
        }
        let halvings = ratio.max(1).ilog2().clamp(1, 4);
        self.probe_step = u32::MAX;
        self.change(self.value >> halvings, "target missed")
    }

    fn change(&mut self, v: u32, why: &'static str) -> Option<&'static str> {
        let before = self.value;
        self.set(v);
        (self.value != before).then_some(why)
    }
}

/// How many of a window's `samples` requests may be slower than the allowed latency
/// before the window misses: `tail_share` of them (0.01: the p99), plus the share `p` the
/// quiet reference itself has past that line, plus `sigmas` standard deviations of that
/// share's count (binomial) — a window of a device as noisy as the reference passes
/// (3 σ: ~99.9 % of the time). `p` in 0..=1.
pub fn slow_allowance(samples: u64, p: f64, tail_share: f64, sigmas: f64) -> f64 {
    let n = samples as f64;
    let p = p.clamp(0.0, 1.0);
    n * (tail_share + p) + sigmas * (n * p * (1.0 - p)).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn miss_halves_per_doubling_and_probe_reverts() {
        let mut l = ProbeLaw::new(2, 64);
        assert_eq!(l.miss(1), Some("target missed"));
        assert_eq!(l.value(), 32);
        assert_eq!(l.miss(5), Some("target missed")); // two doublings: two halvings
        assert_eq!(l.value(), 8);
        assert_eq!(l.miss(1 << 10), Some("target missed")); // at most four, floor 2
        assert_eq!(l.value(), 2);
        // Good window: probe after one (probe_after = 1) by a quarter, at least 1.
        assert_eq!(l.met(), Some("target met: probe"));
        assert_eq!(l.value(), 3);
        assert!(l.probing());
        assert_eq!(l.miss(2), Some("probe missed"));
        assert_eq!(l.value(), 2);
        // Next probe waits two good windows.
        assert_eq!(l.met(), None);
        assert_eq!(l.met(), Some("target met: probe"));
    }

    #[test]
    fn slow_start_doubles_until_the_first_miss_and_relax_restores_the_ceiling() {
        let mut l = ProbeLaw::new(1, 64);
        assert!(l.start_slow(4));
        assert_eq!(l.value(), 4);
        l.met();
        assert_eq!(l.value(), 8);
        l.met();
        assert_eq!(l.value(), 16);
        assert_eq!(l.miss(1), Some("probe missed"));
        assert_eq!(l.value(), 8);
        for _ in 0..3 {
            l.relax();
        }
        assert_eq!(l.value(), 64);
        assert!(!l.start_slow(64));
    }

    #[test]
    fn allowance_is_the_p99_plus_the_quiet_noise() {
        assert!((slow_allowance(100, 0.0, 0.01, 3.0) - 1.0).abs() < 1e-9);
        let a = slow_allowance(100, 0.04, 0.01, 3.0);
        assert!((a - (5.0 + 3.0 * (100.0f64 * 0.04 * 0.96).sqrt())).abs() < 1e-9);
    }
}
