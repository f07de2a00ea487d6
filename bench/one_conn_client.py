#!/usr/bin/python3
"""A QD1 4 KiB random reader and a sequential bulk writer on ONE NBD connection.

Usage:  /usr/bin/python3 bench/one_conn_client.py URI --span BYTES --seconds S
            [--reader] [--writer] [--writer-bs BYTES] [--writer-qd N]

The "one connection" variant of bench/reader_writer_bench.py. fio cannot do it: its nbd
engine opens one libnbd handle (one connection) per job in the job's setup, and a single
fio job has one iodepth and mixes reads and writes by count (rwmixread), so it cannot be
a closed-loop QD1 reader and a QD16 writer at once. This client uses python3-libnbd
(Debian's, hence /usr/bin/python3): one handle, one connection, both streams issued on it
with `aio_pread` / `aio_pwrite` — the reader keeps exactly one read in flight (a new
random 4 KiB-aligned offset in [0, span) each time), the writer keeps `--writer-qd`
writes in flight, sequential from 0 and wrapping at `span`. `--reader` / `--writer`
choose which streams run (both: beside each other).

Latency of a request: from just before its `aio_*` call to its completion callback
(`time.perf_counter_ns`), like fio's total latency; it includes this client's own
overhead, the same alone and beside, so compare it with itself (alone vs. beside), not
with fio's numbers. Percentiles are exact (nearest rank over every request), not fio's
bucketed ones. Completions only record and retire; new requests are issued from the loop
after each `poll`, never from inside a callback.

Prints one JSON object: {"reader": {...}, "writer": {...}} with p50_us, p999_us, iops,
mb_s, count per stream that ran.
"""

import argparse
import json
import math
import os
import random
import sys
import time

import nbd


def percentile(sorted_ns, p):
    """Nearest-rank percentile of a sorted list of ns, in µs."""
    if not sorted_ns:
        return 0.0
    k = max(0, math.ceil(p / 100 * len(sorted_ns)) - 1)
    return sorted_ns[k] / 1000


def summary(lat_ns, nbytes, secs):
    lat_ns.sort()
    return {"p50_us": percentile(lat_ns, 50), "p999_us": percentile(lat_ns, 99.9),
            "iops": len(lat_ns) / secs, "mb_s": nbytes / secs / 1e6, "count": len(lat_ns)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("uri")
    ap.add_argument("--span", type=int, required=True, help="bytes of the export to use")
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--reader", action="store_true")
    ap.add_argument("--writer", action="store_true")
    ap.add_argument("--writer-bs", type=int, default=1 << 20)
    ap.add_argument("--writer-qd", type=int, default=16)
    a = ap.parse_args()
    if not (a.reader or a.writer):
        sys.exit("--reader, --writer or both")

    h = nbd.NBD()
    h.connect_uri(a.uri)
    rbuf = nbd.Buffer(4096)
    wbuf = nbd.Buffer.from_bytearray(bytearray(os.urandom(a.writer_bs)))
    blocks = a.span // 4096
    wslots = a.span // a.writer_bs
    rng = random.Random()

    done = []  # (stream, issue ns, completion ns, errno), appended by completion callbacks
    read_lat, write_lat = [], []
    state = {"reads": 0, "writes": 0, "wpos": 0}

    def issue_read():
        t0 = time.perf_counter_ns()
        h.aio_pread(rbuf, rng.randrange(blocks) * 4096,
                    completion=lambda err, t0=t0: done.append(
                        ("r", t0, time.perf_counter_ns(), err.value)) or 1)
        state["reads"] += 1

    def issue_write():
        off = (state["wpos"] % wslots) * a.writer_bs
        state["wpos"] += 1
        t0 = time.perf_counter_ns()
        h.aio_pwrite(wbuf, off,
                     completion=lambda err, t0=t0: done.append(
                         ("w", t0, time.perf_counter_ns(), err.value)) or 1)
        state["writes"] += 1

    start = time.perf_counter_ns()
    end = start + int(a.seconds * 1e9)
    if a.writer:
        for _ in range(a.writer_qd):
            issue_write()
    if a.reader:
        issue_read()
    while True:
        h.poll(-1)
        now = time.perf_counter_ns()
        while done:
            kind, t0, t1, err = done.pop()
            if err:
                sys.exit(f"{'read' if kind == 'r' else 'write'} failed: errno {err}")
            if kind == "r":
                read_lat.append(t1 - t0)
                if now < end:
                    issue_read()
            else:
                write_lat.append(t1 - t0)
                if now < end:
                    issue_write()
        if now >= end and h.aio_in_flight() == 0:
            break
    secs = (time.perf_counter_ns() - start) / 1e9
    h.shutdown()
    out = {}
    if a.reader:
        out["reader"] = summary(read_lat, len(read_lat) * 4096, secs)
    if a.writer:
        out["writer"] = summary(write_lat, len(write_lat) * a.writer_bs, secs)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
