"""CLI: history (click commands only; the work is done in spark_memsaver.cli.client)."""

from __future__ import annotations

import json
from spark_memsaver.cli.client import (get_history)


def register(cli) -> None:
    import click

    @cli.command()
    @click.option("--json", "as_json", is_flag=True, help="Print the samples as JSON.")
    def history(as_json: bool):
        """Show the daemon's monitoring samples (memory and page-table backing over time)."""
        samples = get_history()
        if as_json:
            click.echo(json.dumps(samples, indent=2))
            return 0
        import time as _t

        def mib(v):
            return f"{v / 1048576:10.1f}" if isinstance(v, (int, float)) else f"{'n/a':>10}"
        click.echo(f"{'time':<20} {'available MiB':>13} {'backing MiB':>11} {'saved MiB':>10}  reason")
        for s in samples:
            t = _t.strftime("%Y-%m-%d %H:%M:%S", _t.localtime(s.get("time", 0)))
            click.echo(f"{t:<20} {mib(s.get('mem_available')):>13} {mib(s.get('backing_bytes')):>11} "
                       f"{mib(s.get('saved_bytes')):>10}  {s.get('reason', '')}")
        return 0
