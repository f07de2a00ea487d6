//! `nvme_passthru`: NVMe I/O commands through io_uring passthrough on the NVMe generic
//! character device `/dev/ngXnY` (Linux 5.19+; `IORING_OP_URING_CMD` with
//! `NVME_URING_CMD_IO`, on a ring created with `IORING_SETUP_SQE128 | IORING_SETUP_CQE32`).
//!
//! The kernel's block layer is skipped above the NVMe driver: no I/O scheduler, no
//! request merging or splitting, no partition remapping; every [`Request`] becomes exactly
//! one NVMe command on the namespace the character device stands for.
//!
//! | [`Op`]          | NVMe command (NVM Command Set 1.0 §3)                           |
//! |-----------------|-----------------------------------------------------------------|
//! | `Read`          | Read (02h)                                                      |
//! | `Write { fua }` | Write (01h), FUA bit (CDW12 bit 30) when `fua`                  |
//! | `Flush`         | Flush (00h)                                                     |
//! | `WriteZeroes`   | Write Zeroes (08h), when Identify Controller ONCS bit 3 is set  |
//! | `Discard`       | Dataset Management (09h), one range, Attribute Deallocate; only when ONCS bit 2 is set **and** DLFEAT says deallocated blocks read as zeroes |
//!
//! # Facts read at open ([`DeviceInfo`])
//!
//! - Namespace id: `NVME_IOCTL_ID`.
//! - Identify Namespace (CNS 00h) and Identify Controller (CNS 01h) through
//!   `NVME_IOCTL_ADMIN_CMD` (needs `CAP_SYS_ADMIN`): capacity = NSZE × the block size of
//!   the LBA format FLBAS selects (512 or 4096 bytes in practice; any power of two from 512
//!   to 64 KiB is accepted; formats with metadata are refused); volatile cache from VWC;
//!   write zeroes / discard as in the table.
//! - Largest transfer (bytes): the smallest of 1 MiB, MDTS (× 4 KiB, the page size Linux
//!   runs every controller with), the block queue's `max_hw_sectors_kb` and
//!   `max_segments` × 4 KiB (a user buffer is mapped page by page) from
//!   `/sys/block/nvmeXnY/queue/`, and [`nvme::MAX_NLB`] blocks.
//!
//! # Polled completions (IOPOLL)
//!
//! With [`IoPoll::Auto`] (default) the ring is created with `IORING_SETUP_IOPOLL` when the
//! namespace's queue reports polling (`queue/io_poll` = 1, i.e. the nvme module was loaded
//! with `poll_queues=N`); the commands then go to a polled hardware queue and
//! [`Channel::poll`] reaps by entering the kernel with `IORING_ENTER_GETEVENTS` (one
//! non-blocking pass over the device queue). Without poll queues the ring is interrupt
//! driven and `poll` reads the completion ring without a syscall. [`IoPoll::On`] refuses to
//! open a device without poll queues; [`IoPoll::Off`] never polls.
//!
//! # Completion status
//!
//! A CQE result `< 0` is a kernel errno (mapped as the `uring` back end does: `EIO` →
//! [`IoError::Io`], `ENODEV`/`ENXIO` → [`IoError::Gone`], `ECANCELED`/`ETIMEDOUT`/`EINTR` →
//! [`IoError::Timeout`], ...); `> 0` is the NVMe status field (SCT/SC, no phase bit) mapped
//! by [`nvme::status_to_result`]; 0 is success.
//!
//! # Hot path
//!
//! As [`crate::uring`]: a fixed in-flight table (slot index = `user_data`), one SQE per
//! request, one `io_uring_enter` per `kick`; no allocation, no lock. Each slot owns a
//! 16-byte Dataset Management range, so a discard needs no allocation either.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use engine::device::{
    validate, BlockDevice, Channel, Completion, DeviceError, DeviceInfo, IoError, Op, Request,
    SubmitError,
};
use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::nvme::{self, ControllerIdentity, DsmRange, NamespaceIdentity};

