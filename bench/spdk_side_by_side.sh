#!/usr/bin/env bash
# SPDK's raid5f (bdevperf) and ferroraid's per-core engine (array-bench) side by side, in one
# interleaved series, one core each (issue 23). A benchmark comparator only: nothing of SPDK
# goes into the project, and this script is never run in CI.
#
#   bench/spdk_side_by_side.sh --build DIR [options]   # build SPDK + ISA-L in DIR/spdk, then run
#   bench/spdk_side_by_side.sh --spdk DIR [options]    # an existing SPDK build (the repo root)
#
# Options:
#   --runs N          rounds of the whole series (default 3); the table gives medians
#   --seconds S       seconds per measurement, both sides (default 4)
#   --levels L        ferroraid levels, comma separated (default 5,6; RAID6 beside RAID5)
#   --results DIR     where every run's raw output goes (default target/spdk-side-by-side/DATE)
#   --array-bench BIN an array-bench binary (default: cargo build --release, then
#                     ${CARGO_TARGET_DIR:-target}/release/array-bench)
#   --spdk-repo URL, --isal-repo URL, --spdk-commit REV   sources for --build (defaults:
#                     GitHub, commit 3230130e = v26.09-pre; ISA-L at the commit SPDK pins)
#                     Where GitHub cannot be reached, a local clone or git directory works
#                     as URL (e.g. the tool library's `fetch` of spdk/spdk and intel/isa-l:
#                     --spdk-repo /work/.mirror/spdk+spdk/repo --isal-repo
#                     /work/.mirror/intel+isa-l/repo), if it holds the pinned commits
#   --build-only      with --build: build, then stop
#   --table DIR       print the table of an earlier results directory again, run nothing
#
# Each round runs, alternating which side goes first: 4 KiB random reads at QD32 on a raw
# RAM and a raw null member and on RAID5 over 5 RAM / 5 null members; the same reads with one
# member removed (SPDK: bdevperf -z, rpc bdev_raid_remove_base_bdev, perform_tests;
# ferroraid: --workload degraded-randread, member 0 failed); full-stripe writes (256 KiB) at
# QD8 and QD32 (SPDK: -w randwrite of stripe-aligned 256 KiB; ferroraid: seqwrite, one stripe
# per request; the engine's per-turn bulk bound holds only after a request that is not a
# bulk write, so these writers alone never meet it). The read runs add array-bench --reactor-raw: its raw member through
# a reactor, the like-for-like reference for "added ns" (SPDK's raw bdev runs through
# bdevperf). SPDK: bdevperf -m 0x1 (reactor on CPU 0); ferroraid: array-bench --reactors 1
# under taskset -c 0 (its reactor pins itself to the first allowed CPU). Both load generators run on their
# reactor, so each side is one core in all.
#
# "added ns per I/O" = 1e9/raid_iops - 1e9/raw_iops, paired within a round, then the median:
# the two raw paths differ (bdev layer vs ferroraid's member channel), so compare the ns the
# RAID layer adds, not RAID/raw ratios.
#
# Hugepages (SPDK only): if fewer than 3 GiB are free, or no hugetlbfs is mounted, the script
# raises vm.nr_hugepages and/or mounts a hugetlbfs of its own, and puts both back on exit
# (trap); it refuses to run if it cannot reserve them (and still puts back what it changed).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)

runs=3 seconds=4 levels=5,6 spdk="" build="" results="" array_bench="" build_only="" table_dir=""
sys_python=/usr/bin/python3 # SPDK's configure/rpc.py want Debian's python (pyelftools etc.)
spdk_repo=https://github.com/spdk/spdk
isal_repo=https://github.com/intel/isa-l
spdk_commit=3230130e
need_mib=3072 # 5 + 1 malloc bdevs of 256 MiB, buffers, DPDK's own

die() { echo "spdk_side_by_side: $*" >&2; exit 1; }
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

