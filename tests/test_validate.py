"""spark-memsaver validate: everything that does not need a GPU.

Argument limits, headroom sizing, the packing-counter checks (counters read through observe_uvm from a
/sys/module/nvidia_uvm tree in the patched module's exact text format), kernel-log parsing and scanning (real
/dev/kmsg and dmesg line formats), report building and saving, the worker's peak protocol, the CLI's
no-libcuda and bad-usage paths as subprocesses, and the worker's data checks driven through a host-memory
stand-in for libcuda (it stands in for a GPU, which this machine lacks; see HostMemoryCuda).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import mmap
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from spark_memsaver.validate import cuda as C
from spark_memsaver.validate import command as V
from spark_memsaver.host import Host
from spark_memsaver.observe.snapshot import observe_records, observe_uvm
from tests.support import needs

pytestmark = pytest.mark.validate

REPO = Path(__file__).resolve().parent.parent
def _python_with_click() -> str:
    """/usr/bin/python3 (the package's interpreter) when it has click, else this interpreter (a venv on GPU hosts)."""
    import subprocess as _sp
    if os.path.exists("/usr/bin/python3") and _sp.run(["/usr/bin/python3", "-c", "import click"],
                                                       capture_output=True).returncode == 0:
        return "/usr/bin/python3"
    return sys.executable


PY = _python_with_click()
GIB, MIB = V.GIB, V.MIB


# --- arguments ----------------------------------------------------------------------------------------

def test_args_defaults_and_bounds_accepted():
    p = V.check_args(V.DEFAULT_MAX_GIB, V.DEFAULT_DURATION, V.DEFAULT_THREADS)
    assert p == {"max_gib": 2.0, "max_bytes": 2 * GIB, "duration": 20.0, "threads": 4}
    assert V.check_args(0.25, 1, 1)["max_bytes"] == GIB // 4
    assert V.check_args(1024, 3600, 64)["threads"] == 64
    assert V.check_args("1.5", "30", "8")["max_bytes"] == int(1.5 * GIB)


@pytest.mark.parametrize("args,option", [
    ((0, 20, 4), "--max-gib"), ((-1, 20, 4), "--max-gib"), ((0.2, 20, 4), "--max-gib"),
    ((1025, 20, 4), "--max-gib"), ((math.nan, 20, 4), "--max-gib"), ((math.inf, 20, 4), "--max-gib"),
    (("lots", 20, 4), "--max-gib"), ((2, 0, 4), "--duration"), ((2, 0.5, 4), "--duration"),
    ((2, 3601, 4), "--duration"), ((2, math.nan, 4), "--duration"), ((2, 20, 0), "--threads"),
    ((2, 20, 65), "--threads"), ((2, 20, 2.5), "--threads"), ((2, 20, "x"), "--threads"),
])
def test_args_out_of_range_is_usage_error(args, option):
    with pytest.raises(V.ValidateUsage) as ei:
        V.check_args(*args)
    assert option in ei.value.message
    assert ei.value.exit_code == 2


# --- headroom sizing ----------------------------------------------------------------------------------

def test_budget_limited_by_max_gib_on_a_roomy_gpu():
    plan = V.plan_budget(2 * GIB, 139 * GIB, 140 * GIB)
    assert plan["refused"] is None
    assert plan["budget"] == 2 * GIB and plan["limited_by"] == "--max-gib"
    assert plan["span"] == {"bytes": V.SPAN_BYTES, "charged": V.SPAN_RESIDENT}


def test_budget_limited_by_headroom_and_span_skipped():
    plan = V.plan_budget(8 * GIB, 4 * GIB, 80 * GIB)
    assert plan["budget"] == 1 * GIB and plan["limited_by"] == "headroom"
    assert plan["span"] is None and "needs 16.2 GiB free" in plan["span_skipped"]


def test_budget_refuses_without_headroom():
    plan = V.plan_budget(2 * GIB, 800 * MIB, 80 * GIB)
    assert plan["budget"] == 0
    assert "at least 256 MiB" in plan["refused"] and "800 MiB free" in plan["refused"]


def test_budget_integrated_gpu_counts_host_memavailable():
    # GB10: cuMemGetInfo can report more than the host can give; MemAvailable wins when smaller
    plan = V.plan_budget(8 * GIB, 100 * GIB, 119 * GIB, integrated=True, host_available=3 * GIB)
    assert plan["basis"].startswith("host MemAvailable")
    assert plan["budget"] == 3 * GIB // 4 and plan["span"] is None
    # a discrete GPU keeps half the host's MemAvailable free (managed pages live there between GPU visits)
    plan = V.plan_budget(8 * GIB, 100 * GIB, 119 * GIB, host_available=3 * GIB)
    assert plan["budget"] == 3 * GIB // 2 and plan["limited_by"] == "host memory"
    plan = V.plan_budget(8 * GIB, 100 * GIB, 119 * GIB, host_available=400 * MIB)
    assert "50% of 400 MiB host MemAvailable" in plan["refused"]
    assert V.plan_budget(8 * GIB, 100 * GIB, 119 * GIB, host_available=None)["budget"] == 8 * GIB


def test_budget_span_charged_fully_without_demand_paging():
    plan = V.plan_budget(2 * GIB, 100 * GIB, 100 * GIB, concurrent_managed=False)
    assert plan["span"] is None and "--max-gib 4.31" in plan["span_skipped"]
    plan = V.plan_budget(5 * GIB, 100 * GIB, 100 * GIB, concurrent_managed=False)
    assert plan["span"]["charged"] == V.SPAN_BYTES


def test_budget_never_exceeds_the_headroom_fraction():
    import hypothesis as hyp
    st = hyp.strategies

    @hyp.settings(max_examples=300, deadline=None)
    @hyp.given(st.integers(0, 1 << 42), st.integers(0, 1 << 42), st.booleans(), st.integers(0, 1 << 42))
    def prop(max_bytes, free, integrated, host):
        plan = V.plan_budget(max_bytes, free, free, integrated=integrated, host_available=host)
        basis = min(free, host) if integrated else free
        allowed = min(max_bytes, int(basis * V.HEADROOM_FRACTION))
        if not integrated:
            allowed = min(allowed, int(host * V.HOST_FRACTION))
        assert plan["budget"] <= max_bytes
        assert plan["budget"] <= basis * V.HEADROOM_FRACTION
        assert integrated or plan["budget"] <= host * V.HOST_FRACTION
        assert (plan["refused"] is not None) == (allowed < V.MIN_BUDGET)
        assert plan["budget"] == (0 if plan["refused"] else allowed)
        if plan["span"]:
            assert V.SPAN_BYTES <= basis * V.HEADROOM_FRACTION
    prop()


def test_crossings():
    assert V.crossings(4 * GIB - 4096, 8192) == [4 * GIB]
    assert V.crossings(4 * GIB, 4096) == []                 # starts on the line: crosses nothing inside
    assert V.crossings(0x7FDE92000000, V.SPAN_BYTES) == [0x7FDF00000000]   # the H200 run's span
    assert len(V.crossings(12345, V.SPAN_BYTES)) >= 1       # any span > 4 GiB crosses


# --- packing counters ---------------------------------------------------------------------------------

def stats_text(tier="4k", trees_packed=0, trees_unpacked=0, reason="none", c256=(0, 0), c4096=(0, 0),
               page_size=65536, saved_skew=0, fmt=1) -> str:
    """The patched module's uvm_pt_pack_stats text, line for line as pt_pack_stats_get() prints it."""
    out = [f"format {fmt}", f"tier {tier}", f"page_size {page_size}", f"trees_packed {trees_packed}",
           f"trees_unpacked {trees_unpacked}", f"unpacked_reason {reason}"]
    sb = ss = 0
    for name, (tables, pages) in (("c256", c256), ("c4096", c4096)):
        backing, stock = pages * page_size, tables * page_size
        sb, ss = sb + backing, ss + stock
        out += [f"{name}_tables {tables}", f"{name}_pages {pages}", f"{name}_backing_bytes {backing}",
                f"{name}_stock_bytes {stock}", f"{name}_saved_bytes {stock - backing}"]
    out += [f"backing_bytes {sb}", f"stock_bytes {ss}", f"saved_bytes {ss - sb + saved_skew}"]
    return "\n".join(out) + "\n"


def uvm_reading(tmp_path, name, stats: str | None, loaded=True) -> dict:
    """observe_uvm() of a /sys/module/nvidia_uvm tree (the loaded module, which cannot exist here)."""
    root = tmp_path / name
    base = root / "sys/module/nvidia_uvm"
    (root / "proc").mkdir(parents=True)
    if loaded:
        (base / "parameters").mkdir(parents=True)
        (base / "version").write_text("580.95.05\n")
        (base / "srcversion").write_text("0123456789ABCDEF0123456\n")
        (base / "parameters/uvm_ats_mode").write_text("1\n")
        if stats is not None:
            (base / "parameters/uvm_pt_pack").write_text("1\n")
            (base / "parameters/uvm_pt_pack_stats").write_text(stats)
    return observe_uvm(Host(root))


def by_name(checks):
    return {c["name"]: c for c in checks}


def test_packing_stock_module_counters_absent(tmp_path):
    r = uvm_reading(tmp_path, "stock", None)
    checks = by_name(V.packing_checks(r, r, r))
    assert set(checks) == {"packing-counters-move", "packing-counters-return"}
    for c in checks.values():
        assert c["status"] == V.NA and c["detail"] == "stock module: counters absent"


def test_packing_module_not_loaded(tmp_path):
    r = uvm_reading(tmp_path, "none", None, loaded=False)
    assert {c["detail"] for c in V.packing_checks(r, r, r)} == {"nvidia-uvm not loaded: counters absent"}


def test_packing_moves_and_returns(tmp_path):
    b = uvm_reading(tmp_path, "b", stats_text(trees_packed=1, c256=(3, 1), c4096=(5, 1)))
    p = uvm_reading(tmp_path, "p", stats_text(trees_packed=2, c256=(300, 2), c4096=(40, 3)))
    a = uvm_reading(tmp_path, "a", stats_text(trees_packed=1, c256=(3, 1), c4096=(5, 1)))
    checks = by_name(V.packing_checks(b, p, a))
    assert checks["packing-counters-consistent"]["status"] == V.PASS
    assert checks["packing-counters-move"]["status"] == V.PASS
    assert checks["packing-counters-move"]["data"] == {"tables": 332, "backing_bytes": 3 * 65536,
                                                        "trees_packed": 1}
    assert checks["packing-counters-return"]["status"] == V.PASS


def test_packing_leak_after_teardown_fails(tmp_path):
    b = uvm_reading(tmp_path, "b", stats_text(trees_packed=1, c256=(3, 1)))
    p = uvm_reading(tmp_path, "p", stats_text(trees_packed=2, c256=(300, 2), c4096=(40, 3)))
    a = uvm_reading(tmp_path, "a", stats_text(trees_packed=1, c256=(5, 2)))
    ret = by_name(V.packing_checks(b, p, a))["packing-counters-return"]
    assert ret["status"] == V.FAIL
    assert ret["data"] == {"c256_tables": 2, "c256_pages": 1, "backing_bytes": 65536}
    assert "c256_tables +2" in ret["detail"]


def test_packing_counters_that_do_not_move_fail(tmp_path):
    r = uvm_reading(tmp_path, "r", stats_text(trees_packed=1, c256=(3, 1)))
    move = by_name(V.packing_checks(r, r, r))["packing-counters-move"]
    assert move["status"] == V.FAIL and "did not grow" in move["detail"]


def test_packing_declined_for_this_gpu_is_not_applicable(tmp_path):
    b = uvm_reading(tmp_path, "b", stats_text(trees_unpacked=0))
    p = uvm_reading(tmp_path, "p", stats_text(trees_unpacked=1, reason="has_vidmem"))
    a = uvm_reading(tmp_path, "a", stats_text(trees_unpacked=0, reason="has_vidmem"))
    checks = by_name(V.packing_checks(b, p, a))
    assert checks["packing-counters-move"]["status"] == V.NA
    assert "unpacked_reason has_vidmem" in checks["packing-counters-move"]["detail"]


def test_packing_tier_off_skips(tmp_path):
    r = uvm_reading(tmp_path, "r", stats_text(tier="off"))
    checks = by_name(V.packing_checks(r, r, r))
    assert checks["packing-counters-move"]["status"] == V.SKIP
    assert "tier is off" in checks["packing-counters-return"]["detail"]


def test_packing_module_loaded_by_the_run_has_an_empty_baseline(tmp_path):
    b = uvm_reading(tmp_path, "b", None, loaded=False)
    p = uvm_reading(tmp_path, "p", stats_text(trees_packed=1, c256=(64, 1), c4096=(6, 1)))
    a = uvm_reading(tmp_path, "a", stats_text())
    checks = by_name(V.packing_checks(b, p, a))
    assert checks["packing-counters-move"]["status"] == V.PASS
    assert checks["packing-counters-return"]["status"] == V.PASS
    a2 = uvm_reading(tmp_path, "a2", stats_text(trees_packed=1, c4096=(1, 1)))
    assert by_name(V.packing_checks(b, p, a2))["packing-counters-return"]["status"] == V.FAIL


def test_packing_unreadable_or_inconsistent_counters_fail(tmp_path):
    good = uvm_reading(tmp_path, "g", stats_text())
    from spark_memsaver.observe.counters import SUPPORTED_FORMATS
    nf = max(SUPPORTED_FORMATS) + 1  # one past what this version reads (format 2 became readable)
    newer = uvm_reading(tmp_path, "n", stats_text(fmt=nf))
    assert newer["packing"] == {"error": f"counters format {nf} is newer than this spark-memsaver understands"}
    for c in V.packing_checks(good, newer, good):
        assert c["status"] == V.FAIL and c["detail"].startswith("counters unreadable")
    skew = uvm_reading(tmp_path, "s", stats_text(trees_packed=1, c256=(9, 1), saved_skew=4096))
    assert by_name(V.packing_checks(good, skew, good))["packing-counters-consistent"]["status"] == V.FAIL
    gone = uvm_reading(tmp_path, "x", None)
    assert by_name(V.packing_checks(good, gone, gone))["packing-counters-move"]["detail"].startswith(
        "counters vanished")


# --- kernel log ---------------------------------------------------------------------------------------

# Real formats: /dev/kmsg records are "prio,seq,usec,flags;text" plus " KEY=value" lines; dmesg prints
# "[ secs.usecs] text". Texts follow NVRM's Xid line and nvidia-uvm's UVM_ASSERT / UVM_ERR_PRINT prefixes.
KMSG_XID = ("3,10123,5123456789,-;NVRM: Xid (PCI:0000:01:00): 31, pid=4242, name=python3, Ch 00000008, "
            "intr 00000000. MMU Fault: ENGINE GRAPHICS GPC0 GPCCLIENT_T1_0 faulted @ 0x7f12_34560000. Fault is "
            "of type FAULT_PDE ACCESS_TYPE_VIRT_READ\n SUBSYSTEM=pci\n DEVICE=+pci:0000:01:00.0\n")
DMESG_LINES = """\
[    0.706095] NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)
[    1.460827] NVRM: gpuClearFbhubPoisonIntrForBug2924523_GA100: FBHUB Interrupt detected. Clearing it.
[    3.689739] NVRM: Persistence mode is deprecated and will be removed in a future release. Please use nvidia-persistenced instead.
[    4.101010] nvidia-uvm: Loaded the UVM driver, major device number 510.
[ 1201.000001] NVRM: Xid (PCI:000f:01:00): 79, pid=1234, name=python3, GPU has fallen off the bus.
[ 1202.345678] nvidia-uvm: uvm_mmu.c:1523 uvm_page_tree_free[pid:4242] Assert failed, condition tree->pool_empty not true
[ 1202.400000] nvidia-uvm: uvm_global.c:429 uvm_global_set_fatal_error_impl[pid:4242] Encountered a global fatal error: Invalid state
[ 1203.000000] nvidia-uvm: uvm_mem.c:562 uvm_mem_alloc_vidmem[pid:4242]  uvm_pmm_gpu_alloc_kernel (count=1, size=0x200000) failed: Out of memory
[ 1203.500000] python3: page allocation failure: order:4, mode:0x40dc0(GFP_KERNEL|__GFP_COMP|__GFP_ZERO), nodemask=(null),cpuset=/,mems_allowed=0
[ 1204.000000] Out of memory: Killed process 4242 (python3) total-vm:123456kB, anon-rss:65536kB, file-rss:0kB
[ 1205.000000] WARNING: CPU: 3 PID: 4242 at /var/lib/dkms/spark-memsaver-uvm/0.1.0/build/nvidia-uvm/uvm_pt_pack.c:442 uvm_pt_pack_tree_deinit+0x5c/0x80 [nvidia_uvm]
[ 1206.000000] Unable to handle kernel paging request at virtual address ffff800012345678
[ 1206.000001] Internal error: Oops: 0000000096000005 [#1] PREEMPT SMP
"""


def test_parse_kmsg_record_and_dmesg_line():
    r = V.parse_kmsg_record(KMSG_XID)
    assert r["level"] == 3 and r["seq"] == 10123 and r["ts"] == pytest.approx(5123.456789)
    assert r["msg"].startswith("NVRM: Xid (PCI:0000:01:00): 31, pid=4242") and "SUBSYSTEM" not in r["msg"]
    assert V.parse_kmsg_record("12,7,100,c;cont") == {"level": 4, "seq": 7, "ts": 0.0001, "msg": "cont"}
    assert V.parse_kmsg_record("garbage") is None
    d = V.parse_dmesg_line("[ 1202.345678] nvidia-uvm: x")
    assert d == {"ts": 1202.345678, "msg": "nvidia-uvm: x"}
    assert V.parse_dmesg_line("no timestamp") is None


def test_scan_finds_each_kind_and_ignores_benign_driver_lines():
    msgs = [V.parse_dmesg_line(ln)["msg"] for ln in DMESG_LINES.splitlines()]
    events = V.scan_messages(msgs)
    assert [e["kind"] for e in events] == ["xid", "uvm-assert", "uvm-fatal", "uvm-error", "alloc-failure",
                                           "oom-kill", "kernel-warning", "kernel-bug"]
    assert events[0]["xid"] == 79 and events[0]["device"] == "PCI:000f:01:00"
    assert V.scan_messages(msgs[:4]) == []      # the H200's own boot lines: nothing to report
    xid = V.scan_messages([V.parse_kmsg_record(KMSG_XID)["msg"]])
    assert xid[0]["kind"] == "xid" and xid[0]["xid"] == 31


def test_log_check_statuses():
    assert V.log_check("/dev/kmsg", None, [])["status"] == V.PASS
    ev = V.scan_messages(["NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=x, Graphics Exception"])
    c = V.log_check("/dev/kmsg", None, ev)
    assert c["status"] == V.FAIL and "xid" in c["detail"] and c["data"]["events"] == ev
    c = V.log_check(None, "/dev/kmsg: Permission denied", [])
    assert c["status"] == V.SKIP and "Permission denied" in c["detail"]


def test_kernel_log_reads_only_what_appeared_during_the_run():
    """The real kernel log: a marker written to /dev/kmsg after start() is collected, older lines are not."""
    needs.root("writing a marker to /dev/kmsg needs root (CI runs as root)")
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
    except OSError as e:
        needs.not_applicable(f"/dev/kmsg not readable here (a container): {e}")
    marker = f"spark-memsaver test_validate marker {os.getpid()}"
    with open("/dev/kmsg", "w") as f:
        f.write(marker + " (before)\n")
    log = V.KernelLog(Host("/"))
    log.start()
    assert log.source == "/dev/kmsg"
    with open("/dev/kmsg", "w") as f:
        f.write(marker + " (during)\n")
    msgs = log.collect()
    assert any(m.endswith(marker + " (during)") for m in msgs)
    assert not any(m.endswith(marker + " (before)") for m in msgs)


# --- report -------------------------------------------------------------------------------------------

def report_with(checks, terminal=None):
    return V.build_report(params={"max_gib": 2.0, "duration": 20.0, "threads": 4},
                          identity={"node": "n1", "kernel": "6.8.0-1014-nvidia-64k", "arch": "aarch64",
                                    "page_size": 65536, "nvidia_driver": "580.95.05",
                                    "uvm": {"patched": True, "version": "580.95.05", "srcversion": "ABC"}},
                          device={"name": "NVIDIA GB10", "integrated": True, "cuda_driver_version": "13.0"},
                          budget=None, checks=checks, counters={}, kernel_log={"source": "/dev/kmsg", "events": []},
                          workload=None, timings={"total_s": 1.5}, terminal=terminal, started=0.0, finished=1.5)


def test_report_outcomes_and_exit_codes():
    data = [V.check("device-memory", V.PASS, "ok"), V.check("managed-memory", V.PASS, "ok")]
    stock = [V.check("packing-counters-move", V.NA, V.STOCK_REASON),
             V.check("packing-counters-return", V.NA, V.STOCK_REASON)]
    r = report_with(data + stock)
    assert (r["outcome"], r["exit_code"]) == ("passed", 0)
    assert r["reason"] == "data checks passed; stock module: counters absent"
    assert r["counts"] == {"pass": 2, "fail": 0, "skip": 0, "not-applicable": 2}
    r = report_with(data + [V.check("packing-counters-return", V.FAIL, "c256_tables +2")])
    assert (r["outcome"], r["exit_code"]) == ("failed", 1) and "c256_tables +2" in r["reason"]
    r = report_with([V.check("cuda", V.NA, "no CUDA device")], {"event": "not-applicable", "reason": "no CUDA device"})
    assert (r["outcome"], r["exit_code"]) == ("not-applicable", 4)
    r = report_with([], {"event": "refused", "reason": "only 100 MiB may be used"})
    # a refusal is 1, as in the CLI's one exit table (exitcodes.py); 2 is bad usage only
    from spark_memsaver import exitcodes
    assert (r["outcome"], r["exit_code"]) == ("refused", exitcodes.EXIT_PROBLEM) == ("refused", 1)
    assert V.HeadroomRefused.exit_code == exitcodes.EXIT_PROBLEM
    assert report_with([])["outcome"] == "failed"          # nothing ran is not a pass
    assert json.loads(json.dumps(r)) == r
    assert r["started_at"] == "1970-01-01T00:00:00Z"


def test_summary_is_readable():
    r = report_with([V.check("device-memory", V.PASS, "3 cuMemAlloc allocations"),
                     V.check("kernel-log", V.FAIL, "1 kernel-log event(s) during the run: xid")])
    s = r["summary"].splitlines()
    assert s[0].startswith("spark-memsaver validate: FAILED: kernel-log: 1 kernel-log event(s)")
    assert any("NVIDIA GB10" in ln and "integrated" in ln for ln in s)
    assert any("6.8.0-1014-nvidia-64k (aarch64, 64 KiB pages) on n1" in ln for ln in s)
    assert any(ln.split()[:2] == ["fail", "kernel-log"] for ln in s)


def test_save_report_is_atomic_and_readable_by_status(tmp_path):
    root = tmp_path / "root"
    path = root / "var/lib/spark-memsaver/validate-last.json"
    V.save_report({"outcome": "passed", "n": 1}, str(path))
    V.save_report({"outcome": "failed", "n": 2}, str(path))
    assert json.loads(path.read_text()) == {"outcome": "failed", "n": 2}
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert os.listdir(path.parent) == ["validate-last.json"]          # no temporary left behind
    assert observe_records(Host(root))["last_validation"]["outcome"] == "failed"
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError):
        V.save_report({"outcome": "passed"}, str(blocker / "r.json"))


