//! md's Partial Parity Log (PPL): the on-disk record format, the scan that finds a
//! member's newest record, and the plan of the parity repairs a record calls for.
//!
//! Bit-compatible with Linux md (`drivers/md/raid5-ppl.c`) and mdadm (`super1.c`,
//! `write_init_ppl1`). Pure: no I/O. The caller reads a member's PPL area (or gives a
//! read callback) and performs the reads and writes a [`RecoveryPlan`] lists.
//! `docs/FORMAT.md` ("Partial Parity Log") describes the format with its sources.
//!
//! - **Area.** Each member holds one PPL area at `super_offset + ppl.offset` (signed
//!   sectors, [`super::Superblock::ppl`]) of `ppl.size` sectors; mdadm puts it
//!   [`MDADM_PPL_OFFSET_SECTORS`] after a v1.2 superblock, [`MDADM_PPL_SIZE_SECTORS`] long.
//!   The kernel trims the size to a header plus whole 4 KiB pages ([`usable_area_sectors`])
//!   and logs one record at a time at the area start (single-PPL) or records back to back
//!   (multi-PPL, [`PplMode::of`]).
//! - **Record.** A 4096-byte [`PplHeader`] (`struct ppl_header`, `md_p.h`) followed by the
//!   partial parity (PP) of its entries, back to back, `pp_size` bytes each.
//! - **Scan.** [`scan_area`] / [`scan_area_with`] walk the records as
//!   `ppl_load_distributed` does and return the newest valid one.
//! - **Recovery.** [`plan_recovery`] lists, for one entry, the rows whose parity
//!   `ppl_recover_entry` rewrites, the blocks it XORs, and the rows it skips.
//!
//! **Units.** `_sectors`: 512-byte sectors (md's unit whatever the device block size);
//! `_bytes`: bytes. Entry fields keep md's units: `data_sector` in 512-byte sectors
//! (native md metadata, `ppl_conf->block_size` = 512), `pp_size` and `data_size` in bytes.
//!
//! Line numbers below refer to Linux v6.1 (`raid5-ppl.c`, `md_p.h`, `md.c`) as in
//! `research/md-batching-and-ppl.md`; function names are the stable reference.

use thiserror::Error;

use super::superblock::{le32, le64};
use super::Uuid;
use crate::geometry::{ArrayGeometry, Level};

/// Size of a PPL header, bytes (`PPL_HEADER_SIZE`, `md_p.h`): one 4 KiB page.
pub const PPL_HEADER_SIZE: usize = 4096;
/// Size of a PPL header, 512-byte sectors (`PPL_HEADER_SIZE >> 9`).
pub const PPL_HEADER_SECTORS: u64 = (PPL_HEADER_SIZE / 512) as u64;
/// Bytes of 0xFF at the start of a header (`PPL_HDR_RESERVED`, `md_p.h`; filled by
/// `ppl_new_iounit` / `write_init_ppl1`).
pub const PPL_HDR_RESERVED: usize = 512;
/// Size of one `struct ppl_header_entry`, bytes (`md_p.h`, packed).
pub const PPL_ENTRY_SIZE: usize = 24;
/// Bytes available for entries: `PPL_HEADER_SIZE - PPL_HDR_RESERVED - 4*4 - 8` = 3560
/// (`PPL_HDR_ENTRY_SPACE`, `md_p.h`).
pub const PPL_HDR_ENTRY_SPACE: usize = PPL_HEADER_SIZE - PPL_HDR_RESERVED - 4 * 4 - 8;
/// Most entries in one header: 3560 / 24 = 148 (`PPL_HDR_MAX_ENTRIES`, `md_p.h`).
pub const PPL_HDR_MAX_ENTRIES: usize = PPL_HDR_ENTRY_SPACE / PPL_ENTRY_SIZE;
/// Most partial-parity bytes of one record in multi-PPL mode: 128 KiB (`PPL_SPACE_SIZE`,
/// `raid5-ppl.c`; `ppl_init_child_log` sets `entry_space` to it).
pub const PPL_SPACE_SIZE: usize = 128 << 10;
/// Smallest (trimmed) area, sectors, logged in multi-PPL mode: room for two records of
/// a header and [`PPL_SPACE_SIZE`], `2 × (128 KiB + 4 KiB) / 512` = 528
/// (`ppl_init_child_log`: `ppl.size << 9 >= (PPL_SPACE_SIZE + PPL_HEADER_SIZE) * 2`).
pub const MULTIPLE_PPL_MIN_SECTORS: u64 = (2 * (PPL_SPACE_SIZE + PPL_HEADER_SIZE) / 512) as u64;
/// Where mdadm puts the PPL area of a v1.1/v1.2 member: sectors after the superblock
/// (`write_init_super1`, super1.c: `sb->ppl.offset = 8`; 4 KiB for the superblock).
pub const MDADM_PPL_OFFSET_SECTORS: i16 = 8;
/// Size of the PPL area mdadm creates, sectors: 1 MiB
/// (`MULTIPLE_PPL_AREA_SIZE_SUPER1 >> 9`, super1.c).
pub const MDADM_PPL_SIZE_SECTORS: u16 = 2048;
/// The header's byte offset of `signature` (then `padding`, zero, at 0x204).
const OFF_SIGNATURE: usize = 0x200;
/// `generation`.
const OFF_GENERATION: usize = 0x208;
/// `entries_count`.
const OFF_ENTRIES_COUNT: usize = 0x210;
/// `checksum`.
const OFF_CHECKSUM: usize = 0x214;
/// `entries[0]`.
const OFF_ENTRIES: usize = 0x218;
/// One 4 KiB row of a stripe, sectors (`STRIPE_SECTORS`, raid5.h).
const STRIPE_SECTORS: u64 = 8;

