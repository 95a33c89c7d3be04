"""The arm64 64 KiB kernel of the memory measurements (tests/test_kernel_memory.py): kind ``memory-6.12-64k``.

Debian's linux-source-6.12 (the series NVIDIA's trees build against), ``allnoconfig`` +
tests/kernel/memory-64k.config + ``olddefconfig``, built like the debug kernels (tests/support/debugkernel.py:
the same steps, every option checked to survive) but without their debug features: KASAN's shadow,
DEBUG_PAGEALLOC and kmemleak would change the very figures measured. It adds PSI, a virtio disk, THP and memory
blocks in sysfs, which the debug kernels lack.

Cached under $SPARK_MEMSAVER_TEST_CACHE/kernel/memory-64k-6.12 (flock ``kernel-memory-64k-6.12``, ``.ready``
stamp); built only with SPARK_MEMSAVER_BUILD_KERNEL=1 (or ``build=True``), else Unavailable with the command:
``SPARK_MEMSAVER_BUILD_KERNEL=1 python3 tests/support/memkernel.py`` (~10 min of 2 cores).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

try:
    from . import cache, debugkernel, qemu
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cache  # type: ignore
    import debugkernel  # type: ignore
    import qemu  # type: ignore

KIND = "memory-6.12-64k"
SERIES = "6.12."
FRAGMENT = debugkernel.KDIR / "memory-64k.config"
_READY = ".ready"


def options() -> list[str]:
    return [ln.strip() for ln in FRAGMENT.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def cache_path() -> Path:
    return cache.cache_dir() / "kernel" / "memory-64k-6.12"


def _tree(base: Path) -> Path | None:
    trees = sorted((base / "build").glob("linux-source-*")) if (base / "build").is_dir() else []
    return trees[0] if trees else None


def _stale(base: Path, wanted: list[str]) -> list[str]:
    tree = _tree(base)
    if tree is None or not (tree / ".config").exists():
        return wanted
    cfg = (tree / ".config").read_text().splitlines()
    return [o for o in wanted if o not in cfg]


def memory_kernel(build: bool | None = None) -> "qemu.Kernel":
    if build is None:
        build = os.environ.get("SPARK_MEMSAVER_BUILD_KERNEL") == "1"
    base, wanted = cache_path(), options()
    if not (base / _READY).exists() or _stale(base, wanted):
        if not build:
            raise qemu.Unavailable(
                f"the {KIND} kernel is not cached ({base}); build it with SPARK_MEMSAVER_BUILD_KERNEL=1 "
                f"python3 tests/support/memkernel.py (~10 min of 2 cores; docs/memory.md)")
        with cache.locked("kernel-memory-64k-6.12"):
            if not (base / _READY).exists() or _stale(base, wanted):
                debugkernel._build(SERIES, base, wanted)
    tree = _tree(base)
    rel = (tree / "include/config/kernel.release").read_text().strip()
    return qemu.Kernel(KIND, tree / "arch/arm64/boot/Image", tree, rel, 65536)


if __name__ == "__main__":
    k = memory_kernel()
    print(k.kind, k.release, k.image, (cache_path() / _READY).read_text().strip())
