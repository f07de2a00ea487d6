//! The Partial Parity Log at run time: md's PPL (`drivers/md/raid5-ppl.c`), shared
//! lock-free by every shard of a RAID5 array.
//!
//! The on-disk format (header, entries, checksums, the area's place on each member) is
//! md's (`../shared/research/md-batching-and-ppl.md` part 2; docs/FORMAT.md). This module
//! holds what the shards share at run time and the pure rules the write path follows.
//!
//! # md's write protocol, per member log (research note §2.5)
//! A write of a stripe is logged in the PPL area of the stripe's **parity member**: one
//! *entry* per run of rows whose set of modified data chunks is the same, with the
//! *partial parity* of those rows — the XOR of the data chunks the write does not modify.
//! 1. The record (4 KiB header + partial parity) is durable (FUA) on the parity member
//!    before any data or parity write of its stripes goes out.
//! 2. The next record of that member's log is written only after every stripe write of the
//!    previous one has completed and the members those writes reached have been flushed
//!    (when they have a volatile cache): so at any instant only the newest record of a log
//!    can describe writes that are not on stable media, and recovery replays only the
//!    newest record of each log (`ppl_load_distributed`).
//!
//! Step 2 makes each member's log strictly serial, across shards too: the shards of an
//! array take turns on a log with a ticket pair ([`PplLog`]): a shard with writes waiting
//! for the log takes a ticket and writes its record when `serving` reaches it; it passes
//! the turn on once the record's writes are durable. Nothing blocks: a waiting shard polls
//! `serving` in its loop, like the bitmap's waiters poll the bitmap generation.
//!
//! # What an entry can describe (`ppl_recover_entry`)
//! An entry names its first modified block by array-logical sector (`data_sector`), its
//! partial parity length (`pp_size`, bytes: rows × row bytes) and modified bytes
//! (`data_size`); recovery takes the modified data chunks to be the `data_size / pp_size`
//! **consecutive** chunks (logical order) from `data_sector`'s chunk, each modified over
//! the same rows. A write that covers one contiguous range of the stripe's logical data
//! modifies, in every row, a consecutive run of chunks ([`entries_for_range`]): at most
//! three runs of rows with different chunk sets. Rows whose every data chunk is modified
//! are logged as md logs a full-stripe write: `pp_size` 0, parity recomputed from all data.
//!
//! # RAID6
//! ferroraid's RAID6 extension (docs/FORMAT.md) logs each write in the logs of both of the
//! stripe's parity members, with partial P and partial Q; [`recover`] pairs the two and
//! rebuilds from them (module `raid6`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use arrayvec::ArrayVec;
use thiserror::Error;

use crate::device::IoError;
use crate::geometry::ArrayGeometry;
use crate::metadata::ppl::{
    plan_recovery, scan_area_with, PplHeader, PPL_HEADER_SECTORS, PPL_HEADER_SIZE,
};
use crate::metadata::Uuid;

mod raid6;
#[cfg(test)]
mod raid6_tests;

pub use raid6::{decode_entry, Raid6Entry, Raid6EntryError};

/// One entry of a record, in engine units (converted to md's `struct ppl_header_entry`
/// when the record is encoded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryRect {
    /// First row, bytes from the start of the chunk.
    pub row_start: u32,
    /// Rows covered, bytes (the same rows of every modified chunk).
    pub row_bytes: u32,
    /// First modified data chunk (logical index in the stripe).
    pub first_chunk: u16,
    /// Modified data chunks, consecutive from `first_chunk`.
    pub chunks: u16,
}

impl EntryRect {
    /// Whether every data chunk of the stripe is modified over these rows (md's
    /// full-stripe entry: no partial parity, `pp_size` 0).
    pub fn is_full(&self, data_chunks: u16) -> bool {
        self.first_chunk == 0 && self.chunks == data_chunks
    }

    /// Bytes of partial parity the entry carries (`pp_size`): 0 for a full entry.
    pub fn pp_bytes(&self, data_chunks: u16) -> u32 {
        if self.is_full(data_chunks) {
            0
        } else {
            self.row_bytes
        }
    }
}

