#!/usr/bin/env bash
# The kernel's native NVMe multipath (ANA) across two portals of one ferroraid subsystem
# (issue 22, Build 2): fio verify runs through a portal going inaccessible, away and back.
#
#   tests/qemu/kernel-nvmf-mp.sh OUTDIR           run it (nothing to do if OUTDIR is current)
#   tests/qemu/kernel-nvmf-mp.sh --check OUTDIR   exit 0 if OUTDIR is current, 3 if not
#   tests/qemu/kernel-nvmf-mp.sh client           fetch nvme-cli (cached); print its tree
#
# kernel-nvmf.sh's rig (the same host side, nvme-cli package, stripped binary and cache
# rules, KNVMF_TIMEOUT and KNVMF_KEEP) with five 32 MiB virtio members (serials kmp-0..)
# and kernel-nvmf-mp.guest.sh in the guest, which documents the sequence: first against
# the kernel's nvmet-tcp (the reference, ports 127.0.0.1:4421 and 127.0.0.2:4421), then
# against `ferroraid serve --nvmf 127.0.0.1:4420 --nvmf 127.0.0.2:4420` driven with
# `ferroraid portal set-ana|remove|add`: both paths optimized; 127.0.0.2 inaccessible;
# removed (its controller reconnecting); added again (live, inaccessible); optimized.
# fio (crc32c verify) runs on the multipath head node throughout. The guest writes the
# summary lines (paths, ANA states from sysfs, `nvme list-subsys`, I/O and the kernel's
# lines at each step); OUTDIR/summary.txt has them after kernel-nvmf.sh's three header lines.
KNVMF_MULTIPATH=1 exec bash "$(dirname "${BASH_SOURCE[0]}")/kernel-nvmf.sh" "$@"
