#!/usr/bin/python3
"""GPU page-table backing memory: stock nvidia-uvm vs. the packing pool, on a model of the seed's node.

The workload is a trace of page-table allocations and frees, generated from a model of a serving node
(one big inference engine, a few auxiliary CUDA processes, short-lived client processes, the kernel
tree of the GPU) whose steady state is calibrated to the measured node of the seed thread:
~52,989 tables of 256 B (64K-page PTE tables) and ~259 tables of 4 KiB (roots, directories, 4K-page
PTE tables) over several processes' trees. Tables are derived from the mapped VA ranges with the
Hopper/Blackwell geometry (a 256 B leaf per 2 MiB of 64K-mapped VA, a 4 KiB PDE0 per 512 MiB, PDE1
per 256 GiB, PDE2 per 128 TiB, one PDE3 and one root per tree), and freed when their last mapping
goes, as uvm_page_tree_put_ptes does.

The trace is replayed through the REAL allocator: uvm_patch/src/uvm_pt_pack.c compiled unchanged
against the userspace shim (tests/harness/libptbench.so, one build per PAGE_SIZE), via ctypes.
The root (depth 0) always takes NVIDIA's path (one whole page). Figures are taken at the end of the
trace (the state the seed measured) and at the trace's peak.

16 KiB kernels (the field's question): the same trace replayed through the pool built with PAGE_SIZE 16 KiB
(libptbench bench-14). Model assumptions, stated: the GPU mappings and therefore the tables are the same as on the
64 KiB node (UVM's CPU chunk sizes are 2M | 64K | PAGE_SIZE on every kernel, uvm_pmm_sysmem.h, so managed memory is
still mapped with 64K GPU pages and 256 B leaf tables); stock NVIDIA backs every table with at least one whole
page (alloc_pages(get_order(size))), i.e. 16 KiB per table; the pool's tiers route as on 64 KiB (a tier is
active when a page holds at least two of its slots). NVIDIA's own page-tree test does not pass on 16 KiB even
with the pool off (check_sizes: docs/kernel-tests.md), so 16 KiB figures are the model's only.

Usage: benchmarks/pagetable_backing.py [--seed N]
Tiers: leaf (the default, module parameter 3: 256 B leaf tables of user trees in 4 KiB slots),
4k-all (1: every non-root table of every tree in 4 KiB slots), 256 (2: 256 B slots).
Last line: default=<ratio> 4k_all=<ratio> tier256=<ratio>  (default = leaf; backing at the end state /
stock 4 KiB kernel)
"""

import argparse
import ctypes
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "harness"

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
TIER_4K_ALL, TIER_256, TIER_LEAF = 1, 2, 3  # module parameter uvm_pt_pack values
SHIFT = {"leaf": 21, 4: 29, 3: 38, 2: 47, 1: 56}  # VA bits covered by one table at each depth


# ----------------------------------------------------------------------------- trace model

class TreeModel:
    """Page tables of one tree (one process on the GPU, or the GPU's kernel tree)."""

    def __init__(self, tid, kind, trace):
        self.tid, self.kind, self.trace = tid, kind, trace
        self.children = {}  # table key -> number of live child tables / mappings
        self.free_va = [(1 << 40, 1 << 40)]  # first-fit VA allocator: (start, length) holes
        self.maps = {}
        trace.append(("tree", tid, kind))
        trace.append(("alloc", tid, ("root",), 0, 4096))

    def _get(self, key, depth, size):
        if key in self.children:
            self.children[key] += 1
            return
        parent = self._parent(key)
        if parent is not None:
            self._get(*parent)
        self.children[key] = 1
        self.trace.append(("alloc", self.tid, key, depth, size))

    def _put(self, key):
        self.children[key] -= 1
        if self.children[key]:
            return
        del self.children[key]
        self.trace.append(("free", self.tid, key))
        parent = self._parent(key)
        if parent is not None:
            self._put(parent[0])

    @staticmethod
    def _parent(key):
        kind = key[0]
        if kind in ("leaf64k", "leaf4k"):
            return (("dir", 4, key[1] >> (SHIFT[4] - SHIFT["leaf"])), 4, 4096)
        if kind == "dir":
            depth, idx = key[1], key[2]
            if depth == 1:
                return None  # PDE3 hangs off the root, which lives as long as the tree
            return (("dir", depth - 1, idx >> (SHIFT[depth - 1] - SHIFT[depth])), depth - 1, 4096)
        return None

    def _va_alloc(self, size, align):
        for i, (start, length) in enumerate(self.free_va):
            va = (start + align - 1) // align * align
            if va + size <= start + length:
                rest = [(start, va - start)] if va > start else []
                if va + size < start + length:
                    rest.append((va + size, start + length - va - size))
                self.free_va[i:i + 1] = rest
                return va
        raise RuntimeError("VA exhausted")

    def _va_free(self, va, size):
        self.free_va.append((va, size))
        self.free_va.sort()
        merged = []
        for start, length in self.free_va:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self.free_va = merged

    def map(self, size, page=64 * KIB, align=2 * MIB):
        va = self._va_alloc(size, align)
        blocks = range(va >> SHIFT["leaf"], ((va + size - 1) >> SHIFT["leaf"]) + 1)
        for b in blocks:
            if page == 64 * KIB:
                self._get(("leaf64k", b), 5, 256)
            else:
                self._get(("leaf4k", b), 5, 4096)
        handle = (va, size, page)
        self.maps[handle] = list(blocks)
        return handle

    def unmap(self, handle):
        kind = "leaf64k" if handle[2] == 64 * KIB else "leaf4k"
        for b in self.maps.pop(handle):
            self._put((kind, b))
        self._va_free(handle[0], handle[1])

    def destroy(self):
        for h in list(self.maps):
            self.unmap(h)
        assert not self.children, self.children
        self.trace.append(("free", self.tid, ("root",)))
        self.trace.append(("untree", self.tid))


