# Host-side helpers shared by the scripts that run ferroraid next to the rig's guest
# (md-reverse.sh, md-ppl.sh): `source` it after rig.sh. The caller sets FERRORAID (the
# binary) and may set RIG_WATCH_PID (the Rust test, whose death stops every server).
#
#   md_host_serve LOG SOCK ARGS...   `ferroraid serve` (NBD on Unix socket SOCK); pid in SRV
#   md_host_stop LOG                 SIGTERM to SRV; it must exit 0 with the array clean
#   md_host_kill9                    SIGKILL to SRV (a crash), reaped
#   md_host_copy SRC DST             nbdcopy --flush, bounded
#   md_host_stop_all                 every server still running (for an EXIT trap)
#   md_host_gone PID                 true when PID is a number and no such process runs
#   md_host_outdir NAME KEYFN ARGS   the scripts' `[--check] OUTDIR` (below; MD_HOST_TOOLS)
#   md_host_workspace NAME           stale runs removed, a socket directory in `socks`
#   md_host_guest LOG WHAT ARGS...   the guest (rig_run ARGS), failing with WHAT

SERVERS=()
WATCHDOGS=()

md_host_gone() { [[ $1 =~ ^[0-9]+$ ]] && ! kill -0 "$1" 2>/dev/null; }

# Stops every ferroraid server still running (TERM, then KILL) and its watchdog.
md_host_stop_all() {
	local pid i
	for pid in "${SERVERS[@]}"; do
		kill -TERM "$pid" 2>/dev/null || continue
		for ((i = 0; i < 100; i++)); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	done
	for pid in "${WATCHDOGS[@]}"; do
		kill -TERM "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	done
	SERVERS=()
	WATCHDOGS=()
}

# Kills server $1 when this script ($$) or RIG_WATCH_PID (the Rust test) dies; runs in the
# background, ends with the server.
md_host_watchdog() {
	local pid=$1 w
	while kill -0 "$pid" 2>/dev/null; do
		for w in $$ $RIG_WATCH_PID; do
			if ! kill -0 "$w" 2>/dev/null; then
				kill -TERM "$pid" 2>/dev/null
				sleep 5
				kill -KILL "$pid" 2>/dev/null
				exit 0
			fi
		done
		sleep 1
	done
}

# md_host_serve LOG SOCK ARGS...: `ferroraid serve` with ARGS (member images, options), NBD on
# Unix socket SOCK; returns once it listens, with its pid in SRV.
md_host_serve() {
	local log=$1 sock=$2 i
	shift 2
	rm -f "$sock" "$sock.rpc"
	NO_COLOR=1 "$FERRORAID" serve --adaptive --nbd "unix:$sock" --rpc "$sock.rpc" "$@" >"$log" 2>&1 &
	SRV=$!
	SERVERS+=("$SRV")
	md_host_watchdog "$SRV" &
	WATCHDOGS+=("$!")
	for ((i = 0; i < 300; i++)); do
		[[ -S $sock ]] && grep -q 'NBD export listening' "$log" && return 0
		if ! kill -0 "$SRV" 2>/dev/null; then
			wait "$SRV" || true
			rig_die "ferroraid serve $* failed to start: $(cat "$log")"
		fi
		sleep 0.1
	done
	rig_die "ferroraid serve $* did not listen on $sock within 30 s: $(cat "$log")"
}

# Forgets SRV (it has exited and been reaped).
md_host_forget() {
	local keep=() p
	for p in "${SERVERS[@]}"; do [[ $p == "$SRV" ]] || keep+=("$p"); done
	SERVERS=("${keep[@]}")
}

# md_host_stop LOG: SIGTERM to the server SRV; it must exit 0 having marked the array clean.
md_host_stop() {
	local log=$1 rc=0 i
	kill -TERM "$SRV"
	for ((i = 0; i < 300; i++)); do
		kill -0 "$SRV" 2>/dev/null || break
		sleep 0.1
	done
	if kill -0 "$SRV" 2>/dev/null; then
		kill -KILL "$SRV"
		rig_die "ferroraid serve did not stop within 30 s of SIGTERM: $(tail -n 20 "$log")"
	fi
	wait "$SRV" || rc=$?
	md_host_forget
	((rc == 0)) || rig_die "ferroraid serve exited with status $rc on SIGTERM: $(tail -n 20 "$log")"
	grep 'array stopped' "$log" | grep -q 'clean=true' ||
		rig_die "ferroraid serve did not mark the array clean: $(tail -n 20 "$log")"
}