# The markdown table of a results directory (header.md + measurements.tsv).
table() {
    cat "$1/header.md"
    "$sys_python" - "$1/measurements.tsv" <<'EOF'
import csv, statistics, sys
from collections import defaultdict

tsv = sys.argv[1]
val = defaultdict(dict)  # (side, case, metric) -> {round: value}
for row in csv.DictReader(open(tsv), delimiter="\t"):
    val[(row["side"], row["case"], row["metric"])][row["round"]] = float(row["value"])
levels = sorted({c.split("-")[1][4:] for s, c, m in val if s == "ferroraid"})

def med(key):
    v = val.get(key)
    return statistics.median(v.values()) if v else None

def added(raid, raw):
    """1e9/raid - 1e9/raw per round, then the median."""
    a, b = val.get(raid, {}), val.get(raw, {})
    d = [1e9 / a[r] - 1e9 / b[r] for r in a if r in b and a[r] > 0 and b[r] > 0]
    return statistics.median(d) if d else None

def iops(x):
    if x is None: return "–"
    return f"{x / 1e6:.2f} M" if x >= 1e6 else f"{x / 1e3:.0f} k"

STRIPE = 262144
def gbs(x): return "–" if x is None else f"{x * STRIPE / 1e9:.2f}"
def ns(x): return "–" if x is None else f"{x:.0f}"
def ratio(a, b): return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}×"

S = lambda c: ("spdk", c, "iops")
F = lambda dev, lvl, tag, m="iops": ("ferroraid", f"{dev}-raid{lvl}-{tag}", m)

rows = []  # (label, spdk value, [ferroraid per level], formatter)
def add(label, s, f, fmt):
    rows.append((label, s, f, fmt))

for dev, sdev, raw in (("null", "raid5n", "nullraw"), ("mem", "raid5m", "mallocraw")):
    name = "null" if dev == "null" else "RAM"
    add(f"raw member, 4 KiB randread QD32 ({name}), IOPS", med(S(f"{raw}-read")),
        [med(F(dev, l, "read", "raw_iops")) for l in levels], iops)
    add(f"4 KiB randread over {name} members, IOPS", med(S(f"{sdev}-read")),
        [med(F(dev, l, "read")) for l in levels], iops)
    add(f"added ns per read ({name})", added(S(f"{sdev}-read"), S(f"{raw}-read")),
        [added(F(dev, l, "read"), F(dev, l, "read", "raw_iops")) for l in levels], ns)
    add(f"raw member through a reactor, 4 KiB randread QD32 ({name}), IOPS", None,
        [med(F(dev, l, "read", "reactor_raw_iops")) for l in levels], iops)
    add(f"added ns per read ({name}), over the raw member through a reactor",
        added(S(f"{sdev}-read"), S(f"{raw}-read")),
        [added(F(dev, l, "read"), F(dev, l, "read", "reactor_raw_iops")) for l in levels], ns)
for dev, sdev, raw in (("null", "raid5n", "nullraw"), ("mem", "raid5m", "mallocraw")):
    name = "null" if dev == "null" else "RAM"
    add(f"degraded 4 KiB randread ({name}), IOPS", med(S(f"{sdev}-degraded")),
        [med(F(dev, l, "degraded")) for l in levels], iops)
    add(f"added ns per degraded read ({name})", added(S(f"{sdev}-degraded"), S(f"{raw}-read")),
        [added(F(dev, l, "degraded"), F(dev, l, "degraded", "raw_iops")) for l in levels], ns)
for dev, sdev in (("mem", "raid5m"), ("null", "raid5n")):
    name = "null" if dev == "null" else "RAM"
    for qd in (8, 32):
        add(f"full-stripe write ({name}) QD{qd}, GB/s", med(S(f"{sdev}-write-qd{qd}")),
            [med(F(dev, l, f"write-qd{qd}")) for l in levels], gbs)

head = "| | SPDK raid5f | " + " | ".join(f"ferroraid RAID{l}" for l in levels)
head += " | ferroraid RAID5 ÷ raid5f |" if "5" in levels else " |"
print(head)
print("|---|---:|" + "---:|" * len(levels) + ("---:|" if "5" in levels else ""))
for label, s, f, fmt in rows:
    line = f"| {label} | {fmt(s)} | " + " | ".join(fmt(x) for x in f) + " |"
    if "5" in levels:
        line += f" {ratio(f[levels.index('5')], s)} |"
    print(line)
