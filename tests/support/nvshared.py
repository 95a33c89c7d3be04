"""NVIDIA's kernel-open trees of the r580-r595 GitHub tags, from the shared directory next to the checkout.

``../shared/nvidia/`` (``$SPARK_MEMSAVER_NV_SHARED`` overrides it) holds ``kernel-open-<version>.tar.xz``
(``git archive --prefix=open-gpu-kernel-modules-<tag>/ <tag> kernel-open COPYING | xz``), ``SHA256SUMS`` and a
README naming each tag's commit. They are test inputs: never copied into the repository. tests/support/nvsrc.py's
``nvidia_source(version)`` calls :func:`unpack` when its cache holds no tree for one of these versions; the
tarball is checked against SHA256SUMS first, and the unpacked tree must state the same version in its Kbuild.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

SHARED_ENV = "SPARK_MEMSAVER_NV_SHARED"


def shared_dir() -> Path:
    """``$SPARK_MEMSAVER_NV_SHARED``, else ``../shared/nvidia`` next to this checkout."""
    env = os.environ.get(SHARED_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "nvidia"


def _shared_sums() -> dict[str, str]:
    """version -> sha256 of kernel-open-<version>.tar.xz, from the shared directory's SHA256SUMS."""
    try:
        text = (shared_dir() / "SHA256SUMS").read_text()
    except OSError:
        return {}
    sums = {}
    for line in text.splitlines():
        m = re.fullmatch(r"([0-9a-f]{64})\s+\*?kernel-open-(\d+\.\d+(?:\.\d+)?)\.tar\.xz", line.strip())
        if m:
            sums[m.group(2)] = m.group(1)
    return sums


def shared_versions() -> list[str]:
    """The versions the shared directory's SHA256SUMS lists (sorted numerically; [] when it is absent): the one list
    of NVIDIA GitHub trees a test can have (README.md there names each tag's commit)."""
    return sorted(_shared_sums(), key=lambda v: tuple(int(x) for x in v.split(".")))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def unpack(version: str, cache: Path, locked, run, tree_in, unavailable) -> Path:
    """Verify kernel-open-<version>.tar.xz against SHA256SUMS and unpack its kernel-open/ into
    ``<cache>/nv/<version>`` under nvsrc's lock (``locked``), with nvsrc's ``run``, ``tree_in`` (the tree
    inside a directory, or None) and ``unavailable`` (its SourceUnavailable)."""
    root = cache / "nv" / version
    with locked(f"nv-{version}"):
        tree = tree_in(root) if root.is_dir() else None
        if tree is not None:
            return tree
        want = _shared_sums().get(version)
        tarball = shared_dir() / f"kernel-open-{version}.tar.xz"
        if want is None or not tarball.is_file():
            raise unavailable(f"{tarball} or its SHA256SUMS line is missing")
        got = _sha256(tarball)
        if got != want:
            raise unavailable(f"{tarball}: sha256 {got}, SHA256SUMS says {want}: a damaged or different "
                              f"file; fetch it again (README.md there names the tag and commit)")
        tmp = Path(tempfile.mkdtemp(prefix=f".nv-{version}-", dir=cache))
        try:
            run(["tar", "-xJf", tarball, "-C", tmp, "--no-same-owner", "--wildcards", "*/kernel-open/*"],
                timeout=600)
            found = [p for p in tmp.glob("*/kernel-open") if tree_in(p.parent) is not None]
            if len(found) != 1:
                raise unavailable(f"{tarball} does not hold one NVIDIA kernel-open/ tree")
            if tree_version(found[0]) != version:
                raise unavailable(f"{tarball}: its Kbuild states NVIDIA {tree_version(found[0])}, not {version}")
            out = found[0].parent
            os.chmod(out, 0o755)
            (out / ".ready").write_text(f"{tarball.name} sha256 {got}\n")
            if root.exists():
                shutil.rmtree(root)
            root.parent.mkdir(parents=True, exist_ok=True)
            os.rename(out, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return tree_in(root)


def tree_version(tree: Path) -> str | None:
    """The version a kernel-open tree's Kbuild states (-DNV_VERSION_STRING=...), None when it states none."""
    try:
        kbuild = (tree / "Kbuild").read_text(errors="replace")
    except OSError:
        return None
    found = set(re.findall(r'-DNV_VERSION_STRING=\\?"([^"\\]+)\\?"', kbuild))
    return found.pop() if len(found) == 1 else None
