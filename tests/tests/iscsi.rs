//! The iSCSI target end to end: `ferroraid serve --iscsi` as a process, real initiators
//! against it (libiscsi's `iscsi-test-cu` compliance suite, `iscsi-ls`, `iscsi-inq`,
//! `iscsi-readcapacity16`, `qemu-io` with `iscsi://` URLs, `fio` through `qemu-nbd`
//! bridging iSCSI to NBD), CHAP one-way and mutual, a member failed over JSON-RPC under
//! iSCSI writes, and a raw-socket initiator sending malformed PDUs.
//!
//! Tools come from Debian's `libiscsi-bin`, `qemu-block-extra` (qemu's iSCSI driver),
//! `qemu-utils` and `fio`. A missing tool skips its test with a printed reason, unless
//! `FERRORAID_REQUIRE_TOOLS=1` (CI). Every server is killed when its test ends.

use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferroraid::iscsi::pdu::{self, op, Bhs, Framing, Header};
use ferroraid::iscsi::text;
use ferroraid_tests::target::{
    create_with, ferroraid_cmd, free_port, member_files, Array, Server, CHUNK,
};
use ferroraid_tests::{required, run_tool, show_output, tool};

const MIB: u64 = 1 << 20;
const TOOL_TIMEOUT: Duration = Duration::from_secs(120);
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// The whole compliance suite (about a minute on the CI machines; a hang fails the test).
const SUITE_TIMEOUT: Duration = Duration::from_secs(600);
/// What tgt 1.0.85 (Debian 12, one file LUN) passes of the same suite, each test counted
/// by its own status (issue 20's measurement: 158 passed, 10 failed, 62 skipped of 230).
const TGT_PASSED: usize = 158;
/// Tests that must pass (issue 20).
const REQUIRED_PASSED: usize = 176;
/// The suite's tests ferroraid fails, each for a reason given in docs/ISCSI.md.
/// The libiscsi tests allowed to skip against a RAID LUN, by suite or `Suite.Test`, with
/// why (docs/ISCSI.md lists the same). Any other skip fails the compliance test.
const ALLOWED_SKIPS: &[(&str, &str)] = &[
    ("PreventAllow", "removable media (the LUN is not removable)"),
    ("StartStopUnit.Simple", "removable media (LOEJ: load/eject)"),
    (
        "Sanitize",
        "SANITIZE: erasing the media of members, not a LUN's job",
    ),
    (
        "MultipathIO",
        "multipath: needs a second portal, the test is given one URL",
    ),
    (
        "ReadOnly.ReadOnlySBC",
        "needs a write-protected logical unit",
    ),
    (
        "WriteAtomic16",
        "WRITE ATOMIC: all-or-nothing across a power loss needs a journal of whole writes",
    ),
    (
        "ExtendedCopy",
        "EXTENDED COPY: copy offload not offered (docs/ISCSI.md, known gaps)",
    ),
    (
        "ReceiveCopyResults",
        "EXTENDED COPY: copy offload not offered (docs/ISCSI.md, known gaps)",
    ),
    (
        "CompareAndWrite.InvalidDataOutSize",
        "runs only with LOGICAL BLOCKS PER PHYSICAL BLOCK > 1",
    ),
    (
        "WriteSame10.UnmapUnaligned",
        "runs only with LOGICAL BLOCKS PER PHYSICAL BLOCK > 1",
    ),
    (
        "WriteSame10.InvalidDataOutSize",
        "runs only with LOGICAL BLOCKS PER PHYSICAL BLOCK > 1",
    ),
    (
        "WriteSame16.UnmapUnaligned",
        "runs only with LOGICAL BLOCKS PER PHYSICAL BLOCK > 1",
    ),
    (
        "WriteSame16.InvalidDataOutSize",
        "runs only with LOGICAL BLOCKS PER PHYSICAL BLOCK > 1",
    ),
];

/// What libiscsi's suite says of one test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CuStatus {
    Passed,
    Failed,
    /// CUnit counts these as passed: a test that printed `[SKIPPED]` before its "passed".
    Skipped,
}

/// Each test's own status from `iscsi-test-cu` output (`Suite.Test` → status), in order.
/// CUnit reports a skipped test as passed, and libiscsi prints a suite's tear-down
/// messages (e.g. "[SKIPPED] PERSISTENT RESERVE IN is not implemented.") after the last
/// test's "passed": a test's status is decided by what it printed between its
/// "Test: NAME ..." and its own "passed"/"FAILED"; "[FAILED]" lines inside a test are the
/// log of a command that was expected to fail, not its status.
fn cu_statuses(text: &str) -> Vec<(String, CuStatus)> {
    let mut out: Vec<(String, CuStatus)> = Vec::new();
    let mut suite = String::new();
    // The open test: its index in `out` and whether it printed [SKIPPED].
    let mut open: Option<(usize, bool)> = None;
    for line in text.lines() {
        if let Some(s) = line.strip_prefix("Suite: ") {
            suite = s.trim().to_string();
            open = None;
            continue;
        }
        let mut rest = line;
        if let Some(t) = line.trim_start().strip_prefix("Test: ") {
            let (name, after) = t.split_once(" ...").unwrap_or((t, ""));
            out.push((format!("{suite}.{name}"), CuStatus::Failed));
            open = Some((out.len() - 1, false));
            rest = after;
        }
        let Some((i, mut skipped)) = open else {
            continue;
        };
        let mut at = 0;
        while at < rest.len() {
            let r = &rest[at..];
            if r.starts_with("[SKIPPED]") {
                skipped = true;
                at += "[SKIPPED]".len();
            } else if r.starts_with("[FAILED]") {
                at += "[FAILED]".len();
            } else if r.starts_with("passed") {
                out[i].1 = if skipped {
                    CuStatus::Skipped
                } else {
                    CuStatus::Passed
                };
                open = None;
                break;
            } else if r.starts_with("FAILED") {
                out[i].1 = CuStatus::Failed;
                open = None;
                break;
            } else {
                at += r.chars().next().map_or(1, char::len_utf8);
            }
        }
        if let Some((i, _)) = open {
            open = Some((i, skipped));
        }
    }
    out
}

#[test]
fn cu_statuses_count_each_test_by_its_own_status() {
    let text = "Suite: A\n  Test: One ...passed\n  Test: Two ...    [SKIPPED] x is not \
        implemented.\n    [SKIPPED] x\npassed\n  Test: Three ...    [FAILED] WRITE10 failed\n\
        passed    [SKIPPED] PERSISTENT RESERVE IN is not implemented.\n\nSuite: B\n  \
        Test: Four ...    [FAILED] c\nFAILED\n    1. x.c:1  - CU_FAIL\n  Test: Five ...passed";
    let got = cu_statuses(text);
    let want = [
        ("A.One", CuStatus::Passed),
        ("A.Two", CuStatus::Skipped),
        ("A.Three", CuStatus::Passed),
        ("B.Four", CuStatus::Failed),
        ("B.Five", CuStatus::Passed),
    ];
    assert_eq!(got.len(), want.len(), "{got:?}");
    for ((n, s), (wn, ws)) in got.iter().zip(want) {
        assert_eq!((n.as_str(), *s), (wn, ws));
    }
}

/// The tools a test needs, or `None` (skipped, said on stderr) when one is missing and
/// `FERRORAID_REQUIRE_TOOLS` is not 1.
fn tools(names: &[&str]) -> Option<Vec<PathBuf>> {
    names.iter().map(|n| tool(n)).collect()
}

/// A RAID6 `name` (64 KiB chunks, left-symmetric) over `members` new member files of
/// `member_bytes` bytes each in `dir`: the array and `ferroraid create`'s output.
fn create_out(dir: &Path, name: &str, members: usize, member_bytes: u64) -> (Array, String) {
    let files = member_files(dir, name, members, member_bytes);
    create_with(dir, 6, "left-symmetric", name, &files, CHUNK, &[])
}

fn create(dir: &Path, name: &str, members: usize, member_bytes: u64) -> Array {
    create_out(dir, name, members, member_bytes).0
}

/// `ferroraid serve` of `a` with NBD and iSCSI on free 127.0.0.1 ports and `extra`
/// arguments (logs in `dir/LABEL.{out,err}`), answering on both.
fn serve(dir: &Path, label: &str, a: &Array, extra: &[&str]) -> Server {
    let iscsi = format!("127.0.0.1:{}", free_port());
    let mut args = vec!["--iscsi", iscsi.as_str()];
    args.extend_from_slice(extra);
    Server::serve(dir, label, &a.name, &a.members, &args)
}

