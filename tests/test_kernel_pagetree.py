"""NVIDIA's own UVM built-in tests (UVM_TEST_PAGE_TREE and the GPU-free ones) through our packing hooks, in arm64 VMs.

The real patched nvidia-uvm.ko (an NVIDIA open tree through the product's apply step, built by NVIDIA's own
Makefile) loads beside a stand-in nvidia.ko built in the same Kbuild run from NVIDIA's headers
(tests/kernel/standin-rm: session and callback registration succeed, every other RM entry point returns
NV_ERR_NOT_SUPPORTED). PID 1 (tests/kernel/pagetree/init.sh) loads nvidia-uvm with uvm_enable_builtin_tests=1
and uvm_pt_pack=0,1,2,3 in turn; /pt_run (static arm64, the tree's own ioctl headers) calls UVM_INITIALIZE,
UVM_TEST_PAGE_TREE (UVM's page-tree tests on fake Maxwell..Blackwell GPUs, pci_dev == NULL: the test build's
-DUVM_PT_PACK_TEST_FAKE_GPU lets the pool take them) and NVIDIA's tests that need no GPU (range tree, rb tree,
locks, kvmalloc, allocator, kthread queue, uvm_mem, CPU chunks, ...). The pool's cumulative test counters prove
what was packed in each run.

Cases (kernel x branch):
- ``64k-rNNN``: every manifest branch (r535, r550, r555 from Debian's archive; r580, r590, r595 from the shared
  NVIDIA trees) on the 64 KiB debug kernel from Debian trixie's linux-source-6.12 (KASAN, PROVE_LOCKING,
  DEBUG_PAGEALLOC, DMA_API_DEBUG, KMEMLEAK, MODVERSIONS: tests/support/debugkernel.py). 64 KiB is where every
  tier shares pages, the default (leaf) included.
- ``16k-r580`` / ``4k-rNNN``: Debian trixie's prebuilt 6.12 arm64-16k / arm64 kernels (NVIDIA's own check_sizes
  fails at 16 KiB with the pool off; at 4 KiB only tier 256 is active), 4 KiB for every branch (``-k "4k and not
  64k"``: pytest's -k matches substrings, and "4k-r580" is part of "64k-r580").
NVIDIA's trees do not compile against Debian's 7.2/7.3 (linux/of_gpio.h is gone), hence 6.12.

All VM tests are `slow`. CI runs 64k-r580 and 64k-r595 (SPARK_MEMSAVER_TEST_KERNEL_64K=1, set by .ci/run: the
64 KiB debug kernel is built by tests/test_kernel_build.py, ~5 min of CI's 2 quiet cores, then NVIDIA 580.142 and
595.45.04 for it; .ci/run fails when either did not pass; these cases are ``heavy_first``, so CI's budget for starting heavy tests never starves them) and 4k-r580 (the whole
suite at 4 KiB; it may give way to the budget). The others run where their kernel and module builds are cached,
or with SPARK_MEMSAVER_BUILD_KERNEL=1 / SPARK_MEMSAVER_TEST_PAGETREE_ALL=1 (which build them: the 64 KiB debug
kernel 5-45 min, each NVIDIA build 5-15 min on 2 cores); otherwise they skip with that reason, also in CI.
End to end at 64 KiB (figures printed without -s):
``SPARK_MEMSAVER_TEST_PAGETREE_ALL=1 tools/test tests/test_kernel_pagetree.py -k 64k -v`` (add
SPARK_MEMSAVER_BUILD_KERNEL=1 on a machine without the kernel). Details and results: docs/kernel-tests.md.
The switch must never reach the product: test_switch_absent_from_the_dkms_build checks the rendered DKMS
tree and the apply step's output for every tier, and a pool object built with the DKMS flags.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import shutil
import time
from pathlib import Path

import pytest

from tests.support import cache, needs, nvsrc, qemu, uvmvm

VERSION = "580.142"
#: the manifest's branches, the tree each runs (r580 first: the DGX Spark branch)
BRANCHES = {"r580": "580.142", "r595": "595.45.04", "r590": "590.48.01", "r550": "550.163.01",
            "r535": "535.261.03", "r555": "555.58.02"}
CASES = ([("debug-6.12-64k", b) for b in BRANCHES] + [("debian-6.12-16k", "r580")]
         + [("debian-6.12-4k", b) for b in BRANCHES])
SHORT = {"debug-6.12-64k": "64k", "debian-6.12-16k": "16k", "debian-6.12-4k": "4k"}
TIERS = (0, 1, 2, 3)
TOKENS = {0: "off", 1: "4k-all", 2: "256", 3: "leaf"}
#: the switch as a build input would spell it (a -D flag or a #define), not the pool's own #ifdef lines
SWITCH_SET = re.compile(rb"-D\s*" + uvmvm.SWITCH.encode() + rb"|#\s*define\s+" + uvmvm.SWITCH.encode())
DEBIAN_DEBUG = "slub_debug=FZPU kfence.sample_interval=10 page_poison=1 init_on_free=1"
OPT_IN = "SPARK_MEMSAVER_BUILD_KERNEL"
ALL_ENV = "SPARK_MEMSAVER_TEST_PAGETREE_ALL"
CI_CASE = ("debian-6.12-4k", "580.142")   # CI's share: NVIDIA's whole suite at 4 KiB, r580
#: .ci/run sets it: CI builds the 6.12 64 KiB debug kernel (tests/test_kernel_build.py) and NVIDIA 580.142 for it
CI64_ENV = "SPARK_MEMSAVER_TEST_KERNEL_64K"
CI64_CASE = ("debug-6.12-64k", "580.142")
#: every case CI runs at 64 KiB: r580 (the DGX Spark branch) and the newest branch, r595 (.ci/run checks that
#: both passed, not skipped: tools/ci-required)
CI64_CASES = (CI64_CASE, ("debug-6.12-64k", "595.45.04"))


def ci_64k() -> bool:
    return os.environ.get(CI64_ENV) == "1"
#: NVIDIA's own check_sizes() (uvm_page_tree_test.c) expects user chunk sizes of a 4 KiB or 64 KiB kernel; on a
#: 16 KiB kernel uvm_mmu_init_gpu_chunk_sizes() adds PAGE_SIZE (16K) and the check fails, with the pool off too.
#: pascal_test_page_tree() stops there, so volta..blackwell do not run on 16 KiB (they do on 4 KiB and 64 KiB).
NV_16K_FAILURE = ["check_sizes Test check failed, condition 'gpu->parent->mmu_user_chunk_sizes == user_sizes' not true",
                  "pascal_test_page_tree Test check failed, call 'check_sizes(pascal)' returned "
                  "'Generic Error: Invalid state [NV_ERR_INVALID_STATE]', expected 'Success [NV_OK]'",
                  "uvm_test_page_tree Test check failed, call 'pascal_test_page_tree(gpu)' returned "
                  "'Generic Error: Invalid state [NV_ERR_INVALID_STATE]', expected 'Success [NV_OK]'"]
NV_ERR_INVALID_STATE = "0x40"
FAILED = re.compile(r"nvidia-uvm: uvm_\w+\.c:\d+ (\w+)\[pid:\d+\] (Test check failed.*)$", re.M)
#: NVIDIA's built-in tests that need no GPU, as tests/kernel/pagetree/pt_run.c names them ("gpu_free")
GPU_FREE = ("rng", "range_tree", "range_tree_random", "rb_tree", "rb_tree_random", "lock", "kvmalloc",
            "perf_utils", "range_allocator", "thread_context", "mem", "cpu_chunk", "perf_events")


def _say(request, text: str) -> None:
    """Print past pytest's capture, so that `-k 64k -v` shows each case's figures (result lines, tables per page,
    times) without -s: docs/kernel-tests.md records them from this output."""
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        print(text, flush=True)


def _opted_in() -> bool:
    return os.environ.get(OPT_IN) == "1" or os.environ.get(ALL_ENV) == "1"


def kernel_or_skip(kind: str) -> qemu.Kernel:
    """The kernel when it is cached (or an opt-in lets it be built), else skip with why. CI's 4 KiB kernel: always."""
    if kind.startswith("debian-6.12-"):
        flavour = "arm64-16k" if kind.endswith("16k") else "arm64"
        ready = glob.glob(str(cache.cache_dir() / "kernel" / f"debian-{flavour}-6.12.*" / ".ready"))
        if kind != CI_CASE[0] and not ready and not _opted_in():
            needs.beyond_ci(f"Debian's 6.12 {flavour} kernel tree", f"not cached; {ALL_ENV}=1 prepares it (~4 min)")
        return qemu.kernel(kind)
    if os.environ.get(OPT_IN) == "1" or (kind == CI64_CASE[0] and ci_64k()):
        return qemu.kernel(kind, build=True)  # builds it where it is not cached: a failure to build is a failure
    try:
        return qemu.kernel(kind, build=False)  # never builds without the opt-in: CI skips the others here
    except qemu.Unavailable as e:
        needs.beyond_ci(f"the {kind} kernel", str(e))


