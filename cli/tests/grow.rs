//! `ferroraid grow --consistency-policy resync|ppl`: a RAID6 PPL array (ferroraid's
//! extension) switched to resync — what kernel md assembles, checked with `mdadm
//! --examine` when mdadm is installed (`FERRORAID_REQUIRE_MDADM=1` makes it required, as
//! in CI) — and back, with `ferroraid examine` after each step; and every refusal, which
//! writes nothing.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Output;

use common::{
    create, disk_tempdir, examine_empty_ppl, examine_json, ferroraid, key_values, mdadm,
    mdadm_examine, member_files,
};
use drivers::metadata_io::{read_superblock_area, write_superblock};
use engine::metadata::{Superblock, MAX_SECTOR};

/// `ferroraid grow --consistency-policy POLICY FILES`.
fn grow(policy: &str, files: &[PathBuf]) -> Output {
    let mut args = vec!["grow", "--consistency-policy", policy];
    args.extend(files.iter().map(|f| f.to_str().unwrap()));
    ferroraid(&args)
}

/// Asserts success; returns stdout.
fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn superblock(f: &Path) -> Superblock {
    Superblock::decode(&read_superblock_area(f).unwrap()).unwrap()
}

/// `ferroraid examine FILE`: text and `key : value` lines.
fn examine(f: &Path) -> (String, std::collections::HashMap<String, String>) {
    let out = ferroraid(&["examine", f.to_str().unwrap()]);
    let text = ok(&out);
    let kv = key_values(&text);
    (text, kv)
}

/// Byte where mdadm's PPL area starts on a v1.2 member (superblock + 8 sectors).
const AREA_AT: u64 = 16 * 512;
/// Its length: 2048 sectors.
const AREA_BYTES: usize = 2048 * 512;

#[test]
fn raid6_ppl_switches_to_resync_and_back() {
    let dir = disk_tempdir();
    let files = member_files(dir.path(), "r6", 5);
    let stdout = ok(&create("6", &["--consistency-policy", "ppl"], &files));
    assert!(stdout.contains("partial parity log: 1 MiB"), "{stdout}");
    assert!(
        stdout.contains("kernel md cannot assemble a RAID6 while its consistency policy is ppl"),
        "{stdout}"
    );
    assert!(
        stdout.contains("ferroraid grow --consistency-policy resync MEMBERS..."),
        "{stdout}"
    );
    let mdadm = mdadm();
    for f in &files {
        let (text, ours) = examine_empty_ppl(f);
        assert_eq!(ours["Feature Map"], "0x1000400", "{text}");
        assert_eq!(
            ours["Features"], "MD_FEATURE_PPL, FERRORAID_FEATURE_RAID6_PPL",
            "{text}"
        );
        assert_eq!(ours["Raid Level"], "raid6", "{text}");
        assert!(text.contains("ferroraid : can serve this array"), "{text}");
        assert!(!text.contains("PPL Error"), "{text}");
        // mdadm reads the member (kernel md would refuse to assemble it: unknown bit).
        let Some(mdadm) = &mdadm else { continue };
        let (md_text, md) = mdadm_examine(mdadm, f);
        assert_eq!(md["Feature Map"], "0x1000400", "{md_text}");
        assert_eq!(md["PPL"], ours["PPL"], "{md_text}");
        assert!(md["Checksum"].ends_with("- correct"), "{md_text}");
    }
    let (_, v) = examine_json(&files[..1]);
    assert_eq!(
        v[0]["features"],
        serde_json::json!(["MD_FEATURE_PPL", "FERRORAID_FEATURE_RAID6_PPL"])
    );
    assert_eq!(v[0]["ppl"]["mode"], "multiple");
    assert_eq!(v[0]["supported"], true);
    // Leave something in member 0's area: the switch back must re-initialise it.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&files[0])
        .unwrap()
        .write_all_at(&[0xa5; 8192], AREA_AT)
        .unwrap();

    // ppl -> resync: what md assembles.
    let stdout = ok(&grow("resync", &files));
    assert!(
        stdout.contains("consistency policy ppl -> resync on 5 devices, events 1"),
        "{stdout}"
    );
    assert!(stdout.contains("kernel md can assemble it now"), "{stdout}");
    assert!(
        stdout.contains("mdadm --grow --bitmap=internal"),
        "{stdout}"
    );
    for f in &files {
        let sb = superblock(f);
        assert_eq!((sb.feature_map, sb.bitmap_offset), (0, 0));
        assert_eq!((sb.events, sb.resync_offset), (1, MAX_SECTOR));
        assert_eq!((sb.data_offset, sb.bblog_offset), (4096, 2056));
        let (text, ours) = examine(f);
        assert_eq!(ours["Feature Map"], "0x0", "{text}");
        assert_eq!(ours["Events"], "1", "{text}");
        assert!(!text.contains("PPL"), "{text}");
        assert!(!text.contains("Features"), "{text}");
        assert!(text.contains("ferroraid : can serve this array"), "{text}");
        let Some(mdadm) = &mdadm else { continue };
        let (md_text, md) = mdadm_examine(mdadm, f);
        for (k, want) in [
            ("Feature Map", "0x0"),
            ("Raid Level", "raid6"),
            ("Raid Devices", "5"),
            ("Events", "1"),
            ("State", "clean"),
            ("Data Offset", "4096 sectors"),
        ] {
            assert_eq!(md.get(k).map(String::as_str), Some(want), "{k}:\n{md_text}");
        }
        assert!(md["Checksum"].ends_with("- correct"), "{md_text}");
        assert!(!md_text.contains("PPL"), "{md_text}");
    }

    // resync -> ppl: the areas are written again as at create.
    let stdout = ok(&grow("ppl", &files));
    assert!(
        stdout.contains("consistency policy resync -> ppl on 5 devices, events 2"),
        "{stdout}"
    );
    assert!(stdout.contains("kernel md cannot assemble"), "{stdout}");
    assert!(
        stdout.contains("partial parity log areas written (2048 sectors at offset 8 sectors"),
        "{stdout}"
    );
    for f in &files {
        let sb = superblock(f);
        assert_eq!(
            (sb.feature_map, sb.ppl(), sb.events),
            (0x0100_0400, (8, 2048), 2)
        );
        let (text, ours) = examine_empty_ppl(f);
        assert_eq!(ours["Feature Map"], "0x1000400", "{text}");
        assert!(text.contains("ferroraid : can serve this array"), "{text}");
    }
    let mut area = vec![0u8; AREA_BYTES];
    std::fs::File::open(&files[0])
        .unwrap()
        .read_exact_at(&mut area, AREA_AT)
        .unwrap();
    assert!(
        area[4096..].iter().all(|&b| b == 0),
        "area not re-initialised"
    );
}

