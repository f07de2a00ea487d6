#!/usr/bin/env bash
# ferroraid's QEMU test rig: a Debian kernel + a busybox initramfs, booted under TCG.
#
# Use it as a library (`source tests/qemu/rig.sh`, then the rig_* functions) or as a command:
#
#   tests/qemu/rig.sh kernel                      fetch + unpack the Debian kernel (cached)
#   tests/qemu/rig.sh initramfs [OPTIONS]         build an initramfs, print its path (cached)
#       --init FILE        the caller's guest script (runs as /rig/test.sh; required)
#       --modules "LIST"   kernel modules or sets (virtio nvme ahci md vfio nbd nvme-tcp ext4); deps resolved
#       --bin PATH         a host binary to copy in with its shared libraries (repeatable)
#       --root DIR         a tree unpacked from Debian packages (`dpkg-deb -x`; repeatable): a
#                          --bin inside it goes to its path in the tree, and its libraries
#                          are found (and go) there first
#       --file SRC:DST     a host file to copy to DST in the guest (repeatable)
#   tests/qemu/rig.sh run [OPTIONS] [-- QEMU ARGS...]   boot it, print the guest's verdict
#       --initrd FILE      from `initramfs` (required)
#       --log FILE         the guest console (default: a file beside the initrd)
#       --disk KIND:FILE[:SERIAL[:ro]]  KIND virtio | nvme | ahci (repeatable, in order)
#       --out-disk FILE    a scratch disk: what the guest leaves in /rig/out comes back ...
#       --out-dir DIR      ... unpacked here
#       --timeout SECS     whole-run limit (default 300); --mem 1G; --smp 1
#       --machine SPEC     default q35 (e.g. q35,kernel-irqchip=split for intel-iommu)
#       --append "ARGS"    extra kernel command line (e.g. intel_iommu=on)
#       --console          interactive: the serial console on this terminal, no log
#   tests/qemu/rig.sh smoke                       build and boot a trivial guest (virtio + NVMe)
#   tests/qemu/rig.sh smoke-vfio                  NVMe behind intel-iommu, bound to vfio-pci
#
# Exit status of `run`: 0 when the guest printed `RIG-RESULT: ok`; 1 when it printed
# `RIG-RESULT: fail ...`; 2 when it printed no verdict (crash, panic, hang); 124 on timeout.
# Everything is cached under ${CARGO_TARGET_DIR:-<repo>/target}/qemu-guest. See docs/TESTING.md.
set -euo pipefail

RIG_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RIG_REPO=$(cd "$RIG_DIR/../.." && pwd)
RIG_CACHE=${RIG_CACHE:-${CARGO_TARGET_DIR:-$RIG_REPO/target}/qemu-guest}
RIG_QEMU=${RIG_QEMU:-qemu-system-x86_64}
# A process whose death must take the guest down with it (the test that started us).
RIG_WATCH_PID=${RIG_WATCH_PID:-}

rig_log() { printf 'rig: %s\n' "$*" >&2; }
rig_die() {
	printf 'rig: error: %s\n' "$*" >&2
	exit 1
}

rig_need() {
	local c
	for c in "$@"; do
		command -v "$c" >/dev/null 2>&1 || rig_die "'$c' is not installed (needed by the QEMU rig; see docs/TESTING.md for the apt packages)"
	done
}

# Holds an exclusive lock on the cache while "$@" runs, so parallel tests share one build.
rig_locked() {
	mkdir -p "$RIG_CACHE"
	(
		flock -w 600 9 || rig_die "timed out waiting for the lock on $RIG_CACHE/.lock"
		"$@"
	) 9>"$RIG_CACHE/.lock"
}

