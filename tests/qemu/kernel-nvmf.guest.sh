# The kernel's own NVMe/TCP host on ferroraid's NVMe/TCP target, in the rig's guest (run by
# kernel-nvmf.sh, which documents the whole test). Busybox sh, `-e`, /rig/lib.sh sourced;
# /rig/knvmf.env holds the parameters. What it prints for the host goes to $RIG_OUT; every
# step is on the console.
#
#  1. `modprobe nvme-tcp` (/dev/nvme-fabrics appears); a host NQN and host ID in /etc/nvme;
#  2. `ferroraid create` a RAID6 over the virtio members (serials knvmf-0..), `serve
#     --adaptive --nvmf 127.0.0.1:PORT --rpc`, loopback up;
#  3. `nvme discover` lists the subsystem; `nvme connect -k 30` gives /dev/nvmeXnY;
#     `nvme id-ctrl`/`id-ns` show the documented fields (docs/NVMF.md);
#  4. fio on the block device: JOBS jobs on disjoint JOB_MIB MiB regions, libaio at QD,
#     O_DIRECT random writes of 4..256 KiB with crc32c verify headers, verified after; a
#     third of the way through (in requests, ns_writes: /sys/block/*/stat) `ferroraid fail` takes
#     member FAIL_SLOT out: no error reaches the host;
#  5. mkfs.ext4, mount, FILES files of FILE_MIB MiB, their sha256, umount, caches dropped,
#     `e2fsck -f -n` clean, mount again, the sums agree, umount;
#  6. `nvme disconnect -n NQN` (controller gone); the kernel's nvme lines so far hold no
#     error, reset, timeout, reconnect or recovery (so also no shutdown complaint: CC.SHN);
#  7. `nvme connect -g -G` (header and data digests; Linux refuses the connection unless
#     the target echoes both), the sums again, fio on files (libaio, QD, crc32c verify);
#  8. the target stopped with the host connected (`ferroraid status` exit 1: degraded;
#     SIGTERM, exit 0, array clean) and served again on the survivors: the host's reconnect
#     loop brings the controller back live ("Successfully reconnected"), `e2fsck -f -n`
#     clean, all sums agree, fio --verify_only passes, reads served degraded; `nvme
#     disconnect`, SIGTERM (exit 0);
#  9. the reference: the kernel's nvmet-tcp exports a loop device of the same size on the
#     same portal (configfs, as blktests does); the same commands pass against it: discover,
#     connect, id-ctrl (recorded for comparison), fio, mkfs/e2fsck, -g -G and the sums,
#     disconnect, no kernel complaint.
. /rig/knvmf.env
RPC=/tmp/fr.rpc
FR=/usr/bin/ferroraid
MNT=/mnt/fs
NQN="nqn.2026-11.org.ferroraid:$NAME"
TAG=knvmf
# shellcheck source=tests/qemu/nvmf-lib.guest.sh
. /rig/nvmf-lib.sh

# fio_line_g FILE: fio's write line.
fio_line_g() { grep -E '^ *write:' "$1" | head -n1 | sed 's/^ *//; s/,.*//'; }

# ctrl_fields FILE: the fields of `nvme id-ctrl` output FILE the summary shows.
ctrl_fields() {
	echo "subnqn $(field "$1" subnqn), mdts $(field "$1" mdts), nn $(field "$1" nn), cntrltype $(field "$1" cntrltype), kas $(field "$1" kas), sgls $(field "$1" sgls), ioccsz $(field "$1" ioccsz), maxcmd $(field "$1" maxcmd), oncs $(field "$1" oncs), vwc $(field "$1" vwc), mn '$(field "$1" mn)'"
}

ln -sf /proc/mounts /etc/mtab
mkdir -p "$MNT"
cp /rig/kernel "$RIG_OUT/kernel.txt"
echo "$(fio --version); $(mkfs.ext4 -V 2>&1 | head -n1); $(nvme version | tr '\n' ' ')" >"$RIG_OUT/versions.txt"
say "kernel $(uname -r); $(grep -c ^processor /proc/cpuinfo) cpu; $(cat "$RIG_OUT/versions.txt")"

