"""Heavy, cached build inputs for the tests: NVIDIA open kernel-module sources and kernel trees.

Everything is downloaded from Debian's archive (the mirror is read at run time from the system's
``/etc/apt/sources.list.d/*.sources`` / ``sources.list``; system apt state is never modified: a
private apt configuration under the cache is used) and cached under ``$SPARK_MEMSAVER_TEST_CACHE``
(default ``/var/cache/spark-memsaver-tests``). Every producer takes an exclusive ``flock`` on
``<cache>/locks/<name>.lock`` and publishes its result by an atomic rename plus a ``.ready`` stamp,
so concurrent tests (or engineers) never duplicate or observe half-done work.

API (all return paths inside the cache; all raise :class:`SourceUnavailable` with a reason when the
input cannot be produced here, which tests may turn into a skip only where CI cannot get it):

``nvidia_source(version) -> Path``
    The NVIDIA open kernel-module tree exactly as a driver package installs it under ``/usr/src``
    (= upstream ``kernel-open/`` layout: ``Kbuild``, ``Makefile``, ``conftest.sh``, ``common/``,
    ``nvidia/``, ``nvidia-uvm/`` ...). Debian versions (:data:`DEBIAN_VERSIONS`: 535.261.03,
    550.163.01, 555.58.02) are downloaded from ``nvidia-open-kernel-dkms`` (contrib). NVIDIA's
    GitHub tags (the r580-r595 trees DGX Spark nodes run; which ones: :func:`shared_versions`) come from the shared
    directory ``../shared/nvidia/`` next to the checkout (``$SPARK_MEMSAVER_NV_SHARED`` overrides it):
    ``kernel-open-<version>.tar.xz`` is checked against that directory's ``SHA256SUMS`` and unpacked into
    ``<cache>/nv/<version>/kernel-open``. A tree already there (also one put there with
    :func:`export_git_tag` from a local clone) is used as it is.
    Treat the returned tree as read-only: copy it before building or patching.

``shared_dir() -> Path``, ``shared_versions() -> list[str]``
    The shared directory and the versions its ``SHA256SUMS`` lists (empty when it is absent): the one list of
    the GitHub trees tests can have.

``manifest_github_versions() -> list[str]``
    The versions ``uvm_patch/manifest.yaml`` lists exactly that Debian's archive does not ship: the GitHub trees
    the shared directory must hold (tests/test_nvsrc.py).

``x86_headers() -> (kernel_release, Path)``
    Debian's ``linux-headers-amd64`` (installed with apt-get if missing, root only); the path is
    ``/lib/modules/<release>/build``.

``arm64_64k_tree() -> Path``
    A bookworm ``linux-source-6.1`` tree configured for arm64 with ``CONFIG_ARM64_64K_PAGES=y``
    (defconfig + 64K pages, ``modules_prepare`` done) with ``Module.symvers`` taken from Debian's
    arm64 headers package of the same ABI, ready for ``make ARCH=arm64
    CROSS_COMPILE=aarch64-linux-gnu- SYSSRC=<tree>``.

``cache_dir() -> Path``, ``debian_mirror() -> str`` are public helpers.

Command line (for CI warm-up or by hand)::

    python3 tests/support/nvsrc.py nvidia 550.163.01 | shared | x86 | arm64 | git-export MIRROR TAG
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from . import cache, nvshared
    from .nvshared import shared_dir, shared_versions, tree_version
except ImportError:  # run as a script: python3 tests/support/<name>.py
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cache  # type: ignore
    import nvshared  # type: ignore
    from nvshared import shared_dir, shared_versions, tree_version  # type: ignore

__all__ = ["SourceUnavailable", "DEBIAN_VERSIONS", "cache_dir", "debian_mirror", "manifest_github_versions",
           "nvidia_source", "shared_dir", "shared_versions", "tree_version", "x86_headers", "arm64_64k_tree", "export_git_tag"]

#: NVIDIA versions Debian ships as nvidia-open-kernel-dkms (contrib) and the suite to find them in.
DEBIAN_VERSIONS = {
    "535.261.03": "bookworm",
    "550.163.01": "sid",
    "555.58.02": "experimental",
}
NVIDIA_SUITES = ("bookworm", "trixie", "sid", "experimental")
ARM64_CROSS = "aarch64-linux-gnu-"
_READY = ".ready"


def manifest_github_versions() -> list[str]:
    """The versions uvm_patch/manifest.yaml lists exactly that are not Debian's (:data:`DEBIAN_VERSIONS`): NVIDIA's
    GitHub tags, which only the shared directory provides (sorted numerically)."""
    import yaml

    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "uvm_patch" / "manifest.yaml").read_text())
    listed = {v for d in doc["drivers"] for v in d.get("versions") or ()}
    return sorted(listed - set(DEBIAN_VERSIONS), key=lambda v: tuple(int(x) for x in v.split(".")))


class SourceUnavailable(RuntimeError):
    """A cached input cannot be produced on this machine (message says why and what to do)."""


cache_dir = cache.cache_dir
_locked = cache.locked


def _run(argv, *, cwd=None, env=None, timeout=1800, log=None):
    full_env = dict(os.environ, LC_ALL="C.UTF-8", DEBIAN_FRONTEND="noninteractive")
    if env:
        full_env.update(env)
    p = subprocess.run([str(a) for a in argv], cwd=cwd, env=full_env, timeout=timeout,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    if log is not None:
        Path(log).write_text(p.stdout)
    if p.returncode != 0:
        tail = "\n".join(p.stdout.strip().splitlines()[-15:])
        raise SourceUnavailable(f"{' '.join(map(str, argv))} failed (rc={p.returncode}):\n{tail}")
    return p.stdout


# --------------------------------------------------------------------------------------------
# Debian archive access through a private apt configuration

_system_source_entries = cache.source_entries


def debian_mirror() -> str:
    """The Debian archive URI the system uses (the entry carrying a plain release suite)."""
    uri = cache.debian_mirror()
    if uri is None:
        raise SourceUnavailable("no Debian archive entry found in /etc/apt/sources.list(.d); "
                                "configure apt with a Debian mirror")
    return uri


def _apt(arch: str, lines: list[str]) -> list[str]:
    """Prepare a private apt state dir for `arch` with the given sources lines; return the options."""
    base = cache_dir() / "apt" / arch
    for sub in ("lists/partial", "parts", "cache/archives/partial", "prefs"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    sl = base / "sources.list"
    content = "\n".join(lines) + "\n"
    opts = [f"-o=Dir::Etc::SourceList={sl}", f"-o=Dir::Etc::SourceParts={base / 'parts'}",
            f"-o=Dir::Etc::PreferencesParts={base / 'prefs'}",
            f"-o=Dir::State::Lists={base / 'lists'}", f"-o=Dir::Cache={base / 'cache'}",
            f"-o=APT::Architectures::={arch}", f"-o=APT::Architecture={arch}"]
    stamp = base / "updated"
    if not sl.exists() or sl.read_text() != content or not stamp.exists():
        sl.write_text(content)
        _run(["apt-get", *opts, "update"], timeout=600)
        stamp.write_text("ok\n")
    return opts


def _keyring() -> str:
    return "/usr/share/keyrings/debian-archive-keyring.gpg"


def _download(opts: list[str], spec: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    _run(["apt-get", *opts, "download", spec], cwd=dest, timeout=900)
    name = spec.split("=")[0].split(":")[0]
    ver = spec.split("=", 1)[1].split(":", 1)[-1] if "=" in spec else "*"
    debs = sorted(dest.glob(f"{name}_{ver}_*.deb"))
    if not debs:
        raise SourceUnavailable(f"apt-get download {spec} produced no .deb")
    return debs[-1]


def _deb_versions(opts: list[str], package: str) -> list[str]:
    out = _run(["apt-cache", *opts, "madison", package])
    return [line.split("|")[1].strip() for line in out.splitlines() if "|" in line]


# --------------------------------------------------------------------------------------------
# NVIDIA sources

def _nvidia_tree_in(root: Path) -> Path | None:
    for cand in (root / "kernel-open", *sorted(root.glob("usr/src/nvidia-*"))):
        if (cand / "nvidia-uvm").is_dir() and (cand / "Kbuild").is_file():
            return cand
    return None


def nvidia_source(version: str) -> Path:
    """Path of the NVIDIA open kernel-module tree (/usr/src layout) for `version` (see module doc)."""
    root = cache_dir() / "nv" / version
    if (root / _READY).exists() or (version not in DEBIAN_VERSIONS and root.is_dir()):
        tree = _nvidia_tree_in(root)
        if tree is not None:
            return tree
    if version not in DEBIAN_VERSIONS:
        if version in shared_versions():
            return nvshared.unpack(version, cache_dir(), _locked, _run, _nvidia_tree_in, SourceUnavailable)
        raise SourceUnavailable(
            f"NVIDIA {version} is not in Debian's archive, not in {shared_dir()}/SHA256SUMS and no tree is "
            f"cached at {root}/kernel-open; put kernel-open-{version}.tar.xz and its SHA256SUMS line in "
            f"{shared_dir()} (or export it from a clone of github NVIDIA/open-gpu-kernel-modules with "
            f"'python3 tests/support/nvsrc.py git-export CLONE {version}')")
    with _locked(f"nv-{version}"):
        if (root / _READY).exists():
            tree = _nvidia_tree_in(root)
            if tree is not None:
                return tree
        mirror = debian_mirror()
        opts = _apt("amd64", [f"deb [signed-by={_keyring()}] {mirror} {s} contrib" for s in NVIDIA_SUITES])
        wanted = [v for v in _deb_versions(opts, "nvidia-open-kernel-dkms") if v.split("-")[0] == version]
        if not wanted:
            raise SourceUnavailable(f"nvidia-open-kernel-dkms {version} is not offered by {NVIDIA_SUITES}")
        debs = cache_dir() / "debs"
        deb = _download(opts, f"nvidia-open-kernel-dkms={wanted[0]}", debs)
        tmp = Path(tempfile.mkdtemp(prefix=f".nv-{version}-", dir=cache_dir()))
        try:
            _run(["dpkg-deb", "-x", deb, tmp])
            if _nvidia_tree_in(tmp) is None:
                raise SourceUnavailable(f"{deb.name} does not contain an NVIDIA kernel-module tree")
            (tmp / _READY).write_text(f"{deb.name}\n")
            if root.exists():
                shutil.rmtree(root)
            root.parent.mkdir(parents=True, exist_ok=True)
            os.rename(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return _nvidia_tree_in(root)


def export_git_tag(clone: str | os.PathLike, tag: str) -> Path:
    """Export `tag`'s kernel-open/ from a local git clone into the cache (session helper)."""
    root = cache_dir() / "nv" / tag
    with _locked(f"nv-{tag}"):
        if not (root / _READY).exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".nv-{tag}-", dir=cache_dir()))
            try:
                arch = subprocess.run(["git", "-C", str(clone), "archive", tag, "kernel-open"],
                                      stdout=subprocess.PIPE, check=True).stdout
                subprocess.run(["tar", "-x", "-C", str(tmp)], input=arch, check=True)
                (tmp / _READY).write_text(f"git {tag}\n")
                if root.exists():
                    shutil.rmtree(root)
                root.parent.mkdir(parents=True, exist_ok=True)
                os.rename(tmp, root)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return root / "kernel-open"


