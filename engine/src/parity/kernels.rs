//! The parity algorithms, written once over an instruction-set abstraction ([`Isa`]) and
//! monomorphised per kernel. Each public kernel entry point (in `scalar.rs` / `x86.rs`) is
//! a `#[target_feature]` function that calls these `#[inline(always)]` bodies, so the
//! vector operations inline into code compiled for that instruction set.
//!
//! Every function works in 64-byte *units* (one cache line; one `__m512i`, two `__m256i`,
//! or 64 scalar bytes) and unrolls [`UNROLL`] units per step to keep enough independent
//! work in flight, with a one-unit loop for the tail. Callers (the safe wrappers in
//! `mod.rs`) guarantee: every pointer valid for `len` bytes, 64-byte aligned, `len` a
//! multiple of 64, outputs not overlapping inputs (except the in-place P/Q of `update`).

use super::{gf, Delta};

/// Bytes per unit.
pub const UNIT: usize = 64;
/// Units per unrolled step: 4 × 64 B = 256 B, enough independent accumulators to hide the
/// latency of the `mul2` chain in Horner's rule, few enough to stay in 16 (AVX2) / 32
/// (AVX-512) vector registers with P, Q and a loaded unit live.
pub const UNROLL: usize = 4;

/// The operations the parity algorithms need, on one 64-byte unit.
///
/// # Safety
/// Implementations use instructions of a specific ISA; callers must only invoke them from
/// code running on a CPU that has it (guaranteed by the `Kernel` dispatch).
pub unsafe trait Isa {
    /// One 64-byte unit.
    type V: Copy;
    /// A prepared multiplier (multiplication by one constant).
    type M: Copy;
    /// Loads 64 bytes from a 64-byte aligned `p`.
    unsafe fn load(p: *const u8) -> Self::V;
    /// Stores 64 bytes at a 64-byte aligned `p`; `STREAM` selects a non-temporal store.
    unsafe fn store<const STREAM: bool>(p: *mut u8, v: Self::V);
    /// Orders earlier non-temporal stores before later stores (`sfence`).
    unsafe fn fence();
    /// All-zero unit.
    unsafe fn zero() -> Self::V;
    /// Byte-wise XOR.
    unsafe fn xor(a: Self::V, b: Self::V) -> Self::V;
    /// Multiplies every byte by {02}.
    unsafe fn mul2(a: Self::V) -> Self::V;
    /// Prepares multiplication by `c`.
    unsafe fn prep(c: u8) -> Self::M;
    /// Multiplies every byte by the prepared constant.
    unsafe fn mul(m: Self::M, a: Self::V) -> Self::V;
}

/// P/Q accumulators over `srcs` at byte offset `off`, for `N` units.
///
/// `srcs[i]` is syndrome slot `i`; a null pointer stands for an all-zero chunk (an erased
/// chunk during recovery). Returns `(Σ D, Σ g^i·D)`, each computed only if asked.
#[inline(always)]
unsafe fn accumulate<I: Isa, const N: usize, const P: bool, const Q: bool>(
    srcs: &[*const u8],
    off: usize,
) -> ([I::V; N], [I::V; N]) {
    // SAFETY (whole body): the caller guarantees each non-null src is valid for off + N*64
    // bytes and aligned; the ISA is present.
    unsafe {
        let mut p = [I::zero(); N];
        let mut q = [I::zero(); N];
        let top = srcs.len() - 1;
        let s = srcs[top];
        if !s.is_null() {
            for u in 0..N {
                let d = I::load(s.add(off + u * UNIT));
                p[u] = d;
                q[u] = d;
            }
        }
        // Horner's rule from the highest slot down: Q = ((D_top·g ⊕ D_top-1)·g ⊕ ...) ⊕ D_0.
        for z in (0..top).rev() {
            let s = srcs[z];
            if Q {
                for qu in q.iter_mut() {
                    *qu = I::mul2(*qu);
                }
            }
            if !s.is_null() {
                for u in 0..N {
                    let d = I::load(s.add(off + u * UNIT));
                    if P {
                        p[u] = I::xor(p[u], d);
                    }
                    if Q {
                        q[u] = I::xor(q[u], d);
                    }
                }
            }
        }
        (p, q)
    }
}

