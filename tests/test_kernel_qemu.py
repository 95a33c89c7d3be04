"""The packing pool in a real arm64 kernel (qemu-system-aarch64, TCG, virt + SMMUv3, -cpu max).

An out-of-tree selftest module (tests/kernel/selftest/st_main.c) links uvm_patch/src/uvm_pt_pack.c
unchanged and backs the pool's get/put with alloc_pages + dma_map_page on QEMU's pci-testdev, which sits
behind the virt machine's SMMUv3; 4 kthreads hammer alloc/free on 3 trees (tree 0 stands in for UVM's
kernel tree). The VM's init (tests/kernel/init.sh, busybox) loads it once per tier (0..3), prints the
counters, checks that uvm_pt_pack=7 loads with packing off, triggers a kmemleak scan, and powers off.

A run fails on the module's own result line, on any console line of KASAN, KFENCE, lockdep, DMA-API
debug, kmemleak, WARN or BUG, and when the console never reaches the end.

Kernels: the 64 KiB-page debug kernel (KASAN, PROVE_LOCKING, DEBUG_PAGEALLOC, DMA_API_DEBUG, KMEMLEAK;
built from Debian's linux-source-7.x) runs when it is cached or SPARK_MEMSAVER_BUILD_KERNEL=1 (marker
slow); Debian's prebuilt linux-image-arm64 (4 KiB) and -arm64-16k (16 KiB) run in CI. The kthread stress (8
kthreads, every tier, counters back to 0) runs in the 6.12 64 KiB debug kernel when it is cached (slow).
Details and measured times: docs/kernel-tests.md.
"""

from __future__ import annotations

import re

import pytest

from tests.support import needs, qemu

pytestmark = pytest.mark.kernel

TIERS = (0, 1, 2, 3)
RESULT = re.compile(r"PTPACK-SELFTEST tier=(\d) result=(\w+) iommu=(\d) threads=(\d+) ops=(\d+) "
                    r"tables_max=(\d+) gets=(\d+) puts=(\d+) errors=(\d+) page_size=(\d+)")
#: boot options that switch on the debug features Debian's prebuilt kernels carry (docs/kernel-tests.md)
DEBIAN_DEBUG = "slub_debug=FZPU kfence.sample_interval=10 page_poison=1 init_on_free=1"


def _boot(kind, tmp_path, *, threads=4, defines=()):
    try:
        k = qemu.kernel(kind)
    except qemu.Unavailable as e:
        if kind.startswith("debug-"):
            needs.beyond_ci(f"the {kind} debug kernel", str(e))
        raise
    ko = qemu.selftest_module(k, tmp_path / "mod", defines)
    rd = qemu.initramfs({"pt_pack_selftest.ko": ko}, tmp_path / "initrd.gz")
    append = "" if kind.startswith("debug-") else DEBIAN_DEBUG
    log = qemu.boot(k, rd, append=f"{append} SELFTEST_THREADS={threads}".strip(), timeout=1500)
    (tmp_path / "console.log").write_text(log)
    return k, log


def _stats(log, tier):
    block = log.split(f"STATS-BEGIN tier={tier}", 1)[1].split("STATS-END", 1)[0]
    return {ln.split()[0]: ln.split()[1] for ln in block.replace("\r", "").splitlines() if len(ln.split()) == 2}


def _check(k, log, threads=4):
    assert "VM-DONE" in log, "the VM did not finish its script:\n" + log[-3000:]
    bad = qemu.bad_lines(log)
    assert not bad, "kernel reported problems:\n" + "\n".join(bad[:40])
    results = {int(m.group(1)): m for m in RESULT.finditer(log.split("BADPARAM-BEGIN", 1)[0])}
    assert sorted(results) == list(TIERS), log[-3000:]
    for tier, m in results.items():
        assert m.group(2) == "pass" and m.group(9) == "0", m.group(0)
        assert m.group(3) == "1", "the PCI device was not behind the SMMU"
        assert int(m.group(10)) == k.page_size
        assert int(m.group(4)) == threads and int(m.group(5)) == threads * 20000
        gets, puts = int(m.group(7)), int(m.group(8))
        assert gets == puts
        # packing happened wherever a tier saves something at this page size
        saves = tier == 2 or (tier in (1, 3) and k.page_size > 4096)
        assert (gets > 0) == saves, m.group(0)
    # the counters after each run: the tier token and an empty pool
    for tier, token in zip(TIERS, ("off", "4k-all", "256", "leaf")):
        block = log.split(f"STATS-BEGIN tier={tier}", 1)[1].split("STATS-END", 1)[0]
        assert "format 2" in block and f"tier {token}" in block
        assert re.search(r"^saved_bytes 0\s*$", block, re.M) and re.search(r"^trees_packed 0\s*$", block, re.M)
        # live counters back to 0, nothing leaked, no refused free, no whole-page fallback
        st = _stats(log, tier)
        for key in ("c256_tables", "c256_pages", "c4096_tables", "c4096_pages", "backing_bytes", "stock_bytes",
                    "leaked_tables", "leaked_pages", "leaked_bytes", "bad_frees", "whole_page_tables"):
            assert st.get(key) == "0", (tier, key, st)
    # an invalid tier: logged, packing off, the module loaded
    assert "BADPARAM loaded tier off" in log and "uvm_pt_pack=7 is not a tier" in log


