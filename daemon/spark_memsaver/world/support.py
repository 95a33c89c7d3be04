"""The manifest's verdict on each driver (world layer: a reading, the tree's hooked files, handed to its verdict,
decide/qualification.py): what status, installability and the planner are given as ``support``.

    support_for(versions, trees)   {version: support(...)}: supported or why not, qualification, by what
    source_trees(host, snap)       {version: host path of its open NVIDIA tree} from the snapshot's driver sources
    qualify(tree, version)         qualification by version and by content (the recorded sha256 of hooked files)

Read-only (sha256 of a few source files); act/patch.py re-exports these names for the apply step.
"""

from __future__ import annotations

from pathlib import Path

from spark_memsaver.decide import qualification as qual
from spark_memsaver.world.manifest import Manifest, _entry_for, load_manifest, nearest


def _sha256(p: Path) -> str:
    from spark_memsaver.digest import sha256   # not hashlib (libcrypto): status hashes the hooked files

    return sha256(p.read_bytes()).hexdigest()


def tree_hashes(tree: Path, paths) -> dict[str, str | None]:
    """sha256 of each path under `tree` (None for a missing file)."""
    return {p: (_sha256(Path(tree) / p) if (Path(tree) / p).is_file() else None) for p in paths}


def qualify(tree: Path | None, driver_version: str, manifest: Manifest | None = None) -> dict:
    """Qualification of the tree `tree` (labelled `driver_version`; None = judge by version only) by the
    manifest's version entries and the recorded sha256 of the files the hooks touch (decide/qualification.py):
    ``{"version", "qualification", "by": "version"|"content", "inherited_from", "drifted", "compared_with",
    "branch", "match", "verified_on", "hashes_recorded"}``."""
    manifest = manifest or load_manifest()
    entry, kind = _entry_for(manifest, driver_version)
    branch = entry.branch if entry is not None else nearest(manifest, driver_version).branch
    hashes = tree_hashes(tree, manifest.hooked_paths(branch)) if tree is not None else None
    return {"version": driver_version,
            **qual.decide(driver_version, entry, kind, hashes, manifest.entries, nearest_branch=branch)}


def support(version: str, tree: Path | None = None, manifest: Manifest | None = None) -> dict:
    """The daemon's manifest verdict for one driver (act/steps.support_for): ``{"supported", "reason" (when
    not), "branch", "qualification", "by", "inherited_from", "drifted", "compared_with"}``. Supported = the
    manifest lists the version (exact or range; the dry run decides at build time) or, with its tree, the hooked
    files are those of a compile-verified tree of the nearest branch (compile-verified by content). An unlisted
    version judged without its tree also has ``content_unchecked: True`` when its source could still qualify it
    by content (fetch the source, then ask again)."""
    manifest = manifest or load_manifest()
    q = qualify(tree, version, manifest)
    keys = {k: q[k] for k in ("branch", "qualification", "by", "inherited_from", "drifted", "compared_with")}
    if q["match"] != "nearest":
        return {"supported": True, **keys}
    why = f"NVIDIA driver {version} is not in this release's patch manifest"
    if q["compared_with"]:
        why += (f", and its hooked files differ from the compile-verified {q['compared_with']} tree "
                f"({', '.join(q['drifted'])})")
    # no tree to judge by content: its source (once fetched) may still qualify it by content
    unchecked = tree is None and any(e.branch == q["branch"] and e.hooked_files for e in manifest.entries)
    return {"supported": False, "reason": why, **keys, "content_unchecked": unchecked}


def support_for(versions, trees: dict | None = None) -> dict:
    """support() for each version (act/steps.support_for, the planner's and installability's input); trees:
    {version: path of its NVIDIA tree} (source_trees()). No manifest = nothing supported, with the reason."""
    try:
        manifest = load_manifest()
    except Exception as e:
        return {v: {"supported": False, "reason": f"patch manifest unavailable: {e}"} for v in versions if v}
    out = {}
    for v in versions:
        if not v:
            continue
        try:
            try:
                out[v] = support(v, (trees or {}).get(v), manifest)
            except OSError:   # an unreadable tree: judged by its version alone
                out[v] = support(v, None, manifest)
        except Exception as e:
            out[v] = {"supported": False, "reason": f"NVIDIA driver {v} is not in this release's patch manifest ({e})"}
    return out


def source_trees(host, w) -> dict:
    """{driver version: host path of its NVIDIA tree} for each driver a world's sources name: world/tree.source_tree,
    the tree the DKMS build compiles (never another tree of the same version)."""
    from spark_memsaver.world.tree import source_tree
    out = {}
    for s in w.driver.sources:
        if s.version and s.version not in out and (t := source_tree(host, s.version)):
            out[s.version] = host.path(t)
    return out
