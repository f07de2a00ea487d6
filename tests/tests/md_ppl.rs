//! md's Partial Parity Log between Linux md and ferroraid, both ways, across a crash
//! (issue 19, "Kernel md interoperability").
//!
//! `tests/qemu/md-ppl.sh` (see `docs/TESTING.md`), in one boot of the rig's guest:
//!
//! - **ferroraid → md**: a RAID5 made by `ferroraid create --consistency-policy ppl`, served,
//!   written with a seeded pattern and then killed (`kill -9`) under small random NBD
//!   writes, so its members are dirty with ferroraid's PPL records live, is assembled by
//!   the kernel's md, which must run its PPL recovery (its own debug line `ppl_load:
//!   return: 0 mismatch_count: 0 recovered_entries: N`, N > 0), come up clean without a
//!   resync (`resync_start` none, `consistency_policy` ppl), find `mismatch_cnt` 0 in a
//!   `check`, and read back the pattern outside the crash window;
//! - **md → ferroraid**: md creates a PPL RAID5, writes its pattern, and the guest crashes
//!   (sysrq b) under small random O_DIRECT writes; `ferroraid examine` finds md's newest
//!   record with entries, `ferroraid serve` recovers (entries > 0, "no resync needed") and
//!   reads back the pattern outside the window (each window block old or new); with one
//!   member removed, `serve --run` recovers and reads back the pattern outside the window;
//! - **ferroraid's RAID6 PPL** (its own extension): a RAID6 made by `ferroraid create
//!   --consistency-policy ppl`, written and stopped cleanly, is refused by md (the
//!   ferroraid feature bit is one md does not know: `Invalid argument`); a copy switched
//!   with `ferroraid grow --consistency-policy resync` is assembled by md clean, without a
//!   resync, `check` finds `mismatch_cnt` 0, and md reads back what ferroraid wrote.
//!
//! This test holds the script's summary to that and has the oracle
//! (`../shared/oracle/raidref.py`) verify parity on every stripe of the members ferroraid
//! recovered and extract what ferroraid read back over NBD (the degraded copy with the lost
//! member rebuilt by the oracle). The result is cached in `target/tmp/md-ppl`, keyed on the
//! scripts, the ferroraid binary and mdadm. Without `qemu-system-x86_64`, `mdadm`,
//! `nbdcopy`, python3-libnbd or a kernel for the rig it prints `SKIPPED md_ppl: why` and
//! passes, unless `FERRORAID_REQUIRE_QEMU=1`.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use ferroraid_tests::{first_difference, number_after, repo_root, summary_line as line, Oracle};

