//! `struct mdp_superblock_1`: layout, decoding, encoding, checksum and what ferroraid accepts.
//!
//! On-disk layout (all integers little-endian; offsets in bytes from the start of the
//! superblock; `md_p.h`, checked by mdadm's `calc_sb_1_csum`: `data_offset` at 128, `utime`
//! at 192, 256 bytes before `dev_roles`):
//!
//! | off | size | field                | unit / meaning                                              |
//! |-----|------|----------------------|-------------------------------------------------------------|
//! |   0 | 4    | `magic`              | `0xa92b4efc` ([`MD_SB_MAGIC`])                              |
//! |   4 | 4    | `major_version`      | 1                                                           |
//! |   8 | 4    | `feature_map`        | `MD_FEATURE_*` bits ([`Feature`])                           |
//! |  12 | 4    | `pad0`               | zero                                                        |
//! |  16 | 16   | `set_uuid`           | array UUID                                                  |
//! |  32 | 32   | `set_name`           | array name, NUL-padded (`host:name` or `name`)              |
//! |  64 | 8    | `ctime`              | creation time ([`super::MdTime`])                           |
//! |  72 | 4    | `level`              | RAID level, signed (−4 multipath, −1 linear, 0, 1, 4, 5, 6, 10) |
//! |  76 | 4    | `layout`             | md layout id (`ALGORITHM_*`)                                |
//! |  80 | 8    | `size`               | sectors of each member's data area the array uses           |
//! |  88 | 4    | `chunksize`          | sectors                                                     |
//! |  92 | 4    | `raid_disks`         | members of a complete array                                 |
//! |  96 | 4    | `bitmap_offset`      | signed sectors from the superblock (union with `ppl`)       |
//! | 100 | 4    | `new_level`          | reshape target level                                        |
//! | 104 | 8    | `reshape_position`   | sectors of array space reshaped so far                      |
//! | 112 | 4    | `delta_disks`        | signed change of `raid_disks` in a reshape                  |
//! | 116 | 4    | `new_layout`         | reshape target layout                                       |
//! | 120 | 4    | `new_chunk`          | sectors                                                     |
//! | 124 | 4    | `new_offset`         | signed sectors added to `data_offset` after a reshape       |
//! | 128 | 8    | `data_offset`        | sectors from the start of the member to its data area       |
//! | 136 | 8    | `data_size`          | sectors of the member usable for data                       |
//! | 144 | 8    | `super_offset`       | sectors from the start of the member to this superblock     |
//! | 152 | 8    | `recovery_offset`    | sectors (from `data_offset`) already recovered (union `journal_tail`) |
//! | 160 | 4    | `dev_number`         | this member's slot in `dev_roles` (not its role)            |
//! | 164 | 4    | `cnt_corrected_read` | read errors corrected by rewriting                          |
//! | 168 | 16   | `device_uuid`        | member UUID                                                 |
//! | 184 | 1    | `devflags`           | `WriteMostly1` = 1, `FailFast1` = 2                         |
//! | 185 | 1    | `bblog_shift`        | bad-block log: shift from sectors to its block size         |
//! | 186 | 2    | `bblog_size`         | sectors reserved for the bad-block log                      |
//! | 188 | 4    | `bblog_offset`       | signed sectors from the superblock to the bad-block log     |
//! | 192 | 8    | `utime`              | last update time ([`super::MdTime`])                        |
//! | 200 | 8    | `events`             | update counter                                              |
//! | 208 | 8    | `resync_offset`      | sectors (from `data_offset`) known in sync; `MaxSector` = clean |
//! | 216 | 4    | `sb_csum`            | checksum ([`Superblock::checksum`])                         |
//! | 220 | 4    | `max_dev`            | entries in `dev_roles`                                      |
//! | 224 | 32   | `pad3`               | zero                                                        |
//! | 256 | 2·max_dev | `dev_roles[]`   | role of each `dev_number` ([`DevRole`])                     |

use std::fmt;

use thiserror::Error;

use super::create::ConsistencyPolicy;
use super::ppl::{usable_area_sectors, PplArea, PplMode};
use super::{MdTime, Uuid};
use crate::geometry::{ArrayGeometry, Geometry, GeometryError, Layout, Level};

/// `MD_SB_MAGIC` (`md_p.h`).
pub const MD_SB_MAGIC: u32 = 0xa92b_4efc;
/// Bytes of the fixed part of the superblock, before `dev_roles` (`md_p.h`; mdadm's
/// `calc_sb_1_csum` checks `sizeof(struct mdp_superblock_1) == 256`).
pub const SUPERBLOCK_BASE_BYTES: usize = 256;
/// Bytes reserved for the superblock: it is read and written as one 4 KiB block (the
/// kernel's `super_1_load` reads 4096 bytes; mdadm's `MAX_SB_SIZE`).
pub const SUPERBLOCK_AREA_BYTES: usize = 4096;
/// Largest `max_dev` that fits the 4 KiB area: (4096 − 256) / 2 = 1920. The kernel
/// refuses more (`super_1_load`: `max_dev > (4096-256)/2`); mdadm's `MAX_DEVS`.
pub const MAX_DEV_LIMIT: u32 = ((SUPERBLOCK_AREA_BYTES - SUPERBLOCK_BASE_BYTES) / 2) as u32;
/// Where a v1.2 superblock sits: 8 sectors (4 KiB) from the start of the member
/// (`super_1_load`, `minor_version` 2: `sb_start = 8`).
pub const SUPER_OFFSET_SECTORS: u64 = 8;
/// The same position in bytes (4096).
pub const SUPERBLOCK_OFFSET_BYTES: u64 = SUPER_OFFSET_SECTORS * 512;
/// md's `MaxSector` (`~(sector_t)0`): in `resync_offset`, "the whole array is in sync"
/// (clean); in `recovery_offset`, "fully recovered".
pub const MAX_SECTOR: u64 = u64::MAX;
/// `dev_roles` value of a spare (`MD_DISK_ROLE_SPARE`).
pub const DEV_ROLE_SPARE: u16 = 0xffff;
/// `dev_roles` value of a faulty member (`MD_DISK_ROLE_FAULTY`).
pub const DEV_ROLE_FAULTY: u16 = 0xfffe;
/// `dev_roles` value of a journal device (`MD_DISK_ROLE_JOURNAL`).
pub const DEV_ROLE_JOURNAL: u16 = 0xfffd;
/// Largest value of a regular role (`MD_DISK_ROLE_MAX`).
pub const DEV_ROLE_MAX: u16 = 0xff00;
/// Every feature bit the kernel knows (`MD_FEATURE_ALL`, `md_p.h`).
pub const FEATURE_ALL: u32 = 0x1fff;
/// ferroraid's own feature bit, `1 << 24` in `feature_map`: the array keeps ferroraid's
/// RAID6 Partial Parity Log ([`Feature::Raid6Ppl`]; `docs/FORMAT.md`, "RAID6 PPL"). Outside
/// [`FEATURE_ALL`] on purpose: the kernel refuses a member with a bit it does not know
/// (`super_1_load`: `feature_map & ~MD_FEATURE_ALL` → -EINVAL), which is the safe answer
/// for a log md cannot keep.
pub const FERRORAID_FEATURE_RAID6_PPL: u32 = 1 << 24;

// Byte offsets of the fields (see the table in the module docs).
const OFF_MAGIC: usize = 0;
const OFF_MAJOR: usize = 4;
const OFF_FEATURE_MAP: usize = 8;
const OFF_PAD0: usize = 12;
const OFF_SET_UUID: usize = 16;
const OFF_SET_NAME: usize = 32;
const OFF_CTIME: usize = 64;
const OFF_LEVEL: usize = 72;
const OFF_LAYOUT: usize = 76;
const OFF_SIZE: usize = 80;
const OFF_CHUNKSIZE: usize = 88;
const OFF_RAID_DISKS: usize = 92;
const OFF_BITMAP_OFFSET: usize = 96;
const OFF_NEW_LEVEL: usize = 100;
const OFF_RESHAPE_POSITION: usize = 104;
const OFF_DELTA_DISKS: usize = 112;
const OFF_NEW_LAYOUT: usize = 116;
const OFF_NEW_CHUNK: usize = 120;
const OFF_NEW_OFFSET: usize = 124;
const OFF_DATA_OFFSET: usize = 128;
const OFF_DATA_SIZE: usize = 136;
const OFF_SUPER_OFFSET: usize = 144;
const OFF_RECOVERY_OFFSET: usize = 152;
const OFF_DEV_NUMBER: usize = 160;
const OFF_CNT_CORRECTED_READ: usize = 164;
const OFF_DEVICE_UUID: usize = 168;
const OFF_DEVFLAGS: usize = 184;
const OFF_BBLOG_SHIFT: usize = 185;
const OFF_BBLOG_SIZE: usize = 186;
const OFF_BBLOG_OFFSET: usize = 188;
const OFF_UTIME: usize = 192;
const OFF_EVENTS: usize = 200;
const OFF_RESYNC_OFFSET: usize = 208;
const OFF_SB_CSUM: usize = 216;
const OFF_MAX_DEV: usize = 220;
const OFF_PAD3: usize = 224;
const PAD3_LEN: usize = 32;

