"""Is this nvidia-uvm ours: the ONE owner of the fact, for every layer that decides or acts on it.

Two named predicates, side by side (docs/architecture.md, "One owner per fact"):

* :func:`is_ours` -- a packing nvidia-uvm of spark-memsaver of ANY release: our modinfo tag (``spark_memsaver``
  = ``uvm-pt-pack/N``, whatever N) or a ``uvm_pt_pack`` parameter. Such a module is never the stock module:
  nothing records it as stock, nothing keeps it as "the stock file a driver package put back".
* :func:`built_here` -- ours AND built by this package: the exact tag ``uvm-pt-pack/1`` (``PATCH_ID``). What act/
  verifies after an install, what it may delete as its own leftover, what the kotool's verify requires.

Both take a module as any reader gives it: the typed world's ``ModuleSelection`` (a kernel's ``uvm_selected``)
or ``Uvm`` (the loaded module: sysfs shows no tag, only the parameters, so only :func:`is_ours` can be true of
it), or the plain dicts of observe/modules.py (``read_selected``, ``read_file``, ``describe``) and the status
document. The tag and parameters themselves are read by observe/modules.classify (``state``: ours | patched |
stock | ...); this module is where a ``state``/``patched`` field is turned into an answer, and nothing else reads
those fields to decide (tests/test_owners.py).

Also: is ours built for the nvidia.ko beside it -- the one predicate of the planner (decide/plan.py), the APT door
(decide/apt.py), status (decide/status.py) and so metrics and D-Bus; versions compared by
``versions.base_version`` (the guard's ``driver_of()``). Pure."""

from __future__ import annotations

from spark_memsaver.versions import base_version
from spark_memsaver.vocabulary import PATCH_ID  # noqa: F401  (the tag of the module this package builds)
_OURS_STATES = ("ours", "patched")


def _fields(sel) -> tuple[str | None, bool | None]:
    if sel is None:
        return None, None
    if isinstance(sel, dict):
        return sel.get("state"), sel.get("patched")
    return getattr(sel, "state", None), getattr(sel, "patched", None)


def is_ours(sel) -> bool:
    """The module is a packing nvidia-uvm of spark-memsaver (any tag ``uvm-pt-pack/N`` or a ``uvm_pt_pack``
    parameter): never the stock module. None (nothing selected or loaded) is not ours."""
    state, patched = _fields(sel)
    if state is not None:                     # observe/modules' classification: ours | patched | stock | ...
        return state in _OURS_STATES
    return bool(patched)                      # the loaded module (sysfs: a uvm_pt_pack parameter)


def built_here(sel) -> bool:
    """Ours AND built by this package: the exact tag (``PATCH_ID``, observe/modules ``state`` "ours"). A module
    tagged ``uvm-pt-pack/2`` is :func:`is_ours` but not built here."""
    state, _ = _fields(sel)
    return state == "ours"


def is_stock(sel) -> bool:
    """A readable module that is not ours by any tag: what the stock record may name."""
    state, patched = _fields(sel)
    return state == "stock" if state is not None else (sel is not None and patched is False)


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
