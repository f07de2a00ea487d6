//! The block-device interface every back end implements (`drivers/`: io_uring, vfio NVMe,
//! RAM, null; [`crate::sim`] for the engine's own test world).
//!
//! A [`BlockDevice`] describes a device ([`DeviceInfo`]) and opens **channels**: one
//! [`Channel`] (queue pair) per reactor. A channel is owned by one reactor and never shared:
//! `submit` queues a [`Request`], `kick` hands queued requests to the device in one batch
//! (one `io_uring_enter`, one doorbell write), and `poll` reaps finished requests as
//! [`Completion`]s without blocking. Every completion carries the caller's tag and a
//! status; device errors never panic and never go unreported.
//!
//! Units: offsets and lengths are in **bytes** and must be multiples of the device's
//! logical block size ([`DeviceInfo::block_bytes`]); queue depths count requests.
//!
//! Buffers are lent to the device through [`IoBuf`], a raw handle whose constructor carries
//! the safety contract (the memory stays valid and untouched until the request completes),
//! so submission itself is safe and allocation-free. Buffer pools (allocated at start) mint
//! `IoBuf`s; registered-buffer indices (io_uring fixed buffers, vfio DMA mappings) travel
//! with them. A write may also carry a list of pieces ([`IoBuf::gather`], `pwritev(2)`'s
//! iovec array) on channels that say they take one ([`Channel::gathers`]: io_uring, RAM,
//! null, the simulator); the array writes a chunk that several client writes fill that
//! way, without copying them together first.

use std::fmt;
use std::ptr::NonNull;

use thiserror::Error;

/// Static facts about a device, read once at open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Human-readable name (path, or `mem0`, `sim3`), used in logs and errors.
    pub name: String,
    /// Logical block size in bytes: every offset and length is a multiple of it.
    pub block_bytes: u32,
    /// Usable size in bytes (a multiple of `block_bytes`).
    pub capacity_bytes: u64,
    /// Most requests one channel may have in flight (its queue depth).
    pub queue_depth: u32,
    /// Largest transfer of one request, in bytes (a multiple of `block_bytes`).
    pub max_transfer_bytes: u32,
    /// Whether the device has a volatile write cache, so `Flush` (and FUA) matter.
    pub volatile_cache: bool,
    /// Whether `WriteZeroes` is supported natively (else callers write zero buffers).
    pub write_zeroes: bool,
    /// Whether `Discard` (deallocate / TRIM / UNMAP) is supported **and leaves zeroes**:
    /// reads of a discarded range return zeroes (md's `devices_handle_discard_safely`). The
    /// array discards whole stripes only, and only when every member promises this, so
    /// parity (all zero for all-zero data) stays consistent. A device that may return old
    /// data after a discard reports `false`.
    pub discard: bool,
    /// Whether the medium seeks (a rotating disk): reading every chunk of a run costs less
    /// than skipping some, since a skipped chunk breaks the run with a seek. Linux's
    /// `queue/rotational` (what md consults through `blk_queue_nonrot`); back ends that
    /// cannot tell report `true`, the choice that keeps runs unbroken. The array uses it
    /// to decide whether a RAID6 rebuild may leave the parity it does not need unread
    /// (`Array::start_process`).
    pub rotational: bool,
}

/// What a request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Read `len_bytes` at `offset_bytes` into the buffer.
    Read,
    /// Write the buffer to `offset_bytes`; with `fua`, durable (past any volatile cache)
    /// before the completion (NVMe FUA bit; `RWF_DSYNC` for io_uring).
    Write {
        /// Force unit access.
        fua: bool,
    },
    /// Make every write completed before this request durable. No range, no buffer.
    Flush,
    /// Write zeroes to the range without a data buffer.
    WriteZeroes,
    /// Deallocate the range. Back ends that report [`DeviceInfo::discard`] leave zeroes
    /// behind; a device that cannot do it at run time completes with
    /// [`IoError::Unsupported`] and leaves the range unchanged.
    Discard,
}

impl Op {
    /// Whether the request moves data through its buffer.
    pub fn has_data(self) -> bool {
        matches!(self, Op::Read | Op::Write { .. })
    }
}

