"""A host seen through a root prefix (``--root``): a live system, a mounted image or a test fixture."""

from __future__ import annotations

import os

from spark_memsaver.host.runner import Runner

_MAX_LINKS = 40


class Host:
    """Paths are resolved as strings (:meth:`fspath`); :meth:`path` and :attr:`root` give ``pathlib.Path``
    objects, imported at first use: the idle daemon reads its files through :meth:`fspath` and the read
    helpers and so never loads pathlib (with urllib.parse and ipaddress, about 0.6 MiB resident)."""

    def __init__(self, root: str | os.PathLike = "/", runner: Runner | None = None):
        self._root = os.path.realpath(root) if str(root) != "/" else "/"
        self.runner = runner or Runner()

    @property
    def root(self):
        from pathlib import Path
        return Path(self._root)

    @property
    def is_live(self) -> bool:
        """True when inspecting the running system itself (root prefix '/')."""
        return self._root == "/"

    def path(self, p: str | os.PathLike, follow: bool = True):
        """:meth:`fspath` as a ``pathlib.Path``."""
        from pathlib import Path
        return Path(self.fspath(p, follow))

    def fspath(self, p: str | os.PathLike, follow: bool = True) -> str:
        """Map an absolute host path into the root prefix, resolving symlinks *inside* the root.

        An absolute link target such as ``/usr/src/linux-headers-X`` is taken relative to the root,
        as chroot(2) would, so fixture roots and mounted images never leak into the real system.
        ``follow=False`` leaves a final symlink unresolved (to readlink it).
        """
        p = str(p)
        if self.is_live:
            return p
        if not follow:
            head, _, tail = p.rstrip("/").rpartition("/")
            base = self.fspath(head or "/")
            return os.path.join(base, tail) if tail else base
        parts = [x for x in p.split("/") if x not in ("", ".")]
        resolved: list[str] = []
        links = 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            candidate = os.path.join(self._root, *resolved, part)
            if os.path.islink(candidate):
                links += 1
                if links > _MAX_LINKS:
                    return candidate  # a loop: let the caller's open() fail with ELOOP-like error
                target = os.readlink(candidate)
                if target.startswith("/"):
                    resolved = []
                parts = [x for x in target.split("/") if x not in ("", ".")] + parts
                continue
            resolved.append(part)
        return os.path.join(self._root, *resolved)

    def read_text(self, p: str, default: str | None = None) -> str | None:
        try:
            with open(self.fspath(p), errors="replace") as f:
                return f.read()
        except (OSError, UnicodeError):
            return default

    def read_bytes(self, p: str) -> bytes | None:
        try:
            with open(self.fspath(p), "rb") as f:
                return f.read()
        except OSError:
            return None

    def exists(self, p: str) -> bool:
        return os.path.exists(self.fspath(p))

    def listdir(self, p: str) -> list[str]:
        try:
            return sorted(os.listdir(self.fspath(p)))
        except OSError:
            return []

    def run(self, argv: list[str], **kw):
        return self.runner.run(argv, **kw)
