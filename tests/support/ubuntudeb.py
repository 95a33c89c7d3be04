"""Ubuntu-shaped NVIDIA packages (.deb) and a local signed APT repository serving them, for end-to-end tests.

What they stand in for: the packages a DGX OS / Ubuntu 24.04 node gets its NVIDIA open kernel modules from
(shared/briefs/dkms-mok.md §3.1), with Ubuntu's names, layout and version style, built with the real
dpkg-deb from Debian's real NVIDIA sources (tests/support/nvsrc.py) and real stock modules compiled for each
kernel (tests/support/stockdriver.py):

``linux-modules-nvidia-<br>-open-<K>``  (version ``<abi>.<abinum>+<n>``, e.g. ``6.1.0-57.57+1``)
    the stock ``nvidia.ko`` and ``nvidia-uvm.ko`` precompiled for kernel ``K`` in
    ``/lib/modules/<K>/kernel/nvidia-<br>-open/`` (plain ``.ko``, as Canonical's file lists show);
    ``Depends: nvidia-kernel-common-<br> (>= <driver>)``; postinst/postrm run ``depmod -a <K>``.
    ``<n>`` is the respin number of the driver in :data:`VERSIONS` (1, 2, 3), so a newer driver for the same
    kernel is a real package upgrade, as linux-restricted-modules respins are.
    Not reproduced: nvidia-modeset/-drm/-peermem (stockdriver builds nvidia + nvidia-uvm only), the split
    into linux-objects-/linux-signatures- packages, Canonical's signatures, and the dependency on
    linux-image-<K> (the test containers have headers, no kernel image).
``nvidia-kernel-source-<br>-open``  (version ``<driver>-0ubuntu0.24.04.1``)
    NVIDIA's open tree at ``/usr/src/nvidia-<driver>/`` as Ubuntu ships it: no ``dkms.conf`` and no
    ``patches/`` (those are ``nvidia-dkms-<br>-open``'s), and, as tests/support/driverdeb.py does, without
    the prebuilt ``*.o_binary`` RM blobs (only nvidia.ko links them; nvidia-uvm builds without them).
``nvidia-kernel-common-<br>``  (same version)
    a documentation file only (Ubuntu's carries GSP firmware and udev rules the tests do not need).

Driver versions (:data:`VERSIONS`), all branch ``550`` so package names stay the same across versions:
    ``550.163.01``  NVIDIA's real release (Debian's nvidia-open-kernel-dkms 550.163.01).
    ``550.163.02``  "the next version": 550.163.01 re-versioned (tree: Kbuild/version.mk strings; modules: the
                    ``.modinfo`` ``version=`` string rewritten in place, code and CRCs untouched). No such
                    NVIDIA release exists; only its version string differs from 550.163.01, so its hooked
                    files are byte-identical to 550.163.01's (qualification by content applies).
    ``550.163.03``  the same again, used for "a version whose source package is not in the repository".
    (555.58.02 would be honest too, but under a 555 branch name: not an upgrade of the same packages.)

API
    ``ubuntu_debs(version, kernels) -> dict[str, Path]``: package name -> cached .deb (built once, locked).
    ``deb_version(version)``, ``modules_version(version, kernel)``, ``modules_package(kernel)``,
    ``SOURCE_PACKAGE``, ``COMMON_PACKAGE``: the names and versions the packages carry.
    ``ubuntu_repo(debs, dest, suite="noble") -> (repo_dir, keyring)``: a signed APT repository (apt-ftparchive
    + gpg; several versions of a package side by side in ``pool/``) at ``dest``, regenerated in place on each
    call (the repository directory itself is kept, so a bind mount of it sees the new state). The signing key
    lives in ``<test cache>/ubuntudeb/gnupg`` (0700, outside the checkout); ``keyring`` is its public key
    (binary, for ``Signed-By:``), copied to ``dest/../<name>.gpg``.
    ``sources_entry(uri, keyring, suite="noble") -> str``: the deb822 stanza for ``/etc/apt/sources.list.d``.

Command line: ``python3 tests/support/ubuntudeb.py VERSION KERNEL...`` prints the .deb paths.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from . import cache, driverdeb, nvsrc, stockdriver
except ImportError:  # run as a script: python3 tests/support/<name>.py
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cache  # type: ignore
    import driverdeb  # type: ignore
    import nvsrc  # type: ignore
    import stockdriver  # type: ignore

__all__ = ["BRANCH", "VERSIONS", "SOURCE_PACKAGE", "COMMON_PACKAGE", "UbuntuDebError", "ubuntu_debs",
           "deb_version", "modules_version", "modules_package", "ubuntu_repo", "sources_entry"]

BRANCH = "550"
#: driver version -> (the real NVIDIA release its files come from, respin number of the modules packages)
VERSIONS = {"550.163.01": ("550.163.01", 1), "550.163.02": ("550.163.01", 2), "550.163.03": ("550.163.01", 3)}
SOURCE_PACKAGE = f"nvidia-kernel-source-{BRANCH}-open"
COMMON_PACKAGE = f"nvidia-kernel-common-{BRANCH}"
UBUNTU_SUFFIX = "-0ubuntu0.24.04.1"
FORMAT = 1  # bump to rebuild cached packages when the recipe changes
_READY = ".ready"
_MAINT = "spark-memsaver tests <tests@localhost>"


class UbuntuDebError(RuntimeError):
    pass


def deb_version(version: str) -> str:
    """nvidia-kernel-source/-common version: '550.163.01' -> '550.163.01-0ubuntu0.24.04.1'."""
    return f"{version}{UBUNTU_SUFFIX}"


def modules_package(kernel: str) -> str:
    return f"linux-modules-nvidia-{BRANCH}-open-{kernel}"


def modules_version(version: str, kernel: str) -> str:
    """Ubuntu's kernel-ABI style: kernel '6.1.0-57-amd64', respin 2 -> '6.1.0-57.57+2'."""
    m = re.match(r"^(\d+\.\d+\.\d+)-(\d+)", kernel)
    if not m:
        raise UbuntuDebError(f"cannot derive an ABI from kernel release {kernel!r}")
    return f"{m.group(1)}-{m.group(2)}.{m.group(2)}+{VERSIONS[version][1]}"


