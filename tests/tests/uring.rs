//! io_uring back end against a regular file on the real disk and against a loop device.
//!
//! The loop-device test needs root and `losetup`; without them it prints why it skips,
//! unless `FERRORAID_REQUIRE_LOOP` is set, in which case it fails.

use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use drivers::uring::{UringChannel, UringConfig, UringDevice, INLINE_READ_MAX_BYTES};
use ferroraid_tests::attach_loop;

/// A directory on the real disk (`/tmp` may be tmpfs, which has no O_DIRECT on old kernels
/// and no ZERO_RANGE at all).
fn disk_tempdir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir in CARGO_TARGET_TMPDIR")
}
use engine::buf::AlignedBuf;
use engine::device::{
    BlockDevice, Channel, Completion, DeviceInfo, IoBuf, IoError, IoSeg, Op, Request, SubmitError,
};

/// Longest a test waits for one batch of completions.
const BATCH_TIMEOUT: Duration = Duration::from_secs(30);

fn fill_random(buf: &mut [u8], seed: u64) {
    ferroraid_tests::Rng::new(seed).fill(buf);
}

fn random_buf(len: usize, seed: u64) -> AlignedBuf {
    let mut b = AlignedBuf::zeroed(len);
    fill_random(&mut b, seed);
    b
}

/// Lends `buf[off..off + len]` to a request.
fn lend(buf: &mut AlignedBuf, off: usize, len: usize, region: Option<u16>) -> IoBuf {
    assert!(off + len <= buf.len());
    let ptr = NonNull::new(buf[off..].as_mut_ptr()).expect("non-null");
    // SAFETY: every test waits for the request's completion (or drops the channel, which
    // waits) before touching or freeing the buffer again.
    unsafe { IoBuf::from_raw(ptr, u32::try_from(len).expect("small"), region) }
}

fn req(tag: u64, op: Op, offset: u64, buf: IoBuf) -> Request {
    Request {
        tag,
        op,
        offset_bytes: offset,
        len_bytes: buf.len(),
        buf,
    }
}

fn range_req(tag: u64, op: Op, offset: u64, len: u32) -> Request {
    Request {
        tag,
        op,
        offset_bytes: offset,
        len_bytes: len,
        buf: IoBuf::NONE,
    }
}

/// Waits for `n` completions (blocking in the kernel between polls).
fn complete(ch: &mut UringChannel, n: usize) -> Vec<Completion> {
    complete_with(ch, n, false)
}

/// Collects `n` completions; with `spin`, only by polling (no syscall of the channel's
/// own: completions must show up in the ring while the caller busy-polls, as a reactor in
/// polled mode does).
fn complete_with(ch: &mut UringChannel, n: usize, spin: bool) -> Vec<Completion> {
    let deadline = Instant::now() + BATCH_TIMEOUT;
    let mut got = Vec::with_capacity(n);
    let mut out = [Completion::EMPTY; 16];
    while got.len() < n {
        let k = ch.poll(&mut out);
        got.extend_from_slice(&out[..k]);
        if k == 0 {
            assert!(
                Instant::now() < deadline,
                "timed out: {} of {n} completions",
                got.len()
            );
            if spin {
                std::hint::spin_loop();
            } else {
                ch.wait(1, Some(Duration::from_millis(100))).expect("wait");
            }
        }
    }
    assert_eq!(ch.in_flight(), 0);
    got.sort_by_key(|c| c.tag);
    got
}

/// Submits `reqs` as one batch (one kick) and asserts they all succeed.
fn run_ok(ch: &mut UringChannel, reqs: &[Request]) {
    run_ok_with(ch, reqs, false);
}

/// As [`run_ok`]; with `spin`, completions are reaped by polling alone.
fn run_ok_with(ch: &mut UringChannel, reqs: &[Request], spin: bool) {
    for r in reqs {
        ch.submit(*r)
            .unwrap_or_else(|e| panic!("submit {r:?}: {e}"));
    }
    assert_eq!(ch.in_flight(), reqs.len());
    ch.kick();
    for c in complete_with(ch, reqs.len(), spin) {
        assert_eq!(c.status, Ok(()), "request {}", c.tag);
    }
}

