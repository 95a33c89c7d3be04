"""Throw-away Debian containers with a real systemd PID 1 (systemd-nspawn), for package and lifecycle tests.

What it stands in for: a freshly installed Debian node. It is the real thing except the kernel: the
container shares the host kernel (no module loading, no udevd events, no EFI firmware).

Host requirements (root): ``systemd-container`` (systemd-nspawn), ``debootstrap``, ``util-linux``
(nsenter). They are listed in ``tools/deps/package.txt``.

Rootfs cache
    ``rootfs(suite="bookworm", extra=()) -> Path`` debootstraps a ``--variant=minbase`` rootfs with
    systemd, systemd-sysv, dbus, python3 and spark-memsaver's runtime dependencies (:data:`BASE_PACKAGES`)
    plus ``extra`` packages, once, under ``$SPARK_MEMSAVER_TEST_CACHE/nspawn/<suite>-<hash>/root``
    (exclusive ``flock`` on ``<cache>/locks/nspawn-<suite>-<hash>.lock``, published by atomic rename and a
    ``.ready`` stamp). The Debian mirror is read at run time from ``/etc/apt/sources.list.d/*.sources``
    (or ``sources.list``); inside the rootfs apt gets ``main contrib`` for the suite and its lists are
    fetched at build time, so ``apt-get install ./x.deb`` works offline when the dependencies are already
    there. The cached rootfs is never booted: containers boot a throw-away layer over it.

Containers
    ::

        from tests.support.nspawn import Container, kernel_headers
        with Container(binds=[("/srv/x", "/srv/x")], kernels=kernel_headers()) as c:
            c.copy_in("build/deb/spark-memsaver_0.1_all.deb", "/root/")
            r = c.run(["apt-get", "install", "-y", "/root/spark-memsaver_0.1_all.deb"], timeout=300)
            print(r.stdout)
            assert c.run(["systemctl", "is-active", "foo"], check=False).stdout.strip() == "active"

    ``Container(suite="bookworm", extra=(), binds=(), binds_rw=(), kernels=(), name=None,
    boot_timeout=60, layer="auto")``
        ``binds``: ``(host_path, container_path)`` pairs bind-mounted read-only; ``binds_rw``: read-write
        (use sparingly: the container can change the host). ``kernels``: kernel releases whose host
        headers are made visible so DKMS can build inside: ``/usr/src/linux-headers-*`` and
        ``/usr/lib/linux-kbuild-*`` are bind-mounted read-only and a *writable* ``/lib/modules/<K>`` is
        created in the container holding copies of the host's top-level entries (``build``/``source``
        links, ``modules.*``), so ``dkms install`` and ``depmod`` write into the container only. Shared
        libraries the headers' tools need (objtool: libelf1) are apt-installed at boot (~10 s), as the
        linux-headers packages' dependencies would be.
        ``layer``: ``"overlay"`` (overlayfs over the cached rootfs; default when the kernel supports it),
        ``"copy"`` (``cp -a --reflink=auto``) or ``"auto"``.
        The host's CA bundle is bind-mounted at ``/etc/host-ca.crt`` and ``PIP_CERT``/``REQUESTS_CA_BUNDLE``
        point at it (this workplace intercepts TLS; apt itself uses signed plain-http archives).

    Entering ``with`` boots ``systemd-nspawn -b --register=no --keep-unit`` (no host systemd/machined is
    needed) in its own session and waits until ``systemctl is-system-running`` says ``running`` or
    ``degraded`` (:class:`ContainerError` after ``boot_timeout`` s, with the boot log). Leaving ``with``
    (also on exceptions) powers the container off, SIGKILLs it after 20 s, unmounts and deletes the layer.

    Attributes and methods:
        ``root``: host path of the container's root directory (the merged layer). Paths on tmpfs mounts
        inside the container (``/run``, ``/tmp``) are only visible through ``proc_root``.
        ``proc_root``: ``/proc/<pid1>/root`` (the container's view, tmpfs mounts included).
        ``pid``: host PID of the container's systemd (PID 1 inside).
        ``run(argv, check=True, timeout=300, input=None, env=None, cwd="/") -> CompletedProcess``
            runs ``argv`` inside all of the container's namespaces through ``nsenter`` with a clean
            environment (``PATH``, ``LANG=C.UTF-8``, ``DEBIAN_FRONTEND=noninteractive``, ``HOME=/root``
            plus ``env``); ``stdout``/``stderr`` are text. With ``check`` a non-zero exit raises
            :class:`CommandFailed` (``.result`` holds the CompletedProcess; the message shows argv, rc and
            the output tails). A timeout kills the command and raises :class:`ContainerError`.
        ``sh(script, **kw)``: ``run(["sh", "-ec", script], **kw)``.
        ``copy_in(src, dst)``: copies a host file or directory into the container (``dst`` ending in
        ``/`` or an existing directory receives it by name), preserving modes; returns the container path.
        ``copy_out(src, dst)``: the reverse.
        ``read_text(path)``, ``exists(path)``: read through ``proc_root``.
        ``bus_address``: ``unix:path=/proc/<pid>/root/run/dbus/system_bus_socket`` (for busctl/gdbus
        ``--address`` from the host).
        ``journal(unit=None, lines=200) -> str``, ``boot_log() -> str``: for failure messages.
        ``poweroff()``: explicit teardown (idempotent).
        ``start_sshd(address, authorized_key, port=22)``: sshd on that loopback address only (the
        containers share the host's network namespace, so each takes its own 127.0.0.x); root by key only.
        Needs ``extra=("openssh-server",)``.

    ``containers(n, **kw)``: a context manager booting ``n`` containers with the same arguments.
    ``base=MINIMAL_PACKAGES`` (for :func:`rootfs` and :class:`Container`): minbase plus systemd and dbus
    only, a node as a minimal install leaves it (no compiler, dpkg-dev, sudo or cpio).

    ``kernel_headers() -> list[str]``: kernel releases with headers on the host (``/lib/modules/*/build``).
    ``debian_mirror() -> str``: the mirror URI from the system's apt sources.
    ``available() -> str | None``: None when containers can run here, else the reason (for ``pytest.skip``).

Command line::

    python3 tests/support/nspawn.py rootfs [SUITE]       # build/warm the cache, print the path
    python3 tests/support/nspawn.py shell [SUITE]        # boot one and open a shell in it (debugging)
    python3 tests/support/nspawn.py bench [SUITE]        # time boot+teardown per layer kind
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

try:
    from . import cache
except ImportError:  # run as a script: python3 tests/support/<name>.py
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cache  # type: ignore

__all__ = ["BASE_PACKAGES", "MINIMAL_PACKAGES", "Container", "containers", "ContainerError", "CommandFailed", "rootfs", "kernel_headers",
           "debian_mirror", "available", "cache_dir"]

#: Packages every rootfs gets: a booting systemd with a system bus, and spark-memsaver's runtime
#: dependencies (so installing our .deb in a test does not download the world every time).
BASE_PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "libpam-systemd", "polkitd",
    "python3", "python3-pydbus", "python3-gi", "python3-psutil", "python3-pyudev", "python3-jinja2",
    "python3-click", "python3-yaml",
    "dkms", "kmod", "patch", "openssl", "mokutil", "make", "gcc", "libc6-dev", "dpkg-dev",
    "ca-certificates", "procps", "less",
)
#: A node as a minimal Debian install leaves it: minbase plus a booting systemd with a system bus.
MINIMAL_PACKAGES = ("systemd", "systemd-sysv", "dbus")
ROOTFS_FORMAT = 2  # bump to invalidate cached rootfs trees when the recipe changes
_READY = ".ready"
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ContainerError(RuntimeError):
    """The container could not be prepared, booted, entered or torn down (message says why)."""


class CommandFailed(ContainerError):
    """A command run inside the container exited non-zero; ``.result`` is the CompletedProcess."""

    def __init__(self, msg: str, result: subprocess.CompletedProcess):
        super().__init__(msg)
        self.result = result


cache_dir = cache.cache_dir
_locked = cache.locked


def _tail(text: str, n: int = 25) -> str:
    return "\n".join((text or "").strip().splitlines()[-n:])


def _host_run(argv, *, timeout=600, check=True, env=None, log=None):
    full_env = dict(os.environ, LC_ALL="C.UTF-8", DEBIAN_FRONTEND="noninteractive")
    if env:
        full_env.update(env)
    p = subprocess.run([str(a) for a in argv], env=full_env, timeout=timeout, text=True, errors="replace",
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if log is not None:
        Path(log).write_text(p.stdout)
    if check and p.returncode != 0:
        raise ContainerError(f"{' '.join(map(str, argv))} failed (rc={p.returncode}):\n{_tail(p.stdout)}")
    return p


# --------------------------------------------------------------------------------------------
# apt sources

_source_entries = cache.source_entries


def debian_mirror() -> str:
    """The Debian archive URI the host's apt uses (the entry that carries a plain release suite)."""
    uri = cache.debian_mirror()
    if uri is None:
        raise ContainerError("no Debian archive entry in /etc/apt/sources.list(.d); configure apt with a Debian mirror")
    return uri


