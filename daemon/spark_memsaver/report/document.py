"""Report: the versioned status document (``status --json``, D-Bus GetStatus) and its readable form.

The document's JSON Schema is ``status.schema.json`` beside this file; schema version 2 (1 plus
``host.hostname``, ``host.machine_id`` and ``generated_at``, so documents from several nodes compare).
"""

from __future__ import annotations

import json
import os
import time

from spark_memsaver import __version__
from spark_memsaver.config import Config
from spark_memsaver.decide.ours import is_ours
from spark_memsaver.decide.status import Verdict, evaluate
from spark_memsaver.host import Host

SCHEMA_VERSION = 2


def node_identity(host: Host) -> dict:
    """hostname and machine id of the node under the root (a container or image root: its own files)."""
    import re

    def read(path):
        try:
            with open(host.path(path), encoding="ascii", errors="replace") as f:
                return f.readline().strip()
        except OSError:
            return None
    hostname = read("/etc/hostname") if not host.is_live else (os.uname().nodename or read("/etc/hostname"))
    mid = read("/etc/machine-id")
    return {"hostname": hostname or None, "machine_id": mid if mid and re.fullmatch(r"[0-9a-f]{32}", mid) else None}


def _uvm_column(sel: dict) -> str:
    """The Kernels table's UVM column: ours, stock, unreadable (the index names a file modinfo cannot read) or none."""
    if sel.get("state") == "unreadable":
        return "unreadable"
    return "ours" if is_ours(sel) else ("stock" if sel.get("path") else "none")


def _uvm_selected(k) -> dict | None:
    sel = k.uvm_selected
    if not sel:
        return None
    return {"path": sel.path, "version": sel.version, "patched": sel.patched, "signer": sel.signer,
            "srcversion": sel.srcversion, "vermagic": sel.vermagic, "state": sel.state}


def _hold(w) -> dict | None:
    """The administrator's hold on the running kernel (decide/hold.py), with the line status prints."""
    from spark_memsaver.decide import hold as holds
    k = w.host.kernel
    h = holds.held(w.records, k) if k else None
    if not h:
        return None
    return {"by": h.get("by"), "since": h.get("since"), "kernel": h.get("kernel"), "reason": h.get("reason"),
            "text": holds.describe(h, k, k), "resume": holds.resume_command(h, k, k),
            **({"unreadable": h["unreadable"]} if h.get("unreadable") else {})}


def build_document(w, verdict: Verdict, config: Config, identity: dict | None = None) -> dict:
    """The status document from a world (model.World), its verdict and the config; ``identity`` (node_identity)
    joins ``host``."""
    uvm = w.uvm
    return {
        "schema": SCHEMA_VERSION,
        "version": __version__,
        "state": verdict.state,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": dict(w.host.as_json(), **(identity or {})),
        "driver": {"loaded_version": w.driver.loaded_version,
                   "sources": [{"version": s.version, "path": s.path, "open": s.open,
                                "origin": s.origin or "usr-src"} for s in w.driver.sources]},
        **({"driver_sources": w.driver_sources} if isinstance(w.driver_sources, dict) else {}),
        "uvm": {"loaded": uvm.loaded, "version": uvm.version, "srcversion": uvm.srcversion,
                "patched": uvm.patched, "parameters": uvm.parameters, "packing": uvm.packing},
        "kernels": [{"release": k.release, "running": k.running, "page_size": k.page_size,
                     "headers": k.headers, "uvm_selected": _uvm_selected(k),
                     "nvidia_version": k.nvidia_selected.version if k.nvidia_selected else None}
                    for k in w.kernels],
        "dkms": w.dkms.as_json(),
        "secure_boot": w.secure_boot,
        "uvm_holders": [h.as_json() for h in w.holders],
        "memory": w.memory.as_json(),
        "records": w.records.as_json(),
        "config": {"kernels": config.kernels, "tier": config.tier, "interval": config.interval,
                   "source": config.source},
        "findings": [x.to_dict() for x in verdict.findings],
        "hold": _hold(w),
        "unknown": list(w.unknown),
    }


def status_of(host: Host, config: Config) -> tuple[dict, Verdict]:
    """(document, verdict) of ``status`` over world.facts -- the facts install and reconcile decide
    installability from (act/installable.observe takes the same): what every status reader calls (cli status,
    metrics, the daemon's status process). Imports nothing of act/ (tests/test_layers.py)."""
    from spark_memsaver import world
    return status(host, config, *world.facts(host, config))


