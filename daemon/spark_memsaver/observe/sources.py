"""Observe: where each installed NVIDIA driver's open kernel-module source is (/usr/src, or our cache in
/var/cache/spark-memsaver/sources) and, when it is missing, which exact package version APT's lists offer.

    facts(host, config, driver, kernels) -> what decide/sources.section decides World.driver_sources over
    offered(host, packages)              -> what APT's lists offer (the packages: decide/sources.packages_to_ask)
    cache_sources(host)  -> the cached trees, in the JSON shape of World.driver.sources with "origin": "cache"

APT is read with its own tools (apt-cache madison / show, dpkg-query) through the host's runner. A --root host
is read through its own APT state (``-o Dir=<root>/``, no cache files written there); a root without APT lists
is "unknown" (nothing fetchable, no command guessed). The lists read is memoised in the cache directory, keyed
by the lists' and dpkg status's mtimes, so the status child does not pay apt-cache's start-up on every refresh.
"""

from __future__ import annotations

import json
import os
import re

from spark_memsaver import logs
from spark_memsaver.host import Host, paths, records
from spark_memsaver.errors import MemsaverError
from spark_memsaver.versions import DRIVER_RE, base_version as _base

log = logs.lazy("spark_memsaver.observe.sources")

RECORD = ".spark-memsaver-source.json"      # inside each cached tree, published with it by one rename
MEMO = ".apt-index.json"
DPKG_MEMO = ".dpkg-index.json"
APT_TIMEOUT = 60
NVIDIA_PATTERNS = ("nvidia-kernel-common*", "nvidia-kernel-source*", "nvidia-open-kernel-*")


# --- APT -----------------------------------------------------------------------------------------

def apt_options(host: Host) -> list[str] | None:
    """Options that make apt-get / apt-cache read ``host``'s APT state; None when it has none."""
    if not host.path("/var/lib/apt/lists").is_dir() or not host.path("/etc/apt").is_dir():
        return None
    if host.runner.which("apt-cache") is None:
        return None
    if host.is_live:
        return []
    return [f"-o=Dir={host.root}/", "-o=Dir::Cache::pkgcache=", "-o=Dir::Cache::srcpkgcache="]


def _mtime(host: Host, p: str) -> int | None:
    try:
        return host.path(p).stat().st_mtime_ns
    except OSError:
        return None


def _lists_key(host: Host) -> dict:
    lists = host.path("/var/lib/apt/lists")
    newest = 0
    try:
        for e in os.scandir(lists):
            if e.is_file():
                newest = max(newest, e.stat().st_mtime_ns)
    except OSError:
        pass
    return {"lists": _mtime(host, "/var/lib/apt/lists"), "newest": newest,
            "status": _mtime(host, "/var/lib/dpkg/status"),
            "sources": [_mtime(host, "/etc/apt/sources.list"), _mtime(host, "/etc/apt/sources.list.d")]}


def _memo(host: Host, key: dict, compute, name: str = MEMO):
    """compute() memoised under the cache directory (best effort: an unwritable cache just recomputes)."""
    p = host.path(f"{paths.SOURCES_CACHE}/{name}")
    try:
        old = json.loads(p.read_text())
        if old.get("key") == key:
            return old["value"]
    except (OSError, ValueError, AttributeError, KeyError):
        pass
    value = compute()
    try:
        cache = host.path(paths.CACHE_DIR)     # the package's own directory (tmpfiles.d, CacheDirectory=)
        if not p.parent.is_dir() and cache.is_dir() and os.access(cache, os.W_OK):
            p.parent.mkdir(mode=0o755, exist_ok=True)
        if p.parent.is_dir() and os.access(p.parent, os.W_OK):
            from spark_memsaver.host.fsutil import atomic_write
            atomic_write(p, json.dumps({"key": key, "value": value}) + "\n", 0o644, durable=False)
    except (OSError, TypeError, ValueError) as e:
        log.debug("apt index memo not written: %s", e)
    return value


