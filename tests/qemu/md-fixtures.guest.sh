# Guest side of tests/qemu/md-fixtures.sh: runs as /rig/test.sh (busybox sh -e, with
# /rig/lib.sh sourced) inside the rig's initramfs. For each array of /rig/arrays.conf it
# creates the array with the real mdadm + md driver on the disks whose serials are
# NAME-0..NAME-(n-1), waits for the initial resync, writes the pattern disk p-NAME over the
# whole array, optionally fails + removes one member and rewrites the start of the array
# from p2-NAME, has md check parity (mismatch_cnt), records what md reports in
# $RIG_OUT/NAME/, and stops the array cleanly.

t() { cut -d' ' -f1 /proc/uptime; }
say() { echo "md-fixtures [$(t)s]: $*"; }

# Waits until md has nothing to do on $1 (no resync/recovery/check running or pending).
wait_idle() {
	_n=${1#/dev/} _i=0
	while :; do
		_a=$(cat "/sys/block/$_n/md/sync_action")
		_r=$(cat "/sys/block/$_n/md/resync_start")
		if [ "$_a" = idle ] && [ "$_r" = none ] && ! grep -A3 "^$_n :" /proc/mdstat | grep -Eq 'resync|recovery|check|PENDING|DELAYED'; then
			return 0
		fi
		_i=$((_i + 1))
		if [ $_i -gt 1200 ]; then
			echo "md-fixtures: $1 still busy after 600 s (sync_action=$_a resync_start=$_r)"
			cat /proc/mdstat
			return 1
		fi
		sleep 0.5
	done
}

mdadm --version >"$RIG_OUT/mdadm-version.txt" 2>&1
cat /rig/kernel >"$RIG_OUT/kernel.txt"
# No other I/O competes; let resync run at full speed.
echo 1000000 >/proc/sys/dev/raid/speed_limit_min
echo 2000000 >/proc/sys/dev/raid/speed_limit_max

i=0
while read -r name level layout members chunk_kib fail_slot rewrite_kib bitmap_kib <&3; do
	case $name in '' | '#'*) continue ;; esac
	md=/dev/md$i
	out=$RIG_OUT/$name
	mkdir -p "$out"
	devs=
	s=0
	while [ $s -lt "$members" ]; do
		d=$(rig_dev_by_serial "$name-$s")
		devs="$devs $d"
		echo "$s $name-$s $d" >>"$out/devices"
		s=$((s + 1))
	done
	pat=$(rig_dev_by_serial "p-$name")
	say "$name: creating RAID$level $layout, $members members, ${chunk_kib}K chunk:$devs"
	bitmap=
	if [ "$bitmap_kib" != - ]; then
		bitmap="--bitmap=internal --bitmap-chunk=$bitmap_kib"
	fi
	# shellcheck disable=SC2086
	mdadm --create "$md" --run --homehost='<none>' --name="$name" --metadata=1.2 \
		--level="$level" --layout="$layout" --chunk="$chunk_kib" --raid-devices="$members" $bitmap $devs
	cat /proc/mdstat >"$out/mdstat-created.txt"
	wait_idle "$md"
	say "$name: initial resync done"
	size=$(blockdev --getsize64 "$md")
	echo "$size" >"$out/array_size"
	parity=$((level - 4))
	width=$(((members - parity) * chunk_kib * 1024))
	# Full stripes, O_DIRECT: md sees whole-stripe writes.
	dd if="$pat" of="$md" bs="$width" count=$((size / width)) iflag=fullblock oflag=direct 2>"$out/dd.txt"
	[ $((size % width)) -eq 0 ] || { echo "md-fixtures: array size $size is not whole stripes of $width"; exit 1; }
	say "$name: wrote $size bytes of the pattern"
	if [ "$fail_slot" != - ]; then
		fdev=$(rig_dev_by_serial "$name-$fail_slot")
		mdadm "$md" --fail "$fdev"
		mdadm "$md" --remove "$fdev"
		pat2=$(rig_dev_by_serial "p2-$name")
		# 64 KiB O_DIRECT writes: partial stripes, so md's degraded read-modify/reconstruct-write paths.
		dd if="$pat2" of="$md" bs=65536 count=$((rewrite_kib / 64)) iflag=fullblock oflag=direct 2>>"$out/dd.txt"
		say "$name: failed and removed $fdev (slot $fail_slot), rewrote the first ${rewrite_kib} KiB degraded"
	else
		# md's own verdict on the parity it wrote.
		echo check >/sys/block/${md#/dev/}/md/sync_action
		sleep 1
		wait_idle "$md"
		cat /sys/block/${md#/dev/}/md/mismatch_cnt >"$out/mismatch_cnt"
		say "$name: md check done, mismatch_cnt $(cat "$out/mismatch_cnt")"
	fi
	sync
	mdadm --detail "$md" >"$out/detail.txt"
	cat /proc/mdstat >"$out/mdstat.txt"
	mdadm --stop "$md"
	# shellcheck disable=SC2086
	mdadm --examine $devs >"$out/examine.txt"
	if [ "$bitmap_kib" != - ]; then
		for d in $devs; do
			mdadm --examine-bitmap "$d" >>"$out/examine-bitmap.txt"
		done
	fi
	say "$name: stopped"
	i=$((i + 1))
done 3</rig/arrays.conf