# --------------------------------------------------------------------------------------------
# Kernel trees

def _dpkg_installed(pkg: str) -> bool:
    p = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
    return p.returncode == 0 and "install ok installed" in p.stdout


def _ensure_packages(pkgs: list[str]) -> None:
    missing = [p for p in pkgs if not _dpkg_installed(p)]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SourceUnavailable(f"packages missing and not root: apt-get install {' '.join(missing)}")
    with _locked("apt-install"):
        missing = [p for p in pkgs if not _dpkg_installed(p)]
        if missing:
            _run(["apt-get", "install", "-y", "-q", *missing], timeout=1800)


def headers_abi_of(depends: str) -> str | None:
    """The kernel ABI linux-headers-amd64's Depends names: '6.1.0-57' (Debian 12: linux-headers-6.1.0-57-amd64),
    '6.12.117+deb13' (Debian 13: linux-headers-6.12.117+deb13-amd64); None when it names none."""
    m = re.search(r"linux-headers-(\d+\.\d+\.\d+(?:-\d+|\+deb\d+))-amd64\b", depends)
    return m.group(1) if m else None


def _headers_abi() -> str:
    """The kernel ABI of the installed linux-headers-amd64 (:func:`headers_abi_of`)."""
    out = subprocess.run(["dpkg-query", "-W", "-f=${Depends}", "linux-headers-amd64"],
                         capture_output=True, text=True).stdout
    abi = headers_abi_of(out)
    if abi is None:
        raise SourceUnavailable(f"cannot tell the kernel ABI from linux-headers-amd64 (Depends: {out.strip()!r})")
    return abi


