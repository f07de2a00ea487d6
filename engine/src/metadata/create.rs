//! Superblocks for a new array, laid out the way mdadm 4.2 lays them out.
//!
//! mdadm's rules (`super1.c`), for metadata 1.2:
//! - **Superblock** at 8 sectors (4 KiB) from the start; `max_dev` =
//!   `(roundup(256 + 2 × devices, 512) − 256) / 2` (`init_super1`: 128 for up to 128
//!   devices); `dev_roles` all `0xffff` (spare) but the active members' slots, which hold
//!   their role; `dev_number` = the device's index (`add_to_super1`).
//! - **Bitmap space** reserved after the superblock at `superblock + 8` sectors
//!   (`add_internal_bitmap1`: `offset = 4*2`), sized by [`choose_bitmap_space_sectors`]
//!   (`choose_bm_space`): 4 KiB, 64 KiB above 8 GiB, 128 KiB from 200 GiB.
//! - **Default data offset** ([`default_data_offset_sectors`], `validate_geometry1`):
//!   `12 KiB + bitmap space + headroom`, rounded up to a whole MiB, where headroom (room
//!   for a later reshape to move the data) starts at 128 MiB and halves while it exceeds
//!   ~0.1% of the device and stays at least four chunks. At least 1 MiB; 128 MiB + 1 MiB
//!   (264192 sectors) on large devices. mdadm computes it from the first device and uses
//!   it for all; so does [`NewArray::superblocks`].
//! - **Bad-block log** ([`bad_block_log`], `write_init_super1`): 8 sectors right after the
//!   bitmap space (`bblog_offset = 8 + bitmap space`, relative to the superblock) when the
//!   data offset leaves room, else the 8 sectors just below the data.
//! - `data_size` = device size − `data_offset`; `size` (the part each member contributes)
//!   = the smallest `data_size`, rounded down to whole chunks (`Create.c`).
//! - **Internal bitmap** ([`BitmapChoice`]): mdadm adds one by default when each member
//!   contributes more than 100 GiB (`Create.c`); with one, `feature_map` =
//!   `MD_FEATURE_BITMAP_OFFSET`, `bitmap_offset` = 8 and the bitmap superblock and bits
//!   follow `super::bitmap` (chunk from `choose_bitmap_chunk_bytes`).
//! - **Consistency policy** ([`ConsistencyPolicy`], `mdadm --consistency-policy`):
//!   `resync` (neither bitmap nor PPL), `bitmap` (the internal bitmap) or `ppl` (mdadm:
//!   RAID5 only, `mdadm.c`; ferroraid also on RAID6, its extension; never with a bitmap).
//!   With `ppl`, every member gets `MD_FEATURE_PPL` (on RAID6 also ferroraid's
//!   `FERRORAID_FEATURE_RAID6_PPL`, so kernel md refuses the member) and a PPL area of [`MDADM_PPL_SIZE_SECTORS`] (1 MiB) at
//!   superblock + [`MDADM_PPL_OFFSET_SECTORS`] (`write_init_super1`); the default data
//!   offset reserves the whole 1 MiB instead of the bitmap space (`validate_geometry1`:
//!   `bmspace = MULTIPLE_PPL_AREA_SIZE_SUPER1 >> 9`), and the bad-block log follows the
//!   area. The area starts zeroed with the empty header at its start
//!   ([`NewArray::initial_ppl_area`], `write_init_ppl1`).
//! - `feature_map` 0 without a bitmap or PPL, `events` 0 (`write_init_super1` resets it),
//!   `utime = ctime`, `resync_offset` = `MaxSector` for a clean array (`--assume-clean`)
//!   or 0 when a resync must make the parity consistent.

use rand_chacha::rand_core::RngCore;
use thiserror::Error;

use super::bitmap::{
    check_bitmap_space, choose_bitmap_chunk_bytes, mdadm_adds_bitmap_by_default, Bitmap,
    BitmapError, BitmapSuper, DEFAULT_DAEMON_SLEEP_S,
};
use super::ppl::{PplHeader, MDADM_PPL_OFFSET_SECTORS, MDADM_PPL_SIZE_SECTORS};
use super::superblock::{
    Feature, DEV_ROLE_SPARE, MAX_DEV_LIMIT, MAX_SECTOR, SUPERBLOCK_BASE_BYTES, SUPER_OFFSET_SECTORS,
};
use super::{MdTime, Superblock, Uuid};
use crate::geometry::{Geometry, Level};

