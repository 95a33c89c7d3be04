"""Text that someone else wrote, made safe to show: the one sanitizer of untrusted strings (issue 35 item 6).

Any local user can name a process (``/proc/PID/comm`` of a holder of the world-writable /dev/nvidia-uvm), and a
module's parameters, the kernel log and a config file carry text we did not write. Shown raw, ``x\\e[8m`` hides
what follows on root's terminal (click strips escapes only from pipes), a U+202E turns the rest of a line around,
and a newline forges a line of its own. :func:`safe` escapes every control, format (bidi included), line or
paragraph separator and surrogate character as ``\\xNN``/``\\uNNNN``/``\\UNNNNNNNN`` (Python's notation), so
the text is the same in the status text, in ``--json`` and over D-Bus. The readers in observe/ (and the kernel
log's in validate/) apply it where they read; nothing downstream needs to remember.
"""

from __future__ import annotations

import re

_PLAIN = re.compile(r"[^\x20-\x7e]")    # printable ASCII needs nothing
_ESCAPE_CATEGORIES = ("Cc", "Cf", "Zl", "Zp", "Cs")


def _escaped(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else (f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")


def safe(text, limit: int | None = None) -> str:
    """``text`` with its control, format (bidi), separator and surrogate characters escaped; cut to ``limit``
    characters first (``...`` added) when given. Anything not a string is shown as its str()."""
    s = text if isinstance(text, str) else str(text)
    if limit is not None and len(s) > limit:
        s = s[:limit] + "..."
    if _PLAIN.search(s) is None:
        return s
    import unicodedata     # at first use: most text is plain ASCII, and the idle daemon does not carry it
    return "".join(_escaped(c) if (c < " " or "\x7f" <= c) and unicodedata.category(c) in _ESCAPE_CATEGORIES
                   else c for c in s)


def is_safe(text: str) -> bool:
    return safe(text) == text
