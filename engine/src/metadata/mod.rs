//! md's v1.2 superblock: the on-disk metadata of every ferroraid member.
//!
//! ferroraid does not invent a format. Every member carries Linux md's version-1
//! superblock (`struct mdp_superblock_1`, `include/uapi/linux/raid/md_p.h`) in the
//! **v1.2 position: 4 KiB from the start of the member** (`super_offset` = 8 sectors), so
//! `mdadm --examine` reads ferroraid members and an array moves between kernel md and
//! ferroraid in both directions. `docs/FORMAT.md` describes the format as ferroraid uses it.
//!
//! - [`Superblock`] holds every field of `mdp_superblock_1`; [`Superblock::decode`] checks
//!   the format (magic, version, `max_dev`, checksum, padding) and [`parse`] also checks
//!   that ferroraid can serve the array (level, layout, chunk, feature bits, offsets).
//!   [`Superblock::to_bytes`] / [`Superblock::write_into`] encode it with md's checksum.
//! - [`NewArray`] builds the superblocks of a new array the way mdadm 4.2 does (default
//!   data offset, bad-block log placement, `max_dev`, roles, events).
//! - [`next_generation`] produces the next superblock of every member (events bumped,
//!   state updated) so a crash in the middle of writing them leaves a consistent set;
//!   [`switch_consistency_policy`] switches a stopped, clean array between `ppl` and
//!   `resync` (the way back to md for a RAID6 PPL array).
//! - [`bitmap`] is md's internal write-intent bitmap: [`BitmapSuper`] (`bitmap_super_t`),
//!   the bit layout, mdadm's sizing, and the checks of a bitmap read from disk.
//! - [`ppl`] is md's Partial Parity Log: the record format ([`PplHeader`], [`PplEntry`]),
//!   the scan of a member's PPL area for its newest record, and recovery planning.
//! - [`assemble`] decides, from the superblocks found on a set of devices, which device
//!   serves which role, which are stale, spare or missing, and whether the array may start.
//!
//! The module does no I/O (the engine makes no syscalls): reading and writing the 4 KiB
//! superblock area of a file or block device is `drivers::metadata_io`.
//!
//! **Units.** md counts offsets and sizes in **512-byte sectors** whatever the device's
//! logical block size; every field and parameter here whose name ends in `_sectors`, and
//! every raw superblock field documented "sectors", uses that unit. Byte quantities say
//! `_bytes`.
//!
//! Sources: the kernel's `md_p.h` (layout and constants), `drivers/md/md.c`
//! (`calc_sb_1_csum`, `super_1_load`, `super_1_validate`, `super_1_sync`), mdadm 4.2's
//! `super1.c` (`init_super1`, `write_init_super1`, `validate_geometry1`,
//! `choose_bm_space`, `examine_super1`) and `Assemble.c`, and the kernel's
//! `Documentation/admin-guide/md.rst`.

mod assemble;
pub mod bitmap;
mod create;
pub mod ppl;
pub mod pr_record;
mod superblock;
mod update;

#[cfg(test)]
mod bitmap_tests;
#[cfg(test)]
mod ppl_tests;
#[cfg(test)]
mod tests;

pub use assemble::{
    assemble, readd_recovery, ArrayBitmap, AssembleError, AssembleOptions, Assembly, Candidate,
    Exclusion, ExclusionReason, ForcedAction, FullRebuildReason, Member, ReAdd, ReaddBitmap,
    Recovery, ReplacementMember, EVENT_MARGIN,
};
pub use bitmap::{Bitmap, BitmapError, BitmapSuper};
pub use create::{
    bad_block_log, choose_bitmap_space_sectors, default_data_offset_sectors, empty_ppl_area,
    ppl_data_offset_sectors, set_name, BitmapChoice, ConsistencyPolicy, CreateError, NewArray,
    BAD_BLOCK_LOG_SECTORS, BITMAP_OFFSET_SECTORS, DATA_OFFSET_ALIGN_SECTORS, MAX_NAME_BYTES,
};
pub use ppl::{PplArea, PplEntry, PplError, PplHeader};
pub use superblock::{
    parse, raw_checksum, DevRole, Feature, FeatureSet, Superblock, SuperblockError,
    DEV_ROLE_FAULTY, DEV_ROLE_JOURNAL, DEV_ROLE_MAX, DEV_ROLE_SPARE, FEATURE_ALL,
    FERRORAID_FEATURE_RAID6_PPL, MAX_DEV_LIMIT, MAX_SECTOR, MD_SB_MAGIC, SUPERBLOCK_AREA_BYTES,
    SUPERBLOCK_BASE_BYTES, SUPERBLOCK_OFFSET_BYTES, SUPER_OFFSET_SECTORS,
};
pub use update::{
    joining_member, mdadm_ppl_placement, next_generation, switch_consistency_policy,
    PolicyChangeError, Resync, Update, UpdateError, MIN_PPL_SPACE_SECTORS,
};

