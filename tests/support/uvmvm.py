"""NVIDIA's own UVM page-tree tests through the packing hooks, in an arm64 VM (tests/test_kernel_pagetree.py).

``build(k, version, dest) -> Built``: the real patched nvidia-uvm.ko (NVIDIA's open tree of ``version``,
through the product's apply step, ``spark-memsaver patch apply``, zero fuzz) built by NVIDIA's own Makefile
against ``k`` (tests/support/qemu.py), together with a stand-in nvidia.ko (tests/kernel/standin-rm) built
in the same Kbuild run from NVIDIA's own headers: modpost resolves every symbol nvidia-uvm imports against
it (no KBUILD_MODPOST_WARN), and, where the kernel has CONFIG_MODVERSIONS, the CRCs are genksyms' of
NVIDIA's prototypes. The test copy of the tree adds ``-DUVM_PT_PACK_TEST_FAKE_GPU`` to uvm_pt_pack.o (and to
nothing else): the pool accepts UVM's fake GPUs and prints cumulative ``test_total_*`` counters.

``pt_run(tree, dest)``: tests/kernel/pagetree/pt_run.c, static arm64, built with the tree's own
uvm_ioctl.h / uvm_linux_ioctl.h / uvm_test_ioctl.h (include paths; nothing copied into the repository).

``initramfs(built, runner, dest)``: busybox + tests/kernel/pagetree/init.sh + the two modules + pt_run.

``build(..., race=True)`` (TEST BUILD ONLY, its own cache entry ``...-race``): tests/kernel/pagetree/pt_race.c
inserted into the copy's uvm_page_tree_test.c, run by uvm_test_page_tree() instead of NVIDIA's suite when the
module parameter uvm_pt_pack_test_race_threads is > 0 (N kthreads race NVIDIA's get_ptes / alloc_table /
put_ptes on one fake-GPU tree), and one counting statement in each of the copy's uvm_mmu.c paths it is about
(RACE_EDITS). Never shipped: tests/test_kernel_pagetree.py checks the apply output and the DKMS tree for RACE_MARKER.

NVIDIA's trees come from tests/support/nvsrc.py (Debian's archive, or a ``git archive`` export of
github NVIDIA/open-gpu-kernel-modules into the cache: ``python3 tests/support/nvsrc.py git-export CLONE TAG``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from . import cache, nvsrc, qemu
except ImportError:  # pragma: no cover
    import cache  # type: ignore
    import nvsrc  # type: ignore
    import qemu  # type: ignore

REPO = Path(__file__).resolve().parents[2]
KDIR = REPO / "tests" / "kernel"
SWITCH = "UVM_PT_PACK_TEST_FAKE_GPU"
#: a string only the switch compiles in (uvm_pt_pack.c); its absence from a module proves the switch is off
SWITCH_MARKER = b"test_fake_gpu_build"
RACE_SRC = KDIR / "pagetree" / "pt_race.c"
#: the race variant's module parameter; in no product file, and in no module but the race variant's
RACE_MARKER = b"uvm_pt_pack_test_race_threads"
_HIT = "uvm_pt_race_hit"
#: (file in nvidia-uvm/, anchor, replacement): each anchor must occur exactly once in the patched copy. The
#: uvm_mmu.c ones only count (pt_race.c's uvm_pt_race_hit): the retry of uvm_page_tree_get_ptes_async() (the
#: lock dropped to allocate a directory), a directory so allocated found unused and freed (another thread
#: inserted one first), uvm_page_tree_alloc_table()'s should_free.
RACE_EDITS = (
    ("uvm_mmu.c", '#include "uvm_mmu.h"\n',
     f'#include "uvm_mmu.h"\nvoid {_HIT}(int what); /* TEST BUILD ONLY (tests/support/uvmvm.py, race) */\n'),
    ("uvm_mmu.c", "                    return NV_ERR_MORE_PROCESSING_REQUIRED;\n",
     f"                    {_HIT}(0);\n                    return NV_ERR_MORE_PROCESSING_REQUIRED;\n"),
    ("uvm_mmu.c", "            if (j == used_count) {\n",
     f"            if (j == used_count) {{\n                {_HIT}(1);\n"),
    ("uvm_mmu.c", "        should_free = true;\n", f"        should_free = true;\n        {_HIT}(2);\n"),
    ("uvm_page_tree_test.c", "    if (!g_uvm_global.ats.enabled)\n",
     "    if (uvm_pt_pack_test_race_threads > 0) {\n        status = pt_race_run(gpu);\n        goto done;\n    }\n"
     "    if (!g_uvm_global.ats.enabled)\n"),
    ("uvm_page_tree_test.c", "NV_STATUS uvm_test_page_tree(UVM_TEST_PAGE_TREE_PARAMS *params, struct file *filp)\n",
     "@RACE_SRC@NV_STATUS uvm_test_page_tree(UVM_TEST_PAGE_TREE_PARAMS *params, struct file *filp)\n"),
)
CROSS = qemu.CROSS
MAKEARCH = ["ARCH=arm64", f"CROSS_COMPILE={CROSS}", f"CC={CROSS}gcc", f"LD={CROSS}ld", f"OBJDUMP={CROSS}objdump"]


@dataclasses.dataclass
class Built:
    version: str
    tree: Path            # the patched NVIDIA tree (test copy)
    nvidia: Path          # stand-in nvidia.ko
    uvm: Path             # patched nvidia-uvm.ko (test build)
    seconds: float
    log: Path


def nvidia_tree(version: str) -> Path:
    """NVIDIA's open tree for version (raises nvsrc.SourceUnavailable with the remedy)."""
    return nvsrc.nvidia_source(version)


