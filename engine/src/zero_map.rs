//! The zero map: which stripes the array knows to read as zeroes, for block status
//! (NBD `NBD_CMD_BLOCK_STATUS` with the `base:allocation` context, proto.md "Metadata
//! querying" and "Block status"; what `nbdcopy` and `qemu-img convert` use to skip holes).
//!
//! One bit per stripe, shared lock-free by every shard of the array (each stripe's owner
//! writes its bits; any reactor's front end reads them):
//! - **set** when the array learns a stripe is all zeroes: at start, from the members
//!   themselves where every member can tell ([`crate::device::BlockDevice::allocated`]:
//!   a stripe whose chunk on every present member is unallocated — a hole in a sparse
//!   member file, a never-touched region of a memory member — reads as zeroes, parity
//!   included), and at run time when a whole-stripe write-zeroes or discard has completed
//!   on the members;
//! - **cleared** when a write, write-zeroes or discard of the stripe starts (the stripe
//!   held, before any member I/O), so a write that has completed is never reported as a
//!   hole. A request concurrent with the write may see either state (proto.md lets block
//!   status race with writes).
//!
//! A clear bit means "data" (allocated, contents unknown): an array whose members cannot
//! tell reports everything as data until stripes are zeroed through it, which is always a
//! correct answer. The map lives in memory and is rebuilt from the members at each start.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::geometry::ArrayGeometry;

/// One bit per stripe: set = the stripe reads as zeroes. See the module docs.
#[derive(Debug)]
pub struct ZeroMap {
    words: Box<[AtomicU64]>,
    stripes: u64,
    /// Data bytes per stripe (array bytes, all data chunks).
    stripe_bytes: u64,
}

impl ZeroMap {
    /// A map of `geo`'s stripes, every stripe "data" (nothing known to be zero).
    pub fn new(geo: &ArrayGeometry) -> Self {
        let stripes = geo.stripes();
        let words = stripes.div_ceil(64) as usize;
        Self {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
            stripes,
            stripe_bytes: geo.geometry().stripe_data_bytes(),
        }
    }

    /// The map of an array whose members report their allocation: stripe `s` is marked
    /// zero when, on every member, none of the member's bytes
    /// `[data_offset_bytes + s × chunk, +chunk)` is allocated. `allocated[m]` is member
    /// `m`'s allocated byte ranges (member offsets, any order, may overlap); `None` for a
    /// member that cannot tell, which leaves every stripe "data"; a member missing from
    /// the array (failed) is simply not in the list (its chunks are parity-reconstructed
    /// from the others: zeroes when they all are).
    pub fn from_allocation(
        geo: &ArrayGeometry,
        data_offset_bytes: u64,
        allocated: &[Option<Vec<Range<u64>>>],
    ) -> Self {
        let map = Self::new(geo);
        if allocated.is_empty() || allocated.iter().any(Option::is_none) {
            return map;
        }
        let chunk = u64::from(geo.geometry().chunk_bytes());
        let end = data_offset_bytes + geo.member_data_bytes();
        // Start from "all zero" (whole words, the last one up to the stripe count), then
        // mark every stripe an allocated range touches.
        for (i, w) in map.words.iter().enumerate() {
            let left = map.stripes - 64 * i as u64;
            w.store(
                if left >= 64 {
                    u64::MAX
                } else {
                    (1 << left) - 1
                },
                Ordering::Relaxed,
            );
        }
        for ranges in allocated.iter().flatten() {
            for r in ranges {
                let lo = r.start.max(data_offset_bytes);
                let hi = r.end.min(end);
                if lo >= hi {
                    continue;
                }
                let first = (lo - data_offset_bytes) / chunk;
                let last = (hi - 1 - data_offset_bytes) / chunk;
                for s in first..=last {
                    map.clear(s);
                }
            }
        }
        map
    }

    /// Stripes in the map.
    pub fn stripes(&self) -> u64 {
        self.stripes
    }

    /// Whether stripe `stripe` is known to read as zeroes (false past the end).
    #[inline]
    pub fn is_zero(&self, stripe: u64) -> bool {
        if stripe >= self.stripes {
            return false;
        }
        let w = self.words[(stripe / 64) as usize].load(Ordering::Acquire);
        w & (1 << (stripe % 64)) != 0
    }

    /// Marks stripe `stripe` as reading zeroes (its whole-stripe zeroing has completed).
    /// Only the stripe's owner, holding the stripe, calls this.
    pub fn set_zero(&self, stripe: u64) {
        if stripe < self.stripes {
            self.words[(stripe / 64) as usize].fetch_or(1 << (stripe % 64), Ordering::Release);
        }
    }

    /// Marks stripe `stripe` as data: called as a write, write-zeroes or discard of it
    /// starts. One load and no store when the bit is already clear (the common case on the
    /// write path: no read-modify-write of a line other shards read).
    #[inline]
    pub fn clear(&self, stripe: u64) {
        if stripe >= self.stripes {
            return;
        }
        let word = &self.words[(stripe / 64) as usize];
        let bit = 1 << (stripe % 64);
        if word.load(Ordering::Relaxed) & bit != 0 {
            word.fetch_and(!bit, Ordering::Release);
        }
    }

