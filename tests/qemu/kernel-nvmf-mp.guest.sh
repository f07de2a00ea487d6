# The kernel's native NVMe multipath (ANA) over two portals of one subsystem, in the rig's
# guest (run by kernel-nvmf-mp.sh, which documents the whole test). Busybox sh, `-e`,
# /rig/lib.sh and /rig/nvmf-lib.sh sourced; /rig/knvmf.env holds the parameters. Each fact
# the Rust test checks is a `KEY: ...` line of $RIG_OUT/summary-guest.txt (and the console).
#
#  1. `modprobe nvme-tcp`; `ferroraid create` a RAID LEVEL over the virtio members (serials
#     kmp-0..), `serve --adaptive --nvmf 127.0.0.1:PORT --nvmf 127.0.0.2:PORT --rpc`;
#  2. `nvme connect -k 30 -c 1 -l 120` to both portals: one head namespace /dev/nvmeXnY,
#     two controllers of the subsystem, one path node nvmeXcZnY each, both live and ANA
#     optimized; `nvme id-ctrl`/`id-ns` recorded (CMIC, OAES, ANATT, ANACAP, ANAGRPMAX,
#     NANAGRPID, MNAN; NMIC, ANAGRPID); the subsystem's iopolicy set to round-robin, so
#     that both paths carry I/O;
#  3. the sequence (mp_sequence), with fio rounds running on the head node throughout
#     (JOBS jobs on disjoint JOB_MIB MiB regions, libaio at QD, O_DIRECT random 4..256 KiB
#     writes with crc32c verify headers and a new seed each round, verified after each
#     round): ANA change notices turned off on 127.0.0.2's controller (`nvme set-feature
#     -f 0x0b -v 0`) and portal 127.0.0.2 set inaccessible: the host can learn it only from
#     the status of the I/O round-robin sends there (ANA Inaccessible: failover, ANA log),
#     its path's ana_state turns inaccessible; removed (its controller goes connecting;
#     I/O goes on through 127.0.0.1); added again inaccessible (the host's reconnect loop
#     brings the controller back live, reads the ANA log and enables the notices again);
#     set optimized: no I/O goes to an inaccessible path, so only the ANA change notice
#     (AEN, then the log) can turn its ana_state optimized;
#     at each step the controllers' states, the paths' ana_state (sysfs), `nvme
#     list-subsys /dev/nvmeXnY`, the head node's completed requests since the last step
#     and the kernel's new nvme lines are recorded; every fio round exits 0 with err=0;
#     the kernel log holds no WARNING, BUG or Oops; `nvme disconnect` of both, SIGTERM;
#  4. the reference, run first (so that it runs whatever ferroraid does): the same sequence
#     against the kernel's nvmet-tcp exporting a loop device on ports 127.0.0.1:PORT+1
#     and 127.0.0.2:PORT+1 (configfs; the ANA state of port
#     N is ports/N/ana_groups/1/ana_state; removing = unlinking the subsystem from the
#     port, as blktests nvme/057 and nvmet's own multipath tests do).
. /rig/knvmf.env
FR_PORT=$PORT
RPC=/tmp/fr.rpc
FR=/usr/bin/ferroraid
TAG=kmp
# shellcheck source=tests/qemu/nvmf-lib.guest.sh
. /rig/nvmf-lib.sh
A1=127.0.0.1
A2=127.0.0.2
SUM=$RIG_OUT/summary-guest.txt
: >"$SUM"
# B: the backend the sequence drives, fr (ferroraid's JSON-RPC portal methods) or nvmet;
# NQN and PORT: its subsystem and port.

# note KEY TEXT...: a summary line `KEY: TEXT`, also on the console.
note() {
	_k=$1
	shift
	echo "$_k: $*" >>"$SUM"
	say "$_k: $*"
}