def _add_standin(src: Path, tree: Path) -> None:
    d = tree / "standin-rm"
    d.mkdir()
    for f in ("standin_rm.c", "standin_rm.h", "standin-rm.Kbuild"):
        shutil.copy(KDIR / "standin-rm" / f, d / f)
    qemu._run([sys.executable, KDIR / "standin-rm" / "gen_stubs.py", tree / "common/inc/nv_uvm_interface.h",
               d / "standin_rm.c", d / "standin_stubs.c"])
    conftests = [ln for ln in (src / "nvidia/nvidia.Kbuild").read_text().splitlines() if ln.startswith("NV_CONFTEST_")]
    if not conftests:
        raise qemu.Unavailable(f"{src}/nvidia/nvidia.Kbuild has no NV_CONFTEST_ lines")
    with open(d / "standin-rm.Kbuild", "a") as fh:
        fh.write("# nvidia/nvidia.Kbuild's conftest lists (nv-linux.h needs them)\n" + "\n".join(conftests) + "\n")


#: r535's uvm_lock.h initialises UVM's locks in static functions, so every UVM mutex (rwsem, spinlock) of a
#: compilation unit shares one lockdep class: lockdep then reports NVIDIA's own nesting of two va_space mutexes in
#: uvm_va_space_create() as "possible recursive locking" and switches itself off for the rest of the boot, which
#: would leave the pool unchecked. r550 and later make these initialisers macros (a class per call site); the test
#: copy of an older tree gets the same (TEST BUILD ONLY, appended to uvm_lock.h; the product builds NVIDIA's file
#: as it is). The value: the field that holds the kernel lock.
LOCK_INITS = {"uvm_mutex_init": "m", "uvm_init_rwsem": "sem", "uvm_spin_lock_init": "lock",
              "uvm_spin_lock_irqsave_init": "lock", "uvm_rwlock_irqsave_init": "lock"}
LOCK_GUARD_END = "#endif // __UVM_LOCK_H__"


def lockdep_classes(tree: Path) -> list[str]:
    """Give each lock initialisation site of the test tree its own lockdep class where uvm_lock.h initialises
    locks in static functions (see LOCK_INITS); returns the initialisers wrapped ([] for r550 and later)."""
    h = tree / "nvidia-uvm" / "uvm_lock.h"
    text = h.read_text()
    wrapped = [f for f in LOCK_INITS if re.search(rf"^static void {f}\(", text, re.M)]
    if not wrapped:
        return []
    if text.count(LOCK_GUARD_END) != 1:
        raise AssertionError(f"{h}: no single '{LOCK_GUARD_END}' to add the lockdep classes before")
    block = ["", "/* tests/support/uvmvm.py (TEST BUILD ONLY): a lockdep class per initialisation site, as r550+ */"]
    for f in wrapped:
        block.append(f"#define {f}(lock_, order_) do {{ static struct lock_class_key uvm_test_key_; "
                     f"({f})((lock_), (order_)); lockdep_set_class(&(lock_)->{LOCK_INITS[f]}, &uvm_test_key_); "
                     "} while (0)")
    h.write_text(text.replace(LOCK_GUARD_END, "\n".join(block) + "\n\n" + LOCK_GUARD_END))
    return wrapped


