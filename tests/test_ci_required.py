"""tools/ci-required: CI fails when a test of its 64 KiB share did not run and pass (a skip included).

The JUnit reports here are pytest's own, written by a real inner pytest run over test files named as CI's are;
the required names are checked against the real test files' collection, so a rename cannot make the check
vacuous (every required test would then be "not run" and CI red, but this test says which name drifted)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "ci-required"


def _tool():
    loader = importlib.machinery.SourceFileLoader("ci_required", str(TOOL))
    spec = importlib.util.spec_from_loader("ci_required", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _report(tmp_path: Path, skip: str = "") -> Path:
    """A JUnit report from a real pytest run over stand-in files with CI's required names; ``skip`` names one
    test (module::name) to skip, as CI's budget or a missing tree would."""
    ci = _tool()
    root = tmp_path / "run"
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "__init__.py").write_text("")
    by_module: dict[str, list[str]] = {}
    for module, name in ci.REQUIRED:
        by_module.setdefault(module.split(".")[-1], []).append(name)
    for module, names in by_module.items():
        lines = ["import pytest", ""]
        plain = sorted({n.split("[")[0] for n in names})
        for base in plain:
            params = [n.split("[")[1].rstrip("]") for n in names if n.startswith(base + "[")]
            if params:
                lines.append(f"@pytest.mark.parametrize('case', {params!r})")
                lines.append(f"def {base}(case):")
                lines.append(f"    if '{module}::{base}[' + case + ']' == {skip!r}: pytest.skip('budget spent')")
            else:
                lines.append(f"def {base}():")
                lines.append(f"    if '{module}::{base}' == {skip!r}: pytest.skip('budget spent')")
            lines.append("")
        (root / "tests" / f"{module}.py").write_text("\n".join(lines))
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(root),
                    f"--junitxml={xml}", "tests"], cwd=root, capture_output=True, text=True, timeout=120)
    return xml


def test_all_required_passed_is_green(tmp_path):
    r = subprocess.run([str(TOOL), str(_report(tmp_path))], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all 9 required tests passed" in r.stdout


def test_a_skipped_64k_case_turns_ci_red(tmp_path):
    xml = _report(tmp_path, skip="test_kernel_pagetree::test_page_tree_passes_in_every_tier[64k-r595]")
    r = subprocess.run([str(TOOL), str(xml)], capture_output=True, text=True)
    assert r.returncode == 1, r.stdout
    assert "test_page_tree_passes_in_every_tier[64k-r595]: skipped (budget spent)" in r.stdout, r.stdout
    assert r.stdout.count("did not pass") == 1


def test_an_absent_case_or_unreadable_report_turns_ci_red(tmp_path):
    ci = _tool()
    found = ci.outcomes(str(_report(tmp_path)))
    del found[("tests.test_kernel_oom", "test_oom_checks_catch_a_broken_pool")]
    assert ci.missing(found) == ["tests.test_kernel_oom::test_oom_checks_catch_a_broken_pool: not run "
                                 "(absent from the report)"]
    bad = tmp_path / "bad.xml"
    bad.write_text("<testsuites><testsuite")
    r = subprocess.run([str(TOOL), str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and "cannot read the test report" in r.stderr


def test_required_names_are_the_real_tests():
    """Every required name is collected from the real test files (parametrized ids included)."""
    ci = _tool()
    files = sorted({"tests/" + m.split(".")[-1] + ".py" for m, _ in ci.REQUIRED})
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "PYTHONPATH": f"{REPO}:{REPO / 'daemon'}"})
    ids = set(r.stdout.split())
    for module, name in ci.REQUIRED:
        assert f"tests/{module.split('.')[-1]}.py::{name}" in ids, (name, r.stdout[-2000:])


def test_ci_run_checks_the_required_tests_after_a_full_green_run():
    text = (REPO / ".ci" / "run").read_text()
    assert '--junitxml="$junit"' in text
    assert 'tools/ci-required "$junit" || rc=1' in text
    assert text.index('tools/ci-required "$junit"') > text.index("rc=$?")
