#!/usr/bin/env bash
# The kernel's own NVMe/TCP host (Debian's nvme-tcp.ko, `nvme` from Debian's nvme-cli) on
# ferroraid's NVMe/TCP target (`serve --nvmf`), both in one rig guest, over loopback: the
# docs/NVMF.md `nvme discover`/`nvme connect` lines, tested (issue 22).
#
#   tests/qemu/kernel-nvmf.sh OUTDIR           run it (nothing to do if OUTDIR is current)
#   tests/qemu/kernel-nvmf.sh --check OUTDIR   exit 0 if OUTDIR is current, 3 if not
#   tests/qemu/kernel-nvmf.sh client           fetch nvme-cli (cached); print its tree
#
# In the guest (kernel-nvmf.guest.sh): `modprobe nvme-tcp`; `ferroraid create` a RAID6 over
# six 32 MiB virtio members, `ferroraid serve --adaptive --nvmf 127.0.0.1:4420`; `nvme
# discover -t tcp -a 127.0.0.1 -s 4420` lists the subsystem; `nvme connect ... -n NQN -k 30`
# gives /dev/nvmeXnY; `nvme id-ctrl`/`id-ns` show subnqn, mdts, nn, sgls, nsze = ncap = the
# device's size; fio on the block device (libaio, O_DIRECT, 2 jobs at QD 8 on disjoint
# regions, random writes of 4..256 KiB — in-capsule, R2T and split by MDTS — with crc32c
# verify headers, verified after writing) with `ferroraid fail` taking a member out a third
# of the way through; mkfs.ext4, mount, files, sha256, umount, `e2fsck -f -n` clean, mount
# again and the sums agree; `nvme disconnect -n NQN` with no kernel complaint so far (the
# shutdown by CC.SHN included); `nvme connect -g -G` (header and data digests), the sums,
# fio on files; the target stopped (SIGTERM, exit 0, array clean) and served again on the
# survivors under the connected host, whose reconnect loop brings the controller back:
# `e2fsck -f -n`, the sums and fio --verify_only agree, reads rebuilt from parity;
# disconnect, SIGTERM (exit 0). Then the reference: the same commands (discover, connect,
# id-ctrl, fio, mkfs/e2fsck, -g -G, disconnect) against the kernel's nvmet-tcp exporting a
# loop device on the same portal, with no kernel complaint either. Here, the guest's record goes to OUTDIR with summary.txt.
#
# nvme-cli is not installed on the host: its Debian package (with libnvme1 and libdbus-1-3,
# which the host may lack) is fetched with `apt-get download`, unpacked with `dpkg-deb -x`
# under ${RIG_CACHE}/nvme-cli/VERSION and put in the guest with `rig.sh initramfs --root`.
# fio, mkfs.ext4 and e2fsck are the host's (fio, e2fsprogs).
#
# FERRORAID=PATH is the binary under test (default: ${CARGO_TARGET_DIR:-target}/release/
# ferroraid); its debug information is stripped for the guest (a copy in the rig's cache).
# OUTDIR is current when OUTDIR/.complete holds the hash of the scripts, the binary, fio,
# e2fsprogs and nvme-cli. KNVMF_TIMEOUT bounds the guest (default 600 s); KNVMF_KEEP=1 keeps
# a failed run's work directory.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=tests/qemu/rig.sh
source "$HERE/rig.sh"
# shellcheck source=tests/qemu/md-host.sh
source "$HERE/md-host.sh"

# KNVMF_MULTIPATH=1 (kernel-nvmf-mp.sh): the multipath test, kernel-nvmf-mp.guest.sh, instead.
if [[ ${KNVMF_MULTIPATH:-} == 1 ]]; then
	TEST=kernel-nvmf-mp SERIAL=kmp
	MEMBERS=5 MEMBER_MIB=32 LEVEL=6 CHUNK=64K NAME=kmp PORT=4420
	JOBS=2 QD=8 JOB_MIB=8 SEED=2057
	VARS="MEMBERS LEVEL CHUNK NAME PORT JOBS QD JOB_MIB SEED"