const _: () = assert!(PPL_HDR_ENTRY_SPACE == 3560);
const _: () = assert!(PPL_HDR_MAX_ENTRIES == 148);
const _: () = assert!(OFF_ENTRIES + PPL_HDR_MAX_ENTRIES * PPL_ENTRY_SIZE == 4088);
const _: () = assert!(MULTIPLE_PPL_MIN_SECTORS == 528);

/// The PPL signature of an array with native md metadata: the standard CRC-32C (the
/// Castagnoli polynomial, initial value and final XOR `0xFFFFFFFF`; `crc32c("123456789")`
/// = `0xE3069283`) of the 16 bytes of `set_uuid`.
///
/// The kernel writes it as `~crc32c_le(~0, mddev->uuid, 16)` (`ppl_init_log`,
/// raid5-ppl.c:1402) and mdadm as `~crc32c_le(~0, sb->set_uuid, 16)` (`write_init_ppl1`);
/// `crc32c_le` is the raw, un-inverted CRC, so the stored value is exactly the standard
/// CRC-32C, with no further inversion.
pub fn signature(set_uuid: &Uuid) -> u32 {
    crate::checksum::crc32c(set_uuid.as_bytes())
}

/// The checksum an entry stores for its partial parity: the standard CRC-32C of the
/// entry's `pp_size` bytes (`ppl_log_stripe` starts from `~0` and accumulates
/// `crc32c_le` page by page, `ppl_submit_iounit` inverts; `ppl_recover` checks it the
/// same way). Empty partial parity (a full-stripe entry) gives 0.
pub fn pp_checksum(pp: &[u8]) -> u32 {
    crate::checksum::crc32c(pp)
}

/// The header checksum of a 4096-byte header block: the standard CRC-32C of the block
/// with its `checksum` field (bytes 0x214..0x218) taken as zero
/// (`ppl_submit_iounit`, `ppl_load_distributed`, `write_init_ppl1`).
pub fn header_checksum(block: &[u8; PPL_HEADER_SIZE]) -> u32 {
    use crate::checksum::{crc32c, crc32c_append};
    let crc = crc32c(&block[..OFF_CHECKSUM]);
    let crc = crc32c_append(crc, &[0; 4]);
    crc32c_append(crc, &block[OFF_CHECKSUM + 4..])
}

/// One `struct ppl_header_entry` (24 bytes, little-endian, `md_p.h`): one or more
/// consecutive 4 KiB rows of one stripe that write the same data members.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub struct PplEntry {
    /// Array (logical) address of the first modified data sector, 512-byte sectors
    /// (native md: `ppl_conf->block_size` 512; `ppl_submit_iounit` shifts by
    /// `ilog2(block_size >> 9)`, i.e. by 0).
    pub data_sector: u64,
    /// Bytes of partial parity the entry carries: one 4 KiB page per row, 0 for a
    /// full-stripe write (`ppl_log_stripe`).
    pub pp_size: u32,
    /// Bytes of modified data: rows × modified data members × 4 KiB (`ppl_log_stripe`).
    pub data_size: u32,
    /// Role (raid-disk index) of the stripe's parity member: the member whose PPL area
    /// holds the record (`ppl_log_stripe`: `sh->pd_idx`).
    pub parity_disk: u32,
    /// CRC-32C of the entry's partial parity ([`pp_checksum`]); 0 when `pp_size` is 0.
    pub checksum: u32,
}

impl PplEntry {
    /// The 24 on-disk bytes.
    pub fn to_bytes(&self) -> [u8; PPL_ENTRY_SIZE] {
        let mut b = [0u8; PPL_ENTRY_SIZE];
        b[0..8].copy_from_slice(&self.data_sector.to_le_bytes());
        b[8..12].copy_from_slice(&self.pp_size.to_le_bytes());
        b[12..16].copy_from_slice(&self.data_size.to_le_bytes());
        b[16..20].copy_from_slice(&self.parity_disk.to_le_bytes());
        b[20..24].copy_from_slice(&self.checksum.to_le_bytes());
        b
    }

