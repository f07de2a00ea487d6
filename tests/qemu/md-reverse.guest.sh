# Guest side of tests/qemu/md-reverse.sh: runs as /rig/test.sh (busybox sh -e, with
# /rig/lib.sh sourced) inside the rig's initramfs. For each array of /rig/arrays.conf, whose
# members ferroraid created and wrote on the host, the real mdadm + md driver:
#
# 1. assemble it (`mdadm --assemble --run`, the member disks NAME-SLOT in a shuffled order;
#    a degraded array's missing member is not attached at all);
# 2. must find it clean: active, sync_action idle, resync_start none, nothing resyncing in
#    /proc/mdstat, the size ferroraid reported;
# 3. must return the pattern ferroraid wrote (md5 of the whole array; on a mismatch, `cmp`
#    against the pattern disk p-NAME says where);
# 4. check the parity itself (`check` -> mismatch_cnt 0; complete arrays only);
# 5. write the rewrite pattern (disk p2-rev) at an offset in the middle of a stripe, in
#    64 KiB O_DIRECT writes (md's read-modify-write / reconstruct-write paths on
#    ferroraid's parity), check again, and stop the array cleanly, for the host to serve
#    with ferroraid again.
#
# What md printed goes to $RIG_OUT/NAME/. Any deviation fails the guest (RIG-RESULT: fail).

MD_TAG=md-reverse
# shellcheck source=tests/qemu/md-lib.guest.sh
. /rig/md-lib.sh

mdadm --version >"$RIG_OUT/mdadm-version.txt" 2>&1
cat /rig/kernel >"$RIG_OUT/kernel.txt"
echo 1000000 >/proc/sys/dev/raid/speed_limit_min
echo 2000000 >/proc/sys/dev/raid/speed_limit_max
p2=$(rig_dev_by_serial p2-rev)

