"""`--all` is the per-kernel operation for each kernel (issue 34, item 2): install and remove choose, refuse,
plan and act for each kernel of --all exactly as --kernel K does, and print one row per kernel."""

from __future__ import annotations

import json

import pytest

from tests.support import sparkroot
from tests.support.inproc import cli

K = sparkroot.SPARK_KERNEL
K2 = "6.14.0-1020-nvidia-64k"


def _json(*args):
    code, out, err = cli(*args, "--json")
    return code, json.loads(out or "{}"), err


def test_remove_all_removes_an_override_not_registered_in_dkms(tmp_path):
    """The README's way back on a node whose override is installed but not registered in DKMS: 'remove --all'
    printed 'nothing was installed', exited 0 and left ours installed and selected (its plan was only the
    hold); 'remove' for that kernel removed it."""
    root = str(sparkroot.make_spark_root(tmp_path / "r", ours_installed="580.142"))
    code, plan, _ = _json("--root", root, "remove", "--all", "--dry-run")
    assert code == 0 and [s["action"] for s in plan["steps"]] == ["hold", "restore-stock", "depmod", "initramfs"]
    code, out, err = cli("--root", root, "remove", "--all")
    assert code == 0, err
    assert "nothing was installed" not in out and K in out and "stock selected" in out, out
    _, doc, _ = _json("--root", root, "status")
    assert doc["state"] == "stock", doc["state"]
    assert not doc["kernels"][0]["uvm_selected"]["patched"], doc["kernels"][0]


@pytest.mark.parametrize("installed", [None, "580.142"])
def test_remove_all_plans_each_kernel_as_remove_kernel(tmp_path, installed):
    root = str(sparkroot.make_spark_root(tmp_path / "r", ours_installed=installed, extra_kernels=(K2,)))
    _, every, _ = _json("--root", root, "remove", "--all", "--dry-run")
    one = []
    for k in (K, K2):
        _, p, _ = _json("--root", root, "remove", "--kernel", k, "--dry-run")
        assert p["steps"][0]["action"] == "hold" and p["steps"][0]["kernel"] == k
        one += p["steps"][1:]
    assert every["steps"][0] == {**every["steps"][0], "action": "hold", "kernel": None}
    assert every["steps"][1:] == one


def test_install_all_judges_each_kernel_as_install_kernel(tmp_path):
    """install --all picked kernels by its own rules (headers, policy, nvidia.ko) and refused none: a kernel
    that --kernel K refuses (a driver source missing, say) was built and failed midway. Now each kernel is
    the one installability decision: a refused one is a row with the code and remedy --kernel K gives."""
    root = sparkroot.make_spark_root(tmp_path / "r", extra_kernels=(K2,))
    (root / f"lib/modules/{K2}/build").unlink()                     # K2: no headers
    code, one, _ = _json("--root", str(root), "install", "--kernel", K2, "--dry-run")
    assert code == 1 and one["error"]["code"] == "headers-missing", one
    code, every, _ = _json("--root", str(root), "install", "--all", "--dry-run")
    assert code == 0, every
    assert every["skipped"] == [{"kernel": K2, "code": "headers-missing", "reason": every["skipped"][0]["reason"],
                                 "remedy": one["error"]["remedy"]}], every["skipped"]
    _, k1, _ = _json("--root", str(root), "install", "--kernel", K, "--dry-run")
    assert every["steps"] == k1["steps"]


def test_install_all_on_a_node_where_no_kernel_can_refuses_as_install_kernel(tmp_path):
    root = str(sparkroot.make_spark_root(tmp_path / "r", headers=False))
    a = _json("--root", root, "install", "--all", "--dry-run")
    b = _json("--root", root, "install", "--kernel", K, "--dry-run")
    assert a[0] == b[0] == 1 and a[1]["error"] == b[1]["error"], (a, b)
    real = _json("--root", root, "install", "--all")
    assert real[0] == 1 and real[1]["error"] == b[1]["error"], real


def test_build_all_judges_each_kernel_as_build_kernel(tmp_path):
    """build had no --all (install and remove did): a node's kernels were built one '--kernel K' at a time. Now
    build --all is build --kernel K for each kernel: the same plan, a refused kernel a row with the code and
    remedy --kernel K gives; --all with --kernel or --driver is bad usage (exit 2)."""
    root = sparkroot.make_spark_root(tmp_path / "r", extra_kernels=(K2,))
    (root / f"lib/modules/{K2}/build").unlink()                     # K2: no headers
    code, one, _ = _json("--root", str(root), "build", "--kernel", K2, "--dry-run")
    assert code == 1 and one["error"]["code"] == "headers-missing", one
    code, every, _ = _json("--root", str(root), "build", "--all", "--force", "--dry-run")
    assert code == 0, every
    assert every["skipped"] == [{"kernel": K2, "code": "headers-missing", "reason": every["skipped"][0]["reason"],
                                 "remedy": one["error"]["remedy"]}], every["skipped"]
    _, k1, _ = _json("--root", str(root), "build", "--kernel", K, "--force", "--dry-run")
    assert every["steps"] == k1["steps"] and [s["action"] for s in k1["steps"]] == ["build"], (every, k1)
    for bad in (("--kernel", K), ("--driver", sparkroot.DRIVER)):
        code, doc, _ = _json("--root", str(root), "build", "--all", *bad, "--dry-run")
        assert code == 2 and doc["error"]["code"] == "usage", doc


def test_build_all_on_a_node_where_no_kernel_can_refuses_as_build_kernel(tmp_path):
    root = str(sparkroot.make_spark_root(tmp_path / "r", headers=False, extra_kernels=(K2,)))
    a = _json("--root", root, "build", "--all", "--dry-run")
    b = _json("--root", root, "build", "--kernel", K, "--dry-run")
    assert a[0] == b[0] == 1 and a[1]["error"] == b[1]["error"], (a, b)
    real = _json("--root", root, "build", "--all")
    assert real[0] == 1 and real[1]["error"] == b[1]["error"], real
    assert cli("--root", root, "build", "--kernel", K) == cli("--root", root, "build", "--all")   # said alike
