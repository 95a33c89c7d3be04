"""A real stock NVIDIA driver (nvidia.ko + nvidia-uvm.ko) for a test kernel, built once and cached.

Stands in for nothing: the modules are compiled from Debian's ``nvidia-open-kernel-dkms`` sources
(:func:`tests.support.nvsrc.nvidia_source`) against the real kernel headers, exactly as a driver
package's build would, and carry real ``__kcrctab`` CRCs, ``vermagic`` and ``depends``. What a
driver *package* adds (dpkg ownership) is not reproduced here; the lifecycle tests wrap these files
into test .debs themselves.

Where :func:`install_stock` puts things, and why
    ``<root>/lib/modules/<kernel>/kernel/nvidia-<branch>-open/{nvidia,nvidia-uvm}.ko``
        the layout of Ubuntu's prebuilt ``linux-objects-nvidia-<branch>-open-<kernel>`` packages
        (what DGX OS ships; ``<branch>`` = the major version, e.g. ``550``). Plain names (``nvidia``,
        ``nvidia-uvm``) as on Ubuntu, not Debian's ``nvidia-current*`` renames, so ``modinfo -k K
        nvidia`` / ``nvidia-uvm`` select them. ``kernel/`` ranks "built-in" for depmod, below
        ``updates/`` where DKMS puts overrides: the same priority relation as on a Spark.
    ``<root>/usr/src/nvidia-<version>/``
        the layout of Ubuntu's ``nvidia-kernel-source-<branch>-open`` (the NVIDIA open tree:
        ``Kbuild``, ``Makefile``, ``conftest.sh``, ``common/``, ``nvidia-uvm/`` ...; a real copy,
        never a link into the cache, so tests may damage it).
    Both get a ``.spark-memsaver-test-stock`` marker so :func:`uninstall_stock` removes only what
    it installed; ``depmod`` is run for the kernel afterwards (``-b root`` for a non-/ root).

API
    ``STOCK_VERSIONS``: the versions supported here (550.163.01, 555.58.02).
    ``build_stock(version, kernel=None) -> Path``: directory holding ``nvidia.ko`` and
        ``nvidia-uvm.ko`` (``strip -g``'d as distro packages ship them) plus ``build.json``
        (version, kernel, fixes applied, seconds). Cached under
        ``$SPARK_MEMSAVER_TEST_CACHE/stockdriver/<version>/<kernel>/`` with a file lock, so
        concurrent callers build once. ``kernel`` defaults to Debian's ``linux-headers-amd64`` release.
    ``install_stock(version, kernel=None, root="/", source=True) -> dict``: install as above; returns
        ``{"kernel", "version", "module_dir", "nvidia", "nvidia_uvm", "source_dir"}``. Refuses
        (:class:`StockError`) to overwrite files it did not install.
    ``uninstall_stock(version, kernel=None, root="/") -> None``: undo :func:`install_stock` (idempotent).
    ``module_dir(version, kernel)``, ``source_dir(version)``: the host paths used (without root).

Fixes applied to NVIDIA's sources before building (recorded in ``build.json``): when the kernel's
``pci_resize_resource()`` takes the 4th ``exclude_bars`` argument (Debian 6.1.192 headers) and the
NVIDIA tree calls it with three, ``0`` is passed as the 4th argument (nvidia.ko only; see
shared/briefs/harness.md 1c). Nothing else is changed.

Command line: ``python3 tests/support/stockdriver.py build|install|uninstall VERSION [KERNEL]``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from . import cache
except ImportError:  # run as a script: python3 tests/support/<name>.py
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cache  # type: ignore

try:
    from . import nvsrc
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import nvsrc  # type: ignore

__all__ = ["STOCK_VERSIONS", "StockError", "build_stock", "install_stock", "uninstall_stock",
           "module_dir", "source_dir"]

STOCK_VERSIONS = ("550.163.01", "555.58.02")
MARKER = ".spark-memsaver-test-stock"
_READY = ".ready"


class StockError(RuntimeError):
    """The stock driver cannot be built or installed here (message says why)."""


def _default_kernel(kernel: str | None) -> str:
    if kernel:
        return kernel
    try:
        return nvsrc.x86_headers()[0]
    except nvsrc.SourceUnavailable as e:
        raise StockError(str(e)) from e


def module_dir(version: str, kernel: str) -> str:
    return f"/lib/modules/{kernel}/kernel/nvidia-{version.split('.')[0]}-open"


def source_dir(version: str) -> str:
    return f"/usr/src/nvidia-{version}"


_locked = cache.locked


def _fix_pci_resize(tree: Path, kernel: str) -> list[str]:
    pci_h = Path(f"/lib/modules/{kernel}/source/include/linux/pci.h")
    if not pci_h.exists():
        pci_h = Path(f"/lib/modules/{kernel}/build/include/linux/pci.h")
    try:
        text = pci_h.read_text(errors="replace")
    except OSError:
        return []
    m = re.search(r"int\s+__must_check\s+pci_resize_resource\(([^)]*)\)", text, re.S)
    if not m or "exclude_bars" not in m.group(1):
        return []
    f = tree / "nvidia" / "nv-pci.c"
    src = f.read_text()
    new, n = re.subn(r"pci_resize_resource\((\s*pci_dev\s*,\s*NV_GPU_BAR1\s*,\s*requested_size\s*)\)",
                     r"pci_resize_resource(\1, 0)", src)
    if n:
        f.write_text(new)
        return [f"nvidia/nv-pci.c: pci_resize_resource(..., 0) for {pci_h} (exclude_bars), {n} call(s)"]
    return []


def build_stock(version: str, kernel: str | None = None) -> Path:
    """Build (once) and return the cache directory holding nvidia.ko and nvidia-uvm.ko."""
    if version not in STOCK_VERSIONS:
        raise StockError(f"no stock build recipe for NVIDIA {version} (known: {', '.join(STOCK_VERSIONS)})")
    kernel = _default_kernel(kernel)
    out = nvsrc.cache_dir() / "stockdriver" / version / kernel
    if (out / _READY).exists():
        return out
    with _locked(f"stockdriver-{version}-{kernel}"):
        if (out / _READY).exists():
            return out
        if not Path(f"/lib/modules/{kernel}/build/Makefile").exists():
            raise StockError(f"kernel headers for {kernel} are not installed")
        try:
            src = nvsrc.nvidia_source(version)
        except nvsrc.SourceUnavailable as e:
            raise StockError(str(e)) from e
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{kernel}.tmp-", dir=out.parent))
        try:
            tree = tmp / "src"
            shutil.copytree(src, tree, symlinks=True)
            fixes = _fix_pci_resize(tree, kernel)
            t0 = time.monotonic()
            argv = ["nice", "-n", "5", "make", "-j2", "modules", f"KERNEL_UNAME={kernel}",
                    "NV_KERNEL_MODULES=nvidia nvidia-uvm"]
            with open(tmp / "make.log", "w") as log:
                p = subprocess.run(argv, cwd=tree, stdout=log, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, LC_ALL="C.UTF-8"), timeout=3600)
            seconds = round(time.monotonic() - t0, 1)
            logtext = (tmp / "make.log").read_text(errors="replace")
            if p.returncode != 0:
                tail = "\n".join(logtext.strip().splitlines()[-20:])
                raise StockError(f"stock build of NVIDIA {version} for {kernel} failed (rc={p.returncode}):\n{tail}")
            if "WARNING: modpost" in logtext:
                raise StockError("stock build has modpost warnings:\n"
                                 + "\n".join(l for l in logtext.splitlines() if "modpost" in l)[-3000:])
            res = tmp / "result"
            res.mkdir()
            for name in ("nvidia.ko", "nvidia-uvm.ko"):
                shutil.copy2(tree / name, res / name)
                subprocess.run(["strip", "-g", str(res / name)], check=True)
            (res / "build.json").write_text(json.dumps({
                "version": version, "kernel": kernel, "fixes": fixes, "seconds": seconds,
                "source": str(src), "make": argv[3:]}, indent=2) + "\n")
            shutil.copy2(tmp / "make.log", res / "make.log")
            (res / _READY).write_text("ok\n")
            if out.exists():
                shutil.rmtree(out)
            os.rename(res, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _depmod(kernel: str, root: str) -> None:
    argv = ["depmod", "-a", kernel] if root in ("/", "") else ["depmod", "-b", root, "-a", kernel]
    subprocess.run(argv, check=True, capture_output=True)


def install_stock(version: str, kernel: str | None = None, root: str = "/", source: bool = True) -> dict:
    """Install the stock modules (and the NVIDIA source) as a driver package would; see module doc."""
    kernel = _default_kernel(kernel)
    built = build_stock(version, kernel)
    r = Path(root)
    mdir = r / module_dir(version, kernel).lstrip("/")
    sdir = r / source_dir(version).lstrip("/")
    for d in ([mdir, sdir] if source else [mdir]):
        if d.exists() and not (d / MARKER).exists():
            raise StockError(f"{d} exists and was not installed by the test helper: refusing to touch it")
    mdir.mkdir(parents=True, exist_ok=True)
    for name in ("nvidia.ko", "nvidia-uvm.ko"):
        tmp = mdir / f".{name}.tmp"
        shutil.copy2(built / name, tmp)
        os.rename(tmp, mdir / name)
    (mdir / MARKER).write_text(f"{version} {kernel}\n")
    if source:
        if sdir.exists():
            shutil.rmtree(sdir)
        tmp = sdir.parent / f".{sdir.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(nvsrc.nvidia_source(version), tmp, symlinks=True)
        (tmp / MARKER).write_text(f"{version}\n")
        os.rename(tmp, sdir)
    _depmod(kernel, root)
    return {"kernel": kernel, "version": version, "module_dir": module_dir(version, kernel),
            "nvidia": f"{module_dir(version, kernel)}/nvidia.ko",
            "nvidia_uvm": f"{module_dir(version, kernel)}/nvidia-uvm.ko",
            "source_dir": source_dir(version) if source else None}


def uninstall_stock(version: str, kernel: str | None = None, root: str = "/") -> None:
    """Remove what install_stock put there (only directories carrying its marker)."""
    kernel = _default_kernel(kernel)
    r = Path(root)
    changed = False
    for d in (r / module_dir(version, kernel).lstrip("/"), r / source_dir(version).lstrip("/")):
        if (d / MARKER).exists():
            shutil.rmtree(d)
            changed = True
    kdir = r / "lib/modules" / kernel / "kernel"
    if changed and kdir.is_dir() and not any(kdir.iterdir()):
        kdir.rmdir()  # created by install_stock on a headers-only kernel
    if changed and (r / "lib/modules" / kernel).is_dir():
        _depmod(kernel, root)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("build", "install", "uninstall"):
        print(__doc__)
        return 2
    kernel = argv[2] if len(argv) > 2 else None
    try:
        if argv[0] == "build":
            print(build_stock(argv[1], kernel))
        elif argv[0] == "install":
            print(json.dumps(install_stock(argv[1], kernel), indent=2))
        else:
            uninstall_stock(argv[1], kernel)
    except StockError as e:
        print(f"unavailable: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
