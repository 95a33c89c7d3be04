"""Userspace harness of the page-table packing pool (uvm_patch/src/uvm_pt_pack.c).

The pool's C file is compiled UNCHANGED against tests/harness/shim/ (userspace stand-ins for the
few kernel APIs it uses) and driven by tests/harness/pt_harness.c, whose checker keeps its own
model of every table and backing page (alignment, overlap, release of empty pages, zeroing on
reuse, counters text vs. recomputed truth, empty pools at deinit).

Variants: ASan+UBSan unit checks and a random-op driver (10^6 ops per page size), a
multi-threaded stress under TSan, a short libFuzzer run (clang), and five deliberately broken
allocators (-DUVM_PT_PACK_FAULT_INJECT=n) that the checker must reject. `fatal-teardown` covers a tree
torn down after a UVM fatal error (expect_empty false: no WARN, one rate-limited line, pages leaked and moved to
the leaked_* counters). `recycle` replays stale, double and wrong-pool frees with an allocator that hands the
last released page and DMA address back, as the buddy allocator and the IOVA cache do. The full 10^7-op run is
tests/harness/run-fuzz.sh (figures in uvm_patch/README.md).
"""

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import needs

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "harness"
BUILD = HARNESS / "build"
README = REPO / "uvm_patch" / "README.md"
SHIFTS = [12, 14, 16]  # 4 KiB, 16 KiB, 64 KiB pages

pytestmark = pytest.mark.harness


