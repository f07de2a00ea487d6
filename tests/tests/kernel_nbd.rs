//! The kernel's own NBD client on ferroraid (issue 18, "the README's `nbd-client` line,
//! tested").
//!
//! `tests/qemu/kernel-nbd.sh` (see `docs/TESTING.md`) boots the rig's guest (Debian's kernel
//! with its `nbd.ko` and `ext4`) with six virtio members and, in it, the `ferroraid` binary
//! under test: `ferroraid create` a RAID6, `ferroraid serve --adaptive --nbd
//! 127.0.0.1:10809`, then Debian's `nbd-client 127.0.0.1 10809 /dev/nbd0 -N knbd` over
//! loopback, `mkfs.ext4`, mount, fio on files (three jobs of random 32 KiB O_DIRECT writes
//! with crc32c verify headers and an fsync every 8 writes, verified after writing) with
//! `ferroraid fail` taking a member out a third of the way through; the files' sha256,
//! umount, `nbd-client -d`, SIGTERM (exit 0). Then `serve` again on the five survivors
//! (degraded), connect again, `e2fsck -f -n` clean, mount, the sums and `fio --verify_only`
//! agree, with reads rebuilt from parity, and the target stops cleanly once more.
//!
//! The script fails on any deviation; this test holds its summary to the same facts. The
//! result is cached in `target/tmp/kernel-nbd`, keyed on the scripts, the ferroraid binary,
//! fio, e2fsprogs and the nbd-client package. Without `qemu-system-x86_64`, fio, e2fsprogs,
//! a kernel for the rig or the nbd-client package (fetched with `apt-get download`), it
//! prints `SKIPPED kernel_nbd: why` and passes, unless `FERRORAID_REQUIRE_QEMU=1`.

use std::path::Path;

use ferroraid_tests::{number_after, repo_root, summary_has as has, summary_line as line};

/// `ferroraid status`'s degraded reads in summary line `name` ("reads: N direct, M degraded").
fn degraded_reads(summary: &str, name: &str) -> u64 {
    let l = line(summary, name);
    number_after(l, " direct, ").unwrap_or_else(|| panic!("{name}: no read counts in {l:?}"))
}

#[test]
fn kernel_nbd_client_ext4_fio_with_a_member_failed() {
    let script = repo_root().join("tests/qemu/kernel-nbd.sh");
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernel-nbd");
    let Some(ferroraid_tests::KernelClientRun {
        out,
        summary,
        start,
    }) = ferroraid_tests::run_kernel_client_rig("kernel_nbd", &script, &out_dir, "nbd-client")
    else {
        return;
    };

    has(&summary, "connect", &["nbd-client connected: /dev/nbd0 "]);
    has(&summary, "mkfs", &["mkfs.ext4 and mount done: /dev/nbd0"]);
    has(&summary, "fail", &["fio still running", "is now degraded"]);
    // fio wrote through the failure and verified what it wrote.
    has(
        &summary,
        "fio-write",
        &["crc32c: exit 0", "write: IOPS=", "verify read: IOPS="],
    );
    let fio = line(&summary, "fio-write");
    let before = number_after(fio, "nbd0 writes ").unwrap_or(0);
    let all = number_after(fio, " before the fail, ").unwrap_or(0);
    assert!(
        before > 0 && all > before,
        "fio-write: no writes on both sides of the member failure: {fio:?}"
    );
    // Served again without the failed member: fsck clean, the files as they were.
    has(&summary, "serve-2", &["degraded start"]);
    has(&summary, "e2fsck", &["exit 0", "files"]);
    has(
        &summary,
        "remount",
        &["sha256 3/3 files OK", "fio --verify_only exit 0"],
    );
    // Both targets stopped cleanly, having served reads rebuilt from parity: fio's verify
    // after the failure, and everything after the remount.
    for stop in ["stop-1", "stop-2"] {
        has(
            &summary,
            stop,
            &["serve exit 0", "array stopped", "clean=true"],
        );
        assert!(
            degraded_reads(&summary, stop) > 0,
            "{stop}: the degraded array served no degraded read:\n{summary}"
        );
    }
    ferroraid_tests::print_rig_summary("kernel_nbd", start, &out_dir, &out, &summary);
}