def build_gate(k: qemu.Kernel, version: str, inject: int = 0) -> None:
    """Skip unless the patched build is cached (or opted in, or CI's case): one more NVIDIA build is ~5-15 min.
    Asked before NVIDIA's source is fetched, so that a skipped case downloads nothing."""
    ci = (k.kind, version, inject) == (*CI_CASE, 0) or (inject == 0 and (k.kind, version) in CI64_CASES and ci_64k())
    if not ci and not uvmvm.is_cached(k, version, inject) and not _opted_in():
        needs.beyond_ci(f"NVIDIA {version} built for {k.release}",
                        f"not cached for these sources; {ALL_ENV}=1 builds it (5-15 min on 2 cores, beyond CI's share)")


def build_or_skip(k: qemu.Kernel, version: str, inject: int = 0) -> uvmvm.Built:
    """The patched build when cached (or opted in, or CI's case), else skip (build_gate)."""
    build_gate(k, version, inject)
    return uvmvm.cached_build(k, version, inject)


@pytest.fixture(scope="module", params=[pytest.param(c, marks=[pytest.mark.heavy_first] if (c[0], BRANCHES[c[1]]) in CI64_CASES
                                                     else []) for c in CASES], ids=[f"{SHORT[k]}-{b}" for k, b in CASES])
