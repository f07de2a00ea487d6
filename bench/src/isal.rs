//! Intel ISA-L's RAID functions (`isa-l/raid.h`), the reference the parity kernels are
//! measured against. Linked only when the build script found `libisal` (Debian
//! `libisal-dev`); otherwise [`available`] is false and the calls return `None`.
//!
//! ISA-L's Q is the same syndrome as md's and ferroraid's (Horner's rule over the sources in
//! array order, generator {02}, polynomial 0x11d), so outputs can be compared byte for byte.

#[cfg(have_isal)]
mod ffi {
    use std::ffi::{c_int, c_void};
    #[link(name = "isal")]
    extern "C" {
        /// `vects` = sources + 1 destination (last pointer); 32-byte aligned buffers.
        pub fn xor_gen(vects: c_int, len: c_int, array: *mut *mut c_void) -> c_int;
        /// `vects` = sources + P + Q (last two pointers); `len` a multiple of 32.
        pub fn pq_gen(vects: c_int, len: c_int, array: *mut *mut c_void) -> c_int;
    }
}

/// Whether ISA-L was linked into this build.
pub fn available() -> bool {
    cfg!(have_isal)
}

/// Most pointers a call passes (data chunks + P + Q).
const MAX_VECTS: usize = 258;

fn pointers(data: &[&[u8]], outs: &mut [&mut [u8]], arr: &mut [*mut u8; MAX_VECTS]) -> usize {
    let len = outs[0].len();
    assert!(data.len() + outs.len() <= MAX_VECTS);
    let mut n = 0;
    for d in data {
        assert_eq!(d.len(), len);
        arr[n] = d.as_ptr().cast_mut();
        n += 1;
    }
    for o in outs.iter_mut() {
        assert_eq!(o.len(), len);
        arr[n] = o.as_mut_ptr();
        n += 1;
    }
    assert!(
        arr[..n].iter().all(|p| (*p as usize).is_multiple_of(32)),
        "ISA-L needs 32-byte aligned buffers"
    );
    assert!(len.is_multiple_of(32) && len <= i32::MAX as usize);
    n
}

/// `p = ⊕ data` with ISA-L's `xor_gen`. `None` when ISA-L is not linked.
///
/// # Panics
/// On unequal lengths, misalignment, or a failure status from ISA-L.
pub fn xor_gen(data: &[&[u8]], p: &mut [u8]) -> Option<()> {
    let mut arr = [std::ptr::null_mut(); MAX_VECTS];
    let len = p.len() as i32;
    let n = pointers(data, &mut [p], &mut arr);
    #[cfg(have_isal)]
    {
        // SAFETY: arr[..n] holds n valid, 32-byte aligned pointers to buffers of `len` bytes
        // (checked above); the last one is writable and does not alias the sources (it is a
        // distinct &mut).
        let rc = unsafe { ffi::xor_gen(n as i32, len, arr.as_mut_ptr().cast()) };
        assert_eq!(rc, 0, "ISA-L xor_gen failed");
        Some(())
    }
    #[cfg(not(have_isal))]
    {
        let _ = (n, len);
        None
    }
}

/// `p = ⊕ data`, `q = Σ g^i·data[i]` with ISA-L's `pq_gen`. `None` when ISA-L is absent.
///
/// # Panics
/// On unequal lengths, misalignment, or a failure status from ISA-L.
pub fn pq_gen(data: &[&[u8]], p: &mut [u8], q: &mut [u8]) -> Option<()> {
    let mut arr = [std::ptr::null_mut(); MAX_VECTS];
    let len = p.len() as i32;
    let n = pointers(data, &mut [p, q], &mut arr);
    #[cfg(have_isal)]
    {
        // SAFETY: as in xor_gen; the last two pointers are distinct writable buffers.
        let rc = unsafe { ffi::pq_gen(n as i32, len, arr.as_mut_ptr().cast()) };
        assert_eq!(rc, 0, "ISA-L pq_gen failed");
        Some(())
    }
    #[cfg(not(have_isal))]
    {
        let _ = (n, len);
        None
    }
}

#[cfg(all(test, have_isal))]
mod tests {
    use engine::buf::AlignedBuf;
    use engine::parity::Parity;

    /// ISA-L and ferroraid agree on P and Q: the comparison in the benchmark is like for like.
    #[test]
    fn isal_matches_engine() {
        let data: Vec<AlignedBuf> = (0..6)
            .map(|i| {
                let mut b = AlignedBuf::zeroed(4096);
                crate::fill_random(&mut b, i);
                b
            })
            .collect();
        let r: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
        let (mut p1, mut q1, mut p2, mut q2) = (
            AlignedBuf::zeroed(4096),
            AlignedBuf::zeroed(4096),
            AlignedBuf::zeroed(4096),
            AlignedBuf::zeroed(4096),
        );
        Parity::new().gen_pq(&r, &mut p1, &mut q1);
        super::pq_gen(&r, &mut p2, &mut q2).unwrap();
        assert!(p1[..] == p2[..] && q1[..] == q2[..]);
        super::xor_gen(&r, &mut p2).unwrap();
        assert!(p1[..] == p2[..]);
    }
}
