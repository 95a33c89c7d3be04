"""spark-memsaver's entry point (``spark_memsaver.cli.entry:main``: /usr/bin/spark-memsaver, ``python3 -m
spark_memsaver``).

A status command line is recognised here and run without importing click (cli/status.py: the same body, output
and errors as the click command); every other line goes to the click group in cli/main.py.
"""

from __future__ import annotations

import sys


def main() -> None:
    from spark_memsaver.cli.status import lean

    rc = lean(sys.argv[1:])
    if rc is None:
        from spark_memsaver.cli.main import main as click_main
        click_main()
    sys.exit(rc)
