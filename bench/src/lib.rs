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

/// Cache-line round trip between CPU cores `a` and `b`, ns: two threads pinned there hand
/// one 128-byte-aligned counter back and forth `round_trips` times; the median of five
/// such runs. It is the floor of any hand-off between reactors on those cores, and on a
/// virtual machine it shows where the host placed the vCPUs (the same core complex or
/// not), which changes multi-reactor figures by tens of percent. The calling thread's
/// affinity is left alone. `None` when either thread cannot be pinned.
pub fn core_round_trip_ns(a: usize, b: usize, round_trips: u64) -> Option<f64> {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    #[repr(align(128))]
    struct Line(AtomicU64);

    fn wait_for(line: &Line, want: u64) {
        let mut spins = 0u32;
        while line.0.load(Ordering::Acquire) != want {
            spins += 1;
            if spins.is_multiple_of(4096) {
                // Both threads on one core (or descheduled): let the other one run.
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    let mut runs = Vec::new();
    for _ in 0..5 {
        let line = Line(AtomicU64::new(0));
        let pinned = AtomicBool::new(true);
        let ns = std::thread::scope(|s| {
            s.spawn(|| {
                if !core_affinity::set_for_current(core_affinity::CoreId { id: b }) {
                    pinned.store(false, Ordering::Release);
                }
                for i in 0..round_trips {
                    wait_for(&line, 2 * i + 1);
                    line.0.store(2 * i + 2, Ordering::Release);
                }
            });
            // Its own thread too: pinning the caller would leave it pinned.
            s.spawn(|| {
                if !core_affinity::set_for_current(core_affinity::CoreId { id: a }) {
                    pinned.store(false, Ordering::Release);
                }
                let t = Instant::now();
                for i in 0..round_trips {
                    line.0.store(2 * i + 1, Ordering::Release);
                    wait_for(&line, 2 * i + 2);
                }
                t.elapsed().as_nanos() as f64 / round_trips.max(1) as f64
            })
            .join()
            .expect("round-trip thread")
        });
        if !pinned.load(Ordering::Acquire) {
            return None;
        }
        runs.push(ns);
    }
    Some(median(&mut runs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_between_cores_is_measured() {
        let cores_before = std::thread::available_parallelism().unwrap();
        // Core 0 with itself works on any machine (the waits yield): a finite, positive
        // figure, or None where pinning is not allowed.
        if let Some(ns) = core_round_trip_ns(0, 0, 200) {
            assert!(ns.is_finite() && ns > 0.0, "{ns}");
        }
        assert_eq!(
            std::thread::available_parallelism().unwrap(),
            cores_before,
            "the caller is not left pinned"
        );
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }
}
