//! Memory-read bandwidth baseline: XOR-reduce buffers into registers and discard the result.
//! It reads exactly what a parity kernel reads and writes nothing, so "kernel GB/s ÷
//! baseline GB/s" says how close the kernel gets to the machine's read bandwidth on the
//! same buffers in the same run.

/// XOR of all 64-byte units of every buffer in `bufs` (returned so the reads cannot be
/// optimised away). Uses AVX-512 where available, AVX2 next, plain `u64` otherwise.
///
/// # Panics
/// If a buffer's length is not a multiple of 64 or it is not 64-byte aligned.
pub fn read_all(bufs: &[&[u8]]) -> u64 {
    for b in bufs {
        assert!(b.len() % 64 == 0 && (b.as_ptr() as usize).is_multiple_of(64));
    }
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F detected; buffers checked above.
            return unsafe { read_avx512(bufs) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 detected; buffers checked above.
            return unsafe { read_avx2(bufs) };
        }
    }
    let mut acc = 0u64;
    for b in bufs {
        for w in b.chunks_exact(8) {
            acc ^= u64::from_le_bytes(w.try_into().expect("8 bytes"));
        }
    }
    acc
}

/// Four independent accumulators per buffer step, 256 bytes per iteration, buffers in
/// turn — the same access pattern as the parity kernels (all sources at one offset, then
/// the next offset).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn read_avx512(bufs: &[&[u8]]) -> u64 {
    use std::arch::x86_64::*;
    let len = bufs.first().map_or(0, |b| b.len());
    let mut a = [_mm512_setzero_si512(); 4];
    let mut off = 0;
    while off + 256 <= len {
        for b in bufs {
            for (u, acc) in a.iter_mut().enumerate() {
                // SAFETY: off + 256 <= len == b.len(); 64-byte aligned (checked by caller).
                let v = unsafe { _mm512_load_si512(b.as_ptr().add(off + 64 * u).cast()) };
                *acc = _mm512_xor_si512(*acc, v);
            }
        }
        off += 256;
    }
    let x = _mm512_xor_si512(_mm512_xor_si512(a[0], a[1]), _mm512_xor_si512(a[2], a[3]));
    let mut out = [0u64; 8];
    // SAFETY: out is 64 bytes; unaligned store.
    unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast(), x) };
    out.iter().fold(0, |s, v| s ^ v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn read_avx2(bufs: &[&[u8]]) -> u64 {
    use std::arch::x86_64::*;
    let len = bufs.first().map_or(0, |b| b.len());
    let mut a = [_mm256_setzero_si256(); 4];
    let mut off = 0;
    while off + 128 <= len {
        for b in bufs {
            for (u, acc) in a.iter_mut().enumerate() {
                // SAFETY: off + 128 <= len == b.len(); 32-byte aligned.
                let v = unsafe { _mm256_load_si256(b.as_ptr().add(off + 32 * u).cast()) };
                *acc = _mm256_xor_si256(*acc, v);
            }
        }
        off += 128;
    }
    let x = _mm256_xor_si256(_mm256_xor_si256(a[0], a[1]), _mm256_xor_si256(a[2], a[3]));
    let mut out = [0u64; 4];
    // SAFETY: out is 32 bytes; unaligned store.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), x) };
    out.iter().fold(0, |s, v| s ^ v)
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_every_byte() {
        let mut a = engine::buf::AlignedBuf::zeroed(1024);
        let b = engine::buf::AlignedBuf::zeroed(1024);
        assert_eq!(super::read_all(&[&a, &b]), 0);
        a[1000] = 0x5a;
        assert_ne!(super::read_all(&[&a, &b]), 0);
    }
}
