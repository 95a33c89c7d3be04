"""tests/support/needs.py and the conftest hook: a test that needs what this machine lacks is skipped with the
reason, never where the thing exists, and never under tools/test (SPARK_MEMSAVER_TESTS_STRICT=1)."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support import needs

REPO = Path(__file__).resolve().parent.parent
ABSENT = "spark-memsaver-no-such-tool"


def _missing_exec(name: str) -> FileNotFoundError:
    try:
        subprocess.run([name, "--version"], capture_output=True)
    except FileNotFoundError as e:
        return e
    raise AssertionError(f"{name} ran")


def test_gap_is_named_only_when_the_thing_is_really_absent(monkeypatch):
    assert "not installed" in needs.environment_gap(_missing_exec(ABSENT))
    # a tool that exists here: its FileNotFoundError (e.g. a missing argument file) is a real failure
    e = FileNotFoundError(2, "No such file or directory", "sh")
    assert needs.environment_gap(e) is None
    # a path, not a command: never a machine gap
    assert needs.environment_gap(FileNotFoundError(2, "x", "/no/such/file")) is None
    assert needs.environment_gap(ModuleNotFoundError("x", name="json")) is None
    assert needs.environment_gap(ModuleNotFoundError("x", name="spark_memsaver_no_such_mod")) is not None
    from spark_memsaver.errors import CommandNotFound
    # a program the product does not run (a misspelt name in the code) is a failure, never a skip
    assert needs.environment_gap(CommandNotFound(f"'{ABSENT}' is not installed", remedy="r")) is None
    assert needs.environment_gap(CommandNotFound("'modprob' is not installed", remedy="r")) is None
    # one it runs, really absent (a PATH and sbin list without it): the machine's gap, with its package
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(needs, "_SBIN", ())
    assert needs.environment_gap(CommandNotFound("'dkms' is not installed", remedy="r")) == \
        "dkms is not installed (package dkms, tools/deps/*.txt)"
    monkeypatch.undo()
    assert needs.environment_gap(CommandNotFound("'sh' is not installed", remedy="r")) is None
    assert needs.environment_gap(RuntimeError("anything")) is None
    assert needs.environment_gap(needs.Missing("x", "y")) == "x is not available here (y)"


def test_product_programs_are_the_programs_the_product_runs_and_deps_install_them():
    """needs.PRODUCT_PROGRAMS names every program the product's code runs by a literal name (Host.run/stream
    argv[0], update-initramfs aside: it runs only where initramfs-tools is the host's), and each one's package
    is in tools/deps/*.txt (coreutils: Essential)."""
    import re
    code = "\n".join(p.read_text() for p in (REPO / "daemon/spark_memsaver").rglob("*.py"))
    ran = set(re.findall(r'(?:run|stream)\(\s*\[\s*"([^"]+)"', code)) - {"update-initramfs"}
    assert ran and ran <= set(needs.PRODUCT_PROGRAMS), sorted(ran - set(needs.PRODUCT_PROGRAMS))
    deps = set(" ".join(re.sub(r"#.*", "", p.read_text()) for p in (REPO / "tools/deps").glob("*.txt")).split())
    assert set(needs.PRODUCT_PROGRAMS.values()) - deps == {"coreutils"}


def test_require_skips_and_strict_fails(monkeypatch):
    monkeypatch.delenv(needs.STRICT_ENV, raising=False)
    needs.require("sh")
    with pytest.raises(pytest.skip.Exception, match=ABSENT):
        needs.require("sh", ABSENT)
    monkeypatch.setenv(needs.STRICT_ENV, "1")
    needs.require("sh")
    with pytest.raises(pytest.fail.Exception, match=ABSENT):
        needs.require(ABSENT)


def _run_suite(tmp_path, strict: bool) -> str:
    t = tmp_path / "test_gap.py"
    t.write_text(textwrap.dedent(f"""
        import subprocess, pytest

        @pytest.fixture
        def built():
            subprocess.run([{ABSENT!r}])

        def test_absent_tool_in_a_fixture(built):
            pass

        def test_absent_tool_in_the_test():
            subprocess.run([{ABSENT!r}])

        def test_present_tool_failing_is_a_failure():
            subprocess.run(["sh", "-c", "exit 3"], check=True)

        def test_product_running_a_misspelt_program_is_a_failure():
            from spark_memsaver.host import Host
            Host("/").run(["modprob", "--version"], timeout=5)

        @pytest.mark.needs({ABSENT!r})
        def test_marked():
            pass

        @pytest.mark.needs("sh")
        def test_marked_present():
            pass
    """))
    env = {k: v for k, v in os.environ.items() if k != needs.STRICT_ENV}
    if strict:
        env[needs.STRICT_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "daemon")])
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-rA",
                        "-q", "--rootdir", str(tmp_path), str(t)], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=120)
    return r.stdout


def test_hook_reports_absent_tools_as_skipped(tmp_path):
    out = _run_suite(tmp_path, strict=False)
    assert "2 failed, 1 passed, 3 skipped" in out, out
    assert "FAILED test_gap.py::test_present_tool_failing_is_a_failure" in out, out
    assert "FAILED test_gap.py::test_product_running_a_misspelt_program_is_a_failure" in out, out
    assert f"this machine lacks it: {ABSENT} is not installed" in out, out


def test_hook_converts_nothing_under_tools_test(tmp_path):
    out = _run_suite(tmp_path, strict=True)
    assert "3 failed, 1 passed, 2 errors" in out, out


def test_product_python_is_replaced_only_where_it_runs():
    from tests.conftest import product_argv
    v = "/opt/venv/bin/python3"
    assert product_argv(["/usr/bin/python3", "-m", "spark_memsaver"], v) == [v, "-m", "spark_memsaver"]
    assert product_argv(["setpriv", "--reuid=65534", "/usr/bin/python3", "-c", "x"], v) == \
        ["setpriv", "--reuid=65534", v, "-c", "x"]
    # an argument that merely names it (a shebang check, an ansible variable) stays
    assert product_argv(["grep", "-q", "/usr/bin/python3", "f"], v) == ["grep", "-q", "/usr/bin/python3", "f"]
    assert product_argv("/usr/bin/python3 -c x", v) == "/usr/bin/python3 -c x"
    assert product_argv(["/usr/bin/python3.11"], v) == ["/usr/bin/python3.11"]


def test_slow_budget(monkeypatch):
    monkeypatch.delenv(needs.SLOW_BUDGET_ENV, raising=False)
    assert needs.slow_budget_spent(now=1e12) is None
    monkeypatch.setenv(needs.SLOW_BUDGET_ENV, "60")
    needs.session_started()
    t0 = needs._STARTED
    assert needs.slow_budget_spent(now=t0 + 59) is None
    assert "60 s is the budget" in needs.slow_budget_spent(now=t0 + 61)
    monkeypatch.setenv(needs.SLOW_BUDGET_ENV, "soon")
    with pytest.raises(pytest.UsageError):
        needs.slow_budget_spent()


#: the run-shaping variables .ci/run exports: an inner run starts without them, then gets what a test gives it
_RUN_ENVS = (needs.SLOW_BUDGET_ENV, needs.T0_ENV, needs.WATCHDOG_ENV, needs.CI_SHARE_ENV)


def _inner_pytest(tmp_path, name: str, source: str, markers: str, **env: str) -> subprocess.CompletedProcess:
    """Run tests/conftest.py over ``source`` (written to ``name``) in a pytest of its own, with ``env`` set."""
    (tmp_path / name).write_text(textwrap.dedent(source))
    full = {k: v for k, v in os.environ.items() if k not in _RUN_ENVS}
    full.update(env, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "daemon")]))
    argv = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-rA", "-q",
            "-o", f"markers={markers}", "--rootdir", str(tmp_path), str(tmp_path / name)]
    return subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=full, timeout=120)


def test_slow_tests_past_the_budget_are_skipped_even_under_tools_test(tmp_path):
    source = """
        import pytest

        def test_fast():
            pass

        @pytest.mark.slow
        def test_slow():
            pass

        @pytest.mark.kernel
        def test_vm():
            pass
    """
    for budget, expect in (("0", "1 passed, 2 skipped"), ("3600", "3 passed")):
        r = _inner_pytest(tmp_path, "test_budget.py", source, "slow\nkernel",
                          **{needs.STRICT_ENV: "1", needs.SLOW_BUDGET_ENV: budget})
        assert expect in r.stdout, r.stdout


def test_the_budget_counts_from_the_ci_job_start(monkeypatch):
    monkeypatch.setenv(needs.SLOW_BUDGET_ENV, "60")
    monkeypatch.setenv(needs.T0_ENV, "1000")
    needs.session_started(now_wall=1050)             # pytest starts 50 s after the job (the package install)
    t = needs._STARTED + 50
    assert needs.slow_budget_spent(now=t + 9) is None
    assert "60 s is the budget" in needs.slow_budget_spent(now=t + 11)
    needs.session_started(now_wall=900)              # a T0 in the future counts as now
    assert needs.slow_budget_spent(now=needs._STARTED + 59) is None
    monkeypatch.setenv(needs.T0_ENV, "yesterday")
    with pytest.raises(pytest.UsageError):
        needs.session_started()
    monkeypatch.delenv(needs.T0_ENV)
    needs.session_started()


def test_watchdog_limit_parsing(monkeypatch):
    monkeypatch.delenv(needs.WATCHDOG_ENV, raising=False)
    assert needs.watchdog_limit(True) is None
    monkeypatch.setenv(needs.WATCHDOG_ENV, "600,1500")
    assert (needs.watchdog_limit(False), needs.watchdog_limit(True)) == (600, 1500)
    monkeypatch.setenv(needs.WATCHDOG_ENV, "0,1500")
    assert needs.watchdog_limit(False) is None
    for bad in ("600", "a,b", "-1,5", "nan,5"):
        monkeypatch.setenv(needs.WATCHDOG_ENV, bad)
        with pytest.raises(pytest.UsageError):
            needs.watchdog_limit(True)


def test_a_hung_test_is_stopped_by_the_watchdog_and_light_tests_run_first(tmp_path):
    source = """
        import subprocess, time
        import pytest

        ORDER = []

        @pytest.mark.slow
        def test_a_heavy_one_collected_first():
            ORDER.append("heavy")

        def test_hangs_in_a_child():
            ORDER.append("hang")
            subprocess.run(["sleep", "60"])

        def test_runs_after_it():
            ORDER.append("after")
            assert ORDER == ["hang", "after"]
    """
    t = time.monotonic()
    r = _inner_pytest(tmp_path, "test_hang.py", source, "slow", **{needs.WATCHDOG_ENV: "2,30"})
    assert time.monotonic() - t < 40, r.stdout
    assert "1 failed, 2 passed" in r.stdout, r.stdout
    assert "WatchdogExpired" in r.stdout and "test_hangs_in_a_child ran past 2 s" in r.stdout, r.stdout
    assert 'subprocess.run(["sleep", "60"])' in r.stdout, r.stdout      # where it hung


def test_ci_share_marked_tests_skip_only_under_ci(tmp_path):
    source = """
        import pytest

        @pytest.mark.ci_share("costs 20 min cold")
        def test_big():
            pass

        def test_small():
            pass
    """
    for share, expect in (("1", "1 passed, 1 skipped"), ("", "2 passed")):
        r = _inner_pytest(tmp_path, "test_share.py", source, "ci_share", **{needs.CI_SHARE_ENV: share})
        assert expect in r.stdout, r.stdout
        assert ("costs 20 min cold" in r.stdout) == (share == "1"), r.stdout


def test_tests_run_modprobe_with_a_private_module_configuration():
    """The suite does not read the host's product state: every modprobe a test runs on this machine names its
    module configuration (-C: a fixture root's etc/modprobe.d or a private one), so an installed spark-memsaver's
    install rule for nvidia_uvm (/lib/modprobe.d/spark-memsaver.conf, after `tools/run`) changes nothing a test
    reads. (Before: tests/test_dkms.py's --show-depends printed the rule instead of the files to insert.) A call
    inside a container (``c.run``/``self.c.run``) reads that container's own configuration."""
    import re
    bad = []
    for f in sorted((REPO / "tests").glob("test_*.py")):
        text = f.read_text()
        for m in re.finditer(r'(?<![.\w])(sh|subprocess\.run|subprocess\.check_output)\(\s*\[?\s*"modprobe"', text):
            depth, end = 0, m.start()
            for end in range(text.index("(", m.start()), len(text)):       # the whole call, parentheses matched
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth == 0:
                    break
            call = text[m.start():end + 1]
            if '"-C"' not in call:
                bad.append(f"{f.name}:{text.count(chr(10), 0, m.start()) + 1}")
    assert bad == [], bad


def test_tools_test_is_strict_whatever_the_environment_says():
    """tools/test (CI's entry) runs pytest with SPARK_MEMSAVER_TESTS_STRICT=1 set on its own exec line, after
    the caller's environment: an exported SPARK_MEMSAVER_TESTS_STRICT=0 cannot turn a missing tool into a skip."""
    text = (REPO / "tools/test").read_text()
    run = [ln for ln in text.splitlines() if ln.startswith("exec ")]
    assert len(run) == 1 and f" {needs.STRICT_ENV}=1 " in run[0] and "-m pytest" in run[0], run
    assert run[0].index(f"{needs.STRICT_ENV}=1") < run[0].index("/usr/bin/python3")
    assert text.count(needs.STRICT_ENV) == 1, "tools/test reads or unsets the strict switch somewhere else"


def test_heavy_first_tests_start_before_the_other_heavy_ones(tmp_path):
    """Light tests first, then heavy tests marked heavy_first (CI's 64 KiB kernel and cases), then the other heavy
    ones, each group in collection order: a budget spent by the other heavy tests cannot starve CI's 64 KiB share."""
    source = """
        import pytest

        ORDER = []

        @pytest.mark.slow
        def test_heavy_a():
            ORDER.append("heavy_a")

        @pytest.mark.kernel
        @pytest.mark.heavy_first
        def test_first_a():
            ORDER.append("first_a")

        def test_light():
            ORDER.append("light")

        @pytest.mark.slow
        @pytest.mark.heavy_first
        def test_first_b():
            ORDER.append("first_b")

        @pytest.mark.kernel
        def test_heavy_b():
            ORDER.append("heavy_b")

        def test_zz_order():
            pass

        def teardown_module():
            assert ORDER == ["light", "first_a", "first_b", "heavy_a", "heavy_b"], ORDER
    """
    r = _inner_pytest(tmp_path, "test_first.py", source, "slow\nkernel\nheavy_first")
    assert "6 passed" in r.stdout and "error" not in r.stdout.lower(), r.stdout
