//! The same array engine over every real back end: `mem`, `null`, io_uring over files and
//! over loop devices. Random reads and writes are checked against a flat reference image,
//! and the member images the engine wrote are handed to the independent oracle.
//!
//! The loop-device case needs root and `losetup`; without them it says why it skips, unless
//! `FERRORAID_REQUIRE_LOOP` is set.

use std::path::{Path, PathBuf};

use drivers::mem::MemDevice;
use drivers::null::NullDevice;
use drivers::uring::{UringConfig, UringDevice};
use engine::array::{Array, ArrayCompletion, ArrayConfig, ArrayOp, ArrayRequest};
use engine::buf::AlignedBuf;
use engine::device::{BlockDevice, Channel, IoBuf};
use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
use engine::parity::Parity;
use ferroraid_tests::{attach_loop, Oracle, Rng};

const DATA_OFFSET: u64 = 1 << 20;
const CHUNK: u64 = 16384;
const STRIPES: u64 = 64;

fn geometry(level: Level, layout: Layout, members: u16) -> ArrayGeometry {
    let g = Geometry::new(level, layout, members, CHUNK, 512).unwrap();
    ArrayGeometry::new(g, STRIPES).unwrap()
}

/// An array over `devs` (member order), data area at [`DATA_OFFSET`].
fn array_over<D: BlockDevice>(geo: ArrayGeometry, devs: &[D]) -> Array<D::Channel> {
    let chans = devs.iter().map(|d| d.open_channel().unwrap()).collect();
    let cfg = ArrayConfig {
        data_offset_bytes: DATA_OFFSET,
        ..ArrayConfig::default()
    };
    Array::new(geo, chans, Parity::new(), cfg).unwrap()
}

/// Runs one request to completion, busy-polling the engine; `buf` is the data of a read or
/// write, and only gives the length of a write-zeroes or discard.
fn run_one<C: Channel>(arr: &mut Array<C>, op: ArrayOp, off: u64, buf: &mut [u8]) {
    let io = if op.has_buffer() {
        // SAFETY: `buf` outlives the request, which completes before this function returns,
        // and is not touched meanwhile.
        unsafe { IoBuf::from_slice(buf) }
    } else {
        IoBuf::NONE
    };
    arr.submit(ArrayRequest {
        tag: 1,
        op,
        offset_bytes: off,
        len_bytes: buf.len() as u32,
        buf: io,
    })
    .unwrap();
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 1];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        arr.process();
        if arr.poll(&mut out) == 1 {
            assert_eq!(
                out[0].status,
                Ok(()),
                "{op:?} at {off}+{} failed",
                buf.len()
            );
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "request did not complete"
        );
        std::hint::spin_loop();
    }
}

/// Random writes and reads (one at a time, up to two stripes long) checked against a flat
/// reference; returns the reference. With `check_reads` off (null members) reads only have
/// to complete.
fn workload<C: Channel>(arr: &mut Array<C>, seed: u64, ops: usize, check_reads: bool) -> Vec<u8> {
    let cap = arr.geometry().capacity_bytes();
    let stripe = arr.geometry().geometry().stripe_data_bytes();
    let mut reference = vec![0u8; cap as usize];
    let mut rng = Rng::new(seed);
    let mut buf = AlignedBuf::zeroed((2 * stripe) as usize);
    // Whole stripes of a discard read back as zeroes when every member promises it.
    let discard_zeroes = arr.channels().all(|c| c.info().discard);
    for i in 0..ops {
        let len = 512 * (1 + rng.below(if i % 2 == 0 { 16 } else { 2 * stripe / 512 }));
        let off = 512 * rng.below((cap - len) / 512 + 1);
        let b = &mut buf[..len as usize];
        let kind = rng.below(16);
        if kind == 0 {
            reference[off as usize..(off + len) as usize].fill(0);
            run_one(
                arr,
                ArrayOp::WriteZeroes {
                    fua: rng.below(2) == 0,
                },
                off,
                b,
            );
        } else if kind == 1 {
            let (first, last) = (off.div_ceil(stripe) * stripe, (off + len) / stripe * stripe);
            if discard_zeroes && first < last {
                reference[first as usize..last as usize].fill(0);
            }
            run_one(arr, ArrayOp::Discard, off, b);
        } else if kind < 9 {
            rng.fill(b);
            reference[off as usize..(off + len) as usize].copy_from_slice(b);
            run_one(
                arr,
                ArrayOp::Write {
                    fua: rng.below(8) == 0,
                },
                off,
                b,
            );
        } else {
            run_one(arr, ArrayOp::Read, off, b);
            if check_reads {
                assert!(
                    b == &reference[off as usize..(off + len) as usize],
                    "seed {seed}: read {off}+{len} differs"
                );
            }
        }
    }
    run_one(arr, ArrayOp::Flush, 0, &mut []);
    reference
}

