//! The management socket: JSON-RPC 2.0 over a Unix stream socket.
//!
//! A running target (`ferroraid serve`) answers management requests on a Unix socket —
//! [`default_rpc_path`] unless told otherwise — and `ferroraid status|fail|remove|add`
//! are its clients ([`RpcClient`]). This is the management plane, not the data path: each
//! connection is served by its own thread, and the target's work is done by a
//! [`Handler`].
//!
//! # Wire format
//!
//! [JSON-RPC 2.0](https://www.jsonrpc.org/specification), **one JSON value per line**: a
//! request (or a batch: an array of requests) is a single line of UTF-8 JSON ended by
//! `\n`, and so is each response. Requests longer than [`MAX_REQUEST_BYTES`] (1 MiB) are
//! refused with an `Invalid Request` error and the connection is closed. Blank lines are
//! ignored. A request without `id` is a notification: it is carried out, and never
//! answered.
//!
//! ```text
//! → {"jsonrpc":"2.0","method":"member_fail","params":{"device":"/dev/nvme2n1"},"id":1}
//! ← {"error":{"code":-32002,"message":"array would fail: ..."},"id":1,"jsonrpc":"2.0"}
//! ```
//!
//! # Methods
//!
//! | method | params | result |
//! |---|---|---|
//! | `array_status` | none | [`StatusReport`] |
//! | `member_fail` | `{"device": "<path or slot number>"}` | the member's [`MemberReport`] after |
//! | `member_remove` | `{"device": "<path or slot number>"}` | the (now empty) slot's [`MemberReport`] |
//! | `member_add` | `{"device": "<path>"}` | the added device's [`MemberReport`] |
//! | `member_replace` | `{"old": "<path or slot number>", "new": "<path>"}` | the replacement's [`MemberReport`] (`replacing`) |
//! | `nvmf_portal_list` | none | [`PortalListReport`] `{"portals": [...]}` |
//! | `nvmf_portal_set_ana` | `{"portal": "IP:PORT", "ana_state": "optimized" \| "non_optimized" \| "inaccessible"}` | [`PortalSetAnaReport`] |
//! | `nvmf_portal_remove` | `{"portal": "IP:PORT"}` | [`PortalRemoveReport`] |
//! | `nvmf_portal_add` | `{"portal": "IP:PORT", "ana_state"?: ...}` | [`PortalAddReport`] |
//! | `rpc_methods` | none | the method names, sorted |
//!
//! `params` may also be given by position (`["/dev/nvme2n1"]`). A device is named by the
//! path the target opened it with, or by its slot number (all digits; write `./3` for a
//! file named `3`); a slot may also be sent as a JSON number.
//!
//! # Errors
//!
//! The standard codes — [`codes::PARSE_ERROR`] (-32700), [`codes::INVALID_REQUEST`]
//! (-32600), [`codes::METHOD_NOT_FOUND`] (-32601), [`codes::INVALID_PARAMS`] (-32602),
//! [`codes::INTERNAL_ERROR`] (-32603) — and application codes from -32000 down
//! ([`codes`]), each with a message naming the device. Malformed input never stops the
//! server: at worst its connection is closed.
//!
//! # Security
//!
//! The socket is created with mode 0600 (bound, chmod-ed, and only then listening, so it
//! is never reachable with a looser mode): only its owner (root, for a system target)
//! may manage the array.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::frontends::ExportSpec;
use crate::nvmf::spec::AnaState;
use crate::nvmf::{
    PortalAddReport, PortalError, PortalListReport, PortalRemoveReport, PortalSetAnaReport,
};
use crate::status::{
    ExportProtocol, ExportRemoveReport, ExportReport, MemberReport, ProcessKind, ProcessReport,
    StatusReport,
};
use crate::target::ExportError;

/// Longest request line the server reads, in bytes (the `\n` not counted): 1 MiB. A
/// management request is a few hundred bytes; the bound keeps a misbehaving client from
/// making the server buffer without limit.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;
/// Longest response line a client reads, in bytes: 16 MiB (a status report of a
/// 257-member array is well under 1 MiB).
pub const MAX_RESPONSE_BYTES: usize = 16 << 20;
/// Most requests in one batch: a batch is answered in one line, and this keeps that line
/// (and the time one connection holds a handler) bounded.
pub const MAX_BATCH: usize = 64;
/// Most connections served at once; a connection beyond it is answered with
/// [`codes::SERVER_BUSY`] and closed. Each connection is a thread.
pub const MAX_CONNECTIONS: usize = 64;
/// Longest path a device parameter may have, bytes (Linux's `PATH_MAX`).
pub const MAX_DEVICE_BYTES: usize = 4096;
/// How long the server waits for a client to take a response before dropping the
/// connection.
pub const SERVER_WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`RpcClient`] waits to connect, send, and for each answer, unless told
/// otherwise ([`RpcClient::connect_timeout`]).
pub const DEFAULT_CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// Mode of the socket file: read/write for its owner only.
pub const SOCKET_MODE: u32 = 0o600;
/// Mode of a directory [`RpcServer::bind`] creates for the socket.
pub const SOCKET_DIR_MODE: u32 = 0o700;
/// The system target's socket (used when running as root with `/run` writable).
pub const SYSTEM_SOCKET_PATH: &str = "/run/ferroraid/ferroraid.sock";
/// File name of the socket in `$XDG_RUNTIME_DIR` or the current directory.
pub const SOCKET_FILE_NAME: &str = "ferroraid.sock";
/// How long [`RpcServer::bind`] waits for a server already at the path to accept.
const STALE_CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// Backlog of the listening socket.
const LISTEN_BACKLOG: i32 = 64;
/// Longest method name quoted back in an error message, in characters.
const MAX_QUOTED_CHARS: usize = 64;

/// JSON-RPC error codes: the standard ones and ferroraid's application codes (the
/// spec reserves -32000..=-32099 for implementation-defined server errors).
pub mod codes {
    /// The line is not valid JSON (or not UTF-8).
    pub const PARSE_ERROR: i64 = -32700;
    /// Not a valid JSON-RPC 2.0 request (missing/wrong `jsonrpc`, `method`, `id`,
    /// `params` of the wrong type, empty batch, oversize line).
    pub const INVALID_REQUEST: i64 = -32600;
    /// No such method.
    pub const METHOD_NOT_FOUND: i64 = -32601;
    /// The method's parameters are missing, unknown or of the wrong type.
    pub const INVALID_PARAMS: i64 = -32602;
    /// The server failed (a handler panicked, a result could not be encoded).
    pub const INTERNAL_ERROR: i64 = -32603;
    /// The array has no member with that path or slot.
    pub const NO_SUCH_MEMBER: i64 = -32000;
    /// `member_remove` of a member that is still active: fail it first.
    pub const MEMBER_NOT_FAULTY: i64 = -32001;
    /// Failing (or removing) the member would leave the array without enough members to
    /// serve its data.
    pub const ARRAY_WOULD_FAIL: i64 = -32002;
    /// `member_add` of a device that is already a member or spare of this array.
    pub const DEVICE_IN_USE: i64 = -32003;
    /// `member_add` of a device that cannot be used (cannot be opened, too small, belongs
    /// to another array, ...).
    pub const DEVICE_UNUSABLE: i64 = -32004;
    /// The target cannot do this (yet).
    pub const NOT_SUPPORTED: i64 = -32005;
    /// `process_start` refused: another process runs, the array is degraded (only a
    /// rebuild may run) or failed; `member_replace` refused for the same reasons, or
    /// because the member is not in service or already being replaced.
    pub const PROCESS_REFUSED: i64 = -32006;
    /// `nvmf_portal_*`: no NVMe/TCP portal listens on that address.
    pub const NO_SUCH_PORTAL: i64 = -32007;
    /// `nvmf_portal_add` of an address that is already a portal.
    pub const PORTAL_EXISTS: i64 = -32008;
    /// `nvmf_portal_add`, `export_add`: the address cannot be listened on (in use, not
    /// local, ...).
    pub const PORTAL_BIND_FAILED: i64 = -32009;
    /// No running array has that name (`array` parameter, `array_stop`).
    pub const NO_SUCH_ARRAY: i64 = -32020;
    /// The process serves several arrays (or none) and the method needs one: name it
    /// with the `array` parameter.
    pub const ARRAY_NOT_NAMED: i64 = -32021;
    /// `array_start`/`array_create`: an array of that name is already running.
    pub const ARRAY_NAME_IN_USE: i64 = -32022;
    /// `array_start`: the array cannot be assembled or started (the message says why:
    /// a device that cannot be opened or claimed, a superblock refused, a socket in use).
    pub const ARRAY_START_FAILED: i64 = -32023;
    /// `array_create`: the members cannot be written (the message says why).
    pub const ARRAY_CREATE_FAILED: i64 = -32024;
    /// `array_stop`: the array stopped, but a flush or the final superblock write failed
    /// (the message says which; the array may need a resync at its next start).
    pub const ARRAY_STOP_FAILED: i64 = -32025;
    /// `export_add` of a protocol already exported (one server per protocol per array),
    /// or whose previous export still drains its connections.
    pub const EXPORT_EXISTS: i64 = -32010;
    /// `export_remove` of a protocol that is not exported.
    pub const NOT_EXPORTED: i64 = -32011;
    /// The server is at [`super::MAX_CONNECTIONS`]; try again.
    pub const SERVER_BUSY: i64 = -32099;
}

/// The method names, sorted (the result of `rpc_methods`).
pub const METHODS: [&str; 20] = [
    "array_create",
    "array_create_progress",
    "array_list",
    "array_start",
    "array_status",
    "array_stop",
    "export_add",
    "export_list",
    "export_remove",
    "member_add",
    "member_fail",
    "member_remove",
    "member_replace",
    "nvmf_portal_add",
    "nvmf_portal_list",
    "nvmf_portal_remove",
    "nvmf_portal_set_ana",
    "process_start",
    "process_stop",
    "rpc_methods",
];

/// A JSON-RPC error object: what a [`Handler`] returns to refuse a request, and what
/// [`RpcClient`] reports when the server refused one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct RpcError {
    /// The error code ([`codes`]).
    pub code: i64,
    /// One sentence for people, naming the device or method concerned.
    pub message: String,
    /// Optional details for programs (application errors carry `{"device": ...}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

