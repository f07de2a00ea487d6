//! [`TracedPacer`]: ferroraid's pacer with every control window's verdict and every probe
//! undone at once printed on stderr (`--trace` of `pacing-scenario` and
//! `pacing-realtime`).

use engine::qos::pacer::FerroraidPacer;
use engine::qos::{Admission, Pacer};

/// Wraps a [`FerroraidPacer`]; after each call, prints what changed (a window closed, a
/// probe was undone) on stderr, times in s of the executor's clock, latencies in µs,
/// rates in MB/s per member. Counts the admissions it answered (now / not before / after
/// a completion), shown with each window.
pub struct TracedPacer {
    inner: FerroraidPacer,
    windows: u64,
    reverts: u64,
    answers: [u64; 3],
}

impl TracedPacer {
    /// Wraps `inner`; prints `label` first.
    pub fn new(inner: FerroraidPacer, label: &str) -> Self {
        eprintln!("--- run: {label}");
        Self {
            inner,
            windows: 0,
            reverts: 0,
            answers: [0; 3],
        }
    }

    fn log(&mut self) {
        if self.inner.windows() != self.windows {
            self.windows = self.inner.windows();
            let w = self.inner.last_window();
            eprintln!(
                "window t={:.4}s n={} over={} allowance={:.2} quiet_over={:.4} p50={:.1}µs (allowed {:.1}µs) mean={:.1}µs (allowed {:.1}µs) p99={:.1}µs max={:.1}µs baseline={:.1}µs allowed={:.1}µs bg_in_flight={} verdict={:?} -> rate={:.2}MB/s depth={} answers now/notbefore/aftercompletion={:?}",
                w.end_ns as f64 / 1e9,
                w.samples,
                w.over,
                w.allowance,
                w.quiet_over,
                w.p50_ns as f64 / 1e3,
                w.allowed_p50_ns as f64 / 1e3,
                w.mean_ns as f64 / 1e3,
                w.allowed_mean_ns as f64 / 1e3,
                w.p99_ns as f64 / 1e3,
                w.max_ns as f64 / 1e3,
                w.baseline_ns as f64 / 1e3,
                w.allowed_ns as f64 / 1e3,
                w.bg_in_flight,
                w.verdict,
                w.rate as f64 / 1e6,
                w.depth,
                self.answers,
            );
        }
        if self.inner.reverts() != self.reverts {
            self.reverts = self.inner.reverts();
            let r = self.inner.last_revert();
            eprintln!(
                "revert t={:.4}s latency={:.1}µs allowed={:.1}µs overlapped_background={}",
                r.at_ns as f64 / 1e9,
                r.latency_ns as f64 / 1e3,
                r.allowed_ns as f64 / 1e3,
                r.overlapped_background
            );
        }
    }
}

impl Pacer for TracedPacer {
    fn foreground_submitted(&mut self, now_ns: u64) {
        self.inner.foreground_submitted(now_ns);
    }
    fn foreground_done(&mut self, now_ns: u64, latency_ns: u64, bytes: u64, read: bool) {
        self.inner.foreground_done(now_ns, latency_ns, bytes, read);
        self.log();
    }
    fn background_done(&mut self, now_ns: u64, latency_ns: u64, bytes_per_member: u64) {
        self.inner
            .background_done(now_ns, latency_ns, bytes_per_member);
    }
    fn admit(&mut self, now_ns: u64, bytes_per_member: u64, in_flight: u32) -> Admission {
        let a = self.inner.admit(now_ns, bytes_per_member, in_flight);
        self.answers[match a {
            Admission::Now => 0,
            Admission::NotBefore(_) => 1,
            Admission::AfterCompletion => 2,
        }] += 1;
        self.log();
        a
    }
}
