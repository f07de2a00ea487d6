#!/usr/bin/env python3
"""Issue 24: a small reader beside a bulk writer, measured end to end (fio over NBD/iSCSI).

Usage:  python3 bench/reader_writer_bench.py [--members tmpfs,ext4] [--reactors 1,2]
            [--protocols nbd,iscsi] [--connections multi,one] [--writer-qd 16,64]
            [--seconds 8] [--runs 3] [--member-mib 512] [--exe PATH] [--fio-iscsi PATH]
            [--control]

For every member kind, the array is a RAID6 over six member files (`ferroraid create
--level 6`), served by `ferroraid serve --polled --cores C...` (one reactor per listed
CPU, the last CPUs of this process's affinity); the clients run on the other CPUs
(`taskset`). Beside it, in the same run, `qemu-nbd --cache=none --aio=io_uring` serves one
member-sized file on the same CPUs. Both are prefilled; both are measured over the same
byte range (one member's size less 8 MiB).

Three phases per target, cell and run, `--seconds` each: the reader alone (4 KiB random
reads, QD1), the writer alone (1 MiB sequential writes, QD `--writer-qd`), and both
together. The target is restarted for the "together" phase, so the `queue_wait_us`
histograms of `ferroraid status --json` (per request class, from the array's acceptance
of a request to its first member request, since the target started) hold that phase
only: the table shows the small-read class's p99.9 beside the writer — how much of the
reader's wait is inside the array rather than in the front end, the network stack or
the client.

Dimensions (comma-separated lists; every combination is a table):
- `--members`: `tmpfs` (a tmpfs this script mounts on a new temporary directory and
  unmounts at the end; needs root) and/or `ext4` (a new directory under /var/tmp; the
  file system found there is printed).
- `--reactors`: ferroraid reactors, one polled core each. A count that leaves no CPU for
  the clients (fewer CPUs than reactors + 1) is skipped, and the output says so.
- `--protocols`: `nbd` (fio's nbd engine; qemu-nbd rows beside) and/or `iscsi` (fio's
  libiscsi engine, target `iqn.2026-11.org.ferroraid:bench` LUN 0; no qemu-nbd rows, it
  does not speak iSCSI — compare with the NBD table). Debian's fio has no libiscsi engine;
  `--fio-iscsi` names a fio built with `--enable-libiscsi` (default: `fio` when it has the
  engine, else /work/tools/fio-iscsi/bin/fio; without one the iSCSI tables are skipped
  with the reason printed).
- `--connections`: `multi` — reader and writer are two fio jobs, so two connections (fio's
  nbd engine opens one libnbd handle per job, its libiscsi engine one session per job).
  `one` — both streams on ONE NBD connection. fio cannot do that: the handle is per job,
  and one job has one iodepth and mixes reads and writes by count, which is not a QD1
  closed-loop reader beside a QD16 writer. So `one` uses bench/one_conn_client.py
  (python3-libnbd under /usr/bin/python3): one handle, the reader keeping one read in
  flight and the writer `--writer-qd` writes, latency from submission to completion
  callback, exact percentiles. Its numbers include the Python client's own cost (the
  same alone and beside), so read a `one` table by its ratios, not against fio's
  absolute numbers. iSCSI with `one` is skipped: there is no single-session
  two-stream iSCSI client here.
- `--writer-qd`: the bulk writer's queue depth (the issue: 16, and 64).
- `--control`: adds a control row to every separate-connection table: the same QD1
  reader on ferroraid, beside a bulk writer that writes a local file on the member file
  system directly (fio's io_uring engine, O_DIRECT except on tmpfs) on the clients' CPUs,
  no server in its path. Its "p99.9 ×" is what a bulk writer costs the reader on this
  machine without the target's scheduling involved (the clients' CPU, the kernel, the
  shared disk) — the bound below which the target's own rows cannot be judged here.

Numbers: reader p50 / p99.9 are fio's `clat_ns` percentiles (`--percentile_list=50:99.9`),
IOPS and MB/s fio's per-job `iops` and `bw_bytes` (10^6 bytes); each is the median over
`--runs` runs, and the ratios (p99.9 ×, IOPS kept, writer kept) are ratios of those
medians. The issue's targets: p99.9 beside ≤ 2× alone, reader IOPS ≥ 70 % of alone,
writer MB/s ≥ 70 % of alone.

A client that fails (e.g. an iSCSI command answered TASK SET FULL: fio's libiscsi engine
does not retry) fails that target's row of that table, with its first error line; the
other cells still run.

Everything this script starts (servers, clients: each in its own process group), mounts
and creates is stopped, unmounted and removed at the end, also on Ctrl-C, SIGTERM or a
failure. Needs fio, qemu-nbd, taskset, python3-libnbd (for `one`), root (for `tmpfs`).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nbd_bench import ROOT, free_port, release_binary, wait_port  # noqa: E402  (the same helpers)

ARRAY = "bench"
IQN = f"iqn.2026-11.org.ferroraid:{ARRAY}"
ONE_CONN_CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                               "one_conn_client.py")
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's python3-libnbd lives there


class Interrupted(Exception):
    pass


def on_signal(signum, _frame):
    # Once: a second Ctrl-C must not cut the cleanup short.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(f"signal {signum}")


def killpg(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def spawn(stack, cmd, what, log_path=None):
    """Start a server in its own process group; the stack stops it (SIGTERM, then KILL).
    Its stderr goes to `log_path` (kept, for the caller to read), else to a temporary
    file; the tail is printed if it exits on its own with an error."""
    # stderr to a file, not a pipe: a pipe nobody reads would stall a chatty server.
    log = open(log_path, "w+b") if log_path else tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                            start_new_session=True)

    def stop():
        if proc.poll() is None:
            killpg(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                print(f"{what} did not stop on SIGTERM; killing it", file=sys.stderr)
                killpg(proc, signal.SIGKILL)
                proc.wait()
        elif proc.returncode not in (0, -signal.SIGTERM):
            log.seek(0)
            err = log.read().decode(errors="replace")[-2000:]
            print(f"{what} exited with {proc.returncode}: {err}", file=sys.stderr)
        log.close()

    stack.callback(stop)
    return proc


def run_client(cmd, timeout):
    """Run a client in its own process group, killed on any exception; its stdout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        killpg(proc, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0:
        raise ClientFailed(cmd, proc.returncode, err)
    return out


class ClientFailed(Exception):
    """A client exited with an error: `why` is its first error line (fio repeats it for
    every failed I/O)."""

    def __init__(self, cmd, rc, stderr):
        lines = [l for l in stderr.splitlines() if l.strip()]
        first = next((l for l in lines if "error" in l.lower()), lines[-1] if lines else "")
        prog = cmd[4] if cmd[3] == SYSTEM_PYTHON else cmd[3]  # after "taskset -c CPUS"
        self.why = f"{os.path.basename(prog)} exited with {rc}: {first.strip()}"
        super().__init__(f"{shlex.join(cmd)} exited with {rc}: {stderr[-2000:]}")


def cpu_list(cpus):
    return ",".join(map(str, cpus))


# ---------------------------------------------------------------- member kinds

def fs_type(path):
    return subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "--target", path],
                          capture_output=True, text=True).stdout.strip() or "unknown"