else
	TEST=kernel-nvmf SERIAL=knvmf
	MEMBERS=6 MEMBER_MIB=32 LEVEL=6 CHUNK=64K NAME=knvmf PORT=4420 FAIL_SLOT=2
	JOBS=2 QD=8 JOB_MIB=24 FILES=4 FILE_MIB=4 SEED=2022
	VARS="MEMBERS LEVEL CHUNK NAME PORT FAIL_SLOT JOBS QD JOB_MIB FILES FILE_MIB SEED"
fi
PARAMS="$MEMBER_MIB $(for v in $VARS; do printf '%s=%s ' "$v" "${!v}"; done)"
FERRORAID=${FERRORAID:-${CARGO_TARGET_DIR:-$RIG_REPO/target}/release/ferroraid}

# Sets KNVMF_CLIENT to the unpacked nvme-cli tree (KNVMF_CLIENT/usr/sbin/nvme), fetching it
# on first use (md-host.sh, md_host_client_debs).
knvmf_client() {
	md_host_client_debs nvme-cli usr/sbin/nvme libnvme1 libdbus-1-3
	KNVMF_CLIENT=$MD_HOST_CLIENT
}

if [[ ${1:-} == client ]]; then
	knvmf_client
	echo "$KNVMF_CLIENT"
	exit 0
fi

knvmf_key() {
	{
		cat "$HERE/rig.sh" "$HERE/md-host.sh" "$HERE/kernel-nvmf.sh" "$HERE/$TEST.guest.sh" "$HERE/nvmf-lib.guest.sh"
		sha256sum <"$FERRORAID"
		for b in "$(command -v fio)" "$(command -v mkfs.ext4)" "$(command -v e2fsck)"; do sha256sum <"$b"; done
		cat "$KNVMF_CLIENT/PACKAGES"
		echo "$PARAMS"
	} | sha256sum | cut -c1-16
}
rig_need fio mkfs.ext4 e2fsck
knvmf_client
MD_HOST_TOOLS="sha256sum" md_host_outdir "$TEST" knvmf_key "$@"

start=$SECONDS
rig_kernel
md_host_workspace "$TEST"
RIG_PID=
trap 'md_host_client_cleanup "${KNVMF_KEEP:-}"' EXIT
trap 'exit 130' INT TERM HUP
rm -rf "$work"
mkdir -p "$work"

md_host_stripped_ferroraid kernel-nvmf
conf=$work/knvmf.env
for v in $VARS; do printf '%s=%s\n' "$v" "${!v}"; done >"$conf"
# A path that depends only on the content: the initramfs cache is keyed on paths too.
stable=$RIG_CACHE/kernel-nvmf/knvmf-$(sha256sum <"$conf" | cut -c1-16).env
[[ -s $stable ]] || { cp "$conf" "$stable.$$" && mv "$stable.$$" "$stable"; }
initrd=$(rig_initramfs --init "$HERE/$TEST.guest.sh" --modules "nvme-tcp nvmet-tcp loop ext4" \
	--root "$FR_ROOT" --bin "$FR_ROOT/usr/bin/ferroraid" \
	--root "$KNVMF_CLIENT" --bin "$KNVMF_CLIENT/usr/sbin/nvme" \
	--bin "$(command -v fio)" --bin "$(command -v mkfs.ext4)" --bin "$(command -v e2fsck)" \
	--file /etc/mke2fs.conf:/etc/mke2fs.conf --file "$stable:/rig/knvmf.env" \
	--file "$HERE/nvmf-lib.guest.sh:/rig/nvmf-lib.sh")

disks=()
for ((i = 0; i < MEMBERS; i++)); do
	truncate -s "${MEMBER_MIB}M" "$work/d$i.img"
	disks+=(--disk "virtio:$work/d$i.img:$SERIAL-$i")
