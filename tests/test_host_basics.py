"""host/: locks (defect 1, 12), atomic_write (defect 5), runner process-group timeout (defect 11)."""

import os
import subprocess
import sys
import time

import pytest

from spark_memsaver.errors import CommandTimedOut, LockTimeout
from spark_memsaver.host import Host, fsutil, locks, paths
from spark_memsaver.host.runner import Runner
from tests.support import needs


def test_lock_lives_in_run_dir_and_times_out_named(tmp_path):
    h = Host(tmp_path)
    assert paths.lock("lifecycle") == "/run/spark-memsaver/lifecycle.lock"
    with locks.hold(h, "lifecycle", timeout=1, purpose="outer"):
        code = ("import sys; sys.path.insert(0, 'daemon');"
                "from spark_memsaver.host import Host, locks;"
                f"h = Host({str(tmp_path)!r});"
                "exec('try:\\n with locks.hold(h, \"lifecycle\", timeout=0.5): pass\\nexcept Exception as e: print(type(e).__name__, e)')")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30).stdout
    assert out.startswith("LockTimeout") and f"pid {os.getpid()}" in out and "outer" in out
    assert issubclass(LockTimeout, Exception)


def test_planted_symlink_is_not_followed_nor_truncated(tmp_path):
    h = Host(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    lp = h.path(paths.lock("validate"))
    lp.parent.mkdir(parents=True)
    lp.symlink_to(victim)
    with pytest.raises(OSError):
        with locks.hold(h, "validate", timeout=1):
            pass
    assert victim.read_text() == "precious\n"


@pytest.mark.needs("setpriv")
def test_unprivileged_user_cannot_create_the_lock(tmp_path):
    needs.root("switching to an unprivileged user needs root")
    h = Host(tmp_path)
    d = h.path(paths.RUN_DIR)
    with locks.hold(h, "lifecycle", timeout=1):
        pass
    assert oct(d.stat().st_mode & 0o777) == "0o700"
    os.chmod(tmp_path, 0o755)
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c",
                        f": >> {d}/lifecycle.lock"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Permission denied" in r.stderr, r.stderr


def test_owner_alive_uses_start_time():
    me = os.getpid()
    st = locks.start_time(me)
    assert st and locks.owner_alive(me, st)
    assert not locks.owner_alive(me, str(int(st) + 1))   # same pid, other start time: a recycled pid
    assert not locks.owner_alive(2 ** 22 + 1, None)


def test_atomic_write_never_follows_a_symlink_at_a_temp_name(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.chmod(victim, 0o600)
    names = iter(["aaaa", "bbbb"])
    monkeypatch.setattr(fsutil, "_token", lambda: next(names))
    (tmp_path / ".rec.json.aaaa.tmp").symlink_to(victim)     # planted where the first temp name would be
    fsutil.atomic_write(tmp_path / "rec.json", "{}\n", mode=0o644)
    assert victim.read_text() == "precious\n" and (victim.stat().st_mode & 0o777) == 0o600
    assert (tmp_path / "rec.json").read_text() == "{}\n"
    assert ((tmp_path / "rec.json").stat().st_mode & 0o777) == 0o644


def test_timeout_kills_the_whole_process_group(tmp_path):
    marker = f"spark-memsaver-test-{os.getpid()}"
    with pytest.raises(CommandTimedOut):
        Runner().run(["sh", "-c", f"sh -c 'sleep 300; : {marker}' & sleep 300"], timeout=1)
    time.sleep(0.3)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert left.strip() == ""
