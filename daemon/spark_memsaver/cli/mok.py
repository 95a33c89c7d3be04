"""CLI: the mok group (click commands only; the work is done in act/enroll.py, observe/mok.py, decide/mok.py)."""

from __future__ import annotations

from spark_memsaver.errors import UsageError
import json
import os
import stat
import sys
from spark_memsaver.act.enroll import (_refuse_for, _require_live_root, cancel_enrollment, check_console_timeout,
                                       plan_cancel, plan_enrollment, request_enrollment)
from spark_memsaver.decide.mok import exit_code
from spark_memsaver.world import secure_boot
from spark_memsaver.report.mok import render_text


def _argv_text(argv: list) -> str:
    return " ".join(argv)


def _dry_enroll_text(plan: dict) -> list[str]:
    c = plan["certificate"]
    out = [f"Dry run: would request enrollment of {c.get('subject')}", f"  sha256 {c.get('sha256')}",
           f"  sha1   {c.get('sha1')} (MokManager's 'View key' shows this one)", "would run:"]
    out += [f"  {_argv_text(a)}" for a in plan["would_run"]]
    out += [f"then 'spark-memsaver mok status' would show {plan['state_after']} (now: {plan['state_now']}), and the "
            "console steps at the next boot."]
    out += [f"note: {n}" for n in plan["notes"]]
    out.append("Nothing was changed: no password was asked and mokutil was not called.")
    return out


def _dry_cancel_text(plan: dict) -> list[str]:
    if not plan["pending"]:
        return [f"Dry run: nothing to cancel: {plan['message']}; mokutil would not be called."]
    out = ["Dry run: would drop the pending enrollment request (MokNew, MokAuth)", "would run:"]
    out += [f"  {_argv_text(a)}" for a in plan["would_run"]]
    out += [f"note: {n}" for n in plan["notes"]]
    out.append("Nothing was changed: mokutil was not called.")
    return out


def _read_password(password_file: str | None, password_stdin: bool) -> str:
    import click

    if password_file and password_stdin:
        raise UsageError("give either --password-file or --password-stdin, not both")
    if password_file:
        try:
            st = os.stat(password_file)
            with open(password_file, encoding="utf-8") as f:
                pw = f.readline().rstrip("\r\n")
        except (OSError, UnicodeError) as e:
            raise UsageError(f"cannot read the password file {password_file}: {getattr(e, 'strerror', e) or e}")
        if stat.S_IMODE(st.st_mode) & 0o077:
            click.echo(f"warning: {password_file} is readable by others; delete it after enrolling", err=True)
        return pw
    if password_stdin or not sys.stdin.isatty():
        return sys.stdin.readline().rstrip("\r\n")
    return click.prompt("One-time MOK password (you will type it again at the console)", hide_input=True,
                        confirmation_prompt=True)


