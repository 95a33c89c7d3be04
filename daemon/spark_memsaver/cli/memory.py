"""CLI: memory (where this node's memory goes; click command only: observe/memory reads, decide/memory decides,
report/memory writes the text)."""

from __future__ import annotations


def register(cli) -> None:
    import click

    @cli.command("memory")
    @click.option("--json", "as_json", is_flag=True, help="Print the JSON document (schema 1, docs/memory.md).")
    @click.option("--need", "need", default=None, metavar="SIZE",
                  help="Say whether an allocation of SIZE (e.g. 100G) fits now, after reclaim, or not at all.")
    @click.option("--watch", "watch", type=click.FloatRange(0.5, 3600), default=None, metavar="SECONDS",
                  help="Print again every SECONDS until interrupted (JSON: one document a line).")
    @click.pass_obj
    def memory_cmd(obj, as_json, need, watch):
        """Show where this node's memory goes: rows that add up to MemTotal, each with its source; what is free
        now (what CUDA sees on GB10) and after reclaim; free blocks by size; pressure; and whether an
        allocation fits.

        Exit status: 0 shown (and, with --need, it fits now or after reclaim), 1 with --need it does not fit,
        2 bad usage or /proc/meminfo not readable.
        """
        import json
        import time

        from spark_memsaver.decide import memory as decide
        from spark_memsaver.errors import InspectionError
        from spark_memsaver.observe import memory as observe
        from spark_memsaver.report.memory import render_text

        need_bytes = decide.parse_size(need) if need is not None else None
        while True:
            doc = decide.model(observe.read(obj.host), need_bytes)
            if doc["total_bytes"] is None:
                raise InspectionError("cannot read /proc/meminfo under " + str(obj.host.root),
                                      remedy="Give --root a running system's root or a fixture with proc/meminfo.")
            if as_json:
                click.echo(json.dumps(doc, indent=None if watch else 2))
            else:
                click.echo(render_text(doc))
            if watch is None:
                break
            if not as_json:
                click.echo("")
            try:
                time.sleep(watch)
            except KeyboardInterrupt:       # Ctrl-C ends a watch: not an error
                return 0
        return 1 if doc["verdict"]["fits"] == "no" else 0

    @cli.command("reclaim")
    @click.option("--need", "need", required=True, metavar="SIZE",
                  help="What the launch needs free (e.g. 100G): reclaim the difference from MemFree.")
    @click.option("--dry-run", is_flag=True, help="Print what would be written and why; change nothing.")
    @click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
    @click.pass_obj
    def reclaim_cmd(obj, need, dry_run, as_json):
        """Free what a launch needs before it starts: on GB10, CUDA counts only MemFree as free.

        Reclaims need - MemFree (and a margin) through cgroup v2's memory.reclaim where it is available, else
        with drop_caches=1 (which drops the whole clean page cache: more than needed, and it says so); then
        compacts when less than the need lies in free blocks of 2 MiB or more. For a unit:
        ExecStartPre=spark-memsaver reclaim --need 100G (docs/memory.md).

        Exit status: 0 the need is free, 1 it is not (more than is reclaimable: "cannot: ..."; or less was
        freed), 2 bad usage.
        """
        import json
        import os

        from spark_memsaver.act import reclaim as act
        from spark_memsaver.decide import memory as decide

        need_bytes = decide.parse_size(need)
        result = None
        if not dry_run and obj.host.is_live and os.geteuid() != 0:
            from spark_memsaver.cli import client
            job = client.maybe_call_job("PrepareLaunch", need_bytes)
            if job is None:
                import shlex
                import sys

                from spark_memsaver.errors import NotPermitted
                raise NotPermitted("'reclaim' writes the kernel's memory knobs and needs root; spark-memsaverd is "
                                   "not running to ask on your behalf",
                                   remedy="Run it as root: 'sudo spark-memsaver "
                                          + " ".join(shlex.quote(a) for a in sys.argv[1:]) + "'.")
            result = job.get("result")
        if result is None:
            result = act.reclaim(obj.host, need_bytes, dry_run=dry_run)
        click.echo(json.dumps(result, indent=2) if as_json else act.text(result))
        return 0 if dry_run or result.get("met") else 1
