"""One owner per fact (issue 34 item 1; docs/architecture.md, "One owner per fact"): each fact has one function
that decides it, and every layer asks that function. Each test here is a place where two rules disagreed on main.

Real parts: the fixture roots hold real ELF objects with a .modinfo section (tests/support/sparkroot.py), read by
the real modinfo/depmod and the kotool. A module tagged ``uvm-pt-pack/2`` stands in for a packing nvidia-uvm of
another spark-memsaver release (one this package did not build)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

from spark_memsaver.act import dkms_run, override, steps
from spark_memsaver.decide import ours
from spark_memsaver.host import Host, paths, records
from tests.support import sparkroot

K = sparkroot.SPARK_KERNEL
PKG = Path(__file__).resolve().parent.parent / "daemon" / "spark_memsaver"
STOCK = f"/lib/modules/{K}/kernel/nvidia-580-open/nvidia-uvm.ko"


def other_release_fields(version: str = sparkroot.DRIVER) -> list[tuple[str, str]]:
    """A packing nvidia-uvm of another spark-memsaver release: our fields with the tag uvm-pt-pack/2."""
    return [(k, "uvm-pt-pack/2" if k == "spark_memsaver" else v)
            for k, v in sparkroot.uvm_fields(version, "B0B0B0B0B0B0B0B0B0B0B01", K, ours=True)]


def _depmod(root: Path) -> None:
    import subprocess
    subprocess.run(["depmod", "-b", str(root), K], check=True, capture_output=True)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# --- is it ours ---------------------------------------------------------------------------------------------

def test_a_module_of_another_release_is_ours_to_every_layer_and_built_here_to_none(tmp_path):
    """decide/ said yes to a uvm-pt-pack/2 module, act/ no (dkms_run.selected's "ours" was the exact tag): the
    same file was ours to the planner and stock to the install engine."""
    from spark_memsaver import world
    root = sparkroot.make_spark_root(tmp_path / "root")
    sparkroot.make_module(root / f"lib/modules/{K}/updates/dkms/nvidia-uvm.ko", other_release_fields())
    _depmod(root)
    h = Host(root)
    k = next(k for k in world.snapshot(h).kernels if k.release == K)
    act_view = dkms_run.selected(h, K, "nvidia_uvm")
    for sel in (k.uvm_selected, act_view, override.modules.read_selected(h, K)):
        assert ours.is_ours(sel) and not ours.built_here(sel) and not ours.is_stock(sel)
    v = override.verify_installed(h, K)
    assert not v["ok"] and not v["ours"] and "did not build" in " ".join(v["problems"])


def test_the_two_predicates_over_every_module_shape():
    from spark_memsaver.model import ModuleSelection, Uvm
    assert ours.is_ours({"state": "ours"}) and ours.built_here({"state": "ours"})
    assert ours.is_ours({"state": "patched", "patched": True}) and not ours.built_here({"state": "patched"})
    for st in ("stock", "none", "builtin", "unreadable"):
        assert not ours.is_ours({"state": st, "patched": None}) and not ours.built_here({"state": st})
    assert ours.is_stock({"state": "stock"}) and not ours.is_stock({"state": "unreadable", "patched": None})
    assert not ours.is_stock(None) and not ours.is_ours(None)
    assert ours.is_ours(Uvm(loaded=True, patched=True)) and not ours.built_here(Uvm(loaded=True, patched=True))
    assert ours.is_ours(ModuleSelection(patched=True, state="patched"))
    assert not ours.is_ours(ModuleSelection(patched=False, state="stock"))
    assert ours.is_ours({"loaded": True, "patched": True}) and not ours.is_ours({"loaded": True, "patched": False})


# Reading the fields that say "ours" to decide is the owner's alone (decide/ours.py); observe/ produces them,
# model.py types them, a dict entry that copies one into a document is not a decision.
_READ = re.compile(r"""\.patched\b|\[["'](?:patched|ours)["']\]|\.get\(["'](?:patched|ours)["']\)"""
                   r"""|\[["']state["']\]\s*[!=]=\s*["']ours["']|state["']?\)?\s*[!=]=\s*["']ours["']""")
_PRODUCERS = {"decide/ours.py", "observe/modules.py", "observe/snapshot.py", "model.py"}


def test_nothing_outside_the_owner_reads_ours_to_decide():
    bad = []
    for p in sorted(PKG.rglob("*.py")):
        rel = str(p.relative_to(PKG))
        if rel in _PRODUCERS:
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            copy = re.search(r"""["'](?:patched|ours)["']\s*:\s*\w+(?:\.patched|\[|\.get\()""", code) and \
                not re.search(r"""[!=]=\s*["']ours["']""", code)
            if _READ.search(code) and not copy:
                bad.append(f"{rel}:{n}: {line.strip()}")
    assert not bad, "decide 'ours' through decide/ours.is_ours / built_here:\n" + "\n".join(bad)


# --- the stock record: one path, one writer -----------------------------------------------------------------

def test_restore_stock_never_keeps_a_packing_module_as_the_stock_file(tmp_path):
    """A uvm-pt-pack/2 module standing where the recorded stock file was is not "a stock file a driver package
    put back": on main restore_stock kept it, verified it as stock and said ok."""
    root = sparkroot.make_spark_root(tmp_path / "root")
    h = Host(root)
    stock = h.path(STOCK)
    want = _sha(stock)
    rec = h.path(paths.stock_record(K))
    rec.parent.mkdir(parents=True, exist_ok=True)
    rec.write_text(json.dumps({"kernel": K, "stock_path": STOCK, "stock_sha256": want, "recorded": "x"}))
    saved = h.path(f"/var/lib/dkms/spark-memsaver-uvm/original_module/{K}/x/nvidia-uvm.ko")
    saved.parent.mkdir(parents=True)
    shutil.copy2(stock, saved)
    stock.unlink()
    sparkroot.make_module(stock, other_release_fields())
    _depmod(root)
    res = override.restore_stock(h, K)
    assert _sha(stock) == want, "a packing module was kept as the stock file"
    assert res["ok"] and res["selected"] == STOCK
    assert any("restored" in a for a in res["actions"])


def test_the_one_writer_never_records_a_packing_module_as_stock(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "root")
    h = Host(root)
    first = override.record_stock(h, K)                      # the stock module: recorded
    assert first["stock_path"] == STOCK and first["stock_sha256"] == _sha(h.path(STOCK))
    sparkroot.make_module(root / f"lib/modules/{K}/updates/dkms/nvidia-uvm.ko", other_release_fields())
    _depmod(root)
    assert override.record_stock(h, K) == first               # the packing module: the record stays
    assert steps.record_stock(h, K) == STOCK                  # the build-install step asks the same writer
    assert records.one(h, "stock", paths.stock_record(K)) == first
    h.path(paths.stock_record(K)).unlink()
    assert override.record_stock(h, K) is None and not h.path(paths.stock_record(K)).exists()


def test_the_stock_record_has_one_path():
    """override.py joined the kernel into the path itself; host/paths.py safe_names it: a kernel release with
    a character outside [A-Za-z0-9._+-] was written to one file and looked up in another."""
    for k in (K, "6.8.0-1014-nvidia-64k", "6.8.0 odd~rc1"):
        assert override._stock_record_path(k) == paths.stock_record(k)
    writers = [p.relative_to(PKG) for p in PKG.rglob("*.py")
               if re.search(r"_write_json\(host, _stock_record_path|atomic_write\(.*stock_record", p.read_text())]
    assert [str(p) for p in writers] == ["act/override.py"]


# --- Debian version -> driver version -----------------------------------------------------------------------

def test_one_debian_version_to_driver_rule():
    """decide/apt.py turned '55.1-1' into None, decide/sources.py into '55.1' (and a kernel package's
    '6.8.0-1010.10' into '6.8.0'): the APT door and the source finder read one package version two ways."""
    from spark_memsaver import versions
    from spark_memsaver.decide import apt, sources
    cases = {"55.1-1": None, "6.8.0-1010.10": None, "1:555.58.02-1": "555.58.02", "580.142": "580.142",
             "580.178.04-0ubuntu0.24.04.1": "580.178.04", "550.163.01-4~bpo12+1": "550.163.01",
             "580.142~rc1-1": "580.142", "580.142.1.2-1": None, "-": None, "": None, None: None}
    for deb, want in cases.items():
        assert apt.upstream_of_deb(deb) == sources.driver_of(deb) == versions.driver_of_deb(deb) == want, deb
    from spark_memsaver.service import checks
    assert checks.DRIVER_RE is versions.DRIVER_RE is apt.DRIVER_VERSION_RE


# --- driver branch, source package, flavour -----------------------------------------------------------------

def test_the_build_refusal_names_the_packages_of_the_branch(tmp_path):
    """dkms_run's remedy guessed nvidia-kernel-source-<major>-open, which NVIDIA's repository does not use from
    590 on (nvidia-kernel-source-open): it now names decide/sources' packages for the branch."""
    import pytest
    from spark_memsaver.act.dkms_errors import DriverSourceMissing
    from spark_memsaver.decide import sources
    h = Host(tmp_path)
    for drv in ("580.142", "590.48.01"):
        with pytest.raises(DriverSourceMissing) as e:
            dkms_run.find_driver_source(h, drv)
        pkgs = sources.search_packages(drv)
        assert f"'apt-cache policy {' '.join(pkgs)}'" in e.value.remedy
        assert set(pkgs) == {c["package"] for c in sources.source_package(drv)
                             if c["layout"] in (sources.UBUNTU, sources.UBUNTU_SERVER, sources.NVIDIA_REPO)}
    assert "nvidia-kernel-source-open" in sources.search_packages("590.48.01")


def test_one_flavour_rule():
    from spark_memsaver.decide import installability as inst, sources
    assert "def _server" not in (PKG / "decide/installability.py").read_text()
    srv = {"nvidia_ko": ["/lib/modules/a/kernel/nvidia-580-open/nvidia.ko",
                         "/lib/modules/b/kernel/nvidia-580srv-open/nvidia.ko"]}
    assert sources.server_flavour(srv, "580") and not sources.server_flavour({"nvidia_ko": srv["nvidia_ko"][:1]}, "580")
    assert sources.server_flavour({"installed": {"nvidia-kernel-common-580-server": "x"}}, "580")
    assert inst.branch_of is sources.branch_of and inst.server_flavour is sources.server_flavour


# --- Secure Boot: the loadable states -----------------------------------------------------------------------

def test_one_rule_of_the_loadable_secure_boot_states():
    """The states were listed in decide/mok.py, decide/installability.py and decide/status.py."""
    from spark_memsaver.decide import mok
    defs = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
            if re.search(r'^\w*LOADABLE\s*=\s*\("not-needed"', p.read_text(), re.M)]
    assert defs == ["decide/mok.py"]
    assert [s for s in mok.STATES if mok.state_loadable(s)] == ["not-needed", "enrolled"]


# --- the tree that is built is the tree that is hashed ------------------------------------------------------

def test_qualification_hashes_the_tree_the_build_compiles(tmp_path):
    """Two trees of one driver: /usr/src/nvidia-580.142 damaged (no conftest.sh), a complete fetched one in the
    source cache. The build compiles the cached one; on main qualification hashed the damaged one (the first
    'open' tree of that version)."""
    from spark_memsaver import world
    from spark_memsaver.world import support
    from tests.test_sources import nvidia_tree
    drv = sparkroot.DRIVER
    root = sparkroot.make_spark_root(tmp_path / "root")
    h = Host(root)
    usr = nvidia_tree(h.path(f"/usr/src/nvidia-{drv}"), drv)
    (usr / "conftest.sh").unlink()
    (usr / "nvidia-uvm/uvm_mmu.c").write_text("/* edited by hand */\n")
    nvidia_tree(h.path(paths.source_tree(drv)), drv)
    built = dkms_run.find_driver_source(h, drv)
    assert built == paths.source_tree(drv)
    assert support.source_trees(h, world.snapshot(h))[drv] == h.path(built)