def _out_dir() -> Path:
    return cache.cache_dir() / "ubuntudeb" / f"v{FORMAT}"


def _build(pkg: Path, deb: Path) -> None:
    # Ubuntu builds its .debs with zstd (dpkg >= 1.21.18 reads and writes it)
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zzstd", "-z3", "--build", str(pkg), str(deb)],
                   check=True, capture_output=True)


def _control(pkg: Path, fields: dict[str, str], description: str) -> Path:
    dbg = pkg / "DEBIAN"
    dbg.mkdir(parents=True, exist_ok=True)
    text = "".join(f"{k}: {v}\n" for k, v in fields.items())
    text += f"Maintainer: {_MAINT}\nDescription: {description}\n (spark-memsaver test package with Ubuntu's name and layout)\n"
    (dbg / "control").write_text(text)
    return dbg


def _cached(name: str, build) -> Path:
    """Build ``name`` (a .deb file name) once into the cache with ``build(pkgdir) -> None``."""
    out = _out_dir()
    deb = out / name
    if deb.exists() and Path(f"{deb}{_READY}").exists():
        return deb
    with cache.locked(f"ubuntudeb-{name}"):
        if deb.exists() and Path(f"{deb}{_READY}").exists():
            return deb
        out.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".pkg-", dir=out))
        try:
            build(tmp / "pkg")
            _build(tmp / "pkg", tmp / name)
            os.rename(tmp / name, deb)
            Path(f"{deb}{_READY}").write_text("ok\n")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return deb


