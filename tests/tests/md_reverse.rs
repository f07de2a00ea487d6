//! Linux md assembles and serves arrays that ferroraid wrote (the reverse of `md_fixtures`).
//!
//! `tests/qemu/md-reverse.sh` (see `docs/TESTING.md`) has the `ferroraid` binary create a
//! RAID6 (left-symmetric), a RAID5 (left-asymmetric) and a second RAID6 (right-symmetric)
//! on sparse member files and write a seeded pattern over each through `ferroraid serve`
//! and `nbdcopy`. A Debian kernel under QEMU (the rig) then has the real mdadm and md
//! driver assemble them — the members in a shuffled order, the third with one member not
//! attached at all (degraded) — and requires: clean (no resync), md's view of the
//! superblocks equal to mdadm's, the pattern read back, md's own `check` finding
//! `mismatch_cnt` 0; md writes 4 MiB mid-stripe and stops the arrays, and ferroraid must
//! read back what md wrote (the degraded one with its stale member offered again, and left
//! out). The script's result is cached in `target/tmp/md-reverse`, keyed on the scripts,
//! the ferroraid binary and mdadm, so it reruns whenever the binary changes.
//!
//! The binary: `env!("CARGO_BIN_EXE_ferroraid")` exists only in the `ferroraid` package's
//! own tests, so [`ferroraid`] runs `cargo build -p ferroraid --bin ferroraid` with this
//! test's profile and target directory (a no-op when it is fresh) and uses
//! `target/<profile>/ferroraid`; `FERRORAID_BIN=/path` overrides that.
//!
//! Without `qemu-system-x86_64`, `mdadm`, `nbdcopy` or a kernel for the rig, the QEMU part
//! prints `SKIPPED md_reverse: why` and passes, unless `FERRORAID_REQUIRE_QEMU=1` (CI).
//! [`time_stamps_are_whole_seconds`] needs none of that: it is the host-side regression
//! check of the one incompatibility the guest found (microseconds in `ctime`/`utime`,
//! which the kernel reads as seconds past 2106).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use engine::metadata::Superblock;
use ferroraid_tests::{repo_root, show_output};

/// The `ferroraid` binary of this build ([`ferroraid_tests::ferroraid_bin`]).
fn ferroraid() -> &'static Path {
    ferroraid_tests::ferroraid_bin()
}

#[test]
fn md_assembles_and_serves_ferroraid_arrays() {
    let qemu = repo_root().join("tests/qemu");
    let script = qemu.join("md-reverse.sh");
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("md-reverse");
    if let Some(why) = ferroraid_tests::qemu_rig_unavailable(&ferroraid_tests::RIG_TOOLS_MD_NBD) {
        ferroraid_tests::skip_without_rig("md_reverse", &why);
        return;
    }
    let bin = ferroraid();
    let start = Instant::now();
    let out = ferroraid_tests::run_rig_script(&script, &out_dir, Some(bin));
    let summary = ferroraid_tests::read_rig_summary(&out_dir);
    // The script fails on any deviation; its summary must say so too.
    for (name, complete) in [
        ("rev6", true),
        ("rev5", true),
        ("rev6d", false),
        ("rev6b", true),
    ] {
        let line = summary
            .lines()
            .find(|l| l.starts_with(&format!("{name}: ")))
            .unwrap_or_else(|| panic!("summary.txt has no line for {name}:\n{summary}"));
        for want in [
            "array_state=clean",
            "sync_action=idle",
            "resync_start=none",
            "ferroraid read back md's writes: ok",
        ] {
            assert!(line.contains(want), "{name}: no {want:?} in {line:?}");
        }
        let degraded = if complete { "degraded=0" } else { "degraded=1" };
        assert!(line.contains(degraded), "{name}: no {degraded} in {line:?}");
        if complete {
            assert!(
                line.contains("mismatch_cnt 0, after md wrote 0;"),
                "{name}: md's check did not find the parity consistent: {line:?}"
            );
        }
    }
    ferroraid_tests::print_rig_summary("md_reverse", start, &out_dir, &out, &summary);
}

