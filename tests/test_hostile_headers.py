"""Hostile and odd nv-linux.h content never stops `status` (decide/c_expr.py, c_macros.py, hazards.py).

Each case is a text that stopped the whole of `spark-memsaver status` (exit 3, or a run without end) before
the readers were bounded: it is put into the driver source of a Spark root (tests/support/sparkroot.py; the
595.45.04 excerpt of NVIDIA's nv-linux.h follows it, so the version rule says "affected") and `status --json`
runs as a user would run it, under a generous wall-clock bound. Either the text is read (the content decides)
or the check says it could not read the file and the driver version decides: never exit 3, never a hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from spark_memsaver.decide import c_expr, c_macros
from spark_memsaver.decide import hazards as hz
from tests.test_hazards import K64, REPO, TABLE, excerpt, node

BOUND_S = 60          # a normal status takes ~1 s; the unbounded readers ran for minutes (or forever)
MACRO = "NV_DMA_SUBMAP_MAX_PAGES"


def _chain(n: int) -> str:
    """`#define M(i+1) (Mi+Mi)`: exponential when each use is resolved again (473 bytes ran over 20 s)."""
    return "#define M0 1\n" + "".join(f"#define M{i + 1} (M{i}+M{i})\n" for i in range(n))


CASES = {
    # name: (text before the excerpt, what decides: "content" or "version", words of the finding)
    "400 nested parentheses": ("#if " + "(" * 400 + "1" + ")" * 400 + "\n#endif\n", "version", "nested"),
    "1200 negations": ("#if " + "!" * 1200 + "1\n#endif\n", "version", "nested"),
    "1500-deep define chain": ("#define D0 1\n" + "".join(f"#define D{i + 1} (D{i})\n" for i in range(1500))
                               + "#if D1500\n#endif\n", "version", "nested"),
    "4301-digit literal": ("#if " + "7" * 4301 + "\n#endif\n", "version", "digits"),
    "invalid octal literal": ("#if 08\n#endif\n", "content", None),     # found by tests/test_fuzz.py
    "doubling define chain": (_chain(40) + "#if M40 > 0\n#endif\n", "content", None),
    "1.9 MiB of continuation lines": ("#define NV_LONG_TABLE \\\n" + "1\\\n" * 650_000 + "2\n", "content", None),
    "3 MiB header": ("/*" + " " * (3 << 20) + "*/\n", "version", "larger than"),
}


def _status(root: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    t0 = time.monotonic()
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), "status", "--json",
                        "--direct"], capture_output=True, text=True, env=env, timeout=BOUND_S)
    return r, time.monotonic() - t0


@pytest.mark.parametrize("name", list(CASES))
def test_status_survives_a_hostile_header(tmp_path, name):
    prefix, decided_by, words = CASES[name]
    root = node(tmp_path, version="595.45.04", page_size=K64)
    h = root / "usr/src/nvidia-595.45.04/common/inc/nv-linux.h"
    h.write_text(prefix + excerpt("595.45.04"))
    r, seconds = _status(root)
    assert r.returncode == 1, (r.returncode, seconds, r.stderr[-2000:])   # a warning: "a problem was found"
    doc = json.loads(r.stdout)
    codes = {f["code"]: f for f in doc["findings"]}
    hazard = codes["driver-hazard-dma-submap"]
    if decided_by == "content":
        assert "decided from nv-linux.h" in hazard["message"] and "hazard-check-failed" not in codes
    else:
        assert "decided by the driver version" in hazard["message"]
        failed = codes["hazard-check-failed"]
        assert failed["severity"] == "info" and "hazard check could not read nv-linux.h" in failed["message"]
        assert words in failed["message"], failed["message"]


# --- the same cases at the reader level: a named CEvalError (CLimitError) or a value, quickly --------------

READER_CPU_S = 20     # CPU seconds for one reader call here (each takes under 1 s; before: minutes, or without end)


class _PastBound(BaseException):
    """Raised by the CPU timer (a BaseException: no reader's `except Exception` can swallow it)."""


@contextlib.contextmanager
def cpu_bound(seconds: float = READER_CPU_S):
    """Stop the block after ``seconds`` of CPU time (ITIMER_VIRTUAL; the watchdog's SIGALRM is left alone) and
    fail: a reader that went exponential again fails here instead of running until killed."""
    def expire(signum, frame):
        raise _PastBound()
    previous = signal.signal(signal.SIGVTALRM, expire)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield
    except _PastBound:
        pytest.fail(f"the reader ran past {seconds} s of CPU time (stopped)")
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)


