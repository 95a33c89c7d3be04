"""Leftovers of a driver-source fetch that was killed midway: ``.staging-*`` directories in the source cache.

act/source_fetch.py downloads and unpacks into ``SOURCES_CACHE/.staging-<random>`` and removes it on every
way out it sees; a kill -9 (or a power cut) leaves it behind, a partial .deb of tens of MB that counts in the
cache's size. :func:`sweep` removes them: whenever the cache is pruned (the caller holds the lifecycle lock)
and when spark-memsaverd starts (it takes the lock without waiting; if a fetch holds it, the next prune
sweeps). Light on imports (no shutil): the idle daemon calls it.
"""

from __future__ import annotations

import logging
import os

from spark_memsaver.host import paths

log = logging.getLogger(__name__)
PREFIX = ".staging-"


def _remove_tree(top: str) -> None:
    """rm -r without following links (a link inside is removed, never its target)."""
    if os.path.islink(top) or not os.path.isdir(top):
        os.unlink(top)
        return
    for dirpath, dirnames, filenames in os.walk(top, topdown=False):
        for n in filenames:
            os.unlink(os.path.join(dirpath, n))
        for n in dirnames:
            p = os.path.join(dirpath, n)
            os.unlink(p) if os.path.islink(p) else os.rmdir(p)
    os.rmdir(top)


def sweep(host, *, lock: bool = False) -> list[str]:
    """Remove every ``.staging-*`` entry of the source cache; the names removed. ``lock``: take the lifecycle
    lock first, without waiting (a fetch running elsewhere keeps its directory); otherwise the caller holds it."""
    base = host.fspath(paths.SOURCES_CACHE)
    try:
        names = [n for n in os.listdir(base) if n.startswith(PREFIX)]
    except OSError:
        return []
    if not names:
        return []
    if lock:
        from spark_memsaver.errors import MemsaverError
        from spark_memsaver.host import locks
        try:
            with locks.hold(host, "lifecycle", timeout=0, purpose="sweep the source cache's staging leftovers"):
                return sweep(host)
        except (MemsaverError, OSError) as e:
            log.info("source cache staging leftovers kept for now: %s", getattr(e, "message", e))
            return []
    gone = []
    for n in names:
        try:
            _remove_tree(os.path.join(base, n))
            gone.append(n)
        except FileNotFoundError:
            gone.append(n)
        except OSError as e:
            log.warning("cannot remove %s/%s: %s", base, n, e.strerror or e)
    if gone:
        log.info("removed %d staging leftover(s) of killed source fetches in %s", len(gone), base)
    return gone
