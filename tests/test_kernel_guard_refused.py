"""The guard when the kernel refuses our module, in a real boot (issue 23): module.sig_enforce=1.

Debian's signed 7.x arm64 kernel boots under Debian's AAVMF whose db holds a test "platform" key; the kernel
loads it into .platform and trusts it for modules (tests/support/guardvm.py says what each part is). The
stand-in nvidia.ko and stock nvidia-uvm.ko are signed with that key; ours is signed with it (loads), with a
key nothing trusts (the kernel: "Loading of module with unavailable key is rejected", modprobe: "Key was
rejected by service"), or references a symbol the kernel does not export (an ABI mismatch). `modprobe
nvidia_uvm` runs the committed install rule and uvm-guard under dash with Debian's kmod.
"""

import re

import pytest

from tests.support import guardvm, qemu

pytestmark = [pytest.mark.kernel, pytest.mark.slow]


def test_guard_loads_stock_when_the_kernel_refuses_ours(tmp_path):
    k = qemu.kernel("debian-4k")
    rd, certs = guardvm.initramfs(k, tmp_path / "mods", tmp_path / "initrd.gz")
    vars_fd = guardvm.vars_with_db(guardvm.efi_root(), certs["platform"], tmp_path / "vars.fd")
    log = guardvm.boot(k, rd, vars_fd, timeout=900)
    (tmp_path / "console.log").write_text(log)
    assert "VM-DONE" in log, log[-3000:]
    assert "sig_enforce=Y" in log, "module.sig_enforce=1 did not take"
    assert re.search(r"integrity: Loaded X\.509 cert 'spark-memsaver test platform key: [0-9a-f]{40}'", log), \
        "the db certificate did not reach the platform keyring"
    res = dict(re.findall(r"RESULT case=(\w+) (nvidia_rc=\d+ rc=\d+ loaded=\S+)", log))
    # the trust path works: ours signed with the trusted key loads (so a refusal below is the key's doing)
    assert res.get("trusted") == "nvidia_rc=0 rc=0 loaded=ours", log[-4000:]
    # untrusted key: the kernel refuses ours, the guard loads the verified stock and exits 0
    assert res.get("untrusted") == "nvidia_rc=0 rc=0 loaded=stock-580.142", log[-4000:]
    assert "Loading of module with unavailable key is rejected" in log
    # the kernel's reason in guard.log and in the kernel log (the guard writes /dev/kmsg; the console shows it)
    assert re.search(r"GUARDLOG \S+ kernel=\S+ ours-load-failed: the kernel refused our nvidia-uvm \S+: "
                     r"Key was rejected by service \[key-not-trusted\]", log), log[-4000:]
    assert re.search(r"\[\s*[\d.]+\] spark-memsaver-guard: ours-load-failed: .*Key was rejected by service", log)
    # ABI mismatch: an unresolvable symbol, same fallback
    assert res.get("abi") == "nvidia_rc=0 rc=0 loaded=stock-580.142", log[-4000:]
    assert "nvidia_uvm: Unknown symbol spark_memsaver_test_absent_symbol" in log
    assert re.search(r"GUARDLOG .*ours-load-failed: .*Unknown symbol in module.* \[abi-mismatch\]", log)
    assert "REFUSED" not in log
    keys = log.split("PROC-KEYS-BEGIN", 1)[1].split("PROC-KEYS-END", 1)[0]
    assert re.search(r"keyring   \.platform: 1", keys), keys
    assert not qemu.bad_lines(log.split("VM-DONE")[0]), qemu.bad_lines(log)
