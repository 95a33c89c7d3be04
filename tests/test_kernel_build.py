"""The 6.12 64 KiB debug kernel, first among the heavy tests (CI's share at 64 KiB, issue 41).

NVIDIA's page-tree suite at 64 KiB (tests/test_kernel_pagetree.py, 64k-r580) and the out-of-memory run
(tests/test_kernel_oom.py) need it. In CI (.ci/run sets SPARK_MEMSAVER_TEST_KERNEL_64K=1) this test builds it
on a cold cache (tests/support/debugkernel.py: Debian trixie's linux-source-6.12, allnoconfig +
tests/kernel/debug-64k.config + debug-nvidia.config, `make -j2 Image modules`) and prints how long the build
took, so CI's log records it; it is ``heavy_first`` like the cases that use it, so that CI's budget for starting
heavy tests never starves them. Elsewhere it checks a cached kernel, builds one with
SPARK_MEMSAVER_BUILD_KERNEL=1, or skips with the command that builds it. Measured: docs/kernel-tests.md.
"""

from __future__ import annotations

import time

import pytest

from tests.support import debugkernel
from tests.test_kernel_pagetree import _say, kernel_or_skip


@pytest.mark.kernel
@pytest.mark.slow
@pytest.mark.heavy_first
def test_debug_kernel_64k_is_built_with_every_option(request):
    """The kernel is there (built now where CI's switch or the opt-in asks), 64 KiB pages, every option of the
    config fragments in its .config (fault injection, the memory cgroup and compaction included), an Image and
    Module.symvers to build modules against; the build's time is printed."""
    t0 = time.time()
    k = kernel_or_skip("debug-6.12-64k")
    took = time.time() - t0
    stamp = (debugkernel.cache_path("6.12.") / ".ready").read_text().strip()
    _say(request, f"\n[debug-6.12-64k kernel] {stamp}; {'built (or waited for) here' if took > 60 else 'cached'} "
         f"({took:.0f} s in this test)")
    cfg = (k.tree / ".config").read_text().splitlines()
    assert [o for o in debugkernel.options("6.12.") if o not in cfg] == []
    assert "CONFIG_FAIL_PAGE_ALLOC=y" in cfg and "CONFIG_FAILSLAB=y" in cfg and "CONFIG_MEMCG=y" in cfg
    assert k.page_size == 65536 and k.image.is_file() and (k.tree / "Module.symvers").is_file()
