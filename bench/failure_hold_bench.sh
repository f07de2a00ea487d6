#!/bin/bash
# How long writes wait when a member fails under them (the write hold: writes finished
# while a failure is unrecorded complete only once the superblocks record it).
#
# Usage (root: mounts a 3 MiB tmpfs):  bench/failure_hold_bench.sh FERRORAID_BINARY [RUNS]
#
# Per run: a RAID6 of six 64 MiB members (--assume-clean), five in a temporary directory
# under /var/tmp and one on a 3 MiB tmpfs, served over NBD; fio writes 128 MiB
# sequentially in 64 KiB writes at QD4 (fio's nbd engine). The tmpfs member fills after
# ~12 MiB of array writes and fails with ENOSPC; the target records it faulty and every
# write succeeds. Prints, per run, the writer's slowest completion and p99.9 (ms): the
# hold shows as the slowest write.
set -euo pipefail
BIN=$(realpath "$1")
RUNS=${2:-5}
for tool in fio python3 mount umount; do
    command -v $tool >/dev/null || { echo "$tool is not installed" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "needs root (mounts a tmpfs)" >&2; exit 2; }
for run in $(seq "$RUNS"); do
    D=$(mktemp -d /var/tmp/failure-hold-XXXX)
    SRV=
    cleanup() {
        if [ -n "$SRV" ]; then
            kill "$SRV" 2>/dev/null || true
            wait "$SRV" 2>/dev/null || true
            SRV=
        fi
        # (An exited process's io_uring lets go of its files a moment later.)
        for _ in $(seq 50); do
            mountpoint -q "$D/small" || break
            umount "$D/small" 2>/dev/null || sleep 0.1
        done
        rm -rf "$D"
    }
    trap cleanup EXIT
    mkdir "$D/small"
    mount -t tmpfs -o size=3m tmpfs "$D/small"
    M=()
    for i in 0 1 2 3 4; do truncate -s 64M "$D/m$i.img"; M+=("$D/m$i.img"); done
    truncate -s 64M "$D/small/full.img"
    M+=("$D/small/full.img")
    "$BIN" create --level 6 --name hold --force --assume-clean "${M[@]}" >/dev/null 2>&1
    PORT=$((20000 + RANDOM % 20000))
    "$BIN" serve --nbd "127.0.0.1:$PORT" "${M[@]}" >"$D/log" 2>&1 &
    SRV=$!
    for _ in $(seq 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
        sleep 0.1
    done
    fio --name=w --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/hold" --rw=write --bs=64k \
        --iodepth=4 --size=128m --output-format=json >"$D/fio.json" 2>/dev/null
    grep -q "recording it faulty" "$D/log" || { echo "run $run: the member did not fail" >&2; exit 1; }
    python3 - "$D/fio.json" "$run" <<'PY'
import json, sys
t = open(sys.argv[1]).read()
w = json.loads(t[t.index("{"):])["jobs"][0]["write"]
c = w["clat_ns"]
assert w.get("total_ios", 0) > 0 and json.loads(t[t.index("{"):])["jobs"][0]["error"] == 0
print(f"run {sys.argv[2]}: {w['total_ios']} writes, slowest {c['max'] / 1e6:.1f} ms, "
      f"p99.9 {c['percentile']['99.900000'] / 1e6:.2f} ms, mean {c['mean'] / 1e3:.0f} us")
PY
    cleanup
    trap - EXIT
done
