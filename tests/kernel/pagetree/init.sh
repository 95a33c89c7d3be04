#!/bin/sh
# PID 1 of the page-tree VM (tests/test_kernel_pagetree.py, busybox): the stand-in nvidia.ko, then the
# patched nvidia-uvm.ko once per tier with uvm_enable_builtin_tests=1, NVIDIA's UVM_TEST_PAGE_TREE through
# /pt_run, NVIDIA's GPU-free built-in tests (tiers in GF_TIERS, default all), the pool's counters after each
# load; then kmemleak scans where the kernel has kmemleak, and power off.
# Kernel command line (passed on to init): PT_TIERS="2" (tiers to run; "2,3" for several), GF_TIERS="" (none),
# RACE_THREADS=8 [RACE_ITERS=n RACE_SECS=s]: the race variant's parameters (tests/kernel/pagetree/pt_race.c:
# UVM_TEST_PAGE_TREE then runs the page-tree race instead of NVIDIA's suite).
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev 2>/dev/null
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
echo "VM-BOOTED kernel=$(uname -r) page_size=$(getconf PAGESIZE 2>/dev/null)"
insmod /nvidia.ko; echo "NVIDIA-LOAD rc=$?"
race=${RACE_THREADS:+uvm_pt_pack_test_race_threads=$RACE_THREADS uvm_pt_pack_test_race_iters=${RACE_ITERS:-2000} uvm_pt_pack_test_race_secs=${RACE_SECS:-300}}
for t in $(echo "${PT_TIERS:-0 1 2 3}" | tr , ' '); do
	insmod /nvidia-uvm.ko uvm_pt_pack=$t uvm_enable_builtin_tests=1 $race; echo "UVM-LOAD tier=$t rc=$?"
	major=$(awk '$2 == "nvidia-uvm" {print $1}' /proc/devices)
	rm -f /dev/nvidia-uvm; [ -n "$major" ] && mknod /dev/nvidia-uvm c "$major" 0
	s=$(cut -d. -f1 /proc/uptime)
	echo "PT-BEGIN tier=$t"
	/pt_run page_tree; echo "PT-RC tier=$t rc=$? secs=$(($(cut -d. -f1 /proc/uptime) - s))"
	case " ${GF_TIERS-0 1 2 3} " in *" $t "*)
		s=$(cut -d. -f1 /proc/uptime)
		echo "GF-BEGIN tier=$t"
		/pt_run gpu_free; echo "GF-RC tier=$t rc=$? secs=$(($(cut -d. -f1 /proc/uptime) - s))";;
	esac
	echo "STATS-BEGIN tier=$t"; cat /sys/module/nvidia_uvm/parameters/uvm_pt_pack_stats; echo "STATS-END"
	rmmod nvidia_uvm; echo "UVM-UNLOAD tier=$t rc=$?"
done
rmmod nvidia; echo "NVIDIA-UNLOAD rc=$?"
if [ -e /sys/kernel/debug/kmemleak ]; then
	echo scan > /sys/kernel/debug/kmemleak; sleep 6; echo scan > /sys/kernel/debug/kmemleak
	echo "KMEMLEAK-BEGIN"; cat /sys/kernel/debug/kmemleak; echo "KMEMLEAK-END"
fi
echo "VM-DONE"
poweroff -f