    /// An entry from its 24 on-disk bytes.
    pub fn from_bytes(b: &[u8; PPL_ENTRY_SIZE]) -> Self {
        PplEntry {
            data_sector: le64(b, 0),
            pp_size: le32(b, 8),
            data_size: le32(b, 12),
            parity_disk: le32(b, 16),
            checksum: le32(b, 20),
        }
    }

    /// Whether `pp` (the entry's `pp_size` bytes) matches the stored checksum, as
    /// `ppl_recover` checks before recovering the entry (a mismatch skips the entry and
    /// counts a mismatch).
    pub fn pp_matches(&self, pp: &[u8]) -> bool {
        pp.len() as u64 == u64::from(self.pp_size) && pp_checksum(pp) == self.checksum
    }
}

/// A decoded `struct ppl_header` (`md_p.h`): one PPL record's 4096-byte header.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct PplHeader {
    /// Array identifier: [`signature`] of the set UUID for native metadata.
    pub signature: u32,
    /// Sequence number of the record (`io->seq`: 1, 2, 3 … per assembly; 0 in the empty
    /// header written at creation and array start).
    pub generation: u64,
    /// The used entries, at most [`PPL_HDR_MAX_ENTRIES`].
    pub entries: Vec<PplEntry>,
}

/// Why a 4096-byte block is not a valid PPL header.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PplError {
    /// The block is not 4096 bytes long.
    #[error("PPL header must be {PPL_HEADER_SIZE} bytes, got {len}")]
    HeaderLength {
        /// Bytes given.
        len: usize,
    },
    /// The stored header checksum does not match the block.
    #[error(
        "PPL header checksum mismatch: stored 0x{stored:08x}, computed 0x{computed:08x} \
         (crc32c of the 4096-byte header with the checksum field zeroed)"
    )]
    Checksum {
        /// `checksum` as stored.
        stored: u32,
        /// CRC-32C of the block.
        computed: u32,
    },
    /// `entries_count` exceeds the 148 slots of a header.
    #[error("PPL header entries_count {count} exceeds the header's {PPL_HDR_MAX_ENTRIES} slots")]
    EntryCount {
        /// `entries_count` as stored.
        count: u32,
    },
    /// The header was written for another array.
    #[error("PPL header signature 0x{found:08x} is not this array's 0x{expected:08x}")]
    Signature {
        /// Stored signature.
        found: u32,
        /// [`signature`] of the array's UUID.
        expected: u32,
    },
    /// More entries than a header holds were given to [`PplHeader::encode`].
    #[error("a PPL header holds at most {PPL_HDR_MAX_ENTRIES} entries, got {count}")]
    TooManyEntries {
        /// Entries given.
        count: usize,
    },
}

impl PplHeader {
    /// The empty header md writes at array creation (`write_init_ppl1`, super1.c) and at
    /// every array start (`ppl_write_empty_header`, raid5-ppl.c:1041): the array's
    /// signature, generation 0, no entries.
    pub fn empty(set_uuid: &Uuid) -> Self {
        PplHeader {
            signature: signature(set_uuid),
            generation: 0,
            entries: Vec::new(),
        }
    }

    /// Encodes the header into a 4096-byte block: 512 bytes of 0xFF, the fields, the used
    /// entries first and the unused slots (and the 8 trailing bytes) zero, then the
    /// checksum ([`header_checksum`]) — `ppl_new_iounit` + `ppl_submit_iounit`.
    ///
    /// # Errors
    /// [`PplError::TooManyEntries`] beyond [`PPL_HDR_MAX_ENTRIES`] entries.
    pub fn encode(&self) -> Result<[u8; PPL_HEADER_SIZE], PplError> {
        let mut b = [0u8; PPL_HEADER_SIZE];
        self.encode_into(&mut b)?;
        Ok(b)
    }

