# The kernel's own NBD client on ferroraid, in the rig's guest (run by kernel-nbd.sh, which
# documents the whole test). Busybox sh, `-e`, /rig/lib.sh sourced; /rig/knbd.env holds the
# parameters. What it prints for the host goes to $RIG_OUT; every step is on the console.
#
#  1. `ferroraid create` a RAID6 over the virtio members (serials knbd-0..), `serve
#     --adaptive --nbd 127.0.0.1:PORT --rpc`, loopback up;
#  2. `nbd-client 127.0.0.1 PORT /dev/nbd0 -N NAME` (the README's line), mkfs.ext4, mount;
#  3. fio on files: JOBS jobs of random BS_KIB KiB O_DIRECT writes with crc32c verify headers,
#     an fsync every FSYNC writes, verified after writing; a third of the way through
#     (in requests, /sys/block/nbd0/stat) `ferroraid fail` takes member FAIL_SLOT out;
#  4. sha256 of every file, umount, `nbd-client -d`, SIGTERM (exit 0, array stopped);
#  5. `serve` again on the surviving members (degraded: every read of the failed member's
#     chunks is rebuilt from parity), `nbd-client` again, caches dropped, `e2fsck -f -n`
#     clean, mount, the sums and fio --verify_only agree, reads served degraded;
#  6. umount, `nbd-client -d`, SIGTERM (exit 0).
. /rig/knbd.env
RPC=/tmp/fr.rpc
FR=/usr/bin/ferroraid
MNT=/mnt/fs
SERVE=

t() { cut -d' ' -f1 /proc/uptime; }
say() { echo "knbd [$(t)s]: $*"; }
fail() {
	echo "knbd: FAIL: $*"
	for f in /tmp/serve*.log; do
		[ -f "$f" ] && { echo "--- last lines of $f"; tail -n 40 "$f"; }
	done
	echo "--- kernel log"
	dmesg | tail -n 40
	[ -z "$SERVE" ] || kill -TERM "$SERVE" 2>/dev/null || true
	exit 1
}
# The writes the kernel completed on nbd0 (/sys/block/nbd0/stat, field 5).
nbd_writes() { set -- $(cat /sys/block/nbd0/stat); echo "$5"; }

# serve LOG DEVICES...: `ferroraid serve` in the background (pid in SERVE), returns once the
# export listens.
serve() {
	_log=$1
	shift
	rm -f "$RPC"
	NO_COLOR=1 $FR serve --adaptive --nbd "127.0.0.1:$PORT" --rpc "$RPC" "$@" >"$_log" 2>&1 &
	SERVE=$!
	_i=0
	until grep -q 'NBD export listening' "$_log" && [ -S "$RPC" ]; do
		kill -0 "$SERVE" 2>/dev/null || { SERVE=; fail "ferroraid serve exited: $(cat "$_log")"; }
		_i=$((_i + 1))
		[ $_i -le 600 ] || fail "ferroraid serve did not listen within 60 s"
		sleep 0.1
	done
}

# stop LOG STATUS: `ferroraid status` to STATUS (exit 1: degraded), then SIGTERM to the
# server; it must exit 0 having stopped the array.
stop() {
	_rc=0
	$FR status --rpc "$RPC" >"$2" 2>&1 || _rc=$?
	[ $_rc -eq 1 ] || fail "ferroraid status exited $_rc, not 1 (degraded): $(cat "$2")"
	kill -TERM "$SERVE"
	_rc=0
	wait "$SERVE" || _rc=$?
	SERVE=
	[ $_rc -eq 0 ] || fail "ferroraid serve exited $_rc on SIGTERM"
	grep -q 'array stopped' "$1" || fail "ferroraid serve logged no 'array stopped'"
}

