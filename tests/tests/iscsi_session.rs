//! The stateful iSCSI fuzz target's driver (`fuzz/src/iscsi_session.rs`, included here) on
//! its seeds (`fuzz/seeds/iscsi_session/`, written by `fuzz/gen_iscsi_session_seeds.py`)
//! and on the inputs kept from fuzzing runs (`fuzz/regressions/iscsi_session/`): every rule
//! the fuzzer checks holds on each of them, and each seed reaches what it was written for,
//! without a fuzzing toolchain.

#[path = "../../fuzz/src/iscsi_session.rs"]
#[allow(dead_code)]
mod session;

use ferroraid_tests::{fuzz_inputs, fuzz_seed};

fn seed(name: &str) -> Vec<u8> {
    fuzz_seed("seeds/iscsi_session", name)
}

/// Each seed is a whole session that gets as deep as it was written to.
#[test]
fn seeds_reach_their_phase() {
    let seeds = fuzz_inputs("seeds/iscsi_session");
    assert!(seeds.len() >= 12, "seeds missing: {}", seeds.len());
    for (name, input) in seeds {
        let o = session::run(&input);
        println!("{name}: {o:?}");
        assert_eq!(o.login_failures, 0, "{name}: {o:?}");
        assert!(o.logins >= 1, "{name}: {o:?}");
        match name.as_str() {
            "discovery-chap-digests" => {
                assert_eq!(o.full_feature, 0, "{name}: {o:?}");
                assert!(o.send_targets == 1 && o.logout == 1, "{name}: {o:?}");
            }
            "discovery" => {
                assert!(o.send_targets == 1 && o.full_feature == 1, "{name}: {o:?}");
                assert!(o.reject >= 1 && o.logout == 2, "{name}: {o:?}");
                assert!(o.scsi_good >= 7, "{name}: {o:?}");
            }
            "abort" => {
                assert!(o.tmf >= 6 && o.r2t >= 3, "{name}: {o:?}");
                assert!(o.scsi_good >= 2 && o.logout == 1, "{name}: {o:?}");
            }
            "r2t" => assert!(o.r2t >= 5 && o.scsi_good >= 3, "{name}: {o:?}"),
            "r2t-outstanding" => assert!(o.r2t >= 2 && o.scsi_good >= 2, "{name}: {o:?}"),
            "two-connections" => {
                assert!(o.full_feature == 2 && o.r2t >= 2, "{name}: {o:?}");
                assert!(o.scsi_good >= 3 && o.logout == 1, "{name}: {o:?}");
            }
            "pieces-and-drop" | "shutdown-busy" => {
                assert!(o.full_feature == 1 && o.logout == 0, "{name}: {o:?}")
            }
            // Regression: a draining connection was no longer read, so a write waiting
            // for its solicited data could not finish (and the initiator's close went
            // unseen) until the drain grace period expired.
            "shutdown-r2t-data" => {
                assert!(o.r2t == 1 && o.scsi_good == 1, "{name}: {o:?}")
            }
            "busy-small-buffers" => {
                assert!(o.data_in >= 12 && o.scsi_good >= 16, "{name}: {o:?}")
            }
            _ => {
                assert!(o.full_feature == 1 && o.logout == 1, "{name}: {o:?}");
                assert!(o.scsi_good >= 2 && o.scsi_other == 0, "{name}: {o:?}");
            }
        }
    }
}

/// Every 5th prefix of a session (an initiator that vanishes at that byte) keeps the
/// rules: nothing is left held once it is gone.
#[test]
fn an_initiator_may_vanish_at_any_byte() {
    for name in ["abort", "chap-mutual-digests", "two-connections"] {
        let input = seed(name);
        let step = if input.len() > 8000 { 97 } else { 5 };
        for end in (1..input.len()).step_by(step) {
            session::run(&input[..end]);
        }
    }
}

/// The inputs kept from fuzzing runs keep the rules.
#[test]
fn regressions_keep_the_rules() {
    for (name, input) in fuzz_inputs("regressions/iscsi_session") {
        println!("{name}");
        session::run(&input);
    }
}
