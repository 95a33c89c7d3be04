"""The way back always works, whatever else is broken (issue 35, item 11): tests/FAULTS.md rows wb1-wb4.

Each safety path -- rollback, remove, the APT door's removal before a driver upgrade, reconcile's removal of a
stale override, status -- on a Spark-shaped root (tests/support/sparkroot.py: real ELF modules, real depmod, real
DKMS) with one broken input: six config shapes and a hostile one (a FIFO), four corrupt-record shapes on each of
four kinds, dkms, modprobe or depmod missing, a read-only or full /var/lib/spark-memsaver. After it, the module kmod
selects is stock or built for the nvidia.ko beside it (status changes nothing), and the fault is named: status's
findings, or for what status cannot see (a read-only state directory) the command's own result.

The config and record rows run the real CLI in-process (click's runner, the same SafeGroup.main); the tool and
read-only rows run it as a process in a private mount namespace (unshare -m), where the tool is really absent
(a bind mount over it) or the directory really read-only (a read-only bind mount): nothing on this host changes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from spark_memsaver.host import Host
from spark_memsaver.observe import modules
from spark_memsaver.versions import base_version
from tests.support import needs, sparkroot

pytestmark = pytest.mark.lifecycle

REPO = Path(__file__).resolve().parent.parent
K = sparkroot.SPARK_KERNEL
DRV, NEW, STALE = sparkroot.DRIVER, "580.159", "580.95.05"
STATE = "var/lib/spark-memsaver"
CONFIG = "etc/spark-memsaver/config.yaml"


def _bomb() -> str:
    """~0.4 KB of nested YAML aliases: 10^9 elements once expanded (a config reader that builds or formats it
    never returns)."""
    levels = ["&a0 [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"]
    levels += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    return "kernels: [" + ", ".join(levels) + "]\n"


def _write(path: Path, data: str | bytes | None, kind: str = "file") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(data if isinstance(data, bytes) else data.encode())


# config shape -> (how the file is made, what the finding must say besides the file)
CONFIGS = {
    "syntax": (lambda p: _write(p, "tier: [oops\n"), "line 2"),
    "wrong-type": (lambda p: _write(p, "interval: fast\n"), "line 1"),
    "unknown-key": (lambda p: _write(p, "tier: leaf\ncolour: blue\n"), "line 2"),
    "alias-bomb": (lambda p: _write(p, _bomb()), "aliases"),
    "oversized": (lambda p: _write(p, "# padding\n" * 8000 + "tier: leaf\n"), "KiB"),
    "unreadable": (lambda p: _write(p, None, "dir"), "not a regular file"),
    "fifo": (lambda p: _write(p, None, "fifo"), "not a regular file"),
}

# corrupt records: four shapes (torn JSON, another JSON type, fields of the wrong type, empty) on each of the four
# kinds the safety paths read (issue 35 item 11: "4 corrupt-record shapes per kind")
KINDS = {
    "hold": (f"{STATE}/holds/{K}.json", '{"by": 7, "kernel": ["no"], "since": {}}'),
    "rollback": (f"{STATE}/rollbacks/{K}.json", '{"kernel": 7, "reason": [], "time": 1}'),
    "intent": (f"{STATE}/intents/remove-{K}.json", '{"op": 7, "kernel": ["no"], "pid": "x"}'),
    "stock-record": (f"{STATE}/dkms/{K}.json", '{"kernel": 7, "stock_path": ["/etc/passwd"], "stock_sha256": 1}'),
}
SHAPES = {"not-json": lambda fields: fields[:12], "wrong-type": lambda fields: "[]",
          "wrong-fields": lambda fields: fields, "empty": lambda fields: ""}
RECORDS = {f"{kind}-{shape}": (rel, make(fields)) for kind, (rel, fields) in KINDS.items()
           for shape, make in SHAPES.items()}


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """Two nodes: ours for 580.142 beside nvidia 580.142 (rollback, remove, the APT door) and ours for 580.95.05
    beside 580.142 (reconcile's stale removal, status); and the .deb of the driver upgrade the door sees."""
    needs.require("depmod", "dkms", "dpkg-deb")
    base = tmp_path_factory.mktemp("safety")
    out = {}
    for name, ours in (("current", DRV), ("stale", STALE)):
        root = sparkroot.make_spark_root(base / name, ours_installed=ours)
        shutil.copy2(shutil.which("dkms"), root / "usr/sbin/dkms")        # a node has DKMS
        out[name] = root
    from tests.test_apt_precision import ARCH, kver, modules_deb, modules_pkg
    deb = modules_deb(base, K, NEW, rev=2)
    out["apt"] = (f"VERSION 3\nAPT::Architecture={ARCH}\n\n"
                  f"{modules_pkg(K)} {kver(K)} {ARCH} none < {kver(K, 2)} {ARCH} none {deb}\n")
    return out


# path -> (template, argv after --root, stdin)
PATHS = {
    "rollback": ("current", ["rollback", "--json"], None),
    "remove": ("current", ["remove", "--json"], None),
    "apt-door": ("current", ["reconcile", "--apt-pre-install", "--json"], "apt"),
    "reconcile-stale": ("stale", ["reconcile", "--json"], None),
    "status": ("stale", ["status", "--json", "--direct"], None),
}


def _node(templates, tmp_path, path: str) -> Path:
    return Path(shutil.copytree(templates[PATHS[path][0]], tmp_path / "root", symlinks=True))


def _safe_module(root: Path, check: bool = True) -> dict:
    """What kmod selects for K: stock, or ours built for the nvidia.ko beside it (the invariant, ``check``)."""
    sel = modules.read_selected(Host(root), K)
    nv = modules.read_selected(Host(root), K, "nvidia")
    assert sel.get("path") and nv.get("version"), (sel, nv)
    if check and sel.get("patched"):
        assert base_version(sel["version"]) == base_version(nv["version"]), (sel, nv)
    return {"patched": bool(sel.get("patched")), "version": sel.get("version"), "path": sel["path"]}


def _status(root: Path) -> dict:
    r = CliRunner(mix_stderr=False).invoke(_cli(), ["--root", str(root), "status", "--json", "--direct"])
    assert r.exit_code in (0, 1), (r.exit_code, r.stdout, r.stderr)
    return json.loads(r.stdout)


def _cli():
    from spark_memsaver.cli.main import cli
    return cli


def _run_in_process(templates, root: Path, path: str, monkeypatch):
    monkeypatch.delenv("SPARK_MEMSAVER_CONFIG", raising=False)
    monkeypatch.delenv("APT_HOOK_INFO_FD", raising=False)
    _t, argv, stdin = PATHS[path]
    r = CliRunner(mix_stderr=False).invoke(_cli(), ["--root", str(root), *argv],
                                           input=templates[stdin] if stdin else None)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exc_info
    assert "Traceback" not in r.stderr and "internal-error" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r


def _acted(root: Path, path: str, before: dict) -> dict:
    """The invariant after the path ran: a safe module; the acting paths left the stock one (ours was
    selected before each of them: current for rollback/remove/door, stale for reconcile)."""
    after = _safe_module(root, check=path != "status")
    if path == "status":
        assert after == before, "status changed the module selection"
    else:
        assert not after["patched"], f"{path}: ours still selected: {after}"
    return after


@pytest.mark.parametrize("shape", sorted(CONFIGS))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_safety_path_with_a_broken_config(templates, tmp_path, monkeypatch, path, shape):
    root = _node(templates, tmp_path, path)
    make, says = CONFIGS[shape]
    make(root / CONFIG)
    before = _safe_module(root, check=False)
    r = _run_in_process(templates, root, path, monkeypatch)
    assert r.exit_code == (1 if path == "status" else 0), (r.exit_code, r.stdout, r.stderr)
    _acted(root, path, before)
    # the door's output and the command's result name the file once; status names it as its one finding
    out = r.stdout + r.stderr
    if path != "status":
        assert out.count("warning[config-invalid]") == 1 and str(root / CONFIG) in r.stderr, r.stderr
    found = [f for f in _status(root)["findings"] if f["code"] == "config-invalid"]
    assert len(found) == 1 and str(root / CONFIG) in found[0]["message"] and says in found[0]["message"], found
    if path == "reconcile-stale":   # removed, and nothing built over the defaults
        doc = json.loads(r.stdout)
        assert "build-install" not in [s["action"] for s in doc["steps"]], doc["steps"]
        assert [f["code"] for f in doc["findings"]].count("config-invalid") == 1, doc["findings"]


def _record_cases():
    """Every path x kind x shape; light: four a path, so that each kind and each shape meets each path once in the
    light suite (a Latin square), the other 60 marked slow (0.2-0.3 s each)."""
    out = []
    for p, path in enumerate(sorted(PATHS)):
        for k, kind in enumerate(KINDS):
            for sh, shape in enumerate(SHAPES):
                light = (k + sh + p) % len(SHAPES) == 0
                out.append(pytest.param(path, f"{kind}-{shape}", id=f"{path}-{kind}-{shape}",
                                        marks=() if light else pytest.mark.slow))
    return out


@pytest.mark.parametrize("path,record", _record_cases())
def test_safety_path_with_a_corrupt_record(templates, tmp_path, monkeypatch, path, record):
    root = _node(templates, tmp_path, path)
    (root / CONFIG).parent.mkdir(parents=True, exist_ok=True)
    (root / CONFIG).write_text("auto_build: false\n")      # only the safety steps: no build on a fixture tree
    rel, text = RECORDS[record]
    _write(root / rel, text)
    before = _safe_module(root, check=False)
    r = _run_in_process(templates, root, path, monkeypatch)
    assert r.exit_code in ((0, 1) if path == "status" else (0,)), (r.exit_code, r.stdout, r.stderr)
    _acted(root, path, before)
    # the corrupt text is never trusted: it is still there and status names it, or it was set aside (the one
    # quarantine, *.bad-<time>) and maybe replaced by a record this run wrote whole
    still = (root / rel).exists() and (root / rel).read_text() == text
    if still:
        codes = {f["code"]: f for f in _status(root)["findings"]}
        assert "record-quarantined" in codes and rel.split("/")[-1] in codes["record-quarantined"]["message"], codes
    else:
        assert list((root / rel).parent.glob("*.bad-*")) or (root / rel).exists(), sorted(
            p.name for p in (root / rel).parent.iterdir())
        if (root / rel).exists():
            assert isinstance(json.loads((root / rel).read_text()), dict)
    if path == "status":
        assert still, "status renamed or rewrote a record"


# --- the environment: a tool or a writable state directory missing (a private mount namespace) -----------

def _unshared(root: Path, setup: str, argv: list[str], stdin: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'daemon'}:{REPO}")
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    env.pop("APT_HOOK_INFO_FD", None)
    script = (f"set -e; {setup}; set +e; /usr/bin/python3 -m spark_memsaver --root \"$0\" \"$@\"; rc=$?; "
              "/usr/bin/python3 -m spark_memsaver --root \"$0\" status --json --direct > \"$0.status\"; exit $rc")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(root), *argv],
                       input=stdin, capture_output=True, text=True, env=env, timeout=300)
    assert "Traceback" not in r.stderr and "internal-error" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r


