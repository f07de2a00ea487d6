//! Reading and writing md v1.2 superblocks on files and block devices.
//!
//! The engine's [`engine::metadata`] decides everything about superblocks but does no
//! I/O; this module moves the 4 KiB superblock area at byte 4096 of a member
//! ([`SUPERBLOCK_OFFSET_BYTES`]) with plain positioned I/O (`pread`/`pwrite` through
//! [`std::os::unix::fs::FileExt`]) and makes writes durable with `fdatasync`
//! ([`File::sync_data`]). No `O_DIRECT`: the superblock is rarely written and the page
//! cache is coherent with the block device, so buffered I/O plus a sync is enough (mdadm
//! does the same). Every error carries the path.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use engine::metadata::bitmap::{bitmap_start_sector, BITMAP_SUPER_BYTES};
use engine::metadata::{
    Bitmap, BitmapError, BitmapSuper, Candidate, Superblock, SuperblockError,
    SUPERBLOCK_AREA_BYTES, SUPERBLOCK_OFFSET_BYTES, SUPER_OFFSET_SECTORS,
};

/// What went wrong reading or writing a superblock, with the path.
#[derive(Debug, thiserror::Error)]
pub enum MetadataIoError {
    /// The operating system refused (open, read, write, sync, size).
    #[error("{path}: {what}: {source}", path = path.display())]
    Io {
        /// The member.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The error.
        source: io::Error,
    },
    /// The device is too small to hold what the operation needs.
    #[error(
        "{path}: device is {device_bytes} bytes, {needed_bytes} needed ({why})",
        path = path.display()
    )]
    TooSmall {
        /// The member.
        path: PathBuf,
        /// Its size in bytes.
        device_bytes: u64,
        /// Bytes needed.
        needed_bytes: u64,
        /// For what.
        why: &'static str,
    },
    /// The superblock found (or to be written) is not acceptable.
    #[error("{path}: {source}", path = path.display())]
    Superblock {
        /// The member.
        path: PathBuf,
        /// Why.
        source: SuperblockError,
    },
    /// The internal bitmap found (or to be written) is not acceptable.
    #[error("{path}: internal bitmap: {source}", path = path.display())]
    Bitmap {
        /// The member.
        path: PathBuf,
        /// Why.
        source: BitmapError,
    },
    /// A superblock whose `super_offset` is not the v1.2 position this module writes to.
    #[error(
        "{path}: refusing to write a superblock with super_offset {super_offset} sectors at \
         the v1.2 position (sector 8)",
        path = path.display()
    )]
    WrongPosition {
        /// The member.
        path: PathBuf,
        /// The superblock's `super_offset`.
        super_offset: u64,
    },
}

fn io_err<'a>(
    path: &'a Path,
    what: &'static str,
) -> impl FnOnce(io::Error) -> MetadataIoError + 'a {
    move |source| MetadataIoError::Io {
        path: path.to_path_buf(),
        what,
        source,
    }
}

/// Size of a file or block device in bytes (seeking to the end works for both).
fn device_bytes(f: &mut File, path: &Path) -> Result<u64, MetadataIoError> {
    f.seek(SeekFrom::End(0)).map_err(io_err(path, "size"))
}

/// Reads the raw 4 KiB superblock area (bytes 4096..8192) of a member.
///
/// # Errors
/// [`MetadataIoError::Io`] (open, read); [`MetadataIoError::TooSmall`] when the device
/// ends before the area does.
pub fn read_superblock_area(
    path: impl AsRef<Path>,
) -> Result<[u8; SUPERBLOCK_AREA_BYTES], MetadataIoError> {
    let path = path.as_ref();
    let mut f = File::open(path).map_err(io_err(path, "open"))?;
    let size = device_bytes(&mut f, path)?;
    let needed = SUPERBLOCK_OFFSET_BYTES + SUPERBLOCK_AREA_BYTES as u64;
    if size < needed {
        return Err(MetadataIoError::TooSmall {
            path: path.to_path_buf(),
            device_bytes: size,
            needed_bytes: needed,
            why: "the v1.2 superblock area is bytes 4096..8192",
        });
    }
    let mut area = [0u8; SUPERBLOCK_AREA_BYTES];
    f.read_exact_at(&mut area, SUPERBLOCK_OFFSET_BYTES)
        .map_err(io_err(path, "read superblock"))?;
    Ok(area)
}

