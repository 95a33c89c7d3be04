"""EFI variable formats, parsed strictly: efivarfs files and EFI_SIGNATURE_LISTs (the X.509 part is x509.py).

Pure functions over bytes; no file I/O here except :func:`read_efivarfs_file`, which only bounds a read.

* efivarfs file (``/sys/firmware/efi/efivars/<Name>-<guid>``): 4 bytes of attributes (u32, little-endian)
  followed by the variable's data (Documentation/filesystems/efivarfs.rst).
* ``EFI_SIGNATURE_LIST`` (UEFI spec 32.4.1): ``SignatureType`` (16-byte GUID) · ``SignatureListSize`` u32 ·
  ``SignatureHeaderSize`` u32 · ``SignatureSize`` u32 · header · entries of ``SignatureOwner`` GUID + data.
  A variable such as ``db`` or ``MokListRT`` is a concatenation of such lists.
* GUIDs on disk are in the UEFI "mixed-endian" layout: the first three fields little-endian, the last eight
  bytes as written (Python's ``uuid.UUID(bytes_le=...)``).

Every malformation raises a subclass of :class:`EfiFormatError` whose message names the variable, the byte
offset and what was expected; nothing here raises anything else on any input.
"""

from __future__ import annotations

import struct
from spark_memsaver.record import Record, field

from spark_memsaver.errors import MemsaverError
from spark_memsaver.efi.der import DerError, tlv_header

# --- GUIDs -----------------------------------------------------------------------------------------

EFI_GLOBAL_VARIABLE = "8be4df61-93ca-11d2-aa0d-00e098032b8c"      # SecureBoot, SetupMode, PK, KEK
SHIM_LOCK_GUID = "605dab50-e046-4300-abb6-3dd810dd8b23"           # MokListRT, MokNew, ... (shim)
EFI_IMAGE_SECURITY_DATABASE = "d719b2cb-3d3a-4596-a3bc-dad00e67656f"  # db, dbx

EFI_CERT_X509 = "a5c059a1-94e4-4aa7-87b5-ab155c2bf072"
EFI_CERT_SHA256 = "c1c41626-504c-4092-aca9-41f936934328"
EFI_CERT_SHA1 = "826ca512-cf10-4ac9-b187-be01496631bd"
EFI_CERT_SHA224 = "0b6e5233-a65c-44c9-9407-d9ab83bfc8bd"
EFI_CERT_SHA384 = "ff3e5307-9fd0-48c9-85f1-8ad56c701e01"
EFI_CERT_SHA512 = "093e0fae-a6c4-4f50-9f1b-d41e2b89c19a"
EFI_CERT_RSA2048 = "3c5766e8-269c-4e34-aa14-ed776e85b3b6"
EFI_CERT_X509_SHA256 = "3bd2a492-96c0-4079-b420-fcf98ef103ed"     # hash of TBSCertificate + EFI_TIME
EFI_CERT_X509_SHA384 = "7076876e-80c2-4ee6-aad2-28b349a6865b"
EFI_CERT_X509_SHA512 = "446dbf63-2502-4cda-bcfa-2465d2b0fe9d"

SIGNATURE_TYPE_NAMES = {
    EFI_CERT_X509: "x509", EFI_CERT_SHA256: "sha256", EFI_CERT_SHA1: "sha1", EFI_CERT_SHA224: "sha224",
    EFI_CERT_SHA384: "sha384", EFI_CERT_SHA512: "sha512", EFI_CERT_RSA2048: "rsa2048",
    EFI_CERT_X509_SHA256: "x509-sha256", EFI_CERT_X509_SHA384: "x509-sha384", EFI_CERT_X509_SHA512: "x509-sha512",
}
# Data bytes per entry (after the 16-byte owner) for the fixed-size types.
_FIXED_DATA_SIZE = {
    EFI_CERT_SHA256: 32, EFI_CERT_SHA1: 20, EFI_CERT_SHA224: 28, EFI_CERT_SHA384: 48, EFI_CERT_SHA512: 64,
    EFI_CERT_RSA2048: 256, EFI_CERT_X509_SHA256: 32 + 16, EFI_CERT_X509_SHA384: 48 + 16,
    EFI_CERT_X509_SHA512: 64 + 16,
}

