"""observe/modules.py: the ONE reader of "which nvidia-uvm does modprobe select for kernel K, and is it ours".

Real parts only: the module files are real ELF objects with a real .modinfo (tests/support/sparkroot.py),
modules.dep is written by the real depmod (with the fixture's depmod.d search order), and the reader runs the
real modinfo. The .ko.zst cases use the real zstd.
"""

from __future__ import annotations

import subprocess

import pytest

from spark_memsaver.act import override, steps
from spark_memsaver.host import Host
from spark_memsaver.observe import modules
from spark_memsaver.observe import snapshot as observe
from tests.support import needs, sparkroot

K = sparkroot.SPARK_KERNEL
STOCK = f"/lib/modules/{K}/kernel/nvidia-580-open/nvidia-uvm.ko"
OURS = f"/lib/modules/{K}/updates/dkms/nvidia-uvm.ko"


def depmod(root):
    """depmod for the fixture root; its own depmod.d when it has one (depmod -b reads the host's otherwise)."""
    conf = ["-C", str(root / "etc/depmod.d")] if (root / "etc/depmod.d").is_dir() else []
    subprocess.run(["depmod", "-b", str(root), *conf, K], check=True, capture_output=True)


def three_answers(host):
    """What observe (the snapshot), the install verification (act/override.py) and the lifecycle's check
    (act/steps.py) say about the same kernel: (state/ours seen by each)."""
    snap_k = next(k for k in observe.observe_kernels(host, "aarch64") if k["release"] == K)
    sel = snap_k["uvm_selected"]
    obs = bool(sel and sel.get("patched") and sel.get("patch_id") == modules.PATCH_ID)
    ver = override.verify_installed(host, K)
    ok_lc, info, _ = steps.ours_matches(host, K)
    return {"observe": obs, "verify": ver["ours"], "lifecycle": bool(info.get("patched")) and
            info.get("patch_id") == modules.PATCH_ID}, sel, ver, ok_lc


