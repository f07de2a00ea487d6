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
# array-bench configuration, 3 s, $REACTORS reactors (default 1) pinned from CPU $CPU
# (default 0; one reactor then shares its core with nothing of this script's). With more
# than one reactor the samples of every reactor thread count, over all their requests;
# $EXTRA adds array-bench options (e.g. EXTRA=--local-only). Writes $OUT/LABEL.txt (default OUT=target/reactor-profile): "ns/IO function" lines,
# largest first, and prints "LABEL iops=N cpu_ns_per_io=X". Needs perf (linux-perf); symbols
# come from the release profile's debug information.
set -euo pipefail
bin=$1 label=$2 workload=${3:-randread} level=${4:-5} device=${5:-null} qd=${6:-}
out=${OUT:-target/reactor-profile}
hz=4999
mkdir -p "$out"
# The reference would run on reactor threads too, and its samples be divided by the array's
# requests.
case " ${EXTRA:-} " in *" --reactor-raw "*) echo "EXTRA: --reactor-raw is not profiled here" >&2; exit 2 ;; esac
qd_arg=()
[ -n "$qd" ] && qd_arg=(--qd "$qd")
reactors=${REACTORS:-1}
cpus=${CPU:-0}
[ "$reactors" -gt 1 ] && cpus="${CPU:-0}-$(( ${CPU:-0} + reactors - 1 ))"
# shellcheck disable=SC2086 # EXTRA: options, split on purpose
perf record -q -F "$hz" -o "$out/$label.data" taskset -c "$cpus" "$bin" --device "$device" \
    --reactors "$reactors" --level "$level" --workload "$workload" "${qd_arg[@]}" --seconds 3 \
    ${EXTRA:-} >"$out/$label.bench" 2>/dev/null
# The array row's IOPS column (the 5th field of the markdown table).
iops=$(grep -E '^\| (Null|Mem|File) ' "$out/$label.bench" | head -1 | awk -F'|' '{print $6 + 0}')
[ "${iops%.*}" -gt 0 ] || { echo "no IOPS in $out/$label.bench" >&2; exit 1; }
perf script -i "$out/$label.data" -F comm,ip,sym 2>/dev/null |
    awk -v n="$reactors" '($1 == "reactor-0") || (n > 1 && $1 ~ /^reactor-[0-9]+$/) {
        $1 = ""; $2 = ""; sub(/^ +/, ""); print }' |
    sort | uniq -c | sort -rn >"$out/$label.samples"
awk -v io="$iops" -v hz="$hz" '{ n = $1; $1 = ""; sub(/^ /, "");
    printf "%7.1f ns  %s\n", n * 1e9 / hz / (io * 3), $0 }' "$out/$label.samples" >"$out/$label.txt"
awk -v io="$iops" -v hz="$hz" -v l="$label" '{ s += $1 } END {
    printf "%s iops=%d cpu_ns_per_io=%.1f\n", l, io, s * 1e9 / hz / (io * 3) }' "$out/$label.samples"
