"""`spark-memsaver status` end to end: the real CLI as a subprocess, against this host and Spark-like roots.

The Spark roots come from tests/support/sparkroot.py (real-format files, real ELF modules, real depmod)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from tests.support import sparkroot

REPO = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((REPO / "daemon/spark_memsaver/report/status.schema.json").read_text())


def cli(*args, env=None, input=None):
    e = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    e.pop("SPARK_MEMSAVER_CONFIG", None)
    if env:
        e.update(env)
    return subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", *args], capture_output=True, text=True,
                          env=e, input=input, timeout=60)


def status_json(*args):
    r = cli(*args, "status", "--json", "--direct")
    assert r.returncode in (0, 1), r.stderr
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert "Traceback" not in r.stderr
    return r.returncode, doc


def host_has_nvidia_driver() -> bool:
    """Independent of the code under test: NVIDIA sources, a loaded nvidia, or an nvidia.ko on disk.
    (Build machines have none, unless another test of this suite is running against this host.)"""
    import glob
    return bool(glob.glob("/usr/src/nvidia-*") or os.path.exists("/sys/module/nvidia")
                or glob.glob("/lib/modules/*/**/nvidia.ko*", recursive=True))


def test_this_host_says_not_applicable_and_why():
    rc, doc = status_json()
    assert doc["host"]["page_size"] == os.sysconf("SC_PAGE_SIZE")
    assert doc["host"]["kernel"] == os.uname().release
    codes = [f["code"] for f in doc["findings"]]
    if host_has_nvidia_driver():
        assert doc["state"] != "not-applicable" and "no-nvidia-driver" not in codes
        return
    assert doc["state"] == "not-applicable"
    assert rc == 0
    assert "no-nvidia-driver" in codes


def test_this_host_text_output_is_readable():
    r = cli("status", "--direct")
    assert r.returncode in (0, 1)
    assert "State:" in r.stdout and "Kernel:" in r.stdout and "remedy:" in r.stdout
    if not host_has_nvidia_driver():
        assert r.returncode == 0 and "not-applicable" in r.stdout and "No NVIDIA driver" in r.stdout


@pytest.fixture
def spark(tmp_path):
    return sparkroot.make_spark_root(tmp_path / "root")


def test_spark_stock(spark):
    rc, doc = status_json("--root", str(spark))
    assert rc == 0
    assert doc["state"] == "stock"
    assert doc["host"] == {"kernel": sparkroot.SPARK_KERNEL, "arch": "aarch64", "page_size": 65536,
                           "hostname": sparkroot.HOSTNAME, "machine_id": sparkroot.MACHINE_ID}
    assert doc["schema"] == 2 and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["generated_at"])
    assert doc["driver"]["loaded_version"] == "580.142"
    assert doc["driver"]["sources"][0]["version"] == "580.142"
    assert doc["uvm"]["loaded"] and not doc["uvm"]["patched"]
    assert doc["uvm"]["srcversion"] == sparkroot.STOCK_UVM_SRCVERSION
    (k,) = doc["kernels"]
    assert k["running"] and k["page_size"] == 65536 and k["headers"]
    sel = k["uvm_selected"]
    assert sel["path"] == f"/lib/modules/{sparkroot.SPARK_KERNEL}/kernel/nvidia-580-open/nvidia-uvm.ko"
    assert sel["version"] == "580.142" and sel["patched"] is False
    assert k["nvidia_version"] == "580.142"
    assert doc["memory"]["total"] == 128452160 * 1024
    assert doc["memory"]["available"] == 119876544 * 1024
    assert doc["memory"]["pagetable_backing"] is None


def test_spark_active_reports_counters(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r", uvm_loaded="ours", ours_installed="580.142")
    rc, doc = status_json("--root", str(root))
    assert doc["state"] == "active", doc["findings"]
    assert doc["uvm"]["patched"]
    p = doc["uvm"]["packing"]
    # 52,989 tables of 256 B in 4 KiB slots: 16 per 64 KiB page -> 3312 pages; 259 of 4 KiB -> 17 pages.
    assert p["classes"]["256"]["pages"] == 3312 and p["classes"]["4096"]["pages"] == 17
    assert doc["memory"]["pagetable_backing"] == (3312 + 17) * 65536
    assert doc["memory"]["saved"] == (52989 + 259 - 3312 - 17) * 65536
    assert doc["kernels"][0]["uvm_selected"]["signer"] == "spark-memsaver fixture signing key"


def test_spark_mismatch_is_an_error_exit_1(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r", ours_installed="575.51.02")
    rc, doc = status_json("--root", str(root))
    assert rc == 1
    assert doc["state"] == "needs-attention"
    assert "override-driver-mismatch" in [f["code"] for f in doc["findings"]]


def test_holders_are_listed(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r", holders=2)
    rc, doc = status_json("--root", str(root))
    assert sorted(h["pid"] for h in doc["uvm_holders"]) == [4242, 4243]
    assert {h["comm"] for h in doc["uvm_holders"]} == {"vllm-worker", "python3"}


def test_root_without_a_system_is_exit_2(tmp_path):
    r = cli("--root", str(tmp_path), "status", "--json")
    assert r.returncode == 2
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "inspection-impossible" and err["remedy"]
    assert "Traceback" not in r.stderr


def test_root_that_does_not_exist_is_usage_error(tmp_path):
    r = cli("--root", str(tmp_path / "nope"), "status")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr + r.stdout


def test_last_validation_report_is_shown(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r")
    sparkroot.write(root, "/var/lib/spark-memsaver/validate-last.json", json.dumps(
        {"outcome": "passed", "reason": "data checks passed; stock module: counters absent",
         "finished_at": "2026-11-30T02:20:00Z"}))
    rc, doc = status_json("--root", str(root))
    assert doc["records"]["last_validation"]["outcome"] == "passed"
    r = cli("--root", str(root), "status", "--direct")
    assert "Last validation:" in r.stdout and "passed: data checks passed" in r.stdout
