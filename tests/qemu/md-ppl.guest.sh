# Guest side of tests/qemu/md-ppl.sh: runs as /rig/test.sh (busybox sh -e, with /rig/lib.sh
# and /rig/md-lib.sh sourced) inside the rig's initramfs; /rig/ppl.env sets the sizes.
#
# Part 1, ferroraid -> md (disks fr2md-0.., killed under writes on the host, members dirty
# with ferroraid's PPL records live): with md's PPL debug messages on (dynamic debug,
# raid5-ppl.c), `mdadm --assemble` must run md's PPL recovery (ppl_load: "mismatch_count: 0
# recovered_entries: N", N > 0) and come up clean without a resync, consistency_policy ppl;
# the whole array is read back for the host (md-read.bin), md's `check` must find
# mismatch_cnt 0, and the array is stopped cleanly.
#
# Part 0, ferroraid's RAID6 PPL (disks fr6ppl-.., fr6rs-..: one array written by ferroraid and
# stopped cleanly; fr6rs is a copy switched with `ferroraid grow --consistency-policy
# resync`): md must refuse the PPL members (the ferroraid feature bit is one md does not
# know), and assemble the switched copy clean, read it back for the host, and find
# mismatch_cnt 0.
#
# Part 2, md -> ferroraid (disks md2fr-0..): `mdadm --create --consistency-policy=ppl` a
# RAID5 (--assume-clean: the members are zero, so parity is consistent), write the pattern
# p-md2fr over it in full stripes, then hand the results to the host (the out disk, and
# RIG-RESULT: ok, now: the guest does not come back), start writers of small random O_DIRECT
# writes of n-md2fr into the crash window and, after at least CRASH_AFTER of them and a
# random pause, crash the guest (sysrq b: no sync, no stop; QEMU exits on the reboot).

MD_TAG=md-ppl
# shellcheck source=tests/qemu/md-lib.guest.sh
. /rig/md-lib.sh
# shellcheck disable=SC1091
. /rig/ppl.env

mdadm --version >"$RIG_OUT/mdadm-version.txt" 2>&1
cat /rig/kernel >"$RIG_OUT/kernel.txt"
echo 1000000 >/proc/sys/dev/raid/speed_limit_min
echo 2000000 >/proc/sys/dev/raid/speed_limit_max

# md's PPL messages are pr_debug: switched on for raid5-ppl.c while md assembles.
ddc=/proc/dynamic_debug/control
if [ ! -w $ddc ]; then
	mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null || true
	ddc=/sys/kernel/debug/dynamic_debug/control
fi
[ -w $ddc ] || fail "no dynamic debug control (neither /proc nor debugfs): md's PPL messages cannot be seen"

# --- part 0: ferroraid's RAID6 PPL ----------------------------------------------------------
out=$RIG_OUT/fr6
mkdir -p "$out"
md=/dev/md2
sys=/sys/block/md2/md
fr6() {
	devs=
	s=0
	while [ $s -lt "$FR6_MEMBERS" ]; do
		devs="$devs $(rig_dev_by_serial "$1-$s")"
		s=$((s + 1))
	done
	echo "$devs"
}
devs=$(fr6 fr6ppl)
# shellcheck disable=SC2086
mdadm --examine $devs >"$out/examine-ppl.txt" 2>&1 || true
# shellcheck disable=SC2086
if mdadm --assemble $md $devs >"$out/assemble-ppl.txt" 2>&1 && [ -e $sys/array_state ] &&
	grep -Eq '^(clean|active)' $sys/array_state; then
	cat "$out/assemble-ppl.txt"
	fail "fr6: md assembled ferroraid's RAID6 PPL array: $(cat $sys/array_state)"
fi
mdadm --stop $md >/dev/null 2>&1 || true
dmesg | grep -E 'md2|md:' | tail -n 20 >"$out/dmesg-refused.txt" || true
grep -Eo 'Invalid argument|does not have a valid v1.2 superblock|not assembled|no (usable|recogniseable) superblock' \
	"$out/assemble-ppl.txt" | sort -u | tr '\n' ' ' | sed 's/ $//' >"$out/refused.txt"
[ -s "$out/refused.txt" ] || echo "refused: $(head -n1 "$out/assemble-ppl.txt")" >"$out/refused.txt"
say "fr6: md refused ferroraid's RAID6 PPL members: $(cat "$out/refused.txt")"
devs=$(fr6 fr6rs)
# shellcheck disable=SC2086
if ! mdadm --assemble $md $devs >"$out/assemble-resync.txt" 2>&1; then
	cat "$out/assemble-resync.txt"
	fail "fr6: md refused the array switched to resync"