/// A `ferroraid serve` that is killed when dropped (test failure included).
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Both superblock time stamps of every member, raw: (ctime, utime).
fn stamps(images: &[PathBuf]) -> Vec<(u64, u64)> {
    images
        .iter()
        .map(|p| {
            let mut b = vec![0u8; 4096];
            File::open(p)
                .and_then(|f| f.read_exact_at(&mut b, 4096))
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            let sb = Superblock::decode(&b).unwrap_or_else(|e| panic!("{}: {e:?}", p.display()));
            (sb.ctime.raw(), sb.utime.raw())
        })
        .collect()
}

/// md reads `ctime`/`utime` as whole seconds (all 64 bits; `super_1_validate` since the
/// kernel's time64_t conversion), so ferroraid must write microseconds 0, as mdadm and the
/// kernel do: with them, md's assembled array dated itself "Sun Feb 7 06:28:15 2106" (the
/// guest of `md-reverse.sh` found it). Checked on `create`'s superblocks and on the
/// updates `serve` writes (active on start, clean on SIGTERM).
#[test]
fn time_stamps_are_whole_seconds() {
    let bin = ferroraid();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let images: Vec<PathBuf> = (0..4)
        .map(|i| dir.path().join(format!("m{i}.img")))
        .collect();
    for p in &images {
        File::create(p)
            .and_then(|f| f.set_len(8 << 20))
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }
    let out = Command::new(bin)
        .args(["create", "--level", "5", "--name", "stamps"])
        .args(&images)
        .stdin(Stdio::null())
        .output()
        .expect("running ferroraid create");
    assert!(
        out.status.success(),
        "ferroraid create: {}",
        show_output(&out)
    );
    let created = stamps(&images);
    let whole = |t: u64| t >> 40 == 0;
    for (p, (c, u)) in images.iter().zip(&created) {
        assert!(
            whole(*c) && whole(*u),
            "{}: ctime {c:#x} / utime {u:#x} carry microseconds (top 24 bits); md reads the \
             whole field as seconds",
            p.display()
        );
    }

    let sock = dir.path().join("nbd.sock");
    let child = Command::new(bin)
        .arg("serve")
        .arg("--adaptive")
        .arg("--nbd")
        .arg(format!("unix:{}", sock.display()))
        .arg("--rpc")
        .arg(dir.path().join("rpc.sock"))
        .args(&images)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting ferroraid serve");
    let mut server = Server(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !sock.exists() {
        assert!(
            server.0.try_wait().expect("polling the server").is_none(),
            "ferroraid serve exited at start"
        );
        assert!(Instant::now() < deadline, "ferroraid serve never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The active mark is written before the listener opens.
    let active = stamps(&images);
    let pid = server.0.id().to_string();
    let term = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("running kill");
    assert!(term.success(), "kill -TERM {pid} failed");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = server.0.try_wait().expect("polling the server") {
            break s;
        }
        assert!(Instant::now() < deadline, "ferroraid serve ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut log = String::new();
    if let Some(mut e) = server.0.stderr.take() {
        use std::io::Read as _;
        let _ = e.read_to_string(&mut log);
    }
    assert!(status.success(), "ferroraid serve: {status}: {log}");
    let stopped = stamps(&images);
    for (p, ((c0, _), ((c1, u1), (c2, u2)))) in images
        .iter()
        .zip(created.iter().zip(active.iter().zip(&stopped)))
    {
        assert!(c1 == c0 && c2 == c0, "{}: serve changed ctime", p.display());
        assert!(
            whole(*u1) && whole(*u2),
            "{}: serve wrote utime {u1:#x} (active) / {u2:#x} (clean) with microseconds",
            p.display()
        );
    }
}
