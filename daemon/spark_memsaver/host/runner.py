"""The one adapter every external command goes through: argv lists only, logged, time-limited."""

from __future__ import annotations

import contextlib
import os
import time

from spark_memsaver import logs
from spark_memsaver.errors import CommandFailed, CommandNotFound, CommandTimedOut

# subprocess, signal and logging are imported when a command runs: a status that runs none pays for none of them
log = logs.lazy("spark_memsaver.run")

# Where system tools live; the daemon's environment under systemd may have a minimal PATH.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# The Debian package of each program spark-memsaver runs: a missing one is named with it (status's program-missing
# finding, observe/programs.py, and every command's error).
PACKAGES = {"dkms": "dkms", "depmod": "kmod", "modprobe": "kmod", "modinfo": "kmod", "insmod": "kmod", "kmod": "kmod",
            "mokutil": "mokutil", "keyctl": "keyutils", "openssl": "openssl", "patch": "patch", "dpkg-deb": "dpkg",
            "dpkg-query": "dpkg", "dpkg": "dpkg", "apt-get": "apt", "apt-cache": "apt", "dmesg": "util-linux",
            "gcc": "gcc", "make": "make", "zstd": "zstd", "xz": "xz-utils", "tar": "tar", "nice": "coreutils",
            "update-initramfs": "initramfs-tools"}


def not_found(name: str) -> CommandNotFound:
    """The named error for a program that is not installed: its Debian package and the command that installs it."""
    pkg = PACKAGES.get(os.path.basename(name))
    if pkg is None:
        return CommandNotFound(f"'{name}' is not installed", remedy=f"Install the package that provides {name}.")
    return CommandNotFound(f"'{name}' is not installed (Debian package {pkg})",
                           remedy=f"Install it: 'sudo apt-get install {pkg}'.")


def search_path(env_path: str | None = None, root: bool | None = None) -> str:
    """The PATH commands are looked up in and run with: the caller's absolute entries and SYSTEM_PATH.

    Empty and relative entries are dropped: an empty one (``PATH`` unset gave ``":" + SYSTEM_PATH``) or ``.``
    means the current directory, so a root run from a user-writable directory (a cron job, a hook, ``env -i``)
    would execute that user's ``dpkg-deb`` or ``modinfo``. For root the system directories come first."""
    env_path = os.environ.get("PATH", "") if env_path is None else env_path
    root = (os.geteuid() == 0) if root is None else root
    own = [d for d in env_path.split(os.pathsep) if d.startswith("/")]
    system = SYSTEM_PATH.split(os.pathsep)
    out: list[str] = []
    for d in (system + own) if root else (own + system):
        if d not in out:
            out.append(d)
    return os.pathsep.join(out)


def _which(name: str, path: str | None) -> str | None:
    """shutil.which for an executable name (shutil itself pulls bz2/lzma into the idle daemon)."""
    if "/" in name:
        return name if os.access(name, os.X_OK) and not os.path.isdir(name) else None
    for d in (path if path is not None else search_path()).split(os.pathsep):
        if not d.startswith("/"):
            continue                # never the current directory, whatever PATH says
        cand = os.path.join(d, name)
        if os.access(cand, os.X_OK) and not os.path.isdir(cand):
            return cand
    return None


class _Record:
    """A plain record: keyword or positional fields, repr and equality by field. Not a dataclass: the daemon
    imports this module, and dataclasses brings inspect, ast and dis (about 1 MiB resident) with it."""

    __slots__ = ()
    _defaults: dict = {}

    def __init__(self, *args, **kw):
        names = self.__slots__
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}() takes at most {len(names)} fields")
        values = dict(self._defaults, **dict(zip(names, args)))
        for k, v in kw.items():
            if k not in names:
                raise TypeError(f"{type(self).__name__}() has no field {k!r}")
            values[k] = v
        for k in names:
            if k not in values:
                raise TypeError(f"{type(self).__name__}() missing field {k!r}")
            setattr(self, k, values[k])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    __hash__ = None   # mutable, as the dataclasses were


class Result(_Record):
    """What Runner.run returns: argv, returncode, stdout, stderr, seconds."""

    __slots__ = ("argv", "returncode", "stdout", "stderr", "seconds")

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def _run_group(argv, input, timeout, env, cwd, text):
    """subprocess.run in a new session; on timeout the WHOLE process group is killed, then reaped."""
    import signal
    import subprocess
    with subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd, text=text,
                          errors="replace" if text else None, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(argv, proc.poll(), out, err)