def status(host: Host, config: Config, snap: dict, support: dict) -> tuple[dict, Verdict]:
    """The document and its verdict from the planner's snapshot and manifest verdict (world.facts; status_of
    gathers them): status, install and reconcile decide installability from the same facts
    (decide/installability.py). report/ imports nothing of act/."""
    verdict = evaluate(snap, config, support)
    doc = build_document(snap, verdict, config, node_identity(host))
    # the manifest's verdict on each driver source, by content where the tree is here (world/support.support)
    doc["driver"]["patch"] = {s["version"]: {k: sup.get(k) for k in ("supported", "qualification", "by",
                                                                     "inherited_from", "drifted")}
                              for s in doc["driver"]["sources"] if (sup := (support or {}).get(s["version"]))}
    return doc, verdict


def _source_text(s: dict, patch: dict) -> str:
    """'580.178.04 (fetched): compile-verified by content from 580.142'."""
    p = patch.get(s["version"]) or {}
    note = ""
    if p.get("supported") and p.get("qualification"):
        note = (p["qualification"] + (f" by content from {p['inherited_from']}" if p.get("inherited_from") else "")
                + (f" (drifted: {' '.join(d.rsplit('/', 1)[-1] for d in p['drifted'])})" if p.get("drifted") else ""))
    elif p:
        note = "not supported"
    return s["version"] + (" (fetched)" if s.get("origin") == "cache" else "") + (f": {note}" if note else "")


def _mib(n) -> str:
    """One unit in the text: GiB with two decimals (JSON keeps bytes)."""
    if n is None:
        return "n/a"
    return f"{n / 1073741824:.2f} GiB"


def _memory_line(mem: dict) -> str:
    """Available of total, the gap CUDA cannot see on GB10 (MemFree vs MemAvailable), the free 2 MiB blocks."""
    from spark_memsaver.report.memory import status_line
    return status_line(mem) or f"{_mib(mem.get('available'))} available of {_mib(mem.get('total'))}"


def _source_cache_rows(ds: dict | None) -> list[tuple[str, str]]:
    """The driver-source cache (act/source_fetch.py): its trees and size, and a fetch waiting for apt."""
    if not isinstance(ds, dict):
        return []
    cache = ds.get("cache") or {}
    entries = cache.get("entries") or []
    what = (f"{len(entries)} tree{'s' if len(entries) != 1 else ''} ("
            + ", ".join(f"{e.get('driver')} from {e.get('package')} {e.get('deb_version')}" for e in entries)
            + f"), {_mib(cache.get('bytes') or 0)} in {cache.get('dir')}") if entries else \
        f"empty ({cache.get('dir')})" + (f", {_mib(cache['bytes'])} of leftovers" if cache.get("bytes") else "")
    rows = [("Source cache", what + f"; source_fetch: {ds.get('mode')}")]
    pend = ds.get("pending")
    if isinstance(pend, dict) and pend.get("drivers"):
        rows.append(("Source fetch", f"pending for {', '.join(map(str, pend['drivers']))}: runs when apt/dpkg exit "
                     f"({pend.get('reason')})"))
    return rows


def _signing_key_row(sb: dict) -> list:
    """The signing certificate's SHA-256 (one per fleet when signing_cert is shared) and the kernel's trust."""
    c = sb.get("certificate") or {}
    if not c.get("sha256"):
        return []
    trust = (sb.get("kernel") or {}).get("trusted_by_kernel") or "unknown"
    return [("Signing key", f"sha256 {c['sha256']} ({c.get('path')}); trusted by the running kernel: {trust}")]


