//! ferroraid device back ends: implementations of [`engine::device::BlockDevice`].
//!
//! - [`any`]: one device type over all of them (and a placeholder for a missing member).
//! - [`mem`]: a RAM disk (data kept in memory; for tests and CPU-cost benchmarks).
//! - [`null`]: no data at all; every request completes at once (pure CPU cost).
//! - [`uring`]: io_uring over regular files and block devices with O_DIRECT.
//! - [`nvme_passthru`]: NVMe commands through io_uring passthrough on `/dev/ngXnY`.
//! - [`vfio_nvme`]: a polled user-space NVMe driver over VFIO (`vfio:0000:00:04.0`).
//! - [`nvme`]: NVMe command formats, Identify parsing and status mapping both share.
//! - [`metadata_io`]: reading and writing md v1.2 superblocks (positioned I/O + sync);
//!   not a device back end, but the I/O the engine's `metadata` module leaves out.
//!
//! The simulated device with a virtual clock lives in the engine (`engine::sim`), as the
//! engine's own test world.

pub mod any;
pub mod mem;
pub mod metadata_io;
pub mod null;
pub mod nvme;
pub mod nvme_passthru;
pub mod ppl_io;
pub mod topology;
pub mod uring;
pub mod vfio_nvme;
