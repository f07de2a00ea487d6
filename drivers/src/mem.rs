//! `mem`: a RAM disk. Writes, zeroes and discards are done inside `submit` (a memory copy);
//! a read's copy waits for the channel's next `poll`, or runs before the next request
//! that is not a read (write, zeroes, discard, flush), whichever comes first; on x86-64
//! its first bytes are prefetched at `submit` ([`READ_PREFETCH_BYTES`]). Every request's
//! completion waits for a `poll` (as many as its `out` holds, oldest first). It exists to
//! measure the engine's CPU cost with real data movement, and for tests that want to look
//! at member contents.

use std::collections::VecDeque;
use std::sync::Arc;

use engine::device::{
    check_memory_shape, validate_gather, BlockDevice, Channel, Completion, DeviceError, DeviceInfo,
    IoBuf, Op, Request, SubmitError,
};
use engine::parity::{Parity, ALIGN};

/// Transparent-huge-page size the store is aligned to (x86-64 PMD size).
const HUGE_PAGE: usize = 2 << 20;

/// Writes of at least this many bytes are copied into the store with streaming stores
/// ([`Parity::copy`]); of a gathered write, only its pieces of this size or more (each
/// streamed piece ends with a fence, which waits for its stores to drain: sixteen 4 KiB
/// pieces streamed one by one made `seqwrite-4k` 8 % slower). A large write's destination lines
/// are rarely in cache (a chunk of a full-stripe write lands on RAM no one has touched
/// lately), and a cached copy first reads every line it writes (read-for-ownership). On a
/// Zen 4 VM, 5 × 64 KiB into cold huge-page memory took 12.5 µs streamed and 17.3–18.6 µs
/// with `memcpy` (docs/BENCHMARKS.md, "RAM members written with streaming stores").
/// Smaller writes are mostly the pieces of read-modify-writes, whose old contents were
/// just read into cache: those keep `memcpy`.
pub const STREAM_WRITE_MIN_BYTES: usize = 32 << 10;

/// Bytes at the start of a read's source that `submit` prefetches on x86-64 (two 64-byte
/// cache lines); the copy itself runs later (module docs). A random 4 KiB read of a
/// RAM disk larger than the cache waits on DRAM (and often a TLB walk): begun at `submit`,
/// that wait overlaps the engine's work on the other requests of the turn, and the
/// hardware prefetcher carries on from the lines already asked for. On a Zen 4 VM (2
/// vCPUs), 4 KiB random reads at QD32 over RAID5 of `mem` members, one reactor, runs
/// alternated: 1.77–1.91 M IOPS copying in `submit`; 2.19–2.25 M with 128 bytes
/// prefetched, against 2.00–2.07 M with the copy deferred and nothing prefetched,
/// 2.05–2.20 M with 64 bytes, 2.01–2.23 M with 256 and 1.81–2.01 M with the whole read
/// (docs/BENCHMARKS.md, "RAM member reads copied at poll").
pub const READ_PREFETCH_BYTES: usize = 128;