/// A buffer lent to a device for the life of one request.
///
/// Holds a pointer, a length, and the index of the registered region it lies in (io_uring
/// fixed buffer, vfio DMA mapping), if any. Created only through the `unsafe`
/// [`IoBuf::from_raw`], whose caller promises what the device relies on.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IoBuf {
    ptr: NonNull<u8>,
    len: u32,
    region: Option<u16>,
    /// 0: `ptr..ptr + len` is the data. Otherwise a gather list ([`IoBuf::gather`]): `ptr`
    /// addresses `segs` [`IoSeg`]s whose lengths add up to `len`.
    segs: u16,
}

/// One piece of a gathered write ([`IoBuf::gather`]): `len` bytes at `base`. Laid out as
/// POSIX `struct iovec` (`<sys/uio.h>`), so a list of them is an iovec array that
/// `pwritev(2)` / `IORING_OP_WRITEV` take as is.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoSeg {
    /// Start of the piece.
    pub base: *mut u8,
    /// Its length in bytes.
    pub len: usize,
}

impl IoSeg {
    /// An empty piece, to fill preallocated lists with.
    pub const EMPTY: IoSeg = IoSeg {
        base: std::ptr::null_mut(),
        len: 0,
    };
}

// SAFETY: an IoSeg only names memory; whoever builds an IoBuf from a list of them takes on
// IoBuf::gather's contract (the pieces stay valid and unwritten while the request is in
// flight), whichever thread the list lives on.
unsafe impl Send for IoSeg {}

// SAFETY: an IoBuf is a lent region of memory; from_raw's contract makes the device the only
// user of that memory while the request is in flight, whichever thread it runs on.
unsafe impl Send for IoBuf {}

impl IoBuf {
    /// An empty buffer, for requests without data (`Flush`, `WriteZeroes`, `Discard`).
    pub const NONE: IoBuf = IoBuf {
        ptr: NonNull::dangling(),
        len: 0,
        region: None,
        segs: 0,
    };

    /// Lends `len` bytes at `ptr` to a device; `region` is the registered-buffer index the
    /// memory lies in, if it was registered with the back end.
    ///
    /// # Safety
    /// From the submission of the request carrying this buffer until its completion is
    /// returned by `poll` (or the channel is dropped): `ptr..ptr+len` is valid, writable
    /// memory that nothing else reads or writes, and (if `region` is given) it lies inside
    /// that registered region. For O_DIRECT and DMA back ends the pointer must also be
    /// aligned to the device's block size (4 KiB alignment always suffices).
    pub unsafe fn from_raw(ptr: NonNull<u8>, len: u32, region: Option<u16>) -> Self {
        Self {
            ptr,
            len,
            region,
            segs: 0,
        }
    }

    /// Lends the `count` pieces listed at `list`, `len` bytes in all, as the data of one
    /// write: the device writes them one after the other from the request's offset (a
    /// gathered write, `pwritev(2)`). Only [`Op::Write`] takes such a buffer, and only on a
    /// channel whose [`Channel::gathers`] is `true`; [`validate`] refuses it elsewhere.
    ///
    /// # Safety
    /// From the submission of the request carrying this buffer until its completion is
    /// returned by `poll` (or the channel is dropped): the list (`count` [`IoSeg`]s at
    /// `list`) is valid and unchanged, every piece is valid memory that nothing writes,
    /// and the pieces' lengths add up to `len`. For O_DIRECT and DMA back ends each piece's
    /// address and length must also be multiples of the device's block size.
    pub unsafe fn gather(list: NonNull<IoSeg>, count: u16, len: u32) -> Self {
        Self {
            ptr: list.cast(),
            len,
            region: None,
            segs: count,
        }
    }

    /// The pieces of a gathered buffer ([`IoBuf::gather`]); `None` for a contiguous one.
    pub fn segments(&self) -> Option<&[IoSeg]> {
        (self.segs > 0).then(|| {
            // SAFETY: IoBuf::gather's contract: `segs` IoSegs at `ptr`, valid and unchanged
            // while the request (and so this IoBuf) is in flight.
            unsafe {
                std::slice::from_raw_parts(self.ptr.cast::<IoSeg>().as_ptr(), self.segs.into())
            }
        })
    }