/// Writes the member images to files (dropping the data offset) and has the oracle verify
/// parity and extract the logical image, which must equal `reference`; without the oracle,
/// says on stderr that `test` skips this check.
fn oracle_check(
    test: &str,
    level: Level,
    layout: Layout,
    images: &[Vec<u8>],
    reference: &[u8],
    dir: &Path,
) {
    let Some(oracle) = Oracle::locate_or_skip(test) else {
        return;
    };
    let mut paths: Vec<PathBuf> = Vec::new();
    for (i, img) in images.iter().enumerate() {
        let p = dir.join(format!("m{i}.img"));
        std::fs::write(&p, &img[DATA_OFFSET as usize..]).unwrap();
        paths.push(p);
    }
    let mut args: Vec<String> = vec!["verify".into()];
    args.extend(paths.iter().map(|p| p.display().to_string()));
    let common = [
        "--level".to_string(),
        level.md_level().to_string(),
        "--layout".into(),
        layout.name().into(),
        "--chunk".into(),
        CHUNK.to_string(),
    ];
    args.extend(common.iter().cloned());
    let out = oracle.run_ok(&args).unwrap_or_else(|e| panic!("{e}"));
    assert!(out.contains("mismatches 0"), "{out}");
    let extracted = dir.join("logical.img");
    let mut args: Vec<String> = vec!["extract".into()];
    args.extend(paths.iter().map(|p| p.display().to_string()));
    args.extend(common.iter().cloned());
    args.extend(["--out".into(), extracted.display().to_string()]);
    oracle.run_ok(&args).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        std::fs::read(&extracted).unwrap() == reference,
        "oracle's logical image differs from the reference"
    );
}

#[test]
fn array_on_mem_members_passes_the_oracle() {
    for (level, layout, n) in [
        (Level::Raid6, Layout::LeftSymmetric, 6),
        (Level::Raid6, Layout::LeftAsymmetric, 7),
        (Level::Raid5, Layout::RightAsymmetric, 5),
    ] {
        let geo = geometry(level, layout, n);
        let devs: Vec<MemDevice> = (0..n)
            .map(|i| {
                MemDevice::new(&format!("mem{i}"), DATA_OFFSET + STRIPES * CHUNK, 512, 32).unwrap()
            })
            .collect();
        let mut arr = array_over(geo, &devs);
        let reference = workload(&mut arr, 11 + u64::from(n), 400, true);
        let images: Vec<Vec<u8>> = devs.iter().map(|d| d.contents()).collect();
        let dir = tempfile::tempdir().unwrap();
        oracle_check(
            "array_on_mem_members_passes_the_oracle",
            level,
            layout,
            &images,
            &reference,
            dir.path(),
        );
    }
}

#[test]
fn array_on_null_members_completes_everything() {
    let geo = geometry(Level::Raid6, Layout::LeftSymmetric, 6);
    let devs: Vec<NullDevice> = (0..6)
        .map(|i| {
            NullDevice::new(&format!("null{i}"), DATA_OFFSET + STRIPES * CHUNK, 512, 32).unwrap()
        })
        .collect();
    let mut arr = array_over(geo, &devs);
    workload(&mut arr, 5, 400, false);
    let st = arr.stats();
    assert!(st.rmw_writes + st.rcw_writes + st.full_stripe_writes > 0 && st.direct_reads > 0);
}