#: where NVIDIA's UVM_TEST_MEM_SANITY needs a registered GPU: r535 asks uvm_conf_computing_mode_enabled() about
#: the VA space's first GPU, a NULL pointer without one (r550+ read g_uvm_global.conf_computing_enabled)
MEM_NEEDS_GPU = "uvm_conf_computing_mode_enabled(uvm_va_space_find_first_gpu(va_space))"


def gpu_free_skips(tree: Path) -> dict[str, str]:
    """pt_run's GPU-free tests this tree's own code cannot run without a GPU: name -> why (read from the tree)."""
    mem = tree / "nvidia-uvm" / "uvm_mem_test.c"
    if mem.exists() and MEM_NEEDS_GPU in mem.read_text():
        return {"mem": f"uvm_mem_test.c calls {MEM_NEEDS_GPU}: a NULL GPU without one"}
    return {}


def add_race(uvm_dir: Path) -> None:
    """The race variant's edits (RACE_EDITS) to a patched nvidia-uvm/ directory; a missing or repeated anchor
    (another NVIDIA tree) is an error naming it."""
    for name, anchor, new in RACE_EDITS:
        f = uvm_dir / name
        text = f.read_text()
        if text.count(anchor) != 1:
            raise AssertionError(f"{f}: the race variant's anchor {anchor.strip()!r} occurs {text.count(anchor)} times")
        src = f"/* ---- tests/kernel/pagetree/pt_race.c (TEST BUILD ONLY) ---- */\n{RACE_SRC.read_text()}\n"
        f.write_text(text.replace(anchor, new.replace("@RACE_SRC@", src)))


def build(k: qemu.Kernel, version: str, dest: Path, *, switch: bool = True, inject: int = 0, race: bool = False,
          jobs: int = 2) -> Built:
    """Patched nvidia-uvm.ko + stand-in nvidia.ko for k, in dest (fresh each call). inject: the pool's
    UVM_PT_PACK_FAULT_INJECT (a deliberately broken pool, to show NVIDIA's tests catch it). race: add the
    page-tree race (add_race)."""
    src = nvidia_tree(version)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    tree = dest / "nv"
    env = {"PYTHONPATH": str(REPO / "daemon")}
    qemu._run(["/usr/bin/python3", "-m", "spark_memsaver", "patch", "apply", "--source", src, "--dest", tree,
               "--slim", "--json"], env=env, log=dest / "apply.json")
    # the test-only switch, for the pool's object only (the apply step's own tier-default lines use the same form)
    if switch:
        with open(tree / "nvidia-uvm/nvidia-uvm-sources.Kbuild", "a") as fh:
            fh.write(f"\n# tests/support/uvmvm.py (TEST BUILD ONLY): the pool accepts UVM's fake GPUs\n"
                     f"CFLAGS_uvm_pt_pack.o += -D{SWITCH}\nCFLAGS_nvidia-uvm/uvm_pt_pack.o += -D{SWITCH}\n")
            if inject:
                fh.write(f"CFLAGS_uvm_pt_pack.o += -DUVM_PT_PACK_FAULT_INJECT={inject}\n"
                         f"CFLAGS_nvidia-uvm/uvm_pt_pack.o += -DUVM_PT_PACK_FAULT_INJECT={inject}\n")
    if race:
        add_race(tree / "nvidia-uvm")
    _add_standin(src, tree)
    lockdep_classes(tree)
    # (no KERNELRELEASE=: NVIDIA's Makefile reads a set KERNELRELEASE as "called by Kbuild"; the tree's own
    # include/config/kernel.release already is k.release)
    t0 = time.time()
    # no KBUILD_MODPOST_WARN: every import of nvidia-uvm must resolve against the stand-in
    e = {k_: v for k_, v in os.environ.items() if k_ != "KBUILD_MODPOST_WARN"}
    e["LC_ALL"] = "C.UTF-8"
    p = subprocess.run(["nice", "-n", "10", "make", "-C", str(tree), f"-j{jobs}", *MAKEARCH, f"SYSSRC={k.tree}",
                        f"SYSOUT={k.tree}", "NV_KERNEL_MODULES=standin-rm nvidia-uvm", "modules"],
                       env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                       timeout=3600)
    log = dest / "build.log"
    log.write_text(p.stdout)
    secs = time.time() - t0
    if p.returncode:
        raise AssertionError(f"NVIDIA {version} build against {k.release} failed (rc={p.returncode}), {log}:\n" +
                             "\n".join(p.stdout.splitlines()[-30:]))
    if "WARNING: modpost" in p.stdout:
        raise AssertionError("modpost warnings:\n" + "\n".join(ln for ln in p.stdout.splitlines() if "modpost" in ln))
    return Built(version, tree, tree / "nvidia.ko", tree / "nvidia-uvm.ko", secs, log)


