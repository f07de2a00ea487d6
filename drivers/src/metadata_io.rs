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

use engine::metadata::{
    Candidate, Superblock, SuperblockError, SUPERBLOCK_AREA_BYTES, SUPERBLOCK_OFFSET_BYTES,
    SUPER_OFFSET_SECTORS,
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
pub fn read_candidate(path: impl AsRef<Path>) -> Result<Candidate, MetadataIoError> {
    let path = path.as_ref();
    let area = read_superblock_area(path)?;
    Ok(Candidate::from_bytes(path.display().to_string(), &area))
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
