"""spark-memsaver: the command-line interface (click), which the entry point (cli/entry.py) hands every command line
that the lean status entry (cli/status.py) does not read. Exit codes: spark_memsaver/exitcodes.py."""

from __future__ import annotations

import json
import logging
import sys

import click

from spark_memsaver import __version__
from spark_memsaver.cli import status as _status
from spark_memsaver.cli.status import (Context, emit_error, internal_error, setup_logging,  # noqa: F401
                                       stdout_gone as _stdout_gone, wants_json as _wants_json)
from spark_memsaver.errors import EXIT_FAILED, EXIT_PROBLEM, EXIT_USAGE, MemsaverError


# The other commands live in their own modules of this package, each adding itself with register(group).
# A module is imported when one of its commands runs (or when --help lists them all): `status` pays for
# none of them.
LAZY_COMMANDS = {"patch": "patch", "build": "build", "install": "build", "remove": "build", "mok": "mok",
                 "reconcile": "lifecycle", "rollback": "lifecycle", "activate": "lifecycle",
                 "validate": "validate", "history": "history", "events": "events", "metrics": "metrics",
                 "memory": "memory", "reclaim": "memory"}


def _set_global(ctx, param, value):
    """A global option given after the command ('status --root X'): as if given before it."""
    if value is None or value is False:
        return
    root_ctx = ctx.find_root()
    key = {"config": "config_path"}.get(param.name, param.name)
    root_ctx.params[key] = value
    obj = ctx.find_object(Context)
    if obj is not None:                     # the root group's callback ran (it runs before a command's parsing)
        setattr(obj, key, value)
        obj._config = obj._safety = obj._host = None
        if param.name == "debug":
            logging.getLogger().setLevel(logging.DEBUG)


def _global_options() -> list:
    """--root, --config and --debug of the root group, accepted after each command too (hidden in its help)."""
    return [click.Option(["--root"], default=None, type=click.Path(file_okay=False), metavar="DIR", hidden=True,
                         expose_value=False, callback=_set_global, help="As before the command."),
            click.Option(["--config", "config"], default=None, metavar="FILE", hidden=True, expose_value=False,
                         callback=_set_global, help="As before the command."),
            click.Option(["--debug"], is_flag=True, default=False, hidden=True, expose_value=False,
                         callback=_set_global, help="As before the command.")]


def _accept_global_options(cmd) -> None:
    if cmd is None or getattr(cmd, "_globals_added", False):
        return
    have = {o for p in cmd.params for o in getattr(p, "opts", ())}
    cmd.params.extend(o for o in _global_options() if not set(o.opts) & have)
    cmd._globals_added = True
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            _accept_global_options(sub)


class SafeGroup(click.Group):
    """Named errors become messages and exit codes; nothing reaches the user as a traceback."""

    def list_commands(self, ctx):
        return sorted(set(self.commands) | set(LAZY_COMMANDS))

    def get_command(self, ctx, name):
        if name not in self.commands and name in LAZY_COMMANDS:
            import importlib
            importlib.import_module(f"spark_memsaver.cli.{LAZY_COMMANDS[name]}").register(self)
        from spark_memsaver.cli.examples import attach
        attach(self.commands.get(name), name)       # each --help ends with its examples
        _accept_global_options(self.commands.get(name))   # 'status --root X' as 'spark-memsaver --root X status'
        return self.commands.get(name)

    def format_epilog(self, ctx, formatter):
        if ctx.parent is None and not self.epilog:          # 'spark-memsaver --help' ends with examples too
            from spark_memsaver.cli.examples import attach
            attach(self, "")
        super().format_epilog(ctx, formatter)

    def invoke(self, ctx):
        # inside click's main, which would turn EPIPE into exit 1: a closed pipe is caught (and flushed) here
        try:
            rv = super().invoke(ctx)
        except BrokenPipeError:      # a stream other than the sink's (a test runner's): the result is lost
            return _stdout_gone()
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _stdout_gone()
        return rv                    # the command's own exit code, whoever read its output

    def main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        _status.pipe_safe_stdout()
        try:
            rv = super().main(*args, **kwargs)
            sys.exit(rv if isinstance(rv, int) else 0)
        except MemsaverError as e:
            emit_error(e)
            sys.exit(e.exit_code)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.ClickException as e:
            if _wants_json():  # usage errors are JSON too when JSON was asked for
                from spark_memsaver.errors import UsageError
                ctx = getattr(e, "ctx", None)
                where = ctx.command_path if ctx is not None else "spark-memsaver"
                err = UsageError(e.format_message(), remedy=f"See '{where} --help'.")
                emit_error(err)
            else:
                e.show()
            sys.exit(EXIT_USAGE)
        except click.Abort:
            click.echo("aborted", err=True)
            sys.exit(EXIT_PROBLEM)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(EXIT_FAILED)
        except BrokenPipeError:
            sys.exit(_stdout_gone())
        except Exception as e:  # a bug: say so plainly, keep the traceback for --debug
            if logging.getLogger().isEnabledFor(logging.DEBUG):
                raise
            emit_error(internal_error(e))
            sys.exit(EXIT_FAILED)


@click.group(cls=SafeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--root", default="/", show_default=True, type=click.Path(file_okay=False), metavar="DIR",
              help="Inspect the system under this root prefix (image, container root, fixture).")
@click.option("--config", "config_path", envvar="SPARK_MEMSAVER_CONFIG", default=None, metavar="FILE",
              help="Config file [default: /etc/spark-memsaver/config.yaml].")
@click.option("--debug", is_flag=True, help="Log every command run and keep tracebacks.")
@click.version_option(__version__, prog_name="spark-memsaver")
@click.pass_context
def cli(ctx, root, config_path, debug):
    """Pack nvidia-uvm GPU page tables on 64 KiB-page kernels, safely (DGX Spark / GB10)."""
    setup_logging(debug, eager=True)
    ctx.obj = Context(root, config_path, debug)


@cli.command(help=_status.help_text())
@click.option("--json", "as_json", is_flag=True, help="Print the versioned JSON document (schema 2).")
@click.option("--direct", is_flag=True, help="Inspect directly even when spark-memsaverd runs.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing; exit with the state's code (below).")
@click.option("-v", "--verbose", is_flag=True, help="Also show the internals: driver-source drift, the source cache.")
@click.pass_obj
def status(obj: Context, as_json: bool, direct: bool, quiet: bool, verbose: bool):
    return _status.run(obj, as_json, direct, quiet, verbose)      # the lean entry runs the same (cli/status.py)


@cli.group()
def config():
    """Inspect the configuration."""


@config.command("show")
@click.option("--json", "as_json", is_flag=True, help="Print it as JSON (with its source and notes).")
@click.pass_obj
def config_show(obj: Context, as_json: bool):
    """Print the effective configuration (defaults merged with the file) as YAML."""
    d = obj.config.to_dict()
    if as_json:
        click.echo(json.dumps(d, indent=2))
    else:  # YAML, loadable as a config file; where it came from is a comment
        import yaml
        source = d.pop("source", None)
        if source:
            click.echo(f"# source: {source}")
        for note in d.pop("notes", None) or []:
            click.echo(f"# note: {note}".replace("\n", " "))
        click.echo(yaml.safe_dump(d, sort_keys=False, default_flow_style=False), nl=False)


def main() -> None:
    cli.main(prog_name="spark-memsaver")
