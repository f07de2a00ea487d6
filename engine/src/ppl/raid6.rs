//! RAID6 recovery at assembly: ferroraid's RAID6 extension of md's Partial Parity Log
//! (docs/FORMAT.md, "PPL"; the spec of the extension is the "Recovery" section there).
//!
//! A write of stripe S is logged twice, with identical entries: in the log of S's P member
//! (partial P: XOR of the data chunks the write leaves alone) and in the log of S's Q
//! member (partial Q: `Σ g^slot · D` over the same chunks, [`StripeLayout::q_slot`]). The
//! write ordering guarantees that a write with a member write issued and not durable is in
//! the newest record of **both** logs, and that a stripe whose two newest records do not
//! hold the same write is consistent on stable media.
//!
//! Recovery takes each present member's newest record and, for every entry, looks for its
//! *partner*: the entry with the same `data_sector`, `pp_size` and `data_size` in the newest
//! record of the stripe's other parity member. Then:
//! - partner member present, its newest record without the partner entry: **settled**,
//!   nothing to do ([`RecoveryReport::entries_settled`]);
//! - partner entry found: **joint** recovery with both partials (the pair once);
//! - partner member missing (or its log unreadable: no valid record, counted as a
//!   mismatch): **single** recovery with this entry's partial alone.
//!
//! Recovery of an entry, over its rows (with M the modified data chunks, U the others):
//! 1. a missing U chunk is rebuilt from the partial(s): a virtual stripe whose M chunks are
//!    zero, whose P is the partial P and Q the partial Q (a missing or corrupt partial is an
//!    erased P or Q);
//! 2. a missing M chunk takes the value the on-disk P/Q imply (old, new or torn: the write
//!    was in flight, its region cannot be known — [`RecoveryReport::rows_skipped`]);
//! 3. P and Q are recomputed from the whole row and written to whichever parity members
//!    are present.
//!
//! md's `ppl_recover_entry` works block by block (4 KiB when the entry is 4 KiB aligned,
//! else 512 B) because a member may be recovered only up to some offset; here a member is
//! present or not as a whole, so an entry's rows are processed as one rectangle (the
//! arithmetic is bytewise: the result is the same), and rows are *counted* in md's blocks.

use std::collections::BTreeSet;

use arrayvec::ArrayVec;
use thiserror::Error;

use super::{PplLayout, PplMedia, RecoverError, RecoveryReport};
use crate::buf::AlignedBuf;
use crate::device::IoError;
use crate::geometry::{ArrayGeometry, Role, StripeLayout};
use crate::metadata::ppl::{scan_area_with, PplEntry, PPL_HEADER_SECTORS};
use crate::metadata::Uuid;
use crate::parity::{ChunkId, Parity, MAX_DATA_CHUNKS};

/// Bytes of md's recovery block when an entry is 4 KiB aligned (`STRIPE_SIZE`).
const BLOCK_4K: u32 = 4096;
/// md's recovery block otherwise (native metadata: `block_size` 512).
const BLOCK_512: u32 = 512;

/// A RAID6 PPL entry decoded against the geometry: which rows of which chunks of which
/// stripe the logged write modified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Raid6Entry {
    /// The stripe.
    pub stripe: u64,
    /// First modified data chunk (logical index in the stripe).
    pub first_chunk: u16,
    /// Modified data chunks, consecutive from `first_chunk`.
    pub chunks: u16,
    /// First row, bytes from the start of the chunk.
    pub row_start: u32,
    /// Rows covered, bytes (the same rows of every modified chunk; equals `pp_size` when
    /// the entry carries partial parity).
    pub row_bytes: u32,
    /// md's recovery block, bytes: 4096 when the entry's first and last sectors are 4 KiB
    /// aligned, else 512 (`ppl_recover_entry`); rows are counted in these.
    pub block_bytes: u32,
}

impl Raid6Entry {
    /// Whether logical data chunk `k` is modified.
    pub fn modifies(&self, k: u16) -> bool {
        k >= self.first_chunk && k - self.first_chunk < self.chunks
    }

