"""Decide: where the memory goes -- rows that partition MemTotal, free now vs after reclaim, free blocks by size,
pressure, and one verdict for an allocation of a given size. Pure: a reading of observe/memory.read in, the
``memory --json`` document out (schema 1; docs/memory.md explains each field).

The rows come from /proc/meminfo, each counted once (Cached holds Shmem, so page cache is Cached + Buffers -
Shmem; vmalloc'd kernel stacks are in both VmallocUsed and KernelStack, so vmalloc is the difference). What no
meminfo line counts -- the NVIDIA driver's allocations (CUDA memory on GB10), nvidia-uvm's page tables and any
other driver page -- is MemTotal minus the rest; our counters and NVML split it where they are known.
"""

from __future__ import annotations

import re

from spark_memsaver.errors import UsageError

SCHEMA = 1
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
NAMED_BLOCKS = (2 * MIB, 32 * MIB)       # the sizes status, metrics and the verdict speak of
TOLERANCE = 0.01                         # rows sum to MemTotal within 1 %

# (kind, meminfo keys added, keys subtracted, source)
MEMINFO_ROWS = (
    ("free", ("MemFree",), (), "meminfo MemFree"),
    ("page-cache", ("Cached", "Buffers"), ("Shmem",), "meminfo Cached + Buffers - Shmem (file pages)"),
    ("shmem", ("Shmem",), (), "meminfo Shmem (tmpfs, /dev/shm, shared anonymous)"),
    ("anonymous", ("AnonPages",), (), "meminfo AnonPages (process memory; AnonHugePages within it)"),
    ("swap-cache", ("SwapCached",), (), "meminfo SwapCached"),
    ("slab-reclaimable", ("SReclaimable",), (), "meminfo SReclaimable"),
    ("slab-unreclaimable", ("SUnreclaim",), (), "meminfo SUnreclaim"),
    ("kernel-reclaimable-other", ("KReclaimable",), ("SReclaimable",), "meminfo KReclaimable - SReclaimable"),
    ("kernel-stacks", ("KernelStack",), (), "meminfo KernelStack"),
    ("page-tables", ("PageTables", "SecPageTables"), (), "meminfo PageTables + SecPageTables (CPU page tables)"),
    ("percpu", ("Percpu",), (), "meminfo Percpu"),
    ("vmalloc", ("VmallocUsed",), ("KernelStack",),
     "meminfo VmallocUsed - KernelStack (kernel stacks are vmalloc'd and already counted)"),
    ("zswap", ("Zswap",), (), "meminfo Zswap (compressed swap pool)"),
    ("balloon", ("Balloon",), (), "meminfo Balloon (taken by a hypervisor's balloon)"),
    ("unaccepted", ("Unaccepted",), (), "meminfo Unaccepted (not yet accepted from the host)"),
)
PCP_SOURCE = ("zoneinfo pagesets count x page size: free pages kept on per-CPU lists, in no meminfo line (not in "
              "MemFree); large on 64 KiB kernels")
RESIDUAL_SOURCE = ("MemTotal - the rows above: driver allocations no meminfo line counts (CUDA memory on GB10, "
                   "the NVIDIA driver's own), other driver pages")


def _get(mi: dict, key: str) -> int:
    return int(mi.get(key) or 0)


def _hugepages(mi: dict) -> int:
    if "Hugetlb" in mi:
        return _get(mi, "Hugetlb")
    return _get(mi, "HugePages_Total") * _get(mi, "Hugepagesize")


