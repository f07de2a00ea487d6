//! The controller side of the vfio NVMe driver: VFIO container, group and device; BAR0
//! registers; DMA arenas; the admin queue; controller reset and enable.
//!
//! Everything here runs at open, at channel creation and deletion, and on error recovery
//! (abort, reset), never per I/O: the admin queue sits behind a mutex.

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vfio_ioctls::{VfioContainer, VfioDevice, VfioOps};

use crate::nvme::{self, Command, ControllerIdentity, NamespaceIdentity};

use super::VfioNvmeError;

/// PCI configuration space region of a vfio-pci device (`VFIO_PCI_CONFIG_REGION_INDEX`).
const CONFIG_REGION: u32 = 7;
/// BAR0 region (`VFIO_PCI_BAR0_REGION_INDEX`).
const BAR0_REGION: u32 = 0;
/// PCI Command register: memory space (bit 1), bus master (bit 2), INTx disable (bit 10).
const PCI_COMMAND: u64 = 0x04;
const PCI_COMMAND_MEMORY: u16 = 1 << 1;
const PCI_COMMAND_MASTER: u16 = 1 << 2;
const PCI_COMMAND_INTX_DISABLE: u16 = 1 << 10;

// Controller registers (NVMe Base 2.0 §3.1.3, Figure 33).
const REG_CAP: usize = 0x00;
const REG_VS: usize = 0x08;
const REG_INTMS: usize = 0x0C;
const REG_CC: usize = 0x14;
const REG_CSTS: usize = 0x1C;
const REG_AQA: usize = 0x24;
const REG_ASQ: usize = 0x28;
const REG_ACQ: usize = 0x30;
/// First doorbell register.
const DOORBELL_BASE: usize = 0x1000;

const CC_EN: u32 = 1;
/// CC.IOSQES = 6 (64-byte SQ entries), CC.IOCQES = 4 (16-byte CQ entries), CSS = 0 (NVM),
/// MPS = 0 (4 KiB pages), AMS = 0 (round robin).
const CC_CONFIG: u32 = (6 << 16) | (4 << 20);
const CSTS_RDY: u32 = 1;
const CSTS_CFS: u32 = 1 << 1;

/// Memory page size the driver runs the controller with (CC.MPS = 0): also the PRP unit.
pub(crate) const PAGE: usize = 4096;
/// Admin queue entries (both queues): enough for the handful of commands in flight at once
/// (the admin path is synchronous, one command at a time).
const ADMIN_ENTRIES: u16 = 32;
/// How long one admin command may take before it counts as timed out. Generous: under
/// emulation (TCG) a command can take tens of milliseconds.
pub(crate) const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);
/// First I/O virtual address handed out; the range below is left unused so a stray zero
/// address faults in the IOMMU instead of reaching memory.
const IOVA_START: u64 = 1 << 20;
/// End of the IOVA range handed out: below the x86 MSI window (0xFEE0_0000) and inside the
/// 39-bit address width of the smallest common IOMMU.
const IOVA_END: u64 = 0xC000_0000;
/// Granularity of IOVA ranges: one 2 MiB huge page.
const HUGE_PAGE: usize = 2 << 20;

/// Memory the controller reaches by DMA: an anonymous mapping (2 MiB huge pages when the
/// system has them, else 4 KiB pages, populated and pinned by the mapping) mapped into the
/// container's IOMMU domain at `iova`. Accessed only through raw pointers (volatile or
/// `copy_nonoverlapping`), never through references: the device may write it at any time.
pub(crate) struct DmaArena {
    ptr: NonNull<u8>,
    len: usize,
    iova: u64,
    hugepages: bool,
    container: Arc<VfioContainer>,
}

// SAFETY: the arena is plain memory plus an Arc to a Sync container; all access goes
// through raw pointers by the one owner (a channel or the admin queue behind its mutex).
unsafe impl Send for DmaArena {}
// SAFETY: shared access only reads addresses (ptr/iova), never the memory.
unsafe impl Sync for DmaArena {}