    /// Rows of the entry in md's blocks ([`Raid6Entry::block_bytes`]).
    pub fn rows(&self) -> u64 {
        u64::from(self.row_bytes / self.block_bytes)
    }
}

/// Why a RAID6 entry is refused: something ferroraid's writer never produces
/// (`crate::ppl::entries_for_range`). Each refusal counts one mismatch.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum Raid6EntryError {
    /// `pp_size`/`data_size` do not describe whole 512-byte rows of whole chunks: not a
    /// multiple of 512, `data_size` not a multiple of the row bytes (or of the data chunks
    /// for a full-stripe entry), no data, or `pp_size` above the chunk size.
    #[error(
        "RAID6 PPL entry with pp_size {pp_size} and data_size {data_size} bytes describes no \
         rectangle of rows the writer logs (chunk {chunk_bytes} bytes)"
    )]
    Shape {
        /// `pp_size`, bytes.
        pp_size: u32,
        /// `data_size`, bytes.
        data_size: u32,
        /// Chunk size, bytes.
        chunk_bytes: u32,
    },
    /// More modified chunks (`data_size / pp_size`) than a stripe has data chunks.
    #[error("RAID6 PPL entry names {chunks} modified chunks; a stripe has {data_chunks}")]
    TooManyChunks {
        /// Modified chunks named.
        chunks: u64,
        /// Data chunks per stripe.
        data_chunks: u16,
    },
    /// The entry's rows run past the end of the chunk, or its chunks past the stripe's
    /// last data chunk.
    #[error("RAID6 PPL entry at array sector {data_sector} crosses its chunk or stripe")]
    CrossesStripe {
        /// `data_sector`, 512-byte sectors.
        data_sector: u64,
    },
    /// The entry lies beyond the array.
    #[error(
        "RAID6 PPL entry at array sector {data_sector} is beyond the array's {stripes} stripes"
    )]
    OutOfRange {
        /// `data_sector`, 512-byte sectors.
        data_sector: u64,
        /// Stripes in the array.
        stripes: u64,
    },
    /// The log's member is neither P nor Q of the entry's stripe.
    #[error(
        "RAID6 PPL entry for stripe {stripe} found in the log of member {log_member}, which \
         holds neither its P nor its Q"
    )]
    NotParity {
        /// The stripe.
        stripe: u64,
        /// The member whose area held the entry.
        log_member: u16,
    },
    /// The entry's `parity_disk` is not the log's own member.
    #[error(
        "RAID6 PPL entry names parity disk {parity_disk} but was found in the log of member \
         {log_member}"
    )]
    ParityDisk {
        /// The entry's `parity_disk`.
        parity_disk: u32,
        /// The member whose area held the entry.
        log_member: u16,
    },
}