def member_dir(stack, kind, member_mib):
    """A fresh directory for the members of `kind`, removed (and unmounted) at the end."""
    if kind == "tmpfs":
        d = tempfile.mkdtemp(prefix="rw-bench-tmpfs-")
        stack.callback(os.rmdir, d)
        # Six members and qemu-nbd's file, plus room for the metadata.
        size = 7 * member_mib + 64
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}m,mode=0700",
                            "rw-bench", d], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"cannot mount a tmpfs on {d}: {r.stderr.strip()}")
        stack.callback(subprocess.run, ["umount", d], check=True)
    else:
        d = tempfile.mkdtemp(prefix="rw-bench-", dir="/var/tmp")
        stack.callback(shutil.rmtree, d)
    return d


# ---------------------------------------------------------------- targets

class Ferroraid:
    name = "ferroraid"

    def __init__(self, exe, work, member_mib, sock_dir):
        self.exe = exe
        self.members = [os.path.join(work, f"m{i}.img") for i in range(6)]
        for m in self.members:
            with open(m, "wb") as f:
                f.truncate(member_mib << 20)
        subprocess.run([exe, "create", "--level", "6", "--name", ARRAY, "--force",
                        *self.members], check=True, capture_output=True)
        self.sock = os.path.join(sock_dir, f"ferroraid-{os.path.basename(work)}.sock")

    def start(self, stack, cpus, protocol):
        nbd_port = free_port()
        cmd = [self.exe, "serve", "--polled", "--cores", cpu_list(cpus),
               "--nbd", f"127.0.0.1:{nbd_port}", "--rpc", self.sock]
        if protocol == "iscsi":
            iscsi_port = free_port()
            cmd += ["--iscsi", f"127.0.0.1:{iscsi_port}"]
        proc = spawn(stack, cmd + self.members, "ferroraid serve")
        wait_port(nbd_port, proc, "ferroraid serve")
        self.wait_idle()
        nbd_uri = f"nbd://127.0.0.1:{nbd_port}/{ARRAY}"
        if protocol == "iscsi":
            wait_port(iscsi_port, proc, "ferroraid serve")
            return nbd_uri, f"iscsi://127.0.0.1:{iscsi_port}/{IQN}/0"
        return nbd_uri, nbd_uri

    def status(self):
        r = subprocess.run([self.exe, "status", "--json", "--rpc", self.sock],
                           capture_output=True, text=True, timeout=30)
        if not r.stdout.strip():
            raise RuntimeError(f"ferroraid status: {r.stderr.strip()}")
        return json.loads(r.stdout)

    def wait_idle(self, timeout=300):
        """Wait out a resync (or any process) so that it does not run beside fio."""
        end = time.time() + timeout
        while True:
            p = self.status()["process"]
            if p["state"] != "running":
                return
            if time.time() > end:
                raise RuntimeError(f"a {p['kind']} still runs after {timeout} s")
            time.sleep(0.5)


