"""SHA-256 from CPython's built-in implementation (``_sha256`` in 3.11, ``_sha2`` in 3.12), hashlib's where
neither exists: importing hashlib loads OpenSSL's libcrypto (about 11 M instructions and its pages) for the
few digests a status computes (the DKMS signing certificate, a driver tree's hooked files). The digests are
hashlib's (tests/test_speed.py)."""

from __future__ import annotations


try:
    from _sha256 import sha256 as _new
except ImportError:
    try:
        from _sha2 import sha256 as _new
    except ImportError:
        from hashlib import sha256 as _new


def sha256(data: bytes = b""):
    """A SHA-256 object (``update``, ``digest``, ``hexdigest``) fed ``data``."""
    return _new(data)