# --- kernel ---------------------------------------------------------------------------------
# Sets RIG_KPKG (package), RIG_KVER (Debian version), RIG_KREL (uname -r), RIG_KDIR (the
# unpacked tree: boot/, lib/modules/RIG_KREL/ with a modules.dep made by busybox depmod) and
# RIG_VMLINUZ. The package is the one `linux-image-amd64` depends on (pinned: override with
# RIG_KERNEL_PKG=linux-image-X-amd64 [RIG_KERNEL_VERSION=deb-version]). Without apt (offline),
# the newest cached kernel is used.
rig_kernel() {
	local pkg=${RIG_KERNEL_PKG:-} ver=${RIG_KERNEL_VERSION:-}
	if [[ -z $pkg ]] && command -v apt-cache >/dev/null; then
		pkg=$(apt-cache depends linux-image-amd64 2>/dev/null |
			sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*-amd64\)$/\1/p' | head -n1 || true)
	fi
	if [[ -n $pkg && -z $ver ]] && command -v apt-cache >/dev/null; then
		ver=$(apt-cache policy "$pkg" 2>/dev/null | sed -n 's/^ *Candidate: \(.*\)$/\1/p' | head -n1 || true)
		[[ $ver == "(none)" ]] && ver=
	fi
	if [[ -z $pkg || -z $ver ]]; then
		local cached
		cached=$(printf '%s\n' "$RIG_CACHE"/kernel/*/.complete | sort -V | tail -n1)
		[[ -e $cached ]] || rig_die "cannot tell which kernel to use: apt-cache knows no linux-image-amd64 \
(run 'apt-get update' first) and nothing is cached in $RIG_CACHE/kernel"
		RIG_KDIR=$(dirname "$cached")
		rig_log "apt has no kernel package list; using the cached $(basename "$RIG_KDIR")"
	else
		RIG_KDIR=$RIG_CACHE/kernel/${pkg}_$ver
		[[ -e $RIG_KDIR/.complete ]] || rig_locked rig__fetch_kernel "$pkg" "$ver" "$RIG_KDIR"
	fi
	# shellcheck disable=SC1091
	source "$RIG_KDIR/VERSION"
	# shellcheck disable=SC2154 # package, version, release: set by VERSION
	RIG_KPKG=$package RIG_KVER=$version RIG_KREL=$release
	RIG_VMLINUZ=$RIG_KDIR/boot/vmlinuz-$RIG_KREL
	[[ -r $RIG_VMLINUZ ]] || rig_die "$RIG_VMLINUZ is missing: remove $RIG_KDIR and rerun"
}

rig__fetch_kernel() {
	local pkg=$1 ver=$2 dest=$3
	[[ -e $dest/.complete ]] && return 0 # another process finished it while we waited
	rig_need apt-get dpkg-deb busybox
	local tmp=$dest.tmp.$$
	rm -rf "$tmp" && mkdir -p "$tmp/tree"
	rig_log "downloading $pkg=$ver"
	local log
	if ! log=$(cd "$tmp" && apt-get download "$pkg=$ver" 2>&1); then
		rm -rf "$tmp"
		rig_die "apt-get download $pkg=$ver failed (stale package lists? try 'apt-get update'):
$log"
	fi
	local deb
	deb=$(ls "$tmp"/*.deb)
	rig_log "unpacking $(basename "$deb")"
	dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$tmp/tree" ./boot ./lib/modules ||
		rig_die "unpacking $deb failed"
	rm -f "$deb"
	local rel
	rel=$(ls "$tmp/tree/lib/modules")
	[[ $(wc -w <<<"$rel") == 1 ]] || rig_die "expected one module tree in $deb, found: $rel"
	# The .deb ships no modules.dep (its postinst runs depmod); busybox's depmod makes one.
	busybox depmod -b "$tmp/tree" "$rel" || rig_die "busybox depmod failed on $tmp/tree"
	printf 'package=%q\nversion=%q\nrelease=%q\n' "$pkg" "$ver" "$rel" >"$tmp/tree/VERSION"
	rm -rf "$dest"
	mv "$tmp/tree" "$dest"
	rmdir "$tmp"
	touch "$dest/.complete"
	rig_log "kernel $pkg $ver ($rel) cached in $dest"
}

# --- modules --------------------------------------------------------------------------------
# Named sets, so callers say what they need rather than the module graph.
rig_module_set() {
	case $1 in
	virtio) echo "virtio_pci virtio_blk" ;;
	nvme) echo "nvme" ;;
	ahci) echo "ahci sd_mod" ;;
	# libcrc32c (a raid456 dependency) only soft-depends on a crc32c provider: name one.
	md) echo "crc32c_generic raid456" ;;
	vfio) echo "vfio_pci vfio_iommu_type1" ;;
	# The kernel's NBD client (nbd-client talks to it over generic netlink or ioctls).
	nbd) echo "nbd" ;;
	# The kernel's NVMe/TCP host (pulls nvme-fabrics, nvme-core); its digests ask the crypto
	# API for crc32c: name a provider.
	nvme-tcp) echo "crc32c_generic nvme_tcp" ;;
	# ext4 asks the crypto API for crc32c (metadata_csum, mke2fs's default): name a provider.
	ext4) echo "crc32c_generic ext4" ;;
	*) echo "$1" ;;
	esac
}

# Prints the .ko paths (relative to lib/modules/REL) to load for the modules named in "$@",
# each after its dependencies, from modules.dep. Built-in modules are skipped.
rig_resolve_modules() {
	local mdir=$RIG_KDIR/lib/modules/$RIG_KREL
	local -A seen=()
	local -a order=()
	visit() {
		local name=${1//-/_} path line dep
		[[ -n ${seen[$name]:-} ]] && return 0
		seen[$name]=1
		if sed 's/-/_/g' "$mdir/modules.builtin" | grep -q "/$name\.ko$"; then
			return 0
		fi
		line=$(awk -v n="$name" -F: '{ p=$1; b=p; sub(/.*\//,"",b); sub(/\.ko.*$/,"",b); gsub(/-/,"_",b);
			if (b == n) { print; exit } }' "$mdir/modules.dep")
		[[ -n $line ]] || rig_die "kernel module '$1' is neither in $mdir/modules.dep nor built in"
		path=${line%%:*}
		for dep in ${line#*:}; do
			dep=${dep##*/}
			visit "${dep%%.ko*}"
		done
		order+=("$path")
	}
	local m s
	for m in "$@"; do
		for s in $(rig_module_set "$m"); do visit "$s"; done
	done
	printf '%s\n' "${order[@]}"
}

