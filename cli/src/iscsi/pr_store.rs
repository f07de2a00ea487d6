//! Where the persistent-reservation state lives while APTPL is set (SPC-4 §5.14.5
//! "Persisting reservations and registrations across power loss"): the
//! [`ReservationStore`] trait, and [`MemoryStore`], an in-memory store for tests.
//!
//! The bytes a store keeps are [`super::pr::PrState::encode`]'s: versioned and checksummed
//! by the encoding itself, so a store need not add a checksum of its own.

use std::io;
use std::sync::Mutex;

/// Where the persistent-reservation state lives while APTPL is set (SPC-4 §5.14.5).
pub trait ReservationStore: Send + Sync + 'static {
    /// The newest saved state, `None` if nothing was ever saved (or it was cleared).
    fn load(&self) -> std::io::Result<Option<Vec<u8>>>;
    /// Saves `state` durably; returns once it is durable. An empty `state` clears it.
    fn save(&self, state: &[u8]) -> std::io::Result<()>;
    /// The longest state [`ReservationStore::save`] can keep, bytes (`None`: no limit). A
    /// PERSISTENT RESERVE OUT whose new state would not fit is refused with INSUFFICIENT
    /// REGISTRATION RESOURCES (SPC-4 §6.16.2) before it changes anything.
    fn capacity_bytes(&self) -> Option<usize> {
        None
    }
}

/// A [`ReservationStore`] in memory: survives a restart of the iSCSI server within one
/// process (tests), nothing more. Saves can be made to fail ([`MemoryStore::fail_saves`]).
#[derive(Debug, Default)]
pub struct MemoryStore {
    state: Mutex<(Option<Vec<u8>>, bool, u64)>,
    capacity: Option<usize>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// A store holding `state` (as if saved before), e.g. to test a corrupt record.
    pub fn with_state(state: Vec<u8>) -> Self {
        Self {
            state: Mutex::new((Some(state), false, 0)),
            capacity: None,
        }
    }

    /// An empty store that keeps at most `bytes` ([`ReservationStore::capacity_bytes`]).
    pub fn with_capacity(bytes: usize) -> Self {
        Self {
            capacity: Some(bytes),
            ..Self::default()
        }
    }

    /// From now on every save fails (`true`) or succeeds (`false`).
    pub fn fail_saves(&self, fail: bool) {
        self.lock().1 = fail;
    }

    /// Successful saves so far (clears included).
    pub fn saves(&self) -> u64 {
        self.lock().2
    }

    /// The bytes kept now (`None`: nothing saved, or cleared).
    pub fn current(&self) -> Option<Vec<u8>> {
        self.lock().0.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Option<Vec<u8>>, bool, u64)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ReservationStore for MemoryStore {
    fn load(&self) -> io::Result<Option<Vec<u8>>> {
        Ok(self.lock().0.clone())
    }

    fn save(&self, state: &[u8]) -> io::Result<()> {
        let mut s = self.lock();
        if s.1 {
            return Err(io::Error::other("MemoryStore: saves made to fail"));
        }
        s.0 = if state.is_empty() {
            None
        } else {
            Some(state.to_vec())
        };
        s.2 += 1;
        Ok(())
    }

    fn capacity_bytes(&self) -> Option<usize> {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_store_saves_clears_and_fails() {
        let m = MemoryStore::new();
        assert_eq!(m.load().unwrap(), None);
        m.save(b"abc").unwrap();
        assert_eq!(m.load().unwrap().as_deref(), Some(&b"abc"[..]));
        m.save(b"").unwrap();
        assert_eq!(m.load().unwrap(), None);
        m.fail_saves(true);
        assert!(m.save(b"x").is_err());
        assert_eq!(m.saves(), 2);
    }
}
