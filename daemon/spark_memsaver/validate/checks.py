"""Checks of ``spark-memsaver validate``: counters (packing) and the kernel log (pure, but for KernelLog)."""

from __future__ import annotations

import os
import re

from spark_memsaver.errors import MemsaverError
from spark_memsaver.host.safetext import safe
from spark_memsaver.validate.params import FAIL, MIB, NA, PASS, SKIP, STOCK_REASON

# --- checks and counters (pure) ------------------------------------------------------------------------

def check(name: str, status: str, detail: str, data=None) -> dict:
    d = {"name": name, "status": status, "detail": detail}
    if data is not None:
        d["data"] = data
    return d


def _tables(s: dict) -> int:
    return sum(c.get("tables", 0) for c in s.get("classes", {}).values())


def _zero_stats() -> dict:
    return {"format": 1, "tier": None, "trees_packed": 0, "trees_unpacked": 0, "backing_bytes": 0,
            "stock_bytes": 0, "saved_bytes": 0,
            "classes": {c: {"tables": 0, "pages": 0, "backing_bytes": 0, "stock_bytes": 0, "saved_bytes": 0}
                        for c in ("256", "4096")}}


def _signature(s: dict) -> dict:
    sig = {"trees_packed": s.get("trees_packed", 0), "backing_bytes": s.get("backing_bytes", 0)}
    for cls, v in s.get("classes", {}).items():
        sig[f"c{cls}_tables"] = v.get("tables", 0)
        sig[f"c{cls}_pages"] = v.get("pages", 0)
    return sig


def packing_checks(before: dict | None, peak: dict | None, after: dict | None) -> list[dict]:
    """Checks on the packing counters from three observe_uvm() readings: before, at peak, after teardown.

    Stock module (no counters at all): both checks not-applicable, "stock module: counters absent".
    Packed module: at peak the live tables and backing bytes must have grown; after teardown every live count
    (trees, tables and pages per class, backing bytes) must equal the baseline. Tier off, or a GPU whose trees
    the module declines to pack (unpacked_reason), make them skip / not-applicable with the reason.
    """
    names = ("packing-counters-move", "packing-counters-return")
    stats = [(x or {}).get("packing") for x in (before, peak, after)]
    if all(s is None for s in stats):
        loaded = any((x or {}).get("loaded") for x in (before, peak, after))
        reason = STOCK_REASON if loaded else "nvidia-uvm not loaded: counters absent"
        return [check(n, NA, reason) for n in names]
    errs = [s["error"] for s in stats if s and "error" in s]
    if errs:
        return [check(n, FAIL, f"counters unreadable: {errs[0]}") for n in names]
    b, p, a = stats
    if b is None:
        if (before or {}).get("loaded"):
            return [check(n, FAIL, "counters appeared during the run: the module changed under it") for n in names]
        b = _zero_stats()  # nvidia-uvm was loaded by this run: its baseline is empty
    if p is None or a is None:
        return [check(n, FAIL, "counters vanished during the run: nvidia-uvm unloaded or replaced")
                for n in names]
    out = []
    bad = [f"{label}: saved_bytes {s['saved_bytes']} != stock_bytes {s['stock_bytes']} - backing_bytes "
           f"{s['backing_bytes']}" for label, s in (("before", b), ("peak", p), ("after", a))
           if s.get("tier") is not None and s["saved_bytes"] != s["stock_bytes"] - s["backing_bytes"]]
    out.append(check("packing-counters-consistent", FAIL if bad else PASS,
                     "; ".join(bad) if bad else "saved = stock - backing in every reading"))
    if str(p.get("tier")).lower() in ("off", "0"):
        return out + [check(n, SKIP, "packing tier is off (uvm_pt_pack=0): nothing is packed") for n in names]
    d_tables = _tables(p) - _tables(b)
    d_backing = p["backing_bytes"] - b["backing_bytes"]
    d_trees = p.get("trees_packed", 0) - b.get("trees_packed", 0)
    moved = {"tables": d_tables, "backing_bytes": d_backing, "trees_packed": d_trees}
    if d_trees <= 0 and d_tables <= 0 and p.get("trees_unpacked", 0) > b.get("trees_unpacked", 0):
        reason = f"this GPU's page trees are not packed: unpacked_reason {p.get('unpacked_reason')}"
        return out + [check(n, NA, reason, moved) for n in names]
    if d_tables > 0 and d_backing > 0:
        out.append(check(names[0], PASS, f"+{d_tables} packed tables, +{d_backing / MIB:.2f} MiB backing at peak",
                         moved))
    else:
        out.append(check(names[0], FAIL, f"counters did not grow at peak (tables {d_tables:+d}, backing "
                                         f"{d_backing:+d} B, trees {d_trees:+d})", moved))
    sb, sa = _signature(b), _signature(a)
    diff = {k: sa.get(k, 0) - sb.get(k, 0) for k in set(sb) | set(sa) if sa.get(k, 0) != sb.get(k, 0)}
    if diff:
        out.append(check(names[1], FAIL, "after teardown the counters differ from the baseline: "
                         + ", ".join(f"{k} {v:+d}" for k, v in sorted(diff.items())), diff))
    else:
        out.append(check(names[1], PASS, "trees, tables, pages and backing bytes back to the baseline"))
    return out