/// Generates P (`Σ D`) into `p_out` and/or Q (`Σ g^i·D`) into `q_out` over `srcs`
/// (slot order, no nulls), `len` bytes each.
///
/// # Safety
/// See the module docs; `srcs` non-empty; outputs requested by `P`/`Q` non-null.
#[inline(always)]
pub unsafe fn gen<I: Isa, const P: bool, const Q: bool, const STREAM: bool>(
    srcs: &[*const u8],
    p_out: *mut u8,
    q_out: *mut u8,
    len: usize,
) {
    // SAFETY: forwarded caller contract; offsets stay below len.
    unsafe {
        let mut off = 0;
        while off + UNROLL * UNIT <= len {
            gen_step::<I, UNROLL, P, Q, STREAM>(srcs, p_out, q_out, off);
            off += UNROLL * UNIT;
        }
        while off < len {
            gen_step::<I, 1, P, Q, STREAM>(srcs, p_out, q_out, off);
            off += UNIT;
        }
        if STREAM {
            I::fence();
        }
    }
}

#[inline(always)]
unsafe fn gen_step<I: Isa, const N: usize, const P: bool, const Q: bool, const STREAM: bool>(
    srcs: &[*const u8],
    p_out: *mut u8,
    q_out: *mut u8,
    off: usize,
) {
    // SAFETY: forwarded caller contract.
    unsafe {
        let (p, q) = accumulate::<I, N, P, Q>(srcs, off);
        for u in 0..N {
            if P {
                I::store::<STREAM>(p_out.add(off + u * UNIT), p[u]);
            }
            if Q {
                I::store::<STREAM>(q_out.add(off + u * UNIT), q[u]);
            }
        }
    }
}

/// The multipliers of a recovery: `out_x = a·Pxy ⊕ b·Qxy`, `out_y = Pxy ⊕ out_x`, where
/// `Pxy = p_in ⊕ Σ D` and `Qxy = q_in ⊕ Σ g^i·D` over the surviving data (erased = null).
pub struct Recovery<M> {
    /// Multiplier of Pxy; `None` means 0 (the term is skipped).
    pub a: Option<M>,
    /// Multiplier of Qxy.
    pub b: M,
}

/// Recovers one or two erased chunks in a single pass; see [`Recovery`].
///
/// - two data chunks x < y: `p_in = P`, `q_in = Q`, `a = g^(y-x)/(g^(y-x)⊕1)`,
///   `b = g^-x/(g^(y-x)⊕1)`, `out_y` = D_y;
/// - one data chunk x from Q (P lost or not trusted): `p_in = null`, `a = None`,
///   `b = g^-x`; `out_y` (optional) receives the regenerated P.
///
/// # Safety
/// See the module docs; `q_in` and `out_x` non-null; `p_in`, `out_y` may be null.
#[inline(always)]
pub unsafe fn recover<I: Isa, const STREAM: bool>(
    srcs: &[*const u8],
    p_in: *const u8,
    q_in: *const u8,
    k: &Recovery<I::M>,
    out_x: *mut u8,
    out_y: *mut u8,
    len: usize,
) {
    // SAFETY: forwarded caller contract; offsets stay below len.
    unsafe {
        let mut off = 0;
        while off + UNROLL * UNIT <= len {
            recover_step::<I, UNROLL, STREAM>(srcs, p_in, q_in, k, out_x, out_y, off);
            off += UNROLL * UNIT;
        }
        while off < len {
            recover_step::<I, 1, STREAM>(srcs, p_in, q_in, k, out_x, out_y, off);
            off += UNIT;
        }
        if STREAM {
            I::fence();
        }
    }
}

#[inline(always)]
unsafe fn recover_step<I: Isa, const N: usize, const STREAM: bool>(
    srcs: &[*const u8],
    p_in: *const u8,
    q_in: *const u8,
    k: &Recovery<I::M>,
    out_x: *mut u8,
    out_y: *mut u8,
    off: usize,
) {
    // SAFETY: forwarded caller contract.
    unsafe {
        let (mut p, mut q) = accumulate::<I, N, true, true>(srcs, off);
        for u in 0..N {
            let at = off + u * UNIT;
            if !p_in.is_null() {
                p[u] = I::xor(p[u], I::load(p_in.add(at)));
            }
            q[u] = I::xor(q[u], I::load(q_in.add(at)));
            let mut dx = I::mul(k.b, q[u]);
            if let Some(a) = k.a {
                dx = I::xor(dx, I::mul(a, p[u]));
            }
            I::store::<STREAM>(out_x.add(at), dx);
            if !out_y.is_null() {
                I::store::<STREAM>(out_y.add(at), I::xor(p[u], dx));
            }
        }
    }
}

