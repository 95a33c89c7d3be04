"""Known driver hazards (uvm_patch/hazards.yaml, spark_memsaver.hazards): NVIDIA/open-gpu-kernel-modules#1269.

Fixtures: tests/fixtures/hazards/nv-linux.h-<tag>.excerpt are the lines around NV_DMA_SUBMAP_MAX_PAGES of
NVIDIA's real nv-linux.h at each tag; the -fixed / -partial64k files are constructed (said in their first
line). The whole real file of every r580-r595 tag the shared directory holds (tests/support/nvsrc.py: its
SHA256SUMS) is checked too; every tag's, where an open-gpu-kernel-modules git mirror is on this machine (not in CI).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from hypothesis import given, settings, strategies as st

from spark_memsaver import record
from spark_memsaver.decide import hazards as hz
from tests.support import needs, nvsrc

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "uvm_patch" / "hazards.yaml"
FIX = Path(__file__).resolve().parent / "fixtures" / "hazards"
MIRROR = Path(os.environ.get("SPARK_MEMSAVER_NV_MIRROR", "/work/.mirror/NVIDIA+open-gpu-kernel-modules/repo"))

K4, K16, K64 = 4096, 16384, 65536


def excerpt(name: str) -> str:
    return (FIX / f"nv-linux.h-{name}.excerpt").read_text()


@pytest.fixture(scope="module")
def h1269() -> hz.Hazard:
    (h,) = [h for h in hz.load_hazards(TABLE.read_text()) if h.reference.endswith("#1269")]
    return h


def schema_finding():
    s = json.loads((REPO / "daemon/spark_memsaver/report/status.schema.json").read_text())
    return s["properties"]["findings"]["items"]


# --- the table --------------------------------------------------------------------------------------

def test_table_entry_1269(h1269):
    assert h1269.component == "nvidia.ko"
    assert h1269.arch == ("aarch64",) and set(h1269.page_sizes) == {K16, K64}
    assert h1269.affected_min == (590, 44, 1) and h1269.affected_below is None
    assert h1269.signature.macro == "NV_DMA_SUBMAP_MAX_PAGES"
    assert "common/inc/nv-linux.h" in h1269.signature.files
    assert h1269.signature.alignment == 2 << 20
    assert any("580" in r for r in h1269.remedies) and any("4 KiB" in r for r in h1269.remedies)


def _mutate(path, value):
    doc = yaml.safe_load(TABLE.read_text())
    node = doc
    for k in path[:-1]:
        node = node[k]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return yaml.safe_dump(doc)


@pytest.mark.parametrize("path,value,words", [
    (("format",), 2, "format"),
    (("hazards", 0, "drivers", "affected", "min"), "five-ninety", "dotted"),
    (("hazards", 0, "signature", "kind"), "regex", "signature kind"),
    (("hazards", 0, "signature", "alignment"), 3000000, "power of two"),
    (("hazards", 0, "signature", "file"), ["/etc/passwd"], "relative"),
    (("hazards", 0, "signature", "file"), ["../x.h"], "relative"),
    (("hazards", 0, "remedies"), [], "remedies"),
    (("hazards", 0, "code"), "Not Kebab", "kebab"),
    (("hazards", 0, "reference"), KeyError, "reference"),
])
def test_table_defects_are_named(path, value, words):
    with pytest.raises(hz.HazardsInvalid) as e:
        hz.load_hazards(_mutate(path, value))
    assert words in e.value.message and e.value.code == "hazards-invalid" and e.value.remedy


def test_table_not_yaml_is_named():
    with pytest.raises(hz.HazardsInvalid, match="not valid YAML"):
        hz.load_hazards("hazards: [\n")
    doc = yaml.safe_load(TABLE.read_text())
    doc["hazards"].append(copy.deepcopy(doc["hazards"][0]))
    with pytest.raises(hz.HazardsInvalid, match="duplicate"):
        hz.load_hazards(yaml.safe_dump(doc))


# --- affected -------------------------------------------------------------------------------------

AFFECTED_TAGS = ["590.44.01", "590.48.01", "595.45.04"]


@pytest.mark.parametrize("page_size", [K16, K64])
@pytest.mark.parametrize("tag", AFFECTED_TAGS)
def test_affected_with_source(h1269, tag, page_size):
    a = hz.assess(h1269, driver_version=tag, arch="aarch64", page_size=page_size, nv_linux_h_text=excerpt(tag))
    assert (a.state, a.decided_by) == (hz.AFFECTED, "content"), a.reason
    assert a.details["submap_bytes"] == (1 << 32) - page_size        # NV_U32_MAX >> PAGE_SHIFT pages
    assert a.details["reference_submap_bytes"] == (1 << 32) - (2 << 20)
    f = hz.finding(h1269, a)
    jsonschema.validate(f, schema_finding())
    assert f["severity"] == "warning"
    for words in ("4 GiB or more", "cudaMalloc/cuMemCreate", "just below each 4 GiB boundary",
                  "NVIDIA/open-gpu-kernel-modules#1269", "nvidia.ko", "driver source"):
        assert words in f["message"]
    assert "580" in f["remedy"] and "4 KiB" in f["remedy"] and "validated on hardware" in f["remedy"]


@pytest.mark.parametrize("page_size", [K16, K64])
@pytest.mark.parametrize("version", ["590.44.01", "595.45.04", "595.84", "610.43.03", "595.45.04-0ubuntu1"])
def test_affected_without_source_by_version(h1269, version, page_size):
    a = hz.assess(h1269, driver_version=version, arch="arm64", page_size=page_size, nv_linux_h_text=None)
    assert (a.state, a.decided_by) == (hz.AFFECTED, "version")
    assert "no driver source" in a.reason and "590.44.01 and newer" in a.reason
    f = hz.finding(h1269, a)
    assert "decided by the driver version" in f["message"] and "#1269" in f["message"]


# --- quiet ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [K16, K64])
@pytest.mark.parametrize("with_source", [True, False])
def test_quiet_on_580(h1269, page_size, with_source):
    a = hz.assess(h1269, driver_version="580.142", arch="aarch64", page_size=page_size,
                  nv_linux_h_text=excerpt("580.142") if with_source else None)
    assert a.state == hz.NOT_AFFECTED and a.decided_by == ("content" if with_source else "version"), a.reason
    assert hz.finding(h1269, a) is None
    if with_source:
        assert "64 KiB alignment" in a.reason       # the 580 tree's own 4 KiB branch: 4 GiB - 64 KiB


@pytest.mark.parametrize("tag", ["580.142"] + AFFECTED_TAGS)
@pytest.mark.parametrize("with_source", [True, False])
def test_quiet_on_4k_kernels_and_x86(h1269, tag, with_source):
    text = excerpt(tag) if with_source else None
    for arch, ps in (("aarch64", K4), ("x86_64", K4), ("amd64", K4), ("x86_64", K64)):
        a = hz.assess(h1269, driver_version=tag, arch=arch, page_size=ps, nv_linux_h_text=text)
        assert (a.state, a.decided_by) == (hz.NOT_AFFECTED, "platform"), (arch, ps, a.reason)
        assert hz.finding(h1269, a) is None


@pytest.mark.parametrize("page_size", [K16, K64])
@pytest.mark.parametrize("version", ["595.45.04", "610.43.03", None])
def test_quiet_on_the_fixed_tree_whatever_its_version(h1269, page_size, version):
    a = hz.assess(h1269, driver_version=version, arch="aarch64", page_size=page_size,
                  nv_linux_h_text=excerpt("595.45.04-fixed"))
    assert (a.state, a.decided_by) == (hz.NOT_AFFECTED, "content"), a.reason
    assert "fixed" in a.reason and a.details["submap_bytes"] % (2 << 20) == 0
    assert hz.finding(h1269, a) is None


def test_partial_fix_is_judged_per_page_size(h1269):
    text = excerpt("595.45.04-partial64k")
    a64 = hz.assess(h1269, driver_version="595.45.04", arch="aarch64", page_size=K64, nv_linux_h_text=text)
    a16 = hz.assess(h1269, driver_version="595.45.04", arch="aarch64", page_size=K16, nv_linux_h_text=text)
    assert a64.state == hz.NOT_AFFECTED and a64.details["submap_bytes"] == (1 << 32) - (2 << 20)
    assert a16.state == hz.AFFECTED and a16.details["submap_bytes"] == (1 << 32) - K16


def test_content_overrides_the_version_label(h1269):
    # A 580-labelled tree carrying 595's text is affected; a 595-labelled tree with 580's text is not.
    a = hz.assess(h1269, driver_version="580.142", arch="aarch64", page_size=K64,
                  nv_linux_h_text=excerpt("595.45.04"))
    b = hz.assess(h1269, driver_version="595.45.04", arch="aarch64", page_size=K64,
                  nv_linux_h_text=excerpt("580.142"))
    assert (a.state, b.state) == (hz.AFFECTED, hz.NOT_AFFECTED)


def test_the_signature_data_decides(h1269):
    # The table, not the code, holds the requirement: at 64 KiB alignment a 595 tree passes at 64 KiB pages.
    h = record.replace(h1269, signature=record.replace(h1269.signature, alignment=64 << 10))
    a = hz.assess(h, driver_version="595.45.04", arch="aarch64", page_size=K64, nv_linux_h_text=excerpt("595.45.04"))
    assert a.state == hz.NOT_AFFECTED
    h = record.replace(h1269, affected_min=(596, 0))
    assert hz.assess(h, driver_version="595.45.04", arch="aarch64", page_size=K64,
                     nv_linux_h_text=None).state == hz.NOT_AFFECTED


def test_whole_file_structure_around_the_excerpt(h1269):
    # The excerpt inside an include guard, next to conditions that cannot be decided here (kernel version,
    # conftest symbols, function-like macros, char literals): the macro's own #if structure still decides.
    body = excerpt("595.45.04")
    text = ("/* header */\n#ifndef _NV_LINUX_H_\n#define _NV_LINUX_H_\n#include <linux/version.h>\n"
            "#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 1, 0)\n#define NV_SOMETHING 1\n#else\n"
            "#define NV_SOMETHING 0\n#endif\n#if defined(NV_CONFTEST_X) && 'a' == 97\n#define Q(x) (x)\n#endif\n"
            "// #else  (a line comment, not a directive)\n#define STR \"/* not a comment */\"\n"
            + body + "\n#endif  /* _NV_LINUX_H_ */\n")
    a = hz.assess(h1269, driver_version="595.45.04", arch="aarch64", page_size=K64, nv_linux_h_text=text)
    assert a.state == hz.AFFECTED, a.reason


# --- odd input: unknown with a reason, never an exception -----------------------------------------

GOOD_ELSE = "#else\n#define NV_DMA_SUBMAP_MAX_PAGES ((NvU32)(NV_U32_MAX >> PAGE_SHIFT))\n#endif\n"
ODD = {
    "empty": ("", "empty"),
    "binary": ("\x7fELF\x00\x01\x02", "not text"),
    "no macro": ("#define NV_OTHER 1\n", "not defined in this file"),
    "unterminated comment": ("/* never closed\n#define NV_DMA_SUBMAP_MAX_PAGES 1\n", "unterminated"),
    "else without if": ("#else\n#define NV_DMA_SUBMAP_MAX_PAGES 1\n#endif\n", "without #if"),
    "endif without if": ("#define NV_DMA_SUBMAP_MAX_PAGES 1\n#endif\n", "without #if"),
    "never closed": ("#if defined(CONFIG_ARM64_4K_PAGES)\n#define NV_DMA_SUBMAP_MAX_PAGES 1\n", "never closed"),
    "elif after else": ("#if 1\n#else\n#elif 1\n#endif\n", "after #else"),
    "undecidable guard": ("#if defined(NV_SOME_CONFTEST)\n#define NV_DMA_SUBMAP_MAX_PAGES 65535\n#endif\n",
                          "cannot decide"),
    "function-like": ("#define NV_DMA_SUBMAP_MAX_PAGES(x) (x)\n", "function-like"),
    "calls a function-like macro": ("#define F(x) (x)\n#define NV_DMA_SUBMAP_MAX_PAGES F(3)\n", "function-like"),
    "unknown symbol": ("#define NV_DMA_SUBMAP_MAX_PAGES (NV_FROM_ELSEWHERE - 16)\n", "NV_FROM_ELSEWHERE"),
    "self reference": ("#define NV_DMA_SUBMAP_MAX_PAGES (NV_DMA_SUBMAP_MAX_PAGES + 1)\n", "itself"),
    "no value": ("#define NV_DMA_SUBMAP_MAX_PAGES\n", "without a value"),
    "division by zero": ("#define NV_DMA_SUBMAP_MAX_PAGES (65536 / (PAGE_SHIFT - PAGE_SHIFT))\n", "division"),
    "garbage expression": ("#define NV_DMA_SUBMAP_MAX_PAGES ((NvU32)(NV_U32_MAX >> ))\n", "expression"),
    "string value": ("#define NV_DMA_SUBMAP_MAX_PAGES \"4G\"\n", "integer expression"),
    "zero": ("#define NV_DMA_SUBMAP_MAX_PAGES 0\n", "not a submap size"),
    "too large": ("#define NV_DMA_SUBMAP_MAX_PAGES (1ULL << 40)\n", "not a submap size"),
    "undef": ("#define NV_DMA_SUBMAP_MAX_PAGES 1\n#undef NV_DMA_SUBMAP_MAX_PAGES\n", "#undef"),
    "deep nesting": ("#if 1\n" * 100 + "#define NV_DMA_SUBMAP_MAX_PAGES 1\n" + "#endif\n" * 100, "nested"),
    "if without expression": ("#if\n#define NV_DMA_SUBMAP_MAX_PAGES 1\n#endif\n", "without an expression"),
}


@pytest.mark.parametrize("name", list(ODD))
def test_odd_text_is_unknown_with_a_reason(h1269, name):
    text, words = ODD[name]
    a = hz.assess(h1269, driver_version="595.45.04", arch="aarch64", page_size=K64, nv_linux_h_text=text)
    assert (a.state, a.decided_by) == (hz.UNKNOWN, "content"), a.reason
    assert words in a.reason, a.reason
    assert "would be affected" in a.reason        # the version's answer is named, not used
    assert hz.finding(h1269, a) is None


@pytest.mark.parametrize("kw,words", [
    ({"driver_version": None, "arch": "aarch64", "page_size": K64}, "no readable driver version"),
    ({"driver_version": "garbage?", "arch": "aarch64", "page_size": K64}, "garbage?"),
    ({"driver_version": "595.45.04", "arch": None, "page_size": K64}, "not observed"),
    ({"driver_version": "595.45.04", "arch": "aarch64", "page_size": None}, "not observed"),
])
def test_missing_observations_are_unknown(h1269, kw, words):
    a = hz.assess(h1269, nv_linux_h_text=None, **kw)
    assert a.state == hz.UNKNOWN and words in a.reason


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("#ifdefndlsu ()01x<>+-*/&|!?:\\\n\"'NV_DMA_SUBMAP_MAX_PAGES"
                                             "CONFIG_ARM64_4K_PAGESPAGE_SHIFT")), max_size=300),
       st.sampled_from([K4, K16, K64]))
def test_fuzzed_text_never_raises(h1269, text, page_size):
    a = hz.assess(h1269, driver_version="595.45.04", arch="aarch64", page_size=page_size, nv_linux_h_text=text)
    assert a.state in (hz.AFFECTED, hz.NOT_AFFECTED, hz.UNKNOWN) and a.reason
    json.dumps(a.to_dict())


# --- the whole real file of every tag, when the mirror is here ------------------------------------

def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "--git-dir", str(MIRROR), *args], capture_output=True, text=True)


def _nv_linux_h(tag: str) -> str:
    """NVIDIA's whole common/inc/nv-linux.h of ``tag`` (tests/support/nvsrc.py: the shared r580-r595 trees)."""
    return (nvsrc.nvidia_source(tag) / "common/inc/nv-linux.h").read_text()