/// The default data offset is a whole number of these: 2048 sectors (1 MiB; mdadm's
/// `ONE_MEG`).
pub const DATA_OFFSET_ALIGN_SECTORS: u64 = 2048;
/// Where an internal bitmap goes, in sectors after the superblock (4 KiB: right after the
/// superblock's 4 KiB; mdadm's `add_internal_bitmap1` for 1.1/1.2 when creating).
pub const BITMAP_OFFSET_SECTORS: i32 = 8;
/// Sectors mdadm reserves for the bad-block log (`bblog_size = 8`: 4 KiB, 512 entries).
pub const BAD_BLOCK_LOG_SECTORS: u16 = 8;
/// Longest array name mdadm writes: 31 bytes, so the 32-byte `set_name` stays
/// NUL-terminated (`init_super1` copies at most `sizeof(set_name) - 1`).
pub const MAX_NAME_BYTES: usize = 31;
/// mdadm's metadata overhead before the bitmap in the default data offset: 12 KiB
/// (`validate_geometry1`: `12*2`), sectors.
const BASE_OVERHEAD_SECTORS: u64 = 24;
/// Largest reshape headroom mdadm leaves: 128 MiB, sectors.
const MAX_HEADROOM_SECTORS: u64 = 128 * 1024 * 2;

/// Why a new array's superblocks could not be built.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CreateError {
    /// An empty array name.
    #[error("array name is empty (mdadm would fall back to the md minor number; give a name)")]
    EmptyName,
    /// A name or host name with a NUL or line-feed byte.
    #[error("{what} {value:?} contains a NUL or newline byte")]
    NameByte {
        /// `"name"` or `"homehost"`.
        what: &'static str,
        /// The value.
        value: String,
    },
    /// The name does not fit `set_name`.
    #[error(
        "array name {name:?} is {len} bytes: set_name holds at most {MAX_NAME_BYTES} \
         (32 bytes, NUL-terminated, as mdadm writes it)"
    )]
    NameTooLong {
        /// The name that would be stored (with the host prefix when one applies).
        name: String,
        /// Its length in bytes.
        len: usize,
    },
    /// Fewer devices than the geometry's members, or more than `dev_roles` can hold.
    #[error("{devices} devices given for a {raid_disks}-member array (at most {MAX_DEV_LIMIT} devices in all)")]
    DeviceCount {
        /// Devices given.
        devices: usize,
        /// Members the geometry has.
        raid_disks: u16,
    },
    /// An explicit data offset that overlaps the superblock or is not 4 KiB-aligned.
    #[error(
        "data offset {data_offset} sectors is invalid: it must be a multiple of 8 sectors \
         (4 KiB) and at least {min} sectors (past the superblock)"
    )]
    DataOffset {
        /// The offset asked for, sectors.
        data_offset: u64,
        /// Smallest allowed, sectors.
        min: u64,
    },
    /// The internal bitmap cannot be made (chunk refused, or it does not fit before the
    /// data with an explicit data offset).
    #[error("internal bitmap: {0}")]
    Bitmap(#[from] BitmapError),
    /// A consistency policy together with a bitmap choice that contradicts it (mdadm:
    /// "--bitmap is not compatible with consistency policy", "--bitmap is required for
    /// consistency policy").
    #[error("consistency policy {policy} {why}")]
    PolicyConflict {
        /// The policy asked for.
        policy: ConsistencyPolicy,
        /// What contradicts it.
        why: &'static str,
    },
    /// An explicit data offset that leaves no room for mdadm's PPL area and the bad-block
    /// log after it between the superblock and the data.
    #[error(
        "data offset {data_offset} sectors leaves no room for the PPL area: it needs at \
         least {min} sectors ({MDADM_PPL_SIZE_SECTORS} sectors at {MDADM_PPL_OFFSET_SECTORS} \
         after the superblock, then the {BAD_BLOCK_LOG_SECTORS}-sector bad-block log)"
    )]
    PplSpace {
        /// The data offset asked for, sectors.
        data_offset: u64,
        /// Smallest that holds the area, sectors.
        min: u64,
    },
    /// A device too small for the data offset plus one chunk.
    #[error(
        "device {index} has {device_sectors} sectors: too small for a {data_offset}-sector \
         data offset plus one {chunk_sectors}-sector chunk"
    )]
    DeviceTooSmall {
        /// Index of the device in the list.
        index: usize,
        /// Its size, sectors.
        device_sectors: u64,
        /// The data offset, sectors.
        data_offset: u64,
        /// The chunk size, sectors.
        chunk_sectors: u32,
    },
}