fn run_one(ch: &mut UringChannel, r: Request) -> Result<(), IoError> {
    ch.submit(r).expect("submit");
    ch.kick();
    complete(ch, 1)[0].status
}

/// The data checks every device gets: batched write + read-back, FUA, flush, write
/// zeroes, discard, refusals, registered buffers, drop with requests in flight.
fn exercise(dev: &UringDevice) {
    let info = dev.info().clone();
    let block = info.block_bytes as usize;
    assert!(info.capacity_bytes >= 4 << 20, "{info:?}");
    let mut ch = dev.open_channel().expect("channel");

    // Batched writes of random data at scattered offsets, then batched reads.
    const N: usize = 8;
    const LEN: usize = 64 << 10;
    let offsets: Vec<u64> = (0..N as u64).map(|i| (i * 3 + 1) * LEN as u64).collect();
    let mut data = random_buf(N * LEN, 1);
    let writes: Vec<Request> = (0..N)
        .map(|i| {
            let op = Op::Write { fua: false };
            req(
                i as u64,
                op,
                offsets[i],
                lend(&mut data, i * LEN, LEN, None),
            )
        })
        .collect();
    run_ok(&mut ch, &writes);
    let mut back = AlignedBuf::zeroed(N * LEN);
    let reads: Vec<Request> = (0..N)
        .map(|i| {
            req(
                100 + i as u64,
                Op::Read,
                offsets[i],
                lend(&mut back, i * LEN, LEN, None),
            )
        })
        .collect();
    // Reaped by busy polling alone.
    run_ok_with(&mut ch, &reads, true);
    assert!(
        back[..] == data[..],
        "read-back differs from what was written"
    );

    // A gathered write (IORING_OP_WRITEV): three pieces from scattered places of one
    // buffer, out of order, written one after the other, FUA; read back whole.
    assert!(ch.gathers());
    let mut src = random_buf(4 * LEN, 5);
    let pieces = [(2 * LEN, block), (0, 3 * block), (LEN + block, 2 * block)];
    let mut segs: Vec<IoSeg> = pieces
        .iter()
        .map(|&(off, len)| IoSeg {
            base: src[off..].as_mut_ptr(),
            len,
        })
        .collect();
    let total = pieces.iter().map(|p| p.1).sum::<usize>();
    // SAFETY: `segs` and `src` outlive the request, which completes before run_one returns.
    let buf = unsafe {
        IoBuf::gather(
            NonNull::new(segs.as_mut_ptr()).expect("non-null"),
            segs.len() as u16,
            total as u32,
        )
    };
    let at = 5 * LEN as u64;
    assert_eq!(
        run_one(&mut ch, req(3, Op::Write { fua: true }, at, buf)),
        Ok(())
    );
    let mut got = AlignedBuf::zeroed(total);
    let r = req(4, Op::Read, at, lend(&mut got, 0, total, None));
    assert_eq!(run_one(&mut ch, r), Ok(()));
    let want: Vec<u8> = pieces
        .iter()
        .flat_map(|&(off, len)| src[off..off + len].to_vec())
        .collect();
    assert!(got[..] == want[..], "a gathered write read back differs");
    // A gathered read is refused before it reaches the kernel.
    let bad = req(5, Op::Read, at, buf);
    assert!(matches!(ch.submit(bad), Err(SubmitError::Invalid(_))));

    // FUA write of one block at the last block of the device, read back.
    let last = info.capacity_bytes - block as u64;
    let mut fua = random_buf(block, 2);
    let w = req(
        1,
        Op::Write { fua: true },
        last,
        lend(&mut fua, 0, block, None),
    );
    assert_eq!(run_one(&mut ch, w), Ok(()));
    let mut one = AlignedBuf::zeroed(block);
    let r = req(2, Op::Read, last, lend(&mut one, 0, block, None));
    assert_eq!(run_one(&mut ch, r), Ok(()));
    assert!(one[..] == fua[..]);

    // Flush.
    assert_eq!(run_one(&mut ch, range_req(3, Op::Flush, 0, 0)), Ok(()));

    // Write zeroes over the middle of the first written range; its neighbours keep data.
    let z_off = offsets[0] + 4096;
    let z_len = 16 << 10;
    if info.write_zeroes {
        let wz = range_req(4, Op::WriteZeroes, z_off, z_len);
        assert_eq!(run_one(&mut ch, wz), Ok(()));
        let mut rb = AlignedBuf::from_slice(&[0xa5; LEN]);
        let r = req(5, Op::Read, offsets[0], lend(&mut rb, 0, LEN, None));
        assert_eq!(run_one(&mut ch, r), Ok(()));
        assert!(rb[..4096] == data[..4096]);
        assert!(rb[4096..4096 + z_len as usize].iter().all(|&b| b == 0));
        assert!(rb[4096 + z_len as usize..] == data[4096 + z_len as usize..LEN]);
    } else {
        let wz = range_req(4, Op::WriteZeroes, z_off, z_len);
        assert!(matches!(ch.submit(wz), Err(SubmitError::Invalid(_))));
    }

    // Discard the second range: reads give zeroes or the old data (device-defined).
    if info.discard {
        let d = range_req(6, Op::Discard, offsets[1], LEN as u32);
        assert_eq!(run_one(&mut ch, d), Ok(()));
        let mut rb = AlignedBuf::zeroed(LEN);
        let r = req(7, Op::Read, offsets[1], lend(&mut rb, 0, LEN, None));
        assert_eq!(run_one(&mut ch, r), Ok(()));
        let old = &data[LEN..2 * LEN];
        assert!(rb.iter().all(|&b| b == 0) || rb[..] == old[..]);
    }

    // Refusals: beyond the end, misaligned offset and length; nothing queued.
    let mut tmp = AlignedBuf::zeroed(2 * block);
    for (r, why) in [
        (
            req(8, Op::Read, last, lend(&mut tmp, 0, 2 * block, None)),
            "beyond",
        ),
        (
            req(
                8,
                Op::Read,
                info.capacity_bytes,
                lend(&mut tmp, 0, block, None),
            ),
            "beyond",
        ),
        (
            req(
                8,
                Op::Read,
                block as u64 / 2,
                lend(&mut tmp, 0, block, None),
            ),
            "multiple",
        ),
        (
            req(
                8,
                Op::Write { fua: false },
                0,
                lend(&mut tmp, 0, block / 2, None),
            ),
            "multiple",
        ),
        (
            req(8, Op::Read, 0, lend(&mut tmp, 0, block, Some(0))),
            "registered",
        ),
    ] {
        match ch.submit(r) {
            Err(SubmitError::Invalid(m)) => assert!(m.contains(why), "{m} vs {why}"),
            other => panic!("{r:?}: {other:?}"),
        }
    }
    assert_eq!(ch.in_flight(), 0);

    // Registered buffers: fixed write / plain read, plain write / fixed read.
    let mut region = AlignedBuf::zeroed(4 * LEN);
    let base = NonNull::new(region.as_mut_ptr()).expect("non-null");
    // SAFETY: `region` stays allocated until after `ch` is dropped (both explicitly, at the
    // end of this function, `ch` first), and is unregistered before that anyway.
    unsafe { ch.register_buffers(&[(base, region.len())]) }.expect("register buffers");
    assert_eq!(ch.registered_regions(), 1);
    fill_random(&mut region[..LEN], 3);
    let fixed_off = 40 * LEN as u64;
    let w = req(
        9,
        Op::Write { fua: false },
        fixed_off,
        lend(&mut region, 0, LEN, Some(0)),
    );
    assert_eq!(run_one(&mut ch, w), Ok(()));
    let mut plain = AlignedBuf::zeroed(LEN);
    let r = req(10, Op::Read, fixed_off, lend(&mut plain, 0, LEN, None));
    assert_eq!(run_one(&mut ch, r), Ok(()));
    assert!(plain[..] == region[..LEN]);
    let mut plain2 = random_buf(LEN, 4);
    let w = req(
        11,
        Op::Write { fua: true },
        fixed_off + LEN as u64,
        lend(&mut plain2, 0, LEN, None),
    );
    assert_eq!(run_one(&mut ch, w), Ok(()));
    let r = req(
        12,
        Op::Read,
        fixed_off + LEN as u64,
        lend(&mut region, 2 * LEN, LEN, Some(0)),
    );
    assert_eq!(run_one(&mut ch, r), Ok(()));
    assert!(region[2 * LEN..3 * LEN] == plain2[..]);
    // A buffer outside the region it names is refused.
    let mut outside = AlignedBuf::zeroed(LEN);
    let r = req(13, Op::Read, 0, lend(&mut outside, 0, LEN, Some(0)));
    assert!(matches!(ch.submit(r), Err(SubmitError::Invalid(_))));
    let r = req(13, Op::Read, 0, lend(&mut region, 0, LEN, Some(1)));
    assert!(matches!(ch.submit(r), Err(SubmitError::Invalid(_))));
    ch.unregister_buffers().expect("unregister");
    assert_eq!(ch.registered_regions(), 0);

    // Drop with requests in flight: the drop waits for them before the buffers go.
    let mut big = AlignedBuf::zeroed(N * LEN);
    for (i, &off) in offsets.iter().enumerate() {
        let r = req(
            20 + i as u64,
            Op::Read,
            off,
            lend(&mut big, i * LEN, LEN, None),
        );
        ch.submit(r).expect("submit");
    }
    ch.kick();
    assert_eq!(ch.stats().kick_errors, 0);
    assert_eq!(ch.stats().stray_completions, 0);
    drop(ch);
    drop(big);
    drop(region);
}

