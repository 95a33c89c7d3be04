"""Lifecycle: driver-change rollback, the load-time guard, activation, recovery of interrupted operations.

Part 1  pure: reconcile.plan (table), the apt hook protocol, intent/rollback records, and a property:
        no plan ever leaves a patched UVM selected beside a different driver's nvidia.ko.
Part 2  the guard (systemd/guard/uvm-guard) with the real modprobe/modinfo/depmod against module trees,
        and activation refused by real processes holding a real file.
Part 3  (test_lifecycle_e2e.py) end to end in systemd-nspawn with real dpkg/apt/DKMS.

The module files of part 2 are real ELF objects with a real .modinfo section (tests/support/sparkroot.py);
they stand in for NVIDIA's nvidia.ko / nvidia-uvm.ko, whose code cannot run here (no GPU, no module
loading) and whose metadata is all the guard reads.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spark_memsaver import world
from spark_memsaver.host import events, intents
from spark_memsaver.act import activate as act_activate, executor, steps as act_steps
from spark_memsaver.observe import snapshot as observe
from spark_memsaver.decide import plan as rc
from spark_memsaver.config import Config
from spark_memsaver.decide.status import evaluate
from spark_memsaver.host import Host
from spark_memsaver.host import locks
from tests.support import needs, sparkroot
from tests.support.worlds import typed

rc, evaluate = typed(rc), typed(evaluate)   # dict snapshots -> model.World (tests/support/worlds.py)

pytestmark = pytest.mark.lifecycle

REPO = Path(__file__).resolve().parent.parent
GUARD = REPO / "systemd/guard/uvm-guard"
K = "6.14.0-1015-nvidia-64k"
K2 = "6.14.0-1020-nvidia-64k"
SUPPORT = {"550.163.01": {"supported": True}, "555.58.02": {"supported": True},
           "555.58.99": {"supported": False, "reason": "NVIDIA driver 555.58.99 is not in this release's patch "
                                                       "manifest"}}


# ------------------------------------------------------------------------------------------------
# Part 1: pure

def mod(version, patched=False, path=None):
    return {"path": path or f"/lib/modules/{K}/{'updates/dkms' if patched else 'kernel/nv'}/nvidia-uvm.ko",
            "version": version, "srcversion": "OURS" if patched else "STOCK", "patched": patched,
            "signer": "k" if patched else None, "depends": ["nvidia"], "patch_id": "uvm-pt-pack/1" if patched else None}


def kern(rel=K, ours=None, nv="550.163.01", stock=None, headers=True, page=65536, running=True):
    sel = mod(ours, True) if ours else (mod(stock or nv) if nv else None)
    return {"release": rel, "running": running, "page_size": page, "headers": headers,
            "uvm_selected": sel, "nvidia_selected": {"path": "/x/nvidia.ko", "version": nv} if nv else None}


def snap(*kernels, sources=("550.163.01", "555.58.02", "555.58.99"), sb="not-needed", intents_=(), rollbacks=(),
         unreadable=(), uvm=None, loaded_nv=None, holders=()):
    return {
        "host": {"kernel": K, "arch": "aarch64", "page_size": 65536},
        "driver": {"loaded_version": loaded_nv, "sources": [{"version": v, "path": f"/usr/src/nvidia-{v}",
                                                              "open": True} for v in sources]},
        "uvm": uvm or {"loaded": False, "patched": False},
        "kernels": list(kernels) or [kern()],
        "dkms": {"available": True, "registrations": []},
        "secure_boot": {"state": sb},
        "holders": list(holders),
        "records": {"intents": list(intents_), "rollbacks": list(rollbacks), "unreadable": list(unreadable)},
    }


def actions(steps, acting_only=False):
    return [(s.action, s.kernel) for s in steps if not acting_only or s.action in rc.ACTING]


CFG = Config()
CFG_ALL = Config(kernels="all")
CFG_NOAUTO = Config(auto_build=False)

PLAN_CASES = [
    # id, snapshot, config, expected (action, kernel) list, reason fragment of the first step
    ("override-matches", snap(kern(ours="550.163.01")), CFG, [("ok", K)], "selected beside"),
    ("suffix-version-matches", snap(kern(ours="550.163.01-spark1")), CFG, [("ok", K)], ""),
    ("driver-upgrade-supported", snap(kern(ours="550.163.01", nv="555.58.02")), CFG,
     [("remove-override", K), ("build-install", K)], "changed from 550.163.01 to 555.58.02"),
    ("driver-upgrade-unsupported", snap(kern(ours="550.163.01", nv="555.58.99")), CFG,
     [("remove-override", K), ("record-rollback", K)], "changed from 550.163.01 to 555.58.99"),
    ("driver-removed", snap(kern(ours="550.163.01", nv=None)), CFG,
     [("remove-override", K), ("record-rollback", K)], "no nvidia.ko"),
    ("driver-downgrade", snap(kern(ours="555.58.02", nv="550.163.01")), CFG,
     [("remove-override", K), ("build-install", K)], "changed from 555.58.02 to 550.163.01"),
    ("unreadable-override-version", snap(kern(ours="garbage?", nv="550.163.01")), CFG,
     [("remove-override", K), ("build-install", K)], "changed from garbage?"),
    ("fresh-supported", snap(kern()), CFG, [("build-install", K)], "no build"),
    ("headers-missing", snap(kern(headers=False)), CFG, [("stay-stock", K)], "headers"),
    ("outside-policy-4k", snap(kern(page=4096)), CFG, [("stay-stock", K)], "64k-only"),
    ("policy-all-4k", snap(kern(page=4096)), CFG_ALL, [("build-install", K)], ""),
    ("auto-build-off", snap(kern()), CFG_NOAUTO, [("stay-stock", K)], "auto_build"),
    ("upgrade-auto-build-off", snap(kern(ours="550.163.01", nv="555.58.02")), CFG_NOAUTO,
     [("remove-override", K), ("record-rollback", K)], ""),
    ("sb-unknown-no-build", snap(kern(), sb="unknown"), CFG, [("stay-stock", K)], "Secure Boot"),
    ("sb-unknown-still-removes", snap(kern(ours="550.163.01", nv="555.58.02"), sb="unknown"), CFG,
     [("remove-override", K), ("record-rollback", K)], ""),
    ("sb-enrolled-builds", snap(kern(), sb="enrolled"), CFG, [("build-install", K)], ""),
    ("sb-key-not-enrolled", snap(kern(), sb="not-enrolled"), CFG, [("stay-stock", K)], "Secure Boot"),
    ("source-missing", snap(kern(ours="550.163.01", nv="555.58.02"), sources=("550.163.01",)), CFG,
     [("remove-override", K), ("record-rollback", K)], ""),
    ("no-nvidia-no-build", snap(kern(nv=None)), CFG, [("stay-stock", K)], "no nvidia.ko"),
    ("failed-before-no-retry", snap(kern(nv="555.58.02"), rollbacks=[{"kernel": K, "time": "2026-01-01T00:00:00Z",
                                                                       "code": "build-failed",
                                                                       "driver_to": "555.58.02",
                                                                       "reason": "make failed"}]), CFG,
     [("stay-stock", K)], "last build"),
    ("failed-for-other-driver-retries", snap(kern(nv="555.58.02"), rollbacks=[
        {"kernel": K, "time": "t", "code": "build-failed", "driver_to": "550.163.01", "reason": "x"}]), CFG,
     [("build-install", K)], ""),
    ("after-prehook-unsupported-says-why", snap(kern(nv="555.58.99"), rollbacks=[
        {"kernel": K, "time": "t", "code": "driver-changing", "driver_from": "550.163.01", "driver_to": "555.58.99",
         "reason": "APT is about to change the NVIDIA driver"}]), CFG,
     [("record-rollback", K)], "changed from 550.163.01 to 555.58.99; NVIDIA driver 555.58.99 is not in"),
    ("rollback-reason-current-is-fixed-point", snap(kern(nv="555.58.99"), rollbacks=[
        {"kernel": K, "time": "t", "code": "driver-unsupported", "driver_from": "550.163.01",
         "reason": "NVIDIA driver changed from 550.163.01 to 555.58.99; "
                   "NVIDIA driver 555.58.99 is not in this release's patch manifest"}]), CFG, [("stay-stock", K)], ""),
    ("after-prehook-supported-rebuilds", snap(kern(nv="555.58.02"), rollbacks=[
        {"kernel": K, "time": "t", "code": "driver-changing", "driver_from": "550.163.01", "reason": "x"}]), CFG,
     [("build-install", K)], ""),
    ("back-clears-rollback", snap(kern(ours="555.58.02", nv="555.58.02"), rollbacks=[
        {"kernel": K, "time": "t", "code": "driver-unsupported", "reason": "x"}]), CFG,
     [("clear-rollback", K), ("ok", K)], ""),
    ("new-kernel-headers-later", snap(kern(ours="550.163.01"), kern(K2, running=False)), CFG,
     [("build-install", K2), ("ok", K)], ""),
    ("new-kernel-without-headers", snap(kern(ours="550.163.01"), kern(K2, running=False, headers=False)), CFG,
     [("ok", K), ("stay-stock", K2)], ""),
    ("two-kernels-upgrade-order", snap(kern(ours="550.163.01", nv="555.58.02"),
                                       kern(K2, ours="550.163.01", nv="555.58.02", running=False)), CFG,
     [("remove-override", K), ("remove-override", K2), ("build-install", K), ("build-install", K2)], ""),
    ("mixed-kernels", snap(kern(ours="550.163.01", nv="555.58.99"), kern(K2, ours="550.163.01", running=False)),
     CFG, [("remove-override", K), ("record-rollback", K), ("ok", K2)], ""),
    ("modinfo-error", snap({**kern(), "uvm_selected": {"path": None, "error": "modinfo hung"}}), CFG,
     [("stay-stock", K)], "cannot read"),
    # interrupted operations
    ("interrupted-build", snap(kern(), intents_=[{"id": f"build-{K}", "op": "build", "kernel": K, "pid": 999999,
                                                  "started": "t"}]), CFG,
     [("undo-intent", K), ("build-install", K)], "interrupted 'build'"),
    ("interrupted-install-complete", snap(kern(ours="550.163.01"), intents_=[
        {"id": f"install-{K}", "op": "install", "kernel": K, "pid": 999999, "started": "t"}]), CFG,
     [("clear-intent", K), ("ok", K)], "had completed"),
    ("interrupted-install-half", snap(kern(ours="550.163.01", nv="555.58.02"), intents_=[
        {"id": f"install-{K}", "op": "install", "kernel": K, "pid": 999999, "started": "t"}]), CFG,
     [("undo-intent", K), ("build-install", K)], "interrupted 'install'"),
    ("interrupted-remove", snap(kern(ours="550.163.01", nv="555.58.99"), intents_=[
        {"id": f"remove-{K}", "op": "remove", "kernel": K, "pid": 999999, "started": "t",
         "driver_from": "550.163.01", "driver_to": "555.58.99"}]), CFG,
     [("finish-intent", K), ("record-rollback", K)], "interrupted 'remove'"),
    ("interrupted-rollback", snap(kern(), intents_=[{"id": f"rollback-{K}", "op": "rollback", "kernel": K,
                                                     "pid": 999999, "started": "t"}]), CFG,
     [("finish-intent", K), ("build-install", K)], ""),
    ("interrupted-register", snap(kern(), intents_=[{"id": "register-all", "op": "register", "kernel": None,
                                                     "pid": 999999, "started": "t"}]), CFG,
     [("undo-intent", None), ("build-install", K)], ""),
    ("interrupted-activate", snap(kern(ours="550.163.01"), intents_=[
        {"id": f"activate-{K}", "op": "activate", "kernel": K, "pid": 999999, "started": "t"}]), CFG,
     [("reload-uvm", K), ("ok", K)], ""),
    ("operation-still-running", snap(kern(ours="550.163.01", nv="555.58.02"), intents_=[
        {"id": f"build-{K}", "op": "build", "kernel": K, "pid": 4242, "started": "t"}]), CFG,
     [("blocked", K)], "still running"),
    ("unreadable-record", snap(kern(ours="550.163.01"), unreadable=["/var/lib/spark-memsaver/intents/x.json"]), CFG,
     [("drop-record", None), ("ok", K)], "not valid JSON"),
    # loaded state
    ("loaded-mismatch-no-users", snap(kern(ours="555.58.02", nv="555.58.02"), loaded_nv="550.163.01",
                                      uvm={"loaded": True, "patched": True, "version": "555.58.02"}), CFG,
     [("reload-uvm", None), ("ok", K)], ""),
    ("loaded-mismatch-in-use", snap(kern(ours="555.58.02", nv="555.58.02"), loaded_nv="550.163.01",
                                    uvm={"loaded": True, "patched": True, "version": "555.58.02"},
                                    holders=[{"pid": 7, "comm": "vllm"}]), CFG,
     [("ok", K), ("blocked", None)], ""),
    ("loaded-match-fine", snap(kern(ours="550.163.01"), loaded_nv="550.163.01",
                               uvm={"loaded": True, "patched": True, "version": "550.163.01"}), CFG, [("ok", K)], ""),
]


@pytest.mark.parametrize("name,s,cfg,expected,fragment", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_plan_table(name, s, cfg, expected, fragment):
    steps = rc.plan(s, cfg, SUPPORT, alive_pids={4242})
    assert actions(steps) == expected, [x.to_dict() for x in steps]
    if fragment:
        assert fragment in steps[0].reason, steps[0].reason
    for st in steps:
        assert st.reason, st  # every step explains itself
        if st.action == "build-install":
            k = next(k for k in s["kernels"] if k["release"] == st.kernel)
            assert st.driver_to == rc.base_version(k["nvidia_selected"]["version"])
            assert SUPPORT[st.driver_to]["supported"]
        if st.action == "record-rollback":
            assert st.remedy and st.code


def test_plan_rollback_reason_names_the_manifest():
    steps = rc.plan(snap(kern(ours="550.163.01", nv="555.58.99")), CFG, SUPPORT)
    rec = [s for s in steps if s.action == "record-rollback"][0]
    assert rec.code == "driver-unsupported"
    assert "555.58.99" in rec.reason and "manifest" in rec.reason
    assert "Nothing is broken" in rec.remedy


def test_plan_kernel_filter_and_no_rebuild():
    s = snap(kern(ours="550.163.01", nv="555.58.02"), kern(K2, ours="550.163.01", nv="555.58.02", running=False))
    assert actions(rc.plan(s, CFG, SUPPORT, kernels=[K2])) == [("remove-override", K2), ("build-install", K2)]
    assert actions(rc.plan(s, CFG, SUPPORT, rebuild=False), True) == [
        ("remove-override", K), ("remove-override", K2), ("record-rollback", K), ("record-rollback", K2)]


def test_unknown_version_is_unsupported_when_absent_from_support():
    steps = rc.plan(snap(kern(ours="550.163.01", nv="560.1.2")), CFG, SUPPORT)
    assert actions(steps) == [("remove-override", K), ("record-rollback", K)]
    assert "not in the patch manifest" in steps[1].reason


def test_base_version_and_deb_versions():
    assert rc.base_version("550.163.01-spark1") == "550.163.01"
    assert rc.base_version(" 580.142\n") == "580.142"
    assert rc.base_version(None) is None and rc.base_version("") is None
    assert rc.upstream_of_deb("1:555.58.02-1") == "555.58.02"
    assert rc.upstream_of_deb("580.142-0ubuntu0.24.04.1") == "580.142"
    assert rc.upstream_of_deb("550.163.01-4~bpo12+1") == "550.163.01"
    assert rc.upstream_of_deb("6.8.0-1010.10") is None          # a kernel-flavoured version names no driver
    assert rc.upstream_of_deb("-") is None


# --- the property that matters: simulate executing any plan -------------------------------------

def _simulate(s, steps):
    """Apply a plan's acting steps to the snapshot's kernels the way lifecycle does on success."""
    s = copy.deepcopy(s)
    by = {k["release"]: k for k in s["kernels"]}
    for st in steps:
        if st.action in ("remove-override", "undo-intent", "finish-intent") and st.kernel in by:
            k = by[st.kernel]
            nv = (k.get("nvidia_selected") or {}).get("version")
            k["uvm_selected"] = mod(nv) if nv else None
        if st.action == "build-install":
            by[st.kernel]["uvm_selected"] = mod(st.driver_to, True)
    return s


def _unsafe(s):
    bad = []
    for k in s["kernels"]:
        sel, nv = k.get("uvm_selected") or {}, (k.get("nvidia_selected") or {}).get("version")
        if sel.get("patched") and rc.base_version(sel.get("version")) != rc.base_version(nv):
            bad.append(k["release"])
    return bad


def test_property_no_plan_leaves_a_mismatch():
    import hypothesis as hyp
    st = hyp.strategies
    versions = st.sampled_from(["550.163.01", "555.58.02", "555.58.99", "560.1.2", None])

    @st.composite
    def kernels(draw):
        out = []
        for i in range(draw(st.integers(1, 3))):
            nv = draw(versions)
            ours = draw(st.sampled_from([None, "550.163.01", "555.58.02", "555.58.99-x"]))
            out.append(kern(f"6.14.0-{1000 + i}-nvidia-64k", ours=ours, nv=nv, headers=draw(st.booleans()),
                            page=draw(st.sampled_from([4096, 65536])), running=i == 0))
        return out

    @hyp.settings(max_examples=400, deadline=None)
    @hyp.given(kernels(), st.sampled_from(["not-needed", "enrolled", "unknown", "not-enrolled"]),
               st.sampled_from([CFG, CFG_ALL, CFG_NOAUTO]),
               st.lists(st.sampled_from(["550.163.01", "555.58.02", "555.58.99"]), unique=True))
    def check(ks, sb, cfg, srcs):
        s = snap(*ks, sources=tuple(srcs), sb=sb)
        steps = rc.plan(s, cfg, SUPPORT)
        after = _simulate(s, steps)
        assert _unsafe(after) == []
        # and the plan is a fixed point once executed: nothing acting remains (except rollback bookkeeping)
        again = rc.plan(after, cfg, SUPPORT)
        assert [x for x in again if x.action in ("remove-override", "build-install")] == [], again

    check()


# --- APT Pre-Install-Pkgs protocol -----------------------------------------------------------------

V3 = """VERSION 3
APT::Architecture=amd64
DPkg::Tools::Options::/usr/lib/spark-memsaver/apt-pre-install::Version=3
Dir=/

