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


# --- host/events.py ------------------------------------------------------------------------------------------

OP_KINDS = ("build", "install", "remove", "activate", "rollback", "reconcile", "apt-pre-install", "enroll",
            "enroll-cancel")


def test_every_operation_and_note_kind_is_recorded_and_nothing_else(tmp_path):
    """Each operation executor.perform and the MOK commands finish, and each note the steps, hooks and rollback
    records write, becomes a line; a kind outside them is refused naming it (kills: a kind misspelt in KINDS or
    NOTES, the refusals' wording)."""
    from spark_memsaver.act import executor
    host = Host(str(tmp_path))
    assert set(executor.OPS) <= set(OP_KINDS)
    for op in OP_KINDS:
        assert events.record(host, op) is True, op
    for kind in ("step", "hook", "rolled-back", "rollback-cleared"):
        assert events.note(host, kind) is True, kind
    assert [e["op"] for e in events.read(host)] == [*OP_KINDS, "step", "hook", "rolled-back", "rollback-cleared"]
    with pytest.raises(ValueError) as e:
        events.record(host, "format-disk")
    assert str(e.value) == "unknown event kind 'format-disk'"
    with pytest.raises(ValueError) as e:
        events.note(host, "build")
    assert str(e.value) == "unknown event kind 'build'"


def test_an_operations_event_keeps_its_arguments_and_drops_unset_ones():
    """The arguments an administrator gave are in the event; unset ones (None, False, "") are not, and a value
    that is no scalar is kept as its JSON text (kills: each name of _ARGS misspelt, False -> True and "" -> "XXXX"
    in the unset test)."""
    args = {"kernel": "6.8.0-1", "driver_version": "580.142", "driver": "580", "all_kernels": True, "force": True,
            "reason": "admin", "code": "requested", "remedy": "not an event field", "dry_run": False}
    ev = events.event_of("build", args, {"ok": True})
    assert {k: v for k, v in ev.items() if k != "time"} == {
        "op": "build", "kernel": "6.8.0-1", "driver_version": "580.142", "driver": "580", "all_kernels": True,
        "force": True, "reason": "admin", "code": "requested", "ok": True}
    ev = events.event_of("install", {"kernel": None, "all_kernels": False, "reason": "", "force": 0,
                                     "code": ["a", 1]}, {})
    assert {k: v for k, v in ev.items() if k != "time"} == {"op": "install", "code": '["a", 1]', "ok": True}


def test_a_failed_operation_records_its_error_code_and_message():
    """A failure is ok: false with the error's code (its class name when it has none) and its message, cut at 500
    characters (kills: the "message" key, _short's bound 500 -> 501, < for <=, the "..." marker)."""
    class Refused(Exception):
        code = "headers-missing"
    ev = events.event_of("build", {"kernel": "k"}, {"ok": True, "steps": [{"action": "a"}]}, Refused("no headers"))
    assert ev["ok"] is False and ev["error"] == {"code": "headers-missing", "message": "no headers"}
    assert "steps" not in ev
    assert events.event_of("build", error=OSError("x"))["error"] == {"code": "OSError", "message": "x"}
    exact, long = "m" * 500, "m" * 501
    assert events.event_of("build", error=RuntimeError(exact))["error"]["message"] == exact
    assert events.event_of("build", error=RuntimeError(long))["error"]["message"] == "m" * 500 + "..."


