"""The black box (service/blackbox.py): under memory pressure, a sample a second appended and fsynced to one file
per boot; trimmed and pruned; `history --boot -1` reads the boot before this one without the daemon.

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