def rows(mi: dict, uvm: dict | None = None, gpu: dict | None = None, pcp_bytes: int | None = None) -> list[dict]:
    """Rows [{kind, bytes, source}] that partition MemTotal: each meminfo figure once, then what is left split
    into the per-CPU free lists (zoneinfo), nvidia-uvm's page tables (our counters), GPU allocations (NVML) and
    the rest."""
    out = []
    for kind, plus, minus, source in MEMINFO_ROWS:
        if not any(k in mi for k in plus):
            continue
        n = max(0, sum(_get(mi, k) for k in plus) - sum(_get(mi, k) for k in minus))
        if n or kind == "free":
            out.append({"kind": kind, "bytes": n, "source": source})
    if _hugepages(mi):
        out.append({"kind": "hugepages", "bytes": _hugepages(mi),
                    "source": "meminfo Hugetlb (HugePages_Total x Hugepagesize on older kernels)"})
    left = max(0, _get(mi, "MemTotal") - sum(r["bytes"] for r in out))
    if isinstance(pcp_bytes, int) and pcp_bytes > 0 and left:
        take = min(pcp_bytes, left)
        out.append({"kind": "per-cpu-free", "bytes": take, "source": PCP_SOURCE
                    + ("" if take == pcp_bytes else f"; {pcp_bytes} counted, capped at what was left")})
        left -= take
    backing = (uvm or {}).get("backing_bytes")
    if isinstance(backing, int) and backing > 0:
        take = min(backing, left)
        out.append({"kind": "uvm-page-tables", "bytes": take,
                    "source": "spark-memsaver's nvidia-uvm counters (uvm_pt_pack_stats backing_bytes)"
                              + ("" if take == backing else f"; {backing} counted, capped at what was left")})
        left -= take
    if (gpu or {}).get("state") == "known":
        held = sum(p["bytes"] for p in gpu.get("processes") or [] if isinstance(p.get("bytes"), int)
                   and p.get("unified", True))          # a discrete GPU's own memory is not in MemTotal
        take = min(held, left)
        if take:
            out.append({"kind": "gpu-allocations", "bytes": take,
                        "source": "NVML compute processes (nvmlDeviceGetComputeRunningProcesses)"
                                  + ("" if take == held else f"; {held} reported, capped at what was left")})
            left -= take
    out.append({"kind": "driver-and-other", "bytes": left, "source": RESIDUAL_SOURCE})
    return out


