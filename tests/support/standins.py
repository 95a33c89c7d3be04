"""Stand-ins for what a fixture root cannot do itself, for following Next for real (tests/test_state_space.py,
check c). Each says what it stands in for; nothing here is a branch in shipped code:

* ``dkms_wrapper``: the real dkms on the root's own tree (``--dkmstree/--sourcetree/--installtree``, arm64, as
  tests/test_dkms_restore_newer.py runs it; its own depmod on the root's tree, ``depmod -b ROOT``), through the engines' own switch for which dkms to run
  (SPARK_MEMSAVER_DKMS). Only ``dkms build`` -- the compile of nvidia-uvm, minutes of a real NVIDIA tree -- is
  stood in for: a prebuilt real ELF module with our .modinfo for that driver and kernel (tests/support/sparkroot.py)
  is put where DKMS's build puts it (<tree>/<package>/<ver>/<kernel>/<arch>/module/), signed as DKMS signs it (the
  kernel's sign-file with framework.conf's mok_signing_key/mok_certificate when the kernel checks signatures), with
  the make.log DKMS keeps. No prebuilt module for that driver and kernel: the build fails as a compile would.
* ``modprobe_reload``: what `modprobe -r nvidia_uvm && modprobe nvidia_uvm` does to /sys/module/nvidia_uvm on the
  node -- the file the guard loads (its rule, systemd/guard/uvm-guard; a Secure Boot kernel refuses ours unless
  its key is enrolled): its version and srcversion, and ours shows its uvm_pt_pack parameters and counters
  (the configured tier; nothing packed yet). The engines skip modprobe under
  --root (it acts on the running kernel only), and report the reload as skipped: the test does it for the node.
* ``mokutil_import``: what `mokutil --import CERT` leaves in the firmware variables (efivarfs, byte-exact: the
  4-byte attributes NV|BS|RT, then an EFI_SIGNATURE_LIST of one X.509 entry owned by shim in MokNew, and the
  password hash in MokAuth): an enrollment request pending until a person confirms it in MokManager at the next
  boot. `mok enroll` refuses --root (it writes the running machine's firmware), so the test does it for the node.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
from pathlib import Path

ARCH = "aarch64"
REPO = Path(__file__).resolve().parent.parent.parent
EFI_SHIM = "605dab50-e046-4300-abb6-3dd810dd8b23"
_G_SHIM = bytes.fromhex("50ab5d6046e00043abb63dd810dd8b23")
_T_X509 = bytes.fromhex("a159c0a5e494a74a87b5ab155c2bf072")
_A_NV = 0x1 | 0x2 | 0x4


def dkms_wrapper(path: Path, root: Path, prebuilt: Path) -> Path:
    """A dkms program for ``root``: the real dkms on the root's tree, whose own depmod (after an install or an
    uninstall) runs on the root (``depmod -b ROOT``: a depmod first on its PATH) and whose force list is the root's;
    ``dkms build`` stood in for."""
    q = shlex.quote
    tree = f"--dkmstree {q(str(root))}/var/lib/dkms --sourcetree {q(str(root))}/usr/src " \
           f"--installtree {q(str(root))}/lib/modules"
    bin_ = path.parent / f"{path.name}.bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "depmod").write_text(f'#!/bin/sh\nexec {q(shutil.which("depmod") or "/usr/sbin/depmod")} -b {q(str(root))} "$@"\n')
    (bin_ / "depmod").chmod(0o755)
    path.write_text("#!/bin/sh\n"
                    'if [ "$1" = build ]; then\n'
                    f'  PYTHONPATH={q(str(REPO))} exec {sys.executable} -m tests.support.standins '
                    f'{q(str(root))} {q(str(prebuilt))} "$@"\n'
                    "fi\n"
                    # DKMS reads its force list at /usr/share/dkms/modules_to_force_install of the machine it runs
                    # on: the node's (what the package ships or the engines write there) decides, as on the node;
                    # an entry for the module ("<m>" or "<m>_version-override") skips the version check: --force
                    f'if [ "$1" = install ] && cat {q(str(root))}/usr/share/dkms/modules_to_force_install/* '
                    '2>/dev/null | grep -qxE -- "$3(_version-override)?"; then set -- "$@" --force; fi\n'
                    f'PATH={q(str(bin_))}:$PATH exec dkms "$@" -a {ARCH} {tree}\n')
    path.chmod(0o755)
    return path


def _framework(root: Path) -> dict:
    """DKMS's framework settings as DKMS reads them: framework.conf, then framework.conf.d/*.conf, last wins."""
    files = [root / "etc/dkms/framework.conf"] + sorted((root / "etc/dkms/framework.conf.d").glob("*.conf"))
    out = {"mok_signing_key": "/var/lib/dkms/mok.key", "mok_certificate": "/var/lib/dkms/mok.pub"}
    for f in files:
        if f.is_file():
            for m in re.finditer(r"^\s*(mok_signing_key|mok_certificate)=(\S+)", f.read_text(), re.M):
                out[m.group(1)] = shlex.split(m.group(2))[0]
    return out


