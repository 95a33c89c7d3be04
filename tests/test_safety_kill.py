"""SIGKILL mid-step on every safety path (issue 35, item 11): tests/FAULTS.md rows wb8.

rollback, remove, the APT door's removal before a driver upgrade and reconcile's removal of a stale override run as
the real CLI (a process) on a Spark-shaped root whose override DKMS installed (tests/support/statespace.py lays out
DKMS's tree; the real dkms acts on it through a wrapper, as tests/test_state_space.py does). At each step the
removal engine takes (act/override.remove_plan: dkms uninstall, dkms unbuild, restore-stock, depmod, then the
dropped registration) a stand-in for that step's program sends SIGKILL to the CLI, before or after running the
real program: the kill lands exactly there, and no branch in shipped code knows about it. Then, as an
administrator would: ``status`` must name the interruption (``operation-interrupted``) with a remedy; that remedy
is run; after it the module kmod selects is stock (ours for the nvidia.ko beside it never comes back half-done),
no intent, temporary file or half-installed DKMS state is left, and status no longer names an interruption.

The stand-in depmod replaces /usr/sbin/depmod in a private mount namespace only (unshare -m, as
tests/test_safety_faults.py hides a tool): nothing on this host changes.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support import needs, sparkroot, statespace
from tests.test_safety_faults import CONFIG, DRV, K, STALE, STATE, _cli, _safe_module, _status

pytestmark = pytest.mark.lifecycle

REPO = Path(__file__).resolve().parent.parent
ARCH = statespace.ARCH
PACKAGE = statespace.PACKAGE

# The stand-in: one program for dkms and depmod. SM_KILL_AT="<tool> <first argument or *> <before|after>": at
# that call it SIGKILLs the CLI (SM_KILL_PID, the process the test started) before or after running the real
# program, and leaves a mark; depmod counts only when the CLI itself runs it (not DKMS's own depmod).
STANDIN = r"""#!/bin/bash
tool=$(basename "$0")
if [ "$tool" = dkms ]; then run() { "$SM_REAL_DKMS" "$@" -a aarch64 --dkmstree "$SM_ROOT/var/lib/dkms" \
    --sourcetree "$SM_ROOT/usr/src" --installtree "$SM_ROOT/lib/modules"; }
else run() { (exec -a depmod "$SM_KMOD" "$@"); }
fi
read -r at_tool at_arg at_when <<< "${SM_KILL_AT:-- - -}"
hit=
if [ "$at_tool" = "$tool" ] && { [ "$at_arg" = '*' ] || [ "$at_arg" = "$1" ]; } && [ ! -e "$SM_MARK" ] \
   && { [ "$tool" = dkms ] || [ "$PPID" = "$SM_KILL_PID" ]; }; then hit=1; fi
if [ -n "$hit" ] && [ "$at_when" = before ]; then echo "$*" > "$SM_MARK"; kill -KILL "$SM_KILL_PID"; exit 1; fi
run "$@"; rc=$?
if [ -n "$hit" ]; then echo "$*" > "$SM_MARK"; kill -KILL "$SM_KILL_PID"; fi
exit $rc
"""

# the kill points: each step of act/override.remove_plan on a node where DKMS installed ours, before and after
# the program of that step ran (dkms's own steps, then restore-stock + depmod, then the dropped registration)
POINTS = {
    "uninstall-before": "dkms uninstall before",
    "uninstall-after": "dkms uninstall after",
    "unbuild-after": "dkms unbuild after",
    "depmod-before": "depmod * before",        # restore-stock done, the selection not yet refreshed
    "depmod-after": "depmod * after",          # stock selected again, the bookkeeping not done
    "dkms-remove-after": "dkms remove after",  # the registration dropped, the intent not cleared
}

PATHS = {
    "rollback": ("current", ["rollback", "--json"], None),
    "remove": ("current", ["remove", "--json"], None),
    "apt-door": ("current", ["reconcile", "--apt-pre-install", "--json"], "apt"),
    "reconcile-stale": ("stale", ["reconcile", "--json"], None),
}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Ours installed by DKMS for 580.142 beside nvidia 580.142, and for 580.95.05 beside 580.142; the .deb of
    the driver upgrade the APT door sees; the stand-in programs."""
    needs.require("depmod", "dkms", "dpkg-deb", "unshare", "mount", "bash")
    base = tmp_path_factory.mktemp("kill")
    out = {}
    for name, ours in (("current", DRV), ("stale", STALE)):
        root = sparkroot.make_spark_root(base / name, ours_installed=ours)
        statespace.add_dkms_build(root, K, ours, installed=True)
        sparkroot.write(root, "/" + CONFIG, "auto_build: false\n")      # recovery never builds on a fixture tree
        out[name] = root
    from tests.test_apt_precision import ARCH as DEB_ARCH, kver, modules_deb, modules_pkg
    deb = modules_deb(base, K, "580.159", rev=2)
    out["apt"] = (f"VERSION 3\nAPT::Architecture={DEB_ARCH}\n\n"
                  f"{modules_pkg(K)} {kver(K)} {DEB_ARCH} none < {kver(K, 2)} {DEB_ARCH} none {deb}\n")
    bin_ = base / "standin"
    bin_.mkdir()
    for tool in ("dkms", "depmod"):
        (bin_ / tool).write_text(STANDIN)
        (bin_ / tool).chmod(0o755)
    out["bin"] = bin_
    return out


