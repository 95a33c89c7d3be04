"""Source acquisition (issue #14 item 1): driver -> source package (pure), what APT offers (a REAL apt reading
a local repository of real .debs built with dpkg-deb and indexed with apt-ftparchive), and the fetch itself
(the real ``apt-get download`` into the cache, SHA256 against the lists, dpkg-deb -x, one rename).

The repository lives in a fixture root (``--root`` host): its etc/apt/sources.list names a ``[trusted=yes]``
file: repository, ``apt-get -o Dir=<root>/ update`` fills its lists, and the product reads that root's APT
state exactly as it reads a mounted image's. The .debs carry a small but well-formed open kernel-module tree
(Kbuild with NV_VERSION_STRING, nvidia-uvm/...); the UBUNTU engineer's end-to-end test uses real NVIDIA trees.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from spark_memsaver import world
from spark_memsaver import config as cfg
from spark_memsaver.decide import sources as dsrc
from spark_memsaver.errors import (ConfigError, SourceChecksumMismatch, SourceFetchDisabled, SourceNotInLists)
from spark_memsaver.host import Host, paths
from tests.support import needs
from spark_memsaver.model import world_of

V = "580.178.04"
UBU = "580.178.04-0ubuntu0.24.04.1"
PKG = "nvidia-kernel-source-580-open"

needs_apt = pytest.mark.needs("apt-get", "apt-ftparchive", "dpkg-deb")   # tools/deps/sources.txt


# --- pure -------------------------------------------------------------------------------------------

def test_driver_of_deb_versions():
    assert dsrc.driver_of("580.178.04-0ubuntu0.24.04.1") == "580.178.04"
    assert dsrc.driver_of("1:550.163.01-4") == "550.163.01"
    assert dsrc.driver_of("535.261.03-1~deb12u1") == "535.261.03"
    assert dsrc.driver_of("580.142") == "580.142"
    assert dsrc.driver_of("580.142~rc1-1") == "580.142"
    assert dsrc.driver_of("580.142.1.2-1") is None
    assert dsrc.driver_of("abc-1") is None and dsrc.driver_of(None) is None and dsrc.driver_of("") is None


def test_source_package_order_by_layout():
    names = lambda layout: [c["package"] for c in dsrc.source_package(V, layout)]  # noqa: E731
    assert names({"os_id": "ubuntu"}) == [PKG, "nvidia-kernel-source-580-server-open", "nvidia-kernel-source-open",
                                          "nvidia-open-kernel-dkms", "nvidia-open-kernel-source"]
    # DGX OS reports ID=ubuntu; a derivative names it in ID_LIKE
    assert names({"os_id": "dgx", "os_id_like": "ubuntu debian"})[0] == PKG
    # the server flavour's modules live in kernel/nvidia-580srv-open/
    assert names({"os_id": "ubuntu", "nvidia_ko": "/lib/modules/K/kernel/nvidia-580srv-open/nvidia.ko"})[0] == \
        "nvidia-kernel-source-580-server-open"
    assert names({"os_id": "ubuntu", "installed": {"nvidia-kernel-common-580-server": UBU}})[0] == \
        "nvidia-kernel-source-580-server-open"
    assert names({"os_id": "debian"})[:2] == ["nvidia-open-kernel-dkms", "nvidia-open-kernel-source"]
    # how the driver is installed outranks os-release: Ubuntu-shaped packages on a Debian system take Ubuntu's
    # source package (Debian's DKMS package there would add a second driver), and the reverse
    assert names({"os_id": "debian", "installed": {"nvidia-kernel-common-580": UBU}})[0] == PKG
    assert names({"os_id": "debian", "nvidia_ko": "/lib/modules/K/kernel/nvidia-580-open/nvidia.ko"})[0] == PKG
    assert names({"os_id": "ubuntu", "installed": {"nvidia-open-kernel-dkms": "580.142-1"}})[0] == \
        "nvidia-open-kernel-dkms"
    trees = {c["package"]: c["tree"] for c in dsrc.source_package(V, {})}
    assert trees[PKG] == f"/usr/src/nvidia-{V}"
    assert trees["nvidia-open-kernel-dkms"] == f"/usr/src/nvidia-current-open-{V}"
    assert dsrc.source_package("not-a-version", {}) == []


def test_install_command_exact_and_refuses_injection():
    assert dsrc.install_command(PKG, UBU) == f"sudo apt-get install {PKG}={UBU}"
    for bad in (("x; rm -rf /", "1"), (PKG, "1.0 && reboot"), (PKG, ""), ("", "1")):
        with pytest.raises(ValueError):
            dsrc.install_command(*bad)


def test_choose_exact_version_and_sibling_inference():
    cands = dsrc.source_package(V, {"os_id": "ubuntu"})
    offered = {PKG: ["580.200.01-0ubuntu1", UBU, "580.142-0ubuntu1"]}
    assert dsrc.choose(V, cands, offered) == {"package": PKG, "deb_version": UBU, "in_lists": True}
    # not in the lists: the version the installed nvidia-kernel-common-580 has (same source, same version)
    got = dsrc.choose(V, cands, {PKG: ["580.200.01-0ubuntu1"]}, {"nvidia-kernel-common-580": UBU})
    assert got == {"package": PKG, "deb_version": UBU, "in_lists": False}
    # a sibling of another driver version proves nothing
    got = dsrc.choose(V, cands, {}, {"nvidia-kernel-common-580": "580.200.01-0ubuntu1"})
    assert got == {"package": None, "deb_version": None, "in_lists": False}
    # NVIDIA's CUDA repository from branch 590 on: unbranched names, sibling nvidia-kernel-common
    c595 = dsrc.source_package("595.71.05", {"os_id": "ubuntu"})
    got = dsrc.choose("595.71.05", c595, {}, {"nvidia-kernel-common": "595.71.05-1ubuntu1"})
    assert got == {"package": "nvidia-kernel-source-open", "deb_version": "595.71.05-1ubuntu1", "in_lists": False}


def test_config_source_fetch_key():
    assert cfg.Config().source_fetch == "auto"
    assert cfg.parse("source_fetch: never\n", "t").source_fetch == "never"
    with pytest.raises(ConfigError, match="source_fetch"):
        cfg.parse("source_fetch: sometimes\n", "t")
    with pytest.raises(ConfigError, match="source_fetch"):
        cfg.parse("source_fetch: false\n", "t")


# --- a real APT repository ------------------------------------------------------------------------------

def nvidia_tree(d: Path, version: str) -> Path:
    """A small open kernel-module tree in the /usr/src layout (what read_tree_version/find_driver_source check)."""
    files = {
        "Kbuild": f'EXTRA_CFLAGS += -DNV_VERSION_STRING=\\"{version}\\"\n',
        "Makefile": "# NVIDIA open kernel modules\n", "conftest.sh": "#!/bin/sh\n",
        "common/inc/nv.h": "/* nv */\n",
        "nvidia/nvidia.Kbuild": "NV_CONFTEST_FUNCTION_COMPILE_TESTS += x\n",
        "nvidia-uvm/uvm.c": "/* uvm */\n", "nvidia-uvm/uvm_mmu.c": f"/* uvm_mmu {version} */\n",
        "nvidia-uvm/uvm_mmu.h": "/* uvm_mmu.h */\n", "nvidia-uvm/nvidia-uvm-sources.Kbuild": "NVIDIA_UVM_SOURCES +=\n",
        "nvidia-uvm/nvidia-uvm.Kbuild": "# uvm\n",
    }
    for rel, text in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return d


def make_deb(out: Path, package: str, deb_version: str, tree_version: str, *, tree_dir: str | None = None,
             tarball: bool = False) -> Path:
    build = out / f"build-{package}-{deb_version}"
    (build / "DEBIAN").mkdir(parents=True)
    (build / "DEBIAN/control").write_text(
        f"Package: {package}\nVersion: {deb_version}\nArchitecture: all\nMaintainer: t <t@example.invalid>\n"
        "Section: kernel\nPriority: optional\nDescription: NVIDIA kernel source package (test)\n")
    if tarball:
        t = nvidia_tree(out / f"tar-{deb_version}/modules/nvidia-kernel", tree_version)
        (build / "usr/src").mkdir(parents=True)
        subprocess.run(["tar", "-cJf", str(build / "usr/src/nvidia-open-kernel.tar.xz"), "-C",
                        str(t.parent.parent), "modules"], check=True)
    else:
        nvidia_tree(build / "usr/src" / (tree_dir or f"nvidia-{tree_version}"), tree_version)
    deb = out / f"{package}_{deb_version.split(':')[-1]}_all.deb"
    subprocess.run(["dpkg-deb", "-Zgzip", "--root-owner-group", "--build", str(build), str(deb)], check=True,
                   capture_output=True)
    shutil.rmtree(build)
    return deb


def index(repo: Path) -> None:
    pk = subprocess.run(["apt-ftparchive", "packages", "."], cwd=repo, check=True, capture_output=True).stdout
    (repo / "Packages").write_bytes(pk)


def apt_root(root: Path, repo: Path, os_id: str = "ubuntu") -> Path:
    """APT state of a fixture root that knows the repository (the system's apt state is never touched)."""
    for d in ("etc/apt/sources.list.d", "etc/apt/preferences.d", "etc/apt/apt.conf.d", "var/lib/apt/lists/partial",
              "var/cache/apt/archives/partial", "var/lib/dpkg/updates", "var/lib/dpkg/info"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "etc/apt/sources.list").write_text(f"deb [trusted=yes] file:{repo} ./\n")
    (root / "var/lib/dpkg/status").touch()
    (root / "etc/os-release").write_text(f'ID={os_id}\nVERSION_ID="24.04"\n')
    update(root)
    return root


def update(root: Path) -> None:
    subprocess.run(["apt-get", f"-o=Dir={root}/", "-o=Dir::Cache::pkgcache=", "-o=Dir::Cache::srcpkgcache=",
                    "-q", "update"], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    r.mkdir()
    os.chmod(tmp_path, 0o755)   # apt's _apt download sandbox may read it
    make_deb(r, PKG, UBU, V)
    make_deb(r, PKG, "580.142-0ubuntu0.24.04.1", "580.142")
    index(r)
    return r


def driver_kernels(version: str, path: str = "/lib/modules/K/kernel/nvidia-580-open/nvidia.ko"):
    return {"loaded_version": version, "sources": []}, [{"release": "K", "nvidia_selected": {"version": version,
                                                                                            "path": path}}]


@needs_apt
def test_observe_real_apt_offers_exact_version(tmp_path, repo):
    root = apt_root(tmp_path / "root", repo)
    host = Host(root)
    drv, kernels = driver_kernels(V)
    got = world.driver_sources(host, cfg.Config(), drv, kernels)
    e = got["by_driver"][V]
    assert got["apt"] == "read" and got["mode"] == "auto"
    assert e == {"present": False, "path": None, "origin": None, "package": PKG, "deb_version": UBU,
                 "in_lists": True, "fetchable": True, "remedy": f"sudo apt-get install {PKG}={UBU}"}
    # source_fetch: never -> not fetchable, the exact command is the remedy
    never = world.driver_sources(host, cfg.Config(source_fetch="never"), drv, kernels)["by_driver"][V]
    assert never["fetchable"] is False and never["remedy"] == f"sudo apt-get install {PKG}={UBU}"
    # a driver the repository lacks: not in the lists, no guessed version without an installed sibling
    drv2, k2 = driver_kernels("580.999.01")
    e2 = world.driver_sources(host, cfg.Config(), drv2, k2)["by_driver"]["580.999.01"]
    assert e2["in_lists"] is False and e2["fetchable"] is False and e2["remedy"] is None


@needs_apt
def test_observe_root_without_apt_is_unknown(tmp_path):
    root = tmp_path / "bare"
    (root / "etc").mkdir(parents=True)
    drv, kernels = driver_kernels(V)
    got = world.driver_sources(Host(root), cfg.Config(), drv, kernels)
    assert got["apt"] == "unknown"
    assert got["by_driver"][V]["fetchable"] is False and got["by_driver"][V]["in_lists"] is False


@needs_apt
def test_fetch_real_apt_download_into_cache_and_snapshot_sees_it(tmp_path, repo):
    from spark_memsaver.act import source_fetch
    from spark_memsaver.observe import sources as osrc
    root = apt_root(tmp_path / "root", repo)
    host = Host(root)
    # apt-get download takes no dpkg lock: another process holds both of the root's dpkg locks meanwhile, as
    # apt and dpkg do inside the APT/dpkg doors
    with _DpkgLocks(root):
        res = source_fetch.fetch(host, cfg.Config(), V)
    assert res["status"] == "fetched" and res["package"] == PKG and res["deb_version"] == UBU
    tree = root / paths.source_tree(V).lstrip("/")
    assert res["path"] == paths.source_tree(V) and (tree / "nvidia-uvm/uvm_mmu.c").is_file()
    rec = json.loads((tree / osrc.RECORD).read_text())
    want = subprocess.run(["apt-cache", f"-o=Dir={root}/", "-o=Dir::Cache::pkgcache=", "show", f"{PKG}={UBU}"],
                          capture_output=True, text=True, check=True).stdout
    assert f"SHA256: {rec['sha256']}" in want
    # nothing installed: dpkg's database is untouched, no staging left
    assert (root / "var/lib/dpkg/status").read_text() == ""
    assert [n for n in os.listdir(root / paths.SOURCES_CACHE.lstrip("/")) if n.startswith(".staging")] == []
    drv, kernels = driver_kernels(V)
    src = osrc.cache_sources(host)
    assert src == [{"version": V, "path": paths.source_tree(V), "open": True, "origin": "cache"}]
    got = world.driver_sources(host, cfg.Config(), drv, kernels)
    assert got["by_driver"][V]["present"] is True and got["by_driver"][V]["origin"] == "cache"
    assert got["by_driver"][V]["remedy"] is None and got["by_driver"][V]["fetchable"] is False
    assert got["cache"]["entries"][0]["deb_version"] == UBU and got["cache"]["bytes"] > 0
    # the build's source lookup finds the cached tree (act/dkms_run.find_driver_source)
    from spark_memsaver.act.dkms_run import find_driver_source
    assert find_driver_source(host, V) == paths.source_tree(V)
    # a second fetch is a no-op
    assert source_fetch.fetch(host, cfg.Config(), V)["status"] == "present"


@needs_apt
def test_tampered_deb_is_refused_and_nothing_kept(tmp_path, repo):
    from spark_memsaver.act import source_fetch
    root = apt_root(tmp_path / "root", repo)
    deb = repo / f"{PKG}_{UBU}_all.deb"
    data = bytearray(deb.read_bytes())
    data[-100] ^= 0xFF                       # same size, different bytes, after Packages was made
    deb.write_bytes(bytes(data))
    with pytest.raises(SourceChecksumMismatch) as ei:
        source_fetch.fetch(Host(root), cfg.Config(), V)
    assert "nothing was kept" in ei.value.message
    cache = root / paths.SOURCES_CACHE.lstrip("/")
    assert [n for n in os.listdir(cache) if not n.startswith((".apt-index", ".dpkg-index"))] == []


def test_verify_deb_against_lists_fields(tmp_path):
    """Our own check (beside apt's): a .deb whose sha256 or size differs from the lists' fields is refused."""
    from spark_memsaver.act import source_fetch
    from spark_memsaver.host.fsutil import sha256_file
    deb = tmp_path / "x.deb"
    deb.write_bytes(b"a" * 100)
    good = {"SHA256": sha256_file(deb), "Size": "100", "Package": PKG, "Version": UBU}
    assert source_fetch.verify_deb(deb, good) == good["SHA256"]
    for bad in ({**good, "SHA256": "0" * 64}, {**good, "Size": "99"}, {**good, "SHA256": ""}):
        with pytest.raises(SourceChecksumMismatch):
            source_fetch.verify_deb(deb, bad)


@needs_apt
def test_fetch_never_and_not_in_lists_give_exact_command(tmp_path, repo):
    from spark_memsaver.act import source_fetch
    root = apt_root(tmp_path / "root", repo)
    with pytest.raises(SourceFetchDisabled) as ei:
        source_fetch.fetch(Host(root), cfg.Config(source_fetch="never"), V)
    assert f"sudo apt-get install {PKG}={UBU}" in ei.value.remedy
    # a version the repository does not carry, with the sibling package dpkg has installed
    (root / "var/lib/dpkg/status").write_text(
        "Package: nvidia-kernel-common-580\nStatus: install ok installed\nArchitecture: all\n"
        "Version: 580.190.01-0ubuntu0.24.04.1\nMaintainer: t <t@example.invalid>\nDescription: t\n\n")
    with pytest.raises(SourceNotInLists) as ei:
        source_fetch.fetch(Host(root), cfg.Config(), "580.190.01")
    assert f"sudo apt-get install {PKG}=580.190.01-0ubuntu0.24.04.1" in ei.value.remedy
    assert not (root / paths.source_tree("580.190.01").lstrip("/")).exists()


@needs_apt
def test_debian_dkms_and_tarball_layouts(tmp_path):
    from spark_memsaver.act import source_fetch
    r = tmp_path / "repo"
    r.mkdir()
    os.chmod(tmp_path, 0o755)
    make_deb(r, "nvidia-open-kernel-dkms", "550.163.01-4", "550.163.01", tree_dir="nvidia-current-open-550.163.01")
    make_deb(r, "nvidia-open-kernel-source", "555.58.02-1", "555.58.02", tarball=True)
    index(r)
    root = apt_root(tmp_path / "root", r, os_id="debian")
    for v, pkg in (("550.163.01", "nvidia-open-kernel-dkms"), ("555.58.02", "nvidia-open-kernel-source")):
        res = source_fetch.fetch(Host(root), cfg.Config(), v)
        assert res["package"] == pkg and (root / paths.source_tree(v).lstrip("/") / "Kbuild").is_file()


@needs_apt
def test_wrong_tree_in_package_is_refused(tmp_path):
    """A package whose tree says another version (its Kbuild) is refused: the cache never holds a mislabelled tree."""
    from spark_memsaver.act import source_fetch
    from spark_memsaver.errors import SourceUnpackFailed
    r = tmp_path / "repo"
    r.mkdir()
    os.chmod(tmp_path, 0o755)
    make_deb(r, PKG, UBU, "580.142", tree_dir=f"nvidia-{V}")
    index(r)
    root = apt_root(tmp_path / "root", r)
    with pytest.raises(SourceUnpackFailed, match="holds NVIDIA 580.142"):
        source_fetch.fetch(Host(root), cfg.Config(), V)
    assert not (root / paths.source_tree(V).lstrip("/")).exists()


@needs_apt
def test_prune_keeps_only_installed_drivers(tmp_path, repo):
    from spark_memsaver.act import source_fetch
    root = apt_root(tmp_path / "root", repo)
    host = Host(root)
    source_fetch.fetch(host, cfg.Config(), "580.142")
    res = source_fetch.fetch(host, cfg.Config(), V, keep={V})      # the driver moved on: 580.142 goes
    assert res["pruned"] == ["580.142"]
    cache = root / paths.SOURCES_CACHE.lstrip("/")
    assert sorted(n for n in os.listdir(cache) if n.startswith("nvidia-")) == [f"nvidia-{V}"]
    (cache / ".staging-deadbeef").mkdir()                          # a killed fetch's leftover
    assert source_fetch.prune(host, set()) == {"removed": [V], "kept": []}
    assert [n for n in os.listdir(cache) if not n.startswith((".apt-index", ".dpkg-index"))] == []


# --- the plan step (act/steps.py -> act/source_fetch.run_step) and reconcile's pruning ---------------------

class _DpkgLocks:
    """Another process holding the root's dpkg locks with fcntl, as apt (lock-frontend) and dpkg (lock) do
    (F_GETLK, which the product uses, sees only other processes' locks)."""

    CODE = ("import fcntl, os, sys\n"
            "fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o640) for p in sys.argv[1:]]\n"
            "[fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB) for fd in fds]\n"
            "print('held', flush=True)\nsys.stdin.read()\n")

    def __init__(self, root: Path):
        self.args = [str(root / "var/lib/dpkg" / n) for n in ("lock-frontend", "lock")]

    def __enter__(self):
        import sys
        self.p = subprocess.Popen([sys.executable, "-c", self.CODE, *self.args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "held"
        return self

    def __exit__(self, *exc):
        self.p.stdin.close()
        self.p.wait(timeout=30)


def _steps(kernel: str, driver: str):
    from spark_memsaver.decide import plan as rc
    # the plan fetches each driver once: the second kernel's build of the same driver has no fetch step of its own
    return [rc.Step("fetch-source", kernel, "source missing", driver_to=driver),
            rc.Step("build-install", kernel, "no build", driver_to=driver),
            rc.Step("build-install", kernel + "-2", "no build", driver_to=driver)]


@needs_apt
def test_step_inside_apt_doors_defers_and_build_waits(tmp_path, repo):
    """Inside the APT/dpkg doors (apt/dpkg hold the dpkg locks) nothing is fetched: the fetch is recorded as
    pending for the daemon, and the kernel's build does not run (it would fail without the source)."""
    from spark_memsaver.act import steps as st
    from spark_memsaver.observe import sources as osrc
    root = apt_root(tmp_path / "root", repo)
    host = Host(root)
    with _DpkgLocks(root):
        done = st.execute(host, cfg.Config(), _steps("K", V), snap=None)
    assert done[0]["ok"] is True and done[0]["result"]["deferred"] is True
    assert done[1]["skipped"].startswith("its NVIDIA driver source is not fetched yet")
    assert done[2]["skipped"].startswith("its NVIDIA driver source is not fetched yet")
    assert osrc.pending(host)["drivers"] == [V]
    assert not (root / paths.source_tree(V).lstrip("/")).exists()
    # apt has exited: the same step fetches, and the pending record goes
    done = st.execute(host, cfg.Config(), _steps("K", V)[:1], snap=None)
    assert done[0]["ok"] is True and done[0]["result"]["status"] == "fetched"
    assert osrc.pending(host) is None


@needs_apt
def test_step_failure_records_rollback_with_exact_remedy(tmp_path, repo):
    from spark_memsaver.act import steps as st
    from spark_memsaver.host import intents
    root = apt_root(tmp_path / "root", repo)
    host = Host(root)
    (root / "var/lib/dpkg/status").write_text(
        "Package: nvidia-kernel-common-580\nStatus: install ok installed\nArchitecture: all\n"
        "Version: 580.190.01-0ubuntu0.24.04.1\nMaintainer: t <t@example.invalid>\nDescription: t\n\n")
    done = st.execute(host, cfg.Config(), _steps("K", "580.190.01"), snap=None)
    assert done[0]["ok"] is False and done[0]["result"]["error"]["code"] == "source-not-in-lists"
    assert "skipped" in done[1] and "skipped" in done[2]
    rb = [r for r in intents.list_rollbacks(host)[0] if r.get("kernel") == "K"]
    assert rb and rb[0]["code"] == "source-not-in-lists"
    assert f"sudo apt-get install {PKG}=580.190.01-0ubuntu0.24.04.1" in rb[0]["remedy"]


@needs_apt
def test_prune_installed_from_a_snapshot(tmp_path, repo):
    from spark_memsaver.act import source_fetch
    root = apt_root(tmp_path / "root", repo)
    host = Host(root)
    source_fetch.fetch(host, cfg.Config(), "580.142")
    source_fetch.fetch(host, cfg.Config(), V)
    drv, kernels = driver_kernels(V)
    unreadable = {"driver": {"loaded_version": None}, "kernels": [{"release": "K", "nvidia_selected": {
        "error": "modinfo failed", "state": "unreadable"}}]}
    assert source_fetch.prune_installed(host, world_of(unreadable)) is None        # unknown driver: nothing pruned
    with _DpkgLocks(root):
        assert source_fetch.prune_installed(host, world_of(dict(driver=drv, kernels=kernels))) is None   # apt runs
    assert source_fetch.prune_installed(host, world_of(dict(driver=drv, kernels=kernels)))["removed"] == ["580.142"]
    # the source package got installed meanwhile (/usr/src/nvidia-<v>): the cached copy goes too
    nvidia_tree(root / f"usr/src/nvidia-{V}", V)
    assert source_fetch.prune_installed(host, world_of(dict(driver=drv, kernels=kernels)))["removed"] == [V]


# --- the daemon runs a deferred fetch once apt has exited (service/daemon.py, service/monitor.py) ------------

needs_gi = pytest.mark.needs_modules("gi")   # python3-gi: the daemon's main loop


@needs_gi
def test_daemon_polls_dpkg_lock_then_reconciles_once(tmp_path, monkeypatch):
    from gi.repository import GLib
    from spark_memsaver.act import source_fetch
    from spark_memsaver.service.daemon import Daemon
    root = tmp_path / "root"
    (root / "var/lib/dpkg").mkdir(parents=True)
    d = Daemon(root=str(root))
    asked = []
    monkeypatch.setattr(d, "request_reconcile", lambda why: asked.append(why))
    d.arm_deferred_fetch()
    assert d._fetch_timer is None                                   # nothing pending: no timer at all
    source_fetch.defer(d.host, V, "K", "apt holds its locks")
    d.arm_deferred_fetch()
    assert d._fetch_timer is not None
    GLib.source_remove(d._fetch_timer)
    with _DpkgLocks(root):
        assert d.poll_deferred_fetch() is True and asked == []      # apt/dpkg still run: keep polling
    assert d.poll_deferred_fetch() is False and len(asked) == 1     # apt exited: one reconcile
    assert d._fetch_timer is None
    source_fetch.clear_pending(d.host)
    assert d.poll_deferred_fetch() is False and len(asked) == 1     # consumed meanwhile: nothing more


@needs_gi
def test_monitor_wakes_on_the_pending_record_only(tmp_path):
    from gi.repository import Gio, GLib
    from spark_memsaver.service.monitor import Monitor
    root = tmp_path / "root"
    cache = root / paths.CACHE_DIR.lstrip("/")
    cache.mkdir(parents=True)
    m = Monitor.__new__(Monitor)
    m.host, m._changed_paths, m._settle = Host(root), [], None
    f = lambda name: Gio.File.new_for_path(str(cache / name))   # noqa: E731
    E = Gio.FileMonitorEvent
    m._on_file_changed(None, f("sources"), None, E.CREATED)                          # a fetch's own files
    m._on_file_changed(None, f(".sources-pending.json.ab12.tmp"), None, E.CREATED)
    m._on_file_changed(None, f("sources-pending.json"), None, E.DELETED)             # consumed
    assert m._changed_paths == [] and m._settle is None
    m._on_file_changed(None, f(".sources-pending.json.ab12.tmp"), f("sources-pending.json"), E.RENAMED)
    assert len(m._changed_paths) == 1 and m._settle is not None
    GLib.source_remove(m._settle)


@needs_apt
def test_reconcile_outside_apt_consumes_the_pending_record(tmp_path, repo):
    from spark_memsaver.act import source_fetch
    from spark_memsaver.observe import sources as osrc
    root = apt_root(tmp_path / "root", repo)
    host = Host(root)
    source_fetch.defer(host, V, "K", "apt holds its locks")
    drv, kernels = driver_kernels(V)
    with _DpkgLocks(root):
        source_fetch.prune_installed(host, world_of(dict(driver=drv, kernels=kernels)))
        assert osrc.pending(host) is not None                       # apt still runs: kept
    source_fetch.prune_installed(host, world_of(dict(driver=drv, kernels=kernels)))
    assert osrc.pending(host) is None


# --- status on a Spark-shaped root with precompiled modules and no source (issue #14, "what must be shown") ---

def _cli(*args):
    repo_root = Path(__file__).resolve().parents[1]
    e = dict(os.environ, PYTHONPATH=str(repo_root / "daemon"))
    e.pop("SPARK_MEMSAVER_CONFIG", None)
    return subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", *args], capture_output=True, text=True,
                          env=e, timeout=120)


@needs_apt
@pytest.mark.needs("depmod", "gcc")   # the Spark root
def test_status_spark_root_without_source_then_fetched(tmp_path):
    import jsonschema
    from tests.support import sparkroot
    from spark_memsaver.act import source_fetch
    drv = sparkroot.DRIVER
    root = sparkroot.make_spark_root(tmp_path / "spark")
    shutil.rmtree(root / f"usr/src/nvidia-{drv}")                  # precompiled modules, no source package
    r = tmp_path / "repo"
    r.mkdir()
    os.chmod(tmp_path, 0o755)
    ubu = f"{drv}-0ubuntu0.24.04.1"
    make_deb(r, PKG, ubu, drv)
    index(r)
    apt_root(root, r)
    schema = json.loads((Path(__file__).resolve().parents[1] / "daemon/spark_memsaver/report/status.schema.json")
                        .read_text())
    conf = tmp_path / "never.yaml"
    conf.write_text("source_fetch: never\n")
    p = _cli("--root", str(root), "--config", str(conf), "status", "--json", "--direct")
    assert "Traceback" not in p.stderr, p.stderr
    doc = json.loads(p.stdout)
    jsonschema.validate(doc, schema)
    e = doc["driver_sources"]["by_driver"][drv]
    assert e["present"] is False and e["fetchable"] is False and e["remedy"] == f"sudo apt-get install {PKG}={ubu}"
    assert doc["driver_sources"]["cache"] == {"dir": paths.SOURCES_CACHE, "bytes": 0, "entries": []}
    # fetched (what the fetch-source step does): status shows the cached tree and its size, in text and JSON
    source_fetch.fetch(Host(root), cfg.Config(), drv)
    p = _cli("--root", str(root), "status", "--json", "--direct")
    doc = json.loads(p.stdout)
    jsonschema.validate(doc, schema)
    assert {"version": drv, "path": paths.source_tree(drv), "open": True, "origin": "cache"} in doc["driver"]["sources"]
    assert doc["driver_sources"]["by_driver"][drv]["present"] is True
    assert doc["driver_sources"]["cache"]["entries"][0]["deb_version"] == ubu
    text = _cli("--root", str(root), "status", "--direct", "--verbose").stdout   # internals: --verbose (issue 27)
    assert f"{drv} (fetched" in text and f"1 tree ({drv} from {PKG} {ubu})" in text


@needs_apt
def test_apt_read_is_memoised_and_follows_apt_get_update(tmp_path, repo):
    """The lists read is memoised in the cache (keyed by the lists' and dpkg status's mtimes): an unchanged
    APT state is not read again, and an 'apt-get update' that brings the version is seen at once."""
    import time as _t
    from spark_memsaver.observe import sources as osrc
    root = apt_root(tmp_path / "root", repo)
    (root / paths.SOURCES_CACHE.lstrip("/")).mkdir(parents=True)
    host = Host(root)
    drv, kernels = driver_kernels("580.999.01")
    t0 = _t.monotonic()
    assert world.driver_sources(host, cfg.Config(), drv, kernels)["by_driver"]["580.999.01"]["in_lists"] is False
    cold = _t.monotonic() - t0
    assert (root / paths.SOURCES_CACHE.lstrip("/") / osrc.MEMO).is_file()
    calls = []
    real_run = host.runner.run
    host.runner.run = lambda argv, **kw: (calls.append(argv[0]), real_run(argv, **kw))[1]
    t0 = _t.monotonic()
    world.driver_sources(host, cfg.Config(), drv, kernels)
    warm = _t.monotonic() - t0
    assert "apt-cache" not in calls, calls
    make_deb(repo, PKG, "580.999.01-0ubuntu1", "580.999.01")
    index(repo)
    update(root)
    e = world.driver_sources(host, cfg.Config(), drv, kernels)["by_driver"]["580.999.01"]
    assert e["in_lists"] is True and e["deb_version"] == "580.999.01-0ubuntu1"
    print(f"apt lists read: cold {cold * 1000:.0f} ms, memoised {warm * 1000:.0f} ms")


@needs_apt
def test_real_debian_nvidia_package_fetched_into_a_buildable_tree(tmp_path):
    """Debian's real nvidia-open-kernel-dkms 550.163.01 (tests/support/nvsrc.py's cached download) served from a
    local repository: the fetched tree is what the build accepts (act/dkms_run.find_driver_source: version,
    conftest lists) and the manifest's patch applies to it with zero fuzz (act/patch.check_source)."""
    from tests.support import nvsrc
    from spark_memsaver.act import patch as uvm_patch, source_fetch
    from spark_memsaver.act.dkms_run import find_driver_source
    v = "550.163.01"
    nvsrc.nvidia_source(v)
    debs = sorted((nvsrc.cache_dir() / "debs").glob(f"nvidia-open-kernel-dkms_{v}-*_*.deb"))
    if not debs:
        needs.absent(f"nvidia-open-kernel-dkms_{v} .deb in nvsrc's cache", "nvsrc downloads it with the tree")
    r = tmp_path / "repo"
    r.mkdir()
    os.chmod(tmp_path, 0o755)
    try:
        os.link(debs[-1], r / debs[-1].name)
    except OSError:
        shutil.copyfile(debs[-1], r / debs[-1].name)
    index(r)
    root = apt_root(tmp_path / "root", r, os_id="debian")
    (root / "etc/apt/apt.conf.d/99arch").write_text('APT::Architecture "amd64";\nAPT::Architectures { "amd64"; };\n')
    update(root)
    host = Host(root)
    res = source_fetch.fetch(host, cfg.Config(), v)
    assert res["package"] == "nvidia-open-kernel-dkms" and res["deb_version"] == debs[-1].name.split("_")[1]
    assert find_driver_source(host, v) == paths.source_tree(v)
    chk = uvm_patch.check_source(host.path(paths.source_tree(v)), runner=host.runner)
    assert chk["version"] == v and chk["qualification"] == "nvidia-tests", chk   # raises if it does not apply


@needs_gi
def test_monitor_real_inotify_sees_the_pending_record(tmp_path):
    """The real Gio file monitor on the cache directory: defer()'s atomic write (temp file renamed into place)
    arrives as an event the monitor keeps; the fetch's own files in the cache do not."""
    import time as _t
    from gi.repository import GLib
    from spark_memsaver.act import source_fetch
    from spark_memsaver.service.monitor import Monitor
    root = tmp_path / "root"
    (root / paths.CACHE_DIR.lstrip("/")).mkdir(parents=True)
    m = Monitor.__new__(Monitor)
    m.host, m._changed_paths, m._settle, m._file_monitors = Host(root), [], None, []
    m._start_file_monitors()
    ctx = GLib.MainContext.default()

    def pump(seconds):
        end = _t.monotonic() + seconds
        while _t.monotonic() < end:
            ctx.iteration(False)
            _t.sleep(0.02)
    try:
        (root / paths.SOURCES_CACHE.lstrip("/")).mkdir()
        (root / paths.SOURCES_CACHE.lstrip("/") / ".staging-x").mkdir()
        pump(1.0)
        assert m._changed_paths == []
        source_fetch.defer(m.host, V, "K", "apt holds its locks")
        pump(2.0)
        assert m._changed_paths, "no event for the pending record"
    finally:
        if m._settle is not None:
            GLib.source_remove(m._settle)
        for fm in m._file_monitors:
            fm.cancel()


@needs_apt
def test_file_system_error_is_named_and_nothing_kept(tmp_path, repo):
    """A cache that cannot be written (here: a file where the cache directory should be) is a named error."""
    from spark_memsaver.act import source_fetch
    from spark_memsaver.errors import SourceFetchError
    root = apt_root(tmp_path / "root", repo)
    (root / paths.CACHE_DIR.lstrip("/")).mkdir(parents=True)
    (root / paths.SOURCES_CACHE.lstrip("/")).write_text("not a directory\n")
    with pytest.raises(SourceFetchError) as ei:
        source_fetch.fetch(Host(root), cfg.Config(), V)
    assert ei.value.code == "source-fetch-failed" and "nothing was kept" in ei.value.message
    assert ei.value.remedy.startswith("Check the free space and permissions")


@needs_apt
def test_real_dpkg_maintainer_script_defers_the_fetch(tmp_path, repo):
    """The door as dpkg really runs it: a package's postinst (dpkg holds its lock and lock-frontend, as in the
    dpkg trigger and the kernel hooks) runs the fetch-source step; it defers, nothing is fetched. Once dpkg has
    exited the same step fetches."""
    import sys
    from spark_memsaver.observe import sources as osrc
    root = apt_root(tmp_path / "root", repo)
    admin = root / "var/lib/dpkg"
    out = tmp_path / "step.json"
    repo_root = Path(__file__).resolve().parents[1]
    probe = tmp_path / "probe"
    (probe / "DEBIAN").mkdir(parents=True)
    (probe / "DEBIAN/control").write_text("Package: spark-memsaver-probe\nVersion: 1\nArchitecture: all\n"
                                          "Maintainer: t <t@example.invalid>\nDescription: door probe\n")
    code = ("import json, sys; from spark_memsaver.host import Host; from spark_memsaver.act import steps; "
            "from spark_memsaver.decide import plan; from spark_memsaver import config; "
            f"d = steps.execute(Host({str(root)!r}), config.Config(), "
            f"[plan.Step('fetch-source', 'K', 'r', driver_to={V!r})], snap=None); "
            f"open({str(out)!r}, 'w').write(json.dumps(d))")
    (probe / "DEBIAN/postinst").write_text(f"#!/bin/sh\nset -e\n[ \"$1\" = configure ] || exit 0\n"
                                           f"PYTHONPATH={repo_root / 'daemon'} {sys.executable} -c \"{code}\"\n")
    os.chmod(probe / "DEBIAN/postinst", 0o755)
    deb = tmp_path / "probe.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(probe), str(deb)], check=True,
                   capture_output=True)
    env = {k: v for k, v in os.environ.items() if k != "DPKG_FRONTEND_LOCKED"}
    p = subprocess.run(["dpkg", f"--admindir={admin}", "--log=/dev/null", "--force-not-root", "-i", str(deb)],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    done = json.loads(out.read_text())
    assert done[0]["result"].get("deferred") is True, done
    assert "dpkg" in done[0]["result"]["reason"] or "apt" in done[0]["result"]["reason"]
    assert osrc.pending(Host(root))["drivers"] == [V]
    assert not (root / paths.source_tree(V).lstrip("/")).exists()