def _without(tool: str, tmp: Path) -> str:
    """A shell line that hides ``tool`` from /usr/sbin (and /sbin, its link on merged-/usr) in this namespace
    only: the real directory bound aside, and a directory of links to its entries but that one bound over it."""
    real, shadow = tmp / "sbin-real", tmp / "sbin-shadow"
    real.mkdir()
    shadow.mkdir()
    for e in os.listdir("/usr/sbin"):
        if e != tool:
            src = f"/usr/sbin/{e}"
            os.symlink(os.readlink(src) if os.path.islink(src) else str(real / e), shadow / e)
    others = [d for d in ("/usr/local/sbin", "/usr/local/bin", "/usr/bin", "/bin") if os.path.exists(f"{d}/{tool}")]
    assert not others, f"{tool} is also in {others}: hiding /usr/sbin's would prove nothing"
    return f"mount --bind /usr/sbin {real}; mount --bind {shadow} /usr/sbin; ! command -v {tool}"


ENV_FAULTS = ("dkms-missing", "modprobe-missing", "depmod-missing", "var-lib-read-only", "var-lib-full")


@pytest.mark.parametrize("fault", ENV_FAULTS)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_safety_path_with_a_broken_environment(templates, tmp_path, monkeypatch, path, fault):
    needs.require("unshare", "mount")
    root = _node(templates, tmp_path, path)
    (root / CONFIG).parent.mkdir(parents=True, exist_ok=True)
    (root / CONFIG).write_text("auto_build: false\n")
    (root / STATE).mkdir(parents=True, exist_ok=True)
    if fault == "dkms-missing":
        (root / "usr/sbin/dkms").unlink()                       # the node's own dkms is gone, and this host's
        setup = _without("dkms", tmp_path)
    elif fault in ("modprobe-missing", "depmod-missing"):
        setup = _without(fault.split("-")[0], tmp_path)
    elif fault == "var-lib-read-only":
        setup = f"mount --bind {root / STATE} {root / STATE}; mount -o remount,bind,ro {root / STATE}"
    else:                         # a small tmpfs, filled: every record write fails with ENOSPC
        setup = (f"mount -t tmpfs -o size=64k,mode=0755 tmpfs {root / STATE}; "
                 f"cat /dev/zero > {root / STATE}/filler 2>/dev/null || true")
    before = _safe_module(root, check=False)
    _t, argv, stdin = PATHS[path]
    r = _unshared(root, setup, argv, templates[stdin] if stdin else None)
    status = json.loads(Path(f"{root}.status").read_text())
    codes = [f["code"] for f in status["findings"]]
    if fault == "depmod-missing" and path != "status":
        # nothing selects the stock module again without depmod: the command stops named (program, package) and
        # leaves its recovery record; status names the program first, and the interruption, whose remedy finishes
        # the way back once kmod is back (meanwhile the guard never loads an unreadable selection: row 54)
        err = json.loads(r.stdout)
        err = err.get("error") or next(k["error"] for k in err.get("kernels") or err.get("steps") if k.get("error"))
        assert r.returncode == (0 if path == "apt-door" else 3), r.stdout       # the door never aborts APT
        assert "'depmod' is not installed (Debian package kmod)" in err["message"], r.stdout
        assert err["remedy"] == "Install it: 'sudo apt-get install kmod'.", err
        assert "operation-interrupted" in codes, codes
        remedy = next(f["remedy"] for f in status["findings"] if f["code"] == "operation-interrupted")
        monkeypatch.delenv("SPARK_MEMSAVER_CONFIG", raising=False)
        fix = remedy.split("'sudo spark-memsaver ", 1)[1].split("'", 1)[0].split()
        done = CliRunner(mix_stderr=False).invoke(_cli(), ["--root", str(root), *fix, "--json"])
        assert done.exit_code == 0 and "operation-interrupted" not in str(_status(root)["findings"]), done.stdout
    else:
        assert r.returncode in ((0, 1) if path == "status" else (0,)), (r.returncode, r.stdout, r.stderr)
    _acted(root, path, before)
    if fault == "dkms-missing":   # on the stale node status leads with what to do first: the mismatch, whose
        # remedy (reconcile) works without dkms (the reconcile-stale row); everywhere else it names dkms
        assert "dkms-missing" in codes or path == "status" and codes[0] == "override-driver-mismatch", codes
    elif fault.endswith("-missing"):      # status names the program and the package that provides it
        tool = fault.split("-")[0]
        named = [f for f in status["findings"] if f["code"] == "program-missing" and f["message"].startswith(tool)]
        assert named and "package kmod" in named[0]["message"] and "apt-get install kmod" in named[0]["remedy"], \
            status["findings"]
        first = next(f for f in status["findings"] if f["severity"] == "error")
        assert first == named[0], status["findings"]       # before the mismatch, whose remedy needs depmod
    elif fault.startswith("var-lib") and path != "status":
        doc = json.loads(r.stdout)     # status cannot see a record that was never written: the result says it
        why = "Read-only file system" if fault == "var-lib-read-only" else "No space left on device"
        assert doc.get("record_problems") and any(why in json.dumps(p) for p in doc["record_problems"]), doc
