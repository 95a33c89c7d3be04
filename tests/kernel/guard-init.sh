#!/bin/sh
# PID 1 of the guard VM (busybox + Debian's real kmod): modprobe nvidia_uvm through the committed
# modprobe rule and uvm-guard, once with nvidia.ko matching ours and once not.
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /run /var/lib /tmp
K=$(uname -r)
echo "VM-BOOTED kernel=$K kmod=$(/usr/sbin/modprobe --version | head -1)"
for case in match mismatch; do
	cp /cases/$case/nvidia.ko /cases/$case/nvidia-uvm.ko /lib/modules/$K/kernel/drivers/video/
	/usr/sbin/depmod -a
	/usr/sbin/modprobe nvidia
	echo "CASE $case nvidia=$(cat /sys/module/nvidia/version)"
	/usr/sbin/modprobe nvidia_uvm; rc=$?
	v=$(cat /sys/module/nvidia_uvm/parameters/variant 2>/dev/null)
	echo "RESULT case=$case rc=$rc loaded=${v:-none} uvm_version=$(cat /sys/module/nvidia_uvm/version 2>/dev/null)"
	cat /run/spark-memsaver/guard.log 2>/dev/null | tail -2 | sed 's/^/GUARDLOG /'
	/usr/sbin/rmmod nvidia_uvm 2>/dev/null; /usr/sbin/rmmod nvidia
done
echo "VM-DONE"
poweroff -f
