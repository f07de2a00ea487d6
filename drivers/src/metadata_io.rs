//! Reading and writing md v1.2 superblocks on members of every kind.
//!
//! The engine's [`engine::metadata`] decides everything about superblocks but does no
//! I/O; this module moves the 4 KiB superblock area at byte 4096 of a member
//! ([`SUPERBLOCK_OFFSET_BYTES`]).
//!
//! - Files and block devices: plain positioned I/O (`pread`/`pwrite` through
//!   [`std::os::unix::fs::FileExt`]), writes made durable with `fdatasync`
//!   ([`File::sync_data`]). No `O_DIRECT`: the superblock is rarely written and the page
//!   cache is coherent with the block device, so buffered I/O plus a sync is enough (mdadm
//!   does the same).
//! - NVMe generic character devices (`/dev/ngXnY`) and vfio controllers (`vfio:BDF`),
//!   which have no `read`/`write`: through the member's own back end
//!   ([`crate::any::open_member`]): one channel, a Read (or a Write with FUA followed by a
//!   Flush), waited for synchronously ([`read_area_from`], [`write_area_to`]). A vfio
//!   controller already open in this process is shared, not opened twice.
//!
//! Every error carries the path.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use engine::buf::AlignedBuf;
use engine::device::{BlockDevice, Channel, Completion, IoBuf, IoError, Op, Request, SubmitError};
use engine::metadata::bitmap::{bitmap_start_sector, BITMAP_SUPER_BYTES};
use engine::metadata::ppl::{scan_area_with, AreaScan, PplArea, PplHeader, PPL_HEADER_SIZE};
use engine::metadata::pr_record::{PR_RECORD_BYTES, PR_RECORD_OFFSET_BYTES};
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
    /// A member reached through its back end (`/dev/ngXnY`, `vfio:BDF`) could not be
    /// opened.
    #[error("{path}: {what}: {source}", path = path.display())]
    Device {
        /// The member.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The back end's error.
        source: engine::device::DeviceError,
    },
    /// A request to a member reached through its back end failed.
    #[error("{path}: {what}: {error}", path = path.display())]
    Request {
        /// The member.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The completion status (or `Timeout` when none came in time).
        error: engine::device::IoError,
    },
    /// A PPL area that cannot be written: `sb` has none, or md would refuse it, or the
    /// bytes given are not its initial contents.
    #[error("{path}: PPL area: {why}", path = path.display())]
    Ppl {
        /// The member.
        path: PathBuf,
        /// Why.
        why: String,
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
    if needs_back_end(path) {
        let dev = open_back_end(path)?;
        return read_area_from(&dev, path);
    }
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

/// Scans the PPL area of the member at `path` for its newest record
/// ([`engine::metadata::ppl::scan_area_with`]: one 4 KiB read per header, as md's
/// `ppl_load_distributed`), or `None` when `sb` has no PPL feature bit. Files and block
/// devices, like [`read_bitmap`].
///
/// # Errors
/// [`MetadataIoError::Superblock`] when md would refuse the area
/// ([`Superblock::ppl_area`]); [`MetadataIoError::TooSmall`] when it lies beyond the end
/// of the device; [`MetadataIoError::Io`] when a read fails.
pub fn scan_ppl(
    path: impl AsRef<Path>,
    sb: &Superblock,
) -> Result<Option<(PplArea, AreaScan)>, MetadataIoError> {
    let path = path.as_ref();
    let area = match sb.ppl_area() {
        Ok(Some(area)) => area,
        Ok(None) => return Ok(None),
        Err(source) => {
            return Err(MetadataIoError::Superblock {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let mut f = File::open(path).map_err(io_err(path, "open"))?;
    let size = device_bytes(&mut f, path)?;
    let start = area.start_sector * 512;
    let needed = start + area.usable_sectors * 512;
    if size < needed {
        return Err(MetadataIoError::TooSmall {
            path: path.to_path_buf(),
            device_bytes: size,
            needed_bytes: needed,
            why: "the PPL area lies beyond the end of the device",
        });
    }
    let scan = scan_area_with(area.usable_sectors, &sb.set_uuid, |offset, block| {
        f.read_exact_at(block, start + offset * 512)
            .map_err(io_err(path, "read PPL header"))
    })?;
    Ok(Some((area, scan)))
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

/// Writes a new member's PPL area as mdadm's `write_init_ppl1` does (`super1.c`): the
/// whole area of `ppl.size` sectors at `(super_offset + ppl.offset) × 512` bytes, zero but
/// for the empty header at its start (`area`, from `NewArray::initial_ppl_area`), in one
/// write, then `fdatasync`. Write it before the superblock that announces it. Files and
/// block devices; nothing outside the area is touched.
///
/// # Errors
/// [`MetadataIoError::Ppl`] when `sb` has no PPL area or md would refuse it
/// ([`Superblock::ppl_area`]), when `area` is not `ppl.size` sectors long or does not
/// start with a header of `sb`'s array, or for a member reached through its back end
/// (NVMe generic device, vfio: not supported for PPL arrays yet);
/// [`MetadataIoError::TooSmall`] when the area passes the end of the device;
/// [`MetadataIoError::Io`] (open, write, sync).
pub fn write_init_ppl(
    path: impl AsRef<Path>,
    sb: &Superblock,
    area: &[u8],
) -> Result<(), MetadataIoError> {
    write_ppl_area(path.as_ref(), sb, Some(area))
}

/// Zeroes the whole PPL area of the member at `path` (superblock `sb`), then
/// `fdatasync`: no record of an earlier life survives, and none is valid at its start
/// either, so until the running array's log reaches the start of this area again
/// recovery finds no log on it — which it counts as a mismatch (and a dirty array is
/// resynced) rather than reading an empty, clean log. For a device that joins a running
/// array, whose log continues wherever the array's log stands (see
/// `engine::ppl::PplLog::rewind`).
///
/// # Errors
/// As [`write_init_ppl`], less the header checks.
pub fn wipe_ppl(path: impl AsRef<Path>, sb: &Superblock) -> Result<(), MetadataIoError> {
    write_ppl_area(path.as_ref(), sb, None)
}

/// [`write_init_ppl`] (`area` given, checked) or [`wipe_ppl`] (`None`: zeroes).
fn write_ppl_area(
    path: &Path,
    sb: &Superblock,
    area: Option<&[u8]>,
) -> Result<(), MetadataIoError> {
    let refuse = |why: String| MetadataIoError::Ppl {
        path: path.to_path_buf(),
        why,
    };
    let ppl = match sb.ppl_area() {
        Ok(Some(ppl)) => ppl,
        Ok(None) => return Err(refuse("the superblock has no PPL feature bit".into())),
        Err(e) => return Err(refuse(e.to_string())),
    };
    let len = u64::from(ppl.size_sectors) * 512;
    let wipe = area.is_none();
    let zeroes;
    let area = match area {
        Some(a) => a,
        None => {
            zeroes = vec![0u8; len as usize];
            &zeroes[..]
        }
    };
    if area.len() as u64 != len {
        return Err(refuse(format!(
            "{} bytes given for a {len}-byte area",
            area.len()
        )));
    }
    // ppl_area() guarantees room for the header and a page: the slice is in bounds.
    if !wipe {
        PplHeader::decode_for(&area[..PPL_HEADER_SIZE], &sb.set_uuid).map_err(|e| {
            refuse(format!(
                "the area does not start with this array's header: {e}"
            ))
        })?;
    }
    if needs_back_end(path) {
        return Err(refuse(
            "members reached through their back end (NVMe generic devices, vfio) are not \
             supported for PPL arrays yet"
                .into(),
        ));
    }
    let mut f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_err(path, "open for writing"))?;
    let start = ppl.start_sector * 512;
    let size = device_bytes(&mut f, path)?;
    if size < start + len {
        return Err(MetadataIoError::TooSmall {
            path: path.to_path_buf(),
            device_bytes: size,
            needed_bytes: start + len,
            why: "the PPL area lies beyond the end of the device",
        });
    }
    f.write_all_at(area, start)
        .map_err(io_err(path, "write PPL area"))?;
    f.sync_data().map_err(io_err(path, "sync PPL area"))?;
    Ok(())
}

/// Checks, writing nothing, that `sb` can be written as the superblock of the device at
/// `path` ([`write_superblock`]'s checks): for a command that writes several members and
/// must refuse before the first write rather than after some.
///
/// # Errors
/// As [`write_superblock`], less the write and sync.
pub fn check_superblock_fits(
    path: impl AsRef<Path>,
    sb: &Superblock,
) -> Result<(), MetadataIoError> {
    let path = path.as_ref();
    superblock_area(path, sb)?;
    let size = if needs_back_end(path) {
        open_back_end(path)?.info().capacity_bytes
    } else {
        let mut f = File::open(path).map_err(io_err(path, "open"))?;
        device_bytes(&mut f, path)?
    };
    superblock_fits(path, sb, size)
}

/// `sb` encoded in its 4 KiB area, when it sits where ferroraid writes superblocks.
fn superblock_area(
    path: &Path,
    sb: &Superblock,
) -> Result<[u8; SUPERBLOCK_AREA_BYTES], MetadataIoError> {
    if sb.super_offset != SUPER_OFFSET_SECTORS {
        return Err(MetadataIoError::WrongPosition {
            path: path.to_path_buf(),
            super_offset: sb.super_offset,
        });
    }
    sb.to_area().map_err(|source| MetadataIoError::Superblock {
        path: path.to_path_buf(),
        source,
    })
}

/// Whether a device of `size` bytes holds `sb`'s data area (and the superblock area).
fn superblock_fits(path: &Path, sb: &Superblock, size: u64) -> Result<(), MetadataIoError> {
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
    let area = superblock_area(path, sb)?;
    if needs_back_end(path) {
        let dev = open_back_end(path)?;
        superblock_fits(path, sb, dev.info().capacity_bytes)?;
        return write_area_to(&dev, path, &area);
    }
    let mut f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_err(path, "open for writing"))?;
    let size = device_bytes(&mut f, path)?;
    superblock_fits(path, sb, size)?;
    f.write_all_at(&area, SUPERBLOCK_OFFSET_BYTES)
        .map_err(io_err(path, "write superblock"))?;
    f.sync_data().map_err(io_err(path, "sync superblock"))?;
    Ok(())
}

/// Checks that the device at `path` (open as `f`) holds the whole persistent-reservation
/// record area.
fn pr_area_fits(f: &mut File, path: &Path) -> Result<(), MetadataIoError> {
    let size = device_bytes(f, path)?;
    let needed = PR_RECORD_OFFSET_BYTES + PR_RECORD_BYTES as u64;
    if size < needed {
        return Err(MetadataIoError::TooSmall {
            path: path.to_path_buf(),
            device_bytes: size,
            needed_bytes: needed,
            why: "the persistent-reservation record is bytes 0..4096",
        });
    }
    Ok(())
}

/// Reads the persistent-reservation record area of a member: bytes 0..4096, before the
/// v1.2 superblock ([`engine::metadata::pr_record`]). Files and block devices with
/// `pread`; NVMe generic devices and vfio controllers through their back end.
///
/// # Errors
/// [`MetadataIoError::Io`] (open, read); [`MetadataIoError::TooSmall`] for a device shorter
/// than the area; [`MetadataIoError::Device`] / [`MetadataIoError::Request`] from a back
/// end.
pub fn read_pr_record_area(path: &Path) -> Result<Box<[u8; PR_RECORD_BYTES]>, MetadataIoError> {
    let mut area = Box::new([0u8; PR_RECORD_BYTES]);
    if needs_back_end(path) {
        let dev = open_back_end(path)?;
        let mut buf = AlignedBuf::zeroed(PR_RECORD_BYTES);
        run_range(
            &dev,
            path,
            "read persistent-reservation record",
            Op::Read,
            PR_RECORD_OFFSET_BYTES,
            PR_RECORD_BYTES as u64,
            &mut buf,
        )?;
        area.copy_from_slice(&buf);
        return Ok(area);
    }
    let mut f = File::open(path).map_err(io_err(path, "open"))?;
    pr_area_fits(&mut f, path)?;
    f.read_exact_at(&mut area[..], PR_RECORD_OFFSET_BYTES)
        .map_err(io_err(path, "read persistent-reservation record"))?;
    Ok(area)
}

/// Writes the persistent-reservation record area of a member (bytes 0..4096) and makes it
/// durable: `pwrite` + `fdatasync` for files and block devices, a FUA write (and a flush
/// for a volatile cache) through a back end. Nothing outside the area is touched.
///
/// # Errors
/// As [`read_pr_record_area`], for writing and syncing.
pub fn write_pr_record_area(
    path: &Path,
    area: &[u8; PR_RECORD_BYTES],
) -> Result<(), MetadataIoError> {
    if needs_back_end(path) {
        let dev = open_back_end(path)?;
        let mut buf = AlignedBuf::from_slice(area);
        run_range(
            &dev,
            path,
            "write persistent-reservation record",
            Op::Write { fua: true },
            PR_RECORD_OFFSET_BYTES,
            PR_RECORD_BYTES as u64,
            &mut buf,
        )?;
        if dev.info().volatile_cache {
            run_request(
                &dev,
                path,
                "flush after the persistent-reservation record",
                Op::Flush,
                &mut [],
            )?;
        }
        return Ok(());
    }
    let mut f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_err(path, "open for writing"))?;
    pr_area_fits(&mut f, path)?;
    f.write_all_at(area, PR_RECORD_OFFSET_BYTES)
        .map_err(io_err(path, "write persistent-reservation record"))?;
    f.sync_data()
        .map_err(io_err(path, "sync persistent-reservation record"))?;
    Ok(())
}

/// Whether `path` is reached only through its back end — a `vfio:` address or a character
/// device (NVMe generic device) — rather than with `pread`/`pwrite`. Callers that size,
/// zero or flush members themselves use [`member_bytes`], [`zero_range`] and
/// [`flush_member`] for these.
pub fn uses_back_end(path: &Path) -> bool {
    needs_back_end(path)
}

/// Size in bytes of a member reached through its back end ([`uses_back_end`]).
///
/// # Errors
/// [`MetadataIoError::Device`] when it cannot be opened.
pub fn member_bytes(path: &Path) -> Result<u64, MetadataIoError> {
    Ok(open_back_end(path)?.info().capacity_bytes)
}

/// Makes a member reached through its back end durable (a Flush command; nothing when the
/// device has no volatile cache).
///
/// # Errors
/// [`MetadataIoError::Device`] / [`MetadataIoError::Request`].
pub fn flush_member(path: &Path) -> Result<(), MetadataIoError> {
    let dev = open_back_end(path)?;
    if dev.info().volatile_cache {
        run_request(&dev, path, "flush", Op::Flush, &mut [])?;
    }
    Ok(())
}

/// Largest piece [`zero_range`] zeroes with one request, in bytes.
const ZERO_PIECE_BYTES: u64 = 1 << 20;

/// Zeroes `len` bytes at `offset` of a member reached through its back end: Write Zeroes
/// commands of up to 1 MiB when the device has them, else writes of a zero buffer; then a
/// flush. `offset` and `len` must be multiples of the device's block size.
///
/// # Errors
/// [`MetadataIoError::TooSmall`] when the range passes the end of the device;
/// [`MetadataIoError::Device`] / [`MetadataIoError::Request`] from the back end
/// (`Invalid` for a misaligned range).
pub fn zero_range(path: &Path, offset: u64, len: u64) -> Result<(), MetadataIoError> {
    let dev = open_back_end(path)?;
    let info = dev.info().clone();
    if offset.saturating_add(len) > info.capacity_bytes {
        return Err(MetadataIoError::TooSmall {
            path: path.to_path_buf(),
            device_bytes: info.capacity_bytes,
            needed_bytes: offset.saturating_add(len),
            why: "the range to zero must lie within the device",
        });
    }
    let piece_max = ZERO_PIECE_BYTES.min(u64::from(info.max_transfer_bytes));
    let mut zeroes = AlignedBuf::zeroed(piece_max as usize);
    let mut at = 0;
    while at < len {
        let piece = if info.write_zeroes {
            ZERO_PIECE_BYTES.min(len - at)
        } else {
            piece_max.min(len - at)
        };
        let (op, buf): (Op, &mut [u8]) = if info.write_zeroes {
            (Op::WriteZeroes, &mut [])
        } else {
            (Op::Write { fua: false }, &mut zeroes[..piece as usize])
        };
        run_range(&dev, path, "zero", op, offset + at, piece, buf)?;
        at += piece;
    }
    if info.volatile_cache {
        run_request(&dev, path, "flush after zeroing", Op::Flush, &mut [])?;
    }
    Ok(())
}

/// Whether `path` is reached only through its back end: a `vfio:` address or a character
/// device (NVMe generic device).
fn needs_back_end(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    crate::any::is_vfio_spec(path)
        || std::fs::metadata(path).is_ok_and(|m| m.file_type().is_char_device())
}

fn open_back_end(path: &Path) -> Result<crate::any::AnyDevice, MetadataIoError> {
    // Queue depth 2: a read, or a write and its flush.
    crate::any::open_member(path, &crate::any::MemberConfig::with_queue_depth(2)).map_err(
        |source| MetadataIoError::Device {
            path: path.to_path_buf(),
            what: "open",
            source,
        },
    )
}

/// How long one superblock request may take through a back end before it is given up.
const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Runs one superblock-area request on a fresh channel of `dev` and waits for it: a read
/// or write of `buf` at the v1.2 superblock offset, or a flush (`buf` empty).
fn run_request<D: BlockDevice>(
    dev: &D,
    path: &Path,
    what: &'static str,
    op: Op,
    buf: &mut [u8],
) -> Result<(), MetadataIoError> {
    let offset = if op.has_data() {
        SUPERBLOCK_OFFSET_BYTES
    } else {
        0
    };
    let len = buf.len() as u64;
    run_range(dev, path, what, op, offset, len, buf)
}

/// Runs one request (`len` bytes at `offset`; `buf` holds the data, empty for Flush and
/// Write Zeroes) on a fresh channel of `dev` and waits for it (polling, bounded by
/// [`REQUEST_TIMEOUT`]).
fn run_range<D: BlockDevice>(
    dev: &D,
    path: &Path,
    what: &'static str,
    op: Op,
    offset: u64,
    len: u64,
    buf: &mut [u8],
) -> Result<(), MetadataIoError> {
    let mut ch = dev
        .open_channel()
        .map_err(|source| MetadataIoError::Device {
            path: path.to_path_buf(),
            what: "open a channel",
            source,
        })?;
    let io = if op.has_data() {
        // SAFETY: `buf` outlives the request: this function waits for the completion (or,
        // on timeout, drops the channel, whose Drop waits for or cancels it) before
        // returning.
        unsafe { IoBuf::from_slice(buf) }
    } else {
        IoBuf::NONE
    };
    let fail = |error| MetadataIoError::Request {
        path: path.to_path_buf(),
        what,
        error,
    };
    let len_bytes = u32::try_from(len).map_err(|_| fail(IoError::Invalid))?;
    ch.submit(Request {
        tag: 1,
        op,
        offset_bytes: offset,
        len_bytes,
        buf: io,
    })
    .map_err(|e| {
        fail(match e {
            SubmitError::Gone => IoError::Gone,
            _ => IoError::Invalid,
        })
    })?;
    ch.kick();
    let deadline = std::time::Instant::now() + REQUEST_TIMEOUT;
    let mut out = [Completion::EMPTY; 1];
    loop {
        if ch.poll(&mut out) == 1 {
            return out[0].status.map_err(fail);
        }
        if std::time::Instant::now() >= deadline {
            return Err(fail(IoError::Timeout));
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

/// Reads the 4 KiB superblock area of an open member through its back end (`path` names it
/// in errors).
///
/// # Errors
/// [`MetadataIoError::TooSmall`] for a device smaller than 8 KiB;
/// [`MetadataIoError::Device`] / [`MetadataIoError::Request`] from the back end.
pub fn read_area_from<D: BlockDevice>(
    dev: &D,
    path: &Path,
) -> Result<[u8; SUPERBLOCK_AREA_BYTES], MetadataIoError> {
    let needed = SUPERBLOCK_OFFSET_BYTES + SUPERBLOCK_AREA_BYTES as u64;
    if dev.info().capacity_bytes < needed {
        return Err(MetadataIoError::TooSmall {
            path: path.to_path_buf(),
            device_bytes: dev.info().capacity_bytes,
            needed_bytes: needed,
            why: "the v1.2 superblock area is bytes 4096..8192",
        });
    }
    let mut buf = AlignedBuf::zeroed(SUPERBLOCK_AREA_BYTES);
    run_request(dev, path, "read superblock", Op::Read, &mut buf)?;
    let mut area = [0u8; SUPERBLOCK_AREA_BYTES];
    area.copy_from_slice(&buf);
    Ok(area)
}

/// Writes the 4 KiB superblock area of an open member through its back end (a FUA write,
/// then a flush when the device has a volatile cache).
///
/// # Errors
/// [`MetadataIoError::Device`] / [`MetadataIoError::Request`] from the back end.
pub fn write_area_to<D: BlockDevice>(
    dev: &D,
    path: &Path,
    area: &[u8; SUPERBLOCK_AREA_BYTES],
) -> Result<(), MetadataIoError> {
    let mut buf = AlignedBuf::from_slice(area);
    run_request(
        dev,
        path,
        "write superblock",
        Op::Write { fua: true },
        &mut buf,
    )?;
    if dev.info().volatile_cache {
        run_request(dev, path, "flush after the superblock", Op::Flush, &mut [])?;
    }
    Ok(())
}