/// Sectors mdadm reserves for an internal bitmap on a device of `device_sectors`
/// (`choose_bm_space`, `super1.c`): none below 64 KiB, 128 KiB (256 sectors) from about
/// 200 GiB, 64 KiB (128 sectors) above 8 GiB, else 4 KiB (8 sectors). Always a multiple
/// of 4 KiB.
pub fn choose_bitmap_space_sectors(device_sectors: u64) -> u64 {
    if device_sectors < 64 * 2 {
        0
    } else if device_sectors - 64 * 2 >= 200 * 1024 * 1024 * 2 {
        128 * 2
    } else if device_sectors - 4 * 2 > 8 * 1024 * 1024 * 2 {
        64 * 2
    } else {
        4 * 2
    }
}

/// mdadm 4.2's default data offset for metadata 1.2 on a device of `device_sectors` with
/// chunks of `chunk_sectors` (`validate_geometry1`, `super1.c`), in sectors:
/// `24 + bitmap space + headroom`, rounded up to [`DATA_OFFSET_ALIGN_SECTORS`] (1 MiB).
/// The headroom starts at 128 MiB and halves while it is more than 1/1024 of the device
/// and half of it is still at least two chunks. The result is at least 1 MiB, leaves room
/// for an internal bitmap at superblock + 8 sectors and for the 8-sector bad-block log,
/// and is 264192 sectors (129 MiB) on devices from about 128 GiB.
pub fn default_data_offset_sectors(device_sectors: u64, chunk_sectors: u32) -> u64 {
    data_offset_reserving(
        device_sectors,
        chunk_sectors,
        choose_bitmap_space_sectors(device_sectors),
    )
}

/// mdadm 4.2's default data offset, in sectors, for a member of an array created with
/// `--consistency-policy=ppl` (`validate_geometry1`, `super1.c`: the space reserved after
/// the superblock is the whole multiple-PPL area, `MULTIPLE_PPL_AREA_SIZE_SUPER1 >> 9` =
/// [`MDADM_PPL_SIZE_SECTORS`], instead of the bitmap space):
/// `ROUND_UP(24 + 2048 + headroom, 2048)`, headroom as in [`default_data_offset_sectors`].
/// At least 2 MiB (4096 sectors); 266240 sectors (130 MiB) on large devices.
pub fn ppl_data_offset_sectors(device_sectors: u64, chunk_sectors: u32) -> u64 {
    data_offset_reserving(
        device_sectors,
        chunk_sectors,
        u64::from(MDADM_PPL_SIZE_SECTORS),
    )
}

/// `validate_geometry1`'s default data offset with `space_sectors` reserved for a bitmap
/// or PPL: `24 + space + headroom` rounded up to 1 MiB, in sectors.
fn data_offset_reserving(device_sectors: u64, chunk_sectors: u32, space_sectors: u64) -> u64 {
    let chunk = u64::from(chunk_sectors);
    let mut headroom = MAX_HEADROOM_SECTORS;
    while (headroom << 10) > device_sectors && (chunk == 0 || headroom / 2 >= chunk * 2) {
        headroom >>= 1;
    }
    let raw = BASE_OVERHEAD_SECTORS + space_sectors + headroom;
    raw.div_ceil(DATA_OFFSET_ALIGN_SECTORS) * DATA_OFFSET_ALIGN_SECTORS
}

