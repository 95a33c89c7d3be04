"""report/: what a mutation run in full (tools/mutation-run, issue 29 item 3) found unguarded by the fast tests.
Each test pins one line a user reads on `status`'s first screen, in `metrics` or in `mok status` (the status
document in, the text out) and names the mutants it kills."""

from __future__ import annotations

import json

import pytest

from spark_memsaver.report import summary

GIB = 1 << 30


# --- report/summary.py ---------------------------------------------------------------------------------------

def _doc(state="active", saved=None, **kw):
    d = {"state": state, "findings": [], "config": {"tier": "leaf"}, "host": {"page_size": 65536},
         "memory": {} if saved is None else {"saved": saved, "pagetable_backing": GIB // 4,
                                             "pagetable_stock_equivalent": GIB + GIB // 4}}
    d.update(kw)
    return d


def test_gain_measured_estimated_or_nothing():
    """Gain: measured while ours packs (saved, backing, stock equivalent, two decimals of GiB), an estimate with
    its basis otherwise, 'nothing measurable' on small pages, nothing on a node it does not apply to (kills:
    each branch's test and wording, the GiB format)."""
    usable = ("usable memory gained: about 1.8 GiB (estimate from the seed project's measurement on a serving GB10 "
              "node: page-table backing 3.25 -> 0.22 GiB)")
    assert summary.gain(_doc(saved=GIB)) == ("page-table backing saved now: 1.00 GiB (measured: 0.25 GiB instead of "
                                             "1.25 GiB); " + usable + ", not measured here")
    d = _doc(saved=GIB)
    del d["memory"]["pagetable_stock_equivalent"]
    assert summary.gain(d).startswith("page-table backing saved now: 1.00 GiB (measured: 0.25 GiB instead of 0.00 GiB)")
    assert summary.gain(_doc(saved=0)).startswith("page-table backing saved now: 0.00 GiB")   # measured zero is measured
    est = usable + "; page-table backing saved: measured here once active"
    assert summary.gain(_doc("stock")) == est
    assert summary.gain(_doc("stock", host={})) == est                        # page size unknown
    assert summary.gain(_doc("stock", host={"page_size": 4096})) == \
        "nothing measurable: with 4 KiB pages a page table already costs little"
    assert summary.gain(_doc("stock", host={"page_size": 16384})).startswith("nothing measurable: with 16 KiB")
    assert summary.gain(_doc("not-applicable", saved=GIB)) is None
    assert summary.risk(_doc("not-applicable", saved=GIB)) is None


def test_gain_of_an_inactive_node_is_nothing_now():
    """Inactive (ours loaded, packing nothing): no 'saved now' even with counters read, but 'nothing now' with
    the estimate once it packs; on small pages still 'nothing measurable' (kills: the inactive rule and its
    wording)."""
    assert summary.gain(_doc("inactive", saved=0)) == (
        "nothing now: our nvidia-uvm is loaded but packs nothing (the finding below says why); once it packs, usable "
        "memory gained: about 1.8 GiB (estimate from the seed project's measurement on a serving GB10 node: "
        "page-table backing 3.25 -> 0.22 GiB)")
    assert summary.gain(_doc("inactive", host={"page_size": 4096})).startswith("nothing measurable")
    assert summary.next_step(_doc("inactive", saved=0)) is None        # nothing to validate while it packs nothing


def test_risk_says_what_is_proven():
    """Risk: validated (with when) only for a packing node whose last validation passed; otherwise what is not
    proven and the validate command; a tier other than leaf adds that it is not validated on hardware (kills:
    the outcome test, the packing test, the wording, the tier rule)."""
    passed = {"last_validation": {"outcome": "passed", "finished_at": "2026-12-01T10:00:00Z"}}
    assert summary.risk(_doc(saved=GIB, records=passed)) == "validated on this node (2026-12-01T10:00:00Z)"
    assert summary.risk(_doc(saved=GIB, records={"last_validation": {"outcome": "passed"}})) == \
        "validated on this node (time not recorded)"
    not_yet = ("this package has not yet run on a GB10 (no NVIDIA driver here to qualify) and this node has not "
               "been validated: run 'sudo spark-memsaver validate'")
    assert summary.risk(_doc(saved=GIB)) == not_yet
    assert summary.risk(_doc(saved=GIB, records={"last_validation": {"outcome": "failed",
                                                                     "finished_at": "x"}})) == not_yet
    assert summary.risk(_doc(saved=GIB, records={"last_validation": "passed"})) == not_yet
    assert summary.risk(_doc("stock", records=passed)) == (
        "this package has not yet run on a GB10 (no NVIDIA driver here to qualify); once active, run "
        "'sudo spark-memsaver validate'")
    assert summary.risk(_doc(saved=GIB, config={"tier": "256"})) == not_yet + \
        "; tier 256 is not validated on hardware"
    assert summary.risk(_doc(saved=GIB, config={})) == not_yet


def _f(code, severity, remedy):
    return {"code": code, "severity": severity, "remedy": remedy}


def test_next_step_is_the_most_severe_remedy_that_asks_for_something():
    """Next: an error's remedy before a warning's, whatever their order; a remedy that is empty or says
    'Nothing to do' is passed over; an info finding counts only when it asks for install/activate/a fetch
    (kills: the severity order, the skip rules, the info codes)."""
    fs = [_f("w", "warning", "fix the warning"), _f("e", "error", "fix the error")]
    assert summary.next_step(_doc("stock", findings=fs)) == "fix the error"
    fs = [_f("stock", "info", "install it"), _f("w", "warning", "fix the warning")]
    assert summary.next_step(_doc("stock", findings=fs)) == "fix the warning"
    fs = [_f("x", "mystery", "unknown severity last"), _f("w", "warning", "fix the warning")]
    assert summary.next_step(_doc("stock", findings=fs)) == "fix the warning"
    fs = [_f("e", "error", "  "), _f("e2", "error", "Nothing to do: fine."), _f("w", "warning", "do this")]
    assert summary.next_step(_doc("stock", findings=fs)) == "do this"
    assert summary.next_step(_doc("stock", findings=[_f("e", "error", "NOTHING TO DO here")])) is None
    assert summary.next_step(_doc("stock", findings=[{"code": "e", "severity": "error", "remedy": None},
                                                     _f("w", "warning", "do this")])) == "do this"
    assert summary.next_step(_doc("stock", findings=[_f("other", "info", "x"), _f("stock", "info", "install")])) \
        == "install"
    for code in ("stock", "activation-pending", "driver-source-fetchable", "packing-disabled"):
        assert summary.next_step(_doc("stock", findings=[_f(code, "info", "run it")])) == "run it", code
    assert summary.next_step(_doc("stock", findings=[_f("other", "info", "run it")])) is None


def test_next_step_validate_or_nothing_and_the_hold():
    """With nothing asked for: validate a packing node never validated (its exact sentence), nothing for a
    validated one or one that does not pack; the administrator's hold comes first unless an error is there
    (kills: the validate fallback, the hold's error test)."""
    assert summary.next_step(_doc(saved=GIB)) == ("Run 'sudo spark-memsaver validate' to qualify packing on this "
                                                  "node with real GPU work.")
    assert summary.next_step(_doc("stock")) is None
    assert summary.next_step(_doc(saved=GIB, records={"last_validation": {"outcome": "passed"}})) is None
    held = _f("held", "warning", "sudo spark-memsaver install")
    hold = {"by": "rollback", "since": "2026-12-01T10:00:00Z", "kernel": "K"}
    step = summary.next_step(_doc("stock", findings=[_f("w", "warning", "other"), held], hold=hold))
    assert step.startswith("Run 'sudo spark-memsaver install' to resume packing (held since 2026-12-01T10:00:00Z")
    assert step.endswith(").")
    assert summary.next_step(_doc("stock", findings=[held], hold="bad")) == \
        "Run 'sudo spark-memsaver install' to resume packing."
    assert summary.next_step(_doc("stock", findings=[held, _f("e", "error", "fix the error")], hold=hold)) == \
        "fix the error"
    assert summary.next_step(_doc("stock", findings=[_f("held", "warning", " "), _f("w", "warning", "other")],
                                  hold=hold)) == "other"


# --- report/metrics.py ---------------------------------------------------------------------------------------

METRICS_DOC = {
    "version": "1.2.3", "host": {"kernel": "6.14.0-1015-nvidia-64k", "page_size": 65536},
    "driver": {"loaded_version": "580.142"}, "config": {"tier": "leaf"}, "state": "active",
    "memory": {"saved": 1000, "pagetable_backing": 200},
    "uvm": {"loaded": True, "patched": True, "packing": {"trees_packed": 3}},
    "secure_boot": {"state": "pending-enroll", "last_request": {"requested_at": "2026-12-01T10:00:00Z"}},
    "records": {"rollbacks": [{}, {}]}, "hold": {"by": "remove", "since": "2026-12-02T00:00:00Z"},
    "findings": [{"severity": "warning"}, {"severity": "warning"}, {"severity": "error"}],
    "generated_at": "2026-12-02T10:00:00Z"}


def _family(name, mtype, help_, *rows):
    return [f"# HELP spark_memsaver_{name} {help_}", f"# TYPE spark_memsaver_{name} {mtype}",
            *(f"spark_memsaver_{name}{r}" for r in rows)]


# the memory families (report/memory.metric_series) when no memory document is given: every series at 0
MEMORY_FAMILIES_UNKNOWN = (
    _family("memory_bytes", "gauge", "Bytes of MemTotal by where they go (rows of 'spark-memsaver memory'; 0 when "
            "not known).", *(f'{{kind="{k}"}} 0' for k in (
                "free", "page-cache", "shmem", "anonymous", "swap-cache", "slab-reclaimable", "slab-unreclaimable",
                "kernel-reclaimable-other", "kernel-stacks", "page-tables", "percpu", "vmalloc", "zswap", "balloon",
                "unaccepted", "hugepages", "per-cpu-free", "uvm-page-tables", "gpu-allocations", "driver-and-other")))
    + _family("free_after_reclaim_bytes", "gauge", "MemAvailable: what could be free after reclaim.", " 0")
    + _family("reclaimable_gap_bytes", "gauge", "MemAvailable - MemFree: memory CUDA does not see free on GB10 "
              "until it is reclaimed.", " 0")
    + _family("free_blocks", "gauge", "Free blocks of this size or larger (a larger block counted as several), "
              "by size in bytes; only sizes this kernel's largest order can hold.", '{size="2097152"} 0')
    + _family("memory_pressure_percent", "gauge", "PSI memory pressure: share of time stalled, by kind and window.",
              *(f'{{kind="{k}",window="{w}"}} 0.0' for k in ("some", "full") for w in ("avg10", "avg60", "avg300")))
    + _family("memory_pressure_stall_seconds_total", "counter", "PSI memory stall time since boot, by kind.",
              '{kind="some"} 0.0', '{kind="full"} 0.0'))


def test_metrics_exposition_is_exactly_the_documented_one():
    """The whole exposition of one document and one daemon sample, as monitoring/README.md documents it and
    its alert rules and dashboard read it: names, HELP and TYPE lines, labels in order, every state series
    present (0 or 1), the sample's figures over the document's (kills: every name, help text, label and value
    rule of exposition())."""
    from spark_memsaver.host.events import KINDS
    from spark_memsaver.report.metrics import SECURE_BOOT_STATES, STATES, exposition
    # the lifecycle log: the newest of each operation and result; a step, a record or a line without ok is none
    events = [{"time": "2026-12-01T10:00:00Z", "op": "install", "ok": True},
              {"time": "2026-12-01T11:00:00Z", "op": "install", "ok": True},
              {"time": "2026-12-01T09:00:00Z", "op": "install", "ok": True},
              {"time": "2026-12-01T12:00:00Z", "op": "rollback", "ok": False},
              {"time": "2026-12-01T13:00:00Z", "op": "step", "action": "remove-override", "ok": True},
              {"time": "2026-12-01T14:00:00Z", "op": "rolled-back", "kernel": "k"},
              {"time": "2026-12-01T15:00:00Z", "op": "build", "ok": 1}]
    last = {("install", "ok"): 1796122800, ("rollback", "failed"): 1796126400}
    common = '{driver="580.142",kernel="6.14.0-1015-nvidia-64k",tier="leaf"}'
    want = (
        _family("info", "gauge", "spark-memsaver on this node (value 1; the labels carry the facts).",
                '{version="1.2.3",driver="580.142",kernel="6.14.0-1015-nvidia-64k",tier="leaf",state="active"} 1')
        + _family("state", "gauge", "1 for the node's status state, 0 for every other state.",
                  *(f'{{state="{s}"}} {int(s == "active")}' for s in STATES))
        + _family("saved_bytes", "gauge", "Bytes of page-table backing memory saved by packing (0 when inactive).",
                  f"{common} 2000")
        + _family("backing_bytes", "gauge", "Bytes of memory now backing GPU page tables (0 when unknown).",
                  f"{common} 300")
        + _family("packing_active", "gauge", "1 when the loaded nvidia-uvm packs page tables, else 0.",
                  f"{common} 0")
        + _family("page_size_bytes", "gauge", "The running kernel's page size in bytes.", " 65536")
        + _family("secure_boot_state", "gauge",
                  "1 for the signing key's Secure Boot / MOK state, 0 for every other.",
                  *(f'{{state="{s}"}} {int(s == "pending-enroll")}' for s in SECURE_BOOT_STATES))
        + _family("mok_pending_since_seconds", "gauge",
                  "Unix time the pending MOK enrollment was requested; 0 if none.", " 1796119200")
        + _family("rollback_records", "gauge", "Rollback records kept now (kernels rolled back to the stock nvidia-uvm; "
                  "goes down when one is undone): a count of records, not of rollbacks ever.", " 2")
        + _family("held", "gauge", "1 when the administrator's rollback/remove holds the running kernel on stock "
                  "(until `spark-memsaver install`), by origin; else 0.", '{by="rollback"} 0', '{by="remove"} 1',
                  '{by="unreadable"} 0')
        + _family("held_since_seconds", "gauge", "Unix time the running kernel's hold was recorded; 0 if none.",
                  " 1796169600")
        + _family("last_operation_timestamp_seconds", "gauge", "Unix time of the last finished operation of each "
                  "kind in the lifecycle event log, by result (ok, failed); 0 if none is kept.",
                  *(f'{{op="{op}",result="{r}"}} {last.get((op, r), 0)}' for op in KINDS for r in ("ok", "failed")))
        + _family("findings", "gauge", "Findings of the last status, by severity.",
                  '{severity="info"} 0', '{severity="warning"} 2', '{severity="error"} 1')
        + _family("pagetable_backing_bytes", "gauge", "Bytes backing GPU page tables at the last sample.", " 300")
        + _family("pagetable_stock_bytes", "gauge", "Bytes the same tables would take in the stock nvidia-uvm.",
                  " 2300")
        + _family("memory_total_bytes", "gauge", "MemTotal at the last sample.", " 10")
        + _family("memory_available_bytes", "gauge", "MemAvailable at the last sample.", " 5")
        + MEMORY_FAMILIES_UNKNOWN
        + _family("last_sample_timestamp_seconds", "gauge", "Unix time of the sample these figures come from.",
                  " 5.25"))
    got = exposition(METRICS_DOC, sample_time=5.25, sample={
        "backing_bytes": 300, "saved_bytes": 2000, "packing_active": False, "stock_bytes": 2300, "mem_total": 10,
        "mem_available": 5}, events=events)
    assert got.split("\n") == want + [""]
    assert STATES == ("not-applicable", "stock", "built", "installed", "active", "inactive", "rolled-back",
                      "needs-attention", "unverified")
    assert SECURE_BOOT_STATES == ("not-needed", "no-key", "not-enrolled", "pending-enroll", "enrolled",
                                  "pending-delete", "blocked", "unknown")


def test_metrics_without_a_sample_read_the_document():
    """Without the daemon's sample: the document's figures, packing from its uvm counters, the time from its
    generated_at; no sample-only series; a hold or MOK request that is absent or unreadable reads 0; a label
    value is escaped (backslash, quote, newline) and loses control characters (kills: the fallbacks, the
    escaping; the kernel's and state's `or ""`, the time's 3 decimals)."""
    from spark_memsaver.report.metrics import exposition
    text = exposition(METRICS_DOC)
    assert 'spark_memsaver_saved_bytes{driver="580.142",kernel="6.14.0-1015-nvidia-64k",tier="leaf"} 1000' in text
    assert 'spark_memsaver_packing_active{driver="580.142",kernel="6.14.0-1015-nvidia-64k",tier="leaf"} 1' in text
    assert "spark_memsaver_last_sample_timestamp_seconds 1796205600.0\n" in text
    assert "pagetable_backing_bytes" not in text and "memory_total_bytes" not in text
    doc = dict(METRICS_DOC, hold="remove", secure_boot={"state": "pending-enroll", "last_request": "x"},
               version='a"b\\c\nd\x01e', records={"rollbacks": "many"}, memory={})
    text = exposition(doc, sample_time=1)
    assert "spark_memsaver_held_since_seconds 0\n" in text and 'spark_memsaver_held{by="remove"} 0' in text
    assert "spark_memsaver_mok_pending_since_seconds 0\n" in text
    assert "spark_memsaver_rollback_records 0\n" in text and "spark_memsaver_last_sample_timestamp_seconds 1.0\n" in text
    assert 'version="a\\"b\\\\c\\nde"' in text
    assert f'spark_memsaver_saved_bytes{{driver="580.142",kernel="6.14.0-1015-nvidia-64k",tier="leaf"}} 0' in text
    # a document without kernel or state: empty label values, never a made-up one; the sample's time in ms
    doc = {k: v for k, v in METRICS_DOC.items() if k != "state"}
    doc["host"] = {"page_size": 65536}
    text = exposition(doc, sample_time=1.23456)
    assert 'spark_memsaver_info{version="1.2.3",driver="580.142",kernel="",tier="leaf",state=""} 1\n' in text
    assert "spark_memsaver_last_sample_timestamp_seconds 1.235\n" in text
    # a MOK request only counts while the enrollment is pending
    doc = dict(METRICS_DOC, secure_boot={"state": "enrolled", "last_request": {"requested_at": "2026-12-01T10:00:00Z"}})
    assert "spark_memsaver_mok_pending_since_seconds 0\n" in exposition(doc)


def test_metrics_of_an_empty_document_are_zero_unknown_or_empty():
    """A document that says nothing (an old or broken one) still gives every series: empty label values, 0 bytes, page
    size 0, Secure Boot "unknown", an operation whose time cannot be read at 0; a label keeps its spaces (kills:
    the `or ""` of driver, tier and version, `or 0` -> `or 1` of the backing bytes and page size, "unknown"'s
    spelling, the default 0 of the newest operation time, `c >= " "` -> `c > " "`)."""
    from spark_memsaver.report.metrics import exposition
    text = exposition({}, sample_time=7, events=[{"op": "install", "ok": True, "time": "not a time"}])
    assert 'spark_memsaver_info{version="",driver="",kernel="",tier="",state=""} 1\n' in text
    assert 'spark_memsaver_backing_bytes{driver="",kernel="",tier=""} 0\n' in text
    assert "spark_memsaver_page_size_bytes 0\n" in text
    assert 'spark_memsaver_secure_boot_state{state="unknown"} 1\n' in text
    assert 'spark_memsaver_last_operation_timestamp_seconds{op="install",result="ok"} 0\n' in text
    text = exposition(dict(METRICS_DOC, version="1.2.3 beta 1"), sample_time=7)
    assert 'spark_memsaver_info{version="1.2.3 beta 1",' in text


# --- report/mok.py -------------------------------------------------------------------------------------------

def test_mok_status_text_rows():
    """`mok status` says every fact as its row, aligned: the state, reason and remedy; the firmware flags in
    words (unknown/n/a where not read); the certificate with its fingerprints (sha1 as MokManager shows it);
    where the key was found; the kernel's lockdown, enforcement and whether the key is loaded (kills: each
    row's label, each flag's wording, the alignment)."""
    from spark_memsaver.report.mok import render_text
    sb = {"state": "enrolled", "reason": "our key is in MokListRT", "remedy": None, "efi": True, "secure_boot": True,
          "setup_mode": False, "validation_disabled": False,
          "certificate": {"path": "/var/lib/dkms/mok.pub", "origin": "dkms", "present": True, "sha256": "ab" * 32,
                          "sha1": "cd" * 20, "subject": "CN=x", "not_after": "2036-01-01T00:00:00Z"},
          "where": ["MokListRT", ".platform"], "kernel": {"lockdown": "integrity", "sig_enforce": False,
                                                         "key_loaded": True}}
    assert render_text(sb).split("\n") == [
        "State:               enrolled",
        "Reason:              our key is in MokListRT",
        "EFI:                 yes",
        "Secure Boot:         on",
        "Setup mode:          no",
        "Validation disabled: no",
        "Certificate:         /var/lib/dkms/mok.pub (dkms)",
        "  subject:           CN=x",
        "  sha256:            " + "ab" * 32,
        "  sha1:              " + "cd" * 20 + " (MokManager's 'View key' shows this one)",
        "  not after:         2036-01-01T00:00:00Z",
        "Found in:            MokListRT, .platform",
        "Kernel:              lockdown=integrity sig_enforce=N key loaded=yes"]
    sb = {"state": "unknown", "reason": "efivarfs is not mounted", "remedy": "sudo mount it", "efi": False,
          "secure_boot": None, "setup_mode": None, "validation_disabled": True,
          "certificate": {"path": "/x.der", "origin": "config", "present": False},
          "kernel": {"lockdown": None, "sig_enforce": None, "key_loaded": None}}
    assert render_text(sb).split("\n") == [
        "State:               unknown",
        "Reason:              efivarfs is not mounted",
        "Remedy:              sudo mount it",
        "EFI:                 no",
        "Secure Boot:         unknown",
        "Setup mode:          n/a",
        "Validation disabled: yes (MokSBStateRT)",
        "Certificate:         /x.der (config, missing)",
        "Kernel:              lockdown=n/a sig_enforce=n/a"]
    sb.update(secure_boot=False, setup_mode=True, validation_disabled=None, kernel={"sig_enforce": True},
              certificate={"path": "/y", "origin": "dkms", "present": True, "sha256": "ef" * 32, "subject": "CN=y",
                           "not_after": "2030-01-01T00:00:00Z"})
    rows = render_text(sb).split("\n")
    assert rows[4:] == ["Secure Boot:         off", "Setup mode:          yes", "Validation disabled: n/a",
                        "Certificate:         /y (dkms)", "  subject:           CN=y",
                        "  sha256:            " + "ef" * 32, "  not after:         2030-01-01T00:00:00Z",
                        "Kernel:              lockdown=n/a sig_enforce=Y"]
    sb["kernel"] = {"lockdown": "none", "sig_enforce": False, "key_loaded": False}     # our key not in the keyring
    assert render_text(sb).split("\n")[-1] == "Kernel:              lockdown=none sig_enforce=N key loaded=no"


# --- report/document.py --------------------------------------------------------------------------------------

def _status_doc():
    src = [("580.142", "/usr/src/nvidia-580.142", "usr-src"), ("580.178.04", "/c", "cache"),
           ("599.1.1", "/d", "usr-src"), ("590.48.01", "/e", "usr-src")]
    return {
        "state": "active", "host": {"kernel": "6.14.0-1015-nvidia-64k", "arch": "aarch64", "page_size": 65536},
        "driver": {"loaded_version": "580.142",
                   "sources": [{"version": v, "path": p, "open": True, "origin": o} for v, p, o in src],
                   "patch": {"580.142": {"supported": True, "qualification": "compile-verified"},
                             "580.178.04": {"supported": True, "qualification": "compile-verified",
                                            "inherited_from": "580.142", "drifted": ["a/b/uvm.c", "c.h"]},
                             "599.1.1": {"supported": False}}},
        "driver_sources": {"mode": "auto", "pending": {"drivers": ["590.48.01"], "reason": "dpkg is running"},
                           "cache": {"dir": "/var/cache/spark-memsaver/sources", "bytes": GIB,
                                     "entries": [{"driver": "580.178.04", "package": "nvidia-kernel-source-580-open",
                                                  "deb_version": "580.178.04-0ubuntu1"}]}},
        "uvm": {"loaded": True, "patched": True},
        "secure_boot": {"state": "enrolled", "certificate": {"sha256": "ab" * 32, "path": "/var/lib/dkms/mok.pub"},
                        "kernel": {"trusted_by_kernel": "yes"}},
        "memory": {"available": 100 * GIB, "total": 120 * GIB, "saved": GIB, "pagetable_backing": GIB // 4,
                   "pagetable_stock_equivalent": GIB + GIB // 4},
        "hold": {"text": "held since T, by rollback"},
        "records": {"last_validation": {"outcome": "passed", "reason": "all checks",
                                        "finished_at": "2026-12-01T10:00:00Z"}},
        "unknown": ["holders"],
        "kernels": [{"release": "6.14.0-1015-nvidia-64k", "running": True, "page_size": 65536, "headers": True,
                     "uvm_selected": {"patched": True, "path": "/p", "version": "580.142"}},
                    {"release": "6.14.0-1020-nvidia", "running": False, "page_size": 4096, "headers": False,
                     "uvm_selected": {"patched": False, "path": "/q", "version": "580.142"}},
                    {"release": "6.1.0-9", "running": False, "page_size": None, "headers": True,
                     "uvm_selected": None}],
        "uvm_holders": [{"pid": 1234, "comm": "python3"}, {}],
        "findings": [{"severity": "warning", "code": "w1", "message": "something", "remedy": "do it"},
                     {"severity": "info", "code": "i1", "message": "fine", "remedy": ""}],
        "config": {"tier": "leaf"}}


def _bare_doc():
    return {"state": "stock", "host": {"kernel": None}, "driver": {"loaded_version": None, "sources": []},
            "uvm": {"loaded": False, "patched": False}, "secure_boot": {},
            "memory": {"available": None, "total": None}, "kernels": [], "findings": [],
            "driver_sources": {"mode": "never", "cache": {"dir": "/c", "bytes": 5 * GIB}}}


STATUS_TEXT = [
    'State:              active',
    'Hold:               held since T, by rollback',
    'Gain:               page-table backing saved now: 1.00 GiB (measured: 0.25 GiB instead of 1.25 GiB); usable '
    "memory gained: about 1.8 GiB (estimate from the seed project's measurement on a serving GB10 node: page-table "
    'backing 3.25 -> 0.22 GiB), not measured here',
    'Risk:               validated on this node (2026-12-01T10:00:00Z)',
    'Next:               do it',
    '',
    'Kernel:             6.14.0-1015-nvidia-64k (aarch64, 64 KiB pages)',
    'NVIDIA driver:      580.142',
    'Driver sources:     580.142: compile-verified, 580.178.04 (fetched): compile-verified by content from '
    '580.142 (drifted: uvm.c c.h), 599.1.1: not supported, 590.48.01',
    'Source cache:       1 tree (580.178.04 from nvidia-kernel-source-580-open 580.178.04-0ubuntu1), 1.00 GiB '
    'in /var/cache/spark-memsaver/sources; source_fetch: auto',
    'Source fetch:       pending for 590.48.01: runs when apt/dpkg exit (dpkg is running)',
    'nvidia-uvm:         ours (loaded)',
    'Secure Boot:        enrolled',
    'Signing key:        sha256 abababababababababababababababababababababababababababababababab '
    '(/var/lib/dkms/mok.pub); trusted by the running kernel: yes',
    'Memory:             100.00 GiB available of 120.00 GiB',
    'Page-table backing: 0.25 GiB',
    'Saved:              1.00 GiB',
    'Last validation:    passed: all checks (2026-12-01T10:00:00Z)',
    'Unknown:            holders (no /proc under this root: an image, not a running system)',
    '',
    'Kernels:',
    '    RELEASE                        PAGE  HEADERS  UVM    VERSION',
    '  * 6.14.0-1015-nvidia-64k       64 KiB  yes      ours   580.142',
    '    6.14.0-1020-nvidia            4 KiB  no       stock  580.142',
    '    6.1.0-9                       ? KiB  yes      none',
    '  (* running)',
    '',
    'Holding /dev/nvidia-uvm (2):',
    '      PID  COMMAND',
    '     1234  python3',
    '        ?  ?',
    '',
    '[warning] w1: something',
    '    remedy: do it',
    '[info] i1: fine',
]
BARE_VERBOSE = [
    'State:          stock',
    "Gain:           usable memory gained: about 1.8 GiB (estimate from the seed project's measurement on a "
    'serving GB10 node: page-table backing 3.25 -> 0.22 GiB); page-table backing saved: measured here once active',
    'Risk:           this package has not yet run on a GB10 (no NVIDIA driver here to qualify); once active, run '
    "'sudo spark-memsaver validate'",
    'Next:           nothing to do',
    '',
    'Kernel:         unknown (nothing runs under this root)',
    'NVIDIA driver:  not loaded',
    'Driver sources: none',
    'Source cache:   empty (/c), 5.00 GiB of leftovers; source_fetch: never',
    'nvidia-uvm:     stock (not loaded)',
    'Secure Boot:    unknown',
    'Memory:         n/a available of n/a',
]
BARE_TEXT = [
    'State:         stock',
    "Gain:          usable memory gained: about 1.8 GiB (estimate from the seed project's measurement on a "
    'serving GB10 node: page-table backing 3.25 -> 0.22 GiB); page-table backing saved: measured here once active',
    'Risk:          this package has not yet run on a GB10 (no NVIDIA driver here to qualify); once active, run '
    "'sudo spark-memsaver validate'",
    'Next:          nothing to do',
    '',
    'Kernel:        unknown (nothing runs under this root)',
    'NVIDIA driver: not loaded',
    'nvidia-uvm:    stock (not loaded)',
    'Secure Boot:   unknown',
    'Memory:        n/a available of n/a',
]


def test_status_text_is_every_row_in_its_place():
    """`status --verbose` of a node with everything to say: the first screen (state, hold, gain, risk, next),
    a blank line, the node's rows aligned (driver sources with their verdicts, the source cache and a pending
    fetch, the signing key, memory, the last validation, what could not be read), the kernel table with the
    running one starred, the processes holding /dev/nvidia-uvm, the findings with their remedies (kills: each
    row's label, order, wording and unit, the table's columns)."""
    from spark_memsaver.report.document import render_text
    assert render_text(_status_doc(), verbose=True).split("\n") == STATUS_TEXT


def test_status_text_of_a_bare_root_and_without_verbose():
    """An image root (no running kernel, no driver, nothing measured): its rows say so in words ('unknown',
    'not loaded', 'n/a', 'none', an empty cache with leftovers); without --verbose the internals are left out
    and the rows align to the longest label left (kills: the fallbacks' wording, the verbose switch)."""
    from spark_memsaver.report.document import render_text
    assert render_text(_bare_doc(), verbose=True).split("\n") == BARE_VERBOSE
    assert render_text(_bare_doc()).split("\n") == BARE_TEXT
    doc = _status_doc()
    doc["driver_sources"]["cache"]["entries"].append({"driver": "590.48.01", "package": "p", "deb_version": "1"})
    doc["driver_sources"]["pending"] = {"drivers": []}
    rows = render_text(doc, verbose=True).split("\n")
    assert rows[9].startswith("Source cache:       2 trees (580.178.04 from nvidia-kernel-source-580-open "
                              "580.178.04-0ubuntu1, 590.48.01 from p 1), 1.00 GiB in ")
    assert rows[10].startswith("nvidia-uvm:")


def test_status_document_carries_the_hold_and_the_config(tmp_path):
    """`status --json` (and GetStatus, metrics) carry the administrator's hold with its reason, and the config the
    verdict was made under (kills: the "hold", "config" and hold "reason" keys)."""
    from spark_memsaver.config import Config
    from spark_memsaver.host import Host, holds
    from spark_memsaver.report import document
    from tests.support import sparkroot
    k = sparkroot.SPARK_KERNEL
    host = Host(str(sparkroot.make_spark_root(tmp_path / "r", ours_installed="580.142")))
    rec = holds.hold(host, "rollback", k, "GPU fault under load")
    doc, _ = document.status_of(host, Config())
    assert doc["hold"] == {"by": "rollback", "since": rec["since"], "kernel": k, "reason": "GPU fault under load",
                           "text": f"held since {rec['since']}, by rollback; `sudo spark-memsaver install` resumes",
                           "resume": "sudo spark-memsaver install"}
    assert doc["config"] == {"kernels": "64k-only", "tier": "leaf", "interval": 60, "source": "defaults"}


def test_status_document_names_each_source_module_and_patch_verdict(tmp_path):
    """The document lists each driver source with whether it is an open tree, each kernel's selected nvidia-uvm
    with its srcversion and vermagic, the loaded one's version and parameters, the source cache (driver_sources),
    and the manifest's verdict on each source; `status --json` prints it 2-space indented in the order it is built
    (schema first) (kills: the "open", "origin", "srcversion", "vermagic", uvm's "version" and "parameters",
    "driver_sources", "patch" and each of its five keys, ``support or {}`` -> ``and``, dumps' indent and
    sort_keys)."""
    from spark_memsaver.config import Config
    from spark_memsaver.host import Host
    from spark_memsaver.report import document
    from tests.support import sparkroot
    host = Host(str(sparkroot.make_spark_root(tmp_path / "r", ours_installed="580.142")))
    doc, _ = document.status_of(host, Config())
    assert doc["driver"]["sources"] == [{"version": "580.142", "path": "/usr/src/nvidia-580.142", "open": True,
                                         "origin": "usr-src"}]
    assert doc["uvm"] == {"loaded": True, "version": "580.142", "srcversion": sparkroot.STOCK_UVM_SRCVERSION,
                          "patched": False, "parameters": {"uvm_disable_hmm": "N", "uvm_page_table_location": "(null)"},
                          "packing": None}
    assert doc["driver_sources"]["mode"] == "auto" and doc["driver_sources"]["cache"]["entries"] == []
    sel = doc["kernels"][0]["uvm_selected"]
    assert sel["srcversion"] == sparkroot.OURS_UVM_SRCVERSION and sel["vermagic"].startswith(sparkroot.SPARK_KERNEL)
    patch = doc["driver"]["patch"]["580.142"]
    assert patch == {"supported": True, "qualification": "untested", "by": "content", "inherited_from": None,
                     "drifted": ["nvidia-uvm/nvidia-uvm-sources.Kbuild", "nvidia-uvm/uvm_mmu.c",
                                 "nvidia-uvm/uvm_mmu.h"]}
    text = document.dumps(doc)
    assert text.startswith('{\n  "schema": ') and json.loads(text) == doc
    assert list(json.loads(text)) == list(doc)


def test_status_text_edges_of_sources_cache_validation_and_units():
    """A source that is not supported says so even with a qualification; an empty cache with no leftover bytes
    says only where it is; a validation record without outcome shows '?', without reason or time nothing; a hold
    without its text says "held"; an unknown page size '?'; an unknown trust "unknown"; pending fetches are
    listed with ', ' (kills: ``supported and qualification`` -> ``or``, the empty cache's "" -> "XXXX", the
    defaults '?', '' and "" of the validation row, "held", the Kernel row's '?', "unknown", the ', ' separator,
    the GiB divisor)."""
    from spark_memsaver.report import document
    assert document._source_text({"version": "599.1.1"}, {"599.1.1": {"supported": False,
                                                                      "qualification": "compile-verified"}}) \
        == "599.1.1: not supported"
    assert document._source_cache_rows({"mode": "auto", "cache": {"dir": "/c", "bytes": 0, "entries": []}}) == \
        [("Source cache", "empty (/c); source_fetch: auto")]
    assert document._mib(1476395008) == "1.38 GiB"            # 1.375 GiB exactly: rounds half to even, up
    doc = _status_doc()
    doc["records"] = {"last_validation": {"reason": "interrupted"}}
    assert "Last validation:    ?: interrupted" in document.render_text(doc).split("\n")

    def row(d, label, verbose=False):
        return [ln[len(label) + 1:].lstrip(" ") for ln in document.render_text(d, verbose).split("\n")
                if ln.startswith(label + ":")]
    doc["records"] = {"last_validation": {"outcome": "passed"}}
    assert row(doc, "Last validation") == ["passed: "]
    doc["hold"] = {}
    assert row(doc, "Hold") == ["held"]
    doc["host"]["page_size"] = None
    assert row(doc, "Kernel") == ["6.14.0-1015-nvidia-64k (aarch64, ? KiB pages)"]
    doc["secure_boot"]["kernel"] = {}
    assert row(doc, "Signing key") == [f"sha256 {'ab' * 32} (/var/lib/dkms/mok.pub); trusted by the running "
                                       "kernel: unknown"]
    doc["driver_sources"]["pending"]["drivers"] = ["590.48.01", "595.45.04"]
    assert row(doc, "Source fetch", verbose=True) == ["pending for 590.48.01, 595.45.04: runs when apt/dpkg exit "
                                                      "(dpkg is running)"]


def test_node_identity_reads_a_hostname_that_is_not_ascii(tmp_path):
    """An image's /etc/hostname with bytes outside ASCII is read with replacement characters, never an error; a
    machine-id that is not 32 hex digits is none (kills: the errors="replace" handler's name, the id test's
    ``and`` -> ``or``)."""
    from spark_memsaver.host import Host
    from spark_memsaver.report import document
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/hostname").write_bytes("nod\u00e9\n".encode())
    assert document.node_identity(Host(str(tmp_path)))["hostname"] == "nod\ufffd\ufffd"
    (tmp_path / "etc/machine-id").write_text("not-a-machine-id\n")          # only 32 hex digits are an id
    assert document.node_identity(Host(str(tmp_path)))["machine_id"] is None
    (tmp_path / "etc/machine-id").write_text("0123456789abcdef0123456789abcdef\n")
    assert document.node_identity(Host(str(tmp_path)))["machine_id"] == "0123456789abcdef0123456789abcdef"
