#!/usr/bin/env python3
"""NVMe/TCP vs NBD vs iSCSI on the same array, per target core (issue 22), in one run.

Usage:  python3 bench/fronts_bench.py [--seconds 4] [--runs 3] [--members null,file]
            [--reactors 1,2] [--fronts nvmf,nbd,iscsi] [--only randread,...]
            [--span-mib 1024] [--fio-iscsi PATH] [--json PATH]
            [--null-serve PATH] [--serve PATH] [--nvmf-load PATH]

One target process serves the array over all three fronts at once (`--nbd`, `--iscsi`,
`--nvmf`: they share the reactors, each front polled every loop turn), restarted for
every repetition; within a repetition each workload runs over the three fronts one after
the other, their order rotated by repetition and workload. Members:

- `null`: `nbd-null-serve` (bench/src/bin/nbd-null-serve.rs; serve's front ends and
  reactor with serve's defaults over a RAID6 of six `drivers::null` members, 64 KiB
  chunk: every member request completes at the next poll). `ferroraid serve` itself has
  no `null` member kind.
- `file`: `ferroraid serve` over a RAID6 of six member files (`ferroraid create --level
  6`) in a fresh directory under /var/tmp, the array written once through NBD first so
  reads find data.

Both run `--adaptive` (a reactor spins 1000 idle turns, then naps up to 200 µs: a polled
reactor would show 100 % CPU whatever the load) under `taskset`: 1 reactor on the last
CPU of this process's affinity with the clients on the others; 2 reactors on the last
two CPUs with the clients on the same CPUs (with 2 CPUs that is sharing both: the
2-reactor rows then measure a target and a client competing for the same cores).

Clients, one connection (queue, session) per reactor, each keeping the queue depth:
- NVMe/TCP: `nvmf-load` (bench/src/bin/nvmf-load.rs, our initiator: one I/O queue and
  thread per connection).
- NBD: fio's `nbd` engine (libnbd), one job per connection.
- iSCSI: fio's `libiscsi` engine, one job (session, own initiator name) per connection;
  Debian's fio lacks it, `--fio-iscsi` names a fio built with `--enable-libiscsi`.

Workloads: 4 KiB random read and write QD32 over `--span-mib` from offset 0, 128 KiB
sequential read and write QD8 (each connection its own part of the span).

Per run: target CPU = utime + stime of the target process (all threads, /proc/PID/stat)
from just before the client starts to just after it exits (connection setup included,
the adaptive reactor's idle spinning included, nothing subtracted), and of its
`reactor-N` threads alone (/proc/PID/task/TID/stat); client CPU = the client's own
utime + stime (getrusage of the waited-for child). Reported: IOPS and MB/s as the client
counts them, target CPU % (of one CPU) and µs per request, requests per target
CPU-second, client CPU % and µs per request. Medians over `--runs`.
"""

import argparse
import contextlib
import glob
import json
import os
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True  # no bench/__pycache__ from the imports below
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nbd_bench import free_port, release_binary, wait_port  # noqa: E402  (the same helpers)
from nbd_frontend_bench import CLK_TCK, cpu_seconds, loadavg  # noqa: E402
from reader_writer_bench import (  # noqa: E402
    IQN, ClientFailed, Ferroraid, Interrupted, cpu_list, find_iscsi_fio, fio_escape,
    on_signal, run_client, spawn)

ARRAY = "bench"  # reader_writer_bench's array name: IQN iqn.2026-11.org.ferroraid:bench

# (short name, title, nvmf-load workload, fio rw, block size bytes, queue depth)
ALL_WORKLOADS = [
    ("randread", "4 KiB random read, QD32", "randread", "randread", 4096, 32),
    ("randwrite", "4 KiB random write, QD32", "randwrite", "randwrite", 4096, 32),
    ("seqread", "128 KiB sequential read, QD8", "seqread", "read", 128 << 10, 8),
    ("seqwrite", "128 KiB sequential write, QD8", "seqwrite", "write", 128 << 10, 8),
]
FRONTS = {"nvmf": "NVMe/TCP", "nbd": "NBD", "iscsi": "iSCSI"}


