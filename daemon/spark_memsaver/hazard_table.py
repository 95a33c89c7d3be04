"""The known-hazards table (uvm_patch/hazards.yaml): its format, parsed and checked from text.

Pure: the caller passes the table's text (observe/snapshot.py reads the file, and the files the signatures
name). Any defect is the named ``HazardsInvalid`` with a remedy. A leaf (layer 0) so that observe/ and decide/
both read the format without importing each other; assessment lives in decide/hazards.py, which re-exports these
names.
"""

from __future__ import annotations

import functools
import re

from spark_memsaver.errors import EXIT_USAGE, MemsaverError
from spark_memsaver.record import Record

FORMAT = 1
ARM64_PAGE_SIZES = (4096, 16384, 65536)     # the page sizes an arm64 kernel can have (decide/c_macros.py too)

ARCH_ALIASES = {"aarch64": "aarch64", "arm64": "aarch64", "x86_64": "x86_64", "amd64": "x86_64",
                 "ppc64le": "ppc64le", "ppc64el": "ppc64le", "riscv64": "riscv64"}


class HazardsInvalid(MemsaverError):
    code = "hazards-invalid"
    exit_code = EXIT_USAGE
    remedy = ("Reinstall spark-memsaver: 'sudo apt-get install --reinstall spark-memsaver' (the hazards table ships "
              "in /usr/share/spark-memsaver/uvm_patch/).")


class Signature(Record, frozen=True):
    kind: str
    files: tuple[str, ...]
    macro: str
    alignment: int
    reference_page_size: int


class Hazard(Record, frozen=True):
    id: str
    code: str
    reference: str
    url: str
    component: str
    arch: tuple[str, ...]
    page_sizes: tuple[int, ...]
    affected_min: tuple[int, ...]
    affected_below: tuple[int, ...] | None
    affected_text: str
    signature: Signature
    effect: str
    remedies: tuple[str, ...]


def parse_version(text) -> tuple[int, ...] | None:
    """'595.45.04' -> (595, 45, 4); a packaging suffix ('-0ubuntu1', '-sm0.1') is ignored; else None."""
    if not isinstance(text, str):
        return None
    m = re.match(r"\s*(\d+(?:\.\d+)+)(?:$|[-+~\s])", text)
    if not m:
        return None
    return tuple(int(p) for p in m.group(1).split("."))


def _req(d: dict, key: str, where: str, kind=None):
    if not isinstance(d, dict) or key not in d:
        raise HazardsInvalid(f"hazards table: {where} lacks '{key}'")
    v = d[key]
    if kind is not None and not isinstance(v, kind):
        raise HazardsInvalid(f"hazards table: {where}.{key} has the wrong type ({type(v).__name__})")
    return v


def load_hazards(text: str, source: str = "hazards.yaml") -> list[Hazard]:
    """Parse and check the table's text; HazardsInvalid (named, with a remedy) on any defect. Parsed once per
    process for a given text (observe and decide both ask; the Hazards are frozen)."""
    return list(_load_hazards(text, source))


@functools.lru_cache(maxsize=4)
def _load_hazards(text: str, source: str) -> tuple[Hazard, ...]:
    from spark_memsaver import yamlio

    try:
        doc = yamlio.load_data(text, "hazards")
    except yamlio.yaml_error() as e:
        raise HazardsInvalid(f"{source}: not valid YAML ({e.__class__.__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise HazardsInvalid(f"{source}: not a hazards table of format {FORMAT}")
    out = []
    seen = set()
    for i, h in enumerate(_req(doc, "hazards", source, list)):
        where = f"{source}: hazards[{i}]"
        hid = _req(h, "id", where, str)
        where = f"{source}: hazard {hid}"
        if hid in seen:
            raise HazardsInvalid(f"{where}: duplicate id")
        seen.add(hid)
        code = _req(h, "code", where, str)
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", code):
            raise HazardsInvalid(f"{where}: code {code!r} is not kebab-case")
        drivers = _req(h, "drivers", where, dict)
        rng = _req(drivers, "affected", where + ".drivers", dict)
        vmin = parse_version(_req(rng, "min", where + ".drivers.affected", str))
        below = rng.get("below")
        vbelow = parse_version(below) if below is not None else None
        if vmin is None or (below is not None and vbelow is None):
            raise HazardsInvalid(f"{where}: drivers.affected holds a version that is not dotted numbers")
        sig = _req(h, "signature", where, dict)
        kind = _req(sig, "kind", where + ".signature", str)
        if kind != "submap-alignment":
            raise HazardsInvalid(f"{where}: unknown signature kind {kind!r}")
        files = _req(sig, "file", where + ".signature")
        files = (files,) if isinstance(files, str) else tuple(files) if isinstance(files, list) else None
        if not files or not all(isinstance(f, str) and f and not f.startswith("/") and ".." not in f.split("/")
                                for f in files):
            raise HazardsInvalid(f"{where}: signature.file must be relative paths inside the driver source")
        align = _req(sig, "alignment", where + ".signature", int)
        ref_ps = _req(sig, "reference_page_size", where + ".signature", int)
        if align <= 0 or align & (align - 1) or ref_ps not in ARM64_PAGE_SIZES:
            raise HazardsInvalid(f"{where}: signature.alignment must be a power of two and "
                                 f"reference_page_size one of {ARM64_PAGE_SIZES}")
        arch = tuple(ARCH_ALIASES.get(a, a) for a in _req(h, "arch", where, list))
        page_sizes = tuple(_req(h, "page_sizes", where, list))
        if not page_sizes or not all(isinstance(p, int) and p > 0 for p in page_sizes):
            raise HazardsInvalid(f"{where}: page_sizes must be byte counts")
        remedies = tuple(_req(h, "remedies", where, list))
        if not remedies or not all(isinstance(r, str) and r.strip() for r in remedies):
            raise HazardsInvalid(f"{where}: remedies must be non-empty text")
        affected_text = f"{rng['min']} and newer" if below is None else f"{rng['min']} up to (not including) {below}"
        out.append(Hazard(
            id=hid, code=code, reference=_req(h, "reference", where, str), url=str(h.get("url", "")),
            component=_req(h, "component", where, str), arch=arch, page_sizes=page_sizes,
            affected_min=vmin, affected_below=vbelow, affected_text=affected_text,
            signature=Signature(kind, files, _req(sig, "macro", where + ".signature", str), align, ref_ps),
            effect=" ".join(_req(h, "effect", where, str).split()),
            remedies=tuple(" ".join(r.split()) for r in remedies)))
    return tuple(out)
