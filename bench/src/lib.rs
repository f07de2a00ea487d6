//! Shared pieces of ferroraid's benchmarks: the reference implementations measured beside
//! ferroraid in the same run (memory-read bandwidth, Intel ISA-L) and timing helpers.
//!
//! Benchmarks report ratios measured side by side, never lone absolute times: the machines
//! they run on are shared and noisy.

pub mod isal;
pub mod membw;
pub mod pacer_trace;

use std::time::Instant;

/// Runs `f` once and returns its wall time in seconds.
pub fn time_s(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// The CPU model name from /proc/cpuinfo ("unknown" if unreadable), for benchmark headers.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// Median of `v` (sorted in place); `NaN` for an empty slice.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Fills `buf` with deterministic pseudo-random bytes (ChaCha8 from `seed`), touching
/// every page so that measurement never pays first-touch faults.
pub fn fill_random(buf: &mut [u8], seed: u64) {
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    rand_chacha::ChaCha8Rng::seed_from_u64(seed).fill_bytes(buf);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }
}
