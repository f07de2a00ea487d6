#!/usr/bin/env bash
# md's Partial Parity Log between Linux md and ferroraid, both ways, across a crash.
#
#   tests/qemu/md-ppl.sh OUTDIR           run it (nothing to do if OUTDIR is current)
#   tests/qemu/md-ppl.sh --check OUTDIR   exit 0 if OUTDIR is current, 3 if not
#
# ferroraid -> md (fr2md): on the host, `ferroraid create --consistency-policy ppl` a RAID5,
# `serve` it, write a seeded pattern with nbdcopy, then small random writes into a crash
# window (md-ppl.py write, 4 connections) and SIGKILL the server under them: the members
# are left dirty with ferroraid's PPL records live (`ferroraid examine`: the newest record
# has entries). In the guest md assembles them and must recover from ferroraid's PPL
# (dmesg, ppl_load: mismatch_count 0, recovered_entries > 0), come up clean without a
# resync, and find mismatch_cnt 0 in a `check`; back here, what md read must be the pattern
# outside the window and, in it, each 4 KiB block the pattern or what was written there.
#
# md -> ferroraid (md2fr): in the same boot, after part 1, md creates a PPL RAID5, writes
# its pattern, and the guest crashes (sysrq b) under small random O_DIRECT writes into a
# crash window. Here `ferroraid examine` must find the members dirty and md's newest PPL
# record with entries; `ferroraid serve` must log PPL recovery with entries > 0 and "no
# resync needed", and read back the pattern outside the window (each window block the
# pattern or the rewrite); then, on a copy of the crashed members without member MD_LOST,
# `serve --run` (no --force) must recover and read back the pattern outside the window.
# The Rust test (tests/tests/md_ppl.rs) then has the oracle verify parity on every stripe
# of the recovered members and extract what ferroraid read back.
#
# FERRORAID=PATH is the binary under test (default: ${CARGO_TARGET_DIR:-target}/release/
# ferroraid). OUTDIR is current when OUTDIR/.complete holds the hash of the scripts, the
# binary and mdadm; it holds summary.txt and per direction what md and ferroraid printed;
# md2fr/ also keeps, for the oracle, the recovered members (d*.img), the degraded copy
# (degraded/) and what ferroraid read back from each (readback*.bin): about 400 MB.
# MDPPL_KEEP=1 keeps a failed run's work directory; MDPPL_TIMEOUT bounds the guest (600 s).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=tests/qemu/rig.sh
source "$HERE/rig.sh"
# shellcheck source=tests/qemu/md-host.sh
source "$HERE/md-host.sh"

MiB=$((1 << 20))
FR_MEMBERS=4 FR_MEMBER_BYTES=$((24 * MiB)) FR_SEED=8001 FR_NEW_SEED=8002
FR_OFF=$((8 * MiB)) FR_LEN=$((8 * MiB)) FR_ACKS=64
MD_MEMBERS=5 MD_MEMBER_BYTES=$((24 * MiB)) MD_CHUNK_KIB=64 MD_SEED=8003 MD_NEW_SEED=8004
MD_OFF=$((16 * MiB)) MD_LEN=$((8 * MiB)) MD_WRITERS=4 CRASH_AFTER=40 MD_LOST=1
FR6_MEMBERS=4 FR6_MEMBER_BYTES=$((16 * MiB)) FR6_SEED=8005
PARAMS="$FR_MEMBERS $FR_MEMBER_BYTES $FR_SEED $FR_NEW_SEED $FR_OFF $FR_LEN $FR_ACKS $MD_MEMBERS \
$MD_MEMBER_BYTES $MD_CHUNK_KIB $MD_SEED $MD_NEW_SEED $MD_OFF $MD_LEN $MD_WRITERS $CRASH_AFTER $MD_LOST \
$FR6_MEMBERS $FR6_MEMBER_BYTES $FR6_SEED"
FERRORAID=${FERRORAID:-${CARGO_TARGET_DIR:-$RIG_REPO/target}/release/ferroraid}

ppl_key() {
	{
		cat "$HERE/rig.sh" "$HERE/md-host.sh" "$HERE/md-ppl.sh" "$HERE/md-ppl.guest.sh" \
			"$HERE/md-lib.guest.sh" "$HERE/mdfix.py" "$HERE/md-ppl.py"
		sha256sum <"$FERRORAID"
		sha256sum <"$(command -v mdadm)"
		echo "$PARAMS"
	} | sha256sum | cut -c1-16
}

