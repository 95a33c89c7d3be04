"""The APT door's .deb reader streams `dpkg-deb --fsys-tarfile` (act/apt_facts.py over host/runner.Runner.stream).

Real parts: .debs built with the real dpkg-deb (-b), a real ELF nvidia.ko with a real .modinfo
(tests/support/sparkroot.py), read with the real modinfo. Before: the whole uncompressed archive was held in
memory (then a copy of each .ko) and only then compared with the 1 GiB cap, inside apt's own transaction.
"""

from __future__ import annotations

import subprocess
import time
import tracemalloc
from pathlib import Path

import pytest

from spark_memsaver.act import apt_facts
from spark_memsaver.host import Host
from spark_memsaver.host.runner import Runner
from tests.support import sparkroot

pytestmark = pytest.mark.lifecycle

K = sparkroot.SPARK_KERNEL
KO = f"lib/modules/{K}/kernel/nvidia-580-open/nvidia.ko"
ARCH = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True).stdout.strip()


def _deb(tmp: Path, filler_mib: int, filler_first: bool = True) -> Path:
    tree = tmp / "tree"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN/control").write_text(f"Package: linux-modules-nvidia-580-open-{K}\nVersion: 1\n"
                                         f"Architecture: {ARCH}\nMaintainer: t <t@example.org>\nDescription: t\n")
    ko = tree / KO
    ko.parent.mkdir(parents=True)
    sparkroot.make_module(ko, [("version", "580.159"), ("license", "Dual MIT/GPL"), ("name", "nvidia"),
                               ("vermagic", f"{K} SMP mod_unload modversions")])
    big = tree / ("lib/aaa-firmware.bin" if filler_first else "usr/zzz-firmware.bin")   # dpkg-deb sorts by name
    big.parent.mkdir(parents=True, exist_ok=True)
    with open(big, "wb") as f:
        f.truncate(filler_mib << 20)                  # zeros: a small .deb, a large tar stream
    deb = tmp / "m.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-z1", "-b", str(tree), str(deb)], check=True,
                   capture_output=True)
    return deb


def test_versions_are_read_from_the_stream_without_holding_it(tmp_path):
    deb = _deb(tmp_path, 48)
    tracemalloc.start()
    try:
        got = apt_facts.nvidia_ko_versions(Host("/"), str(deb), {K: "/" + KO})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == {K: "580.159"}
    assert peak < 8 << 20, f"peak {peak >> 20} MiB of Python memory for a 48 MiB archive"


def test_the_cap_is_enforced_while_reading(tmp_path):
    deb = _deb(tmp_path, 4)
    t0 = time.monotonic()
    assert apt_facts.nvidia_ko_versions(Host("/"), str(deb), {K: "/" + KO}, limit=1 << 20) == {}
    assert time.monotonic() - t0 < 30
    # the same archive under a cap it fits in; and a .ko before the filler is read before the cap matters
    assert apt_facts.nvidia_ko_versions(Host("/"), str(deb), {K: "/" + KO}, limit=8 << 20) == {K: "580.159"}
    deb2 = _deb(tmp_path / "b", 4, filler_first=False)
    assert apt_facts.nvidia_ko_versions(Host("/"), str(deb2), {K: "/" + KO}, limit=1 << 20) == {K: "580.159"}
    # deb_facts over it: the fact is left out, never a guess (the door then counts the driver unknown)
    f = apt_facts.deb_facts(Host("/"), str(deb))
    assert f["readable"] and f["nvidia_ko"] == {K: "580.159"}


