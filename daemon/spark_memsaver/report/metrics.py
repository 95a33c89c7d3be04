"""Report: the Prometheus text exposition of a status document (pure: document in, text out).

The metric names, labels and meanings are specified in monitoring/README.md (installed as
/usr/share/doc/spark-memsaver/examples/monitoring/README.md); the alert rules and the Grafana dashboard there use
exactly these. Every series is always present: a state that does not hold is 0, never
missing, so a series does not vanish when a node changes state.

Used by ``spark-memsaver metrics`` (for cron or a node_exporter textfile) and by the daemon, which writes the
same text to node_exporter's textfile directory after each sample.
"""

from __future__ import annotations

import time

from spark_memsaver.decide.packing import packing_active

STATES = ("not-applicable", "stock", "built", "installed", "active", "inactive", "rolled-back",
          "needs-attention", "unverified")
SECURE_BOOT_STATES = ("not-needed", "no-key", "not-enrolled", "pending-enroll", "enrolled", "pending-delete",
                      "blocked", "unknown")
SEVERITIES = ("info", "warning", "error")
HOLD_ORIGINS = ("rollback", "remove", "unreadable")   # host/holds.py BY, and decide/hold.UNREADABLE


def _label(value) -> str:
    """A label value in the exposition format: backslash, quote and newline escaped; control characters dropped."""
    s = "" if value is None else str(value)
    s = "".join(c for c in s if c >= " " or c == "\n")
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**kv) -> str:
    if not kv:
        return ""
    return "{" + ",".join(f'{k}="{_label(v)}"' for k, v in kv.items()) + "}"