@pytest.mark.parametrize("tag", nvsrc.shared_versions() or [None])
def test_shared_tags_content_agrees_with_the_version_range(h1269, tag):
    if tag is None:
        needs.absent(f"NVIDIA's kernel-open trees in {nvsrc.shared_dir()}",
                     "a checkout's ../shared/nvidia/ holds them (README.md there)")
    text = _nv_linux_h(tag)
    for ps in (K16, K64):
        by_text = hz.assess(h1269, driver_version=tag, arch="aarch64", page_size=ps, nv_linux_h_text=text)
        by_ver = hz.assess(h1269, driver_version=tag, arch="aarch64", page_size=ps, nv_linux_h_text=None)
        assert by_text.decided_by == "content"
        assert by_text.state == by_ver.state, (tag, ps, by_text.reason)
        assert (by_text.state == hz.AFFECTED) is (hz.parse_version(tag) >= (590, 44, 1)), (tag, ps)


def test_every_tag_content_agrees_with_the_version_range(h1269):
    if not MIRROR.is_dir():
        needs.beyond_ci("every open-gpu-kernel-modules tag", f"needs a git mirror at {MIRROR} "
                        "($SPARK_MEMSAVER_NV_MIRROR); CI checks the shared directory's tags above")
    tags = [t for t in _git("tag").stdout.split() if hz.parse_version(t)]
    assert len(tags) > 50
    seen = {hz.AFFECTED: 0, hz.NOT_AFFECTED: 0}
    for tag in tags:
        text = _git("show", f"{tag}:kernel-open/common/inc/nv-linux.h").stdout
        for ps in (K16, K64):
            by_text = hz.assess(h1269, driver_version=tag, arch="aarch64", page_size=ps, nv_linux_h_text=text)
            by_ver = hz.assess(h1269, driver_version=tag, arch="aarch64", page_size=ps, nv_linux_h_text=None)
            assert by_text.decided_by == "content"
            assert by_text.state == by_ver.state, (tag, ps, by_text.reason)
            seen[by_text.state] += 1
    assert seen[hz.AFFECTED] >= 6 and seen[hz.NOT_AFFECTED] >= 100


