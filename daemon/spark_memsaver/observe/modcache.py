"""kmod's answers kept across runs: ``modinfo -k K NAME`` is run again only when something it reads changed.

``status`` asked kmod twice per kernel (nvidia-uvm and nvidia), two subprocesses on every run for facts that
change only when a module, a modules index or a modprobe.d file does (issue 38). An answer of
:func:`observe.modules.read_selected` is kept in ``/var/cache/spark-memsaver/modinfo.json`` (the package's cache
directory; never created here) together with what it was made from:

* the resolution's inputs: the stat (inode, size, mtime, ctime) of ``/lib/modules/K`` and of each ``modules.*``
  index in it, and of every modprobe.d directory kmod reads and each file in them -- the host's (``modinfo -b``
  reads the host's configuration) and the root's;
* the module file it named: its stat again, so a module replaced in place (same name, new file) is read again.

Any difference, a missing or unreadable cache, or an entry of another format: modinfo runs, as before. Only root
writes the live system's copy (any user reads it); a copy whose file or directory is writable by others, or
owned by another user, is not believed. Unreadable answers (a timeout, a missing modinfo) are never kept.
"""

from __future__ import annotations

import json
import os

from spark_memsaver.host import Host, paths
from spark_memsaver.host.fsutil import trusted_copy

FORMAT = 1
MAX_ENTRIES = 64
KEPT_STATES = ("ours", "patched", "stock", "none", "builtin")
CONFIG_DIRS = ("/etc/modprobe.d", "/run/modprobe.d", "/usr/local/lib/modprobe.d", "/lib/modprobe.d",
               "/usr/lib/modprobe.d")


def cache_file(host: Host) -> str:
    return str(host.path(f"{paths.CACHE_DIR}/modinfo.json"))


def _stat(p: str):
    try:
        st = os.stat(p)
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _dir_stats(d: str) -> list:
    out = [d, _stat(d)]
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return out
    return out + [[n, _stat(os.path.join(d, n))] for n in names]


def inputs(host: Host, kernel: str) -> list:
    """What kmod's answer for ``kernel`` depends on (see the module's docstring), as comparable data."""
    moddir = str(host.path(f"/lib/modules/{kernel}"))
    out = [[moddir, _stat(moddir)]]
    try:
        out += [[n, _stat(os.path.join(moddir, n))] for n in sorted(os.listdir(moddir)) if n.startswith("modules.")]
    except OSError:
        pass
    dirs = list(CONFIG_DIRS) + ([str(host.path(d)) for d in CONFIG_DIRS] if not host.is_live else [])
    for d in dirs:
        out.append(_dir_stats(d))
    return out


def _load(path: str) -> dict:
    if not trusted_copy(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(kept, dict) or kept.get("format") != FORMAT or not isinstance(kept.get("entries"), dict):
        return {}
    return kept["entries"]


def lookup(host: Host, kernel: str, name: str, now_inputs: list) -> dict | None:
    """The kept answer for (kernel, name) when nothing it was made from changed; else None."""
    e = _load(cache_file(host)).get(f"{kernel}\0{name}")
    if not isinstance(e, dict) or e.get("inputs") != now_inputs or not isinstance(e.get("answer"), dict):
        return None
    answer = e["answer"]
    p = answer.get("path")
    if p is not None and e.get("file") != _stat(str(host.path(p))):
        return None
    return dict(answer)


def store(host: Host, kernel: str, name: str, now_inputs: list, answer: dict) -> None:
    """Keep ``answer`` (best effort: root on the live system, or the owner of a fixture root's cache directory)."""
    if answer.get("state") not in KEPT_STATES:
        return
    path = cache_file(host)
    d = os.path.dirname(path)
    if not os.path.isdir(d) or (host.is_live and os.geteuid() != 0) or not os.access(d, os.W_OK):
        return
    entries = _load(path)
    p = answer.get("path")
    entries.pop(f"{kernel}\0{name}", None)
    entries[f"{kernel}\0{name}"] = {"inputs": now_inputs, "answer": answer,
                                    "file": _stat(str(host.path(p))) if p is not None else None}
    while len(entries) > MAX_ENTRIES:
        entries.pop(next(iter(entries)))
    try:
        from spark_memsaver.host.fsutil import atomic_write
        atomic_write(path, json.dumps({"format": FORMAT, "entries": entries}), 0o644, durable=False)
    except (OSError, TypeError, ValueError):
        pass        # the next run asks kmod again
