//! Quality of service: I/O classes, background pacing and per-device depth control.
//!
//! - [`depth`]: per-member queue-depth controllers (off, wbt-like, ferroraid's).
//! - [`dispatch`]: per-member, per-class queues in front of a member channel.
//! - [`pacer`]: background pacers (ferroraid's, md's pre-4.1 and 4.1+ rules).
//! - [`share`]: the bulk share — stripe operations bulk writes may hold per shard, adapted
//!   from the small reads' time inside the target.
//! - [`law`]: the control law the depth controller and the bulk share run (AIMD with
//!   probe-revert) and the window test they share with the pacer.
//!
//! This module holds the interfaces the stripe engine talks to; the controllers that
//! implement them live in submodules. Everything here is driven by the executor's clock
//! (ns, [`crate::array::Array::set_now`]), so the same code runs in virtual time over
//! simulated devices and in real time on the reactors.

pub mod depth;
pub mod dispatch;
pub mod law;
pub mod pacer;
pub mod share;

pub use depth::{DepthConfig, DepthController, DepthPolicy, QosState};

/// The class of a member request, for dispatch and depth control.
///
/// Dispatch rule: a foreground read never waits inside ferroraid behind queued
/// background or bulk-write I/O of the same member.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IoClass {
    /// Reads serving a client request (including the reads of a degraded read).
    ForegroundRead,
    /// Writes serving a client request, and the reads of its read-modify-write.
    ForegroundWrite,
    /// Flushes and FUA writes.
    Flush,
    /// Resync, rebuild, check and repair I/O.
    Background,
}

impl IoClass {
    /// Every class, in dispatch priority order (highest first).
    pub const ALL: [IoClass; 4] = [
        IoClass::ForegroundRead,
        IoClass::Flush,
        IoClass::ForegroundWrite,
        IoClass::Background,
    ];

    /// Position in [`IoClass::ALL`] (dispatch priority, 0 highest): an index for per-class
    /// arrays.
    pub const fn index(self) -> usize {
        match self {
            IoClass::ForegroundRead => 0,
            IoClass::Flush => 1,
            IoClass::ForegroundWrite => 2,
            IoClass::Background => 3,
        }
    }

    /// Whether the depth controller limits this class (foreground writes, background).
    pub const fn is_write_class(self) -> bool {
        matches!(self, IoClass::ForegroundWrite | IoClass::Background)
    }
}

/// A pacer's answer to "may a background stripe operation start now?".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Start it now.
    Now,
    /// Ask again at (or after) this time, ns on the executor's clock.
    NotBefore(u64),
    /// Ask again once a background operation in flight has completed.
    AfterCompletion,
}

/// Admits background work (resync, rebuild, check, repair) on one shard, from what the
/// shard's foreground I/O experiences. One pacer per shard (per reactor): it sees only its
/// own shard's traffic and needs no synchronisation.
///
/// Times are ns on the executor's clock; latencies are ns from the array request's
/// submission to its completion; sizes are bytes. Implementations must not allocate per
/// call (they run on the hot path).
pub trait Pacer: Send {
    /// A foreground array request (read or write piece) was accepted by the shard.
    fn foreground_submitted(&mut self, now_ns: u64);
    /// A foreground array request finished after `latency_ns`, having moved `bytes`.
    fn foreground_done(&mut self, now_ns: u64, latency_ns: u64, bytes: u64, read: bool);
    /// A foreground array request finished without a member I/O (a read served from the
    /// stripe cache), having moved `bytes`: done, but its latency says nothing about the
    /// members and is no sample. The default reports it as [`Self::foreground_done`] with
    /// latency 0, for pacers that do not measure latency.
    fn foreground_done_unmeasured(&mut self, now_ns: u64, bytes: u64, read: bool) {
        self.foreground_done(now_ns, 0, bytes, read);
    }
    /// A background stripe operation finished after `latency_ns`, having moved
    /// `bytes_per_member` on each member it touched.
    fn background_done(&mut self, now_ns: u64, latency_ns: u64, bytes_per_member: u64);
    /// Whether a background stripe operation moving `bytes_per_member` may start now,
    /// with `in_flight` background operations of this shard outstanding.
    fn admit(&mut self, now_ns: u64, bytes_per_member: u64, in_flight: u32) -> Admission;
}

/// A pacer that admits everything: background runs at full speed, bounded only by the
/// shard's background depth. For tests and for arrays with no foreground traffic.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unpaced;

impl Pacer for Unpaced {
    fn foreground_submitted(&mut self, _now_ns: u64) {}
    fn foreground_done(&mut self, _now_ns: u64, _latency_ns: u64, _bytes: u64, _read: bool) {}
    fn background_done(&mut self, _now_ns: u64, _latency_ns: u64, _bytes_per_member: u64) {}
    fn admit(&mut self, _now_ns: u64, _bytes_per_member: u64, _in_flight: u32) -> Admission {
        Admission::Now
    }
}

#[cfg(test)]
pub(crate) mod tests;
