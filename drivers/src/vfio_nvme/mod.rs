//! `vfio_nvme`: a polled user-space NVMe driver over VFIO (SPDK's model): the kernel only
//! provides the IOMMU mapping (`vfio-pci`, `vfio_iommu_type1`); ferroraid owns the
//! controller, its admin queue and one I/O queue pair per reactor, and never takes an
//! interrupt.
//!
//! A member is named by its PCI address: `vfio:0000:00:04.0` ([`parse_address`]). The
//! device must be bound to `vfio-pci` first (docs/OPERATIONS.md, "NVMe members": the
//! `driver_override` steps, hugepages, IOMMU groups).
//!
//! # Bring-up ([`VfioNvmeDevice::open`], NVMe Base 2.0 §3.5.1)
//!
//! 1. VFIO container (`/dev/vfio/vfio`, type-1 v2 IOMMU), the device's IOMMU group, the
//!    device fd — through the `vfio-ioctls` crate (no hypervisor features).
//! 2. PCI Command register: memory space and bus master on, INTx off.
//! 3. BAR0 mapped (registers and doorbells; not the MSI-X table behind them).
//! 4. CAP read: MQES (queue size limit), DSTRD (doorbell stride), TO (ready timeout),
//!    MPSMIN (must allow 4 KiB pages), CSS (NVM command set).
//! 5. CC.EN = 0, wait CSTS.RDY = 0 (bounded by CAP.TO); admin queues (AQA, ASQ, ACQ) in a
//!    DMA arena; CC = IOSQES 6, IOCQES 4, MPS 0, CSS NVM, EN = 1; wait CSTS.RDY = 1;
//!    interrupts masked (INTMS).
//! 6. Identify Controller (MDTS, ONCS, VWC, NN), Identify Namespace of the first active
//!    namespace (NSZE, FLBAS → block size; formats with metadata are refused), Set Features
//!    Number of Queues.
//!
//! # Channels (one per reactor)
//!
//! [`BlockDevice::open_channel`] takes a free queue id, allocates a DMA arena of its own
//! (2 MiB huge pages when the system has them, else 4 KiB pages; IOMMU-mapped at an IOVA
//! of its own) and creates an I/O completion queue with interrupts off (IEN = 0) and its
//! submission queue, `queue_depth + 1` entries each (one stays empty: full ≠ empty). The
//! arena also holds, per command slot, a bounce buffer of `max_transfer_bytes` and a PRP
//! list page, filled once at creation: a transfer of one page uses PRP1, two pages PRP1 +
//! PRP2, more PRP1 + a PRP list (NVMe Base 2.0 §4.1.1). The command identifier is the slot
//! index.
//!
//! Data moves through the slot's bounce buffer: a write is copied in at `submit`, a read
//! copied out when it completes. The engine's buffers are ordinary memory, unknown to the
//! IOMMU; mapping caller memory for zero-copy transfers is not done yet.
//!
//! `submit` writes the SQE (no syscall, no lock, no allocation); `kick` writes the SQ tail
//! doorbell once for the batch; `poll` consumes completion entries by phase tag and writes
//! the CQ head doorbell once.
//!
//! # Errors and recovery
//!
//! - Command status (SCT/SC) → [`IoError`] by [`nvme::status_to_result`].
//! - Command timeout (default 30 s, [`VfioNvmeConfig::command_timeout`]): the command is
//!   aborted (admin Abort); if it is still outstanding one more timeout later, the
//!   controller is reset.
//! - Controller health (CSTS) is read every [`HEALTH_CHECK_INTERVAL`] while commands are
//!   in flight: fatal status (CFS), a controller that dropped ready, or all-ones (device
//!   gone) reset the controller.
//! - A reset (by any channel; [`crate::vfio_nvme`] counts generations) loses every command
//!   in flight: each channel completes its own with [`IoError::Timeout`] — never a hang,
//!   never a silent retry of a write the array already counts as failed — and re-creates
//!   its queue pair. The array fails the member on the first error, as for any device.
//! - A controller that cannot be re-enabled is failed: every request then completes or is
//!   refused with [`IoError::Gone`] / [`SubmitError::Gone`].
//!
//! # Detach
//!
//! Dropping a channel deletes its queue pair (the controller completes or aborts its
//! commands first) and unmaps its arena; dropping the last handle disables the controller
//! (CC.EN = 0: no more DMA), unmaps everything and closes the device, group and container,
//! so `vfio-pci` can hand the device back (unbind, clear `driver_override`, reprobe).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