def vm(request, tmp_path_factory):
    kind, branch = request.param
    version = BRANCHES[branch]
    tmp = tmp_path_factory.mktemp(f"pagetree-{SHORT[kind]}-{branch}")
    # the kernel first: where it is not cached (the 64 KiB debug kernel in CI, always) the case skips before
    # anything is downloaded or unpacked for it
    k = kernel_or_skip(kind)
    build_gate(k, version)                  # a case beyond CI's share skips here, before any source is fetched
    nvsrc.nvidia_source(version)            # Debian's archive or the shared trees (a failure under tools/test if absent)
    t0 = time.time()
    built = build_or_skip(k, version)
    runner = uvmvm.pt_run(built, tmp / "pt_run")
    rd = uvmvm.initramfs(built, runner, tmp / "initrd.gz")
    t1 = time.time()
    log = qemu.boot(k, rd, append="" if kind.startswith("debug") else DEBIAN_DEBUG, timeout=3600)
    (tmp / "console.log").write_text(log)
    _say(request, f"\n[{SHORT[kind]}-{branch} {version}] build {'cached' if t1 - t0 < 60 else 'cold'} {t1 - t0:.0f}s "
         f"(NVIDIA build {built.seconds:.0f}s when made), VM {time.time() - t1:.0f}s, log {tmp}/console.log")
    return k, built, log.replace("\r", "")


def _stats(log: str, tier: int) -> dict[str, str]:
    block = log.split(f"STATS-BEGIN tier={tier}\n", 1)[1].split("STATS-END", 1)[0]
    return dict(ln.split(" ", 1) for ln in block.splitlines() if " " in ln)