def _sparse_deb(tmp: Path, fmt: str, hole_mib: int = 300) -> Path:
    """A .deb whose data.tar (GNU tar --sparse, ``fmt``) carries the nvidia.ko as a sparse member: a real ELF
    module followed by a ``hole_mib`` MiB hole the archive does not store (a ~20 KiB .deb). Put together with ar
    as dpkg-deb lays one out (dpkg-deb -b never writes sparse members)."""
    tree = tmp / "data"
    ko = tree / KO
    ko.parent.mkdir(parents=True)
    sparkroot.make_module(ko, [("version", "580.159"), ("license", "Dual MIT/GPL"), ("name", "nvidia"),
                               ("vermagic", f"{K} SMP mod_unload modversions")])
    with open(ko, "r+b") as f:
        f.truncate(ko.stat().st_size + (hole_mib << 20))
    (tmp / "ctl").mkdir()
    (tmp / "ctl/control").write_text(f"Package: linux-modules-nvidia-580-open-{K}\nVersion: 1\n"
                                     f"Architecture: {ARCH}\nMaintainer: t <t@example.org>\nDescription: t\n")
    subprocess.run(["tar", "-czf", str(tmp / "control.tar.gz"), "-C", str(tmp / "ctl"), "./control"], check=True)
    subprocess.run(["tar", "--sparse", f"--format={fmt}", "--owner=0", "--group=0", "-cf", str(tmp / "data.tar"),
                    "-C", str(tree), "./" + KO], check=True)
    (tmp / "debian-binary").write_text("2.0\n")
    deb = tmp / "sparse.deb"
    subprocess.run(["ar", "rc", str(deb), "debian-binary", "control.tar.gz", "data.tar"], cwd=tmp, check=True)
    return deb


@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_a_sparse_member_is_refused_before_it_is_written(tmp_path, fmt, monkeypatch):
    """A ~20 KiB .deb whose nvidia.ko is a sparse member of 300 MiB (GNU and pax sparse formats): before,
    the copy wrote 300 MiB of zeros to a temporary file as root inside apt's transaction (the 1 GiB cap counted
    only the archive's bytes). Now the member is refused unread: no version (the door counts the driver
    unknown), and nothing is written to the temporary directory."""
    deb = _sparse_deb(tmp_path, fmt)
    assert deb.stat().st_size < 64 << 10
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    assert KO in listing                    # dpkg-deb reads it as a package
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(apt_facts.tempfile, "tempdir", str(scratch))
    written = []
    real = apt_facts._modinfo_version
    monkeypatch.setattr(apt_facts, "_modinfo_version", lambda *a, **kw: written.append(a[2]) or real(*a, **kw))
    assert apt_facts.nvidia_ko_versions(Host("/"), str(deb), {K: "/" + KO}) == {}
    assert written == [] and list(scratch.iterdir()) == []
    f = apt_facts.deb_facts(Host("/"), str(deb))
    assert f["readable"] and f.get("nvidia_ko", {}) == {}


def test_a_member_over_the_member_cap_is_refused_and_the_copy_is_capped(tmp_path):
    """A wanted member larger than member_limit is refused by its size before anything is copied; and the copy
    itself stops at the cap whatever the member claims (here a reader without end: /dev/zero)."""
    deb = _deb(tmp_path, 1)
    assert apt_facts.nvidia_ko_versions(Host("/"), str(deb), {K: "/" + KO}, member_limit=1024) == {}
    assert apt_facts.nvidia_ko_versions(Host("/"), str(deb), {K: "/" + KO}) == {K: "580.159"}
    with open("/dev/zero", "rb") as endless, pytest.raises(apt_facts.TarTooLarge):
        apt_facts._modinfo_version(Host("/"), endless, "nvidia.ko", limit=3 << 20)


def test_a_damaged_deb_is_no_version(tmp_path):
    deb = _deb(tmp_path, 1)
    data = deb.read_bytes()
    (tmp_path / "torn.deb").write_bytes(data[: len(data) // 2])
    assert apt_facts.nvidia_ko_versions(Host("/"), str(tmp_path / "torn.deb"), {K: "/" + KO}) == {}


def test_stream_kills_the_group_at_the_timeout_and_when_left_early():
    t0 = time.monotonic()
    with Runner().stream(["sh", "-c", "yes | cat"], timeout=1) as st:
        n = 0
        while chunk := st.stdout.read(1 << 16):
            n += len(chunk)
    assert st.returncode == -9 and st.timed_out and n > 0 and time.monotonic() - t0 < 10
    t0 = time.monotonic()
    with Runner().stream(["sh", "-c", "yes | cat"], timeout=60) as st:
        assert st.stdout.read(10) == b"y\ny\ny\ny\ny\n"
    assert st.returncode == -9 and not st.timed_out and time.monotonic() - t0 < 10
    with Runner().stream(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=60) as st:
        assert st.stdout.read() == b"out\n"
    assert st.returncode == 3 and st.stderr == "err\n"
