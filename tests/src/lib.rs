//! Shared helpers for ferroraid's cross-crate integration tests (`tests/tests/*.rs`).
//!
//! - [`Oracle`] finds and runs the independent Python reference of md's layout and parity,
//!   `../shared/oracle/raidref.py` beside the repository (see `shared/DESIGN.md`,
//!   "Correctness references"), and turns a failed run into an error that carries the
//!   command line, exit status and the oracle's stderr; [`Oracle::locate_or_skip`] says
//!   why a test skips its oracle checks when the oracle or `python3` is missing.
//! - [`Rng`] is a tiny deterministic generator (SplitMix64): every test case derives its
//!   data from a printed seed ([`seed_of`]), so a failure replays exactly.
//! - Third-party tools: [`tool`] finds one or says why the test skips (unless
//!   `FERRORAID_REQUIRE_TOOLS=1`), [`run_tool`] runs one with a timeout and its output in
//!   files (no pipe can fill up).
//! - Loop devices ([`attach_loop`], [`LoopGuard`]) and the Linux md fixtures made by the
//!   QEMU rig ([`ensure_md_fixtures`]).
//! - [`crash`]: the simulated crash world of the model test's crash phase and the
//!   write-hole test — members with a bitmap area, the sharded array over them, the
//!   workload that runs until a crash with torn member writes, and the per-block model of
//!   the versions a block may hold afterwards.
//!
//! - [`target`]: the `ferroraid` binary run as an operator runs it — the fixture that
//!   creates an array, starts `ferroraid serve`, waits until it serves, fills it and cleans
//!   up ([`target::TargetFixture`]), for the tests of the binary.
//!
//! Beyond `engine`, the crate uses only test plumbing (`libc` for `PR_SET_PDEATHSIG`,
//! `tempfile`, `serde_json` for `status --json`) — never `ferroraid` itself, so the oracle
//! tests and the binary tests stay independent of the code they check.

use std::ffi::OsStr;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub mod crash;
pub mod target;

/// Where the oracle script lives: `shared/oracle/raidref.py` beside the workspace root.
///
/// Resolved from this crate's manifest directory (`<root>/tests`), never from an absolute
/// path, so it works wherever the repository is cloned as long as `shared/` sits beside it.
pub fn oracle_path() -> PathBuf {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/oracle/raidref.py"
    ))
    .to_path_buf()
}

/// Why the oracle could not be run, or what it said when it refused.
#[derive(Debug, Clone)]
pub enum OracleError {
    /// The script is not where [`oracle_path`] says.
    Missing(PathBuf),
    /// `python3` could not be started.
    NoPython(String),
    /// The oracle ran and exited with a status other than the one required.
    Failed {
        /// The command line, for replaying by hand.
        command: String,
        /// Its exit status.
        status: ExitStatus,
        /// Its standard output.
        stdout: String,
        /// Its standard error (argparse messages, "mismatch in stripe N", tracebacks).
        stderr: String,
    },
}

impl fmt::Display for OracleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OracleError::Missing(p) => write!(
                f,
                "the oracle {} does not exist: the repository must be cloned with shared/ beside it",
                p.display()
            ),
            OracleError::NoPython(why) => write!(f, "cannot run python3 for the oracle: {why}"),
            OracleError::Failed {
                command,
                status,
                stdout,
                stderr,
            } => write!(
                f,
                "oracle failed ({status}): {command}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                stdout.trim_end(),
                stderr.trim_end()
            ),
        }
    }
}

impl std::error::Error for OracleError {}