def _run_of(log: str, tier: int, tag: str = "PT") -> str:
    return log.split(f"{tag}-BEGIN tier={tier}\n", 1)[1].split(f"{tag}-RC tier={tier}", 1)[0]


def _around(log: str, line: str, n: int = 40) -> str:
    """The console lines around ``line``'s first occurrence (what led to a bad line, e.g. an RCU stall's header)."""
    lines = log.splitlines()
    i = lines.index(line)
    return "\n".join(lines[max(0, i - n):i + n])


def _failures(run: str) -> list[str]:
    return [f"{m.group(1)} {m.group(2).strip()}" for m in FAILED.finditer(run)]


@pytest.mark.kernel
@pytest.mark.slow
def test_page_tree_passes_in_every_tier(vm, request):
    """4 KiB and 64 KiB: UVM_TEST_PAGE_TREE returns NV_OK in every tier. 16 KiB: NVIDIA's own check_sizes() fails
    with the pool off; every tier gives exactly that result (the same three lines) and nothing else. No KASAN,
    lockdep, DMA-API, kmemleak, WARN or BUG line anywhere; RM was asked for nothing the stand-in lacks."""
    k, built, log = vm
    assert "VM-DONE" in log, "the VM did not finish its script:\n" + log[-4000:]
    bad = qemu.bad_lines(log)
    assert not bad, "kernel reported problems:\n" + "\n".join(bad[:40]) + "\n--- the first in context:\n" + \
        _around(log, bad[0])
    assert "NVIDIA-LOAD rc=0" in log and "NVIDIA-UNLOAD rc=0" in log, log[-4000:]
    # the RM calls of a whole run: session and callbacks only, no stubbed entry point
    called = re.findall(r"standin-rm: (nvUvmInterface\w+) -> (\S+)", log)
    # 590 and later register events with RegisterUvmEvents/DeRegisterUvmEvents, earlier ones with
    # RegisterUvmCallbacks/DeRegisterUvmOps (tests/kernel/standin-rm/gen_stubs.py)
    reg, dereg = (("RegisterUvmEvents", "DeRegisterUvmEvents") if int(built.version.split(".")[0]) >= 590
                  else ("RegisterUvmCallbacks", "DeRegisterUvmOps"))
    assert sorted(called) == sorted([("nvUvmInterfaceSessionCreate", "NV_OK"), (f"nvUvmInterface{reg}", "NV_OK"),
                                     (f"nvUvmInterface{dereg}", "void"), ("nvUvmInterfaceSessionDestroy", "NV_OK")]), called
    if k.page_size == 65536:
        assert "KMEMLEAK-BEGIN" in log, "the debug kernel has no kmemleak: " + log[-2000:]
    for t in TIERS:
        assert f"UVM-LOAD tier={t} rc=0" in log, log[-4000:]
        run = _run_of(log, t)
        assert "PT-RUN step=initialize ioctl=0 errno=0 rmStatus=0x0" in run, run[-3000:]
        if k.page_size == 16384:
            assert _failures(run) == NV_16K_FAILURE, run[-3000:]
            assert f"PT-RUN step=page_tree ioctl=0 errno=0 rmStatus={NV_ERR_INVALID_STATE}" in run, run[-3000:]
        else:
            assert _failures(run) == [], run[-3000:]
            assert "PT-RUN step=page_tree ioctl=0 errno=0 rmStatus=0x0" in run, run[-3000:]
            assert f"PT-RC tier={t} rc=0" in log
        _say(request, f"[{SHORT[k.kind]}-{built.version}] tier {TOKENS[t]}: "
             + re.search(r"PT-RUN step=page_tree .*", run).group(0)
             + " " + re.search(rf"PT-RC tier={t} .*", log).group(0))
        assert f"UVM-UNLOAD tier={t} rc=0" in log


