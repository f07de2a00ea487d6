//! The JSON-RPC server and client, with a mock [`Handler`].

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::*;
use crate::status::{
    ArrayInfo, ArrayState, MemberState, ProcessKind, ProcessReport, ReactorMode, ReactorsReport,
    StatsReport,
};

/// A RAID6 of six members `/dev/m0`..`/dev/m5` whose management requests change a
/// status report. `/dev/panic` makes a handler panic; `/dev/bad` cannot be added.
pub(crate) struct Mock {
    report: Mutex<StatusReport>,
}

impl Mock {
    /// The live exports (the report's list).
    fn exports(&self) -> Vec<ExportReport> {
        self.lock().exports.clone()
    }
}

impl Mock {
    pub(crate) fn new() -> Arc<Mock> {
        let members = (0..6u16)
            .map(|s| MemberReport::idle(Some(s), Some(format!("/dev/m{s}")), MemberState::Active))
            .collect();
        Arc::new(Mock {
            report: Mutex::new(StatusReport {
                array: ArrayInfo {
                    name: "host:data".into(),
                    array_uuid: "e6c2614f:6ebd4c6b:5055bf86:866fae7b".into(),
                    level: 6,
                    layout: "left-symmetric".into(),
                    chunk_bytes: 65536,
                    raid_devices: 6,
                    size_bytes: 1 << 30,
                    state: ArrayState::Clean,
                    events: 1,
                    consistency_policy: "resync".to_string(),
                },
                members,
                reactors: ReactorsReport {
                    count: 1,
                    cores: vec![None],
                    mode: ReactorMode::Adaptive,
                    load: vec![],
                },
                stats: StatsReport::default(),
                requests_in_flight: 0,
                writes_awaiting_record: 0,
                exports: vec![],
                process: ProcessReport::idle(),
                bitmap: None,
                queue_wait_us: crate::status::QueueWaitReport::default(),
                nbd: None,
                nvmf: None,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StatusReport> {
        self.report.lock().unwrap()
    }

    fn index(r: &StatusReport, dev: &str) -> Result<usize, RpcError> {
        if dev == "/dev/panic" {
            panic!("mock handler told to panic");
        }
        let m = r
            .find_member(dev)
            .ok_or_else(|| RpcError::no_such_member(dev))?;
        Ok(r.members.iter().position(|x| x == m).unwrap())
    }

    fn refresh(r: &mut StatusReport) {
        let working = r
            .members
            .iter()
            .filter(|m| m.slot.is_some() && m.state == MemberState::Active)
            .count() as u16;
        r.array.state = ArrayState::derive(r.array.raid_devices, 2, working, true);
        r.array.events += 1;
    }
}

impl Handler for Mock {
    fn export_add(&self, spec: &ExportSpec) -> Result<Vec<ExportReport>, RpcError> {
        // The dispatcher checked the spec: a bad one reaching here is a bug (the panic
        // becomes an internal error, which the garbage test refuses).
        assert!(spec.validate().is_ok(), "unchecked spec {spec:?}");
        let mut r = self.lock();
        if r.exports.iter().any(|e| e.protocol == spec.protocol) {
            return Err(RpcError::export(&ExportError::Exists(spec.protocol)));
        }
        let name = spec.name.clone().unwrap_or_else(|| r.array.name.clone());
        let added: Vec<ExportReport> = spec
            .tcp
            .iter()
            .map(ToString::to_string)
            .chain(spec.unix.iter().map(|p| p.display().to_string()))
            .map(|address| ExportReport {
                protocol: spec.protocol,
                address,
                name: name.clone(),
            })
            .collect();
        r.exports.extend(added.iter().cloned());
        Ok(added)
    }

    fn export_remove(&self, protocol: ExportProtocol) -> Result<ExportRemoveReport, RpcError> {
        let mut r = self.lock();
        let (gone, kept) = r.exports.drain(..).partition(|e| e.protocol == protocol);
        r.exports = kept;
        let gone: Vec<ExportReport> = gone;
        if gone.is_empty() {
            return Err(RpcError::export(&ExportError::NotExported(protocol)));
        }
        Ok(ExportRemoveReport {
            protocol,
            exports: gone,
            drained: true,
        })
    }

    fn status(&self) -> StatusReport {
        self.lock().clone()
    }

    fn member_fail(&self, dev: &str) -> Result<MemberReport, RpcError> {
        let mut r = self.lock();
        let i = Self::index(&r, dev)?;
        if r.members[i].state == MemberState::Active {
            let working = r
                .members
                .iter()
                .filter(|m| m.state == MemberState::Active)
                .count();
            if working <= 4 {
                return Err(RpcError::array_would_fail(
                    dev,
                    format!("{working} of 6 members active, 4 needed"),
                ));
            }
            r.members[i].state = MemberState::Faulty;
            Self::refresh(&mut r);
        }
        Ok(r.members[i].clone())
    }

    fn member_remove(&self, dev: &str) -> Result<MemberReport, RpcError> {
        let mut r = self.lock();
        let i = Self::index(&r, dev)?;
        if r.members[i].state == MemberState::Active {
            return Err(RpcError::member_not_faulty(dev));
        }
        r.members[i].state = MemberState::Removed;
        r.members[i].device = None;
        Self::refresh(&mut r);
        Ok(r.members[i].clone())
    }

    fn member_add(&self, dev: &str) -> Result<MemberReport, RpcError> {
        let mut r = self.lock();
        if dev == "/dev/bad" {
            return Err(RpcError::device_unusable(dev, "too small"));
        }
        if r.find_member(dev).is_some() {
            return Err(RpcError::device_in_use(dev));
        }
        let m = MemberReport::idle(None, Some(dev.to_string()), MemberState::Spare);
        r.members.push(m.clone());
        Ok(m)
    }

    fn process_start(&self, kind: ProcessKind) -> Result<ProcessReport, RpcError> {
        let mut r = self.lock();
        if r.process.kind != ProcessKind::Idle {
            return Err(RpcError::process_refused(format!(
                "a {} is running",
                r.process.kind
            )));
        }
        r.process = ProcessReport {
            kind,
            size_bytes: r.array.size_bytes,
            ..ProcessReport::idle()
        };
        Ok(r.process.clone())
    }

    fn process_stop(&self) -> Result<ProcessReport, RpcError> {
        let mut r = self.lock();
        r.process = ProcessReport::idle();
        Ok(r.process.clone())
    }
}

fn req(h: &dyn Handler, line: &str) -> Value {
    handle_request(h, line.as_bytes()).expect("an answer")
}

fn err_code(v: &Value) -> i64 {
    v["error"]["code"]
        .as_i64()
        .unwrap_or_else(|| panic!("not an error: {v}"))
}

fn err_msg(v: &Value) -> &str {
    v["error"]["message"].as_str().unwrap()
}

#[test]
fn methods_and_results() {
    let m = Mock::new();
    let v = req(&*m, r#"{"jsonrpc":"2.0","method":"rpc_methods","id":1}"#);
    assert_eq!(v["result"], json!(METHODS));
    assert_eq!(v["id"], 1);
    assert_eq!(v["jsonrpc"], "2.0");
    let mut sorted = METHODS;
    sorted.sort_unstable();
    assert_eq!(sorted, METHODS);

    let v = req(&*m, r#"{"jsonrpc":"2.0","method":"array_status","id":"a"}"#);
    assert_eq!(v["id"], "a");
    let r: StatusReport = serde_json::from_value(v["result"].clone()).unwrap();
    assert_eq!(r.array.state, ArrayState::Clean);
    // Empty params are no params.
    for p in ["{}", "[]"] {
        let v = req(
            &*m,
            &format!(r#"{{"jsonrpc":"2.0","method":"array_status","params":{p},"id":null}}"#),
        );
        assert!(v["result"].is_object(), "{v}");
        assert_eq!(v["id"], Value::Null);
    }

    let v = req(
        &*m,
        r#"{"jsonrpc":"2.0","method":"member_fail","params":{"device":"/dev/m2"},"id":2}"#,
    );
    assert_eq!(v["result"]["state"], "faulty", "{v}");
    assert_eq!(v["result"]["slot"], 2);
    // By slot, as a string, a number, or positionally.
    for p in [r#"{"device":"3"}"#, r#"{"device":3}"#, r#"["3"]"#, "[3]"] {
        let v = req(
            &*m,
            &format!(r#"{{"jsonrpc":"2.0","method":"member_fail","params":{p},"id":3}}"#),
        );
        assert_eq!(v["result"]["slot"], 3, "{p}: {v}");
        assert_eq!(v["result"]["state"], "faulty", "{p}: {v}");
    }
    assert_eq!(m.status().array.state, ArrayState::Degraded);
    let v = req(
        &*m,
        r#"{"jsonrpc":"2.0","method":"member_remove","params":{"device":"/dev/m2"},"id":4}"#,
    );
    assert_eq!(v["result"]["state"], "removed", "{v}");
    let v = req(
        &*m,
        r#"{"jsonrpc":"2.0","method":"member_add","params":{"device":"/dev/new"},"id":5}"#,
    );
    assert_eq!(v["result"]["state"], "spare", "{v}");
    assert_eq!(v["result"]["slot"], Value::Null, "{v}");
}

#[test]
fn application_errors_name_the_device() {
    let m = Mock::new();
    let call = |method: &str, dev: &str| {
        req(
            &*m,
            &json!({"jsonrpc":"2.0","method":method,"params":{"device":dev},"id":7}).to_string(),
        )
    };
    let v = call("member_fail", "/dev/nope");
    assert_eq!(err_code(&v), codes::NO_SUCH_MEMBER);
    assert!(err_msg(&v).contains("no such member: /dev/nope"), "{v}");
    assert_eq!(v["error"]["data"]["device"], "/dev/nope");
    assert_eq!(v["id"], 7);
    let v = call("member_remove", "/dev/m1");
    assert_eq!(err_code(&v), codes::MEMBER_NOT_FAULTY);
    assert!(
        err_msg(&v).contains("member /dev/m1 is not faulty (fail it first"),
        "{v}"
    );
    assert!(call("member_fail", "/dev/m0")["result"].is_object());
    assert!(call("member_fail", "/dev/m1")["result"].is_object());
    let v = call("member_fail", "/dev/m2");
    assert_eq!(err_code(&v), codes::ARRAY_WOULD_FAIL);
    assert!(err_msg(&v).contains("array would fail"), "{v}");
    assert!(err_msg(&v).contains("/dev/m2"), "{v}");
    let v = call("member_add", "/dev/m3");
    assert_eq!(err_code(&v), codes::DEVICE_IN_USE);
    assert!(err_msg(&v).contains("/dev/m3"), "{v}");
    let v = call("member_add", "/dev/bad");
    assert_eq!(err_code(&v), codes::DEVICE_UNUSABLE);
    assert!(
        err_msg(&v).contains("cannot use /dev/bad: too small"),
        "{v}"
    );
}

#[test]
fn protocol_errors() {
    let m = Mock::new();
    let cases: &[(&str, i64, &str)] = &[
        ("{", codes::PARSE_ERROR, "parse error"),
        ("not json", codes::PARSE_ERROR, "parse error"),
        (
            r#"{"jsonrpc":"2.0","method":"x","id":1"#,
            codes::PARSE_ERROR,
            "parse error",
        ),
        ("42", codes::INVALID_REQUEST, "must be a JSON object"),
        ("null", codes::INVALID_REQUEST, "must be a JSON object"),
        ("[]", codes::INVALID_REQUEST, "empty batch"),
        (
            r#"{"method":"rpc_methods","id":1}"#,
            codes::INVALID_REQUEST,
            "\"jsonrpc\" must be \"2.0\"",
        ),
        (
            r#"{"jsonrpc":"1.0","method":"rpc_methods","id":1}"#,
            codes::INVALID_REQUEST,
            "\"2.0\"",
        ),
        (
            r#"{"jsonrpc":2.0,"method":"rpc_methods","id":1}"#,
            codes::INVALID_REQUEST,
            "\"2.0\"",
        ),
        (
            r#"{"jsonrpc":"2.0","id":1}"#,
            codes::INVALID_REQUEST,
            "missing \"method\"",
        ),
        (
            r#"{"jsonrpc":"2.0","method":1,"id":1}"#,
            codes::INVALID_REQUEST,
            "must be a string",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"rpc_methods","params":"x","id":1}"#,
            codes::INVALID_REQUEST,
            "object or an array",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"rpc_methods","id":{"a":1}}"#,
            codes::INVALID_REQUEST,
            "\"id\" must be",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"rpc_methods","id":[1]}"#,
            codes::INVALID_REQUEST,
            "\"id\" must be",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"rpc_methods","param":{},"id":1}"#,
            codes::INVALID_REQUEST,
            "unknown member \"param\"",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"status","id":1}"#,
            codes::METHOD_NOT_FOUND,
            "method not found: \"status\" (methods: array_create, ",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"","id":1}"#,
            codes::METHOD_NOT_FOUND,
            "method not found: \"\"",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_status","params":{"x":1},"id":1}"#,
            codes::INVALID_PARAMS,
            "array_status takes no parameters",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_status","params":[1],"id":1}"#,
            codes::INVALID_PARAMS,
            "takes no parameters",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"member_fail","id":1}"#,
            codes::INVALID_PARAMS,
            "missing device",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"member_fail","params":{},"id":1}"#,
            codes::INVALID_PARAMS,
            "missing device",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"member_fail","params":[],"id":1}"#,
            codes::INVALID_PARAMS,
            "missing device",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"member_fail","params":["a","b"],"id":1}"#,
            codes::INVALID_PARAMS,
            "missing device",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"member_fail","params":{"device":"/dev/m1","force":true},"id":1}"#,
            codes::INVALID_PARAMS,
            "unknown parameter \"force\"",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"member_fail","params":{"dev":"/dev/m1"},"id":1}"#,
            codes::INVALID_PARAMS,
            "unknown parameter \"dev\"",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"member_fail","params":{"device":""},"id":1}"#,
            codes::INVALID_PARAMS,
            "device is empty",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"member_fail","params":{"device":true},"id":1}"#,
            codes::INVALID_PARAMS,
            "string or a slot number",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"member_fail","params":{"device":null},"id":1}"#,
            codes::INVALID_PARAMS,
            "string or a slot number",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"member_fail","params":{"device":-1},"id":1}"#,
            codes::INVALID_PARAMS,
            "not a slot number",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"member_fail","params":{"device":1.5},"id":1}"#,
            codes::INVALID_PARAMS,
            "not a slot number",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"member_fail","params":{"device":70000},"id":1}"#,
            codes::INVALID_PARAMS,
            "not a slot number",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"member_fail","params":{"device":"a\u0000b"},"id":1}"#,
            codes::INVALID_PARAMS,
            "contains NUL",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"nvmf_portal_list","params":{"x":1},"id":1}"#,
            codes::INVALID_PARAMS,
            "nvmf_portal_list takes no parameters",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"nvmf_portal_set_ana","id":1}"#,
            codes::INVALID_PARAMS,
            "missing portal",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"nvmf_portal_set_ana","params":{"portal":"127.0.0.1:4420"},"id":1}"#,
            codes::INVALID_PARAMS,
            "missing ana_state",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"nvmf_portal_set_ana","params":["127.0.0.1:4420",null],"id":1}"#,
            codes::INVALID_PARAMS,
            "missing ana_state",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"nvmf_portal_set_ana","params":{"portal":"127.0.0.1:4420","ana_state":"bogus"},"id":1}"#,
            codes::INVALID_PARAMS,
            "unknown ANA state \"bogus\"",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"nvmf_portal_set_ana","params":{"portal":5,"ana_state":"optimized"},"id":1}"#,
            codes::INVALID_PARAMS,
            "portal must be an address string",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"nvmf_portal_set_ana","params":{"portal":" ","ana_state":"optimized"},"id":1}"#,
            codes::INVALID_PARAMS,
            "portal must be an address string",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"nvmf_portal_remove","params":{"portal":"127.0.0.1:4420","ana_state":"optimized"},"id":1}"#,
            codes::INVALID_PARAMS,
            "unknown parameter \"ana_state\": nvmf_portal_remove takes {\"portal\": \"IP:PORT\"}",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"nvmf_portal_remove","params":["127.0.0.1:4420","optimized"],"id":1}"#,
            codes::INVALID_PARAMS,
            "nvmf_portal_remove takes",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"nvmf_portal_add","params":["127.0.0.1:4420","optimized","x"],"id":1}"#,
            codes::INVALID_PARAMS,
            "nvmf_portal_add takes",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"nvmf_portal_add","params":"127.0.0.1:4420","id":1}"#,
            codes::INVALID_REQUEST,
            "\"params\" must be an object or an array",
        ),
    ];
    for &(line, code, want) in cases {
        let v = req(&*m, line);
        assert_eq!(err_code(&v), code, "{line}: {v}");
        assert!(err_msg(&v).contains(want), "{line}: {v}");
        assert_eq!(v["jsonrpc"], "2.0", "{line}: {v}");
        // Requests with a valid id get it back; unreadable ones get null.
        let want_id = if code == codes::PARSE_ERROR || !line.contains(r#""id":1}"#) {
            Value::Null
        } else {
            json!(1)
        };
        assert_eq!(v["id"], want_id, "{line}: {v}");
    }
    // Not UTF-8; a huge method name is quoted shortened.
    let v = handle_request(
        &*m,
        b"{\"jsonrpc\":\"2.0\",\"method\":\"\xff\xfe\",\"id\":1}",
    )
    .unwrap();
    assert_eq!(err_code(&v), codes::PARSE_ERROR);
    let long = "x".repeat(10_000);
    let v = req(
        &*m,
        &json!({"jsonrpc":"2.0","method":long,"id":1}).to_string(),
    );
    assert_eq!(err_code(&v), codes::METHOD_NOT_FOUND);
    // The name quoted short; the message also lists the methods.
    assert!(err_msg(&v).len() < 200 + METHODS.join(", ").len(), "{v}");
    let long_dev = "/".repeat(MAX_DEVICE_BYTES + 1);
    let v = req(
        &*m,
        &json!({"jsonrpc":"2.0","method":"member_fail","params":[long_dev],"id":1}).to_string(),
    );
    assert_eq!(err_code(&v), codes::INVALID_PARAMS);
    // Deep nesting is a parse error (serde_json's recursion limit), not a stack overflow.
    let deep = format!(
        r#"{{"jsonrpc":"2.0","method":"rpc_methods","params":{}{},"id":1}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert_eq!(err_code(&req(&*m, &deep)), codes::PARSE_ERROR);
}

