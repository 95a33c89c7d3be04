"""What a caller who is not root may see of the processes that hold /dev/nvidia-uvm: their number only.

The daemon reads every holder's pid and command (it runs as root, with CAP_SYS_PTRACE, so hidepid does not
hide them). Published as such, any local user would learn what other users run (issue 12 defect 9). So:
- ``GetStatus``/``GetJob`` for a caller whose uid is not 0 go through :func:`document`/:func:`value`;
- everything broadcast (signals, the ``Job*`` and ``Findings`` properties) goes through them always.
A holder list becomes ``[]`` with its count beside it (``uvm_holders_count``/``holders_count``) and the
key named in ``redacted``; ``comm[pid]`` in a message becomes ``a process``. Pure.
"""

from __future__ import annotations

import re

HOLDER_KEYS = ("uvm_holders", "holders")
_COMM_PID = re.compile(r"[^\s,;:()\[\]]{1,64}\[\d+\]")
_PID_WORD = re.compile(r"\bpid \d+\b")


def text(s: str) -> str:
    return _PID_WORD.sub("pid <hidden>", _COMM_PID.sub("a process", s))


def value(v):
    """``v`` (a JSON-able structure) without holder identities."""
    if isinstance(v, str):
        return text(v)
    if isinstance(v, list):
        return [value(x) for x in v]
    if isinstance(v, tuple):
        return tuple(value(x) for x in v)
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if k in HOLDER_KEYS and isinstance(x, list):
                out[k] = []
                out[f"{k}_count"] = len(x)
                out.setdefault("redacted", []).append(k)
            else:
                out[k] = value(x)
        return out
    return v


def document(doc: dict) -> dict:
    """A status document for a caller who is not root."""
    out = value(doc)
    out.setdefault("uvm_holders_count", 0)
    return out
