//! A `ferroraid` target run as an operator runs it, for the tests of the binary
//! (`tests/tests/target.rs`, `iscsi.rs`, ...): the one place that creates member files or
//! loop devices, runs `ferroraid create`, starts `ferroraid serve` as a process, waits
//! until it serves, fills it, and stops and cleans up.
//!
//! - [`TargetFixture::builder`] → [`TargetBuilder`]: level, member count and kind (sparse
//!   files or loop devices), member size, chunk, layout, consistency policy, internal
//!   bitmap, extra `serve` arguments, a JSON-RPC socket, an iSCSI portal, a shuffled device
//!   order, a fill with seeded random data; [`TargetBuilder::build`] gives a
//!   [`TargetFixture`] (temporary directory, [`Array`], running [`Server`], the data it
//!   holds) or `None` when a tool the test asked for is missing (said on stderr, unless
//!   `FERRORAID_REQUIRE_TOOLS`/`_LOOP` make that a failure).
//! - [`Server`]: one `ferroraid serve` (or `demo`) process: its NBD URIs, iSCSI portal and
//!   RPC socket, readiness (the NBD newstyle greeting, and the iSCSI port), clean stops
//!   (SIGTERM → exit 0 → "array stopped"), `kill -9`, the management CLI against it
//!   ([`Server::mgmt`], [`Server::status`], [`Server::wait_status`]); every failure message
//!   carries the server's stdout and stderr, and `Drop` kills it (so does
//!   `PR_SET_PDEATHSIG` if the test process dies).
//! - [`create`], [`member_files`], [`Array`] (the oracle's view of the members),
//!   [`examine`] (`mdadm --examine`), [`refused_serve`] (a start that must fail).
//!
//! Sizes are bytes throughout; ports are 127.0.0.1 TCP ports.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use crate::{
    attach_loop, first_difference, mdadm, required, run_tool, show_output, tool, LoopGuard, Oracle,
    Rng,
};

/// 1 KiB, bytes.
pub const KIB: u64 = 1 << 10;
/// 1 MiB, bytes.
pub const MIB: u64 = 1 << 20;
/// The chunk every fixture array uses unless told otherwise (64 KiB, mdadm's default
/// is 512 KiB), bytes.
pub const CHUNK: u64 = 64 * KIB;
/// Member files: mdadm's 1 MiB data offset for small devices, then 8 MiB of data (128
/// chunks), so a 6-member RAID6 or a 5-member RAID5 holds 32 MiB.
pub const MEMBER_BYTES: u64 = 9 * MIB;
pub const DATA_OFFSET: u64 = MIB;
/// Any one client command.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(120);
/// From spawning `ferroraid serve` to its NBD port answering.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// From SIGTERM to the exit.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// A start that must be refused: still running after this long counts as started.
pub const REFUSE_TIMEOUT: Duration = Duration::from_secs(20);
// ---------------------------------------------------------------------------------------
// The binary.
// ---------------------------------------------------------------------------------------

/// The `ferroraid` binary of this build ([`crate::ferroraid_bin`]).
pub fn ferroraid() -> &'static Path {
    crate::ferroraid_bin()
}

/// `ferroraid ARGS...` with the environment every run gets: plain logs at `info` (the
/// messages the tests look for), no colours.
pub fn ferroraid_cmd<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut c = Command::new(ferroraid());
    c.args(args).env("RUST_LOG", "info").env("NO_COLOR", "1");
    c
}

/// A 127.0.0.1 TCP port that was free a moment ago (bound to port 0, then closed), and
/// that no earlier call in this process returned: the kernel may hand the same ephemeral
/// port to two binds in a row once the first is closed, and a target given it twice (an
/// NBD and an NVMe/TCP listener, say) fails to start ("Address already in use").
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("binding 127.0.0.1:0")
            .port();
        if given.insert(port) {
            return port;
        }
    }
}

// ---------------------------------------------------------------------------------------
// A running target.
// ---------------------------------------------------------------------------------------

/// A `ferroraid serve` (or `demo`) process. `Drop` kills it if it is still running, and
/// prints its log when the test is failing.
pub struct Server {
    child: Option<Child>,
    /// Where its logs (and the clients' scratch files) go.
    pub dir: PathBuf,
    /// The name its log files and failure messages carry.
    pub label: String,
    stdout: PathBuf,
    stderr: PathBuf,
    /// The NBD export name (the array's name).
    pub export: String,
    /// The NBD TCP port on 127.0.0.1.
    pub port: u16,
    /// The NBD Unix socket, when it listens on one.
    pub socket: Option<PathBuf>,
    /// The JSON-RPC management socket (`--rpc PATH` among its arguments), if any.
    pub rpc: Option<PathBuf>,
    /// The iSCSI port on 127.0.0.1 (`--iscsi 127.0.0.1:PORT` among its arguments), if any.
    pub iscsi_port: Option<u16>,
    status: Option<ExitStatus>,
}

impl Server {
    /// Spawns `ferroraid ARGS...` (logs in `dir/LABEL.{out,err}`) and waits until its NBD
    /// port greets a client.
    pub fn spawn(
        dir: &Path,
        label: &str,
        args: &[OsString],
        export: &str,
        port: u16,
        socket: Option<PathBuf>,
    ) -> Server {
        let mut s = Self::spawn_unready(dir, label, args, export, port, socket);
        s.wait_ready();
        s
    }