    /// [`Self::encode`] into `b` (every byte of it written): for the write path, which
    /// encodes straight into a record's buffer.
    ///
    /// # Errors
    /// [`PplError::TooManyEntries`] beyond [`PPL_HDR_MAX_ENTRIES`] entries (`b` untouched).
    pub fn encode_into(&self, b: &mut [u8; PPL_HEADER_SIZE]) -> Result<(), PplError> {
        if self.entries.len() > PPL_HDR_MAX_ENTRIES {
            return Err(PplError::TooManyEntries {
                count: self.entries.len(),
            });
        }
        b[PPL_HDR_RESERVED..].fill(0);
        b[..PPL_HDR_RESERVED].fill(0xff);
        b[OFF_SIGNATURE..OFF_SIGNATURE + 4].copy_from_slice(&self.signature.to_le_bytes());
        b[OFF_GENERATION..OFF_GENERATION + 8].copy_from_slice(&self.generation.to_le_bytes());
        b[OFF_ENTRIES_COUNT..OFF_ENTRIES_COUNT + 4]
            .copy_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for (i, e) in self.entries.iter().enumerate() {
            let at = OFF_ENTRIES + i * PPL_ENTRY_SIZE;
            b[at..at + PPL_ENTRY_SIZE].copy_from_slice(&e.to_bytes());
        }
        let c = header_checksum(b);
        b[OFF_CHECKSUM..OFF_CHECKSUM + 4].copy_from_slice(&c.to_le_bytes());
        Ok(())
    }

    /// Decodes a header block, checking what `ppl_load_distributed` checks of every header
    /// (its checksum) and that `entries_count` fits the header — the kernel trusts a
    /// checksummed count and would read past its page beyond 148; this refuses it.
    ///
    /// The reserved bytes, `padding`, unused slots and the signature are not checked
    /// (the kernel does not check them either; [`PplHeader::decode_for`] checks the
    /// signature). Never panics.
    ///
    /// # Errors
    /// [`PplError::HeaderLength`], [`PplError::Checksum`], [`PplError::EntryCount`].
    pub fn decode(block: &[u8]) -> Result<Self, PplError> {
        let b: &[u8; PPL_HEADER_SIZE] = block
            .try_into()
            .map_err(|_| PplError::HeaderLength { len: block.len() })?;
        let stored = le32(b, OFF_CHECKSUM);
        let computed = header_checksum(b);
        if stored != computed {
            return Err(PplError::Checksum { stored, computed });
        }
        let count = le32(b, OFF_ENTRIES_COUNT);
        if count as usize > PPL_HDR_MAX_ENTRIES {
            return Err(PplError::EntryCount { count });
        }
        let entries = (0..count as usize)
            .map(|i| {
                let at = OFF_ENTRIES + i * PPL_ENTRY_SIZE;
                let mut e = [0u8; PPL_ENTRY_SIZE];
                e.copy_from_slice(&b[at..at + PPL_ENTRY_SIZE]);
                PplEntry::from_bytes(&e)
            })
            .collect();
        Ok(PplHeader {
            signature: le32(b, OFF_SIGNATURE),
            generation: le64(b, OFF_GENERATION),
            entries,
        })
    }

    /// [`PplHeader::decode`], then the native-metadata signature check of
    /// `ppl_load_distributed` (the signature must be [`signature`]`(set_uuid)`).
    ///
    /// # Errors
    /// Those of [`PplHeader::decode`] and [`PplError::Signature`].
    pub fn decode_for(block: &[u8], set_uuid: &Uuid) -> Result<Self, PplError> {
        let h = Self::decode(block)?;
        let expected = signature(set_uuid);
        if h.signature != expected {
            return Err(PplError::Signature {
                found: h.signature,
                expected,
            });
        }
        Ok(h)
    }

    /// Sectors the record takes: the header plus each entry's `pp_size >> 9`, summed as
    /// `ppl_load_distributed` advances to the next record (a `pp_size` that is not a
    /// whole number of sectors is rounded down per entry, as there).
    pub fn record_sectors(&self) -> u64 {
        PPL_HEADER_SECTORS
            + self
                .entries
                .iter()
                .map(|e| u64::from(e.pp_size >> 9))
                .sum::<u64>()
    }
}

/// The part of a configured area the kernel uses, sectors: the header plus the rest
/// rounded down to whole 4 KiB pages, or `None` when no page fits ("PPL space too
/// small", `ppl_validate_rdev`, raid5-ppl.c:1255, which then sets `ppl.size` to this).
pub fn usable_area_sectors(size_sectors: u16) -> Option<u64> {
    let data = u64::from(size_sectors).checked_sub(PPL_HEADER_SECTORS)?;
    let data = data - data % STRIPE_SECTORS;
    (data > 0).then_some(PPL_HEADER_SECTORS + data)
}

/// How md logs into an area (`ppl_init_child_log`, raid5-ppl.c:1302).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PplMode {
    /// Every record at the area start; a record's PP takes up to the area minus the
    /// header (`use_multippl` false, `entry_space = ppl.size*512 - 4096`).
    Single,
    /// Records back to back from the area start, each with at most [`PPL_SPACE_SIZE`] of
    /// PP, rewinding to the start when the next does not fit (`use_multippl`). The
    /// kernel then writes `MD_FEATURE_MULTIPLE_PPLS` in the superblock (`super_1_sync`).
    Multiple,
}