/// Where mdadm 4.2 puts the bad-block log of a 1.2 member (`write_init_super1`): returns
/// `(bblog_offset, bblog_size)` in sectors relative to the superblock, or `None` when the
/// data offset leaves no room. `bitmap_space_sectors` is
/// [`choose_bitmap_space_sectors`] of the array's component size (mdadm passes `sb->size`),
/// or [`MDADM_PPL_SIZE_SECTORS`] for a PPL array (`write_init_super1`: `bm_space` is the
/// PPL area, which also starts at superblock + 8).
///
/// With the superblock at sector 8 and the bitmap space at superblock + 8: if
/// `data_offset >= 8 + 8 + bitmap space + 8`, the log follows the bitmap space
/// (`offset = 8 + bitmap space`); else if `data_offset >= 8 + 16`, it takes the 8 sectors
/// just below the data (`offset = data_offset − 8 − 8`); else there is none.
pub fn bad_block_log(data_offset_sectors: u64, bitmap_space_sectors: u64) -> Option<(i32, u16)> {
    let sb = SUPER_OFFSET_SECTORS;
    let bm_offset = BITMAP_OFFSET_SECTORS as u64;
    let log = u64::from(BAD_BLOCK_LOG_SECTORS);
    if data_offset_sectors >= sb + bm_offset + bitmap_space_sectors + log {
        i32::try_from(bm_offset + bitmap_space_sectors)
            .ok()
            .map(|o| (o, BAD_BLOCK_LOG_SECTORS))
    } else if data_offset_sectors >= sb + 16 {
        i32::try_from(data_offset_sectors - log - sb)
            .ok()
            .map(|o| (o, BAD_BLOCK_LOG_SECTORS))
    } else {
        None
    }
}

/// The `set_name` mdadm would write for `name` created on `homehost` (`init_super1`):
/// `homehost:name` when a host is given, the name has no `:` and the result is at most
/// 31 bytes; else `name` as given. NUL-padded to 32 bytes.
///
/// # Errors
/// [`CreateError::EmptyName`]; [`CreateError::NameByte`] for a NUL or newline;
/// [`CreateError::NameTooLong`] when the stored name would exceed [`MAX_NAME_BYTES`]
/// (mdadm would silently truncate it).
pub fn set_name(name: &str, homehost: Option<&str>) -> Result<[u8; 32], CreateError> {
    if name.is_empty() {
        return Err(CreateError::EmptyName);
    }
    let bad = |s: &str| s.bytes().any(|b| b == 0 || b == b'\n');
    if bad(name) {
        return Err(CreateError::NameByte {
            what: "name",
            value: name.to_string(),
        });
    }
    let full = match homehost {
        Some(h) if bad(h) => {
            return Err(CreateError::NameByte {
                what: "homehost",
                value: h.to_string(),
            })
        }
        Some(h) if !h.is_empty() && !name.contains(':') && h.len() + 1 + name.len() < 32 => {
            format!("{h}:{name}")
        }
        _ => name.to_string(),
    };
    if full.len() > MAX_NAME_BYTES {
        return Err(CreateError::NameTooLong {
            len: full.len(),
            name: full,
        });
    }
    let mut out = [0u8; 32];
    out[..full.len()].copy_from_slice(full.as_bytes());
    Ok(out)
}

/// A PPL area of `size_sectors` 512-byte sectors as mdadm's `write_init_ppl1` leaves it
/// (and md's `ppl_write_empty_header`): all zero but for the empty header of array `uuid`
/// ([`PplHeader::empty`]: generation 0, no entries) at its start. `size_sectors` below the
/// 8-sector header is taken as 8 (the header always fits).
pub fn empty_ppl_area(uuid: &Uuid, size_sectors: u16) -> Vec<u8> {
    let header = PplHeader::empty(uuid)
        .encode()
        .expect("the empty header has no entries to refuse");
    let mut area = vec![0u8; (usize::from(size_sectors) * 512).max(header.len())];
    area[..header.len()].copy_from_slice(&header);
    area
}

/// Whether a new array gets an internal write-intent bitmap (`mdadm --bitmap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BitmapChoice {
    /// mdadm's default: internal when each member contributes more than 100 GiB
    /// ([`super::bitmap::mdadm_adds_bitmap_by_default`]), else none.
    #[default]
    Auto,
    /// `--bitmap=internal`.
    Internal,
    /// `--bitmap=none`.
    None,
}

/// How a new array makes its parity consistent after an unclean shutdown: mdadm's
/// `--consistency-policy` values for RAID5/6 (`consistency_policies`, `maps.c`; mdadm's
/// `none` is for levels without redundancy and `journal` needs a journal device, which
/// ferroraid does not have).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConsistencyPolicy {
    /// `resync`: no bitmap, no log; a dirty array is resynced in full.
    Resync,
    /// `bitmap`: the internal write-intent bitmap; only dirty regions are resynced.
    Bitmap,
    /// `ppl`: md's Partial Parity Log on RAID5, ferroraid's RAID6 extension of it on
    /// RAID6 ([`Feature::Raid6Ppl`]); also closes the write hole.
    Ppl,
}