impl RpcError {
    /// An error with `code` and `message` and no data.
    pub fn new(code: i64, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
            data: None,
        }
    }

    fn with_device(code: i64, message: String, device: &str) -> Self {
        RpcError {
            code,
            message,
            data: Some(json!({ "device": device })),
        }
    }

    /// [`codes::PARSE_ERROR`]: the line is not JSON; `detail` says where.
    pub fn parse_error(detail: impl std::fmt::Display) -> Self {
        Self::new(codes::PARSE_ERROR, format!("parse error: {detail}"))
    }

    /// [`codes::INVALID_REQUEST`] with what is wrong.
    pub fn invalid_request(detail: impl std::fmt::Display) -> Self {
        Self::new(codes::INVALID_REQUEST, format!("invalid request: {detail}"))
    }

    /// [`codes::METHOD_NOT_FOUND`] for `method` (quoted, shortened), listing the methods.
    pub fn method_not_found(method: &str) -> Self {
        Self::new(
            codes::METHOD_NOT_FOUND,
            format!(
                "method not found: {:?} (methods: {})",
                shorten(method),
                METHODS.join(", ")
            ),
        )
    }

    /// [`codes::INVALID_PARAMS`] with what is wrong.
    pub fn invalid_params(detail: impl std::fmt::Display) -> Self {
        Self::new(codes::INVALID_PARAMS, format!("invalid params: {detail}"))
    }

    /// `Err(`[`codes::INVALID_PARAMS`]`)` when `device` is a relative path: the node would
    /// resolve it in its own working directory, not the client's, and could write another
    /// file than the one meant (`vfio:BDF` names are not paths). The `ferroraid` CLI sends
    /// absolute paths.
    pub fn require_absolute(device: &std::path::Path) -> Result<(), RpcError> {
        if device.is_relative() && !device.to_string_lossy().starts_with("vfio:") {
            return Err(Self::invalid_params(format!(
                "device {:?} is a relative path: the target would resolve it in its own \
                 working directory, not yours; give an absolute path",
                device.display().to_string()
            )));
        }
        Ok(())
    }

    /// [`codes::INTERNAL_ERROR`] with what failed.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        Self::new(codes::INTERNAL_ERROR, format!("internal error: {detail}"))
    }

    /// [`codes::NO_SUCH_MEMBER`]: nothing in the array is `device` (a path or slot).
    pub fn no_such_member(device: &str) -> Self {
        Self::with_device(
            codes::NO_SUCH_MEMBER,
            format!("no such member: {device} is not a member, spare or slot of this array"),
            device,
        )
    }

    /// [`codes::MEMBER_NOT_FAULTY`]: `device` is still active, so it cannot be removed.
    pub fn member_not_faulty(device: &str) -> Self {
        Self::with_device(
            codes::MEMBER_NOT_FAULTY,
            format!("member {device} is not faulty (fail it first: ferroraid fail {device})"),
            device,
        )
    }

    /// [`codes::ARRAY_WOULD_FAIL`]: taking `device` out would lose data; `why` says how
    /// many members are left and needed.
    pub fn array_would_fail(device: &str, why: impl std::fmt::Display) -> Self {
        Self::with_device(
            codes::ARRAY_WOULD_FAIL,
            format!("array would fail: refusing to take {device} out of service ({why})"),
            device,
        )
    }

    /// [`codes::DEVICE_IN_USE`]: `device` is already part of the array.
    pub fn device_in_use(device: &str) -> Self {
        Self::with_device(
            codes::DEVICE_IN_USE,
            format!("{device} is already a member or spare of this array"),
            device,
        )
    }

    /// [`codes::DEVICE_UNUSABLE`]: `device` cannot be added; `why` says why.
    pub fn device_unusable(device: &str, why: impl std::fmt::Display) -> Self {
        Self::with_device(
            codes::DEVICE_UNUSABLE,
            format!("cannot use {device}: {why}"),
            device,
        )
    }

    /// [`codes::NOT_SUPPORTED`]: the target cannot do `what` yet.
    pub fn not_supported(what: impl std::fmt::Display) -> Self {
        Self::new(codes::NOT_SUPPORTED, format!("not supported: {what}"))
    }

    /// A refused portal operation: [`codes::INVALID_PARAMS`] for a malformed address,
    /// [`codes::NO_SUCH_PORTAL`], [`codes::PORTAL_EXISTS`], [`codes::PORTAL_BIND_FAILED`];
    /// the message is the [`PortalError`]'s.
    pub fn portal(e: &PortalError) -> Self {
        let code = match e {
            PortalError::BadAddress(_) => codes::INVALID_PARAMS,
            PortalError::Unknown(_) => codes::NO_SUCH_PORTAL,
            PortalError::Exists(_) => codes::PORTAL_EXISTS,
            PortalError::Bind { .. } | PortalError::Spawn { .. } => codes::PORTAL_BIND_FAILED,
        };
        Self::new(code, e.to_string())
    }

    /// [`codes::NOT_SUPPORTED`]: the target serves no NVMe/TCP (`nvmf_portal_*`).
    pub fn no_nvmf() -> Self {
        Self::new(
            codes::NOT_SUPPORTED,
            "no NVMe/TCP front is configured (serve --nvmf HOST:PORT)",
        )
    }

    /// [`codes::NO_SUCH_ARRAY`] for `name`.
    pub fn no_such_array(name: &str, running: &[String]) -> Self {
        let mut e = Self::new(
            codes::NO_SUCH_ARRAY,
            format!(
                "no running array is named {:?} (running: {})",
                shorten(name),
                if running.is_empty() {
                    "none".to_string()
                } else {
                    running.join(", ")
                }
            ),
        );
        e.data = Some(json!({ "array": name }));
        e
    }

    /// [`codes::ARRAY_NOT_NAMED`]: the method needs one array and the process serves
    /// `running` (none, or several).
    pub fn array_not_named(method: &str, running: &[String]) -> Self {
        let message = if running.is_empty() {
            format!("{method}: no array is running (start one with array_start)")
        } else {
            format!(
                "{method}: this process serves {} arrays ({}): name one with {{\"array\": NAME}}",
                running.len(),
                running.join(", ")
            )
        };
        Self::new(codes::ARRAY_NOT_NAMED, message)
    }

    /// A refused export change: [`codes::EXPORT_EXISTS`] (already exported, or the
    /// previous export still drains), [`codes::NOT_EXPORTED`], [`codes::INVALID_PARAMS`]
    /// (a bad spec), [`codes::PORTAL_BIND_FAILED`] (cannot listen),
    /// [`codes::INTERNAL_ERROR`] (the target is stopping); the message is the error's.
    pub fn export(e: &ExportError) -> Self {
        let code = match e {
            ExportError::Exists(_) | ExportError::Draining(_) => codes::EXPORT_EXISTS,
            ExportError::NotExported(_) => codes::NOT_EXPORTED,
            ExportError::BadSpec(_) => codes::INVALID_PARAMS,
            ExportError::Start { .. } => codes::PORTAL_BIND_FAILED,
            ExportError::Stopping => codes::INTERNAL_ERROR,
        };
        Self::new(code, e.to_string())
    }

    /// [`codes::PROCESS_REFUSED`]: a background process cannot start; `why` says why.
    pub fn process_refused(why: impl std::fmt::Display) -> Self {
        Self::new(codes::PROCESS_REFUSED, format!("cannot start: {why}"))
    }
}

/// What the target does for each method. Called from the server's connection threads,
/// possibly at the same time: implementations serialize their own state changes. A
/// panic in a handler is answered with [`codes::INTERNAL_ERROR`] and does not stop the
/// server.
///
/// `device_or_slot` is a device path as given by the operator or a slot number in
/// decimal ([`StatusReport::find_member`] resolves both against a report).
pub trait Handler: Send + Sync {
    /// The current status (`array_status`).
    fn status(&self) -> StatusReport;

    /// Marks a member faulty (`member_fail`, like `mdadm --fail`): no more I/O goes to it;
    /// the array runs degraded. Failing an already faulty member is not an error.
    ///
    /// # Errors
    /// [`RpcError::no_such_member`]; [`RpcError::array_would_fail`] when the array has no
    /// redundancy left to lose.
    fn member_fail(&self, device_or_slot: &str) -> Result<MemberReport, RpcError>;

    /// Takes a faulty member out of its slot (`member_remove`, like `mdadm --remove`),
    /// releasing the device; the slot becomes `removed`. A spare is removed outright.
    ///
    /// # Errors
    /// [`RpcError::no_such_member`]; [`RpcError::member_not_faulty`] for an active member.
    fn member_remove(&self, device_or_slot: &str) -> Result<MemberReport, RpcError>;

    /// Adds a device (`member_add`, like `mdadm --add`): as a spare, or into an empty slot
    /// where a rebuild will recover it.
    ///
    /// # Errors
    /// [`RpcError::device_in_use`], [`RpcError::device_unusable`],
    /// [`RpcError::not_supported`].
    fn member_add(&self, device_path: &str) -> Result<MemberReport, RpcError>;

    /// Replaces a member while it keeps serving (`member_replace`, like `mdadm --replace
    /// OLD --with NEW`): `new` gets the member's contents (copied from it, rebuilt from
    /// the others where it cannot be read) and every write, then takes its slot; `old`
    /// leaves the array. Returns the replacement's report (`replacing`); progress is the
    /// `replace` process of the status report.
    ///
    /// # Errors
    /// [`RpcError::no_such_member`]; [`RpcError::process_refused`] when the member is not
    /// in service, already being replaced, the array is degraded (md would give the new
    /// device to the missing member first: add it instead) or another process runs;
    /// [`RpcError::device_in_use`], [`RpcError::device_unusable`]. Targets that predate it
    /// answer [`RpcError::not_supported`].
    fn member_replace(&self, old: &str, new: &str) -> Result<MemberReport, RpcError> {
        let _ = (old, new);
        Err(RpcError::not_supported("member_replace"))
    }

    /// Starts a background process (`process_start`, like writing md's `sync_action`):
    /// `check` (count parity mismatches), `repair` (rewrite mismatched parity) or `resync`
    /// (make parity consistent). Returns the process as it starts.
    ///
    /// # Errors
    /// [`RpcError::process_refused`] while another process runs, on a degraded or failed
    /// array; [`RpcError::invalid_params`] for another kind (`rebuild` starts by itself
    /// when a device is added to a degraded array).
    fn process_start(&self, kind: ProcessKind) -> Result<ProcessReport, RpcError>;

