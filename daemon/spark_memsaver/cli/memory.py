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
            time.sleep(watch)
        return 1 if doc["verdict"]["fits"] == "no" else 0
