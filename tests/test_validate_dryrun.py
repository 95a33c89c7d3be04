"""`spark-memsaver validate --dry-run` (validate/dryrun.py): the plan of a run on this node, with nothing run or
written. It refuses what the run refuses (exit 2), is not applicable where the run is (exit 4), and never
initialises CUDA. No GPU here: the CUDA library is the gcc-built stand-in of tests/test_mutant_kills.py, which
stands in for NVIDIA's libcuda.so.1 (its cuInit records that it was called)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from spark_memsaver.validate import checks as vchecks
from spark_memsaver.validate import dryrun
from tests.test_mutant_kills import STANDIN, compile_standin
from tests.test_validate import HostMemoryCuda, by_name, run_worker_inline, stats_text, uvm_reading

REPO = Path(__file__).resolve().parent.parent
# the stand-in, plus a marker file that cuInit writes: the dry run must never initialise CUDA
MARKED = STANDIN.replace("OK(cuInit) ", "") + r"""
#include <stdio.h>
#include <stdlib.h>
int cuInit(unsigned f) { const char *m = getenv("CUINIT_MARK"); if (m) { FILE *o = fopen(m, "w"); if (o) fclose(o); } return 0; }
"""


@pytest.fixture(scope="module")
def libcuda(tmp_path_factory) -> Path:
    return compile_standin(tmp_path_factory.mktemp("libcuda"), MARKED)


def cli(args, env_extra, module="spark_memsaver"):
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"), **env_extra)
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    return subprocess.run(["/usr/bin/python3", "-m", module, *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("module", ["spark_memsaver", "spark_memsaver.validate.command"])
def test_the_plan_with_a_cuda_library_runs_nothing_and_writes_nothing(libcuda, tmp_path, module):
    state = tmp_path / "state/validate-last.json"
    mark = tmp_path / "cuinit-called"
    args = ["--max-gib", "3", "--threads", "6", "--duration", "9", "--report", str(tmp_path / "r.json"), "--dry-run"]
    env = {"SPARK_MEMSAVER_LIBCUDA": str(libcuda), "SPARK_MEMSAVER_VALIDATE_REPORT": str(state),
           "CUINIT_MARK": str(mark)}
    r = cli((["validate"] if module == "spark_memsaver" else []) + args, env, module)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "plan (dry run): spark-memsaver validate" and lines[-1] == "  nothing was run or written"
    text = r.stdout
    assert f"cuda:     {libcuda} (loaded, not initialised)" in text
    assert "at most 3.00 GiB (--max-gib), never more than 25% of the GPU's free memory" in text
    assert "6 threads, 9 s of allocation rounds" in text
    assert "checks:   " + ", ".join(dryrun.CHECKS) in text
    assert str(tmp_path / "r.json") in text
    assert not mark.exists(), "the dry run initialised CUDA"
    assert not state.exists() and not (tmp_path / "r.json").exists()
    j = cli((["validate"] if module == "spark_memsaver" else []) + args + ["--json"], env, module)
    doc = json.loads(j.stdout)
    assert j.returncode == 0 and doc["dry_run"] is True and doc["outcome"] == "would-run"
    assert doc["parameters"] == {"max_gib": 3.0, "duration": 9.0, "threads": 6}
    assert doc["budget_rule"]["max_bytes"] == 3 * 1024 ** 3 and doc["checks"] == list(dryrun.CHECKS)
    assert not mark.exists() and not state.exists()


def test_not_applicable_and_refused_as_the_run_is(tmp_path):
    """No CUDA library: exit 4 with the run's reason; bad options and --root: exit 2, as the run."""
    env = {"SPARK_MEMSAVER_LIBCUDA": "/nonexistent/libcuda.so.1",
           "SPARK_MEMSAVER_VALIDATE_REPORT": str(tmp_path / "s.json")}
    r = cli(["validate", "--dry-run", "--json"], env)
    doc = json.loads(r.stdout)
    assert r.returncode == 4 and doc["outcome"] == "not-applicable" and doc["checks"] == []
    assert "no CUDA driver library: cannot load /nonexistent/libcuda.so.1" in doc["reason"]
    assert not (tmp_path / "s.json").exists()                                       # the dry run saved nothing
    run = cli(["validate", "--json", "--report", str(tmp_path / "r.json")], env)      # the run itself says the same
    assert run.returncode == 4 and json.loads(run.stdout)["reason"] == doc["reason"]
    for args in (["--max-gib", "0"], ["--threads", "0"], ["--duration", "nan"]):
        r = cli(["validate", "--dry-run", *args], env)
        assert r.returncode == 2 and "error[validate-usage]" in r.stderr and "Traceback" not in r.stderr, args
    r = cli(["--root", str(tmp_path), "validate", "--dry-run"], env)
    assert r.returncode == 2 and "cannot use --root" in r.stderr


def test_the_check_list_is_the_runs(tmp_path):
    """dryrun.CHECKS against the code: the worker's data checks (through the host-memory stand-in of
    tests/test_validate.py), packing_checks' names on a packed module, then device-alloc-4gib and kernel-log."""
    ev = run_worker_inline(HostMemoryCuda(), min_budget=32 << 20, max_block=16 << 20)
    worker = list(by_name(ev["done"]["checks"]))
    b = uvm_reading(tmp_path, "b", stats_text(trees_packed=1, c256=(3, 1), c4096=(5, 1)))
    p = uvm_reading(tmp_path, "p", stats_text(trees_packed=2, c256=(300, 2), c4096=(40, 3)))
    packing = [c["name"] for c in vchecks.packing_checks(b, p, b)]
    assert list(dryrun.CHECKS) == worker + sorted(set(packing), key=packing.index) + ["device-alloc-4gib",
                                                                                       "kernel-log"]
