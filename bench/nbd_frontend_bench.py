#!/usr/bin/env python3
"""NBD front-end cost: ferroraid over `null` members vs. qemu-nbd over `null-co`, same run.

Usage:  python3 bench/nbd_frontend_bench.py [--seconds 5] [--runs 3] [--tls off,on]
            [--level 6] [--members 6] [--export-mib 4096] [--mode adaptive|polled]
            [--only randread,randwrite,seqread,seqwrite] [--exe PATH]

Issue 18: what the NBD front end costs per request, with no storage under it. Both
servers export the same number of bytes of nothing:

- ferroraid: `nbd-null-serve` (bench/src/bin/nbd-null-serve.rs; built here unless `--exe`):
  the NBD server and reactor of `ferroraid serve`, with serve's defaults, over a RAID
  array of `null` members (`drivers::null`: every request completes at the next poll,
  buffers untouched — reads send whatever the buffer held). `ferroraid serve` itself
  cannot do this: it assembles arrays from md superblocks on real devices and has no
  `null` member kind. One reactor, `--mode adaptive` by default (spins briefly when idle,
  then naps; `polled` never sleeps and so shows 100 % CPU whatever the load).
  Its cost includes the RAID engine (parity for writes), not only the front end.
- qemu-nbd: `qemu-nbd --image-opts driver=null-co,size=BYTES,read-zeroes=off`. null-co
  with `read-zeroes=off` leaves read buffers untouched, like ferroraid's null members
  (`read-zeroes=on` would add a memset per read).

Each server runs under `taskset` on the last CPU of this process's affinity, fio on the
others (with 2 CPUs: one each). Clients: fio's `nbd` engine (libnbd), one job, one
connection: 4 KiB random read QD32, 4 KiB random write QD32, 1 MiB sequential read QD8,
1 MiB sequential write QD8, `--seconds` each, over the whole export.

TLS (`--tls off,on`): with `on`, a throwaway CA and a server certificate (ECDSA P-256, for
localhost and 127.0.0.1) are made with openssl; ferroraid runs with `--tls require
--tls-cert --tls-key`, qemu-nbd with `--object tls-creds-x509,id=tls0,dir=DIR,
endpoint=server,verify-peer=off --tls-creds tls0` (no client certificates on either
side), and fio connects to `nbds://127.0.0.1:PORT/EXPORT`, libnbd verifying the server
against the CA. fio's nbd engine cannot be given the CA in the URI: libnbd refuses the
`tls-certificates=DIR` parameter ("local file access ... is not allowed") unless the
program calls nbd_set_uri_allow_local_file, which fio does not; and libnbd's default
directory is /etc/pki/libnbd for root, $HOME/.pki/libnbd otherwise. So with TLS on,
fio runs as `nobody` (setpriv) with HOME set to a directory of this run holding
.pki/libnbd/ca-cert.pem (nothing outside the run's temporary directory is written).
ferroraid's log names the negotiated TLS version and cipher suite; the script prints it.

Server CPU: utime + stime of the server process (all its threads, /proc/PID/stat) from just
before fio starts to just after it exits — connection setup, the TLS handshake and fio's
start and exit included — divided by the requests fio completed: µs of server CPU per
request. Nothing is subtracted: ferroraid's adaptive reactor spins a little whenever it
runs out of work, and that is in its figure. CPU % is that time over fio's wall time.

Every figure is the median over `--runs` runs (servers restarted each run, their order
alternating run to run); ratios are ferroraid ÷ qemu-nbd of the medians. The load average
before and after is printed: on a shared machine, read the figures with it.
"""

import argparse
import contextlib
import json
import os
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
from nbd_bench import ROOT, free_port, release_binary, wait_port  # noqa: E402  (the same helpers)
from reader_writer_bench import (  # noqa: E402
    ClientFailed, Interrupted, cpu_list, on_signal, run_client, spawn)

EXPORT = "bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")

# (short name, title, fio rw, block size, queue depth)
ALL_WORKLOADS = [
    ("randread", "4 KiB random read, QD32", "randread", "4k", 32),
    ("randwrite", "4 KiB random write, QD32", "randwrite", "4k", 32),
    ("seqread", "1 MiB sequential read, QD8", "read", "1m", 8),
    ("seqwrite", "1 MiB sequential write, QD8", "write", "1m", 8),
]


