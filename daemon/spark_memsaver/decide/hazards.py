"""Known hazards of the NVIDIA driver around our module (uvm_patch/hazards.yaml): pure decisions.

Nothing here reads the host: callers pass the table's text, the observed driver version, arch,
page size and (when the driver source is on the node) the text of the file the hazard's signature
names. The answer is an ``Assessment``:

- ``affected`` / ``not-affected`` / ``unknown``;
- ``decided_by``: ``platform`` (the arch or page size alone rules it out), ``content`` (the driver
  source is present: its text decides, whatever the version, so a fixed release is recognised
  without a table change) or ``version`` (no source, e.g. precompiled modules: the version range
  decides, and the reason says so).

The only signature kind today is ``submap-alignment``: a small C preprocessor evaluator
(decide/c_macros.py, over decide/c_expr.py) finds the object-like macro the signature names, follows
the ``#if/#ifdef/#elif/#else`` structure around it for each arm64 page size (``CONFIG_ARM64_<n>K_PAGES``, ``PAGE_SHIFT``) and computes its value. Conditions
it cannot decide (symbols from other headers, function-like macros) make the answer ``unknown`` only
when the macro's value depends on them. Odd or malformed text is ``unknown`` with a reason, never an
exception.

The table's format and loader are in decide/hazard_table.py; every public name is importable from here.
"""

from __future__ import annotations

import dataclasses

from spark_memsaver.decide.c_expr import CEvalError
from spark_memsaver.decide.c_macros import ARM64_PAGE_SIZES, kib as _kib, macro_value
from spark_memsaver.decide.hazard_table import (
    ARCH_ALIASES as _ARCH_ALIASES, FORMAT, Hazard, HazardsInvalid, Signature, load_hazards, parse_version)

__all__ = ["AFFECTED", "ARM64_PAGE_SIZES", "Assessment", "CEvalError", "ContentVerdict", "FORMAT", "Hazard",
           "HazardsInvalid", "NOT_AFFECTED", "Signature", "UNKNOWN", "assess", "content_verdict", "finding",
           "findings_from_inputs", "load_hazards", "macro_value", "parse_version"]

AFFECTED = "affected"
NOT_AFFECTED = "not-affected"
UNKNOWN = "unknown"


# ----------------------------------------------------------------------------------------------
# Assessment


@dataclasses.dataclass(frozen=True)
class Assessment:
    hazard: str
    reference: str
    state: str                      # AFFECTED | NOT_AFFECTED | UNKNOWN
    decided_by: str | None          # "platform" | "content" | "version" | None (not decidable)
    reason: str
    driver_version: str | None
    arch: str | None
    page_size: int | None
    details: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _in_range(h: Hazard, v: tuple[int, ...]) -> bool:
    return v >= h.affected_min and (h.affected_below is None or v < h.affected_below)


def assess(hazard: Hazard, *, driver_version: str | None, arch: str | None, page_size: int | None,
           nv_linux_h_text: str | None) -> Assessment:
    """Decide whether this node meets the hazard. Pure; never raises for odd input."""
    norm_arch = _ARCH_ALIASES.get(arch, arch) if isinstance(arch, str) else None

    def result(state, by, reason, **details):
        return Assessment(hazard.id, hazard.reference, state, by, reason, driver_version, norm_arch,
                          page_size if isinstance(page_size, int) else None, details)

    if norm_arch is not None and norm_arch not in hazard.arch:
        return result(NOT_AFFECTED, "platform", f"{hazard.reference} needs {'/'.join(hazard.arch)}; "
                      f"this node is {norm_arch}")
    if isinstance(page_size, int) and page_size not in hazard.page_sizes:
        return result(NOT_AFFECTED, "platform", f"{hazard.reference} needs "
                      f"{' or '.join(_kib(p) for p in hazard.page_sizes)} pages; this kernel uses "
                      f"{_kib(page_size) if page_size > 0 else page_size}")
    if norm_arch is None or not isinstance(page_size, int):
        return result(UNKNOWN, None, "the node's architecture or page size was not observed")

    version = parse_version(driver_version)
    by_version = None
    if version is not None:
        by_version = AFFECTED if _in_range(hazard, version) else NOT_AFFECTED

    if nv_linux_h_text is not None:
        c = content_verdict(hazard.signature, nv_linux_h_text, page_size)
        if c.state == UNKNOWN:
            hint = ""
            if by_version is not None:
                hint = (f"; by version alone ({hazard.affected_text}) driver {driver_version} would be "
                        f"{by_version}")
            return result(UNKNOWN, "content", f"the driver source could not be read for "
                          f"{hazard.signature.macro}: {c.reason}{hint}", **c.details)
        return result(c.state, "content", c.reason, **c.details)

    if version is None:
        return result(UNKNOWN, None, "no driver source on this node and no readable driver version"
                      + (f" ({driver_version!r})" if driver_version else ""))
    return result(by_version, "version",
                  f"no driver source on this node (precompiled modules): decided by the version range "
                  f"{hazard.affected_text}, not by the source; driver {driver_version} is "
                  f"{'inside' if by_version == AFFECTED else 'outside'} it")


@dataclasses.dataclass(frozen=True)
class ContentVerdict:
    state: str
    reason: str
    details: dict


