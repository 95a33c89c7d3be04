"""Loggers that import ``logging`` when something is first logged, not when the module that logs is imported.

``logging`` (with traceback, linecache, tokenize, string and threading) was about a tenth of a `status` run's
instructions, and a status that runs no command logs nothing (issue 38). ``log = logs.lazy("name")`` gives an
object with the logger's methods; the first call imports logging, applies the set-up the CLI asked for
(:func:`configure`, which the lean status entry calls instead of ``logging.basicConfig``), and hands over to
``logging.getLogger(name)``. Leaf module.
"""

from __future__ import annotations

import sys

_pending: dict | None = None


def configure(**basic) -> None:
    """``logging.basicConfig(**basic)`` now if logging is loaded, else at the first logger's first use."""
    global _pending
    if "logging" in sys.modules:
        import logging
        logging.basicConfig(**basic)
        _pending = None
    else:
        _pending = basic


def _logging():
    global _pending
    import logging

    if _pending is not None:
        basic, _pending = _pending, None
        logging.basicConfig(**basic)
    return logging


class _Lazy:
    __slots__ = ("_name",)

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        return getattr(_logging().getLogger(self._name), attr)


def lazy(name: str) -> _Lazy:
    return _Lazy(name)
