//! Where persistent-reservation state is kept while APTPL is set.

/// Where the persistent-reservation state lives while APTPL is set (SPC-4 §5.14.5).
pub trait ReservationStore: Send + Sync + 'static {
    /// The newest saved state, `None` if nothing was ever saved (or it was cleared).
    fn load(&self) -> std::io::Result<Option<Vec<u8>>>;
    /// Saves `state` durably; returns once it is durable. An empty `state` clears it.
    fn save(&self, state: &[u8]) -> std::io::Result<()>;
}