/// The entries describing a write of the contiguous range `lo..hi` of a stripe's logical
/// data (bytes; `0 <= lo < hi <= data_chunks × chunk_bytes`), at most three, in row
/// order (see the module docs). Rows no chunk is modified in get no entry.
///
/// # Panics
/// If the range is empty or outside the stripe (a programmer error: ranges come from the
/// engine's own stripe pieces).
pub fn entries_for_range(lo: u64, hi: u64, chunk_bytes: u32) -> ArrayVec<EntryRect, 3> {
    let c = u64::from(chunk_bytes);
    assert!(lo < hi, "empty range");
    let (k_lo, o_lo) = ((lo / c) as u16, (lo % c) as u32);
    let (k_hi, o_hi) = (((hi - 1) / c) as u16, ((hi - 1) % c) as u32 + 1);
    let mut out = ArrayVec::new();
    if k_lo == k_hi {
        out.push(EntryRect {
            row_start: o_lo,
            row_bytes: o_hi - o_lo,
            first_chunk: k_lo,
            chunks: 1,
        });
        return out;
    }
    // In row r: chunk k_lo is modified iff r >= o_lo, k_hi iff r < o_hi, every chunk
    // between always. The chunk set changes only at o_lo and o_hi.
    let mut cuts: ArrayVec<u32, 4> = ArrayVec::new();
    for x in [0, o_lo, o_hi, chunk_bytes] {
        if !cuts.contains(&x) {
            cuts.push(x);
        }
    }
    cuts.sort_unstable();
    for w in cuts.windows(2) {
        let (a, b) = (w[0], w[1]);
        let first = if a >= o_lo { k_lo } else { k_lo + 1 };
        let last = if a < o_hi { k_hi } else { k_hi - 1 };
        if first > last {
            continue;
        }
        out.push(EntryRect {
            row_start: a,
            row_bytes: b - a,
            first_chunk: first,
            chunks: last - first + 1,
        });
    }
    out
}

/// One member's log, shared by the shards (see the module docs): the turn tickets, the
/// record generation and where the next record goes.
#[derive(Debug, Default)]
pub struct PplLog {
    next_ticket: AtomicU64,
    serving: AtomicU64,
    /// Generation of the last record written (md counts 1, 2, 3 … from each assembly; the
    /// empty header written at assembly has 0).
    generation: AtomicU64,
    /// Bytes from the start of the area where the next record goes.
    next_offset: AtomicU64,
    /// The next record goes to the area's start ([`Self::rewind`]).
    rewind: AtomicBool,
}

impl PplLog {
    /// Takes a ticket: the caller's turn comes when [`Self::serving`] equals it.
    pub fn take_ticket(&self) -> u64 {
        self.next_ticket.fetch_add(1, Ordering::AcqRel)
    }

    /// Makes the next record placed ([`Self::place_record`]) start the area again, as a
    /// wrap does. For a log whose member device changed (a replacement took the slot):
    /// recovery walks a log from the area's start, and the new device holds none of the
    /// records before it took the slot (its area was zeroed when it joined), so its log
    /// is walkable once a record lies at its start. Every shard asks when it swaps the
    /// device in; the first record after the last of them lands there (an earlier one
    /// may land at the start of the old device's area, a wrap there). Until then the new
    /// device's log reads as missing (recovery counts a mismatch; the turn rule makes the
    /// newest record the only one whose writes may not be durable).
    pub fn rewind(&self) {
        self.rewind.store(true, Ordering::Release);
    }

    /// The ticket whose turn it is.
    pub fn serving(&self) -> u64 {
        self.serving.load(Ordering::Acquire)
    }

    /// Ends the turn of `ticket` (which must be the one being served).
    pub fn pass_turn(&self, ticket: u64) {
        let prev = self.serving.fetch_add(1, Ordering::AcqRel);
        assert_eq!(
            prev, ticket,
            "a PPL turn passed on by a shard that did not hold it"
        );
    }