/// A passthrough channel is an io_uring like the block back end's: the same default and
/// largest queue depth, and the same default largest transfer.
pub use crate::uring::{DEFAULT_MAX_TRANSFER_BYTES, DEFAULT_QUEUE_DEPTH, MAX_QUEUE_DEPTH};
/// Memory page size the Linux NVMe driver runs controllers with (`NVME_CTRL_PAGE_SIZE`):
/// the unit of MDTS as Linux applies it, and of a user-buffer segment.
const CTRL_PAGE_BYTES: u64 = 4096;
/// `io_uring_enter` calls one `kick` makes before leaving the rest for the next.
const MAX_ENTER_TRIES: u32 = 16;
/// Fixed-file index of the character device in every channel.
const NG: types::Fixed = types::Fixed(0);
/// `user_data` of abort requests: above every slot index.
const CANCEL_USER_DATA: u64 = u64::MAX;
/// `IORING_ENTER_GETEVENTS` of `<linux/io_uring.h>` (the crate keeps its `sys` private).
const IORING_ENTER_GETEVENTS: u32 = 1;

/// `NVME_IOCTL_ID` = `_IO('N', 0x40)`: the namespace id of the device.
const NVME_IOCTL_ID: libc::c_ulong = 0x4E40;
/// `NVME_IOCTL_ADMIN_CMD` = `_IOWR('N', 0x41, struct nvme_admin_cmd)` (72 bytes).
const NVME_IOCTL_ADMIN_CMD: libc::c_ulong = 0xC048_4E41;
/// `NVME_URING_CMD_IO` = `_IOWR('N', 0x80, struct nvme_uring_cmd)` (72 bytes).
const NVME_URING_CMD_IO: u32 = 0xC048_4E80;

/// `struct nvme_passthru_cmd` / `nvme_admin_cmd` of `<linux/nvme_ioctl.h>`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PassthruCmd {
    opcode: u8,
    flags: u8,
    rsvd1: u16,
    nsid: u32,
    cdw2: u32,
    cdw3: u32,
    metadata: u64,
    addr: u64,
    metadata_len: u32,
    data_len: u32,
    cdw10: u32,
    cdw11: u32,
    cdw12: u32,
    cdw13: u32,
    cdw14: u32,
    cdw15: u32,
    timeout_ms: u32,
    result: u32,
}
const _: () = assert!(std::mem::size_of::<PassthruCmd>() == 72);

/// `struct nvme_uring_cmd` of `<linux/nvme_ioctl.h>`: the first 72 of the SQE's 80 command
/// bytes.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct UringCmd {
    opcode: u8,
    flags: u8,
    rsvd1: u16,
    nsid: u32,
    cdw2: u32,
    cdw3: u32,
    metadata: u64,
    addr: u64,
    metadata_len: u32,
    data_len: u32,
    cdw10: u32,
    cdw11: u32,
    cdw12: u32,
    cdw13: u32,
    cdw14: u32,
    cdw15: u32,
    timeout_ms: u32,
    rsvd2: u32,
}
const _: () = assert!(std::mem::size_of::<UringCmd>() == 72);

impl UringCmd {
    /// The 80 command bytes of a 128-byte SQE.
    fn to_bytes(self) -> [u8; 80] {
        let mut out = [0u8; 80];
        // SAFETY: UringCmd is repr(C) plain integers without padding (72 bytes, asserted
        // above); copying its bytes into a larger array is a plain byte copy.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&self as *const UringCmd).cast::<u8>(),
                out.as_mut_ptr(),
                std::mem::size_of::<UringCmd>(),
            );
        }
        out
    }
}

/// Whether channels poll for completions (`IORING_SETUP_IOPOLL`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IoPoll {
    /// Poll when the namespace has poll queues (`queue/io_poll` = 1), else interrupts.
    #[default]
    Auto,
    /// Never poll.
    Off,
    /// Always poll; opening fails when the kernel has no poll queues for the device.
    On,
}

/// How to open a [`PassthruDevice`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassthruConfig {
    /// Commands one channel may have in flight (1 to [`MAX_QUEUE_DEPTH`]).
    pub queue_depth: u32,
    /// Polled completions.
    pub iopoll: IoPoll,
}

impl Default for PassthruConfig {
    fn default() -> Self {
        Self {
            queue_depth: DEFAULT_QUEUE_DEPTH,
            iopoll: IoPoll::Auto,
        }
    }
}

