import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "daemon"))
sys.path.insert(0, str(REPO))  # for tests.support

os.environ.setdefault("SPARK_MEMSAVER_TEST_CACHE", "/var/cache/spark-memsaver-tests")

from tests.support import needs  # noqa: E402

PRODUCT_PYTHON = "/usr/bin/python3"
PRODUCT_MODULES = ("click", "yaml", "jinja2")
_WRAPPERS = {"setpriv", "env", "nice", "runuser", "timeout", "unshare", "nsenter"}


def _same_interpreter_venv() -> bool:
    """This interpreter is a venv over the product's /usr/bin/python3 (same binary, its own site-packages)."""
    return (sys.prefix != sys.base_prefix and os.path.exists(PRODUCT_PYTHON)
            and os.path.realpath(sys.executable) == os.path.realpath(PRODUCT_PYTHON))


def product_argv(args, python: str):
    """``args`` with /usr/bin/python3 replaced by ``python`` where it is the program that runs: argv[0], or the
    program a wrapper (setpriv --reuid=..., env X=1, nice -n 5) runs; anything else is returned unchanged."""
    if isinstance(args, (list, tuple)) and args and PRODUCT_PYTHON in args:
        i = list(args).index(PRODUCT_PYTHON)
        if i == 0 or os.path.basename(str(args[0])) in _WRAPPERS:
            return [*args[:i], python, *args[i + 1:]]
    return args


def _redirect_product_python() -> None:
    """Where /usr/bin/python3 lacks the product's modules but this interpreter is a venv of that same binary
    that has them (the lent GPU host), the tests' ``/usr/bin/python3 ...`` subprocesses run on this venv: the
    same CPython, with click/yaml/jinja2 from the venv instead of python3-click/-yaml/-jinja2. Nowhere else
    (CI's /usr/bin/python3 has them: nothing changes there)."""
    if not needs.python_lacks(PRODUCT_PYTHON, *PRODUCT_MODULES) or not _same_interpreter_venv():
        return
    if needs.python_lacks(sys.executable, *PRODUCT_MODULES):
        return
    orig = subprocess.Popen.__init__

    def init(self, args, *a, **kw):
        orig(self, product_argv(args, sys.executable), *a, **kw)

    subprocess.Popen.__init__ = init


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(*tools): skip (fail under SPARK_MEMSAVER_TESTS_STRICT) "
                                       "when a tool is not installed (tests/support/needs.py)")
    config.addinivalue_line("markers", "needs_modules(*modules): skip (fail under SPARK_MEMSAVER_TESTS_STRICT) "
                                       "when a Python module is not importable (tests/support/needs.py)")
    _redirect_product_python()


def pytest_sessionstart(session):
    needs.session_started()


def pytest_collection_modifyitems(config, items):
    """Every light test runs before the first heavy one (builds, containers, VMs): the quick checks of the
    whole product never wait behind a build, and CI's budget for starting heavy tests limits only those.
    Heavy tests marked ``heavy_first`` (the 64 KiB debug kernel's build and CI's cases at 64 KiB) start before
    the other heavy ones, so that budget never starves them. The sort is stable: files and tests keep their
    order within each group."""
    items.sort(key=lambda item: (bool(needs.is_heavy(item)),
                                 item.get_closest_marker("heavy_first") is None))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under ``$SPARK_MEMSAVER_TEST_WATCHDOG_S`` (set by .ci/run) a test that runs past its limit is stopped with
    needs.WatchdogExpired raised where it was (its traceback says where it hung) and fails; the run goes on."""
    limit = needs.watchdog_limit(bool(needs.is_heavy(item)))
    if not limit:
        yield
        return

    def expire(signum, frame):
        raise needs.WatchdogExpired(f"{item.nodeid} ran past {limit:.0f} s ({needs.WATCHDOG_ENV}): stopped")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def pytest_runtest_setup(item):
    needs.ci_share(item)
    heavy = needs.is_heavy(item)
    if heavy:
        spent = needs.slow_budget_spent()
        if spent:
            needs.beyond_ci(f"{'/'.join(heavy)} test", spent)
    for mark in item.iter_markers("needs"):
        needs.require(*mark.args)
    for mark in item.iter_markers("needs_modules"):
        needs.require_modules(*mark.args)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing setup or call whose exception says that this machine lacks a tool, a Python module or a
    Debian archive (confirmed independently, tests/support/needs.py) is reported as skipped with that reason;
    under tools/test (SPARK_MEMSAVER_TESTS_STRICT=1) it stays a failure."""
    outcome = yield
    rep = outcome.get_result()
    if call.when in ("setup", "call") and rep.failed and call.excinfo is not None and not needs.strict():
        why = needs.environment_gap(call.excinfo.value)
        if why:
            path, line, _ = item.location
            rep.outcome = "skipped"
            rep.longrepr = (str(REPO / path), (line or 0) + 1, f"Skipped: this machine lacks it: {why}")
            if hasattr(rep, "wasxfail"):
                del rep.wasxfail