md_host_outdir md-ppl ppl_key "$@"
# The writer needs libnbd's Python binding: the first python3 that has it (a python3 ahead
# of the system's on PATH often has not).
NBD_PYTHON=
for p in python3 /usr/bin/python3; do
	if "$p" -c 'import nbd' 2>/dev/null; then
		NBD_PYTHON=$p
		break
	fi
done
[[ -n $NBD_PYTHON ]] || rig_die "no python3 with the nbd module (apt-get install python3-libnbd)"

start=$SECONDS
rig_kernel
md_host_workspace md-ppl
RIG_PID=
WRITER=
ppl_cleanup() {
	if [[ -n $WRITER ]] && kill -TERM "$WRITER" 2>/dev/null; then wait "$WRITER" 2>/dev/null || true; fi
	md_host_stop_all
	if [[ -n $RIG_PID ]] && kill -TERM "$RIG_PID" 2>/dev/null; then
		wait "$RIG_PID" 2>/dev/null || true
	fi
	rm -rf "$socks"
	if [[ ${MDPPL_KEEP:-} != 1 ]]; then
		rm -rf "$work"
	elif [[ -d $work ]]; then
		rig_log "kept $work"
	fi
}
trap ppl_cleanup EXIT
trap 'exit 130' INT TERM HUP

pattern() { python3 "$HERE/mdfix.py" pattern --name "$1" --seed "$2" --size "$3" --out "$4"; }
# region ARRAY DIR [--outside-only]: md-ppl.py region against DIR's patterns and window.
region() {
	local array=$1 dir=$2 off len
	shift 2
	read -r off len <"$dir/window"
	python3 "$HERE/md-ppl.py" region "$array" --base "$dir/pattern.bin" --new "$dir/new.bin" \
		--off "$off" --len "$len" "$@"
}
# newest_entries FILE: the most entries of any member's newest PPL record in `ferroraid
# examine` output FILE.
# Sparse member images DIR/d0.img.. (N of BYTES each) and `ferroraid create` of a PPL array
# of LEVEL named NAME over them (left-symmetric, 64 KiB chunk); prints the array's bytes.
fr_create() {
	local level=$1 name=$2 dir=$3 n=$4 bytes=$5 i size imgs=()
	for ((i = 0; i < n; i++)); do
		truncate -s "$bytes" "$dir/d$i.img"
		imgs+=("$dir/d$i.img")
	done
	"$FERRORAID" create --level "$level" --layout left-symmetric --chunk 64K --name "$name" \
		--consistency-policy ppl "${imgs[@]}" >"$dir/create.txt" 2>&1 ||
		rig_die "$name: ferroraid create failed: $(cat "$dir/create.txt")"
	size=$(sed -n 's/.*, \([0-9]*\) bytes, data offset .*/\1/p' "$dir/create.txt")
	[[ -n $size ]] || rig_die "$name: cannot read the array size from: $(cat "$dir/create.txt")"
	echo "$size"
}
newest_entries() {
	sed -n 's/^ *PPL Newest : generation [0-9]*, \([0-9]*\) entries.*/\1/p' "$1" | sort -n | tail -n1
}

rm -rf "$work"
mkdir -p "$work/fr2md" "$work/md2fr" "$work/fr6/ppl"

# --- ferroraid -> md: create, pattern, writes, kill -9 -------------------------------------
d=$work/fr2md
fr_size=$(fr_create 5 fr2md "$d" "$FR_MEMBERS" "$FR_MEMBER_BYTES")
fr_images=()
for ((i = 0; i < FR_MEMBERS; i++)); do fr_images+=("$d/d$i.img"); done
pattern fr2md "$FR_SEED" "$fr_size" "$d/pattern.bin"
pattern fr2md-window "$FR_NEW_SEED" "$FR_LEN" "$d/new.bin"
echo "$FR_OFF $FR_LEN" >"$d/window"
md_host_serve "$d/serve-write.log" "$socks/fr2md" "${fr_images[@]}"
uri="nbd+unix:///fr2md?socket=$socks/fr2md"
md_host_copy "$d/pattern.bin" "$uri"
: >"$d/acks.txt"
"$NBD_PYTHON" "$HERE/md-ppl.py" write "$uri" --off "$FR_OFF" --len "$FR_LEN" --new "$d/new.bin" \
	--acks "$d/acks.txt" --writers 4 --seed "$FR_SEED" 2>"$d/writer.err" &
