#!/usr/bin/env python3
"""fio over NBD: ferroraid's RAID6 array vs. qemu-nbd serving one member file, same run.

Usage:  python3 bench/nbd_bench.py [--dir DIR] [--member-mib N] [--seconds S] [--runs R]

Builds `ferroraid` (release), creates a RAID6 over six member files in DIR (default a new
temporary directory on the file system of /var/tmp), serves it with `ferroraid serve`
(one polled reactor pinned to the last CPU), and runs fio workloads with fio's `nbd`
engine (pinned to CPU 0): 4 KiB random read QD32, 4 KiB random write QD32, 1 MiB
sequential write QD8, and the sub-stripe writes of the stripe-cache issue: 4 KiB
sequential write QD32, 64 KiB sequential write QD8, 4 KiB write QD1 with an fsync (NBD
flush) after each, 16 KiB random 70/30 read/write QD16 (IOPS of both sides added). Then it
serves one member-sized file with `qemu-nbd --cache=none
--aio=io_uring` (pinned to the same CPU as the reactor) and runs the same workloads. Both
targets are prefilled with data first (random reads of holes would measure nothing).
Prints a Markdown table with IOPS, MB/s and the ratio ferroraid / qemu-nbd per workload,
median over --runs runs, and the machine. Needs fio, qemu-nbd, qemu-img.
`--exe PATH` runs a given ferroraid binary (an older build, for before/after tables)
instead of building this tree; `--only NAME,...` runs a subset of the workloads (by the
short names in WORKLOADS); `--serve-args` passes more options to `ferroraid serve`.

`--device-mb-s B` (root) puts every file behind a loop device of its own (`losetup
--direct-io=on`) and runs both targets in a blkio cgroup (v1) that limits reads and writes
of each loop device to B MB/s (`blkio.throttle.{read,write}_bps_device`): seven
independent devices of equal bandwidth, so the RAID's members add bandwidth as separate
drives do, and qemu-nbd serves one of those devices. With the files on tmpfs (`--dir
/dev/shm/...`) the throttle is the only limit. The loop devices and the cgroup made here
are removed at the end.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def release_binary(exe, package="ferroraid", binary="ferroraid"):
    """`exe` made absolute when given; else `binary` of `package`, built in release (in
    `CARGO_TARGET_DIR` when set, as cargo puts it)."""
    if exe:
        return os.path.abspath(exe)
    subprocess.run(["cargo", "build", "--release", "-q", "-p", package, "--bin", binary],
                   cwd=ROOT, check=True)
    target_dir = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    return os.path.join(target_dir, "release", binary)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_port(port, proc, what, timeout=30):
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            sys.exit(f"{what} exited early with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    sys.exit(f"{what} did not listen on {port} within {timeout} s")


def fio(uri, rw, bs, qd, seconds, size, cpu, extra=()):
    cmd = [
        "taskset", "-c", str(cpu),
        "fio", "--name=job", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}",
        f"--bs={bs}", f"--iodepth={qd}", f"--size={size}", "--time_based",
        f"--runtime={seconds}", "--output-format=json", "--randrepeat=0",
        "--norandommap", *extra,
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    # fio's nbd engine prints "fio: connected to NBD server" before the JSON.
    job = json.loads(out[out.index("{"):])["jobs"][0]
    if rw == "randrw":
        sides = [job["read"], job["write"]]
    else:
        sides = [job["read"] if rw.endswith("read") else job["write"]]
    return sum(x["iops"] for x in sides), sum(x["bw_bytes"] for x in sides) / 1e6


class Devices:
    """Loop devices over `files`, each limited to `mb_s` MB/s for the tasks of one blkio
    cgroup (v1). `wrap(cmd)` runs a command inside the cgroup; `close()` detaches the loop
    devices attached here and removes the cgroup."""

    ROOT = "/sys/fs/cgroup/blkio"

    @classmethod
    def check(cls, mb_s):
        """Exits with the reason when devices of `mb_s` MB/s cannot be made here."""
        if mb_s <= 0:
            sys.exit("--device-mb-s takes a positive number of MB/s")
        if os.geteuid() != 0:
            sys.exit("--device-mb-s needs root (losetup and a blkio cgroup)")
        if not os.path.isfile(os.path.join(cls.ROOT, "blkio.throttle.write_bps_device")):
            sys.exit(f"--device-mb-s needs the cgroup v1 blkio controller at {cls.ROOT}")

    def __init__(self, files, mb_s):
        self.loops = []
        self.cgroup = os.path.join(self.ROOT, f"ferroraid-nbd-bench-{os.getpid()}")
        os.mkdir(self.cgroup)
        try:
            for f in files:
                dev = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", f],
                                     check=True, capture_output=True,
                                     text=True).stdout.strip()
                self.loops.append(dev)
                st = os.stat(dev)
                rule = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)} {mb_s * 1_000_000}"
                for knob in ("read_bps_device", "write_bps_device"):
                    with open(os.path.join(self.cgroup, f"blkio.throttle.{knob}"), "w") as k:
                        k.write(rule)
        except BaseException:
            self.close()
            raise

    def wrap(self, cmd):
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', self.cgroup, *cmd]

    def close(self):
        """Detaches this run's loop devices and removes its cgroup; what cannot be undone
        is reported, never raised (it would hide the error that brought us here)."""
        for dev in self.loops:
            r = subprocess.run(["losetup", "-d", dev], capture_output=True, text=True)
            if r.returncode != 0:
                print(f"warning: losetup -d {dev}: {r.stderr.strip()}", file=sys.stderr)
        self.loops = []
        if os.path.isdir(self.cgroup):
            # A process left inside (a server that would not stop) keeps the cgroup busy:
            # move it back to the root first.
            try:
                with open(os.path.join(self.cgroup, "cgroup.procs")) as f:
                    left = f.read().split()
                for pid in left:
                    with open(os.path.join(self.ROOT, "cgroup.procs"), "w") as f:
                        f.write(pid)
                os.rmdir(self.cgroup)
            except OSError as e:
                print(f"warning: removing {self.cgroup}: {e}", file=sys.stderr)


def stop(proc, ask, timeout):
    """Asks `proc` to stop (`ask(proc)`), killing it after `timeout` s; the timeout is
    still raised (a server that does not stop on request is a finding)."""
    ask(proc)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def prefill(uri, size, cpu):
    subprocess.run(
        ["taskset", "-c", str(cpu), "fio", "--name=fill", "--ioengine=nbd", f"--uri={uri}",
         "--rw=write", "--bs=1m", "--iodepth=8", f"--size={size}",
         "--output-format=json"],
        check=True, capture_output=True)


# (short name, title, fio rw, block size, queue depth, extra fio options)
ALL_WORKLOADS = [
    ("randread", "4 KiB random read, QD32", "randread", "4k", 32, ()),
    ("randwrite", "4 KiB random write, QD32", "randwrite", "4k", 32, ()),
    ("seq1m", "1 MiB sequential write, QD8", "write", "1m", 8, ()),
    ("seq4k", "4 KiB sequential write, QD32", "write", "4k", 32, ()),
    ("seq64k", "64 KiB sequential write, QD8", "write", "64k", 8, ()),
    ("fsync4k", "4 KiB write + fsync each, QD1", "write", "4k", 1, ("--fsync=1",)),
    ("randrw16k", "16 KiB random 70/30 read/write, QD16", "randrw", "16k", 16,
     ("--rwmixread=70",)),
]
WORKLOADS = ALL_WORKLOADS


def measure(uri, size, seconds, cpu):
    prefill(uri, size, cpu)
    return [fio(uri, rw, bs, qd, seconds, size, cpu, extra)
            for _, _, rw, bs, qd, extra in WORKLOADS]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir")
    ap.add_argument("--member-mib", type=int, default=512)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--exe", help="a prebuilt ferroraid binary to measure")
    ap.add_argument("--serve-args", default="",
                    help="extra arguments for `ferroraid serve`, split on spaces "
                    "(e.g. '--stripe-cache 64M')")
    ap.add_argument("--device-mb-s", type=int,
                    help="each file behind its own loop device limited to this many MB/s "
                    "(root; see above)")
    ap.add_argument("--only", help="comma-separated workload names: "
                    + ",".join(w[0] for w in ALL_WORKLOADS))
    a = ap.parse_args()
    global WORKLOADS
    if a.only:
        names = a.only.split(",")
        unknown = [n for n in names if n not in {w[0] for w in ALL_WORKLOADS}]
        if unknown:
            sys.exit(f"unknown workloads {unknown}")
        WORKLOADS = [w for w in ALL_WORKLOADS if w[0] in names]
    for tool in ("fio", "qemu-nbd", "taskset") + (("losetup",) if a.device_mb_s is not None else ()):
        if not shutil.which(tool):
            sys.exit(f"{tool} is not installed")
    if a.device_mb_s is not None:
        Devices.check(a.device_mb_s)
    exe = release_binary(a.exe)
    cpus = sorted(os.sched_getaffinity(0))
    target_cpu, client_cpu = cpus[-1], cpus[0]
    work = a.dir or tempfile.mkdtemp(prefix="nbd-bench-", dir="/var/tmp")
    os.makedirs(work, exist_ok=True)
    size = a.member_mib << 20
    members = [os.path.join(work, f"m{i}.img") for i in range(6)]
    for m in members:
        with open(m, "wb") as f:
            f.truncate(size)
    single = os.path.join(work, "single.img")
    with open(single, "wb") as f:
        f.truncate(size)
    devices = None
    try:
        if a.device_mb_s is not None:
            devices = Devices(members + [single], a.device_mb_s)
        run_all(a, exe, members, single, devices, target_cpu, client_cpu, work)
    finally:
        if devices:
            devices.close()
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


def run_all(a, exe, members, single, devices, target_cpu, client_cpu, work):
    wrap = devices.wrap if devices else (lambda cmd: cmd)
    if devices:
        members, single = devices.loops[:-1], devices.loops[-1]
    subprocess.run([exe, "create", "--level", "6", "--name", "bench", "--force", *members],
                   check=True, capture_output=True)
    # The array's capacity is 4 data members' worth, less md's data offset; the
    # comparison uses the same byte range on both targets: one member's size less 8 MiB.
    span = f"{a.member_mib - 8}m"

    rows = {w[1]: ([], []) for w in WORKLOADS}
    for run in range(a.runs):
        port = free_port()
        srv = subprocess.Popen(wrap(
            [exe, "serve", "--polled", "--cores", str(target_cpu), "--nbd",
             f"127.0.0.1:{port}", *a.serve_args.split(), *members]),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_port(port, srv, "ferroraid serve")
            res = measure(f"nbd://127.0.0.1:{port}/bench", span, a.seconds, client_cpu)
        finally:
            stop(srv, lambda p: p.send_signal(signal.SIGTERM), 60)
        for (_, name, *_), r in zip(WORKLOADS, res):
            rows[name][0].append(r)
        port = free_port()
        q = subprocess.Popen(wrap(
            ["taskset", "-c", str(target_cpu), "qemu-nbd", "-f", "raw", "--cache=none",
             "--aio=io_uring", "-x", "single", "-b", "127.0.0.1", "-p", str(port),
             "--persistent", "--shared=8", single]),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_port(port, q, "qemu-nbd")
            res = measure(f"nbd://127.0.0.1:{port}/single", span, a.seconds, client_cpu)
        finally:
            stop(q, subprocess.Popen.terminate, 30)
        for (_, name, *_), r in zip(WORKLOADS, res):
            rows[name][1].append(r)
        print(f"run {run + 1}/{a.runs} done", file=sys.stderr)

    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                  if l.startswith("model name")), "unknown CPU")
    print(f"- machine: {model}, {os.cpu_count()} CPUs; target on CPU {target_cpu}, "
          f"fio on CPU {client_cpu}; {a.runs} runs of {a.seconds} s, medians")
    print(f"- ferroraid: RAID6, 6 members of {a.member_mib} MiB, 64 KiB chunk, one polled "
          f"reactor; qemu-nbd: one {a.member_mib} MiB file, --cache=none --aio=io_uring; "
          f"files in {work}"
          + (f", each behind a loop device limited to {a.device_mb_s} MB/s (blkio)"
             if devices else ""))
    print()
    print(f"- ferroraid binary: {exe}" + (f", serve {a.serve_args}" if a.serve_args else ""))
    print()
    print("| workload | ferroraid IOPS | ferroraid MB/s | qemu-nbd IOPS | qemu-nbd MB/s | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for _, name, *_ in WORKLOADS:
        ours, theirs = rows[name]
        oi = statistics.median(x[0] for x in ours)
        ob = statistics.median(x[1] for x in ours)
        ti = statistics.median(x[0] for x in theirs)
        tb = statistics.median(x[1] for x in theirs)
        print(f"| {name} | {oi:,.0f} | {ob:,.1f} | {ti:,.0f} | {tb:,.1f} | {oi / ti:.2f}× |")


if __name__ == "__main__":
    main()