#[test]
fn notifications_and_batches() {
    let m = Mock::new();
    // A notification is carried out and not answered, even when it fails.
    assert!(handle_request(
        &*m,
        br#"{"jsonrpc":"2.0","method":"member_fail","params":{"device":"/dev/m5"}}"#
    )
    .is_none());
    assert_eq!(m.status().members[5].state, MemberState::Faulty);
    assert!(handle_request(&*m, br#"{"jsonrpc":"2.0","method":"nope"}"#).is_none());
    // An invalid request is answered even without an id.
    let v = req(&*m, r#"{"jsonrpc":"2.0","method":5}"#);
    assert_eq!(err_code(&v), codes::INVALID_REQUEST);

    let v = req(
        &*m,
        r#"[{"jsonrpc":"2.0","method":"rpc_methods","id":1},
            {"jsonrpc":"2.0","method":"rpc_methods"},
            {"jsonrpc":"2.0","method":"nope","id":2},
            7,
            {"jsonrpc":"2.0","method":"member_fail","params":["/dev/x"],"id":3}]"#,
    );
    let a = v.as_array().unwrap();
    assert_eq!(a.len(), 4, "{v}");
    assert_eq!(a[0]["result"], json!(METHODS));
    assert_eq!(err_code(&a[1]), codes::METHOD_NOT_FOUND);
    assert_eq!(a[1]["id"], 2);
    assert_eq!(err_code(&a[2]), codes::INVALID_REQUEST);
    assert_eq!(err_code(&a[3]), codes::NO_SUCH_MEMBER);
    // Only notifications: nothing at all.
    assert!(handle_request(&*m, br#"[{"jsonrpc":"2.0","method":"rpc_methods"}]"#).is_none());
    // Bounded batches.
    let big = format!(
        "[{}]",
        vec![r#"{"jsonrpc":"2.0","method":"rpc_methods","id":1}"#; MAX_BATCH + 1].join(",")
    );
    let v = req(&*m, &big);
    assert_eq!(err_code(&v), codes::INVALID_REQUEST);
    assert!(err_msg(&v).contains("at most 64"), "{v}");
}

#[test]
fn a_panicking_handler_is_an_internal_error() {
    let m = Mock::new();
    let v = req(
        &*m,
        r#"{"jsonrpc":"2.0","method":"member_fail","params":{"device":"/dev/panic"},"id":9}"#,
    );
    assert_eq!(err_code(&v), codes::INTERNAL_ERROR);
    assert!(
        err_msg(&v)
            .contains("member_fail failed: the handler panicked (mock handler told to panic)"),
        "{v}"
    );
    assert_eq!(v["id"], 9);
}

/// The `array` parameter: a single-array target answers for its own name (md's
/// `host:name` or the short name) and refuses another with NO_SUCH_ARRAY; a non-string
/// name is refused; the process methods of a multi-array node are not supported by a
/// single-array target, and their parameters are checked first.
#[test]
fn array_parameter_and_array_methods() {
    let m = Mock::new();
    for name in ["data", "host:data"] {
        let v = req(
            &*m,
            &format!(
                r#"{{"jsonrpc":"2.0","method":"array_status","params":{{"array":"{name}"}},"id":1}}"#
            ),
        );
        assert_eq!(v["result"]["array"]["name"], "host:data", "{v}");
    }
    let v = req(
        &*m,
        r#"{"jsonrpc":"2.0","method":"member_fail","params":{"device":"1","array":"other"},"id":1}"#,
    );
    assert_eq!(err_code(&v), codes::NO_SUCH_ARRAY, "{v}");
    assert!(
        err_msg(&v).contains("\"other\" (running: host:data)"),
        "{v}"
    );
    assert_eq!(v["error"]["data"]["array"], "other");
    // Nothing was failed by the refused request.
    assert!(m
        .status()
        .members
        .iter()
        .all(|x| x.state == MemberState::Active));
    let cases: &[(&str, i64, &str)] = &[
        (
            r#"{"jsonrpc":"2.0","method":"array_status","params":{"array":7},"id":1}"#,
            codes::INVALID_PARAMS,
            "\"array\" must be an array name",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_list","params":{"x":1},"id":1}"#,
            codes::INVALID_PARAMS,
            "array_list takes no parameters",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_start","params":["/dev/a"],"id":1}"#,
            codes::INVALID_PARAMS,
            "array_start takes named parameters",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_start","params":{"devices":[]},"id":1}"#,
            codes::INVALID_PARAMS,
            "devices is empty",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_start","params":{"devices":["/a"],"nbd":["nowhere"]},"id":1}"#,
            codes::INVALID_PARAMS,
            "array_start: invalid socket address",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_start","params":{"devices":["/a"],"colour":"red"},"id":1}"#,
            codes::INVALID_PARAMS,
            "unknown field `colour`",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_start","params":{"devices":["/a"]},"id":1}"#,
            codes::NOT_SUPPORTED,
            "not supported: array_start",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_stop","params":{},"id":1}"#,
            codes::INVALID_PARAMS,
            "array_stop takes {\"array\": NAME}",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_stop","params":{"array":"data","now":true},"id":1}"#,
            codes::INVALID_PARAMS,
            "unknown parameter \"now\"",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_stop","params":["data"],"id":1}"#,
            codes::NOT_SUPPORTED,
            "not supported: array_stop",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_create","params":{"name":"x","devices":["/a"]},"id":1}"#,
            codes::INVALID_PARAMS,
            "missing field `level`",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_create","params":{"name":"x","level":6,"devices":["/a"]},"id":1}"#,
            codes::NOT_SUPPORTED,
            "not supported: array_create",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_create_progress","params":{"array":"x"},"id":1}"#,
            codes::INVALID_PARAMS,
            "array_create_progress takes no parameters",
        ),
        (
            r#"{"jsonrpc":"2.0","method":"array_create_progress","id":1}"#,
            codes::NOT_SUPPORTED,
            "not supported: array_create_progress",
        ),
    ];
    for &(line, code, want) in cases {
        let v = req(&*m, line);
        assert_eq!(err_code(&v), code, "{line}: {v}");
        assert!(err_msg(&v).contains(want), "{line}: {v}");
    }
    let v = req(&*m, r#"{"jsonrpc":"2.0","method":"array_list","id":1}"#);
    assert_eq!(v["result"][0]["array"]["name"], "host:data", "{v}");
}

#[test]
fn never_panics_on_garbage() {
    let m = Mock::new();
    let valid: &[&[u8]] = &[
        br#"{"jsonrpc":"2.0","method":"member_fail","params":{"device":"/dev/m1"},"id":1}"#,
        br#"[{"jsonrpc":"2.0","method":"array_status","id":"x"},{"jsonrpc":"2.0","method":"member_add","params":["/dev/q"]}]"#,
        br#"{"jsonrpc":"2.0","method":"nvmf_portal_set_ana","params":{"portal":"127.0.0.2:4420","ana_state":"inaccessible"},"id":2}"#,
        br#"[{"jsonrpc":"2.0","method":"nvmf_portal_add","params":["127.0.0.2:4420","non_optimized"],"id":3},{"jsonrpc":"2.0","method":"nvmf_portal_remove","params":{"portal":"[::1]:4420"},"id":4}]"#,
        br#"{"jsonrpc":"2.0","method":"member_fail","params":{"device":"1","array":"data"},"id":5}"#,
        br#"{"jsonrpc":"2.0","method":"array_start","params":{"devices":["/dev/a","/dev/b"],"force":true,"nbd":["127.0.0.1:10809"]},"id":6}"#,
        br#"[{"jsonrpc":"2.0","method":"array_stop","params":{"array":"data"},"id":7},{"jsonrpc":"2.0","method":"array_list","id":8}]"#,
        br#"{"jsonrpc":"2.0","method":"array_create","params":{"name":"x","level":6,"devices":["/a","/b","/c","/d"],"chunk_bytes":65536},"id":9}"#,
        br#"{"jsonrpc":"2.0","method":"export_add","params":{"protocol":"nbd","listen":["127.0.0.1:10810","unix:/tmp/s"],"name":"x"},"id":5}"#,
        br#"[{"jsonrpc":"2.0","method":"export_add","params":["iscsi",["[::1]:3260"]],"id":6},{"jsonrpc":"2.0","method":"export_remove","params":{"protocol":"iscsi"},"id":7}]"#,
        br#"[{"jsonrpc":"2.0","method":"export_remove","params":["nbd"],"id":8},{"jsonrpc":"2.0","method":"export_list","id":9}]"#,
    ];
    feed_garbage(&*m, valid, 20_000, 0x9e37_79b9_7f4a_7c15);
}

/// Feeds `h` `rounds` requests: every fourth random bytes, the others `valid` in turn with
/// one to four byte mutations (replaced, removed, or a JSON punctuation inserted), from a
/// xorshift seeded with `seed` (deterministic). Every answer must be a JSON-RPC response
/// and none an internal error: no mutation gets past the parameter checks to a handler
/// unchecked.
pub(crate) fn feed_garbage(h: &dyn Handler, valid: &[&[u8]], rounds: usize, seed: u64) {
    let mut x = seed;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for i in 0..rounds {
        let mut b: Vec<u8> = if i % 4 == 0 {
            (0..next() % 200).map(|_| next() as u8).collect()
        } else {
            valid[i % valid.len()].to_vec()
        };
        for _ in 0..1 + next() % 4 {
            if b.is_empty() {
                break;
            }
            let at = (next() % b.len() as u64) as usize;
            match next() % 3 {
                0 => b[at] = next() as u8,
                1 => {
                    b.remove(at);
                }
                _ => b.insert(at, b"{}[]\",:0\\"[(next() % 9) as usize]),
            }
        }
        if let Some(v) = handle_request(h, &b) {
            assert!(v.is_object() || v.is_array(), "{v}");
            let answers = match &v {
                Value::Array(a) => a.clone(),
                one => vec![one.clone()],
            };
            for a in answers {
                assert_ne!(
                    a["error"]["code"],
                    json!(codes::INTERNAL_ERROR),
                    "{}: {a}",
                    String::from_utf8_lossy(&b)
                );
            }
        }
    }
}

#[test]
fn export_methods() {
    let m = Mock::new();
    let call = |line: &str| req(&*m, line);
    let v = call(r#"{"jsonrpc":"2.0","method":"export_list","id":1}"#);
    assert_eq!(v["result"], json!([]), "{v}");
    let v = call(
        r#"{"jsonrpc":"2.0","method":"export_add","params":{"protocol":"nbd","listen":["127.0.0.1:10810","unix:/run/x.sock"]},"id":1}"#,
    );
    assert_eq!(
        v["result"],
        json!([
            {"protocol":"nbd","address":"127.0.0.1:10810","name":"host:data"},
            {"protocol":"nbd","address":"/run/x.sock","name":"host:data"}
        ]),
        "{v}"
    );
    // Positional, with a name.
    let v = call(
        r#"{"jsonrpc":"2.0","method":"export_add","params":["nvmf",["127.0.0.1:4420"]],"id":1}"#,
    );
    assert_eq!(v["result"][0]["protocol"], "nvmf", "{v}");
    assert_eq!(m.exports().len(), 3);
    // One server per protocol.
    let v = call(
        r#"{"jsonrpc":"2.0","method":"export_add","params":{"protocol":"nbd","listen":["127.0.0.1:10811"]},"id":1}"#,
    );
    assert_eq!(err_code(&v), codes::EXPORT_EXISTS, "{v}");
    assert_eq!(err_msg(&v), "nbd is already exported (remove it first)");
    let v = call(r#"{"jsonrpc":"2.0","method":"export_list","params":[],"id":1}"#);
    assert_eq!(v["result"].as_array().map(Vec::len), Some(3), "{v}");
    let v =
        call(r#"{"jsonrpc":"2.0","method":"export_remove","params":{"protocol":"nbd"},"id":1}"#);
    assert_eq!(v["result"]["protocol"], "nbd", "{v}");
    assert_eq!(v["result"]["drained"], true, "{v}");
    assert_eq!(
        v["result"]["exports"].as_array().map(Vec::len),
        Some(2),
        "{v}"
    );
    let v = call(r#"{"jsonrpc":"2.0","method":"export_remove","params":["nbd"],"id":1}"#);
    assert_eq!(err_code(&v), codes::NOT_EXPORTED, "{v}");
    assert_eq!(err_msg(&v), "nbd is not exported");
    // Added again once removed.
    let v = call(
        r#"{"jsonrpc":"2.0","method":"export_add","params":{"protocol":"nbd","listen":["127.0.0.1:10810"],"name":"other"},"id":1}"#,
    );
    assert_eq!(v["result"][0]["name"], "other", "{v}");
    // A handler without exports refuses them as not supported.
    struct Bare;
    impl Handler for Bare {
        fn status(&self) -> StatusReport {
            Mock::new().status()
        }
        fn member_fail(&self, _: &str) -> Result<MemberReport, RpcError> {
            unreachable!()
        }
        fn member_remove(&self, _: &str) -> Result<MemberReport, RpcError> {
            unreachable!()
        }
        fn member_add(&self, _: &str) -> Result<MemberReport, RpcError> {
            unreachable!()
        }
        fn process_start(&self, _: ProcessKind) -> Result<ProcessReport, RpcError> {
            unreachable!()
        }
        fn process_stop(&self) -> Result<ProcessReport, RpcError> {
            unreachable!()
        }
    }
    let v = req(
        &Bare,
        r#"{"jsonrpc":"2.0","method":"export_remove","params":["iscsi"],"id":1}"#,
    );
    assert_eq!(err_code(&v), codes::NOT_SUPPORTED, "{v}");
    let v = req(&Bare, r#"{"jsonrpc":"2.0","method":"export_list","id":1}"#);
    assert_eq!(v["result"], json!([]), "{v}");
}

#[test]
fn export_params_errors() {
    let m = Mock::new();
    let add = |p: &str| format!(r#"{{"jsonrpc":"2.0","method":"export_add","params":{p},"id":1}}"#);
    let remove =
        |p: &str| format!(r#"{{"jsonrpc":"2.0","method":"export_remove","params":{p},"id":1}}"#);
    let cases: Vec<(String, &str)> = vec![
        (
            r#"{"jsonrpc":"2.0","method":"export_add","id":1}"#.into(),
            "missing protocol: export_add takes {\"protocol\"",
        ),
        (add(r#"{"listen":["127.0.0.1:1"]}"#), "missing protocol"),
        (add(r#"{"protocol":"nbd"}"#), "missing listen"),
        (add(r#"{"protocol":"nbd","listen":null}"#), "missing listen"),
        (add(r#"{"protocol":"nbd","listen":[]}"#), "listen is empty"),
        (
            add(r#"{"protocol":"nbd","listen":"127.0.0.1:1"}"#),
            "listen must be an array",
        ),
        (
            add(r#"{"protocol":"nbd","listen":[5]}"#),
            "listen must be an array",
        ),
        (
            add(r#"{"protocol":"fcoe","listen":["127.0.0.1:1"]}"#),
            "unknown protocol \"fcoe\"",
        ),
        (
            add(r#"{"protocol":7,"listen":["127.0.0.1:1"]}"#),
            "protocol must be a string",
        ),
        (
            add(r#"{"protocol":"NBD","listen":["127.0.0.1:1"]}"#),
            "unknown protocol \"NBD\"",
        ),
        (
            add(r#"{"protocol":"nbd","listen":["localhost:10809"]}"#),
            "listen \"localhost:10809\": expected IP:PORT (e.g. 127.0.0.1:10809) or unix:PATH",
        ),
        (
            add(r#"{"protocol":"nbd","listen":["unix:"]}"#),
            "unix: needs a socket path",
        ),
        (
            add(r#"{"protocol":"iscsi","listen":["unix:/x"]}"#),
            "iscsi listens on TCP only",
        ),
        (
            add(r#"{"protocol":"nvmf","listen":["127.0.0.1:4420"],"name":"x"}"#),
            "name applies to NBD only",
        ),
        (
            add(r#"{"protocol":"nbd","listen":["127.0.0.1:1"],"name":""}"#),
            "name must be 1 to 4096 bytes",
        ),
        (
            add(r#"{"protocol":"nbd","listen":["127.0.0.1:1"],"name":3}"#),
            "name must be a string",
        ),
        (
            add(r#"{"protocol":"nbd","listen":["127.0.0.1:1","127.0.0.1:1"]}"#),
            "listen address 127.0.0.1:1 given twice",
        ),
        (
            add(r#"["nbd",["127.0.0.1:1"],"x","y"]"#),
            "export_add takes",
        ),
        (remove("{}"), "missing protocol: export_remove takes"),
        (
            remove(r#"{"protocol":"nbd","listen":[]}"#),
            "unknown parameter \"listen\"",
        ),
        (remove(r#"["nbd","iscsi"]"#), "export_remove takes"),
        (remove("[]"), "export_remove takes"),
        (remove(r#"{"protocol":"tcp"}"#), "unknown protocol \"tcp\""),
        (remove(r#"{"protocol":null}"#), "missing protocol"),
        (
            r#"{"jsonrpc":"2.0","method":"export_list","params":{"protocol":"nbd"},"id":1}"#.into(),
            "export_list takes no parameters",
        ),
    ];
    for (line, want) in &cases {
        let v = req(&*m, line);
        assert_eq!(err_code(&v), codes::INVALID_PARAMS, "{line}: {v}");
        assert!(err_msg(&v).contains(want), "{line}: {v} (want {want:?})");
    }
    // A listen list over the limit.
    let many: Vec<String> = (0..65).map(|i| format!("127.0.0.1:{}", 1000 + i)).collect();
    let v = req(
        &*m,
        &json!({"jsonrpc":"2.0","method":"export_add","params":{"protocol":"nbd","listen":many},"id":1})
            .to_string(),
    );
    assert_eq!(err_code(&v), codes::INVALID_PARAMS, "{v}");
    assert!(err_msg(&v).contains("at most 64"), "{v}");
    // Nothing was exported by any of them.
    assert!(m.exports().is_empty());
}

#[test]
fn bounded_lines() {
    let mut r = std::io::BufReader::with_capacity(7, &b"abc\n\nlonger line\nend"[..]);
    let mut line = Vec::new();
    assert_eq!(
        read_bounded_line(&mut r, &mut line, 100).unwrap(),
        LineRead::Line
    );
    assert_eq!(line, b"abc");
    assert_eq!(
        read_bounded_line(&mut r, &mut line, 100).unwrap(),
        LineRead::Line
    );
    assert_eq!(line, b"");
    assert_eq!(
        read_bounded_line(&mut r, &mut line, 100).unwrap(),
        LineRead::Line
    );
    assert_eq!(line, b"longer line");
    assert_eq!(
        read_bounded_line(&mut r, &mut line, 100).unwrap(),
        LineRead::Line
    );
    assert_eq!(line, b"end");
    assert_eq!(
        read_bounded_line(&mut r, &mut line, 100).unwrap(),
        LineRead::Eof
    );
    // Exactly at the limit is fine; one more is too long.
    let mut r = &b"12345\n123456\n"[..];
    assert_eq!(
        read_bounded_line(&mut r, &mut line, 5).unwrap(),
        LineRead::Line
    );
    assert_eq!(
        read_bounded_line(&mut r, &mut line, 5).unwrap(),
        LineRead::TooLong
    );
    assert!(line.is_empty());
}

#[test]
fn default_path_rule() {
    assert_eq!(
        default_rpc_path_from(true, Some("/run/user/1000".into())),
        PathBuf::from("/run/ferroraid/ferroraid.sock")
    );
    assert_eq!(
        default_rpc_path_from(false, Some("/run/user/1000".into())),
        PathBuf::from("/run/user/1000/ferroraid.sock")
    );
    assert_eq!(
        default_rpc_path_from(false, Some("relative/dir".into())),
        PathBuf::from("./ferroraid.sock")
    );
    assert_eq!(
        default_rpc_path_from(false, Some("".into())),
        PathBuf::from("./ferroraid.sock")
    );
    assert_eq!(
        default_rpc_path_from(false, None),
        PathBuf::from("./ferroraid.sock")
    );
    // The real one follows the same rule.
    let p = default_rpc_path();
    assert!(p.ends_with(SOCKET_FILE_NAME), "{}", p.display());
}

// ---- over a real socket ----

fn sock_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

fn serve(path: &Path) -> (RpcServer, Arc<Mock>) {
    let m = Mock::new();
    let s = RpcServer::bind(path, m.clone()).expect("bind");
    (s, m)
}

/// Sends raw bytes and reads one answer line (or nothing, when the server closes).
fn raw(path: &Path, bytes: &[u8]) -> Option<Value> {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(bytes).unwrap();
    let mut r = std::io::BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    (!line.is_empty()).then(|| serde_json::from_str(&line).unwrap())
}

#[test]
fn client_and_server() {
    let dir = sock_dir();
    let path = dir.path().join("rpc.sock");
    let (mut server, _m) = serve(&path);
    assert_eq!(server.path(), path);
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o7777, 0o600, "socket mode {mode:o}");

    let mut c = RpcClient::connect(&path).unwrap();
    let r = c.status().unwrap();
    assert_eq!(r.array.level, 6);
    let m = c.member_fail("/dev/m1").unwrap();
    assert_eq!(m.state, MemberState::Faulty);
    assert_eq!(c.status().unwrap().array.state, ArrayState::Degraded);
    assert_eq!(c.status().unwrap().exit_code(), 1);
    let m = c.member_remove("1").unwrap();
    assert_eq!(m.state, MemberState::Removed);
    let m = c.member_add("/dev/new").unwrap();
    assert_eq!(m.state, MemberState::Spare);
    assert_eq!(c.call("rpc_methods", Value::Null).unwrap(), json!(METHODS));
    match c.member_remove("/dev/m2") {
        Err(ClientError::Rpc(e)) => {
            assert_eq!(e.code, codes::MEMBER_NOT_FAULTY);
            assert_eq!(
                e.to_string(),
                "member /dev/m2 is not faulty (fail it first: ferroraid fail /dev/m2)"
            );
        }
        other => panic!("{other:?}"),
    }
    match c.call("frobnicate", Value::Null) {
        Err(ClientError::Rpc(e)) => assert_eq!(e.code, codes::METHOD_NOT_FOUND),
        other => panic!("{other:?}"),
    }
    // Pipelined requests on one connection, blank lines ignored, answered in order.
    let v = raw(
        &path,
        b"\n  \r\n{\"jsonrpc\":\"2.0\",\"method\":\"rpc_methods\",\"id\":5}\r\n",
    )
    .unwrap();
    assert_eq!(v["id"], 5);

    server.shutdown();
    assert!(!path.exists(), "shutdown removes the socket");
    server.shutdown(); // idempotent
    let e = RpcClient::connect(&path).err().unwrap();
    assert!(e.is_not_running(), "{e}");
    assert!(
        e.to_string().starts_with(&format!(
            "no ferroraid target is running at {}",
            path.display()
        )),
        "{e}"
    );
    // The open client sees the connection closed, not a hang.
    let e = c.status().unwrap_err();
    assert!(matches!(e, ClientError::Io { .. }), "{e}");
}

#[test]
fn shutdown_interrupts_idle_connections() {
    let dir = sock_dir();
    let path = dir.path().join("rpc.sock");
    let (server, _m) = serve(&path);
    let idle: Vec<UnixStream> = (0..4)
        .map(|_| UnixStream::connect(&path).unwrap())
        .collect();
    // Make sure every connection has been accepted before shutting down.
    let mut c = RpcClient::connect(&path).unwrap();
    c.status().unwrap();
    let t = Instant::now();
    drop(server);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "shutdown took {:?}",
        t.elapsed()
    );
    for mut s in idle {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = [0u8; 1];
        assert_eq!(s.read(&mut b).unwrap(), 0, "closed by the server");
    }
    assert!(!path.exists());
}

#[test]
fn oversize_line_is_refused_and_the_server_goes_on() {
    let dir = sock_dir();
    let path = dir.path().join("rpc.sock");
    let (_server, _m) = serve(&path);
    // MAX_REQUEST_BYTES + 1 bytes without a newline: refused before the newline arrives.
    let mut s = UnixStream::connect(&path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let big = vec![b' '; MAX_REQUEST_BYTES + 1];
    s.write_all(&big).unwrap();
    let mut r = std::io::BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(err_code(&v), codes::INVALID_REQUEST);
    assert!(err_msg(&v).contains("longer than 1048576 bytes"), "{v}");
    line.clear();
    assert_eq!(r.read_line(&mut line).unwrap(), 0, "connection closed");
    // A request of exactly the limit is read (and is a valid request padded with spaces).
    let mut req = br#"{"jsonrpc":"2.0","method":"rpc_methods","id":1}"#.to_vec();
    req.resize(MAX_REQUEST_BYTES, b' ');
    req.push(b'\n');
    let v = raw(&path, &req).unwrap();
    assert_eq!(v["result"], json!(METHODS));
}

#[test]
fn malformed_input_over_the_socket() {
    let dir = sock_dir();
    let path = dir.path().join("rpc.sock");
    let (_server, _m) = serve(&path);
    let v = raw(&path, b"{\"jsonrpc\"\n").unwrap();
    assert_eq!(err_code(&v), codes::PARSE_ERROR);
    let v = raw(&path, b"\xff\xfe\x00\x01\n").unwrap();
    assert_eq!(err_code(&v), codes::PARSE_ERROR);
    // A client that says nothing, or half a request, and hangs up: no answer, no harm.
    {
        let mut s = UnixStream::connect(&path).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert_eq!(s.read(&mut [0u8; 8]).unwrap(), 0);
    }
    {
        let mut s = UnixStream::connect(&path).unwrap();
        s.write_all(b"{\"jsonrpc\":\"2.0\",\"meth").unwrap();
    }
    // The last line may lack its newline when the client stops writing.
    let mut s = UnixStream::connect(&path).unwrap();
    s.write_all(br#"{"jsonrpc":"2.0","method":"rpc_methods","id":3}"#)
        .unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.contains(r#""id":3"#), "{out}");
    // Still serving.
    assert!(RpcClient::connect(&path).unwrap().status().is_ok());
}

#[test]
fn concurrent_clients() {
    let dir = sock_dir();
    let path = dir.path().join("rpc.sock");
    let (_server, m) = serve(&path);
    std::thread::scope(|s| {
        for t in 0..8 {
            let path = &path;
            s.spawn(move || {
                let mut c = RpcClient::connect(path).unwrap();
                for i in 0..50 {
                    if (t + i) % 5 == 0 {
                        let e = c.member_remove("/dev/m0").unwrap_err();
                        assert!(matches!(e, ClientError::Rpc(ref e) if e.code == codes::MEMBER_NOT_FAULTY), "{e}");
                    } else {
                        assert!(c.status().unwrap().members.len() >= 6);
                    }
                    let dev = format!("/dev/t{t}-{i}");
                    assert_eq!(c.member_add(&dev).unwrap().device.as_deref(), Some(dev.as_str()));
                }
            });
        }
    });
    assert_eq!(m.status().members.len(), 6 + 8 * 50);
}

#[test]
fn connection_limit() {
    let dir = sock_dir();
    let path = dir.path().join("rpc.sock");
    let (_server, _m) = serve(&path);
    let mut held = Vec::new();
    for _ in 0..MAX_CONNECTIONS {
        let mut c = RpcClient::connect(&path).unwrap();
        c.call("rpc_methods", Value::Null).unwrap(); // accepted and registered
        held.push(c);
    }
    let mut extra = RpcClient::connect(&path).unwrap();
    match extra.call("rpc_methods", Value::Null) {
        Err(ClientError::Rpc(e)) => {
            assert_eq!(e.code, codes::SERVER_BUSY);
            assert!(e.message.contains("server busy"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    held.pop();
    // The slot frees once the server notices the close.
    let t = Instant::now();
    loop {
        let mut c = RpcClient::connect(&path).unwrap();
        match c.call("rpc_methods", Value::Null) {
            Ok(_) => break,
            Err(ClientError::Rpc(e)) if e.code == codes::SERVER_BUSY => {
                assert!(t.elapsed() < Duration::from_secs(10));
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn stale_socket_is_replaced() {
    let dir = sock_dir();
    let path = dir.path().join("rpc.sock");
    // A socket file nobody listens on any more (a target that crashed).
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    assert!(RpcClient::connect(&path).err().unwrap().is_not_running());
    let (_server, _m) = serve(&path);
    assert!(RpcClient::connect(&path).unwrap().status().is_ok());
}

#[test]
fn second_server_is_refused() {
    let dir = sock_dir();
    let path = dir.path().join("rpc.sock");
    let (_server, _m) = serve(&path);
    match RpcServer::bind(&path, Mock::new()) {
        Err(e @ ServerError::AlreadyRunning { .. }) => {
            assert!(e.to_string().contains("already running at"), "{e}")
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a second server bound a live socket"),
    }
    // The first one is untouched.
    assert!(RpcClient::connect(&path).unwrap().status().is_ok());
}

#[test]
fn other_files_are_never_replaced() {
    let dir = sock_dir();
    let path = dir.path().join("precious");
    std::fs::write(&path, b"data").unwrap();
    match RpcServer::bind(&path, Mock::new()) {
        Err(e @ ServerError::NotASocket { .. }) => {
            assert!(e.to_string().contains("is not a socket"), "{e}")
        }
        other => panic!("{:?}", other.err()),
    }
    assert_eq!(std::fs::read(&path).unwrap(), b"data");
    // A symbolic link, even to a socket, is not a socket.
    let real = dir.path().join("real.sock");
    drop(UnixListener::bind(&real).unwrap());
    let link = dir.path().join("link.sock");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    assert!(matches!(
        RpcServer::bind(&link, Mock::new()),
        Err(ServerError::NotASocket { .. })
    ));
}

#[test]
fn missing_directory_is_created_private() {
    let dir = sock_dir();
    let path = dir.path().join("run/ferroraid/rpc.sock");
    let (_server, _m) = serve(&path);
    let mode = std::fs::metadata(path.parent().unwrap())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "{mode:o}");
    let long = dir.path().join("x".repeat(120));
    match RpcServer::bind(&long, Mock::new()) {
        Err(e @ ServerError::Io { .. }) => assert!(e.to_string().contains("107 bytes"), "{e}"),
        other => panic!("{:?}", other.err()),
    }
}

#[test]
fn client_times_out_on_a_silent_server() {
    let dir = sock_dir();
    let path = dir.path().join("silent.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let mut c = RpcClient::connect_timeout(&path, Duration::from_millis(200)).unwrap();
    let t = Instant::now();
    let e = c.status().unwrap_err();
    assert!(matches!(e, ClientError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("did not answer within 200ms"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
    drop(listener);
}

#[test]
fn client_rejects_bad_answers() {
    let dir = sock_dir();
    let path = dir.path().join("liar.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let answers: &[&str] = &[
        "not json\n",
        "[1]\n",
        "{\"jsonrpc\":\"1.0\",\"result\":1,\"id\":1}\n",
        "{\"jsonrpc\":\"2.0\",\"result\":1,\"id\":99}\n",
        "{\"jsonrpc\":\"2.0\",\"id\":1}\n",
        "{\"jsonrpc\":\"2.0\",\"error\":{\"code\":\"x\"},\"id\":1}\n",
    ];
    let server = std::thread::spawn(move || {
        for a in answers {
            let (mut s, _) = listener.accept().unwrap();
            let mut r = std::io::BufReader::new(s.try_clone().unwrap());
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            s.write_all(a.as_bytes()).unwrap();
        }
    });
    for _ in answers {
        let mut c = RpcClient::connect(&path).unwrap();
        let e = c.call("rpc_methods", Value::Null).unwrap_err();
        assert!(matches!(e, ClientError::Protocol { .. }), "{e}");
        assert!(e.to_string().contains("sent an invalid answer"), "{e}");
    }
    server.join().unwrap();
}

#[test]
fn shutdown_works_when_the_socket_file_is_gone() {
    let dir = sock_dir();
    let path = dir.path().join("rpc.sock");
    let (mut server, _m) = serve(&path);
    std::fs::remove_file(&path).unwrap();
    // Someone else's socket now has the path: shutdown must not remove it.
    let other = UnixListener::bind(&path).unwrap();
    let t = Instant::now();
    server.shutdown();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(path.exists(), "another server's socket was removed");
    drop(other);
}

#[test]
fn process_start_and_stop() {
    let m = Mock::new();
    let v = req(
        &*m,
        r#"{"jsonrpc":"2.0","method":"process_start","params":{"kind":"check"},"id":1}"#,
    );
    assert_eq!(v["result"]["kind"], "check", "{v}");
    assert_eq!(v["result"]["size_bytes"], 1u64 << 30);
    // A second one is refused with the application code, naming the running one.
    let v = req(
        &*m,
        r#"{"jsonrpc":"2.0","method":"process_start","params":["repair"],"id":2}"#,
    );
    assert_eq!(err_code(&v), codes::PROCESS_REFUSED);
    assert!(err_msg(&v).contains("check is running"), "{v}");
    let v = req(&*m, r#"{"jsonrpc":"2.0","method":"process_stop","id":3}"#);
    assert_eq!(v["result"]["kind"], "idle", "{v}");
    // Bad parameters name what is accepted.
    for (params, what) in [
        (r#"{"kind":"rebuild"}"#, "member_add"),
        (r#"{"kind":"scrub"}"#, "unknown process kind"),
        (r#"{"kind":7}"#, "missing kind"),
        (r#"{}"#, "missing kind"),
        (r#"{"kind":"check","x":1}"#, "unknown parameter"),
    ] {
        let line =
            format!(r#"{{"jsonrpc":"2.0","method":"process_start","params":{params},"id":4}}"#);
        let v = req(&*m, &line);
        assert_eq!(err_code(&v), codes::INVALID_PARAMS, "{params}: {v}");
        assert!(err_msg(&v).contains(what), "{params}: {v}");
    }
    let v = req(
        &*m,
        r#"{"jsonrpc":"2.0","method":"process_stop","params":{"kind":"check"},"id":5}"#,
    );
    assert_eq!(err_code(&v), codes::INVALID_PARAMS);
}

/// `member_replace`: parameters by name or position, each checked; a handler that does
/// not implement it answers "not supported" (a target that predates it); one that does
/// gets the two devices as given.
#[test]
fn member_replace_params() {
    struct Replacer;
    impl Handler for Replacer {
        fn status(&self) -> StatusReport {
            unreachable!()
        }
        fn member_fail(&self, _: &str) -> Result<MemberReport, RpcError> {
            unreachable!()
        }
        fn member_remove(&self, _: &str) -> Result<MemberReport, RpcError> {
            unreachable!()
        }
        fn member_add(&self, _: &str) -> Result<MemberReport, RpcError> {
            unreachable!()
        }
        fn member_replace(&self, old: &str, new: &str) -> Result<MemberReport, RpcError> {
            Ok(MemberReport::idle(
                old.parse().ok(),
                Some(new.to_string()),
                crate::status::MemberState::Replacing,
            ))
        }
        fn process_start(&self, _: ProcessKind) -> Result<ProcessReport, RpcError> {
            unreachable!()
        }
        fn process_stop(&self) -> Result<ProcessReport, RpcError> {
            unreachable!()
        }
    }
    let v = req(
        &Replacer,
        r#"{"jsonrpc":"2.0","method":"member_replace","params":{"old":2,"new":"/dev/n"},"id":1}"#,
    );
    assert_eq!(v["result"]["slot"], 2, "{v}");
    assert_eq!(v["result"]["device"], "/dev/n", "{v}");
    assert_eq!(v["result"]["state"], "replacing", "{v}");
    let v = req(
        &Replacer,
        r#"{"jsonrpc":"2.0","method":"member_replace","params":["3","/dev/n"],"id":2}"#,
    );
    assert_eq!(v["result"]["slot"], 3, "{v}");
    for (params, what) in [
        (r#"{"old":"/dev/a"}"#, "missing old or new"),
        (r#"["/dev/a"]"#, "missing old or new"),
        (
            r#"{"old":"/dev/a","new":"/dev/b","x":1}"#,
            "unknown parameter",
        ),
        (r#"{"old":"/dev/a","new":5}"#, "new must be a device path"),
        (r#"{"old":"","new":"/dev/b"}"#, "device is empty"),
        (r#"{"old":true,"new":"/dev/b"}"#, "string or a slot number"),
    ] {
        let line =
            format!(r#"{{"jsonrpc":"2.0","method":"member_replace","params":{params},"id":4}}"#);
        let v = req(&Replacer, &line);
        assert_eq!(err_code(&v), codes::INVALID_PARAMS, "{params}: {v}");
        assert!(err_msg(&v).contains(what), "{params}: {v}");
    }
    let m = Mock::new();
    let v = req(
        &*m,
        r#"{"jsonrpc":"2.0","method":"member_replace","params":{"old":"1","new":"/dev/n"},"id":5}"#,
    );
    assert_eq!(err_code(&v), codes::NOT_SUPPORTED, "{v}");
    let v = req(
        &*m,
        r#"{"jsonrpc":"2.0","method":"process_start","params":{"kind":"replace"},"id":6}"#,
    );
    assert!(err_msg(&v).contains("member_replace"), "{v}");
}
