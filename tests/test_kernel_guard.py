"""The load-time guard in a real boot (Debian's 7.3 arm64 kernel under qemu, Debian's kmod 34 and dash).

The initramfs (tests/support/qemu.py guard_initramfs) carries the committed systemd/guard/uvm-guard and
systemd/modprobe.d/spark-memsaver.conf unchanged, and stand-in modules built for the VM's kernel
(tests/kernel/standin: they stand in only for the module name, .modinfo version and, for "ours", the
spark_memsaver tag and uvm_pt_pack parameter; they drive no hardware): our nvidia-uvm 580.142 in
updates/dkms, and per case an nvidia.ko + stock nvidia-uvm.ko of one version. tests/kernel/guard-init.sh
runs depmod, `modprobe nvidia`, `modprobe nvidia_uvm` (→ the install rule → uvm-guard) and reports which
module the kernel really loaded (its `variant` parameter in sysfs).
"""

import re

import pytest

from tests.support import qemu

pytestmark = pytest.mark.kernel


def test_modprobe_selects_ours_on_match_and_verified_stock_on_mismatch(tmp_path):
    k = qemu.kernel("debian-4k")
    rd = qemu.guard_initramfs(k, tmp_path / "mods", tmp_path / "initrd.gz")
    log = qemu.boot(k, rd, timeout=600)
    (tmp_path / "console.log").write_text(log)
    assert "VM-DONE" in log, log[-3000:]
    assert "kmod version 34" in log or re.search(r"kmod=kmod version \d+", log), "not Debian's kmod"
    res = dict(re.findall(r"RESULT case=(\w+) (rc=\d+ loaded=\S+ uvm_version=\S*)", log))
    assert res.get("match") == "rc=0 loaded=ours uvm_version=580.142", log[-3000:]
    assert res.get("mismatch") == "rc=0 loaded=stock-580.95.05 uvm_version=580.95.05", log[-3000:]
    assert "loaded nvidia is 580.95.05: loading the stock module" in log
    assert not qemu.bad_lines(log), qemu.bad_lines(log)