# --- 1. the kernel's NVMe/TCP host ------------------------------------------------------------
nvmf_host_init
say "nvme-tcp loaded: $(grep -o '^nvme[a-z_]*' /proc/modules | sort | tr '\n' ' ')/dev/nvme-fabrics present"

# --- 2. the array and the target --------------------------------------------------------------
DEVS=$(rig_devs_by_serial knvmf- "$MEMBERS") || fail "the member disks knvmf-0.. did not appear"
$FR create --level "$LEVEL" --chunk "$CHUNK" --name "$NAME" $DEVS >"$RIG_OUT/create.txt" 2>&1 ||
	fail "ferroraid create: $(cat "$RIG_OUT/create.txt")"
say "$(tail -n 1 "$RIG_OUT/create.txt")"
FAILED=$(echo $DEVS | cut -d' ' -f$((FAIL_SLOT + 1)))
SURVIVORS=$(echo $DEVS | tr ' ' '\n' | grep -vx "$FAILED" | tr '\n' ' ')
serve /tmp/serve-1.log --nvmf "127.0.0.1:$PORT" $DEVS
say "ferroraid serve is up on $DEVS: $(grep -o 'nqn=[^ ]*' /tmp/serve-1.log | head -n1)"

# --- 3. discover, connect, identify -----------------------------------------------------------
timeout 120 nvme discover -t tcp -a 127.0.0.1 -s "$PORT" >"$RIG_OUT/discover.txt" 2>&1 ||
	fail "nvme discover -t tcp -a 127.0.0.1 -s $PORT: $(cat "$RIG_OUT/discover.txt")"
grep -q "^subnqn: *$NQN\$" "$RIG_OUT/discover.txt" ||
	fail "nvme discover does not list $NQN: $(cat "$RIG_OUT/discover.txt")"
say "discovered: $(grep -c '^=====Discovery Log Entry' "$RIG_OUT/discover.txt") entries, trtype $(field "$RIG_OUT/discover.txt" trtype), subnqn $NQN, traddr $(field "$RIG_OUT/discover.txt" traddr), trsvcid $(field "$RIG_OUT/discover.txt" trsvcid)"

connect "$RIG_OUT/connect.txt" 127.0.0.1
BYTES=$(($(cat "/sys/block/$NS/size") * 512))
LBS=$(cat "/sys/block/$NS/queue/logical_block_size")
say "connected: /dev/$NS ($CTRL, state $(cat /sys/class/nvme/$CTRL/state), transport $(cat /sys/class/nvme/$CTRL/transport), queue_count $(cat /sys/class/nvme/$CTRL/queue_count), sqsize $(cat /sys/class/nvme/$CTRL/sqsize)) $BYTES bytes, logical block $LBS, io_min $(cat /sys/block/$NS/queue/minimum_io_size), io_opt $(cat /sys/block/$NS/queue/optimal_io_size)"

nvme id-ctrl "/dev/$CTRL" >"$RIG_OUT/id-ctrl.txt" 2>&1 || fail "nvme id-ctrl /dev/$CTRL: $(cat "$RIG_OUT/id-ctrl.txt")"
nvme id-ns "/dev/$NS" >"$RIG_OUT/id-ns.txt" 2>&1 || fail "nvme id-ns /dev/$NS: $(cat "$RIG_OUT/id-ns.txt")"
I=$RIG_OUT/id-ctrl.txt
[ "$(field "$I" subnqn)" = "$NQN" ] || fail "id-ctrl subnqn '$(field "$I" subnqn)', not $NQN"
[ "$(field "$I" mdts)" = 5 ] || fail "id-ctrl mdts '$(field "$I" mdts)', not 5 (docs/NVMF.md)"
[ "$(field "$I" nn)" = 1 ] || fail "id-ctrl nn '$(field "$I" nn)', not 1"
[ "$(field "$I" cntrltype)" = 1 ] || fail "id-ctrl cntrltype '$(field "$I" cntrltype)', not 1 (I/O)"
[ "$(field "$I" kas)" != 0 ] || fail "id-ctrl kas 0"
ctrl_fields "$I" >"$RIG_OUT/id-ctrl.fields"
I=$RIG_OUT/id-ns.txt
NSZE=$(($(field "$I" nsze)))
[ $NSZE -gt 0 ] || fail "id-ns nsze '$(field "$I" nsze)'"
[ $((NSZE * LBS)) -eq $BYTES ] || fail "id-ns nsze $NSZE x $LBS bytes != /dev/$NS's $BYTES bytes"
[ $(($(field "$I" ncap))) -eq $NSZE ] || fail "id-ns ncap '$(field "$I" ncap)' != nsze $NSZE"
echo "nsze $NSZE = ncap x $LBS bytes = /dev/$NS, nguid $(field "$I" nguid), npwg $(field "$I" npwg), nows $(field "$I" nows), noiob $(field "$I" noiob)" >"$RIG_OUT/id-ns.fields"
say "id-ctrl: $(cat "$RIG_OUT/id-ctrl.fields")"
say "id-ns: $(cat "$RIG_OUT/id-ns.fields")"

