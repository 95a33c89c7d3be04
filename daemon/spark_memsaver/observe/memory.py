"""Observe: where this node's memory goes, read from /proc and /sys under the root (``spark-memsaver memory``).

Plain readings, no judgement (decide/memory.py partitions MemTotal, counts blocks and gives the verdict):

- ``/proc/meminfo`` (bytes; ``HugePages_*`` stay counts), ``/proc/buddyinfo`` (free blocks per zone and order),
  ``/proc/pagetypeinfo`` (pageblocks by migrate type; root-only, so ``None`` for a user), ``/proc/pressure/*``
  (PSI), the ``compact_*`` lines of ``/proc/vmstat``;
- ``/sys/devices/system/memory`` (memory blocks: what the kernel was given, beside MemTotal);
- our nvidia-uvm counters (observe/snapshot.observe_uvm: packed page-table bytes and what stock would use);
- GPU allocations per process (observe/gpuprocs.py: NVML through ctypes where it is; "unknown" where not).

Every reading that fails is ``None`` and named in ``unreadable``: a fixture root without /proc reads as such.
"""

from __future__ import annotations

import os

from spark_memsaver.host import Host

PSI_RESOURCES = ("memory", "io", "cpu")
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


def page_size(host: Host) -> int | None:
    """This kernel's page size: the live system's; under a root, from THP's PMD size (observe/snapshot)."""
    if host.is_live:
        return os.sysconf("SC_PAGE_SIZE")
    from spark_memsaver.observe.snapshot import observe_host
    return observe_host(host)["page_size"]


def memory_blocks(host: Host) -> dict | None:
    """/sys/devices/system/memory: the block size and how many blocks there are (online or not): the memory
    the kernel was handed, which MemTotal is less than by what firmware and the kernel kept at boot."""
    size = (host.read_text("/sys/devices/system/memory/block_size_bytes") or "").strip()
    try:
        block = int(size, 16)
    except ValueError:
        return None
    names = [n for n in host.listdir("/sys/devices/system/memory") if n.startswith("memory") and n[6:].isdigit()]
    online = sum(1 for n in names
                 if (host.read_text(f"/sys/devices/system/memory/{n}/state") or "").strip() == "online")
    if not names:
        return None
    return {"block_size_bytes": block, "blocks": len(names), "online": online,
            "bytes": block * len(names)}


def uvm_counters(host: Host) -> dict | None:
    """Our module's page-table figures (packed backing bytes, what stock would use), None when not ours/loaded."""
    from spark_memsaver.observe.snapshot import observe_uvm
    packing = observe_uvm(host).get("packing")
    if not packing or "error" in packing:
        return None
    return {"backing_bytes": packing.get("backing_bytes"), "stock_bytes": packing.get("stock_bytes"),
            "saved_bytes": packing.get("saved_bytes")}


def read(host: Host, gpu: bool = True) -> dict:
    """One reading of everything ``memory`` shows (plain JSON-able dict). ``gpu`` False skips NVML (status
    and the daemon's sample: no library load on that path)."""
    unreadable = []

    def text(path):
        t = host.read_text(path)
        if t is None:
            unreadable.append(path)
        return t

    mi = text("/proc/meminfo")
    bi = text("/proc/buddyinfo")
    pti = text("/proc/pagetypeinfo")
    vm = text("/proc/vmstat")
    psi = {}
    for res in PSI_RESOURCES:
        t = text(f"/proc/pressure/{res}")
        psi[res] = parse_psi(t) if t is not None else None
    gpu_reading = None
    if gpu:
        from spark_memsaver.observe import gpuprocs
        gpu_reading = gpuprocs.read(host)
    return {
        "page_size": page_size(host),
        "meminfo": parse_meminfo(mi) if mi is not None else None,
        "buddyinfo": parse_buddyinfo(bi) if bi is not None else None,
        "pagetypeinfo": parse_pagetypeinfo(pti) if pti is not None else None,
        "vmstat": parse_vmstat(vm) if vm is not None else None,
        "pressure": psi,
        "memory_blocks": memory_blocks(host),
        "uvm": uvm_counters(host),
        "gpu": gpu_reading,
        "unreadable": unreadable,
    }


def read_cheap(host: Host) -> dict:
    """What status's Memory line needs: MemFree, MemAvailable and the free blocks (two small /proc files)."""
    mi = host.read_text("/proc/meminfo")
    bi = host.read_text("/proc/buddyinfo")
    return {"page_size": page_size(host), "meminfo": parse_meminfo(mi) if mi is not None else None,
            "buddyinfo": parse_buddyinfo(bi) if bi is not None else None}
