//! `uring`: io_uring over regular files and block devices (`/dev/sdX`, `/dev/nvmeXnY`,
//! `/dev/loopN`), opened `O_RDWR | O_DIRECT` by default.
//!
//! A [`UringDevice`] is opened once per member; every reactor then calls
//! [`BlockDevice::open_channel`] and gets its own [`UringChannel`]: its own io_uring (nothing
//! is shared between channels), sized to the queue depth, with the member registered as fixed
//! file 0 and, optionally, an SQPOLL kernel thread. A channel opened on a thread pinned to
//! one CPU keeps its kernel io-wq workers (which run `FSYNC` and whatever cannot complete
//! inline) off that CPU, on the process's other CPUs (see [`worker_cpus`]).
//!
//! # Requests
//!
//! | [`Op`]            | io_uring operation                                         |
//! |-------------------|------------------------------------------------------------|
//! | `Read`            | `READ`, or `READ_FIXED` when the buffer has a region       |
//! | `Write { fua }`   | `WRITE` / `WRITE_FIXED`, with `RWF_DSYNC` when `fua`       |
//! | `Flush`           | `FSYNC` with `IORING_FSYNC_DATASYNC`                       |
//! | `WriteZeroes`     | `FALLOCATE` with `FALLOC_FL_ZERO_RANGE \| FALLOC_FL_KEEP_SIZE` |
//! | `Discard`         | `FALLOCATE` with `FALLOC_FL_PUNCH_HOLE \| FALLOC_FL_KEEP_SIZE` |
//!
//! On a block device the kernel turns `ZERO_RANGE` into `blkdev_issue_zeroout` (a WRITE
//! ZEROES command, or zero pages written by the kernel where the device has none) and
//! `PUNCH_HOLE` into a WRITE ZEROES that may unmap and has no fallback, so `Discard` on a
//! block device needs hardware write-zeroes support (`queue/write_zeroes_max_bytes > 0`)
//! and always leaves zeroes behind. That support can vanish at run time: a loop device over
//! a file system without `ZERO_RANGE` (tmpfs) advertises write zeroes until its first one
//! fails, then clears it, so a `Discard` that [`DeviceInfo::discard`] promised may still
//! complete with [`IoError::Unsupported`] (harmless: discard is advisory).
//!
//! # Hot path
//!
//! `submit` validates, takes a slot of a fixed in-flight table allocated when the channel was
//! opened (the slot index is the SQE's `user_data`; the slot holds the tag, the expected
//! length and the op) and writes one SQE: no allocation, no lock, no syscall (unless the
//! submission ring is full). `kick` is one `io_uring_enter` for the whole batch (none at all
//! when nothing is queued, or when an SQPOLL thread is awake). `poll` reads the completion
//! ring without a syscall.
//!
//! # Small reads of memory-backed files (tmpfs, ramfs)
//!
//! io_uring issues a read inline only on a file that takes `IOCB_NOWAIT` (`FMODE_NOWAIT`:
//! block devices, ext4, xfs, btrfs); on any other file it hands the read to the
//! submitting thread's io-wq, the kernel worker pool that also runs every write it could
//! not issue inline. tmpfs (Linux 6.18, with or without `O_DIRECT`) takes no `NOWAIT` at
//! all, so every member read *and* write goes to io-wq (`perf` on the
//! `io_uring:io_uring_queue_async_work` tracepoint: 400 of 400 reads "normal", 400 of 400
//! writes "hashed"). There the reads wait behind the writes:
//!
//! - io-wq is per *thread*, shared by every ring that thread submits on: one reactor's
//!   member channels all feed one work list;
//! - a buffered (or tmpfs) write to a regular file is *hashed* by inode: writes to one
//!   file run one at a time, and a new one is inserted right after the last queued write
//!   of its file — ahead of a read queued after that write;
//! - io-wq adds a worker only when none is free and either the work is marked concurrent
//!   (`IOSQE_ASYNC`) or no worker is running; a tmpfs write copies memory and never
//!   sleeps, so one worker (`iou-wrk-<reactor tid>`) runs everything, in list order.
//!
//! Measured with a probe that drives six tmpfs files from one thread as a reactor does
//! (64 KiB writes, 48 in flight, round robin; one 4 KiB random read at a time; the
//! thread on CPU 1, io-wq on CPU 0; 2 shared vCPUs): a read took p50 2.3–5.4 ms, p99.9
//! 22 ms. Marked `IOSQE_ASYNC` (so io-wq starts a worker for it) p50 24 µs, p99.9
//! 8.5–10.6 ms — a free worker still takes the oldest work first, often another file's
//! writes. A `pread` on the reactor thread: p50 ≤ 1 µs, p99.9 24–43 µs, writes as fast.
//! On ext4 with `O_DIRECT` (written extents) neither reads nor writes entered io-wq at
//! all (0 of 4377 reads, 0 of 167232 writes queued async): the reader waits in the block
//! layer and the disk, where the engine's depth controller acts.
//! Through this driver (`bench/src/bin/member-read-probe.rs`, same load, 64 MiB files,
//! medians of 3 alternating runs): tmpfs reads through io_uring p50 269 µs, p99.9 10.6 ms,
//! 887 reads/s; served inline p50 1 µs, p99.9 351 µs, 281718 reads/s, writes 2786 vs 2704
//! MB/s; ext4 `O_DIRECT` takes the same path either way (p50 685 µs, p99.9 7.8 ms).
//!
//! So a channel reads a regular file itself, with one `pread(2)` in `submit`, when
//! - the file system is memory-backed (`fstatfs`: `TMPFS_MAGIC`, `RAMFS_MAGIC`): a read
//!   is a copy out of the page cache and never waits for a device (it blocks only to
//!   swap a swapped-out tmpfs page back in);
//! - the file refuses `RWF_NOWAIT` (probed at open with one block read at offset 0:
//!   `EOPNOTSUPP` is the kernel's answer for a file without `FMODE_NOWAIT`), i.e.
//!   io_uring would send every read to io-wq (a kernel that issues them inline gets
//!   io_uring's own path);
//! - the read is at most [`INLINE_READ_MAX_BYTES`] (64 KiB: the probe's `pread` of 64 KiB
//!   took p50 5 µs, of 256 KiB 25 µs, of 1 MiB 84 µs beside the writes — a small read's
//!   member reads stay a few µs of the reactor's turn, bulk reads go to io-wq);
//! - and [`UringConfig::inline_reads`] is on (default).
//!
//! The completion is kept in the in-flight slot and returned by the next `poll`, like any
//! other (no allocation, no lock: a fixed ring of slot indices). Writes, flushes and
//! larger reads go through io_uring as before. Counted in [`UringStats::inline_reads`].
//!
//! # Device facts ([`DeviceInfo`])
//!
//! - **Block size** (bytes). Block device: the logical block size (`BLKSSZGET`). Regular
//!   file opened with `O_DIRECT`: the file's direct-I/O offset alignment from
//!   `statx(STATX_DIOALIGN)` (`stx_dio_offset_align`, raised to 512 if smaller) when the
//!   kernel and file system report it; otherwise 512 if a 512-byte `O_DIRECT` read at offset
//!   0 succeeds, else 4096. Regular file without `O_DIRECT`: 512 (the page cache takes any
//!   alignment; 512 is md's sector). The block size must be a power of two from 512 to
//!   65536 bytes.
//! - **Capacity** (bytes): `BLKGETSIZE64` or the file length, rounded down to the block size.
//!   A device smaller than one block is refused.
//! - **Largest transfer** (bytes): 1 MiB, lowered to `queue/max_sectors_kb` for a block
//!   device that reports less; the kernel splits anything larger than the device takes.
//! - **Queue depth** (requests in flight per channel): the configured depth; for a SCSI or
//!   SATA disk capped at its `device/queue_depth` in sysfs, but never below 2 (a QD=1 disk
//!   gets two: one at the disk, one waiting, so it never idles between requests).
//!   [`UringDevice::device_queue_depth`] reports the sysfs value itself.
//! - **Volatile cache**: always for a regular file (page cache and the disk's cache sit
//!   behind `fsync`); for a block device, `queue/write_cache` reads `write back` (also
//!   assumed when sysfs cannot be read: flushing is the safe side).
//! - **Write zeroes / discard**: for a regular file, checked once at open with an anonymous
//!   `O_TMPFILE` in the same directory (same file system): each is reported unless the file
//!   system answers `EOPNOTSUPP` (tmpfs, for example, has no `ZERO_RANGE`); the member file
//!   itself is never touched by the probe. For a block device, write zeroes is always
//!   reported (the kernel falls back to writing zero pages) and discard when
//!   `queue/write_zeroes_max_bytes` is non-zero.
//!
//! # Errors in completions
//!
//! A negative CQE result is mapped by errno: `EIO` → [`IoError::Io`] `{ errno: 5 }`,
//! `ENOSPC` → [`IoError::NoSpace`], `ENODEV`/`ENXIO` → [`IoError::Gone`], `ENODATA` (the
//! block layer's "critical medium error") → [`IoError::Medium`], `ETIMEDOUT` and `ECANCELED` (an aborted request) →
//! [`IoError::Timeout`], `EOPNOTSUPP` → [`IoError::Unsupported`], `EINVAL` for `FALLOCATE`
//! or `FSYNC` → [`IoError::Unsupported`], anything else → [`IoError::Io`] with its errno. A
//! read or write that moved fewer bytes than asked → [`IoError::Short`].

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use engine::buf::{AlignedBuf, BUF_ALIGN};
use engine::device::{
    validate_gather, BlockDevice, Channel, Completion, DeviceError, DeviceInfo, IoError, Op,
    Request, SubmitError,
};
use io_uring::{opcode, squeue, types, IoUring};

