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

/// The subsystem NQN of the multipath guest's array (named `kmp`).
const MP_NQN: &str = "nqn.2026-11.org.ferroraid:kmp";

/// Issue 22, Build 2 / Done when: "fio verify runs through a portal going down and back with
/// zero errors; `nvme list-subsys` shows the ANA states changing". `tests/qemu/kernel-nvmf-mp.sh`
/// (kernel-nvmf.sh's rig, `kernel-nvmf-mp.guest.sh` in the guest) serves one array on
/// 127.0.0.1:4420 and 127.0.0.2:4420 and connects the kernel's host to both: one multipath
/// head node with two paths, round-robin; under fio rounds (crc32c verify) the second portal
/// is set inaccessible, removed, added back (inaccessible) and set optimized with `ferroraid
/// portal ...`; at each step the guest records the controllers' states and the paths'
/// `ana_state` (sysfs), `nvme list-subsys`, the requests completed since the last step and the
/// kernel's new lines. The same sequence against the kernel's nvmet-tcp (ports on
/// 127.0.0.1:4421 and 127.0.0.2:4421, `ana_groups/1/ana_state`) runs first as the reference;
/// this test holds both to the same facts. Cached in `target/tmp/kernel-nvmf-mp`; skips
/// like the test above.
#[test]
fn kernel_nvme_multipath_rides_through_a_portal_going_down_and_back() {
    let script = repo_root().join("tests/qemu/kernel-nvmf-mp.sh");
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernel-nvmf-mp");
    let Some(ferroraid_tests::KernelClientRun {
        out,
        summary,
        start,
    }) = ferroraid_tests::run_kernel_client_rig(
        "kernel_nvmf multipath",
        &script,
        &out_dir,
        "nvme-cli",
    )
    else {
        return;
    };
    has(&summary, "multipath", &["nvme_core multipath=Y"]);
    has(&summary, "portals", &["127.0.0.1:4420", "127.0.0.2:4420"]);
    let one = "127.0.0.1=live/optimized";
    for b in ["nvmet", "fr"] {
        let key = |step: &str| format!("{b}-{step}");
        // One namespace node, two paths (one per portal), both optimized, I/O going on.
        has(
            &summary,
            &key("paths"),
            &[
                ": /dev/nvme",
                " 1 heads, 2 paths, 2 controllers",
                "iopolicy round-robin",
                one,
                "127.0.0.2=live/optimized",
            ],
        );
        // ANA notices off on that controller: the host learnt the state from the status of
        // the I/O sent there (ANA Inaccessible, failover) and shows it in sysfs and
        // list-subsys.
        has(
            &summary,
            &key("inaccessible"),
            &[one, "127.0.0.2=live/inaccessible", "trsvcid=442"],
        );
        assert!(
            line(&summary, &key("inaccessible")).contains(" inaccessible |")
                || line(&summary, &key("inaccessible")).contains(" inaccessible;"),
            "{b}-inaccessible: list-subsys shows no inaccessible path:\n{summary}"
        );
        // Removed: its controller reconnects in a loop while I/O goes on through the other.
        has(&summary, &key("removed"), &[one, "127.0.0.2=connecting/"]);
        // Added back: the host's reconnect loop brings the controller back.
        has(
            &summary,
            &key("readded"),
            &[
                one,
                "127.0.0.2=live/inaccessible",
                "Successfully reconnected",
            ],
        );
        // Only the ANA change notice (AEN, then the log) can tell the host this one.
        has(
            &summary,
            &key("optimized"),
            &[one, "127.0.0.2=live/optimized"],
        );
        for step in ["paths", "inaccessible", "removed", "readded", "optimized"] {
            let l = line(&summary, &key(step));
            let ios = number_after(l, "I/O: ").unwrap_or(0);
            assert!(ios >= 64, "{b}-{step}: no I/O going on ({ios}): {l:?}");
        }
        // fio's rounds ran through it all: exit 0, no errors, verify passed.
        has(
            &summary,
            &key("fio"),
            &["crc32c verify", "each exit 0 err=0", " 0 with errors"],
        );
        has(
            &summary,
            &key("kernel"),
            &["no WARNING/BUG/Oops", "disconnected 2 controller"],
        );
    }
    has(&summary, "fr-paths", &[MP_NQN]);
    // What the host's multipath rests on (docs/NVMF.md): CMIC multi-port, multi-controller
    // and ANA; OAES with ANA change notices; ANATT 10 s; ANACAP optimized, non-optimized,
    // inaccessible + ANAGRPID fixed (71); one group; MNAN 1; the namespace shared, group 1.
    for b in ["nvmet", "fr"] {
        has(
            &summary,
            &format!("{b}-identify"),
            &[
                "cmic 0xb,",
                "oaes 0x900,",
                "anatt 10,",
                "nmic 0x1,",
                "anagrpid 1",
            ],
        );
    }
    has(
        &summary,
        "fr-identify",
        &["anacap 71,", "anagrpmax 1,", "nanagrpid 1,", "mnan 1,"],
    );
    // The target honoured Asynchronous Event Configuration: no notice while it was off, one
    // once the reconnect enabled it again.
    has(
        &summary,
        "fr-inaccessible",
        &["is inaccessible (0 controller(s) notified)"],
    );
    has(
        &summary,
        "fr-removed",
        &["removed (3 connection(s) closed)"],
    );
    has(&summary, "fr-readded", &["added (inaccessible)"]);
    has(
        &summary,
        "fr-optimized",
        &["is optimized (1 controller(s) notified)"],
    );
    has(&summary, "stop", &["serve exit 0", "clean=true"]);
    ferroraid_tests::print_rig_summary("kernel_nvmf multipath", start, &out_dir, &out, &summary);
}
