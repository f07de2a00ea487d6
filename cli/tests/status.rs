//! `ferroraid status|fail|remove|add` against a management socket served in this test
//! process by `ferroraid::rpc::RpcServer` with a mock handler.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

use ferroraid::rpc::{Handler, RpcError, RpcServer};
use ferroraid::status::{
    ArrayInfo, ArrayState, MemberReport, MemberState, ProcessKind, ProcessReport, ReactorMode,
    ReactorsReport, StatsReport, StatusReport,
};

fn ferroraid(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferroraid"))
        .args(args)
        .output()
        .expect("run ferroraid")
}

/// A RAID5 of four members `/dev/m0`..`/dev/m3` whose report the test sets.
struct Mock(Mutex<StatusReport>);

impl Mock {
    fn new() -> Arc<Mock> {
        Arc::new(Mock(Mutex::new(StatusReport {
            array: ArrayInfo {
                name: "host:status".into(),
                array_uuid: "01234567:89abcdef:01234567:89abcdef".into(),
                level: 5,
                layout: "left-symmetric".into(),
                chunk_bytes: 65536,
                raid_devices: 4,
                size_bytes: 3 << 30,
                state: ArrayState::Clean,
                events: 4,
                consistency_policy: "bitmap".to_string(),
            },
            members: (0..4u16)
                .map(|s| {
                    MemberReport::idle(Some(s), Some(format!("/dev/m{s}")), MemberState::Active)
                })
                .collect(),
            reactors: ReactorsReport {
                count: 2,
                cores: vec![Some(0), Some(1)],
                mode: ReactorMode::Polled,
                load: vec![],
            },
            stats: StatsReport::default(),
            requests_in_flight: 3,
            writes_awaiting_record: 0,
            exports: vec![],
            process: ProcessReport::idle(),
            bitmap: None,
            queue_wait_us: ferroraid::status::QueueWaitReport::default(),
            nbd: None,
            nvmf: None,
        })))
    }

    fn set(&self, f: impl FnOnce(&mut StatusReport)) {
        f(&mut self.0.lock().unwrap());
    }

    fn refresh(r: &mut StatusReport) {
        let working = r
            .members
            .iter()
            .filter(|m| m.slot.is_some() && m.state == MemberState::Active)
            .count() as u16;
        r.array.state = ArrayState::derive(4, 1, working, true);
    }
}

impl Handler for Mock {
    fn status(&self) -> StatusReport {
        let mut r = self.0.lock().unwrap();
        let now = r.clone();
        // A running check advances a quarter per look and finds 16 sectors mismatched.
        let p = &mut r.process;
        if p.kind == ProcessKind::Check {
            p.position_bytes += p.size_bytes / 4;
            if p.position_bytes >= p.size_bytes {
                *p = ProcessReport {
                    mismatch_cnt: 16,
                    ..ProcessReport::idle()
                };
            }
        }
        now
    }

    fn member_fail(&self, dev: &str) -> Result<MemberReport, RpcError> {
        let mut r = self.0.lock().unwrap();
        let i = r
            .members
            .iter()
            .position(|m| Some(m) == r.find_member(dev))
            .ok_or_else(|| RpcError::no_such_member(dev))?;
        if r.array.state != ArrayState::Clean {
            return Err(RpcError::array_would_fail(dev, "RAID5 already degraded"));
        }
        r.members[i].state = MemberState::Faulty;
        Self::refresh(&mut r);
        Ok(r.members[i].clone())
    }

    fn member_remove(&self, dev: &str) -> Result<MemberReport, RpcError> {
        let mut r = self.0.lock().unwrap();
        let i = r
            .members
            .iter()
            .position(|m| Some(m) == r.find_member(dev))
            .ok_or_else(|| RpcError::no_such_member(dev))?;
        if r.members[i].state == MemberState::Active {
            return Err(RpcError::member_not_faulty(dev));
        }
        r.members[i].state = MemberState::Removed;
        r.members[i].device = None;
        Ok(r.members[i].clone())
    }

    fn member_add(&self, dev: &str) -> Result<MemberReport, RpcError> {
        let mut r = self.0.lock().unwrap();
        let m = MemberReport::idle(None, Some(dev.into()), MemberState::Spare);
        r.members.push(m.clone());
        Ok(m)
    }

    fn process_start(&self, kind: ProcessKind) -> Result<ProcessReport, RpcError> {
        let mut r = self.0.lock().unwrap();
        if r.array.state != ArrayState::Clean {
            return Err(RpcError::process_refused("the array is degraded"));
        }
        if kind == ProcessKind::Repair {
            // A repair that finds nothing: done at once.
            r.process = ProcessReport::idle();
            return Ok(r.process.clone());
        }
        r.process = ProcessReport {
            kind,
            size_bytes: r.array.size_bytes,
            ..ProcessReport::idle()
        };
        Ok(r.process.clone())
    }

    fn process_stop(&self) -> Result<ProcessReport, RpcError> {
        let mut r = self.0.lock().unwrap();
        r.process = ProcessReport::idle();
        Ok(r.process.clone())
    }
}