def _in_root(root: Path, p: str) -> Path:
    return root / p.lstrip("/")


def dkms_build(root: Path, prebuilt: Path, argv: list[str]) -> int:
    """``dkms build -m P -v V -k K [-j N]``, the compile stood in for (the module docstring)."""
    from tests.support import sparkroot
    args = dict(zip(argv[1::2], argv[2::2]))
    pkg, ver, kernel = args.get("-m"), args.get("-v"), args.get("-k")
    base = root / "var/lib/dkms" / pkg / ver
    if not (base / "source").exists():
        print(f"Error! The module/version combo: {pkg}-{ver} is not located in the DKMS tree.", file=sys.stderr)
        return 3
    driver = ver.split("-sm", 1)[0]
    src = prebuilt / driver / kernel / "nvidia-uvm.ko"
    log = base / "build" / "make.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if not src.is_file():
        log.write_text(f"# stand-in for the compile: no prebuilt nvidia-uvm for {driver} and {kernel}\nmake: *** "
                       "[Makefile] Error 2\n")
        print(f"Error! Bad return status for module build on kernel: {kernel} ({ARCH})\nConsult {log} for more "
              "information.", file=sys.stderr)
        return 10
    out = base / kernel / ARCH / "module" / "nvidia-uvm.ko"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(src.read_bytes())
    config = root / f"boot/config-{kernel}"
    if config.is_file() and re.search(r"^CONFIG_MODULE_SIG=y", config.read_text(), re.M):
        fw = _framework(root)
        key, crt = _in_root(root, fw["mok_signing_key"]), _in_root(root, fw["mok_certificate"])
        if key.is_file() and crt.is_file():
            sparkroot.sign_module(out, key, crt)
    log.write_text(f"# stand-in for the compile of nvidia-uvm for {kernel}: a prebuilt module\n"
                   f"  LD [M]  {out.parent}/nvidia-uvm.ko\n")
    (base / kernel / ARCH / "log").mkdir(parents=True, exist_ok=True)
    (base / kernel / ARCH / "log" / "make.log").write_bytes(log.read_bytes())
    print(f"Building module:\nCleaning build area...\nmake -j{args.get('-j', '1')} KERNELRELEASE={kernel}...\n"
          f"Signing module {out}\nCleaning build area...")
    return 0


# What nvidia.ko exports to nvidia-uvm (one symbol of its interface stands for all) and its CRC: the symbol
# versions a build with KBUILD_EXTRA_SYMBOLS records in nvidia-uvm's __versions, checked against nvidia.ko.
EXPORTS = {"nvUvmInterfaceRegisterGpu": 0x5A1F00D1}


