"""A host seen through a root prefix (``--root``): a live system, a mounted image or a test fixture."""

from __future__ import annotations

import os
from pathlib import Path

from spark_memsaver.host.runner import Runner

_MAX_LINKS = 40


class Host:
    def __init__(self, root: str | os.PathLike = "/", runner: Runner | None = None):
        self.root = Path(root).resolve() if str(root) != "/" else Path("/")
        self.runner = runner or Runner()

    @property
    def is_live(self) -> bool:
        """True when inspecting the running system itself (root prefix '/')."""
        return self.root == Path("/")

    def path(self, p: str | os.PathLike, follow: bool = True) -> Path:
        """Map an absolute host path into the root prefix, resolving symlinks *inside* the root.

        An absolute link target such as ``/usr/src/linux-headers-X`` is taken relative to the root,
        as chroot(2) would, so fixture roots and mounted images never leak into the real system.
        ``follow=False`` leaves a final symlink unresolved (to readlink it).
        """
        p = str(p)
        if self.is_live:
            return Path(p)
        if not follow:
            head, _, tail = p.rstrip("/").rpartition("/")
            return self.path(head or "/") / tail
        parts = [x for x in p.split("/") if x not in ("", ".")]
        resolved: list[str] = []
        links = 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            candidate = self.root.joinpath(*resolved, part)
            if candidate.is_symlink():
                links += 1
                if links > _MAX_LINKS:
                    return candidate  # a loop: let the caller's open() fail with ELOOP-like error
                target = os.readlink(candidate)
                if target.startswith("/"):
                    resolved = []
                parts = [x for x in target.split("/") if x not in ("", ".")] + parts
                continue
            resolved.append(part)
        return self.root.joinpath(*resolved)

    def read_text(self, p: str, default: str | None = None) -> str | None:
        try:
            return self.path(p).read_text(errors="replace")
        except (OSError, UnicodeError):
            return default

    def read_bytes(self, p: str) -> bytes | None:
        try:
            return self.path(p).read_bytes()
        except OSError:
            return None

    def exists(self, p: str) -> bool:
        return self.path(p).exists()

    def listdir(self, p: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(p)))
        except OSError:
            return []

    def run(self, argv: list[str], **kw):
        return self.runner.run(argv, **kw)
