"""What `status --json` imports on a warm Spark root (issue 38): the list below, and nothing else. A module that
joins the status path fails here until it is added to the list on purpose -- or imported where it is used.

Warm: the package's cache directory exists, so the parsed data files (yamlio) and kmod's answers
(observe/modcache.py) are kept from the first run; the second run is the one listed. Modules a bare
``python3 -c pass`` loads (site, encodings, whatever this Python's site-packages pull in) are not counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import sparkroot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.needs("modinfo", "depmod")

# the package's modules on the status path (observe -> world -> decide -> report, and the lean entry)
OURS = {
    "spark_memsaver", "spark_memsaver.cli", "spark_memsaver.cli.entry", "spark_memsaver.cli.status",
    "spark_memsaver.config", "spark_memsaver.decide", "spark_memsaver.decide.apt", "spark_memsaver.decide.c_expr",
    "spark_memsaver.decide.c_macros", "spark_memsaver.decide.hazards", "spark_memsaver.decide.hold",
    "spark_memsaver.decide.installability", "spark_memsaver.decide.mok", "spark_memsaver.decide.ours",
    "spark_memsaver.decide.plan", "spark_memsaver.decide.policy", "spark_memsaver.decide.qualification",
    "spark_memsaver.decide.sources", "spark_memsaver.decide.status", "spark_memsaver.decide.step",
    # status's own finding types and Secure Boot findings (moved out of decide/status.py, at its size limit)
    "spark_memsaver.decide.findings", "spark_memsaver.decide.sbfindings",
    "spark_memsaver.efi", "spark_memsaver.efi.der", "spark_memsaver.efi.mokvars", "spark_memsaver.efi.siglist",
    "spark_memsaver.efi.x509", "spark_memsaver.errors", "spark_memsaver.exitcodes", "spark_memsaver.hazard_table",
    "spark_memsaver.host", "spark_memsaver.host.fsutil", "spark_memsaver.host.paths", "spark_memsaver.host.records",
    "spark_memsaver.host.runner", "spark_memsaver.host.safetext", "spark_memsaver.logs", "spark_memsaver.model",
    "spark_memsaver.observe",
    "spark_memsaver.observe.builds", "spark_memsaver.observe.counters", "spark_memsaver.observe.guardlog",
    "spark_memsaver.observe.modcache", "spark_memsaver.observe.modules", "spark_memsaver.observe.mok",
    "spark_memsaver.observe.procmem",                       # the Memory line (issue 36): two small /proc files
    "spark_memsaver.observe.snapshot", "spark_memsaver.observe.sources", "spark_memsaver.record",
    "spark_memsaver.remedy", "spark_memsaver.report", "spark_memsaver.report.document", "spark_memsaver.versions",
    "spark_memsaver.vocabulary", "spark_memsaver.world", "spark_memsaver.world.manifest",
    "spark_memsaver.world.support", "spark_memsaver.yamlio",
    "spark_memsaver.opnames",       # the one table of operations: remedy.py's root commands (issue 34)
    "spark_memsaver.world.tree",    # the one source tree: qualification hashes the tree the build compiles
    "spark_memsaver.observe.programs", "spark_memsaver.decide.wayback",   # the way back's programs, by name (35)
    "spark_memsaver.digest",        # CPython's sha256 (not hashlib's libcrypto): the fixture's tree is complete now,
                                    # so qualification hashes its hooked files, as on every node with the driver's tree
}
# everything else, by top-level name (what a bare interpreter already has is not counted). Not here, on purpose:
# click (the lean entry), logging, subprocess, signal (nothing is logged or run on a warm root), yaml (the
# parsed copies), dataclasses, inspect, ast, typing (no code generation), datetime, shlex.
OTHERS = {"collections", "contextlib", "enum", "fnmatch", "functools", "ipaddress", "json", "keyword", "operator",
          "pathlib", "re", "reprlib", "struct", "urllib", "warnings", "time", "itertools", "copyreg", "types",
          "errno", "stat", "posixpath", "genericpath", "ntpath", "os", "io", "abc", "codecs", "encodings", "importlib"}

_PROBE = ("import sys, json, atexit\n"
          "atexit.register(lambda: sys.__stderr__.write('\\nMODULES ' + json.dumps(sorted(sys.modules)) + '\\n'))\n")


def _modules(code: str, *args: str) -> set[str]:
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    r = subprocess.run([sys.executable, "-c", _PROBE + code, *args], capture_output=True, text=True, env=env,
                       timeout=120)
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("MODULES ")]
    assert line, r.stderr[-3000:]
    return set(json.loads(line[-1][len("MODULES "):]))


def status_modules(root, parsed) -> set[str]:
    code = ("from spark_memsaver import yamlio\n"
            f"yamlio.DATA_CACHE = {str(parsed)!r}\n"
            "sys.argv = ['spark-memsaver', *sys.argv[1:]]\n"
            "from spark_memsaver.cli.entry import main\nmain()\n")
    args = ("--root", str(root), "status", "--json", "--direct")
    _modules(code, *args)                                   # the first run keeps the parsed data and kmod's answers
    return _modules(code, *args) - _modules("pass")


def test_status_imports_what_the_list_says(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "root", ours_installed=sparkroot.DRIVER, uvm_loaded="ours")
    (root / "var/cache/spark-memsaver").mkdir(parents=True)
    extra = status_modules(root, tmp_path / "parsed")
    ours = {m for m in extra if m.split(".")[0] == "spark_memsaver"}
    others = {m.split(".")[0] for m in extra if m.split(".")[0] != "spark_memsaver" and not m.startswith("_")}
    assert not ours - OURS, f"new on the status path: {sorted(ours - OURS)} -- add to OURS on purpose, or import " \
                            "it where it is used"
    if sys.version_info[:2] == (3, 11):                    # Debian 12's Python: the list is this interpreter's
        assert not others - OTHERS, f"new on the status path: {sorted(others - OTHERS)} -- add to OTHERS on " \
                                    "purpose, or import it where it is used"
    assert not {"click", "logging", "subprocess", "yaml", "dataclasses"} & others