/// What one oracle run printed, and how it ended.
#[derive(Debug, Clone)]
pub struct OracleOutput {
    /// The command line, for messages.
    pub command: String,
    /// Exit status (0: success; `verify` exits 1 on a parity mismatch, argparse 2 on usage).
    pub status: ExitStatus,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl OracleOutput {
    /// Exit code, or -1 if the process was killed by a signal.
    pub fn code(&self) -> i32 {
        self.status.code().unwrap_or(-1)
    }

    /// This output as an [`OracleError::Failed`].
    pub fn into_error(self) -> OracleError {
        OracleError::Failed {
            command: self.command,
            status: self.status,
            stdout: self.stdout,
            stderr: self.stderr,
        }
    }
}

/// The interpreter behind `python3`, resolved once.
///
/// Asking `python3` for `sys.executable` once and running that directly skips wrapper
/// scripts (pyenv shims cost ~100 ms per start), which matters for the hundreds of short
/// oracle runs a test file makes.
fn python() -> Result<&'static Path, OracleError> {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let out = Command::new("python3")
                .args(["-c", "import sys; print(sys.executable)"])
                .stdin(Stdio::null())
                .output()
                .map_err(|e| format!("python3 is not on PATH ({e})"))?;
            if !out.status.success() {
                return Err(format!(
                    "python3 -c 'import sys' exited with {}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim_end()
                ));
            }
            let exe = String::from_utf8_lossy(&out.stdout).trim().to_string();
            Ok(if exe.is_empty() {
                PathBuf::from("python3")
            } else {
                PathBuf::from(exe)
            })
        })
        .as_deref()
        .map_err(|e| OracleError::NoPython(e.clone()))
}

/// A handle on the oracle script; cheap to clone.
#[derive(Debug, Clone)]
pub struct Oracle {
    script: PathBuf,
}

impl Oracle {
    /// Finds the oracle at [`oracle_path`] and checks that `python3` runs.
    ///
    /// # Errors
    /// [`OracleError::Missing`] or [`OracleError::NoPython`].
    pub fn locate() -> Result<Self, OracleError> {
        let script = oracle_path();
        if !script.is_file() {
            return Err(OracleError::Missing(script));
        }
        python()?;
        Ok(Self { script })
    }

    /// The oracle, or `None` after saying on stderr why `test` skips its oracle checks.
    ///
    /// The project's rule for missing tools: a user who cloned only this repository (no
    /// `../shared` beside it) or has no `python3` gets a `SKIPPED: ...` line naming the
    /// reason, not a failure; CI sets `FERRORAID_REQUIRE_ORACLE=1`, under which a missing
    /// oracle panics instead. Only a missing oracle skips: what the oracle says once it runs
    /// (a mismatch, a refused command) is still checked by the caller.
    ///
    /// # Panics
    /// When [`Oracle::locate`] fails and `FERRORAID_REQUIRE_ORACLE=1`.
    pub fn locate_or_skip(test: &str) -> Option<Self> {
        match Self::locate() {
            Ok(oracle) => Some(oracle),
            Err(why) => {
                assert!(
                    !required("FERRORAID_REQUIRE_ORACLE"),
                    "{test}: {why} and FERRORAID_REQUIRE_ORACLE=1"
                );
                eprintln!(
                    "SKIPPED: {test}: {why} (set FERRORAID_REQUIRE_ORACLE=1 to fail instead)"
                );
                None
            }
        }
    }

    /// The script's path.
    pub fn script(&self) -> &Path {
        &self.script
    }

    /// Runs `python3 -I -S raidref.py ARGS...` and returns its output whatever the exit status.
    ///
    /// `-I -S` (isolated, no `site`): the oracle uses only the standard library, so the
    /// environment (PYTHONPATH, user site packages) cannot change what it computes.
    ///
    /// Note that raidref.py parses its member list as a positional right after the command:
    /// pass `verify IMG... --level ...`, not `verify --level ... IMG...` (argparse then
    /// rejects the images as "unrecognized arguments").
    ///
    /// # Errors
    /// [`OracleError::NoPython`] if the interpreter cannot be started.
    pub fn run<I, S>(&self, args: I) -> Result<OracleOutput, OracleError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let python = python()?;
        let mut cmd = Command::new(python);
        cmd.args(["-I", "-S"]).arg(&self.script);
        let mut command = format!("python3 -I -S {}", self.script.display());
        for a in args {
            command.push(' ');
            command.push_str(&a.as_ref().to_string_lossy());
            cmd.arg(a);
        }
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .map_err(|e| OracleError::NoPython(format!("{} ({e})", python.display())))?;
        Ok(OracleOutput {
            command,
            status: out.status,
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    /// Runs the oracle and requires exit status 0; returns its stdout.
    ///
    /// # Errors
    /// [`OracleError::Failed`] (with stderr) on any other status; see [`Oracle::run`].
    pub fn run_ok<I, S>(&self, args: I) -> Result<String, OracleError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let out = self.run(args)?;
        if out.status.success() {
            Ok(out.stdout)
        } else {
            Err(out.into_error())
        }
    }
}

/// Mixes the parts of a test-case description into one 64-bit seed (FNV-1a over the parts,
/// finished with SplitMix64), so each case has a fixed, distinct, printable seed.
pub fn seed_of(parts: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    Rng::new(h).next_u64()
}

/// SplitMix64 (Steele, Lea, Flood 2014): small, fast, deterministic; good enough to make
/// test data that no layout or parity bug can agree with by accident.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator started at `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value in `0..n` (`n > 0`; the tiny modulo bias is irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Rng::below(0)");
        self.next_u64() % n
    }

    /// Fills `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }

    /// `len` random bytes.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.fill(&mut v);
        v
    }
}