    /// Stops the running process (`process_stop`, md's `sync_action` = `idle`): its
    /// operations in flight finish, and a resync or rebuild resumes from where it stopped
    /// the next time it starts. Stopping when nothing runs is not an error. Returns the
    /// state after the stop.
    fn process_stop(&self) -> Result<ProcessReport, RpcError>;

    /// The NVMe/TCP portals with their ANA state, controllers and connections
    /// (`nvmf_portal_list`).
    ///
    /// # Errors
    /// [`RpcError::no_nvmf`] when the target serves no NVMe/TCP (the default).
    fn nvmf_portal_list(&self) -> Result<PortalListReport, RpcError> {
        Err(RpcError::no_nvmf())
    }

    /// Sets a portal's ANA state (`nvmf_portal_set_ana`); controllers of the portal that
    /// enabled ANA change notices get an Asynchronous Event.
    ///
    /// # Errors
    /// [`RpcError::no_nvmf`]; [`RpcError::portal`] (unknown portal, malformed address).
    fn nvmf_portal_set_ana(
        &self,
        portal: &str,
        state: AnaState,
    ) -> Result<PortalSetAnaReport, RpcError> {
        let _ = (portal, state);
        Err(RpcError::no_nvmf())
    }

    /// Stops listening on a portal and closes its connections (`nvmf_portal_remove`).
    ///
    /// # Errors
    /// [`RpcError::no_nvmf`]; [`RpcError::portal`] (unknown portal, malformed address).
    fn nvmf_portal_remove(&self, portal: &str) -> Result<PortalRemoveReport, RpcError> {
        let _ = portal;
        Err(RpcError::no_nvmf())
    }

    /// Listens on a new portal (`nvmf_portal_add`), in ANA state `state` (default
    /// optimized).
    ///
    /// # Errors
    /// [`RpcError::no_nvmf`]; [`RpcError::portal`] (already present, cannot bind,
    /// malformed address).
    fn nvmf_portal_add(
        &self,
        portal: &str,
        state: Option<AnaState>,
    ) -> Result<PortalAddReport, RpcError> {
        let _ = (portal, state);
        Err(RpcError::no_nvmf())
    }

    /// Starts an export of the array while it serves (`export_add`): the protocol's
    /// server listening on `spec`'s addresses, its front-ends handed to the running
    /// reactors. Returns the new export's addresses (bound ports) and name.
    ///
    /// # Errors
    /// [`RpcError::export`]: already exported or still draining, a bad spec, cannot
    /// listen, the target stopping. The default refuses with [`codes::NOT_SUPPORTED`].
    fn export_add(&self, spec: &ExportSpec) -> Result<Vec<ExportReport>, RpcError> {
        let _ = spec;
        Err(RpcError::not_supported("export_add"))
    }

    /// Removes the export of `protocol` (`export_remove`): its listeners stop, its
    /// connections finish the requests they accepted, reply and close.
    ///
    /// # Errors
    /// [`RpcError::export`]: not exported, the target stopping. The default refuses with
    /// [`codes::NOT_SUPPORTED`].
    fn export_remove(&self, protocol: ExportProtocol) -> Result<ExportRemoveReport, RpcError> {
        let _ = protocol;
        Err(RpcError::not_supported("export_remove"))
    }

    /// The live exports (`export_list`): every listen address of every protocol with its
    /// export name, as [`StatusReport::exports`] has them.
    ///
    /// # Errors
    /// None by default (the status report's list).
    fn export_list(&self) -> Result<Vec<ExportReport>, RpcError> {
        Ok(self.status().exports)
    }

    /// `array_status` of the one array this handler answers for. A target of one array
    /// answers its status; a process serving several answers only when the request names
    /// one (`{"array": NAME}`, [`Handler::route`]).
    ///
    /// # Errors
    /// [`RpcError::array_not_named`] when the process serves no array or several.
    fn status_checked(&self) -> Result<StatusReport, RpcError> {
        Ok(self.status())
    }

    /// Runs `f` with the handler of the array named `array` (a request's `array`
    /// parameter): every per-array method (`array_status`, `member_*`, `process_*`,
    /// `nvmf_portal_*`) goes through it when the request names an array. `None` (the
    /// default): the handler serves one array, and the request is answered by it when the
    /// name is that array's, refused with [`RpcError::no_such_array`] otherwise.
    ///
    /// # Errors
    /// [`RpcError::no_such_array`]; whatever `f` returns.
    fn route(
        &self,
        array: &str,
        f: &mut dyn FnMut(&dyn Handler) -> Result<Value, RpcError>,
    ) -> Option<Result<Value, RpcError>> {
        let _ = (array, f);
        None
    }

    /// Every running array's status, by name (`array_list`).
    ///
    /// # Errors
    /// As [`Handler::status_checked`] for a single-array target.
    fn array_list(&self) -> Result<Vec<StatusReport>, RpcError> {
        Ok(vec![self.status_checked()?])
    }

    /// Assembles and starts an array on this process's reactors (`array_start`, mdadm
    /// `--assemble`'s rules as `ferroraid serve` has them) with the exports asked for.
    /// Returns its status.
    ///
    /// # Errors
    /// [`RpcError::not_supported`] on a single-array target; [`codes::ARRAY_NAME_IN_USE`],
    /// [`codes::ARRAY_START_FAILED`] (with the reason).
    fn array_start(&self, params: ArrayStartParams) -> Result<StatusReport, RpcError> {
        let _ = params;
        Err(RpcError::not_supported("array_start"))
    }

    /// Stops an array (`array_stop`): its exports stop taking connections, requests in
    /// flight finish, its shards leave the reactors, members are flushed and it is marked
    /// clean. The other arrays serve on.
    ///
    /// # Errors
    /// [`RpcError::not_supported`] on a single-array target; [`RpcError::no_such_array`];
    /// [`codes::ARRAY_STOP_FAILED`].
    fn array_stop(&self, array: &str) -> Result<ArrayStopReport, RpcError> {
        let _ = array;
        Err(RpcError::not_supported("array_stop"))
    }

    /// Creates an array on new members (`array_create`, mdadm `--create`'s rules as
    /// `ferroraid create` has them: superblocks, zeroed data areas) and, unless
    /// `start: false`, starts it (as `array_start`).
    ///
    /// # Errors
    /// [`RpcError::not_supported`] on a single-array target; [`RpcError::invalid_params`]
    /// for a bad geometry; [`codes::ARRAY_CREATE_FAILED`]; as [`Handler::array_start`].
    fn array_create(&self, params: ArrayCreateParams) -> Result<ArrayCreateReport, RpcError> {
        let _ = params;
        Err(RpcError::not_supported("array_create"))
    }

    /// The creates in progress (and the last one of each name), with the bytes zeroed so
    /// far (`array_create_progress`): the progress handle of a long `array_create`,
    /// polled from another connection while it runs.
    ///
    /// # Errors
    /// [`RpcError::not_supported`] on a single-array target.
    fn array_create_progress(&self) -> Result<Vec<CreateProgressReport>, RpcError> {
        Err(RpcError::not_supported("array_create_progress"))
    }
}

/// One `array_create` of a running target and how far it got
/// (`array_create_progress`): kept after it ends until the next create of that name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CreateProgressReport {
    /// The array's name.
    pub array: String,
    /// `zeroing` (the members' data areas), `starting` (created, being assembled and
    /// started), `done`, or `failed` (see `error`).
    pub state: String,
    /// Bytes of the members' data areas zeroed so far (every member together).
    pub zeroed_bytes: u64,
    /// Bytes to zero in all (0 with `assume_clean`, or before the create knows).
    pub total_bytes: u64,
    /// Seconds since the create began.
    pub elapsed_s: f64,
    /// Why it failed, when `state` is `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Exports of an array started over JSON-RPC (`array_start`, `array_create`): where each
/// front listens. Empty lists: not exported over that protocol.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportParams {
    /// NBD TCP addresses (`host:port`).
    #[serde(default)]
    pub nbd: Vec<std::net::SocketAddr>,
    /// NBD Unix socket paths.
    #[serde(default)]
    pub nbd_unix: Vec<PathBuf>,
    /// iSCSI portals (`host:port`); the target is `iqn.2026-11.org.ferroraid:<name>`.
    #[serde(default)]
    pub iscsi: Vec<std::net::SocketAddr>,
    /// NVMe/TCP portals (`host:port`); the subsystem is `nqn.2026-11.org.ferroraid:<name>`.
    #[serde(default)]
    pub nvmf: Vec<std::net::SocketAddr>,
}

/// `array_start`'s parameters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArrayStartParams {
    /// Member devices, any order (their superblocks say the roles).
    pub devices: Vec<PathBuf>,
    /// Start although members are missing or out of date (mdadm `--force`).
    #[serde(default)]
    pub force: bool,
    /// Start although members the array counts as active are missing (mdadm `--run`).
    #[serde(default)]
    pub run: bool,
    /// Where to export it.
    #[serde(default, flatten)]
    pub exports: ExportParams,
}

/// `array_create`'s parameters (`ferroraid create`'s options).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArrayCreateParams {
    /// Array name (`set_name`, at most 31 bytes).
    pub name: String,
    /// RAID level: 5 or 6.
    pub level: u8,
    /// Member devices in role order.
    pub devices: Vec<PathBuf>,
    /// Chunk size, bytes (a power of two, 4 KiB..16 MiB; default 64 KiB).
    #[serde(default)]
    pub chunk_bytes: Option<u64>,
    /// md layout name (default `left-symmetric`).
    #[serde(default)]
    pub layout: Option<String>,
    /// Declare the members consistent instead of zeroing them (md's `--assume-clean`).
    #[serde(default)]
    pub assume_clean: bool,
    /// Overwrite devices that carry an md superblock.
    #[serde(default)]
    pub force: bool,
    /// `internal` or `none` (default: mdadm's rule).
    #[serde(default)]
    pub bitmap: Option<String>,
    /// Bytes of each member one bitmap bit covers (default: mdadm's).
    #[serde(default)]
    pub bitmap_chunk_bytes: Option<u64>,
    /// `resync`, `bitmap` or `ppl` (default: as `bitmap` decides).
    #[serde(default)]
    pub consistency_policy: Option<String>,
    /// Start the array once created (default true).
    #[serde(default = "yes")]
    pub start: bool,
    /// Where to export it when started.
    #[serde(default, flatten)]
    pub exports: ExportParams,
}

