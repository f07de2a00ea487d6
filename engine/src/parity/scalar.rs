//! The scalar reference: byte-at-a-time arithmetic, written for obviousness. Every SIMD
//! kernel must produce exactly its bytes.

use super::gf;
use super::kernels::{Isa, UNIT};

/// Plain Rust, no vector instructions assumed.
#[derive(Clone, Copy)]
pub struct Scalar;

// SAFETY: uses no ISA extension; valid on every CPU.
unsafe impl Isa for Scalar {
    type V = [u8; UNIT];
    type M = u8;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self::V {
        // SAFETY: caller guarantees p is valid for UNIT bytes.
        unsafe { p.cast::<[u8; UNIT]>().read() }
    }
    #[inline(always)]
    unsafe fn store<const STREAM: bool>(p: *mut u8, v: Self::V) {
        // SAFETY: caller guarantees p is valid for UNIT bytes of writes.
        unsafe { p.cast::<[u8; UNIT]>().write(v) }
    }
    #[inline(always)]
    unsafe fn fence() {}
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        [0; UNIT]
    }
    #[inline(always)]
    unsafe fn xor(a: Self::V, b: Self::V) -> Self::V {
        let mut r = a;
        for (x, y) in r.iter_mut().zip(b) {
            *x ^= y;
        }
        r
    }
    #[inline(always)]
    unsafe fn mul2(a: Self::V) -> Self::V {
        let mut r = a;
        for x in r.iter_mut() {
            // x·{02}: shift left, reduce by the low byte of 0x11d when bit 7 falls out.
            *x = (*x << 1) ^ if *x & 0x80 != 0 { 0x1d } else { 0 };
        }
        r
    }
    #[inline(always)]
    unsafe fn prep(c: u8) -> Self::M {
        c
    }
    #[inline(always)]
    unsafe fn mul(m: Self::M, a: Self::V) -> Self::V {
        let mut r = a;
        for x in r.iter_mut() {
            *x = gf::mul(m, *x);
        }
        r
    }
}
