"""CLI: build, install and remove (click commands only; the work is done by act/executor.perform)."""

from __future__ import annotations

import click
import json
import re
import sys
import os

from spark_memsaver.observe.dkms import PACKAGE
from spark_memsaver.errors import MemsaverError


class _Line:
    """A live progress line on stderr (a TTY gets \\r updates; otherwise one line per message change)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last = ""
        self.tenth = None           # a counted stage ('compiling nvidia-uvm: 61/122 files'): one line per 10 %

    def __call__(self, fraction: float, message: str) -> None:
        if not self.enabled:
            return
        text = f"[{int(fraction * 100):3d}%] {message}"
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()
        elif message != self.last:
            m = re.match(r"^(.*): (\d+)/(\d+) files$", message)
            tenth = (m.group(1), int(m.group(2)) * 10 // max(1, int(m.group(3)))) if m else None
            if tenth is None or tenth != self.tenth:
                sys.stderr.write(text + "\n")
            self.tenth = tenth
        self.last = message

    def done(self) -> None:
        if self.enabled and self.tty and self.last:
            sys.stderr.write("\n")


def act(obj, op: str, progress, **kw) -> dict:
    """The one decision of every mutating command: root, or another root (--root) -> executor.perform here;
    a non-root user on the live system -> spark-memsaverd (polkit decides), or perform (which refuses with
    a named error) when no daemon runs. ``_local_only`` (e.g. build --force) never goes to the daemon."""
    from spark_memsaver.act import executor, installable

    local_only = kw.pop("_local_only", False)
    # toward stock never waits for a valid config file (issue 35); build and install refuse an unusable one
    config = obj.safety_config() if op in executor.SAFETY_OPS else obj.config
    if kw.get("kernel"):       # a kernel release, as D-Bus checks it, before anything else (versions.release)
        installable.check_kernel(obj.host, kw["kernel"])
    if kw.get("dry_run"):      # a plan changes nothing: no root, no daemon (act/dryrun.py, through perform)
        return executor.perform(op, obj.host, config, progress=progress, **kw)
    if obj.host.is_live and os.geteuid() != 0:
        if not local_only:
            from spark_memsaver.cli import client
            from spark_memsaver.opnames import dbus_method
            method = dbus_method(op)              # the one table of operations
            doc = client.act_unprivileged(obj.host, method, progress=progress,
                                          **{k: v for k, v in kw.items() if v not in (None, False)})
            if doc is not None:
                return doc
        from spark_memsaver.errors import NotPermitted
        if local_only:        # never asked of the daemon (build --force, reconcile, one kernel's rollback)
            raise NotPermitted(f"'{op}' changes kernel modules and needs root",
                               remedy=f"Run it as root: '{_as_typed_with_sudo()}'.")
        raise NotPermitted(f"'{op}' changes kernel modules and needs root; spark-memsaverd is not running to "
                           "ask on your behalf",
                           remedy=f"Run it as root: '{_as_typed_with_sudo()}'; or start the daemon "
                                  "('sudo systemctl start spark-memsaverd.service') and retry as an authorized user.")
    return executor.perform(op, obj.host, config, progress=progress, **kw)


def _as_typed_with_sudo() -> str:
    """The command line the user typed, with sudo: a remedy runnable as printed."""
    import shlex
    return "sudo spark-memsaver " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _run_cli(obj, op: str, as_json: bool, **kw):
    line = _Line(not as_json)
    try:
        if kw.get("force"):
            kw["_local_only"] = True
        else:
            kw.pop("force", None)
        return act(obj, op, line, **kw)
    finally:
        line.done()


def hazard_notes(host) -> list[dict]:
    """Warnings about known NVIDIA driver faults on this node (uvm_patch/hazards.yaml), for install and
    reconcile to say once. Our module neither causes nor cures them: the operation goes on regardless."""
    from spark_memsaver.decide.hazards import findings_from_inputs
    from spark_memsaver.observe.snapshot import observe_hazard_inputs
    try:
        return [f for f in findings_from_inputs(observe_hazard_inputs(host)) if f["severity"] == "warning"]
    except (OSError, MemsaverError):
        return []


def hazard_note_lines(notes: list[dict]) -> list[str]:
    return [ln for n in notes for ln in (f"note: {n['message']}", f"      remedy: {n['remedy']}")]


def plan_lines(doc: dict) -> list[str]:
    """A dry run's plan (act/dryrun.py), in reconcile's step format."""
    return (["plan (dry run):"] + step_lines(doc["steps"]) + ([] if doc["steps"] else ["  nothing to do"])
            + [f"  skipped          {s['kernel']:<28} {s['reason']}" for s in doc.get("skipped", [])])


def step_lines(steps: list[dict]) -> list[str]:
    out = []
    for s in steps:
        mark = "" if s.get("ok", True) else "  FAILED: " + (s.get("error") or {}).get("message", "")
        out.append(f"  {s['action']:<16} {s.get('kernel') or '':<28} {s.get('reason', '')}{mark}")
    return out


def kernel_table(rows: list[tuple[str, str, str]]) -> list[str]:
    """The per-kernel result of install/remove (one row per kernel, for --kernel and --all alike)."""
    w = max([len("KERNEL")] + [len(r[0]) for r in rows])
    v = max([len("RESULT")] + [len(r[1]) for r in rows])
    return [f"{'KERNEL':<{w}}  {'RESULT':<{v}}  DETAIL"] + [f"{k:<{w}}  {res:<{v}}  {d}" for k, res, d in rows]


def _print_plan(doc: dict, as_json: bool) -> int:
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
    else:
        for ln in plan_lines(doc):
            click.echo(ln)
    return 0


def next_step(obj) -> str | None:
    """After install: the one next step for this node's state now (report/summary.py, as status's first screen
    says it), e.g. activate, enroll the key, or nothing."""
    try:
        from spark_memsaver.report.document import status_of as status
        from spark_memsaver.report.summary import next_step as step
        doc, _ = status(obj.host, obj.config)
        return step(doc)
    except (OSError, MemsaverError):
        return None


def register(cli) -> None:
    """Add `build`, `install` and `remove` to the root group."""

    @cli.command("build")
    @click.option("--kernel", "kernel", default=None, metavar="KERNEL",
                  help="Kernel release [default: the running kernel].")
    @click.option("--all", "all_kernels", is_flag=True, help="Every installed kernel (not with --kernel or --driver).")
    @click.option("--driver", "driver", default=None, metavar="VERSION",
                  help="Expected NVIDIA driver version (must match nvidia.ko).")
    @click.option("--force", is_flag=True, help="Rebuild even when an identical build is installed.")
    @click.option("--dry-run", is_flag=True, help="Print the plan the build would follow; change nothing.")
    @click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
    @click.pass_obj
    def build_cmd(obj, kernel, all_kernels, driver, force, dry_run, as_json):
        """Build the patched nvidia-uvm with DKMS for a kernel (signs it; does not install)."""
        _refuse_both(kernel, all_kernels, "build")
        doc = _run_cli(obj, "build", as_json, kernel=kernel, driver_version=driver, force=force,
                       **({"all_kernels": True} if all_kernels else {}), **({"dry_run": True} if dry_run else {}))
        if dry_run:
            return _print_plan(doc, as_json)
        if as_json:
            click.echo(json.dumps(doc, indent=2, default=str))
        elif all_kernels:          # one row per kernel, as install/remove --all print
            rows = [(r["kernel"], r["status"], f"{PACKAGE}/{r['dkms_version']} (NVIDIA {r['driver']}) -> "
                     f"{r.get('module')}; " + _signed(r.get("signing") or {})) for r in doc["built"]]
            rows += [(s["kernel"], f"refused [{s.get('code', '?')}]", f"{s['reason']}; remedy: {s.get('remedy', '')}")
                     for s in doc["skipped"]]
            for ln in kernel_table(rows):
                click.echo(ln)
        else:
            click.echo(f"{doc['status']}: {PACKAGE}/{doc['dkms_version']} for {doc['kernel']} "
                       f"(NVIDIA {doc['driver']}) -> {doc.get('module')}")
            s = doc.get("signing", {})
            click.echo(_signed(s))
            if s.get("changes_global_signing"):
                click.echo(f"note: DKMS now signs ALL modules with {s.get('key')} (was {s.get('replaces')})")
            if doc.get("log"):
                click.echo(f"log: {doc['log']}")
        return 0

    def _signed(s: dict) -> str:
        return f"signed by: {s.get('subject')} ({s.get('cert')})" if s.get("applies") \
            else f"not signed: {s.get('reason')}"

    def _kernels_opts(f):
        f = click.option("--json", "as_json", is_flag=True, help="Print the result (or the plan) as JSON.")(f)
        f = click.option("--dry-run", is_flag=True, help="Print the plan the run would follow; change nothing.")(f)
        f = click.option("--all", "all_kernels", is_flag=True, help="Every installed kernel (not with --kernel).")(f)
        f = click.option("--kernel", "kernel", default=None, metavar="KERNEL",
                         help="Kernel release [default: the running kernel].")(f)
        return f

    def _refuse_both(kernel, all_kernels, op):
        if kernel and all_kernels:     # before the daemon is asked or anything is recorded (executor says the same)
            from spark_memsaver.errors import UsageError
            raise UsageError("--kernel and --all exclude each other",
                             remedy=f"Give one: 'sudo spark-memsaver {op} --kernel {kernel}' for that kernel, or "
                                    f"'sudo spark-memsaver {op} --all' for every kernel.")

    @cli.command("install")
    @_kernels_opts
    @click.pass_obj
    def install_cmd(obj, kernel, all_kernels, dry_run, as_json):
        """Build if needed and install the override; verify it is the selected nvidia-uvm."""
        _refuse_both(kernel, all_kernels, "install")
        doc = _run_cli(obj, "install", as_json, kernel=kernel, all_kernels=all_kernels,
                       **({"dry_run": True} if dry_run else {}))
        if dry_run:
            return _print_plan(doc, as_json)
        doc["notes"] = hazard_notes(obj.host)
        doc["next"] = next_step(obj)
        if as_json:
            click.echo(json.dumps(doc, indent=2, default=str))
        else:
            rows = [(r["kernel"], "installed", f"{r['selected']} (NVIDIA {r['driver']}, {PACKAGE}/"
                     f"{r['dkms_version']}); initramfs: {r['initramfs']}") for r in doc["installed"]]
            rows += [(s["kernel"], f"refused [{s.get('code', '?')}]", f"{s['reason']}; remedy: {s.get('remedy', '')}")
                     for s in doc["skipped"]]
            for ln in kernel_table(rows):
                click.echo(ln)
            for ln in hazard_note_lines(doc["notes"]):
                click.echo(ln)
            if doc["next"]:
                click.echo(f"next: {doc['next']}")
        return 0

    @cli.command("remove")
    @_kernels_opts
    @click.pass_obj
    def remove_cmd(obj, kernel, all_kernels, dry_run, as_json):
        """Remove the override; restore and verify the stock nvidia-uvm."""
        _refuse_both(kernel, all_kernels, "remove")
        doc = _run_cli(obj, "remove", as_json, kernel=kernel, all_kernels=all_kernels,
                       **({"dry_run": True} if dry_run else {}))
        if dry_run:
            return _print_plan(doc, as_json)
        if as_json:
            click.echo(json.dumps(doc, indent=2, default=str))
        else:
            rows = [(r["kernel"], "stock selected" if r.get("steps", ["?"])[0] != "restore-stock" or r["actions"] or
                     any(d["kernel"] == r["kernel"] for d in doc["removed"]) else "stock (nothing of ours)",
                     f"{r['selected']}" + (f" ({'; '.join(r['actions'])})" if r["actions"] else ""))
                    for r in doc["restored"]]
            for ln in kernel_table(rows) if rows else ["nothing of ours was found on any kernel"]:
                click.echo(ln)
            r = doc.get("reload")
            if r:
                click.echo("nvidia-uvm reloaded: the stock module is loaded" if r.get("ok") else
                           f"nvidia-uvm not reloaded ({r.get('skipped') or r.get('error')}): ours stays loaded until "
                           "nvidia-uvm is reloaded or the node reboots")
        return 0