def _madison(host: Host, opts: list[str], packages: list[str]) -> dict[str, list[str]]:
    r = host.run(["apt-cache", *opts, "madison", *packages], timeout=APT_TIMEOUT)
    out: dict[str, list[str]] = {}
    for line in r.stdout.splitlines():
        parts = [x.strip() for x in line.split("|")]
        if len(parts) >= 3 and parts[0] in packages and parts[1] not in out.get(parts[0], []):
            out.setdefault(parts[0], []).append(parts[1])
    return out


def offered(host: Host, packages: list[str]) -> dict[str, list[str]] | None:
    """{package: [versions APT's lists offer, newest first]}; None when this host has no readable APT state."""
    opts = apt_options(host)
    if opts is None:
        return None
    key = {"opts": opts, "packages": sorted(packages), **_lists_key(host)}
    try:
        return _memo(host, key, lambda: _madison(host, opts, packages))
    except MemsaverError as e:   # apt-cache missing or hung: unknown, never a crash of status
        log.warning("cannot read APT's lists: %s", e.message)
        return None


def package_record(host: Host, package: str, deb_version: str) -> dict | None:
    """The lists' stanza fields of exactly ``package=deb_version`` (SHA256, Size, Filename, Architecture), or None."""
    opts = apt_options(host)
    if opts is None:
        return None
    r = host.run(["apt-cache", *opts, "show", "--no-all-versions", f"{package}={deb_version}"], timeout=APT_TIMEOUT)
    if not r.ok:
        return None
    fields: dict[str, str] = {}
    for line in r.stdout.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        m = re.match(r"^([A-Za-z0-9-]+):\s*(.*)$", line)
        if m:
            fields[m.group(1)] = m.group(2).strip()
    if fields.get("Package") != package or fields.get("Version") != deb_version:
        return None
    return fields


def installed_packages(host: Host) -> dict[str, str]:
    """{package: version} of the NVIDIA kernel packages dpkg has installed (host's own dpkg database), memoised
    like the lists (keyed by dpkg's status file: dpkg replaces it on every change)."""
    if not host.path("/var/lib/dpkg/status").is_file() or host.runner.which("dpkg-query") is None:
        return {}
    try:
        st = host.path("/var/lib/dpkg/status").stat()
    except OSError:
        return {}
    key = {"status": [st.st_mtime_ns, st.st_size, st.st_ino], "patterns": list(NVIDIA_PATTERNS)}
    try:
        return _memo(host, key, lambda: _dpkg_query(host), name=DPKG_MEMO)
    except MemsaverError:   # dpkg-query missing or hung: nothing known (and nothing memoised)
        return {}


def _dpkg_query(host: Host) -> dict[str, str]:
    argv = ["dpkg-query"] + ([] if host.is_live else [f"--admindir={host.path('/var/lib/dpkg')}"]) + \
        ["-W", "-f=${Package}\t${Version}\t${db:Status-Status}\n", *NVIDIA_PATTERNS]
    r = host.run(argv, timeout=APT_TIMEOUT)
    out = {}
    for line in r.stdout.splitlines():   # rc 1 when a pattern matches nothing: the rest is still valid
        f = line.split("\t")
        if len(f) == 3 and f[2] == "installed" and f[1]:
            out[f[0]] = f[1]
    return out


def os_release(host: Host) -> dict:
    text = host.read_text("/etc/os-release") or host.read_text("/usr/lib/os-release") or ""
    kv = {}
    for line in text.splitlines():
        m = re.match(r'^([A-Z_]+)=(?:"([^"]*)"|(\S*))', line)
        if m:
            kv[m.group(1)] = m.group(2) if m.group(2) is not None else m.group(3)
    return {"os_id": kv.get("ID"), "os_id_like": kv.get("ID_LIKE")}


# --- the cache -----------------------------------------------------------------------------------

