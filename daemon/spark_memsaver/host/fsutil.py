"""Small file-system helpers shared by every module that writes state (stdlib only)."""

from __future__ import annotations

import contextlib
import os


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


def _token() -> str:
    """A random temp-name part (os.urandom: the secrets module would pull hashlib/OpenSSL into the daemon)."""
    return os.urandom(6).hex()


def atomic_write(path, data: bytes | str, mode: int = 0o644, durable: bool = True) -> None:
    """Replace ``path`` atomically: a new unique temp file beside it (O_CREAT|O_EXCL|O_NOFOLLOW), fchmod on
    the open fd (never a path), fsync, rename over the target, fsync of the directory. A reader sees the old
    or the new content; a crash leaves at most a stray ``.name.*.tmp``."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, mode=0o755, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = os.path.join(d, f".{os.path.basename(path)}.{_token()}.tmp")
        try:
            fd = os.open(tmp, flags, 0o600)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary name beside {path}")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(d)


def trusted_copy(path: str) -> bool:
    """A kept copy (a file and its directory) written by root or by us and not writable by others: only then is
    it believed (yamlio's parsed data files, observe/modcache's kmod answers)."""
    try:
        for p in (path, os.path.dirname(path)):
            st = os.stat(p)
            if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
                return False
        return True
    except OSError:
        return False


def sha256_file(path) -> str | None:
    """Hex SHA-256 of a file, read in 1 MiB chunks; None when it cannot be read."""
    from spark_memsaver.digest import sha256   # CPython's own: hashlib would load libcrypto

    try:
        h = sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None


def _not_json(token: str):
    raise ValueError(f"{token} is not JSON")


def _finite(text: str) -> float:
    import math
    v = float(text)
    if not math.isfinite(v):            # 1e400 reads as inf
        raise ValueError(f"{text} is out of range")
    return v


def loads_strict(text: str | bytes):
    """json.loads of one line, refusing NaN, Infinity and numbers that overflow to them (RFC 8259 has none):
    what the history and event readers accept. ValueError (or RecursionError, deep nesting) otherwise."""
    import json
    return json.loads(text, parse_constant=_not_json, parse_float=_finite)