def make_ko(path: Path, fields: list[tuple[str, str]], exports: dict | None = None,
            versions: dict | None = None) -> Path:
    """A relocatable object as kbuild links a module: .modinfo ``fields``; ``exports`` {symbol: crc} as
    EXPORT_SYMBOL_GPL with CONFIG_MODVERSIONS leaves them (__ksymtab_<sym>, absolute __crc_<sym>);
    ``versions`` {symbol: crc} in __versions (struct modversion_info: an unsigned long, a 56-byte name)."""
    from tests.support import sparkroot
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = "".join(f"{k}={v}\\0" for k, v in fields)
    c = ['static const char modinfo[] __attribute__((section(".modinfo"), used, aligned(1))) = "' + blob + '";']
    for sym, crc in (exports or {}).items():
        c += [f"int {sym}(void) {{ return 0; }}",
              f'__asm__(".globl __crc_{sym}\\n.set __crc_{sym}, 0x{crc:08x}\\n");',
              f"static const unsigned long __ksymtab_{sym} __attribute__((section(\"___ksymtab_gpl+{sym}\"), "
              f"used)) = 0;"]
    if versions:
        c += ["struct modversion_info { unsigned long crc; char name[64 - sizeof(unsigned long)]; };",
              "static const struct modversion_info ____versions[] __attribute__((used, section(\"__versions\"))) "
              "= {" + ", ".join(f'{{0x{crc:08x}, "{sym}"}}' for sym, crc in versions.items()) + "};"]
    src = path.with_suffix(".c")
    src.write_text("\n".join(c) + "\n")
    subprocess.run([sparkroot._cc(), "-c", "-o", str(path), str(src)], check=True)
    src.unlink()
    return path


def exporting_nvidia(root: Path, kernels: tuple[str, ...]) -> None:
    """nvidia.ko of ``root`` for each kernel again, now exporting EXPORTS (same .modinfo), and depmod."""
    from tests.support import sparkroot
    for k in kernels:
        ko = root / f"lib/modules/{k}/kernel/nvidia-580-open/nvidia.ko"
        make_ko(ko, [("version", sparkroot.DRIVER), ("license", "Dual MIT/GPL"), ("name", "nvidia"),
                     ("srcversion", "0D6E5F4A3B2C1D0E9F8A7B6"),
                     ("vermagic", f"{k} SMP preempt mod_unload modversions aarch64")], exports=EXPORTS)
        subprocess.run(["depmod", "-b", str(root), k], check=True, capture_output=True)


def prebuild(where: Path, drivers: tuple[str, ...], kernels: tuple[str, ...]) -> Path:
    """The modules the stand-in build hands out: ours (uvm-pt-pack/1) per driver and kernel, real ELF objects
    with the symbol versions of nvidia.ko's exports (exporting_nvidia) that a build against it records."""
    from tests.support import sparkroot
    for d in drivers:
        for k in kernels:
            make_ko(where / d / k / "nvidia-uvm.ko", sparkroot.uvm_fields(d, sparkroot.OURS_UVM_SRCVERSION, k,
                                                                          ours=True), versions=EXPORTS)
    return where


def _modinfo(root: Path, args: list[str]) -> dict:
    """The real modinfo on ``root`` (``-k K nvidia-uvm``: the file depmod selects; or a file), as a dict."""
    r = subprocess.run(["modinfo", "-b", str(root), *args], capture_output=True, text=True)
    out: dict = {"parm": []}
    for ln in r.stdout.splitlines():
        k, _, v = ln.partition(":")
        if k == "parm":
            out["parm"].append(v.strip().split(":", 1)[0])
        else:
            out.setdefault(k.strip(), v.strip())
    return out if r.returncode == 0 else {}


