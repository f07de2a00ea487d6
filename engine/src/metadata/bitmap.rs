//! md's internal write-intent bitmap: the on-disk format, where it sits, how mdadm 4.2
//! sizes it, and the checks a bitmap read from disk must pass.
//!
//! **Where.** With `MD_FEATURE_BITMAP_OFFSET` (feature bit value 1) in the md superblock's
//! `feature_map`, the bitmap starts `bitmap_offset` (signed) sectors from the superblock:
//! absolute member sector `super_offset + bitmap_offset` (for v1.2 as mdadm creates it:
//! 8 + 8 = sector 16, byte 8192). mdadm's `locate_bitmap1`, the kernel's
//! `md_bitmap_read_sb` (`mddev->bitmap_info.offset`).
//!
//! **What.** A 256-byte little-endian `bitmap_super_t` (`drivers/md/md-bitmap.h`,
//! mdadm `bitmap.h`), then the bit array right after it, one bit per *bitmap chunk*:
//!
//! | byte | size | field              | meaning                                                 |
//! |-----:|-----:|--------------------|---------------------------------------------------------|
//! |   0  | 4    | `magic`            | [`BITMAP_MAGIC`] 0x6d746962 ("bitm" read as le32)       |
//! |   4  | 4    | `version`          | 3 (host-endian bits), 4 (little-endian bits), 5 cluster |
//! |   8  | 16   | `uuid`             | the array's `set_uuid`                                  |
//! |  24  | 8    | `events`           | md superblock `events` when the bitmap was last written |
//! |  32  | 8    | `events_cleared`   | array `events` when a bit was last cleared              |
//! |  40  | 8    | `sync_size`        | sectors of each member the bitmap covers (`size`)       |
//! |  48  | 4    | `state`            | bit 1 stale, bit 2 write error, bit 15 host-endian      |
//! |  52  | 4    | `chunksize`        | bytes of each member one bit covers (power of two)      |
//! |  56  | 4    | `daemon_sleep`     | seconds between bitmap-daemon passes                    |
//! |  60  | 4    | `write_behind`     | max outstanding write-behind writes (RAID1 only)        |
//! |  64  | 4    | `sectors_reserved` | sectors reserved for the bitmap (0: not recorded)       |
//! |  68  | 4    | `nodes`            | cluster nodes (0: not clustered)                        |
//! |  72  | 64   | `cluster_name`     | NUL-padded                                              |
//! | 136  | 120  | pad                | zero                                                    |
//!
//! **Bits.** Bit `k` covers member data sectors `[k·c, (k+1)·c)` with `c = chunksize/512`,
//! counted from `data_offset` on every member at once (RAID5/6 bitmaps cover the
//! per-member "resync" space, `mddev->resync_max_sectors`), so one bit is a run of whole
//! or partial stripes. There are `ceil(sync_size·512 / chunksize)` bits. Bit `k` is byte
//! `256 + k/8` from the bitmap start, mask `1 << (k % 8)` (`set_bit_le` on bit
//! `k + 256·8`: the kernel's `file_page_offset` counts the superblock in; version 3 uses
//! host order, the same bytes on a little-endian host). The on-disk area is
//! `256 + ceil(bits/8)` bytes rounded up to 4 KiB (mdadm's `calc_bitmap_size`).
//!
//! **Sizing for a new 1.2 array** ([`choose_bitmap_chunk_bytes`], mdadm 4.2
//! `add_internal_bitmap1`): the room is [`choose_bitmap_space_sectors`] of the component
//! size, capped at 128 KiB when no chunk was asked for; `min_chunk` starts at 4 KiB and
//! doubles until `size·512/min_chunk + 1` bits fit `(room·512 − 256)·8`; the default chunk
//! is `max(min_chunk, 64 MiB)`, an explicit one must be at least `min_chunk`. mdadm adds
//! an internal bitmap by default when each member contributes more than 100 GiB
//! ([`mdadm_adds_bitmap_by_default`], `Create.c`); mdadm writes the whole area with every
//! bit set (`write_bitmap1`: `memset(buf, 0xff, 4096)`), `events` and `events_cleared` 0,
//! `daemon_sleep` 5 s (`DEFAULT_BITMAP_DELAY`), `sectors_reserved` 0.
//!
//! **Reading.** [`BitmapSuper::decode`] refuses what the kernel's `md_bitmap_read_sb`
//! refuses (bad magic, version outside 3..=5, chunk below 512 bytes or not a power of two,
//! `daemon_sleep` 0, `write_behind` above 16383) plus clustered bitmaps (version 5 /
//! `nodes` > 0, which ferroraid does not serve); [`BitmapSuper::check_against`] checks it
//! belongs to the array (UUID, `sync_size`) and that its bits fit the space between the
//! superblock and the data (and the bad-block log) — no bit may lie beyond it.
//!
//! **Events.** The kernel writes the bitmap superblock with the array's `events` before
//! each md superblock update (`md_update_sb` → `md_bitmap_update_sb`); a bitmap whose
//! `events` is below the superblock's is stale and md then treats every bit as dirty
//! ("bitmap file is out of date ... forcing full recovery"). `events_cleared` is the
//! array's `events` when a bit was last cleared (`md_bitmap_endwrite` updates it only for
//! writes that reached every member); a member whose `events` is at least
//! `events_cleared` missed only writes still marked in the bitmap and can be re-added
//! with a bitmap-based recovery (`super_1_validate`), an older one needs a full rebuild.

