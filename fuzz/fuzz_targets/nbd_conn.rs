//! Fuzz target: a whole NBD connection in process — the handshake with options in any
//! order, STARTTLS and the rest inside TLS, the transmission phase with interleaved
//! commands, disconnects at any byte — against the real server (handshake state machine
//! and reactor front-end) over an in-memory array, the client's bytes delivered in pieces
//! the input chooses. The input format and the rules checked are in
//! `src/nbd_conversation.rs`.
//!
//! With `NBD_CONN_STATS=N` in the environment it prints, every N executions, how many
//! completed a TLS handshake and how many of those reached the transmission phase (to see
//! that a run reaches TLS).
#![no_main]

#[path = "../src/nbd_conversation.rs"]
mod conversation;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

static RUNS: AtomicU64 = AtomicU64::new(0);
static TLS: AtomicU64 = AtomicU64::new(0);
static TLS_TRANSMISSION: AtomicU64 = AtomicU64::new(0);

fn every() -> u64 {
    static EVERY: OnceLock<u64> = OnceLock::new();
    *EVERY.get_or_init(|| {
        std::env::var("NBD_CONN_STATS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    })
}

fuzz_target!(|data: &[u8]| {
    let o = conversation::run(data);
    let every = every();
    if every == 0 {
        return;
    }
    let runs = RUNS.fetch_add(1, Ordering::Relaxed) + 1;
    if o.tls {
        TLS.fetch_add(1, Ordering::Relaxed);
        if o.transmission {
            TLS_TRANSMISSION.fetch_add(1, Ordering::Relaxed);
        }
    }
    if runs.is_multiple_of(every) {
        eprintln!(
            "nbd_conn: {runs} runs, {} with a TLS handshake, {} of them in transmission",
            TLS.load(Ordering::Relaxed),
            TLS_TRANSMISSION.load(Ordering::Relaxed)
        );
    }
});
