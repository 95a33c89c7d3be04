"""CLI: activate, rollback and reconcile (click commands only; the work is done by act/executor.perform)."""

from __future__ import annotations

from spark_memsaver.decide import plan as rc
from spark_memsaver.errors import EXIT_FAILED
from spark_memsaver.errors import MemsaverError
from spark_memsaver.host import events
import json
import os
import re
import sys
from spark_memsaver.act.executor import perform
from spark_memsaver.cli.build import act, plan_lines, step_lines


def _emit(doc: dict, as_json: bool, lines: list[str]) -> None:
    import click
    for p in _PRINTERS:
        p.done()
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
    else:
        for ln in lines:
            click.echo(ln)


_PRINTERS: list = []
COUNTED = re.compile(r"^(?P<stage>.*): (?P<n>\d+)/(?P<total>\d+) files$")


class ProgressLines:
    """The progress printer of reconcile and the package-manager doors (stderr).

    A TTY gets one live line (\\r updates). Anything else (apt, term.log, the journal) gets one line per
    stage and, for a counted stage ('compiling nvidia-uvm: 61/122 files', act/build.py), a line per 10 %
    step of its count at most; never the same line twice in a row."""

    def __init__(self, stream=None, tty: bool | None = None, prefix: str = ""):
        self.stream = stream
        self.tty = tty
        self.prefix = prefix
        self.last = None            # the last line written
        self.stage = None           # (stage, total) of the last counted line, and its 10 % step
        self.step = -1
        self.live = False
        _PRINTERS.append(self)

    def _out(self):
        return self.stream or sys.stderr

    def __call__(self, *args) -> None:
        msgs = [a for a in args if isinstance(a, str)]
        if not msgs:
            return
        msg = msgs[-1].strip()
        out = self._out()
        tty = out.isatty() if self.tty is None else self.tty
        m = COUNTED.match(msg)
        key = (m.group("stage"), int(m.group("total"))) if m else None
        if tty:
            # counts of the same stage update the live line in place; a new stage starts a new line
            same = key is not None and key == self.stage
            if msg != self.last:
                out.write(("\r\033[K" if same else "\n" if self.live else "") + self.prefix + msg)
                out.flush()
            self.live, self.last, self.stage = True, msg, key
            return
        if m:
            step = min(10, int(m.group("n")) * 10 // max(1, key[1]))
            if key == self.stage and step <= self.step:
                return
            self.step = step
        else:
            self.step = -1
        self.stage = key
        if msg == self.last:
            return
        self.last = msg
        out.write(self.prefix + msg + "\n")
        out.flush()

    def done(self) -> None:
        """End a live line (before the command's own output)."""
        if self.live:
            self._out().write("\n")
            self._out().flush()
            self.live = False


def register(root) -> None:
    import click

    progress = ProgressLines()

    @root.command("reconcile")
    @click.option("--json", "as_json", is_flag=True, help="Print the steps (or the plan) as JSON.")
    @click.option("--dry-run", is_flag=True, help="Print the plan; change nothing.")
    @click.option("--kernel", "kernels", multiple=True, metavar="KERNEL",
                  help="Only this kernel release (repeatable).")
    @click.option("--no-rebuild", is_flag=True, help="Only the safety steps (removals, records).")
    @click.option("--apt-pre-install", "apt_pre", is_flag=True, hidden=True,
                  help="APT DPkg::Pre-Install-Pkgs door: read the v3 package list from $APT_HOOK_INFO_FD/stdin.")
    @click.option("--hook", "hook", default=None, hidden=True,
                  help="Called by a package-manager door (apt-post-invoke, dpkg-trigger, kernel-postinst): "
                       "never fails the caller.")
    @click.pass_obj
    def reconcile_cmd(obj, as_json, dry_run, kernels, no_rebuild, apt_pre, hook):
        """Make every kernel safe: remove overrides built for another driver, finish or undo interrupted
        operations, rebuild where the driver is supported. Exit 0 done, 2 bad usage (e.g. a --kernel that is not
        installed: unknown-kernel), 3 a step failed."""
        # a package-manager door writes into apt's output and term.log: lines, never a live \r line
        say = None if as_json else (ProgressLines(tty=False, prefix="spark-memsaver: ") if (apt_pre or hook)
                                    else progress)
        if not dry_run and not (apt_pre or hook):   # no root: refused before any lock, as typed with sudo
            from spark_memsaver.act.executor import require_root
            from spark_memsaver.cli.build import _as_typed_with_sudo
            require_root(obj.host, "reconcile", _as_typed_with_sudo())
        config = obj.safety_config()    # toward stock never waits for a valid config file (issue 35)
        if apt_pre:
            fd = int(os.environ.get("APT_HOOK_INFO_FD", "0") or 0)
            text = os.fdopen(os.dup(fd), errors="replace").read() if fd else sys.stdin.read()
            try:
                doc = perform("apt-pre-install", obj.host, config, progress=say, text=text)
            except MemsaverError as e:  # never abort APT: the post step, the daemon and the guard follow
                doc = {"ok": False, "error": e.to_dict(), "steps": []}
                click.echo(f"spark-memsaver: pre-install check failed: {e.message}", err=True)
            from spark_memsaver.decide.apt import door_line
            _emit(doc, as_json, [f"spark-memsaver: {door_line(s)}" for s in doc["steps"]]
                  + [f"spark-memsaver: {n['message']}" for n in doc.get("notes", [])])
            return 0
        if hook:
            try:
                # a kernel hook names its kernel: only that kernel is built (never another kernel's rebuild)
                doc = perform("reconcile", obj.host, config, progress=say, inside_dpkg=True,
                              kernels=list(kernels) or None)
            except MemsaverError as e:
                doc = {"ok": False, "acting": 0, "error": e.to_dict(), "steps": []}
                click.echo(f"spark-memsaver ({hook}): {e.message}", err=True)
            events.note(obj.host, "hook", source=hook, acting=doc.get("acting"), ok=doc.get("ok"))
            shown = [x for x in doc["steps"] if x["action"] in rc.ACTING or x["action"] == "stay-stock"]
            _emit(doc, as_json, ([f"spark-memsaver ({hook}):"] + step_lines(shown)) if shown else [])
            return 0
        doc = perform("reconcile", obj.host, config, progress=say, kernels=list(kernels) or None,
                      rebuild=False if no_rebuild else None, dry_run=dry_run)
        from spark_memsaver.cli.build import hazard_note_lines, hazard_notes
        doc["notes"] = hazard_notes(obj.host)
        _emit(doc, as_json, (["plan (dry run):"] if dry_run else ["reconcile:"]) + step_lines(doc["steps"])
              + ([] if doc["steps"] else ["  nothing to do"]) + hazard_note_lines(doc["notes"]))
        return 0 if doc.get("ok", True) else EXIT_FAILED

    @root.command("rollback")
    @click.option("--json", "as_json", is_flag=True, help="Print the result (or the plan) as JSON.")
    @click.option("--dry-run", is_flag=True, help="Print the plan the rollback would follow; change nothing.")
    @click.option("--kernel", default=None, metavar="KERNEL", help="Only this kernel release [default: every kernel "
                  "where ours is selected].")
    @click.option("--reason", default="requested by the administrator", show_default=True, metavar="REASON",
                  help="Why, recorded and shown by 'status' (automation never undoes a rollback; 'install' does).")
    @click.pass_obj
    def rollback_cmd(obj, as_json, dry_run, kernel, reason):
        """Return to the stock nvidia-uvm (verified) and record why; status then says rolled-back."""
        # the D-Bus Rollback takes no kernel: a rollback of one kernel is done here (root) or refused
        doc = act(obj, "rollback", None if as_json else progress, reason=reason, kernel=kernel,
                  _local_only=bool(kernel) or dry_run, **({"dry_run": True} if dry_run else {}))
        if dry_run:
            _emit(doc, as_json, plan_lines(doc))
            return 0
        lines = ["nothing to roll back: the stock nvidia-uvm is selected"] if doc["nothing_to_do"] else \
            [f"{d['kernel']}: {'stock selected' if d['ok'] else 'FAILED: ' + d['error']['message']}"
             for d in doc["kernels"]]
        r = doc.get("reload")
        if r:
            lines.append("nvidia-uvm reloaded" if r.get("ok") else f"nvidia-uvm not reloaded: {r.get('skipped') or r.get('error')}")
        _emit(doc, as_json, lines)
        return 0 if doc["ok"] else EXIT_FAILED

    @root.command("activate")
    @click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
    @click.option("--dry-run", is_flag=True, help="Say what would be run; change nothing.")
    @click.pass_obj
    def activate_cmd(obj, as_json, dry_run):
        """Load our installed nvidia-uvm now, if no process uses /dev/nvidia-uvm (never forced).
        Exit 0 active, 1 refused or deferred to next boot, 3 failed."""
        doc = act(obj, "activate", None if as_json else progress, dry_run=dry_run, _local_only=dry_run)
        if doc.get("already") and doc.get("packing") is False:
            lines = [f"already loaded, packing nothing: {doc.get('path')} (srcversion {doc.get('srcversion')}); "
                     "'spark-memsaver status' says why and what to do"]
        elif doc.get("already"):
            lines = [f"already active: {doc.get('path')} (srcversion {doc.get('srcversion')})"]
        elif doc.get("activated"):
            lines = [f"active: {doc.get('path')} (srcversion {doc.get('srcversion')})"]
        elif doc.get("dry_run"):
            lines = ["would run: " + "; ".join(" ".join(c) for c in doc["would_run"])]
        else:
            lines = [doc["message"]]
        _emit(doc, as_json, lines)
        return 0 if doc.get("activated") or doc.get("dry_run") else 1