/// Decodes `entry` by md's rules (`ppl_recover_entry`, as [`crate::metadata::ppl::plan_recovery`]
/// reads them, with `DD` = data chunks of a RAID6 stripe): the first modified block is at
/// array sector `data_sector`; with `pp_size > 0` the modified chunks are `data_size /
/// pp_size` consecutive chunks from that block's chunk, over `pp_size` bytes of rows each;
/// with `pp_size == 0` (full-stripe entry) every data chunk over `data_size / DD` bytes of
/// rows. Units: `data_sector` in 512-byte sectors, `pp_size`/`data_size` in bytes.
///
/// Only what ferroraid's writer produces is accepted (ferroraid RAID6 extension,
/// docs/FORMAT.md): for `pp_size == chunk` md's own rule (`n = DD`, bounded by
/// `data_size`) gives the same chunks when `data_size` is a whole number of chunks, which
/// is all the writer writes.
///
/// # Errors
/// [`Raid6EntryError::Shape`], [`Raid6EntryError::TooManyChunks`],
/// [`Raid6EntryError::CrossesStripe`], [`Raid6EntryError::OutOfRange`]; never panics.
pub fn decode_entry(entry: &PplEntry, geo: &ArrayGeometry) -> Result<Raid6Entry, Raid6EntryError> {
    let g = geo.geometry();
    let dd = g.data_chunks();
    let chunk = g.chunk_bytes();
    let shape = Raid6EntryError::Shape {
        pp_size: entry.pp_size,
        data_size: entry.data_size,
        chunk_bytes: chunk,
    };
    let (row_bytes, n) = if entry.pp_size == 0 {
        if !entry.data_size.is_multiple_of(u32::from(dd)) {
            return Err(shape);
        }
        (entry.data_size / u32::from(dd), u64::from(dd))
    } else {
        if !entry.data_size.is_multiple_of(entry.pp_size) || entry.pp_size > chunk {
            return Err(shape);
        }
        (entry.pp_size, u64::from(entry.data_size / entry.pp_size))
    };
    if row_bytes == 0 || !row_bytes.is_multiple_of(BLOCK_512) || n == 0 {
        return Err(shape);
    }
    if n > u64::from(dd) {
        return Err(Raid6EntryError::TooManyChunks {
            chunks: n,
            data_chunks: dd,
        });
    }
    let first = entry
        .data_sector
        .checked_mul(512)
        .ok_or(Raid6EntryError::OutOfRange {
            data_sector: entry.data_sector,
            stripes: geo.stripes(),
        })?;
    let (stripe, within) = geo.stripe_of(first);
    if stripe >= geo.stripes() {
        return Err(Raid6EntryError::OutOfRange {
            data_sector: entry.data_sector,
            stripes: geo.stripes(),
        });
    }
    let first_chunk = (within / u64::from(chunk)) as u16;
    let row_start = (within % u64::from(chunk)) as u32;
    if u64::from(first_chunk) + n > u64::from(dd) || row_start + row_bytes > chunk {
        return Err(Raid6EntryError::CrossesStripe {
            data_sector: entry.data_sector,
        });
    }
    let block_bytes = if row_start.is_multiple_of(BLOCK_4K) && row_bytes.is_multiple_of(BLOCK_4K) {
        BLOCK_4K
    } else {
        BLOCK_512
    };
    Ok(Raid6Entry {
        stripe,
        first_chunk,
        chunks: n as u16,
        row_start,
        row_bytes,
        block_bytes,
    })
}

/// One entry of a member's newest record, loaded.
struct Loaded {
    entry: PplEntry,
    /// The decoded entry, or `None` when refused (a mismatch, counted; never paired).
    decoded: Option<Raid6Entry>,
    /// The partial parity when it verified (`None`: checksum mismatch, unreadable, or a
    /// full-stripe entry, which carries none).
    pp: Option<AlignedBuf>,
    /// Whether its pp verified (or it has none to verify).
    pp_ok: bool,
    /// Already recovered or settled (as itself or as its partner's partner).
    done: bool,
}

/// Members with a loaded log: `None` for a missing member or a log without a valid record.
type Logs = Vec<Option<Vec<Loaded>>>;

impl Loaded {
    /// Whether this entry is the not yet recovered partner of `e` (same `data_sector`,
    /// `pp_size`, `data_size`; ferroraid RAID6 extension, docs/FORMAT.md).
    fn pairs_with(&self, e: &PplEntry) -> bool {
        !self.done
            && self.decoded.is_some()
            && self.entry.data_sector == e.data_sector
            && self.entry.pp_size == e.pp_size
            && self.entry.data_size == e.data_size
    }
}

/// Entry `i` of member `m`'s loaded log.
fn loaded(logs: &Logs, m: usize, i: usize) -> &Loaded {
    &logs[m].as_ref().expect("a loaded log")[i]
}

/// [`loaded`], mutable.
fn loaded_mut(logs: &mut Logs, m: usize, i: usize) -> &mut Loaded {
    &mut logs[m].as_mut().expect("a loaded log")[i]
}