@pytest.mark.kernel
@pytest.mark.slow
def test_gpu_free_builtin_tests_pass(vm, request):
    """NVIDIA's built-in tests that need no GPU (pt_run's gpu_free list) return NV_OK with the hooked module in
    every tier: a regression of ours in code they share (locks, allocators, trees, uvm_mem) would show here."""
    k, built, log = vm
    for t in TIERS:
        run = _run_of(log, t, "GF")
        steps = re.findall(r"PT-RUN step=(\w+) ioctl=(-?\d+) errno=(\d+) rmStatus=(0x[0-9a-f]+)", run)
        skipped = re.findall(r"PT-SKIP step=(\w+)", run)
        assert skipped == list(uvmvm.gpu_free_skips(built.tree)), (skipped, "skips other than the tree's own")
        assert [s[0] for s in steps] == ["initialize", *(g for g in GPU_FREE if g not in skipped)], run[-3000:]
        assert all(s[1:] == ("0", "0", "0x0") for s in steps), (t, [s for s in steps if s[1:] != ("0", "0", "0x0")])
        assert _failures(run) == [], run[-3000:]
        assert re.search(rf"GF-RC tier={t} rc=0\b", log), log[-3000:]
    secs = " ".join(re.findall(r"GF-RC tier=\d+ rc=0 secs=(\d+)", log))
    skips = uvmvm.gpu_free_skips(built.tree)
    _say(request, f"[{SHORT[k.kind]}-{built.version}] GPU-free tests NV_OK in every tier ({secs} s): "
         f"{' '.join(g for g in GPU_FREE if g not in skips)}"
         + "".join(f"; {g} not run: {why}" for g, why in skips.items()))


@pytest.mark.kernel
@pytest.mark.slow
def test_counters_prove_tables_were_packed(vm, request):
    """Per tier, what the pool packed during UVM's own tests (cumulative test counters), and the live counters back
    at zero after the run (every packed table freed, every backing page returned)."""
    k, built, log = vm
    for t in TIERS:
        s = _stats(log, t)
        assert s["tier"] == TOKENS[t] and s["test_fake_gpu_build"] == "1", s
        for key in ("trees_packed", "c256_tables", "c4096_tables", "c256_pages", "c4096_pages", "saved_bytes"):
            assert s[key] == "0", (t, key, s)
        trees, t256, t4k = (int(s[f"test_total_{n}"]) for n in ("trees_packed", "c256_tables", "c4096_tables"))
        p256, p4k = int(s["test_total_c256_pages"]), int(s["test_total_c4096_pages"])
        _say(request, f"[{SHORT[k.kind]}-{built.version}] tier {TOKENS[t]}: trees {trees}, 256 B tables/pages "
             f"{t256}/{p256}{f' = {t256 / p256:.2f}' if p256 else ''}, 4 KiB tables/pages {t4k}/{p4k}"
             f"{f' = {t4k / p4k:.2f}' if p4k else ''}")
        # at 4 KiB only the 256 tier saves anything (a 4 KiB slot is a whole page): 4k-all and leaf are inactive
        if t == 0 or (k.page_size == 4096 and t != 2):
            assert trees == t256 == t4k == p256 == p4k == 0, s
            continue
        assert trees > 0 and t256 > 0 and p256 > 0, s        # 64K-page PTE tables (256 B) in every tier
        if t == 3 or k.page_size == 4096:
            assert t4k == p4k == 0, s                          # leaf: 256 B tables only; 4 KiB: no 4 KiB slots
        else:
            assert t4k > 0 and p4k > 0, s                      # 4k-all and 256: directories too
        # slots were shared: fewer backing pages than tables
        assert p256 < t256, s
    # the fake GPUs reached the pool only through the test build's switch
    assert "uvm_pt_pack TEST BUILD (UVM_PT_PACK_TEST_FAKE_GPU): fake GPUs accepted" in log


@pytest.mark.kernel
@pytest.mark.slow
@pytest.mark.parametrize("kind, tier", [("debug-6.12-64k", 3), ("debug-6.12-64k", 1), ("debian-6.12-4k", 2)],
                         ids=["64k-leaf", "64k-4k-all", "4k-256"])
