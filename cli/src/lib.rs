//! The `ferroraid` crate's library: the parts of the target that tests and other tools
//! use directly.
//!
//! - [`status`]: the status report (`ferroraid status`, the `array_status` method).

pub mod status;
