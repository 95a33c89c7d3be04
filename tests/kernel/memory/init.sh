#!/bin/sh
# PID 1 of the memory VMs (tests/test_kernel_memory.py, busybox). Steps from the kernel command line, in order:
#   MEM_STEPS="idle,reclaim,frag,psi"  (one boot) | "bb" (killed by the host) | "bbafter" | "pageblocks"
# The host reads everything from the console:
#   MEMDUMP-BEGIN <tag> ... MEMDUMP-END <tag>: the kernel's memory files, each as "MEMFILE <path>", its lines
#     prefixed "@ " (console noise between them is ignored), "MEMFILE-END"; "MEMFILE-EMPTY <path>" for a knob
#     that exists but cannot be read (memory.reclaim is write-only)
#   MEMASK <tag>: the guest waits for the host's answer on the console: "KNOB <path> <value>" lines (each
#     written as act/reclaim.write_knob writes it, timed: KNOB-DONE), then "GO"
# Other parameters: PSI_TRIGGER (service/floor.py's trigger, spaces as commas), HOG_MAX (memory.max of the hog's
# cgroup), HOG_ANON_MIB (anonymous memory the hog holds in it), FRAG_PCT, PB_TIER, PB_OPS, HOST_EPOCH, MODS
# (modules to load first, in order: the 4 KiB Debian kernel's virtio_blk and ext4), BB_NOSYNC (memtool: the
# black box without its fsync, the control).
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /sys/fs/cgroup; mount -t cgroup2 none /sys/fs/cgroup && echo +memory > /sys/fs/cgroup/cgroup.subtree_control
[ -n "$HOST_EPOCH" ] && date -s "@$HOST_EPOCH" > /dev/null
for m in $(echo "$MODS" | tr , ' '); do insmod "/$m" || echo "MOD-FAILED $m"; done
echo "VM-BOOTED kernel=$(uname -r) page_size=$(/memtool pagesize) boot_id=$(cat /proc/sys/kernel/random/boot_id)"
i=0; while [ ! -b /dev/vda ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
mkdir -p /mnt
if [ -b /dev/vda ]; then mount -t ext2 /dev/vda /mnt && echo "DISK-MOUNTED"; fi
TRIGGER=$(echo "${PSI_TRIGGER:-some,200000,2000000}" | tr , ' ')
now() { /memtool now; }

dump() {             # tag (after 2 s of quiet: right after a step, pages are still moving between the per-CPU
	#                    lists, the buddy allocator and the page cache, and the files are read one after another)
	sleep 2
	echo "MEMDUMP-BEGIN $1"
	for f in /proc/meminfo /proc/buddyinfo /proc/pagetypeinfo /proc/vmstat /proc/zoneinfo /proc/pressure/memory \
		/proc/pressure/io /proc/pressure/cpu /proc/sys/kernel/osrelease /proc/sys/kernel/arch \
		/proc/sys/kernel/random/boot_id /sys/kernel/mm/transparent_hugepage/hpage_pmd_size \
		/sys/devices/system/memory/block_size_bytes /sys/devices/system/memory/memory*/state; do
		[ -r "$f" ] || continue
		echo "MEMFILE $f"; sed 's/^/@ /' "$f"; echo "MEMFILE-END"
	done
	[ -e /sys/fs/cgroup/memory.reclaim ] && echo "MEMFILE-EMPTY /sys/fs/cgroup/memory.reclaim"
	echo "MEMDUMP-END $1"
}

ask() {              # tag: write the knobs the host names, then go on
	echo "MEMASK $1"
	while read -r w p v; do
		case $w in
		KNOB) t=$(now); echo "$v" > "$p"; r=$?; echo "KNOB-DONE $p $v rc=$r ms=$(($(now) - t))";;
		GO) break;;
		esac
	done
}

cg() {               # name max -> a cgroup under the root's memory controller
	mkdir -p "/sys/fs/cgroup/$1"; echo "$2" > "/sys/fs/cgroup/$1/memory.max"
}

cgstat() {           # name
	echo "CGSTAT $1 current=$(cat /sys/fs/cgroup/$1/memory.current) peak=$(cat /sys/fs/cgroup/$1/memory.peak 2>/dev/null)" \
		"$(tr '\n' ' ' < /sys/fs/cgroup/$1/memory.events)"
	echo "CGPRESSURE $1 $(tr '\n' ' ' < /sys/fs/cgroup/$1/memory.pressure 2>/dev/null)"
}

