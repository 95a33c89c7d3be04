"""Issue 35 (items 1, 3, 7 CLI part, 10): config reading is bounded before anything is built or formatted; every
command without root refuses before a lock; --kernel is checked as D-Bus checks it, in every CLI command;
`reconcile --no-rebuild` says its own reason; a closed pipe keeps the command's exit code. The fault table of the
safety paths is tests/test_safety_faults.py. Real CLI processes (an unprivileged one through setpriv), Spark-shaped
roots (tests/support/sparkroot.py)."""

from __future__ import annotations

import json
import re
import os
import resource
import shutil
import subprocess
from pathlib import Path

import pytest

from spark_memsaver import config as cfg
from spark_memsaver.errors import ConfigError
from tests.support import needs, sparkroot

REPO = Path(__file__).resolve().parent.parent
K = sparkroot.SPARK_KERNEL
ENV = dict(os.environ, PYTHONPATH=str(REPO / "daemon"), PYTHONDONTWRITEBYTECODE="1")
ENV.pop("SPARK_MEMSAVER_CONFIG", None)
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def cli(*args, prefix=(), timeout=120, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([*prefix, "/usr/bin/python3", "-m", "spark_memsaver", *args], capture_output=True, text=True,
                       env=ENV, timeout=timeout, **kw)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def _bomb() -> str:
    levels = ["&a0 [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"]
    levels += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    return "kernels: [" + ", ".join(levels) + "]\n"


def _limit_memory():          # a reader that expands the aliases dies at 1 GiB instead of taking the machine
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


# --- item 1: bounded reading --------------------------------------------------------------------------------

def test_an_alias_bomb_is_refused_before_anything_is_built(tmp_path):
    """~0.4 KB of nested aliases (10^9 elements): before, every reader hung past 30 s growing to gigabytes (the
    error formatted the value with !r). Now: refused at the first anchor, named with file and line."""
    p = tmp_path / "config.yaml"
    p.write_text(_bomb())
    assert len(p.read_bytes()) < 1024
    r = cli("--config", str(p), "config", "show", timeout=60, preexec_fn=_limit_memory)
    assert r.returncode == 2 and "error[config-invalid]" in r.stderr and "aliases" in r.stderr, r.stderr
    assert f"{p}, line 1" in r.stderr and len(r.stderr) < 2000, r.stderr
    r = cli("--config", str(p), "status", "--json", "--direct", timeout=60, preexec_fn=_limit_memory)
    found = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "config-invalid"]
    assert r.returncode != 2 and len(found) == 1 and "aliases" in found[0]["message"], (r.returncode, found)


@pytest.mark.parametrize("text,needle", [
    ("# padding\n" * 7000 + "tier: leaf\n", "larger than 64 KiB"),
    ("kernels: " + "[" * 9 + "]" * 9 + "\n", "nested deeper than 8 levels"),
    ("tier: &t leaf\n", "anchors and aliases"),
])
def test_size_depth_and_anchors_are_capped(tmp_path, text, needle):
    p = tmp_path / "config.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        cfg.load(str(p))
    assert needle in e.value.message and e.value.details["file"] == str(p), e.value.message


@pytest.mark.parametrize("text", ["? [1, 2]\n: x\n", "{[1]: 2}\n", "1: 2\n", "tier: !!binary aGVsbG8=\n",
                                  "tier: !!python/object:os.system x\n", "a: &x 1\nb: *x\n", "\ufefftier: [\n",
                                  "tier: \x00\n"])
def test_odd_documents_are_named_config_errors(tmp_path, text):
    """Keys that are lists or numbers, tags, anchors, a BOM, a NUL: a ConfigError naming the file, nothing else."""
    p = tmp_path / "config.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        cfg.load(str(p))
    assert str(p) in e.value.message and len(e.value.message) < 400, e.value.message


def test_a_fifo_is_refused_without_blocking(tmp_path):
    """A FIFO at the config path: before, open() waited for a writer for ever (every reader, the hooks too)."""
    p = tmp_path / "config.yaml"
    os.mkfifo(p)
    r = cli("--config", str(p), "config", "show", timeout=60)
    assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr


