"""Decisions that no mutant may survive (issue 29 item 3): each test pins one behaviour that a mutation run
found unguarded, through the public entry point, and says which mutant it kills.

The libcuda stand-in is a C library built here with gcc: it stands in for NVIDIA's libcuda.so.1 (no GPU on
CI) only to see the exact integer the binding passes for a size; the real library is driven by
tests/test_gpu.py (-m gpu) on a GPU machine.
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
from pathlib import Path

import pytest

from spark_memsaver import record
from spark_memsaver.decide import apt
from spark_memsaver.decide import hazards as hz
from spark_memsaver.host import Host, events
from spark_memsaver.validate import cuda
from tests.support import needs, sparkroot
from tests.support.worlds import typed

apt = typed(apt)   # dict snapshots -> model.World (tests/support/worlds.py)

REPO = Path(__file__).resolve().parent.parent
K = "6.8.0-50-generic"
GIB = 1 << 30


def _snap(version="550.163.01"):
    return {"kernels": [{"release": K, "uvm_selected": {"patched": True, "version": f"{version}-spark1"},
                         "nvidia_selected": {"path": f"/lib/modules/{K}/kernel/nvidia-550-open/nvidia.ko"}}]}


# --- the APT door ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("readable,removed", [(False, True), (True, False)])
def test_unreadable_meta_package_removes_the_override_fail_safe(readable, removed):
    """A meta package (linux-modules-nvidia-550-generic) whose .deb could not be read may carry anything: the
    override is removed. Read, it carries no module: nothing happens. (Kills: unreadable meta = no effect.)"""
    change = {"name": "linux-modules-nvidia-550-generic", "action": "Install", "old": "1", "new": "2",
              "facts": {"readable": readable}}
    steps = apt.assess(_snap(), [change])["steps"]
    assert [(s.action, s.kernel) for s in steps] == ([("remove-override", K)] if removed else [])


def test_mixed_target_drivers_in_one_transaction_remove_the_override():
    """Two packages for the kernel, one keeping 550.163.01 and one bringing 550.163.02: the override (built for
    550.163.01) must go. (Kills: ``tos == {built_for}`` -> ``built_for in tos``.)"""
    def pkg(name, drv):
        return {"name": f"{name}-550-{K}", "action": "Install", "old": "1", "new": "2",
                "facts": {"readable": True, "modules": {K: ["nvidia.ko"]}, "nvidia_ko": {K: drv}}}
    same = apt.assess(_snap(), [pkg("linux-modules-nvidia", "550.163.01")])
    assert same["steps"] == [] and [n["kind"] for n in same["notes"]] == ["kept"]
    mixed = apt.assess(_snap(), [pkg("linux-modules-nvidia", "550.163.01"), pkg("linux-objects-nvidia", "550.163.02")])
    assert [(s.action, s.kernel, s.driver_from, s.code) for s in mixed["steps"]] == [
        ("remove-override", K, "550.163.01", "driver-changing")]


@pytest.mark.parametrize("deb,up", [("1:555.58.02-1", "555.58.02"), ("550.163.01+really1~deb12u1-2", "550.163.01"),
                                    ("580.142~rc1", "580.142"), ("580.142-0ubuntu0.24.04.1", "580.142"),
                                    ("-", None), ("garbage", None)])
def test_the_driver_a_debian_version_names(deb, up):
    """(Kills: the '[+~]' split of upstream_of_deb mutated.)"""
    assert apt.upstream_of_deb(deb) == up


def test_apt_hook_v2_line_keeps_the_whole_action():
    """A v2 hook line's action is every field after the new version, joined by one space: '**CONFIGURE**' and
    a removal's '**REMOVE**' are what the door compares. (Kills: the join string mutated.)"""
    text = "VERSION 2\nAPT::Architecture=arm64\n\nnvidia-kernel-source-580-open 580.95.05 < 580.142 **CONFIGURE**\n" \
           "linux-modules-nvidia-580-6.8.0-50-generic 1 > - **REMOVE** now\n"
    assert [(c["name"], c["old"], c["new"], c["action"]) for c in apt.parse_apt_hook(text)] == [
        ("nvidia-kernel-source-580-open", "580.95.05", "580.142", "**CONFIGURE**"),
        ("linux-modules-nvidia-580-6.8.0-50-generic", "1", None, "**REMOVE** now")]


