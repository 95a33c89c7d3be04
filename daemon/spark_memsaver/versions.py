"""The one ``base_version``: the NVIDIA driver version a module's version string names. A leaf (layer 0): the
reader of modules (observe/modules.py), the planner, the APT door, installability, status and metrics all use
this one, and it matches the load-time guard's ``driver_of()`` (systemd/guard/uvm-guard)."""

from __future__ import annotations

import re

DRIVER_RE = re.compile(r"^\d{3}\.\d{1,3}(?:\.\d{1,3})?$")   # an NVIDIA driver version: 580.142, 550.163.01
# Debian policy 5.6.12: [epoch:]upstream[-revision]
DEB_VERSION_RE = re.compile(r"^(?:\d+:)?[0-9][A-Za-z0-9.+~:-]*$")
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


def driver_of_deb(deb_version: str | None) -> str | None:
    """The ONE Debian package version -> NVIDIA driver version: the upstream part (epoch and Debian revision
    cut, then a '+' or '~' suffix) when it is a driver version (``DRIVER_RE``: a three-digit branch), else None.
    '1:555.58.02-1' -> '555.58.02', '580.178.04-0ubuntu0.24.04.1' -> '580.178.04', '55.1-1' -> None (no NVIDIA
    branch has two digits), '6.8.0-1010.10' (a kernel package) -> None. decide/apt.py (the APT door) and
    decide/sources.py (which package carries a driver's source) both ask this one."""
    if not deb_version or not DEB_VERSION_RE.match(deb_version):
        return None
    v = deb_version.split(":", 1)[1] if re.match(r"^\d+:", deb_version) else deb_version
    upstream = v.rsplit("-", 1)[0] if "-" in v else v
    upstream = re.split(r"[+~]", upstream, maxsplit=1)[0]
    return upstream if DRIVER_RE.match(upstream) else None