print()
print("- IOPS: bdevperf's Total line and array-bench's array row; GB/s = IOPS × 256 KiB / 1e9.")
print("- added ns = 1e9/raid_iops − 1e9/raw_iops (raw: SPDK's MallocRaw/NullRaw bdev, ferroraid's")
print("  raw member row of the same array-bench run); for the ns rows a ratio above 1 means")
print("  ferroraid's RAID layer adds more per I/O than raid5f's. \"Over the raw member through a")
print("  reactor\": ferroraid's raw reference run as its array is, by the same load generator on a")
print("  reactor (array-bench --reactor-raw), as SPDK's runs through bdevperf; SPDK's column repeats")
print("  its one added figure.")
print("- Full-stripe writes: the engine's per-turn bulk bound (256 KiB per reactor turn) holds for")
print("  a second after a request that is not a bulk write (docs/PACING.md); these writers of")
print("  256 KiB requests alone never meet it.")
print("- SPDK full-stripe writes: randwrite of stripe-aligned 256 KiB; ferroraid: seqwrite of whole")
print("  stripes. Degraded: SPDK removes the last member (Malloc4/Null4), ferroraid fails member 0.")
def spread(side):
    r = [max(v.values()) / min(v.values()) for (s, c, m), v in val.items()
         if s == side and m in ("iops", "raw_iops") and len(v) > 1 and min(v.values()) > 0]
    return f"{statistics.median(r):.2f}× (worst {max(r):.2f}×)" if r else "–"
print(f"- Spread between rounds, max ÷ min of one figure, median over figures: SPDK {spread('spdk')},")
print(f"  ferroraid {spread('ferroraid')}; every round's figures: measurements.tsv.")
EOF
}

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
    case $1 in
    --build) build=${2:?}; shift 2 ;;
    --spdk) spdk=${2:?}; shift 2 ;;
    --runs) runs=${2:?}; shift 2 ;;
    --seconds) seconds=${2:?}; shift 2 ;;
    --levels) levels=${2:?}; shift 2 ;;
    --results) results=${2:?}; shift 2 ;;
    --array-bench) array_bench=${2:?}; shift 2 ;;
    --spdk-repo) spdk_repo=${2:?}; shift 2 ;;
    --isal-repo) isal_repo=${2:?}; shift 2 ;;
    --spdk-commit) spdk_commit=${2:?}; shift 2 ;;
    --build-only) build_only=1; shift ;;
    --table) table_dir=${2:?}; shift 2 ;;
    -h | --help) usage 0 ;;
    *) echo "unknown argument: $1" >&2; usage 2 ;;
    esac
done
[ -x "$sys_python" ] || die "$sys_python is missing"
if [ -n "$table_dir" ]; then
    table "$table_dir"
    exit 0
fi
[ -n "${CI:-}" ] && die "not for CI (CI is set): this is a manual comparator"
[ -n "$build" ] && [ -n "$spdk" ] && die "--build and --spdk exclude each other"
[ -z "$build" ] && [ -z "$spdk" ] && usage 2
[[ $runs =~ ^[1-9][0-9]*$ ]] || die "--runs: a positive integer"
[[ $seconds =~ ^[1-9][0-9]*$ ]] || die "--seconds: a positive integer (bdevperf -t takes whole seconds)"
[[ $levels =~ ^[56](,[56])?$ ]] || die "--levels: 5, 6 or 5,6"
[ "$(id -u)" -eq 0 ] || die "needs root (hugepages, hugetlbfs)"
command -v taskset >/dev/null || die "taskset (util-linux) is missing"

