#!/bin/sh
# PID 1 of the test VM's initramfs (busybox): run the pool selftest once per tier, then power off.
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev 2>/dev/null
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
echo "VM-BOOTED kernel=$(uname -r) page_size=$(getconf PAGESIZE 2>/dev/null)"
for t in 0 1 2 3; do
	insmod /pt_pack_selftest.ko uvm_pt_pack=$t threads=${SELFTEST_THREADS:-4} ops=${SELFTEST_OPS:-20000}
	echo "STATS-BEGIN tier=$t"; cat /sys/module/pt_pack_selftest/parameters/uvm_pt_pack_stats; echo "STATS-END"
	rmmod pt_pack_selftest
done
# an invalid tier is logged and leaves packing off; the module loads all the same (a typo must not take CUDA out)
echo "BADPARAM-BEGIN"
if insmod /pt_pack_selftest.ko uvm_pt_pack=7 threads=1 ops=1 2>/dev/null; then
	echo "BADPARAM loaded $(grep '^tier ' /sys/module/pt_pack_selftest/parameters/uvm_pt_pack_stats)"; rmmod pt_pack_selftest
else echo "BADPARAM refused"; fi
if [ -e /sys/kernel/debug/kmemleak ]; then
	echo scan > /sys/kernel/debug/kmemleak; sleep 6; echo scan > /sys/kernel/debug/kmemleak
	echo "KMEMLEAK-BEGIN"; cat /sys/kernel/debug/kmemleak; echo "KMEMLEAK-END"
fi
echo "VM-DONE"
poweroff -f
