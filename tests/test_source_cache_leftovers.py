"""The driver-source cache after a fetch killed midway, and a leftover /usr/src tree (act/source_fetch.py,
act/dkms_run.py, host/staging.py, spark-memsaverd's start).

Before: a `.staging-*` directory (a 50 MB partial .deb) survived `prune_installed` (it returned early when the
cache held no tree) and counted in the cache's size; a leftover, incomplete /usr/src/nvidia-<v> counted as
present (Kbuild + nvidia-uvm/ were enough), so nothing was fetched, while every build refused it as corrupt
(find_driver_source took the first directory) and the pruning threw the complete cached tree away.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from spark_memsaver.act import dkms_run, source_fetch
from spark_memsaver.act.dkms_errors import DriverSourceCorrupt
from spark_memsaver.host import Host, locks, paths
from spark_memsaver.observe import sources as osrc
from tests.support import sparkroot
from tests.test_sources import V, driver_kernels, nvidia_tree
from spark_memsaver.model import world_of

CACHE = paths.SOURCES_CACHE.lstrip("/")


def _killed_fetch(root: Path) -> Path:
    """What a fetch killed during `apt-get download` leaves: .staging-<hex>/deb/<partial .deb> (50 MB, sparse)."""
    st = root / CACHE / ".staging-0123456789ab"
    (st / "deb").mkdir(parents=True)
    with open(st / "deb" / f"nvidia-kernel-source-580-open_{V}-0ubuntu1_arm64.deb", "wb") as f:
        f.truncate(50 << 20)
    (st / "link").symlink_to("/etc")          # removed as a link, never followed
    return st


def test_prune_installed_sweeps_a_killed_fetch(tmp_path):
    host = Host(str(tmp_path))
    st = _killed_fetch(tmp_path)
    assert osrc.cache_summary(host, osrc.cache_entries(host))["bytes"] >= 50 << 20
    drv, kernels = driver_kernels(V)
    source_fetch.prune_installed(host, world_of(dict(driver=drv, kernels=kernels)))
    assert not st.exists() and os.path.isdir("/etc")
    assert osrc.cache_summary(host, osrc.cache_entries(host))["bytes"] == 0
    # also when the snapshot cannot say which drivers are installed (nothing else is pruned then)
    st = _killed_fetch(tmp_path)
    assert source_fetch.prune_installed(host, None) is None and not st.exists()


def _incomplete_usr_src(root: Path) -> Path:
    """What a removed source package can leave: the directory with its Kbuild, without conftest.sh."""
    d = nvidia_tree(root / f"usr/src/nvidia-{V}", V)
    (d / "conftest.sh").unlink()
    return d


def test_a_leftover_usr_src_tree_does_not_hide_the_fetched_one(tmp_path):
    host = Host(str(tmp_path))
    _incomplete_usr_src(tmp_path)
    # no fetched tree yet: nothing usable is present (a fetch will run) and the build names the damage
    assert source_fetch.present(host, V) is None
    with pytest.raises(DriverSourceCorrupt, match="conftest.sh"):
        dkms_run.find_driver_source(host, V)
    # the fetched tree, complete, in the cache: present, built from, and kept by the pruning
    nvidia_tree(tmp_path / paths.source_tree(V).lstrip("/"), V)
    assert source_fetch.present(host, V) == paths.source_tree(V)
    assert dkms_run.find_driver_source(host, V) == paths.source_tree(V)
    drv, kernels = driver_kernels(V)
    assert source_fetch.prune_installed(host, world_of(dict(driver=drv, kernels=kernels)))["removed"] == []
    assert (tmp_path / paths.source_tree(V).lstrip("/") / "Kbuild").is_file()
    # a complete /usr/src tree still comes first, and then the cached copy goes
    (tmp_path / f"usr/src/nvidia-{V}/conftest.sh").write_text("#!/bin/sh\n")
    assert source_fetch.present(host, V) == dkms_run.find_driver_source(host, V) == f"/usr/src/nvidia-{V}"
    assert source_fetch.prune_installed(host, world_of(dict(driver=drv, kernels=kernels)))["removed"] == [V]


def test_the_dkms_build_script_takes_the_same_tree(tmp_path):
    """The rendered spark-memsaver-build's source loop, run by bash over the same two trees."""
    tmpl = (Path(__file__).resolve().parent.parent / "dkms/templates/spark-memsaver-build.j2").read_text()
    start = tmpl.index('src=""')
    loop = tmpl[start:tmpl.index('[[ -n "$src" ]]', start)]
    import jinja2
    cands = [str(tmp_path / f"usr/src/nvidia-{V}"), str(tmp_path / paths.source_tree(V).lstrip("/"))]
    script = jinja2.Template(loop).render(source_candidates=cands) + '\necho "$src"\n'
    _incomplete_usr_src(tmp_path)
    nvidia_tree(Path(cands[1]), V)
    r = subprocess.run(["bash", "-euc", f"driver={V}\n" + script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == cands[1], r.stdout + r.stderr
    (Path(cands[0]) / "conftest.sh").write_text("#!/bin/sh\n")
    r = subprocess.run(["bash", "-euc", f"driver={V}\n" + script], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == cands[0], r.stdout + r.stderr


def test_daemon_start_sweeps_unless_a_fetch_holds_the_lock(tmp_path):
    """spark-memsaverd itself (a private system bus), started twice over a root with a killed fetch's leftover."""
    from tests.support.privatebus import PrivateSystemBus, names, start_daemon, stop_process
    root = sparkroot.make_spark_root(tmp_path / "root")
    st = _killed_fetch(root)
    bus = PrivateSystemBus(tmp_path / "bus").start()
    try:
        with locks.hold(Host(str(root)), "lifecycle", timeout=0, purpose="a fetch in another process"):
            p = start_daemon(bus, "--no-reconcile", "--root", str(root), log_path=tmp_path / "d1.log")
            try:
                bus.wait_for_name(names.BUS_NAME, timeout=30, proc=p)
                assert st.exists(), "a running fetch's staging directory must be kept"
            finally:
                stop_process(p)
        p = start_daemon(bus, "--no-reconcile", "--root", str(root), log_path=tmp_path / "d2.log")
        try:
            bus.wait_for_name(names.BUS_NAME, timeout=30, proc=p)
            deadline = time.monotonic() + 10
            while st.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not st.exists(), (tmp_path / "d2.log").read_text()[-2000:]
        finally:
            stop_process(p)
    finally:
        bus.stop()
