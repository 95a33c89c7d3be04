"""Observe: the parsers of the kernel's memory files (/proc/meminfo, buddyinfo, pagetypeinfo, pressure, vmstat)
and the free blocks by size. No I/O and no other import: observe/snapshot (status's Memory line) and
observe/memory (the ``memory`` command) both read with them."""

from __future__ import annotations

VMSTAT_KEYS = ("compact_stall", "compact_fail", "compact_success", "compact_migrate_scanned",
               "compact_free_scanned", "pgsteal_direct", "pgsteal_kswapd", "allocstall_normal",
               "allocstall_movable")


def parse_meminfo(text: str) -> dict[str, int]:
    """``Key:  N kB`` lines as bytes; unit-less lines (``HugePages_Total``) as counts. Bad lines are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts or not parts[0].isdigit():
            continue
        n = int(parts[0])
        if len(parts) > 1:
            if parts[1] != "kB":
                continue
            n *= 1024
        out[key.strip()] = n
    return out


def parse_buddyinfo(text: str) -> list[dict]:
    """``Node 0, zone   Normal  c0 c1 ...``: one entry per zone, counts of free blocks by order."""
    zones = []
    for line in text.splitlines():
        head, sep, rest = line.partition("zone")
        if not sep or not head.startswith("Node"):
            continue
        fields = rest.split()
        try:
            node = int(head.split()[1].rstrip(","))
            counts = [int(x) for x in fields[1:]]
        except (IndexError, ValueError):
            continue
        if fields and counts:
            zones.append({"node": node, "zone": fields[0], "counts": counts})
    return zones


def parse_pagetypeinfo(text: str) -> dict | None:
    """The pageblock order and the ``Number of blocks type`` table: {order, pages_per_block, zones: [{node,
    zone, blocks: {type: n}}]}; None when the table is not there."""
    order = per_block = None
    header: list[str] | None = None
    zones = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("Page block order:"):
            order = _int(s.split(":", 1)[1])
        elif s.startswith("Pages per block:"):
            per_block = _int(s.split(":", 1)[1])
        elif s.startswith("Number of blocks type"):
            header = s[len("Number of blocks type"):].split()
        elif header is not None and s.startswith("Node") and "zone" in s:
            head, _, rest = s.partition("zone")
            fields = rest.split()
            try:
                node = int(head.split()[1].rstrip(","))
                nums = [int(x) for x in fields[1:]]
            except (IndexError, ValueError):
                continue
            zones.append({"node": node, "zone": fields[0], "blocks": dict(zip(header, nums))})
        elif header is not None and s and not s.startswith("Node"):
            header = None if zones else header
    if header is None and not zones:
        return None
    return {"order": order, "pages_per_block": per_block, "zones": zones}


def _int(s: str) -> int | None:
    s = s.strip()
    return int(s) if s.isdigit() else None


def parse_psi(text: str) -> dict:
    """``some avg10=0.00 avg60=0.00 avg300=0.00 total=0`` (and ``full``): {some: {avg10, ..., total}, full: ...}."""
    out = {}
    for line in text.splitlines():
        kind, *pairs = line.split()
        if kind not in ("some", "full"):
            continue
        vals = {}
        for p in pairs:
            k, _, v = p.partition("=")
            try:
                vals[k] = int(v) if k == "total" else float(v)
            except ValueError:
                continue
        out[kind] = vals
    return out


def parse_vmstat(text: str, keys=VMSTAT_KEYS) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k in keys and v.strip().isdigit():
            out[k] = int(v)
    return out


def parse_zoneinfo_pcp(text: str) -> int | None:
    """Pages on the per-CPU free lists: the ``count:`` lines of zoneinfo's pagesets, every zone and CPU, in base
    pages. Free pages the allocator keeps per CPU; MemFree does not count them (found in a 64 KiB guest: up to 8 %
    of its memory after a file was read; tests/test_kernel_memory.py). None when there is no such line."""
    n, seen = 0, False
    for line in text.splitlines():
        key, _, rest = line.strip().partition(":")
        if key == "count" and rest.strip().isdigit():
            n += int(rest)
            seen = True
    return n if seen else None


def free_blocks(buddyinfo: list[dict] | None, page_size: int | None) -> list[dict]:
    """Free blocks by size over every zone: [{order, size_bytes, count}] (buddyinfo order n is page_size << n)."""
    if not buddyinfo or not page_size:
        return []
    orders = max(len(z["counts"]) for z in buddyinfo)
    counts = [sum(z["counts"][o] for z in buddyinfo if o < len(z["counts"])) for o in range(orders)]
    return [{"order": o, "size_bytes": page_size << o, "count": c} for o, c in enumerate(counts)]