    /// Lends `buf` (not registered with any back end).
    ///
    /// # Safety
    /// As [`IoBuf::from_raw`]: from submission until the request's completion is returned,
    /// `buf` stays allocated and nothing else reads or writes it — although the borrow ends
    /// when this call returns. `buf.len()` must fit in `u32`.
    pub unsafe fn from_slice(buf: &mut [u8]) -> Self {
        let len = u32::try_from(buf.len()).expect("an I/O buffer is smaller than 4 GiB");
        Self {
            ptr: NonNull::new(buf.as_mut_ptr()).unwrap_or(NonNull::dangling()),
            len,
            region: None,
            segs: 0,
        }
    }

    /// Start of the buffer (of a gathered buffer: of its list of pieces, see
    /// [`IoBuf::segments`]).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.len
    }
    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Registered region index, if any.
    pub fn region(&self) -> Option<u16> {
        self.region
    }
}

impl fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.segs > 0 {
            return write!(f, "IoBuf({} pieces, {} bytes)", self.segs, self.len);
        }
        write!(
            f,
            "IoBuf({:p}+{}, region {:?})",
            self.ptr, self.len, self.region
        )
    }
}

/// One request to a channel.
#[derive(Clone, Copy, Debug)]
pub struct Request {
    /// The caller's tag, returned unchanged in the [`Completion`].
    pub tag: u64,
    /// What to do.
    pub op: Op,
    /// Byte offset on the device (multiple of the block size; 0 for `Flush`).
    pub offset_bytes: u64,
    /// Length in bytes (multiple of the block size; 0 for `Flush`). For `Read`/`Write` it
    /// must equal `buf.len()`.
    pub len_bytes: u32,
    /// The data buffer for `Read`/`Write`; [`IoBuf::NONE`] otherwise.
    pub buf: IoBuf,
}

/// Why a request failed. Each is reported in its [`Completion`]; none panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum IoError {
    /// The device reported an I/O error (EIO, NVMe media/data-transfer errors): the member
    /// should be failed.
    #[error("I/O error (errno {errno})")]
    Io {
        /// OS errno or the back end's closest equivalent (5 = EIO).
        errno: i32,
    },
    /// An unrecovered read error on the range: a latent sector error; the data can be
    /// rebuilt from redundancy and rewritten.
    #[error("unrecovered read error (medium error)")]
    Medium,
    /// The device ran out of space (ENOSPC: sparse backing file on a full filesystem).
    #[error("no space left on the backing store")]
    NoSpace,
    /// The device transferred fewer bytes than asked and could not complete the rest.
    #[error("short transfer: {done} of {expected} bytes")]
    Short {
        /// Bytes transferred.
        done: u32,
        /// Bytes requested.
        expected: u32,
    },
    /// The request lies outside the device or is not block-aligned (a caller bug the
    /// back end still refuses cleanly).
    #[error("request out of range or misaligned")]
    Invalid,
    /// The operation is not supported by this device (see [`DeviceInfo`]).
    #[error("operation not supported by the device")]
    Unsupported,
    /// The device is gone (hot-removed, controller failed, simulated disappearance).
    #[error("device is gone")]
    Gone,
    /// The request did not complete within the back end's timeout and was aborted.
    #[error("request timed out")]
    Timeout,
}

/// A finished request.
///
/// `repr(C)`: the tag first, at offset 0, then the 12-byte status. Left to Rust's layout
/// the tag sat at offset 16, behind the status, and a back end's copy of a whole entry
/// into the poll array (compiled as 8 + 4 + 8 + 4 bytes) left it straddling two stores:
/// the array's first read of each tag then missed store-to-load forwarding (a stall per
/// member completion, `Array::reap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct Completion {
    /// The tag of the request.
    pub tag: u64,
    /// `Ok` when the whole range was transferred (and, for FUA writes and flushes, made
    /// durable).
    pub status: Result<(), IoError>,
}

impl Completion {
    /// A completion with no tag and a successful status: a placeholder for completion
    /// arrays that `poll` fills.
    pub const EMPTY: Completion = Completion {
        tag: 0,
        status: Ok(()),
    };
}

/// Why `submit` did not accept a request. The request was not queued; nothing happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum SubmitError {
    /// The channel already has `queue_depth` requests in flight: poll, then retry.
    #[error("channel queue is full")]
    QueueFull,
    /// The request is malformed for this device (range, alignment, buffer length,
    /// unsupported op); it would never succeed.
    #[error("invalid request: {0}")]
    Invalid(&'static str),
    /// The device is gone; no request will ever be accepted again.
    #[error("device is gone")]
    Gone,
}

