"""Qualification by content (pure): which manifest entry vouches for an NVIDIA tree, judged by the bytes of the
files our hook patch touches ("hooked files"), not only by the version string the tree carries.

Levels, lowest first: ``untested``, ``compile-verified`` (the tree compiled with our hooks), ``nvidia-tests``
(also: NVIDIA's own built-in UVM tests passed through our hooks, recorded per run in the entry's ``nvidia_tests``:
suite, kernel, page size, tiers, date). The two verified levels carry hooked-file hashes and vouch by content.

The manifest records, per verified tree, ``hooked_files: {version: {path: sha256}}`` (paths as in the
patch, relative to the /usr/src-layout tree root, e.g. ``nvidia-uvm/uvm_mmu.c``; written by uvm_patch/gen-hashes).
:func:`decide` maps (version, the manifest's version match, the tree's hashes) to a verdict:

* exact version entry, hooked files as recorded (or no tree / nothing recorded): the entry's qualification,
  ``by: version``;
* exact version entry of a compile-verified tree, hooked files differ: ``untested``, ``by: content``,
  ``drifted`` names the files (a relabelled or modified tree is not what was compiled);
* exact version entry, hooked files as recorded, and a tree of a higher level of the same branch has the same
  hooked files: that level, ``by: content``, ``inherited_from`` that version;
* range match or no match, hooked files identical to a verified tree of the same branch: that tree's level,
  ``by: content``, ``inherited_from`` that version (the highest level, then the nearest version, if several);
* otherwise: ``untested`` (the dry run decides, as before), ``by: version``; ``drifted`` lists the files that
  differ from the closest compile-verified tree of the branch (``compared_with``) when a tree was given.

Inputs are plain data (entries need ``branch``, ``qualification``, ``versions``, ``verified_on``,
``hooked_files`` attributes); hashing the tree is the caller's I/O (world/support.py ``qualify``).
"""

from __future__ import annotations

import re

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: the qualification levels, lowest first; the verified ones carry hooked-file hashes and vouch by content
LEVELS = ("untested", "compile-verified", "nvidia-tests")
VERIFIED = ("compile-verified", "nvidia-tests")
#: what each nvidia_tests record of the manifest says
TEST_RECORD_KEYS = ("suite", "kernel", "page_size", "tiers", "date")


def rank(level: str) -> int:
    return LEVELS.index(level) if level in LEVELS else -1


def check_test_records(raw, level: str) -> str | None:
    """Why an entry's ``nvidia_tests`` value is malformed for its level, or None."""
    if level != "nvidia-tests":
        return None if not raw else "nvidia_tests belong to nvidia-tests entries only"
    if not isinstance(raw, list) or not raw:
        return "nvidia-tests needs nvidia_tests: a list of runs (suite, kernel, page_size, tiers, date)"
    for i, r in enumerate(raw):
        if not isinstance(r, dict) or [k for k in TEST_RECORD_KEYS if not r.get(k)]:
            return f"nvidia_tests[{i}] needs {', '.join(TEST_RECORD_KEYS)}"
    return None


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
             compared_with=None, recorded=False, tests=()) -> dict:
    return {"qualification": qualification, "by": by, "inherited_from": inherited_from,
            "drifted": sorted(drifted), "compared_with": compared_with, "branch": branch, "match": match,
            "verified_on": list(verified_on), "hashes_recorded": recorded, "nvidia_tests": list(tests)}


def _tests(entry) -> list:
    return list(getattr(entry, "nvidia_tests", None) or [])


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
    branch = entry.branch if entry is not None else nearest_branch
    cands = [(v, e, files) for e in entries if e.branch == branch and e.qualification in VERIFIED
             for v, files in (e.hooked_files or {}).items()]
    same = [c for c in cands if hashes is not None and not _differs(c[2], hashes)]
    # the identical tree of the highest level, then the nearest version
    best = min(same, key=lambda c: (-rank(c[1].qualification), distance(c[0], version))) if same else None
    if match == "exact":
        recorded = (entry.hooked_files or {}).get(version)
        if hashes is None or not recorded:
            return _verdict(entry.qualification, "version", branch=entry.branch, match="exact",
                            verified_on=entry.verified_on, recorded=bool(recorded), tests=_tests(entry))
        drifted = _differs(recorded, hashes)
        if drifted and entry.qualification in VERIFIED:
            return _verdict("untested", "content", branch=entry.branch, match="exact", drifted=drifted,
                            compared_with=version, recorded=True)
        if not drifted and best is not None and rank(best[1].qualification) > rank(entry.qualification):
            return _verdict(best[1].qualification, "content", branch=branch, match="exact",
                            verified_on=best[1].verified_on, inherited_from=best[0], recorded=True,
                            tests=_tests(best[1]))
        return _verdict(entry.qualification, "version", branch=entry.branch, match="exact",
                        verified_on=entry.verified_on, drifted=drifted, recorded=True, tests=_tests(entry))
    if best is not None:
        v, e, _ = best
        return _verdict(e.qualification, "content", branch=branch, match=match or "content",
                        verified_on=e.verified_on, inherited_from=v, recorded=True, tests=_tests(e))
    verdict = _verdict("untested", "version", branch=branch, match=match or "nearest", recorded=False)
    if hashes is not None and cands:
        v, _, files = min(cands, key=lambda c: (len(_differs(c[2], hashes)), distance(c[0], version)))
        verdict.update(drifted=sorted(_differs(files, hashes)), compared_with=v)
    return verdict