def test_a_finished_operations_event_keeps_its_outcome():
    """ok from the result (true when it does not say), the steps' action/kernel/ok (at most 50, set values only,
    dicts only), changes and recovered as text, the kernel/driver/srcversion/path the result names unless the
    arguments named them, and the APT door's lists (kills: result None or {} handling, ok's default, the steps'
    keys and bound, the copied fields' names, their 'not already set' test)."""
    assert events.event_of("reconcile")["ok"] is True                    # no result at all
    assert events.event_of("reconcile", result={"acting": 1})["ok"] is True
    assert events.event_of("reconcile", result={"ok": False})["ok"] is False
    steps = [{"action": "build", "kernel": "k1", "ok": True, "reason": "not kept"},
             {"action": "install", "kernel": None, "ok": False}, "not a step"] + [{"action": "x"}] * 60
    ev = events.event_of("reconcile", result={"ok": True, "steps": steps})
    assert ev["steps"][:2] == [{"action": "build", "kernel": "k1", "ok": True}, {"action": "install", "ok": False}]
    assert len(ev["steps"]) == 50 and ev["steps"][2] == {"action": "x"}
    assert "steps" not in events.event_of("reconcile", result={"steps": []})
    ev = events.event_of("install", {"kernel": "from-args"},
                         {"changes": ["pkg 1 -> 2"], "recovered": [{"action": "undo-intent"}], "kernel": "from-result",
                          "driver_version": "580.142", "srcversion": "ABC", "path": "/lib/x.ko", "other": "no"})
    assert ev["changes"] == '["pkg 1 -> 2"]' and ev["recovered"] == '[{"action": "undo-intent"}]'
    assert (ev["kernel"], ev["driver_version"], ev["srcversion"], ev["path"]) == \
        ("from-args", "580.142", "ABC", "/lib/x.ko")
    assert "other" not in ev
    ev = events.event_of("install", None, {"kernel": "k2", "driver_version": 580, "path": ["not", "scalar"],
                                           "changes": [], "recovered": None})
    assert ev["kernel"] == "k2" and ev["driver_version"] == 580
    assert "path" not in ev and "changes" not in ev and "recovered" not in ev
    ev = events.event_of("apt-pre-install", result={"packages": ["nvidia-dkms 1 -> 2"], "sources_seen": ["580.142"],
                                                    "removed": ["k1"], "kept": [], "notes": ["x"]})
    assert (ev["packages"], ev["sources_seen"], ev["removed"], ev["kept"]) == \
        (["nvidia-dkms 1 -> 2"], ["580.142"], ["k1"], [])
    assert "notes" not in ev


def test_list_fields_are_bounded_and_other_values_kept_as_scalars_or_text(tmp_path):
    """The APT door's lists keep at most 200 names of at most 200 characters; a list elsewhere is kept as its JSON
    text; numbers, booleans and None as they are (kills: _field's LISTS test negated or 'or', its bounds 200 ->
    201, the scalar test's 'is None' and 'or')."""
    names = ["n" * 201] + [f"pkg{i}" for i in range(300)]
    f = events._field("packages", names)
    assert len(f) == 200 and f[0] == "n" * 200 + "..." and f[1] == "pkg0" and f[199] == "pkg198"
    assert events._field("packages", ["n" * 200]) == ["n" * 200]
    assert events._field("source", ["a", "b"]) == '["a", "b"]'
    assert events._field("packages", "one") == "one"
    for v in (None, 3, 2.5, True, False):
        assert events._field("acting", v) is v
    host = Host(str(tmp_path))
    events.note(host, "hook", source="dpkg-trigger", acting=2, ok=None, _private="x", op="build",
                time="1999-01-01T00:00:00Z", event="install", removed=["k1"], detail={"a": 1})
    ev = events.read(host)[0]
    assert {k: v for k, v in ev.items() if k != "time"} == {
        "op": "hook", "source": "dpkg-trigger", "acting": 2, "removed": ["k1"], "detail": '{"a": 1}'}
    assert ev["time"] != "1999-01-01T00:00:00Z"


def test_a_writer_polls_a_held_lock_every_10_ms_for_5_s_then_appends_unlocked(tmp_path, monkeypatch):
    """A rotation holds the log's lock for a moment: a writer retries every 10 ms and, past LOCK_WAIT (5 s), appends
    without the lock rather than lose the line (kills: LOCK_WAIT 5 -> 6, the sleep 0.01 -> 1.01, > -> >= at the
    deadline). A fake clock that advances by what is slept: no real waiting."""
    import fcntl
    host = Host(str(tmp_path))
    assert events.note(host, "hook", source="first")
    p = tmp_path / "var/lib/spark-memsaver/events.jsonl"
    holder = os.open(p, os.O_WRONLY | os.O_APPEND)
    fcntl.flock(holder, fcntl.LOCK_EX)                 # another open file: its lock conflicts with the writer's
    ms, slept = [0], []

    def sleep(s):
        slept.append(s)
        ms[0] += round(s * 1000)
    monkeypatch.setattr(events.time, "monotonic", lambda: ms[0] / 1000)
    monkeypatch.setattr(events.time, "sleep", sleep)
    try:
        assert events.note(host, "hook", source="second")
    finally:
        os.close(holder)
    assert set(slept) == {0.01} and len(slept) == 501      # 5.000 s is not past the deadline, 5.010 s is
    assert [e["source"] for e in events.read(host)] == ["first", "second"]


