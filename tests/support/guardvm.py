"""The guard when the kernel refuses our module, in a real boot with module.sig_enforce=1 (issue 23).

Debian's signed arm64 kernel (qemu.kernel("debian-4k")) boots under Debian's AAVMF (qemu-efi-aarch64, the
no-secboot build) whose variable store holds a ``db`` with one certificate of ours, the "platform" key: the
kernel loads db into its ``.platform`` keyring and Debian's kernel verifies modules against ``.platform``
when the system keyrings lack the key (kernel/module/signing.c, Debian's patch) -- the path Ubuntu's kernels
take for a MOK. The variable store is written offline by virt-fw-vars (python3-virt-firmware).

Stand-in modules (tests/kernel/standin, built for the VM's kernel; module name, version, tag only):
nvidia.ko and the stock nvidia-uvm.ko signed with the platform key; ours in three variants: signed with the
platform key (loads), signed with a key nothing trusts (EKEYREJECTED), and signed with the platform key but
referencing a symbol the kernel does not export (an ABI mismatch: "Unknown symbol in module").
tests/kernel/guard-refused-init.sh runs each case through `modprobe nvidia_uvm` (-> install rule -> the
committed uvm-guard) and reports the module loaded, the guard's exit status, the log lines, and /proc/keys.

The keys are generated in the test's temporary directory and never leave it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import cache, qemu

KDIR = qemu.KDIR
EFI_DEBS = ("qemu-efi-aarch64", "python3-virt-firmware", "python3-pefile", "keyutils:arm64", "libkeyutils1:arm64")
OWNER = "605dab50-e046-4300-abb6-3dd810dd8b23"
CASES = ("trusted", "untrusted", "abi")


def efi_root() -> Path:
    """Debian's AAVMF, virt-fw-vars and keyctl:arm64, unpacked (not installed) into the cache."""
    d = cache.cache_dir() / "kernel" / "efi-arm64"
    if not (d / ".ready-guardvm").exists():
        with cache.locked("efi-arm64"):
            if not (d / ".ready-guardvm").exists():
                for deb in qemu.download(qemu._apt(), list(EFI_DEBS), d / "debs"):
                    qemu._run(["dpkg-deb", "-x", deb, d / "x"])
                (d / ".ready-guardvm").write_text("ok\n")
    return d / "x"


def make_key(d: Path, name: str, cn: str) -> tuple[Path, Path]:
    key, crt = d / f"{name}.key", d / f"{name}.pem"
    qemu._run(["openssl", "req", "-new", "-x509", "-nodes", "-days", "3650", "-subj", f"/CN={cn}", "-newkey",
               "rsa:2048", "-keyout", key, "-out", crt, "-addext", "keyUsage=digitalSignature",
               "-addext", "extendedKeyUsage=codeSigning"])
    os.chmod(key, 0o600)
    return key, crt


def vars_with_db(efi: Path, cert: Path, dest: Path) -> Path:
    """AAVMF_VARS.fd with ``cert`` as db's only entry (setup mode, no PK: Secure Boot off)."""
    shim = dest.parent / "pyshim"
    shim.mkdir(exist_ok=True)
    (shim / "importlib_resources.py").write_text("from importlib.resources import *  # noqa\n")  # 3.11's
    env = {"PYTHONPATH": f"{efi / 'usr/lib/python3/dist-packages'}:{shim}"}
    qemu._run(["/usr/bin/python3", "-m", "virt.firmware.vars", "-i", efi / "usr/share/AAVMF/AAVMF_VARS.fd",
               "-o", dest, "--add-db", OWNER, cert], env=env)
    return dest


def signed_standin(k, work: Path, name: str, version: str, variant: str, ours: bool, key: Path, crt: Path,
                   unknown_symbol: bool = False) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    if unknown_symbol:
        shutil.copy(KDIR / "standin" / "standin.c", work / "standin.c")
        (work / "abi.c").write_text(
            "// a reference to a symbol the kernel does not export: the loader fails with -ENOENT\n"
            "extern int spark_memsaver_test_absent_symbol(void);\n"
            "int standin_abi_probe(void);\nint standin_abi_probe(void) { return spark_memsaver_test_absent_symbol(); }\n")
        flags = f"-DSTANDIN_VERSION='\"{version}\"' -DSTANDIN_VARIANT='\"{variant}\"'" + (" -DSTANDIN_OURS" if ours else "")
        (work / "Kbuild").write_text(f"obj-m := {name}.o\n{name}-y := standin.o abi.o\nccflags-y := {flags}\n")
        qemu._run(["make", "-C", k.tree, f"M={work}", "ARCH=arm64", f"CROSS_COMPILE={qemu.CROSS}",
                   f"KERNELRELEASE={k.release}", "KBUILD_MODPOST_WARN=1", "modules"])
        ko = work / f"{name}.ko"
    else:
        ko = qemu.standin_module(k, work, name, version, variant, ours)
    qemu._run([k.tree / "scripts/sign-file", "sha256", key, crt, ko])
    return ko