# Variable attributes (UEFI spec 8.2, SetVariable).
ATTR_NON_VOLATILE = 0x1
ATTR_BOOTSERVICE_ACCESS = 0x2
ATTR_RUNTIME_ACCESS = 0x4
ATTR_HARDWARE_ERROR_RECORD = 0x8
ATTR_AUTHENTICATED_WRITE_ACCESS = 0x10
ATTR_TIME_BASED_AUTHENTICATED_WRITE_ACCESS = 0x20
ATTR_APPEND_WRITE = 0x40
ATTR_ENHANCED_AUTHENTICATED_ACCESS = 0x80
_ATTR_KNOWN = 0xFF

# Bounds. Firmware limits one variable to tens of KiB (shim splits MokListRT for that reason); a dbx with
# thousands of hashes is ~30 KiB. Anything past 1 MiB is not a real variable.
MAX_VARIABLE_SIZE = 1 << 20
ESL_HEADER_SIZE = 28
GUID_SIZE = 16


def guid_to_bytes(guid: str) -> bytes:
    """Text GUID -> its 16 bytes as stored on disk (mixed-endian)."""
    import uuid   # here, not at import: uuid loads platform (status reads no GUID on most nodes)

    return uuid.UUID(guid).bytes_le


def guid_from_bytes(b: bytes) -> str:
    """16 on-disk bytes -> text GUID (lower case)."""
    import uuid

    return str(uuid.UUID(bytes_le=bytes(b)))


def efivarfs_name(name: str, guid: str) -> str:
    return f"{name}-{guid}"


# --- errors ----------------------------------------------------------------------------------------

class EfiFormatError(MemsaverError):
    """An EFI variable (or a certificate) is not in the format the specification requires."""

    code = "efi-variable-malformed"
    remedy = ("The firmware or shim wrote a variable spark-memsaver cannot read safely; the Secure Boot state is "
              "reported as unknown. Compare with 'mokutil --list-enrolled' and report the variable's bytes.")

    def __init__(self, what: str, reason: str, offset: int | None = None):
        where = f" at byte {offset}" if offset is not None else ""
        super().__init__(f"{what}: {reason}{where}", what=what, reason=reason, offset=offset)
        self.what, self.reason, self.offset = what, reason, offset


class TruncatedVariable(EfiFormatError):
    code = "efi-variable-truncated"


class OversizedVariable(EfiFormatError):
    code = "efi-variable-oversized"


class MalformedSignatureList(EfiFormatError):
    code = "efi-signature-list-malformed"


class MalformedCertificate(EfiFormatError):
    code = "certificate-malformed"
    remedy = "Give a DER or PEM X.509 certificate (e.g. 'openssl x509 -in CERT -noout -text' must accept it)."


# --- efivarfs files --------------------------------------------------------------------------------

class EfiVariable(Record, frozen=True):
    name: str
    attributes: int
    data: bytes

    @property
    def volatile(self) -> bool:
        return not (self.attributes & ATTR_NON_VOLATILE)

    def attribute_names(self) -> list[str]:
        names = ((ATTR_NON_VOLATILE, "NV"), (ATTR_BOOTSERVICE_ACCESS, "BS"), (ATTR_RUNTIME_ACCESS, "RT"),
                 (ATTR_HARDWARE_ERROR_RECORD, "HR"), (ATTR_AUTHENTICATED_WRITE_ACCESS, "AW"),
                 (ATTR_TIME_BASED_AUTHENTICATED_WRITE_ACCESS, "AT"), (ATTR_APPEND_WRITE, "AP"),
                 (ATTR_ENHANCED_AUTHENTICATED_ACCESS, "EA"))
        return [n for bit, n in names if self.attributes & bit]