/// RAID6 recovery (see the module docs): [`super::recover`] for a geometry with two
/// parity chunks.
pub(super) fn recover(
    geo: &ArrayGeometry,
    layout: &PplLayout,
    uuid: &Uuid,
    present: &[bool],
    media: &mut impl PplMedia,
) -> Result<RecoveryReport, RecoverError> {
    let mut rep = RecoveryReport::default();
    let members = usize::from(geo.geometry().members());
    let is_present = |m: u16| present.get(usize::from(m)).copied().unwrap_or(false);
    let mut logs: Logs = Vec::with_capacity(members);
    for m in 0..members as u16 {
        logs.push(if is_present(m) {
            load_log(geo, layout, uuid, m, media, &mut rep)?
        } else {
            None
        });
    }
    let mut written = vec![false; members];
    let mut skipped_stripes = BTreeSet::new();
    let parity = Parity::new().streaming(false);
    for l in 0..members {
        for i in 0..logs[l].as_ref().map_or(0, Vec::len) {
            let (entry, d) = match loaded(&logs, l, i) {
                Loaded {
                    done: false,
                    decoded: Some(d),
                    entry,
                    ..
                } => (*entry, *d),
                _ => continue,
            };
            let st = geo.stripe(d.stripe);
            let (pm, qm) = (st.p_member(), st.q_member().expect("RAID6 has Q"));
            let other = usize::from(if l == usize::from(pm) { qm } else { pm });
            // The partner, in the newest record of the other parity member; none to look
            // for when that member is missing or its log unreadable (a mismatch already):
            // single recovery.
            let partner = match &logs[other] {
                None => None,
                Some(es) => match es.iter().position(|p| p.pairs_with(&entry)) {
                    Some(j) => Some(j),
                    None => {
                        // The other log's newest record does not hold the write: the rows
                        // are consistent on media.
                        rep.entries_settled += 1;
                        loaded_mut(&mut logs, l, i).done = true;
                        continue;
                    }
                },
            };
            let own = loaded(&logs, l, i);
            let part = partner.map(|j| loaded(&logs, other, j));
            let (own_pp, part_pp) = (own.pp.as_deref(), part.and_then(|p| p.pp.as_deref()));
            let unit = Unit {
                d,
                st,
                pp_p: if l == usize::from(pm) {
                    own_pp
                } else {
                    part_pp
                },
                pp_q: if l == usize::from(pm) {
                    part_pp
                } else {
                    own_pp
                },
            };
            let done = replay(&unit, geo, layout, &is_present, &parity, media, &mut rep)?;
            if done.parity {
                rep.entries += u32::from(own.pp_ok) + part.map_or(0, |p| u32::from(p.pp_ok));
                rep.entries_paired += if part.is_some() { 2 } else { 0 };
                for m in [pm, qm] {
                    written[usize::from(m)] |= is_present(m);
                }
            }
            if done.skipped {
                skipped_stripes.insert(d.stripe);
            }
            loaded_mut(&mut logs, l, i).done = true;
            if let Some(j) = partner {
                loaded_mut(&mut logs, other, j).done = true;
            }
        }
    }
    rep.stripes_skipped += skipped_stripes.len() as u64;
    for (m, _) in written.iter().enumerate().filter(|(_, &w)| w) {
        media.flush(m as u16).map_err(|error| RecoverError::Io {
            member: m as u16,
            error,
        })?;
    }
    Ok(rep)
}