/// Reads and parses a member's superblock ([`engine::metadata::parse`]: format and
/// ferroraid support both checked).
///
/// # Errors
/// As [`read_superblock_area`], and [`MetadataIoError::Superblock`] with the parser's
/// reason (no magic, bad checksum with both values, unsupported feature by name, ...).
pub fn read_superblock(path: impl AsRef<Path>) -> Result<Superblock, MetadataIoError> {
    let path = path.as_ref();
    let area = read_superblock_area(path)?;
    engine::metadata::parse(&area).map_err(|source| MetadataIoError::Superblock {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads a member's superblock as an assembly [`Candidate`] named by its path: a device
/// whose superblock does not decode becomes an unreadable candidate (assembly decides).
///
/// # Errors
/// [`MetadataIoError::Io`] / [`MetadataIoError::TooSmall`] when the area cannot be read at
/// all.
///
/// When the superblock has an internal bitmap (`MD_FEATURE_BITMAP_OFFSET`), its bitmap
/// superblock is read too and attached ([`Candidate::with_bitmap`]): decoded and checked
/// against the superblock ([`BitmapSuper::check_against`]), or the reason it is not
/// acceptable (assembly decides); an I/O error reading it is an error here.
pub fn read_candidate(path: impl AsRef<Path>) -> Result<Candidate, MetadataIoError> {
    let path = path.as_ref();
    let area = read_superblock_area(path)?;
    let c = Candidate::from_bytes(path.display().to_string(), &area);
    let Ok(sb) = &c.superblock else {
        return Ok(c);
    };
    if bitmap_start_sector(sb).is_none() {
        return Ok(c);
    }
    let checked = match read_bitmap(path, sb) {
        Ok(b) => Ok(b.super_),
        Err(MetadataIoError::Bitmap { source, .. }) => Err(source),
        Err(e) => return Err(e),
    };
    Ok(c.with_bitmap(checked))
}

/// Reads a member's internal bitmap (superblock and bits) from
/// `(super_offset + bitmap_offset) × 512` bytes and checks it against `sb`
/// ([`BitmapSuper::check_against`]).
///
/// # Errors
/// [`MetadataIoError::Bitmap`] when `sb` has no bitmap, or the bitmap does not decode or
/// belong to `sb` (named reason); [`MetadataIoError::TooSmall`] when the device ends
/// before the bitmap does; [`MetadataIoError::Io`] (open, read).
pub fn read_bitmap(path: impl AsRef<Path>, sb: &Superblock) -> Result<Bitmap, MetadataIoError> {
    let path = path.as_ref();
    let bm_err = |source| MetadataIoError::Bitmap {
        path: path.to_path_buf(),
        source,
    };
    let start = bitmap_start_sector(sb).ok_or_else(|| bm_err(BitmapError::NoBitmap))? * 512;
    let mut f = File::open(path).map_err(io_err(path, "open"))?;
    let size = device_bytes(&mut f, path)?;
    let mut head = [0u8; BITMAP_SUPER_BYTES];
    if size < start + head.len() as u64 {
        return Err(MetadataIoError::TooSmall {
            path: path.to_path_buf(),
            device_bytes: size,
            needed_bytes: start + head.len() as u64,
            why: "the internal bitmap lies beyond the end of the device",
        });
    }
    f.read_exact_at(&mut head, start)
        .map_err(io_err(path, "read bitmap superblock"))?;
    let bs = BitmapSuper::decode(&head).map_err(bm_err)?;
    bs.check_against(sb).map_err(bm_err)?;
    // check_against bounded the bits by the space before the data: the read is small.
    let len = BITMAP_SUPER_BYTES as u64 + bs.bits().div_ceil(8);
    if size < start + len {
        return Err(MetadataIoError::TooSmall {
            path: path.to_path_buf(),
            device_bytes: size,
            needed_bytes: start + len,
            why: "the internal bitmap lies beyond the end of the device",
        });
    }
    let mut area = vec![0u8; len as usize];
    f.read_exact_at(&mut area, start)
        .map_err(io_err(path, "read bitmap"))?;
    Bitmap::decode(&area).map_err(bm_err)
}

/// Writes a bitmap area (bitmap superblock first, e.g. `NewArray::initial_bitmap_area`
/// or [`Bitmap::to_area`]) at `sb`'s bitmap start, then `fdatasync`. The area must fit
/// the space between the superblock and the data ([`BitmapSuper::check_against`] on its
/// own superblock); nothing else is touched.
///
/// # Errors
/// [`MetadataIoError::Bitmap`] when `sb` has no bitmap or the area's superblock does not
/// decode, belong to `sb` or fit; [`MetadataIoError::Io`] (open, write, sync).
pub fn write_bitmap_area(
    path: impl AsRef<Path>,
    sb: &Superblock,
    area: &[u8],
) -> Result<(), MetadataIoError> {
    let path = path.as_ref();
    let bm_err = |source| MetadataIoError::Bitmap {
        path: path.to_path_buf(),
        source,
    };
    let start = bitmap_start_sector(sb).ok_or_else(|| bm_err(BitmapError::NoBitmap))?;
    let bs = BitmapSuper::decode(area).map_err(bm_err)?;
    bs.check_against(sb).map_err(bm_err)?;
    // The area may be rounded up past the bits (4 KiB); it must still end before the
    // data and the bad-block log.
    engine::metadata::bitmap::check_bitmap_space(
        sb,
        (area.len() as u64 - BITMAP_SUPER_BYTES as u64) * 8,
    )
    .map_err(bm_err)?;
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_err(path, "open for writing"))?;
    f.write_all_at(area, start * 512)
        .map_err(io_err(path, "write bitmap"))?;
    f.sync_data().map_err(io_err(path, "sync bitmap"))?;
    Ok(())
}

/// Writes `sb` as the member's superblock: the encoding zero-padded to the 4 KiB area at
/// byte 4096 (one aligned write, fine for 4 KiB-sector devices), then `fdatasync`.
/// The file or block device must exist; nothing outside the area is touched.
///
/// # Errors
/// [`MetadataIoError::WrongPosition`] unless `super_offset` is 8 sectors;
/// [`MetadataIoError::Superblock`] if `sb` cannot be encoded (too many roles);
/// [`MetadataIoError::TooSmall`] when the device is smaller than
/// `(data_offset + data_size)` sectors (the kernel would refuse such a member);
/// [`MetadataIoError::Io`] (open, write, sync).
pub fn write_superblock(path: impl AsRef<Path>, sb: &Superblock) -> Result<(), MetadataIoError> {
    let path = path.as_ref();
    if sb.super_offset != SUPER_OFFSET_SECTORS {
        return Err(MetadataIoError::WrongPosition {
            path: path.to_path_buf(),
            super_offset: sb.super_offset,
        });
    }
    let area = sb.to_area().map_err(|source| MetadataIoError::Superblock {
        path: path.to_path_buf(),
        source,
    })?;
    let mut f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_err(path, "open for writing"))?;
    let size = device_bytes(&mut f, path)?;
    let needed = sb
        .data_offset
        .saturating_add(sb.data_size)
        .saturating_mul(512)
        .max(SUPERBLOCK_OFFSET_BYTES + SUPERBLOCK_AREA_BYTES as u64);
    if size < needed {
        return Err(MetadataIoError::TooSmall {
            path: path.to_path_buf(),
            device_bytes: size,
            needed_bytes: needed,
            why: "the superblock's data_offset + data_size must lie within the device",
        });
    }
    f.write_all_at(&area, SUPERBLOCK_OFFSET_BYTES)
        .map_err(io_err(path, "write superblock"))?;
    f.sync_data().map_err(io_err(path, "sync superblock"))?;
    Ok(())
}