def _num(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


def _rfc3339_to_unix(text) -> int:
    from spark_memsaver.timefmt import utc_epoch   # not time.strptime: the resident daemon calls this

    t = utc_epoch(text)
    return int(t) if t is not None else 0


def exposition(doc: dict, *, sample_time: float | None = None, sample: dict | None = None,
               events: list | None = None, memory_doc: dict | None = None) -> str:
    """The exposition text for one status document (schema 1 or newer).

    ``events``: the lifecycle event log (host/events.read, the one log `spark-memsaver events` and D-Bus GetEvents
    read): the time of the last finished operation of each kind, by result.

    ``sample`` (the daemon's monitoring sample, service/monitor.py) is fresher than the document for the
    live figures: when given, its backing/saved bytes and packing flag are used, and the memory series of the
    sample are added (``pagetable_backing_bytes``, ``pagetable_stock_bytes``, ``memory_*_bytes``).

    ``memory_doc``: the ``memory`` document (decide/memory.model): where the memory goes, free blocks, pressure
    (report/memory.metric_series; every series present, 0 when not given)."""
    host = doc.get("host") or {}
    driver = (doc.get("driver") or {}).get("loaded_version") or ""
    kernel = host.get("kernel") or ""
    from spark_memsaver.decide.packing import tier_of
    tier = tier_of(doc)          # the running tier where ours is loaded (its counters), else the configured one
    state = doc.get("state") or ""
    memory = doc.get("memory") or {}
    sb = doc.get("secure_boot") or {}
    records = doc.get("records") or {}
    common = {"driver": driver, "kernel": kernel, "tier": tier}

    out: list[str] = []

    def metric(name, mtype, help_, rows):
        out.append(f"# HELP spark_memsaver_{name} {help_}")
        out.append(f"# TYPE spark_memsaver_{name} {mtype}")
        for labels, value in rows:
            out.append(f"spark_memsaver_{name}{_labels(**labels)} {_num(value)}")

    metric("info", "gauge", "spark-memsaver on this node (value 1; the labels carry the facts).",
           [({"version": doc.get("version") or "", **common, "state": state}, 1)])
    metric("state", "gauge", "1 for the node's status state, 0 for every other state.",
           [({"state": s}, int(s == state)) for s in STATES])
    active = packing_active(doc.get("uvm"))      # the one reader (decide/packing.py), as status and D-Bus
    sample = sample or {}
    if sample.get("backing_bytes") is not None:
        memory = dict(memory, pagetable_backing=sample["backing_bytes"], saved=sample.get("saved_bytes"))
    if "packing_active" in sample:
        active = bool(sample["packing_active"])
    metric("saved_bytes", "gauge", "Bytes of page-table backing memory saved by packing (0 when inactive).",
           [(common, int(memory.get("saved") or 0))])
    metric("backing_bytes", "gauge", "Bytes of memory now backing GPU page tables (0 when unknown).",
           [(common, int(memory.get("pagetable_backing") or 0))])
    metric("packing_active", "gauge", "1 when the loaded nvidia-uvm packs page tables, else 0.",
           [(common, int(active))])
    metric("page_size_bytes", "gauge", "The running kernel's page size in bytes.",
           [({}, int(host.get("page_size") or 0))])
    sb_state = sb.get("state") or "unknown"
    metric("secure_boot_state", "gauge", "1 for the signing key's Secure Boot / MOK state, 0 for every other.",
           [({"state": s}, int(s == sb_state)) for s in SECURE_BOOT_STATES])
    pending_since = 0
    if sb_state == "pending-enroll":
        pending_since = _rfc3339_to_unix((sb.get("last_request") or {}).get("requested_at")
                                         if isinstance(sb.get("last_request"), dict) else None)
    metric("mok_pending_since_seconds", "gauge", "Unix time the pending MOK enrollment was requested; 0 if none.",
           [({}, pending_since)])
    rollbacks = records.get("rollbacks") if isinstance(records.get("rollbacks"), list) else []
    metric("rollback_records", "gauge", "Rollback records kept now (kernels rolled back to the stock nvidia-uvm; "
           "goes down when one is undone): a count of records, not of rollbacks ever.", [({}, len(rollbacks))])
    hold = doc.get("hold") if isinstance(doc.get("hold"), dict) else {}
    metric("held", "gauge", "1 when the administrator's rollback/remove holds the running kernel on stock "
           "(until `spark-memsaver install`), by origin; else 0.",
           [({"by": by}, int(hold.get("by") == by)) for by in HOLD_ORIGINS])
    metric("held_since_seconds", "gauge", "Unix time the running kernel's hold was recorded; 0 if none.",
           [({}, _rfc3339_to_unix(hold.get("since")))])
    from spark_memsaver.host.events import KINDS
    last: dict = {}
    for e in events or ():
        if isinstance(e, dict) and e.get("op") in KINDS and isinstance(e.get("ok"), bool):
            key = (e["op"], "ok" if e["ok"] else "failed")
            last[key] = max(last.get(key, 0), _rfc3339_to_unix(e.get("time")))
    metric("last_operation_timestamp_seconds", "gauge", "Unix time of the last finished operation of each kind in "
           "the lifecycle event log, by result (ok, failed); 0 if none is kept.",
           [({"op": op, "result": r}, last.get((op, r), 0)) for op in KINDS for r in ("ok", "failed")])
    findings = doc.get("findings") or []
    metric("findings", "gauge", "Findings of the last status, by severity.",
           [({"severity": sev}, sum(1 for f in findings if f.get("severity") == sev)) for sev in SEVERITIES])
    for name, key, help_ in (
            ("pagetable_backing_bytes", "backing_bytes", "Bytes backing GPU page tables at the last sample."),
            ("pagetable_stock_bytes", "stock_bytes", "Bytes the same tables would take in the stock nvidia-uvm."),
            ("memory_total_bytes", "mem_total", "MemTotal at the last sample."),
            ("memory_available_bytes", "mem_available", "MemAvailable at the last sample.")):
        if sample.get(key) is not None:
            metric(name, "gauge", help_, [({}, int(sample[key]))])
    from spark_memsaver.report.memory import metric_series
    for name, mtype, help_, rows in metric_series(memory_doc):
        metric(name, mtype, help_, rows)
    when = sample_time if sample_time is not None else _rfc3339_to_unix(doc.get("generated_at")) or time.time()
    metric("last_sample_timestamp_seconds", "gauge", "Unix time of the sample these figures come from.",
           [({}, round(float(when), 3))])
    return "\n".join(out) + "\n"
