//! ferroraid device back ends.
//!
//! This crate will hold the implementations of the engine's block-device trait (io_uring
//! over files and block devices, NVMe passthrough, a vfio user-space NVMe driver, and RAM
//! and null devices). The trait itself arrives with the data path (issue 3); until then the
//! crate only re-exports the engine so that the dependency direction `drivers -> engine`
//! is fixed from the start.

pub use engine;
