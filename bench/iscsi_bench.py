#!/usr/bin/env python3
"""iSCSI vs. NBD on the same ferroraid array, same run, same client.

Usage:  python3 bench/iscsi_bench.py [--dir DIR] [--member-mib N] [--runs R]
                                     [--reads N] [--writes N]

Builds `ferroraid` (release), creates a RAID6 over six member files in DIR (default a new
temporary directory under /var/tmp), and serves it with `ferroraid serve` exporting both
NBD and iSCSI (one polled reactor pinned to the last CPU). The client is `qemu-img bench`
(pinned to CPU 0) for both protocols, so the same initiator code (qemu's block layer,
its NBD client and its libiscsi driver) drives both and only the protocol differs:

- 4 KiB random read, QD32: `-s 4096 -d 32 -S STEP` with a step that is an odd multiple
  of 4 KiB and coprime to the array's size in blocks, so successive reads scatter over
  the whole array (qemu-img bench wraps the offset at the end);
- 1 MiB sequential write, QD8: `-w -s 1M -d 8`.

The array is prefilled (over NBD) first. Prints a Markdown table with IOPS, MB/s and the
ratio iSCSI / NBD per workload, median over --runs runs, and the machine. Needs qemu-img
with the iSCSI driver (Debian: qemu-utils + qemu-block-extra) and taskset.
"""

import argparse
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nbd_bench import ROOT, free_port, wait_port  # noqa: E402  (the same helpers)


def bench(url, cpu, count, size, depth, write=False, step=None):
    """One `qemu-img bench` run: (IOPS, MB/s)."""
    cmd = ["taskset", "-c", str(cpu), "qemu-img", "bench", "-f", "raw", "-t", "none",
           "-c", str(count), "-d", str(depth), "-s", str(size)]
    if write:
        cmd.append("-w")
    if step is not None:
        cmd += ["-S", str(step)]
    out = subprocess.run(cmd + [url], check=True, capture_output=True, text=True).stdout
    m = re.search(r"Run completed in ([0-9.]+) seconds", out)
    if not m:
        sys.exit(f"no timing in qemu-img bench output: {out}")
    secs = float(m.group(1))
    return count / secs, count * size / secs / 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir")
    ap.add_argument("--member-mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--reads", type=int, default=200_000, help="4 KiB reads per run")
    ap.add_argument("--writes", type=int, default=4_000, help="1 MiB writes per run")
    a = ap.parse_args()
    for tool in ("qemu-img", "taskset"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is not installed")
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "ferroraid"], cwd=ROOT,
                   check=True)
    target_dir = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    exe = os.path.join(target_dir, "release", "ferroraid")
    cpus = sorted(os.sched_getaffinity(0))
    target_cpu, client_cpu = cpus[-1], cpus[0]
    work = a.dir or tempfile.mkdtemp(prefix="iscsi-bench-", dir="/var/tmp")
    os.makedirs(work, exist_ok=True)
    members = [os.path.join(work, f"m{i}.img") for i in range(6)]
    for m in members:
        with open(m, "wb") as f:
            f.truncate(a.member_mib << 20)
    out = subprocess.run([exe, "create", "--level", "6", "--name", "bench", "--force",
                          *members], check=True, capture_output=True, text=True).stdout
    capacity = int(re.search(r", (\d+) bytes, data offset", out).group(1))
    blocks = capacity // 4096
    # An odd multiple of 4 KiB whose block count is coprime to the array's: every read
    # lands on a different block until the whole array was visited.
    k = 7919
    while math.gcd(k, blocks) != 1:
        k += 2
    step = k * 4096

    workloads = [
        ("4 KiB random read, QD32", dict(count=a.reads, size=4096, depth=32, step=step)),
        ("1 MiB sequential write, QD8",
         dict(count=a.writes, size=1 << 20, depth=8, write=True)),
    ]
    rows = {name: ([], []) for name, _ in workloads}
    for run in range(a.runs):
        nbd_port, iscsi_port = free_port(), free_port()
        srv = subprocess.Popen(
            [exe, "serve", "--polled", "--cores", str(target_cpu),
             "--nbd", f"127.0.0.1:{nbd_port}", "--iscsi", f"127.0.0.1:{iscsi_port}",
             *members],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_port(nbd_port, srv, "ferroraid serve")
            wait_port(iscsi_port, srv, "ferroraid serve")
            nbd = f"nbd://127.0.0.1:{nbd_port}/bench"
            iscsi = f"iscsi://127.0.0.1:{iscsi_port}/iqn.2026-11.org.ferroraid:bench/0"
            if run == 0:
                bench(nbd, client_cpu, capacity >> 20, 1 << 20, 8, write=True)
            for name, w in workloads:
                # Alternate the order so neither protocol always runs on a warmer cache.
                order = [(0, iscsi), (1, nbd)] if run % 2 == 0 else [(1, nbd), (0, iscsi)]
                for side, url in order:
                    rows[name][side].append(bench(url, client_cpu, **w))
        finally:
            srv.send_signal(signal.SIGTERM)
            srv.wait(timeout=60)
        print(f"run {run + 1}/{a.runs} done", file=sys.stderr)

    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                  if l.startswith("model name")), "unknown CPU")
    print(f"- machine: {model}, {os.cpu_count()} CPUs; target on CPU {target_cpu}, "
          f"qemu-img bench on CPU {client_cpu}; {a.runs} runs, medians")
    print(f"- ferroraid: RAID6, 6 members of {a.member_mib} MiB, 64 KiB chunk, one polled "
          f"reactor serving NBD and iSCSI at once; files in {work}")
    print(f"- reads: {a.reads} × 4 KiB, step {step} bytes; writes: {a.writes} × 1 MiB")
    print()
    print("| workload | iSCSI IOPS | iSCSI MB/s | NBD IOPS | NBD MB/s | iSCSI / NBD |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, _ in workloads:
        isc, nbd = rows[name]
        ii = statistics.median(x[0] for x in isc)
        ib = statistics.median(x[1] for x in isc)
        ni = statistics.median(x[0] for x in nbd)
        nb = statistics.median(x[1] for x in nbd)
        print(f"| {name} | {ii:,.0f} | {ib:,.1f} | {ni:,.0f} | {nb:,.1f} | {ii / ni:.2f}× |")
    if not a.dir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