// The layout facts mdadm checks at run time, checked at compile time.
const _: () = assert!(OFF_DATA_OFFSET == 128 && OFF_UTIME == 192);
const _: () = assert!(OFF_PAD3 + PAD3_LEN == SUPERBLOCK_BASE_BYTES);
const _: () = assert!(SUPERBLOCK_BASE_BYTES + 2 * MAX_DEV_LIMIT as usize == SUPERBLOCK_AREA_BYTES);

/// A bit of `feature_map` (`MD_FEATURE_*`, `md_p.h`, and ferroraid's own
/// [`Feature::Raid6Ppl`]); the discriminant is the bit's position. ferroraid accepts those
/// in [`Feature::SUPPORTED`]; [`Feature::refusal`] says why each other one is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Feature {
    /// `MD_FEATURE_BITMAP_OFFSET` (1): an internal write-intent bitmap at `bitmap_offset`.
    BitmapOffset = 0,
    /// `MD_FEATURE_RECOVERY_OFFSET` (2): this member is recovered only up to
    /// `recovery_offset`.
    RecoveryOffset,
    /// `MD_FEATURE_RESHAPE_ACTIVE` (4): a reshape is in progress.
    ReshapeActive,
    /// `MD_FEATURE_BAD_BLOCKS` (8): the bad-block log is not empty.
    BadBlocks,
    /// `MD_FEATURE_REPLACEMENT` (16): this member is replacing another with the same role.
    Replacement,
    /// `MD_FEATURE_RESHAPE_BACKWARDS` (32): a reshape runs from the end backwards.
    ReshapeBackwards,
    /// `MD_FEATURE_NEW_OFFSET` (64): a reshape moves the data to `data_offset + new_offset`.
    NewOffset,
    /// `MD_FEATURE_RECOVERY_BITMAP` (128): the recovery is guided by the bitmap.
    RecoveryBitmap,
    /// `MD_FEATURE_CLUSTERED` (256): clustered md (mdadm calls the bit
    /// `MD_FEATURE_BITMAP_VERSIONED`).
    Clustered,
    /// `MD_FEATURE_JOURNAL` (512): a RAID5/6 write journal device.
    Journal,
    /// `MD_FEATURE_PPL` (1024): partial parity log.
    Ppl,
    /// `MD_FEATURE_MULTIPLE_PPLS` (2048): several partial parity logs.
    MultiplePpls,
    /// `MD_FEATURE_RAID0_LAYOUT` (4096): RAID0 layout is meaningful (RAID0 only).
    Raid0Layout = 12,
    /// [`FERRORAID_FEATURE_RAID6_PPL`] (`1 << 24`, ferroraid's own bit): the RAID6 array
    /// keeps ferroraid's RAID6 Partial Parity Log — md's PPL format and placement, logged
    /// in the P and the Q member's areas. Valid only on RAID6 together with
    /// [`Feature::Ppl`] or [`Feature::MultiplePpls`] ([`Superblock::ppl_area`]). Kernel md
    /// refuses the member (an unknown bit).
    Raid6Ppl = 24,
}

impl Feature {
    /// Every feature, in bit order.
    pub const ALL: [Feature; 14] = [
        Feature::BitmapOffset,
        Feature::RecoveryOffset,
        Feature::ReshapeActive,
        Feature::BadBlocks,
        Feature::Replacement,
        Feature::ReshapeBackwards,
        Feature::NewOffset,
        Feature::RecoveryBitmap,
        Feature::Clustered,
        Feature::Journal,
        Feature::Ppl,
        Feature::MultiplePpls,
        Feature::Raid0Layout,
        Feature::Raid6Ppl,
    ];

    /// The feature's bit in `feature_map`.
    pub fn bit(self) -> u32 {
        1 << (self as u32)
    }

    /// The bit's name: the kernel's (`md_p.h`), or `FERRORAID_FEATURE_RAID6_PPL` for
    /// ferroraid's own [`Feature::Raid6Ppl`].
    pub fn md_name(self) -> &'static str {
        match self {
            Feature::BitmapOffset => "MD_FEATURE_BITMAP_OFFSET",
            Feature::RecoveryOffset => "MD_FEATURE_RECOVERY_OFFSET",
            Feature::ReshapeActive => "MD_FEATURE_RESHAPE_ACTIVE",
            Feature::BadBlocks => "MD_FEATURE_BAD_BLOCKS",
            Feature::Replacement => "MD_FEATURE_REPLACEMENT",
            Feature::ReshapeBackwards => "MD_FEATURE_RESHAPE_BACKWARDS",
            Feature::NewOffset => "MD_FEATURE_NEW_OFFSET",
            Feature::RecoveryBitmap => "MD_FEATURE_RECOVERY_BITMAP",
            Feature::Clustered => "MD_FEATURE_CLUSTERED",
            Feature::Journal => "MD_FEATURE_JOURNAL",
            Feature::Ppl => "MD_FEATURE_PPL",
            Feature::MultiplePpls => "MD_FEATURE_MULTIPLE_PPLS",
            Feature::Raid0Layout => "MD_FEATURE_RAID0_LAYOUT",
            Feature::Raid6Ppl => "FERRORAID_FEATURE_RAID6_PPL",
        }
    }

    /// Features ferroraid serves: [`Feature::BitmapOffset`] (the internal write-intent
    /// bitmap, `super::bitmap`), [`Feature::RecoveryOffset`] (a member rebuilt up to
    /// `recovery_offset`: the rebuild resumes there, as md's `super_1_validate` does),
    /// [`Feature::Replacement`] (a device replacing the member of its role, copied up to
    /// `recovery_offset`: the replace resumes there, or — the member gone — it becomes the
    /// member and is rebuilt from there, as md's `raid5_run` does) and
    /// [`Feature::RecoveryBitmap`] (a member recovered from the write-intent bitmap: a
    /// re-add), [`Feature::Ppl`] / [`Feature::MultiplePpls`] (md's Partial Parity Log
    /// on RAID5, `crate::ppl`; md's own PPL checks, [`Superblock::ppl_area`], come first)
    /// and [`Feature::Raid6Ppl`] (the same log on RAID6, ferroraid's extension; valid only
    /// with a PPL bit on RAID6, checked by [`Superblock::ppl_area`]).
    pub const SUPPORTED: u32 = 1 | 2 | 16 | 128 | 1024 | 2048 | FERRORAID_FEATURE_RAID6_PPL;

    /// What the feature means and why ferroraid refuses it today (every feature outside
    /// [`Feature::SUPPORTED`]).
    pub fn refusal(self) -> &'static str {
        match self {
            Feature::BitmapOffset => {
                "internal write-intent bitmap (supported: never refused by check_supported)"
            }
            Feature::RecoveryOffset => {
                "member only partly recovered (supported: the rebuild resumes at recovery_offset)"
            }
            Feature::ReshapeActive => "reshape in progress: finish it under md first",
            Feature::BadBlocks => {
                "member has recorded bad blocks: md would not read those sectors, ferroraid \
                 does not read the bad-block log yet"
            }
            Feature::Replacement => {
                "replacement in progress (supported: the replace resumes at recovery_offset)"
            }
            Feature::ReshapeBackwards => "backwards reshape in progress: finish it under md first",
            Feature::NewOffset => {
                "reshape to a new data offset in progress: finish it under md first"
            }
            Feature::RecoveryBitmap => {
                "bitmap-guided recovery in progress (supported: the re-add resumes)"
            }
            Feature::Clustered => "clustered md is not supported",
            Feature::Journal => "RAID5/6 write journal is not supported",
            Feature::Ppl | Feature::MultiplePpls => {
                "partial parity log (supported on RAID5, and on RAID6 with \
                 FERRORAID_FEATURE_RAID6_PPL: recovered at assembly, written before every \
                 stripe write)"
            }
            Feature::Raid6Ppl => {
                "ferroraid's RAID6 partial parity log (supported on RAID6 with a PPL bit; \
                 kernel md cannot assemble such an array: switch it to resync first, \
                 ferroraid grow --consistency-policy resync)"
            }
            Feature::Raid0Layout => {
                "RAID0 layout flag on a RAID5/6 superblock (the kernel refuses it too)"
            }
        }
    }
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (0x{:x})", self.md_name(), self.bit())
    }
}