# --- the planner: a failed build is not retried automatically for the same driver ---------------------------

@pytest.mark.parametrize("code,retried", [("build-failed", False), ("patch-failed", False), ("install-failed", False),
                                          ("driver-changing", True)])
def test_no_automatic_retry_after_a_failed_build_install_or_patch(code, retried):
    """After a rollback coded build-failed / patch-failed / install-failed for the driver now installed, reconcile
    stays stock and says how to retry; any other code rebuilds. (Kills: a code dropped from NO_AUTO_RETRY.)"""
    from spark_memsaver.decide import plan as rc
    rc = typed(rc)
    from tests.test_lifecycle import CFG, K as LK, SUPPORT, kern, snap
    s = snap(kern(nv="555.58.02"), rollbacks=[{"kernel": LK, "time": "2026-01-01T00:00:00Z", "code": code,
                                                "driver_from": "550.163.01", "driver_to": "555.58.02",
                                                "reason": "make failed"}])
    steps = rc.plan(s, CFG, SUPPORT, alive_pids=set())
    assert [(x.action, x.kernel) for x in steps] == [("build-install" if retried else "stay-stock", LK)], steps
    if not retried:
        assert "the last build for driver 555.58.02 failed (make failed)" in steps[0].reason
        assert steps[0].remedy == f"sudo spark-memsaver install --kernel {LK}"   # runnable as printed (issue 27)


# --- hazards -----------------------------------------------------------------------------------------------

def test_hazard_range_upper_bound_is_exclusive():
    """A fix released in 595.45.04 (affected_below) means 595.45.04 itself is not affected by version; the
    version just below is. (Kills: ``v < affected_below`` -> ``v <= affected_below``.)"""
    (h,) = [h for h in hz.load_hazards((REPO / "uvm_patch/hazards.yaml").read_text()) if h.reference.endswith("#1269")]
    h = record.replace(h, affected_below=(595, 45, 4))
    kw = dict(arch="aarch64", page_size=65536, nv_linux_h_text=None)
    assert hz.assess(h, driver_version="595.45.04", **kw).state == hz.NOT_AFFECTED
    assert hz.assess(h, driver_version="595.45.3", **kw).state == hz.AFFECTED
    assert hz.assess(h, driver_version="590.44.01", **kw).state == hz.AFFECTED


# --- the event log -----------------------------------------------------------------------------------------

