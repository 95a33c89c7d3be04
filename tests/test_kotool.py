"""dkms/spark-memsaver-kotool fails closed (issue 12, defects 13 and 11).

Defect 13: a kernel config that cannot be read is not "does not sign", and the PRE_INSTALL guard
(`kotool guard`) refuses a signing kernel when the signing record is missing. Defect 11 (kotool part): every
subprocess has a timeout and its whole process group is killed; module reading never blocks (FIFO) and never
decompresses without bound.

Real parts: the kotool itself (as DKMS runs it and as the daemon imports it), gcc-built ELF objects with a real
.modinfo section (tests/support/sparkroot.py; they stand in for NVIDIA's modules, whose metadata is all that is
read), the real xz/zstd/modinfo/sh/sleep. Kernel configs are files in a prefix ($SPARK_MEMSAVER_KOTOOL_ROOT).

SPARK_MEMSAVER_TEST_KOTOOL=PATH runs these tests against another copy (e.g. the previous release's).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import sparkroot

pytestmark = pytest.mark.dkms

REPO = Path(__file__).resolve().parent.parent
KOTOOL = Path(os.environ.get("SPARK_MEMSAVER_TEST_KOTOOL") or REPO / "dkms/spark-memsaver-kotool")
K = "6.14.0-1015-nvidia-64k"
DRIVER = "550.163.01"
SIGNS = "CONFIG_ARM64=y\nCONFIG_MODULE_SIG=y\nCONFIG_MODVERSIONS=y\n"
NOT_SIGNS = "CONFIG_ARM64=y\n# CONFIG_MODULE_SIG is not set\n"


def load():
    loader = importlib.machinery.SourceFileLoader("kotool_under_test", str(KOTOOL))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


@pytest.fixture
def kt(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARK_MEMSAVER_KOTOOL_ROOT", str(tmp_path / "root"))
    return load()


def config(tmp_path, text, where="build"):
    rel = f"/lib/modules/{K}/build/.config" if where == "build" else f"/boot/config-{K}"
    return sparkroot.write(tmp_path / "root", rel, text)


def uvm(tmp_path, name="nvidia-uvm.ko", version=DRIVER):
    return sparkroot.make_module(tmp_path / "m" / name, sparkroot.uvm_fields(version, "OURS", K, True))


# --- defect 13: the kernel's signing policy is known or the answer is "refuse" --------------------------

def test_unreadable_kernel_config_is_not_not_signing(kt):
    with pytest.raises(kt.KoError, match=f"cannot tell whether kernel {K} checks module signatures"):
        kt.kernel_signs_modules(K)


def test_config_that_says_neither_is_not_not_signing(kt, tmp_path):
    config(tmp_path, "CONFIG_ARM64=y\n", where="boot")
    with pytest.raises(kt.KoError, match="says neither"):
        kt.kernel_signs_modules(K)


@pytest.mark.parametrize("text,where,answer", [(SIGNS, "build", True), (SIGNS, "boot", True),
                                               (NOT_SIGNS, "build", False), (NOT_SIGNS, "boot", False)])
def test_config_answers(kt, tmp_path, text, where, answer):
    config(tmp_path, text, where)
    assert kt.kernel_signs_modules(K) is answer


def test_verify_with_unreadable_config_is_a_problem(kt, tmp_path):
    ko = uvm(tmp_path)
    res = kt.verify(str(ko), K, DRIVER, signing={"serial": "01AB", "subject": "x"})
    assert not res["ok"]
    assert any("cannot tell whether kernel" in p for p in res["problems"]), res["problems"]


def test_verify_on_a_signing_kernel_needs_the_signing_record(kt, tmp_path):
    config(tmp_path, SIGNS)
    ko = uvm(tmp_path)
    res = kt.verify(str(ko), K, DRIVER, signing=None)
    assert any("no signing record" in p for p in res["problems"]), res["problems"]
    assert res["facts"]["signing_applies"] is True


def _guard(tmp_path, meta=None, record=None):
    """`kotool guard K aarch64` as DKMS's PRE_INSTALL runs it: in the source dir, with the built module in
    the DKMS tree."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    rec_path = tmp_path / "signing.json"
    if record is not None:
        rec_path.write_text(record)
    meta = meta if meta is not None else {"package": "spark-memsaver-uvm", "dkms_version": f"{DRIVER}-0.1.0",
                                          "driver_version": DRIVER, "patch_id": "uvm-pt-pack/1",
                                          "signing_record": str(rec_path)}
    (src / "spark-memsaver.json").write_text(json.dumps(meta))
    tree = tmp_path / "dkms"
    sparkroot.make_module(tree / f"spark-memsaver-uvm/{DRIVER}-0.1.0/{K}/aarch64/module/nvidia-uvm.ko",
                          sparkroot.uvm_fields(DRIVER, "OURS", K, True))
    env = dict(os.environ, SPARK_MEMSAVER_DKMS_TREE=str(tree), SPARK_MEMSAVER_KOTOOL_ROOT=str(tmp_path / "root"))
    return subprocess.run([sys.executable, str(KOTOOL), "guard", K, "aarch64"], cwd=src, env=env,
                          capture_output=True, text=True, timeout=120)


