"""The one ``base_version``: the NVIDIA driver version a module's version string names. A leaf (layer 0): the
reader of modules (observe/modules.py), the planner, the APT door, installability, status and metrics all use
this one, and it matches the load-time guard's ``driver_of()`` (systemd/guard/uvm-guard)."""

from __future__ import annotations

import re

DRIVER_RE = re.compile(r"^\d+\.\d+(?:\.\d+)?$")     # an NVIDIA driver version: 580.142, 550.163.01
# A kernel release as a name under /lib/modules: never '/', '..' alone, blanks or control characters. The one
# check of every door that takes a kernel (D-Bus service/checks.kernel, every CLI --kernel): a full match.
KERNEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+~-]{0,127}")


def release(v) -> str:
    """``v`` when it is a kernel release name (KERNEL_RE, a full match), else errors.InvalidArgument (exit 2)."""
    if not isinstance(v, str) or not KERNEL_RE.fullmatch(v):
        from spark_memsaver.errors import InvalidArgument
        raise InvalidArgument(f"'kernel' is not a kernel release: {v!r}"[:200],
                              remedy="Give a release as listed under /lib/modules, e.g. 6.14.0-1015-nvidia-64k.")
    return v


def base_version(v: str | None) -> str | None:
    """'550.163.01-spark1' -> '550.163.01'; '' or None -> None. Cut at the first '-', '+', '~' or blank."""
    if not v:
        return None
    return re.split(r"[-+~ \t]", v.strip(), maxsplit=1)[0] or None