#[derive(Debug)]
struct Shared {
    info: DeviceInfo,
    file: File,
    nsid: u32,
    /// log2 of the block size.
    lba_shift: u32,
    iopoll: bool,
}

/// An NVMe namespace driven through its generic character device (`/dev/ngXnY`).
#[derive(Debug)]
pub struct PassthruDevice {
    shared: Arc<Shared>,
    controller: ControllerIdentity,
}

impl PassthruDevice {
    /// Opens the NVMe generic character device `path` read-write and reads its facts (see
    /// the module documentation). The device name is the path as given.
    ///
    /// # Errors
    /// [`DeviceError::Unusable`] (naming the path) for a queue depth outside
    /// 1..=[`MAX_QUEUE_DEPTH`], a path that is not a character device, a namespace whose
    /// LBA format carries metadata or is not 512 B–64 KiB, an inactive namespace, or
    /// [`IoPoll::On`] without poll queues; [`DeviceError::Os`] when `open`, `NVME_IOCTL_ID`
    /// (not an NVMe device) or an Identify command fails (`EACCES`/`EPERM` without
    /// `CAP_SYS_ADMIN`), or with the NVMe status of a failed Identify.
    pub fn open(path: impl AsRef<Path>, config: &PassthruConfig) -> Result<Self, DeviceError> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        if config.queue_depth == 0 || config.queue_depth > MAX_QUEUE_DEPTH {
            return Err(DeviceError::Unusable(format!(
                "{shown}: queue depth {} outside 1..={MAX_QUEUE_DEPTH}",
                config.queue_depth
            )));
        }
        let meta = std::fs::metadata(path).map_err(|e| os(format!("stat {shown}"), e))?;
        if !meta.file_type().is_char_device() {
            return Err(DeviceError::Unusable(format!(
                "{shown}: not a character device; NVMe passthrough takes the generic \
                 character device /dev/ngXnY"
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| os(format!("open {shown} read-write"), e))?;
        let fd = file.as_raw_fd();
        // SAFETY: NVME_IOCTL_ID takes no argument and returns the namespace id or -1.
        let nsid = unsafe { libc::ioctl(fd, NVME_IOCTL_ID) };
        if nsid <= 0 {
            return Err(os(
                format!("NVME_IOCTL_ID on {shown} (is it an NVMe generic device?)"),
                io::Error::last_os_error(),
            ));
        }
        let nsid = nsid as u32;
        let mut data = vec![0u8; 4096].into_boxed_slice();
        admin_identify(&file, nsid, 0x00, &mut data)
            .map_err(|e| os(format!("Identify Namespace {nsid} on {shown}"), e))?;
        let ns = NamespaceIdentity::parse(data[..].try_into().expect("4096 bytes"))
            .map_err(|why| DeviceError::Unusable(format!("{shown}: {why}")))?;
        if ns.metadata_bytes != 0 {
            return Err(DeviceError::Unusable(format!(
                "{shown}: the namespace is formatted with {} metadata bytes per block; \
                 ferroraid needs a format without metadata",
                ns.metadata_bytes
            )));
        }
        data.fill(0);
        admin_identify(&file, 0, 0x01, &mut data)
            .map_err(|e| os(format!("Identify Controller on {shown}"), e))?;
        let ctrl = ControllerIdentity::parse(data[..].try_into().expect("4096 bytes"));

        let queue = block_queue_dir(path);
        let read_u64 = |attr: &str| -> Option<u64> {
            let dir = queue.as_ref()?;
            std::fs::read_to_string(dir.join(attr))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        let block = u64::from(ns.block_bytes);
        let mut max = u64::from(DEFAULT_MAX_TRANSFER_BYTES);
        if let Some(m) = ctrl.max_transfer_bytes(CTRL_PAGE_BYTES) {
            max = max.min(m);
        }
        if let Some(kb) = read_u64("max_hw_sectors_kb") {
            max = max.min(kb * 1024);
        }
        if let Some(segs) = read_u64("max_segments") {
            max = max.min(segs.saturating_mul(CTRL_PAGE_BYTES));
        }
        max = max.min(u64::from(nvme::MAX_NLB) * block);
        let max = (max - max % block).max(block) as u32;
        let has_poll_queues = read_u64("io_poll").is_some_and(|v| v == 1);
        let iopoll = match config.iopoll {
            IoPoll::Off => false,
            IoPoll::Auto => has_poll_queues,
            IoPoll::On if has_poll_queues => true,
            IoPoll::On => {
                return Err(DeviceError::Unusable(format!(
                    "{shown}: IOPOLL asked for, but the namespace has no poll queues (load \
                     the nvme module with poll_queues=N)"
                )))
            }
        };
        let info = DeviceInfo {
            name: shown,
            block_bytes: ns.block_bytes,
            capacity_bytes: ns.capacity_bytes(),
            queue_depth: config.queue_depth,
            max_transfer_bytes: max,
            volatile_cache: ctrl.vwc,
            write_zeroes: ctrl.write_zeroes(),
            discard: ctrl.dsm() && ns.deallocated_reads_zeroes,
            // NVMe rotational media (NVMe 2.0's Rotational Media bit) is not read yet; the
            // solid-state NVMe devices this driver serves do not seek.
            rotational: false,
        };
        Ok(Self {
            shared: Arc::new(Shared {
                info,
                file,
                nsid,
                lba_shift: ns.block_bytes.trailing_zeros(),
                iopoll,
            }),
            controller: ctrl,
        })
    }

    /// The namespace id.
    pub fn nsid(&self) -> u32 {
        self.shared.nsid
    }

    /// Whether channels poll for completions (IOPOLL).
    pub fn iopoll(&self) -> bool {
        self.shared.iopoll
    }

    /// What Identify Controller reported.
    pub fn controller(&self) -> &ControllerIdentity {
        &self.controller
    }
}

/// Identify (`cns`) through the admin passthrough ioctl into `data` (4096 bytes).
fn admin_identify(file: &File, nsid: u32, cns: u32, data: &mut [u8]) -> io::Result<()> {
    assert_eq!(data.len(), 4096);
    let mut cmd = PassthruCmd {
        opcode: nvme::ADMIN_IDENTIFY,
        nsid,
        addr: data.as_mut_ptr() as u64,
        data_len: 4096,
        cdw10: cns,
        ..PassthruCmd::default()
    };
    // SAFETY: `cmd` is a live nvme_admin_cmd; its `addr` points to `data`, 4096 writable
    // bytes that outlive the (synchronous) ioctl.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), NVME_IOCTL_ADMIN_CMD, &mut cmd) };
    match rc {
        0 => Ok(()),
        r if r < 0 => Err(io::Error::last_os_error()),
        status => Err(io::Error::other(format!(
            "NVMe status {status:#x} ({})",
            nvme::status_name(status as u16)
        ))),
    }
}

/// `/sys/block/nvmeXnY/queue` for the generic device `ngXnY` (same instance numbers).
fn block_queue_dir(path: &Path) -> Option<PathBuf> {
    let real = std::fs::canonicalize(path).ok()?;
    let name = real.file_name()?.to_str()?;
    let rest = name.strip_prefix("ng")?;
    let dir = PathBuf::from(format!("/sys/block/nvme{rest}/queue"));
    dir.is_dir().then_some(dir)
}

impl BlockDevice for PassthruDevice {
    type Channel = PassthruChannel;

    fn info(&self) -> &DeviceInfo {
        &self.shared.info
    }

    /// Creates an io_uring with 128-byte SQEs and 32-byte CQEs (IOPOLL when the device
    /// polls), `queue_depth` entries, the character device as fixed file 0.
    ///
    /// # Errors
    /// [`DeviceError::Os`] when the kernel refuses the ring (`EINVAL` on kernels without
    /// SQE128/CQE32, before 5.19) or the file registration.
    fn open_channel(&self) -> Result<PassthruChannel, DeviceError> {
        let info = &self.shared.info;
        let mut builder = IoUring::<squeue::Entry128, cqueue::Entry32>::builder();
        if self.shared.iopoll {
            builder.setup_iopoll();
        }
        let ring = builder.build(info.queue_depth).map_err(|e| {
            os(
                format!("io_uring setup (SQE128/CQE32) for {}", info.name),
                e,
            )
        })?;
        ring.submitter()
            .register_files(&[self.shared.file.as_raw_fd()])
            .map_err(|e| os(format!("io_uring file registration for {}", info.name), e))?;
        let depth = info.queue_depth as usize;
        Ok(PassthruChannel {
            ring,
            shared: Arc::clone(&self.shared),
            slots: vec![Slot::IDLE; depth].into_boxed_slice(),
            ranges: vec![DsmRange::default(); depth].into_boxed_slice(),
            free: (0..info.queue_depth).rev().collect(),
            free_top: depth,
            in_flight: 0,
            stats: PassthruStats::default(),
        })
    }
}

/// Counters of one channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassthruStats {
    /// `io_uring_enter` failures (requests stay queued for the next kick).
    pub kick_errors: u64,
    /// Completions that matched no request in flight.
    pub stray_completions: u64,
    /// Abort (`ASYNC_CANCEL`) requests issued.
    pub aborts: u64,
    /// Completions with an NVMe status other than success.
    pub nvme_errors: u64,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    tag: u64,
    op: Op,
    busy: bool,
}

impl Slot {
    const IDLE: Slot = Slot {
        tag: 0,
        op: Op::Flush,
        busy: false,
    };
}

/// A per-reactor queue pair on a [`PassthruDevice`]: its own SQE128/CQE32 io_uring.
///
/// `Send` for the reasons given on [`crate::uring::UringChannel`] (no
/// `IORING_SETUP_SINGLE_ISSUER`; all state owned; `&mut self` for every ring access).
pub struct PassthruChannel {
    ring: IoUring<squeue::Entry128, cqueue::Entry32>,
    shared: Arc<Shared>,
    slots: Box<[Slot]>,
    /// One Dataset Management range per slot, lent to the kernel with a discard.
    ranges: Box<[DsmRange]>,
    free: Box<[u32]>,
    free_top: usize,
    in_flight: usize,
    stats: PassthruStats,
}

const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<PassthruChannel>();
};

impl PassthruChannel {
    /// The channel's counters.
    pub fn stats(&self) -> PassthruStats {
        self.stats
    }

