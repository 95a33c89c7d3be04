"""Out of memory, never worse: NVIDIA's page-tree suite and the pool's selftest under allocation failure at 64 KiB.

One arm64 VM (the 6.12 64 KiB debug kernel: KASAN, PROVE_LOCKING, DEBUG_PAGEALLOC, DMA_API_DEBUG, KMEMLEAK, now
with FAULT_INJECTION, FAIL_PAGE_ALLOC, FAILSLAB, FAULT_INJECTION_DEBUG_FS, MEMCG and COMPACTION:
tests/kernel/debug-64k.config) runs tests/kernel/oom/init.sh: for each tier (stock = uvm_pt_pack=0) and case it
loads the patched nvidia-uvm.ko (NVIDIA 580.142, the page-tree test's build: tests/support/uvmvm.py), calls
UVM_TEST_PAGE_TREE through /pt_run (``pt_run oom``), prints the pool's counters and unloads it; then the pool's
selftest module (oom=1) per tier and case. Cases (init.sh's head comment): fail_page_alloc / failslab at an
interval or a probability, restricted to the test task (task-filter + /proc/self/make-it-fail around the ioctl;
the selftest's kthreads mark themselves); ``nth``: /proc/self/fail-nth from a seed, one injected failure per
call at a seeded position; ``memcg``: the test in a memory cgroup under memory.max; ``hog``: a background hog
holding the guest at the edge of its memory.

Required of every tier and case (``problems()``): the VM finishes (no hang), each load and unload succeeds, every
call returns, with NV_OK or NV_ERR_NO_MEMORY, or a status stock NVIDIA returned under the same case (NVIDIA's own
test code, not ours: listed in the table); the pool's live counters (tables, pages, leaked, bad frees) are 0 after
each case; the selftest passes (gets == puts, empty pools, failed allocations counted, not errors); no KASAN,
lockdep, DMA-API, WARN, BUG or Oops line (the OOM killer's and the page allocator's own stack dumps excepted),
kmemleak's scan empty and kmemleak still running. Packed tiers are compared with stock: the set of statuses per
case, and failures injected.

CI runs a small matrix (stock + leaf, one case of each kind); ``SPARK_MEMSAVER_TEST_OOM_ALL=1`` runs the full one
(every tier, several probabilities and intervals, a seeded fail-nth sweep, two memory limits). Not vacuous:
test_oom_checks_catch_a_broken_pool runs the selftest built with the pool's fault injection 6 (a page whose
descriptor cannot be allocated is dropped: a leak) and 7 (a failed get() reported as success) and requires
``problems()`` to name each. Results and the command: docs/kernel-tests.md ("Out of memory").
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from tests.support import nvsrc, qemu, uvmvm
from tests.test_kernel_pagetree import _say, build_or_skip, kernel_or_skip

VERSION = "580.142"
KIND = "debug-6.12-64k"
ALL_ENV = "SPARK_MEMSAVER_TEST_OOM_ALL"
OOM_INIT = uvmvm.KDIR / "oom" / "init.sh"
NV_OK, NV_ERR_NO_MEMORY = 0x0, 0x51
TOKENS = {0: "stock", 1: "4k-all", 2: "256", 3: "leaf"}
#: CI's share: stock and the default tier, one case of each kind (~4 min of VM on 2 cores)
SMALL = {"OOM_TIERS": "0,3", "OOM_CASES": "page-i:40,slab-i:40,memcg:4M,hog:2048", "OOM_CALLS": "2",
         "ST_TIERS": "0,3", "ST_CASES": "page-p:5,slab-p:5", "ST_OPS": "4000"}
#: SPARK_MEMSAVER_TEST_OOM_ALL=1: every tier, probabilities and intervals of both kinds, a seeded fail-nth sweep
FULL = {"OOM_TIERS": "0,1,2,3",
        "OOM_CASES": "page-i:3,page-i:97,page-p:2,page-p:25,slab-i:5,slab-i:211,slab-p:2,slab-p:25,nth:7,"
                     "memcg:4M,hog:4096",
        "OOM_CALLS": "4", "ST_TIERS": "0,1,2,3",
        "ST_CASES": "page-p:2,page-p:25,page-i:9,slab-p:2,slab-p:25,slab-i:13,memcg:4M,hog:4096",
        "ST_OPS": "4000"}
LIVE_KEYS = ("c256_tables", "c256_pages", "c4096_tables", "c4096_pages", "leaked_tables", "leaked_pages",
             "bad_frees")
CALL = re.compile(r"PT-OOM call=(\d+) ioctl=(-?\d+) errno=(\d+) rmStatus=0x([0-9a-f]+) nth=(\d+) "
                  r"injected=(-?\d+) ms=(\d+)")
ST_RESULT = re.compile(r"PTPACK-SELFTEST tier=(\d) result=(\w+) iommu=\d threads=\d+ ops=(\d+) tables_max=\d+ "
                       r"gets=(\d+) puts=(\d+) errors=(\d+) page_size=\d+ oom=1 enomem=(\d+) eio=(\d+) whole=(\d+)")
#: stack dumps the kernel prints on purpose when memory runs out (the OOM killer, a failed allocation without
#: __GFP_NOWARN): their "Call trace:" is a report of the condition under test, not of a defect
OOM_REPORT = re.compile(r"invoked oom-killer:|page allocation failure:|vmalloc error: size")
LEAK = re.compile(r"unreferenced object 0x[0-9a-f]+ \(size (\d+)\):\n\s+comm \"([^\"]*)\", pid (\d+)")
#: debug facilities that switch themselves off when their own allocations fail: the run would check less
DEBUG_OFF = re.compile(r"Kernel memory leak detector disabled|kmemleak: Cannot allocate|"
                       r"DMA-API: debugging out of memory|dma-debug disabled|DEBUG_LOCKS_WARN_ON|turning off the locking correctness")


def _cmdline(matrix: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in matrix.items())


def _block(log: str, begin: str, end: str) -> str:
    return log.split(begin, 1)[1].split(end, 1)[0] if begin in log else ""


def _stats(text: str) -> dict[str, str]:
    return dict(ln.split(" ", 1) for ln in text.splitlines() if " " in ln)


def bad_console_lines(log: str) -> list[str]:
    """qemu.bad_lines, less the "Call trace:" of the kernel's own out-of-memory reports (within 40 lines of their
    header, with no other report line between)."""
    lines = log.splitlines()
    excused, since = set(), None
    for i, ln in enumerate(lines):
        if OOM_REPORT.search(ln):
            since = i
        elif since is not None and (i - since > 40 or re.search(r"\bBUG: |\bWARNING: |cut here", ln)):
            since = None
        if since is not None and "Call trace:" in ln:
            excused.add(i)
    bad = set(qemu.bad_lines(log.replace(_block(log, "KMEMLEAK-BEGIN", "KMEMLEAK-END"), "")))
    return [ln for i, ln in enumerate(lines) if ln in bad and i not in excused]


def parse(log: str) -> tuple[list[dict], list[dict]]:
    """(NVIDIA's cases, the selftest's cases) of a console log, one dict per tier and case."""
    nv, st = [], []
    for m in re.finditer(r"OOM-LOAD tier=(\d) case=(\S+) rc=(-?\d+)", log):
        t, case = int(m.group(1)), m.group(2)
        tag = f"tier={t} case={case}"
        run = _block(log, f"OOM-BEGIN {tag}", f"OOM-END {tag}")
        end = re.search(rf"OOM-END {re.escape(tag)} rc=(-?\d+) secs=(\d+) injected=(\d+)", log)
        calls = [dict(ioctl=int(c.group(2)), status=int(c.group(4), 16), nth=int(c.group(5)),
                      injected=int(c.group(6)), ms=int(c.group(7))) for c in CALL.finditer(run)]
        unload = re.search(rf"OOM-UNLOAD {re.escape(tag)} rc=(-?\d+)", log)
        pid = re.search(r"PT-OOM pid=(\d+)", run)
        nv.append(dict(tier=t, case=case, load=int(m.group(3)), calls=calls, end=end and int(end.group(1)),
                       pid=pid and int(pid.group(1)),
                       secs=end and int(end.group(2)), injected=(int(end.group(3)) if end else 0)
                       + sum(c["injected"] == 1 for c in calls),
                       stats=_stats(_block(log, f"STATS-BEGIN {tag}\n", "STATS-END")),
                       unload=unload and int(unload.group(1)), cgroup=re.findall(r"CGROUP .*", run),
                       hog=re.findall(r"HOG .*", run), vm=re.findall(r"vmstat (.*)", log[m.start():log.find(
                           f"OOM-UNLOAD {tag}", m.start())])))
    for m in re.finditer(r"ST-BEGIN ko=(\S+) tier=(\d) case=(\S+)", log):
        ko, t, case = m.group(1), int(m.group(2)), m.group(3)
        tag = f"ko={ko} tier={t} case={case}"
        run = _block(log, f"ST-BEGIN {tag}", f"ST-END {tag}")
        end = re.search(rf"ST-END {re.escape(tag)} rc=(-?\d+) secs=(\d+) injected=(\d+)", log)
        res = ST_RESULT.search(run)
        unload = re.search(rf"ST-UNLOAD {re.escape(tag)} rc=(-?\d+)", log)
        st.append(dict(ko=ko, tier=t, case=case, result=res and res.groups(), end=end and int(end.group(1)),
                       secs=end and int(end.group(2)), injected=end and int(end.group(3)),
                       stats=_stats(_block(log, f"STATS-BEGIN {tag}\n", "STATS-END")),
                       unload=unload and int(unload.group(1)), cgroup=re.findall(r"CGROUP .*", run)))
    return nv, st


def leaks_by_case(log: str, nv: list[dict]) -> dict:
    """kmemleak's objects (sizes) by (tier, case) of the pt_run that allocated them; None: any other task. NVIDIA's
    test leaks on some of its own error paths (shrink_test() returns without uvm_page_tree_deinit() when a get
    fails): with the pool off too, so a packed tier may leak exactly what stock leaked in the same case."""
    by_pid = {r["pid"]: (r["tier"], r["case"]) for r in nv if r.get("pid")}
    out: dict = {}
    for size, comm, pid in LEAK.findall(_block(log, "KMEMLEAK-BEGIN", "KMEMLEAK-END")):
        out.setdefault(by_pid.get(int(pid)) if comm == "pt_run" else None, []).append(int(size))
    return out


def problems(log: str, calls: int) -> list[str]:
    """Everything the out-of-memory run requires, as a list of what failed (empty: the run passed)."""
    out = []
    if "VM-DONE" not in log:
        out.append("the VM did not finish (hang or crash): " + log[-1500:])
    out += [f"console: {ln}" for ln in bad_console_lines(log)]
    out += [f"debug facility off: {ln}" for ln in log.splitlines() if DEBUG_OFF.search(ln)]
    nv, st = parse(log)
    if "KMEMLEAK-BEGIN" not in log:
        out.append("kmemleak: no scan")
    leaks = leaks_by_case(log, nv)
    for key, sizes in leaks.items():
        if key is None:
            out.append(f"kmemleak: {len(sizes)} objects of no NVIDIA test call: "
                       + _block(log, "KMEMLEAK-BEGIN", "KMEMLEAK-END").strip()[:1500])
        elif key[0] != 0 and sorted(sizes) != sorted(leaks.get((0, key[1]), [])):
            out.append(f"kmemleak: tier {key[0]} case {key[1]} leaked {sorted(sizes)} B, stock {sorted(leaks.get((0, key[1]), []))}")
    stock = {}
    for r in nv:
        if r["tier"] == 0:
            stock.setdefault(r["case"], set()).update(c["status"] for c in r["calls"])
    for r in nv:
        where = f"nvidia-uvm tier {r['tier']} case {r['case']}"
        if r["load"] != 0 or r["unload"] != 0:
            out.append(f"{where}: load rc {r['load']}, unload rc {r['unload']}")
        if len(r["calls"]) != calls or r["end"] != 0:
            out.append(f"{where}: {len(r['calls'])} of {calls} calls returned (pt_run rc {r['end']})")
        allowed = {NV_OK, NV_ERR_NO_MEMORY} | stock.get(r["case"], set())
        for c in r["calls"]:
            if c["ioctl"] != 0 or c["status"] not in allowed:
                out.append(f"{where}: ioctl {c['ioctl']} status 0x{c['status']:x} (allowed: "
                           f"{sorted(hex(s) for s in allowed)})")
        live = {k: r["stats"].get(k) for k in LIVE_KEYS if r["stats"].get(k) != "0"}
        if live:
            out.append(f"{where}: live counters not 0 after the case: {live}")
    for r in st:
        where = f"selftest {r['ko']} tier {r['tier']} case {r['case']}"
        res = r["result"]
        if not res or res[1] != "pass" or res[5] != "0" or res[3] != res[4]:
            out.append(f"{where}: {res and 'result=%s errors=%s gets=%s puts=%s' % (res[1], res[5], res[3], res[4])}")
        # under memory.max the memory cgroup's OOM killer may take insmod (the cgroup's one task: the
        # kthreads charge to it) -- the kernel's answer to the limit; the selftest still finishes and passes
        killed = r["case"].startswith("memcg") and r["end"] == 137 and re.search(r" oom_kill [1-9]",
                                                                                 " ".join(r["cgroup"]))
        if (r["end"] != 0 and not killed) or r["unload"] != 0:
            out.append(f"{where}: insmod rc {r['end']}, rmmod rc {r['unload']}")
        live = {k: r["stats"].get(k) for k in LIVE_KEYS if r["stats"].get(k) != "0"}
        if live:
            out.append(f"{where}: live counters not 0: {live}")
    return out


def table(log: str) -> str:
    """The per tier and case table docs/kernel-tests.md records."""
    nv, st = parse(log)
    stock = {r["case"]: sorted({c["status"] for c in r["calls"]}) for r in nv if r["tier"] == 0}
    leaks = leaks_by_case(log, nv)
    rows = ["| tier | case | calls | NV_OK | NV_ERR_NO_MEMORY | other | failures injected | statuses vs stock | "
            "kmemleak (NVIDIA's test) | 256 B tables packed | s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in nv:
        sts = [c["status"] for c in r["calls"]]
        same = "stock" if r["tier"] == 0 else ("same" if sorted(set(sts)) == stock.get(r["case"]) else
                                               f"stock {[hex(s) for s in stock.get(r['case'], [])]}")
        other = [hex(s) for s in sts if s not in (NV_OK, NV_ERR_NO_MEMORY)]
        rows.append(f"| {TOKENS[r['tier']]} | {r['case']} | {len(sts)} | {sts.count(NV_OK)} | "
                    f"{sts.count(NV_ERR_NO_MEMORY)} | {' '.join(other) or 0} | {r['injected']} | {same} | "
                    f"{len(leaks.get((r['tier'], r['case']), []))} | {r['stats'].get('test_total_c256_tables', '-')} | "
                    f"{r['secs']} |")
    rows += ["", "| selftest | tier | case | result | ops | gets = puts | enomem | eio | whole page | failures "
                 "injected | s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in st:
        res = r["result"] or ("?",) * 9
        rows.append(f"| {r['ko']} | {TOKENS[r['tier']]} | {r['case']} | {res[1]} | {res[2]} | {res[3]} = {res[4]} | "
                    f"{res[6]} | {res[7]} | {res[8]} | {r['injected']} | {r['secs']} |")
    return "\n".join(rows)


def _initramfs(built: uvmvm.Built, runner: Path, selftests: dict[str, Path], dest: Path) -> Path:
    return uvmvm.initramfs(built, runner, dest, init=OOM_INIT, extra=selftests)


def _boot(k, rd, matrix, tmp, request, what):
    t0 = time.time()
    log = qemu.boot(k, rd, append=_cmdline(matrix), timeout=3600).replace("\r", "")
    (tmp / "console.log").write_text(log)
    _say(request, f"\n[oom {what}] VM {time.time() - t0:.0f}s, log {tmp}/console.log\n" + table(log))
    return log


@pytest.mark.kernel
@pytest.mark.slow
@pytest.mark.heavy_first
def test_out_of_memory_is_never_worse_than_stock(tmp_path, request):
    """NVIDIA's UVM_TEST_PAGE_TREE (stock and packed tiers) and the pool's selftest under fail_page_alloc,
    failslab, fail-nth, memory.max and a memory hog: problems() is empty (a packed tier's statuses are NV_OK,
    NV_ERR_NO_MEMORY or what stock returned in the same case), the injections really failed allocations, each
    packed tier packed, the selftest saw ENOMEM."""
    full = os.environ.get(ALL_ENV) == "1"
    matrix = FULL if full else SMALL
    k = kernel_or_skip(KIND)
    nvsrc.nvidia_source(VERSION)
    built = build_or_skip(k, VERSION)
    st = qemu.selftest_module(k, tmp_path / "st", defines=(uvmvm.SWITCH,))
    rd = _initramfs(built, uvmvm.pt_run(built, tmp_path / "pt_run"), {"st-0.ko": st}, tmp_path / "initrd.gz")
    log = _boot(k, rd, matrix, tmp_path, request, "full" if full else "CI matrix")
    found = problems(log, int(matrix["OOM_CALLS"]))
    assert not found, "\n".join(found[:40])
    nv, stt = parse(log)
    tiers = [int(t) for t in matrix["OOM_TIERS"].split(",")]
    cases = matrix["OOM_CASES"].split(",")
    assert sorted({(r["tier"], r["case"]) for r in nv}) == sorted((t, c) for t in tiers for c in cases)
    assert len(stt) == len(matrix["ST_TIERS"].split(",")) * len(matrix["ST_CASES"].split(","))
    for r in nv + [r for r in stt if r["tier"] != 0]:        # the selftest allocates nothing with the pool off
        if r["case"].split(":")[0] in ("page-i", "page-p", "slab-i", "slab-p", "nth"):
            assert r["injected"] > 0, (r["tier"], r["case"], "no failure injected: the case tested nothing")
    # the injections reach the pool's failure paths: NV_ERR_NO_MEMORY seen in a packed tier
    assert any(c["status"] == NV_ERR_NO_MEMORY for r in nv if r["tier"] != 0 for c in r["calls"])
    # each packed tier packed (the switch build's counters, per load: a call that fails at its 40th allocation
    # may end before the first packed table, the uninjected cases run the whole suite) and the selftest saw ENOMEM
    for t in tiers:
        if t != 0:
            assert any(int(r["stats"]["test_total_c256_tables"]) > 0 for r in nv if r["tier"] == t), t
    assert any(int(r["result"][6]) > 0 for r in stt if r["tier"] != 0)
    # memory.max bit the selftest's charged user trees (the full matrix: UVM's fake trees are charged nowhere)
    for r in stt:
        if r["case"].startswith("memcg"):
            assert re.search(r" max [1-9]", " ".join(r["cgroup"])), r["cgroup"]


@pytest.mark.kernel
@pytest.mark.slow
@pytest.mark.heavy_first
def test_oom_checks_catch_a_broken_pool(tmp_path, request):
    """Not vacuous: the selftest with the pool built to fail on its out-of-memory paths -- 6: a backing page whose
    descriptor cannot be allocated is dropped (leaked, with its DMA mapping); 7: a failed get() is reported as
    success -- under failslab and fail_page_alloc in the leaf tier: problems() names each."""
    k = kernel_or_skip(KIND)
    nvsrc.nvidia_source(VERSION)
    built = build_or_skip(k, VERSION)
    mods = {f"st-{n}.ko": qemu.selftest_module(k, tmp_path / f"st{n}",
                                               defines=(uvmvm.SWITCH, f"UVM_PT_PACK_FAULT_INJECT={n}"))
            for n in (6, 7)}
    rd = _initramfs(built, uvmvm.pt_run(built, tmp_path / "pt_run"), mods, tmp_path / "initrd.gz")
    matrix = {"OOM_TIERS": "", "ST_TIERS": "3", "ST_CASES": "slab-p:20,page-p:20", "ST_OPS": "4000"}
    log = _boot(k, rd, matrix, tmp_path, request, "broken pool")
    found = problems(log, 0)
    _say(request, "\n".join(found[:12]))
    assert "VM-DONE" in log, log[-3000:]
    for n in (6, 7):
        assert any(f"selftest /st-{n}.ko tier 3" in p for p in found), (n, found)


def _leak(pid, size=327680):
    return f"unreferenced object 0xffff800083410000 (size {size}):\n  comm \"pt_run\", pid {pid}, jiffies 1\n"


def _synthetic(tier0=("0x51", "0x0"), tier3=("0x51", "0x0"), live="0", st="pass", extra="", leaks=""):
    """A console log of one NVIDIA case in stock and leaf and one selftest case, as init.sh and pt_run print it."""
    stats = "".join(f"{k} {live if k == 'c256_tables' else '0'}\n" for k in LIVE_KEYS) + "test_total_c256_tables 5\n"
    out = ["VM-BOOTED kernel=6.12.117 page_size=65536", "NVIDIA-LOAD rc=0"]
    for t, sts in ((0, tier0), (3, tier3)):
        tag = f"tier={t} case=page-i:40"
        out += [f"OOM-LOAD {tag} rc=0", f"OOM-BEGIN {tag} vmstat oom_kill=0 ", f"PT-OOM pid={100 + t} mode=task calls=2"]
        out += [f"PT-OOM call={i} ioctl=0 errno=0 rmStatus={s} nth=0 injected=-1 ms=5" for i, s in enumerate(sts)]
        out += [f"OOM-END {tag} rc=0 secs=3 injected=2 vmstat oom_kill=0 ", f"STATS-BEGIN {tag}", stats.rstrip(),
                "STATS-END", f"OOM-UNLOAD {tag} rc=0"]
    tag = "ko=/st-0.ko tier=3 case=slab-p:5"
    out += [f"ST-BEGIN {tag} vmstat x=0 ",
            f"PTPACK-SELFTEST tier=3 result={st} iommu=1 threads=4 ops=16000 tables_max=9 gets=7 puts=7 errors=0 "
            "page_size=65536 oom=1 enomem=3 eio=0 whole=1",
            f"ST-END {tag} rc=0 secs=4 injected=9 vmstat x=0 ", f"STATS-BEGIN {tag}", stats.rstrip(), "STATS-END",
            f"ST-UNLOAD {tag} rc=0", extra, "KMEMLEAK-BEGIN", leaks, "KMEMLEAK-END", "VM-DONE"]
    return "\n".join(out) + "\n"


def test_problems_names_what_an_out_of_memory_run_must_not_do():
    """The judge of test_out_of_memory_is_never_worse_than_stock on console logs as the VM prints them: a clean
    run passes (the OOM killer's own stack dump excused); each defect is named."""
    ok = _synthetic(extra="pt_run invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0\nCall trace:\n"
                          " dump_backtrace+0x0/0x1e0\nOut of memory: Killed process 77 (pt_run)")
    assert problems(ok, 2) == []
    nv, st = parse(ok)
    assert [(r["tier"], r["injected"], [c["status"] for c in r["calls"]]) for r in nv] == \
        [(0, 2, [0x51, 0]), (3, 2, [0x51, 0])] and st[0]["result"][6] == "3"
    assert "| leaf | page-i:40 | 2 | 1 | 1 | 0 | 2 | same | 0 | 5 | 3 |" in table(ok)
    bad = {
        "status 0x40": _synthetic(tier3=("0x40", "0x0")),                 # a status stock never gave
        "live counters not 0": _synthetic(live="1"),                      # a table or page left behind
        "result=fail": _synthetic(st="fail"),                             # the selftest's own checks
        "1 of 2 calls returned": _synthetic(tier3=("0x0",)),              # a call that never came back
        "console: WARNING: CPU": _synthetic(extra="WARNING: CPU: 1 PID: 7 at uvm_pt_pack.c:1"),
        "debug facility off": _synthetic(extra="kmemleak: Kernel memory leak detector disabled"),
        "kmemleak": _synthetic(leaks=_leak(55)),                          # a leak of another task
        "kmemleak: tier 3": _synthetic(leaks=_leak(103)),                 # the leaf run leaked, stock did not
        "did not finish": _synthetic().replace("VM-DONE", "VM-TIMEOUT after 3600 s"),
    }
    for what, log in bad.items():
        assert any(what in p for p in problems(log, 2)), (what, problems(log, 2))
    # NVIDIA's test leaking on its own error path, as much with the pool off: its own, not ours
    assert problems(_synthetic(leaks=_leak(100) + _leak(103)), 2) == []
    # a status stock NVIDIA gives under the same case is NVIDIA's own, in every tier
    assert problems(_synthetic(tier0=("0x40", "0x0"), tier3=("0x40", "0x0")), 2) == []