@pytest.mark.parametrize("kind", ["debian-4k", "debian-16k"])
def test_pool_selftest_in_debian_kernel(kind, tmp_path):
    k, log = _boot(kind, tmp_path)
    _check(k, log)


@pytest.mark.slow
def test_pool_selftest_in_64k_debug_kernel(tmp_path):
    k, log = _boot("debug-64k", tmp_path)
    _check(k, log)
    _debug_features_on(log)   # the debug features really were on in this kernel


def _debug_features_on(log):
    assert "Lock dependency validator" in log
    assert "kmemleak: Kernel memory leak detector initialized" in log
    assert "DMA-API: debugging enabled by kernel config" in log
    assert "KMEMLEAK-BEGIN\nKMEMLEAK-END" in log.replace("\r", "")


#: the stress run in the 6.12 debug kernel: more kthreads than the VM's 4 vCPUs, so that allocations
#: (no tree lock) and frees (tree lock, page release) of one tree preempt each other
STRESS_THREADS = 8


@pytest.mark.slow
@pytest.mark.ci_share("8 kthreads x 4 tiers under TCG, ~8-11 min of VM: CI builds the 6.12 64 KiB kernel for NVIDIA's "
                      "page-tree case and the out-of-memory run, not for this stress")
def test_pool_stress_in_6_12_64k_debug_kernel(tmp_path):
    """The kthread stress in the 64 KiB 6.12 debug kernel NVIDIA's modules are tested in (KASAN, PROVE_LOCKING,
    DEBUG_ATOMIC_SLEEP, DEBUG_PAGEALLOC, kmemleak, DMA_API_DEBUG), every tier; the pool's object is built with
    UVM_PT_PACK_TEST_FAKE_GPU for its cumulative test_total_* counters (the predicate is unchanged for a tree
    with a PCI device). Result lines and counters: docs/kernel-tests.md."""
    k, log = _boot("debug-6.12-64k", tmp_path, threads=STRESS_THREADS, defines=("UVM_PT_PACK_TEST_FAKE_GPU",))
    assert k.page_size == 65536 and k.release.startswith("6.12.")
    config = set((k.tree / ".config").read_text().splitlines())
    for opt in ("KASAN_GENERIC", "PROVE_LOCKING", "DEBUG_ATOMIC_SLEEP", "DEBUG_PAGEALLOC_ENABLE_DEFAULT",
                "DEBUG_KMEMLEAK", "DMA_API_DEBUG", "ARM64_64K_PAGES"):
        assert f"CONFIG_{opt}=y" in config, opt
    _check(k, log, threads=STRESS_THREADS)
    _debug_features_on(log)
    assert "KernelAddressSanitizer initialized" in log
    for tier, trees in ((1, 3), (2, 3), (3, 2)):      # leaf: the two user trees, not the kernel tree
        st = _stats(log, tier)
        assert int(st["test_total_c256_tables"]) > 0 and int(st["test_total_c256_pages"]) > 0, (tier, st)
        assert int(st["test_total_trees_packed"]) == trees, (tier, st)
    assert int(_stats(log, 3)["test_total_c4096_tables"]) == 0          # leaf packs 256 B tables only
    assert int(_stats(log, 2)["test_total_c4096_tables"]) > 0


@pytest.mark.slow
@pytest.mark.ci_share("8 kthreads x 4 tiers under TCG, ~8-11 min of VM: CI builds the 6.12 64 KiB kernel for NVIDIA's "
                      "page-tree case and the out-of-memory run, not for this stress")
def test_pool_stress_fails_on_a_broken_pool_in_6_12_64k_debug_kernel(tmp_path):
    """Not vacuous: the same run with the pool built to hand out slots without marking them used
    (UVM_PT_PACK_FAULT_INJECT=1: overlapping tables) fails on the selftest's own checks."""
    k, log = _boot("debug-6.12-64k", tmp_path, threads=STRESS_THREADS, defines=("UVM_PT_PACK_FAULT_INJECT=1",))
    assert "VM-DONE" in log, log[-3000:]
    results = {int(m.group(1)): m for m in RESULT.finditer(log.split("BADPARAM-BEGIN", 1)[0])}
    assert results[0].group(2) == "pass", results[0].group(0)
    for tier in (1, 2, 3):
        assert results[tier].group(2) == "fail" and int(results[tier].group(9)) > 0, results[tier].group(0)
    assert "clobbered (overlap)" in log


def test_bad_patterns_catch_a_kasan_report():
    """The console filter is not vacuous: a real KASAN/lockdep/WARN line shape is caught."""
    sample = ("[   12.1] BUG: KASAN: slab-use-after-free in uvm_pt_pack_free+0x44/0x1c0\n"
              "[   12.2] WARNING: CPU: 1 PID: 77 at mm/page_alloc.c:4455\n"
              "[   12.3] DMA-API: pci 0000:00:01.0: device driver frees DMA memory with wrong function\n")
    assert len(qemu.bad_lines(sample)) == 3
    assert qemu.bad_lines("DMA-API: preallocated 65536 debug entries\nrcu: \tRCU lockdep checking is enabled.") == []
