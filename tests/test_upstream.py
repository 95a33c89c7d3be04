"""The upstream series (uvm_patch/upstream/): generated from the DKMS sources, applies to 595.45.04, compiles.

NVIDIA's 595.45.04 kernel-open/ comes from the shared directory (tests/support/nvsrc.py), committed into a
throw-away git repository: `git apply --check` runs against it, every `index` line of the series is the blob
id of that tree's file before and after the series, and (-m compile) the series is applied and nvidia-uvm.ko
built against this machine's x86_64 headers by build-check. The generator's own comparison reads the
open-gpu-kernel-modules mirror when it is here (not in CI: the series is then compared minus the index lines,
which the blob-id test above covers).
"""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import needs, nvsrc

REPO = Path(__file__).resolve().parent.parent
UP = REPO / "uvm_patch" / "upstream"
MIRROR = Path(os.environ.get("SPARK_MEMSAVER_NV_MIRROR", "/work/.mirror/NVIDIA+open-gpu-kernel-modules/repo"))
TAG = "595.45.04"


@pytest.fixture(scope="module")
def tag_repo(tmp_path_factory) -> Path:
    """A git repository whose tag 595.45.04 holds NVIDIA's kernel-open/ of that tag (the shared tree; the
    commit id differs from NVIDIA's, the blobs are the same). The mirror is used where it exists."""
    if MIRROR.is_dir():
        return MIRROR
    src = nvsrc.nvidia_source(TAG)
    repo = tmp_path_factory.mktemp("nvtag") / "repo"
    shutil.copytree(src, repo / "kernel-open", symlinks=True)
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GIT_CONFIG_NOSYSTEM="1", HOME=str(repo.parent))
    for argv in (["init", "-q"], ["add", "-A", "-f", "kernel-open"], ["commit", "-q", "-m", TAG], ["tag", TAG]):
        subprocess.run(["git", "-C", str(repo), *argv], check=True, env=env, capture_output=True)
    return repo / ".git"


@pytest.fixture(scope="module")
def gen():
    loader = importlib.machinery.SourceFileLoader("upstream_generate", str(UP / "generate"))
    spec = importlib.util.spec_from_loader("upstream_generate", loader)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["upstream_generate"] = mod
    loader.exec_module(mod)
    return mod


def committed() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((UP / "series").glob("*.patch"))}


def test_committed_series_is_the_generators_output(gen):
    mirror = MIRROR if MIRROR.is_dir() else None
    out = gen.build_series(mirror)
    have = committed()
    assert list(have) == list(out) and len(out) == 2
    if mirror is None:
        have = {k: gen.strip_index(v) for k, v in have.items()}
        out = {k: gen.strip_index(v) for k, v in out.items()}
    assert have == out, "run uvm_patch/upstream/generate and commit uvm_patch/upstream/series"
    assert gen.build_series(mirror) == gen.build_series(mirror)          # reproducible (fixed author/date)