def x86_headers() -> tuple[str, Path]:
    """(kernel release, /lib/modules/<release>/build) of Debian's x86_64 headers."""
    _ensure_packages(["linux-headers-amd64", "build-essential", "kmod"])
    rel = f"{_headers_abi()}-amd64"
    build = Path("/lib/modules") / rel / "build"
    if not (build / "Makefile").exists():
        raise SourceUnavailable(f"{build} is not a kernel build tree")
    return rel, build


def arm64_64k_tree() -> Path:
    """Prepared arm64 CONFIG_ARM64_64K_PAGES=y tree (see module doc)."""
    base = cache_dir() / "arm64-64k"
    tree = base / "linux-source-6.1"
    if (base / _READY).exists():
        return tree
    _ensure_packages(["linux-headers-amd64", "linux-source-6.1", "gcc-aarch64-linux-gnu", "bc", "bison",
                      "flex", "libssl-dev", "libelf-dev", "kmod", "make"])
    with _locked("arm64-64k"):
        if (base / _READY).exists():
            return tree
        tarball = sorted(glob.glob("/usr/src/linux-source-6.1.tar.*"))
        if not tarball:
            raise SourceUnavailable("linux-source-6.1 installed but no /usr/src/linux-source-6.1.tar.*")
        if base.exists():
            shutil.rmtree(base)
        base.mkdir(parents=True)
        _run(["tar", "-xf", tarball[0], "-C", base], timeout=1800)
        env = {"ARCH": "arm64", "CROSS_COMPILE": ARM64_CROSS}
        _run(["make", "defconfig"], cwd=tree, env=env)
        _run(["scripts/config", "--disable", "ARM64_4K_PAGES", "--disable", "ARM64_16K_PAGES",
              "--enable", "ARM64_64K_PAGES"], cwd=tree)
        _run(["make", "olddefconfig"], cwd=tree, env=env)
        cfg = (tree / ".config").read_text()
        if "CONFIG_ARM64_64K_PAGES=y" not in cfg:
            raise SourceUnavailable("olddefconfig dropped CONFIG_ARM64_64K_PAGES")
        _run(["make", "-j2", "modules_prepare"], cwd=tree, env=env, timeout=3600)
        # Module.symvers of Debian's real arm64 kernel (same ABI), so NVIDIA's export-symbol
        # conftests see real kernel exports instead of silently evaluating to 0.
        entries = [e for e in _system_source_entries() if "debian" in e[0]]
        lines = [f"deb [signed-by={_keyring()}] {uri} {suite} main" for uri, suites in entries for suite in suites]
        opts = _apt("arm64", lines)
        deb = _download(opts, f"linux-headers-{_headers_abi()}-arm64:arm64", base / "debs")
        ext = base / "debs" / "x"
        _run(["dpkg-deb", "-x", deb, ext])
        symvers = sorted(ext.glob("usr/src/linux-headers-*-arm64/Module.symvers"))
        if not symvers:
            raise SourceUnavailable(f"{deb.name} carries no Module.symvers")
        shutil.copy(symvers[0], tree / "Module.symvers")
        shutil.rmtree(ext)
        (base / _READY).write_text(f"defconfig+ARM64_64K_PAGES, Module.symvers from {deb.name}\n")
    return tree


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    try:
        if argv[0] == "nvidia":
            print(nvidia_source(argv[1]))
        elif argv[0] == "shared":
            for v in shared_versions():
                print(v, nvidia_source(v))
        elif argv[0] == "x86":
            print(*x86_headers())
        elif argv[0] == "arm64":
            print(arm64_64k_tree())
        elif argv[0] == "git-export":
            print(export_git_tag(argv[1], argv[2]))
        else:
            print(__doc__)
            return 2
    except SourceUnavailable as e:
        print(f"unavailable: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
