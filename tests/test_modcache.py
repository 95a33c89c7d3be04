"""observe/modcache.py: an inspection asks kmod (`modinfo -k`) again only when something kmod reads changed
(issue 38); a verification after a change always asks; a cache that others could have written is not believed.
Real modinfo and depmod over a Spark-shaped root (tests/support/sparkroot.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from spark_memsaver.host import Host
from spark_memsaver.host.runner import Runner
from spark_memsaver.observe import modcache, modules
from tests.support import sparkroot

pytestmark = pytest.mark.needs("modinfo", "depmod")
K = sparkroot.SPARK_KERNEL


class CountingRunner(Runner):
    """The real runner, counting the modinfo calls it makes."""

    def __init__(self):
        super().__init__()
        self.modinfo = 0

    def run(self, argv, **kw):
        if argv and os.path.basename(argv[0]) == "modinfo":
            self.modinfo += 1
        return super().run(argv, **kw)


@pytest.fixture
def spark(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "root", ours_installed=sparkroot.DRIVER)
    (root / "var/cache/spark-memsaver").mkdir(parents=True)      # the package's cache directory
    return root


def _read(root, runner, name=modules.UVM, **kw):
    return modules.read_selected(Host(str(root), runner=runner), K, name, cached=True, **kw)


def test_second_inspection_asks_kmod_nothing_and_answers_the_same(spark):
    r = CountingRunner()
    first = _read(spark, r)
    assert r.modinfo == 1 and first["state"] == "ours"
    again = _read(spark, r)
    assert r.modinfo == 1 and again == first
    assert json.loads((spark / "var/cache/spark-memsaver/modinfo.json").read_text())["format"] == modcache.FORMAT
    assert _read(spark, r, digest=True)["sha256"]          # the digest is of the file now, never kept
    assert r.modinfo == 1


def test_a_verification_always_asks_kmod(spark):
    r = CountingRunner()
    _read(spark, r)
    modules.read_selected(Host(str(spark), runner=r), K)           # act/'s call: cached=False
    assert r.modinfo == 2


@pytest.mark.parametrize("change", ["depmod", "module-replaced", "modprobe-d", "module-removed"])
def test_what_kmod_reads_changing_asks_again(spark, change):
    r = CountingRunner()
    assert _read(spark, r)["state"] == "ours"
    ours = spark / f"lib/modules/{K}/updates/dkms/nvidia-uvm.ko"
    if change == "depmod":
        os.utime(spark / f"lib/modules/{K}/modules.dep.bin", ns=(1, 1))
    elif change == "module-replaced":          # same name, another file: the selection's file stat differs
        tmp = ours.with_suffix(".new")
        shutil.copy(spark / f"lib/modules/{K}/kernel/nvidia-580-open/nvidia-uvm.ko", tmp)
        os.replace(tmp, ours)
    elif change == "modprobe-d":
        d = spark / "etc/modprobe.d"
        d.mkdir(parents=True, exist_ok=True)
        (d / "x.conf").write_text("# a new rule\n")
    else:
        ours.unlink()
        import subprocess
        subprocess.run(["depmod", "-b", str(spark), K], check=True)
    after = _read(spark, r)
    assert r.modinfo == 2
    if change == "module-replaced":
        assert after["state"] == "stock"
    if change == "module-removed":
        assert after["state"] == "stock" and "updates" not in after["path"]


def test_a_cache_others_could_write_is_not_believed(spark):
    r = CountingRunner()
    _read(spark, r)
    f = spark / "var/cache/spark-memsaver/modinfo.json"
    kept = json.loads(f.read_text())
    (entry,) = [e for k, e in kept["entries"].items() if k.endswith("\0nvidia_uvm")]
    entry["answer"]["state"] = "stock"                         # a forged answer
    f.write_text(json.dumps(kept))
    os.chmod(f, 0o666)
    assert _read(spark, r)["state"] == "ours" and r.modinfo == 2
    assert f.stat().st_mode & 0o777 == 0o644                    # asked again, and kept again, root's alone
    os.chmod(f.parent, 0o777)
    assert _read(spark, r)["state"] == "ours" and r.modinfo == 3    # nor in a directory others can write


@pytest.mark.parametrize("text", ["", "{", "[]", '{"format": 1, "entries": []}', '{"format": 2, "entries": {}}'])
def test_a_damaged_cache_is_asked_around(spark, text):
    r = CountingRunner()
    f = spark / "var/cache/spark-memsaver/modinfo.json"
    f.write_text(text)
    assert _read(spark, r)["state"] == "ours" and r.modinfo == 1
    assert _read(spark, r)["state"] == "ours" and r.modinfo == 1   # rewritten whole by the first


def test_unreadable_answers_and_a_missing_cache_directory_keep_nothing(spark, tmp_path):
    class Broken(CountingRunner):
        def run(self, argv, **kw):
            if os.path.basename(argv[0]) == "modinfo":
                self.modinfo += 1
                raise OSError("modinfo hung")
            return super().run(argv, **kw)
    r = Broken()
    assert _read(spark, r)["state"] == "unreadable"
    assert not (spark / "var/cache/spark-memsaver/modinfo.json").exists()
    shutil.rmtree(spark / "var/cache/spark-memsaver")
    r = CountingRunner()
    _read(spark, r)
    assert not (spark / "var/cache/spark-memsaver").exists()          # never created here: the package's
