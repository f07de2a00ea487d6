//! x86-64 SIMD kernels: AVX2, AVX-512BW, and AVX-512 + GFNI.
//!
//! - AVX2 / AVX-512BW multiply by {02} with compare/add/xor and by a constant with the
//!   split-nibble `pshufb` tables of [`gf::NIBBLE`].
//! - GFNI multiplies by any constant, {02} included, with one `gf2p8affineqb` and the
//!   per-constant bit matrix of [`gf::AFFINE`] (`gf2p8mulb` is not usable: it reduces by the
//!   AES polynomial 0x11b, RAID-6 needs 0x11d).
//!
//! Outputs may be written with non-temporal stores (`STREAM`): parity destined for a device
//! need not displace the data it was computed from.

use std::arch::x86_64::*;

use super::gf;
use super::kernels::Isa;

/// AVX2: a unit is two 256-bit registers.
#[derive(Clone, Copy)]
pub struct Avx2;

/// AVX-512F + AVX-512BW: a unit is one 512-bit register.
#[derive(Clone, Copy)]
pub struct Avx512;

/// AVX-512F + AVX-512BW + GFNI.
#[derive(Clone, Copy)]
pub struct Gfni;

/// Prepared multiplier for the pshufb kernels: the low- and high-nibble tables.
#[derive(Clone, Copy)]
pub struct NibbleTables(*const [u8; 32]);

// SAFETY: every method uses only AVX/AVX2 instructions; the Kernel dispatch only calls
// these through `#[target_feature(enable = "avx2")]` entry points after runtime detection.
unsafe impl Isa for Avx2 {
    type V = [__m256i; 2];
    type M = NibbleTables;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self::V {
        // SAFETY: p is 64-byte aligned and valid for 64 bytes (caller contract).
        unsafe {
            [
                _mm256_load_si256(p.cast()),
                _mm256_load_si256(p.add(32).cast()),
            ]
        }
    }
    #[inline(always)]
    unsafe fn store<const STREAM: bool>(p: *mut u8, v: Self::V) {
        // SAFETY: p is 64-byte aligned and valid for 64 bytes of writes (caller contract).
        unsafe {
            if STREAM {
                _mm256_stream_si256(p.cast(), v[0]);
                _mm256_stream_si256(p.add(32).cast(), v[1]);
            } else {
                _mm256_store_si256(p.cast(), v[0]);
                _mm256_store_si256(p.add(32).cast(), v[1]);
            }
        }
    }
    #[inline(always)]
    unsafe fn fence() {
        // SAFETY: sfence has no preconditions.
        unsafe { _mm_sfence() }
    }
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        // SAFETY: AVX present (caller contract).
        unsafe { [_mm256_setzero_si256(); 2] }
    }
    #[inline(always)]
    unsafe fn xor(a: Self::V, b: Self::V) -> Self::V {
        // SAFETY: AVX2 present.
        unsafe { [_mm256_xor_si256(a[0], b[0]), _mm256_xor_si256(a[1], b[1])] }
    }
    #[inline(always)]
    unsafe fn mul2(a: Self::V) -> Self::V {
        // SAFETY: AVX2 present.
        unsafe {
            let poly = _mm256_set1_epi8(0x1d);
            let z = _mm256_setzero_si256();
            let m = |x: __m256i| {
                // 0xff where bit 7 is set (signed compare 0 > x), then the reduction byte.
                let hi = _mm256_and_si256(_mm256_cmpgt_epi8(z, x), poly);
                _mm256_xor_si256(_mm256_add_epi8(x, x), hi)
            };
            [m(a[0]), m(a[1])]
        }
    }
    #[inline(always)]
    unsafe fn prep(c: u8) -> Self::M {
        NibbleTables(&gf::NIBBLE[usize::from(c)])
    }
    #[inline(always)]
    unsafe fn mul(m: Self::M, a: Self::V) -> Self::V {
        // SAFETY: AVX2 present; m.0 points into the static NIBBLE table (32 readable bytes).
        unsafe {
            let t = m.0.cast::<u8>();
            let lo_t = _mm256_broadcastsi128_si256(_mm_loadu_si128(t.cast()));
            let hi_t = _mm256_broadcastsi128_si256(_mm_loadu_si128(t.add(16).cast()));
            let mask = _mm256_set1_epi8(0x0f);
            let f = |x: __m256i| {
                let lo = _mm256_and_si256(x, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), mask);
                _mm256_xor_si256(_mm256_shuffle_epi8(lo_t, lo), _mm256_shuffle_epi8(hi_t, hi))
            };
            [f(a[0]), f(a[1])]
        }
    }
}

