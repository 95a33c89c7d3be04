"""Secure Boot / MOK readings, typed: which EFI variables are read (names, GUIDs, directories), what was read
(``RawEfi``), the variables parsed (``parse_efi`` -> ``ParsedEfi``), the signing certificate located
(``CertInfo``) and the whole reading (``MokReading``). Pure over bytes, a leaf (layer 0): observe/mok.py fills
these, decide/mok.py decides over them, so neither imports the other."""

from __future__ import annotations

from spark_memsaver.record import Record, field

from spark_memsaver import efi as ev

EFI_DIR = "/sys/firmware/efi"
EFIVARS_DIR = "/sys/firmware/efi/efivars"
MOKVAR_DIR = "/sys/firmware/efi/mok-variables"

# Variables we read: name -> GUID. MokListRT continuations (MokListRT1, ...) are found by listing.
SCALARS = {"SecureBoot": ev.EFI_GLOBAL_VARIABLE, "SetupMode": ev.EFI_GLOBAL_VARIABLE,
           "MokSBStateRT": ev.SHIM_LOCK_GUID}
LISTS = {"MokListRT": ev.SHIM_LOCK_GUID, "MokListXRT": ev.SHIM_LOCK_GUID, "MokNew": ev.SHIM_LOCK_GUID,
         "MokDel": ev.SHIM_LOCK_GUID, "db": ev.EFI_IMAGE_SECURITY_DATABASE, "dbx": ev.EFI_IMAGE_SECURITY_DATABASE}
PRESENCE = {"MokAuth": ev.SHIM_LOCK_GUID, "MokDelAuth": ev.SHIM_LOCK_GUID, "MokListTrustedRT": ev.SHIM_LOCK_GUID,
            "MokTimeout": ev.SHIM_LOCK_GUID}
MOKVAR_NAMES = ("MokListRT", "MokListXRT")    # shim's config table, preferred by mokutil when present


# --- what was read (observe/mok.py fills it) ---------------------------------------------------------

class RawEfi(Record):
    """Exactly what was read, nothing interpreted. files: name -> bytes | None (absent) | str (read error)."""
    efi: bool
    efivarfs: bool                     # efivars directory exists and lists at least one variable
    listing_error: str | None = None
    files: dict = field(default_factory=dict)
    continuations: list = field(default_factory=list)   # MokListRT<N> names present, sorted by N
    mokvar: dict = field(default_factory=dict)          # name -> bytes | str (read error)


# --- parsing (pure) --------------------------------------------------------------------------------------

class Var(Record):
    name: str
    present: bool
    source: str = ""                   # "efivarfs" or "mok-variables"
    error: str | None = None           # why it could not be used (unknown)
    attributes: int | None = None
    value: int | None = None           # scalars
    lists: list = field(default_factory=list)

    def summary(self) -> dict:
        d = {"present": self.present}
        if not self.present and not self.error:
            return d
        d["source"] = self.source
        if self.attributes is not None:
            d["attributes"] = f"0x{self.attributes:08x}"
        if self.value is not None:
            d["value"] = self.value
        if self.lists:
            d.update(ev.summarize(self.lists))
        if self.error:
            d["error"] = self.error
        return d


class ParsedEfi(Record):
    efi: bool
    efivarfs: bool
    listing_error: str | None
    vars: dict                          # name -> Var
    moklist_parts: list                 # names making up MokListRT, in order


def _parse_scalar(name: str, raw) -> Var:
    if raw is None:
        return Var(name, False)
    if isinstance(raw, str):
        return Var(name, True, "efivarfs", error=raw)
    try:
        v = ev.parse_efivarfs(raw, name)
        return Var(name, True, "efivarfs", attributes=v.attributes, value=ev.parse_uint_flag(v))
    except ev.EfiFormatError as e:
        return Var(name, True, "efivarfs", error=e.message)


def _parse_list(name: str, raw, source: str = "efivarfs") -> Var:
    if raw is None:
        return Var(name, False)
    if isinstance(raw, str):
        return Var(name, True, source, error=raw)
    try:
        if source == "efivarfs":
            v = ev.parse_efivarfs(raw, name)
            return Var(name, True, source, attributes=v.attributes,
                       lists=ev.parse_signature_lists(v.data, name, base_offset=4))
        return Var(name, True, source, lists=ev.parse_signature_lists(raw, name))
    except ev.EfiFormatError as e:
        return Var(name, True, source, error=e.message)


def parse_efi(raw: RawEfi) -> ParsedEfi:
    vs: dict = {}
    for name in SCALARS:
        vs[name] = _parse_scalar(name, raw.files.get(name))
    parts = ["MokListRT"]
    for name in LISTS:
        if name in raw.mokvar:
            vs[name] = _parse_list(name, raw.mokvar[name], "mok-variables")
        else:
            vs[name] = _parse_list(name, raw.files.get(name))
    if "MokListRT" not in raw.mokvar:
        for name in raw.continuations:
            vs[name] = _parse_list(name, raw.files.get(name))
            parts.append(name)
    for name in PRESENCE:
        r = raw.files.get(name)
        vs[name] = Var(name, r is not None, "efivarfs", error=r if isinstance(r, str) else None)
    return ParsedEfi(raw.efi, raw.efivarfs, raw.listing_error, vs, parts)


# --- certificate ----------------------------------------------------------------------------------------

class CertInfo(Record):
    path: str | None
    origin: str                         # "--cert", "config signing_cert", "dkms framework.conf", default...
    present: bool = False
    error: str | None = None            # unreadable / not a certificate / unresolvable path -> unknown
    cert: ev.Certificate | None = None
    encoding: str | None = None
    key_path: str | None = None         # the private key DKMS signs with beside it (None: not known, e.g. --cert)
    key_present: bool | None = None     # whether that path exists (never read; a pkcs11: URI counts as present)

    def summary(self) -> dict:
        d = {"path": self.path, "origin": self.origin, "present": self.present}
        if self.key_path is not None:
            d.update({"key_path": self.key_path, "key_present": self.key_present})
        if self.cert is not None:
            c = self.cert
            d.update({"encoding": self.encoding, "sha256": c.sha256, "sha1": c.sha1, "subject": c.subject_text,
                      "issuer": c.issuer_text, "serial": c.serial.hex(), "not_before": c.not_before,
                      "not_after": c.not_after, "key_id": c.skid.hex() if c.skid is not None else None,
                      "kernel_description": c.kernel_key_description})
        if self.error:
            d["error"] = self.error
        return d


class MokReading(Record):
    """Everything observe/mok.read() gathered for one verdict (decide/mok.section)."""
    parsed: ParsedEfi
    cert: CertInfo
    request: dict | None               # our record of the last enrollment request (host/paths.MOK_REQUEST)
    boot_id: str | None
    kernel: dict                       # lockdown, sig_enforce, keyrings, trusted_by_kernel (observe/mok.read_kernel)
