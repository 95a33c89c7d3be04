"""One exit-code table for the whole CLI and one for `status --quiet` (spark_memsaver/exitcodes.py):
every named error exits with a code of the table, a missing piece (dkms, headers) is a refusal (1) however it is
found, `status --quiet` never says 0 where plain `status` finds a warning, 4 means not-applicable in both, and a
reader that closes the pipe early (`status | head -1`) is not an error (exit 0)."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import re
import subprocess
from pathlib import Path

import pytest

import spark_memsaver
from spark_memsaver import exitcodes as ec
from spark_memsaver.config import Config
from spark_memsaver.decide.status import evaluate
from spark_memsaver.errors import MemsaverError
from tests.support import sparkroot
from tests.test_decide import CASES
from spark_memsaver.model import world_of
from tests.support.worlds import typed

evaluate = typed(evaluate)   # dict snapshots -> model.World (tests/support/worlds.py)

REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
ENV.pop("SPARK_MEMSAVER_CONFIG", None)


def cli(*args, **kw):
    return subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", *args], capture_output=True, text=True,
                          env=ENV, timeout=120, **kw)


def _all_errors() -> list[type]:
    for m in pkgutil.walk_packages(spark_memsaver.__path__, "spark_memsaver."):
        if m.name.startswith(("spark_memsaver.service", "spark_memsaver.validate.worker")):
            continue          # pydbus/gi and the CUDA worker: their errors are MemsaverErrors all the same
        try:
            importlib.import_module(m.name)
        except ImportError:
            continue
    seen, todo = [], [MemsaverError]
    while todo:
        c = todo.pop()
        seen.append(c)
        todo.extend(c.__subclasses__())
    return seen


def test_every_named_error_exits_with_a_code_of_the_table():
    codes = {c for c, _ in ec.TABLE}
    errors = _all_errors()
    assert len(errors) > 40
    bad = [(e.__name__, e.exit_code) for e in errors if e.exit_code not in codes]
    assert bad == []


def test_a_missing_piece_is_a_refusal_whichever_piece():
    from spark_memsaver.act.dkms_errors import DkmsMissing, HeadersMissing
    assert DkmsMissing.exit_code == HeadersMissing.exit_code == ec.EXIT_PROBLEM
    assert DkmsMissing.remedy == "sudo apt-get install dkms"
    snap, _, _, _ = CASES["stock"]()                # the planner finds it missing too: the same remedy
    snap["dkms"]["available"] = False
    from spark_memsaver.decide.plan import stock_reason
    w = world_of(snap)
    assert stock_reason(w.kernels[0], w, Config(), {"580.142": {"supported": True}})[1:] == \
        ("dkms-missing", DkmsMissing.remedy)


def test_quiet_table_shares_the_meaning_of_the_main_table():
    main = dict(ec.TABLE)
    quiet = dict(ec.QUIET_TABLE)
    assert "not applicable" in main[4] and quiet[4] == "not-applicable"
    assert set(ec.QUIET_STATE.values()) <= set(quiet)
    assert ec.EXIT_FAILED not in quiet          # status does nothing midway: 3 is never a state
    from spark_memsaver.decide.status import STATES
    assert set(ec.QUIET_STATE) == set(STATES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_quiet_agrees_with_status_on_warnings(name):
    snap, config, state, _ = CASES[name]()
    v = evaluate(snap, config)
    doc = {"state": v.state, "findings": [f.to_dict() for f in v.findings]}
    plain, quiet = ec.status_code(doc), ec.quiet_code(doc)
    if plain != 0:
        assert quiet != 0, (name, doc)
    assert (quiet == ec.EXIT_NOT_APPLICABLE) == (v.state == "not-applicable"), (name, quiet)
    assert quiet == 0 or quiet in dict(ec.QUIET_TABLE)


def test_quiet_on_a_stock_node_with_a_warning_is_1():
    snap, _, _, _ = CASES["stock"]()
    snap["kernels"][0]["headers"] = False           # headers-missing: a warning on the running kernel
    v = evaluate(snap, Config())
    doc = {"state": v.state, "findings": [f.to_dict() for f in v.findings]}
    assert v.state == "stock" and ec.status_code(doc) == 1 and ec.quiet_code(doc) == 1


def test_quiet_through_the_cli(tmp_path):
    roots = {"active": sparkroot.make_spark_root(tmp_path / "a", uvm_loaded="ours", ours_installed="580.142"),
             "stock": sparkroot.make_spark_root(tmp_path / "s"),
             "nohdr": sparkroot.make_spark_root(tmp_path / "h", headers=False)}
    got = {}
    for name, root in roots.items():
        q = cli("--root", str(root), "status", "--quiet")
        p = cli("--root", str(root), "status", "--json")
        assert q.stdout == "" and q.stderr == ""
        got[name] = (json.loads(p.stdout)["state"], p.returncode, q.returncode)
    assert got["active"] == ("active", 0, 0) and got["stock"] == ("stock", 0, 0), got
    assert got["nohdr"][1] == 1 and got["nohdr"][2] == 1, got
    help_text = cli("status", "--help").stdout
    for code, meaning in ec.QUIET_TABLE:
        assert re.search(rf"^\s+{code}\s+{re.escape(meaning.replace('`', ''))}$", help_text, re.M), help_text


def test_closed_pipe_is_not_an_error(tmp_path):
    """A reader that goes away before or while we write: exit 0 and nothing on stderr, every time (before the
    fix, 7 runs in 12 of 'status | head -1' exited 1: click turns EPIPE into exit 1). A stock root whose plain
    status exits 0, so any 1 is the pipe's."""
    root = sparkroot.make_spark_root(tmp_path / "r")
    argv = ["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), "status", "--verbose"]
    assert cli(*argv[3:]).returncode == 0
    for _ in range(6):                  # the read end closed before the first write: EPIPE for sure
        r, w = os.pipe()
        p = subprocess.Popen(argv, stdout=w, stderr=subprocess.PIPE, env=ENV)
        os.close(w)
        os.close(r)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0 and err == b"", (p.returncode, err)
    for _ in range(6):                  # the shell's own pipe into head -1, as a user types it
        out = subprocess.run(["bash", "-c", " ".join(argv) + " | head -1; echo \"rc=${PIPESTATUS[0]}\""],
                             capture_output=True, text=True, env=ENV, timeout=120)
        assert out.stdout.splitlines()[-1] == "rc=0" and out.stderr == "", out

