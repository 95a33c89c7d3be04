"""Is the selected (or loaded) nvidia-uvm ours, and is it built for the nvidia.ko beside it: the one predicate of
the planner (decide/plan.py), the APT door (decide/apt.py), status (decide/status.py) and so metrics and D-Bus.
Pure; the facts come from observe/modules.py (kmod's own choice: ``patched`` is "carries our modinfo tag"), in the
typed world (model.ModuleSelection, model.Kernel, model.Uvm). Versions are compared by ``versions.base_version``
(the guard's ``driver_of()``)."""

from __future__ import annotations

from spark_memsaver.versions import base_version


def is_ours(sel) -> bool:
    """The module (a kernel's ``uvm_selected`` or the world's ``uvm``) is our patched nvidia-uvm."""
    return bool(sel is not None and sel.patched)


def built_for(sel) -> str | None:
    """The driver version our module was built for; None when it is not ours or its version is unreadable."""
    return base_version(sel.version) if is_ours(sel) else None


def _nvidia(k) -> str | None:
    return base_version(k.nvidia_selected.version) if k is not None and k.nvidia_selected else None


def selection(k) -> str:
    """A kernel's selection (model.Kernel; None: no kernel): 'stock' (not ours), 'consistent' (ours, built for the
    nvidia.ko beside it) or 'mismatch' (ours beside another driver's nvidia.ko, beside none, or with an unreadable
    version)."""
    sel = k.uvm_selected if k is not None else None
    if not is_ours(sel):
        return "stock"
    nv = _nvidia(k)
    b = built_for(sel)
    return "consistent" if b and nv and b == nv else "mismatch"


def driver_mismatch(k) -> tuple[str, str] | None:
    """(built_for, nvidia.ko's driver) when ours is selected beside another, readable, driver; else None."""
    b = built_for(k.uvm_selected)
    nv = _nvidia(k)
    return (b, nv) if b and nv and b != nv else None


def loaded_mismatch(uvm, loaded_nvidia: str | None) -> tuple[str, str] | None:
    """(built_for, loaded nvidia) when our module (the world's ``uvm``) is loaded beside another loaded driver;
    else None."""
    b = built_for(uvm) if uvm is not None and uvm.loaded else None
    nv = base_version(loaded_nvidia)
    return (b, nv) if b and nv and b != nv else None