# state_of ADDR / ana_of ADDR: the state of the controller of ADDR ("absent" when none) and
# the ana_state of its path node ("-" when none).
state_of() {
	_c=$(ctrl_of "$1")
	if [ -z "$_c" ]; then echo absent; else cat "/sys/class/nvme/$_c/state"; fi
}
ana_of() {
	_c=$(ctrl_of "$1")
	for _p in /sys/class/nvme/$_c/nvme*c*n*/ana_state; do
		[ -n "$_c" ] && [ -r "$_p" ] && { cat "$_p"; return 0; }
	done
	echo -
}
# paths: `ADDR=STATE/ANA (nvmeX)` for both portals.
paths() {
	for _a in $A1 $A2; do
		printf '%s=%s/%s (%s) ' "$_a" "$(state_of $_a)" "$(ana_of $_a)" "$(ctrl_of $_a)"
	done
}
# wait_until WHAT CMD...: runs CMD every 0.2 s until it succeeds, for at most 90 s.
wait_until() {
	_what=$1
	shift
	_i=0
	until "$@"; do
		_i=$((_i + 1))
		[ $_i -le 450 ] || fail "$B: $_what not within 90 s: $(paths), $(nodes); fio: $(cat /tmp/fio.result 2>/dev/null || echo running)"
		sleep 0.2
	done
}
is() { [ "$(state_of "$1")/$(ana_of "$1")" = "$2" ]; }
# down ADDR: its controller is reconnecting (or gone, once ctrl-loss-tmo has passed).
down() { case "$(state_of "$1")" in connecting | resetting | absent) return 0 ;; esac; return 1; }

# path_ios ADDR: the requests (reads + writes) completed on the path node of ADDR (0 when
# none). The 6.1 head node counts none (its bios are not accounted), its paths do.
path_ios() {
	_c=$(ctrl_of "$1")
	for _p in /sys/class/nvme/$_c/nvme*c*n*/stat; do
		[ -n "$_c" ] && [ -r "$_p" ] && { set -- $(cat "$_p"); echo $(($1 + $5)); return 0; }
	done
	echo 0
}
# The requests completed through both paths.
ns_ios() { echo $(($(path_ios $A1) + $(path_ios $A2))); }
# kernel_since N: the kernel's nvme lines after line N of dmesg, without time stamps, the
# repeats of the reconnect loop once, joined with " | ".
kernel_since() {
	dmesg | tail -n +$(($1 + 1)) | grep -i nvme | sed 's/^\[[^]]*\] //; s/attempt [0-9]*/attempt N/' |
		awk '!seen[$0]++' | tr '\n' '|' | sed 's/|$//; s/|/ | /g'
}
MARK=0 IOS1=0 IOS2=0
# step KEY WHAT: records the step: what was done, the paths, `nvme list-subsys`, the I/O
# since the last step and the kernel's new nvme lines; fio must still be running.
step() {
	kill -0 "$FIO" 2>/dev/null || fail "$B: the fio rounds ended before the step '$2': $(cat /tmp/fio.result 2>/dev/null)"
	timeout 30 nvme list-subsys "/dev/$NS" >"$RIG_OUT/$1.list-subsys.txt" 2>&1 || true
	_i1=$(path_ios $A1) _i2=$(path_ios $A2)
	_l=$(dmesg | wc -l)
	note "$1" "$2; paths $(paths); list-subsys: $(grep -- '+-' "$RIG_OUT/$1.list-subsys.txt" | sed 's/^ *+- //' | tr '\n' '|' | sed 's/|$//; s/|/ | /g'); I/O: $((_i1 - IOS1 + _i2 - IOS2)) requests ($A1 $((_i1 - IOS1)), $A2 $((_i2 - IOS2))); kernel: $(kernel_since $MARK)"
	MARK=$_l IOS1=$_i1 IOS2=$_i2
}
# io_goes_on WHAT: at least 64 more requests complete on the head node (within 90 s).
io_goes_on() {
	_from=$(ns_ios)
	wait_until "I/O going on ($1)" io_since "$_from"
}
io_since() { [ $(($(ns_ios) - $1)) -ge 64 ]; }

# fio_rounds TAG: fio rounds on the head node until /tmp/fio.stop exists; the result
# ("N rounds" or why it stopped) in /tmp/fio.result.
fio_rounds() {
	_r=0
	while [ ! -e /tmp/fio.stop ]; do
		_r=$((_r + 1))
		_o=$RIG_OUT/fio-$1-$_r.txt
		_rc=0
		fio --name=kmp --filename="/dev/$NS" --numjobs="$JOBS" --size="${JOB_MIB}M" \
			--offset_increment="${JOB_MIB}M" --bsrange=4k-256k --rw=randwrite --direct=1 \
			--ioengine=libaio --iodepth="$QD" --verify=crc32c --verify_fatal=1 \
			--randseed=$((SEED + _r)) --group_reporting --eta=never --output="$_o" || _rc=$?
		if [ $_rc -ne 0 ] || ! grep -q 'err= 0' "$_o"; then
			echo "round $_r: fio exited $_rc: $(cat "$_o")" >/tmp/fio.result
			return 1
		fi
	done
	echo "$_r rounds" >/tmp/fio.result
}

