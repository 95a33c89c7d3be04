"""Small file-system helpers shared by every module that writes state (stdlib only)."""

from __future__ import annotations

import contextlib
import os
import tempfile


def fsync_dir(d: str) -> None:
    """Make a rename or unlink in ``d`` durable (best effort: some file systems refuse)."""
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path, data: bytes | str, mode: int = 0o644, durable: bool = True) -> None:
    """Replace ``path`` atomically: a temporary file beside it, (fsync,) rename over the target, (fsync
    of the directory). A reader sees the old or the new content, never a mix; a crash leaves at most a
    stray ``.name.*.tmp`` file. ``durable=False`` skips the fsyncs (for data that is rewritten anyway)."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, mode=0o755, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(d)
