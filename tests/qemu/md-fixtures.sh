#!/usr/bin/env bash
# Member images written by Linux md itself, for ferroraid's compatibility tests.
#
#   tests/qemu/md-fixtures.sh OUTDIR           make them (nothing to do if OUTDIR is current)
#   tests/qemu/md-fixtures.sh --check OUTDIR   exit 0 if OUTDIR is current, 3 if not
#
# One boot of the rig's guest (tests/qemu/rig.sh: Debian kernel, real mdadm + md driver)
# creates the arrays below on sparse 24 MiB files attached as virtio disks, waits for the
# initial resync, writes a seeded pattern (tests/qemu/mdfix.py pattern) over each whole
# array, has md check the parity, and stops the arrays cleanly. mdfix6d is left degraded:
# after the pattern, member 2 is failed and removed and the first 4 MiB are rewritten, so its
# image (and superblock) is stale. mdfix6b is made with an internal write-intent bitmap
# (64 KiB bitmap chunks) and treated like mdfix6d (member 1 failed and removed, the first
# 2 MiB rewritten degraded), so md leaves the rewritten regions dirty in the bitmap and
# member 1 re-addable from it. OUTDIR/NAME/ then holds d0.img.. (the disk given to md
# as NAME-i), pattern.bin (the array's final logical content), manifest.json (geometry, md's
# data offset/size, events, members in slot order, kernel) and what md printed (detail.txt,
# examine*.txt, mdstat*.txt). OUTDIR/console.log is the guest console. See docs/TESTING.md.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=tests/qemu/rig.sh
source "$HERE/rig.sh"

MEMBER_BYTES=${MDFIX_MEMBER_BYTES:-$((24 << 20))}
# name level layout members chunk_KiB fail_slot rewrite_KiB seed rewrite_seed bitmap_chunk_KiB
ARRAYS="\
mdfix6  6 left-symmetric   6 64 - 0    6001 0    -
mdfix5  5 left-asymmetric  5 64 - 0    5001 0    -
mdfix6d 6 right-asymmetric 5 64 2 4096 6002 6003 -
mdfix6b 6 left-symmetric   5 64 1 2048 6004 6005 64"

fixtures_key() {
	{
		cat "$HERE/rig.sh" "$HERE/md-fixtures.sh" "$HERE/md-fixtures.guest.sh" "$HERE/mdfix.py"
		echo "$MEMBER_BYTES"
	} | sha256sum | cut -c1-16
}

check=0
if [[ ${1:-} == --check ]]; then
	check=1
	shift
fi
[[ $# == 1 ]] || rig_die "usage: $0 [--check] OUTDIR"
out=$1
key=$(fixtures_key)
if [[ -e $out/.complete && $(cat "$out/.complete") == "$key" ]]; then
	((check)) || rig_log "md fixtures in $out are current (key $key)"
	exit 0
fi
((check)) && exit 3

rig_need python3 mdadm truncate
start=$SECONDS
rig_kernel
mkdir -p "$(dirname "$out")"
out=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")
work=$out.tmp.$$
# MDFIX_KEEP=1 keeps the work directory of a failed run for a look.
trap '[[ ${MDFIX_KEEP:-} == 1 ]] && rig_log "kept $work" || rm -rf "$work"' EXIT
rm -rf "$work"
mkdir -p "$work"
printf '%s\n' "$ARRAYS" | awk '{print $1, $2, $3, $4, $5, $6, $7, $10}' >"$work/arrays.conf"

disks=()
while read -r name level layout members chunk fail rewrite seed rseed _bitmap; do
	mkdir -p "$work/$name"
	for ((i = 0; i < members; i++)); do
		truncate -s "$MEMBER_BYTES" "$work/$name/d$i.img"
		disks+=(--disk "virtio:$work/$name/d$i.img:$name-$i")
	done
	# The array is smaller than data members x member size (md's data offset); trimmed after.
	nd=$((members - level + 4))
	python3 "$HERE/mdfix.py" pattern --name "$name" --seed "$seed" --size $((nd * MEMBER_BYTES)) \
		--out "$work/$name/pattern.bin"
	disks+=(--disk "virtio:$work/$name/pattern.bin:p-$name:ro")
	if [[ $fail != - ]]; then
		python3 "$HERE/mdfix.py" pattern --name "$name-rewrite" --seed "$rseed" --size $((rewrite * 1024)) \
			--out "$work/$name/rewrite.bin"
		disks+=(--disk "virtio:$work/$name/rewrite.bin:p2-$name:ro")
	fi
done <<<"$ARRAYS"
rig_log "md fixtures: images and patterns ready ($((SECONDS - start))s)"

initrd=$(rig_initramfs --init "$HERE/md-fixtures.guest.sh" --modules md --bin "$(command -v mdadm)" \
	--file "$work/arrays.conf:/rig/arrays.conf")
if ! rig_run --initrd "$initrd" --log "$work/console.log" --timeout "${MDFIX_TIMEOUT:-600}" \
	--out-disk "$work/out.img" --out-dir "$work/guest" "${disks[@]}"; then
	cp "$work/console.log" "$out.failed-console.log" 2>/dev/null || true
	rig_die "the md-fixtures guest failed; its console log: $out.failed-console.log"
fi
rig_log "md fixtures: guest done ($((SECONDS - start))s)"

cp "$work/guest/kernel.txt" "$work/guest/mdadm-version.txt" "$work/"
while read -r name level layout members chunk fail rewrite seed rseed _bitmap; do
	d=$work/$name
	[[ -s $work/guest/$name/array_size ]] || rig_die "the guest left no results for $name (see $work/console.log)"
	cp -r "$work/guest/$name/." "$d/"
	size=$(cat "$d/array_size")
	truncate -s "$size" "$d/pattern.bin"
	args=()
	if [[ $fail != - ]]; then
		python3 "$HERE/mdfix.py" compose --base "$d/pattern.bin" --over "$d/rewrite.bin" --out "$d/final.bin"
		mv "$d/final.bin" "$d/pattern.bin"
		rm "$d/rewrite.bin"
		args=(--rewrite-seed "$rseed" --rewrite-bytes $((rewrite * 1024)))
	fi
	python3 "$HERE/mdfix.py" manifest --dir "$d" --name "$name" --level "$level" --layout "$layout" \
		--chunk $((chunk * 1024)) --members "$members" --image-bytes "$MEMBER_BYTES" --seed "$seed" "${args[@]}"
done <<<"$ARRAYS"
rm -rf "$work/guest"
echo "$key" >"$work/.complete"
rm -rf "$out"
mv "$work" "$out"
trap - EXIT
rig_log "md fixtures: done in $((SECONDS - start))s: $out ($(sed -n 's/^kernel_release=//p' "$out/kernel.txt"))"