use thiserror::Error;

use super::create::choose_bitmap_space_sectors;
use super::superblock::{Feature, Superblock, SUPERBLOCK_BASE_BYTES};
use super::Uuid;

/// `BITMAP_MAGIC`: the first le32 of a bitmap superblock ("bitm").
pub const BITMAP_MAGIC: u32 = 0x6d74_6962;
/// Size of `bitmap_super_t` in bytes; the bits follow it.
pub const BITMAP_SUPER_BYTES: usize = 256;
/// `BITMAP_MAJOR_LO` / `BITMAP_MAJOR_HOSTENDIAN`: bits in host order (little-endian on
/// every host ferroraid runs on).
pub const BITMAP_MAJOR_HOSTENDIAN: u32 = 3;
/// `BITMAP_MAJOR_HI`: bits little-endian; what mdadm 4.2 writes and ferroraid writes.
pub const BITMAP_MAJOR_HI: u32 = 4;
/// `BITMAP_MAJOR_CLUSTERED`: one bitmap per cluster node (md-cluster); not served.
pub const BITMAP_MAJOR_CLUSTERED: u32 = 5;
/// `state` bit: the bitmap is out of date; every bit must be treated as set
/// (`BITMAP_STALE` = bit 1).
pub const BITMAP_STATE_STALE: u32 = 1 << 1;
/// `state` bit: a bitmap write failed (`BITMAP_WRITE_ERROR` = bit 2; the kernel never
/// stores it).
pub const BITMAP_STATE_WRITE_ERROR: u32 = 1 << 2;
/// `state` bit: host-endian bits (`BITMAP_HOSTENDIAN` = bit 15).
pub const BITMAP_STATE_HOSTENDIAN: u32 = 1 << 15;
/// Smallest chunk the kernel accepts, bytes (`md_bitmap_read_sb`: "bitmap chunksize too
/// small").
pub const MIN_KERNEL_CHUNK_BYTES: u32 = 512;
/// Smallest chunk mdadm chooses, bytes ("sub-page chunks don't work yet").
pub const MIN_MDADM_CHUNK_BYTES: u64 = 4096;
/// mdadm's default chunk when none is asked for and the room allows it: 64 MiB.
pub const DEFAULT_CHUNK_BYTES: u64 = 64 << 20;
/// mdadm's default `daemon_sleep` (`DEFAULT_BITMAP_DELAY`), seconds.
pub const DEFAULT_DAEMON_SLEEP_S: u32 = 5;
/// Largest `write_behind` (`COUNTER_MAX` = 16383).
pub const MAX_WRITE_BEHIND: u32 = 16383;
/// Largest bitmap area mdadm uses when no chunk size is asked for: 128 KiB, sectors.
pub const DEFAULT_ROOM_CAP_SECTORS: u64 = 128 * 2;
/// mdadm adds an internal bitmap by default above this component size, sectors
/// (`Create.c`: `s->size > 100*1024*1024` KiB = 100 GiB).
pub const AUTO_BITMAP_MIN_SECTORS: u64 = 100 * 1024 * 1024 * 2;