def _security_mirror(suite: str) -> str | None:
    for uri, suites in _source_entries():
        if f"{suite}-security" in suites:
            return uri
    return None


# --------------------------------------------------------------------------------------------
# availability and rootfs

def available() -> str | None:
    """None when containers can be booted here, else a reason suitable for pytest.skip."""
    if os.geteuid() != 0:
        return "systemd-nspawn containers need root"
    for tool in ("systemd-nspawn", "debootstrap", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install systemd-container debootstrap util-linux)"
    return None


def _rootfs_key(suite: str, extra, base=None) -> str:
    if base is None:  # the default recipe keeps its historical key (existing caches stay valid)
        h = hashlib.sha256(repr((ROOTFS_FORMAT, suite, sorted(BASE_PACKAGES), sorted(extra))).encode()).hexdigest()
    else:
        h = hashlib.sha256(repr((ROOTFS_FORMAT, suite, "base", sorted(base), sorted(extra))).encode()).hexdigest()
    return f"{suite}-{h[:12]}"


def rootfs(suite: str = "bookworm", extra=(), base=None) -> Path:
    """Path of the cached, never-booted rootfs for `suite` with `base` (default BASE_PACKAGES) + `extra`
    (built once). ``base=MINIMAL_PACKAGES`` gives a node as a minimal install leaves it (no compiler,
    no dpkg-dev, no sudo, no cpio): the first-contact tests use it."""
    reason = available()
    if reason:
        raise ContainerError(reason)
    base_pkgs = BASE_PACKAGES if base is None else tuple(base)
    key = _rootfs_key(suite, tuple(extra), None if base is None else base_pkgs)
    base = cache_dir() / "nspawn" / key
    root = base / "root"
    if (base / _READY).exists():
        return root
    with _locked(f"nspawn-{key}"):
        if (base / _READY).exists():
            return root
        base.mkdir(parents=True, exist_ok=True)
        tmp = base / "root.tmp"
        if tmp.exists():
            _rmtree(tmp)
        mirror = debian_mirror()
        log = base / "debootstrap.log"
        pkgs = ",".join(sorted(set(base_pkgs) | set(extra)))
        t0 = time.monotonic()
        _host_run(["debootstrap", "--variant=minbase", "--components=main,contrib", f"--include={pkgs}",
                   suite, tmp, mirror], timeout=1800, log=log)
        _configure_rootfs(tmp, suite, mirror)
        os.rename(tmp, root)
        (base / _READY).write_text(f"built in {time.monotonic() - t0:.1f}s from {pkgs}\n")
    return root


