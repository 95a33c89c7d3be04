"""Observe once per operation (issue 34, item 3): following ``kernel`` from the install entry, how often the acting
code goes back down to a lower layer (observe/, decide/, world/) once the operation's first step has begun.

A real ``install --kernel K`` runs to its end in this process on a fixture root (tests/support/installroot.py: the
real dkms on the root's tree, the real depmod and modinfo, the real NVIDIA tree) under ``sys.setprofile``. Every
call whose caller is a frame of act/ and whose callee is a function of observe/, decide/ or world/ is counted,
from the moment the first intent record is written (act/records_io.safe_intent: "plan -> lock -> intent -> act"):
what came before is the one observation and the plan. The initial observation itself is counted too, apart (the
whole world read: world.facts/snapshot/observe_for_plan), once per operation.

The count is of distinct call sites (caller file:line -> callee); the run prints them with the number of calls.
The issue measured 22 returns on an older main; main before this change: install 36 sites (38 calls) and two
whole-world reads, remove 19 sites (29 calls), reconcile's build-install 38 sites (60 calls). The remove after
the install and the reconcile are counted the same way."""

from __future__ import annotations

import collections
import os
import sys

import pytest

from tests.support import installroot, needs

LOWER = ("spark_memsaver.observe", "spark_memsaver.decide", "spark_memsaver.world")
ACT = "spark_memsaver.act"
WHOLE = {("spark_memsaver.world", "facts"), ("spark_memsaver.world", "snapshot"),
         ("spark_memsaver.world", "observe_for_plan"), ("spark_memsaver.observe.snapshot", "snapshot")}
LIMIT = 5


def _module(frame) -> str:
    return frame.f_globals.get("__name__") or ""


def _lower(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in LOWER)


def trace(op: str, root, kernel: str | None, **args) -> tuple[dict, collections.Counter, collections.Counter]:
    """(``op --kernel kernel``'s result, {call site: calls} after the first step began, {whole-world reads: calls})."""
    from spark_memsaver.act import executor
    from spark_memsaver.config import Config
    from spark_memsaver.host import Host

    mid: collections.Counter = collections.Counter()
    whole: collections.Counter = collections.Counter()
    started = [False]

    def profile(frame, event, arg):
        if event != "call":
            return
        name, code = _module(frame), frame.f_code
        caller = frame.f_back
        if name == f"{ACT}.records_io" and code.co_name == "safe_intent":
            started[0] = True
        if caller is None or not _lower(name) or not _module(caller).startswith(ACT + "."):
            return
        if (name, code.co_name) in WHOLE:
            whole[f"{_module(caller)}:{caller.f_lineno} -> {name}.{code.co_name}"] += 1
        if started[0]:
            mid[f"{_module(caller)}:{caller.f_lineno} -> {name}.{code.co_qualname}"] += 1

    sys.setprofile(profile)
    try:
        doc = executor.perform(op, Host(str(root)), Config(), **({"kernel": kernel} if kernel else {}), **args)
    finally:
        sys.setprofile(None)
    return doc, mid, whole


@pytest.fixture
def node(tmp_path, monkeypatch):
    needs.require("gcc", "depmod", "modinfo", "dkms")
    monkeypatch.delenv("SPARK_MEMSAVER_CONFIG", raising=False)
    root, wrapper = installroot.make(tmp_path)
    monkeypatch.setenv("SPARK_MEMSAVER_DKMS", str(wrapper))
    return root


def test_the_fixture_install_really_installs_ours(node):
    """The measurement below follows a real install to its end: ours is selected afterwards, verified."""
    from spark_memsaver.host import Host
    from spark_memsaver.observe import modules
    doc, _, _ = trace("install", node, installroot.K)
    [one] = doc["installed"]
    assert one["selected"] == f"/lib/modules/{installroot.K}/updates/dkms/nvidia-uvm.ko" and one["verification"]["ok"]
    sel = modules.selection(Host(str(node)), installroot.K)
    assert sel["state"] == "ours" and sel["versions_match"] is True


def _report(op: str, mid, whole) -> None:
    print(f"\nobserve-once: {op}: {len(mid)} call sites back to a lower layer after the first step "
          f"({sum(mid.values())} calls); whole-world reads: {sum(whole.values())}")
    for site, n in sorted(mid.items()):
        print(f"  {n:3d}  {site}")
    for site, n in sorted(whole.items()):
        print(f"  whole {n:3d}  {site}")


def test_install_returns_to_a_lower_layer_at_most_five_times(node):
    doc, mid, whole = trace("install", node, installroot.K)
    assert doc["installed"], doc
    _report("install", mid, whole)
    assert sum(whole.values()) == 1, whole
    assert len(mid) <= LIMIT, "\n".join(f"{n:3d} {s}" for s, n in sorted(mid.items()))


def test_remove_returns_to_a_lower_layer_at_most_five_times(node):
    """The way back too: after the install, ``remove --kernel K`` decides its plan before its first step
    (act/removal.remove_prepare) and reads the host again only through world/refresh (19 call sites before)."""
    trace("install", node, installroot.K)
    doc, mid, whole = trace("remove", node, installroot.K)
    assert [r["ok"] for r in doc["restored"]] == [True], doc
    _report("remove", mid, whole)
    assert sum(whole.values()) == 1, whole
    assert len(mid) <= LIMIT, "\n".join(f"{n:3d} {s}" for s, n in sorted(mid.items()))