def test_a_value_shown_back_is_cut(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text("interval: '" + "x" * 20000 + "'\n")
    with pytest.raises(ConfigError) as e:
        cfg.load(str(p))
    assert len(e.value.message) < 300 and "..." in e.value.message, e.value.message


def test_build_and_install_still_refuse_an_unusable_file(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "root")
    (root / "etc/spark-memsaver").mkdir(parents=True, exist_ok=True)
    (root / "etc/spark-memsaver/config.yaml").write_text("tier: [oops\n")
    for argv in (["build", "--dry-run"], ["install", "--dry-run"], ["install", "--kernel", K]):
        r = cli("--root", str(root), *argv)
        assert r.returncode == 2 and "error[config-invalid]" in r.stderr, (argv, r.stderr)
    from spark_memsaver.act import executor
    from spark_memsaver.host import Host
    bad = cfg.load_for_safety(root=str(root))
    with pytest.raises(ConfigError):      # the executor refuses it too (D-Bus, any other door)
        executor.perform("install", Host(root), bad, kernel=K)


# --- item 3: no root --------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["reconcile"], ["reconcile", "--no-rebuild"], ["reconcile", "--json"],
    ["install"], ["remove"], ["rollback"], ["activate"], ["build"],
])
def test_every_command_without_root_refuses_before_any_lock(argv):
    """On the live system as nobody (no daemon to ask here): not-permitted, exit 1, the sudo form as typed. Before,
    reconcile crashed: internal-error PermissionError on /run/spark-memsaver/lifecycle.lock, exit 3."""
    needs.require("setpriv")
    needs.root("becoming nobody with setpriv")
    lock = Path("/run/spark-memsaver/lifecycle.lock")
    before = lock.stat().st_mtime_ns if lock.exists() else None
    r = cli(*argv, prefix=NOBODY, cwd="/")
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "not-permitted" in out, (r.returncode, out)
    assert "sudo spark-memsaver " + " ".join(argv) in out and "internal-error" not in out, out
    assert (lock.stat().st_mtime_ns if lock.exists() else None) == before


def test_the_executor_refuses_without_root_for_every_door():
    """D-Bus runs as root; any other door that reaches executor.perform unprivileged (a hook run by hand) is
    refused there too, before the lock; the package-manager door says so and never fails its caller."""
    needs.require("setpriv")
    needs.root("becoming nobody with setpriv")
    code = ("from spark_memsaver.act import executor\nfrom spark_memsaver.config import Config\n"
            "from spark_memsaver.host import Host\nfrom spark_memsaver.errors import NotPermitted\n"
            "for op in ('reconcile', 'remove', 'rollback', 'install', 'build'):\n"
            "    try:\n        executor.perform(op, Host('/'), Config())\n"
            "    except NotPermitted as e:\n        print(op, e.code, e.remedy)\n")
    r = subprocess.run([*NOBODY, "/usr/bin/python3", "-c", code], capture_output=True, text=True, env=ENV, cwd="/",
                       timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split()[:2] for ln in lines] == [[op, "not-permitted"] for op in
                                               ("reconcile", "remove", "rollback", "install", "build")], r.stdout
    assert all("'sudo spark-memsaver " in ln for ln in lines), lines
    r = cli("reconcile", "--hook", "dpkg", prefix=NOBODY, cwd="/")
    assert r.returncode == 0 and "needs root" in r.stderr and "internal-error" not in r.stderr, r.stderr


def test_metrics_output_without_root_is_refused_by_name():
    """Before: internal-error PermissionError, exit 3."""
    needs.require("setpriv")
    needs.root("becoming nobody with setpriv")
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="sm-metrics-", dir="/tmp"))    # root's, 0755: readable, not writable by nobody
    try:
        d.chmod(0o755)
        out = d / "spark-memsaver.prom"
        r = cli("metrics", "--output", str(out), prefix=NOBODY, cwd="/")      # the live system, as nobody
        assert r.returncode == 1 and "error[not-permitted]" in r.stderr, r.stderr
        assert f"sudo spark-memsaver metrics --output {out}" in r.stderr and not out.exists(), r.stderr
    finally:
        shutil.rmtree(d)


# --- item 7: one kernel check for every door ----------------------------------------------------------------

@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    root = sparkroot.make_spark_root(tmp_path_factory.mktemp("k") / "root", ours_installed=sparkroot.DRIVER)
    shutil.copy2(shutil.which("dkms") or "/usr/sbin/dkms", root / "usr/sbin/dkms")
    return root


CMDS = [["remove"], ["remove", "--dry-run"], ["rollback"], ["rollback", "--dry-run"], ["install"],
        ["install", "--dry-run"], ["build"], ["build", "--dry-run"], ["reconcile"], ["reconcile", "--dry-run"]]


@pytest.mark.parametrize("argv,kernel", [(a, "../../etc") for a in CMDS] + [
    (["remove"], f"{K}\n"), (["remove"], "a/b"), (["remove"], ".."), (["reconcile"], ".."),
    (["rollback", "--dry-run"], "a/b")])
