//! Fuzz target: the NBD wire parsers of `ferroraid::nbd::proto` — a transmission request
//! (parsed, round-tripped through `encode_request`, judged by `check_request` against
//! limits taken from the input), an option header, and every option's data. None may
//! panic; a parsed request must re-encode to the same bytes.
#![no_main]

use ferroraid::nbd::proto::{
    check_request, encode_request, parse_option, parse_option_header, parse_request, ExportLimits,
    REQUEST_BYTES,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = parse_request(data) {
        assert_eq!(&encode_request(&r)[..], &data[..REQUEST_BYTES]);
        // Limits from the input's tail: any combination must be judged without panicking.
        let tail = data.get(REQUEST_BYTES..).unwrap_or_default();
        let byte = |i: usize| tail.get(i).copied().unwrap_or(0);
        let lim = ExportLimits {
            size_bytes: u64::from(byte(0)) << (byte(1) % 48),
            min_block_bytes: 1u32 << (byte(2) % 17),
            max_block_bytes: 1u32 << (byte(3) % 32),
            trim: byte(4) & 1 != 0,
            write_zeroes: byte(4) & 2 != 0,
            fast_zero: byte(4) & 4 != 0,
            structured: byte(4) & 8 != 0,
            block_status: byte(4) & 16 != 0,
        };
        let _ = check_request(&r, &lim);
    }
    let _ = parse_option_header(data);
    if let Some((&kind, rest)) = data.split_first() {
        let _ = parse_option(u32::from(kind % 16), rest);
    }
});
