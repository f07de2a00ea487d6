//! `ferroraid examine` on member files whose superblocks ferroraid wrote, held against
//! `mdadm --examine` of the same files. Without mdadm the comparison is skipped (with a
//! message) unless `FERRORAID_REQUIRE_MDADM=1` (CI sets it); the error cases always run.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::{
    create, disk_tempdir, examine_empty_ppl, examine_json, ferroraid, key_values, mdadm,
    mdadm_examine, member_files, MEMBER_BYTES,
};
use drivers::metadata_io::write_superblock;
use engine::geometry::{Geometry, Layout, Level};
use engine::metadata::{next_generation, MdTime, NewArray, Resync, Superblock, Update, Uuid};
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

/// A RAID6 (right-asymmetric, 128 KiB chunks) of six members plus a spare, written to
/// sparse files; then member 2 fails (generation 1, dirty), so the survivors record it
/// faulty and member 2 keeps generation 0.
fn raid6_files(dir: &Path) -> (Vec<PathBuf>, Vec<Superblock>) {
    let files: Vec<PathBuf> = (0..7)
        .map(|i| {
            let p = dir.join(format!("member{i}.img"));
            std::fs::File::create(&p)
                .and_then(|f| f.set_len(MEMBER_BYTES))
                .unwrap();
            p
        })
        .collect();
    let g = Geometry::new(Level::Raid6, Layout::RightAsymmetric, 6, 128 << 10, 512).unwrap();
    let mut a = NewArray::new(
        g,
        Uuid::random(&mut ChaCha8Rng::seed_from_u64(7)),
        "examined",
        Some("testhost"),
        MdTime::new(1_700_000_000, 0),
    )
    .unwrap();
    a.clean = true;
    let sbs = a
        .superblocks(
            &vec![MEMBER_BYTES / 512; files.len()],
            &mut ChaCha8Rng::seed_from_u64(8),
        )
        .unwrap();
    for (f, sb) in files.iter().zip(&sbs) {
        write_superblock(f, sb).unwrap();
    }
    let next = next_generation(
        &sbs,
        &Update {
            utime: MdTime::new(1_700_000_100, 0),
            failed: vec![2],
            resync: Some(Resync::Dirty),
            roles: Vec::new(),
            recovery: Vec::new(),
            features: Vec::new(),
        },
    )
    .unwrap();
    let mut now = sbs.clone();
    for (i, sb) in next.into_iter().enumerate() {
        if let Some(sb) = sb {
            write_superblock(&files[i], &sb).unwrap();
            now[i] = sb;
        }
    }
    (files, now)
}

