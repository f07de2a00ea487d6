#!/usr/bin/env bash
# The NVMe guest test, one command: ferroraid's direct NVMe back ends against real NVMe
# controller models in a QEMU guest under TCG (this host has no NVMe hardware, and its KVM
# cannot boot stock guests).
#
#   tests/guest/run.sh            install what is missing, build, boot, check; exit 0 = pass
#
# 1. Installs the Debian packages it needs when missing (qemu-system-x86, busybox-static,
#    cpio, zstd, python3; root and apt needed for that) and builds the guest checker
#    (`guest_check`, tests/src/bin/guest_check.rs) in release mode.
# 2. Boots the rig's guest (tests/qemu/rig.sh: Debian's linux-image-amd64 kernel, busybox,
#    an initramfs with the checker and the nvme, ahci, vfio-pci and vfio_iommu_type1
#    modules) on q35 with an emulated intel-iommu (caching-mode=on, guest intel_iommu=on),
#    eight emulated NVMe controllers (serials nv0..nv7) and two AHCI disks (sata0, sata1);
#    nv6, sata1 and nv7 are spares.
# 3. The guest (tests/guest/guest.sh) reloads nvme with poll_queues=1 (real polled queues
#    for IOPOLL: facts and superblock I/O), then without them for the load (the 6.1
#    kernel can oops in bio_poll under polled passthrough load), checks device facts (the SATA disk's queue depth
#    from sysfs, QD=1 handling), superblock I/O through each back end, then runs the model
#    test (guest_check model: random concurrent reads/writes verified against a reference,
#    an in-guest parity check of every stripe, a member failure, a verified degraded phase,
#    a rebuild onto a spare of the failed member's kind (nv6, or sata1 for the SATA member)
#    with the verified random requests going on, the parity check again)
#    on RAID5 and RAID6 arrays over (a) NVMe passthrough /dev/ngXnY, (c) passthrough beside
#    the AHCI disk, (b) four controllers bound to vfio-pci with ferroraid's user-space
#    driver — there the member failure is the controller disabled under I/O, which the
#    driver must survive (reset, lost commands failed, never hung) — then a command-timeout
#    drill (abort, reset, queue pair usable again) and the clean return of the controllers
#    to the kernel's nvme driver.
#    The kernel gets `no_timer_check`: under TCG on a loaded host the IO-APIC timer check
#    behind intel-iommu's interrupt remapping can miss its window and panic the boot
#    ("timer doesn't work through Interrupt-remapped IO-APIC").
#    The ferroraid binary then runs `create` and `examine` on /dev/ngXnY members, and
#    `serve` on a mix of /dev/ngXnY and vfio:BDF members (started; a member failed and
#    removed and the spare nv7 added by PCI address over JSON-RPC, rebuilt by the running
#    target until `status` says healthy; stopped with SIGTERM; superblocks examined clean,
#    the spare active in the removed member's role).
# 4. Back on the host, for every array, over the backing files of its final members (the
#    rebuilt spare in the failed member's slot), raidref.py (../shared/oracle) `verify`
#    must accept P (and Q) of every stripe and `extract` the logical image, which must
#    equal the guest's reference image (sha256).
#
# Functional only: TCG timings mean nothing and are never reported as performance.
# Environment: GUEST_OPS (requests per phase, default 600), GUEST_TIMEOUT (s, default 900),
# GUEST_KEEP=1 keeps the work directory, GUEST_ONLY=vfio runs only the vfio part. Exit status: 0 pass; 1 a check failed; 2 the
# guest crashed or printed no verdict; 124 timeout.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
start=$SECONDS

# --- packages -------------------------------------------------------------------------------
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
for pkg in qemu-system-x86 busybox-static cpio zstd python3; do
	installed "$pkg" || missing+=("$pkg")
