//! What the in-process conversation drivers (`nbd_conversation.rs`, `iscsi_session.rs`,
//! `nvmf_conn.rs`) share: the client's non-blocking send and the in-memory array they
//! serve. Each driver includes this file as its own `harness` module (`#[path]`), in the
//! fuzz targets and in the seed replay tests alike.

use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use drivers::mem::MemDevice;
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};

/// Sends `b` on `s` without blocking and without `SIGPIPE` (`MSG_NOSIGNAL`: the fuzzer's
/// process does not ignore the signal). Returns the bytes sent (0 when the socket's buffer
/// is full or the call was interrupted); `None`: the target has closed.
pub fn send(s: &UnixStream, b: &[u8]) -> Option<usize> {
    // SAFETY: `b` is a valid slice for the call; the descriptor is open (owned by `s`).
    let n = unsafe {
        libc::send(
            s.as_raw_fd(),
            b.as_ptr().cast(),
            b.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if n >= 0 {
        return Some(n as usize);
    }
    match std::io::Error::last_os_error().kind() {
        ErrorKind::WouldBlock | ErrorKind::Interrupted => Some(0),
        _ => None,
    }
}

/// A `level` array (md's left-symmetric layout) of `members` in-memory members of
/// `stripes` chunks of `chunk` bytes each, with `block`-byte blocks: its geometry and its
/// members (each allowing 32 requests in flight).
///
/// # Panics
/// A geometry the engine refuses (the drivers pass fixed, valid ones).
pub fn mem_array(
    level: Level,
    members: u16,
    chunk: u64,
    block: u32,
    stripes: u64,
) -> (ArrayGeometry, Vec<MemDevice>) {
    let g = Geometry::new(level, Layout::LeftSymmetric, members, chunk, block).expect("geometry");
    let geo = ArrayGeometry::new(g, stripes).expect("array geometry");
    let devices = (0..members)
        .map(|i| MemDevice::new(&format!("m{i}"), stripes * chunk, block, 32).expect("mem"))
        .collect();
    (geo, devices)
}
