"""CLI: validate (click commands only; the work is done in spark_memsaver.validate.command)."""

from __future__ import annotations

import json

from spark_memsaver.validate.command import (DEFAULT_DURATION, DEFAULT_MAX_GIB, DEFAULT_THREADS, HEADROOM_FRACTION, MAX_GIB_RANGE, _print, validate)


def register(cli) -> None:
    import click

    @cli.command("validate")
    @click.option("--max-gib", type=float, default=DEFAULT_MAX_GIB, show_default=True, metavar="GIB",
                  help=f"Most memory to allocate, GiB ({MAX_GIB_RANGE[0]:g}-{MAX_GIB_RANGE[1]:g}); never more than "
                       f"{HEADROOM_FRACTION:.0%} of what is free.")
    @click.option("--duration", type=float, default=DEFAULT_DURATION, show_default=True, metavar="SECONDS",
                  help="Seconds of allocation rounds before the peak (1-3600).")
    @click.option("--threads", type=int, default=DEFAULT_THREADS, show_default=True, metavar="N", help="Worker threads (1-64).")
    @click.option("--json", "as_json", is_flag=True, help="Print the JSON report.")
    @click.option("--report", "report_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
                  help="Also write the JSON report to this file.")
    @click.option("--dry-run", is_flag=True,
                  help="Print what the run would do on this node (CUDA is loaded, never initialised); run nothing.")
    @click.pass_obj
    def validate_cmd(obj, max_gib, duration, threads, as_json, report_path, dry_run):
        """Qualify this node's nvidia-uvm with real GPU work (CUDA driver API) and keep the evidence.

        Exit status: 0 passed, 1 failed or refused (too little free memory), 2 bad usage,
        4 not applicable (no libcuda / no GPU).
        """
        if dry_run:
            from spark_memsaver.validate import dryrun
            p = dryrun.plan(obj.host, max_gib, duration, threads, report_path)
            click.echo(json.dumps(p, indent=2) if as_json else dryrun.render(p))
            return p["exit_code"]
        rep = validate(obj.host, max_gib, duration, threads, report_path)
        return _print(rep, as_json, click.echo)