mod controller;

use std::mem::ManuallyDrop;
use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use engine::device::{
    validate, BlockDevice, Channel, Completion, DeviceError, DeviceInfo, IoError, Op, Request,
    SubmitError,
};

use crate::nvme::{self, Command, CompletionEntry, DsmRange};
use controller::{Controller, DmaArena, PAGE};

/// Default queue depth of a channel (commands in flight).
pub const DEFAULT_QUEUE_DEPTH: u32 = 64;
/// Largest queue depth a channel takes: the bounce buffers cost `depth × max_transfer`.
pub const MAX_QUEUE_DEPTH: u32 = 1024;
/// Largest transfer of one command unless MDTS says less: 256 KiB (64 pages), a full chunk
/// of md's default geometry with one PRP list page to spare.
pub const DEFAULT_MAX_TRANSFER_BYTES: u32 = 256 << 10;
// One PRP list page (512 entries) covers every transfer a slot can make.
const _: () = assert!((DEFAULT_MAX_TRANSFER_BYTES as usize).div_ceil(PAGE) <= PAGE / 8 + 1);

/// Default command timeout: the Linux NVMe driver's (`nvme_core.io_timeout`, 30 s).
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a channel with commands in flight reads CSTS for fatal status.
pub const HEALTH_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// Default number of I/O queue pairs asked of the controller (one per reactor).
pub const DEFAULT_MAX_CHANNELS: u16 = 16;

/// Why the controller could not be opened or set up.
#[derive(Debug, thiserror::Error)]
pub enum VfioNvmeError {
    /// Setup refused (wrong driver, group not viable, timeouts...), with the reason.
    #[error("{0}")]
    Setup(String),
    /// An OS call failed.
    #[error("{what}: {source}")]
    Os {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// An admin command completed with an error status.
    #[error("{what} failed: NVMe status {status:#06x} ({})", nvme::status_name(*status))]
    Status {
        /// The command.
        what: &'static str,
        /// The status field (SCT/SC).
        status: u16,
    },
}

impl From<VfioNvmeError> for DeviceError {
    fn from(e: VfioNvmeError) -> Self {
        match e {
            VfioNvmeError::Os { what, source } => DeviceError::Os { what, source },
            other => DeviceError::Unusable(other.to_string()),
        }
    }
}

/// Parses a member spec `vfio:DDDD:BB:DD.F` (PCI domain, bus, device, function in hex) and
/// returns the address part (`DDDD:BB:DD.F`, lower case); `None` if `spec` does not start
/// with `vfio:`.
///
/// # Errors
/// A message when the prefix is there but the address is malformed.
pub fn parse_address(spec: &str) -> Option<Result<String, String>> {
    let addr = spec.strip_prefix("vfio:")?;
    let ok = {
        let b = addr.as_bytes();
        b.len() == 12
            && b[4] == b':'
            && b[7] == b':'
            && b[10] == b'.'
            && [0, 1, 2, 3, 5, 6, 8, 9]
                .iter()
                .all(|&i| b[i].is_ascii_hexdigit())
            && (b'0'..=b'7').contains(&b[11])
    };
    Some(if ok {
        Ok(addr.to_ascii_lowercase())
    } else {
        Err(format!(
            "'{spec}': a vfio member is vfio:DDDD:BB:DD.F (PCI domain:bus:device.function in \
             hex, e.g. vfio:0000:00:04.0)"
        ))
    })
}

/// How to open a [`VfioNvmeDevice`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VfioNvmeConfig {
    /// Commands one channel may have in flight (1 to [`MAX_QUEUE_DEPTH`], lowered to what
    /// CAP.MQES allows).
    pub queue_depth: u32,
    /// I/O queue pairs to ask for: the most channels (reactors) the device serves at once.
    pub max_channels: u16,
    /// A command outstanding longer than this is aborted (and after twice this, the
    /// controller reset).
    pub command_timeout: Duration,
}

impl Default for VfioNvmeConfig {
    fn default() -> Self {
        Self {
            queue_depth: DEFAULT_QUEUE_DEPTH,
            max_channels: DEFAULT_MAX_CHANNELS,
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
        }
    }
}

/// An NVMe controller (its first active namespace) driven from user space through VFIO.
pub struct VfioNvmeDevice {
    ctrl: Arc<Controller>,
    info: DeviceInfo,
    config: VfioNvmeConfig,
}

