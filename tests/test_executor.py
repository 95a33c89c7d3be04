"""act/executor.py: the one path for every module mutation.

Real parts: the DKMS engines (act/build.py, act/override.py) on a Spark-shaped root (tests/support/sparkroot.py: real ELF
modules with real .modinfo, real depmod/modinfo), the real dkms program behind a wrapper that only logs
and waits (SPARK_MEMSAVER_DKMS: the engines' own switch for which dkms to run), real processes killed
with SIGKILL, a real full tmpfs for the state directory (ENOSPC from the kernel, not a mock).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spark_memsaver.act import executor, installable, steps
from spark_memsaver.config import Config
from spark_memsaver.decide import plan as rc
from spark_memsaver.decide.status import evaluate
from spark_memsaver.errors import UsageError
from spark_memsaver.host import Host, intents
from tests.support import needs, sparkroot
from tests.support.worlds import typed

rc, evaluate = typed(rc), typed(evaluate)   # dict snapshots -> model.World (tests/support/worlds.py)

REPO = Path(__file__).resolve().parent.parent
K = sparkroot.SPARK_KERNEL
STOCK = f"/lib/modules/{K}/kernel/nvidia-580-open/nvidia-uvm.ko"
V3 = ("VERSION 3\nAPT::Architecture=arm64\n\n"
      "nvidia-kernel-source-580-open 580.142-0ubuntu1 arm64 none < 590.44.01-0ubuntu1 arm64 none /x.deb\n")


def _env(tmp_path, sleep="0"):
    wrapper = tmp_path / "dkms-wrapper"
    if not wrapper.exists():
        wrapper.write_text("#!/bin/sh\n"
                           'echo "start $$ $SPARK_TEST_WHO $1" >> "$SPARK_TEST_LOG"\n'
                           'sleep "$SPARK_TEST_SLEEP"\n'
                           'echo "end $$ $SPARK_TEST_WHO" >> "$SPARK_TEST_LOG"\n'
                           'exec dkms "$@"\n')
        wrapper.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'daemon'}:{REPO}", SPARK_MEMSAVER_DKMS=str(wrapper),
               SPARK_TEST_LOG=str(tmp_path / "order.log"), SPARK_TEST_SLEEP=sleep, SPARK_TEST_WHO="test")
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    return env


@pytest.fixture
def spark(tmp_path, monkeypatch):
    root = sparkroot.make_spark_root(tmp_path / "root", ours_installed="580.142")
    for k, v in _env(tmp_path).items():
        monkeypatch.setenv(k, v)
    return root


def _selected(root) -> dict:
    return steps.selected(Host(root), K)


def _intents(root):
    return sorted(p.name for p in (root / "var/lib/spark-memsaver/intents").glob("*.json"))


def test_unknown_op_and_unknown_kernel(spark):
    with pytest.raises(UsageError, match="unknown operation"):
        executor.perform("format", Host(spark), Config())
    with pytest.raises(UsageError, match="not installed"):
        executor.perform("remove", Host(spark), Config(), kernel="9.9.9-nope")


def test_remove_goes_through_lock_intent_and_verification(spark):
    assert _selected(spark).get("patched")
    doc = executor.perform("remove", Host(spark), Config(), kernel=K)
    assert doc["restored"][0]["selected"] == STOCK and not _selected(spark).get("patched")
    assert _intents(spark) == [] and "record_problems" not in doc
    assert (spark / "run/spark-memsaver/lifecycle.lock").exists()      # it took the one lock


def _killed_midway(tmp_path, root, op_code: str) -> None:
    env = _env(tmp_path, sleep="30")
    code = ("from spark_memsaver.act import executor; from spark_memsaver.host import Host; "
            "from spark_memsaver.config import Config; " + op_code)
    p = subprocess.Popen([sys.executable, "-c", code % str(root)], env=env, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    log = tmp_path / "order.log"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (log.exists() and "start" in log.read_text()):
        time.sleep(0.05)
    assert log.exists(), p.stderr.read() if p.poll() is not None else "no dkms call"
    os.killpg(p.pid, signal.SIGKILL)                                   # kill -9 midway, with its dkms
    p.wait(10)


def test_remove_killed_midway_is_finished_by_the_next_perform(tmp_path, spark):
    _killed_midway(tmp_path, spark, "executor.perform('remove', Host(%r), Config(), kernel='" + K + "')")
    assert _intents(spark) == [f"remove-{K}.json"] and _selected(spark).get("patched")
    snap = installable.observe_for_plan(Host(spark))
    assert "operation-interrupted" in [f.code for f in evaluate(snap, Config()).findings]
    doc = executor.perform("reconcile", Host(spark), Config(), rebuild=False)
    assert [s["action"] for s in doc["steps"]][0] == "finish-intent" and doc["steps"][0]["ok"]
    assert _intents(spark) == [] and _selected(spark)["path"] == STOCK


def test_install_killed_midway_is_undone_by_the_next_perform(tmp_path, spark):
    _killed_midway(tmp_path, spark, "executor.perform('install', Host(%r), Config(), kernel='" + K + "')")
    assert _intents(spark) == [f"install-{K}.json"]
    # any later operation first recovers: here a plain remove of nothing else
    doc = executor.perform("rollback", Host(spark), Config(), kernel=K, reason="test")
    assert [s["action"] for s in doc["recovered"]] == ["clear-intent"] or \
        [s["action"] for s in doc["recovered"]] == ["undo-intent"]
    assert _intents(spark) == [] and _selected(spark)["path"] == STOCK


def test_apt_door_and_install_serialize_on_the_one_lock(tmp_path, spark):
    """An Install (D-Bus/CLI) holds the lifecycle lock while its engine runs; the APT pre-install door
    started meanwhile waits for it, then removes the override: their dkms calls never interleave."""
    env_a = dict(_env(tmp_path, sleep="3"), SPARK_TEST_WHO="install")
    code = ("from spark_memsaver.act import executor; from spark_memsaver.host import Host; "
            "from spark_memsaver.config import Config; from spark_memsaver.errors import MemsaverError\n"
            "try: executor.perform('install', Host(%r), Config(), kernel=%r)\n"
            "except MemsaverError as e: print('install refused:', e.code)\n") % (str(spark), K)
    a = subprocess.Popen([sys.executable, "-c", code], env=env_a, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    log = tmp_path / "order.log"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (log.exists() and "install" in log.read_text()):
        time.sleep(0.05)
    env_b = dict(_env(tmp_path), SPARK_TEST_WHO="apt-door")
    b = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(spark), "reconcile",
                        "--apt-pre-install"], input=V3, env=env_b, capture_output=True, text=True, timeout=120)
    a.communicate(timeout=120)
    assert b.returncode == 0, b.stderr
    assert "waiting for another spark-memsaver operation" in b.stderr, b.stderr
    events = [ln.split()[0] + " " + ln.split()[2] for ln in log.read_text().splitlines()]
    first_door = events.index("start apt-door")
    assert "end install" in events[:first_door]                         # the door acted after the install
    assert all(e.endswith("apt-door") for e in events[first_door:]), events
    assert _selected(spark)["path"] == STOCK                             # override removed before unpack


def test_apt_door_observes_the_host_once(spark, monkeypatch):
    """The APT pre-install door takes one snapshot (its recovery's), not two (issue 22; before: two)."""
    from spark_memsaver.observe import snapshot as snapmod
    calls = []
    real = snapmod.snapshot
    monkeypatch.setattr(snapmod, "snapshot", lambda *a, **k: calls.append(1) or real(*a, **k))
    doc = executor.perform("apt-pre-install", Host(spark), Config(), text=V3)
    assert doc["steps"][0]["action"] == "remove-override" and doc["steps"][0]["ok"], doc
    assert len(calls) == 1 and _selected(spark)["path"] == STOCK


# --- defect 4: a full state disk never stops a removal toward stock -----------------------------

@pytest.fixture
def full_state(spark):
    needs.root("mounting a tmpfs needs root")
    state = spark / "var/lib/spark-memsaver"
    state.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,nr_inodes=64", "tmpfs", str(state)], check=True)
    try:
        fd = os.open(state / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        yield spark
    finally:
        subprocess.run(["umount", str(state)], check=False)


def test_full_disk_removal_goes_on_and_is_reported(full_state):
    with pytest.raises(OSError):
        intents.write_intent(Host(full_state), "remove", K)              # the disk really is full
    doc = executor.perform("remove", Host(full_state), Config(), kernel=K)
    assert _selected(full_state)["path"] == STOCK                        # stock selected anyway
    codes = [p["code"] for p in doc["record_problems"]]
    assert codes and set(codes) == {"record-write-failed"} and doc["findings"] == doc["record_problems"]
    assert "No space left" in doc["record_problems"][0]["message"]


def test_full_disk_apt_door_still_removes_the_override(full_state):
    doc = executor.perform("apt-pre-install", Host(full_state), Config(), text=V3)
    assert doc["steps"][0]["action"] == "remove-override" and doc["steps"][0]["ok"], doc
    assert _selected(full_state)["path"] == STOCK
    assert doc["record_problems"]


def test_full_disk_refuses_a_build_without_its_record(full_state):
    from spark_memsaver.act.records_io import RecordWriteFailed
    with pytest.raises(RecordWriteFailed, match="nothing was changed"):
        executor.perform("install", Host(full_state), Config(), kernel=K)
    assert _selected(full_state).get("patched")                          # untouched


# --- a configuration change since the build ------------------------------------------------------

def _build_record(root, **settings):
    p = root / f"var/lib/spark-memsaver/builds/{K}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"schema": 1, "kernel": K, "driver": "580.142", **settings}))


def test_config_change_is_a_finding_with_the_exact_command(spark):
    _build_record(spark, tier="4k-all", tier_value=1, kernels="64k-only")
    cfg = Config(auto_build=False)                                        # tier: leaf (default)
    doc = executor.perform("reconcile", Host(spark), cfg, dry_run=True)
    st = [s for s in doc["steps"] if s.get("code") == "config-changed"]
    assert [s["action"] for s in st] == ["config-changed"] and "tier 4k-all -> leaf" in st[0]["reason"]
    f = [x for x in evaluate(installable.observe_for_plan(Host(spark)), cfg).findings if x.code == "config-changed"]
    assert len(f) == 1 and f[0].kernel == K
    # build --force runs only as root (never through the daemon): the remedy says sudo, or it would not work
    assert f[0].remedy == (f"sudo spark-memsaver build --kernel {K} --force && "
                           f"sudo spark-memsaver install --kernel {K}")
    # same settings: nothing to say
    _build_record(spark, tier="leaf", tier_value=3, kernels="64k-only")
    assert not [x for x in evaluate(installable.observe_for_plan(Host(spark)), cfg).findings
                if x.code == "config-changed"]


def test_config_change_rebuilds_with_auto_build(spark):
    import shutil
    needs.require("dkms", remedy="tools/deps/dkms.txt")
    (spark / "usr/sbin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(shutil.which("dkms"), spark / "usr/sbin/dkms")          # the root has DKMS, as a node does
    _build_record(spark, tier="256", kernels="64k-only")
    doc = executor.perform("reconcile", Host(spark), Config(), dry_run=True, kernels=[K])
    st = [s for s in doc["steps"] if s.get("code") == "config-changed"]
    assert doc["support"]["580.142"]["supported"], doc["support"]
    assert [s["action"] for s in st] == ["build-install"] and "rebuilding" in st[0]["reason"]
    f = [x for x in evaluate(installable.observe_for_plan(Host(spark)), Config()).findings
         if x.code == "config-changed"]
    assert f and f[0].remedy.endswith("spark-memsaver reconcile")


def test_build_of_0_1_0_is_compared_through_its_dkms_tree(spark):
    """0.1.0 wrote no build record: the settings come from our rendered tree's spark-memsaver.json."""
    meta = spark / "usr/src/spark-memsaver-uvm-580.142-sm0.1.0/spark-memsaver.json"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"format": 1, "driver_version": "580.142", "tier": "4k", "tier_default": 1,
                                "kernels_policy": "64k-only"}))
    snap = installable.observe_for_plan(Host(spark))
    assert [x.kernel for x in evaluate(snap, Config(auto_build=False)).findings if x.code == "config-changed"] == [K]
    assert not [x for x in evaluate(snap, Config(tier="4k")).findings if x.code == "config-changed"]


