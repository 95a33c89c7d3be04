"""The one ``base_version``: the NVIDIA driver version a module's version string names. A leaf (layer 0): the
reader of modules (observe/modules.py), the planner, the APT door, installability, status and metrics all use
this one, and it matches the load-time guard's ``driver_of()`` (systemd/guard/uvm-guard)."""

from __future__ import annotations

import re

DRIVER_RE = re.compile(r"^\d+\.\d+(?:\.\d+)?$")     # an NVIDIA driver version: 580.142, 550.163.01


def base_version(v: str | None) -> str | None:
    """'550.163.01-spark1' -> '550.163.01'; '' or None -> None. Cut at the first '-', '+', '~' or blank."""
    if not v:
        return None
    return re.split(r"[-+~ \t]", v.strip(), maxsplit=1)[0] or None