def test_every_cli_kernel_goes_through_the_dbus_check(spark, argv, kernel):
    """Before: 'remove --kernel ../../etc' wrote holds/.._.._etc.json and ran depmod with that name (D-Bus refused
    it). Now the CLI refuses it with D-Bus's own error (versions.release, service/checks.kernel calls it)."""
    from spark_memsaver.service import checks
    with pytest.raises(checks.InvalidArgument) as dbus:
        checks.kernel(kernel)
    r = cli("--root", str(spark), *argv, "--kernel", kernel, "--json")
    err = json.loads(r.stdout)["error"]
    assert r.returncode == 2 and err["code"] == "invalid-argument" and err["message"] == dbus.value.message, r.stdout
    state = spark / "var/lib/spark-memsaver"
    assert not [p for p in state.rglob("*") if ".." in p.name or "etc" in p.name], sorted(state.rglob("*"))


# --- item 10: --no-rebuild's own reason; a closed pipe keeps the exit code ---------------------------------

def test_no_rebuild_records_its_own_reason(tmp_path):
    """A supported driver and no build: plain reconcile would build; --no-rebuild stays stock and says why --
    before, "automatic builds are off (auto_build: false)" while auto_build was true."""
    root = sparkroot.make_spark_root(tmp_path / "root")
    plain = json.loads(cli("--root", str(root), "reconcile", "--dry-run", "--json").stdout)["steps"]
    assert "build-install" in [s["action"] for s in plain], plain
    steps = json.loads(cli("--root", str(root), "reconcile", "--no-rebuild", "--dry-run", "--json").stdout)["steps"]
    (st,) = [s for s in steps if s["kernel"] == K]
    assert st["action"] == "stay-stock" and "--no-rebuild" in st["reason"] and "auto_build" not in st["reason"], st
    assert st["code"] == "no-rebuild", st


def test_the_callers_reason_and_the_configs_are_told_apart():
    from spark_memsaver.decide.plan import no_rebuild
    dpkg = "dpkg (pid 42) is running: rebuilds wait for its trigger"
    assert no_rebuild(cfg.Config(), False, dpkg) == (dpkg, "no-rebuild")
    assert no_rebuild(cfg.Config(auto_build=False)) == ("automatic builds are off (auto_build: false)",
                                                       "auto-build-off")
    assert no_rebuild(cfg.Config()) is None and no_rebuild(cfg.Config(), True) is None
    bad = cfg.Config(invalid={"file": "/etc/spark-memsaver/config.yaml", "line": 3, "message": "m"})
    reason, code = no_rebuild(bad, True)           # an unusable file is never built over, whoever asks
    assert code == "config-invalid" and "config.yaml, line 3" in reason


def _closed_pipe(argv: list[str]) -> int:
    r, w = os.pipe()
    p = subprocess.Popen(argv, stdout=w, stderr=subprocess.PIPE, env=ENV)
    os.close(w)
    os.close(r)              # the reader is gone before the first write: EPIPE for sure
    _, err = p.communicate(timeout=120)
    assert b"Traceback" not in err, err
    return p.returncode


def test_a_closed_pipe_keeps_the_commands_exit_code(tmp_path):
    """'status | true' on a node with a warning exits 1 (before: 0); '--help | true' exits 0 (before: 1)."""
    root = sparkroot.make_spark_root(tmp_path / "root", ours_installed="580.95.05")   # a stale override: an error
    base = ["/usr/bin/python3", "-m", "spark_memsaver"]
    assert cli("--root", str(root), "status").returncode == 1
    warned = sparkroot.make_spark_root(tmp_path / "warned")      # the node: a warning only (rolled back)
    from spark_memsaver.host import Host, intents
    intents.write_rollback(Host(warned), K, "the driver moved", code="stock-selected")
    assert cli("--root", str(warned), "status").returncode == 1
    assert _closed_pipe(base + ["--root", str(warned), "status"]) == 1
    for _ in range(3):
        assert _closed_pipe(base + ["--root", str(root), "status", "--verbose"]) == 1
        assert _closed_pipe(base + ["--root", str(root), "status", "--json"]) == 1
        assert _closed_pipe(base + ["--help"]) == 0
        assert _closed_pipe(base + ["reconcile", "--help"]) == 0


# --- item 1: the readers beside status, and spark-memsaverd's side ----------------------------------------

def test_metrics_and_mok_status_go_on_with_an_unusable_file(tmp_path):
    """Before: both stopped with config-invalid, exit 2."""
    root = sparkroot.make_spark_root(tmp_path / "root")
    (root / "etc/spark-memsaver").mkdir(parents=True, exist_ok=True)
    (root / "etc/spark-memsaver/config.yaml").write_text("tier: [oops\n")
    for argv, code in ((["metrics"], 0), (["mok", "status"], 0), (["mok", "status", "--json"], 0)):
        r = cli("--root", str(root), *argv)
        assert r.returncode == code and r.stderr.count("warning[config-invalid]") == 1, (argv, r.returncode, r.stderr)
        assert "config.yaml: not valid YAML (line 2" in r.stderr, r.stderr
    assert "spark_memsaver_info{" in cli("--root", str(root), "metrics").stdout


