"""Prometheus side of spark-memsaver with the real tools: promtool (Debian package ``prometheus``) checks and
unit-tests monitoring/alerts.yml, the Grafana dashboard's queries are valid PromQL over our metric names only,
and the real ``prometheus-node-exporter`` serves our textfile format over loopback.

The textfile here is :func:`sample_textfile` (our format, written from the metric list in
monitoring/README.md). To test the real command's output instead, pass it to :func:`scrape_textfile`
(``scrape_textfile(subprocess.run(["spark-memsaver", "metrics"], ...).stdout)``): every check below takes the
text, not the sample.

``python3 tests/test_monitoring.py --write`` regenerates monitoring/alerts.test.yml from SCENARIOS.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.support import needs

REPO = Path(__file__).resolve().parent.parent
MON = REPO / "monitoring"
ALERTS = MON / "alerts.yml"
ALERTS_TEST = MON / "alerts.test.yml"
DASHBOARD = MON / "grafana-dashboard.json"

STATES = ("not-applicable", "stock", "built", "installed", "active", "inactive", "rolled-back",
          "needs-attention", "unverified")
SB_STATES = ("not-needed", "no-key", "not-enrolled", "pending-enroll", "enrolled", "pending-delete", "blocked",
             "unknown")
SEVERITIES = ("info", "warning", "error")
OPS = ("build", "install", "remove", "activate", "rollback", "reconcile", "apt-pre-install", "enroll",
       "enroll-cancel")                # host/events.py KINDS: the operations of the lifecycle event log

#: name -> (type, label names). The contract with the Python side (monitoring/README.md lists the same).
METRICS = {
    "spark_memsaver_info": ("gauge", ("version", "driver", "kernel", "tier", "state")),
    "spark_memsaver_state": ("gauge", ("state",)),
    "spark_memsaver_saved_bytes": ("gauge", ("driver", "kernel", "tier")),
    "spark_memsaver_backing_bytes": ("gauge", ("driver", "kernel", "tier")),
    "spark_memsaver_packing_active": ("gauge", ("driver", "kernel", "tier")),
    "spark_memsaver_page_size_bytes": ("gauge", ()),
    "spark_memsaver_secure_boot_state": ("gauge", ("state",)),
    "spark_memsaver_mok_pending_since_seconds": ("gauge", ()),
    "spark_memsaver_rollback_records": ("gauge", ()),
    "spark_memsaver_held": ("gauge", ("by",)),
    "spark_memsaver_held_since_seconds": ("gauge", ()),
    "spark_memsaver_findings": ("gauge", ("severity",)),
    "spark_memsaver_last_sample_timestamp_seconds": ("gauge", ()),
    "spark_memsaver_last_operation_timestamp_seconds": ("gauge", ("op", "result")),
    # where the memory goes (report/memory.py; `spark-memsaver memory`)
    "spark_memsaver_memory_bytes": ("gauge", ("kind",)),
    "spark_memsaver_free_after_reclaim_bytes": ("gauge", ()),
    "spark_memsaver_reclaimable_gap_bytes": ("gauge", ()),
    "spark_memsaver_free_blocks": ("gauge", ("size",)),
    "spark_memsaver_memory_pressure_percent": ("gauge", ("kind", "window")),
    "spark_memsaver_memory_pressure_stall_seconds_total": ("counter", ("kind",)),
}
MEMORY_KINDS = ("free", "page-cache", "shmem", "anonymous", "swap-cache", "slab-reclaimable", "slab-unreclaimable",
                "kernel-reclaimable-other", "kernel-stacks", "page-tables", "percpu", "vmalloc", "zswap", "balloon",
                "unaccepted", "hugepages", "per-cpu-free", "uvm-page-tables", "gpu-allocations", "driver-and-other")
PSI = [(k, w) for k in ("some", "full") for w in ("avg10", "avg60", "avg300")]
GIB = 1 << 30


def _tool(name: str, pkg: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.path.exists(f"/usr/bin/{name}") else None)
    if path is None:
        needs.absent(name, f"apt-get install {pkg}; tools/deps/ops.txt")
    return path


# ---------------------------------------------------------------------------------------------------
# the textfile

def sample_textfile(state="active", sb="enrolled", driver="580.95.05", kernel="6.11.0-1016-nvidia-64k",
                    tier="4k", saved=3_380_000_000, backing=212_000_000, page_size=65536, mok_since=0,
                    rollbacks=0, findings=(0, 0, 0), now=None, held=None) -> str:
    """Our exposition format for one node, every series present (0 where it does not apply)."""
    now = time.time() if now is None else now
    lab = f'driver="{driver}",kernel="{kernel}",tier="{tier}"'
    helps = {
        "spark_memsaver_info": "spark-memsaver build and node facts (always 1).",
        "spark_memsaver_state": "1 for the node's current state, 0 for the others.",
        "spark_memsaver_saved_bytes": "Bytes of GPU page-table backing memory saved by packing.",
        "spark_memsaver_backing_bytes": "Bytes currently backing GPU page tables.",
        "spark_memsaver_packing_active": "1 when the loaded nvidia-uvm packs page tables.",
        "spark_memsaver_page_size_bytes": "Kernel page size.",
        "spark_memsaver_secure_boot_state": "1 for the signing key's Secure Boot/MOK state, 0 for the others.",
        "spark_memsaver_mok_pending_since_seconds": "Unix time the MOK enrollment request was made, 0 if none.",
        "spark_memsaver_rollback_records": "Rollback records kept now (goes down when one is undone).",
        "spark_memsaver_held": "1 when the administrator's rollback/remove holds the running kernel, by origin.",
        "spark_memsaver_held_since_seconds": "Unix time the hold was recorded, 0 if none.",
        "spark_memsaver_findings": "Findings of the last status by severity.",
        "spark_memsaver_last_sample_timestamp_seconds": "Unix time of the last sample.",
        "spark_memsaver_last_operation_timestamp_seconds": "Unix time of the last operation by kind and result.",
        "spark_memsaver_memory_bytes": "Bytes of MemTotal by where they go.",
        "spark_memsaver_free_after_reclaim_bytes": "MemAvailable.",
        "spark_memsaver_reclaimable_gap_bytes": "MemAvailable - MemFree.",
        "spark_memsaver_free_blocks": "Free blocks of this size or larger, by size.",
        "spark_memsaver_memory_pressure_percent": "PSI memory pressure by kind and window.",
        "spark_memsaver_memory_pressure_stall_seconds_total": "PSI memory stall time by kind.",
    }
    rows = {"free": 100 * GIB, "page-cache": 10 * GIB, "anonymous": 4 * GIB, "driver-and-other": 8 * GIB}
    values = {
        "spark_memsaver_info": [(f'version="0.1.0",{lab},state="{state}"', 1)],
        "spark_memsaver_state": [(f'state="{s}"', int(s == state)) for s in STATES],
        "spark_memsaver_saved_bytes": [(lab, saved)],
        "spark_memsaver_backing_bytes": [(lab, backing)],
        "spark_memsaver_packing_active": [(lab, int(state == "active"))],
        "spark_memsaver_page_size_bytes": [("", page_size)],
        "spark_memsaver_secure_boot_state": [(f'state="{s}"', int(s == sb)) for s in SB_STATES],
        "spark_memsaver_mok_pending_since_seconds": [("", mok_since)],
        "spark_memsaver_rollback_records": [("", rollbacks)],
        "spark_memsaver_held": [(f'by="{b}"', int(b == held)) for b in ("rollback", "remove", "unreadable")],
        "spark_memsaver_held_since_seconds": [("", 0)],
        "spark_memsaver_findings": [(f'severity="{s}"', n) for s, n in zip(SEVERITIES, findings)],
        "spark_memsaver_last_sample_timestamp_seconds": [("", round(now, 3))],
        "spark_memsaver_last_operation_timestamp_seconds": [(f'op="{o}",result="{r}"', 0) for o in OPS
                                                            for r in ("ok", "failed")],
        "spark_memsaver_memory_bytes": [(f'kind="{k}"', rows.get(k, 0)) for k in MEMORY_KINDS],
        "spark_memsaver_free_after_reclaim_bytes": [("", 112 * GIB)],
        "spark_memsaver_reclaimable_gap_bytes": [("", 12 * GIB)],
        "spark_memsaver_free_blocks": [(f'size="{2 << 20}"', 51200)] + ([(f'size="{32 << 20}"', 3200)]
                                                                     if page_size == 65536 else []),
        "spark_memsaver_memory_pressure_percent": [(f'kind="{k}",window="{w}"', 0.0) for k, w in PSI],
        "spark_memsaver_memory_pressure_stall_seconds_total": [(f'kind="{k}"', 1.5) for k in ("some", "full")],
    }
    out = []
    for name, (typ, _labels) in METRICS.items():
        out.append(f"# HELP {name} {helps[name]}")
        out.append(f"# TYPE {name} {typ}")
        for labels, v in values[name]:
            out.append(f"{name}{{{labels}}} {v}" if labels else f"{name} {v}")
    return "\n".join(out) + "\n"


def parse_exposition(text: str) -> dict[str, list[tuple[dict, float]]]:
    """name -> [(labels, value)] from the text exposition format (enough of it for our series)."""
    series: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?', line)
        assert m, f"not an exposition line: {line!r}"
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        series.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return series


def _free_port(host="127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def node_exporter(textfile_dir: Path):
    """The real prometheus-node-exporter on a loopback port, textfile collector only; yields the URL."""
    exe = _tool("prometheus-node-exporter", "prometheus-node-exporter")
    port = _free_port()
    p = subprocess.Popen([exe, f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults",
                          "--collector.textfile", f"--collector.textfile.directory={textfile_dir}"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                if p.poll() is not None or time.monotonic() > deadline:
                    p.kill()
                    raise AssertionError(f"node_exporter did not serve {url}:\n{p.stdout.read()}")
                time.sleep(0.1)
        yield url
    finally:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def scrape_textfile(text: str, name: str = "spark-memsaver.prom") -> str:
    """Put ``text`` where node_exporter's textfile collector reads it (as the daemon does: a temporary file
    renamed into place), scrape node_exporter over loopback, return what it served."""
    with tempfile.TemporaryDirectory(prefix="textfile.") as d:
        tmp = Path(d) / f".{name}.tmp"
        tmp.write_text(text)
        os.rename(tmp, Path(d) / name)
        with node_exporter(Path(d)) as url:
            return urllib.request.urlopen(url, timeout=10).read().decode()


# ---------------------------------------------------------------------------------------------------
# alert unit tests: scenarios -> promtool's test file

_HOUR = 3600
#: instance -> series overrides; every node gets all series. "good" and the "*-ok" nodes must never alert.
SCENARIOS = {
    "good":         {},
    "rolledback":   {"state": "rolled-back"},
    "attention":    {"state": "needs-attention"},
    "inactive64k":  {"state": "installed"},
    "x86-ok":       {"state": "installed", "page_size": 4096},
    "noapp-ok":     {"state": "not-applicable", "page_size": 65536},
    "mokwait":      {"state": "built", "sb": "pending-enroll", "mok_since": 600},
    "stale":        {"stale": True},
    "stock64k":     {"state": "stock"},
    "heldremove-ok": {"state": "stock", "held": "remove"},        # the administrator's `remove --all`
    "heldrollback-ok": {"state": "stock", "held": "rollback"},    # `rollback`, no failure on record
    # the administrator's `rollback` writes a rollback record and a hold: status says rolled-back, on purpose
    "rolledbackheld-ok": {"state": "rolled-back", "held": "rollback"},
    # memory (defaults: 12 GiB gap of 122, 3200 free 32 MiB blocks, no pressure; x86 has no 32 MiB series)
    "cachefull":    {"gap_gib": 70},                               # unsloth #10704: a 60 GB file read once
    "fragmented":   {"blocks_32m": 0},                             # sparkring #173: a week up, none left
    "pressured":    {"psi_some_avg300": 35.0},
    "fragmentedlow-ok": {"blocks_32m": 0, "after_gib": 10},        # nothing free anyway: not fragmentation
}
#: alert -> [(eval time, instances expected firing)]
EXPECT = {
    "SparkMemsaverRolledBack": [("4m", []), ("10m", ["rolledback"])],
    "SparkMemsaverNeedsAttention": [("4m", []), ("10m", ["attention"])],
    "SparkMemsaverPackingInactive": [("50m", []), ("70m", ["inactive64k", "mokwait", "stock64k"]),
                                     ("25h", ["inactive64k", "mokwait", "stock64k"])],
    "SparkMemsaverMokPendingTooLong": [("23h", []), ("24h20m", ["mokwait"])],
    "SparkMemsaverMetricsStale": [("14m", []), ("25m", ["stale"])],
    "SparkMemsaverReclaimableGapLarge": [("20m", []), ("40m", ["cachefull"])],
    "SparkMemsaverLargeBlocksGone": [("20m", []), ("40m", ["fragmented"])],
    "SparkMemsaverMemoryPressure": [("10m", []), ("20m", ["pressured"])],
}
_MINUTES = 26 * 60  # samples at 1m for 26 h


def _series_for(instance: str, o: dict) -> list[dict]:
    """promtool input_series for one node (constant values; the last-sample time follows the clock)."""
    state = o.get("state", "active")
    sb = o.get("sb", "enrolled")
    base = f'instance="{instance}",job="node"'
    lab = f'{base},driver="580.95.05",kernel="6.11.0-1016-nvidia-64k",tier="4k"'
    n = _MINUTES

    def const(v):
        return f"{v}x{n}"

    s = [(f'spark_memsaver_state{{{base},state="{st}"}}', const(int(st == state))) for st in STATES]
    s += [(f'spark_memsaver_secure_boot_state{{{base},state="{st}"}}', const(int(st == sb))) for st in SB_STATES]
    s += [(f"spark_memsaver_packing_active{{{lab}}}", const(int(state == "active"))),
          (f"spark_memsaver_saved_bytes{{{lab}}}", const(3380000000 if state == "active" else 0)),
          (f"spark_memsaver_page_size_bytes{{{base}}}", const(o.get("page_size", 65536))),
          (f"spark_memsaver_mok_pending_since_seconds{{{base}}}", const(o.get("mok_since", 0))),
          *((f'spark_memsaver_held{{{base},by="{by}"}}', const(int(o.get("held") == by)))
            for by in ("rollback", "remove")),
          (f"spark_memsaver_held_since_seconds{{{base}}}", const(600 if o.get("held") else 0)),
          (f"spark_memsaver_last_sample_timestamp_seconds{{{base}}}",
           const(0) if o.get("stale") else f"0+60x{n}")]
    gap, after = o.get("gap_gib", 12) * GIB, o.get("after_gib", 112) * GIB
    s += [(f'spark_memsaver_memory_bytes{{{base},kind="{k}"}}', const(v)) for k, v in
          (("free", after - gap), ("page-cache", gap), ("anonymous", 122 * GIB - after))]
    s += [(f"spark_memsaver_free_after_reclaim_bytes{{{base}}}", const(after)),
          (f"spark_memsaver_reclaimable_gap_bytes{{{base}}}", const(gap)),
          (f'spark_memsaver_free_blocks{{{base},size="{2 << 20}"}}', const(51200))]
    if o.get("page_size", 65536) == 65536:
        s.append((f'spark_memsaver_free_blocks{{{base},size="{32 << 20}"}}', const(o.get("blocks_32m", 3200))))
    s += [(f'spark_memsaver_memory_pressure_percent{{{base},kind="{k}",window="{w}"}}',
           const(o.get("psi_some_avg300", 0.0) if (k, w) == ("some", "avg300") else 0.0)) for k, w in PSI]
    return [{"series": k, "values": v} for k, v in s]


def _render(template: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def alert_unit_tests(alerts_doc: dict) -> dict:
    """promtool's unit-test document for SCENARIOS/EXPECT, expected labels and annotations taken from the rules."""
    rules = {r["alert"]: r for g in alerts_doc["groups"] for r in g["rules"] if "alert" in r}
    assert set(rules) == set(EXPECT), f"alerts without a scenario or scenarios without an alert: {set(rules) ^ set(EXPECT)}"
    series = [s for inst, o in SCENARIOS.items() for s in _series_for(inst, o)]
    tests = []
    for alert, checks in EXPECT.items():
        rule = rules[alert]
        cases = []
        for t, firing in checks:
            exp = []
            for inst in firing:
                labels = {"instance": inst, "job": "node", **rule.get("labels", {})}
                if alert in ("SparkMemsaverRolledBack", "SparkMemsaverNeedsAttention"):
                    labels["state"] = SCENARIOS[inst]["state"]
                ann = {k: _render(v, labels) for k, v in rule.get("annotations", {}).items()}
                exp.append({"exp_labels": labels, "exp_annotations": ann})
            cases.append({"eval_time": t, "alertname": alert, "exp_alerts": exp})
        tests.extend(cases)
    return {
        "rule_files": ["alerts.yml"],
        "evaluation_interval": "1m",
        "tests": [{"name": "every alert fires for its node only; healthy nodes never alert",
                   "interval": "1m", "input_series": series, "alert_rule_test": tests}],
    }