/// `QueueFull` at the depth limit, and space again after polling.
fn queue_full(path: &Path, info: &DeviceInfo) {
    let cfg = UringConfig {
        queue_depth: 4,
        ..UringConfig::default()
    };
    let dev = UringDevice::open(path, &cfg).expect("open");
    let block = info.block_bytes as usize;
    let mut ch = dev.open_channel().expect("channel");
    let mut buf = AlignedBuf::zeroed(5 * block);
    for i in 0..4 {
        let r = req(
            i,
            Op::Read,
            i * block as u64,
            lend(&mut buf, i as usize * block, block, None),
        );
        ch.submit(r).expect("submit below the depth");
    }
    let r = req(4, Op::Read, 0, lend(&mut buf, 4 * block, block, None));
    assert_eq!(ch.submit(r), Err(SubmitError::QueueFull));
    assert_eq!(
        ch.submit(range_req(4, Op::Flush, 0, 0)),
        Err(SubmitError::QueueFull)
    );
    assert_eq!(ch.in_flight(), 4);
    ch.kick();
    let done = complete(&mut ch, 4);
    assert_eq!(done.iter().map(|c| c.tag).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert!(done.iter().all(|c| c.status.is_ok()));
    assert_eq!(run_one(&mut ch, r), Ok(()));
}

fn make_file(dir: &Path, name: &str, len: u64) -> PathBuf {
    let path = dir.join(name);
    let f = std::fs::File::create(&path).expect("create");
    f.set_len(len).expect("set_len");
    path
}

#[test]
fn regular_file() {
    let dir = disk_tempdir();
    // Not a multiple of any block size: capacity rounds down.
    let path = make_file(dir.path(), "member.img", (16 << 20) + 100);
    let t = Instant::now();
    let dev = UringDevice::open(&path, &UringConfig::default()).expect("open");
    let info = dev.info().clone();
    eprintln!("regular file DeviceInfo: {info:?}");
    assert!(!dev.is_block_device());
    assert!(
        info.block_bytes == 512 || info.block_bytes == 4096,
        "{info:?}"
    );
    assert_eq!(info.capacity_bytes, 16 << 20);
    assert_eq!(info.max_transfer_bytes, 1 << 20);
    assert!(info.volatile_cache);
    // The tempdir is on ext4/xfs/btrfs (the build disk), all of which have both.
    assert!(info.write_zeroes && info.discard, "{info:?}");
    exercise(&dev);
    queue_full(&path, &info);
    eprintln!("regular file checks: {:?}", t.elapsed());
}

#[test]
fn regular_file_sqpoll_and_channel_moved_to_another_thread() {
    let dir = disk_tempdir();
    let path = make_file(dir.path(), "member.img", 8 << 20);
    let cfg = UringConfig {
        sqpoll: Some(10),
        ..UringConfig::default()
    };
    let dev = UringDevice::open(&path, &cfg).expect("open");
    let block = dev.info().block_bytes as usize;
    let mut ch = dev.open_channel().expect("channel with SQPOLL");
    // Created here, used on another thread (as a reactor would).
    let h = std::thread::spawn(move || {
        let mut data = random_buf(32 * block, 5);
        let writes: Vec<Request> = (0..32)
            .map(|i| {
                let buf = lend(&mut data, i * block, block, None);
                req(i as u64, Op::Write { fua: false }, (i * block) as u64, buf)
            })
            .collect();
        run_ok(&mut ch, &writes);
        let mut back = AlignedBuf::zeroed(32 * block);
        let r = req(99, Op::Read, 0, lend(&mut back, 0, 32 * block, None));
        assert_eq!(run_one(&mut ch, r), Ok(()));
        assert!(back[..] == data[..]);
    });
    h.join().expect("reactor thread");
}

#[test]
fn regular_file_short_read_after_truncation() {
    let dir = disk_tempdir();
    let path = make_file(dir.path(), "member.img", 64 << 10);
    let cfg = UringConfig {
        direct: false,
        ..UringConfig::default()
    };
    let dev = UringDevice::open(&path, &cfg).expect("open");
    assert_eq!(dev.info().block_bytes, 512);
    assert_eq!(dev.info().capacity_bytes, 64 << 10);
    // The file shrinks behind the device's back: reads past the new end come back short.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|f| f.set_len(4096 + 100))
        .expect("truncate");
    let mut ch = dev.open_channel().expect("channel");
    let mut buf = AlignedBuf::zeroed(8192);
    let r = req(1, Op::Read, 0, lend(&mut buf, 0, 8192, None));
    assert_eq!(
        run_one(&mut ch, r),
        Err(IoError::Short {
            done: 4196,
            expected: 8192
        })
    );
    let r = req(2, Op::Read, 16384, lend(&mut buf, 0, 8192, None));
    assert_eq!(
        run_one(&mut ch, r),
        Err(IoError::Short {
            done: 0,
            expected: 8192
        })
    );
}

#[test]
fn refuses_empty_and_tiny_files() {
    let dir = disk_tempdir();
    for len in [0, 100] {
        let path = make_file(dir.path(), &format!("tiny{len}.img"), len);
        let err = UringDevice::open(&path, &UringConfig::default()).expect_err("refused");
        let msg = err.to_string();
        assert!(
            msg.contains(&path.display().to_string()) && msg.contains("block"),
            "{msg}"
        );
    }
}

#[test]
fn loop_device() {
    let dir = disk_tempdir();
    let backing = make_file(dir.path(), "loop-backing.img", 64 << 20);
    let guard = match attach_loop(&backing) {
        Ok(g) => g,
        Err(why) if std::env::var_os("FERRORAID_REQUIRE_LOOP").is_none() => {
            eprintln!("SKIP loop_device: {why} (set FERRORAID_REQUIRE_LOOP=1 to fail instead)");
            return;
        }
        Err(why) => panic!("FERRORAID_REQUIRE_LOOP is set and no loop device: {why}"),
    };
    let t = Instant::now();
    let dev = UringDevice::open(&guard.dev, &UringConfig::default()).expect("open loop device");
    let info = dev.info().clone();
    eprintln!("loop device {} DeviceInfo: {info:?}", guard.dev);
    assert!(dev.is_block_device());
    assert_eq!(info.capacity_bytes, 64 << 20);
    assert!(info.block_bytes >= 512 && info.max_transfer_bytes >= info.block_bytes);
    exercise(&dev);
    queue_full(Path::new(&guard.dev), &info);

    // What went through the loop device is in the backing file.
    let mut ch = dev.open_channel().expect("channel");
    let mut data = random_buf(64 << 10, 6);
    let off = 50u64 << 20;
    let w = req(
        1,
        Op::Write { fua: true },
        off,
        lend(&mut data, 0, 64 << 10, None),
    );
    assert_eq!(run_one(&mut ch, w), Ok(()));
    assert_eq!(run_one(&mut ch, range_req(2, Op::Flush, 0, 0)), Ok(()));
    drop(ch);
    drop(dev);
    let mut from_file = vec![0u8; 64 << 10];
    let f = std::fs::File::open(&backing).expect("open backing file");
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut from_file, off).expect("read backing");
    assert!(from_file[..] == data[..]);
    eprintln!("loop device checks: {:?}", t.elapsed());
    drop(guard);
}

