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
exception. A text this reader cannot read at all (past its limits: nesting, size, work; or any failure of
the check itself) is not the file's answer: the version rule decides, and an info finding
(``hazard-check-failed``: "hazard check could not read nv-linux.h: ...") says so.

The table's format and loader are in hazard_table.py (a leaf: observe/ reads it too); every public name is importable from here.
"""

from __future__ import annotations

from spark_memsaver.decide.c_expr import CEvalError, CLimitError
from spark_memsaver.decide.c_macros import ARM64_PAGE_SIZES, kib as _kib, macro_value
from spark_memsaver.hazard_table import (
    ARCH_ALIASES as _ARCH_ALIASES, FORMAT, Hazard, HazardsInvalid, Signature, load_hazards, parse_version)
from spark_memsaver.record import Record, asdict, field

__all__ = ["AFFECTED", "ARM64_PAGE_SIZES", "Assessment", "CEvalError", "ContentVerdict", "FORMAT", "Hazard",
           "HazardsInvalid", "NOT_AFFECTED", "Signature", "UNKNOWN", "assess", "content_verdict", "finding",
           "findings_from_inputs", "load_hazards", "macro_value", "parse_version"]

AFFECTED = "affected"
NOT_AFFECTED = "not-affected"
UNKNOWN = "unknown"


# ----------------------------------------------------------------------------------------------
# Assessment


class Assessment(Record, frozen=True):
    hazard: str
    reference: str
    state: str                      # AFFECTED | NOT_AFFECTED | UNKNOWN
    decided_by: str | None          # "platform" | "content" | "version" | None (not decidable)
    reason: str
    driver_version: str | None
    arch: str | None
    page_size: int | None
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _in_range(h: Hazard, v: tuple[int, ...]) -> bool:
    return v >= h.affected_min and (h.affected_below is None or v < h.affected_below)


def assess(hazard: Hazard, *, driver_version: str | None, arch: str | None, page_size: int | None,
           nv_linux_h_text: str | None, read_error: str | None = None) -> Assessment:
    """Decide whether this node meets the hazard. Pure; never raises for odd input.

    ``read_error``: the file exists but could not be read (e.g. over the size cap); like a text past the
    reader's limits, the version rule then decides and ``details["check_failed"]`` holds the reason."""
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

    failed = None
    if nv_linux_h_text is not None:
        try:
            c = content_verdict(hazard.signature, nv_linux_h_text, page_size)
        except CLimitError as e:
            c, failed = None, str(e)
        except Exception as e:              # noqa: BLE001 - any failure of the check: the version decides
            c, failed = None, f"{type(e).__name__}: {e}"[:400]
        if c is None:
            pass
        elif c.state == UNKNOWN:
            hint = ""
            if by_version is not None:
                hint = (f"; by version alone ({hazard.affected_text}) driver {driver_version} would be "
                        f"{by_version}")
            return result(UNKNOWN, "content", f"the driver source could not be read for "
                          f"{hazard.signature.macro}: {c.reason}{hint}", **c.details)
        else:
            return result(c.state, "content", c.reason, **c.details)
    elif read_error:
        failed = read_error
    if failed is not None:
        failed = f"hazard check could not read {hazard.signature.files[0].rsplit('/', 1)[-1]}: {failed}"
        if version is None:
            return result(UNKNOWN, None, f"{failed}; no readable driver version", check_failed=failed)
        return result(by_version, "version", f"{failed}; decided by the version range {hazard.affected_text}: "
                      f"driver {driver_version} is {'inside' if by_version == AFFECTED else 'outside'} it",
                      check_failed=failed)

    if version is None:
        return result(UNKNOWN, None, "no driver source on this node and no readable driver version"
                      + (f" ({driver_version!r})" if driver_version else ""))
    return result(by_version, "version",
                  f"no driver source on this node (precompiled modules): decided by the version range "
                  f"{hazard.affected_text}, not by the source; driver {driver_version} is "
                  f"{'inside' if by_version == AFFECTED else 'outside'} it")


class ContentVerdict(Record, frozen=True):
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
    except CLimitError:
        raise                               # not the file's answer: assess() lets the version decide
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
           "version": f"decided by the driver version ({hazard.affected_text}): " + (
               "the driver source's nv-linux.h could not be read" if a.details.get("check_failed")
               else "no driver source on this node")}
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
    errors = inputs.get("source_errors") or {}
    out = []
    for h in table_hazards:
        text = next((sources[f] for f in h.signature.files if sources.get(f) is not None), None)
        error = next((errors[f] for f in h.signature.files if errors.get(f)), None) if text is None else None
        kw = dict(driver_version=inputs.get("driver_version"), arch=inputs.get("arch"),
                  page_size=inputs.get("page_size"))
        try:
            a = assess(h, nv_linux_h_text=text, read_error=error, **kw)
        except Exception as e:              # noqa: BLE001 - assess() is not expected to raise; if it does,
            a = assess(h, nv_linux_h_text=None, read_error=f"{type(e).__name__}: {e}"[:400], **kw)
        if a.details.get("check_failed"):
            out.append(check_failed_finding(h, a, inputs.get("source_path")))
        f = finding(h, a)
        if f is not None:
            out.append(f)
    return out


def check_failed_finding(hazard: Hazard, a: Assessment, source_path: str | None) -> dict:
    """The info finding of a hazard check that could not read the driver's file (the version decided)."""
    where = f"{source_path}/{hazard.signature.files[0]}" if source_path else hazard.signature.files[0]
    verdict = (f"driver {a.driver_version} was judged by its version ({hazard.affected_text}) instead"
               if a.decided_by == "version" else "no driver version to judge by either")
    return {"code": "hazard-check-failed", "severity": "info",
            "message": f"The known-hazard check of {hazard.reference} skipped the driver source: "
                       f"{a.details['check_failed']}; {verdict}.",
            "remedy": (f"Restore NVIDIA's file: sudo apt-get install --reinstall \"$(dpkg -S {where} | cut -d: -f1)\". "
                       if where.startswith("/usr/src/") else "")
                      + "If it is NVIDIA's file unchanged, report this as a spark-memsaver bug with the file attached."}