def cpu_seconds(pid):
    """utime + stime of process `pid`, all its threads (live and exited), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        # The command name (field 2) may hold spaces: split after its closing ')'.
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def make_certs(d):
    """A CA and a server certificate for localhost/127.0.0.1 (openssl, ECDSA P-256).
    Returns (server dir for qemu-nbd: ca-cert.pem, server-cert.pem, server-key.pem, also
    what ferroraid is given; the client's HOME, holding .pki/libnbd/ca-cert.pem)."""
    srv, cli = os.path.join(d, "server"), os.path.join(d, "client")
    os.makedirs(srv, mode=0o700)
    os.makedirs(cli)

    def ossl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    ca_key, ca_cert = os.path.join(d, "ca-key.pem"), os.path.join(srv, "ca-cert.pem")
    ossl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-out", ca_key)
    ossl("req", "-x509", "-new", "-key", ca_key, "-out", ca_cert, "-days", "2",
         "-subj", "/CN=nbd frontend bench CA",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    key, csr = os.path.join(srv, "server-key.pem"), os.path.join(d, "server.csr")
    cert = os.path.join(srv, "server-cert.pem")
    ossl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", key)
    ossl("req", "-new", "-key", key, "-out", csr, "-subj", "/CN=localhost")
    ext = os.path.join(d, "server.ext")
    with open(ext, "w") as f:
        f.write("basicConstraints=critical,CA:FALSE\n"
                "keyUsage=critical,digitalSignature\n"
                "extendedKeyUsage=serverAuth\n"
                "subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    ossl("x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "2", "-extfile", ext)
    # libnbd's default certificate directory of a non-root user (see the docstring).
    libnbd = os.path.join(cli, ".pki", "libnbd")
    os.makedirs(libnbd)
    shutil.copy(ca_cert, os.path.join(libnbd, "ca-cert.pem"))
    # fio runs as nobody: it must reach the CA (nothing here is secret but the keys).
    for p in (d, cli, os.path.join(cli, ".pki"), libnbd):
        os.chmod(p, 0o755)
    os.chmod(os.path.join(libnbd, "ca-cert.pem"), 0o644)
    return srv, cli


class Server:
    """One server kind: how to start it, plain or over TLS."""

    def __init__(self, name, argv, uri_path):
        self.name, self.argv, self.uri_path = name, argv, uri_path

    def start(self, stack, cpu, tls_dirs, log_path):
        port = free_port()
        cmd = ["taskset", "-c", str(cpu), *self.argv(port, cpu, tls_dirs)]
        proc = spawn(stack, cmd, self.name, log_path)
        wait_port(port, proc, self.name)
        if tls_dirs:
            uri = f"nbds://127.0.0.1:{port}/{self.uri_path}"
        else:
            uri = f"nbd://127.0.0.1:{port}/{self.uri_path}"
        return proc, uri


def ferroraid_server(exe, a):
    def argv(port, cpu, tls):
        cmd = [exe, "--level", str(a.level), "--members", str(a.members),
               "--chunk-kib", str(a.chunk_kib), "--export-mib", str(a.export_mib),
               "--name", EXPORT, "--nbd", f"127.0.0.1:{port}", "--cores", str(cpu),
               "--mode", a.mode]
        if tls:
            cmd += ["--tls", "require", "--tls-cert", os.path.join(tls[0], "server-cert.pem"),
                    "--tls-key", os.path.join(tls[0], "server-key.pem")]
        return cmd
    return Server("ferroraid", argv, EXPORT)


def qemu_server(size):
    def argv(port, cpu, tls):
        cmd = ["qemu-nbd", "--image-opts", f"driver=null-co,size={size},read-zeroes=off",
               "-x", EXPORT, "-b", "127.0.0.1", "-p", str(port), "--persistent",
               "--shared=8"]
        if tls:
            cmd += ["--object", f"tls-creds-x509,id=tls0,dir={tls[0]},endpoint=server,"
                                "verify-peer=off", "--tls-creds", "tls0"]
        return cmd
    return Server("qemu-nbd", argv, EXPORT)


def as_client(cmd, client_home):
    """`cmd` as the NBD client runs it: over TLS (`client_home` set), as nobody with that
    HOME, where libnbd finds the CA (see the module docstring)."""
    if client_home is None:
        return cmd
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "env",
            f"HOME={client_home}", *cmd]


def export_size(uri, client_home):
    """The export's size as a client sees it (nbdinfo), or None without nbdinfo."""
    if not shutil.which("nbdinfo"):
        return None
    return int(run_client(as_client(["nbdinfo", "--size", uri], client_home),
                          timeout=60).strip())


def fio_job(uri, workload, seconds, size, cpus, server_pid, client_home):
    """One fio job; returns IOPS, MB/s, requests, server CPU seconds, wall seconds."""
    _, _, rw, bs, qd = workload
    cmd = ["taskset", "-c", cpu_list(cpus), *as_client(["fio"], client_home),
           "--name=job", "--ioengine=nbd",
           f"--uri={uri}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}", f"--size={size}",
           "--time_based", f"--runtime={seconds}", "--output-format=json",
           "--randrepeat=0", "--norandommap"]
    c0, t0 = cpu_seconds(server_pid), time.monotonic()
    out = run_client(cmd, timeout=seconds + 120)
    c1, t1 = cpu_seconds(server_pid), time.monotonic()
    # fio's nbd engine prints "fio: connected to NBD server" before the JSON.
    job = json.loads(out[out.index("{"):])["jobs"][0]
    if job["error"]:
        raise RuntimeError(f"fio {rw} on {uri} failed: error {job['error']}")
    side = job["read"] if "read" in rw else job["write"]
    return {"iops": side["iops"], "mb_s": side["bw_bytes"] / 1e6,
            "ios": side["total_ios"], "cpu_s": c1 - c0, "wall_s": t1 - t0,
            "fio_cpu": job["usr_cpu"] + job["sys_cpu"]}


def tls_summary(log_path):
    """ferroraid's 'TLS established' log line, reduced to version and suite."""
    with open(log_path, errors="replace") as f:
        for line in f:
            if "TLS established" in line:
                words = dict(w.split("=", 1) for w in line.split() if "=" in w)
                return f"{words.get('version', '?')}, {words.get('suite', '?')}"
    return "no 'TLS established' line in the log"


def med(runs, key):
    return statistics.median(r[key] for r in runs)


def per_req_us(r):
    return 1e6 * r["cpu_s"] / max(r["ios"], 1)


def summarise(runs):
    return {
        "iops": med(runs, "iops"), "mb_s": med(runs, "mb_s"),
        "cpu_pct": statistics.median(100 * r["cpu_s"] / r["wall_s"] for r in runs),
        "us": statistics.median(per_req_us(r) for r in runs),
        "fio_cpu": med(runs, "fio_cpu"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tls", default="off,on", help="comma-separated subset of off,on")
    ap.add_argument("--level", type=int, default=6, choices=(5, 6))
    ap.add_argument("--members", type=int, default=6)
    ap.add_argument("--chunk-kib", type=int, default=64)
    ap.add_argument("--export-mib", type=int, default=4096)
    ap.add_argument("--mode", default="adaptive", choices=("adaptive", "polled"))
    ap.add_argument("--only", help="comma-separated workloads: "
                    + ",".join(w[0] for w in ALL_WORKLOADS))
    ap.add_argument("--exe", help="a prebuilt nbd-null-serve binary")
    a = ap.parse_args()
    tls_modes = [t for t in a.tls.split(",") if t]
    if not tls_modes or any(t not in ("off", "on") for t in tls_modes):
        sys.exit(f"--tls {a.tls!r}: a comma-separated subset of off,on")
    workloads = ALL_WORKLOADS
    if a.only:
        names = a.only.split(",")
        unknown = [n for n in names if n not in {w[0] for w in ALL_WORKLOADS}]
        if unknown:
            sys.exit(f"unknown workloads {unknown}")
        workloads = [w for w in ALL_WORKLOADS if w[0] in names]
    tools = ["fio", "qemu-nbd", "taskset"] + (["openssl"] if "on" in tls_modes else [])
    for tool in tools:
        if not shutil.which(tool):
            sys.exit(f"{tool} is not installed")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("needs 2 CPUs: one for the server, the others for fio")
    server_cpu, client_cpus = cpus[-1], cpus[:-1]

    exe = release_binary(a.exe, "bench", "nbd-null-serve")

    data = a.members - (2 if a.level == 6 else 1)
    stripe = data * a.chunk_kib * 1024
    size = (a.export_mib << 20) // stripe * stripe
    servers = [ferroraid_server(exe, a), qemu_server(size)]

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)

    load_before = loadavg()
    started = time.time()
    # results[tls][server][workload short name] = [per-run dicts]
    results = {t: {s.name: {w[0]: [] for w in workloads} for s in servers}
               for t in tls_modes}
    tls_info = None
    with contextlib.ExitStack() as stack:
        work = tempfile.mkdtemp(prefix="nbd-frontend-bench-")
        stack.callback(shutil.rmtree, work)
        if "on" in tls_modes:
            os.chmod(work, 0o755)  # fio (as nobody) reaches the CA below it
            tls_dirs = make_certs(os.path.join(work, "pki"))
        else:
            tls_dirs = None
        for run in range(a.runs):
            order = servers if run % 2 == 0 else servers[::-1]
            for t in tls_modes:
                for s in order:
                    log = os.path.join(work, f"{s.name}-{t}-{run}.log")
                    with contextlib.ExitStack() as srv_stack:
                        proc, uri = s.start(srv_stack, server_cpu,
                                            tls_dirs if t == "on" else None, log)
                        home = tls_dirs[1] if t == "on" else None
                        got = export_size(uri, home)
                        if got is not None and got != size:
                            sys.exit(f"{s.name} exports {got} bytes, expected {size}")
                        for w in workloads:
                            results[t][s.name][w[0]].append(fio_job(
                                uri, w, a.seconds, size, client_cpus, proc.pid, home))
                    if t == "on" and s.name == "ferroraid" and tls_info is None:
                        tls_info = tls_summary(log)
                    print(f"run {run + 1}/{a.runs}: TLS {t}: {s.name} done", file=sys.stderr)
    load_after = loadavg()
    minutes = (time.time() - started) / 60

    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                  if l.startswith("model name")), "unknown CPU")
    fio_version = subprocess.run(["fio", "--version"], capture_output=True,
                                 text=True).stdout.strip()
    qemu_version = subprocess.run(["qemu-nbd", "--version"], capture_output=True,
                                  text=True).stdout.splitlines()[0]
    print(f"- command: `python3 bench/nbd_frontend_bench.py {shlex.join(sys.argv[1:])}`")
    print(f"- machine: {model}, {len(cpus)} CPUs for this run, kernel {os.uname().release}; "
          f"servers on CPU {server_cpu}, fio on CPU {cpu_list(client_cpus)}")
    print(f"- load average (1/5/15 min) before: {load_before}; after: {load_after} "
          f"({minutes:.1f} min)")
    print(f"- {a.runs} run(s) of {a.seconds} s per workload, medians; ratios = ferroraid ÷ "
          f"qemu-nbd of the medians")
    print(f"- ferroraid ({exe}): RAID{a.level}, {a.members} null members, "
          f"{a.chunk_kib} KiB chunk, one {a.mode} reactor; qemu-nbd: {qemu_version}, "
          f"driver=null-co,read-zeroes=off; both export {size} bytes")
    print(f"- client: {fio_version}, nbd engine (libnbd), one job, one connection")
    if tls_info:
        print(f"- TLS: ferroraid --tls require, qemu-nbd tls-creds-x509 verify-peer=off, "
              f"fio nbds:// verifying the server (CA in libnbd's default directory, fio "
              f"as nobody); ferroraid negotiated {tls_info}")
    print("- server CPU: utime+stime of the server process over the fio job (connection "
          "and TLS setup included, nothing subtracted: the adaptive reactor's idle spin "
          "is in it) ÷ requests completed; CPU %: of one CPU over the job's wall time")
    summaries = {t: {s.name: {w[0]: summarise(results[t][s.name][w[0]]) for w in workloads}
                     for s in servers} for t in tls_modes}
    for t in tls_modes:
        print()
        print(f"### TLS {t}")
        print()
        print("| workload | ferroraid IOPS | MB/s | server CPU % | CPU µs/req "
              "| qemu-nbd IOPS | MB/s | server CPU % | CPU µs/req "
              "| IOPS ratio | CPU µs/req ratio | fio CPU % (ferroraid / qemu-nbd) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for short, title, *_ in workloads:
            f, q = summaries[t]["ferroraid"][short], summaries[t]["qemu-nbd"][short]
            print(f"| {title} | {f['iops']:,.0f} | {f['mb_s']:,.1f} | {f['cpu_pct']:.0f} "
                  f"| {f['us']:.2f} | {q['iops']:,.0f} | {q['mb_s']:,.1f} "
                  f"| {q['cpu_pct']:.0f} | {q['us']:.2f} | {f['iops'] / q['iops']:.2f}× "
                  f"| {f['us'] / q['us']:.2f}× | {f['fio_cpu']:.0f} / {q['fio_cpu']:.0f} |")
    if tls_modes == ["off", "on"]:
        print()
        print("### What TLS adds: server CPU µs per request, on − off (on ÷ off)")
        print()
        print("| workload | ferroraid | qemu-nbd |")
        print("|---|---:|---:|")
        for short, title, *_ in workloads:
            cells = []
            for s in servers:
                off = summaries["off"][s.name][short]["us"]
                on = summaries["on"][s.name][short]["us"]
                cells.append(f"{on - off:+.2f} ({on / off:.2f}×)")
            print(f"| {title} | {' | '.join(cells)} |")


if __name__ == "__main__":
    try:
        main()
    except Interrupted as e:
        sys.exit(f"interrupted ({e}); everything started was stopped and removed")
    except ClientFailed as e:
        sys.exit(str(e))