impl std::fmt::Debug for VfioNvmeDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioNvmeDevice")
            .field("info", &self.info)
            .field("io_queues", &self.ctrl.io_queues)
            .finish()
    }
}

impl VfioNvmeDevice {
    /// Opens the NVMe controller at PCI address `bdf` (`DDDD:BB:DD.F`, bound to vfio-pci)
    /// and brings it up (module documentation). The device name is `vfio:BDF`.
    ///
    /// # Errors
    /// [`DeviceError::Unusable`] for a bad configuration, a device not bound to vfio-pci or
    /// not NVMe, a group that is not viable, a controller that does not become ready within
    /// CAP.TO, failed admin commands (with their NVMe status), a namespace with metadata or
    /// none active; [`DeviceError::Os`] when mapping BAR0 or DMA memory fails.
    pub fn open(bdf: &str, config: &VfioNvmeConfig) -> Result<Self, DeviceError> {
        if config.queue_depth == 0 || config.queue_depth > MAX_QUEUE_DEPTH {
            return Err(DeviceError::Unusable(format!(
                "vfio:{bdf}: queue depth {} outside 1..={MAX_QUEUE_DEPTH}",
                config.queue_depth
            )));
        }
        if config.command_timeout.is_zero() {
            return Err(DeviceError::Unusable(format!(
                "vfio:{bdf}: the command timeout must be positive"
            )));
        }
        let ctrl = shared_controller(bdf, config.max_channels.max(1))?;
        // queue_depth + 1 entries must fit MQES.
        let depth = config.queue_depth.min(ctrl.cap.mqes - 1);
        let block = ctrl.namespace.block_bytes;
        let mut max = u64::from(DEFAULT_MAX_TRANSFER_BYTES);
        if let Some(m) = ctrl.identity.max_transfer_bytes(PAGE as u64) {
            max = max.min(m);
        }
        max = max.min(u64::from(nvme::MAX_NLB) * u64::from(block));
        let max = ((max - max % u64::from(block)).max(u64::from(block))) as u32;
        let info = DeviceInfo {
            name: ctrl.name.clone(),
            block_bytes: block,
            capacity_bytes: ctrl.namespace.capacity_bytes(),
            queue_depth: depth,
            max_transfer_bytes: max,
            volatile_cache: ctrl.identity.vwc,
            write_zeroes: ctrl.identity.write_zeroes(),
            discard: ctrl.identity.dsm() && ctrl.namespace.deallocated_reads_zeroes,
            // NVMe rotational media (NVMe 2.0's Rotational Media bit) is not read yet; the
            // solid-state NVMe devices this driver serves do not seek.
            rotational: false,
        };
        Ok(Self {
            ctrl,
            info,
            config: *config,
        })
    }

    /// The PCI address.
    pub fn bdf(&self) -> String {
        self.ctrl.bdf()
    }

    /// The namespace id in use.
    pub fn nsid(&self) -> u32 {
        self.ctrl.nsid
    }

    /// I/O queue pairs the controller granted (the most channels open at once).
    pub fn io_queues(&self) -> u16 {
        self.ctrl.io_queues
    }

    /// Controller resets so far.
    pub fn resets(&self) -> u64 {
        self.ctrl.generation.load(Ordering::Acquire)
    }

    /// Fault injection (tests, drills): disables the controller (CC.EN = 0) behind the
    /// channels' backs, as a controller reset by the hardware would. Commands in flight are
    /// lost; channels notice within [`HEALTH_CHECK_INTERVAL`], reset the controller,
    /// complete their lost commands with [`IoError::Timeout`] and carry on.
    pub fn inject_controller_disable(&self) {
        self.ctrl.inject_disable();
    }
}

/// Controllers open in this process, by PCI address. A VFIO group can be opened once per
/// process, so a second [`VfioNvmeDevice::open`] of the same controller (the superblock
/// reader beside the array, say) shares the first one's controller and takes its own queue
/// pairs. Only opens and the last drop take the lock.
static OPEN_CONTROLLERS: Mutex<Vec<(String, Weak<Controller>)>> = Mutex::new(Vec::new());

