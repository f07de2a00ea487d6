//! `ferroraid create`: md v1.2 superblocks on new members, and consistent initial parity.
//!
//! The superblocks are laid out as mdadm 4.2 lays them out (`engine::metadata::NewArray`):
//! same data offset, bad-block log, roles, so `mdadm --examine` reads them and kernel md
//! assembles the array. Initial parity: the parity of all-zero data is zero (P and Q), so
//! zeroing every member's data area makes the array consistent without computing anything.
//! By default `create` does exactly that — `FALLOC_FL_PUNCH_HOLE` on files (they stay
//! sparse, no data written), `BLKZEROOUT` on block devices (the device's write-zeroes, or zero pages
//! the kernel writes) — with a progress bar, then records the array clean. With
//! `--assume-clean` the members are declared consistent as they are (md's
//! `--assume-clean`: right for new, already-zeroed devices, wrong for anything else).
//!
//! **Internal write-intent bitmap** (`--bitmap internal|none`, `--bitmap-chunk`): by
//! default mdadm's rule — one when each member contributes more than 100 GiB — laid out
//! and sized as mdadm 4.2 does (`engine::metadata::bitmap`). The array is always created
//! consistent (zeroed, or declared clean), so every bit starts clear: mdadm writes all bits
//! set even then (md clears them lazily without a resync, `resync_offset` being
//! `MaxSector`); nothing needs a resync here, and clear bits say so.
//!
//! **Consistency policy** (`--consistency-policy resync|bitmap|ppl`, mdadm's option):
//! `resync` is no bitmap, `bitmap` the internal bitmap, `ppl` md's Partial Parity Log on
//! RAID5 and ferroraid's RAID6 extension of it on RAID6 (`engine::metadata::ConsistencyPolicy`,
//! `NewArray::policy`; kernel md cannot assemble a RAID6 PPL array: `crate::grow` switches
//! it to `resync`). A PPL array's members get mdadm's 1 MiB area at superblock + 4 KiB and
//! mdadm's larger data offset (on RAID6 also `FERRORAID_FEATURE_RAID6_PPL`); the area is
//! written (zeroes and the empty header, `write_init_ppl1`) before the superblock that
//! announces it.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use anyhow::{bail, ensure, Context, Result};
use drivers::metadata_io;
use engine::geometry::Geometry;
use engine::metadata::{BitmapChoice, ConsistencyPolicy, MdTime, NewArray, Superblock, Uuid};
use indicatif::{ProgressBar, ProgressStyle};
use tracing::info;

/// The zeroing of a create in progress, readable from another thread: bytes zeroed so
/// far over every member, of the total (0 until the create knows it; `assume_clean`
/// zeroes nothing and leaves both 0).
#[derive(Debug, Default)]
pub struct ZeroProgress {
    /// Bytes of the members' data areas zeroed so far.
    pub done_bytes: AtomicU64,
    /// Bytes to zero in all (the data area of every member).
    pub total_bytes: AtomicU64,
}

/// What to create.
#[derive(Clone, Debug)]
pub struct CreateOptions {
    /// Level, layout, member count (= `devices.len()`) and chunk.
    pub geometry: Geometry,
    /// Array name (`set_name`, at most 32 bytes).
    pub name: String,
    /// Member devices, in role order.
    pub devices: Vec<PathBuf>,
    /// Declare the members consistent without zeroing them.
    pub assume_clean: bool,
    /// Overwrite devices that already carry an md superblock.
    pub force: bool,
    /// Show a progress bar (a terminal); otherwise progress goes to the log.
    pub progress: bool,
    /// Where the zeroing's progress is published for another thread to read (the
    /// `array_create_progress` method of a running target), if anywhere.
    pub zero_progress: Option<Arc<ZeroProgress>>,
    /// Internal write-intent bitmap: mdadm's default rule, internal, or none.
    pub bitmap: BitmapChoice,
    /// Bitmap chunk (bytes of each member per bit), or `None` for mdadm's default.
    pub bitmap_chunk_bytes: Option<u64>,
    /// `--consistency-policy`, or `None` for the default (`bitmap` decides).
    pub consistency_policy: Option<ConsistencyPolicy>,
}

