//! Write planning for one stripe: which of full-stripe write, read-modify-write (RMW),
//! reconstruct-write (RCW) or degraded reconstruct-write a partial write takes, and over
//! which byte range of the chunks parity must be recomputed.
//!
//! # The rule
//! Parity is recomputed over the **parity range** `R` (bytes within a chunk): the written
//! range of the chunk when the write touches one data chunk, the whole chunk otherwise (a
//! write spanning two or more chunks covers the tail of one and the head of the next, whose
//! union within a chunk is the whole chunk).
//!
//! - **Full-stripe**: every data chunk is written whole. No reads: P/Q come from the new
//!   data. Works degraded too (failed members are simply not written).
//! - Otherwise, if a member of the stripe has failed: **degraded reconstruct-write** —
//!   read every surviving chunk over `R`, rebuild the missing ones, overlay the new data,
//!   regenerate P/Q, write the surviving members that changed.
//! - Otherwise count the chunk reads (each over `R`) of the two healthy strategies:
//!   * **RMW** reads the touched data chunks and the parity chunks, then
//!     `P' = P ⊕ Δ`, `Q' = Q ⊕ g^slot·Δ` with `Δ = old ⊕ new`;
//!   * **RCW** reads the untouched data chunks and the touched ones not covering all of `R`,
//!     then regenerates P/Q from the full new data.
//!
//!   The strategy that reads fewer chunks wins. **A tie goes to RMW**, where md
//!   (`handle_stripe_dirtying`: `rmw < rcw` → RMW, else RCW) picks RCW: both then move the
//!   same number of chunks (the writes are the same), but RMW reads exactly the blocks it
//!   then writes (device caches, and for RAM-backed members the CPU cache, already hold
//!   them) and computes parity deltas of the touched chunks only, where RCW regenerates
//!   P/Q from every data chunk. On a 6-member RAID6 every one-chunk write is such a tie;
//!   measured on `mem` members RMW did 1.6× the 4 KiB random writes of RCW per core
//!   (docs/BENCHMARKS.md). RCW's one advantage — it does not trust the old parity — matters
//!   only while parity may be stale (an unclean array awaiting resync), which the resync
//!   of a later issue handles.

use crate::geometry::StripeLayout;

/// A byte range within a chunk, `start..end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ChunkRange {
    /// First byte.
    pub start: u32,
    /// One past the last byte.
    pub end: u32,
}

impl ChunkRange {
    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.end - self.start
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }
    /// Whether `self` contains all of `other`.
    pub fn contains(&self, other: &ChunkRange) -> bool {
        self.start <= other.start && other.end <= self.end
    }

    /// The smallest range containing both `self` and `other`.
    pub fn hull(&self, other: &ChunkRange) -> ChunkRange {
        ChunkRange {
            start: self.start.min(other.start),
            end: self.end.max(other.end),
        }
    }
}

/// What a write does to the data chunks of one stripe. A contiguous range touches a run of
/// consecutive chunks `first..=last`, the first from `first_start`, the last up to
/// `last_end`, the ones between whole: four numbers, no per-chunk table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StripeWrite {
    first: u16,
    last: u16,
    first_start: u32,
    last_end: u32,
    /// Data chunks in the stripe.
    pub data_chunks: u16,
    /// Chunk size, bytes.
    pub chunk_bytes: u32,
}

impl StripeWrite {
    /// The footprint of writing stripe-data bytes `start..end` (offsets within the
    /// stripe's logical data, `0..data_chunks*chunk_bytes`).
    ///
    /// # Panics
    /// If the range is empty or exceeds the stripe (a caller bug).
    #[inline]
    pub fn from_range(data_chunks: u16, chunk_bytes: u32, start: u64, end: u64) -> Self {
        let c = u64::from(chunk_bytes);
        assert!(
            start < end && end <= u64::from(data_chunks) * c,
            "range {start}..{end} outside the stripe"
        );
        // Chunk sizes are powers of two (md's rule, checked by `Geometry::new`): shifts and
        // masks instead of divisions on this per-request path.
        debug_assert!(chunk_bytes.is_power_of_two());
        let shift = chunk_bytes.trailing_zeros();
        let (first, last) = ((start >> shift) as u16, ((end - 1) >> shift) as u16);
        Self {
            first,
            last,
            first_start: (start & (c - 1)) as u32,
            last_end: (end - (u64::from(last) << shift)) as u32,
            data_chunks,
            chunk_bytes,
        }
    }

    /// The written range of data chunk `k`, or `None` if the write does not touch it.
    pub fn written(&self, k: u16) -> Option<ChunkRange> {
        if k < self.first || k > self.last {
            return None;
        }
        Some(ChunkRange {
            start: if k == self.first { self.first_start } else { 0 },
            end: if k == self.last {
                self.last_end
            } else {
                self.chunk_bytes
            },
        })
    }

    /// The touched data chunks with their written ranges, in order: `(k, range)` for
    /// `k` in `first..=last` (no test of the untouched ones).
    pub fn chunks(&self) -> impl Iterator<Item = (u16, ChunkRange)> + '_ {
        (self.first..=self.last).map(|k| (k, self.written(k).expect("touched")))
    }

    /// Data chunks touched.
    pub fn touched(&self) -> u16 {
        self.last - self.first + 1
    }

    /// The parity range `R` (see the module docs).
    pub fn parity_range(&self) -> ChunkRange {
        if self.first == self.last {
            ChunkRange {
                start: self.first_start,
                end: self.last_end,
            }
        } else {
            ChunkRange {
                start: 0,
                end: self.chunk_bytes,
            }
        }
    }

    /// Whether every data chunk is written whole.
    pub fn is_full_stripe(&self) -> bool {
        self.first == 0
            && self.last + 1 == self.data_chunks
            && self.first_start == 0
            && self.last_end == self.chunk_bytes
    }
}

