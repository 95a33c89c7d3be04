"""`spark-memsaver memory`: rows that partition MemTotal (4 KiB and 64 KiB GB10 fixture roots, and this machine's
real /proc), free now vs after reclaim, free blocks in bytes for the kernel's page size, pageblocks, PSI, the
verdict, and the command's JSON and exit status.

The fixture roots (tests/fixtures/memory/README.md) stand in for a GB10's /proc and /sys files: GB10 figures
as posted by their users, the rest composed in the kernel's formats."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from spark_memsaver.decide import memory as decide
from spark_memsaver.host import Host
from spark_memsaver.observe import gpuprocs
from spark_memsaver.observe import memory as observe
from spark_memsaver.observe import procmem
from tests.support import sparkroot

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures" / "memory"
ENV = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
ENV.pop("SPARK_MEMSAVER_CONFIG", None)
KB, MIB, GIB = 1024, 1 << 20, 1 << 30
UNCOUNTED_64K = 3670016 * KB          # what compose.py left to no meminfo line on gb10-64k


def root(tmp_path: Path, name: str, *, blocks: tuple[int, int] | None = None, stats: str | None = None) -> Path:
    """A copy of fixture ``name``; ``blocks`` = (block size, count) adds /sys/devices/system/memory, ``stats``
    our module's counters."""
    r = tmp_path / name
    shutil.copytree(FIX / name, r)
    if blocks:
        d = r / "sys/devices/system/memory"
        d.mkdir(parents=True)
        (d / "block_size_bytes").write_text(f"{blocks[0]:x}\n")
        for i in range(blocks[1]):
            (d / f"memory{i}").mkdir()
            (d / f"memory{i}" / "state").write_text("online\n" if i else "offline\n")
    if stats:
        p = r / "sys/module/nvidia_uvm/parameters"
        p.mkdir(parents=True)
        (p / "uvm_pt_pack_stats").write_text(stats)
        (p / "uvm_pt_pack").write_text("1\n")
    return r


def doc_of(r, need=None) -> dict:
    return decide.model(observe.read(Host(r)), need)


def kinds(doc) -> dict:
    return {row["kind"]: row["bytes"] for row in doc["rows"]}


def meminfo(r) -> dict:
    return procmem.parse_meminfo(Path(r, "proc/meminfo").read_text())


@pytest.mark.parametrize("name", ["gb10-4k", "gb10-64k"])
def test_rows_partition_memtotal_on_both_page_sizes(name):
    doc = doc_of(FIX / name)
    mi = meminfo(FIX / name)
    assert doc["total_bytes"] == mi["MemTotal"]
    assert abs(doc["rows_sum_bytes"] - doc["total_bytes"]) <= decide.TOLERANCE * doc["total_bytes"]
    assert sum(r["bytes"] for r in doc["rows"]) == doc["rows_sum_bytes"]
    k = kinds(doc)
    # each meminfo figure once: Cached holds Shmem, KernelStack is inside VmallocUsed
    assert k["page-cache"] == mi["Cached"] + mi["Buffers"] - mi["Shmem"]
    assert k["shmem"] == mi["Shmem"] > 0.01 * mi["MemTotal"]
    assert k["vmalloc"] == mi["VmallocUsed"] - mi["KernelStack"]
    assert all(r["source"] for r in doc["rows"])


def test_the_64k_remainder_is_what_no_meminfo_line_counts():
    """compose.py left 3670016 kB to no line (GPU and driver allocations): the remainder is exactly that, so a
    figure counted twice (less than 1 % of MemTotal) shows here even where the sum stays within 1 %."""
    assert kinds(doc_of(FIX / "gb10-64k"))["driver-and-other"] == UNCOUNTED_64K


def test_rows_partition_this_machines_memtotal():
    doc = doc_of("/")
    assert doc["total_bytes"] and doc["page_size"] == os.sysconf("SC_PAGE_SIZE")
    assert abs(doc["rows_sum_bytes"] - doc["total_bytes"]) <= decide.TOLERANCE * doc["total_bytes"]
    # no GPU here: what no meminfo line counts is small on this machine (kernel pages not itemised)
    assert kinds(doc)["driver-and-other"] < 0.05 * doc["total_bytes"]
    assert doc["free_blocks"][0]["size_bytes"] == doc["page_size"]


