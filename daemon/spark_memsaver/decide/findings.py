"""A finding of status (code, severity, message, remedy, kernel) and the verdict that carries them: the types
decide/status.py and the modules it draws findings from (decide/sbfindings.py) share, and :func:`needs_first`,
the one rule that puts a missing piece's remedy before an install or build that would be refused. Pure."""

from __future__ import annotations

import re

from spark_memsaver import remedy as rm
from spark_memsaver.record import Record, asdict, field

SEVERITIES = ("info", "warning", "error")


class Finding(Record, frozen=True):
    code: str
    severity: str
    message: str
    remedy: str = ""
    kernel: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["kernel"] is None:
            del d["kernel"]
        return d


class Verdict(Record):
    state: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def problem(self) -> bool:
        return any(f.severity in ("warning", "error") for f in self.findings)


def needs_first(decision: dict | None, remedy: str, joint: str = "then:") -> str:
    """``remedy`` as it stands, or -- when it starts with an install or build that would be refused for the
    running kernel now (decide/installability.py) -- the missing piece's own remedy first."""
    first = (rm.commands_in(remedy) or [""])[0]
    if decision is None or not decision["missing"] or not re.search(r"spark-memsaver (install|build)\b", first):
        return remedy
    return f"{decision['missing'][0]['remedy'].rstrip('.')}; {joint} {remedy[:1].lower()}{remedy[1:]}"