#[test]
fn check_follows_progress_and_exits_3_on_mismatches() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("ferroraid.sock");
    let mock = Mock::new();
    let _server = RpcServer::bind(&sock, mock.clone()).unwrap();
    let s = sock.to_str().unwrap();
    let out = ferroraid(&["check", "--rpc", s]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(3), "{text}");
    assert!(text.contains("check of array"), "{text}");
    assert!(
        text.contains("% done"),
        "progress lines off a terminal: {text}"
    );
    assert!(text.contains("mismatch_cnt 16"), "{text}");
    // A repair that finds nothing exits 0.
    let out = ferroraid(&["repair", "--rpc", s]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    // --no-wait returns at once; stop-process says what it stopped.
    let out = ferroraid(&["check", "--no-wait", "--rpc", s]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = ferroraid(&["stop-process", "--rpc", s]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("check stopped"), "{text}");
    let out = ferroraid(&["stop-process", "--rpc", s]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("nothing was running"));
    // Refusals name the reason and exit 1.
    mock.set(|r| r.array.state = ArrayState::Degraded);
    let out = ferroraid(&["check", "--rpc", s]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("degraded"),
        "{out:?}"
    );
    // No target: exit 4.
    let out = ferroraid(&["check", "--rpc", dir.path().join("none").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(4), "{out:?}");
}

fn status(sock: &Path, json: bool) -> Output {
    let mut args = vec!["status", "--rpc", sock.to_str().unwrap()];
    if json {
        args.push("--json");
    }
    ferroraid(&args)
}

#[test]
fn exit_codes_follow_the_array_state() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("ferroraid.sock");
    let mock = Mock::new();
    let _server = RpcServer::bind(&sock, mock.clone()).unwrap();

    let out = status(&sock, false);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("host:status:\n"), "{text}");
    assert!(text.contains("          State : clean\n"), "{text}");
    assert!(
        text.contains("       Reactors : 2 polled (cores 0,1)\n"),
        "{text}"
    );
    assert!(text.contains("/dev/m3"), "{text}");

    for (state, process, code) in [
        (ArrayState::Active, ProcessKind::Resync, 0),
        (ArrayState::Degraded, ProcessKind::Idle, 1),
        (ArrayState::Clean, ProcessKind::Rebuild, 1),
        (ArrayState::Failed, ProcessKind::Idle, 2),
    ] {
        mock.set(|r| {
            r.array.state = state;
            r.process.kind = process;
        });
        for json in [false, true] {
            let out = status(&sock, json);
            assert_eq!(out.status.code(), Some(code), "{state:?} {process:?}");
            assert!(
                out.stderr.is_empty(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            if json {
                let r: StatusReport = serde_json::from_slice(&out.stdout).unwrap();
                assert_eq!(r, mock.status());
            } else {
                let text = String::from_utf8_lossy(&out.stdout);
                assert!(text.contains(&format!("State : {state}")), "{text}");
            }
        }
    }
}

#[test]
fn no_target_is_exit_4_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("ferroraid.sock");
    let check = |out: &Output| {
        assert_eq!(out.status.code(), Some(4));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains(&format!(
                "no ferroraid target is running at {}",
                sock.display()
            )),
            "{err}"
        );
        assert!(out.stdout.is_empty());
    };
    check(&status(&sock, false));
    check(&status(&sock, true));
    // A stale socket (the target died) reads the same.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    check(&status(&sock, false));
    check(&ferroraid(&["fail", "1", "--rpc", sock.to_str().unwrap()]));
}

#[test]
fn fail_remove_add() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("ferroraid.sock");
    let s = sock.to_str().unwrap();
    let mock = Mock::new();
    let _server = RpcServer::bind(&sock, mock.clone()).unwrap();

    let run = |args: &[&str]| {
        let mut a = args.to_vec();
        a.extend(["--rpc", s]);
        let out = ferroraid(&a);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = run(&["remove", "/dev/m1"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains(
            "ferroraid: error: remove /dev/m1: member /dev/m1 is not faulty (fail it first"
        ),
        "{err}"
    );
    assert!(out.is_empty());

    let (code, out, err) = run(&["fail", "/dev/m1"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        out,
        "ferroraid: set /dev/m1 faulty (slot 1); array host:status is now degraded\n"
    );
    let (code, _, err) = run(&["fail", "2"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("fail 2: array would fail"), "{err}");
    let (code, _, err) = run(&["fail", "/dev/nope"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no such member: /dev/nope"), "{err}");

    let (code, out, err) = run(&["remove", "1"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        out,
        "ferroraid: removed 1 from slot 1 (now removed); array host:status is now degraded\n"
    );
    let (code, out, err) = run(&["add", "/dev/new"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        out,
        "ferroraid: added /dev/new as a spare; array host:status is now degraded\n"
    );
    assert_eq!(mock.status().members.len(), 5);
    assert_eq!(mock.status().exit_code(), 1);
    // A target without `member_replace` refuses it clearly (exit 1).
    let (code, out, err) = run(&["replace", "/dev/m0", "/dev/other"]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        err.contains("replace /dev/m0 with /dev/other: not supported: member_replace"),
        "{err}"
    );
}