# md_host_kill9: SIGKILL to the server SRV, as a crash would stop it.
md_host_kill9() {
	kill -KILL "$SRV"
	wait "$SRV" 2>/dev/null || true
	md_host_forget
}

# md_host_copy SRC DST: nbdcopy, bounded.
md_host_copy() {
	timeout -k 5 120 nbdcopy --flush "$1" "$2" ||
		rig_die "nbdcopy $1 $2 failed (status $?)"
}

# md_host_outdir NAME KEY_FUNCTION ARGS...: the command line both scripts take,
# `[--check] OUTDIR`. Sets `out` (OUTDIR, absolute), `key` (KEY_FUNCTION's hash of what the
# results depend on) and `work` (OUTDIR.tmp.PID, where a run builds them), and returns only
# when there is work to do: it exits 0 when OUTDIR/.complete holds the key (current), and
# under --check 3 when not (or when there is no binary at FERRORAID). MD_HOST_TOOLS names
# the host tools it requires besides truncate, cmp, md5sum and timeout (default: python3,
# mdadm and nbdcopy, what the md scripts use).
md_host_outdir() {
	local name=$1 keyfn=$2 check=0
	shift 2
	if [[ ${1:-} == --check ]]; then
		check=1
		shift
	fi
	[[ $# == 1 ]] || rig_die "usage: $0 [--check] OUTDIR (FERRORAID=PATH names the binary)"
	out=$1
	if [[ ! -x $FERRORAID ]]; then
		((check)) && exit 3
		rig_die "no ferroraid binary at $FERRORAID: build it (cargo build --release -p ferroraid) or set FERRORAID=PATH"
	fi
	# shellcheck disable=SC2086 # one tool a word
	rig_need ${MD_HOST_TOOLS:-python3 mdadm nbdcopy} truncate cmp md5sum timeout
	key=$("$keyfn")
	if [[ -e $out/.complete && $(cat "$out/.complete") == "$key" ]]; then
		((check)) || rig_log "$name results in $out are current (key $key)"
		exit 0
	fi
	((check)) && exit 3
	mkdir -p "$(dirname "$out")"
	out=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")
	work=$out.tmp.$$
	return 0
}

# md_host_workspace NAME: removes what runs killed with SIGKILL left (their traps never ran):
# work directories OUT.tmp.PID and socket directories /tmp/NAME.* whose owner is gone; then
# makes this run's socket directory (a short path: sun_path holds 108 bytes) in `socks`.
md_host_workspace() {
	local stale
	for stale in "$out".tmp.*; do
		if [[ -d $stale ]] && md_host_gone "${stale##*.tmp.}"; then rm -rf "$stale"; fi
	done
	for stale in /tmp/"$1".*; do
		if [[ -f $stale/owner ]] && md_host_gone "$(cat "$stale/owner")"; then rm -rf "$stale"; fi
	done
	socks=$(mktemp -d "/tmp/$1.XXXXXX")
	echo $$ >"$socks/owner"
}

# md_host_guest LOG WHAT ARGS...: boots the guest (`rig_run --log LOG ARGS...`) in the
# background with its pid in RIG_PID (so `wait` returns at once when a signal comes, and the
# caller's EXIT trap can stop it); on failure keeps the console log as OUT.failed-console.log
# and dies saying WHAT failed.
md_host_guest() {
	local log=$1 what=$2 rc=0
	shift 2
	rig_run --log "$log" "$@" &
	RIG_PID=$!
	wait "$RIG_PID" || rc=$?
	RIG_PID=
	if ((rc != 0)); then
		cp "$log" "$out.failed-console.log" 2>/dev/null || true
		# The guest's own account of its failure (the guest scripts print `TAG: FAIL: why`
		# and then what they know: logs, mdstat, the kernel log).
		if grep -qa ': FAIL: ' "$log" 2>/dev/null; then
			rig_log "the guest's failure:"
			sed -n '/: FAIL: /,$p' "$log" | head -n 150 | tr -d '\r' >&2
		fi
		rig_die "$what; its console log: $out.failed-console.log"
	fi
}

# md_host_client_debs PKG BIN [DEP...]: sets MD_HOST_CLIENT to a tree with the Debian
# package PKG (apt's candidate version; without apt's lists, the newest cached) and DEPs
# unpacked, under $RIG_CACHE/PKG/VERSION with their .deb names in PACKAGES, fetched with
# `apt-get download` + `dpkg-deb -x` on first use (for `rig.sh initramfs --root`); BIN, a
# path in the tree, must be executable there. The kernel client tests' host tools.
md_host_client_debs() {
	local pkg=$1 bin=$2 ver=
	shift 2
	if command -v apt-cache >/dev/null; then
		ver=$(apt-cache policy "$pkg" 2>/dev/null | sed -n 's/^ *Candidate: \(.*\)$/\1/p' | head -n1 || true)
		[[ $ver == "(none)" ]] && ver=
	fi
	if [[ -z $ver ]]; then
		local cached
		cached=$(printf '%s\n' "$RIG_CACHE/$pkg"/*/.complete | sort -V | tail -n1)
		[[ -e $cached ]] || rig_die "apt knows no $pkg package (run 'apt-get update') and none is cached in $RIG_CACHE/$pkg"
		MD_HOST_CLIENT=$(dirname "$cached")
		return 0
	fi
	MD_HOST_CLIENT=$RIG_CACHE/$pkg/${ver//:/%3a}
	[[ -e $MD_HOST_CLIENT/.complete ]] || rig_locked md_host__fetch_debs "$MD_HOST_CLIENT" "$pkg=$ver" "$@"
	[[ -x $MD_HOST_CLIENT/$bin ]] || rig_die "$MD_HOST_CLIENT has no $bin: remove it and rerun"
}

# md_host__fetch_debs DEST PKG=VER [DEP...]: downloads and unpacks them into DEST.
md_host__fetch_debs() {
	local dest=$1 log deb
	shift
	[[ -e $dest/.complete ]] && return 0
	rig_need apt-get dpkg-deb
	local tmp=$dest.tmp.$$
	rm -rf "$tmp" && mkdir -p "$tmp/tree"
	rig_log "downloading $*"
	if ! log=$(cd "$tmp" && apt-get download "$@" 2>&1); then
		rm -rf "$tmp"
		rig_die "apt-get download $* failed (stale package lists? try 'apt-get update'):
$log"
	fi
	for deb in "$tmp"/*.deb; do
		dpkg-deb -x "$deb" "$tmp/tree" || rig_die "unpacking $deb failed"
		basename "$deb" >>"$tmp/tree/PACKAGES"
	done
	rm -f "$tmp"/*.deb
	rm -rf "$dest"
	mv "$tmp/tree" "$dest"
	rmdir "$tmp"
	touch "$dest/.complete"
	rig_log "$1 cached in $dest"
}

# md_host_stripped_ferroraid NAME: sets FR_ROOT to a tree holding $FERRORAID without its
# debug information (a fifth of the size) at usr/bin/ferroraid, under $RIG_CACHE/NAME and
# keyed on the binary's content (FR_SUM, 16 hex digits of its SHA-256), so that the
# guest's initramfs cache holds.
md_host_stripped_ferroraid() {
	FR_SUM=$(sha256sum <"$FERRORAID" | cut -c1-16)
	FR_ROOT=$RIG_CACHE/$1/ferroraid-$FR_SUM
	if [[ ! -x $FR_ROOT/usr/bin/ferroraid ]]; then
		mkdir -p "$FR_ROOT/usr/bin"
		if command -v objcopy >/dev/null; then
			objcopy --strip-debug "$FERRORAID" "$FR_ROOT/usr/bin/ferroraid.$$"
		else
			cp "$FERRORAID" "$FR_ROOT/usr/bin/ferroraid.$$"
		fi
		mv "$FR_ROOT/usr/bin/ferroraid.$$" "$FR_ROOT/usr/bin/ferroraid"
	fi
}

# md_host_client_cleanup KEEP: the kernel client tests' EXIT trap: stops the guest
# (RIG_PID), removes the socket directory and, unless KEEP is 1, the work directory.
md_host_client_cleanup() {
	if [[ -n ${RIG_PID:-} ]] && kill -TERM "$RIG_PID" 2>/dev/null; then
		wait "$RIG_PID" 2>/dev/null || true
	fi
	rm -rf "$socks"
	if [[ ${1:-} != 1 ]]; then
		rm -rf "$work"
	elif [[ -d $work ]]; then
		rig_log "kept $work"
	fi
}
