//! The `ferroraid` binary as a user runs it.

use std::process::Command;

fn ferroraid(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ferroraid"))
        .args(args)
        .output()
        .expect("run ferroraid")
}

fn oracle() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/oracle/raidref.py")
}

/// The demo builds, verifies, degrades and reconstructs an array, and the member images it
/// leaves behind pass the independent oracle.
#[test]
fn demo_images_pass_the_oracle() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    for (level, layout, members, fail) in [
        ("6", "left-asymmetric", "7", "0,4"),
        ("5", "right-symmetric", "4", "2"),
    ] {
        let out = ferroraid(&[
            "selftest",
            "--dir",
            d,
            "--level",
            level,
            "--layout",
            layout,
            "--members",
            members,
            "--chunk",
            "16K",
            "--member-size",
            "2M",
            "--fail",
            fail,
        ]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "demo failed: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("0 mismatches"), "{stdout}");
        assert!(
            stdout.contains("read back every logical byte correctly"),
            "{stdout}"
        );
        let n: usize = members.parse().unwrap();
        let mut cmd = Command::new("python3");
        cmd.arg(oracle()).arg("verify");
        for i in 0..n {
            cmd.arg(dir.path().join(format!("member-{i}.img")));
        }
        cmd.args(["--level", level, "--layout", layout, "--chunk", "16384"]);
        let v = cmd.output().expect("run python3");
        assert!(
            v.status.success(),
            "oracle rejected demo images: {}",
            String::from_utf8_lossy(&v.stdout)
        );
    }
}

#[test]
fn bad_input_gets_a_clear_error() {
    for (args, want) in [
        (vec!["selftest", "--members", "300"], "4 to 257 members"),
        (vec!["selftest", "--chunk", "3K"], "power of two"),
        (vec!["selftest", "--fail", "1,2,3"], "survives only 2"),
        (
            vec!["selftest", "--level", "5", "--fail", "9"],
            "does not exist",
        ),
        (vec!["layout", "--layout", "diagonal"], "left-symmetric (2)"),
        (vec!["map", "--chunk", "64Q", "0"], "not a byte size"),
        (vec!["map", "4096.5"], "not a whole number"),
        (
            vec!["selftest", "--level", "5", "--members", "257"],
            "3 to 256 members",
        ),
        (
            vec!["selftest", "--members", "257", "--member-size", "1G"],
            "limited to 1073741824 bytes",
        ),
        (vec!["map", "18446744073709551615"], "capacity limit"),
        (vec!["layout", "--stripes", "2000000"], "2000000"),
    ] {
        let out = ferroraid(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn layout_and_map_agree() {
    let out = ferroraid(&["layout", "--level", "6", "--layout", "la", "--members", "5"]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    // md RAID6 left-asymmetric, stripe 2: D6 D7 P Q D8 with slots 1 2 - - 0.
    assert!(
        s.contains("D6/s1     D7/s2         P         Q     D8/s0"),
        "{s}"
    );
    let out = ferroraid(&[
        "map",
        "--level",
        "6",
        "--layout",
        "la",
        "--members",
        "5",
        "384K",
    ]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("member 0 offset 131072 (stripe 2, data index 0, slot 1"),
        "{s}"
    );
}

/// The demo replaces only regular files: a symlink named like a member image is refused
/// before anything is written, and the file it points to is untouched.
#[test]
fn demo_refuses_symlinks_and_dedups_failures() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("precious.txt");
    std::fs::write(&target, b"PRECIOUS").unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::os::unix::fs::symlink(&target, data.join("member-2.img")).unwrap();
    let d = data.to_str().unwrap();
    let out = ferroraid(&[
        "selftest",
        "--dir",
        d,
        "--members",
        "4",
        "--chunk",
        "4K",
        "--member-size",
        "64K",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("symbolic link"));
    assert_eq!(std::fs::read(&target).unwrap(), b"PRECIOUS");
    assert!(
        !data.join("member-0.img").exists(),
        "nothing may be written before the check"
    );
    // Naming a member twice loses it once.
    std::fs::remove_file(data.join("member-2.img")).unwrap();
    let out = ferroraid(&[
        "selftest",
        "--dir",
        d,
        "--level",
        "5",
        "--members",
        "4",
        "--member-size",
        "1M",
        "--fail",
        "0,0",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("lost members [0]"));
}

/// Members of different sizes: the array takes the smallest one's size on every member,
/// and, as mdadm does, `create` warns when the largest exceeds it by more than 1 %.
#[test]
fn create_warns_when_members_differ_in_size() {
    let dir = tempfile::tempdir().unwrap();
    let files: Vec<String> = [64u64, 64, 80]
        .iter()
        .enumerate()
        .map(|(i, mib)| {
            let p = dir.path().join(format!("m{i}.img"));
            std::fs::File::create(&p)
                .and_then(|f| f.set_len(mib << 20))
                .unwrap();
            p.display().to_string()
        })
        .collect();
    let mut args = vec![
        "create",
        "--level",
        "5",
        "--name",
        "sizes",
        "--assume-clean",
    ];
    args.extend(files.iter().map(String::as_str));
    let out = ferroraid(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{} is 16 MiB larger than the smallest member",
            files[2]
        )),
        "{stderr}"
    );
}