@pytest.mark.parametrize("name", [n for n in CASES if n != "3 MiB header"])
def test_reader_bounds(name):
    prefix, decided_by, words = CASES[name]
    text = prefix + f"#define {MACRO} 1\n"
    t0 = time.monotonic()
    with cpu_bound():
        if decided_by == "content":
            assert c_macros.macro_value(text, MACRO, K64) == 1
        else:
            with pytest.raises(c_expr.CLimitError, match=words):
                c_macros.macro_value(text, MACRO, K64)
    assert time.monotonic() - t0 < BOUND_S


@cpu_bound()
def test_limits_inside_the_macro_value():
    deep = "#define D0 1\n" + "".join(f"#define D{i + 1} (D{i}+1)\n" for i in range(1500)) + f"#define {MACRO} D1500\n"
    with pytest.raises(c_expr.CLimitError, match="nested"):
        c_macros.macro_value(deep, MACRO, K64)
    # a value past 64 bits is not a preprocessor value (intmax_t): named, not a many-megabyte integer
    square = "#define S0 3\n" + "".join(f"#define S{i + 1} (S{i}*S{i})\n" for i in range(40)) + f"#define {MACRO} S40\n"
    with pytest.raises(c_expr.CEvalError, match="out of range"):
        c_macros.macro_value(square, MACRO, K64)
    # work: one long expression, and many cheap ones, stop at a named limit (not after minutes)
    with pytest.raises(c_expr.CLimitError, match="tokens"):
        c_macros.macro_value("#if " + "1+" * 200_000 + "1\n#endif\n" + f"#define {MACRO} 1\n", MACRO, K64)
    chain = "#define D0 1\n" + "".join(f"#define D{i + 1} (D{i}+1)\n" for i in range(40))
    with pytest.raises(c_expr.CLimitError, match="operands"):
        c_macros.macro_value(chain + "#define X 1\n#if D40\n#endif\n" * 3000 + f"#define {MACRO} 1\n", MACRO, K64)
    # C division truncates toward zero, exactly (a float quotient lost the low bits past 2**53)
    assert c_macros.macro_value("#define Q (-((1 << 62) + 3) / 3)\n", "Q", K64) == -(((1 << 62) + 3) // 3)
    assert c_macros.macro_value("#define R (-7 % 3)\n", "R", K64) == -1
    # the real expressions are far inside the limits
    assert c_macros.macro_value("#define A ((NvU32)(((NV_U32_MAX >> PAGE_SHIFT) + 1) - (SZ_2M >> PAGE_SHIFT)))\n",
                                "A", K64) == 65536 - 32


def test_assess_turns_any_failure_into_the_version_rule():
    (h,) = [h for h in hz.load_hazards(TABLE.read_text()) if h.reference.endswith("#1269")]
    text = "#if " + "(" * 400 + "1" + ")" * 400 + "\n#endif\n" + excerpt("595.45.04")
    a = hz.assess(h, driver_version="595.45.04", arch="aarch64", page_size=K64, nv_linux_h_text=text)
    assert (a.state, a.decided_by) == (hz.AFFECTED, "version"), a.reason
    assert a.reason.startswith("hazard check could not read nv-linux.h: ") and "nested" in a.reason
    fs = hz.findings_from_inputs({"table": {"path": str(TABLE), "text": TABLE.read_text()},
                                  "driver_version": "595.45.04", "arch": "aarch64", "page_size": K64,
                                  "sources": {"common/inc/nv-linux.h": text}})
    assert [f["code"] for f in fs] == ["hazard-check-failed", "driver-hazard-dma-submap"]


@pytest.mark.parametrize("exc", [KeyError("PAGE_SHIFT"), MemoryError(), ZeroDivisionError("integer division")])
def test_any_failure_of_the_check_is_a_finding_not_an_exception(monkeypatch, exc):
    """Not only the reader's own limits: whatever the content check raises (a bug of ours, memory) becomes the
    hazard-check-failed finding and the version rule decides; assess() itself raising likewise. The raising
    check stands in for a reader bug not known yet."""
    (h,) = [h for h in hz.load_hazards(TABLE.read_text()) if h.reference.endswith("#1269")]

    def broken(*a, **k):
        raise exc
    monkeypatch.setattr(hz, "content_verdict", broken)
    a = hz.assess(h, driver_version="595.45.04", arch="aarch64", page_size=K64, nv_linux_h_text=excerpt("595.45.04"))
    assert (a.state, a.decided_by) == (hz.AFFECTED, "version"), a.reason
    assert a.reason.startswith(f"hazard check could not read nv-linux.h: {type(exc).__name__}"), a.reason
    inputs = {"table": {"path": str(TABLE), "text": TABLE.read_text()}, "driver_version": "595.45.04",
              "arch": "aarch64", "page_size": K64, "sources": {"common/inc/nv-linux.h": excerpt("595.45.04")}}
    assert [f["code"] for f in hz.findings_from_inputs(inputs)] == ["hazard-check-failed", "driver-hazard-dma-submap"]
    real = hz.assess

    def assess_raising(hazard, **kw):
        if kw.get("nv_linux_h_text") is not None:
            raise exc
        return real(hazard, **kw)
    monkeypatch.setattr(hz, "assess", assess_raising)
    fs = hz.findings_from_inputs(inputs)
    assert [f["code"] for f in fs] == ["hazard-check-failed", "driver-hazard-dma-submap"], fs
    assert type(exc).__name__ in fs[0]["message"] and "judged by its version" in fs[0]["message"], fs[0]


def test_status_survives_a_deeply_nested_record(tmp_path):
    """Found by tests/test_fuzz.py: a record file of 100,000 '[' raised RecursionError (status exit 3)."""
    from tests.support import sparkroot
    root = sparkroot.make_spark_root(tmp_path / "r")
    sparkroot.write(root, "/var/lib/spark-memsaver/rollbacks/6.14.0-1015-nvidia-64k.json", "[" * 100_000)
    r, seconds = _status(root)
    assert r.returncode in (0, 1), (r.returncode, seconds, r.stdout[-2000:])
    doc = json.loads(r.stdout)
    (q,) = [f for f in doc["findings"] if f["code"] == "record-quarantined"]
    assert "nested too deeply" in q["message"], q


@pytest.mark.dbus
@pytest.mark.parametrize("name", ["doubling define chain", "400 nested parentheses"])
def test_the_daemon_answers_getstatus_over_a_hostile_header(tmp_path, name):
    """spark-memsaverd itself (a private system bus) over the same root: its status child reads the header like
    `status` does. Before: the child ran until its 600 s timeout (the doubling chain) or failed (RecursionError),
    and GetStatus answered Busy ("the first status is not ready yet") meanwhile."""
    from tests.support.privatebus import PrivateSystemBus, names, start_daemon, stop_process
    from tests.test_dbus import gdbus_call
    prefix, decided_by, _ = CASES[name]
    root = node(tmp_path, version="595.45.04", page_size=K64)
    (root / "usr/src/nvidia-595.45.04/common/inc/nv-linux.h").write_text(prefix + excerpt("595.45.04"))
    bus = PrivateSystemBus(tmp_path / "bus").start()
    try:
        p = start_daemon(bus, "--no-reconcile", "--root", str(root), log_path=tmp_path / "d.log")
        try:
            bus.wait_for_name(names.BUS_NAME, timeout=30, proc=p)
            t0, r = time.monotonic(), None
            while time.monotonic() - t0 < BOUND_S:
                r = gdbus_call(bus, "GetStatus")
                if r.returncode == 0:
                    break
                assert "Busy" in r.stderr, r.stderr
                time.sleep(0.2)
            assert r is not None and r.returncode == 0, (time.monotonic() - t0, r and r.stderr,
                                                         (tmp_path / "d.log").read_text()[-2000:])
        finally:
            stop_process(p)
    finally:
        bus.stop()
    import ast
    doc = json.loads(ast.literal_eval(r.stdout.strip())[0])          # gdbus prints ('<json>',)
    codes = {f["code"]: f for f in doc["findings"]}
    assert ("hazard-check-failed" in codes) == (decided_by == "version"), sorted(codes)
    assert "driver-hazard-dma-submap" in codes, sorted(codes)
