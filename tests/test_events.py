"""The lifecycle event log (issue 15, item 6): host/events.py's events.jsonl, written once per finished
act/executor.perform() (real operations against tests/support/sparkroot.py roots, through the real CLI in a
subprocess), listed by `spark-memsaver events [--json]`; append-only, bounded, torn lines skipped."""

import json
import os
import subprocess
from pathlib import Path

from spark_memsaver.host import Host, events
from tests.support import sparkroot

REPO = Path(__file__).resolve().parent.parent


def cli(*args):
    e = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    e.pop("SPARK_MEMSAVER_CONFIG", None)
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", *args], capture_output=True, text=True,
                       env=e, timeout=300, cwd=str(REPO))
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_operations_become_events(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r", uvm_loaded="ours", ours_installed="580.142")
    r = cli("--root", str(root), "rollback", "--reason", "test: back to stock")
    evs = json.loads(cli("--root", str(root), "events", "--json").stdout)
    assert len(evs) == 1 and evs[0]["op"] == "rollback", evs
    assert evs[0]["ok"] is (r.returncode == 0), (r.returncode, r.stdout, r.stderr, evs)
    assert evs[0]["time"].endswith("Z") and evs[0].get("reason") == "test: back to stock"
    # bad usage is no event (issue 27): nothing was attempted -- a typo'd --kernel, --kernel with --all
    for argv in (("build", "--kernel", "9.9.9-not-here"), ("install", "--kernel", "9.9.9-not-here"),
                 ("install", "--kernel", sparkroot.SPARK_KERNEL, "--all")):
        r2 = cli("--root", str(root), *argv)
        assert r2.returncode == 2, (argv, r2.stdout, r2.stderr)
    assert len(json.loads(cli("--root", str(root), "events", "--json").stdout)) == 1
    # a refused build (the kernel's headers are gone) is an event, with the named error
    (root / f"lib/modules/{sparkroot.SPARK_KERNEL}/build").unlink()
    r2 = cli("--root", str(root), "build", "--kernel", sparkroot.SPARK_KERNEL)
    assert r2.returncode == 1, (r2.stdout, r2.stderr)
    evs = json.loads(cli("--root", str(root), "events", "--json").stdout)
    assert [e["op"] for e in evs] == ["rollback", "build"], evs
    assert evs[1]["ok"] is False and evs[1]["error"]["code"] == "headers-missing"
    assert evs[1]["kernel"] == sparkroot.SPARK_KERNEL
    text = cli("--root", str(root), "events").stdout.splitlines()
    assert text[0].split()[:4] == ["TIME", "(UTC)", "OPERATION", "RESULT"]
    assert text[2].split()[2:4] == ["build", "failed"] and sparkroot.SPARK_KERNEL in text[2]
    for argv in (("install", "--dry-run"), ("remove", "--dry-run"), ("rollback", "--dry-run")):
        cli("--root", str(root), *argv)
    # a dry run is no event
    cli("--root", str(root), "reconcile", "--dry-run")
    assert len(json.loads(cli("--root", str(root), "events", "--json").stdout)) == 2


def test_bounded_append_only_and_torn_lines(tmp_path, monkeypatch):
    host = Host(str(tmp_path))
    monkeypatch.setattr(events, "MAX_BYTES", 4096)
    for i in range(200):
        assert events.record(host, "install", {"kernel": f"k{i}"}, result={"ok": True})
    p = tmp_path / "var/lib/spark-memsaver/events.jsonl"
    assert p.stat().st_size <= 4096 + 300
    got = events.read(host)
    assert got[-1]["kernel"] == "k199" and 10 < len(got) < 200
    assert [int(e["kernel"][1:]) for e in got] == list(range(200 - len(got), 200))
    with open(p, "a") as f:
        f.write('{"op": "install", "ti')           # a crash midway through a line
    assert len(events.read(host)) == len(got)
    try:
        events.record(host, "format-disk")
    except ValueError as e:
        assert "unknown event kind" in str(e)
    else:
        raise AssertionError("an unknown kind must be refused")


def test_unwritable_log_does_not_fail_the_operation(tmp_path):
    host = Host(str(tmp_path))
    (tmp_path / "var/lib/spark-memsaver/events.jsonl").mkdir(parents=True)
    assert events.record(host, "remove", {"kernel": "k"}, result={"ok": True}) is False


def test_no_events_yet(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r")
    r = cli("--root", str(root), "events")
    assert r.returncode == 0 and r.stdout.strip() == "no events."
    assert json.loads(cli("--root", str(root), "events", "--json").stdout) == []
