//! The `ferroraid` crate's library: the parts of the target that tests and other tools
//! use directly.
//!
//! - [`rpc`]: the JSON-RPC 2.0 management socket (server, [`rpc::Handler`], client).
//! - [`status`]: the status report (`ferroraid status`, the `array_status` method).
//! - [`examine`]: superblock reports (`ferroraid examine`).

pub mod examine;
pub mod rpc;
pub mod status;