def _sb_refuses(root: Path) -> bool:
    """The kernel refuses a module signed with a key it does not trust: Secure Boot on (the SecureBoot variable's
    value byte) and DKMS's certificate in no MokListRT* variable (the only keys these nodes can enroll)."""
    efi = root / "sys/firmware/efi/efivars"
    sb = next(iter(efi.glob("SecureBoot-*")), None) if efi.is_dir() else None
    if sb is None or sb.read_bytes()[4:5] != b"\x01":
        return False
    crt = root / "var/lib/dkms/mok.pub"
    der = crt.read_bytes() if crt.is_file() else None
    return not (der and any(der in v.read_bytes() for v in efi.glob("MokListRT*")))


def modprobe_reload(root: Path, kernel: str, tier: str = "leaf") -> dict:
    """`modprobe -r nvidia_uvm; modprobe nvidia_uvm` on the node ``root`` stands for, through the guard's rule
    (systemd/guard/uvm-guard): the file depmod selects for ``kernel`` when it is stock, or ours for the loaded
    nvidia's driver that the kernel accepts (Secure Boot: a trusted key); else the stock file beside nvidia.ko
    for that driver; else nothing. nvidia not loaded: modprobe loads the nvidia.ko depmod selects first. Returns the loaded file's modinfo (empty: nothing loaded)."""
    from tests.support import sparkroot
    sysm = root / "sys/module/nvidia_uvm"
    for p in sorted(sysm.rglob("*"), reverse=True) if sysm.is_dir() else ():
        p.unlink() if p.is_file() or p.is_symlink() else p.rmdir()
    if sysm.is_dir():
        sysm.rmdir()
    if not (root / "sys/module/nvidia").is_dir():    # modprobe loads nvidia first, the one depmod selects for it;
        nv = _modinfo(root, ["-k", kernel, "nvidia"])  # the guard judges ours against that file's driver
        if not nv.get("version"):
            return {}
        sparkroot.write(root, "/sys/module/nvidia/version", nv["version"].split()[0] + "\n")
    nvidia = (root / "sys/module/nvidia/version").read_text().split()[0]
    info = _modinfo(root, ["-k", kernel, "nvidia-uvm"])
    patched = info.get("spark_memsaver") or any(p.startswith("uvm_pt_pack") for p in info.get("parm", []))
    if not info or (patched and (info.get("spark_memsaver") != "uvm-pt-pack/1" or info.get("version") != nvidia
                                 or _sb_refuses(root))):
        info = _modinfo(root, [str(root / f"lib/modules/{kernel}/kernel/nvidia-580-open/nvidia-uvm.ko")])
        if not info or info.get("version") != nvidia or info.get("spark_memsaver"):
            return {}
    sparkroot.write(root, "/sys/module/nvidia_uvm/version", info.get("version", "") + "\n")
    sparkroot.write(root, "/sys/module/nvidia_uvm/srcversion", info.get("srcversion", "") + "\n")
    sparkroot.write(root, "/sys/module/nvidia_uvm/parameters/uvm_page_table_location", "(null)\n")
    if "uvm_pt_pack" in info["parm"]:
        sparkroot.write(root, "/sys/module/nvidia_uvm/parameters/uvm_pt_pack", "3\n")
        sparkroot.write(root, "/sys/module/nvidia_uvm/parameters/uvm_pt_pack_stats",
                        sparkroot.stats_text(tier=tier, packed=0, t256=0, t4k=0))
    return info


def mokutil_import(root: Path, der: bytes) -> None:
    """`mokutil --import` of the DER certificate ``der`` on the node ``root`` stands for (the module docstring)."""
    from tests.support import sparkroot
    entry = _G_SHIM + der
    esl = _T_X509 + struct.pack("<III", 28 + len(entry), 0, len(entry)) + entry
    efi = "/sys/firmware/efi/efivars/%s-" + EFI_SHIM
    sparkroot.write(root, efi % "MokNew", struct.pack("<I", _A_NV) + esl)
    sparkroot.write(root, efi % "MokAuth", struct.pack("<I", _A_NV) + hashlib.sha256(b"password").digest())


if __name__ == "__main__":
    sys.exit(dkms_build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]))