class QemuNbd:
    name = "qemu-nbd"

    def __init__(self, work, member_mib):
        self.file = os.path.join(work, "single.img")
        with open(self.file, "wb") as f:
            f.truncate(member_mib << 20)

    def start(self, stack, cpus, protocol):
        assert protocol == "nbd"
        port = free_port()
        proc = spawn(stack, ["taskset", "-c", cpu_list(cpus), "qemu-nbd", "-f", "raw",
                             "--cache=none", "--aio=io_uring", "-x", "single",
                             "-b", "127.0.0.1", "-p", str(port), "--persistent",
                             "--shared=8", self.file], "qemu-nbd")
        wait_port(port, proc, "qemu-nbd")
        uri = f"nbd://127.0.0.1:{port}/single"
        return uri, uri

    def status(self):
        return None


class Control:
    """The control row (`--control`): the reader reads ferroraid as in its own row, but
    the bulk writer writes a file of the same member file system directly (fio's
    io_uring engine, O_DIRECT except on tmpfs), on the clients' CPUs — no server in its
    path. What the reader loses beside it is what a bulk writer costs a QD1 reader on
    this machine without the target's involvement: a bound on what the target's
    scheduling can be judged by."""
    name = "control"

    def __init__(self, ferroraid, work, member_mib):
        self.ferroraid = ferroraid
        self.writer_file = os.path.join(work, "control-writer.img")
        self.writer_direct = fs_type(work) != "tmpfs"
        with open(self.writer_file, "wb") as f:
            f.truncate(member_mib << 20)

    def start(self, stack, cpus, protocol):
        return self.ferroraid.start(stack, cpus, protocol)

    def status(self):
        return None


# ---------------------------------------------------------------- clients

def fio_escape(s):
    return s.replace(":", "\\:")


