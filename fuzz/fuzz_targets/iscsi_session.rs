//! Fuzz target: whole iSCSI sessions in process — logins (AuthMethod=None, CHAP one-way
//! and mutual, operational negotiation, discovery sessions with SendTargets), the
//! full-feature phase (SCSI commands with immediate data, unsolicited and R2T-solicited
//! Data-Out, task management, NOP-Out, text, logout), several connections, disconnects
//! at any byte — against the real target (login state machine and reactor front-end) over
//! an in-memory RAID5/RAID6 array. The input format and the rules checked are in
//! `src/iscsi_session.rs`.
#![no_main]

#[path = "../src/iscsi_session.rs"]
mod session;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    session::run(data);
});