/// What was created.
#[derive(Clone, Debug)]
pub struct Created {
    /// The array UUID.
    pub uuid: Uuid,
    /// Array capacity, bytes.
    pub size_bytes: u64,
    /// Data offset of every member, bytes.
    pub data_offset_bytes: u64,
    /// Bitmap chunk in bytes when an internal bitmap was written.
    pub bitmap_chunk_bytes: Option<u64>,
    /// The array's consistency policy.
    pub consistency_policy: ConsistencyPolicy,
}

/// Size of a file or block device, bytes.
///
/// # Errors
/// The device cannot be opened or sized.
pub fn device_bytes(path: &Path) -> Result<u64> {
    if metadata_io::uses_back_end(path) {
        return metadata_io::member_bytes(path)
            .with_context(|| format!("sizing {}", path.display()));
    }
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let meta = f
        .metadata()
        .with_context(|| format!("stat {}", path.display()))?;
    if meta.file_type().is_block_device() {
        let mut size: u64 = 0;
        // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is valid.
        let rc = unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
        ensure!(
            rc == 0,
            "{}: BLKGETSIZE64: {}",
            path.display(),
            std::io::Error::last_os_error()
        );
        Ok(size)
    } else if meta.file_type().is_file() {
        Ok(meta.len())
    } else {
        bail!(
            "{} is neither a regular file nor a block device",
            path.display()
        )
    }
}

/// `_IOR(0x12, 114, size_t)`.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
/// `_IO(0x12, 127)`.
const BLKZEROOUT: libc::c_ulong = 0x127f;

/// Zeroes `len` bytes at `offset` of a member: `FALLOC_FL_PUNCH_HOLE` for files (falling
/// back to `FALLOC_FL_ZERO_RANGE`), `BLKZEROOUT` for block devices.
fn zero_range(f: &File, block: bool, offset: u64, len: u64) -> std::io::Result<()> {
    let fd = f.as_raw_fd();
    if block {
        let range: [u64; 2] = [offset, len];
        // SAFETY: BLKZEROOUT reads two u64 (start, length) through the pointer.
        let rc = unsafe { libc::ioctl(fd, BLKZEROOUT, range.as_ptr()) };
        return if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        };
    }
    let (o, l) = (offset as libc::off_t, len as libc::off_t);
    // A file keeps its holes: punching reads back as zeroes and uses no space (a sparse
    // member stays sparse); zero-range where the file system cannot punch.
    for mode in [
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
    ] {
        // SAFETY: fallocate takes plain integers.
        if unsafe { libc::fallocate(fd, mode, o, l) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(e);
        }
    }
    Err(std::io::Error::from_raw_os_error(libc::EOPNOTSUPP))
}

/// Refuses a PPL over members reached through their back end (NVMe generic devices,
/// vfio): their PPL I/O is not there yet (`drivers::metadata_io::write_init_ppl`).
///
/// # Errors
/// The first such device, named.
pub(crate) fn refuse_back_end_for_ppl(devices: &[PathBuf]) -> Result<()> {
    if let Some(p) = devices.iter().find(|p| metadata_io::uses_back_end(p)) {
        bail!(
            "{}: PPL arrays over members reached through their back end (NVMe generic \
             devices, vfio) are not supported yet",
            p.display()
        );
    }
    Ok(())
}

/// What makes two paths one device: a block device's device number, else a file's
/// (filesystem, inode) — symlinks, hard links and other spellings of one path agree;
/// `None` for a path that cannot be looked at (a `vfio:` name, a missing file).
fn device_identity(p: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m = std::fs::metadata(p).ok()?;
    Some(if m.file_type().is_block_device() {
        (u64::MAX, m.rdev())
    } else {
        (m.dev(), m.ino())
    })
}

