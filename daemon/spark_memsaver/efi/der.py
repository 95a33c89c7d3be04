"""DER's tag-length-value header, strictly (single-byte tags, definite lengths of at most 4 bytes): the one
primitive that efi/x509.py (certificates) and efi/siglist.py (an X.509 entry's bounds) share, so
neither imports the other's internals."""

from __future__ import annotations


class DerError(Exception):
    pass


def tlv_header(b: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, header length, content length) of the TLV at pos; single-byte tags only (all X.509 needs)."""
    if pos + 2 > len(b):
        raise DerError("truncated tag/length")
    tag = b[pos]
    if tag & 0x1F == 0x1F:
        raise DerError("multi-byte tag")
    first = b[pos + 1]
    if first < 0x80:
        length, hdr = first, 2
    else:
        k = first & 0x7F
        if k == 0:
            raise DerError("indefinite length (BER, not DER)")
        if k > 4:
            raise DerError(f"{k}-byte length field")
        if pos + 2 + k > len(b):
            raise DerError("truncated length")
        length = int.from_bytes(b[pos + 2:pos + 2 + k], "big")
        hdr = 2 + k
    if pos + hdr + length > len(b):
        raise DerError(f"element of {length} bytes runs past the end")
    return tag, hdr, length