# --- the layers: engines and decisions never reach into cli/ or click -----------------------------

def test_act_observe_decide_import_no_cli_and_no_click():
    pkg = REPO / "daemon/spark_memsaver"
    bad = []
    pat = re.compile(r"^\s*(?:from\s+(?:spark_memsaver\.cli|\.\.?cli|click)\b|import\s+(?:click|spark_memsaver\.cli)\b)"
                     r"|from\s+spark_memsaver\s+import\s+cli\b", re.M)
    for sub in ("act", "observe", "decide"):
        for f in sorted((pkg / sub).rglob("*.py")):
            for m in pat.finditer(f.read_text()):
                bad.append(f"{f.relative_to(pkg)}: {m.group(0).strip()}")
    assert bad == [], bad


def test_every_acting_step_has_exactly_one_handler():
    """Steps run from one table (act/steps.HANDLERS): every acting action of decide/step has a handler, or is run
    by execute() itself (fetch-source); no explaining step (INFO) has one, and no handler is for an unknown action."""
    from spark_memsaver.act import steps
    from spark_memsaver.decide import step

    assert set(steps.HANDLERS) | set(steps.BY_EXECUTE) == set(step.ACTING)
    assert not set(steps.HANDLERS) & set(steps.BY_EXECUTE)
    assert not (set(steps.HANDLERS) | set(steps.BY_EXECUTE)) & set(step.INFO)


