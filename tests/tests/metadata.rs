//! md v1.2 superblocks on real files, held against mdadm itself.
//!
//! ferroraid writes the superblocks of a RAID6 and a RAID5 array into sparse member files
//! (`drivers::metadata_io`), and `mdadm --examine` must read every one of them: the right
//! array UUID, name, level, member count, layout, chunk, data offset, role, events, array
//! state — and "Checksum : ... - correct". Without mdadm these tests print why they skip,
//! unless `FERRORAID_REQUIRE_MDADM=1` (set by CI), in which case they fail.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use drivers::metadata_io::{
    read_candidate, read_superblock, read_superblock_area, write_superblock, MetadataIoError,
};
use engine::geometry::{Geometry, Layout, Level};
use engine::metadata::{
    assemble, next_generation, AssembleOptions, MdTime, NewArray, Resync, Superblock,
    SuperblockError, Update, Uuid, MD_SB_MAGIC,
};
use ferroraid_tests::mdadm;
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Member size: 64 MiB, sparse.
const MEMBER_BYTES: u64 = 64 << 20;
const CHUNK_BYTES: u64 = 64 << 10;

fn disk_tempdir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir in CARGO_TARGET_TMPDIR")
}

/// Creates `n` sparse member files of [`MEMBER_BYTES`].
fn member_files(dir: &Path, n: usize) -> Vec<PathBuf> {
    (0..n)
        .map(|i| {
            let p = dir.join(format!("member{i}.img"));
            std::fs::File::create(&p)
                .and_then(|f| f.set_len(MEMBER_BYTES))
                .expect("create member file");
            p
        })
        .collect()
}

/// Builds and writes the superblocks of a new array onto `files`.
fn create(
    files: &[PathBuf],
    level: Level,
    layout: Layout,
    uuid: Uuid,
    clean: bool,
) -> Vec<Superblock> {
    let g = Geometry::new(level, layout, files.len() as u16, CHUNK_BYTES, 512).unwrap();
    let mut a = NewArray::new(
        g,
        uuid,
        "ferro",
        Some("testhost"),
        MdTime::new(1_700_000_000, 0),
    )
    .unwrap();
    a.clean = clean;
    let sbs = a
        .superblocks(
            &vec![MEMBER_BYTES / 512; files.len()],
            &mut ChaCha8Rng::seed_from_u64(42),
        )
        .unwrap();
    for (f, sb) in files.iter().zip(&sbs) {
        write_superblock(f, sb).unwrap();
    }
    sbs
}

/// Runs `mdadm --examine FILE` and returns its `key : value` lines.
fn examine(mdadm: &Path, file: &Path) -> (String, HashMap<String, String>) {
    let out = Command::new(mdadm)
        .arg("--examine")
        .arg(file)
        .output()
        .expect("run mdadm");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "mdadm --examine {} failed ({}): {}{}",
        file.display(),
        out.status,
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    let map = text
        .lines()
        .filter_map(|l| l.split_once(" : "))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    (text, map)
}

fn field<'a>(m: &'a HashMap<String, String>, k: &str, text: &str) -> &'a str {
    m.get(k)
        .map(String::as_str)
        .unwrap_or_else(|| panic!("mdadm --examine printed no {k:?} line:\n{text}"))
}

/// Checks every line of `mdadm --examine` that the superblock decides.
fn check_examine(mdadm: &Path, file: &Path, sb: &Superblock, array_state: &str) {
    let (text, m) = examine(mdadm, file);
    let f = |k: &str| field(&m, k, &text).to_string();
    assert_eq!(f("Magic"), format!("{MD_SB_MAGIC:08x}"), "{text}");
    assert_eq!(f("Version"), "1.2", "{text}");
    assert_eq!(f("Feature Map"), "0x0", "{text}");
    assert_eq!(f("Array UUID"), sb.set_uuid.to_string(), "{text}");
    assert_eq!(f("Name"), "testhost:ferro", "{text}");
    assert_eq!(f("Raid Level"), format!("raid{}", sb.level), "{text}");
    assert_eq!(f("Raid Devices"), sb.raid_disks.to_string(), "{text}");
    assert!(
        f("Avail Dev Size").starts_with(&format!("{} sectors", sb.data_size)),
        "{text}"
    );
    assert_eq!(
        f("Data Offset"),
        format!("{} sectors", sb.data_offset),
        "{text}"
    );
    assert_eq!(f("Super Offset"), "8 sectors", "{text}");
    let state = if sb.is_clean() { "clean" } else { "active" };
    assert_eq!(f("State"), state, "{text}");
    assert_eq!(f("Device UUID"), sb.device_uuid.to_string(), "{text}");
    assert_eq!(
        f("Checksum"),
        format!("{:x} - correct", sb.checksum().unwrap()),
        "{text}"
    );
    assert_eq!(f("Events"), sb.events.to_string(), "{text}");
    let layout = Layout::from_md(sb.layout).unwrap();
    assert_eq!(f("Layout"), layout.name(), "{text}");
    assert_eq!(f("Chunk Size"), format!("{}K", sb.chunksize / 2), "{text}");
    let role = match sb.role() {
        engine::metadata::DevRole::Active(r) => format!("Active device {r}"),
        other => panic!("unexpected role {other}"),
    };
    assert_eq!(f("Device Role"), role, "{text}");
    assert!(
        f("Array State").starts_with(&format!("{array_state} (")),
        "expected Array State {array_state}:\n{text}"
    );
    assert_eq!(
        f("Bad Block Log"),
        format!(
            "512 entries available at offset {} sectors",
            sb.bblog_offset
        ),
        "{text}"
    );
    assert!(!text.contains("WARNING"), "{text}");
}