# ---------------------------------------------------------------------------------------
# Build (--build DIR): Debian packages, SPDK at $spdk_commit, ISA-L at SPDK's pinned commit,
# local-build.diff (Debian 12's DPDK 22.11), configure, make.
pkgs=(libdpdk-dev libaio-dev libjson-c-dev meson ninja-build python3-pyelftools nasm
    libcunit1-dev libncurses-dev pkg-config autoconf libtool libkeyutils-dev libfuse3-dev
    python3-jsonschema python3-jinja2 python3-tabulate python3-yaml libnuma-dev uuid-dev
    libssl-dev git make gcc)

build_spdk() {
    local dir=$1 src missing=() p isal
    mkdir -p "$dir"
    src=$(cd "$dir" && pwd)/spdk
    for p in "${pkgs[@]}"; do
        dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed' ||
            missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "apt-get install ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
    fi
    if [ -x "$src/build/examples/bdevperf" ]; then
        log "$src/build/examples/bdevperf exists: not rebuilding (remove $src/build to rebuild)"
        spdk=$src
        return
    fi
    [ -d "$src/.git" ] || git clone -q "$spdk_repo" "$src"
    git -C "$src" checkout -q "$spdk_commit" || die "SPDK commit $spdk_commit not in $spdk_repo"
    isal=$(git -C "$src" ls-tree HEAD isa-l | awk '{print $3}')
    [ -n "$isal" ] || die "SPDK $spdk_commit pins no isa-l submodule"
    if [ ! -d "$src/isa-l/.git" ] && [ ! -f "$src/isa-l/.git" ]; then
        rm -rf "$src/isa-l"
        git clone -q "$isal_repo" "$src/isa-l"
    fi
    git -C "$src/isa-l" checkout -q "$isal" || die "ISA-L commit $isal not in $isal_repo"
    if git -C "$src" apply --check "$here/spdk/local-build.diff" 2>/dev/null; then
        git -C "$src" apply "$here/spdk/local-build.diff"
    elif ! git -C "$src" apply --check -R "$here/spdk/local-build.diff" 2>/dev/null; then
        die "bench/spdk/local-build.diff applies neither forwards nor backwards to $src"
    fi
    (
        cd "$src"
        export PATH=/usr/bin:$PATH
        ./configure --with-dpdk --with-raid5f --without-isal-crypto --without-crypto \
            --disable-tests --disable-unit-tests --without-vhost --without-virtio \
            --without-iscsi-initiator --without-nvme-cuse --without-fsdev --without-vfio-user \
            --without-rdma --without-idxd
        sed -i 's/^CONFIG_IPSEC_MB?=y/CONFIG_IPSEC_MB?=n/' mk/config.mk
        nice -n 10 make -j"$(nproc)"
    )
    spdk=$src
}

if [ -n "$build" ]; then
    build_spdk "$build"
    [ -n "$build_only" ] && { log "built: $spdk"; exit 0; }
fi
spdk=$(cd "$spdk" && pwd)
bdevperf=$spdk/build/examples/bdevperf
[ -x "$bdevperf" ] || die "$bdevperf is missing (build with --build DIR)"
export LD_LIBRARY_PATH=$spdk/build/lib:$spdk/isa-l/.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

if [ -z "$array_bench" ]; then
    log "cargo build --release -p bench --bin array-bench"
    (cd "$repo" && nice -n 10 cargo build -q --release -p bench --bin array-bench)
    array_bench=${CARGO_TARGET_DIR:-$repo/target}/release/array-bench
fi
[ -x "$array_bench" ] || die "$array_bench is not executable"