def reactor_seconds(pid):
    """utime + stime of each `reactor-N` thread of `pid`, seconds, by thread name."""
    out = {}
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(f"{task}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except FileNotFoundError:  # a thread that just exited
            continue
        comm = head.split("(", 1)[1]
        if comm.startswith("reactor-"):
            fields = rest.split()
            out[comm] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Target:
    """A started target: its process and the three fronts' addresses."""

    def __init__(self, proc, ports):
        self.proc, self.ports = proc, ports

    def uri(self, front):
        p = self.ports[front]
        if front == "nbd":
            return f"nbd://127.0.0.1:{p}/{ARRAY}"
        if front == "iscsi":
            return f"iscsi://127.0.0.1:{p}/{IQN}/0"
        return f"127.0.0.1:{p}"


def start_target(stack, argv, cpus, what):
    """`argv` (without the listen options) pinned to `cpus`, serving all three fronts."""
    ports = {f: free_port() for f in FRONTS}
    cmd = ["taskset", "-c", cpu_list(cpus), *argv,
           "--nbd", f"127.0.0.1:{ports['nbd']}", "--iscsi", f"127.0.0.1:{ports['iscsi']}",
           "--nvmf", f"127.0.0.1:{ports['nvmf']}"]
    proc = spawn(stack, cmd, what)
    for p in ports.values():
        wait_port(p, proc, what)
    return Target(proc, ports)


class NullMembers:
    label = "null"

    def __init__(self, exe, span_mib):
        self.exe, self.span_mib = exe, span_mib

    def describe(self):
        return (f"nbd-null-serve: RAID6, 6 null members, 64 KiB chunk, "
                f"{self.span_mib} MiB export")

    def start(self, stack, cpus):
        return start_target(stack, [self.exe, "--level", "6", "--members", "6",
                                    "--chunk-kib", "64", "--export-mib", str(self.span_mib),
                                    "--name", ARRAY, "--mode", "adaptive",
                                    "--cores", cpu_list(cpus)], cpus, "nbd-null-serve")


class FileMembers(Ferroraid):
    """reader_writer_bench's array of six member files, served on all three fronts."""
    label = "file"

    def __init__(self, exe, work, span_mib):
        # The data area of each member is a quarter of the span, + md's 1 MiB offset and
        # room for the superblock.
        super().__init__(exe, work, span_mib // 4 + 2, work)
        self.work, self.prefilled = work, False

    def describe(self):
        return (f"ferroraid serve: RAID6, 6 member files on {fs_of(self.work)} "
                f"({self.work}), 64 KiB chunk")

    def start(self, stack, cpus):
        t = start_target(stack, [self.exe, "serve", "--adaptive", "--cores", cpu_list(cpus),
                                 "--rpc", self.sock, *self.members], cpus, "ferroraid serve")
        self.wait_idle()
        return t


def fs_of(path):
    return subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "--target", path],
                          capture_output=True, text=True).stdout.strip() or "unknown"


def client_cmd(front, w, jobs, seconds, span, tools, target):
    """The client command line of `front` for workload `w`, `jobs` connections."""
    short, _, load_w, rw, bs, qd = w
    if front == "nvmf":
        return [tools["nvmf-load"], "--addr", target.uri("nvmf"), "--queues", str(jobs),
                "--qd", str(qd), "--workload", load_w, "--seconds", str(seconds),
                "--range-mib", str(span >> 20)]
    seq = not short.startswith("rand")
    part = span // jobs if seq else span
    cmd = [tools["fio"] if front == "nbd" else tools["fio-iscsi"],
           "--thread", "--group_reporting", f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}",
           f"--size={part}", "--time_based", f"--runtime={seconds}",
           "--output-format=json", "--norandommap", "--randrepeat=0"]
    for j in range(jobs):
        cmd += [f"--name=c{j}", f"--offset={j * part if seq else 0}"]
        if front == "nbd":
            cmd += ["--ioengine=nbd", f"--uri={target.uri('nbd')}"]
        else:
            cmd += ["--ioengine=libiscsi", f"--filename={fio_escape(target.uri('iscsi'))}",
                    f"--initiator=iqn.2026-12.org.fio:c{j}"]
    return cmd


def parse_client(front, w, out):
    """(requests completed, IOPS, MB/s) from the client's output."""
    if front == "nvmf":
        r = json.loads(out.strip().splitlines()[-1])
        return r["ops"], r["iops"], r["mib_s"] * (1 << 20) / 1e6
    # fio's nbd engine prints "fio: connected to NBD server" and the libiscsi engine a
    # note on iodepth (it queues asynchronously all the same) before the JSON.
    job = json.loads(out[out.index("{"):])["jobs"][0]
    if job["error"]:
        raise RuntimeError(f"fio {w[3]} failed: error {job['error']}")
    side = job["read"] if "read" in w[3] else job["write"]
    return side["total_ios"], side["iops"], side["bw_bytes"] / 1e6