impl DmaArena {
    /// Maps `len` bytes (rounded up to 2 MiB) and IOMMU-maps them at the next free IOVA.
    pub(crate) fn new(
        container: &Arc<VfioContainer>,
        iova_next: &AtomicU64,
        len: usize,
        what: &str,
    ) -> Result<Self, VfioNvmeError> {
        let len = len.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        let iova = iova_next.fetch_add(len as u64, Ordering::Relaxed);
        if iova + len as u64 > IOVA_END {
            return Err(VfioNvmeError::Setup(format!(
                "{what}: the I/O virtual address range is exhausted ({len} bytes more at {iova:#x})"
            )));
        }
        let mut hugepages = true;
        // SAFETY: anonymous private mapping, no address hint, no file: creates new memory.
        let mut p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            hugepages = false;
            // SAFETY: as above, without huge pages.
            p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                    -1,
                    0,
                )
            };
        }
        if p == libc::MAP_FAILED {
            return Err(VfioNvmeError::Os {
                what: format!("mmap {len} bytes of DMA memory for {what}"),
                source: std::io::Error::last_os_error(),
            });
        }
        let ptr = NonNull::new(p.cast::<u8>()).expect("mmap never returns null on success");
        // SAFETY: the mapping is fresh, `len` bytes, and no Rust reference to it exists or
        // will ever be made (all access is through raw pointers); it stays mapped until
        // Drop, which unmaps the IOVA range first.
        if let Err(e) = unsafe { container.vfio_dma_map(iova, len, ptr.as_ptr()) } {
            // SAFETY: unmapping the mapping made above, which nothing else uses.
            unsafe { libc::munmap(p, len) };
            return Err(VfioNvmeError::Setup(format!(
                "{what}: VFIO_IOMMU_MAP_DMA of {len} bytes at IOVA {iova:#x}: {e}"
            )));
        }
        Ok(Self {
            ptr,
            len,
            iova,
            hugepages,
            container: Arc::clone(container),
        })
    }

    /// Host address of byte `off`.
    pub(crate) fn ptr(&self, off: usize) -> *mut u8 {
        assert!(off <= self.len);
        // SAFETY: in bounds of the mapping (checked).
        unsafe { self.ptr.as_ptr().add(off) }
    }

    /// Bus (IO virtual) address of byte `off`.
    pub(crate) fn iova(&self, off: usize) -> u64 {
        assert!(off <= self.len);
        self.iova + off as u64
    }

    /// Zeroes `[off, off + len)`.
    pub(crate) fn zero(&self, off: usize, len: usize) {
        assert!(off + len <= self.len);
        // SAFETY: in bounds; raw write, no reference made.
        unsafe { std::ptr::write_bytes(self.ptr(off), 0, len) };
    }

    /// Whether the arena is backed by huge pages.
    pub(crate) fn hugepages(&self) -> bool {
        self.hugepages
    }
}

