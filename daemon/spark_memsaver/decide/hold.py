"""The administrator's hold (host/holds.py writes it): is a kernel held, and how to say so. Pure.

``records.holds`` (model.Records) is the list of hold records observe read (host/records.py kind "hold").
"""

from __future__ import annotations


UNREADABLE = "unreadable"      # the origin of a hold whose record cannot be read (metrics: held{by="unreadable"})


def held(records, kernel: str | None) -> dict | None:
    """The hold that applies to ``kernel`` (``records``: the world's model.Records, or None): its own, else the
    hold on every kernel unless ``install`` released this kernel from it; None when automation may act on it."""
    if records is None:
        return None
    holds = [h for h in records.holds if isinstance(h, dict)]
    # a hold record that cannot be read still holds (every kernel): the administrator's word is not guessed
    holds += [{"by": UNREADABLE, "kernel": None, "since": "?", "unreadable": q.get("path")}
              for q in records.quarantined if isinstance(q, dict) and q.get("kind") == "hold" and not q.get("moved_to")]
    own = [h for h in holds if kernel is not None and h.get("kernel") == kernel]
    if own:
        return own[-1]
    every = [h for h in holds if h.get("kernel") is None and kernel not in (h.get("released") or [])]
    return every[-1] if every else None


def resume_command(hold: dict, kernel: str | None, running: str | None = None) -> str:
    """The command that ends ``hold`` for ``kernel``: install (it clears the hold, then installs)."""
    if hold.get("unreadable"):
        return "sudo spark-memsaver install --all"
    if kernel and kernel != running:
        return f"sudo spark-memsaver install --kernel {kernel}"
    return "sudo spark-memsaver install"


def origin(hold: dict) -> str:
    """'held since 2026-12-02T10:00:00Z, by rollback'."""
    if hold.get("unreadable"):
        return f"held by an unreadable hold record ({hold['unreadable']}; reconcile sets it aside and keeps the hold)"
    what = hold.get("by") or "the administrator"
    if hold.get("kernel") is None:
        what += " --all" if what == "remove" else " of every kernel"
    return f"held since {hold.get('since') or '?'}, by {what}"


def describe(hold: dict, kernel: str | None, running: str | None = None) -> str:
    """'held since 2026-12-02T10:00:00Z, by rollback; `sudo spark-memsaver install` resumes'."""
    return f"{origin(hold)}; `{resume_command(hold, kernel, running)}` resumes"