def test_nvidia_tests_catch_a_broken_pool(kind, tier, tmp_path, request):
    """Not vacuous: with the pool built to hand out overlapping slots (UVM_PT_PACK_FAULT_INJECT=1) the run fails the
    checks test_page_tree_passes_in_every_tier applies. At 4 KiB (tier 256, the only one active there) and at
    64 KiB in tier 4k-all (4 KiB tables sharing 64 KiB pages) NVIDIA's own test fails: a PTE of one table
    overwritten through another (`assert_range_vec_ptes ... PTE is 0x404000 instead of 0x204000`, measured at 64 KiB)
    and NV_ERR_INVALID_STATE. At 64 KiB in the default tier (leaf) NVIDIA's test returns NV_OK (measured: its 256 B
    leaf tables aliasing in one 4 KiB slot are never checked against each other), and the run fails on the pool's
    own teardown check instead (a WARNING line: tables left in backing pages)."""
    k = kernel_or_skip(kind)
    nvsrc.nvidia_source(VERSION)
    built = build_or_skip(k, VERSION, inject=1)
    rd = uvmvm.initramfs(built, uvmvm.pt_run(built, tmp_path / "pt_run"), tmp_path / "initrd.gz")
    log = qemu.boot(k, rd, append=f"PT_TIERS={tier} GF_TIERS=", timeout=3600).replace("\r", "")
    (tmp_path / "console.log").write_text(log)
    run = _run_of(log, tier)
    failure = re.search(r"assert_range_vec_ptes\[pid:\d+\] PTE is 0x[0-9a-f]+ instead of 0x[0-9a-f]+", run)
    torn = re.search(r"uvm_pt_pack: page tree torn down with \d+ tables in \d+ backing pages", log)
    _say(request, f"\n[{SHORT[kind]} tier {TOKENS[tier]}, broken pool] NVIDIA's test: "
         + (failure.group(0) if failure else "no PTE failure") + "; "
         + " ".join(re.findall(r"PT-RUN step=page_tree .*", run)) + "; pool: " + (torn.group(0) if torn else "-")
         + f"; {len(qemu.bad_lines(log))} bad console lines")
    if k.page_size == 4096 or tier == 1:
        assert f"PT-RUN step=page_tree ioctl=0 errno=0 rmStatus={NV_ERR_INVALID_STATE}" in run, run[-3000:]
        assert failure, run[-3000:]
    else:
        assert torn and any("WARNING:" in ln for ln in qemu.bad_lines(log)), log[-3000:]


def test_64k_cases_skip_without_the_cached_debug_kernel(tmp_path, monkeypatch):
    """Without CI's switch (SPARK_MEMSAVER_TEST_KERNEL_64K=1) or SPARK_MEMSAVER_BUILD_KERNEL=1 a cold cache builds
    no 64 KiB debug kernel: every 64k case skips with the kernel, why and the command that builds it, not even
    the modules' opt-in builds it; the 7.x one is never CI's. CI's switch lets only the 6.12 kernel and the
    64k-r580 build through (the other branches and the broken pool still skip when not cached)."""
    monkeypatch.setenv("SPARK_MEMSAVER_TEST_CACHE", str(tmp_path))
    monkeypatch.delenv(OPT_IN, raising=False)
    monkeypatch.delenv(CI64_ENV, raising=False)
    monkeypatch.setenv(ALL_ENV, "1")
    with pytest.raises(pytest.skip.Exception) as e:
        kernel_or_skip("debug-6.12-64k")
    msg = str(e.value)
    assert "debug-6.12-64k" in msg and "not cached" in msg and "CI builds only the 6.12 one" in msg, msg
    assert "SPARK_MEMSAVER_BUILD_KERNEL=1 python3 tests/support/debugkernel.py 6.12." in msg, msg
    assert not (tmp_path / "kernel" / "debug-64k-6.12").exists()
    monkeypatch.setenv(CI64_ENV, "1")
    monkeypatch.delenv(ALL_ENV)
    with pytest.raises(pytest.skip.Exception):
        kernel_or_skip("debug-64k")
    k = qemu.Kernel("debug-6.12-64k", tmp_path / "Image", tmp_path, "6.12.0", 65536)
    for version, inject in (("590.48.01", 0), ("580.142", 1), ("595.45.04", 1)):
        with pytest.raises(pytest.skip.Exception):
            build_gate(k, version, inject)
    build_gate(k, "580.142")               # CI's 64 KiB cases: no skip
    build_gate(k, "595.45.04")
    monkeypatch.delenv(CI64_ENV)
    with pytest.raises(pytest.skip.Exception):
        build_gate(k, "580.142")