class Clients:
    def __init__(self, fio_iscsi, span, seconds, cpus):
        self.fio_iscsi = fio_iscsi
        self.span = span
        self.seconds = seconds
        self.taskset = ["taskset", "-c", cpu_list(cpus)]

    def prefill(self, nbd_uri):
        run_client([*self.taskset, "fio", "--name=fill", "--ioengine=nbd",
                    f"--uri={nbd_uri}", "--rw=write", "--bs=1m", "--iodepth=8",
                    f"--size={self.span}", "--output-format=json"], timeout=600)

    def fio(self, protocol, uri, reader, writer, writer_qd, control=None):
        """Reader and/or writer as fio jobs (one connection each): (reader, writer). With
        `control` (a [`Control`]), the writer writes its local file instead of `uri`."""
        if protocol == "nbd":
            cmd, target = ["fio"], ["--ioengine=nbd", f"--uri={uri}"]
        else:
            cmd = [self.fio_iscsi]
            target = ["--ioengine=libiscsi", f"--filename={fio_escape(uri)}"]
        cmd += ["--thread", f"--size={self.span}", "--time_based",
                f"--runtime={self.seconds}", "--output-format=json",
                "--percentile_list=50:99.9", "--norandommap", "--randrepeat=0"]
        # Each libiscsi session gets its own initiator name.
        init = (lambda who: [f"--initiator=iqn.2026-12.org.fio:{who}"]
                if protocol == "iscsi" else [])
        if reader:
            cmd += ["--name=reader", *target, "--rw=randread", "--bs=4k", "--iodepth=1",
                    *init("reader")]
        if writer and control is not None:
            cmd += ["--name=writer", "--ioengine=io_uring",
                    f"--filename={fio_escape(control.writer_file)}",
                    f"--direct={int(control.writer_direct)}", "--rw=write", "--bs=1m",
                    f"--iodepth={writer_qd}"]
        elif writer:
            cmd += ["--name=writer", *target, "--rw=write", "--bs=1m",
                    f"--iodepth={writer_qd}", *init("writer")]
        out = run_client(self.taskset + cmd, timeout=self.seconds + 120)
        # fio's nbd engine prints "fio: connected to NBD server" and the libiscsi engine
        # a note on iodepth (it queues asynchronously all the same) before the JSON.
        jobs = {j["jobname"]: j for j in json.loads(out[out.index("{"):])["jobs"]}
        for j in jobs.values():
            if j["error"]:
                raise RuntimeError(f"fio job {j['jobname']} failed: error {j['error']}")
        r = w = None
        if reader:
            rd = jobs["reader"]["read"]
            pct = rd["clat_ns"]["percentile"]
            r = {"p50_us": pct["50.000000"] / 1000, "p999_us": pct["99.900000"] / 1000,
                 "iops": rd["iops"]}
        if writer:
            w = {"mb_s": jobs["writer"]["write"]["bw_bytes"] / 1e6}
        return r, w

    def one_conn(self, uri, reader, writer, writer_qd):
        """Reader and/or writer on one NBD connection (bench/one_conn_client.py)."""
        cmd = [*self.taskset, SYSTEM_PYTHON, ONE_CONN_CLIENT, uri, "--span", str(self.span),
               "--seconds", str(self.seconds), "--writer-qd", str(writer_qd)]
        cmd += ["--reader"] if reader else []
        cmd += ["--writer"] if writer else []
        res = json.loads(run_client(cmd, timeout=self.seconds + 120))
        return res.get("reader"), res.get("writer")

    def run(self, protocol, connections, uri, reader, writer, writer_qd, control=None):
        if connections == "one":
            assert control is None, "the control row is measured with fio only"
            return self.one_conn(uri, reader, writer, writer_qd)
        return self.fio(protocol, uri, reader, writer, writer_qd, control)


def measure(target, clients, cpus, cell, prefilled):
    """One run of one target in one cell: the three phases and, for ferroraid, the
    queue waits of the "together" phase."""
    protocol, _, connections, qd = cell
    control = target if isinstance(target, Control) else None
    res = {}
    with contextlib.ExitStack() as stack:
        nbd_uri, uri = target.start(stack, cpus, protocol)
        # The control reads the array ferroraid's row filled.
        name = "ferroraid" if control else target.name
        if not prefilled.get(name):
            clients.prefill(nbd_uri)
            prefilled[name] = True
        res["reader_alone"], _ = clients.run(protocol, connections, uri, True, False, qd)
        _, res["writer_alone"] = clients.run(protocol, connections, uri, False, True, qd,
                                             control)
    with contextlib.ExitStack() as stack:
        _, uri = target.start(stack, cpus, protocol)
        res["reader_beside"], res["writer_beside"] = clients.run(
            protocol, connections, uri, True, True, qd, control)
        st = target.status()
        if st is not None:
            res["queue_wait"] = st["queue_wait_us"]
    return res


# ---------------------------------------------------------------- report

def find_iscsi_fio(path):
    for cand in ([path] if path else ["fio", "/work/tools/fio-iscsi/bin/fio"]):
        exe = shutil.which(cand)
        if exe and "libiscsi" in subprocess.run([exe, "--enghelp"], capture_output=True,
                                                text=True).stdout.split():
            return exe, None
    why = (f"{path} has no libiscsi engine" if path else
           "no fio with the libiscsi engine (Debian's fio lacks it; build fio with "
           "--enable-libiscsi and pass --fio-iscsi)")
    return None, why


def pct(x):
    return f"{x:.1f} %" if x < 10 else f"{x:.0f} %"