# --- initramfs ------------------------------------------------------------------------------
# The rig's own /init: mounts, loads modules, runs /rig/test.sh, reports, powers off.
rig__init_script() {
	cat <<'EOF'
#!/bin/sh
# Generated by tests/qemu/rig.sh: the rig's PID 1.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /run /tmp /rig/out
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
hostname ferroraid-rig
. /rig/lib.sh
rig_finish() {
	# Pack /rig/out onto the out disk, if the host gave one.
	out=$(rig_dev_by_serial rig-out 0 2>/dev/null) || out=
	if [ -n "$out" ]; then
		if ! (cd /rig/out && tar -cf "$out" .); then
			echo "rig: writing /rig/out to $out failed"
			verdict="fail (out disk)"
		fi
	fi
	sync
	echo "RIG-RESULT: $verdict"
	poweroff -f
	echo o >/proc/sysrq-trigger
	sleep 10
}
verdict=ok
echo "rig: kernel $(uname -r) up $(cut -d' ' -f1 /proc/uptime)s"
while read -r ko; do
	[ -n "$ko" ] || continue
	if ! err=$(insmod "/lib/modules/$(uname -r)/$ko" 2>&1); then
		case $err in
		*"File exists"*) ;;
		*) echo "rig: insmod $ko: $err"; verdict="fail (insmod $ko)"; rig_finish ;;
		esac
	fi
done </rig/modules.load
export RIG_OUT=/rig/out
sh -e -c '. /rig/lib.sh; . /rig/test.sh'
rc=$?
[ $rc -eq 0 ] || verdict="fail (test.sh exit $rc)"
rig_finish
EOF
}

rig__lib_script() {
	cat <<'EOF'
# Generated by tests/qemu/rig.sh: helpers for guest scripts (`. /rig/lib.sh`).

# rig_dev_by_serial SERIAL [TIMEOUT_S=10]: prints /dev/NAME of the disk (virtio-blk, NVMe
# namespace or SATA) whose serial is SERIAL, waiting for it to appear.
rig_dev_by_serial() {
	_want=$1 _t=${2:-10}
	while :; do
		for _b in /sys/block/*; do
			_n=${_b##*/} _s=
			if [ -r "$_b/serial" ]; then _s=$(cat "$_b/serial")
			elif [ -r "$_b/device/serial" ]; then _s=$(cat "$_b/device/serial")
			# SCSI/SATA: VPD page 0x80, the unit serial number after a 4-byte header.
			elif [ -r "$_b/device/vpd_pg80" ]; then _s=$(tail -c +5 "$_b/device/vpd_pg80" | tr -d '\000')
			fi
			_s=$(echo $_s)
			if [ "$_s" = "$_want" ]; then echo "/dev/$_n"; return 0; fi
		done
		[ "$_t" -gt 0 ] || break
		_t=$((_t - 1))
		sleep 1
	done
	echo "rig: no disk with serial '$_want'" >&2
	return 1
}