fn uring_array(paths: &[PathBuf]) -> (Array<drivers::uring::UringChannel>, Vec<UringDevice>) {
    let geo = geometry(Level::Raid6, Layout::LeftSymmetric, paths.len() as u16);
    let devs: Vec<UringDevice> = paths
        .iter()
        .map(|p| UringDevice::open(p, &UringConfig::default()).unwrap())
        .collect();
    (array_over(geo, &devs), devs)
}

fn member_files(dir: &Path, n: usize) -> Vec<PathBuf> {
    (0..n)
        .map(|i| {
            let p = dir.join(format!("member{i}.img"));
            let f = std::fs::File::create(&p).unwrap();
            f.set_len(DATA_OFFSET + STRIPES * CHUNK).unwrap();
            p
        })
        .collect()
}

#[test]
fn array_on_uring_files_passes_the_oracle() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let paths = member_files(dir.path(), 6);
    let (mut arr, devs) = uring_array(&paths);
    let reference = workload(&mut arr, 21, 300, true);
    drop(arr);
    drop(devs);
    let images: Vec<Vec<u8>> = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();
    oracle_check(
        "array_on_uring_files_passes_the_oracle",
        Level::Raid6,
        Layout::LeftSymmetric,
        &images,
        &reference,
        dir.path(),
    );
}

/// The same over member files on tmpfs, where the io_uring channels serve small reads
/// themselves (`pread` in `submit`, `UringDevice::inline_read_max_bytes`): every read the
/// workload checks, and the images, match the oracle. Skips where /dev/shm is not tmpfs.
#[test]
fn array_on_uring_tmpfs_files_passes_the_oracle() {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    if !mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some("/dev/shm") && l.contains(" tmpfs "))
    {
        eprintln!("SKIP: /dev/shm is not a tmpfs mount");
        return;
    }
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let paths = member_files(dir.path(), 6);
    let devs: Vec<UringDevice> = paths
        .iter()
        .map(|p| {
            UringDevice::open(p, &UringConfig::default()).unwrap_or_else(|_| {
                // O_DIRECT on tmpfs needs Linux 6.6.
                let cfg = UringConfig {
                    direct: false,
                    ..UringConfig::default()
                };
                UringDevice::open(p, &cfg).unwrap()
            })
        })
        .collect();
    eprintln!(
        "tmpfs members: reads up to {} bytes served inline",
        devs[0].inline_read_max_bytes()
    );
    let mut arr = array_over(geometry(Level::Raid6, Layout::LeftSymmetric, 6), &devs);
    let reference = workload(&mut arr, 22, 300, true);
    drop(arr);
    drop(devs);
    let images: Vec<Vec<u8>> = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();
    oracle_check(
        "array_on_uring_tmpfs_files_passes_the_oracle",
        Level::Raid6,
        Layout::LeftSymmetric,
        &images,
        &reference,
        dir.path(),
    );
}

#[test]
fn array_on_uring_loop_devices_passes_the_oracle() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let files = member_files(dir.path(), 5);
    let mut guards = Vec::new();
    for f in &files {
        match attach_loop(f) {
            Ok(g) => guards.push(g),
            Err(why) => {
                assert!(
                    std::env::var_os("FERRORAID_REQUIRE_LOOP").is_none(),
                    "loop devices required: {why}"
                );
                eprintln!("SKIP array_on_uring_loop_devices_passes_the_oracle: {why}");
                return;
            }
        }
    }
    let devs: Vec<PathBuf> = guards.iter().map(|g| PathBuf::from(&g.dev)).collect();
    let (mut arr, uring) = uring_array(&devs);
    let reference = workload(&mut arr, 31, 300, true);
    drop(arr);
    drop(uring);
    drop(guards); // detach before reading the backing files
    let images: Vec<Vec<u8>> = files.iter().map(|p| std::fs::read(p).unwrap()).collect();
    oracle_check(
        "array_on_uring_loop_devices_passes_the_oracle",
        Level::Raid6,
        Layout::LeftSymmetric,
        &images,
        &reference,
        dir.path(),
    );
}