def _tree_bytes(path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def cache_entries(host: Host) -> list[dict]:
    """The trees in the cache, each with the record fetch() published with it."""
    out = []
    for name in host.listdir(paths.SOURCES_CACHE):
        if not name.startswith("nvidia-"):
            continue
        p = f"{paths.SOURCES_CACHE}/{name}"
        if not host.path(p).is_dir():
            continue
        rec = records.one(host, "source-tree", f"{p}/{RECORD}") or {}     # a bad one: derived from the tree
        driver = rec.get("driver") or name[len("nvidia-"):]
        size = rec.get("bytes") if rec.get("bytes") is not None else _tree_bytes(host.path(p))
        out.append({"driver": driver, "package": rec.get("package"), "deb_version": rec.get("deb_version"),
                    "sha256": rec.get("sha256"), "fetched": rec.get("fetched"), "path": p, "bytes": size,
                    "open": host.exists(f"{p}/nvidia-uvm") and host.exists(f"{p}/Kbuild")})
    return out


def cache_sources(host: Host, entries: list[dict] | None = None) -> list[dict]:
    """The cached trees in the JSON shape of World.driver.sources (version, path, open) plus origin "cache"."""
    return [{"version": e["driver"], "path": e["path"], "open": e["open"], "origin": "cache"}
            for e in (entries if entries is not None else cache_entries(host))]


def cache_summary(host: Host, entries: list[dict]) -> dict:
    total = sum(e["bytes"] for e in entries)
    for name in host.listdir(paths.SOURCES_CACHE):   # a staging dir a killed fetch left (removed by prune)
        if name.startswith(".staging-"):
            total += _tree_bytes(host.path(f"{paths.SOURCES_CACHE}/{name}"))
    return {"dir": paths.SOURCES_CACHE, "bytes": total,
            "entries": [{k: e[k] for k in ("driver", "package", "deb_version", "path", "bytes")} for e in entries]}


# --- the snapshot key ----------------------------------------------------------------------------

def installed_drivers(driver: dict, kernels: list[dict]) -> list[str]:
    """The driver versions in effect: the loaded nvidia, and each kernel's installed nvidia.ko."""
    out = []
    for v in [_base(driver.get("loaded_version"))] + [_base((k.get("nvidia_selected") or {}).get("version"))
                                                      for k in kernels]:
        if v and DRIVER_RE.match(v) and v not in out:
            out.append(v)
    return out


def layout_for(host: Host, driver_version: str, kernels: list[dict], installed: dict[str, str]) -> dict:
    ko = next(((k.get("nvidia_selected") or {}).get("path") for k in kernels
               if _base((k.get("nvidia_selected") or {}).get("version")) == driver_version), None)
    return {**os_release(host), "nvidia_ko": ko, "installed": installed}


def pending(host: Host) -> dict | None:
    """The fetch a door deferred until apt exits (act/source_fetch.defer), or None (absent, or not a valid
    "sources-pending" record: host/records.py's typed reader)."""
    rec = records.one(host, "sources-pending", paths.SOURCES_PENDING)
    return None if rec is None else {k: v for k, v in rec.items() if not k.startswith("_")}


def facts(host: Host, config, driver: dict, kernels: list[dict], entries: list[dict] | None = None) -> dict:
    """What World.driver_sources is decided over (decide/sources.section): the mode, the source trees (/usr/src
    and the cache), the driver versions in effect, which of them have no tree, and for those the system's
    layout (os-release, nvidia.ko, dpkg's NVIDIA packages)."""
    mode = getattr(config, "source_fetch", "auto") if config is not None else "auto"
    entries = cache_entries(host) if entries is None else entries
    trees = [s for s in (driver.get("sources") or []) if s.get("open", True)]
    trees += [s for s in cache_sources(host, entries) if s["open"] and s["path"] not in {t["path"] for t in trees}]
    versions = installed_drivers(driver, kernels)
    missing = [v for v in versions if not any(t.get("version") == v for t in trees)]
    installed = installed_packages(host) if missing else {}
    return {"mode": mode, "trees": trees, "entries": entries, "versions": versions, "missing": missing,
            "installed": installed, "layouts": {v: layout_for(host, v, kernels, installed) for v in missing},
            "cache": cache_summary(host, entries), "pending": pending(host)}
