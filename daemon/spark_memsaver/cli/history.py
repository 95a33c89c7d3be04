"""CLI: history (click command only; the files are read by service/history.py). parse_since is shared with
cli/events.py."""

from __future__ import annotations

import calendar
import json
import re
import time

from spark_memsaver.errors import UsageError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str, now: float | None = None) -> float:
    """'90m', '2h', '7d', '1h30m' (ago), or a UTC time '2026-12-01T10:00:00Z' / '2026-12-01 10:00' /
    '2026-12-01' -> epoch seconds."""
    now = time.time() if now is None else now
    t = text.strip()
    if re.fullmatch(r"(\d+[smhdw])+", t):
        return now - sum(int(n) * _UNITS[u] for n, u in re.findall(r"(\d+)([smhdw])", t))
    for fmt in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M",
                "%Y-%m-%dT%H:%M", "%Y-%m-%d"):
        try:
            return float(calendar.timegm(time.strptime(t, fmt)))
        except ValueError:
            pass
    raise UsageError(f"--since {text!r} is neither a duration nor a time",
                     remedy="Give a duration such as 90m, 2h, 7d or 1h30m, or a UTC time such as "
                            "2026-12-01T10:00:00Z or '2026-12-01 10:00'.")


def _gib(v) -> str:
    try:
        return f"{v / 1073741824:.2f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "n/a"
    except OverflowError:
        return "n/a"


def register(cli) -> None:
    import click

    @cli.command()
    @click.option("--since", "since", metavar="DURATION|TIME", default=None,
                  help="Only samples newer than this: a duration ago (90m, 2h, 7d) or a UTC time.")
    @click.option("--json", "as_json", is_flag=True, help="Print the samples as JSON (bytes).")
    @click.option("--boot", "boot", type=click.IntRange(max=0), default=None, metavar="N",
                  help="The black box of a boot instead: 0 this one, -1 the one before (1 Hz samples under "
                       "memory pressure, kept through a power cycle).")
    @click.pass_obj
    def history(obj, since, as_json: bool, boot):
        """Show the monitoring samples (memory and page-table backing over time).

        Read from /var/lib/spark-memsaver/history/ (kept 7 days at the sampling interval); spark-memsaverd
        is asked only when that directory is absent.
        """
        from spark_memsaver.service import history as hist

        t0 = parse_since(since) if since else None
        if boot is not None:
            return _black_box(obj, boot, t0, as_json)
        skipped = 0
        if hist.exists(obj.host):
            samples, skipped = hist.read_counted(obj.host, since=t0)
        elif obj.root == "/":
            from spark_memsaver.cli.client import get_history
            samples = [s for s in get_history() if isinstance(s, dict) and hist.valid_time(s.get("time"))
                       and (t0 is None or s["time"] >= t0)]
        else:
            samples = []
        if skipped:
            click.echo(f"note: {skipped} unreadable lines skipped in {obj.host.path(hist.paths.SAMPLES_DIR)}",
                       err=True)
        if as_json:
            click.echo(json.dumps(samples, indent=2))
            return 0
        if not samples:
            click.echo("no samples" + (f" since {since}" if since else "") + ".")
            return 0
        click.echo(f"{'TIME (UTC)':<20} {'AVAILABLE GiB':>13} {'BACKING GiB':>11} {'SAVED GiB':>9}  REASON")
        for s in samples:
            t = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s.get("time", 0)))
            click.echo(f"{t:<20} {_gib(s.get('mem_available')):>13} {_gib(s.get('backing_bytes')):>11} "
                       f"{_gib(s.get('saved_bytes')):>9}  {s.get('reason', '')}")
        return 0


def _black_box(obj, boot: int, t0, as_json: bool) -> int:
    """history --boot N: the black box's samples of that boot (service/blackbox.py), oldest first."""
    import click

    from spark_memsaver.service import blackbox
    bid, samples = blackbox.read_boot(obj.host, boot)
    samples = [s for s in samples if t0 is None or (isinstance(s.get("time"), (int, float)) and s["time"] >= t0)]
    if as_json:
        click.echo(json.dumps({"boot": boot, "boot_id": bid, "samples": samples}, indent=2))
        return 0
    if not samples:
        click.echo(f"no black-box samples for boot {boot}" + (f" ({bid})" if bid else "")
                   + ": recorded only under memory pressure.")
        return 0
    click.echo(f"boot {boot} ({bid}): {len(samples)} samples under memory pressure")
    click.echo(f"{'TIME (UTC)':<20} {'FREE GiB':>8} {'AVAILABLE GiB':>13} {'CACHE GiB':>9} {'PSI some10':>10} "
               f"{'full10':>6}")
    for s in samples:
        t = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s.get("time") or 0))
        click.echo(f"{t:<20} {_gib(s.get('mem_free')):>8} {_gib(s.get('mem_available')):>13} "
                   f"{_gib(s.get('cached')):>9} {s.get('psi_some_avg10') or 0:>10.2f} {s.get('psi_full_avg10') or 0:>6.2f}")
    return 0
