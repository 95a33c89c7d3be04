"""The lifecycle event log (issue 15, item 6): host/events.py's events.jsonl, written once per finished
act/executor.perform() (real operations against tests/support/sparkroot.py roots, through the real CLI in a
subprocess), listed by `spark-memsaver events [--json]`; append-only, bounded, torn lines skipped."""

import json
import multiprocessing
import os
import subprocess
import time
from pathlib import Path

import pytest

from spark_memsaver.host import Host, events
from spark_memsaver.host.fsutil import atomic_write
from tests.support import sparkroot

REPO = Path(__file__).resolve().parent.parent


def cli(*args):
    e = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    e.pop("SPARK_MEMSAVER_CONFIG", None)
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", *args], capture_output=True, text=True,
                       env=e, timeout=300, cwd=str(REPO))
    assert "Traceback" not in r.stderr, r.stderr
    return r


def ops(text: str) -> list[dict]:
    """The operations' events (not the steps, hook runs and rollback records the one log also holds)."""
    return [e for e in json.loads(text) if e["op"] in events.KINDS]


def test_operations_become_events(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r", uvm_loaded="ours", ours_installed="580.142")
    r = cli("--root", str(root), "rollback", "--reason", "test: back to stock")
    every = json.loads(cli("--root", str(root), "events", "--json").stdout)
    # the one log: the rollback record written inside the operation, then the operation's event
    assert [e["op"] for e in every] == ["rolled-back", "rollback"], every
    assert every[0]["kernel"] == sparkroot.SPARK_KERNEL and every[0]["code"] == "requested"
    evs = ops(cli("--root", str(root), "events", "--json").stdout)
    assert len(evs) == 1 and evs[0]["op"] == "rollback", evs
    assert evs[0]["ok"] is (r.returncode == 0), (r.returncode, r.stdout, r.stderr, evs)
    assert evs[0]["time"].endswith("Z") and evs[0].get("reason") == "test: back to stock"
    # bad usage is no event (issue 27): nothing was attempted -- a typo'd --kernel, --kernel with --all
    for argv in (("build", "--kernel", "9.9.9-not-here"), ("install", "--kernel", "9.9.9-not-here"),
                 ("install", "--kernel", sparkroot.SPARK_KERNEL, "--all")):
        r2 = cli("--root", str(root), *argv)
        assert r2.returncode == 2, (argv, r2.stdout, r2.stderr)
    assert len(ops(cli("--root", str(root), "events", "--json").stdout)) == 1
    # a refused build (the kernel's headers are gone) is an event, with the named error
    (root / f"lib/modules/{sparkroot.SPARK_KERNEL}/build").unlink()
    r2 = cli("--root", str(root), "build", "--kernel", sparkroot.SPARK_KERNEL)
    assert r2.returncode == 1, (r2.stdout, r2.stderr)
    evs = ops(cli("--root", str(root), "events", "--json").stdout)
    assert [e["op"] for e in evs] == ["rollback", "build"], evs
    assert evs[1]["ok"] is False and evs[1]["error"]["code"] == "headers-missing"
    assert evs[1]["kernel"] == sparkroot.SPARK_KERNEL
    text = cli("--root", str(root), "events").stdout.splitlines()
    assert text[0].split()[:4] == ["TIME", "(UTC)", "OPERATION", "RESULT"]
    assert text[1].split()[2:4] == ["rolled-back", "-"] and "test: back to stock" in text[1]   # no result
    assert text[3].split()[2:4] == ["build", "failed"] and sparkroot.SPARK_KERNEL in text[3]
    for argv in (("install", "--dry-run"), ("remove", "--dry-run"), ("rollback", "--dry-run")):
        cli("--root", str(root), *argv)
    # a dry run is no event
    cli("--root", str(root), "reconcile", "--dry-run")
    assert len(ops(cli("--root", str(root), "events", "--json").stdout)) == 2


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


def _writer(root: str, name: str, n: int, max_bytes: int, inherited: int | None = None) -> None:
    if inherited is not None:
        os.close(inherited)             # the parent's locked descriptor, copied by fork: not this writer's
    events.MAX_BYTES = max_bytes
    host = Host(root)
    for i in range(n):
        assert events.note(host, "hook", source=name, acting=i, ok=True)


def test_two_processes_lose_no_line(tmp_path):
    """A hook writes outside the lifecycle lock while an operation writes inside it: both append to the one log at
    once, each line one O_APPEND write. Before (history.jsonl: read, add a line, rewrite) about a third of such
    lines went missing; now all 2 x 300 are there, each writer's in its order."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), name, 300, 1 << 20)) for name in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    rows, skipped = events.read_counted(Host(str(tmp_path)))
    assert skipped == 0
    for name in ("a", "b"):
        assert [e["acting"] for e in rows if e["source"] == name] == list(range(300))


def test_a_line_written_during_a_rotation_is_kept(tmp_path):
    """A rotation (the log past MAX_BYTES) renames a new file over the log while holding the log's lock; a writer
    that comes meanwhile waits for the lock, sees the log renamed under it, reopens it and appends there. Without
    that its line went to the file the rotation had just replaced."""
    import fcntl
    host = Host(str(tmp_path))
    assert events.note(host, "hook", source="first", ok=True)
    p = tmp_path / "var/lib/spark-memsaver/events.jsonl"
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    fcntl.flock(fd, fcntl.LOCK_EX)                      # a rotation in progress, as events._trim runs it
    ctx = multiprocessing.get_context("fork")
    w = ctx.Process(target=_writer, args=(str(tmp_path), "during", 1, 1 << 20, fd))
    w.start()
    time.sleep(0.5)
    assert "during" not in p.read_text()                # it waits for the rotation
    kept = p.read_bytes()
    atomic_write(str(p), kept, 0o644)                   # the rotation's rename
    os.close(fd)
    w.join(60)
    assert w.exitcode == 0
    assert [e["source"] for e in events.read(host)] == ["first", "during"]


def test_an_older_history_file_is_read_then_folded_in(tmp_path):
    """An older install's second log (history.jsonl, "event" lines) is read as the log's older segment -- by a reader
    that never writes (an image inspected with --root) -- and folded into the one log, in time order, by the next
    writer; a line that cannot be read is kept as it was (and skipped, counted, as before)."""
    d = tmp_path / "var/lib/spark-memsaver"
    d.mkdir(parents=True)
    old = [{"event": "rolled-back", "kernel": "k1", "time": "2026-01-01T10:00:00Z", "reason": "driver changing",
            "code": "driver-changing", "schema": 1},
           {"event": "remove-override", "kernel": "k1", "time": "2026-01-01T10:00:01Z", "reason": "r", "ok": True},
           {"event": "apt-pre-install", "time": "2026-01-01T10:00:02Z", "packages": ["nvidia-dkms 1 -> 2"],
            "sources_seen": ["580.142"], "removed": ["k1"], "kept": []}]
    (d / "history.jsonl").write_text("".join(json.dumps(x) + "\n" for x in old) + '{"event": "hook", "ti\n')
    (d / "events.jsonl").write_text(json.dumps({"time": "2026-01-01T10:00:01Z", "op": "install", "ok": True}) + "\n")
    host = Host(str(tmp_path))
    rows, skipped = events.read_counted(host)
    assert [(e["op"], e.get("action")) for e in rows] == [("rolled-back", None), ("step", "remove-override"),
                                                          ("install", None), ("apt-pre-install", None)]
    assert rows[3]["removed"] == ["k1"] and skipped == 1
    assert (d / "history.jsonl").exists()                  # a reader changed nothing
    assert events.note(host, "hook", source="dpkg-trigger", ok=True)
    assert not (d / "history.jsonl").exists()
    after, skipped = events.read_counted(host)
    assert after[:4] == rows and after[4]["op"] == "hook" and skipped == 1
    assert all("event" not in e for e in after)


def test_an_older_history_link_is_not_copied(tmp_path):
    d = tmp_path / "var/lib/spark-memsaver"
    d.mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.write_text(json.dumps({"event": "hook", "time": "2026-01-01T10:00:00Z", "key": "PRIVATE"}) + "\n")
    (d / "history.jsonl").symlink_to(secret)
    assert events.note(Host(str(tmp_path)), "hook", source="x", ok=True)     # recorded all the same
    assert "PRIVATE" not in (d / "events.jsonl").read_text()
