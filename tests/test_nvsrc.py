"""tests/support/nvsrc.py + nvshared.py: NVIDIA's r580-r595 trees come from the shared directory next to the
checkout, checked against its SHA256SUMS, unpacked once into the test cache under the cache's lock.

The synthetic tarballs below are built the way the shared ones are (``open-gpu-kernel-modules-<tag>/kernel-open``)
with a two-file tree: they stand in for NVIDIA's 1 MiB archives only to reach the refusals. The last test reads the
real shared directory: under tools/test (CI) every tag must be there and unpack to the version it is named after.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import threading
from pathlib import Path

import pytest

from tests.support import needs, nvshared, nvsrc


def _tarball(shared: Path, version: str, stated: str | None = None) -> Path:
    stated = stated or version
    files = {"Kbuild": f'ccflags-y += -DNV_VERSION_STRING=\\"{stated}\\"\n', "nvidia-uvm/uvm_mmu.c": "/* x */\n"}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tf:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"open-gpu-kernel-modules-{version}/kernel-open/{rel}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    p = shared / f"kernel-open-{version}.tar.xz"
    p.write_bytes(buf.getvalue())
    with open(shared / "SHA256SUMS", "a") as fh:
        fh.write(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n")
    return p


@pytest.fixture
def env(tmp_path, monkeypatch):
    shared, cache = tmp_path / "shared", tmp_path / "cache"
    shared.mkdir()
    monkeypatch.setenv(nvshared.SHARED_ENV, str(shared))
    monkeypatch.setenv("SPARK_MEMSAVER_TEST_CACHE", str(cache))
    return shared, cache


def test_a_listed_tarball_is_verified_unpacked_once_and_reused(env):
    shared, cache = env
    _tarball(shared, "580.1.2")
    assert nvsrc.shared_versions() == ["580.1.2"]
    tree = nvsrc.nvidia_source("580.1.2")
    assert tree == cache / "nv/580.1.2/kernel-open" and nvsrc.tree_version(tree) == "580.1.2"
    assert (tree / "nvidia-uvm/uvm_mmu.c").read_text() == "/* x */\n"
    assert "sha256" in (cache / "nv/580.1.2/.ready").read_text()
    (shared / "kernel-open-580.1.2.tar.xz").unlink()          # the cache answers from now on
    assert nvsrc.nvidia_source("580.1.2") == tree
    assert [p.name for p in cache.iterdir() if p.name.startswith(".nv-")] == []   # no half-done leftovers


def test_concurrent_callers_unpack_once(env):
    shared, cache = env
    _tarball(shared, "590.3.4")
    got = []
    ts = [threading.Thread(target=lambda: got.append(nvsrc.nvidia_source("590.3.4"))) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(set(got)) == 1 and len(got) == 4
    assert sorted(p.name for p in (cache / "nv").iterdir()) == ["590.3.4"]


def test_a_damaged_tarball_is_refused_and_nothing_is_cached(env):
    shared, cache = env
    p = _tarball(shared, "580.1.2")
    data = bytearray(p.read_bytes())
    data[-20] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(nvsrc.SourceUnavailable, match="sha256 .* SHA256SUMS says"):
        nvsrc.nvidia_source("580.1.2")
    assert not (cache / "nv/580.1.2").exists()


def test_a_tree_stating_another_version_is_refused(env):
    shared, cache = env
    _tarball(shared, "580.1.2", stated="580.9.9")
    with pytest.raises(nvsrc.SourceUnavailable, match="states NVIDIA 580.9.9, not 580.1.2"):
        nvsrc.nvidia_source("580.1.2")
    assert not (cache / "nv/580.1.2").exists()


def test_an_unlisted_version_says_where_to_put_it(env):
    shared, _ = env
    _tarball(shared, "580.1.2")
    with pytest.raises(nvsrc.SourceUnavailable, match=r"not in .*SHA256SUMS.*kernel-open-580\.7\.7\.tar\.xz"):
        nvsrc.nvidia_source("580.7.7")
    assert needs.environment_gap(nvsrc.SourceUnavailable("x")) == "x"   # a skip here, a failure in CI


def test_the_shared_directory_holds_every_github_tag():
    """The real ../shared/nvidia: it holds every GitHub tag the manifest lists exactly, and every tree its SHA256SUMS
    lists (the one list tests take their GitHub trees from) unpacks to itself."""
    if not nvsrc.shared_versions():
        needs.absent(f"NVIDIA's kernel-open trees in {nvsrc.shared_dir()}",
                     "a checkout's ../shared/nvidia/ holds them (README.md there)")
    assert set(nvsrc.manifest_github_versions()) <= set(nvsrc.shared_versions())
    for v in nvsrc.shared_versions():
        assert nvsrc.tree_version(nvsrc.nvidia_source(v)) == v


def test_manifest_github_versions_are_the_manifests():
    """What the manifest names exactly, less Debian's three: read from uvm_patch/manifest.yaml, not written here."""
    from spark_memsaver.act import patch as up

    listed = {v for e in up.load_manifest(Path(__file__).resolve().parents[1] / "uvm_patch").entries
              for v in e.versions or ()}
    assert set(nvsrc.manifest_github_versions()) == listed - set(nvsrc.DEBIAN_VERSIONS)
    assert "580.142" in nvsrc.manifest_github_versions() and "550.163.01" not in nvsrc.manifest_github_versions()


def test_headers_abi_of_debian_12_and_13():
    """linux-headers-amd64's Depends names the kernel ABI the DKMS tests build against: Debian 12 says
    linux-headers-6.1.0-57-amd64, Debian 13 linux-headers-6.12.117+deb13-amd64 (tools/test on a fresh Debian 13
    stopped every DKMS test with "cannot tell the kernel ABI": the pattern knew only the first form)."""
    assert nvsrc.headers_abi_of("linux-headers-6.1.0-57-amd64 (= 6.1.192-3)") == "6.1.0-57"
    assert nvsrc.headers_abi_of("linux-headers-6.12.117+deb13-amd64 (= 6.12.117-1)") == "6.12.117+deb13"
    assert nvsrc.headers_abi_of("linux-headers-6.12.117+deb13-cloud-amd64 (= 6.12.117-1)") is None
    assert nvsrc.headers_abi_of("") is None