#[test]
fn json_agrees_with_mdadm() {
    let dir = disk_tempdir();
    let (files, sbs) = raid6_files(dir.path());
    let (out, entries) = examine_json(&files);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(entries.len(), files.len());
    // What the superblocks say, independently of mdadm.
    for (i, (e, sb)) in entries.iter().zip(&sbs).enumerate() {
        assert_eq!(e["device"], files[i].to_str().unwrap());
        assert_eq!(e["array_uuid"], sb.set_uuid.to_string());
        assert_eq!(e["name"], "testhost:examined");
        assert_eq!(e["level"], 6);
        assert_eq!(e["layout"], "right-asymmetric");
        assert_eq!(e["chunk_bytes"], 128 << 10);
        assert_eq!(e["raid_devices"], 6);
        assert_eq!(e["data_offset_bytes"], sb.data_offset * 512);
        assert_eq!(e["data_size_bytes"], sb.data_size * 512);
        assert_eq!(e["device_uuid"], sb.device_uuid.to_string());
        assert_eq!(e["feature_map"], 0);
        assert_eq!(e["checksum_ok"], true);
        assert_eq!(e["supported"], true);
        let (events, state, array_state) = if i == 2 {
            (0, "clean", "AAAAAA")
        } else {
            (1, "active", "AA.AAA")
        };
        assert_eq!(e["events"], events, "{e}");
        assert_eq!(e["state"], state, "{e}");
        assert_eq!(e["array_state"], array_state, "{e}");
        let role = if i == 6 {
            Value::from("spare")
        } else {
            Value::from(i)
        };
        assert_eq!(e["role"], role, "{e}");
    }
    let Some(mdadm) = mdadm() else { return };
    for (f, e) in files.iter().zip(&entries) {
        let (text, m) = mdadm_examine(&mdadm, f);
        let md = |k: &str| {
            m.get(k)
                .unwrap_or_else(|| panic!("mdadm printed no {k:?}:\n{text}"))
                .as_str()
        };
        let s = |k: &str| e[k].as_str().unwrap().to_string();
        let n = |k: &str| e[k].as_u64().unwrap();
        assert_eq!(md("Array UUID"), s("array_uuid"), "{text}");
        assert_eq!(md("Name"), s("name"), "{text}");
        assert_eq!(md("Raid Level"), format!("raid{}", n("level")), "{text}");
        assert_eq!(md("Raid Devices"), n("raid_devices").to_string(), "{text}");
        assert_eq!(md("Layout"), s("layout"), "{text}");
        assert_eq!(
            md("Chunk Size"),
            format!("{}K", n("chunk_bytes") / 1024),
            "{text}"
        );
        assert_eq!(
            md("Data Offset"),
            format!("{} sectors", n("data_offset_bytes") / 512),
            "{text}"
        );
        assert!(
            md("Avail Dev Size").starts_with(&format!("{} sectors", n("data_size_bytes") / 512)),
            "{text}"
        );
        assert!(
            md("Array Size").starts_with(&format!("{} KiB", n("array_size_bytes") / 1024)),
            "{text}"
        );
        assert_eq!(md("Events"), n("events").to_string(), "{text}");
        assert_eq!(md("State"), s("state"), "{text}");
        assert_eq!(md("Device UUID"), s("device_uuid"), "{text}");
        assert_eq!(
            md("Feature Map"),
            format!("0x{:x}", n("feature_map")),
            "{text}"
        );
        assert_eq!(
            md("Checksum"),
            format!("{:x} - correct", n("checksum")),
            "{text}"
        );
        let role = match &e["role"] {
            Value::Number(r) => format!("Active device {r}"),
            Value::String(r) => r.clone(),
            other => panic!("role {other}"),
        };
        assert_eq!(md("Device Role"), role, "{text}");
        assert!(
            md("Array State").starts_with(&format!("{} (", s("array_state"))),
            "{text}"
        );
    }
}