fn yes() -> bool {
    true
}

/// `array_stop`'s result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrayStopReport {
    /// The array stopped.
    pub array: String,
    /// It was marked clean (no resync owed at its next start).
    pub clean: bool,
}

/// `array_create`'s result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ArrayCreateReport {
    /// The array's name.
    pub array: String,
    /// Its UUID, md's colon form.
    pub uuid: String,
    /// Usable size, bytes.
    pub size_bytes: u64,
    /// Start of the data area on each member, bytes.
    pub data_offset_bytes: u64,
    /// Its status when started (`start: true`), else `null`.
    pub status: Option<StatusReport>,
}

/// Answers one request line (a request or a batch) with `handler`: the response to write
/// back, or `None` when there is nothing to answer (notifications). Never panics, whatever
/// the input; the line excludes its `\n`. This is the server's whole protocol logic,
/// usable without a socket.
pub fn handle_request(handler: &dyn Handler, line: &[u8]) -> Option<Value> {
    let v: Value = match serde_json::from_slice(line) {
        Ok(v) => v,
        Err(e) => return Some(error_response(Value::Null, RpcError::parse_error(e))),
    };
    match v {
        Value::Array(items) => {
            if items.is_empty() {
                return Some(error_response(
                    Value::Null,
                    RpcError::invalid_request("empty batch"),
                ));
            }
            if items.len() > MAX_BATCH {
                return Some(error_response(
                    Value::Null,
                    RpcError::invalid_request(format!(
                        "batch of {} requests: at most {MAX_BATCH}",
                        items.len()
                    )),
                ));
            }
            let out: Vec<Value> = items
                .into_iter()
                .filter_map(|item| handle_one(handler, item))
                .collect();
            (!out.is_empty()).then_some(Value::Array(out))
        }
        other => handle_one(handler, other),
    }
}

fn error_response(id: Value, e: RpcError) -> Value {
    json!({ "jsonrpc": "2.0", "error": e, "id": id })
}

/// `s` cut to [`MAX_QUOTED_CHARS`] characters for quoting in a message.
fn shorten(s: &str) -> String {
    if s.chars().count() <= MAX_QUOTED_CHARS {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(MAX_QUOTED_CHARS).collect();
        t.push('…');
        t
    }
}

/// One request of a line or batch.
fn handle_one(handler: &dyn Handler, v: Value) -> Option<Value> {
    let Value::Object(mut obj) = v else {
        return Some(error_response(
            Value::Null,
            RpcError::invalid_request("a request must be a JSON object"),
        ));
    };
    // `None`: a notification (no `id` member at all).
    let id = match obj.remove("id") {
        None => None,
        Some(id @ (Value::Null | Value::String(_) | Value::Number(_))) => Some(id),
        Some(_) => {
            return Some(error_response(
                Value::Null,
                RpcError::invalid_request("\"id\" must be a string, a number or null"),
            ))
        }
    };
    let reply_id = id.clone().unwrap_or(Value::Null);
    let invalid = |detail: &str| {
        Some(error_response(
            reply_id.clone(),
            RpcError::invalid_request(detail),
        ))
    };
    match obj.remove("jsonrpc") {
        Some(Value::String(v)) if v == "2.0" => {}
        _ => return invalid("\"jsonrpc\" must be \"2.0\""),
    }
    let method = match obj.remove("method") {
        Some(Value::String(m)) => m,
        Some(_) => return invalid("\"method\" must be a string"),
        None => return invalid("missing \"method\""),
    };
    let params = match obj.remove("params") {
        None => None,
        Some(p @ (Value::Object(_) | Value::Array(_))) => Some(p),
        Some(_) => return invalid("\"params\" must be an object or an array"),
    };
    if let Some(k) = obj.keys().next() {
        return invalid(&format!(
            "unknown member {:?} (a request has jsonrpc, method, params and id)",
            shorten(k)
        ));
    }
    let result = dispatch(handler, &method, params);
    let id = id?; // notifications are carried out, never answered
    Some(match result {
        Ok(v) => json!({ "jsonrpc": "2.0", "result": v, "id": id }),
        Err(e) => error_response(id, e),
    })
}

/// The methods of the process rather than of one array: never routed by `array`.
const PROCESS_METHODS: [&str; 6] = [
    "array_create",
    "array_create_progress",
    "array_list",
    "array_start",
    "array_stop",
    "rpc_methods",
];

fn dispatch(
    handler: &dyn Handler,
    method: &str,
    mut params: Option<Value>,
) -> Result<Value, RpcError> {
    // A per-array method naming its array goes to that array's handler.
    if !PROCESS_METHODS.contains(&method) {
        if let Some(Value::Object(m)) = &mut params {
            if let Some(a) = m.remove("array") {
                let Value::String(name) = a else {
                    return Err(RpcError::invalid_params(format!(
                        "{method}: \"array\" must be an array name (a string)"
                    )));
                };
                let mut params = Some(params.take().expect("an object"));
                let routed = handler.route(&name, &mut |h| dispatch_one(h, method, params.take()));
                return match routed {
                    Some(r) => r,
                    None => {
                        let own = handler.status_checked()?.array.name;
                        if crate::scan::name_matches(&name, &own) {
                            dispatch_one(handler, method, params.take())
                        } else {
                            Err(RpcError::no_such_array(&name, &[own]))
                        }
                    }
                };
            }
        }
    }
    dispatch_one(handler, method, params)
}

fn dispatch_one(
    handler: &dyn Handler,
    method: &str,
    params: Option<Value>,
) -> Result<Value, RpcError> {
    match method {
        "array_status" => {
            no_params(method, params)?;
            encode(guarded(method, || handler.status_checked())??)
        }
        "array_list" => {
            no_params(method, params)?;
            encode(guarded(method, || handler.array_list())??)
        }
        "array_start" => {
            let p: ArrayStartParams = struct_params(method, params)?;
            if p.devices.is_empty() {
                return Err(RpcError::invalid_params(
                    "array_start: devices is empty: name the member devices",
                ));
            }
            encode(guarded(method, || handler.array_start(p))??)
        }
        "array_create" => {
            let p: ArrayCreateParams = struct_params(method, params)?;
            encode(guarded(method, || handler.array_create(p))??)
        }
        "array_create_progress" => {
            no_params(method, params)?;
            encode(guarded(method, || handler.array_create_progress())??)
        }
        "array_stop" => {
            let usage = || "array_stop takes {\"array\": NAME}".to_string();
            let name = match single_param(params, "array", &usage)? {
                Some(Value::String(n)) => n,
                _ => {
                    return Err(RpcError::invalid_params(format!(
                        "missing or non-string array: {}",
                        usage()
                    )))
                }
            };
            encode(guarded(method, || handler.array_stop(&name))??)
        }
        "member_fail" => {
            let d = device_param(method, params)?;
            encode(guarded(method, || handler.member_fail(&d))??)
        }
        "member_remove" => {
            let d = device_param(method, params)?;
            encode(guarded(method, || handler.member_remove(&d))??)
        }
        "member_add" => {
            let d = device_param(method, params)?;
            encode(guarded(method, || handler.member_add(&d))??)
        }
        "member_replace" => {
            let (old, new) = replace_params(method, params)?;
            encode(guarded(method, || handler.member_replace(&old, &new))??)
        }
        "process_start" => {
            let kind = kind_param(method, params)?;
            encode(guarded(method, || handler.process_start(kind))??)
        }
        "process_stop" => {
            no_params(method, params)?;
            encode(guarded(method, || handler.process_stop())??)
        }
        "nvmf_portal_list" => {
            no_params(method, params)?;
            encode(guarded(method, || handler.nvmf_portal_list())??)
        }
        "nvmf_portal_set_ana" => {
            let (portal, state) = portal_params(method, params, true)?;
            let state = state.expect("required");
            encode(guarded(method, || {
                handler.nvmf_portal_set_ana(&portal, state)
            })??)
        }
        "nvmf_portal_remove" => {
            let (portal, _) = portal_params(method, params, false)?;
            encode(guarded(method, || handler.nvmf_portal_remove(&portal))??)
        }
        "nvmf_portal_add" => {
            let (portal, state) = portal_params(method, params, false)?;
            encode(guarded(method, || {
                handler.nvmf_portal_add(&portal, state)
            })??)
        }
        "export_add" => {
            let spec = export_add_params(method, params)?;
            encode(guarded(method, || handler.export_add(&spec))??)
        }
        "export_remove" => {
            let p = export_remove_params(method, params)?;
            encode(guarded(method, || handler.export_remove(p))??)
        }
        "export_list" => {
            no_params(method, params)?;
            encode(guarded(method, || handler.export_list())??)
        }
        "rpc_methods" => {
            no_params(method, params)?;
            Ok(json!(METHODS))
        }
        other => Err(RpcError::method_not_found(other)),
    }
}

/// Runs a handler method, turning a panic into [`codes::INTERNAL_ERROR`].
fn guarded<T>(method: &str, f: impl FnOnce() -> T) -> Result<T, RpcError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string());
        tracing::error!(method, panic = %what, "RPC handler panicked");
        RpcError::internal(format!("{method} failed: the handler panicked ({what})"))
    })
}

fn encode<T: Serialize>(v: T) -> Result<Value, RpcError> {
    serde_json::to_value(v)
        .map_err(|e| RpcError::internal(format!("cannot encode the result: {e}")))
}

