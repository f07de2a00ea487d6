# Helpers of the NVMe/TCP guest scripts (kernel-nvmf.guest.sh, kernel-nvmf-mp.guest.sh), in
# the guest at /rig/nvmf-lib.sh. Busybox sh. The caller sets TAG (the console prefix), NQN,
# PORT, FR (the ferroraid binary) and RPC (its JSON-RPC socket); SERVE holds the pid of the
# `ferroraid serve` in the background (empty when none), CTRL and NS what `connect` found.
SERVE=
CTRL=
NS=

t() { cut -d' ' -f1 /proc/uptime; }
say() { echo "$TAG [$(t)s]: $*"; }
fail() {
	echo "$TAG: FAIL: $*"
	for f in /tmp/serve*.log; do
		[ -f "$f" ] && { echo "--- last lines of $f"; tail -n 40 "$f"; }
	done
	echo "--- kernel log"
	dmesg | tail -n 60
	[ -z "$SERVE" ] || kill -TERM "$SERVE" 2>/dev/null || true
	exit 1
}
# field FILE NAME: the value of `NAME : value` in nvme-cli's normal output.
field() { sed -n "s/^$2 *: *//p" "$1" | head -n1 | sed 's/ *$//'; }

# nvmf_host_init: loopback up, `modprobe nvme-tcp` (/dev/nvme-fabrics appears), a host NQN
# and host ID in /etc/nvme (what Debian's nvme-cli postinst would have written).
nvmf_host_init() {
	ip link set lo up
	mkdir -p /etc/nvme
	modprobe nvme-tcp || fail "modprobe nvme-tcp"
	[ -c /dev/nvme-fabrics ] || fail "no /dev/nvme-fabrics after modprobe nvme-tcp"
	_id=$(cat /proc/sys/kernel/random/uuid)
	echo "nqn.2014-08.org.nvmexpress:uuid:$_id" >/etc/nvme/hostnqn
	echo "$_id" >/etc/nvme/hostid
}

# ctrl_of ADDR: the /sys/class/nvme controller of subsystem NQN whose address is ADDR:PORT
# (empty when none).
ctrl_of() {
	for _c in /sys/class/nvme/nvme*; do
		[ "$(cat "$_c/subsysnqn" 2>/dev/null)" = "$NQN" ] || continue
		case "$(cat "$_c/address" 2>/dev/null)" in
		"traddr=$1,trsvcid=$PORT"*) echo "${_c##*/}" ;;
		esac
	done
}

# connect LOG ADDR [OPTIONS...]: `nvme connect -t tcp -a ADDR -s PORT -n NQN -k 30 OPTIONS`;
# sets CTRL (nvmeX, the controller of ADDR) and NS (nvmeXnY, the sized namespace block
# device: with native multipath the subsystem's head node, not a path node nvmeXcZnY).
connect() {
	_log=$1 _addr=$2
	shift 2
	CTRL= NS=
	timeout 180 nvme connect -t tcp -a "$_addr" -s "$PORT" -n "$NQN" -k 30 "$@" >"$_log" 2>&1 ||
		fail "nvme connect -t tcp -a $_addr -s $PORT -n $NQN -k 30 $*: $(cat "$_log")"
	CTRL=$(ctrl_of "$_addr" | tail -n1)
	[ -n "$CTRL" ] || fail "no /sys/class/nvme controller of $NQN at $_addr after nvme connect: $(cat "$_log")"
	_i=0
	while :; do
		for b in /sys/block/nvme*n*; do
			case ${b##*/} in *c*) continue ;; esac # a multipath path node, not the disk
			[ -e "$b" ] && [ "$(cat "$b/size")" != 0 ] && NS=${b##*/}
		done
		[ -n "$NS" ] && [ -b "/dev/$NS" ] && break
		_i=$((_i + 1))
		[ $_i -le 300 ] || fail "no sized /dev/nvmeXnY 30 s after nvme connect"
		sleep 0.1
	done
}

# disconnect LOG: `nvme disconnect -n NQN`; no controller of NQN may be left.
disconnect() {
	timeout 60 nvme disconnect -n "$NQN" >"$1" 2>&1 || fail "nvme disconnect -n $NQN: $(cat "$1")"
	for _c in /sys/class/nvme/nvme*; do
		[ "$(cat "$_c/subsysnqn" 2>/dev/null)" != "$NQN" ] || fail "${_c##*/} still there after nvme disconnect"
	done
}

# serve LOG ARGS...: `ferroraid serve --adaptive --rpc RPC ARGS` in the background (pid in
# SERVE; ARGS hold the --nvmf portals and the members), returns once the target listens.
serve() {
	_log=$1
	shift
	rm -f "$RPC"
	NO_COLOR=1 $FR serve --adaptive --rpc "$RPC" "$@" >"$_log" 2>&1 &
	SERVE=$!
	_i=0
	until grep -q 'NVMe/TCP target listening' "$_log" && [ -S "$RPC" ]; do
		kill -0 "$SERVE" 2>/dev/null || { SERVE=; fail "ferroraid serve exited: $(cat "$_log")"; }
		_i=$((_i + 1))
		[ $_i -le 600 ] || fail "ferroraid serve did not listen within 60 s"
		sleep 0.1
	done
}

# stop LOG STATUS WANT: `ferroraid status` to STATUS, its exit status must be WANT (1:
# degraded), then SIGTERM to the target; it must exit 0 having stopped the array clean.
stop() {
	_rc=0
	$FR status --rpc "$RPC" >"$2" 2>&1 || _rc=$?
	[ $_rc -eq "$3" ] || fail "ferroraid status exited $_rc, not $3: $(cat "$2")"
	kill -TERM "$SERVE"
	_rc=0
	wait "$SERVE" || _rc=$?
	SERVE=
	cp "$1" "$RIG_OUT/"
	[ $_rc -eq 0 ] || fail "ferroraid serve exited $_rc on SIGTERM"
	grep 'array stopped' "$1" | grep -q 'clean=true' || fail "ferroraid serve did not stop the array clean"
}

# The writes the kernel completed on the namespace (field 5 of /sys/block/DISK/stat): with
# native multipath (a target with CMIC/NMIC set, as ferroraid's and nvmet are) the sum over
# its path nodes nvmeXcZnY, since the 6.1 head node accounts nothing (its bios bypass the
# request accounting); else NS's own.
ns_writes() {
	_w=0 _n=0
	for _p in /sys/block/nvme*c*n*; do
		[ "$(cat "$_p/device/subsysnqn" 2>/dev/null)" = "$NQN" ] || continue
		set -- $(cat "$_p/stat")
		_w=$((_w + $5)) _n=$((_n + 1))
	done
	[ $_n -gt 0 ] || { set -- $(cat "/sys/block/$NS/stat") && _w=$5; }
	echo "$_w"
}

# The kernel's nvme lines holding an error, reset, timeout or recovery (a grep -E pattern).
COMPLAINT='error|fail|timeout|timed out|reset|recovery|reconnect|incomplete|mismatch|invalid|unsupported|unexpected|abort'

# complaints FILE: the kernel's nvme lines matching COMPLAINT, to FILE (false when none).
# The NQNs and "ferroraid" are left out: "ferroraid" holds "error".
complaints() {
	dmesg | grep -i 'nvme' | sed 's/NQN "[^"]*"/NQN/; s/ferroraid//g' | grep -iE "$COMPLAINT" >"$1"
}