/// Default queue depth of a channel (requests in flight): deep enough to keep an NVMe SSD
/// busy from one reactor, small enough that 64 members × a few reactors stay cheap.
pub const DEFAULT_QUEUE_DEPTH: u32 = 128;

/// Largest queue depth a channel accepts: the kernel's `IORING_MAX_ENTRIES`.
pub const MAX_QUEUE_DEPTH: u32 = 32768;

/// Largest transfer of one request, in bytes, unless a block device asks for less: large
/// enough for a full chunk of common RAID geometries, small enough that one request does
/// not monopolise a device queue.
pub const DEFAULT_MAX_TRANSFER_BYTES: u32 = 1 << 20;

/// Smallest and largest block sizes accepted, in bytes.
const MIN_BLOCK_BYTES: u32 = 512;
const MAX_BLOCK_BYTES: u32 = 65536;

/// Largest read, in bytes, that a channel on a memory-backed file serves itself with
/// `pread(2)` instead of handing it to io-wq (module documentation, "Small reads of
/// memory-backed files"): a 64 KiB copy out of tmpfs took ~5 µs (p50) beside a bulk
/// writer, a 256 KiB one ~25 µs.
pub const INLINE_READ_MAX_BYTES: u32 = 64 << 10;

/// `statfs.f_type` of tmpfs and ramfs (`include/uapi/linux/magic.h`): file systems whose
/// pages live in memory only.
const MEMORY_FS_MAGICS: [u64; 2] = [0x0102_1994, 0x8584_58f6];

/// Most registered buffer regions: an [`engine::device::IoBuf`] region index is a `u16`.
const MAX_REGIONS: usize = 1 << 16;

/// `io_uring_enter` calls one `kick` makes (retrying `EINTR`, or a kernel that stopped
/// early in a batch) before leaving the rest for the next kick: every loop is bounded.
const MAX_ENTER_TRIES: u32 = 16;

/// Fixed-file index of the member in every channel's file table.
const MEMBER: types::Fixed = types::Fixed(0);

/// `BLKGETSIZE64` = `_IOR(0x12, 114, size_t)`; the libc crate does not define it.
#[cfg(not(any(
    target_arch = "mips",
    target_arch = "mips64",
    target_arch = "powerpc",
    target_arch = "powerpc64",
    target_arch = "sparc",
    target_arch = "sparc64"
)))]
const BLKGETSIZE64: u32 =
    (2 << 30) | ((std::mem::size_of::<usize>() as u32) << 16) | (0x12 << 8) | 114;
/// `BLKGETSIZE64` on architectures whose ioctl encoding puts the direction in bits 29..31.
#[cfg(any(
    target_arch = "mips",
    target_arch = "mips64",
    target_arch = "powerpc",
    target_arch = "powerpc64",
    target_arch = "sparc",
    target_arch = "sparc64"
))]
const BLKGETSIZE64: u32 =
    (2 << 29) | ((std::mem::size_of::<usize>() as u32) << 16) | (0x12 << 8) | 114;

/// How to open a [`UringDevice`] and its channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UringConfig {
    /// Open with `O_DIRECT` (bypass the page cache). Default `true`. Without it, regular
    /// files go through the page cache and their block size is 512 bytes.
    pub direct: bool,
    /// Requests one channel may have in flight; also the size of each channel's rings
    /// (rounded up to a power of two by the kernel). 1 to [`MAX_QUEUE_DEPTH`]; default
    /// [`DEFAULT_QUEUE_DEPTH`].
    pub queue_depth: u32,
    /// `Some(idle_ms)`: each channel gets an SQPOLL kernel thread that polls its submission
    /// ring and sleeps after `idle_ms` milliseconds without work, so `kick` usually needs no
    /// syscall (costs a kernel thread per channel, busy while I/O flows). Default `None`.
    pub sqpoll: Option<u32>,
    /// Let a channel on a memory-backed regular file (tmpfs, ramfs) that io_uring cannot
    /// read without io-wq serve reads of at most [`INLINE_READ_MAX_BYTES`] itself, with
    /// `pread(2)` in `submit`, so they never queue behind writes in io-wq (module
    /// documentation, "Small reads of memory-backed files"). Default `true`; no effect on
    /// block devices or on files io_uring can read inline.
    pub inline_reads: bool,
}

impl Default for UringConfig {
    fn default() -> Self {
        Self {
            direct: true,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            sqpoll: None,
            inline_reads: true,
        }
    }
}

/// Where the kernel's io-wq workers of a channel opened on this thread may run: every CPU
/// the process may use except this thread's own, when the thread is pinned to one CPU and
/// others remain; `None` (leave the default) otherwise.
///
/// Requests the kernel cannot complete inline (`fsync`, and reads or writes of files that
/// cannot be served without blocking) go to io-wq worker threads, which inherit the
/// submitting thread's affinity. A polled reactor pinned to its core never yields it, so a
/// worker sharing that core runs only when the scheduler preempts the poller — a flush
/// measured at ~10 ms instead of ~0.3 ms (`fio --fsync=1` over NBD, ext4 member files).
/// Letting the workers run on every CPU, the reactor's included, still stalls flushes now
/// and then (the scheduler often wakes a worker where it last ran); the other CPUs are
/// where a deployment leaves the kernel its housekeeping. The price on a 2-CPU test
/// machine: there the other CPU also runs the benchmark client, and members whose every
/// request goes to io-wq (tmpfs files) run at half the speed they get when the workers may
/// preempt the poller (docs/BENCHMARKS.md, "Write passes", second round).
fn worker_cpus() -> Option<libc::cpu_set_t> {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: cpu_set_t is plain bits; all-zero is the empty set.
    let mut own: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut process: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live cpu_set_t of `size` bytes; 0 is the calling
    // thread, getpid() the main thread (the process's own mask unless it was narrowed).
    let ok = unsafe {
        libc::sched_getaffinity(0, size, &mut own) == 0
            && libc::sched_getaffinity(libc::getpid(), size, &mut process) == 0
    };
    // SAFETY: CPU_COUNT reads a valid cpu_set_t.
    if !ok || unsafe { libc::CPU_COUNT(&own) } != 1 {
        return None;
    }
    let mut rest = 0;
    for cpu in 0..libc::CPU_SETSIZE as usize {
        // SAFETY: cpu < CPU_SETSIZE, the sets are valid.
        unsafe {
            if libc::CPU_ISSET(cpu, &own) {
                libc::CPU_CLR(cpu, &mut process);
            } else if libc::CPU_ISSET(cpu, &process) {
                rest += 1;
            }
        }
    }
    (rest > 0).then_some(process)
}