nvidia-kernel-source-sparktest 550.163.01-1 amd64 none < 555.58.02-1 amd64 none /var/cache/apt/archives/nvidia-kernel-source-sparktest_555.58.02-1_amd64.deb
libfoo1 - - none < 1.2-3 amd64 same /var/cache/apt/archives/libfoo1_1.2-3_amd64.deb
nvidia-kernel-source-sparktest 550.163.01-1 amd64 none < 555.58.02-1 amd64 none **CONFIGURE**
"""


def test_parse_apt_v3_and_driver_changes():
    acts = rc.parse_apt_hook(V3)
    assert [a["name"] for a in acts] == ["nvidia-kernel-source-sparktest", "libfoo1", "nvidia-kernel-source-sparktest"]
    assert acts[0]["old"] == "550.163.01-1" and acts[0]["new"] == "555.58.02-1"
    assert acts[1]["old"] is None
    ch = rc.driver_changes(acts)
    assert len(ch) == 1 and ch[0]["new_driver"] == "555.58.02"


def test_parse_apt_v3_as_apt_sends_it():
    # captured from apt 2.6.1 (Debian 12) in a container: DPkg::Tools::Options::tee::Version "3"
    real = ("VERSION 3\nCommandLine::AsString=apt-get%20install%20-y%20/root/dummy_2.0-1_all.deb\n\n"
            "nvidia-kernel-source-dummy 1.0-1 all none < 2.0-1 all none /root/dummy_2.0-1_all.deb\n"
            "nvidia-kernel-source-dummy 1.0-1 all none < 2.0-1 all none **CONFIGURE**\n")
    acts = rc.parse_apt_hook(real)
    assert [(a["name"], a["old"], a["new"], a["action"]) for a in acts] == [
        ("nvidia-kernel-source-dummy", "1.0-1", "2.0-1", "/root/dummy_2.0-1_all.deb"),
        ("nvidia-kernel-source-dummy", "1.0-1", "2.0-1", "**CONFIGURE**")]
    assert [c["new_driver"] for c in rc.driver_changes(acts)] == [None]   # "2.0" names no driver: acts as change


def test_parse_apt_v2_v1_remove_and_bad_input():
    v2 = "VERSION 2\nA=b\n\nnvidia-driver-580-open 580.95.05-0ubuntu1 < 580.142-0ubuntu1 /x/n.deb\n" \
         "nvidia-dkms-580-open 580.95.05-0ubuntu1 < - **REMOVE**\n"
    ch = rc.driver_changes(rc.parse_apt_hook(v2))
    assert [(c["name"], c["new_driver"]) for c in ch] == [("nvidia-driver-580-open", "580.142"),
                                                          ("nvidia-dkms-580-open", None)]
    v1 = "/var/cache/apt/archives/nvidia-kernel-source-580-open_580.142-0ubuntu1_arm64.deb\n"
    assert rc.driver_changes(rc.parse_apt_hook(v1))[0]["new_driver"] == "580.142"
    with pytest.raises(rc.HookInputError):
        rc.parse_apt_hook("VERSION 3\n\nshort line here\n")
    with pytest.raises(rc.HookInputError):
        rc.parse_apt_hook("VERSION 9\n\n")
    assert rc.parse_apt_hook("") == []
    # packages that are not the NVIDIA kernel driver never count
    other = "VERSION 3\n\nnvidia-settings 1 amd64 none < 2 amd64 none /x.deb\nlinux-image-6.1 1 a n < 2 a n /y.deb\n"
    assert rc.driver_changes(rc.parse_apt_hook(other)) == []


def test_apt_doors_never_abort_apt(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    # garbage on the hook's stdin: a clear message, exit 0 (APT goes on; later doors and the guard remain)
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(tmp_path), "reconcile",
                        "--apt-pre-install"], input="VERSION 9\n\nx\n", capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert "unsupported APT hook protocol" in r.stderr
    # the configured command with our program missing (package removed, conffile kept): APT still succeeds
    conf = (REPO / "systemd/apt/90spark-memsaver").read_text()
    cmd = conf.split('DPkg::Pre-Install-Pkgs { "', 1)[1].split('"', 1)[0]
    assert cmd.split()[0] in conf.split("DPkg::Tools::Options::", 1)[1]   # the v3 option names the program
    gone = cmd.replace("/usr/lib/spark-memsaver/apt-pre-install", str(tmp_path / "absent"))
    r = subprocess.run(["sh", "-c", gone], input=V3 * 200, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    # the hook script itself drains its input and exits 0 whatever happens
    r = subprocess.run(["sh", str(REPO / "systemd/apt/apt-pre-install")], input=V3 * 200, capture_output=True,
                       text=True, timeout=60, env=dict(env, PATH="/usr/bin:/bin"))
    assert r.returncode == 0


@pytest.mark.parametrize("names", ["nvidia-kernel-source-580-open", "nvidia-dkms-580-open", "nvidia-open-kernel-dkms",
                                   "nvidia-kernel-open-dkms", "linux-modules-nvidia-580-open-6.17.0-1014-nvidia",
                                   "linux-objects-nvidia-580-open-6.14.0-1011-oracle", "nvidia-driver-580-open",
                                   "nvidia-kernel-common-580", "nvidia-kernel-source-sparktest"])
def test_driver_package_names(names):
    assert rc.DRIVER_PACKAGE_RE.match(names)


def test_pre_install_plan():
    s = snap(kern(ours="550.163.01"), kern(K2, ours="555.58.02", nv="555.58.02", running=False), kern("6.1.0-x"))
    ch = rc.driver_changes(rc.parse_apt_hook(V3))
    steps = rc.pre_install_plan(s, ch)
    assert actions(steps) == [("remove-override", K)]          # K2 is already built for 555.58.02
    assert "550.163.01 to 555.58.02" in steps[0].reason
    rm = rc.driver_changes([{"name": "nvidia-kernel-source-sparktest", "old": "1", "new": None,
                             "action": "**REMOVE**"}])
    assert actions(rc.pre_install_plan(s, rm)) == [("remove-override", K), ("remove-override", K2)]
    assert rc.pre_install_plan(s, []) == []


# --- intent and rollback records -------------------------------------------------------------------

def test_intent_lifecycle_and_atomicity(tmp_path):
    h = Host(tmp_path)
    with intents.intent(h, "build", K, driver_version="555.58.02") as rec:
        on_disk = json.loads((tmp_path / f"var/lib/spark-memsaver/intents/build-{K}.json").read_text())
        assert on_disk["op"] == "build" and on_disk["kernel"] == K and on_disk["pid"] == os.getpid()
        assert on_disk["driver_version"] == "555.58.02" and on_disk["started"].endswith("Z")
        assert rec["id"] == f"build-{K}"
    assert intents.list_intents(h) == ([], [])
    with pytest.raises(RuntimeError):
        with intents.intent(h, "install", K):
            raise RuntimeError("power cut")
    left, bad = intents.list_intents(h)
    assert [(r["op"], r["phase"]) for r in left] == [("install", "failed")] and "power cut" in left[0]["error"]
    # no temporary files are left behind by the atomic writes
    assert [p.name for p in (tmp_path / "var/lib/spark-memsaver/intents").iterdir()] == [f"install-{K}.json"]
    with pytest.raises(ValueError):
        intents.write_intent(h, "format-disk", K)


def test_records_are_what_observe_and_decide_read(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "root", loaded_driver="580.142", uvm_loaded="stock")
    h = Host(root)
    intents.write_intent(h, "build", sparkroot.SPARK_KERNEL, driver_version="580.142")
    intents.write_rollback(h, sparkroot.SPARK_KERNEL, "NVIDIA driver changed from 580.95.05 to 590.1",
                           remedy="Update spark-memsaver.", code="driver-unsupported")
    recs = observe.observe_records(h)
    assert recs["intents"][0]["op"] == "build" and recs["intents"][0]["kernel"] == sparkroot.SPARK_KERNEL
    v = evaluate(world.snapshot(h), Config())
    codes = {f.code: f for f in v.findings}
    assert "operation-interrupted" in codes and codes["operation-interrupted"].kernel == sparkroot.SPARK_KERNEL
    assert v.state == "rolled-back"
    assert "580.95.05 to 590.1" in codes["rolled-back"].message
    assert codes["rolled-back"].remedy == "Update spark-memsaver."
    assert intents.clear_rollback(h, sparkroot.SPARK_KERNEL) and not intents.clear_rollback(h, sparkroot.SPARK_KERNEL)
    hist = events.read(h)               # the one lifecycle log (host/events.py)
    assert [e["op"] for e in hist] == ["rolled-back", "rollback-cleared"]
    assert hist[0]["code"] == "driver-unsupported" and hist[1]["kernel"] == sparkroot.SPARK_KERNEL


def test_corrupt_record_is_set_aside_not_trusted(tmp_path):
    h = Host(tmp_path)
    d = tmp_path / "var/lib/spark-memsaver/intents"
    d.mkdir(parents=True)
    (d / "build-x.json").write_text('{"op": "build", "kern')     # torn by a crash of an older writer
    good, bad = intents.list_intents(h)
    assert good == [] and bad == ["/var/lib/spark-memsaver/intents/build-x.json"]
    steps = rc.plan(snap(kern(ours="550.163.01"), unreadable=bad), CFG, SUPPORT)
    act_steps.execute(h, CFG, [s for s in steps if s.action == "drop-record"], {})
    assert not (d / "build-x.json").exists() and len(list(d.glob("build-x.json.bad-*"))) == 1   # one quarantine
    assert intents.list_intents(h) == ([], [])


def test_lock_serializes_processes(tmp_path):
    h = Host(tmp_path)
    code = ("import sys,time; sys.path.insert(0,%r); from spark_memsaver.act import executor; from spark_memsaver.host "
            "import Host\nwith executor.locked(Host(%r)):\n    print('held', flush=True); time.sleep(3)"
            % (str(REPO / "daemon"), str(tmp_path)))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    from spark_memsaver.errors import Busy
    with pytest.raises(Busy):
        with executor.locked(h, wait=0.5):
            pass
    t0 = time.monotonic()
    with executor.locked(h, wait=30):
        waited = time.monotonic() - t0
    p.wait(10)
    assert waited > 0.5


def test_dpkg_lock_is_seen_without_taking_it(tmp_path):
    lock = tmp_path / "var/lib/dpkg/lock-frontend"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    h = Host(tmp_path)
    assert locks.dpkg_running(h) is None
    code = ("import fcntl,os,time,sys; fd=os.open(%r, os.O_RDWR); fcntl.lockf(fd, fcntl.LOCK_EX); "
            "print('locked', flush=True); time.sleep(30)" % str(lock))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"       # dpkg takes its locks with fcntl(F_SETLK)
        assert locks.dpkg_running(h) == p.pid
        assert locks.dpkg_running(h) == p.pid            # asking twice: we never took the lock
    finally:
        p.kill()
        p.wait()
    assert locks.dpkg_running(h) is None


# ------------------------------------------------------------------------------------------------
# Part 2: the guard with real modprobe/modinfo/depmod, activation with real holders

def _tree(root: Path, *, nv="555.58.02", stock_uvm="555.58.02", ours="550.163.01", stock_dir="kernel/nvidia-open",
          kernel=K, options="", extra=()):
    """A module tree as a driver package + spark-memsaver leave it, with depmod's real selection."""
    m = root / f"lib/modules/{kernel}"
    if nv:
        sparkroot.make_module(m / stock_dir / "nvidia.ko", [("version", nv), ("license", "Dual MIT/GPL"),
                                                            ("name", "nvidia"), ("vermagic", f"{kernel} SMP")])
    if stock_uvm:
        sparkroot.make_module(m / stock_dir / "nvidia-uvm.ko", sparkroot.uvm_fields(stock_uvm, "STOCK", kernel, False))
    if ours:
        sparkroot.make_module(m / "updates/dkms/nvidia-uvm.ko", sparkroot.uvm_fields(ours, "OURS", kernel, True))
    for rel, fields in extra:
        sparkroot.make_module(m / rel, fields)
    conf = root / "etc/modprobe.d"
    conf.mkdir(parents=True, exist_ok=True)
    rule = (REPO / "systemd/modprobe.d/spark-memsaver.conf").read_text().replace(
        "/usr/lib/spark-memsaver/uvm-guard", str(GUARD))
    (conf / "spark-memsaver.conf").write_text(rule + options)
    subprocess.run(["depmod", "-b", str(root), kernel], check=True, capture_output=True)
    return root


