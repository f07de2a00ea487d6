//! Latency histograms recorded on the per-request path.
//!
//! An HDR histogram record costs ~60 instructions (bucket arithmetic, the count, min/max)
//! and touches one line of a 37 KB count array; a shard records two or three latencies
//! per request (its member's latency, the depth controller's read window, the bulk
//! share's window). The array's clock is read once per loop turn, so the requests reaped
//! in one turn that were issued in one turn all have the same latency: on a busy shard
//! most records repeat the previous value. [`LatencyHistogram`] keeps the current run of
//! equal values as a count and adds it to the histogram only when a different value
//! arrives or the histogram is read — the same contents, with a compare and an increment
//! for most records.

use hdrhistogram::Histogram;

/// An HDR histogram of latencies, ns (1 ns to 1 hour, 2 significant digits: the bounds of
/// [`crate::array::new_latency_histogram`]), with a run-length front: consecutive equal
/// values are counted and added at once. Reading it ([`Self::histogram`], [`Self::fill`],
/// [`Self::len`]) always sees every value recorded since the last [`Self::reset`].
/// Never allocates after [`Self::new`].
pub struct LatencyHistogram {
    hist: Histogram<u64>,
    /// The value of the run not yet in `hist`, ns (meaningful when `run_count > 0`).
    run_value: u64,
    /// Records of `run_value` in a row not yet in `hist`.
    run_count: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl LatencyHistogram {
    /// An empty histogram (allocates its count array, ~37 KB).
    pub fn new() -> Self {
        LatencyHistogram {
            hist: crate::array::new_latency_histogram(),
            run_value: 0,
            run_count: 0,
        }
    }

    /// Records one latency of `ns` nanoseconds (saturating at the bounds, as
    /// `Histogram::saturating_record`: 0 counts as the lowest bucket, over one hour as one
    /// hour).
    #[inline]
    pub fn record(&mut self, ns: u64) {
        if self.run_count > 0 && ns == self.run_value {
            self.run_count += 1;
        } else {
            self.start_run(ns);
        }
    }

    /// Adds the current run to the histogram and starts a new one at `ns`.
    #[inline(never)]
    fn start_run(&mut self, ns: u64) {
        self.flush();
        self.run_value = ns;
        self.run_count = 1;
    }

    /// Adds the pending run to the histogram.
    fn flush(&mut self) {
        if self.run_count > 0 {
            self.hist
                .saturating_record_n(self.run_value, self.run_count);
            self.run_count = 0;
        }
    }

    /// Every value recorded since the last reset.
    pub fn histogram(&mut self) -> &Histogram<u64> {
        self.flush();
        &self.hist
    }

    /// Values recorded since the last reset.
    pub fn len(&self) -> u64 {
        self.hist.len() + self.run_count
    }

    /// Whether nothing was recorded since the last reset.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every value.
    pub fn reset(&mut self) {
        self.hist.reset();
        self.run_count = 0;
    }

    /// Makes `out` (a histogram with [`crate::array::new_latency_histogram`]'s bounds,
    /// or wider) hold exactly the values recorded here since the last reset; never
    /// allocates with such an `out`.
    pub fn fill(&self, out: &mut Histogram<u64>) {
        out.reset();
        self.add_to(out);
    }

    /// Adds the values recorded here since the last reset to `out` (bounds as for
    /// [`Self::fill`]; never allocates).
    pub fn add_to(&self, out: &mut Histogram<u64>) {
        // Same or wider bounds: cannot fail or allocate.
        let _ = out.add(&self.hist);
        if self.run_count > 0 {
            out.saturating_record_n(self.run_value, self.run_count);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the order of values, runs and reads, the histogram holds what plain
        /// `saturating_record` calls would have recorded.
        #[test]
        fn equals_a_plain_histogram(
            steps in proptest::collection::vec((0u64..6, any::<bool>(), 0u8..20), 1..300),
        ) {
            let mut ours = LatencyHistogram::new();
            let mut plain = crate::array::new_latency_histogram();
            let mut out = crate::array::new_latency_histogram();
            for (v, read, op) in steps {
                // A few distinct values (runs form), one far past the top, and 0.
                let ns = match v {
                    5 => u64::MAX,
                    0 => 0,
                    v => v * 1_000,
                };
                if op == 0 {
                    ours.reset();
                    plain.reset();
                } else {
                    ours.record(ns);
                    plain.saturating_record(ns);
                }
                prop_assert_eq!(ours.len(), plain.len());
                prop_assert_eq!(ours.is_empty(), plain.is_empty());
                if read {
                    ours.fill(&mut out);
                    prop_assert_eq!(&out, &plain);
                    ours.add_to(&mut out);
                    prop_assert_eq!(out.len(), 2 * plain.len());
                    prop_assert_eq!(ours.histogram(), &plain);
                }
            }
            prop_assert_eq!(ours.histogram(), &plain);
        }
    }
}