# mp_sequence: connect both portals, then inaccessible, removed, added, optimized under fio
# (the backend's set_ana/remove/add functions), fio's result, disconnect. Keys: B-STEP.
mp_sequence() {
	MARK=$(dmesg | wc -l) IOS1=0 IOS2=0
	connect "$RIG_OUT/$B-connect-1.txt" $A1 -c 1 -l 120
	C1=$CTRL
	connect "$RIG_OUT/$B-connect-2.txt" $A2 -c 1 -l 120
	C2=$CTRL
	[ "$C1" != "$C2" ] || fail "$B: one controller $C1 for both portals"
	SUBSYS=
	for s in /sys/class/nvme-subsystem/*; do
		[ "$(cat "$s/subsysnqn")" = "$NQN" ] && SUBSYS=$s
	done
	[ -n "$SUBSYS" ] || fail "$B: no /sys/class/nvme-subsystem of $NQN"
	_ctrls=$(ls -d "$SUBSYS"/nvme[0-9]* 2>/dev/null | grep -cv 'n[0-9]*$' || true)
	# The second controller's namespace scan may still be running when connect returns.
	wait_until "one namespace block device with two path nodes" one_with_two_paths
	# The Identify fields native multipath rests on (Base 2.0 §5.17.2.1, §8.1).
	nvme id-ctrl "/dev/$C2" >"$RIG_OUT/$B-id-ctrl.txt" 2>&1 || fail "$B: nvme id-ctrl /dev/$C2: $(cat "$RIG_OUT/$B-id-ctrl.txt")"
	nvme id-ns "/dev/$NS" >"$RIG_OUT/$B-id-ns.txt" 2>&1 || fail "$B: nvme id-ns /dev/$NS: $(cat "$RIG_OUT/$B-id-ns.txt")"
	_f=
	for _n in cmic oaes anatt anacap anagrpmax nanagrpid mnan; do _f="$_f$_n $(field "$RIG_OUT/$B-id-ctrl.txt" $_n), "; done
	note "$B-identify" "id-ctrl /dev/$C2: ${_f}id-ns /dev/$NS: nmic $(field "$RIG_OUT/$B-id-ns.txt" nmic), anagrpid $(field "$RIG_OUT/$B-id-ns.txt" anagrpid)"
	wait_until "both paths live and optimized" both_optimized
	echo round-robin >"$SUBSYS/iopolicy" || fail "$B: setting $SUBSYS/iopolicy"
	rm -f /tmp/fio.stop /tmp/fio.result
	fio_rounds "$B" &
	FIO=$!
	io_goes_on "fio started"
	step "$B-paths" "$NQN: /dev/$NS, $(nodes), $_ctrls controllers in ${SUBSYS##*/}, iopolicy $(cat "$SUBSYS/iopolicy")"

	# ANA change notices off on the controller of A2 (Asynchronous Event Configuration
	# 0): the host can learn that A2 went inaccessible only from the status of the I/O the
	# round-robin policy sends there (ANA Inaccessible: it fails over and reads the log).
	nvme set-feature "/dev/$C2" --feature-id=0x0b --value=0 >"$RIG_OUT/$B-aec-off.txt" 2>&1 ||
		fail "$B: nvme set-feature /dev/$C2 -f 0x0b -v 0: $(cat "$RIG_OUT/$B-aec-off.txt")"
	${B}_set_ana $A2 inaccessible >"$RIG_OUT/$B-set-inaccessible.txt" 2>&1 ||
		fail "$B: setting $A2 inaccessible: $(cat "$RIG_OUT/$B-set-inaccessible.txt")"
	wait_until "$A2 inaccessible in sysfs (from the I/O status: notices off)" is $A2 live/inaccessible
	is $A1 live/optimized || fail "$B: $A1 not live/optimized after $A2 went inaccessible: $(paths)"
	io_goes_on "$A2 inaccessible"
	step "$B-inaccessible" "ANA notices off on $C2 ($(tr -d '\n' <"$RIG_OUT/$B-aec-off.txt")), $A2 set inaccessible ($(tr -d '\n' <"$RIG_OUT/$B-set-inaccessible.txt"))"

	${B}_remove $A2 >"$RIG_OUT/$B-remove.txt" 2>&1 || fail "$B: removing $A2: $(cat "$RIG_OUT/$B-remove.txt")"
	wait_until "$A2's controller reconnecting" down $A2
	io_goes_on "$A2 removed"
	down $A2 || fail "$B: $A2 came back while removed: $(paths)"
	step "$B-removed" "$A2 removed ($(tr -d '\n' <"$RIG_OUT/$B-remove.txt"))"

	${B}_add $A2 inaccessible >"$RIG_OUT/$B-add.txt" 2>&1 || fail "$B: adding $A2: $(cat "$RIG_OUT/$B-add.txt")"
	wait_until "$A2 live again (inaccessible)" is $A2 live/inaccessible
	io_goes_on "$A2 added"
	step "$B-readded" "$A2 added inaccessible ($(tr '\n' ' ' <"$RIG_OUT/$B-add.txt" | sed 's/ $//'))"

	# The reconnect enabled the notices again; no I/O goes to an inaccessible path, so only
	# the notice (AEN, then the host reads the ANA log) can tell the host.
	${B}_set_ana $A2 optimized >"$RIG_OUT/$B-set-optimized.txt" 2>&1 ||
		fail "$B: setting $A2 optimized: $(cat "$RIG_OUT/$B-set-optimized.txt")"
	wait_until "both paths live and optimized again (from the ANA change notice)" both_optimized
	io_goes_on "$A2 optimized"
	step "$B-optimized" "$A2 set optimized ($(tr -d '\n' <"$RIG_OUT/$B-set-optimized.txt"))"

	touch /tmp/fio.stop
	_rc=0
	wait "$FIO" || _rc=$?
	FIO=
	[ $_rc -eq 0 ] || fail "$B: fio: $(cat /tmp/fio.result)"
	_last=$(cat /tmp/fio.result)
	note "$B-fio" "$JOBS jobs x $JOB_MIB MiB, libaio QD $QD, O_DIRECT random 4-256 KiB writes, crc32c verify: $_last, each exit 0 err=0; $(cat "$RIG_OUT"/fio-$B-*.txt | grep -c 'err= 0') reports with err= 0, $(cat "$RIG_OUT"/fio-$B-*.txt | grep -E 'err= *[1-9]' | wc -l) with errors"
	disconnect "$RIG_OUT/$B-disconnect.txt"
	dmesg >"$RIG_OUT/$B-dmesg.txt"
	_bad=$(grep -E 'WARNING:|BUG:|Oops|Call Trace|general protection|hung_task|blocked for more than' "$RIG_OUT/$B-dmesg.txt" | head -n3 | tr '\n' '|')
	[ -z "$_bad" ] || fail "$B: the kernel logged: $_bad"
	note "$B-kernel" "no WARNING/BUG/Oops; $(tr -d '\n' <"$RIG_OUT/$B-disconnect.txt"); $(kernel_since $MARK)"
}
# nodes: "H heads, P paths": the block devices of NQN, multipath head nodes nvmeXnY and
# path nodes nvmeXcZnY (a head node's device is the nvme-subsystem, a path node's its
# controller, both with subsysnqn).
nodes() {
	_heads=0 _paths=0
	for b in /sys/block/nvme*n*; do
		[ "$(cat "$b/device/subsysnqn" 2>/dev/null)" = "$NQN" ] || continue
		case ${b##*/} in *c*) _paths=$((_paths + 1)) ;; *) _heads=$((_heads + 1)) ;; esac
	done
	echo "$_heads heads, $_paths paths"
}
one_with_two_paths() { [ "$(nodes)" = "1 heads, 2 paths" ]; }
both_optimized() { is $A1 live/optimized && is $A2 live/optimized; }

# ferroraid's portal methods (ferroraid portal ..., docs/NVMF.md).
fr_set_ana() { $FR portal set-ana "$1:$PORT" "$2" --rpc "$RPC"; }
fr_remove() { $FR portal remove "$1:$PORT" --rpc "$RPC"; }
fr_add() { $FR portal add "$1:$PORT" --ana-state "$2" --rpc "$RPC"; }

ln -sf /proc/mounts /etc/mtab
cp /rig/kernel "$RIG_OUT/kernel.txt"
echo "$(fio --version); $(nvme version | tr '\n' ' ')" >"$RIG_OUT/versions.txt"
say "kernel $(uname -r); $(grep -c ^processor /proc/cpuinfo) cpu; $(cat "$RIG_OUT/versions.txt")"
nvmf_host_init
note multipath "nvme_core multipath=$(cat /sys/module/nvme_core/parameters/multipath)"

# --- 1. the reference first: the sequence against nvmet-tcp (on PORT + 1) -------------------
B=nvmet
NQN=nqn.2014-08.org.ferroraid:nvmet-mp
PORT=$((FR_PORT + 1))
C=/sys/kernel/config/nvmet
# nvmet_port ADDR: the configfs port of ADDR.
nvmet_port() { if [ "$1" = $A1 ]; then echo "$C/ports/1"; else echo "$C/ports/2"; fi; }
nvmet_set_ana() { echo "$2" >"$(nvmet_port "$1")/ana_groups/1/ana_state" && echo "$(nvmet_port "$1")/ana_groups/1/ana_state = $2"; }
nvmet_remove() { rm "$(nvmet_port "$1")/subsystems/$NQN" && echo "unlinked from $(nvmet_port "$1")"; }
nvmet_add() { nvmet_set_ana "$1" "$2" && ln -s "$C/subsystems/$NQN" "$(nvmet_port "$1")/subsystems/$NQN" && echo "linked to $(nvmet_port "$1")"; }
modprobe nvmet-tcp || fail "modprobe nvmet-tcp"
grep -q " /sys/kernel/config " /proc/mounts || mount -t configfs none /sys/kernel/config || fail "mount configfs"
truncate -s $((JOBS * JOB_MIB * 2))M /tmp/ref.img
LOOP=$(losetup -f)
losetup "$LOOP" /tmp/ref.img || fail "losetup $LOOP /tmp/ref.img"
mkdir "$C/subsystems/$NQN" "$C/subsystems/$NQN/namespaces/1" || fail "nvmet configfs mkdir"
echo 1 >"$C/subsystems/$NQN/attr_allow_any_host"
echo -n "$LOOP" >"$C/subsystems/$NQN/namespaces/1/device_path"
echo 1 >"$C/subsystems/$NQN/namespaces/1/enable" || fail "nvmet: enabling namespace 1 on $LOOP"
for a in $A1 $A2; do
	P=$(nvmet_port $a)
	mkdir "$P" || fail "nvmet: mkdir $P"
	echo tcp >"$P/addr_trtype"
	echo ipv4 >"$P/addr_adrfam"
	echo "$a" >"$P/addr_traddr"
	echo "$PORT" >"$P/addr_trsvcid"
	nvmet_add $a optimized >/dev/null || fail "nvmet: linking $P"
done
mp_sequence
for a in $A1 $A2; do rm "$(nvmet_port $a)/subsystems/$NQN" && rmdir "$(nvmet_port $a)" || fail "nvmet: removing $(nvmet_port $a)"; done

# --- 2. ferroraid: the array and the target on two portals ----------------------------------
B=fr
NQN="nqn.2026-11.org.ferroraid:$NAME"
PORT=$FR_PORT
DEVS=$(rig_devs_by_serial kmp- "$MEMBERS") || fail "the member disks kmp-0.. did not appear"
$FR create --level "$LEVEL" --chunk "$CHUNK" --name "$NAME" $DEVS >"$RIG_OUT/create.txt" 2>&1 ||
	fail "ferroraid create: $(cat "$RIG_OUT/create.txt")"
note array "$(tail -n 1 "$RIG_OUT/create.txt")"
serve /tmp/serve.log --nvmf "$A1:$PORT" --nvmf "$A2:$PORT" $DEVS
$FR portal list --rpc "$RPC" >"$RIG_OUT/portals.txt" 2>&1 || fail "ferroraid portal list: $(cat "$RIG_OUT/portals.txt")"
note portals "$(tr '\n' ' ' <"$RIG_OUT/portals.txt")"

mp_sequence
stop /tmp/serve.log "$RIG_OUT/status.txt" 0
note stop "serve exit 0, $(grep 'array stopped' /tmp/serve.log | tail -n1 | sed 's/.*array stopped/array stopped/')"

say "done"
