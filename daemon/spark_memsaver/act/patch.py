"""The apply step: NVIDIA open kernel-module tree in, patched copy out (never in place, never with fuzz).

Input (SRC): an NVIDIA open kernel-module tree as a driver package installs it under /usr/src, i.e. the
layout of upstream's ``kernel-open/`` (``Kbuild``, ``Makefile``, ``conftest.sh``, ``common/``,
``nvidia-uvm/`` ...). Output (DEST): a NEW directory holding a copy of SRC with

* ``uvm_patch/src/uvm_pt_pack.[ch]`` copied into ``nvidia-uvm/`` (one source of truth for every branch),
* the branch's hook patch from ``uvm_patch/manifest.yaml`` applied with ``patch --fuzz=0``,
* optionally the build-time default tier (``-DUVM_PT_PACK_DEFAULT=<n>``) added for uvm_pt_pack.o,
* ``spark-memsaver-uvm-patch.json``: what was applied (version, branch, files and their sha256,
  qualification).

Steps and preconditions (each refusal is a named error with a remedy; nothing is left behind):

1. SRC is a tree of the expected layout; its driver version is read from ``Kbuild``
   (``-DNV_VERSION_STRING="X"``, what the module is compiled with) and cross-checked against
   ``dkms.conf`` ``PACKAGE_VERSION`` when that holds a real version -> else ``SourceTreeInvalid``.
   A tree that already carries the pool is refused too (``SourceTreeInvalid``).
2. DEST does not exist (``DestinationExists``); its parent does.
3. The manifest selects the patch: an exact version entry, else a range entry (qualification
   ``untested``). A version the manifest does not know gets a dry run with the nearest branch's patch
   and is refused (``UnknownDriverVersion``) stating whether that patch would apply cleanly; with
   ``allow_untested`` a clean nearest-branch patch is applied and reported as ``untested``.
4. Dry run (``patch --dry-run --fuzz=0 --forward``) against SRC (read-only) -> ``PatchDoesNotApply``.
5. Copy SRC into a temporary sibling of DEST, add the pool files, apply for real, verify, then rename
   to DEST atomically. Any failure removes the temporary copy.

Python API: :func:`apply_patch`, :func:`check_source`, :func:`read_tree_version`, :func:`load_manifest`.
CLI: ``spark-memsaver patch apply --source SRC --dest DEST [--tier-default N] [--allow-untested] [--slim] [--json]``
and ``spark-memsaver patch check --source SRC [--json]`` (dry run only).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path


from spark_memsaver.world.manifest import (QUALIFICATIONS, VERIFIED, _VERSION_RE, Entry, Manifest,  # noqa: F401
                                           ManifestInvalid, Selection, _entry_for, _vkey, load_manifest, nearest,
                                           patch_data_dir, select)
from spark_memsaver.world.support import (_sha256, qualify, source_trees, support, support_for,  # noqa: F401
                                          tree_hashes)
from spark_memsaver.errors import EXIT_USAGE, MemsaverError
from spark_memsaver.world.tree import (_REQUIRED, POOL_DEST, SourceTreeInvalid,  # noqa: F401  (world/tree.py owns the
                                       read_tree_version)                       # tree's shape and version)
from spark_memsaver.host.runner import Runner

MARKER = "spark-memsaver-uvm-patch.json"
TIERS = {0: "off", 1: "4k-all", 2: "256", 3: "leaf"}   # decide/policy.py MODULE_TIERS
_PATCH_TIMEOUT = 120.0


# ----------------------------------------------------------------------------------------------
# Named errors

class DestinationExists(MemsaverError):
    code = "destination-exists"
    remedy = "Choose a new --dest directory, or remove the old one first (the apply step never writes in place)."


class UnknownDriverVersion(MemsaverError):
    code = "unknown-driver-version"
    remedy = ("This NVIDIA driver version has no qualified patch. Use a driver version listed by "
              "'spark-memsaver patch list', or wait for a spark-memsaver release that supports it.")


class PatchDoesNotApply(MemsaverError):
    code = "patch-does-not-apply"
    remedy = ("The NVIDIA sources differ from what the patch expects (zero fuzz). Reinstall the driver's "
              "source package unmodified; if it is unmodified, this driver needs a new patch release.")


class InvalidTier(MemsaverError):
    code = "invalid-tier"
    exit_code = EXIT_USAGE
    remedy = "Use 0 (off), 3 (leaf, the default), 1 (4k-all) or 2 (256; both opt-in, not hardware-validated)."


# ----------------------------------------------------------------------------------------------
# Source tree



# ----------------------------------------------------------------------------------------------
# patch(1)

def _patch(runner: Runner, tree: Path, patch_file: Path, dry_run: bool):
    argv = ["patch", "-p1", "--fuzz=0", "--forward", "--batch", "--no-backup-if-mismatch", "-r", "-",
            "-d", str(tree), "-i", str(patch_file)]
    if dry_run:
        argv.insert(1, "--dry-run")
    return runner.run(argv, timeout=_PATCH_TIMEOUT)


def _dry_run(runner: Runner, src: Path, sel: Selection) -> tuple[bool, str]:
    """Dry-run every patch of the selection against SRC (read-only). Several patch files of one branch
    would have to be checked on a scratch copy; branches have one file today."""
    out = []
    for p in sel.patches:
        r = _patch(runner, src, p, dry_run=True)
        out.append((r.stdout + r.stderr).strip())
        if not r.ok or "FAILED" in r.stdout or "fuzz" in r.stdout.lower():
            return False, "\n".join(out)
    return True, "\n".join(out)


def check_source(source: Path, *, allow_untested: bool = False, manifest: Manifest | None = None,
                 runner: Runner | None = None) -> dict:
    """Steps 1, 3 and 4 (no copy): version, selection and dry run. Returns a JSON-able dict or raises."""
    runner = runner or Runner()
    manifest = manifest or load_manifest()
    source = Path(source)
    version = read_tree_version(source)
    q = qualify(source, version, manifest)
    content = {k: q[k] for k in ("by", "inherited_from", "drifted", "compared_with", "nvidia_tests")}
    sel = select(manifest, version)
    if sel is None and q["qualification"] in VERIFIED:   # unlisted, hooked files of a verified tree
        sel = Selection(version, q["branch"], manifest.branches[q["branch"]], q["qualification"], "content", [])
    if sel is None:
        near = nearest(manifest, version)
        clean, log = _dry_run(runner, source, near)
        details = dict(version=version, nearest_branch=near.branch, nearest_patch_clean=clean,
                       known=[v for v, _ in manifest.known_versions()], **content)
        if not clean:
            raise UnknownDriverVersion(
                f"NVIDIA {version} is not in the manifest, and the nearest branch's patch ({near.branch}) "
                f"does not apply cleanly to it: refused", **details, dry_run=log[-2000:])
        if not allow_untested:
            raise UnknownDriverVersion(
                f"NVIDIA {version} is not in the manifest. The nearest branch's patch ({near.branch}) would "
                f"apply cleanly (zero fuzz), but it is UNTESTED for this version (not even compile-verified): "
                f"refused", remedy=UnknownDriverVersion.remedy + " To try it anyway at your own risk, pass "
                "--allow-untested.", **details)
        sel = near
    else:
        clean, log = _dry_run(runner, source, sel)
        if not clean:
            raise PatchDoesNotApply(
                f"the {sel.branch} patch for NVIDIA {version} does not apply to {source} with zero fuzz",
                version=version, branch=sel.branch, dry_run=log[-2000:])
    sel.qualification, sel.verified_on, sel.content = q["qualification"], q["verified_on"], content
    return {"source": str(source), "version": version, "branch": sel.branch, "match": sel.match,
            "qualification": sel.qualification, **content, "verified_on": sel.verified_on,
            "patches": [str(p.relative_to(manifest.root)) for p in sel.patches], "dry_run": "clean",
            "_selection": sel}


def apply_patch(source, dest, tier_default: int | None = None, *, allow_untested: bool = False,
                slim: bool = False, manifest: Manifest | None = None, runner: Runner | None = None) -> dict:
    """Copy SRC to the new directory DEST, add the pool, apply the branch patch with zero fuzz.

    tier_default: None keeps the pool's compiled-in default; 0/1/2 sets -DUVM_PT_PACK_DEFAULT for
    uvm_pt_pack.o. slim: leave out NVIDIA's prebuilt ``*.o_binary`` blobs (the ~220 MB RM core, only
    needed to link nvidia.ko; nvidia-uvm does not use them). Returns the marker dict (also written to
    DEST/spark-memsaver-uvm-patch.json).
    """
    runner = runner or Runner()
    manifest = manifest or load_manifest()
    source, dest = Path(source).absolute(), Path(dest).absolute()
    if tier_default is not None and tier_default not in TIERS:
        raise InvalidTier(f"tier {tier_default!r} is not 0, 1, 2 or 3")
    if dest.exists() or dest.is_symlink():
        raise DestinationExists(f"{dest} already exists", dest=str(dest))
    if not dest.parent.is_dir():
        raise DestinationExists(f"the parent of {dest} does not exist", dest=str(dest),
                                remedy="Create the parent directory first.")
    if dest == source or source in dest.parents:
        raise DestinationExists(f"{dest} is inside the source tree {source}",
                                remedy="Choose a --dest outside the source tree.")
    result = check_source(source, allow_untested=allow_untested, manifest=manifest, runner=runner)
    sel: Selection = result.pop("_selection")

    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        work = tmp / "tree"
        shutil.copytree(source, work, symlinks=True,
                        ignore=shutil.ignore_patterns("*.o_binary") if slim else None)
        for f in manifest.pool_files:
            target = work / POOL_DEST / f.name
            if target.exists():
                raise SourceTreeInvalid(f"{source} already has {POOL_DEST}/{f.name}")
            shutil.copy2(f, target)
        for p in sel.patches:
            r = _patch(runner, work, p, dry_run=False)
            if not r.ok:
                raise PatchDoesNotApply(f"{p.name} failed on the copy after a clean dry run",
                                        output=(r.stdout + r.stderr)[-2000:])
        if tier_default is not None:
            kb = work / "nvidia-uvm" / "nvidia-uvm-sources.Kbuild"
            with kb.open("a") as fh:
                fh.write(f"\n# spark-memsaver: build-time default of the uvm_pt_pack parameter "
                         f"({TIERS[tier_default]})\n"
                         f"CFLAGS_uvm_pt_pack.o += -DUVM_PT_PACK_DEFAULT={tier_default}\n"
                         f"CFLAGS_nvidia-uvm/uvm_pt_pack.o += -DUVM_PT_PACK_DEFAULT={tier_default}\n")
        if "uvm_pt_pack.c" not in (work / "nvidia-uvm/nvidia-uvm-sources.Kbuild").read_text():
            raise PatchDoesNotApply("the patched tree does not list uvm_pt_pack.c (patch incomplete)")
        marker = {
            "format": 1,
            "source": str(source),
            "version": result["version"],
            "branch": sel.branch,
            "match": sel.match,
            "qualification": sel.qualification,
            **sel.content,
            "verified_on": sel.verified_on,
            "tier_default": tier_default,
            "slim": slim,
            "patches": {str(p.relative_to(manifest.root)): _sha256(p) for p in sel.patches},
            "pool": {f.name: _sha256(f) for f in manifest.pool_files},
        }
        (work / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        os.rename(work, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    marker["dest"] = str(dest)
    return marker