def _configure_rootfs(root: Path, suite: str, mirror: str) -> None:
    """apt sources (main contrib) + lists, hostname, quiet boot, no pager, no docs purge."""
    lines = [f"Types: deb\nURIs: {mirror}\nSuites: {suite}"
             + (f" {suite}-updates" if suite not in ("sid", "unstable") else "")
             + "\nComponents: main contrib\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"]
    sec = _security_mirror(suite)
    if sec:
        lines.append(f"Types: deb\nURIs: {sec}\nSuites: {suite}-security\nComponents: main contrib\n"
                     "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")
    (root / "etc/apt/sources.list.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/apt/sources.list.d/debian.sources").write_text("\n".join(lines))
    with contextlib.suppress(FileNotFoundError):
        (root / "etc/apt/sources.list").unlink()
    (root / "etc/apt/apt.conf.d/90spark-test").write_text(
        'APT::Install-Recommends "false";\nAcquire::Retries "3";\nDpkg::Use-Pty "false";\n')
    (root / "etc/hostname").write_text("spark-test\n")
    # A fresh machine-id per boot (empty file = "uninitialized": systemd makes a transient one).
    (root / "etc/machine-id").write_text("")
    with contextlib.suppress(FileNotFoundError):
        (root / "var/lib/dbus/machine-id").unlink()
    # Units that cannot work in a container sharing the host kernel; masking keeps "running" reachable.
    for unit in ("systemd-udevd.service", "systemd-udev-trigger.service", "systemd-udev-settle.service",
                 "systemd-modules-load.service", "getty@.service", "console-getty.service",
                 "systemd-timesyncd.service", "apt-daily.timer", "apt-daily-upgrade.timer",
                 "e2scrub_all.timer", "fstrim.timer", "dpkg-db-backup.timer"):
        link = root / "etc/systemd/system" / unit
        link.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to("/dev/null")
    _host_run(["chroot", root, "apt-get", "update", "-q"], timeout=600)
    _host_run(["chroot", root, "apt-get", "clean"], timeout=60)