def test_the_daemons_status_child_and_reconcile_job_keep_going(tmp_path):
    """spark-memsaverd: its status document names the unusable file (one finding) over the config in force, and
    its reconcile job runs on the last good config marked invalid (no builds) instead of failing -- before, a
    stale override stayed until the file was fixed."""
    root = sparkroot.make_spark_root(tmp_path / "root", ours_installed="580.95.05")
    bad = tmp_path / "config.yaml"
    bad.write_text("interval: fast\n")
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver.service.statusproc", "--root", str(root),
                        "--config", str(bad)], input=json.dumps({"interval": 30}), capture_output=True, text=True,
                       env=ENV, timeout=120)
    ans = json.loads(r.stdout)
    assert ans["config_error"]["code"] == "config-invalid" and ans["config"]["interval"] == 30, ans["config"]
    assert "invalid" not in ans["config"]
    found = [f for f in ans["doc"]["findings"] if f["code"] == "config-invalid"]
    assert len(found) == 1 and f"{bad}, line 1" in found[0]["message"], found
    from types import SimpleNamespace
    from spark_memsaver.service import daemon as d
    from spark_memsaver.service.statusproc import Settings, config_dict
    me = SimpleNamespace(config_path=str(bad), root=str(root), config=Settings(config_dict(cfg.Config(interval=30))))
    job = d.Daemon._job_config(me, "reconcile")
    assert job.interval == 30 and job.invalid and job.invalid["line"] == 1, job
    from spark_memsaver.decide.plan import no_rebuild
    assert no_rebuild(job)[1] == "config-invalid"


def test_a_removal_stopped_by_a_named_error_keeps_its_recovery_record(tmp_path):
    """Exit 3 means a recorded interruption. A removal that stops on a named error midway (depmod missing or
    failing after our files went, the stock module not verified) keeps its intent, marked failed with the error:
    status names the interruption and the next operation finishes the removal (tests/FAULTS.md wb4, depmod).
    Before, the record was cleared as if the engine had put everything back. A build or install that fails named
    still clears it (its engine restores stock before raising)."""
    from spark_memsaver.act import records_io as rio
    from spark_memsaver.errors import CommandNotFound
    from spark_memsaver.host import Host, intents
    host = Host(tmp_path)
    with pytest.raises(CommandNotFound):
        with rio.safe_intent(host, "remove", K, removal=True, problems=[]):
            raise CommandNotFound("'depmod' is not installed (Debian package kmod)")
    (rec,), bad = intents.list_intents(host)
    assert not bad and rec["op"] == "remove" and rec["kernel"] == K and rec["phase"] == "failed", rec
    assert rec["error"] == "command-not-found: 'depmod' is not installed (Debian package kmod)", rec
    intents.clear_intent(host, rec)
    with pytest.raises(CommandNotFound):
        with rio.safe_intent(host, "install", K, removal=False, problems=[]):
            raise CommandNotFound("'dkms' is not installed")
    assert intents.list_intents(host) == ([], [])


def test_status_names_a_selection_it_cannot_read_and_depmod_mends_it(tmp_path):
    """Our file gone while the module index still names it (a removal stopped before depmod, a file deleted by
    hand): status names it (selection-unreadable, the guard never loads it) -- before, it said only "stock: The
    stock nvidia-uvm is selected" -- and its remedy, depmod for that kernel, makes kmod select the stock module."""
    needs.require("depmod")
    root = sparkroot.make_spark_root(tmp_path / "root", ours_installed=sparkroot.DRIVER)
    (root / f"lib/modules/{K}/updates/dkms/nvidia-uvm.ko").unlink()
    doc = json.loads(cli("--root", str(root), "status", "--json").stdout)
    found = {f["code"]: f for f in doc["findings"]}
    assert "selection-unreadable" in found and found["selection-unreadable"]["kernel"] == K, sorted(found)
    assert found["selection-unreadable"]["remedy"] == f"Run 'sudo depmod -a {K}' to rebuild the module index.", found
    # nothing readable is selected: status does not also call it "stock" (with install's advice), and its Kernels
    # table and JSON say unreadable, not "none"
    assert "stock" not in found, sorted(found)
    assert doc["kernels"][0]["uvm_selected"]["state"] == "unreadable", doc["kernels"]
    text = cli("--root", str(root), "status").stdout
    assert re.search(rf"\* {re.escape(K)}\s+64 KiB\s+yes\s+unreadable\s*$", text, re.M), text
    r = subprocess.run(["depmod", "-b", str(root), "-a", K], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(cli("--root", str(root), "status", "--json").stdout)
    assert "selection-unreadable" not in [f["code"] for f in doc["findings"]]
    assert "stock" in [f["code"] for f in doc["findings"]]
    (k,) = doc["kernels"]
    assert k["uvm_selected"]["version"] == sparkroot.DRIVER and not k["uvm_selected"]["patched"], k