# --- the worker protocol -------------------------------------------------------------------------------

FAKE_WORKER = r"""
import json, sys, select
print(json.dumps({"event": "identity", "device": {"name": "x"}}), flush=True)
print(json.dumps({"event": "peak", "live_bytes": 5}), flush=True)
r, _, _ = select.select([sys.stdin], [], [], 10)
go = bool(r) and sys.stdin.readline().strip() == "go"
print(json.dumps({"event": "done", "got_go": go}), flush=True)
"""


def test_run_worker_reads_at_peak_then_releases():
    seen = []
    res = V.run_worker([PY, "-c", FAKE_WORKER], 30, lambda ev: seen.append(ev["live_bytes"]))
    assert seen == [5]
    assert [e["event"] for e in res["events"]] == ["identity", "peak", "done"]
    assert res["events"][-1]["got_go"] is True and res["returncode"] == 0 and not res["timed_out"]


def test_run_worker_kills_a_hung_worker():
    res = V.run_worker([PY, "-c", "import time; print('{\"event\": \"identity\"}', flush=True); time.sleep(60)"],
                       1.5, lambda ev: None)
    assert res["timed_out"] and res["returncode"] != 0 and res["events"] == [{"event": "identity"}]


# --- the worker's data checks through a stand-in for libcuda -------------------------------------------