# rig_devs_by_serial PREFIX COUNT: prints the COUNT disks with serials PREFIX0, PREFIX1, ...
# (rig_dev_by_serial each), space-separated, in that order.
rig_devs_by_serial() {
	_i=0 _devs=
	while [ $_i -lt "$2" ]; do
		_devs="$_devs${_devs:+ }$(rig_dev_by_serial "$1$_i")" || return 1
		_i=$((_i + 1))
	done
	echo "$_devs"
}

# rig_section NAME CMD...: runs CMD and prints its output between markers on the console.
rig_section() {
	_name=$1; shift
	echo "RIG-BEGIN $_name"
	"$@" 2>&1
	_rc=$?
	echo "RIG-END $_name rc=$_rc"
	return $_rc
}
EOF
}

# Copies host file SRC to DST inside the staging dir, dereferencing links. A busybox applet
# link already at DST is replaced (cp would follow it to the host's busybox).
rig__stage() {
	local root=$1 src=$2 dst=$3
	mkdir -p "$root$(dirname "$dst")"
	rm -f "$root$dst"
	cp -L "$src" "$root$dst"
}

# The guest path of host file $1: inside a --root tree (rig_initramfs's `roots`), its path
# in that tree; else the same path.
rig__guest_path() {
	local r
	for r in "${roots[@]}"; do
		if [[ $1 == "$r"/* ]]; then
			echo "${1#"$r"}"
			return 0
		fi
	done
	echo "$1"
}

# Stages and packs the initramfs (a subshell, so the staging dir goes on any exit); uses
# rig_initramfs's variables.
rig__pack_initramfs() (
	local root
	root=$(mktemp -d "$RIG_CACHE/initramfs-root.XXXXXX")
	# shellcheck disable=SC2064
	trap "rm -rf '$root'" EXIT
	mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,run,tmp,etc,rig/out,lib/modules/"$RIG_KREL"}
	cp "$busybox" "$root/bin/busybox"
	local applet
	for applet in $("$busybox" --list-full); do
		[[ -e $root/$applet || -L $root/$applet ]] || ln -s /bin/busybox "$root/$applet"
	done
	local b lib libs dst r ldpath=""
	# Libraries in the --root trees come before the host's (as LD_LIBRARY_PATH for ldd).
	for r in "${roots[@]}"; do
		for lib in "$r"/lib/*-linux-gnu "$r"/usr/lib/*-linux-gnu; do
			[[ -d $lib ]] && ldpath+=${ldpath:+:}$lib
		done
	done
	for b in "${bins[@]}"; do
		[[ -x $b ]] || rig_die "initramfs: --bin '$b' is not an executable file"
		rig__stage "$root" "$b" "$(rig__guest_path "$b")"
		# Shared libraries and the loader, at the paths the binary asks for.
		libs=$(LD_LIBRARY_PATH=$ldpath ldd "$b" 2>&1 || true)
		if grep -q 'not found' <<<"$libs"; then
			rig_die "initramfs: --bin '$b' needs libraries found nowhere (install them, or unpack their packages into a --root):
$(grep 'not found' <<<"$libs")"
		fi
		for lib in $(awk '/=> \//{print $3} /^[ \t]*\//{print $1}' <<<"$libs"); do
			dst=$(rig__guest_path "$lib")
			[[ -e $root$dst ]] || rig__stage "$root" "$lib" "$dst"
		done
	done
	for f in "${files[@]}"; do
		[[ $f == *:* ]] || rig_die "initramfs: --file takes SRC:DST, got '$f'"
		[[ -r ${f%%:*} ]] || rig_die "initramfs: cannot read '${f%%:*}'"
		rig__stage "$root" "${f%%:*}" "${f#*:}"
	done
	local mdir=$RIG_KDIR/lib/modules/$RIG_KREL ko
	for ko in $kos; do
		mkdir -p "$root/lib/modules/$RIG_KREL/$(dirname "$ko")"
		cp "$mdir/$ko" "$root/lib/modules/$RIG_KREL/$ko"
	done
	# shellcheck disable=SC2086 # $kos: one path a word
	printf '%s\n' $kos >"$root/rig/modules.load"
	# A modules.dep for what is shipped, so `modprobe` works in the guest too.
	cp "$mdir/modules.builtin" "$root/lib/modules/$RIG_KREL/"
	for ko in $kos; do grep "^$ko:" "$mdir/modules.dep"; done >"$root/lib/modules/$RIG_KREL/modules.dep"
	rig__init_script >"$root/init"
	rig__lib_script >"$root/rig/lib.sh"
	cp "$init" "$root/rig/test.sh"
	chmod 755 "$root/init" "$root/rig/test.sh"
	printf 'kernel_package=%s\nkernel_version=%s\nkernel_release=%s\n' \
		"$RIG_KPKG" "$RIG_KVER" "$RIG_KREL" >"$root/rig/kernel"
	(cd "$root" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) |
		zstd -q -3 -T1 >"$out.tmp" || rig_die "packing the initramfs failed"
	mv "$out.tmp" "$out"
)

# Builds (or reuses) an initramfs; prints its path. See the header for the options.
rig_initramfs() {
	local init="" modules="virtio" out=""
	local -a bins=() files=() roots=()
	while (($#)); do
		case $1 in
		--init) init=$2; shift 2 ;;
		--modules) modules="virtio $2"; shift 2 ;;
		--bin) bins+=("$2"); shift 2 ;;
		--root)
			[[ -d $2 ]] || rig_die "initramfs: --root '$2' is not a directory"
			roots+=("$(cd "$2" && pwd)")
			shift 2
			;;
		--file) files+=("$2"); shift 2 ;;
		--out) out=$2; shift 2 ;;
		*) rig_die "initramfs: unknown option '$1'" ;;
		esac
	done
	[[ -n $init ]] || rig_die "initramfs: --init FILE is required"
	[[ -r $init ]] || rig_die "initramfs: cannot read the init script '$init'"
	rig_need cpio zstd sha256sum
	[[ -n ${RIG_KREL:-} ]] || rig_kernel
	local busybox
	busybox=${RIG_BUSYBOX:-$(command -v busybox || true)}
	[[ -n $busybox ]] || rig_die "busybox is not installed (apt-get install busybox-static)"
	file -L "$busybox" 2>/dev/null | grep -q 'statically linked' ||
		ldd "$busybox" 2>&1 | grep -q 'not a dynamic executable' ||
		rig_die "$busybox is dynamically linked; install busybox-static"

	local kos
	# shellcheck disable=SC2086 # $modules: one name a word
	kos=$(rig_resolve_modules $modules)
	# The cache key: everything that goes in.
	local key f
	key=$({
		echo "rig:$(sha256sum <"${BASH_SOURCE[0]}")"
		echo "kernel:$RIG_KPKG $RIG_KVER $RIG_KREL"
		echo "modules:$kos"
		echo "init:$(sha256sum <"$init")"
		echo "busybox:$(sha256sum <"$busybox")"
		for f in "${roots[@]}"; do echo "root:$f"; done
		for f in "${bins[@]}"; do echo "bin:$f $(sha256sum <"$f")"; done
		for f in "${files[@]}"; do echo "file:$f $(sha256sum <"${f%%:*}")"; done
	} | sha256sum | cut -c1-16)
	[[ -n $out ]] || out=$RIG_CACHE/initramfs/$key.cpio.zst
	if [[ -s $out && -s $out.key && $(cat "$out.key") == "$key" ]]; then
		echo "$out"
		return 0
	fi
	mkdir -p "$(dirname "$out")"
	rig__pack_initramfs
	echo "$key" >"$out.key"
	local names="" ko
	for ko in $kos; do names+=" ${ko##*/}"; done
	rig_log "initramfs $out ($(du -h "$out" | cut -f1), modules:$names)"
	echo "$out"
}

# --- run ------------------------------------------------------------------------------------
rig_run() (
	# A subshell: its traps and variables stay here.
	local initrd="" log="" timeout=300 mem=1G smp=1 machine=q35 append="" outdisk="" outdir=""
	local console=0 n=0 kind file serial ro spec
	local -a disks=() extra=() devargs=()
	while (($#)); do
		case $1 in
		--initrd) initrd=$2; shift 2 ;;
		--log) log=$2; shift 2 ;;
		--timeout) timeout=$2; shift 2 ;;
		--mem) mem=$2; shift 2 ;;
		--smp) smp=$2; shift 2 ;;
		--machine) machine=$2; shift 2 ;;
		--append) append="$append $2"; shift 2 ;;
		--disk) disks+=("$2"); shift 2 ;;
		--out-disk) outdisk=$2; shift 2 ;;
		--out-dir) outdir=$2; shift 2 ;;
		--console) console=1; shift ;;
		--) shift; extra=("$@"); break ;;
		*) rig_die "run: unknown option '$1'" ;;
		esac
	done
	[[ -r $initrd ]] || rig_die "run: --initrd '$initrd' is not readable (build it with 'rig.sh initramfs')"
	rig_need "$RIG_QEMU" timeout
	[[ -n ${RIG_KREL:-} ]] || rig_kernel
	[[ -n $log ]] || log=${initrd%.cpio.zst}.log
	[[ -z $outdisk || -n $outdir ]] || rig_die "run: --out-disk needs --out-dir"
	for spec in "${disks[@]}"; do
		IFS=: read -r kind file serial ro <<<"$spec"
		[[ -f $file ]] || rig_die "run: disk image '$file' does not exist"
		serial=${serial:-d$n}
		((${#serial} <= 20)) || rig_die "run: serial '$serial' is longer than 20 characters"
		local ropt=""
		[[ $ro == ro ]] && ropt=",readonly=on"
		devargs+=(-drive "file=$file,format=raw,if=none,id=d$n,cache=unsafe$ropt")
		case $kind in
		virtio) devargs+=(-device "virtio-blk-pci,drive=d$n,serial=$serial") ;;
		nvme) devargs+=(-device "nvme,drive=d$n,serial=$serial") ;;
		ahci)
			((n < 6)) || rig_die "run: q35's AHCI has 6 ports; ahci disks must come first"
			devargs+=(-device "ide-hd,drive=d$n,bus=ide.$n,serial=$serial")
			;;
		*) rig_die "run: unknown disk kind '$kind' in '$spec' (virtio, nvme or ahci)" ;;
		esac
		n=$((n + 1))
	done
	if [[ -n $outdisk ]]; then
		rm -f "$outdisk" && truncate -s "${RIG_OUT_DISK_SIZE:-64M}" "$outdisk"
		devargs+=(-drive "file=$outdisk,format=raw,if=none,id=rigout,cache=unsafe"
			-device "virtio-blk-pci,drive=rigout,serial=rig-out")
	fi
	# Extra arguments go before the disks: intel-iommu must precede the devices it translates.
	local -a cmd=("$RIG_QEMU" -machine "$machine" -accel tcg -m "$mem" -smp "$smp"
		-no-reboot -display none -vga none -nic none -monitor none
		-kernel "$RIG_VMLINUZ" -initrd "$initrd"
		-append "console=ttyS0 panic=-1 quiet$append"
		"${extra[@]}" "${devargs[@]}")
	if ((console)); then
		cmd+=(-serial mon:stdio)
		exec "${cmd[@]}"
	fi
	mkdir -p "$(dirname "$log")"
	: >"$log"
	cmd+=(-serial "file:$log")
	printf '%q ' "${cmd[@]}" >"$log.cmd"
	echo >>"$log.cmd"
	local start=$SECONDS qpid rc=0 w
	timeout -k 5 "$timeout" "${cmd[@]}" </dev/null >"$log.qemu" 2>&1 &
	qpid=$!
	# shellcheck disable=SC2064
	trap "kill -TERM $qpid 2>/dev/null; wait $qpid 2>/dev/null" EXIT
	trap 'exit 130' INT TERM HUP
	while kill -0 "$qpid" 2>/dev/null; do
		# The script that called us ($$ in this subshell) and RIG_WATCH_PID must live.
		for w in $$ $RIG_WATCH_PID; do
			if ! kill -0 "$w" 2>/dev/null; then
				rig_log "process $w is gone: stopping the guest"
				exit 130
			fi
		done
		sleep 1
	done
	wait "$qpid" || rc=$?
	trap - EXIT
	local took=$((SECONDS - start))
	if ((rc == 124 || rc == 137)); then
		rig_log "TIMEOUT: the guest ran past ${timeout}s; console log $log; last lines:"
		tail -n 30 "$log" >&2
		exit 124
	fi
	if ((rc != 0)); then
		rig_log "qemu exited with status $rc after ${took}s: $(tail -n 5 "$log.qemu")"
		tail -n 30 "$log" >&2
		exit 2
	fi
	if [[ -n $outdisk ]]; then
		rm -rf "$outdir" && mkdir -p "$outdir"
		tar -xf "$outdisk" -C "$outdir" 2>/dev/null || rig_log "the out disk holds no archive (did the guest finish?)"
		rm -f "$outdisk"
	fi
	local verdict
	verdict=$(tr -d '\r' <"$log" | sed -n 's/^RIG-RESULT: //p' | tail -n1)
	case $verdict in
	ok)
		rig_log "guest: ok (${took}s; console log $log)"
		exit 0
		;;
	"")
		rig_log "the guest printed no RIG-RESULT line (${took}s): kernel panic or crash? console log $log; last lines:"
		tail -n 30 "$log" >&2
		exit 2
		;;
	*)
		rig_log "guest: $verdict (${took}s); console log $log; last lines:"
		tail -n 30 "$log" >&2
		exit 1
		;;
	esac
)

