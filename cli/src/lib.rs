//! ferroraid as a library: the parts of the storage target that the `ferroraid` binary
//! wires together, exposed so integration tests (and later a fuzzer) can use them
//! in-process.
//!
//! - [`nbd`]: the NBD server (protocol, handshake, reactor front-end).
//! - [`nvmf`]: NVMe over TCP (so far the PDU layer: [`nvmf::pdu`]).
//! - [`target`]: the running target (assembly, reactors, NBD, superblock bookkeeping).
//! - [`create`]: creating an array (superblocks, initial parity by zeroing).
//! - [`grow`]: switching a stopped array's consistency policy (`ppl` ↔ `resync`).
//! - [`rpc`]: the JSON-RPC 2.0 management socket (server, [`rpc::Handler`], client).
//! - [`status`]: the status report (`ferroraid status`, the `array_status` method).
//! - [`examine`]: superblock reports (`ferroraid examine`).
//! - [`notify`]: readiness notification to systemd (`Type=notify`, `sd_notify`'s protocol).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod create;
pub mod examine;
pub mod frontends;
pub mod grow;
pub mod iscsi;
pub mod metrics;
pub mod nbd;
pub mod node;
pub mod notify;
pub mod nvmf;
pub mod rpc;
pub mod scan;
pub mod status;
pub mod target;