/// `mdadm --examine --brief` of all members: exactly one ARRAY line, for this array.
fn check_brief(mdadm: &Path, files: &[PathBuf], uuid: Uuid) {
    let out = Command::new(mdadm)
        .args(["--examine", "--brief"])
        .args(files)
        .output()
        .expect("run mdadm");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one ARRAY line:\n{text}");
    let l = lines[0];
    assert!(l.starts_with("ARRAY /dev/md/ferro "), "{l}");
    assert!(l.contains("metadata=1.2"), "{l}");
    assert!(l.contains(&format!("UUID={uuid}")), "{l}");
}

fn uuid(seed: u64) -> Uuid {
    Uuid::random(&mut ChaCha8Rng::seed_from_u64(seed))
}

#[test]
fn mdadm_examines_raid6_members() {
    let Some(mdadm) = mdadm() else { return };
    let dir = disk_tempdir();
    let files = member_files(dir.path(), 6);
    let u = uuid(6);
    let sbs = create(&files, Level::Raid6, Layout::LeftSymmetric, u, true);
    for (f, sb) in files.iter().zip(&sbs) {
        assert_eq!(&read_superblock(f).unwrap(), sb);
        check_examine(&mdadm, f, sb, "AAAAAA");
    }
    check_brief(&mdadm, &files, u);
    eprintln!("{}", examine(&mdadm, &files[0]).0);
}

#[test]
fn mdadm_examines_raid5_members() {
    let Some(mdadm) = mdadm() else { return };
    let dir = disk_tempdir();
    let files = member_files(dir.path(), 5);
    let u = uuid(5);
    let sbs = create(&files, Level::Raid5, Layout::RightAsymmetric, u, false);
    for (f, sb) in files.iter().zip(&sbs) {
        check_examine(&mdadm, f, sb, "AAAAA");
    }
    check_brief(&mdadm, &files, u);
}

#[test]
fn mdadm_reads_every_layout_and_level() {
    let Some(mdadm) = mdadm() else { return };
    let dir = disk_tempdir();
    let files = member_files(dir.path(), 4);
    for level in [Level::Raid5, Level::Raid6] {
        for layout in Layout::ALL {
            let sbs = create(&files, level, layout, uuid(u64::from(layout.md_id())), true);
            check_examine(&mdadm, &files[3], &sbs[3], "AAAA");
        }
    }
}

/// A member fails: the next generation goes to the others. mdadm sees the new events, the
/// dirty state and the failed role on the survivors; assembly from the files agrees.
#[test]
fn next_generation_on_files_and_mdadm() {
    let dir = disk_tempdir();
    let files = member_files(dir.path(), 6);
    let sbs = create(&files, Level::Raid6, Layout::LeftSymmetric, uuid(9), true);
    let next = next_generation(
        &sbs,
        &Update {
            utime: MdTime::new(1_700_000_100, 0),
            failed: vec![4],
            resync: Some(Resync::Dirty),
            roles: Vec::new(),
            recovery: Vec::new(),
            features: Vec::new(),
        },
    )
    .unwrap();
    assert!(next[4].is_none());
    // Crash after three of the five survivors were written.
    for (f, sb) in files.iter().zip(&next).take(3) {
        write_superblock(f, sb.as_ref().unwrap()).unwrap();
    }
    let candidates: Vec<_> = files.iter().map(|f| read_candidate(f).unwrap()).collect();
    let a = assemble(&candidates, AssembleOptions::default()).unwrap_err();
    // Dirty (N+1 says so) and degraded (member 4 recorded faulty): refused without force.
    assert!(a.to_string().contains("dirty"), "{a}");
    let forced = assemble(
        &candidates,
        AssembleOptions {
            force: true,
            ..AssembleOptions::default()
        },
    )
    .unwrap();
    assert_eq!(forced.events, 1);
    assert_eq!(forced.missing_roles, vec![4]);
    assert_eq!(
        forced.members[3].as_ref().unwrap().events,
        0,
        "one behind: kept"
    );

    // Finish the update; mdadm reads the survivors.
    for (f, sb) in files.iter().zip(&next).skip(3) {
        if let Some(sb) = sb {
            write_superblock(f, sb).unwrap();
        }
    }
    if let Some(mdadm) = mdadm() {
        for (f, sb) in files.iter().zip(&next) {
            if let Some(sb) = sb {
                check_examine(&mdadm, f, sb, "AAAA.A");
            }
        }
    }
}