def initramfs(k, work: Path, dest: Path) -> tuple[Path, dict]:
    """The VM's initramfs and the certificates (PEM paths) of the two keys."""
    keys = work / "keys"
    keys.mkdir(parents=True, exist_ok=True)
    os.chmod(keys, 0o700)
    pk, pc = make_key(keys, "platform", "spark-memsaver test platform key")
    uk, uc = make_key(keys, "untrusted", "spark-memsaver test fleet key")
    mods = {
        "nvidia.ko": signed_standin(k, work / "nv", "nvidia", "580.142", "nvidia", False, pk, pc),
        "stock": signed_standin(k, work / "stock", "nvidia-uvm", "580.142", "stock-580.142", False, pk, pc),
        "trusted": signed_standin(k, work / "ours-t", "nvidia-uvm", "580.142", "ours", True, pk, pc),
        "untrusted": signed_standin(k, work / "ours-u", "nvidia-uvm", "580.142", "ours", True, uk, uc),
        "abi": signed_standin(k, work / "ours-a", "nvidia-uvm", "580.142", "ours", True, pk, pc, unknown_symbol=True),
    }
    km, efi = qemu.kmod_root(), efi_root()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for d in ("bin", "proc", "sys", "dev", "tmp", "run", "usr/sbin", "usr/bin", "usr/lib/aarch64-linux-gnu",
                  "usr/lib/modprobe.d", "usr/lib/spark-memsaver", "etc", "var/lib", "cases"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "lib").symlink_to("usr/lib")
        shutil.copy(qemu.busybox(), root / "bin/busybox")
        shutil.copy(km / "usr/bin/dash", root / "bin/dash")
        (root / "bin/sh").symlink_to("dash")
        shutil.copy(km / "usr/bin/kmod", root / "usr/bin/kmod")
        for tool in ("modprobe", "modinfo", "insmod", "rmmod", "depmod", "lsmod"):
            (root / "usr/sbin" / tool).symlink_to("../bin/kmod")
        shutil.copy(efi / "usr/bin/keyctl", root / "usr/bin/keyctl")
        libs = km / "usr/lib/aarch64-linux-gnu"
        for lib in ("ld-linux-aarch64.so.1", "libc.so.6", "libkmod.so.2", "libssl.so.3", "libcrypto.so.3",
                    "libz.so.1", "libzstd.so.1"):
            shutil.copy(libs / lib, root / "usr/lib/aarch64-linux-gnu" / lib, follow_symlinks=True)
        shutil.copy(efi / "usr/lib/aarch64-linux-gnu/libkeyutils.so.1", root / "usr/lib/aarch64-linux-gnu",
                    follow_symlinks=True)
        (root / "usr/lib/ld-linux-aarch64.so.1").symlink_to("aarch64-linux-gnu/ld-linux-aarch64.so.1")
        shutil.copy(qemu.REPO / "systemd/modprobe.d/spark-memsaver.conf",
                    root / "usr/lib/modprobe.d/spark-memsaver.conf")
        shutil.copy(qemu.REPO / "systemd/guard/uvm-guard", root / "usr/lib/spark-memsaver/uvm-guard")
        os.chmod(root / "usr/lib/spark-memsaver/uvm-guard", 0o755)
        kdir = root / "usr/lib/modules" / k.release
        (kdir / "updates/dkms").mkdir(parents=True)
        (kdir / "kernel/drivers/video").mkdir(parents=True)
        for f in ("modules.order", "modules.builtin", "modules.builtin.modinfo"):
            (kdir / f).write_text("")
        shutil.copy(mods["nvidia.ko"], kdir / "kernel/drivers/video/nvidia.ko")
        shutil.copy(mods["stock"], kdir / "kernel/drivers/video/nvidia-uvm.ko")
        for case in CASES:
            shutil.copy(mods[case], root / "cases" / f"{case}.ko")
        for name, crt in (("platform", pc), ("untrusted", uc)):
            subprocess.run(["openssl", "x509", "-in", crt, "-outform", "DER", "-out", root / "cases" / f"{name}.der"],
                           check=True)
        shutil.copy(KDIR / "guard-refused-init.sh", root / "init")
        os.chmod(root / "init", 0o755)
        qemu.pack_initramfs(root, dest)
    return dest, {"platform": pc, "untrusted": uc}


def boot(k, initrd: Path, vars_fd: Path, *, timeout: int = 900) -> str:
    """Boot k through AAVMF (db from vars_fd) with module.sig_enforce=1; the serial console log."""
    efi = efi_root()
    code = vars_fd.parent / "code.fd"
    shutil.copy(efi / "usr/share/AAVMF/AAVMF_CODE.no-secboot.fd", code)
    argv = ["qemu-system-aarch64", "-machine", "virt,gic-version=3", "-cpu", "max", "-smp", "2", "-m", "2G",
            "-nographic", "-no-reboot", "-nic", "none",
            "-drive", f"if=pflash,format=raw,readonly=on,file={code}",
            "-drive", f"if=pflash,format=raw,file={vars_fd}",
            "-kernel", str(k.image), "-initrd", str(initrd),
            "-append", "console=ttyAMA0 panic=-1 module.sig_enforce=1"]
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    return p.stdout.decode(errors="replace")