# --- one table of operations (issue 34 item 3) ----------------------------------------------------------------

PKG = Path(__file__).resolve().parent.parent / "daemon" / "spark_memsaver"


def _second_lists() -> list[str]:
    """Literals outside opnames.py that list operation names again: a tuple/list/set of three or more, or a
    dict from three or more of them to their D-Bus methods (the executor, events, D-Bus and the CLI each had
    one on main)."""
    import ast
    from spark_memsaver import opnames
    names = set(opnames.EVENT_KINDS) | set(opnames.DBUS_JOBS)
    methods = {o.dbus_method for o in opnames.OPERATIONS.values()}
    found = []
    for p in sorted(PKG.rglob("*.py")):
        if p.name == "opnames.py" and p.parent == PKG:
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, (ast.Tuple, ast.List, ast.Set)):
                vals = [e.value for e in n.elts if isinstance(e, ast.Constant)]
                if len(names & set(vals)) >= 3:
                    found.append(f"{p.relative_to(PKG)}:{n.lineno}")
            elif isinstance(n, ast.Dict):
                pairs = [(k.value, v.value) for k, v in zip(n.keys, n.values)
                         if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)]
                if len([k for k, v in pairs if k in names and v in methods]) >= 3:
                    found.append(f"{p.relative_to(PKG)}:{n.lineno}")
    return found