fn shared_controller(bdf: &str, max_channels: u16) -> Result<Arc<Controller>, VfioNvmeError> {
    let mut open = OPEN_CONTROLLERS.lock().unwrap_or_else(|p| p.into_inner());
    open.retain(|(_, w)| w.strong_count() > 0);
    if let Some(c) = open
        .iter()
        .find(|(b, _)| b == bdf)
        .and_then(|(_, w)| w.upgrade())
    {
        return Ok(c);
    }
    let c = Arc::new(Controller::open(bdf, max_channels)?);
    open.push((bdf.to_string(), Arc::downgrade(&c)));
    Ok(c)
}

impl BlockDevice for VfioNvmeDevice {
    type Channel = VfioNvmeChannel;

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Creates one I/O queue pair with its own DMA arena (see the module documentation).
    ///
    /// # Errors
    /// [`DeviceError::Unusable`] when every granted queue pair is in use, the controller
    /// has failed, or Create I/O CQ/SQ fails; [`DeviceError::Os`] when DMA memory cannot
    /// be mapped.
    fn open_channel(&self) -> Result<VfioNvmeChannel, DeviceError> {
        VfioNvmeChannel::new(Arc::clone(&self.ctrl), &self.info, &self.config).map_err(Into::into)
    }
}

/// Counters of one channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VfioNvmeStats {
    /// Completions with an error status.
    pub nvme_errors: u64,
    /// Completions whose command identifier matched no command in flight.
    pub stray_completions: u64,
    /// Abort commands sent for commands past the timeout or asked by the array.
    pub aborts: u64,
    /// Controller resets this channel started or recovered from.
    pub resets: u64,
    /// Commands failed because a reset lost them.
    pub lost_to_reset: u64,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    tag: u64,
    op: Op,
    len: u32,
    /// The caller's buffer (reads are copied back into it).
    buf: *mut u8,
    issued: Instant,
    aborted: bool,
    busy: bool,
}

/// A per-reactor I/O queue pair on a [`VfioNvmeDevice`].
///
/// `Send`: it owns its queues and arena outright; the controller it shares is `Sync` (its
/// admin queue behind a mutex, registers accessed volatile, each doorbell written only by
/// its queue's owner).
pub struct VfioNvmeChannel {
    ctrl: Arc<Controller>,
    info: DeviceInfo,
    /// Dropped by hand in Drop, only once the controller can no longer reach it.
    arena: ManuallyDrop<DmaArena>,
    /// Where the queues, PRP lists and bounce buffers lie in the arena.
    layout: Layout,
    qid: u16,
    /// Entries of each queue (queue_depth + 1).
    entries: u16,
    sq_tail: u16,
    cq_head: u16,
    phase: bool,
    doorbell_pending: bool,
    generation: u64,
    slots: Box<[Slot]>,
    free: Box<[u16]>,
    free_top: usize,
    in_flight: usize,
    /// Completions owed without the device (lost to a reset), delivered by `poll`.
    owed: Box<[Completion]>,
    owed_len: usize,
    lba_shift: u32,
    nsid: u32,
    command_timeout: Duration,
    next_check: Instant,
    gone: bool,
    stats: VfioNvmeStats,
}

// SAFETY: see the type's documentation; the raw buffer pointers in slots are IoBufs whose
// `from_raw` contract allows use from whichever thread the request completes on.
unsafe impl Send for VfioNvmeChannel {}

/// Arena layout of a channel (byte offsets; every area page-aligned).
#[derive(Clone, Copy, Debug)]
struct Layout {
    sq: usize,
    cq: usize,
    prp: usize,
    bounce: usize,
    /// Bytes between two slots' bounce buffers (max transfer rounded up to a page).
    stride: usize,
    total: usize,
}

impl Layout {
    fn new(entries: usize, depth: usize, max_transfer: usize) -> Self {
        let round = |x: usize| x.div_ceil(PAGE) * PAGE;
        let sq = 0;
        let cq = round(entries * 64);
        let prp = cq + round(entries * 16);
        let bounce = prp + depth * PAGE;
        let stride = round(max_transfer);
        let total = bounce + depth * stride;
        Self {
            sq,
            cq,
            prp,
            bounce,
            stride,
            total,
        }
    }
}

