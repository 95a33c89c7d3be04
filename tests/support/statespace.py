"""Node states built on Spark-shaped fixture roots (tests/support/sparkroot.py), cheaply: DKMS's own tree
layout for a build of ours, and (tests/test_state_space.py) every dimension a node varies in."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.support import sparkroot

PACKAGE = "spark-memsaver-uvm"
ARCH = "aarch64"


def dkms_version(driver: str) -> str:
    from spark_memsaver.observe.dkms import dkms_version_string
    return dkms_version_string(driver)


def add_dkms_build(root: Path, kernel: str, driver: str, installed: bool) -> str:
    """A registration of ours in DKMS's tree (as 'dkms add' and 'dkms build' leave it: the source link, the
    built module under <ver>/<kernel>/<arch>/module) and, ``installed``, DKMS's kernel-<k>-<arch> link; the
    built module is a real .ko with our .modinfo (what DKMS would have built; no compiler run)."""
    ver = dkms_version(driver)
    tree = root / "var/lib/dkms" / PACKAGE
    src = root / "usr/src" / f"{PACKAGE}-{ver}"
    src.mkdir(parents=True, exist_ok=True)
    (src / "dkms.conf").write_text(f'PACKAGE_NAME="{PACKAGE}"\nPACKAGE_VERSION="{ver}"\nBUILT_MODULE_NAME[0]='
                                   '"nvidia-uvm"\nDEST_MODULE_LOCATION[0]="/updates/dkms"\nAUTOINSTALL="yes"\n')
    (tree / ver).mkdir(parents=True, exist_ok=True)
    link = tree / ver / "source"
    if not link.is_symlink():
        os.symlink(f"../../../../../usr/src/{PACKAGE}-{ver}", link)
    ko = tree / ver / kernel / ARCH / "module" / "nvidia-uvm.ko"
    installed_ko = root / f"lib/modules/{kernel}/updates/dkms/nvidia-uvm.ko"
    if installed_ko.is_file():
        ko.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(installed_ko, ko)
    else:
        sparkroot.make_module(ko, sparkroot.uvm_fields(driver, sparkroot.OURS_UVM_SRCVERSION, kernel, ours=True))
    if installed:
        k = tree / f"kernel-{kernel}-{ARCH}"
        if not k.is_symlink():
            os.symlink(f"{ver}/{kernel}/{ARCH}", k)
    return ver