const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 4;
const OFF_UUID: usize = 8;
const OFF_EVENTS: usize = 24;
const OFF_EVENTS_CLEARED: usize = 32;
const OFF_SYNC_SIZE: usize = 40;
const OFF_STATE: usize = 48;
const OFF_CHUNKSIZE: usize = 52;
const OFF_DAEMON_SLEEP: usize = 56;
const OFF_WRITE_BEHIND: usize = 60;
const OFF_SECTORS_RESERVED: usize = 64;
const OFF_NODES: usize = 68;
const OFF_CLUSTER_NAME: usize = 72;
const CLUSTER_NAME_BYTES: usize = 64;

/// Why a bitmap could not be built or was refused. Every variant names the values.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BitmapError {
    /// Fewer than 256 bytes.
    #[error("bitmap superblock truncated: {len} bytes given, 256 needed")]
    Truncated {
        /// Bytes given.
        len: usize,
    },
    /// Not a bitmap superblock.
    #[error("bad bitmap magic 0x{found:08x} (expected 0x{BITMAP_MAGIC:08x})")]
    BadMagic {
        /// The first le32.
        found: u32,
    },
    /// A version outside 3..=5.
    #[error("unrecognized bitmap superblock version {version} (md knows 3, 4 and 5)")]
    UnsupportedVersion {
        /// The stored version.
        version: u32,
    },
    /// A clustered (md-cluster) bitmap.
    #[error(
        "clustered bitmap (version {version}, {nodes} nodes): md-cluster arrays are not \
         served by ferroraid"
    )]
    Clustered {
        /// The stored version.
        version: u32,
        /// The stored `nodes`.
        nodes: u32,
    },
    /// Chunk below 512 bytes.
    #[error("bitmap chunksize {chunk_bytes} bytes is too small (at least 512)")]
    ChunkTooSmall {
        /// The chunk, bytes.
        chunk_bytes: u64,
    },
    /// Chunk not a power of two.
    #[error("bitmap chunksize {chunk_bytes} bytes is not a power of 2")]
    ChunkNotPowerOfTwo {
        /// The chunk, bytes.
        chunk_bytes: u64,
    },
    /// Members too small for mdadm to reserve bitmap space (below 64 sectors).
    #[error("no room for an internal bitmap: {size_sectors} sectors per member")]
    NoSpace {
        /// The component size, sectors.
        size_sectors: u64,
    },
    /// An asked-for chunk too small for the room: its bits would not fit.
    #[error(
        "bitmap chunk {chunk_bytes} bytes is too small for {size_sectors} sectors per member: \
         the {room_sectors}-sector bitmap space needs chunks of at least {min_chunk_bytes} bytes"
    )]
    ChunkTooSmallForSpace {
        /// The chunk asked for, bytes.
        chunk_bytes: u64,
        /// Smallest chunk that fits, bytes.
        min_chunk_bytes: u64,
        /// The component size, sectors.
        size_sectors: u64,
        /// The space, sectors.
        room_sectors: u64,
    },
    /// `daemon_sleep` 0.
    #[error("bitmap daemon sleep period {daemon_sleep_s} s out of range (at least 1)")]
    DaemonSleep {
        /// The stored value, seconds.
        daemon_sleep_s: u32,
    },
    /// `write_behind` above 16383.
    #[error("write-behind limit {write_behind} out of range (0 - 16383)")]
    WriteBehind {
        /// The stored value.
        write_behind: u32,
    },
    /// The bitmap's UUID is not the array's.
    #[error("bitmap superblock UUID {bitmap} does not match the array UUID {array}")]
    UuidMismatch {
        /// The bitmap's.
        bitmap: Uuid,
        /// The superblock's `set_uuid`.
        array: Uuid,
    },
    /// `sync_size` differs from the superblock's `size` (a size change interrupted).
    #[error(
        "bitmap sync_size {sync_size} sectors differs from the array's size {size} sectors \
         per member"
    )]
    SyncSize {
        /// The bitmap's `sync_size`, sectors.
        sync_size: u64,
        /// The superblock's `size`, sectors.
        size: u64,
    },
    /// The superblock has `MD_FEATURE_BITMAP_OFFSET` but its bitmap was not read.
    #[error("the member has an internal bitmap but it was not read")]
    NotRead,
    /// The superblock has no `MD_FEATURE_BITMAP_OFFSET`.
    #[error("the md superblock has no internal bitmap (feature_map bit 1 clear)")]
    NoBitmap,
    /// The bits would lie beyond the space reserved for the bitmap.
    #[error(
        "bitmap at sector {start} needs {needed_sectors} sectors but only {room_sectors} are \
         free before {limit} (bits would lie beyond the bitmap space)"
    )]
    DoesNotFit {
        /// First sector of the bitmap, absolute on the member.
        start: i64,
        /// Sectors the bitmap needs.
        needed_sectors: u64,
        /// Sectors free.
        room_sectors: i64,
        /// What ends the space (`"data"`, `"bad-block log"`).
        limit: &'static str,
    },
    /// The bitmap would overlap the superblock.
    #[error("bitmap offset {bitmap_offset} sectors overlaps the md superblock")]
    OverlapsSuperblock {
        /// The stored `bitmap_offset`.
        bitmap_offset: i32,
    },
    /// A buffer smaller than the bit array.
    #[error("bitmap area of {len} bytes is too short: {needed} bytes needed for {bits} bits")]
    AreaTooShort {
        /// Bytes given.
        len: usize,
        /// Bytes needed.
        needed: usize,
        /// Bits.
        bits: u64,
    },
}