# connect: the README's line; waits until the kernel has the device sized.
connect() {
	nbd-client 127.0.0.1 "$PORT" /dev/nbd0 -N "$NAME" >>"$RIG_OUT/nbd-client.txt" 2>&1 ||
		fail "nbd-client 127.0.0.1 $PORT /dev/nbd0 -N $NAME: $(cat "$RIG_OUT/nbd-client.txt")"
	_i=0
	while [ "$(cat /sys/block/nbd0/size)" = 0 ]; do
		_i=$((_i + 1))
		[ $_i -le 100 ] || fail "/dev/nbd0 has no size 10 s after nbd-client connected"
		sleep 0.1
	done
}

disconnect() {
	nbd-client -d /dev/nbd0 >>"$RIG_OUT/nbd-client.txt" 2>&1 || fail "nbd-client -d /dev/nbd0 failed"
	_i=0
	while [ "$(cat /sys/block/nbd0/size)" != 0 ]; do
		_i=$((_i + 1))
		[ $_i -le 100 ] || fail "/dev/nbd0 still sized 10 s after nbd-client -d"
		sleep 0.1
	done
}

# fio_job ARGS...: the workload (the same job with --verify_only re-reads and checks it).
fio_job() {
	fio --name=knbd --directory="$MNT" --numjobs="$JOBS" --size="${FILE_MIB}M" --bs="${BS_KIB}k" \
		--rw=randwrite --direct=1 --ioengine=psync --fsync="$FSYNC" --verify=crc32c \
		--verify_fatal=1 --randseed="$SEED" --group_reporting --eta=never "$@"
}

ip link set lo up
ln -sf /proc/mounts /etc/mtab
mkdir -p "$MNT"
cp /rig/kernel "$RIG_OUT/kernel.txt"
echo "$(fio --version); $(mkfs.ext4 -V 2>&1 | head -n1)" >"$RIG_OUT/versions.txt"
say "kernel $(uname -r); $(grep -c ^processor /proc/cpuinfo) cpu; $(cat "$RIG_OUT/versions.txt")"

# --- 1. the array ---------------------------------------------------------------------------
DEVS=$(rig_devs_by_serial knbd- "$MEMBERS") || fail "the member disks knbd-0.. did not appear"
FAILED=$(echo $DEVS | cut -d' ' -f$((FAIL_SLOT + 1)))
SURVIVORS=$(echo $DEVS | tr ' ' '\n' | grep -vx "$FAILED" | tr '\n' ' ')
$FR create --level "$LEVEL" --chunk "$CHUNK" --name "$NAME" $DEVS >"$RIG_OUT/create.txt" 2>&1 ||
	fail "ferroraid create: $(cat "$RIG_OUT/create.txt")"
say "$(tail -n 1 "$RIG_OUT/create.txt")"
serve /tmp/serve-1.log $DEVS
say "ferroraid serve is up on $DEVS"

# --- 2. the kernel's client, a file system --------------------------------------------------
connect
say "nbd-client connected: /dev/nbd0 $(($(cat /sys/block/nbd0/size) * 512)) bytes, logical block $(cat /sys/block/nbd0/queue/logical_block_size)"
mkfs.ext4 -F /dev/nbd0 >"$RIG_OUT/mkfs.txt" 2>&1 || fail "mkfs.ext4 /dev/nbd0: $(cat "$RIG_OUT/mkfs.txt")"
mount -t ext4 /dev/nbd0 "$MNT" || fail "mount /dev/nbd0"
say "mkfs.ext4 and mount done: $(df -k "$MNT" | tail -n 1)"

# --- 3. fio, a member failed under it -------------------------------------------------------
before=$(nbd_writes)
total=$((JOBS * FILE_MIB * 1024 / BS_KIB))
fio_job --output="$RIG_OUT/fio-write.txt" &
FIO=$!
i=0
while [ $(($(nbd_writes) - before)) -lt $((total / 3)) ]; do
	kill -0 $FIO 2>/dev/null || fail "fio ended before a third of its writes reached nbd0: $(cat "$RIG_OUT/fio-write.txt")"
	i=$((i + 1))
	[ $i -le 3000 ] || fail "fio wrote less than a third in 300 s"
	sleep 0.1
