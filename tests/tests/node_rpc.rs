//! An appliance started empty (`serve --rpc` with no array) is given arrays at runtime
//! over JSON-RPC with the real binary (issue 21): `create --rpc` writes and starts them
//! (`array_create`, its progress handle `array_create_progress`), `list` shows them, a
//! request without `--array` is refused while several run, `stop`/`start` take one away
//! and bring it back while the other serves, and bad requests are refused with clear
//! errors that disturb nothing.

use std::ffi::OsString;
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use ferroraid_tests::target::{ferroraid_cmd, free_port, member_files, Server};
use ferroraid_tests::tool;

fn run(args: &[&str], rpc: &Path) -> Output {
    ferroraid_cmd(args)
        .arg("--rpc")
        .arg(rpc)
        .output()
        .expect("running ferroraid")
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn json(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", text(o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(o)))
}

#[test]
fn an_empty_appliance_creates_lists_stops_and_starts_arrays() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rpc = d.join("node.sock");
    let args: Vec<OsString> = vec![
        "serve".into(),
        "--adaptive".into(),
        "--reactors".into(),
        "2".into(),
        "--rpc".into(),
        rpc.clone().into(),
    ];
    let mut srv = Server::spawn_unready(d, "node", &args, "", 0, None);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let o = run(&["list", "--json"], &rpc);
        if o.status.success() {
            assert_eq!(
                json(&o),
                serde_json::json!([]),
                "an empty appliance lists nothing"
            );
            break;
        }
        assert!(Instant::now() < deadline, "never answered: {}", srv.logs());
        assert!(srv.try_wait().is_none(), "serve exited: {}", srv.logs());
        std::thread::sleep(Duration::from_millis(50));
    }
    // A per-array request with no array running says so.
    let o = run(&["status"], &rpc);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no array is running"),
        "{}",
        text(&o)
    );

    let (pa, pb) = (free_port(), free_port());
    let a = member_files(d, "a", 4, 40 << 20);
    let b = member_files(d, "b", 5, 40 << 20);
    let path = |p: &std::path::PathBuf| p.display().to_string();
    let mut create_a = vec!["create", "--json", "--level", "5", "--name", "alpha"];
    let nbd_a = format!("127.0.0.1:{pa}");
    create_a.extend(["--nbd", &nbd_a]);
    let a_paths: Vec<String> = a.iter().map(path).collect();
    create_a.extend(a_paths.iter().map(String::as_str));
    let created = json(&run(&create_a, &rpc));
    assert_eq!(created["array"], "alpha");
    assert_eq!(created["status"]["array"]["level"], 5, "{created}");
    let size_a = created["size_bytes"].as_u64().unwrap();
    assert_eq!(size_a, 3 * (39 << 20), "{created}");
    // The progress handle: the create is done, and it zeroed every member's data area.
    let mut client = ferroraid::rpc::RpcClient::connect(&rpc).unwrap();
    let jobs = client.array_create_progress().unwrap();
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert_eq!(jobs[0].state, "done", "{jobs:?}");
    assert_eq!(jobs[0].total_bytes, 4 * (39 << 20), "{jobs:?}");
    assert_eq!(jobs[0].zeroed_bytes, jobs[0].total_bytes, "{jobs:?}");

    let mut create_b = vec!["create", "--level", "6", "--name", "beta"];
    let nbd_b = format!("127.0.0.1:{pb}");
    create_b.extend(["--nbd", &nbd_b]);
    let b_paths: Vec<String> = b.iter().map(path).collect();
    create_b.extend(b_paths.iter().map(String::as_str));
    let o = run(&create_b, &rpc);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("started"),
        "{}",
        text(&o)
    );

    let listed = json(&run(&["list", "--json"], &rpc));
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["array"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["alpha", "beta"], "{listed}");
    // Several arrays: a request must name one; naming one works.
    let o = run(&["status"], &rpc);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("serves 2 arrays (alpha, beta)"),
        "{}",
        text(&o)
    );
    let st = json(&run(&["status", "--json", "--array", "beta"], &rpc));
    assert_eq!(st["array"]["level"], 6, "{st}");
    // Refusals that disturb nothing: a second array of a name in use, devices in use, a
    // stop of an unknown array, a member of an unknown array.
    let o = run(&create_a, &rpc);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("already running"),
        "{}",
        text(&o)
    );
    let mut start_b = vec!["start"];
    start_b.extend(b_paths.iter().map(String::as_str));
    let o = run(&start_b, &rpc);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("in use"),
        "{}",
        text(&o)
    );
    let o = run(&["stop", "gamma"], &rpc);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no running array is named \"gamma\""),
        "{}",
        text(&o)
    );
    let o = run(&["fail", "--array", "gamma", "0"], &rpc);
    assert!(!o.status.success(), "{}", text(&o));
    assert_eq!(
        json(&run(&["list", "--json"], &rpc))
            .as_array()
            .unwrap()
            .len(),
        2
    );

    // Data written to alpha survives a stop and a start while beta serves.
    let qemu_io = tool("qemu-io");
    if let Some(q) = &qemu_io {
        let o = std::process::Command::new(q)
            .args(["-f", "raw", "-c", "write -P 0x3c 1M 512k"])
            .arg(format!("nbd://127.0.0.1:{pa}/alpha"))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
    }
    let stopped = json(&run(&["stop", "--json", "alpha"], &rpc));
    assert_eq!(
        stopped,
        serde_json::json!({"array": "alpha", "clean": true})
    );
    let listed = json(&run(&["list", "--json"], &rpc));
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed[0]["array"]["name"], "beta");
    // Its devices are free again: another process could read them; here it is started
    // again, in another order, on another port.
    let pa2 = free_port();
    let nbd_a2 = format!("127.0.0.1:{pa2}");
    let mut start_a = vec!["start", "--json", "--nbd", &nbd_a2];
    start_a.extend(a_paths.iter().rev().map(String::as_str));
    let st = json(&run(&start_a, &rpc));
    assert_eq!(st["array"]["name"], "alpha", "{st}");
    assert_eq!(st["array"]["state"], "active", "{st}");
    if let Some(q) = &qemu_io {
        let o = std::process::Command::new(q)
            .args(["-f", "raw", "-c", "read -P 0x3c 1M 512k"])
            .arg(format!("nbd://127.0.0.1:{pa2}/alpha"))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        assert!(
            !String::from_utf8_lossy(&o.stdout).contains("Pattern verification failed"),
            "{}",
            text(&o)
        );
    }
    srv.stop();
    // Both arrays were stopped clean with the process.
    let log = srv.logs();
    for name in ["alpha", "beta"] {
        assert!(
            log.lines().any(|l| l.contains("array stopped")
                && l.contains(&format!("array={name}"))
                && l.contains("clean=true")),
            "{name} not stopped clean: {log}"
        );
    }
}

