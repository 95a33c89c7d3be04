"""A root directory laid out as a DGX Spark would be, for ``spark-memsaver --root``.

What is real here: every file is in the kernel's real format (procfs, sysfs, /boot/config, efivarfs), the
module files are real ELF relocatable objects for aarch64 carrying a real ``.modinfo`` section compiled by gcc,
signed by the kernel's own ``sign-file`` when asked, and ``modules.dep`` is produced by the real ``depmod``.
What it stands in for: a GB10 node whose NVIDIA 580.142 driver is loaded (no such hardware here), and the
NVIDIA-built .ko files (only their metadata matters to the code under test, not their code).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

SPARK_KERNEL = "6.14.0-1015-nvidia-64k"
DRIVER = "580.142"
STOCK_UVM_SRCVERSION = "5F1C0B9E2D4A7C3E8B6A0D1"
OURS_UVM_SRCVERSION = "A94E27C61B0F3D58E2C7B40"
EFI_GLOBAL = "8be4df61-93ca-11d2-aa0d-00e098032b8c"

# free blocks by order on a 64 KiB kernel (order 5 = 2 MiB, 9 = 32 MiB, 13 = 512 MiB), in buddyinfo's format
BUDDYINFO = ("Node 0, zone      DMA    604    410    220    140     90     60     40     21      9      2      1 "
             "     0      0      0 \n"
             "Node 0, zone   Normal  41877   8000   4000   1500    600    180     40      8      2      0      0 "
             "     0      0      0 \n")
MEMINFO = """MemTotal:       128452160 kB
MemFree:        101234560 kB
MemAvailable:   119876544 kB
Buffers:          412800 kB
Cached:         17654272 kB
SwapCached:            0 kB
Active:          6123456 kB
Inactive:       15432192 kB
SwapTotal:      16777152 kB
SwapFree:       16777152 kB
Dirty:              1024 kB
AnonPages:       3489536 kB
Mapped:          1123456 kB
Shmem:            234560 kB
KReclaimable:     987648 kB
Slab:            1876544 kB
SReclaimable:     987648 kB
SUnreclaim:       888896 kB
KernelStack:       45056 kB
PageTables:        98304 kB
CommitLimit:     80803232 kB
Committed_AS:    9876544 kB
VmallocTotal:   133141626880 kB
VmallocUsed:      345600 kB
HugePages_Total:       0
Hugepagesize:     524288 kB
"""


HOSTNAME = "spark-01"
MACHINE_ID = "5f1e0c2a9b8d4e7f8a6b5c4d3e2f1a0b"


def _cc() -> str:
    return shutil.which("aarch64-linux-gnu-gcc") or "gcc"


def make_module(path: Path, fields: list[tuple[str, str]]) -> Path:
    """Compile a relocatable object whose .modinfo section holds ``fields`` (key=value strings)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = "".join(f"{k}={v}\\0" for k, v in fields)
    src = path.with_suffix(".c")
    src.write_text('static const char modinfo[] __attribute__((section(".modinfo"), used, aligned(1))) = "'
                   + blob + '";\n')
    subprocess.run([_cc(), "-c", "-o", str(path), str(src)], check=True)
    src.unlink()
    return path


def sign_module(ko: Path, key: Path, cert: Path) -> None:
    sign_file = sorted(glob.glob("/usr/src/linux-headers-*/scripts/sign-file")) or \
        sorted(glob.glob("/usr/lib/linux-kbuild-*/scripts/sign-file"))
    if not sign_file:
        from tests.support.needs import Missing
        raise Missing("the kernel's scripts/sign-file", "apt install linux-headers-amd64")
    subprocess.run([sign_file[0], "sha256", str(key), str(cert), str(ko)], check=True)


def make_signing_key(d: Path, cn: str) -> tuple[Path, Path]:
    d.mkdir(parents=True, exist_ok=True)
    key, crt = d / "signing.key", d / "signing.der"
    subprocess.run(["openssl", "req", "-new", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
                    "-subj", f"/CN={cn}", "-outform", "DER", "-keyout", str(key), "-out", str(crt)],
                   check=True, capture_output=True)
    os.chmod(key, 0o600)
    return key, crt