/// The set feature bits of a `feature_map`, for error messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeatureSet(pub u32);

impl FeatureSet {
    /// The known features that are set.
    pub fn features(self) -> impl Iterator<Item = Feature> {
        Feature::ALL
            .into_iter()
            .filter(move |f| self.0 & f.bit() != 0)
    }
    /// Bits set that neither the kernel (outside [`FEATURE_ALL`]) nor ferroraid
    /// ([`FERRORAID_FEATURE_RAID6_PPL`]) defines.
    pub fn unknown_bits(self) -> u32 {
        self.0 & !(FEATURE_ALL | FERRORAID_FEATURE_RAID6_PPL)
    }
}

impl fmt::Display for FeatureSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for feat in self.features() {
            if !first {
                f.write_str("; ")?;
            }
            first = false;
            write!(f, "{feat}: {}", feat.refusal())?;
        }
        if self.unknown_bits() != 0 {
            if !first {
                f.write_str("; ")?;
            }
            write!(
                f,
                "unknown feature bits 0x{:x} (newer than this md format; the kernel refuses them too)",
                self.unknown_bits()
            )?;
        }
        Ok(())
    }
}

/// What a `dev_roles` entry says about the device in that slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DevRole {
    /// Active member holding role `n` (0-based position in the stripe layout).
    Active(u16),
    /// Spare (`0xffff`).
    Spare,
    /// Faulty (`0xfffe`): failed, not to be used.
    Faulty,
    /// Journal device (`0xfffd`).
    Journal,
    /// A value md does not define (`0xff01..=0xfffc`).
    Invalid(u16),
}

impl DevRole {
    /// Interprets a raw `dev_roles` entry.
    pub fn from_raw(raw: u16) -> Self {
        match raw {
            DEV_ROLE_SPARE => DevRole::Spare,
            DEV_ROLE_FAULTY => DevRole::Faulty,
            DEV_ROLE_JOURNAL => DevRole::Journal,
            r if r <= DEV_ROLE_MAX => DevRole::Active(r),
            r => DevRole::Invalid(r),
        }
    }

    /// The raw `dev_roles` value.
    pub fn raw(self) -> u16 {
        match self {
            DevRole::Active(r) | DevRole::Invalid(r) => r,
            DevRole::Spare => DEV_ROLE_SPARE,
            DevRole::Faulty => DEV_ROLE_FAULTY,
            DevRole::Journal => DEV_ROLE_JOURNAL,
        }
    }
}

impl fmt::Display for DevRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DevRole::Active(r) => write!(f, "active device {r}"),
            DevRole::Spare => f.write_str("spare"),
            DevRole::Faulty => f.write_str("faulty"),
            DevRole::Journal => f.write_str("journal"),
            DevRole::Invalid(r) => write!(f, "undefined role 0x{r:04x}"),
        }
    }
}

/// Why a superblock was refused. Every variant names the field and the values involved.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SuperblockError {
    /// Fewer bytes than the superblock needs.
    #[error("superblock truncated: {len} bytes given, {needed} needed")]
    Truncated {
        /// Bytes given.
        len: usize,
        /// Bytes needed (256 + 2 × `max_dev`, or 256 before `max_dev` is known).
        needed: usize,
    },
    /// No md magic: not an md v1 superblock (or not at this position).
    #[error("no md superblock: magic is 0x{found:08x}, expected 0x{MD_SB_MAGIC:08x}")]
    NoMagic {
        /// The first four bytes, little-endian.
        found: u32,
    },
    /// `major_version` other than 1.
    #[error("md superblock major version {found} is not 1 (0.90 superblocks live at the end of the device)")]
    WrongMajorVersion {
        /// The stored major version.
        found: u32,
    },
    /// `max_dev` larger than fits the 4 KiB superblock area.
    #[error("max_dev {max_dev} is too large: at most {MAX_DEV_LIMIT} roles fit the 4 KiB superblock area")]
    MaxDevTooLarge {
        /// The stored `max_dev` (or the length of `dev_roles` when encoding).
        max_dev: u64,
    },
    /// `sb_csum` does not match the checksum of the contents.
    #[error("bad superblock checksum: stored 0x{stored:08x}, computed 0x{computed:08x}")]
    BadChecksum {
        /// `sb_csum` as stored.
        stored: u32,
        /// What `calc_sb_1_csum` gives for the contents.
        computed: u32,
    },
    /// Non-zero padding: the kernel refuses it ("might be a new feature").
    #[error("superblock padding field {field} is not zero (a newer md feature?); the kernel refuses it too")]
    NonZeroPadding {
        /// `pad0` or `pad3`.
        field: &'static str,
    },
    /// Not at the v1.2 position.
    #[error(
        "not a v1.2 superblock: super_offset is {super_offset} sectors, ferroraid uses 8 \
         (4 KiB from the start; v1.1 has 0, v1.0 sits at the end of the device)"
    )]
    NotVersion12 {
        /// The stored `super_offset`, sectors.
        super_offset: u64,
    },
    /// Feature bits ferroraid does not support.
    #[error("unsupported md features: {0}")]
    UnsupportedFeatures(FeatureSet),
    /// A level other than RAID5 or RAID6.
    #[error("unsupported RAID level {}: ferroraid serves raid5 and raid6 only", level_name(*.level))]
    UnsupportedLevel {
        /// The stored level (signed, md's numbering).
        level: i32,
    },
    /// A layout outside the six ferroraid knows.
    #[error("unsupported {level} layout {layout}: {reason}")]
    UnsupportedLayout {
        /// The level.
        level: Level,
        /// The stored md layout id.
        layout: u32,
        /// Why.
        reason: String,
    },
    /// A chunk size ferroraid's geometry cannot represent.
    #[error(
        "chunk size {chunk_sectors} sectors is not representable: it must be a power of two \
         from 8 sectors (4 KiB) to 32768 sectors (16 MiB)"
    )]
    ChunkNotRepresentable {
        /// The stored `chunksize`, sectors.
        chunk_sectors: u32,
    },
    /// `raid_disks` outside what the level allows.
    #[error("invalid geometry: {0}")]
    Geometry(#[from] GeometryError),
    /// `raid_disks` does not fit ferroraid's member count type.
    #[error("raid_disks {raid_disks} is out of range")]
    RaidDisks {
        /// The stored `raid_disks`.
        raid_disks: u32,
    },
    /// The data area overlaps the superblock.
    #[error(
        "data_offset {data_offset} sectors overlaps the superblock, which ends at sector {min}"
    )]
    DataOffset {
        /// The stored `data_offset`, sectors.
        data_offset: u64,
        /// First sector after the superblock.
        min: u64,
    },
    /// The data area is too small for the array.
    #[error(
        "data_size {data_size} sectors is too small: the array uses {size} sectors of each \
         member (and md requires at least 10)"
    )]
    DataSize {
        /// The stored `data_size`, sectors.
        data_size: u64,
        /// The stored `size`, sectors.
        size: u64,
    },
    /// The array's per-member size is smaller than one chunk.
    #[error(
        "array size {size} sectors per member is smaller than one {chunk_sectors}-sector chunk"
    )]
    SizeTooSmall {
        /// The stored `size`, sectors.
        size: u64,
        /// The stored `chunksize`, sectors.
        chunk_sectors: u32,
    },
    /// The bad-block log area overlaps the superblock or the data.
    #[error(
        "bad-block log at {offset} sectors from the superblock ({size} sectors) overlaps the \
         superblock or the data area"
    )]
    BadBlockLogPlacement {
        /// The stored `bblog_offset`, sectors.
        offset: i32,
        /// The stored `bblog_size`, sectors.
        size: u16,
    },
    /// A `dev_roles` entry md does not define, or a role ≥ `raid_disks`.
    #[error(
        "dev_roles[{dev_number}] = 0x{role:04x} is not a valid role for {raid_disks} raid disks"
    )]
    InvalidRole {
        /// The slot.
        dev_number: u32,
        /// The raw entry.
        role: u16,
        /// The stored `raid_disks`.
        raid_disks: u32,
    },
    /// More than two slots hold the same active role. md allows two: a member and its
    /// replacement (mdadm's Array State shows `R`); a third is corruption.
    #[error(
        "role {role} is held by dev_roles[{first}], its replacement and dev_roles[{second}]: \
         md allows a member and one replacement"
    )]
    DuplicateRole {
        /// The role.
        role: u16,
        /// First slot holding it.
        first: u32,
        /// The third slot holding it.
        second: u32,
    },
    /// An internal bitmap that does not start between the superblock and the data.
    #[error(
        "internal bitmap at {bitmap_offset} sectors from the superblock does not lie between \
         the superblock and the data (data_offset {data_offset} sectors)"
    )]
    BitmapPlacement {
        /// The stored `bitmap_offset`, sectors.
        bitmap_offset: i32,
        /// The stored `data_offset`, sectors.
        data_offset: u64,
    },
    /// PPL feature bits in a combination md refuses: either PPL bit with an internal
    /// bitmap or a journal, or both PPL bits (`super_1_validate`, md.c:1856–1865).
    #[error(
        "feature_map 0x{feature_map:x}: {why} (md's super_1_validate refuses this combination)"
    )]
    PplFeatures {
        /// The stored `feature_map`.
        feature_map: u32,
        /// Which rule.
        why: &'static str,
    },
    /// A PPL on a level other than RAID5 (`ppl_init_log`: "PPL is not compatible with raid
    /// level %d"), and not ferroraid's RAID6 PPL either (a RAID6 with a PPL bit but
    /// without [`FERRORAID_FEATURE_RAID6_PPL`], or a level other than 5 and 6).
    #[error(
        "PPL is not compatible with raid level {}: md's PPL is RAID5 only (ferroraid's RAID6 \
         PPL also sets FERRORAID_FEATURE_RAID6_PPL)",
        level_name(*.level)
    )]
    PplLevel {
        /// The stored level.
        level: i32,
    },
    /// [`FERRORAID_FEATURE_RAID6_PPL`] where it is not valid: without a PPL bit
    /// (`MD_FEATURE_PPL` or `MD_FEATURE_MULTIPLE_PPLS`) or on a level other than RAID6
    /// (ferroraid's rule, `docs/FORMAT.md` "RAID6 PPL": the bit marks a RAID6 PPL only).
    #[error(
        "feature_map 0x{feature_map:x} on raid level {}: FERRORAID_FEATURE_RAID6_PPL \
         (0x{FERRORAID_FEATURE_RAID6_PPL:x}) {why}",
        level_name(*.level)
    )]
    Raid6PplBit {
        /// The stored `feature_map`.
        feature_map: u32,
        /// The stored level.
        level: i32,
        /// Which rule.
        why: &'static str,
    },
    /// A PPL area md refuses (`ppl_validate_rdev`, raid5-ppl.c:1255).
    #[error(
        "PPL area at {offset} sectors from the superblock, {size} sectors long: {why} \
         (md's ppl_validate_rdev refuses it)"
    )]
    PplPlacement {
        /// `ppl.offset`, signed sectors from the superblock.
        offset: i16,
        /// `ppl.size`, sectors.
        size: u16,
        /// What is wrong.
        why: &'static str,
    },
    /// A PPL area md accepts but too small for ferroraid's writer: it logs up to one
    /// chunk of partial parity per record ([`crate::ppl::min_area_bytes`]) where md logs
    /// per 4 KiB stripe.
    #[error(
        "PPL area of {usable_sectors} usable sectors is too small for ferroraid with a \
         {chunk_sectors}-sector chunk: it logs up to one chunk of partial parity per record and \
         needs {needed_sectors} sectors (md, logging per 4 KiB stripe, accepts it); assemble \
         it with md, or switch the stopped array to `ferroraid grow --consistency-policy resync`"
    )]
    PplAreaTooSmall {
        /// The area md uses, sectors (`usable_area_sectors` of `ppl.size`).
        usable_sectors: u64,
        /// `chunksize`, sectors.
        chunk_sectors: u32,
        /// What ferroraid needs, sectors.
        needed_sectors: u64,
    },
    /// A buffer too small for [`Superblock::write_into`].
    #[error("buffer of {len} bytes is too small for a {needed}-byte superblock")]
    BufferTooSmall {
        /// Bytes given.
        len: usize,
        /// Bytes needed.
        needed: usize,
    },
}