/// Whether /dev/shm is a tmpfs mount (the tmpfs tests skip where it is not).
fn shm_is_tmpfs() -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let yes = mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some("/dev/shm") && l.contains(" tmpfs "));
    if !yes {
        eprintln!("SKIP tmpfs test: /dev/shm is not a tmpfs mount");
    }
    yes
}

/// On tmpfs (no `FALLOC_FL_ZERO_RANGE`) write zeroes is reported unsupported and refused,
/// while discard (`PUNCH_HOLE`) works. Skips where /dev/shm is not tmpfs.
#[test]
fn tmpfs_file_reports_what_its_file_system_supports() {
    if !shm_is_tmpfs() {
        return;
    }
    let dir = tempfile::tempdir_in("/dev/shm").expect("tempdir in /dev/shm");
    let path = make_file(dir.path(), "member.img", 1 << 20);
    let cfg = UringConfig {
        direct: false,
        ..UringConfig::default()
    };
    let dev = UringDevice::open(&path, &cfg).expect("open");
    let info = dev.info();
    assert!(!info.write_zeroes && info.discard, "{info:?}");
    let mut ch = dev.open_channel().expect("channel");
    assert!(matches!(
        ch.submit(range_req(1, Op::WriteZeroes, 0, 4096)),
        Err(SubmitError::Invalid(_))
    ));
    assert_eq!(run_one(&mut ch, range_req(2, Op::Discard, 0, 4096)), Ok(()));
}