    /// Spawns `ferroraid ARGS...` without waiting for it to serve.
    pub fn spawn_unready(
        dir: &Path,
        label: &str,
        args: &[OsString],
        export: &str,
        port: u16,
        socket: Option<PathBuf>,
    ) -> Server {
        Self::launch(dir, label, ferroraid_cmd(args), args, export, port, socket)
    }

    /// Spawns `cmd` (a [`ferroraid_cmd`] of `args`, with whatever the caller added: an
    /// environment variable, say) without waiting for it to serve. `args` are searched
    /// for `--rpc PATH` and `--iscsi 127.0.0.1:PORT`, which [`Server::rpc`] and
    /// [`Server::iscsi_port`] then name.
    pub fn launch(
        dir: &Path,
        label: &str,
        mut cmd: Command,
        args: &[OsString],
        export: &str,
        port: u16,
        socket: Option<PathBuf>,
    ) -> Server {
        let stdout = dir.join(format!("{label}.out"));
        let stderr = dir.join(format!("{label}.err"));
        // SAFETY: prctl is async-signal-safe; the closure touches nothing else. The server
        // dies with the test (even a test killed from outside): no process is left behind.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(fs::File::create(&stdout).expect("creating the server's stdout file"))
            .stderr(fs::File::create(&stderr).expect("creating the server's stderr file"))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", ferroraid().display()));
        let after = |flag: &str| args.windows(2).find(|w| w[0] == flag).map(|w| w[1].clone());
        let iscsi_port = after("--iscsi").map(|a| {
            let a = a.to_string_lossy().into_owned();
            a.rsplit_once(':')
                .and_then(|(_, p)| p.parse().ok())
                .unwrap_or_else(|| panic!("--iscsi {a}: the fixture serves iSCSI on HOST:PORT"))
        });
        Server {
            child: Some(child),
            dir: dir.to_path_buf(),
            label: label.to_string(),
            stdout,
            stderr,
            export: export.to_string(),
            port,
            socket,
            rpc: after("--rpc").map(PathBuf::from),
            iscsi_port,
            status: None,
        }
    }