impl VfioNvmeChannel {
    fn new(
        ctrl: Arc<Controller>,
        info: &DeviceInfo,
        config: &VfioNvmeConfig,
    ) -> Result<Self, VfioNvmeError> {
        if ctrl.failed.load(Ordering::Acquire) {
            return Err(VfioNvmeError::Setup(format!(
                "{}: the controller has failed",
                ctrl.name
            )));
        }
        let depth = info.queue_depth as usize;
        let entries = depth + 1;
        let max_transfer = info.max_transfer_bytes as usize;
        let layout = Layout::new(entries, depth, max_transfer);
        let qid = ctrl.take_qid().ok_or_else(|| {
            VfioNvmeError::Setup(format!(
                "{}: all {} I/O queue pairs are in use",
                ctrl.name, ctrl.io_queues
            ))
        })?;
        if !ctrl.doorbell_mapped(qid) {
            ctrl.put_qid(qid);
            return Err(VfioNvmeError::Setup(format!(
                "{}: the doorbells of queue {qid} lie outside the mapped BAR0 page",
                ctrl.name
            )));
        }
        let arena = match DmaArena::new(&ctrl.container, &ctrl.iova_next, layout.total, &ctrl.name)
        {
            Ok(a) => a,
            Err(e) => {
                ctrl.put_qid(qid);
                return Err(e);
            }
        };
        // PRP lists, once: slot s's list names pages 1.. of its bounce buffer.
        for s in 0..depth {
            let base = arena.iova(layout.bounce + s * layout.stride);
            let list = arena.ptr(layout.prp + s * PAGE).cast::<u64>();
            for k in 1..max_transfer.div_ceil(PAGE) {
                // SAFETY: entry k-1 < 512 of the slot's list page, inside the arena; raw
                // write before the device knows the page.
                unsafe { list.add(k - 1).write_volatile(base + (k * PAGE) as u64) };
            }
        }
        let generation = ctrl.generation.load(Ordering::Acquire);
        if let Err(e) = ctrl.create_io_queue_pair(
            qid,
            entries as u16,
            arena.iova(layout.cq),
            arena.iova(layout.sq),
        ) {
            ctrl.put_qid(qid);
            return Err(e);
        }
        tracing::debug!(
            controller = %ctrl.name,
            qid,
            depth,
            hugepages = arena.hugepages(),
            "vfio NVMe queue pair created"
        );
        let idle = Slot {
            tag: 0,
            op: Op::Flush,
            len: 0,
            buf: std::ptr::null_mut(),
            issued: Instant::now(),
            aborted: false,
            busy: false,
        };
        Ok(Self {
            info: info.clone(),
            lba_shift: ctrl.namespace.block_bytes.trailing_zeros(),
            nsid: ctrl.nsid,
            ctrl,
            arena: ManuallyDrop::new(arena),
            layout,
            qid,
            entries: entries as u16,
            sq_tail: 0,
            cq_head: 0,
            phase: true,
            doorbell_pending: false,
            generation,
            slots: vec![idle; depth].into_boxed_slice(),
            free: (0..depth as u16).rev().collect(),
            free_top: depth,
            in_flight: 0,
            owed: vec![Completion::EMPTY; depth].into_boxed_slice(),
            owed_len: 0,
            command_timeout: config.command_timeout,
            next_check: Instant::now() + HEALTH_CHECK_INTERVAL,
            gone: false,
            stats: VfioNvmeStats::default(),
        })
    }

    /// The channel's counters.
    pub fn stats(&self) -> VfioNvmeStats {
        self.stats
    }

    /// The I/O queue id of this channel.
    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// Changes the command timeout of this channel (tests use a tiny one to exercise the
    /// abort and reset path).
    ///
    /// # Panics
    /// If `t` is zero.
    pub fn set_command_timeout(&mut self, t: Duration) {
        assert!(!t.is_zero());
        self.command_timeout = t;
    }

    fn bounce_off(&self, slot: usize) -> usize {
        self.layout.bounce + slot * self.layout.stride
    }

    /// Completes every command in flight with `err` (they were lost) and frees its slot.
    fn fail_in_flight(&mut self, err: IoError) {
        for i in 0..self.slots.len() {
            if self.slots[i].busy {
                self.slots[i].busy = false;
                self.owed[self.owed_len] = Completion {
                    tag: self.slots[i].tag,
                    status: Err(err),
                };
                self.owed_len += 1;
                self.free[self.free_top] = i as u16;
                self.free_top += 1;
                self.in_flight -= 1;
                self.stats.lost_to_reset += 1;
            }
        }
        debug_assert_eq!(self.in_flight, 0);
    }

