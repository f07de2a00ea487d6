//! The NBD server (the NBD project's `doc/proto.md`, fixed newstyle).
//!
//! - [`proto`]: the wire format, pure (parsing, encoding, the request rules).

pub mod proto;