/// What a handler built before its target is up (the management socket is bound first)
/// waits for: the target's state once set, waiting up to 30 s.
///
/// # Errors
/// [`RpcError::internal`] ("still starting") after 30 s.
pub(crate) fn wait_started<T>(cell: &std::sync::OnceLock<T>) -> Result<&T, RpcError> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(s) = cell.get() {
            return Ok(s);
        }
        if std::time::Instant::now() > deadline {
            return Err(RpcError::internal("the target is still starting"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A method's parameters as one named-parameter object (`T`, unknown keys refused).
fn struct_params<T: serde::de::DeserializeOwned>(
    method: &str,
    params: Option<Value>,
) -> Result<T, RpcError> {
    match params {
        Some(v @ Value::Object(_)) => serde_json::from_value(v)
            .map_err(|e| RpcError::invalid_params(format!("{method}: {e}"))),
        _ => Err(RpcError::invalid_params(format!(
            "{method} takes named parameters (an object); see docs/MANAGEMENT.md"
        ))),
    }
}

fn no_params(method: &str, params: Option<Value>) -> Result<(), RpcError> {
    match params {
        None => Ok(()),
        Some(Value::Object(m)) if m.is_empty() => Ok(()),
        Some(Value::Array(a)) if a.is_empty() => Ok(()),
        Some(_) => Err(RpcError::invalid_params(format!(
            "{method} takes no parameters"
        ))),
    }
}

/// A method's one parameter: `{"KEY": value}` or `[value]`; `None` when it is missing.
///
/// # Errors
/// Another key beside `key` ([`RpcError::invalid_params`], with `usage`).
fn single_param(
    params: Option<Value>,
    key: &str,
    usage: &dyn Fn() -> String,
) -> Result<Option<Value>, RpcError> {
    Ok(match params {
        Some(Value::Object(mut m)) => {
            let v = m.remove(key);
            if let Some(k) = m.keys().next() {
                return Err(RpcError::invalid_params(format!(
                    "unknown parameter {:?}: {}",
                    shorten(k),
                    usage()
                )));
            }
            v
        }
        Some(Value::Array(a)) if a.len() == 1 => a.into_iter().next(),
        _ => None,
    })
}

/// The `device` parameter: `{"device": "..."}` or `["..."]`; a string (path or slot) or
/// a non-negative integer (slot).
fn device_param(method: &str, params: Option<Value>) -> Result<String, RpcError> {
    let usage = || format!("{method} takes {{\"device\": \"<path or slot number>\"}}");
    let Some(v) = single_param(params, "device", &usage)? else {
        return Err(RpcError::invalid_params(format!(
            "missing device: {}",
            usage()
        )));
    };
    device_value(v, &usage)
}

/// A device value: a string (path or slot) or a non-negative integer (slot).
fn device_value(v: Value, usage: &dyn Fn() -> String) -> Result<String, RpcError> {
    match v {
        Value::String(s) if s.is_empty() => Err(RpcError::invalid_params(format!(
            "device is empty: {}",
            usage()
        ))),
        Value::String(s) if s.len() > MAX_DEVICE_BYTES || s.contains('\0') => {
            Err(RpcError::invalid_params(format!(
                "device is not a path: longer than {MAX_DEVICE_BYTES} bytes or contains NUL"
            )))
        }
        Value::String(s) => Ok(s),
        Value::Number(n) => match n.as_u64().and_then(|s| u16::try_from(s).ok()) {
            Some(slot) => Ok(slot.to_string()),
            None => Err(RpcError::invalid_params(format!(
                "device {n} is not a slot number (0..=65535)"
            ))),
        },
        _ => Err(RpcError::invalid_params(format!(
            "device must be a string or a slot number: {}",
            usage()
        ))),
    }
}

/// The parameters of `member_replace`: `{"old": ..., "new": ...}` or `[old, new]`; `old`
/// a path or slot, `new` a path.
fn replace_params(method: &str, params: Option<Value>) -> Result<(String, String), RpcError> {
    let usage =
        || format!("{method} takes {{\"old\": \"<path or slot number>\", \"new\": \"<path>\"}}");
    let (old, new) = match params {
        Some(Value::Object(mut m)) => {
            let (o, n) = (m.remove("old"), m.remove("new"));
            if let Some(k) = m.keys().next() {
                return Err(RpcError::invalid_params(format!(
                    "unknown parameter {:?}: {}",
                    shorten(k),
                    usage()
                )));
            }
            (o, n)
        }
        Some(Value::Array(a)) if a.len() == 2 => {
            let mut it = a.into_iter();
            (it.next(), it.next())
        }
        _ => (None, None),
    };
    let (Some(old), Some(new)) = (old, new) else {
        return Err(RpcError::invalid_params(format!(
            "missing old or new device: {}",
            usage()
        )));
    };
    let old = device_value(old, &usage)?;
    let new = match new {
        Value::String(_) => device_value(new, &usage)?,
        _ => {
            return Err(RpcError::invalid_params(format!(
                "new must be a device path: {}",
                usage()
            )))
        }
    };
    Ok((old, new))
}

/// The `kind` parameter of `process_start`: `{"kind": "check"}` or `["check"]`; one of
/// `check`, `repair`, `resync`.
fn kind_param(method: &str, params: Option<Value>) -> Result<ProcessKind, RpcError> {
    let usage = || format!("{method} takes {{\"kind\": \"check\" | \"repair\" | \"resync\"}}");
    let v = single_param(params, "kind", &usage)?;
    match v.as_ref().and_then(Value::as_str) {
        Some("check") => Ok(ProcessKind::Check),
        Some("repair") => Ok(ProcessKind::Repair),
        Some("resync") => Ok(ProcessKind::Resync),
        Some("rebuild") => Err(RpcError::invalid_params(
            "a rebuild starts by itself when a device is added to a degraded array (member_add)",
        )),
        Some("replace") => Err(RpcError::invalid_params(
            "a replace starts with member_replace (ferroraid replace OLD NEW)",
        )),
        Some(other) => Err(RpcError::invalid_params(format!(
            "unknown process kind {:?}: {}",
            shorten(other),
            usage()
        ))),
        None => Err(RpcError::invalid_params(format!(
            "missing kind: {}",
            usage()
        ))),
    }
}

/// The parameters of the `nvmf_portal_*` methods: `{"portal": "IP:PORT", "ana_state":
/// "..."}` or `["IP:PORT", "..."]`. `ana_state` is required when `need_state`, refused by
/// `nvmf_portal_remove`, optional for `nvmf_portal_add`.
fn portal_params(
    method: &str,
    params: Option<Value>,
    need_state: bool,
) -> Result<(String, Option<AnaState>), RpcError> {
    let takes_state = method != "nvmf_portal_remove";
    let usage = || {
        let st = "\"optimized\" | \"non_optimized\" | \"inaccessible\"";
        match (takes_state, need_state) {
            (false, _) => format!("{method} takes {{\"portal\": \"IP:PORT\"}}"),
            (true, true) => {
                format!("{method} takes {{\"portal\": \"IP:PORT\", \"ana_state\": {st}}}")
            }
            (true, false) => {
                format!("{method} takes {{\"portal\": \"IP:PORT\", \"ana_state\"?: {st}}}")
            }
        }
    };
    let (portal, state) = match params {
        Some(Value::Object(mut m)) => {
            let p = m.remove("portal");
            let st = if takes_state {
                m.remove("ana_state")
            } else {
                None
            };
            if let Some(k) = m.keys().next() {
                return Err(RpcError::invalid_params(format!(
                    "unknown parameter {:?}: {}",
                    shorten(k),
                    usage()
                )));
            }
            (p, st)
        }
        Some(Value::Array(a)) if a.len() <= 1 + usize::from(takes_state) => {
            let mut it = a.into_iter();
            (it.next(), it.next())
        }
        None => (None, None),
        Some(_) => return Err(RpcError::invalid_params(usage())),
    };
    let portal = match portal {
        Some(Value::String(p)) if !p.trim().is_empty() => p,
        Some(_) => {
            return Err(RpcError::invalid_params(format!(
                "portal must be an address string: {}",
                usage()
            )))
        }
        None => {
            return Err(RpcError::invalid_params(format!(
                "missing portal: {}",
                usage()
            )))
        }
    };
    let state = match state {
        None | Some(Value::Null) if need_state => {
            return Err(RpcError::invalid_params(format!(
                "missing ana_state: {}",
                usage()
            )))
        }
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match AnaState::from_name(&s) {
            Some(st) => Some(st),
            None => {
                return Err(RpcError::invalid_params(format!(
                    "unknown ANA state {:?}: {}",
                    shorten(&s),
                    usage()
                )))
            }
        },
        Some(_) => {
            return Err(RpcError::invalid_params(format!(
                "ana_state must be a string: {}",
                usage()
            )))
        }
    };
    Ok((portal, state))
}

/// Longest `listen` list of `export_add`.
const MAX_LISTEN: usize = 64;

/// A `protocol` value: `"nbd"`, `"iscsi"` or `"nvmf"`.
fn protocol_value(
    v: Option<Value>,
    usage: &dyn Fn() -> String,
) -> Result<ExportProtocol, RpcError> {
    match v {
        Some(Value::String(s)) => match s.as_str() {
            "nbd" => Ok(ExportProtocol::Nbd),
            "iscsi" => Ok(ExportProtocol::Iscsi),
            "nvmf" => Ok(ExportProtocol::Nvmf),
            _ => Err(RpcError::invalid_params(format!(
                "unknown protocol {:?}: {}",
                shorten(&s),
                usage()
            ))),
        },
        None | Some(Value::Null) => Err(RpcError::invalid_params(format!(
            "missing protocol: {}",
            usage()
        ))),
        Some(_) => Err(RpcError::invalid_params(format!(
            "protocol must be a string: {}",
            usage()
        ))),
    }
}

/// The parameters of `export_add`: `{"protocol": P, "listen": [ADDR, ...], "name"?: N}`
/// or `[P, [ADDR, ...], N?]`; each address `IP:PORT`, or `unix:PATH` for NBD; `name`
/// (NBD only) a non-empty string.
fn export_add_params(method: &str, params: Option<Value>) -> Result<ExportSpec, RpcError> {
    let usage = || {
        format!(
            "{method} takes {{\"protocol\": \"nbd\" | \"iscsi\" | \"nvmf\", \"listen\": \
             [\"IP:PORT\" | \"unix:PATH\", ...], \"name\"?: \"<NBD export name>\"}}"
        )
    };
    let (protocol, listen, name) = match params {
        Some(Value::Object(mut m)) => {
            let (p, l, n) = (m.remove("protocol"), m.remove("listen"), m.remove("name"));
            if let Some(k) = m.keys().next() {
                return Err(RpcError::invalid_params(format!(
                    "unknown parameter {:?}: {}",
                    shorten(k),
                    usage()
                )));
            }
            (p, l, n)
        }
        Some(Value::Array(a)) if a.len() <= 3 => {
            let mut it = a.into_iter();
            (it.next(), it.next(), it.next())
        }
        None => (None, None, None),
        Some(_) => return Err(RpcError::invalid_params(usage())),
    };
    let protocol = protocol_value(protocol, &usage)?;
    let mut spec = ExportSpec {
        protocol,
        tcp: Vec::new(),
        unix: Vec::new(),
        name: None,
    };
    let listen = match listen {
        Some(Value::Array(l)) if l.is_empty() => {
            return Err(RpcError::invalid_params(format!(
                "listen is empty: {}",
                usage()
            )))
        }
        Some(Value::Array(l)) if l.len() > MAX_LISTEN => {
            return Err(RpcError::invalid_params(format!(
                "listen has {} addresses: at most {MAX_LISTEN}",
                l.len()
            )))
        }
        Some(Value::Array(l)) => l,
        None | Some(Value::Null) => {
            return Err(RpcError::invalid_params(format!(
                "missing listen: {}",
                usage()
            )))
        }
        Some(_) => {
            return Err(RpcError::invalid_params(format!(
                "listen must be an array of address strings: {}",
                usage()
            )))
        }
    };
    for a in listen {
        let Value::String(a) = a else {
            return Err(RpcError::invalid_params(format!(
                "listen must be an array of address strings: {}",
                usage()
            )));
        };
        if a.len() > MAX_DEVICE_BYTES {
            return Err(RpcError::invalid_params(format!(
                "listen address longer than {MAX_DEVICE_BYTES} bytes"
            )));
        }
        spec.push_listen(&a)
            .map_err(|e| RpcError::invalid_params(format!("{e}: {}", usage())))?;
    }
    spec.name = match name {
        None | Some(Value::Null) => None,
        Some(Value::String(n)) => Some(n),
        Some(_) => {
            return Err(RpcError::invalid_params(format!(
                "name must be a string: {}",
                usage()
            )))
        }
    };
    spec.validate()
        .map_err(|e| RpcError::invalid_params(format!("{e}: {}", usage())))?;
    Ok(spec)
}

/// The parameter of `export_remove`: `{"protocol": P}` or `[P]`.
fn export_remove_params(method: &str, params: Option<Value>) -> Result<ExportProtocol, RpcError> {
    let usage = || format!("{method} takes {{\"protocol\": \"nbd\" | \"iscsi\" | \"nvmf\"}}");
    match params {
        None | Some(Value::Object(_)) => {}
        Some(Value::Array(ref a)) if a.len() == 1 => {}
        Some(_) => return Err(RpcError::invalid_params(usage())),
    }
    protocol_value(single_param(params, "protocol", &usage)?, &usage)
}

/// What [`read_bounded_line`] found.
#[derive(Debug, PartialEq, Eq)]
enum LineRead {
    /// A line (without its `\n`), or the last bytes before end of stream.
    Line,
    /// End of stream, nothing read.
    Eof,
    /// The line is longer than the limit (what was read of it is discarded).
    TooLong,
}

/// Reads one `\n`-terminated line into `line`, never holding more than `max` bytes.
fn read_bounded_line<R: BufRead>(
    r: &mut R,
    line: &mut Vec<u8>,
    max: usize,
) -> io::Result<LineRead> {
    line.clear();
    loop {
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(if line.is_empty() {
                LineRead::Eof
            } else {
                LineRead::Line
            });
        }
        match buf.iter().position(|&b| b == b'\n') {
            Some(i) => {
                if line.len() + i > max {
                    line.clear();
                    return Ok(LineRead::TooLong);
                }
                line.extend_from_slice(&buf[..i]);
                r.consume(i + 1);
                return Ok(LineRead::Line);
            }
            None => {
                let n = buf.len();
                if line.len() + n > max {
                    line.clear();
                    return Ok(LineRead::TooLong);
                }
                line.extend_from_slice(buf);
                r.consume(n);
            }
        }
    }
}

fn write_line(w: &mut impl Write, v: &Value) -> io::Result<()> {
    let mut bytes = serde_json::to_vec(v).map_err(io::Error::other)?;
    bytes.push(b'\n');
    w.write_all(&bytes)?;
    w.flush()
}

/// The default management socket path, by this rule (first that applies):
///
/// 1. running as root (effective uid 0) with `/run` writable:
///    [`SYSTEM_SOCKET_PATH`] (`/run/ferroraid/ferroraid.sock`);
/// 2. `$XDG_RUNTIME_DIR` set to an absolute path (the per-user runtime directory of the
///    XDG Base Directory specification, `/run/user/UID`): `$XDG_RUNTIME_DIR/ferroraid.sock`;
/// 3. else `./ferroraid.sock`, in the current directory.
///
/// Server and clients apply the same rule, so `ferroraid serve` and `ferroraid status`
/// run by the same user in the same place find each other; `--rpc PATH` overrides it.
pub fn default_rpc_path() -> PathBuf {
    let root = rustix::process::geteuid().is_root();
    let run_writable = root
        && rustix::fs::accessat(
            rustix::fs::CWD,
            "/run",
            rustix::fs::Access::WRITE_OK,
            rustix::fs::AtFlags::EACCESS,
        )
        .is_ok();
    default_rpc_path_from(run_writable, std::env::var_os("XDG_RUNTIME_DIR"))
}

/// [`default_rpc_path`]'s rule with its inputs given: `root_with_writable_run` (effective
/// uid 0 and `/run` writable) and the value of `XDG_RUNTIME_DIR`.
pub fn default_rpc_path_from(
    root_with_writable_run: bool,
    xdg_runtime_dir: Option<OsString>,
) -> PathBuf {
    if root_with_writable_run {
        return PathBuf::from(SYSTEM_SOCKET_PATH);
    }
    match xdg_runtime_dir.map(PathBuf::from) {
        // The XDG spec: relative paths are invalid and must be ignored.
        Some(dir) if dir.is_absolute() => dir.join(SOCKET_FILE_NAME),
        _ => Path::new(".").join(SOCKET_FILE_NAME),
    }
}

/// Why [`RpcServer::bind`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Another server answers on the socket.
    #[error(
        "a ferroraid target is already running at {} (stop it first, or give another socket \
         with --rpc PATH)", path.display()
    )]
    AlreadyRunning {
        /// The socket path.
        path: PathBuf,
    },
    /// Something that is not a socket is in the way; it is left alone.
    #[error("{} exists and is not a socket: refusing to replace it", path.display())]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// The operating system refused a step.
    #[error("{}: {what}: {source}", path.display())]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The step.
        what: &'static str,
        /// The error.
        source: io::Error,
    },
}

