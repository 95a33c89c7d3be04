"""The CLI's surface, read from click's own command tree: every option has help and a meaningful metavar, every
command's --help ends with 1-3 examples that parse with the CLI's parser (sudo exactly on the commands that
change the system), every mutating command has --dry-run that prints the plan the run follows and changes
nothing, and conflicting options are refused as bad usage."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import click
import pytest

from spark_memsaver.cli import examples
from tests.support import sparkroot
from tests.support.cliparse import parse, parse_with_globals, split
from tests.test_docs_vs_code import gen_docs

REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
ENV.pop("SPARK_MEMSAVER_CONFIG", None)
LEAVES = dict(gen_docs().leaf_commands())
MUTATING = {"install", "build", "remove", "rollback", "activate", "reconcile", "mok enroll", "mok cancel",
            "validate", "reclaim"}
DRY_RUN = {"install", "build", "remove", "rollback", "activate", "reconcile", "mok enroll", "mok cancel",
           "validate", "reclaim"}
GROUPS = ["", "mok", "patch", "config"]        # "": spark-memsaver itself
VAGUE = {"TEXT", "INTEGER", "FLOAT", "PATH", "DIRECTORY", "FILENAME", "FILE PATH", "INTEGER RANGE", "FLOAT RANGE"}


def cli(*args):
    return subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", *args], capture_output=True, text=True,
                          env=ENV, timeout=300)


def metavar(p, ctx) -> str:
    """click 8.1 (Debian 12) takes no context; 8.2 and later need it."""
    try:
        return p.make_metavar(ctx)
    except TypeError:
        return p.make_metavar()


def test_the_tree_is_whole():
    assert {"status", "install", "build", "remove", "rollback", "activate", "reconcile", "mok enroll",
            "patch check", "validate", "metrics", "config show"} <= set(LEAVES)
    assert set(examples.EXAMPLES) == set(LEAVES) | set(GROUPS)


@pytest.mark.parametrize("group", GROUPS)
def test_group_help_ends_with_runnable_examples(group):
    """'spark-memsaver --help' and each group's --help end with 1-3 examples too (they ended with the command
    list): each runs one of the group's commands as written."""
    r = cli(*group.split(), "--help")
    assert r.returncode == 0, r.stderr
    tail = r.stdout.rstrip().split("\n\n")[-1].splitlines()
    assert tail[0].strip() == "Examples:", r.stdout
    lines = [ln.strip() for ln in tail[1:]]
    assert 1 <= len(lines) <= 3
    for ln in lines:
        sudo, _ = split(ln)
        got, _ = parse(ln)
        assert got in LEAVES and got.startswith(group), (ln, got)
        assert sudo == (got in MUTATING), f"{ln}: sudo {'missing' if not sudo else 'not needed'}"


@pytest.mark.parametrize("path", sorted(LEAVES))
def test_every_option_has_help_and_a_meaningful_metavar(path):
    cmd = LEAVES[path]
    ctx = click.Context(cmd)
    for p in cmd.params:
        if not isinstance(p, click.Option) or p.hidden:
            continue
        assert p.help, f"{path} {p.opts}: no help"
        if not p.is_flag:
            mv = metavar(p, ctx)
            assert mv.strip("[]. ").upper() not in VAGUE, f"{path} {p.opts}: metavar {mv}"


def test_global_options_have_help_and_metavars():
    from spark_memsaver.cli.main import cli as root
    ctx = click.Context(root)
    for p in root.params:
        if isinstance(p, click.Option) and not p.is_flag:
            assert p.help and metavar(p, ctx) in ("DIR", "FILE"), p.opts


@pytest.mark.parametrize("path", sorted(LEAVES))
def test_help_ends_with_runnable_examples(path):
    r = cli(*path.split(), "--help")
    assert r.returncode == 0, r.stderr
    tail = r.stdout.rstrip().split("\n\n")[-1].splitlines()
    assert tail[0].strip() == "Examples:", r.stdout
    lines = [ln.strip() for ln in tail[1:]]
    assert 1 <= len(lines) <= 3
    for ln in lines:
        sudo, _ = split(ln)
        got, _ = parse(ln)
        assert got == path, (ln, got)
        assert sudo == (path in MUTATING), f"{ln}: sudo {'missing' if not sudo else 'not needed'}"