def test_event_log_never_writes_through_a_symlink(tmp_path, caplog):
    """/var/lib/spark-memsaver/events.jsonl planted as a symlink to another file of the root: record() refuses
    (O_NOFOLLOW on the log's own path, also under a root prefix: the kernel's ELOOP is the reason it gives) and
    the target is untouched. (Kills: dropping O_NOFOLLOW -- the open then follows the link, the reopen loop
    meets a different file each time and gives up with event-log-unstable instead of ELOOP; found with it: under
    a prefix the link was resolved before the open and written through.)"""
    host = Host(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    p = host.path(events.EVENTS)
    p.parent.mkdir(parents=True)
    os.symlink("../../../victim", p)
    with caplog.at_level("WARNING", logger=events.__name__):
        assert events.record(host, "build", {"kernel": K}, {"ok": True}) is False
    assert os.strerror(errno.ELOOP) in caplog.text and "event-log-unstable" not in caplog.text
    assert victim.read_text() == "precious\n" and p.is_symlink()
    p.unlink()
    assert events.record(host, "build", {"kernel": K}, {"ok": True}) is True and "build" in p.read_text()


def test_event_log_reopen_is_bounded(tmp_path):
    """The writer reopens the log when a rotation renamed a new file over the one it opened; a path that names
    another file after every open (here: a symlink opened without O_NOFOLLOW, which is what the loop would meet
    if that flag were lost) ends after events.REOPENS opens with the named error, never a loop for ever; the
    file the link names is not written."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    p = tmp_path / "events.jsonl"
    os.symlink(victim, p)
    with pytest.raises(events.EventLogUnstable) as ei:
        events._open_locked(str(p), events.OPEN_FLAGS & ~os.O_NOFOLLOW)
    assert ei.value.code == "event-log-unstable" and str(events.REOPENS) in str(ei.value)
    assert victim.read_text() == "precious\n"


# --- the CUDA binding's size arguments ---------------------------------------------------------------------

STANDIN = r"""
#include <stddef.h>
#include <string.h>
unsigned long long last_size, last_ptr;
#define OK(name) int name() { return 0; }
OK(cuInit) OK(cuDriverGetVersion) OK(cuDeviceGetCount) OK(cuDeviceGet) OK(cuDeviceGetName)
OK(cuDeviceGetAttribute) OK(cuDeviceTotalMem_v2) OK(cuDeviceGetPCIBusId) OK(cuDeviceGetUuid_v2)
OK(cuDevicePrimaryCtxRetain) OK(cuDevicePrimaryCtxRelease_v2) OK(cuCtxSetCurrent) OK(cuCtxSynchronize)
OK(cuMemGetInfo_v2) OK(cuMemFree_v2) OK(cuMemsetD32_v2) OK(cuStreamCreate) OK(cuStreamDestroy_v2)
OK(cuStreamSynchronize)
int cuMemAlloc_v2(unsigned long long *p, size_t n) { last_size = n; *p = 0x10000; return 0; }
int cuMemAllocManaged(unsigned long long *p, size_t n, unsigned f) { last_size = n; *p = 0x20000; return 0; }
int cuMemsetD8_v2(unsigned long long d, unsigned char v, size_t n) { last_ptr = d; last_size = n; return 0; }
int cuMemcpyHtoD_v2(unsigned long long d, const void *s, size_t n) { last_ptr = d; last_size = n; return 0; }
int cuMemcpyDtoH_v2(void *d, unsigned long long s, size_t n) { last_ptr = s; last_size = n; return 0; }
"""


def compile_standin(d: Path, source: str = STANDIN) -> Path:
    """d/libcuda.so.1 built with gcc from ``source`` (the stand-in for NVIDIA's library; no GPU here)."""
    needs.require("gcc", remedy="tools/deps/base.txt (build-essential)")
    (d / "standin.c").write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(d / "libcuda.so.1"), str(d / "standin.c")], check=True)
    return d / "libcuda.so.1"


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    return compile_standin(tmp_path_factory.mktemp("libcuda"))


@pytest.mark.parametrize("size", [5 * GIB + 3, 4 * GIB, (1 << 40) + 4096])
def test_sizes_of_4_gib_and_more_reach_the_driver_whole(standin, size):
    """Every size-taking entry point passes a 64-bit size: 5 GiB + 3 arrives as 5 GiB + 3, not truncated to
    32 bits (exactly what the 4 GiB-crossing checks of validate probe). (Kills: c_size_t -> c_uint.)"""
    c = cuda.Cuda(str(standin))
    last = ctypes.c_ulonglong.in_dll(c.lib, "last_size")
    last_ptr = ctypes.c_ulonglong.in_dll(c.lib, "last_ptr")
    assert c.alloc(size) == 0x10000 and last.value == size
    assert c.alloc_managed(size) == 0x20000 and last.value == size
    for call in (lambda: c.memset_d8(5 * GIB, 0, size), lambda: c.htod(5 * GIB, 0, size),
                 lambda: c.dtoh(0, 5 * GIB, size)):
        last.value = last_ptr.value = 0
        call()
        assert (last.value, last_ptr.value) == (size, 5 * GIB)


# --- the kernel policy --------------------------------------------------------------------------------------

def test_policy_answers_exactly():
    """(Kills, in decide/policy.py: the error code, the dkms.conf keys, an in-policy reason that is not empty,
    preempt_rt ignored without a readable config.)"""
    from spark_memsaver.config import Config
    from spark_memsaver.decide import policy
    with pytest.raises(policy.TierInvalid) as e:
        policy.normalize_tier("bogus")
    assert e.value.code == "config-invalid" and str(e.value).startswith("tier 'bogus' is not one of: leaf, 4k-all, 256")
    assert policy.dkms_build_exclusive("64k-only") == {"build_exclusive_arch": "^aarch64$",
                                                       "build_exclusive_config": "CONFIG_ARM64_64K_PAGES !CONFIG_PREEMPT_RT"}
    assert policy.dkms_build_exclusive("all") == {"build_exclusive_arch": "", "build_exclusive_config": "!CONFIG_PREEMPT_RT"}
    k64 = {"release": "6.8.0-1-nvidia-64k", "page_size": 65536}
    kc = {"release": "6.8.0-1-nvidia-64k", "page_size": 65536,
          "kconfig": {"CONFIG_ARM64": "y", "CONFIG_ARM64_64K_PAGES": "y"}}
    for cfg in (Config(), Config(kernels="all")):
        assert policy.kernel_in_policy(k64, cfg) == (True, "")
        assert policy.kernel_in_policy(kc, cfg) == (True, "")
        ok, why = policy.kernel_in_policy({**k64, "preempt_rt": True}, cfg)      # no config read: the flag decides
        assert not ok and "PREEMPT_RT" in why


