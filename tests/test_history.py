"""Persisted monitoring history (issue 15, item 6): service/history.py under STATE_DIR/history/, written by the
real Monitor.sample() against a Spark-like root (tests/support/sparkroot.py), read by the real
`spark-memsaver history` in a subprocess without any daemon; bounded to 7 days at the interval, rotated,
every file replaced atomically (never a half-written file), --since durations and UTC times."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from spark_memsaver import config as cfg, record
from spark_memsaver.host import Host
from spark_memsaver.service import history as hist
from spark_memsaver.service.monitor import Monitor
from tests.support import sparkroot

REPO = Path(__file__).resolve().parent.parent


def cli(*args):
    e = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    e.pop("SPARK_MEMSAVER_CONFIG", None)
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", *args], capture_output=True, text=True,
                       env=e, timeout=120, cwd=str(REPO))
    assert "Traceback" not in r.stderr, r.stderr
    return r


def monitor(root, interval=60):
    c = record.replace(cfg.load(None, root=str(root)), interval=interval)
    return Monitor(Host(str(root)), c, on_sample=lambda s: None, on_module_event=lambda a, b: None,
                   on_paths_changed=lambda p: None)


def test_monitor_samples_are_read_back_by_the_command_without_a_daemon(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r", uvm_loaded="ours", ours_installed="580.142")
    m = monitor(root)
    taken = [m.sample("interval") for _ in range(3)]
    d = root / "var/lib/spark-memsaver/history"
    assert (d / "current.jsonl").is_file()
    r = cli("--root", str(root), "history", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert [s["time"] for s in got] == [s["time"] for s in taken]
    assert got[-1]["saved_bytes"] == taken[-1]["saved_bytes"] and got[-1]["saved_bytes"] > 0
    assert not any(k.startswith("_") for s in got for k in s)
    text = cli("--root", str(root), "history").stdout
    assert text.splitlines()[0].split()[:4] == ["TIME", "(UTC)", "AVAILABLE", "GiB"]
    assert len(text.splitlines()) == 4 and "interval" in text.splitlines()[-1]
    # a new monitor (daemon restart) continues the same file
    m2 = monitor(root)
    m2.sample("settled")
    assert len(json.loads(cli("--root", str(root), "history", "--json").stdout)) == 4


def test_bounded_to_seven_days_at_the_interval_and_rotated(tmp_path):
    host = Host(str(tmp_path))
    interval = 3600                      # 168 samples in 7 days
    h = hist.History(host, interval)
    t0 = 1_700_000_000.0
    n = 1000
    for i in range(n):
        assert h.append({"time": t0 + i * interval, "reason": "interval", "saved_bytes": i})
    d = tmp_path / "var/lib/spark-memsaver/history"
    segs = hist.segments(str(d))
    assert 1 <= len(segs) <= -(-hist.capacity(interval) // hist.SEGMENT)
    got = hist.read(host)
    assert hist.capacity(interval) <= len(got) <= hist.capacity(interval) + 2 * hist.SEGMENT
    assert got[-1]["saved_bytes"] == n - 1
    assert [s["time"] for s in got] == sorted(s["time"] for s in got)
    # nothing older than the window survives beyond one segment's span
    assert got[0]["time"] >= t0 + (n - 1) * interval - hist.RETENTION_S - hist.SEGMENT * interval
    assert not [p for p in os.listdir(d) if p.endswith(".tmp")]


def test_age_pruning_and_since(tmp_path):
    host = Host(str(tmp_path))
    h = hist.History(host, 60)
    now = time.time()
    old = now - 10 * 86400
    for i in range(hist.SEGMENT):                 # one closed segment, ten days old
        h.append({"time": old + i, "reason": "interval"})
    for i in range(hist.SEGMENT):                 # another, from the last two hours
        h.append({"time": now - 7200 + i * 60, "reason": "interval"})
    h.append({"time": now, "reason": "settled"})
    assert all(s["time"] > now - 86400 for s in hist.read(host)), "the 10-day-old segment must be gone"
    r = cli("--root", str(tmp_path), "history", "--json", "--since", "30m")
    got = json.loads(r.stdout)
    assert got and all(s["time"] >= now - 1800 - 5 for s in got) and got[-1]["reason"] == "settled"
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - 600))
    got2 = json.loads(cli("--root", str(tmp_path), "history", "--json", "--since", stamp).stdout)
    assert got2 and all(s["time"] >= now - 601 for s in got2) and len(got2) < len(got)
    r = cli("--root", str(tmp_path), "history", "--since", "yesterday-ish")
    assert r.returncode == 2 and "remedy:" in r.stderr


def test_torn_or_foreign_lines_are_skipped_and_writes_are_whole_files(tmp_path):
    host = Host(str(tmp_path))
    h = hist.History(host, 60)
    h.append({"time": 1.0, "reason": "a"})
    d = tmp_path / "var/lib/spark-memsaver/history"
    ino = (d / "current.jsonl").stat().st_ino
    h.append({"time": 2.0, "reason": "b"})
    assert (d / "current.jsonl").stat().st_ino != ino, "each write must replace the file (rename), not edit it"
    (d / "seg-000000000000000.jsonl").write_text('{"time": 0.5, "reason": "x"}\nnot json\n{"time": "bad"}\n{"ti')
    got = hist.read(host)
    assert [s["reason"] for s in got] == ["x", "a", "b"]


def test_unwritable_directory_is_not_fatal(tmp_path):
    host = Host(str(tmp_path))
    (tmp_path / "var/lib/spark-memsaver").mkdir(parents=True)
    (tmp_path / "var/lib/spark-memsaver/history").write_text("a file where the directory should be")
    assert hist.History(host, 60).append({"time": 1.0}) is False


def test_absent_history_under_root_is_empty_not_an_error(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r")
    r = cli("--root", str(root), "history")
    assert r.returncode == 0 and r.stdout.strip() == "no samples."
    assert json.loads(cli("--root", str(root), "history", "--json").stdout) == []
