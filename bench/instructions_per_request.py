#!/usr/bin/env python3
"""Instructions the reactor executes per array request, counted by valgrind's callgrind.

On a shared VM the wall-clock figures of array-bench move by 5-20 % between runs, more than
most changes to the per-request path are worth. Instruction counts do not move: this runs
one array-bench configuration (1 reactor unless --reactors, 1 s) under callgrind, counts
only what executes inside the reactor's loop turn (`--toggle-collect` on `Reactor::turn`;
the pre-reactor-set engine's `reactor::run` with `--root run`), and divides by the requests
the array finished (calls of `finish_req`).

Work driven by the clock rather than by requests is left out: under valgrind the run is
~50x slower, so per-window work (depth-controller and bulk-share windows, publishing
figures, histogram resets) would be charged ~50x too often per request. Those calls are
matched by name (EXCLUDE below) and their inclusive cost is subtracted.

    bench/instructions_per_request.py ARRAY_BENCH [--workload randread] [--level 5]
        [--device null] [--reactors 1] [--top N]

With --reactors 2 (or more) the reactors' threads all run on CPU 0 under valgrind, one at a
time; the count is then what a request costs with its cross-reactor path (pieces, parent
entries, foreign reads, messages to the owner and back), beside the one-reactor figure.

Prints "instructions/request=X requests=N" and, with --top, the N functions with the most
instructions of their own per request. Needs valgrind (apt-get install valgrind); never
run by CI. An instruction count is not a time (cache misses, branch mispredictions and the
parity kernels' wide instructions weigh differently): confirm a change with array-bench
itself, alternating the binaries.
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

# The depth controller's `calibrate` is not among them: it runs once per 64 quiet reads,
# per request however slow the clock.
EXCLUDE = re.compile(
    r"(::tick|publish|QueueWait::fill|__memset|__memcpy|Histogram<T>::add|::reset"
    r"|close_window|tick_members|::report)"
)


def parse(path):
    """(requests, instructions, excluded instructions, self cost by function name)."""
    names = {}
    calls = collections.Counter()
    self_ir = collections.Counter()
    excluded = 0
    fn = None
    callee = None
    after_calls = False
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            m = re.match(r"^(c?fn)=\((\d+)\)(?: (.*))?$", line)
            if m:
                kind, ident, name = m.groups()
                if name:
                    names[ident] = name
                if kind == "fn":
                    fn, callee = ident, None
                else:
                    callee = ident
                after_calls = False
                continue
            m = re.match(r"^calls=(\d+)", line)
            if m and callee:
                calls[callee] += int(m.group(1))
                after_calls = True
                continue
            if line.startswith(("totals", "summary", "events", "positions")):
                continue
            m = re.match(r"^\S+ (\d+)$", line)
            if not m:
                continue
            cost = int(m.group(1))
            if after_calls:
                # The inclusive cost of a call: left out when clock-driven work is called
                # from request work (counted once, at the outermost excluded call).
                if EXCLUDE.search(names.get(callee, "")) and not EXCLUDE.search(
                    names.get(fn, "")
                ):
                    excluded += cost
                after_calls = False
                callee = None
            elif fn:
                self_ir[fn] += cost
    requests = sum(c for i, c in calls.items() if names.get(i, "").endswith("finish_req"))
    by_name = collections.Counter()
    for i, cost in self_ir.items():
        by_name[names.get(i, i)] += cost
    return requests, sum(self_ir.values()), excluded, by_name


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("array_bench")
    ap.add_argument("--workload", default="randread")
    ap.add_argument("--level", default="5")
    ap.add_argument("--device", default="null")
    ap.add_argument("--reactors", default="1")
    ap.add_argument("--root", default="engine::reactor::Reactor*::turn",
                    help="function whose inclusive instructions count (callgrind pattern)")
    ap.add_argument("--top", type=int, default=0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        # One allowed CPU: array-bench then skips its cache-line round-trip probe (two
        # threads spinning on one line, which valgrind's serialised threads make endless).
        cmd = ["taskset", "-c", "0", "valgrind", "--tool=callgrind",
               f"--toggle-collect={a.root}", f"--callgrind-out-file={out}",
               a.array_bench, "--device", a.device, "--level", a.level, "--reactors", a.reactors,
               "--workload", a.workload, "--seconds", "1", "--member-mib", "64"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0 or not os.path.exists(out):
            sys.exit(f"valgrind run failed ({run.returncode}):\n{run.stderr[-2000:]}")
        requests, total, excluded, by_name = parse(out)
    if requests == 0:
        sys.exit(f"no request finished inside {a.root} (wrong --root for this binary?)")
    print(f"instructions/request={(total - excluded) / requests:.1f} requests={requests} "
          f"({a.workload}, RAID{a.level}, {a.device}, {a.reactors} reactor(s))")
    for name, cost in by_name.most_common(a.top):
        if EXCLUDE.search(name):
            continue
        print(f"{cost / requests:9.1f}  {name[:140]}")


if __name__ == "__main__":
    main()
