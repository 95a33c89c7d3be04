"""The load-time guard's log (/run/spark-memsaver/guard.log, this boot only): the last time the kernel refused
our module. The guard (systemd/guard/uvm-guard) writes one line per event:

    <UTC time> kernel=<release> ours-load-failed: the kernel refused our nvidia-uvm <path>: <reason> [<cause>]

and then loads the verified stock module. Only the newest such line for the running kernel is reported.
"""

from __future__ import annotations

import re

from spark_memsaver.host import paths
from spark_memsaver.host.safetext import safe

GUARD_LOG = paths.GUARD_LOG
_LINE = re.compile(r"^(?P<time>\S+) kernel=(?P<kernel>\S+) ours-load-failed: the kernel refused our nvidia-uvm "
                   r"(?P<path>\S+): (?P<reason>.*) \[(?P<cause>[a-z-]+)\]$")
MAX_BYTES = 1 << 20


def parse(text: str, kernel: str | None) -> dict | None:
    last = None
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and (kernel is None or m.group("kernel") == kernel):
            last = m.groupdict()
    # the reason is the kernel's and modprobe's words (a module's parameters, its file name): shown escaped
    return {k: safe(v, 1000) for k, v in last.items()} if last else last


def ours_load_failed(host, kernel: str | None) -> dict | None:
    """The guard's newest 'ours-load-failed' for ``kernel`` in this boot's log (rotated part first), or None."""
    text = ""
    for f in (GUARD_LOG + ".1", GUARD_LOG):
        t = host.read_text(f)
        if t:
            text += t[-MAX_BYTES:] + "\n"
    return parse(text, kernel) if text else None
