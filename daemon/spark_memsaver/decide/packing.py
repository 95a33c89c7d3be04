"""Is packing active: the one reader of the fact, for status, metrics, the monitor and D-Bus. Pure."""

from __future__ import annotations

from spark_memsaver.decide.ours import is_ours


def packing_active(uvm: dict | None) -> bool:
    """Our module is loaded, its counters parse, packing is on and at least one GPU qualified
    (``uvm``: the snapshot's / status document's ``uvm``: loaded, patched, packing counters)."""
    uvm = uvm if isinstance(uvm, dict) else {}
    p = uvm.get("packing") or {}
    if not (uvm.get("loaded") and is_ours(uvm)) or not isinstance(p, dict) or not p or "error" in p:
        return False
    if p.get("tier") == "off":
        return False
    return not (p.get("trees_packed", 0) == 0 and p.get("trees_unpacked", 0) > 0)


def running_tier(uvm: dict | None) -> str | None:
    """The tier our LOADED module packs with, as its counters say it (off, 4k-all, 256, leaf; an older module's
    ``4k`` read as ``4k-all``), else None (ours not loaded, counters unreadable): the one reader of the running
    tier, for the status line, Risk and the metrics' tier label -- the configured tier is what the next build
    uses, not what runs."""
    from spark_memsaver.vocabulary import RENAMED
    uvm = uvm if isinstance(uvm, dict) else {}
    p = uvm.get("packing") or {}
    if not (uvm.get("loaded") and is_ours(uvm)) or not isinstance(p, dict) or "error" in p or not p.get("tier"):
        return None
    t = str(p["tier"])
    return RENAMED.get(t, t)


def tier_of(doc: dict) -> str:
    """The tier a status document is about: the running one when ours is loaded, else the configured one."""
    return running_tier(doc.get("uvm")) or str((doc.get("config") or {}).get("tier") or "")
