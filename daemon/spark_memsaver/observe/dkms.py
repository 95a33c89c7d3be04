"""Our DKMS registrations as DKMS keeps them (/var/lib/dkms/spark-memsaver-uvm), read without running dkms:
versions registered, kernels built, the version installed for a kernel, the built module file."""

from __future__ import annotations

import os
import re
from pathlib import Path


from spark_memsaver import __version__
from spark_memsaver.host import Host, paths


PACKAGE = "spark-memsaver-uvm"


MODULE = "nvidia-uvm"


DKMS_TREE = "/var/lib/dkms"


SRC_ROOT = paths.SRC_ROOT          # host/paths.py is the one list


FORCE_FILE = f"/usr/share/dkms/modules_to_force_install/{PACKAGE}"


DEPMOD_FILE = f"/usr/lib/depmod.d/{PACKAGE}.conf"


DEST = "/updates/dkms"


_SUFFIXES = ("", ".xz", ".zst", ".gz")


# ------------------------------------------------------------------------------------------------
# Named errors


def dkms_version_string(driver: str, ours: str = __version__) -> str:
    return f"{driver}-sm{ours}"


def parse_dkms_version(v: str) -> tuple[str, str] | None:
    m = re.match(r"^(\d+\.\d+(?:\.\d+)?)-sm(.+)$", v)
    return (m.group(1), m.group(2)) if m else None


def registered_versions(host: Host) -> list[str]:
    base = host.path(f"{DKMS_TREE}/{PACKAGE}")
    try:
        return sorted(n for n in os.listdir(base) if not n.startswith(("kernel-", "original_module"))
                      and (base / n).is_dir())
    except OSError:
        return []


def _arch_dirs(host: Host, ver: str, kernel: str) -> list[Path]:
    return sorted(p for p in host.path(f"{DKMS_TREE}/{PACKAGE}/{ver}/{kernel}").glob("*") if p.is_dir())


def built_module(host: Host, ver: str, kernel: str) -> Path | None:
    for a in _arch_dirs(host, ver, kernel):
        for s in _SUFFIXES:
            p = a / "module" / f"{MODULE}.ko{s}"
            if p.is_file():
                return p
    return None


def installed_version(host: Host, kernel: str) -> str | None:
    """Our DKMS version installed for `kernel` (DKMS's kernel-<k>-<arch> link), else None."""
    base = host.path(f"{DKMS_TREE}/{PACKAGE}")
    for link in base.glob(f"kernel-{kernel}-*"):
        if link.is_symlink():
            return os.readlink(link).split("/")[0]
    return None


def kernels_of(host: Host, ver: str) -> list[str]:
    base = host.path(f"{DKMS_TREE}/{PACKAGE}/{ver}")
    try:
        return sorted(n for n in os.listdir(base) if n not in ("source", "build", "log") and (base / n).is_dir())
    except OSError:
        return []


def installed_path(host: Host, kernel: str, suffix: str = "") -> str:
    return paths.dkms_installed(kernel, suffix)        # host/paths.py: the one location


# ------------------------------------------------------------------------------------------------
# Acting helpers