/// What was opened: decides how the device facts are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    RegularFile,
    BlockDevice,
}

/// What a device shares with its channels (read-only after open).
#[derive(Debug)]
struct Shared {
    info: DeviceInfo,
    file: File,
    sqpoll: Option<u32>,
    /// Reads of at most this many bytes are served with `pread` in `submit` (0: none).
    inline_read_max: u32,
}

/// A regular file or block device driven through io_uring: one member.
///
/// Holds the open file and the device facts; [`BlockDevice::open_channel`] creates one
/// [`UringChannel`] per reactor. Channels keep the file open on their own, so the device
/// may be dropped before its channels.
#[derive(Debug)]
pub struct UringDevice {
    shared: Arc<Shared>,
    kind: Kind,
    device_queue_depth: Option<u32>,
}

impl UringDevice {
    /// Opens `path` (a regular file or a block device) read-write, with `O_DIRECT` unless
    /// `config.direct` is false, and reads its facts (see the module documentation for the
    /// rules behind each [`DeviceInfo`] field). The device name is the path as given.
    ///
    /// # Errors
    /// [`DeviceError::Unusable`] (message names the path) for a queue depth outside
    /// 1..=[`MAX_QUEUE_DEPTH`], a path that is neither a regular file nor a block device, a
    /// block size that is not a power of two from 512 to 65536 bytes, a direct-I/O memory
    /// alignment above 4096 bytes, or a capacity below one block;
    /// [`DeviceError::Os`] when `stat`, `open` (for instance `EINVAL` from a file system
    /// without `O_DIRECT`: use `direct: false`), `statx` or a block-device ioctl fails.
    pub fn open(path: impl AsRef<Path>, config: &UringConfig) -> Result<Self, DeviceError> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        if config.queue_depth == 0 || config.queue_depth > MAX_QUEUE_DEPTH {
            return Err(DeviceError::Unusable(format!(
                "{shown}: queue depth {} outside 1..={MAX_QUEUE_DEPTH}",
                config.queue_depth
            )));
        }
        // Refuse anything else before opening it: opening a character device or a FIFO can
        // have side effects (tape rewind, blocking).
        let meta = std::fs::metadata(path).map_err(|e| os(format!("stat {shown}"), e))?;
        let kind = file_kind(&shown, meta.file_type())?;

        let mut flags = 0;
        if config.direct {
            flags |= libc::O_DIRECT;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(flags)
            .open(path)
            .map_err(|e| {
                let how = if config.direct { " with O_DIRECT" } else { "" };
                os(format!("open {shown} read-write{how}"), e)
            })?;
        let opened = file
            .metadata()
            .map_err(|e| os(format!("fstat {shown}"), e))?;
        if file_kind(&shown, opened.file_type())? != kind {
            return Err(DeviceError::Unusable(format!(
                "{shown}: changed type while being opened"
            )));
        }

        let (info, device_queue_depth) = match kind {
            Kind::BlockDevice => block_device_info(&shown, &file, config)?,
            Kind::RegularFile => (regular_file_info(path, &shown, &file, config)?, None),
        };
        let inline_read_max = if kind == Kind::RegularFile
            && config.inline_reads
            && memory_backed(&file)
            && !takes_nowait_reads(&file, info.block_bytes)
        {
            INLINE_READ_MAX_BYTES
        } else {
            0
        };
        Ok(Self {
            shared: Arc::new(Shared {
                info,
                file,
                sqpoll: config.sqpoll,
                inline_read_max,
            }),
            kind,
            device_queue_depth,
        })
    }

    /// Whether the device is a block device (else a regular file).
    pub fn is_block_device(&self) -> bool {
        self.kind == Kind::BlockDevice
    }

    /// The device's own command queue depth from sysfs (`device/queue_depth` of a SCSI or
    /// SATA disk: 1 without NCQ, typically 31/32 with it); `None` for regular files and
    /// block devices without one (NVMe, virtio, loop). The channel depth
    /// ([`DeviceInfo::queue_depth`]) derives from it.
    pub fn device_queue_depth(&self) -> Option<u32> {
        self.device_queue_depth
    }

    /// Largest read, in bytes, that this device's channels serve themselves with `pread`
    /// ([`INLINE_READ_MAX_BYTES`] on a memory-backed file io_uring would read through
    /// io-wq, with [`UringConfig::inline_reads`] on); 0 when every read goes through
    /// io_uring.
    pub fn inline_read_max_bytes(&self) -> u32 {
        self.shared.inline_read_max
    }
}

impl BlockDevice for UringDevice {
    type Channel = UringChannel;

    fn info(&self) -> &DeviceInfo {
        &self.shared.info
    }

    /// Creates an io_uring of `queue_depth` entries (completion ring twice that, so it can
    /// never overflow), with SQPOLL if configured, and registers the member as fixed file 0.
    ///
    /// # Errors
    /// [`DeviceError::Os`] when the kernel refuses the ring (`io_uring_setup`: memory lock
    /// limits, io_uring disabled by `kernel.io_uring_disabled`) or the file registration.
    /// A regular file's data extents within `range` from `lseek(2)` `SEEK_DATA` /
    /// `SEEK_HOLE` (ext4 and xfs report unwritten extents as holes, tmpfs its
    /// unallocated pages); `None` for a block device (it cannot tell) or when `lseek`
    /// fails (a file system without hole support reports the whole file as data, which
    /// is also what it returns).
    fn allocated(&self, range: std::ops::Range<u64>) -> Option<Vec<std::ops::Range<u64>>> {
        if self.kind != Kind::RegularFile {
            return None;
        }
        let fd = self.shared.file.as_raw_fd();
        let seek = |pos: u64, whence: libc::c_int| -> Result<Option<u64>, ()> {
            let pos = libc::off_t::try_from(pos).map_err(|_| ())?;
            // SAFETY: `fd` stays open while `self` lives; lseek touches no memory of ours.
            // The file offset it moves is used by nothing else (io_uring requests carry
            // their own offsets).
            let r = unsafe { libc::lseek(fd, pos, whence) };
            if r >= 0 {
                return Ok(Some(r as u64));
            }
            // ENXIO: no data (or no hole) at or after `pos`.
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::ENXIO) => Ok(None),
                _ => Err(()),
            }
        };
        let mut out = Vec::new();
        let mut pos = range.start;
        while pos < range.end {
            let Some(data) = seek(pos, libc::SEEK_DATA).ok()? else {
                break;
            };
            if data >= range.end {
                break;
            }
            let hole = seek(data, libc::SEEK_HOLE).ok()?.unwrap_or(range.end);
            let end = hole.clamp(data + 1, range.end);
            out.push(data..end);
            pos = end;
        }
        Some(out)
    }

    fn open_channel(&self) -> Result<UringChannel, DeviceError> {
        let info = &self.shared.info;
        // IORING_SETUP_SUBMIT_ALL (5.18): one bad SQE does not stop the kernel from taking
        // the rest of the batch; older kernels refuse the flag with EINVAL, so retry
        // without it (`submit_queued` then loops until the ring is empty).
        // Not IORING_SETUP_SINGLE_ISSUER: the channel is created on one thread and moved to
        // its reactor, and that flag binds the ring to the creating thread.
        // Not COOP_TASKRUN / DEFER_TASKRUN: completions must reach the completion ring while
        // the reactor polls without entering the kernel.
        let build = |submit_all: bool| {
            let mut builder = IoUring::builder();
            if let Some(idle_ms) = self.shared.sqpoll {
                builder.setup_sqpoll(idle_ms);
            }
            if submit_all {
                builder.setup_submit_all();
            }
            builder.build(info.queue_depth)
        };
        let ring = match build(true) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => build(false),
            other => other,
        }
        .map_err(|e| {
            os(
                format!(
                    "io_uring setup ({} entries) for {}",
                    info.queue_depth, info.name
                ),
                e,
            )
        })?;
        ring.submitter()
            .register_files(&[self.shared.file.as_raw_fd()])
            .map_err(|e| os(format!("io_uring file registration for {}", info.name), e))?;
        if let Some(cpus) = worker_cpus() {
            // Best effort (IORING_REGISTER_IOWQ_AFF, Linux 5.14): without it the workers
            // stay on the reactor's CPU, which is slower but correct.
            let _ = ring.submitter().register_iowq_aff(&cpus);
        }

        let depth = info.queue_depth as usize;
        let slots = vec![Slot::IDLE; depth].into_boxed_slice();
        // Pop from the end: slot 0 is used first.
        let free: Box<[u32]> = (0..info.queue_depth).rev().collect();
        let ready = vec![0; depth].into_boxed_slice();
        Ok(UringChannel {
            ring,
            shared: Arc::clone(&self.shared),
            slots,
            free,
            free_top: depth,
            ready,
            ready_head: 0,
            ready_len: 0,
            in_flight: 0,
            regions: Box::new([]),
            stats: UringStats::default(),
        })
    }
}