def render_text(doc: dict, verbose: bool = False) -> str:
    """Aligned, readable status: first what packing gives here, the risk and the one next step
    (report/summary.py); then the node; the internals (driver-source drift, source cache) with ``verbose``."""
    from spark_memsaver.report import summary
    unknown = doc.get("unknown") or []
    kernel = (f"{doc['host']['kernel']} ({doc['host']['arch']}, {(doc['host']['page_size'] or 0) // 1024 or '?'}"
              " KiB pages)") if doc["host"].get("kernel") else "unknown (nothing runs under this root)"
    first = [(k, v) for k, v in (("Gain", summary.gain(doc)), ("Risk", summary.risk(doc)),
                                 ("Next", summary.next_step(doc) or "nothing to do")) if v]
    internals = [("Driver sources", ", ".join(_source_text(s, doc["driver"].get("patch") or {})
                                              for s in doc["driver"]["sources"]) or "none"),
                 *_source_cache_rows(doc.get("driver_sources"))] if verbose else []
    rows = [
        ("State", doc["state"]),
        *first,
        ("Kernel", kernel),
        ("NVIDIA driver", doc["driver"]["loaded_version"] or "not loaded"),
        *internals,
        ("nvidia-uvm", ("ours" if is_ours(doc["uvm"]) else "stock") + (" (loaded" + _tier_note(doc) + ")"
                                                                       if doc["uvm"]["loaded"] else " (not loaded)")),
        ("Secure Boot", doc["secure_boot"].get("state", "unknown")),
        *_signing_key_row(doc["secure_boot"]),
        ("Memory", _memory_line(doc["memory"])),
    ]
    if doc["memory"].get("saved") is not None:     # measured only where ours packs: the Gain line says the rest
        rows += [("Page-table backing", _mib(doc["memory"]["pagetable_backing"])),
                 ("Saved", _mib(doc["memory"]["saved"]))]
    if isinstance(doc.get("hold"), dict):
        rows.insert(1, ("Hold", doc["hold"].get("text") or "held"))
    last = (doc.get("records") or {}).get("last_validation")
    if isinstance(last, dict):
        rows.append(("Last validation", f"{last.get('outcome', '?')}: {last.get('reason', '')}"
                     + (f" ({last.get('finished_at')})"
                        if last.get("finished_at") else "")))
    if unknown:
        rows.append(("Unknown", ", ".join(unknown) + " (no /proc under this root: an image, not a running system)"))
    width = max(len(r[0]) for r in rows) + 2
    lines = [f"{k + ':':<{width}}{v}" for k, v in rows]
    lines.insert(1 + len(first) + (1 if isinstance(doc.get("hold"), dict) else 0), "")   # the first screen ends
    if doc["kernels"]:
        lines.append("")
        lines.append("Kernels:")
        uvm = [_uvm_column(k["uvm_selected"] or {}) for k in doc["kernels"]]
        w = max(6, *map(len, uvm))
        lines.append(f"  {'':1} {'RELEASE':<28} {'PAGE':>6}  {'HEADERS':<8} {'UVM':<{w}} {'VERSION'}")
        for k, which in zip(doc["kernels"], uvm):
            sel = k["uvm_selected"] or {}
            page = f"{(k['page_size'] or 0) // 1024 or '?'} KiB"
            lines.append(f"  {'*' if k['running'] else ' '} {k['release']:<28} {page:>6}  "
                         f"{'yes' if k['headers'] else 'no':<8} {which:<{w}} {sel.get('version') or ''}".rstrip())
        if any(k["running"] for k in doc["kernels"]):
            lines.append("  (* running)")
    holders = doc.get("uvm_holders")
    if holders:
        lines.append("")
        lines.append(f"Holding /dev/nvidia-uvm ({len(holders)}):")
        lines.append(f"  {'PID':>7}  COMMAND")
        for h in holders:
            lines.append(f"  {h.get('pid', '?'):>7}  {h.get('comm', '?')}")
    if doc["findings"]:
        lines.append("")
        for f in doc["findings"]:
            lines.append(f"[{f['severity']}] {f['code']}: {f['message']}")
            if f.get("remedy"):
                lines.append(f"    remedy: {f['remedy']}")
    return "\n".join(lines)


def _tier_note(doc: dict) -> str:
    """', tier 256; configured: leaf': the tier ours runs with (decide/packing.running_tier), and the configured
    one when they differ (the next build uses that)."""
    from spark_memsaver.decide.packing import running_tier
    run = running_tier(doc.get("uvm"))
    if run is None:
        return ""
    conf = str((doc.get("config") or {}).get("tier") or "")
    return f", tier {run}" + (f"; configured: {conf}" if conf and conf != run else "")


def dumps(doc: dict) -> str:
    return json.dumps(doc, indent=2, sort_keys=False)