/// md's checksum folds in a trailing 16-bit word when `max_dev` is odd: mdadm must agree
/// with ferroraid's encoding for odd and even role counts alike.
#[test]
fn mdadm_agrees_on_checksum_for_odd_max_dev() {
    let Some(mdadm) = mdadm() else { return };
    let dir = disk_tempdir();
    let files = member_files(dir.path(), 4);
    let sbs = create(&files, Level::Raid6, Layout::LeftSymmetric, uuid(3), true);
    for max_dev in [4usize, 5, 7, 33, 1920] {
        let mut sb = sbs[1].clone();
        sb.dev_roles = (0..max_dev)
            .map(|i| if i < 4 { i as u16 } else { 0xffff })
            .collect();
        write_superblock(&files[1], &sb).unwrap();
        assert_eq!(read_superblock(&files[1]).unwrap(), sb);
        let (text, m) = examine(&mdadm, &files[1]);
        assert_eq!(
            field(&m, "Checksum", &text),
            format!("{:x} - correct", sb.checksum().unwrap()),
            "max_dev {max_dev}:\n{text}"
        );
    }
}

#[test]
fn io_errors_name_the_path() {
    let dir = disk_tempdir();
    let files = member_files(dir.path(), 1);
    // No superblock yet: no magic.
    let e = read_superblock(&files[0]).unwrap_err();
    assert!(matches!(
        e,
        MetadataIoError::Superblock {
            source: SuperblockError::NoMagic { found: 0 },
            ..
        }
    ));
    assert!(e.to_string().contains("member0.img"), "{e}");
    // A corrupted superblock: the checksum with both values.
    let sbs = create(
        &member_files(dir.path(), 4),
        Level::Raid6,
        Layout::LeftSymmetric,
        uuid(1),
        true,
    );
    let mut area = read_superblock_area(dir.path().join("member1.img")).unwrap();
    area[300] ^= 0xff;
    std::fs::write(dir.path().join("bad.img"), vec![0u8; 8192]).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("bad.img"))
            .unwrap();
        f.write_all_at(&area, 4096).unwrap();
    }
    let e = read_superblock(dir.path().join("bad.img")).unwrap_err();
    assert!(e.to_string().contains("bad.img"), "{e}");
    assert!(
        e.to_string().contains("bad superblock checksum: stored"),
        "{e}"
    );
    // Too small for the superblock area, and for the data the superblock describes.
    let tiny = dir.path().join("tiny.img");
    std::fs::write(&tiny, vec![0u8; 5000]).unwrap();
    let e = read_superblock(&tiny).unwrap_err();
    assert!(matches!(e, MetadataIoError::TooSmall { .. }), "{e}");
    assert!(e.to_string().contains("tiny.img"), "{e}");
    let e = write_superblock(dir.path().join("bad.img"), &sbs[1]).unwrap_err();
    assert!(matches!(e, MetadataIoError::TooSmall { .. }), "{e}");
    // Missing file.
    let e = write_superblock(dir.path().join("absent.img"), &sbs[0]).unwrap_err();
    assert!(matches!(e, MetadataIoError::Io { .. }), "{e}");
    assert!(e.to_string().contains("absent.img"), "{e}");
    // Not a v1.2 position.
    let mut v10 = sbs[0].clone();
    v10.super_offset = 131000;
    let e = write_superblock(dir.path().join("member0.img"), &v10).unwrap_err();
    assert!(matches!(e, MetadataIoError::WrongPosition { .. }), "{e}");
}

/// Runs `mdadm --examine-bitmap DEV` (it reads internal bitmaps only through a block
/// device: on a regular file it takes the file for an external bitmap) and returns its
/// `key : value` lines.
fn examine_bitmap(mdadm: &Path, dev: &str) -> (String, HashMap<String, String>) {
    let out = Command::new(mdadm)
        .arg("--examine-bitmap")
        .arg(dev)
        .output()
        .expect("run mdadm");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "mdadm --examine-bitmap {dev} failed ({}): {text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let map = text
        .lines()
        .filter_map(|l| l.split_once(" : "))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    (text, map)
}