/// Index and the surrounding bytes of the first difference between `a` and `b`, for
/// assertion messages (`None` if they are equal, including in length).
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<String> {
    if a == b {
        return None;
    }
    let i = a
        .iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()));
    let show = |s: &[u8]| {
        let end = (i + 8).min(s.len());
        format!("{:02x?}", &s[i.min(end)..end])
    };
    Some(format!(
        "first difference at byte {i} (lengths {} and {}): {} vs {}",
        a.len(),
        b.len(),
        show(a),
        show(b)
    ))
}

/// A loop device a test created; `Drop` detaches exactly it and waits until the kernel
/// has let go of it.
pub struct LoopGuard {
    /// The device path, `/dev/loopN`.
    pub dev: String,
}

impl Drop for LoopGuard {
    fn drop(&mut self) {
        match Command::new("losetup").arg("-d").arg(&self.dev).status() {
            Ok(s) if s.success() => {}
            other => {
                eprintln!("WARNING: `losetup -d {}` failed: {other:?}", self.dev);
                return;
            }
        }
        // The kernel finishes the detach when the last opener goes; an io_uring's reference
        // to its fixed file is dropped by the ring's asynchronous teardown, a few
        // milliseconds after the channel. Wait for it so the test leaves nothing behind.
        let name = self.dev.trim_start_matches("/dev/");
        let attached = PathBuf::from(format!("/sys/block/{name}/loop/backing_file"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while attached.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if attached.exists() {
            eprintln!(
                "WARNING: {} still attached 10 s after `losetup -d`",
                self.dev
            );
        }
    }
}

/// Attaches `file` to a free loop device with direct I/O (`losetup --find --show
/// --direct-io=on`), or says why not (no losetup, not root).
///
/// # Errors
/// A message saying why the device could not be attached.
pub fn attach_loop(file: &Path) -> Result<LoopGuard, String> {
    let out = run_system_tool(
        "losetup",
        Command::new("losetup")
            .args(["--find", "--show", "--direct-io=on"])
            .arg(file),
    )?;
    let dev = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !dev.starts_with("/dev/loop") {
        return Err(format!("losetup printed {dev:?}, not a loop device"));
    }
    Ok(LoopGuard { dev })
}

/// Runs `cmd` (the system tool `name`), which must succeed: its output, or a message
/// saying why not (the tool is missing, or it failed, with its stderr).
fn run_system_tool(name: &str, cmd: &mut Command) -> Result<std::process::Output, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {name}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{name} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(out)
}

/// A tmpfs of a given size mounted at a directory the caller owns (a file system that runs
/// out of room: a member file on it fails its writes with ENOSPC), unmounted (`umount -l`)
/// when dropped.
pub struct TmpfsMount {
    /// Where it is mounted.
    pub dir: PathBuf,
}

impl TmpfsMount {
    /// Mounts a tmpfs of `bytes` at `dir` (created), or says why not (no `mount`, not
    /// root).
    ///
    /// # Errors
    /// A message saying why it could not be mounted.
    pub fn new(dir: &Path, bytes: u64) -> Result<Self, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        run_system_tool(
            "mount",
            Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
                .arg(dir),
        )?;
        Ok(TmpfsMount {
            dir: dir.to_path_buf(),
        })
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

/// The workspace root (the directory above this crate's manifest).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace")
        .to_path_buf()
}

/// Whether the environment variable `name` is set to `1` (how CI makes a skip a failure).
pub fn required(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}
/// Runs `f` on its own thread and returns its result, or panics naming `what` when it
/// takes longer than `limit` (a hang becomes a failure; the thread is left behind).
pub fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} did not finish within {limit:?}"))
}