def row(label, runs):
    failed = [r["error"] for r in runs if "error" in r]
    if failed:
        return f"| {label} | failed ({len(failed)} of {len(runs)} runs): {failed[0]} |"
    med = lambda key, field: statistics.median(r[key][field] for r in runs)  # noqa: E731
    ra50, ra999, ra_iops = (med("reader_alone", f) for f in ("p50_us", "p999_us", "iops"))
    rb50, rb999, rb_iops = (med("reader_beside", f) for f in ("p50_us", "p999_us", "iops"))
    wa, wb = med("writer_alone", "mb_s"), med("writer_beside", "mb_s")
    ratio = rb999 / ra999
    r_kept = 100 * rb_iops / ra_iops
    w_kept = 100 * wb / wa
    if all("queue_wait" in r for r in runs):
        qw = statistics.median(r["queue_wait"]["small_read"]["p999"] for r in runs)
        inside = f"{qw:.0f} ({pct(100 * qw / rb999)})"
    else:
        inside = "–"
    met = " · ".join("yes" if ok else "no"
                     for ok in (ratio <= 2, r_kept >= 70, w_kept >= 70))
    return (f"| {label} | {ra50:.0f} / {ra999:.0f}, {ra_iops:.0f} | "
            f"{rb50:.0f} / {rb999:.0f}, {rb_iops:.0f} | {ratio:.1f}× | {pct(r_kept)} | "
            f"{wa:.0f} / {wb:.0f} | {pct(w_kept)} | {inside} | {met} |")


def cell_title(cell, cpus=None):
    """The cell in words; with `cpus` (this run's CPUs), where target and clients ran."""
    protocol, reactors, connections, qd = cell
    conn = ("reader and writer on separate connections" if connections == "multi"
            else "reader and writer on one connection")
    where = ""
    if cpus:
        where = (f" (CPU {cpu_list(cpus[-reactors:])}; "
                 f"clients on CPU {cpu_list(cpus[:-reactors])})")
    return (f"{'NBD' if protocol == 'nbd' else 'iSCSI'}, {reactors} "
            f"reactor{'s' if reactors > 1 else ''}{where}, {conn}, writer 1 MiB QD{qd}")


