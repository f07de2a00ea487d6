#!/usr/bin/env bash
# Linux md assembles and serves arrays that ferroraid wrote: the reverse of md-fixtures.sh.
#
#   tests/qemu/md-reverse.sh OUTDIR           run it (nothing to do if OUTDIR is current)
#   tests/qemu/md-reverse.sh --check OUTDIR   exit 0 if OUTDIR is current, 3 if not
#
# On the host, per array below: `ferroraid create` on sparse member files, `ferroraid serve
# --adaptive` (NBD on a Unix socket), a seeded pattern (mdfix.py pattern) written over the
# whole array with nbdcopy, SIGTERM (ferroraid marks the array clean). Then one boot of the
# rig's guest (tests/qemu/rig.sh: Debian kernel, the host's mdadm, the md driver) with the
# member images as virtio disks: md assembles each array from its members in a shuffled
# order (rev6d with one member not attached at all: degraded), must find it clean, return
# the pattern, and find ferroraid's parity consistent (`check`, mismatch_cnt 0); then md
# writes 4 MiB mid-stripe, checks again and stops the array. Back on the host, ferroraid
# serves the images again (rev6d: with its stale member back among them) and must read
# back exactly what md wrote. rev6b is created with an internal write-intent bitmap
# (256 KiB chunks): md must load ferroraid's bitmap as current (no "out of date", no full
# recovery), keep it through its own write, and ferroraid must find md's bitmap current
# afterwards. See md-reverse.guest.sh and docs/TESTING.md.
#
# FERRORAID=PATH is the binary under test (default: ${CARGO_TARGET_DIR:-target}/release/
# ferroraid; build it first). OUTDIR is current when OUTDIR/.complete holds the hash of the
# scripts, the ferroraid binary and mdadm; it then holds what md and ferroraid printed
# (summary.txt, per array NAME/: create.txt, serve-*.log, examine-*.txt, mdstat*.txt,
# detail*.txt, state-assembled.txt, mismatch_cnt*), not the images (MDREV_KEEP=1 keeps them,
# and a failed run's work directory). MDREV_TIMEOUT bounds the guest (300 s).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=tests/qemu/rig.sh
source "$HERE/rig.sh"
# shellcheck source=tests/qemu/md-host.sh
source "$HERE/md-host.sh"

MEMBER_BYTES=${MDREV_MEMBER_BYTES:-$((24 << 20))}
# name level layout members chunk_KiB missing_slot seed bitmap_chunk_KiB
ARRAYS="\
rev6  6 left-symmetric  6 64 - 7001 -
rev5  5 left-asymmetric 5 64 - 7002 -
rev6d 6 right-symmetric 6 64 2 7003 -
rev6b 6 left-symmetric  5 64 - 7004 256"
# What md writes in the guest (every array): 4 MiB from 3 MiB + 192 KiB, mid-stripe.
WRITE_OFF=$(((3 << 20) + (192 << 10)))
WRITE_BYTES=$((4 << 20))
WRITE_SEED=7009
FERRORAID=${FERRORAID:-${CARGO_TARGET_DIR:-$RIG_REPO/target}/release/ferroraid}

reverse_key() {
	{
		cat "$HERE/rig.sh" "$HERE/md-host.sh" "$HERE/md-reverse.sh" "$HERE/md-reverse.guest.sh" "$HERE/md-lib.guest.sh" "$HERE/mdfix.py"
		sha256sum <"$FERRORAID"
		sha256sum <"$(command -v mdadm)"
		echo "$MEMBER_BYTES"
	} | sha256sum | cut -c1-16
}

md_host_outdir md-reverse reverse_key "$@"

start=$SECONDS
rig_kernel
md_host_workspace md-reverse
RIG_PID=

# Stops every ferroraid server still running, the guest, and removes the work directory.
reverse_cleanup() {
	md_host_stop_all
	# The guest: rig_run's own traps stop QEMU.
	if [[ -n $RIG_PID ]] && kill -TERM "$RIG_PID" 2>/dev/null; then
		wait "$RIG_PID" 2>/dev/null || true
	fi
	rm -rf "$socks"
	# (An if, not `[[ ... ]] && ...`: the trap's last status would become the script's.)
	if [[ ${MDREV_KEEP:-} != 1 ]]; then
		rm -rf "$work"
	elif [[ -d $work ]]; then
		rig_log "kept $work"
	fi
}
trap reverse_cleanup EXIT
trap 'exit 130' INT TERM HUP