    /// For the turn holder: the next record's generation and its offset in an area of
    /// `area_bytes`, for a record of `record_bytes` (md's multiple-PPL mode: records back
    /// to back, rewinding to the start when the next one does not fit, raid5-ppl.c
    /// `ppl_submit_iounit`).
    ///
    /// A record always ends more than one header before the end of the area. md's scan
    /// (`ppl_load_distributed`) walks `while (offset < ppl.size - 8)`: when the newest
    /// record ends at or past `ppl.size - 8` sectors the loop ends on its condition and —
    /// unlike when it stops at an invalid or older header — keeps the advanced offset
    /// instead of the newest record's, so `ppl_recover` reads that record's partial parity
    /// from past its end, finds a checksum mismatch and md resyncs. The kernel-md interop
    /// test saw both edges: a record ending exactly at the end of the area, and one ending
    /// exactly one header before it. `off + record_bytes + 4096 < area_bytes` keeps every
    /// record clear of both.
    pub fn place_record(&self, record_bytes: u64, area_bytes: u64) -> (u64, u64) {
        let gen = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        let mut off = self.next_offset.load(Ordering::Acquire);
        if self.rewind.swap(false, Ordering::AcqRel)
            || off + record_bytes + PPL_HEADER_SIZE as u64 >= area_bytes
        {
            off = 0;
        }
        self.next_offset
            .store(off + record_bytes, Ordering::Release);
        (gen, off)
    }
}

/// The smallest usable PPL area, bytes, that ferroraid's writer can log into for a chunk
/// of `chunk_bytes`: one record (the 4 KiB header and up to one chunk of partial parity,
/// what one write of a stripe can need) that ends more than one 4 KiB header before the
/// area's end ([`PplLog::place_record`]). md logs per 4 KiB stripe and needs less
/// (`ppl_validate_rdev`: a header and one page), so an md array can have a smaller area;
/// assembly refuses to serve such an array with its PPL rather than log into it.
pub fn min_area_bytes(chunk_bytes: u32) -> u64 {
    3 * PPL_HEADER_SIZE as u64 + u64::from(chunk_bytes)
}

/// The most members an array with a Partial Parity Log may have: 64, md's limit
/// (raid5-ppl.c `ppl_init_log`: "PPL doesn't support over %d disks", one bit per disk
/// in `disk_flush_bitmap`, an `unsigned long`). ferroraid's logs keep one bit per member
/// in the same way ([`crate::array::Array::attach_ppl`]); create, the policy switch and
/// assembly refuse more.
pub const MAX_PPL_MEMBERS: u16 = 64;

/// What every shard of a RAID5 array with a PPL shares: one [`PplLog`] per member, where
/// the area lies on each member, and the array's signature.
#[derive(Debug)]
pub struct PplShared {
    logs: Box<[PplLog]>,
    /// Byte offset of the PPL area from the start of each member (absolute; md's
    /// `ppl.sector × 512`).
    pub area_offset_bytes: u64,
    /// Bytes of the area (md's `ppl.size × 512`).
    pub area_bytes: u64,
    /// The records' `signature`: CRC32C of the array UUID as md computes it.
    pub signature: u32,
}

impl PplShared {
    /// The shared logs of an array of `members` members.
    pub fn new(members: usize, area_offset_bytes: u64, area_bytes: u64, signature: u32) -> Self {
        PplShared {
            logs: (0..members).map(|_| PplLog::default()).collect(),
            area_offset_bytes,
            area_bytes,
            signature,
        }
    }

    /// Member `m`'s log.
    pub fn log(&self, m: usize) -> &PplLog {
        &self.logs[m]
    }

    /// Members (logs).
    pub fn members(&self) -> usize {
        self.logs.len()
    }
}

/// Where the PPL and the data lie on every member, bytes from the member's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PplLayout {
    /// Start of the PPL area (md's `ppl.sector × 512`).
    pub area_offset_bytes: u64,
    /// Usable bytes of the area: [`crate::metadata::ppl::usable_area_sectors`] × 512 (the
    /// kernel trims `ppl.size` that way, `ppl_validate_rdev`).
    pub area_bytes: u64,
    /// Start of the data area (md's `data_offset × 512`).
    pub data_offset_bytes: u64,
}

