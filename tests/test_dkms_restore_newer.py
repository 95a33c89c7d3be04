"""DKMS >= 3.1.7 (Debian 13's real 3.2.2 here) puts its archived original back with ``mv -f`` on uninstall, over
a newer stock nvidia-uvm that a driver package installed since (plain ``dpkg -i``, no APT door): the old
driver's nvidia-uvm beside the new nvidia.ko. Our uninstall keeps the newer file (tests/FAULTS.md d4).

The real dkms 3.2.2 runs on a private tree (a wrapper adds ``--dkmstree/--sourcetree/--installtree`` of a
fixture root); the installed state is laid out as DKMS 3.2.2 writes it (kernel-<K>-<arch> link, module/,
original_module/ with the ``.origin`` record) and the module files are real ELF objects with a .modinfo.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spark_memsaver.config import Config
from spark_memsaver.host import Host
from tests.support import needs, sparkroot

pytestmark = pytest.mark.dkms

K = "6.1.0-99-smtest"
ARCH = "x86_64"


def _uvm(path: Path, version: str) -> Path:
    return sparkroot.make_module(path, [("version", version), ("name", "nvidia_uvm"), ("depends", "nvidia"),
                                        ("vermagic", f"{K} SMP preempt mod_unload modversions ")])


def test_uninstall_keeps_a_newer_stock_file_over_dkms_archived_original(tmp_path, monkeypatch):
    needs.require("gcc", "depmod", "dpkg-deb", "apt-get")
    from tests.test_dkms import dkms_release
    from spark_memsaver.act import dkms_run, render
    from spark_memsaver.observe.dkms import PACKAGE
    exe = dkms_release("trixie")
    root = tmp_path / "root"
    (root / "usr/src").mkdir(parents=True)
    r = render.render(Host(root), Config(kernels="all"), "555.58.02", "/usr/src/nvidia-555.58.02")
    ver = r["version"]
    tree, inst, src = root / "var/lib/dkms", root / "lib/modules", root / "usr/src"
    tree.mkdir(parents=True)
    wrapper = tmp_path / "dkms"
    wrapper.write_text(f'#!/bin/sh\nexec {exe} "$@" --dkmstree {tree} --sourcetree {src} --installtree {inst}\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("SPARK_MEMSAVER_DKMS", str(wrapper))
    os.system(f"{wrapper} add -m {PACKAGE} -v {ver} >/dev/null")
    # installed as DKMS 3.2.2 leaves it: ours in updates/dkms, the old stock archived with its origin
    built = _uvm(tree / PACKAGE / ver / K / ARCH / "module/nvidia-uvm.ko", "555.58.02")
    (tree / PACKAGE / f"kernel-{K}-{ARCH}").symlink_to(f"{ver}/{K}/{ARCH}")
    (inst / K / "updates/dkms").mkdir(parents=True)
    (inst / K / "updates/dkms/nvidia-uvm.ko").write_bytes(built.read_bytes())
    stock = inst / K / "kernel/nvidia-555-open/nvidia-uvm.ko"
    arch_dir = tree / PACKAGE / "original_module" / K / ARCH
    old = _uvm(arch_dir / "nvidia-uvm.ko", "555.58.02")
    (arch_dir / "nvidia-uvm.ko.origin").write_text(f"{stock}\n")
    # plain dpkg -i of driver 555.58.99 since: its stock nvidia-uvm stands at the original location
    new = _uvm(stock, "555.58.99").read_bytes()
    assert new != old.read_bytes()
    dkms_run._uninstall_kernel(Host(root), ver, K)
    assert not (inst / K / "updates/dkms/nvidia-uvm.ko").exists(), "dkms uninstall did not run"
    assert stock.read_bytes() == new, "the old driver's archived nvidia-uvm replaced the new driver's"
    assert not list(stock.parent.glob(".*spark-memsaver*")), "a file was left aside"
