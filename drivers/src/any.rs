//! [`AnyDevice`]: one device type over every back end, so an array can mix them (NVMe
//! through passthrough beside a SATA disk through the block layer, a vfio controller beside
//! files) and real members beside a [`Missing`](AnyDevice::Missing) placeholder for a role
//! whose device is absent (an array assembled degraded). The reactors are generic over one
//! device type; dispatch here is a `match` per call (no `dyn`, no allocation).
//!
//! [`open_member`] turns a member spec as the user writes it into a device:
//!
//! | spec                          | back end                                          |
//! |-------------------------------|---------------------------------------------------|
//! | `vfio:DDDD:BB:DD.F`           | [`crate::vfio_nvme`] (controller bound to vfio-pci) |
//! | a character device (`/dev/ngXnY`) | [`crate::nvme_passthru`]                      |
//! | a block device or regular file | [`crate::uring`] (`O_DIRECT`)                    |

use engine::device::{
    BlockDevice, Channel, Completion, DeviceError, DeviceInfo, Request, SubmitError,
};

use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use crate::mem::{MemChannel, MemDevice};
use crate::null::{NullChannel, NullDevice};
use crate::nvme_passthru::{PassthruChannel, PassthruConfig, PassthruDevice};
use crate::uring::{UringChannel, UringConfig, UringDevice};
use crate::vfio_nvme::{VfioNvmeChannel, VfioNvmeConfig, VfioNvmeDevice};

/// How to open members of each back end ([`open_member`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemberConfig {
    /// Files and block devices.
    pub uring: UringConfig,
    /// NVMe generic character devices.
    pub passthru: PassthruConfig,
    /// vfio NVMe controllers.
    pub vfio: VfioNvmeConfig,
}

impl MemberConfig {
    /// Every back end with the same channel queue depth (each caps it at what its device
    /// allows).
    pub fn with_queue_depth(queue_depth: u32) -> Self {
        let mut c = Self::default();
        c.uring.queue_depth = queue_depth;
        c.passthru.queue_depth = queue_depth;
        c.vfio.queue_depth = queue_depth.min(crate::vfio_nvme::MAX_QUEUE_DEPTH);
        c
    }
}

/// Whether `spec` names a vfio NVMe controller (`vfio:...`).
pub fn is_vfio_spec(spec: &Path) -> bool {
    spec.to_str().is_some_and(|s| s.starts_with("vfio:"))
}

/// Opens the member `spec` with the back end its kind calls for (module documentation).
///
/// # Errors
/// [`DeviceError::Unusable`] for a malformed `vfio:` address or anything the chosen back
/// end refuses; [`DeviceError::Os`] when `spec` cannot be examined or opened.
pub fn open_member(spec: &Path, config: &MemberConfig) -> Result<AnyDevice, DeviceError> {
    if let Some(s) = spec.to_str() {
        if let Some(addr) = crate::vfio_nvme::parse_address(s) {
            let addr = addr.map_err(DeviceError::Unusable)?;
            return Ok(AnyDevice::VfioNvme(VfioNvmeDevice::open(
                &addr,
                &config.vfio,
            )?));
        }
    }
    let meta = std::fs::metadata(spec).map_err(|source| DeviceError::Os {
        what: format!("stat {}", spec.display()),
        source,
    })?;
    if meta.file_type().is_char_device() {
        return Ok(AnyDevice::NvmePassthru(PassthruDevice::open(
            spec,
            &config.passthru,
        )?));
    }
    Ok(AnyDevice::Uring(UringDevice::open(spec, &config.uring)?))
}

/// A member device of any back end.
pub enum AnyDevice {
    /// io_uring over a file or block device.
    Uring(UringDevice),
    /// NVMe passthrough on a generic character device.
    NvmePassthru(PassthruDevice),
    /// User-space NVMe driver over VFIO.
    VfioNvme(VfioNvmeDevice),
    /// RAM disk.
    Mem(MemDevice),
    /// No data.
    Null(NullDevice),
    /// A role with no device: refuses every request with [`SubmitError::Gone`]. The array
    /// must list the role among its failed members.
    Missing(DeviceInfo),
}

impl AnyDevice {
    /// A placeholder for an absent member with the facts the array expects of a member
    /// (`capacity_bytes`, `block_bytes`); `name` appears in messages (e.g. "missing role 2").
    pub fn missing(name: &str, capacity_bytes: u64, block_bytes: u32) -> Self {
        AnyDevice::Missing(DeviceInfo {
            name: name.to_string(),
            block_bytes,
            capacity_bytes,
            queue_depth: 1,
            max_transfer_bytes: block_bytes,
            volatile_cache: false,
            write_zeroes: false,
            discard: false,
            rotational: false,
        })
    }
}

/// A channel of an [`AnyDevice`].
// Channels live unboxed in each reactor's member table: one indirection less per request
// is worth the few hundred bytes a small variant wastes.
#[allow(clippy::large_enum_variant)]
pub enum AnyChannel {
    /// io_uring.
    Uring(UringChannel),
    /// NVMe passthrough.
    NvmePassthru(PassthruChannel),
    /// vfio NVMe queue pair.
    VfioNvme(VfioNvmeChannel),
    /// RAM disk.
    Mem(MemChannel),
    /// No data.
    Null(NullChannel),
    /// An absent member.
    Missing(DeviceInfo),
}

impl BlockDevice for AnyDevice {
    type Channel = AnyChannel;