def _source_deb(version: str) -> Path:
    base = VERSIONS[version][0]

    def build(pkg: Path) -> None:
        sdir = pkg / f"usr/src/nvidia-{version}"
        shutil.copytree(nvsrc.nvidia_source(base), sdir, symlinks=True,
                        ignore=shutil.ignore_patterns("*.o_binary", "dkms.conf", "patches"))
        if version != base and not driverdeb._reversion_tree(sdir, base, version):
            raise UbuntuDebError(f"{sdir}: no version string {base} found to rewrite")
        _control(pkg, {"Package": SOURCE_PACKAGE, "Source": f"nvidia-graphics-drivers-{BRANCH}",
                       "Version": deb_version(version), "Architecture": "amd64", "Section": "restricted/libs",
                       "Priority": "optional"},
                 f"NVIDIA kernel source package ({version}, open flavour)")

    return _cached(f"{SOURCE_PACKAGE}_{deb_version(version)}_amd64.deb", build)


def _common_deb(version: str) -> Path:
    def build(pkg: Path) -> None:
        doc = pkg / f"usr/share/doc/{COMMON_PACKAGE}"
        doc.mkdir(parents=True)
        (doc / "README.spark-memsaver-test").write_text(
            f"Stands in for Ubuntu's {COMMON_PACKAGE} {deb_version(version)} (firmware and udev rules omitted).\n")
        _control(pkg, {"Package": COMMON_PACKAGE, "Source": f"nvidia-graphics-drivers-{BRANCH}",
                       "Version": deb_version(version), "Architecture": "amd64", "Section": "restricted/libs",
                       "Priority": "optional"},
                 f"Shared files used by the NVIDIA kernel modules ({version})")

    return _cached(f"{COMMON_PACKAGE}_{deb_version(version)}_amd64.deb", build)


def _modules_deb(version: str, kernel: str) -> Path:
    base = VERSIONS[version][0]
    name = modules_package(kernel)
    ver = modules_version(version, kernel)

    def build(pkg: Path) -> None:
        built = stockdriver.build_stock(base, kernel)            # real modules for this kernel (cached)
        mdir = pkg / f"lib/modules/{kernel}/kernel/nvidia-{BRANCH}-open"
        mdir.mkdir(parents=True)
        for ko in ("nvidia.ko", "nvidia-uvm.ko"):
            shutil.copy2(built / ko, mdir / ko)
            if version != base:
                driverdeb._reversion_ko(mdir / ko, base, version)
        dbg = _control(pkg, {"Package": name, "Source": f"linux-restricted-modules-{kernel}",
                             "Version": ver, "Architecture": "amd64", "Section": "restricted/kernel",
                             "Priority": "optional", "Depends": f"{COMMON_PACKAGE} (>= {version})"},
                       f"Linux kernel nvidia modules for version {kernel} (NVIDIA {version}, open)")
        for script in ("postinst", "postrm"):
            (dbg / script).write_text(
                f"#!/bin/sh\nset -e\nif [ -d /lib/modules/{kernel} ]; then depmod -a {kernel}; fi\nexit 0\n")
            os.chmod(dbg / script, 0o755)

    return _cached(f"{name}_{ver}_amd64.deb", build)


def ubuntu_debs(version: str, kernels, source: bool = True) -> dict[str, Path]:
    """The Ubuntu-shaped packages of driver ``version``: common, source (unless ``source=False``) and one
    modules package per kernel in ``kernels``. Returns {package name: .deb path}."""
    if version not in VERSIONS:
        raise UbuntuDebError(f"no Ubuntu-shaped packages for {version} (known: {', '.join(VERSIONS)})")
    out = {COMMON_PACKAGE: _common_deb(version)}
    if source:
        out[SOURCE_PACKAGE] = _source_deb(version)
    for k in kernels:
        out[modules_package(k)] = _modules_deb(version, k)
    return out


# --------------------------------------------------------------------------------------------
# the signed repository