impl PplMode {
    /// The mode of an area of `usable_sectors` (after [`usable_area_sectors`]): multi-PPL
    /// from [`MULTIPLE_PPL_MIN_SECTORS`] (528) on.
    pub fn of(usable_sectors: u64) -> Self {
        if usable_sectors >= MULTIPLE_PPL_MIN_SECTORS {
            PplMode::Multiple
        } else {
            PplMode::Single
        }
    }

    /// Most PP bytes one record of this mode holds in an area of `usable_sectors`
    /// (`log->entry_space`).
    pub fn entry_space_bytes(self, usable_sectors: u64) -> u64 {
        match self {
            PplMode::Multiple => PPL_SPACE_SIZE as u64,
            PplMode::Single => (usable_sectors * 512).saturating_sub(PPL_HEADER_SIZE as u64),
        }
    }
}

impl std::fmt::Display for PplMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PplMode::Single => "single",
            PplMode::Multiple => "multiple",
        })
    }
}

/// A member's PPL area as its superblock places it, checked as md checks it
/// ([`super::Superblock::ppl_area`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PplArea {
    /// `ppl.offset`: signed sectors from the superblock to the area.
    pub offset_sectors: i16,
    /// `ppl.size`: the configured size, sectors.
    pub size_sectors: u16,
    /// Where the area starts on the member, sectors from the start of the device
    /// (`super_offset + ppl.offset`: md's `rdev->ppl.sector`, `super_1_load`).
    pub start_sector: u64,
    /// The part md uses, sectors ([`usable_area_sectors`]).
    pub usable_sectors: u64,
    /// How md logs into it ([`PplMode::of`] the usable size).
    pub mode: PplMode,
    /// Whether the superblock carries `MD_FEATURE_MULTIPLE_PPLS` (else `MD_FEATURE_PPL`).
    pub multiple_feature: bool,
}

/// A valid record found in an area.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PplRecord {
    /// Offset of the record's header from the area start, sectors. Its PP starts
    /// [`PPL_HEADER_SECTORS`] later (`ppl_recover`).
    pub offset_sectors: u64,
    /// The decoded header.
    pub header: PplHeader,
}

/// Why a scan stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScanEnd {
    /// The next header would not fit in the area (`pplhdr_offset >= ppl.size - 8`).
    EndOfArea,
    /// The header at `offset_sectors` is not valid: bad checksum or entry count (a torn
    /// or never-written record; [`PplError`]).
    Invalid {
        /// Offset of the header, sectors from the area start.
        offset_sectors: u64,
        /// What is wrong.
        error: PplError,
    },
    /// The header at `offset_sectors` has another array's signature.
    Signature {
        /// Offset of the header, sectors from the area start.
        offset_sectors: u64,
        /// The stored signature.
        found: u32,
    },
    /// The header at `offset_sectors` is older than the one before it: the log rewound
    /// there and the previous record is the newest.
    Older {
        /// Offset of the header, sectors from the area start.
        offset_sectors: u64,
        /// Its generation.
        generation: u64,
    },
}

/// The outcome of scanning one member's PPL area.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AreaScan {
    /// The newest valid record, or `None` (no valid header at the area start: md counts a
    /// mismatch and, if the array is dirty, resyncs it).
    pub newest: Option<PplRecord>,
    /// Valid records walked through (the newest included).
    pub records_seen: u32,
    /// Why the walk stopped.
    pub end: ScanEnd,
}

/// Walks an area's records as `ppl_load_distributed` (raid5-ppl.c:1074) does, reading
/// each 4096-byte header through `read(offset_sectors, block)` (offset from the area
/// start). `usable_sectors` is the area size after [`usable_area_sectors`].
///
/// From offset 0, while a header fits (`offset < usable_sectors - 8`): a header with a
/// bad checksum (or an entry count above 148) or the wrong signature ends the walk; one
/// whose generation is *lower* than the previous record's ends it too (the log rewound;
/// equal generations go on); otherwise it becomes the newest and the walk moves on by
/// [`PplHeader::record_sectors`]. The mode ([`PplMode`]) does not change the walk: in a
/// single-PPL area the second "header" is PP data or zeros and fails its checksum.
/// At most `usable_sectors / 8` headers are read (each record is at least 8 sectors).
///
/// # Errors
/// The first error of `read`: md then fails the member and recovers nothing from it.
pub fn scan_area_with<E>(
    usable_sectors: u64,
    set_uuid: &Uuid,
    mut read: impl FnMut(u64, &mut [u8; PPL_HEADER_SIZE]) -> Result<(), E>,
) -> Result<AreaScan, E> {
    let expected = signature(set_uuid);
    let mut newest: Option<PplRecord> = None;
    let mut seen = 0u32;
    let mut offset = 0u64;
    let mut block = [0u8; PPL_HEADER_SIZE];
    let end = loop {
        if offset >= usable_sectors.saturating_sub(PPL_HEADER_SECTORS) {
            break ScanEnd::EndOfArea;
        }
        read(offset, &mut block)?;
        let header = match PplHeader::decode(&block) {
            Ok(h) => h,
            Err(error) => {
                break ScanEnd::Invalid {
                    offset_sectors: offset,
                    error,
                }
            }
        };
        if header.signature != expected {
            break ScanEnd::Signature {
                offset_sectors: offset,
                found: header.signature,
            };
        }
        if let Some(prev) = &newest {
            if prev.header.generation > header.generation {
                break ScanEnd::Older {
                    offset_sectors: offset,
                    generation: header.generation,
                };
            }
        }
        seen += 1;
        let next = offset + header.record_sectors();
        newest = Some(PplRecord {
            offset_sectors: offset,
            header,
        });
        offset = next;
    };
    Ok(AreaScan {
        newest,
        records_seen: seen,
        end,
    })
}

