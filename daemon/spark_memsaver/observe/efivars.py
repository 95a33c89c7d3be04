"""EFI variable formats, parsed strictly: efivarfs files, EFI_SIGNATURE_LISTs, and the X.509 fields we report.

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

import datetime as _dt
import hashlib
import struct
import uuid
from dataclasses import dataclass, field

from spark_memsaver.errors import MemsaverError

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
    return uuid.UUID(guid).bytes_le


def guid_from_bytes(b: bytes) -> str:
    """16 on-disk bytes -> text GUID (lower case)."""
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

@dataclass(frozen=True)
class EfiVariable:
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

@dataclass(frozen=True)
class SignatureEntry:
    owner: str
    data: bytes


@dataclass(frozen=True)
class SignatureList:
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


def der_length_check(der: bytes, name: str, offset: int) -> None:
    """An X.509 entry must be exactly one DER SEQUENCE (the certificate), nothing before or after."""
    try:
        tag, hdr, length = _tlv_header(der, 0)
    except _DerError as e:
        raise MalformedSignatureList(name, f"x509 entry is not DER: {e}", offset)
    if tag != 0x30:
        raise MalformedSignatureList(name, f"x509 entry starts with tag 0x{tag:02x}, not a DER SEQUENCE", offset)
    if hdr + length != len(der):
        raise MalformedSignatureList(name, f"x509 entry holds {len(der)} bytes but its DER encoding is "
                                           f"{hdr + length} bytes", offset)


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


# --- minimal DER / X.509 ---------------------------------------------------------------------------

class _DerError(Exception):
    pass


def _tlv_header(b: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, header length, content length) of the TLV at pos; single-byte tags only (all X.509 needs)."""
    if pos + 2 > len(b):
        raise _DerError("truncated tag/length")
    tag = b[pos]
    if tag & 0x1F == 0x1F:
        raise _DerError("multi-byte tag")
    first = b[pos + 1]
    if first < 0x80:
        length, hdr = first, 2
    else:
        k = first & 0x7F
        if k == 0:
            raise _DerError("indefinite length (BER, not DER)")
        if k > 4:
            raise _DerError(f"{k}-byte length field")
        if pos + 2 + k > len(b):
            raise _DerError("truncated length")
        length = int.from_bytes(b[pos + 2:pos + 2 + k], "big")
        hdr = 2 + k
    if pos + hdr + length > len(b):
        raise _DerError(f"element of {length} bytes runs past the end")
    return tag, hdr, length


