"""Observe: where this node's memory goes, read from /proc and /sys under the root (``spark-memsaver memory``).

Plain readings, no judgement (decide/memory.py partitions MemTotal, counts blocks and gives the verdict):

- ``/proc/meminfo`` (bytes; ``HugePages_*`` stay counts), ``/proc/buddyinfo`` (free blocks per zone and order),
  ``/proc/zoneinfo`` (pages on the per-CPU free lists, which MemFree leaves out),
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
from spark_memsaver.observe.procmem import (free_blocks, parse_buddyinfo, parse_meminfo, parse_pagetypeinfo,
                                           parse_psi, parse_vmstat, parse_zoneinfo_pcp)

PSI_RESOURCES = ("memory", "io", "cpu")


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


def uvm_counters(host: Host, uvm: dict | None = None) -> dict | None:
    """Our module's page-table figures (packed backing bytes, what stock would use), None when not ours/loaded.
    ``uvm``: observe/snapshot.observe_uvm's reading when the caller has one."""
    if uvm is None:
        from spark_memsaver.observe.snapshot import observe_uvm
        uvm = observe_uvm(host)
    packing = uvm.get("packing")
    if not packing or "error" in packing:
        return None
    return {"backing_bytes": packing.get("backing_bytes"), "stock_bytes": packing.get("stock_bytes"),
            "saved_bytes": packing.get("saved_bytes")}


def read(host: Host, gpu: bool = True, blocks: bool = True, uvm: dict | None = None,
         pagetypes: bool = True) -> dict:
    """One reading of everything ``memory`` shows (plain JSON-able dict). ``gpu`` False skips NVML and
    ``blocks`` False the sysfs memory blocks (the daemon's sample and metrics: no library load, no walk over
    a thousand sysfs directories each interval), ``pagetypes`` False /proc/pagetypeinfo (the kernel walks the free
    lists under the zone lock to print it: not each interval)."""
    unreadable = []

    def text(path):
        t = host.read_text(path)
        if t is None:
            unreadable.append(path)
        return t

    mi = text("/proc/meminfo")
    bi = text("/proc/buddyinfo")
    pti = text("/proc/pagetypeinfo") if pagetypes else None
    vm = text("/proc/vmstat")
    zi = text("/proc/zoneinfo")
    psi = {}
    for res in PSI_RESOURCES:
        t = text(f"/proc/pressure/{res}")
        psi[res] = parse_psi(t) if t is not None else None
    gpu_reading = None
    if gpu:
        from spark_memsaver.observe import gpuprocs
        gpu_reading = gpuprocs.read(host)
    ps = page_size(host)
    buddy = parse_buddyinfo(bi) if bi is not None else None
    return {
        "page_size": ps,
        "meminfo": parse_meminfo(mi) if mi is not None else None,
        "buddyinfo": buddy,
        "free_blocks": free_blocks(buddy, ps),
        "pagetypeinfo": parse_pagetypeinfo(pti) if pti is not None else None,
        "vmstat": parse_vmstat(vm) if vm is not None else None,
        "pcp_pages": parse_zoneinfo_pcp(zi) if zi is not None else None,
        "pressure": psi,
        "memory_blocks": memory_blocks(host) if blocks else None,
        "uvm": uvm_counters(host, uvm),
        "gpu": gpu_reading,
        "unreadable": unreadable,
    }