fn le32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

fn le64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

/// Number of bitmap bits covering `sync_size_sectors` of each member with chunks of
/// `chunk_bytes`: `ceil(sync_size·512 / chunk)` (mdadm's `bitmap_bits`, the kernel's
/// `DIV_ROUND_UP_SECTOR_T(blocks, 1 << chunkshift)`). `chunk_bytes` must be non-zero.
pub fn bitmap_bits(sync_size_sectors: u64, chunk_bytes: u64) -> u64 {
    assert!(chunk_bytes > 0, "bitmap chunk of 0 bytes");
    (u128::from(sync_size_sectors) * 512).div_ceil(u128::from(chunk_bytes)) as u64
}

/// Bytes of the bitmap area for `bits` bits: the 256-byte superblock plus `ceil(bits/8)`,
/// rounded up to `boundary` bytes (4096 for mdadm's default placement; mdadm's
/// `calc_bitmap_size`).
pub fn bitmap_area_bytes(bits: u64, boundary: u64) -> u64 {
    (BITMAP_SUPER_BYTES as u64 + bits.div_ceil(8)).div_ceil(boundary) * boundary
}

/// Where bit `k` lives: `(byte offset from the bitmap start, mask)`. Byte `256 + k/8`,
/// mask `1 << (k % 8)` (module docs, "Bits").
pub fn bit_location(k: u64) -> (u64, u8) {
    (BITMAP_SUPER_BYTES as u64 + k / 8, 1u8 << (k % 8))
}

/// Whether mdadm 4.2 adds an internal bitmap when creating an array whose members each
/// contribute `size_sectors` (`Create.c`: component size above 100 GiB, level ≥ 1, no
/// journal, no PPL).
pub fn mdadm_adds_bitmap_by_default(size_sectors: u64) -> bool {
    size_sectors > AUTO_BITMAP_MIN_SECTORS
}