def pt_run(built: Built, dest: Path) -> Path:
    """tests/kernel/pagetree/pt_run.c, static arm64, with the tree's own UVM ioctl headers."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    inc = built.tree
    qemu._run([f"{CROSS}gcc", "-static", "-O2", "-Wall", "-Werror", "-o", dest,
               *(f"-DPT_RUN_SKIP_{t.upper()}" for t in gpu_free_skips(built.tree)),
               f"-I{inc / 'nvidia-uvm'}", f"-I{inc / 'common/inc'}", KDIR / "pagetree/pt_run.c"])
    return dest


def initramfs(built: Built, runner: Path, dest: Path, *, init: Path = KDIR / "pagetree" / "init.sh",
              extra: dict[str, Path] | None = None) -> Path:
    """busybox, init (PID 1), the two modules, pt_run, and extra (name in / -> file: tests/test_kernel_oom.py's
    selftest modules)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for d in ("bin", "proc", "sys", "dev", "tmp"):
            (root / d).mkdir()
        shutil.copy(qemu.busybox(), root / "bin/busybox")
        (root / "bin/sh").symlink_to("busybox")
        shutil.copy(init, root / "init")
        os.chmod(root / "init", 0o755)
        shutil.copy(built.nvidia, root / "nvidia.ko")
        shutil.copy(built.uvm, root / "nvidia-uvm.ko")
        shutil.copy(runner, root / "pt_run")
        os.chmod(root / "pt_run", 0o755)
        for name, src in (extra or {}).items():
            shutil.copy(src, root / name)
        qemu.pack_initramfs(root, dest)
    return dest


def cache_key(k: qemu.Kernel, version: str, digest: str) -> str:
    return f"{version}-{k.kind}-{k.release}-{digest}"


def _entry(k: qemu.Kernel, version: str, inject: int = 0, race: bool = False) -> Path:
    """The cache entry of build(k, version) for the current inputs: our files that go into the modules (the pool,
    the branch patches, the stand-in; the race variant's source and edits too, in its own entries only); a change
    to any of them is a new entry."""
    import hashlib
    h = hashlib.sha256()
    for f in sorted([*(REPO / "uvm_patch/src").iterdir(), *(KDIR / "standin-rm").iterdir(),
                     *(REPO / "uvm_patch/patches").rglob("*.patch")]):
        if f.is_file() and f.suffix != ".pyc":
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(repr(sorted(LOCK_INITS.items())).encode())   # the test build's own change to older trees
    if race:
        h.update(b"race\0" + RACE_SRC.read_bytes() + repr(RACE_EDITS).encode())
    key = cache_key(k, version, h.hexdigest()[:12]) + (f"-inject{inject}" if inject else "") + ("-race" if race else "")
    return cache.cache_dir() / "uvmvm" / key


def is_cached(k: qemu.Kernel, version: str, inject: int = 0, race: bool = False) -> bool:
    return (_entry(k, version, inject, race) / ".ready").exists()


def cached_build(k: qemu.Kernel, version: str, inject: int = 0, race: bool = False) -> Built:
    """build() once per (kernel, version, inputs) under the cache (see _entry)."""
    base = _entry(k, version, inject, race)
    stamp = base / ".ready"
    with cache.locked(f"uvmvm-{base.name}"):
        if not stamp.exists():
            b = build(k, version, base / "b", inject=inject, race=race)
            stamp.write_text(f"{b.seconds:.0f}\n")
    secs = float(stamp.read_text())
    tree = base / "b" / "nv"
    return Built(version, tree, tree / "nvidia.ko", tree / "nvidia-uvm.ko", secs, base / "b" / "build.log")