/// Synchronous member access for recovery at assembly, before the array serves anything.
/// Offsets are bytes from the start of the member.
pub trait PplMedia {
    /// Reads `buf.len()` bytes of member `member` at `offset`.
    fn read(&mut self, member: u16, offset: u64, buf: &mut [u8]) -> Result<(), IoError>;
    /// Writes `buf` to member `member` at `offset`.
    fn write(&mut self, member: u16, offset: u64, buf: &[u8]) -> Result<(), IoError>;
    /// Makes member `member`'s completed writes durable.
    fn flush(&mut self, member: u16) -> Result<(), IoError>;
}

/// What [`recover`] did (md's `ppl_conf` counters, and what ferroraid reports on top).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Members whose log was read (present members).
    pub logs: u32,
    /// Records replayed: the newest of each log, when it has entries.
    pub records: u32,
    /// Entries whose partial parity verified and whose rows were replayed
    /// (`recovered_entries`).
    pub entries: u32,
    /// md's `mismatch_count`: logs without a valid header at the area start, entries whose
    /// partial parity fails its checksum, entries the geometry refuses. Any makes the array
    /// stay dirty (a resync, where possible) instead of clean. RAID6 also counts the
    /// entries [`decode_entry`] or the log-member check refuses ([`Raid6EntryError`]), and
    /// one per entry (or pair) whose rows have more than two erasures
    /// (`rows_unrecoverable`).
    pub mismatches: u32,
    /// Rows whose parity was recomputed (RAID6: P and Q, written to whichever of them is
    /// present; a pair of entries counts its rows once). Rows are md's recovery blocks:
    /// 4096 bytes of each chunk when the entry is 4 KiB aligned, else 512.
    pub rows_repaired: u64,
    /// Rows whose written region could not be known because a modified data chunk's member
    /// is missing. RAID5 (md): left alone, the written region there is as md leaves it
    /// (old, new or torn), the rest of the stripe safe. RAID6: the missing modified block
    /// is given the value the on-disk P/Q imply (old, new or torn) and the row is then
    /// repaired (counted in `rows_repaired` too): every unmodified block is safe.
    pub rows_skipped: u64,
    /// Stripes with skipped rows.
    pub stripes_skipped: u64,
    /// RAID6 only (ferroraid RAID6 extension, docs/FORMAT.md): entries whose partner log
    /// (the stripe's other parity member, present, with a valid record) does not hold the
    /// same entry in its newest record — the write was never issued or is durable, the rows
    /// are consistent on media and are left alone. Counted per entry, in either log.
    pub entries_settled: u32,
    /// RAID6 only: entries recovered jointly with their partner (both counted, whether or
    /// not their partial parity verified); the others among `entries` were recovered alone
    /// (their partner's member missing or its log unreadable).
    pub entries_paired: u32,
    /// RAID6 only: rows left alone because more chunks were erased than P and Q can solve
    /// (missing members plus unknown partial parity: more than two). Each entry (or pair)
    /// with such rows counts one mismatch.
    pub rows_unrecoverable: u64,
}

impl RecoveryReport {
    /// Whether the array is consistent after recovery (no mismatch): it may be marked
    /// clean without a resync.
    pub fn clean(&self) -> bool {
        self.mismatches == 0
    }
}

/// Why recovery stopped.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RecoverError {
    /// A member read or write failed: md fails that member and recovers nothing from it
    /// (`ppl_load_distributed`, `ppl_recover_entry`); the caller decides whether the array
    /// can start without it.
    #[error("member {member}: {error} during PPL recovery")]
    Io {
        /// The member (role index).
        member: u16,
        /// The device's error.
        error: IoError,
    },
}