def parse_efivarfs(raw: bytes, name: str = "variable") -> EfiVariable:
    """Split an efivarfs file into attributes and data, checking the attributes are possible."""
    if len(raw) > MAX_VARIABLE_SIZE + 4:
        raise OversizedVariable(name, f"{len(raw)} bytes, more than the {MAX_VARIABLE_SIZE}-byte limit")
    if len(raw) < 4:
        raise TruncatedVariable(name, f"{len(raw)} bytes, shorter than the 4 attribute bytes every efivarfs "
                                      "file starts with")
    (attrs,) = struct.unpack_from("<I", raw, 0)
    if attrs & ~_ATTR_KNOWN:
        raise EfiFormatError(name, f"attribute word 0x{attrs:08x} has undefined bits set", 0)
    if not attrs & ATTR_RUNTIME_ACCESS:
        raise EfiFormatError(name, f"attribute word 0x{attrs:08x} lacks RUNTIME_ACCESS, which every variable "
                                   "visible in efivarfs has", 0)
    if not attrs & ATTR_BOOTSERVICE_ACCESS:
        raise EfiFormatError(name, f"attribute word 0x{attrs:08x} has RUNTIME_ACCESS without "
                                   "BOOTSERVICE_ACCESS, which UEFI forbids", 0)
    return EfiVariable(name, attrs, bytes(raw[4:]))


def encode_efivarfs(attributes: int, data: bytes) -> bytes:
    return struct.pack("<I", attributes) + bytes(data)


def read_efivarfs_file(path, name: str | None = None) -> bytes:
    """Read at most MAX_VARIABLE_SIZE + 5 bytes (so an oversized file is detected, never slurped whole).

    OSError propagates (FileNotFoundError = the variable does not exist)."""
    with open(path, "rb") as f:
        raw = f.read(MAX_VARIABLE_SIZE + 5)
    if len(raw) > MAX_VARIABLE_SIZE + 4:
        raise OversizedVariable(name or str(path), f"more than {MAX_VARIABLE_SIZE} bytes of data")
    return raw


def parse_uint_flag(var: EfiVariable) -> int:
    """A scalar variable (SecureBoot, SetupMode, MokSBStateRT): 1 byte per UEFI; mokutil also accepts 2 or 4.

    Returns 0 or 1; any other value or size is malformed."""
    n = len(var.data)
    if n == 0:
        raise TruncatedVariable(var.name, "no data byte after the attributes (expected 1)", 4)
    if n not in (1, 2, 4):
        raise OversizedVariable(var.name, f"{n} data bytes; expected 1 (or 2/4, which mokutil tolerates)", 4)
    value = int.from_bytes(var.data, "little")
    if value not in (0, 1):
        raise EfiFormatError(var.name, f"value {value} is neither 0 nor 1", 4)
    return value


# --- EFI_SIGNATURE_LIST ----------------------------------------------------------------------------

class SignatureEntry(Record, frozen=True):
    owner: str
    data: bytes


class SignatureList(Record, frozen=True):
    type_guid: str
    header: bytes
    signature_size: int
    entries: tuple[SignatureEntry, ...]
    offset: int

    @property
    def type_name(self) -> str:
        return SIGNATURE_TYPE_NAMES.get(self.type_guid, "unknown:" + self.type_guid)