#[cfg(test)]
thread_local! {
    /// Copies this thread made with streaming stores (tests check the path was taken).
    static STREAMED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Copies `len` bytes from `src` to `dst` in the store: with `stream` (streaming stores;
/// `None` where the CPU has no SIMD parity kernel) when `len` is at least
/// [`STREAM_WRITE_MIN_BYTES`] and both pointers and `len` are [`ALIGN`]-aligned, else
/// `memcpy`.
///
/// # Safety
/// `src` valid for reads and `dst` for writes of `len` bytes, not overlapping, and no one
/// else accessing `dst..dst + len` meanwhile.
// Not inlined: inlined, the kernel dispatch grew `submit`, and reads over `mem` members
// (which never come here) measured 8-15 % slower with the same instruction count.
#[inline(never)]
unsafe fn write_store(stream: Option<&Parity>, src: *const u8, dst: *mut u8, len: usize) {
    if let Some(stream) = stream.filter(|_| {
        len >= STREAM_WRITE_MIN_BYTES
            && len.is_multiple_of(ALIGN)
            && (src as usize).is_multiple_of(ALIGN)
            && (dst as usize).is_multiple_of(ALIGN)
    }) {
        #[cfg(test)]
        STREAMED.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract: both ranges valid for `len` bytes, apart, and
        // `dst`'s ours alone for the copy, so the two slices alias nothing.
        let (s, d) = unsafe {
            (
                std::slice::from_raw_parts(src, len),
                std::slice::from_raw_parts_mut(dst, len),
            )
        };
        stream.copy(s, d);
    } else {
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }
}

/// The memory behind a [`MemDevice`], shared by its channels: an anonymous mapping, with
/// the store's `len` bytes starting at `off`, the first 2 MiB boundary inside it.
struct Store {
    map: std::cell::UnsafeCell<memmap2::MmapMut>,
    off: usize,
    len: usize,
}

impl Store {
    /// Maps `len` zeroed bytes on transparent huge pages where the kernel gives them, all
    /// faulted in.
    fn new(name: &str, len: usize) -> Result<Self, DeviceError> {
        let mut map = memmap2::MmapOptions::new()
            .len(len + HUGE_PAGE)
            .map_anon()
            .map_err(|source| DeviceError::Os {
                what: format!("{name}: mapping {len} bytes of RAM"),
                source,
            })?;
        // Ask for transparent huge pages *before* the first touch (THP mode is often
        // `madvise`; pages faulted in earlier stay small): random 4 KiB I/O over gigabytes
        // of RAM disk otherwise misses the TLB on nearly every request. Advisory: on
        // failure the device just uses small pages.
        let _ = map.advise(memmap2::Advice::HugePage);
        let off = (map.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - map.as_ptr() as usize;
        // Touch every page now (one fault per huge page): the data path must not take page
        // faults. The mapping is opaque to the compiler, so the stores are kept.
        map[off..off + len].fill(0);
        Ok(Self {
            map: std::cell::UnsafeCell::new(map),
            off,
            len,
        })
    }

    /// Start of the store's bytes.
    ///
    /// # Safety
    /// The caller upholds the access rule documented on the `Sync` impl.
    unsafe fn base(&self) -> *mut u8 {
        // SAFETY: `off + len` lies inside the mapping (mapped `len + HUGE_PAGE` bytes, `off`
        // < HUGE_PAGE); the pointer is derived without creating a reference to the bytes.
        unsafe { (*self.map.get()).as_mut_ptr().add(self.off) }
    }
}

// SAFETY: channels on different reactors access the store concurrently through raw
// copies, or slices that live for one request's copy of its own range (`write_store`).
// A read's copy runs after its `submit`, at the channel's next `poll` (or before the
// channel's next request that is not a read), but before its completion leaves `poll`.
// Soundness rests on the engine's data-path invariant (DESIGN.md "The data path"), in
// both directions, from the issue of a request to the moment its completion is polled:
// a member byte range is written only by the reactor that owns its stripe; no request
// touching a range is issued while a write to an overlapping range is in flight; and no
// write is issued to a range while a read of it is in flight. The owner's reads hold their
// stripe shared until they are reaped, and another reactor's (foreign) reads hold the
// stripe gate until theirs are (`Array::fast_read_done`, released with Release ordering
// and taken by the owner's writes with Acquire, so the copy inside `poll`
// happens-before the write). Under that rule no two threads access the same bytes
// concurrently with one of them writing.
unsafe impl Sync for Store {}
// SAFETY: the mapping is owned; moving the store between threads moves ownership.
unsafe impl Send for Store {}

/// A RAM-backed block device.
pub struct MemDevice {
    info: DeviceInfo,
    store: Arc<Store>,
}

impl MemDevice {
    /// A zero-filled RAM disk of `capacity_bytes` with `block_bytes` logical blocks and
    /// `queue_depth` requests per channel. All of its memory is touched here, so requests
    /// never fault pages in.
    ///
    /// # Errors
    /// [`DeviceError::Unusable`] for a block size other than 512/4096, a capacity that is
    /// zero or not a multiple of the block size, or a zero queue depth.
    pub fn new(
        name: &str,
        capacity_bytes: u64,
        block_bytes: u32,
        queue_depth: u32,
    ) -> Result<Self, DeviceError> {
        let info = memory_device_info(name, capacity_bytes, block_bytes, queue_depth)?;
        let len = check_memory_shape(name, capacity_bytes, block_bytes)?;
        Ok(Self {
            info,
            store: Arc::new(Store::new(name, len)?),
        })
    }

    /// A copy of the device's contents, for tests (e.g. to hand member images to the
    /// oracle). Call only while no channel has requests in flight.
    pub fn contents(&self) -> Vec<u8> {
        // SAFETY: per the doc contract no request is in flight, so nothing writes the store;
        // base..base+len is the store.
        unsafe { std::slice::from_raw_parts(self.store.base(), self.store.len).to_vec() }
    }
}

impl BlockDevice for MemDevice {
    type Channel = MemChannel;

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The 4 KiB pages of `range` holding a nonzero byte (the device starts zero-filled:
    /// a page never written with data reads as zeroes). Reads the whole range once.
    fn allocated(&self, range: std::ops::Range<u64>) -> Option<Vec<std::ops::Range<u64>>> {
        const PAGE: u64 = 4096;
        let end = range.end.min(self.store.len as u64);
        let mut out: Vec<std::ops::Range<u64>> = Vec::new();
        let mut pos = range.start;
        while pos < end {
            let next = ((pos / PAGE + 1) * PAGE).min(end);
            // SAFETY: `pos..next` lies within the store (`end` ≤ its length). Called as the
            // array starts, before any channel of this device has a request in flight, so
            // nothing writes these bytes while they are read.
            let page = unsafe {
                std::slice::from_raw_parts(
                    self.store.base().add(pos as usize),
                    (next - pos) as usize,
                )
            };
            if page.iter().any(|&b| b != 0) {
                match out.last_mut() {
                    Some(r) if r.end == pos => r.end = next,
                    _ => out.push(pos..next),
                }
            }
            pos = next;
        }
        Some(out)
    }

    fn open_channel(&self) -> Result<MemChannel, DeviceError> {
        Ok(MemChannel {
            info: self.info.clone(),
            store: Arc::clone(&self.store),
            done: Immediate::new(self.info.queue_depth),
            // The scalar kernel has no streaming store: `memcpy` is the better copy there.
            stream: Some(Parity::new().streaming(true))
                .filter(|p| p.kernel() != engine::parity::Kernel::Scalar),
            // A read's completion is in `done` until it is polled, and `done` holds at most
            // the queue depth: never reallocated.
            reads: Vec::with_capacity(self.info.queue_depth as usize),
        })
    }
}

/// A channel of a [`MemDevice`].
pub struct MemChannel {
    info: DeviceInfo,
    store: Arc<Store>,
    done: Immediate,
    /// The copy for large writes ([`STREAM_WRITE_MIN_BYTES`]); `None` on CPUs with only
    /// the scalar parity kernel.
    stream: Option<Parity>,
    /// Reads taken by `submit` whose copy has not run yet, in submission order; each
    /// one's completion is in `done`.
    reads: Vec<PendingRead>,
}

/// A read whose copy runs at the channel's next `poll`, or before the channel's next
/// request that is not a read.
struct PendingRead {
    /// Store offset, bytes.
    off: usize,
    /// The request's buffer: `len` bytes, the caller's until the completion is polled
    /// ([`IoBuf::from_raw`] contract).
    buf: IoBuf,
    len: usize,
}

impl MemChannel {
    /// Runs the copies of every read taken so far, in submission order.
    fn finish_reads(&mut self) {
        for r in self.reads.drain(..) {
            // SAFETY: `submit` bounded off+len by the store's length (`validate_gather`);
            // the buffer is valid for len bytes until its completion is polled, which
            // has not happened (a read's completion is polled only after this runs), and
            // it is caller memory apart from the store; no one writes these store bytes
            // meanwhile: the engine issues no write overlapping a request in flight
            // (the rule on `Store`), and this channel's own writes run these copies first.
            unsafe {
                std::ptr::copy_nonoverlapping(self.store.base().add(r.off), r.buf.as_ptr(), r.len)
            }
        }
    }
}

/// Asks for the first [`READ_PREFETCH_BYTES`] of `src..src + len` to be brought into the
/// cache; nothing where the architecture has no prefetch hint used here.
#[inline(always)]
fn prefetch_read(src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let mut at = 0;
        while at < len.min(READ_PREFETCH_BYTES) {
            // SAFETY: `prefetcht0` (SSE, part of the x86-64 baseline) is a hint: it never
            // faults and reads nothing architecturally; `src + at` stays inside the read.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(src.add(at).cast::<i8>()) };
            at += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (src, len);
}

impl Channel for MemChannel {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
        validate_gather(&self.info, &req)?;
        self.done.admit()?;
        let off = req.offset_bytes as usize; // < capacity, which fits in usize (checked at new)
        let len = req.len_bytes as usize;
        // A read's buffer is never gathered (`validate_gather` refuses it).
        if req.op == Op::Read {
            debug_assert!(
                self.reads.len() < self.reads.capacity(),
                "admit() bounds reads"
            );
            // SAFETY: `base` only derives the pointer (nothing is accessed here; the copy
            // in `finish_reads` keeps the access rule on `Store`); validate_gather() bounded
            // off+len by the store's length, so `off` stays inside it.
            prefetch_read(unsafe { self.store.base().add(off) }, len);
            self.reads.push(PendingRead {
                off,
                buf: req.buf,
                len,
            });
            self.done.complete(req.tag);
            return Ok(());
        }
        // Whatever this request writes lands after the reads taken before it.
        if !self.reads.is_empty() {
            self.finish_reads();
        }
        if let Some(segs) = req.buf.segments() {
            let mut at = off;
            for seg in segs {
                // SAFETY: validate_gather() checked the pieces add up to len and bounded
                // off+len by the capacity (the store's length); each piece is valid memory
                // of seg.len bytes (IoBuf::gather contract), caller memory apart from the
                // store; concurrent access to the store is excluded as below.
                unsafe {
                    write_store(
                        self.stream.as_ref(),
                        seg.base,
                        self.store.base().add(at),
                        seg.len,
                    )
                };
                at += seg.len;
            }
            self.done.complete(req.tag);
            return Ok(());
        }
        // SAFETY: validate() bounded off+len by the capacity (the store's length); the
        // request's buffer is valid for len bytes (IoBuf::from_raw contract); store and
        // buffer do not overlap (the buffer is caller memory); concurrent access to the same
        // store bytes is excluded by the engine invariant documented on `Store`.
        unsafe {
            let base = self.store.base();
            match req.op {
                Op::Read => unreachable!("reads wait for poll (above)"),
                Op::Write { .. } => {
                    write_store(self.stream.as_ref(), req.buf.as_ptr(), base.add(off), len)
                }
                Op::WriteZeroes | Op::Discard => std::ptr::write_bytes(base.add(off), 0, len),
                Op::Flush => {}
            }
        }
        self.done.complete(req.tag);
        Ok(())
    }

    fn kick(&mut self) {}

    fn poll(&mut self, out: &mut [Completion]) -> usize {
        if !self.reads.is_empty() {
            self.finish_reads();
        }
        self.done.poll(out)
    }

    fn in_flight(&self) -> usize {
        self.done.len()
    }

    /// A gathered write copies its pieces one after the other.
    fn gathers(&self) -> bool {
        true
    }
}

/// The facts of a memory-speed device (`mem`, `null`), after checking its shape.
///
/// # Errors
/// [`DeviceError::Unusable`] for a block size other than 512/4096, a capacity that is zero
/// or not a multiple of the block size, or a zero queue depth.
pub(crate) fn memory_device_info(
    name: &str,
    capacity_bytes: u64,
    block_bytes: u32,
    queue_depth: u32,
) -> Result<DeviceInfo, DeviceError> {
    check_memory_shape(name, capacity_bytes, block_bytes)?;
    if queue_depth == 0 {
        return Err(DeviceError::Unusable(format!(
            "{name}: queue depth must be at least 1"
        )));
    }
    Ok(DeviceInfo {
        name: name.to_string(),
        block_bytes,
        capacity_bytes,
        queue_depth,
        max_transfer_bytes: 16 << 20,
        volatile_cache: false,
        write_zeroes: true,
        discard: true,
        rotational: false,
    })
}

/// Completions of a back end that finishes its requests without the kernel (`null`
/// inside `submit`; `mem` inside `submit`, or at `poll` for reads), waiting for `poll`:
/// bounded by the queue depth, allocated once, never reallocated.
pub(crate) struct Immediate {
    done: VecDeque<Completion>,
    depth: usize,
}

impl Immediate {
    pub(crate) fn new(queue_depth: u32) -> Self {
        Self {
            done: VecDeque::with_capacity(queue_depth as usize),
            depth: queue_depth as usize,
        }
    }

    /// Room for one more request?
    pub(crate) fn admit(&self) -> Result<(), SubmitError> {
        if self.done.len() >= self.depth {
            Err(SubmitError::QueueFull)
        } else {
            Ok(())
        }
    }

    /// Records a successful completion of `tag`.
    pub(crate) fn complete(&mut self, tag: u64) {
        debug_assert!(self.done.len() < self.depth, "admit() first");
        self.done.push_back(Completion {
            tag,
            status: Ok(()),
        });
    }

    /// Moves up to `out.len()` completions into `out`; returns how many.
    pub(crate) fn poll(&mut self, out: &mut [Completion]) -> usize {
        let n = self.done.len().min(out.len());
        for (o, c) in out.iter_mut().zip(self.done.drain(..n)) {
            *o = c;
        }
        n
    }

    /// Completions not yet polled.
    pub(crate) fn len(&self) -> usize {
        self.done.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::buf::AlignedBuf;
    use engine::device::IoBuf;

    fn io(buf: &mut AlignedBuf) -> IoBuf {
        // SAFETY: the buffer outlives every request in these tests and is not touched while
        // a request is in flight (until its completion is polled).
        unsafe { IoBuf::from_slice(buf) }
    }

    /// A gathered write lands its pieces one after the other.
    #[test]
    fn gathered_writes_land_their_pieces_in_order() {
        let dev = MemDevice::new("mem0", 1 << 20, 512, 2).unwrap();
        let mut ch = dev.open_channel().unwrap();
        assert!(ch.gathers());
        let mut w = AlignedBuf::zeroed(4096);
        w.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i / 512) as u8 + 1);
        let mut segs = [
            engine::device::IoSeg {
                base: w[3072..].as_mut_ptr(),
                len: 1024,
            },
            engine::device::IoSeg {
                base: w.as_mut_ptr(),
                len: 512,
            },
        ];
        // SAFETY: segs and w outlive the request (MemChannel completes it in submit).
        let buf =
            unsafe { IoBuf::gather(std::ptr::NonNull::new(segs.as_mut_ptr()).unwrap(), 2, 1536) };
        let req = Request {
            tag: 1,
            op: Op::Write { fua: false },
            offset_bytes: 4096,
            len_bytes: 1536,
            buf,
        };
        ch.submit(req).unwrap();
        let mut back = AlignedBuf::zeroed(1536);
        let read = Request {
            tag: 2,
            op: Op::Read,
            offset_bytes: 4096,
            len_bytes: 1536,
            buf: io(&mut back),
        };
        ch.submit(read).unwrap();
        let mut out = [Completion::EMPTY; 2];
        assert_eq!(ch.poll(&mut out), 2);
        assert_eq!(&back[..512], &[7u8; 512][..]);
        assert_eq!(&back[512..1024], &[8u8; 512][..]);
        assert_eq!(&back[1024..], &[1u8; 512][..]);
    }

    #[test]
    fn writes_read_back_and_zeroes_zero() {
        let dev = MemDevice::new("mem0", 1 << 20, 512, 2).unwrap();
        let mut ch = dev.open_channel().unwrap();
        let mut w = AlignedBuf::zeroed(4096);
        w.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let req = |tag, op, off, buf| Request {
            tag,
            op,
            offset_bytes: off,
            len_bytes: 4096,
            buf,
        };
        ch.submit(req(1, Op::Write { fua: true }, 8192, io(&mut w)))
            .unwrap();
        ch.submit(req(2, Op::WriteZeroes, 8192 + 4096, IoBuf::NONE))
            .unwrap();
        assert_eq!(
            ch.submit(req(3, Op::Read, 0, io(&mut w))),
            Err(SubmitError::QueueFull)
        );
        let mut out = [Completion::EMPTY; 4];
        assert_eq!(ch.poll(&mut out), 2);
        assert_eq!((out[0].tag, out[1].tag), (1, 2));
        let mut r = AlignedBuf::zeroed(4096);
        ch.submit(req(4, Op::Read, 8192, io(&mut r))).unwrap();
        assert_eq!(ch.poll(&mut out), 1);
        assert_eq!(&r[..], &w[..]);
        let img = dev.contents();
        assert_eq!(&img[8192..12288], &w[..]);
        assert!(img[12288..16384].iter().all(|&b| b == 0));
        assert!(matches!(
            ch.submit(req(5, Op::Read, (1 << 20) - 512, io(&mut r))),
            Err(SubmitError::Invalid(_))
        ));
    }

    /// A read's copy waits for `poll`, but a write submitted after it on the same channel
    /// lands after it: the read returns what was there before the write, whether the
    /// write is copied, streamed or zeroes; reads taken after the write see it; every
    /// read's data is in place when its completion is polled, one per `poll`.
    #[test]
    fn reads_return_what_was_there_before_a_later_write() {
        let big = STREAM_WRITE_MIN_BYTES;
        let dev = MemDevice::new("mem0", 1 << 20, 512, 8).unwrap();
        let mut ch = dev.open_channel().unwrap();
        let mut a = AlignedBuf::zeroed(big);
        a.fill(0xa1);
        let mut b = AlignedBuf::zeroed(big);
        b.fill(0xb2);
        let req = |tag, op, len, buf| Request {
            tag,
            op,
            offset_bytes: 64 << 10,
            len_bytes: len as u32,
            buf,
        };
        let w = Op::Write { fua: false };
        let mut out = [Completion::EMPTY; 8];
        ch.submit(req(1, w, big, io(&mut a))).unwrap();
        assert_eq!(ch.poll(&mut out), 1);
        let (mut r1, mut r2, mut r3) = (
            AlignedBuf::zeroed(big),
            AlignedBuf::zeroed(4096),
            AlignedBuf::zeroed(big),
        );
        // Read A; write B (streamed where the CPU has a SIMD kernel); read B; zero the
        // first 4 KiB; read it back; their completions polled one at a time.
        ch.submit(req(2, Op::Read, big, io(&mut r1))).unwrap();
        ch.submit(req(3, w, big, io(&mut b))).unwrap();
        ch.submit(req(4, Op::Read, 4096, io(&mut r2))).unwrap();
        ch.submit(req(5, Op::WriteZeroes, 4096, IoBuf::NONE))
            .unwrap();
        ch.submit(req(6, Op::Read, big, io(&mut r3))).unwrap();
        let mut tags = Vec::new();
        while ch.in_flight() > 0 {
            assert_eq!(ch.poll(&mut out[..1]), 1);
            assert!(out[0].status.is_ok());
            tags.push(out[0].tag);
        }
        assert_eq!(tags, [2, 3, 4, 5, 6]);
        assert!(
            r1.iter().all(|&x| x == 0xa1),
            "the first read saw the later write"
        );
        assert!(
            r2.iter().all(|&x| x == 0xb2),
            "the second read missed the write before it"
        );
        assert!(
            r3[..4096].iter().all(|&x| x == 0),
            "the zeroes were not read back"
        );
        assert!(r3[4096..].iter().all(|&x| x == 0xb2));
    }

    /// Writes of [`STREAM_WRITE_MIN_BYTES`] and more take the streaming copy where the
    /// buffer is aligned and `memcpy` where it is not; of a gathered write, only its large
    /// aligned pieces stream. The whole store is compared with the image the writes make,
    /// so a copy that ran short or past its end fails, and the streamed copies are counted.
    #[test]
    fn large_writes_land_whether_streamed_or_not() {
        let big = STREAM_WRITE_MIN_BYTES * 2;
        let min = STREAM_WRITE_MIN_BYTES;
        let dev = MemDevice::new("mem0", 4 << 20, 512, 4).unwrap();
        let mut ch = dev.open_channel().unwrap();
        let simd = ch.stream.is_some();
        let mut w = AlignedBuf::zeroed(big + 4096);
        w.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i * 7 + i / 4096) as u8 | 1);
        // One pointer for every piece: `w` is not touched again until the writes are done.
        let p = w.as_mut_ptr();
        let mut image = vec![0u8; 4 << 20];
        let mut out = [Completion::EMPTY; 4];
        let before = STREAMED.with(|n| n.get());
        let mut write = |tag, off: usize, from: usize, len: usize| {
            // SAFETY: `from..from + len` lies inside `w`, which outlives the request: a
            // MemChannel completes it inside `submit`.
            let buf = unsafe {
                IoBuf::from_raw(
                    std::ptr::NonNull::new(p.add(from)).unwrap(),
                    len as u32,
                    None,
                )
            };
            ch.submit(Request {
                tag,
                op: Op::Write { fua: false },
                offset_bytes: off as u64,
                len_bytes: len as u32,
                buf,
            })
            .unwrap();
            // SAFETY: as above; read after the copy.
            let src = unsafe { std::slice::from_raw_parts(p.add(from), len) };
            image[off..off + len].copy_from_slice(src);
        };
        // Aligned: streamed. 512 bytes into the buffer: 64-byte aligned as well, streamed.
        // 4 KiB + 32 bytes in: not aligned, so `memcpy`.
        write(1, 1 << 20, 0, big);
        write(2, 2 << 20, 512, big);
        write(3, 3 << 20, 4096 + 32, big - 512);
        assert_eq!(ch.poll(&mut out), 3);
        // Gathered: a large misaligned piece (`memcpy`), a small one (`memcpy`), and a large
        // aligned one last (streamed; nothing written after it hides an overrun).
        // SAFETY (the three pieces): inside `w`.
        let mut segs = unsafe {
            [
                engine::device::IoSeg {
                    base: p.add(32),
                    len: min,
                },
                engine::device::IoSeg { base: p, len: 512 },
                engine::device::IoSeg {
                    base: p.add(4096),
                    len: min,
                },
            ]
        };
        let glen = 2 * min + 512;
        // SAFETY: segs and w outlive the request (MemChannel completes it in submit).
        let buf = unsafe {
            IoBuf::gather(
                std::ptr::NonNull::new(segs.as_mut_ptr()).unwrap(),
                3,
                glen as u32,
            )
        };
        ch.submit(Request {
            tag: 4,
            op: Op::Write { fua: false },
            offset_bytes: 512,
            len_bytes: glen as u32,
            buf,
        })
        .unwrap();
        assert_eq!(ch.poll(&mut out), 1);
        image[512..512 + min].copy_from_slice(&w[32..32 + min]);
        image[512 + min..1024 + min].copy_from_slice(&w[..512]);
        image[1024 + min..1024 + 2 * min].copy_from_slice(&w[4096..4096 + min]);
        assert!(
            dev.contents() == image,
            "the store differs from the writes' image"
        );
        let streamed = STREAMED.with(|n| n.get()) - before;
        assert_eq!(streamed, if simd { 3 } else { 0 });
    }

    #[test]
    fn bad_geometry_is_refused() {
        assert!(MemDevice::new("m", 1000, 512, 1).is_err());
        assert!(MemDevice::new("m", 4096, 1024, 1).is_err());
        assert!(MemDevice::new("m", 4096, 512, 0).is_err());
    }
}
