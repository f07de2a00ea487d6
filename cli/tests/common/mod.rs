//! Helpers shared by the integration tests that run the `ferroraid` binary on member
//! files and hold its results against `mdadm --examine` (`examine.rs`, `grow.rs`).
#![allow(dead_code)] // each test binary uses its own subset

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// Member size: 64 MiB, sparse.
pub const MEMBER_BYTES: u64 = 64 << 20;

/// Runs the `ferroraid` binary with `args`.
pub fn ferroraid(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferroraid"))
        .args(args)
        .output()
        .expect("run ferroraid")
}

/// mdadm's path; `None` (with a SKIP message) when it is not installed, unless
/// `FERRORAID_REQUIRE_MDADM` is set (CI sets it): then the test fails.
pub fn mdadm() -> Option<PathBuf> {
    let found = ["/usr/sbin/mdadm", "/sbin/mdadm", "/usr/bin/mdadm"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists());
    match found {
        Some(p) => Some(p),
        None if std::env::var_os("FERRORAID_REQUIRE_MDADM").is_some() => {
            panic!("FERRORAID_REQUIRE_MDADM is set and mdadm is not installed")
        }
        None => {
            eprintln!("SKIP: mdadm not found (set FERRORAID_REQUIRE_MDADM=1 to fail instead)");
            None
        }
    }
}

/// A temporary directory on disk (sparse files, not tmpfs), in `CARGO_TARGET_TMPDIR`.
pub fn disk_tempdir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir in CARGO_TARGET_TMPDIR")
}

/// `mdadm --examine FILE`: its text and `key : value` lines.
pub fn mdadm_examine(mdadm: &Path, file: &Path) -> (String, HashMap<String, String>) {
    let out = Command::new(mdadm)
        .arg("--examine")
        .arg(file)
        .output()
        .expect("run mdadm");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    (text.clone(), key_values(&text))
}

/// The `key : value` lines of `mdadm --examine`-style text, trimmed.
pub fn key_values(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once(" : "))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

/// `ferroraid examine --json FILES`: the output and its entries.
pub fn examine_json(files: &[PathBuf]) -> (Output, Vec<Value>) {
    let mut args = vec!["examine", "--json"];
    args.extend(files.iter().map(|f| f.to_str().unwrap()));
    let out = ferroraid(&args);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "examine --json printed no JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out, v.as_array().expect("a JSON array").clone())
}

/// `count` sparse 64 MiB member files named `{prefix}{i}.img` in `dir`.
pub fn member_files(dir: &Path, prefix: &str, count: usize) -> Vec<PathBuf> {
    (0..count)
        .map(|i| {
            let p = dir.join(format!("{prefix}{i}.img"));
            std::fs::File::create(&p)
                .and_then(|f| f.set_len(MEMBER_BYTES))
                .unwrap();
            p
        })
        .collect()
}

/// `ferroraid create --level L --name pol` with `extra` options over `files`.
pub fn create(level: &str, extra: &[&str], files: &[PathBuf]) -> Output {
    let mut args = vec!["create", "--level", level, "--name", "pol"];
    args.extend_from_slice(extra);
    args.extend(files.iter().map(|f| f.to_str().unwrap()));
    ferroraid(&args)
}

/// `ferroraid examine FILE` of a member with mdadm's PPL area holding only the empty
/// header: checks the "PPL" and "PPL Newest" lines; returns the text and its
/// `key : value` lines.
pub fn examine_empty_ppl(file: &Path) -> (String, HashMap<String, String>) {
    let out = ferroraid(&["examine", file.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let ours = key_values(&text);
    assert_eq!(
        ours.get("PPL").map(String::as_str),
        Some("2048 sectors at offset 8 sectors from superblock"),
        "{text}"
    );
    assert!(
        text.contains("PPL Newest : generation 0, 0 entries, at 0 sectors into the area"),
        "{text}"
    );
    (text, ours)
}