/// The path of the installed tool `name`, or `None` (after saying so on stderr) when it is
/// not installed and `FERRORAID_REQUIRE_TOOLS` is not `1`; under it, a missing tool panics.
pub fn tool(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        assert!(
            !required("FERRORAID_REQUIRE_TOOLS"),
            "{name} is not installed and FERRORAID_REQUIRE_TOOLS=1"
        );
        eprintln!(
            "SKIPPED: {name} is not installed (set FERRORAID_REQUIRE_TOOLS=1 to fail instead)"
        );
    }
    found
}

/// Whether `program arg` runs and exits 0 (e.g. `qemu-system-x86_64 --version`).
pub fn tool_runs(program: &str, arg: &str) -> bool {
    Command::new(program)
        .arg(arg)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The installed `mdadm` (on `PATH`, or in `/sbin`, `/usr/sbin`), or `None` after saying
/// on stderr that the checks needing it are skipped.
///
/// # Panics
/// When mdadm is missing and `FERRORAID_REQUIRE_MDADM` is set (CI) or
/// `FERRORAID_REQUIRE_TOOLS=1`.
pub fn mdadm() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("mdadm"))
            .chain([
                PathBuf::from("/sbin/mdadm"),
                PathBuf::from("/usr/sbin/mdadm"),
            ])
            .find(|p| p.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var_os("FERRORAID_REQUIRE_MDADM").is_none()
                && !required("FERRORAID_REQUIRE_TOOLS"),
            "mdadm is not installed (apt-get install mdadm) and FERRORAID_REQUIRE_MDADM or \
             FERRORAID_REQUIRE_TOOLS=1 is set"
        );
        eprintln!(
            "SKIPPED: mdadm is not installed: the `mdadm --examine` checks are skipped \
             (FERRORAID_REQUIRE_MDADM=1 makes this a failure)"
        );
    }
    found
}

/// A command's exit status, stdout and stderr, for failure messages.
pub fn show_output(out: &Output) -> String {
    format!(
        "{}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout).trim_end(),
        String::from_utf8_lossy(&out.stderr).trim_end()
    )
}

/// Runs `cmd` with stdin closed and stdout/stderr in files under `dir` (no pipe can fill
/// up), for at most `timeout`: a command still running then is killed and the test fails
/// with its stderr.
///
/// # Panics
/// The command cannot be started, or runs past `timeout`.
pub fn run_tool(cmd: &mut Command, dir: &Path, timeout: Duration) -> Output {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let shown = format!("{cmd:?}");
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let out_p = dir.join(format!("tool-{}-{n}.out", std::process::id()));
    let err_p = dir.join(format!("tool-{}-{n}.err", std::process::id()));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_p).expect("creating the tool's stdout file"))
        .stderr(std::fs::File::create(&err_p).expect("creating the tool's stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {shown}: {e}"));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait().expect("waiting for a tool") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{shown} ran longer than {timeout:?}; stderr:\n{}",
                std::fs::read_to_string(&err_p).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let out = Output {
        status,
        stdout: std::fs::read(&out_p).unwrap_or_default(),
        stderr: std::fs::read(&err_p).unwrap_or_default(),
    };
    let _ = std::fs::remove_file(&out_p);
    let _ = std::fs::remove_file(&err_p);
    out
}

/// A QEMU-rig test that cannot run here (`why`, from [`qemu_rig_unavailable`]): prints
/// `SKIPPED test: why` and returns, so the test passes, unless `FERRORAID_REQUIRE_QEMU=1`
/// (CI), under which it panics.
///
/// # Panics
/// Under `FERRORAID_REQUIRE_QEMU=1`.
pub fn skip_without_rig(test: &str, why: &str) {
    assert!(
        !required("FERRORAID_REQUIRE_QEMU"),
        "FERRORAID_REQUIRE_QEMU=1 but {test} cannot run: {why}"
    );
    eprintln!("SKIPPED {test}: {why} (set FERRORAID_REQUIRE_QEMU=1 to make this a failure)");
}

