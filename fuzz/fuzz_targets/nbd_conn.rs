//! Fuzz target: a whole NBD connection in process — the handshake with options in any
//! order, the transmission phase with interleaved commands, disconnects at any byte —
//! against the real server (handshake state machine and reactor front-end) over an
//! in-memory array, the client's bytes delivered in pieces the input chooses. The input
//! format and the rules checked are in `src/nbd_conversation.rs`.
#![no_main]

#[path = "../src/nbd_conversation.rs"]
mod conversation;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    conversation::run(data);
});