fi
{
	echo "array_state=$(cat $sys/array_state)"
	echo "consistency_policy=$(cat $sys/consistency_policy)"
	echo "resync_start=$(cat $sys/resync_start)"
} >"$out/state.txt"
grep -qx 'consistency_policy=resync' "$out/state.txt" || fail "fr6: md's policy: $(cat "$out/state.txt")"
grep -qx 'resync_start=none' "$out/state.txt" || fail "fr6: md wants a resync of a cleanly stopped array: $(cat "$out/state.txt")"
dd if=$md of="$out/md-read.bin" bs=1048576 2>/dev/null
md_check $md "$out/mismatch_cnt"
say "fr6: md assembled the switched array ($(tr '\n' ' ' <"$out/state.txt")), read $(wc -c <"$out/md-read.bin") bytes, mismatch_cnt $(cat "$out/mismatch_cnt")"
[ "$(cat "$out/mismatch_cnt")" = 0 ] || fail "fr6: md check found mismatches"
mdadm --stop $md

# --- part 1: ferroraid -> md ------------------------------------------------------------
out=$RIG_OUT/fr2md
mkdir -p "$out"
md=/dev/md0
sys=/sys/block/md0/md
devs=
s=$((FR_MEMBERS - 1))
while [ $s -ge 0 ]; do
	devs="$devs $(rig_dev_by_serial "fr2md-$s")"
	s=$((s - 1))
done
# shellcheck disable=SC2086
mdadm --examine $devs >"$out/examine-before.txt" 2>&1 || fail "mdadm --examine of ferroraid's members failed"
n=$(grep -c '^ *State : active$' "$out/examine-before.txt" || true)
[ "$n" = "$FR_MEMBERS" ] || fail "ferroraid's members are not all dirty (State : active on $n of $FR_MEMBERS)"
echo 'file raid5-ppl.c +p' >$ddc
say "fr2md: assembling ferroraid's dirty PPL RAID5 from$devs"
# shellcheck disable=SC2086
if ! mdadm --assemble $md $devs >"$out/assemble.txt" 2>&1; then
	cat "$out/assemble.txt"
	fail "mdadm --assemble refused ferroraid's members"
fi
echo 'file raid5-ppl.c -p' >$ddc
cat "$out/assemble.txt"
cat /proc/mdstat >"$out/mdstat-assembled.txt"
{
	echo "array_state=$(cat $sys/array_state)"
	echo "consistency_policy=$(cat $sys/consistency_policy)"
	echo "sync_action=$(cat $sys/sync_action)"
	echo "resync_start=$(cat $sys/resync_start)"
	echo "degraded=$(cat $sys/degraded)"
} >"$out/state-assembled.txt"
cat "$out/state-assembled.txt"
dmesg >"$out/dmesg-assemble.txt"
grep -E 'md/raid:md0|ppl_load|latest PPL|ppl_recover:' "$out/dmesg-assemble.txt" || true
grep -Eq '^array_state=(clean|active)$' "$out/state-assembled.txt" || fail "fr2md: md's array is not clean/active"
grep -qx 'consistency_policy=ppl' "$out/state-assembled.txt" || fail "fr2md: md's consistency_policy is not ppl"
grep -qx 'resync_start=none' "$out/state-assembled.txt" || fail "fr2md: md wants a resync: its PPL recovery did not make the dirty array clean"
grep -qx 'sync_action=idle' "$out/state-assembled.txt" || fail "fr2md: md is not idle after assembly"
! busy md0 || fail "fr2md: md is resyncing after assembly"
sed -n 's/.*ppl_load: return: \(.*\)$/\1/p' "$out/dmesg-assemble.txt" >"$out/ppl_load.txt"
[ -s "$out/ppl_load.txt" ] || fail "fr2md: md printed no ppl_load line (PPL not loaded, or dynamic debug off)"
grep -Eq '^0 mismatch_count: 0 recovered_entries: [1-9][0-9]*$' "$out/ppl_load.txt" ||
	fail "fr2md: md's PPL recovery: $(cat "$out/ppl_load.txt")"