/// A rig script's `OUT_DIR/summary.txt` (what [`run_rig_script`] left).
///
/// # Panics
/// The file cannot be read.
pub fn read_rig_summary(out_dir: &Path) -> String {
    let path = out_dir.join("summary.txt");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The line of a rig script's `summary.txt` that starts with `name: `.
///
/// # Panics
/// The summary has no such line.
pub fn summary_line<'a>(summary: &'a str, name: &str) -> &'a str {
    summary
        .lines()
        .find(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with(": ")))
        .unwrap_or_else(|| panic!("summary.txt has no line for {name}:\n{summary}"))
}

/// The decimal number right after the first `key` in `line` (`entries=5` with key
/// `entries=` → 5), or `None` when `key` is absent or no digit follows it.
pub fn number_after(line: &str, key: &str) -> Option<u64> {
    let rest = &line[line.find(key)? + key.len()..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Asserts every one of `wants` is in the summary line `name` ([`summary_line`]).
///
/// # Panics
/// The line is missing or lacks one of them.
pub fn summary_has(summary: &str, name: &str, wants: &[&str]) {
    let l = summary_line(summary, name);
    for want in wants {
        assert!(l.contains(want), "{name}: no {want:?} in {l:?}");
    }
}

/// What the kernel client scripts (`tests/qemu/kernel-*.sh`) need on the host besides the
/// rig and their client package: (program, version argument, Debian package).
pub const KERNEL_CLIENT_TOOLS: [(&str, &str, &str); 4] = [
    ("qemu-system-x86_64", "--version", "qemu-system-x86"),
    ("fio", "--version", "fio"),
    ("mkfs.ext4", "-V", "e2fsprogs"),
    ("e2fsck", "-V", "e2fsprogs"),
];

/// What a kernel client script's run left: its output, its summary and when it started.
pub struct KernelClientRun {
    pub out: Output,
    pub summary: String,
    pub start: Instant,
}

/// Runs the kernel client script `script` (`tests/qemu/kernel-*.sh`) into `out_dir` with
/// this build's binary, after checking the host tools ([`KERNEL_CLIENT_TOOLS`]) and
/// fetching `package` (the Debian client package the script fetches itself: `SCRIPT
/// client`). `None` (the test is skipped, [`skip_without_rig`]) when either is missing.
///
/// # Panics
/// As [`run_rig_script`] and [`read_rig_summary`]; as [`skip_without_rig`] under
/// `FERRORAID_REQUIRE_QEMU=1`.
pub fn run_kernel_client_rig(
    test: &str,
    script: &Path,
    out_dir: &Path,
    package: &str,
) -> Option<KernelClientRun> {
    if let Some(why) = qemu_rig_unavailable(&KERNEL_CLIENT_TOOLS) {
        skip_without_rig(test, &why);
        return None;
    }
    let client = Command::new("bash")
        .arg(script)
        .arg("client")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    if !client.status.success() {
        skip_without_rig(
            test,
            &format!(
                "Debian's {package} package cannot be fetched (apt-get download): {}",
                show_output(&client)
            ),
        );
        return None;
    }
    let start = Instant::now();
    let out = run_rig_script(script, out_dir, Some(ferroraid_bin()));
    let summary = read_rig_summary(out_dir);
    Some(KernelClientRun {
        out,
        summary,
        start,
    })
}

/// What a rig script (`run_rig_script`) said, for the test's output: its stderr, then its
/// `summary` unless the stderr already holds it (a run prints its summary at the end; a
/// cached result only says it is current).
pub fn print_rig_summary(test: &str, start: Instant, out_dir: &Path, out: &Output, summary: &str) {
    let said = String::from_utf8_lossy(&out.stderr);
    eprintln!(
        "{test}: {:.1} s ({}):\n{}\n{}",
        start.elapsed().as_secs_f64(),
        out_dir.display(),
        said.trim_end(),
        if said.contains(summary.trim_end()) {
            ""
        } else {
            summary.trim_end()
        }
    );
}

/// What the scripts that run `ferroraid` beside the rig's md need on the host (for
/// [`qemu_rig_unavailable`]): QEMU, mdadm, nbdcopy and python3.
pub const RIG_TOOLS_MD_NBD: [(&str, &str, &str); 4] = [
    ("qemu-system-x86_64", "--version", "qemu-system-x86"),
    ("mdadm", "--version", "mdadm"),
    ("nbdcopy", "--version", "libnbd-bin"),
    ("python3", "--version", "python3"),
];

/// Runs `bash SCRIPT OUT_DIR` (a `tests/qemu` script that caches its results in OUT_DIR)
/// with `RIG_WATCH_PID` set to this process, so the guest and servers stop if the test
/// dies, and `FERRORAID` set to `ferroraid` when given; returns its output.
///
/// # Panics
/// The script cannot be started or exits with a failure.
pub fn run_rig_script(script: &Path, out_dir: &Path, ferroraid: Option<&Path>) -> Output {
    let mut cmd = Command::new("bash");
    cmd.arg(script)
        .arg(out_dir)
        .env("RIG_WATCH_PID", std::process::id().to_string())
        .stdin(Stdio::null());
    if let Some(bin) = ferroraid {
        cmd.env("FERRORAID", bin);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} {} failed: {}",
        script.display(),
        out_dir.display(),
        show_output(&out)
    );
    out
}

/// Why the QEMU rig (`tests/qemu/rig.sh`, docs/TESTING.md) cannot run here, or `None`: the
/// first of `tools` — (program, version argument, Debian package) — that does not run,
/// else no kernel for the rig (`rig.sh kernel`: apt unreachable and nothing cached).
///
/// # Panics
/// `bash` cannot be started.
pub fn qemu_rig_unavailable(tools: &[(&str, &str, &str)]) -> Option<String> {
    for (tool, arg, package) in tools {
        if !tool_runs(tool, arg) {
            return Some(format!(
                "{tool} is not installed (apt-get install {package})"
            ));
        }
    }
    let kernel = Command::new("bash")
        .arg(repo_root().join("tests/qemu/rig.sh"))
        .arg("kernel")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run rig.sh kernel: {e}"));
    (!kernel.status.success()).then(|| {
        format!(
            "the rig has no kernel (apt unreachable and nothing cached?): {}",
            show_output(&kernel)
        )
    })
}

/// The Linux md fixtures (`tests/qemu/md-fixtures.sh`, docs/TESTING.md) in `dir`, made if
/// they are not current. `false` (after printing `SKIPPED who: why`) when they cannot be
/// made here: no `qemu-system-x86_64`, no `mdadm`, no kernel for the rig. Under
/// `FERRORAID_REQUIRE_QEMU=1` (CI) that is a failure instead.
///
/// Callers pass their `CARGO_TARGET_TMPDIR`-based directory (only integration tests have
/// that variable) and must not modify the cached images: copy what they change.
///
/// # Panics
/// The fixture script fails, or the fixtures cannot be made under `FERRORAID_REQUIRE_QEMU=1`.
pub fn ensure_md_fixtures(dir: &Path, who: &str) -> bool {
    // Tests of one binary run in parallel: one makes the fixtures while the others wait,
    // then find them current (else a second build would replace the directory under a test
    // already reading it).
    static MAKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _making = MAKING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let skip = |why: &str| {
        assert!(
            !required("FERRORAID_REQUIRE_QEMU"),
            "FERRORAID_REQUIRE_QEMU=1 but the md fixtures cannot be made: {why}"
        );
        eprintln!("SKIPPED {who}: {why} (set FERRORAID_REQUIRE_QEMU=1 to make this a failure)");
        false
    };
    let qemu = repo_root().join("tests/qemu");
    let script = qemu.join("md-fixtures.sh");
    let check = Command::new("bash")
        .arg(&script)
        .arg("--check")
        .arg(dir)
        .status()
        .unwrap_or_else(|e| panic!("cannot run bash {}: {e}", script.display()));
    if check.success() {
        return true;
    }
    // The kernel comes from apt (or the rig's cache): no kernel, no rig.
    if let Some(why) = qemu_rig_unavailable(&[
        ("qemu-system-x86_64", "--version", "qemu-system-x86"),
        ("mdadm", "--version", "mdadm"),
    ]) {
        return skip(&why);
    }
    let start = Instant::now();
    let out = run_rig_script(&script, dir, None);
    eprintln!(
        "{who}: made the md fixtures in {:.1} s:\n{}",
        start.elapsed().as_secs_f64(),
        String::from_utf8_lossy(&out.stderr).trim_end()
    );
    true
}

/// The `ferroraid` binary of this build, made current first.
///
/// The test executable is `TARGET/<profile-dir>/deps/NAME-HASH`; the binary is
/// `TARGET/<profile-dir>/ferroraid`. `cargo build -p ferroraid --bin ferroraid` always runs
/// (cargo decides freshness; well under a second when fresh) with the same target
/// directory and the profile that made this test: `debug` is `cargo test`'s `test`
/// profile (whose dependencies this build already compiled, so only the binary links),
/// `release` is `--release`, anything else `--profile NAME`; this crate's `hwloc` feature
/// builds it `--features hwloc`. `FERRORAID_BIN` skips all of
/// it. Every test that runs the binary uses this one function, so no two of them
/// rebuild `target/<profile>/ferroraid` with different profiles.
pub fn ferroraid_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("FERRORAID_BIN") {
            let p = PathBuf::from(p);
            assert!(p.is_file(), "FERRORAID_BIN={} is not a file", p.display());
            return p;
        }
        let exe = std::env::current_exe().expect("the test executable's path");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .unwrap_or_else(|| panic!("{} is not in target/<profile>/deps", exe.display()));
        let target_dir = profile_dir.parent().expect("target/<profile> has a parent");
        let profile = match profile_dir.file_name().and_then(OsStr::to_str) {
            Some("debug") => "test",
            Some("release") => "release",
            Some(other) => other,
            None => panic!("{} has no profile directory name", exe.display()),
        };
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(repo_root())
            .args([
                "build",
                "--quiet",
                "--package",
                "ferroraid",
                "--bin",
                "ferroraid",
            ])
            .args(["--profile", profile, "--target-dir"])
            .arg(target_dir)
            .stdin(Stdio::null());
        // The binary picks cores the way this test build does (`--features hwloc`).
        if cfg!(feature = "hwloc") {
            cmd.args(["--features", "hwloc"]);
        }
        let start = Instant::now();
        match cmd.output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!("building ferroraid ({cmd:?}) failed: {}", show_output(&out)),
            Err(e) => panic!("cannot run {cmd:?}: {e}"),
        }
        let bin = profile_dir.join("ferroraid");
        assert!(bin.is_file(), "{cmd:?} left no {}", bin.display());
        eprintln!(
            "ferroraid binary {} is current ({:.1} s)",
            bin.display(),
            start.elapsed().as_secs_f64()
        );
        bin
    })
}

