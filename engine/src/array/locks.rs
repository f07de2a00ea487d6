//! The stripes a shard's running operations hold (the owner's half of the stripe ordering
//! rule, module docs of [`crate::array`]): a write or write-zeroes/discard holds its stripe
//! *exclusively*; a read or a background operation holds it *shared*. A read may start
//! beside shared holders; a write (or background operation) only on a stripe nobody holds.
//! The holders are identified by the operation index their member requests' tags carry:
//! stripe operations, and the fast-path reads (`read.rs`), which hold a stripe shared
//! without a stripe operation (the bitmap's and the logs' indices, in between, never hold
//! one).
//!
//! Holds are kept in a flat list with each operation's position in it, so taking and
//! releasing are O(1); the common check of a read ("does a write hold my stripe?") is O(1)
//! while no exclusive hold exists at all (a read-only load), O(holds) otherwise. The list
//! never holds more than one entry per operation index, and its capacity is reserved at
//! construction: nothing allocates per I/O.

/// No position: the operation holds nothing.
const NONE: u32 = u32::MAX;

/// The stripe holds of `ops` operation indices (`0..ops`).
pub(crate) struct StripeLocks {
    /// (stripe, operation, exclusive), in no particular order.
    held: Vec<(u64, u32, bool)>,
    /// Per operation: its index in `held`, or [`NONE`].
    at: Vec<u32>,
    /// Exclusive entries in `held`.
    exclusive: usize,
}

impl StripeLocks {
    /// Room for `ops` operations, one hold each.
    pub(crate) fn new(ops: usize) -> Self {
        Self {
            held: Vec::with_capacity(ops),
            at: vec![NONE; ops],
            exclusive: 0,
        }
    }

    /// Whether an operation on `stripe` must wait: for a write (`exclusive`), any hold on
    /// the stripe; for a read, an exclusive one.
    #[inline]
    pub(crate) fn conflicts(&self, stripe: u64, exclusive: bool) -> bool {
        if !exclusive && self.exclusive == 0 {
            return false;
        }
        self.held
            .iter()
            .any(|&(st, _, x)| st == stripe && (x || exclusive))
    }

    /// The operation holding `stripe` exclusively (a write), if any. O(1) while no
    /// exclusive hold exists, O(holds) otherwise.
    pub(crate) fn exclusive_holder(&self, stripe: u64) -> Option<u32> {
        if self.exclusive == 0 {
            return None;
        }
        self.held
            .iter()
            .find(|&&(st, _, x)| st == stripe && x)
            .map(|&(_, op, _)| op)
    }

    /// Operation `op` holds `stripe` from now on (`exclusive` for a write).
    ///
    /// # Panics
    /// If `op` already holds a stripe or is out of range (an engine bug).
    #[inline(always)]
    pub(crate) fn take(&mut self, stripe: u64, op: u32, exclusive: bool) {
        if self.at[op as usize] != NONE {
            held_twice(op);
        }
        debug_assert!(
            self.held.len() < self.held.capacity(),
            "one hold per operation"
        );
        self.at[op as usize] = self.held.len() as u32;
        self.held.push((stripe, op, exclusive));
        self.exclusive += usize::from(exclusive);
    }

    /// Operation `op` lets go of its stripe, if it holds one.
    #[inline]
    pub(crate) fn release(&mut self, op: u32) {
        let i = std::mem::replace(&mut self.at[op as usize], NONE);
        if i == NONE {
            return;
        }
        // `swap_remove` by hand: the moved hold's operation is taken from the popped
        // value, not loaded back from the slot just stored to (that load waited on
        // store-to-load forwarding on the fast-read path).
        let last = self.held.pop().expect("a held stripe");
        let (_, x, exclusive) = if (i as usize) < self.held.len() {
            self.at[last.1 as usize] = i;
            std::mem::replace(&mut self.held[i as usize], last)
        } else {
            last
        };
        debug_assert_eq!(x, op);
        self.exclusive -= usize::from(exclusive);
    }
}

/// The panic of [`StripeLocks::take`] for an operation that already holds a stripe: out
/// of line, so that `take` stays small enough to inline on the fast-read path.
#[cold]
#[inline(never)]
fn held_twice(op: u32) -> ! {
    panic!("operation {op} holds a stripe")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_share_writes_exclude() {
        let mut l = StripeLocks::new(8);
        assert!(!l.conflicts(5, false) && !l.conflicts(5, true));
        l.take(5, 0, false);
        l.take(5, 1, false);
        assert!(!l.conflicts(5, false), "reads share a stripe");
        assert!(l.conflicts(5, true), "a write waits for reads");
        assert!(!l.conflicts(6, true));
        l.release(0);
        l.release(1);
        assert!(!l.conflicts(5, true));
        l.take(5, 2, true);
        assert!(l.conflicts(5, false) && l.conflicts(5, true));
        assert!(!l.conflicts(4, false));
        l.release(2);
        assert!(!l.conflicts(5, false) && !l.conflicts(5, true));
    }

    #[test]
    fn release_keeps_positions_right_after_moves() {
        let mut l = StripeLocks::new(6);
        for op in 0..6 {
            l.take(100 + u64::from(op), op, op % 2 == 1);
        }
        // Releasing from the front moves the last entry into the hole each time.
        for op in [0u32, 3, 1] {
            l.release(op);
            l.release(op); // twice: a no-op
        }
        for op in [2u32, 4, 5] {
            assert!(
                l.conflicts(100 + u64::from(op), true),
                "op {op} still holds"
            );
        }
        assert!(!l.conflicts(100, true) && !l.conflicts(103, true) && !l.conflicts(101, true));
        assert!(l.conflicts(105, false), "op 5 holds exclusively");
        l.release(5);
        assert!(!l.conflicts(105, false));
        l.take(105, 5, false);
        assert!(!l.conflicts(105, false));
    }
}