    /// After a controller reset: fail what was in flight, re-create the queue pair.
    fn recover(&mut self) {
        self.stats.resets += 1;
        self.fail_in_flight(IoError::Timeout);
        self.doorbell_pending = false;
        self.generation = self.ctrl.generation.load(Ordering::Acquire);
        if self.ctrl.failed.load(Ordering::Acquire) {
            self.gone = true;
            return;
        }
        let l = self.layout;
        self.arena.zero(l.cq, usize::from(self.entries) * 16);
        self.sq_tail = 0;
        self.cq_head = 0;
        self.phase = true;
        if let Err(e) = self.ctrl.create_io_queue_pair(
            self.qid,
            self.entries,
            self.arena.iova(l.cq),
            self.arena.iova(l.sq),
        ) {
            tracing::error!(controller = %self.ctrl.name, qid = self.qid, error = %e,
                "re-creating the queue pair after a reset failed");
            self.gone = true;
        }
    }

    /// Resets the controller (if nobody did since this channel's generation) and recovers.
    fn reset_controller(&mut self) {
        if let Err(e) = self.ctrl.reset(self.generation) {
            tracing::error!(controller = %self.ctrl.name, error = %e, "controller reset failed");
        }
        self.recover();
    }

    /// Checks controller health and command ages (at most every [`HEALTH_CHECK_INTERVAL`]).
    fn check(&mut self, now: Instant) {
        if now < self.next_check {
            return;
        }
        let interval = HEALTH_CHECK_INTERVAL.min(self.command_timeout / 2);
        self.next_check = now + interval.max(Duration::from_micros(100));
        if self.ctrl.fatal() {
            tracing::warn!(controller = %self.ctrl.name, qid = self.qid,
                "controller fatal status or not ready: reset");
            self.reset_controller();
            return;
        }
        let mut need_reset = false;
        for i in 0..self.slots.len() {
            let s = self.slots[i];
            if !s.busy {
                continue;
            }
            let age = now.saturating_duration_since(s.issued);
            if age >= self.command_timeout * 2 {
                tracing::warn!(controller = %self.ctrl.name, qid = self.qid, cid = i,
                    op = ?s.op, ?age, "command still outstanding after its abort: reset");
                need_reset = true;
            } else if age >= self.command_timeout && !s.aborted {
                self.slots[i].aborted = true;
                self.stats.aborts += 1;
                tracing::warn!(controller = %self.ctrl.name, qid = self.qid, cid = i,
                    op = ?s.op, ?age, "command timed out: abort");
                if let Err(e) = self.ctrl.abort(self.qid, i as u16) {
                    tracing::warn!(controller = %self.ctrl.name, error = %e, "abort failed: reset");
                    need_reset = true;
                }
            }
        }
        if need_reset {
            self.reset_controller();
        }
    }

    fn ring_sq_doorbell(&mut self) {
        if self.doorbell_pending {
            // The SQEs must be in memory before the controller learns of them.
            fence(Ordering::SeqCst);
            self.ctrl
                .bar
                .write32(self.ctrl.doorbell(self.qid, false), u32::from(self.sq_tail));
            self.doorbell_pending = false;
        }
    }
}

/// Reads the completion entry at arena offset `at` if its phase tag is `phase`.
///
/// The status word (with the phase tag, bytes 14–15) is read first and alone; only after
/// it shows the expected phase, and an acquire fence, is the rest of the entry read. Reading
/// the 16 bytes in one go can tear against the device's write of the entry (observed under
/// QEMU: a new phase tag beside the previous lap's command identifier), completing the wrong
/// command and losing the right one.
pub(crate) fn read_cqe(arena: &DmaArena, at: usize, phase: bool) -> Option<CompletionEntry> {
    // SAFETY: the entry (16 bytes at `at`) lies in the arena's CQ area (callers pass
    // `cq + head × 16`, head < entries); volatile reads of memory the device writes.
    unsafe {
        let status = std::ptr::read_volatile(arena.ptr(at + 14).cast::<u16>());
        if (status & 1 != 0) != phase {
            return None;
        }
        // The rest of the entry (and the data it announces) only after the phase tag.
        fence(Ordering::Acquire);
        let mut e = std::ptr::read_volatile(arena.ptr(at).cast::<CompletionEntry>());
        e.status = status;
        Some(e)
    }
}

