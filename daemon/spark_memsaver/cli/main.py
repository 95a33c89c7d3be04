"""spark-memsaver: the command-line interface (click). Exit codes: spark_memsaver/exitcodes.py."""

from __future__ import annotations

import json
import logging
import os
import sys

import click

from spark_memsaver import __version__
from spark_memsaver.errors import EXIT_FAILED, EXIT_PROBLEM, EXIT_USAGE, MemsaverError

class Context:
    def __init__(self, root: str, config_path: str | None, debug: bool):
        self.root = root
        self.config_path = config_path
        self.debug = debug
        self._config = None
        self._host = None

    @property
    def config(self):
        if self._config is None:
            from spark_memsaver import config as cfg
            self._config = cfg.load(self.config_path, root=self.root)
        return self._config

    @property
    def host(self):
        if self._host is None:
            from spark_memsaver.host import Host
            self._host = Host(self.root)
        return self._host


def _wants_json() -> bool:
    return "--json" in sys.argv[1:]


def emit_error(err: MemsaverError) -> None:
    if _wants_json():
        click.echo(json.dumps({"error": err.to_dict()}, indent=2))
    else:
        click.echo(f"error[{err.code}]: {err.message}", err=True)
        if err.remedy:
            click.echo(f"remedy: {err.remedy}", err=True)


# The other commands live in their own modules of this package, each adding itself with register(group).
# A module is imported when one of its commands runs (or when --help lists them all): `status` pays for
# none of them.
LAZY_COMMANDS = {"patch": "patch", "build": "build", "install": "build", "remove": "build", "mok": "mok",
                 "reconcile": "lifecycle", "rollback": "lifecycle", "activate": "lifecycle",
                 "validate": "validate", "history": "history", "events": "events", "metrics": "metrics"}


def _stdout_gone() -> int:
    """The reader of our stdout went away ('status | head -1'): what is left goes nowhere; that is not an error."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0


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
        obj._config = obj._host = None
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
            sys.stdout.flush()
            return rv
        except BrokenPipeError:
            return _stdout_gone()

    def main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
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
            err = MemsaverError(f"internal error: {type(e).__name__}: {e}",
                                remedy="Re-run with --debug and report the output as a bug.")
            err.code = "internal-error"
            emit_error(err)
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
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    ctx.obj = Context(root, config_path, debug)


def _status_help() -> str:
    from spark_memsaver import exitcodes as ec
    rows = "\n".join(f"  {c}  {m.replace('`', '')}" for c, m in ec.QUIET_TABLE)
    return ("Show what is installed, selected, loaded and saved, and what to do about it.\n\n"
            "Exit status: 0 consistent, 1 a warning or an error was found, 2 inspection impossible or bad usage.\n\n"
            "\b\nWith --quiet, the state decides, like 'systemctl is-active':\n" + rows)


@cli.command(help=_status_help())
@click.option("--json", "as_json", is_flag=True, help="Print the versioned JSON document (schema 2).")
@click.option("--direct", is_flag=True, help="Inspect directly even when spark-memsaverd runs.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing; exit with the state's code (below).")
@click.option("-v", "--verbose", is_flag=True, help="Also show the internals: driver-source drift, the source cache.")
@click.pass_obj
def status(obj: Context, as_json: bool, direct: bool, quiet: bool, verbose: bool):
    if quiet and (as_json or verbose):
        from spark_memsaver.errors import UsageError
        other = "--json" if as_json else "--verbose"
        raise UsageError(f"--quiet and {other} exclude each other",
                         remedy=f"Give one: 'spark-memsaver status --quiet' for the state as the exit status, or "
                                f"'spark-memsaver status {other}' to print it.")
    config = obj.config  # validate the config first: a bad file is exit 2
    doc = None
    if not direct and obj.root == "/":
        try:
            from spark_memsaver.cli import client
            doc = client.get_status()
            if doc is not None and not client.is_fresh(doc):   # stale: the daemon re-makes it; look now
                doc = None
        except ImportError:
            doc = None
    if doc is None:
        from spark_memsaver.report.document import status_of as run_status
        doc, _ = run_status(obj.host, config)
        doc["source"] = "direct"
    from spark_memsaver import exitcodes
    if quiet:
        return exitcodes.quiet_code(doc)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        from spark_memsaver.report.document import render_text
        click.echo(render_text(doc, verbose=verbose))
        click.echo(f"\n(source: {'spark-memsaverd' if doc.get('source') == 'daemon' else 'direct inspection'})")
    return exitcodes.status_code(doc)


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