/// md's name of a level (`mdadm`'s `pers` table), for messages.
fn level_name(level: i32) -> String {
    let name = match level {
        -5 => "faulty",
        -4 => "multipath",
        -1 => "linear",
        0 => "raid0",
        1 => "raid1",
        4 => "raid4",
        5 => "raid5",
        6 => "raid6",
        10 => "raid10",
        _ => return format!("{level} (unknown)"),
    };
    format!("{name} ({level})")
}

/// Every field of `struct mdp_superblock_1` (`md_p.h`), decoded.
///
/// The three fields that have only one valid value or are derived are not stored:
/// `magic` (always [`MD_SB_MAGIC`]), `major_version` (always 1) and `pad0`/`pad3` (always
/// zero) are written by the encoder and checked by the decoder; `sb_csum` is computed on
/// encoding ([`Superblock::checksum`]); `max_dev` is `dev_roles.len()`
/// ([`Superblock::max_dev`]).
///
/// Fields are public: this is the on-disk record, and tests and tools need to set any
/// value. [`Superblock::check_supported`] says whether ferroraid can serve the array it
/// describes; [`parse`] decodes and checks in one step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// `feature_map`: `MD_FEATURE_*` bits ([`Feature`]). ferroraid writes 0,
    /// [`Feature::BitmapOffset`] (1) with an internal bitmap, or [`Feature::Ppl`] (1024)
    /// with a Partial Parity Log, plus [`Feature::Raid6Ppl`] (`1 << 24`) on RAID6.
    pub feature_map: u32,
    /// `set_uuid`: the array's UUID, the same on every member.
    pub set_uuid: Uuid,
    /// `set_name`: the array name, NUL-padded, not necessarily NUL-terminated (mdadm writes
    /// at most 31 bytes). By mdadm's convention `homehost:name`; see [`Superblock::name`].
    pub set_name: [u8; 32],
    /// `ctime`: when the array was created.
    pub ctime: MdTime,
    /// `level`: md's signed RAID level (5 or 6 for ferroraid).
    pub level: i32,
    /// `layout`: md's layout id (`ALGORITHM_*`, `drivers/md/raid5.h`); 0..=5 for
    /// ferroraid ([`Layout::md_id`]).
    pub layout: u32,
    /// `size`: sectors of each member's data area that the array uses ("component size").
    pub size: u64,
    /// `chunksize`: chunk size in sectors.
    pub chunksize: u32,
    /// `raid_disks`: members of the complete array (roles `0..raid_disks`).
    pub raid_disks: u32,
    /// `bitmap_offset`: signed sectors from the superblock to the internal write-intent
    /// bitmap; meaningful only with [`Feature::BitmapOffset`]. Shares its 4 bytes with
    /// `ppl.offset` (signed 16 bits, sectors) and `ppl.size` (16 bits, sectors), meaningful
    /// with [`Feature::Ppl`] ([`Superblock::ppl`]).
    pub bitmap_offset: i32,
    /// `new_level`: target level of a reshape (with [`Feature::ReshapeActive`]).
    pub new_level: i32,
    /// `reshape_position`: sectors of array space already reshaped (with
    /// [`Feature::ReshapeActive`]).
    pub reshape_position: u64,
    /// `delta_disks`: signed change of `raid_disks` in a reshape.
    pub delta_disks: i32,
    /// `new_layout`: target layout of a reshape.
    pub new_layout: u32,
    /// `new_chunk`: target chunk size of a reshape, sectors.
    pub new_chunk: u32,
    /// `new_offset`: signed sectors added to `data_offset` by a reshape (with
    /// [`Feature::NewOffset`]); may differ per member.
    pub new_offset: i32,
    /// `data_offset`: sectors from the start of this member to its data area.
    pub data_offset: u64,
    /// `data_size`: sectors of this member usable for data (from `data_offset`).
    pub data_size: u64,
    /// `super_offset`: sectors from the start of this member to this superblock (8 for
    /// v1.2).
    pub super_offset: u64,
    /// `recovery_offset`: sectors (from `data_offset`) of this member already recovered,
    /// meaningful with [`Feature::RecoveryOffset`]; on a journal device the same 8 bytes
    /// are `journal_tail`.
    pub recovery_offset: u64,
    /// `dev_number`: this member's permanent slot in `dev_roles` (not its role).
    pub dev_number: u32,
    /// `cnt_corrected_read`: read errors corrected by rewriting, for this member.
    pub cnt_corrected_read: u32,
    /// `device_uuid`: this member's UUID (set by user space, ignored by the kernel).
    pub device_uuid: Uuid,
    /// `devflags`: `WriteMostly1` (1, RAID1 only) and `FailFast1` (2). Ignored by
    /// ferroraid for RAID5/6, kept as found.
    pub devflags: u8,
    /// `bblog_shift`: shift from sectors to the bad-block log's block size.
    pub bblog_shift: u8,
    /// `bblog_size`: sectors reserved for the bad-block log (0: none).
    pub bblog_size: u16,
    /// `bblog_offset`: signed sectors from the superblock to the bad-block log (0: none).
    pub bblog_offset: i32,
    /// `utime`: time of the last superblock update.
    pub utime: MdTime,
    /// `events`: the update counter, bumped on every superblock update of the array; the
    /// member(s) with the highest count carry the array's current state.
    pub events: u64,
    /// `resync_offset`: sectors (from `data_offset`) known to be in sync; [`MAX_SECTOR`]
    /// when the array is clean, 0 when the whole array needs a resync.
    pub resync_offset: u64,
    /// `dev_roles[max_dev]`: the role of the device in each slot, indexed by `dev_number`
    /// ([`DevRole`]: role number, `0xffff` spare, `0xfffe` faulty, `0xfffd` journal).
    /// Its length is `max_dev`, at most [`MAX_DEV_LIMIT`].
    pub dev_roles: Vec<u16>,
}

