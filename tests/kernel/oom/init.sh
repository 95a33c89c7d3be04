#!/bin/sh
# PID 1 of the out-of-memory VM (tests/test_kernel_oom.py, busybox). NVIDIA's UVM_TEST_PAGE_TREE through the
# patched nvidia-uvm.ko, and the pool's selftest, under allocation failure, per tier and case:
#   page-i:N   fail_page_alloc, every N-th allocation of the test task   page-p:P  the same, probability P %
#   slab-i:N   failslab, every N-th allocation of the test task          slab-p:P  the same, probability P %
#   nth:SEED   (NVIDIA's test only) /proc/self/fail-nth per call, n from SEED (pt_run oom nth)
#   memcg:MAX  the test in a memory cgroup with memory.max = MAX (the selftest charges its user trees there;
#              NVIDIA's fake-GPU trees are charged nowhere: UVM charges a user tree to its va_space's mm)
#   hog:KIB    a background memory hog holds the guest KIB beyond MemAvailable 0 (below the watermarks) while
#              the test runs; the OOM killer takes the hog first (oom_score_adj 1000) and it is started again
# fail_page_alloc / failslab: task-filter Y (only a task with make-it-fail 1: pt_run around its ioctl, the
# selftest's kthreads), ignore-gfp-wait N, min-order 0 (GFP_KERNEL order-0 pages fail too), verbose 0;
# times starts at 1000000, so failures injected = 1000000 - times.
# Kernel command line: OOM_TIERS="0,3" OOM_CASES="page-i:7,slab-i:11" OOM_CALLS=2 (NVIDIA's test; none: "")
# ST_TIERS, ST_CASES, ST_OPS (the selftest: every /st-*.ko in the initramfs, in name order).
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev 2>/dev/null
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
mkdir -p /sys/fs/cgroup; mount -t cgroup2 none /sys/fs/cgroup && echo +memory > /sys/fs/cgroup/cgroup.subtree_control
echo "VM-BOOTED kernel=$(uname -r) page_size=$(getconf PAGESIZE 2>/dev/null)"
D=/sys/kernel/debug
for a in fail_page_alloc failslab; do
	echo 0 > $D/$a/probability; echo 1 > $D/$a/interval; echo -1 > $D/$a/times
	echo Y > $D/$a/task-filter; echo N > $D/$a/ignore-gfp-wait; echo 0 > $D/$a/verbose
done
echo N > $D/fail_page_alloc/ignore-gfp-highmem; echo 0 > $D/fail_page_alloc/min-order
secs() { cut -d. -f1 /proc/uptime; }
vm() { awk -v k="$1" '$1 == k {print $2}' /proc/vmstat; }
VMKEYS="allocstall_normal pgscan_kswapd pgscan_direct compact_stall oom_kill"
vmsnap() { for k in $VMKEYS; do printf '%s=%s ' "$k" "$(vm $k)"; done; }

inject_on() {        # kind arg
	case $1 in
	page-*) a=fail_page_alloc;; slab-*) a=failslab;; *) return;;
	esac
	case $1 in
	*-i) echo 100 > $D/$a/probability; echo "$2" > $D/$a/interval;;
	*-p) echo "$2" > $D/$a/probability; echo 1 > $D/$a/interval;;
	esac
	echo 1000000 > $D/$a/times
}
inject_off() {       # kind -> prints the failures injected
	case $1 in
	page-*) a=fail_page_alloc;; slab-*) a=failslab;; *) echo 0; return;;
	esac
	echo 0 > $D/$a/probability; echo 1 > $D/$a/interval
	echo $((1000000 - $(cat $D/$a/times))); echo -1 > $D/$a/times
}
HOG=
hog_start() {        # KiB beyond MemAvailable 0; respawned while /tmp/hog.on exists
	: > /tmp/hog.on; : > /tmp/hog.log
	(while [ -e /tmp/hog.on ]; do /pt_run hog "$1" >> /tmp/hog.log 2>&1; done) &
	HOG=$!
	i=0; while ! grep -q HOG-READY /tmp/hog.log 2>/dev/null && [ $i -lt 600 ]; do sleep 1; i=$((i + 1)); done
	echo "HOG $(head -1 /tmp/hog.log) after ${i}s"
}
hog_stop() {
	rm -f /tmp/hog.on
	for p in $(pidof pt_run); do tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | grep -q ' hog ' && kill -9 $p; done
	wait $HOG 2>/dev/null; HOG=
	echo "HOG-STOP started $(grep -c HOG-READY /tmp/hog.log) times"
}
CG=/sys/fs/cgroup/oomtest
cg_make() { mkdir -p $CG && echo "$1" > $CG/memory.max; }
cg_done() {
	echo "CGROUP max=$(cat $CG/memory.max) peak=$(cat $CG/memory.peak 2>/dev/null) $(tr '\n' ' ' < $CG/memory.events)"
	rmdir $CG
}