/// A counting global allocator for "the data path allocates nothing" tests: a test binary
/// installs [`alloc_count::Counting`] as its `#[global_allocator]` and wraps the front-end
/// under test in [`alloc_count::Armed`], which counts allocations only while that front-end
/// runs on its reactor.
pub mod alloc_count {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;
    use std::sync::atomic::{AtomicU64, Ordering};

    use engine::array::ArrayCompletion;
    use engine::device::Channel;
    use engine::reactor::{Frontend, Io};

    /// Forwards to the system allocator; counts allocations and reallocations made while
    /// the calling thread is armed.
    pub struct Counting;

    thread_local! {
        static ARMED: Cell<bool> = const { Cell::new(false) };
    }
    static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

    /// Allocations counted so far, every thread.
    pub fn allocations() -> u64 {
        ALLOCATIONS.load(Ordering::Relaxed)
    }

    fn arm(on: bool) {
        ARMED.with(|a| a.set(on));
    }

    // SAFETY: forwards every call to the system allocator unchanged; the bookkeeping
    // touches only a const-initialised thread-local Cell and an atomic (neither allocates).
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            if ARMED.with(Cell::get) {
                ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            }
            // SAFETY: same contract as our caller's.
            unsafe { System.alloc(l) }
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            // SAFETY: same contract as our caller's.
            unsafe { System.dealloc(p, l) }
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
            if ARMED.with(Cell::get) {
                ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            }
            // SAFETY: same contract as our caller's.
            unsafe { System.realloc(p, l, n) }
        }
    }

    /// A front-end with the allocation counter armed around its `poll` and `complete`.
    pub struct Armed<F>(pub F);

    impl<F: Frontend> Frontend for Armed<F> {
        fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
            arm(true);
            let r = self.0.poll(io);
            arm(false);
            r
        }
        fn complete(&mut self, c: ArrayCompletion) {
            arm(true);
            self.0.complete(c);
            arm(false);
        }
        fn finished(&self) -> bool {
            self.0.finished()
        }
    }
}

