//! The kernel's own NVMe/TCP host on ferroraid's NVMe/TCP target (issue 22, "in the QEMU
//! guest rig: `nvme discover` lists the subsystem; `nvme connect` gives `/dev/nvmeXnY`...").
//!
//! `tests/qemu/kernel-nvmf.sh` (see `docs/TESTING.md`) boots the rig's guest (Debian's kernel
//! with its `nvme-tcp` and `ext4` modules) with six virtio members and, in it, the
//! `ferroraid` binary under test: `modprobe nvme-tcp`, `ferroraid create` a RAID6,
//! `ferroraid serve --adaptive --nvmf 127.0.0.1:4420`, then Debian's nvme-cli over loopback:
//! `nvme discover -t tcp -a 127.0.0.1 -s 4420` lists the subsystem, `nvme connect ... -n
//! nqn.2026-11.org.ferroraid:knvmf -k 30` gives the kernel's block device, `nvme
//! id-ctrl`/`id-ns` show the fields docs/NVMF.md documents (subnqn, mdts 5, nn 1, nsze equal
//! to the device's size); fio on the block device (libaio, O_DIRECT, two jobs at queue depth
//! 8, random writes of 4..256 KiB with crc32c verify headers, verified after writing);
//! mkfs.ext4, mount, files, umount, `e2fsck -f -n` clean, the files' sums after a remount;
//! `ferroraid fail` takes a member out a third of the way through fio; `nvme disconnect`
//! with no kernel complaint so far (error, reset, timeout, recovery; the shutdown by CC.SHN
//! included). Then `nvme connect -g -G` (header and data digests), the sums and fio on
//! files; the target stopped (SIGTERM, exit 0, array clean) and started again on the five
//! survivors under the connected host, whose reconnect loop brings the controller back:
//! `e2fsck -f -n`, the sums and `fio --verify_only` agree, with reads rebuilt from parity.
//! Last, the reference: the same commands against the kernel's own `nvmet-tcp` exporting a
//! loop device on the same portal.
//!
//! The script fails on any deviation; this test holds its summary to the same facts. The
//! result is cached in `target/tmp/kernel-nvmf`, keyed on the scripts, the ferroraid binary,
//! fio, e2fsprogs and the nvme-cli packages. Without `qemu-system-x86_64`, fio, e2fsprogs, a
//! kernel for the rig or the nvme-cli package (fetched with `apt-get download`), it prints
//! `SKIPPED kernel_nvmf: why` and passes, unless `FERRORAID_REQUIRE_QEMU=1`.

use std::path::Path;

use ferroraid_tests::{number_after, repo_root, summary_has as has, summary_line as line};

/// The subsystem NQN of the guest's array (named `knvmf`; docs/NVMF.md, "Identity").
const NQN: &str = "nqn.2026-11.org.ferroraid:knvmf";

#[test]
fn kernel_nvme_tcp_host_discover_connect_fio_ext4_disconnect() {
    let script = repo_root().join("tests/qemu/kernel-nvmf.sh");
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernel-nvmf");
    let Some(ferroraid_tests::KernelClientRun {
        out,
        summary,
        start,
    }) = ferroraid_tests::run_kernel_client_rig("kernel_nvmf", &script, &out_dir, "nvme-cli")
    else {
        return;
    };

    has(
        &summary,
        "modprobe",
        &["nvme_tcp", "/dev/nvme-fabrics present"],
    );
    has(&summary, "discover", &["trtype tcp", NQN, "trsvcid 4420"]);
    has(
        &summary,
        "connect",
        &["state live", "transport tcp", " bytes"],
    );
    let subnqn = format!("subnqn {NQN},");
    has(
        &summary,
        "id-ctrl",
        &[&subnqn, "mdts 5,", "nn 1,", "cntrltype 1,"],
    );
    has(&summary, "id-ns", &["= ncap x"]);
    let nsze = number_after(line(&summary, "id-ns"), "nsze ").unwrap_or(0);
    assert!(nsze > 0, "id-ns: no namespace size in {summary}");
    // fio on the block device wrote through a member failure and verified what it wrote.
    has(&summary, "fail", &["fio still running", "is now degraded"]);
    has(
        &summary,
        "fio",
        &["crc32c: exit 0", "write: IOPS=", "verify read: IOPS="],
    );
    let fio = line(&summary, "fio");
    let before = number_after(fio, "; writes ").unwrap_or(0);
    let all = number_after(fio, " before the fail, ").unwrap_or(0);
    assert!(
        before > 0 && all > before,
        "fio: no writes on both sides of the member failure: {fio:?}"
    );
    has(&summary, "mkfs", &["/dev/nvme"]);
    has(&summary, "e2fsck", &["exit 0", "files"]);
    has(&summary, "remount", &["sha256 4/4 files OK"]);
    has(&summary, "disconnect", &["disconnected 1 controller"]);
    // Nothing so far (failure, shutdown by CC.SHN included) made the kernel complain.
    has(&summary, "kernel-log", &["no complaint"]);
    has(
        &summary,
        "digests",
        &[
            "nvme connect -g -G",
            "state live",
            "sha256 4/4 OK",
            "write: IOPS=",
        ],
    );
    // The target restarted under the connected host; its reconnect loop took it back.
    has(
        &summary,
        "restart",
        &["live again", "Successfully reconnected", "degraded start"],
    );
    has(
        &summary,
        "after-restart",
        &[
            "e2fsck -f -n clean",
            "sha256 6 files OK",
            "fio --verify_only exit 0",
        ],
    );
    has(&summary, "restart-log", &["Successfully reconnected"]);
    for stop in ["stop-1", "stop-2"] {
        has(
            &summary,
            stop,
            &["serve exit 0", "array stopped", "clean=true"],
        );
    }
    // The reference: the same commands against the kernel's own nvmet-tcp pass too.
    has(
        &summary,
        "nvmet",
        &[
            "discover lists nqn.2014-08.org.ferroraid:nvmet-ref",
            "fio exit 0",
            "e2fsck -f -n clean",
            "-g -G sums 4/4 OK",
            "no complaint",
        ],
    );
    has(&summary, "nvmet-id-ctrl", &["cntrltype 1,"]);
    let degraded = number_after(line(&summary, "stop-2"), " direct, ").unwrap_or(0);
    assert!(degraded > 0, "stop-2: no degraded read served:\n{summary}");
    ferroraid_tests::print_rig_summary("kernel_nvmf", start, &out_dir, &out, &summary);
}
