"""Odd lines in the monitoring history and the event log (service/history.py, host/events.py, the `history` and
`events` commands, the Monitor's GLib timer): a line that is valid JSON with a time that is not a finite epoch in
a sane range (`1e300`, `NaN`, `Infinity`, a string, a year 1900) is skipped and counted, never used. Before:
the history's segment rename failed forever (current.jsonl and the in-memory list grew without bound), NaN
raised inside the GLib timer callback (the timer was removed: sampling and the textfile stopped) and both
commands exited 3.

Real parts: the real Monitor on a Spark-like root (tests/support/sparkroot.py), a real GLib main loop, the
commands in a subprocess.
"""

from __future__ import annotations

import json
import math
import time

import pytest

from spark_memsaver.host import Host
from spark_memsaver.host import events as ev
from spark_memsaver.service import history as hist
from tests.support import sparkroot
from tests.test_history import cli, monitor

BAD_SAMPLE_LINES = ['{"time": 1e300, "reason": "interval"}', '{"time": NaN, "reason": "interval"}',
                    '{"time": Infinity, "reason": "interval"}', '{"time": -Infinity}', '{"time": true}',
                    '{"time": "2026-12-01"}', '{"time": -5}', '{"time": 1e12}', '[1, 2]', '"text"', 'nul\x00l']
NOW = time.time()


def _no_constant(name):
    raise AssertionError(f"{name} in the JSON output")


def _good(t):
    return json.dumps({"time": t, "reason": "interval", "mem_available": 1 << 30})


def _history_root(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r", uvm_loaded="ours", ours_installed="580.142")
    d = root / "var/lib/spark-memsaver/history"
    d.mkdir(parents=True, exist_ok=True)
    return root, d


@pytest.mark.parametrize("bad", BAD_SAMPLE_LINES[:3])
def test_a_bad_time_in_current_never_blocks_rotation(tmp_path, bad):
    root, d = _history_root(tmp_path)
    (d / "current.jsonl").write_text(bad + "\n" + _good(NOW - 60) + "\n")
    m = monitor(root)
    for _ in range(hist.SEGMENT + 5):
        assert m._on_timer() is True
    segs = hist.segments(str(d))
    assert len(segs) == 1, segs                       # rotated once, to a sane name
    assert len(m.persisted._current) <= 6             # the in-memory list did not keep growing
    assert len((d / "current.jsonl").read_text().splitlines()) <= 6
    rows = hist.read(Host(str(root)))
    assert len(rows) == hist.SEGMENT + 6 and all(math.isfinite(r["time"]) for r in rows)
    assert m.persisted.skipped == 1


def test_a_failed_rotation_resets_the_buffer(tmp_path):
    root, d = _history_root(tmp_path)
    h = hist.History(Host(str(root)), 60)
    t0 = 1_800_000_000.0
    (d / f"seg-{int(t0 * 1000):015d}.jsonl").mkdir()       # the segment's name is taken by a directory
    for i in range(hist.SEGMENT):
        h.append({"time": t0 + i, "reason": "interval"})
    assert h._current == []                                # not kept (and rewritten) for ever
    h.append({"time": t0 + hist.SEGMENT, "reason": "interval"})
    assert len((d / "current.jsonl").read_text().splitlines()) == 1


def test_a_failing_write_keeps_the_buffer_bounded(tmp_path):
    """The history directory cannot be written at all (its path taken by a file: ENOTDIR/EEXIST, as a read-only
    or full file system would fail): samples are dropped past one segment, never kept in memory without end
    (before: every sample stayed in the list, and the whole list was joined again at each sample). Writing
    resumes when the directory can be made again."""
    root, d = _history_root(tmp_path)
    d.rmdir()
    d.write_text("not a directory\n")
    h = hist.History(Host(str(root)), 60)
    t0 = 1_800_000_000.0
    for i in range(hist.SEGMENT * 4):
        assert h.append({"time": t0 + i, "reason": "interval"}) is False
    assert len(h._current) <= hist.SEGMENT, len(h._current)
    d.unlink()
    assert h.append({"time": t0 + hist.SEGMENT * 4, "reason": "interval"}) is True
    rows = hist.read(Host(str(root)))
    assert 1 <= len(rows) <= hist.SEGMENT and rows[-1]["time"] == t0 + hist.SEGMENT * 4


def test_the_sampler_keeps_its_glib_timer_when_a_sample_fails(tmp_path):
    """A real GLib main loop with the monitor's own 1 s timer; each sample's consumer raises."""
    from gi.repository import GLib
    root, _ = _history_root(tmp_path)
    m = monitor(root, interval=1)
    calls = []

    def boom(s):
        calls.append(s)
        raise ValueError("cannot convert float NaN to integer")
    m._on_sample = boom
    loop = GLib.MainLoop()
    m._arm_timer()
    GLib.timeout_add(3500, loop.quit)
    loop.run()
    GLib.source_remove(m._timer)
    assert len(calls) >= 2, calls                          # the timer survived the first failure


def test_history_command_skips_and_counts_bad_lines(tmp_path):
    root, d = _history_root(tmp_path)
    (d / "current.jsonl").write_text("\n".join(BAD_SAMPLE_LINES + [_good(NOW - 120), _good(NOW - 60)]) + "\n")
    r = cli("--root", str(root), "history")              # before: exit 3 (OverflowError on 1e300, ValueError on NaN)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 3, (r.returncode, r.stdout + r.stderr)
    r = cli("--root", str(root), "history", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(r.stdout, parse_constant=_no_constant)   # strict JSON: no NaN/Infinity in it
    assert [round(x["time"]) for x in rows] == [round(NOW - 120), round(NOW - 60)]
    assert f"{len(BAD_SAMPLE_LINES)} unreadable lines skipped" in r.stderr


BAD_EVENT_LINES = ['{"time": 1e300, "op": "install", "ok": true}', '{"time": NaN, "op": "install"}',
                   '{"time": Infinity, "op": "install"}', '{"time": "1900-01-01T00:00:00Z", "op": "build"}',
                   '{"time": "2026-12-01T10:00:00Z", "op": {"x": 1}}',
                   '{"time": "2026-12-01T10:00:00Z", "op": "build", "error": "text"}',
                   '{"time": "2026-12-01T10:00:00Z", "op": "build", "steps": ["a"]}',
                   '{"time": "2026-12-01T10:00:00Z", "op": "build", "kernel": [5]}', '[]',
                   '{"time": "2026-12-01T10:00:00Z", "op": "build", "x": 1e400}']


def test_events_command_skips_and_counts_bad_lines(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r")
    p = root / "var/lib/spark-memsaver/events.jsonl"
    p.parent.mkdir(parents=True, exist_ok=True)
    good = json.dumps({"time": "2026-12-01T11:00:00Z", "op": "install", "ok": True, "kernel": "6.8.0-1"})
    p.write_text("\n".join(BAD_EVENT_LINES + [good]) + "\n")
    for args in (("events",), ("events", "--json"), ("events", "--since", "2026-11-30")):
        r = cli("--root", str(root), *args)              # before: `events` exit 3 (AttributeError)
        assert r.returncode == 0, (args, r.returncode, r.stdout + r.stderr)
        assert f"{len(BAD_EVENT_LINES)} unreadable lines skipped" in r.stderr
        assert "6.8.0-1" in r.stdout
    rows, skipped = ev.read_counted(Host(str(root)))
    assert rows == [json.loads(good)] and skipped == len(BAD_EVENT_LINES)