def test_uvm_counters_and_nvml_split_the_remainder(tmp_path):
    stats = sparkroot.stats_text(tier="leaf")
    r = root(tmp_path, "gb10-64k", stats=stats)
    reading = observe.read(Host(r))
    backing = reading["uvm"]["backing_bytes"]
    assert backing > 0 and reading["gpu"]["state"] == "unknown"       # NVML: never under --root
    reading["gpu"] = {"state": "known", "processes": [{"pid": 7, "bytes": GIB}, {"pid": 8, "bytes": None}]}
    doc = decide.model(reading)
    k = kinds(doc)
    assert k["uvm-page-tables"] == backing and k["gpu-allocations"] == GIB
    assert k["driver-and-other"] == UNCOUNTED_64K - backing - GIB
    assert doc["rows_sum_bytes"] == doc["total_bytes"]
    assert doc["uvm_page_tables"]["stock_bytes"] > backing
    # more reported than no line counts: capped, and the row says so
    reading["gpu"]["processes"][0]["bytes"] = 64 * GIB
    capped = {r["kind"]: r for r in decide.model(reading)["rows"]}
    assert capped["gpu-allocations"]["bytes"] == UNCOUNTED_64K - backing and "capped" in \
        capped["gpu-allocations"]["source"]


@pytest.mark.parametrize("name,page,two_mib_order,largest", [("gb10-4k", 4096, 9, 32 * MIB),
                                                             ("gb10-64k", 65536, 5, 512 * MIB)])
def test_free_blocks_are_bytes_for_the_kernels_page_size(name, page, two_mib_order, largest):
    doc = doc_of(FIX / name)
    assert doc["page_size"] == page
    sizes = [b["size_bytes"] for b in doc["free_blocks"]]
    assert sizes[two_mib_order] == 2 * MIB and sizes[-1] == largest and len(sizes) == 14
    if page == 65536:
        assert sizes[9] == 32 * MIB
    buddy = procmem.parse_buddyinfo(Path(FIX / name, "proc/buddyinfo").read_text())
    want = sum(z["counts"][o] << (o - two_mib_order) for z in buddy for o in range(two_mib_order, 14))
    assert doc["free_blocks_of"][str(2 * MIB)] == want > 0


def test_the_fragmented_4k_node_has_no_free_32mib_block():
    """sparkring #173: 27 free 16 MiB blocks and none of 32 MiB after a week (4 KiB kernel: order 12, 13)."""
    doc = doc_of(FIX / "gb10-4k")
    assert doc["free_blocks"][12] == {"size_bytes": 16 * MIB, "count": 27}
    assert doc["free_blocks_of"][str(32 * MIB)] == 0
    assert doc["compaction"]["compact_fail"] == 1350000


def test_blocks_larger_than_the_largest_order_are_not_applicable():
    blocks = procmem.free_blocks([{"node": 0, "zone": "Normal", "counts": [1] * 11}], 4096)   # x86: 4 MiB max
    assert decide.blocks_of(blocks, 32 * MIB) is None
    assert decide.blocks_of(blocks, 2 * MIB) == 1 + 2


def test_pageblocks_and_pressure():
    d4, d64 = doc_of(FIX / "gb10-4k"), doc_of(FIX / "gb10-64k")
    assert d4["pageblocks"]["pageblock_bytes"] == 2 * MIB and d4["pageblocks"]["unmovable"] == 34 + 1874
    assert d64["pageblocks"]["pageblock_bytes"] == 512 * MIB and d64["pageblocks"]["unmovable"] == 32
    assert d64["pressure"]["memory"]["some"] == {"avg10": 12.40, "avg60": 6.81, "avg300": 1.97, "total": 90412337}
    assert d64["pressure"]["memory"]["full"]["avg10"] == 3.05
    assert d64["pressure"]["io"] is None and "/proc/pressure/io" in d64["unreadable"]


def test_this_machines_pagetypeinfo_parses_when_readable():
    text = Host("/").read_text("/proc/pagetypeinfo")
    if text is None:
        assert os.geteuid() != 0          # root-only file: a user reads None, and the report says so
        return
    pti = procmem.parse_pagetypeinfo(text)
    assert pti["order"] is not None and pti["zones"] and "Unmovable" in pti["zones"][0]["blocks"]
    assert all(len(z["blocks"]) >= 4 for z in pti["zones"])


def test_free_now_after_reclaim_and_the_gap():
    doc = doc_of(FIX / "gb10-4k")
    mi = meminfo(FIX / "gb10-4k")
    assert doc["free_now_bytes"] == mi["MemFree"] and doc["free_after_reclaim_bytes"] == mi["MemAvailable"]
    assert doc["reclaimable_gap_bytes"] == mi["MemAvailable"] - mi["MemFree"]
    assert round(doc["reclaimable_gap_bytes"] / GIB, 2) == 74.13       # unsloth #10704: 115.65 - 41.52