    /// Builds the 72-byte passthrough command for `req` (validated) in `slot`.
    fn command(&mut self, req: &Request, slot: u32) -> UringCmd {
        let s = &self.shared;
        let slba = req.offset_bytes >> s.lba_shift;
        let nlb = req.len_bytes >> s.lba_shift;
        let c = nvme::io_command(req.op, 0, s.nsid, slba, nlb);
        let mut cmd = UringCmd {
            opcode: c.opcode(),
            nsid: c.nsid,
            cdw10: c.cdw10,
            cdw11: c.cdw11,
            cdw12: c.cdw12,
            ..UringCmd::default()
        };
        match req.op {
            Op::Read | Op::Write { .. } => {
                cmd.addr = req.buf.as_ptr() as u64;
                cmd.data_len = req.len_bytes;
            }
            Op::Discard => {
                let r = &mut self.ranges[slot as usize];
                *r = DsmRange {
                    attributes: 0,
                    nlb,
                    slba,
                };
                cmd.addr = r as *mut DsmRange as u64;
                cmd.data_len = std::mem::size_of::<DsmRange>() as u32;
            }
            Op::Flush | Op::WriteZeroes => {}
        }
        cmd
    }

    fn push(&mut self, entry: &squeue::Entry128) -> bool {
        for attempt in 0..2 {
            if attempt > 0 && !self.submit_queued() {
                return false;
            }
            let mut sq = self.ring.submission();
            // SAFETY: the command's data buffer is an IoBuf whose `from_raw` contract keeps
            // it valid and untouched until its completion is returned by `poll` or the
            // channel is dropped (Drop drains); a discard's range lives in `self.ranges`,
            // which outlives every request (Drop drains first) and whose slot is not reused
            // before completion; fixed file 0 is registered at channel creation.
            if unsafe { sq.push(entry) }.is_ok() {
                return true;
            }
        }
        false
    }

