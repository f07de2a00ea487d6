//! The `ferroraid` binary end to end, as an operator runs it: `ferroraid create` on member
//! files or loop devices, `ferroraid serve --adaptive` started as a process (devices named
//! in a shuffled order, NBD on a free 127.0.0.1 port and a Unix socket in a temporary
//! directory), third-party clients against it (`qemu-io`, `qemu-img`, `nbdinfo`,
//! `nbdcopy`, `fio --ioengine=nbd`, python3-libnbd), and then the members held against
//! `mdadm --examine` and the independent oracle (`../shared/oracle/raidref.py`).
//!
//! - files: RAID6 and RAID5 over sparse files, every client, SIGTERM → exit 0, members
//!   clean, oracle verify + extract = what the clients wrote;
//! - loop devices: the same round trip over `/dev/loopN` (root + losetup);
//! - kill -9 during FUA/flushed writes: members left active (dirty), the restarted target
//!   says a resync is needed, every acknowledged write reads back, and the resync it runs
//!   by itself leaves parity consistent and the members clean;
//! - assembly: another array's member, a blank device, a corrupt superblock, too many
//!   members missing are refused (non-zero exit, the device and the reason named); `--force`
//!   and degraded starts serve the same data; a stale member is never used;
//! - Linux md's own members (the QEMU rig's fixtures) served and read back;
//! - `ferroraid demo` as a new user runs it; `serve --config`.
//!
//! The binary: `cargo test --workspace` builds it (the `ferroraid` package's own tests need
//! it); when it is missing or older than its sources (`cargo test -p ferroraid-tests` after
//! an edit), [`ferroraid`] runs `cargo build -p ferroraid --bin ferroraid` first, so a stale
//! binary is never tested; `FERRORAID_BIN=/path/to/ferroraid` overrides that. A client tool
//! that is not installed skips its part with a printed reason, unless
//! `FERRORAID_REQUIRE_TOOLS=1` (CI); likewise `FERRORAID_REQUIRE_LOOP`, `_MDADM`, `_QEMU`.
//! Every server is killed when its test ends (the guard's `Drop`, and `PR_SET_PDEATHSIG`
//! should the test process itself be killed); loop devices are detached by their guards.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferroraid_tests::target::*;
use ferroraid_tests::{
    attach_loop, ensure_md_fixtures, mdadm, run_tool, seed_of, show_output, tool,
};

#[test]
fn files_raid6_served_to_every_client() {
    files_round_trip(6, "left-symmetric", 6, 2);
}

#[test]
fn files_raid5_served_to_every_client() {
    files_round_trip(5, "left-asymmetric", 5, 1);
}

/// qemu-io writes at `(pattern, offset, length)`, verified by reads, applied to `reference`.
const QEMU_IO_WRITES: [(u8, u64, u64); 5] = [
    (0xab, 0, 64 * KIB),
    (0xcd, 64 * KIB, MIB),
    (0x5a, 3 * MIB, 192 * KIB),
    (0x11, 4608, 512),
    (0x3c, 5 * MIB + 1536, 300 * KIB),
];

fn qemu_io_patterns(srv: &Server, dir: &Path, reference: &mut [u8]) {
    let Some(qemu_io) = tool("qemu-io") else {
        return;
    };
    let mut cmds = Vec::new();
    for (i, &(p, off, len)) in QEMU_IO_WRITES.iter().enumerate() {
        let fua = if i % 2 == 1 { "-f " } else { "" };
        cmds.push(format!("write {fua}-P 0x{p:02x} {off} {len}"));
        reference[off as usize..(off + len) as usize].fill(p);
    }
    cmds.push("flush".into());
    // Every written range read back, with the bytes around it.
    for &(_, off, len) in &QEMU_IO_WRITES {
        let lo = off.saturating_sub(4096);
        let hi = (off + len + 4096).min(reference.len() as u64);
        for (o, l) in split_runs(reference, lo, hi) {
            cmds.push(format!("read -P 0x{:02x} {o} {l}", reference[o as usize]));
        }
    }
    // Asynchronous writes, then one flush for both.
    for (p, off) in [(0x77u8, 8 * MIB), (0x78, 9 * MIB)] {
        cmds.push(format!("aio_write -P 0x{p:02x} {off} 128k"));
        reference[off as usize..(off + 128 * KIB) as usize].fill(p);
    }
    cmds.push("aio_flush".into());
    cmds.push("read -P 0x77 8m 128k".into());
    cmds.push("read -P 0x78 9m 128k".into());
    // The same commands over TCP, then over the Unix socket.
    for uri in [srv.uri(), srv.unix_uri()] {
        let mut c = Command::new(&qemu_io);
        c.args(["-f", "raw"]);
        for x in &cmds {
            c.args(["-c", x]);
        }
        let out = srv.client_ok(c.arg(&uri), dir);
        assert!(
            !out.contains("Pattern verification failed") && !out.contains("error"),
            "{uri}:\n{out}\n{}",
            srv.logs()
        );
    }
}

/// Runs of equal bytes of `data[lo..hi]`, as (offset, length), 512-byte aligned.
fn split_runs(data: &[u8], lo: u64, hi: u64) -> Vec<(u64, u64)> {
    let mut v = Vec::new();
    let mut o = lo;
    while o < hi {
        let b = data[o as usize];
        let mut e = o + 512;
        while e < hi && data[e as usize..(e + 512) as usize].iter().all(|&x| x == b) {
            e += 512;
        }
        v.push((o, e - o));
        o = e;
    }
    v
}

fn files_round_trip(level: u8, layout: &'static str, n: usize, reactors: usize) {
    let seed = seed_of(&[u64::from(level), n as u64]);
    let mut fx = TargetFixture::builder(level, n)
        .layout(layout)
        .name(&format!("files{level}"))
        .shuffle(seed)
        .serve_args(&["--reactors", &reactors.to_string()])
        .build()
        .expect("no tool needed");
    let (d, a, members) = (fx.dir().to_path_buf(), &fx.array, &fx.array.members);
    let (d, srv) = (d.as_path(), fx.server.as_mut().expect("served"));
    // A new array reads as zeroes (create zeroed the data areas).
    let mut reference = std::mem::take(&mut fx.data);
    let mut known = true;

    if let Some(nbdinfo) = tool("nbdinfo") {
        for uri in [srv.uri(), srv.unix_uri()] {
            let size = srv.client_ok(Command::new(&nbdinfo).args(["--size", &uri]), d);
            assert_eq!(size.trim(), a.size.to_string(), "{uri}: nbdinfo --size");
            for can in ["flush", "fua", "trim", "zero", "multi-conn"] {
                srv.client_ok(Command::new(&nbdinfo).args(["--can", can, &uri]), d);
            }
            let info = srv.client_ok(Command::new(&nbdinfo).arg(&uri), d);
            let field = |k: &str| -> String {
                info.lines()
                    .find_map(|l| l.trim().strip_prefix(k).map(|v| v.trim().to_string()))
                    .unwrap_or_else(|| panic!("no {k} in:\n{info}"))
            };
            assert_eq!(field("block_size_minimum:"), "512", "{info}");
            // A full stripe of data: 4 data chunks × 64 KiB, both shapes.
            let stripe = data_chunks(level, n) * CHUNK;
            assert_eq!(stripe, 256 * KIB);
            assert_eq!(field("block_size_preferred:"), stripe.to_string(), "{info}");
            assert_eq!(field("is_read_only:"), "false", "{info}");
            let list = srv.client_ok(Command::new(&nbdinfo).args(["--list", &uri]), d);
            assert!(list.contains(&format!("export=\"{}\"", a.name)), "{list}");
            assert!(
                list.contains(&format!("RAID{level} {n} members, 64 KiB chunk")),
                "{list}"
            );
        }
    }

    qemu_io_patterns(srv, d, &mut reference);

    if let Some(fio) = fio_with_nbd() {
        // Four jobs, four connections (multi-conn), each on its own 4 MiB: random writes of
        // 4 KiB..256 KiB at depth 8, every block read back and checked by CRC32C.
        let out = srv.client_ok(
            Command::new(&fio).current_dir(d).args([
                "--verify_state_save=0",
                "--name=target",
                "--ioengine=nbd",
                &format!("--uri={}", srv.uri()),
                "--rw=randwrite",
                "--bsrange=4k-256k",
                "--size=4m",
                "--offset_increment=4m",
                "--numjobs=4",
                "--iodepth=8",
                "--verify=crc32c",
                "--verify_fatal=1",
                "--do_verify=1",
                "--randseed=4242",
                "--group_reporting",
                "--output-format=terse",
            ]),
            d,
        );
        assert!(!out.contains("verify: bad"), "{out}");
        let line = out
            .lines()
            .find(|l| l.starts_with("3;"))
            .unwrap_or_else(|| panic!("no terse line in:\n{out}"));
        let f: Vec<&str> = line.split(';').collect();
        assert_eq!(f[4], "0", "fio reported error {}: {out}", f[4]);
        assert_eq!(
            (f[5], f[46]),
            ("16384", "16384"),
            "fio must write and verify 4 × 4 MiB: {out}"
        );
        // Random mixed reads and writes, verified, four connections over the Unix socket.
        let out = srv.client_ok(
            Command::new(&fio).current_dir(d).args([
                "--verify_state_save=0",
                "--name=mixed",
                "--ioengine=nbd",
                &format!("--uri={}", srv.unix_uri()),
                "--rw=randrw",
                "--bs=4k",
                "--size=2m",
                "--offset=16m",
                "--offset_increment=2m",
                "--numjobs=4",
                "--iodepth=16",
                "--verify=crc32c",
                "--verify_fatal=1",
                "--randseed=4343",
                "--group_reporting",
                "--output-format=terse",
            ]),
            d,
        );
        let f: Vec<&str> = out
            .lines()
            .find(|l| l.starts_with("3;"))
            .unwrap_or_else(|| panic!("no terse line in:\n{out}"))
            .split(';')
            .collect();
        assert_eq!(f[4], "0", "fio reported error {}: {out}", f[4]);
        assert!(
            f[5] != "0" && f[46] != "0",
            "fio must read and write: {out}"
        );
        known = false; // fio's data is its own
    }

    if let Some(qemu_img) = tool("qemu-img") {
        let img = d.join("convert-in.img");
        let data = random_file(&img, a.size, seed ^ 1);
        srv.client_ok(
            Command::new(&qemu_img)
                .args(["convert", "-n", "-f", "raw", "-O", "raw"])
                .arg(&img)
                .arg(srv.uri()),
            d,
        );
        let out = srv.client_ok(
            Command::new(&qemu_img)
                .args(["compare", "-f", "raw", "-F", "raw"])
                .arg(&img)
                .arg(srv.unix_uri()),
            d,
        );
        assert!(out.contains("Images are identical"), "{out}");
        reference = data;
        known = true;
    }

    if let Some(nbdcopy) = tool("nbdcopy") {
        let src = d.join("nbdcopy-in.img");
        let data = random_file(&src, a.size, seed ^ 2);
        srv.client_ok(
            Command::new(&nbdcopy)
                .args(["--connections=4", "--flush"])
                .arg(&src)
                .arg(srv.uri()),
            d,
        );
        let back = d.join("nbdcopy-out.img");
        srv.client_ok(Command::new(&nbdcopy).arg(srv.unix_uri()).arg(&back), d);
        assert_same(
            "nbdcopy out of the export",
            &fs::read(&back).unwrap(),
            &data,
        );
        reference = data;
        known = true;
    }

    // A last partial-stripe write over a chunk boundary (read-modify-write of parity).
    if let Some(qemu_io) = tool("qemu-io") {
        let (off, len) = (CHUNK - 4096, 12 * KIB);
        srv.client_ok(
            Command::new(&qemu_io).args([
                "-f",
                "raw",
                "-c",
                &format!("write -P 0xe7 {off} {len}"),
                "-c",
                "flush",
                &srv.uri(),
            ]),
            d,
        );
        reference[off as usize..(off + len) as usize].fill(0xe7);
    }

    srv.stop();
    examine(d, members, "clean", None);
    a.oracle_verify(None);
    if known {
        if let Some(logical) = a.oracle_extract(d, &[]) {
            assert_same(
                "the oracle's logical image vs what the clients wrote",
                &logical,
                &reference,
            );
        }
    } else {
        eprintln!("no qemu-img or nbdcopy: the logical image is fio's, not compared");
    }
}

// ---------------------------------------------------------------------------------------
// 2. Loop devices.
// ---------------------------------------------------------------------------------------

#[test]
fn loop_devices_round_trip() {
    let Some(nbdcopy) = tool("nbdcopy") else {
        return;
    };
    let Some(mut fx) = TargetFixture::builder(6, 6)
        .loop_devices()
        .name("loops")
        .shuffle(0x100b)
        .build()
    else {
        return;
    };
    let d = fx.dir().to_path_buf();
    let d = d.as_path();
    let a = &fx.array;
    let devs = a.members.clone();
    assert_eq!(a.data_offset, DATA_OFFSET);
    assert_eq!(a.size, 32 * MIB);
    let srv = fx.server.as_mut().expect("served");
    let src = d.join("in.img");
    let data = random_file(&src, a.size, 0x100b);
    srv.client_ok(
        Command::new(&nbdcopy)
            .arg("--flush")
            .arg(&src)
            .arg(srv.unix_uri()),
        d,
    );
    let back = d.join("out.img");
    srv.client_ok(
        Command::new(&nbdcopy)
            .arg("--connections=2")
            .arg(srv.uri())
            .arg(&back),
        d,
    );
    assert_same(
        "nbdcopy out of the export",
        &fs::read(&back).unwrap(),
        &data,
    );
    srv.stop();
    examine(d, &devs, "clean", None);
    a.oracle_verify(None);
    if let Some(logical) = a.oracle_extract(d, &[]) {
        assert_same(
            "the oracle's logical image of the backing files",
            &logical,
            &data,
        );
    }
}

// ---------------------------------------------------------------------------------------
// 3. kill -9 during writes.
// ---------------------------------------------------------------------------------------

/// The writer and the checker of the kill -9 test (python3-libnbd).
///
/// `write URI ACKS`: region A (8 MiB at 0) in 256 KiB writes, one flush, then "A" in ACKS;
/// then, forever, region B (64 blocks of 64 KiB from 16 MiB, wrapping, write k holding
/// `shake256("B:k")`) in units: one FUA write, then three plain writes and a flush; after
/// each unit the number of the last write it covered goes to ACKS (line-buffered: written
/// only after the server acknowledged it).
///
/// `verify URI ACKS`: region A intact; every region-B block holds its newest acknowledged
/// write, or one of the (at most three) writes after the last acknowledgement, which were
/// in flight or unflushed at the kill.
const KILL_SCRIPT: &str = r#"
import hashlib, sys
import nbd