/// One connection being served: a handle on its stream (to shut it down) and its thread.
struct Conn {
    stream: UnixStream,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    handler: Arc<dyn Handler>,
    stopping: AtomicBool,
    conns: Mutex<HashMap<u64, Conn>>,
}

impl Shared {
    fn conns(&self) -> MutexGuard<'_, HashMap<u64, Conn>> {
        self.conns.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A running JSON-RPC server on a Unix socket ([module docs](self)). Stops, and removes
/// its socket, on [`RpcServer::shutdown`] or drop.
pub struct RpcServer {
    path: PathBuf,
    shared: Arc<Shared>,
    /// A second handle on the listening socket, to wake the accept thread.
    listener: UnixListener,
    accept: Option<JoinHandle<()>>,
    /// Device and inode of the socket file, so shutdown removes only its own.
    file_id: (u64, u64),
}

fn server_io<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(io::Error) -> ServerError + 'a {
    move |source| ServerError::Io {
        path: path.to_path_buf(),
        what,
        source,
    }
}

impl RpcServer {
    /// Creates the socket at `path` and serves `handler` on it, each connection on its
    /// own thread.
    ///
    /// - A missing parent directory is created with mode 0700 ([`SOCKET_DIR_MODE`]).
    /// - If `path` is a socket a live server answers on, nothing is touched
    ///   ([`ServerError::AlreadyRunning`]); a stale socket (nobody listening) is removed;
    ///   anything else at `path` is refused ([`ServerError::NotASocket`]).
    /// - The socket is bound, set to mode 0600 ([`SOCKET_MODE`]), and only then listens.
    ///
    /// # Errors
    /// As above, and [`ServerError::Io`] for a path too long for a Unix socket (107 bytes)
    /// and any refused step (directory creation, removal, socket, bind, chmod, listen).
    pub fn bind(
        path: impl AsRef<Path>,
        handler: Arc<dyn Handler>,
    ) -> Result<RpcServer, ServerError> {
        let path = path.as_ref().to_path_buf();
        let addr = SocketAddrUnix::new(&path)
            .map_err(|e| server_io(&path, "socket path (at most 107 bytes)")(e.into()))?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if !dir.exists() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(SOCKET_DIR_MODE)
                    .create(dir)
                    .map_err(server_io(&path, "create the socket's directory"))?;
            }
        }
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_socket() => match connect_fd(&addr, STALE_CHECK_TIMEOUT) {
                // Someone answers, or is listening with a full backlog: a live server.
                Ok(_) | Err(rustix::io::Errno::AGAIN) => {
                    return Err(ServerError::AlreadyRunning { path })
                }
                Err(rustix::io::Errno::CONNREFUSED) => {
                    tracing::info!(path = %path.display(), "removing stale RPC socket");
                    std::fs::remove_file(&path)
                        .map_err(server_io(&path, "remove the stale socket"))?;
                }
                Err(e) => {
                    return Err(server_io(
                        &path,
                        "check whether a target answers on the socket",
                    )(e.into()))
                }
            },
            Ok(_) => return Err(ServerError::NotASocket { path }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(server_io(&path, "inspect the socket path")(e)),
        }
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| server_io(&path, "create socket")(e.into()))?;
        match rustix::net::bind(&fd, &addr) {
            Ok(()) => {}
            // Another server bound it since we looked.
            Err(rustix::io::Errno::ADDRINUSE) => return Err(ServerError::AlreadyRunning { path }),
            Err(e) => return Err(server_io(&path, "bind")(e.into())),
        }
        // Not listening yet: nobody can connect before the mode is restrictive.
        let remove_on_err = |e: ServerError| {
            let _ = std::fs::remove_file(&path);
            e
        };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(SOCKET_MODE))
            .map_err(server_io(&path, "chmod 0600"))
            .map_err(remove_on_err)?;
        let meta = std::fs::symlink_metadata(&path)
            .map_err(server_io(&path, "stat the socket"))
            .map_err(remove_on_err)?;
        rustix::net::listen(&fd, LISTEN_BACKLOG)
            .map_err(|e| server_io(&path, "listen")(e.into()))
            .map_err(remove_on_err)?;
        let listener = UnixListener::from(fd);
        let waker = listener
            .try_clone()
            .map_err(server_io(&path, "duplicate the listening socket"))
            .map_err(remove_on_err)?;
        let shared = Arc::new(Shared {
            handler,
            stopping: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("ferroraid-rpc".into())
            .spawn(move || accept_loop(&listener, &s))
            .map_err(server_io(&path, "start the accept thread"))
            .map_err(remove_on_err)?;
        tracing::info!(path = %path.display(), "JSON-RPC management socket listening");
        Ok(RpcServer {
            path,
            shared,
            listener: waker,
            accept: Some(accept),
            file_id: (meta.dev(), meta.ino()),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops the server: no new connections, open ones closed (a handler call in progress
    /// finishes first; its answer may not be delivered), threads joined, and the socket
    /// file removed if it is still this server's. Idempotent; drop does it too.
    pub fn shutdown(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.shared.stopping.store(true, Ordering::Release);
        // Wake the accept thread: shutdown(2) makes a blocked accept fail on Linux; the
        // connection is the portable fallback.
        let _ = rustix::net::shutdown(&self.listener, rustix::net::Shutdown::Both);
        let _ = UnixStream::connect(&self.path);
        let _ = accept.join();
        let conns: Vec<Conn> = self.shared.conns().drain().map(|(_, c)| c).collect();
        for c in &conns {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
        for c in conns {
            if let Some(t) = c.thread {
                let _ = t.join();
            }
        }
        if let Ok(m) = std::fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == self.file_id {
                let _ = std::fs::remove_file(&self.path);
            }
        }
        tracing::info!(path = %self.path.display(), "JSON-RPC management socket closed");
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: &UnixListener, shared: &Arc<Shared>) {
    let mut next_id = 0u64;
    loop {
        let res = listener.accept();
        if shared.stopping.load(Ordering::Acquire) {
            return;
        }
        match res {
            Ok((stream, _)) => {
                next_id += 1;
                start_connection(shared, next_id, stream);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Out of file descriptors or memory: back off rather than spin.
                tracing::warn!(error = %e, "RPC accept failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn start_connection(shared: &Arc<Shared>, id: u64, stream: UnixStream) {
    let mut conns = shared.conns();
    if conns.len() >= MAX_CONNECTIONS {
        drop(conns);
        let mut stream = stream;
        let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
        let _ = write_line(
            &mut stream,
            &error_response(
                Value::Null,
                RpcError::new(
                    codes::SERVER_BUSY,
                    format!("server busy: {MAX_CONNECTIONS} connections open; try again"),
                ),
            ),
        );
        return;
    }
    let handle = match stream.try_clone() {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!(error = %e, "RPC connection dropped");
            return;
        }
    };
    conns.insert(
        id,
        Conn {
            stream: handle,
            thread: None,
        },
    );
    drop(conns);
    let s = shared.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("ferroraid-rpc-{id}"))
        .spawn(move || {
            serve_connection(&s, stream);
            s.conns().remove(&id);
        });
    match spawned {
        Ok(t) => {
            if let Some(c) = shared.conns().get_mut(&id) {
                c.thread = Some(t);
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot start an RPC connection thread");
            shared.conns().remove(&id);
        }
    }
}

fn serve_connection(shared: &Shared, stream: UnixStream) {
    let _ = stream.set_write_timeout(Some(SERVER_WRITE_TIMEOUT));
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::with_capacity(64 << 10, stream);
    let mut line = Vec::new();
    loop {
        match read_bounded_line(&mut reader, &mut line, MAX_REQUEST_BYTES) {
            Ok(LineRead::Line) => {}
            Ok(LineRead::Eof) | Err(_) => return,
            Ok(LineRead::TooLong) => {
                let e = RpcError::invalid_request(format!(
                    "request line longer than {MAX_REQUEST_BYTES} bytes; closing the connection"
                ));
                let _ = write_line(&mut writer, &error_response(Value::Null, e));
                return;
            }
        }
        if shared.stopping.load(Ordering::Acquire) {
            return;
        }
        let req = line.trim_ascii();
        if req.is_empty() {
            continue;
        }
        if let Some(resp) = handle_request(&*shared.handler, req) {
            if write_line(&mut writer, &resp).is_err() {
                return;
            }
        }
    }
}

/// A connected Unix stream socket to `addr`, waiting at most `timeout` while the
/// listener's backlog is full (a Unix `connect` honours `SO_SNDTIMEO`: `EAGAIN` when it
/// expires).
fn connect_fd(
    addr: &SocketAddrUnix,
    timeout: Duration,
) -> rustix::io::Result<std::os::fd::OwnedFd> {
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    rustix::net::sockopt::set_socket_timeout(
        &fd,
        rustix::net::sockopt::Timeout::Send,
        Some(timeout),
    )?;
    rustix::net::connect(&fd, addr)?;
    Ok(fd)
}

/// Why an [`RpcClient`] call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing listens at the path (no socket file, or a stale one).
    #[error(
        "no ferroraid target is running at {} ({source}); start one with `ferroraid serve`, \
         or give its socket with --rpc PATH", path.display()
    )]
    NotRunning {
        /// The socket path.
        path: PathBuf,
        /// What connect(2) said (no such file, connection refused).
        source: io::Error,
    },
    /// Connecting failed otherwise (permission denied: the socket is mode 0600, owned by
    /// the user running the target).
    #[error("cannot connect to the ferroraid target at {}: {source}", path.display())]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// No answer in time.
    #[error("the ferroraid target at {} did not answer within {timeout:?}", path.display())]
    Timeout {
        /// The socket path.
        path: PathBuf,
        /// The timeout.
        timeout: Duration,
    },
    /// Sending or receiving failed, or the server closed the connection without answering.
    #[error("talking to the ferroraid target at {}: {what}: {source}", path.display())]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The step.
        what: &'static str,
        /// The error.
        source: io::Error,
    },
    /// The answer is not a valid JSON-RPC 2.0 response to the request.
    #[error("the ferroraid target at {} sent an invalid answer: {detail}", path.display())]
    Protocol {
        /// The socket path.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// The server refused the request.
    #[error("{0}")]
    Rpc(RpcError),
}

impl ClientError {
    /// Whether the failure means no target is running at the path.
    pub fn is_not_running(&self) -> bool {
        matches!(self, ClientError::NotRunning { .. })
    }
}

/// A JSON-RPC client of a target's management socket: one connection, calls in turn.
pub struct RpcClient {
    path: PathBuf,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    timeout: Duration,
    next_id: u64,
    /// The array per-array methods name (`None`: the process's only array).
    array: Option<String>,
}

impl RpcClient {
    /// Names the array every later per-array request is for (the `array` parameter;
    /// `None`: the process's only array). Process methods (`array_*` but
    /// `array_status`, `rpc_methods`) are never given it.
    pub fn set_array(&mut self, array: Option<String>) {
        self.array = array;
    }

    /// Connects with [`DEFAULT_CLIENT_TIMEOUT`].
    ///
    /// # Errors
    /// As [`RpcClient::connect_timeout`].
    pub fn connect(path: impl AsRef<Path>) -> Result<RpcClient, ClientError> {
        Self::connect_timeout(path, DEFAULT_CLIENT_TIMEOUT)
    }

    /// Connects to the socket at `path`; `timeout` bounds the connection and each later
    /// send and answer.
    ///
    /// # Errors
    /// [`ClientError::NotRunning`] when no socket exists or nobody listens (ENOENT,
    /// ECONNREFUSED); [`ClientError::Timeout`] when the server's backlog stays full;
    /// [`ClientError::Connect`] otherwise (permission denied, path too long, ...).
    pub fn connect_timeout(
        path: impl AsRef<Path>,
        timeout: Duration,
    ) -> Result<RpcClient, ClientError> {
        use rustix::io::Errno;
        let path = path.as_ref().to_path_buf();
        let connect_err = |source: io::Error| ClientError::Connect {
            path: path.clone(),
            source,
        };
        let addr = SocketAddrUnix::new(&path).map_err(|e| {
            connect_err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("socket path longer than 107 bytes ({e})"),
            ))
        })?;
        let fd = match connect_fd(&addr, timeout) {
            Ok(fd) => fd,
            Err(e @ (Errno::NOENT | Errno::CONNREFUSED)) => {
                return Err(ClientError::NotRunning {
                    path,
                    source: e.into(),
                })
            }
            Err(Errno::AGAIN) => return Err(ClientError::Timeout { path, timeout }),
            Err(Errno::ACCESS) => {
                return Err(connect_err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "permission denied (the socket is mode 0600: run as the user who started \
                     the target)",
                )))
            }
            Err(e) => return Err(connect_err(e.into())),
        };
        let stream = UnixStream::from(fd);
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .map_err(connect_err)?;
        let writer = stream.try_clone().map_err(connect_err)?;
        Ok(RpcClient {
            path,
            reader: BufReader::new(stream),
            writer,
            timeout,
            next_id: 0,
            array: None,
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn io_err(&self, what: &'static str, source: io::Error) -> ClientError {
        if matches!(
            source.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            ClientError::Timeout {
                path: self.path.clone(),
                timeout: self.timeout,
            }
        } else {
            ClientError::Io {
                path: self.path.clone(),
                what,
                source,
            }
        }
    }

    fn protocol(&self, detail: impl Into<String>) -> ClientError {
        ClientError::Protocol {
            path: self.path.clone(),
            detail: detail.into(),
        }
    }

    /// The error a server sent before closing the connection, if it sent one.
    fn read_refusal(&mut self) -> Option<RpcError> {
        let mut line = Vec::new();
        match read_bounded_line(&mut self.reader, &mut line, MAX_RESPONSE_BYTES) {
            Ok(LineRead::Line) => {}
            _ => return None,
        }
        let Ok(Value::Object(mut obj)) = serde_json::from_slice::<Value>(&line) else {
            return None;
        };
        serde_json::from_value(obj.remove("error")?).ok()
    }

    /// Calls `method` with `params` (`Value::Null`: none) and returns its result.
    ///
    /// # Errors
    /// [`ClientError::Rpc`] with the server's error; [`ClientError::Timeout`],
    /// [`ClientError::Io`] (including a connection closed without an answer),
    /// [`ClientError::Protocol`] for an answer that is not a JSON-RPC 2.0 response to
    /// this request.
    pub fn call(&mut self, method: &str, mut params: Value) -> Result<Value, ClientError> {
        if let Some(a) = &self.array {
            if !PROCESS_METHODS.contains(&method) {
                match &mut params {
                    Value::Null => params = json!({ "array": a }),
                    Value::Object(m) => {
                        m.insert("array".into(), json!(a));
                    }
                    _ => {}
                }
            }
        }
        self.next_id += 1;
        let id = self.next_id;
        let mut req = json!({ "jsonrpc": "2.0", "method": method, "id": id });
        if !params.is_null() {
            req["params"] = params;
        }
        if let Err(e) = write_line(&mut self.writer, &req) {
            // A server that refused the connection (busy) said why before closing it:
            // report that rather than the broken pipe.
            if matches!(
                e.kind(),
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
            ) {
                if let Some(refusal) = self.read_refusal() {
                    return Err(ClientError::Rpc(refusal));
                }
            }
            return Err(self.io_err("send request", e));
        }
        let mut line = Vec::new();
        match read_bounded_line(&mut self.reader, &mut line, MAX_RESPONSE_BYTES) {
            Ok(LineRead::Line) => {}
            Ok(LineRead::Eof) => {
                return Err(self.io_err(
                    "read answer",
                    io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed without an answer",
                    ),
                ))
            }
            Ok(LineRead::TooLong) => {
                return Err(self.protocol(format!("answer longer than {MAX_RESPONSE_BYTES} bytes")))
            }
            Err(e) => return Err(self.io_err("read answer", e)),
        }
        let v: Value =
            serde_json::from_slice(&line).map_err(|e| self.protocol(format!("not JSON ({e})")))?;
        let Value::Object(mut obj) = v else {
            return Err(self.protocol("not a JSON object"));
        };
        if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
            return Err(self.protocol("\"jsonrpc\" is not \"2.0\""));
        }
        if let Some(err) = obj.remove("error") {
            // Errors the server could not tie to a request (parse errors, busy) have id null.
            let e: RpcError = serde_json::from_value(err)
                .map_err(|e| self.protocol(format!("malformed error object ({e})")))?;
            return Err(ClientError::Rpc(e));
        }
        if obj.get("id") != Some(&json!(id)) {
            return Err(self.protocol(format!(
                "answer for id {}, expected {id}",
                obj.get("id").unwrap_or(&Value::Null)
            )));
        }
        obj.remove("result")
            .ok_or_else(|| self.protocol("neither result nor error"))
    }

    fn call_as<T: serde::de::DeserializeOwned>(
        &mut self,
        method: &str,
        params: Value,
    ) -> Result<T, ClientError> {
        let v = self.call(method, params)?;
        serde_json::from_value(v)
            .map_err(|e| self.protocol(format!("unexpected {method} result ({e})")))
    }

    /// `array_status`.
    ///
    /// # Errors
    /// As [`RpcClient::call`].
    pub fn status(&mut self) -> Result<StatusReport, ClientError> {
        self.call_as("array_status", Value::Null)
    }

    /// `array_list`: every running array's status.
    ///
    /// # Errors
    /// As [`RpcClient::call`].
    pub fn array_list(&mut self) -> Result<Vec<StatusReport>, ClientError> {
        self.call_as("array_list", Value::Null)
    }

    /// `array_start`: assembles and starts an array; its status.
    ///
    /// # Errors
    /// As [`RpcClient::call`].
    pub fn array_start(&mut self, p: &ArrayStartParams) -> Result<StatusReport, ClientError> {
        let params = serde_json::to_value(p).map_err(|e| self.protocol(e.to_string()))?;
        self.call_as("array_start", params)
    }

    /// `array_stop`: stops the array `name`.
    ///
    /// # Errors
    /// As [`RpcClient::call`].
    pub fn array_stop(&mut self, name: &str) -> Result<ArrayStopReport, ClientError> {
        self.call_as("array_stop", json!({ "array": name }))
    }

    /// `array_create_progress`: the creates in progress.
    ///
    /// # Errors
    /// As [`RpcClient::call`].
    pub fn array_create_progress(&mut self) -> Result<Vec<CreateProgressReport>, ClientError> {
        self.call_as("array_create_progress", Value::Null)
    }

    /// `array_create`: creates (and unless told otherwise starts) an array.
    ///
    /// # Errors
    /// As [`RpcClient::call`].
    pub fn array_create(
        &mut self,
        p: &ArrayCreateParams,
    ) -> Result<ArrayCreateReport, ClientError> {
        let params = serde_json::to_value(p).map_err(|e| self.protocol(e.to_string()))?;
        self.call_as("array_create", params)
    }

    /// `member_fail` of `device` (a path or slot number).
    ///
    /// # Errors
    /// As [`RpcClient::call`]; the server's refusals ([`Handler::member_fail`]) as
    /// [`ClientError::Rpc`].
    pub fn member_fail(&mut self, device: &str) -> Result<MemberReport, ClientError> {
        self.call_as("member_fail", json!({ "device": device }))
    }

    /// `member_remove` of `device` (a path or slot number).
    ///
    /// # Errors
    /// As [`RpcClient::member_fail`].
    pub fn member_remove(&mut self, device: &str) -> Result<MemberReport, ClientError> {
        self.call_as("member_remove", json!({ "device": device }))
    }

    /// `member_add` of the device at `path`.
    ///
    /// # Errors
    /// As [`RpcClient::member_fail`].
    pub fn member_add(&mut self, path: &str) -> Result<MemberReport, ClientError> {
        self.call_as("member_add", json!({ "device": path }))
    }

    /// `member_replace` of `old` (a path or slot number) by the device at `new`.
    ///
    /// # Errors
    /// As [`RpcClient::call`]; the server's refusals ([`Handler::member_replace`]) as
    /// [`ClientError::Rpc`].
    pub fn member_replace(&mut self, old: &str, new: &str) -> Result<MemberReport, ClientError> {
        self.call_as("member_replace", json!({ "old": old, "new": new }))
    }

    /// `process_start` of `kind` (check, repair or resync).
    ///
    /// # Errors
    /// As [`RpcClient::call`]; the server's refusals ([`Handler::process_start`]) as
    /// [`ClientError::Rpc`].
    pub fn process_start(&mut self, kind: ProcessKind) -> Result<ProcessReport, ClientError> {
        self.call_as("process_start", json!({ "kind": kind }))
    }

    /// `process_stop`.
    ///
    /// # Errors
    /// As [`RpcClient::call`].
    pub fn process_stop(&mut self) -> Result<ProcessReport, ClientError> {
        self.call_as("process_stop", Value::Null)
    }

    /// `nvmf_portal_list`.
    ///
    /// # Errors
    /// As [`RpcClient::call`]; a target without NVMe/TCP as [`ClientError::Rpc`].
    pub fn nvmf_portal_list(&mut self) -> Result<PortalListReport, ClientError> {
        self.call_as("nvmf_portal_list", Value::Null)
    }

    /// `nvmf_portal_set_ana` of `portal` to `state`.
    ///
    /// # Errors
    /// As [`RpcClient::call`]; the server's refusals ([`Handler::nvmf_portal_set_ana`])
    /// as [`ClientError::Rpc`].
    pub fn nvmf_portal_set_ana(
        &mut self,
        portal: &str,
        state: AnaState,
    ) -> Result<PortalSetAnaReport, ClientError> {
        self.call_as(
            "nvmf_portal_set_ana",
            json!({ "portal": portal, "ana_state": state }),
        )
    }

    /// `nvmf_portal_remove` of `portal`.
    ///
    /// # Errors
    /// As [`RpcClient::nvmf_portal_set_ana`].
    pub fn nvmf_portal_remove(&mut self, portal: &str) -> Result<PortalRemoveReport, ClientError> {
        self.call_as("nvmf_portal_remove", json!({ "portal": portal }))
    }

    /// `nvmf_portal_add` of `portal`, in `state` (default optimized).
    ///
    /// # Errors
    /// As [`RpcClient::nvmf_portal_set_ana`].
    pub fn nvmf_portal_add(
        &mut self,
        portal: &str,
        state: Option<AnaState>,
    ) -> Result<PortalAddReport, ClientError> {
        let params = match state {
            Some(st) => json!({ "portal": portal, "ana_state": st }),
            None => json!({ "portal": portal }),
        };
        self.call_as("nvmf_portal_add", params)
    }

    /// `export_add` of `protocol` on `listen` (each `IP:PORT`, or `unix:PATH` for NBD),
    /// NBD export name `name` (default the array name).
    ///
    /// # Errors
    /// As [`RpcClient::call`]; the server's refusals ([`Handler::export_add`]) as
    /// [`ClientError::Rpc`].
    pub fn export_add(
        &mut self,
        protocol: ExportProtocol,
        listen: &[String],
        name: Option<&str>,
    ) -> Result<Vec<ExportReport>, ClientError> {
        let params = match name {
            Some(n) => json!({ "protocol": protocol, "listen": listen, "name": n }),
            None => json!({ "protocol": protocol, "listen": listen }),
        };
        self.call_as("export_add", params)
    }

    /// `export_remove` of `protocol`.
    ///
    /// # Errors
    /// As [`RpcClient::export_add`].
    pub fn export_remove(
        &mut self,
        protocol: ExportProtocol,
    ) -> Result<ExportRemoveReport, ClientError> {
        self.call_as("export_remove", json!({ "protocol": protocol }))
    }

    /// `export_list`.
    ///
    /// # Errors
    /// As [`RpcClient::call`].
    pub fn export_list(&mut self) -> Result<Vec<ExportReport>, ClientError> {
        self.call_as("export_list", Value::Null)
    }
}

#[cfg(test)]
pub(crate) mod tests;