/// The fuzz inputs kept in `fuzz/DIR` (a target's `seeds/T` or `regressions/T`), as
/// (file name, bytes), sorted by name; none when the folder does not exist. For the seed
/// replay tests of the conversation fuzz targets.
///
/// # Panics
/// A file of the folder cannot be read.
pub fn fuzz_inputs(dir: &str) -> Vec<(String, Vec<u8>)> {
    let dir = repo_root().join("fuzz").join(dir);
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut v: Vec<_> = rd
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.is_file())
        .map(|p| {
            let b = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p.file_name().unwrap().to_string_lossy().into_owned(), b)
        })
        .collect();
    v.sort();
    v
}

/// The input named `name` in `fuzz/DIR` ([`fuzz_inputs`]).
///
/// # Panics
/// There is no such input.
pub fn fuzz_seed(dir: &str, name: &str) -> Vec<u8> {
    fuzz_inputs(dir)
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("fuzz input {dir}/{name} missing"))
        .1
}

/// Runs `promtool check metrics` (Debian's `prometheus` package, as Prometheus itself
/// lints an exposition) on `text`: `Some(lines checked)` when it accepts it, `None` when
/// promtool is not installed (a failure under `FERRORAID_REQUIRE_TOOLS=1`, [`tool`]).
///
/// # Panics
/// When promtool rejects the text (its complaint in the message).
pub fn promtool_check(text: &str) -> Option<usize> {
    use std::io::Write as _;
    let promtool = tool("promtool")?;
    let mut child = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running promtool");
    // promtool may stop reading at the first fault: its verdict below says which.
    let _ = child
        .stdin
        .take()
        .expect("promtool's stdin")
        .write_all(text.as_bytes());
    let out = child.wait_with_output().expect("waiting for promtool");
    assert!(
        out.status.success(),
        "promtool check metrics: {}",
        show_output(&out)
    );
    Some(text.lines().count())
}

