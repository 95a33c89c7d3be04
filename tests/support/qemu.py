"""arm64 test VMs for the packing pool: kernels, an initramfs, the selftest module, and a qemu runner.

Everything heavy is cached under $SPARK_MEMSAVER_TEST_CACHE (tests/support/cache.py) and produced under a
named lock. Debian packages come through a private apt configuration (own sources.list, lists and archives
under the cache, APT::Architectures amd64+arm64); the system's apt state is never touched.

Kernels (``kernel(kind) -> Kernel``):
  ``debug-64k`` / ``debug-6.12-64k``  Debian's linux-source-7.x / -6.12 built for arm64 with
                  CONFIG_ARM64_64K_PAGES=y, a minimal config plus KASAN, PROVE_LOCKING, DEBUG_PAGEALLOC,
                  DMA_API_DEBUG, KMEMLEAK (tests/support/debugkernel.py). Built only when
                  SPARK_MEMSAVER_BUILD_KERNEL=1, else taken from the cache or reported unavailable.
  ``debian-4k`` / ``debian-16k``  Debian's prebuilt linux-image-arm64 / -arm64-16k (the newest 7.x offered
                  by sid / experimental / trixie-backports); out-of-tree modules are built against the same
                  linux-source prepared with that image's own .config (Debian's headers want gcc-14, which
                  Debian 12 lacks: see docs/kernel-tests.md).
  ``debian-6.12-4k`` / ``debian-6.12-16k``  the same from trixie's 6.12 (NVIDIA's trees include
                  linux/of_gpio.h, which 7.2 and 7.3 dropped: tests/test_kernel_pagetree.py uses these).

``selftest_module(kernel)`` builds tests/kernel/selftest with uvm_patch/src/uvm_pt_pack.[ch] copied in
unchanged; ``initramfs(files)`` packs busybox-static:arm64 + tests/kernel/init.sh; ``boot(...)`` runs
qemu-system-aarch64 (TCG, -machine virt,iommu=smmuv3, -cpu max, serial console) and returns the log.
"""

from __future__ import annotations

import dataclasses
import gzip
import functools
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

try:
    from . import cache
except ImportError:  # pragma: no cover
    import cache  # type: ignore

REPO = Path(__file__).resolve().parents[2]
KDIR = REPO / "tests" / "kernel"
CROSS = "aarch64-linux-gnu-"
SUITES = ("sid", "experimental", "trixie-backports", "trixie")
_READY = ".ready"


class Unavailable(RuntimeError):
    """An input cannot be produced here; the message says why and what to do."""


@dataclasses.dataclass
class Kernel:
    kind: str
    image: Path          # arm64 Image (uncompressed or EFI zboot, both boot with -kernel)
    tree: Path           # a tree to build out-of-tree modules against
    release: str
    page_size: int