def test_a_log_removed_while_it_is_opened_is_reopened(tmp_path, monkeypatch):
    """When the log disappears between the writer's open and its check (a rotation's rename, an administrator's
    rm), the writer opens the log anew and the line is in the file readers read, not in the removed one (kills:
    ``same = True`` on FileNotFoundError)."""
    host = Host(str(tmp_path))
    assert events.note(host, "hook", source="first")
    p = str(tmp_path / "var/lib/spark-memsaver/events.jsonl")
    real, gone = os.stat, []

    def stat(path, *a, **kw):
        if path == p and not gone:
            gone.append(path)
            os.unlink(path)
            raise FileNotFoundError(2, "No such file or directory", path)
        return real(path, *a, **kw)
    monkeypatch.setattr(events.os, "stat", stat)
    assert events.note(host, "hook", source="second")
    assert gone and [e["source"] for e in events.read(host)] == ["second"]


def _log(tmp_path):
    return tmp_path / "var/lib/spark-memsaver/events.jsonl"


def test_the_log_and_its_directory_modes_and_sorted_lines(tmp_path):
    """A new state directory is 0755, the log 0644 also after a rotation and after folding an older file in; each
    line is one JSON object with its keys sorted, the older file's lines too (kills: makedirs 0o755 -> 0o756, the
    rewrite's mode 0o644 -> 0o645 in _trim and _migrate, sort_keys True -> False in _append and _converted)."""
    old = os.umask(0)
    try:
        host = Host(str(tmp_path))
        assert events.note(host, "hook", source="a", acting=1)
        p = _log(tmp_path)
        assert stat.S_IMODE(p.parent.stat().st_mode) == 0o755 and stat.S_IMODE(p.stat().st_mode) == 0o644
        (p.parent / "history.jsonl").write_text(
            json.dumps({"time": "2026-01-01T10:00:00Z", "reason": "r", "kernel": "k1", "event": "rolled-back"}) + "\n")
        assert events.note(host, "step", kernel="k2", action="build", ok=True)
        assert stat.S_IMODE(p.stat().st_mode) == 0o644
        lines = p.read_text().splitlines()
        assert len(lines) == 3
        for line in lines:
            keys = list(json.loads(line))
            assert keys == sorted(keys), line
        import unittest.mock
        with unittest.mock.patch.object(events, "MAX_BYTES", 200):
            for i in range(10):
                assert events.note(host, "hook", source=f"s{i}")
        assert p.stat().st_size <= 300 and stat.S_IMODE(p.stat().st_mode) == 0o644
    finally:
        os.umask(old)


def test_rotation_keeps_the_newest_half_from_a_whole_line(tmp_path, monkeypatch):
    """Past MAX_BYTES (not at it) the log keeps its last MAX_BYTES/2 bytes from the first whole line in them; a cut
    right after a newline keeps the line that starts there (kills: > -> >=, the slice's + and // 3, the newline
    searched for, nl - 1 / nl + 2, nl > 0 and nl >= 1)."""
    host = Host(str(tmp_path))
    p = _log(tmp_path)
    p.parent.mkdir(parents=True)
    monkeypatch.setattr(events, "MAX_BYTES", 400)
    time_ = "2026-12-01T10:00:00Z"

    def line(length, name):           # a line of exactly ``length`` bytes, newline included
        empty = len(json.dumps({"op": "hook", "pad": "", "source": name, "time": time_}, sort_keys=True)) + 1
        return (json.dumps({"op": "hook", "pad": "y" * (length - empty), "source": name, "time": time_},
                           sort_keys=True) + "\n").encode()
    n = len((json.dumps({"op": "hook", "source": "new", "time": time_}, sort_keys=True) + "\n").encode())

    def sources():
        rows, skipped = events.read_counted(host)
        assert skipped == 0
        return [e["source"] for e in rows]
    p.write_bytes(line(400 - n, "a"))
    assert events.note(host, "hook", source="new") and p.stat().st_size == 400
    assert sources() == ["a", "new"]                  # at MAX_BYTES: nothing cut
    assert events.note(host, "hook", source="two")    # 400 + n: the last 200 bytes, from their first whole line
    assert sources() == ["new", "two"]
    p.write_bytes(line(250, "a") + line(199 - n, "b"))  # the last 200 bytes after the append start with a newline
    assert events.note(host, "hook", source="new")
    assert sources() == ["b", "new"]