def test_every_vm_case_is_heavy():
    """The tests that build NVIDIA and boot VMs are `slow` and `kernel` (heavy: they run after the light ones and
    none starts once CI's budget is spent, tests/conftest.py)."""
    for f in (test_page_tree_passes_in_every_tier, test_gpu_free_builtin_tests_pass,
              test_counters_prove_tables_were_packed, test_nvidia_tests_catch_a_broken_pool):
        assert {"slow", "kernel"} <= {m.name for m in f.pytestmark}, f.__name__


def _switch_hits(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and SWITCH_SET.search(p.read_bytes())]


def test_switch_absent_from_the_dkms_build(tmp_path):
    """No rendered DKMS file and no apply-step output (every tier) sets UVM_PT_PACK_TEST_FAKE_GPU; the
    scanner finds it in a tree prepared the way the test build prepares its own (not vacuous)."""
    from spark_memsaver.act import patch, render
    from spark_memsaver.config import Config
    from spark_memsaver.decide import policy
    from spark_memsaver.host import Host

    for tier in policy.TIERS:
        root = tmp_path / f"root-{tier}"
        (root / "usr/src").mkdir(parents=True)
        r = render.render(Host(root), Config(tier=tier), VERSION, f"/usr/src/nvidia-{VERSION}")
        rendered = root / r["path"].lstrip("/")
        assert (rendered / "uvm_patch/src/uvm_pt_pack.c").is_file()
        assert _switch_hits(rendered) == [], tier
    src = nvsrc.nvidia_source(VERSION)
    for value in (None, *policy.TIERS.values()):
        dest = tmp_path / f"apply-{value}"
        patch.apply_patch(src, dest, value, slim=True)
        assert _switch_hits(dest) == [], value
    # the same scan catches the test build's line
    probe = tmp_path / "probe"
    shutil.copytree(tmp_path / "apply-None" / "nvidia-uvm", probe)
    with open(probe / "nvidia-uvm-sources.Kbuild", "a") as fh:
        fh.write(f"CFLAGS_uvm_pt_pack.o += -D{uvmvm.SWITCH}\n")
    assert _switch_hits(probe) == ["nvidia-uvm-sources.Kbuild"]


@pytest.mark.kernel
def test_switch_absent_from_a_module_built_with_the_dkms_flags(tmp_path):
    """The pool built for the VM kernel with the flags the apply step gives it (-DUVM_PT_PACK_DEFAULT=n)
    carries none of the switch's strings; built with the switch, it does (the check is not vacuous).
    Built against test_kernel_qemu.py's Debian 16 KiB tree (cached in CI already): the pool alone compiles on 7.x."""
    k = qemu.kernel("debian-16k")
    found = {}
    for name, flags in (("dkms", "-DUVM_PT_PACK_DEFAULT=3"), ("test", f"-DUVM_PT_PACK_DEFAULT=3 -D{uvmvm.SWITCH}")):
        d = tmp_path / name
        d.mkdir()
        for f in ("uvm_pt_pack.c", "uvm_pt_pack.h"):
            shutil.copy(uvmvm.REPO / "uvm_patch/src" / f, d / f)
        (d / "Kbuild").write_text(f"obj-m := ptpack.o\nptpack-y := uvm_pt_pack.o lic.o\nccflags-y := {flags}\n")
        (d / "lic.c").write_text('#include <linux/module.h>\nMODULE_LICENSE("Dual MIT/GPL");\n')
        qemu._run(["make", "-C", k.tree, f"M={d}", "ARCH=arm64", f"CROSS_COMPILE={qemu.CROSS}", "modules"])
        data = (d / "ptpack.ko").read_bytes()
        found[name] = (uvmvm.SWITCH_MARKER in data, uvmvm.SWITCH.encode() in data)
    assert found == {"dkms": (False, False), "test": (True, True)}


