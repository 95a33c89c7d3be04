"""Report: the readable form of the ``memory`` document (decide/memory.model) and status's one Memory line."""

from __future__ import annotations

from spark_memsaver.decide.memory import GIB, MEMINFO_ROWS, MIB, NAMED_BLOCKS, blocks_of, gib


def _size(n: int) -> str:
    if n >= GIB:
        return f"{n // GIB} GiB" if n % GIB == 0 else gib(n)
    if n >= MIB:
        return f"{n // MIB} MiB"
    return f"{n // 1024} KiB"


def _pct(n: int, total: int) -> str:
    return f"{100 * n / total:5.1f} %" if total else "   ? %"


def _psi(p: dict | None) -> str:
    if not p:
        return "not readable (no /proc/pressure: a kernel without PSI, or under --root without it)"
    some, full = p.get("some") or {}, p.get("full") or {}
    return (f"some {some.get('avg10', 0):.2f} / {some.get('avg60', 0):.2f} / {some.get('avg300', 0):.2f}, "
            f"full {full.get('avg10', 0):.2f} / {full.get('avg60', 0):.2f} / {full.get('avg300', 0):.2f} "
            "(% of time stalled, avg10 / avg60 / avg300)")


def render_text(doc: dict) -> str:
    total = doc.get("total_bytes")
    if not total:
        return ("Memory: cannot tell: /proc/meminfo is not readable under this root ("
                + ", ".join(doc.get("unreadable") or []) + ")")
    ps = doc.get("page_size")
    lines = [f"Memory of this node: {gib(total)} (MemTotal), {ps // 1024 if ps else '?'} KiB pages"]
    inst = doc.get("installed") or {}
    if inst.get("bytes"):
        lines.append(f"  beside it: {gib(inst['bytes'])} in memory blocks, {gib(inst['not_in_memtotal_bytes'])} "
                     f"of it not in MemTotal ({inst['source']})")
    else:
        lines.append(f"  installed memory: {inst.get('source') or 'cannot be known'}")
    lines += ["", f"  {'WHERE':<26} {'GiB':>9} {'SHARE':>7}  SOURCE"]
    for r in doc["rows"]:
        lines.append(f"  {r['kind']:<26} {r['bytes'] / GIB:9.2f} {_pct(r['bytes'], total)}  {r['source']}")
    lines.append(f"  {'(sum)':<26} {doc['rows_sum_bytes'] / GIB:9.2f} {_pct(doc['rows_sum_bytes'], total)}")
    gpu = doc.get("gpu") or {}
    if gpu.get("state") == "known":
        lines += ["", f"GPU allocations by process ({len(gpu.get('processes') or [])}):"]
        for p in gpu.get("processes") or []:
            lines.append(f"  {p['pid']:>7}  {gib(p.get('bytes')):>12}  {p.get('comm') or '?'}  "
                         f"{p.get('unit') or p.get('cgroup') or '-'}"
                         + ("" if p.get("unified", True) else "  (a discrete GPU's own memory: not in MemTotal)"))
    else:
        lines += ["", f"GPU allocations by process: unknown ({gpu.get('reason')})"]
    uvm = doc.get("uvm_page_tables") or {}
    if "packed_bytes" in uvm:
        lines.append(f"nvidia-uvm page tables: {gib(uvm['packed_bytes'])} packed; stock would use "
                     f"{gib(uvm.get('stock_bytes'))} (saved {gib(uvm.get('saved_bytes'))})")
    else:
        lines.append(f"nvidia-uvm page tables: unknown ({uvm.get('reason')})")
    lines += ["",
              f"Free now (what CUDA sees on GB10, MemFree): {gib(doc['free_now_bytes'])}",
              f"Free after reclaim (MemAvailable):          {gib(doc['free_after_reclaim_bytes'])}",
              f"Gap (reclaimable page cache and slab):      {gib(doc['reclaimable_gap_bytes'])}"]
    blocks = [b for b in doc.get("free_blocks") or [] if b["count"]]
    if doc.get("free_blocks"):
        named = ", ".join(f"{_size(int(s))}: {n if n is not None else 'n/a (larger than the largest order)'}"
                          for s, n in (doc.get("free_blocks_of") or {}).items())
        lines += ["", f"Free blocks (counting larger blocks as several): {named}",
                  "  by size: " + (", ".join(f"{_size(b['size_bytes'])} x{b['count']}" for b in blocks) or "none")]
    else:
        lines += ["", "Free blocks: unknown (/proc/buddyinfo not readable)"]
    pb = doc.get("pageblocks")
    if pb:
        lines.append(f"Pageblocks ({_size(pb['pageblock_bytes']) if pb.get('pageblock_bytes') else '?'} each): "
                     f"{pb['unmovable']} unmovable of {pb['total']} ("
                     + ", ".join(f"{k} {v}" for k, v in pb["by_type"].items() if v) + ")")
    else:
        lines.append("Pageblocks: unknown (/proc/pagetypeinfo is readable by root only)")
    lines.append(f"Pressure (memory): {_psi((doc.get('pressure') or {}).get('memory'))}")
    v = doc["verdict"]
    lines += ["", f"Verdict: {v['text']} ({v['reason']})"]
    if doc.get("unreadable"):
        lines.append(f"Not readable: {', '.join(doc['unreadable'])}")
    return "\n".join(lines)