i=0
# name level members size_bytes md5 order(slots,comma) missing_slot write_off write_bytes bitmap_KiB
while read -r name level members size md5 order missing woff wbytes bitmap <&3; do
	case $name in '' | '#'*) continue ;; esac
	md=/dev/md$i
	n=md$i
	out=$RIG_OUT/$name
	mkdir -p "$out"
	devs=
	for s in $(echo "$order" | tr , ' '); do
		d=$(rig_dev_by_serial "$name-$s")
		devs="$devs $d"
		echo "$s $name-$s $d" >>"$out/devices"
	done
	say "$name: assembling RAID$level from$devs (slots $order; missing: $missing)"
	# shellcheck disable=SC2086
	if ! mdadm --assemble "$md" --run $devs >"$out/assemble.txt" 2>&1; then
		cat "$out/assemble.txt"
		fail "$name: mdadm --assemble refused ferroraid's members"
	fi
	cat "$out/assemble.txt"
	cat /proc/mdstat >"$out/mdstat-assembled.txt"
	mdadm --detail "$md" >"$out/detail-assembled.txt"
	sys=/sys/block/$n/md
	{
		echo "array_state=$(cat $sys/array_state)"
		echo "sync_action=$(cat $sys/sync_action)"
		echo "resync_start=$(cat $sys/resync_start)"
		echo "degraded=$(cat $sys/degraded)"
		echo "raid_disks=$(cat $sys/raid_disks)"
		echo "level=$(cat $sys/level)"
		echo "layout=$(cat $sys/layout)"
		echo "chunk_size=$(cat $sys/chunk_size)"
	} >"$out/state-assembled.txt"
	cat "$out/state-assembled.txt"
	grep -Eq "^$n : active (\(auto-read-only\) )?raid$level " /proc/mdstat || fail "$name: /proc/mdstat does not show $n active raid$level"
	# Clean: nothing to resync (a dirty superblock would have md resync from resync_offset).
	grep -qx 'sync_action=idle' "$out/state-assembled.txt" || fail "$name: md is not idle after assembly"
	grep -qx 'resync_start=none' "$out/state-assembled.txt" || fail "$name: md wants a resync (ferroraid left it dirty?)"
	! busy "$n" || fail "$name: md is resyncing/recovering after assembly"
	grep -qx "raid_disks=$members" "$out/state-assembled.txt" || fail "$name: md's raid_disks is not $members"
	# md's view of the time stamps (the kernel's, through GET_ARRAY_INFO) must be what the
	# superblocks say (mdadm decodes those itself): md reads ctime/utime as plain seconds.
	# shellcheck disable=SC2086
	mdadm --examine $devs >"$out/examine-assembled.txt"
	for f in 'Creation Time' 'Update Time'; do
		k=$(sed -n "s/^ *$f : //p" "$out/detail-assembled.txt")
		e=$(sed -n "s/^ *$f : //p" "$out/examine-assembled.txt" | sort -u)
		[ "$k" = "$e" ] || fail "$name: $f: md says '$k', the superblocks say '$e' (time stamps md cannot read?)"
	done
	want_degraded=0
	[ "$missing" = - ] || want_degraded=1
	grep -qx "degraded=$want_degraded" "$out/state-assembled.txt" || fail "$name: md's degraded count is not $want_degraded"
	got=$(blockdev --getsize64 "$md")
	[ "$got" = "$size" ] || fail "$name: md's array is $got bytes, ferroraid's $size"
	if [ "$bitmap" != - ]; then
		# md loaded ferroraid's bitmap, as current: no "out of date ... forcing full
		# recovery", the chunk ferroraid wrote, and mdadm reports it on every member.
		grep -q 'Intent Bitmap : Internal' "$out/detail-assembled.txt" ||
			fail "$name: md did not load ferroraid's internal bitmap"
		bc=$(cat $sys/bitmap/chunksize)
		[ "$bc" = $((bitmap * 1024)) ] || fail "$name: md's bitmap chunk is $bc, ferroraid wrote $((bitmap * 1024))"
		if dmesg | grep -E "md$i([^0-9]|:)" | grep -Eq 'out of date|forcing full recovery|bitmap superblock UUID mismatch'; then
			dmesg | grep -E "md$i([^0-9]|:)"
			fail "$name: md refused or distrusted ferroraid's bitmap"
		fi
		# shellcheck disable=SC2086
		for d in $devs; do mdadm --examine-bitmap "$d" >>"$out/examine-bitmap-assembled.txt"; done
		grep -q 'State : OK' "$out/examine-bitmap-assembled.txt" ||
			fail "$name: mdadm --examine-bitmap: $(cat "$out/examine-bitmap-assembled.txt")"
		say "$name: md loaded ferroraid's bitmap (chunk $bc)"
	fi

	sum=$(md5sum <"$md" | cut -d' ' -f1)
	echo "$sum" >"$out/md5-assembled"
	if [ "$sum" != "$md5" ]; then
		pat=$(rig_dev_by_serial "p-$name")
		cmp "$md" "$pat" || true
		fail "$name: md returns other data than ferroraid wrote (md5 $sum, want $md5)"
	fi
	say "$name: md returns ferroraid's data ($size bytes, md5 $sum)"
	if [ "$missing" = - ]; then
		md_check "$md" "$out/mismatch_cnt"
		say "$name: md check of ferroraid's parity: mismatch_cnt $(cat "$out/mismatch_cnt")"
	fi

	# md writes: 64 KiB O_DIRECT, starting and ending mid-stripe.
	dd if="$p2" of="$md" bs=65536 seek=$((woff / 65536)) count=$((wbytes / 65536)) \
		iflag=fullblock oflag=direct 2>"$out/dd.txt"
	sync
	say "$name: md wrote $wbytes bytes at $woff"
	if [ "$missing" = - ]; then
		md_check "$md" "$out/mismatch_cnt-after-write"
		say "$name: md check after md's writes: mismatch_cnt $(cat "$out/mismatch_cnt-after-write")"
	fi
	mdadm --detail "$md" >"$out/detail.txt"
	cat /proc/mdstat >"$out/mdstat.txt"
	dmesg | grep -E "md$i([^0-9]|$)" >"$out/dmesg.txt" || true
	mdadm --stop "$md"
	# shellcheck disable=SC2086
	mdadm --examine $devs >"$out/examine.txt"
	if [ "$bitmap" != - ]; then
		# shellcheck disable=SC2086
		for d in $devs; do mdadm --examine-bitmap "$d" >>"$out/examine-bitmap.txt"; done
	fi
	say "$name: stopped"
	i=$((i + 1))
done 3</rig/arrays.conf