    /// `ferroraid serve --adaptive --nbd 127.0.0.1:PORT --nbd unix:DIR/LABEL.sock EXTRA...
    /// DEVICES...`, ready.
    pub fn serve(
        dir: &Path,
        label: &str,
        export: &str,
        devices: &[PathBuf],
        extra: &[&str],
    ) -> Self {
        let port = free_port();
        let socket = dir.join(format!("{label}.sock"));
        let mut args: Vec<OsString> = vec!["serve".into(), "--adaptive".into()];
        args.push("--nbd".into());
        args.push(format!("127.0.0.1:{port}").into());
        args.push("--nbd".into());
        args.push(format!("unix:{}", socket.display()).into());
        args.extend(extra.iter().map(OsString::from));
        args.extend(devices.iter().map(|d| d.as_os_str().to_owned()));
        Self::spawn(dir, label, &args, export, port, Some(socket))
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn out(&self) -> String {
        fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    /// Both logs, for failure messages.
    pub fn logs(&self) -> String {
        format!(
            "--- ferroraid ({}) stdout ---\n{}\n--- ferroraid ({}) stderr ---\n{}",
            self.label,
            self.out().trim_end(),
            self.label,
            self.log().trim_end()
        )
    }

    /// Polls until the NBD port sends the newstyle greeting (and the iSCSI port, if any,
    /// accepts a connection). Fails (with the logs) if the
    /// process exits first or `START_TIMEOUT` passes.
    pub fn wait_ready(&mut self) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(st) = self.try_wait() {
                panic!(
                    "ferroraid ({}) exited with {st} before serving:\n{}",
                    self.label,
                    self.logs()
                );
            }
            let iscsi_up = self
                .iscsi_port
                .is_none_or(|p| TcpStream::connect(("127.0.0.1", p)).is_ok());
            if self.greets() && iscsi_up {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "ferroraid ({}) did not answer on 127.0.0.1:{} (NBD) and {:?} (iSCSI) within \
                 {START_TIMEOUT:?}:\n{}",
                self.label,
                self.port,
                self.iscsi_port,
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether 127.0.0.1:PORT answers with the fixed-newstyle greeting (`NBDMAGIC`
    /// `IHAVEOPT`); then the probe leaves politely (`NBD_OPT_ABORT`, and waits for the
    /// server's answer or close).
    pub fn greets(&self) -> bool {
        let addr = ("127.0.0.1", self.port);
        let Ok(mut s) = TcpStream::connect(addr) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let mut g = [0u8; 18];
        if s.read_exact(&mut g).is_err() || &g[..16] != b"NBDMAGICIHAVEOPT" {
            return false;
        }
        // Client flags FIXED_NEWSTYLE | NO_ZEROES, then option 2 (ABORT) with no data.
        let mut abort = Vec::from(3u32.to_be_bytes());
        abort.extend_from_slice(b"IHAVEOPT");
        abort.extend_from_slice(&2u32.to_be_bytes());
        abort.extend_from_slice(&0u32.to_be_bytes());
        if s.write_all(&abort).is_ok() {
            let mut reply = [0u8; 20];
            let _ = s.read(&mut reply);
        }
        true
    }

    /// Waits until stdout contains `needle` (what the process prints after it listens);
    /// fails with the logs after `START_TIMEOUT`.
    pub fn wait_out(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let out = self.out();
            if out.contains(needle) {
                return out;
            }
            assert!(
                Instant::now() < deadline && self.try_wait().is_none(),
                "ferroraid ({}) never printed {needle:?}:\n{}",
                self.label,
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            if let Some(c) = self.child.as_mut() {
                self.status = c.try_wait().expect("waiting for ferroraid");
            }
        }
        self.status
    }

    /// Waits up to `timeout` for the process to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait() {
                return Some(s);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) takes plain integers; the pid is our own child's, not yet reaped.
        let rc = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(rc, 0, "kill({}, {sig}) failed", self.pid());
    }

    /// SIGTERM (or SIGINT), and the exit status, which must come within `STOP_TIMEOUT`.
    pub fn stop_with(&mut self, sig: i32) -> ExitStatus {
        if let Some(s) = self.try_wait() {
            panic!(
                "ferroraid ({}) had already exited ({s}) when asked to stop:\n{}",
                self.label,
                self.logs()
            );
        }
        self.signal(sig);
        match self.wait_exit(STOP_TIMEOUT) {
            Some(s) => s,
            None => {
                let logs = self.logs();
                self.kill9();
                panic!(
                    "ferroraid ({}) did not exit within {STOP_TIMEOUT:?} of signal {sig}:\n{logs}",
                    self.label
                );
            }
        }
    }

    /// SIGTERM; the exit status must be 0.
    pub fn stop(&mut self) {
        let st = self.stop_with(libc::SIGTERM);
        assert!(
            st.success(),
            "ferroraid ({}) exited with {st} after SIGTERM:\n{}",
            self.label,
            self.logs()
        );
        let log = self.log();
        assert!(
            log.contains("array stopped"),
            "no 'array stopped' after SIGTERM:\n{}",
            self.logs()
        );
    }

    /// SIGKILL, and reap it.
    pub fn kill9(&mut self) {
        if let Some(c) = self.child.as_mut() {
            if self.status.is_none() {
                let _ = c.kill();
                self.status = c.wait().ok();
            }
        }
    }

    pub fn uri(&self) -> String {
        format!("nbd://127.0.0.1:{}/{}", self.port, self.export)
    }

    pub fn unix_uri(&self) -> String {
        let sock = self.socket.as_ref().expect("this server has a Unix socket");
        format!("nbd+unix:///{}?socket={}", self.export, sock.display())
    }

    /// Runs a client; on failure the message carries the client's and the server's output.
    pub fn client_ok(&self, cmd: &mut Command, dir: &Path) -> String {
        let shown = format!("{cmd:?}");
        let out = run_tool(cmd, dir, TOOL_TIMEOUT);
        assert!(
            out.status.success(),
            "{shown} failed: {}\n{}",
            show_output(&out),
            self.logs()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The iSCSI portal, `iscsi://127.0.0.1:PORT`.
    ///
    /// # Panics
    /// The server was started without `--iscsi`.
    pub fn iscsi_portal(&self) -> String {
        let port = self.iscsi_port.expect("this server has no iSCSI portal");
        format!("iscsi://127.0.0.1:{port}")
    }

    /// LUN 0 of the array's iSCSI target, `iscsi://127.0.0.1:PORT/IQN/0` (the target is
    /// `iqn.2026-11.org.ferroraid:<array name>`).
    pub fn iscsi_url(&self) -> String {
        format!("{}/{}/0", self.iscsi_portal(), self.iscsi_target())
    }

    /// The iSCSI target name `serve` gives the array.
    pub fn iscsi_target(&self) -> String {
        format!("iqn.2026-11.org.ferroraid:{}", self.export)
    }

    /// The JSON-RPC socket path as an argument.
    ///
    /// # Panics
    /// The server was started without `--rpc`.
    pub fn rpc_arg(&self) -> String {
        let rpc = self.rpc.as_ref().expect("this server has no --rpc socket");
        rpc.display().to_string()
    }

    /// `ferroraid status --json --rpc SOCK`: the parsed report and the exit status. The
    /// socket answers once the array is assembled, so "not running" (exit 4) is retried
    /// for up to 10 s.
    pub fn status(&self) -> (serde_json::Value, Option<i32>) {
        let rpc = self.rpc_arg();
        let deadline = Instant::now() + Duration::from_secs(10);
        let out = loop {
            let out = run_tool(
                &mut ferroraid_cmd(["status", "--json", "--rpc", &rpc]),
                &self.dir,
                TOOL_TIMEOUT,
            );
            if out.status.code() != Some(4) || Instant::now() > deadline {
                break out;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "status --json is not JSON ({e}): {}\n{}",
                show_output(&out),
                self.logs()
            )
        });
        (v, out.status.code())
    }

    /// Runs `ferroraid ARGS... --rpc SOCK` against this server and asserts its exit
    /// status; returns its stdout and stderr together.
    pub fn mgmt(&self, args: &[&OsStr], code: i32) -> String {
        let mut cmd = ferroraid_cmd(args);
        cmd.args(["--rpc", &self.rpc_arg()]);
        let shown = format!("{cmd:?}");
        let out = run_tool(&mut cmd, &self.dir, TOOL_TIMEOUT);
        assert_eq!(
            out.status.code(),
            Some(code),
            "{shown}: {}\n{}",
            show_output(&out),
            self.logs()
        );
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// Polls `status --json` until `done` holds for the report and exit status (at most
    /// `TOOL_TIMEOUT`); returns that report. Fails naming `what`, with the logs.
    pub fn wait_status(
        &self,
        what: &str,
        mut done: impl FnMut(&serde_json::Value, Option<i32>) -> bool,
    ) -> serde_json::Value {
        let deadline = Instant::now() + TOOL_TIMEOUT;
        loop {
            let (st, code) = self.status();
            if done(&st, code) {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: never happened: {st}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the members have taken `n` writes between them (a client's writes are
    /// reaching them).
    pub fn wait_member_writes(&self, n: u64) {
        self.wait_status("writes reaching the members", |st, _| {
            let writes: u64 = st["members"]
                .as_array()
                .map(|ms| ms.iter().filter_map(|m| m["io"]["writes"].as_u64()).sum())
                .unwrap_or(0);
            writes >= n
        });
    }

    /// Waits (at most 10 s: the monitor logs within a turn or two) until stderr holds
    /// `needle`; returns stderr.
    pub fn wait_log(&self, needle: &str) -> String {
        self.wait_log_for(needle, Duration::from_secs(10))
    }

    /// Waits at most `timeout` until stderr holds `needle` (a background process
    /// finishing, say); returns stderr. Fails with the logs.
    pub fn wait_log_for(&self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.log();
            if log.contains(needle) {
                return log;
            }
            assert!(
                Instant::now() < deadline,
                "no {needle:?} in the log within {timeout:?}:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Writes the file `data_file` from the start of the export with nbdcopy (TCP), and
    /// flushes.
    pub fn fill(&self, nbdcopy: &Path, data_file: &Path) {
        self.client_ok(
            Command::new(nbdcopy)
                .arg("--flush")
                .arg(data_file)
                .arg(self.uri()),
            &self.dir,
        );
    }

    /// The whole export, read with nbdcopy (over the Unix socket).
    pub fn read_all(&self, nbdcopy: &Path) -> Vec<u8> {
        let out = self.dir.join(format!("{}-read.img", self.label));
        self.client_ok(
            Command::new(nbdcopy).arg(self.unix_uri()).arg(&out),
            &self.dir,
        );
        let v = fs::read(&out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
        let _ = fs::remove_file(&out);
        v
    }

    /// `qemu-io -f raw -c CMD... URI` (TCP) that must succeed; returns its stdout.
    pub fn qemu_io(&self, qemu_io: &Path, cmds: &[&str]) -> String {
        let mut c = Command::new(qemu_io);
        c.args(["-f", "raw"]);
        for x in cmds {
            c.args(["-c", x]);
        }
        let out = self.client_ok(c.arg(self.uri()), &self.dir);
        assert!(
            !out.contains("Pattern verification failed"),
            "qemu-io {cmds:?}:\n{out}\n{}",
            self.logs()
        );
        out
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let running = self.status.is_none();
        self.kill9();
        if std::thread::panicking() {
            eprintln!(
                "{}{}",
                if running {
                    "(killed at the end of the failed test)\n"
                } else {
                    ""
                },
                self.logs()
            );
        }
    }
}

/// Runs `ferroraid ARGS...`, which must fail: returns its stderr.
pub fn refused(dir: &Path, what: &str, args: &[OsString]) -> String {
    let mut cmd = ferroraid_cmd(args);
    let out = run_tool(&mut cmd, dir, REFUSE_TIMEOUT);
    assert!(
        !out.status.success(),
        "{what}: ferroraid {args:?} should have refused, but exited 0: {}",
        show_output(&out)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `ferroraid serve --adaptive --nbd 127.0.0.1:PORT EXTRA... DEVICES...`, which must refuse
/// to start: exit non-zero without ever serving. Returns its stderr.
pub fn refused_serve(dir: &Path, what: &str, devices: &[PathBuf], extra: &[&str]) -> String {
    let port = free_port();
    let mut args: Vec<OsString> = vec!["serve".into(), "--adaptive".into(), "--nbd".into()];
    args.push(format!("127.0.0.1:{port}").into());
    args.extend(extra.iter().map(OsString::from));
    args.extend(devices.iter().map(|d| d.as_os_str().to_owned()));
    let label = format!(
        "refused-{}",
        what.replace(|c: char| !c.is_alphanumeric(), "-")
    );
    let mut srv = Server::spawn_unready(dir, &label, &args, "", port, None);
    let deadline = Instant::now() + REFUSE_TIMEOUT;
    loop {
        if let Some(st) = srv.try_wait() {
            assert!(
                !st.success(),
                "{what}: ferroraid serve {devices:?} {extra:?} should have refused, but exited 0:\n{}",
                srv.logs()
            );
            return srv.log();
        }
        assert!(
            !srv.greets(),
            "{what}: ferroraid serve {devices:?} {extra:?} started serving instead of refusing:\n{}",
            srv.logs()
        );
        assert!(
            Instant::now() < deadline,
            "{what}: ferroraid serve neither refused nor served within {REFUSE_TIMEOUT:?}:\n{}",
            srv.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------------------------------
// Arrays.
// ---------------------------------------------------------------------------------------

/// An array made by `ferroraid create`.
#[derive(Clone, Debug)]
pub struct Array {
    pub level: u8,
    pub layout: &'static str,
    /// Chunk size, bytes.
    pub chunk: u64,
    pub name: String,
    /// Member devices in role order.
    pub members: Vec<PathBuf>,
    /// What the oracle reads for each role (the backing files of loop devices).
    pub images: Vec<PathBuf>,
    /// Capacity, bytes (from create's output).
    pub size: u64,
    pub data_offset: u64,
}

/// `n` sparse member files `dir/PREFIXi.img` of `bytes` bytes each.
pub fn member_files(dir: &Path, prefix: &str, n: usize, bytes: u64) -> Vec<PathBuf> {
    (0..n)
        .map(|i| {
            let p = dir.join(format!("{prefix}{i}.img"));
            fs::File::create(&p)
                .and_then(|f| f.set_len(bytes))
                .unwrap_or_else(|e| panic!("creating {}: {e}", p.display()));
            p
        })
        .collect()
}

pub fn data_chunks(level: u8, members: usize) -> u64 {
    members as u64 - if level == 6 { 2 } else { 1 }
}

/// `ferroraid create --level L --chunk 64K --layout X --name N MEMBERS...`; checks the
/// reported capacity and data offset.
pub fn create(
    dir: &Path,
    level: u8,
    layout: &'static str,
    name: &str,
    members: &[PathBuf],
) -> Array {
    create_with(dir, level, layout, name, members, CHUNK, &[]).0
}

/// `ferroraid create --level L --chunk CHUNK --layout X --name N EXTRA... MEMBERS...`
/// (`chunk` in bytes; `extra`: `--consistency-policy ppl`, `--bitmap internal`, ...).
/// Checks that it says what it created, and for member files without `extra` the data
/// offset (1 MiB, as mdadm's for small devices) and the capacity (whole chunks of each
/// member's data area × data members). Returns the array and create's stdout.
pub fn create_with(
    dir: &Path,
    level: u8,
    layout: &'static str,
    name: &str,
    members: &[PathBuf],
    chunk: u64,
    extra: &[&str],
) -> (Array, String) {
    let mut cmd = ferroraid_cmd(["create", "--level", &level.to_string(), "--chunk"]);
    cmd.arg(format!("{}K", chunk / KIB))
        .args(["--layout", layout, "--name", name])
        .args(extra)
        .args(members);
    let shown = format!("{cmd:?}");
    let out = run_tool(&mut cmd, dir, TOOL_TIMEOUT);
    assert!(out.status.success(), "{shown}: {}", show_output(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    // "created raid6 left-symmetric array "x" (UUID ...): 6 members, chunk 65536 bytes,
    // 33554432 bytes, data offset 1048576 bytes"
    let mut size = None;
    let mut data_offset = None;
    for part in text.trim().split(", ") {
        if let Some(v) = part.strip_prefix("data offset ") {
            data_offset = v.split_whitespace().next().and_then(|v| v.parse().ok());
        } else if let Some(v) = part.strip_suffix(" bytes") {
            if let Ok(v) = v.parse::<u64>() {
                size = Some(v);
            }
        }
    }
    let (Some(size), Some(data_offset)) = (size, data_offset) else {
        panic!("{shown}: no capacity/data offset in its output: {text}");
    };
    assert!(
        text.starts_with(&format!("created raid{level} {layout} array \"{name}\"")),
        "{text}"
    );
    let member_bytes = fs::metadata(&members[0]).map(|m| m.len()).unwrap_or(0);
    if member_bytes > 0 && extra.is_empty() {
        // Files of a plain array (a PPL or a bitmap moves the data offset): the capacity
        // follows from the data offset and the member size.
        assert_eq!(data_offset, DATA_OFFSET, "{text}");
        assert_eq!(
            size,
            (member_bytes - data_offset) / chunk * chunk * data_chunks(level, members.len()),
            "{text}"
        );
    }
    let array = Array {
        level,
        layout,
        chunk,
        name: name.to_string(),
        members: members.to_vec(),
        images: members.to_vec(),
        size,
        data_offset,
    };
    (array, text)
}

impl Array {
    pub fn oracle_args(&self, command: &str, images: &[String], extra: &[String]) -> Vec<String> {
        let mut a = vec![command.to_string()];
        a.extend(images.iter().cloned());
        for (k, v) in [
            ("--level", self.level.to_string()),
            ("--layout", self.layout.to_string()),
            ("--chunk", self.chunk.to_string()),
            ("--data-offset", self.data_offset.to_string()),
        ] {
            a.push(k.to_string());
            a.push(v);
        }
        a.extend(extra.iter().cloned());
        a
    }

    pub fn image_args(&self, missing: &[usize]) -> Vec<String> {
        self.images
            .iter()
            .enumerate()
            .map(|(i, p)| {
                if missing.contains(&i) {
                    "missing".to_string()
                } else {
                    p.display().to_string()
                }
            })
            .collect()
    }

    /// The oracle, or `None` after saying on stderr that the running test skips its oracle
    /// checks of this array.
    pub fn oracle(&self) -> Option<Oracle> {
        let test = std::thread::current().name().unwrap_or("target").to_owned();
        Oracle::locate_or_skip(&format!("{test} (array {})", self.name))
    }

    /// The oracle checks P (and Q) of the first `stripes` stripes (all by default); nothing
    /// to do without the oracle.
    pub fn oracle_verify(&self, stripes: Option<u64>) {
        let Some(oracle) = self.oracle() else {
            return;
        };
        let extra: Vec<String> = stripes
            .map(|s| vec!["--stripes".to_string(), s.to_string()])
            .unwrap_or_default();
        let out = oracle
            .run_ok(self.oracle_args("verify", &self.image_args(&[]), &extra))
            .unwrap_or_else(|e| panic!("{}: {e}", self.name));
        assert!(out.contains("mismatches 0"), "{}: {out}", self.name);
    }

    /// The logical image the oracle reads from the members (`missing` roles rebuilt), or
    /// `None` without the oracle.
    pub fn oracle_extract(&self, dir: &Path, missing: &[usize]) -> Option<Vec<u8>> {
        let oracle = self.oracle()?;
        let out = dir.join(format!("{}-extract.img", self.name));
        let extra = ["--out".to_string(), out.display().to_string()];
        oracle
            .run_ok(self.oracle_args("extract", &self.image_args(missing), &extra))
            .unwrap_or_else(|e| panic!("{}: {e}", self.name));
        let mut v = fs::read(&out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
        let _ = fs::remove_file(&out);
        v.truncate(self.size as usize);
        Some(v)
    }
}

/// `items` in a seeded random order that differs from the given one.
pub fn shuffled<T: Clone + PartialEq>(items: &[T], seed: u64) -> Vec<T> {
    let mut v = items.to_vec();
    let mut rng = Rng::new(seed);
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i as u64 + 1) as usize);
    }
    if v.len() > 1 && v == items {
        v.rotate_left(1);
    }
    v
}

pub fn random_file(path: &Path, len: u64, seed: u64) -> Vec<u8> {
    let data = Rng::new(seed).bytes(len as usize);
    fs::write(path, &data).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    data
}

pub fn assert_same(what: &str, got: &[u8], want: &[u8]) {
    if let Some(d) = first_difference(got, want) {
        panic!("{what}: {d}");
    }
}

/// `mdadm --examine` of every member: `State : {state}`, the checksum correct, and (if
/// given) `Events : {events}`. Returns each member's events.
pub fn examine(dir: &Path, members: &[PathBuf], state: &str, events: Option<u64>) -> Vec<u64> {
    let Some(mdadm) = mdadm() else {
        return Vec::new();
    };
    members
        .iter()
        .map(|m| {
            let out = run_tool(
                Command::new(&mdadm).arg("--examine").arg(m),
                dir,
                TOOL_TIMEOUT,
            );
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let ctx = format!("mdadm --examine {}", m.display());
            assert!(out.status.success(), "{ctx}: {}", show_output(&out));
            let field = |k: &str| -> String {
                text.lines()
                    .map(str::trim)
                    .find_map(|l| l.strip_prefix(k).map(|v| v.trim().to_string()))
                    .unwrap_or_else(|| panic!("{ctx}: no {k:?} in\n{text}"))
            };
            assert_eq!(field("State :"), state, "{ctx}:\n{text}");
            assert!(
                field("Checksum :").ends_with("- correct"),
                "{ctx}: checksum not correct:\n{text}"
            );
            let ev: u64 = field("Events :").parse().expect("Events is a number");
            if let Some(e) = events {
                assert_eq!(ev, e, "{ctx}: events\n{text}");
            }
            ev
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// 1. Member files, every client.
// ---------------------------------------------------------------------------------------

/// fio with its nbd engine, or `None` (said why).
///
/// # Panics
/// fio is missing or has no nbd engine and `FERRORAID_REQUIRE_TOOLS=1`.
pub fn fio_with_nbd() -> Option<PathBuf> {
    let fio = tool("fio")?;
    let ok = Command::new(&fio)
        .arg("--enghelp=nbd")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            !required("FERRORAID_REQUIRE_TOOLS"),
            "fio has no nbd engine and FERRORAID_REQUIRE_TOOLS=1"
        );
        eprintln!("SKIPPED: fio was built without the nbd engine");
        return None;
    }
    Some(fio)
}

/// Waits up to `timeout` for a client to exit; kills it and fails after that.
pub fn wait_child(c: &mut Child, timeout: Duration) -> ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = c.try_wait().expect("waiting for a client") {
            return s;
        }
        if Instant::now() > deadline {
            let _ = c.kill();
            let _ = c.wait();
            panic!("a client did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits for a child with piped output (at most `TOOL_TIMEOUT`).
pub fn wait_child_output(c: &mut Child) -> Output {
    wait_child(c, TOOL_TIMEOUT);
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    if let Some(mut s) = c.stdout.take() {
        s.read_to_end(&mut stdout)
            .expect("reading the client's stdout");
    }
    if let Some(mut s) = c.stderr.take() {
        s.read_to_end(&mut stderr)
            .expect("reading the client's stderr");
    }
    Output {
        status: c.try_wait().ok().flatten().expect("exited"),
        stdout,
        stderr,
    }
}

/// `mdadm --examine DEV`'s text (empty without mdadm).
pub fn mdadm_examine(dir: &Path, dev: &Path) -> String {
    let Some(mdadm) = mdadm() else {
        return String::new();
    };
    let out = run_tool(
        Command::new(&mdadm).arg("--examine").arg(dev),
        dir,
        TOOL_TIMEOUT,
    );
    assert!(out.status.success(), "{}", show_output(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The value of `key` in an `mdadm --examine` text (`Recovery Offset : 123 sectors` → 123).
pub fn examine_number(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.trim().strip_prefix(key))
        .and_then(|v| v.trim_start_matches([' ', ':']).split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The member entries of a `status --json` report whose state is `state`.
pub fn members_in(st: &serde_json::Value, state: &str) -> Vec<serde_json::Value> {
    st["members"]
        .as_array()
        .map(|ms| ms.iter().filter(|m| m["state"] == state).cloned().collect())
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------
// The fixture.
// ---------------------------------------------------------------------------------------

/// What members the fixture makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemberKind {
    /// Sparse files `DIR/PREFIXi.img`.
    Files,
    /// Loop devices over sparse files `DIR/backingi.img` (root and losetup; the oracle
    /// reads the backing files).
    Loop,
}

/// How to build a [`TargetFixture`]; from [`TargetFixture::builder`].
#[derive(Clone, Debug)]
pub struct TargetBuilder {
    level: u8,
    members: usize,
    kind: MemberKind,
    member_bytes: u64,
    prefix: String,
    layout: &'static str,
    name: Option<String>,
    chunk: u64,
    create_args: Vec<String>,
    serve_args: Vec<String>,
    rpc: bool,
    iscsi: bool,
    shuffle: Option<u64>,
    fill: Option<u64>,
    label: String,
    serve: bool,
    stop_after_fill: bool,
}

/// A created array in its own temporary directory, served by a running `ferroraid
/// serve` (unless built with [`TargetBuilder::no_serve`] or stopped), optionally filled
/// with seeded random data. Dropping it kills the server first, then detaches the loop
/// devices, then removes the directory.
pub struct TargetFixture {
    /// The running server, if any ([`TargetFixture::srv`]).
    pub server: Option<Server>,
    /// The array: members in role order, what the oracle reads, capacity.
    pub array: Array,
    /// What the array holds as far as the fixture knows: zeroes after create (create
    /// zeroes the data area), the fill data after a fill; `array.size` bytes.
    pub data: Vec<u8>,
    /// `ferroraid create`'s stdout.
    pub created: String,
    /// nbdcopy, when the fixture was built with a fill.
    pub nbdcopy: Option<PathBuf>,
    /// After `server`: the devices are detached only once the server let go of them.
    _loops: Vec<LoopGuard>,
    tmp: tempfile::TempDir,
}

impl TargetFixture {
    /// A builder for a RAID`level` array over `members` sparse 9 MiB member files named
    /// `m0.img`..., 64 KiB chunks, left-symmetric, named `fixture`, served over NBD
    /// (127.0.0.1 and a Unix socket, `--adaptive`) in role order, not filled.
    pub fn builder(level: u8, members: usize) -> TargetBuilder {
        TargetBuilder {
            level,
            members,
            kind: MemberKind::Files,
            member_bytes: MEMBER_BYTES,
            prefix: "m".into(),
            layout: "left-symmetric",
            name: None,
            chunk: CHUNK,
            create_args: Vec::new(),
            serve_args: Vec::new(),
            rpc: false,
            iscsi: false,
            shuffle: None,
            fill: None,
            label: "serve".into(),
            serve: true,
            stop_after_fill: false,
        }
    }

    /// The temporary directory: members, logs, sockets, scratch files.
    pub fn dir(&self) -> &Path {
        self.tmp.path()
    }

    /// The running server.
    ///
    /// # Panics
    /// None is running (built with `no_serve`, or stopped).
    pub fn srv(&self) -> &Server {
        self.server
            .as_ref()
            .expect("the fixture's server is not running")
    }

    /// The running server, mutable (to stop or kill it).
    pub fn srv_mut(&mut self) -> &mut Server {
        self.server
            .as_mut()
            .expect("the fixture's server is not running")
    }

    /// The running server, handed over to the caller (declared after the fixture, it is
    /// dropped — killed — before the fixture removes the directory and detaches loops).
    ///
    /// # Panics
    /// None is running.
    pub fn take_server(&mut self) -> Server {
        self.server
            .take()
            .expect("the fixture's server is not running")
    }

    /// Stops the running server (SIGTERM, exit 0, "array stopped") and lets it go.
    pub fn stop(&mut self) {
        if let Some(mut s) = self.server.take() {
            s.stop();
        }
    }

    /// `ferroraid serve` of this array again (a restart): `devices` (in the order given)
    /// with `extra` arguments, labelled `label`, ready. The fixture does not keep it.
    pub fn serve(&self, label: &str, devices: &[PathBuf], extra: &[&str]) -> Server {
        Server::serve(self.dir(), label, &self.array.name, devices, extra)
    }

    /// The path of the JSON-RPC socket the builder's [`TargetBuilder::rpc`] asks for
    /// (`DIR/rpc.sock`), as an argument.
    pub fn rpc_arg(&self) -> String {
        self.dir().join("rpc.sock").display().to_string()
    }
}

impl TargetBuilder {
    /// Member kind (files, the default, or loop devices).
    pub fn kind(mut self, kind: MemberKind) -> Self {
        self.kind = kind;
        self
    }

    /// Loop devices instead of files (root and losetup; without them `build` skips).
    pub fn loop_devices(self) -> Self {
        self.kind(MemberKind::Loop)
    }

    /// Each member's size, bytes (default 9 MiB: 1 MiB data offset + 8 MiB of data).
    pub fn member_bytes(mut self, bytes: u64) -> Self {
        self.member_bytes = bytes;
        self
    }

    /// Member file names `PREFIXi.img` (default `m`).
    pub fn prefix(mut self, prefix: &str) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// md layout (default left-symmetric).
    pub fn layout(mut self, layout: &'static str) -> Self {
        self.layout = layout;
        self
    }

    /// The array's name, which is the NBD export name (default `fixture`).
    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Chunk size, bytes (a multiple of 4 KiB; default 64 KiB).
    pub fn chunk(mut self, bytes: u64) -> Self {
        self.chunk = bytes;
        self
    }

    /// `--consistency-policy POLICY` at create (`resync`, `bitmap`, `ppl`).
    pub fn consistency_policy(mut self, policy: &str) -> Self {
        self.create_args
            .extend(["--consistency-policy".into(), policy.into()]);
        self
    }

    /// An internal write-intent bitmap of `chunk` regions (`--bitmap internal
    /// --bitmap-chunk CHUNK`, e.g. "256K").
    pub fn bitmap(mut self, chunk: &str) -> Self {
        self.create_args.extend([
            "--bitmap".into(),
            "internal".into(),
            "--bitmap-chunk".into(),
            chunk.into(),
        ]);
        self
    }

    /// More `serve` arguments (`--reactors 2`, `--speed-max 1024`, ...).
    pub fn serve_args(mut self, args: &[&str]) -> Self {
        self.serve_args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// A JSON-RPC socket at `DIR/rpc.sock` ([`Server::status`], [`Server::mgmt`]).
    pub fn rpc(mut self) -> Self {
        self.rpc = true;
        self
    }

    /// An iSCSI portal on a free 127.0.0.1 port too ([`Server::iscsi_url`]).
    pub fn iscsi(mut self) -> Self {
        self.iscsi = true;
        self
    }

    /// Devices named to `serve` in a seeded shuffled order (default: role order).
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.shuffle = Some(seed);
        self
    }

    /// Writes the whole export with data from `seed` (`random_file`) through nbdcopy
    /// before handing it back (without nbdcopy `build` skips).
    pub fn fill(mut self, seed: u64) -> Self {
        self.fill = Some(seed);
        self
    }

    /// After the fill, stop the server cleanly: the fixture hands back a created, filled
    /// and clean array and no server (the test starts its own).
    pub fn stop_after_fill(mut self) -> Self {
        self.stop_after_fill = true;
        self
    }

    /// The server's label: its log files are `DIR/LABEL.{out,err}` (default `serve`).
    pub fn label(mut self, label: &str) -> Self {
        self.label = label.into();
        self
    }

    /// Create only; no server.
    pub fn no_serve(mut self) -> Self {
        self.serve = false;
        self
    }

    /// Creates the members and the array, starts the server and waits until it serves,
    /// fills it. `None` (said on stderr) when a tool it needs is missing: nbdcopy for a
    /// fill, root and losetup for loop devices.
    ///
    /// # Panics
    /// Anything failing on the way (create refused, the server exiting or not answering
    /// within 30 s: with its logs), or a missing tool under `FERRORAID_REQUIRE_TOOLS=1`
    /// (`FERRORAID_REQUIRE_LOOP=1` for loop devices).
    pub fn build(self) -> Option<TargetFixture> {
        let nbdcopy = match self.fill {
            Some(_) => Some(tool("nbdcopy")?),
            None => None,
        };
        let tmp = tempfile::tempdir().expect("a temporary directory");
        let d = tmp.path();
        let name = self.name.clone().unwrap_or_else(|| "fixture".into());
        let (devices, images, loops) = match self.kind {
            MemberKind::Files => {
                let files = member_files(d, &self.prefix, self.members, self.member_bytes);
                (files.clone(), files, Vec::new())
            }
            MemberKind::Loop => {
                let files = member_files(d, "backing", self.members, self.member_bytes);
                let mut loops = Vec::new();
                for f in &files {
                    match attach_loop(f) {
                        Ok(g) => loops.push(g),
                        Err(why) => {
                            assert!(
                                !required("FERRORAID_REQUIRE_LOOP"),
                                "FERRORAID_REQUIRE_LOOP=1 but {why}"
                            );
                            let test = std::thread::current().name().unwrap_or("?").to_owned();
                            eprintln!(
                                "SKIPPED {test}: {why} (needs root and losetup; \
                                 FERRORAID_REQUIRE_LOOP=1 makes this a failure)"
                            );
                            return None;
                        }
                    }
                }
                let devs = loops.iter().map(|g| PathBuf::from(&g.dev)).collect();
                (devs, files, loops)
            }
        };
        let create_args: Vec<&str> = self.create_args.iter().map(String::as_str).collect();
        let (mut array, created) = create_with(
            d,
            self.level,
            self.layout,
            &name,
            &devices,
            self.chunk,
            &create_args,
        );
        array.images = images;
        let mut fx = TargetFixture {
            server: None,
            data: vec![0; array.size as usize],
            array,
            created,
            nbdcopy,
            _loops: loops,
            tmp,
        };
        if !self.serve {
            return Some(fx);
        }
        let order = match self.shuffle {
            Some(seed) => shuffled(&fx.array.members, seed),
            None => fx.array.members.clone(),
        };
        let rpc = fx.rpc_arg();
        let iscsi = format!("127.0.0.1:{}", free_port());
        let mut args: Vec<&str> = self.serve_args.iter().map(String::as_str).collect();
        if self.rpc {
            args.extend(["--rpc", &rpc]);
        }
        if self.iscsi {
            args.extend(["--iscsi", &iscsi]);
        }
        let srv = fx.serve(&self.label, &order, &args);
        if let (Some(seed), Some(nbdcopy)) = (self.fill, &fx.nbdcopy) {
            let src = fx.dir().join("fill.img");
            fx.data = random_file(&src, fx.array.size, seed);
            srv.fill(nbdcopy, &src);
            let _ = fs::remove_file(&src);
        }
        fx.server = Some(srv);
        if self.stop_after_fill {
            fx.stop();
        }
        Some(fx)
    }
}