@pytest.mark.parametrize("tag", ["580.142", "590.44.01", "590.48.01", "595.45.04"])
def test_fixture_excerpts_are_nvidias_text(tag):
    full = _nv_linux_h(tag)
    body = excerpt(tag).split("\n", 1)[1]
    assert body in full


# --- status on root-prefixed Spark roots (tests/support/sparkroot.py + NVIDIA's nv-linux.h text) ---------

from tests.support import sparkroot  # noqa: E402

PMD = {K4: 2 << 20, K16: 32 << 20, K64: 512 << 20}


def node(tmp_path, *, version: str, page_size: int = K64, arch: str = "aarch64", source: str | None = "same",
         loaded: bool = True) -> Path:
    """A Spark root (sparkroot) re-dressed: driver `version` loaded (or only its nvidia.ko on disk), the
    running kernel at `page_size`, and /usr/src/nvidia-<version>/common/inc/nv-linux.h holding the fixture
    excerpt `source` ("same": the excerpt of `version`; None: no source, as with precompiled modules)."""
    root = sparkroot.make_spark_root(tmp_path / "root", loaded_driver=version if loaded else None)
    k = sparkroot.SPARK_KERNEL
    sparkroot.write(root, "/proc/sys/kernel/arch", arch + "\n")
    sparkroot.write(root, "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", f"{PMD[page_size]}\n")
    cfg = "CONFIG_X86_64=y\n" if arch == "x86_64" else \
        f"CONFIG_ARM64=y\nCONFIG_ARM64_{page_size // 1024}K_PAGES=y\n"
    sparkroot.write(root, f"/boot/config-{k}", cfg + "CONFIG_MODVERSIONS=y\nCONFIG_MODULE_SIG=y\n")
    src = root / f"usr/src/nvidia-{sparkroot.DRIVER}"
    if source is None:
        import shutil
        shutil.rmtree(src)
    else:
        if version != sparkroot.DRIVER:
            src = src.rename(root / f"usr/src/nvidia-{version}")
        sparkroot.write(root, f"/usr/src/nvidia-{version}/common/inc/nv-linux.h",
                        excerpt(version if source == "same" else source))
    return root


