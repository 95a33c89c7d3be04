"""The Debian releases the container tests (tests/test_package.py, tests/test_lifecycle_e2e.py) run in.

``bookworm`` (Debian 12: Python 3.11, dkms 3.0.10-8) and ``trixie`` (Debian 13: Python 3.13, dkms 3.2.x,
pydbus 0.6.0-6); the host's bookworm kernel headers are bound into both (tests/support/nspawn.py). Ubuntu
noble (dkms 3.0.11, Python 3.12) sits between the two.

The trixie halves are ``slow`` and run only when asked: ``SPARK_MEMSAVER_TEST_SUITES=bookworm,trixie``
(comma list; default ``bookworm``). Measured cold on this project's 2-core machine (a trixie rootfs
debootstrapped, nvidia-uvm compiled per flow) they take longer than CI's budget for them (12 min):
tests/test_package.py's trixie install flow alone took 14.9 min (docs/distributions.md). A suite left out is
skipped with that reason, never silently passed.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.support import needs

ENV = "SPARK_MEMSAVER_TEST_SUITES"
DEFAULT = "bookworm"
SUITES = ["bookworm", pytest.param("trixie", marks=pytest.mark.slow)]


def wanted() -> list[str]:
    v = os.environ.get(ENV, "").strip() or DEFAULT
    return [s.strip() for s in v.split(",") if s.strip()]


def suite_param(suite: str) -> str:
    """``suite`` for a parametrized fixture, or a skip when ``$SPARK_MEMSAVER_TEST_SUITES`` leaves it out."""
    if suite not in wanted():
        needs.beyond_ci(f"{suite} container", f"not in {ENV}={','.join(wanted())} (the {suite} halves are slow: "
                    f"run them with {ENV}=bookworm,{suite}; docs/distributions.md)")
    return suite


def host_suite() -> str:
    """The Debian codename of this machine (/etc/os-release), whose kernel headers the containers get."""
    try:
        for line in open("/etc/os-release"):
            if line.startswith("VERSION_CODENAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return ""


def host_headers_compilers() -> tuple[str, ...]:
    """The compilers the host's kernel headers were built with: Debian's linux-headers-<K> depends on
    linux-compiler-gcc-<N>-<arch> (gcc-<N>) and its Makefile runs x86_64-linux-gnu-gcc-<N>. A container of
    another release builds against those bound headers only with gcc-<N> installed, as that headers package
    would have pulled it in."""
    import subprocess
    r = subprocess.run(["dpkg-query", "-W", "-f=${Depends},", "linux-headers-*"], capture_output=True, text=True)
    return tuple(sorted({f"gcc-{m}" for m in re.findall(r"linux-compiler-gcc-(\d+)-", r.stdout)}))


def extra(suite: str) -> tuple[str, ...]:
    """Packages a ``suite`` container's rootfs needs beyond a real node of that release, given the host's
    kernel headers (cached with the rootfs: tests/support/nspawn.py keys the rootfs by its packages)."""
    return () if suite == host_suite() else host_headers_compilers()

