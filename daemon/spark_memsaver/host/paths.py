"""Every on-disk location of spark-memsaver, in one module (host paths; map with ``Host.path()``)."""

from __future__ import annotations

import re

STATE_DIR = "/var/lib/spark-memsaver"
RUN_DIR = "/run/spark-memsaver"          # root-only 0700: the daemon's RuntimeDirectory; every lock lives here
CACHE_DIR = "/var/cache/spark-memsaver"
SOURCES_CACHE = f"{CACHE_DIR}/sources"    # fetched NVIDIA open kernel-module trees (act/source_fetch.py)
SOURCES_PENDING = f"{CACHE_DIR}/sources-pending.json"   # a fetch deferred past apt/dpkg (the daemon runs it)
CONFIG_FILE = "/etc/spark-memsaver/config.yaml"
SRC_ROOT = "/usr/src"                     # where driver packages put their source trees (and DKMS its own)
LOG_DIR = f"{STATE_DIR}/logs"
INTENTS = f"{STATE_DIR}/intents"
ROLLBACKS = f"{STATE_DIR}/rollbacks"
BUILDS = f"{STATE_DIR}/builds"        # build records <kernel>.json (act/records_io.py writes, observe/builds.py reads)
HOLDS = f"{STATE_DIR}/holds"          # the administrator's holds: <kernel>.json, all.json (host/holds.py)
SAMPLES_DIR = f"{STATE_DIR}/history"      # the monitor's persisted samples (service/history.py): not lifecycle
BLACKBOX_DIR = f"{STATE_DIR}/blackbox"    # 1 Hz samples under memory pressure, fsynced, per boot (service/blackbox.py)
BOOT_ID = "/proc/sys/kernel/random/boot_id"   # this boot's id (host/boots.py; the MOK request record)
EVENTS = f"{STATE_DIR}/events.jsonl"      # the one lifecycle event log (host/events.py)
LEGACY_HISTORY = f"{STATE_DIR}/history.jsonl"   # an older install's second lifecycle log: folded into EVENTS
STOCK_DIR = f"{STATE_DIR}/stock"          # older one-line stock records <kernel> (read by the guard, migrated)
DKMS_STATE = f"{STATE_DIR}/dkms"          # the stock records <kernel>.json and original/<kernel>/
SIGNING_RECORD = f"{STATE_DIR}/signing.json"
SIGNED_LOG = f"{STATE_DIR}/signed.json"
MOK_REQUEST = f"{STATE_DIR}/mok-request.json"
VALIDATE_REPORT = f"{STATE_DIR}/validate-last.json"
GUARD_LOG = f"{RUN_DIR}/guard.log"        # the load-time guard's log, this boot only (observe/guardlog.py reads it)
LOCK_NAMES = ("lifecycle", "validate", "reclaim")
# the kernel's memory knobs `reclaim --need` writes (act/reclaim.py)
CGROUP_RECLAIM = "/sys/fs/cgroup/memory.reclaim"     # cgroup v2 root (Linux >= 5.19): reclaim N bytes
DROP_CACHES = "/proc/sys/vm/drop_caches"             # 1: drop the clean page cache (all of it)
COMPACT_MEMORY = "/proc/sys/vm/compact_memory"       # 1: compact every zone

#: spark-memsaver(8)'s FILES entries for the locations above (tools/gen-docs writes that part of the section from
#: here; tests/test_docs_vs_code.py checks every such path the man page names is one of these): path, what is there.
DOCUMENTED = (
    (CONFIG_FILE, "Configuration (a conffile)."),
    (f"{STATE_DIR}/", "State: intent and recovery records (`intents/`), rollback records (`rollbacks/`), build records "
                      "(`builds/`), the administrator's holds (`holds/`), the stock modules' records (`dkms/`), the "
                      "signing and MOK records."),
    (f"{LOG_DIR}/", "Build logs: DKMS's make.log of each build, as `dkms-build-VERSION-KERNEL.log`."),
    (f"{SAMPLES_DIR}/", "The monitoring samples `spark-memsaver history` reads (kept 7 days at the configured "
                        "interval, whatever `history_size` says)."),
    (f"{BLACKBOX_DIR}/", "The black box: samples each second while memory pressure lasts, fsynced, one file per boot "
                         "(`spark-memsaver history --boot -1` reads the boot before this one)."),
    (EVENTS, "The lifecycle event log `spark-memsaver events` reads."),
    (f"{CACHE_DIR}/", "Caches: NVIDIA driver sources fetched for precompiled drivers (`sources/`), a fetch deferred "
                      "past APT, parsed patch data."),
    (f"{RUN_DIR}/", "Runtime files (root only): the load-time guard's log of this boot (`guard.log`), the lifecycle "
                    "and validate locks."),
)

_SAFE = re.compile(r"[^A-Za-z0-9._+-]")


def safe_name(s: str | None) -> str:
    return _SAFE.sub("_", s or "all")


def lock(name: str) -> str:
    if name not in LOCK_NAMES:
        raise ValueError(f"unknown lock {name!r}")
    return f"{RUN_DIR}/{name}.lock"


def intent(iid: str) -> str:
    return f"{INTENTS}/{safe_name(iid)}.json"


def rollback(kernel: str) -> str:
    return f"{ROLLBACKS}/{safe_name(kernel)}.json"


def hold(kernel: str | None) -> str:
    """A hold on ``kernel``; None: on every kernel, also those installed later (``all.json``)."""
    return f"{HOLDS}/{safe_name(kernel)}.json"


def stock_record(kernel: str) -> str:
    return f"{DKMS_STATE}/{safe_name(kernel)}.json"


def legacy_stock_record(kernel: str) -> str:
    """The older stock record (one absolute path, a line) that act/steps.record_stock migrates into stock_record."""
    return f"{STOCK_DIR}/{kernel}"


def dkms_installed(kernel: str, suffix: str = "") -> str:
    """Where DKMS installs our nvidia-uvm for ``kernel`` (its DEST_MODULE_LOCATION, updates/dkms; ``suffix``: the
    compression's, e.g. ".zst"): the file that modprobe selects over the driver package's once depmod ran."""
    return f"/lib/modules/{kernel}/updates/dkms/nvidia-uvm.ko{suffix}"


def stock_original(kernel: str) -> str:
    return f"{DKMS_STATE}/original/{safe_name(kernel)}"


def source_tree(driver: str) -> str:
    """The cached tree of NVIDIA ``driver``'s open kernel-module source (the /usr/src/nvidia-<v> layout)."""
    return f"{SOURCES_CACHE}/nvidia-{safe_name(driver)}"
