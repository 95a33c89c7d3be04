#!/bin/sh
# Runs inside tools/mok-e2e's guest (chrooted into this machine's /usr and the checkout over 9p), once per boot.
# The product's load path: stand-in modules (the pair nvidia.ko + stock nvidia-uvm.ko signed by a "vendor" key
# that is already a MOK; ours signed by the key being enrolled) in a module tree on tmpfs, depmod, the committed
# modprobe rule (its guard path pointed at the checkout), `modprobe nvidia_uvm` -> uvm-guard; then status.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin PYTHONPATH=/repo/daemon LC_ALL=C.UTF-8 HOME=/root
cd /
p=$(cat /e2e/phase)
K=$(uname -r)
sm() { /usr/bin/python3 -m spark_memsaver "$@"; }
mount -t tmpfs mods /usr/lib/modules
mkdir -p /lib/modules/$K/kernel/drivers/video /lib/modules/$K/updates/dkms /etc/modprobe.d /etc/spark-memsaver \
	/run/spark-memsaver /var/lib/spark-memsaver
mount --bind /e2e/state /var/lib/spark-memsaver     # the request record of boot 1, read after the reboot
cp /e2e/nvidia.ko /e2e/nvidia-uvm-stock.ko /lib/modules/$K/kernel/drivers/video/
mv /lib/modules/$K/kernel/drivers/video/nvidia-uvm-stock.ko /lib/modules/$K/kernel/drivers/video/nvidia-uvm.ko
cp /e2e/nvidia-uvm-ours.ko /lib/modules/$K/updates/dkms/nvidia-uvm.ko
depmod -a
sed 's|/usr/lib/spark-memsaver/uvm-guard|/repo/systemd/guard/uvm-guard|' /repo/systemd/modprobe.d/spark-memsaver.conf \
	> /etc/modprobe.d/spark-memsaver.conf
printf 'signing_cert: /e2e/mok.der\n' > /etc/spark-memsaver/config.yaml
sm mok status --json > /e2e/mok-$p.json 2>/e2e/mok-$p.err; echo $? > /e2e/mok-$p.rc
echo "E2E: phase $p mok status rc=$(cat /e2e/mok-$p.rc)"
modprobe nvidia_uvm > /e2e/modprobe-$p.txt 2>&1; echo $? > /e2e/modprobe-$p.rc
cat /sys/module/nvidia_uvm/parameters/variant > /e2e/variant-$p.txt 2>/dev/null || echo none > /e2e/variant-$p.txt
cp /run/spark-memsaver/guard.log /e2e/guard-$p.log 2>/dev/null
dmesg | grep -E 'spark-memsaver-guard|Loading of module|standin|Loaded X.509' > /e2e/dmesg-$p.txt
echo "E2E: phase $p modprobe rc=$(cat /e2e/modprobe-$p.rc) loaded=$(cat /e2e/variant-$p.txt)"
if [ "$p" = 1 ]; then
	# shellcheck disable=SC2046 # --wait-at-console, or --console-timeout 5 (tools/mok-e2e --missed-prompt)
	printf '%s\n' "$(cat /e2e/password)" | sm mok enroll --password-stdin $(cat /e2e/enroll-args) --json \
		> /e2e/enroll.json 2>/e2e/enroll.err; echo $? > /e2e/enroll.rc
	rm -f /e2e/password
	echo "E2E: enroll rc=$(cat /e2e/enroll.rc)"
fi
sm status --json > /e2e/status-$p.json 2>/e2e/status-$p.err; echo $? > /e2e/status-$p.rc
cat /proc/keys > /e2e/proc-keys-$p.txt 2>&1
mokutil --sb-state > /e2e/sb-state-$p.txt 2>&1
echo "E2E: phase $p status rc=$(cat /e2e/status-$p.rc)"
