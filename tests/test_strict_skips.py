"""Strict means strict: every skip in tests/ goes through tests/support/needs.py.

needs.py decides, per kind, whether a skip may happen under tools/test (SPARK_MEMSAVER_TESTS_STRICT=1, CI):
a missing tool, service, input or root (``needs.require``/``absent``/``root``, the ``needs`` marker) is a
failure there; only what CI does not get by design (``needs.beyond_ci``: opt-in heavy runs, inputs outside the
shared directory) or what this machine's nature makes meaningless (``needs.not_applicable``) skips everywhere.
A direct ``pytest.skip``/``skipif``/``importorskip`` would bypass that decision, so this check fails on any.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ALLOWED = {REPO / "tests/support/needs.py"}
BANNED_CALLS = {"skip", "importorskip", "xfail"}
BANNED_MARKS = {"skip", "skipif"}


def direct_skips(source: str) -> list[tuple[int, str]]:
    """(line, text) of every direct pytest skip in ``source``."""
    found = []
    tree = ast.parse(source)
    # pytest.skip.Exception (catching a skip, as tests/test_needs.py does) is not a skip
    caught = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "Exception"}
    for node in ast.walk(tree):
        if id(node) in caught:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "pytest":
            for a in node.names:
                if a.name in BANNED_CALLS | {"mark"}:
                    found.append((node.lineno, f"from pytest import {a.name}"))
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id == "pytest" and node.attr in BANNED_CALLS:
            found.append((node.lineno, f"pytest.{node.attr}"))
        if isinstance(v, ast.Attribute) and v.attr == "mark" and isinstance(v.value, ast.Name) \
                and v.value.id == "pytest" and node.attr in BANNED_MARKS:
            found.append((node.lineno, f"pytest.mark.{node.attr}"))
    return sorted(set(found))


def test_the_check_finds_each_form():
    src = ("import pytest\nfrom pytest import skip\n@pytest.mark.skipif(True, reason='x')\ndef t():\n"
           "    pytest.skip('no zstd')\n    pytest.importorskip('yaml')\n    m = pytest.mark.skip\n")
    assert [t for _, t in direct_skips(src)] == ["from pytest import skip", "pytest.mark.skipif", "pytest.skip",
                                                  "pytest.importorskip", "pytest.mark.skip"]
    assert direct_skips("from tests.support import needs\nneeds.require('zstd')\nneeds.beyond_ci('a', 'b')\n"
                        "with pytest.raises(pytest.skip.Exception):\n    pass\n") == []


def test_no_test_file_skips_directly():
    bad = []
    for p in sorted((REPO / "tests").rglob("*.py")):
        if p in ALLOWED:
            continue
        bad += [f"{p.relative_to(REPO)}:{line}: {text}" for line, text in direct_skips(p.read_text())]
    assert not bad, "skip through tests/support/needs.py (require/absent/root/beyond_ci/not_applicable):\n" + \
        "\n".join(bad)