def _make(*targets):
    if shutil.which("gcc") is None or shutil.which("make") is None:
        pytest.fail("gcc and make are required for the harness (apt-get install build-essential)")
    proc = subprocess.run(["make", "-C", str(HARNESS), "-j2", *targets],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"make {' '.join(targets)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


def _run(argv, timeout=600, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, env=e)


@pytest.fixture(scope="module")
def asan():
    _make("asan", "build/asan-16-def2/pt_harness")


@pytest.fixture(scope="module")
def tsan():
    _make("tsan")


@pytest.fixture(scope="module")
def faults():
    _make("faults")


@pytest.fixture(scope="module")
def bench_lib():
    _make("build/bench-16/libptbench.so")
    return BUILD / "bench-16" / "libptbench.so"


def test_pool_passes_kernel_style_warnings():
    """-Wmissing-prototypes, -Wdeclaration-after-statement, -Wvla, ... -Werror, every page size."""
    _make("kwarn")


@pytest.mark.parametrize("version, builds", [((4, 15, 0), False), ((4, 19, 255), False), ((4, 20, 0), False),
                                             ((5, 0, 0), True), ((6, 12, 0), True)])
def test_kernel_floor_is_linux_5_0(version, builds):
    """The pool needs 5.0 (xa_for_each(xa, index, entry)); NVIDIA's branches build from 4.15: below 5.0 the
    build stops on the pool's own #error, which says why, instead of a missing header or a macro mismatch."""
    if shutil.which("gcc") is None:
        pytest.fail("gcc is required for the harness (apt-get install build-essential)")
    code = (version[0] << 16) + (version[1] << 8) + version[2]
    proc = _run(["gcc", "-std=gnu11", "-fsyntax-only", f"-I{HARNESS / 'shim'}", "-DUVM_PT_PACK_UVM_LOCKS",
                 "-DSHIM_PAGE_SHIFT=16", f"-DLINUX_VERSION_CODE={code}", REPO / "uvm_patch/src/uvm_pt_pack.c"],
                timeout=120)
    assert (proc.returncode == 0) == builds, proc.stderr[-2000:]
    if not builds:
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
        assert errors and "uvm_pt_pack needs Linux 5.0 or newer" in errors[0], proc.stderr[-2000:]


@pytest.mark.parametrize("shift", SHIFTS)
def test_unit_checks_under_asan_ubsan(asan, shift):
    exe = BUILD / f"asan-{shift}" / "pt_harness"
    proc = _run([exe, "unit"])
    assert proc.returncode == 0, proc.stderr
    assert f"unit: page_size={1 << shift} ok" in proc.stdout
    proc = _run([exe, "deinit-warn"])
    assert proc.returncode == 0 and "deinit-warn: ok" in proc.stdout, proc.stderr
    assert "WARNING" not in proc.stderr  # quiet mode: the expected warning is counted, not printed
    proc = _run([exe, "fatal-teardown"])
    assert proc.returncode == 0 and "fatal-teardown: ok" in proc.stdout, proc.stderr


@pytest.mark.parametrize("shift", SHIFTS)
def test_bad_frees_with_recycled_pages(asan, shift):
    """Recycle mode: put() keeps the page and get() hands it back with the same DMA address (the buddy allocator's
    and the IOVA cache's LIFO reuse). Double free after release, stale free into the recycled page (same pool,
    another pool, a reused slot), wrong-pool free and an untagged free of a pool page: each WARNs exactly once,
    never reaches NVIDIA's __free_pages (the pool returns true), nothing is put, live tables stay intact."""
    proc = _run([BUILD / f"asan-{shift}" / "pt_harness", "recycle"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"recycle: page_size={1 << shift} bad_frees=7 ok" in proc.stdout


def test_default_tier_comes_from_build_flag(asan):
    """-DUVM_PT_PACK_DEFAULT=2 (what the DKMS template passes) sets the parameter's default."""
    proc = _run([BUILD / "asan-16-def2" / "pt_harness", "unit"])
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("shift", SHIFTS)
def test_random_ops_under_asan_ubsan(asan, shift):
    ops = 1_000_000
    proc = _run([BUILD / f"asan-{shift}" / "pt_harness", "fuzz", ops, 20260 + shift])
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = re.search(r"fuzz: page_size=(\d+) ops=(\d+) runs=\d+ backing_gets=(\d+)", proc.stdout)
    assert m and int(m.group(1)) == 1 << shift and int(m.group(2)) == ops
    assert int(m.group(3)) > 100, "the op mix must churn backing pages"


@pytest.mark.parametrize("shift", SHIFTS)
def test_multithreaded_stress_under_tsan(tsan, shift):
    proc = _run([BUILD / f"tsan-{shift}" / "pt_harness", "stress", 100_000, 7, 4],
                env={"TSAN_OPTIONS": "halt_on_error=1 exitcode=66"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "ThreadSanitizer" not in proc.stderr
    assert re.search(r"stress: .* threads=4 ops=100000 stats_reads=[1-9]", proc.stdout), proc.stdout


# Each broken allocator must be rejected by the checker (exit 3, named failure).
FAULTS = {
    1: ("overlap", "empty page held"),   # slot handed out without being marked used
    2: ("misaligned",),                  # table addresses off by 128 bytes
    3: ("not zeroed",),                  # reused slot not zeroed
    4: ("empty page held",),             # empty backing page kept
    5: ("routing",),                     # leaf tier packs 4 KiB tables / kernel trees (scope leak)
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_checker_catches_injected_fault(faults, fault):
    proc = _run([BUILD / f"fi{fault}-16" / "pt_harness", "fuzz", 100_000, 1])
    assert proc.returncode == 3, f"fault {fault} not detected (rc={proc.returncode})\n{proc.stderr[-2000:]}"
    m = re.search(r"CHECK FAILED: ([a-z ]+):", proc.stderr)
    assert m and m.group(1) in FAULTS[fault], proc.stderr[-2000:]


def test_tsan_stress_catches_missing_pool_lock():
    """Self-check of the stress: the pool with its spinlock compiled out (shim only) must be reported."""
    _make("build/tsan-nolock/pt_harness")
    proc = _run([BUILD / "tsan-nolock" / "pt_harness", "stress", 50_000, 1, 4],
                env={"TSAN_OPTIONS": "halt_on_error=1 exitcode=66"})
    assert proc.returncode != 0, "a pool without its lock passed the stress"
    assert "ThreadSanitizer: data race" in proc.stderr or "CHECK FAILED" in proc.stderr, proc.stderr[-2000:]


def test_libfuzzer_short_run(tmp_path):
    needs.require("clang", remedy="apt-get install clang libclang-rt-dev; tools/deps/harness.txt")
    _make("build/fuzz-16/pt_fuzz")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    proc = _run([BUILD / "fuzz-16" / "pt_fuzz", "-max_total_time=15", "-max_len=4096", "-seed=1", corpus],
                timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = re.search(r"fuzz-ops: page_size=65536 ops=(\d+)", proc.stderr)
    assert m and int(m.group(1)) > 1000, proc.stderr[-2000:]


def _stats_via_lib(lib_path):
    lib = ctypes.CDLL(str(lib_path))
    lib.ptb_alloc.restype = ctypes.c_long
    lib.ptb_alloc.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint]
    lib.ptb_free.argtypes = [ctypes.c_long]
    pool = lib.ptb_pool_new(2)
    handles = [lib.ptb_alloc(pool, 5, 256) for _ in range(300)] + [lib.ptb_alloc(pool, 3, 4096) for _ in range(20)]
    root = lib.ptb_alloc(pool, 0, 4096)
    buf = ctypes.create_string_buffer(8192)
    n = lib.ptb_stats(buf, len(buf))
    text = buf.value.decode()
    assert n == len(text)
    for h in handles + [root]:
        assert lib.ptb_free(h) == 0
    assert lib.ptb_pool_destroy(pool) == 0
    return text


def test_counters_text_matches_documented_format(bench_lib):
    """The stats getter prints exactly the keys, in the order, that the README documents."""
    text = _stats_via_lib(bench_lib)
    lines = text.splitlines()
    got_keys = [ln.split(" ", 1)[0] for ln in lines]
    doc = README.read_text()
    section = doc.split("## Counters interface, format 2", 1)[1].split("\n## ", 1)[0]
    doc_keys = re.findall(r"^\| `([a-z0-9_]+)`", section, flags=re.M)
    assert doc_keys and got_keys == doc_keys
    kv = dict(ln.split(" ", 1) for ln in lines)
    assert kv["format"] == "2" and kv["page_size"] == "65536"
    assert kv["tier"] == "leaf"  # the compiled-in default
    # 300 tables of 256 B at 256 B granularity: 2 pages; 20 of 4 KiB in 4 KiB slots: 2 pages
    assert (kv["c256_tables"], kv["c256_pages"]) == ("300", "2")
    assert (kv["c4096_tables"], kv["c4096_pages"]) == ("20", "2")
    assert int(kv["c256_stock_bytes"]) == 300 * 65536
    assert int(kv["saved_bytes"]) == int(kv["stock_bytes"]) - int(kv["backing_bytes"]) == (320 - 4) * 65536