/// Recovery at assembly after an unclean shutdown. Run it before the array serves
/// anything, then [`reinit_areas`]. `present[m]`: whether member (role) `m` can be read
/// and written; offsets in `layout` are bytes.
///
/// - **RAID5** (md's `ppl_load` → `ppl_recover` → `ppl_recover_entry`, through
///   [`plan_recovery`]): for every present member, the newest record of its log is read and
///   each entry whose partial parity verifies has, row by row, its parity rewritten as
///   `PP ⊕ the current data of the modified chunks` — right whether each modified block
///   holds old, new or torn data — except rows whose modified chunk lies on a missing
///   member (skipped, counted).
/// - **RAID6** (ferroraid RAID6 extension, docs/FORMAT.md; `geo` with two parity chunks):
///   each entry is paired with the same entry in the newest record of its stripe's other
///   parity member's log; settled (partner log present without it: nothing to do), joint
///   (both partial parities) or single (partner member missing) recovery rebuilds missing
///   unmodified blocks from the partial parity, solves missing modified blocks from the
///   on-disk P and Q, and writes P and Q of the whole row to the present parity members
///   (module `raid6`). Entries the writer never produces ([`Raid6EntryError`]) and
///   rows with more than two erasures are left alone and counted as mismatches.
///
/// Every written member is flushed. Never panics on what it reads.
///
/// # Errors
/// [`RecoverError::Io`] on the first member I/O error.
pub fn recover(
    geo: &ArrayGeometry,
    layout: &PplLayout,
    uuid: &Uuid,
    present: &[bool],
    media: &mut impl PplMedia,
) -> Result<RecoveryReport, RecoverError> {
    if geo.geometry().parity_chunks() == 2 {
        return raid6::recover(geo, layout, uuid, present, media);
    }
    // RAID5: md's `ppl_recover`.
    let mut rep = RecoveryReport::default();
    let io = |member: u16| move |error: IoError| RecoverError::Io { member, error };
    let sectors = layout.area_bytes / 512;
    let mut written = vec![false; present.len()];
    let mut last_skipped_stripe = None;
    let stripe_data_sectors =
        u64::from(geo.geometry().chunk_sectors()) * u64::from(geo.geometry().data_chunks());
    for (m, _) in present.iter().enumerate().filter(|(_, &p)| p) {
        let member = m as u16;
        rep.logs += 1;
        let scan = scan_area_with(sectors, uuid, |off, block| {
            media.read(member, layout.area_offset_bytes + off * 512, block)
        })
        .map_err(io(member))?;
        let Some(rec) = scan.newest else {
            rep.mismatches += 1;
            continue;
        };
        rep.records += u32::from(!rec.header.entries.is_empty());
        let mut pp_at = layout.area_offset_bytes + (rec.offset_sectors + PPL_HEADER_SECTORS) * 512;
        for e in &rec.header.entries {
            let mut pp = vec![0u8; e.pp_size as usize];
            let at = pp_at;
            pp_at += u64::from(e.pp_size >> 9) * 512;
            if pp_at > layout.area_offset_bytes + layout.area_bytes {
                rep.mismatches += 1;
                break;
            }
            media.read(member, at, &mut pp).map_err(io(member))?;
            if !e.pp_matches(&pp) {
                rep.mismatches += 1;
                continue;
            }
            let plan = match plan_recovery(e, geo, member, |d, _| !present[usize::from(d)]) {
                Ok(p) => p,
                Err(_) => {
                    rep.mismatches += 1;
                    continue;
                }
            };
            rep.entries += 1;
            rep.rows_skipped += plan.skipped.len() as u64;
            for sk in &plan.skipped {
                let stripe = sk.array_sector / stripe_data_sectors;
                if last_skipped_stripe != Some(stripe) {
                    last_skipped_stripe = Some(stripe);
                    rep.stripes_skipped += 1;
                }
            }
            let bs = plan.block_bytes as usize;
            let mut acc = vec![0u8; bs];
            let mut blk = vec![0u8; bs];
            for row in &plan.rows {
                match row.pp_offset_bytes {
                    Some(o) => acc.copy_from_slice(&pp[o as usize..o as usize + bs]),
                    None => acc.fill(0),
                }
                for d in &row.data {
                    media
                        .read(
                            d.member,
                            layout.data_offset_bytes + d.offset_bytes,
                            &mut blk,
                        )
                        .map_err(io(d.member))?;
                    acc.iter_mut().zip(&blk).for_each(|(a, b)| *a ^= b);
                }
                let pm = row.parity.member;
                media
                    .write(pm, layout.data_offset_bytes + row.parity.offset_bytes, &acc)
                    .map_err(io(pm))?;
                written[usize::from(pm)] = true;
                rep.rows_repaired += 1;
            }
        }
    }
    for (m, _) in written.iter().enumerate().filter(|(_, &w)| w) {
        media.flush(m as u16).map_err(io(m as u16))?;
    }
    Ok(rep)
}