done
guest_start=$SECONDS
md_host_guest "$work/console.log" "the $TEST guest failed" \
	--initrd "$initrd" --timeout "${KNVMF_TIMEOUT:-600}" --mem 1G --smp 2 \
	--out-disk "$work/out.img" --out-dir "$work/guest" "${disks[@]}"
guest_s=$((SECONDS - guest_start))
g=$work/guest
# What the guest said, to the summary; each line is what the Rust test checks.
summary_head() {
	echo "kernel: $(sed -n 's/^kernel_release=//p' "$g/kernel.txt"); $(grep -o 'fio-[0-9.]*' "$g/versions.txt" | head -n1)"
	echo "nvme-cli: $(tr '\n' ' ' <"$KNVMF_CLIENT/PACKAGES")"
	echo "ferroraid: $FERRORAID ($FR_SUM); guest ${guest_s}s"
}
fio_line() { grep -E "^ *$2:" "$1" | head -n1 | sed 's/^ *//'; }
# said PREFIX: the rest of the guest's first console line holding PREFIX.
said() { grep -o "$1.*" "$work/console.log" | head -n1 | tr -d '\r' | sed "s|^$1||"; }
knvmf_summary() {
	summary_head
	echo "array: $(tail -n 1 "$g/create.txt")"
	echo "modprobe: $(said 'nvme-tcp loaded: ')"
	echo "discover: $(said 'discovered: ')"
	echo "connect: $(said 'connected: ')"
	echo "id-ctrl: $(cat "$g/id-ctrl.fields")"
	echo "id-ns: $(cat "$g/id-ns.fields")"
	echo "fail: $(said 'ferroraid fail '); $(cat "$g/fail.txt")"
	read -r at_fail total <"$g/writes.txt"
	echo "fio: $JOBS jobs x $JOB_MIB MiB, libaio QD $QD, O_DIRECT random 4-256 KiB writes, crc32c: exit 0; $(fio_line "$g/fio.txt" write); verify $(fio_line "$g/fio.txt" read); writes $at_fail before the fail, $total in all"
	echo "mkfs: $(said 'mkfs.ext4 and mount done: ')"
	echo "e2fsck: exit 0; $(tail -n 1 "$g/e2fsck.txt")"
	echo "remount: sha256 $(grep -c ': OK$' "$g/sums-check.txt")/$FILES files OK"
	echo "disconnect: $(said 'nvme disconnect: ')"
	echo "kernel-log: $(said 'kernel log: ')"
	echo "digests: $(said 'digests: '); $(fio_line "$g/fio-digests.txt" write)"
	echo "stop-1: status exit 1 (degraded); serve exit 0; $(grep 'array stopped' "$g/serve-1.log" | tail -n1 | sed 's/.*array stopped/array stopped/')"
	echo "restart: $(said 'restart: '); serve-2 $(grep -o 'degraded start: .*' "$g/serve-2.log" | head -n1)"
	echo "after-restart: $(said 'after the restart: ')"
	echo "stop-2: status exit 1 (degraded), $(grep -o 'reads: [0-9]* direct, [0-9]* degraded' "$g/status-2.txt"); serve exit 0; $(grep 'array stopped' "$g/serve-2.log" | tail -n1 | sed 's/.*array stopped/array stopped/')"
	echo "restart-log: $(said 'kernel log of the restart: ')"
	echo "nvmet: $(said 'nvmet reference: ')"
	echo "nvmet-id-ctrl: $(said 'nvmet id-ctrl: ')"
}
if [[ $TEST == kernel-nvmf-mp ]]; then
	# The multipath guest writes its summary lines itself.
	{ summary_head && cat "$g/summary-guest.txt"; } >"$work/summary.txt"
else
	knvmf_summary >"$work/summary.txt"
fi
cat "$work/summary.txt" >&2
mkdir -p "$work/result"
cp -r "$g/." "$work/result/"
cp "$work/summary.txt" "$work/console.log" "$work/result/"
echo "$key" >"$work/result/.complete"
rm -rf "$out"
mv "$work/result" "$out"
rig_log "$TEST: ok in $((SECONDS - start))s (guest ${guest_s}s); results in $out"