/// Why a device or channel could not be opened.
#[derive(Debug, Error)]
pub enum DeviceError {
    /// An OS call failed while opening or setting up.
    #[error("{what}: {source}")]
    Os {
        /// What was being done (with the path).
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The device or its configuration is unusable (wrong size, unsupported block size...).
    #[error("{0}")]
    Unusable(String),
}

/// A per-reactor queue pair to one device. Owned by exactly one reactor.
pub trait Channel {
    /// The facts of the device this channel leads to.
    fn info(&self) -> &DeviceInfo;

    /// Queues `req`. Nothing reaches the device until [`Channel::kick`] (back ends may
    /// kick early when their submission ring is full).
    ///
    /// # Errors
    /// [`SubmitError::QueueFull`] at the queue-depth limit (retry after `poll`);
    /// [`SubmitError::Invalid`] for a request that can never succeed;
    /// [`SubmitError::Gone`] once the device has disappeared.
    fn submit(&mut self, req: Request) -> Result<(), SubmitError>;

    /// Hands every queued request to the device in one batch.
    fn kick(&mut self);

    /// Moves up to `out.len()` finished requests into `out` without blocking; returns how
    /// many.
    fn poll(&mut self, out: &mut [Completion]) -> usize;

    /// Requests submitted and not yet returned by `poll`.
    fn in_flight(&self) -> usize;

    /// Best-effort abort of every request with `tag` that this channel accepted and has
    /// not yet returned (the array calls it when a request outlives its command timeout).
    /// A request the back end manages to abort completes through `poll` with
    /// [`IoError::Timeout`]; one it cannot abort completes whenever the device returns it
    /// (its buffer stays lent until then). The default aborts nothing.
    fn abort(&mut self, tag: u64) {
        let _ = tag;
    }

    /// Whether `submit` takes gathered write buffers ([`IoBuf::gather`]). Back ends that
    /// do answer `true` and check requests with [`validate_gather`]; the default, `false`,
    /// keeps them out ([`validate`] refuses them), and callers copy into one buffer
    /// instead.
    fn gathers(&self) -> bool {
        false
    }
}

/// A block device: its facts and a factory of per-reactor channels.
pub trait BlockDevice {
    /// The channel type (monomorphised into the reactor: no `dyn` on the hot path).
    type Channel: Channel;

    /// The device's facts.
    fn info(&self) -> &DeviceInfo;

    /// Opens a new channel (queue pair) for one reactor.
    ///
    /// # Errors
    /// [`DeviceError`] when the back end cannot create another queue.
    fn open_channel(&self) -> Result<Self::Channel, DeviceError>;