def _run(argv, *, cwd=None, env=None, timeout=3600, log=None):
    e = dict(os.environ, LC_ALL="C.UTF-8")
    e.update(env or {})
    p = subprocess.run([str(a) for a in argv], cwd=cwd, env=e, timeout=timeout,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    if log:
        Path(log).write_text(p.stdout)
    if p.returncode:
        raise Unavailable(f"{' '.join(map(str, argv))} failed (rc={p.returncode}):\n" +
                          "\n".join(p.stdout.splitlines()[-20:]))
    return p.stdout


def _apt() -> list[str]:
    base = cache.cache_dir() / "apt" / "kernel-arm64"
    for sub in ("lists/partial", "parts", "prefs", "cache/archives/partial"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    mirror = cache.debian_mirror()
    if mirror is None:
        raise Unavailable("no Debian archive entry in /etc/apt/sources.list(.d)")
    key = "/usr/share/keyrings/debian-archive-keyring.gpg"
    text = "".join(f"deb [signed-by={key}] {mirror} {s} main\n" for s in SUITES)
    sl = base / "sources.list"
    opts = [f"-o=Dir::Etc::SourceList={sl}", f"-o=Dir::Etc::SourceParts={base / 'parts'}",
            f"-o=Dir::Etc::PreferencesParts={base / 'prefs'}", f"-o=Dir::State::Lists={base / 'lists'}",
            f"-o=Dir::Cache={base / 'cache'}", "-o=APT::Architecture=amd64",
            "-o=APT::Architectures::=amd64", "-o=APT::Architectures::=arm64"]
    stamp = base / "updated"
    if not sl.exists() or sl.read_text() != text or not stamp.exists() or time.time() - stamp.stat().st_mtime > 86400:
        sl.write_text(text)
        _run(["apt-get", *opts, "update"], timeout=900)
        stamp.write_text("ok\n")
    return opts


def newest_in_madison(madison: str, major: str) -> str | None:
    """The newest release (no ~rc) starting with ``major`` in `apt-cache madison` output, by dpkg's order."""
    vers = [ln.split("|")[1].strip() for ln in madison.splitlines() if "|" in ln]
    vers = [v for v in vers if v.startswith(major) and "~rc" not in v]
    if not vers:
        return None
    best = vers[0]
    for v in vers[1:]:
        if subprocess.run(["dpkg", "--compare-versions", v, "gt", best]).returncode == 0:
            best = v
    return best


def newest_version(opts: list[str], pkg: str, major: str = "7.") -> str:
    best = newest_in_madison(_run(["apt-cache", *opts, "madison", pkg]), major)
    if best is None:
        raise Unavailable(f"no {major}x release of {pkg} in {SUITES}")
    return best


def pack_initramfs(root: Path, dest: Path) -> Path:
    """``root`` as a gzip'd newc cpio archive at ``dest``."""
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    cp = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root,
                        input=("\n".join(names) + "\n").encode(), stdout=subprocess.PIPE, check=True)
    dest.write_bytes(gzip.compress(cp.stdout, 6))
    return dest


def download(opts: list[str], specs: list[str], dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    _run(["apt-get", *opts, "download", *specs], cwd=dest, timeout=1800)
    found = []
    for spec in specs:
        name = spec.split("=")[0].split(":")[0]
        debs = sorted(dest.glob(f"{name}_*.deb"))
        if not debs:
            raise Unavailable(f"apt-get download {spec} produced no .deb")
        found.append(debs[-1])
    return found


def _abi(opts, version: str, flavour: str) -> str:
    out = _run(["apt-cache", *opts, "show", f"linux-image-{flavour}:arm64={version}"])
    for ln in out.splitlines():
        if ln.startswith("Depends:"):
            for dep in ln.split(":", 1)[1].split(","):
                d = dep.strip().split(" ")[0]
                if d.startswith("linux-image-") and d.endswith(f"-{flavour}"):
                    return d[len("linux-image-"):-len(f"-{flavour}")]
    raise Unavailable(f"cannot tell the ABI of linux-image-{flavour} {version}")


def _linux_source(opts, version: str) -> Path:
    """Path of linux-source-<x.y>.tar.xz (extracted from the .deb into the cache)."""
    src = cache.cache_dir() / "kernel" / f"linux-source-{version}"
    tarballs = sorted(src.glob("usr/src/linux-source-*.tar.xz"))
    if not tarballs:
        mm = ".".join(version.split(".")[:2])
        deb, = download(opts, [f"linux-source-{mm}={version}"], cache.cache_dir() / "debs")
        src.mkdir(parents=True, exist_ok=True)   # a cold cache has no kernel/ yet
        _run(["dpkg-deb", "-x", deb, src])
        tarballs = sorted(src.glob("usr/src/linux-source-*.tar.xz"))
    return tarballs[-1]


def debug_kernel_64k(series: str = "7.", build: bool | None = None) -> Kernel:
    """The 64 KiB debug kernel from linux-source-<series> (tests/support/debugkernel.py; build: see there)."""
    try:
        from . import debugkernel
    except ImportError:  # pragma: no cover
        import debugkernel  # type: ignore
    return debugkernel.debug_kernel(series, build)


@functools.lru_cache(maxsize=None)
def debian_kernel(flavour: str, major: str = "7.") -> Kernel:
    """flavour: 'arm64' (4 KiB pages) or 'arm64-16k'; major: the version prefix to pick the newest of."""
    opts = _apt()
    version = newest_version(opts, f"linux-image-{flavour}", major)
    abi = _abi(opts, version, flavour)
    base = cache.cache_dir() / "kernel" / f"debian-{flavour}-{version}"
    if not (base / _READY).exists():
        with cache.locked(f"kernel-debian-{flavour}"):
            if not (base / _READY).exists():
                shutil.rmtree(base, ignore_errors=True)
                base.mkdir(parents=True)
                # 7.x packs the kernel and its modules as linux-binary-*; 6.x (trixie) as linux-image-*
                binary = "linux-binary" if version.startswith("7.") else "linux-image"
                debs = download(opts, [f"{binary}-{abi}-{flavour}:arm64={version}",
                                       f"linux-headers-{abi}-{flavour}:arm64={version}"], base / "debs")
                for d in debs:
                    _run(["dpkg-deb", "-x", d, base / "x"])
                tarball = _linux_source(opts, version)
                _run(["tar", "-xf", tarball, "-C", base])
                tree = next(base.glob("linux-source-*"))
                hdr = next((base / "x/usr/src").glob(f"linux-headers-*-{flavour}"))
                shutil.copy(hdr / ".config", tree / ".config")
                env = {"ARCH": "arm64", "CROSS_COMPILE": CROSS}
                # gcc-12 cannot take Debian's gcc-14 options; signing/BTF need Debian's keys and pahole
                # (BTF stays on: it changes struct module, which the loader compares)
                _run(["scripts/config", "--disable", "MODULE_SIG_ALL", "--set-str", "MODULE_SIG_KEY", "",
                      "--set-str", "SYSTEM_TRUSTED_KEYS", ""], cwd=tree)
                _run(["make", "olddefconfig"], cwd=tree, env=env)
                _run(["nice", "-n", "10", "make", "-j2", f"KERNELRELEASE={abi}-{flavour}", "modules_prepare"],
                     cwd=tree, env=env, timeout=3600)
                shutil.copy(hdr / "Module.symvers", tree / "Module.symvers")
                (base / _READY).write_text(f"{version}\n")
    tree = next(base.glob("linux-source-*"))
    image = next(p for p in [*(base / "x/boot").glob("vmlinuz-*"), *(base / "x/usr/lib/modules").glob("*/vmlinuz")])
    return Kernel(f"debian-{flavour}", image, tree, f"{abi}-{flavour}", 16384 if flavour.endswith("16k") else 4096)


def kernel(kind: str, build: bool | None = None) -> Kernel:
    """build: the debug kernels only (None: SPARK_MEMSAVER_BUILD_KERNEL=1 decides; tests/support/debugkernel.py)."""
    if kind == "debug-64k":
        return debug_kernel_64k(build=build)
    if kind == "debug-6.12-64k":
        return debug_kernel_64k("6.12.", build)
    if kind == "debian-4k":
        return debian_kernel("arm64")
    if kind == "debian-16k":
        return debian_kernel("arm64-16k")
    if kind in ("debian-6.12-4k", "debian-6.12-16k"):
        # trixie's 6.12: NVIDIA's trees include linux/of_gpio.h, which 7.2 and 7.3 no longer have
        # (docs/kernel-tests.md, "NVIDIA's page-tree tests")
        k = debian_kernel("arm64" if kind.endswith("-4k") else "arm64-16k", "6.12.")
        return dataclasses.replace(k, kind=kind)
    raise ValueError(kind)


def selftest_module(k: Kernel, dest: Path, defines: tuple[str, ...] = ()) -> Path:
    """Build tests/kernel/selftest (+ the pool, unchanged) against k.tree into dest; returns the .ko.
    defines: test-only macros for the pool's object (UVM_PT_PACK_TEST_FAKE_GPU: cumulative test_total_*
    counters; UVM_PT_PACK_FAULT_INJECT=n: a deliberately broken pool, to show that a run fails)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in (KDIR / "selftest").iterdir():
        shutil.copy(f, dest / f.name)
    if defines:
        with open(dest / "Kbuild", "a") as fh:
            fh.write("CFLAGS_uvm_pt_pack.o +=" + "".join(f" -D{d}" for d in defines) + "\n")
    for f in ("uvm_pt_pack.c", "uvm_pt_pack.h"):
        shutil.copy(REPO / "uvm_patch" / "src" / f, dest / f)
    extra = [f"KERNELRELEASE={k.release}"] if k.kind.startswith("debian") else []
    out = _run(["make", "-C", k.tree, f"M={dest}", "ARCH=arm64", f"CROSS_COMPILE={CROSS}", "W=1", *extra,
                "modules"], timeout=900)
    warnings = [ln for ln in out.splitlines() if "warning:" in ln]
    if warnings:
        raise AssertionError("selftest module build warnings:\n" + "\n".join(warnings))
    return dest / "pt_pack_selftest.ko"


def busybox() -> Path:
    d = cache.cache_dir() / "kernel" / "busybox-arm64"
    bb = d / "x/usr/bin/busybox"
    if not bb.exists():
        with cache.locked("busybox-arm64"):
            if not bb.exists():
                deb, = download(_apt(), ["busybox-static:arm64"], d / "debs")
                _run(["dpkg-deb", "-x", deb, d / "x"])
    return bb


def initramfs(files: dict[str, Path], dest: Path, init: Path = KDIR / "init.sh") -> Path:
    """A gzip'd newc cpio: /bin/busybox, /init, and files (name in / -> source path)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for d in ("bin", "proc", "sys", "dev", "tmp"):
            (root / d).mkdir()
        shutil.copy(busybox(), root / "bin/busybox")
        (root / "bin/sh").symlink_to("busybox")
        shutil.copy(init, root / "init")
        os.chmod(root / "init", 0o755)
        for name, src in files.items():
            shutil.copy(src, root / name)
        pack_initramfs(root, dest)
    return dest


#: RCU's stall report (21 s by default) under TCG: NVIDIA's CPU-bound built-in tests (range_tree_random,
#: shrink_test) run 50-100x slower emulated with KASAN than on hardware, and 4 vCPUs share this host's 2 cores;
#: a vCPU that is simply not scheduled for 21 s was reported as a stall, with a "Call trace:" that failed the run
#: (r555/r595 at 64 KiB, tier 0 with the pool off, inside NVIDIA's range_tree test). 300 s is RCU's largest
#: value: a real stall -- a loop that never yields -- is still reported, and the run's timeout still ends it.
RCU_STALL_UNDER_TCG = "rcupdate.rcu_cpu_stall_timeout=300"


def boot(k: Kernel, initrd: Path, *, append: str = "", timeout: int = 900, smp: int = 4,
         mem: str = "2G") -> str:
    """Boot k with initrd under TCG; return the serial console log. On timeout the VM is killed and the log so far
    is returned with a last line ``VM-TIMEOUT after N s`` (the callers' ``VM-DONE`` check then fails on it and
    shows how far the run got)."""
    if shutil.which("qemu-system-aarch64") is None:
        raise Unavailable("qemu-system-aarch64 missing (apt-get install qemu-system-arm)")
    argv = ["qemu-system-aarch64", "-machine", "virt,iommu=smmuv3,gic-version=3", "-cpu", "max",
            "-smp", str(smp), "-m", mem, "-nographic", "-no-reboot", "-nic", "none", "-kernel", str(k.image),
            "-initrd", str(initrd), "-device", "pci-testdev",
            "-append", f"console=ttyAMA0 panic=-1 oops=panic {RCU_STALL_UNDER_TCG} {append}".strip()]
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        return (e.stdout or b"").decode(errors="replace") + f"\nVM-TIMEOUT after {timeout} s\n"
    return p.stdout.decode(errors="replace")


#: console lines that fail a run (sanitizers, lockdep, DMA-API debug reports, kmemleak, WARN/BUG)
BAD_PATTERNS = tuple(re.compile(p) for p in (
    r"\bBUG: ", r"\bWARNING: ", r"cut here", r"Call trace:", r"\bOops\b", r"Kernel panic",
    r"DMA-API: \S+ [0-9a-f]{4}:", r"unreferenced object 0x", r"inconsistent lock state",
    r"possible (circular|recursive) locking", r"list_(add|del) corruption", r"INFO: task .* blocked",
    r"general protection fault", r"Unable to handle kernel",
))


def bad_lines(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if any(p.search(ln) for p in BAD_PATTERNS)]


# ------------------------------------------------------------------------------------------------
# The load-time guard in a real boot: Debian's kmod:arm64 (with its libraries), the committed modprobe
# rule and uvm-guard, and stand-in nvidia / nvidia-uvm modules (tests/kernel/standin).

# dash: the guard is a #!/bin/sh script and real systems run it under dash; busybox's ash would run its
# own modinfo/modprobe applets instead of kmod's (FEATURE_PREFER_APPLETS), whatever PATH says.
KMOD_DEBS = ("dash:arm64", "kmod:arm64", "libkmod2:arm64", "libc6:arm64", "libssl3t64:arm64", "zlib1g:arm64", "libzstd1:arm64")


def kmod_root() -> Path:
    d = cache.cache_dir() / "kernel" / "kmod-arm64"
    if not (d / _READY).exists():
        with cache.locked("kmod-arm64"):
            if not (d / _READY).exists():
                shutil.rmtree(d, ignore_errors=True)
                for deb in download(_apt(), list(KMOD_DEBS), d / "debs"):
                    _run(["dpkg-deb", "-x", deb, d / "x"])
                (d / _READY).write_text("ok\n")
    return d / "x"


def standin_module(k: Kernel, dest: Path, name: str, version: str, variant: str, ours: bool) -> Path:
    """A stand-in nvidia.ko / nvidia-uvm.ko (module name, .modinfo version, tag) built against k."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(KDIR / "standin" / "standin.c", dest / "standin.c")
    flags = f"-DSTANDIN_VERSION='\"{version}\"' -DSTANDIN_VARIANT='\"{variant}\"'" + (" -DSTANDIN_OURS" if ours else "")
    (dest / "Kbuild").write_text(f"obj-m := {name}.o\n{name}-y := standin.o\nccflags-y := {flags}\n")
    extra = [f"KERNELRELEASE={k.release}"] if k.kind.startswith("debian") else []
    _run(["make", "-C", k.tree, f"M={dest}", "ARCH=arm64", f"CROSS_COMPILE={CROSS}", *extra, "modules"])
    return dest / f"{name}.ko"


def guard_initramfs(k: Kernel, work: Path, dest: Path) -> Path:
    """Initramfs for tests/kernel/guard-init.sh: cases 'match' (nvidia 580.142 = ours) and 'mismatch'."""
    mods = {
        "ours": standin_module(k, work / "ours", "nvidia-uvm", "580.142", "ours", True),
        "match/nvidia.ko": standin_module(k, work / "nv1", "nvidia", "580.142", "nvidia", False),
        "match/nvidia-uvm.ko": standin_module(k, work / "st1", "nvidia-uvm", "580.142", "stock-580.142", False),
        "mismatch/nvidia.ko": standin_module(k, work / "nv2", "nvidia", "580.95.05", "nvidia", False),
        "mismatch/nvidia-uvm.ko": standin_module(k, work / "st2", "nvidia-uvm", "580.95.05", "stock-580.95.05",
                                                 False),
    }
    km = kmod_root()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for d in ("bin", "proc", "sys", "dev", "tmp", "run", "usr/sbin", "usr/bin", "usr/lib/aarch64-linux-gnu",
                  "usr/lib/modprobe.d", "usr/lib/spark-memsaver", "etc", "var/lib"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "lib").symlink_to("usr/lib")
        shutil.copy(busybox(), root / "bin/busybox")
        shutil.copy(km / "usr/bin/dash", root / "bin/dash")
        (root / "bin/sh").symlink_to("dash")
        shutil.copy(km / "usr/bin/kmod", root / "usr/bin/kmod")
        for tool in ("modprobe", "modinfo", "insmod", "rmmod", "depmod", "lsmod"):
            (root / "usr/sbin" / tool).symlink_to("../bin/kmod")
        libs = km / "usr/lib/aarch64-linux-gnu"
        for lib in ("ld-linux-aarch64.so.1", "libc.so.6", "libkmod.so.2", "libssl.so.3", "libcrypto.so.3",
                    "libz.so.1", "libzstd.so.1"):
            shutil.copy(libs / lib, root / "usr/lib/aarch64-linux-gnu" / lib, follow_symlinks=True)
        (root / "usr/lib/ld-linux-aarch64.so.1").symlink_to("aarch64-linux-gnu/ld-linux-aarch64.so.1")
        # the committed files, unchanged
        shutil.copy(REPO / "systemd/modprobe.d/spark-memsaver.conf", root / "usr/lib/modprobe.d/spark-memsaver.conf")
        shutil.copy(REPO / "systemd/guard/uvm-guard", root / "usr/lib/spark-memsaver/uvm-guard")
        os.chmod(root / "usr/lib/spark-memsaver/uvm-guard", 0o755)
        kdir = root / "usr/lib/modules" / k.release
        (kdir / "updates/dkms").mkdir(parents=True)
        (kdir / "kernel/drivers/video").mkdir(parents=True)
        shutil.copy(mods["ours"], kdir / "updates/dkms/nvidia-uvm.ko")
        # this VM has no modules of its own: empty lists, so depmod has nothing to warn about
        for f in ("modules.order", "modules.builtin", "modules.builtin.modinfo"):
            (kdir / f).write_text("")
        for case in ("match", "mismatch"):
            (root / "cases" / case).mkdir(parents=True)
            for f in ("nvidia.ko", "nvidia-uvm.ko"):
                shutil.copy(mods[f"{case}/{f}"], root / "cases" / case / f)
        shutil.copy(KDIR / "guard-init.sh", root / "init")
        os.chmod(root / "init", 0o755)
        pack_initramfs(root, dest)
    return dest
