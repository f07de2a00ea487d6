//! Exports added and removed while the array serves, with the real binary:
//! `ferroraid export add|remove|list` against `serve --rpc`.
//!
//! - `remove_drains_and_readd_serves`: a RAID5 filled with seeded data and served over
//!   NBD; a libnbd client (python3-libnbd) has 64 writes of 256 KiB in flight when
//!   `export remove nbd` runs: every write it sent gets its reply or the connection's end,
//!   none is left hanging, the connection closes, the ports (TCP and Unix) refuse, the
//!   protocol is no longer listed and a second remove is refused; `export add nbd` on a
//!   new port with another name serves again (nbdinfo sees the size, qemu-io writes and
//!   verifies a pattern) and the whole array reads back as the fill, the acknowledged
//!   writes and the pattern (a write not acknowledged reads as old or new data, never
//!   anything else); the target then stops cleanly.
//! - `serve_without_nbd_then_add`: `serve --nbd none` serves no export until
//!   `export add nbd`; a second add of the protocol is refused with "already exported".

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};

use ferroraid_tests::target::{assert_same, free_port, Server, TargetFixture, MIB, TOOL_TIMEOUT};
use ferroraid_tests::{run_tool, show_output, tool};

/// Writes `N` regions of `SIZE` bytes (write `i` at `i * SIZE`, every byte `pattern(i)`)
/// without waiting, says "submitted", then collects the replies until none is in flight
/// or the connection ends; prints the acknowledged writes' indexes, the failed count, and
/// "closed" when a later read fails (the server closed the connection).
const CLIENT: &str = r#"
import sys, nbd
uri, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
h = nbd.NBD()
h.connect_uri(uri)
cookies = []
for i in range(n):
    buf = nbd.Buffer.from_bytearray(bytearray([(i * 7 + 1) & 0xff]) * size)
    cookies.append(h.aio_pwrite(buf, i * size))
print("submitted", flush=True)
while h.aio_in_flight() > 0:
    try:
        h.poll(-1)
    except nbd.Error:
        break
ok, failed, pending = [], 0, 0
for i, c in enumerate(cookies):
    try:
        if h.aio_command_completed(c):
            ok.append(i)
        else:
            pending += 1
    except nbd.Error:
        failed += 1
print("ok", " ".join(map(str, ok)), flush=True)
print("failed", failed, "pending", pending, flush=True)
# Every write may have completed before the removal began: probe the connection only
# once the test says the removal returned.
sys.stdin.readline()
try:
    h.pread(512, 0)
    print("still open", flush=True)
except nbd.Error as e:
    print("closed", e, flush=True)
"#;

/// The byte write `i` of the client fills its region with.
fn pattern(i: usize) -> u8 {
    ((i * 7 + 1) & 0xff) as u8
}

/// `ferroraid ARGS... --rpc SOCK` against `srv`, with exit status `code`: its output.
fn mgmt(srv: &Server, args: &[&str], code: i32) -> String {
    let args: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
    srv.mgmt(&args, code)
}

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// The whole export at `uri`, read with nbdcopy into `dir`.
fn read_all(srv: &Server, nbdcopy: &Path, uri: &str, dir: &Path) -> Vec<u8> {
    let out = dir.join("readback.img");
    srv.client_ok(Command::new(nbdcopy).arg(uri).arg(&out), dir);
    let v = std::fs::read(&out).expect("reading the copy");
    let _ = std::fs::remove_file(&out);
    v
}

