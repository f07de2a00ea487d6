//! Fuzz target: a whole NVMe/TCP connection (and the other queues of its association) in
//! process — ICReq, admin and I/O commands, R2T exchanges, disconnects at any byte —
//! against the real front-end over an in-memory array, the host's bytes delivered in
//! pieces the input chooses. The input format and the rules checked are in
//! `src/nvmf_conn.rs`.
#![no_main]

#[path = "../src/nvmf_conn.rs"]
mod conn;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    conn::run(data);
});