def _children(b: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    """(tag, content start, content end) of each element in b[start:end]."""
    out = []
    pos = start
    while pos < end:
        tag, hdr, length = _tlv_header(b, pos)
        if pos + hdr + length > end:
            raise _DerError("element runs past its parent")
        out.append((tag, pos + hdr, pos + hdr + length))
        pos += hdr + length
    return out


def _oid(b: bytes) -> str:
    if not b:
        raise _DerError("empty OID")
    parts = [b[0] // 40, b[0] % 40] if b[0] < 80 else [2, b[0] - 80]
    v = 0
    for x in b[1:]:
        v = (v << 7) | (x & 0x7F)
        if not x & 0x80:
            parts.append(v)
            v = 0
    return ".".join(map(str, parts))


_NAME_OIDS = {"2.5.4.3": "CN", "2.5.4.10": "O", "2.5.4.11": "OU", "2.5.4.6": "C", "2.5.4.7": "L",
              "2.5.4.8": "ST", "1.2.840.113549.1.9.1": "emailAddress"}


def _name(b: bytes, start: int, end: int) -> list[tuple[str, str]]:
    out = []
    for tag, s, e in _children(b, start, end):          # SET of AttributeTypeAndValue
        if tag != 0x31:
            raise _DerError("Name is not a SEQUENCE of SETs")
        for tag2, s2, e2 in _children(b, s, e):
            kids = _children(b, s2, e2)
            if tag2 != 0x30 or len(kids) != 2 or kids[0][0] != 0x06:
                raise _DerError("malformed AttributeTypeAndValue")
            oid = _oid(b[kids[0][1]:kids[0][2]])
            raw = b[kids[1][1]:kids[1][2]]
            if kids[1][0] == 0x1E:  # BMPString
                val = raw.decode("utf-16-be", errors="replace")
            else:
                val = raw.decode("utf-8", errors="replace")
            out.append((_NAME_OIDS.get(oid, oid), val))
    return out


def _time(b: bytes, tag: int, s: int, e: int) -> str:
    t = b[s:e].decode("ascii", errors="replace")
    try:
        if tag == 0x17:  # UTCTime YYMMDDHHMMSSZ
            d = _dt.datetime.strptime(t, "%y%m%d%H%M%SZ")
            if d.year >= 2050:
                d = d.replace(year=d.year - 100)
        elif tag == 0x18:
            d = _dt.datetime.strptime(t, "%Y%m%d%H%M%SZ")
        else:
            raise _DerError(f"validity time has tag 0x{tag:02x}")
    except ValueError:
        raise _DerError(f"unparseable validity time {t!r}")
    return d.replace(tzinfo=_dt.timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Certificate:
    der: bytes
    subject: list = field(default_factory=list)
    issuer: list = field(default_factory=list)
    serial: bytes = b""
    not_before: str = ""
    not_after: str = ""
    skid: bytes | None = None
    tbs_sha256: bytes = b""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.der).hexdigest()

    @property
    def sha1(self) -> str:
        return hashlib.sha1(self.der).hexdigest()

    @staticmethod
    def _fmt(rdns) -> str:
        return ", ".join(f"{k}={v}" for k, v in rdns)

    @property
    def subject_text(self) -> str:
        return self._fmt(self.subject)

    @property
    def issuer_text(self) -> str:
        return self._fmt(self.issuer)

    def _get(self, rdns, key):
        for k, v in rdns:
            if k == key:
                return v
        return None

    @property
    def kernel_key_description(self) -> str:
        """The description the kernel gives this certificate's key in /proc/keys and keyctl
        (x509_fabricate_name + ": " + SKID hex, or serial hex without an SKID)."""
        cn, o, email = (self._get(self.subject, "CN"), self._get(self.subject, "O"),
                        self._get(self.subject, "emailAddress"))
        if cn and o:
            cb, ob = cn.encode(), o.encode()
            if (len(cb) >= len(ob) and cb[:len(ob)] == ob) or (len(cb) >= 7 and len(ob) >= 7 and cb[:7] == ob[:7]):
                name = cn
            else:
                name = f"{o}: {cn}"
        else:
            name = cn or o or email or ""
        tail = self.skid if self.skid is not None else self.serial
        return f"{name}: {tail.hex()}"


def parse_certificate(der: bytes, name: str = "certificate") -> Certificate:
    """The fields we report from a DER X.509 certificate; MalformedCertificate if it is not one."""
    der = bytes(der)
    try:
        tag, hdr, length = _tlv_header(der, 0)
        if tag != 0x30 or hdr + length != len(der):
            raise _DerError("not exactly one DER SEQUENCE")
        top = _children(der, hdr, hdr + length)
        if len(top) != 3 or top[0][0] != 0x30:
            raise _DerError("Certificate must be SEQUENCE { tbsCertificate, signatureAlgorithm, signature }")
        tbs_tag_start = hdr
        tbs_end = top[0][2]
        tbs = _children(der, top[0][1], tbs_end)
        i = 0
        if tbs and tbs[0][0] == 0xA0:
            i = 1
        if len(tbs) < i + 6:
            raise _DerError("tbsCertificate has too few fields")
        serial_t, validity_t, subject_t, issuer_t = tbs[i], tbs[i + 3], tbs[i + 4], tbs[i + 2]
        if serial_t[0] != 0x02 or issuer_t[0] != 0x30 or validity_t[0] != 0x30 or subject_t[0] != 0x30:
            raise _DerError("tbsCertificate fields have unexpected types")
        times = _children(der, validity_t[1], validity_t[2])
        if len(times) != 2:
            raise _DerError("validity must hold notBefore and notAfter")
        skid = None
        for tag2, s2, e2 in tbs[i + 6:]:
            if tag2 != 0xA3:
                continue
            (exts_tag, es, ee), = _children(der, s2, e2)
            for _t, xs, xe in _children(der, es, ee):
                parts = _children(der, xs, xe)
                if parts and parts[0][0] == 0x06 and _oid(der[parts[0][1]:parts[0][2]]) == "2.5.29.14":
                    octet = parts[-1]
                    inner = _children(der, octet[1], octet[2])
                    if len(inner) == 1 and inner[0][0] == 0x04:
                        skid = der[inner[0][1]:inner[0][2]]
        return Certificate(
            der=der,
            subject=_name(der, subject_t[1], subject_t[2]),
            issuer=_name(der, issuer_t[1], issuer_t[2]),
            serial=der[serial_t[1]:serial_t[2]],
            not_before=_time(der, *times[0]),
            not_after=_time(der, *times[1]),
            skid=skid,
            tbs_sha256=hashlib.sha256(der[tbs_tag_start:tbs_end]).digest(),
        )
    except (_DerError, ValueError, IndexError) as e:
        raise MalformedCertificate(name, f"not a valid DER X.509 certificate ({e})")


def load_certificate(raw: bytes, name: str = "certificate") -> tuple[Certificate, str]:
    """DER or PEM (the first CERTIFICATE block) -> (Certificate, "der"|"pem")."""
    import base64
    import binascii

    if raw.lstrip().startswith(b"-----BEGIN"):
        text = raw.decode("ascii", errors="replace")
        begin = text.find("-----BEGIN CERTIFICATE-----")
        end = text.find("-----END CERTIFICATE-----", begin + 1)
        if begin < 0 or end < 0:
            raise MalformedCertificate(name, "PEM file without a complete CERTIFICATE block "
                                             "(a private key or CSR is not a certificate)")
        body = text[begin + len("-----BEGIN CERTIFICATE-----"):end]
        try:
            der = base64.b64decode("".join(body.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise MalformedCertificate(name, f"PEM block is not valid base64 ({e})")
        return parse_certificate(der, name), "pem"
    return parse_certificate(raw, name), "der"