def blocks_of(blocks: list[dict], size: int) -> int | None:
    """How many free ``size`` blocks there are, larger blocks counted as several (None when no free block can be
    that large on this kernel: its largest order is smaller)."""
    if not blocks or blocks[-1]["size_bytes"] < size:
        return None
    return sum(b["count"] * (b["size_bytes"] // size) for b in blocks if b["size_bytes"] >= size)


def pageblocks(pti: dict | None, page_size: int | None) -> dict | None:
    """Pageblocks by migrate type over every zone (pagetypeinfo): unmovable ones pin free memory in small pieces."""
    if not pti or not page_size:
        return None
    by_type: dict[str, int] = {}
    for z in pti["zones"]:
        for t, n in z["blocks"].items():
            by_type[t] = by_type.get(t, 0) + n
    per = pti.get("pages_per_block")
    return {"pageblock_bytes": per * page_size if per else None, "by_type": by_type,
            "unmovable": by_type.get("Unmovable", 0), "total": sum(by_type.values())}


def pressure(psi: dict | None) -> dict:
    """PSI by resource: {memory: {some: {avg10, avg60, avg300, total}, full: ...} or None, io, cpu}."""
    return {k: v for k, v in (psi or {}).items()}


def gib(n: int | float | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f} GiB"


def verdict(need: int | None, free_now: int | None, after: int | None, blocks: list[dict]) -> dict:
    """fits-now / fits-after-reclaim / does-not-fit for ``need`` bytes, with the reason; without a need, what
    fits at most. The bytes decide; the 2 MiB blocks are a caveat (CUDA maps in large pages where it can)."""
    if free_now is None or after is None:
        return {"need_bytes": need, "fits": "unknown", "text": "cannot tell: /proc/meminfo was not readable",
                "reason": "no /proc/meminfo under this root"}
    b2 = blocks_of(blocks, NAMED_BLOCKS[0])
    in_blocks = None if b2 is None else b2 * NAMED_BLOCKS[0]
    if need is None:
        return {"need_bytes": None, "fits": None,
                "text": f"up to {gib(free_now)} fits now; up to {gib(after)} after reclaim",
                "reason": "MemFree now; MemAvailable after reclaim (page cache and reclaimable slab freed)"}
    n = gib(need)
    if need <= free_now:
        fits, text = "now", f"a {n} allocation fits now"
        reason = f"{gib(free_now)} free now (MemFree)"
        if in_blocks is not None and in_blocks < need:
            reason += (f"; only {gib(in_blocks)} of it lies in free blocks of 2 MiB or more: compaction "
                       "('reclaim --need') may be needed for large pages")
    elif need <= after:
        fits, text = "after-reclaim", f"a {n} allocation fits after reclaim"
        reason = (f"{gib(free_now)} free now (MemFree); {gib(after - free_now)} more can be reclaimed "
                  f"(MemAvailable {gib(after)}): sudo spark-memsaver reclaim --need {need_arg(need)}")
    else:
        fits, text = "no", f"a {n} allocation does not fit"
        reason = f"{gib(need - after)} more than is free after reclaim (MemAvailable {gib(after)})"
    return {"need_bytes": need, "fits": fits, "text": text, "reason": reason}


def need_arg(n: int) -> str:
    """A byte count as the shortest exact --need argument (100G, 512M, 123456)."""
    for unit, size in (("G", GIB), ("M", MIB), ("K", KIB)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'100G', '1.5GiB', '512M', '4096' -> bytes (binary units); anything else is bad usage."""
    m = _SIZE.match(text or "")
    if not m:
        raise UsageError(f"not a size: {text!r}",
                         remedy="Give bytes or a number with K, M, G or T (binary units), e.g. --need 100G.")
    n = float(m.group(1)) * (1 << (10 * " KMGT".index((m.group(2) or " ").upper())))
    if n < 1 or n > 1 << 50:
        raise UsageError(f"size out of range: {text!r}", remedy="Give a size from 1 byte to 1024T, e.g. --need 100G.")
    return int(n)


def installed(mi: dict, blocks: dict | None) -> dict:
    """MemTotal beside the memory the kernel was handed (memory blocks in sysfs), or why it cannot be known."""
    total = _get(mi, "MemTotal")
    if not blocks:
        return {"bytes": None, "source": "cannot be known here: no /sys/devices/system/memory blocks",
                "not_in_memtotal_bytes": None}
    return {"bytes": blocks["bytes"], "not_in_memtotal_bytes": max(0, blocks["bytes"] - total),
            "source": f"/sys/devices/system/memory: {blocks['blocks']} blocks of {blocks['block_size_bytes'] >> 20} MiB"
                      f" ({blocks['online']} online); the difference is kept by firmware and the kernel at boot"}


def model(reading: dict, need: int | None = None) -> dict:
    """The ``memory --json`` document from one reading (observe/memory.read)."""
    mi = reading.get("meminfo") or {}
    ps = reading.get("page_size")
    total = _get(mi, "MemTotal") if mi else None
    pcp = reading.get("pcp_pages")
    the_rows = rows(mi, reading.get("uvm"), reading.get("gpu"),
                    pcp * ps if isinstance(pcp, int) and ps else None) if mi else []
    free_now = mi.get("MemFree") if mi else None
    after = mi.get("MemAvailable") if mi else None
    if after is not None and free_now is not None:
        after = max(after, free_now)
    blocks = reading.get("free_blocks") or []
    uvm = reading.get("uvm")
    return {
        "schema": SCHEMA,
        "page_size": ps,
        "total_bytes": total,
        "rows": the_rows,
        "rows_sum_bytes": sum(r["bytes"] for r in the_rows),
        "installed": installed(mi, reading.get("memory_blocks")) if mi else None,
        "free_now_bytes": free_now,
        "free_after_reclaim_bytes": after,
        "reclaimable_gap_bytes": None if after is None or free_now is None else after - free_now,
        "free_blocks": [{"size_bytes": b["size_bytes"], "count": b["count"]} for b in blocks],
        "free_blocks_of": {str(s): blocks_of(blocks, s) for s in NAMED_BLOCKS},
        "pageblocks": pageblocks(reading.get("pagetypeinfo"), ps),
        "compaction": reading.get("vmstat"),
        "pressure": pressure(reading.get("pressure")),
        "uvm_page_tables": ({"packed_bytes": uvm.get("backing_bytes"), "stock_bytes": uvm.get("stock_bytes"),
                             "saved_bytes": uvm.get("saved_bytes")} if uvm else
                            {"state": "unknown", "reason": "spark-memsaver's nvidia-uvm is not loaded (the stock one counts nothing)"}),
        "gpu": reading.get("gpu") or {"state": "unknown", "reason": "not asked"},
        "verdict": verdict(need, free_now, after, blocks),
        "unreadable": list(reading.get("unreadable") or []),
    }
