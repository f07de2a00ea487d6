//! The whole-connection NVMe/TCP fuzz target's driver (`fuzz/src/nvmf_conn.rs`, included
//! here) on its seeds (`fuzz/seeds/nvmf_conn/`, written by `fuzz/gen_nvmf_conn_seeds.py`)
//! and on the inputs kept from fuzzing runs (`fuzz/regressions/nvmf_conn/`): every rule the
//! fuzzer checks holds on each of them, and each seed gets as far as it was written to,
//! without a fuzzing toolchain.

#[path = "../../fuzz/src/nvmf_conn.rs"]
#[allow(dead_code)]
mod conn;

use ferroraid_tests::{fuzz_inputs, fuzz_seed};

fn seed(name: &str) -> Vec<u8> {
    fuzz_seed("seeds/nvmf_conn", name)
}

/// Each seed is a whole conversation that gets as far as it was written to.
#[test]
fn seeds_reach_their_commands() {
    let seeds = fuzz_inputs("seeds/nvmf_conn");
    assert!(seeds.len() >= 10, "seeds missing: {}", seeds.len());
    for (name, input) in seeds {
        let o = conn::run(&input);
        println!("{name}: {o:?}");
        match name.as_str() {
            "admin-io" => {
                // 2 connects; the I/O mix: everything but the failed Compare, the
                // out-of-range read and the unknown opcode succeeds.
                assert!(
                    o.connects == 2 && o.io_ok == 10 && o.r2t >= 2,
                    "{name}: {o:?}"
                );
                assert!(o.c2h_data >= 3 && o.term == 0, "{name}: {o:?}");
                assert!(o.checked == 2 && o.aers_held == 1, "{name}: {o:?}");
            }
            "digests-raid6-pieces" => {
                assert!(
                    o.hdgst == 2 && o.ddgst == 2 && o.io_ok == 10,
                    "{name}: {o:?}"
                );
                assert!(o.checked == 2 && o.aers_held == 4, "{name}: {o:?}");
            }
            "hdgst-aer-limit-small-h2c" => {
                assert!(o.hdgst == 2 && o.io_ok == 10, "{name}: {o:?}");
                // 128 KiB and 16 KiB writes in 4 KiB H2CData PDUs.
                assert!(o.h2c_data >= 36, "{name}: {o:?}");
                assert!(o.checked == 2 && o.aers_held == 4, "{name}: {o:?}");
            }
            "small-buffers" => {
                assert!(
                    o.io_ok == 12 && o.r2t >= 6 && o.checked == 2,
                    "{name}: {o:?}"
                )
            }
            "withhold-r2t" => {
                // The read in capsule-sized data and the Flush complete; the R2T write
                // waits for data that never comes.
                assert!(
                    o.r2t >= 1 && o.h2c_data == 0 && o.checked == 2,
                    "{name}: {o:?}"
                );
                assert!(o.io_ok >= 2, "{name}: {o:?}");
            }
            // The target closes the I/O queue after the Disconnect (not checked).
            "io-disconnect" => {
                assert!(
                    o.connects == 2 && o.io_ok == 1 && o.checked == 1,
                    "{name}: {o:?}"
                )
            }
            "discovery" => {
                assert!(
                    o.connects == 1 && o.c2h_data >= 2 && o.checked == 1,
                    "{name}: {o:?}"
                )
            }
            // The admin queue's TermReq ends the association: the I/O queue's Connect fails, its
            // stray H2CData gets the second TermReq.
            "termreq" => assert!(o.term == 2 && o.connects == 1, "{name}: {o:?}"),
            "admin-drop-mid-capsule" | "shutdown-busy" => {
                assert!(o.connects == 2 && o.io_ok >= 1, "{name}: {o:?}")
            }
            // The target closes at the host's end of stream: what it has not answered
            // by then is dropped.
            "half-close-now" => assert!(o.connects == 2 && o.checked == 0, "{name}: {o:?}"),
            other => panic!("seed {other} has no expectation"),
        }
    }
}

/// Every seed with its bytes sent in pieces chosen by other fragmentation seeds keeps the
/// rules.
#[test]
fn pieces_keep_the_rules() {
    for (name, mut input) in fuzz_inputs("seeds/nvmf_conn") {
        for s in [1u8, 5, 13, 200] {
            input[1] = s;
            let o = conn::run(&input);
            assert!(o.icresp >= 1, "{name} with pieces {s}: {o:?}");
        }
    }
}

/// Every 7th prefix of two conversations (a host that vanishes at that byte, or half-
/// closes there) keeps the rules: nothing is left held once it is gone.
#[test]
fn a_host_may_vanish_at_any_byte() {
    for name in ["admin-io", "digests-raid6-pieces"] {
        let input = seed(name);
        for end in (2..input.len()).step_by(7) {
            conn::run(&input[..end]);
        }
    }
}

/// The inputs kept from fuzzing runs keep the rules.
#[test]
fn regressions_keep_the_rules() {
    for (name, input) in fuzz_inputs("regressions/nvmf_conn") {
        println!("{name}");
        conn::run(&input);
    }
}