/// A python3 with the libnbd bindings (`import nbd`), or `None` (said why; a failure
/// under `FERRORAID_REQUIRE_TOOLS=1`). Debian's python3-libnbd is for the system
/// interpreter, which a pyenv `python3` may shadow.
pub fn python_nbd() -> Option<PathBuf> {
    for p in ["/usr/bin/python3", "python3"] {
        let ok = Command::new(p)
            .args(["-c", "import nbd"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Some(PathBuf::from(p));
        }
    }
    assert!(
        !required("FERRORAID_REQUIRE_TOOLS"),
        "no python3 with the libnbd bindings (python3-libnbd) and FERRORAID_REQUIRE_TOOLS=1"
    );
    eprintln!("SKIPPED: no python3 with the libnbd bindings (apt-get install python3-libnbd)");
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_deterministic_and_fills_odd_lengths() {
        let a = Rng::new(7).bytes(13);
        let b = Rng::new(7).bytes(13);
        assert_eq!(a, b);
        assert_ne!(a, Rng::new(8).bytes(13));
        assert_ne!(seed_of(&[1, 2]), seed_of(&[2, 1]));
    }

    #[test]
    fn first_difference_names_the_byte() {
        assert!(first_difference(b"abc", b"abc").is_none());
        let d = first_difference(b"abcd", b"abXd").unwrap();
        assert!(d.contains("byte 2"), "{d}");
        let d = first_difference(b"ab", b"abc").unwrap();
        assert!(d.contains("byte 2"), "{d}");
    }

    #[test]
    fn oracle_path_is_beside_the_workspace() {
        let p = oracle_path();
        assert!(p.ends_with("shared/oracle/raidref.py"), "{}", p.display());
    }
}