/// SIGHUP re-reads the config (issue 21): a table added since the start is assembled and
/// served; a table removed leaves its array running (logged, never stopped silently); a
/// changed setting is logged by its key, and a running array's moved exports with both
/// places; a config that no longer parses changes nothing.
#[test]
fn sighup_starts_new_tables_and_never_stops_an_array() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let a = member_files(d, "a", 4, 24 << 20);
    let b = member_files(d, "b", 4, 24 << 20);
    let arr_a = ferroraid_tests::target::create(d, 5, "left-symmetric", "alpha", &a);
    let arr_b = ferroraid_tests::target::create(d, 6, "left-symmetric", "beta", &b);
    let (pa, pb) = (free_port(), free_port());
    let rpc = d.join("node.sock");
    let cfg = d.join("node.toml");
    let head = format!(
        "mode = \"adaptive\"\nrpc = {:?}\n",
        rpc.display().to_string()
    );
    let table = |name: &str, prefix: &str, port: u16| {
        format!(
            "[[array]]\nname = {name:?}\nscan = [{:?}]\nnbd = [\"127.0.0.1:{port}\"]\n",
            format!("{}/{prefix}*.img", d.display())
        )
    };
    std::fs::write(&cfg, format!("{head}{}", table("alpha", "a", pa))).unwrap();
    let args: Vec<OsString> = vec!["serve".into(), "--config".into(), cfg.clone().into()];
    let mut srv = Server::spawn(d, "hup", &args, &arr_a.name, pa, Some(rpc.clone()));
    let names = |rpc: &Path| -> Vec<String> {
        json(&run(&["list", "--json"], rpc))
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["array"]["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(names(&rpc), ["alpha"]);
    let wait_names = |want: &[&str]| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let got = names(&rpc);
            if got == want {
                return;
            }
            assert!(Instant::now() < deadline, "wanted {want:?}, have {got:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // A second table: started by the reload.
    std::fs::write(
        &cfg,
        format!(
            "{head}{}{}",
            table("alpha", "a", pa),
            table("beta", "b", pb)
        ),
    )
    .unwrap();
    srv.signal(libc::SIGHUP);
    wait_names(&["alpha", "beta"]);
    if let Some(nbdinfo) = tool("nbdinfo") {
        let info = srv.client_ok(
            std::process::Command::new(&nbdinfo)
                .arg(format!("nbd://127.0.0.1:{pb}/{}", arr_b.name)),
            d,
        );
        assert!(
            info.contains(&format!("export-size: {}", arr_b.size)),
            "{info}"
        );
    }
    // alpha's table gone: alpha keeps running, and the log says so. A setting changed
    // beside it is named, with what it applies to; beta's table moved to another port:
    // beta is still exported where it was, and the log says both.
    let pb2 = free_port();
    std::fs::write(
        &cfg,
        format!("{head}queue_depth = 64\n{}", table("beta", "b", pb2)),
    )
    .unwrap();
    srv.signal(libc::SIGHUP);
    srv.wait_log("no longer in the configuration");
    srv.wait_log(
        "applied to arrays started from now on; running arrays keep their settings until \
         stopped and started again: queue_depth",
    );
    srv.wait_log(&format!(
        "the configuration exports the array at nbd 127.0.0.1:{pb2}; it is exported at \
         nbd 127.0.0.1:{pb} and stays so"
    ));
    assert_eq!(names(&rpc), ["alpha", "beta"]);
    // A config that does not parse: nothing changes, the process serves on.
    std::fs::write(&cfg, "this is = = not toml").unwrap();
    srv.signal(libc::SIGHUP);
    srv.wait_log("the configuration is not usable, nothing changed");
    assert_eq!(names(&rpc), ["alpha", "beta"]);
    // A table whose scan finds nothing fails alone: the settings beside it still apply.
    // A table that leaves out a running member (one replaced since it was written, say)
    // is named with the member it leaves out.
    let canon = |p: &Path| std::fs::canonicalize(p).unwrap().display().to_string();
    std::fs::write(
        &cfg,
        format!(
            "{head}queue_depth = 64\nwrite_hold_us = 100\n{}[[array]]\nname = \"gone\"\nscan = [{:?}]\n\
             [[array]]\nname = \"alpha\"\ndevices = [{:?}, {:?}, {:?}]\n",
            table("beta", "b", pb2),
            format!("{}/absent*.img", d.display()),
            canon(&a[0]),
            canon(&a[1]),
            canon(&a[2]),
        ),
    )
    .unwrap();
    srv.signal(libc::SIGHUP);
    srv.wait_log("reload: cannot start an array: [[array]] name \"gone\": no such array");
    srv.wait_log("until stopped and started again: write_hold_us");
    let log = srv.wait_log(&format!(
        "the configuration does not name the running member(s) {}",
        canon(&a[3])
    ));
    assert_eq!(names(&rpc), ["alpha", "beta"]);
    // A running array's own table that does not resolve (an export address that does
    // not parse) is named as its table, not as an array the configuration left.
    let gone = |log: &str| log.matches("no longer in the configuration").count();
    let before = gone(&log);
    std::fs::write(
        &cfg,
        format!(
            "{head}queue_depth = 64\nwrite_hold_us = 100\n{}[[array]]\nname = \"alpha\"\n\
             devices = [{:?}]\nnbd = [\"localhost:1\"]\n",
            table("beta", "b", pb2),
            canon(&a[0]),
        ),
    )
    .unwrap();
    srv.signal(libc::SIGHUP);
    let log = srv.wait_log(
        "reload: the array's table is not usable; the array keeps running as it is: \
         [[array]] name \"alpha\": nbd \"localhost:1\"",
    );
    assert_eq!(gone(&log), before, "{log}");
    srv.stop();
}