class Stream(_Record):
    """What Runner.stream yields: ``stdout`` to read; the rest is set when the block ends."""

    __slots__ = ("argv", "stdout", "returncode", "stderr", "seconds", "timed_out")
    _defaults = {"returncode": None, "stderr": "", "seconds": 0.0, "timed_out": False}


class Runner:
    """Runs commands. Subclass or replace to stand in for the host (tests, fixture roots)."""

    def __init__(self, env: dict[str, str] | None = None):
        self.env = env

    def which(self, name: str) -> str | None:
        return _which(name, search_path())

    @contextlib.contextmanager
    def stream(self, argv: list[str], *, timeout: float = 60.0, env: dict[str, str] | None = None):
        """Run ``argv`` with its stdout as a pipe the caller reads while it runs (binary), nothing held here:
        for output that may be large (``dpkg-deb --fsys-tarfile``). Yields a :class:`Stream`; its
        ``returncode`` and ``stderr`` (the last 4 KiB) are set once the block ends. Past ``timeout``, or when
        the block ends before the output does, the whole process group is killed (the reader sees EOF)."""
        import signal
        import subprocess
        import tempfile
        import threading
        argv = [str(a) for a in argv]
        exe = argv[0] if os.sep in argv[0] else self.which(argv[0])
        if exe is None:
            raise not_found(argv[0])
        full_env = dict(os.environ, **(self.env or {}), **(env or {}))
        full_env.setdefault("LC_ALL", "C.UTF-8")
        full_env["PATH"] = search_path(full_env.get("PATH", ""))
        t0 = time.monotonic()
        with tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen([exe] + argv[1:], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=err, env=full_env, start_new_session=True)
            except FileNotFoundError:
                raise not_found(argv[0]) from None

            def kill():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            timer = threading.Timer(timeout, kill)
            timer.daemon = True
            timer.start()
            out = Stream(argv, proc.stdout)
            try:
                yield out
            finally:
                timer.cancel()
                if proc.poll() is None:
                    kill()
                proc.stdout.close()
                out.returncode = proc.wait()
                err.seek(max(0, err.seek(0, os.SEEK_END) - 4096))
                out.stderr = err.read().decode(errors="replace")
                out.seconds = time.monotonic() - t0
                out.timed_out = out.seconds >= timeout
                log.debug("rc=%d %.3fs (streamed): %s", out.returncode, out.seconds, " ".join(argv))

    def run(self, argv: list[str], *, timeout: float = 60.0, input: str | bytes | None = None,
            check: bool = False, env: dict[str, str] | None = None, cwd: str | None = None,
            text: bool = True) -> Result:
        if isinstance(argv, str):  # defensive: no shell strings, ever
            raise TypeError("argv must be a list")
        argv = [str(a) for a in argv]
        exe = argv[0] if os.sep in argv[0] else self.which(argv[0])
        if exe is None:
            raise not_found(argv[0])
        full_env = dict(os.environ)
        full_env.setdefault("LC_ALL", "C.UTF-8")
        if self.env:
            full_env.update(self.env)
        if env:
            full_env.update(env)
        full_env["PATH"] = search_path(full_env.get("PATH", ""))
        import subprocess
        t0 = time.monotonic()
        try:
            p = _run_group([exe] + argv[1:], input, timeout, full_env, cwd, text)
        except subprocess.TimeoutExpired:
            log.warning("timed out after %.0fs: %s", timeout, " ".join(argv))
            raise CommandTimedOut(f"'{' '.join(argv)}' did not finish within {timeout:.0f} s",
                                  remedy="Check the system load and the command's logs, then retry.")
        except FileNotFoundError:
            raise not_found(argv[0])
        dt = time.monotonic() - t0
        log.debug("rc=%d %.3fs: %s", p.returncode, dt, " ".join(argv))
        res = Result(argv, p.returncode, p.stdout, p.stderr, dt)
        if check and p.returncode != 0:
            tail = (p.stderr or p.stdout or "").strip().splitlines()[-5:]
            raise CommandFailed(f"'{' '.join(argv)}' failed with exit code {p.returncode}: " + " | ".join(tail),
                                returncode=p.returncode)
        return res