/// The bitmap chunk, in bytes, mdadm 4.2 picks for a new v1.2 array whose members each
/// contribute `size_sectors`, given `--bitmap-chunk` (`requested`, bytes) or not
/// (`add_internal_bitmap1`; module docs, "Sizing").
///
/// # Errors
/// [`BitmapError::NoSpace`] below 64 sectors;
/// [`BitmapError::ChunkTooSmall`] / [`BitmapError::ChunkNotPowerOfTwo`] for a requested
/// chunk the kernel would refuse; [`BitmapError::ChunkTooSmallForSpace`] when its bits do
/// not fit the space mdadm reserves.
pub fn choose_bitmap_chunk_bytes(
    size_sectors: u64,
    requested: Option<u64>,
) -> Result<u64, BitmapError> {
    if let Some(c) = requested {
        check_chunk(c)?;
    }
    let mut room = choose_bitmap_space_sectors(size_sectors);
    if requested.is_none() {
        room = room.min(DEFAULT_ROOM_CAP_SECTORS);
    }
    if room <= 1 {
        return Err(BitmapError::NoSpace { size_sectors });
    }
    let max_bits = (room * 512).saturating_sub(BITMAP_SUPER_BYTES as u64) * 8;
    let mut min_chunk = MIN_MDADM_CHUNK_BYTES;
    let mut bits = size_sectors * 512 / min_chunk + 1;
    while bits > max_bits {
        min_chunk *= 2;
        bits = bits.div_ceil(2);
    }
    match requested {
        None => Ok(min_chunk.max(DEFAULT_CHUNK_BYTES)),
        Some(c) if c < min_chunk => Err(BitmapError::ChunkTooSmallForSpace {
            chunk_bytes: c,
            min_chunk_bytes: min_chunk,
            size_sectors,
            room_sectors: room,
        }),
        Some(c) => Ok(c),
    }
}

fn check_chunk(chunk_bytes: u64) -> Result<(), BitmapError> {
    if chunk_bytes < u64::from(MIN_KERNEL_CHUNK_BYTES) {
        return Err(BitmapError::ChunkTooSmall { chunk_bytes });
    }
    if !chunk_bytes.is_power_of_two() || chunk_bytes > u64::from(u32::MAX) {
        return Err(BitmapError::ChunkNotPowerOfTwo { chunk_bytes });
    }
    Ok(())
}

/// Every field of `bitmap_super_t` (`md-bitmap.h`), decoded. `magic` is implied
/// ([`BITMAP_MAGIC`], checked on decode, written on encode); the padding is written zero
/// and ignored on decode (the kernel ignores it too).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BitmapSuper {
    /// `version`: [`BITMAP_MAJOR_HI`] (4) as written by mdadm and ferroraid;
    /// [`BITMAP_MAJOR_HOSTENDIAN`] (3) accepted.
    pub version: u32,
    /// `uuid`: the array's `set_uuid`.
    pub uuid: Uuid,
    /// `events`: the md superblock `events` this bitmap was last written with.
    pub events: u64,
    /// `events_cleared`: array `events` when a bit was last cleared.
    pub events_cleared: u64,
    /// `sync_size`: sectors of each member covered (the superblock's `size`).
    pub sync_size: u64,
    /// `state`: [`BITMAP_STATE_STALE`], [`BITMAP_STATE_WRITE_ERROR`],
    /// [`BITMAP_STATE_HOSTENDIAN`].
    pub state: u32,
    /// `chunksize`: bytes of each member one bit covers (power of two, ≥ 512).
    pub chunksize: u32,
    /// `daemon_sleep`: seconds between bitmap-daemon passes (≥ 1).
    pub daemon_sleep: u32,
    /// `write_behind`: outstanding write-behind writes allowed (RAID1; 0 here).
    pub write_behind: u32,
    /// `sectors_reserved`: sectors reserved for the bitmap; 0 = not recorded (mdadm).
    pub sectors_reserved: u32,
    /// `nodes`: cluster nodes; 0 = not clustered.
    pub nodes: u32,
    /// `cluster_name`: NUL-padded.
    pub cluster_name: [u8; 64],
}

impl BitmapSuper {
    /// The bitmap superblock mdadm 4.2 writes for a new array with `uuid`, `size_sectors`
    /// per member, `chunk_bytes` per bit (from [`choose_bitmap_chunk_bytes`]) and
    /// `daemon_sleep_s`: version 4, events 0, nothing reserved, not clustered.
    pub fn new(uuid: Uuid, size_sectors: u64, chunk_bytes: u32, daemon_sleep_s: u32) -> Self {
        BitmapSuper {
            version: BITMAP_MAJOR_HI,
            uuid,
            events: 0,
            events_cleared: 0,
            sync_size: size_sectors,
            state: 0,
            chunksize: chunk_bytes,
            daemon_sleep: daemon_sleep_s,
            write_behind: 0,
            sectors_reserved: 0,
            nodes: 0,
            cluster_name: [0; 64],
        }
    }