def parse_signature_lists(data: bytes, name: str = "variable", base_offset: int = 0) -> list[SignatureList]:
    """Parse a concatenation of EFI_SIGNATURE_LISTs; the whole buffer must be consumed exactly.

    ``base_offset`` is added to offsets in error messages (4 when ``data`` follows efivarfs attributes).
    Unknown signature types are kept with opaque entries (UEFI allows vendor types; mokutil skips them)."""
    data = bytes(data)
    if len(data) > MAX_VARIABLE_SIZE:
        raise OversizedVariable(name, f"{len(data)} bytes of signature lists, more than {MAX_VARIABLE_SIZE}")
    out: list[SignatureList] = []
    pos = 0
    n = len(data)
    while pos < n:
        at = base_offset + pos
        left = n - pos
        if left < ESL_HEADER_SIZE:
            raise TruncatedVariable(name, f"{left} bytes left, too few for a 28-byte EFI_SIGNATURE_LIST header", at)
        type_guid = guid_from_bytes(data[pos:pos + 16])
        list_size, header_size, sig_size = struct.unpack_from("<III", data, pos + 16)
        if list_size < ESL_HEADER_SIZE:
            raise MalformedSignatureList(name, f"SignatureListSize {list_size} is smaller than the 28-byte header",
                                         at)
        if list_size > left:
            raise TruncatedVariable(name, f"SignatureListSize {list_size} runs past the end of the data "
                                          f"({left} bytes left)", at)
        body = list_size - ESL_HEADER_SIZE
        if header_size > body:
            raise MalformedSignatureList(name, f"SignatureHeaderSize {header_size} exceeds the list body "
                                               f"({body} bytes)", at)
        if sig_size < GUID_SIZE + 1:
            raise MalformedSignatureList(name, f"SignatureSize {sig_size} cannot hold a 16-byte owner GUID "
                                               "and data", at)
        fixed = _FIXED_DATA_SIZE.get(type_guid)
        tname = SIGNATURE_TYPE_NAMES.get(type_guid, type_guid)
        if fixed is not None and sig_size != GUID_SIZE + fixed:
            raise MalformedSignatureList(name, f"{tname} list has SignatureSize {sig_size}, expected "
                                               f"{GUID_SIZE + fixed}", at)
        entries_len = body - header_size
        if entries_len == 0:
            raise MalformedSignatureList(name, "signature list holds no entries", at)
        if entries_len % sig_size:
            raise MalformedSignatureList(name, f"{entries_len} bytes of entries is not a multiple of "
                                               f"SignatureSize {sig_size}", at)
        if type_guid == EFI_CERT_X509 and header_size != 0:
            raise MalformedSignatureList(name, f"x509 list has SignatureHeaderSize {header_size}, expected 0", at)
        header = data[pos + ESL_HEADER_SIZE:pos + ESL_HEADER_SIZE + header_size]
        entries = []
        e = pos + ESL_HEADER_SIZE + header_size
        end = pos + list_size
        while e < end:
            owner = guid_from_bytes(data[e:e + GUID_SIZE])
            payload = data[e + GUID_SIZE:e + sig_size]
            if type_guid == EFI_CERT_X509:
                der_length_check(payload, name, base_offset + e + GUID_SIZE)
            entries.append(SignatureEntry(owner, payload))
            e += sig_size
        out.append(SignatureList(type_guid, header, sig_size, tuple(entries), at))
        pos = end
    return out


def encode_signature_list(type_guid: str, entries: list[tuple[str, bytes]], header: bytes = b"") -> bytes:
    """Build one EFI_SIGNATURE_LIST (all entries must have the same size)."""
    sizes = {len(d) for _, d in entries}
    if len(sizes) != 1:
        raise ValueError("all entries of one signature list must have the same size")
    sig_size = GUID_SIZE + sizes.pop()
    body = b"".join(guid_to_bytes(o) + d for o, d in entries)
    total = ESL_HEADER_SIZE + len(header) + len(body)
    return guid_to_bytes(type_guid) + struct.pack("<III", total, len(header), sig_size) + header + body


def summarize(lists: list[SignatureList]) -> dict:
    counts: dict[str, int] = {}
    for sl in lists:
        counts[sl.type_name] = counts.get(sl.type_name, 0) + len(sl.entries)
    return {"lists": len(lists), "entries": counts}


def der_length_check(der: bytes, name: str, offset: int) -> None:
    """An X.509 entry must be exactly one DER SEQUENCE (the certificate), nothing before or after."""
    try:
        tag, hdr, length = tlv_header(der, 0)
    except DerError as e:
        raise MalformedSignatureList(name, f"x509 entry is not DER: {e}", offset)
    if tag != 0x30:
        raise MalformedSignatureList(name, f"x509 entry starts with tag 0x{tag:02x}, not a DER SEQUENCE", offset)
    if hdr + length != len(der):
        raise MalformedSignatureList(name, f"x509 entry holds {len(der)} bytes but its DER encoding is "
                                           f"{hdr + length} bytes", offset)
