"""The first screen of `status`: what packing gives on this node, the risk in one line, the one next step.

Pure functions of the status document (report/document.py); `status` prints them right under the state, and
`install` ends with :func:`next_step`.
"""

from __future__ import annotations

GIB = 1 << 30
# The seed project's measurement of the same packing (tier leaf) on a serving GB10 node: page-table backing
# 3.25 GiB -> 0.218 GiB, usable memory +1.78-1.86 GiB (README.md, "What it saves").
SEED_SAVED_GIB = 1.8
SEED_BASIS = "the seed project's measurement on a serving GB10 node: page-table backing 3.25 -> 0.22 GiB"
VALIDATE = "sudo spark-memsaver validate"
PACKING_STATES = ("active",)
OURS_STATES = ("installed", "built", "unverified", "active", "inactive")


def _gib(n) -> str:
    return f"{n / GIB:.2f} GiB"


def _packing(doc: dict) -> bool:
    """Ours is loaded, packs, and its counters read: the figures are measured (active, or unverified while
    loaded). Inactive is loaded and packs nothing (uvm_pt_pack=0, or a GPU that does not qualify)."""
    return (doc.get("memory") or {}).get("saved") is not None and doc.get("state") not in ("not-applicable",
                                                                                            "inactive")


def _page_size(doc: dict) -> int | None:
    return (doc.get("host") or {}).get("page_size")


def gain(doc: dict) -> str | None:
    """What packing gives here, in two figures that are not the same thing: the page-table backing saved now
    (measured from our module's counters while it packs) and the usable memory gained (never measured here:
    the seed project's figure, an estimate with its basis)."""
    state = doc.get("state")
    mem = doc.get("memory") or {}
    if state == "not-applicable":
        return None
    usable = f"usable memory gained: about {SEED_SAVED_GIB} GiB (estimate from {SEED_BASIS})"
    if _packing(doc):
        return (f"page-table backing saved now: {_gib(mem['saved'])} (measured: {_gib(mem['pagetable_backing'])} "
                f"instead of {_gib(mem.get('pagetable_stock_equivalent') or 0)}); {usable}, not measured here")
    ps = _page_size(doc)
    if ps and ps != 65536:
        return f"nothing measurable: with {ps // 1024} KiB pages a page table already costs little"
    if state == "inactive":
        return (f"nothing now: our nvidia-uvm is loaded but packs nothing (the finding below says why); once it "
                f"packs, {usable}")
    return f"{usable}; page-table backing saved: measured here once active"


def _validated(doc: dict) -> dict | None:
    last = (doc.get("records") or {}).get("last_validation")
    return last if isinstance(last, dict) and last.get("outcome") == "passed" else None


def risk(doc: dict) -> str | None:
    """One line: what is and is not proven about the module on this node."""
    state = doc.get("state")
    if state == "not-applicable":
        return None
    from spark_memsaver.decide.packing import tier_of
    from spark_memsaver.vocabulary import VALIDATED_TIERS
    tier = tier_of(doc)          # the running tier where ours is loaded (it packs with it), else the configured
    extra = f"; tier {tier} is not validated on hardware" if tier and tier not in VALIDATED_TIERS + ("off",) else ""
    v = _validated(doc)
    if v and _packing(doc):
        return f"validated on this node ({v.get('finished_at') or 'time not recorded'}){extra}"
    qual = qualification(doc)
    if _packing(doc):
        return (f"this package has not yet run on a GB10 ({qual}) and this node has not been validated: run "
                f"'{VALIDATE}'" + extra)
    return f"this package has not yet run on a GB10 ({qual}); once active, run '{VALIDATE}'" + extra


def qualification(doc: dict) -> str:
    """What is proven of the exact source tree ours is (or would be) built from: the manifest's verdict on the
    running kernel's driver by content (world/support.py, the document's driver.patch), never a general claim."""
    drv = next((k.get("nvidia_version") for k in doc.get("kernels") or [] if isinstance(k, dict) and k.get("running")),
               None) or (doc.get("driver") or {}).get("loaded_version")
    if not drv:
        return "no NVIDIA driver here to qualify"
    p = ((doc.get("driver") or {}).get("patch") or {}).get(drv)
    if not isinstance(p, dict):
        return f"driver {drv}: no source tree here to qualify"
    if not p.get("supported"):
        return f"driver {drv}: not supported by this release"
    q = p.get("qualification") or "untested"
    how = f" by content from {p['inherited_from']}" if p.get("inherited_from") else ""
    drift = ("; hooked files drifted: " + " ".join(str(d).rsplit("/", 1)[-1] for d in p["drifted"])
             if p.get("drifted") else "")
    return f"driver {drv}'s tree: {q}{how}{drift}"


_SEVERITY = {"error": 0, "warning": 1, "info": 2}


def _held_step(doc: dict, findings: list) -> str | None:
    """On a node the administrator held (rollback/remove; decide/hold.py): the hold's resume command, the
    remedy of the ``held`` finding, with who held it and since when. Automation never reverses the hold, so
    nothing else on the node moves until the administrator does this."""
    held = next((f for f in findings if f.get("code") == "held" and (f.get("remedy") or "").strip()), None)
    if held is None:
        return None
    from spark_memsaver import remedy as rm
    from spark_memsaver.decide import hold as holds
    hold = doc.get("hold") if isinstance(doc.get("hold"), dict) else {}
    why = f" ({holds.origin(hold)})" if hold and not hold.get("unreadable") else ""
    remedy = held["remedy"].strip()
    if "'" in remedy:           # what install needs first, then the install (decide/status.py): said as it is
        return f"{remedy} to resume packing{why}."
    return f"{rm.run(remedy)} to resume packing{why}."


def next_step(doc: dict) -> str | None:
    """The one next step: the remedy of the most severe finding that asks for something (an error first, then
    the administrator's hold: its resume command), else validation of an active node that was never validated,
    else nothing."""
    findings = sorted(doc.get("findings") or [], key=lambda f: _SEVERITY.get(f.get("severity"), 3))
    if not any(f.get("severity") == "error" for f in findings):
        step = _held_step(doc, findings)
        if step:
            return step
    for f in findings:
        remedy = (f.get("remedy") or "").strip()
        if not remedy or remedy.lower().startswith("nothing to do"):
            continue
        if f.get("severity") == "info" and f.get("code") not in ("stock", "activation-pending",
                                                                 "driver-source-fetchable", "packing-disabled",
                                                                 "ours-loaded-stock-selected"):
            continue
        return remedy
    if _packing(doc) and not _validated(doc):
        return f"Run '{VALIDATE}' to qualify packing on this node with real GPU work."
    return None
