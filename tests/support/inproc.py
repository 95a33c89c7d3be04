"""The CLI called in this process (the console script's entry, cli/entry.main: exit codes and named errors as
a user sees them), for tests that run it hundreds of times on fixture roots (tests/test_state_space.py): a
subprocess per call would cost ~0.3 s of interpreter start each."""

from __future__ import annotations

import contextlib
import io
import os
import sys


def cli(*args: str, click: bool = False) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``spark-memsaver ARGS``; ``click``: through the click group alone (what the
    entry hands every line the lean status path does not read), to compare the two."""
    from spark_memsaver.cli import entry
    if click:
        from spark_memsaver.cli import main as entry     # noqa: F811  (cli/main.main: the click group's)
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_cfg = sys.argv, os.environ.pop("SPARK_MEMSAVER_CONFIG", None)
    sys.argv = ["spark-memsaver", *args]          # cli/main._wants_json reads it
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                entry.main()            # the console script's own entry: the lean status path, else click's
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved_argv
        if saved_cfg is not None:
            os.environ["SPARK_MEMSAVER_CONFIG"] = saved_cfg
    return code, out.getvalue(), err.getvalue()
