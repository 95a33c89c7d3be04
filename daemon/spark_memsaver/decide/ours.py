"""Is the selected (or loaded) nvidia-uvm ours, and is it built for the nvidia.ko beside it: the one predicate of
the planner (decide/plan.py), the APT door (decide/apt.py), status (decide/status.py) and so metrics and D-Bus.
Pure; the facts come from observe/modules.py (kmod's own choice: ``patched`` is "carries our modinfo tag").
Versions are compared by ``versions.base_version`` (the guard's ``driver_of()``)."""

from __future__ import annotations

from spark_memsaver.versions import base_version


def is_ours(sel: dict | None) -> bool:
    """The module (a snapshot's ``uvm_selected`` or ``uvm``) is our patched nvidia-uvm."""
    return bool((sel or {}).get("patched"))


def built_for(sel: dict | None) -> str | None:
    """The driver version our module was built for; None when it is not ours or its version is unreadable."""
    return base_version((sel or {}).get("version")) if is_ours(sel) else None


def selection(k: dict) -> str:
    """A snapshot kernel's selection: 'stock' (not ours), 'consistent' (ours, built for the nvidia.ko beside it)
    or 'mismatch' (ours beside another driver's nvidia.ko, beside none, or with an unreadable version)."""
    sel = k.get("uvm_selected") or {}
    if not is_ours(sel):
        return "stock"
    nv = base_version((k.get("nvidia_selected") or {}).get("version"))
    b = built_for(sel)
    return "consistent" if b and nv and b == nv else "mismatch"


def driver_mismatch(k: dict) -> tuple[str, str] | None:
    """(built_for, nvidia.ko's driver) when ours is selected beside another, readable, driver; else None."""
    b = built_for(k.get("uvm_selected"))
    nv = base_version((k.get("nvidia_selected") or {}).get("version"))
    return (b, nv) if b and nv and b != nv else None


def loaded_mismatch(uvm: dict | None, loaded_nvidia: str | None) -> tuple[str, str] | None:
    """(built_for, loaded nvidia) when our module is loaded beside another loaded driver; else None."""
    uvm = uvm or {}
    b = built_for(uvm) if uvm.get("loaded") else None
    nv = base_version(loaded_nvidia)
    return (b, nv) if b and nv and b != nv else None