# --- kernel log -------------------------------------------------------------------------------------

LOG_PATTERNS = (
    ("xid", re.compile(r"NVRM: Xid \((?P<dev>[^)]*)\): (?P<xid>\d+)")),
    ("uvm-assert", re.compile(r"nvidia-uvm: .*Assert failed")),
    ("uvm-fatal", re.compile(r"nvidia-uvm: .*global fatal error")),
    ("uvm-error", re.compile(r"nvidia-uvm: .*(?:\bERROR: |\bfailed\b)")),
    ("alloc-failure", re.compile(r"page allocation failure|NV_ERR_NO_MEMORY|NVRM: .*(?:failed to allocate|"
                                 r"out of memory)", re.I)),
    ("oom-kill", re.compile(r"Out of memory: Killed process|oom-kill:|invoked oom-killer")),
    ("kernel-warning", re.compile(r"WARNING: CPU: \d+ PID: \d+ at .*(?:nvidia|uvm)")),
    ("kernel-bug", re.compile(r"\bBUG: |\bOops\b|general protection fault|Kernel panic")),
)

_KMSG_RE = re.compile(r"^(?P<prio>\d+),(?P<seq>\d+),(?P<ts>\d+),[^;]*;(?P<msg>.*)$", re.S)
_DMESG_RE = re.compile(r"^\[\s*(?P<ts>\d+\.\d+)\]\s?(?P<msg>.*)$")


def parse_kmsg_record(rec: str) -> dict | None:
    """One /dev/kmsg record: 'prio,seq,usec,flags;message' + optional ' KEY=value' continuation lines."""
    first = rec.split("\n", 1)[0]
    m = _KMSG_RE.match(first)
    if not m:
        return None
    return {"level": int(m["prio"]) & 7, "seq": int(m["seq"]), "ts": int(m["ts"]) / 1e6, "msg": m["msg"]}


def parse_dmesg_line(line: str) -> dict | None:
    m = _DMESG_RE.match(line)
    if not m:
        return None
    return {"ts": float(m["ts"]), "msg": m["msg"]}


def scan_messages(messages: list[str]) -> list[dict]:
    """Kernel-log messages that mean trouble for a UVM qualification, each with its kind."""
    events = []
    for msg in messages:
        for kind, rx in LOG_PATTERNS:
            m = rx.search(msg)
            if m:
                ev = {"kind": kind, "line": safe(msg.strip()[:400])}    # the kernel log quotes process names
                if kind == "xid":
                    ev["xid"] = int(m["xid"])
                    ev["device"] = m["dev"]
                events.append(ev)
                break
    return events


class KernelLog:
    """Marks the kernel log at start and returns the messages that appeared since, from /dev/kmsg or dmesg."""

    def __init__(self, host):
        self.host = host
        self.fd = None
        self.source = None
        self.reason = None
        self.mark = None

    def start(self) -> None:
        errors = []
        if self.host.is_live:
            try:
                fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
                try:
                    os.lseek(fd, 0, os.SEEK_END)
                except OSError:
                    pass
                self.fd, self.source = fd, "/dev/kmsg"
                return
            except OSError as e:
                errors.append(f"/dev/kmsg: {e.strerror or e}")
        try:
            r = self.host.run(["dmesg"], timeout=15)
            if r.ok:
                lines = [x for x in (parse_dmesg_line(ln) for ln in r.stdout.splitlines()) if x]
                self.mark = (lines[-1]["ts"], lines[-1]["msg"]) if lines else (-1.0, "")
                self.source = "dmesg"
                return
            errors.append(f"dmesg: {(r.stderr or r.stdout).strip()[:200]}")
        except MemsaverError as e:
            errors.append(f"dmesg: {e.message}")
        self.reason = "; ".join(errors) or "no kernel log"

    def collect(self) -> list[str]:
        if self.source == "/dev/kmsg":
            msgs = []
            while True:
                try:
                    data = os.read(self.fd, 16384)
                except BlockingIOError:
                    break
                except BrokenPipeError:   # records overwritten while we read: go on with the next one
                    continue
                except OSError as e:
                    self.reason = f"/dev/kmsg read: {e}"
                    break
                if not data:
                    break
                rec = parse_kmsg_record(data.decode(errors="replace"))
                if rec:
                    msgs.append(rec["msg"])
            os.close(self.fd)
            self.fd = None
            return msgs
        if self.source == "dmesg":
            try:
                r = self.host.run(["dmesg"], timeout=15)
            except MemsaverError as e:
                self.reason = f"dmesg: {e.message}"
                return []
            lines = [x for x in (parse_dmesg_line(ln) for ln in r.stdout.splitlines()) if x]
            return [x["msg"] for x in lines if (x["ts"], x["msg"]) > self.mark]
        return []


def log_check(log_source: str | None, reason: str | None, events: list[dict]) -> dict:
    if log_source is None:
        return check("kernel-log", SKIP, f"kernel log not readable ({reason}); run as root to scan it")
    if events:
        kinds = sorted({e["kind"] for e in events})
        return check("kernel-log", FAIL, f"{len(events)} kernel-log event(s) during the run: {', '.join(kinds)}; "
                     f"first: {events[0]['line']}", {"events": events[:50]})
    return check("kernel-log", PASS, f"no Xid, UVM assertion or allocation failure in {log_source}")