/// The human output repeats mdadm's key lines verbatim.
#[test]
fn human_output_has_mdadms_key_lines() {
    let dir = disk_tempdir();
    let (files, _) = raid6_files(dir.path());
    let out = ferroraid(&[
        "examine",
        files[0].to_str().unwrap(),
        files[6].to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with(&format!("{}:\n", files[0].display())),
        "{text}"
    );
    assert!(
        text.contains(&format!("\n{}:\n", files[6].display())),
        "{text}"
    );
    let Some(mdadm) = mdadm() else { return };
    let blocks: Vec<&str> = text.split(&format!("{}:\n", files[6].display())).collect();
    for (f, block) in [(&files[0], blocks[0]), (&files[6], blocks[1])] {
        let ours = key_values(block);
        let (md_text, md) = mdadm_examine(&mdadm, f);
        for k in [
            "Magic",
            "Version",
            "Feature Map",
            "Array UUID",
            "Name",
            "Raid Level",
            "Raid Devices",
            "Data Offset",
            "Super Offset",
            "State",
            "Device UUID",
            "Checksum",
            "Events",
            "Layout",
            "Chunk Size",
            "Device Role",
            "Array State",
        ] {
            assert_eq!(
                ours.get(k),
                md.get(k),
                "{k}: ours\n{block}\nmdadm's\n{md_text}"
            );
        }
        let avail = |m: &HashMap<String, String>| {
            m["Avail Dev Size"].split(" (").next().unwrap().to_string()
        };
        assert_eq!(avail(&ours), avail(&md));
    }
}

#[test]
fn bad_devices_are_reported_and_the_rest_printed() {
    let dir = disk_tempdir();
    let (files, _) = raid6_files(dir.path());
    let blank = dir.path().join("blank.img");
    std::fs::File::create(&blank)
        .and_then(|f| f.set_len(MEMBER_BYTES))
        .unwrap();
    let tiny = dir.path().join("tiny.img");
    std::fs::write(&tiny, b"too small").unwrap();
    let missing = dir.path().join("missing.img");
    // A superblock whose checksum no longer matches (one byte of the name changed).
    let corrupt = dir.path().join("corrupt.img");
    std::fs::copy(&files[1], &corrupt).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&corrupt)
            .unwrap();
        f.write_all_at(b"X", 4096 + 32).unwrap();
    }
    let list = vec![
        files[0].clone(),
        blank.clone(),
        tiny.clone(),
        missing.clone(),
        corrupt.clone(),
        files[3].clone(),
    ];
    let (out, entries) = examine_json(&list);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(entries.len(), 6);
    assert_eq!(entries[0]["role"], 0);
    assert_eq!(entries[5]["role"], 3);
    let b = blank.display();
    let want = [
        (1, format!("{b}: no md superblock: magic is 0x00000000")),
        (2, format!("{}: device is 9 bytes", tiny.display())),
        (
            3,
            format!("{}: open: No such file or directory", missing.display()),
        ),
    ];
    for (i, msg) in &want {
        let e = entries[*i]["error"].as_str().unwrap();
        assert!(e.starts_with(msg.as_str()), "{e}");
        assert!(stderr.contains(msg.as_str()), "{stderr}");
    }
    // The corrupt superblock is shown, its checksum flagged, as mdadm does.
    let c = &entries[4];
    assert_eq!(c["checksum_ok"], false, "{c}");
    assert_eq!(c["name"], "Xesthost:examined");
    assert!(
        stderr.contains(&format!(
            "{}: bad superblock checksum: stored 0x{:08x}, expected 0x{:08x}",
            corrupt.display(),
            c["checksum"].as_u64().unwrap(),
            c["checksum_expected"].as_u64().unwrap()
        )),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 4, "{stderr}");
    if let Some(mdadm) = mdadm() {
        let (text, m) = mdadm_examine(&mdadm, &corrupt);
        assert_eq!(
            m["Checksum"],
            format!(
                "{:x} - expected {:x}",
                c["checksum"].as_u64().unwrap(),
                c["checksum_expected"].as_u64().unwrap()
            ),
            "{text}"
        );
    }

    // Human output: the good devices (and the corrupt one) printed, the rest on stderr.
    let args: Vec<&str> = std::iter::once("examine")
        .chain(list.iter().map(|p| p.to_str().unwrap()))
        .collect();
    let out = ferroraid(&args);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("{}:\n", files[0].display())),
        "{text}"
    );
    assert!(
        text.contains(&format!("{}:\n", files[3].display())),
        "{text}"
    );
    assert!(text.contains(" - expected "), "{text}");
    assert!(!text.contains(&format!("{b}:")), "{text}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no md superblock"));

    // Only a blank device: non-zero, nothing on stdout in human mode.
    let out = ferroraid(&["examine", blank.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    // No device at all is a usage error.
    let out = ferroraid(&["examine"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("<DEV>"));
}

/// A RAID5 member with mdadm's PPL area (2048 sectors at +8, `MD_FEATURE_PPL`) holding
/// the empty header: ferroraid's "PPL" line is mdadm's, and it reads the header.
#[test]
fn ppl_line_agrees_with_mdadm() {
    use engine::metadata::ppl::{PplHeader, MDADM_PPL_OFFSET_SECTORS, MDADM_PPL_SIZE_SECTORS};
    use engine::metadata::Feature;
    use std::os::unix::fs::FileExt;

    let dir = disk_tempdir();
    let file = dir.path().join("ppl.img");
    let f = std::fs::File::create(&file).unwrap();
    f.set_len(MEMBER_BYTES).unwrap();
    let g = Geometry::new(Level::Raid5, Layout::LeftSymmetric, 3, 64 << 10, 512).unwrap();
    let a = NewArray::new(
        g,
        Uuid::random(&mut ChaCha8Rng::seed_from_u64(9)),
        "ppl",
        Some("testhost"),
        MdTime::new(1_700_000_000, 0),
    )
    .unwrap();
    let mut sb = a
        .superblocks(&[MEMBER_BYTES / 512; 3], &mut ChaCha8Rng::seed_from_u64(10))
        .unwrap()
        .remove(0);
    sb.feature_map = Feature::Ppl.bit();
    sb.set_ppl(MDADM_PPL_OFFSET_SECTORS, MDADM_PPL_SIZE_SECTORS);
    // mdadm's data offset with a PPL: ROUND_UP(24 + 2048 + headroom, 2048) sectors.
    let grow = 4096u64.saturating_sub(sb.data_offset);
    sb.data_offset += grow;
    sb.data_size -= grow;
    sb.size = sb.size.min(sb.data_size) / 128 * 128;
    write_superblock(&file, &sb).unwrap();
    let header = PplHeader::empty(&sb.set_uuid).encode().unwrap();
    f.write_all_at(&header, 16 * 512).unwrap();

    let (text, ours) = examine_empty_ppl(&file);
    // A RAID5 with md's PPL is served (issue 19).
    assert!(text.contains("ferroraid : can serve this array"), "{text}");
    let Some(mdadm) = mdadm() else { return };
    let (md_text, md) = mdadm_examine(&mdadm, &file);
    for k in ["PPL", "Feature Map", "Raid Level", "Data Offset"] {
        assert_eq!(
            ours.get(k),
            md.get(k),
            "{k}: ours\n{text}\nmdadm's\n{md_text}"
        );
    }
}

/// `ferroraid create --consistency-policy ppl` lays a RAID5 out as `mdadm --create
/// --consistency-policy=ppl` does: mdadm reads every member, with its PPL line, feature
/// bit, data offset (`ROUND_UP(24 + 2048 + headroom, 2048)`: 4096 sectors here) and
/// bad-block log after the area; `ferroraid examine` finds the empty record; the area is
/// zero but for that header. A second create without --force is refused.
#[test]
fn create_with_ppl_policy_is_mdadms_layout() {
    use engine::metadata::ppl::PplHeader;
    use std::os::unix::fs::FileExt;

    let dir = disk_tempdir();
    let files = member_files(dir.path(), "ppl", 4);
    let out = create("5", &["--consistency-policy", "ppl"], &files);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("data offset 2097152 bytes"), "{stdout}");
    assert!(stdout.contains("partial parity log: 1 MiB"), "{stdout}");

    let mdadm = mdadm();
    for f in &files {
        let area = drivers::metadata_io::read_superblock_area(f).unwrap();
        let sb = Superblock::decode(&area).unwrap();
        let mut bytes = vec![0u8; 2048 * 512];
        std::fs::File::open(f)
            .unwrap()
            .read_exact_at(&mut bytes, 16 * 512)
            .unwrap();
        let header = PplHeader::empty(&sb.set_uuid).encode().unwrap();
        assert_eq!(&bytes[..4096], &header[..], "{}", f.display());
        assert!(bytes[4096..].iter().all(|&b| b == 0), "{}", f.display());

        let (text, ours) = examine_empty_ppl(f);
        assert!(!text.contains("PPL Error"), "{text}");
        let Some(mdadm) = &mdadm else { continue };
        let (md_text, md) = mdadm_examine(mdadm, f);
        let expect = [
            ("PPL", "2048 sectors at offset 8 sectors from superblock"),
            ("Feature Map", "0x400"),
            ("Data Offset", "4096 sectors"),
            ("Super Offset", "8 sectors"),
            ("Raid Level", "raid5"),
            ("Checksum", ""),
        ];
        for (k, v) in expect {
            let got = md
                .get(k)
                .unwrap_or_else(|| panic!("mdadm printed no {k}:\n{md_text}"));
            if k == "Checksum" {
                assert!(got.ends_with("- correct"), "{md_text}");
            } else {
                assert_eq!(got, v, "{k}:\n{md_text}");
            }
            assert_eq!(
                ours.get(k),
                md.get(k),
                "{k}: ours\n{text}\nmdadm's\n{md_text}"
            );
        }
        assert!(
            md.get("Bad Block Log")
                .is_some_and(|v| v.contains("at offset 2056 sectors")),
            "{md_text}"
        );
        // mdadm 4.2's --examine prints no consistency policy (only --detail does).
        assert!(!md_text.contains("Consistency Policy"), "{md_text}");
    }

    // Still an md member: a second create must be asked to overwrite it.
    let out = create("5", &[], &files);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already carries an md superblock"), "{err}");
}

/// What mdadm refuses is refused with its reason, before any member is written:
/// PPL or resync with a bitmap (also on RAID6, where ferroraid allows PPL), bitmap
/// without one, md's policies ferroraid has no use for. `resync` writes no bitmap and
/// `bitmap` one, on an array small enough to get none by default.
#[test]
fn consistency_policy_refusals_and_resync_bitmap() {
    let dir = disk_tempdir();
    let files = member_files(dir.path(), "pol", 4);
    // (level, options, what the error says, exit status: 1 refused, 64 usage error)
    let cases: [(&str, &[&str], &str, i32); 7] = [
        (
            "6",
            &["ppl", "--bitmap", "internal"],
            "consistency policy ppl is not compatible with an internal write-intent bitmap",
            1,
        ),
        (
            "5",
            &["ppl", "--bitmap", "internal"],
            "consistency policy ppl is not compatible with an internal write-intent bitmap",
            1,
        ),
        (
            "5",
            &["ppl", "--bitmap-chunk", "1M"],
            "not compatible with an internal write-intent bitmap",
            1,
        ),
        (
            "6",
            &["resync", "--bitmap", "internal"],
            "consistency policy resync is not compatible",
            1,
        ),
        (
            "6",
            &["bitmap", "--bitmap", "none"],
            "consistency policy bitmap needs an internal write-intent bitmap",
            1,
        ),
        ("6", &["journal"], "journal device", 64),
        ("6", &["none"], "without redundancy", 64),
    ];
    for (level, extra, needle, code) in cases {
        let mut args = vec!["--consistency-policy"];
        args.extend_from_slice(extra);
        let out = create(level, &args, &files);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        for f in &files {
            let area = drivers::metadata_io::read_superblock_area(f).unwrap();
            assert!(
                area.iter().all(|&b| b == 0),
                "{args:?}: {} was written",
                f.display()
            );
        }
    }

    let out = create("6", &["--consistency-policy", "resync"], &files);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_, v) = examine_json(&files[..1]);
    let text = v[0].to_string();
    let sb = Superblock::decode(&drivers::metadata_io::read_superblock_area(&files[0]).unwrap())
        .unwrap();
    assert_eq!((sb.feature_map, sb.data_offset), (0, 2048), "{text}");
    if let Some(mdadm) = mdadm() {
        let (md_text, md) = mdadm_examine(&mdadm, &files[0]);
        assert_eq!(md.get("Feature Map").map(String::as_str), Some("0x0"));
        assert!(!md_text.contains("Internal Bitmap"), "{md_text}");
        assert!(!md_text.contains("PPL"), "{md_text}");
    }
    let out = create("6", &["--consistency-policy", "bitmap", "--force"], &files);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("internal write-intent bitmap"));
    let sb = Superblock::decode(&drivers::metadata_io::read_superblock_area(&files[0]).unwrap())
        .unwrap();
    assert_eq!(sb.feature_map, 0x1);
}

