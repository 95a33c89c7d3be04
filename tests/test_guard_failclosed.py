"""The load-time guard (systemd/guard/uvm-guard) fails closed (issue 12, defect 2).

Real modprobe/modinfo/depmod/xz against module trees built by tests/test_lifecycle.py's fixtures (real ELF
objects with a real .modinfo section, standing in for NVIDIA's nvidia.ko / nvidia-uvm.ko, whose metadata is
all the guard reads). Every case here is one where an error used to read as "stock" or "fine".

SPARK_MEMSAVER_TEST_GUARD=PATH runs these tests against another copy of the guard (e.g. the previous
release's, to show that they fail there).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import needs, sparkroot
from tests.test_lifecycle import K, REPO, _tree, guard_log, inserted, p

pytestmark = pytest.mark.lifecycle

GUARD = Path(os.environ.get("SPARK_MEMSAVER_TEST_GUARD") or REPO / "systemd/guard/uvm-guard")
SHELLS = {"dash": ["dash"], "bash": ["bash"], "busybox": ["busybox", "sh"]}


def run(root: Path, *args, shell="dash", env=None, cwd=None, kernel=K):
    e = dict(os.environ, SPARK_MEMSAVER_GUARD_KVER=kernel, SPARK_MEMSAVER_GUARD_MODDIR=str(root),
             SPARK_MEMSAVER_GUARD_ROOT=str(root), SPARK_MEMSAVER_GUARD_DRYRUN="1",
             SPARK_MEMSAVER_GUARD_CONFIG=str(root / "etc/modprobe.d"))
    e.update(env or {})
    needs.require(SHELLS[shell][0], remedy="tools/deps/lifecycle.txt")
    return subprocess.run(SHELLS[shell] + [str(GUARD), *args], capture_output=True, text=True, env=e,
                          timeout=60, cwd=cwd or root)


def unreadable_ours(root: Path, version="550.163.01", kernel=K) -> str:
    """Our module, xz-compressed and listed by depmod, then damaged: modinfo cannot decompress it, while
    modprobe still selects it (and on a live kernel would hand it to the in-kernel decompressor)."""
    ko = root / f"lib/modules/{kernel}/updates/dkms/nvidia-uvm.ko"
    sparkroot.make_module(ko, sparkroot.uvm_fields(version, "OURS", kernel, True))
    subprocess.run(["xz", "-f", str(ko)], check=True)
    subprocess.run(["depmod", "-b", str(root), kernel], check=True, capture_output=True)
    xz = Path(str(ko) + ".xz")
    xz.write_bytes(xz.read_bytes()[:100])
    # the precondition: modprobe still selects the damaged file, modinfo fails on it
    sel = subprocess.run(["modprobe", "-d", str(root), "-C", str(root / "etc/modprobe.d"), "-S", kernel,
                          "--ignore-install", "--dry-run", "--show-depends", "nvidia_uvm"], capture_output=True, text=True)
    assert str(xz) in sel.stdout, sel.stdout + sel.stderr
    assert subprocess.run(["modinfo", "-b", str(root), "-k", kernel, "nvidia_uvm"],
                          capture_output=True).returncode != 0
    return str(xz)


# --- defect 2: an unreadable selection is not "stock" ------------------------------------------------

@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_unreadable_selection_loads_the_verified_stock_by_path(tmp_path, shell):
    root = _tree(tmp_path, nv="555.58.02", stock_uvm="555.58.02", ours=None)
    bad = unreadable_ours(root)
    r = run(root, "uvm_perf_prefetch_enable=0", shell=shell)
    assert bad not in r.stdout, "the module modinfo cannot read was loaded"
    assert r.returncode == 0, r.stderr
    assert inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")]
    assert r.stdout.split()[-1] == "uvm_perf_prefetch_enable=0"
    assert "cannot be read" in r.stderr
    assert "loading the stock module" in guard_log(root)


def test_unreadable_selection_without_a_stock_refuses(tmp_path):
    root = _tree(tmp_path, nv="555.58.02", stock_uvm=None, ours=None)
    bad = unreadable_ours(root)
    r = run(root)
    assert r.returncode == 1 and inserted(r) == [] and bad not in r.stdout
    assert "REFUSED" in r.stderr and "cannot be read" in r.stderr
    assert "REFUSED" in guard_log(root)


def test_real_modprobe_with_an_unreadable_selection(tmp_path):
    # modprobe itself runs the install rule (not --dry-run); the guard's DRYRUN stops only the final insert
    root = _tree(tmp_path, nv="555.58.02", stock_uvm="555.58.02", ours=None)
    conf = root / "etc/modprobe.d/spark-memsaver.conf"
    conf.write_text(conf.read_text().replace(str(REPO / "systemd/guard/uvm-guard"), str(GUARD)))
    unreadable_ours(root)
    e = dict(os.environ, SPARK_MEMSAVER_GUARD_KVER=K, SPARK_MEMSAVER_GUARD_MODDIR=str(root),
             SPARK_MEMSAVER_GUARD_ROOT=str(root), SPARK_MEMSAVER_GUARD_DRYRUN="1",
             SPARK_MEMSAVER_GUARD_CONFIG=str(root / "etc/modprobe.d"))
    r = subprocess.run(["modprobe", "-d", str(root), "-S", K, "-C", str(root / "etc/modprobe.d"), "nvidia-uvm"],
                       capture_output=True, text=True, env=e, timeout=60)
    assert inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")], r.stdout + r.stderr


def test_patched_by_someone_else_is_not_ours(tmp_path):
    # a patched module whose tag is not ours, even of the right driver version, is not loaded
    root = _tree(tmp_path, nv="555.58.02", stock_uvm="555.58.02", ours=None,
                 extra=[("updates/dkms/nvidia-uvm.ko",
                         [(k, "uvm-pt-pack/9" if k == "spark_memsaver" else v)
                          for k, v in sparkroot.uvm_fields("555.58.02", "OTHER", K, True)])])
    r = run(root)
    assert inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")], r.stdout + r.stderr
    assert "not by this spark-memsaver" in r.stderr


# --- unreadable versions ---------------------------------------------------------------------------

def test_loaded_nvidia_without_a_readable_version_refuses(tmp_path):
    # nvidia is loaded (/sys/module/nvidia exists) but its version cannot be read: the disk's 550 is not
    # what runs, so ours for 550 is not loaded on its word
    root = _tree(tmp_path, nv="550.163.01", stock_uvm="550.163.01", ours="550.163.01")
    (root / "sys/module/nvidia").mkdir(parents=True)
    r = run(root)
    assert r.returncode == 1 and inserted(r) == [], r.stdout
    assert "nvidia driver version cannot be read" in r.stderr and "REFUSED" in r.stderr


def test_empty_nvidia_version_never_takes_any_stock(tmp_path):
    # an empty version used to mean "any driver": a stock nvidia-uvm of some driver was loaded
    root = _tree(tmp_path, nv="555.58.02", stock_uvm="550.163.01", ours="550.163.01")
    sparkroot.write(root, "/sys/module/nvidia/version", "\n")
    r = run(root)
    assert r.returncode == 1 and inserted(r) == [], r.stdout
    assert "cannot be read" in r.stderr


def test_nvidia_ko_without_a_version_never_takes_any_stock(tmp_path):
    root = _tree(tmp_path, nv=None, stock_uvm="555.58.02", ours="550.163.01",
                 extra=[("kernel/nvidia-open/nvidia.ko", [("name", "nvidia"), ("license", "Dual MIT/GPL"),
                                                          ("vermagic", f"{K} SMP")])])
    r = run(root)
    assert r.returncode == 1 and inserted(r) == [], r.stdout
    assert "nvidia driver version cannot be read" in r.stderr


# --- stock records ---------------------------------------------------------------------------------

def test_relative_stock_record_is_not_read_from_the_working_directory(tmp_path):
    root = _tree(tmp_path / "root", nv="555.58.02", stock_uvm="555.58.02", ours="550.163.01")
    cwd = tmp_path / "cwd"
    sparkroot.make_module(cwd / "nvidia-uvm.ko", sparkroot.uvm_fields("555.58.02", "CWD", K, False))
    sparkroot.write(root, f"/var/lib/spark-memsaver/stock/{K}", "nvidia-uvm.ko\n")
    r = run(root, cwd=cwd)
    assert inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")], r.stdout + r.stderr
    assert "holds no absolute path; not used" in guard_log(root)


def test_stock_record_that_does_not_verify_is_reported(tmp_path):
    root = _tree(tmp_path, nv="555.58.02", stock_uvm="555.58.02", ours="550.163.01",
                 extra=[("kernel/old/nvidia-uvm.ko", sparkroot.uvm_fields("550.163.01", "OLD", K, False))])
    sparkroot.write(root, f"/var/lib/spark-memsaver/stock/{K}", f"/lib/modules/{K}/kernel/old/nvidia-uvm.ko\n")
    r = run(root)
    # the recorded file is the old driver's: never loaded; the verified stock beside nvidia.ko is
    assert inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")]
    assert f"names /lib/modules/{K}/kernel/old/nvidia-uvm.ko, which is not a stock nvidia-uvm of driver " \
           "555.58.02; not used" in guard_log(root)


# --- options: quoted, never globbed ----------------------------------------------------------------

def test_options_are_never_globbed(tmp_path):
    root = _tree(tmp_path / "root", nv="555.58.02", ours="550.163.01",
                 options="options nvidia_uvm uvm_x=* uvm_z=1\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for name in ("uvm_x=GLOBBED", "uvm_y=GLOBBED"):
        (cwd / name).write_text("")
    r = run(root, "uvm_y=*", cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert "GLOBBED" not in r.stdout
    assert r.stdout.split() == ["insmod", p(root, "kernel/nvidia-open/nvidia-uvm.ko"), "uvm_x=*", "uvm_z=1",
                                "uvm_y=*"]


# --- guard.log: bounded, never through a link ------------------------------------------------------

def test_guard_log_is_rotated_at_the_default_cap(tmp_path):
    root = _tree(tmp_path, nv="555.58.02", ours="550.163.01")
    sparkroot.write(root, "/run/spark-memsaver/guard.log", "x" * 70000 + "\n")
    run(root)
    log = root / "run/spark-memsaver/guard.log"
    assert log.stat().st_size < 4096 and "loading the stock module" in log.read_text()
    assert (root / "run/spark-memsaver/guard.log.1").stat().st_size == 70001


def test_guard_log_stays_bounded_over_many_loads(tmp_path):
    root = _tree(tmp_path, nv="555.58.02", ours="550.163.01")
    for _ in range(30):
        run(root, env={"SPARK_MEMSAVER_GUARD_LOG_MAX": "2048"})
    d = root / "run/spark-memsaver"
    sizes = {f.name: f.stat().st_size for f in d.iterdir()}
    assert set(sizes) == {"guard.log", "guard.log.1"}
    assert sizes["guard.log"] < 2048 + 1024 and sizes["guard.log.1"] < 2048 + 1024, sizes


def test_guard_log_link_is_not_followed(tmp_path):
    root = _tree(tmp_path / "root", nv="555.58.02", ours="550.163.01")
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    (root / "run/spark-memsaver").mkdir(parents=True)
    (root / "run/spark-memsaver/guard.log").symlink_to(victim)
    r = run(root)
    assert inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")]
    assert victim.read_text() == "untouched\n"


def test_kernel_release_must_be_a_release_name(tmp_path):
    root = _tree(tmp_path, nv="555.58.02", ours="550.163.01")
    r = run(root, kernel="../../../etc")
    assert r.returncode == 1 and inserted(r) == [] and "is not a kernel release name" in r.stderr


# --- a shell whose applets shadow kmod (busybox-static's ash: FEATURE_PREFER_APPLETS) --------------------

def _busybox_static() -> Path:
    """Debian's real busybox-static, unpacked into the test cache (it conflicts with the busybox package, so it
    is never installed). Its ash runs its own modinfo/modprobe/insmod applets for bare command names."""
    from tests.support import cache
    dest = cache.cache_dir() / "busybox-static"
    bb = dest / "bin/busybox"
    with cache.locked("busybox-static"):
        if not bb.exists():
            work = dest.with_name("busybox-static.tmp")
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            r = subprocess.run(["apt-get", "download", "busybox-static"], cwd=work, capture_output=True, text=True,
                               timeout=300)
            debs = list(work.glob("busybox-static_*.deb"))
            if r.returncode != 0 or not debs:
                needs.absent("busybox-static from Debian's archive", f"apt-get download failed: {r.stderr.strip()[-300:]}")
            subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(work / "root")], check=True)
            shutil.rmtree(dest, ignore_errors=True)
            (work / "root").rename(dest)
            shutil.rmtree(work, ignore_errors=True)
    return bb


def test_busybox_static_ash_runs_kmods_tools_not_its_applets(tmp_path):
    bb = _busybox_static()
    # the precondition: in this shell a bare `modinfo` is the applet, which has no -k
    t = subprocess.run([str(bb), "sh", "-c", "type modinfo; modinfo -k x nvidia 2>&1; echo rc=$?"],
                       capture_output=True, text=True)
    assert "modinfo is modinfo" in t.stdout and "rc=0" not in t.stdout, t.stdout
    root = _tree(tmp_path, nv="550.163.01", stock_uvm="550.163.01", ours="550.163.01")
    e = dict(os.environ, SPARK_MEMSAVER_GUARD_KVER=K, SPARK_MEMSAVER_GUARD_MODDIR=str(root),
             SPARK_MEMSAVER_GUARD_ROOT=str(root), SPARK_MEMSAVER_GUARD_DRYRUN="1",
             SPARK_MEMSAVER_GUARD_CONFIG=str(root / "etc/modprobe.d"))
    r = subprocess.run([str(bb), "sh", str(GUARD)], capture_output=True, text=True, env=e, timeout=60, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "REFUSED" not in r.stderr
    # ours matches the driver: the normal modprobe path, which inserts our file
    assert p(root, "updates/dkms/nvidia-uvm.ko") in r.stdout, r.stdout