def uvm_fields(version: str, srcversion: str, kernel: str, ours: bool) -> list[tuple[str, str]]:
    f = [("version", version), ("license", "Dual MIT/GPL"), ("srcversion", srcversion), ("depends", "nvidia"),
         ("name", "nvidia_uvm"), ("vermagic", f"{kernel} SMP preempt mod_unload modversions aarch64"),
         ("parm", "uvm_page_table_location:Set the location for UVM-allocated page tables. "
                  "Choices are: vid, sys. (charp)"),
         ("parmtype", "uvm_page_table_location:charp")]
    if ours:
        f += [("spark_memsaver", "uvm-pt-pack/1"),
              ("parm", "uvm_pt_pack:Pack GPU page tables: 0 off, 1 4 KiB slots, 2 256 B slots (int)"),
              ("parmtype", "uvm_pt_pack:int"),
              ("parm", "uvm_pt_pack_stats:Page-table packing counters, format 1 (read-only)"),
              ("parmtype", "uvm_pt_pack_stats:string")]
    return f


def write(root: Path, rel: str, data: str | bytes, mode: int | None = None) -> Path:
    p = root / rel.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        p.write_bytes(data)
    else:
        p.write_text(data)
    if mode is not None:
        os.chmod(p, mode)
    return p


def stats_text(tier="4k", packed=1, unpacked=0, t256=52989, t4k=259, page=65536, slot256=4096) -> str:
    """Counters in format 1 (uvm_patch/README.md) for a given table population, densely packed."""
    def cls(n, size, slot):
        per_page = page // max(slot, size)
        pages = -(-n // per_page) if n else 0
        return n, pages, pages * page, n * page, n * page - pages * page
    c256 = cls(t256, 256, slot256)
    c4k = cls(t4k, 4096, 4096)
    lines = ["format 1", f"tier {tier}", f"page_size {page}", f"trees_packed {packed}",
             f"trees_unpacked {unpacked}",
             # as the module prints it: "disabled" whenever the tier is off (uvm_pt_pack=0)
             f"unpacked_reason {'disabled' if tier == 'off' else 'none' if not unpacked else 'has-vidmem'}"]
    for name, c in (("c256", c256), ("c4096", c4k)):
        for k, v in zip(("tables", "pages", "backing_bytes", "stock_bytes", "saved_bytes"), c):
            lines.append(f"{name}_{k} {v}")
    lines += [f"backing_bytes {c256[2] + c4k[2]}", f"stock_bytes {c256[3] + c4k[3]}",
              f"saved_bytes {c256[4] + c4k[4]}"]
    return "\n".join(lines) + "\n"


def make_spark_root(root: Path, *, loaded_driver: str | None = DRIVER, uvm_loaded: str | None = "stock",
                    ours_installed: str | None = None, secure_boot: bool | None = False,
                    holders: int = 0, headers: bool = True, stats: str | None = None,
                    extra_kernels: tuple[str, ...] = (), dkms: bool = True,
                    signing: tuple[Path, Path] | None | bool = None) -> Path:
    """Lay out a Spark root. ``uvm_loaded``: None, "stock" or "ours"; ``ours_installed``: None or the driver
    version our override was built for (it is installed under updates/dkms and selected by depmod), signed with
    ``signing`` (key, certificate: the pair the node's DKMS signs with), left unsigned with ``signing=False`` (a
    certificate whose key the test does not have), or else signed with a key pair of its own."""
    k = SPARK_KERNEL
    if dkms:   # the package depends on dkms; builds under --root run this machine's dkms, so this marks it only
        write(root, "/usr/sbin/dkms", "#!/bin/sh\n# dkms is installed on this node (fixture marker)\nexit 1\n", 0o755)
    write(root, "/proc/sys/kernel/osrelease", k + "\n")
    write(root, "/proc/sys/kernel/arch", "aarch64\n")
    write(root, "/proc/meminfo", MEMINFO)
    write(root, "/proc/buddyinfo", BUDDYINFO)
    write(root, "/etc/hostname", HOSTNAME + "\n")
    write(root, "/etc/machine-id", MACHINE_ID + "\n")
    write(root, "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "536870912\n")
    for rel in (k,) + tuple(extra_kernels):
        write(root, f"/boot/config-{rel}", "CONFIG_ARM64=y\nCONFIG_ARM64_64K_PAGES=y\nCONFIG_MODVERSIONS=y\n"
              "CONFIG_MODULE_SIG=y\n# CONFIG_ARM64_4K_PAGES is not set\n")
        if headers:
            write(root, f"/usr/src/linux-headers-{rel}/Makefile", "# kernel headers Makefile\n")
            link = root / f"lib/modules/{rel}/build"
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                os.symlink(f"/usr/src/linux-headers-{rel}", link)
        mod = root / f"lib/modules/{rel}/kernel/nvidia-580-open"
        make_module(mod / "nvidia.ko", [("version", DRIVER), ("license", "Dual MIT/GPL"), ("name", "nvidia"),
                                        ("srcversion", "0D6E5F4A3B2C1D0E9F8A7B6"),
                                        ("vermagic", f"{rel} SMP preempt mod_unload modversions aarch64")])
        make_module(mod / "nvidia-uvm.ko", uvm_fields(DRIVER, STOCK_UVM_SRCVERSION, rel, ours=False))
        if ours_installed:
            ko = make_module(root / f"lib/modules/{rel}/updates/dkms/nvidia-uvm.ko",
                             uvm_fields(ours_installed, OURS_UVM_SRCVERSION, rel, ours=True))
            if signing is not False:
                key, crt = signing or make_signing_key(root.parent / f"{root.name}-keys",
                                                       "spark-memsaver fixture signing key")
                sign_module(ko, key, crt)
        subprocess.run(["depmod", "-b", str(root), rel], check=True, capture_output=True)
    # NVIDIA's open kernel source, as nvidia-kernel-source-580-open installs it: the files the build's completeness
    # rule looks at (world/tree.tree_problem), with placeholder text of ours (statespace.real_source copies the
    # real files where a build's preflight must pass)
    src = f"/usr/src/nvidia-{DRIVER}"
    write(root, f"{src}/Kbuild", f'# NVIDIA Kbuild (fixture)\nccflags-y += -DNV_VERSION_STRING=\\"{DRIVER}\\"\n')
    write(root, f"{src}/nvidia/nvidia.Kbuild", "# fixture\nNV_CONFTEST_FUNCTION_COMPILE_TESTS += fixture\n")
    for rel in ("Makefile", "conftest.sh", "nvidia-uvm/nvidia-uvm.Kbuild", "nvidia-uvm/nvidia-uvm-sources.Kbuild",
                "nvidia-uvm/uvm.c", "nvidia-uvm/uvm_mmu.c", "nvidia-uvm/uvm_mmu.h"):
        write(root, f"{src}/{rel}", "/* fixture */\n")
    (root / src.lstrip("/") / "common/inc").mkdir(parents=True, exist_ok=True)
    if loaded_driver:
        write(root, "/sys/module/nvidia/version", loaded_driver + "\n")
        write(root, "/sys/module/nvidia/srcversion", "0D6E5F4A3B2C1D0E9F8A7B6\n")
    if uvm_loaded:
        ours = uvm_loaded == "ours"
        write(root, "/sys/module/nvidia_uvm/version", (ours_installed or DRIVER) + "\n")
        write(root, "/sys/module/nvidia_uvm/srcversion",
              (OURS_UVM_SRCVERSION if ours else STOCK_UVM_SRCVERSION) + "\n")
        write(root, "/sys/module/nvidia_uvm/parameters/uvm_page_table_location", "(null)\n")
        write(root, "/sys/module/nvidia_uvm/parameters/uvm_disable_hmm", "N\n")
        if ours:
            write(root, "/sys/module/nvidia_uvm/parameters/uvm_pt_pack", "1\n")
            write(root, "/sys/module/nvidia_uvm/parameters/uvm_pt_pack_stats", stats or stats_text())
    # EFI: a byte-exact SecureBoot variable (4 attribute bytes NV|BS|RT = 0x06, then the value).
    if secure_boot is not None:
        write(root, f"/sys/firmware/efi/efivars/SecureBoot-{EFI_GLOBAL}",
              b"\x06\x00\x00\x00" + (b"\x01" if secure_boot else b"\x00"))
        write(root, f"/sys/firmware/efi/efivars/SetupMode-{EFI_GLOBAL}", b"\x06\x00\x00\x00\x00")
    for i in range(holders):
        pid = 4242 + i
        write(root, f"/proc/{pid}/comm", ("vllm-worker" if i == 0 else "python3") + "\n")
        fd = root / f"proc/{pid}/fd"
        fd.mkdir(parents=True, exist_ok=True)
        os.symlink("/dev/nvidia-uvm", fd / "7")
        os.symlink("/dev/nvidiactl", fd / "6")
    return root
