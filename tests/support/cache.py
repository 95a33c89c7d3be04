"""Plumbing shared by the test-support builders: the artifact cache, its locks, and the host's apt sources.

The cache lives at $SPARK_MEMSAVER_TEST_CACHE (default /var/cache/spark-memsaver-tests); every builder
takes a named lock under <cache>/locks so concurrent tests (or engineers) never duplicate a build.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re
from pathlib import Path

DEBIAN_SUITES = ("bookworm", "trixie", "sid", "stable", "testing", "unstable")


def cache_dir() -> Path:
    d = Path(os.environ.get("SPARK_MEMSAVER_TEST_CACHE", "/var/cache/spark-memsaver-tests"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def locked(name: str):
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def source_entries() -> list[tuple[str, list[str]]]:
    """(uri, suites) of the host's apt entries, deb822 and one-line formats, read at run time."""
    entries: list[tuple[str, list[str]]] = []
    for f in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        for stanza in re.split(r"\n\s*\n", Path(f).read_text(errors="replace")):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line or line[:1].isspace():
                    continue
                k, v = line.split(":", 1)
                fields[k.strip().lower()] = v.strip()
            if fields.get("enabled", "yes").lower() == "no" or "deb" not in fields.get("types", "").split():
                continue
            for uri in fields.get("uris", "").split():
                entries.append((uri.rstrip("/"), fields.get("suites", "").split()))
    for f in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
        try:
            text = Path(f).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            m = re.match(r"\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
            if m:
                entries.append((m.group(1).rstrip("/"), [m.group(2)]))
    return entries


def debian_mirror() -> str | None:
    """The Debian archive URI the host's apt uses (the entry carrying a plain release suite), or None."""
    for uri, suites in source_entries():
        if any(s in DEBIAN_SUITES for s in suites):
            return uri
    return None