WRITER=$!
for ((i = 0; i < 600; i++)); do
	(($(wc -l <"$d/acks.txt") >= FR_ACKS)) && break
	kill -0 "$WRITER" 2>/dev/null || rig_die "the writer stopped early: $(cat "$d/writer.err")"
	sleep 0.1
done
(($(wc -l <"$d/acks.txt") >= FR_ACKS)) || rig_die "the writer got no $FR_ACKS writes acknowledged in 60 s"
sleep "0.$((RANDOM % 300 + 100))"
md_host_kill9
rc=0
wait "$WRITER" || rc=$?
WRITER=
((rc != 0)) || rig_die "the writer was not cut off by the kill"
echo "$(wc -l <"$d/acks.txt") writes acknowledged before kill -9" >"$d/killed.txt"
"$FERRORAID" examine "${fr_images[@]}" >"$d/examine-crashed.txt" 2>&1 || true
mdadm --examine "${fr_images[@]}" >"$d/mdadm-examine-crashed.txt" 2>&1 || true
[[ $(grep -c '^ *State : active$' "$d/mdadm-examine-crashed.txt") == "$FR_MEMBERS" ]] ||
	rig_die "fr2md: the killed server left members that are not dirty: $(cat "$d/mdadm-examine-crashed.txt")"
fr_entries=$(newest_entries "$d/examine-crashed.txt")
((${fr_entries:-0} > 0)) || rig_die "fr2md: no member's newest PPL record has entries: $(cat "$d/examine-crashed.txt")"
rig_log "md-ppl: fr2md: ferroraid killed under writes ($(cat "$d/killed.txt"); newest record: $fr_entries entries) ($((SECONDS - start))s)"
disks=()
for ((i = 0; i < FR_MEMBERS; i++)); do disks+=(--disk "virtio:$d/d$i.img:fr2md-$i"); done

# --- ferroraid's RAID6 PPL: md must refuse it, and take it once switched to resync --------
d=$work/fr6
fr6_size=$(fr_create 6 fr6 "$d" "$FR6_MEMBERS" "$FR6_MEMBER_BYTES")
fr6_images=()
fr6_ppl=()
for ((i = 0; i < FR6_MEMBERS; i++)); do
	fr6_images+=("$d/d$i.img")
	fr6_ppl+=("$d/ppl/d$i.img")
done
pattern fr6 "$FR6_SEED" "$fr6_size" "$d/pattern.bin"
md_host_serve "$d/serve.log" "$socks/fr6" "${fr6_images[@]}"
md_host_copy "$d/pattern.bin" "nbd+unix:///fr6?socket=$socks/fr6"
md_host_stop "$d/serve.log"
for ((i = 0; i < FR6_MEMBERS; i++)); do cp --sparse=always "${fr6_images[i]}" "${fr6_ppl[i]}"; done
"$FERRORAID" grow --consistency-policy resync "${fr6_images[@]}" >"$d/grow.txt" 2>&1 ||
	rig_die "fr6: ferroraid grow --consistency-policy resync failed: $(cat "$d/grow.txt")"
for ((i = 0; i < FR6_MEMBERS; i++)); do
	disks+=(--disk "virtio:${fr6_ppl[i]}:fr6ppl-$i" --disk "virtio:${fr6_images[i]}:fr6rs-$i")
done
rig_log "md-ppl: fr6: ferroraid RAID6 PPL written and stopped, a copy switched to resync ($((SECONDS - start))s)"

# --- md -> ferroraid: the images md will create on ---------------------------------------
d=$work/md2fr
for ((i = 0; i < MD_MEMBERS; i++)); do
	truncate -s "$MD_MEMBER_BYTES" "$d/d$i.img"
	disks+=(--disk "virtio:$d/d$i.img:md2fr-$i")
done
# Larger than the array (md's data offset): trimmed to md's size afterwards.
pattern md2fr "$MD_SEED" $(((MD_MEMBERS - 1) * MD_MEMBER_BYTES)) "$d/pattern.bin"
pattern md2fr-window "$MD_NEW_SEED" "$MD_LEN" "$d/new.bin"
echo "$MD_OFF $MD_LEN" >"$d/window"
disks+=(--disk "virtio:$d/pattern.bin:p-md2fr:ro" --disk "virtio:$d/new.bin:n-md2fr:ro")