use std::fmt;
use std::str::FromStr;

use rand_chacha::rand_core::RngCore;
use thiserror::Error;

/// A 16-byte md UUID (`set_uuid`, `device_uuid`), printed the way mdadm prints it:
/// four groups of eight hex digits separated by `:` (`examine_super1`), bytes in on-disk
/// order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Uuid(pub [u8; 16]);

impl Uuid {
    /// A random UUID from `rng`: 16 random bytes, as mdadm's `random_uuid` makes them
    /// (no RFC 4122 version bits; md treats the UUID as an opaque identifier).
    pub fn random<R: RngCore + ?Sized>(rng: &mut R) -> Self {
        let mut b = [0u8; 16];
        rng.fill_bytes(&mut b);
        Uuid(b)
    }

    /// The 16 bytes, in on-disk order.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Display for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, b) in self.0.iter().enumerate() {
            if i > 0 && i % 4 == 0 {
                f.write_str(":")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Uuid({self})")
    }
}

/// A UUID string that is not 32 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "invalid UUID {0:?}: expected 32 hex digits, optionally separated by ':', '-', '.' or ' ' \
     (mdadm prints xxxxxxxx:xxxxxxxx:xxxxxxxx:xxxxxxxx)"
)]
pub struct UuidParseError(pub String);

impl FromStr for Uuid {
    type Err = UuidParseError;
    /// Accepts mdadm's form (`xxxxxxxx:xxxxxxxx:xxxxxxxx:xxxxxxxx`), the RFC 4122 form with
    /// dashes, or plain hex: like mdadm's `parse_uuid`, separators `:`, `-`, `.` and space
    /// are skipped.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 16];
        let mut n = 0usize;
        for c in s.chars() {
            if matches!(c, ':' | '-' | '.' | ' ') {
                continue;
            }
            let d = c
                .to_digit(16)
                .ok_or_else(|| UuidParseError(s.to_string()))?;
            if n >= 32 {
                return Err(UuidParseError(s.to_string()));
            }
            out[n / 2] |= (d as u8) << if n.is_multiple_of(2) { 4 } else { 0 };
            n += 1;
        }
        if n != 32 {
            return Err(UuidParseError(s.to_string()));
        }
        Ok(Uuid(out))
    }
}

/// md's time stamp (`ctime`, `utime`): low 40 bits seconds since the Unix epoch, high
/// 24 bits microseconds (or 0) — `md_p.h`: "lo 40 bits are seconds, top 24 are
/// microseconds or 0".
///
/// **Write microseconds 0.** Nobody else writes them: mdadm stores `time(0)`
/// (`init_super1`), the kernel `ktime_get_real_seconds()` (`super_1_sync`), and current
/// kernels (since the time64_t conversion; 6.1 here) read the *whole* 64-bit field as
/// seconds in `super_1_validate`, so a stamp with microseconds becomes a date past 2106
/// (`mdadm --detail` on the assembled array shows "Sun Feb  7 06:28:15 2106", the
/// clamped value). `tests/qemu/md-reverse.sh` checks md's view against the superblocks.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct MdTime(u64);

impl MdTime {
    /// Largest representable seconds value (2^40 − 1, in the year 36812).
    pub const MAX_SECONDS: u64 = (1 << 40) - 1;

    /// A time stamp from Unix seconds and microseconds. Seconds above
    /// [`MdTime::MAX_SECONDS`] saturate to it, microseconds above 999 999 to 999 999 (the
    /// field cannot hold more; neither happens for a real clock before the year 36812).
    pub fn new(seconds: u64, micros: u32) -> Self {
        let s = seconds.min(Self::MAX_SECONDS);
        let us = u64::from(micros.min(999_999));
        MdTime(s | (us << 40))
    }

    /// The raw 64-bit field as stored on disk.
    pub fn from_raw(raw: u64) -> Self {
        MdTime(raw)
    }

    /// The raw 64-bit field.
    pub fn raw(self) -> u64 {
        self.0
    }

    /// Seconds since the Unix epoch (low 40 bits).
    pub fn seconds(self) -> u64 {
        self.0 & Self::MAX_SECONDS
    }

    /// Microseconds (high 24 bits; not checked to be below 10^6 when read from disk).
    pub fn micros(self) -> u32 {
        (self.0 >> 40) as u32
    }
}

impl fmt::Debug for MdTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MdTime({}.{:06})", self.seconds(), self.micros())
    }
}