# --- smoke ----------------------------------------------------------------------------------
rig_smoke() {
	rig_kernel
	local dir=$RIG_CACHE/smoke
	mkdir -p "$dir"
	cat >"$dir/test.sh" <<'EOF'
echo "smoke: $(uname -r), $(grep -c ^processor /proc/cpuinfo) cpu"
for s in sm-ahci sm-virtio sm-nvme; do
	d=$(rig_dev_by_serial $s)
	echo "smoke: $s is $d, $(cat /sys/block/${d#/dev/}/size) sectors"
done
echo hello >"$RIG_OUT/hello"
EOF
	truncate -s 1M "$dir/ahci.img" "$dir/virtio.img" "$dir/nvme.img"
	local initrd
	initrd=$(rig_initramfs --init "$dir/test.sh" --modules "nvme ahci")
	rig_run --initrd "$initrd" --log "$dir/console.log" --timeout 120 \
		--disk "ahci:$dir/ahci.img:sm-ahci" --disk "virtio:$dir/virtio.img:sm-virtio" \
		--disk "nvme:$dir/nvme.img:sm-nvme" --out-disk "$dir/out.img" --out-dir "$dir/out"
	[[ $(cat "$dir/out/hello") == hello ]] || rig_die "smoke: the out disk did not bring back /rig/out/hello"
	rig_log "smoke: ok ($RIG_KPKG $RIG_KVER)"
}