    /// The allocated byte ranges of `range` (device offsets, in order): bytes outside
    /// them read as zeroes (holes of a sparse file: `lseek(2)` `SEEK_DATA`/`SEEK_HOLE`;
    /// never-written pages of a memory device). Called once per member as the array
    /// starts, off the reactors ([`crate::zero_map::ZeroMap`], for block status). `None`:
    /// the device cannot tell (the default; every byte counts as data). A device whose
    /// answer fails reports `None` too: "data" is always a correct answer.
    fn allocated(&self, range: std::ops::Range<u64>) -> Option<Vec<std::ops::Range<u64>>> {
        let _ = range;
        None
    }
}

/// Checks `req` against `info`: alignment, range, buffer length, supported op. Back ends
/// call it in `submit` so every one refuses bad requests the same way.
///
/// # Errors
/// [`SubmitError::Invalid`] naming the first problem found.
#[inline]
pub fn validate(info: &DeviceInfo, req: &Request) -> Result<(), SubmitError> {
    if req.buf.segments().is_some() {
        return Err(SubmitError::Invalid(
            "gathered buffer on a channel that does not gather",
        ));
    }
    validate_range(info, req)
}

/// [`validate`] for a channel that gathers ([`Channel::gathers`]): a gathered buffer is
/// taken by writes only, with at least one piece, every piece a positive multiple of the
/// block size long (its address aligned as the back end needs is the caller's promise,
/// [`IoBuf::gather`]) and the pieces adding up to the request's length.
///
/// # Errors
/// [`SubmitError::Invalid`] naming the first problem found.
#[inline]
pub fn validate_gather(info: &DeviceInfo, req: &Request) -> Result<(), SubmitError> {
    if let Some(segs) = req.buf.segments() {
        if !matches!(req.op, Op::Write { .. }) {
            return Err(SubmitError::Invalid(
                "a gathered buffer on a request that is not a write",
            ));
        }
        let block = info.block_bytes as usize;
        let mut total = 0usize;
        for s in segs {
            if s.len == 0 || !s.len.is_multiple_of(block) || s.base.is_null() {
                return Err(SubmitError::Invalid(
                    "a gathered piece is empty, null or not a multiple of the block size",
                ));
            }
            total += s.len;
        }
        if total != req.len_bytes as usize {
            return Err(SubmitError::Invalid(
                "gathered pieces differ in length from the request",
            ));
        }
    }
    validate_range(info, req)
}

/// What [`validate`] and [`validate_gather`] share: op, buffer length, alignment, range.
#[inline]
fn validate_range(info: &DeviceInfo, req: &Request) -> Result<(), SubmitError> {
    let block = u64::from(info.block_bytes);
    match req.op {
        Op::Flush => {
            if req.len_bytes != 0 || !req.buf.is_empty() {
                return Err(SubmitError::Invalid("flush carries no range or buffer"));
            }
            return Ok(());
        }
        Op::Read | Op::Write { .. } => {
            if req.buf.len() != req.len_bytes {
                return Err(SubmitError::Invalid(
                    "buffer length differs from request length",
                ));
            }
            if req.len_bytes > info.max_transfer_bytes {
                return Err(SubmitError::Invalid(
                    "transfer larger than the device's maximum",
                ));
            }
        }
        Op::WriteZeroes if !info.write_zeroes => {
            return Err(SubmitError::Invalid("write-zeroes not supported"));
        }
        Op::Discard if !info.discard => return Err(SubmitError::Invalid("discard not supported")),
        Op::WriteZeroes | Op::Discard => {}
    }
    if req.len_bytes == 0 {
        return Err(SubmitError::Invalid("zero-length request"));
    }
    if !req.offset_bytes.is_multiple_of(block) || !u64::from(req.len_bytes).is_multiple_of(block) {
        return Err(SubmitError::Invalid(
            "offset or length not a multiple of the block size",
        ));
    }
    match req.offset_bytes.checked_add(u64::from(req.len_bytes)) {
        Some(end) if end <= info.capacity_bytes => Ok(()),
        _ => Err(SubmitError::Invalid("request beyond the end of the device")),
    }
}

/// Checks the shape of a device that keeps its data in memory (RAM disk, simulated
/// device): block size 512 or 4096, capacity a positive multiple of it that fits in memory.
/// Returns the capacity as a `usize` length.
///
/// # Errors
/// [`DeviceError::Unusable`] naming the device and the problem.
pub fn check_memory_shape(
    name: &str,
    capacity_bytes: u64,
    block_bytes: u32,
) -> Result<usize, DeviceError> {
    if block_bytes != 512 && block_bytes != 4096 {
        return Err(DeviceError::Unusable(format!(
            "{name}: block size {block_bytes} is not 512 or 4096"
        )));
    }
    if capacity_bytes == 0 || !capacity_bytes.is_multiple_of(u64::from(block_bytes)) {
        return Err(DeviceError::Unusable(format!(
            "{name}: capacity {capacity_bytes} bytes is not a positive multiple of the {block_bytes}-byte block"
        )));
    }
    usize::try_from(capacity_bytes).map_err(|_| {
        DeviceError::Unusable(format!(
            "{name}: {capacity_bytes} bytes do not fit in memory"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> DeviceInfo {
        DeviceInfo {
            name: "t".into(),
            block_bytes: 512,
            capacity_bytes: 1 << 20,
            queue_depth: 4,
            max_transfer_bytes: 128 << 10,
            volatile_cache: false,
            write_zeroes: true,
            discard: false,
            rotational: false,
        }
    }

    fn req(op: Op, off: u64, len: u32, buf_len: u32) -> Request {
        let mut storage = [0u8; 1];
        // SAFETY: never submitted; validate only reads the length.
        let buf =
            unsafe { IoBuf::from_raw(NonNull::new(storage.as_mut_ptr()).unwrap(), buf_len, None) };
        Request {
            tag: 1,
            op,
            offset_bytes: off,
            len_bytes: len,
            buf: if buf_len == 0 { IoBuf::NONE } else { buf },
        }
    }

    #[test]
    fn validation_refuses_bad_requests() {
        let i = info();
        assert!(validate(&i, &req(Op::Read, 0, 512, 512)).is_ok());
        assert!(validate(&i, &req(Op::Flush, 0, 0, 0)).is_ok());
        assert!(validate(&i, &req(Op::WriteZeroes, 512, 4096, 0)).is_ok());
        for (r, why) in [
            (req(Op::Read, 100, 512, 512), "multiple"),
            (req(Op::Read, 0, 512, 1024), "buffer length"),
            (
                req(Op::Write { fua: true }, (1 << 20) - 512, 1024, 1024),
                "beyond",
            ),
            (req(Op::Read, u64::MAX - 511, 512, 512), "beyond"),
            (req(Op::Discard, 0, 512, 0), "discard"),
            (req(Op::Read, 0, 0, 0), "zero-length"),
            (req(Op::Flush, 0, 512, 0), "flush"),
            (req(Op::Read, 0, 256 << 10, 256 << 10), "maximum"),
        ] {
            match validate(&i, &r) {
                Err(SubmitError::Invalid(m)) => assert!(m.contains(why), "{m} vs {why}"),
                other => panic!("{r:?}: {other:?}"),
            }
        }
    }

    /// A gathered buffer: refused by `validate` (channels that do not gather); taken by
    /// `validate_gather` for writes whose pieces are whole blocks adding up to the length.
    #[test]
    fn gathered_buffers_are_checked_piece_by_piece() {
        let i = info();
        let mut data = [0u8; 4096];
        let p = data.as_mut_ptr();
        let gathered = |segs: &mut [IoSeg], op: Op, len: u32| {
            // SAFETY: never submitted; validation reads the list, not the pieces.
            let buf = unsafe {
                IoBuf::gather(
                    NonNull::new(segs.as_mut_ptr()).unwrap(),
                    segs.len() as u16,
                    len,
                )
            };
            Request {
                tag: 1,
                op,
                offset_bytes: 1024,
                len_bytes: len,
                buf,
            }
        };
        let w = Op::Write { fua: false };
        let seg = |off: usize, len: usize| IoSeg {
            base: p.wrapping_add(off),
            len,
        };
        let mut good = [seg(2048, 512), seg(0, 1024)];
        let r = gathered(&mut good, w, 1536);
        assert_eq!(r.buf.segments().map(<[IoSeg]>::len), Some(2));
        assert!(validate_gather(&i, &r).is_ok());
        match validate(&i, &r) {
            Err(SubmitError::Invalid(m)) => assert!(m.contains("does not gather"), "{m}"),
            other => panic!("{other:?}"),
        }
        for (mut segs, op, len, why) in [
            (
                vec![seg(0, 512), seg(512, 512)],
                Op::Read,
                1024,
                "not a write",
            ),
            (
                vec![seg(0, 512), seg(512, 256)],
                w,
                768,
                "multiple of the block",
            ),
            (vec![seg(0, 512), seg(512, 0)], w, 512, "empty"),
            (
                vec![seg(0, 512), seg(512, 512)],
                w,
                1536,
                "differ in length",
            ),
            (vec![seg(0, 256 << 10)], w, 256 << 10, "maximum"),
        ] {
            match validate_gather(&i, &gathered(&mut segs, op, len)) {
                Err(SubmitError::Invalid(m)) => assert!(m.contains(why), "{m} vs {why}"),
                other => panic!("{why}: {other:?}"),
            }
        }
    }

    /// The alignment test accepts exactly the multiples of the block size, power of two
    /// or not (520-byte sectors carry protection information on some SAS drives).
    #[test]
    fn alignment_is_exact_for_every_block_size() {
        for block in [512u32, 4096, 520, 4160] {
            let i = DeviceInfo {
                block_bytes: block,
                capacity_bytes: u64::from(block) * 1024,
                max_transfer_bytes: block * 16,
                ..info()
            };
            let b = u64::from(block);
            for off in [0, 1, b - 1, b, b + 1, 2 * b, 3 * b - 8, 7 * b] {
                for len in [b, b + 8, 2 * b, 2 * b - 512] {
                    let ok = off % b == 0 && len % b == 0;
                    let r = req(Op::WriteZeroes, off, len as u32, 0);
                    assert_eq!(
                        validate(&i, &r).is_ok(),
                        ok,
                        "block {block}, offset {off}, length {len}"
                    );
                }
            }
        }
    }
}