results=${results:-${CARGO_TARGET_DIR:-$repo/target}/spdk-side-by-side/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$results"
results=$(cd "$results" && pwd)
cp "$here/spdk/bdevs.json" "$results/bdevs.json"
log "raw output of every run: $results"

# ---------------------------------------------------------------------------------------
# Hugepages: only what is missing, all of it undone on exit.
hp_orig="" hp_mnt="" hp_mnt_made="" hp_dir="" sock=""
child_pid="" # the bdevperf or array-bench running now
dpdk_run=/var/run/dpdk dpdk_run_made="" # DPDK's runtime directory: removed at exit if ours
[ -d "$dpdk_run" ] || dpdk_run_made=1
cleanup() {
    local rc=$? now
    set +e # put back everything, whatever fails on the way
    trap - EXIT INT TERM
    if [ -n "$child_pid" ] && kill -0 "$child_pid" 2>/dev/null; then
        kill -INT "$child_pid" 2>/dev/null
        for _ in 1 2 3 4 5 6 7 8 9 10; do
            kill -0 "$child_pid" 2>/dev/null || break
            sleep 0.5
        done
        kill -KILL "$child_pid" 2>/dev/null
        wait "$child_pid" 2>/dev/null || true
        dpdk_tidy "$child_pid"
    fi
    [ -n "$dpdk_run_made" ] && rmdir "$dpdk_run" 2>/dev/null
    [ -n "$sock" ] && rm -f "$sock" "$sock.lock"
    if [ -n "$hp_mnt" ]; then
        umount "$hp_mnt" && log "unmounted our hugetlbfs $hp_mnt" ||
            { echo "WARNING: could not unmount $hp_mnt" >&2; rc=1; }
        [ -n "$hp_mnt_made" ] && rmdir "$hp_mnt" 2>/dev/null
    fi
    if [ -n "$hp_orig" ]; then
        echo "$hp_orig" >/proc/sys/vm/nr_hugepages || true
        now=$(cat /proc/sys/vm/nr_hugepages)
        if [ "$now" = "$hp_orig" ]; then
            log "vm.nr_hugepages back to $hp_orig"
        else
            echo "WARNING: vm.nr_hugepages is $now, was $hp_orig before this script" >&2
            rc=1
        fi
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

setup_hugepages() {
    local kb need free want got
    kb=$(awk '/^Hugepagesize:/ {print $2}' /proc/meminfo)
    need=$((need_mib * 1024 / kb))
    free=$(awk '/^HugePages_Free:/ {print $2}' /proc/meminfo)
    if [ "$free" -lt "$need" ]; then
        [ -w /proc/sys/vm/nr_hugepages ] || die "cannot write /proc/sys/vm/nr_hugepages"
        hp_orig=$(cat /proc/sys/vm/nr_hugepages)
        want=$((hp_orig + need - free))
        log "vm.nr_hugepages $hp_orig -> $want ($need_mib MiB free needed, $((free * kb / 1024)) MiB were)"
        echo "$want" >/proc/sys/vm/nr_hugepages || true
        got=$(cat /proc/sys/vm/nr_hugepages)
        [ "$got" -ge "$want" ] || die "only $got of $want hugepages could be reserved: refusing"
    fi
    # A hugetlbfs of the default page size (no pagesize= option, or pagesize=<default>).
    hp_dir=$(awk -v mb="$((kb / 1024))M" '$3 == "hugetlbfs" && ($4 !~ /pagesize=/ ||
        $4 ~ ("pagesize=" mb "(,|$)")) { print $2; exit }' /proc/mounts)
    if [ -z "$hp_dir" ]; then
        hp_dir=$(mktemp -d /tmp/spdk-sbs-hugetlbfs.XXXXXX)
        hp_mnt_made=1
        mount -t hugetlbfs nodev "$hp_dir" || die "cannot mount hugetlbfs on $hp_dir"
        hp_mnt=$hp_dir
        log "mounted hugetlbfs on $hp_dir (for this run only)"
    fi
}
setup_hugepages
{
    echo "nr_hugepages before: ${hp_orig:-unchanged}; hugetlbfs: $hp_dir${hp_mnt:+ (ours)}"
    grep -i huge /proc/meminfo
} >"$results/hugepages.txt"

# ---------------------------------------------------------------------------------------
# Measurements: one TSV line per figure (round, side, case, metric, value).
tsv=$results/measurements.tsv
printf 'round\tside\tcase\tmetric\tvalue\n' >"$tsv"
sock=/tmp/spdk-sbs.$$.sock # short: AF_UNIX paths are limited to 108 bytes
spdk_args=(-m 0x1 -u --huge-unlink --huge-dir "$hp_dir" --json "$results/bdevs.json")

# The first "Total" line of bdevperf's summary: "Total : IOPS MiB/s Fail/s TO/s avg min max"
# (with -z, shutdown prints a second summary of zeros).
bdevperf_iops() {
    tr '\r' '\n' <"$1" | awk -F: '$1 ~ /^ *Total *$/ { split($2, f, " "); print f[1]; ok = 1; exit }
        END { if (!ok) exit 1 }'
}

# perform_tests' JSON answer: the sum of its jobs' "iops".
perform_tests_iops() {
    "$sys_python" -c 'import json, sys; r = json.load(open(sys.argv[1]))["results"]
print(sum(j["iops"] for j in r) if r else sys.exit(1))' "$1"
}

# DPDK's runtime directory of one bdevperf process (/var/run/dpdk/spdk_pidN, left behind
# even with --no-shconf), and /var/run/dpdk itself at exit if this script created it.
dpdk_tidy() { rm -rf "${dpdk_run:?}/spdk_pid$1"; }

spdk_run() { # round case bdev qd bytes workload
    local r=$1 c=$2 bdev=$3 qd=$4 bs=$5 w=$6 out iops rc=0
    out=$results/r$r/spdk-$c.txt
    log "round $r: SPDK $c"
    "$bdevperf" "${spdk_args[@]}" -T "$bdev" -q "$qd" -o "$bs" \
        -w "$w" -t "$seconds" >"$out" 2>&1 &
    child_pid=$!
    wait "$child_pid" || rc=$?
    dpdk_tidy "$child_pid"
    child_pid=""
    iops=$(bdevperf_iops "$out") || die "no Total line in $out (bdevperf rc $rc)"
    [ "$rc" -eq 0 ] || die "bdevperf rc $rc: $out"
    printf '%s\tspdk\t%s\tiops\t%s\n' "$r" "$c" "$iops" >>"$tsv"
}

rpc() { "$sys_python" "$spdk/scripts/rpc.py" -s "$sock" "$@"; }

spdk_degraded() { # round case raid member
    local r=$1 c=$2 raid=$3 member=$4 out iops i
    out=$results/r$r/spdk-$c.txt
    log "round $r: SPDK $c ($raid without $member)"
    rm -f "$sock"
    "$bdevperf" "${spdk_args[@]}" -z -r "$sock" -T "$raid" -q 32 -o 4096 -w randread \
        -t "$seconds" >"$out" 2>&1 &
    child_pid=$!
    for i in $(seq 600); do
        [ -S "$sock" ] && rpc -t 5 framework_wait_init >/dev/null 2>&1 && break
        kill -0 "$child_pid" 2>/dev/null || die "bdevperf exited early: $out"
        sleep 0.1
    done
    rpc bdev_raid_remove_base_bdev "$member" >"$results/r$r/spdk-$c.remove.txt" 2>&1 ||
        die "bdev_raid_remove_base_bdev $member failed"
    rpc bdev_raid_get_bdevs all >"$results/r$r/spdk-$c.raid.json" 2>&1 || true
    "$sys_python" "$spdk/examples/bdev/bdevperf/bdevperf.py" -s "$sock" -t $((seconds + 120)) \
        perform_tests >"$results/r$r/spdk-$c.json" 2>&1 || die "perform_tests failed"
    kill -INT "$child_pid"
    wait "$child_pid" || true
    dpdk_tidy "$child_pid"
    child_pid=""
    rm -f "$sock"
    iops=$(perform_tests_iops "$results/r$r/spdk-$c.json") ||
        die "no results in $results/r$r/spdk-$c.json"
    printf '%s\tspdk\t%s\tiops\t%s\n' "$r" "$c" "$iops" >>"$tsv"
}

# array-bench rows: "| Mem | raid5 | Randread | 1 | IOPS | GB/s | CPU µs/IO | raw IOPS | ...",
# with --reactor-raw two more columns at the end (the 15th field: the raw member through a
# reactor, IOPS).
fr_run() { # round tag workload qd [array-bench options...]
    local r=$1 tag=$2 w=$3 qd=$4 out
    shift 4
    out=$results/r$r/ferroraid-$tag.txt
    log "round $r: ferroraid $tag"
    # In the background and waited for, so that a signal to this script reaches the trap now.
    taskset -c 0 "$array_bench" --device mem,null --level "$levels" --reactors 1 \
        --workload "$w" --qd "$qd" --seconds "$seconds" "$@" >"$out" 2>&1 &
    child_pid=$!
    wait "$child_pid" || die "array-bench failed: $out"
    child_pid=""
    awk -F'|' -v r="$r" -v tag="$tag" '
        function t(s) { gsub(/^ +| +$/, "", s); return s }
        t($2) ~ /^(Mem|Null)$/ && t($5) == "1" {
            c = tolower(t($2)) "-" t($3) "-" tag
            printf "%s\tferroraid\t%s\tiops\t%s\n", r, c, t($6)
            printf "%s\tferroraid\t%s\traw_iops\t%s\n", r, c, t($9)
            printf "%s\tferroraid\t%s\tcpu_us\t%s\n", r, c, t($8)
            if (NF >= 17 && t($15) + 0 > 0)
                printf "%s\tferroraid\t%s\treactor_raw_iops\t%s\n", r, c, t($15)
            n++ }
        END { if (n == 0) exit 1 }' "$out" >>"$tsv" || die "no array-bench rows in $out"
}

spdk_reads() {
    spdk_run "$1" mallocraw-read MallocRaw 32 4096 randread
    spdk_run "$1" nullraw-read NullRaw 32 4096 randread
    spdk_run "$1" raid5m-read raid5m 32 4096 randread
    spdk_run "$1" raid5n-read raid5n 32 4096 randread
}
spdk_degr() {
    spdk_degraded "$1" raid5m-degraded raid5m Malloc4
    spdk_degraded "$1" raid5n-degraded raid5n Null4
}
spdk_writes() { # round qd
    spdk_run "$1" "raid5m-write-qd$2" raid5m "$2" 262144 randwrite
    spdk_run "$1" "raid5n-write-qd$2" raid5n "$2" 262144 randwrite
}
fr_reads() { fr_run "$1" read randread 32 --reactor-raw; }
fr_degr() { fr_run "$1" degraded degraded-randread 32; }
fr_writes() {
    fr_run "$1" "write-qd$2" seqwrite "$2"
}

cpu_model=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $flags " == *" $1 "* ]] && echo yes || echo no; }
{
    echo "- CPU: $cpu_model, $(nproc --all) vCPUs; avx512f: $(has avx512f), vpclmulqdq: $(has vpclmulqdq), gfni: $(has gfni)"
    echo "- SPDK $(git -C "$spdk" describe --tags --always 2>/dev/null || echo '?') ($(git -C "$spdk" rev-parse --short=10 HEAD 2>/dev/null || echo '?')), ISA-L $(git -C "$spdk/isa-l" rev-parse --short HEAD 2>/dev/null || echo '?'); ferroraid $(git -C "$repo" rev-parse --short=10 HEAD)$(git -C "$repo" diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
    echo "- $runs rounds of $seconds s per measurement, interleaved; one core (CPU 0) each side; medians of the rounds (added ns paired within a round); raw output: $results"
    echo
} >"$results/header.md"
started=$(date +%s)
for r in $(seq "$runs"); do
    mkdir -p "$results/r$r"
    for pair in "spdk_reads fr_reads" "spdk_degr fr_degr" "spdk_writes fr_writes 8" \
        "spdk_writes fr_writes 32"; do
        set -- $pair
        if [ $((r % 2)) -eq 1 ]; then
            "$1" "$r" ${3:-}
            "$2" "$r" ${3:-}
        else
            "$2" "$r" ${3:-}
            "$1" "$r" ${3:-}
        fi
    done
done
log "series done in $(($(date +%s) - started)) s"

# ---------------------------------------------------------------------------------------
# The table.
table "$results" | tee "$results/table.md"
