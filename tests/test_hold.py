"""The administrator's word is kept (issue 22, item 5): after `rollback` or `remove` no automation -- the APT/dpkg
doors, the kernel hook, spark-memsaverd's start-up reconcile -- brings our module back; `install` ends the hold.

Real parts: a Spark-shaped root (tests/support/sparkroot.py: real ELF modules, real depmod, real DKMS), the real
CLI for the doors (the exact argv systemd/dpkg/dpkg-post and systemd/apt/apt-pre-install run) and the executor
op the daemon runs at start (service/operations.run("reconcile")). Rows ad1-ad4 of tests/FAULTS.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from spark_memsaver.act import executor, steps
from spark_memsaver.config import Config
from spark_memsaver.host import Host
from tests.support import sparkroot

REPO = Path(__file__).resolve().parent.parent
K = sparkroot.SPARK_KERNEL
K2 = "6.14.0-1016-nvidia-64k"
STOCK = f"/lib/modules/{K}/kernel/nvidia-580-open/nvidia-uvm.ko"


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'daemon'}:{REPO}")
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    return env


@pytest.fixture
def spark(tmp_path, monkeypatch):
    root = sparkroot.make_spark_root(tmp_path / "root", ours_installed="580.142")
    (root / "usr/sbin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(shutil.which("dkms") or "/usr/sbin/dkms", root / "usr/sbin/dkms")   # a node has DKMS
    monkeypatch.delenv("SPARK_MEMSAVER_CONFIG", raising=False)
    return root


def cli(root: Path, *args, input: str | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), *args], input=input,
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def plan(root: Path, *kernels) -> list[dict]:
    args = [a for k in kernels for a in ("--kernel", k)]
    r = cli(root, "reconcile", "--dry-run", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["steps"]


def status(root: Path) -> dict:
    r = cli(root, "status", "--json", "--direct")
    return json.loads(r.stdout)


def selected(root: Path, kernel: str = K) -> dict:
    return steps.selected(Host(root), kernel)


def _rolled_back(root: Path) -> None:
    doc = executor.perform("rollback", Host(root), Config(), kernel=K, reason="GPU fault under load")
    assert doc["ok"] and selected(root)["path"] == STOCK


def test_h1_rollback_then_an_apt_run_builds_nothing(spark):
    """Before: right after the rollback the planner wanted `build-install … no build of our module`."""
    before = plan(spark)
    _rolled_back(spark)
    assert [s["action"] for s in plan(spark)] == ["held"], plan(spark)
    # the doors an apt run goes through: pre-install (no driver change: nothing), then DPkg::Post-Invoke
    r = cli(spark, "reconcile", "--apt-pre-install", input="VERSION 3\nAPT::Architecture=arm64\n\n")
    assert r.returncode == 0, r.stderr
    r = cli(spark, "reconcile", "--hook", "apt-post-invoke", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [s["action"] for s in doc["steps"]] == ["held"] and doc.get("acting") == 0, doc
    assert selected(spark)["path"] == STOCK
    assert before == [s for s in before if s["action"] != "build-install"]      # no rebuild pending before


def test_h2_rollback_then_reboot_daemon_start_reconcile_keeps_stock(spark):
    """The reconcile spark-memsaverd runs at start (service/daemon.py request_reconcile -> operations.run)."""
    from spark_memsaver.service import operations
    _rolled_back(spark)
    doc = operations.run("reconcile", Host(spark), Config(), None)
    assert [s["action"] for s in doc["steps"]] == ["held"], doc
    assert selected(spark)["path"] == STOCK
    st = status(spark)
    assert st["state"] == "rolled-back"
    held = [f for f in st["findings"] if f["code"] == "held"]
    assert held and "held since " in held[0]["message"] and ", by rollback; `sudo spark-memsaver install` resumes" \
        in held[0]["message"], st["findings"]
    assert held[0]["remedy"] == "sudo spark-memsaver install"
    rb = [f for f in st["findings"] if f["code"] == "rolled-back"][0]
    assert "comes back by itself" not in rb["remedy"] and "sudo spark-memsaver install" in rb["remedy"]
    assert st["hold"]["by"] == "rollback" and st["hold"]["resume"] == "sudo spark-memsaver install"
    text = cli(spark, "status", "--direct").stdout
    assert "Hold:" in text and "by rollback; `sudo spark-memsaver install` resumes" in text
    m = cli(spark, "metrics").stdout
    assert 'spark_memsaver_held{by="rollback"} 1' in m and 'spark_memsaver_held{by="remove"} 0' in m


def test_h3_remove_all_then_a_new_kernel_stays_stock(spark):
    executor.perform("remove", Host(spark), Config(), kernel=K)   # the fixture's override is not DKMS-registered
    doc = executor.perform("remove", Host(spark), Config(), all_kernels=True)
    assert selected(spark)["path"] == STOCK, doc
    # a new kernel arrives (its modules, headers, nvidia.ko), then the kernel hook runs for it
    sparkroot.make_spark_root(spark, extra_kernels=(K2,))
    assert not selected(spark, K2).get("patched")
    steps_k2 = plan(spark, K2)
    assert [s["action"] for s in steps_k2] == ["held"] and "by remove --all" in steps_k2[0]["reason"], steps_k2
    r = cli(spark, "reconcile", "--hook", "kernel-postinst", "--kernel", K2, "--json")
    assert r.returncode == 0, r.stderr
    assert [s["action"] for s in json.loads(r.stdout)["steps"]] == ["held"]
    assert not selected(spark, K2).get("patched")
    assert status(spark)["hold"]["by"] == "remove"


def test_h3_safety_steps_still_run_under_a_hold(spark):
    """A hold never keeps a mismatched override: our 570 build beside nvidia.ko 580.142 is removed."""
    executor.perform("remove", Host(spark), Config(), kernel=K)
    sparkroot.make_spark_root(spark, ours_installed="570.86.15")     # a stale override appears (by hand)
    assert selected(spark).get("patched")
    acts = [s["action"] for s in plan(spark)]
    assert acts[0] == "remove-override" and "build-install" not in acts, acts


def test_h4_install_clears_the_hold(spark):
    _rolled_back(spark)
    assert plan(spark)[0]["action"] == "held"
    # the administrator's install (it ends the hold first; the build itself may fail on a fixture tree)
    r = cli(spark, "install", "--kernel", K, "--json")
    assert "Traceback" not in r.stderr
    assert not [p for p in (spark / "var/lib/spark-memsaver/holds").glob("*.json")]
    assert "held" not in [s["action"] for s in plan(spark)]
    assert status(spark).get("hold") is None


def test_install_of_one_kernel_releases_it_from_an_all_hold(spark):
    from spark_memsaver.decide.hold import held
    from spark_memsaver.host import holds
    from spark_memsaver.model import Records
    holds.hold(Host(spark), "remove", None, "requested")
    holds.release(Host(spark), K)
    rec = json.loads((spark / "var/lib/spark-memsaver/holds/all.json").read_text())
    assert held(Records(holds=[rec]), K) is None and held(Records(holds=[rec]), K2) == rec
    holds.hold(Host(spark), "rollback", K, "again")
    assert held(Records(holds=[rec, {"by": "rollback", "kernel": K}]), K)["by"] == "rollback"
    assert holds.release(Host(spark), None) and held(Records(holds=[]), K) is None


def test_rollback_while_ours_is_loaded_says_the_reload_comes_next(tmp_path, monkeypatch):
    """A rollback while CUDA holds /dev/nvidia-uvm leaves our module loaded (it is never force-unloaded). Status
    then says that, with the hold, and Next is the reload that brings the stock module in -- not 'validate' on a
    node the administrator just rolled back, and not silent about the hold."""
    monkeypatch.delenv("SPARK_MEMSAVER_CONFIG", raising=False)
    root = sparkroot.make_spark_root(tmp_path / "root", ours_installed="580.142", uvm_loaded="ours", holders=1,
                                     stats=sparkroot.stats_text(tier="leaf"))
    (root / "usr/sbin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(shutil.which("dkms") or "/usr/sbin/dkms", root / "usr/sbin/dkms")
    _rolled_back(root)
    doc = status(root)
    f = next(x for x in doc["findings"] if x["code"] == "ours-loaded-stock-selected")
    assert "held since" in f["message"] and "by rollback" in f["message"], f
    assert "sudo modprobe -r nvidia_uvm && sudo modprobe nvidia_uvm" in f["remedy"], f
    text = cli(root, "status", "--direct").stdout
    nxt = next(ln for ln in text.splitlines() if ln.startswith("Next:"))
    assert "modprobe -r nvidia_uvm" in nxt and "validate" not in nxt, text
