"""CLI: events (click command only; the log is read by host/events.py)."""

from __future__ import annotations

import json

from spark_memsaver.cli.history import parse_since


def register(cli) -> None:
    import click

    @cli.command()
    @click.option("--since", "since", metavar="DURATION|TIME", default=None,
                  help="Only events newer than this: a duration ago (90m, 2h, 7d) or a UTC time.")
    @click.option("--boot", "boot", type=click.IntRange(max=0), default=None, metavar="N",
                  help="Only the events of one boot: 0 this one, -1 the one before (numbered as history --boot "
                       "numbers them), e.g. what happened before a wedge and a power cycle.")
    @click.option("--json", "as_json", is_flag=True, help="Print the events as JSON.")
    @click.pass_obj
    def events(obj, since, boot, as_json: bool):
        """Show lifecycle events: builds, installs, removals, activations, rollbacks, reconciles, the APT door's
        runs, key enrollment requests and their cancellations, and the steps, hook runs and rollback records
        inside them.

        Read from /var/lib/spark-memsaver/events.jsonl (append-only, bounded; an older install's history.jsonl
        is read with it until it is folded in); no daemon needed.
        """
        from spark_memsaver.host import events as ev

        t0 = parse_since(since) if since else None
        # --boot numbers boots over the whole log (host/boots.py), whatever --since shows: the log is read once
        rows, skipped = ev.read_counted(obj.host, since=t0 if boot is None else None)
        if skipped:
            click.echo(f"note: {skipped} unreadable lines skipped in {obj.host.path(ev.EVENTS)}", err=True)
        if boot is not None:
            rows, which = _of_boot(obj.host, rows, boot)
            rows = [e for e in rows if t0 is None or (ev.epoch(e["time"]) or 0) >= t0]
            if not as_json:
                click.echo(which)
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return 0
        if not rows:
            click.echo("no events" + (f" since {since}" if since else "") + ".")
            return 0
        click.echo(f"{'TIME (UTC)':<20}  {'OPERATION':<15} {'RESULT':<7} {'KERNEL':<28} DETAIL")
        for e in rows:      # host/events.py read only well-formed events: time and op are strings
            result = "-" if "ok" not in e else "ok" if e["ok"] else "failed"   # a rollback record has no result
            click.echo(f"{e['time'].replace('T', ' ').rstrip('Z'):<20}  {e['op']:<15} "
                       f"{result:<7} {str(e.get('kernel') or '-'):<28} {_detail(e)}".rstrip())
        return 0


def _of_boot(host, rows: list[dict], boot: int) -> tuple[list[dict], str]:
    """The events of ``rows`` (the whole log) written in boot ``boot`` (host/boots.py numbers boots), and a line
    saying which boot that is. Events of a version that did not record boots belong to none: the line counts them."""
    from spark_memsaver.host import boots
    bid = boots.resolve(host, boot, rows)
    mine = [e for e in rows if bid is not None and e.get("boot") == bid]
    unknown = sum(1 for e in rows if "boot" not in e)
    which = (f"boot {boot} ({bid})" if bid else f"boot {boot}: no record of it") + \
        (f"; {unknown} older events carry no boot id and are left out" if unknown else "")
    return mine, which


def _detail(e: dict) -> str:
    """An operation's error or steps; a step's action and why; a hook's source; a rollback record's reason."""
    if e.get("error"):
        return str(e["error"].get("message") or e["error"].get("code") or "")
    if e.get("steps"):
        return ", ".join(f"{s.get('action')}" + (f" {s['kernel']}" if s.get("kernel") else "") for s in e["steps"])
    parts = [str(e[k]) for k in ("action", "source", "reason") if e.get(k) not in (None, "")]
    if e.get("removed"):
        parts.append("removed " + " ".join(e["removed"]))
    return ": ".join(parts)