def status_doc(root: Path, kernels: str = "64k-only"):
    from spark_memsaver.config import Config
    from spark_memsaver.host import Host
    from spark_memsaver.report.document import status_of as status
    from spark_memsaver.report.document import render_text
    doc, verdict = status(Host(root), Config(kernels=kernels))
    jsonschema.validate(doc, json.loads((REPO / "daemon/spark_memsaver/report/status.schema.json").read_text()))
    return doc, render_text(doc)


def hazard_findings(doc):
    return [f for f in doc["findings"] if f["code"] == "driver-hazard-dma-submap"]


@pytest.mark.parametrize("page_size", [K16, K64])
@pytest.mark.parametrize("version", ["590.44.01", "595.45.04"])
@pytest.mark.parametrize("with_source", [True, False])
def test_status_warns_on_an_affected_node(tmp_path, version, page_size, with_source):
    root = node(tmp_path, version=version, page_size=page_size, source="same" if with_source else None)
    doc, text = status_doc(root)
    (f,) = hazard_findings(doc)
    assert f["severity"] == "warning" and "NVIDIA/open-gpu-kernel-modules#1269" in f["message"]
    assert ("driver source" if with_source else "decided by the driver version") in f["message"]
    assert f"driver {version}" in f["message"]
    assert "[warning] driver-hazard-dma-submap:" in text and "580 driver branch" in text
    if page_size == K16:     # 64k-only policy: otherwise not-applicable, the warning is still there
        assert doc["state"] == "not-applicable"