conf=$work/ppl.env
printf '%s\n' "FR_MEMBERS=$FR_MEMBERS" "FR6_MEMBERS=$FR6_MEMBERS" "MD_MEMBERS=$MD_MEMBERS" "MD_CHUNK_KIB=$MD_CHUNK_KIB" \
	"MD_OFF=$MD_OFF" "MD_LEN=$MD_LEN" "MD_WRITERS=$MD_WRITERS" "CRASH_AFTER=$CRASH_AFTER" >"$conf"
# A path that depends only on the content: the initramfs cache is keyed on paths too.
stable=$RIG_CACHE/md-ppl/ppl-$(sha256sum <"$conf" | cut -c1-16).env
mkdir -p "$(dirname "$stable")"
[[ -s $stable ]] || { cp "$conf" "$stable.$$" && mv "$stable.$$" "$stable"; }
initrd=$(rig_initramfs --init "$HERE/md-ppl.guest.sh" --modules md --bin "$(command -v mdadm)" \
	--file "$stable:/rig/ppl.env" --file "$HERE/md-lib.guest.sh:/rig/md-lib.sh")
guest_start=$SECONDS
# The whole of what md reads back in part 1 comes back on the out disk.
RIG_OUT_DISK_SIZE=256M md_host_guest "$work/console.log" "the md-ppl guest failed" \
	--initrd "$initrd" --timeout "${MDPPL_TIMEOUT:-600}" --append log_buf_len=16M \
	--out-disk "$work/out.img" --out-dir "$work/guest" "${disks[@]}"
guest_s=$((SECONDS - guest_start))
grep -q 'md-ppl .*crashing the guest (sysrq b)' "$work/console.log" ||
	rig_die "the md-ppl guest ended without crashing itself under writes; console log: $work/console.log"
rig_log "md-ppl: guest done in ${guest_s}s ($((SECONDS - start))s)"
cp "$work/guest/kernel.txt" "$work/guest/mdadm-version.txt" "$work/"

# --- ferroraid -> md: what md did --------------------------------------------------------
d=$work/fr2md
cp -r "$work/guest/fr2md/." "$d/"
region "$d/md-read.bin" "$d" >"$d/region.txt" ||
	rig_die "fr2md: what md read back after its PPL recovery: $(cat "$d/region.txt")"
