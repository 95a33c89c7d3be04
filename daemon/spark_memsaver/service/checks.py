"""Checks of what a D-Bus caller sends: options, kernel releases, driver versions, free text, the MOK password,
and the certificate file of RequestEnrollment. Pure except :func:`read_cert` (one bounded, non-blocking read).

Every pattern is a full match (``re.fullmatch``): ``$`` also matches before a trailing newline, which let
``'6.14.0-1015-nvidia-64k\\n'`` through as a kernel release (issue 12 defect 7). Free text (a rollback reason)
refuses control and format characters (Unicode categories Cc and Cf: newlines, escapes, the bidi overrides
U+202A-U+202E and isolates U+2066-U+2069), so it cannot forge log lines or reorder what an admin reads.
"""

from __future__ import annotations

import os
import re
import stat

from spark_memsaver import versions
from spark_memsaver.errors import InvalidArgument  # noqa: F401  (re-exported: D-Bus's Error.InvalidArgument)

KERNEL_RE = versions.KERNEL_RE      # the one kernel-release check, shared with every CLI --kernel
DRIVER_RE = versions.DRIVER_RE      # the one driver-version shape
REASON_MAX = 200
CERT_MAX_BYTES = 1 << 20          # a DER or PEM certificate is a few KiB; mok reads at most 1 MiB too
PASSWORD_MAX = 256


def bad_chars(text: str) -> list[str]:
    """The control/format characters in ``text`` as U+XXXX names (empty when clean)."""
    import unicodedata   # at first use: the idle daemon does not carry it

    return [f"U+{ord(c):04X}" for c in text if unicodedata.category(c) in ("Cc", "Cf")]


def kernel(v: str) -> str:
    return versions.release(v)


def driver(v: str) -> str:
    if not DRIVER_RE.fullmatch(v):
        raise InvalidArgument(f"'driver_version' is not an NVIDIA driver version: {v!r}",
                              remedy="Give a version such as 580.142 or 550.163.01.")
    return v


def reason(v: str) -> str:
    bad = bad_chars(v)
    if bad:
        raise InvalidArgument(f"'reason' contains control or bidi characters ({', '.join(sorted(set(bad))[:8])})",
                              remedy="Give the reason as plain text on one line.")
    if not v.strip() or len(v) > REASON_MAX:
        raise InvalidArgument(f"'reason' must be 1-{REASON_MAX} printable characters")
    return v


def cert(v: str) -> str:
    if not v.startswith("/") or len(v) > 4096 or bad_chars(v):
        raise InvalidArgument(f"'cert' must be an absolute path without control characters: {v!r}")
    return v


# method -> option name -> (python type, checker, kwarg name)
OPTIONS = {
    "Build": {"kernel": (str, kernel, "kernel"), "all_kernels": (bool, None, "all_kernels"),
              "driver_version": (str, driver, "driver_version")},
    "Install": {"kernel": (str, kernel, "kernel"), "all_kernels": (bool, None, "all_kernels")},
    "Remove": {"kernel": (str, kernel, "kernel"), "all_kernels": (bool, None, "all_kernels")},
    "Activate": {},
    "Rollback": {"reason": (str, reason, "reason")},
    "RequestEnrollment": {"cert": (str, cert, "cert"), "wait_at_console": (bool, None, "wait_at_console")},
    "Refresh": {},
    "PrepareLaunch": {},
}
_TYPE_NAMES = {str: "a string (s)", bool: "a boolean (b)"}


def check_options(method: str, options) -> dict:
    """a{sv} options -> keyword arguments, or InvalidArgument naming the bad key."""
    spec = OPTIONS[method]
    if not isinstance(options, dict):
        raise InvalidArgument(f"{method}: options must be a dictionary (a{{sv}})")
    kwargs = {}
    for key, value in options.items():
        if key not in spec:
            known = ", ".join(sorted(spec)) or "none"
            raise InvalidArgument(f"{method}: unknown option {key!r} (known options: {known})")
        typ, check, kw = spec[key]
        if type(value) is not typ:
            raise InvalidArgument(f"{method}: option '{key}' must be {_TYPE_NAMES[typ]}, "
                                  f"got {type(value).__name__}")
        kwargs[kw] = check(value) if check else value
    if kwargs.get("all_kernels") and "kernel" in kwargs:
        raise InvalidArgument(f"{method}: give either 'kernel' or 'all_kernels', not both")
    return kwargs


def check_password(password) -> str:
    if not isinstance(password, str) or not password:
        raise InvalidArgument("RequestEnrollment: the one-time MOK password must not be empty",
                              remedy="Choose a password to type at the MOK manager on the next boot.")
    if len(password) > PASSWORD_MAX or bad_chars(password):
        raise InvalidArgument(f"RequestEnrollment: the password must be at most {PASSWORD_MAX} characters on "
                              "one line, without control characters")
    return password


class CertUnreadable(InvalidArgument):
    code = "cert-unreadable"
    remedy = "Give the path of a regular certificate file (DER or PEM, at most 1 MiB), not a link, FIFO or device."


def read_cert(path: str) -> bytes:
    """The bytes of the certificate file at ``path``, read without ever blocking (issue 12 defect 11): opened
    O_NONBLOCK|O_NOFOLLOW, checked with fstat on the open descriptor (regular file, at most CERT_MAX_BYTES),
    so a FIFO, a device or a link planted at the path is refused at once and cannot wedge the job slot."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        why = "it is a symbolic link" if e.errno == 40 else (e.strerror or str(e))
        raise CertUnreadable(f"cannot open the certificate {path!r}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CertUnreadable(f"the certificate {path!r} is not a regular file")
        if st.st_size > CERT_MAX_BYTES:
            raise CertUnreadable(f"the certificate {path!r} is {st.st_size} bytes (at most {CERT_MAX_BYTES})")
        data = os.read(fd, CERT_MAX_BYTES + 1)
        if len(data) > CERT_MAX_BYTES:
            raise CertUnreadable(f"the certificate {path!r} grew past {CERT_MAX_BYTES} bytes while read")
        return data
    finally:
        os.close(fd)