impl Channel for VfioNvmeChannel {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Validates `req`, copies write data into the slot's bounce buffer and writes one SQE.
    ///
    /// # Errors
    /// [`SubmitError::Invalid`] from [`validate`] or for a Write Zeroes longer than 65536
    /// blocks; [`SubmitError::QueueFull`] at the queue depth; [`SubmitError::Gone`] once
    /// the controller has failed.
    fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
        if self.gone {
            return Err(SubmitError::Gone);
        }
        validate(&self.info, &req)?;
        if req.op == Op::WriteZeroes && req.len_bytes >> self.lba_shift > nvme::MAX_NLB {
            return Err(SubmitError::Invalid(
                "write zeroes longer than 65536 blocks (NVMe NLB limit)",
            ));
        }
        if self.ctrl.generation.load(Ordering::Acquire) != self.generation {
            self.recover();
            if self.gone {
                return Err(SubmitError::Gone);
            }
        }
        if self.free_top == 0 {
            return Err(SubmitError::QueueFull);
        }
        let slot = usize::from(self.free[self.free_top - 1]);
        let slba = req.offset_bytes >> self.lba_shift;
        let nlb = req.len_bytes >> self.lba_shift;
        let mut cmd: Command = nvme::io_command(req.op, slot as u16, self.nsid, slba, nlb);
        let off = self.bounce_off(slot);
        match req.op {
            Op::Read | Op::Write { .. } => {
                let len = req.len_bytes as usize;
                if let Op::Write { .. } = req.op {
                    // SAFETY: the IoBuf contract makes `req.buf` valid for `len` bytes until
                    // completion; the bounce buffer (max_transfer ≥ len, validated) lies in
                    // the arena and belongs to this free slot: the device does not use it.
                    unsafe {
                        std::ptr::copy_nonoverlapping(req.buf.as_ptr(), self.arena.ptr(off), len)
                    };
                }
                cmd.prp1 = self.arena.iova(off);
                let pages = len.div_ceil(PAGE);
                if pages == 2 {
                    cmd.prp2 = self.arena.iova(off + PAGE);
                } else if pages > 2 {
                    cmd.prp2 = self.arena.iova(self.layout.prp + slot * PAGE);
                }
            }
            Op::Discard => {
                let range = DsmRange {
                    attributes: 0,
                    nlb,
                    slba,
                };
                // SAFETY: 16 bytes at the start of this free slot's bounce buffer.
                unsafe { std::ptr::write_volatile(self.arena.ptr(off).cast::<DsmRange>(), range) };
                cmd.prp1 = self.arena.iova(off);
            }
            Op::Flush | Op::WriteZeroes => {}
        }
        let at = self.layout.sq + usize::from(self.sq_tail) * 64;
        // SAFETY: SQ entry `sq_tail` < entries lies in the arena's SQ area; the controller
        // reads it only after the doorbell (kick) names it.
        unsafe { std::ptr::write_volatile(self.arena.ptr(at).cast::<Command>(), cmd) };
        self.sq_tail = (self.sq_tail + 1) % self.entries;
        self.doorbell_pending = true;
        self.free_top -= 1;
        self.slots[slot] = Slot {
            tag: req.tag,
            op: req.op,
            len: req.len_bytes,
            buf: req.buf.as_ptr(),
            issued: Instant::now(),
            aborted: false,
            busy: true,
        };
        self.in_flight += 1;
        Ok(())
    }

    /// One SQ tail doorbell write for everything queued since the last kick.
    fn kick(&mut self) {
        self.ring_sq_doorbell();
    }

    /// Consumes completion entries by phase tag (copying read data out of the bounce
    /// buffers), writes the CQ head doorbell once, and checks health and timeouts.
    fn poll(&mut self, out: &mut [Completion]) -> usize {
        let mut n = 0;
        while n < out.len() && self.owed_len > 0 {
            self.owed_len -= 1;
            out[n] = self.owed[self.owed_len];
            n += 1;
        }
        if self.in_flight == 0 || n == out.len() {
            return n;
        }
        if self.ctrl.generation.load(Ordering::Acquire) != self.generation {
            self.recover();
            return n + self.poll(&mut out[n..]);
        }
        let cq = self.layout.cq;
        let mut consumed = false;
        while n < out.len() {
            let at = cq + usize::from(self.cq_head) * 16;
            let Some(e) = read_cqe(&self.arena, at, self.phase) else {
                break;
            };
            self.cq_head += 1;
            if self.cq_head == self.entries {
                self.cq_head = 0;
                self.phase = !self.phase;
            }
            consumed = true;
            let i = usize::from(e.cid);
            let Some(s) = self.slots.get(i).copied().filter(|s| s.busy) else {
                self.stats.stray_completions += 1;
                continue;
            };
            let status_field = e.status_field();
            let status = nvme::status_to_result(s.op, status_field);
            if status.is_err() {
                self.stats.nvme_errors += 1;
            } else if s.op == Op::Read {
                let off = self.bounce_off(i);
                // SAFETY: the command finished, so the device no longer writes the bounce
                // buffer; `s.buf` is the caller's IoBuf of `s.len` bytes, valid until this
                // completion is returned.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.arena.ptr(off), s.buf, s.len as usize)
                };
            }
            self.slots[i].busy = false;
            self.free[self.free_top] = i as u16;
            self.free_top += 1;
            self.in_flight -= 1;
            out[n] = Completion { tag: s.tag, status };
            n += 1;
        }
        if consumed {
            self.ctrl
                .bar
                .write32(self.ctrl.doorbell(self.qid, true), u32::from(self.cq_head));
        }
        if self.in_flight > 0 {
            self.check(Instant::now());
        }
        n
    }

    fn in_flight(&self) -> usize {
        self.in_flight + self.owed_len
    }

    /// Sends an NVMe Abort for every command with `tag`; one the controller aborts
    /// completes with status "command abort requested" ([`IoError::Timeout`]). A command
    /// that stays outstanding is handled by the timeout path (reset).
    fn abort(&mut self, tag: u64) {
        for i in 0..self.slots.len() {
            if self.slots[i].busy && self.slots[i].tag == tag && !self.slots[i].aborted {
                self.slots[i].aborted = true;
                self.stats.aborts += 1;
                let _ = self.ctrl.abort(self.qid, i as u16);
            }
        }
    }
}

