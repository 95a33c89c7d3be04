"""act/executor.py behaviours that a mutation run (tools/mutation-run, issue 29 item 3) found unguarded by the fast
tests: each test pins one behaviour an administrator, the APT door or a reader of the event log relies on and names
the mutants it kills.

Real parts: act/executor.perform on a Spark-shaped root (tests/support/sparkroot.py: real ELF modules with real
.modinfo, real depmod/modinfo), the real intent, hold and rollback records, the real event log.
"""

from __future__ import annotations

import json

import pytest

from spark_memsaver.act import executor
from spark_memsaver.config import Config
from spark_memsaver.errors import MemsaverError, UsageError
from spark_memsaver.host import Host, events, holds, intents, paths
from tests.support import sparkroot

K = sparkroot.SPARK_KERNEL
HEAD = "VERSION 3\nAPT::Architecture=arm64\n\n"
SOURCE_UP = "nvidia-kernel-source-580-open 580.142-0ubuntu1 arm64 none < 590.44.01-0ubuntu1 arm64 none /x.deb\n"
NEW_DKMS = "nvidia-dkms-590-open - - none < 590.44.01-0ubuntu1 arm64 none /y.deb\n"
COMMON_GONE = "nvidia-kernel-common-580 580.142-0ubuntu1 arm64 none < - - none **REMOVE**\n"
SOURCE_BUMP = "nvidia-kernel-source-580-open 580.142-0ubuntu1 arm64 none < 580.142-0ubuntu2 arm64 none /z.deb\n"


@pytest.fixture
def spark(tmp_path, monkeypatch):
    monkeypatch.delenv("SPARK_MEMSAVER_CONFIG", raising=False)
    return Host(str(sparkroot.make_spark_root(tmp_path / "root", ours_installed="580.142")))


def _ops(host):
    return [e for e in events.read(host) if e["op"] in events.KINDS]


def test_the_apt_door_says_what_changed_what_it_removed_and_why(spark):
    """The door's result (and so its event): each package as 'name old -> new' with '-' for none, the source trees
    it saw, the kernels whose override it removed, each change's effect; the rollback record says the step's code
    and when the override comes back (kills: the packages' `or '-'` (x2), the "sources_seen" key, effect None,
    the record's code `or` -> `and`, its remedy's wording)."""
    doc = executor.perform("apt-pre-install", spark, Config(), text=HEAD + SOURCE_UP + NEW_DKMS + COMMON_GONE)
    assert doc["packages"] == ["nvidia-kernel-source-580-open 580.142-0ubuntu1 -> 590.44.01-0ubuntu1",
                               "nvidia-dkms-590-open - -> 590.44.01-0ubuntu1",
                               "nvidia-kernel-common-580 580.142-0ubuntu1 -> -"]
    assert doc["sources_seen"] == ["580.142"] and doc["removed"] == [K] and doc["kept"] == []
    assert [(c["effect"]["driver"], c["effect"]["removed"], c["effect"]["how"]) for c in doc["changes"]] == \
        [("590.44.01", False, "package version"), ("590.44.01", False, "package version"), (None, True, "removed")]
    rb = json.loads(spark.path(f"{paths.STATE_DIR}/rollbacks/{K}.json").read_text())
    assert rb["code"] == "driver-removed" and rb["driver_from"] == "580.142"
    assert rb["remedy"] == "spark-memsaver rebuilds for the new driver after the upgrade when it is supported."
    ev = _ops(spark)[-1]
    assert ev["op"] == "apt-pre-install" and ev["packages"] == doc["packages"] and ev["removed"] == [K]


def test_the_apt_door_keeps_an_override_whose_driver_stays(spark):
    """A source-package bump with the same driver keeps the override and says so under "kept"; only "kept" notes
    count there (kills: the "kept" key, its kind's spelling, == -> !=)."""
    doc = executor.perform("apt-pre-install", spark, Config(), text=HEAD + SOURCE_BUMP)
    assert doc["steps"] == [] and doc["removed"] == [] and doc["kept"] == [K]
    assert [n["kind"] for n in doc["notes"]] == ["kept"]
    assert _ops(spark)[-1]["kept"] == [K]          # the APT door's event: whenever NVIDIA packages change


def test_the_apt_door_without_nvidia_packages_does_nothing_and_records_nothing(spark):
    """An APT run that changes no NVIDIA driver package: ok, nothing planned, no event (kills: ok True -> False)."""
    other = "bash 5.2-1 arm64 none < 5.2-2 arm64 none /b.deb\n"
    assert executor.perform("apt-pre-install", spark, Config(), text=HEAD + other) == \
        {"ok": True, "changes": [], "steps": []}
    assert _ops(spark) == []


def test_an_unknown_operation_is_named_with_the_known_ones(spark):
    """(kills: the message's wording and its ', ' separator)."""
    with pytest.raises(UsageError) as e:
        executor.perform("format", spark, Config())
    assert str(e.value) == ("unknown operation 'format' (one of: build, install, remove, activate, rollback, "
                            "reconcile, apt-pre-install)")


def test_every_kernel_a_reconcile_names_must_exist(spark):
    """`reconcile --kernel K` for a kernel that is not installed is a usage error naming it, before anything is
    planned (kills: the "kernels" argument's name)."""
    with pytest.raises(UsageError, match="9.9.9-nope"):
        executor.perform("reconcile", spark, Config(), kernels=["9.9.9-nope"], rebuild=False)
    assert _ops(spark) == []


