#!/usr/bin/env bash
# CPU time per array request of the reactor thread, by function: where array-bench's
# "CPU µs/IO" goes. Samples the reactor thread with perf (cpu-clock, which stops when the
# thread is preempted, so a loaded machine inflates it less than wall time) and divides each
# function's samples by the requests the run completed.
#
#   bench/reactor_profile.sh ARRAY_BENCH LABEL [WORKLOAD] [LEVEL] [DEVICE] [QD]
#
# ARRAY_BENCH: an array-bench binary (compare two by running this alternately for each);
# WORKLOAD (randread), LEVEL (5), DEVICE (null), QD (array-bench's default): one
# array-bench configuration, 1 reactor, 3 s, pinned to CPU $CPU (default 0; the reactor
# then shares its core with nothing of this script's). Writes $OUT/LABEL.txt (default OUT=target/reactor-profile): "ns/IO function" lines,
# largest first, and prints "LABEL iops=N cpu_ns_per_io=X". Needs perf (linux-perf); symbols
# come from the release profile's debug information.
set -euo pipefail
bin=$1 label=$2 workload=${3:-randread} level=${4:-5} device=${5:-null} qd=${6:-}
out=${OUT:-target/reactor-profile}
hz=4999
mkdir -p "$out"
qd_arg=()
[ -n "$qd" ] && qd_arg=(--qd "$qd")
perf record -q -F "$hz" -o "$out/$label.data" taskset -c "${CPU:-0}" "$bin" --device "$device" \
    --reactors 1 --level "$level" --workload "$workload" "${qd_arg[@]}" --seconds 3 \
    >"$out/$label.bench" 2>/dev/null
# The array row's IOPS column (the 5th field of the markdown table).
iops=$(grep -E '^\| (Null|Mem|File) ' "$out/$label.bench" | head -1 | awk -F'|' '{print $6 + 0}')
[ "${iops%.*}" -gt 0 ] || { echo "no IOPS in $out/$label.bench" >&2; exit 1; }
perf script -i "$out/$label.data" -F comm,ip,sym 2>/dev/null |
    awk '$1 == "reactor-0" { $1 = ""; $2 = ""; sub(/^ +/, ""); print }' |
    sort | uniq -c | sort -rn >"$out/$label.samples"
awk -v io="$iops" -v hz="$hz" '{ n = $1; $1 = ""; sub(/^ /, "");
    printf "%7.1f ns  %s\n", n * 1e9 / hz / (io * 3), $0 }' "$out/$label.samples" >"$out/$label.txt"
awk -v io="$iops" -v hz="$hz" -v l="$label" '{ s += $1 } END {
    printf "%s iops=%d cpu_ns_per_io=%.1f\n", l, io, s * 1e9 / hz / (io * 3) }' "$out/$label.samples"