#[test]
fn remove_drains_and_readd_serves() {
    let Some(python) = ferroraid_tests::python_nbd() else {
        return;
    };
    let (Some(nbdinfo), Some(qemu_io)) = (tool("nbdinfo"), tool("qemu-io")) else {
        return;
    };
    let Some(mut fx) = TargetFixture::builder(5, 4).rpc().fill(21).build() else {
        return;
    };
    let nbdcopy = fx.nbdcopy.clone().expect("a filled fixture has nbdcopy");
    let dir = fx.dir().to_path_buf();
    let mut want = fx.data.clone();
    let (n, size) = (64usize, 256 * 1024usize);
    assert!((n * size) as u64 <= fx.array.size);
    let srv = fx.srv();
    let listed = json(&mgmt(srv, &["export", "list", "--json"], 0));
    assert!(
        listed.as_array().is_some_and(|l| l
            .iter()
            .any(|e| e["protocol"] == "nbd" && e["address"] == format!("127.0.0.1:{}", srv.port))),
        "{listed}"
    );
    // One NBD server per array.
    let refused = mgmt(
        srv,
        &[
            "export",
            "add",
            "nbd",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
        ],
        1,
    );
    assert!(refused.contains("nbd is already exported"), "{refused}");

    // Writes in flight, then the export removed under them.
    let mut client = Command::new(&python)
        .args(["-c", CLIENT, &srv.uri(), &n.to_string(), &size.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the libnbd client");
    let mut lines = BufReader::new(client.stdout.take().expect("piped")).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    assert_eq!(first, "submitted", "the client: {first}\n{}", srv.logs());
    let removed = json(&mgmt(srv, &["export", "remove", "nbd", "--json"], 0));
    assert_eq!(removed["protocol"], "nbd", "{removed}");
    assert_eq!(removed["drained"], true, "{removed}\n{}", srv.logs());
    // The removal returned: the client may now look whether its connection is closed.
    {
        use std::io::Write as _;
        let mut go = client.stdin.take().expect("piped");
        go.write_all(b"removed\n").expect("telling the client");
    }
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = ferroraid_tests::target::wait_child(&mut client, TOOL_TIMEOUT);
    let mut err = String::new();
    let _ = std::io::Read::read_to_string(&mut client.stderr.take().expect("piped"), &mut err);
    assert!(status.success(), "client: {rest:?} {err}\n{}", srv.logs());
    let acked: Vec<usize> = rest
        .iter()
        .find_map(|l| l.strip_prefix("ok"))
        .map(|l| {
            l.split_whitespace()
                .map(|x| x.parse().expect("an index"))
                .collect()
        })
        .unwrap_or_else(|| panic!("no ok line: {rest:?}"));
    let counts = rest
        .iter()
        .find(|l| l.starts_with("failed"))
        .expect("a failed line");
    let failed: usize = counts.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(
        counts.ends_with("pending 0"),
        "a request left hanging: {rest:?}"
    );
    assert_eq!(acked.len() + failed, n, "{rest:?}");
    assert!(
        rest.iter().any(|l| l.starts_with("closed")),
        "the connection stayed open after the removal: {rest:?}"
    );
    eprintln!(
        "export remove with {n} writes in flight: {} acknowledged, {failed} cut by the close",
        acked.len()
    );
    // The ports refuse; the list is empty; a second removal is refused.
    assert!(
        TcpStream::connect(("127.0.0.1", srv.port)).is_err(),
        "TCP port still open"
    );
    let sock = srv
        .socket
        .clone()
        .expect("the fixture listens on a Unix socket");
    assert!(
        UnixStream::connect(&sock).is_err(),
        "Unix socket still open"
    );
    let listed = json(&mgmt(srv, &["export", "list", "--json"], 0));
    assert_eq!(listed, serde_json::json!([]), "{listed}");
    let (st, _) = srv.status();
    assert_eq!(st["exports"], serde_json::json!([]), "{st}");
    let again = mgmt(srv, &["export", "remove", "nbd"], 1);
    assert!(again.contains("nbd is not exported"), "{again}");

    // Added again on a new port, under another name.
    let port = free_port();
    let added = json(&mgmt(
        srv,
        &[
            "export",
            "add",
            "nbd",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--name",
            "again",
            "--json",
        ],
        0,
    ));
    assert_eq!(
        added,
        serde_json::json!([{"protocol": "nbd", "address": format!("127.0.0.1:{port}"), "name": "again"}]),
    );
    let uri = format!("nbd://127.0.0.1:{port}/again");
    let info = srv.client_ok(Command::new(&nbdinfo).args(["--size", &uri]), &dir);
    assert_eq!(info.trim(), fx.array.size.to_string(), "nbdinfo --size");
    let at = 20 * MIB;
    for (cmd, what) in [
        (format!("write -P 0xa5 {at} 65536"), "write"),
        (format!("read -P 0xa5 {at} 65536"), "read back"),
    ] {
        let out = run_tool(
            Command::new(&qemu_io).args(["-f", "raw", "-c", &cmd, &uri]),
            &dir,
            TOOL_TIMEOUT,
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && !text.contains("Pattern verification failed"),
            "qemu-io {what}: {}\n{}",
            show_output(&out),
            srv.logs()
        );
    }
    want[at as usize..at as usize + 65536].fill(0xa5);
    // The array: the fill, the acknowledged writes, the pattern; a write that was cut
    // reads as the fill or as its own bytes, never anything else.
    let got = read_all(srv, &nbdcopy, &uri, &dir);
    assert_eq!(got.len(), want.len());
    for i in 0..n {
        let r = i * size..(i + 1) * size;
        if acked.contains(&i) {
            want[r].fill(pattern(i));
        } else if got[r.clone()] != want[r.clone()] {
            for (k, (&g, &w)) in got[r.clone()].iter().zip(&want[r.clone()]).enumerate() {
                assert!(
                    g == w || g == pattern(i),
                    "write {i} (cut): byte {} is {g:#x}, neither the fill {w:#x} nor {:#x}",
                    r.start + k,
                    pattern(i)
                );
            }
            want[r.clone()].copy_from_slice(&got[r]);
        }
    }
    assert_same("the array after remove and re-add", &got, &want);
    fx.stop();
}

#[test]
fn serve_without_nbd_then_add() {
    let Some(nbdinfo) = tool("nbdinfo") else {
        return;
    };
    let Some(fx) = TargetFixture::builder(5, 4).no_serve().build() else {
        return;
    };
    let dir = fx.dir().to_path_buf();
    let rpc = fx.rpc_arg();
    let port = free_port();
    let mut args: Vec<std::ffi::OsString> = ["serve", "--adaptive", "--nbd", "none", "--rpc", &rpc]
        .iter()
        .map(Into::into)
        .collect();
    args.extend(fx.array.members.iter().map(|d| d.as_os_str().to_owned()));
    let mut srv = Server::spawn_unready(&dir, "nonbd", &args, &fx.array.name, port, None);
    let st = srv.wait_status("the array served", |st, code| {
        code == Some(0) && st["array"]["name"].is_string()
    });
    assert_eq!(st["exports"], serde_json::json!([]), "{st}");
    assert!(
        !srv.greets(),
        "NBD answers on 127.0.0.1:{port} before any export"
    );
    let none = mgmt(&srv, &["export", "list"], 0);
    assert!(none.contains("no export"), "{none}");
    let out = mgmt(
        &srv,
        &[
            "export",
            "add",
            "nbd",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ],
        0,
    );
    assert!(out.contains("nbd export added"), "{out}");
    srv.wait_ready();
    let refused = mgmt(
        &srv,
        &[
            "export",
            "add",
            "nbd",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
        ],
        1,
    );
    assert!(refused.contains("already exported"), "{refused}");
    let info = srv.client_ok(Command::new(&nbdinfo).args(["--size", &srv.uri()]), &dir);
    assert_eq!(info.trim(), fx.array.size.to_string());
    srv.stop();
}