@pytest.mark.parametrize("path", sorted(LEAVES))
def test_global_options_after_every_command(path):
    """'spark-memsaver status --root X' failed with "No such option '--root'": the root group's options are taken
    after the command too (its first example with them appended), with the same effect as before it."""
    import shlex
    sudo, argv = split(examples.EXAMPLES[path][0])
    n = 1 + len(path.split())
    argv = argv[:n] + ["--root", "/srv/img", "--config", "/srv/c.yaml", "--debug"] + argv[n:]
    got, _, top = parse_with_globals(" ".join(["sudo"] * sudo + [shlex.quote(a) for a in argv]))
    assert got == path
    assert (top["root"], top["config_path"], top["debug"]) == ("/srv/img", "/srv/c.yaml", True)
    _, _, top = parse_with_globals(examples.EXAMPLES[path][0])          # none given: the defaults
    assert (top["root"], top["debug"]) == ("/", False)


def test_status_root_after_the_command_reads_that_root(tmp_path):
    root = tmp_path / "root"
    sparkroot.make_spark_root(root)
    before = cli("--root", str(root), "status", "--json")
    after = cli("status", "--root", str(root), "--json")
    assert after.returncode == before.returncode and "No such option" not in after.stderr, after.stderr
    a, b = json.loads(after.stdout), json.loads(before.stdout)
    assert a["host"]["kernel"] == b["host"]["kernel"] == sparkroot.SPARK_KERNEL
    assert a["state"] == b["state"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tier: 256\n")
    shown = cli("config", "show", "--config", str(cfg), "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["tier"] == "256", shown.stdout + shown.stderr


@pytest.mark.parametrize("path", sorted(DRY_RUN))
def test_every_mutating_command_has_dry_run(path):
    assert any("--dry-run" in p.opts for p in LEAVES[path].params), path


def _tree(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


def test_dry_runs_change_nothing_and_print_a_plan(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r", uvm_loaded="ours", ours_installed="580.142")
    before = _tree(root)
    for argv in (("install", "--dry-run"), ("remove", "--dry-run"), ("rollback", "--dry-run"),
                 ("build", "--dry-run"), ("reconcile", "--dry-run")):
        r = cli("--root", str(root), *argv)
        assert r.returncode == 0, (argv, r.stdout, r.stderr)
        assert r.stdout.startswith("plan (dry run):"), (argv, r.stdout)
    assert _tree(root) == before


def test_rollback_dry_run_is_the_plan_the_run_follows(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r", uvm_loaded="ours", ours_installed="580.142")
    plan = json.loads(cli("--root", str(root), "rollback", "--dry-run", "--json").stdout)
    assert plan["dry_run"] is True
    planned = sorted({s["kernel"] for s in plan["steps"] if s["action"] == "remove"})
    done = json.loads(cli("--root", str(root), "rollback", "--json").stdout)
    assert planned == sorted(k["kernel"] for k in done["kernels"]) == [sparkroot.SPARK_KERNEL]
    # ours stays loaded under a root prefix (the reload is modprobe on the running node: skipped here, and said):
    # the next rollback has nothing left to take away but that reload
    assert done["reload"] == {"ok": False, "skipped": "not the running system"}, done
    again = json.loads(cli("--root", str(root), "rollback", "--dry-run", "--json").stdout)
    assert [s["action"] for s in again["steps"]] == ["reload-uvm"], again


@pytest.mark.parametrize("state,args", [("stock", ()), ("installed", ()), ("stock", ("--all",)),
                                        ("installed", ("--kernel", sparkroot.SPARK_KERNEL))])
def test_remove_dry_run_is_the_plan_the_run_follows(tmp_path, state, args):
    """remove --dry-run listed 'dkms uninstall and unbuild', 'the recorded stock nvidia-uvm' and initramfs for
    every kernel, also where nothing of ours was registered and no stock was recorded (the run then only makes
    the stock one selected again), and not the hold the run writes."""
    root = sparkroot.make_spark_root(tmp_path / "r", ours_installed="580.142" if state == "installed" else None)
    plan = json.loads(cli("--root", str(root), "remove", "--dry-run", "--json", *args).stdout)
    done = json.loads(cli("--root", str(root), "remove", "--json", *args).stdout)
    by = {}
    for s in plan["steps"]:
        by.setdefault(s["action"], []).append(s["kernel"])
    acted = {"uninstall": [r["kernel"] for r in done["removed"] if r["action"] == "uninstalled"],
             "unbuild": [r["kernel"] for r in done["removed"] if r["action"] == "unbuilt"],
             "restore-stock": [r["kernel"] for r in done["restored"]],
             "depmod": [r["kernel"] for r in done["restored"]],
             "initramfs": [r["kernel"] for r in done["restored"] if "initramfs" in r]}
    assert {a: by.get(a, []) for a in acted} == acted, (plan["steps"], done)
    held = json.loads(cli("--root", str(root), "status", "--json").stdout).get("hold") or {}
    assert by.get("hold") == [held.get("kernel")] and held.get("by") == "remove", (plan["steps"], held)


@pytest.mark.parametrize("held", ["kernel", "all"])
def test_install_dry_run_names_the_hold_it_ends(tmp_path, held):
    """install ends the administrator's rollback/remove hold before it acts (automation may act again); its
    dry run did not say so. The plan's release step is what host/holds.release does on a copy of the root."""
    import shutil

    from spark_memsaver.host import Host, holds
    root = sparkroot.make_spark_root(tmp_path / "r")
    holds.hold(Host(root), "rollback" if held == "kernel" else "remove",
               sparkroot.SPARK_KERNEL if held == "kernel" else None, "requested")
    plan = json.loads(cli("--root", str(root), "install", "--dry-run", "--json").stdout)
    assert plan["steps"][0]["action"] == "release-hold", plan["steps"]
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, symlinks=True)
    released = holds.release(Host(copy), sparkroot.SPARK_KERNEL)
    assert released and all(r in plan["steps"][0]["reason"] for r in released), (plan["steps"][0], released)
    free = sparkroot.make_spark_root(tmp_path / "free")
    assert "release-hold" not in [s["action"] for s in json.loads(
        cli("--root", str(free), "install", "--dry-run", "--json").stdout)["steps"]]


def test_install_dry_run_plans_or_refuses_as_the_run_does(tmp_path):
    ok = sparkroot.make_spark_root(tmp_path / "ok")
    plan = json.loads(cli("--root", str(ok), "install", "--dry-run", "--json").stdout)
    assert [s["action"] for s in plan["steps"]] == ["build", "install", "depmod", "initramfs", "verify"]
    assert {s["kernel"] for s in plan["steps"]} == {sparkroot.SPARK_KERNEL}
    bad = sparkroot.make_spark_root(tmp_path / "bad", headers=False)
    dry = cli("--root", str(bad), "install", "--dry-run", "--json")
    real = cli("--root", str(bad), "install", "--json")
    assert dry.returncode == real.returncode == 1, (dry.stdout, real.stdout)
    assert json.loads(dry.stdout)["error"] == json.loads(real.stdout)["error"]
    assert json.loads(dry.stdout)["error"]["code"] == "headers-missing"


@pytest.mark.parametrize("op", ["install", "remove"])
def test_kernel_and_all_are_refused_as_bad_usage(tmp_path, op):
    root = sparkroot.make_spark_root(tmp_path / "r")
    r = cli("--root", str(root), op, "--kernel", sparkroot.SPARK_KERNEL, "--all")
    assert r.returncode == 2 and "error[usage]: --kernel and --all exclude each other" in r.stderr, r.stderr
    remedy = re.search(r"^remedy: (.*)$", r.stderr, re.M).group(1)
    for cmd in re.findall(r"'([^']+)'", remedy):
        assert parse(cmd)[0] == op


@pytest.mark.parametrize("other", ["--json", "--verbose"])
def test_status_quiet_with_a_printing_option_is_bad_usage(tmp_path, other):
    """--quiet prints nothing; --json and --verbose print: together they were accepted and --quiet won silently."""
    root = sparkroot.make_spark_root(tmp_path / "r")
    r = cli("--root", str(root), "status", "--quiet", other)
    if other == "--json":                 # the error itself is JSON when JSON was asked for
        err = json.loads(r.stdout)["error"]
        message, remedy = f"error[{err['code']}]: {err['message']}", err["remedy"]
    else:
        message, remedy = r.stderr.splitlines()[0], re.search(r"^remedy: (.*)$", r.stderr, re.M).group(1)
    assert r.returncode == 2 and message == f"error[usage]: --quiet and {other} exclude each other", r
    cmds = re.findall(r"'([^']+)'", remedy)
    assert len(cmds) == 2 and all(parse(c)[0] == "status" for c in cmds), remedy


def test_mok_enroll_dry_run_refuses_both_password_sources(tmp_path):
    """The real run refuses --password-file with --password-stdin (bad usage); its dry run said it would enroll."""
    from tests.test_mok import A_VOLATILE, _openssl_cert, efivar, x509_list
    from tests.test_secure_boot_path import node
    ours = _openssl_cert(tmp_path, "ours", "/CN=DKMS module signing key").read_bytes()
    vendor = _openssl_cert(tmp_path, "vendor", "/O=Example/CN=Example Vendor CA").read_bytes()
    root = node(tmp_path / "r", ours, {"MokListRT": efivar(A_VOLATILE, x509_list(vendor))})
    pw = tmp_path / "pw"
    pw.write_text("secret\n")
    assert cli("--root", str(root), "mok", "enroll", "--dry-run").returncode == 0
    r = cli("--root", str(root), "mok", "enroll", "--password-file", str(pw), "--password-stdin", "--dry-run")
    assert r.returncode == 2 and "not both" in r.stderr and "would" not in r.stdout, (r.stdout, r.stderr)


def test_install_ends_with_the_next_step():
    from spark_memsaver.report.summary import next_step
    doc = {"state": "installed", "findings": [{"code": "activation-pending", "severity": "info",
                                               "message": "m", "remedy": "Run 'sudo spark-memsaver activate'."}]}
    assert next_step(doc) == "Run 'sudo spark-memsaver activate'."
    doc = {"state": "active", "findings": [], "records": {}, "memory": {"saved": 1 << 30}}
    assert "sudo spark-memsaver validate" in next_step(doc)
    doc["records"]["last_validation"] = {"outcome": "passed"}
    assert next_step(doc) is None


def test_install_next_step_on_the_states_install_leaves(tmp_path):
    """What `install` prints last ('next: ...', cli/build.next_step) on the two states an install leaves a node
    in, read from real fixture roots: installed with Secure Boot off -> activate; installed while the key is
    not enrolled -> enroll, then reboot and confirm at the console. Each is runnable as printed."""
    from spark_memsaver.cli.build import next_step
    from spark_memsaver.cli.main import Context
    from tests.test_mok import A_VOLATILE, _openssl_cert, efivar, x509_list
    from tests.test_secure_boot_path import node
    installed = sparkroot.make_spark_root(tmp_path / "i", ours_installed="580.142")
    ours = _openssl_cert(tmp_path, "ours", "/CN=DKMS module signing key").read_bytes()
    vendor = _openssl_cert(tmp_path, "vendor", "/O=Example/CN=Example Vendor CA").read_bytes()
    unverified = node(tmp_path / "u", ours, {"MokListRT": efivar(A_VOLATILE, x509_list(vendor))})
    got = {name: next_step(Context(str(root), None, False)) for name, root in
           (("installed", installed), ("unverified", unverified))}
    assert got["installed"].startswith("Run 'sudo spark-memsaver activate'"), got
    assert got["unverified"].startswith("Run 'sudo spark-memsaver mok enroll', then reboot"), got
    for step in got.values():
        for c in re.findall(r"'([^']+)'", step):
            parse(c)
