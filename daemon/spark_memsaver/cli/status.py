"""`status` without click: the command's body, the CLI's shared context and output, and the lean entry's argv reader.

`status` is what people, scripts and monitoring run most, and click with what it imports (typing, enum, gettext,
datetime, ...) was a third of its time (issue 38). :func:`lean` recognises a status command line before click
is imported and runs :func:`run` -- the same body the click command (cli/main.py) calls -- with the same
output (:func:`echo` is what both write with), errors (:func:`emit_error`), exit codes and logging set-up. A
line it does not recognise in full (``--help``, an unknown or misspelt option, another command, ``--debug``,
shell completion) returns None and goes to click, which says what it always said. So the two paths cannot
differ on a line only click reads, and tests/test_lean_entry.py compares the two on the lines both read.
"""

from __future__ import annotations

import io
import os
import re
import sys

from spark_memsaver.errors import EXIT_FAILED, EXIT_PROBLEM, EXIT_USAGE, MemsaverError  # noqa: F401

_ANSI = re.compile(r"\033\[[;?0-9]*[a-zA-Z]")      # what click.echo strips when the stream is not a terminal


class Context:
    def __init__(self, root: str, config_path: str | None, debug: bool):
        self.root = root
        self.config_path = config_path
        self.debug = debug
        self._config = None
        self._safety = None
        self._host = None

    @property
    def config(self):
        """The configuration, strictly: an unusable file is config-invalid (exit 2). What build, install,
        activate and 'config show' act on."""
        if self._config is None:
            from spark_memsaver import config as cfg
            self._config = cfg.load(self.config_path, root=self.root)
        return self._config

    def safety_config(self, announce: bool = True):
        """The configuration of a safety path (rollback, remove, reconcile and the package-manager doors, status,
        metrics, mok status): never stopped by the file. An unusable file gives the built-in defaults carrying
        its error (config.load_for_safety), said once on stderr as a config-invalid warning (``announce``;
        status shows it as its finding instead)."""
        if self._safety is None:
            from spark_memsaver import config as cfg
            self._safety = cfg.load_for_safety(self.config_path, root=self.root)
            bad = self._safety.invalid
            if bad and announce:
                echo(f"warning[config-invalid]: {bad['message']}; using the built-in defaults for what safety "
                     "needs (nothing is built until the file is fixed)", err=True)
                if bad.get("remedy"):
                    echo(f"remedy: {bad['remedy']}", err=True)
        return self._safety

    @property
    def host(self):
        if self._host is None:
            from spark_memsaver.host import Host
            self._host = Host(self.root)
        return self._host


def echo(text: str = "", err: bool = False, nl: bool = True) -> None:
    """``click.echo`` for text: a line to stdout (or stderr), escape sequences stripped when not a terminal."""
    f = sys.stderr if err else sys.stdout
    out = text + "\n" if nl else text
    if out:
        try:
            tty = f.isatty()
        except Exception:
            tty = False
        f.write(out if tty else _ANSI.sub("", out))
    f.flush()


def wants_json() -> bool:
    return "--json" in sys.argv[1:]


def emit_error(err: MemsaverError) -> None:
    import json

    if wants_json():
        echo(json.dumps({"error": err.to_dict()}, indent=2))
    else:
        echo(f"error[{err.code}]: {err.message}", err=True)
        if err.remedy:
            echo(f"remedy: {err.remedy}", err=True)


def stdout_gone() -> int:
    """The reader of our stdout went away ('status | head -1'): what is left goes nowhere; that is not an error."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0


class _PipeSink(io.RawIOBase):
    """fd 1 under the real stdout: a reader that went away ('status | true', '--help | head -1') makes the rest
    go nowhere, and the command goes on to its own exit code (a warning is still 1, --help still 0). Before,
    EPIPE became exit 0 inside a command (its code lost) and exit 1 in click's --help."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd = fd
        self.gone = False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return os.isatty(self.fd)

    def write(self, b) -> int:
        n = len(b)
        if self.gone:
            return n
        try:
            return os.write(self.fd, b)
        except BrokenPipeError:
            self.gone = True
            stdout_gone()
            return n


def pipe_safe_stdout() -> None:
    """Put the interpreter's own stdout (not a test runner's) over :class:`_PipeSink`."""
    out = sys.stdout
    if out is None or out is not sys.__stdout__:
        return
    try:
        fd = out.fileno()
        out.flush()
    except (OSError, ValueError):
        return
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(_PipeSink(fd)), encoding=out.encoding, errors=out.errors,
                                  line_buffering=out.line_buffering, write_through=True)


