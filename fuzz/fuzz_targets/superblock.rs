//! Fuzz target: md v1.2 superblock parsing (`engine::metadata`).
//!
//! Feeds the input to the parser twice: as it is (exercising the format checks: magic,
//! version, max_dev, checksum) and with magic, version, padding and checksum fixed up so
//! the input reaches the deeper checks (features, level, layout, chunk, offsets, roles)
//! and assembly. Whatever decodes must re-encode to exactly the bytes it came from.
#![no_main]

use engine::metadata::{
    assemble, parse, raw_checksum, AssembleOptions, Candidate, Superblock, MD_SB_MAGIC,
};
use libfuzzer_sys::fuzz_target;

fn check(bytes: &[u8]) {
    let _ = parse(bytes);
    if let Ok(sb) = Superblock::decode(bytes) {
        let n = sb.encoded_len();
        let again = sb.to_bytes().expect("a decoded superblock encodes");
        assert_eq!(&again[..], &bytes[..n], "decode/encode round trip");
        let _ = sb.check_supported();
        let _ = sb.array_geometry(4096);
        let _ = (sb.name(), sb.short_name(), sb.role(), sb.ppl());
        let mut twin = sb.clone();
        twin.dev_number = twin.dev_number.wrapping_add(1);
        twin.events = twin.events.wrapping_sub(1);
        let candidates = [Candidate::new("a", sb), Candidate::new("b", twin)];
        for force in [false, true] {
            let _ = assemble(
                &candidates,
                AssembleOptions {
                    force,
                    ..AssembleOptions::default()
                },
            );
        }
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    if data.len() >= 256 {
        let mut fixed = data.to_vec();
        fixed[0..4].copy_from_slice(&MD_SB_MAGIC.to_le_bytes());
        fixed[4..8].copy_from_slice(&1u32.to_le_bytes());
        fixed[12..16].fill(0);
        fixed[224..256].fill(0);
        if let Ok(c) = raw_checksum(&fixed) {
            fixed[216..220].copy_from_slice(&c.to_le_bytes());
        }
        check(&fixed);
    }
});
