//! RAID parity: P (XOR) and Q (Reed–Solomon syndrome over GF(2^8)), generation,
//! read-modify-write updates, and recovery of every erasure a stripe can survive.
//!
//! # Definitions
//! For data chunks `D_0 .. D_{k-1}` in **Q syndrome slot order** (see
//! [`crate::geometry::StripeLayout::q_slot`]; for md's asymmetric layouts this is not the
//! logical data order):
//!
//! - `P = D_0 ⊕ D_1 ⊕ … ⊕ D_{k-1}`
//! - `Q = g^0·D_0 ⊕ g^1·D_1 ⊕ … ⊕ g^{k-1}·D_{k-1}` in GF(2^8) with polynomial 0x11d and
//!   generator g = {02}, byte by byte (H. P. Anvin, "The mathematics of RAID-6"; Linux
//!   `lib/raid6`; md's `raid6_idx_to_slot`).
//!
//! # Buffers
//! All functions work on caller-provided buffers and never allocate. Every buffer passed to
//! one call must have the same length, a multiple of 64 bytes, and start on a 64-byte
//! boundary ([`crate::buf::AlignedBuf`] satisfies this); outputs must not overlap inputs.
//! Violations are programmer errors and panic (the checks are O(number of buffers)).
//!
//! # Kernels
//! [`Kernel`] names the implementations: the scalar reference and AVX2, AVX-512BW and
//! AVX-512+GFNI kernels, all bit-identical to the reference. [`Parity::new`] picks the best
//! one the CPU has, at run time.

mod gf;
mod kernels;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::fmt;

use arrayvec::ArrayVec;
use thiserror::Error;

pub use gf::{inv as gf_inv, mul as gf_mul, pow_g as gf_pow_g};

/// Most sources a kernel reads in one call: 255 data chunks plus P.
const MAX_SOURCES: usize = 256;
/// Most data chunks in a stripe (255: the Q coefficient limit, see
/// [`crate::geometry::MAX_DATA_CHUNKS`]); RAID5 stripes share the bound.
pub const MAX_DATA_CHUNKS: usize = crate::geometry::MAX_DATA_CHUNKS as usize;
/// Required alignment and length granularity of every buffer, in bytes.
pub const ALIGN: usize = kernels::UNIT;

const _: () = assert!(MAX_SOURCES > MAX_DATA_CHUNKS);
const _: () = assert!(crate::buf::BUF_ALIGN.is_multiple_of(ALIGN));

/// An implementation of the parity arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Byte-at-a-time reference; runs everywhere.
    Scalar,
    /// AVX2 with `pshufb` nibble tables.
    Avx2,
    /// AVX-512F/BW with `vpshufb` nibble tables and mask-register reduction.
    Avx512bw,
    /// AVX-512F/BW with GFNI `gf2p8affineqb` for every GF(2^8) multiplication.
    Avx512Gfni,
}

impl Kernel {
    /// Every kernel, slowest first.
    pub const ALL: [Kernel; 4] = [
        Kernel::Scalar,
        Kernel::Avx2,
        Kernel::Avx512bw,
        Kernel::Avx512Gfni,
    ];

    /// Whether this CPU can run the kernel (runtime CPUID check).
    pub fn is_available(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512bw => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Gfni => {
                Kernel::Avx512bw.is_available() && std::arch::is_x86_feature_detected!("gfni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The kernels this CPU can run, slowest first.
    pub fn available() -> impl Iterator<Item = Kernel> {
        Self::ALL.into_iter().filter(|k| k.is_available())
    }

    /// The fastest kernel this CPU can run (the last of [`Kernel::available`]).
    pub fn best() -> Kernel {
        Self::available().last().unwrap_or(Kernel::Scalar)
    }

    /// Short name: `scalar`, `avx2`, `avx512bw`, `avx512-gfni`.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512bw => "avx512bw",
            Kernel::Avx512Gfni => "avx512-gfni",
        }
    }
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Kernel {
    type Err = ParityError;
    fn from_str(s: &str) -> Result<Self, ParityError> {
        Self::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| ParityError::UnknownKernel(s.to_string()))
    }
}

/// Errors of the parity layer (what callers can get wrong at run time; buffer-shape
/// violations are asserted instead).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ParityError {
    /// The CPU lacks the instructions of the requested kernel.
    #[error("parity kernel {0} is not supported by this CPU")]
    KernelUnavailable(Kernel),
    /// No kernel of that name.
    #[error("unknown parity kernel {0:?}: expected scalar, avx2, avx512bw or avx512-gfni")]
    UnknownKernel(String),
    /// More chunks lost than the stripe's redundancy.
    #[error("{lost} chunks of the stripe are lost but it has only {redundancy} parity chunk(s): data is unrecoverable")]
    TooManyErasures {
        /// Distinct chunks reported lost.
        lost: usize,
        /// Parity chunks of the stripe (1 or 2).
        redundancy: usize,
    },
    /// An erasure naming a chunk the stripe does not have (Q of a RAID5 stripe, a data slot
    /// past the end).
    #[error("erasure {0:?} names a chunk this stripe does not have")]
    NoSuchChunk(ChunkId),
}

