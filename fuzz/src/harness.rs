//! What the in-process conversation drivers (`nbd_conversation.rs`, `iscsi_session.rs`,
//! `nvmf_conn.rs`) share: the client's non-blocking send and the in-memory array they
//! serve. Each driver includes this file as its own `harness` module (`#[path]`), in the
//! fuzz targets and in the seed replay tests alike.
// Each driver uses what it needs of this file (the NBD driver has no length-prefixed
// actions).
#![allow(dead_code)]

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

/// Splits a length-prefixed piece off the front of an action stream: a big-endian `u16`
/// length (0 when fewer than 2 bytes are left), then that many bytes (fewer at the end of
/// the input). Returns the piece; `b` keeps the rest.
pub fn take_prefixed<'a>(b: &mut &'a [u8]) -> &'a [u8] {
    let n = match *b {
        [h, l, ..] => usize::from(u16::from_be_bytes([*h, *l])),
        _ => 0,
    };
    let rest = b.get(2..).unwrap_or_default();
    let (d, rest) = rest.split_at(n.min(rest.len()));
    *b = rest;
    d
}

/// Runs loop turns (`turn` returns whether anything moved) until two turns in a row move
/// nothing, or `max` turns have run.
pub fn turn_until_quiet(max: u32, mut turn: impl FnMut() -> bool) {
    let mut quiet = 0;
    for _ in 0..max {
        if turn() {
            quiet = 0;
        } else {
            quiet += 1;
            if quiet == 2 {
                break;
            }
        }
    }
}