class HostMemoryCuda:
    """Stands in for libcuda.so.1 and a GPU, which this machine lacks: the driver calls validate makes,
    implemented on host memory (anonymous mmap, so the >4 GiB span costs only what is touched).
    ``corrupt_dtoh`` flips one byte in the Nth cuMemcpyDtoH, as a bad page mapping would."""

    path = "host-memory stand-in"
    prefetch_api = "cuMemPrefetchAsync_v2"

    def __init__(self, free=64 * GIB, corrupt_dtoh=None):
        self.maps, self.free_b, self.corrupt, self.ndtoh = {}, free, corrupt_dtoh, 0
        self.calls: dict[str, int] = {}

    def _n(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def init(self): self._n("cuInit")
    def driver_version(self): return 13000
    def device_count(self): return 1
    def device(self, i): return 0
    def device_name(self, d): return "host-memory stand-in"
    def uuid(self, d): return "GPU-00000000-0000-0000-0000-000000000000"
    def pci_bus_id(self, d): return "0000:00:00.0"
    def total_mem(self, d): return 80 * GIB
    def attribute(self, d, a):
        return {C.ATTR_INTEGRATED: 0, C.ATTR_MANAGED_MEMORY: 1, C.ATTR_CONCURRENT_MANAGED_ACCESS: 1,
                C.ATTR_PAGEABLE_MEMORY_ACCESS: 0}[a]
    def primary_ctx_retain(self, d): self._n("retain"); return 0x1234
    def primary_ctx_release(self, d): self._n("release")
    def set_current(self, c): pass
    def synchronize(self): pass
    def mem_info(self): return self.free_b, 80 * GIB

    def _map(self, size, kind):
        self._n(kind)
        m = mmap.mmap(-1, size)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        self.maps[addr] = m
        return addr

    def alloc(self, size): return self._map(size, "cuMemAlloc")
    def alloc_managed(self, size): return self._map(size, "cuMemAllocManaged")
    def free(self, p): self._n("cuMemFree"); self.maps.pop(p)
    def memset_d8(self, p, v, n): ctypes.memset(p, v, n)
    def memset_d32(self, p, v, n): ctypes.memmove(p, struct.pack("<I", v) * n, 4 * n)
    def htod(self, d, s, n): ctypes.memmove(d, s, n)
    def dtoh(self, d, s, n):
        ctypes.memmove(d, s, n)
        self.ndtoh += 1
        if self.ndtoh == self.corrupt:
            (ctypes.c_ubyte * 1).from_address(d + n // 2)[0] ^= 0x5A
    def stream_create(self): return 0x99
    def stream_destroy(self, s): pass
    def stream_sync(self, s): pass
    def prefetch(self, p, n, dev, s): self._n("prefetch")


@pytest.fixture
def small():
    """A small run: the workload's logic does not depend on the 256 MiB floor a real node keeps (passed to the
    worker as parameters, as the command passes its own)."""
    return {"min_budget": 32 * MIB, "max_block": 16 * MIB}


def run_worker_inline(cu, max_bytes=80 * MIB, **params):
    events = []
    V._Worker({"max_bytes": max_bytes, "duration": 1, "threads": 2, "seed": 7, **params}, events.append,
              lambda t: True, lambda: cu).run()
    return {e["event"]: e for e in events}


def test_worker_data_checks_pass_and_free_everything(small):
    cu = HostMemoryCuda()
    ev = run_worker_inline(cu, **small)
    checks = by_name(ev["done"]["checks"])
    assert {n: c["status"] for n, c in checks.items()} == {
        "device-memory": "pass", "managed-memory": "pass", "managed-prefetch": "pass", "holes-reuse": "pass",
        "cross-4gib": "pass", "threads": "pass", "teardown": "pass"}
    assert checks["cross-4gib"]["data"]["bytes"] == V.SPAN_BYTES
    assert cu.maps == {}                                             # every allocation freed
    assert cu.calls["cuMemFree"] == cu.calls["cuMemAlloc"] + cu.calls["cuMemAllocManaged"]
    assert cu.calls["release"] == cu.calls["retain"] == 1
    w = ev["done"]["workload"]
    assert w["max_thread_live_bytes"] <= w["share_per_thread"] <= 80 * MIB // 2
    assert w["max_block"] <= 16 * MIB and w["holes_freed"] > 0 and w["prefetches"] > 0
    assert 0 < ev["peak"]["live_bytes"] - ev["peak"]["span_bytes"] <= 80 * MIB


def test_worker_detects_a_corrupted_read(small):
    ev = run_worker_inline(HostMemoryCuda(corrupt_dtoh=3), **small)
    bad = [c for c in ev["done"]["checks"] if c["status"] == V.FAIL]
    # the 3rd copy-engine read belongs to whichever thread (or the span) got there first
    assert len(bad) == 1 and bad[0]["name"] in ("device-memory", "managed-memory", "cross-4gib")
    assert "differs" in bad[0]["detail"]


def test_worker_refuses_without_headroom():
    cu = HostMemoryCuda(free=512 * MIB)
    ev = run_worker_inline(cu, max_bytes=2 * GIB)
    assert "refused" in ev and "done" not in ev and "at least 256 MiB" in ev["refused"]["reason"]
    assert ev["budget"]["budget"]["cap"] == 128 * MIB
    assert "cuMemAlloc" not in cu.calls and "cuMemAllocManaged" not in cu.calls
    assert cu.calls["release"] == 1


# --- the command, as a user runs it --------------------------------------------------------------------

def run_cli(args, env_extra, module="spark_memsaver"):
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"), **env_extra)
    return subprocess.run([PY, "-m", module] + args, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("module,lib,why", [
    ("spark_memsaver", "/nonexistent/libcuda.so.1", "cannot load /nonexistent/libcuda.so.1"),
    ("spark_memsaver.validate.command", "/nonexistent/libcuda.so.1", "cannot load"),
    ("spark_memsaver", "libc.so.6", "does not export cuInit"),
])
def test_no_libcuda_is_not_applicable_exit_4(tmp_path, module, lib, why):
    state = tmp_path / "root/var/lib/spark-memsaver/validate-last.json"
    p = run_cli(["validate", "--json", "--report", str(tmp_path / "r.json")] if module == "spark_memsaver"
                else ["--json", "--report", str(tmp_path / "r.json")], {
        "SPARK_MEMSAVER_LIBCUDA": lib, "SPARK_MEMSAVER_VALIDATE_REPORT": str(state)}, module)
    assert p.returncode == 4, p.stdout + p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    rep = json.loads(p.stdout)
    assert rep["outcome"] == "not-applicable" and why in rep["reason"]
    assert rep["checks"] == [{"name": "cuda", "status": "not-applicable", "detail": rep["reason"]}]
    assert rep["identity"]["kernel"] == os.uname().release
    assert json.loads((tmp_path / "r.json").read_text())["outcome"] == "not-applicable"
    if os.geteuid() == 0:   # root keeps the last report where status reads it
        assert observe_records(Host(tmp_path / "root"))["last_validation"]["reason"] == rep["reason"]


def test_default_library_on_this_machine(tmp_path, monkeypatch):
    """Without SPARK_MEMSAVER_LIBCUDA, libcuda.so.1 is loaded by name. Where the dynamic loader knows no
    libcuda (ldconfig's cache, independently of the binding), validate is not applicable, exit 4; where it
    does (a GPU machine), the binding loads that library and the driver answers."""
    from spark_memsaver.validate import cuda
    monkeypatch.delenv("SPARK_MEMSAVER_LIBCUDA", raising=False)
    if ctypes.util.find_library("cuda") is None and not os.environ.get("LD_LIBRARY_PATH"):
        p = run_cli(["validate"], {"SPARK_MEMSAVER_VALIDATE_REPORT": str(tmp_path / "last.json")})
        assert p.returncode == 4 and "Traceback" not in p.stderr
        assert p.stdout.startswith("spark-memsaver validate: NOT-APPLICABLE: no CUDA driver library: cannot load "
                                   "libcuda.so.1")
        with pytest.raises(cuda.CudaUnavailable, match="cannot load libcuda.so.1"):
            cuda.Cuda()
        return
    c = cuda.Cuda()
    assert c.path == "libcuda.so.1"
    c.init()
    assert c.driver_version() >= 11000 and c.prefetch_api


@pytest.mark.parametrize("args,needle", [
    (["--max-gib", "0"], "--max-gib must be between 0.25 and 1024"),
    (["--threads", "65"], "--threads must be between 1 and 64"),
    (["--duration", "soon"], "soon"),
])
def test_bad_usage_exits_2_without_traceback(args, needle, tmp_path):
    p = run_cli(["validate"] + args, {"SPARK_MEMSAVER_LIBCUDA": "/nonexistent",
                                      "SPARK_MEMSAVER_VALIDATE_REPORT": str(tmp_path / "x.json")})
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "x.json").exists()


def test_validate_refuses_a_root_prefix(tmp_path):
    p = run_cli(["--root", str(tmp_path), "validate", "--json"], {"SPARK_MEMSAVER_LIBCUDA": "/nonexistent"})
    assert p.returncode == 2 and json.loads(p.stdout)["error"]["code"] == "validate-usage"


def test_second_concurrent_run_is_refused(tmp_path, monkeypatch):
    import fcntl
    lock = tmp_path / "validate.lock"
    monkeypatch.setattr(V._single_run, "PATH", str(lock))
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(V.ValidateBusy) as ei:
            V.validate(Host("/"), 2, 20, 4)
        assert ei.value.exit_code == 1
    finally:
        os.close(fd)
    with V._single_run():      # free again once the holder is gone
        pass


def test_worker_refuses_when_no_memory_is_left_for_a_context():
    class Exhausted(HostMemoryCuda):
        def primary_ctx_retain(self, d):
            raise C.CudaError("cuDevicePrimaryCtxRetain", C.CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY",
                              "out of memory")
    ev = run_worker_inline(Exhausted())
    assert ev["refused"]["reason"] == "the GPU has no memory left for a CUDA context (CUDA_ERROR_OUT_OF_MEMORY)"
    assert "budget" not in ev and "done" not in ev