/// Reads member `m`'s newest record and its entries' partial parity; counts the log, the
/// record and the mismatches (no valid record, a partial parity past the area or failing
/// its checksum, a refused entry). `None` when the log has no valid record.
fn load_log(
    geo: &ArrayGeometry,
    layout: &PplLayout,
    uuid: &Uuid,
    m: u16,
    media: &mut impl PplMedia,
    rep: &mut RecoveryReport,
) -> Result<Option<Vec<Loaded>>, RecoverError> {
    let io = |error: IoError| RecoverError::Io { member: m, error };
    rep.logs += 1;
    let scan = scan_area_with(layout.area_bytes / 512, uuid, |off, block| {
        media.read(m, layout.area_offset_bytes + off * 512, block)
    })
    .map_err(io)?;
    let Some(rec) = scan.newest else {
        rep.mismatches += 1;
        return Ok(None);
    };
    rep.records += u32::from(!rec.header.entries.is_empty());
    let area_end = layout.area_offset_bytes + layout.area_bytes;
    let mut pp_at = layout.area_offset_bytes + (rec.offset_sectors + PPL_HEADER_SECTORS) * 512;
    let mut past_end = false;
    let mut out = Vec::with_capacity(rec.header.entries.len());
    for e in &rec.header.entries {
        let at = pp_at;
        pp_at += u64::from(e.pp_size >> 9) * 512;
        if pp_at > area_end && !past_end {
            // As md's RAID5 recovery: one mismatch; the entries' rows are still known from
            // the (checksummed) header, their partial parity is not.
            past_end = true;
            rep.mismatches += 1;
        }
        let decoded = decode_entry(e, geo)
            .and_then(|d| check_log_member(e, geo.stripe(d.stripe), m).map(|()| d));
        let mut pp = None;
        let mut pp_ok = false;
        if decoded.is_err() {
            // Never paired nor replayed: its partial parity is not read.
            rep.mismatches += 1;
        } else if e.pp_size == 0 {
            pp_ok = e.pp_matches(&[]);
        } else if !past_end {
            let mut buf = AlignedBuf::zeroed(e.pp_size as usize);
            media.read(m, at, &mut buf).map_err(io)?;
            pp_ok = e.pp_matches(&buf);
            pp = pp_ok.then_some(buf);
        }
        if decoded.is_ok() && !pp_ok && !past_end {
            rep.mismatches += 1;
        }
        out.push(Loaded {
            entry: *e,
            decoded: decoded.ok(),
            pp,
            pp_ok,
            done: false,
        });
    }
    Ok(Some(out))
}

/// The log member must be the entry's `parity_disk` and P or Q of its stripe.
fn check_log_member(e: &PplEntry, st: StripeLayout, m: u16) -> Result<(), Raid6EntryError> {
    if e.parity_disk != u32::from(m) {
        return Err(Raid6EntryError::ParityDisk {
            parity_disk: e.parity_disk,
            log_member: m,
        });
    }
    match st.role(m) {
        Role::P | Role::Q => Ok(()),
        Role::Data { .. } => Err(Raid6EntryError::NotParity {
            stripe: st.stripe(),
            log_member: m,
        }),
    }
}

/// One recovery: an entry (single) or a pair (joint), with the partials available.
struct Unit<'a> {
    d: Raid6Entry,
    st: StripeLayout,
    /// Partial P, `row_bytes` long, when known.
    pp_p: Option<&'a [u8]>,
    /// Partial Q, likewise.
    pp_q: Option<&'a [u8]>,
}

/// What [`replay`] did.
struct Replayed {
    /// P/Q were written to the present parity members.
    parity: bool,
    /// A modified chunk's member is missing (rows counted in `rows_skipped`).
    skipped: bool,
}