def alert_unit_tests_text() -> str:
    doc = alert_unit_tests(yaml.safe_load(ALERTS.read_text()))
    return ("# Generated by `python3 tests/test_monitoring.py --write` from SCENARIOS/EXPECT there; do not edit.\n"
            "# Run: promtool test rules monitoring/alerts.test.yml\n"
            + yaml.safe_dump(doc, sort_keys=False, width=200))


# ---------------------------------------------------------------------------------------------------
# PromQL: names used by rules and the dashboard

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                 "offset", "time", "max", "min", "sum", "avg", "count", "rate", "increase", "changes", "resets",
                 "label_values", "topk", "bottomk", "abs", "clamp_min", "absent", "delta", "deriv", "timestamp",
                 "max_over_time", "min_over_time", "avg_over_time", "last_over_time", "vector", "scalar", "sort"}


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers outside {...}, quotes and grouping clauses, that are not
    PromQL keywords/functions, label names in by/without/on (...), or durations."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "{}", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\$\w+", "", e)
    return {w for w in re.findall(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", e) if w not in _PROMQL_WORDS}


def dashboard_exprs(dash: dict) -> list[str]:
    out = []

    def walk(o):
        if isinstance(o, dict):
            if isinstance(o.get("expr"), str):
                out.append(o["expr"])
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(dash.get("panels", []))
    return out


# ---------------------------------------------------------------------------------------------------
# tests

def test_promtool_check_rules():
    promtool = _tool("promtool", "prometheus")
    r = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(EXPECT)} rules found" in r.stdout, r.stdout


def test_alert_unit_tests_are_current_and_pass():
    promtool = _tool("promtool", "prometheus")
    assert ALERTS_TEST.read_text() == alert_unit_tests_text(), \
        "monitoring/alerts.test.yml is stale: run python3 tests/test_monitoring.py --write"
    r = subprocess.run([promtool, "test", "rules", str(ALERTS_TEST)], capture_output=True, text=True, cwd=MON)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_alert_unit_tests_catch_a_broken_rule(tmp_path):
    """The unit tests can fail: with the rolled-back alert watching the wrong state, promtool reports it."""
    promtool = _tool("promtool", "prometheus")
    broken = ALERTS.read_text().replace('spark_memsaver_state{state="rolled-back"}', 'spark_memsaver_state{state="stock"}')
    assert broken != ALERTS.read_text()
    (tmp_path / "alerts.yml").write_text(broken)
    (tmp_path / "alerts.test.yml").write_text(ALERTS_TEST.read_text())
    r = subprocess.run([promtool, "test", "rules", "alerts.test.yml"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and "SparkMemsaverRolledBack" in r.stdout + r.stderr, r.stdout + r.stderr


def test_rules_and_dashboard_use_only_our_metrics(tmp_path):
    promtool = _tool("promtool", "prometheus")
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["panels"]
    exprs = dashboard_exprs(dash)
    assert len(exprs) >= 10
    alerts = yaml.safe_load(ALERTS.read_text())
    rule_exprs = [r["expr"] for g in alerts["groups"] for r in g["rules"]]
    used = set()
    for e in exprs + rule_exprs:
        names = metric_names(e)
        assert names, f"no metric in {e!r}"
        assert names <= set(METRICS), f"{e!r} uses metrics outside the list: {names - set(METRICS)}"
        used |= names
    assert {"spark_memsaver_saved_bytes", "spark_memsaver_state", "spark_memsaver_secure_boot_state"} <= used
    # the dashboard's queries are valid PromQL: promtool parses them as recording rules
    rec = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:panel_{i}", "expr": e.replace("$instance", ".*")} for i, e in enumerate(exprs)]}]}
    (tmp_path / "dash-rules.yml").write_text(yaml.safe_dump(rec))
    r = subprocess.run([promtool, "check", "rules", str(tmp_path / "dash-rules.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # the README documents exactly this list
    readme = (MON / "README.md").read_text()
    for name in METRICS:
        assert f"`{name}" in readme, f"{name} missing from monitoring/README.md"


def test_metric_name_check_rejects_unknown_names():
    assert metric_names('sum by (instance) (spark_memsaver_saved_bytes{tier="4k"}) / node_memory_MemTotal_bytes') \
        == {"spark_memsaver_saved_bytes", "node_memory_MemTotal_bytes"}
    assert metric_names("time() - spark_memsaver_last_sample_timestamp_seconds[5m] > 900") \
        == {"spark_memsaver_last_sample_timestamp_seconds"}


def check_exposition(text: str) -> None:
    """What every textfile of ours must satisfy: promtool's lint, every listed metric present with its labels,
    the one-hot families have every state (0 or 1, exactly one 1)."""
    promtool = _tool("promtool", "prometheus")
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
    series = parse_exposition(text)
    for name, (_typ, labels) in METRICS.items():
        assert name in series, f"{name} missing"
        for lab, _v in series[name]:
            assert set(labels) <= set(lab), f"{name} lacks labels {set(labels) - set(lab)}"
    for name, states in (("spark_memsaver_state", STATES), ("spark_memsaver_secure_boot_state", SB_STATES)):
        got = {lab["state"]: v for lab, v in series[name]}
        assert set(got) == set(states), f"{name}: states {set(states) ^ set(got)}"
        assert sorted(got.values()) == [0.0] * (len(states) - 1) + [1.0], got
    assert {lab["severity"] for lab, _ in series["spark_memsaver_findings"]} == set(SEVERITIES)


@pytest.mark.parametrize("kw", [{}, {"state": "not-applicable", "sb": "not-needed", "saved": 0, "backing": 0}],
                         ids=["active", "not-applicable"])
def test_sample_textfile_passes_promtool_check_metrics(kw):
    check_exposition(sample_textfile(**kw))


def test_check_exposition_rejects_a_vanishing_series():
    text = "\n".join(l for l in sample_textfile().splitlines() if 'state="rolled-back"' not in l) + "\n"
    with pytest.raises(AssertionError):
        check_exposition(text)


def test_node_exporter_serves_our_textfile():
    text = sample_textfile(state="active", sb="enrolled", saved=3380000000)
    check_exposition(text)
    served = scrape_textfile(text)
    got = parse_exposition(served)
    want = parse_exposition(text)
    for name, rows in want.items():
        assert name in got, f"node_exporter does not serve {name}"
        assert sorted((tuple(sorted(l.items())), v) for l, v in got[name]) == \
            sorted((tuple(sorted(l.items())), v) for l, v in rows), name
    # node_exporter read the file without error (its own series say so)
    errs = got.get("node_textfile_scrape_error", [])
    assert errs and errs[0][1] == 0.0, errs
    assert any(l.get("file", "").endswith("spark-memsaver.prom") for l, _ in got.get("node_textfile_mtime_seconds", []))


def test_node_exporter_flags_a_broken_textfile():
    served = parse_exposition(scrape_textfile("spark_memsaver_state{state=\"active\" 1\n"))
    assert served["node_textfile_scrape_error"][0][1] == 1.0
    assert "spark_memsaver_state" not in served


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        ALERTS_TEST.write_text(alert_unit_tests_text())
        print(f"wrote {ALERTS_TEST}")
    else:
        print("usage: python3 tests/test_monitoring.py --write", file=sys.stderr)
        sys.exit(2)


def test_every_command_an_alert_gives_is_runnable_as_written():
    """An alert's description is a remedy read on a dashboard: each `command` in it exists, parses with the CLI's
    own parser and carries sudo exactly when it needs root (the same check as tests/test_remedies.py)."""
    from tests.test_remedies import check_command
    doc = yaml.safe_load(ALERTS.read_text())
    commands, problems = [], []
    for group in doc["groups"]:
        for rule in group["rules"]:
            text = " ".join(rule.get("annotations", {}).values())
            for c in re.findall(r"`([^`]+)`", text):
                if re.match(r"(sudo )?(spark-memsaver|systemctl|journalctl)\b", c):
                    commands.append(c)
                    problems += [f"{rule['alert']}: {p}" for p in check_command(c)]
    assert len(commands) >= 6, commands
    assert not problems, "\n".join(problems)
