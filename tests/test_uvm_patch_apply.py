"""The apply step (daemon/spark_memsaver/uvm_patch.py) against real NVIDIA trees and tiny synthetic ones.

Real trees (tests/support/nvsrc.py): Debian's nvidia-open-kernel-dkms 535/550/555 and NVIDIA's GitHub tags
580/590/595 from the shared directory next to the checkout (sha256-checked); both reach CI, where a missing one
is a failure (tests/support/needs.py: a skip elsewhere, with the reason).
Synthetic trees are a handful of real 550 files, edited to hit each refusal path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spark_memsaver.act import patch as up
from spark_memsaver.host.runner import Result, Runner
from tests.support import nvsrc

REPO = Path(__file__).resolve().parent.parent
DEBIAN = sorted(nvsrc.DEBIAN_VERSIONS)
# the GitHub tags the manifest lists exactly (the shared directory's others are qualified by content:
# tests/test_qualification.py); nvsrc takes them from the shared directory's SHA256SUMS
GITHUB = nvsrc.manifest_github_versions()


def _tree_or_skip(version: str) -> Path:
    """The real tree; SourceUnavailable is a skip with its reason, a failure under tools/test (conftest)."""
    return nvsrc.nvidia_source(version)


def _digest(tree: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(tree.rglob("*")):
        if p.is_file() and "nv-kernel.o_binary" not in p.name:
            h.update(str(p.relative_to(tree)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


# ------------------------------------------------------------------------------------------------
# Real trees

@pytest.mark.parametrize("version", DEBIAN + GITHUB)
def test_every_manifest_version_reads_selects_and_dry_runs_clean(version):
    tree = _tree_or_skip(version)
    r = up.check_source(tree)
    assert r["version"] == version
    assert r["match"] == "exact"
    assert r["dry_run"] == "clean"
    assert r["qualification"] in ("nvidia-tests", "compile-verified", "untested")   # never hardware-validated


def test_apply_real_550_tree(tmp_path):
    src = _tree_or_skip("550.163.01")
    mmu_before = (src / "nvidia-uvm/uvm_mmu.c").read_bytes()
    dest = tmp_path / "patched"
    m = up.apply_patch(src, dest)
    assert (src / "nvidia-uvm/uvm_mmu.c").read_bytes() == mmu_before, "source must never be touched"
    assert not (src / "nvidia-uvm/uvm_pt_pack.c").exists()
    assert m["version"] == "550.163.01" and m["branch"] == "r550"
    for f in ("uvm_pt_pack.c", "uvm_pt_pack.h"):
        assert (dest / "nvidia-uvm" / f).read_bytes() == (REPO / "uvm_patch/src" / f).read_bytes()
    mmu = (dest / "nvidia-uvm/uvm_mmu.c").read_text()
    for hook in ("pt_pack_tree_init(tree);", "uvm_pt_pack_tree_deinit(&tree->pt_pack, uvm_global_get_status() == NV_OK);",
                 "status = pt_pack_allocate(tree, depth, phys_alloc_size, &dir->phys_alloc);",
                 "if (uvm_pt_pack_free(&tree->pt_pack,", "uvm_parent_gpu_unmap_cpu_pages(tree->gpu->parent, gpu_addr"):
        assert mmu.count(hook) == 1, hook
    assert ".integrated = -1" in mmu  # 550 has no is_integrated_gpu
    assert "struct uvm_pt_pack_pool pt_pack;" in (dest / "nvidia-uvm/uvm_mmu.h").read_text()
    kb = (dest / "nvidia-uvm/nvidia-uvm-sources.Kbuild").read_text()
    assert kb.count("NVIDIA_UVM_SOURCES += nvidia-uvm/uvm_pt_pack.c") == 1
    assert not list(dest.rglob("*.orig")) and not list(dest.rglob("*.rej"))
    marker = json.loads((dest / up.MARKER).read_text())
    assert marker["patches"] == m["patches"] and marker["tier_default"] is None
    assert _leftovers(tmp_path) == ["patched"]
    # A patched copy is not a valid source, and the destination now exists.
    with pytest.raises(up.SourceTreeInvalid):
        up.apply_patch(dest, tmp_path / "again")
    with pytest.raises(up.DestinationExists):
        up.apply_patch(src, dest)


def test_slim_copy_leaves_out_the_rm_blob(tmp_path):
    src = _tree_or_skip("550.163.01")
    assert (src / "nvidia/nv-kernel.o_binary").exists()
    m = up.apply_patch(src, tmp_path / "p", slim=True)
    assert m["slim"] is True
    assert not (tmp_path / "p/nvidia/nv-kernel.o_binary").exists()
    assert (tmp_path / "p/nvidia/nvidia.Kbuild").exists()  # conftest lists stay
    assert (tmp_path / "p/nvidia-uvm/uvm_pt_pack.c").exists()


def test_branch_drift_is_absorbed_535_vs_555(tmp_path):
    m535 = up.apply_patch(_tree_or_skip("535.261.03"), tmp_path / "a")
    m555 = up.apply_patch(_tree_or_skip("555.58.02"), tmp_path / "b")
    assert (m535["branch"], m555["branch"]) == ("r535", "r555")
    assert "uvm_gpu_unmap_cpu_pages(tree->gpu->parent, gpu_addr" in (tmp_path / "a/nvidia-uvm/uvm_mmu.c").read_text()
    assert "uvm_parent_gpu_unmap_cpu_pages(tree->gpu->parent, gpu_addr" in (tmp_path / "b/nvidia-uvm/uvm_mmu.c").read_text()


def test_github_580_has_integrated_predicate(tmp_path):
    up.apply_patch(_tree_or_skip("580.142"), tmp_path / "p")
    assert ".integrated = gpu->parent->is_integrated_gpu ? 1 : 0" in (tmp_path / "p/nvidia-uvm/uvm_mmu.c").read_text()


def test_tier_default_goes_into_kbuild(tmp_path):
    up.apply_patch(_tree_or_skip("550.163.01"), tmp_path / "p", tier_default=2)
    kb = (tmp_path / "p/nvidia-uvm/nvidia-uvm-sources.Kbuild").read_text()
    assert "CFLAGS_uvm_pt_pack.o += -DUVM_PT_PACK_DEFAULT=2" in kb
    with pytest.raises(up.InvalidTier):
        up.apply_patch(_tree_or_skip("550.163.01"), tmp_path / "q", tier_default=7)
    assert not (tmp_path / "q").exists()


# ------------------------------------------------------------------------------------------------
# Synthetic trees (a few real 550 files)

SYNTH_FILES = ["Kbuild", "Makefile", "conftest.sh", "dkms.conf", "nvidia-uvm/uvm_mmu.c", "nvidia-uvm/uvm_mmu.h",
               "nvidia-uvm/nvidia-uvm-sources.Kbuild", "nvidia-uvm/nvidia-uvm.Kbuild"]


@pytest.fixture
def synth(tmp_path) -> Path:
    real = _tree_or_skip("550.163.01")
    t = tmp_path / "src"
    for f in SYNTH_FILES:
        (t / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(real / f, t / f)
    (t / "common/inc").mkdir(parents=True)
    return t


def _set_version(tree: Path, version: str) -> None:
    for f, old in (("Kbuild", "550.163.01"), ("dkms.conf", "550.163.01")):
        p = tree / f
        p.write_text(p.read_text().replace(old, version))


def _drift(tree: Path) -> None:
    """One byte of uvm_mmu.c's licence header changed: the hooked files no longer match any verified tree
    (else a relabelled tree inherits compile-verified by content; tests/test_qualification.py), hunks unaffected."""
    mmu = tree / "nvidia-uvm/uvm_mmu.c"
    data = mmu.read_bytes()
    mmu.write_bytes(b"X" + data[1:])


def _out(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


def test_synthetic_tree_applies(synth, tmp_path):
    out = _out(tmp_path)
    before = _digest(synth)
    up.apply_patch(synth, out / "p")
    assert _digest(synth) == before
    assert (out / "p/nvidia-uvm/uvm_pt_pack.c").exists()


def test_changed_context_line_is_refused_and_leaves_nothing(synth, tmp_path):
    mmu = synth / "nvidia-uvm/uvm_mmu.c"
    text = mmu.read_text()
    # One context line of the allocate_directory hunk, changed the way a vendor update might.
    old = "    // Fall back to sysmem if allocating page tables in vidmem with eviction\n"
    assert text.count(old) == 1
    mmu.write_text(text.replace(old, "    // Fall back to sysmem when vidmem allocation with eviction\n"))
    before = _digest(synth)
    out = _out(tmp_path)
    with pytest.raises(up.PatchDoesNotApply) as ei:
        up.apply_patch(synth, out / "p")
    assert "FAILED" in ei.value.details["dry_run"]
    assert _leftovers(out) == []
    assert _digest(synth) == before
    assert not list(synth.rglob("*.rej")) and not list(synth.rglob("*.orig"))


@pytest.mark.parametrize("damage", ["missing_header", "no_version", "two_versions", "dkms_mismatch",
                                    "bad_version", "already_patched"])
def test_corrupted_tree_is_refused(synth, tmp_path, damage):
    if damage == "missing_header":
        (synth / "nvidia-uvm/uvm_mmu.h").unlink()
    elif damage == "no_version":
        kb = synth / "Kbuild"
        kb.write_text("\n".join(l for l in kb.read_text().splitlines() if "NV_VERSION_STRING" not in l))
    elif damage == "two_versions":
        kb = synth / "Kbuild"
        kb.write_text(kb.read_text() + '\nccflags-y += -DNV_VERSION_STRING=\\"551.1\\"\n')
    elif damage == "dkms_mismatch":
        d = synth / "dkms.conf"
        d.write_text(d.read_text().replace('PACKAGE_VERSION="550.163.01"', 'PACKAGE_VERSION="550.54.14"'))
    elif damage == "bad_version":
        _set_version(synth, "rc-550")
    elif damage == "already_patched":
        (synth / "nvidia-uvm/uvm_pt_pack.c").write_text("/* stale */\n")
    out = _out(tmp_path)
    with pytest.raises(up.SourceTreeInvalid) as ei:
        up.apply_patch(synth, out / "p")
    assert ei.value.remedy
    assert _leftovers(out) == []


def test_not_a_directory(tmp_path):
    with pytest.raises(up.SourceTreeInvalid):
        up.apply_patch(tmp_path / "nope", tmp_path / "p")


def test_destination_exists_is_refused_untouched(synth, tmp_path):
    out = _out(tmp_path)
    (out / "p").mkdir()
    (out / "p" / "keep").write_text("mine")
    with pytest.raises(up.DestinationExists):
        up.apply_patch(synth, out / "p")
    assert (out / "p" / "keep").read_text() == "mine" and _leftovers(out / "p") == ["keep"]
    with pytest.raises(up.DestinationExists):
        up.apply_patch(synth, synth / "inside")


def test_unknown_version_clean_but_untested_is_refused_with_statement(synth, tmp_path):
    _set_version(synth, "551.10.02")
    _drift(synth)
    out = _out(tmp_path)
    with pytest.raises(up.UnknownDriverVersion) as ei:
        up.apply_patch(synth, out / "p")
    e = ei.value
    assert e.details["nearest_branch"] == "r550" and e.details["nearest_patch_clean"] is True
    assert "would apply cleanly" in e.message and "UNTESTED" in e.message
    assert "--allow-untested" in e.remedy
    assert _leftovers(out) == []
    m = up.apply_patch(synth, out / "p", allow_untested=True)
    assert (m["version"], m["branch"], m["match"], m["qualification"]) == ("551.10.02", "r550", "nearest", "untested")
    assert (m["drifted"], m["compared_with"]) == (["nvidia-uvm/uvm_mmu.c"], "550.163.01")


def test_unknown_version_not_clean_is_refused(synth, tmp_path):
    _set_version(synth, "549.1")
    mmu = synth / "nvidia-uvm/uvm_mmu.c"
    text = mmu.read_text()
    assert text.count("    if (tree->root == NULL)\n") == 1
    mmu.write_text(text.replace("    if (tree->root == NULL)\n", "    if (!tree->root)\n"))
    out = _out(tmp_path)
    for allow in (False, True):
        with pytest.raises(up.UnknownDriverVersion) as ei:
            up.apply_patch(synth, out / "p", allow_untested=allow)
        assert ei.value.details["nearest_patch_clean"] is False
        assert "does not apply cleanly" in ei.value.message
    assert _leftovers(out) == []


def test_failure_after_dry_run_leaves_nothing(synth, tmp_path):
    class FailRealPatch(Runner):
        def run(self, argv, **kw):
            if argv[0] == "patch" and "--dry-run" not in argv:
                return Result(list(argv), 1, "Hunk #1 FAILED at 1.\n", "", 0.0)
            return super().run(argv, **kw)

    out = _out(tmp_path)
    with pytest.raises(up.PatchDoesNotApply):
        up.apply_patch(synth, out / "p", runner=FailRealPatch())
    assert _leftovers(out) == []


def _manifest_copy(tmp_path: Path, edit) -> up.Manifest:
    root = tmp_path / "uvm_patch"
    shutil.copytree(REPO / "uvm_patch", root, ignore=shutil.ignore_patterns("*.log"))
    doc = yaml.safe_load((root / "manifest.yaml").read_text())
    edit(doc)
    (root / "manifest.yaml").write_text(yaml.safe_dump(doc))
    return up.load_manifest(root)


def test_range_match_is_untested(synth, tmp_path):
    m = _manifest_copy(tmp_path, lambda d: d["drivers"].append(
        {"range": {"min": "550.0", "below": "551.0"}, "branch": "r550", "qualification": "untested"}))
    _set_version(synth, "550.200.1")
    _drift(synth)
    out = _out(tmp_path)
    r = up.apply_patch(synth, out / "p", manifest=m)
    assert (r["match"], r["qualification"], r["drifted"]) == ("range", "untested", ["nvidia-uvm/uvm_mmu.c"])


@pytest.mark.parametrize("bad", ["hardware-validated", "verified-without-kernels", "unknown-branch"])
def test_manifest_never_claims_hardware_validation(tmp_path, bad):
    def edit(d):
        if bad == "hardware-validated":
            d["drivers"][0]["qualification"] = "hardware-validated"
        elif bad == "verified-without-kernels":
            d["drivers"][0]["qualification"] = "compile-verified"
            d["drivers"][0].pop("verified_on", None)
        else:
            d["drivers"][0]["branch"] = "r999"
    with pytest.raises(up.ManifestInvalid):
        _manifest_copy(tmp_path, edit)


def test_shipped_manifest_is_valid_and_covers_every_patch():
    m = up.load_manifest(REPO / "uvm_patch")
    used = {e.branch for e in m.entries}
    assert used == set(m.branches)
    on_disk = {p.relative_to(REPO / "uvm_patch") for p in (REPO / "uvm_patch/patches").rglob("*.patch")}
    assert on_disk == {p.relative_to(m.root) for ps in m.branches.values() for p in ps}
    for e in m.entries:
        assert e.qualification in ("nvidia-tests", "compile-verified", "untested")   # never hardware-validated


def test_patches_are_hooks_only():
    """A patch carries our lines and context, never a whole vendor file (small, few hunks)."""
    for p in (REPO / "uvm_patch/patches").rglob("*.patch"):
        text = p.read_text()
        # 9: include, pt_pack_tag field, pool field, free hook, glue, alloc hook, init, deinit, Kbuild
        assert text.count("\n@@ ") + text.startswith("@@ ") <= 9, p
        assert sum(1 for l in text.splitlines() if l.startswith(" ")) < 60, p


def test_cli_refusal_is_named_json_and_exit_1(synth, tmp_path):
    out = _out(tmp_path)
    (out / "p").mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    p = subprocess.run([sys.executable, "-m", "spark_memsaver", "patch", "apply", "--source", str(synth),
                        "--dest", str(out / "p"), "--json"], capture_output=True, text=True, env=env)
    assert p.returncode == 1, p.stderr
    err = json.loads(p.stdout)["error"]
    assert err["code"] == "destination-exists" and err["name"] == "DestinationExists" and err["remedy"]
    assert "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "spark_memsaver", "patch", "apply", "--source", str(synth),
                        "--dest", str(out / "q"), "--json"], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout)["branch"] == "r550" and (out / "q/nvidia-uvm/uvm_pt_pack.h").exists()


@pytest.mark.parametrize("branch", ["r535", "r550", "r555", "r580", "r590", "r595"])
def test_committed_patches_match_their_generator(branch):
    """uvm_patch/gen-patches.py is the source of the hook text: the committed patch must be its output."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_patches", REPO / "uvm_patch/gen-patches.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules["gen_patches"] = gen  # dataclasses look their module up
    spec.loader.exec_module(gen)
    br = gen.BRANCHES[branch]
    tree = _tree_or_skip(br.source_version)
    committed = (REPO / "uvm_patch/patches" / branch / gen.PATCH_NAME).read_text()
    assert gen.make_patch(br, tree) == committed