impl Drop for VfioNvmeChannel {
    /// Deletes the queue pair (the controller finishes or aborts its commands first), so
    /// no DMA reaches the arena after it is unmapped. If the controller does not answer,
    /// it is reset (which stops all its DMA); if even that fails, the arena is leaked
    /// rather than freed under a device that might still write it.
    fn drop(&mut self) {
        self.ring_sq_doorbell();
        let same_generation = self.ctrl.generation.load(Ordering::Acquire) == self.generation;
        let safe = if self.gone || !same_generation {
            // Queues already gone with a reset (or never re-created).
            !self.ctrl.failed.load(Ordering::Acquire)
        } else if self.ctrl.delete_io_queue_pair(self.qid).is_ok() {
            true
        } else {
            self.ctrl.reset(self.generation).is_ok()
        };
        self.ctrl.put_qid(self.qid);
        if safe {
            // SAFETY: dropped exactly once, here; the controller no longer reaches it.
            unsafe { ManuallyDrop::drop(&mut self.arena) };
        } else {
            // Leaked on purpose (still IOMMU-mapped): the device might still write it.
            self.ctrl.shutdown();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(parse_address("/dev/ng0n1"), None);
        assert_eq!(
            parse_address("vfio:0000:00:04.0"),
            Some(Ok("0000:00:04.0".into()))
        );
        assert_eq!(
            parse_address("vfio:0000:AF:1f.7"),
            Some(Ok("0000:af:1f.7".into()))
        );
        for bad in [
            "vfio:",
            "vfio:00:04.0",
            "vfio:0000:00:04.8",
            "vfio:0000-00:04.0",
        ] {
            let e = parse_address(bad).unwrap().unwrap_err();
            assert!(e.contains("DDDD:BB:DD.F"), "{e}");
        }
    }

    #[test]
    fn arena_layout_is_page_aligned() {
        let l = Layout::new(65, 64, 256 << 10);
        assert_eq!(l.sq, 0);
        assert_eq!(l.cq % PAGE, 0);
        assert!(l.cq >= 65 * 64);
        assert!(l.prp >= l.cq + 65 * 16 && l.prp.is_multiple_of(PAGE));
        assert_eq!(l.bounce, l.prp + 64 * PAGE);
        assert_eq!(l.total, l.bounce + 64 * (256 << 10));
    }

    #[test]
    fn open_refuses_bad_addresses_and_configs() {
        let e = VfioNvmeDevice::open("0000:ff:1f.7", &VfioNvmeConfig::default()).unwrap_err();
        assert!(e.to_string().contains("no PCI device"), "{e}");
        let cfg = VfioNvmeConfig {
            queue_depth: 0,
            ..VfioNvmeConfig::default()
        };
        assert!(VfioNvmeDevice::open("0000:00:04.0", &cfg).is_err());
    }
}
