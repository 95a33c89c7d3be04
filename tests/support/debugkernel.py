"""arm64 debug kernels built from Debian's linux-source for the qemu tests (tests/support/qemu.py kinds).

``debug_kernel(series)`` builds Debian's newest ``linux-source-<series>*`` for arm64 with 64 KiB pages,
``allnoconfig`` + tests/kernel/debug-64k.config (+ debug-nvidia.config for 6.12) + ``olddefconfig``; every
option of the fragments must survive olddefconfig (a dropped one is an error). Debug features: KASAN
(generic, outline), PROVE_LOCKING, DEBUG_PAGEALLOC (on by default), DMA_API_DEBUG, DEBUG_KMEMLEAK,
SLUB_DEBUG, DEBUG_ATOMIC_SLEEP; MODVERSIONS on (modules' CRCs are checked at load).

Kinds and cache entries (under $SPARK_MEMSAVER_TEST_CACHE/kernel, built under a named flock, published
by a ``.ready`` stamp; built only when SPARK_MEMSAVER_BUILD_KERNEL=1 or the caller asks (``build=True``: CI's
share, tests/test_kernel_build.py), else taken from the cache or reported unavailable with the command that
builds it). A cached build whose .config lacks an option the fragments now ask for is built again.
  ``debug-64k``        series "7."    -> debug-64k/build/linux-source-7.x      (the pool's selftest)
  ``debug-6.12-64k``   series "6.12." -> debug-64k-6.12/build/linux-source-6.12 (NVIDIA's trees compile
                       against 6.12, not 7.2/7.3: tests/test_kernel_pagetree.py)

By hand: ``SPARK_MEMSAVER_BUILD_KERNEL=1 python3 tests/support/debugkernel.py 6.12.``
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

try:
    from . import cache, qemu
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cache  # type: ignore
    import qemu  # type: ignore

KDIR = Path(__file__).resolve().parents[2] / "tests" / "kernel"
_READY = ".ready"
#: series -> (kind, cache directory name, config fragments)
SERIES = {
    "7.": ("debug-64k", "debug-64k", ("debug-64k.config",)),
    "6.12.": ("debug-6.12-64k", "debug-64k-6.12", ("debug-64k.config", "debug-nvidia.config")),
}


def options(series: str) -> list[str]:
    out: list[str] = []
    for frag in SERIES[series][2]:
        out += [ln.strip() for ln in (KDIR / frag).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return out


def cache_path(series: str) -> Path:
    return cache.cache_dir() / "kernel" / SERIES[series][1]


def debug_kernel(series: str = "7.", build: bool | None = None) -> "qemu.Kernel":
    """The kernel of series; build: None = SPARK_MEMSAVER_BUILD_KERNEL=1 decides, True/False = the caller."""
    kind, _, _ = SERIES[series]
    if build is None:
        build = os.environ.get("SPARK_MEMSAVER_BUILD_KERNEL") == "1"
    base = cache_path(series)
    stamp = base / _READY
    opts_wanted = options(series)
    trees = sorted((base / "build").glob("linux-source-*")) if (base / "build").is_dir() else []
    if not stamp.exists() and trees and (trees[0] / "arch/arm64/boot/Image").exists() \
            and (trees[0] / "Module.symvers").exists():
        # a build finished by hand with the same steps counts once its config checks out
        if all(o in (trees[0] / ".config").read_text().splitlines() for o in opts_wanted):
            stamp.write_text("adopted\n")
    if stamp.exists() and trees and not all(o in (trees[0] / ".config").read_text().splitlines() for o in opts_wanted):
        stale = f"its .config lacks {[o for o in opts_wanted if o not in (trees[0] / '.config').read_text().splitlines()]}"
    else:
        stale = ""
    if not stamp.exists() or stale:
        if not build:
            raise qemu.Unavailable(
                f"the {kind} debug kernel is not cached ({base}{': ' + stale if stale else ''}); build it with "
                f"SPARK_MEMSAVER_BUILD_KERNEL=1 python3 tests/support/debugkernel.py {series} (5-45 min of 2 cores, "
                f"docs/kernel-tests.md; CI builds only the 6.12 one, tests/test_kernel_build.py)")
        with cache.locked(f"kernel-{SERIES[series][1]}"):
            if not stamp.exists() or stale:
                _build(series, base, opts_wanted)
    tree = sorted((base / "build").glob("linux-source-*"))[0]
    rel = (tree / "include/config/kernel.release").read_text().strip()
    return qemu.Kernel(kind, tree / "arch/arm64/boot/Image", tree, rel, 65536)


def _build(series: str, base: Path, wanted: list[str]) -> None:
    opts = qemu._apt()
    version = qemu.newest_version(opts, "linux-source", series)
    tarball = qemu._linux_source(opts, version)
    shutil.rmtree(base, ignore_errors=True)
    (base / "build").mkdir(parents=True)
    t0 = time.time()
    qemu._run(["tar", "-xf", tarball, "-C", base / "build"])
    tree = next((base / "build").glob("linux-source-*"))
    env = {"ARCH": "arm64", "CROSS_COMPILE": qemu.CROSS}
    qemu._run(["make", "allnoconfig"], cwd=tree, env=env)
    with open(tree / ".config", "a") as fh:
        fh.write("\n".join(wanted) + "\n")
    qemu._run(["make", "olddefconfig"], cwd=tree, env=env)
    cfg = (tree / ".config").read_text().splitlines()
    dropped = [o for o in wanted if o not in cfg]
    if dropped:
        raise qemu.Unavailable(f"olddefconfig dropped {dropped} from linux-source {version}")
    t1 = time.time()
    qemu._run(["nice", "-n", "10", "make", "-j2", "Image", "modules"], cwd=tree, env=env, timeout=3 * 3600,
              log=base / "build.log")
    (base / _READY).write_text(f"linux-source {version}: built in {time.time() - t1:.0f}s "
                               f"(+{t1 - t0:.0f}s extract/config)\n")


if __name__ == "__main__":
    arg = (sys.argv[1] if len(sys.argv) > 1 else "7").rstrip(".") + "."      # "6.12" and "6.12." alike
    if arg not in SERIES:
        sys.exit(f"debugkernel.py: no debug kernel series {sys.argv[1]!r}; one of: {', '.join(s.rstrip('.') for s in SERIES)}")
    k = debug_kernel(arg)
    print(k.kind, k.release, k.image, (cache_path(arg) / _READY).read_text().strip())
