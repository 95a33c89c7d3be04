"""The load-time guard when the kernel refuses our module (issue 23): never a node without nvidia-uvm.

Real modprobe/modinfo/depmod against module trees built by tests/test_lifecycle.py's fixtures, under dash,
bash and busybox sh; the guard runs for real (not its dry run). What stands in: **the kernel's answer to a
load**. No module can be loaded on this machine, so the root brings its own modprobe and insmod
(tests/support/kernelstandin.py: the real modprobe resolves what to insert, then the file listed as refused
gets kmod's exact error line for that errno -- "modprobe: ERROR: could not insert 'nvidia_uvm': <text>" --
and exit status 1); the guard finds them as it finds kmod's programs, in its root first. The same path with a
real kernel refusing a real module (module.sig_enforce=1 and an untrusted key; an unknown symbol) is
tests/test_kernel_guard_refused.py.

SPARK_MEMSAVER_TEST_GUARD=PATH runs these against another copy of the guard (the previous one fails them:
it exited with modprobe's failure and loaded nothing).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support import kernelstandin
from tests.test_guard_failclosed import GUARD, SHELLS, run
from tests.test_lifecycle import K, _tree, guard_log, inserted, p

pytestmark = pytest.mark.lifecycle

# kmod's text for each errno the kernel returns (libkmod mod_strerror / strerror), and the cause we log
REFUSALS = {
    "EKEYREJECTED": ("Key was rejected by service", "key-not-trusted"),
    "ENOKEY": ("Required key not available", "key-not-trusted"),
    "ENOENT (unknown symbol)": ("Unknown symbol in module, or unknown parameter (see dmesg)", "abi-mismatch"),
    "EINVAL (symbol version)": ("Invalid argument", "abi-mismatch"),
    "ENOEXEC": ("Invalid module format", "bad-format"),
    "EPERM (lockdown)": ("Operation not permitted", "signature-required"),
    "other": ("Cannot allocate memory", "other"),
}


LIVE = {"SPARK_MEMSAVER_GUARD_DRYRUN": ""}     # the guard's real load, through the root's stand-ins


def _refused(root, text, shell="dash", args=(), refused="updates/dkms/nvidia-uvm.ko"):
    kernelstandin.install(root)
    kernelstandin.refuse(root, p(root, refused), text)
    return run(root, *args, shell=shell, env=LIVE)


@pytest.mark.parametrize("shell", sorted(SHELLS))
@pytest.mark.parametrize("errno_name", sorted(REFUSALS))
def test_ours_refused_loads_the_verified_stock(tmp_path, shell, errno_name):
    text, cause = REFUSALS[errno_name]
    root = _tree(tmp_path, nv="550.163.01", stock_uvm="550.163.01", ours="550.163.01")
    ours = p(root, "updates/dkms/nvidia-uvm.ko")
    r = _refused(root, text, shell, ("uvm_perf_prefetch_enable=0",))
    assert r.returncode == 0, r.stderr
    assert inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")], r.stdout + r.stderr
    assert r.stdout.split()[-1] == "uvm_perf_prefetch_enable=0"       # the caller's options kept
    log = guard_log(root)
    assert f"ours-load-failed: the kernel refused our nvidia-uvm {ours}: {text} [{cause}]" in log, log
    assert "loading the stock module" in log and "REFUSED" not in log
    if cause in ("key-not-trusted", "signature-required"):
        assert "'sudo spark-memsaver mok enroll'" in log
    else:
        assert "'sudo spark-memsaver reconcile'" in log


def test_ours_refused_without_a_stock_refuses(tmp_path):
    root = _tree(tmp_path, nv="550.163.01", stock_uvm=None, ours="550.163.01")
    r = _refused(root, "Key was rejected by service")
    assert r.returncode == 1 and inserted(r) == [], r.stdout
    log = guard_log(root)
    assert "ours-load-failed" in log and "REFUSED" in log and "no verified stock nvidia-uvm" in log


def test_ours_refused_never_takes_a_stock_of_another_driver(tmp_path):
    # the stock module beside a driver other than the one loaded is not "verified stock"
    root = _tree(tmp_path, nv="550.163.01", stock_uvm="555.58.02", ours="550.163.01")
    r = _refused(root, "Key was rejected by service")
    assert r.returncode == 1 and inserted(r) == [], r.stdout


def test_ours_accepted_is_loaded_and_nothing_is_logged(tmp_path):
    root = _tree(tmp_path, nv="550.163.01", stock_uvm="550.163.01", ours="550.163.01")
    r = run(root)
    assert r.returncode == 0 and inserted(r) == [p(root, "updates/dkms/nvidia-uvm.ko")], r.stdout + r.stderr
    assert "ours-load-failed" not in guard_log(root)
    # the same through the real load: the kernel takes ours, nothing else is inserted
    r = run(kernelstandin.install(root), env=LIVE)
    assert r.returncode == 0 and inserted(r) == [p(root, "updates/dkms/nvidia-uvm.ko")], r.stdout + r.stderr
    assert "ours-load-failed" not in guard_log(root)


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_stock_refused_by_the_kernel_is_the_guards_failure(tmp_path, shell):
    """Stock selected (no override): the guard hands the load to modprobe and exits with modprobe's status.
    Here the kernel refuses the stock module: the guard exits 1, never 0. (Kills: load_selected's
    ``exit $?`` -> ``exit 0``.)"""
    root = _tree(tmp_path, nv="550.163.01", stock_uvm="550.163.01", ours=None)
    r = _refused(root, "Invalid module format", shell, refused="kernel/nvidia-open/nvidia-uvm.ko")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "could not insert 'nvidia_uvm': Invalid module format" in r.stderr
    (root / "kernel-refuses").unlink()                                   # accepted: 0, and the file went in
    r = run(root, env=LIVE)
    assert r.returncode == 0 and inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")], r.stdout + r.stderr


def test_real_modprobe_runs_the_rule_and_the_fallback(tmp_path):
    # modprobe itself runs the install rule (not --dry-run); the guard's loads go to the root's stand-ins
    root = _tree(tmp_path, nv="550.163.01", stock_uvm="550.163.01", ours="550.163.01")
    conf = root / "etc/modprobe.d/spark-memsaver.conf"
    assert str(GUARD) in conf.read_text() or "uvm-guard" in conf.read_text()
    kernelstandin.install(root)
    kernelstandin.refuse(root, p(root, "updates/dkms/nvidia-uvm.ko"), "Required key not available")
    e = dict(os.environ, SPARK_MEMSAVER_GUARD_KVER=K, SPARK_MEMSAVER_GUARD_MODDIR=str(root),
             SPARK_MEMSAVER_GUARD_ROOT=str(root), SPARK_MEMSAVER_GUARD_CONFIG=str(root / "etc/modprobe.d"))
    e.pop("SPARK_MEMSAVER_GUARD_DRYRUN", None)
    r = subprocess.run(["modprobe", "-d", str(root), "-S", K, "-C", str(root / "etc/modprobe.d"), "nvidia-uvm"],
                       capture_output=True, text=True, env=e, timeout=60)
    assert r.returncode == 0, r.stderr
    assert inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")], r.stdout + r.stderr
    assert "[key-not-trusted]" in guard_log(root)


def test_the_shipped_guard_has_no_test_only_knob():
    """The guard reads only its documented inspection knobs; no variable makes it pretend a load failed (the
    kernel's answer comes from the programs it runs, tests/support/kernelstandin.py here)."""
    import re
    text = GUARD.read_text()
    knobs = set(re.findall(r"SPARK_MEMSAVER_GUARD_[A-Z_]+", text))
    assert knobs == {f"SPARK_MEMSAVER_GUARD_{k}" for k in ("KVER", "MODDIR", "ROOT", "CONFIG", "DRYRUN", "LOG_MAX")}


def test_stock_insert_refused_by_the_kernel_is_a_refusal(tmp_path):
    """Ours refused, then the kernel refuses the verified stock module too (insmod by path): the guard says
    REFUSED and exits 1, never 0. (Kills: ``"$INSMOD" ... || refuse`` -> ``&&``, which the dry run could not
    reach.)"""
    root = _tree(tmp_path, nv="550.163.01", stock_uvm="550.163.01", ours="550.163.01")
    kernelstandin.install(root)
    kernelstandin.refuse(root, p(root, "updates/dkms/nvidia-uvm.ko"), "Key was rejected by service")
    kernelstandin.refuse(root, p(root, "kernel/nvidia-open/nvidia-uvm.ko"), "Invalid module format")
    r = run(root, env=LIVE)
    assert r.returncode == 1 and inserted(r) == [], r.stdout + r.stderr
    assert "could not insert module" in r.stderr and "REFUSED: insmod" in r.stderr
    assert "REFUSED" in guard_log(root)