    /// Decodes the first 256 bytes of `bytes` and checks what the kernel checks
    /// (`md_bitmap_read_sb`) plus "not clustered". Never panics.
    ///
    /// # Errors
    /// [`BitmapError::Truncated`], [`BitmapError::BadMagic`],
    /// [`BitmapError::UnsupportedVersion`], [`BitmapError::ChunkTooSmall`],
    /// [`BitmapError::ChunkNotPowerOfTwo`], [`BitmapError::DaemonSleep`],
    /// [`BitmapError::WriteBehind`], [`BitmapError::Clustered`], in that order.
    pub fn decode(bytes: &[u8]) -> Result<Self, BitmapError> {
        if bytes.len() < BITMAP_SUPER_BYTES {
            return Err(BitmapError::Truncated { len: bytes.len() });
        }
        let b = &bytes[..BITMAP_SUPER_BYTES];
        let magic = le32(b, OFF_MAGIC);
        if magic != BITMAP_MAGIC {
            return Err(BitmapError::BadMagic { found: magic });
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[OFF_UUID..OFF_UUID + 16]);
        let mut cluster_name = [0u8; 64];
        cluster_name.copy_from_slice(&b[OFF_CLUSTER_NAME..OFF_CLUSTER_NAME + CLUSTER_NAME_BYTES]);
        let s = BitmapSuper {
            version: le32(b, OFF_VERSION),
            uuid: Uuid(uuid),
            events: le64(b, OFF_EVENTS),
            events_cleared: le64(b, OFF_EVENTS_CLEARED),
            sync_size: le64(b, OFF_SYNC_SIZE),
            state: le32(b, OFF_STATE),
            chunksize: le32(b, OFF_CHUNKSIZE),
            daemon_sleep: le32(b, OFF_DAEMON_SLEEP),
            write_behind: le32(b, OFF_WRITE_BEHIND),
            sectors_reserved: le32(b, OFF_SECTORS_RESERVED),
            nodes: le32(b, OFF_NODES),
            cluster_name,
        };
        if !(BITMAP_MAJOR_HOSTENDIAN..=BITMAP_MAJOR_CLUSTERED).contains(&s.version) {
            return Err(BitmapError::UnsupportedVersion { version: s.version });
        }
        check_chunk(u64::from(s.chunksize))?;
        if s.daemon_sleep == 0 {
            return Err(BitmapError::DaemonSleep {
                daemon_sleep_s: s.daemon_sleep,
            });
        }
        if s.write_behind > MAX_WRITE_BEHIND {
            return Err(BitmapError::WriteBehind {
                write_behind: s.write_behind,
            });
        }
        if s.version == BITMAP_MAJOR_CLUSTERED || s.nodes > 0 {
            return Err(BitmapError::Clustered {
                version: s.version,
                nodes: s.nodes,
            });
        }
        Ok(s)
    }

    /// The 256-byte encoding (little-endian, zero padding).
    pub fn encode(&self) -> [u8; BITMAP_SUPER_BYTES] {
        let mut b = [0u8; BITMAP_SUPER_BYTES];
        let p32 =
            |b: &mut [u8], off: usize, v: u32| b[off..off + 4].copy_from_slice(&v.to_le_bytes());
        let p64 =
            |b: &mut [u8], off: usize, v: u64| b[off..off + 8].copy_from_slice(&v.to_le_bytes());
        p32(&mut b, OFF_MAGIC, BITMAP_MAGIC);
        p32(&mut b, OFF_VERSION, self.version);
        b[OFF_UUID..OFF_UUID + 16].copy_from_slice(self.uuid.as_bytes());
        p64(&mut b, OFF_EVENTS, self.events);
        p64(&mut b, OFF_EVENTS_CLEARED, self.events_cleared);
        p64(&mut b, OFF_SYNC_SIZE, self.sync_size);
        p32(&mut b, OFF_STATE, self.state);
        p32(&mut b, OFF_CHUNKSIZE, self.chunksize);
        p32(&mut b, OFF_DAEMON_SLEEP, self.daemon_sleep);
        p32(&mut b, OFF_WRITE_BEHIND, self.write_behind);
        p32(&mut b, OFF_SECTORS_RESERVED, self.sectors_reserved);
        p32(&mut b, OFF_NODES, self.nodes);
        b[OFF_CLUSTER_NAME..OFF_CLUSTER_NAME + CLUSTER_NAME_BYTES]
            .copy_from_slice(&self.cluster_name);
        b
    }

