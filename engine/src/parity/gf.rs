//! GF(2^8) arithmetic for RAID-6: polynomial x^8+x^4+x^3+x^2+1 (0x11d), generator
//! g = {02} (H. P. Anvin, "The mathematics of RAID-6"; the same field as Linux's
//! `lib/raid6` and ISA-L).
//!
//! Every table here is computed at compile time by `const fn`, from the polynomial alone.

/// The field's reduction polynomial, including the x^8 term.
pub const POLY: u16 = 0x11d;

const fn build_exp() -> [u8; 512] {
    let mut exp = [0u8; 512];
    let mut x: u16 = 1;
    let mut i = 0;
    while i < 255 {
        exp[i] = x as u8;
        x <<= 1;
        if x & 0x100 != 0 {
            x ^= POLY;
        }
        i += 1;
    }
    // Doubled so that exp[log a + log b] needs no reduction mod 255.
    while i < 512 {
        exp[i] = exp[i - 255];
        i += 1;
    }
    exp
}

const fn build_log(exp: &[u8; 512]) -> [u8; 256] {
    let mut log = [0u8; 256];
    let mut i = 0;
    while i < 255 {
        log[exp[i] as usize] = i as u8;
        i += 1;
    }
    log
}

/// `EXP[i] = g^i` for `i` in `0..510` (the table repeats with period 255).
pub static EXP: [u8; 512] = build_exp();
/// `LOG[a]` = the `i` with `g^i = a`, for `a != 0` (`LOG[0]` is meaningless, 0).
pub static LOG: [u8; 256] = build_log(&build_exp());

const fn mul_const_fn(a: u8, b: u8) -> u8 {
    // Shift-and-add (Russian peasant) multiplication: usable in const context.
    let mut a = a as u16;
    let mut b = b;
    let mut r: u16 = 0;
    while b != 0 {
        if b & 1 != 0 {
            r ^= a;
        }
        a <<= 1;
        if a & 0x100 != 0 {
            a ^= POLY;
        }
        b >>= 1;
    }
    r as u8
}

/// `a · b` in GF(2^8)/0x11d.
#[inline]
pub fn mul(a: u8, b: u8) -> u8 {
    if a == 0 || b == 0 {
        0
    } else {
        EXP[LOG[a as usize] as usize + LOG[b as usize] as usize]
    }
}

/// Multiplicative inverse of `a`.
///
/// # Panics
/// If `a == 0` (zero has no inverse; callers only invert non-zero coefficients).
#[inline]
pub fn inv(a: u8) -> u8 {
    assert!(a != 0, "zero has no inverse in GF(2^8)");
    EXP[255 - LOG[a as usize] as usize]
}

/// `g^e` for any exponent (reduced mod 255).
#[inline]
pub fn pow_g(e: u32) -> u8 {
    EXP[(e % 255) as usize]
}

const fn build_nibble_tables() -> [[u8; 32]; 256] {
    let mut t = [[0u8; 32]; 256];
    let mut c = 0;
    while c < 256 {
        let mut i = 0;
        while i < 16 {
            t[c][i] = mul_const_fn(c as u8, i as u8);
            t[c][16 + i] = mul_const_fn(c as u8, (i << 4) as u8);
            i += 1;
        }
        c += 1;
    }
    t
}

/// Split-nibble multiplication tables for `pshufb`: for constant `c`,
/// `NIBBLE[c][0..16][i] = c·i` and `NIBBLE[c][16..32][i] = c·(i << 4)`, so that
/// `c·x = NIBBLE[c][x & 15] ⊕ NIBBLE[c][16 + (x >> 4)]`.
pub static NIBBLE: [[u8; 32]; 256] = build_nibble_tables();

const fn build_affine() -> [u64; 256] {
    let mut t = [0u64; 256];
    let mut c = 0;
    while c < 256 {
        // gf2p8affineqb computes result bit i as parity(matrix.byte[7 - i] & x) (Intel SDM,
        // GF2P8AFFINEQB). Multiplication by c is linear over GF(2): bit i of c·x is the
        // parity of x's bits k for which bit i of c·2^k is set.
        let mut m = 0u64;
        let mut i = 0;
        while i < 8 {
            let mut row = 0u64;
            let mut k = 0;
            while k < 8 {
                if (mul_const_fn(c as u8, 1 << k) >> i) & 1 != 0 {
                    row |= 1 << k;
                }
                k += 1;
            }
            m |= row << (8 * (7 - i));
            i += 1;
        }
        t[c] = m;
        c += 1;
    }
    t
}

/// 8×8 bit matrices for `gf2p8affineqb`: `AFFINE[c]` multiplies each byte by `c` in
/// GF(2^8)/0x11d. (GFNI's own `gf2p8mulb` uses the AES polynomial 0x11b and cannot be
/// used for RAID-6.)
pub static AFFINE: [u64; 256] = build_affine();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_agree_with_shift_and_add() {
        for a in 0..=255u8 {
            for b in 0..=255u8 {
                assert_eq!(mul(a, b), mul_const_fn(a, b));
            }
            if a != 0 {
                assert_eq!(mul(a, inv(a)), 1);
            }
        }
        // g = {02} generates the whole multiplicative group: order exactly 255.
        let mut seen = [false; 256];
        for e in 0..255 {
            let v = pow_g(e);
            assert!(!seen[v as usize]);
            seen[v as usize] = true;
        }
        assert_eq!(pow_g(255), 1);
        assert_eq!(mul(0x80, 2), 0x1d);
    }

    #[test]
    fn nibble_tables_multiply() {
        for c in 0..=255u8 {
            let t = &NIBBLE[c as usize];
            for x in 0..=255u8 {
                assert_eq!(t[(x & 15) as usize] ^ t[16 + (x >> 4) as usize], mul(c, x));
            }
        }
    }

    /// Bit-level model of gf2p8affineqb (Intel SDM pseudo-code), against mul().
    #[test]
    fn affine_matrices_multiply() {
        for c in 0..=255u8 {
            let m = AFFINE[c as usize];
            for x in 0..=255u8 {
                let mut r = 0u8;
                for i in 0..8 {
                    let row = (m >> (8 * (7 - i))) as u8;
                    r |= (((row & x).count_ones() & 1) as u8) << i;
                }
                assert_eq!(r, mul(c, x), "c={c} x={x}");
            }
        }
    }
}