fn ok(out: Output, what: &str, srv: &Server) -> String {
    assert!(
        out.status.success(),
        "{what}: {}\n--- server ---\n{}",
        show_output(&out),
        srv.log()
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

// ---------------------------------------------------------------------------------------
// libiscsi's compliance suite.
// ---------------------------------------------------------------------------------------

/// `iscsi-test-cu -d -t ALL` passes more tests than tgt, fails only the known ones, and
/// neither crashes nor hangs the target (it still serves and stops cleanly afterwards).
#[test]
fn compliance_suite_passes_176_with_no_failure_and_only_explained_skips() {
    let Some(t) = tools(&["iscsi-test-cu", "iscsi-inq"]) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    // RAID6, 4 members of 129 MiB: 256 MiB of LUN.
    let a = create(d, "cu", 4, 129 * MIB);
    let mut srv = serve(d, "cu", &a, &["--reactors", "2"]);
    let started = Instant::now();
    let out = run_tool(
        Command::new(&t[0]).args(["-d", "-t", "ALL", &srv.iscsi_url()]),
        d,
        SUITE_TIMEOUT,
    );
    let took = started.elapsed();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("iscsi-test-cu took {took:?}");
    // "               tests    230    230    226      4        0"
    let nums: Vec<u32> = text
        .lines()
        .find(|l| l.trim_start().starts_with("tests "))
        .unwrap_or_else(|| panic!("no summary: {}", show_output(&out)))
        .split_whitespace()
        .skip(1)
        .map(|n| n.parse().unwrap())
        .collect();
    let (total, ran) = (nums[0], nums[1]);
    assert_eq!(ran, total, "tests did not run: {text}");
    let statuses = cu_statuses(&text);
    assert_eq!(
        statuses.len(),
        total as usize,
        "tests found in the output vs the summary's total"
    );
    let of = |want: CuStatus| -> Vec<&str> {
        statuses
            .iter()
            .filter(|(_, s)| *s == want)
            .map(|(n, _)| n.as_str())
            .collect()
    };
    let (passed, failed, skipped) = (
        of(CuStatus::Passed),
        of(CuStatus::Failed),
        of(CuStatus::Skipped),
    );
    eprintln!(
        "iscsi-test-cu, each test by its own status: {} passed, {} failed, {} skipped of {total}",
        passed.len(),
        failed.len(),
        skipped.len()
    );
    assert!(
        failed.is_empty(),
        "failed: {failed:?}\n{text}\n--- server ---\n{}",
        srv.log()
    );
    let unexplained: Vec<&str> = skipped
        .iter()
        .copied()
        .filter(|n| {
            !ALLOWED_SKIPS
                .iter()
                .any(|(p, _)| n == p || n.strip_prefix(p).is_some_and(|r| r.starts_with('.')))
        })
        .collect();
    assert!(
        unexplained.is_empty(),
        "skipped without a reason a RAID LUN gives: {unexplained:?}\n{text}"
    );
    assert!(
        passed.len() >= REQUIRED_PASSED,
        "{} passed (required {REQUIRED_PASSED}; tgt 1.0.85 passes {TGT_PASSED})",
        passed.len()
    );
    assert!(
        srv.try_wait().is_none(),
        "the target died under the suite:\n{}",
        srv.log()
    );
    assert!(!srv.log().contains("panicked"), "{}", srv.log());
    // Still serving.
    ok(
        run_tool(Command::new(&t[1]).arg(srv.iscsi_url()), d, TOOL_TIMEOUT),
        "iscsi-inq after the suite",
        &srv,
    );
    srv.stop();
}

/// The reservation suites of `iscsi-test-cu` (persistent reservations and
/// RESERVE/RELEASE(6), 27 tests, two initiator names) against a target with two reactors:
/// every test runs and passes — none skipped, counted by each test's own status.
#[test]
fn reservation_suites_all_pass() {
    let Some(t) = tools(&["iscsi-test-cu"]) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let a = create(d, "pr", 4, 129 * MIB);
    let mut srv = serve(d, "pr", &a, &["--reactors", "2"]);
    let suites = "ALL.PrinReadKeys,ALL.ProutReserve,ALL.ProutRegister,ALL.ProutClear,\
ALL.ProutPreempt,ALL.PrinReportCapabilities,ALL.PrinServiceactionRange,ALL.Reserve6";
    let out = run_tool(
        Command::new(&t[0]).args(["-d", "-t", suites, &srv.iscsi_url()]),
        d,
        SUITE_TIMEOUT,
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let res = cu_statuses(&text);
    let bad: Vec<_> = res.iter().filter(|(_, s)| *s != CuStatus::Passed).collect();
    assert!(
        bad.is_empty() && res.len() == 27,
        "{} tests, not passed: {bad:?}\n{text}\n--- server ---\n{}",
        res.len(),
        srv.log()
    );
    assert!(!srv.log().contains("panicked"), "{}", srv.log());
    srv.stop();
}

/// libiscsi's ExtendedCopy (6 tests) and ReceiveCopyResults (2 tests) suites run against
/// the binary and every test passes by its own status (a skip is not a pass).
#[test]
fn extended_copy_and_receive_copy_results_suites_pass() {
    let Some(t) = tools(&["iscsi-test-cu"]) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let a = create(d, "xc", 4, 129 * MIB);
    let mut srv = serve(d, "xc", &a, &["--reactors", "2"]);
    for (suite, tests) in [("ALL.ExtendedCopy", 6), ("ALL.ReceiveCopyResults", 2)] {
        let out = run_tool(
            Command::new(&t[0]).args(["-d", "-V", "-t", suite, &srv.iscsi_url()]),
            d,
            SUITE_TIMEOUT,
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let statuses = cu_statuses(&text);
        assert_eq!(statuses.len(), tests, "{suite}: {}", show_output(&out));
        for (name, status) in &statuses {
            assert_eq!(
                *status,
                CuStatus::Passed,
                "{name}: {text}\n--- server ---\n{}",
                srv.log()
            );
        }
    }
    assert!(!srv.log().contains("panicked"), "{}", srv.log());
    srv.stop();
}

// ---------------------------------------------------------------------------------------
// Inquiry tools.
// ---------------------------------------------------------------------------------------

#[test]
fn iscsi_ls_inq_and_readcapacity16_report_the_array() {
    let Some(t) = tools(&["iscsi-ls", "iscsi-inq", "iscsi-readcapacity16"]) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let (a, created) = create_out(d, "inq", 6, 17 * MIB);
    // "created raid6 ... array "inq" (UUID a:b:c:d): ...": the UUID in hex, no separators.
    let uuid_hex = created
        .split("(UUID ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap_or_else(|| panic!("no UUID in {created}"))
        .replace(':', "");
    let mut srv = serve(d, "inq", &a, &[]);
    let ls = ok(
        run_tool(Command::new(&t[0]).arg(srv.iscsi_portal()), d, TOOL_TIMEOUT),
        "iscsi-ls",
        &srv,
    );
    assert!(
        ls.contains(&format!(
            "Target:{} Portal:127.0.0.1:{},1",
            srv.iscsi_target(),
            srv.iscsi_port.expect("iSCSI")
        )),
        "{ls}"
    );
    let inq = ok(
        run_tool(Command::new(&t[1]).arg(srv.iscsi_url()), d, TOOL_TIMEOUT),
        "iscsi-inq",
        &srv,
    );
    for want in [
        "Peripheral Device Type:DIRECT_ACCESS",
        "Vendor:FERRORAI",
        "Product:RAID6 array",
        "CmdQue:1",
    ] {
        assert!(inq.contains(want), "{want} missing:\n{inq}");
    }
    // Unit serial number: the array UUID.
    let serial = ok(
        run_tool(
            Command::new(&t[1]).args(["-e", "1", "-c", "128", &srv.iscsi_url()]),
            d,
            TOOL_TIMEOUT,
        ),
        "iscsi-inq VPD 0x80",
        &srv,
    );
    assert!(serial.contains(&uuid_hex), "{} not in\n{serial}", uuid_hex);
    // Device identification: an NAA designator.
    let ident = ok(
        run_tool(
            Command::new(&t[1]).args(["-e", "1", "-c", "131", &srv.iscsi_url()]),
            d,
            TOOL_TIMEOUT,
        ),
        "iscsi-inq VPD 0x83",
        &srv,
    );
    assert!(ident.contains("NAA"), "{ident}");
    let cap = ok(
        run_tool(Command::new(&t[2]).arg(srv.iscsi_url()), d, TOOL_TIMEOUT),
        "iscsi-readcapacity16",
        &srv,
    );
    for want in [
        format!("RETURNED LOGICAL BLOCK ADDRESS:{}", a.size / 512 - 1),
        "LOGICAL BLOCK LENGTH IN BYTES:512".to_string(),
        "LBPME:1 LBPRZ:1".to_string(),
        format!("Total size:{}", a.size),
    ] {
        assert!(cap.contains(&want), "{want} missing:\n{cap}");
    }
    srv.stop();
}

// ---------------------------------------------------------------------------------------
// qemu-io, fio through qemu-nbd, a member failed under writes.
// ---------------------------------------------------------------------------------------

/// qemu's iSCSI driver, or `None` when `qemu-block-extra` is missing.
fn qemu_iscsi(srv: &Server, d: &Path) -> Option<PathBuf> {
    let q = tool("qemu-io")?;
    let out = run_tool(
        Command::new(&q).args(["-f", "raw", "-c", "read 0 512", &srv.iscsi_url()]),
        d,
        TOOL_TIMEOUT,
    );
    let text = show_output(&out);
    if text.contains("Unknown protocol") || text.contains("Unknown driver") {
        assert!(
            !required("FERRORAID_REQUIRE_TOOLS"),
            "qemu has no iSCSI driver (qemu-block-extra) and FERRORAID_REQUIRE_TOOLS=1"
        );
        eprintln!("SKIPPED: qemu has no iSCSI driver (install qemu-block-extra)");
        return None;
    }
    Some(q)
}

/// qemu-io writes patterns at aligned and unaligned offsets over iSCSI, verifies them
/// over iSCSI, and the same bytes read back over NBD from the same array.
#[test]
fn qemu_io_writes_and_verifies_patterns_over_iscsi() {
    if tools(&["qemu-io"]).is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let a = create(d, "qio", 6, 17 * MIB);
    let mut srv = serve(d, "qio", &a, &["--reactors", "2"]);
    let Some(q) = qemu_iscsi(&srv, d) else {
        return;
    };
    let writes: &[(u64, u64, u8)] = &[
        (0, 4096, 0x11),
        (512, 1536, 0x22),
        (65536 - 512, 8192, 0x33),
        (3 * MIB, 2 * MIB, 0x44),
        (a.size - 1024 * 1024, 1024 * 1024, 0x55),
    ];
    for &(off, len, pat) in writes {
        let cmd = format!("write -P {pat} {off} {len}");
        ok(
            run_tool(
                Command::new(&q).args(["-f", "raw", "-c", &cmd, &srv.iscsi_url()]),
                d,
                TOOL_TIMEOUT,
            ),
            &cmd,
            &srv,
        );
    }
    // Later writes overwrite earlier ones: verify the last pattern of every byte range.
    let last = writes;
    let check = |url: String, what: &str| {
        for (i, &(off, len, pat)) in last.iter().enumerate() {
            // Only the parts not overwritten later.
            let mut pieces = vec![(off, off + len)];
            for &(o2, l2, _) in &last[i + 1..] {
                pieces = pieces
                    .into_iter()
                    .flat_map(|(s, e)| {
                        let mut v = Vec::new();
                        if s < o2.min(e) {
                            v.push((s, o2.min(e)));
                        }
                        if (o2 + l2).max(s) < e {
                            v.push(((o2 + l2).max(s), e));
                        }
                        v
                    })
                    .collect();
            }
            for (s, e) in pieces {
                let cmd = format!("read -P {pat} {s} {}", e - s);
                let out = ok(
                    run_tool(
                        Command::new(&q).args(["-f", "raw", "-c", &cmd, &url]),
                        d,
                        TOOL_TIMEOUT,
                    ),
                    &format!("{what}: {cmd}"),
                    &srv,
                );
                assert!(
                    !out.contains("Pattern verification failed"),
                    "{what}: {cmd}: {out}"
                );
            }
        }
    };
    check(srv.iscsi_url(), "iSCSI");
    check(format!("nbd://127.0.0.1:{}/{}", srv.port, a.name), "NBD");
    srv.stop();
}

/// `ferroraid status --json --rpc SOCK`, retried while the socket is not up yet.
fn rpc_status(d: &Path, rpc: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = run_tool(
            &mut ferroraid_cmd(["status", "--json", "--rpc", rpc]),
            d,
            TOOL_TIMEOUT,
        );
        if out.status.code() != Some(4) || Instant::now() > deadline {
            return serde_json::from_slice(&out.stdout)
                .unwrap_or_else(|e| panic!("status --json: {e}: {}", show_output(&out)));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// fio (through qemu-nbd, which bridges qemu's iSCSI initiator to an NBD socket) writes
/// random blocks with CRC32C verification while the operator fails a member over
/// JSON-RPC: fio sees no error and every block verifies; the array reports degraded.
#[test]
fn fio_random_writes_verify_over_iscsi_while_a_member_fails() {
    let Some(t) = tools(&["fio", "qemu-nbd"]) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let a = create(d, "fio", 6, 17 * MIB);
    let rpc = d.join("rpc.sock");
    let rpc_arg = rpc.display().to_string();
    let mut srv = serve(d, "fio", &a, &["--rpc", &rpc_arg, "--reactors", "2"]);
    if qemu_iscsi(&srv, d).is_none() {
        return;
    }
    let sock = d.join("bridge.sock");
    let mut bridge = Command::new(&t[1])
        // Persistent, several clients: fio connects more than once.
        .args(["-f", "raw", "--cache=none", "-t", "-e", "8", "-k"])
        .arg(&sock)
        .arg(srv.iscsi_url())
        .stdout(Stdio::null())
        .stderr(fs::File::create(d.join("qemu-nbd.err")).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + START_TIMEOUT;
    while !sock.exists() {
        assert!(Instant::now() < deadline, "qemu-nbd did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut fio = Command::new(&t[0])
        .current_dir(d)
        .args([
            "--verify_state_save=0",
            "--name=iscsi",
            "--ioengine=nbd",
            &format!("--uri=nbd+unix:///?socket={}", sock.display()),
            "--rw=randwrite",
            "--bs=16k",
            "--size=16m",
            "--iodepth=8",
            "--loops=6",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--do_verify=1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Fail member 1 once writes reach the members.
    let deadline = Instant::now() + TOOL_TIMEOUT;
    loop {
        let st = rpc_status(d, &rpc_arg);
        let writes: u64 = st["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["io"]["writes"].as_u64().unwrap())
            .sum();
        if writes >= 64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no writes reached the members: {st}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = run_tool(
        ferroraid_cmd(["fail", "--rpc", &rpc_arg]).arg(&a.members[1]),
        d,
        TOOL_TIMEOUT,
    );
    ok(out, "ferroraid fail", &srv);
    assert!(
        fio.try_wait().unwrap().is_none(),
        "fio finished before the failure"
    );
    let out = fio.wait_with_output().unwrap();
    let _ = bridge.kill();
    let _ = bridge.wait();
    assert!(
        out.status.success(),
        "fio saw an error: {}\n--- server ---\n{}",
        show_output(&out),
        srv.log()
    );
    let st = rpc_status(d, &rpc_arg);
    assert_eq!(st["array"]["state"], "degraded", "{st}");
    assert_eq!(st["members"][1]["state"], "faulty", "{st}");
    assert!(!srv.log().contains("CHECK CONDITION"), "{}", srv.log());
    srv.stop();
}

// ---------------------------------------------------------------------------------------
// CHAP.
// ---------------------------------------------------------------------------------------

/// One-way and mutual CHAP with secrets from the config file; wrong secrets refused.
#[test]
fn chap_one_way_and_mutual_and_wrong_secrets_refused() {
    let Some(t) = tools(&["iscsi-inq"]) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let a = create(d, "chap", 4, 9 * MIB);
    let cfg = d.join("serve.toml");
    fs::write(
        &cfg,
        "[iscsi_chap]\nuser = \"alice\"\nsecret = \"alice-secret-12\"\n\
         mutual_user = \"target\"\nmutual_secret = \"target-secret-1\"\n",
    )
    .unwrap();
    let cfg_arg = cfg.display().to_string();
    let mut srv = serve(d, "chap", &a, &["--config", &cfg_arg]);
    let url_with = |cred: &str, query: &str| {
        format!(
            "iscsi://{cred}@127.0.0.1:{}/{}/0{query}",
            srv.iscsi_port.expect("iSCSI"),
            srv.iscsi_target()
        )
    };
    let inq = |url: String| run_tool(Command::new(&t[0]).arg(url), d, TOOL_TIMEOUT);
    // One-way.
    ok(
        inq(url_with("alice%alice-secret-12", "")),
        "one-way CHAP",
        &srv,
    );
    // Mutual: the initiator checks the target's answer.
    ok(
        inq(url_with(
            "alice%alice-secret-12",
            "?target_user=target&target_password=target-secret-1",
        )),
        "mutual CHAP",
        &srv,
    );
    // Wrong initiator secret, unknown user, no credentials: refused.
    for (cred, what) in [
        ("alice%wrong-secret-00", "wrong secret"),
        ("mallory%alice-secret-12", "wrong user"),
    ] {
        let out = inq(url_with(cred, ""));
        assert!(
            !out.status.success(),
            "{what} accepted: {}",
            show_output(&out)
        );
    }
    let out = inq(srv.iscsi_url());
    assert!(
        !out.status.success(),
        "no CHAP accepted: {}",
        show_output(&out)
    );
    // The target proving a wrong mutual secret: the initiator refuses it.
    let out = inq(url_with(
        "alice%alice-secret-12",
        "?target_user=target&target_password=not-the-secret",
    ));
    assert!(
        !out.status.success(),
        "initiator accepted a wrong target secret: {}",
        show_output(&out)
    );
    assert!(
        srv.log().contains("CHAP authentication failed"),
        "{}",
        srv.log()
    );
    srv.stop();
}

// ---------------------------------------------------------------------------------------
// Malformed PDUs from a raw-socket initiator.
// ---------------------------------------------------------------------------------------

/// A minimal initiator over a blocking socket: logs in (optionally asking for digests),
/// sends raw PDUs, reads PDUs.
struct Raw {
    s: TcpStream,
    f: Framing,
    cmd_sn: u32,
    itt: u32,
    tsih: u16,
}

/// What a raw login asks for.
#[derive(Clone, Copy, Default)]
struct LoginOpts {
    digests: bool,
    /// ImmediateData=No (all write data solicited by R2T).
    no_immediate: bool,
    /// Join this session (0: a new one).
    tsih: u16,
    cid: u16,
    /// MaxBurstLength and MaxOutstandingR2T to offer (0: not sent, the defaults).
    max_burst: u32,
    max_r2t: u32,
    /// InitiatorName ("": `iqn.2026-11.org.ferroraid:raw-test`).
    initiator: &'static str,
    /// ISID (zero: 80 00 00 12 34 56).
    isid: [u8; 6],
}

impl Raw {
    fn login(port: u16, target: &str, digests: bool) -> Raw {
        Self::login_with(
            port,
            target,
            LoginOpts {
                digests,
                ..LoginOpts::default()
            },
        )
    }

    fn login_with(port: u16, target: &str, o: LoginOpts) -> Raw {
        let digests = o.digests;
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut kv = Vec::new();
        text::put(
            &mut kv,
            "InitiatorName",
            if o.initiator.is_empty() {
                "iqn.2026-11.org.ferroraid:raw-test"
            } else {
                o.initiator
            },
        );
        text::put(&mut kv, "SessionType", "Normal");
        text::put(&mut kv, "TargetName", target);
        text::put(&mut kv, "AuthMethod", "None");
        text::put(
            &mut kv,
            "HeaderDigest",
            if digests { "CRC32C" } else { "None" },
        );
        text::put(
            &mut kv,
            "DataDigest",
            if digests { "CRC32C" } else { "None" },
        );
        text::put(&mut kv, "MaxRecvDataSegmentLength", "65536");
        text::put(
            &mut kv,
            "ImmediateData",
            if o.no_immediate { "No" } else { "Yes" },
        );
        text::put(&mut kv, "InitialR2T", "Yes");
        if o.max_burst > 0 {
            text::put(&mut kv, "MaxBurstLength", &o.max_burst.to_string());
        }
        if o.max_r2t > 0 {
            text::put(&mut kv, "MaxOutstandingR2T", &o.max_r2t.to_string());
        }
        // Security → full feature in one step (T=1, CSG=0, NSG=3: allowed when nothing
        // is left to negotiate in the operational stage, RFC 7143 §6.3).
        let h = Header::new(op::LOGIN_REQ | 0x40, 0x80 | 0x03, kv.len() as u32, 1)
            .byte(3, 0)
            .bytes(
                8,
                &if o.isid == [0; 6] {
                    [0x80, 0, 0, 0x12, 0x34, 0x56]
                } else {
                    o.isid
                },
            )
            .u16(14, o.tsih)
            .u16(20, o.cid)
            .u32(24, 1);
        let plain = Framing {
            header_digest: false,
            data_digest: false,
            max_recv_data: 65536,
        };
        let mut buf = vec![0u8; pdu::pdu_bytes(kv.len(), &plain)];
        pdu::write_pdu(&mut buf, &h, &kv, &plain);
        s.write_all(&buf).unwrap();
        let mut r = Raw {
            s,
            f: plain,
            cmd_sn: 1,
            itt: 10,
            tsih: 0,
        };
        let (bhs, data) = r.read().expect("login response");
        assert_eq!(bhs.opcode(), op::LOGIN_RESP);
        assert_eq!(
            u16::from_be_bytes([bhs.raw[36], bhs.raw[37]]),
            0,
            "login refused"
        );
        assert_eq!(bhs.flags() & 0x83, 0x83, "not in full-feature phase");
        r.tsih = u16::from_be_bytes([bhs.raw[14], bhs.raw[15]]);
        r.cmd_sn = bhs.u32_at(28);
        assert!(o.tsih == 0 || r.tsih == o.tsih, "joined another session");
        let keys = text::parse(&data).unwrap();
        assert!(keys
            .iter()
            .any(|(k, v)| k == "HeaderDigest" && v == if digests { "CRC32C" } else { "None" }));
        r.f = Framing {
            header_digest: digests,
            data_digest: digests,
            max_recv_data: 65536,
        };
        r
    }

    fn send(&mut self, h: &Header, data: &[u8]) {
        let mut buf = vec![0u8; pdu::pdu_bytes(data.len(), &self.f)];
        let n = pdu::write_pdu(&mut buf, h, data, &self.f);
        let _ = self.s.write_all(&buf[..n]);
    }

    /// The next PDU, or `None` when the target closed the connection.
    fn read(&mut self) -> Option<(Bhs, Vec<u8>)> {
        let mut h = [0u8; 48];
        self.s.read_exact(&mut h).ok()?;
        let bhs = Bhs::parse(&h).unwrap();
        let mut rest = vec![0u8; bhs.wire_bytes(self.f.header_digest, self.f.data_digest) - 48];
        self.s.read_exact(&mut rest).ok()?;
        let mut all = h.to_vec();
        all.extend_from_slice(&rest);
        let f = Framing {
            max_recv_data: 1 << 24,
            ..self.f
        };
        assert_eq!(f.frame(&all), Ok(Some(all.len())), "target's header digest");
        let p = f.split(&all).unwrap();
        assert!(p.data_digest_ok, "target's data digest");
        Some((bhs, p.data.to_vec()))
    }

    /// A NOP-Out ping (immediate) and its NOP-In: the connection is alive and in step.
    fn ping(&mut self) -> Bhs {
        self.itt += 1;
        let h = Header::new(op::NOP_OUT | 0x40, 0x80, 4, self.itt)
            .u32(20, pdu::RESERVED_TAG)
            .u32(24, self.cmd_sn);
        self.send(&h, b"ping");
        let (b, data) = self.read().expect("NOP-In");
        assert_eq!(b.opcode(), op::NOP_IN);
        assert_eq!(b.itt(), self.itt);
        assert_eq!(data, b"ping");
        b
    }

    /// Whether the target closed the connection: EOF or a reset within the read timeout
    /// (a timeout is not a close; bytes are drained until one of them).
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 4096];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return false
                }
                Err(_) => return true,
            }
        }
    }

    fn test_unit_ready(&mut self, cmd_sn: u32) {
        self.itt += 1;
        let h = Header::new(op::SCSI_CMD, 0x80, 0, self.itt)
            .u32(20, 0)
            .u32(24, cmd_sn)
            .bytes(32, &[0u8; 16]);
        self.send(&h, &[]);
    }
}

#[test]
fn malformed_pdus_get_rejects_or_a_clean_drop() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let a = create(d, "raw", 4, 9 * MIB);
    let mut srv = serve(d, "raw", &a, &[]);
    let port = srv.iscsi_port.expect("iSCSI");
    let target = srv.iscsi_target();

    // An unknown opcode: Reject "command not supported", the connection goes on.
    let mut r = Raw::login(port, &target, false);
    let h = Header::new(0x1e, 0x80, 0, 77);
    r.send(&h, &[]);
    let (b, data) = r.read().expect("Reject");
    assert_eq!(
        (b.opcode(), b.raw[2]),
        (op::REJECT, pdu::reject::NOT_SUPPORTED)
    );
    assert_eq!(&data[..48], &h.0, "the Reject carries the rejected header");
    r.ping();

    // A command outside the CmdSN window is ignored (RFC 7143 §4.2.2.1): no answer, and
    // ExpCmdSN does not move; the in-window one is answered.
    let exp_before = r.ping().u32_at(28);
    r.test_unit_ready(exp_before.wrapping_add(1000));
    let after = r.ping();
    assert_eq!(
        after.u32_at(28),
        exp_before,
        "an out-of-window CmdSN moved ExpCmdSN"
    );
    r.test_unit_ready(exp_before);
    let (b, _) = r.read().expect("SCSI Response");
    assert_eq!(
        (b.opcode(), b.raw[3]),
        (op::SCSI_RESP, 0),
        "TEST UNIT READY"
    );
    assert_eq!(b.u32_at(28), exp_before.wrapping_add(1));

    // A data segment beyond MaxRecvDataSegmentLength: dropped.
    let h = Header::new(op::NOP_OUT | 0x40, 0x80, 1 << 20, 99).u32(20, pdu::RESERVED_TAG);
    let _ = r.s.write_all(&h.0);
    assert!(r.closed(), "oversized PDU accepted");

    // Garbage: a "login" in the full-feature phase, then noise: dropped, no panic.
    let mut r = Raw::login(port, &target, false);
    let _ = r.s.write_all(&[0x43u8; 48]);
    let _ = r.s.write_all(&[0xffu8; 4096]);
    // Whatever the target makes of it, it must answer with Rejects or close: read until
    // it closes or goes quiet.
    let _ = r.s.set_read_timeout(Some(Duration::from_secs(2)));
    let mut sink = [0u8; 4096];
    while matches!(r.s.read(&mut sink), Ok(n) if n > 0) {}

    // Digests: a data digest error gets Reject "data digest error" and the PDU is
    // dropped; a header digest error drops the connection.
    let mut r = Raw::login(port, &target, true);
    r.ping();
    r.itt += 1;
    let h = Header::new(op::NOP_OUT | 0x40, 0x80, 4, r.itt).u32(20, pdu::RESERVED_TAG);
    let mut buf = vec![0u8; pdu::pdu_bytes(4, &r.f)];
    let n = pdu::write_pdu(&mut buf, &h, b"ping", &r.f);
    buf[n - 1] ^= 0xff; // the data digest
    r.s.write_all(&buf[..n]).unwrap();
    let (b, _) = r.read().expect("Reject");
    assert_eq!(
        (b.opcode(), b.raw[2]),
        (op::REJECT, pdu::reject::DATA_DIGEST)
    );
    r.ping();
    let n = pdu::write_pdu(&mut buf, &h, b"ping", &r.f);
    buf[50] ^= 0xff; // the header digest
    r.s.write_all(&buf[..n]).unwrap();
    assert!(r.closed(), "header digest error accepted");

    // The target is unharmed: a new session works and the server stops cleanly.
    let mut r = Raw::login(port, &target, false);
    r.ping();
    assert!(srv.try_wait().is_none());
    assert!(!srv.log().contains("panicked"), "{}", srv.log());
    srv.stop();
}

// ---------------------------------------------------------------------------------------
// In process: the target over `mem` members and real reactors, with tunables the binary
// does not expose.
// ---------------------------------------------------------------------------------------

mod in_process {
    use super::*;
    use std::sync::Arc;

    use drivers::mem::MemDevice;
    use engine::array::ArrayConfig;
    use engine::geometry::{ArrayGeometry, Geometry, Layout, Level};
    use engine::parity::Parity;
    use engine::reactor::{Mode, ReactorConfig, Reactors};
    use ferroraid::iscsi::pr_store::{MemoryStore, ReservationStore};
    use ferroraid::iscsi::{lun_info, IscsiConfig, IscsiError, IscsiFrontend, IscsiServer};
    use ferroraid::nbd::BufferClass;

    const MEMBER_BYTES: u64 = 8 << 20;
    const CHUNK: u64 = 64 << 10;

    struct Target {
        server: Option<IscsiServer>,
        reactors: Option<Reactors<IscsiFrontend>>,
        port: u16,
        name: String,
    }

    impl Target {
        /// RAID6 over 6 mem members, `reactors` reactors, `buffers` task buffers of 64 KiB
        /// per reactor.
        fn start(reactors: usize, buffers: u16) -> Target {
            Self::start_with(reactors, buffers, |_| {})
        }

        /// As [`Target::start`], with the tunables adjusted by `tweak`.
        fn start_with(
            reactors: usize,
            buffers: u16,
            tweak: impl FnOnce(&mut IscsiConfig),
        ) -> Target {
            Self::start_full(reactors, buffers, tweak, None)
        }

        /// As [`Target::start_with`], with a reservation store (APTPL).
        fn start_full(
            reactors: usize,
            buffers: u16,
            tweak: impl FnOnce(&mut IscsiConfig),
            store: Option<Arc<dyn ReservationStore>>,
        ) -> Target {
            let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 6, CHUNK, 512).unwrap();
            let geo = ArrayGeometry::new(g, MEMBER_BYTES / CHUNK).unwrap();
            let devices: Arc<Vec<MemDevice>> = Arc::new(
                (0..6)
                    .map(|i| MemDevice::new(&format!("mem{i}"), MEMBER_BYTES, 512, 64).unwrap())
                    .collect(),
            );
            let config = IscsiConfig {
                buffers: vec![BufferClass {
                    bytes: 64 << 10,
                    count: buffers,
                }],
                max_transfer_bytes: 64 << 10,
                drain_grace: Duration::from_secs(5),
                ..IscsiConfig::default()
            };
            let mut config = config;
            tweak(&mut config);
            let lun = lun_info("mem", &geo, [7; 16], &config);
            let name = lun.target_name.clone();
            let mut builder = IscsiServer::builder(lun)
                .config(config)
                .listen("127.0.0.1:0".parse().unwrap());
            if let Some(st) = store {
                builder = builder.reservation_store(st);
            }
            let (server, frontends) = builder.start(reactors).unwrap();
            let port = server.addrs()[0].port();
            let running = Reactors::start(
                devices,
                geo,
                Parity::new(),
                ArrayConfig::default(),
                ReactorConfig {
                    cores: vec![None; reactors],
                    mode: Mode::Adaptive,
                    requests: 256,
                    foreign_reads: true,
                },
                frontends,
            )
            .unwrap();
            Target {
                server: Some(server),
                reactors: Some(running),
                port,
                name,
            }
        }

        /// Shuts down (bounded; the server may have been shut down already) and checks
        /// every front-end got its buffers back.
        fn stop(&mut self) {
            if let Some(s) = self.server.take() {
                s.shutdown();
            }
            let reactors = self.reactors.take().expect("running");
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = tx.send(reactors.stop());
            });
            let frontends = rx
                .recv_timeout(Duration::from_secs(30))
                .expect("reactors did not stop within 30 s")
                .expect("reactors ran");
            for (i, f) in frontends.iter().enumerate() {
                assert_eq!(f.connections(), 0, "reactor {i} still holds connections");
                assert_eq!(f.free_buffers(), f.buffers(), "reactor {i} leaked buffers");
            }
        }
    }

    impl Drop for Target {
        fn drop(&mut self) {
            if let Some(s) = self.server.take() {
                s.shutdown();
            }
            if let Some(r) = self.reactors.take() {
                let _ = r.stop();
            }
        }
    }

    fn write10(r: &mut Raw, cmd_sn: u32, lba: u32, blocks: u16) -> u32 {
        r.itt += 1;
        let mut cdb = [0u8; 16];
        cdb[0] = 0x2a;
        cdb[2..6].copy_from_slice(&lba.to_be_bytes());
        cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
        let h = Header::new(op::SCSI_CMD, 0x80 | 0x20, 0, r.itt)
            .u32(20, u32::from(blocks) * 512)
            .u32(24, cmd_sn)
            .bytes(32, &cdb);
        r.send(&h, &[]);
        r.itt
    }

    fn read10(r: &mut Raw, cmd_sn: u32, lba: u32, blocks: u16) -> Vec<u8> {
        r.itt += 1;
        let mut cdb = [0u8; 16];
        cdb[0] = 0x28;
        cdb[2..6].copy_from_slice(&lba.to_be_bytes());
        cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
        let h = Header::new(op::SCSI_CMD, 0x80 | 0x40, 0, r.itt)
            .u32(20, u32::from(blocks) * 512)
            .u32(24, cmd_sn)
            .bytes(32, &cdb);
        r.send(&h, &[]);
        let mut data = Vec::new();
        loop {
            let (b, d) = r.read().expect("Data-In");
            assert_eq!(b.itt(), r.itt);
            if b.opcode() == op::DATA_IN {
                assert_eq!(b.u32_at(40) as usize, data.len(), "Data-In in order");
                data.extend_from_slice(&d);
                if b.flags() & 0x01 != 0 {
                    assert_eq!(b.raw[3], 0, "read status");
                    return data;
                }
            } else {
                assert_eq!(b.opcode(), op::SCSI_RESP);
                assert_eq!(b.raw[3], 0, "read status");
                return data;
            }
        }
    }

    /// One SCSI command with `out` as immediate data (at most FirstBurstLength) and up to
    /// `din` bytes of data-in: its status, data-in and sense data.
    fn command(
        r: &mut Raw,
        cmd_sn: u32,
        cdb: &[u8],
        out: &[u8],
        din: u32,
    ) -> (u8, Vec<u8>, Vec<u8>) {
        r.itt += 1;
        let mut c = [0u8; 16];
        c[..cdb.len()].copy_from_slice(cdb);
        let mut flags = 0x80;
        if !out.is_empty() {
            flags |= 0x20;
        }
        if din > 0 {
            flags |= 0x40;
        }
        let h = Header::new(op::SCSI_CMD, flags, out.len() as u32, r.itt)
            .u32(
                20,
                if out.is_empty() {
                    din
                } else {
                    out.len() as u32
                },
            )
            .u32(24, cmd_sn)
            .bytes(32, &c);
        r.send(&h, out);
        let mut data = Vec::new();
        loop {
            let (b, d) = r.read().expect("Data-In or SCSI Response");
            assert_eq!(b.itt(), r.itt);
            if b.opcode() == op::DATA_IN {
                data.extend_from_slice(&d);
                if b.flags() & 0x01 != 0 {
                    return (b.raw[3], data, Vec::new());
                }
            } else {
                assert_eq!(b.opcode(), op::SCSI_RESP);
                let sense = if d.len() > 2 {
                    d[2..].to_vec()
                } else {
                    Vec::new()
                };
                return (b.raw[3], data, sense);
            }
        }
    }

    /// An EXTENDED COPY(LID1) parameter list: one identification CSCD descriptor per
    /// designator, block to block segments `(src index, dst index, blocks, src, dst)`.
    fn xcopy_list(list_id: u8, naas: &[&[u8]], segs: &[(u16, u16, u16, u64, u64)]) -> Vec<u8> {
        let mut p = vec![0u8; 16];
        p[0] = list_id;
        p[2..4].copy_from_slice(&(32 * naas.len() as u16).to_be_bytes());
        p[8..12].copy_from_slice(&(28 * segs.len() as u32).to_be_bytes());
        for naa in naas {
            let mut d = [0u8; 32];
            d[0] = 0xe4;
            d[4] = 0x01;
            d[5] = 0x03;
            d[7] = naa.len() as u8;
            d[8..8 + naa.len()].copy_from_slice(naa);
            d[29..32].copy_from_slice(&512u32.to_be_bytes()[1..]);
            p.extend_from_slice(&d);
        }
        for &(si, di, n, src, dst) in segs {
            let mut d = [0u8; 28];
            d[0] = 0x02;
            d[3] = 0x18;
            d[4..6].copy_from_slice(&si.to_be_bytes());
            d[6..8].copy_from_slice(&di.to_be_bytes());
            d[10..12].copy_from_slice(&n.to_be_bytes());
            d[12..20].copy_from_slice(&src.to_be_bytes());
            d[20..28].copy_from_slice(&dst.to_be_bytes());
            p.extend_from_slice(&d);
        }
        p
    }

    /// EXTENDED COPY through a raw session, with 64 KiB task buffers: a copy larger than
    /// the buffer's work area (several read/write pieces) and then an overlapping one
    /// (destination inside the source: copied back to front) read back exactly as a copy
    /// through an unbounded buffer would leave them; COPY STATUS reports the held result
    /// once; a CSCD naming another logical unit is unreachable and copies nothing.
    #[test]
    fn extended_copy_blocks_read_back_equal_to_the_source() {
        let mut t = Target::start(1, 8);
        let mut r = Raw::login(t.port, &t.name, false);
        let mut sn = r.ping().u32_at(28);
        let mut next = || {
            sn = sn.wrapping_add(1);
            sn.wrapping_sub(1)
        };
        // This LUN's NAA designator, from the Device Identification page.
        let (st, page, _) = command(&mut r, next(), &[0x12, 0x01, 0x83, 0x01, 0x00], &[], 256);
        assert_eq!(st, 0);
        let mut at = 4;
        let mut naa = Vec::new();
        while at + 4 <= page.len() {
            let len = usize::from(page[at + 3]);
            if page[at + 1] & 0x3f == 0x03 {
                naa = page[at + 4..at + 4 + len].to_vec();
                break;
            }
            at += 4 + len;
        }
        assert_eq!(naa.len(), 16, "no NAA designator in {page:02x?}");
        // 300 distinct blocks at LBA 0, in 8 KiB writes.
        let src: Vec<u8> = (0..300 * 512)
            .map(|i: usize| ((i / 512) as u8) ^ (i as u8).wrapping_mul(7))
            .collect();
        for (k, chunk) in src.chunks(16 * 512).enumerate() {
            let mut cdb = [0u8; 10];
            cdb[0] = 0x2a;
            cdb[2..6].copy_from_slice(&(16 * k as u32).to_be_bytes());
            cdb[7..9].copy_from_slice(&((chunk.len() / 512) as u16).to_be_bytes());
            let (st, _, sense) = command(&mut r, next(), &cdb, chunk, 0);
            assert_eq!(st, 0, "write: {sense:02x?}");
        }
        // Segment 1: LBA 0..300 to 1000..1300 (three pieces of at most 120 blocks);
        // segment 2: 1000..1200 to 1050..1250, overlapping.
        let list = xcopy_list(5, &[&naa], &[(0, 0, 300, 0, 1000), (0, 0, 200, 1000, 1050)]);
        let mut cdb = [0u8; 16];
        cdb[0] = 0x83;
        cdb[10..14].copy_from_slice(&(list.len() as u32).to_be_bytes());
        let (st, _, sense) = command(&mut r, next(), &cdb, &list, 0);
        assert_eq!(st, 0, "EXTENDED COPY: {sense:02x?}");
        let mut want = src.clone();
        want.copy_within(0..200 * 512, 50 * 512);
        // Read back in 100-block reads (the longest transfer is 64 KiB here).
        let got: Vec<u8> = (0..3)
            .flat_map(|k| read10(&mut r, next(), 1000 + 100 * k, 100))
            .collect();
        assert!(got == want, "copied blocks differ from the source");
        // COPY STATUS: completed, 2 segments, 500 blocks written; then discarded.
        let mut rcr = [0u8; 16];
        rcr[0] = 0x84;
        rcr[2] = 5;
        rcr[10..14].copy_from_slice(&64u32.to_be_bytes());
        let (st, data, _) = command(&mut r, next(), &rcr, &[], 64);
        assert_eq!(st, 0);
        assert_eq!(&data[4..8], &[0x01, 0, 2, 0], "status, segments, units");
        assert_eq!(
            u32::from_be_bytes(data[8..12].try_into().unwrap()),
            500 * 512
        );
        let (st, _, sense) = command(&mut r, next(), &rcr, &[], 64);
        assert_eq!(
            (st, sense[2] & 0x0f, sense[12]),
            (0x02, 0x05, 0x24),
            "held twice"
        );
        // Another logical unit's designator: COPY ABORTED / UNREACHABLE COPY TARGET.
        let list = xcopy_list(6, &[&naa, &[0x61; 16]], &[(0, 1, 10, 0, 2000)]);
        cdb[10..14].copy_from_slice(&(list.len() as u32).to_be_bytes());
        let (st, _, sense) = command(&mut r, next(), &cdb, &list, 0);
        assert_eq!(
            (st, sense[2] & 0x0f, sense[12], sense[13]),
            (0x02, 0x0a, 0x08, 0x04)
        );
        assert!(read10(&mut r, next(), 2000, 10).iter().all(|&b| b == 0));
        drop(r);
        t.stop();
    }

    /// With every task buffer taken by writes waiting for their (solicited) data, further
    /// commands are answered TASK SET FULL instead of being left unread — the Data-Out
    /// behind them still flows, the waiting writes complete, and the data reads back.
    #[test]
    fn no_free_buffer_answers_task_set_full_and_data_keeps_flowing() {
        let mut t = Target::start(1, 2);
        let mut r = Raw::login_with(
            t.port,
            &t.name,
            LoginOpts {
                no_immediate: true,
                ..LoginOpts::default()
            },
        );
        let sn = r.ping().u32_at(28);
        // Four 8 KiB writes, no data yet: two get buffers (and R2Ts), two TASK SET FULL.
        let itts: Vec<u32> = (0..4)
            .map(|i| write10(&mut r, sn.wrapping_add(i), 16 * i, 16))
            .collect();
        let mut r2t = Vec::new();
        let mut full = Vec::new();
        while r2t.len() + full.len() < 4 {
            let (b, _) = r.read().expect("R2T or response");
            match b.opcode() {
                op::R2T => {
                    assert_eq!((b.u32_at(40), b.u32_at(44)), (0, 8192), "R2T offset/length");
                    r2t.push((b.itt(), b.u32_at(20)));
                }
                op::SCSI_RESP => {
                    assert_eq!(b.raw[3], 0x28, "status of a command without a buffer");
                    full.push(b.itt());
                }
                o => panic!("unexpected opcode {o:#x}"),
            }
        }
        assert_eq!(r2t.iter().map(|x| x.0).collect::<Vec<_>>(), itts[..2]);
        assert_eq!(full, itts[2..]);
        // The solicited data, in two Data-Out PDUs each: both writes complete.
        for (k, &(itt, ttt)) in r2t.iter().enumerate() {
            for part in 0..2u32 {
                let data = vec![0x40 + k as u8; 4096];
                let h = Header::new(op::DATA_OUT, if part == 1 { 0x80 } else { 0 }, 4096, itt)
                    .u32(20, ttt)
                    .u32(36, part)
                    .u32(40, part * 4096);
                r.send(&h, &data);
            }
        }
        for _ in 0..2 {
            let (b, _) = r.read().expect("SCSI Response");
            assert_eq!((b.opcode(), b.raw[3]), (op::SCSI_RESP, 0), "write status");
        }
        // Retry of the refused ones now succeeds (buffers are back), and everything reads
        // back.
        let sn2 = sn.wrapping_add(4);
        let itt = write10(&mut r, sn2, 32, 16);
        let (b, _) = r.read().expect("R2T");
        assert_eq!((b.opcode(), b.itt()), (op::R2T, itt));
        let h = Header::new(op::DATA_OUT, 0x80, 8192, itt)
            .u32(20, b.u32_at(20))
            .u32(36, 0);
        r.send(&h, &[0x55; 8192]);
        let (b, _) = r.read().expect("SCSI Response");
        assert_eq!((b.opcode(), b.raw[3]), (op::SCSI_RESP, 0));
        let got = read10(&mut r, sn2.wrapping_add(1), 0, 48);
        assert!(got[..8192].iter().all(|&x| x == 0x40));
        assert!(got[8192..16384].iter().all(|&x| x == 0x41));
        assert!(got[16384..].iter().all(|&x| x == 0x55));
        drop(r);
        t.stop();
    }

    /// A write larger than MaxBurstLength is solicited in bursts, MaxOutstandingR2T of
    /// them at a time (R2TSN, offsets and lengths per RFC 7143 §11.8), each with its own
    /// TTT and DataSN sequence; the data lands where it belongs.
    #[test]
    fn several_r2ts_outstanding_solicit_a_write_in_bursts() {
        let mut t = Target::start(1, 8);
        let mut r = Raw::login_with(
            t.port,
            &t.name,
            LoginOpts {
                no_immediate: true,
                max_burst: 8192,
                max_r2t: 3,
                ..LoginOpts::default()
            },
        );
        let sn = r.ping().u32_at(28);
        // 64 KiB: 8 bursts of 8 KiB, 3 outstanding at a time.
        let itt = write10(&mut r, sn, 100, 128);
        let pattern = |off: u32| (off / 512 % 251) as u8;
        let mut next_sn = 0;
        let mut done = 0;
        let mut outstanding = Vec::new();
        while done < 8 {
            while outstanding.len() < 3 && next_sn < 8 {
                let (b, _) = r.read().expect("R2T");
                assert_eq!((b.opcode(), b.itt()), (op::R2T, itt));
                assert_eq!(b.u32_at(36), next_sn, "R2TSN");
                assert_eq!(b.u32_at(40), next_sn * 8192, "buffer offset");
                assert_eq!(b.u32_at(44), 8192, "desired length");
                outstanding.push((b.u32_at(20), b.u32_at(40)));
                next_sn += 1;
            }
            // Answer the oldest: two PDUs, DataSN 0 and 1.
            let (ttt, off) = outstanding.remove(0);
            for part in 0..2u32 {
                let o = off + part * 4096;
                let data: Vec<u8> = (0..4096u32).map(|i| pattern(o + i)).collect();
                let h = Header::new(op::DATA_OUT, if part == 1 { 0x80 } else { 0 }, 4096, itt)
                    .u32(20, ttt)
                    .u32(36, part)
                    .u32(40, o);
                r.send(&h, &data);
            }
            done += 1;
        }
        let (b, _) = r.read().expect("SCSI Response");
        assert_eq!((b.opcode(), b.itt(), b.raw[3]), (op::SCSI_RESP, itt, 0));
        let got = read10(&mut r, sn.wrapping_add(1), 100, 128);
        let want: Vec<u8> = (0..65536u32).map(pattern).collect();
        assert!(got == want, "data read back differs");
        drop(r);
        t.stop();
    }

    /// A WRITE and a READ four times the largest task buffer (64 KiB) go through it in
    /// windows: the WRITE (FUA, with immediate data) solicits each window's data with R2Ts
    /// that never cross a window boundary, the READ's Data-In continues its DataSN and
    /// buffer offsets across windows, and the data reads back. Beyond the configured
    /// maximum transfer length a command is still refused (CHECK CONDITION).
    #[test]
    fn transfers_longer_than_the_buffer_go_in_windows() {
        let mut t = Target::start_with(1, 8, |c| c.max_transfer_bytes = 1 << 20);
        let mut r = Raw::login_with(
            t.port,
            &t.name,
            LoginOpts {
                max_burst: 24576,
                max_r2t: 3,
                ..LoginOpts::default()
            },
        );
        let sn = r.ping().u32_at(28);
        let total = 256u32 << 10;
        let pattern = |off: u32| ((off / 512 * 7 + off % 512) % 253) as u8;
        // WRITE(10), FUA, 512 blocks, 8 KiB immediate data.
        r.itt += 1;
        let itt = r.itt;
        let mut cdb = [0u8; 16];
        cdb[0] = 0x2a;
        cdb[1] = 0x08;
        cdb[2..6].copy_from_slice(&300u32.to_be_bytes());
        cdb[7..9].copy_from_slice(&512u16.to_be_bytes());
        let imm: Vec<u8> = (0..8192u32).map(pattern).collect();
        let h = Header::new(op::SCSI_CMD, 0x80 | 0x20, 8192, itt)
            .u32(20, total)
            .u32(24, sn)
            .bytes(32, &cdb);
        r.send(&h, &imm);
        let mut covered = 8192u32;
        let mut r2t_sn = 0;
        let status = loop {
            let (b, _) = r.read().expect("R2T or SCSI Response");
            assert_eq!(b.itt(), itt);
            if b.opcode() == op::SCSI_RESP {
                break b.raw[3];
            }
            assert_eq!(b.opcode(), op::R2T);
            assert_eq!(b.u32_at(36), r2t_sn, "R2TSN continues across windows");
            r2t_sn += 1;
            let (ttt, off, len) = (b.u32_at(20), b.u32_at(40), b.u32_at(44));
            assert_eq!(off, covered, "R2Ts solicit the data in order");
            assert!(len > 0 && len <= 24576);
            assert_eq!(
                off / 65536,
                (off + len - 1) / 65536,
                "R2T {off}+{len} crosses a window"
            );
            let mut o = off;
            let mut data_sn = 0;
            while o < off + len {
                let n = (off + len - o).min(4096);
                let data: Vec<u8> = (o..o + n).map(pattern).collect();
                let last = o + n == off + len;
                let h = Header::new(op::DATA_OUT, if last { 0x80 } else { 0 }, n, itt)
                    .u32(20, ttt)
                    .u32(36, data_sn)
                    .u32(40, o);
                r.send(&h, &data);
                data_sn += 1;
                o += n;
            }
            covered = off + len;
        };
        assert_eq!(status, 0, "windowed write status");
        assert_eq!(covered, total);
        // 8 KiB..64 KiB in bursts of 24 KiB, cut at the window: 3; then 3 per window.
        assert_eq!(r2t_sn, 3 + 3 * 3);
        // READ(10) of the same 512 blocks.
        r.itt += 1;
        let mut cdb = [0u8; 16];
        cdb[0] = 0x28;
        cdb[2..6].copy_from_slice(&300u32.to_be_bytes());
        cdb[7..9].copy_from_slice(&512u16.to_be_bytes());
        let h = Header::new(op::SCSI_CMD, 0x80 | 0x40, 0, r.itt)
            .u32(20, total)
            .u32(24, sn.wrapping_add(1))
            .bytes(32, &cdb);
        r.send(&h, &[]);
        let mut got = Vec::new();
        let mut data_sn = 0;
        loop {
            let (b, d) = r.read().expect("Data-In");
            assert_eq!((b.opcode(), b.itt()), (op::DATA_IN, r.itt));
            assert_eq!(b.u32_at(36), data_sn, "DataSN continues across windows");
            assert_eq!(b.u32_at(40) as usize, got.len(), "buffer offset");
            data_sn += 1;
            got.extend_from_slice(&d);
            if b.flags() & 0x01 != 0 {
                assert_eq!(b.raw[3], 0, "read status");
                break;
            }
        }
        let want: Vec<u8> = (0..total).map(pattern).collect();
        assert!(got == want, "data read back differs");
        // A READ(10) above MAXIMUM TRANSFER LENGTH (1 MiB): CHECK CONDITION.
        r.itt += 1;
        let mut cdb = [0u8; 16];
        cdb[0] = 0x28;
        cdb[7..9].copy_from_slice(&2050u16.to_be_bytes());
        let h = Header::new(op::SCSI_CMD, 0x80 | 0x40, 0, r.itt)
            .u32(20, 2050 * 512)
            .u32(24, sn.wrapping_add(2))
            .bytes(32, &cdb);
        r.send(&h, &[]);
        let (b, _) = r.read().expect("SCSI Response");
        assert_eq!(
            (b.opcode(), b.itt(), b.raw[3]),
            (op::SCSI_RESP, r.itt, 0x02)
        );
        drop(r);
        t.stop();
    }

    /// A Data-Out whose DataSN skips (an earlier one lost to a digest error the target did
    /// not see, RFC 7143 §7.9) fails its task with ABORTED COMMAND / PROTOCOL SERVICE CRC
    /// ERROR once the outstanding bursts are answered (§7.8, ERL 0), writes nothing, and
    /// leaves the connection up; the next write on it works.
    #[test]
    fn a_datasn_gap_fails_the_task_and_keeps_the_connection() {
        let mut t = Target::start(1, 8);
        let mut r = Raw::login_with(
            t.port,
            &t.name,
            LoginOpts {
                no_immediate: true,
                max_burst: 8192,
                max_r2t: 2,
                ..LoginOpts::default()
            },
        );
        let sn = r.ping().u32_at(28);
        let send_burst = |r: &mut Raw, itt: u32, ttt: u32, off: u32, sns: [u32; 2], fill: u8| {
            for (part, &data_sn) in sns.iter().enumerate() {
                let o = off + part as u32 * 4096;
                let h = Header::new(op::DATA_OUT, if part == 1 { 0x80 } else { 0 }, 4096, itt)
                    .u32(20, ttt)
                    .u32(36, data_sn)
                    .u32(40, o);
                r.send(&h, &[fill; 4096]);
            }
        };
        // 32 KiB = 4 bursts of 8 KiB, 2 outstanding. The first burst's second PDU says
        // DataSN 5 instead of 1.
        let itt = write10(&mut r, sn, 200, 64);
        let mut r2ts = Vec::new();
        for k in 0..2u32 {
            let (b, _) = r.read().expect("R2T");
            assert_eq!((b.opcode(), b.itt(), b.u32_at(36)), (op::R2T, itt, k));
            r2ts.push((b.u32_at(20), b.u32_at(40)));
        }
        send_burst(&mut r, itt, r2ts[0].0, r2ts[0].1, [0, 5], 0xab);
        // The second R2T was already sent: its data is awaited, then the task fails. No
        // third R2T is solicited.
        send_burst(&mut r, itt, r2ts[1].0, r2ts[1].1, [0, 1], 0xab);
        let (b, data) = r.read().expect("SCSI Response");
        assert_eq!(
            (b.opcode(), b.itt(), b.raw[3]),
            (op::SCSI_RESP, itt, 0x02), // CHECK CONDITION
            "the write after a DataSN gap"
        );
        // Sense data: 2-byte length, then fixed format: key at 2, ASC/ASCQ at 12/13.
        assert_eq!(
            (data[2 + 2] & 0x0f, data[2 + 12], data[2 + 13]),
            (0x0b, 0x47, 0x05),
            "ABORTED COMMAND / PROTOCOL SERVICE CRC ERROR"
        );
        // Nothing of it was written; the connection still serves a good write.
        assert!(
            read10(&mut r, sn.wrapping_add(1), 200, 64)
                .iter()
                .all(|&x| x == 0),
            "a failed write changed the blocks"
        );
        let itt = write10(&mut r, sn.wrapping_add(2), 200, 16);
        let (b, _) = r.read().expect("R2T");
        assert_eq!((b.opcode(), b.itt()), (op::R2T, itt));
        send_burst(&mut r, itt, b.u32_at(20), 0, [0, 1], 0xcd);
        let (b, _) = r.read().expect("SCSI Response");
        assert_eq!((b.opcode(), b.itt(), b.raw[3]), (op::SCSI_RESP, itt, 0));
        assert!(read10(&mut r, sn.wrapping_add(3), 200, 16)
            .iter()
            .all(|&x| x == 0xcd));
        drop(r);
        t.stop();
    }

    /// An initiator that leaves an R2T unanswered (while answering nothing else) is cut
    /// after the stall timeout, and the buffer its task held comes back.
    #[test]
    fn unanswered_r2t_cuts_the_connection_after_the_stall_timeout() {
        let mut t = Target::start_with(1, 4, |c| c.stall_timeout = Duration::from_secs(1));
        let mut r = Raw::login_with(
            t.port,
            &t.name,
            LoginOpts {
                no_immediate: true,
                ..LoginOpts::default()
            },
        );
        let sn = r.ping().u32_at(28);
        let itt = write10(&mut r, sn, 0, 16);
        let (b, _) = r.read().expect("R2T");
        assert_eq!((b.opcode(), b.itt()), (op::R2T, itt));
        r.s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        let started = Instant::now();
        assert!(r.closed(), "the stalled connection was not cut");
        assert!(started.elapsed() >= Duration::from_millis(900));
        // The target serves on, and every buffer is home at stop.
        let mut r = Raw::login(t.port, &t.name, false);
        r.ping();
        drop(r);
        t.stop();
    }

    /// A second connection joins a session (same ISID, its TSIH, another CID): both carry
    /// commands of the one CmdSN window; a login naming an unknown TSIH is refused.
    #[test]
    fn abort_task_answers_by_whether_the_task_was_still_running() {
        let mut t = Target::start(1, 16);
        let mut a = Raw::login(t.port, &t.name, false);
        let sn = a.ping().u32_at(28);
        a.test_unit_ready(sn);
        let done_itt = a.itt;
        let (resp, _) = a.read().expect("SCSI Response");
        assert_eq!((resp.opcode(), resp.raw[3]), (op::SCSI_RESP, 0));
        // ABORT TASK (immediate) of a task whose status was sent: RefCmdSN is behind the
        // window, so "Task does not exist" (RFC 7143 §11.5.1 c, §11.6.1 response 1) —
        // never "Function complete" after the task's own status.
        let tmf = |rtt: u32, ref_sn: u32, itt: u32| {
            Header::new(op::TMF_REQ | 0x40, 0x80 | 1, 0, itt)
                .u32(20, rtt)
                .u32(24, sn.wrapping_add(1))
                .u32(32, ref_sn)
        };
        a.send(&tmf(done_itt, sn, 900), &[]);
        let (r, _) = a.read().expect("TMF response");
        assert_eq!((r.opcode(), r.raw[2]), (op::TMF_RESP, 1), "finished task");
        // A task never received whose CmdSN is inside the window: considered received,
        // "Function complete" (rule b).
        a.send(&tmf(4242, sn.wrapping_add(1), 901), &[]);
        let (r, _) = a.read().expect("TMF response");
        assert_eq!(
            (r.opcode(), r.raw[2]),
            (op::TMF_RESP, 0),
            "RefCmdSN in the window"
        );
        drop(a);
        t.stop();
    }

    /// Sends COMPARE AND WRITE of one block at `lba` (verify data, then write data, as
    /// immediate data) on `r`; returns its ITT. The caller reads the response.
    fn caw_send(r: &mut Raw, lba: u64, verify: &[u8; 512], write: &[u8; 512]) -> u32 {
        r.itt += 1;
        let mut cdb = [0u8; 16];
        cdb[0] = 0x89;
        cdb[2..10].copy_from_slice(&lba.to_be_bytes());
        cdb[13] = 1;
        let mut data = verify.to_vec();
        data.extend_from_slice(write);
        let h = Header::new(op::SCSI_CMD, 0x80 | 0x20, 1024, r.itt)
            .u32(20, 1024)
            .u32(24, r.cmd_sn)
            .bytes(32, &cdb);
        r.cmd_sn = r.cmd_sn.wrapping_add(1);
        r.send(&h, &data);
        r.itt
    }

    /// The response to COMPARE AND WRITE `itt` on `r`: `true` for GOOD, `false` for
    /// CHECK CONDITION with MISCOMPARE sense (anything else fails the test).
    fn caw_won(r: &mut Raw, itt: u32) -> bool {
        let (b, d) = r.read().expect("SCSI Response");
        assert_eq!((b.opcode(), b.itt()), (op::SCSI_RESP, itt));
        match b.raw[3] {
            0 => true,
            2 => {
                // Sense length (2 bytes), then fixed-format sense data.
                let sense = &d[2..];
                assert_eq!(
                    (sense[2] & 0x0f, sense[12], sense[13]),
                    (0x0e, 0x1d, 0x00),
                    "MISCOMPARE sense"
                );
                assert_eq!(sense[0] & 0x80, 0x80, "INFORMATION valid");
                false
            }
            s => panic!("COMPARE AND WRITE status {s:#x}"),
        }
    }

    /// Two initiators (two sessions) race COMPARE AND WRITE on one block, 200 rounds,
    /// each expecting the block's current contents and bringing its own new data, over
    /// two reactors: the engine's compare-and-write holds the stripe from the read through
    /// the write, so exactly one wins every round and the block reads back the winner's
    /// data (before issue 20 the front end read, compared and wrote in three steps, and
    /// both could win).
    #[test]
    fn compare_and_write_races_have_one_winner() {
        let mut t = Target::start(2, 16);
        let mut a = Raw::login(t.port, &t.name, false);
        let mut b = Raw::login_with(
            t.port,
            &t.name,
            LoginOpts {
                isid: [0x80, 0, 0, 0x12, 0x34, 0x57],
                ..LoginOpts::default()
            },
        );
        assert_ne!(a.tsih, b.tsih, "two sessions");
        let lba = 37u64;
        let mut current = [0u8; 512];
        for round in 0..200u32 {
            let mut new_a = [0u8; 512];
            let mut new_b = [0u8; 512];
            for (i, (x, y)) in new_a.iter_mut().zip(new_b.iter_mut()).enumerate() {
                *x = (round as usize * 7 + i) as u8 | 1;
                *y = (round as usize * 13 + i) as u8 & 0xfe;
            }
            // Alternate who sends first.
            let (ia, ib) = if round % 2 == 0 {
                let ia = caw_send(&mut a, lba, &current, &new_a);
                (ia, caw_send(&mut b, lba, &current, &new_b))
            } else {
                let ib = caw_send(&mut b, lba, &current, &new_b);
                (caw_send(&mut a, lba, &current, &new_a), ib)
            };
            let (wa, wb) = (caw_won(&mut a, ia), caw_won(&mut b, ib));
            assert!(wa ^ wb, "round {round}: a won {wa}, b won {wb}");
            let winner = if wa { new_a } else { new_b };
            let sn = a.cmd_sn;
            a.cmd_sn = sn.wrapping_add(1);
            let back = read10(&mut a, sn, lba as u32, 1);
            assert_eq!(
                &back[..],
                &winner[..],
                "round {round}: not the winner's data"
            );
            current = winner;
        }
        drop((a, b));
        t.stop();
    }

    /// A shutdown under an initiator that streams writes ends its connection gracefully.
    /// The initiator sends 1024 WRITE(10)s of 64 KiB immediate data (64 MiB over the
    /// first 16 MiB, far more than the socket buffers hold) as fast as the target takes
    /// them, and the target is shut down after the first response: it answers the tasks
    /// it had, drops the commands that come after, and ends the connection with the
    /// initiator's bytes still unread. The initiator must read every response and then the
    /// end of stream, and must be able to send all it had: closing a socket with unread
    /// bytes resets the connection (RFC 1122 4.2.2.13), which shows the initiator
    /// ECONNRESET and can lose responses still queued, so the target shuts its side down
    /// and discards what still comes until the initiator closes.
    #[test]
    fn a_drain_ends_with_every_response_then_the_end_of_stream_not_a_reset() {
        const N: u32 = 1024;
        const LEN: u32 = 64 << 10;
        const REGIONS: u32 = 256;
        const ITT0: u32 = 1000;
        let mut t = Target::start(1, 16);
        let mut r = Raw::login(t.port, &t.name, false);
        let sn = r.ping().u32_at(28);
        let mut tx = r.s.try_clone().unwrap();
        let f = r.f;
        let sender = std::thread::spawn(move || {
            let payload = vec![0x5au8; LEN as usize];
            let mut buf = vec![0u8; pdu::pdu_bytes(LEN as usize, &f)];
            let mut sent = 0u32;
            for i in 0..N {
                let mut cdb = [0u8; 16];
                cdb[0] = 0x2a;
                cdb[2..6].copy_from_slice(&((i % REGIONS) * (LEN / 512)).to_be_bytes());
                cdb[7..9].copy_from_slice(&((LEN / 512) as u16).to_be_bytes());
                let h = Header::new(op::SCSI_CMD, 0x80 | 0x20, LEN, ITT0 + i)
                    .u32(20, LEN)
                    .u32(24, sn.wrapping_add(i))
                    .bytes(32, &cdb);
                let n = pdu::write_pdu(&mut buf, &h, &payload, &f);
                if tx.write_all(&buf[..n]).is_err() {
                    break;
                }
                sent += 1;
            }
            // Everything sent (or the target stopped taking bytes): our side ends.
            let _ = tx.shutdown(std::net::Shutdown::Write);
            sent
        });
        let mut first = [0u8; 48];
        r.s.read_exact(&mut first).unwrap();
        t.server.take().expect("running").shutdown();
        r.s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut rest = Vec::new();
        let end = r.s.read_to_end(&mut rest);
        let sent = sender.join().unwrap();
        let mut all = first.to_vec();
        all.extend_from_slice(&rest);
        let mut answered = Vec::new();
        let mut at = 0;
        while at + 48 <= all.len() {
            let b = Bhs::parse(&all[at..at + 48]).unwrap();
            assert_eq!(
                b.opcode(),
                op::SCSI_RESP,
                "PDU {} is no SCSI Response",
                answered.len()
            );
            // GOOD, or TASK SET FULL when no buffer was free.
            assert!(
                matches!(b.raw[3], 0 | 0x28),
                "write {} ended with status {:#x}",
                b.itt() - ITT0,
                b.raw[3]
            );
            answered.push(b.itt() - ITT0);
            at += b.wire_bytes(false, false);
        }
        assert!(
            end.is_ok(),
            "the connection was reset instead of ended after {} responses: {end:?}",
            answered.len()
        );
        assert_eq!(at, all.len(), "a response cut short");
        // The target took (and threw away) what the initiator still sent until it ended
        // its side, rather than resetting the connection under it.
        assert_eq!(sent, N, "the initiator could not send all its writes");
        // One response per accepted write, none twice, none for a write never sent.
        let n = answered.len();
        answered.sort_unstable();
        answered.dedup();
        assert_eq!(answered.len(), n, "a response sent twice");
        assert!(
            answered.iter().all(|&i| i < sent),
            "{answered:?} of {sent} sent"
        );
        assert!(
            (n as u32) < N,
            "the drain accepted every write: nothing was cut"
        );
        eprintln!("{sent} writes sent, {n} answered before the end of stream");
        t.stop();
    }

    #[test]
    fn two_connections_share_one_session() {
        let mut t = Target::start(2, 16);
        let mut a = Raw::login(t.port, &t.name, false);
        let sn = a.ping().u32_at(28);
        let mut b = Raw::login_with(
            t.port,
            &t.name,
            LoginOpts {
                tsih: a.tsih,
                cid: 1,
                ..LoginOpts::default()
            },
        );
        assert_eq!(b.tsih, a.tsih);
        // A command on B advances the session's ExpCmdSN, seen on A.
        b.test_unit_ready(sn);
        let (resp, _) = b.read().expect("SCSI Response");
        assert_eq!((resp.opcode(), resp.raw[3]), (op::SCSI_RESP, 0));
        assert_eq!(a.ping().u32_at(28), sn.wrapping_add(1));
        a.test_unit_ready(sn.wrapping_add(1));
        let (resp, _) = a.read().expect("SCSI Response");
        assert_eq!(resp.u32_at(28), sn.wrapping_add(2));
        assert_eq!(b.ping().u32_at(28), sn.wrapping_add(2));
        // Joining a session that does not exist: login status 0x020a.
        let mut s = TcpStream::connect(("127.0.0.1", t.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut kv = Vec::new();
        text::put(
            &mut kv,
            "InitiatorName",
            "iqn.2026-11.org.ferroraid:raw-test",
        );
        text::put(&mut kv, "TargetName", &t.name);
        text::put(&mut kv, "AuthMethod", "None");
        let h = Header::new(op::LOGIN_REQ | 0x40, 0x80 | 0x03, kv.len() as u32, 1)
            .bytes(8, &[0x80, 0, 0, 0x12, 0x34, 0x56])
            .u16(14, a.tsih.wrapping_add(100))
            .u16(20, 2);
        let plain = Framing {
            header_digest: false,
            data_digest: false,
            max_recv_data: 65536,
        };
        let mut buf = vec![0u8; pdu::pdu_bytes(kv.len(), &plain)];
        pdu::write_pdu(&mut buf, &h, &kv, &plain);
        s.write_all(&buf).unwrap();
        let mut hdr = [0u8; 48];
        s.read_exact(&mut hdr).unwrap();
        assert_eq!(hdr[0] & 0x3f, op::LOGIN_RESP);
        assert_eq!(u16::from_be_bytes([hdr[36], hdr[37]]), 0x020a);
        drop((a, b));
        t.stop();
    }

    /// One SCSI command with `out` as immediate data (at most FirstBurstLength) and up
    /// to `din` bytes of data-in: its status and its data-in, or its sense data.
    fn scsi(r: &mut Raw, cdb: &[u8], out: &[u8], din: u32) -> (u8, Vec<u8>) {
        r.itt += 1;
        let mut c = [0u8; 16];
        c[..cdb.len()].copy_from_slice(cdb);
        let mut flags = 0x80;
        if !out.is_empty() {
            flags |= 0x20;
        }
        if din > 0 {
            flags |= 0x40;
        }
        let edtl = if out.is_empty() {
            din
        } else {
            out.len() as u32
        };
        let h = Header::new(op::SCSI_CMD, flags, out.len() as u32, r.itt)
            .u32(20, edtl)
            .u32(24, r.cmd_sn)
            .bytes(32, &c);
        r.cmd_sn += 1;
        r.send(&h, out);
        let mut data = Vec::new();
        loop {
            let (b, d) = r.read().expect("a response");
            assert_eq!(b.itt(), r.itt, "opcode {:#x}", b.opcode());
            match b.opcode() {
                op::DATA_IN => {
                    data.extend_from_slice(&d);
                    if b.flags() & 0x01 != 0 {
                        return (b.raw[3], data);
                    }
                }
                op::SCSI_RESP => {
                    if data.is_empty() && d.len() > 2 {
                        data = d[2..].to_vec();
                    }
                    return (b.raw[3], data);
                }
                o => panic!("unexpected PDU {o:#x}"),
            }
        }
    }

    const GOOD: u8 = 0;
    const CHECK: u8 = 2;
    const CONFLICT: u8 = 0x18;

    fn prout(r: &mut Raw, sa: u8, kind: u8, key: u64, sa_key: u64, aptpl: bool) -> (u8, Vec<u8>) {
        let mut p = [0u8; 24];
        p[..8].copy_from_slice(&key.to_be_bytes());
        p[8..16].copy_from_slice(&sa_key.to_be_bytes());
        p[20] = u8::from(aptpl);
        scsi(r, &[0x5f, sa, kind, 0, 0, 0, 0, 0, 24, 0], &p, 0)
    }

    /// READ KEYS: (PRgeneration, keys).
    fn read_keys(r: &mut Raw) -> (u32, Vec<u64>) {
        let (st, d) = scsi(r, &[0x5e, 0, 0, 0, 0, 0, 0, 0x10, 0, 0], &[], 4096);
        assert_eq!(st, GOOD);
        let n = u32::from_be_bytes(d[4..8].try_into().unwrap()) as usize;
        let keys = d[8..8 + n]
            .chunks(8)
            .map(|k| u64::from_be_bytes(k.try_into().unwrap()))
            .collect();
        (u32::from_be_bytes(d[..4].try_into().unwrap()), keys)
    }

    /// READ RESERVATION: (key, type) or `None`.
    fn read_reservation(r: &mut Raw) -> Option<(u64, u8)> {
        let (st, d) = scsi(r, &[0x5e, 1, 0, 0, 0, 0, 0, 0x10, 0, 0], &[], 4096);
        assert_eq!(st, GOOD);
        if u32::from_be_bytes(d[4..8].try_into().unwrap()) == 0 {
            return None;
        }
        Some((
            u64::from_be_bytes(d[8..16].try_into().unwrap()),
            d[21] & 0x0f,
        ))
    }

    fn write1(r: &mut Raw, lba: u8) -> (u8, Vec<u8>) {
        scsi(r, &[0x2a, 0, 0, 0, 0, lba, 0, 0, 1, 0], &[0x5a; 512], 0)
    }
    fn read1(r: &mut Raw, lba: u8) -> (u8, Vec<u8>) {
        scsi(r, &[0x28, 0, 0, 0, 0, lba, 0, 0, 1, 0], &[], 512)
    }

    fn login_as(t: &Target, initiator: &'static str, isid_low: u8) -> Raw {
        Raw::login_with(
            t.port,
            &t.name,
            LoginOpts {
                initiator,
                isid: [0x80, 0, 0, 0, 0, isid_low],
                ..LoginOpts::default()
            },
        )
    }

    const A: &str = "iqn.2026-11.org.ferroraid:initiator-a";
    const B: &str = "iqn.2026-11.org.ferroraid:initiator-b";

    /// The real binary keeps APTPL state in the record before each member's superblock:
    /// A registers and reserves Write Exclusive with APTPL, the target stops; the record is
    /// on every member; started again (members given in another order), the reservation
    /// is there — B's write conflicts, A's runs — and mdadm still reads the superblocks.
    #[test]
    fn aptpl_reservations_survive_a_restart_on_the_members() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let mut arr = create(d, "aptpl", 4, 9 * MIB);
        let login = |srv: &Server, initiator: &'static str, low: u8| {
            Raw::login_with(
                srv.iscsi_port.expect("iSCSI"),
                &srv.iscsi_target(),
                LoginOpts {
                    initiator,
                    isid: [0x80, 0, 0, 0, 0, low],
                    ..LoginOpts::default()
                },
            )
        };
        let mut srv = serve(d, "aptpl1", &arr, &["--reactors", "2"]);
        let mut a = login(&srv, A, 1);
        assert_eq!(prout(&mut a, 0, 0, 0, 0xa1, true).0, GOOD, "REGISTER");
        assert_eq!(prout(&mut a, 1, 1, 0xa1, 0, true).0, GOOD, "RESERVE WE");
        drop(a);
        srv.stop();
        for m in &arr.members {
            let head = fs::read(m).unwrap();
            assert_eq!(&head[..8], b"FRRSV\0\x01\0", "record on {}", m.display());
        }
        arr.members.reverse();
        let mut srv = serve(d, "aptpl2", &arr, &["--reactors", "2"]);
        let mut a = login(&srv, A, 1);
        let mut b = login(&srv, B, 2);
        assert_eq!(read_reservation(&mut b), Some((0xa1, 1)));
        assert_eq!(write1(&mut b, 4).0, CONFLICT);
        assert_eq!(write1(&mut a, 4).0, GOOD);
        // RELEASE and unregister: the record keeps the cleared state across a restart.
        assert_eq!(prout(&mut a, 2, 1, 0xa1, 0, true).0, GOOD, "RELEASE");
        assert_eq!(prout(&mut a, 0, 0, 0xa1, 0, true).0, GOOD, "unregister");
        drop((a, b));
        srv.stop();
        let mut srv = serve(d, "aptpl3", &arr, &[]);
        let mut b = login(&srv, B, 2);
        assert_eq!(read_reservation(&mut b), None);
        assert_eq!(write1(&mut b, 4).0, GOOD);
        drop(b);
        srv.stop();
        if let Some(mdadm) = tool("mdadm") {
            let out = run_tool(
                Command::new(mdadm).arg("--examine").arg(&arr.members[0]),
                d,
                TOOL_TIMEOUT,
            );
            assert!(
                out.status.success(),
                "mdadm --examine: {}",
                show_output(&out)
            );
        }
    }

    /// Sends a one-block WRITE(10) of `lba` without data and reads the R2T that solicits
    /// it: the write's ITT and that R2T.
    fn write_awaiting_data(r: &mut Raw, lba: u8) -> (u32, Bhs) {
        r.itt += 1;
        let mut cdb = [0u8; 16];
        cdb[..10].copy_from_slice(&[0x2a, 0, 0, 0, 0, lba, 0, 0, 1, 0]);
        let h = Header::new(op::SCSI_CMD, 0x80 | 0x20, 0, r.itt)
            .u32(20, 512)
            .u32(24, r.cmd_sn)
            .bytes(32, &cdb);
        r.cmd_sn += 1;
        r.send(&h, &[]);
        let (r2t, _) = r.read().expect("R2T");
        assert_eq!((r2t.opcode(), r2t.itt()), (op::R2T, r.itt));
        (r.itt, r2t)
    }

    /// PREEMPT AND ABORT from B (on either reactor) aborts A's task that waits for its
    /// data: no status ever comes for it, its data is not written, and A's next command
    /// reports REGISTRATIONS PREEMPTED.
    #[test]
    fn preempt_and_abort_aborts_the_preempted_nexus_tasks() {
        let mut t = Target::start_full(2, 8, |_| {}, None);
        let mut a = login_as(&t, A, 1);
        let mut b = login_as(&t, B, 2);
        let (ka, kb) = (0xa, 0xb);
        assert_eq!(prout(&mut a, 6, 0, 0, ka, false).0, GOOD);
        assert_eq!(prout(&mut b, 6, 0, 0, kb, false).0, GOOD);
        assert_eq!(prout(&mut a, 1, 1, ka, 0, false).0, GOOD, "A reserves WE");
        // A's WRITE of block 7, its data solicited and never sent.
        let (write_itt, r2t) = write_awaiting_data(&mut a, 7);
        // B: PREEMPT AND ABORT A's key, taking the reservation.
        assert_eq!(prout(&mut b, 5, 1, kb, ka, false).0, GOOD);
        // A's data arrives late: dropped with its task.
        let dout = Header::new(op::DATA_OUT, 0x80, 512, write_itt)
            .u32(20, r2t.u32_at(20))
            .u32(40, 0);
        a.send(&dout, &[0x77; 512]);
        // The next answer A gets is its TEST UNIT READY's (scsi() checks the ITT): the
        // unit attention, and no status for the aborted write.
        let (st, sense) = scsi(&mut a, &[0; 6], &[], 0);
        assert_eq!(st, CHECK);
        assert_eq!((sense[2] & 0x0f, sense[12], sense[13]), (0x06, 0x2a, 0x05));
        assert_eq!(
            read1(&mut b, 7),
            (GOOD, vec![0; 512]),
            "aborted data not written"
        );
        assert_eq!(read_reservation(&mut a), Some((kb, 1)));
        drop((a, b));
        t.stop();
    }

    /// A LOGICAL UNIT RESET from B's session aborts A's waiting task although A's session
    /// lives on the other reactor; A then hears BUS DEVICE RESET FUNCTION OCCURRED.
    #[test]
    fn a_logical_unit_reset_aborts_tasks_on_every_reactor() {
        let mut t = Target::start_full(2, 8, |_| {}, None);
        let mut a = login_as(&t, A, 1);
        let mut b = login_as(&t, B, 2);
        assert_ne!(a.tsih % 2, b.tsih % 2, "the two sessions on two reactors");
        let (write_itt, r2t) = write_awaiting_data(&mut a, 9);
        // LOGICAL UNIT RESET (function 5), immediate, from B.
        b.itt += 1;
        let tmf = Header::new(op::TMF_REQ | 0x40, 0x80 | 5, 0, b.itt)
            .u32(20, pdu::RESERVED_TAG)
            .u32(24, b.cmd_sn);
        b.send(&tmf, &[]);
        let (r, _) = b.read().expect("TMF response");
        assert_eq!(
            (r.opcode(), r.raw[2]),
            (op::TMF_RESP, 0),
            "function complete"
        );
        // The late data: A's reactor looks at the reset (bumped before B's answer was
        // sent) at the start of the turn that reads it, so it finds no task.
        let dout = Header::new(op::DATA_OUT, 0x80, 512, write_itt)
            .u32(20, r2t.u32_at(20))
            .u32(40, 0);
        a.send(&dout, &[0x66; 512]);
        let (st, sense) = scsi(&mut a, &[0; 6], &[], 0);
        assert_eq!(st, CHECK, "A's next command: the unit attention");
        assert_eq!((sense[2] & 0x0f, sense[12], sense[13]), (0x06, 0x29, 0x03));
        assert_eq!(
            read1(&mut a, 9),
            (GOOD, vec![0; 512]),
            "aborted data not written"
        );
        drop((a, b));
        t.stop();
    }

    /// A store with room for one registration (like the 4 KiB record on the members, only
    /// smaller): a second APTPL registration that would not fit is refused INSUFFICIENT
    /// REGISTRATION RESOURCES and changes nothing; without APTPL it is kept in memory.
    #[test]
    fn a_state_the_store_cannot_hold_is_refused_whole() {
        let store = Arc::new(MemoryStore::with_capacity(100));
        let mut t = Target::start_full(1, 8, |_| {}, Some(Arc::clone(&store) as _));
        let mut a = login_as(&t, A, 1);
        let mut b = login_as(&t, B, 2);
        assert_eq!(prout(&mut a, 6, 0, 0, 0xa, true).0, GOOD);
        let saves = store.saves();
        let (st, sense) = prout(&mut b, 6, 0, 0, 0xb, true);
        assert_eq!(st, CHECK);
        assert_eq!(
            (sense[2] & 0x0f, sense[12], sense[13]),
            (0x05, 0x55, 0x04),
            "INSUFFICIENT REGISTRATION RESOURCES"
        );
        assert_eq!(read_keys(&mut b), (1, vec![0xa]), "nothing changed");
        assert_eq!(store.saves(), saves, "nothing saved");
        drop((a, b));
        t.stop();
    }

    /// Two initiators on a target with two reactors: A registers and reserves Write
    /// Exclusive, B's WRITE conflicts while its READ runs; B preempts A, A hears
    /// REGISTRATIONS PREEMPTED and then conflicts; READ KEYS and READ RESERVATION follow.
    /// With APTPL the reservation survives a restart of the target (in-memory store); a
    /// save that fails is CHECK CONDITION MEDIUM ERROR; a corrupt saved state stops the
    /// start.
    #[test]
    fn two_initiators_reserve_preempt_and_aptpl_survives_a_restart() {
        let store = Arc::new(MemoryStore::new());
        let dynstore = || Some(Arc::clone(&store) as Arc<dyn ReservationStore>);
        let mut t = Target::start_full(2, 8, |_| {}, dynstore());
        let mut a = login_as(&t, A, 1);
        let mut b = login_as(&t, B, 2);
        let (ka, kb) = (0xaaaa_0001u64, 0xbbbb_0002u64);
        // REGISTER AND IGNORE EXISTING KEY with APTPL, then RESERVE Write Exclusive.
        assert_eq!(prout(&mut a, 6, 0, 0, ka, true).0, GOOD);
        assert_eq!(prout(&mut b, 6, 0, 0, kb, true).0, GOOD);
        assert_eq!(prout(&mut a, 1, 1, ka, 0, true).0, GOOD);
        assert!(store.saves() >= 3, "APTPL saves: {}", store.saves());
        // B, registered but not the holder: writes conflict, reads run.
        assert_eq!(write1(&mut b, 1).0, CONFLICT);
        assert_eq!(read1(&mut b, 1).0, GOOD);
        assert_eq!(write1(&mut a, 1).0, GOOD);
        assert_eq!(read1(&mut b, 1), (GOOD, vec![0x5a; 512]));
        // A wrong key conflicts.
        assert_eq!(prout(&mut b, 1, 1, ka, 0, true).0, CONFLICT);
        assert_eq!(read_keys(&mut b), (2, vec![ka, kb]));
        assert_eq!(read_reservation(&mut b), Some((ka, 1)));
        // B preempts A's reservation (and registration).
        assert_eq!(prout(&mut b, 4, 1, kb, ka, true).0, GOOD);
        let (st, sense) = scsi(&mut a, &[0; 6], &[], 0);
        assert_eq!(st, CHECK, "A's next command reports the unit attention");
        assert_eq!(
            (sense[2] & 0x0f, sense[12], sense[13]),
            (0x06, 0x2a, 0x05),
            "REGISTRATIONS PREEMPTED"
        );
        assert_eq!(scsi(&mut a, &[0; 6], &[], 0).0, GOOD, "reported once");
        assert_eq!(write1(&mut a, 2).0, CONFLICT);
        assert_eq!(read1(&mut a, 2).0, GOOD);
        assert_eq!(write1(&mut b, 2).0, GOOD);
        assert_eq!(read_keys(&mut a), (3, vec![kb]));
        assert_eq!(read_reservation(&mut a), Some((kb, 1)));
        // A save that fails: CHECK CONDITION, MEDIUM ERROR / WRITE ERROR.
        store.fail_saves(true);
        let (st, sense) = prout(&mut a, 6, 0, 0, ka, true);
        assert_eq!(st, CHECK);
        assert_eq!((sense[2] & 0x0f, sense[12]), (0x03, 0x0c));
        store.fail_saves(false);
        assert_eq!(prout(&mut a, 6, 0, 0, 0, true).0, GOOD, "A unregisters");
        assert_eq!(read_keys(&mut a), (5, vec![kb]));
        // Restart the target: the state comes back from the store.
        drop((a, b));
        t.stop();
        let mut t = Target::start_full(2, 8, |_| {}, dynstore());
        let mut b = login_as(&t, B, 2);
        let mut a = login_as(&t, A, 1);
        assert_eq!(read_reservation(&mut a), Some((kb, 1)));
        assert_eq!(read_keys(&mut a), (5, vec![kb]));
        assert_eq!(write1(&mut a, 3).0, CONFLICT);
        assert_eq!(write1(&mut b, 3).0, GOOD);
        // Another ISID of B's name is another nexus: not the holder.
        let mut b2 = login_as(&t, B, 9);
        assert_eq!(write1(&mut b2, 3).0, CONFLICT);
        // CLEAR drops every registration and the reservation.
        assert_eq!(prout(&mut b, 3, 0, kb, 0, false).0, GOOD);
        assert_eq!(write1(&mut a, 3).0, GOOD);
        assert_eq!(read_reservation(&mut b2), None);
        drop((a, b, b2));
        t.stop();
        // A corrupt saved state: the target refuses to start and leaves it alone.
        let mut bad = store.current().expect("a saved state");
        let last = bad.len() - 1;
        bad[last] ^= 1;
        let corrupt = Arc::new(MemoryStore::with_state(bad.clone()));
        let g = Geometry::new(Level::Raid6, Layout::LeftSymmetric, 6, CHUNK, 512).unwrap();
        let geo = ArrayGeometry::new(g, MEMBER_BYTES / CHUNK).unwrap();
        let cfg = IscsiConfig::default();
        let lun = lun_info("mem", &geo, [7; 16], &cfg);
        let err = IscsiServer::builder(lun)
            .listen("127.0.0.1:0".parse().unwrap())
            .reservation_store(Arc::clone(&corrupt) as Arc<dyn ReservationStore>)
            .start(1)
            .err()
            .expect("a corrupt state must stop the start");
        assert!(matches!(err, IscsiError::Reservations(_)), "{err}");
        assert!(err.to_string().contains("checksum"), "{err}");
        assert_eq!(corrupt.current(), Some(bad));
    }
}
