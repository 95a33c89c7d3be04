"""Test NVIDIA driver packages (.deb) for the lifecycle tests, built with the real dpkg-deb and cached.

Each package stands in for a distro's NVIDIA open-driver packages for one kernel (on DGX OS:
``nvidia-kernel-source-580-open`` + ``linux-objects-nvidia-580-open-<kernel>``) and installs:

``/usr/src/nvidia-<version>/``
    NVIDIA's real open kernel-module tree from Debian's ``nvidia-open-kernel-dkms`` (tests/support/nvsrc.py),
    less the prebuilt ``*.o_binary`` RM blobs (only nvidia.ko/nvidia-modeset.ko link them, and the stock
    nvidia.ko below is shipped prebuilt), so the package stays small; nvidia-uvm builds from it unchanged.
``/lib/modules/<kernel>/kernel/nvidia-<major>-open/{nvidia,nvidia-uvm}.ko``
    the real stock modules compiled from that tree for ``<kernel>`` (tests/support/stockdriver.py).

All versions share one package name, :data:`PACKAGE`, so ``apt install ./newer.deb`` and ``dpkg -i`` are
real upgrades (dpkg removes the old version's files). The postinst/postrm run ``depmod`` for the kernel
as driver packages do. The package name matches reconcile.DRIVER_PACKAGE_RE like the real ones.

"Unsupported" driver (:data:`UNSUPPORTED`): NVIDIA 555.58.02 re-versioned as 555.58.99, a release absent
from uvm_patch/manifest.yaml. Its tree says 555.58.99 (Kbuild's NV_VERSION_STRING and friends) and the
two stock modules carry ``version=555.58.99`` (the ``.modinfo`` string rewritten in place, same length;
code, CRCs and srcversion untouched). It stands in for a future NVIDIA release this spark-memsaver does not
know. Its tree also differs from 555.58.02's in one byte of ``nvidia-uvm/uvm_mmu.c``'s licence header: a tree
whose hooked files are identical to a compile-verified one inherits that qualification by content (issue 14
item 3, act/patch.qualify), so a version string alone no longer makes a release unknown.

API: ``driver_deb(version, kernel=None) -> Path`` (version in :data:`VERSIONS`);
     ``deb_version(version) -> str``.
Command line: ``python3 tests/support/driverdeb.py VERSION [KERNEL]`` prints the .deb path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from . import cache
except ImportError:  # run as a script: python3 tests/support/<name>.py
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cache  # type: ignore

try:
    from . import nvsrc, stockdriver
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import nvsrc  # type: ignore
    import stockdriver  # type: ignore

PACKAGE = "nvidia-kernel-source-sparktest"
UNSUPPORTED = "555.58.99"
_BASE = {"550.163.01": "550.163.01", "555.58.02": "555.58.02", UNSUPPORTED: "555.58.02"}
VERSIONS = tuple(_BASE)
_READY = ".ready"
_STAMP = {UNSUPPORTED: "ok drifted\n"}   # a cached package of an older recipe is rebuilt


def _ready(deb: Path, version: str) -> bool:
    stamp = Path(f"{deb}{_READY}")
    return deb.exists() and stamp.exists() and stamp.read_text() == _STAMP.get(version, "ok\n")


def _drift_hooked(tree: Path) -> None:
    mmu = tree / "nvidia-uvm/uvm_mmu.c"
    data = mmu.read_bytes()
    if not data.startswith(b"/*"):
        raise DriverDebError(f"{mmu}: expected a licence comment at the top")
    mmu.write_bytes(b"/*" + (b"#" if data[2:3] != b"#" else b"*") + data[3:])


class DriverDebError(RuntimeError):
    pass


def deb_version(version: str) -> str:
    return f"{version}-1"


_locked = cache.locked


def _reversion_tree(tree: Path, old: str, new: str) -> int:
    n = 0
    for f in [tree / "Kbuild", tree / "dkms.conf", *tree.glob("*.mk"), tree / "utils.mk", tree / "version.mk"]:
        if f.is_file():
            t = f.read_text(errors="surrogateescape")
            if old in t:
                f.write_text(t.replace(old, new), errors="surrogateescape")
                n += 1
    return n


def _reversion_ko(ko: Path, old: str, new: str) -> None:
    if len(old) != len(new):
        raise DriverDebError("re-versioning needs equal-length versions")
    data = ko.read_bytes()
    needle = f"version={old}\0".encode()
    if data.count(needle) != 1:
        raise DriverDebError(f"{ko}: expected exactly one '{needle!r}' in .modinfo, found {data.count(needle)}")
    ko.write_bytes(data.replace(needle, f"version={new}\0".encode()))
    got = subprocess.run(["modinfo", "-F", "version", str(ko)], capture_output=True, text=True).stdout.strip()
    if got != new:
        raise DriverDebError(f"{ko}: modinfo reads {got!r} after re-versioning, not {new}")


def driver_deb(version: str, kernel: str | None = None) -> Path:
    """Build (once, cached) and return the test driver package for ``version`` and ``kernel``."""
    if version not in _BASE:
        raise DriverDebError(f"no test driver package for {version} (known: {', '.join(VERSIONS)})")
    base = _BASE[version]
    kernel = kernel or nvsrc.x86_headers()[0]
    out_dir = nvsrc.cache_dir() / "driverdeb" / kernel
    deb = out_dir / f"{PACKAGE}_{deb_version(version)}_amd64.deb"
    if _ready(deb, version):
        return deb
    with _locked(f"driverdeb-{version}-{kernel}"):
        if _ready(deb, version):
            return deb
        built = stockdriver.build_stock(base, kernel)           # real nvidia.ko + nvidia-uvm.ko (cached)
        src = nvsrc.nvidia_source(base)
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".pkg-", dir=out_dir))
        try:
            pkg = tmp / "pkg"
            sdir = pkg / f"usr/src/nvidia-{version}"
            shutil.copytree(src, sdir, symlinks=True, ignore=shutil.ignore_patterns("*.o_binary"))
            mdir = pkg / stockdriver.module_dir(version, kernel).lstrip("/")
            mdir.mkdir(parents=True)
            for name in ("nvidia.ko", "nvidia-uvm.ko"):
                shutil.copy2(built / name, mdir / name)
            if version != base:
                if not _reversion_tree(sdir, base, version):
                    raise DriverDebError(f"{sdir}: no version string {base} found to rewrite")
                for name in ("nvidia.ko", "nvidia-uvm.ko"):
                    _reversion_ko(mdir / name, base, version)
            if version == UNSUPPORTED:
                _drift_hooked(sdir)
            dbg = pkg / "DEBIAN"
            dbg.mkdir()
            (dbg / "control").write_text(
                f"Package: {PACKAGE}\nVersion: {deb_version(version)}\nArchitecture: amd64\n"
                "Maintainer: spark-memsaver tests <tests@localhost>\nSection: contrib/kernel\nPriority: optional\n"
                f"Description: NVIDIA open kernel modules {version} for {kernel} (spark-memsaver test package)\n"
                " NVIDIA's open kernel-module source under /usr/src and the stock nvidia.ko/nvidia-uvm.ko\n"
                " built from it, standing in for a distribution's NVIDIA driver packages.\n")
            for script in ("postinst", "postrm"):
                (dbg / script).write_text(f"#!/bin/sh\nset -e\nif [ -d /lib/modules/{kernel} ]; then depmod -a {kernel}; fi\n")
                os.chmod(dbg / script, 0o755)
            subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-z1", "--build", str(pkg), str(deb)],
                           check=True, capture_output=True)
            Path(f"{deb}{_READY}").write_text(_STAMP.get(version, "ok\n"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return deb


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    print(driver_deb(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