    fn info(&self) -> &DeviceInfo {
        match self {
            AnyDevice::Uring(d) => d.info(),
            AnyDevice::NvmePassthru(d) => d.info(),
            AnyDevice::VfioNvme(d) => d.info(),
            AnyDevice::Mem(d) => d.info(),
            AnyDevice::Null(d) => d.info(),
            AnyDevice::Missing(i) => i,
        }
    }

    /// The back end's answer; an absent member holds nothing (`Some` of no range): a
    /// stripe whose present members are all unallocated reads as zeroes, the absent
    /// member's chunk being reconstructed from them.
    fn allocated(&self, range: std::ops::Range<u64>) -> Option<Vec<std::ops::Range<u64>>> {
        match self {
            AnyDevice::Uring(d) => d.allocated(range),
            AnyDevice::NvmePassthru(d) => d.allocated(range),
            AnyDevice::VfioNvme(d) => d.allocated(range),
            AnyDevice::Mem(d) => d.allocated(range),
            AnyDevice::Null(d) => d.allocated(range),
            AnyDevice::Missing(_) => Some(Vec::new()),
        }
    }

    fn open_channel(&self) -> Result<AnyChannel, DeviceError> {
        Ok(match self {
            AnyDevice::Uring(d) => AnyChannel::Uring(d.open_channel()?),
            AnyDevice::NvmePassthru(d) => AnyChannel::NvmePassthru(d.open_channel()?),
            AnyDevice::VfioNvme(d) => AnyChannel::VfioNvme(d.open_channel()?),
            AnyDevice::Mem(d) => AnyChannel::Mem(d.open_channel()?),
            AnyDevice::Null(d) => AnyChannel::Null(d.open_channel()?),
            AnyDevice::Missing(i) => AnyChannel::Missing(i.clone()),
        })
    }
}

impl Channel for AnyChannel {
    fn info(&self) -> &DeviceInfo {
        match self {
            AnyChannel::Uring(c) => c.info(),
            AnyChannel::NvmePassthru(c) => c.info(),
            AnyChannel::VfioNvme(c) => c.info(),
            AnyChannel::Mem(c) => c.info(),
            AnyChannel::Null(c) => c.info(),
            AnyChannel::Missing(i) => i,
        }
    }

    fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
        match self {
            AnyChannel::Uring(c) => c.submit(req),
            AnyChannel::NvmePassthru(c) => c.submit(req),
            AnyChannel::VfioNvme(c) => c.submit(req),
            AnyChannel::Mem(c) => c.submit(req),
            AnyChannel::Null(c) => c.submit(req),
            AnyChannel::Missing(_) => Err(SubmitError::Gone),
        }
    }

    fn kick(&mut self) {
        match self {
            AnyChannel::Uring(c) => c.kick(),
            AnyChannel::NvmePassthru(c) => c.kick(),
            AnyChannel::VfioNvme(c) => c.kick(),
            AnyChannel::Mem(c) => c.kick(),
            AnyChannel::Null(c) => c.kick(),
            AnyChannel::Missing(_) => {}
        }
    }

    fn poll(&mut self, out: &mut [Completion]) -> usize {
        match self {
            AnyChannel::Uring(c) => c.poll(out),
            AnyChannel::NvmePassthru(c) => c.poll(out),
            AnyChannel::VfioNvme(c) => c.poll(out),
            AnyChannel::Mem(c) => c.poll(out),
            AnyChannel::Null(c) => c.poll(out),
            AnyChannel::Missing(_) => 0,
        }
    }

    fn in_flight(&self) -> usize {
        match self {
            AnyChannel::Uring(c) => c.in_flight(),
            AnyChannel::NvmePassthru(c) => c.in_flight(),
            AnyChannel::VfioNvme(c) => c.in_flight(),
            AnyChannel::Mem(c) => c.in_flight(),
            AnyChannel::Null(c) => c.in_flight(),
            AnyChannel::Missing(_) => 0,
        }
    }

    fn abort(&mut self, tag: u64) {
        match self {
            AnyChannel::Uring(c) => c.abort(tag),
            AnyChannel::NvmePassthru(c) => c.abort(tag),
            AnyChannel::VfioNvme(c) => c.abort(tag),
            AnyChannel::Mem(c) => c.abort(tag),
            AnyChannel::Null(c) => c.abort(tag),
            AnyChannel::Missing(_) => {}
        }
    }

    fn gathers(&self) -> bool {
        match self {
            AnyChannel::Uring(c) => c.gathers(),
            AnyChannel::NvmePassthru(c) => c.gathers(),
            AnyChannel::VfioNvme(c) => c.gathers(),
            AnyChannel::Mem(c) => c.gathers(),
            AnyChannel::Null(c) => c.gathers(),
            // Refuses every request anyway; claiming to gather keeps an array with a
            // missing member on the gathering path of the others.
            AnyChannel::Missing(_) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::device::{IoBuf, Op};

    #[test]
    fn missing_members_refuse_everything_and_others_dispatch() {
        let m = AnyDevice::missing("missing role 2", 1 << 20, 512);
        assert_eq!(m.info().capacity_bytes, 1 << 20);
        let mut ch = m.open_channel().unwrap();
        let r = Request {
            tag: 1,
            op: Op::Flush,
            offset_bytes: 0,
            len_bytes: 0,
            buf: IoBuf::NONE,
        };
        assert_eq!(ch.submit(r), Err(SubmitError::Gone));
        let n = AnyDevice::Null(NullDevice::new("n", 1 << 20, 512, 4).unwrap());
        let mut ch = n.open_channel().unwrap();
        ch.submit(r).unwrap();
        let mut out = [Completion::EMPTY; 2];
        assert_eq!(ch.poll(&mut out), 1);
        assert_eq!(out[0].tag, 1);
    }
}