/// Every refusal says why, exits 1 (64 for a usage error) and writes nothing.
#[test]
fn grow_refusals_write_nothing() {
    let dir = disk_tempdir();
    let files = member_files(dir.path(), "g", 5);
    ok(&create("6", &["--consistency-policy", "ppl"], &files));
    let other = member_files(dir.path(), "o", 4);
    ok(&create("6", &["--consistency-policy", "bitmap"], &other));
    let blank = member_files(dir.path(), "b", 1);
    let all: Vec<PathBuf> = files.iter().chain(&other).cloned().collect();
    let snapshot = |fs: &[PathBuf]| -> Vec<Vec<u8>> {
        fs.iter()
            .map(|f| {
                let mut b = vec![0u8; 4096 + AREA_BYTES];
                std::fs::File::open(f)
                    .unwrap()
                    .read_exact_at(&mut b, 4096)
                    .unwrap();
                b
            })
            .collect()
    };
    let before = snapshot(&all);
    let with = |extra: &[PathBuf]| -> Vec<PathBuf> { files.iter().chain(extra).cloned().collect() };
    let twice = with(&files[..1]);
    let foreign: Vec<PathBuf> = files[..4].iter().chain(&other[..1]).cloned().collect();
    let blank_too = with(&blank);
    // (policy, devices, what the error says, exit status)
    let cases: [(&str, &[PathBuf], &str, i32); 8] = [
        (
            "resync",
            &files[..4],
            "no device given for role 4: give every member",
            1,
        ),
        ("ppl", &files, "consistency policy is already ppl", 1),
        ("resync", &twice, "are the same device", 1),
        ("resync", &foreign, "belongs to array", 1),
        (
            "resync",
            &other,
            "current consistency policy is bitmap, cannot change to resync",
            1,
        ),
        (
            "ppl",
            &other,
            "current consistency policy is bitmap, cannot change to ppl",
            1,
        ),
        ("resync", &blank_too, "no usable md superblock", 1),
        ("bitmap", &files, "mdadm --grow --bitmap=internal", 64),
    ];
    for (policy, devs, needle, code) in cases {
        let out = grow(policy, devs);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{policy} {devs:?}: {err}");
        assert!(err.contains(needle), "{policy} {devs:?}: {err}");
        assert_eq!(snapshot(&all), before, "{policy} {devs:?} wrote");
    }

    // A dirty array: assemble and stop it cleanly first.
    for f in &files {
        let mut sb = superblock(f);
        sb.resync_offset = 0;
        write_superblock(f, &sb).unwrap();
    }
    let dirty = snapshot(&files);
    let out = grow("resync", &files);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("not shut down cleanly"), "{err}");
    assert!(err.contains("stop it cleanly first"), "{err}");
    assert_eq!(snapshot(&files), dirty);

    // A member one generation behind (a stop that did not reach it), named.
    for f in &files {
        let mut sb = superblock(f);
        sb.resync_offset = MAX_SECTOR;
        sb.events = if f == &files[2] { 0 } else { 1 };
        write_superblock(f, &sb).unwrap();
    }
    let out = grow("resync", &files);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "{}: superblock 2 (slot 2) is at events 0",
            files[2].display()
        )),
        "{err}"
    );
}

/// A member too small for the data area its superblock gives is refused before any
/// member is written (the others were switched before the write to it failed, leaving the
/// members with different policies and generations).
#[test]
fn grow_checks_every_member_before_writing_one() {
    let dir = disk_tempdir();
    let files = member_files(dir.path(), "t", 5);
    ok(&create("6", &["--consistency-policy", "ppl"], &files));
    std::fs::OpenOptions::new()
        .write(true)
        .open(&files[4])
        .and_then(|f| f.set_len(3 << 20))
        .unwrap();
    let before: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    let out = grow("resync", &files);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&files[4].display().to_string()) && err.contains("within the device"),
        "{err}"
    );
    let after: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    assert!(before == after, "grow wrote a member");
}