def _files(text: str) -> dict[str, str]:
    """path -> the diff section of that path."""
    parts = re.split(r"^diff --git a/(\S+) b/\S+\n", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_new_files_are_the_pool_sources_with_the_upstream_edits(gen):
    series = "".join(committed().values())
    files = _files(series)
    for name in ("uvm_pt_pack.c", "uvm_pt_pack.h"):
        body = files[f"kernel-open/nvidia-uvm/{name}"]
        assert body.startswith("new file mode 100644\n")
        added = "\n".join(l[1:] for l in body.split("\n") if l.startswith("+") and not l.startswith("+++")) + "\n"
        assert added == gen.upstream_pool(name)
    c = gen.upstream_pool("uvm_pt_pack.c")
    src = (REPO / "uvm_patch/src/uvm_pt_pack.c").read_text()
    assert "MODULE_INFO(spark_memsaver" in src and "MODULE_INFO(spark_memsaver" not in c
    assert re.search(r"^#define UVM_PT_PACK_DEFAULT 0\b", c, re.M)
    assert "tier != UVM_PT_PACK_TIER_OFF && tier != UVM_PT_PACK_TIER_LEAF" in c
    assert "SPDX-License-Identifier: GPL-2.0-only OR MIT" in c
    # Apart from the edited lines, the file is the DKMS product's, line for line.
    extra = set(c.split("\n")) - set(src.split("\n"))
    assert len(extra) <= 14, extra
    h = gen.upstream_pool("uvm_pt_pack.h")
    for text in (c, h):
        # no product, no document or test of ours, no test hook
        assert not gen.FORBIDDEN.search(text), gen.FORBIDDEN.search(text)
        for word in ("spark", "FAULT_INJECT", "TEST_FAKE_GPU", "PT_PACK_FI(", "tests/", "seed project"):
            assert word not in text, word
    # NVIDIA's lock type and order, not a raw spinlock
    assert "#define UVM_PT_PACK_LOCK_T       uvm_spinlock_t" in h
    assert "uvm_spin_lock_init((l), UVM_LOCK_ORDER_LEAF)" in h and '#include "uvm_lock.h"' in h
    assert not re.search(r"(?<!uvm_)spinlock_t|\bspin_lock\(|spin_lock_init\(l\)", h + c)
    # tier 3 is never called the default; the default is off
    assert not re.search(r"LEAF\s*:\s*default|default: 256|3 leaf \(default", h + c)
    assert "0 off (default), 3 leaf" in c


def test_hook_hunks_are_the_dkms_patchs(gen):
    """Every hunk of uvm_mmu.[ch] / the Kbuild is the r595 DKMS patch's, same context, our comments renamed."""
    dkms = gen.parse_unified((REPO / "uvm_patch/patches/r595/0001-uvm-pt-pack-hooks.patch").read_text())
    series = _files("".join(committed().values()))
    for rel, hunks in dkms.items():
        body = series["kernel-open/" + rel]
        got = gen.parse_unified(f"--- a/{rel}\n+++ b/{rel}\n" + body.split(f"+++ b/kernel-open/{rel}\n", 1)[1])[rel]
        assert [(h.old_start, h.old_len) for h in got] == [(h.old_start, h.old_len) for h in hunks]
        for g, d in zip(got, hunks):
            assert [l for l in g.lines if not l.startswith("+")] == [l for l in d.lines if not l.startswith("+")]
            assert g.lines == [gen.upstream_hook_line(l) for l in d.lines]
    assert not re.search(r"^\+.*spark[-_]memsaver", "".join(series[p] for p in series if "uvm_pt_pack" not in p),
                         re.M)


def test_messages_carry_the_figures_and_the_caveats():
    p1, p2 = committed().values()
    for words in ("0.2035 GiB", "3.2566 GiB", "3,400,000", "400,000", "pending: run in a VM", "Predicates",
                  "uvm_pt_pack=3", "NVIDIA/open-gpu-kernel-modules#1269", "has not run on hardware yet"):
        assert words in p2, words
    assert "GPL-2.0-only OR MIT" in p1 and "default 0" in p1
    assert "the default is 0, off" in p2 and "integrated_unknown" in p2 and "pt_pack_tag" in p2
    for p in (p1, p2):
        assert not re.search(r"spark|memsaver|MODULE_INFO|FAULT_INJECT|TEST_FAKE_GPU", p, re.I)   # headers too
        assert "\nSigned-off-by: " in p
        assert re.search(r"^\+.*\buvm_spinlock_t\b", p1, re.M)
    for p in (p1, p2):
        assert p.startswith("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\nFrom: ")
        assert "\nDate: Tue, 1 Dec 2026 12:00:00 +0000\n" in p
    assert "base-commit: df1c9a3de2be4b130f4fc7680f7198193d8ac6ad" in p2


def test_the_whole_mail_names_no_project_of_ours(gen):
    """From:, Signed-off-by: and every other line of both patches: no project name (the author is a placeholder
    naming nobody; whoever submits regenerates with --author, which sets both lines)."""
    for name, p in committed().items():
        assert not re.search(r"spark|memsaver", p, re.I), (name, re.search(r"^.*(spark|memsaver).*$", p, re.I | re.M))
        assert f"\nFrom: {gen.AUTHOR}\n" in p and f"\nSigned-off-by: {gen.AUTHOR}\n" in p
    mine = gen.build_series(None, "Jane Doe <jane@example.org>")
    for p in mine.values():
        assert "\nFrom: Jane Doe <jane@example.org>\n" in p and "\nSigned-off-by: Jane Doe <jane@example.org>\n" in p
        assert gen.AUTHOR not in p
    with pytest.raises(gen.GenerateError, match="names our project"):
        gen.build_series(None, "spark-memsaver maintainers <maintainers@spark-memsaver.invalid>")
    assert gen.main(["--no-mirror", "--print", "--author", "not an address"]) == 1


def test_generator_stops_when_the_pool_moves(gen, monkeypatch, tmp_path):
    # An upstream edit whose anchor no longer matches must stop generation, never emit a half-edited file.
    src = tmp_path / "uvm_patch"
    (src / "src").mkdir(parents=True)
    for name in ("uvm_pt_pack.c", "uvm_pt_pack.h"):
        text = (REPO / "uvm_patch/src" / name).read_text()
        (src / "src" / name).write_text(text.replace("MODULE_INFO(spark_memsaver", "MODULE_INFO(other"))
    monkeypatch.setattr(gen, "UVM_PATCH", src)
    with pytest.raises(gen.GenerateError, match="no product modinfo tag"):
        gen.upstream_pool("uvm_pt_pack.c")
    with pytest.raises(gen.GenerateError, match="still names the product"):
        gen.upstream_hook_line("+    x = 1; // spark_memsaver leftover")
    # a test hook or a word of ours left after the edits stops it too
    for name in ("uvm_pt_pack.c", "uvm_pt_pack.h"):
        (src / "src" / name).write_text((REPO / "uvm_patch/src" / name).read_text())
    with open(src / "src" / "uvm_pt_pack.c", "a") as fh:
        fh.write("#if UVM_PT_PACK_FAULT_INJECT\n#endif\n")
    with pytest.raises(gen.GenerateError, match="still has 'FAULT_INJECT'"):
        gen.upstream_pool("uvm_pt_pack.c")


def test_apply_hunks_refuses_wrong_context(gen):
    h = gen.Hunk(2, 2, [" b", "+x", " c"])
    assert gen.apply_hunks("a\nb\nc\n", [h], "f") == "a\nb\nx\nc\n"
    with pytest.raises(gen.GenerateError, match="context differs"):
        gen.apply_hunks("a\nB\nc\n", [h], "f")


def test_index_lines_are_the_tags_blobs(tag_repo):
    """Every `index OLD..NEW` line of the series: OLD is the tag's blob of that file (zeros for a new file),
    NEW the blob of the file after the series up to that patch (git hash-object of the applied text)."""
    texts: dict[str, str] = {}
    checked = 0
    for name, patch in committed().items():
        for rel, body in _files(patch).items():
            m = re.match(r"(?:new file mode \d+\n)?index ([0-9a-f]+)\.\.([0-9a-f]+)", body)
            assert m, (name, rel, body[:200])
            old, new = m.groups()
            if rel not in texts:
                show = subprocess.run(["git", "--git-dir", str(tag_repo), "show", f"{TAG}:{rel}"],
                                      capture_output=True, text=True)
                texts[rel] = show.stdout if show.returncode == 0 else None
            before = texts[rel]
            want_old = _blob(before)[:len(old)] if before is not None else "0" * len(old)
            assert old == want_old, (name, rel)
            after = _apply_file(before or "", body)
            assert _blob(after)[:len(new)] == new, (name, rel)
            texts[rel] = after
            checked += 1
    assert checked == 5


def _blob(text: str) -> str:
    return subprocess.run(["git", "hash-object", "--stdin"], input=text, capture_output=True, text=True,
                          check=True).stdout.strip()


def _apply_file(text: str, body: str) -> str:
    """``text`` with the hunks of one file's diff section applied (exact context, as git apply would)."""
    lines, body_lines = text.splitlines(keepends=True), body.splitlines(keepends=True)
    out, pos, i = [], 0, 0
    while i < len(body_lines):
        m = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,(\d+))? @@", body_lines[i])
        i += 1
        if not m:
            continue
        old_n, new_n = int(m.group(2) or 1), int(m.group(3) or 1)
        start = int(m.group(1)) - (0 if old_n == 0 else 1)
        out += lines[pos:start]
        pos = start
        while old_n or new_n:
            ln = body_lines[i]
            i += 1
            if ln[0] in " -":
                assert lines[pos] == ln[1:], (pos, ln)
                pos, old_n = pos + 1, old_n - 1
            if ln[0] in " +":
                out.append(ln[1:])
                new_n -= 1
    return "".join(out + lines[pos:])


