//! ferroraid as a library: the parts of the storage target that the `ferroraid` binary
//! wires together, exposed so integration tests (and later a fuzzer) can use them
//! in-process.
//!
//! - [`nbd`]: the NBD server (protocol, handshake, reactor front-end).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod nbd;
