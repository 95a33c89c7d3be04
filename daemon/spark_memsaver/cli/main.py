"""spark-memsaver's entry point (``spark_memsaver.cli.main:main``).

A status command line is recognised here and run without importing click (cli/status.py: the same body, output
and errors as the click command); every other line goes to the click group in cli/group.py. ``cli``, ``Context``
and the rest of the group's names are still importable from here (read from cli/group.py when first asked for).
"""

from __future__ import annotations

import sys


def main() -> None:
    from spark_memsaver.cli.status import lean

    rc = lean(sys.argv[1:])
    if rc is None:
        from spark_memsaver.cli.group import main as click_main
        click_main()
    sys.exit(rc)


def __getattr__(name: str):
    if name.startswith("__"):          # the import system asks for __path__ and the like: not the group's
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from spark_memsaver.cli import group

    try:
        return getattr(group, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
