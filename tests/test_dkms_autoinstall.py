"""``dkms autoinstall`` for a kernel that has no NVIDIA modules yet (tests/FAULTS.md d1), with the real DKMS
of Debian 12 (3.0.10-8) and Debian 13 (3.2.2; Ubuntu noble's 3.0.11 has the same autoinstall code, read from
its source: docs/distributions.md).

The rendered dkms.conf (dkms/templates/dkms.conf.j2) excludes, under ``dkms autoinstall`` only, a kernel that
has no nvidia.ko of its driver and no NVIDIA DKMS package of that driver registered: DKMS >= 3.0.11 then
reports the module as skipped and autoinstall succeeds (the kernel's headers package configures); DKMS
3.0.10 still counts the skip as a failure (the gap that remains on Debian 12). A kernel with the driver's
nvidia.ko, or with NVIDIA's DKMS package registered, is built as before, and spark-memsaver's own
``dkms build`` is never excluded by this rule.

Everything runs in private trees (``--sourcetree``, ``--dkmstree``, ``--installtree``): nothing of this
machine's DKMS state is read or changed. The nvidia.ko is a real ELF object with a real .modinfo (gcc) in a
private module tree indexed by the real depmod.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from spark_memsaver.config import Config
from spark_memsaver.host import Host
from tests.support import needs, sparkroot

pytestmark = pytest.mark.dkms

DRIVER = "550.163.01"
K = "6.1.0-99-smtest"
SKIPPED = "BUILD_EXCLUSIVE"
BUILDING = "Building module"            # both releases print it when they go on to run MAKE


def _dkms_exe(which: str) -> str:
    if which == "3.0.10":
        needs.require("dkms", "depmod", "modinfo", "gcc")
        return shutil.which("dkms") or "/usr/sbin/dkms"
    from tests.test_dkms import dkms_release
    needs.require("depmod", "modinfo", "gcc", "dpkg-deb", "apt-get")
    return str(dkms_release("trixie"))


@pytest.fixture(params=["3.0.10", "3.2.2"])
def world(request, tmp_path):
    """A private DKMS world: our tree rendered as the product renders it, registered with the real dkms."""
    exe = _dkms_exe(request.param)
    ver = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    if request.param == "3.0.10":
        assert "3.0.10" in ver, ver
    else:
        assert "3.2" in ver, ver
    from spark_memsaver.act import render
    from spark_memsaver.observe.dkms import PACKAGE
    root = tmp_path / "root"
    (root / "usr/src").mkdir(parents=True)
    r = render.render(Host(root), Config(kernels="all"), DRIVER, f"/usr/src/nvidia-{DRIVER}")
    tree, inst, ksrc = tmp_path / "dkmstree", tmp_path / "inst", tmp_path / "ksrc"
    tree.mkdir()
    (inst / "lib/modules" / K / "kernel").mkdir(parents=True)
    ksrc.mkdir()
    (ksrc / ".config").write_text("CONFIG_X86_64=y\nCONFIG_MODULES=y\n")
    (ksrc / "include").mkdir()          # what DKMS checks of the headers (no kernel is compiled against)
    (inst / "lib/modules" / K / "build").symlink_to(ksrc)
    common = ["--sourcetree", str(root / "usr/src"), "--dkmstree", str(tree),
              "--installtree", str(inst / "lib/modules")]
    subprocess.run([exe, "add", "-m", PACKAGE, "-v", r["version"], *common], check=True,
                   capture_output=True, timeout=60)

    class W:
        pass
    w = W()
    w.exe, w.tree, w.inst, w.ksrc, w.common, w.version, w.package = exe, tree, inst, ksrc, common, \
        r["version"], PACKAGE
    w.release = request.param
    return w


def _depmod(w):
    subprocess.run(["depmod", "-b", str(w.inst), K], check=True, capture_output=True, timeout=60)


def _nvidia_ko(w, version: str):
    sparkroot.make_module(w.inst / "lib/modules" / K / "updates/dkms/nvidia.ko",
                          [("version", version), ("license", "Dual MIT/GPL"), ("name", "nvidia"),
                           ("vermagic", f"{K} SMP preempt mod_unload modversions ")])
    _depmod(w)


def _autoinstall(w) -> subprocess.CompletedProcess:
    return subprocess.run([w.exe, "autoinstall", "-k", K, "--kernelsourcedir", str(w.ksrc), *w.common],
                          capture_output=True, text=True, timeout=300)


def _out(r) -> str:
    return r.stdout + r.stderr


def test_kernel_without_nvidia_is_skipped_not_failed(world):
    _depmod(world)                      # the new kernel's module tree, no nvidia.ko in it
    r = _autoinstall(world)
    assert SKIPPED in _out(r), _out(r)
    if world.release == "3.0.10":
        # Debian 12: the exclusion happens, but 3.0.10's autoinstall counts exit 77 as a failure (FAULTS d1)
        assert r.returncode != 0, _out(r)
    else:
        assert r.returncode == 0, _out(r)
        assert f"skipped for module(s) {world.package}" in r.stdout, _out(r)
    assert not list(world.tree.glob(f"{world.package}/{world.version}/{K}")), "something was built"


def test_kernel_with_another_drivers_nvidia_is_skipped(world):
    _nvidia_ko(world, "555.58.02")
    r = _autoinstall(world)
    assert SKIPPED in _out(r), _out(r)


def test_kernel_with_the_drivers_nvidia_is_built(world):
    _nvidia_ko(world, DRIVER)
    r = _autoinstall(world)
    # not excluded: DKMS goes on to build (spark-memsaver-build then stops: no NVIDIA tree here)
    assert SKIPPED not in _out(r) and BUILDING in _out(r), _out(r)


def test_nvidia_dkms_package_registered_for_the_driver_is_built(world):
    _depmod(world)
    nv = world.tree / "nvidia-current-open" / DRIVER / "source"
    nv.mkdir(parents=True)              # NVIDIA's DKMS package of this driver (Debian's nvidia-open-kernel-dkms)
    (nv / "dkms.conf").write_text(f'PACKAGE_NAME="nvidia-current-open"\nPACKAGE_VERSION="{DRIVER}"\n'
                                  'BUILT_MODULE_NAME[0]="nvidia"\nDEST_MODULE_LOCATION[0]="/updates/dkms"\n'
                                  'AUTOINSTALL="no"\n')
    r = _autoinstall(world)
    assert SKIPPED not in _out(r) and BUILDING in _out(r), _out(r)


def test_our_own_build_is_never_excluded_by_the_autoinstall_rule(world):
    _depmod(world)
    r = subprocess.run([world.exe, "build", "-m", world.package, "-v", world.version, "-k", K,
                        "--kernelsourcedir", str(world.ksrc), *world.common], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 77 and SKIPPED not in _out(r) and BUILDING in _out(r), _out(r)


@pytest.mark.parametrize("hold", ["kernel", "all", "all-released"])
def test_a_hold_excludes_the_kernel_from_autoinstall(world, hold):
    """After `rollback`/`remove` (host/holds.py) dkms autoinstall -- at boot, for a new kernel -- never brings our
    module back; `install --kernel K` under an all-kernels hold releases K (its `released` list)."""
    import json
    from spark_memsaver.host import holds
    _nvidia_ko(world, DRIVER)               # everything a build needs: only the hold can exclude it
    h = Host(world.inst)
    holds.hold(h, "rollback" if hold == "kernel" else "remove", K if hold == "kernel" else None, "test")
    if hold == "all-released":
        holds.release(h, K)
        assert K in json.loads((world.inst / "var/lib/spark-memsaver/holds/all.json").read_text())["released"]
    r = _autoinstall(world)
    if hold == "all-released":
        assert SKIPPED not in _out(r) and BUILDING in _out(r), _out(r)
    else:
        assert SKIPPED in _out(r) and BUILDING not in _out(r), _out(r)