# a memory hog for PSI: HOG_ANON_MIB held anonymous (no swap: never reclaimed) and the page-cache file read
# over and over in what memory.max leaves: every read reclaims within the cgroup (direct reclaim: a memory stall)
HOG="/memtool anon ${HOG_ANON_MIB:-40} & while :; do cat /mnt/fill > /dev/null; done"

step_reclaim() {
	cg fill max
	t=$(now)
	sh -c 'echo $$ > /sys/fs/cgroup/fill/cgroup.procs; exec cat /mnt/fill' > /dev/null
	echo "FILLED ms=$(($(now) - t)) fill_bytes=$(stat -c %s /mnt/fill)"
	cgstat fill
	dump filled
	ask reclaim
	dump reclaimed
	ask compact
	dump after-reclaim
	cgstat fill
}

step_frag() {
	/memtool frag "${FRAG_PCT:-60}" > /tmp/frag.log 2>&1 &
	fp=$!
	i=0; while ! grep -q FRAG-READY /tmp/frag.log && [ $i -lt 600 ]; do sleep 0.5; i=$((i + 1)); done
	cat /tmp/frag.log
	dump frag-before
	t=$(now); echo 1 > /proc/sys/vm/compact_memory; echo "COMPACTED rc=$? ms=$(($(now) - t))"
	dump frag-after
	kill -9 $fp; wait $fp 2>/dev/null
}

step_psi() {
	cg hog "${HOG_MAX:-48M}"
	dump psi-before
	/memtool psi "$TRIGGER" "${PSI_SECS:-60}" /sys/fs/cgroup/hog sh -c "$HOG"
	dump psi-after
	cgstat hog
}

step_bb() {          # the black box: killed by the host after some samples
	d=/mnt/var/lib/spark-memsaver/blackbox
	mkdir -p $d
	cg hog "${HOG_MAX:-48M}"
	/memtool bbrecord "$TRIGGER" "${PSI_SECS:-60}" /sys/fs/cgroup/hog "$d/$(cat /proc/sys/kernel/random/boot_id).jsonl" sh -c "$HOG"
	echo "BB-ENDED rc=$?"
}

step_bbafter() {     # the next boot: what the disk kept, and this boot's own sample
	d=/mnt/var/lib/spark-memsaver/blackbox
	for f in $d/*.jsonl; do echo "BB-FOUND $(basename $f) lines=$(wc -l < $f)"; done
	/memtool bbsample "$d/$(cat /proc/sys/kernel/random/boot_id).jsonl"
}

unmovable() { awk '/^Number of blocks type/ {t=1; next} t && /^Node/ {s += $5} END {print s + 0}' /proc/pagetypeinfo; }

step_pageblocks() {  # the pool's selftest in tier PB_TIER: Unmovable pageblocks during and after it
	dump pb-before
	max=$(unmovable); before=$max
	insmod /st.ko uvm_pt_pack="${PB_TIER:-0}" threads=4 ops="${PB_OPS:-20000}" &
	ip=$!
	while kill -0 $ip 2>/dev/null; do u=$(unmovable); [ "$u" -gt "$max" ] && max=$u; sleep 0.2; done
	wait $ip; rc=$?
	echo "PB-RESULT tier=${PB_TIER:-0} insmod=$rc unmovable_before=$before unmovable_max=$max unmovable_after=$(unmovable)"
	dmesg | grep PTPACK-SELFTEST
	echo "STATS-BEGIN"; cat /sys/module/pt_pack_selftest/parameters/uvm_pt_pack_stats; echo "STATS-END"
	dump pb-after
	rmmod pt_pack_selftest; echo "PB-UNLOAD rc=$?"
}

for s in $(echo "${MEM_STEPS:-idle}" | tr , ' '); do
	echo "STEP-BEGIN $s"
	case $s in
	idle) dump idle;;
	*) "step_$s";;
	esac
	echo "STEP-END $s"
done
grep -q " /mnt " /proc/mounts && umount /mnt
echo "VM-DONE"
poweroff -f