/// Whether some python3 the script would use has libnbd's binding.
fn python_nbd() -> bool {
    ["python3", "/usr/bin/python3"].iter().any(|p| {
        Command::new(p)
            .args(["-c", "import nbd"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

#[test]
fn md_and_ferroraid_recover_each_others_ppl_after_a_crash() {
    let qemu = repo_root().join("tests/qemu");
    let script = qemu.join("md-ppl.sh");
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("md-ppl");
    if let Some(why) = ferroraid_tests::qemu_rig_unavailable(&ferroraid_tests::RIG_TOOLS_MD_NBD) {
        ferroraid_tests::skip_without_rig("md_ppl", &why);
        return;
    }
    if !python_nbd() {
        ferroraid_tests::skip_without_rig(
            "md_ppl",
            "no python3 with the nbd module (apt-get install python3-libnbd)",
        );
        return;
    }
    let start = Instant::now();
    let out =
        ferroraid_tests::run_rig_script(&script, &out_dir, Some(ferroraid_tests::ferroraid_bin()));
    let summary = ferroraid_tests::read_rig_summary(&out_dir);

    // ferroraid -> md: md recovered from ferroraid's log, no resync, parity consistent.
    let fr = line(&summary, "fr2md");
    for want in [
        "array_state=clean",
        "consistency_policy=ppl",
        "resync_start=none",
        "ppl_load return: 0 mismatch_count: 0 recovered_entries: ",
        "mismatch_cnt 0;",
        " 0 other",
    ] {
        assert!(fr.contains(want), "fr2md: no {want:?} in {fr:?}");
    }
    let recovered = number_after(fr, "recovered_entries: ").unwrap_or(0);
    assert!(recovered > 0, "fr2md: md recovered no entry: {fr:?}");
    let logged = number_after(fr, "newest PPL record: ").unwrap_or(0);
    assert!(
        logged > 0,
        "fr2md: ferroraid's newest record was empty: {fr:?}"
    );

    // md -> ferroraid: ferroraid recovered from md's log, no resync.
    let r6 = line(&summary, "fr6");
    for want in [
        "md refused it",
        "consistency_policy=resync resync_start=none",
        "mismatch_cnt 0",
        "read back equal",
    ] {
        assert!(r6.contains(want), "fr6: no {want:?} in {r6:?}");
    }
    let md = line(&summary, "md2fr");
    assert!(
        number_after(md, "newest PPL record: ").unwrap_or(0) > 0,
        "md2fr: md's newest record was empty: {md:?}"
    );
    assert!(
        number_after(md, "entries=").unwrap_or(0) > 0,
        "md2fr: ferroraid recovered no entry: {md:?}"
    );
    for want in ["mismatches=0", "no resync needed", " 0 other"] {
        assert!(md.contains(want), "md2fr: no {want:?} in {md:?}");
    }
    let dg = line(&summary, "md2fr-degraded");
    assert!(
        dg.contains("mismatches=0"),
        "md2fr-degraded: ferroraid found logs it could not trust: {dg:?}"
    );

    if let Some(oracle) = Oracle::locate_or_skip("md_ppl") {
        check_with_oracle(&oracle, &out_dir.join("md2fr"));
    }
    ferroraid_tests::print_rig_summary("md_ppl", start, &out_dir, &out, &summary);
}

/// The oracle on md's members after ferroraid's recovery: parity consistent on every
/// stripe, and the logical image equal to what ferroraid served; on the degraded copy (the
/// lost member rebuilt by the oracle from the others) equal to what `serve --run` served.
fn check_with_oracle(oracle: &Oracle, dir: &Path) {
    let geometry: BTreeMap<String, String> = fs::read_to_string(dir.join("geometry.txt"))
        .unwrap_or_else(|e| panic!("{}/geometry.txt: {e}", dir.display()))
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let get = |k: &str| -> u64 {
        geometry
            .get(k)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("geometry.txt has no number {k}: {geometry:?}"))
    };
    let (members, lost, size) = (get("members"), get("lost"), get("size"));
    let common = [
        "--level".to_owned(),
        get("level").to_string(),
        "--layout".to_owned(),
        geometry["layout"].clone(),
        "--chunk".to_owned(),
        get("chunk").to_string(),
        "--data-offset".to_owned(),
        get("data_offset").to_string(),
    ];
    let images = |sub: &str, missing: Option<u64>| -> Vec<String> {
        (0..members)
            .map(|i| {
                if Some(i) == missing {
                    "missing".to_owned()
                } else {
                    dir.join(sub)
                        .join(format!("d{i}.img"))
                        .display()
                        .to_string()
                }
            })
            .collect()
    };
    let run = |cmd: &str, imgs: Vec<String>, extra: &[String]| -> String {
        let mut args = vec![cmd.to_owned()];
        args.extend(imgs);
        args.extend(common.iter().cloned());
        args.extend(extra.iter().cloned());
        oracle
            .run_ok(&args)
            .unwrap_or_else(|e| panic!("md2fr: {e}"))
    };
    let verdict = run("verify", images("", None), &[]);
    assert!(
        verdict.contains("mismatches 0"),
        "md2fr: the oracle finds parity inconsistent after ferroraid's PPL recovery: {verdict}"
    );
    for (sub, missing, served) in [
        ("", None, "readback.bin"),
        ("degraded", Some(lost), "readback-degraded.bin"),
    ] {
        let extract = dir.join("oracle-extract.bin");
        run(
            "extract",
            images(sub, missing),
            &["--out".to_owned(), extract.display().to_string()],
        );
        let mut want = fs::read(&extract).unwrap_or_else(|e| panic!("{}: {e}", extract.display()));
        let _ = fs::remove_file(&extract);
        want.truncate(size as usize);
        let got = fs::read(dir.join(served)).unwrap_or_else(|e| panic!("{served}: {e}"));
        if let Some(d) = first_difference(&got, &want) {
            panic!("md2fr: ferroraid served ({served}) other data than the oracle extracts: {d}");
        }
    }
    eprintln!(
        "md_ppl: oracle: {} of md's recovered members; ferroraid's readback = the oracle's extract \
         (all {members} members, and member {lost} lost)",
        verdict.trim()
    );
}
