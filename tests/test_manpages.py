"""The man pages render cleanly with the real tools: ``groff -ww -man -Tutf8`` and man-db's ``man --warnings``
print nothing on stderr, and every ``.TP`` entry has its whole tag on the tag line (a tag spread over
several input lines renders its tail as the entry's body: "install [--kernel" and then "K | --all] ...").
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support import needs

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted((REPO / "docs").glob("*.8"))
ENV = dict(os.environ, LC_ALL="C.UTF-8", MANWIDTH="80", MAN_KEEP_FORMATTING="", MANPAGER="cat", PAGER="cat")


def _need(tool: str, pkg: str) -> str:
    needs.require(tool, remedy=f"apt-get install {pkg}; tools/deps/ops.txt")
    path = needs.which(tool)
    if b"has been minimized" in Path(path).read_bytes()[:4096]:   # Ubuntu's minimized image: man is a stub
        needs.absent(f"{pkg}'s {tool}", f"{path} is the 'unminimize' stub of a minimized Ubuntu")
    return path


def _plain(text: str) -> str:
    """Roff source text without escapes: what the reader sees of one input line."""
    text = re.sub(r"\\f(\[[^\]]*\]|\(..|.)", "", text)
    text = text.replace("\\-", "-").replace("\\c", "").replace("\\ ", " ").replace("\\(em", "-")
    return re.sub(r"\\.", "", text)


def tp_tag_problems(source: str) -> list[str]:
    """Entries whose .TP tag does not stand on one input line: the tag line continues (``\\c``), or its
    brackets do not balance (the rest went to the next line, i.e. into the body)."""
    lines = source.splitlines()
    problems = []
    for i, line in enumerate(lines):
        if line.strip() != ".TP" or i + 1 >= len(lines):
            continue
        tag = lines[i + 1]
        shown = _plain(re.sub(r'^\.(B|I|BR|RB|BI|IB|IR|RI)\s+', "", tag).replace('"', ""))
        if tag.rstrip().endswith("\\c") or shown.count("[") != shown.count("]"):
            problems.append(f"line {i + 2}: {tag!r}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_groff_ww_clean(page):
    groff = _need("groff", "groff")
    r = subprocess.run([groff, "-ww", "-man", "-Tutf8", str(page)], capture_output=True, text=True, env=ENV)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert len(r.stdout.splitlines()) > 20


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_man_warnings_clean(page):
    man = _need("man", "man-db")
    r = subprocess.run([man, "--warnings", "-l", str(page)], capture_output=True, text=True, env=ENV)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "NAME" in r.stdout


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_tp_tags_on_one_line(page):
    assert tp_tag_problems(page.read_text()) == []


def test_command_tags_render_whole():
    """The COMMANDS entries as a reader sees them: each tag line complete, e.g. the install synopsis."""
    man = _need("man", "man-db")
    out = subprocess.run([man, "-l", str(REPO / "docs/spark-memsaver.8")], capture_output=True, text=True,
                         env=dict(ENV, MANWIDTH="120")).stdout
    section = out.split("COMMANDS", 1)[1].split("EXIT STATUS", 1)[0]
    tags = [l.strip() for l in section.splitlines() if re.match(r"^ {7}\S", l)]
    assert "install [--kernel K | --all] [--dry-run] [--json]" in tags, tags
    assert "validate [--max-gib N] [--duration S] [--threads N] [--report FILE] [--json] [--dry-run]" in tags, tags
    for t in tags:
        assert t.count("[") == t.count("]"), t


def test_checker_flags_a_multi_line_tag():
    bad = '.TP\n.BR install " [" \\-\\-kernel\n.IR K | \\c\n.BR \\-\\-all "] [" \\-\\-json ]\nBody.\n'
    assert tp_tag_problems(bad) == ["line 2: '.BR install \" [\" \\\\-\\\\-kernel'"]
    assert tp_tag_problems('.TP\n\\fBinstall\\fR [\\fB\\-\\-all\\fR]\nBody.\n') == []


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_pages_name_the_real_unit(page):
    text = _plain(page.read_text())
    assert not re.search(r"spark-memsaver\.service|-u spark-memsaver\b(?!d)|start spark-memsaver\b(?!d)", text)
