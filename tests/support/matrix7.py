"""The Linux 7.x compile matrix's build root: Debian 13 (trixie) with gcc-14, Debian's real 7.x headers.

Why a trixie root: Debian's 7.x kernels (trixie-backports, sid) are built with gcc-14, and their headers
packages carry gcc-14-only flags (``-fmin-function-alignment``...); Debian 12 has gcc-12. trixie's gcc-14
(14.2) is the compiler trixie-backports' kernels were built with, so the headers are used as shipped.

``buildroot() -> BuildRoot`` (cached under ``$SPARK_MEMSAVER_TEST_CACHE/matrix7/<key>``, exclusive lock,
atomic rename + ``.ready``):

- ``debootstrap --variant=minbase trixie`` with gcc-14 (native and ``gcc-aarch64-linux-gnu``), make, bc,
  bison, flex, libssl-dev, libelf-dev, kmod, dwarves and the Python modules the apply step imports;
- ``dpkg --add-architecture arm64``, trixie-backports, then **installed with apt**: Debian's
  ``linux-headers-<abi>-amd64``, ``linux-headers-<abi>-arm64:arm64`` and ``linux-headers-<abi>-arm64-16k:arm64``
  of the newest 7.x Debian offers there (cross-building modules against the arm64 headers is what their
  ``linux-kbuild`` (``Multi-Arch: foreign``, amd64 tools) and ``gcc-14-for-host:arm64`` dependencies are for);
- on first use (:func:`tree`), a **64 KiB-page** arm64 tree: Debian's ``linux-source-7.x`` of the same version, Debian's arm64 ``.config``
  + ``CONFIG_ARM64_64K_PAGES=y`` (module signing keys cleared), ``olddefconfig``, ``modules_prepare`` with
  the same gcc-14 cross compiler, Debian arm64's ``Module.symvers`` (Debian ships no 64 KiB arm64 kernel).

Commands run inside the root through ``systemd-nspawn --read-only`` (not booted; host network; the root is
shared, read-only, by concurrent runs) with the repository bound read-only at ``/repo`` and work directories
bound read-write: :meth:`BuildRoot.run`.

Command line::

    python3 tests/support/matrix7.py root [--64k]  # build/warm the cache (--64k: and the 64 KiB tree), print it
    python3 tests/support/matrix7.py run CMD...    # run CMD inside (repo at /repo, cache at the same path)
    python3 tests/support/matrix7.py cell VERSION {amd64|arm64-4k|arm64-16k|arm64-64k} OUTDIR [--no-stock] [--shim] [--ours-only]
                                                   # one matrix cell (uvm_patch/compile-matrix-7x.sh wraps it)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

try:
    from . import cache, nvsrc
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cache  # type: ignore
    import nvsrc  # type: ignore

REPO = Path(__file__).resolve().parents[2]
SUITE = "trixie"
PACKAGES = ("gcc", "gcc-14", "make", "libc6-dev", "bc", "bison", "flex", "libssl-dev", "libelf-dev", "kmod",
            "xz-utils", "dwarves", "gcc-aarch64-linux-gnu", "binutils-aarch64-linux-gnu", "patch", "file",
            "python3", "python3-yaml", "python3-click", "python3-jinja2", "python3-psutil")
FORMAT = 1
_READY = ".ready"


class Unavailable(RuntimeError):
    """The build root cannot be produced here (message says why)."""


@dataclasses.dataclass
class BuildRoot:
    root: Path
    kernel_version: str           # Debian package version, e.g. 7.3.4-1~bpo13+1
    abi: str                      # e.g. 7.3.4+deb13
    trees: dict                   # cell -> kernel build dir *inside* the root (amd64, arm64-4k, arm64-16k, arm64-64k)

    def run(self, argv, *, binds_rw=(), timeout=3600, env=None, log=None, repo=REPO,
            check=False) -> subprocess.CompletedProcess:
        return _nspawn(self.root, argv, binds_rw=binds_rw, timeout=timeout, env=env, log=log, repo=repo,
                       check=check, read_only=True)


#: matrix cells: name -> (compile-matrix.sh ARCH, page size)
CELLS = {"amd64": ("x86_64", 4096), "arm64-4k": ("arm64", 4096), "arm64-16k": ("arm64", 16384),
         "arm64-64k": ("arm64", 65536)}


def cell(version: str, name: str, out: Path, *, stock: bool = True, shim: bool = False, ours_only: bool = False,
         jobs: int = 2,
         repo: Path = REPO, timeout: int = 3600) -> tuple[int, str, dict | None]:
    """Run uvm_patch/compile-matrix.sh for NVIDIA `version` against cell `name` inside the build root.

    Returns (exit code, stdout+stderr, result.json or None). `out` is bound read-write at the same path.
    `repo` is bound at /repo (default: this checkout) and supplies the script and the apply step."""
    br = buildroot()
    src = nvsrc.nvidia_source(version)
    arch, _ = CELLS[name]
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {"JOBS": str(jobs), "STOCK": "1" if stock else "0", "OF_GPIO_SHIM": "1" if shim else "0",
           "OURS_ONLY": "1" if ours_only else "0",
           "PYTHON": "/usr/bin/python3"}
    p = br.run(["/repo/uvm_patch/compile-matrix.sh", src, tree(br, name), arch, out], binds_rw=[out.parent],
               env=env, repo=repo, timeout=timeout)
    res = out / "result.json"
    return p.returncode, p.stdout, (json.loads(res.read_text()) if res.exists() else None)


def _host(argv, *, timeout=1800, log=None, cwd=None):
    p = subprocess.run([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       errors="replace", timeout=timeout, cwd=cwd,
                       env=dict(os.environ, LC_ALL="C.UTF-8", DEBIAN_FRONTEND="noninteractive"))
    if log:
        with open(log, "a") as fh:
            fh.write(f"$ {' '.join(map(str, argv))}\n{p.stdout}\n")
    if p.returncode:
        raise Unavailable(f"{' '.join(map(str, argv))} failed (rc={p.returncode}):\n"
                          + "\n".join(p.stdout.splitlines()[-20:]))
    return p.stdout


def _nspawn(root: Path, argv, *, binds_rw=(), timeout=3600, env=None, log=None, check=True, repo=REPO,
            read_only=False):
    # --read-only takes a shared lock on the root (several builds at once); a writable run takes it alone
    args = ["systemd-nspawn", "-q", "--register=no", "--keep-unit", "--timezone=off", "--resolv-conf=copy-host",
            "--link-journal=no", "-D", str(root), f"--bind-ro={repo}:/repo", *(["--read-only"] if read_only else [])]
    c = cache.cache_dir()
    args.append(f"--bind={c}:{c}")
    for b in binds_rw:
        args.append(f"--bind={b}:{b}")
    for k, v in (env or {}).items():
        args.append(f"--setenv={k}={v}")
    args += ["--setenv=LC_ALL=C.UTF-8", "--setenv=DEBIAN_FRONTEND=noninteractive", "--", *map(str, argv)]
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                       timeout=timeout, stdin=subprocess.DEVNULL)
    if log:
        with open(log, "a") as fh:
            fh.write(f"# {' '.join(map(str, argv))}\n{p.stdout}\n")
    if check and p.returncode:
        raise Unavailable(f"in {SUITE} root: {' '.join(map(str, argv))} failed (rc={p.returncode}):\n"
                          + "\n".join(p.stdout.splitlines()[-25:]))
    return p


def _key() -> str:
    h = hashlib.sha256(repr((FORMAT, SUITE, sorted(PACKAGES))).encode()).hexdigest()[:12]
    return f"{SUITE}-{h}"


def _newest(root: Path, pkg: str) -> str:
    from tests.support.qemu import newest_in_madison
    best = newest_in_madison(_nspawn(root, ["apt-cache", "madison", pkg]).stdout, "7.")
    if best is None:
        raise Unavailable(f"no 7.x {pkg} in {SUITE}/{SUITE}-backports")
    return best


def buildroot() -> BuildRoot:
    base = cache.cache_dir() / "matrix7" / _key()
    root = base / "root"
    if not (base / _READY).exists():
        if os.geteuid() != 0:
            raise Unavailable("the trixie build root needs root (debootstrap, systemd-nspawn)")
        for tool in ("debootstrap", "systemd-nspawn"):
            if shutil.which(tool) is None:
                raise Unavailable(f"{tool} missing (apt-get install debootstrap systemd-container)")
        mirror = cache.debian_mirror()
        if mirror is None:
            raise Unavailable("no Debian archive entry in /etc/apt/sources.list(.d)")
        with cache.locked(f"matrix7-{_key()}"):
            if not (base / _READY).exists():
                _build(base, mirror)
    info = json.loads((base / _READY).read_text())
    return BuildRoot(root, info["kernel_version"], info["abi"], info["trees"])


def _build(base: Path, mirror: str) -> None:
    t0 = time.monotonic()
    base.mkdir(parents=True, exist_ok=True)
    tmp = base / "root.tmp"
    subprocess.run(["rm", "-rf", "--one-file-system", str(tmp)], check=False)
    log = base / "build.log"
    log.write_text("")
    _host(["debootstrap", "--variant=minbase", "--components=main", f"--include={','.join(PACKAGES)}",
           SUITE, tmp, mirror], log=log)
    key = "/usr/share/keyrings/debian-archive-keyring.gpg"
    (tmp / "etc/apt/sources.list.d").mkdir(parents=True, exist_ok=True)
    (tmp / "etc/apt/sources.list.d/debian.sources").write_text(
        f"Types: deb\nURIs: {mirror}\nSuites: {SUITE} {SUITE}-updates {SUITE}-backports\n"
        f"Components: main\nSigned-By: {key}\n")
    (tmp / "etc/apt/sources.list").unlink(missing_ok=True)
    (tmp / "etc/apt/apt.conf.d/90matrix").write_text('APT::Install-Recommends "false";\nAcquire::Retries "3";\n')
    _nspawn(tmp, ["dpkg", "--add-architecture", "arm64"], log=log)
    _nspawn(tmp, ["apt-get", "update", "-q"], log=log, timeout=900)
    version = _newest(tmp, "linux-headers-amd64")
    # ABI from the metapackage's dependency (linux-headers-7.3.4+deb13-amd64)
    show = _nspawn(tmp, ["apt-cache", "show", f"linux-headers-amd64={version}"]).stdout
    dep = next(d.strip().split(" ")[0] for ln in show.splitlines() if ln.startswith("Depends:")
               for d in ln.split(":", 1)[1].split(",") if d.strip().startswith("linux-headers-7."))
    abi = dep[len("linux-headers-"):-len("-amd64")]
    mm = ".".join(version.split(".")[:2])
    pkgs = [f"linux-headers-{abi}-amd64={version}", f"linux-headers-{abi}-arm64:arm64={version}",
            f"linux-headers-{abi}-arm64-16k:arm64={version}"]
    _nspawn(tmp, ["apt-get", "install", "-y", "-q", *pkgs], log=log, timeout=1800)
    _nspawn(tmp, ["apt-get", "clean"], log=log)
    k64 = f"/usr/src/linux-{abi}-arm64-64k"
    trees = {"amd64": f"/usr/src/linux-headers-{abi}-amd64", "arm64-4k": f"/usr/src/linux-headers-{abi}-arm64",
             "arm64-16k": f"/usr/src/linux-headers-{abi}-arm64-16k", "arm64-64k": k64}
    root = base / "root"
    subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=False)
    os.rename(tmp, root)
    (base / _READY).write_text(json.dumps({"kernel_version": version, "abi": abi, "trees": trees,
                                           "seconds": round(time.monotonic() - t0)}) + "\n")


def tree(br: BuildRoot, name: str) -> str:
    """The kernel build dir (inside the root) for cell `name`; the 64 KiB tree is prepared on first use."""
    path = br.trees[name]
    if name != "arm64-64k":
        return path
    stamp = br.root / path.lstrip("/") / ".matrix-ready"
    if stamp.exists():
        return path
    with cache.locked(f"matrix7-64k-{br.abi}"):
        if not stamp.exists():
            _prepare_64k(br, path, br.root.parent / "build-64k.log")
    return path


def _prepare_64k(br: BuildRoot, k64: str, log: Path) -> None:
    """linux-source of the headers' version, Debian's arm64 config + 64K pages, gcc-14 cross."""
    t0 = time.monotonic()
    log.write_text("")
    abi, version = br.abi, br.kernel_version
    mm = ".".join(version.split(".")[:2])
    tree = br.root / k64.lstrip("/")
    done = tree / "include/generated/autoconf.h"
    if done.exists() and (tree / "Module.symvers").exists() and \
            "CONFIG_ARM64_64K_PAGES=y" in (tree / ".config").read_text():
        (tree / ".matrix-ready").write_text("adopted\n")  # prepared by an earlier recipe, same steps
        return
    _nspawn(br.root, ["apt-get", "install", "-y", "-q", f"linux-source-{mm}={version}"], log=log, timeout=1800)
    script = f"""set -e
