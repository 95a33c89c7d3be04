"""host/runner.py's PATH: nothing is ever run from the current directory, and root runs the system's tools.

Before: with PATH unset (`env -i spark-memsaver ...`, as from a cron job or a hook) the runner searched
`":" + SYSTEM_PATH`, whose empty entry is the current directory, so a root run from a user-writable directory
executed that user's `modinfo`, `dpkg-query`, `dkms`, `openssl`... The planted tools here are real scripts that
leave a mark when run; the product runs as root, as these tests do.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from spark_memsaver.host import runner
from tests.support import sparkroot

REPO = Path(__file__).resolve().parent.parent
TOOLS = ("modinfo", "modprobe", "dpkg-deb", "dpkg-query", "apt-cache", "dkms", "openssl", "mokutil", "uname",
         "keyctl", "update-initramfs", "depmod", "lsmod", "sh")


def _plant(d: Path) -> Path:
    mark = d / "RAN"
    for t in TOOLS:
        p = d / t
        p.write_text(f"#!/bin/sh\necho {t} >> {mark}\nexit 0\n")
        p.chmod(0o755)
    return mark


@pytest.mark.parametrize("path", [None, "", ":", ".", "bin", "./bin:", "::/usr/bin"])
def test_pathless_or_relative_path_never_searches_the_current_directory(tmp_path, path):
    cwd = tmp_path / "user-writable"
    (cwd / "bin").mkdir(parents=True)
    mark = _plant(cwd)
    _plant(cwd / "bin")
    env = {"PYTHONPATH": str(REPO / "daemon")} | ({} if path is None else {"PATH": path})
    code = ("from spark_memsaver.host.runner import Runner\n"
            "r = Runner()\n"
            "print(r.which('modinfo'))\n"
            "print(r.run(['modinfo', '--version']).returncode)\n"
            "print(r.run(['sh', '-c', 'echo $PATH']).stdout.strip())\n")
    out = subprocess.run(["env", "-i", *[f"{k}={v}" for k, v in env.items()], "/usr/bin/python3", "-c", code],
                         cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    which, rc, child_path = out.stdout.splitlines()
    assert which.startswith("/") and not which.startswith(str(tmp_path)), which
    assert not mark.exists() and not (cwd / "bin/RAN").exists(), mark.read_text()
    assert all(d.startswith("/") for d in child_path.split(":")), child_path   # the children's PATH too


def test_root_runs_the_system_tool_before_an_absolute_entry_of_the_callers_path(tmp_path):
    """Root whose PATH starts with a user-writable absolute directory (a sudo keeping the caller's PATH, a
    hook's environment): the system's modinfo is found and run, not the planted one; the children's PATH
    starts with the system directories too. Before: the caller's PATH came first."""
    user = tmp_path / "home/user/bin"
    user.mkdir(parents=True)
    mark = _plant(user)
    code = ("from spark_memsaver.host.runner import Runner\n"
            "r = Runner()\n"
            "print(r.which('modinfo'))\n"
            "print(r.run(['modinfo', '--version']).returncode)\n"
            "print(r.run(['sh', '-c', 'echo $PATH']).stdout.strip())\n")
    out = subprocess.run(["env", "-i", f"PYTHONPATH={REPO / 'daemon'}", f"PATH={user}:/usr/bin:/bin", "/usr/bin/python3",
                          "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    which, rc, child_path = out.stdout.splitlines()
    assert which in [f"{d}/modinfo" for d in runner.SYSTEM_PATH.split(":")], which
    assert rc == "0" and not mark.exists(), mark.read_text() if mark.exists() else rc
    system = runner.SYSTEM_PATH.split(":")
    assert child_path.split(":") == system + [str(user)], child_path


def test_status_as_root_from_a_planted_directory(tmp_path):
    """The whole `status` (modinfo, dpkg-query, apt-cache, keyctl, ...) under `env -i`, from a directory
    holding a planted copy of every tool it may run."""
    root = sparkroot.make_spark_root(tmp_path / "r")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    mark = _plant(cwd)
    r = subprocess.run(["env", "-i", f"PYTHONPATH={REPO / 'daemon'}", "/usr/bin/python3", "-m", "spark_memsaver",
                        "--root", str(root), "status", "--json", "--direct"], cwd=cwd, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode in (0, 1), r.stdout[-2000:] + r.stderr[-2000:]
    assert not mark.exists(), f"ran from the current directory: {mark.read_text()}"


def test_search_path_order():
    sp = runner.search_path
    system = runner.SYSTEM_PATH.split(":")
    assert sp("", root=True).split(":") == system
    assert sp("/opt/x:.:bin::/usr/bin", root=True).split(":") == system + ["/opt/x"]
    assert sp("/opt/x:.:bin::/usr/bin", root=False).split(":") == ["/opt/x", "/usr/bin"] + \
        [d for d in system if d != "/usr/bin"]