done
at_fail=$(($(nbd_writes) - before))
$FR fail --rpc "$RPC" "$FAILED" >"$RIG_OUT/fail.txt" 2>&1 || fail "ferroraid fail $FAILED: $(cat "$RIG_OUT/fail.txt")"
kill -0 $FIO 2>/dev/null || fail "fio was not running any more when the member failed"
say "ferroraid fail $FAILED (slot $FAIL_SLOT) after $at_fail of fio's writes reached nbd0, fio still running"
rc=0
wait $FIO || rc=$?
[ $rc -eq 0 ] || fail "fio (write + verify) exited $rc: $(cat "$RIG_OUT/fio-write.txt")"
grep -q 'err= 0' "$RIG_OUT/fio-write.txt" || fail "fio reported errors: $(cat "$RIG_OUT/fio-write.txt")"
after=$(($(nbd_writes) - before))
[ $after -gt $at_fail ] || fail "no write reached nbd0 after the fail ($after, $at_fail at the fail)"
say "fio done: $JOBS jobs x $FILE_MIB MiB written and verified; nbd0 writes: $at_fail before the fail, $after in all"
echo "$at_fail $after" >"$RIG_OUT/writes.txt"

# --- 4. sums, unmount, disconnect, stop -----------------------------------------------------
(cd "$MNT" && find . -type f | sort | xargs sha256sum) >/tmp/sums.txt
cp /tmp/sums.txt "$RIG_OUT/sums.txt"
[ "$(wc -l </tmp/sums.txt)" -eq "$JOBS" ] || fail "expected $JOBS files, found: $(cat /tmp/sums.txt)"
sync
umount "$MNT" || fail "umount after fio"
disconnect
stop /tmp/serve-1.log "$RIG_OUT/status-1.txt"
cp /tmp/serve-1.log "$RIG_OUT/"
say "unmounted, nbd-client -d, ferroraid serve stopped (exit 0)"

# --- 5. again, degraded: a new target, a new connection, fsck, the files --------------------
serve /tmp/serve-2.log $SURVIVORS
say "ferroraid serve is up again on the survivors $SURVIVORS"
connect
echo 3 >/proc/sys/vm/drop_caches
rc=0
e2fsck -f -n /dev/nbd0 >"$RIG_OUT/e2fsck.txt" 2>&1 || rc=$?
[ $rc -eq 0 ] || fail "e2fsck -f -n /dev/nbd0 exited $rc: $(cat "$RIG_OUT/e2fsck.txt")"
say "e2fsck -f -n clean: $(tail -n 1 "$RIG_OUT/e2fsck.txt")"
mount -t ext4 /dev/nbd0 "$MNT" || fail "mount /dev/nbd0 again"
(cd "$MNT" && sha256sum -c /tmp/sums.txt) >"$RIG_OUT/sums-check.txt" 2>&1 ||
	fail "the files' sha256 differ after the remount: $(cat "$RIG_OUT/sums-check.txt")"
rc=0
fio_job --verify_only --output="$RIG_OUT/fio-verify.txt" || rc=$?
[ $rc -eq 0 ] || fail "fio --verify_only exited $rc: $(cat "$RIG_OUT/fio-verify.txt")"
grep -q 'err= 0' "$RIG_OUT/fio-verify.txt" || fail "fio --verify_only reported errors: $(cat "$RIG_OUT/fio-verify.txt")"
say "remounted: sha256 of the $JOBS files equal, fio --verify_only passed"
umount "$MNT" || fail "umount after the verify"
disconnect
stop /tmp/serve-2.log "$RIG_OUT/status-2.txt"
grep -q 'reads: [0-9]* direct, [1-9][0-9]* degraded' "$RIG_OUT/status-2.txt" ||
	fail "the degraded array served no degraded read: $(cat "$RIG_OUT/status-2.txt")"
cp /tmp/serve-2.log "$RIG_OUT/"
dmesg | grep -i nbd >"$RIG_OUT/dmesg-nbd.txt" || true
say "done"
