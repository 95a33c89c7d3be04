"""What a test needs from the machine, and what happens when this machine lacks it.

A test that needs a tool this machine does not have (the lent GPU host: Ubuntu 24.04 without kmod, dkms,
systemd-nspawn, dbus-daemon, mokutil, a Debian archive or any network) is SKIPPED there, with the reason. It is
never weakened where the tool exists: the check is the tool's real absence, and under ``tools/test`` (CI), which
installs every ``tools/deps/*.txt`` first, ``SPARK_MEMSAVER_TESTS_STRICT=1`` turns every such skip into a
failure (an absent tool there is a broken deps list, not a reason to pass quietly).

Three ways in:
- ``require("depmod", "modinfo")`` inside a test or fixture, ``@pytest.mark.needs("zstd")`` on a test;
- ``raise Missing(what, remedy)`` from a fixture builder that finds its input absent;
- ``environment_gap(exc)`` (used by tests/conftest.py on every failing setup/call): the exception says that the
  machine lacks something, and the absence is confirmed independently (``shutil.which``, ``find_spec``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import time

import pytest

STRICT_ENV = "SPARK_MEMSAVER_TESTS_STRICT"
# root's PATH has these; a plain user's may not, and kmod's tools live there
_SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")
# exception types of tests/support that mean "this input cannot be produced on this machine"
_UNAVAILABLE = {("tests.support.nvsrc", "SourceUnavailable"), ("tests.support.qemu", "Unavailable"),
                ("tests.support.matrix7", "Unavailable")}


class Missing(RuntimeError):
    """Something a test needs is absent from this machine; ``remedy`` says how to get it."""

    def __init__(self, what: str, remedy: str = ""):
        self.what, self.remedy = what, remedy
        super().__init__(f"{what} is not available here" + (f" ({remedy})" if remedy else ""))


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def which(tool: str) -> str | None:
    path = os.environ.get("PATH", os.defpath)
    return shutil.which(tool, path=os.pathsep.join([path, *_SBIN]))


def missing_tools(*tools: str) -> list[str]:
    return [t for t in tools if which(t) is None]


@functools.lru_cache(maxsize=None)
def python_lacks(interpreter: str, *modules: str) -> tuple[str, ...]:
    """The modules among ``modules`` that ``interpreter`` cannot import (all of them if it does not run)."""
    if not os.access(interpreter, os.X_OK):
        return modules
    code = ("import importlib.util, sys\n"
            "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    r = subprocess.run([interpreter, "-c", code, *modules], capture_output=True, text=True, timeout=60)
    return modules if r.returncode else tuple(r.stdout.split())


def absent(what: str, remedy: str = "") -> None:
    """Skip the running test because ``what`` is absent; fail instead under tools/test (strict)."""
    msg = f"{what} is not available here" + (f" ({remedy})" if remedy else "")
    if strict():
        pytest.fail(f"{msg}; {STRICT_ENV} is set (tools/test installed tools/deps/*.txt), so it must be")
    pytest.skip(msg)


def beyond_ci(what: str, why: str) -> None:
    """Skip, also under tools/test: ``what`` is an input or a run CI does not get by design (a tag outside the
    shared NVIDIA directory, an opt-in build of 20 minutes); ``why`` says how to get or run it."""
    pytest.skip(f"{what}: {why}")


CI_SHARE_ENV = "SPARK_MEMSAVER_TEST_CI_SHARE"


def ci_share(item) -> None:
    """Under ``$SPARK_MEMSAVER_TEST_CI_SHARE=1`` (.ci/run: CI's cold 2-core machine has 90 minutes) a test marked
    ``ci_share(why)`` is skipped with why; plain tools/test runs it."""
    mark = item.get_closest_marker("ci_share")
    if mark is not None and os.environ.get(CI_SHARE_ENV) == "1":
        beyond_ci("beyond CI's share", f"{mark.args[0]} (plain tools/test runs it; {CI_SHARE_ENV}=1 is set by .ci/run)")


def not_applicable(why: str) -> None:
    """Skip, also under tools/test: this machine's nature makes the test meaningless or unsafe here (EFI
    firmware present: no real MOK request may be queued; a kernel without THP); ``why`` says which."""
    pytest.skip(why)


SLOW_BUDGET_ENV = "SPARK_MEMSAVER_TEST_SLOW_BUDGET_S"
# epoch seconds at which the CI job started (.ci/run sets it before installing packages): the budget counts from
# there, not from pytest's start, so the package install is inside it
T0_ENV = "SPARK_MEMSAVER_TEST_T0"
# "LIGHT,HEAVY" seconds: a test that runs longer is stopped and fails (tests/conftest.py), so a hang becomes a
# named failure with its traceback instead of a CI job killed with nothing to read
WATCHDOG_ENV = "SPARK_MEMSAVER_TEST_WATCHDOG_S"
# the markers of tests that take minutes (builds, containers, VMs): none starts once the budget is spent
HEAVY_MARKS = ("slow", "kernel", "compile", "dkms", "package")
_STARTED = time.monotonic()


class WatchdogExpired(Exception):
    """A test ran past its limit under ``$SPARK_MEMSAVER_TEST_WATCHDOG_S`` and was stopped."""


def _seconds(env: str, raw: str) -> float:
    try:
        v = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{env}={raw!r} is not a number of seconds") from None
    if v != v or v < 0:
        raise pytest.UsageError(f"{env}={raw!r} is not a number of seconds")
    return v


def session_started(now_wall: float | None = None) -> None:
    """The run's clock starts now (tests/conftest.py calls it at session start), or at ``$SPARK_MEMSAVER_TEST_T0``
    (epoch seconds) when that is set and not in the future."""
    global _STARTED
    _STARTED = time.monotonic()
    raw = os.environ.get(T0_ENV, "").strip()
    if raw:
        behind = (time.time() if now_wall is None else now_wall) - _seconds(T0_ENV, raw)
        _STARTED -= max(0.0, behind)


def slow_budget_spent(now: float | None = None) -> str | None:
    """Why a heavy test (``HEAVY_MARKS``) must not start: ``$SPARK_MEMSAVER_TEST_SLOW_BUDGET_S`` (set by .ci/run: CI has a
    wall-clock limit the whole run must stay under) seconds have passed since the run started. None when
    no budget is set or it is not spent. A bad value is a usage error, not "no budget"."""
    raw = os.environ.get(SLOW_BUDGET_ENV, "").strip()
    if not raw:
        return None
    budget = _seconds(SLOW_BUDGET_ENV, raw)
    spent = (time.monotonic() if now is None else now) - _STARTED
    if spent < budget:
        return None
    return (f"not started: {spent:.0f} s of this run have passed and {SLOW_BUDGET_ENV}={budget:.0f} s is the "
            f"budget for starting heavy tests (CI's wall-clock limit); run it alone with tools/test")


def watchdog_limit(heavy: bool) -> float | None:
    """Seconds a test may run under ``$SPARK_MEMSAVER_TEST_WATCHDOG_S`` ("LIGHT,HEAVY"); None when unset."""
    raw = os.environ.get(WATCHDOG_ENV, "").strip()
    if not raw:
        return None
    parts = raw.split(",")
    if len(parts) != 2:
        raise pytest.UsageError(f"{WATCHDOG_ENV}={raw!r}: expected LIGHT,HEAVY seconds, e.g. 600,1500")
    light, hv = (_seconds(WATCHDOG_ENV, x.strip()) for x in parts)
    return (hv if heavy else light) or None


def is_heavy(item) -> list[str]:
    """The heavy markers (``HEAVY_MARKS``) a collected test carries, sorted."""
    return sorted(m for m in HEAVY_MARKS if item.get_closest_marker(m) is not None)


def root(why: str) -> None:
    """The test needs root (CI runs as root: there, not being root is a failure)."""
    if os.geteuid() != 0:
        absent("root", why)


def containers() -> None:
    """systemd-nspawn containers (tests/support/nspawn.py): root, systemd-nspawn, debootstrap and nsenter."""
    root("systemd-nspawn containers need root")
    require("systemd-nspawn", "debootstrap", "nsenter",
            remedy="apt-get install systemd-container debootstrap util-linux; tools/deps/package.txt")


def opt_in(env: str, why: str):
    """A mark: the test runs only where ``$env`` is set (a run longer than its CI share; ``why`` says so)."""
    return pytest.mark.skipif(not os.environ.get(env), reason=why if env in why else f"{why}: run it with {env}=1")


def require(*tools: str, remedy: str = "tools/test installs tools/deps/*.txt") -> None:
    gone = missing_tools(*tools)
    if gone:
        absent(", ".join(gone), remedy)


def require_modules(*modules: str, interpreter: str | None = None, remedy: str = "tools/deps/base.txt") -> None:
    if interpreter is None:
        gone = [m for m in modules if importlib.util.find_spec(m) is None]
    else:
        gone = list(python_lacks(interpreter, *modules))
    if gone:
        absent(f"python module(s) {', '.join(gone)}" + (f" in {interpreter}" if interpreter else ""), remedy)


_NOT_INSTALLED = re.compile(r"'([^'/\s]+)' is not installed")
# The programs the product runs (every Host.run argv[0]) and the Debian package of tools/deps/*.txt that gives
# each (tests/test_needs.py checks the lists): only their absence is a machine gap. A product error naming any
# other program (a misspelt name in the code) is a failure, also outside STRICT. The product's own table
# (host/runner.PACKAGES: its errors and status name the package), update-initramfs aside (initramfs-tools is the
# host's choice, never a test dependency).
# Read when first asked (needs.PRODUCT_PROGRAMS): a script that imports this module before the product is on
# its path (benchmarks/) still can.
@functools.cache
def _product_programs() -> dict:
    from spark_memsaver.host.runner import PACKAGES
    return {name: pkg for name, pkg in PACKAGES.items() if name != "update-initramfs"}


def __getattr__(name: str):
    if name == "PRODUCT_PROGRAMS":
        return _product_programs()
    raise AttributeError(name)


def environment_gap(exc: BaseException) -> str | None:
    """Why ``exc`` means this machine lacks what the test needs (checked, not guessed), or None."""
    if isinstance(exc, Missing):
        return str(exc)
    kind = (type(exc).__module__, type(exc).__name__)
    if kind in _UNAVAILABLE:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, FileNotFoundError) and isinstance(exc.filename, str) and "/" not in exc.filename \
            and exc.filename and which(exc.filename) is None:
        return f"{exc.filename} is not installed (tools/deps/*.txt lists it)"
    if type(exc).__name__ == "CommandNotFound" and type(exc).__module__ == "spark_memsaver.errors":
        m = _NOT_INSTALLED.search(str(exc))
        progs = _product_programs()
        if m and m.group(1) in progs and which(m.group(1)) is None:
            return f"{m.group(1)} is not installed (package {progs[m.group(1)]}, tools/deps/*.txt)"
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        if importlib.util.find_spec(top) is None:
            return f"python module {top} is not installed (tools/deps/*.txt lists its Debian package)"
    return None