MIB = 1 << 20
A_OFF, A_LEN, A_BS = 0, 8 * MIB, 256 * 1024
B_OFF, B_BLOCKS, B_BS = 16 * MIB, 64, 64 * 1024
BATCH = 3

def content(tag, n):
    return hashlib.shake_256(tag.encode()).digest(n)

def b_write(k):
    return B_OFF + (k % B_BLOCKS) * B_BS, content(f"B:{k}", B_BS)

mode, uri, acks = sys.argv[1:4]
h = nbd.NBD()
h.connect_uri(uri)
if mode == "write":
    for i in range(A_LEN // A_BS):
        h.pwrite(content(f"A:{i}", A_BS), A_OFF + i * A_BS)
    h.flush()
    log = open(acks, "w", buffering=1)
    log.write("A\n")
    k = 0
    while True:
        off, data = b_write(k)
        h.pwrite(data, off, nbd.CMD_FLAG_FUA)
        log.write(f"{k}\n")
        k += 1
        for _ in range(BATCH):
            off, data = b_write(k)
            h.pwrite(data, off)
            k += 1
        h.flush()
        log.write(f"{k - 1}\n")
else:
    lines = open(acks).read().split()
    assert lines and lines[0] == "A", "region A was never flushed"
    last = int(lines[-1]) if len(lines) > 1 else -1
    bad = []
    for i in range(A_LEN // A_BS):
        if h.pread(A_BS, A_OFF + i * A_BS) != content(f"A:{i}", A_BS):
            bad.append(f"region A, {A_BS}-byte block {i} (flushed before the kill)")
    for i in range(B_BLOCKS):
        acked = [k for k in range(last + 1) if k % B_BLOCKS == i]
        ok = [content(f"B:{acked[-1]}", B_BS) if acked else bytes(B_BS)]
        ok += [content(f"B:{k}", B_BS) for k in range(last + 1, last + 1 + BATCH)
               if k % B_BLOCKS == i]
        if h.pread(B_BS, B_OFF + i * B_BS) not in ok:
            bad.append(f"region B block {i}: last acknowledged write "
                       f"{acked[-1] if acked else None} lost")
    h.shutdown()
    print(f"acknowledged region-B writes: {last + 1}; region A and {B_BLOCKS} blocks checked")
    if bad:
        print("LOST:", *bad, sep="\n")
        sys.exit(1)
"#;

/// Runs [`KILL_SCRIPT`]'s writer against `srv` (acknowledgements in `acks`, its stderr in
/// `werr`) and kills the server (-9) once region B has wrapped (64 blocks; 4 writes per
/// two acknowledgements); the writer must then fail, cut off mid-write.
fn write_until_wrapped_then_kill(
    python: &Path,
    script: &Path,
    srv: &mut Server,
    acks: &Path,
    werr: &Path,
) {
    let mut writer = Command::new(python)
        .arg(script)
        .args(["write", &srv.uri()])
        .arg(acks)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(werr).unwrap())
        .spawn()
        .expect("starting the writer");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let n = fs::read_to_string(acks).map_or(0, |s| s.lines().count());
        if n > 48 {
            break;
        }
        if let Some(st) = writer.try_wait().unwrap() {
            panic!(
                "the writer exited ({st}) before the kill: {}\n{}",
                fs::read_to_string(werr).unwrap_or_default(),
                srv.logs()
            );
        }
        if Instant::now() > deadline {
            let _ = writer.kill();
            let _ = writer.wait();
            panic!(
                "the writer acknowledged only {n} units in 60 s\n{}",
                srv.logs()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    srv.kill9();
    let st = wait_child(&mut writer, Duration::from_secs(30));
    assert!(
        !st.success(),
        "the writer must have been cut off mid-write by the kill: {st}"
    );
}

/// A temporary directory holding [`KILL_SCRIPT`], and the python3 to run it with; `None`
/// (said why) without python3-libnbd.
fn kill_setup() -> Option<(tempfile::TempDir, PathBuf, PathBuf)> {
    let python = ferroraid_tests::python_nbd()?;
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("writer.py");
    fs::write(&script, KILL_SCRIPT).unwrap();
    Some((tmp, python, script))
}

#[test]
fn kill_9_during_writes_keeps_acknowledged_data_and_leaves_the_array_dirty() {
    let Some((tmp, python, script)) = kill_setup() else {
        return;
    };
    let mut fx = TargetFixture::builder(6, 6)
        .name("crash")
        .shuffle(9)
        .build()
        .expect("no tool needed");
    let d = tmp.path();
    let (a, srv) = (&fx.array, fx.server.as_mut().expect("served"));
    let members = a.members.clone();

    let acks = d.join("acks.txt");
    write_until_wrapped_then_kill(&python, &script, srv, &acks, &d.join("writer.err"));
    let acked = fs::read_to_string(&acks).unwrap();
    // The array was being written: every member says so (a resync is needed).
    let events = examine(d, &members, "active", None);
    assert!(events.iter().all(|&e| e == 1), "events {events:?}");

    let mut srv = fx.serve("restart", &shuffled(&members, 10), &[]);
    assert!(
        srv.log().contains("resync needed"),
        "the restarted target must say a resync is needed:\n{}",
        srv.logs()
    );
    let out = run_tool(
        Command::new(&python)
            .arg(&script)
            .args(["verify", &srv.unix_uri()])
            .arg(&acks),
        d,
        TOOL_TIMEOUT,
    );
    assert!(
        out.status.success(),
        "acknowledged data lost across kill -9 (acks: {} lines): {}\n{}",
        acked.lines().count(),
        show_output(&out),
        srv.logs()
    );
    // The target resyncs by itself (the array was not shut down cleanly): once it has
    // finished, a clean stop leaves members that are clean and parity consistent on every
    // stripe, the torn ones included.
    srv.wait_log_for("background process finished process=resync", TOOL_TIMEOUT);
    srv.stop();
    examine(d, &members, "clean", None);
    a.oracle_verify(None);
}

/// Runs [`KILL_SCRIPT`]'s writer against a RAID`level` over four (RAID6: five) member
/// files created with `--consistency-policy POLICY`, kills the server (-9) once region B
/// has wrapped, deletes the `lost` member files, and starts the target again on the others
/// with `--run` (start degraded), or `--force` when `force`. Returns the fixture (its
/// server: the restarted one, when it started), whether it started (or its exit and log),
/// and the verifier's output.
fn kill_9_and_lose_a_member(
    python: &Path,
    script: &Path,
    policy: &str,
    level: u8,
    lost: &[usize],
    force: bool,
) -> (TargetFixture, Result<(), String>, Option<Output>) {
    let mut fx = TargetFixture::builder(level, if level == 6 { 5 } else { 4 })
        .prefix(policy)
        .name(&format!("hole-{policy}"))
        .consistency_policy(policy)
        .label(&format!("{policy}-serve"))
        .build()
        .expect("no tool needed");
    let d = fx.dir().to_path_buf();
    let d = d.as_path();
    let (members, name) = (fx.array.members.clone(), fx.array.name.clone());
    let acks = d.join(format!("{policy}-acks.txt"));
    let werr = d.join(format!("{policy}-writer.err"));
    write_until_wrapped_then_kill(python, script, fx.srv_mut(), &acks, &werr);
    fx.server = None;
    examine(d, &members, "active", None);
    for &m in lost {
        fs::remove_file(&members[m]).unwrap();
    }
    let rest: Vec<PathBuf> = (0..members.len())
        .filter(|i| !lost.contains(i))
        .map(|i| members[i].clone())
        .collect();
    let label = format!("{policy}-restart");
    let port = free_port();
    let socket = d.join(format!("{label}.sock"));
    let mut args: Vec<OsString> = vec!["serve".into(), "--adaptive".into()];
    args.push("--nbd".into());
    args.push(format!("127.0.0.1:{port}").into());
    args.push("--nbd".into());
    args.push(format!("unix:{}", socket.display()).into());
    // The absent member was active: mdadm's --run (start degraded); --force also
    // overrides the refusal of a dirty degraded start.
    args.push(if force { "--force" } else { "--run" }.into());
    args.extend(rest.iter().map(|p| p.as_os_str().to_owned()));
    let mut srv = Server::spawn_unready(d, &label, &args, &name, port, Some(socket));
    if let Some(st) = srv.wait_exit(Duration::from_secs(5)) {
        return (fx, Err(format!("exit {st}: {}", srv.log())), None);
    }
    srv.wait_ready();
    let out = run_tool(
        Command::new(python)
            .arg(script)
            .args(["verify", &srv.unix_uri()])
            .arg(&acks),
        d,
        TOOL_TIMEOUT,
    );
    fx.server = Some(srv);
    (fx, Ok(()), Some(out))
}

/// The write hole closed end to end (issue 19): with the Partial Parity Log, an array
/// killed (-9) under flushed and FUA writes and then started with member files gone
/// starts without `--force` (`--run`, as mdadm: the log is recovered first) and reads back
/// every acknowledged write and everything flushed before the crash — RAID5 (md's PPL)
/// with one member lost, RAID6 (ferroraid's two-log extension) with one and with two.
/// The same run with the write-intent bitmap needs `--force`; what it reads back then is
/// reported beside it.
#[test]
fn kill_9_then_lost_members_with_ppl_read_back_every_acknowledged_write() {
    let Some((_tmp, python, script)) = kill_setup() else {
        return;
    };
    let cases: [(u8, &[usize]); 4] = [(5, &[1]), (5, &[3]), (6, &[2]), (6, &[0, 3])];
    for (level, lost) in cases {
        let (mut fx, started, out) =
            kill_9_and_lose_a_member(&python, &script, "ppl", level, lost, false);
        if let Err(e) = started {
            panic!("a dirty degraded PPL array must start without --force: {e}")
        }
        let out = out.expect("served");
        let srv = fx.srv();
        assert!(
            srv.log().contains("PPL recovery after an unclean shutdown"),
            "no PPL recovery logged:\n{}",
            srv.logs()
        );
        assert!(
            out.status.success(),
            "PPL, RAID{level}, members {lost:?} lost: acknowledged data lost across kill -9: {}\n{}",
            show_output(&out),
            srv.logs()
        );
        eprintln!(
            "ppl, RAID{level}, members {lost:?} lost: {}",
            String::from_utf8_lossy(&out.stdout).trim()
        );
        fx.stop();

        let (_fx, refused, _) =
            kill_9_and_lose_a_member(&python, &script, "bitmap", level, lost, false);
        let why = refused.expect_err("a dirty degraded bitmap array needs --force");
        assert!(why.contains("dirty"), "{why}");
        let (mut fx, started, out) =
            kill_9_and_lose_a_member(&python, &script, "bitmap", level, lost, true);
        started.expect("--force starts it");
        let out = out.expect("served");
        eprintln!(
            "bitmap (--force), RAID{level}, members {lost:?} lost: verify {}: {}",
            if out.status.success() {
                "passed"
            } else {
                "FAILED"
            },
            String::from_utf8_lossy(&out.stdout).trim()
        );
        fx.stop();
    }
}

// ---------------------------------------------------------------------------------------
// 3b. The internal write-intent bitmap, end to end.
// ---------------------------------------------------------------------------------------

/// `ferroraid examine --json` of `member`: (md `events`, bitmap `events`, bitmap
/// `events_cleared`, dirty bits).
fn bitmap_state(dir: &Path, member: &Path) -> (u64, u64, u64, u64) {
    let out = run_tool(
        ferroraid_cmd(["examine", "--json"]).arg(member),
        dir,
        TOOL_TIMEOUT,
    );
    assert!(out.status.success(), "{}", show_output(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let r = &v[0];
    let b = &r["bitmap"];
    assert!(b.is_object(), "no bitmap in {r}");
    let n = |x: &serde_json::Value| x.as_u64().unwrap_or_else(|| panic!("not a number in {r}"));
    (
        n(&r["events"]),
        n(&b["events"]),
        n(&b["events_cleared"]),
        n(&b["dirty_bits"]),
    )
}

/// A 4-member RAID6 named `name` (64 KiB chunks, 9 MiB files `NAMEi.img`) with an internal
/// bitmap of 256 KiB regions (4 stripes each), built by `more`'s builder; checks that
/// create says so. `None`: a tool `more` asked for is missing.
fn create_with_bitmap(
    name: &str,
    more: impl FnOnce(TargetBuilder) -> TargetBuilder,
) -> Option<TargetFixture> {
    let fx = more(
        TargetFixture::builder(6, 4)
            .prefix(name)
            .name(name)
            .bitmap("256K"),
    )
    .build()?;
    assert!(fx.created.contains("262144-byte chunks"), "{}", fx.created);
    assert_eq!(fx.array.size, 16 * MIB, "{}", fx.created);
    Some(fx)
}

/// An array created with an internal bitmap is served with it: a write marks its regions
/// on every member's bitmap (md's format, read back by `ferroraid examine` and `mdadm
/// --examine-bitmap`), the bitmap superblock keeps up with the md superblock's events so
/// it never reads as stale, the regions are cleared lazily (after one to two 5 s daemon
/// periods of quiet), and the stop leaves the array clean and consistent.
#[test]
fn internal_bitmap_is_kept_in_md_format_while_serving() {
    let Some(nbdcopy) = tool("nbdcopy") else {
        return;
    };
    let fx = create_with_bitmap("bm", TargetBuilder::no_serve).expect("no tool needed");
    let (d, a) = (fx.dir(), &fx.array);
    let members = a.members.clone();
    // 8 MiB of data per member in 256 KiB regions: 32 bits, all clear, events 0.
    assert_eq!(bitmap_state(d, &members[0]), (0, 0, 0, 0));

    let mut srv = fx.serve("serve", &shuffled(&members, 21), &[]);
    // 1 MiB at the start: 8 stripes of 128 KiB = 512 KiB of each member = regions 0 and 1.
    let data = d.join("data.bin");
    let want = random_file(&data, MIB, 77);
    let t_write = Instant::now();
    srv.fill(&nbdcopy, &data);
    for m in &members {
        let (ev, bev, _, dirty) = bitmap_state(d, m);
        assert!(
            bev >= ev,
            "{}: bitmap events {bev} behind the superblock's {ev}",
            m.display()
        );
        if t_write.elapsed() < Duration::from_secs(4) {
            assert_eq!(dirty, 2, "{}: regions 0 and 1 must be marked", m.display());
        }
    }
    // Quiet: md's daemon clears the bits after one to two 5 s periods.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let states: Vec<_> = members.iter().map(|m| bitmap_state(d, m)).collect();
        if states.iter().all(|s| s.3 == 0) {
            assert!(
                t_write.elapsed() >= Duration::from_secs(5),
                "cleared {:?} after the write: sooner than one daemon period",
                t_write.elapsed()
            );
            for (ev, bev, cleared, _) in states {
                assert!(
                    bev >= ev && cleared >= 1 && cleared <= bev,
                    "{ev} {bev} {cleared}"
                );
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "bits never cleared: {states:?}\n{}",
            srv.logs()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let got = srv.read_all(&nbdcopy);
    assert_same("read back", &got[..MIB as usize], &want);
    srv.stop();
    examine(d, &members, "clean", None);
    for m in &members {
        let (ev, bev, _, dirty) = bitmap_state(d, m);
        assert_eq!(
            (bev, dirty),
            (ev, 0),
            "{}: bitmap after the stop",
            m.display()
        );
    }
    a.oracle_verify(None);
    // mdadm reads the bitmap too (through a block device only).
    if let Some(mdadm) = mdadm() {
        match attach_loop(&members[1]) {
            Ok(g) => {
                let out = run_tool(
                    Command::new(&mdadm).arg("--examine-bitmap").arg(&g.dev),
                    d,
                    TOOL_TIMEOUT,
                );
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                assert!(out.status.success(), "{}", show_output(&out));
                assert!(text.contains("Chunksize : 256 KB"), "{text}");
                assert!(text.contains("State : OK"), "{text}");
                assert!(
                    text.contains("Bitmap : 32 bits (chunks), 0 dirty"),
                    "{text}"
                );
            }
            Err(why) => eprintln!("SKIPPED mdadm --examine-bitmap: {why}"),
        }
    }
}

// ---------------------------------------------------------------------------------------
// 4. Assembly: refusals, --force, degraded starts.
// ---------------------------------------------------------------------------------------

fn superblock_area(p: &Path) -> Vec<u8> {
    let f = fs::File::open(p).unwrap();
    let mut v = vec![0u8; 4096];
    f.read_exact_at(&mut v, 4096).unwrap();
    v
}

fn write_superblock_area(p: &Path, area: &[u8]) {
    let f = fs::OpenOptions::new().write(true).open(p).unwrap();
    f.write_all_at(area, 4096).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn assembly_refuses_foreign_blank_and_corrupt_members_and_force_starts_degraded() {
    let Some(nbdcopy) = tool("nbdcopy") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let x = create(
        d,
        6,
        "left-symmetric",
        "x",
        &member_files(d, "x", 6, MEMBER_BYTES),
    );
    let y = create(
        d,
        6,
        "left-symmetric",
        "y",
        &member_files(d, "y", 6, MEMBER_BYTES),
    );
    let src = d.join("data.img");
    let data = random_file(&src, x.size, 0xa55e);
    {
        let mut srv = Server::serve(d, "fill", &x.name, &x.members, &[]);
        srv.fill(&nbdcopy, &src);
        srv.stop();
    }

    // Another array's member mixed in.
    let mut mixed = x.members[..5].to_vec();
    mixed.insert(2, y.members[0].clone());
    let err = refused_serve(d, "foreign member", &mixed, &[]);
    let y0 = y.members[0].display().to_string();
    assert!(
        err.contains(&y0) && err.contains("is a member of array"),
        "the refusal must name {y0} and why: {err}"
    );

    // A blank device (no superblock).
    let blank = member_files(d, "blank", 1, MEMBER_BYTES).remove(0);
    let mut with_blank = x.members.clone();
    with_blank.insert(3, blank.clone());
    let err = refused_serve(d, "blank device", &with_blank, &[]);
    assert!(
        err.contains(&blank.display().to_string()) && err.contains("no md superblock"),
        "the refusal must name {} and why: {err}",
        blank.display()
    );

    // A corrupted superblock: one byte of the array name flipped, the checksum now wrong.
    let victim = &x.members[3];
    let good = superblock_area(victim);
    let mut bad = good.clone();
    bad[32] ^= 0x20;
    write_superblock_area(victim, &bad);
    let err = refused_serve(d, "corrupt superblock", &x.members, &[]);
    assert!(
        err.contains(&victim.display().to_string()) && err.contains("bad superblock checksum"),
        "the refusal must name {} and the checksum: {err}",
        victim.display()
    );

    // --force: assembled without it, degraded, said clearly; the data is all there.
    let mut srv = Server::serve(d, "forced", &x.name, &shuffled(&x.members, 4), &["--force"]);
    let log = srv.log();
    assert!(
        log.contains(&format!("forced: skipped {}", victim.display()))
            && log.contains("degraded start: roles [3] missing"),
        "--force must say what it skipped and that the array runs degraded:\n{}",
        srv.logs()
    );
    assert_same(
        "the export read degraded (role 3 rebuilt)",
        &srv.read_all(&nbdcopy),
        &data,
    );
    srv.stop();
    drop(srv);
    let survivors: Vec<PathBuf> = x.members.iter().filter(|m| *m != victim).cloned().collect();
    examine(d, &survivors, "clean", None);
    if let Some(logical) = x.oracle_extract(d, &[3]) {
        assert_same("the oracle's image with role 3 missing", &logical, &data);
    }

    // The member's original superblock back: it missed the forced run's updates, so it is
    // out of date and must not be used; the array starts degraded without --force.
    write_superblock_area(victim, &good);
    let mut srv = Server::serve(d, "stale", &x.name, &shuffled(&x.members, 5), &[]);
    let log = srv.log();
    assert!(
        log.contains(&format!("{} not used", victim.display()))
            && log.contains("degraded start: roles [3] missing"),
        "the out-of-date member must be left out, and said so:\n{}",
        srv.logs()
    );
    assert_same(
        "the export with the out-of-date member present",
        &srv.read_all(&nbdcopy),
        &data,
    );
    srv.stop();
}

#[test]
fn degraded_raid6_serves_with_one_and_two_members_missing_and_refuses_three() {
    let Some(nbdcopy) = tool("nbdcopy") else {
        return;
    };
    let fx = TargetFixture::builder(6, 6)
        .name("deg")
        .label("healthy")
        .fill(0xdead)
        .stop_after_fill()
        .build()
        .expect("nbdcopy is there");
    let d = fx.dir();
    let a = fx.array.clone();
    let mut data = fx.data.clone();

    // One member file gone. The array still counts it active, so without --force the
    // start is refused (mdadm's --run rule: a forgotten device would be recorded faulty for
    // good) and nothing is written; with --force it starts degraded with the same data,
    // and takes writes (parity updated around the missing member).
    let gone4 = d.join("gone-m4.img");
    fs::rename(&a.members[4], &gone4).unwrap();
    let five: Vec<PathBuf> = [0, 1, 2, 3, 5].map(|i| a.members[i].clone()).to_vec();
    let before = examine(d, &five, "clean", None);
    let err = refused_serve(d, "one missing, not forced", &shuffled(&five, 1), &[]);
    assert!(
        err.contains("no device given for role(s) [4]") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(
        examine(d, &five, "clean", None),
        before,
        "a refused start wrote"
    );
    let mut srv = fx.serve("one-missing", &shuffled(&five, 1), &["--force"]);
    assert!(
        srv.log().contains("degraded start: roles [4] missing"),
        "{}",
        srv.logs()
    );
    assert_same("one member missing", &srv.read_all(&nbdcopy), &data);
    if let Some(qemu_io) = tool("qemu-io") {
        // Partial and full stripes written degraded: parity kept around the missing member.
        let (off, len) = (MIB + 512, 3 * MIB + 4096);
        srv.client_ok(
            Command::new(&qemu_io).args([
                "-f",
                "raw",
                "-c",
                &format!("write -P 0x6b {off} {len}"),
                "-c",
                "flush",
                "-c",
                &format!("read -P 0x6b {off} {len}"),
                &srv.uri(),
            ]),
            d,
        );
        data[off as usize..(off + len) as usize].fill(0x6b);
    }
    srv.stop();
    drop(srv);

    // Two missing: RAID6 still serves (role 4 is recorded faulty now, role 1 is not: forced).
    let four: Vec<PathBuf> = [0, 2, 3, 5].map(|i| a.members[i].clone()).to_vec();
    let mut srv = fx.serve("two-missing", &shuffled(&four, 2), &["--force"]);
    assert!(
        srv.log().contains("degraded start: roles [1, 4] missing"),
        "{}",
        srv.logs()
    );
    assert_same("two members missing", &srv.read_all(&nbdcopy), &data);
    srv.stop();
    drop(srv);
    if let Some(logical) = a.oracle_extract(d, &[1, 4]) {
        assert_same(
            "the oracle's image with roles 1 and 4 missing",
            &logical,
            &data,
        );
    }

    // Three missing: more than RAID6 survives; refused, naming the missing roles.
    let three: Vec<PathBuf> = [0, 3, 5].map(|i| a.members[i].clone()).to_vec();
    let err = refused_serve(d, "three missing", &three, &[]);
    assert!(
        err.contains("too few members to serve data") && err.contains("missing roles [1, 2, 4]"),
        "{err}"
    );
    let err = refused_serve(d, "three missing, forced", &three, &["--force"]);
    assert!(err.contains("too few members to serve data"), "{err}");
}

#[test]
fn a_member_left_out_of_a_degraded_run_is_not_used_after_a_crash() {
    let (Some(nbdcopy), Some(qemu_io)) = (tool("nbdcopy"), tool("qemu-io")) else {
        return;
    };
    let fx = TargetFixture::builder(6, 6)
        .name("left")
        .label("healthy")
        .fill(0x1ef7)
        .stop_after_fill()
        .build()
        .expect("nbdcopy is there");
    let d = fx.dir();
    let a = fx.array.clone();
    let mut data = fx.data.clone();
    // Degraded run without m5: writes land on the others only; then the target crashes
    // (one superblock generation later than m5's: within md's margin of one).
    let five = a.members[..5].to_vec();
    let mut srv = fx.serve("degraded", &shuffled(&five, 3), &["--force"]);
    let len = 4 * MIB;
    srv.client_ok(
        Command::new(&qemu_io).args([
            "-f",
            "raw",
            "-c",
            &format!("write -P 0x6c 0 {len}"),
            "-c",
            "flush",
            &srv.uri(),
        ]),
        d,
    );
    data[..len as usize].fill(0x6c);
    srv.kill9();
    drop(srv);

    // All six named again. m5 holds the old data of every chunk it serves in the first
    // 4 MiB: using it would return that. Dirty (the crash) and degraded (m5 missed
    // writes): refused without --force, as md refuses.
    let m5 = a.members[5].display().to_string();
    let err = refused_serve(d, "dirty with a stale member", &a.members, &[]);
    assert!(
        err.contains("dirty") && err.contains("degraded"),
        "must refuse a dirty array whose member missed writes: {err}"
    );
    let mut srv = fx.serve("forced", &shuffled(&a.members, 4), &["--force"]);
    assert!(
        srv.log().contains(&format!("{m5} not used")),
        "{m5} must be left out:\n{}",
        srv.logs()
    );
    assert_same(
        "the export after the crash, m5 present but out of date",
        &srv.read_all(&nbdcopy),
        &data,
    );
    srv.stop();
}

#[test]
fn force_brings_in_an_out_of_date_member_when_too_few_are_current() {
    let Some(nbdcopy) = tool("nbdcopy") else {
        return;
    };
    let fx = TargetFixture::builder(6, 6)
        .name("old")
        .label("healthy")
        .fill(0x01d)
        .stop_after_fill()
        .build()
        .expect("nbdcopy is there");
    let d = fx.dir();
    let a = fx.array.clone();
    let data = fx.data.clone();
    // A degraded run without m0 (no writes): m0 is now out of date.
    let mut srv = fx.serve("without-m0", &a.members[1..], &["--force"]);
    srv.stop();
    drop(srv);
    // m0 and three current members: too few current ones; force could use m0.
    let four = a.members[..4].to_vec();
    let m0 = a.members[0].display().to_string();
    let err = refused_serve(d, "too few current", &four, &[]);
    assert!(
        err.contains("too few members to serve data") && err.contains(&m0),
        "the refusal must name the out-of-date member force could use: {err}"
    );
    let mut srv = fx.serve("forced", &shuffled(&four, 6), &["--force"]);
    assert!(
        srv.log()
            .contains(&format!("forced: using out-of-date {m0}")),
        "{}",
        srv.logs()
    );
    // m0 missed no data writes, so the array still holds exactly the data.
    assert_same(
        "forced with an out-of-date member",
        &srv.read_all(&nbdcopy),
        &data,
    );
    srv.stop();
}

#[test]
fn a_start_that_fails_on_its_address_leaves_the_array_clean() {
    let fx = TargetFixture::builder(6, 6)
        .name("busy")
        .no_serve()
        .build()
        .expect("no tool needed");
    let d = fx.dir();
    let a = fx.array.clone();
    let before = examine(d, &a.members, "clean", None);
    // Someone else holds the port.
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let args: Vec<OsString> = ["serve", "--adaptive", "--nbd", &format!("127.0.0.1:{port}")]
        .iter()
        .map(OsString::from)
        .chain(a.members.iter().map(|m| m.as_os_str().to_owned()))
        .collect();
    let err = refused(d, "port in use", &args);
    assert!(
        err.contains(&format!("127.0.0.1:{port}")) && err.contains("Address already in use"),
        "{err}"
    );
    // Nothing was served: no generation written, nothing to resync.
    let after = examine(d, &a.members, "clean", None);
    assert_eq!(before, after, "events moved although the start failed");
    drop(busy);
    let mut srv = fx.serve("serve", &a.members, &[]);
    assert!(!srv.log().contains("resync needed"), "{}", srv.logs());
    // A second target (or create) on the same devices is refused while this one runs, and
    // this one keeps serving.
    let port2 = free_port();
    let args: Vec<OsString> = [
        "serve",
        "--adaptive",
        "--nbd",
        &format!("127.0.0.1:{port2}"),
    ]
    .iter()
    .map(OsString::from)
    .chain(a.members.iter().rev().map(|m| m.as_os_str().to_owned()))
    .collect();
    let err = refused(d, "devices in use", &args);
    assert!(
        err.contains("in use: another array or ferroraid process holds its lock"),
        "{err}"
    );
    let args: Vec<OsString> = ["create", "--level", "6", "--force"]
        .iter()
        .map(OsString::from)
        .chain(a.members.iter().map(|m| m.as_os_str().to_owned()))
        .collect();
    let err = refused(d, "create on devices in use", &args);
    assert!(
        err.contains("in use: another array or ferroraid process holds its lock"),
        "{err}"
    );
    assert!(
        srv.greets(),
        "the first target stopped serving:\n{}",
        srv.logs()
    );
    srv.stop();
}

// ---------------------------------------------------------------------------------------
// 5. Members written by Linux md.
// ---------------------------------------------------------------------------------------

/// `(image, active)` of each member in a fixture's `manifest.json` (slot order).
fn manifest_members(manifest: &str) -> Vec<(String, bool)> {
    let value = |s: &str, key: &str| -> String {
        let at = s
            .find(&format!("\"{key}\": \""))
            .unwrap_or_else(|| panic!("no {key} in {s}"));
        let rest = &s[at + key.len() + 5..];
        rest[..rest.find('"').expect("a closing quote")].to_string()
    };
    let members = &manifest[manifest.find("\"members\"").expect("members")..];
    members
        .split("\"slot\":")
        .skip(1)
        .map(|m| (value(m, "image"), value(m, "state") == "active"))
        .collect()
}

/// Member images Linux md wrote (the QEMU fixtures) are served with the data md was given;
/// mdadm reads the superblocks ferroraid writes after. The arrays with a failed and
/// removed member are served first without it (degraded), then with it given back: md's
/// re-add decision is acted on — on `mdfix6b` the removed member is rebuilt over the 11
/// stripes md's own bitmap marks, on `mdfix6d` (no bitmap) in full — and then it is in
/// sync.
#[test]
fn linux_md_members_are_served_with_the_data_md_was_given() {
    let Some(nbdcopy) = tool("nbdcopy") else {
        return;
    };
    let fixtures = Path::new(env!("CARGO_TARGET_TMPDIR")).join("md-fixtures");
    if !ensure_md_fixtures(&fixtures, "target::linux_md_members") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    for (k, name) in ["mdfix6", "mdfix5", "mdfix6d", "mdfix6b"]
        .into_iter()
        .enumerate()
    {
        let src = fixtures.join(name);
        let manifest = fs::read_to_string(src.join("manifest.json")).unwrap();
        let pattern = fs::read(src.join("pattern.bin")).unwrap();
        // Copies: serving marks members active and then clean; the cache stays md's.
        let d = tmp.path().join(name);
        fs::create_dir(&d).unwrap();
        let mut all = Vec::new();
        let mut current = Vec::new();
        let mut stale = Vec::new();
        for (image, active) in manifest_members(&manifest) {
            let copy = d.join(&image);
            fs::copy(src.join(&image), &copy).unwrap();
            all.push(copy.clone());
            if active { &mut current } else { &mut stale }.push(copy);
        }
        if !stale.is_empty() {
            // mdfix6d, mdfix6b: without the failed and removed member, degraded.
            let mut srv = Server::serve(&d, "survivors", name, &shuffled(&current, 7), &[]);
            assert!(srv.log().contains("degraded start"), "{}", srv.logs());
            assert_same(
                &format!("{name} without the removed member"),
                &srv.read_all(&nbdcopy),
                &pattern,
            );
            srv.stop();
        }
        let mut srv = Server::serve(&d, "all", name, &shuffled(&all, k as u64), &[]);
        for s in &stale {
            // The removed member is given back with its old superblock: md's re-add
            // decision, acted on — by bitmap on mdfix6b (md's own bitmap marks the 11
            // stripes rewritten without it), in full on mdfix6d (no bitmap).
            let log = srv.log();
            assert!(
                log.contains(&format!("{} not used", s.display()))
                    && log.contains("member re-added"),
                "{name}: the removed member must come back:\n{}",
                srv.logs()
            );
            let how = if name == "mdfix6b" {
                "bitmap-based recovery of the dirty regions only"
            } else {
                "needs a full rebuild: the array has no write-intent bitmap"
            };
            assert!(log.contains(how), "{name}: {how}:\n{}", srv.logs());
            let log = srv.wait_log("rebuild complete");
            if name == "mdfix6b" {
                let log = srv.wait_log("background process finished process=rebuild");
                assert!(log.contains("process=rebuild stripes=11"), "{log}");
            }
            let _ = log;
        }
        assert_same(
            &format!("{name}: the export vs the pattern md was given"),
            &srv.read_all(&nbdcopy),
            &pattern,
        );
        srv.stop();
        drop(srv);
        // mdadm still reads them: ferroraid's generations continue md's (and a re-added
        // member is in sync).
        examine(&d, &all, "clean", None);
    }
}

// ---------------------------------------------------------------------------------------
// 6. The demo.
// ---------------------------------------------------------------------------------------

#[test]
fn demo_round_trips_a_file_and_reuses_its_array() {
    let (Some(nbdcopy), Some(qemu_img)) = (tool("nbdcopy"), tool("qemu-img")) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let dir = d.join("demo-data");
    let port = free_port();
    let demo = |secs: u64| -> Vec<OsString> {
        let mut a: Vec<OsString> = vec!["demo".into(), "--dir".into(), dir.clone().into()];
        a.extend([
            "--nbd".into(),
            format!("127.0.0.1:{port}").into(),
            "--seconds".into(),
            secs.to_string().into(),
        ]);
        a
    };
    let src = d.join("disk.img");
    let data = random_file(&src, 256 * MIB, 0xde70);
    let read_back = |srv: &Server, what: &str| {
        let back = d.join("back.img");
        srv.client_ok(
            Command::new(&qemu_img)
                .args(["dd", "-f", "raw", "-O", "raw", "bs=1M", "count=256"])
                .arg(format!("if={}", srv.uri()))
                .arg(format!("of={}", back.display())),
            d,
        );
        assert_same(what, &fs::read(&back).unwrap(), &data);
        let _ = fs::remove_file(&back);
    };

    // First run: makes the array, serves it; Ctrl-C stops it cleanly.
    let mut srv = Server::spawn(d, "demo1", &demo(300), "demo", port, None);
    let out = srv.wait_out("Ctrl-C stops");
    assert!(
        out.contains("created RAID6 \"demo\" over 6 sparse")
            && out.contains(&format!("nbd://127.0.0.1:{port}/demo")),
        "{}",
        srv.logs()
    );
    srv.client_ok(
        Command::new(&nbdcopy)
            .arg("--flush")
            .arg(&src)
            .arg(srv.uri()),
        d,
    );
    read_back(&srv, "256 MiB through the demo");
    let st = srv.stop_with(libc::SIGINT);
    assert!(st.success(), "demo exited {st} on SIGINT:\n{}", srv.logs());
    drop(srv);
    let members: Vec<PathBuf> = (0..6)
        .map(|i| dir.join(format!("member-{i}.img")))
        .collect();
    examine(d, &members, "clean", None);

    // Second run: the same array, the same data; it stops by itself after --seconds.
    let secs = 15;
    let started = Instant::now();
    let mut srv = Server::spawn(d, "demo2", &demo(secs), "demo", port, None);
    assert!(
        srv.wait_out("Ctrl-C stops")
            .contains(&format!("reusing the array in {}", dir.display())),
        "{}",
        srv.logs()
    );
    read_back(&srv, "256 MiB after restarting the demo");
    let st = srv
        .wait_exit(Duration::from_secs(secs) + STOP_TIMEOUT)
        .unwrap_or_else(|| panic!("the demo ran past --seconds {secs}:\n{}", srv.logs()));
    assert!(st.success(), "demo exited {st}:\n{}", srv.logs());
    assert!(
        started.elapsed() >= Duration::from_secs(secs),
        "the demo stopped before --seconds {secs}:\n{}",
        srv.logs()
    );
    examine(d, &members, "clean", None);
}

// ---------------------------------------------------------------------------------------
// 7. serve --config.
// ---------------------------------------------------------------------------------------

#[test]
fn serve_config_file_is_used_and_bad_ones_are_refused() {
    let fx = TargetFixture::builder(5, 4)
        .layout("right-symmetric")
        .name("cfg")
        .no_serve()
        .build()
        .expect("no tool needed");
    let d = fx.dir();
    let a = fx.array.clone();
    let port = free_port();
    let sock = d.join("cfg.sock");
    let devices: Vec<String> = shuffled(&a.members, 8)
        .iter()
        .map(|p| format!("{:?}", p.display().to_string()))
        .collect();
    let good = format!(
        "# ferroraid serve --config\n\
         devices = [{}]\n\
         nbd = [\"127.0.0.1:{port}\", \"unix:{}\"]\n\
         mode = \"adaptive\"\n\
         reactors = 1\n\
         max_block = \"1M\"\n",
        devices.join(", "),
        sock.display()
    );
    let cfg = d.join("serve.toml");
    fs::write(&cfg, &good).unwrap();
    let args: Vec<OsString> = vec!["serve".into(), "--config".into(), cfg.clone().into()];
    let mut srv = Server::spawn(d, "config", &args, &a.name, port, Some(sock));
    if let Some(nbdinfo) = tool("nbdinfo") {
        let info = srv.client_ok(Command::new(&nbdinfo).arg(srv.unix_uri()), d);
        assert!(info.contains("block_size_maximum: 1048576"), "{info}");
        assert!(info.contains(&format!("export-size: {}", a.size)), "{info}");
    }
    if let Some(qemu_io) = tool("qemu-io") {
        srv.client_ok(
            Command::new(&qemu_io).args([
                "-f",
                "raw",
                "-c",
                "write -P 0x42 100k 1m",
                "-c",
                "read -P 0x42 100k 1m",
                "-c",
                "read -P 0 0 100k",
                &srv.uri(),
            ]),
            d,
        );
    }
    srv.stop();
    drop(srv);
    examine(d, &a.members, "clean", None);

    for (what, line, reason) in [
        ("unknown key", "colour = \"blue\"", "unknown field `colour`"),
        (
            "bad mode",
            "mode = \"turbo\"",
            "mode \"turbo\": expected \"polled\" or \"adaptive\"",
        ),
        (
            "bad type",
            "reactors = \"two\"",
            "invalid type: string \"two\"",
        ),
        ("bad address", "nbd = [\"localhost\"]", "expected HOST:PORT"),
        ("zero reactors", "reactors = 0", "at least 1"),
    ] {
        // Replace the key if the good file has it, else add the line.
        let key = line.split(" = ").next().unwrap();
        let mut text: String = good
            .lines()
            .filter(|l| !l.starts_with(&format!("{key} = ")))
            .map(|l| format!("{l}\n"))
            .collect();
        text.push_str(line);
        text.push('\n');
        let bad = d.join(format!("bad-{}.toml", what.replace(' ', "-")));
        fs::write(&bad, &text).unwrap();
        let err = refused(
            d,
            what,
            &["serve".into(), "--config".into(), bad.clone().into()],
        );
        assert!(err.contains(reason), "{what}: no {reason:?} in: {err}");
        assert!(
            !err.contains("panicked"),
            "{what}: a refusal, not a panic: {err}"
        );
        if what != "bad mode" && what != "bad address" && what != "zero reactors" {
            assert!(
                err.contains(&bad.display().to_string()),
                "{what}: the message must name the file: {err}"
            );
        }
    }
}

/// `examine --scan GLOB` finds two arrays among shuffled member files and a file without a
/// superblock, and prints an `[[array]]` table for each that `serve --config` assembles
/// as written (mdadm's `--examine --scan` into `--assemble --scan`); bad scan configs are
/// refused with what to do.
#[test]
fn examine_scan_tables_round_trip_into_serve_config() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Created with the members in shuffled order: the glob's sorted order is not the
    // roles' order.
    let a_files = member_files(d, "m-a", 4, 24 << 20);
    let b_files = member_files(d, "m-b", 5, 24 << 20);
    let a = create(d, 5, "left-symmetric", "scan-a", &shuffled(&a_files, 3));
    let b = create(d, 6, "left-symmetric", "scan-b", &shuffled(&b_files, 4));
    fs::write(d.join("m-junk.img"), vec![0u8; 1 << 20]).unwrap();
    let pattern = format!("{}/m-*.img", d.display());

    let out = ferroraid_cmd(["examine", "--scan", &pattern])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{}", show_output(&out));
    let parsed: toml::Table = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let tables = parsed["array"].as_array().expect("[[array]] tables");
    assert_eq!(tables.len(), 2, "{text}");
    assert!(text.contains("RAID5, 4 of 4 slots found"), "{text}");
    assert!(text.contains("RAID6, 5 of 5 slots found"), "{text}");

    let json = ferroraid_cmd(["examine", "--scan", "--json", &pattern])
        .output()
        .unwrap();
    let found: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(found["arrays"].as_array().unwrap().len(), 2, "{found}");
    let skipped = found["skipped"].to_string();
    assert!(skipped.contains("m-junk.img"), "{skipped}");

    // Each table, as printed, serves its array.
    for (arr, label) in [(&a, "scan-a"), (&b, "scan-b")] {
        let start = text
            .find(&format!("name = \"{label}\""))
            .unwrap_or_else(|| panic!("no table named {label}: {text}"));
        let table_start = text[..start].rfind("[[array]]").unwrap();
        let table_end = text[start..].find("\n\n").map_or(text.len(), |e| start + e);
        let port = free_port();
        let cfg = d.join(format!("{label}.toml"));
        fs::write(
            &cfg,
            format!(
                "mode = \"adaptive\"\nnbd = [\"127.0.0.1:{port}\"]\n\n{}\n",
                &text[table_start..table_end]
            ),
        )
        .unwrap();
        let args: Vec<OsString> = vec!["serve".into(), "--config".into(), cfg.into()];
        let mut srv = Server::spawn(d, label, &args, &arr.name, port, None);
        if let Some(qemu_io) = tool("qemu-io") {
            srv.qemu_io(
                &qemu_io,
                &["write -P 0x5c 64k 256k", "read -P 0x5c 64k 256k"],
            );
        }
        if let Some(nbdinfo) = tool("nbdinfo") {
            let info = srv.client_ok(Command::new(&nbdinfo).arg(srv.uri()), d);
            assert!(
                info.contains(&format!("export-size: {}", arr.size)),
                "{info}"
            );
        }
        srv.stop();
    }

    // Both tables in one config, each with its own export: one process assembles and
    // serves both arrays (mdadm's `--assemble --scan` over the whole mdadm.conf).
    let (pa, pb) = (free_port(), free_port());
    let mut both = String::from("mode = \"adaptive\"\nreactors = 2\n");
    for chunk in text.split("[[array]]").skip(1) {
        let port = if chunk.contains("name = \"scan-a\"") {
            pa
        } else {
            pb
        };
        both += &format!("[[array]]\nnbd = [\"127.0.0.1:{port}\"]{chunk}");
    }
    let cfg = d.join("both.toml");
    fs::write(&cfg, &both).unwrap();
    let rpc = d.join("both.sock");
    let args: Vec<OsString> = vec![
        "serve".into(),
        "--config".into(),
        cfg.into(),
        "--rpc".into(),
        rpc.clone().into(),
    ];
    let mut srv = Server::spawn(d, "both", &args, &a.name, pa, Some(rpc.clone()));
    let list = ferroraid_cmd(["list", "--json", "--rpc"])
        .arg(&rpc)
        .output()
        .unwrap();
    assert!(list.status.success(), "{}", show_output(&list));
    let listed: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["array"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), 2, "{listed}");
    assert!(
        names.iter().any(|n| n.ends_with("scan-a")) && names.iter().any(|n| n.ends_with("scan-b"))
    );
    if let Some(nbdinfo) = tool("nbdinfo") {
        for (arr, port) in [(&a, pa), (&b, pb)] {
            let info = srv.client_ok(
                Command::new(&nbdinfo).arg(format!("nbd://127.0.0.1:{port}/{}", arr.name)),
                d,
            );
            assert!(
                info.contains(&format!("export-size: {}", arr.size)),
                "{info}"
            );
        }
    }
    srv.stop();

    // Nothing there: exit 1 and why.
    let none = ferroraid_cmd(["examine", "--scan", &format!("{}/none-*", d.display())])
        .output()
        .unwrap();
    assert_eq!(none.status.code(), Some(1), "{}", show_output(&none));
    assert!(String::from_utf8_lossy(&none.stderr).contains("no array found"));
    // Two tables and a top-level export (whose array would it be?); a UUID no device
    // has: what was found.
    for (what, extra, reason) in [
        (
            "two tables",
            text.clone(),
            "give each table its own exports",
        ),
        (
            "unknown uuid",
            format!(
                "[[array]]\nuuid = \"00000000:00000000:00000000:00000001\"\nscan = [{:?}]\n",
                pattern
            ),
            "no such array",
        ),
    ] {
        let cfg = d.join("bad-scan.toml");
        fs::write(
            &cfg,
            format!("nbd = [\"127.0.0.1:{}\"]\n{extra}", free_port()),
        )
        .unwrap();
        let err = refused(d, what, &["serve".into(), "--config".into(), cfg.into()]);
        assert!(err.contains(reason), "{what}: no {reason:?} in: {err}");
        if what == "unknown uuid" {
            assert!(err.contains("scan-a") && err.contains("scan-b"), "{err}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// 8. A member failed over JSON-RPC while a client writes.
// ---------------------------------------------------------------------------------------

/// fio writing 64 KiB random blocks with CRC32C verification over four connections
/// (4 MiB each), `loops` times over, then reading everything back (`--verify_fatal`).
fn fio_verified_writes(fio: &Path, srv: &Server, d: &Path, loops: u32) -> Child {
    Command::new(fio)
        .current_dir(d)
        .args([
            "--verify_state_save=0",
            "--name=rpc",
            "--ioengine=nbd",
            &format!("--uri={}", srv.uri()),
            "--rw=randwrite",
            "--bs=64k",
            "--size=4m",
            "--offset_increment=4m",
            "--numjobs=4",
            "--iodepth=8",
            &format!("--loops={loops}"),
            "--verify=crc32c",
            "--verify_fatal=1",
            "--do_verify=1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The operator fails a member over the management socket while fio writes with CRC32C
/// verification over four connections: the command answers at once, the client sees no
/// error and reads back exactly what it wrote (reconstructed around the failed member),
/// `status` shows the member faulty and the array degraded (exit 1), the survivors'
/// superblocks record the failure, and after a clean stop a restart on all six devices
/// leaves the failed member out and serves what the oracle extracts without it.
#[test]
fn fail_a_member_over_json_rpc_during_client_writes() {
    let Some(fio) = fio_with_nbd() else {
        return;
    };
    let Some(nbdcopy) = tool("nbdcopy") else {
        return;
    };
    let mut fx = TargetFixture::builder(6, 6)
        .name("rpc")
        .rpc()
        .build()
        .expect("no tool needed");
    let mut srv = fx.take_server();
    let d = fx.dir();
    let a = fx.array.clone();
    let (before, code) = srv.status();
    assert_eq!(code, Some(0), "healthy array: {before}\n{}", srv.logs());
    let events_before = before["array"]["events"].as_u64().unwrap();
    let mut client = fio_verified_writes(&fio, &srv, d, 24);
    srv.wait_member_writes(64);
    srv.mgmt(&[OsStr::new("fail"), a.members[2].as_os_str()], 0);
    assert!(
        client.try_wait().unwrap().is_none(),
        "fio finished before the failure: the member must fail under its writes"
    );
    let (st, code) = srv.status();
    assert_eq!(code, Some(1), "a degraded array exits 1: {st}");
    assert_eq!(st["array"]["state"], "degraded", "{st}");
    assert_eq!(st["members"][2]["state"], "faulty", "{st}");
    assert!(
        st["array"]["events"].as_u64().unwrap() > events_before,
        "{st}"
    );
    let out = client.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "fio saw an error: {}\n{}",
        show_output(&out),
        srv.logs()
    );
    // The survivors record slot 2 as gone; the failed member's superblock is not rewritten.
    if let Some(mdadm) = mdadm() {
        for (r, m) in a.members.iter().enumerate().filter(|(r, _)| *r != 2) {
            let out = run_tool(
                Command::new(&mdadm).arg("--examine").arg(m),
                d,
                TOOL_TIMEOUT,
            );
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let state = text
                .lines()
                .find_map(|l| l.trim().strip_prefix("Array State :"))
                .unwrap_or_else(|| panic!("member {r}: no Array State in\n{text}"))
                .trim()
                .to_string();
            assert!(state.starts_with("AA.AAA"), "member {r}: {state}\n{text}");
        }
    }
    srv.stop();
    // Restart on all six without --force: the failed member stays out.
    let mut srv = fx.serve("restart", &a.members, &[]);
    let got = srv.read_all(&nbdcopy);
    if let Some(want) = a.oracle_extract(d, &[2]) {
        assert_same(
            "array after the failure and a restart",
            &got,
            &want[..got.len()],
        );
    }
    assert!(
        srv.logs().contains(&a.members[2].display().to_string()),
        "the restart must say it leaves {} out:\n{}",
        a.members[2].display(),
        srv.logs()
    );
    srv.stop();
}

/// A member fails (over JSON-RPC) under fio's verified writes, the operator adds a blank
/// device: the target rebuilds onto it while fio keeps writing, `status` shows it
/// `rebuilding` then `active` with the process back to idle (exit 0), fio verifies every
/// block, the new member's superblock says it is in sync, and the oracle finds parity
/// consistent on the members including the new one and extracts what the clients wrote.
#[test]
fn rebuild_onto_a_blank_replacement_during_client_writes() {
    let Some(fio) = fio_with_nbd() else {
        return;
    };
    let Some(nbdcopy) = tool("nbdcopy") else {
        return;
    };
    // The pacer keeps a rebuild at its floor while fio writes; a floor of 100 MB/s per
    // member lets it finish while fio still writes (what this test checks), through the
    // default pacer all the same.
    let mut fx = TargetFixture::builder(6, 6)
        .name("rebuild")
        .rpc()
        .serve_args(&["--speed-min", "100000", "--speed-max", "200000"])
        .build()
        .expect("no tool needed");
    let mut srv = fx.take_server();
    let d = fx.dir();
    let mut a = fx.array.clone();
    let blank = member_files(fx.dir(), "new", 1, MEMBER_BYTES).remove(0);
    let rpc_arg = fx.rpc_arg();
    let mut client = fio_verified_writes(&fio, &srv, d, 40);
    srv.wait_member_writes(64);
    srv.mgmt(&[OsStr::new("fail"), a.members[2].as_os_str()], 0);
    // A device that is too small, and one already in the array, are refused by name.
    let small = d.join("small");
    fs::write(&small, vec![0u8; MIB as usize]).unwrap();
    for (dev, why) in [(&small, "smaller"), (&a.members[0], "already a member")] {
        let out = run_tool(
            ferroraid_cmd(["add", "--rpc", &rpc_arg]).arg(dev),
            d,
            TOOL_TIMEOUT,
        );
        assert_eq!(
            out.status.code(),
            Some(1),
            "add {}: {}",
            dev.display(),
            show_output(&out)
        );
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(why),
            "add {}: {}",
            dev.display(),
            show_output(&out)
        );
    }
    let text = srv.mgmt(&[OsStr::new("add"), blank.as_os_str()], 0);
    assert!(text.contains("as member 2"), "{text}");
    // The rebuild completes while fio is still writing.
    let deadline = Instant::now() + TOOL_TIMEOUT;
    loop {
        let (st, code) = srv.status();
        let state = st["members"][2]["state"].as_str().unwrap_or("").to_string();
        if state == "rebuilding" {
            assert_eq!(code, Some(1), "a rebuilding array exits 1: {st}");
        }
        if state == "active" && st["process"]["kind"] == "idle" {
            assert_eq!(code, Some(0), "{st}");
            assert_eq!(st["array"]["state"], "active", "{st}");
            assert_eq!(
                st["members"][2]["device"].as_str(),
                Some(blank.display().to_string().as_str()),
                "{st}"
            );
            assert!(
                client.try_wait().unwrap().is_none(),
                "fio finished before the rebuild did: it must rebuild under client writes"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the rebuild did not finish: {st}\n{}",
            srv.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = client.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "fio saw an error: {}\n{}",
        show_output(&out),
        srv.logs()
    );
    let got = srv.read_all(&nbdcopy);
    srv.stop();
    assert!(
        srv.logs().contains("rebuild complete"),
        "no completion in the log:\n{}",
        srv.logs()
    );
    // The new member took slot 2's role and is in sync; the array is clean.
    a.members[2] = blank.clone();
    a.images[2] = blank.clone();
    if let Some(mdadm) = mdadm() {
        let out = run_tool(
            Command::new(&mdadm).arg("--examine").arg(&blank),
            d,
            TOOL_TIMEOUT,
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{}", show_output(&out));
        assert!(text.contains("Device Role : Active device 2"), "{text}");
        assert!(text.contains("State : clean"), "{text}");
        assert!(!text.contains("Recovery Offset"), "{text}");
        assert!(text.contains("Array State : AAAAAA"), "{text}");
    }
    a.oracle_verify(None);
    if let Some(want) = a.oracle_extract(d, &[]) {
        assert_same("array after the rebuild", &got, &want[..got.len()]);
    }
    // Without the failed member the array assembles whole and serves the same data.
    let mut srv = fx.serve("restart", &a.members, &[]);
    let again = srv.read_all(&nbdcopy);
    assert_same("array after a restart", &again, &got);
    srv.stop();
}

/// After a crash, the target resyncs only the regions its write-intent bitmap marked dirty
/// (md's bitmap-driven resync): a stripe made inconsistent inside a dirty region is made
/// consistent, one made inconsistent inside a clean region is left as it is (so the
/// oracle finds exactly one mismatch), and the resync covers the dirty regions' stripes
/// only.
#[test]
fn resync_after_a_crash_covers_only_bitmap_dirty_regions() {
    let Some(nbdcopy) = tool("nbdcopy") else {
        return;
    };
    let mut fx = create_with_bitmap("rb", |b| b).expect("no tool needed");
    let d = fx.dir().to_path_buf();
    let d = d.as_path();
    let (a, srv) = (&fx.array, fx.server.as_mut().expect("served"));
    let members = a.members.clone();
    // Regions are 256 KiB of each member = 4 stripes of 128 KiB of data. Write stripe 0
    // (region 0) and stripe 64 (region 16), then crash before the daemon clears the bits.
    let data = d.join("data.bin");
    random_file(&data, 128 * KIB, 5);
    srv.fill(&nbdcopy, &data);
    let mut at8m = Command::new(tool("qemu-io").expect("qemu-io"));
    at8m.args(["-f", "raw", "-c", "write -P 0x6b 8M 128K", &srv.uri()]);
    let out = run_tool(&mut at8m, d, TOOL_TIMEOUT);
    assert!(out.status.success(), "{}", show_output(&out));
    srv.kill9();
    // Torn stripes: member 0's chunk of stripe 1 (dirty region 0) and of stripe 40 (clean
    // region 10) no longer match their parity.
    let f = fs::OpenOptions::new()
        .write(true)
        .open(&members[0])
        .unwrap();
    for stripe in [1u64, 40] {
        f.write_all_at(&[0xee; 4096], DATA_OFFSET + stripe * CHUNK)
            .unwrap();
    }
    drop(f);
    let mut srv = Server::serve(d, "restart", "rb", &members, &[]);
    srv.wait_log_for("background process finished process=resync", TOOL_TIMEOUT);
    let log = srv.log();
    assert!(log.contains("bitmap_ranges=Some(2)"), "{log}");
    assert!(log.contains("process=resync stripes=8"), "{log}");
    srv.stop();
    let Some(oracle) = a.oracle() else {
        return;
    };
    let out = oracle
        .run(a.oracle_args("verify", &a.image_args(&[]), &[]))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        out.stdout.contains("mismatches 1") && out.stderr.contains("mismatch in stripe 40"),
        "only the clean region's torn stripe may remain: {}\n{}",
        out.stdout,
        out.stderr
    );
}

/// A 6-member RAID6 fixture named `name`, filled from `seed`, served with JSON-RPC and
/// background copies paced to 1 MiB/s per member (`--speed-max 1024`: a test finds a
/// rebuild or replace of its 8 MiB members part-way for seconds); its server, taken, and
/// nbdcopy. `None` without nbdcopy.
fn paced_fixture(name: &str, seed: u64) -> Option<(TargetFixture, Server, PathBuf)> {
    let nbdcopy = tool("nbdcopy")?;
    let mut fx = TargetFixture::builder(6, 6)
        .name(name)
        .rpc()
        .serve_args(&["--speed-max", "1024"])
        .fill(seed)
        .build()
        .expect("nbdcopy is there");
    let srv = fx.take_server();
    Some((fx, srv, nbdcopy))
}

/// `ferroraid replace --no-wait OLD NEW`, which must succeed.
fn replace_no_wait(srv: &Server, old: &Path, new: &Path) {
    srv.mgmt(
        &[
            OsStr::new("replace"),
            OsStr::new("--no-wait"),
            old.as_os_str(),
            new.as_os_str(),
        ],
        0,
    );
}

/// A rebuild interrupted by a clean stop resumes where it got to: at 1 MiB/s per member
/// (`--speed-max`) the stop finds it part-way, the new member's superblock records its
/// `recovery_offset` (mdadm shows it), and a restart on the members resumes the rebuild
/// there, finishes it, and leaves parity consistent and every member in sync.
#[test]
fn an_interrupted_rebuild_resumes_from_its_recovery_offset() {
    let Some((fx, mut srv, nbdcopy)) = paced_fixture("resume", 31) else {
        return;
    };
    let d = fx.dir();
    let mut a = fx.array.clone();
    let blank = member_files(fx.dir(), "new", 1, MEMBER_BYTES).remove(0);
    let want = fx.data.clone();
    for (cmd, dev) in [("fail", &a.members[2]), ("add", &blank)] {
        srv.mgmt(&[OsStr::new(cmd), dev.as_os_str()], 0);
    }
    // 8 MiB per member at 1 MiB/s: a few seconds in, the rebuild is part-way.
    std::thread::sleep(Duration::from_secs(3));
    let (st, code) = srv.status();
    assert_eq!(st["process"]["kind"], "rebuild", "{st}");
    assert_eq!(code, Some(1), "{st}");
    srv.stop();
    let sectors = |text: &str| -> Option<u64> {
        text.lines()
            .find_map(|l| l.trim().strip_prefix("Recovery Offset :"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    };
    let Some(mdadm) = mdadm() else {
        return;
    };
    let examine_blank = || {
        let out = run_tool(
            Command::new(&mdadm).arg("--examine").arg(&blank),
            d,
            TOOL_TIMEOUT,
        );
        assert!(out.status.success(), "{}", show_output(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = examine_blank();
    let at = sectors(&text).unwrap_or_else(|| panic!("no Recovery Offset:\n{text}"));
    assert!(
        at > 0 && at < (MEMBER_BYTES - DATA_OFFSET) / 512,
        "part-way: {at} sectors\n{text}"
    );
    assert!(text.contains("Device Role : Active device 2"), "{text}");
    // Restart on the new set of members (the failed one left out): the rebuild resumes.
    a.members[2] = blank.clone();
    a.images[2] = blank.clone();
    let mut srv = fx.serve("restart", &a.members, &[]);
    srv.wait_log_for("rebuild complete", TOOL_TIMEOUT);
    let log = srv.log();
    assert!(
        log.contains("the rebuild resumes") && log.contains(&format!("recovery_offset={at}")),
        "{log}"
    );
    let got = srv.read_all(&nbdcopy);
    assert_same("array after the resumed rebuild", &got, &want);
    srv.stop();
    let text = examine_blank();
    assert_eq!(sectors(&text), None, "in sync after the rebuild:\n{text}");
    assert!(text.contains("State : clean"), "{text}");
    a.oracle_verify(None);
}

// ---------------------------------------------------------------------------------------
// Replace (md's `mdadm --replace`) and re-add by bitmap.
// ---------------------------------------------------------------------------------------

/// `ferroraid replace` onto a blank device while fio writes with CRC32C verification: the
/// bad requests are refused by name (too small, already a member, no such member, a
/// second replace), status shows the replacement (`replacing`, process `replace`, the
/// array healthy: exit 0) and then the new device active in the slot, fio verifies every
/// block, the new member's superblock says `Active device 2` and in sync, the old
/// device's own superblock says it is out (mdadm: not an active device), the oracle
/// verifies parity with the new member in place and extracts what the clients wrote, and
/// a restart given the old device too leaves it out.
#[test]
fn replace_a_member_during_client_writes() {
    let Some(fio) = fio_with_nbd() else {
        return;
    };
    let Some(nbdcopy) = tool("nbdcopy") else {
        return;
    };
    // As for the rebuild test: a 100 MB/s floor lets the replace finish under fio. Two
    // reactors: each copies its own stripes, and the last to finish swaps it in on both.
    let mut fx = TargetFixture::builder(6, 6)
        .name("replace")
        .rpc()
        .serve_args(&[
            "--reactors",
            "2",
            "--speed-min",
            "100000",
            "--speed-max",
            "200000",
        ])
        .build()
        .expect("no tool needed");
    let mut srv = fx.take_server();
    let d = fx.dir();
    let mut a = fx.array.clone();
    let new = member_files(fx.dir(), "new", 1, MEMBER_BYTES).remove(0);
    let mut client = fio_verified_writes(&fio, &srv, d, 40);
    srv.wait_member_writes(64);
    let old = a.members[2].clone();
    let small = d.join("small");
    fs::write(&small, vec![0u8; MIB as usize]).unwrap();
    for (from, to, why) in [
        (old.as_os_str(), small.as_os_str(), "smaller"),
        (
            old.as_os_str(),
            a.members[0].as_os_str(),
            "already a member",
        ),
        (OsStr::new("9"), new.as_os_str(), "no such member"),
    ] {
        let text = srv.mgmt(&[OsStr::new("replace"), from, to], 1);
        assert!(text.contains(why), "{text}");
    }
    let text = srv.mgmt(
        &[
            OsStr::new("replace"),
            OsStr::new("--no-wait"),
            old.as_os_str(),
            new.as_os_str(),
        ],
        0,
    );
    assert!(text.contains("replacing member 2"), "{text}");
    // One replace at a time: the same slot, or another, is refused while it runs.
    let other = member_files(d, "other", 1, MEMBER_BYTES).remove(0);
    let (st, code) = srv.status();
    if !members_in(&st, "replacing").is_empty() {
        assert_eq!(code, Some(0), "a replace leaves the array healthy: {st}");
        assert_eq!(st["process"]["kind"], "replace", "{st}");
        let r = &members_in(&st, "replacing")[0];
        assert_eq!(r["slot"], 2, "{st}");
        assert_eq!(r["device"].as_str(), Some(new.to_str().unwrap()), "{st}");
        for slot in ["2", "3"] {
            let text = srv.mgmt(
                &[OsStr::new("replace"), OsStr::new(slot), other.as_os_str()],
                1,
            );
            assert!(text.contains("being replaced"), "{text}");
        }
    }
    let mut seen_replacing = false;
    let st = srv.wait_status("the replace completing", |st, code| {
        if !members_in(st, "replacing").is_empty() && st["process"]["kind"] == "replace" {
            seen_replacing = true;
            assert_eq!(code, Some(0), "a replace leaves the array healthy: {st}");
        }
        members_in(st, "replacing").is_empty()
            && st["members"][2]["device"].as_str() == Some(new.to_str().unwrap())
    });
    eprintln!("replace under fio: seen in progress {seen_replacing}");
    assert_eq!(st["members"][2]["state"], "active", "{st}");
    assert_eq!(st["array"]["state"], "active", "{st}");
    assert!(
        client.try_wait().unwrap().is_none(),
        "fio finished before the replace did: it must replace under client writes"
    );
    let out = client.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "fio saw an error: {}\n{}",
        show_output(&out),
        srv.logs()
    );
    let got = srv.read_all(&nbdcopy);
    srv.stop();
    let log = srv.log();
    // The superblocks record the swap before the reactors make it.
    let (copied, complete) = (log.find("replace copied"), log.find("replace complete"));
    assert!(
        copied.is_some() && complete.is_some() && copied < complete,
        "{}",
        srv.logs()
    );
    for l in log.lines().filter(|l| {
        l.contains("replace started")
            || l.contains("replace copied")
            || l.contains("replace complete")
    }) {
        eprintln!("{l}");
    }
    a.members[2] = new.clone();
    a.images[2] = new.clone();
    if mdadm().is_some() {
        let text = mdadm_examine(d, &new);
        assert!(text.contains("Device Role : Active device 2"), "{text}");
        assert!(text.contains("State : clean"), "{text}");
        assert!(!text.contains("Recovery Offset"), "{text}");
        assert!(text.contains("Array State : AAAAAA"), "{text}");
        // The old device says it is out: its slot is not an active one any more (mdadm
        // prints a device whose own role is faulty as "spare").
        let text_old = mdadm_examine(d, &old);
        assert!(!text_old.contains("Active device"), "{text_old}");
        assert_eq!(
            examine_number(&text_old, "Events :"),
            examine_number(&text, "Events :").map(|e| e - 1),
            "the old device got the completing generation:\n{text_old}"
        );
    }
    a.oracle_verify(None);
    if let Some(want) = a.oracle_extract(d, &[]) {
        assert_same("array after the replace", &got, &want[..got.len()]);
    }
    // Given every device, the old one included, a restart leaves the old one out.
    let mut all = a.members.clone();
    all.push(old.clone());
    let mut srv = fx.serve("restart", &all, &[]);
    let again = srv.read_all(&nbdcopy);
    assert_same("array after a restart", &again, &got);
    assert!(
        srv.logs().contains(&format!("{} not used", old.display())),
        "{}",
        srv.logs()
    );
    srv.stop();
}

/// A replace interrupted by a clean stop resumes where it got to: at 1 MiB/s per member
/// the stop finds it part-way; the new device's superblock says what md's does during a
/// replace (`Replacement device 2`, a `Recovery Offset`, Array State `R` in slot 2), and a
/// restart on all seven devices resumes the replace there, finishes it, and leaves the
/// data and parity right.
#[test]
fn an_interrupted_replace_resumes_from_its_recovery_offset() {
    let Some((fx, mut srv, nbdcopy)) = paced_fixture("rresume", 41) else {
        return;
    };
    let d = fx.dir();
    let mut a = fx.array.clone();
    let new = member_files(fx.dir(), "new", 1, MEMBER_BYTES).remove(0);
    let want = fx.data.clone();
    let old = a.members[2].clone();
    replace_no_wait(&srv, &old, &new);
    std::thread::sleep(Duration::from_secs(3));
    let (st, code) = srv.status();
    assert_eq!(st["process"]["kind"], "replace", "{st}");
    assert_eq!(code, Some(0), "{st}");
    assert!(
        st["process"]["position_bytes"].as_u64().unwrap() > 0,
        "{st}"
    );
    srv.stop();
    let mut all = a.members.clone();
    all.push(new.clone());
    if mdadm().is_some() {
        let text = mdadm_examine(d, &new);
        let at = examine_number(&text, "Recovery Offset :")
            .unwrap_or_else(|| panic!("no Recovery Offset:\n{text}"));
        assert!(
            at > 0 && at < (MEMBER_BYTES - DATA_OFFSET) / 512,
            "part-way: {at} sectors\n{text}"
        );
        assert!(
            text.contains("Device Role : Replacement device 2"),
            "{text}"
        );
        assert!(text.contains("Array State : AARAAA"), "{text}");
        let text0 = mdadm_examine(d, &a.members[0]);
        assert!(text0.contains("Array State : AARAAA"), "{text0}");
    }
    let mut srv = fx.serve("restart", &shuffled(&all, 5), &["--speed-max", "1024"]);
    // A write below the checkpoint at once: the resumed replacement must get it (the
    // oracle below finds its parity wrong otherwise).
    let mut want = want;
    if let Some(qemu_io) = tool("qemu-io") {
        let mut cmd = Command::new(qemu_io);
        cmd.args(["-f", "raw", "-c", "write -P 0x3c 0 1M", &srv.uri()]);
        let out = run_tool(&mut cmd, d, TOOL_TIMEOUT);
        assert!(out.status.success(), "{}", show_output(&out));
        want[..MIB as usize].fill(0x3c);
    }
    srv.wait_log_for("replace complete", TOOL_TIMEOUT);
    assert!(srv.log().contains("the replace resumes"), "{}", srv.logs());
    let got = srv.read_all(&nbdcopy);
    assert_same("array after the resumed replace", &got, &want);
    srv.stop();
    verify_replaced(&mut a, d, 2, &new);
}

/// After a replace of RAID6 member `slot` onto `new` finished and its target stopped:
/// `new` holds the slot in `a`; mdadm (where installed) sees it active with no recovery
/// offset and all six slots in sync; the oracle verifies the data and parity.
fn verify_replaced(a: &mut ferroraid_tests::target::Array, d: &Path, slot: usize, new: &Path) {
    a.members[slot] = new.to_path_buf();
    a.images[slot] = new.to_path_buf();
    if mdadm().is_some() {
        let text = mdadm_examine(d, new);
        assert!(
            text.contains(&format!("Device Role : Active device {slot}")),
            "{text}"
        );
        assert!(!text.contains("Recovery Offset"), "{text}");
        assert!(text.contains("Array State : AAAAAA"), "{text}");
    }
    a.oracle_verify(None);
}

/// A replace cut short by kill -9 while a client writes, after its first checkpoint: the
/// array is left active (dirty) with a replacement part-way. A restart on all seven
/// devices resumes the replace from the checkpoint (a write below it at once must reach
/// the new device), resyncs, and ends with the new device in the slot, every acknowledged
/// write there, and parity consistent.
#[test]
fn kill_9_during_a_replace_under_writes_loses_nothing() {
    let Some((fx, mut srv, nbdcopy)) = paced_fixture("rkill", 43) else {
        return;
    };
    let Some(qemu_io) = tool("qemu-io") else {
        return;
    };
    let d = fx.dir();
    let mut a = fx.array.clone();
    let new = member_files(fx.dir(), "new", 1, MEMBER_BYTES).remove(0);
    let mut want = fx.data.clone();
    let old = a.members[2].clone();
    let write = |srv: &Server, pattern: u8, at_mib: u64, want: &mut Vec<u8>| {
        let mut cmd = Command::new(&qemu_io);
        cmd.args([
            "-f",
            "raw",
            "-c",
            &format!("write -P {pattern:#x} {at_mib}M 1M"),
            &srv.uri(),
        ]);
        let out = run_tool(&mut cmd, d, TOOL_TIMEOUT);
        assert!(out.status.success(), "{}", show_output(&out));
        let at = (at_mib * MIB) as usize;
        want[at..at + MIB as usize].fill(pattern);
    };
    replace_no_wait(&srv, &old, &new);
    for (i, pattern) in [0x51u8, 0x52, 0x53].into_iter().enumerate() {
        std::thread::sleep(Duration::from_secs(1));
        write(&srv, pattern, 4 + 5 * i as u64, &mut want);
    }
    // Past the replace's first checkpoint (every 5 s), short of its end (8 MiB at 1 MiB/s).
    std::thread::sleep(Duration::from_secs(3));
    let (st, _) = srv.status();
    assert_eq!(st["process"]["kind"], "replace", "still copying: {st}");
    srv.kill9();
    let mut all = a.members.clone();
    all.push(new.clone());
    let rpc = fx.rpc_arg();
    let mut srv = fx.serve(
        "restart",
        &shuffled(&all, 7),
        &["--speed-max", "1024", "--rpc", &rpc],
    );
    assert!(srv.log().contains("resync needed"), "{}", srv.logs());
    write(&srv, 0x3c, 0, &mut want);
    srv.wait_log_for("replace complete", TOOL_TIMEOUT);
    let log = srv.log();
    let resumed_at = log
        .split("(copied up to sector ")
        .nth(1)
        .and_then(|t| t.split(')').next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("the replace did not resume:\n{}", srv.logs()));
    assert!(
        resumed_at > 0,
        "resumed from its checkpoint: {}",
        srv.logs()
    );
    srv.wait_status("the replace and the resync done", |st, _| {
        st["process"]["kind"] == "idle" && st["array"]["state"] == "active"
    });
    let got = srv.read_all(&nbdcopy);
    assert_same("array after kill -9 during the replace", &got, &want);
    srv.stop();
    verify_replaced(&mut a, d, 2, &new);
}

/// The new device failing (the operator fails it) cancels the replace: status says the
/// process failed and why, the array is as it was; a second replace, onto a hot spare,
/// whose old member then fails goes on as a rebuild from the others (status: `rebuild`,
/// degraded) and ends with the new device in the slot and the data right.
#[test]
fn replace_cancelled_by_a_failing_new_device_and_turned_into_a_rebuild() {
    let Some(nbdcopy) = tool("nbdcopy") else {
        return;
    };
    // Two reactors: a failure one of them sees is spread to the other.
    let mut fx = TargetFixture::builder(5, 5)
        .name("rfail")
        .rpc()
        .serve_args(&["--speed-max", "1024", "--reactors", "2"])
        .fill(43)
        .build()
        .expect("nbdcopy is there");
    let mut srv = fx.take_server();
    let mut a = fx.array.clone();
    let bad = member_files(fx.dir(), "bad", 1, MEMBER_BYTES).remove(0);
    let new = member_files(fx.dir(), "new", 1, MEMBER_BYTES).remove(0);
    let want = fx.data.clone();
    let old = a.members[1].clone();
    srv.mgmt(
        &[
            OsStr::new("replace"),
            OsStr::new("--no-wait"),
            old.as_os_str(),
            bad.as_os_str(),
        ],
        0,
    );
    std::thread::sleep(Duration::from_millis(500));
    srv.mgmt(&[OsStr::new("fail"), bad.as_os_str()], 0);
    let st = srv.wait_status("the replace stopping", |st, _| {
        members_in(st, "replacing").is_empty() && st["process"]["state"] == "failed"
    });
    assert_eq!(st["process"]["kind"], "replace", "{st}");
    assert!(
        st["process"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("replacement device of member 1 failed")),
        "{st}"
    );
    assert_eq!(st["array"]["state"], "active", "{st}");
    assert_eq!(st["members"][1]["device"].as_str(), old.to_str(), "{st}");
    // Replace again, onto a hot spare this time (md's `--replace` takes a spare); the old
    // member fails part-way: a rebuild from the others.
    let text = srv.mgmt(&[OsStr::new("add"), new.as_os_str()], 0);
    assert!(text.contains("as a spare"), "{text}");
    srv.mgmt(
        &[
            OsStr::new("replace"),
            OsStr::new("--no-wait"),
            OsStr::new("1"),
            new.as_os_str(),
        ],
        0,
    );
    std::thread::sleep(Duration::from_millis(1500));
    srv.mgmt(&[OsStr::new("fail"), old.as_os_str()], 0);
    // At 1 MiB/s per member the copy of 8 MiB is still going.
    let st = srv.wait_status("the replace turning into a rebuild", |st, _| {
        st["process"]["kind"] == "rebuild"
    });
    assert_eq!(members_in(&st, "replacing").len(), 1, "{st}");
    assert_eq!(st["array"]["state"], "degraded", "{st}");
    assert_eq!(srv.status().1, Some(1), "a degraded array exits 1");
    let st = srv.wait_status("the rebuild completing", |st, _| {
        members_in(st, "replacing").is_empty()
            && st["members"][1]["device"].as_str() == Some(new.to_str().unwrap())
            && st["members"][1]["state"] == "active"
    });
    assert_eq!(st["array"]["state"], "active", "{st}");
    let got = srv.read_all(&nbdcopy);
    assert_same("array after the replace turned rebuild", &got, &want);
    srv.stop();
    a.members[1] = new.clone();
    a.images[1] = new.clone();
    a.oracle_verify(None);
    let _ = bad;
}

/// The replacement's superblock cannot be written (its file is gone mid-copy): the replace
/// is cancelled and the member it was copying keeps its slot, in the superblocks too. The
/// failed write used to fail the replacement's role, which recorded the member itself
/// faulty (`Meta::record_with` took the role's device for the one that failed), and the
/// array came back degraded after a restart.
#[test]
fn a_replacement_whose_superblock_cannot_be_written_is_cancelled_and_the_member_kept() {
    let Some((fx, mut srv, nbdcopy)) = paced_fixture("runwritable", 45) else {
        return;
    };
    let d = fx.dir();
    let a = fx.array.clone();
    let new = member_files(fx.dir(), "new", 1, MEMBER_BYTES).remove(0);
    let want = fx.data.clone();
    let old = a.members[2].clone();
    replace_no_wait(&srv, &old, &new);
    std::thread::sleep(Duration::from_millis(500));
    // The reactors keep their open file; the next checkpoint (every 5 s) cannot open it
    // to write its superblock. At 1 MiB/s the copy of 8 MiB is still going then.
    std::fs::remove_file(&new).unwrap();
    let st = srv.wait_status("the replace cancelled", |st, _| {
        members_in(st, "replacing").is_empty() && st["process"]["state"] == "failed"
    });
    assert_eq!(st["process"]["kind"], "replace", "{st}");
    assert_eq!(st["array"]["state"], "active", "{st}");
    assert_eq!(st["members"][2]["device"].as_str(), old.to_str(), "{st}");
    assert!(
        srv.log()
            .contains("the replacement's superblock could not be written"),
        "{}",
        srv.logs()
    );
    let got = srv.read_all(&nbdcopy);
    assert_same("array after the cancelled replace", &got, &want);
    srv.stop();
    if mdadm().is_some() {
        let text = mdadm_examine(d, &a.members[0]);
        assert!(text.contains("Array State : AAAAAA"), "{text}");
    }
    let rpc = fx.rpc_arg();
    let mut srv = fx.serve("restart", &a.members, &["--rpc", &rpc]);
    let (st, code) = srv.status();
    assert_eq!(st["array"]["state"], "active", "{st}");
    assert_eq!(code, Some(0), "{st}");
    srv.stop();
    a.oracle_verify(None);
}

/// A member whose device fails its writes (ENOSPC: its file is on a 3 MiB tmpfs and the
/// clients write 8 MiB to it) while a client writes: the reactors fail it, the monitor
/// records it faulty before the writes finished meanwhile are acknowledged, the client
/// sees every write succeed and reads back what it wrote, nothing stays held, and after a
/// restart on all six devices the member's stale data is left out (its slot recorded
/// faulty on the others) and the data is still right.
#[test]
fn a_member_failing_its_writes_is_recorded_faulty_and_left_out_after_a_restart() {
    let Some(nbdcopy) = tool("nbdcopy") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let mount = match ferroraid_tests::TmpfsMount::new(&d.join("small"), 3 << 20) {
        Ok(m) => m,
        Err(why) => {
            assert!(
                !ferroraid_tests::required("FERRORAID_REQUIRE_MOUNT"),
                "FERRORAID_REQUIRE_MOUNT=1 but {why}"
            );
            eprintln!(
                "SKIPPED a_member_failing_its_writes_is_recorded_faulty_and_left_out_after_a_restart: \
                 {why} (needs root; FERRORAID_REQUIRE_MOUNT=1 makes this a failure)"
            );
            return;
        }
    };
    let mut members = member_files(d, "m", 5, MEMBER_BYTES);
    members.extend(member_files(&mount.dir, "full", 1, MEMBER_BYTES));
    // No zeroing: it would fill the small file system at once (sparse files read zeroes).
    let (array, _) = create_with(
        d,
        6,
        "left-symmetric",
        "enospc",
        &members,
        64 * KIB,
        &["--assume-clean"],
    );
    let rpc = d.join("rpc.sock").display().to_string();
    let mut srv = Server::serve(d, "serve", "enospc", &members, &["--rpc", &rpc]);
    let src = d.join("fill.img");
    let want = random_file(&src, array.size, 51);
    srv.fill(&nbdcopy, &src);
    let st = srv.wait_status("the member failed and recorded", |st, _| {
        st["members"][5]["state"] == "faulty" && st["array"]["state"] == "degraded"
    });
    // Every write was acknowledged: none is held any more (as the reactors publish).
    srv.wait_status("no write held", |st, _| st["writes_awaiting_record"] == 0);
    assert_eq!(st["requests_in_flight"], 0, "{st}");
    let log = srv.log();
    assert!(
        log.contains("member failed; recording it faulty"),
        "{}",
        srv.logs()
    );
    let got = srv.read_all(&nbdcopy);
    assert_same("array after the member failed", &got, &want);
    srv.stop();
    let mut srv = Server::serve(d, "restart", "enospc", &members, &["--rpc", &rpc]);
    let (st, code) = srv.status();
    assert_eq!(st["array"]["state"], "degraded", "{st}");
    assert_eq!(code, Some(1), "{st}");
    let got = srv.read_all(&nbdcopy);
    assert_same("array after the restart", &got, &want);
    srv.stop();
    drop(mount);
}

/// A member failed and removed for a short while, writes to two places meanwhile, then
/// given back with `ferroraid add`: it rejoins its slot and only the bitmap's dirty
/// regions are rebuilt (8 stripes of 128, 512 KiB written to it instead of 8 MiB), the
/// data and parity are right; the bits are cleared again once the array is whole. The
/// same at `serve` after a restart without the member. An array without a bitmap rebuilds
/// a returning member in full.
#[test]
fn a_returning_member_is_rebuilt_only_where_the_bitmap_says() {
    let Some(qemu_io) = tool("qemu-io") else {
        return;
    };
    let Some(mut fx) = create_with_bitmap("readd", |b| {
        b.rpc().serve_args(&["--reactors", "2"]).fill(47)
    }) else {
        return;
    };
    let d = fx.dir().to_path_buf();
    let d = d.as_path();
    let rpc_arg = fx.rpc_arg();
    let nbdcopy = fx.nbdcopy.clone().expect("filled");
    let mut want = std::mem::take(&mut fx.data);
    let (a, srv) = (&fx.array, fx.server.as_mut().expect("served"));
    // The daemon clears the bits after 5-10 s of quiet.
    srv.wait_status("the bitmap clearing", |st, _| {
        st["bitmap"]["dirty_regions"] == 0
    });
    let gone = a.members[1].clone();
    // The engine keeps counting the slot's I/O across its absence (a removed slot reports
    // none): the baseline is taken before.
    let (st, _) = srv.status();
    let before = st["members"][1]["io"]["write_bytes"].as_u64().unwrap();
    srv.mgmt(&[OsStr::new("fail"), gone.as_os_str()], 0);
    srv.mgmt(&[OsStr::new("remove"), gone.as_os_str()], 0);
    // 128 KiB at 0 (region 0) and at 8 MiB (region 16): two regions of 4 stripes each.
    let write = |srv: &Server, at: u64, byte: u8, want: &mut Vec<u8>| {
        srv.qemu_io(&qemu_io, &[&format!("write -P {byte} {at} 128K")]);
        want[at as usize..(at + 128 * KIB) as usize].fill(byte);
    };
    write(srv, 0, 0x5a, &mut want);
    write(srv, 8 * MIB, 0x6b, &mut want);
    let st = srv.wait_status("the writes marked", |st, _| {
        st["bitmap"]["dirty_regions"] == 2
    });
    assert_eq!(st["bitmap"]["clearing"], false, "kept while degraded: {st}");
    let text = srv.mgmt(&[OsStr::new("add"), gone.as_os_str()], 0);
    assert!(text.contains("as member 1"), "{text}");
    let st = srv.wait_status("the re-add completing", |st, _| {
        st["members"][1]["state"] == "active" && st["process"]["kind"] == "idle"
    });
    let written = st["members"][1]["io"]["write_bytes"].as_u64().unwrap() - before;
    let log = srv.wait_log("process=rebuild stripes=8");
    assert!(log.contains("member re-added"), "{log}");
    // 8 stripes × 64 KiB of data, plus the bitmap area and its updates: far below the
    // 8 MiB a full rebuild writes.
    assert!(
        (512 * KIB..MIB).contains(&written),
        "{written} bytes written to the re-added member\n{log}"
    );
    eprintln!("re-add wrote {written} bytes to the member (a full rebuild: 8 MiB)");
    let got = srv.read_all(&nbdcopy);
    assert_same("array after the re-add", &got, &want);
    // Whole again: the bits are cleared.
    srv.wait_status("the bitmap clearing again", |st, _| {
        st["bitmap"]["dirty_regions"] == 0 && st["bitmap"]["clearing"] == true
    });
    // Out again; a restart without it; writes; a restart with it re-adds it at serve.
    srv.mgmt(&[OsStr::new("fail"), gone.as_os_str()], 0);
    write(srv, 4 * MIB, 0x7c, &mut want);
    srv.stop();
    let others: Vec<PathBuf> = a.members.iter().filter(|m| **m != gone).cloned().collect();
    let mut srv = Server::serve(d, "degraded", "readd", &others, &[]);
    write(&srv, 12 * MIB, 0x8d, &mut want);
    srv.stop();
    let mut srv = Server::serve(d, "back", "readd", &a.members, &["--rpc", &rpc_arg]);
    srv.wait_status("the re-add at serve", |st, _| {
        st["members"][1]["state"] == "active" && st["process"]["kind"] == "idle"
    });
    let log = srv.wait_log("process=rebuild stripes=8");
    assert!(log.contains("bitmap-based recovery"), "{log}");
    assert!(log.contains("member re-added"), "{log}");
    let got = srv.read_all(&nbdcopy);
    assert_same("array after the re-add at serve", &got, &want);
    srv.stop();
    a.oracle_verify(None);

    // Without a bitmap: a full rebuild.
    let mut fx = TargetFixture::builder(5, 5)
        .prefix("n")
        .name("nobm")
        .label("nobm")
        .rpc()
        .fill(53)
        .build()
        .expect("nbdcopy is there");
    let want = std::mem::take(&mut fx.data);
    let (b, srv) = (&mut fx.array, fx.server.as_mut().expect("served"));
    let gone = b.members[3].clone();
    srv.mgmt(&[OsStr::new("fail"), gone.as_os_str()], 0);
    srv.mgmt(&[OsStr::new("remove"), gone.as_os_str()], 0);
    srv.mgmt(&[OsStr::new("add"), gone.as_os_str()], 0);
    srv.wait_status("the full rebuild", |st, _| {
        st["members"][3]["state"] == "active" && st["process"]["kind"] == "idle"
    });
    let log = srv.wait_log("process=rebuild stripes=128");
    assert!(
        log.contains("cannot return by bitmap") && log.contains("no write-intent bitmap"),
        "{log}"
    );
    let got = srv.read_all(&nbdcopy);
    assert_same("array after the full rebuild", &got, &want);
    srv.stop();
    b.images = b.members.clone();
    b.oracle_verify(None);
}

// ---------------------------------------------------------------------------------------
// The metrics endpoint (issue 21).
// ---------------------------------------------------------------------------------------

/// One HTTP/1.0 exchange with the metrics endpoint: `(status code, body)`.
fn http(port: u16, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connecting to the metrics port");
    s.set_read_timeout(Some(TOOL_TIMEOUT)).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).expect("reading the answer");
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {head}"));
    (code, body.to_string())
}

/// `GET /metrics` in the Prometheus text format, answered 200 (503 — the array is still
/// being assembled after the NBD port opened — is retried for up to 10 s).
fn scrape(port: u16) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, body) = http(port, "GET /metrics HTTP/1.0\r\nHost: test\r\n\r\n");
        if code == 503 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        assert_eq!(code, 200, "{body}");
        return body;
    }
}

/// The sum of every sample of family `name` whose labels contain every `label=value` of
/// `labels`.
fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, v) = l.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, ""));
            (n == name && labels.iter().all(|x| rest.contains(x))).then(|| v.parse::<f64>().ok())?
        })
        .sum()
}

/// Scrapes until `ok` holds for the text (the reactors publish every 100 ms), at most 10 s.
fn scrape_until(port: u16, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let t = scrape(port);
        if ok(&t) {
            return t;
        }
        assert!(Instant::now() < deadline, "{what}: never seen in\n{t}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `serve --metrics` exports Prometheus text a monitoring system accepts (`promtool check
/// metrics`), OpenMetrics when asked, and its counters move by what fio did: 8 MiB written
/// in 64 KiB requests shows as at least 8 MiB × members/data chunks written to the members
/// and at least 128 write requests' stripe writes; 8 MiB read back as at least 8 MiB read
/// from the members and 128 small-read queue waits. Scrapes during fio are answered. Bad
/// paths get 404, other methods 405; a bad or busy address is refused at start.
#[test]
fn metrics_endpoint_counts_what_fio_did_and_promtool_accepts_it() {
    let Some(fio) = fio_with_nbd() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let members = member_files(d.path(), "m", 4, 32 * MIB);
    let a = create(d.path(), 5, "left-symmetric", "met", &members);
    let refused = refused_serve(
        d.path(),
        "bad metrics address",
        &members,
        &["--metrics", "nowhere"],
    );
    assert!(refused.contains("expected HOST:PORT"), "{refused}");
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_addr = busy.local_addr().unwrap().to_string();
    let refused = refused_serve(
        d.path(),
        "busy metrics address",
        &members,
        &["--metrics", &busy_addr],
    );
    assert!(
        refused.contains("binding the metrics endpoint"),
        "{refused}"
    );
    drop(busy);

    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let srv = Server::serve(d.path(), "met", &a.name, &members, &["--metrics", &addr]);
    let before = scrape(port);
    let array = r#"array="met""#;
    assert_eq!(
        metric_sum(&before, "ferroraid_array_raid_devices", &[array]),
        4.0,
        "{before}"
    );
    assert_eq!(
        metric_sum(&before, "ferroraid_member_state", &[r#"state="active""#]),
        4.0,
        "{before}"
    );
    if let Some(lines) = ferroraid_tests::promtool_check(&before) {
        eprintln!("promtool check metrics: accepted ({lines} lines)");
    }
    let (code, om) = http(
        port,
        "GET /metrics HTTP/1.0\r\nAccept: application/openmetrics-text; version=1.0.0\r\n\r\n",
    );
    assert_eq!(code, 200);
    assert!(om.ends_with("# EOF\n"), "{om}");
    assert_eq!(http(port, "GET /nope HTTP/1.0\r\n\r\n").0, 404);
    assert_eq!(
        http(port, "POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n").0,
        405
    );

    let member_written = |t: &str| metric_sum(t, "ferroraid_member_written_bytes_total", &[array]);
    let member_read = |t: &str| metric_sum(t, "ferroraid_member_read_bytes_total", &[array]);
    let stripe_writes = |t: &str| metric_sum(t, "ferroraid_array_stripe_writes_total", &[array]);
    let small_reads = |t: &str| {
        metric_sum(
            t,
            "ferroraid_array_queue_wait_seconds_count",
            &[r#"class="small_read""#],
        )
    };
    let fio_job = |rw: &str| {
        Command::new(&fio)
            .current_dir(d.path())
            .args([
                "--name=metrics",
                "--ioengine=nbd",
                &format!("--uri={}", srv.uri()),
                &format!("--rw={rw}"),
                "--bs=64k",
                "--size=8m",
                "--iodepth=4",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut writer = fio_job("write");
    // Scrapes while fio runs are answered (a management thread, not a reactor).
    let t0 = Instant::now();
    let during = scrape(port);
    assert!(
        during.contains("ferroraid_reactor_busy_seconds_total"),
        "{during}"
    );
    eprintln!("a scrape during fio took {:?}", t0.elapsed());
    let out = wait_child_output(&mut writer);
    assert!(out.status.success(), "fio write: {}", show_output(&out));
    let data_chunks = data_chunks(5, 4) as f64;
    let client = (8 * MIB) as f64;
    let after_write = scrape_until(port, "the writes at the members", |t| {
        member_written(t) - member_written(&before) >= client * 4.0 / data_chunks
    });
    let written = member_written(&after_write) - member_written(&before);
    assert!(
        written <= client * 3.0,
        "{written} member bytes for {client} written"
    );
    assert!(stripe_writes(&after_write) - stripe_writes(&before) >= 1.0);
    let mut reader = fio_job("read");
    let out = wait_child_output(&mut reader);
    assert!(out.status.success(), "fio read: {}", show_output(&out));
    let after_read = scrape_until(port, "the reads at the members", |t| {
        member_read(t) - member_read(&after_write) >= client
            && small_reads(t) - small_reads(&after_write) >= 128.0
    });
    eprintln!(
        "fio wrote {client} bytes: members took {written} bytes; fio read {client} bytes: \
         members gave {} bytes, {} small reads queued",
        member_read(&after_read) - member_read(&after_write),
        small_reads(&after_read) - small_reads(&after_write)
    );
    drop(srv);
}

// ---------------------------------------------------------------------------------------
// Service integration: systemd's Type=notify (issue 21).
// ---------------------------------------------------------------------------------------

/// Under a service manager (`NOTIFY_SOCKET` set to a datagram socket the test binds, as
/// systemd does for `Type=notify`), `serve` sends `READY=1` only once the export answers
/// and the management socket serves (the NBD greeting and `status` work the moment it
/// arrives; the log says every export listened before it), with a `STATUS=` naming the
/// array; SIGTERM gives `STOPPING=1` before the exit; a start that fails sends no
/// `READY=1` but a `STATUS=` saying why.
#[test]
fn serve_tells_systemd_it_is_ready_only_once_the_export_answers() {
    use std::os::unix::net::UnixDatagram;
    let fx = TargetFixture::builder(5, 4)
        .name("notified")
        .no_serve()
        .build()
        .expect("no tool needed");
    let d = fx.dir();
    let sock_path = d.join("notify.sock");
    let notify = UnixDatagram::bind(&sock_path).unwrap();
    notify.set_read_timeout(Some(START_TIMEOUT)).unwrap();
    let recv = || -> String {
        let mut buf = [0u8; 4096];
        let n = notify
            .recv(&mut buf)
            .expect("a notification within START_TIMEOUT");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };

    let port = free_port();
    let nbd_sock = d.join("notified.sock");
    let rpc = d.join("rpc.sock");
    let mut args: Vec<OsString> = ["serve", "--adaptive", "--nbd"]
        .iter()
        .map(OsString::from)
        .collect();
    args.push(format!("127.0.0.1:{port}").into());
    args.extend([
        "--nbd".into(),
        format!("unix:{}", nbd_sock.display()).into(),
    ]);
    args.extend(["--rpc".into(), rpc.clone().into_os_string()]);
    args.extend(fx.array.members.iter().map(|m| m.as_os_str().to_owned()));
    let mut cmd = ferroraid_cmd(&args);
    cmd.env("NOTIFY_SOCKET", &sock_path);
    let mut srv = Server::launch(d, "notified", cmd, &args, "notified", port, Some(nbd_sock));
    let ready = recv();
    // The moment READY=1 arrives, the export greets and the management socket answers.
    assert!(
        srv.greets(),
        "READY=1 before the NBD port answered:\n{}",
        srv.logs()
    );
    let out = run_tool(
        ferroraid_cmd(["status", "--json", "--rpc"]).arg(&rpc),
        d,
        TOOL_TIMEOUT,
    );
    assert_eq!(out.status.code(), Some(0), "{}", show_output(&out));
    let lines: Vec<&str> = ready.lines().collect();
    assert_eq!(lines.first(), Some(&"READY=1"), "{ready:?}");
    let status = lines
        .iter()
        .find_map(|l| l.strip_prefix("STATUS="))
        .unwrap_or_else(|| panic!("no STATUS= in {ready:?}"));
    assert!(
        status.contains("serving array \"notified\"")
            && status.contains("4/4 members online")
            && status.contains(&format!("nbd 127.0.0.1:{port}")),
        "{status}"
    );
    let log = srv.log();
    let told = log
        .find("told the service manager: ready")
        .unwrap_or_else(|| panic!("no readiness in the log:\n{log}"));
    let last_listen = log
        .rfind("NBD export listening")
        .unwrap_or_else(|| panic!("no export in the log:\n{log}"));
    assert!(
        last_listen < told,
        "ready before every export listened:\n{log}"
    );
    let st = srv.stop_with(libc::SIGTERM);
    assert!(st.success(), "{st}:\n{}", srv.logs());
    let stopping = recv();
    assert!(stopping.starts_with("STOPPING=1\n"), "{stopping:?}");
    drop(srv);
    examine(d, &fx.array.members, "clean", None);

    // A refused start (a member missing, not forced): no READY=1, a STATUS= with the reason.
    let err = {
        let mut cmd = ferroraid_cmd(["serve", "--adaptive", "--nbd"]);
        cmd.arg(format!("127.0.0.1:{}", free_port()))
            .args(&fx.array.members[1..])
            .env("NOTIFY_SOCKET", &sock_path);
        let out = run_tool(&mut cmd, d, REFUSE_TIMEOUT);
        assert!(!out.status.success(), "{}", show_output(&out));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let failed = recv();
    assert!(
        !failed.contains("READY=1") && failed.starts_with("STATUS=start failed: "),
        "{failed:?} ({err})"
    );
    assert!(
        failed.contains("--force"),
        "the reason, as on stderr: {failed:?}"
    );
}

/// The PPL area (byte offset, bytes) of member file `p`, from its superblock.
fn ppl_area_of(p: &Path) -> (u64, u64) {
    let sb = drivers::metadata_io::read_superblock(p).unwrap();
    let (off, size) = sb.ppl();
    assert!(size > 0, "{}: no PPL area", p.display());
    let at = (sb.super_offset as i64 + i64::from(off)) as u64 * 512;
    (at, u64::from(size) * 512)
}

/// A device joining an array with a Partial Parity Log has its PPL area zeroed first: a
/// replacement whose area holds records of this array from an earlier run (same
/// signature, so recovery would take them for its own) has them wiped before it takes
/// the slot, and so do a spare added later and a spare known since assembly that a
/// failure promotes. (Zeroes, not md's empty header: the running log goes on past the
/// area's start, and the engine rewinds the slot's log there at the swap.)
#[test]
fn a_device_joining_a_ppl_array_has_its_log_wiped() {
    if tool("qemu-io").is_none() {
        return;
    }
    let mut fx = TargetFixture::builder(5, 4)
        .name("ppl-join")
        .consistency_policy("ppl")
        .rpc()
        .build()
        .expect("no tool needed");
    let d = fx.dir().to_path_buf();
    let mut reference = vec![0u8; 16 * MIB as usize];
    qemu_io_patterns(fx.srv(), &d, &mut reference);
    fx.stop();
    let members = fx.array.members.clone();
    let (at, len) = ppl_area_of(&members[0]);
    let mut stale = vec![0u8; len as usize];
    fs::File::open(&members[0])
        .unwrap()
        .read_exact_at(&mut stale, at)
        .unwrap();
    assert!(
        stale.iter().skip(4096).any(|&b| b != 0),
        "the first run left no record to go stale"
    );
    // Two blank devices (no superblock) carrying the first run's log of member 0.
    let joining: Vec<PathBuf> = member_files(&d, "joining", 2, MEMBER_BYTES);
    for p in &joining {
        fs::OpenOptions::new()
            .write(true)
            .open(p)
            .unwrap()
            .write_all_at(&stale, at)
            .unwrap();
    }
    let rpc = fx.rpc_arg();
    let srv = fx.serve("again", &members, &["--rpc", &rpc]);
    let empty = vec![0u8; len as usize];
    let text = srv.mgmt(
        &[
            OsStr::new("replace"),
            members[2].as_os_str(),
            joining[0].as_os_str(),
        ],
        0,
    );
    assert!(text.contains("replace done"), "{text}");
    let text = srv.mgmt(&[OsStr::new("add"), joining[1].as_os_str()], 0);
    assert!(text.contains("spare"), "{text}");
    let area_of = |p: &Path| {
        let mut area = vec![0u8; len as usize];
        fs::File::open(p)
            .unwrap()
            .read_exact_at(&mut area, at)
            .unwrap();
        area
    };
    for p in &joining {
        assert!(
            area_of(p) == empty,
            "{}: its PPL area was not wiped",
            p.display()
        );
    }
    let mut srv = srv;
    srv.stop();
    // A spare known since assembly (its area untouched by it) that a failure promotes.
    fs::OpenOptions::new()
        .write(true)
        .open(&joining[1])
        .unwrap()
        .write_all_at(&stale, at)
        .unwrap();
    let mut now = members.clone();
    now[2] = joining[0].clone();
    now.push(joining[1].clone());
    let mut srv = fx.serve("promote", &now, &["--rpc", &rpc]);
    srv.mgmt(&[OsStr::new("fail"), members[3].as_os_str()], 0);
    let spare = joining[1].to_str().unwrap().to_string();
    srv.wait_status("the spare taking member 3's role", |st, _| {
        st["members"][3]["device"].as_str() == Some(spare.as_str())
    });
    assert!(
        area_of(&joining[1]) == empty,
        "the promoted spare's PPL area was not wiped"
    );
    srv.stop();
}
