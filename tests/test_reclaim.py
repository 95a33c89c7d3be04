"""`reclaim --need SIZE` and D-Bus PrepareLaunch: the plan (decide/reclaim.py), what is written to the kernel's
memory knobs (act/reclaim.py) and the refusals, on the GB10 fixture roots of tests/test_memory.py.

The knobs in a fixture root are plain files standing in for /sys/fs/cgroup/memory.reclaim,
/proc/sys/vm/drop_caches and compact_memory (the kernel cannot be asked here: dropping this shared machine's caches
would be felt by everyone on it); what the command writes to them is what it would write to the kernel. A fixture's
meminfo does not move, so a run there reclaims nothing: it reports "met: no" and exits 1, which is also what a
real node says when the kernel frees less than asked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from spark_memsaver.decide import memory as dmem
from spark_memsaver.decide import reclaim as decide
from spark_memsaver.host import Host
from spark_memsaver.observe import memory as observe
from tests.support import needs

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures" / "memory"
ENV = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
ENV.pop("SPARK_MEMSAVER_CONFIG", None)
GIB, MIB = 1 << 30, 1 << 20
KNOBS = ("sys/fs/cgroup/memory.reclaim", "proc/sys/vm/drop_caches", "proc/sys/vm/compact_memory")


def root(tmp_path, name="gb10-4k", knobs=KNOBS) -> Path:
    r = tmp_path / name
    shutil.copytree(FIX / name, r)
    for k in knobs:
        (r / k).parent.mkdir(parents=True, exist_ok=True)
        (r / k).write_text("")
    return r


def cli(*args, user=None):
    pre = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if user == "nobody" else []
    return subprocess.run([*pre, "/usr/bin/python3", "-m", "spark_memsaver", *args], capture_output=True, text=True,
                          env=ENV, timeout=120)


def doc_of(r):
    return dmem.model(observe.read(Host(r), gpu=False))


def test_plan_frees_the_difference_with_a_margin_through_memory_reclaim():
    doc = doc_of(FIX / "gb10-4k")
    need = 100 * GIB
    p = decide.plan(doc, need, cgroup_reclaim="/sys/fs/cgroup/memory.reclaim", drop_caches="d", compact="c")
    short = need - doc["free_now_bytes"]
    assert p["possible"] and p["short_bytes"] == short
    first = p["steps"][0]
    assert first["action"] == "memory-reclaim" and int(first["value"]) == short + short // 16
    assert p["steps"][-1]["action"] == "compact-if-short"


def test_plan_without_cgroup2_drops_caches_and_says_it_drops_more():
    p = decide.plan(doc_of(FIX / "gb10-4k"), 100 * GIB, cgroup_reclaim=None, drop_caches="/proc/sys/vm/drop_caches",
                    compact="c")
    assert p["steps"][0]["action"] == "drop-caches" and p["steps"][0]["value"] == "1"
    assert "more than needed" in p["steps"][0]["why"] and "74.13 GiB reclaimable" in p["steps"][0]["why"]


def test_plan_refuses_more_than_is_reclaimable_and_asks_nothing_when_free():
    doc = doc_of(FIX / "gb10-4k")
    p = decide.plan(doc, 120 * GIB, cgroup_reclaim=None, drop_caches="d", compact="c")
    assert not p["possible"] and p["text"].startswith("cannot: 4.35 GiB more than is reclaimable")
    p = decide.plan(doc, 10 * GIB, cgroup_reclaim="m", drop_caches="d", compact="c")
    assert p["possible"] and p["short_bytes"] == 0 and [s["action"] for s in p["steps"]] == ["compact-if-short"]
    # the cap: never ask memory.reclaim for more than MemAvailable - MemFree
    p = decide.plan(doc, doc["free_after_reclaim_bytes"], cgroup_reclaim="m", drop_caches="d", compact="c")
    assert int(p["steps"][0]["value"]) == doc["reclaimable_gap_bytes"]


def test_reclaim_writes_the_knobs_and_reports_before_and_after(tmp_path):
    r = root(tmp_path)
    out = cli("--root", str(r), "reclaim", "--need", "60G", "--json")
    assert out.returncode == 1, out.stderr          # the fixture's meminfo does not move: not met
    res = json.loads(out.stdout)
    assert {"free_before_bytes", "free_after_bytes", "reclaimed_bytes", "seconds", "met"} <= set(res)
    assert res["met"] is False and res["reclaimed_bytes"] == 0 and res["method"] == "memory.reclaim"
    short = 60 * GIB - res["free_before_bytes"]
    assert (r / KNOBS[0]).read_text() == str(short + decide.margin(short))
    assert (r / KNOBS[1]).read_text() == ""          # memory.reclaim is there: the page cache stays
    assert (r / KNOBS[2]).read_text() == "1"         # 886 free 2 MiB blocks (1.7 GiB) < 60 GiB: compacted
    text = cli("--root", str(r), "reclaim", "--need", "60G").stdout
    assert "Met: no, 18.48 GiB short" in text and "memory-reclaim" in text


def test_reclaim_falls_back_to_drop_caches_and_skips_compaction_when_blocks_suffice(tmp_path):
    r = root(tmp_path, "gb10-64k", knobs=KNOBS[1:])
    out = cli("--root", str(r), "reclaim", "--need", "1G", "--json")
    res = json.loads(out.stdout)
    assert out.returncode == 0 and res["met"] is True, out.stdout + out.stderr    # 7.43 GiB free already
    assert [s["action"] for s in res["steps"]] == ["compact-if-short"] and "skipped" in res["steps"][0]
    assert (r / KNOBS[2]).read_text() == ""
    out = cli("--root", str(r), "reclaim", "--need", "50G", "--json")
    res = json.loads(out.stdout)
    assert res["method"] == "drop_caches" and (r / KNOBS[1]).read_text() == "1"


def test_a_knob_the_kernel_lacks_is_a_failed_step_not_a_new_file(tmp_path):
    r = root(tmp_path, knobs=())
    out = cli("--root", str(r), "reclaim", "--need", "60G", "--json")
    res = json.loads(out.stdout)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert res["steps"][0]["ok"] is False and "drop_caches" in res["steps"][0]["error"]
    assert not (r / KNOBS[1]).exists()


def test_cannot_is_exit_1_and_writes_nothing(tmp_path):
    r = root(tmp_path)
    out = cli("--root", str(r), "reclaim", "--need", "120G")
    assert out.returncode == 1
    assert "error[cannot-reclaim]: cannot: 4.35 GiB more than is reclaimable" in out.stderr
    assert all((r / k).read_text() == "" for k in KNOBS)
    out = cli("--root", str(r), "reclaim", "--need", "120G", "--json")
    assert json.loads(out.stdout)["error"]["code"] == "cannot-reclaim"


def test_dry_run_plans_and_changes_nothing(tmp_path):
    r = root(tmp_path)
    out = cli("--root", str(r), "reclaim", "--need", "60G", "--dry-run", "--json")
    res = json.loads(out.stdout)
    assert out.returncode == 0 and res["dry_run"] is True and res["met"] is None
    assert [s["action"] for s in res["steps"]] == ["memory-reclaim", "compact-if-short"]
    assert all((r / k).read_text() == "" for k in KNOBS)


def test_bad_size_is_usage():
    out = cli("--root", str(FIX / "gb10-4k"), "reclaim", "--need", "a lot")
    assert out.returncode == 2 and "error[usage]" in out.stderr


def test_a_user_without_the_daemon_is_refused_with_a_runnable_remedy():
    needs.require("setpriv")
    needs.root("runs the command as uid 65534 (run as root, as CI does)")
    out = cli("reclaim", "--need", "1G", user="nobody")
    assert out.returncode == 1 and "error[not-permitted]" in out.stderr, out.stderr
    assert "'sudo spark-memsaver reclaim --need 1G'" in out.stderr


@pytest.mark.dbus
def test_prepare_launch_over_dbus_is_a_polkit_job(tmp_path):
    """PrepareLaunch(need_bytes, {}): root's call runs act/reclaim as a job on the daemon's root; uid 65534 is
    refused (no polkit grant); a need of 0 is an invalid argument."""
    from spark_memsaver.service import names
    from tests.test_dbus import Daemon, Monitor, _need, busctl, dbus_error, gdbus_call, job_id
    from tests.support import sparkroot
    from tests.support.privatebus import PrivateSystemBus
    _need("dbus-daemon", "gdbus", "setpriv", "depmod", "gcc")
    needs.root("the bus tests run the daemon as root and a caller as uid 65534 (run as root, as CI does)")
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="spark-memsaver-bus."))
    bus = PrivateSystemBus(d).start()
    spark = sparkroot.make_spark_root(tmp_path / "root")
    for k in KNOBS[1:]:
        (spark / k).parent.mkdir(parents=True, exist_ok=True)
        (spark / k).write_text("")
    daemon = Daemon(bus, spark, tmp_path / "daemon.log")
    mon = Monitor(bus, tmp_path)
    try:
        daemon.wait_idle()
        assert dbus_error(gdbus_call(bus, "PrepareLaunch", "1073741824", "{}", user="nobody")) == \
            names.ERROR_NOT_AUTHORIZED
        assert dbus_error(gdbus_call(bus, "PrepareLaunch", "0", "{}")) == names.ERROR_INVALID_ARGUMENT
        need = 105 * GIB            # the root: 96.5 GiB free, 114.3 GiB available
        jid = job_id(gdbus_call(bus, "PrepareLaunch", str(need), "{}"))
        mon.wait_for(rf"JobFinished \(uint32 {jid}, 'prepare-launch', true")
        job = json.loads(json.loads(busctl("call", names.BUS_NAME, names.OBJECT_PATH, names.INTERFACE, "GetJob",
                                           "u", str(jid), "--json=short", bus=bus).stdout)["data"][0])
        assert job["state"] == "succeeded" and job["operation"] == "prepare-launch"
        res = job["result"]
        assert res["need_bytes"] == need and res["method"] == "drop_caches" and res["met"] is False
        assert (spark / KNOBS[1]).read_text() == "1"
    finally:
        mon.stop()
        daemon.stop()
        bus.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_memory_reclaim_that_cannot_be_written_falls_back_to_drop_caches(tmp_path):
    """spark-memsaverd's unit mounts /sys/fs/cgroup read-only (ProtectControlGroups=yes): PrepareLaunch's write to
    memory.reclaim fails there (EROFS). A directory in its place stands in for that failure here (EISDIR): the run
    says why and drops caches instead, rather than reclaiming nothing."""
    r = root(tmp_path, knobs=KNOBS[1:])
    (r / KNOBS[0]).mkdir(parents=True)
    res = json.loads(cli("--root", str(r), "reclaim", "--need", "60G", "--json").stdout)
    acts = [(s["action"], s["ok"]) for s in res["steps"]]
    assert acts[:2] == [("memory-reclaim", False), ("drop-caches", True)], acts
    assert res["method"] == "drop_caches" and "memory.reclaim could not be written" in res["steps"][1]["why"]
    assert (r / KNOBS[1]).read_text() == "1"
