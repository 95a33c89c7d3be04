"""A plan step and the one ``base_version``: shared by the reconcile planner (decide/plan.py) and the APT door's
plan (decide/apt.py), so neither imports the other. Pure."""

from __future__ import annotations

from spark_memsaver.record import Record, asdict

from spark_memsaver.versions import base_version  # noqa: F401  (the one base_version)


class Step(Record):
    action: str
    kernel: str | None = None
    reason: str = ""
    driver_from: str | None = None
    driver_to: str | None = None
    intent: str | None = None          # id of the intent record this step finishes/undoes
    path: str | None = None
    code: str | None = None            # rollback code for record-rollback; why a kernel stays stock
    remedy: str = ""
    driver: str | None = None          # fetch-source: the driver version whose source is fetched

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, "")}


# Actions that change the system (the rest only explain).
ACTING = ("undo-intent", "finish-intent", "clear-intent", "drop-record", "remove-override",
          "record-rollback", "clear-rollback", "fetch-source", "build-install", "reload-uvm")
INFO = ("ok", "stay-stock", "blocked", "config-changed", "held")


