//! Per-reactor data buffers for NBD requests, allocated once at start.
//!
//! A request that carries data (`NBD_CMD_READ`, `NBD_CMD_WRITE`) takes one buffer for its
//! whole life: a write's payload is received into it, the array reads from it; a read's
//! data lands in it and is sent from it. Buffers come in a few size classes (e.g. many
//! 128 KiB ones for ordinary I/O and a few of the maximum block size), so the maximum
//! block size does not multiply the memory of every slot. A request takes the smallest
//! free buffer that fits; when none fits, the connection stops reading until one frees.
//!
//! Every buffer is an [`AlignedBuf`] (4096-byte aligned: O_DIRECT members and the parity
//! kernels both accept it). Free lists are preallocated to their full length, so taking
//! and returning buffers never allocates.

use engine::buf::AlignedBuf;

/// One size class of the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferClass {
    /// Size of each buffer, bytes (a multiple of the export's minimum block size).
    pub bytes: u32,
    /// Buffers of this size per reactor.
    pub count: u16,
}

/// Index of a buffer in its pool.
pub(crate) type BufId = u16;

pub(crate) struct BufPool {
    bufs: Vec<AlignedBuf>,
    /// Class of each buffer (index into `classes`).
    class_of: Vec<u8>,
    /// Classes by ascending size: buffer size and free list.
    classes: Vec<(u32, Vec<BufId>)>,
}

impl BufPool {
    /// Allocates every buffer of `classes` (sizes need not be sorted or distinct; at most
    /// 255 classes and 65535 buffers in all — checked by the server configuration).
    pub(crate) fn new(classes: &[BufferClass]) -> Self {
        let mut sorted: Vec<BufferClass> = classes.to_vec();
        sorted.sort_by_key(|c| c.bytes);
        let mut bufs = Vec::new();
        let mut class_of = Vec::new();
        let mut out = Vec::with_capacity(sorted.len());
        for (k, c) in sorted.iter().enumerate() {
            let mut free = Vec::with_capacity(usize::from(c.count));
            for _ in 0..c.count {
                free.push(bufs.len() as BufId);
                bufs.push(AlignedBuf::zeroed(c.bytes as usize));
                class_of.push(k as u8);
            }
            // Hand out low indices first (nicer in traces).
            free.reverse();
            out.push((c.bytes, free));
        }
        Self {
            bufs,
            class_of,
            classes: out,
        }
    }

    /// Takes the smallest free buffer of at least `len` bytes.
    pub(crate) fn take(&mut self, len: u32) -> Option<BufId> {
        self.classes
            .iter_mut()
            .filter(|(bytes, _)| *bytes >= len)
            .find_map(|(_, free)| free.pop())
    }

    /// Size of the largest buffer class, bytes (0 for an empty pool).
    pub(crate) fn largest(&self) -> u32 {
        self.classes.last().map_or(0, |(bytes, _)| *bytes)
    }

    /// Returns a buffer taken with [`BufPool::take`].
    pub(crate) fn give(&mut self, id: BufId) {
        let k = usize::from(self.class_of[usize::from(id)]);
        debug_assert!(
            !self.classes[k].1.contains(&id),
            "buffer {id} returned twice"
        );
        // Capacity is the class size: never reallocates.
        self.classes[k].1.push(id);
    }

    /// The buffer's bytes.
    pub(crate) fn buf(&self, id: BufId) -> &[u8] {
        &self.bufs[usize::from(id)]
    }

    /// The buffer's bytes, writable.
    pub(crate) fn buf_mut(&mut self, id: BufId) -> &mut [u8] {
        &mut self.bufs[usize::from(id)]
    }

    /// Total buffers.
    pub(crate) fn len(&self) -> usize {
        self.bufs.len()
    }

    /// Buffers currently free.
    pub(crate) fn free_count(&self) -> usize {
        self.classes.iter().map(|(_, f)| f.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smallest_fit_then_larger_classes() {
        let mut p = BufPool::new(&[
            BufferClass {
                bytes: 1 << 20,
                count: 1,
            },
            BufferClass {
                bytes: 4096,
                count: 2,
            },
        ]);
        assert_eq!(p.len(), 3);
        assert_eq!(p.largest(), 1 << 20);
        let a = p.take(512).unwrap();
        let b = p.take(4096).unwrap();
        assert_eq!(p.buf(a).len(), 4096);
        assert_eq!(p.buf(b).len(), 4096);
        // Small class exhausted: the large one serves.
        let c = p.take(512).unwrap();
        assert_eq!(p.buf(c).len(), 1 << 20);
        assert!(p.take(1).is_none());
        assert!(p.take(2 << 20).is_none());
        for id in [a, b, c] {
            assert_eq!(p.buf(id).as_ptr() as usize % 4096, 0);
            p.give(id);
        }
        assert_eq!(p.free_count(), 3);
    }
}
