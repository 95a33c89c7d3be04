"""`spark-memsaver metrics`: the real command's exposition against Spark-like roots (tests/support/sparkroot.py),
checked with Debian's promtool and scraped through the real prometheus-node-exporter (tests/test_monitoring.py's
helpers: the alert rules and the dashboard are tested against the same metric list)."""

import calendar
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from spark_memsaver.observe.counters import CountersError, parse_stats
from spark_memsaver.report.metrics import exposition
from tests.support import sparkroot
from tests.test_monitoring import check_exposition, parse_exposition, scrape_textfile

REPO = Path(__file__).resolve().parent.parent


def metrics(*args):
    e = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    e.pop("SPARK_MEMSAVER_CONFIG", None)
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", *args, "metrics"], capture_output=True,
                       text=True, env=e, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r.stdout


def one(series, name, **labels):
    rows = [v for lab, v in series[name] if all(lab.get(k) == v2 for k, v2 in labels.items())]
    assert len(rows) == 1, (name, labels, series.get(name))
    return rows[0]


def test_active_spark_node(tmp_path):
    # ours runs tier leaf (its counters say so): the tier label is the running tier (tests/test_status_agrees.py)
    root = sparkroot.make_spark_root(tmp_path / "r", uvm_loaded="ours", ours_installed="580.142",
                                     stats=sparkroot.stats_text(tier="leaf"))
    text = metrics("--root", str(root))
    check_exposition(text)
    s = parse_exposition(text)
    info = s["spark_memsaver_info"][0][0]
    assert info["driver"] == "580.142" and info["kernel"] == sparkroot.SPARK_KERNEL and info["tier"] == "leaf"
    assert one(s, "spark_memsaver_state", state=info["state"]) == 1.0
    assert one(s, "spark_memsaver_page_size_bytes") == 65536.0
    status = json.loads(subprocess.run(
        ["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), "status", "--json", "--direct"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO / "daemon"))).stdout)
    assert one(s, "spark_memsaver_saved_bytes", tier="leaf") == float(status["memory"]["saved"] or 0)
    assert one(s, "spark_memsaver_backing_bytes") == float(status["memory"]["pagetable_backing"] or 0)
    assert status["memory"]["saved"] and status["memory"]["saved"] > 0
    # the one reader of "packing active" (decide/packing.py), as status and D-Bus: an active node says 1
    # (before: 0, from a key the counters do not have, so SparkMemsaverPackingInactive fired on healthy nodes)
    assert status["state"] == "active" and info["state"] == "active"
    assert one(s, "spark_memsaver_packing_active", tier="leaf") == 1.0


def test_stock_node_keeps_every_series_at_zero(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r")
    text = metrics("--root", str(root))
    check_exposition(text)
    s = parse_exposition(text)
    assert one(s, "spark_memsaver_saved_bytes") == 0.0 and one(s, "spark_memsaver_packing_active") == 0.0
    assert one(s, "spark_memsaver_state", state="active") == 0.0


def test_this_host_and_node_exporter_serves_the_real_output(tmp_path):
    text = metrics()
    check_exposition(text)
    served = parse_exposition(scrape_textfile(text))
    for name, rows in parse_exposition(text).items():
        got = {tuple(sorted(lab.items())): v for lab, v in served[name]}
        for lab, v in rows:
            key = tuple(sorted(lab.items()))
            assert got.get(key) == v, (name, lab, v, served[name])


def test_labels_are_escaped_and_pending_since_parsed():
    doc = {"version": "0.2.0", "state": "unverified", "host": {"kernel": 'k"\\\n1', "page_size": 65536},
           "driver": {"loaded_version": "580.142"}, "config": {"tier": "leaf"}, "memory": {},
           "uvm": {"packing": None}, "records": {"rollbacks": [{}, {}]},
           "secure_boot": {"state": "pending-enroll", "last_request": {"requested_at": "2026-11-30T10:00:00Z"}},
           "findings": [{"severity": "warning"}, {"severity": "warning"}, {"severity": "info"}],
           "generated_at": "2026-12-01T00:00:00Z"}
    text = exposition(doc)
    check_exposition(text)
    s = parse_exposition(text)
    assert one(s, "spark_memsaver_mok_pending_since_seconds") == calendar.timegm((2026, 11, 30, 10, 0, 0))
    assert one(s, "spark_memsaver_rollback_records") == 2.0
    assert one(s, "spark_memsaver_findings", severity="warning") == 2.0
    assert one(s, "spark_memsaver_last_sample_timestamp_seconds") == calendar.timegm((2026, 12, 1, 0, 0, 0))
    assert 'kernel="k\\"\\\\\\n1"' in text


def test_no_series_that_goes_down_is_typed_counter():
    """spark_memsaver_rollbacks_total was typed counter, yet it counted the rollback records kept now, which go
    down when a rollback is undone (a counter never does: rate() would read a reset). The number of records is a
    gauge named for what it counts; every counter family keeps its value when the records go from 2 to 1."""
    import re

    def text(n):
        return exposition({"version": "0.2.0", "state": "rolled-back", "host": {"kernel": "k", "page_size": 65536},
                           "records": {"rollbacks": [{"kernel": f"k{i}"} for i in range(n)]}}, sample_time=1)
    before, after = text(2), text(1)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", before, re.M))
    s2, s1 = parse_exposition(before), parse_exposition(after)
    for name, typ in types.items():
        if typ == "counter":
            assert [v for _, v in s1[name]] >= [v for _, v in s2[name]], f"{name}: a counter that went down"
    assert types["spark_memsaver_rollback_records"] == "gauge"
    assert (one(s2, "spark_memsaver_rollback_records"), one(s1, "spark_memsaver_rollback_records")) == (2.0, 1.0)


def test_counters_format_2_and_format_1_speak_one_vocabulary():
    f2 = sparkroot.stats_text(tier="leaf").replace("format 1", "format 2")
    assert parse_stats(f2)["tier"] == "leaf"
    assert parse_stats(f2.replace("tier leaf", "tier 4k-all"))["tier"] == "4k-all"
    with pytest.raises(CountersError):
        parse_stats(f2.replace("format 2", "format 3"))


def test_the_last_operations_come_from_the_one_lifecycle_log(tmp_path):
    """spark_memsaver_last_operation_timestamp_seconds{op,result}: read from host/events.py's log, what
    `spark-memsaver events` and D-Bus GetEvents read -- the newest of each kind and result; steps, hook runs and
    rollback records in the log are not operations; every kind and result is a series (0 when none is kept). The
    daemon's textfile (service/monitor.py) reads the log again only when it changed."""
    from spark_memsaver.host import Host, events
    from spark_memsaver.service.monitor import Monitor
    from spark_memsaver.config import Config
    root = sparkroot.make_spark_root(tmp_path / "r")
    log = root / "var/lib/spark-memsaver/events.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"time": "2026-12-01T10:00:00Z", "op": "install", "ok": True, "kernel": "k"},
            {"time": "2026-12-01T11:00:00Z", "op": "install", "ok": True, "kernel": "k"},
            {"time": "2026-12-01T12:00:00Z", "op": "step", "action": "remove-override", "ok": True},
            {"time": "2026-12-01T12:00:01Z", "op": "rolled-back", "kernel": "k", "reason": "GPU fault"},
            {"time": "2026-12-01T12:00:02Z", "op": "rollback", "ok": False, "error": {"code": "x", "message": "m"}}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = metrics("--root", str(root))
    check_exposition(text)
    s = parse_exposition(text)
    t = lambda x: float(calendar.timegm(time.strptime(x, "%Y-%m-%dT%H:%M:%SZ")))  # noqa: E731
    assert one(s, "spark_memsaver_last_operation_timestamp_seconds", op="install", result="ok") == \
        t("2026-12-01T11:00:00Z")
    assert one(s, "spark_memsaver_last_operation_timestamp_seconds", op="rollback", result="failed") == \
        t("2026-12-01T12:00:02Z")
    assert one(s, "spark_memsaver_last_operation_timestamp_seconds", op="rollback", result="ok") == 0.0
    assert len(s["spark_memsaver_last_operation_timestamp_seconds"]) == 2 * len(events.KINDS)
    m = Monitor(Host(str(root)), Config(), on_sample=lambda x: None, on_module_event=lambda a, b: None,
                on_paths_changed=lambda p: None)
    first = m._events()
    assert [e["op"] for e in first] == [r["op"] for r in rows] and m._events() is first    # not read again
    events.record(Host(str(root)), "rollback", {"kernel": "k"}, result={"ok": True})
    assert m._events()[-1]["op"] == "rollback" and m._events()[-1]["ok"] is True
