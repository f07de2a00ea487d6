//! The engine's own test world: a virtual clock and simulated block devices with a latency
//! model and seeded fault injection. The same engine code that production runs is driven
//! over these devices by a single-threaded executor, so a test is deterministic and a
//! failing seed replays exactly (TigerBeetle's VOPR, FoundationDB's simulation).
//!
//! - [`SimClock`]: virtual time in nanoseconds, shared by every device of one simulation.
//!   Time moves only when the executor advances it (to the next event).
//! - [`SimDevice`]: a [`crate::device::BlockDevice`] holding its data in memory, serving
//!   requests on a model of fixed latency + transfer bandwidth + internal parallelism +
//!   device queue depth (+ seek and rotation for disks), per [`Profile`].
//! - [`Fault`]: what can go wrong, injected by rule or by seeded chance: I/O errors on
//!   chosen ops or LBA ranges, latent sector errors, a member that disappears, a slow member,
//!   a torn (partially applied) write, and — for profiles with a volatile write cache — a
//!   power cut that loses completed writes no flush or FUA made durable
//!   ([`SimDevice::crash_volatile`]).
//! - [`workload`]: closed-loop client jobs (sequential writers, random readers) driven
//!   against an array in virtual time.

mod clock;
mod device;
mod profile;
pub mod workload;

pub use clock::SimClock;
pub use device::{
    Fault, FaultRule, IoEvent, IoEventKind, IoLog, OpFilter, SimChannel, SimDevice, SimMedia,
    SimStats, VolatileLoss,
};
pub use profile::{Profile, Seek};
