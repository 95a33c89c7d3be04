"""host/fsutil.py and host/events.py behaviours that a mutation run (tools/mutation-run, issue 29 item 3) found
unguarded by the fast tests: each test pins one behaviour a user or a reader relies on and names the mutants it
kills."""

from __future__ import annotations

import json
import os
import stat

import pytest

from spark_memsaver.host import Host, events, fsutil


# --- host/fsutil.py ------------------------------------------------------------------------------------------

def test_atomic_write_default_mode_and_new_parents(tmp_path):
    """A record is world-readable, writable by root only, never executable; a missing state directory is
    made 0755 (kills: default mode 0o644 -> 0o645, makedirs mode 0o755 -> 0o756)."""
    old = os.umask(0)                                   # the modes as asked, not as the umask cuts them
    try:
        target = tmp_path / "state" / "record.json"
        fsutil.atomic_write(target, "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o755
    assert target.read_text() == "{}\n"


def test_atomic_write_is_durable_by_default_and_not_when_asked(tmp_path, monkeypatch):
    """By default the file and then its directory are fsynced (a power loss after the call keeps the new
    record); durable=False skips both (kills: durable default True -> False)."""
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    fsutil.atomic_write(tmp_path / "r", b"x")
    assert synced == [False, True]
    synced.clear()
    fsutil.atomic_write(tmp_path / "r", b"y", durable=False)
    assert synced == [] and (tmp_path / "r").read_bytes() == b"y"


def test_atomic_write_temp_is_hidden_beside_target_and_removed_on_failure(tmp_path, monkeypatch):
    """While it is written the new content lives in a hidden ``.name.*.tmp`` beside the target (readers that
    list the directory skip dot files); a failed write leaves the old content and no stray file (kills: the
    temp name's shape)."""
    (tmp_path / "rec.json").write_text("old\n")
    seen = []

    def fsync(fd):
        seen.extend(sorted(os.listdir(tmp_path)))
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError):
        fsutil.atomic_write(tmp_path / "rec.json", "new\n")
    tmp = [n for n in seen if n != "rec.json"]
    assert len(tmp) == 1 and tmp[0].startswith(".rec.json.") and tmp[0].endswith(".tmp"), seen
    assert os.listdir(tmp_path) == ["rec.json"] and (tmp_path / "rec.json").read_text() == "old\n"


def test_atomic_write_never_reuses_a_taken_temp_name(tmp_path, monkeypatch):
    """A stray temp file (or a planted link) of the same name is never opened: after 100 taken names the write
    fails naming its target, the stray untouched (kills: the error's wording)."""
    monkeypatch.setattr(fsutil, "_token", lambda: "feedbeef")
    stray = tmp_path / ".rec.json.feedbeef.tmp"
    stray.write_text("stray\n")
    with pytest.raises(FileExistsError) as e:
        fsutil.atomic_write(tmp_path / "rec.json", "new\n")
    assert str(e.value) == f"no free temporary name beside {tmp_path / 'rec.json'}"
    assert stray.read_text() == "stray\n" and not (tmp_path / "rec.json").exists()


def test_loads_strict_keeps_fractions_and_refuses_what_json_has_not(tmp_path):
    """Fractional numbers (memory samples, event fields) read back as they were written; NaN, Infinity and
    numbers overflowing to inf are refused, so the event reader skips that line and keeps the others (kills:
    ``v = None`` and the negated isfinite test in _finite)."""
    assert fsutil.loads_strict('{"used_gib": 1.5, "n": -2.25e3}') == {"used_gib": 1.5, "n": -2250.0}
    for bad in ('{"a": NaN}', '{"a": Infinity}', '{"a": -Infinity}', '{"a": 1e400}'):
        with pytest.raises(ValueError):
            fsutil.loads_strict(bad)
    h = Host(tmp_path)
    p = h.path(events.EVENTS)
    p.parent.mkdir(parents=True)
    good = {"time": "2026-12-02T10:00:00Z", "op": "build", "seconds": 12.5}
    p.write_text(json.dumps(good) + "\n" + '{"time": "2026-12-02T10:00:01Z", "op": "build", "seconds": 1e400}\n')
    assert events.read_counted(h) == ([good], 1)
