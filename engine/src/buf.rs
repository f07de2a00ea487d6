//! Aligned, zero-initialised byte buffers.
//!
//! The parity kernels require every buffer to start on a 64-byte boundary (one cache line,
//! one AVX-512 register) and to be a multiple of 64 bytes long. Device back ends doing
//! O_DIRECT or DMA want a 4 KiB (page) boundary. [`AlignedBuf`] gives the stronger of the
//! two: every buffer is [`BUF_ALIGN`]-aligned. Buffers are allocated once, at start-up,
//! by the pools that own them; nothing on the data path allocates.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment of every [`AlignedBuf`], in bytes: one 4 KiB page, which satisfies O_DIRECT
/// on 512e/4Kn devices, NVMe PRP entries, and the 64-byte rule of the parity kernels.
pub const BUF_ALIGN: usize = 4096;

/// A heap buffer of `len` bytes, aligned to [`BUF_ALIGN`], zero-filled at allocation.
///
/// Dereferences to `[u8]`. Moving an `AlignedBuf` moves ownership of the memory, never
/// the bytes, so buffers can travel between reactors by value.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf uniquely owns its allocation (like Box<[u8]>); no interior mutability.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only permit reads of the owned bytes (like &[u8]).
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes aligned to [`BUF_ALIGN`].
    ///
    /// `len` may be 0. Aborts through `handle_alloc_error` if the allocator fails (as `Vec`
    /// does); pools call this only at start-up.
    ///
    /// # Panics
    /// If `len` rounded up to [`BUF_ALIGN`] exceeds `isize::MAX`.
    pub fn zeroed(len: usize) -> Self {
        if len == 0 {
            // A dangling but aligned pointer: never dereferenced for a zero-length slice.
            let ptr = NonNull::new(BUF_ALIGN as *mut u8).expect("non-null constant");
            return Self { ptr, len };
        }
        let layout = Self::layout(len);
        // SAFETY: layout has non-zero size (len > 0) and a valid power-of-two alignment.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        Self { ptr, len }
    }

    /// Allocates a buffer holding a copy of `bytes`.
    pub fn from_slice(bytes: &[u8]) -> Self {
        let mut b = Self::zeroed(bytes.len());
        b.copy_from_slice(bytes);
        b
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, BUF_ALIGN).expect("buffer length overflows isize")
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes (zeroed at allocation) for the life
        // of self, or dangling-but-aligned with len 0.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref; &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: ptr was returned by alloc_zeroed with exactly this layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
        }
    }
}

impl Clone for AlignedBuf {
    fn clone(&self) -> Self {
        Self::from_slice(self)
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        for len in [0usize, 1, 64, 4096, 65536 + 64] {
            let b = AlignedBuf::zeroed(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % BUF_ALIGN, 0);
            assert!(b.iter().all(|&x| x == 0));
        }
        let c = AlignedBuf::from_slice(&[1, 2, 3]).clone();
        assert_eq!(&c[..], &[1, 2, 3]);
    }
}