/// ferroraid's internal bitmap, as mdadm reads it: `--examine` announces it 8 sectors
/// after the superblock (feature map 0x1) with the bad-block log after it, and
/// `--examine-bitmap` (through a loop device) reads every bitmap-superblock field and
/// counts the dirty bits ferroraid set.
#[test]
fn mdadm_reads_ferroraid_internal_bitmaps() {
    use drivers::metadata_io::{read_bitmap, write_bitmap_area};
    use engine::metadata::{Bitmap, BitmapChoice};
    let Some(mdadm) = mdadm() else { return };
    let dir = disk_tempdir();
    let files = member_files(dir.path(), 4);
    let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 4, CHUNK_BYTES, 512).unwrap();
    let mut a = NewArray::new(
        g,
        uuid(77),
        "ferro",
        Some("testhost"),
        MdTime::new(1_700_000_000, 0),
    )
    .unwrap();
    a.clean = true;
    a.bitmap = BitmapChoice::Internal;
    a.bitmap_chunk_bytes = Some(1 << 20);
    let sbs = a
        .superblocks(&[MEMBER_BYTES / 512; 4], &mut ChaCha8Rng::seed_from_u64(42))
        .unwrap();
    let bs = a.bitmap_super(sbs[0].size).unwrap().unwrap();
    // Member 0 gets a bitmap with some bits set (as after writes), the others clear ones.
    let mut dirty = Bitmap::new(bs.clone(), false);
    for k in [0u64, 7, 8, 30, bs.bits() - 1] {
        dirty.set(k, true);
    }
    for (i, (f, sb)) in files.iter().zip(&sbs).enumerate() {
        let area = if i == 0 {
            dirty.to_area(false)
        } else {
            a.initial_bitmap_area(sb.size).unwrap().unwrap()
        };
        write_bitmap_area(f, sb, &area).unwrap();
        write_superblock(f, sb).unwrap();
    }
    // ferroraid reads back what it wrote.
    assert_eq!(read_bitmap(&files[0], &sbs[0]).unwrap(), dirty);
    let c = read_candidate(&files[1]).unwrap();
    assert_eq!(c.bitmap, Some(Ok(bs.clone())));
    let asm = assemble(
        &files
            .iter()
            .map(|f| read_candidate(f).unwrap())
            .collect::<Vec<_>>(),
        AssembleOptions::default(),
    )
    .unwrap();
    assert!(!asm.bitmap.unwrap().stale);

    let (text, m) = examine(&mdadm, &files[0]);
    assert_eq!(
        m.get("Feature Map").map(String::as_str),
        Some("0x1"),
        "{text}"
    );
    assert_eq!(
        m.get("Internal Bitmap").map(String::as_str),
        Some("8 sectors from superblock"),
        "{text}"
    );
    assert!(
        m.get("Bad Block Log")
            .is_some_and(|v| v.contains(&format!("offset {} sectors", sbs[0].bblog_offset))),
        "{text}"
    );

    let guard = match ferroraid_tests::attach_loop(&files[0]) {
        Ok(g) => g,
        Err(why) if std::env::var_os("FERRORAID_REQUIRE_LOOP").is_none() => {
            eprintln!(
                "SKIPPED mdadm --examine-bitmap: {why} (mdadm reads internal bitmaps only \
                 through block devices; set FERRORAID_REQUIRE_LOOP=1 to fail instead)"
            );
            return;
        }
        Err(why) => panic!("FERRORAID_REQUIRE_LOOP is set but: {why}"),
    };
    let (text, m) = examine_bitmap(&mdadm, &guard.dev);
    let f = |k: &str| field(&m, k, &text).to_string();
    assert_eq!(f("Magic"), "6d746962", "{text}");
    assert_eq!(f("Version"), "4", "{text}");
    assert_eq!(f("UUID"), uuid(77).to_string(), "{text}");
    assert_eq!(f("Events"), "0", "{text}");
    assert_eq!(f("Events Cleared"), "0", "{text}");
    assert_eq!(f("State"), "OK", "{text}");
    assert_eq!(f("Chunksize"), "1 MB", "{text}");
    assert_eq!(f("Daemon"), "5s flush period", "{text}");
    assert_eq!(f("Write Mode"), "Normal", "{text}");
    assert!(
        f("Sync Size").starts_with(&format!("{} (", sbs[0].size / 2)),
        "{text}"
    );
    assert!(
        f("Bitmap").starts_with(&format!("{} bits (chunks), 5 dirty", bs.bits())),
        "{text}"
    );
}