impl Drop for DmaArena {
    fn drop(&mut self) {
        // Unmap from the IOMMU first, so the device can no longer reach the pages; if that
        // fails, leak the memory rather than hand DMA-reachable pages back to the allocator.
        if self.container.vfio_dma_unmap(self.iova, self.len).is_ok() {
            // SAFETY: the mapping made in `new`, no longer reachable by the device.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        }
    }
}

/// BAR0, mapped: the controller registers and doorbells.
pub(crate) struct Bar {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: MMIO registers accessed only with volatile reads/writes of aligned u32s.
unsafe impl Send for Bar {}
// SAFETY: as above; each doorbell is written by exactly one owner (its channel).
unsafe impl Sync for Bar {}

impl Bar {
    pub(crate) fn read32(&self, off: usize) -> u32 {
        assert!(off.is_multiple_of(4) && off + 4 <= self.len);
        // SAFETY: aligned, in bounds of the BAR mapping.
        unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(off).cast::<u32>()) }
    }
    pub(crate) fn write32(&self, off: usize, v: u32) {
        assert!(off.is_multiple_of(4) && off + 4 <= self.len);
        // SAFETY: aligned, in bounds of the BAR mapping.
        unsafe { std::ptr::write_volatile(self.ptr.as_ptr().add(off).cast::<u32>(), v) }
    }
    /// 64-bit register as two 32-bit accesses, low dword first (Base 2.0 §3.1.2 allows it).
    pub(crate) fn read64(&self, off: usize) -> u64 {
        u64::from(self.read32(off)) | (u64::from(self.read32(off + 4)) << 32)
    }
    pub(crate) fn write64(&self, off: usize, v: u64) {
        self.write32(off, v as u32);
        self.write32(off + 4, (v >> 32) as u32);
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        // SAFETY: the mapping made at open.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Controller capabilities (CAP, Base 2.0 Figure 36) the driver uses.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cap {
    /// Maximum queue entries supported (1's based).
    pub(crate) mqes: u32,
    /// Doorbell stride in bytes (4 << DSTRD).
    pub(crate) stride: usize,
    /// Worst-case time to become ready (CAP.TO × 500 ms).
    pub(crate) timeout: Duration,
    /// Smallest memory page size supported, bytes.
    pub(crate) mps_min: usize,
    /// NVM command set supported (CSS bit 0).
    pub(crate) nvm: bool,
}

impl Cap {
    fn parse(cap: u64) -> Self {
        Self {
            mqes: (cap & 0xFFFF) as u32 + 1,
            stride: 4 << ((cap >> 32) & 0xF),
            timeout: Duration::from_millis(500 * ((cap >> 24) & 0xFF).max(1)),
            mps_min: 1 << (12 + ((cap >> 48) & 0xF)),
            nvm: (cap >> 37) & 1 == 1,
        }
    }
}

/// The admin queue pair (submitted one command at a time).
struct Admin {
    arena: DmaArena,
    sq_tail: u16,
    cq_head: u16,
    phase: bool,
    next_cid: u16,
}

/// Offsets inside the admin arena: SQ, CQ, one 4 KiB data page.
const ADMIN_SQ_OFF: usize = 0;
const ADMIN_CQ_OFF: usize = PAGE;
const ADMIN_DATA_OFF: usize = 2 * PAGE;

/// One NVMe controller bound to vfio-pci, shared by its device and channels.
pub(crate) struct Controller {
    pub(crate) name: String,
    pub(crate) bar: Bar,
    pub(crate) cap: Cap,
    pub(crate) identity: ControllerIdentity,
    pub(crate) namespace: NamespaceIdentity,
    pub(crate) nsid: u32,
    /// I/O queue pairs the controller granted (Number of Queues feature).
    pub(crate) io_queues: u16,
    admin: Mutex<Admin>,
    /// Which I/O queue ids (1..=io_queues) are taken, index qid-1.
    qids: Mutex<Vec<bool>>,
    pub(crate) iova_next: AtomicU64,
    /// Bumped by every controller reset: channels compare it to find their queues gone.
    pub(crate) generation: AtomicU64,
    /// The controller could not be brought back: the member is gone.
    pub(crate) failed: AtomicBool,
    pub(crate) container: Arc<VfioContainer>,
    // Field order is drop order: the device (closing its fd) after the BAR mapping and the
    // arenas, the container last.
    device: VfioDevice,
    /// Keeps the group's `/dev/vfio/N` path for messages.
    pub(crate) sysfs: PathBuf,
}

impl Controller {
    /// Opens the vfio-pci device at `bdf` and brings the controller up (see the module
    /// documentation of `vfio_nvme` for the steps).
    pub(crate) fn open(bdf: &str, want_queues: u16) -> Result<Self, VfioNvmeError> {
        let sysfs = PathBuf::from(format!("/sys/bus/pci/devices/{bdf}"));
        if !sysfs.exists() {
            return Err(VfioNvmeError::Setup(format!(
                "no PCI device {bdf} (no {})",
                sysfs.display()
            )));
        }
        let driver = std::fs::read_link(sysfs.join("driver"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
        if driver.as_deref() != Some("vfio-pci") {
            return Err(VfioNvmeError::Setup(format!(
                "PCI device {bdf} is bound to {}, not vfio-pci (see docs/OPERATIONS.md: \
                 echo vfio-pci > {}/driver_override, unbind, drivers_probe)",
                driver.as_deref().unwrap_or("no driver"),
                sysfs.display()
            )));
        }
        let class = std::fs::read_to_string(sysfs.join("class")).unwrap_or_default();
        if !class.trim().starts_with("0x010802") {
            return Err(VfioNvmeError::Setup(format!(
                "PCI device {bdf} has class {} (NVMe is 0x010802)",
                class.trim()
            )));
        }
        let container = Arc::new(VfioContainer::new(None).map_err(|e| {
            VfioNvmeError::Setup(format!("opening the VFIO container /dev/vfio/vfio: {e}"))
        })?);
        let ops: Arc<dyn VfioOps> = container.clone();
        let device = VfioDevice::new(&sysfs, ops, false).map_err(|e| {
            VfioNvmeError::Setup(format!(
                "opening {bdf} through VFIO (its IOMMU group must be viable: every device in \
                 it bound to vfio-pci or no driver): {e}"
            ))
        })?;

        // Memory space and bus mastering on, legacy interrupts off (the driver polls).
        let mut cmd = [0u8; 2];
        device.region_read(CONFIG_REGION, &mut cmd, PCI_COMMAND);
        let v = u16::from_le_bytes(cmd)
            | PCI_COMMAND_MEMORY
            | PCI_COMMAND_MASTER
            | PCI_COMMAND_INTX_DISABLE;
        device.region_write(CONFIG_REGION, &v.to_le_bytes(), PCI_COMMAND);

        let bar_size = device.get_region_size(BAR0_REGION) as usize;
        if bar_size < DOORBELL_BASE + 8 {
            return Err(VfioNvmeError::Setup(format!(
                "{bdf}: BAR0 is {bar_size} bytes, too small for NVMe registers"
            )));
        }
        // Map registers and doorbells only: the MSI-X table may follow in BAR0, and
        // vfio-pci refuses to map it.
        let map_len = bar_size.min(2 * PAGE);
        // SAFETY: maps the device fd at BAR0's region offset, shared, no address hint; the
        // mapping is owned by `Bar` and unmapped in its Drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                device.as_raw_fd(),
                device.get_region_offset(BAR0_REGION) as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(VfioNvmeError::Os {
                what: format!("mmap BAR0 of {bdf}"),
                source: std::io::Error::last_os_error(),
            });
        }
        let bar = Bar {
            ptr: NonNull::new(p.cast()).expect("mmap never returns null on success"),
            len: map_len,
        };
        let cap = Cap::parse(bar.read64(REG_CAP));
        if !cap.nvm {
            return Err(VfioNvmeError::Setup(format!(
                "{bdf}: the controller does not support the NVM command set"
            )));
        }
        if cap.mps_min > PAGE {
            return Err(VfioNvmeError::Setup(format!(
                "{bdf}: the controller's smallest memory page is {} bytes; the driver uses 4 KiB",
                cap.mps_min
            )));
        }
        let iova_next = AtomicU64::new(IOVA_START);
        let arena = DmaArena::new(&container, &iova_next, 3 * PAGE, bdf)?;
        let mut ctrl = Controller {
            name: format!("vfio:{bdf}"),
            bar,
            cap,
            identity: ControllerIdentity::parse(&[0; 4096]),
            namespace: NamespaceIdentity {
                nsze: 0,
                block_bytes: 512,
                metadata_bytes: 0,
                deallocated_reads_zeroes: false,
            },
            nsid: 1,
            io_queues: 0,
            admin: Mutex::new(Admin {
                arena,
                sq_tail: 0,
                cq_head: 0,
                phase: true,
                next_cid: 0,
            }),
            qids: Mutex::new(Vec::new()),
            iova_next,
            generation: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            container,
            device,
            sysfs,
        };
        let version = ctrl.bar.read32(REG_VS);
        ctrl.enable()?;
        let mut data = [0u8; 4096];
        ctrl.identify(0x01, 0, &mut data)?;
        ctrl.identity = ControllerIdentity::parse(&data);
        // The first active namespace (QEMU's nvme device has namespace 1).
        let mut found = None;
        for nsid in 1..=ctrl.identity.nn.clamp(1, 64) {
            data.fill(0);
            ctrl.identify(0x00, nsid, &mut data)?;
            if let Ok(ns) = NamespaceIdentity::parse(&data) {
                found = Some((nsid, ns));
                break;
            }
        }
        let Some((nsid, ns)) = found else {
            return Err(VfioNvmeError::Setup(format!(
                "{bdf}: the controller has no active namespace"
            )));
        };
        if ns.metadata_bytes != 0 {
            return Err(VfioNvmeError::Setup(format!(
                "{bdf}: namespace {nsid} is formatted with {} metadata bytes per block; a \
                 format without metadata is needed",
                ns.metadata_bytes
            )));
        }
        ctrl.nsid = nsid;
        ctrl.namespace = ns;
        ctrl.io_queues = ctrl.set_queue_count(want_queues)?;
        *ctrl.qids.get_mut().expect("not shared yet") = vec![false; usize::from(ctrl.io_queues)];
        tracing::info!(
            controller = %ctrl.name,
            version = format!("{}.{}", version >> 16, (version >> 8) & 0xFF),
            model = %ctrl.identity.model,
            serial = %ctrl.identity.serial,
            nsid,
            block_bytes = ctrl.namespace.block_bytes,
            io_queues = ctrl.io_queues,
            "vfio NVMe controller ready"
        );
        Ok(ctrl)
    }

    /// Disables the controller and waits for CSTS.RDY = 0 (bounded by CAP.TO).
    fn disable(&self) -> Result<(), VfioNvmeError> {
        let cc = self.bar.read32(REG_CC);
        if cc & CC_EN != 0 {
            self.bar.write32(REG_CC, cc & !CC_EN);
        }
        self.wait_ready(false)
    }

    fn wait_ready(&self, ready: bool) -> Result<(), VfioNvmeError> {
        let deadline = Instant::now() + self.cap.timeout;
        loop {
            let csts = self.bar.read32(REG_CSTS);
            if csts == u32::MAX {
                return Err(VfioNvmeError::Setup(format!(
                    "{}: CSTS reads all ones: the device is gone",
                    self.name
                )));
            }
            if ready && csts & CSTS_CFS != 0 {
                return Err(VfioNvmeError::Setup(format!(
                    "{}: controller fatal status while enabling",
                    self.name
                )));
            }
            if (csts & CSTS_RDY != 0) == ready {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(VfioNvmeError::Setup(format!(
                    "{}: CSTS.RDY did not become {} within CAP.TO ({:?})",
                    self.name, ready as u8, self.cap.timeout
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Resets (CC.EN = 0), sets up the admin queue, enables (CC.EN = 1), masks interrupts.
    /// Base 2.0 §3.5.1 (controller initialization).
    fn enable(&self) -> Result<(), VfioNvmeError> {
        self.disable()?;
        let mut admin = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        admin.arena.zero(0, 2 * PAGE);
        admin.sq_tail = 0;
        admin.cq_head = 0;
        admin.phase = true;
        let n = u32::from(ADMIN_ENTRIES) - 1;
        self.bar.write32(REG_AQA, (n << 16) | n);
        self.bar.write64(REG_ASQ, admin.arena.iova(ADMIN_SQ_OFF));
        self.bar.write64(REG_ACQ, admin.arena.iova(ADMIN_CQ_OFF));
        drop(admin);
        self.bar.write32(REG_CC, CC_CONFIG);
        self.bar.write32(REG_CC, CC_CONFIG | CC_EN);
        self.wait_ready(true)?;
        // Polled: mask every interrupt vector (pin-based; MSI-X is never enabled).
        self.bar.write32(REG_INTMS, u32::MAX);
        Ok(())
    }

    /// Doorbell offset of SQ `qid` tail (`cq` false) or CQ `qid` head (`cq` true):
    /// 1000h + (2 × qid + cq) × (4 << CAP.DSTRD) (Base 2.0 §3.1.3.18–19).
    pub(crate) fn doorbell(&self, qid: u16, cq: bool) -> usize {
        DOORBELL_BASE + (2 * usize::from(qid) + usize::from(cq)) * self.cap.stride
    }

    /// Whether the doorbells of I/O queue `qid` lie in the mapped part of BAR0.
    pub(crate) fn doorbell_mapped(&self, qid: u16) -> bool {
        self.doorbell(qid, true) + 4 <= self.bar.len
    }

    /// Runs one admin command to completion (the data page, if used, is the admin arena's
    /// page at `ADMIN_DATA_OFF`). Returns DW0.
    fn admin_command(
        &self,
        admin: &mut MutexGuard<'_, Admin>,
        mut cmd: Command,
    ) -> Result<u32, VfioNvmeError> {
        let cid = admin.next_cid;
        admin.next_cid = admin.next_cid.wrapping_add(1);
        cmd.cdw0 = (cmd.cdw0 & 0xFFFF) | (u32::from(cid) << 16);
        let slot = usize::from(admin.sq_tail);
        // SAFETY: the SQ entry lies in the admin arena (slot < ADMIN_ENTRIES, 64 bytes
        // each, inside the first page); raw volatile write.
        unsafe {
            std::ptr::write_volatile(
                admin.arena.ptr(ADMIN_SQ_OFF + slot * 64).cast::<Command>(),
                cmd,
            )
        };
        admin.sq_tail = (admin.sq_tail + 1) % ADMIN_ENTRIES;
        fence(Ordering::SeqCst);
        self.bar
            .write32(self.doorbell(0, false), u32::from(admin.sq_tail));
        let deadline = Instant::now() + ADMIN_TIMEOUT;
        loop {
            let at = ADMIN_CQ_OFF + usize::from(admin.cq_head) * 16;
            if let Some(e) = super::read_cqe(&admin.arena, at, admin.phase) {
                admin.cq_head = (admin.cq_head + 1) % ADMIN_ENTRIES;
                if admin.cq_head == 0 {
                    admin.phase = !admin.phase;
                }
                self.bar
                    .write32(self.doorbell(0, true), u32::from(admin.cq_head));
                if e.cid != cid {
                    // A late completion of an earlier (timed-out) command: skip it.
                    continue;
                }
                let status = e.status_field();
                if status != 0 {
                    return Err(VfioNvmeError::Status {
                        what: admin_name(cmd.opcode()),
                        status,
                    });
                }
                return Ok(e.dw0);
            }
            if self.bar.read32(REG_CSTS) & CSTS_CFS != 0 {
                return Err(VfioNvmeError::Setup(format!(
                    "{}: controller fatal status during {}",
                    self.name,
                    admin_name(cmd.opcode())
                )));
            }
            if Instant::now() >= deadline {
                return Err(VfioNvmeError::Setup(format!(
                    "{}: admin command {} (cid {cid}) timed out after {:?} (SQ tail {}, CQ \
                     head {}, phase {}, CSTS {:#x})",
                    self.name,
                    admin_name(cmd.opcode()),
                    ADMIN_TIMEOUT,
                    admin.sq_tail,
                    admin.cq_head,
                    admin.phase,
                    self.bar.read32(REG_CSTS)
                )));
            }
            std::hint::spin_loop();
        }
    }

    fn admin(&self) -> MutexGuard<'_, Admin> {
        self.admin.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Identify with `cns` for `nsid` into `out`.
    fn identify(&self, cns: u32, nsid: u32, out: &mut [u8; 4096]) -> Result<(), VfioNvmeError> {
        let mut admin = self.admin();
        let mut c = Command::new(nvme::ADMIN_IDENTIFY, 0);
        c.nsid = nsid;
        c.prp1 = admin.arena.iova(ADMIN_DATA_OFF);
        c.cdw10 = cns;
        self.admin_command(&mut admin, c)?;
        // SAFETY: the data page lies in the admin arena; the command finished, so the
        // device no longer writes it; raw copy into `out`.
        unsafe {
            std::ptr::copy_nonoverlapping(admin.arena.ptr(ADMIN_DATA_OFF), out.as_mut_ptr(), 4096)
        };
        Ok(())
    }

    /// Set Features – Number of Queues; returns the I/O queue pairs granted.
    fn set_queue_count(&self, want: u16) -> Result<u16, VfioNvmeError> {
        let want = u32::from(want.max(1)) - 1;
        let mut c = Command::new(nvme::ADMIN_SET_FEATURES, 0);
        c.cdw10 = nvme::FEATURE_NUMBER_OF_QUEUES;
        c.cdw11 = (want << 16) | want;
        let dw0 = self.admin_command(&mut self.admin(), c)?;
        let granted = (dw0 & 0xFFFF).min(dw0 >> 16) + 1;
        Ok(granted.min(u32::from(want as u16 + 1)) as u16)
    }

    /// Takes a free I/O queue id.
    pub(crate) fn take_qid(&self) -> Option<u16> {
        let mut q = self.qids.lock().unwrap_or_else(|p| p.into_inner());
        let i = q.iter().position(|&taken| !taken)?;
        q[i] = true;
        Some(i as u16 + 1)
    }

    /// Returns an I/O queue id.
    pub(crate) fn put_qid(&self, qid: u16) {
        let mut q = self.qids.lock().unwrap_or_else(|p| p.into_inner());
        q[usize::from(qid) - 1] = false;
    }

    /// Creates I/O completion queue `qid` (interrupts off) and submission queue `qid` bound
    /// to it; `entries` each, at `cq_iova` / `sq_iova` (physically contiguous in IOVA).
    pub(crate) fn create_io_queue_pair(
        &self,
        qid: u16,
        entries: u16,
        cq_iova: u64,
        sq_iova: u64,
    ) -> Result<(), VfioNvmeError> {
        let mut admin = self.admin();
        let size = u32::from(entries - 1) << 16;
        let mut c = Command::new(nvme::ADMIN_CREATE_CQ, 0);
        c.prp1 = cq_iova;
        c.cdw10 = size | u32::from(qid);
        c.cdw11 = 1; // PC = 1 (contiguous), IEN = 0 (interrupts off)
        self.admin_command(&mut admin, c)?;
        let mut c = Command::new(nvme::ADMIN_CREATE_SQ, 0);
        c.prp1 = sq_iova;
        c.cdw10 = size | u32::from(qid);
        c.cdw11 = (u32::from(qid) << 16) | 1; // CQID, PC = 1, QPRIO urgent(0)
        if let Err(e) = self.admin_command(&mut admin, c) {
            let mut d = Command::new(nvme::ADMIN_DELETE_CQ, 0);
            d.cdw10 = u32::from(qid);
            let _ = self.admin_command(&mut admin, d);
            return Err(e);
        }
        Ok(())
    }

    /// Deletes I/O queue pair `qid` (SQ first: the controller completes or aborts its
    /// commands before answering).
    pub(crate) fn delete_io_queue_pair(&self, qid: u16) -> Result<(), VfioNvmeError> {
        let mut admin = self.admin();
        let mut c = Command::new(nvme::ADMIN_DELETE_SQ, 0);
        c.cdw10 = u32::from(qid);
        let sq = self.admin_command(&mut admin, c);
        let mut c = Command::new(nvme::ADMIN_DELETE_CQ, 0);
        c.cdw10 = u32::from(qid);
        let cq = self.admin_command(&mut admin, c);
        sq.and(cq).map(|_| ())
    }

    /// Abort (Base 2.0 §5.1) of command `cid` on SQ `qid`. Returns whether the controller
    /// says it aborted it (DW0 bit 0 clear).
    pub(crate) fn abort(&self, qid: u16, cid: u16) -> Result<bool, VfioNvmeError> {
        let mut c = Command::new(nvme::ADMIN_ABORT, 0);
        c.cdw10 = (u32::from(cid) << 16) | u32::from(qid);
        let dw0 = self.admin_command(&mut self.admin(), c)?;
        Ok(dw0 & 1 == 0)
    }

    /// Whether the controller reports fatal status (CSTS.CFS) or has vanished.
    pub(crate) fn fatal(&self) -> bool {
        let csts = self.bar.read32(REG_CSTS);
        csts == u32::MAX || csts & CSTS_CFS != 0 || csts & CSTS_RDY == 0
    }

    /// Resets the controller unless someone already did since `seen_generation`: disable,
    /// re-enable with a fresh admin queue, set the queue count again; I/O queues are gone
    /// afterwards and every channel re-creates its own. On failure the controller is marked
    /// failed (the member is gone).
    pub(crate) fn reset(&self, seen_generation: u64) -> Result<(), VfioNvmeError> {
        // Serialise resets on the qid lock (the admin lock is taken inside).
        let _q = self.qids.lock().unwrap_or_else(|p| p.into_inner());
        if self.generation.load(Ordering::Acquire) != seen_generation {
            return Ok(());
        }
        tracing::warn!(controller = %self.name, "resetting the NVMe controller");
        let r = self
            .enable()
            .and_then(|()| self.set_queue_count(self.io_queues).map(|_| ()));
        if r.is_err() {
            self.failed.store(true, Ordering::Release);
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        r
    }

    /// Brings the controller down for detach: CC.EN = 0 (the device stops all DMA).
    pub(crate) fn shutdown(&self) {
        let _ = self.disable();
    }

    /// The PCI address (sysfs directory name).
    pub(crate) fn bdf(&self) -> String {
        self.sysfs
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// Forces a controller reset from outside the data path, as a fault injection for tests
    /// and for the operator: CC.EN = 0 without telling the channels, which find their
    /// commands lost and recover.
    pub(crate) fn inject_disable(&self) {
        let cc = self.bar.read32(REG_CC);
        self.bar.write32(REG_CC, cc & !CC_EN);
    }

    /// The vfio device (for its fd).
    #[allow(dead_code)]
    pub(crate) fn device(&self) -> &VfioDevice {
        &self.device
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The name of an admin opcode, for errors.
fn admin_name(opcode: u8) -> &'static str {
    match opcode {
        nvme::ADMIN_DELETE_SQ => "Delete I/O Submission Queue",
        nvme::ADMIN_CREATE_SQ => "Create I/O Submission Queue",
        nvme::ADMIN_DELETE_CQ => "Delete I/O Completion Queue",
        nvme::ADMIN_CREATE_CQ => "Create I/O Completion Queue",
        nvme::ADMIN_IDENTIFY => "Identify",
        nvme::ADMIN_ABORT => "Abort",
        nvme::ADMIN_SET_FEATURES => "Set Features",
        _ => "admin command",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_fields() {
        // QEMU's nvme: MQES 2047, CQR, TO 15 (7.5 s), DSTRD 0, CSS NVM, MPSMIN 0.
        let cap: u64 = 0x07FF | (1 << 16) | (0x0F << 24) | (1 << 37);
        let c = Cap::parse(cap);
        assert_eq!(c.mqes, 2048);
        assert_eq!(c.stride, 4);
        assert_eq!(c.timeout, Duration::from_millis(7500));
        assert_eq!(c.mps_min, 4096);
        assert!(c.nvm);
        let c = Cap::parse(cap | (2 << 32) | (1 << 48));
        assert_eq!((c.stride, c.mps_min), (16, 8192));
    }
}