def guard(root: Path, *args, kernel=K, shell="dash", env=None):
    e = dict(os.environ, SPARK_MEMSAVER_GUARD_KVER=kernel, SPARK_MEMSAVER_GUARD_MODDIR=str(root),
             SPARK_MEMSAVER_GUARD_ROOT=str(root), SPARK_MEMSAVER_GUARD_DRYRUN="1",
             SPARK_MEMSAVER_GUARD_CONFIG=str(root / "etc/modprobe.d"))
    e.update(env or {})
    return subprocess.run([shell, str(GUARD), *args], capture_output=True, text=True, env=e, timeout=30)


def inserted(r) -> list[str]:
    """The files a (dry-run) load inserts, from modprobe --show-depends / the guard's insmod line."""
    return [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("insmod ")]


def p(root, rel, kernel=K):
    return str(root / f"lib/modules/{kernel}" / rel)


def guard_log(root):
    f = root / "run/spark-memsaver/guard.log"
    return f.read_text() if f.exists() else ""


def test_rule_is_what_modprobe_runs_for_both_spellings(tmp_path):
    root = _tree(tmp_path)
    for name in ("nvidia_uvm", "nvidia-uvm"):
        r = subprocess.run(["modprobe", "-d", str(root), "-S", K, "-C", str(root / "etc/modprobe.d"),
                            "--show-depends", name, "uvm_perf_prefetch_enable=0"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"install {GUARD} $CMDLINE_OPTS uvm_perf_prefetch_enable=0"


def test_guard_mismatch_loads_stock_by_path_and_says_why(tmp_path):
    root = _tree(tmp_path, nv="555.58.02", ours="550.163.01")
    r = guard(root, "uvm_perf_prefetch_enable=0")
    assert r.returncode == 0, r.stderr
    assert inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")]
    assert r.stdout.split()[-1] == "uvm_perf_prefetch_enable=0"
    assert "is for driver 550.163.01" in r.stderr and "555.58.02" in r.stderr
    assert "loading the stock module" in guard_log(root)


def test_guard_match_loads_ours_through_modprobe_without_recursion(tmp_path):
    root = _tree(tmp_path, nv="550.163.01", stock_uvm="550.163.01", ours="550.163.01")
    r = guard(root)
    assert r.returncode == 0, r.stderr
    # --ignore-install: modprobe inserts the selected file instead of running the rule again
    assert inserted(r) == [p(root, "updates/dkms/nvidia-uvm.ko")]
    assert "install " not in r.stdout
    assert guard_log(root) == ""


def test_guard_suffixed_module_version_matches(tmp_path):
    root = _tree(tmp_path, nv="550.163.01", stock_uvm="550.163.01", ours="550.163.01-spark1")
    assert inserted(guard(root)) == [p(root, "updates/dkms/nvidia-uvm.ko")]


def test_guard_loaded_nvidia_wins_over_disk(tmp_path):
    # Driver upgraded on disk to 555 but 550 still loaded (no reboot yet): ours (550) matches what is loaded.
    root = _tree(tmp_path, nv="555.58.02", ours="550.163.01")
    sparkroot.write(root, "/sys/module/nvidia/version", "550.163.01\n")
    assert inserted(guard(root)) == [p(root, "updates/dkms/nvidia-uvm.ko")]
    # and the reverse: ours rebuilt for 555 on disk, 550 still loaded -> stock 555? no: stock must match 550
    root2 = _tree(tmp_path / "b", nv="555.58.02", stock_uvm="555.58.02", ours="555.58.02")
    sparkroot.write(root2, "/sys/module/nvidia/version", "550.163.01\n")
    r = guard(root2)
    assert r.returncode == 1 and inserted(r) == []
    assert "REFUSED" in r.stderr and "no verified stock nvidia-uvm for 550.163.01" in r.stderr


def test_guard_stock_selected_is_plain_modprobe(tmp_path):
    root = _tree(tmp_path, ours=None)
    r = guard(root)
    assert r.returncode == 0 and inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")]
    assert guard_log(root) == ""


def test_guard_refuses_when_no_verified_stock_exists(tmp_path):
    root = _tree(tmp_path, nv="555.58.02", stock_uvm=None, ours="550.163.01")
    r = guard(root)
    assert r.returncode == 1 and inserted(r) == []
    assert "REFUSED" in guard_log(root)


def test_guard_never_takes_a_patched_or_wrong_version_file_as_stock(tmp_path):
    # the stock record points at a patched copy; another dir holds a stock uvm of the wrong driver
    root = _tree(tmp_path, nv="555.58.02", stock_uvm=None, ours="550.163.01",
                 extra=[("extra/nvidia-uvm.ko", sparkroot.uvm_fields("555.58.02", "X", K, True)),
                        ("kernel/old/nvidia-uvm.ko", sparkroot.uvm_fields("550.163.01", "Y", K, False))])
    sparkroot.write(root, f"/var/lib/spark-memsaver/stock/{K}", f"/lib/modules/{K}/extra/nvidia-uvm.ko\n")
    r = guard(root)
    assert r.returncode == 1 and inserted(r) == [], r.stdout


def test_guard_uses_recorded_stock_path(tmp_path):
    # stock in a directory apart from nvidia.ko (e.g. a DKMS-built driver): found through the record
    root = _tree(tmp_path, nv="555.58.02", stock_uvm=None, ours="550.163.01",
                 extra=[("updates/vendor/nvidia-uvm.ko", sparkroot.uvm_fields("555.58.02", "S", K, False))])
    sparkroot.write(root, f"/var/lib/spark-memsaver/stock/{K}", f"/lib/modules/{K}/updates/vendor/nvidia-uvm.ko\n")
    assert inserted(guard(root)) == [p(root, "updates/vendor/nvidia-uvm.ko")]


def test_guard_uses_dkms_stock_record(tmp_path):
    root = _tree(tmp_path, nv="555.58.02", stock_uvm=None, ours="550.163.01",
                 extra=[("updates/vendor/nvidia-uvm.ko", sparkroot.uvm_fields("555.58.02", "S", K, False))])
    sparkroot.write(root, f"/var/lib/spark-memsaver/dkms/{K}.json",
                    json.dumps({"kernel": K, "stock_path": f"/lib/modules/{K}/updates/vendor/nvidia-uvm.ko",
                                "stock_sha256": "x"}, indent=2))
    assert inserted(guard(root)) == [p(root, "updates/vendor/nvidia-uvm.ko")]


def test_guard_no_nvidia_at_all(tmp_path):
    root = _tree(tmp_path, nv=None, stock_uvm=None, ours="550.163.01")
    r = guard(root)
    assert r.returncode == 1 and inserted(r) == []
    assert "cannot be read" in r.stderr


def test_guard_carries_modprobe_d_options_to_insmod(tmp_path):
    root = _tree(tmp_path, options="options nvidia_uvm uvm_disable_hmm=1\n")
    r = guard(root, "uvm_perf_prefetch_enable=0")
    assert r.stdout.strip().endswith("uvm_disable_hmm=1 uvm_perf_prefetch_enable=0"), r.stdout


def test_real_modprobe_runs_the_guard(tmp_path):
    # modprobe itself (not --dry-run) executes the install rule; the guard's DRYRUN only stops the final insert.
    root = _tree(tmp_path, nv="555.58.02", ours="550.163.01")
    e = dict(os.environ, SPARK_MEMSAVER_GUARD_KVER=K, SPARK_MEMSAVER_GUARD_MODDIR=str(root),
             SPARK_MEMSAVER_GUARD_ROOT=str(root), SPARK_MEMSAVER_GUARD_DRYRUN="1",
             SPARK_MEMSAVER_GUARD_CONFIG=str(root / "etc/modprobe.d"))
    r = subprocess.run(["modprobe", "-d", str(root), "-S", K, "-C", str(root / "etc/modprobe.d"), "nvidia-uvm",
                        "a=1"], capture_output=True, text=True, env=e, timeout=30)
    assert r.returncode == 0, r.stderr
    assert inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")] and r.stdout.split()[-1] == "a=1"
    assert "loading the stock module" in guard_log(root)


@pytest.mark.parametrize("shell", ["dash", "bash", "busybox"])
def test_guard_is_posix_sh(tmp_path, shell):
    needs.require(shell, remedy="tools/deps/lifecycle.txt")
    argv = ["busybox", "sh"] if shell == "busybox" else [shell]
    root = _tree(tmp_path, nv="555.58.02", ours="550.163.01")
    e = dict(os.environ, SPARK_MEMSAVER_GUARD_KVER=K, SPARK_MEMSAVER_GUARD_MODDIR=str(root),
             SPARK_MEMSAVER_GUARD_ROOT=str(root), SPARK_MEMSAVER_GUARD_DRYRUN="1",
             SPARK_MEMSAVER_GUARD_CONFIG=str(root / "etc/modprobe.d"))
    r = subprocess.run(argv + [str(GUARD)], capture_output=True, text=True, env=e, timeout=30)
    assert inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")], r.stderr
    if shell == "dash":
        n = subprocess.run(["dash", "-n", str(GUARD)])
        assert n.returncode == 0


def test_guard_with_the_snapshot_observer_agrees(tmp_path):
    # What the guard refuses, decide.py reports as override-driver-mismatch for the same tree.
    root = sparkroot.make_spark_root(tmp_path / "root", loaded_driver=None, uvm_loaded=None,
                                     ours_installed="580.95.05")
    v = evaluate(world.snapshot(Host(root)), Config())
    assert "override-driver-mismatch" in [f.code for f in v.findings]
    r = guard(root, kernel=sparkroot.SPARK_KERNEL)
    assert inserted(r) == [str(root / f"lib/modules/{sparkroot.SPARK_KERNEL}/kernel/nvidia-580-open/nvidia-uvm.ko")]


# --- activation ------------------------------------------------------------------------------------

@pytest.fixture
def holders_file(tmp_path):
    dev = tmp_path / "nvidia-uvm"
    dev.write_bytes(b"")
    procs = [subprocess.Popen(["/usr/bin/python3", "-c", f"import time; f=open({str(dev)!r}); time.sleep(60)"])
             for _ in range(2)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if len(observe.uvm_holders(Host("/"), str(dev))) == 2:
            break
        time.sleep(0.05)
    yield dev, procs
    for pr in procs:
        pr.kill()
        pr.wait()


def test_activation_refused_while_real_processes_hold_the_device(tmp_path, holders_file):
    dev, procs = holders_file
    root = sparkroot.make_spark_root(tmp_path / "root", uvm_loaded="stock", ours_installed="580.142")
    doc = executor.perform("activate", Host(root), CFG, uvm_device=str(dev), proc_host=Host("/"))
    assert doc["activated"] is False and doc["at_next_boot"] is True
    assert sorted(h["pid"] for h in doc["holders"]) == sorted(pr.pid for pr in procs)
    assert "next boot" in doc["message"] and "python3" in doc["message"]
    for pr in procs:
        pr.kill()
        pr.wait()
    doc = executor.perform("activate", Host(root), CFG, uvm_device=str(dev), proc_host=Host("/"))
    assert doc["would_run"] == [["modprobe", "-r", "nvidia_uvm"], ["modprobe", "nvidia_uvm"]]
    assert doc["expect_srcversion"] == sparkroot.OURS_UVM_SRCVERSION
    assert not any("-f" in c or "--force" in c for cmd in doc["would_run"] for c in cmd)


def test_activation_refusals(tmp_path):
    from spark_memsaver.errors import SafetyRefusal
    stock = sparkroot.make_spark_root(tmp_path / "a", uvm_loaded="stock")
    with pytest.raises(SafetyRefusal, match="not selected"):
        executor.perform("activate", Host(stock), CFG)
    other = sparkroot.make_spark_root(tmp_path / "b", loaded_driver="580.95.05", uvm_loaded="stock",
                                      ours_installed="580.142")
    with pytest.raises(act_activate.ActivationRefused, match="loaded nvidia is 580.95.05"):
        executor.perform("activate", Host(other), CFG)
    active = sparkroot.make_spark_root(tmp_path / "c", uvm_loaded="ours", ours_installed="580.142")
    assert executor.perform("activate", Host(active), CFG)["already"] is True


def test_activation_mismatch_remedy_never_reboots_into_the_running_driver(tmp_path):
    """Ours built for 570.86.15, nvidia 580.142 on disk AND loaded: a reboot changes nothing (before, the
    remedy said 'Reboot into the installed driver first (nvidia.ko on disk is 580.142)', the running one)."""
    stale = sparkroot.make_spark_root(tmp_path / "d", uvm_loaded="stock", ours_installed="570.86.15")
    with pytest.raises(act_activate.ActivationRefused, match="loaded nvidia is 580.142") as e:
        executor.perform("activate", Host(stale), CFG)
    assert "reboot" not in e.value.remedy.lower() and "sudo spark-memsaver reconcile" in e.value.remedy
    # the driver on disk is newer than the running one and ours is built for it: then a reboot is the cure
    newer = sparkroot.make_spark_root(tmp_path / "e", loaded_driver="580.95.05", uvm_loaded="stock",
                                      ours_installed="580.142")
    with pytest.raises(act_activate.ActivationRefused) as e:
        executor.perform("activate", Host(newer), CFG)
    assert e.value.remedy.startswith("Reboot") and "580.142" in e.value.remedy and "580.95.05" in e.value.remedy


def test_cli_activate_and_reconcile_dry_run_json(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "root", uvm_loaded="stock", ours_installed="580.95.05")
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), "reconcile", "--dry-run",
                        "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    acts = [(s["action"], s.get("kernel")) for s in doc["steps"]]
    assert acts[0] == ("remove-override", sparkroot.SPARK_KERNEL)
    assert "580.95.05 to 580.142" in doc["steps"][0]["reason"]
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), "activate", "--json"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert json.loads(r.stdout)["error"]["code"] == "activation-refused"