def register(cli) -> None:
    import click

    @cli.group("mok")
    def mok_group():
        """Secure Boot / MOK: is the module-signing key trusted at boot; enroll it."""

    cert_opt = click.option("--cert", "cert", type=click.Path(dir_okay=False), default=None,
                            help="Certificate to check (PEM or DER) [default: DKMS's mok_certificate, else the "
                                 "distribution default].")

    @mok_group.command("status")
    @cert_opt
    @click.option("--json", "as_json", is_flag=True, help="Print the secure_boot section as JSON.")
    @click.pass_obj
    def status_cmd(obj, cert, as_json):
        """Show the Secure Boot / MOK state of the signing key.

        Exit status: 0 enrolled or not needed, 1 not loadable yet (no-key, not-enrolled, pending-*, blocked),
        2 unknown."""
        sb = secure_boot(obj.host, cert=cert, config=None if cert else obj.safety_config())
        click.echo(json.dumps(sb, indent=2) if as_json else render_text(sb))
        return exit_code(sb)

    @mok_group.command("enroll")
    @cert_opt
    @click.option("--password-file", type=click.Path(dir_okay=False), default=None,
                  help="Read the one-time password from the first line of this file.")
    @click.option("--password-stdin", is_flag=True, help="Read the one-time password from one line of stdin.")
    @click.option("--wait-at-console", is_flag=True,
                  help="Also run 'mokutil --timeout -1': MokManager opens its menu and waits instead of a 10 s "
                       "countdown.")
    @click.option("--console-timeout", type=int, default=None, metavar="SECONDS",
                  help="Also run 'mokutil --timeout SECONDS' (1..32767): MokManager counts down this long before it "
                       "boots on without enrolling (default: shim's 10 s).")
    @click.option("--dry-run", is_flag=True, help="Print what would be requested (the mokutil commands, the "
                  "certificate's fingerprints); ask no password, call no mokutil, change nothing.")
    @click.option("--json", "as_json", is_flag=True, help="Print the result (or the error) as JSON.")
    @click.pass_obj
    def enroll_cmd(obj, cert, password_file, password_stdin, wait_at_console, console_timeout, dry_run, as_json):
        """Request enrollment of the signing key at the next boot (mokutil --import).

        Exit status: 0 requested (or, with --dry-run, would be); 1 refused (not needed, no key, already
        enrolled/pending, blocked, unknown); 2 bad usage or password; 3 mokutil failed."""
        if password_file and password_stdin:    # bad usage before anything, --dry-run included
            raise UsageError("give either --password-file or --password-stdin, not both")
        config = None if cert else obj.config
        if dry_run:                    # the same refusals as the real run, then what it would ask mokutil for
            plan = plan_enrollment(obj.host, config, cert=cert, wait_at_console=wait_at_console,
                                   console_timeout=console_timeout)
            click.echo(json.dumps(plan, indent=2) if as_json else "\n".join(_dry_enroll_text(plan)))
            return 0
        check_console_timeout(wait_at_console, console_timeout)
        before = secure_boot(obj.host, cert=cert, config=config)
        _refuse_for(before)                      # refuse before asking for a password
        _require_live_root(obj.host, "mok enroll")
        pw = _read_password(password_file, password_stdin)
        res = request_enrollment(obj.host, config, pw, cert=cert, wait_at_console=wait_at_console,
                                 console_timeout=console_timeout)
        if as_json:
            click.echo(json.dumps(res, indent=2))
            return 0
        c = res["certificate"]
        click.echo(f"Enrollment requested for {c['subject']}\n  sha256 {c['sha256']}\n  sha1   {c['sha1']} "
                   "(MokManager's 'View key' shows this one)")
        for w in res["warnings"]:
            click.echo("warning: " + w, err=True)
        click.echo("\nNow 'spark-memsaver mok status' shows: pending-enroll. At the next boot, at the console:")
        for i, s in enumerate(res["console_steps"], 1):
            click.echo(f"  {i}. {s}")
        click.echo("\nAfter that reboot, 'mok status' shows: enrolled, and our nvidia-uvm is active by itself. If "
                   "the prompt was missed (timeout, 'Continue boot', 3 wrong passwords) the request is gone, the stock "
                   "nvidia-uvm stays in use and it shows not-enrolled: run 'sudo spark-memsaver mok enroll' again.")
        return 0

    @mok_group.command("cancel")
    @cert_opt
    @click.option("--dry-run", is_flag=True, help="Print whether a request is pending and the mokutil command "
                  "that would drop it; call no mokutil, change nothing.")
    @click.option("--json", "as_json", is_flag=True, help="Print the result (or the error) as JSON.")
    @click.pass_obj
    def cancel_cmd(obj, cert, dry_run, as_json):
        """Drop the pending enrollment request (mokutil --revoke-import).

        Exit status: 0 cancelled or nothing pending (or, with --dry-run, would be); 1 refused; 3 mokutil
        failed."""
        if dry_run:
            plan = plan_cancel(obj.host, None if cert else obj.config, cert)
            click.echo(json.dumps(plan, indent=2) if as_json else "\n".join(_dry_cancel_text(plan)))
            return 0
        res = cancel_enrollment(obj.host, None if cert else obj.config, cert)
        if as_json:
            click.echo(json.dumps(res, indent=2))
        else:
            click.echo("Enrollment request cancelled." if res["cancelled"] else "Nothing to cancel: "
                       + res["message"] + ".")
        return 0