def test_series_applies_to_the_tag_with_git_apply_check(tmp_path, tag_repo):
    MIRROR = tag_repo
    g = tmp_path / "git"
    subprocess.run(["git", "init", "-q", "--bare", str(g)], check=True)
    (g / "objects/info/alternates").write_text(f"{MIRROR}/objects\n")
    env = dict(os.environ, GIT_INDEX_FILE=str(tmp_path / "index"))
    commit = subprocess.run(["git", "--git-dir", str(MIRROR), "rev-parse", "595.45.04^{commit}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run(["git", "--git-dir", str(g), "read-tree", commit], check=True, env=env)
    patches = sorted(str(p) for p in (UP / "series").glob("*.patch"))
    p = subprocess.run(["git", "--git-dir", str(g), "apply", "--check", "--cached", *patches],
                       env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    # and it would not apply twice (the check is real): apply, then check again
    subprocess.run(["git", "--git-dir", str(g), "apply", "--cached", *patches], env=env, check=True)
    p = subprocess.run(["git", "--git-dir", str(g), "apply", "--check", "--cached", *patches],
                       env=env, capture_output=True, text=True)
    assert p.returncode != 0


def _checkpatch() -> Path | None:
    """The kernel's scripts/checkpatch.pl: an unpacked linux-source (Debian's linux-source-6.1 in /usr/src, or a
    tree of the test cache), else the three files it needs taken out of /usr/src/linux-source-*.tar.xz."""
    cache = Path(os.environ.get("SPARK_MEMSAVER_TEST_CACHE", "/var/cache/spark-memsaver-tests"))
    found = sorted(glob.glob("/usr/src/linux-source-*/scripts/checkpatch.pl")) + \
        sorted(glob.glob(str(cache / "kernel" / "**" / "scripts" / "checkpatch.pl"), recursive=True)[:1])
    if found:
        return Path(found[0])
    tars = sorted(glob.glob("/usr/src/linux-source-*.tar.xz"))
    if not tars:
        return None
    dest = cache / "checkpatch" / Path(tars[-1]).name.removesuffix(".tar.xz")
    script = dest / "scripts" / "checkpatch.pl"
    if not script.exists():
        dest.mkdir(parents=True, exist_ok=True)
        top = Path(tars[-1]).name.removesuffix(".tar.xz")
        subprocess.run(["tar", "-xJf", tars[-1], "-C", str(dest), "--strip-components=1",
                        *(f"{top}/scripts/{f}" for f in ("checkpatch.pl", "spelling.txt", "const_structs.checkpatch"))],
                       check=True, timeout=600)
    return script


#: checkpatch types not applied to the hooks: uvm_mmu.[ch] are NVIDIA's files, indented with 4 spaces
#: (their house style, kept by the hunks), and this is not a kernel tree (no MAINTAINERS file).
NVIDIA_STYLE = "LEADING_SPACE,CODE_INDENT,SUSPECT_CODE_INDENT"


@pytest.mark.slow
def test_series_is_checkpatch_clean(tmp_path):
    """The kernel's checkpatch.pl: the pool patch with every check (bar MAINTAINERS), the hook patch with every
    check bar the 4-space indentation of NVIDIA's uvm_mmu.c: 0 errors, 0 warnings. Run from a directory outside
    any git tree (checkpatch changes behaviour inside one)."""
    cp = _checkpatch()
    if cp is None:
        raise needs.Missing("the kernel's scripts/checkpatch.pl", "apt-get install linux-source-6.1")
    p1, p2 = sorted((UP / "series").glob("*.patch"))
    for patch, ignore in ((p1, "FILE_PATH_CHANGES"), (p2, "FILE_PATH_CHANGES," + NVIDIA_STYLE)):
        r = subprocess.run(["perl", str(cp), "--no-tree", "--terse", "--show-types", "--ignore", ignore, str(patch)],
                           capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert r.returncode == 0 and r.stdout.strip() == "", (patch.name, r.stdout[-3000:])
    # the check is real: a trailing blank and a long line are reported
    bad = tmp_path / "bad.patch"
    bad.write_text(p1.read_text().replace("+#define PT_PACK_MIN_SLOT   256u\n",
                                          "+#define PT_PACK_MIN_SLOT   256u \n+" + "x" * 120 + "\n", 1)
                   .replace("@@ -0,0 +1,", "@@ -0,0 +1,9", 0))
    r = subprocess.run(["perl", str(cp), "--no-tree", "--terse", "--show-types", str(bad)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert "TRAILING_WHITESPACE" in r.stdout


@pytest.mark.compile
@pytest.mark.slow
def test_series_compiles_against_x86_64_headers(tmp_path, tag_repo):
    _, kdir = nvsrc.x86_headers()
    out = tmp_path / "out"
    p = subprocess.run([str(UP / "build-check"), str(tag_repo), str(kdir), "x86_64", str(out)],
                       capture_output=True, text=True, timeout=3600)
    result = json.loads((out / "result.json").read_text())
    assert p.returncode == 0 and result["status"] == "pass", (result["failures"], p.stdout[-2000:])
    assert result["apply_check"] == "pass" and result["spark_memsaver_tag"] == ""
    assert result["parms"] == ["uvm_pt_pack", "uvm_pt_pack_stats"]