def build_trace(seed):
    """A serving node: engine + auxiliary processes + churn, ending in the measured steady state."""
    rnd = random.Random(seed)
    trace = []
    trees = {}
    tid = 0

    def new_tree(kind):
        nonlocal tid
        tid += 1
        trees[tid] = TreeModel(tid, kind, trace)
        return trees[tid]

    kernel = new_tree("kernel")  # the GPU's kernel tree: channels, semaphores, small 4K mappings
    for _ in range(6):
        kernel.map(rnd.choice([64 * KIB, 256 * KIB, 2 * MIB]), page=4 * KIB, align=2 * MIB)
    for _ in range(40):
        kernel.map(rnd.choice([2 * MIB, 4 * MIB, 8 * MIB]))

    def start_process(kind, weights, n_weights, cache, n_cache):
        t = new_tree(kind)
        t.map(2 * MIB, page=4 * KIB)  # CUDA context bookkeeping mapped with 4 KiB pages
        for _ in range(n_weights):
            t.map(max(64 * KIB, int(weights / n_weights * rnd.uniform(0.5, 1.5))) // (64 * KIB) * (64 * KIB))
        bufs = [t.map(int(cache / n_cache)) for _ in range(n_cache)]
        return t, bufs

    # the inference engine: ~30 GiB of weights in 600 tensors, a KV cache of 48 layer blocks
    engine, _ = start_process("engine", 30 * GIB, 600, 60 * GIB, 48)
    # auxiliary model servers (embedding, reranker) and a small CUDA tool
    aux = [start_process("aux", 5 * GIB, 200, 2 * GIB, 4)[0],
           start_process("aux", 2 * GIB, 120, 1 * GIB, 2)[0],
           start_process("aux", 1 * GIB, 60, 512 * MIB, 2)[0],
           start_process("aux", 256 * MIB, 16, 128 * MIB, 1)[0],
           start_process("aux", 128 * MIB, 8, 64 * MIB, 1)[0]]

    # steady-state churn: activation/workspace buffers come and go (VA is reused first-fit, as
    # CUDA's allocators do), short-lived client processes (benchmarks, health checks) start and exit
    live = []
    clients = []  # (tree, exit step)
    for step in range(3000):
        for c, end in [x for x in clients if x[1] == step]:
            c.destroy()
            clients.remove((c, end))
        r = rnd.random()
        if r < 0.48:
            owner = engine if rnd.random() < 0.8 else rnd.choice(aux)
            size = int(rnd.lognormvariate(3.0, 1.6) * MIB) // (64 * KIB) * (64 * KIB) + 64 * KIB
            live.append((owner, owner.map(min(size, 1 * GIB), align=rnd.choice([64 * KIB, 2 * MIB]))))
        elif r < 0.98:
            if live:
                owner, h = live.pop(rnd.randrange(len(live)))
                owner.unmap(h)
        else:
            c, _ = start_process("client", rnd.choice([64, 256, 1024]) * MIB, 4, 0, 0)
            clients.append((c, step + rnd.randint(20, 150)))
    # the measured state: most workspaces released, the clients still attached stay
    for owner, h in live[: len(live) * 3 // 4]:
        owner.unmap(h)
    return trace


# ----------------------------------------------------------------------------- replay

class Lib:
    def __init__(self, shift):
        path = HARNESS / "build" / f"bench-{shift}" / "libptbench.so"
        lib = ctypes.CDLL(str(path))
        lib.ptb_alloc.restype = ctypes.c_long
        lib.ptb_alloc.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint]
        lib.ptb_free.argtypes = [ctypes.c_long]
        lib.ptb_stock_tables.restype = ctypes.c_long
        lib.ptb_backing_pages.restype = ctypes.c_long
        lib.ptb_page_size.restype = ctypes.c_ulong
        self.lib = lib
        self.page = lib.ptb_page_size()

    def stats(self):
        buf = ctypes.create_string_buffer(8192)
        n = self.lib.ptb_stats(buf, len(buf))
        if n <= 0:
            raise RuntimeError("stats getter failed")
        return {k: v for k, v in (ln.split(" ", 1) for ln in buf.value.decode().splitlines())}


def replay(trace, lib, tier, scope, route=None):
    """Replay through the real pool. scope: 'tree' (one pool per tree) or 'gpu' (one shared pool).
    route(tree_kind, depth, size) -> bool: False sends the table down NVIDIA's path (depth 0).
    Returns (end_bytes, peak_bytes, end_stats)."""
    L = lib.lib
    pools, kinds, handles = {}, {}, {}
    shared = L.ptb_pool_new_kind(tier, 1) if scope == "gpu" else None
    peak = 0

    for op in trace:
        if op[0] == "tree":
            kinds[op[1]] = op[2]
            pools[op[1]] = shared if scope == "gpu" else L.ptb_pool_new_kind(tier, int(op[2] != "kernel"))
        elif op[0] == "untree":
            if scope == "tree" and L.ptb_pool_destroy(pools[op[1]]) != 0:
                raise RuntimeError("pool not empty at tree deinit")
            del pools[op[1]]
        elif op[0] == "alloc":
            _, tid, key, depth, size = op
            if route is not None and not route(kinds[tid], depth, size):
                depth = 0
            h = L.ptb_alloc(pools[tid], depth, size)
            if h < 0:
                raise RuntimeError(f"alloc failed: {h}")
            handles[(tid, key)] = h
            cur = (L.ptb_backing_pages() + L.ptb_stock_tables()) * lib.page
            peak = max(peak, cur)
        else:
            _, tid, key = op
            if L.ptb_free(handles.pop((tid, key))) != 0:
                raise RuntimeError("free failed")

    end_stats = lib.stats()
    end = int(end_stats["backing_bytes"]) + L.ptb_stock_tables() * lib.page
    if end_stats["backing_bytes"] != str(L.ptb_backing_pages() * lib.page):
        raise RuntimeError("counters disagree with the backing pages actually held")
    # tear down: everything must go back
    for (tid, key), h in list(handles.items()):
        if L.ptb_free(h) != 0:
            raise RuntimeError("free failed")
    for tid in list(pools):
        if scope == "tree" and L.ptb_pool_destroy(pools[tid]) != 0:
            raise RuntimeError("pool not empty at tree deinit")
    if shared is not None and L.ptb_pool_destroy(shared) != 0:
        raise RuntimeError("shared pool not empty")
    if L.ptb_backing_pages() or L.ptb_stock_tables():
        raise RuntimeError("backing pages leaked")
    return end, peak, end_stats


def live_tables(trace):
    """Table counts at the end of the trace and at the peak of table count."""
    live = {}
    peak_n = 0
    trees = set()
    for op in trace:
        if op[0] == "alloc":
            live[(op[1], op[2])] = op[4]
            peak_n = max(peak_n, len(live))
        elif op[0] == "free":
            del live[(op[1], op[2])]
        elif op[0] == "tree":
            trees.add(op[1])
        elif op[0] == "untree":
            trees.discard(op[1])
    return live, peak_n, len(trees)


def gib(b):
    return f"{b / GIB:.4f} GiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    subprocess.run(["make", "-s", "-C", str(HARNESS), "-j2", "bench"], check=True,
                   stdout=subprocess.DEVNULL)
    trace = build_trace(args.seed)
    live, peak_n, ntrees = live_tables(trace)
    n256 = sum(1 for s in live.values() if s == 256)
    n4k = sum(1 for s in live.values() if s == 4096)
    roots = sum(1 for (tid, key) in live if key == ("root",))
    allocs = sum(1 for op in trace if op[0] == "alloc")
    frees = sum(1 for op in trace if op[0] == "free")
    print(f"workload: {len(trace)} events ({allocs} table allocations, {frees} frees), "
          f"{sum(1 for op in trace if op[0] == 'tree')} trees over the run, {ntrees} at the end")
    print(f"end state: {n256} tables of 256 B, {n4k} tables of 4 KiB ({roots} of them roots); "
          f"seed's node: 52,989 and ~259")

    lib16, lib14, lib4 = Lib(16), Lib(14), Lib(12)
    stock4k = (n256 + n4k) * 4 * KIB
    stock64k = (n256 + n4k) * 64 * KIB
    ideal = n256 * 256 + n4k * 4096
    rows = [("stock 4 KiB kernel", stock4k, None), ("stock 64 KiB kernel", stock64k, None)]

    published = lambda kind, depth, size: kind != "kernel" and size == 256  # noqa: E731
    r = {}
    r["published"] = replay(trace, lib16, TIER_4K_ALL, "tree", route=published)
    r["default"] = replay(trace, lib16, TIER_LEAF, "tree")
    r["4k_all"] = replay(trace, lib16, TIER_4K_ALL, "tree")
    r["tier256"] = replay(trace, lib16, 2, "tree")
    r["default_gpu"] = replay(trace, lib16, TIER_4K_ALL, "gpu")
    r["tier256_gpu"] = replay(trace, lib16, 2, "gpu")
    r["tier256_4k"] = replay(trace, lib4, 2, "tree")
    for name, tier in (("leaf", TIER_LEAF), ("4k_all", TIER_4K_ALL), ("tier256", TIER_256)):
        r[f"{name}_16k"] = replay(trace, lib14, tier, "tree")

    rows += [
        ("published design (256 B user leaves in 4 KiB slots), 64 KiB", r["published"][0], r["published"][1]),
        ("our default tier leaf (pool, 256 B user leaves), 64 KiB, per-tree", r["default"][0], r["default"][1]),
        ("our 4k-all tier (4 KiB slots, all trees), 64 KiB, per-tree pools", r["4k_all"][0], r["4k_all"][1]),
        ("our 256 B tier, 64 KiB, per-tree pools", r["tier256"][0], r["tier256"][1]),
        ("ideal (live table bytes)", ideal, None),
    ]
    print()
    print(f"{'configuration':66s} {'backing (end)':>16s} {'ratio':>7s} {'peak':>14s}")
    for name, b, peak in rows:
        ps = gib(peak) if peak is not None else "-"
        print(f"{name:66s} {gib(b):>16s} {b / stock4k:7.3f} {ps:>14s}")
    print()
    print("pool scope (64 KiB kernel):")
    for name, key in [("leaf tier, per-tree pools", "default"), ("4k-all tier, per-tree pools", "4k_all"),
                      ("4k-all tier, one pool per GPU", "default_gpu"),
                      ("256 B tier, per-tree pools", "tier256"), ("256 B tier, one pool per GPU", "tier256_gpu")]:
        print(f"  {name:40s} {gib(r[key][0]):>14s} ratio {r[key][0] / stock4k:.3f}  (peak {gib(r[key][1])})")
    print(f"  roots alone (one whole 64 KiB page per tree, never packed): {gib(roots * 64 * KIB)}")
    print()
    print(f"256 B tier on a 4 KiB kernel, per-tree pools: {gib(r['tier256_4k'][0])} "
          f"ratio {r['tier256_4k'][0] / stock4k:.3f}")
    stock16k = (n256 + n4k) * 16 * KIB
    print()
    print("16 KiB kernel (model: the same tables as on 64 KiB, stock = one 16 KiB page per table):")
    print(f"  {'stock 16 KiB kernel':40s} {gib(stock16k):>14s} ratio {stock16k / stock4k:.3f}  "
          f"(vs stock 64 KiB: {stock16k / stock64k:.3f})")
    for name, key in [("our default tier leaf, per-tree pools", "leaf_16k"),
                      ("our 4k-all tier, per-tree pools", "4k_all_16k"), ("our 256 B tier, per-tree pools", "tier256_16k")]:
        end, peak, _ = r[key]
        print(f"  {name:40s} {gib(end):>14s} ratio {end / stock4k:.3f}  (vs stock 16 KiB: {end / stock16k:.3f}; "
              f"peak {gib(peak)})")
    print(f"16k: stock={stock16k / stock4k:.3f} leaf={r['leaf_16k'][0] / stock4k:.3f} "
          f"4k_all={r['4k_all_16k'][0] / stock4k:.3f} tier256={r['tier256_16k'][0] / stock4k:.3f}")
    s = r["tier256"][2]
    print(f"counters at the end (256 B tier): c256_tables {s['c256_tables']} c256_pages {s['c256_pages']} "
          f"c4096_tables {s['c4096_tables']} c4096_pages {s['c4096_pages']} saved_bytes {s['saved_bytes']}")
    if r["default"][0] != r["published"][0]:
        raise RuntimeError("the leaf tier differs from the published design's routing on this trace")
    print(f"default={r['default'][0] / stock4k:.3f} 4k_all={r['4k_all'][0] / stock4k:.3f} "
          f"tier256={r['tier256'][0] / stock4k:.3f}")


if __name__ == "__main__":
    sys.exit(main())