/// What two paths of one device share, to compare devices (two members given as one,
/// a scan's matches, serve's tables): [`device_identity`] where the device can be looked
/// at, else its canonical path (or the path as given).
#[derive(PartialEq, Eq)]
pub enum DeviceKey {
    /// Device number, or (filesystem, inode).
    Node(u64, u64),
    /// A path nothing could be read from.
    Path(PathBuf),
}

impl DeviceKey {
    /// The key of the device at `p`.
    pub fn of(p: &std::path::Path) -> DeviceKey {
        match device_identity(p) {
            Some((a, b)) => DeviceKey::Node(a, b),
            None => DeviceKey::Path(std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())),
        }
    }
}

/// Refuses the same device twice (also through a symlink, a hard link or another path):
/// it would be two roles on one device.
///
/// # Errors
/// The two paths of the first device given twice.
pub(crate) fn check_distinct(devices: &[PathBuf]) -> Result<()> {
    let keys: Vec<DeviceKey> = devices.iter().map(|p| DeviceKey::of(p)).collect();
    for (i, a) in keys.iter().enumerate() {
        if let Some(j) = keys[..i].iter().position(|b| b == a) {
            bail!(
                "{} and {} are the same device",
                devices[j].display(),
                devices[i].display()
            );
        }
    }
    Ok(())
}

