//! The stateful NBD fuzz target's driver (`fuzz/src/nbd_conversation.rs`, included here)
//! on its seeds (`fuzz/seeds/nbd_conn/`, written by `fuzz/gen_nbd_conn_seeds.py`) and on
//! the inputs kept from fuzzing runs (`fuzz/regressions/nbd_conn/`, each a conversation
//! that once broke a rule): every rule the fuzzer checks holds on each of them, with the
//! stream in one piece and in the input's own pieces, without a fuzzing toolchain.

#[path = "../../fuzz/src/nbd_conversation.rs"]
#[allow(dead_code)]
mod conversation;

use ferroraid_tests::fuzz_inputs;

/// Each seed is a whole conversation: it reaches what it was written for, and every
/// rule holds whatever the pieces.
#[test]
fn seeds_are_whole_conversations() {
    let seeds = fuzz_inputs("seeds/nbd_conn");
    assert!(seeds.len() >= 8, "seeds missing: {}", seeds.len());
    for (name, input) in seeds {
        let o = conversation::run(&input);
        println!("{name}: {o:?}");
        assert!(!o.ambiguous, "{name}: seeds use unique handles");
        match name.as_str() {
            "options-abort" => assert!(!o.transmission, "{name}: {o:?}"),
            // Refused before TLS: no export data in the clear; a ClientHello corrupted in
            // flight ends the handshake.
            "tls-require-export-name" | "tls-tampered-hello" => {
                assert!(!o.transmission && !o.tls && !o.clean, "{name}: {o:?}")
            }
            "no-trim-drop" | "shutdown-drain" => assert!(o.transmission, "{name}: {o:?}"),
            _ => {
                // A clean end: every request answered (DISC excepted).
                assert!(o.transmission && o.clean, "{name}: {o:?}");
                assert!(o.answered >= 4, "{name}: {o:?}");
            }
        }
        // The conversations with STARTTLS complete their TLS handshake (the client's,
        // after the acknowledgement); the others never start one.
        let starttls = name.starts_with("tls-")
            && !name.contains("plaintext")
            && !name.contains("export-name")
            && !name.contains("tampered");
        assert_eq!(o.tls, starttls, "{name}: {o:?}");
        // The same conversation in other pieces: the same requests answered (when the
        // client waits for the server to close; one that vanishes, or a server shutting
        // down, cuts it where the pieces happen to be).
        for frag in [0u16, 1, 0x00ff, 0xbeef] {
            let mut again = input.clone();
            again[1..3].copy_from_slice(&frag.to_be_bytes());
            let p = conversation::run(&again);
            if !o.clean && o.transmission {
                continue;
            }
            assert_eq!(
                (p.transmission, p.clean, p.answered),
                (o.transmission, o.clean, o.answered),
                "{name} in pieces from seed {frag:#x}"
            );
        }
    }
}

/// Every prefix of a conversation (a client that vanishes at any byte) keeps the rules,
/// in the clear and inside TLS.
#[test]
fn a_client_may_vanish_at_any_byte() {
    let seeds = fuzz_inputs("seeds/nbd_conn");
    for (seed, step) in [("structured-go", 7), ("tls-require-refused-first", 13)] {
        let (_, input) = seeds.iter().find(|(n, _)| n == seed).expect("seed");
        for end in (conversation::HEADER_BYTES..input.len()).step_by(step) {
            for drop_client in [0u8, 0x20] {
                let mut cut = input[..end].to_vec();
                cut[0] = (cut[0] & !0x20) | drop_client;
                conversation::run(&cut);
            }
        }
    }
}

/// The TLS byte's other settings on a TLS conversation: an eager client (plaintext where
/// the server's TLS layer expects a ClientHello), each ciphertext byte to flip, TLS 1.2,
/// client certificates: the server ends what it cannot read, and nothing else breaks.
#[test]
fn tls_settings_keep_the_rules() {
    let seeds = fuzz_inputs("seeds/nbd_conn");
    let (_, input) = seeds
        .iter()
        .find(|(n, _)| n == "tls-go")
        .expect("tls-go seed");
    for tls in 0..=255u8 {
        let mut v = input.clone();
        v[3] = tls;
        let o = conversation::run(&v);
        let s = conversation::TlsSetup::from_byte(tls);
        if s.mode == conversation::TlsSetting::Off {
            assert!(!o.tls && o.clean, "TLS byte {tls:#04x}: {o:?}");
        } else if !s.eager && s.tamper.is_none() {
            assert!(o.tls && o.clean, "TLS byte {tls:#04x}: {o:?}");
        } else if s.eager {
            assert!(!o.tls && !o.transmission, "TLS byte {tls:#04x}: {o:?}");
        }
    }
}

/// Inputs kept from fuzzing runs.
#[test]
fn regressions_keep_the_rules() {
    for (name, input) in fuzz_inputs("regressions/nbd_conn") {
        println!("{name}: {:?}", conversation::run(&input));
    }
}