/// Counters of one channel, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UringStats {
    /// `io_uring_enter` calls from `kick` (and from `submit` when the submission ring was
    /// full) that failed with something other than `EINTR`; the requests stay queued and
    /// the next `kick` hands them over again.
    pub kick_errors: u64,
    /// Completions whose `user_data` matched no request in flight (ignored; never expected).
    pub stray_completions: u64,
    /// Abort (`ASYNC_CANCEL`) requests issued for requests past the array's command
    /// timeout.
    pub aborts: u64,
    /// Reads served with `pread` in `submit` instead of io_uring (memory-backed files,
    /// module documentation "Small reads of memory-backed files").
    pub inline_reads: u64,
}

/// One entry of the in-flight table.
#[derive(Clone, Copy, Debug)]
struct Slot {
    tag: u64,
    /// Bytes the request moves (for short-transfer detection).
    expected: u32,
    op: Op,
    busy: bool,
    /// Served in `submit` (`pread`): the kernel holds nothing of it, `result` is its
    /// outcome (bytes or `-errno`, as a CQE's) and its index waits in the ready ring.
    inline: bool,
    result: i32,
}

impl Slot {
    const IDLE: Slot = Slot {
        tag: 0,
        expected: 0,
        op: Op::Flush,
        busy: false,
        inline: false,
        result: 0,
    };
}

/// A per-reactor queue pair on a [`UringDevice`]: one io_uring of its own.
///
/// # Why `UringChannel` is `Send`
///
/// A channel is created on one thread and moved to the reactor that owns it. That is sound:
/// the ring's shared memory maps and file descriptor are owned by the channel and touched
/// only through `&mut self` (the `io-uring` crate's `IoUring` is `Send` for this reason);
/// the kernel does not tie a ring to a thread unless `IORING_SETUP_SINGLE_ISSUER` is set,
/// which this back end never sets; the in-flight table holds plain data; the device facts
/// and file are behind an `Arc` of immutable data; registered-buffer addresses are
/// process-wide. Completions of requests submitted before a move may be finished by the
/// kernel through the old thread's task work (or its fallback worker after the thread
/// exits); they still reach this channel's completion ring. Moving a channel while it has
/// requests in flight is therefore safe, though reactors move channels before using them.
/// The channel is not `Sync`: every method that touches the rings takes `&mut self`.
pub struct UringChannel {
    ring: IoUring,
    shared: Arc<Shared>,
    /// In-flight table, `queue_depth` entries; `user_data` of an SQE is its slot index.
    slots: Box<[Slot]>,
    /// Stack of free slot indices: `free[..free_top]`.
    free: Box<[u32]>,
    free_top: usize,
    /// Ring of slots served inline, in completion order: `ready[(ready_head + i) % depth]`
    /// for `i < ready_len` (at most one entry per slot, so it never overflows).
    ready: Box<[u32]>,
    ready_head: usize,
    ready_len: usize,
    /// Requests taken by `submit` and not yet returned by `poll` (inline ones included).
    in_flight: usize,
    /// Registered buffer regions as (start address, length in bytes).
    regions: Box<[(usize, usize)]>,
    stats: UringStats,
}

/// Compile-time check of the promise documented on [`UringChannel`].
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<UringChannel>();
};