def test_readers_keep_an_older_file_without_bad_lines_and_never_follow_its_link(tmp_path):
    """An older history.jsonl with only good lines is read (before: only when it had a bad one too); one that is a
    link -- even to a file inside the root -- is neither read, nor folded in, nor an error; a blank line in a log
    is passed over, not the end of it; a log that cannot be read at all is an error, not an empty log (kills:
    ``older[0] or older[1]`` -> ``older[1] or ...`` / ``and``, the opened file's ``not legacy`` and the raise's
    ``not legacy`` swapped, follow=True for the older file in the reader and the writer, continue -> break)."""
    host = Host(str(tmp_path))
    d = tmp_path / "var/lib/spark-memsaver"
    d.mkdir(parents=True)
    old = {"event": "rolled-back", "kernel": "k1", "time": "2026-01-01T10:00:00Z", "code": "driver-changing"}
    (d / "history.jsonl").write_text(json.dumps(old) + "\n")
    (d / "events.jsonl").write_text(json.dumps({"time": "2026-01-01T10:00:01Z", "op": "install", "ok": True}) +
                                    "\n\n" + json.dumps({"time": "2026-01-01T10:00:02Z", "op": "build"}) + "\n")
    assert [e["op"] for e in events.read(host)] == ["rolled-back", "install", "build"]
    (d / "history.jsonl").unlink()
    (tmp_path / "secret.jsonl").write_text(json.dumps({**old, "key": "PRIVATE"}) + "\n")
    (d / "history.jsonl").symlink_to("../../../secret.jsonl")     # resolves inside the root
    assert events.read_counted(host) == (events.read(host), 0)
    assert [e["op"] for e in events.read(host)] == ["install", "build"]
    assert events.note(host, "hook", source="x")
    assert "PRIVATE" not in (d / "events.jsonl").read_text() and (d / "history.jsonl").is_symlink()
    (d / "history.jsonl").unlink()
    (d / "events.jsonl").unlink()
    (d / "events.jsonl").mkdir()
    with pytest.raises(OSError):
        events.read(host)


def test_folding_in_an_older_file_skips_its_cut_first_line_and_lines_that_are_events(tmp_path, monkeypatch):
    """Of an older file past MAX_BYTES only the last MAX_BYTES are folded in, less a first line the cut went through
    (a cut on a line's start keeps that line whole); at exactly MAX_BYTES it is folded in whole; a line that has an "op" already is not an
    older line (kills: the first line dropped 1 -> 2 and > -> >=, "op" in the legacy test)."""
    host = Host(str(tmp_path))
    d = tmp_path / "var/lib/spark-memsaver"
    d.mkdir(parents=True)
    lines = [json.dumps({"event": "hook", "time": f"2026-01-01T10:00:0{i}Z", "source": f"s{i}"}) + "\n"
             for i in range(6)]
    text = "".join(lines)
    monkeypatch.setattr(events, "MAX_BYTES", len(text))
    log, legacy = str(d / "events.jsonl"), str(d / "history.jsonl")

    def folded(older: str) -> list[str]:       # the fold alone (the writer would rotate the log past MAX_BYTES)
        (d / "events.jsonl").write_text(json.dumps({"op": "hook", "time": "2026-01-01T11:00:00Z", "source": "now"})
                                        + "\n")
        (d / "history.jsonl").write_text(older)
        events._migrate(log, legacy)
        assert not (d / "history.jsonl").exists()
        return [e["source"] for e in events.read(host)]
    assert folded(text) == ["s0", "s1", "s2", "s3", "s4", "s5", "now"]
    # past it: the last MAX_BYTES; a cut on a line's start loses nothing, the line a cut goes through is dropped
    assert folded("x" * 10 + "\n" + text) == ["s0", "s1", "s2", "s3", "s4", "s5", "now"]
    assert folded("x" * 10 + "\n" + text + "\n") == ["s1", "s2", "s3", "s4", "s5", "now"]   # the cut inside s0
    (d / "events.jsonl").unlink()
    (d / "history.jsonl").write_text(json.dumps({"event": "hook", "op": "install", "time": "2026-01-01T10:00:00Z"})
                                     + "\n" + lines[1])
    monkeypatch.setattr(events, "MAX_BYTES", 1 << 20)
    assert events.read_counted(host) == ([{"op": "hook", "time": "2026-01-01T10:00:01Z", "source": "s1"}], 1)


def test_events_since_include_that_second_and_as_json_keeps_the_newest(tmp_path):
    """``--since`` / GetEvents' since keep an event of that very second; GetEvents' limit keeps the newest n, and
    0 (or less) none (kills: >= -> >, [-limit:] -> [+limit:], limit > 0 -> >= 0 / > 1)."""
    from spark_memsaver.timefmt import utc_epoch
    host = Host(str(tmp_path))
    p = _log(tmp_path)
    p.parent.mkdir(parents=True)
    p.write_text("".join(json.dumps({"time": f"2026-01-01T10:00:0{i}Z", "op": "hook", "n": i}) + "\n"
                         for i in range(4)))
    since = utc_epoch("2026-01-01T10:00:02Z")
    assert [e["n"] for e in events.read(host, since)] == [2, 3]
    assert [e["n"] for e in json.loads(events.as_json(host, None, 3))] == [1, 2, 3]
    assert [e["n"] for e in json.loads(events.as_json(host, None, 1))] == [3]
    assert json.loads(events.as_json(host, None, 0)) == [] and json.loads(events.as_json(host, None, -1)) == []