/// A member rebuilt only part-way (`MD_FEATURE_RECOVERY_OFFSET`): `ferroraid examine`
/// prints its "Recovery Offset : N sectors" line as `mdadm --examine` does
/// (`examine_super1`), and `--json` gives it as `recovery_offset_sectors`; an in-sync
/// member has neither.
#[test]
fn recovery_offset_line_agrees_with_mdadm() {
    let dir = disk_tempdir();
    let (files, mut sbs) = raid6_files(dir.path());
    sbs[4].feature_map |= engine::metadata::Feature::RecoveryOffset.bit();
    sbs[4].recovery_offset = 24_576;
    write_superblock(&files[4], &sbs[4]).unwrap();
    let (_, entries) = examine_json(&files[3..5]);
    assert_eq!(entries[0]["recovery_offset_sectors"], Value::Null);
    assert_eq!(entries[1]["recovery_offset_sectors"], 24_576);
    let mut texts = Vec::new();
    for (file, want) in [(&files[3], None), (&files[4], Some("24576 sectors"))] {
        let out = ferroraid(&["examine", file.to_str().unwrap()]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let ours = key_values(&text);
        assert_eq!(
            ours.get("Recovery Offset").map(String::as_str),
            want,
            "{text}"
        );
        texts.push((file, text, ours));
    }
    let Some(mdadm) = mdadm() else { return };
    for (file, text, ours) in texts {
        let (md_text, md) = mdadm_examine(&mdadm, file);
        assert_eq!(
            ours.get("Recovery Offset"),
            md.get("Recovery Offset"),
            "ours\n{text}\nmdadm's\n{md_text}"
        );
    }
}