def _rmtree(path: Path) -> None:
    # rm -rf copes with read-only dirs and is faster than shutil on big trees
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


def kernel_headers() -> list[str]:
    """Kernel releases whose headers are installed on the host (``/lib/modules/<K>/build`` resolves)."""
    return sorted(Path(p).parent.name for p in glob.glob("/lib/modules/*/build") if Path(p).resolve().is_dir())


_overlay_ok: bool | None = None


def _overlay_supported() -> bool:
    global _overlay_ok
    if _overlay_ok is None:
        _overlay_ok = "overlay" in Path("/proc/filesystems").read_text()
    return _overlay_ok


# --------------------------------------------------------------------------------------------
# the container

class Container:
    def __init__(self, suite: str = "bookworm", extra=(), binds=(), binds_rw=(), kernels=(),
                 name: str | None = None, boot_timeout: float = 60, layer: str = "auto", base=None):
        self.suite = suite
        self.extra = tuple(extra)
        self.base = None if base is None else tuple(base)
        self.binds = [(str(a), str(b)) for a, b in binds]
        self.binds_rw = [(str(a), str(b)) for a, b in binds_rw]
        self.kernels = list(kernels)
        self.name = name or f"smtest-{uuid.uuid4().hex[:8]}"
        self.boot_timeout = boot_timeout
        if layer == "auto":
            layer = "overlay" if _overlay_supported() else "copy"
        if layer not in ("overlay", "copy"):
            raise ValueError(f"layer must be overlay, copy or auto, not {layer!r}")
        self.layer = layer
        self.pid: int | None = None
        self._proc: subprocess.Popen | None = None
        self._work: Path | None = None
        self.root: Path | None = None
        self._mounted = False
        self._log: Path | None = None
        self.timings: dict[str, float] = {}

    # ---- lifecycle
    def __enter__(self) -> "Container":
        try:
            self.start()
        except BaseException:
            self.poweroff()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.poweroff()

    def start(self) -> None:
        t0 = time.monotonic()
        lower = rootfs(self.suite, self.extra, base=self.base)
        runs = cache_dir() / "nspawn" / "run"
        runs.mkdir(parents=True, exist_ok=True)
        self._work = Path(tempfile.mkdtemp(prefix=f"{self.name}.", dir=runs))
        self._log = self._work / "boot.log"
        if self.layer == "overlay":
            for d in ("upper", "work", "merged"):
                (self._work / d).mkdir()
            self.root = self._work / "merged"
            _host_run(["mount", "-t", "overlay", "overlay", "-o",
                       f"lowerdir={lower},upperdir={self._work / 'upper'},workdir={self._work / 'work'}",
                       self.root], timeout=60)
            self._mounted = True
        else:
            self.root = self._work / "root"
            _host_run(["cp", "-a", "--reflink=auto", lower, self.root], timeout=600)
        self.timings["layer"] = time.monotonic() - t0

        args = ["systemd-nspawn", "-q", "-D", str(self.root), "-b", "-M", self.name,
                "--register=no", "--keep-unit", "--console=read-only", "--resolv-conf=copy-host",
                "--timezone=off", "--link-journal=no"]
        ca = "/etc/ssl/certs/ca-certificates.crt"
        if os.path.exists(ca):
            args += [f"--bind-ro={ca}:/etc/host-ca.crt"]
        for src, dst in self.binds:
            args.append(f"--bind-ro={src}:{dst}")
        for src, dst in self.binds_rw:
            args.append(f"--bind={src}:{dst}")
        for hdr in self._kernel_paths():
            args.append(f"--bind-ro={hdr}:{hdr}")
        self._prepare_kernels()
        t1 = time.monotonic()
        logf = open(self._log, "w")
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                      start_new_session=True,
                                      env=dict(os.environ, SYSTEMD_LOG_COLOR="0", LC_ALL="C.UTF-8"))
        logf.close()
        self.pid = self._wait_pid1()
        self._wait_running()
        self.timings["boot"] = time.monotonic() - t1
        # Tests expect the host CA for Python HTTPS clients (pip/requests); apt does not need it.
        self.sh("test ! -e /etc/host-ca.crt || { printf 'PIP_CERT=/etc/host-ca.crt\\n"
                "REQUESTS_CA_BUNDLE=/etc/host-ca.crt\\n' >> /etc/environment; }", timeout=30)
        if self.kernels:
            self._install_kbuild_libraries()

    def _install_kbuild_libraries(self) -> None:
        """The bound headers' tools (objtool, sign-file, modpost...) need the shared libraries their
        packages depend on (libelf1, libssl3): install the missing ones, as installing linux-headers would."""
        t = time.monotonic()
        r = self.sh("for f in $(find /usr/lib/linux-kbuild-* /usr/src/linux-headers-* -type f -perm -u+x "
                    "2>/dev/null); do head -c 4 \"$f\" | grep -q ELF && ldd \"$f\" 2>/dev/null; done "
                    "| sed -n 's/^[[:space:]]*\\([^ ]*\\) => not found.*/\\1/p' | sort -u", timeout=120)
        libs = r.stdout.split()
        if not libs:
            return
        pkgs = set()
        for lib in libs:
            q = subprocess.run(["dpkg-query", "-S", f"*/{lib}"], capture_output=True, text=True)
            for line in q.stdout.splitlines():
                pkg = line.split(":", 1)[0].split(",")[0].strip()
                if pkg and not pkg.endswith("-dev"):
                    pkgs.add(pkg)
                    break
        if not pkgs:
            raise ContainerError(f"kernel headers' tools miss {libs} and no host package provides them")
        r = self.run(["apt-get", "install", "-y", "-q", *sorted(pkgs)], check=False, timeout=300)
        if r.returncode != 0:
            self.run(["apt-get", "update", "-q"], timeout=300)
            self.run(["apt-get", "install", "-y", "-q", *sorted(pkgs)], timeout=300)
        self.timings["kbuild-libs"] = time.monotonic() - t

    def _kernel_paths(self) -> list[str]:
        if not self.kernels:
            return []
        paths = set()
        for k in self.kernels:
            mod = Path("/lib/modules") / k
            if not mod.is_dir():
                raise ContainerError(f"kernel {k}: /lib/modules/{k} does not exist on the host")
            for link in ("build", "source"):
                target = mod / link
                if target.exists():
                    paths.add(str(target.resolve()))
        # the headers trees link into linux-kbuild-* / the -common tree: bind every candidate
        paths.update(glob.glob("/usr/src/linux-headers-*"))
        paths.update(glob.glob("/usr/lib/linux-kbuild-*"))
        return sorted(p for p in paths if os.path.isdir(p))

    def _prepare_kernels(self) -> None:
        for k in self.kernels:
            src = Path("/lib/modules") / k
            dst = self.root / "usr/lib/modules" / k
            dst.mkdir(parents=True, exist_ok=True)
            for entry in src.iterdir():
                if entry.is_symlink():
                    os.symlink(os.readlink(entry), dst / entry.name)
                elif entry.is_file():
                    shutil.copy2(entry, dst / entry.name)
            # subdirectories (kernel/, updates/) are deliberately not copied: DKMS writes into updates/

    def _wait_pid1(self) -> int:
        deadline = time.monotonic() + self.boot_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ContainerError(f"systemd-nspawn exited early (rc={self._proc.returncode}):\n"
                                     f"{_tail(self.boot_log())}")
            for child in _children(self._proc.pid):
                if _comm(child) == "systemd":
                    return child
                for grandchild in _children(child):  # nspawn's inner child forks PID 1 on some versions
                    if _comm(grandchild) == "systemd":
                        return grandchild
            time.sleep(0.05)
        raise ContainerError(f"container PID 1 did not appear in {self.boot_timeout}s:\n{_tail(self.boot_log())}")

    def _wait_running(self) -> None:
        deadline = time.monotonic() + self.boot_timeout
        state = ""
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ContainerError(f"container stopped while booting:\n{_tail(self.boot_log())}")
            try:
                r = self.run(["systemctl", "is-system-running"], check=False, timeout=10)
                state = r.stdout.strip()
            except ContainerError:
                state = "unreachable"
            if state in ("running", "degraded"):
                return
            time.sleep(0.1)
        failed = self.run(["systemctl", "--failed", "--no-legend"], check=False, timeout=10).stdout
        raise ContainerError(f"container did not reach running in {self.boot_timeout}s (state {state!r});"
                             f" failed units:\n{failed}\n{_tail(self.boot_log())}")

    def poweroff(self, timeout: float = 20) -> None:
        """Power off (SIGKILL after `timeout`), unmount and delete the layer. Safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            if self.pid:
                # SIGRTMIN+4 asks systemd for poweroff; it works without entering the container.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGRTMIN + 4)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                if self.pid:
                    # killing a pid namespace's init kills everything in it
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        self.pid = None
        if self._mounted and self.root is not None:
            for _ in range(50):
                r = subprocess.run(["umount", str(self.root)], capture_output=True)
                if r.returncode == 0:
                    break
                time.sleep(0.1)
            else:
                subprocess.run(["umount", "-l", str(self.root)], capture_output=True)
            self._mounted = False
        if self._work is not None and self._work.exists() and not os.environ.get("SPARK_MEMSAVER_KEEP_CONTAINER"):
            _rmtree(self._work)
            self._work = None

    # ---- talking to it
    @property
    def proc_root(self) -> Path:
        if not self.pid:
            raise ContainerError("container is not running")
        return Path(f"/proc/{self.pid}/root")

    @property
    def bus_address(self) -> str:
        return f"unix:path={self.proc_root}/run/dbus/system_bus_socket"

    def run(self, argv, check: bool = True, timeout: float = 300, input: str | None = None,
            env: dict | None = None, cwd: str = "/") -> subprocess.CompletedProcess:
        if not self.pid:
            raise ContainerError("container is not running")
        environ = {"PATH": _PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/root", "TERM": "dumb",
                   "DEBIAN_FRONTEND": "noninteractive", "SYSTEMD_PAGER": "", "PAGER": "cat",
                   "SYSTEMD_COLORS": "0"}
        environ.update(env or {})
        argv = [str(a) for a in argv]
        full = ["nsenter", "-t", str(self.pid), "-a", "-r", "-w", "env", "-i", f"--chdir={cwd}",
                *[f"{k}={v}" for k, v in environ.items()], *argv]
        try:
            r = subprocess.run(full, input=input, text=True, errors="replace", timeout=timeout,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=None if input is not None else subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            raise ContainerError(f"in container: {' '.join(argv)} timed out after {timeout}s:\n"
                                 f"{_tail(e.stdout if isinstance(e.stdout, str) else '')}") from None
        if check and r.returncode != 0:
            raise CommandFailed(f"in container: {' '.join(argv)} failed (rc={r.returncode})\n"
                                f"--- stdout:\n{_tail(r.stdout, 40)}\n--- stderr:\n{_tail(r.stderr, 40)}", r)
        return r

    def sh(self, script: str, **kw) -> subprocess.CompletedProcess:
        return self.run(["sh", "-ec", script], **kw)

    def _inside(self, path: str) -> Path:
        return self.proc_root / str(path).lstrip("/")

    def copy_in(self, src, dst) -> str:
        src = Path(src)
        target = self._inside(dst)
        if str(dst).endswith("/") or target.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            target = target / src.name
            dst = str(dst).rstrip("/") + "/" + src.name
        target.parent.mkdir(parents=True, exist_ok=True)
        _host_run(["cp", "-a", "--reflink=auto", "-T", src, target], timeout=300)
        return str(dst)

    def copy_out(self, src, dst) -> Path:
        _host_run(["cp", "-a", "-T", self._inside(src), dst], timeout=300)
        return Path(dst)

    def exists(self, path: str) -> bool:
        return os.path.lexists(self._inside(path))

    def read_text(self, path: str) -> str:
        return self._inside(path).read_text(errors="replace")

    def start_sshd(self, address: str, authorized_key: str, port: int = 22, timeout: float = 30) -> tuple[str, int]:
        """Run the container's sshd on ``address:port`` only (the container shares the host's network, so
        each container takes its own loopback address, e.g. 127.0.0.2), root login by ``authorized_key``
        only. Needs ``openssh-server`` in the rootfs (``extra=("openssh-server",)``). Returns (address, port)
        once the port accepts connections."""
        if not self.exists("/usr/sbin/sshd"):
            raise ContainerError("sshd is not installed in this rootfs: build it with extra=('openssh-server',)")
        conf = (f"ListenAddress {address}:{port}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUseDNS no\n")
        self.run(["mkdir", "-p", "-m", "0700", "/root/.ssh"], timeout=30)
        self.run(["sh", "-ec", "cat > /etc/ssh/sshd_config.d/spark-test.conf"], input=conf, timeout=30)
        self.run(["sh", "-ec", "cat > /root/.ssh/authorized_keys; chmod 0600 /root/.ssh/authorized_keys"],
                 input=authorized_key.strip() + "\n", timeout=30)
        self.run(["ssh-keygen", "-A"], timeout=60)
        self.run(["systemctl", "restart", "ssh.service"], timeout=60)
        deadline = time.monotonic() + timeout
        import socket
        while True:
            try:
                with socket.create_connection((address, port), timeout=2):
                    return address, port
            except OSError as e:
                if time.monotonic() > deadline:
                    raise ContainerError(f"sshd in {self.name} does not accept on {address}:{port}: {e}\n"
                                         f"{self.journal('ssh.service', 30)}") from None
                time.sleep(0.2)

    def journal(self, unit: str | None = None, lines: int = 200) -> str:
        argv = ["journalctl", "--no-pager", "-n", str(lines)] + (["-u", unit] if unit else [])
        try:
            r = self.run(argv, check=False, timeout=30)
            return r.stdout + r.stderr
        except ContainerError as e:
            return f"(journal unavailable: {e})"

    def boot_log(self) -> str:
        try:
            return self._log.read_text(errors="replace") if self._log else ""
        except OSError:
            return ""


@contextlib.contextmanager
def containers(n: int, **kw):
    """``n`` containers booted one after the other with the same arguments (names ``<name>-<i>`` when
    ``name`` is given); yields the list and powers all of them off on exit, also on errors."""
    name = kw.pop("name", None)
    with contextlib.ExitStack() as stack:
        out = []
        for i in range(n):
            out.append(stack.enter_context(Container(name=f"{name}-{i}" if name else None, **kw)))
        yield out


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
        return [int(x) for x in text.split()]
    except (OSError, ValueError):
        out = []
        for st in glob.glob("/proc/[0-9]*/stat"):
            try:
                fields = Path(st).read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(st.split("/")[2]))
            except (OSError, ValueError, IndexError):
                continue
        return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "rootfs"
    suite = argv[1] if len(argv) > 1 else "bookworm"
    if cmd == "rootfs":
        t = time.monotonic()
        print(rootfs(suite), f"({time.monotonic() - t:.1f}s)")
    elif cmd == "shell":
        with Container(suite, kernels=kernel_headers()) as c:
            print(f"container {c.name} pid {c.pid} root {c.root}; exit the shell to power off", file=sys.stderr)
            subprocess.run(["nsenter", "-t", str(c.pid), "-a", "-r", "-w", "/bin/bash", "-l"])
    elif cmd == "bench":
        rootfs(suite)
        for layer in ("overlay", "copy"):
            for _ in range(2):
                t = time.monotonic()
                with Container(suite, layer=layer) as c:
                    up = time.monotonic() - t
                    c.run(["true"])
                total = time.monotonic() - t
                print(f"{layer:8s} layer {c.timings['layer']:.2f}s  boot {c.timings['boot']:.2f}s  "
                      f"up {up:.2f}s  up+teardown {total:.2f}s")
    else:
        print(__doc__.split("Command line::")[1], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
