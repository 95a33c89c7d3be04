"""Qualification by content (pure): which manifest entry vouches for an NVIDIA tree, judged by the bytes of the
files our hook patch touches ("hooked files"), not only by the version string the tree carries.

The manifest records, per compile-verified tree, ``hooked_files: {version: {path: sha256}}`` (paths as in the
patch, relative to the /usr/src-layout tree root, e.g. ``nvidia-uvm/uvm_mmu.c``; written by uvm_patch/gen-hashes).
:func:`decide` maps (version, the manifest's version match, the tree's hashes) to a verdict:

* exact version entry, hooked files as recorded (or no tree / nothing recorded): the entry's qualification,
  ``by: version``;
* exact version entry of a compile-verified tree, hooked files differ: ``untested``, ``by: content``,
  ``drifted`` names the files (a relabelled or modified tree is not what was compiled);
* range match or no match, hooked files identical to a compile-verified tree of the same branch:
  ``compile-verified``, ``by: content``, ``inherited_from`` that version (the nearest one if several);
* otherwise: ``untested`` (the dry run decides, as before), ``by: version``; ``drifted`` lists the files that
  differ from the closest compile-verified tree of the branch (``compared_with``) when a tree was given.

Inputs are plain data (entries need ``branch``, ``qualification``, ``versions``, ``verified_on``,
``hooked_files`` attributes); hashing the tree is the caller's I/O (act/patch.py ``qualify``).
"""

from __future__ import annotations

import re

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def hooked_paths(patch_text: str) -> list[str]:
    """Files a unified diff changes, as ``patch -p1`` sees them (``+++ b/nvidia-uvm/uvm_mmu.c`` -> that path)."""
    out = []
    for line in patch_text.splitlines():
        if line.startswith("+++ "):
            name = line[4:].split("\t")[0].strip()
            if name == "/dev/null":
                continue
            name = name.split("/", 1)[1] if "/" in name else name
            if name not in out:
                out.append(name)
    return sorted(out)


def check_hooked_files(raw, versions: list[str], paths: list[str]) -> str | None:
    """Why a manifest entry's ``hooked_files`` value is malformed, or None (absent is fine: ``{}``)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        return "hooked_files is not a mapping of version -> {path: sha256}"
    for v, files in raw.items():
        if str(v) not in versions:
            return f"hooked_files names {v!r}, which is not one of the entry's versions"
        if not isinstance(files, dict):
            return f"hooked_files[{v}] is not a mapping of path -> sha256"
        if sorted(str(p) for p in files) != sorted(paths):
            return (f"hooked_files[{v}] lists {sorted(map(str, files))}, but the branch's patch touches "
                    f"{sorted(paths)}")
        bad = [p for p, h in files.items() if not _SHA256.match(str(h))]
        if bad:
            return f"hooked_files[{v}]: not a sha256 for {bad}"
    return None


def _vkey(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def distance(a: str, b: str):
    """Sort key of version `a` seen from `b`: same major first, then lower before higher, then closest."""
    ka, kb = _vkey(a), _vkey(b)
    return (abs(ka[0] - kb[0]), ka > kb, [abs(x - y) for x, y in zip(ka[1:], kb[1:])])


def _verdict(qualification, by, *, branch, match, verified_on=(), inherited_from=None, drifted=(),
             compared_with=None, recorded=False) -> dict:
    return {"qualification": qualification, "by": by, "inherited_from": inherited_from,
            "drifted": sorted(drifted), "compared_with": compared_with, "branch": branch, "match": match,
            "verified_on": list(verified_on), "hashes_recorded": recorded}


def _differs(recorded: dict, hashes: dict) -> list[str]:
    return [p for p, h in recorded.items() if hashes.get(p) != h]


def decide(version: str, entry, match: str | None, hashes: dict | None, entries: list,
           nearest_branch: str | None = None) -> dict:
    """The verdict for a tree labelled `version`.

    entry/match: the manifest entry the version selects and how (``"exact"``, ``"range"``, or None/None);
    hashes: ``{path: sha256 or None}`` of the tree's files (None = no tree given); entries: every manifest entry;
    nearest_branch: the branch an unlisted version is compared with (its verdict is ``untested``, match
    ``nearest``, unless an identical tree vouches for it: then match ``content``).
    """
    if match == "exact":
        recorded = (entry.hooked_files or {}).get(version)
        if hashes is None or not recorded:
            return _verdict(entry.qualification, "version", branch=entry.branch, match="exact",
                            verified_on=entry.verified_on, recorded=bool(recorded))
        drifted = _differs(recorded, hashes)
        if drifted and entry.qualification == "compile-verified":
            return _verdict("untested", "content", branch=entry.branch, match="exact", drifted=drifted,
                            compared_with=version, recorded=True)
        return _verdict(entry.qualification, "version", branch=entry.branch, match="exact",
                        verified_on=entry.verified_on, drifted=drifted, recorded=True)
    branch = entry.branch if entry is not None else nearest_branch
    cands = [(v, e, files) for e in entries if e.branch == branch and e.qualification == "compile-verified"
             for v, files in (e.hooked_files or {}).items()]
    if hashes is not None and cands:
        same = [c for c in cands if not _differs(c[2], hashes)]
        if same:
            v, e, _ = min(same, key=lambda c: distance(c[0], version))
            return _verdict("compile-verified", "content", branch=branch, match=match or "content",
                            verified_on=e.verified_on, inherited_from=v, recorded=True)
    verdict = _verdict("untested", "version", branch=branch, match=match or "nearest", recorded=False)
    if hashes is not None and cands:
        v, _, files = min(cands, key=lambda c: (len(_differs(c[2], hashes)), distance(c[0], version)))
        verdict.update(drifted=sorted(_differs(files, hashes)), compared_with=v)
    return verdict
