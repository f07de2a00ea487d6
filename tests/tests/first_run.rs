//! The `ferroraid` binary as a first-time user meets it (issue 16): exit statuses of
//! command-line mistakes, logs without colour codes when stderr is not a terminal, and the
//! start-up line saying how reactor cores were chosen.
//!
//! - `ferroraid bogus`, an unknown option, a bad value and a missing subcommand exit 64
//!   (`EX_USAGE` of sysexits.h), not clap's 2, which `ferroraid status` uses for "array
//!   failed"; `--help` and `--version` exit 0, and `--help` lists the exit statuses.
//! - `ferroraid demo` with stderr in a file (not a terminal) writes no ANSI escape
//!   sequence, with and without `NO_COLOR`, and logs once which method chose its cores
//!   (`hwloc` in builds with the `hwloc` feature, `sysfs` otherwise).
//!
//! Needs no external tool. The binary comes from [`ferroraid_tests::ferroraid_bin`].

use std::ffi::OsStr;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use ferroraid_tests::{ferroraid_bin, run_tool, show_output};

/// Longest a command of this file may run (the demo runs for one second, plus start and
/// stop; a cold binary build happens in `ferroraid_bin`, not here).
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

/// `EX_USAGE` of sysexits.h: the exit status of a command-line usage error.
const EX_USAGE: i32 = 64;

/// The start of every ANSI control sequence (CSI): what must not appear in a log file.
const CSI: &str = "\x1b[";

/// Runs `ferroraid ARGS...` in `dir` with `NO_COLOR` set to `no_color` (removed if `None`).
fn ferroraid<I, S>(dir: &Path, args: I, no_color: Option<&str>) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(ferroraid_bin());
    cmd.args(args).current_dir(dir).env("RUST_LOG", "info");
    match no_color {
        Some(v) => cmd.env("NO_COLOR", v),
        None => cmd.env_remove("NO_COLOR"),
    };
    run_tool(&mut cmd, dir, RUN_TIMEOUT)
}

#[test]
fn usage_errors_exit_64_and_help_lists_the_exit_statuses() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    for args in [
        vec!["bogus"],
        vec![],
        vec!["serve", "--no-such-option"],
        vec!["serve", "--reactors", "many"],
        vec!["layout", "--level", "7"],
    ] {
        let out = ferroraid(d, &args, Some("1"));
        assert_eq!(
            out.status.code(),
            Some(EX_USAGE),
            "ferroraid {args:?}: {}",
            show_output(&out)
        );
        assert!(
            !out.stderr.is_empty() && out.stdout.is_empty(),
            "ferroraid {args:?} says what is wrong on stderr: {}",
            show_output(&out)
        );
    }
    let out = ferroraid(d, ["bogus"], Some("1"));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("bogus"),
        "{}",
        show_output(&out)
    );

    let help = ferroraid(d, ["--help"], Some("1"));
    assert!(help.status.success(), "{}", show_output(&help));
    let text = String::from_utf8_lossy(&help.stdout);
    for needle in ["Exit status", "64", "EX_USAGE", "degraded", "mismatches"] {
        assert!(text.contains(needle), "--help lacks {needle:?}:\n{text}");
    }
    let version = ferroraid(d, ["--version"], Some("1"));
    assert!(version.status.success(), "{}", show_output(&version));
    // A subcommand's help is no error either.
    let sub = ferroraid(d, ["serve", "--help"], Some("1"));
    assert!(sub.status.success(), "{}", show_output(&sub));
}

#[test]
fn logs_to_a_file_have_no_colour_codes_and_say_how_cores_were_chosen() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let method = if cfg!(feature = "hwloc") {
        "hwloc"
    } else {
        "sysfs"
    };
    for no_color in [None, Some("1"), Some("")] {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("binding 127.0.0.1:0")
            .port();
        let out = ferroraid(
            d,
            [
                "demo",
                "--dir",
                "demo-data",
                "--member-size",
                "16M",
                "--nbd",
                &format!("127.0.0.1:{port}"),
                "--seconds",
                "1",
            ],
            no_color,
        );
        assert!(
            out.status.success(),
            "demo (NO_COLOR {no_color:?}): {}",
            show_output(&out)
        );
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(
            log.contains(" INFO "),
            "demo (NO_COLOR {no_color:?}) logged nothing at info:\n{log}"
        );
        assert!(
            !log.contains(CSI) && !String::from_utf8_lossy(&out.stdout).contains(CSI),
            "demo (NO_COLOR {no_color:?}) wrote escape codes into a file: {}",
            show_output(&out)
        );
        // Once, at start: the method that chose the cores (a binary given by FERRORAID_BIN
        // may be built either way), or why the reactors run unpinned.
        let told = log.matches("chosen by ").count() + log.matches("unpinned reactors").count();
        assert_eq!(told, 1, "how cores were chosen, once:\n{log}");
        if std::env::var_os("FERRORAID_BIN").is_none() && !log.contains("unpinned") {
            assert!(
                log.contains(&format!("chosen by {method} topology")),
                "expected the {method} method:\n{log}"
            );
        }
    }
}