/// How a stripe write is carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteMode {
    /// Every data chunk written whole; no reads.
    FullStripe,
    /// Read-modify-write.
    Rmw,
    /// Reconstruct-write.
    Rcw,
    /// A member of the stripe has failed: read all survivors over `R`, rebuild, rewrite.
    Degraded,
}

/// The plan of one stripe write: mode, parity range, and how many chunk reads it costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WritePlan {
    /// Strategy.
    pub mode: WriteMode,
    /// Parity range within the chunk.
    pub range: ChunkRange,
    /// Chunk reads (each over `range`) the plan issues before writing.
    pub reads: u16,
}

/// Plans `w` on `stripe`, given which members have failed (`failed(member)`).
pub fn plan_write(
    w: &StripeWrite,
    stripe: &StripeLayout,
    failed: impl Fn(u16) -> bool,
) -> WritePlan {
    let range = w.parity_range();
    let nd = w.data_chunks;
    let parity_members = [Some(stripe.p_member()), stripe.q_member()];
    let degraded = (0..nd).any(|k| failed(stripe.data_member(k)))
        || parity_members.iter().flatten().any(|&m| failed(m));
    if w.is_full_stripe() {
        return WritePlan {
            mode: WriteMode::FullStripe,
            range,
            reads: 0,
        };
    }
    if degraded {
        let live = (0..nd).filter(|&k| !failed(stripe.data_member(k))).count()
            + parity_members
                .iter()
                .flatten()
                .filter(|&&m| !failed(m))
                .count();
        return WritePlan {
            mode: WriteMode::Degraded,
            range,
            reads: live as u16,
        };
    }
    let touched = w.touched();
    let parity = parity_members.iter().flatten().count() as u16;
    let rmw = touched + parity;
    let rcw = (0..nd)
        .filter(|&k| !w.written(k).is_some_and(|r| r.contains(&range)))
        .count() as u16;
    if rmw <= rcw {
        WritePlan {
            mode: WriteMode::Rmw,
            range,
            reads: rmw,
        }
    } else {
        WritePlan {
            mode: WriteMode::Rcw,
            range,
            reads: rcw,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{Geometry, Layout, Level};

    const C: u32 = 65536;

    fn stripe(level: Level, n: u16) -> StripeLayout {
        Geometry::new(level, Layout::LeftSymmetric, n, u64::from(C), 512)
            .unwrap()
            .stripe(0)
    }

    #[test]
    fn footprint_and_parity_range() {
        let w = StripeWrite::from_range(4, C, 4096, 8192);
        assert_eq!(
            w.written(0),
            Some(ChunkRange {
                start: 4096,
                end: 8192
            })
        );
        assert_eq!(
            w.parity_range(),
            ChunkRange {
                start: 4096,
                end: 8192
            }
        );
        let w = StripeWrite::from_range(4, C, u64::from(C) - 512, u64::from(C) + 512);
        assert_eq!(w.parity_range(), ChunkRange { start: 0, end: C });
        assert!(!w.is_full_stripe());
        assert!(StripeWrite::from_range(4, C, 0, 4 * u64::from(C)).is_full_stripe());
    }

    #[test]
    fn rmw_for_small_writes_on_wide_stripes_rcw_otherwise() {
        let healthy = |_| false;
        // 4 KiB into one chunk of a 7-member RAID6 (5 data): RMW reads 1+2=3, RCW reads 4.
        let s7 = stripe(Level::Raid6, 7);
        let p = plan_write(&StripeWrite::from_range(5, C, 0, 4096), &s7, healthy);
        assert_eq!((p.mode, p.reads), (WriteMode::Rmw, 3));
        // With 6 members (4 data) it is 3 against 3: a tie goes to RMW (unlike md).
        let s6 = stripe(Level::Raid6, 6);
        let p = plan_write(&StripeWrite::from_range(4, C, 0, 4096), &s6, healthy);
        assert_eq!((p.mode, p.reads), (WriteMode::Rmw, 3));
        // RAID5 on 3 members (2 data): RMW reads 1+1=2, RCW reads the other chunk only.
        let s3 = stripe(Level::Raid5, 3);
        let p = plan_write(&StripeWrite::from_range(2, C, 0, 4096), &s3, healthy);
        assert_eq!((p.mode, p.reads), (WriteMode::Rcw, 1));
        // Three whole chunks of four: RCW reads 1, RMW 3+2.
        let p = plan_write(
            &StripeWrite::from_range(4, C, 0, 3 * u64::from(C)),
            &s6,
            healthy,
        );
        assert_eq!((p.mode, p.reads), (WriteMode::Rcw, 1));
        // Full stripe: no reads, even degraded.
        let p = plan_write(
            &StripeWrite::from_range(4, C, 0, 4 * u64::from(C)),
            &s6,
            |m| m == 0,
        );
        assert_eq!((p.mode, p.reads), (WriteMode::FullStripe, 0));
        // Any failed member of the stripe: degraded reconstruct-write of the 5 survivors.
        let p = plan_write(&StripeWrite::from_range(4, C, 0, 4096), &s6, |m| {
            m == s6.p_member()
        });
        assert_eq!((p.mode, p.reads), (WriteMode::Degraded, 5));
    }
}