def test_reconcile_returns_to_a_lower_layer_at_most_five_times(node):
    """The daemon's and the hooks' door: reconcile plans build-install for the stock node and runs it; the
    build and the install take what was prepared before the step (38 call sites before), DKMS's tree read again
    after the build. Two of the five are the source cache's pruning after the steps (act/source_fetch)."""
    doc, mid, whole = trace("reconcile", node, None)
    assert [(s["action"], s["ok"]) for s in doc["steps"]] == [("build-install", True)], doc["steps"]
    _report("reconcile", mid, whole)
    assert sum(whole.values()) == 1, whole
    assert len(mid) <= LIMIT, "\n".join(f"{n:3d} {s}" for s, n in sorted(mid.items()))


def test_rollback_returns_to_a_lower_layer_at_most_five_times(node):
    """``rollback --kernel K`` after the install: its targets from recovery's world (two whole-world reads on
    main), each kernel's removal planned before its intent (20 call sites on main)."""
    trace("install", node, installroot.K)
    doc, mid, whole = trace("rollback", node, installroot.K, reason="test")
    assert doc["kernels"] == [{"kernel": installroot.K, "ok": True}], doc
    _report("rollback", mid, whole)
    assert sum(whole.values()) == 1, whole
    assert len(mid) <= LIMIT, "\n".join(f"{n:3d} {s}" for s, n in sorted(mid.items()))


def test_build_returns_to_a_lower_layer_at_most_five_times(node):
    """``build --kernel K`` (our build already made: verified, reused): refused or not from recovery's world, its
    engine takes the preparation (20 call sites and two whole-world reads on main)."""
    doc, mid, whole = trace("build", node, installroot.K)
    assert doc["status"] == "already-built" and doc["verification"]["ok"], doc
    _report("build", mid, whole)
    assert sum(whole.values()) == 1, whole
    assert len(mid) <= LIMIT, "\n".join(f"{n:3d} {s}" for s, n in sorted(mid.items()))


# --- the reads that stay: the version match is read fresh after the step, never taken from the preparation ----

NEW = "580.999.01"      # a driver package replaced nvidia.ko (plain dpkg -i, no APT door) while the install ran


def _swap_nvidia(root, tmp) -> str:
    """Shell lines that put a ``NEW`` nvidia.ko where the fixture's is, then the real depmod on the root."""
    ko = installroot.nvidia_ko(tmp / "new" / "nvidia.ko", NEW)
    return (f"cp {ko} {root}/lib/modules/{installroot.K}/kernel/nvidia-580-open/nvidia.ko && "
            f"depmod -b {root} {installroot.K} 2>/dev/null\n")


def test_the_verification_after_dkms_install_reads_the_nvidia_ko_of_now(node, tmp_path):
    """The driver changes under ``dkms install`` (after the install was prepared): the engine's verification
    compares ours with the nvidia.ko that is there NOW, refuses, and leaves the stock nvidia-uvm selected. Taken
    from the preparation, it would have seen the stock selection instead (a refusal for another reason)."""
    from spark_memsaver.errors import MemsaverError
    from spark_memsaver.host import Host
    from spark_memsaver.observe import modules
    wrapper = tmp_path / "dkms"
    wrapper.write_text(wrapper.read_text() + f'[ "$1" = install ] && {_swap_nvidia(node, tmp_path)}')
    with pytest.raises(MemsaverError) as e:
        trace("install", node, installroot.K)
    assert e.value.code == "module-verification-failed" and f"is version {NEW}, not {installroot.DRIVER}" in str(e.value), \
        (e.value.code, str(e.value))
    assert modules.selection(Host(str(node)), installroot.K)["state"] == "stock"


def test_the_executor_checks_the_version_match_fresh_before_it_records_ours(node, tmp_path, monkeypatch):
    """The driver changes after the engine verified ours (here: while the initramfs is refreshed): the executor's
    version-match check (act/steps.ours_matches through world/refresh) reads kmod again and refuses to record
    ours as installed beside another driver's nvidia.ko. Taken from the engine's verification, it would pass."""
    import subprocess
    from spark_memsaver.act import override
    from spark_memsaver.errors import MemsaverError
    from spark_memsaver.host import Host, paths
    swap = _swap_nvidia(node, tmp_path)
    real = override.refresh_initramfs

    def refresh_then_swap(host, kernel):
        out = real(host, kernel)
        subprocess.run(["sh", "-c", swap], check=True)
        return out
    monkeypatch.setattr(override, "refresh_initramfs", refresh_then_swap)
    with pytest.raises(MemsaverError) as e:
        trace("install", node, installroot.K)
    assert e.value.code == "reconcile-step-failed" and str(e.value).endswith(f"not ours for {NEW}"), \
        (e.value.code, str(e.value))
    assert not Host(str(node)).path(f"{paths.BUILDS}/{installroot.K}.json").exists()     # nothing recorded
