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
