//! Virtual time.

use std::cell::Cell;
use std::rc::Rc;

/// Virtual time in nanoseconds since the start of a simulation, shared (cheaply cloned) by
/// every simulated device and by the executor that drives them. Single-threaded by design:
/// a simulation runs on one thread so that it is deterministic.
#[derive(Clone, Debug, Default)]
pub struct SimClock {
    now_ns: Rc<Cell<u64>>,
}

impl SimClock {
    /// A clock at time 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// The current virtual time, ns.
    pub fn now_ns(&self) -> u64 {
        self.now_ns.get()
    }

    /// Moves time forward to `t_ns`.
    ///
    /// # Panics
    /// If `t_ns` is in the past: virtual time never runs backwards (an executor bug).
    pub fn advance_to(&self, t_ns: u64) {
        let now = self.now_ns.get();
        assert!(
            t_ns >= now,
            "virtual time cannot go back from {now} ns to {t_ns} ns"
        );
        self.now_ns.set(t_ns);
    }

    /// Moves time forward by `d_ns`.
    pub fn advance_by(&self, d_ns: u64) {
        self.advance_to(self.now_ns.get().saturating_add(d_ns));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_time_and_time_is_monotonic() {
        let c = SimClock::new();
        let d = c.clone();
        c.advance_by(5);
        d.advance_to(7);
        assert_eq!(c.now_ns(), 7);
        assert!(
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.advance_to(3))).is_err()
        );
    }
}