# --- 4. fio on the block device ---------------------------------------------------------------
fio_raw() {
	fio --name=knvmf --filename="/dev/$NS" --numjobs="$JOBS" --size="${JOB_MIB}M" \
		--offset_increment="${JOB_MIB}M" --bsrange=4k-256k --rw=randwrite --direct=1 \
		--ioengine=libaio --iodepth="$QD" --verify=crc32c --verify_fatal=1 --randseed="$SEED" \
		--group_reporting --eta=never "$@"
}
before=$(ns_writes)
fio_raw --output="$RIG_OUT/fio.txt" &
FIO=$!
i=0
# A third of fio's writes (at least 4 KiB each of JOBS x JOB_MIB MiB, at most 256 KiB).
third=$((JOBS * JOB_MIB * 1024 / 256 / 3))
while [ $(($(ns_writes) - before)) -lt $third ]; do
	kill -0 $FIO 2>/dev/null || fail "fio ended before $third of its writes reached $NS: $(cat "$RIG_OUT/fio.txt")"
	i=$((i + 1))
	[ $i -le 3000 ] || fail "fio wrote less than $third requests in 300 s"
	sleep 0.05
done
at_fail=$(($(ns_writes) - before))
$FR fail --rpc "$RPC" "$FAILED" >"$RIG_OUT/fail.txt" 2>&1 || fail "ferroraid fail $FAILED: $(cat "$RIG_OUT/fail.txt")"
kill -0 $FIO 2>/dev/null || fail "fio was not running any more when the member failed"
say "ferroraid fail $FAILED (slot $FAIL_SLOT) after $at_fail of fio's writes reached $NS, fio still running"
rc=0
wait $FIO || rc=$?
[ $rc -eq 0 ] || fail "fio (write + verify) exited $rc: $(cat "$RIG_OUT/fio.txt")"
grep -q 'err= 0' "$RIG_OUT/fio.txt" || fail "fio reported errors: $(cat "$RIG_OUT/fio.txt")"
after=$(($(ns_writes) - before))
[ $after -gt $at_fail ] || fail "no write reached $NS after the fail ($after, $at_fail at the fail)"
echo "$at_fail $after" >"$RIG_OUT/writes.txt"
say "fio done: $JOBS jobs x $JOB_MIB MiB at QD $QD written and verified on /dev/$NS; writes: $at_fail before the fail, $after in all"

# --- 5. a file system -------------------------------------------------------------------------
mkfs.ext4 -F "/dev/$NS" >"$RIG_OUT/mkfs.txt" 2>&1 || fail "mkfs.ext4 /dev/$NS: $(cat "$RIG_OUT/mkfs.txt")"
mount -t ext4 "/dev/$NS" "$MNT" || fail "mount /dev/$NS"
say "mkfs.ext4 and mount done: $(df -k "$MNT" | tail -n 1)"
i=0
while [ $i -lt "$FILES" ]; do
	dd if=/dev/urandom of="$MNT/f$i" bs=1M count="$FILE_MIB" 2>/dev/null || fail "writing $MNT/f$i"
	i=$((i + 1))
