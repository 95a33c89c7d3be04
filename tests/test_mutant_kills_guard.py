"""The guard's decision (systemd/guard/uvm-guard) against the mutants a full run of tools/mutation-run left
alive (issue 29 item 3): each test runs the real guard under dash over a module tree depmod indexed (fake
modules: only their .modinfo, as in tests/test_lifecycle.py) and names the mutant it kills."""

from __future__ import annotations

import json

import pytest

from tests.support import sparkroot
from tests.test_lifecycle import K, _tree, guard, guard_log, inserted, p

pytestmark = pytest.mark.lifecycle
STOCK_RECORD = f"/var/lib/spark-memsaver/stock/{K}"


def test_the_recorded_stock_is_read_inside_the_module_tree(tmp_path):
    """The only stock nvidia-uvm of the driver has a file name no search finds (uvm-stock.ko); the record names it
    by its path on the node: the guard reads it under the module tree's base and inserts it. (Kills: rooted()'s
    ``[ -n "$B" ] && [ "$B" != / ]`` turned into ``= /`` or ``-z``, which read the node's own /lib/modules.)"""
    root = _tree(tmp_path, nv="555.58.02", stock_uvm=None, ours="550.163.01",
                 extra=[("updates/vendor/uvm-stock.ko", sparkroot.uvm_fields("555.58.02", "S", K, False))])
    sparkroot.write(root, STOCK_RECORD, f"/lib/modules/{K}/updates/vendor/uvm-stock.ko\n")
    r = guard(root)
    assert r.returncode == 0 and inserted(r) == [p(root, "updates/vendor/uvm-stock.ko")], r.stdout + r.stderr


def test_a_dkms_record_without_a_stock_path_is_not_complained_about(tmp_path):
    """A DKMS record with no stock_path field (nothing was recorded) is silently passed over; only a stock_path
    that is there and not absolute is reported. (Kills: ``sed -n ... p`` -> ``sed -z``, which printed the whole
    record and reported it as 'not absolute'.)"""
    root = _tree(tmp_path, nv="555.58.02", ours="550.163.01")
    sparkroot.write(root, f"/var/lib/spark-memsaver/dkms/{K}.json", json.dumps({"kernel": K}, indent=2))
    r = guard(root)
    assert inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")] and "DKMS record" not in guard_log(root)
    sparkroot.write(root, f"/var/lib/spark-memsaver/dkms/{K}.json", json.dumps({"stock_path": "lib/x.ko"}))
    guard(root)
    assert "holds a stock_path that is not absolute; not used" in guard_log(root)


def test_the_stock_beside_nvidia_ko_comes_before_any_other(tmp_path):
    """Two verified stock nvidia-uvm files of the driver: the one beside the nvidia.ko modprobe selects (the
    driver package's pair) is taken, not the first one a search of the tree finds (extra/ sorts first).
    (Kills: the ``modinfo -n nvidia`` lookup broken, ``-n`` -> ``-z``.)"""
    root = _tree(tmp_path, nv="555.58.02", ours="550.163.01",
                 extra=[("extra/nvidia-uvm.ko", sparkroot.uvm_fields("555.58.02", "E", K, False))])
    assert inserted(guard(root)) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")]


def test_ours_loaded_says_nothing(tmp_path):
    """Ours is selected for the driver beside it: modprobe loads it and the guard writes nothing to stderr (a
    boot's modprobe passes it on) nor to its log. (Kills: the pass-through of modprobe's stderr inverted,
    ``[ -n "$o_err" ] &&`` -> ``[ -z ...] &&`` or ``||``, which printed an empty line.)"""
    root = _tree(tmp_path, nv="550.163.01", stock_uvm="550.163.01", ours="550.163.01")
    r = guard(root)
    assert (r.returncode, inserted(r), r.stderr) == (0, [p(root, "updates/dkms/nvidia-uvm.ko")], "")
    assert guard_log(root) == ""


def test_a_pool_without_our_tag_is_not_stock(tmp_path):
    """The selected nvidia-uvm has the uvm_pt_pack parameter but no spark_memsaver tag (another build of the
    pool): it is patched, so not loaded as if it were stock; the verified stock is loaded by path instead.
    (Kills: ``[ -z "$i_tag" ] && [ -z "$i_pack" ]`` -> ``||``.)"""
    fields = [f for f in sparkroot.uvm_fields("555.58.02", "POOL", K, True) if f[0] != "spark_memsaver"]
    root = _tree(tmp_path, nv="555.58.02", ours=None, extra=[("updates/dkms/nvidia-uvm.ko", fields)])
    r = guard(root)
    assert r.returncode == 0 and inserted(r) == [p(root, "kernel/nvidia-open/nvidia-uvm.ko")], r.stdout + r.stderr
    assert "is patched but not by this spark-memsaver (tag ''" in r.stderr


def test_several_nvidia_modules_leave_the_driver_unknown(tmp_path):
    """modinfo names two modules for nvidia (two files carrying the alias, of different drivers): the driver
    beside is not known, so the guard refuses and inserts nothing. (Kills: ``read_info nvidia && [ "$i_n"
    -eq 1 ]`` -> ``||``, which took the first one's version.)"""
    nv = [("license", "Dual MIT/GPL"), ("name", "nvidia"), ("vermagic", f"{K} SMP"), ("alias", "nvidia")]
    root = _tree(tmp_path, nv=None, stock_uvm="550.163.01", ours="555.58.02",
                 extra=[("kernel/a/nvidia-a.ko", [("version", "550.163.01")] + nv),
                        ("kernel/b/nvidia-b.ko", [("version", "555.58.02")] + nv)])
    r = guard(root)
    assert r.returncode == 1 and inserted(r) == [], r.stdout + r.stderr
    assert "the nvidia driver version cannot be read" in r.stderr