    fn submit_queued(&mut self) -> bool {
        for _ in 0..MAX_ENTER_TRIES {
            match self.ring.submit() {
                Ok(_) if self.ring.submission().is_empty() => return true,
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(_) => break,
            }
        }
        self.stats.kick_errors += 1;
        false
    }

    /// With IOPOLL, one non-blocking pass of the kernel over the polled device queue.
    fn iopoll_pass(&mut self) {
        // SAFETY: no argument structure is passed (None); GETEVENTS with min_complete 0
        // reaps what the device finished without waiting.
        let _ = unsafe {
            self.ring
                .submitter()
                .enter::<libc::sigset_t>(0, 0, IORING_ENTER_GETEVENTS, None)
        };
    }

    fn reap(&mut self, mut out: Option<&mut [Completion]>) -> usize {
        let limit = out.as_ref().map_or(usize::MAX, |o| o.len());
        let mut n = 0;
        let mut cq = self.ring.completion();
        while n < limit {
            let Some(cqe) = cq.next() else { break };
            if cqe.user_data() == CANCEL_USER_DATA {
                continue;
            }
            let index = usize::try_from(cqe.user_data()).unwrap_or(usize::MAX);
            let Some(slot) = self.slots.get_mut(index).filter(|s| s.busy) else {
                self.stats.stray_completions += 1;
                continue;
            };
            slot.busy = false;
            let status = result_status(slot.op, cqe.result());
            if cqe.result() > 0 {
                self.stats.nvme_errors += 1;
            }
            if let Some(o) = out.as_deref_mut() {
                o[n] = Completion {
                    tag: slot.tag,
                    status,
                };
            }
            self.free[self.free_top] = index as u32;
            self.free_top += 1;
            self.in_flight -= 1;
            n += 1;
        }
        n
    }