done
(cd "$MNT" && sha256sum f*) >/tmp/sums.txt
cp /tmp/sums.txt "$RIG_OUT/sums.txt"
sync
umount "$MNT" || fail "umount"
echo 3 >/proc/sys/vm/drop_caches
rc=0
e2fsck -f -n "/dev/$NS" >"$RIG_OUT/e2fsck.txt" 2>&1 || rc=$?
[ $rc -eq 0 ] || fail "e2fsck -f -n /dev/$NS exited $rc: $(cat "$RIG_OUT/e2fsck.txt")"
say "e2fsck -f -n clean: $(tail -n 1 "$RIG_OUT/e2fsck.txt")"
mount -t ext4 "/dev/$NS" "$MNT" || fail "mount /dev/$NS again"
(cd "$MNT" && sha256sum -c /tmp/sums.txt) >"$RIG_OUT/sums-check.txt" 2>&1 ||
	fail "the files' sha256 differ after the remount: $(cat "$RIG_OUT/sums-check.txt")"
umount "$MNT" || fail "umount after the check"
say "remounted: sha256 of the $FILES files equal"

# --- 6. disconnect: the kernel shuts the controller down (CC.SHN), no complaint so far -------
disconnect "$RIG_OUT/disconnect.txt"
say "nvme disconnect: $(head -n1 "$RIG_OUT/disconnect.txt")"
if complaints "$RIG_OUT/complaints-1.txt"; then
	fail "the kernel complained: $(cat "$RIG_OUT/complaints-1.txt")"
fi
say "kernel log: $(dmesg | grep -ci nvme) nvme lines, no complaint"

# --- 7. header and data digests: the file system again, fio on files --------------------------
# -c 2: the host's reconnect loop retries every 2 s (step 8); -l 120: for 120 s.
connect "$RIG_OUT/connect-digests.txt" 127.0.0.1 -g -G -c 2 -l 120
mount -t ext4 "/dev/$NS" "$MNT" || fail "mount /dev/$NS (digests)"
(cd "$MNT" && sha256sum -c /tmp/sums.txt) >"$RIG_OUT/sums-digests.txt" 2>&1 ||
	fail "the files' sha256 differ over the digest connection: $(cat "$RIG_OUT/sums-digests.txt")"
fio_files() {
	fio --name=kdgst --directory="$MNT" --numjobs="$JOBS" --size="${FILE_MIB}M" --bsrange=4k-128k \
		--rw=randwrite --direct=1 --ioengine=libaio --iodepth="$QD" --verify=crc32c \
		--verify_fatal=1 --randseed="$SEED" --group_reporting --eta=never "$@"
}
rc=0
fio_files --output="$RIG_OUT/fio-digests.txt" || rc=$?
[ $rc -eq 0 ] || fail "fio on files (digests) exited $rc: $(cat "$RIG_OUT/fio-digests.txt")"
grep -q 'err= 0' "$RIG_OUT/fio-digests.txt" || fail "fio (digests) reported errors: $(cat "$RIG_OUT/fio-digests.txt")"
(cd "$MNT" && sha256sum kdgst*) >/tmp/sums-2.txt
umount "$MNT" || fail "umount (digests)"
say "digests: nvme connect -g -G: /dev/$NS ($CTRL, state $(cat /sys/class/nvme/$CTRL/state)), sha256 $(grep -c ': OK$' "$RIG_OUT/sums-digests.txt")/$FILES OK, fio on files exit 0"

# --- 8. the target restarts under the connected host: its reconnect loop -----------------------
stop /tmp/serve-1.log "$RIG_OUT/status-1.txt" 1
say "ferroraid serve stopped (exit 0) with $CTRL connected: $(cat /sys/class/nvme/$CTRL/state)"
serve /tmp/serve-2.log --nvmf "127.0.0.1:$PORT" $SURVIVORS
i=0
until [ "$(cat /sys/class/nvme/$CTRL/state 2>/dev/null)" = live ] && dmesg | grep -q 'Successfully reconnected'; do
	[ -e "/sys/class/nvme/$CTRL" ] || fail "the host gave $CTRL up after the target restarted"
	i=$((i + 1))
	[ $i -le 900 ] || fail "$CTRL not live again 90 s after the target restarted: $(cat /sys/class/nvme/$CTRL/state)"
	sleep 0.1
