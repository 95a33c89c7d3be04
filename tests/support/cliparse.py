"""Parse a command line with the CLI's own click parser, the way `spark-memsaver ...` would, without running it.

    parse("sudo spark-memsaver install --kernel 6.14.0 --dry-run") -> ("install", {"kernel": "6.14.0", ...})

Raises click.UsageError (no such command, no such option, a missing value) exactly as the CLI would."""

from __future__ import annotations

import shlex
import warnings


def split(command: str) -> tuple[bool, list[str]]:
    """(sudo?, argv after the program name) of one shell command line; the first pipeline element only."""
    for sep in ("||", "|", "&&", ";"):
        command = command.split(f" {sep} ", 1)[0]
    argv = shlex.split(command.replace('"$(uname -r)"', "KERNEL").replace("$(uname -r)", "KERNEL"))
    sudo = bool(argv) and argv[0] == "sudo"
    if sudo:
        argv = argv[1:]
    return sudo, argv


def parse(command: str):
    """(command path, params) of a `spark-memsaver ...` line (sudo allowed)."""
    path, params, _ = parse_with_globals(command)
    return path, params


def parse_with_globals(command: str):
    """(command path, params, the root group's params: --root, --config, --debug, wherever they were given)."""
    import click
    from spark_memsaver.cli.main import cli
    _, argv = split(command)
    argv = [a for a in argv if a not in ("--help", "-h")]      # parse what it names; do not print its help
    assert argv and argv[0] == "spark-memsaver", command
    ctx = cli.make_context("spark-memsaver", argv[1:])
    path, cmd = [], cli
    while isinstance(cmd, click.Group):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rest = list(getattr(ctx, "protected_args", [])) + list(ctx.args)
        if not rest:
            raise click.UsageError(f"{command!r}: no command given")
        name, sub, args = cmd.resolve_command(ctx, rest)
        path.append(name)
        ctx = sub.make_context(name, args, parent=ctx)
        cmd = sub
    return " ".join(path), dict(ctx.params), dict(ctx.find_root().params)
