"""uvm_patch/manifest.yaml: where the patch data lives and what the manifest says (format 1), and which entry or
branch a driver version gets (:func:`select`, :func:`nearest`).

Read by world/support.py (the manifest's verdict on each driver: status, installability, the planner) and by
act/patch.py's apply step (which re-exports every name here). Each driver entry: exact ``versions`` or a
``range``, ``branch``, ``qualification`` (a verified level, compile-verified or nvidia-tests, needs ``verified_on``),
for verified trees ``hooked_files: {version: {path: sha256}}`` (every file the branch's hook patch touches;
uvm_patch/gen-hashes), and for nvidia-tests ``nvidia_tests``: the runs of NVIDIA's built-in tests that passed
(suite, kernel, page_size, tiers, date; decide/qualification.py).
"""

from __future__ import annotations

import os
import re
from spark_memsaver.record import Record, field
from pathlib import Path

from spark_memsaver.decide import qualification as qual
from spark_memsaver.errors import EXIT_USAGE, MemsaverError

# never "hardware-validated": nothing of ours is, yet
QUALIFICATIONS = ("nvidia-tests", "compile-verified", "untested")
VERIFIED = qual.VERIFIED
_VERSION_RE = re.compile(r"^\d+\.\d+(\.\d+)?$")


class ManifestInvalid(MemsaverError):
    code = "manifest-invalid"
    exit_code = EXIT_USAGE
    remedy = "Reinstall spark-memsaver: its uvm_patch/manifest.yaml or patch files are damaged."


# ----------------------------------------------------------------------------------------------
# Where the patch data lives

def patch_data_dir() -> Path:
    """uvm_patch/ with manifest.yaml, patches/ and src/: $SPARK_MEMSAVER_UVM_PATCH_DIR, the checkout, or
    the installed copy under /usr/share/spark-memsaver/uvm_patch."""
    env = os.environ.get("SPARK_MEMSAVER_UVM_PATCH_DIR")
    candidates = [Path(env)] if env else []
    candidates += [Path(__file__).resolve().parents[3] / "uvm_patch", Path("/usr/share/spark-memsaver/uvm_patch")]
    for c in candidates:
        if (c / "manifest.yaml").is_file():
            return c
    raise ManifestInvalid("uvm_patch/manifest.yaml not found (looked in: "
                          + ", ".join(str(c) for c in candidates) + ")")


# ----------------------------------------------------------------------------------------------
# Manifest