impl fmt::Debug for UringChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UringChannel")
            .field("device", &self.shared.info.name)
            .field("queue_depth", &self.slots.len())
            .field("in_flight", &self.in_flight)
            .field("regions", &self.regions.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl UringChannel {
    /// Registers `regions` as this ring's fixed buffers; region `i` is `regions[i]` (start,
    /// length in bytes). A request whose [`engine::device::IoBuf::region`] is `Some(i)` is
    /// then issued as `READ_FIXED`/`WRITE_FIXED` on buffer `i` (the kernel skips pinning the
    /// pages on every request). Replaces any earlier registration; an empty slice just
    /// removes it.
    ///
    /// # Safety
    /// Every region must be valid, writable memory of its length and must stay allocated
    /// (not unmapped, not freed) until this channel is dropped or its registration is
    /// replaced or removed ([`UringChannel::register_buffers`] again,
    /// [`UringChannel::unregister_buffers`]): the kernel pins the pages at registration and
    /// reads and writes them through that pinning. Memory that belongs to a live
    /// registration must not be freed even while no request uses it.
    ///
    /// # Errors
    /// [`DeviceError::Unusable`] while requests are in flight or for more than 65536
    /// regions; [`DeviceError::Os`] when the kernel refuses (`EINVAL`: an empty region or
    /// one over 1 GiB, too many regions; `ENOMEM`: memory-lock limit; `EFAULT`: bad memory).
    /// With requests in flight nothing changes; after any other error no buffers are
    /// registered.
    pub unsafe fn register_buffers(
        &mut self,
        regions: &[(NonNull<u8>, usize)],
    ) -> Result<(), DeviceError> {
        if regions.len() > MAX_REGIONS {
            return Err(DeviceError::Unusable(format!(
                "{}: {} buffer regions (at most {MAX_REGIONS})",
                self.shared.info.name,
                regions.len()
            )));
        }
        self.unregister_buffers()?;
        if regions.is_empty() {
            return Ok(());
        }
        let iovecs: Vec<libc::iovec> = regions
            .iter()
            .map(|&(ptr, len)| libc::iovec {
                iov_base: ptr.as_ptr().cast(),
                iov_len: len,
            })
            .collect();
        // SAFETY: the caller promises each region is valid, writable memory that stays
        // allocated until this registration is replaced or removed or the ring is closed
        // (exactly the crate's contract); no request is in flight (checked by
        // unregister_buffers above), so no old fixed buffer is in use.
        unsafe { self.ring.submitter().register_buffers(&iovecs) }.map_err(|e| {
            os(
                format!("io_uring buffer registration for {}", self.shared.info.name),
                e,
            )
        })?;
        self.regions = regions
            .iter()
            .map(|&(ptr, len)| (ptr.as_ptr() as usize, len))
            .collect();
        Ok(())
    }

    /// Removes the registered buffers (if any); requests with a region are refused from
    /// then on. After it returns `Ok`, the regions' memory may be freed.
    ///
    /// # Errors
    /// [`DeviceError::Unusable`] while requests are in flight (they may use the buffers);
    /// [`DeviceError::Os`] if the kernel refuses.
    pub fn unregister_buffers(&mut self) -> Result<(), DeviceError> {
        if self.in_flight != 0 {
            return Err(DeviceError::Unusable(format!(
                "{}: cannot change registered buffers with {} requests in flight",
                self.shared.info.name, self.in_flight
            )));
        }
        if self.regions.is_empty() {
            return Ok(());
        }
        self.ring.submitter().unregister_buffers().map_err(|e| {
            os(
                format!(
                    "io_uring buffer unregistration for {}",
                    self.shared.info.name
                ),
                e,
            )
        })?;
        self.regions = Box::new([]);
        Ok(())
    }

    /// Number of registered buffer regions.
    pub fn registered_regions(&self) -> usize {
        self.regions.len()
    }

    /// Hands queued requests to the kernel and blocks until at least `min_complete`
    /// completions are ready to [`Channel::poll`] (capped at the requests in flight, so it
    /// never waits for something that cannot come), or `timeout` passes, or a signal
    /// arrives. For the adaptive mode (block in the kernel when idle) and for tests; the
    /// polled hot path never calls it.
    ///
    /// # Errors
    /// [`DeviceError::Os`] when `io_uring_enter` fails with anything but `EINTR`, `ETIME`
    /// (the timeout passed), `EAGAIN` or `EBUSY`: those return `Ok` and the caller polls.
    pub fn wait(
        &mut self,
        min_complete: usize,
        timeout: Option<Duration>,
    ) -> Result<(), DeviceError> {
        // Completions served inline are ready already: hand over the queue, wait for none.
        let want = if self.ready_len > 0 {
            0
        } else {
            min_complete.min(self.in_flight)
        };
        let res = match timeout {
            None => self.ring.submit_and_wait(want),
            Some(t) => {
                let ts = types::Timespec::from(t);
                let args = types::SubmitArgs::new().timespec(&ts);
                self.ring.submitter().submit_with_args(want, &args)
            }
        };
        match res {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::ETIME | libc::EAGAIN | libc::EBUSY)
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(os(format!("io_uring wait on {}", self.shared.info.name), e)),
        }
    }

    /// The channel's counters.
    pub fn stats(&self) -> UringStats {
        self.stats
    }

    /// Builds the SQE for `req` (already validated) with `user_data` = `slot`.
    fn entry(req: &Request, slot: u32) -> squeue::Entry {
        let ptr = req.buf.as_ptr();
        let len = req.len_bytes;
        let off = req.offset_bytes;
        if let (Op::Write { fua }, Some(segs)) = (req.op, req.buf.segments()) {
            // An iovec array (IoSeg is laid out as `struct iovec`), valid until the
            // completion (IoBuf::gather contract), which is when the kernel is done with it.
            return opcode::Writev::new(
                MEMBER,
                segs.as_ptr().cast::<libc::iovec>(),
                segs.len() as u32,
            )
            .offset(off)
            .rw_flags(write_flags(fua))
            .build()
            .user_data(u64::from(slot));
        }
        let entry = match (req.op, req.buf.region()) {
            (Op::Read, Some(i)) => opcode::ReadFixed::new(MEMBER, ptr, len, i)
                .offset(off)
                .build(),
            (Op::Read, None) => opcode::Read::new(MEMBER, ptr, len).offset(off).build(),
            (Op::Write { fua }, Some(i)) => opcode::WriteFixed::new(MEMBER, ptr, len, i)
                .offset(off)
                .rw_flags(write_flags(fua))
                .build(),
            (Op::Write { fua }, None) => opcode::Write::new(MEMBER, ptr, len)
                .offset(off)
                .rw_flags(write_flags(fua))
                .build(),
            (Op::Flush, _) => opcode::Fsync::new(MEMBER)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            (Op::WriteZeroes, _) => opcode::Fallocate::new(MEMBER, u64::from(len))
                .offset(off)
                .mode(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE)
                .build(),
            (Op::Discard, _) => opcode::Fallocate::new(MEMBER, u64::from(len))
                .offset(off)
                .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                .build(),
        };
        entry.user_data(u64::from(slot))
    }

    /// Whether `req`'s buffer lies inside the registered region it names (true without a
    /// region or for ops without data).
    fn region_ok(&self, req: &Request) -> bool {
        let Some(i) = req.buf.region() else {
            return true;
        };
        if !req.op.has_data() {
            return true;
        }
        let Some(&(start, len)) = self.regions.get(usize::from(i)) else {
            return false;
        };
        let p = req.buf.as_ptr() as usize;
        p >= start
            && (p - start)
                .checked_add(req.buf.len() as usize)
                .is_some_and(|end| end <= len)
    }

    /// Serves the (validated) read `req` with one `pread(2)` on the member: its outcome as a
    /// CQE result (bytes read or `-errno`), or `None` when the call was interrupted
    /// (`EINTR`, `EAGAIN`), so the read goes through io_uring instead. Only called for
    /// files [`UringDevice::open`] found memory-backed and without `NOWAIT` reads: the call
    /// copies out of the page cache and waits for no device.
    fn read_inline(&self, req: &Request) -> Option<i32> {
        let offset = libc::off_t::try_from(req.offset_bytes).ok()?;
        // SAFETY: the request's IoBuf contract (`IoBuf::from_raw`) makes its buffer valid,
        // writable memory of at least `len_bytes` (checked by `validate`), untouched by
        // anyone else until its completion is returned; the descriptor stays open while
        // `self.shared` lives. The call writes only into that buffer.
        let r = unsafe {
            libc::pread(
                self.shared.file.as_raw_fd(),
                req.buf.as_ptr().cast(),
                req.len_bytes as usize,
                offset,
            )
        };
        if r >= 0 {
            // At most len_bytes ≤ INLINE_READ_MAX_BYTES, so it fits.
            return Some(i32::try_from(r).unwrap_or(i32::MAX));
        }
        match io::Error::last_os_error().raw_os_error() {
            Some(libc::EINTR | libc::EAGAIN) | None => None,
            Some(errno) => Some(-errno),
        }
    }

    /// Pushes `entry`; when the submission ring is full, hands what is queued to the kernel
    /// and tries once more.
    fn push(&mut self, entry: &squeue::Entry) -> bool {
        for attempt in 0..2 {
            if attempt > 0 && !self.submit_queued() {
                return false;
            }
            let mut sq = self.ring.submission();
            // SAFETY: the entry's buffer (if any) is an IoBuf whose `from_raw` contract keeps
            // it valid and untouched until its completion is returned by `poll` or the
            // channel is dropped, and `Drop` waits for every completion; fixed file 0 is
            // registered at channel creation and fixed buffer indices were checked against
            // the live registration (`region_ok`), which cannot change while requests are in
            // flight.
            if unsafe { sq.push(entry) }.is_ok() {
                return true;
            }
        }
        false
    }

    /// One `io_uring_enter` for everything queued (none when SQPOLL is awake), retried a
    /// bounded number of times on `EINTR` or when the kernel took only part of the batch
    /// (a failed SQE on a kernel without `SUBMIT_ALL`). Returns false (and counts a kick
    /// error) when entries are left queued; they go with the next kick.
    fn submit_queued(&mut self) -> bool {
        let sqpoll = self.ring.params().is_setup_sqpoll();
        for _ in 0..MAX_ENTER_TRIES {
            match self.ring.submit() {
                Ok(_) if sqpoll || self.ring.submission().is_empty() => return true,
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(_) => break,
            }
        }
        self.stats.kick_errors += 1;
        false
    }

    /// Reaps completions into `out` (or discards them when `out` is `None`); returns how
    /// many requests finished.
    fn reap(&mut self, mut out: Option<&mut [Completion]>) -> usize {
        let limit = out.as_ref().map_or(usize::MAX, |o| o.len());
        let mut n = 0;
        while n < limit && self.ready_len > 0 {
            let index = self.ready[self.ready_head] as usize;
            self.ready_head = (self.ready_head + 1) % self.ready.len();
            self.ready_len -= 1;
            let slot = &mut self.slots[index];
            slot.busy = false;
            slot.inline = false;
            let done = Completion {
                tag: slot.tag,
                status: completion_status(slot.op, slot.expected, slot.result),
            };
            if let Some(o) = out.as_deref_mut() {
                o[n] = done;
            }
            self.free[self.free_top] = index as u32;
            self.free_top += 1;
            self.in_flight -= 1;
            n += 1;
        }
        let mut cq = self.ring.completion();
        while n < limit {
            let Some(cqe) = cq.next() else { break };
            if cqe.user_data() == CANCEL_USER_DATA {
                // The outcome of an abort request: the aborted request reports its own.
                continue;
            }
            let index = usize::try_from(cqe.user_data()).unwrap_or(usize::MAX);
            let Some(slot) = self.slots.get_mut(index).filter(|s| s.busy) else {
                self.stats.stray_completions += 1;
                continue;
            };
            slot.busy = false;
            let done = Completion {
                tag: slot.tag,
                status: completion_status(slot.op, slot.expected, cqe.result()),
            };
            if let Some(o) = out.as_deref_mut() {
                o[n] = done;
            }
            // A busy slot is never on the free stack, so there is room for it.
            self.free[self.free_top] = index as u32;
            self.free_top += 1;
            self.in_flight -= 1;
            n += 1;
        }
        n
    }

    /// Waits until the kernel holds none of this channel's requests (used by `Drop`).
    fn drain(&mut self) {
        loop {
            self.reap(None);
            if self.in_flight == 0 {
                return;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                    ) => {}
                Err(_) => {
                    // The ring refuses to enter (e.g. its SQPOLL thread died). Requests the
                    // kernel never picked up cannot touch memory; stop when nothing else is
                    // left, otherwise wait for the accepted ones the slow way.
                    if self.in_flight <= self.ring.submission().len() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
}

impl Channel for UringChannel {
    fn info(&self) -> &DeviceInfo {
        &self.shared.info
    }

    /// Validates `req` ([`validate`]), takes a free slot and queues one SQE (no syscall,
    /// unless the submission ring is full, then one `io_uring_enter` to make room).
    ///
    /// # Errors
    /// [`SubmitError::Invalid`] from [`validate`], or for a buffer region that is not
    /// registered or does not contain the buffer; [`SubmitError::QueueFull`] at
    /// `queue_depth` requests in flight, or when the kernel would not take entries off a
    /// full submission ring.
    fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
        validate_gather(&self.shared.info, &req)?;
        if !self.region_ok(&req) {
            return Err(SubmitError::Invalid(
                "buffer not inside the registered region it names",
            ));
        }
        if self.free_top == 0 {
            return Err(SubmitError::QueueFull);
        }
        let index = self.free[self.free_top - 1];
        let inline = if req.op == Op::Read && req.len_bytes <= self.shared.inline_read_max {
            self.read_inline(&req)
        } else {
            None
        };
        if inline.is_some() {
            let at = (self.ready_head + self.ready_len) % self.ready.len();
            self.ready[at] = index;
            self.ready_len += 1;
            self.stats.inline_reads += 1;
        } else if !self.push(&Self::entry(&req, index)) {
            return Err(SubmitError::QueueFull);
        }
        self.free_top -= 1;
        self.slots[index as usize] = Slot {
            tag: req.tag,
            expected: req.len_bytes,
            op: req.op,
            busy: true,
            inline: inline.is_some(),
            result: inline.unwrap_or(0),
        };
        self.in_flight += 1;
        Ok(())
    }

    /// Hands every queued request to the kernel: one `io_uring_enter`, or none when nothing
    /// is queued or an SQPOLL thread is awake. A failing enter is counted in
    /// [`UringStats::kick_errors`] and the requests stay queued for the next kick.
    fn kick(&mut self) {
        if self.ring.submission().is_empty() {
            return;
        }
        self.submit_queued();
    }

    /// Moves finished requests into `out` from the completion ring, without a syscall.
    fn poll(&mut self, out: &mut [Completion]) -> usize {
        if self.in_flight == 0 || out.is_empty() {
            return 0;
        }
        self.reap(Some(out))
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Queues an `IORING_OP_ASYNC_CANCEL` for each request with `tag` and kicks. A request
    /// the kernel can still cancel completes with `-ECANCELED`, reported as
    /// [`IoError::Timeout`]; one already at the device completes when the device returns
    /// it (the block layer's own timeout bounds that).
    fn abort(&mut self, tag: u64) {
        for index in 0..self.slots.len() {
            let slot = &self.slots[index];
            // An inline slot is finished already; its completion waits for `poll`.
            if slot.busy && !slot.inline && slot.tag == tag {
                let entry = opcode::AsyncCancel::new(index as u64)
                    .build()
                    .user_data(CANCEL_USER_DATA);
                if self.push(&entry) {
                    self.stats.aborts += 1;
                }
            }
        }
        self.kick();
    }

    /// Gathered writes go out as one `IORING_OP_WRITEV` (`pwritev2(2)`), their pieces the
    /// iovec array.
    fn gathers(&self) -> bool {
        true
    }
}

// IoSeg is passed to the kernel as `struct iovec`: same size, alignment and field offsets.
const _: () = {
    assert!(std::mem::size_of::<engine::device::IoSeg>() == std::mem::size_of::<libc::iovec>());
    assert!(std::mem::align_of::<engine::device::IoSeg>() == std::mem::align_of::<libc::iovec>());
    assert!(
        std::mem::offset_of!(engine::device::IoSeg, base)
            == std::mem::offset_of!(libc::iovec, iov_base)
    );
    assert!(
        std::mem::offset_of!(engine::device::IoSeg, len)
            == std::mem::offset_of!(libc::iovec, iov_len)
    );
};

/// `user_data` of abort requests: above every slot index.
const CANCEL_USER_DATA: u64 = u64::MAX;

impl Drop for UringChannel {
    /// Submits what is queued and blocks until every request the kernel accepted has
    /// completed, so the kernel never writes into buffers freed after the channel. Blocks
    /// as long as the device takes (a hung device hangs the drop, as it would any reader).
    fn drop(&mut self) {
        self.drain();
    }
}

/// `RWF_*` flags of a write.
fn write_flags(fua: bool) -> i32 {
    if fua {
        libc::RWF_DSYNC
    } else {
        0
    }
}

/// Maps one CQE result to a completion status: negative → [`errno_to_io_error`]; for
/// reads and writes, fewer bytes than `expected` → [`IoError::Short`].
fn completion_status(op: Op, expected: u32, res: i32) -> Result<(), IoError> {
    if res < 0 {
        return Err(errno_to_io_error(op, res.wrapping_neg()));
    }
    let done = res.unsigned_abs();
    if op.has_data() && done < expected {
        return Err(IoError::Short { done, expected });
    }
    Ok(())
}

/// Maps a (positive) errno from a completion of `op` to an [`IoError`] (table in the module
/// documentation).
fn errno_to_io_error(op: Op, errno: i32) -> IoError {
    let sync_or_alloc = matches!(op, Op::Flush | Op::WriteZeroes | Op::Discard);
    match errno {
        libc::ENOSPC => IoError::NoSpace,
        libc::ENODEV | libc::ENXIO => IoError::Gone,
        libc::ENODATA => IoError::Medium,
        libc::ETIMEDOUT | libc::ECANCELED => IoError::Timeout,
        libc::EOPNOTSUPP => IoError::Unsupported,
        libc::EINVAL if sync_or_alloc => IoError::Unsupported,
        errno => IoError::Io { errno },
    }
}

fn os(what: String, source: io::Error) -> DeviceError {
    DeviceError::Os { what, source }
}

/// Accepts regular files and block devices only.
fn file_kind(shown: &str, t: std::fs::FileType) -> Result<Kind, DeviceError> {
    if t.is_file() {
        Ok(Kind::RegularFile)
    } else if t.is_block_device() {
        Ok(Kind::BlockDevice)
    } else {
        let what = if t.is_dir() {
            "a directory"
        } else if t.is_char_device() {
            "a character device"
        } else if t.is_fifo() {
            "a FIFO"
        } else if t.is_socket() {
            "a socket"
        } else {
            "not a regular file or block device"
        };
        Err(DeviceError::Unusable(format!(
            "{shown}: is {what}; a member must be a regular file or a block device"
        )))
    }
}

/// Checks a block size and returns it.
fn check_block(shown: &str, block: u64, source: &str) -> Result<u32, DeviceError> {
    match u32::try_from(block) {
        Ok(b) if b.is_power_of_two() && (MIN_BLOCK_BYTES..=MAX_BLOCK_BYTES).contains(&b) => Ok(b),
        _ => Err(DeviceError::Unusable(format!(
            "{shown}: block size {block} bytes ({source}) is not a power of two from \
             {MIN_BLOCK_BYTES} to {MAX_BLOCK_BYTES}"
        ))),
    }
}

/// Rounds `bytes` down to whole blocks and refuses less than one block.
fn check_capacity(shown: &str, bytes: u64, block: u32) -> Result<u64, DeviceError> {
    let capacity = bytes - bytes % u64::from(block);
    if capacity == 0 {
        return Err(DeviceError::Unusable(format!(
            "{shown}: size {bytes} bytes is less than one {block}-byte block"
        )));
    }
    Ok(capacity)
}

fn base_info(shown: &str, config: &UringConfig, block: u32, capacity: u64) -> DeviceInfo {
    DeviceInfo {
        name: shown.to_owned(),
        block_bytes: block,
        capacity_bytes: capacity,
        queue_depth: config.queue_depth,
        max_transfer_bytes: DEFAULT_MAX_TRANSFER_BYTES,
        volatile_cache: true,
        write_zeroes: true,
        discard: true,
        rotational: true,
    }
}

/// `statx` of an open file.
fn statx(file: &File, mask: u32) -> io::Result<libc::statx> {
    let mut stx = MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: the descriptor is open for the call; an empty path with AT_EMPTY_PATH names
    // the descriptor itself; `stx` points to writable memory of the struct's size.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            mask,
            stx.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statx is plain old data (integers only), so the zeroed value is valid; the
    // kernel filled what it reports.
    Ok(unsafe { stx.assume_init() })
}

fn regular_file_info(
    path: &Path,
    shown: &str,
    file: &File,
    config: &UringConfig,
) -> Result<DeviceInfo, DeviceError> {
    let stx = statx(file, libc::STATX_SIZE | libc::STATX_DIOALIGN)
        .map_err(|e| os(format!("statx {shown}"), e))?;
    let block = if !config.direct {
        MIN_BLOCK_BYTES
    } else if stx.stx_mask & libc::STATX_DIOALIGN != 0 && stx.stx_dio_offset_align != 0 {
        if stx.stx_dio_mem_align as usize > BUF_ALIGN {
            return Err(DeviceError::Unusable(format!(
                "{shown}: direct I/O needs {}-byte memory alignment (buffers are \
                 {BUF_ALIGN}-aligned)",
                stx.stx_dio_mem_align
            )));
        }
        let align = stx.stx_dio_offset_align.max(MIN_BLOCK_BYTES);
        check_block(shown, u64::from(align), "statx DIO offset alignment")?
    } else if probe_direct_512(file)
        .map_err(|e| os(format!("probe O_DIRECT read of {shown}"), e))?
    {
        MIN_BLOCK_BYTES
    } else {
        4096
    };
    let capacity = check_capacity(shown, stx.stx_size, block)?;
    let (write_zeroes, discard) = probe_fallocate(path);
    // The file system's device: a memory file system has none (and does not seek);
    // otherwise its queue's `rotational` (a partition's is its disk's), rotating when
    // sysfs cannot tell (a device-mapper stack answers for its top device).
    let rotational =
        !memory_backed(file) && SysfsQueue::of(stx.stx_dev_major, stx.stx_dev_minor).rotational();
    Ok(DeviceInfo {
        write_zeroes,
        discard,
        rotational,
        ..base_info(shown, config, block, capacity)
    })
}

/// Whether `file` lives on a memory-only file system (tmpfs, ramfs: [`MEMORY_FS_MAGICS`]),
/// from `fstatfs`; false when that fails.
fn memory_backed(file: &File) -> bool {
    let mut st = MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: the descriptor is open for the call; `st` points to writable memory of the
    // struct's size.
    if unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: statfs is plain old data (integers only); the kernel filled it.
    let st = unsafe { st.assume_init() };
    // f_type is a C long or unsigned int depending on the target; the magics fit 32 bits.
    let magic = (st.f_type as u64) & 0xffff_ffff;
    MEMORY_FS_MAGICS.contains(&magic)
}

/// Whether the kernel takes `RWF_NOWAIT` reads of `file` (the file has `FMODE_NOWAIT`, the
/// flag io_uring needs to issue a read inline rather than through io-wq): one
/// `block`-byte `preadv2(RWF_NOWAIT)` at offset 0 into an aligned buffer. `EOPNOTSUPP` is
/// the kernel's "no"; data, `EAGAIN` (would block) or any other answer count as yes, so
/// a doubtful probe leaves reads to io_uring.
fn takes_nowait_reads(file: &File, block: u32) -> bool {
    let mut buf = AlignedBuf::zeroed(block as usize);
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: one iovec over a live buffer of its length; the descriptor is open.
    let r = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, 0, libc::RWF_NOWAIT) };
    r >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EOPNOTSUPP)
}

