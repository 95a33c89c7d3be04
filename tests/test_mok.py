"""Secure Boot / MOK state from efivarfs, and guided enrollment (observe/mok, decide/mok, act/enroll, efi/).

What the fixtures stand in for: **EFI firmware**. This machine boots without EFI, so the variables the
firmware and shim expose at runtime are written by these tests as byte-exact efivarfs files under a fixture
root (``ROOT/sys/firmware/efi/efivars/<Name>-<guid>``: 4 little-endian attribute bytes + data), exactly as the
kernel's efivarfs presents them (Documentation/filesystems/efivarfs.rst), with EFI_SIGNATURE_LISTs encoded
here independently of the code under test (GUID bytes taken literally from the on-disk layout). The
certificates inside are real X.509 certificates made by ``openssl`` in the test. ``mokutil`` is the real
one; on a machine without EFI it reports "EFI variables are not supported on this system", and that path is
tested as it is. Nothing here writes real firmware variables.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import subprocess
from pathlib import Path

import pytest

from spark_memsaver import world
from spark_memsaver import efi as ev
from spark_memsaver.act import enroll
from spark_memsaver.decide import mok as dmok
from spark_memsaver.errors import SecureBootUnknown
from spark_memsaver.host import Host
from spark_memsaver.host.runner import Runner
from spark_memsaver.observe import mok as omok
from tests.support import needs

pytestmark = pytest.mark.mok

REPO = Path(__file__).resolve().parent.parent

# On-disk (mixed-endian) GUID bytes, written out literally so the encoder under test is not trusted.
G_GLOBAL = bytes.fromhex("61dfe48bca93d211aa0d00e098032b8c")
G_SHIM = bytes.fromhex("50ab5d6046e00043abb63dd810dd8b23")
G_IMGDB = bytes.fromhex("cbb219d73a3d9645a3bcdad00e67656f")
T_X509 = bytes.fromhex("a159c0a5e494a74a87b5ab155c2bf072")
T_SHA256 = bytes.fromhex("2616c4c14c509240aca941f936934328")
T_X509_SHA256 = bytes.fromhex("92a4d23bc0967940b420fcf98ef103ed")  # 3bd2a492-96c0-4079-b420-fcf98ef103ed

GUID_TEXT = {G_GLOBAL: "8be4df61-93ca-11d2-aa0d-00e098032b8c", G_SHIM: "605dab50-e046-4300-abb6-3dd810dd8b23",
             G_IMGDB: "d719b2cb-3d3a-4596-a3bc-dad00e67656f"}
VAR_GUID = {"SecureBoot": G_GLOBAL, "SetupMode": G_GLOBAL, "db": G_IMGDB, "dbx": G_IMGDB}

NV, BS, RT, AT = 0x1, 0x2, 0x4, 0x20
A_VOLATILE = BS | RT            # SecureBoot, MokListRT, MokSBStateRT ...
A_NV = NV | BS | RT             # MokNew, MokAuth, MokDel
A_AUTH = NV | BS | RT | AT      # db, dbx


# --- byte builders (independent of spark_memsaver/efi/) -------------------------------------------------------

def esl(sig_type: bytes, entries: list[bytes], owner: bytes = G_SHIM, header: bytes = b"") -> bytes:
    size = 16 + len(entries[0])
    body = b"".join(owner + e for e in entries)
    return sig_type + struct.pack("<III", 28 + len(header) + len(body), len(header), size) + header + body


def x509_list(der: bytes, owner: bytes = G_SHIM) -> bytes:
    return esl(T_X509, [der], owner)


def sha256_list(*blobs: bytes) -> bytes:
    return esl(T_SHA256, [hashlib.sha256(b).digest() for b in blobs])


def efivar(attrs: int, data: bytes) -> bytes:
    return struct.pack("<I", attrs) + data


# --- certificates made by openssl ---------------------------------------------------------------------

PAIRS: dict = {}          # a DER certificate made by _openssl_cert -> (its key, its file): what a module it signs needs


def _openssl_cert(d: Path, name: str, subj: str, days: int = 36500, fmt: str = "DER") -> Path:
    out = d / f"{name}.{fmt.lower()}"
    subprocess.run(["openssl", "req", "-new", "-x509", "-nodes", "-days", str(days), "-subj", subj,
                    "-newkey", "rsa:2048", "-keyout", str(d / f"{name}.key"), "-outform", fmt, "-out", str(out)],
                   check=True, capture_output=True)
    if fmt == "DER":
        PAIRS[out.read_bytes()] = (d / f"{name}.key", out)
    return out


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    ours = _openssl_cert(d, "ours", "/CN=DKMS module signing key")
    other = _openssl_cert(d, "other", "/O=Example Vendor/CN=Example Vendor Secure Boot CA")
    pem = _openssl_cert(d, "pem", "/O=spark/CN=node17 Secure Boot Module Signature key", fmt="PEM")
    return {"ours": ours.read_bytes(), "other": other.read_bytes(), "pem_path": pem,
            "pem_der": subprocess.run(["openssl", "x509", "-in", str(pem), "-outform", "DER"], check=True,
                                      capture_output=True).stdout,
            "dir": d}


def make_root(base: Path, variables: dict, cert: bytes | None = None, *, efi: bool = True,
              cert_path: str = "/var/lib/dkms/mok.pub", os_id: str | None = None,
              mokvar: dict | None = None, extra: dict | None = None) -> Path:
    """A fixture root. variables: name -> raw efivarfs bytes (attributes + data)."""
    root = base
    root.mkdir(parents=True, exist_ok=True)
    (root / "sys/kernel").mkdir(parents=True, exist_ok=True)   # a mounted sysfs (EFI or not) always has it
    if efi:
        vd = root / "sys/firmware/efi/efivars"
        vd.mkdir(parents=True)
        for name, raw in variables.items():
            guid = VAR_GUID.get(name, G_SHIM)
            (vd / f"{name}-{GUID_TEXT[guid]}").write_bytes(raw)
        if mokvar:
            md = root / "sys/firmware/efi/mok-variables"
            md.mkdir(parents=True)
            for name, data in mokvar.items():
                (md / name).write_bytes(data)
    if cert is not None:
        p = root / cert_path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(cert)
    if os_id:
        (root / "etc").mkdir(exist_ok=True)
        (root / "etc/os-release").write_text(f'NAME="x"\nID={os_id}\n')
    for rel, content in (extra or {}).items():
        p = root / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


SB_ON = {"SecureBoot": efivar(A_VOLATILE, b"\x01"), "SetupMode": efivar(A_VOLATILE, b"\x00")}


def scenarios(c) -> dict:
    """name -> (variables, cert bytes or None, expected state, extra make_root kwargs)."""
    ours, other = c["ours"], c["other"]
    shim_vendor = x509_list(other)
    moklist = efivar(A_VOLATILE, shim_vendor + sha256_list(b"grub", b"kernel") + x509_list(ours))
    tbs = ev.parse_certificate(ours).tbs_sha256
    s = {
        "no-efi": ({}, ours, "not-needed", {"efi": False}),
        "sb-off": ({"SecureBoot": efivar(A_VOLATILE, b"\x00"), "SetupMode": efivar(A_VOLATILE, b"\x00")},
                   ours, "not-needed", {}),
        "setup-mode": ({"SecureBoot": efivar(A_VOLATILE, b"\x01"), "SetupMode": efivar(A_VOLATILE, b"\x01")},
                       ours, "not-needed", {}),
        "validation-disabled": ({**SB_ON, "MokSBStateRT": efivar(A_VOLATILE, b"\x01"),
                                 "MokListRT": efivar(A_VOLATILE, shim_vendor)}, ours, "not-needed", {}),
        # A non-volatile MokSBStateRT could be planted at runtime; the kernel ignores it, so do we.
        "validation-nv-ignored": ({**SB_ON, "MokSBStateRT": efivar(A_NV, b"\x01"),
                                   "MokListRT": efivar(A_VOLATILE, shim_vendor)}, ours, "not-enrolled", {}),
        "no-secureboot-var": ({"Boot0000": efivar(A_NV, b"\x01\x00")}, ours, "not-needed", {}),
        "efivarfs-unmounted": ({}, ours, "unknown", {}),
        "no-key": ({**SB_ON, "MokListRT": efivar(A_VOLATILE, shim_vendor)}, None, "no-key", {}),
        "not-enrolled": ({**SB_ON, "MokListRT": efivar(A_VOLATILE, shim_vendor + sha256_list(b"x"))},
                         ours, "not-enrolled", {}),
        "enrolled-among-lists": ({**SB_ON, "MokListRT": moklist, "db": efivar(A_AUTH, x509_list(other))},
                                 ours, "enrolled", {}),
        "enrolled-split": ({**SB_ON, "MokListRT": efivar(A_VOLATILE, shim_vendor),
                            "MokListRT1": efivar(A_VOLATILE, sha256_list(b"a", b"b", b"c")),
                            "MokListRT2": efivar(A_VOLATILE, x509_list(other) + x509_list(ours))},
                           ours, "enrolled", {}),
        "enrolled-db": ({**SB_ON, "MokListRT": efivar(A_VOLATILE, shim_vendor),
                         "db": efivar(A_AUTH, x509_list(other, G_IMGDB) + x509_list(ours, G_IMGDB))},
                        ours, "enrolled", {}),
        "enrolled-mokvar-table": ({**SB_ON, "MokListRT": efivar(A_VOLATILE, shim_vendor)}, ours, "enrolled",
                                  {"mokvar": {"MokListRT": shim_vendor + x509_list(ours)}}),
        "pending-enroll": ({**SB_ON, "MokListRT": efivar(A_VOLATILE, shim_vendor),
                            "MokNew": efivar(A_NV, x509_list(ours)), "MokAuth": efivar(A_NV, b"\x00" * 32)},
                           ours, "pending-enroll", {}),
        "pending-delete": ({**SB_ON, "MokListRT": moklist, "MokDel": efivar(A_NV, x509_list(ours)),
                            "MokDelAuth": efivar(A_NV, b"\x00" * 32)}, ours, "pending-delete", {}),
        "blocked-dbx": ({**SB_ON, "MokListRT": moklist, "dbx": efivar(A_AUTH, sha256_list(b"bad") +
                                                                       x509_list(ours, G_IMGDB))},
                        ours, "blocked", {}),
        "blocked-dbx-tbs-hash": ({**SB_ON, "MokListRT": moklist,
                                  "dbx": efivar(A_AUTH, esl(T_X509_SHA256, [tbs + b"\x00" * 16]))},
                                 ours, "blocked", {}),
        "blocked-mokx": ({**SB_ON, "MokListRT": efivar(A_VOLATILE, shim_vendor),
                          "MokListXRT": efivar(A_VOLATILE, x509_list(ours))}, ours, "blocked", {}),
        # Malformed, truncated, oversized: unknown, with the reason, never a guess.
        "secureboot-5-data-bytes": ({"SecureBoot": efivar(A_VOLATILE, b"\x01\x00\x00\x00\x00"),
                                     "SetupMode": efivar(A_VOLATILE, b"\x00")}, ours, "unknown", {}),
        "secureboot-attrs-only": ({"SecureBoot": b"\x06\x00\x00", "SetupMode": efivar(A_VOLATILE, b"\x00")},
                                  ours, "unknown", {}),
        "secureboot-value-2": ({"SecureBoot": efivar(A_VOLATILE, b"\x02"), "SetupMode": efivar(A_VOLATILE, b"\x00")},
                               ours, "unknown", {}),
        "moklist-truncated": ({**SB_ON, "MokListRT": moklist[:-7]}, ours, "unknown", {}),
        "moklist-bad-sigsize": ({**SB_ON, "MokListRT": efivar(A_VOLATILE, esl(T_SHA256, [b"\x00" * 20]))},
                                ours, "unknown", {}),
        "moklist-oversized": ({**SB_ON, "MokListRT": efivar(A_VOLATILE, b"\x00" * (ev.MAX_VARIABLE_SIZE + 64))},
                              ours, "unknown", {}),
        "moklist-bad-attrs": ({**SB_ON, "MokListRT": efivar(0x100 | A_VOLATILE, shim_vendor)}, ours, "unknown", {}),
        "dbx-trailing-garbage": ({**SB_ON, "MokListRT": moklist, "dbx": efivar(A_AUTH, sha256_list(b"x") + b"\x01")},
                                 ours, "unknown", {}),
        "split-gap": ({**SB_ON, "MokListRT": efivar(A_VOLATILE, shim_vendor),
                       "MokListRT2": efivar(A_VOLATILE, x509_list(ours))}, ours, "unknown", {}),
        "cert-garbage": ({**SB_ON, "MokListRT": moklist}, b"-----BEGIN " + b"PRIVATE KEY-----\nAAAA\n", "unknown", {}),
    }
    return s


SCENARIO_NAMES = ["no-efi", "sb-off", "setup-mode", "validation-disabled", "validation-nv-ignored",
                  "no-secureboot-var", "efivarfs-unmounted", "no-key", "not-enrolled", "enrolled-among-lists",
                  "enrolled-split", "enrolled-db", "enrolled-mokvar-table", "pending-enroll", "pending-delete",
                  "blocked-dbx", "blocked-dbx-tbs-hash", "blocked-mokx", "secureboot-5-data-bytes",
                  "secureboot-attrs-only", "secureboot-value-2", "moklist-truncated", "moklist-bad-sigsize",
                  "moklist-oversized", "moklist-bad-attrs", "dbx-trailing-garbage", "split-gap", "cert-garbage"]


@pytest.fixture(scope="module")
def roots(certs, tmp_path_factory):
    base = tmp_path_factory.mktemp("roots")
    out = {}
    for name, (variables, cert, expected, kw) in scenarios(certs).items():
        out[name] = (make_root(base / name, variables, cert, **kw), expected)
    return out


def test_every_scenario_is_listed(certs):
    assert sorted(scenarios(certs)) == sorted(SCENARIO_NAMES)
    assert {s[2] for s in scenarios(certs).values()} == set(dmok.STATES)


# --- formats ---------------------------------------------------------------------------------------------

def test_guid_byte_order_matches_disk():
    assert ev.guid_to_bytes(ev.EFI_GLOBAL_VARIABLE) == G_GLOBAL
    assert ev.guid_to_bytes(ev.SHIM_LOCK_GUID) == G_SHIM
    assert ev.guid_to_bytes(ev.EFI_IMAGE_SECURITY_DATABASE) == G_IMGDB
    assert ev.guid_to_bytes(ev.EFI_CERT_X509) == T_X509
    assert ev.guid_to_bytes(ev.EFI_CERT_SHA256) == T_SHA256
    assert ev.guid_to_bytes(ev.EFI_CERT_X509_SHA256) == T_X509_SHA256
    assert ev.guid_from_bytes(G_SHIM) == ev.SHIM_LOCK_GUID


def test_parse_lists_x509_and_sha256(certs):
    data = x509_list(certs["other"]) + sha256_list(b"a", b"b") + x509_list(certs["ours"], G_IMGDB)
    lists = ev.parse_signature_lists(data, "MokListRT")
    assert [sl.type_name for sl in lists] == ["x509", "sha256", "x509"]
    assert lists[2].entries[0].data == certs["ours"]
    assert lists[2].entries[0].owner == "d719b2cb-3d3a-4596-a3bc-dad00e67656f"
    assert [e.data for e in lists[1].entries] == [hashlib.sha256(b"a").digest(), hashlib.sha256(b"b").digest()]
    assert lists[1].offset == len(x509_list(certs["other"]))
    assert ev.encode_signature_list(ev.EFI_CERT_X509, [(ev.SHIM_LOCK_GUID, certs["ours"])]) == x509_list(certs["ours"])


@pytest.mark.parametrize("mutate,exc,words", [
    (lambda d: d[:20], ev.TruncatedVariable, "too few for a 28-byte"),
    (lambda d: d[:-1], ev.TruncatedVariable, "runs past the end"),
    (lambda d: d[:16] + struct.pack("<I", 27) + d[20:], ev.MalformedSignatureList, "smaller than the 28-byte"),
    (lambda d: d[:20] + struct.pack("<I", 10 ** 6) + d[24:], ev.MalformedSignatureList, "SignatureHeaderSize"),
    (lambda d: d[:24] + struct.pack("<I", 16) + d[28:], ev.MalformedSignatureList, "SignatureSize 16"),
    (lambda d: d[:24] + struct.pack("<I", 47) + d[28:], ev.MalformedSignatureList, "expected 48"),
    (lambda d: d[:16] + struct.pack("<I", 28) + d[20:28], ev.MalformedSignatureList, "no entries"),
])
def test_malformed_lists_are_named(mutate, exc, words):
    good = sha256_list(b"one", b"two")
    with pytest.raises(exc) as ei:
        ev.parse_signature_lists(mutate(good), "dbx", base_offset=4)
    assert words in ei.value.message and ei.value.message.startswith("dbx: ")


def test_x509_entry_must_be_exactly_one_der_certificate(certs):
    with pytest.raises(ev.MalformedSignatureList, match="DER encoding is"):
        ev.parse_signature_lists(x509_list(certs["ours"] + b"\x00\x00"), "db")
    with pytest.raises(ev.MalformedSignatureList, match="not a DER SEQUENCE"):
        ev.parse_signature_lists(x509_list(b"\x04\x03abc"), "db")


def test_efivarfs_attribute_checks():
    assert ev.parse_efivarfs(b"\x06\x00\x00\x00\x01", "SecureBoot").attributes == 6
    with pytest.raises(ev.TruncatedVariable):
        ev.parse_efivarfs(b"\x06\x00", "SecureBoot")
    with pytest.raises(ev.EfiFormatError, match="lacks RUNTIME_ACCESS"):
        ev.parse_efivarfs(b"\x03\x00\x00\x00\x01", "SecureBoot")
    with pytest.raises(ev.EfiFormatError, match="without BOOTSERVICE_ACCESS"):
        ev.parse_efivarfs(b"\x04\x00\x00\x00\x01", "SecureBoot")
    with pytest.raises(ev.OversizedVariable):
        ev.parse_uint_flag(ev.parse_efivarfs(b"\x06\x00\x00\x00" + b"\x01\x00\x00", "SecureBoot"))
    assert ev.parse_uint_flag(ev.parse_efivarfs(b"\x06\x00\x00\x00\x01\x00\x00\x00", "SecureBoot")) == 1


def test_certificate_fields_match_openssl(certs):
    c, enc = ev.load_certificate(certs["pem_path"].read_bytes())
    assert enc == "pem" and c.der == certs["pem_der"]
    text = subprocess.run(["openssl", "x509", "-in", str(certs["pem_path"]), "-noout", "-serial", "-enddate",
                           "-fingerprint", "-sha256", "-ext", "subjectKeyIdentifier"],
                          check=True, capture_output=True, text=True).stdout
    assert f"serial={c.serial.hex().upper().lstrip('0')}" in text.replace("serial=0", "serial=")
    assert c.sha256.upper() == text.split("Fingerprint=")[1].split()[0].replace(":", "")
    skid = text.split("Subject Key Identifier:")[1].split()[0].replace(":", "").lower()
    assert c.skid.hex() == skid
    # The kernel's key description: O and CN share no 7-char prefix -> "O: CN: skid".
    assert c.kernel_key_description == f"spark: node17 Secure Boot Module Signature key: {skid}"
    year = text.split("notAfter=")[1].split("GMT")[0].split()[-1]
    assert c.not_after.startswith(year + "-")


# --- states, in-process and through the CLI ------------------------------------------------------------

@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_state_in_process(roots, name):
    root, expected = roots[name]
    sb = world.secure_boot(Host(root))
    assert sb["state"] == expected, sb["reason"]
    assert sb["reason"]
    if expected == "unknown":
        with pytest.raises(SecureBootUnknown):
            dmok.require_installable(sb)
    else:
        dmok.require_installable(sb)
    json.dumps(sb)  # JSON-able


def _cli(*args, input=None):
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    return subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", *args], capture_output=True, text=True,
                          env=env, input=input, timeout=60)


@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_state_through_cli(roots, name):
    root, expected = roots[name]
    r = _cli("--root", str(root), "mok", "status", "--json")
    assert "Traceback" not in r.stderr
    doc = json.loads(r.stdout)
    assert doc["state"] == expected
    assert r.returncode == {"not-needed": 0, "enrolled": 0, "unknown": 2}.get(expected, 1)


def test_reasons_are_precise(roots):
    def reason(n):
        return world.secure_boot(Host(roots[n][0]))["reason"]
    assert "runs past the end" in reason("moklist-truncated") and "MokListRT" in reason("moklist-truncated")
    assert "expected 48" in reason("moklist-bad-sigsize")
    assert "oversized" in reason("moklist-oversized")
    assert "MokListRT2 exists but MokListRT1 does not" in reason("split-gap")
    assert "not mounted" in reason("efivarfs-unmounted")
    assert "dbx" in reason("dbx-trailing-garbage")
    assert "5 data bytes" in reason("secureboot-5-data-bytes")
    assert "CERTIFICATE block" in reason("cert-garbage")


def test_details_of_enrolled_split(roots, certs):
    sb = world.secure_boot(Host(roots["enrolled-split"][0]))
    assert sb["where"] == ["MokListRT2"]
    assert sb["secure_boot"] is True and sb["setup_mode"] is False and sb["validation_disabled"] is False
    assert sb["certificate"]["sha256"] == hashlib.sha256(certs["ours"]).hexdigest()
    assert sb["certificate"]["subject"] == "CN=DKMS module signing key"
    assert sb["variables"]["MokListRT1"]["entries"] == {"sha256": 3}
    assert sb["variables"]["MokListRT"]["attributes"] == "0x00000006"


def test_where_db_and_mokvar(roots):
    assert world.secure_boot(Host(roots["enrolled-db"][0]))["where"] == ["db"]
    sb = world.secure_boot(Host(roots["enrolled-mokvar-table"][0]))
    assert sb["where"] == ["MokListRT"] and sb["variables"]["MokListRT"]["source"] == "mok-variables"


def test_status_document_carries_state(roots, tmp_path):
    root = roots["pending-enroll"][0]
    (root / "proc/sys/kernel").mkdir(parents=True, exist_ok=True)
    (root / "proc/sys/kernel/osrelease").write_text("6.17.0-1014-nvidia\n")
    r = _cli("--root", str(root), "status", "--json", "--direct")
    doc = json.loads(r.stdout)
    assert doc["secure_boot"]["state"] == "pending-enroll"


# --- which certificate ------------------------------------------------------------------------------------

def _sb_root(base, certs, **kw):
    return make_root(base, {**SB_ON, "MokListRT": efivar(A_VOLATILE, x509_list(certs["pem_der"]))}, **kw)


def test_cert_from_dkms_framework_conf_d_with_kernelver(tmp_path, certs):
    root = _sb_root(tmp_path / "r", certs, extra={
        "/etc/dkms/framework.conf": '# mok_certificate="/nowhere"\nmok_certificate=/var/lib/dkms/wrong.der\n',
        "/etc/dkms/framework.conf.d/50-spark.conf": 'mok_certificate="/etc/keys/$kernelver/mok.pem"  # ours\n',
        "/proc/sys/kernel/osrelease": "6.17.0-1014-nvidia\n",
        "/etc/keys/6.17.0-1014-nvidia/mok.pem": certs["pem_path"].read_bytes()})
    sb = world.secure_boot(Host(root))
    assert sb["certificate"]["path"] == "/etc/keys/6.17.0-1014-nvidia/mok.pem"
    assert "50-spark.conf" in sb["certificate"]["origin"] and sb["certificate"]["encoding"] == "pem"
    assert sb["state"] == "enrolled"


def test_cert_ubuntu_default(tmp_path, certs):
    root = _sb_root(tmp_path / "r", certs, cert=certs["pem_der"], cert_path=omok.UBUNTU_DEFAULT_CERT, os_id="ubuntu")
    sb = world.secure_boot(Host(root))
    assert sb["certificate"]["path"] == "/var/lib/shim-signed/mok/MOK.der" and sb["state"] == "enrolled"
    root2 = _sb_root(tmp_path / "r2", certs, cert=certs["pem_der"], cert_path=omok.UBUNTU_DEFAULT_CERT,
                     os_id="debian")
    sb2 = world.secure_boot(Host(root2))
    assert sb2["certificate"]["path"] == "/var/lib/dkms/mok.pub" and sb2["state"] == "no-key"


def test_cert_option_and_unresolvable_variable(tmp_path, certs):
    root = _sb_root(tmp_path / "r", certs, extra={"/etc/dkms/framework.conf": "mok_certificate=$dkms_tree/x\n"})
    assert world.secure_boot(Host(root))["state"] == "unknown"
    r = _cli("--root", str(root), "mok", "status", "--json", "--cert", str(certs["pem_path"]))
    assert json.loads(r.stdout)["state"] == "enrolled" and r.returncode == 0


# --- kernel side ------------------------------------------------------------------------------------------

def test_kernel_side(tmp_path, certs):
    c = ev.parse_certificate(certs["ours"])
    keys = (
        "0f1e2d3c I------     1 perm 1f0f0000     0     0 keyring   .platform: 2\n"
        "1a2b3c4d I------     1 perm 1f0b0000     0     0 keyring   .machine: empty\n"
        f"2b3c4d5e I------     1 perm 1f030000     0     0 asymmetri {c.kernel_key_description}: X509.rsa "
        f"{c.skid.hex()[-8:]} []\n"
        "3c4d5e6f I------     1 perm 1f030000     0     0 asymmetri Canonical Ltd. Master Certificate Authority: "
        "ad91990bc22ab1f517048c23b6655a268e345a63: X509.rsa 8e345a63 []\n")
    root = make_root(tmp_path / "r", {**SB_ON, "MokListRT": efivar(A_VOLATILE, x509_list(certs["ours"]))},
                     certs["ours"], extra={"/proc/keys": keys,
                                           "/sys/kernel/security/lockdown": "none [integrity] confidentiality\n",
                                           "/sys/module/module/parameters/sig_enforce": "N\n"})
    k = world.secure_boot(Host(root))["kernel"]
    assert k["lockdown"] == "integrity" and k["sig_enforce"] is False
    assert k["keyrings"][".platform"] == {"present": True, "keys": 2}
    assert k["keyrings"][".machine"] == {"present": True, "keys": 0}
    assert k["key_loaded"] is True and k["key_description"].startswith("DKMS module signing key: ")
    (root / "proc/keys").write_text(keys.splitlines()[0] + "\n" + keys.splitlines()[3] + "\n")
    assert world.secure_boot(Host(root))["kernel"]["key_loaded"] is False


# --- the real mokutil -------------------------------------------------------------------------------------

NO_EFI = not Path("/sys/firmware/efi").exists()


def _mokutil():
    if not Runner().which("mokutil"):
        needs.absent("mokutil", "tools/deps/mok.txt lists it; run tests through tools/test")


def test_live_state_agrees_with_real_mokutil():
    _mokutil()
    sb = world.secure_boot(Host("/"))
    r = subprocess.run(["mokutil", "--sb-state"], capture_output=True, text=True)
    out = r.stdout + r.stderr
    if NO_EFI:
        assert "EFI variables are not supported" in out and r.returncode != 0
        assert sb["state"] == "not-needed" and sb["efi"] is False
    elif "SecureBoot enabled" in out:
        assert sb["secure_boot"] is True
    elif "SecureBoot disabled" in out:
        assert sb["state"] == "not-needed"
    else:
        assert sb["state"] == "unknown"


def test_real_mokutil_import_without_efi_is_a_named_error(certs, tmp_path):
    """Runs the real `mokutil --import --hash-file`; on this machine it has no EFI to write to."""
    _mokutil()
    if not NO_EFI:
        needs.not_applicable("this machine has EFI firmware: a test must not queue a real MOK enrollment")
    seen = {}

    class Spy(Runner):      # the real runner, recording what mokutil was given while it runs
        def run(self, argv, **kw):
            if "--hash-file" in argv:
                hf = argv[argv.index("--hash-file") + 1]
                seen["mode"] = os.stat(hf).st_mode & 0o777
                seen["hash"] = Path(hf).read_text()
                seen["argv"] = list(argv)
                seen["hf"] = hf
            return super().run(argv, **kw)

    der = tmp_path / "k.der"
    der.write_bytes(certs["ours"])
    pw = "Sp4rk one-time"
    with pytest.raises(dmok.MokutilFailed) as ei:
        enroll.run_mokutil_import(Host("/", runner=Spy()), str(der), pw)
    assert "EFI variables are not supported" in ei.value.message
    assert pw not in " ".join(seen["argv"]) and seen["mode"] == 0o600
    salt = seen["hash"].split("$")[2]
    assert seen["hash"] == enroll.sha512_crypt(pw, salt) + "\n"
    assert not os.path.exists(seen["hf"])        # removed afterwards


def test_hash_file_format_is_what_mokutil_decodes():
    import re
    for pw, salt in (("abc", "saltsaltsaltsalt"), ("x" * 100, "a"), ("p@ss w0rd~", "./09AZaz")):
        mine = enroll.sha512_crypt(pw, salt)
        ref = subprocess.run(["openssl", "passwd", "-6", "-salt", salt, "-stdin"], input=pw, check=True,
                             capture_output=True, text=True).stdout.strip()
        assert mine == ref
    h = enroll.sha512_crypt("pw")
    # mokutil decode_sha512_pass: ([./0-9A-Za-z]{1,16})?\$[./0-9A-Za-z]{86}
    assert re.fullmatch(r"\$6\$[./0-9A-Za-z]{16}\$[./0-9A-Za-z]{86}", h)
    assert enroll.sha512_crypt("pw") != h           # a fresh salt each time


def test_enroll_refusals_through_cli(roots, certs):
    cases = {"enrolled-among-lists": "mok-already-enrolled", "pending-enroll": "mok-already-pending",
             "blocked-dbx": "mok-key-blocked", "no-key": "mok-no-key", "sb-off": "mok-not-needed",
             "moklist-truncated": "secure-boot-unknown", "pending-delete": "mok-pending-delete",
             "not-enrolled": "unsupported"}   # the state allows it, but --root never writes real firmware
    for name, code in cases.items():
        r = _cli("--root", str(roots[name][0]), "mok", "enroll", "--password-stdin", "--json", input="secret\n")
        err = json.loads(r.stdout)["error"]
        assert err["code"] == code, (name, err)
        assert r.returncode == 1 and "Traceback" not in r.stderr and "secret" not in r.stdout + r.stderr


def test_enroll_on_this_machine_without_efi():
    if not NO_EFI:
        needs.not_applicable("this machine has EFI firmware")
    r = _cli("mok", "enroll", "--password-stdin", input="secret\n")
    assert r.returncode == 1 and "error[mok-not-needed]" in r.stderr and "no EFI firmware" in r.stderr


def test_password_checks():
    with pytest.raises(dmok.MokBadPassword):
        enroll.check_password("")
    with pytest.raises(dmok.MokBadPassword):
        enroll.check_password("x" * 257)
    with pytest.raises(dmok.MokBadPassword) as ei:
        enroll.check_password("pässwörd")
    assert "pässwörd" not in ei.value.message
    enroll.check_password("a" * 256)


def test_cancel_without_pending_request(roots):
    r = _cli("--root", str(roots["not-enrolled"][0]), "mok", "cancel")
    assert r.returncode == 0 and "Nothing to cancel" in r.stdout
    r = _cli("--root", str(roots["pending-enroll"][0]), "mok", "cancel", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "unsupported"


def test_request_enrollment_api_refuses_unknown(roots):
    with pytest.raises(SecureBootUnknown):
        enroll.request_enrollment(Host(roots["split-gap"][0]), None, "pw")
    with pytest.raises(dmok.MokAlreadyEnrolled):
        enroll.request_enrollment(Host(roots["enrolled-db"][0]), None, "pw")


def test_enrollment_requests_and_cancellations_are_lifecycle_events(roots, tmp_path):
    """Issue 34 item 3: host/events.py named 'enroll' and `events --help` promised enrollments, but nothing
    recorded them. A refused request is one event (as the executor records a refused operation); bad usage and
    the --root refusal are none (nothing attempted, an inspected image is not written); the password never is."""
    import shutil
    from spark_memsaver.host import events
    root = tmp_path / "enrolled"
    shutil.copytree(roots["enrolled-db"][0], root, symlinks=True)
    (root / "var/lib/spark-memsaver/events.jsonl").unlink(missing_ok=True)   # the shared root's earlier tests
    with pytest.raises(dmok.MokAlreadyEnrolled):
        enroll.request_enrollment(Host(root), None, "secret-pw-1")
    (ev,) = events.read(Host(root))
    assert ev["op"] == "enroll" and ev["ok"] is False and ev["error"]["code"] == "mok-already-enrolled"
    assert "secret-pw-1" not in (root / "var/lib/spark-memsaver/events.jsonl").read_text()
    other = tmp_path / "not-enrolled"
    shutil.copytree(roots["not-enrolled"][0], other, symlinks=True)
    (other / "var/lib/spark-memsaver/events.jsonl").unlink(missing_ok=True)
    for call in (lambda: enroll.request_enrollment(Host(other), None, "pw"),        # --root: unsupported
                 lambda: enroll.request_enrollment(Host(other), None, ""),          # bad password
                 lambda: enroll.cancel_enrollment(Host(other))):                    # nothing pending: a no-op
        with contextlib.suppress(Exception):
            call()
    assert events.read(Host(other)) == []
    # A cancellation that ran: mokutil --revoke-import on a live EFI machine cannot run here; the recorder gets
    # what cancel_enrollment returns there.
    done = enroll._recorded("enroll-cancel")(lambda host, **kw: {"cancelled": True, "state_before": "pending-enroll",
                                                                  "state": "not-enrolled"})
    done(Host(other))
    (ev,) = events.read(Host(other))
    assert ev["op"] == "enroll-cancel" and ev["ok"] and ev["state_before"] == "pending-enroll"
    assert ev["state_now"] == "not-enrolled"


def test_require_installable_without_observation():
    with pytest.raises(SecureBootUnknown):
        dmok.require_installable({})
    with pytest.raises(SecureBootUnknown):
        dmok.require_installable({"state": "something-else"})


# --- a missed prompt is visible --------------------------------------------------------------------------

@pytest.mark.parametrize("scenario,record_boot,record_cert,words", [
    ("not-enrolled", "boot-A", "ours", "was not confirmed at the console"),
    ("not-enrolled", "boot-B", "ours", None),           # requested in this boot: nothing was missed yet
    ("not-enrolled", "boot-A", "other", None),          # a request for another certificate
    ("pending-enroll", "boot-A", "ours", "MokManager did not run"),
    ("pending-enroll", "boot-B", "ours", None),
])
def test_request_record_explains_a_missed_prompt(tmp_path, certs, scenario, record_boot, record_cert, words):
    variables, cert, expected, kw = scenarios(certs)[scenario]
    sha = hashlib.sha256(certs[record_cert]).hexdigest()
    root = make_root(tmp_path / "r", variables, cert, **kw, extra={
        "/proc/sys/kernel/random/boot_id": "boot-B\n",
        omok.REQUEST_RECORD: json.dumps({"cert_sha256": sha, "boot_id": record_boot,
                                        "requested_at": "2026-11-30T01:00:00Z"})})
    sb = world.secure_boot(Host(root))
    assert sb["state"] == expected and sb["last_request"]["boot_id"] == record_boot
    if words:
        assert words in sb["reason"] and "2026-11-30T01:00:00Z" in sb["reason"]
    else:
        assert "confirmed at the console" not in sb["reason"] and "did not run" not in sb["reason"]


def test_damaged_request_record_is_ignored(roots):
    root = roots["not-enrolled"][0]
    p = root / omok.REQUEST_RECORD.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("{not json")
    try:
        sb = world.secure_boot(Host(root))
        assert sb["state"] == "not-enrolled" and sb["last_request"] is None
    finally:
        p.unlink()


def test_request_record_round_trip(tmp_path):
    root = make_root(tmp_path / "r", {}, None, efi=False, extra={"/proc/sys/kernel/random/boot_id": "b1\n"})
    h = Host(root)
    enroll.write_request_record(h, "ab" * 32)
    rec = omok.read_request_record(h)
    assert rec["cert_sha256"] == "ab" * 32 and rec["boot_id"] == "b1" and rec["requested_at"].endswith("Z")
    enroll.clear_request_record(h)
    assert omok.read_request_record(h) is None


# --- phase 2 of issue 12: the config the caller runs with, images without sysfs, certificate files ----------

def _status_root(base, certs):
    root = _sb_root(base, certs, extra={"/etc/keys/node.pem": certs["pem_path"].read_bytes(),
                                        "/proc/sys/kernel/osrelease": "6.17.0-1014-nvidia\n"})
    return root


def test_status_uses_the_given_config_signing_cert(tmp_path, certs):
    """`--config X status`: X's signing_cert is the certificate (observe used to reload the host's config)."""
    root = _status_root(tmp_path / "r", certs)
    cfgp = tmp_path / "x.yaml"
    cfgp.write_text("signing_key: /etc/keys/node.key\nsigning_cert: /etc/keys/node.pem\n")
    r = _cli("--root", str(root), "--config", str(cfgp), "status", "--json", "--direct")
    assert "Traceback" not in r.stderr, r.stderr
    sb = json.loads(r.stdout)["secure_boot"]
    assert sb["certificate"]["path"] == "/etc/keys/node.pem"
    assert sb["certificate"]["origin"] == "config signing_cert"
    assert sb["state"] == "enrolled"
    # the in-process reader the daemon's status process uses (report/document.status_of with the daemon's config)
    from spark_memsaver import config as cfg
    from spark_memsaver.report import document
    doc, _ = document.status_of(Host(root), cfg.load(str(cfgp), root=str(root)))
    assert doc["secure_boot"]["certificate"]["path"] == "/etc/keys/node.pem"
    assert doc["secure_boot"]["state"] == "enrolled"


def test_image_without_sysfs_is_unknown_never_not_needed(tmp_path, certs):
    """`mok status --root` on a mounted image (no sysfs in it): unknown with the reason, exit 2."""
    root = tmp_path / "image"
    (root / "etc").mkdir(parents=True)
    (root / "etc/os-release").write_text("ID=ubuntu\n")
    (root / "var/lib/shim-signed/mok").mkdir(parents=True)
    (root / "var/lib/shim-signed/mok/MOK.der").write_bytes(certs["ours"])
    r = _cli("--root", str(root), "mok", "status", "--json")
    assert "Traceback" not in r.stderr
    sb = json.loads(r.stdout)
    assert sb["state"] == "unknown", sb
    assert "not a mounted sysfs" in sb["reason"]
    assert "booted node" in sb["remedy"]
    assert sb["secure_boot"] is None
    assert r.returncode == 2
    with pytest.raises(SecureBootUnknown) as e:
        dmok.require_installable(sb)
    assert "booted node" in e.value.remedy


def test_unknown_refusal_names_the_remedy_for_its_cause(roots, tmp_path, certs):
    sb = world.secure_boot(Host(roots["efivarfs-unmounted"][0]))
    with pytest.raises(SecureBootUnknown) as e:
        dmok.require_installable(sb)
    assert "mount -t efivarfs" in e.value.remedy
    sb = world.secure_boot(Host(roots["cert-garbage"][0]))
    with pytest.raises(SecureBootUnknown) as e:
        enroll.request_enrollment(Host(roots["cert-garbage"][0]), None, "pw")
    assert "/var/lib/dkms/mok.pub" in e.value.remedy and "signing_cert" in e.value.remedy
    assert "mount -t efivarfs" not in e.value.remedy


def _observe_in_child(root: Path, cert: str | None = None, timeout: float = 20):
    code = ("import json,sys; from spark_memsaver import world; from spark_memsaver.host import Host; "
            "print(json.dumps(world.secure_boot(Host(sys.argv[1]), cert=sys.argv[2] or None)))")
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    r = subprocess.run(["/usr/bin/python3", "-c", code, str(root), cert or ""], capture_output=True, text=True,
                       env=env, timeout=timeout)   # a blocking open of a FIFO runs into this timeout
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory", "oversized"])
def test_certificate_file_is_opened_without_blocking(tmp_path, certs, kind):
    """Defect 11 (MOK part): a FIFO at the certificate path wedged the job (blocking open); a symlink was followed."""
    root = _sb_root(tmp_path / "r", certs)
    cp = root / "var/lib/dkms/mok.pub"
    cp.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(cp)
    elif kind == "symlink":
        (tmp_path / "elsewhere.der").write_bytes(certs["pem_der"])
        cp.symlink_to(tmp_path / "elsewhere.der")
    elif kind == "directory":
        cp.mkdir()
    else:
        cp.write_bytes(b"\0" * (omok.MAX_CERT_BYTES + 1))
    sb = _observe_in_child(root)
    words = {"fifo": "is a FIFO", "symlink": "symbolic link", "directory": "is a directory",
             "oversized": "more than"}[kind]
    assert sb["state"] == "unknown" and words in sb["certificate"]["error"], sb
    # --cert on the enrolling machine: the same reader, a named error as the reason
    sb = _observe_in_child(tmp_path / "r", cert=str(cp))
    assert sb["state"] == "unknown" and words in sb["reason"]
    with pytest.raises(omok.CertFileRefused):
        omok.read_cert_file(str(cp))


def test_status_text_shows_the_sha1_mokmanager_shows(roots, certs):
    """MokManager's 'View key' prints the SHA-1 fingerprint: the text status shows it beside the SHA-256."""
    r = _cli("--root", str(roots["not-enrolled"][0]), "mok", "status")
    assert "Traceback" not in r.stderr
    der = certs["ours"]
    sha256 = [ln.split() for ln in r.stdout.splitlines() if ln.strip().startswith("sha256:")]
    assert sha256 == [["sha256:", hashlib.sha256(der).hexdigest()]], r.stdout
    sha1 = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("sha1:")]
    assert len(sha1) == 1 and hashlib.sha1(der).hexdigest() in sha1[0] and "MokManager" in sha1[0], r.stdout


