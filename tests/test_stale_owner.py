"""Issue 12 defect 12: an intent's writer is identified by pid + start time, never by kill(pid, 0).

Real processes: a live child of ours, and a process of another user (setpriv --reuid=65534) that names
itself spark-memsaver and sits on the pid of a 0.1.0 intent (no start time). The planner must recover
in both cases and stay blocked only for the real, still-running writer.
"""

from __future__ import annotations

import json
import subprocess
import sys

from spark_memsaver.act import executor
from spark_memsaver.config import Config
from spark_memsaver.host import Host, locks
from tests.support import sparkroot

K = sparkroot.SPARK_KERNEL


def _intent(root, pid, start_time="absent"):
    d = root / "var/lib/spark-memsaver/intents"
    d.mkdir(parents=True, exist_ok=True)
    rec = {"schema": 1, "id": f"remove-{K}", "op": "remove", "kernel": K, "started": "2026-12-01T00:00:00Z",
           "pid": pid, "phase": "started"}
    if start_time != "absent":
        rec["start_time"] = start_time
    (d / f"remove-{K}.json").write_text(json.dumps(rec))


def _action(root):
    _, _, steps = executor.plan_now(Host(root), Config(), rebuild=False)
    return [s.action for s in steps if s.intent == f"remove-{K}"]


def _spawn(*prefix):
    p = subprocess.Popen([*prefix, sys.executable, "-c", "import time; time.sleep(60)", "spark-memsaver"],
                         stdout=subprocess.DEVNULL)
    for _ in range(100):                      # wait until the exec happened (cmdline is the new program)
        try:
            if b"spark-memsaver" in open(f"/proc/{p.pid}/cmdline", "rb").read():
                break
        except OSError:
            pass
        subprocess.run(["sleep", "0.05"])
    return p


def test_recycled_pid_with_other_start_time_does_not_block(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "root", ours_installed="580.142")
    p = _spawn()
    try:
        _intent(root, p.pid, locks.start_time(p.pid))
        assert _action(root) == ["blocked"]                   # the real writer still runs: wait for it
        _intent(root, p.pid, str(int(locks.start_time(p.pid)) + 7))
        assert _action(root) == ["finish-intent"]             # same pid, another process: recover
    finally:
        p.kill()
        p.wait()


def test_other_users_process_on_an_old_records_pid_does_not_block(tmp_path):
    """0.1.0 code counted this as alive (kill(pid, 0) worked or gave EPERM, and the cmdline said
    spark-memsaver): a local user could keep recovery blocked forever."""
    root = sparkroot.make_spark_root(tmp_path / "root", ours_installed="580.142")
    p = _spawn("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    try:
        _intent(root, p.pid)                                  # no start_time: a record written by 0.1.0
        assert _action(root) == ["finish-intent"]
    finally:
        p.kill()
        p.wait()
    q = _spawn()
    try:
        _intent(root, q.pid)                                  # our own kind of writer, still running
        assert _action(root) == ["blocked"]
    finally:
        q.kill()
        q.wait()