impl ConsistencyPolicy {
    /// mdadm's name (`resync`, `bitmap`, `ppl`).
    pub fn name(self) -> &'static str {
        match self {
            ConsistencyPolicy::Resync => "resync",
            ConsistencyPolicy::Bitmap => "bitmap",
            ConsistencyPolicy::Ppl => "ppl",
        }
    }
}

impl std::fmt::Display for ConsistencyPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ConsistencyPolicy {
    type Err = String;

    /// mdadm's names; `none` and `journal` are refused with the reason.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "resync" => Ok(ConsistencyPolicy::Resync),
            "bitmap" => Ok(ConsistencyPolicy::Bitmap),
            "ppl" => Ok(ConsistencyPolicy::Ppl),
            "none" => Err(
                "\"none\" is md's policy for levels without redundancy (RAID0, \
                 linear); RAID5/6 take resync, bitmap or ppl"
                    .into(),
            ),
            "journal" => Err("\"journal\" needs a RAID5/6 write journal device, which \
                 ferroraid does not support; use resync, bitmap or ppl"
                .into()),
            _ => Err(format!("{s:?}: expected resync, bitmap or ppl")),
        }
    }
}

/// What a new array is: the inputs of mdadm's `--create` that end up in the superblock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewArray {
    /// Level, layout, member count and chunk size (`level`, `layout`, `raid_disks`,
    /// `chunksize`).
    pub geometry: Geometry,
    /// The array UUID (`set_uuid`); [`Uuid::random`] for a new one.
    pub uuid: Uuid,
    /// `set_name`, from [`set_name`].
    pub name: [u8; 32],
    /// Creation time (`ctime`, also the first `utime`).
    pub ctime: MdTime,
    /// `true`: the members are known consistent (e.g. all zeroes, or `--assume-clean`), so
    /// `resync_offset` = `MaxSector`; `false`: `resync_offset` = 0, a resync must compute
    /// the parity before the redundancy can be trusted.
    pub clean: bool,
    /// Data offset in sectors for every member, or `None` for mdadm's default
    /// ([`default_data_offset_sectors`] of the first device).
    pub data_offset_sectors: Option<u64>,
    /// Internal bitmap or not ([`BitmapChoice::Auto`]: mdadm's rule).
    pub bitmap: BitmapChoice,
    /// `--bitmap-chunk`, bytes per bit; `None` for mdadm's default
    /// ([`super::bitmap::choose_bitmap_chunk_bytes`]).
    pub bitmap_chunk_bytes: Option<u64>,
    /// `--delay`: the bitmap daemon's sleep, seconds (mdadm's default 5).
    pub bitmap_daemon_sleep_s: u32,
    /// `--consistency-policy`, or `None` for mdadm's default (the [`NewArray::bitmap`]
    /// choice decides: a bitmap or `resync`); see [`NewArray::policy`].
    pub consistency_policy: Option<ConsistencyPolicy>,
}

impl NewArray {
    /// A new array description with mdadm's defaults: name stored per [`set_name`], not
    /// clean (a resync follows), default data offset.
    ///
    /// # Errors
    /// As [`set_name`].
    pub fn new(
        geometry: Geometry,
        uuid: Uuid,
        name: &str,
        homehost: Option<&str>,
        ctime: MdTime,
    ) -> Result<Self, CreateError> {
        Ok(NewArray {
            geometry,
            uuid,
            name: set_name(name, homehost)?,
            ctime,
            clean: false,
            data_offset_sectors: None,
            bitmap: BitmapChoice::Auto,
            bitmap_chunk_bytes: None,
            bitmap_daemon_sleep_s: DEFAULT_DAEMON_SLEEP_S,
            consistency_policy: None,
        })
    }

