"""Locks: files in RUN_DIR only (root-only), opened O_NOFOLLOW, never truncated, flock with a bounded wait."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
import time

from spark_memsaver.errors import LockTimeout
from spark_memsaver.host import Host, paths


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot), or None when pid is gone."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except (OSError, ValueError):
        return None
    rest = data[data.rfind(")") + 2:].split()   # fields from 3 on; comm may hold spaces and ')'
    return rest[19] if len(rest) > 19 else None


def owner_alive(pid, started) -> bool:
    """The process identified by pid AND start time still runs (EPERM alone is no proof; a recycled pid is
    someone else)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    now = start_time(pid)
    return now is not None and (started is None or str(started) == now)


def _open(host, path: str) -> int:
    p = host.path(path, follow=False)       # a final symlink is never resolved (O_NOFOLLOW refuses it)
    os.makedirs(p.parent, mode=0o700, exist_ok=True)
    return os.open(p, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


@contextlib.contextmanager
def hold(host, name: str, *, timeout: float = 300.0, purpose: str = "", path: str | None = None):
    """Hold lock ``name`` (paths.lock(name), in RUN_DIR). ``path``: another location, for tests of a door that
    cannot run under a root prefix (validate); opened the same way (O_NOFOLLOW, 0600)."""
    path = path or paths.lock(name)
    fd = _open(host, path)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = {}
                    with contextlib.suppress(OSError, ValueError):
                        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
                    raise LockTimeout(f"the {name} lock ({path}) is held by pid {holder.get('pid', '?')} "
                                      f"(started {holder.get('start_time', '?')}, {holder.get('purpose', '?')}); "
                                      f"waited {timeout:.0f} s", holder=holder)
                time.sleep(0.1)
        me = json.dumps({"pid": os.getpid(), "start_time": start_time(os.getpid()), "purpose": purpose}).encode()
        os.ftruncate(fd, 0)          # only after we hold it: a planted file is never truncated blindly
        os.pwrite(fd, me, 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# dpkg's own locks (its door runs inside apt/dpkg): tested, never taken
DPKG_LOCKS = ("/var/lib/dpkg/lock-frontend", "/var/lib/dpkg/lock")


def dpkg_running(host: Host) -> int | None:
    """pid of a dpkg/apt holding the dpkg lock (F_GETLK: tests without taking it), else None."""
    for lock in DPKG_LOCKS:
        try:
            fd = os.open(host.path(lock), os.O_RDONLY)
        except OSError:
            continue
        try:
            req = struct.pack("@hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0)
            res = fcntl.fcntl(fd, fcntl.F_GETLK, req)
            ltype, _, _, _, pid = struct.unpack("@hhqqi", res)
            if ltype != fcntl.F_UNLCK:
                return pid
        except OSError:
            continue
        finally:
            os.close(fd)
    return None