@pytest.mark.parametrize("name", ["efivarfs-unmounted", "moklist-truncated", "secureboot-value-2"])
def test_unknown_status_gives_the_real_next_step(roots, name):
    """In the unknown state `mok status` names what to do (mount efivarfs, check the firmware), not itself."""
    r = _cli("--root", str(roots[name][0]), "mok", "status")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    remedy = next(ln for ln in r.stdout.splitlines() if ln.startswith("Remedy:"))
    assert "mok status" not in remedy, remedy
    assert "'sudo mount -t efivarfs efivarfs /sys/firmware/efi/efivars'" in remedy and "firmware" in remedy


def test_enroll_dry_run_requests_nothing(roots, certs):
    """`mok enroll --dry-run` prints the mokutil commands and the fingerprints, asks no password (stdin is
    empty and no TTY), calls nothing (the real runner, spied: no command at all), and refuses with the real
    run's named errors; `mok cancel --dry-run` likewise."""
    ran = []

    class Spy(Runner):      # the real runner, recording every command it is asked to run
        def run(self, argv, **kw):
            ran.append(list(argv))
            return super().run(argv, **kw)

    plan = enroll.plan_enrollment(Host(roots["not-enrolled"][0], runner=Spy()), None, console_timeout=300)
    assert plan["would_run"][1] == ["mokutil", "--timeout", "300"] and plan["console_timeout"] == 300
    plan = enroll.plan_cancel(Host(roots["pending-enroll"][0], runner=Spy()))
    assert plan["pending"] and plan["would_run"] == [["mokutil", "--revoke-import"]]
    assert ran == []

    def cli(*args):
        return _cli(*args, input="")
    root = str(roots["not-enrolled"][0])
    r = cli("--root", root, "mok", "enroll", "--dry-run", "--console-timeout", "300")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mokutil --ignore-keyring --import" in r.stdout and "mokutil --timeout 300" in r.stdout
    assert hashlib.sha1(certs["ours"]).hexdigest() in r.stdout and "Nothing was changed" in r.stdout
    assert "password" not in r.stderr.lower()
    doc = json.loads(cli("--root", root, "mok", "enroll", "--dry-run", "--json").stdout)
    assert doc["dry_run"] is True and doc["state_now"] == "not-enrolled" and doc["state_after"] == "pending-enroll"
    assert doc["would_run"][0][:2] == ["mokutil", "--ignore-keyring"] and len(doc["would_run"]) == 1
    for name, code in {"enrolled-among-lists": "mok-already-enrolled", "moklist-truncated": "secure-boot-unknown",
                       "no-key": "mok-no-key"}.items():
        r = cli("--root", str(roots[name][0]), "mok", "enroll", "--dry-run", "--json")
        assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == code, (name, r.stdout)
    r = cli("--root", root, "mok", "enroll", "--dry-run", "--wait-at-console", "--console-timeout", "5")
    assert r.returncode == 2 and "mok-bad-timeout" in r.stderr
    # cancel: pending -> would run --revoke-import; nothing pending -> says so
    r = cli("--root", str(roots["pending-enroll"][0]), "mok", "cancel", "--dry-run")
    assert r.returncode == 0 and "mokutil --revoke-import" in r.stdout and "Nothing was changed" in r.stdout
    r = cli("--root", root, "mok", "cancel", "--dry-run")
    assert r.returncode == 0 and "nothing to cancel" in r.stdout.lower() and "revoke" not in r.stdout