# shuffled SEED N [SKIP]: the slots 0..N-1 but SKIP, in a seeded random order (never the
# identity), comma-separated.
shuffled() {
	python3 - "$@" <<'EOF'
import random, sys
seed, n = int(sys.argv[1]), int(sys.argv[2])
slots = [s for s in range(n) if str(s) != (sys.argv[3] if len(sys.argv) > 3 else "-")]
order = slots[:]
random.Random(seed).shuffle(order)
if order == slots:
    order.reverse()
print(",".join(map(str, order)))
EOF
}

rm -rf "$work"
mkdir -p "$work"
python3 "$HERE/mdfix.py" pattern --name rev-write --seed "$WRITE_SEED" --size "$WRITE_BYTES" \
	--out "$work/write.bin"
disks=(--disk "virtio:$work/write.bin:p2-rev:ro")
conf=$work/arrays.conf
: >"$conf"
while read -r name level layout members chunk missing seed bitmap; do
	d=$work/$name
	mkdir -p "$d"
	images=()
	for ((i = 0; i < members; i++)); do
		truncate -s "$MEMBER_BYTES" "$d/d$i.img"
		images+=("$d/d$i.img")
	done
	bm=()
	[[ $bitmap == - ]] || bm=(--bitmap internal --bitmap-chunk "${bitmap}K")
	"$FERRORAID" create --level "$level" --layout "$layout" --chunk "${chunk}K" --name "$name" \
		"${bm[@]}" "${images[@]}" >"$d/create.txt" 2>&1 || rig_die "ferroraid create failed for $name: $(cat "$d/create.txt")"
	size=$(sed -n 's/.*, \([0-9]*\) bytes, data offset .*/\1/p' "$d/create.txt")
	[[ -n $size ]] || rig_die "cannot read the array size from: $(cat "$d/create.txt")"
	python3 "$HERE/mdfix.py" pattern --name "$name" --seed "$seed" --size "$size" --out "$d/pattern.bin"
	md5=$(md5sum <"$d/pattern.bin" | cut -d' ' -f1)
	# Members named in a shuffled order: the superblocks say who is who.
	slots=$(shuffled "$seed" "$members")
	serve=()
	for s in ${slots//,/ }; do serve+=("$d/d$s.img"); done
	md_host_serve "$d/serve-write.log" "$socks/$name" "${serve[@]}"
	md_host_copy "$d/pattern.bin" "nbd+unix:///$name?socket=$socks/$name"
	md_host_stop "$d/serve-write.log"
	mdadm --examine "${images[@]}" >"$d/examine-ferroraid.txt" 2>&1 ||
		rig_die "mdadm --examine of ferroraid's members failed: $(cat "$d/examine-ferroraid.txt")"
	[[ $(grep -c '^ *State : clean$' "$d/examine-ferroraid.txt") == "$members" ]] ||
		rig_die "$name: mdadm --examine does not show every member clean after ferroraid stopped"
	# What the array holds after md's write in the guest.
	cp "$d/pattern.bin" "$d/expected.bin"
	dd if="$work/write.bin" of="$d/expected.bin" bs=65536 seek=$((WRITE_OFF / 65536)) conv=notrunc status=none
	for ((i = 0; i < members; i++)); do
		[[ $i == "$missing" ]] || disks+=(--disk "virtio:$d/d$i.img:$name-$i")
	done
	disks+=(--disk "virtio:$d/pattern.bin:p-$name:ro")
	echo "$name $level $members $size $md5 $(shuffled $((seed + 1)) "$members" "$missing") $missing $WRITE_OFF $WRITE_BYTES $bitmap" >>"$conf"
	rig_log "md-reverse: $name: ferroraid created RAID$level $layout ($members x $MEMBER_BYTES, $size bytes) and wrote the pattern ($((SECONDS - start))s)"
done <<<"$ARRAYS"

# The initramfs is cached by what goes in, paths included: give the list a path that
# depends only on its content, not on this run's work directory.
stable=$RIG_CACHE/md-reverse/arrays-$(sha256sum <"$conf" | cut -c1-16).conf
mkdir -p "$(dirname "$stable")"
[[ -s $stable ]] || { cp "$conf" "$stable.$$" && mv "$stable.$$" "$stable"; }
initrd=$(rig_initramfs --init "$HERE/md-reverse.guest.sh" --modules md --bin "$(command -v mdadm)" \
	--file "$stable:/rig/arrays.conf" --file "$HERE/md-lib.guest.sh:/rig/md-lib.sh")
md_host_guest "$work/console.log" "the md-reverse guest failed (md refused or disagreed with ferroraid's members)" \
	--initrd "$initrd" --timeout "${MDREV_TIMEOUT:-300}" \
	--out-disk "$work/out.img" --out-dir "$work/guest" "${disks[@]}"
rig_log "md-reverse: guest done ($((SECONDS - start))s)"

cp "$work/guest/kernel.txt" "$work/guest/mdadm-version.txt" "$work/"
summary=$work/summary.txt
{
	echo "kernel: $(sed -n 's/^kernel_release=//p' "$work/kernel.txt"); mdadm: $(head -n1 "$work/mdadm-version.txt")"
	echo "ferroraid: $FERRORAID ($(sha256sum <"$FERRORAID" | cut -c1-16))"
} >"$summary"
while read -r name level layout members chunk missing seed bitmap; do
	d=$work/$name
	[[ -s $work/guest/$name/examine.txt ]] || rig_die "the guest left no results for $name (see $work/console.log)"
	cp -r "$work/guest/$name/." "$d/"
	images=()
	for ((i = 0; i < members; i++)); do images+=("$d/d$i.img"); done
	mdadm --examine "${images[@]}" >"$d/examine-md.txt" 2>&1 || true
	# Back to ferroraid: every image (rev6d's stale one too), in another order.
	slots=$(shuffled $((seed + 2)) "$members")
	serve=()
	for s in ${slots//,/ }; do serve+=("$d/d$s.img"); done
	md_host_serve "$d/serve-read.log" "$socks/$name" "${serve[@]}"
	md_host_copy "nbd+unix:///$name?socket=$socks/$name" "$d/readback.bin"
	md_host_stop "$d/serve-read.log"
	if ! cmp "$d/readback.bin" "$d/expected.bin" >"$d/cmp.txt" 2>&1; then
		at=$(sed -n 's/.* byte \([0-9]*\),.*/\1/p' "$d/cmp.txt")
		rig_die "$name: ferroraid reads back other data than md wrote: $(cat "$d/cmp.txt"); \
its block there says: $(dd if="$d/readback.bin" bs=4096 skip=$(((${at:-1} - 1) / 4096)) count=1 status=none | head -c 63)"
	fi
	if [[ $bitmap != - ]]; then
		# md kept the bitmap current: ferroraid finds it so (a stale one is reported).
		grep -q 'write-intent bitmap' "$d/serve-read.log" ||
			rig_die "$name: ferroraid did not set up the bitmap md left: $(cat "$d/serve-read.log")"
		! grep -q 'bitmap is stale' "$d/serve-read.log" ||
			rig_die "$name: ferroraid finds md's bitmap stale: $(cat "$d/serve-read.log")"
	fi
	if [[ $missing != - ]]; then
		grep -q "degraded start: roles \[$missing\] missing" "$d/serve-read.log" ||
			rig_die "$name: ferroraid did not serve md's degraded array without role $missing: $(cat "$d/serve-read.log")"
	fi
	{
		printf '%s: RAID%s %s, %s members (%s), %s bytes; md: %s; %s; mismatch_cnt %s, after md wrote %s; ' \
			"$name" "$level" "$layout" "$members" "$([[ $missing == - ]] && echo complete || echo "slot $missing not attached")" \
			"$(sed -n 's/.*, \([0-9]*\) bytes, data offset .*/\1/p' "$d/create.txt")" \
			"$(sed -n "s/^\(md[0-9]* : .*\)$/\1/p" "$d/mdstat-assembled.txt")" \
			"$(tr '\n' ' ' <"$d/state-assembled.txt" | sed 's/ $//')" \
			"$(cat "$d/mismatch_cnt" 2>/dev/null || echo n/a)" "$(cat "$d/mismatch_cnt-after-write" 2>/dev/null || echo n/a)"
		echo "ferroraid read back md's writes: ok"
	} >>"$summary"
	rig_log "md-reverse: $name: md assembled, checked and wrote; ferroraid read md's writes back ($((SECONDS - start))s)"
done <<<"$ARRAYS"
if [[ ${MDREV_KEEP:-} != 1 ]]; then
	rm -rf "$work/guest" "$work"/*/*.img "$work"/*/*.bin "$work/write.bin"
fi
echo "$key" >"$work/.complete"
rm -rf "$out"
mv "$work" "$out"
rig_log "md-reverse: done in $((SECONDS - start))s: $out"
cat "$out/summary.txt" >&2