    /// The consistency policy of the new array for members contributing `size_sectors`
    /// each, after mdadm's checks (`mdadm.c` for `--create`, `Create.c` for the default):
    /// - no policy given: [`NewArray::bitmap`] decides — a bitmap when asked for, or by
    ///   default when each member contributes more than 100 GiB; else `resync`;
    /// - `ppl`: md's PPL on RAID5 (mdadm allows level 5 only) and ferroraid's RAID6 PPL
    ///   extension on RAID6 (which kernel md cannot assemble); no internal bitmap
    ///   ([`CreateError::PolicyConflict`]; `Auto` means none); at most
    ///   [`crate::ppl::MAX_PPL_MEMBERS`] members ([`CreateError::PolicyConflict`]);
    /// - `resync`: no internal bitmap ([`CreateError::PolicyConflict`]);
    /// - `bitmap`: the internal bitmap (`Auto` becomes one; mdadm requires
    ///   `--bitmap=internal` spelled out), not `BitmapChoice::None`
    ///   ([`CreateError::PolicyConflict`]).
    ///
    /// # Errors
    /// As listed.
    pub fn policy(&self, size_sectors: u64) -> Result<ConsistencyPolicy, CreateError> {
        let conflict = |policy, why| Err(CreateError::PolicyConflict { policy, why });
        match (self.consistency_policy, self.bitmap) {
            (None, BitmapChoice::Internal) => Ok(ConsistencyPolicy::Bitmap),
            (None, BitmapChoice::None) => Ok(ConsistencyPolicy::Resync),
            (None, BitmapChoice::Auto) => Ok(if mdadm_adds_bitmap_by_default(size_sectors) {
                ConsistencyPolicy::Bitmap
            } else {
                ConsistencyPolicy::Resync
            }),
            (
                Some(p @ (ConsistencyPolicy::Ppl | ConsistencyPolicy::Resync)),
                BitmapChoice::Internal,
            ) => conflict(
                p,
                "is not compatible with an internal write-intent bitmap (md keeps one \
                     or the other)",
            ),
            (Some(p @ ConsistencyPolicy::Bitmap), BitmapChoice::None) => conflict(
                p,
                "needs an internal write-intent bitmap, but none was asked for (--bitmap none)",
            ),
            (Some(p @ ConsistencyPolicy::Ppl), _)
                if self.geometry.members() > crate::ppl::MAX_PPL_MEMBERS =>
            {
                conflict(
                    p,
                    "supports at most 64 members (md's limit, raid5-ppl.c ppl_init_log)",
                )
            }
            (Some(p), _) => Ok(p),
        }
    }

    /// The bitmap superblock of the new array when it gets an internal bitmap
    /// ([`NewArray::policy`] is `bitmap`), for members contributing `size_sectors` each;
    /// `None` without one.
    ///
    /// # Errors
    /// As [`NewArray::policy`]; [`CreateError::Bitmap`]: chunk refused or too small for
    /// the space ([`choose_bitmap_chunk_bytes`]), or a daemon sleep of 0.
    pub fn bitmap_super(&self, size_sectors: u64) -> Result<Option<BitmapSuper>, CreateError> {
        if self.policy(size_sectors)? != ConsistencyPolicy::Bitmap {
            return Ok(None);
        }
        if self.bitmap_daemon_sleep_s == 0 {
            return Err(BitmapError::DaemonSleep { daemon_sleep_s: 0 }.into());
        }
        let chunk = choose_bitmap_chunk_bytes(size_sectors, self.bitmap_chunk_bytes)?;
        let chunk = u32::try_from(chunk)
            .map_err(|_| BitmapError::ChunkNotPowerOfTwo { chunk_bytes: chunk })?;
        Ok(Some(BitmapSuper::new(
            self.uuid,
            size_sectors,
            chunk,
            self.bitmap_daemon_sleep_s,
        )))
    }

    /// The bitmap area to write at each member's bitmap start (absolute member byte
    /// `(super_offset + bitmap_offset) × 512`) for a new array, or `None` without a bitmap:
    /// every bit set like mdadm writes it (the whole 4 KiB-rounded area 0xff after the
    /// superblock) when a resync follows; every bit clear when the array is created
    /// clean (`--assume-clean`: nothing needs a resync; mdadm still writes 0xff there,
    /// which md then clears lazily without resyncing because `resync_offset` is
    /// `MaxSector`).
    ///
    /// # Errors
    /// As [`NewArray::bitmap_super`].
    pub fn initial_bitmap_area(&self, size_sectors: u64) -> Result<Option<Vec<u8>>, CreateError> {
        Ok(self.bitmap_super(size_sectors)?.map(|s| {
            let dirty = !self.clean;
            Bitmap::new(s, dirty).to_area(dirty)
        }))
    }