def test_status_warns_from_the_nvidia_ko_when_nothing_is_loaded(tmp_path):
    # No loaded nvidia: the running kernel's nvidia.ko (580.142 in sparkroot) is the driver in effect, and
    # its source decides; given 595's text under that version, content wins over the version.
    root = node(tmp_path, version=sparkroot.DRIVER, loaded=False, source="595.45.04")
    doc, _ = status_doc(root)
    (f,) = hazard_findings(doc)
    assert "driver 580.142" in f["message"] and "driver source" in f["message"]


@pytest.mark.parametrize("case", ["580.142", "580.142-nosrc", "4k", "x86_64", "fixed", "fixed-610"])
def test_status_is_quiet_elsewhere(tmp_path, case):
    kw = {"580.142": dict(version="580.142"), "580.142-nosrc": dict(version="580.142", source=None),
          "4k": dict(version="595.45.04", page_size=K4), "x86_64": dict(version="595.45.04", arch="x86_64",
                                                                         page_size=K4),
          "fixed": dict(version="595.45.04", source="595.45.04-fixed"),
          "fixed-610": dict(version="610.43.03", source="595.45.04-fixed")}[case]
    doc, text = status_doc(node(tmp_path, **kw))
    assert hazard_findings(doc) == [] and "1269" not in text
    assert not [f for f in doc["findings"] if f["code"].startswith("hazard")], doc["findings"]