/// Re-initialises the PPL area of every present member as md does at every start
/// (`ppl_write_empty_header`): the area zeroed, then the empty header (generation 0) at
/// its start, flushed. The array's records then start again at generation 1 from the
/// area's start ([`PplShared`] starts that way).
///
/// # Errors
/// [`RecoverError::Io`] on the first member I/O error.
pub fn reinit_areas(
    layout: &PplLayout,
    uuid: &Uuid,
    present: &[bool],
    media: &mut impl PplMedia,
) -> Result<(), RecoverError> {
    let header = PplHeader::empty(uuid)
        .encode()
        .expect("the empty header encodes");
    let zero = vec![0u8; (1 << 20).min(layout.area_bytes as usize)];
    for (m, _) in present.iter().enumerate().filter(|(_, &p)| p) {
        let member = m as u16;
        let io = |error| RecoverError::Io { member, error };
        let mut off = PPL_HEADER_SIZE as u64;
        while off < layout.area_bytes {
            let n = (layout.area_bytes - off).min(zero.len() as u64) as usize;
            media
                .write(member, layout.area_offset_bytes + off, &zero[..n])
                .map_err(io)?;
            off += n as u64;
        }
        media
            .write(member, layout.area_offset_bytes, &header)
            .map_err(io)?;
        media.flush(member).map_err(io)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rect(row_start: u32, row_bytes: u32, first_chunk: u16, chunks: u16) -> EntryRect {
        EntryRect {
            row_start,
            row_bytes,
            first_chunk,
            chunks,
        }
    }

    #[test]
    fn a_write_inside_one_chunk_is_one_entry() {
        let e = entries_for_range(64 * 1024 + 4096, 64 * 1024 + 12288, 65536);
        assert_eq!(e.as_slice(), &[rect(4096, 8192, 1, 1)]);
    }

    #[test]
    fn a_write_across_chunks_gives_a_consecutive_chunk_set_per_row_run() {
        // Chunk 0 from 48 KiB, chunk 1 whole, chunk 2 up to 16 KiB.
        let c = 65536u32;
        let e = entries_for_range(48 * 1024, 2 * 65536 + 16 * 1024, c);
        assert_eq!(
            e.as_slice(),
            &[
                rect(0, 16384, 1, 2),
                rect(16384, 32768, 1, 1),
                rect(49152, 16384, 0, 2)
            ]
        );
        // Two adjacent partial chunks whose rows do not meet: two single-chunk entries.
        let e = entries_for_range(60 * 1024, 65536 + 4096, c);
        assert_eq!(
            e.as_slice(),
            &[rect(0, 4096, 1, 1), rect(61440, 4096, 0, 1)]
        );
    }

    #[test]
    fn every_modified_block_is_in_exactly_one_entry() {
        let c = 8192u32;
        let nd = 4u64;
        for lo in (0..nd * u64::from(c)).step_by(512) {
            for hi in ((lo + 512)..=nd * u64::from(c)).step_by(512) {
                let mut seen = vec![0u8; (nd * u64::from(c) / 512) as usize];
                for r in entries_for_range(lo, hi, c) {
                    assert!(r.chunks >= 1 && r.row_bytes > 0);
                    for k in r.first_chunk..r.first_chunk + r.chunks {
                        for b in (r.row_start..r.row_start + r.row_bytes).step_by(512) {
                            let x = u64::from(k) * u64::from(c) + u64::from(b);
                            seen[(x / 512) as usize] += 1;
                        }
                    }
                }
                for (i, &n) in seen.iter().enumerate() {
                    let x = i as u64 * 512;
                    let want = u8::from(x >= lo && x < hi);
                    assert_eq!(n, want, "lo {lo} hi {hi} block at {x}");
                }
            }
        }
    }

    #[test]
    fn turns_are_served_in_ticket_order_and_records_rewind() {
        let log = PplLog::default();
        let (a, b) = (log.take_ticket(), log.take_ticket());
        assert_eq!(log.serving(), a);
        log.pass_turn(a);
        assert_eq!(log.serving(), b);
        assert_eq!(log.place_record(4096 + 8192, 32768), (1, 0));
        assert_eq!(log.place_record(4096 + 8192, 32768), (2, 12288));
        assert_eq!(log.place_record(4096 + 8192, 32768), (3, 0));
        // A record that would end at the area's end, or exactly one header before it
        // (where md's scan would misplace it), goes to the start instead.
        let log = PplLog::default();
        assert_eq!(log.place_record(4096 + 12288, 32768), (1, 0));
        assert_eq!(log.place_record(4096 + 12288, 32768), (2, 0));
        let log = PplLog::default();
        assert_eq!(log.place_record(4096 + 8192, 28672 + 512), (1, 0));
        assert_eq!(log.place_record(4096 + 8192, 28672 + 512), (2, 12288));
        let log = PplLog::default();
        assert_eq!(log.place_record(4096 + 8192, 28672), (1, 0));
        assert_eq!(log.place_record(4096 + 8192, 28672), (2, 0));
    }

    /// md's walk as `ppl_load_distributed` codes it (raid5-ppl.c, Linux v6.1), quirk
    /// included: the offset at which `ppl_recover` reads the newest record's partial
    /// parity (`None` when no valid header). Kept apart from [`scan_area_with`], which
    /// returns the newest record's own offset whatever ended the walk.
    fn md_recover_offset(area: &[u8], usable_sectors: u64, uuid: &Uuid) -> Option<u64> {
        let (mut off, mut prev): (u64, Option<(u64, u64)>) = (0, None);
        while off < usable_sectors - PPL_HEADER_SECTORS {
            let at = off as usize * 512;
            let block: &[u8; PPL_HEADER_SIZE] =
                area[at..at + PPL_HEADER_SIZE].try_into().expect("4 KiB");
            let Ok(h) = PplHeader::decode(block) else {
                return prev.map(|(o, _)| o);
            };
            if h.signature != crate::metadata::ppl::signature(uuid)
                || prev.is_some_and(|(_, g)| g > h.generation)
            {
                return prev.map(|(o, _)| o);
            }
            prev = Some((off, h.generation));
            off += h.record_sectors();
        }
        // The loop ended on its condition: md keeps the advanced offset.
        prev.map(|_| off)
    }

    proptest::proptest! {
        /// Records placed by [`PplLog::place_record`] in an area of any usable size are
        /// found by md's own walk at their offsets: the newest record is the one md
        /// recovers, read from where it was written, after any number of rewinds.
        #[test]
        fn md_finds_every_placed_record_where_it_was_written(
            data_pages in 3u64..80,
            pp_pages in proptest::collection::vec(1u64..17, 1..60),
        ) {
            let uuid = Uuid([7; 16]);
            let usable_sectors = PPL_HEADER_SECTORS + data_pages * 8;
            let area_bytes = usable_sectors * 512;
            let mut area = vec![0u8; area_bytes as usize + 2 * PPL_HEADER_SIZE];
            let log = PplLog::default();
            for &pages in &pp_pages {
                let pp = pages.min(data_pages - 2) * 4096;
                let (generation, off) = log.place_record(PPL_HEADER_SIZE as u64 + pp, area_bytes);
                proptest::prop_assert!(off + PPL_HEADER_SIZE as u64 + pp + (PPL_HEADER_SIZE as u64) < area_bytes);
                let header = PplHeader {
                    signature: crate::metadata::ppl::signature(&uuid),
                    generation,
                    entries: vec![crate::metadata::ppl::PplEntry {
                        data_sector: 0,
                        pp_size: pp as u32,
                        data_size: pp as u32,
                        parity_disk: 0,
                        checksum: 0,
                    }],
                };
                let at = off as usize;
                area[at..at + PPL_HEADER_SIZE].copy_from_slice(&header.encode().expect("one entry"));
                proptest::prop_assert_eq!(md_recover_offset(&area, usable_sectors, &uuid), Some(off / 512));
                let scan = crate::metadata::ppl::scan_area(&area, usable_sectors, &uuid);
                proptest::prop_assert_eq!(scan.newest.map(|r| (r.offset_sectors, r.header.generation)), Some((off / 512, generation)));
            }
        }
    }
}