    /// The PPL area to write at each member's PPL start (absolute member byte
    /// `(super_offset + ppl.offset) × 512`) for a new array with the `ppl` policy, or
    /// `None` without one: [`MDADM_PPL_SIZE_SECTORS`] × 512 bytes (1 MiB), zero but for
    /// the empty header ([`PplHeader::empty`]: generation 0, no entries, the array's
    /// signature) at its start, as mdadm's `write_init_ppl1` leaves it (it zeroes the
    /// whole area, then writes the header).
    ///
    /// # Errors
    /// As [`NewArray::policy`].
    pub fn initial_ppl_area(&self, size_sectors: u64) -> Result<Option<Vec<u8>>, CreateError> {
        if self.policy(size_sectors)? != ConsistencyPolicy::Ppl {
            return Ok(None);
        }
        Ok(Some(empty_ppl_area(&self.uuid, MDADM_PPL_SIZE_SECTORS)))
    }

    /// `max_dev` for `devices` devices (members + spares), as mdadm's `init_super1`
    /// computes it: the superblock rounded up to whole 512-byte sectors, all of it roles.
    pub fn max_dev_for(devices: usize) -> u32 {
        let bytes = (SUPERBLOCK_BASE_BYTES + 2 * devices).div_ceil(512) * 512;
        (((bytes - SUPERBLOCK_BASE_BYTES) / 2) as u32).min(MAX_DEV_LIMIT)
    }

    /// The superblock of every device of the new array. `device_sectors[i]` is the size of
    /// device `i` in sectors; the first `geometry.members()` devices become active members
    /// with role = index, any further ones spares. Each gets a random `device_uuid` from
    /// `rng`. The data offset, `size`, `data_size`, bad-block log, `max_dev` and roles
    /// follow mdadm 4.2 (module docs).
    ///
    /// With an internal bitmap ([`NewArray::bitmap_super`]) every superblock gets
    /// `MD_FEATURE_BITMAP_OFFSET` and `bitmap_offset` = [`BITMAP_OFFSET_SECTORS`]; write
    /// [`NewArray::initial_bitmap_area`] there. With the `ppl` policy every superblock
    /// gets `MD_FEATURE_PPL` (and on RAID6 [`Feature::Raid6Ppl`]), `ppl.offset` =
    /// [`MDADM_PPL_OFFSET_SECTORS`], `ppl.size` = [`MDADM_PPL_SIZE_SECTORS`]
    /// (`write_init_super1`), the default data offset is
    /// [`ppl_data_offset_sectors`] and the bad-block log follows the area; write
    /// [`NewArray::initial_ppl_area`] there.
    ///
    /// # Errors
    /// [`CreateError::DeviceCount`], [`CreateError::DataOffset`] (explicit offset below the
    /// superblock's end or not 4 KiB-aligned), [`CreateError::PplSpace`] (an explicit
    /// offset below the end of the PPL area and the bad-block log after it), [`CreateError::DeviceTooSmall`],
    /// [`CreateError::PolicyConflict`] ([`NewArray::policy`]),
    /// [`CreateError::Bitmap`] (bitmap chunk refused, or the bitmap does not fit before an
    /// explicit data offset).
    pub fn superblocks<R: RngCore + ?Sized>(
        &self,
        device_sectors: &[u64],
        rng: &mut R,
    ) -> Result<Vec<Superblock>, CreateError> {
        let raid_disks = self.geometry.members();
        if device_sectors.len() < usize::from(raid_disks)
            || device_sectors.len() > MAX_DEV_LIMIT as usize
        {
            return Err(CreateError::DeviceCount {
                devices: device_sectors.len(),
                raid_disks,
            });
        }
        let max_dev = Self::max_dev_for(device_sectors.len());
        let chunk = self.geometry.chunk_sectors();
        // An explicit policy does not depend on the size: check it before any sizing.
        let ppl = match self.consistency_policy {
            Some(_) => self.policy(0)? == ConsistencyPolicy::Ppl,
            None => false,
        };
        let data_offset = match self.data_offset_sectors {
            Some(d) => {
                let min = SUPER_OFFSET_SECTORS
                    + ((SUPERBLOCK_BASE_BYTES + 2 * max_dev as usize) as u64).div_ceil(512);
                if d < min || !d.is_multiple_of(8) {
                    return Err(CreateError::DataOffset {
                        data_offset: d,
                        min,
                    });
                }
                // The area and the bad-block log after it (mdadm would put the log just
                // below the data, inside the area, with less room).
                let ppl_min = SUPER_OFFSET_SECTORS
                    + MDADM_PPL_OFFSET_SECTORS as u64
                    + u64::from(MDADM_PPL_SIZE_SECTORS)
                    + u64::from(BAD_BLOCK_LOG_SECTORS);
                if ppl && d < ppl_min {
                    return Err(CreateError::PplSpace {
                        data_offset: d,
                        min: ppl_min,
                    });
                }
                d
            }
            None if ppl => ppl_data_offset_sectors(device_sectors[0], chunk),
            None => default_data_offset_sectors(device_sectors[0], chunk),
        };
        let mut smallest = u64::MAX;
        for (index, &dev) in device_sectors.iter().enumerate() {
            if dev < data_offset.saturating_add(u64::from(chunk)) {
                return Err(CreateError::DeviceTooSmall {
                    index,
                    device_sectors: dev,
                    data_offset,
                    chunk_sectors: chunk,
                });
            }
            smallest = smallest.min(dev - data_offset);
        }
        let size = smallest / u64::from(chunk) * u64::from(chunk);
        let bitmap = self.bitmap_super(size)?;
        let mut sbs: Vec<Superblock> = device_sectors
            .iter()
            .enumerate()
            .map(|(i, &dev)| {
                self.member_superblock(
                    i as u32,
                    dev - data_offset,
                    data_offset,
                    size,
                    max_dev,
                    Uuid::random(rng),
                )
            })
            .collect();
        if let Some(bm) = bitmap {
            for sb in &mut sbs {
                sb.feature_map |= Feature::BitmapOffset.bit();
                sb.bitmap_offset = BITMAP_OFFSET_SECTORS;
                check_bitmap_space(sb, bm.bits())?;
            }
        }
        if self.policy(size)? == ConsistencyPolicy::Ppl {
            let raid6 = if self.geometry.level() == Level::Raid6 {
                Feature::Raid6Ppl.bit()
            } else {
                0
            };
            for sb in &mut sbs {
                sb.feature_map |= Feature::Ppl.bit() | raid6;
                sb.set_ppl(MDADM_PPL_OFFSET_SECTORS, MDADM_PPL_SIZE_SECTORS);
                // The bad-block log follows the PPL area, not the bitmap space.
                let (offset, len) =
                    bad_block_log(data_offset, u64::from(MDADM_PPL_SIZE_SECTORS)).unwrap_or((0, 0));
                sb.bblog_offset = offset;
                sb.bblog_size = len;
            }
        }
        Ok(sbs)
    }

