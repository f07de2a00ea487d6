#!/usr/bin/env bash
# The kernel's own NBD client (Debian's nbd.ko, `nbd-client` from Debian) on ferroraid, both
# in one rig guest, over loopback: the README's `nbd-client` line, tested.
#
#   tests/qemu/kernel-nbd.sh OUTDIR           run it (nothing to do if OUTDIR is current)
#   tests/qemu/kernel-nbd.sh --check OUTDIR   exit 0 if OUTDIR is current, 3 if not
#   tests/qemu/kernel-nbd.sh client           fetch nbd-client (cached); print its tree
#
# In the guest (kernel-nbd.guest.sh): `ferroraid create` a RAID6 over six 32 MiB virtio
# members, `ferroraid serve --adaptive --nbd 127.0.0.1:10809`, `nbd-client 127.0.0.1 10809
# /dev/nbd0 -N knbd`, mkfs.ext4, mount; fio on files (3 jobs of 8 MiB, random 32 KiB O_DIRECT
# writes with crc32c verify headers, an fsync every 8 writes, verified after writing); a third
# of the way through `ferroraid fail` takes a member out; the files' sha256, umount,
# `nbd-client -d`, SIGTERM (exit 0). Then serve again on the five surviving members
# (degraded), connect again, `e2fsck -f -n` clean, mount, the sums and `fio --verify_only`
# agree (reads rebuilt from parity: `ferroraid status` counts them), umount, disconnect,
# SIGTERM (exit 0). Here, the guest's record goes to OUTDIR with summary.txt.
#
# nbd-client is not installed on the host: its Debian package (with libnl-3-200 and
# libnl-genl-3-200, which the host may lack) is fetched with `apt-get download`, unpacked with
# `dpkg-deb -x` under ${RIG_CACHE}/nbd-client/VERSION and put in the guest with `rig.sh
# initramfs --root`. fio, mkfs.ext4 and e2fsck are the host's (fio, e2fsprogs).
#
# FERRORAID=PATH is the binary under test (default: ${CARGO_TARGET_DIR:-target}/release/
# ferroraid); its debug information is stripped for the guest (a copy in the rig's cache).
# OUTDIR is current when OUTDIR/.complete holds the hash of the scripts, the binary, fio,
# e2fsprogs and nbd-client. KNBD_TIMEOUT bounds the guest (default 480 s); KNBD_KEEP=1 keeps
# a failed run's work directory.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=tests/qemu/rig.sh
source "$HERE/rig.sh"
# shellcheck source=tests/qemu/md-host.sh
source "$HERE/md-host.sh"

MEMBERS=6 MEMBER_MIB=32 LEVEL=6 CHUNK=64K NAME=knbd PORT=10809 FAIL_SLOT=2
JOBS=3 FILE_MIB=8 BS_KIB=32 FSYNC=8 SEED=9001
PARAMS="$MEMBERS $MEMBER_MIB $LEVEL $CHUNK $NAME $PORT $FAIL_SLOT $JOBS $FILE_MIB $BS_KIB $FSYNC $SEED"
FERRORAID=${FERRORAID:-${CARGO_TARGET_DIR:-$RIG_REPO/target}/release/ferroraid}

# Sets KNBD_CLIENT to the unpacked nbd-client tree (KNBD_CLIENT/sbin/nbd-client), fetching it
# on first use (md-host.sh, md_host_client_debs).
knbd_client() {
	md_host_client_debs nbd-client sbin/nbd-client libnl-3-200 libnl-genl-3-200
	KNBD_CLIENT=$MD_HOST_CLIENT
}

if [[ ${1:-} == client ]]; then
	knbd_client
	echo "$KNBD_CLIENT"
	exit 0
fi

knbd_key() {
	{
		cat "$HERE/rig.sh" "$HERE/md-host.sh" "$HERE/kernel-nbd.sh" "$HERE/kernel-nbd.guest.sh"
		sha256sum <"$FERRORAID"
		for b in "$(command -v fio)" "$(command -v mkfs.ext4)" "$(command -v e2fsck)"; do sha256sum <"$b"; done
		cat "$KNBD_CLIENT/PACKAGES"
		echo "$PARAMS"
	} | sha256sum | cut -c1-16
}
rig_need fio mkfs.ext4 e2fsck
knbd_client
MD_HOST_TOOLS="sha256sum" md_host_outdir kernel-nbd knbd_key "$@"

start=$SECONDS
rig_kernel
md_host_workspace kernel-nbd
RIG_PID=
trap 'md_host_client_cleanup "${KNBD_KEEP:-}"' EXIT
trap 'exit 130' INT TERM HUP
rm -rf "$work"
mkdir -p "$work"