say "fr2md: md's PPL recovery: return: $(cat "$out/ppl_load.txt")"
mdadm --detail $md >"$out/detail.txt"
dd if=$md of="$out/md-read.bin" bs=1048576 2>/dev/null
say "fr2md: read the array back ($(wc -c <"$out/md-read.bin") bytes)"
md_check $md "$out/mismatch_cnt"
say "fr2md: md check: mismatch_cnt $(cat "$out/mismatch_cnt")"
mdadm --stop $md
# shellcheck disable=SC2086
mdadm --examine $devs >"$out/examine-after.txt"
n=$(grep -c '^ *State : clean$' "$out/examine-after.txt" || true)
[ "$n" = "$FR_MEMBERS" ] || fail "fr2md: md did not leave every member clean"

# --- part 2: md -> ferroraid ------------------------------------------------------------
out=$RIG_OUT/md2fr
mkdir -p "$out"
md=/dev/md1
sys=/sys/block/md1/md
devs=
s=0
while [ $s -lt "$MD_MEMBERS" ]; do
	devs="$devs $(rig_dev_by_serial "md2fr-$s")"
	s=$((s + 1))
done
pat=$(rig_dev_by_serial p-md2fr)
new=$(rig_dev_by_serial n-md2fr)
say "md2fr: creating a PPL RAID5, $MD_MEMBERS members, ${MD_CHUNK_KIB}K chunk:$devs"
# shellcheck disable=SC2086
mdadm --create $md --run --homehost='<none>' --name=md2fr --metadata=1.2 --level=5 \
	--layout=left-symmetric --chunk="$MD_CHUNK_KIB" --raid-devices="$MD_MEMBERS" \
	--consistency-policy=ppl --assume-clean $devs >"$out/create.txt" 2>&1 || {
	cat "$out/create.txt"
	fail "md2fr: mdadm --create failed"
}
[ "$(cat $sys/consistency_policy)" = ppl ] || fail "md2fr: md's consistency_policy is $(cat $sys/consistency_policy)"
size=$(blockdev --getsize64 $md)
echo "$size" >"$out/array_size"
width=$(((MD_MEMBERS - 1) * MD_CHUNK_KIB * 1024))
[ $((size % width)) -eq 0 ] || fail "md2fr: array size $size is not whole stripes of $width"
dd if="$pat" of=$md bs="$width" count=$((size / width)) iflag=fullblock oflag=direct 2>"$out/dd.txt"
say "md2fr: wrote the pattern ($size bytes)"
# Stay dirty while the writers run (md marks the array clean after safe_mode_delay idle).
echo 60 >$sys/safe_mode_delay
mdadm --detail $md >"$out/detail.txt"
cat /proc/mdstat >"$out/mdstat.txt"
echo "consistency_policy=$(cat $sys/consistency_policy)" >"$out/state.txt"
for d in $devs; do
	echo "${d#/dev/} ppl_sector=$(cat $sys/dev-${d#/dev/}/ppl_sector) ppl_size=$(cat $sys/dev-${d#/dev/}/ppl_size)"
done >>"$out/state.txt"

# The results so far go to the host now: the guest ends in a crash.
rig_finish_early() {
	o=$(rig_dev_by_serial rig-out 0)
	(cd /rig/out && tar -cf "$o" .)
	sync
	echo "RIG-RESULT: ok"
}
rig_finish_early

writer() {
	while :; do
		r=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
		cnt=$((r % 8 + 1))
		blk=$((r / 8 % (MD_LEN / 4096 - cnt + 1)))
		dd if="$new" of=$md bs=4096 skip=$blk seek=$((MD_OFF / 4096 + blk)) count=$cnt \
			oflag=direct 2>/dev/null || true
		echo "$blk $cnt" >>"/tmp/writer.$1"
	done
}
w=1
while [ $w -le "$MD_WRITERS" ]; do
	writer $w &
	w=$((w + 1))
done
i=0
while [ "$(cat /tmp/writer.* 2>/dev/null | wc -l)" -lt "$CRASH_AFTER" ]; do
	i=$((i + 1))
	[ $i -lt 1200 ] || fail "md2fr: the writers did not get $CRASH_AFTER writes done in 120 s"
	sleep 0.1
done
pause=$(($(od -An -N2 -tu2 /dev/urandom | tr -d ' ') % 1000))
sleep "0.$(printf %03d $pause)"
say "md2fr: $(cat /tmp/writer.* | wc -l) writes done, array_state $(cat $sys/array_state): crashing the guest (sysrq b) 0.$(printf %03d $pause) s after the ${CRASH_AFTER}th"
echo b >/proc/sysrq-trigger
sleep 30