/// Whether a 512-byte `O_DIRECT` read at offset 0 (into a 4 KiB-aligned buffer) is
/// accepted; `EINVAL` means a coarser alignment.
fn probe_direct_512(file: &File) -> io::Result<bool> {
    let mut buf = AlignedBuf::zeroed(MIN_BLOCK_BYTES as usize);
    match file.read_at(&mut buf, 0) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Which of `ZERO_RANGE|KEEP_SIZE` and `PUNCH_HOLE|KEEP_SIZE` the file system holding
/// `path` supports, tried on an anonymous `O_TMPFILE` in the same directory (never on the
/// member). Only `EOPNOTSUPP` counts as unsupported; when no temporary file can be made,
/// both are assumed (a request then fails with [`IoError::Unsupported`] if wrong).
fn probe_fallocate(path: &Path) -> (bool, bool) {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let Ok(tmp) = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .open(&dir)
    else {
        return (true, true);
    };
    let works = |mode: i32| {
        // SAFETY: plain syscall on a descriptor we own, no memory passed.
        let rc = unsafe { libc::fallocate(tmp.as_raw_fd(), mode, 0, 4096) };
        rc == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EOPNOTSUPP)
    };
    (
        works(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE),
        works(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE),
    )
}

fn block_device_info(
    shown: &str,
    file: &File,
    config: &UringConfig,
) -> Result<(DeviceInfo, Option<u32>), DeviceError> {
    let fd = file.as_raw_fd();
    let mut logical: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, which points to a live int.
    let rc = unsafe { libc::ioctl(fd, libc::BLKSSZGET, &mut logical as *mut libc::c_int) };
    if rc != 0 {
        return Err(os(
            format!("ioctl BLKSSZGET on {shown}"),
            io::Error::last_os_error(),
        ));
    }
    let block = check_block(shown, u64::try_from(logical).unwrap_or(0), "BLKSSZGET")?;

    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points to a live u64.
    let rc = unsafe { libc::ioctl(fd, BLKGETSIZE64 as _, &mut size as *mut u64) };
    if rc != 0 {
        return Err(os(
            format!("ioctl BLKGETSIZE64 on {shown}"),
            io::Error::last_os_error(),
        ));
    }
    let capacity = check_capacity(shown, size, block)?;

    let stx = statx(file, libc::STATX_TYPE).map_err(|e| os(format!("statx {shown}"), e))?;
    let queue = SysfsQueue::of(stx.stx_rdev_major, stx.stx_rdev_minor);
    let max_transfer = queue
        .read_u64("max_sectors_kb")
        .and_then(|kb| kb.checked_mul(1024))
        .map_or(DEFAULT_MAX_TRANSFER_BYTES, |b| {
            b.min(u64::from(DEFAULT_MAX_TRANSFER_BYTES)) as u32
        });
    let max_transfer = (max_transfer - max_transfer % block).max(block);
    let volatile_cache = queue
        .read("write_cache")
        .is_none_or(|s| s.trim() != "write through");
    let discard = queue
        .read_u64("write_zeroes_max_bytes")
        .is_some_and(|b| b > 0);
    let device_depth = queue.device_queue_depth();
    let queue_depth = channel_depth(config.queue_depth, device_depth);
    Ok((
        DeviceInfo {
            max_transfer_bytes: max_transfer,
            volatile_cache,
            write_zeroes: true,
            discard,
            queue_depth,
            rotational: queue.rotational(),
            ..base_info(shown, config, block, capacity)
        },
        device_depth,
    ))
}