    fn drain(&mut self) {
        // Bounded by the kernel's own command timeout (nvme_core.io_timeout, 30 s by
        // default), after which it completes every command.
        loop {
            if self.shared.iopoll {
                self.iopoll_pass();
            }
            self.reap(None);
            if self.in_flight == 0 {
                return;
            }
            let r = if self.shared.iopoll {
                self.ring.submit().map(|_| ())
            } else {
                self.ring.submit_and_wait(1).map(|_| ())
            };
            if let Err(e) = r {
                if !matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) {
                    if self.in_flight <= self.ring.submission().len() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
}

/// Maps a CQE result of a passthrough command: `< 0` errno, `> 0` NVMe status field.
fn result_status(op: Op, res: i32) -> Result<(), IoError> {
    match res {
        0 => Ok(()),
        r if r > 0 => nvme::status_to_result(op, r as u16),
        r => Err(match r.wrapping_neg() {
            libc::ENOSPC => IoError::NoSpace,
            libc::ENODEV | libc::ENXIO => IoError::Gone,
            libc::ENODATA => IoError::Medium,
            libc::ETIMEDOUT | libc::ECANCELED | libc::EINTR => IoError::Timeout,
            libc::EOPNOTSUPP => IoError::Unsupported,
            errno => IoError::Io { errno },
        }),
    }
}

impl Channel for PassthruChannel {
    fn info(&self) -> &DeviceInfo {
        &self.shared.info
    }

    /// Validates `req`, takes a slot and queues one `URING_CMD` SQE (no syscall unless the
    /// submission ring is full).
    ///
    /// # Errors
    /// [`SubmitError::Invalid`] from [`validate`] or for a Write Zeroes longer than
    /// [`nvme::MAX_NLB`] blocks; [`SubmitError::QueueFull`] at the queue depth.
    fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
        validate(&self.shared.info, &req)?;
        if req.op == Op::WriteZeroes && req.len_bytes >> self.shared.lba_shift > nvme::MAX_NLB {
            return Err(SubmitError::Invalid(
                "write zeroes longer than 65536 blocks (NVMe NLB limit)",
            ));
        }
        if self.free_top == 0 {
            return Err(SubmitError::QueueFull);
        }
        let index = self.free[self.free_top - 1];
        let cmd = self.command(&req, index).to_bytes();
        let entry = opcode::UringCmd80::new(NG, NVME_URING_CMD_IO)
            .cmd(cmd)
            .build()
            .user_data(u64::from(index));
        if !self.push(&entry) {
            return Err(SubmitError::QueueFull);
        }
        self.free_top -= 1;
        self.slots[index as usize] = Slot {
            tag: req.tag,
            op: req.op,
            busy: true,
        };
        self.in_flight += 1;
        Ok(())
    }

    fn kick(&mut self) {
        if !self.ring.submission().is_empty() {
            self.submit_queued();
        }
    }

    /// Reaps finished commands; with IOPOLL, first one non-blocking polling pass in the
    /// kernel (`IORING_ENTER_GETEVENTS`).
    fn poll(&mut self, out: &mut [Completion]) -> usize {
        if self.in_flight == 0 || out.is_empty() {
            return 0;
        }
        if self.shared.iopoll {
            self.iopoll_pass();
        }
        self.reap(Some(out))
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Queues `ASYNC_CANCEL` for the request's slot. Kernels before 6.7 cannot cancel a
    /// passthrough command that reached the device: it then completes when the controller
    /// returns it or the NVMe driver's own timeout (which aborts and resets) ends it.
    fn abort(&mut self, tag: u64) {
        for index in 0..self.slots.len() {
            let slot = self.slots[index];
            if slot.busy && slot.tag == tag {
                let entry: squeue::Entry128 = opcode::AsyncCancel::new(index as u64)
                    .build()
                    .user_data(CANCEL_USER_DATA)
                    .into();
                if self.push(&entry) {
                    self.stats.aborts += 1;
                }
            }
        }
        self.kick();
    }
}

impl Drop for PassthruChannel {
    /// Waits until the kernel holds none of this channel's commands, so no buffer is
    /// written after it is freed.
    fn drop(&mut self) {
        self.drain();
    }
}

fn os(what: String, source: io::Error) -> DeviceError {
    DeviceError::Os { what, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_header() {
        // _IOWR('N', 0x41 / 0x80, 72-byte struct) on x86_64.
        let iowr = |nr: u32| (3u32 << 30) | (72 << 16) | (u32::from(b'N') << 8) | nr;
        assert_eq!(iowr(0x41) as libc::c_ulong, NVME_IOCTL_ADMIN_CMD);
        assert_eq!(iowr(0x80), NVME_URING_CMD_IO);
        assert_eq!((u32::from(b'N') << 8) | 0x40, NVME_IOCTL_ID as u32);
    }

    #[test]
    fn completion_results() {
        let r = Op::Read;
        assert_eq!(result_status(r, 0), Ok(()));
        assert_eq!(result_status(r, 0x281), Err(IoError::Medium));
        assert_eq!(result_status(r, -libc::EIO), Err(IoError::Io { errno: 5 }));
        assert_eq!(result_status(r, -libc::ENODEV), Err(IoError::Gone));
        assert_eq!(result_status(r, -libc::ECANCELED), Err(IoError::Timeout));
        assert_eq!(
            result_status(r, i32::MIN),
            Err(IoError::Io { errno: i32::MIN })
        );
    }

    #[test]
    fn uring_cmd_layout() {
        let c = UringCmd {
            opcode: 2,
            nsid: 1,
            addr: 0x1122_3344_5566_7788,
            data_len: 4096,
            cdw10: 9,
            cdw12: 7,
            ..UringCmd::default()
        };
        let b = c.to_bytes();
        assert_eq!(b[0], 2);
        assert_eq!(u32::from_le_bytes(b[4..8].try_into().unwrap()), 1);
        assert_eq!(
            u64::from_le_bytes(b[24..32].try_into().unwrap()),
            0x1122_3344_5566_7788
        );
        assert_eq!(u32::from_le_bytes(b[36..40].try_into().unwrap()), 4096);
        assert_eq!(u32::from_le_bytes(b[40..44].try_into().unwrap()), 9);
        assert_eq!(u32::from_le_bytes(b[48..52].try_into().unwrap()), 7);
        assert!(b[72..].iter().all(|&x| x == 0));
    }

    #[test]
    fn refuses_what_is_not_an_nvme_generic_device() {
        let cfg = PassthruConfig::default();
        let e = PassthruDevice::open("/", &cfg).unwrap_err();
        assert!(e.to_string().contains("not a character device"), "{e}");
        let e = PassthruDevice::open("/dev/null", &cfg).unwrap_err();
        assert!(e.to_string().contains("NVME_IOCTL_ID"), "{e}");
        let e = PassthruDevice::open("/nonexistent/ng0n1", &cfg).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/ng0n1"), "{e}");
    }
}