def _vkey(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


class Entry(Record):
    branch: str
    qualification: str
    versions: list[str] = field(default_factory=list)   # exact versions
    range_min: str | None = None                         # inclusive
    range_below: str | None = None                       # exclusive
    verified_on: list[str] = field(default_factory=list)
    hooked_files: dict[str, dict[str, str]] = field(default_factory=dict)   # version -> {path: sha256}
    nvidia_tests: list[dict] = field(default_factory=list)                   # nvidia-tests: the runs that passed

    def matches_exact(self, v: str) -> bool:
        return v in self.versions

    def matches_range(self, v: str) -> bool:
        if self.range_min is None and self.range_below is None:
            return False
        k = _vkey(v)
        return ((self.range_min is None or k >= _vkey(self.range_min))
                and (self.range_below is None or k < _vkey(self.range_below)))


class Manifest(Record):
    root: Path
    pool_files: list[Path]
    branches: dict[str, list[Path]]
    entries: list[Entry]

    def known_versions(self) -> list[tuple[str, Entry]]:
        return [(v, e) for e in self.entries for v in e.versions]

    def hooked_paths(self, branch: str) -> list[str]:
        """Every file the branch's hook patches touch (their ``+++ b/`` lines; the pool files are not among them)."""
        return sorted({p for f in self.branches[branch] for p in qual.hooked_paths(f.read_text(errors="replace"))})


def load_manifest(root: Path | None = None) -> Manifest:
    from spark_memsaver import yamlio

    root = Path(root) if root else patch_data_dir()
    path = root / "manifest.yaml"
    try:
        doc = yamlio.load_data(path.read_text(), "manifest")
    except (OSError, yamlio.yaml_error()) as e:
        raise ManifestInvalid(f"cannot read {path}: {e}")

    def bad(msg):
        return ManifestInvalid(f"{path}: {msg}")

    if not isinstance(doc, dict) or doc.get("format") != 1:
        raise bad("not a format-1 manifest")
    pool = [root / p for p in (doc.get("pool") or {}).get("files", [])]
    if not pool or not all(p.is_file() for p in pool):
        raise bad(f"pool files missing: {[str(p) for p in pool if not p.is_file()] or 'none listed'}")
    branches: dict[str, list[Path]] = {}
    for name, b in (doc.get("branches") or {}).items():
        files = [root / p for p in (b or {}).get("patches", [])]
        if not files or not all(f.is_file() for f in files):
            raise bad(f"branch {name}: patch files missing")
        branches[str(name)] = files
    entries: list[Entry] = []
    for i, raw in enumerate(doc.get("drivers") or []):
        if not isinstance(raw, dict):
            raise bad(f"drivers[{i}] is not a mapping")
        q = raw.get("qualification")
        if q not in QUALIFICATIONS:
            raise bad(f"drivers[{i}]: qualification {q!r} is not one of {QUALIFICATIONS}")
        if raw.get("branch") not in branches:
            raise bad(f"drivers[{i}]: unknown branch {raw.get('branch')!r}")
        versions = [str(v) for v in raw.get("versions", [])]
        rng = raw.get("range") or {}
        for v in versions + [str(x) for x in rng.values()]:
            if not _VERSION_RE.match(v):
                raise bad(f"drivers[{i}]: bad version {v!r}")
        if q in VERIFIED and (not versions or not raw.get("verified_on")):
            raise bad(f"drivers[{i}]: {q} needs exact versions and verified_on")
        hooked = raw.get("hooked_files")
        why = qual.check_hooked_files(hooked, versions, sorted(
            {p for f in branches[raw["branch"]] for p in qual.hooked_paths(f.read_text(errors="replace"))}))
        if why or (hooked and q not in VERIFIED):
            raise bad(f"drivers[{i}]: {why or 'hooked_files belong to verified entries only'}")
        why = qual.check_test_records(raw.get("nvidia_tests"), q)
        if why:
            raise bad(f"drivers[{i}]: {why}")
        entries.append(Entry(branch=raw["branch"], qualification=q, versions=versions,
                             range_min=str(rng["min"]) if "min" in rng else None,
                             range_below=str(rng["below"]) if "below" in rng else None,
                             verified_on=[str(x) for x in raw.get("verified_on", [])],
                             hooked_files={str(v): {str(p): str(h) for p, h in f.items()}
                                           for v, f in (hooked or {}).items()},
                             nvidia_tests=[{str(k): v for k, v in r.items()} for r in raw.get("nvidia_tests") or []]))
    if not entries:
        raise bad("no drivers listed")
    return Manifest(root=root, pool_files=pool, branches=branches, entries=entries)


# ----------------------------------------------------------------------------------------------
# A driver version's entry or branch

class Selection(Record):
    version: str
    branch: str
    patches: list[Path]
    qualification: str
    match: str               # "exact" | "range" | "nearest" | "content" (unlisted, identical hooked files)
    verified_on: list[str]
    content: dict = field(default_factory=dict)   # qualify()'s by / inherited_from / drifted / compared_with


def _entry_for(manifest: Manifest, version: str) -> tuple[Entry | None, str | None]:
    for kind, test in (("exact", Entry.matches_exact), ("range", Entry.matches_range)):
        for e in manifest.entries:
            if test(e, version):
                return e, kind
    return None, None


def select(manifest: Manifest, version: str) -> Selection | None:
    """By version only: the exact entry, else a range entry (untested), else None. See qualify() for content."""
    e, kind = _entry_for(manifest, version)
    if e is None:
        return None
    if kind == "exact":
        return Selection(version, e.branch, manifest.branches[e.branch], e.qualification, "exact", e.verified_on)
    return Selection(version, e.branch, manifest.branches[e.branch], "untested", "range", [])


def nearest(manifest: Manifest, version: str) -> Selection:
    """The branch of the known version closest to `version` (by major, then the rest; ties go lower)."""
    k = _vkey(version)

    def dist(item):
        kv = _vkey(item[0])
        return (abs(kv[0] - k[0]), kv[0] > k[0], [abs(a - b) for a, b in zip(kv[1:], k[1:])])

    v, e = min(manifest.known_versions(), key=dist)
    return Selection(version, e.branch, manifest.branches[e.branch], "untested", "nearest", [])