/// The channel depth of a block device whose hardware queue holds `device` commands
/// (`None`: unknown or effectively unlimited, as for NVMe): the configured depth, capped at
/// the device's depth but never below 2 — DESIGN.md's rule that a QD=1 disk is kept at two
/// in flight (one at the disk, the next waiting in the kernel), so it never idles between
/// requests while deeper queues in the kernel only add latency.
fn channel_depth(configured: u32, device: Option<u32>) -> u32 {
    match device {
        Some(d) if d > 0 => configured.min(d.max(2)),
        _ => configured,
    }
}

/// The `queue/` directory of a block device in sysfs (a partition's is its disk's).
struct SysfsQueue {
    dirs: [PathBuf; 2],
}

impl SysfsQueue {
    fn of(major: u32, minor: u32) -> Self {
        let dev = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
        Self {
            dirs: [dev.join("queue"), dev.join("../queue")],
        }
    }

    fn read(&self, attr: &str) -> Option<String> {
        self.dirs
            .iter()
            .find_map(|d| std::fs::read_to_string(d.join(attr)).ok())
    }

    fn read_u64(&self, attr: &str) -> Option<u64> {
        self.read(attr)?.trim().parse().ok()
    }

    /// `queue/rotational`: whether the kernel says the device seeks (it is 1 unless the
    /// driver marked the queue non-rotational); `true` when it cannot be read.
    fn rotational(&self) -> bool {
        self.read_u64("rotational") != Some(0)
    }

