"""Qualification by content (issue 14 item 3): the manifest records the sha256 of every file the hook patch
touches per compile-verified tree; a tree with identical hooked files inherits that qualification (and says from
which version), a drifted one is untested.

- The manifest's own consistency is always checked (every compile-verified version has a hash for exactly the
  files its branch's patch touches; uvm_patch/gen-hashes writes the committed text byte for byte).
- The hashes are re-derived from the real trees: Debian's nvidia-open-kernel-dkms 535/550/555 and the GitHub tags
  (580/590/595, from the shared directory next to the checkout); CI reaches both, failing to get one fails there.
- Every tree the shared directory's SHA256SUMS lists has a by-content case (BY_CONTENT: match, level, inherited
  from, drifted files, #1269 hazard verdict); a listed tree without one fails.
- Real trees relabelled as tests/support/driverdeb.py does (the version strings only): 580.142 as 580.178.04
  (the DGX Spark's driver) and Debian's 555.58.02 / 550.163.01 (always), each also with
  one byte of uvm_mmu.c changed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from spark_memsaver.act import patch as up
from spark_memsaver.act import steps as st
from spark_memsaver.decide import hazards as hz
from spark_memsaver.decide import qualification as qual
from spark_memsaver.host import Host
from tests.support import driverdeb, needs, nvsrc

REPO = Path(__file__).resolve().parent.parent
MANIFEST = up.load_manifest(REPO / "uvm_patch")
VERIFIED = [(v, e) for e in MANIFEST.entries if e.qualification in qual.VERIFIED for v in e.versions]
#: the shipped level of each listed version (Debian's trees are nvidia-tests since their 64/4 KiB runs): a tree with
#: the same hooked files inherits exactly that level
LEVEL = {v: e.qualification for e in MANIFEST.entries for v in e.versions or ()}
MMU = "nvidia-uvm/uvm_mmu.c"
# what check_source reads: the layout check, the version, the three hooked files
FILES = ["Kbuild", "Makefile", "conftest.sh", "dkms.conf", "nvidia-uvm/uvm_mmu.c", "nvidia-uvm/uvm_mmu.h",
         "nvidia-uvm/nvidia-uvm-sources.Kbuild", "nvidia-uvm/nvidia-uvm.Kbuild"]


def _tree_or_skip(version: str) -> Path:
    """The real tree; SourceUnavailable is a skip with its reason, a failure under tools/test (conftest)."""
    return nvsrc.nvidia_source(version)


def _relabelled(version: str, new: str, dest: Path, whole: bool = False) -> Path:
    """A copy of `version`'s real tree (whole, or the files check_source reads) with driverdeb's re-versioning."""
    src = _tree_or_skip(version)
    if whole:
        shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns("*.o_binary"))
    else:
        for f in FILES:
            if (src / f).exists():
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src / f, dest / f)
        (dest / "common/inc").mkdir(parents=True)
    if new != version:
        assert driverdeb._reversion_tree(dest, version, new)
    assert up.read_tree_version(dest) == new
    return dest


def _one_byte(tree: Path, rel: str = MMU) -> None:
    """Change one byte of the licence header (far from every hunk: the zero-fuzz dry run stays clean)."""
    p = tree / rel
    data = p.read_bytes()
    assert data.startswith(b"/*")
    p.write_bytes(b"/*#" + data[3:])


def _cli(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    return subprocess.run([sys.executable, "-m", "spark_memsaver", "patch", *args], capture_output=True,
                          text=True, env=env)


# ------------------------------------------------------------------------------------------------
# The manifest (always)

def test_every_verified_version_records_every_hooked_file():
    assert VERIFIED
    for v, e in VERIFIED:
        paths = MANIFEST.hooked_paths(e.branch)
        # the patch's +++ lines: the three UVM files; the pool files are copied in, not hooked
        assert paths == ["nvidia-uvm/nvidia-uvm-sources.Kbuild", "nvidia-uvm/uvm_mmu.c", "nvidia-uvm/uvm_mmu.h"]
        assert not {f.name for f in MANIFEST.pool_files} & {Path(p).name for p in paths}
        assert v in e.hooked_files, f"{v}: no hooked_files recorded (run uvm_patch/gen-hashes --write)"
        assert sorted(e.hooked_files[v]) == paths, v
        assert all(len(h) == 64 and int(h, 16) >= 0 for h in e.hooked_files[v].values()), v
    for e in MANIFEST.entries:
        if e.qualification not in qual.VERIFIED:
            assert not e.hooked_files


def test_hooked_paths_reads_plus_lines():
    diff = "--- a/x/one.c\n+++ b/x/one.c\t2026-01-01\n@@ -1 +1 @@\n-a\n+b\n--- /dev/null\n+++ b/new.c\n"
    assert qual.hooked_paths(diff) == ["new.c", "x/one.c"]


def _gen_hashes():
    loader = importlib.machinery.SourceFileLoader("gen_hashes", str(REPO / "uvm_patch/gen-hashes"))
    spec = importlib.util.spec_from_loader("gen_hashes", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_committed_manifest_is_the_generators_text():
    """gen-hashes --write of the recorded hashes gives the committed file byte for byte (format, placement)."""
    gen = _gen_hashes()
    text = (REPO / "uvm_patch/manifest.yaml").read_text()
    recorded = {v: e.hooked_files[v] for v, e in VERIFIED}
    assert gen.render(text, recorded) == text
    stripped = "\n".join(l for l in text.split("\n") if not l.startswith(("    hooked_files:", "      ")))
    assert gen.render(stripped, recorded) == text


def _edited(tmp_path: Path, edit) -> Path:
    root = tmp_path / "uvm_patch"
    shutil.copytree(REPO / "uvm_patch", root, ignore=shutil.ignore_patterns("*.log"))
    doc = yaml.safe_load((root / "manifest.yaml").read_text())
    edit(doc)
    (root / "manifest.yaml").write_text(yaml.safe_dump(doc))
    return root


def _r550(d):
    """550.163.01's entry made a plain compile-verified one, whatever level the shipped manifest gives it: the
    validation rules below are about a compile-verified entry and its hashes."""
    e = next(e for e in d["drivers"] if e.get("versions") == ["550.163.01"])
    e["qualification"] = "compile-verified"
    e.pop("nvidia_tests", None)
    return e


@pytest.mark.parametrize("bad", ["missing-file", "extra-file", "not-a-sha", "unknown-version", "on-untested"])
def test_malformed_hooked_files_are_refused(tmp_path, bad):
    def edit(d):
        files = _r550(d)["hooked_files"]["550.163.01"]
        if bad == "missing-file":
            files.pop(MMU)
        elif bad == "extra-file":
            files["nvidia-uvm/uvm_pt_pack.c"] = "0" * 64
        elif bad == "not-a-sha":
            files[MMU] = "61dcbb18"
        elif bad == "unknown-version":
            _r550(d)["hooked_files"]["550.163.02"] = dict(files)
        else:
            d["drivers"][-1]["hooked_files"] = {"580.0": {}}
    root = _edited(tmp_path, edit)
    with pytest.raises(up.ManifestInvalid):
        up.load_manifest(root)


# ------------------------------------------------------------------------------------------------
# The pure decision

def _entry(branch, q, versions=(), hooked=None):
    return SimpleNamespace(branch=branch, qualification=q, versions=list(versions), verified_on=["k"] if q ==
                           "compile-verified" else [], hooked_files=hooked or {})


A = {"f.c": "a" * 64, "f.h": "b" * 64}
B = {"f.c": "c" * 64, "f.h": "b" * 64}
D = {"f.c": "d" * 64, "f.h": "e" * 64}      # only the other branch's verified tree has these bytes


@pytest.mark.parametrize("case, version, match, hashes, want", [
    ("exact-identical", "1.2", "exact", A, ("compile-verified", "version", None, [])),
    ("exact-no-tree", "1.2", "exact", None, ("compile-verified", "version", None, [])),
    ("exact-drifted", "1.2", "exact", {**A, "f.c": "0" * 64}, ("untested", "content", None, ["f.c"])),
    ("exact-file-missing", "1.2", "exact", {**A, "f.h": None}, ("untested", "content", None, ["f.h"])),
    ("range-identical-nearest-donor", "1.9", "range", B, ("compile-verified", "content", "1.5", [])),
    ("range-drifted", "1.9", "range", {**B, "f.h": "0" * 64}, ("untested", "version", None, ["f.h"])),
    ("range-no-tree", "1.9", "range", None, ("untested", "version", None, [])),
    ("unlisted-identical", "1.1", None, A, ("compile-verified", "content", "1.2", [])),
    ("unlisted-drifted", "1.1", None, {**A, "f.c": "0" * 64}, ("untested", "version", None, ["f.c"])),
    ("other-branchs-bytes", "1.9", "range", D, ("untested", "version", None, ["f.c", "f.h"])),
])
def test_decide(case, version, match, hashes, want):
    verified = _entry("r1", "compile-verified", ["1.2", "1.4", "1.5"], {"1.2": A, "1.4": B, "1.5": B})
    rng = _entry("r1", "untested")
    other = _entry("r2", "compile-verified", ["2.0"], {"2.0": D})     # other branch: never a donor
    entry = {"exact": verified, "range": rng, None: None}[match]
    got = qual.decide(version, entry, match, hashes, [verified, rng, other], nearest_branch="r1")
    assert (got["qualification"], got["by"], got["inherited_from"], got["drifted"]) == want, got
    assert got["branch"] == "r1"
    if got["qualification"] == "compile-verified":
        assert got["verified_on"] == ["k"]
    else:
        assert got["verified_on"] == []


RUN = {"suite": "UVM_TEST_PAGE_TREE", "kernel": "k64", "page_size": 65536, "tiers": ["off", "leaf"],
       "date": "2026-12-02"}


@pytest.mark.parametrize("version, match, hashes, want", [
    ("1.5", "exact", B, ("nvidia-tests", "version", None)),          # the tested tree itself
    ("1.5", "exact", None, ("nvidia-tests", "version", None)),
    ("1.4", "exact", B, ("nvidia-tests", "content", "1.5")),         # compile-verified entry, tested bytes: upgraded
    ("1.4", "exact", None, ("compile-verified", "version", None)),   # no tree: by version only
    ("1.2", "exact", A, ("compile-verified", "version", None)),      # other bytes: stays compile-verified
    ("1.5", "exact", A, ("untested", "content", None)),              # drifted from what was tested
    ("1.3", "range", B, ("nvidia-tests", "content", "1.5")),         # the highest level wins over the nearer 1.4
    ("1.1", None, A, ("compile-verified", "content", "1.2")),
])
def test_decide_nvidia_tests_level(version, match, hashes, want):
    """nvidia-tests sits above compile-verified: a tree with the tested tree's hooked files inherits it by content
    (also a compile-verified exact entry's tree), with the recorded runs; a drifted tested tree is untested."""
    compiled = _entry("r1", "compile-verified", ["1.2", "1.4"], {"1.2": A, "1.4": B})
    tested = SimpleNamespace(branch="r1", qualification="nvidia-tests", versions=["1.5"], verified_on=["k"],
                             hooked_files={"1.5": B}, nvidia_tests=[RUN])
    rng = _entry("r1", "untested")
    entry = {"1.5": tested, "1.4": compiled, "1.2": compiled}.get(version) if match == "exact" else rng
    got = qual.decide(version, entry if match else None, match, hashes, [compiled, tested, rng], nearest_branch="r1")
    assert (got["qualification"], got["by"], got["inherited_from"]) == want, got
    assert got["nvidia_tests"] == ([RUN] if want[0] == "nvidia-tests" else [])


@pytest.mark.parametrize("bad", ["no-runs", "run-lacks-date", "runs-on-compile-verified", "unknown-level"])
def test_malformed_nvidia_tests_are_refused(tmp_path, bad):
    def edit(d):
        e = _r550(d)
        if bad == "no-runs":
            e["qualification"] = "nvidia-tests"
        elif bad == "run-lacks-date":
            e["qualification"], e["nvidia_tests"] = "nvidia-tests", [{k: v for k, v in RUN.items() if k != "date"}]
        elif bad == "runs-on-compile-verified":
            e["nvidia_tests"] = [RUN]
        else:
            e["qualification"] = "hardware-validated"
    with pytest.raises(up.ManifestInvalid):
        up.load_manifest(_edited(tmp_path, edit))
    ok = _edited(tmp_path / "ok", lambda d: _r550(d).update(qualification="nvidia-tests", nvidia_tests=[RUN]))
    assert next(e for e in up.load_manifest(ok).entries if e.versions == ["550.163.01"]).nvidia_tests == [RUN]


# ------------------------------------------------------------------------------------------------
# Real trees

@pytest.mark.parametrize("version", [v for v, _ in VERIFIED])
def test_recorded_hashes_rederived_from_the_real_tree(version):
    tree = _tree_or_skip(version)
    e = dict(VERIFIED)[version]
    assert up.tree_hashes(tree, MANIFEST.hooked_paths(e.branch)) == e.hooked_files[version]
    q = up.qualify(tree, version)
    # a tree whose bytes are also those of a higher-level tree of its branch is raised to that level by content
    top = max((d for v2, d in VERIFIED if d.branch == e.branch and d.hooked_files[v2] == e.hooked_files[version]),
              key=lambda d: qual.rank(d.qualification))
    by = "version" if top.qualification == e.qualification else "content"
    assert (q["qualification"], q["by"], q["drifted"], q["hashes_recorded"]) == (top.qualification, by, [], True)


def test_580_142_relabelled_580_178_04_inherits_nvidia_tests_by_content(tmp_path):
    """The DGX Spark's driver: 580.178.04 falls in the r580 range (untested by version); 580.142's tree relabelled
    580.178.04 has 580.142's hooked files, so it inherits 580.142's level (nvidia-tests) and its runs."""
    tree = _relabelled("580.142", "580.178.04", tmp_path / "nvidia-580.178.04", whole=True)
    p = _cli("check", "--source", str(tree), "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(p.stdout)
    assert (r["version"], r["match"], r["branch"], r["dry_run"]) == ("580.178.04", "range", "r580", "clean")
    assert (r["qualification"], r["by"], r["inherited_from"], r["drifted"]) == ("nvidia-tests", "content",
                                                                                "580.142", [])
    assert r["verified_on"] == dict(VERIFIED)["580.142"].verified_on
    assert r["nvidia_tests"] == dict(VERIFIED)["580.142"].nvidia_tests and r["nvidia_tests"][0]["page_size"] == 65536
    p = _cli("check", "--source", str(tree))
    assert "nvidia-tests by content, hooked files identical to 580.142's" in p.stdout, p.stdout
    assert "NVIDIA's tests passed: " in p.stdout and "64 KiB pages" in p.stdout, p.stdout

    _one_byte(tree)
    p = _cli("check", "--source", str(tree), "--json")
    assert p.returncode == 0, p.stdout + p.stderr      # still clean with zero fuzz: the dry run decides
    r = json.loads(p.stdout)
    assert (r["qualification"], r["inherited_from"], r["drifted"], r["compared_with"]) == ("untested", None,
                                                                                           [MMU], "580.142")
    assert r["verified_on"] == []
    assert "UNTESTED" in _cli("check", "--source", str(tree)).stdout


#: Every NVIDIA tree the shared directory holds (tests/support/nvsrc.py: ../shared/nvidia/SHA256SUMS), what
#: check_source says of it and NVIDIA#1269's verdict for it on aarch64 at 16 and 64 KiB pages (4 KiB: never
#: affected). Computed once from the real trees, written down here, and re-checked against uvm_patch/manifest.yaml
#: below: an exact match is listed, an inherited level is the level of a listed tree with the same hooked files,
#: a drifted file differs from the nearest listed tree's.
#: tag: (match, qualification, inherited_from, drifted, hazard at 16/64 KiB)
BY_CONTENT = {
    "580.82.09": ("range", "untested", None, [MMU], hz.NOT_AFFECTED),      # uvm_mmu.c differs from every 580 tree
    "580.94.06": ("range", "compile-verified", "580.95.05", [], hz.NOT_AFFECTED),
    "580.95.05": ("exact", "compile-verified", None, [], hz.NOT_AFFECTED),
    "580.105.08": ("exact", "nvidia-tests", "580.142", [], hz.NOT_AFFECTED),   # = 580.142's bytes: raised
    "580.126.09": ("range", "nvidia-tests", "580.142", [], hz.NOT_AFFECTED),   # DGX OS 7.4.0's driver
    "580.126.20": ("range", "nvidia-tests", "580.142", [], hz.NOT_AFFECTED),
    "580.142": ("exact", "nvidia-tests", None, [], hz.NOT_AFFECTED),
    "590.44.01": ("content", "nvidia-tests", "590.48.01", [], hz.AFFECTED),   # no 590 range: unlisted, by content
    "590.48.01": ("exact", "nvidia-tests", None, [], hz.AFFECTED),
    "595.45.04": ("exact", "nvidia-tests", None, [], hz.AFFECTED),
}


def _h1269() -> hz.Hazard:
    (h,) = [h for h in hz.load_hazards((REPO / "uvm_patch/hazards.yaml").read_text()) if h.reference.endswith("#1269")]
    return h


def test_every_shared_tree_has_a_by_content_case():
    """A tree the shared directory lists (its SHA256SUMS: the one list of GitHub trees) and no case below covers
    fails here: add its expectations to BY_CONTENT."""
    shared = nvsrc.shared_versions()
    if not shared:
        needs.absent(f"NVIDIA's kernel-open trees in {nvsrc.shared_dir()}",
                     "a checkout's ../shared/nvidia/ holds them (README.md there)")
    assert sorted(set(shared) - set(BY_CONTENT)) == [], "shared trees without a by-content case"
    assert set(nvsrc.manifest_github_versions()) <= set(BY_CONTENT)


@pytest.mark.parametrize("tag", sorted(BY_CONTENT, key=qual._vkey))
def test_real_upstream_releases_by_content(tag):
    """Every real NVIDIA GitHub tree the shared directory holds, listed exactly or not: match, level, where the
    level comes from, drifted files, a clean zero-fuzz dry run, and the #1269 hazard verdict by its nv-linux.h."""
    match, qualification, inherited_from, drifted, hazard = BY_CONTENT[tag]
    if tag not in nvsrc.shared_versions():
        needs.absent(f"NVIDIA {tag} in {nvsrc.shared_dir()}/SHA256SUMS",
                     "a checkout's ../shared/nvidia/ holds it (README.md there names tag and commit)")
    tree = _tree_or_skip(tag)
    r = up.check_source(tree, allow_untested=True)
    assert (r["version"], r["match"], r["qualification"], r["inherited_from"], r["drifted"]) == (
        tag, match, qualification, inherited_from, drifted)
    assert r["dry_run"] == "clean"
    assert r["by"] == ("content" if inherited_from else "version")

    # the expectations agree with uvm_patch/manifest.yaml
    listed = [e for e in MANIFEST.entries if e.matches_exact(tag)]
    ranged = [e for e in MANIFEST.entries if e.matches_range(tag)]
    assert match == ("exact" if listed else "range" if ranged else "content")
    hashes = up.tree_hashes(tree, MANIFEST.hooked_paths(r["branch"]))
    if inherited_from:
        src = dict(VERIFIED)[inherited_from]
        assert (src.branch, src.qualification, src.hooked_files[inherited_from]) == (r["branch"], qualification,
                                                                                   hashes)
        assert r["verified_on"] == src.verified_on
    elif not drifted:
        assert listed and hashes == listed[0].hooked_files[tag] and LEVEL[tag] == qualification
    else:
        assert qualification == "untested" and r["verified_on"] == []
        same = [v for v, e in VERIFIED if e.branch == r["branch"] and e.hooked_files[v] == hashes]
        assert same == []                                          # no verified tree of the branch has its bytes
        ref = dict(VERIFIED)[r["compared_with"]].hooked_files[r["compared_with"]]
        assert sorted(p for p in ref if ref[p] != hashes[p]) == drifted

    # the hazard verdict by the tree's own nv-linux.h, as the version range says
    text = (tree / "common/inc/nv-linux.h").read_text()
    h = _h1269()
    for ps, want, by in ((4096, hz.NOT_AFFECTED, "platform"), (16384, hazard, "content"), (65536, hazard, "content")):
        a = hz.assess(h, driver_version=tag, arch="aarch64", page_size=ps, nv_linux_h_text=text)
        assert (a.state, a.decided_by) == (want, by), (ps, a.reason)
        assert hz.assess(h, driver_version=tag, arch="aarch64", page_size=ps, nv_linux_h_text=None).state == want


def test_unlisted_version_with_identical_hooked_files_is_accepted_by_content(tmp_path):
    """555.58.99 (Debian's 555.58.02 relabelled; no entry, no range) inherits 555.58.02's level and
    is applied without --allow-untested; with one byte of uvm_mmu.c changed it is refused as before."""
    tree = _relabelled("555.58.02", "555.58.99", tmp_path / "src")
    r = up.check_source(tree)
    assert (r["match"], r["qualification"], r["by"], r["inherited_from"]) == ("content", LEVEL["555.58.02"],
                                                                              "content", "555.58.02")
    out = tmp_path / "out"
    out.mkdir()
    m = up.apply_patch(tree, out / "p")
    marker = json.loads((out / "p" / up.MARKER).read_text())
    assert (marker["qualification"], marker["by"], marker["inherited_from"]) == (LEVEL["555.58.02"], "content",
                                                                                 "555.58.02")
    assert m["match"] == "content"

    _one_byte(tree)
    with pytest.raises(up.UnknownDriverVersion) as ei:
        up.check_source(tree)
    assert ei.value.details["drifted"] == [MMU] and ei.value.details["compared_with"] == "555.58.02"
    p = _cli("check", "--source", str(tree), "--json")
    assert p.returncode == 1 and json.loads(p.stdout)["error"]["code"] == "unknown-driver-version"
    p = _cli("check", "--source", str(tree), "--allow-untested", "--json")
    r = json.loads(p.stdout)
    assert (r["match"], r["qualification"], r["drifted"]) == ("nearest", "untested", [MMU])


def test_patch_check_reads_the_source_under_root(tmp_path):
    """`patch check --source /usr/src/nvidia-X` with --root (before or after the command) reads the tree of the
    system under the root: it read the host's /usr/src, where that tree is not."""
    root = tmp_path / "root"
    _relabelled("550.163.01", "550.163.02", root / "usr/src/nvidia-550.163.02")
    assert not Path("/usr/src/nvidia-550.163.02").exists()
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    for argv in (["--root", str(root), "patch", "check"], ["patch", "check", "--root", str(root)]):
        p = subprocess.run([sys.executable, "-m", "spark_memsaver", *argv, "--source", "/usr/src/nvidia-550.163.02",
                            "--json"], capture_output=True, text=True, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        r = json.loads(p.stdout)
        assert (r["source"], r["version"], r["inherited_from"]) == ("/usr/src/nvidia-550.163.02", "550.163.02",
                                                                    "550.163.01")


def test_listed_version_with_changed_content_is_not_compile_verified(tmp_path):
    """A tree labelled 550.163.01 (an exact compile-verified entry) whose uvm_mmu.h differs is not what was
    compiled: untested, by content, drifted names the file (the dry run still decides)."""
    tree = _relabelled("550.163.01", "550.163.01", tmp_path / "src")
    assert up.check_source(tree)["qualification"] == LEVEL["550.163.01"]
    _one_byte(tree, "nvidia-uvm/uvm_mmu.h")
    r = up.check_source(tree)
    assert (r["match"], r["qualification"], r["by"], r["drifted"]) == ("exact", "untested", "content",
                                                                       ["nvidia-uvm/uvm_mmu.h"])
    assert r["verified_on"] == []


def test_daemon_support_reads_the_trees_in_the_snapshot(tmp_path):
    """support_for (act/steps.py's, the planner's and installability's verdict) with the snapshot's trees:
    550.163.02 = 550.163.01's files relabelled -> supported, compile-verified by content; 555.58.99 with a drifted
    uvm_mmu.c -> not supported, the reason names the manifest (decide/plan maps that to driver-unsupported)."""
    from spark_memsaver.model import world_of
    root = tmp_path / "root"
    _relabelled("550.163.01", "550.163.02", root / "usr/src/nvidia-550.163.02")
    _one_byte(_relabelled("555.58.02", "555.58.99", root / "usr/src/nvidia-555.58.99"))
    host = Host(root=str(root))
    snap = world_of({"driver": {"sources": [
        {"version": "550.163.02", "path": "/usr/src/nvidia-550.163.02", "open": True},
        {"version": "555.58.99", "path": "/usr/src/nvidia-555.58.99", "open": True}]}})
    trees = up.source_trees(host, snap)
    assert set(trees) == {"550.163.02", "555.58.99"}
    sup = up.support_for(["550.163.02", "555.58.99", "580.178.04"], trees)
    assert sup["550.163.02"]["supported"] is True
    assert (sup["550.163.02"]["qualification"], sup["550.163.02"]["inherited_from"]) == (LEVEL["550.163.01"],
                                                                                         "550.163.01")
    assert sup["555.58.99"]["supported"] is False
    assert "not in this release's patch manifest" in sup["555.58.99"]["reason"] and MMU in sup["555.58.99"]["reason"]
    # no tree: by version, as before
    assert (sup["580.178.04"]["supported"], sup["580.178.04"]["qualification"]) == (True, "untested")
    no_tree = st.support_for(["550.163.02"])["550.163.02"]
    assert no_tree["supported"] is False and no_tree["content_unchecked"] is True
    assert sup["555.58.99"]["content_unchecked"] is False
    # the planner's and installability's entry (act/steps.py, called by act/executor.py and act/installable.py)
    assert st.support_for(["550.163.02"], st.source_trees(host, snap)) == {"550.163.02": sup["550.163.02"]}


def test_patch_list_shows_hashes_and_inheritance():
    p = _cli("list", "--json")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)["drivers"]
    r580 = next(r for r in rows if r["versions"] == ["580.95.05", "580.105.08"])
    assert r580["hashes_recorded"] == ["580.95.05", "580.105.08"] and r580["hashes_missing"] == []
    tested = next(r for r in rows if r["versions"] == ["580.142"])
    assert tested["qualification"] == "nvidia-tests" and tested["hashes_recorded"] == ["580.142"]
    assert tested["nvidia_tests"][0]["tiers"] == ["off", "4k-all", "256", "leaf"]
    rng = next(r for r in rows if r["range"])
    assert rng["qualification"] == "untested" and "580.142" in rng["inherits_by_content_from"]
    text = _cli("list").stdout
    assert "content hashes: 580.95.05, 580.105.08" in text and "content hashes: 580.142" in text
    assert "NVIDIA's tests passed: UVM_TEST_PAGE_TREE" in text
    assert "verified by content where the hooked files are identical to" in text


def test_driverdebs_unsupported_driver_stays_unknown(tmp_path):
    """tests/support/driverdeb.py's 555.58.99 (lifecycle e2e: "a driver absent from the manifest") is 555.58.02
    relabelled plus the same one-byte drift its recipe applies: still unsupported now that a relabel alone inherits."""
    tree = _relabelled("555.58.02", driverdeb.UNSUPPORTED, tmp_path / "src")
    assert up.support(driverdeb.UNSUPPORTED, tree)["supported"] is True      # the relabel alone would inherit
    driverdeb._drift_hooked(tree)
    sup = up.support(driverdeb.UNSUPPORTED, tree)
    assert sup["supported"] is False and sup["drifted"] == [MMU] and "manifest" in sup["reason"]


def test_status_shows_the_verdict_by_content(tmp_path):
    """status (act/installable.observe -> support with the snapshot's trees -> report/document.py) names the
    qualification of each driver source: inherited by content, or drifted."""
    from tests.support import sparkroot

    root = tmp_path / "root"
    sparkroot.make_spark_root(root)
    _relabelled("550.163.01", "550.163.02", root / "usr/src/nvidia-550.163.02")
    p = subprocess.run([sys.executable, "-m", "spark_memsaver", "--root", str(root), "status", "--json"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO / "daemon")))
    assert p.returncode in (0, 1) and "Traceback" not in p.stderr, p.stderr
    patch = json.loads(p.stdout)["driver"]["patch"]
    assert patch["550.163.02"] == {"supported": True, "qualification": LEVEL["550.163.01"], "by": "content",
                                   "inherited_from": "550.163.01", "drifted": []}
    # the fixture's 580.142 tree is a stand-in without UVM sources: not what was compiled
    assert patch[sparkroot.DRIVER]["qualification"] == "untested" and MMU in patch[sparkroot.DRIVER]["drifted"]
    text = subprocess.run([sys.executable, "-m", "spark_memsaver", "--root", str(root), "status", "--verbose"],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO / "daemon"))).stdout
    assert f"550.163.02: {LEVEL['550.163.01']} by content from 550.163.01" in text, text