/// [`scan_area_with`] over an area already in memory (`area`: the area's bytes from its
/// start; at most `usable_sectors` of it are looked at). Bytes past the end of `area`
/// read as zero (an invalid header).
pub fn scan_area(area: &[u8], usable_sectors: u64, set_uuid: &Uuid) -> AreaScan {
    let r: Result<AreaScan, std::convert::Infallible> =
        scan_area_with(usable_sectors, set_uuid, |offset, block| {
            block.fill(0);
            let start = usize::try_from(offset.saturating_mul(512)).unwrap_or(usize::MAX);
            if let Some(src) = area.get(start..) {
                let n = src.len().min(PPL_HEADER_SIZE);
                block[..n].copy_from_slice(&src[..n]);
            }
            Ok(())
        });
    match r {
        Ok(s) => s,
        Err(never) => match never {},
    }
}

/// A block of a member, in a [`RecoveryPlan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemberBlock {
    /// Member (raid-disk role) index.
    pub member: u16,
    /// Byte offset within the member's data area (add md's `data_offset`).
    pub offset_bytes: u64,
}

/// One row whose parity `ppl_recover_entry` rewrites: `parity = PP ⊕ data[0] ⊕ …`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveryRow {
    /// Array sector of the row in the entry's first modified chunk
    /// (`r_sector_first + i`), 512-byte sectors.
    pub array_sector: u64,
    /// Byte offset of the row's PP within the entry's PP data (`i × 512`), or `None` for
    /// an entry without PP (`pp_size` 0: parity is the XOR of the data alone).
    pub pp_offset_bytes: Option<u64>,
    /// The modified data blocks to XOR, in md's order (`disk` 0, 1, …).
    pub data: Vec<MemberBlock>,
    /// Where the new parity goes (the log's own member).
    pub parity: MemberBlock,
}

/// A row `ppl_recover_entry` leaves alone because a modified data block's member is
/// missing (its parity cannot be recomputed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SkippedRow {
    /// Array sector of the row in the entry's first modified chunk, 512-byte sectors.
    pub array_sector: u64,
    /// The first missing member found (md stops looking there).
    pub missing: MemberBlock,
}

/// What recovering one entry takes: rows to repair and rows skipped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveryPlan {
    /// Size of every block of the plan, bytes: 4096 when the entry's first and last
    /// sectors are 4 KiB aligned, else 512 (`ppl_recover_entry`).
    pub block_bytes: u32,
    /// The rows to repair, in ascending order.
    pub rows: Vec<RecoveryRow>,
    /// The rows skipped for a missing member, in ascending order.
    pub skipped: Vec<SkippedRow>,
}

impl RecoveryPlan {
    /// A plan with no row (512-byte blocks).
    fn nothing() -> Self {
        RecoveryPlan {
            block_bytes: 512,
            rows: Vec::new(),
            skipped: Vec::new(),
        }
    }
}

