"""Compile matrix, the part CI can obtain: the patched nvidia-uvm really built by uvm_patch/compile-matrix.sh

(a) x86_64 against Debian's linux-headers-amd64 with NVIDIA 535.261.03 / 550.163.01 / 555.58.02;
(b) arm64 with CONFIG_ARM64_64K_PAGES=y (cross-compiled, bookworm linux-source-6.1) with 550.163.01.

Each build is ~3 min on 2 cores. Compile-only: modpost runs with KBUILD_MODPOST_WARN=1 (nvidia.ko's
Module.symvers is not built here), so these modules prove compilation, never deployability.
By default only the patched tree is built and its warnings must not come from our code; set
SPARK_MEMSAVER_MATRIX_STOCK=1 to also build the stock tree and require no new warning at all.
The GitHub branches (580/590/595) are recorded in uvm_patch/COMPILE-MATRIX.md (session builds).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support import nvsrc

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "uvm_patch" / "compile-matrix.sh"

pytestmark = [pytest.mark.compile, pytest.mark.slow]


def _run_matrix(src: Path, kdir: Path, arch: str, out: Path) -> dict:
    env = dict(os.environ, JOBS=os.environ.get("SPARK_MEMSAVER_JOBS", "2"),
               STOCK=os.environ.get("SPARK_MEMSAVER_MATRIX_STOCK", "0"))
    p = subprocess.run([str(SCRIPT), str(src), str(kdir), arch, str(out)], capture_output=True, text=True,
                       env=env, timeout=3600)
    result = out / "result.json"
    assert result.exists(), f"no result.json; rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    doc = json.loads(result.read_text())
    tail = (out / "patched.log").read_text(errors="replace")[-3000:] if (out / "patched.log").exists() else ""
    assert p.returncode == 0 and doc["status"] == "pass", f"{p.stdout}\n{doc['failures']}\n{tail}"
    return doc


def _check(doc: dict, version: str, arch: str, out: Path) -> None:
    assert doc["version"] == version and doc["arch"] == arch
    assert doc["parms"] == ["uvm_pt_pack", "uvm_pt_pack_stats"]
    assert doc["spark_memsaver"] == "uvm-pt-pack/1"
    assert doc["module_version"] == version
    ko = out / "patched" / "nvidia-uvm.ko"
    parm = subprocess.run(["modinfo", "-F", "parm", str(ko)], capture_output=True, text=True, check=True).stdout
    assert "uvm_pt_pack:" in parm


@pytest.mark.parametrize("version", ["550.163.01", "535.261.03", "555.58.02"])
def test_x86_64_debian_headers(version, tmp_path):
    src = nvsrc.nvidia_source(version)
    krel, kdir = nvsrc.x86_headers()
    out = tmp_path / f"{version}-x86_64"
    doc = _run_matrix(src, kdir, "x86_64", out)
    _check(doc, version, "x86_64", out)
    assert doc["vermagic"].startswith(krel + " ")


def test_arm64_64k_pages_550(tmp_path):
    src = nvsrc.nvidia_source("550.163.01")
    tree = nvsrc.arm64_64k_tree()
    assert "CONFIG_ARM64_64K_PAGES=y" in (tree / ".config").read_text()
    out = tmp_path / "550.163.01-arm64"
    doc = _run_matrix(src, tree, "arm64", out)
    _check(doc, "550.163.01", "arm64", out)
    assert doc["arm64_64k_pages"] is True
    assert "aarch64" in doc["vermagic"]
