"""A Spark-shaped fixture root on which a real ``install --kernel K`` runs to its end in this process, in about a
second: the NVIDIA 580.142 open tree (tests/support/nvsrc.py) where the driver package puts it, our DKMS tree
rendered by act/render.py and registered with the real ``dkms add``, and the real dkms for install and
uninstall on the root's own tree (a wrapper adds ``--dkmstree/--sourcetree/--installtree``).

What stands in for what cannot happen here:

* the compile of nvidia-uvm for the aarch64 kernel (no arm64 headers here): DKMS's built module is put where
  ``dkms build`` leaves it, a real ELF object with our .modinfo and a ``__versions`` entry carrying the CRC that
  the fixture's nvidia.ko exports (so the kotool's symbol check passes, as for a real build);
* DKMS's own depmod (it would run the host's ``depmod -a K``): the wrapper passes ``--no-depmod`` and runs the
  real depmod on the root instead;
* the force-install file DKMS reads from this machine's /usr/share/dkms (the engine writes it into the root):
  the wrapper passes ``--force`` to ``dkms install``, which is what that file does.

The kernel's config says it does not check module signatures (the signing path has its own tests)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.support import sparkroot

K = sparkroot.SPARK_KERNEL
DRIVER = sparkroot.DRIVER
SYMBOL, CRC = "nvUvmInterfaceSessionCreate", 0x1A2B3C4D


def _object(path: Path, fields: list[tuple[str, str]], extra: str) -> Path:
    """sparkroot.make_module with more C: an exported symbol's CRC, or the __versions table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = "".join(f"{k}={v}\\0" for k, v in fields)
    src = path.with_suffix(".c")
    src.write_text('static const char modinfo[] __attribute__((section(".modinfo"), used, aligned(1))) = "'
                   + blob + '";\n' + extra)
    subprocess.run([sparkroot._cc(), "-c", "-o", str(path), str(src)], check=True)
    src.unlink()
    return path


def nvidia_ko(path: Path, version: str) -> Path:
    """A stand-in nvidia.ko of ``version`` exporting the symbol our built module imports (same CRC)."""
    return _object(path, [("version", version), ("license", "Dual MIT/GPL"), ("name", "nvidia"),
                          ("srcversion", "0D6E5F4A3B2C1D0E9F8A7B6"),
                          ("vermagic", f"{K} SMP preempt mod_unload modversions aarch64")],
                   f'asm(".globl __crc_{SYMBOL}\\n.set __crc_{SYMBOL}, {CRC:#x}\\n");\n')


def make(where: Path) -> tuple[Path, Path]:
    """(root, dkms wrapper): a stock node on which ``install --kernel K`` finds our build already made."""
    from spark_memsaver.act import render
    from spark_memsaver.config import Config
    from spark_memsaver.host import Host
    from tests.support import nvsrc

    root = sparkroot.make_spark_root(where / "root")
    (root / f"boot/config-{K}").write_text("CONFIG_ARM64=y\nCONFIG_ARM64_64K_PAGES=y\nCONFIG_MODVERSIONS=y\n"
                                           "# CONFIG_MODULE_SIG is not set\n# CONFIG_ARM64_4K_PAGES is not set\n")
    src = root / f"usr/src/nvidia-{DRIVER}"
    shutil.rmtree(src)
    shutil.copytree(nvsrc.nvidia_source(DRIVER), src, symlinks=True)
    nvidia_ko(root / f"lib/modules/{K}/kernel/nvidia-580-open/nvidia.ko", DRIVER)
    subprocess.run(["depmod", "-b", str(root), K], check=True, capture_output=True)
    ver = render.render(Host(root), Config(), DRIVER, f"/usr/src/nvidia-{DRIVER}")["version"]
    (root / "var/lib/dkms").mkdir(parents=True, exist_ok=True)
    wrapper = where / "dkms"
    wrapper.write_text(
        "#!/bin/sh\n# the real dkms on the root's own tree; its depmod on the root; install as the force file says\n"
        f'dkms "$@" $([ "$1" = install ] && echo --force) -a aarch64 --no-depmod --dkmstree {root}/var/lib/dkms '
        f"--sourcetree {root}/usr/src --installtree {root}/lib/modules || exit $?\n"
        f'case "$1" in install|uninstall) depmod -b {root} {K} 2>/dev/null;; esac\n')
    wrapper.chmod(0o755)
    subprocess.run([str(wrapper), "add", "-m", "spark-memsaver-uvm", "-v", ver], check=True, capture_output=True)
    _object(root / f"var/lib/dkms/spark-memsaver-uvm/{ver}/{K}/aarch64/module/nvidia-uvm.ko",
            sparkroot.uvm_fields(DRIVER, sparkroot.OURS_UVM_SRCVERSION, K, ours=True),
            "struct mv { unsigned long crc; char name[56]; };\nstatic const struct mv v[] "
            f'__attribute__((section("__versions"), used)) = {{{{{CRC:#x}, "{SYMBOL}"}}}};\n')
    return root, wrapper