def _gpg_home() -> Path:
    home = cache.cache_dir() / "ubuntudeb" / "gnupg"
    with cache.locked("ubuntudeb-gnupg"):
        home.mkdir(parents=True, exist_ok=True)
        os.chmod(home, 0o700)
        if not (home / "keyring.gpg").exists():
            subprocess.run(["gpg", "--homedir", str(home), "--batch", "--passphrase", "", "--quick-gen-key",
                            "spark-memsaver test Ubuntu-shaped archive <tests@localhost>", "ed25519", "sign",
                            "never"], check=True, capture_output=True)
            pub = subprocess.run(["gpg", "--homedir", str(home), "--export"], check=True,
                                 capture_output=True).stdout
            if not pub:
                raise UbuntuDebError("gpg exported no public key")
            (home / "keyring.gpg.tmp").write_bytes(pub)
            os.rename(home / "keyring.gpg.tmp", home / "keyring.gpg")
    return home


def ubuntu_repo(debs, dest, suite: str = "noble") -> tuple[Path, Path]:
    """(Re)generate a signed APT repository at ``dest`` holding ``debs`` (paths, or a dict's values)."""
    debs = list(debs.values()) if isinstance(debs, dict) else list(debs)
    dest = Path(dest)
    home = _gpg_home()
    dest.mkdir(parents=True, exist_ok=True)
    pool = dest / "pool/restricted"
    pool.mkdir(parents=True, exist_ok=True)
    wanted = {Path(d).name for d in debs}
    for old in pool.glob("*.deb"):
        if old.name not in wanted:
            old.unlink()
    for d in debs:
        target = pool / Path(d).name
        if not target.exists():
            shutil.copy2(d, target)
    # build dists/ beside, then swap it in (apt never sees a half-written index)
    new = dest / ".dists.new"
    shutil.rmtree(new, ignore_errors=True)
    bdir = new / suite / "restricted/binary-amd64"
    bdir.mkdir(parents=True)
    packages = subprocess.run(["apt-ftparchive", "packages", "pool"], cwd=dest, check=True,
                              capture_output=True, text=True).stdout
    (bdir / "Packages").write_text(packages)
    subprocess.run(["gzip", "-9kn", str(bdir / "Packages")], check=True)
    release = subprocess.run(
        ["apt-ftparchive", "-o", "APT::FTPArchive::Release::Origin=spark-memsaver-tests",
         "-o", "APT::FTPArchive::Release::Label=spark-memsaver-tests",
         "-o", f"APT::FTPArchive::Release::Suite={suite}", "-o", f"APT::FTPArchive::Release::Codename={suite}",
         "-o", "APT::FTPArchive::Release::Architectures=amd64",
         "-o", "APT::FTPArchive::Release::Components=restricted", "release", str(new / suite)],
        check=True, capture_output=True, text=True).stdout
    (new / suite / "Release").write_text(release)
    gpg = ["gpg", "--homedir", str(home), "--batch", "--yes", "--pinentry-mode", "loopback", "--passphrase", ""]
    subprocess.run([*gpg, "--clearsign", "-o", str(new / suite / "InRelease"), str(new / suite / "Release")],
                   check=True, capture_output=True)
    subprocess.run([*gpg, "-abs", "-o", str(new / suite / "Release.gpg"), str(new / suite / "Release")],
                   check=True, capture_output=True)
    old = dest / ".dists.old"
    shutil.rmtree(old, ignore_errors=True)
    if (dest / "dists").exists():
        os.rename(dest / "dists", old)
    os.rename(new, dest / "dists")
    shutil.rmtree(old, ignore_errors=True)
    for p in [dest, *dest.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)   # apt's _apt sandbox user reads file: repositories
    keyring = dest.parent / f"{dest.name}.gpg"
    shutil.copy2(home / "keyring.gpg", keyring)
    os.chmod(keyring, 0o644)
    return dest, keyring


def sources_entry(uri: str, keyring: str, suite: str = "noble") -> str:
    return f"Types: deb\nURIs: {uri}\nSuites: {suite}\nComponents: restricted\nSigned-By: {keyring}\n"


if __name__ == "__main__":
    if len(sys.argv) < 3:
        print(__doc__)
        sys.exit(2)
    for name, path in ubuntu_debs(sys.argv[1], sys.argv[2:]).items():
        print(name, path)