/// A chunk of a stripe, by role; data chunks by Q syndrome slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ChunkId {
    /// Data chunk at this syndrome slot (index into the slot-ordered data array).
    Data(u8),
    /// The P chunk.
    P,
    /// The Q chunk.
    Q,
}

/// One data chunk changed by a read-modify-write.
#[derive(Clone, Copy, Debug)]
pub struct Delta<'a> {
    /// The chunk's Q syndrome slot (0..=254).
    pub slot: u8,
    /// Its contents before the write (the range being updated).
    pub old: &'a [u8],
    /// Its contents after the write (same range).
    pub new: &'a [u8],
}

/// Kernel entry points: `#[target_feature]` functions that instantiate the generic
/// algorithms for one instruction set, so the vector operations inline into code compiled
/// for it.
macro_rules! entries {
    ($(#[$attr:meta])* $modname:ident, $isa:ty) => {
        mod $modname {
            #![allow(clippy::too_many_arguments)]
            use super::kernels::{self, Isa, Recovery};
            use super::Delta;

            $(#[$attr])*
            pub unsafe fn gen<const P: bool, const Q: bool, const S: bool>(
                srcs: &[*const u8], p: *mut u8, q: *mut u8, len: usize,
            ) {
                // SAFETY: caller (Parity) checked buffers and the CPU feature.
                unsafe { kernels::gen::<$isa, P, Q, S>(srcs, p, q, len) }
            }

            $(#[$attr])*
            pub unsafe fn recover<const S: bool>(
                srcs: &[*const u8], p_in: *const u8, q_in: *const u8, a: Option<u8>, b: u8,
                out_x: *mut u8, out_y: *mut u8, len: usize,
            ) {
                // SAFETY: caller (Parity) checked buffers and the CPU feature.
                unsafe {
                    let k = Recovery { a: a.map(|c| <$isa>::prep(c)), b: <$isa>::prep(b) };
                    kernels::recover::<$isa, S>(srcs, p_in, q_in, &k, out_x, out_y, len)
                }
            }

            $(#[$attr])*
            pub unsafe fn update<const Q: bool>(deltas: &[Delta<'_>], p: *mut u8, q: *mut u8, len: usize) {
                // SAFETY: caller (Parity) checked buffers and the CPU feature.
                unsafe { kernels::update::<$isa, Q>(deltas, p, q, len) }
            }

            $(#[$attr])*
            pub unsafe fn fold_q<const S: bool>(srcs: &[(u8, *const u8)], q_in: *const u8, q_out: *mut u8, len: usize) {
                // SAFETY: caller (Parity) checked buffers and the CPU feature.
                unsafe { kernels::fold_q::<$isa, S>(srcs, q_in, q_out, len) }
            }
        }
    };
}

entries!(scalar_entry, super::scalar::Scalar);
#[cfg(target_arch = "x86_64")]
entries!(
    #[target_feature(enable = "avx2")]
    avx2_entry,
    super::x86::Avx2
);
#[cfg(target_arch = "x86_64")]
entries!(
    #[target_feature(enable = "avx512f,avx512bw")]
    avx512_entry,
    super::x86::Avx512
);
#[cfg(target_arch = "x86_64")]
entries!(
    #[target_feature(enable = "avx512f,avx512bw,gfni")]
    gfni_entry,
    super::x86::Gfni
);

/// Calls `$f` of the entry module for `$self.kernel`, with the streaming flag folded into
/// const generics where the entry takes one.
macro_rules! dispatch {
    ($self:expr, $f:ident :: <$($g:tt),*> ($($arg:expr),*)) => {{
        // SAFETY: callers of this macro have validated every buffer; the kernel was checked
        // to be available when the Parity was built.
        unsafe {
            match $self.kernel {
                Kernel::Scalar => scalar_entry::$f::<$($g),*>($($arg),*),
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx2 => avx2_entry::$f::<$($g),*>($($arg),*),
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx512bw => avx512_entry::$f::<$($g),*>($($arg),*),
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx512Gfni => gfni_entry::$f::<$($g),*>($($arg),*),
                #[cfg(not(target_arch = "x86_64"))]
                _ => unreachable!("non-scalar kernels are never available off x86_64"),
            }
        }
    }};
}

/// The parity engine: a chosen [`Kernel`] plus the store policy. Cheap to copy; every
/// method is a pure function of its buffers.
#[derive(Clone, Copy, Debug)]
pub struct Parity {
    kernel: Kernel,
    streaming: bool,
}

impl Default for Parity {
    fn default() -> Self {
        Self::new()
    }
}

/// Validates one call's buffers: equal length `len`, a multiple of [`ALIGN`], each
/// [`ALIGN`]-aligned.
fn check(
    len: usize,
    bufs: impl IntoIterator<Item = *const u8>,
    lens: impl IntoIterator<Item = usize>,
) {
    assert!(
        len.is_multiple_of(ALIGN),
        "parity buffer length {len} is not a multiple of {ALIGN} bytes"
    );
    for l in lens {
        assert_eq!(l, len, "parity buffers of one call must have equal lengths");
    }
    for p in bufs {
        assert!(
            (p as usize).is_multiple_of(ALIGN),
            "parity buffer {p:p} is not {ALIGN}-byte aligned"
        );
    }
}

/// The data pointers (null for erased chunks), in slot order. An `ArrayVec` is filled
/// without initialising its spare capacity (a plain `[_; MAX_SOURCES]` would be a 2 KiB
/// memset on every call of the data path).
fn pointers(data: &[Option<&[u8]>], len: usize) -> ArrayVec<*const u8, MAX_SOURCES> {
    assert!(
        data.len() <= MAX_DATA_CHUNKS,
        "a stripe has at most {MAX_DATA_CHUNKS} data chunks"
    );
    let mut out = ArrayVec::new();
    for d in data {
        out.push(match d {
            Some(b) => {
                check(len, [b.as_ptr()], [b.len()]);
                b.as_ptr()
            }
            None => std::ptr::null(),
        });
    }
    out
}

/// Slot indices of the `None` entries of `data`, which must number exactly `N`.
fn erased<const N: usize>(data: &[Option<&[u8]>]) -> [usize; N] {
    let mut found = [0usize; N];
    let mut n = 0;
    for (i, d) in data.iter().enumerate() {
        if d.is_none() {
            assert!(n < N, "more than {N} data chunks marked erased");
            found[n] = i;
            n += 1;
        }
    }
    assert_eq!(n, N, "expected exactly {N} erased data chunk(s)");
    found
}

/// The data chunks of a stripe with none erased.
fn full<'a>(s: &[Option<&'a [u8]>]) -> ArrayVec<&'a [u8], MAX_DATA_CHUNKS> {
    s.iter().map(|b| b.expect("no data chunk erased")).collect()
}

impl Parity {
    /// The best kernel for this CPU ([`Kernel::best`]), with ordinary (cached) stores:
    /// see [`Parity::streaming`] for when streaming stores pay.
    pub fn new() -> Self {
        Self {
            kernel: Kernel::best(),
            streaming: false,
        }
    }

    /// A specific kernel.
    ///
    /// # Errors
    /// [`ParityError::KernelUnavailable`] if the CPU lacks its instructions.
    pub fn with_kernel(kernel: Kernel) -> Result<Self, ParityError> {
        if !kernel.is_available() {
            return Err(ParityError::KernelUnavailable(kernel));
        }
        Ok(Self {
            kernel,
            streaming: false,
        })
    }

    /// Sets whether generated and recovered chunks are written with non-temporal
    /// (cache-bypassing) stores. Off (the default) suits the array's data path: its
    /// outputs land in the stripe operations' pooled buffers, which are reused most
    /// recently freed first and so stay in cache, and the member path reads them again at
    /// once (a copy into a `mem` member or the page cache, a DMA that snoops the cache).
    /// Streaming stores there cost every output line a trip to DRAM: full-stripe writes
    /// over `mem` members ran 6–19 % slower and over `null` members 10–36 % slower with
    /// them (`array-bench --workload seqwrite`, docs/BENCHMARKS.md "Cached parity stores").
    /// On suits outputs larger than the cache that nothing reads soon (`parity-bench`'s
    /// out-of-cache passes, where skipping the destination's read-for-ownership puts P+Q
    /// ahead of ISA-L). Scalar ignores it.
    pub fn streaming(mut self, on: bool) -> Self {
        self.streaming = on;
        self
    }

    /// The kernel in use.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    fn gen<const P: bool, const Q: bool>(
        &self,
        data: &[&[u8]],
        p: *mut u8,
        q: *mut u8,
        len: usize,
    ) {
        assert!(!data.is_empty(), "parity needs at least one data chunk");
        assert!(
            data.len() <= MAX_DATA_CHUNKS,
            "a stripe has at most {MAX_DATA_CHUNKS} data chunks"
        );
        // Filled in place: `collect` builds the 2 KiB `ArrayVec` and then moves it.
        let mut ptrs: ArrayVec<*const u8, MAX_SOURCES> = ArrayVec::new();
        for d in data {
            ptrs.push(d.as_ptr());
        }
        check(
            len,
            data.iter().map(|d| d.as_ptr()),
            data.iter().map(|d| d.len()),
        );
        let srcs = &ptrs[..];
        if self.streaming {
            dispatch!(self, gen::<P, Q, true>(srcs, p, q, len))
        } else {
            dispatch!(self, gen::<P, Q, false>(srcs, p, q, len))
        }
    }

    /// Copies `src` into `dst` with this engine's store policy: with
    /// [`Parity::streaming`] on and a SIMD kernel (scalar ignores it), a copy that bypasses
    /// the cache for the destination (no read-for-ownership of its lines), ending with a
    /// store fence, as Linux's pmem driver writes persistent memory
    /// (`memcpy_flushcache`). P over one data chunk is that chunk, so this is
    /// [`Parity::gen_p`] of `[src]`, on the same kernels.
    ///
    /// # Panics
    /// If the lengths differ, are not a multiple of [`ALIGN`] (64 bytes), or either buffer
    /// is not [`ALIGN`]-aligned.
    pub fn copy(&self, src: &[u8], dst: &mut [u8]) {
        self.gen_p(&[src], dst)
    }

    /// P = ⊕ data. `data`: 1..=255 chunks; `p`: output, same length.
    pub fn gen_p(&self, data: &[&[u8]], p: &mut [u8]) {
        check(p.len(), [p.as_ptr()], []);
        self.gen::<true, false>(data, p.as_mut_ptr(), std::ptr::null_mut(), p.len())
    }

    /// Q = Σ g^i·data[i] (`data` in slot order), for when only Q must be (re)generated.
    pub fn gen_q(&self, data: &[&[u8]], q: &mut [u8]) {
        check(q.len(), [q.as_ptr()], []);
        self.gen::<false, true>(data, std::ptr::null_mut(), q.as_mut_ptr(), q.len())
    }

    /// P and Q in one pass over `data` (slot order, 1..=255 chunks).
    pub fn gen_pq(&self, data: &[&[u8]], p: &mut [u8], q: &mut [u8]) {
        check(p.len(), [p.as_ptr(), q.as_ptr()], [q.len()]);
        self.gen::<true, true>(data, p.as_mut_ptr(), q.as_mut_ptr(), p.len())
    }

    /// RAID5 read-modify-write: `P ⊕= Σ (old ⊕ new)` over `deltas`, in place, without the
    /// unchanged data chunks.
    pub fn update_p(&self, deltas: &[Delta<'_>], p: &mut [u8]) {
        self.check_deltas(deltas, p.len());
        check(p.len(), [p.as_ptr()], []);
        dispatch!(
            self,
            update::<false>(deltas, p.as_mut_ptr(), std::ptr::null_mut(), p.len())
        )
    }

    /// RAID6 read-modify-write: `P ⊕= Σ (old ⊕ new)`, `Q ⊕= Σ g^slot·(old ⊕ new)`, in place.
    pub fn update_pq(&self, deltas: &[Delta<'_>], p: &mut [u8], q: &mut [u8]) {
        self.check_deltas(deltas, p.len());
        check(p.len(), [p.as_ptr(), q.as_ptr()], [q.len()]);
        dispatch!(
            self,
            update::<true>(deltas, p.as_mut_ptr(), q.as_mut_ptr(), p.len())
        )
    }

    /// Partial Q: `q_out = q_in ⊕ Σ g^slot·D` over `data` (`(slot, D)` pairs), in one
    /// pass, with the store policy of [`Parity::streaming`] (PPL turns it off: the result
    /// is checksummed next). With `q_in`
    /// a stripe's Q and `data` some of its data chunks, `q_out` is the Q syndrome of the
    /// other chunks — ferroraid's RAID6 PPL partial Q (docs/FORMAT.md). All buffers the
    /// same length, [`ALIGN`]-aligned; `data` may be empty (a copy).
    ///
    /// # Panics
    /// On a slot beyond 254, more than [`MAX_DATA_CHUNKS`] entries, or a length or
    /// alignment the kernels cannot take.
    pub fn fold_q(&self, data: &[(u8, &[u8])], q_in: &[u8], q_out: &mut [u8]) {
        let len = q_out.len();
        assert!(
            data.len() <= MAX_DATA_CHUNKS,
            "a stripe has at most {MAX_DATA_CHUNKS} data chunks"
        );
        check(len, [q_in.as_ptr(), q_out.as_ptr()], [q_in.len()]);
        let mut srcs: ArrayVec<(u8, *const u8), MAX_DATA_CHUNKS> = ArrayVec::new();
        for &(slot, d) in data {
            assert!(
                usize::from(slot) < MAX_DATA_CHUNKS,
                "slot {slot} beyond 254"
            );
            check(len, [d.as_ptr()], [d.len()]);
            srcs.push((slot, d.as_ptr()));
        }
        let (q_in, q_out) = (q_in.as_ptr(), q_out.as_mut_ptr());
        if self.streaming {
            dispatch!(self, fold_q::<true>(&srcs, q_in, q_out, len))
        } else {
            dispatch!(self, fold_q::<false>(&srcs, q_in, q_out, len))
        }
    }

    fn check_deltas(&self, deltas: &[Delta<'_>], len: usize) {
        assert!(
            !deltas.is_empty(),
            "an update needs at least one changed chunk"
        );
        assert!(
            deltas.len() <= MAX_DATA_CHUNKS,
            "a stripe has at most {MAX_DATA_CHUNKS} data chunks"
        );
        for d in deltas {
            assert!(
                usize::from(d.slot) < MAX_DATA_CHUNKS,
                "slot {} beyond 254",
                d.slot
            );
            check(
                len,
                [d.old.as_ptr(), d.new.as_ptr()],
                [d.old.len(), d.new.len()],
            );
        }
    }

    /// Recovers the one erased data chunk (`None` in `data`, slot order) from P:
    /// `out = P ⊕ (⊕ surviving data)`.
    ///
    /// # Panics
    /// Unless exactly one entry of `data` is `None`.
    pub fn recover_data_from_p(&self, data: &[Option<&[u8]>], p: &[u8], out: &mut [u8]) {
        erased::<1>(data);
        let len = out.len();
        check(len, [p.as_ptr(), out.as_ptr()], [p.len()]);
        let mut ptrs: ArrayVec<*const u8, MAX_SOURCES> = ArrayVec::new();
        for b in data.iter().flatten() {
            check(len, [b.as_ptr()], [b.len()]);
            ptrs.push(b.as_ptr());
        }
        ptrs.push(p.as_ptr());
        let srcs = &ptrs[..];
        if self.streaming {
            dispatch!(
                self,
                gen::<true, false, true>(srcs, out.as_mut_ptr(), std::ptr::null_mut(), len)
            )
        } else {
            dispatch!(
                self,
                gen::<true, false, false>(srcs, out.as_mut_ptr(), std::ptr::null_mut(), len)
            )
        }
    }

    /// Recovers the one erased data chunk x (`None` in `data`, slot order) from Q alone:
    /// `D_x = g^-x · (Q ⊕ Σ_{i≠x} g^i·D_i)`. If `p_out` is given, P is regenerated in the
    /// same pass (the case "data + P lost").
    ///
    /// # Panics
    /// Unless exactly one entry of `data` is `None`.
    pub fn recover_data_from_q(
        &self,
        data: &[Option<&[u8]>],
        q: &[u8],
        out: &mut [u8],
        p_out: Option<&mut [u8]>,
    ) {
        let [x] = erased::<1>(data);
        let len = out.len();
        check(len, [q.as_ptr(), out.as_ptr()], [q.len()]);
        let out_y = match p_out {
            Some(p) => {
                check(len, [p.as_ptr()], [p.len()]);
                p.as_mut_ptr()
            }
            None => std::ptr::null_mut(),
        };
        let ptrs = pointers(data, len);
        let n = ptrs.len();
        let b = gf::inv(gf::pow_g(x as u32));
        self.recover(
            &ptrs[..n],
            std::ptr::null(),
            q.as_ptr(),
            None,
            b,
            out.as_mut_ptr(),
            out_y,
            len,
        )
    }

    /// Recovers the two erased data chunks x < y (the two `None`s in `data`, slot order)
    /// from P and Q: with `Pxy = P ⊕ Σ D_i`, `Qxy = Q ⊕ Σ g^i·D_i` over the survivors,
    /// `D_x = A·Pxy ⊕ B·Qxy` where `A = g^(y-x)/(g^(y-x) ⊕ 1)`, `B = g^-x/(g^(y-x) ⊕ 1)`,
    /// and `D_y = Pxy ⊕ D_x` (Anvin §4).
    ///
    /// # Panics
    /// Unless exactly two entries of `data` are `None`.
    pub fn recover_two_data(
        &self,
        data: &[Option<&[u8]>],
        p: &[u8],
        q: &[u8],
        out_x: &mut [u8],
        out_y: &mut [u8],
    ) {
        let [x, y] = erased::<2>(data);
        let len = out_x.len();
        check(
            len,
            [p.as_ptr(), q.as_ptr(), out_x.as_ptr(), out_y.as_ptr()],
            [p.len(), q.len(), out_y.len()],
        );
        let ptrs = pointers(data, len);
        let n = ptrs.len();
        let gyx = gf::pow_g((y - x) as u32);
        let denom = gf::inv(gyx ^ 1);
        let a = gf::mul(gyx, denom);
        let b = gf::mul(gf::inv(gf::pow_g(x as u32)), denom);
        self.recover(
            &ptrs[..n],
            p.as_ptr(),
            q.as_ptr(),
            Some(a),
            b,
            out_x.as_mut_ptr(),
            out_y.as_mut_ptr(),
            len,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn recover(
        &self,
        srcs: &[*const u8],
        p_in: *const u8,
        q_in: *const u8,
        a: Option<u8>,
        b: u8,
        out_x: *mut u8,
        out_y: *mut u8,
        len: usize,
    ) {
        if self.streaming {
            dispatch!(
                self,
                recover::<true>(srcs, p_in, q_in, a, b, out_x, out_y, len)
            )
        } else {
            dispatch!(
                self,
                recover::<false>(srcs, p_in, q_in, a, b, out_x, out_y, len)
            )
        }
    }

    /// Rebuilds whatever `lost` names, in place, from what survives: the general entry
    /// point for degraded reads, rebuild and resync.
    ///
    /// `data` holds the stripe's data chunks in slot order; `q` is `None` for RAID5. Chunks
    /// named in `lost` are overwritten; the others are read. Picks the cheapest route: one
    /// lost data chunk comes from P (XOR only) when P survives.
    ///
    /// # Errors
    /// [`ParityError::TooManyErasures`] beyond the stripe's redundancy (nothing is
    /// written); [`ParityError::NoSuchChunk`] for Q of a RAID5 stripe or a slot past the
    /// end of `data`.
    ///
    /// # Panics
    /// On buffer-shape violations (see the module docs), an empty `data`, or more than 255
    /// data chunks: a valid [`crate::geometry::Geometry`] never produces these.
    pub fn reconstruct(
        &self,
        data: &mut [&mut [u8]],
        p: &mut [u8],
        q: Option<&mut [u8]>,
        lost: &[ChunkId],
    ) -> Result<(), ParityError> {
        assert!(
            !data.is_empty() && data.len() <= MAX_DATA_CHUNKS,
            "a stripe has 1..={MAX_DATA_CHUNKS} data chunks, got {}",
            data.len()
        );
        // Distinct erasures, validated, in canonical order (data slots ascending, P, Q).
        let redundancy = if q.is_some() { 2 } else { 1 };
        let mut distinct = 0;
        for (i, &c) in lost.iter().enumerate() {
            match c {
                ChunkId::Data(s) if usize::from(s) >= data.len() => {
                    return Err(ParityError::NoSuchChunk(c))
                }
                ChunkId::Q if q.is_none() => return Err(ParityError::NoSuchChunk(c)),
                _ => {}
            }
            if !lost[..i].contains(&c) {
                distinct += 1;
            }
        }
        if distinct > redundancy {
            return Err(ParityError::TooManyErasures {
                lost: distinct,
                redundancy,
            });
        }
        let mut set = [ChunkId::P; 2];
        let mut n = 0;
        for &c in lost {
            if !set[..n].contains(&c) {
                set[n] = c;
                n += 1;
            }
        }
        let set = &mut set[..n];
        set.sort_unstable();
        let lost_data = set.iter().filter(|c| matches!(c, ChunkId::Data(_))).count();

        let nd = data.len();
        // Split the data chunks into read-only survivors and the (at most two) outputs.
        let mut survivors: ArrayVec<Option<&[u8]>, MAX_DATA_CHUNKS> = ArrayVec::new();
        let mut outs: [Option<&mut [u8]>; 2] = [None, None];
        let mut o = 0;
        for (i, d) in data.iter_mut().enumerate() {
            if set.contains(&ChunkId::Data(i as u8)) {
                outs[o] = Some(&mut **d);
                o += 1;
                survivors.push(None);
            } else {
                survivors.push(Some(&**d));
            }
        }
        let surv = &survivors[..nd];
        let [o0, o1] = outs;
        match (lost_data, &*set) {
            (0, []) => {}
            (0, [ChunkId::P]) => {
                self.gen_p(&full(surv), p);
            }
            (0, [ChunkId::Q]) => {
                self.gen_q(&full(surv), q.expect("checked"));
            }
            (0, [ChunkId::P, ChunkId::Q]) => {
                self.gen_pq(&full(surv), p, q.expect("checked"));
            }
            (1, [ChunkId::Data(_)]) => {
                self.recover_data_from_p(surv, p, o0.expect("one output"));
            }
            (1, [ChunkId::Data(_), ChunkId::P]) => {
                let q = q.expect("checked");
                self.recover_data_from_q(surv, q, o0.expect("one output"), Some(p));
            }
            (1, [ChunkId::Data(x), ChunkId::Q]) => {
                let out = o0.expect("one output");
                self.recover_data_from_p(surv, p, out);
                // Regenerate Q now that the data is whole again.
                let all: ArrayVec<&[u8], MAX_DATA_CHUNKS> = (0..nd)
                    .map(|i| {
                        if i == usize::from(*x) {
                            &*out
                        } else {
                            surv[i].expect("survivor")
                        }
                    })
                    .collect();
                self.gen_q(&all, q.expect("checked"));
            }
            (2, [ChunkId::Data(_), ChunkId::Data(_)]) => {
                self.recover_two_data(
                    surv,
                    p,
                    q.as_deref().expect("checked"),
                    o0.expect("two outputs"),
                    o1.expect("two outputs"),
                );
            }
            _ => unreachable!("erasure sets are bounded by the redundancy above"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
