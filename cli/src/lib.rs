//! ferroraid as a library: the parts of the storage target that the `ferroraid` binary
//! wires together, exposed so integration tests (and later a fuzzer) can use them
//! in-process.
//!
//! - [`nbd`]: the NBD server (protocol, handshake, reactor front-end).
//! - [`target`]: the running target (assembly, reactors, NBD, superblock bookkeeping).
//! - [`create`]: creating an array (superblocks, initial parity by zeroing).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod create;
pub mod nbd;
pub mod target;
