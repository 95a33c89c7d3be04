"""The ONE source tree of an NVIDIA driver: the tree the DKMS build compiles (act/dkms_run.find_driver_source)
is the tree qualification hashes (world/support.source_trees), chosen by one rule over one candidate list.

    source_candidates(driver)        where a tree of ``driver`` may be: /usr/src's names, then the source cache
    read_tree_version(src)           the driver version a tree is compiled as (Kbuild's NV_VERSION_STRING)
    tree_problem(host, src, driver)  why ``src`` is not a complete tree of ``driver`` to build from, or None
    complete_source(host, driver)    the first complete candidate
    source_tree(host, driver)        the tree of ``driver``: the first complete candidate, else the first that
                                     exists (the one the build's refusal names), else None

Reads the host (files only) and decides nothing else; act/patch.py and act/dkms_run.py re-export these names.
"""

from __future__ import annotations

import re
from pathlib import Path

from spark_memsaver.errors import EXIT_USAGE, MemsaverError
from spark_memsaver.host import paths
from spark_memsaver.world.manifest import _VERSION_RE

SRC_ROOT = paths.SRC_ROOT
POOL_DEST = "nvidia-uvm"
_REQUIRED = ("Kbuild", "Makefile", "conftest.sh", "common/inc", "nvidia-uvm/uvm_mmu.c", "nvidia-uvm/uvm_mmu.h",
             "nvidia-uvm/nvidia-uvm-sources.Kbuild", "nvidia-uvm/nvidia-uvm.Kbuild")


class SourceTreeInvalid(MemsaverError):
    code = "source-tree-invalid"
    exit_code = EXIT_USAGE
    remedy = ("Point --source at an unmodified NVIDIA open kernel-module tree as installed under /usr/src "
              "(e.g. /usr/src/nvidia-580.142 or upstream's kernel-open/); reinstall the driver's DKMS "
              "source package if it was modified.")


def read_tree_version(src: Path) -> str:
    """Driver version of an NVIDIA /usr/src-layout tree (raises SourceTreeInvalid)."""
    src = Path(src)
    if not src.is_dir():
        raise SourceTreeInvalid(f"{src} is not a directory")
    missing = [p for p in _REQUIRED if not (src / p).exists()]
    if missing:
        raise SourceTreeInvalid(f"{src} is not an NVIDIA open kernel-module tree: missing {', '.join(missing)}")
    try:
        kbuild = (src / "Kbuild").read_text(errors="replace")
    except OSError as e:
        raise SourceTreeInvalid(f"cannot read {src / 'Kbuild'}: {e}")
    found = set(re.findall(r'-DNV_VERSION_STRING=\\?"([^"\\]+)\\?"', kbuild))
    if len(found) != 1:
        raise SourceTreeInvalid(f"{src / 'Kbuild'}: expected one NV_VERSION_STRING definition, found "
                                f"{sorted(found) or 'none'}")
    version = found.pop()
    if not _VERSION_RE.match(version):
        raise SourceTreeInvalid(f"{src / 'Kbuild'}: NV_VERSION_STRING {version!r} is not a driver version")
    dkms = src / "dkms.conf"
    if dkms.is_file():
        m = re.search(r'^PACKAGE_VERSION="?([^"\s]+)"?', dkms.read_text(errors="replace"), re.M)
        if m and _VERSION_RE.match(m.group(1)) and m.group(1) != version:
            raise SourceTreeInvalid(f"{src}: Kbuild says {version} but dkms.conf says {m.group(1)}")
    if (src / POOL_DEST / "uvm_pt_pack.c").exists() or \
            "uvm_pt_pack" in (src / "nvidia-uvm/nvidia-uvm-sources.Kbuild").read_text(errors="replace"):
        raise SourceTreeInvalid(f"{src} already carries the spark-memsaver pool (a patched copy?)",
                                remedy="Use the driver's unmodified tree under /usr/src as --source.")
    return version


def source_candidates(driver: str) -> list[str]:
    """Where a tree of ``driver`` may be, in the build's order: /usr/src's names, then the source cache (the tree
    act/source_fetch.py fetched)."""
    return [f"{SRC_ROOT}/nvidia-{driver}", f"{SRC_ROOT}/nvidia-open-{driver}",
            f"{SRC_ROOT}/nvidia-current-open-{driver}", f"{SRC_ROOT}/nvidia-current-{driver}",
            paths.source_tree(driver)]


def tree_problem(host, src: str, driver: str) -> str | None:
    """Why ``src`` is not a complete NVIDIA ``driver`` tree to build from, or None. The one completeness rule
    (find_driver_source, act/source_fetch.present and its pruning; the DKMS build script checks the same)."""
    try:                                    # (a missing directory is "not a directory" here)
        v = read_tree_version(host.path(src))
    except SourceTreeInvalid as e:
        return f"{src} is damaged: {e.message}"
    if v != driver:
        return f"{src} holds NVIDIA {v}, not {driver}"
    if not re.search(r"^NV_CONFTEST_", host.read_text(f"{src}/nvidia/nvidia.Kbuild") or "", re.M):
        return f"{src} is damaged: nvidia/nvidia.Kbuild is missing or has no conftest lists"
    for f in ("conftest.sh", "Makefile", "nvidia-uvm/uvm.c"):
        p = host.path(f"{src}/{f}")
        if not p.is_file() or p.stat().st_size == 0:
            return f"{src} is damaged: {f} is missing or empty"
    return None


def complete_source(host, driver: str, cache: bool = True) -> str | None:
    """The first candidate (/usr/src first, then the cache unless ``cache`` is False) that is complete."""
    return next((c for c in source_candidates(driver) if (cache or c != paths.source_tree(driver))
                 and host.path(c).is_dir() and tree_problem(host, c, driver) is None), None)


def source_tree(host, driver: str) -> str | None:
    """THE tree of ``driver`` (host path): what the build compiles and qualification hashes -- the first complete
    candidate, else the first candidate that exists (a build refuses it, naming it), else None."""
    return complete_source(host, driver) or next((c for c in source_candidates(driver) if host.path(c).is_dir()),
                                                 None)