#[inline]
fn le16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}
/// Little-endian `u32` at byte `off` (also `ppl`).
#[inline]
pub(super) fn le32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}
/// Little-endian `u64` at byte `off` (also `ppl`).
#[inline]
pub(super) fn le64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}
#[inline]
fn put16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}
#[inline]
fn put32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
#[inline]
fn put64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// md's superblock checksum (`calc_sb_1_csum`, `drivers/md/md.c`) of an encoded superblock
/// `sb` with `max_dev` roles: the sum, in 64 bits, of the little-endian 32-bit words of
/// its first `256 + 2 × max_dev` bytes with the `sb_csum` field taken as zero — plus the
/// trailing little-endian 16-bit word when `max_dev` is odd — folded once to 32 bits
/// (`low 32 + high 32`, truncated).
///
/// `sb` must hold at least `256 + 2 × max_dev` bytes (callers check).
fn calc_sb_1_csum(sb: &[u8], max_dev: u32) -> u32 {
    let size = SUPERBLOCK_BASE_BYTES + 2 * max_dev as usize;
    let body = &sb[..size];
    let mut sum: u64 = 0;
    let mut words = body.chunks_exact(4);
    for (i, w) in words.by_ref().enumerate() {
        if i * 4 == OFF_SB_CSUM {
            continue; // sb_csum counts as zero
        }
        sum += u64::from(u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
    }
    let rest = words.remainder();
    if rest.len() == 2 {
        sum += u64::from(u16::from_le_bytes([rest[0], rest[1]]));
    }
    ((sum & 0xffff_ffff) + (sum >> 32)) as u32
}

/// md's checksum of raw superblock bytes — what `sb_csum` should hold — with `max_dev`
/// read from the bytes themselves (mdadm prints it as "expected" when they differ). No
/// other field is checked.
///
/// # Errors
/// [`SuperblockError::Truncated`] when `bytes` is shorter than 256 bytes or than
/// `256 + 2 × max_dev`; [`SuperblockError::MaxDevTooLarge`] above [`MAX_DEV_LIMIT`].
pub fn raw_checksum(bytes: &[u8]) -> Result<u32, SuperblockError> {
    if bytes.len() < SUPERBLOCK_BASE_BYTES {
        return Err(SuperblockError::Truncated {
            len: bytes.len(),
            needed: SUPERBLOCK_BASE_BYTES,
        });
    }
    let max_dev = le32(bytes, OFF_MAX_DEV);
    if max_dev > MAX_DEV_LIMIT {
        return Err(SuperblockError::MaxDevTooLarge {
            max_dev: u64::from(max_dev),
        });
    }
    let needed = SUPERBLOCK_BASE_BYTES + 2 * max_dev as usize;
    if bytes.len() < needed {
        return Err(SuperblockError::Truncated {
            len: bytes.len(),
            needed,
        });
    }
    Ok(calc_sb_1_csum(bytes, max_dev))
}

impl Superblock {
    /// `max_dev`: the number of `dev_roles` entries.
    pub fn max_dev(&self) -> usize {
        self.dev_roles.len()
    }

    /// Bytes of the encoded superblock: `256 + 2 × max_dev`.
    pub fn encoded_len(&self) -> usize {
        SUPERBLOCK_BASE_BYTES + 2 * self.dev_roles.len()
    }

    /// Decodes the superblock at the start of `bytes` and checks its **format** only:
    /// magic, major version, `max_dev` within the 4 KiB area, the checksum, and zero
    /// padding — what the kernel's `super_1_load` checks before it looks at the contents.
    /// It does not judge whether ferroraid can serve the array ([`Superblock::check_supported`];
    /// [`parse`] does both). Never panics, whatever the input.
    ///
    /// # Errors
    /// [`SuperblockError::Truncated`], [`SuperblockError::NoMagic`],
    /// [`SuperblockError::WrongMajorVersion`], [`SuperblockError::MaxDevTooLarge`],
    /// [`SuperblockError::BadChecksum`] (stored and computed values),
    /// [`SuperblockError::NonZeroPadding`], checked in that order.
    pub fn decode(bytes: &[u8]) -> Result<Self, SuperblockError> {
        if bytes.len() < SUPERBLOCK_BASE_BYTES {
            return Err(SuperblockError::Truncated {
                len: bytes.len(),
                needed: SUPERBLOCK_BASE_BYTES,
            });
        }
        let b = bytes;
        let magic = le32(b, OFF_MAGIC);
        if magic != MD_SB_MAGIC {
            return Err(SuperblockError::NoMagic { found: magic });
        }
        let major = le32(b, OFF_MAJOR);
        if major != 1 {
            return Err(SuperblockError::WrongMajorVersion { found: major });
        }
        let max_dev = le32(b, OFF_MAX_DEV);
        if max_dev > MAX_DEV_LIMIT {
            return Err(SuperblockError::MaxDevTooLarge {
                max_dev: u64::from(max_dev),
            });
        }
        let needed = SUPERBLOCK_BASE_BYTES + 2 * max_dev as usize;
        if b.len() < needed {
            return Err(SuperblockError::Truncated {
                len: b.len(),
                needed,
            });
        }
        let stored = le32(b, OFF_SB_CSUM);
        let computed = calc_sb_1_csum(b, max_dev);
        if stored != computed {
            return Err(SuperblockError::BadChecksum { stored, computed });
        }
        if le32(b, OFF_PAD0) != 0 {
            return Err(SuperblockError::NonZeroPadding { field: "pad0" });
        }
        if b[OFF_PAD3..OFF_PAD3 + PAD3_LEN].iter().any(|&x| x != 0) {
            return Err(SuperblockError::NonZeroPadding { field: "pad3" });
        }
        let uuid_at = |off: usize| {
            let mut u = [0u8; 16];
            u.copy_from_slice(&b[off..off + 16]);
            Uuid(u)
        };
        let mut set_name = [0u8; 32];
        set_name.copy_from_slice(&b[OFF_SET_NAME..OFF_SET_NAME + 32]);
        let dev_roles = (0..max_dev as usize)
            .map(|i| le16(b, SUPERBLOCK_BASE_BYTES + 2 * i))
            .collect();
        Ok(Superblock {
            feature_map: le32(b, OFF_FEATURE_MAP),
            set_uuid: uuid_at(OFF_SET_UUID),
            set_name,
            ctime: MdTime::from_raw(le64(b, OFF_CTIME)),
            level: le32(b, OFF_LEVEL) as i32,
            layout: le32(b, OFF_LAYOUT),
            size: le64(b, OFF_SIZE),
            chunksize: le32(b, OFF_CHUNKSIZE),
            raid_disks: le32(b, OFF_RAID_DISKS),
            bitmap_offset: le32(b, OFF_BITMAP_OFFSET) as i32,
            new_level: le32(b, OFF_NEW_LEVEL) as i32,
            reshape_position: le64(b, OFF_RESHAPE_POSITION),
            delta_disks: le32(b, OFF_DELTA_DISKS) as i32,
            new_layout: le32(b, OFF_NEW_LAYOUT),
            new_chunk: le32(b, OFF_NEW_CHUNK),
            new_offset: le32(b, OFF_NEW_OFFSET) as i32,
            data_offset: le64(b, OFF_DATA_OFFSET),
            data_size: le64(b, OFF_DATA_SIZE),
            super_offset: le64(b, OFF_SUPER_OFFSET),
            recovery_offset: le64(b, OFF_RECOVERY_OFFSET),
            dev_number: le32(b, OFF_DEV_NUMBER),
            cnt_corrected_read: le32(b, OFF_CNT_CORRECTED_READ),
            device_uuid: uuid_at(OFF_DEVICE_UUID),
            devflags: b[OFF_DEVFLAGS],
            bblog_shift: b[OFF_BBLOG_SHIFT],
            bblog_size: le16(b, OFF_BBLOG_SIZE),
            bblog_offset: le32(b, OFF_BBLOG_OFFSET) as i32,
            utime: MdTime::from_raw(le64(b, OFF_UTIME)),
            events: le64(b, OFF_EVENTS),
            resync_offset: le64(b, OFF_RESYNC_OFFSET),
            dev_roles,
        })
    }

    /// Encodes the superblock into the start of `out`, with `magic`, `major_version`, zero
    /// padding, `max_dev` and `sb_csum` filled in; returns the bytes written
    /// ([`Superblock::encoded_len`]). Bytes of `out` beyond that are left untouched.
    ///
    /// # Errors
    /// [`SuperblockError::MaxDevTooLarge`] if `dev_roles` has more than [`MAX_DEV_LIMIT`]
    /// entries; [`SuperblockError::BufferTooSmall`] if `out` is shorter than the encoding.
    pub fn write_into(&self, out: &mut [u8]) -> Result<usize, SuperblockError> {
        let max_dev = self.dev_roles.len();
        if max_dev > MAX_DEV_LIMIT as usize {
            return Err(SuperblockError::MaxDevTooLarge {
                max_dev: max_dev as u64,
            });
        }
        let len = self.encoded_len();
        if out.len() < len {
            return Err(SuperblockError::BufferTooSmall {
                len: out.len(),
                needed: len,
            });
        }
        let b = &mut out[..len];
        b[..SUPERBLOCK_BASE_BYTES].fill(0);
        put32(b, OFF_MAGIC, MD_SB_MAGIC);
        put32(b, OFF_MAJOR, 1);
        put32(b, OFF_FEATURE_MAP, self.feature_map);
        b[OFF_SET_UUID..OFF_SET_UUID + 16].copy_from_slice(&self.set_uuid.0);
        b[OFF_SET_NAME..OFF_SET_NAME + 32].copy_from_slice(&self.set_name);
        put64(b, OFF_CTIME, self.ctime.raw());
        put32(b, OFF_LEVEL, self.level as u32);
        put32(b, OFF_LAYOUT, self.layout);
        put64(b, OFF_SIZE, self.size);
        put32(b, OFF_CHUNKSIZE, self.chunksize);
        put32(b, OFF_RAID_DISKS, self.raid_disks);
        put32(b, OFF_BITMAP_OFFSET, self.bitmap_offset as u32);
        put32(b, OFF_NEW_LEVEL, self.new_level as u32);
        put64(b, OFF_RESHAPE_POSITION, self.reshape_position);
        put32(b, OFF_DELTA_DISKS, self.delta_disks as u32);
        put32(b, OFF_NEW_LAYOUT, self.new_layout);
        put32(b, OFF_NEW_CHUNK, self.new_chunk);
        put32(b, OFF_NEW_OFFSET, self.new_offset as u32);
        put64(b, OFF_DATA_OFFSET, self.data_offset);
        put64(b, OFF_DATA_SIZE, self.data_size);
        put64(b, OFF_SUPER_OFFSET, self.super_offset);
        put64(b, OFF_RECOVERY_OFFSET, self.recovery_offset);
        put32(b, OFF_DEV_NUMBER, self.dev_number);
        put32(b, OFF_CNT_CORRECTED_READ, self.cnt_corrected_read);
        b[OFF_DEVICE_UUID..OFF_DEVICE_UUID + 16].copy_from_slice(&self.device_uuid.0);
        b[OFF_DEVFLAGS] = self.devflags;
        b[OFF_BBLOG_SHIFT] = self.bblog_shift;
        put16(b, OFF_BBLOG_SIZE, self.bblog_size);
        put32(b, OFF_BBLOG_OFFSET, self.bblog_offset as u32);
        put64(b, OFF_UTIME, self.utime.raw());
        put64(b, OFF_EVENTS, self.events);
        put64(b, OFF_RESYNC_OFFSET, self.resync_offset);
        put32(b, OFF_MAX_DEV, max_dev as u32);
        for (i, &r) in self.dev_roles.iter().enumerate() {
            put16(b, SUPERBLOCK_BASE_BYTES + 2 * i, r);
        }
        let csum = calc_sb_1_csum(b, max_dev as u32);
        put32(b, OFF_SB_CSUM, csum);
        Ok(len)
    }

    /// The encoded superblock ([`Superblock::encoded_len`] bytes, checksum filled in).
    ///
    /// # Errors
    /// [`SuperblockError::MaxDevTooLarge`] if `dev_roles` has more than [`MAX_DEV_LIMIT`]
    /// entries.
    pub fn to_bytes(&self) -> Result<Vec<u8>, SuperblockError> {
        let mut v = vec![0u8; self.encoded_len()];
        self.write_into(&mut v)?;
        Ok(v)
    }

    /// The full 4 KiB superblock area as written to a member at
    /// [`SUPERBLOCK_OFFSET_BYTES`]: the encoding, zero-padded to [`SUPERBLOCK_AREA_BYTES`]
    /// (one 4 KiB write, aligned for 4 KiB-sector devices).
    ///
    /// # Errors
    /// As [`Superblock::to_bytes`].
    pub fn to_area(&self) -> Result<[u8; SUPERBLOCK_AREA_BYTES], SuperblockError> {
        let mut a = [0u8; SUPERBLOCK_AREA_BYTES];
        self.write_into(&mut a)?;
        Ok(a)
    }

    /// `sb_csum` as [`Superblock::write_into`] stores it (md's `calc_sb_1_csum` of the
    /// encoding).
    ///
    /// # Errors
    /// As [`Superblock::to_bytes`].
    pub fn checksum(&self) -> Result<u32, SuperblockError> {
        let b = self.to_bytes()?;
        Ok(le32(&b, OFF_SB_CSUM))
    }

    /// `set_name` up to its first NUL (at most 32 bytes), as text (invalid UTF-8 replaced).
    pub fn name(&self) -> String {
        let end = self.set_name.iter().position(|&c| c == 0).unwrap_or(32);
        String::from_utf8_lossy(&self.set_name[..end]).into_owned()
    }

    /// The array's short name: `set_name` after the first `:` (mdadm's `host:name`
    /// convention; `ARRAY /dev/md/<short name>` in `mdadm --examine --brief`), or the whole
    /// name when it has no `:`.
    pub fn short_name(&self) -> String {
        let n = self.name();
        match n.split_once(':') {
            Some((_, short)) => short.to_string(),
            None => n,
        }
    }

    /// `ppl.offset` (signed sectors from the superblock) and `ppl.size` (sectors): the
    /// other reading of the `bitmap_offset` union, meaningful with [`Feature::Ppl`].
    pub fn ppl(&self) -> (i16, u16) {
        let raw = self.bitmap_offset as u32;
        ((raw & 0xffff) as u16 as i16, (raw >> 16) as u16)
    }

    /// Sets `ppl.offset` (signed sectors from the superblock) and `ppl.size` (sectors), the
    /// PPL reading of the `bitmap_offset` union (`md_p.h`; `super_1_sync` writes them
    /// the same way). The feature bit is the caller's: mdadm writes [`Feature::Ppl`]
    /// (`write_init_super1`), the kernel [`Feature::MultiplePpls`] for an area of
    /// [`super::ppl::MULTIPLE_PPL_MIN_SECTORS`] or more (`super_1_sync`), and neither may
    /// be set with [`Feature::BitmapOffset`].
    pub fn set_ppl(&mut self, offset_sectors: i16, size_sectors: u16) {
        self.bitmap_offset =
            ((u32::from(size_sectors) << 16) | u32::from(offset_sectors as u16)) as i32;
    }

    /// The member's PPL area, or `None` without a PPL feature bit, after md's checks and
    /// ferroraid's rules for its RAID6 extension ([`Feature::Raid6Ppl`]):
    /// 0. [`Feature::Raid6Ppl`] only with a PPL bit ([`SuperblockError::Raid6PplBit`]);
    /// 1. not both PPL bits, and neither with [`Feature::BitmapOffset`] or
    ///    [`Feature::Journal`] (`super_1_validate`) ([`SuperblockError::PplFeatures`]);
    /// 2. level 5 (`ppl_init_log`) without [`Feature::Raid6Ppl`], or level 6 with it; a
    ///    RAID5 with the bit is [`SuperblockError::Raid6PplBit`], any other level — RAID6
    ///    without the bit included, md's refusal — [`SuperblockError::PplLevel`];
    /// 3. room for the header and one 4 KiB page; the area (trimmed to whole pages) not
    ///    overlapping the data area (`data_offset .. + data_size`) nor the superblock
    ///    (`ppl_validate_rdev`, native metadata: a positive offset below the superblock's
    ///    size, or a non-positive one whose area reaches past it)
    ///    ([`SuperblockError::PplPlacement`]).
    ///
    /// The same placement and size rules hold for RAID5 and RAID6.
    ///
    /// # Errors
    /// The first rule broken, as listed.
    pub fn ppl_area(&self) -> Result<Option<PplArea>, SuperblockError> {
        let single = self.feature_map & Feature::Ppl.bit() != 0;
        let multiple = self.feature_map & Feature::MultiplePpls.bit() != 0;
        let raid6_bit = self.feature_map & Feature::Raid6Ppl.bit() != 0;
        let raid6_bit_error = |why| SuperblockError::Raid6PplBit {
            feature_map: self.feature_map,
            level: self.level,
            why,
        };
        if !single && !multiple {
            if raid6_bit {
                return Err(raid6_bit_error(
                    "is set without a PPL bit (MD_FEATURE_PPL or MD_FEATURE_MULTIPLE_PPLS): \
                     it marks a RAID6 partial parity log and means nothing alone",
                ));
            }
            return Ok(None);
        }
        let features = |why| SuperblockError::PplFeatures {
            feature_map: self.feature_map,
            why,
        };
        if self.feature_map & Feature::BitmapOffset.bit() != 0 {
            return Err(features("a PPL cannot be combined with an internal bitmap"));
        }
        if self.feature_map & Feature::Journal.bit() != 0 {
            return Err(features("a PPL cannot be combined with a journal"));
        }
        if single && multiple {
            return Err(features(
                "MD_FEATURE_PPL and MD_FEATURE_MULTIPLE_PPLS cannot both be set",
            ));
        }
        match (self.level, raid6_bit) {
            (5, false) | (6, true) => {}
            (5, true) => {
                return Err(raid6_bit_error(
                    "is set on a RAID5: a RAID5 partial parity log is md's own and carries no \
                     ferroraid bit",
                ))
            }
            (level, _) => return Err(SuperblockError::PplLevel { level }),
        }
        let (offset, size) = self.ppl();
        let placement = |why| SuperblockError::PplPlacement { offset, size, why };
        let usable = usable_area_sectors(size).ok_or_else(|| {
            placement("too small for the 4 KiB header and one 4 KiB page of partial parity")
        })?;
        let start = self.super_offset as i128 + i128::from(offset);
        let (data_start, data_end) = (
            i128::from(self.data_offset),
            i128::from(self.data_offset) + i128::from(self.data_size),
        );
        if (start < data_start && start + i128::from(usable) > data_start)
            || (start >= data_start && data_end > start)
        {
            return Err(placement("overlaps the data area"));
        }
        let sb_sectors = (self.encoded_len() as u64).div_ceil(512) as i64;
        let offset64 = i64::from(offset);
        if (offset64 > 0 && offset64 < sb_sectors)
            || (offset64 <= 0 && offset64 + usable as i64 > 0)
        {
            return Err(placement("overlaps the superblock"));
        }
        let start_sector = u64::try_from(start)
            .map_err(|_| placement("starts before the beginning of the device"))?;
        Ok(Some(PplArea {
            offset_sectors: offset,
            size_sectors: size,
            start_sector,
            usable_sectors: usable,
            mode: PplMode::of(usable),
            multiple_feature: multiple,
        }))
    }

    /// The role this member's own superblock gives it: `dev_roles[dev_number]`, or spare
    /// when `dev_number` is beyond `max_dev` (the kernel's `super_1_validate` and mdadm's
    /// `role_from_sb` do the same).
    pub fn role(&self) -> DevRole {
        self.role_of(self.dev_number)
    }

    /// The role `dev_roles` gives slot `dev_number` (spare when beyond `max_dev`).
    pub fn role_of(&self, dev_number: u32) -> DevRole {
        self.dev_roles
            .get(dev_number as usize)
            .map_or(DevRole::Spare, |&r| DevRole::from_raw(r))
    }

    /// The consistency policy this superblock records (mdadm's `--detail` "Consistency
    /// Policy", `sysfs consistency_policy`): `ppl` with a PPL feature bit, `bitmap` with
    /// [`Feature::BitmapOffset`], else `resync`. Whether the combination is valid is
    /// [`Superblock::ppl_area`]'s question.
    pub fn consistency_policy(&self) -> ConsistencyPolicy {
        if self.feature_map & (Feature::Ppl.bit() | Feature::MultiplePpls.bit()) != 0 {
            ConsistencyPolicy::Ppl
        } else if self.feature_map & Feature::BitmapOffset.bit() != 0 {
            ConsistencyPolicy::Bitmap
        } else {
            ConsistencyPolicy::Resync
        }
    }

    /// Whether the array was clean (no resync needed) when this superblock was written:
    /// `resync_offset == MaxSector` (mdadm's `examine_super1` prints "clean", else "active").
    pub fn is_clean(&self) -> bool {
        self.resync_offset == MAX_SECTOR
    }

    /// The geometry this superblock describes, with logical block size `block_bytes`
    /// (512 or 4096; md does not record it: it is the largest logical block size of the
    /// members).
    ///
    /// # Errors
    /// [`SuperblockError::UnsupportedLevel`], [`SuperblockError::UnsupportedLayout`],
    /// [`SuperblockError::ChunkNotRepresentable`], [`SuperblockError::RaidDisks`] or
    /// [`SuperblockError::Geometry`] (member count outside the level's limits, block size).
    pub fn geometry(&self, block_bytes: u32) -> Result<Geometry, SuperblockError> {
        let level = match self.level {
            5 => Level::Raid5,
            6 => Level::Raid6,
            other => return Err(SuperblockError::UnsupportedLevel { level: other }),
        };
        let layout = md_layout(level, self.layout)?;
        let c = self.chunksize;
        if !c.is_power_of_two() || !(8..=crate::geometry::MAX_CHUNK_BYTES / 512).contains(&c) {
            return Err(SuperblockError::ChunkNotRepresentable { chunk_sectors: c });
        }
        let members = u16::try_from(self.raid_disks).map_err(|_| SuperblockError::RaidDisks {
            raid_disks: self.raid_disks,
        })?;
        Ok(Geometry::new(
            level,
            layout,
            members,
            u64::from(c) * 512,
            block_bytes,
        )?)
    }

    /// The array this superblock describes: [`Superblock::geometry`] plus its capacity —
    /// `size / chunksize` stripes (md rounds the component size down to whole chunks,
    /// `raid5.c`: `dev_sectors &= ~(chunk_sectors - 1)`).
    ///
    /// # Errors
    /// As [`Superblock::geometry`], and [`SuperblockError::Geometry`] when the capacity
    /// overflows 64 bits of bytes.
    pub fn array_geometry(&self, block_bytes: u32) -> Result<ArrayGeometry, SuperblockError> {
        let g = self.geometry(block_bytes)?;
        let stripes = self.size / u64::from(g.chunk_sectors());
        Ok(ArrayGeometry::new(g, stripes)?)
    }

    /// `Some(recovery_offset)` when this member is only partly rebuilt
    /// (`MD_FEATURE_RECOVERY_OFFSET` set: valid below that many 512-byte sectors from its
    /// data offset), `None` when it is in sync (md's `super_1_validate`).
    pub fn recovering(&self) -> Option<u64> {
        (self.feature_map & Feature::RecoveryOffset.bit() != 0).then_some(self.recovery_offset)
    }

    /// Whether this device replaces the member of its role (`MD_FEATURE_REPLACEMENT`,
    /// md's `Replacement` flag): it holds the member's data up to [`Self::recovering`].
    pub fn is_replacement(&self) -> bool {
        self.feature_map & Feature::Replacement.bit() != 0
    }

    /// Whether this member's recovery is guided by the write-intent bitmap
    /// (`MD_FEATURE_RECOVERY_BITMAP`: a re-add in progress; md keeps `saved_raid_disk`
    /// then, so the recovery stays bitmap-based after a restart).
    pub fn recovers_by_bitmap(&self) -> bool {
        self.recovering().is_some() && self.feature_map & Feature::RecoveryBitmap.bit() != 0
    }

    /// Checks that ferroraid can serve the array this (format-valid) superblock describes,
    /// in this order:
    /// 1. v1.2 position: `super_offset == 8` ([`SuperblockError::NotVersion12`]);
    /// 2. with a PPL feature bit (or [`Feature::Raid6Ppl`]), md's PPL checks and
    ///    ferroraid's RAID6 PPL rules ([`Superblock::ppl_area`]): an array md would refuse
    ///    is refused for that reason, unless it is ferroraid's RAID6 PPL;
    /// 3. no feature bits outside [`Feature::SUPPORTED`]: every other bit of `feature_map`
    ///    is refused by name with its reason ([`SuperblockError::UnsupportedFeatures`]); an
    ///    internal bitmap must start after the superblock and before the data
    ///    ([`SuperblockError::BitmapPlacement`]; the bitmap itself is checked when read,
    ///    `super::BitmapSuper::check_against`);
    /// 4. level 5 or 6, layout 0..=5, chunk a power of two of 4 KiB..16 MiB, `raid_disks`
    ///    within the level's limits ([`Superblock::geometry`]);
    ///    and a PPL area, if any, large enough for ferroraid's records with this chunk
    ///    ([`SuperblockError::PplAreaTooSmall`]);
    /// 5. `data_offset` beyond the superblock (`super_1_load`:
    ///    `data_offset >= sb_start + sb_size`) ([`SuperblockError::DataOffset`]);
    /// 6. `data_size >= 10` (`super_1_load`) and `size <= data_size`
    ///    ([`SuperblockError::DataSize`]); `size` at least one chunk
    ///    ([`SuperblockError::SizeTooSmall`]);
    /// 7. a reserved bad-block log, if any, between the superblock and the data
    ///    ([`SuperblockError::BadBlockLogPlacement`]);
    /// 8. every `dev_roles` entry a role `< raid_disks`, spare or faulty, and no role held
    ///    by more than two slots — a member and its replacement
    ///    ([`SuperblockError::InvalidRole`], [`SuperblockError::DuplicateRole`]).
    ///
    /// # Errors
    /// The first rule broken, as listed.
    pub fn check_supported(&self) -> Result<(), SuperblockError> {
        if self.super_offset != SUPER_OFFSET_SECTORS {
            return Err(SuperblockError::NotVersion12 {
                super_offset: self.super_offset,
            });
        }
        self.ppl_area()?;
        if self.feature_map & !Feature::SUPPORTED != 0 {
            return Err(SuperblockError::UnsupportedFeatures(FeatureSet(
                self.feature_map & !Feature::SUPPORTED,
            )));
        }
        if self.feature_map & Feature::BitmapOffset.bit() != 0 {
            let sb_sectors = (self.encoded_len() as u64).div_ceil(512) as i64;
            let start = self.super_offset as i64 + i64::from(self.bitmap_offset);
            if i64::from(self.bitmap_offset) < sb_sectors || start >= self.data_offset as i64 {
                return Err(SuperblockError::BitmapPlacement {
                    bitmap_offset: self.bitmap_offset,
                    data_offset: self.data_offset,
                });
            }
        }
        self.geometry(512)?;
        if let Some(area) = self.ppl_area()? {
            let needed = crate::ppl::min_area_bytes(self.chunksize * 512) / 512;
            if area.usable_sectors < needed {
                return Err(SuperblockError::PplAreaTooSmall {
                    usable_sectors: area.usable_sectors,
                    chunk_sectors: self.chunksize,
                    needed_sectors: needed,
                });
            }
        }
        let sb_end = SUPER_OFFSET_SECTORS + (self.encoded_len() as u64).div_ceil(512);
        if self.data_offset < sb_end {
            return Err(SuperblockError::DataOffset {
                data_offset: self.data_offset,
                min: sb_end,
            });
        }
        if self.data_size < 10 || self.size > self.data_size {
            return Err(SuperblockError::DataSize {
                data_size: self.data_size,
                size: self.size,
            });
        }
        if self.size < u64::from(self.chunksize) {
            return Err(SuperblockError::SizeTooSmall {
                size: self.size,
                chunk_sectors: self.chunksize,
            });
        }
        if self.bblog_offset != 0 && self.bblog_size != 0 {
            let start = SUPER_OFFSET_SECTORS as i64 + i64::from(self.bblog_offset);
            let end = start + i64::from(self.bblog_size);
            if start < sb_end as i64 || end as u64 > self.data_offset {
                return Err(SuperblockError::BadBlockLogPlacement {
                    offset: self.bblog_offset,
                    size: self.bblog_size,
                });
            }
        }
        // (first slot holding the role, how many hold it)
        let mut holder: Vec<Option<(u32, u8)>> = vec![None; self.raid_disks as usize];
        for (slot, &raw) in self.dev_roles.iter().enumerate() {
            let slot = slot as u32;
            match DevRole::from_raw(raw) {
                DevRole::Spare | DevRole::Faulty => {}
                DevRole::Active(r) if u32::from(r) < self.raid_disks => {
                    let h = &mut holder[usize::from(r)];
                    match h {
                        None => *h = Some((slot, 1)),
                        // A member and its replacement (md's `rdev` and `replacement`).
                        Some((_, n @ 1)) => *n = 2,
                        Some((first, _)) => {
                            return Err(SuperblockError::DuplicateRole {
                                role: r,
                                first: *first,
                                second: slot,
                            });
                        }
                    }
                }
                _ => {
                    return Err(SuperblockError::InvalidRole {
                        dev_number: slot,
                        role: raw,
                        raid_disks: self.raid_disks,
                    })
                }
            }
        }
        Ok(())
    }
}

/// md's layout id → ferroraid's [`Layout`], with a reason for every refusal
/// (`drivers/md/raid5.h` `ALGORITHM_*`; `algorithm_valid_raid5/6`).
fn md_layout(level: Level, id: u32) -> Result<Layout, SuperblockError> {
    if let Ok(l) = Layout::from_md(id) {
        return Ok(l);
    }
    let reason = match (level, id) {
        (Level::Raid6, 8..=10) => {
            let name = ["ddf-zero-restart", "ddf-N-restart", "ddf-N-continue"][(id - 8) as usize];
            format!("{name}: a DDF (external metadata) rotation, not supported")
        }
        (Level::Raid6, 16..=20) => {
            let name = [
                "left-asymmetric-6",
                "right-asymmetric-6",
                "left-symmetric-6",
                "right-symmetric-6",
                "parity-first-6",
            ][(id - 16) as usize];
            format!(
                "{name}: a RAID5 rotation with Q on the last member, left by a RAID5→RAID6 \
                 conversion; not supported — convert it first (mdadm --grow --layout=normalise)"
            )
        }
        (Level::Raid5, _) => "md's RAID5 layouts are 0..=5 (algorithm_valid_raid5)".to_string(),
        (Level::Raid6, _) => {
            "not an md RAID6 layout (0..=5, 8..=10, 16..=20; algorithm_valid_raid6)".to_string()
        }
    };
    Err(SuperblockError::UnsupportedLayout {
        level,
        layout: id,
        reason,
    })
}

/// Decodes a superblock and checks that ferroraid can serve its array:
/// [`Superblock::decode`] then [`Superblock::check_supported`]. `bytes` is the superblock
/// area read at [`SUPERBLOCK_OFFSET_BYTES`] of a member (at least `256 + 2 × max_dev`
/// bytes; the whole 4 KiB area is fine). Never panics, whatever the input.
///
/// # Errors
/// Any [`SuperblockError`] of the two steps: format errors first (magic, version,
/// `max_dev`, checksum with stored and computed values, padding), then support errors
/// (position, feature bits by name, level, layout, chunk, members, offsets, roles).
pub fn parse(bytes: &[u8]) -> Result<Superblock, SuperblockError> {
    let sb = Superblock::decode(bytes)?;
    sb.check_supported()?;
    Ok(sb)
}