def test_dkms_build_script_drops_compiler_flags_from_the_environment(tmp_path):
    """kbuild adds KCFLAGS/KCPPFLAGS/KAFLAGS from the environment to every compile, so a DKMS environment with
    KCFLAGS=-DUVM_PT_PACK_TEST_FAKE_GPU would switch the test mode on: the rendered build script's prologue
    (everything before its first action) must unset them. Runs the real rendered script's prologue in bash."""
    from spark_memsaver.act import render
    from spark_memsaver.config import Config
    from spark_memsaver.host import Host

    root = tmp_path / "root"
    (root / "usr/src").mkdir(parents=True)
    r = render.render(Host(root), Config(), VERSION, f"/usr/src/nvidia-{VERSION}")
    script = (root / r["path"].lstrip("/") / "spark-memsaver-build").read_text().splitlines()
    first_action = next(i for i, ln in enumerate(script) if ln.startswith("progress "))
    prologue = "\n".join(script[:first_action] + ['env'])
    env = dict(os.environ, KCFLAGS=f"-D{uvmvm.SWITCH}", KCPPFLAGS=f"-D{uvmvm.SWITCH}", KAFLAGS="-Dx")
    out = subprocess.run(["bash", "-c", prologue, "spark-memsaver-build", "6.1.0-0-test"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not [ln for ln in out.stdout.splitlines() if ln.split("=", 1)[0] in ("KCFLAGS", "KCPPFLAGS", "KAFLAGS")]


def test_older_trees_get_a_lockdep_class_per_lock_and_skip_what_needs_a_gpu(tmp_path):
    """r535's static lock initialisers (one lockdep class for every UVM mutex, so lockdep reports NVIDIA's own
    nesting and switches off) are wrapped in the test copy, and its GPU-needing mem test is skipped by name;
    r550's macro form and GPU-free mem test are left alone."""
    old = tmp_path / "r535" / "nvidia-uvm"
    old.mkdir(parents=True)
    (old / "uvm_lock.h").write_text(
        "#ifndef __UVM_LOCK_H__\n#define __UVM_LOCK_H__\n"
        "static void uvm_mutex_init(uvm_mutex_t *mutex, uvm_lock_order_t lock_order)\n{\n    mutex_init(&mutex->m);\n}\n"
        "static void uvm_spin_lock_init(uvm_spinlock_t *spinlock, uvm_lock_order_t lock_order)\n{\n}\n"
        "#endif // __UVM_LOCK_H__\n")
    (old / "uvm_mem_test.c").write_text(f"    if ({uvmvm.MEM_NEEDS_GPU})\n        return NV_OK;\n")
    assert uvmvm.lockdep_classes(old.parent) == ["uvm_mutex_init", "uvm_spin_lock_init"]
    text = (old / "uvm_lock.h").read_text()
    assert "lockdep_set_class(&(lock_)->m, &uvm_test_key_)" in text and "lockdep_set_class(&(lock_)->lock," in text
    assert text.index("#define uvm_mutex_init(") > text.index("static void uvm_mutex_init(")
    assert text.rstrip().endswith("#endif // __UVM_LOCK_H__")
    assert list(uvmvm.gpu_free_skips(old.parent)) == ["mem"]
    new = tmp_path / "r550" / "nvidia-uvm"
    new.mkdir(parents=True)
    (new / "uvm_lock.h").write_text("#define uvm_mutex_init(mutex, order) ({ mutex_init(&(mutex)->m); })\n")
    (new / "uvm_mem_test.c").write_text("    if (g_uvm_global.conf_computing_enabled)\n        return NV_OK;\n")
    assert uvmvm.lockdep_classes(new.parent) == [] and uvmvm.gpu_free_skips(new.parent) == {}
    assert (new / "uvm_lock.h").read_text().count("lockdep_set_class") == 0