done
say "restart: $CTRL live again, $(dmesg | grep -o 'Successfully reconnected.*' | tail -n1)"
echo 3 >/proc/sys/vm/drop_caches
rc=0
e2fsck -f -n "/dev/$NS" >"$RIG_OUT/e2fsck-2.txt" 2>&1 || rc=$?
[ $rc -eq 0 ] || fail "e2fsck -f -n /dev/$NS after the restart exited $rc: $(cat "$RIG_OUT/e2fsck-2.txt")"
mount -t ext4 "/dev/$NS" "$MNT" || fail "mount /dev/$NS after the restart"
(cd "$MNT" && sha256sum -c /tmp/sums.txt && sha256sum -c /tmp/sums-2.txt) >"$RIG_OUT/sums-restart.txt" 2>&1 ||
	fail "the files' sha256 differ after the restart: $(cat "$RIG_OUT/sums-restart.txt")"
rc=0
fio_files --verify_only --output="$RIG_OUT/fio-restart.txt" || rc=$?
[ $rc -eq 0 ] || fail "fio --verify_only after the restart exited $rc: $(cat "$RIG_OUT/fio-restart.txt")"
umount "$MNT" || fail "umount after the restart"
say "after the restart: e2fsck -f -n clean, sha256 $(grep -c ': OK$' "$RIG_OUT/sums-restart.txt") files OK, fio --verify_only exit 0"
disconnect "$RIG_OUT/disconnect-2.txt"
say "nvme disconnect: $(head -n1 "$RIG_OUT/disconnect-2.txt")"
stop /tmp/serve-2.log "$RIG_OUT/status-2.txt" 1
grep -q 'reads: [0-9]* direct, [1-9][0-9]* degraded' "$RIG_OUT/status-2.txt" ||
	fail "the degraded array served no degraded read: $(cat "$RIG_OUT/status-2.txt")"
dmesg | grep -i 'nvme' >"$RIG_OUT/dmesg-nvme.txt" || true
complaints "$RIG_OUT/complaints-2.txt" || true
say "kernel log of the restart: $(tr '\n' '|' <"$RIG_OUT/complaints-2.txt" | sed 's/\[ *[0-9.]*\] //g')"

# --- 9. the reference: the same commands against the kernel's own nvmet-tcp ------------------
# A loop device on a tmpfs file of the array's size, exported by nvmet through configfs (as
# blktests does) on the same portal.
seen=$(dmesg | wc -l)
modprobe nvmet-tcp || fail "modprobe nvmet-tcp"
grep -q " /sys/kernel/config " /proc/mounts || mount -t configfs none /sys/kernel/config || fail "mount configfs"
truncate -s "$BYTES" /tmp/ref.img
LOOP=$(losetup -f)
losetup "$LOOP" /tmp/ref.img || fail "losetup $LOOP /tmp/ref.img"
NQN=nqn.2014-08.org.ferroraid:nvmet-ref
C=/sys/kernel/config/nvmet
mkdir "$C/subsystems/$NQN" "$C/subsystems/$NQN/namespaces/1" "$C/ports/1" || fail "nvmet configfs mkdir"
echo 1 >"$C/subsystems/$NQN/attr_allow_any_host"
echo -n "$LOOP" >"$C/subsystems/$NQN/namespaces/1/device_path"
echo 1 >"$C/subsystems/$NQN/namespaces/1/enable" || fail "nvmet: enabling namespace 1 on $LOOP"
echo tcp >"$C/ports/1/addr_trtype"
echo ipv4 >"$C/ports/1/addr_adrfam"
echo 127.0.0.1 >"$C/ports/1/addr_traddr"
echo "$PORT" >"$C/ports/1/addr_trsvcid"
ln -s "$C/subsystems/$NQN" "$C/ports/1/subsystems/$NQN" || fail "nvmet: linking the port"
timeout 120 nvme discover -t tcp -a 127.0.0.1 -s "$PORT" >"$RIG_OUT/discover-nvmet.txt" 2>&1 ||
	fail "nvme discover (nvmet): $(cat "$RIG_OUT/discover-nvmet.txt")"