    /// Stripes currently marked zero.
    pub fn zero_stripes(&self) -> u64 {
        self.words
            .iter()
            .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
            .sum()
    }

    /// Block status of array bytes `[offset_bytes, offset_bytes + len_bytes)` (clipped
    /// to the array): calls `extent(len_bytes, zero)` for consecutive runs, in order,
    /// adjacent runs of the same state merged, the first and last clipped to the range,
    /// until the range ends or `extent` returns `false` (the caller's reply is full).
    /// `zero = true`: the run reads as zeroes. No allocation; the walk skips 64 stripes
    /// at a time over words that are all zero or all data.
    pub fn extents(
        &self,
        offset_bytes: u64,
        len_bytes: u64,
        mut extent: impl FnMut(u64, bool) -> bool,
    ) {
        let cap = self.stripes * self.stripe_bytes;
        let end = offset_bytes.saturating_add(len_bytes).min(cap);
        if offset_bytes >= end {
            return;
        }
        let mut pos = offset_bytes;
        while pos < end {
            let s = pos / self.stripe_bytes;
            let zero = self.is_zero(s);
            let next = self.run_end(s, zero);
            let run_end = (next * self.stripe_bytes).min(end);
            if !extent(run_end - pos, zero) {
                return;
            }
            pos = run_end;
        }
    }

    /// First stripe at or after `s` whose state differs from `zero` (or the stripe count).
    fn run_end(&self, mut s: u64, zero: bool) -> u64 {
        while s < self.stripes {
            let w = self.words[(s / 64) as usize].load(Ordering::Acquire);
            let w = if zero { !w } else { w };
            // Bits at or after `s` within this word that differ.
            let differ = w & (u64::MAX << (s % 64));
            if differ != 0 {
                return ((s / 64) * 64 + u64::from(differ.trailing_zeros())).min(self.stripes);
            }
            s = (s / 64 + 1) * 64;
        }
        self.stripes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{Geometry, Layout, Level};

    fn geo(stripes: u64) -> ArrayGeometry {
        let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 4, 64 << 10, 4096).unwrap();
        ArrayGeometry::new(g, stripes).unwrap()
    }

    fn runs(m: &ZeroMap, off: u64, len: u64) -> Vec<(u64, bool)> {
        let mut v = Vec::new();
        m.extents(off, len, |l, z| {
            v.push((l, z));
            true
        });
        v
    }

    #[test]
    fn a_new_map_is_all_data_and_runs_merge() {
        let m = ZeroMap::new(&geo(200));
        let sb = 3 * 65536;
        assert_eq!(runs(&m, 0, 200 * sb), vec![(200 * sb, false)]);
        for s in 10..140 {
            m.set_zero(s);
        }
        assert_eq!(m.zero_stripes(), 130);
        assert_eq!(
            runs(&m, 0, 200 * sb),
            vec![(10 * sb, false), (130 * sb, true), (60 * sb, false)]
        );
        // Clipped at both ends, unaligned.
        assert_eq!(runs(&m, 10 * sb + 7, 5 * sb), vec![(5 * sb, true)]);
        assert_eq!(
            runs(&m, 9 * sb + 100, sb),
            vec![(sb - 100, false), (100, true)]
        );
        // Past the end: clipped; empty ranges report nothing.
        assert_eq!(runs(&m, 199 * sb, 10 * sb), vec![(sb, false)]);
        assert!(runs(&m, 200 * sb, 10).is_empty());
        m.clear(64);
        assert!(!m.is_zero(64) && m.is_zero(63) && m.is_zero(65));
        assert_eq!(
            runs(&m, 63 * sb, 3 * sb),
            vec![(sb, true), (sb, false), (sb, true)]
        );
    }

    #[test]
    fn the_caller_stops_the_walk() {
        let m = ZeroMap::new(&geo(10));
        for s in (0..10).step_by(2) {
            m.set_zero(s);
        }
        let mut n = 0;
        m.extents(0, u64::MAX, |_, _| {
            n += 1;
            n < 3
        });
        assert_eq!(n, 3);
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one allocated range per member, on purpose
    fn member_allocation_marks_only_stripes_every_member_leaves_unallocated() {
        let g = geo(100);
        let off = 1 << 20;
        let chunk = 64 << 10;
        let alloc = vec![
            Some(vec![0..off]),                                 // metadata only
            Some(vec![off + 5 * chunk..off + 5 * chunk + 1]),   // one byte of stripe 5
            Some(vec![off + 50 * chunk - 1..off + 52 * chunk]), // stripes 49..=51
            Some(vec![]),
        ];
        let m = ZeroMap::from_allocation(&g, off, &alloc);
        let data: Vec<u64> = (0..100).filter(|&s| !m.is_zero(s)).collect();
        assert_eq!(data, vec![5, 49, 50, 51]);
        assert_eq!(m.zero_stripes(), 96, "no bit past the last stripe");
        let mut unknown = alloc.clone();
        unknown[3] = None;
        assert_eq!(
            ZeroMap::from_allocation(&g, off, &unknown).zero_stripes(),
            0
        );
    }
}