def test_stock_selected(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r")
    s = modules.selection(Host(root), K, digest=True)
    assert s["state"] == "stock" and s["path"] == STOCK and not s["ours"]
    assert s["version"] == sparkroot.DRIVER and s["srcversion"] == sparkroot.STOCK_UVM_SRCVERSION
    assert s["nvidia"]["state"] == "stock" and s["nvidia"]["version"] == sparkroot.DRIVER
    assert s["nvidia_beside"] is True and s["versions_match"] is True
    assert len(s["sha256"]) == 64


def test_ours_selected_over_stock_updates_first(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r", ours_installed="580.142")
    s = modules.selection(Host(root), K)
    assert s["state"] == "ours" and s["ours"] and s["path"] == OURS
    assert s["patch_id"] == "uvm-pt-pack/1" and s["signer"] == "spark-memsaver fixture signing key"
    assert s["vermagic"].split()[0] == K and "uvm_pt_pack" in s["parameters"]
    assert s["versions_match"] is True and s["nvidia_beside"] is False


def test_versions_mismatch_is_reported(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r", ours_installed="575.51.02")
    s = modules.selection(Host(root), K)
    assert s["state"] == "ours" and s["versions_match"] is False


def test_patched_but_not_ours(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r")
    fields = [f for f in sparkroot.uvm_fields("580.142", "X" * 23, K, ours=True) if f[0] != "spark_memsaver"]
    sparkroot.make_module(root / OURS.lstrip("/"), fields + [("spark_memsaver", "uvm-pt-pack/0")])
    depmod(root)
    s = modules.read_selected(Host(root), K)
    assert s["state"] == "patched" and not s["ours"] and s["patched"]


def test_not_found_is_none_not_unreadable(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r")
    s = modules.read_selected(Host(root), K, "no_such_module")
    assert s["state"] == "none" and s["path"] is None
    assert observe.module_info(Host(root), K, "no_such_module") is None


def test_ubuntu_search_order_and_zst(tmp_path):
    """Ubuntu's /etc/depmod.d/ubuntu.conf ('search updates ubuntu built-in'): a module in ubuntu/ wins over
    kernel/ (built-in); updates/ wins over both. Modules compressed with zstd (.ko.zst) are read."""
    needs.require("zstd", remedy="tools/deps/modules-reader.txt")
    root = sparkroot.make_spark_root(tmp_path / "r")
    sparkroot.write(root, "/etc/depmod.d/ubuntu.conf", "search updates ubuntu built-in\n")
    ub = root / f"lib/modules/{K}/ubuntu/nvidia-uvm.ko"
    sparkroot.make_module(ub, sparkroot.uvm_fields("580.142", "U" * 23, K, ours=False))
    subprocess.run(["zstd", "-q", "--rm", str(ub)], check=True)
    depmod(root)
    s = modules.read_selected(Host(root), K)
    assert s["state"] == "stock" and s["path"] == f"/lib/modules/{K}/ubuntu/nvidia-uvm.ko.zst", s
    assert s["srcversion"] == "U" * 23
    ours = root / OURS.lstrip("/")
    sparkroot.make_module(ours, sparkroot.uvm_fields("580.142", "O" * 23, K, ours=True))
    subprocess.run(["zstd", "-q", "--rm", str(ours)], check=True)
    depmod(root)
    s = modules.read_selected(Host(root), K)
    assert s["state"] == "ours" and s["path"] == OURS + ".zst"
    assert modules.read_file(Host(root), OURS + ".zst")["state"] == "ours"


def _corrupt_zst_selected(tmp_path):
    """Our module selected as .ko.zst, then its compressed data damaged: modinfo cannot decompress it."""
    root = sparkroot.make_spark_root(tmp_path / "r")
    ours = root / OURS.lstrip("/")
    sparkroot.make_module(ours, sparkroot.uvm_fields("580.142", "O" * 23, K, ours=True))
    subprocess.run(["zstd", "-q", "--rm", str(ours)], check=True)
    depmod(root)
    z = root / (OURS + ".zst").lstrip("/")
    data = bytearray(z.read_bytes())
    z.write_bytes(bytes(data[:4]) + b"\xff" * (len(data) - 4))  # zstd magic kept, frame garbage
    return root


def test_unreadable_is_never_stock(tmp_path):
    needs.require("zstd", remedy="tools/deps/modules-reader.txt")
    root = _corrupt_zst_selected(tmp_path)
    s = modules.selection(Host(root), K)
    assert s["state"] == "unreadable" and s["error"], s
    assert s["state"] != "stock" and not s["ours"] and s["versions_match"] is None
    d = observe.describe_module(observe.module_info(Host(root), K, "nvidia_uvm"))
    assert d is not None and d["path"] is None and d["state"] == "unreadable" and d["error"]
    assert modules.read_file(Host(root), OURS + ".zst")["state"] == "unreadable"


@pytest.mark.parametrize("case", ["stock", "ours", "mismatch", "unreadable"])
def test_observe_verify_and_lifecycle_agree(tmp_path, case):
    """observe, the install verification and the lifecycle's check give the same answer on one fixture."""
    if case == "unreadable":
        needs.require("zstd", remedy="tools/deps/modules-reader.txt")
        root = _corrupt_zst_selected(tmp_path)
    else:
        root = sparkroot.make_spark_root(tmp_path / "r", ours_installed={"stock": None, "ours": "580.142",
                                                                         "mismatch": "575.51.02"}[case])
    host = Host(root)
    answers, sel, ver, ok_lc = three_answers(host)
    want = case in ("ours", "mismatch")
    assert answers == {"observe": want, "verify": want, "lifecycle": want}, answers
    assert ok_lc is (case == "ours")
    if case == "unreadable":
        assert sel["state"] == "unreadable" and ver["state"] == "unreadable" and not ver["ok"]
        assert any("cannot be read" in p for p in ver["problems"])
    if case == "stock":
        assert sel["state"] == ver["state"] == "stock"