done
if ((${#missing[@]})); then
	if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
		echo "guest: missing Debian packages ${missing[*]} (install them as root)" >&2
		exit 1
	fi
	echo "guest: installing ${missing[*]}"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# The rig asks apt which kernel to fetch; without package lists it uses its cache.
if ! apt-cache policy linux-image-amd64 2>/dev/null | grep -q 'Candidate: [0-9]'; then
	apt-get update -qq 2>/dev/null || true
fi

# shellcheck source=tests/qemu/rig.sh
source "$REPO/tests/qemu/rig.sh"
ORACLE=${FERRORAID_ORACLE:-$REPO/../shared/oracle/raidref.py}
[[ -r $ORACLE ]] || rig_die "the oracle raidref.py is not at $ORACLE (set FERRORAID_ORACLE)"

# --- build ----------------------------------------------------------------------------------
echo "guest: building guest_check (release)"
cargo build --release --quiet -p ferroraid-tests --bin guest_check
BIN=$CARGO_TARGET_DIR/release/guest_check
# The ferroraid binary itself, in the profile `cargo test` builds it (`test`: opt-level 2,
# debug assertions on; tests/src/lib.rs ferroraid_bin): after `cargo test` only the binary
# links, where the dev profile would compile every dependency again at opt-level 0.
echo "guest: building ferroraid"
cargo build --quiet --profile test -p ferroraid --bin ferroraid
FR=$CARGO_TARGET_DIR/debug/ferroraid

rig_kernel
work=$(mktemp -d "$RIG_CACHE/guest.XXXXXX")
cleanup() { [[ ${GUEST_KEEP:-0} == 1 ]] || rm -rf "$work"; }
trap cleanup EXIT

# Eight NVMe namespaces and two SATA disks, 32 MiB each (sparse); six 4 MiB regions are
# used by the model arrays (nv7: the whole data area, by the target's rebuild).
for d in nv0 nv1 nv2 nv3 nv4 nv5 nv6 nv7 sata0 sata1; do truncate -s 32M "$work/$d.img"; done
initrd=$(rig_initramfs --init "$HERE/guest.sh" --modules "nvme ahci vfio" \
	--bin "$BIN" --file "$BIN:/usr/bin/guest_check" --bin "$FR" --file "$FR:/usr/bin/ferroraid" \
	--out "$work/initrd.cpio.zst")
disks=(--disk "ahci:$work/sata0.img:sata0" --disk "ahci:$work/sata1.img:sata1")
for i in 0 1 2 3 4 5 6 7; do disks+=(--disk "nvme:$work/nv$i.img:nv$i"); done
rc=0
rig_run --initrd "$initrd" --log "$work/console.log" --timeout "${GUEST_TIMEOUT:-900}" \
	--mem 1G --machine q35,kernel-irqchip=split --append "intel_iommu=on no_timer_check${GUEST_ONLY:+ guest_only=$GUEST_ONLY}" \
	"${disks[@]}" --out-disk "$work/out.img" --out-dir "$work/out" \
	-- -device intel-iommu,caching-mode=on || rc=$?
grep -E '^(guest|model|facts|timeout-drill|superblock|guest_check|created|ferroraid):' "$work/console.log" | tr -d '\r' || true
if ((rc != 0)); then
	GUEST_KEEP=1
	echo "guest: FAILED (rig status $rc); work directory kept: $work" >&2
	exit "$rc"
fi

# --- host-side check with the independent oracle --------------------------------------------
[[ -s $work/out/arrays.txt ]] || rig_die "the guest reported no arrays"
checked=0
while read -r name level layout chunk off stripes missing serials; do
	members=()
	i=0
	for s in $serials; do
		if ((i == missing)); then members+=(missing); else members+=("$work/$s.img"); fi
		i=$((i + 1))
	done
	geo=(--level "$level" --layout "$layout" --chunk "$chunk" --data-offset "$off" --stripes "$stripes")
	if ((missing < 0)); then
		if ! python3 "$ORACLE" verify "${members[@]}" "${geo[@]}"; then
			GUEST_KEEP=1
			echo "guest: FAILED: raidref.py verify rejects the parity of $name's members ($serials)" >&2
			exit 1
		fi
		echo "guest: $name: raidref.py verify accepts P$( ((level == 6)) && echo /Q) of every stripe on $serials"
	fi
	python3 "$ORACLE" extract "${members[@]}" "${geo[@]}" --out "$work/$name.logical"
	got=$(sha256sum "$work/$name.logical" | cut -d' ' -f1)
	want=$(cat "$work/out/$name.sha256")
	if [[ $got != "$want" ]]; then
		GUEST_KEEP=1
		echo "guest: FAILED: raidref's extraction of $name differs from the guest's reference" >&2
		exit 1
	fi
	echo "guest: $name: raidref.py extraction of the member images ($serials) equals the guest's model"
	checked=$((checked + 1))
done <"$work/out/arrays.txt"
[[ -n ${GUEST_ONLY:-} ]] || ((checked == 6)) || rig_die "expected 6 arrays, the guest reported $checked"
echo "guest: NVMe guest test passed: $checked arrays, $((SECONDS - start)) s wall (functional only)"
