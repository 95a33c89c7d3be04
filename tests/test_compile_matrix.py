"""Compile matrix, the part CI can obtain: the patched nvidia-uvm really built by uvm_patch/compile-matrix.sh

(a) x86_64 against Debian's linux-headers-amd64 with NVIDIA 535.261.03 / 550.163.01 / 555.58.02 (Debian's) and
    580.142 (the shared directory's tree: the branch DGX Spark nodes run);
(b) arm64 with CONFIG_ARM64_64K_PAGES=y (cross-compiled, bookworm linux-source-6.1) with 550.163.01 and 580.142;
(c) Linux 7.x (tests/support/matrix7.py: a trixie build root, gcc-14, Debian's real linux-headers-7.3.4
    amd64 / arm64 / arm64-16k installed with apt, and a 64 KiB-page tree from linux-source-7.3):
    - CI: NVIDIA 550.163.01 (Debian's) on 7.3 amd64 as shipped: the stock tree fails (kernel APIs gone in
      7.x) and the patched tree fails with exactly the same errors, while our pool object compiles, also
      with W=1, without a warning ("stock-fails", exit 3);
    - slow (SPARK_MEMSAVER_MATRIX_7X=1; the shared directory's GitHub trees): r580/r590/r595 x the four
      7.x cells with OF_GPIO_SHIM=1, stock + patched: "pass", or "stock-fails" with identical error sets.

Each build is ~3 min on 2 cores. Compile-only: modpost runs with KBUILD_MODPOST_WARN=1 (nvidia.ko's
Module.symvers is not built here), so these modules prove compilation, never deployability.
By default only the patched tree is built and its warnings must not come from our code; set
SPARK_MEMSAVER_MATRIX_STOCK=1 to also build the stock tree and require no new warning at all.
CI builds r580 (580.142) in (a) and (b); every GitHub branch x cell is recorded in uvm_patch/COMPILE-MATRIX.md.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support import matrix7, needs, nvsrc

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "uvm_patch" / "compile-matrix.sh"

pytestmark = [pytest.mark.compile]


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


#: r580 is the DGX Spark branch: CI builds it for x86_64 and arm64 64 KiB; the other branches cost ~2 min (x86_64)
#: and ~8 min (arm64) each on CI's cold 2-core machine, so they are built by plain tools/test, not by CI
_OTHER = pytest.mark.ci_share("one more NVIDIA build; CI builds r580 (the DGX Spark branch)")


@pytest.mark.slow
@pytest.mark.parametrize("version", [pytest.param(v, marks=_OTHER) for v in ("550.163.01", "535.261.03", "555.58.02")]
                         + ["580.142"])
def test_x86_64_debian_headers(version, tmp_path):
    src = nvsrc.nvidia_source(version)
    krel, kdir = nvsrc.x86_headers()
    out = tmp_path / f"{version}-x86_64"
    doc = _run_matrix(src, kdir, "x86_64", out)
    _check(doc, version, "x86_64", out)
    assert doc["vermagic"].startswith(krel + " ")


@pytest.mark.slow
@pytest.mark.parametrize("version", [pytest.param("550.163.01", marks=_OTHER), "580.142"])
def test_arm64_64k_pages(version, tmp_path):
    src = nvsrc.nvidia_source(version)
    tree = nvsrc.arm64_64k_tree()
    assert "CONFIG_ARM64_64K_PAGES=y" in (tree / ".config").read_text()
    out = tmp_path / f"{version}-arm64"
    doc = _run_matrix(src, tree, "arm64", out)
    _check(doc, version, "arm64", out)
    assert doc["arm64_64k_pages"] is True
    assert "aarch64" in doc["vermagic"]


# ------------------------------------------------------------------------------------------------------
# Linux 7.x

def _cell7(version: str, name: str, tmp_path: Path, **kw) -> tuple[int, str, dict]:
    nvsrc.nvidia_source(version)          # Debian's or the shared directory's
    rc, text, doc = matrix7.cell(version, name, tmp_path / f"{version}-{name}", **kw)
    assert doc is not None, f"no result.json (rc={rc}):\n{text[-4000:]}"
    return rc, text, doc


def _ours_clean(doc: dict) -> None:
    """What must hold of our code in every 7.x cell, built or stock-fails."""
    assert "uvm_pt_pack.o" in doc["ours_built"], doc
    assert doc["w1_warnings_ours"] == 0, doc
    assert not any("uvm_pt_pack" in f for f in doc["failures"] if not f.startswith("patched build failed")), doc


@pytest.mark.ci_share("the Linux 7.x build root costs ~20 min cold; results in uvm_patch/COMPILE-MATRIX.md")
def test_linux7_stock_nvidia_fails_the_same_way_patched(tmp_path):
    """Debian's NVIDIA 550.163.01 on Debian's 7.3 amd64 headers, as shipped: NVIDIA's own tree does not build
    (in_irq(), vma->__vm_flags, strncpy(), dev_pagemap_ops.page_free... are gone from 7.3), the patched tree
    fails with exactly the same error set, and our pool object compiles warning-free with W=1 all the same."""
    rc, text, doc = _cell7("550.163.01", "amd64", tmp_path, stock=True, shim=False)
    assert doc["status"] == "stock-fails" and rc == 3, f"{doc['failures']}\n{text[-3000:]}"
    assert doc["stock_error"] and doc["stock_error"] == doc["patched_error"]
    assert "implicit declaration of function ‘strncpy’" in (tmp_path / "550.163.01-amd64/stock.errors").read_text()
    assert doc["errors_stock"] == doc["errors_patched"] > 0
    assert doc["kernel"].startswith(matrix7.buildroot().abi) and doc["kernel"].endswith("-amd64")
    assert doc["kernel_cc"].startswith("x86_64-linux-gnu-gcc-14"), doc["kernel_cc"]
    _ours_clean(doc)


CELLS_7X = [(v, c) for v in ("580.142", "595.45.04", "590.48.01") for c in matrix7.CELLS]


@pytest.mark.slow
@pytest.mark.parametrize("version,name", CELLS_7X, ids=[f"{v}-{c}" for v, c in CELLS_7X])
def test_linux7_cell(version, name, tmp_path):
    """One 7.x cell with OF_GPIO_SHIM=1, stock + patched: "pass" (every check of compile-matrix.sh), or
    "stock-fails" (NVIDIA's unpatched tree fails on this kernel and the patched tree fails identically)."""
    if os.environ.get("SPARK_MEMSAVER_MATRIX_7X") != "1":
        needs.beyond_ci(f"7.x cell {version} {name}", "heavy (10-18 min per cell on 2 shared cores): set SPARK_MEMSAVER_MATRIX_7X=1; results in "
                    "uvm_patch/COMPILE-MATRIX.md")
    rc, text, doc = _cell7(version, name, tmp_path, stock=True, shim=True)
    assert doc["status"] in ("pass", "stock-fails") and rc in (0, 3), f"{doc['failures']}\n{text[-3000:]}"
    assert doc["page_size"] == matrix7.CELLS[name][1]
    _ours_clean(doc)
    if doc["status"] == "pass":
        _check(doc, version, matrix7.CELLS[name][0], tmp_path / f"{version}-{name}")
        assert doc["undefined_new"] == []
    else:
        assert doc["errors_stock"] == doc["errors_patched"] > 0