def test_status_cli_json_and_text(tmp_path):
    root = node(tmp_path, version="595.45.04")
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), "status", "--json",
                        "--direct"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, r.stderr          # a warning: exit 1, "a problem was found"
    doc = json.loads(r.stdout)
    assert [f["code"] for f in hazard_findings(doc)] == ["driver-hazard-dma-submap"]
    assert "NV_DMA_SUBMAP_MAX_PAGES" not in r.stdout     # the file's text stays in the snapshot, not the document


def test_a_missing_table_is_one_info_finding(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_MEMSAVER_UVM_PATCH_DIR", str(tmp_path / "empty"))
    from spark_memsaver.observe import snapshot as obs
    monkeypatch.setattr(obs, "_hazards_table", lambda: {"path": None, "text": None, "error": "not found"})
    doc, _ = status_doc(node(tmp_path, version="595.45.04"))
    codes = [f["code"] for f in doc["findings"]]
    assert "hazards-table-unreadable" in codes and "driver-hazard-dma-submap" not in codes
    assert [f["severity"] for f in doc["findings"] if f["code"] == "hazards-table-unreadable"] == ["info"]


@pytest.mark.parametrize("tag,affected", [("580.142", False), ("590.44.01", True), ("595.45.04", True)])
def test_status_with_nvidias_whole_file(tmp_path, tag, affected):
    root = node(tmp_path, version=tag)
    sparkroot.write(root, f"/usr/src/nvidia-{tag}/common/inc/nv-linux.h", _nv_linux_h(tag))
    doc, _ = status_doc(root)
    assert bool(hazard_findings(doc)) is affected


def _cli(root, *args):
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    return subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_reconcile_proceeds_and_says_it_once(tmp_path):
    root = node(tmp_path, version="595.45.04")
    r = _cli(root, "reconcile", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("NVIDIA/open-gpu-kernel-modules#1269") == 1 and r.stdout.count("note: ") == 1
    assert "plan (dry run):" in r.stdout                         # the plan itself is unchanged
    doc = json.loads(_cli(root, "reconcile", "--dry-run", "--json").stdout)
    assert [n["code"] for n in doc["notes"]] == ["driver-hazard-dma-submap"]
    quiet = node(tmp_path / "q", version="580.142")
    r = _cli(quiet, "reconcile", "--dry-run")
    assert r.returncode == 0 and "note: " not in r.stdout


def test_install_notes_are_the_warnings_only(tmp_path, monkeypatch):
    from spark_memsaver.cli.build import hazard_note_lines, hazard_notes
    from spark_memsaver.host import Host
    notes = hazard_notes(Host(node(tmp_path, version="590.44.01", page_size=K16, source=None)))
    assert [n["code"] for n in notes] == ["driver-hazard-dma-submap"]
    assert len(hazard_note_lines(notes)) == 2 and hazard_note_lines(notes)[0].startswith("note: GPU allocations")
    from spark_memsaver.observe import snapshot as obs
    monkeypatch.setattr(obs, "_hazards_table", lambda: {"path": None, "text": None, "error": "not found"})
    assert hazard_notes(Host(node(tmp_path / "b", version="595.45.04"))) == []   # an info is not a note