# --- the guard's decision ---------------------------------------------------------------------------------

@pytest.mark.lifecycle
def test_guard_never_takes_a_module_of_another_name_as_the_stock_nvidia_uvm(tmp_path):
    """The stock record names the driver's nvidia.ko (right version, no tag, no uvm_pt_pack parameter) and no
    verified stock nvidia-uvm exists: the guard refuses and loads nothing; it must never insmod nvidia.ko as
    nvidia-uvm. (Kills, in is_stock_for: ``[ name = nvidia_uvm ] && [ -z tag ] && [ -z pack ]`` with the
    second && turned into ||.)"""
    from tests.test_lifecycle import K as LK, _tree, guard, inserted
    root = _tree(tmp_path, nv="555.58.02", stock_uvm=None, ours="550.163.01")
    sparkroot.write(root, f"/var/lib/spark-memsaver/stock/{LK}", f"/lib/modules/{LK}/kernel/nvidia-open/nvidia.ko\n")
    r = guard(root)
    assert r.returncode == 1 and inserted(r) == [], r.stdout + r.stderr
    assert "REFUSED" in r.stderr


@pytest.mark.lifecycle
def test_guard_never_guesses_among_several_nvidia_uvm_files(tmp_path):
    """modinfo names two files for nvidia_uvm (two modules carrying the alias, both ours and built for the
    driver beside them): which one modprobe would load is not known, so the guard loads neither and takes the
    verified stock by path, saying why. (Kills, in the selection: ``[ "$i_n" -eq 1 ]`` -> ``-ne 1``.)"""
    from tests.test_lifecycle import K as LK, _tree, guard, inserted, p
    ours = sparkroot.uvm_fields("555.58.02", "OURS", LK, True) + [("alias", "nvidia_uvm")]
    root = _tree(tmp_path, nv="555.58.02", stock_uvm=None, ours=None,
                 extra=[("updates/a/uvm-a.ko", ours), ("updates/b/uvm-b.ko", ours),
                        ("kernel/nvidia-open/uvm-stock.ko", sparkroot.uvm_fields("555.58.02", "S", LK, False))])
    sparkroot.write(root, f"/var/lib/spark-memsaver/stock/{LK}", f"/lib/modules/{LK}/kernel/nvidia-open/uvm-stock.ko\n")
    r = guard(root)
    assert r.returncode == 0 and inserted(r) == [p(root, "kernel/nvidia-open/uvm-stock.ko")], r.stdout + r.stderr
    assert "modinfo names 2 files for nvidia_uvm" in r.stderr


@pytest.mark.lifecycle
def test_guard_loads_stock_beside_a_loaded_nvidia_whose_file_is_gone(tmp_path):
    """nvidia 550.163.01 still loaded, its package removed (no nvidia.ko on disk), ours built for 555.58.02,
    the stock nvidia-uvm of 550.163.01 still there: the guard inserts that stock module by path and does not
    run ``modprobe nvidia`` first (nvidia is loaded; modprobe would find no nvidia.ko and the load would be
    refused). (Kills: ``[ -z "$nv_loaded" ]`` -> ``-n``, which also skips ``modprobe nvidia`` before the
    stock insmod when nvidia is NOT loaded.)"""
    from tests.test_lifecycle import _tree, guard, inserted, p
    root = _tree(tmp_path, nv=None, stock_uvm="550.163.01", ours="555.58.02")
    sparkroot.write(root, "/sys/module/nvidia/version", "550.163.01\n")
    r = guard(root)
    assert r.returncode == 0 and inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")], r.stdout + r.stderr
    assert "loaded nvidia is 550.163.01" in r.stderr and "modprobe nvidia failed" not in r.stderr