/// Read-modify-write: `P ⊕= Σ (old ⊕ new)` and, if `Q`, `Q ⊕= Σ g^slot·(old ⊕ new)`, in
/// place.
///
/// # Safety
/// See the module docs; `deltas` non-empty; `q` non-null when `Q`.
#[inline(always)]
pub unsafe fn update<I: Isa, const Q: bool>(
    deltas: &[Delta<'_>],
    p: *mut u8,
    q: *mut u8,
    len: usize,
) {
    // SAFETY: forwarded caller contract; offsets stay below len.
    unsafe {
        let mut off = 0;
        while off + UNROLL * UNIT <= len {
            update_step::<I, UNROLL, Q>(deltas, p, q, off);
            off += UNROLL * UNIT;
        }
        while off < len {
            update_step::<I, 1, Q>(deltas, p, q, off);
            off += UNIT;
        }
    }
}

/// `q_out = q_in ⊕ Σ g^slot·D` over `srcs` (`(slot, D)` pairs), `len` bytes, in one
/// pass (`STREAM`: non-temporal stores, fenced): the Q syndrome of a stripe's other
/// chunks when `q_in` is the stripe's Q and `srcs` its modified chunks (ferroraid's
/// partial Q, docs/FORMAT.md).
///
/// # Safety
/// See the module docs; `q_in` and `q_out` are the same buffer or do not overlap.
#[inline(always)]
pub unsafe fn fold_q<I: Isa, const STREAM: bool>(
    srcs: &[(u8, *const u8)],
    q_in: *const u8,
    q_out: *mut u8,
    len: usize,
) {
    // SAFETY: forwarded caller contract; offsets stay below len.
    unsafe {
        let mut off = 0;
        while off + UNROLL * UNIT <= len {
            fold_q_step::<I, UNROLL, STREAM>(srcs, q_in, q_out, off);
            off += UNROLL * UNIT;
        }
        while off < len {
            fold_q_step::<I, 1, STREAM>(srcs, q_in, q_out, off);
            off += UNIT;
        }
        if STREAM {
            I::fence();
        }
    }
}

#[inline(always)]
unsafe fn fold_q_step<I: Isa, const N: usize, const STREAM: bool>(
    srcs: &[(u8, *const u8)],
    q_in: *const u8,
    q_out: *mut u8,
    off: usize,
) {
    // SAFETY: forwarded caller contract; every unit is loaded before it is stored, so an
    // in-place call (`q_in == q_out`) reads the old contents.
    unsafe {
        let mut q = [I::zero(); N];
        for (u, qu) in q.iter_mut().enumerate() {
            *qu = I::load(q_in.add(off + u * UNIT));
        }
        for &(slot, d) in srcs {
            let coef = I::prep(gf::pow_g(u32::from(slot)));
            for (u, qu) in q.iter_mut().enumerate() {
                *qu = I::xor(*qu, I::mul(coef, I::load(d.add(off + u * UNIT))));
            }
        }
        for (u, qu) in q.iter().enumerate() {
            I::store::<STREAM>(q_out.add(off + u * UNIT), *qu);
        }
    }
}

#[inline(always)]
unsafe fn update_step<I: Isa, const N: usize, const Q: bool>(
    deltas: &[Delta<'_>],
    p: *mut u8,
    q: *mut u8,
    off: usize,
) {
    // SAFETY: forwarded caller contract.
    unsafe {
        let mut dp = [I::zero(); N];
        let mut dq = [I::zero(); N];
        for d in deltas {
            let (old, new) = (d.old.as_ptr(), d.new.as_ptr());
            let coef = I::prep(gf::pow_g(u32::from(d.slot)));
            for u in 0..N {
                let at = off + u * UNIT;
                let x = I::xor(I::load(old.add(at)), I::load(new.add(at)));
                dp[u] = I::xor(dp[u], x);
                if Q {
                    dq[u] = I::xor(dq[u], I::mul(coef, x));
                }
            }
        }
        for u in 0..N {
            let at = off + u * UNIT;
            I::store::<false>(p.add(at), I::xor(I::load(p.add(at)), dp[u]));
            if Q {
                I::store::<false>(q.add(at), I::xor(I::load(q.add(at)), dq[u]));
            }
        }
    }
}