HEADER = ("| target, members | reader alone p50 / p99.9 µs, IOPS | beside the writer | "
          "p99.9 × | reader IOPS kept | writer MB/s alone / beside | writer kept | "
          "small-read queue wait in the array, p99.9 µs (share of reader p99.9) | "
          "met: p99.9 ≤ 2× · reader ≥ 70 % · writer ≥ 70 % |\n"
          "|---|---|---|---:|---:|---:|---:|---:|---|")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", default="tmpfs,ext4")
    ap.add_argument("--reactors", default="1,2")
    ap.add_argument("--protocols", default="nbd,iscsi")
    ap.add_argument("--connections", default="multi,one")
    ap.add_argument("--writer-qd", default="16,64")
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--member-mib", type=int, default=512)
    ap.add_argument("--exe", help="a prebuilt ferroraid binary to measure")
    ap.add_argument("--fio-iscsi", help="a fio with the libiscsi engine")
    ap.add_argument("--control", action="store_true",
                    help="add the control row: the reader on ferroraid beside a writer "
                         "that writes a local file (no server), separate connections only")
    a = ap.parse_args()

    def choices(opt, value, allowed, conv=str):
        items = [conv(v) for v in value.split(",") if v]
        bad = [v for v in items if allowed is not None and v not in allowed]
        if bad or not items:
            sys.exit(f"--{opt}: {value!r}: expected a comma-separated subset of {allowed}")
        return items

    kinds = choices("members", a.members, ["tmpfs", "ext4"])
    reactor_counts = choices("reactors", a.reactors, None, int)
    protocols = choices("protocols", a.protocols, ["nbd", "iscsi"])
    conns = choices("connections", a.connections, ["multi", "one"])
    qds = choices("writer-qd", a.writer_qd, None, int)
    if min(reactor_counts) < 1 or min(qds) < 1:
        sys.exit("--reactors and --writer-qd must be at least 1")
    tools = ["fio", "qemu-nbd", "taskset", "findmnt"]
    if "tmpfs" in kinds:
        tools += ["mount", "umount"]
    for tool in tools:
        if not shutil.which(tool):
            sys.exit(f"{tool} is not installed")
    if "one" in conns and subprocess.run([SYSTEM_PYTHON, "-c", "import nbd"],
                                         capture_output=True).returncode != 0:
        sys.exit(f"--connections one needs python3-libnbd for {SYSTEM_PYTHON}")
    fio_iscsi, no_iscsi = find_iscsi_fio(a.fio_iscsi) if "iscsi" in protocols else (None, None)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)

    exe = release_binary(a.exe)

    cpus = sorted(os.sched_getaffinity(0))
    span = (a.member_mib - 8) << 20
    cells, skipped = [], []
    for r in reactor_counts:
        for p in protocols:
            for c in conns:
                for q in qds:
                    cell = (p, r, c, q)
                    if len(cpus) < r + 1:
                        skipped.append((cell, f"{r} reactor(s) and fio need {r + 1} CPUs, "
                                              f"this machine lends {len(cpus)}; not "
                                              f"measured rather than sharing cores"))
                    elif p == "iscsi" and no_iscsi:
                        skipped.append((cell, no_iscsi))
                    elif p == "iscsi" and c == "one":
                        skipped.append((cell, "no single-session client with two streams "
                                              "for iSCSI (fio's libiscsi engine logs in "
                                              "once per job)"))
                    else:
                        cells.append(cell)

    # results[kind][cell][target name] = [per-run dicts]
    results = {k: {cell: {} for cell in cells} for k in kinds}
    fs_types = {}
    with contextlib.ExitStack() as stack:
        sock_dir = tempfile.mkdtemp(prefix="rw-bench-sock-")
        stack.callback(shutil.rmtree, sock_dir)
        for kind in kinds:
            with contextlib.ExitStack() as kind_stack:
                work = member_dir(kind_stack, kind, a.member_mib)
                fs_types[kind] = fs_type(work)
                ours = Ferroraid(exe, work, a.member_mib, sock_dir)
                targets = [ours, QemuNbd(work, a.member_mib)]
                if a.control:
                    targets.append(Control(ours, work, a.member_mib))
                prefilled = {}
                for run in range(a.runs):
                    for cell in cells:
                        protocol, reactors = cell[0], cell[1]
                        target_cpus, client_cpus = cpus[-reactors:], cpus[:-reactors]
                        clients = Clients(fio_iscsi, span, a.seconds, client_cpus)
                        for t in targets:
                            if protocol == "iscsi" and t.name == "qemu-nbd":
                                continue
                            if t.name == "control" and cell[2] == "one":
                                continue
                            try:
                                res = measure(t, clients, target_cpus, cell, prefilled)
                            except ClientFailed as e:
                                # The cell's row says why; the other cells still run.
                                print(e, file=sys.stderr)
                                res = {"error": e.why}
                            results[kind][cell].setdefault(t.name, []).append(res)
                        print(f"{kind}: run {run + 1}/{a.runs}: {cell} done",
                              file=sys.stderr)

    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                  if l.startswith("model name")), "unknown CPU")
    fio_version = subprocess.run(["fio", "--version"], capture_output=True,
                                 text=True).stdout.strip()
    print(f"- command: `python3 bench/reader_writer_bench.py {shlex.join(sys.argv[1:])}`")
    print(f"- machine: {model}, {len(cpus)} CPUs for this run; kernel {os.uname().release}")
    print(f"- {a.runs} run(s) of {a.seconds} s per phase, medians; ratios of the medians")
    print(f"- ferroraid ({exe}): RAID6, 6 members of {a.member_mib} MiB, 64 KiB chunk, "
          f"polled reactors; qemu-nbd: one {a.member_mib} MiB file, --cache=none "
          f"--aio=io_uring, on the reactors' CPUs; both over the same "
          f"{a.member_mib - 8} MiB, prefilled")
    print("- members: " + "; ".join(f"{k}: {fs_types[k]}" + (
        " (mounted by this script)" if k == "tmpfs" else " (under /var/tmp)") for k in kinds))
    print(f"- clients: {fio_version} (nbd engine)"
          + (f", {fio_iscsi} (libiscsi engine)" if fio_iscsi else "")
          + ", bench/one_conn_client.py (python3-libnbd) for one connection")
    print("- reader: 4 KiB random read QD1; writer: 1 MiB sequential write; p50 / p99.9:"
          " completion latency (fio clat; one connection: submit to completion)")
    for cell, why in skipped:
        print(f"- skipped: {cell_title(cell)}: {why}")
    for cell in cells:
        print()
        print(f"### {cell_title(cell, cpus)}")
        print()
        print(HEADER)
        for kind in kinds:
            for name, runs in results[kind][cell].items():
                label = {"ferroraid": f"ferroraid, files on {kind}",
                         "qemu-nbd": f"qemu-nbd, one file on {kind}",
                         "control": f"control: reader on ferroraid, writer to a local "
                                    f"file on {kind} (no server)"}[name]
                print(row(label, runs))


if __name__ == "__main__":
    try:
        main()
    except Interrupted as e:
        sys.exit(f"interrupted ({e}); everything started was stopped and removed")