// SAFETY: AVX-512F/BW instructions only; called through entry points with
// `#[target_feature(enable = "avx512f,avx512bw")]` after runtime detection.
unsafe impl Isa for Avx512 {
    type V = __m512i;
    type M = NibbleTables;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self::V {
        // SAFETY: p is 64-byte aligned and valid for 64 bytes (caller contract).
        unsafe { _mm512_load_si512(p.cast()) }
    }
    #[inline(always)]
    unsafe fn store<const STREAM: bool>(p: *mut u8, v: Self::V) {
        // SAFETY: p is 64-byte aligned and valid for 64 bytes of writes (caller contract).
        unsafe {
            if STREAM {
                _mm512_stream_si512(p.cast(), v)
            } else {
                _mm512_store_si512(p.cast(), v)
            }
        }
    }
    #[inline(always)]
    unsafe fn fence() {
        // SAFETY: sfence has no preconditions.
        unsafe { _mm_sfence() }
    }
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        // SAFETY: AVX-512F present.
        unsafe { _mm512_setzero_si512() }
    }
    #[inline(always)]
    unsafe fn xor(a: Self::V, b: Self::V) -> Self::V {
        // SAFETY: AVX-512F present.
        unsafe { _mm512_xor_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn mul2(a: Self::V) -> Self::V {
        // SAFETY: AVX-512BW present.
        unsafe {
            let hi = _mm512_movepi8_mask(a); // bit 7 of every byte
            let sh = _mm512_add_epi8(a, a);
            // Reduce by 0x1d only in the bytes whose bit 7 was shifted out.
            _mm512_xor_si512(sh, _mm512_maskz_mov_epi8(hi, _mm512_set1_epi8(0x1d)))
        }
    }
    #[inline(always)]
    unsafe fn prep(c: u8) -> Self::M {
        NibbleTables(&gf::NIBBLE[usize::from(c)])
    }
    #[inline(always)]
    unsafe fn mul(m: Self::M, a: Self::V) -> Self::V {
        // SAFETY: AVX-512BW present; m.0 points to 32 readable bytes of the static table.
        unsafe {
            let t = m.0.cast::<u8>();
            let lo_t = _mm512_broadcast_i32x4(_mm_loadu_si128(t.cast()));
            let hi_t = _mm512_broadcast_i32x4(_mm_loadu_si128(t.add(16).cast()));
            let mask = _mm512_set1_epi8(0x0f);
            let lo = _mm512_and_si512(a, mask);
            let hi = _mm512_and_si512(_mm512_srli_epi16(a, 4), mask);
            _mm512_xor_si512(_mm512_shuffle_epi8(lo_t, lo), _mm512_shuffle_epi8(hi_t, hi))
        }
    }
}

// SAFETY: AVX-512F/BW + GFNI instructions only; called through entry points with
// `#[target_feature(enable = "avx512f,avx512bw,gfni")]` after runtime detection.
unsafe impl Isa for Gfni {
    type V = __m512i;
    type M = u64;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self::V {
        // SAFETY: as Avx512::load.
        unsafe { Avx512::load(p) }
    }
    #[inline(always)]
    unsafe fn store<const STREAM: bool>(p: *mut u8, v: Self::V) {
        // SAFETY: as Avx512::store.
        unsafe { Avx512::store::<STREAM>(p, v) }
    }
    #[inline(always)]
    unsafe fn fence() {
        // SAFETY: sfence has no preconditions.
        unsafe { _mm_sfence() }
    }
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        // SAFETY: AVX-512F present.
        unsafe { _mm512_setzero_si512() }
    }
    #[inline(always)]
    unsafe fn xor(a: Self::V, b: Self::V) -> Self::V {
        // SAFETY: AVX-512F present.
        unsafe { _mm512_xor_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn mul2(a: Self::V) -> Self::V {
        // SAFETY: AVX-512F + GFNI present.
        unsafe { _mm512_gf2p8affine_epi64_epi8::<0>(a, _mm512_set1_epi64(gf::AFFINE[2] as i64)) }
    }
    #[inline(always)]
    unsafe fn prep(c: u8) -> Self::M {
        gf::AFFINE[usize::from(c)]
    }
    #[inline(always)]
    unsafe fn mul(m: Self::M, a: Self::V) -> Self::V {
        // SAFETY: AVX-512F + GFNI present.
        unsafe { _mm512_gf2p8affine_epi64_epi8::<0>(a, _mm512_set1_epi64(m as i64)) }
    }
}