/// Opens `path` with `O_DIRECT` (tmpfs has it since Linux 6.6), else through the page cache.
fn open_tmpfs_member(path: &Path, inline_reads: bool) -> UringDevice {
    let cfg = UringConfig {
        inline_reads,
        ..UringConfig::default()
    };
    UringDevice::open(path, &cfg).unwrap_or_else(|_| {
        UringDevice::open(
            path,
            &UringConfig {
                direct: false,
                ..cfg
            },
        )
        .expect("open tmpfs member")
    })
}

/// Whether the kernel takes `RWF_NOWAIT` reads of `path` (then io_uring reads it inline
/// itself and the channel must leave reads to it).
fn takes_nowait_reads(path: &Path) -> bool {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).expect("open");
    let mut buf = [0u8; 512];
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: one iovec over a live local buffer of its length; the descriptor is open.
    let r = unsafe { libc::preadv2(f.as_raw_fd(), &iov, 1, 0, libc::RWF_NOWAIT) };
    r >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EOPNOTSUPP)
}

/// A tmpfs member (no `FMODE_NOWAIT`: io_uring would hand every read to io-wq, behind the
/// writes) serves reads of at most `INLINE_READ_MAX_BYTES` in `submit`: their completions
/// are ready before the writes queued ahead of them have even been handed to the kernel,
/// with the data those writes' predecessors left. Larger reads, writes and every read of a
/// file on the build disk (ext4/xfs: reads inline in io_uring already) go through
/// io_uring. Every data check of `exercise` passes on the inline path, and a short read
/// comes back exactly as io_uring reports it.
#[test]
fn tmpfs_small_reads_complete_in_submit_ahead_of_queued_writes() {
    // Files on the build disk take NOWAIT reads: nothing changes for them.
    let disk = disk_tempdir();
    let on_disk = make_file(disk.path(), "member.img", 1 << 20);
    let dev = UringDevice::open(&on_disk, &UringConfig::default()).expect("open");
    assert_eq!(dev.inline_read_max_bytes(), 0);
    if !shm_is_tmpfs() {
        return;
    }
    let dir = tempfile::tempdir_in("/dev/shm").expect("tempdir in /dev/shm");
    let path = make_file(dir.path(), "member.img", 16 << 20);
    if takes_nowait_reads(&path) {
        // A kernel whose tmpfs takes NOWAIT: io_uring serves reads inline itself.
        assert_eq!(open_tmpfs_member(&path, true).inline_read_max_bytes(), 0);
        eprintln!("SKIP inline reads: this kernel reads tmpfs files without io-wq");
        return;
    }
    assert_eq!(open_tmpfs_member(&path, false).inline_read_max_bytes(), 0);
    let dev = open_tmpfs_member(&path, true);
    assert_eq!(dev.inline_read_max_bytes(), INLINE_READ_MAX_BYTES);
    exercise(&dev);

    const CHUNK: usize = 64 << 10;
    // Every buffer is declared before the channels, so that a failing assertion drops the
    // channels (which wait for their requests) before the buffers they may still use.
    let mut old = random_buf(16 * CHUNK, 7);
    let mut new = random_buf(16 * CHUNK, 8);
    let mut small = AlignedBuf::zeroed(4096);
    let mut chunk = AlignedBuf::zeroed(CHUNK);
    let mut large = AlignedBuf::zeroed(2 * CHUNK);
    let mut back = AlignedBuf::zeroed(16 * CHUNK);
    let mut buf = AlignedBuf::zeroed(8192);
    let mut ch = dev.open_channel().expect("channel");
    let writes: Vec<Request> = (0..16)
        .map(|i| {
            let buf = lend(&mut old, i * CHUNK, CHUNK, None);
            req(i as u64, Op::Write { fua: false }, (i * CHUNK) as u64, buf)
        })
        .collect();
    run_ok(&mut ch, &writes);

    // Sixteen 64 KiB writes of new data past the old, queued and not kicked; then reads of
    // the old data: 4 KiB and 64 KiB (inline), 128 KiB (through io_uring).
    for i in 0..16 {
        let buf = lend(&mut new, i * CHUNK, CHUNK, None);
        let off = ((16 + i) * CHUNK) as u64;
        ch.submit(req(100 + i as u64, Op::Write { fua: false }, off, buf))
            .expect("submit write");
    }
    let inline_before = ch.stats().inline_reads;
    let reads = [
        req(1, Op::Read, 8192, lend(&mut small, 0, 4096, None)),
        req(2, Op::Read, CHUNK as u64, lend(&mut chunk, 0, CHUNK, None)),
        req(3, Op::Read, 0, lend(&mut large, 0, 2 * CHUNK, None)),
    ];
    for r in reads {
        ch.submit(r).expect("submit read");
    }
    assert_eq!(ch.in_flight(), 19);
    let mut out = [Completion::EMPTY; 32];
    let k = ch.poll(&mut out);
    let mut tags: Vec<u64> = out[..k].iter().map(|c| c.tag).collect();
    tags.sort_unstable();
    assert_eq!(
        tags,
        [1, 2],
        "only the small reads are done before the kick"
    );
    assert!(
        out[..k].iter().all(|c| c.status == Ok(())),
        "{:?}",
        &out[..k]
    );
    assert_eq!(ch.stats().inline_reads - inline_before, 2);
    assert!(small[..] == old[8192..8192 + 4096]);
    assert!(chunk[..] == old[CHUNK..2 * CHUNK]);
    ch.kick();
    for c in complete(&mut ch, 17) {
        assert_eq!(c.status, Ok(()), "request {}", c.tag);
    }
    assert!(large[..] == old[..2 * CHUNK]);
    let r = req(
        4,
        Op::Read,
        (16 * CHUNK) as u64,
        lend(&mut back, 0, 16 * CHUNK, None),
    );
    assert_eq!(run_one(&mut ch, r), Ok(()));
    assert!(back[..] == new[..]);

    // The file shrinks behind the device's back: the inline read comes back short, with
    // the outcome the io_uring path reports for the same read.
    let mut plain = open_tmpfs_member(&path, false)
        .open_channel()
        .expect("channel");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|f| f.set_len(4096 + 512))
        .expect("truncate");
    let short = Err(IoError::Short {
        done: 4096 + 512,
        expected: 8192,
    });
    let r = req(5, Op::Read, 0, lend(&mut buf, 0, 8192, None));
    assert_eq!(run_one(&mut plain, r), short);
    let before = ch.stats().inline_reads;
    let r = req(6, Op::Read, 0, lend(&mut buf, 0, 8192, None));
    assert_eq!(run_one(&mut ch, r), short);
    assert_eq!(ch.stats().inline_reads, before + 1);
}