    /// The device's own command queue depth: `device/queue_depth` of a SCSI or SATA disk
    /// (the libata/SCSI midlayer's per-device depth: 31 or 32 with NCQ, 1 without), beside
    /// `queue/` (a partition's is its disk's). `None` for devices without one (NVMe,
    /// virtio, loop).
    fn device_queue_depth(&self) -> Option<u32> {
        self.dirs.iter().find_map(|d| {
            let f = d.parent()?.join("device/queue_depth");
            std::fs::read_to_string(f).ok()?.trim().parse().ok()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Op = Op::Write { fua: false };

    #[test]
    fn errno_mapping() {
        for op in [Op::Read, W, Op::Flush, Op::WriteZeroes, Op::Discard] {
            assert_eq!(errno_to_io_error(op, libc::EIO), IoError::Io { errno: 5 });
            assert_eq!(errno_to_io_error(op, libc::ENOSPC), IoError::NoSpace);
            assert_eq!(errno_to_io_error(op, libc::ENODEV), IoError::Gone);
            assert_eq!(errno_to_io_error(op, libc::ENXIO), IoError::Gone);
            assert_eq!(errno_to_io_error(op, libc::ENODATA), IoError::Medium);
            assert_eq!(errno_to_io_error(op, libc::ETIMEDOUT), IoError::Timeout);
            assert_eq!(
                errno_to_io_error(op, libc::EOPNOTSUPP),
                IoError::Unsupported
            );
            assert_eq!(
                errno_to_io_error(op, libc::EBADF),
                IoError::Io { errno: libc::EBADF }
            );
        }
        for op in [Op::Flush, Op::WriteZeroes, Op::Discard] {
            assert_eq!(errno_to_io_error(op, libc::EINVAL), IoError::Unsupported);
        }
        for op in [Op::Read, Op::Write { fua: true }] {
            assert_eq!(
                errno_to_io_error(op, libc::EINVAL),
                IoError::Io {
                    errno: libc::EINVAL
                }
            );
        }
    }

    #[test]
    fn completion_results() {
        assert_eq!(completion_status(Op::Read, 4096, 4096), Ok(()));
        assert_eq!(
            completion_status(Op::Read, 4096, 512),
            Err(IoError::Short {
                done: 512,
                expected: 4096
            })
        );
        assert_eq!(
            completion_status(W, 4096, 0),
            Err(IoError::Short {
                done: 0,
                expected: 4096
            })
        );
        assert_eq!(completion_status(Op::Flush, 0, 0), Ok(()));
        assert_eq!(completion_status(Op::Discard, 4096, 0), Ok(()));
        assert_eq!(
            completion_status(Op::Read, 4096, -libc::EIO),
            Err(IoError::Io { errno: 5 })
        );
        assert_eq!(
            completion_status(Op::WriteZeroes, 4096, -libc::EINVAL),
            Err(IoError::Unsupported)
        );
        // Nothing the kernel returns panics, not even nonsense.
        assert_eq!(
            completion_status(Op::Read, 4096, i32::MIN),
            Err(IoError::Io { errno: i32::MIN })
        );
        assert_eq!(completion_status(Op::Read, 4096, i32::MAX), Ok(()));
    }

    #[test]
    fn channel_depth_follows_the_device() {
        assert_eq!(channel_depth(128, None), 128);
        assert_eq!(channel_depth(128, Some(32)), 32);
        assert_eq!(channel_depth(128, Some(1)), 2);
        assert_eq!(channel_depth(1, Some(1)), 1);
        assert_eq!(channel_depth(16, Some(0)), 16);
        assert_eq!(channel_depth(8, Some(1024)), 8);
    }

    #[test]
    fn blkgetsize64_matches_the_kernel_header_on_x86_64() {
        #[cfg(target_arch = "x86_64")]
        assert_eq!(BLKGETSIZE64, 0x8008_1272);
    }

    /// `rotational` follows the file system's device: a file on a memory file system
    /// never seeks; a file elsewhere gets its device's `queue/rotational` (read here
    /// through the path `stat` names, not the driver's `statx`).
    #[test]
    fn rotational_follows_the_file_systems_device() {
        use std::os::unix::fs::MetadataExt;
        let cfg = UringConfig::default();
        let member = |dir: &Path| {
            let f = tempfile::NamedTempFile::new_in(dir).unwrap();
            f.as_file().set_len(1 << 20).unwrap();
            let dev = UringDevice::open(f.path(), &cfg).unwrap();
            (f, dev.info().rotational)
        };
        if Path::new("/dev/shm").is_dir() {
            let (_f, rotational) = member(Path::new("/dev/shm"));
            assert!(!rotational, "a tmpfs file does not seek");
        }
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        let (f, rotational) = member(here);
        let dev = f.as_file().metadata().unwrap().dev();
        let (major, minor) = (libc::major(dev), libc::minor(dev));
        let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
        let flag = [
            sys.join("queue/rotational"),
            sys.join("../queue/rotational"),
        ]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok());
        match flag {
            Some(v) => assert_eq!(rotational, v.trim() != "0", "{}: {v}", sys.display()),
            // No block device behind the file system (tmpfs, overlay, a network file
            // system): memory-backed ones do not seek, the others are assumed to.
            None => assert_eq!(rotational, !memory_backed(f.as_file())),
        }
    }

    #[test]
    fn refuses_what_is_not_a_member() {
        let cfg = UringConfig::default();
        let err = UringDevice::open("/dev/null", &cfg).unwrap_err();
        assert!(err.to_string().contains("/dev/null"), "{err}");
        assert!(err.to_string().contains("character device"), "{err}");
        let err = UringDevice::open("/", &cfg).unwrap_err();
        assert!(err.to_string().contains("directory"), "{err}");
        let err = UringDevice::open("/nonexistent/ferroraid", &cfg).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/ferroraid"), "{err}");
        let zero = UringConfig {
            queue_depth: 0,
            ..cfg
        };
        assert!(matches!(
            UringDevice::open("/dev/null", &zero),
            Err(DeviceError::Unusable(_))
        ));
    }
}