def internal_error(e: BaseException) -> MemsaverError:
    err = MemsaverError(f"internal error: {type(e).__name__}: {e}",
                        remedy="Re-run with --debug and report the output as a bug.")
    err.code = "internal-error"
    return err


def setup_logging(debug: bool, eager: bool = False) -> None:
    """The CLI's log set-up (warnings, or everything with --debug, to stderr): applied when something is first
    logged (logs.py), so a status that logs nothing never imports logging; ``eager`` (the click group, whose
    error handler asks the root logger's level) now."""
    from spark_memsaver import logs

    if eager:
        import logging  # noqa: F401  (loaded: configure applies at once)
    logs.configure(level=10 if debug else 30, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def help_text() -> str:
    from spark_memsaver import exitcodes as ec
    rows = "\n".join(f"  {c}  {m.replace('`', '')}" for c, m in ec.QUIET_TABLE)
    return ("Show what is installed, selected, loaded and saved, and what to do about it.\n\n"
            "Exit status: 0 consistent, 1 a warning or an error was found, 2 inspection impossible or bad usage.\n\n"
            "\b\nWith --quiet, the state decides, like 'systemctl is-active':\n" + rows)


def run(obj: Context, as_json: bool, direct: bool, quiet: bool, verbose: bool) -> int:
    """The status command's body: the exit code; named errors are raised for the caller to emit."""
    if quiet and (as_json or verbose):
        from spark_memsaver.errors import UsageError
        other = "--json" if as_json else "--verbose"
        raise UsageError(f"--quiet and {other} exclude each other",
                         remedy=f"Give one: 'spark-memsaver status --quiet' for the state as the exit status, or "
                                f"'spark-memsaver status {other}' to print it.")
    config = obj.safety_config(announce=False)  # an unusable file: one config-invalid finding, status goes on
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
        import json
        echo(json.dumps(doc, indent=2))
    else:
        from spark_memsaver.report.document import render_text
        echo(render_text(doc, verbose=verbose))
        echo(f"\n(source: {'spark-memsaverd' if doc.get('source') == 'daemon' else 'direct inspection'})")
    return exitcodes.status_code(doc)


_GLOBAL_VALUE = {"--root": "root", "--config": "config_path"}
_FLAGS = {"--json": "as_json", "--direct": "direct", "-q": "quiet", "--quiet": "quiet", "-v": "verbose",
          "--verbose": "verbose"}


def parse(argv: list[str]) -> dict | None:
    """The options of a status command line that click would read the same way, or None (click reads it).
    ``--root`` and ``--config`` may come before or after the command (each once); flags once each."""
    if "_SPARK_MEMSAVER_COMPLETE" in os.environ:
        return None
    opts = {"root": "/", "config_path": None, "as_json": False, "direct": False, "quiet": False, "verbose": False}
    seen: set[str] = set()
    command = False
    i, n = 0, len(argv)
    while i < n:
        a = argv[i]
        i += 1
        if a == "status" and not command:
            command = True
            continue
        if command and a in _FLAGS:
            if _FLAGS[a] in seen:
                return None
            seen.add(_FLAGS[a])
            opts[_FLAGS[a]] = True
            continue
        name, eq, value = a.partition("=")
        if name not in _GLOBAL_VALUE or name in seen:
            return None
        seen.add(name)
        if not eq:
            if i >= n:
                return None
            value = argv[i]
            i += 1
        if not value or value.startswith("-"):
            return None
        opts[_GLOBAL_VALUE[name]] = value
    if not command:
        return None
    root = opts["root"]
    if root != "/" and not os.path.isdir(root):          # click.Path(file_okay=False) has its own words for a file
        return None if os.path.exists(root) else opts
    if opts["config_path"] is None:
        opts["config_path"] = os.environ.get("SPARK_MEMSAVER_CONFIG") or None
    return opts


def lean(argv: list[str]) -> int | None:
    """Run a status command line recognised by :func:`parse`: its exit code; None when it is not one."""
    opts = parse(argv)
    if opts is None:
        return None
    pipe_safe_stdout()
    try:
        setup_logging(False)
        obj = Context(opts.pop("root"), opts.pop("config_path"), False)
        rv = run(obj, **opts)
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            stdout_gone()
        return rv                    # the command's own exit code, whoever read its output
    except MemsaverError as e:
        emit_error(e)
        return e.exit_code
    except KeyboardInterrupt:
        echo("interrupted", err=True)
        return EXIT_FAILED
    except BrokenPipeError:
        return stdout_gone()
    except Exception as e:  # a bug: said as click's path says it (--debug, for the traceback, goes through click)
        emit_error(internal_error(e))
        return EXIT_FAILED