# An NVMe controller behind QEMU's emulated intel-iommu, bound to vfio-pci in the guest.
rig_smoke_vfio() {
	rig_kernel
	local dir=$RIG_CACHE/smoke-vfio
	mkdir -p "$dir"
	truncate -s 16M "$dir/nvme.img"
	local initrd
	initrd=$(rig_initramfs --init "$RIG_DIR/vfio-smoke.guest.sh" --modules "nvme vfio")
	rig_run --initrd "$initrd" --log "$dir/console.log" --timeout 120 \
		--machine q35,kernel-irqchip=split --append intel_iommu=on \
		--disk "nvme:$dir/nvme.img:vfio-nvme" --out-disk "$dir/out.img" --out-dir "$dir/out" \
		-- -device intel-iommu,caching-mode=on
	rig_log "smoke-vfio: ok (controller and IOMMU group: $(cat "$dir/out/vfio"))"
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
	rig_command=${1:-}
	shift || true
	case $rig_command in
	kernel)
		rig_kernel
		printf 'package=%s\nversion=%s\nrelease=%s\nvmlinuz=%s\n' "$RIG_KPKG" "$RIG_KVER" "$RIG_KREL" "$RIG_VMLINUZ"
		;;
	initramfs) rig_initramfs "$@" ;;
	run) rig_run "$@" ;;
	smoke) rig_smoke ;;
	smoke-vfio) rig_smoke_vfio ;;
	*) rig_die "usage: $0 kernel | initramfs --init FILE [...] | run --initrd FILE [...] | smoke | smoke-vfio (see the header)" ;;
	esac
fi