    /// Whether the `state` stale bit is set: every bit must be treated as dirty.
    pub fn is_stale(&self) -> bool {
        self.state & BITMAP_STATE_STALE != 0
    }

    /// Bytes of each member one bit covers.
    pub fn chunk_bytes(&self) -> u64 {
        u64::from(self.chunksize)
    }

    /// Sectors of each member one bit covers (`chunksize / 512`; at least 1).
    pub fn chunk_sectors(&self) -> u64 {
        u64::from(self.chunksize) / 512
    }

    /// Number of bits ([`bitmap_bits`] of `sync_size`).
    pub fn bits(&self) -> u64 {
        bitmap_bits(self.sync_size, self.chunk_bytes())
    }

    /// Bytes of the on-disk area (superblock + bits), rounded to 4 KiB.
    pub fn area_bytes(&self) -> u64 {
        bitmap_area_bytes(self.bits(), 4096)
    }

    /// Checks that this bitmap belongs to the array of `sb` and fits its member: `sb` has
    /// `MD_FEATURE_BITMAP_OFFSET`, the UUIDs match, `sync_size == size`, the bitmap starts
    /// after the superblock's 4 KiB and its 256 + ceil(bits/8) bytes end before the data
    /// (and before a bad-block log that follows it). The kernel checks UUID and the space
    /// (`md_bitmap_read_sb`, `super_1_validate`'s `bitmap_info.space`).
    ///
    /// # Errors
    /// [`BitmapError::NoBitmap`], [`BitmapError::UuidMismatch`], [`BitmapError::SyncSize`],
    /// [`BitmapError::OverlapsSuperblock`], [`BitmapError::DoesNotFit`].
    pub fn check_against(&self, sb: &Superblock) -> Result<(), BitmapError> {
        if sb.feature_map & Feature::BitmapOffset.bit() == 0 {
            return Err(BitmapError::NoBitmap);
        }
        if self.uuid != sb.set_uuid {
            return Err(BitmapError::UuidMismatch {
                bitmap: self.uuid,
                array: sb.set_uuid,
            });
        }
        if self.sync_size != sb.size {
            return Err(BitmapError::SyncSize {
                sync_size: self.sync_size,
                size: sb.size,
            });
        }
        check_bitmap_space(sb, self.bits())
    }
}

/// Checks that a bitmap of `bits` bits at `sb`'s `bitmap_offset` lies after the
/// superblock and ends before the data area and before a bad-block log placed after it.
///
/// # Errors
/// [`BitmapError::OverlapsSuperblock`], [`BitmapError::DoesNotFit`].
pub fn check_bitmap_space(sb: &Superblock, bits: u64) -> Result<(), BitmapError> {
    let sb_sectors = (SUPERBLOCK_BASE_BYTES as u64 + 2 * sb.max_dev() as u64).div_ceil(512) as i64;
    let off = i64::from(sb.bitmap_offset);
    if off < sb_sectors {
        // v1.2 keeps the bitmap after the superblock; a negative offset (v1.0 style) or one
        // inside the superblock would overlap metadata.
        return Err(BitmapError::OverlapsSuperblock {
            bitmap_offset: sb.bitmap_offset,
        });
    }
    let start = sb.super_offset as i64 + off;
    let needed = (BITMAP_SUPER_BYTES as u64 + bits.div_ceil(8)).div_ceil(512);
    let mut end = sb.data_offset as i64;
    let mut limit = "data";
    if sb.bblog_size != 0 {
        let bb = sb.super_offset as i64 + i64::from(sb.bblog_offset);
        if bb >= start && bb < end {
            end = bb;
            limit = "bad-block log";
        }
    }
    let room = end - start;
    if room < needed as i64 {
        return Err(BitmapError::DoesNotFit {
            start,
            needed_sectors: needed,
            room_sectors: room,
            limit,
        });
    }
    Ok(())
}

/// Absolute member sector where `sb`'s bitmap starts (`super_offset + bitmap_offset`),
/// or `None` without `MD_FEATURE_BITMAP_OFFSET` or when it would be negative.
pub fn bitmap_start_sector(sb: &Superblock) -> Option<u64> {
    if sb.feature_map & Feature::BitmapOffset.bit() == 0 {
        return None;
    }
    u64::try_from(sb.super_offset as i64 + i64::from(sb.bitmap_offset)).ok()
}