@pytest.mark.parametrize("need_gib,fits", [(40, "now"), (100, "after-reclaim"), (116, "no")])
def test_verdict(need_gib, fits):
    v = doc_of(FIX / "gb10-4k", need_gib * GIB)["verdict"]
    assert v["fits"] == fits and v["need_bytes"] == need_gib * GIB
    assert {"now": "fits now", "after-reclaim": "fits after reclaim", "no": "does not fit"}[fits] in v["text"]
    if fits == "after-reclaim":
        assert "sudo spark-memsaver reclaim --need 100G" in v["reason"]
    if fits == "no":
        assert v["reason"].startswith("0.35 GiB more than is free after reclaim")


def test_verdict_names_missing_large_blocks():
    blocks = procmem.free_blocks([{"node": 0, "zone": "Normal", "counts": [10 << 20] + [0] * 10}], 4096)  # 40 GiB, 4 KiB each
    v = decide.verdict(GIB, 40 * GIB, 50 * GIB, blocks)
    assert v["fits"] == "now" and "0.00 GiB of it lies in free blocks of 2 MiB" in v["reason"]


@pytest.mark.parametrize("text,n", [("100G", 100 * GIB), ("1.5GiB", 3 * GIB // 2), ("512M", 512 * MIB),
                                    ("4096", 4096), ("2t", 2 << 40)])
def test_parse_size(text, n):
    assert decide.parse_size(text) == n


@pytest.mark.parametrize("text", ["", "G", "-1G", "1X", "0", "1P"])
def test_parse_size_refuses(text):
    from spark_memsaver.errors import UsageError
    with pytest.raises(UsageError):
        decide.parse_size(text)


def test_installed_memory_beside_memtotal(tmp_path):
    r = root(tmp_path, "gb10-64k", blocks=(512 * MIB, 240))
    inst = doc_of(r)["installed"]
    assert inst["bytes"] == 120 * GIB and inst["not_in_memtotal_bytes"] == max(0, 120 * GIB - 128501256192)
    assert "240 blocks of 512 MiB (239 online)" in inst["source"]
    assert doc_of(FIX / "gb10-4k")["installed"]["bytes"] is None      # no sysfs blocks: cannot be known


@pytest.mark.parametrize("text,unit,cgroup", [
    ("0::/system.slice/vllm.service\n", "vllm.service", "/system.slice/vllm.service"),
    ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/run-r1.scope\n", "run-r1.scope", None),
    ("9:name=systemd:/system.slice/ollama.service\n4:memory:/x\n0::/\n", "ollama.service", None),
    ("0::/docker/abc\n", None, "/docker/abc"),
    ("", None, None)])
def test_pid_to_unit(text, unit, cgroup):
    got = gpuprocs.unit_of(text)
    assert got["unit"] == unit
    if cgroup:
        assert got["cgroup"] == cgroup


def test_nvml_absent_is_unknown_not_zero():
    got = gpuprocs.read(Host("/"))
    if got["state"] == "unknown":
        assert got["reason"] and "processes" not in got
    else:                                   # a machine with an NVIDIA driver
        assert all({"pid", "bytes", "unit", "cgroup"} <= set(p) for p in got["processes"])


def cli(*args):
    return subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", *args], capture_output=True, text=True,
                          env=ENV, timeout=120)