def content_verdict(sig: Signature, text: str, page_size: int) -> ContentVerdict:
    """The submap-alignment signature applied to a source text, at one arm64 page size."""
    if not isinstance(text, str) or not text.strip():
        return ContentVerdict(UNKNOWN, "the file is empty", {})
    if "\x00" in text:
        return ContentVerdict(UNKNOWN, "the file is not text (NUL bytes)", {})
    try:
        ref_pages = macro_value(text, sig.macro, sig.reference_page_size)
        pages = ref_pages if page_size == sig.reference_page_size else macro_value(text, sig.macro, page_size)
    except CEvalError as e:
        return ContentVerdict(UNKNOWN, str(e), {})
    ref_bytes, node_bytes = ref_pages * sig.reference_page_size, pages * page_size
    for ps, b in ((sig.reference_page_size, ref_bytes), (page_size, node_bytes)):
        if b <= 0 or b > 1 << 32:
            return ContentVerdict(UNKNOWN, f"{sig.macro} is {b // ps} pages at {_kib(ps)} pages "
                                  f"({b:#x} bytes), not a submap size of at most 4 GiB", {})
    details = {"macro": sig.macro, "submap_bytes": node_bytes, "reference_submap_bytes": ref_bytes,
               "alignment": sig.alignment}
    if ref_bytes % sig.alignment:
        return ContentVerdict(NOT_AFFECTED, (
            f"this tree keeps only {_kib(_lowbit(ref_bytes))} alignment for {sig.macro} on "
            f"{_kib(sig.reference_page_size)} kernels, so it does not rely on {_kib(sig.alignment)} "
            f"alignment (as in older drivers)"), details)
    if node_bytes % sig.alignment == 0:
        return ContentVerdict(NOT_AFFECTED, (
            f"this tree keeps {_kib(sig.alignment)} alignment for {sig.macro} at {_kib(page_size)} "
            f"pages ({node_bytes:#x} bytes): the fault is fixed in it"), details)
    return ContentVerdict(AFFECTED, (
        f"{sig.macro} at {_kib(page_size)} pages gives a {node_bytes:#x}-byte submap, not a multiple of "
        f"{_kib(sig.alignment)}, while this tree relies on {_kib(sig.alignment)} alignment "
        f"({ref_bytes:#x} bytes at {_kib(sig.reference_page_size)} pages)"), details)


def _lowbit(n: int) -> int:
    return n & -n


def finding(hazard: Hazard, a: Assessment) -> dict | None:
    """A status finding for an affected node; None otherwise."""
    if a.state != AFFECTED:
        return None
    where = ", ".join(x for x in (f"driver {a.driver_version}" if a.driver_version else "",
                                  "arm64" if a.arch == "aarch64" else (a.arch or ""),
                                  f"{_kib(a.page_size)} pages" if a.page_size else "") if x)
    how = {"content": "decided from nv-linux.h in the driver source",
           "version": f"decided by the driver version ({hazard.affected_text}): no driver source on this node"}
    msg = (f"GPU allocations of 4 GiB or more made with cudaMalloc/cuMemCreate fault just below each 4 GiB "
           f"boundary on this node ({where}): {hazard.reference}, a fault in {hazard.component}, not in "
           f"spark-memsaver; cudaMallocManaged is not affected ({how.get(a.decided_by, a.reason)}).")
    remedy = "; or ".join(hazard.remedies)
    remedy = remedy[0].upper() + remedy[1:] + f". Details: {hazard.url or hazard.reference}."
    return {"code": hazard.code, "severity": "warning", "message": msg, "remedy": remedy}


# ----------------------------------------------------------------------------------------------
# From the snapshot (observe/snapshot.py: observe_hazard_inputs gathers the inputs)


def findings_from_inputs(inputs: dict | None) -> list[dict]:
    """Status findings for every hazard this node meets.

    ``inputs``: ``{"table": {"path", "text" (None: not found), "error"}, "driver_version", "arch", "page_size",
    "sources": {relative path in the driver source: text}}``. No driver version and no source: nothing to say
    (there is no driver). A table that cannot be read is one info finding, never an exception.
    """
    if not inputs:
        return []
    table = inputs.get("table") or {}
    if table.get("text") is None:
        return [{"code": "hazards-table-unreadable", "severity": "info",
                 "message": "The known-hazards table could not be read ("
                            + (table.get("error") or f"not found: {table.get('path') or 'hazards.yaml'}")
                            + "): known NVIDIA driver faults are not checked.",
                 "remedy": HazardsInvalid.remedy}]
    try:
        table_hazards = load_hazards(table["text"], table.get("path") or "hazards.yaml")
    except HazardsInvalid as e:
        return [{"code": e.code, "severity": "info", "message": e.message + ": known NVIDIA driver faults are "
                 "not checked.", "remedy": e.remedy}]
    sources = inputs.get("sources") or {}
    if not inputs.get("driver_version") and not sources:
        return []
    out = []
    for h in table_hazards:
        text = next((sources[f] for f in h.signature.files if sources.get(f) is not None), None)
        a = assess(h, driver_version=inputs.get("driver_version"), arch=inputs.get("arch"),
                   page_size=inputs.get("page_size"), nv_linux_h_text=text)
        f = finding(h, a)
        if f is not None:
            out.append(f)
    return out