def _shadow_depmod(standin: Path, tmp: Path) -> str:
    """Shell lines that put ``standin`` at /usr/sbin/depmod in this mount namespace only (a directory of links to
    the other entries bound over /usr/sbin)."""
    real, shadow = tmp / "sbin-real", tmp / "sbin-shadow"
    real.mkdir()
    shadow.mkdir()
    for e in os.listdir("/usr/sbin"):
        src = f"/usr/sbin/{e}"
        os.symlink(str(standin) if e == "depmod" else os.readlink(src) if os.path.islink(src) else str(real / e),
                   shadow / e)
    return f"mount --bind /usr/sbin {real}; mount --bind {shadow} /usr/sbin"


def _killed(nodes, root: Path, tmp: Path, path: str, point: str) -> Path:
    """The path's command as a process, SIGKILLed at ``point``; returns the mark the stand-in left."""
    _t, argv, stdin = PATHS[path]
    mark = tmp / "killed-at"
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'daemon'}", PYTHONDONTWRITEBYTECODE="1",
               SPARK_MEMSAVER_DKMS=str(nodes["bin"] / "dkms"), SM_REAL_DKMS=shutil.which("dkms"), SM_ROOT=str(root),
               SM_KMOD=os.path.realpath(shutil.which("depmod")), SM_KILL_AT=POINTS[point], SM_MARK=str(mark))
    for k in ("SPARK_MEMSAVER_CONFIG", "APT_HOOK_INFO_FD"):
        env.pop(k, None)
    cmd = " ".join(shlex.quote(a) for a in ["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), *argv])
    script = f"set -e; {_shadow_depmod(nodes['bin'] / 'depmod', tmp)}; export SM_KILL_PID=$$; exec {cmd}"
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], input=nodes[stdin] if stdin
                       else None, capture_output=True, text=True, env=env, timeout=300, cwd="/")
    assert r.returncode == -9 and mark.exists(), (point, r.returncode, r.stdout, r.stderr)
    return mark


def _half_done(root: Path) -> list[str]:
    """What a finished operation never leaves: an intent, a temporary file of ours, DKMS's installed link to a
    build whose module is not the one at our install path."""
    left = [str(p) for p in (root / STATE / "intents").glob("*")] if (root / STATE / "intents").is_dir() else []
    left += [str(p) for p in root.rglob("*spark-memsaver-tmp*")]
    tree = root / "var/lib/dkms" / PACKAGE
    link = tree / f"kernel-{K}-{ARCH}"
    installed = root / f"lib/modules/{K}/updates/dkms/nvidia-uvm.ko"
    if link.is_symlink() != installed.exists():
        left.append(f"DKMS installed link {link.is_symlink()} but our file at updates/dkms {installed.exists()}")
    return left


def _cases():
    """Every path x every kill point; light: each point once and each path at least once (a diagonal), the rest
    marked slow (1-2 s a case)."""
    paths, out = list(PATHS), []
    for i, point in enumerate(POINTS):
        for j, path in enumerate(paths):
            light = j == i % len(paths)
            out.append(pytest.param(path, point, id=f"{path}-{point}", marks=() if light else pytest.mark.slow))
    return out


@pytest.mark.parametrize("path,point", _cases())
def test_sigkill_mid_step_then_status_names_it_and_its_remedy_works(nodes, tmp_path, monkeypatch, path, point):
    root = Path(shutil.copytree(nodes[PATHS[path][0]], tmp_path / "root", symlinks=True))
    assert _safe_module(root, check=False)["patched"]            # ours is selected before
    _killed(nodes, root, tmp_path, path, point)
    # status names the interruption, with a remedy that is a command
    doc = _status(root)
    found = {f["code"]: f for f in doc["findings"]}
    assert "operation-interrupted" in found, (point, sorted(found))
    from spark_memsaver.host import Host
    from spark_memsaver.observe import modules
    if modules.read_selected(Host(root), K)["state"] == "unreadable":    # the index names a file that went
        assert "selection-unreadable" in found and "reconcile" in found["selection-unreadable"]["remedy"], found
    remedy = found["operation-interrupted"]["remedy"]
    cmd = remedy.split("'sudo spark-memsaver ", 1)[1].split("'", 1)[0].split()
    # the remedy, as the administrator runs it (the real dkms on this root's tree, nothing killed now)
    monkeypatch.setenv("SPARK_MEMSAVER_DKMS", str(nodes["bin"] / "dkms"))
    monkeypatch.setenv("SM_REAL_DKMS", shutil.which("dkms"))
    monkeypatch.setenv("SM_ROOT", str(root))
    monkeypatch.delenv("SM_KILL_AT", raising=False)
    monkeypatch.delenv("SPARK_MEMSAVER_CONFIG", raising=False)
    r = CliRunner(mix_stderr=False).invoke(_cli(), ["--root", str(root), *cmd, "--json"])
    assert r.exit_code == 0, (cmd, r.exit_code, r.stdout, r.stderr)
    after = _safe_module(root)
    assert not after["patched"], (point, after)
    assert _half_done(root) == [], _half_done(root)
    doc = _status(root)
    codes = [f["code"] for f in doc["findings"]]
    assert "operation-interrupted" not in codes and not [f for f in doc["findings"] if f["severity"] == "error"], \
        doc["findings"]
    if path in ("remove", "rollback"):       # the administrator's word outlives the kill: automation stays off
        assert "held" in codes, codes