md_host_stripped_ferroraid kernel-nbd
conf=$work/knbd.env
printf '%s\n' "MEMBERS=$MEMBERS" "LEVEL=$LEVEL" "CHUNK=$CHUNK" "NAME=$NAME" "PORT=$PORT" \
	"FAIL_SLOT=$FAIL_SLOT" "JOBS=$JOBS" "FILE_MIB=$FILE_MIB" "BS_KIB=$BS_KIB" "FSYNC=$FSYNC" "SEED=$SEED" >"$conf"
# A path that depends only on the content: the initramfs cache is keyed on paths too.
stable=$RIG_CACHE/kernel-nbd/knbd-$(sha256sum <"$conf" | cut -c1-16).env
[[ -s $stable ]] || { cp "$conf" "$stable.$$" && mv "$stable.$$" "$stable"; }
initrd=$(rig_initramfs --init "$HERE/kernel-nbd.guest.sh" --modules "nbd ext4" \
	--root "$FR_ROOT" --bin "$FR_ROOT/usr/bin/ferroraid" \
	--root "$KNBD_CLIENT" --bin "$KNBD_CLIENT/sbin/nbd-client" \
	--bin "$(command -v fio)" --bin "$(command -v mkfs.ext4)" --bin "$(command -v e2fsck)" \
	--file /etc/mke2fs.conf:/etc/mke2fs.conf --file "$stable:/rig/knbd.env")

disks=()
for ((i = 0; i < MEMBERS; i++)); do
	truncate -s "${MEMBER_MIB}M" "$work/d$i.img"
	disks+=(--disk "virtio:$work/d$i.img:knbd-$i")
done
guest_start=$SECONDS
md_host_guest "$work/console.log" "the kernel-nbd guest failed" \
	--initrd "$initrd" --timeout "${KNBD_TIMEOUT:-480}" --mem 1G --smp 2 \
	--out-disk "$work/out.img" --out-dir "$work/guest" "${disks[@]}"
guest_s=$((SECONDS - guest_start))
g=$work/guest
# What the guest said, to the summary; each line is what the Rust test checks.
fio_line() { grep -E "^ *$2:" "$1" | head -n1 | sed 's/^ *//'; }
# `ferroraid status`'s line of read counts ("reads: N direct, M degraded").
reads_line() { grep -o 'reads: [0-9]* direct, [0-9]* degraded' "$1"; }
{
	echo "kernel: $(sed -n 's/^kernel_release=//p' "$g/kernel.txt"); $(grep -o 'fio-[0-9.]*' "$g/versions.txt" | head -n1)"
	echo "nbd-client: $(tr '\n' ' ' <"$KNBD_CLIENT/PACKAGES")"
	echo "ferroraid: $FERRORAID ($FR_SUM); guest ${guest_s}s"
	echo "array: $(tail -n 1 "$g/create.txt")"
	echo "connect: $(grep -o 'nbd-client connected: .*' "$work/console.log" | head -n1 | tr -d '\r')"
	echo "mkfs: $(grep -o 'mkfs.ext4 and mount done: .*' "$work/console.log" | tr -d '\r')"
	read -r at_fail total <"$g/writes.txt"
	echo "fail: $(grep -o 'ferroraid fail .*' "$work/console.log" | head -n1 | tr -d '\r'); $(cat "$g/fail.txt")"
	echo "fio-write: $JOBS jobs x $FILE_MIB MiB, random ${BS_KIB} KiB O_DIRECT writes, fsync every $FSYNC, crc32c: exit 0; $(fio_line "$g/fio-write.txt" write); verify $(fio_line "$g/fio-write.txt" read); nbd0 writes $at_fail before the fail, $total in all"
	echo "stop-1: status exit 1 (degraded), $(reads_line "$g/status-1.txt"); serve exit 0; $(grep 'array stopped' "$g/serve-1.log" | tail -n1 | sed 's/.*array stopped/array stopped/')"
	echo "serve-2: $(grep -o 'degraded start: .*' "$g/serve-2.log" | head -n1)"
	echo "e2fsck: exit 0; $(tail -n 1 "$g/e2fsck.txt")"
	echo "remount: sha256 $(grep -c ': OK$' "$g/sums-check.txt")/$JOBS files OK; fio --verify_only exit 0, $(fio_line "$g/fio-verify.txt" read)"
	echo "stop-2: status exit 1 (degraded), $(reads_line "$g/status-2.txt"); serve exit 0; $(grep 'array stopped' "$g/serve-2.log" | tail -n1 | sed 's/.*array stopped/array stopped/')"
} >"$work/summary.txt"
cat "$work/summary.txt" >&2
mkdir -p "$work/result"
cp -r "$g/." "$work/result/"
cp "$work/summary.txt" "$work/console.log" "$work/result/"
echo "$key" >"$work/result/.complete"
rm -rf "$out"
mv "$work/result" "$out"
rig_log "kernel-nbd: ok in $((SECONDS - start))s (guest ${guest_s}s); results in $out"
