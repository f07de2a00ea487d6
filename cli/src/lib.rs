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

/// An error and its causes for people, one line: `error: cause: cause …` as anyhow's
/// `{:#}` prints it, less every cause whose text the line already holds. Many error types
/// put their cause's text in their own message and also return that cause as `source()`
/// (ours, with thiserror's `{source}`; io wrappers of other crates): `{:#}` then says it
/// twice.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let t = cause.to_string();
        if out.contains(&t) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&t);
    }
    out
}

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