    /// One device's superblock: slot `dev_number` (an active member with role
    /// `dev_number` when below `geometry.members()`, else a spare), `data_size_sectors` of
    /// the device usable from `data_offset_sectors`, the array using `size_sectors` of each
    /// member, `max_dev` role slots, and `device_uuid`. The bad-block log goes where
    /// mdadm puts it ([`bad_block_log`]). The values are taken as given: use
    /// [`NewArray::superblocks`] for the checked, mdadm-computed ones.
    pub fn member_superblock(
        &self,
        dev_number: u32,
        data_size_sectors: u64,
        data_offset_sectors: u64,
        size_sectors: u64,
        max_dev: u32,
        device_uuid: Uuid,
    ) -> Superblock {
        let g = &self.geometry;
        let members = u32::from(g.members());
        let dev_roles = (0..max_dev)
            .map(|i| {
                if i < members {
                    i as u16
                } else {
                    DEV_ROLE_SPARE
                }
            })
            .collect();
        let (bblog_offset, bblog_size) = bad_block_log(
            data_offset_sectors,
            choose_bitmap_space_sectors(size_sectors),
        )
        .unwrap_or((0, 0));
        Superblock {
            feature_map: 0,
            set_uuid: self.uuid,
            set_name: self.name,
            ctime: self.ctime,
            level: g.level().md_level() as i32,
            layout: g.layout().md_id(),
            size: size_sectors,
            chunksize: g.chunk_sectors(),
            raid_disks: members,
            bitmap_offset: 0,
            new_level: 0,
            reshape_position: 0,
            delta_disks: 0,
            new_layout: 0,
            new_chunk: 0,
            new_offset: 0,
            data_offset: data_offset_sectors,
            data_size: data_size_sectors,
            super_offset: SUPER_OFFSET_SECTORS,
            recovery_offset: 0,
            dev_number,
            cnt_corrected_read: 0,
            device_uuid,
            devflags: 0,
            bblog_shift: 0,
            bblog_size,
            bblog_offset,
            utime: self.ctime,
            events: 0,
            resync_offset: if self.clean { MAX_SECTOR } else { 0 },
            dev_roles,
        }
    }
}