/// Creates the array: checks the devices, zeroes their data areas (unless
/// `assume_clean`), writes the superblocks.
///
/// # Errors
/// Wrong device count, a device that already carries an md superblock (without
/// `force`), a device too small, a name too long, a consistency policy refused
/// (`ppl` with a bitmap, or over members reached through their back end), an
/// I/O error (naming the device).
pub fn create(o: &CreateOptions) -> Result<Created> {
    let g = o.geometry;
    if o.consistency_policy == Some(ConsistencyPolicy::Ppl) {
        refuse_back_end_for_ppl(&o.devices)?;
    }
    ensure!(
        o.devices.len() == usize::from(g.members()),
        "a {}-member array needs {} devices, {} given",
        g.members(),
        g.members(),
        o.devices.len()
    );
    check_distinct(&o.devices)?;
    // Claimed for the whole create: not while a target serves them.
    let mut locks = Vec::with_capacity(o.devices.len());
    for p in &o.devices {
        locks.push(crate::target::claim(p)?);
    }
    let mut sectors = Vec::new();
    for p in &o.devices {
        if !o.force {
            // Any md superblock, also one ferroraid cannot serve (a PPL or journal array,
            // another level): only the format is checked.
            let found = metadata_io::read_superblock_area(p)
                .ok()
                .and_then(|area| Superblock::decode(&area).ok());
            if let Some(sb) = found {
                bail!(
                    "{} already carries an md superblock (array {}, name {:?}, role {}); \
                     use --force to overwrite it",
                    p.display(),
                    sb.set_uuid,
                    sb.name(),
                    sb.dev_number
                );
            }
        }
        sectors.push(device_bytes(p)? / 512);
    }
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let mut rng = rand::thread_rng();
    let uuid = Uuid::random(&mut rng);
    let mut new = NewArray::new(
        g,
        uuid,
        &o.name,
        None,
        // Seconds only, as mdadm writes it: the kernel reads the whole field as seconds.
        MdTime::new(now.as_secs(), 0),
    )?;
    new.clean = true;
    new.bitmap = o.bitmap;
    new.bitmap_chunk_bytes = o.bitmap_chunk_bytes;
    new.consistency_policy = o.consistency_policy;
    let sbs = new.superblocks(&sectors, &mut rng)?;
    // Every member gets the smallest one's size, as mdadm does; mdadm also warns when the
    // largest exceeds it by more than 1 % (the rest of it goes unused).
    if let (Some(small), Some(large)) = (
        sectors.iter().enumerate().min_by_key(|&(_, s)| *s),
        sectors.iter().enumerate().max_by_key(|&(_, s)| *s),
    ) {
        if *large.1 > small.1.saturating_add(small.1 / 100) {
            tracing::warn!(
                "{} is {} MiB larger than the smallest member, {}: every member holds only \
                 the smallest one's size, and the rest goes unused",
                o.devices[large.0].display(),
                ((large.1 - small.1) * 512) >> 20,
                o.devices[small.0].display()
            );
        }
    }
    let consistency_policy = new.policy(sbs[0].size)?;
    let bitmap_area = new.initial_bitmap_area(sbs[0].size)?;
    let ppl_area = new.initial_ppl_area(sbs[0].size)?;
    let bitmap_chunk_bytes = new.bitmap_super(sbs[0].size)?.map(|b| b.chunk_bytes());
    let data_offset = sbs[0].data_offset * 512;
    let data_bytes = sbs[0].size * 512;
    let size_bytes = data_bytes / u64::from(g.chunk_bytes())
        * u64::from(g.chunk_bytes())
        * u64::from(g.data_chunks());
    // Invalidate any old superblock first, so an interrupted create leaves no device that
    // claims membership of an array whose parity was never made consistent.
    for p in &o.devices {
        if metadata_io::uses_back_end(p) {
            metadata_io::zero_range(p, 0, data_offset)
                .with_context(|| format!("clearing the metadata area of {}", p.display()))?;
            continue;
        }
        let f = File::options()
            .write(true)
            .open(p)
            .with_context(|| format!("opening {}", p.display()))?;
        let block = f.metadata()?.file_type().is_block_device();
        zero_range(&f, block, 0, data_offset)
            .with_context(|| format!("clearing the metadata area of {}", p.display()))?;
    }
    if !o.assume_clean {
        let total = data_bytes * o.devices.len() as u64;
        if let Some(z) = &o.zero_progress {
            z.total_bytes.store(total, Ordering::Relaxed);
        }
        let publish = |done: u64| {
            if let Some(z) = &o.zero_progress {
                z.done_bytes.store(done, Ordering::Relaxed);
            }
        };
        let bar = if o.progress {
            ProgressBar::new(total).with_style(
                ProgressStyle::with_template(
                    "zeroing members {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                )
                .expect("valid template"),
            )
        } else {
            ProgressBar::hidden()
        };
        const STEP: u64 = 1 << 30;
        let mut done = 0u64;
        for p in &o.devices {
            if metadata_io::uses_back_end(p) {
                metadata_io::zero_range(p, data_offset, data_bytes)
                    .with_context(|| format!("zeroing the data area of {}", p.display()))?;
                done += data_bytes;
                bar.set_position(done);
                publish(done);
                continue;
            }
            let f = File::options()
                .write(true)
                .open(p)
                .with_context(|| format!("opening {}", p.display()))?;
            let block = f.metadata()?.file_type().is_block_device();
            let mut at = 0;
            while at < data_bytes {
                let n = STEP.min(data_bytes - at);
                zero_range(&f, block, data_offset + at, n)
                    .with_context(|| format!("zeroing the data area of {}", p.display()))?;
                at += n;
                done += n;
                bar.set_position(done);
                publish(done);
                if !o.progress && at.is_multiple_of(16 * STEP) {
                    info!(device = %p.display(), done_bytes = at, total_bytes = data_bytes, "zeroing");
                }
            }
            f.sync_data()
                .with_context(|| format!("flushing {}", p.display()))?;
        }
        bar.finish_and_clear();
    }
    // The bitmap or PPL area before the superblock that announces it, so no superblock
    // ever points at an area that was not written.
    for (p, sb) in o.devices.iter().zip(&sbs) {
        if let Some(area) = &bitmap_area {
            metadata_io::write_bitmap_area(p, sb, area)?;
        }
        if let Some(area) = &ppl_area {
            metadata_io::write_init_ppl(p, sb, area)?;
        }
        metadata_io::write_superblock(p, sb)?;
    }
    Ok(Created {
        uuid,
        size_bytes,
        data_offset_bytes: data_offset,
        bitmap_chunk_bytes,
        consistency_policy,
    })
}