def measure(front, w, jobs, seconds, span, tools, target, client_cpus):
    cmd = ["taskset", "-c", cpu_list(client_cpus),
           *client_cmd(front, w, jobs, seconds, span, tools, target)]
    pid = target.proc.pid
    c0, r0, k0, t0 = cpu_seconds(pid), reactor_seconds(pid), children_cpu(), time.monotonic()
    out = run_client(cmd, timeout=seconds + 120)
    c1, r1, k1, t1 = cpu_seconds(pid), reactor_seconds(pid), children_cpu(), time.monotonic()
    ios, iops, mb_s = parse_client(front, w, out)
    return {"ios": ios, "iops": iops, "mb_s": mb_s, "target_cpu_s": c1 - c0,
            "reactor_cpu_s": {k: r1[k] - r0.get(k, 0.0) for k in r1},
            "client_cpu_s": k1 - k0, "wall_s": t1 - t0}


def summarise(runs):
    def med(f):
        return statistics.median(f(r) for r in runs)
    return {
        "iops": med(lambda r: r["iops"]), "mb_s": med(lambda r: r["mb_s"]),
        "target_pct": med(lambda r: 100 * r["target_cpu_s"] / r["wall_s"]),
        "target_us": med(lambda r: 1e6 * r["target_cpu_s"] / max(r["ios"], 1)),
        "reactor_us": med(lambda r: 1e6 * sum(r["reactor_cpu_s"].values()) / max(r["ios"], 1)),
        "per_cpu_s": med(lambda r: r["ios"] / max(r["target_cpu_s"], 1e-9)),
        "client_pct": med(lambda r: 100 * r["client_cpu_s"] / r["wall_s"]),
        "client_us": med(lambda r: 1e6 * r["client_cpu_s"] / max(r["ios"], 1)),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--members", default="null,file", help="subset of null,file")
    ap.add_argument("--reactors", default="1,2", help="subset of 1,2")
    ap.add_argument("--fronts", default="nvmf,nbd,iscsi", help="subset of nvmf,nbd,iscsi")
    ap.add_argument("--only", help="workloads: " + ",".join(w[0] for w in ALL_WORKLOADS))
    ap.add_argument("--span-mib", type=int, default=1024,
                    help="bytes of the array used (and the null export's size), MiB")
    ap.add_argument("--fio-iscsi", help="a fio with the libiscsi engine")
    ap.add_argument("--null-serve", help="a prebuilt nbd-null-serve")
    ap.add_argument("--serve", help="a prebuilt ferroraid")
    ap.add_argument("--nvmf-load", help="a prebuilt nvmf-load")
    ap.add_argument("--json", help="write every run's raw figures here")
    a = ap.parse_args()

    def subset(opt, value, allowed):
        got = [v for v in value.split(",") if v]
        bad = [v for v in got if v not in allowed]
        if not got or bad:
            sys.exit(f"{opt} {value!r}: a comma-separated subset of {','.join(allowed)}")
        return got

    kinds = subset("--members", a.members, ["null", "file"])
    reactor_counts = [int(r) for r in subset("--reactors", a.reactors, ["1", "2"])]
    fronts = subset("--fronts", a.fronts, list(FRONTS))
    names = subset("--only", a.only or ",".join(w[0] for w in ALL_WORKLOADS),
                   [w[0] for w in ALL_WORKLOADS])
    workloads = [w for w in ALL_WORKLOADS if w[0] in names]
    if a.span_mib < 64 or a.span_mib % 4:
        sys.exit("--span-mib: at least 64, a multiple of 4")
    span = a.span_mib << 20
    for tool in ("fio", "taskset", "findmnt"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is not installed")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("needs 2 CPUs: the target's and the clients'")
    tools = {"fio": "fio"}
    if "iscsi" in fronts:
        tools["fio-iscsi"], why = find_iscsi_fio(a.fio_iscsi)
        if why:
            sys.exit(f"iSCSI: {why} (or leave it out: --fronts nvmf,nbd)")
    if "nvmf" in fronts:
        tools["nvmf-load"] = release_binary(a.nvmf_load, "bench", "nvmf-load")
    null_exe = release_binary(a.null_serve, "bench", "nbd-null-serve") if "null" in kinds else None
    serve_exe = release_binary(a.serve) if "file" in kinds else None

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    load_before, started = loadavg(), time.time()
    # results[kind][reactors][workload][front] = [runs]
    results = {k: {n: {w[0]: {f: [] for f in fronts} for w in workloads}
                   for n in reactor_counts} for k in kinds}
    layout, describe = {}, {}
    with contextlib.ExitStack() as stack:
        for kind in kinds:
            if kind == "null":
                members = NullMembers(null_exe, a.span_mib)
            else:
                work = tempfile.mkdtemp(prefix="fronts-bench-", dir="/var/tmp")
                stack.callback(shutil.rmtree, work)
                members = FileMembers(serve_exe, work, a.span_mib)
            for n in reactor_counts:
                target_cpus = cpus[-n:]
                client_cpus = cpus[:-n] or cpus
                layout[n] = (target_cpus, client_cpus)
                for run in range(a.runs):
                    with contextlib.ExitStack() as tstack:
                        target = members.start(tstack, target_cpus)
                        if kind == "file" and not members.prefilled:
                            run_client(["taskset", "-c", cpu_list(client_cpus), "fio",
                                        "--name=fill", "--ioengine=nbd",
                                        f"--uri={target.uri('nbd')}", "--rw=write",
                                        "--bs=1m", "--iodepth=8", f"--size={span}",
                                        "--output-format=json"], timeout=900)
                            members.prefilled = True
                        for i, w in enumerate(workloads):
                            k = (run + i) % len(fronts)
                            for f in fronts[k:] + fronts[:k]:
                                results[kind][n][w[0]][f].append(measure(
                                    f, w, n, a.seconds, span, tools, target, client_cpus))
                    print(f"{kind} members, {n} reactor(s): run {run + 1}/{a.runs} done",
                          file=sys.stderr)
                describe[kind] = members.describe()
    load_after, minutes = loadavg(), (time.time() - started) / 60
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "results": results}, f, indent=1)

    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                  if l.startswith("model name")), "unknown CPU")
    print(f"- command: `python3 bench/fronts_bench.py {shlex.join(sys.argv[1:])}`")
    print(f"- machine: {model}, {len(cpus)} CPUs, kernel {os.uname().release}")
    for n, (t, c) in sorted(layout.items()):
        shared = " (the same CPUs: target and clients share them)" if set(t) & set(c) else ""
        print(f"- {n} reactor(s): target on CPU {cpu_list(t)}, clients on CPU "
              f"{cpu_list(c)}{shared}")
    print(f"- load average (1/5/15 min) before: {load_before}; after: {load_after} "
          f"({minutes:.1f} min)")
    print(f"- {a.runs} run(s) of {a.seconds} s per cell, medians; span {a.span_mib} MiB")
    for kind in kinds:
        print(f"- {kind} members: {describe[kind]}")
    print("- clients: NVMe/TCP nvmf-load; NBD fio nbd engine; iSCSI fio libiscsi engine "
          f"({tools.get('fio-iscsi', '-')}); one connection per reactor")
    print()
    print("| members | reactors | workload | front (client) | IOPS | MB/s | target CPU % "
          "| target µs/IO (reactors) | IO per target CPU-s | client CPU % | client µs/IO |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    client_name = {"nvmf": "nvmf-load", "nbd": "fio nbd", "iscsi": "fio libiscsi"}
    for kind in kinds:
        for n in reactor_counts:
            for w in workloads:
                for f in fronts:
                    s = summarise(results[kind][n][w[0]][f])
                    print(f"| {kind} | {n} | {w[1]} | {FRONTS[f]} ({client_name[f]}) "
                          f"| {s['iops']:,.0f} | {s['mb_s']:,.1f} | {s['target_pct']:.0f} "
                          f"| {s['target_us']:.2f} ({s['reactor_us']:.2f}) "
                          f"| {s['per_cpu_s']:,.0f} | {s['client_pct']:.0f} "
                          f"| {s['client_us']:.2f} |")


if __name__ == "__main__":
    try:
        main()
    except Interrupted as e:
        sys.exit(f"interrupted ({e}); everything started was stopped and removed")
    except ClientFailed as e:
        sys.exit(str(e))
