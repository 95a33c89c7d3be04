"""The lean status entry (cli/status.py, issue 38): a status command line is run without importing click, and says
byte for byte what the click command says -- stdout, stderr and the exit code -- on every node state and form
compared here; every line it does not read in full goes to click (so bad usage, --help and other commands are
click's own words by construction)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys

import pytest

from spark_memsaver.cli import status as lean_status
from tests.support import sparkroot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.needs("modinfo", "depmod")

FORMS = [[], ["--json"], ["-q"], ["--quiet"], ["-v"], ["--verbose"], ["--json", "-v"], ["-q", "--json"],
         ["-v", "-q"], ["--direct"], ["--direct", "--json"], ["--json", "--verbose", "--direct"]]
_STAMP = re.compile(r'"generated_at": "[^"]*"|generated [0-9T:Z-]+')


def _run(fn, argv, monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "argv", ["spark-memsaver", *argv])
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = fn(argv)
        except SystemExit as e:
            rc = e.code
    return rc, _STAMP.sub("<time>", out.getvalue()), _STAMP.sub("<time>", err.getvalue())


def _click(argv):
    from spark_memsaver.cli.main import cli
    cli.main(args=argv, prog_name="spark-memsaver")


def _states(tmp_path):
    """Spark-shaped roots over the dimensions status reads (the module, the driver, holders, Secure Boot)."""
    S = sparkroot
    variants = {
        "stock": {},
        "ours-loaded": dict(ours_installed=S.DRIVER, uvm_loaded="ours"),
        "ours-installed-not-loaded": dict(ours_installed=S.DRIVER, uvm_loaded="stock"),
        "stale-override": dict(ours_installed="580.95.05", uvm_loaded="stock"),
        "no-driver-loaded": dict(loaded_driver=None, uvm_loaded=None),
        "holders": dict(ours_installed=S.DRIVER, uvm_loaded="ours", holders=2),
        "secure-boot-on": dict(ours_installed=S.DRIVER, uvm_loaded="ours", secure_boot=True),
        "no-efi": dict(secure_boot=None),
        "no-headers": dict(headers=False),
        "two-kernels": dict(extra_kernels=("6.14.0-1013-nvidia-64k",)),
    }
    for name, kw in variants.items():
        yield name, S.make_spark_root(tmp_path / name, **kw)


def test_every_state_and_form_says_the_same_through_both_entries(tmp_path, monkeypatch):
    monkeypatch.delenv("SPARK_MEMSAVER_CONFIG", raising=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text("tier: [oops\n")
    other = tmp_path / "tier.yaml"
    other.write_text("tier: 256\n")
    checked = 0
    for name, root in _states(tmp_path):
        for form in FORMS:
            for cfg in ([], ["--config", str(bad)], [f"--config={other}"]):
                for argv in (["--root", str(root), *cfg, "status", *form],      # global options before
                             ["status", *form, "--root", str(root), *cfg]):      # ... and after the command
                    assert lean_status.parse(argv) is not None, argv            # the lean entry reads these
                    a = _run(lean_status.lean, argv, monkeypatch)
                    b = _run(_click, argv, monkeypatch)
                    assert a == b, (name, argv)
                    checked += 1
    assert checked == 10 * len(FORMS) * 3 * 2


def test_the_environment_config_is_read_as_click_reads_it(tmp_path, monkeypatch):
    root = sparkroot.make_spark_root(tmp_path / "r")
    (tmp_path / "c.yaml").write_text("tier: [oops\n")
    monkeypatch.setenv("SPARK_MEMSAVER_CONFIG", str(tmp_path / "c.yaml"))
    argv = ["--root", str(root), "status", "--json"]
    a, b = _run(lean_status.lean, argv, monkeypatch), _run(_click, argv, monkeypatch)
    # an unusable file is one config-invalid finding, and status goes on (issue 35): the same on both paths
    assert a == b and a[0] == 1 and '"code": "config-invalid"' in a[1], a


@pytest.mark.parametrize("argv", [
    ["status", "--help"], ["status", "-h"], ["--help"], ["status", "--bogus"], ["status", "-qv"], ["status", "x"],
    ["--debug", "status"], ["status", "--debug"], ["--root"], ["--root", "/", "status", "--json", "--json"],
    ["--root", "/", "status", "--root", "/"], ["status", "--config"], ["status", "--json", "status"],
    ["--root", "", "status"], ["--root", "/etc/hostname", "status"], ["--root", "/", "--root", "/", "status"],
    ["--version"], ["metrics"], ["status", "--"], ["--config", "-x", "status"], ["statu"], [],
])
def test_lines_the_lean_entry_does_not_read_go_to_click(argv):
    assert lean_status.parse(argv) is None


def test_completion_goes_to_click(monkeypatch):
    monkeypatch.setenv("_SPARK_MEMSAVER_COMPLETE", "bash_source")
    assert lean_status.parse(["status"]) is None


def test_status_imports_no_click(tmp_path):
    """The real entry point, in a fresh interpreter: status runs without click; --help still loads it."""
    root = sparkroot.make_spark_root(tmp_path / "r")
    code = ("import sys, atexit\n"
            "atexit.register(lambda: sys.__stderr__.write('\\nCLICK ' + str('click' in sys.modules) + '\\n'))\n"
            "sys.argv = ['spark-memsaver', *sys.argv[1:]]\n"
            "from spark_memsaver.cli.entry import main\nmain()\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    for args, loaded in ((["status", "--json"], False), (["status", "-q"], False), (["status", "--help"], True)):
        r = subprocess.run([sys.executable, "-c", code, "--root", str(root), *args], capture_output=True, text=True,
                           env=env, timeout=120)
        assert f"CLICK {loaded}" in r.stderr, (args, r.stderr[-2000:])


def test_logging_is_set_up_before_the_first_message_and_not_imported_before():
    """logs.py: the lean entry's log set-up waits for the first message, and that message is formatted as the
    click path's eager set-up formats it."""
    code = ("import sys\nfrom spark_memsaver import logs\nfrom spark_memsaver.cli.status import setup_logging\n"
            "setup_logging(False)\nassert 'logging' not in sys.modules\n"
            "log = logs.lazy('spark_memsaver.run')\nlog.debug('not shown')\nlog.warning('timed out after %ds', 5)\n"
            "assert 'logging' in sys.modules\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "daemon"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "WARNING spark_memsaver.run: timed out after 5s\n"
