#!/bin/sh
# PID 1 of the guard-refused VM (tests/support/guardvm.py; busybox + Debian's real kmod, dash and keyctl):
# with module.sig_enforce=1, `modprobe nvidia_uvm` through the committed rule and uvm-guard once per variant
# of our module: signed with the key the kernel trusts (db -> .platform), with a key it does not trust,
# and with an unresolvable symbol. Prints what the kernel loaded, the guard's status and log, /proc/keys.
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /run/spark-memsaver /var/lib /tmp
K=$(uname -r)
echo "VM-BOOTED kernel=$K kmod=$(/usr/sbin/modprobe --version | head -1) sig_enforce=$(cat /sys/module/module/parameters/sig_enforce)"
for case in trusted untrusted abi; do
	cp /cases/$case.ko /lib/modules/$K/updates/dkms/nvidia-uvm.ko
	/usr/sbin/depmod -a
	/usr/sbin/modprobe nvidia; nvrc=$?
	rm -f /run/spark-memsaver/guard.log
	/usr/sbin/modprobe nvidia_uvm; rc=$?
	v=$(cat /sys/module/nvidia_uvm/parameters/variant 2>/dev/null)
	echo "RESULT case=$case nvidia_rc=$nvrc rc=$rc loaded=${v:-none}"
	sed 's/^/GUARDLOG /' /run/spark-memsaver/guard.log 2>/dev/null
	/usr/sbin/rmmod nvidia_uvm 2>/dev/null; /usr/sbin/rmmod nvidia
done
echo "PROC-KEYS-BEGIN"; cat /proc/keys; echo "PROC-KEYS-END"
echo "KEYCTL-PLATFORM-BEGIN"; /usr/bin/keyctl rlist %:.platform; echo "KEYCTL-PLATFORM-END"
echo "VM-DONE"
poweroff -f