/// Steps 1–3 of the module docs over the unit's rows; counts rows in `rep`.
#[allow(clippy::too_many_arguments)]
fn replay(
    u: &Unit<'_>,
    geo: &ArrayGeometry,
    layout: &PplLayout,
    is_present: &impl Fn(u16) -> bool,
    parity: &Parity,
    media: &mut impl PplMedia,
    rep: &mut RecoveryReport,
) -> Result<Replayed, RecoverError> {
    let d = &u.d;
    let st = &u.st;
    let nd = usize::from(st.data_chunks());
    let len = d.row_bytes as usize;
    let (pm, qm) = (st.p_member(), st.q_member().expect("RAID6 has Q"));
    let chunk = u64::from(geo.geometry().chunk_bytes());
    let off = layout.data_offset_bytes + d.stripe * chunk + u64::from(d.row_start);
    let io = |member: u16| move |error: IoError| RecoverError::Io { member, error };

    // Erasures of each step (ChunkIds by Q slot).
    let mut lost_u: ArrayVec<ChunkId, MAX_DATA_CHUNKS> = ArrayVec::new();
    let mut lost_m: ArrayVec<ChunkId, MAX_DATA_CHUNKS> = ArrayVec::new();
    for k in 0..st.data_chunks() {
        if !is_present(st.data_member(k)) {
            let id = ChunkId::Data(st.q_slot(k) as u8);
            if d.modifies(k) {
                lost_m.push(id);
            } else {
                lost_u.push(id);
            }
        }
    }
    let mut lost_partial: ArrayVec<ChunkId, 2> = ArrayVec::new();
    if u.pp_p.is_none() {
        lost_partial.push(ChunkId::P);
    }
    if u.pp_q.is_none() {
        lost_partial.push(ChunkId::Q);
    }
    let mut lost_pq: ArrayVec<ChunkId, 2> = ArrayVec::new();
    if !is_present(pm) {
        lost_pq.push(ChunkId::P);
    }
    if !is_present(qm) {
        lost_pq.push(ChunkId::Q);
    }
    let rows = d.rows();
    if (!lost_u.is_empty() && lost_u.len() + lost_partial.len() > 2)
        || (!lost_m.is_empty() && lost_m.len() + lost_pq.len() > 2)
    {
        // More erasures than P and Q can solve: the rows are left alone.
        rep.mismatches += 1;
        rep.rows_unrecoverable += rows;
        return Ok(Replayed {
            parity: false,
            skipped: false,
        });
    }

    // The row rectangle of every data chunk (slot order), then P and Q.
    let mut buf = AlignedBuf::zeroed((nd + 2) * len);
    let (data, pq) = buf.split_at_mut(nd * len);
    let (p, q) = pq.split_at_mut(len);
    for k in 0..st.data_chunks() {
        let m = st.data_member(k);
        if is_present(m) {
            let s = usize::from(st.q_slot(k));
            media
                .read(m, off, &mut data[s * len..(s + 1) * len])
                .map_err(io(m))?;
        }
    }

    // 1. Missing unmodified chunks, from the partial(s) over a virtual stripe.
    if !lost_u.is_empty() {
        let mut vbuf = AlignedBuf::zeroed((nd + 2) * len);
        let (vdata, vpq) = vbuf.split_at_mut(nd * len);
        let (vp, vq) = vpq.split_at_mut(len);
        for k in 0..st.data_chunks() {
            let s = usize::from(st.q_slot(k));
            if !d.modifies(k) {
                vdata[s * len..(s + 1) * len].copy_from_slice(&data[s * len..(s + 1) * len]);
            }
        }
        if let Some(pp) = u.pp_p {
            vp.copy_from_slice(pp);
        }
        if let Some(pp) = u.pp_q {
            vq.copy_from_slice(pp);
        }
        let mut lost = lost_u.clone();
        lost.extend(lost_partial.iter().copied());
        let mut slices: ArrayVec<&mut [u8], MAX_DATA_CHUNKS> =
            vdata.chunks_exact_mut(len).collect();
        parity
            .reconstruct(&mut slices, vp, Some(vq), &lost)
            .expect("erasures checked above");
        for id in &lost_u {
            let ChunkId::Data(s) = *id else { continue };
            let s = usize::from(s);
            data[s * len..(s + 1) * len].copy_from_slice(&slices[s][..]);
        }
    }

    // 2. Missing modified chunks: what the on-disk P and Q imply.
    let skipped = !lost_m.is_empty();
    if skipped {
        if is_present(pm) {
            media.read(pm, off, p).map_err(io(pm))?;
        }
        if is_present(qm) {
            media.read(qm, off, q).map_err(io(qm))?;
        }
        let mut lost = lost_m.clone();
        lost.extend(lost_pq.iter().copied());
        let mut slices: ArrayVec<&mut [u8], MAX_DATA_CHUNKS> = data.chunks_exact_mut(len).collect();
        parity
            .reconstruct(&mut slices, p, Some(q), &lost)
            .expect("erasures checked above");
        rep.rows_skipped += rows;
    }

    // 3. P and Q of the whole row, to the present parity members.
    let slices: ArrayVec<&[u8], MAX_DATA_CHUNKS> = data.chunks_exact(len).collect();
    parity.gen_pq(&slices, p, q);
    for (m, b) in [(pm, &*p), (qm, &*q)] {
        if is_present(m) {
            media.write(m, off, b).map_err(io(m))?;
        }
    }
    rep.rows_repaired += rows;
    Ok(Replayed {
        parity: true,
        skipped,
    })
}