@pytest.mark.parametrize("name", ["gb10-4k", "gb10-64k"])
def test_memory_json_document(name):
    r = cli("--root", str(FIX / name), "memory", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {"schema", "page_size", "total_bytes", "rows", "free_now_bytes", "free_after_reclaim_bytes",
            "free_blocks", "pressure", "verdict"} <= set(doc)
    assert doc["schema"] == 1 and all(set(row) == {"kind", "bytes", "source"} for row in doc["rows"])
    assert all(set(b) == {"size_bytes", "count"} for b in doc["free_blocks"])


def test_memory_text_and_exit_status_follow_the_verdict():
    r = cli("--root", str(FIX / "gb10-4k"), "memory", "--need", "100G")
    assert r.returncode == 0, r.stderr
    assert "Verdict: a 100.00 GiB allocation fits after reclaim" in r.stdout
    assert "Gap (reclaimable page cache and slab):      74.13 GiB" in r.stdout
    assert "32 MiB: 0" in r.stdout and "GPU allocations by process: unknown" in r.stdout
    r = cli("--root", str(FIX / "gb10-4k"), "memory", "--need", "200G")
    assert r.returncode == 1 and "does not fit" in r.stdout
    r = cli("--root", str(FIX / "gb10-4k"), "memory", "--need", "lots", "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["code"] == "usage"


def test_memory_under_a_root_without_proc_is_inspection_impossible(tmp_path):
    r = cli("--root", str(tmp_path), "memory")
    assert r.returncode == 2 and "error[inspection-impossible]" in r.stderr and "Traceback" not in r.stderr


def test_memory_on_this_machine():
    r = cli("memory")
    assert r.returncode == 0, r.stderr
    assert "Free now (what CUDA sees on GB10, MemFree)" in r.stdout and "Verdict: up to" in r.stdout


# --- status's Memory line and the metrics ------------------------------------------------------------------

def test_status_memory_line_has_the_gap_and_the_2mib_blocks(tmp_path):
    """One line, from two small /proc files (no command run): the gap CUDA does not see and the 2 MiB blocks."""
    r = sparkroot.make_spark_root(tmp_path / "r")
    out = cli("--root", str(r), "status", "--direct")
    assert out.returncode in (0, 1), out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("Memory:"))
    mi = procmem.parse_meminfo(sparkroot.MEMINFO)
    gap = (mi["MemAvailable"] - mi["MemFree"]) / GIB
    # 64 KiB: 2 MiB is order 5; each larger block counts as 2**(order-5) of them
    buddy = procmem.parse_buddyinfo(sparkroot.BUDDYINFO)
    b2 = sum(z["counts"][o] << (o - 5) for z in buddy for o in range(5, 14))
    assert f"gap {gap:.2f} GiB reclaimable; {b2} free 2 MiB blocks" in line, line
    doc = json.loads(cli("--root", str(r), "status", "--json", "--direct").stdout)
    assert doc["memory"]["free"] == mi["MemFree"] and doc["memory"]["free_blocks"][5] == \
        {"size_bytes": 2 * MIB, "count": 180 + 60}


def test_metrics_carry_the_rows_blocks_gap_and_pressure():
    from spark_memsaver.report.metrics import exposition
    from tests.test_monitoring import check_exposition, parse_exposition
    for name in ("gb10-4k", "gb10-64k"):
        mem = doc_of(FIX / name)
        text = exposition({"state": "stock", "memory": {}, "host": {"page_size": mem["page_size"]}},
                          memory_doc=mem)
        check_exposition(text)
        s = parse_exposition(text)
        assert sum(v for _, v in s["spark_memsaver_memory_bytes"]) == mem["total_bytes"]
        assert {lab["size"]: v for lab, v in s["spark_memsaver_free_blocks"]} == \
            {str(k): float(v) for k, v in mem["free_blocks_of"].items()}
        assert s["spark_memsaver_reclaimable_gap_bytes"][0][1] == mem["reclaimable_gap_bytes"]
    some60 = [v for lab, v in s["spark_memsaver_memory_pressure_percent"] if lab == {"kind": "some", "window": "avg60"}]
    assert some60 == [6.81]
    # x86 (largest block 4 MiB): no 32 MiB series rather than a 0 that would read as fragmentation
    x86 = doc_of("/")
    s = parse_exposition(exposition({"state": "stock", "memory": {}, "host": {}}, memory_doc=x86))
    assert [lab["size"] for lab, _ in s["spark_memsaver_free_blocks"]] == (
        ["2097152"] if x86["free_blocks"][-1]["size_bytes"] < 32 * MIB else ["2097152", "33554432"])


def test_a_discrete_gpus_memory_is_not_carved_out_of_memtotal():
    reading = observe.read(Host(FIX / "gb10-64k"))
    reading["gpu"] = {"state": "known", "processes": [{"pid": 7, "bytes": 40 * GIB, "unified": False},
                                                      {"pid": 8, "bytes": GIB, "unified": True}]}
    k = kinds(decide.model(reading))
    assert k["gpu-allocations"] == GIB and k["driver-and-other"] == UNCOUNTED_64K - GIB


def test_watch_repeats_and_ctrl_c_ends_it_cleanly():
    import signal
    import time
    p = subprocess.Popen(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(FIX / "gb10-64k"), "memory",
                          "--json", "--watch", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=ENV)
    time.sleep(3)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    docs = [json.loads(line) for line in out.splitlines()]
    assert len(docs) >= 2 and all(d["schema"] == 1 for d in docs)
    assert p.returncode == 0 and "interrupted" not in err, err
