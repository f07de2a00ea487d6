# Guest side of `rig.sh smoke-vfio`: the emulated NVMe controller behind QEMU's intel-iommu
# is unbound from the kernel's nvme driver and bound to vfio-pci, as ferroraid's vfio back
# end will need. Runs as /rig/test.sh (busybox sh -e, /rig/lib.sh sourced).
d=$(rig_dev_by_serial vfio-nvme)
n=${d#/dev/}
bdf=$(basename "$(readlink -f "/sys/block/$n/device/device")")
group=$(basename "$(readlink -f "/sys/bus/pci/devices/$bdf/iommu_group")")
echo "vfio-smoke: $d is NVMe controller $bdf in IOMMU group $group"
echo vfio-pci >"/sys/bus/pci/devices/$bdf/driver_override"
echo "$bdf" >"/sys/bus/pci/devices/$bdf/driver/unbind"
echo "$bdf" >/sys/bus/pci/drivers_probe
driver=$(basename "$(readlink -f "/sys/bus/pci/devices/$bdf/driver")")
echo "vfio-smoke: $bdf now bound to $driver"
[ "$driver" = vfio-pci ]
[ -c "/dev/vfio/$group" ]
echo "$bdf $group" >"$RIG_OUT/vfio"