/// Why an entry cannot be planned against a geometry.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RecoveryError {
    /// md's PPL is RAID5 only (`ppl_init_log`: "PPL is not compatible with raid level").
    #[error("md's PPL is RAID5 only; this array is {0}")]
    Level(Level),
    /// The entry reaches beyond the array.
    #[error(
        "PPL entry covers array sectors {first}..{last}, beyond the array's {capacity_sectors} \
         sectors"
    )]
    OutOfRange {
        /// First array sector (`r_sector_first`).
        first: u64,
        /// End array sector (`r_sector_last`, exclusive), saturated on overflow.
        last: u64,
        /// Array size, sectors.
        capacity_sectors: u64,
    },
    /// The entry names more modified data chunks than a stripe has
    /// (`data_size / pp_size`); md never writes such an entry and its recovery would XOR
    /// blocks of the next stripe.
    #[error(
        "PPL entry with data_size {data_size} and pp_size {pp_size} names {data_disks} data \
         chunks; a stripe has {data_chunks}"
    )]
    TooManyDataDisks {
        /// `data_size` of the entry.
        data_size: u32,
        /// `pp_size` of the entry.
        pp_size: u32,
        /// `data_size / pp_size`.
        data_disks: u64,
        /// Data chunks per stripe.
        data_chunks: u16,
    },
    /// A full-stripe entry (`pp_size` 0) longer than a chunk per data member; md never
    /// writes one (an entry stays within one chunk, `ppl_log_stripe`).
    #[error(
        "PPL full-stripe entry of {data_size} bytes spans {strip_sectors} sectors per member, \
         more than a chunk ({chunk_sectors} sectors)"
    )]
    StripTooLong {
        /// `data_size` of the entry.
        data_size: u32,
        /// `(data_size >> 9) / data_chunks`.
        strip_sectors: u64,
        /// Chunk size, sectors.
        chunk_sectors: u32,
    },
    /// The entry's modified range crosses a stripe boundary. md's entries describe rows of
    /// one stripe ("A PPL entry applies to a stripe", raid5-ppl.c); the kernel would XOR
    /// the next stripe's blocks into this stripe's parity.
    #[error(
        "PPL entry covers array sectors {first}..{last}, which cross a stripe boundary \
         (stripes of {stripe_sectors} sectors)"
    )]
    CrossesStripe {
        /// First array sector (`r_sector_first`).
        first: u64,
        /// End array sector (`r_sector_last`, exclusive).
        last: u64,
        /// Data sectors per stripe.
        stripe_sectors: u64,
    },
    /// The row's parity member is not the entry's `parity_disk`: the kernel asserts this
    /// (`BUG_ON(sh.pd_idx != le32_to_cpu(e->parity_disk))`, `ppl_recover_entry`).
    #[error(
        "PPL entry names parity disk {parity_disk} but array sector {array_sector} has its \
         parity on member {p_member} (md: BUG_ON in ppl_recover_entry)"
    )]
    ParityDisk {
        /// Array sector of the row.
        array_sector: u64,
        /// The entry's `parity_disk`.
        parity_disk: u32,
        /// The row's parity member by the layout.
        p_member: u16,
    },
    /// The entry was read from another member's log than its parity member: the kernel
    /// asserts the parity rdev is the log's (`BUG_ON(parity_rdev->bdev->bd_dev !=
    /// log->rdev->bdev->bd_dev)`, `ppl_recover_entry`).
    #[error(
        "PPL entry for parity member {p_member} found in the log of member {log_member} \
         (md: BUG_ON in ppl_recover_entry)"
    )]
    WrongLog {
        /// The row's parity member.
        p_member: u16,
        /// The member whose area held the entry.
        log_member: u16,
    },
}