def test_a_build_for_another_driver_is_refused_naming_that_driver(spark):
    """`build --driver V` (D-Bus: driver, the CLI: driver_version) builds for V, so a V that is not the kernel's
    nvidia.ko is refused naming V (kills: ``driver_version or driver`` -> ``and`` / None: the default driver
    was built instead)."""
    for kw in ({"driver": "575.64"}, {"driver_version": "575.64"}):
        with pytest.raises(MemsaverError) as e:
            executor.perform("build", spark, Config(), kernel=K, **kw)
        assert e.value.code == "driver-mismatch" and str(e.value).endswith("not 575.64"), (kw, str(e.value))


def test_install_says_which_holds_it_released(spark):
    """The administrator's install ends their holds and says which, joined by ', ' (kills: the message's wording
    and separator). The install itself is refused here (the fixture's source tree is no real one)."""
    holds.hold(spark, "remove", K, "requested")
    holds.hold(spark, "rollback", None, "requested")
    said = []
    with pytest.raises(MemsaverError):
        executor.perform("install", spark, Config(), kernel=K, progress=lambda *a: said.append(a[-1]))
    assert f"hold released: {K}, all (for {K})" in said, said


def test_remove_holds_the_kernel_as_requested(spark):
    """`remove` records the administrator's hold with the reason "requested" (status and the events show it)
    (kills: the reason's wording)."""
    executor.perform("remove", spark, Config(), kernel=K)
    rec = json.loads(spark.path(paths.hold(K)).read_text())
    assert (rec["by"], rec["reason"]) == ("remove", "requested")


def test_an_interrupted_operation_is_finished_first_and_said(spark):
    """Every op but reconcile first finishes what an interrupted one left (its intent record) and says so under
    "recovered" (kills: "finish-intent" misspelt in recover's list)."""
    intents.write_intent(spark, "remove", K)       # our own pid: never alive, as after a crash
    doc = executor.perform("rollback", spark, Config(), kernel=K, reason="test")
    assert [s["action"] for s in doc["recovered"]] == ["finish-intent"]
    assert list(spark.path(f"{paths.STATE_DIR}/intents").glob("*.json")) == []
    assert _ops(spark)[-1]["recovered"].startswith('[{"action": "finish-intent"')


def test_an_interrupted_activation_is_reloaded_first(spark):
    """An activation killed midway leaves its intent: the next op first makes sure an nvidia-uvm is loaded (on an
    image: skipped, said) and clears it (kills: "reload-uvm" misspelt in recover's list)."""
    intents.write_intent(spark, "activate", K)
    doc = executor.perform("rollback", spark, Config(), kernel=K, reason="test")
    assert [(s["action"], s["intent"]) for s in doc["recovered"]] == [("reload-uvm", f"activate-{K}")]
    assert list(spark.path(f"{paths.STATE_DIR}/intents").glob("*.json")) == []


def test_recovery_runs_only_steps_of_an_interrupted_operation(tmp_path):
    """Our nvidia-uvm loaded beside another nvidia (by hand) is reloaded by reconcile, not by another op's
    recovery: that step names no intent (kills: ``and (s.intent or s.path)`` -> ``or``)."""
    host = Host(str(sparkroot.make_spark_root(tmp_path / "r", uvm_loaded="ours", loaded_driver="575.64",
                                              ours_installed="580.142")))
    plan = executor.perform("reconcile", host, Config(), dry_run=True)
    assert ("reload-uvm", None) in [(s["action"], s.get("kernel")) for s in plan["steps"]], plan
    doc = executor.perform("rollback", host, Config(), kernel=K, reason="test")
    assert "recovered" not in doc, doc["recovered"]


def test_activate_on_an_image_recovers_nothing(spark):
    """`activate --root IMAGE` only says what it would run: it takes no lock and leaves an interrupted
    operation's record for the node itself (kills: ``or not host.is_live`` -> ``or host.is_live``, and the
    ``or`` -> ``and`` that sent a non-dry activate of an image through the lock and recovery)."""
    intents.write_intent(spark, "remove", K)
    doc = executor.perform("activate", spark, Config())
    assert doc["activated"] is False
    assert doc["would_run"] == [["modprobe", "-r", "nvidia_uvm"], ["modprobe", "nvidia_uvm"]]
    assert "recovered" not in doc
    assert [p.name for p in spark.path(f"{paths.STATE_DIR}/intents").glob("*.json")] == [f"remove-{K}.json"]


def test_dry_runs_of_install_and_rollback_change_nothing(spark):
    """`install --dry-run` and `rollback --dry-run` plan only: no hold written or released, no event (kills:
    "install" and "rollback" misspelt in the dry-run dispatch)."""
    holds.hold(spark, "remove", K, "requested")
    doc = executor.perform("install", spark, Config(), kernel=K, dry_run=True)
    assert doc.get("dry_run") is True and spark.path(paths.hold(K)).exists()
    spark.path(paths.hold(K)).unlink()
    doc = executor.perform("rollback", spark, Config(), kernel=K, reason="test", dry_run=True)
    assert doc.get("dry_run") is True and not spark.path(paths.hold(K)).exists()
    assert _ops(spark) == []


def test_a_reconcile_that_pruned_cached_sources_says_which(spark):
    """A reconcile keeps the cached source trees of the installed drivers only and says which it removed
    (kills: the "removed" key read from the pruning)."""
    from tests.test_sources import nvidia_tree
    nvidia_tree(spark.path(paths.source_tree("575.64")), "575.64")
    doc = executor.perform("reconcile", spark, Config(), rebuild=False)
    assert doc.get("sources_pruned") == ["575.64"], doc
    assert not spark.path(paths.source_tree("575.64")).exists()