def test_the_log_is_rotated_past_one_mib(tmp_path):
    """The bound is 1 MiB (~5000 events): a log that passes it keeps its newest 512 KiB (kills: MAX_BYTES
    1 << 20 -> 2 << 20 or 1 << 21)."""
    host = Host(str(tmp_path))
    p = _log(tmp_path)
    p.parent.mkdir(parents=True)
    one = (json.dumps({"op": "hook", "source": "x" * 960, "time": "2026-12-01T10:00:00Z"}, sort_keys=True) +
           "\n").encode()
    p.write_bytes(one * ((1 << 20) // len(one)))        # just under 1 MiB
    assert events.note(host, "hook", source="y" * 2000)  # now past it
    assert p.stat().st_size <= 1 << 19 and events.read(host)[-1]["source"] == "y" * 500 + "..."


def test_what_cannot_be_recorded_or_folded_in_is_logged_by_name(tmp_path, caplog):
    """The operation goes on, the journal says which event and which file and why, in words (kills: the two
    warnings' wording, ``ev.get("op")``'s key, ``e.strerror or e`` -> ``and``)."""
    host = Host(str(tmp_path))
    d = tmp_path / "var/lib/spark-memsaver"
    (d / "history.jsonl").mkdir(parents=True)             # an older file that cannot be read: the line is still written
    with caplog.at_level("WARNING", logger="spark_memsaver.host.events"):
        assert events.note(host, "hook", source="x")
    assert [r.getMessage() for r in caplog.records] == \
        [f"cannot fold {d / 'history.jsonl'} into {d / 'events.jsonl'}: Is a directory"]
    assert [e["source"] for e in events.read(host)] == ["x"]
    caplog.clear()
    (d / "events.jsonl").unlink()
    (d / "events.jsonl").mkdir()
    with caplog.at_level("WARNING", logger="spark_memsaver.host.events"):
        assert events.record(host, "remove", {"kernel": "k"}) is False
    assert [r.getMessage() for r in caplog.records] == \
        [f"cannot record the remove event in {d / 'events.jsonl'}: Is a directory"]


def test_a_read_event_is_one_as_written(tmp_path):
    """A recorded event with steps reads back; the APT door's lists must be lists of strings; a time is kept from
    the epoch on and up to the last second before 2100 (kills: "steps" dropped from the scalar test's exceptions,
    the LISTS test's 'or' and its return, the time bounds 0 <= and < 4102444800)."""
    host = Host(str(tmp_path))
    assert events.record(host, "reconcile", result={"ok": True, "steps": [{"action": "build", "kernel": "k"}]})
    assert events.read(host)[0]["steps"] == [{"action": "build", "kernel": "k"}]
    p = _log(tmp_path)
    t = "2026-12-01T10:00:00Z"
    good = [{"time": "1970-01-01T00:00:00Z", "op": "hook"}, {"time": "2099-12-31T23:59:59Z", "op": "hook"},
            {"time": t, "op": "apt-pre-install", "removed": ["k1"], "kept": []}]
    bad = [{"time": "2100-01-01T00:00:00Z", "op": "hook"}, {"time": t, "op": "apt-pre-install", "removed": [5]},
           {"time": t, "op": "apt-pre-install", "kept": "k1"}]
    p.write_text("".join(json.dumps(e) + "\n" for e in good + bad))
    assert events.read_counted(host) == (good, len(bad))


def test_a_log_replaced_by_a_link_after_it_was_opened_is_not_written(tmp_path, monkeypatch):
    """The log is never written through a link: when the log is swapped for a link (here: to the very file the
    writer opened) between its open and its check, the writer opens it again, that open refuses the link, and
    the event is reported unwritten (kills: the check's follow_symlinks=False -> True)."""
    host = Host(str(tmp_path))
    assert events.note(host, "hook", source="first")
    p = str(_log(tmp_path))
    moved = p + ".moved"
    real, swapped = os.stat, []

    def stat(path, *a, **kw):
        if path == p and not swapped:
            swapped.append(path)
            os.rename(p, moved)
            os.symlink(moved, p)
        return real(path, *a, **kw)
    monkeypatch.setattr(events.os, "stat", stat)
    assert events.note(host, "hook", source="second") is False
    assert swapped and [json.loads(x)["source"] for x in open(moved)] == ["first"]
