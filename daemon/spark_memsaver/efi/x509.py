"""The X.509 fields we report from a certificate (DER, or one PEM CERTIFICATE block): a minimal strict DER
reader. Pure functions over bytes; every malformation is :class:`MalformedCertificate` (an EfiFormatError)."""

from __future__ import annotations

from spark_memsaver.record import Record, field

from spark_memsaver.efi.der import DerError as _DerError, tlv_header as _tlv_header
from spark_memsaver.efi.siglist import (EfiFormatError, MalformedCertificate,  # noqa: F401
                                                MalformedSignatureList, der_length_check)

# --- minimal DER / X.509 (the TLV header: efi/der.py) --------------------------------------------


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
    """UTCTime (YYMMDDHHMMSSZ, RFC 5280: YY < 50 is 20YY) or GeneralizedTime (YYYYMMDDHHMMSSZ) -> ISO 8601 'Z'.
    Read by hand (timefmt checks the date): datetime.strptime would load _strptime, calendar and locale into
    every status that reads a certificate."""
    from spark_memsaver.timefmt import utc_epoch

    t = b[s:e].decode("ascii", errors="replace")
    if tag not in (0x17, 0x18):
        raise _DerError(f"validity time has tag 0x{tag:02x}")
    digits = t[:-1]
    if tag == 0x17 and len(digits) == 10:
        digits += "00"               # BER's UTCTime without seconds (strptime read it so)
    if not (t.endswith("Z") and digits.isascii() and digits.isdigit() and len(digits) == (12 if tag == 0x17 else 14)):
        raise _DerError(f"unparseable validity time {t!r}")
    if tag == 0x17:
        digits = ("20" if int(digits[:2]) < 50 else "19") + digits
    stamp = f"{digits[:4]}-{digits[4:6]}-{digits[6:8]}T{digits[8:10]}:{digits[10:12]}:{digits[12:14]}Z"
    if int(digits[12:14]) > 59 or utc_epoch(stamp) is None:
        raise _DerError(f"unparseable validity time {t!r}")
    return stamp


def _sha256(data: bytes) -> bytes:
    from spark_memsaver.digest import sha256   # CPython's own: hashlib would load libcrypto into status

    return sha256(data).digest()


class Certificate(Record, frozen=True):
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
        from spark_memsaver.digest import sha256
        return sha256(self.der).hexdigest()

    @property
    def sha1(self) -> str:
        import hashlib
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
            tbs_sha256=_sha256(der[tbs_tag_start:tbs_end]),
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