cd /usr/src && rm -rf {k64} {k64}.x && mkdir {k64}.x && tar -xf linux-source-{mm}.tar.xz -C {k64}.x
mv {k64}.x/linux-source-{mm} {k64} && rmdir {k64}.x && rm -f linux-source-{mm}.tar.xz
cd {k64}
cp /usr/src/linux-headers-{abi}-arm64/.config .config
scripts/config --disable ARM64_4K_PAGES --disable ARM64_16K_PAGES --enable ARM64_64K_PAGES \\
  --disable MODULE_SIG_ALL --set-str MODULE_SIG_KEY '' --set-str SYSTEM_TRUSTED_KEYS '' \\
  --set-str SYSTEM_REVOCATION_KEYS ''
make ARCH=arm64 CROSS_COMPILE=aarch64-linux-gnu- olddefconfig
grep -q '^CONFIG_ARM64_64K_PAGES=y' .config
nice -n 10 make -j2 ARCH=arm64 CROSS_COMPILE=aarch64-linux-gnu- KERNELRELEASE={abi}-arm64-64k modules_prepare
cp /usr/src/linux-headers-{abi}-arm64/Module.symvers Module.symvers
apt-get purge -y -q linux-source-{mm} && apt-get clean
"""
    _nspawn(br.root, ["sh", "-c", script], log=log, timeout=3600)
    (tree / ".matrix-ready").write_text(f"prepared in {time.monotonic() - t0:.0f}s\n")


def main(argv: list[str]) -> int:
    try:
        br = buildroot()
    except Unavailable as e:
        print(f"unavailable: {e}", file=sys.stderr)
        return 1
    if argv[:1] == ["root"]:
        if "--64k" in argv:
            tree(br, "arm64-64k")
        print(json.dumps(dataclasses.asdict(br) | {"root": str(br.root)}, indent=2))
        return 0
    if argv[:1] == ["run"] and len(argv) > 1:
        p = br.run(argv[1:])
        print(p.stdout, end="")
        return p.returncode
    if argv[:1] == ["cell"] and len(argv) >= 4:
        # cell VERSION NAME OUTDIR [--no-stock] [--shim]; REPO=<dir> binds another checkout at /repo
        rc, text, _ = cell(argv[1], argv[2], Path(argv[3]), stock="--no-stock" not in argv,
                           shim="--shim" in argv, ours_only="--ours-only" in argv, jobs=int(os.environ.get("JOBS", "2")),
                           repo=Path(os.environ.get("REPO", REPO)))
        print(text, end="")
        return rc
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