def test_guard_refuses_when_the_kernel_config_cannot_be_read(tmp_path):
    r = _guard(tmp_path, record=json.dumps({"serial": "01AB", "subject": "CN=x"}))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"cannot tell whether kernel {K} checks module signatures" in r.stderr, r.stderr


@pytest.mark.parametrize("record", [None, "", "[]", '{"subject": "CN=x"}'], ids=["missing", "empty", "list",
                                                                                  "no-serial"])
def test_guard_refuses_a_signing_kernel_without_a_signing_record(tmp_path, record):
    config(tmp_path, SIGNS)
    r = _guard(tmp_path, record=record)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "signing record" in r.stderr and "refusing to install" in r.stderr, r.stderr


def test_guard_on_a_kernel_that_does_not_sign_needs_no_record(tmp_path):
    # control: the refusal above is about signing, not about anything else the fixture lacks
    config(tmp_path, NOT_SIGNS)
    r = _guard(tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr   # no nvidia.ko is selected for K here
    assert "signing record" not in r.stderr and "no nvidia.ko is selected" in r.stderr, r.stderr


@pytest.mark.parametrize("meta", [[], "text", {"package": "p"}], ids=["list", "string", "fields-missing"])
def test_guard_refuses_a_bad_source_record_without_a_traceback(tmp_path, meta):
    config(tmp_path, NOT_SIGNS)
    r = _guard(tmp_path, meta=meta)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "spark-memsaver.json" in r.stderr


# --- defect 11: bounded subprocesses and reads ------------------------------------------------------------

def test_subprocess_timeout_kills_the_process_group(kt, tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    t0 = time.monotonic()
    with pytest.raises(kt.KoError, match="no answer within 1 s"):
        kt._run(["sh", "-c", f"sleep 300 & echo $! > {pidfile}; wait"], timeout=1)
    assert time.monotonic() - t0 < 30
    pid = int(pidfile.read_text())
    stat = Path(f"/proc/{pid}/stat")

    def state() -> str:
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return "gone"

    # killed: gone, or a zombie waiting for a reaper (a container's pid 1 may not reap). SIGKILL takes effect
    # when the process next runs, so a busy machine may show it running for a moment: give it 10 s, not 300.
    deadline = time.monotonic() + 10
    while state() not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state() in ("gone", "Z"), state()


def test_subprocess_output_is_bounded(kt):
    with pytest.raises(kt.KoError, match="more than 4096 bytes"):
        kt._run(["sh", "-c", "exec yes"], max_out=4096, timeout=30)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "nvidia-uvm.ko"
    os.mkfifo(fifo)
    code = (f"import importlib.machinery as m; k = m.SourceFileLoader('k', {str(KOTOOL)!r}).load_module()\n"
            f"try:\n    k.modinfo({str(fifo)!r})\nexcept k.KoError as e:\n    print('refused:', e)\n")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("reading a FIFO as a module blocked")
    assert "not a regular file" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("tool,suffix", [("xz", ".xz"), ("zstd", ".zst"), ("gzip", ".gz")])
def test_decompression_is_bounded(kt, tmp_path, monkeypatch, tool, suffix):
    monkeypatch.setattr(kt, "MAX_MODULE_BYTES", 1 << 20, raising=False)
    raw = tmp_path / "big.ko"
    raw.write_bytes(b"\0" * (4 << 20))
    subprocess.run([tool, "-q", "-f", str(raw)], check=True)
    with pytest.raises(kt.KoError, match="more than"):
        kt.read_module_bytes(str(raw) + suffix)


@pytest.mark.parametrize("tool,suffix", [("xz", ".xz"), ("zstd", ".zst"), ("gzip", ".gz")])
def test_damaged_compressed_module_is_a_problem_not_a_crash(kt, tmp_path, tool, suffix):
    config(tmp_path, NOT_SIGNS)
    ko = uvm(tmp_path)
    subprocess.run([tool, "-q", "-f", str(ko)], check=True)
    comp = Path(str(ko) + suffix)
    comp.write_bytes(comp.read_bytes()[:60])
    res = kt.verify(str(comp), K, DRIVER)
    assert not res["ok"] and res["problems"][0].startswith(f"cannot read {comp}"), res["problems"]


@pytest.mark.parametrize("tool,suffix", [("xz", ".xz"), ("zstd", ".zst"), ("gzip", ".gz")])
def test_compressed_module_reads(kt, tmp_path, tool, suffix):
    # control: the bounds do not stop a real module of any format
    ko = uvm(tmp_path)
    subprocess.run([tool, "-q", "-f", str(ko)], check=True)
    info, _ = kt.modinfo(str(ko) + suffix)
    assert info["version"] == DRIVER and info["spark_memsaver"] == "uvm-pt-pack/1"
