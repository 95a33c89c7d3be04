"""The black box (service/blackbox.py): under memory pressure, a sample a second appended and fsynced to one file
per boot; trimmed and pruned; `history --boot -1` reads the boot before this one without the daemon, and
`events --boot -1` the lifecycle events of the same boot.

Real files on a fixture root (its /proc/sys/kernel/random/boot_id stands in for this boot's); the pressure
episode is driven by calling the trigger's callback, as the PSI file descriptor would (a real trigger firing needs
a memory hog: tests/kernel's job, not this machine's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from spark_memsaver.host import Host, paths
from spark_memsaver.service import blackbox

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures" / "memory"
ENV = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
ENV.pop("SPARK_MEMSAVER_CONFIG", None)


def root(tmp_path) -> tuple[Path, str]:
    r = tmp_path / "r"
    shutil.copytree(FIX / "gb10-64k", r)
    bid = str(uuid.uuid4())
    (r / "proc/sys/kernel/random").mkdir(parents=True)
    (r / "proc/sys/kernel/random/boot_id").write_text(bid + "\n")
    return r, bid


class Clock:
    t = 100.0

    def __call__(self):
        return self.t


def test_records_while_pressure_lasts_then_stops(tmp_path):
    r, bid = root(tmp_path)
    clock = Clock()
    bb = blackbox.BlackBox(Host(r), clock=clock)
    bb.last_event = clock()
    assert bb.tick() is True                        # PSI some avg10 12.40 in the fixture: keep going
    clock.t += blackbox.QUIET_S + 1
    assert bb.tick() is True                        # no trigger for a while, but still under pressure
    (r / "proc/pressure/memory").write_text("some avg10=0.20 avg60=3.00 avg300=1.00 total=90412999\n"
                                            "full avg10=0.00 avg60=0.50 avg300=0.20 total=21893455\n")
    assert bb.tick() is False                       # quiet and PSI under 1 %: stopped
    lines = (r / paths.BLACKBOX_DIR.lstrip("/") / f"{bid}.jsonl").read_text().splitlines()
    got = [json.loads(x) for x in lines]
    assert len(got) == 3 and got[0]["mem_free"] == 7976902656 // 1024 * 1024 and got[0]["psi_some_avg10"] == 12.4
    assert got[-1]["psi_some_avg10"] == 0.2


def test_bounded_per_boot_and_old_boots_pruned(tmp_path, monkeypatch):
    r, bid = root(tmp_path)
    d = r / paths.BLACKBOX_DIR.lstrip("/")
    d.mkdir(parents=True)
    for i in range(5):                               # five older boots
        old = d / f"{uuid.UUID(int=i + 1)}.jsonl"
        old.write_text('{"time": 1}\n')
        os.utime(old, (1000 + i, 1000 + i))
    monkeypatch.setattr(blackbox, "TRIM_AT", 20)
    monkeypatch.setattr(blackbox, "LIMIT", 10)
    bb = blackbox.BlackBox(Host(r))
    for _ in range(25):
        bb.write(blackbox.sample(Host(r)))
    assert len((d / f"{bid}.jsonl").read_text().splitlines()) == 15      # trimmed to 10 at 20, then 5 more
    assert len(blackbox.boots(Host(r))) == blackbox.BOOTS_KEPT               # 3 older boots and this one


def test_history_boot_minus_one_reads_the_previous_boot_without_the_daemon(tmp_path):
    r, bid = root(tmp_path)
    bb = blackbox.BlackBox(Host(r))
    for t in (10.0, 11.0, 12.0):
        bb.write(dict(blackbox.sample(Host(r)), time=1796500000 + t))
    (r / "proc/sys/kernel/random/boot_id").write_text(str(uuid.uuid4()) + "\n")   # the power cycle
    out = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(r), "history", "--boot", "-1",
                          "--json"], capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["boot_id"] == bid and [s["time"] for s in doc["samples"]] == [1796500010.0, 1796500011.0,
                                                                               1796500012.0]
    # a line cut by the power cycle is skipped, not fatal
    with open(r / paths.BLACKBOX_DIR.lstrip("/") / f"{bid}.jsonl", "a") as f:
        f.write('{"time": 17965')
    text = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(r), "history", "--boot", "-1"],
                          capture_output=True, text=True, env=ENV, timeout=60)
    assert text.returncode == 0 and f"boot -1 ({bid}): 3 samples" in text.stdout, text.stdout + text.stderr
    now = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(r), "history", "--boot", "0"],
                         capture_output=True, text=True, env=ENV, timeout=60)
    assert "no black-box samples for boot 0" in now.stdout


def _cli(r: Path, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(r), *args],
                         capture_output=True, text=True, env=ENV, timeout=60)
    assert "Traceback" not in out.stderr, out.stderr
    return out


def test_events_boot_minus_one_shows_the_events_of_the_boot_before(tmp_path):
    """After a power cycle, `events --boot -1` shows what the lifecycle log recorded in the boot before (each line
    carries its boot), and names the same boot as `history --boot -1`: one numbering (host/boots.py)."""
    from spark_memsaver.host import events
    r, bid = root(tmp_path)
    host = Host(r)
    log = r / paths.EVENTS.lstrip("/")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(json.dumps({"time": "2026-11-30T10:00:00Z", "op": "install", "ok": True}) + "\n")  # no boot id
    assert events.record(host, "rollback", {"kernel": "6.14.0-1015-nvidia-64k", "reason": "before the wedge"},
                         {"ok": True})
    bb = blackbox.BlackBox(host)
    bb.write(dict(blackbox.sample(host), time=1796500010.0))
    assert json.loads(log.read_text().splitlines()[-1])["boot"] == bid      # the writer stamps its boot
    (r / "proc/sys/kernel/random/boot_id").write_text(str(uuid.uuid4()) + "\n")   # the power cycle
    assert events.note(Host(r), "hook", source="dpkg")                          # this boot's first event
    before = json.loads(_cli(r, "events", "--boot", "-1", "--json").stdout)
    assert [e["op"] for e in before] == ["rollback"] and before[0]["boot"] == bid, before
    text = _cli(r, "events", "--boot", "-1")
    assert text.returncode == 0 and f"boot -1 ({bid}); 1 older events carry no boot id" in text.stdout, text.stdout
    assert "before the wedge" in text.stdout and "rollback" in text.stdout and "dpkg" not in text.stdout
    now = json.loads(_cli(r, "events", "--boot", "0", "--json").stdout)
    assert [e["op"] for e in now] == ["hook"], now
    assert json.loads(_cli(r, "history", "--boot", "-1", "--json").stdout)["boot_id"] == bid
    gone = _cli(r, "events", "--boot", "-2")
    assert gone.returncode == 0 and "boot -2: no record of it" in gone.stdout, gone.stdout


def test_boots_are_numbered_alike_from_either_record(tmp_path):
    """A boot known only by its black box and a later one known only by its events: -1 is the later one and -2
    the earlier one, for `events --boot` and `history --boot` alike."""
    from spark_memsaver.host import boots
    r, first = root(tmp_path)
    host = Host(r)
    bb = blackbox.BlackBox(host)
    bb.write(dict(blackbox.sample(host), time=1796500010.0))
    f = r / paths.BLACKBOX_DIR.lstrip("/") / f"{first}.jsonl"
    os.utime(f, (1796500010, 1796500010))
    second = str(uuid.uuid4())
    log = r / paths.EVENTS.lstrip("/")
    log.write_text(json.dumps({"time": "2026-12-05T08:00:00Z", "op": "reconcile", "ok": True, "boot": second})
                   + "\n")                              # 1796457600: before the black box's last write...
    os.utime(f, (1796400000, 1796400000))               # ...until the black box is older
    (r / "proc/sys/kernel/random/boot_id").write_text(str(uuid.uuid4()) + "\n")
    from spark_memsaver.host import events
    assert boots.order(boots.last_seen(host, events.read(host)), boots.current(host)) == [first, second]
    assert [e["boot"] for e in json.loads(_cli(r, "events", "--boot", "-1", "--json").stdout)] == [second]
    assert json.loads(_cli(r, "history", "--boot", "-2", "--json").stdout)["boot_id"] == first
    assert json.loads(_cli(r, "history", "--boot", "-1", "--json").stdout)["samples"] == []
