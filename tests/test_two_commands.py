"""The README's two commands, in order, on one fresh machine: ``tools/run`` then ``tools/test`` (issue 35 item 4).

A minimal Debian container (debootstrap minbase + systemd + dbus: a node as a minimal install leaves it,
tests/support/nspawn.py ``MINIMAL_PACKAGES``) gets a copy of the checkout. Inside it, ``tools/run`` builds the
package, apt-installs it and shows the status; then ``tools/test tests/test_dkms.py`` installs every test
dependency (tools/deps/*.txt, Debian's linux-headers-amd64 among them) and runs the DKMS tests on that same
machine, with spark-memsaver installed: its modprobe.d install rule for nvidia_uvm, its depmod.d rule, its
daemon, its kernel and APT hooks. The suite must not read that product state (it uses a private module
configuration: ``modprobe -C``); before it did, test_install_selects_the_verified_override failed here because
the installed rule changed what ``modprobe --show-depends`` printed.

What stands in for what: the container shares this machine's kernel (DKMS builds against the headers that
``tools/test`` installs in the container; nothing is loaded) and has no NVIDIA driver, so the package settles
at ``not-applicable``; test_dkms.py installs its own stock NVIDIA 550.163.01 build as it does on any machine.
Nothing of this machine's test cache is shared, except under CI (``SPARK_MEMSAVER_TEST_CI_SHARE=1``, .ci/run):
there the container gets the test inputs this machine's own DKMS tests made before it (tests/support/cache.py's
``nv``, ``stockdriver``, ``debs``, ``apt``, ``dkms-release``: NVIDIA's sources and the stock 550.163.01 build for
the same Debian headers), so CI does not build the stock driver twice; the package, the test dependencies and our
module are still installed and built from nothing inside the container. Elsewhere the container builds all that
a newcomer's machine builds.

bookworm runs by default; trixie when ``SPARK_MEMSAVER_TEST_SUITES=bookworm,trixie`` (tests/support/suites.py).
Each command's time is printed (``-s``); measured figures: docs/distributions.md. The inner run's whole output
goes to ``$SPARK_MEMSAVER_TEST_TWO_COMMANDS_LOG`` (default: the test's tmp_path).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.support import cache, needs, nspawn, suites
from tests.test_repo import checkout_copy, code_version

pytestmark = [pytest.mark.package, pytest.mark.dkms, pytest.mark.slow]

#: the test inputs CI's container shares with this machine (see the module doc)
SHARED_INPUTS = ("nv", "stockdriver", "debs", "apt", "dkms-release", "locks")
RULE = "/lib/modprobe.d/spark-memsaver.conf"
#: the test that read the host's module configuration before (tests/test_dkms.py's modconf fixture)
WITNESS = "test_install_selects_the_verified_override"


def _tail(text: str, n: int = 40) -> str:
    return "\n".join((text or "").strip().splitlines()[-n:])


def shared_inputs() -> list[tuple[str, str]]:
    """Read-write binds of this machine's test inputs at the container's default cache path, under CI only."""
    if os.environ.get(needs.CI_SHARE_ENV) != "1":
        return []
    binds = []
    for name in SHARED_INPUTS:
        d = cache.cache_dir() / name
        d.mkdir(parents=True, exist_ok=True)
        binds.append((str(d), f"/var/cache/spark-memsaver-tests/{name}"))
    return binds


def host_apt_date_checks() -> str:
    """apt's date checks of the Release files as this machine's apt has them (apt-config), for the container's apt:
    both reach the same mirror, so both judge its dates alike. (A mirror that serves the archive as it was on a
    past day, under a clock that is later, has sid's Release file expired: tests/support/nvsrc.py fetches
    NVIDIA 550.163.01 from sid.)"""
    lines = []
    for key in ("Acquire::Check-Valid-Until", "Acquire::Check-Date"):
        r = subprocess.run(["apt-config", "shell", "V", key], capture_output=True, text=True)
        m = re.fullmatch(r"V='([A-Za-z0-9]*)'", r.stdout.strip())
        if m:
            lines.append(f'{key} "{m.group(1)}";')
    return "".join(f"{ln}\n" for ln in lines)


@pytest.mark.parametrize("suite", suites.SUITES)
def test_readme_two_commands_in_order_on_a_fresh_machine(suite, tmp_path):
    suites.suite_param(suite)
    needs.containers()
    src = checkout_copy(tmp_path / "spark-memsaver")
    times = {}
    binds = shared_inputs()
    with nspawn.Container(suite, base=nspawn.MINIMAL_PACKAGES, boot_timeout=120, binds_rw=binds) as c:
        c.copy_in(src, "/root/spark-memsaver")
        c.sh("cat > /etc/apt/apt.conf.d/80host-date-checks", input=host_apt_date_checks())

        t = time.monotonic()
        r = c.run(["tools/run"], check=False, timeout=2400, cwd="/root/spark-memsaver")
        times["tools/run"] = time.monotonic() - t
        print(f"{suite}: tools/run rc={r.returncode} in {times['tools/run']:.0f} s\n{_tail(r.stdout, 12)}")
        assert r.returncode == 0, f"tools/run failed (rc={r.returncode}):\n{_tail(r.stdout)}\n{_tail(r.stderr)}"
        ver = c.run(["dpkg-query", "-W", "-f=${db:Status-Abbrev}|${Version}", "spark-memsaver"]).stdout
        assert ver.replace(" ", "") == f"ii|{code_version()}", ver
        # the product state the suite must not read is really there
        rule = c.read_text(RULE)
        assert re.search(r"(?m)^install nvidia_uvm ", rule), rule

        t = time.monotonic()
        r = c.run(["tools/test", "tests/test_dkms.py", "-v", "-rfEs", "-p", "no:cacheprovider"], check=False,
                  timeout=5400, cwd="/root/spark-memsaver")
        times["tools/test tests/test_dkms.py"] = time.monotonic() - t
        log = os.environ.get("SPARK_MEMSAVER_TEST_TWO_COMMANDS_LOG") or str(tmp_path / "tools-test.log")
        Path(log).write_text(r.stdout + r.stderr)
        summary = _tail(r.stdout, 1)
        print("\n".join(ln for ln in r.stdout.splitlines() if ln.startswith(("FAILED ", "ERROR ", "SKIPPED "))))
        print(f"whole output: {log}")
        print(f"{suite}: tools/test tests/test_dkms.py rc={r.returncode} in "
              f"{times['tools/test tests/test_dkms.py']:.0f} s: {summary}")
        assert r.returncode == 0, f"tools/test failed (rc={r.returncode}):\n{_tail(r.stdout, 80)}\n{_tail(r.stderr)}"
        assert re.search(rf"::{WITNESS} PASSED", r.stdout), _tail(r.stdout, 80)
        assert not re.search(r"\b(failed|errors?|skipped|xfailed|xpassed)\b", summary), summary
        assert c.read_text(RULE) == rule, "the install rule changed while the suite ran"
    print(f"{suite} ({'test inputs shared' if binds else 'cold'}) times: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