def test_the_executor_dispatches_through_the_one_table_of_operations():
    from spark_memsaver import opnames
    from spark_memsaver.host import events
    from spark_memsaver.service import daemon, operations
    assert tuple(executor.TABLE) == opnames.EXECUTOR == executor.OPS
    assert events.KINDS == opnames.EVENT_KINDS and set(opnames.ENROLLMENT) <= set(events.KINDS)
    assert operations.OPERATIONS == opnames.DBUS_JOBS and set(operations.MUTATIONS) <= set(opnames.EXECUTOR)
    assert daemon.REMOVAL_OPS == ("remove", "rollback", "reconcile")
    assert executor.SAFETY_OPS == ("remove", "rollback", "reconcile", "apt-pre-install")
    assert [opnames.dbus_method(o) for o in operations.MUTATIONS] == \
        ["Build", "Install", "Remove", "Activate", "Rollback", "Reconcile"]
    assert not _second_lists(), "operation names listed again outside opnames.py: " + ", ".join(_second_lists())
    assert _op_tests() == {"compares": [], "lookups": ["act/executor.py:TABLE.get(op)"]}


def _op_tests() -> dict:
    """Where the executor and its dry run test the operation's name: comparisons of ``op`` (== != in; the executor
    had 14 on an older main, then 1, and the dry run 4 in an if/elif chain) and lookups of ``op`` in a table."""
    import ast
    out: dict = {"compares": [], "lookups": []}
    for rel in ("act/executor.py", "act/dryrun.py"):
        for n in ast.walk(ast.parse((PKG / rel).read_text())):
            if isinstance(n, ast.Compare) and any(isinstance(x, ast.Name) and x.id == "op"
                                                  for x in [n.left, *n.comparators]):
                out["compares"].append(f"{rel}:{n.lineno}")
            elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Name) and n.slice.id == "op":
                out["lookups"].append(f"{rel}:{ast.unparse(n)}")
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and \
                    any(isinstance(a, ast.Name) and a.id == "op" for a in n.args):
                out["lookups"].append(f"{rel}:{ast.unparse(n)}")
    return out


def test_the_docs_name_every_event_kind():
    from spark_memsaver import opnames
    root = PKG.parent.parent
    api = next(line for line in (root / "docs/dbus-api.md").read_text().splitlines() if "GetEvents(" in line)
    arch = next(line for line in (root / "docs/architecture.md").read_text().splitlines()
                if line.startswith("| `events.jsonl`"))
    for kind in opnames.EVENT_KINDS:
        assert re.search(rf"[ (:]{re.escape(kind)}[,; )]", api), kind
        assert re.search(rf"[ (:]{re.escape(kind)}[,; )]", arch), kind