def status_line(mem: dict) -> str | None:
    """status's Memory line: available of total, the gap between MemFree and MemAvailable, the 2 MiB blocks."""
    total, avail = mem.get("total"), mem.get("available")
    if total is None or avail is None:
        return None
    text = f"{gib(avail)} available of {gib(total)}"
    free = mem.get("free")
    if free is not None:
        text += f"; {gib(free)} free now, gap {gib(max(0, avail - free))} reclaimable"
    b2 = blocks_of(mem.get("free_blocks") or [], NAMED_BLOCKS[0])
    if b2 is not None:
        text += f"; {b2} free {_size(NAMED_BLOCKS[0])} blocks"
    return text


# --- Prometheus series (monitoring/README.md): always present, whatever the node ------------------------------

ROW_KINDS = tuple(k for k, *_ in MEMINFO_ROWS) + ("hugepages", "per-cpu-free", "uvm-page-tables",
                                                 "gpu-allocations", "driver-and-other")
PSI_KINDS = ("some", "full")
PSI_WINDOWS = ("avg10", "avg60", "avg300")


def metric_series(mem: dict | None) -> list[tuple[str, str, str, list]]:
    """(name, type, help, [(labels, value)]) for the memory document (decide/memory.model); every row kind and
    pressure series present (0 when not known), free blocks of 2 MiB always (0 when not known) and of each
    larger named size this kernel can hold (none of 32 MiB on x86, whose largest block is 4 MiB)."""
    mem = mem or {}
    rows = {r["kind"]: r["bytes"] for r in mem.get("rows") or []}
    psi = ((mem.get("pressure") or {}).get("memory")) or {}
    of = mem.get("free_blocks_of") or {}
    return [
        ("memory_bytes", "gauge", "Bytes of MemTotal by where they go (rows of 'spark-memsaver memory'; 0 when "
         "not known).", [({"kind": k}, int(rows.get(k, 0))) for k in ROW_KINDS]),
        ("free_after_reclaim_bytes", "gauge", "MemAvailable: what could be free after reclaim.",
         [({}, int(mem.get("free_after_reclaim_bytes") or 0))]),
        ("reclaimable_gap_bytes", "gauge", "MemAvailable - MemFree: memory CUDA does not see free on GB10 until "
         "it is reclaimed.", [({}, int(mem.get("reclaimable_gap_bytes") or 0))]),
        ("free_blocks", "gauge", "Free blocks of this size or larger (a larger block counted as several), by size "
         "in bytes; only sizes this kernel's largest order can hold.",
         [({"size": str(s)}, int(of.get(str(s)) or 0)) for s in NAMED_BLOCKS
          if of.get(str(s)) is not None or s == NAMED_BLOCKS[0]]),
        ("memory_pressure_percent", "gauge", "PSI memory pressure: share of time stalled, by kind and window.",
         [({"kind": k, "window": w}, float((psi.get(k) or {}).get(w) or 0.0)) for k in PSI_KINDS
          for w in PSI_WINDOWS]),
        ("memory_pressure_stall_seconds_total", "counter", "PSI memory stall time since boot, by kind.",
         [({"kind": k}, round(((psi.get(k) or {}).get("total") or 0) / 1e6, 6)) for k in PSI_KINDS]),
    ]