/// A bitmap as read from a member: its superblock and its bits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bitmap {
    /// The superblock.
    pub super_: BitmapSuper,
    /// The bit array, `ceil(bits/8)` bytes, bit order as on disk (module docs).
    pub bytes: Vec<u8>,
}

impl Bitmap {
    /// Decodes a bitmap area read from the bitmap start: the superblock
    /// ([`BitmapSuper::decode`]) and `ceil(bits/8)` bytes of bits after it.
    ///
    /// # Errors
    /// As [`BitmapSuper::decode`]; [`BitmapError::AreaTooShort`] when `area` ends before
    /// the bits do.
    pub fn decode(area: &[u8]) -> Result<Self, BitmapError> {
        let super_ = BitmapSuper::decode(area)?;
        let bits = super_.bits();
        let needed = BITMAP_SUPER_BYTES as u64 + bits.div_ceil(8);
        if (area.len() as u64) < needed {
            return Err(BitmapError::AreaTooShort {
                len: area.len(),
                needed: needed.min(usize::MAX as u64) as usize,
                bits,
            });
        }
        Ok(Bitmap {
            bytes: area[BITMAP_SUPER_BYTES..needed as usize].to_vec(),
            super_,
        })
    }

    /// A bitmap with every bit set (`dirty`) or clear.
    pub fn new(super_: BitmapSuper, dirty: bool) -> Self {
        let len = super_.bits().div_ceil(8) as usize;
        let mut b = Bitmap {
            bytes: vec![if dirty { 0xff } else { 0 }; len],
            super_,
        };
        b.clear_tail();
        b
    }

    fn clear_tail(&mut self) {
        let bits = self.bits();
        if !bits.is_multiple_of(8) {
            if let Some(last) = self.bytes.last_mut() {
                *last &= (1u8 << (bits % 8)) - 1;
            }
        }
    }

    /// Number of bits.
    pub fn bits(&self) -> u64 {
        self.super_.bits()
    }

    /// Whether bit `k` is set. Bits past the end read as clear.
    pub fn is_set(&self, k: u64) -> bool {
        if k >= self.bits() {
            return false;
        }
        let (byte, mask) = bit_location(k);
        self.bytes[(byte - BITMAP_SUPER_BYTES as u64) as usize] & mask != 0
    }

    /// Sets or clears bit `k` (ignored past the end).
    pub fn set(&mut self, k: u64, dirty: bool) {
        if k >= self.bits() {
            return;
        }
        let (byte, mask) = bit_location(k);
        let b = &mut self.bytes[(byte - BITMAP_SUPER_BYTES as u64) as usize];
        if dirty {
            *b |= mask;
        } else {
            *b &= !mask;
        }
    }

    /// Number of set bits among the first `bits()` (what `mdadm -X` reports as dirty).
    pub fn dirty_count(&self) -> u64 {
        (0..self.bits()).filter(|&k| self.is_set(k)).count() as u64
    }

    /// The set bits, ascending.
    pub fn dirty(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.bits()).filter(|&k| self.is_set(k))
    }

    /// The on-disk area: superblock, bits, and zero (or, with `fill_dirty`, 0xff like
    /// mdadm's `write_bitmap1`) up to the 4 KiB-rounded [`BitmapSuper::area_bytes`].
    pub fn to_area(&self, fill_dirty: bool) -> Vec<u8> {
        let mut v = vec![if fill_dirty { 0xff } else { 0 }; self.super_.area_bytes() as usize];
        v[..BITMAP_SUPER_BYTES].copy_from_slice(&self.super_.encode());
        v[BITMAP_SUPER_BYTES..BITMAP_SUPER_BYTES + self.bytes.len()].copy_from_slice(&self.bytes);
        if fill_dirty {
            // Bits past the last chunk: mdadm leaves them set; keep them so.
            let bits = self.bits();
            if !bits.is_multiple_of(8) {
                v[BITMAP_SUPER_BYTES + self.bytes.len() - 1] |= !((1u8 << (bits % 8)) - 1);
            }
        }
        v
    }
}