# run CMD... for a case: under the cgroup (memcg), beside the hog (hog), or as it is
in_case() {          # kind arg cmd...
	k=$1; x=$2; shift 2
	case $k in
	memcg) cg_make "$x"; sh -c 'echo $$ > '$CG'/cgroup.procs; exec "$@"' sh "$@"; r=$?; cg_done; return $r;;
	hog) hog_start "$x"; "$@"; r=$?; hog_stop; return $r;;
	*) "$@";;
	esac
}

insmod /nvidia.ko; echo "NVIDIA-LOAD rc=$?"
for t in $(echo "${OOM_TIERS-0,3}" | tr , ' '); do
	for c in $(echo "${OOM_CASES-page-i:7,slab-i:11}" | tr , ' '); do
		k=${c%%:*}; x=${c#*:}
		insmod /nvidia-uvm.ko uvm_pt_pack=$t uvm_enable_builtin_tests=1; echo "OOM-LOAD tier=$t case=$c rc=$?"
		major=$(awk '$2 == "nvidia-uvm" {print $1}' /proc/devices)
		rm -f /dev/nvidia-uvm; [ -n "$major" ] && mknod /dev/nvidia-uvm c "$major" 0
		echo "OOM-BEGIN tier=$t case=$c vmstat $(vmsnap)"
		s=$(secs)
		case $k in
		nth) in_case "$k" "$x" /pt_run oom nth "${OOM_CALLS:-2}" "$x";;
		page-*|slab-*) inject_on "$k" "$x"; in_case "$k" "$x" /pt_run oom task "${OOM_CALLS:-2}";;
		*) in_case "$k" "$x" /pt_run oom none "${OOM_CALLS:-2}";;
		esac
		rc=$?
		echo "OOM-END tier=$t case=$c rc=$rc secs=$(($(secs) - s)) injected=$(inject_off "$k") vmstat $(vmsnap)"
		echo "STATS-BEGIN tier=$t case=$c"; cat /sys/module/nvidia_uvm/parameters/uvm_pt_pack_stats; echo "STATS-END"
		rmmod nvidia_uvm; echo "OOM-UNLOAD tier=$t case=$c rc=$?"
	done
done
rmmod nvidia 2>/dev/null; echo "NVIDIA-UNLOAD rc=$?"

# the pool's selftest (kthreads marked make-it-fail; user trees charged to the loader's cgroup)
for ko in /st-*.ko; do
	[ -e "$ko" ] || continue
	for t in $(echo "${ST_TIERS-0,3}" | tr , ' '); do
		for c in $(echo "${ST_CASES-page-p:5,slab-p:5}" | tr , ' '); do
			k=${c%%:*}; x=${c#*:}
			echo "ST-BEGIN ko=$ko tier=$t case=$c vmstat $(vmsnap)"
			s=$(secs)
			inject_on "$k" "$x"
			in_case "$k" "$x" insmod "$ko" uvm_pt_pack=$t oom=1 threads=4 ops="${ST_OPS:-5000}"
			rc=$?
			echo "ST-END ko=$ko tier=$t case=$c rc=$rc secs=$(($(secs) - s)) injected=$(inject_off "$k") vmstat $(vmsnap)"
			echo "STATS-BEGIN ko=$ko tier=$t case=$c"; cat /sys/module/pt_pack_selftest/parameters/uvm_pt_pack_stats
			echo "STATS-END"
			rmmod pt_pack_selftest; echo "ST-UNLOAD ko=$ko tier=$t case=$c rc=$?"
		done
	done
done
if [ -e /sys/kernel/debug/kmemleak ]; then
	echo scan > /sys/kernel/debug/kmemleak; sleep 6; echo scan > /sys/kernel/debug/kmemleak
	echo "KMEMLEAK-BEGIN"; cat /sys/kernel/debug/kmemleak; echo "KMEMLEAK-END"
fi
echo "VM-DONE"
poweroff -f