grep -q "^subnqn: *$NQN\$" "$RIG_OUT/discover-nvmet.txt" ||
	fail "nvme discover does not list $NQN (nvmet): $(cat "$RIG_OUT/discover-nvmet.txt")"
connect "$RIG_OUT/connect-nvmet.txt" 127.0.0.1
nvme id-ctrl "/dev/$CTRL" >"$RIG_OUT/id-ctrl-nvmet.txt" 2>&1 || fail "nvme id-ctrl (nvmet)"
ctrl_fields "$RIG_OUT/id-ctrl-nvmet.txt" >"$RIG_OUT/id-ctrl-nvmet.fields"
rc=0
fio_raw --output="$RIG_OUT/fio-nvmet.txt" || rc=$?
[ $rc -eq 0 ] && grep -q 'err= 0' "$RIG_OUT/fio-nvmet.txt" || fail "fio (nvmet) exited $rc: $(cat "$RIG_OUT/fio-nvmet.txt")"
mkfs.ext4 -F "/dev/$NS" >"$RIG_OUT/mkfs-nvmet.txt" 2>&1 || fail "mkfs.ext4 (nvmet)"
mount -t ext4 "/dev/$NS" "$MNT" || fail "mount (nvmet)"
i=0
while [ $i -lt "$FILES" ]; do
	dd if=/dev/urandom of="$MNT/f$i" bs=1M count="$FILE_MIB" 2>/dev/null || fail "writing $MNT/f$i (nvmet)"
	i=$((i + 1))
done
(cd "$MNT" && sha256sum f*) >/tmp/sums-nvmet.txt
umount "$MNT" || fail "umount (nvmet)"
rc=0
e2fsck -f -n "/dev/$NS" >"$RIG_OUT/e2fsck-nvmet.txt" 2>&1 || rc=$?
[ $rc -eq 0 ] || fail "e2fsck -f -n (nvmet) exited $rc: $(cat "$RIG_OUT/e2fsck-nvmet.txt")"
disconnect "$RIG_OUT/disconnect-nvmet.txt"
connect "$RIG_OUT/connect-nvmet-digests.txt" 127.0.0.1 -g -G
mount -t ext4 "/dev/$NS" "$MNT" || fail "mount (nvmet, digests)"
(cd "$MNT" && sha256sum -c /tmp/sums-nvmet.txt) >"$RIG_OUT/sums-nvmet.txt" 2>&1 ||
	fail "sha256 (nvmet, digests): $(cat "$RIG_OUT/sums-nvmet.txt")"
umount "$MNT" || fail "umount (nvmet, digests)"
disconnect "$RIG_OUT/disconnect-nvmet-2.txt"
dmesg | tail -n +$((seen + 1)) >"$RIG_OUT/dmesg-nvmet.txt"
if sed 's/NQN "[^"]*"/NQN/; s/ferroraid//g' "$RIG_OUT/dmesg-nvmet.txt" | grep -i nvme |
	grep -iE "$COMPLAINT" >"$RIG_OUT/complaints-nvmet.txt"; then
	fail "the kernel complained (nvmet): $(cat "$RIG_OUT/complaints-nvmet.txt")"
fi
say "nvmet reference: discover lists $NQN, connect, fio exit 0 ($(fio_line_g "$RIG_OUT/fio-nvmet.txt")), e2fsck -f -n clean, -g -G sums $(grep -c ': OK$' "$RIG_OUT/sums-nvmet.txt")/$FILES OK, disconnect, no complaint"
say "nvmet id-ctrl: $(cat "$RIG_OUT/id-ctrl-nvmet.fields")"
say "done"