/// Plans the recovery of `entry`, read from the PPL area of member `log_member`, as
/// `ppl_recover_entry` (raid5-ppl.c:786) performs it, for native metadata (block size
/// 512). `missing(member, offset_bytes)` says whether the block of a member at that
/// data-area offset cannot be read: md's `!rdev || (!In_sync && sector >=
/// recovery_offset)`.
///
/// With `DD` data chunks per stripe, `first = data_sector`:
/// - `pp_size < chunk` and `pp_size > 0` (cases 0, 1): `n = data_size / pp_size`
///   modified chunks, `strip = pp_size >> 9` sectors each;
/// - `pp_size == 0` (case 2, full stripe): `n = DD`, `strip = (data_size >> 9) / DD`;
/// - in both, `last = first + (n-1)·chunk + strip`;
/// - `pp_size >= chunk` (cases 3, 4, other implementations): `n = DD`, `strip = chunk`,
///   `last = first + (data_size >> 9)`.
///
/// Blocks are 4 KiB when `first` and `last` are 4 KiB aligned, else 512 bytes. For each
/// block offset `i` in `0..strip`, the data blocks are `first + i + d·chunk` for `d` in
/// `0..n` that lie below `last`; a row with none is left alone, a row where one of them
/// is missing is skipped (md stops at the first missing one), and otherwise the parity
/// of `first + i` is `PP[i] ⊕ data…`.
///
/// An entry md never writes but the kernel would process blindly is refused instead:
/// more modified chunks than a stripe has, a full-stripe strip longer than a chunk, or a
/// range (`first..last`) that crosses into the next stripe. An
/// entry with `data_size < pp_size` (no modified chunk, `n` = 0) plans nothing, as in md.
///
/// # Errors
/// [`RecoveryError::Level`] for RAID6; [`RecoveryError::OutOfRange`] when `last` is
/// beyond the array; [`RecoveryError::TooManyDataDisks`], [`RecoveryError::StripTooLong`],
/// [`RecoveryError::CrossesStripe`];
/// [`RecoveryError::ParityDisk`] and [`RecoveryError::WrongLog`] where the kernel asserts,
/// on a row it repairs.
pub fn plan_recovery(
    entry: &PplEntry,
    geometry: &ArrayGeometry,
    log_member: u16,
    mut missing: impl FnMut(u16, u64) -> bool,
) -> Result<RecoveryPlan, RecoveryError> {
    let g = geometry.geometry();
    if g.level() != Level::Raid5 {
        return Err(RecoveryError::Level(g.level()));
    }
    let chunk = u64::from(g.chunk_sectors());
    let dd = u64::from(g.data_chunks());
    let pp_size = u64::from(entry.pp_size);
    let data_size = u64::from(entry.data_size);
    let first = entry.data_sector;
    let capacity_sectors = geometry.capacity_bytes() / 512;
    let (n, strip, last) = if pp_size >> 9 < chunk {
        let (n, strip) = match data_size.checked_div(pp_size) {
            Some(n) => (n, pp_size >> 9),
            // pp_size 0: a full-stripe entry.
            None => (dd, (data_size >> 9) / dd),
        };
        if n > dd {
            return Err(RecoveryError::TooManyDataDisks {
                data_size: entry.data_size,
                pp_size: entry.pp_size,
                data_disks: n,
                data_chunks: g.data_chunks(),
            });
        }
        if strip > chunk {
            return Err(RecoveryError::StripTooLong {
                data_size: entry.data_size,
                strip_sectors: strip,
                chunk_sectors: g.chunk_sectors(),
            });
        }
        if n == 0 {
            // `data_size < pp_size`: md's inner loop never runs, nothing is written.
            return Ok(RecoveryPlan::nothing());
        }
        (n, strip, first.checked_add((n - 1) * chunk + strip))
    } else {
        (dd, chunk, first.checked_add(data_size >> 9))
    };
    let out_of_range = |last| RecoveryError::OutOfRange {
        first,
        last,
        capacity_sectors,
    };
    let last = last.ok_or_else(|| out_of_range(u64::MAX))?;
    if last <= first {
        // No block below `last` (a strip under one sector, or no data): md reads and
        // writes nothing.
        return Ok(RecoveryPlan::nothing());
    }
    if last > capacity_sectors {
        return Err(out_of_range(last));
    }
    let stripe_sectors = g.stripe_data_bytes() / 512;
    if first / stripe_sectors != (last - 1) / stripe_sectors {
        return Err(RecoveryError::CrossesStripe {
            first,
            last,
            stripe_sectors,
        });
    }
    let block_sectors =
        if first.is_multiple_of(STRIPE_SECTORS) && last.is_multiple_of(STRIPE_SECTORS) {
            STRIPE_SECTORS
        } else {
            1
        };
    let mut plan = RecoveryPlan {
        block_bytes: (block_sectors * 512) as u32,
        ..RecoveryPlan::nothing()
    };
    let map = |sector: u64| -> (u16, u16, u64) {
        // raid5_compute_sector: (data member, parity member, member byte offset).
        let (stripe, within) = geometry.stripe_of(sector * 512);
        let chunk_bytes = u64::from(g.chunk_bytes());
        let layout = geometry.stripe(stripe);
        let index = (within / chunk_bytes) as u16;
        let offset = stripe * chunk_bytes + within % chunk_bytes;
        (layout.data_member(index), layout.p_member(), offset)
    };
    let mut i = 0;
    while i < strip {
        let row = first + i;
        let mut data = Vec::new();
        let mut skipped = None;
        for d in 0..n {
            let r = row + d * chunk;
            if r >= last {
                continue;
            }
            let (member, _, offset_bytes) = map(r);
            let block = MemberBlock {
                member,
                offset_bytes,
            };
            if missing(member, offset_bytes) {
                skipped = Some(block);
                break;
            }
            data.push(block);
        }
        i += block_sectors;
        if let Some(missing) = skipped {
            plan.skipped.push(SkippedRow {
                array_sector: row,
                missing,
            });
            continue;
        }
        if data.is_empty() {
            continue;
        }
        let (_, p_member, offset_bytes) = map(row);
        if u32::from(p_member) != entry.parity_disk {
            return Err(RecoveryError::ParityDisk {
                array_sector: row,
                parity_disk: entry.parity_disk,
                p_member,
            });
        }
        if p_member != log_member {
            return Err(RecoveryError::WrongLog {
                p_member,
                log_member,
            });
        }
        plan.rows.push(RecoveryRow {
            array_sector: row,
            pp_offset_bytes: (pp_size > 0).then_some((row - first) * 512),
            data,
            parity: MemberBlock {
                member: p_member,
                offset_bytes,
            },
        });
    }
    Ok(plan)
}
