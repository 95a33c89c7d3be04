"""CLI: metrics (click command only; the text is made by spark_memsaver.report.metrics)."""

from __future__ import annotations


def register(cli) -> None:
    import click

    @cli.command("metrics")
    @click.option("--output", "output", type=click.Path(dir_okay=False), default=None,
                  help="Write the text atomically to this file (e.g. a node_exporter textfile) instead of stdout.")
    @click.pass_obj
    def metrics_cmd(obj, output):
        """Print the Prometheus exposition of this node's status.

        \b
        The series (README.md), alert rules and a Grafana dashboard:
          /usr/share/doc/spark-memsaver/examples/monitoring/

        For cron or node_exporter's textfile collector; spark-memsaverd writes the same text to
        /var/lib/prometheus/node-exporter/spark-memsaver.prom by itself when that directory exists.
        """
        from spark_memsaver.report.document import status_of as run_status
        from spark_memsaver.report.metrics import exposition

        from spark_memsaver.host import events

        doc, _ = run_status(obj.host, obj.safety_config())   # a bad file: a finding, not a stop
        from spark_memsaver.decide import memory as decide_memory
        from spark_memsaver.observe import memory as observe_memory
        mem = decide_memory.model(observe_memory.read(obj.host, gpu=False, blocks=False, pagetypes=False))
        text = exposition(doc, events=events.read(obj.host), memory_doc=mem)
        if output is None:
            click.echo(text, nl=False)
            return 0
        from spark_memsaver.host.fsutil import atomic_write
        try:
            atomic_write(output, text, 0o644)
        except PermissionError as e:      # not root (or not the file's owner): refused, never internal-error
            import shlex
            import sys
            from spark_memsaver.errors import NotPermitted
            raise NotPermitted(f"cannot write {output}: {e.strerror}",
                               remedy="Run it as a user who may write there: 'sudo spark-memsaver "
                                      + " ".join(shlex.quote(a) for a in sys.argv[1:]) + "'.")
        except OSError as e:
            from spark_memsaver.errors import UsageError
            raise UsageError(f"cannot write {output}: {e.strerror or e}",
                             remedy="Give a file in an existing, writable directory with --output.")
        return 0
