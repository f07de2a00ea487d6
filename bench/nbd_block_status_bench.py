#!/usr/bin/env python3
"""NBD block status (issue 18): what `nbdcopy` and `qemu-img convert` save on a
half-empty export, with `--nbd-block-status on` against `off`.

Usage:  python3 bench/nbd_block_status_bench.py [--exe PATH] [--dir DIR] [--runs R]
                                                [--size-mib N]

Creates a RAID6 over six sparse member files (64 KiB chunk; `ferroraid create` punches
holes over the data areas) whose export is --size-mib (default 1024 MiB), serves it
(`ferroraid serve --adaptive`, one reactor), writes the first half of the export with
`nbdcopy` from a random file, then for each setting (`on`, `off`; a fresh `serve` each,
whose zero map is rebuilt from the members' allocation):
- R times `nbdcopy nbd://... null:` (the whole export to nowhere): wall time, the bytes
  the server sent as read data (its "connection closed" log lines, `bytes_read`) and the
  bytes read from the members (`ferroraid status --json`: members[].io.read_bytes);
- R times `qemu-img convert -O raw nbd://... out.raw`: wall time and the space the
  output takes (`du`) against its size (qemu-img also skips writing zero blocks it
  reads, so the output is sparse either way: the difference is what crosses the wire).
Prints a Markdown table with medians and the machine. Needs nbdcopy and qemu-img.
`--exe PATH` runs a given ferroraid binary instead of building this tree.
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True  # no bench/__pycache__ from the import below
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nbd_bench import free_port, release_binary, wait_port  # noqa: E402  (the same helpers)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "bs"
CHUNK = 64 << 10


class Serve:
    """`ferroraid serve` with block status on or off; its log goes to a file."""

    def __init__(self, exe, members, work, block_status):
        self.exe, self.port = exe, free_port()
        self.rpc = os.path.join(work, "rpc.sock")
        self.log_path = os.path.join(work, f"serve-{block_status}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [exe, "serve", "--adaptive", "--reactors", "1", "--nbd", f"127.0.0.1:{self.port}",
             "--rpc", self.rpc, "--nbd-block-status", block_status, *members],
            stdout=subprocess.DEVNULL, stderr=self.log, env={**os.environ, "RUST_LOG": "info"})
        wait_port(self.port, self.proc, "ferroraid serve", timeout=60)
        self.uri = f"nbd://127.0.0.1:{self.port}/{NAME}"

    def member_read_bytes(self):
        out = subprocess.run([self.exe, "status", "--json", "--rpc", self.rpc],
                             capture_output=True, text=True).stdout
        return sum(m["io"]["read_bytes"] for m in json.loads(out)["members"])

    def nbd_bytes_read(self):
        """Read data the server sent, summed over the closed connections' log lines."""
        with open(self.log_path) as f:
            return sum(int(m.group(1)) for m in re.finditer(r"bytes_read=(\d+)", f.read()))

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        self.log.close()


def timed(cmd):
    t = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exe")
    ap.add_argument("--dir")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=1024)
    a = ap.parse_args()
    for tool in ("nbdcopy", "nbdinfo", "qemu-img", "du"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is not installed")
    exe = release_binary(a.exe)
    work = a.dir or tempfile.mkdtemp(prefix="nbd-bs-bench-", dir="/var/tmp")
    os.makedirs(work, exist_ok=True)
    # 4 data members of size/4 each, plus md's data offset (1 MiB for members this small;
    # the export size printed is the one served).
    members = [os.path.join(work, f"m{i}.img") for i in range(6)]
    for m in members:
        with open(m, "wb") as f:
            f.truncate((a.size_mib << 20) // 4 + (1 << 20))
    subprocess.run([exe, "create", "--level", "6", "--chunk", "64K", "--name", NAME, "--force",
                    *members], check=True, capture_output=True)
    half = os.path.join(work, "half.raw")
    with open(half, "wb") as f:
        for _ in range(a.size_mib // 2):
            f.write(os.urandom(1 << 20))
    s = Serve(exe, members, work, "on")
    try:
        timed(["nbdcopy", "--flush", half, s.uri])
    finally:
        s.stop()
    os.remove(half)

    rows = {}
    for mode in ("on", "off"):
        s = Serve(exe, members, work, mode)
        try:
            times, wire, member = [], [], []
            for _ in range(a.runs):
                w0, m0 = s.nbd_bytes_read(), s.member_read_bytes()
                times.append(timed(["nbdcopy", s.uri, "null:"]))
                time.sleep(0.5)  # the connections' closing log lines
                wire.append(s.nbd_bytes_read() - w0)
                member.append(s.member_read_bytes() - m0)
            out = os.path.join(work, f"out-{mode}.raw")
            qts = []
            w0 = s.nbd_bytes_read()
            for _ in range(a.runs):
                qts.append(timed(["qemu-img", "convert", "-O", "raw", s.uri, out]))
                du = int(subprocess.run(["du", "--block-size=1", out], capture_output=True,
                                        text=True, check=True).stdout.split()[0])
                size = os.path.getsize(out)
                os.remove(out)
            qt = statistics.median(qts)
            time.sleep(0.5)
            qwire = (s.nbd_bytes_read() - w0) / a.runs
            export = int(subprocess.run(["nbdinfo", "--size", s.uri], capture_output=True,
                                        text=True, check=True).stdout)
        finally:
            s.stop()
        rows[mode] = (statistics.median(times), statistics.median(wire),
                      statistics.median(member), qt, qwire, du, size, times)
        print(f"block status {mode}: done", file=sys.stderr)

    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                  if l.startswith("model name")), "unknown CPU")
    mib = 1 << 20
    print(f"RAID6 × 6 sparse files, 64 KiB chunk, {export / mib:.0f} MiB export, first "
          f"{a.size_mib // 2} MiB written; {os.cpu_count()} CPUs ({model}); medians of {a.runs}\n")
    print("| block status | nbdcopy → null: s (runs) | read data sent, MiB | member reads, MiB "
          "| qemu-img convert s | its read data sent, MiB | output allocated / size, MiB |")
    print("|---|---|---|---|---|---|---|")
    for mode, (t, w, m, qt, qw, du, size, times) in rows.items():
        print(f"| {mode} | {t:.2f} ({', '.join(f'{x:.2f}' for x in times)}) | {w / mib:.0f} "
              f"| {m / mib:.0f} | {qt:.2f} | {qw / mib:.0f} | {du / mib:.0f} / {size / mib:.0f} |")
    if not a.dir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