mdadm --examine "${fr_images[@]}" >"$d/mdadm-examine-after.txt" 2>&1 || true
rm -f "$d"/*.img "$d"/*.bin

# --- ferroraid's RAID6 PPL: what md did ---------------------------------------------------
d=$work/fr6
cp -r "$work/guest/fr6/." "$d/"
truncate -s "$fr6_size" "$d/pattern.bin"
cmp -s "$d/md-read.bin" "$d/pattern.bin" ||
	rig_die "fr6: md's read-back of the array switched to resync differs from what ferroraid wrote"
rm -rf "$d"/*.img "$d"/*.bin "$d/ppl"

# --- md -> ferroraid: the crashed members ------------------------------------------------
d=$work/md2fr
cp -r "$work/guest/md2fr/." "$d/"
md_size=$(cat "$d/array_size")
truncate -s "$md_size" "$d/pattern.bin"
images=()
for ((i = 0; i < MD_MEMBERS; i++)); do images+=("$d/d$i.img"); done
"$FERRORAID" examine "${images[@]}" >"$d/examine-crashed.txt" 2>&1 ||
	rig_die "md2fr: ferroraid examine failed: $(cat "$d/examine-crashed.txt")"
mdadm --examine "${images[@]}" >"$d/mdadm-examine-crashed.txt" 2>&1 || true
[[ $(grep -c '^ *State : active$' "$d/mdadm-examine-crashed.txt") == "$MD_MEMBERS" ]] ||
	rig_die "md2fr: md's crashed members are not all dirty: $(cat "$d/mdadm-examine-crashed.txt")"
md_entries=$(newest_entries "$d/examine-crashed.txt")
((${md_entries:-0} > 0)) || rig_die "md2fr: no member's newest PPL record (md's) has entries: $(cat "$d/examine-crashed.txt")"
data_offset=$(sed -n 's/^ *Data Offset : \([0-9]*\) sectors$/\1/p' "$d/mdadm-examine-crashed.txt" | sort -u)
[[ $data_offset =~ ^[0-9]+$ ]] || rig_die "md2fr: no single data offset in: $(cat "$d/mdadm-examine-crashed.txt")"
printf 'level=5\nlayout=left-symmetric\nchunk=%s\ndata_offset=%s\nsize=%s\nmembers=%s\nlost=%s\n' \
	$((MD_CHUNK_KIB * 1024)) $((data_offset * 512)) "$md_size" "$MD_MEMBERS" "$MD_LOST" >"$d/geometry.txt"
mkdir -p "$d/degraded"
degraded=()
for ((i = 0; i < MD_MEMBERS; i++)); do
	((i == MD_LOST)) && continue
	cp --sparse=always "$d/d$i.img" "$d/degraded/d$i.img"
	degraded+=("$d/degraded/d$i.img")
done

# Every member: recovery, then the whole array read back.
md_host_serve "$d/serve.log" "$socks/md2fr" "${images[@]}"
grep 'PPL recovery after an unclean shutdown' "$d/serve.log" | grep -Eq 'entries=[1-9]' ||
	rig_die "md2fr: ferroraid logged no PPL recovery with entries: $(cat "$d/serve.log")"
grep -q 'no resync needed' "$d/serve.log" ||
	rig_die "md2fr: ferroraid's PPL recovery left a resync to do: $(cat "$d/serve.log")"
md_host_copy "nbd+unix:///md2fr?socket=$socks/md2fr" "$d/readback.bin"
md_host_stop "$d/serve.log"
region "$d/readback.bin" "$d" >"$d/region.txt" ||
	rig_die "md2fr: what ferroraid read back after recovering md's PPL: $(cat "$d/region.txt")"

# Member MD_LOST gone: --run, no --force.
md_host_serve "$d/serve-degraded.log" "$socks/md2fr" --run "${degraded[@]}"
grep -q 'PPL recovery after an unclean shutdown' "$d/serve-degraded.log" ||
	rig_die "md2fr: degraded: ferroraid logged no PPL recovery: $(cat "$d/serve-degraded.log")"
md_host_copy "nbd+unix:///md2fr?socket=$socks/md2fr" "$d/readback-degraded.bin"
md_host_stop "$d/serve-degraded.log"
region "$d/readback-degraded.bin" "$d" --outside-only >"$d/region-degraded.txt" ||
	rig_die "md2fr: member $MD_LOST lost: what ferroraid read back: $(cat "$d/region-degraded.txt")"

# --- summary -----------------------------------------------------------------------------
recovery() { grep -h 'PPL recovery after an unclean shutdown' "$1" | sed 's/.*PPL recovery after an unclean shutdown *//'; }
{
	echo "kernel: $(sed -n 's/^kernel_release=//p' "$work/kernel.txt"); mdadm: $(head -n1 "$work/mdadm-version.txt")"
	echo "ferroraid: $FERRORAID ($(sha256sum <"$FERRORAID" | cut -c1-16)); guest ${guest_s}s"
	d=$work/fr6
	echo "fr6: ferroraid RAID6 ppl $FR6_MEMBERS x $FR6_MEMBER_BYTES: md refused it ($(cat "$d/refused.txt"));" \
		"after grow --consistency-policy resync: md $(tr '\n' ' ' <"$d/state.txt")mismatch_cnt $(cat "$d/mismatch_cnt"), read back equal"
	d=$work/fr2md
	echo "fr2md: ferroraid RAID5 $FR_MEMBERS x $FR_MEMBER_BYTES, $fr_size bytes, $(cat "$d/killed.txt");" \
		"newest PPL record: $fr_entries entries; md: $(tr '\n' ' ' <"$d/state-assembled.txt")ppl_load return: $(cat "$d/ppl_load.txt");" \
		"mismatch_cnt $(cat "$d/mismatch_cnt"); md read back: $(cat "$d/region.txt")"
	d=$work/md2fr
	echo "md2fr: md RAID5 $MD_MEMBERS x $MD_MEMBER_BYTES, $md_size bytes, $(sed -n 's/.*md2fr: \([0-9]* writes done\).*/\1/p' "$work/console.log") at the crash;" \
		"newest PPL record: $md_entries entries; ferroraid: $(recovery "$d/serve.log"); no resync needed;" \
		"read back: $(cat "$d/region.txt")"
	echo "md2fr-degraded: member $MD_LOST lost, serve --run: $(recovery "$d/serve-degraded.log"); read back: $(cat "$d/region-degraded.txt")"
} >"$work/summary.txt"
rm -rf "$work/guest" "$work/md2fr/pattern.bin" "$work/md2fr/new.bin"
echo "$key" >"$work/.complete"
rm -rf "$out"
mv "$work" "$out"
rig_log "md-ppl: done in $((SECONDS - start))s: $out"
cat "$out/summary.txt" >&2
