"""act/signing.py: the DKMS signing drop-in (defect 8 of issue 12) and the kernel-signs question (defect 13's
signing side).

Real parts: openssl makes the keys, bash itself sources the drop-in we write (as DKMS does for every module),
the kotool answers whether a kernel signs. The fixture root stands in for a host's /etc and /var only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from spark_memsaver import world
from spark_memsaver.act import signing
from spark_memsaver.config import Config
from spark_memsaver.host import Host
from tests.support import needs

pytestmark = pytest.mark.mok


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    key, crt = d / "k.key", d / "k.der"
    subprocess.run(["openssl", "req", "-new", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
                    "-subj", "/CN=test signing key", "-outform", "DER", "-keyout", str(key), "-out", str(crt)],
                   check=True, capture_output=True)
    return key.read_bytes(), crt.read_bytes()


def _root(tmp_path: Path, pair, key_path: str, cert_path: str, *, key_mode=0o600, cert: bytes | None = None) -> Path:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc/os-release").write_text("ID=debian\n")
    (root / "etc/dkms").mkdir(parents=True, exist_ok=True)
    (root / "etc/dkms/framework.conf").write_text("# DKMS framework\n")
    for rel, data, mode in ((key_path, pair[0], key_mode), (cert_path, pair[1] if cert is None else cert, 0o644)):
        p = root / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.chmod(p, mode)
    return root


def _cfg(key: str, cert: str) -> Config:
    return Config(source="/etc/spark-memsaver/config.yaml", signing_key=key, signing_cert=cert)


def _source_in_bash(dropin: Path, cwd: Path) -> list[str]:
    """What DKMS gets: bash sources the file, then the two variables are printed."""
    r = subprocess.run(["bash", "-c", 'set -eu; . "$1"; printf "%s\\n%s\\n" "$mok_signing_key" "$mok_certificate"',
                        "_", str(dropin)], capture_output=True, text=True, cwd=cwd, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.mark.parametrize("payload", ["$(touch {mark})", "`touch {mark}`", "'; touch {mark}; '",
                                     '"; touch {mark}; "', "${{IFS}}$(touch {mark})"])
def test_dropin_values_cannot_execute_when_bash_sources_them(tmp_path, pair, payload):
    mark = tmp_path / "pwned"
    key = f"/etc/keys/{payload.format(mark=mark)}/node.key"
    cert = "/etc/keys/node.der"
    root = _root(tmp_path, pair, key, cert)
    host = Host(str(root))
    res = signing.ensure(host, _cfg(key, cert))
    dropin = root / signing.DROPIN.lstrip("/")
    assert res["changes_global_signing"] and dropin.is_file()
    got = _source_in_bash(dropin, tmp_path)
    assert not mark.exists(), "sourcing the drop-in ran a command"
    assert got == [key, cert]
    # and our own reader agrees with bash
    s = signing.framework_settings(host)
    assert (s["mok_signing_key"][0], s["mok_certificate"][0]) == (key, cert)
    assert oct(dropin.stat().st_mode & 0o777) == "0o644"


def test_mok_status_reads_the_quoted_dropin_back(tmp_path, pair):
    """The MOK reader (observe/mok.py) and bash agree on a certificate path with a quote and a `$(...)` in it."""
    from spark_memsaver.observe import mok as omok

    mark = tmp_path / "pwned"
    key, cert = f"/etc/keys/$(touch {mark})/node.key", "/etc/keys/it's \"ours\"/node.der"
    root = _root(tmp_path, pair, key, cert)
    host = Host(str(root))
    signing.ensure(host, _cfg(key, cert))
    assert _source_in_bash(root / signing.DROPIN.lstrip("/"), tmp_path) == [key, cert]
    assert omok.dkms_signing_config(host)["mok_certificate"] == cert
    c = world.secure_boot(host)["certificate"]
    assert c["path"] == cert and c["present"] and c["origin"].startswith("mok_certificate in")
    assert not mark.exists()


def test_an_unparsable_certificate_is_refused_before_anything_is_written(tmp_path, pair):
    key, cert = "/etc/keys/node.key", "/etc/keys/node.der"
    root = _root(tmp_path, pair, key, cert, cert=b"not a certificate\n")
    dropin = root / signing.DROPIN.lstrip("/")
    with pytest.raises(signing.SigningError) as e:
        signing.ensure(Host(str(root)), _cfg(key, cert))
    assert "not a readable X.509 certificate" in e.value.message
    assert not dropin.exists()
    assert not (root / signing.RECORD.lstrip("/")).exists()


@pytest.mark.parametrize("bad,words", [
    ("/etc/keys/node\n.key", "control character U+000A"),
    ("/etc/keys/node\x1b[2J.key", "control character U+001B"),
    ("/etc/keys/node\u202e.key", "control character U+202E"),
    ("etc/keys/node.key", "not absolute"),
])
def test_bad_paths_are_refused_and_our_previous_dropin_is_removed(tmp_path, pair, bad, words):
    good_key, cert = "/etc/keys/node.key", "/etc/keys/node.der"
    root = _root(tmp_path, pair, good_key, cert)
    host = Host(str(root))
    dropin = root / signing.DROPIN.lstrip("/")
    signing.ensure(host, _cfg(good_key, cert))
    assert dropin.exists()                               # a drop-in of ours from an earlier, valid config
    if bad.startswith("/"):
        p = root / bad.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(pair[0])
        os.chmod(p, 0o600)
    with pytest.raises(signing.SigningPathRefused) as e:
        signing.ensure(host, _cfg(bad, cert))
    assert words in e.value.message and e.value.remedy
    assert not dropin.exists(), "a refusal must not leave our drop-in sourced"


@pytest.mark.parametrize("case", ["mode-0644", "not-root", "symlink", "missing"])
def test_key_file_must_be_root_owned_0600_regular(tmp_path, pair, case):
    key, cert = "/etc/keys/node.key", "/etc/keys/node.der"
    root = _root(tmp_path, pair, key, cert)
    kp = root / key.lstrip("/")
    if case == "mode-0644":
        os.chmod(kp, 0o644)
    elif case == "not-root":
        needs.root("chown needs root")
        os.chown(kp, 1000, 1000)
    elif case == "symlink":
        real = kp.with_name("real.key")
        kp.rename(real)
        kp.symlink_to("real.key")
    else:
        kp.unlink()
    with pytest.raises(signing.SigningError) as e:
        signing.ensure(Host(str(root)), _cfg(key, cert))
    assert {"mode-0644": "readable by group or others", "not-root": "not root", "symlink": "not a regular file",
            "missing": "node.key does not"}[case] in e.value.message
    assert type(e.value).__name__ in ("SigningKeyUnsafe", "SigningKeyIncomplete")
    assert not (root / signing.DROPIN.lstrip("/")).exists()


def test_conflicting_later_dropin_is_refused_before_writing(tmp_path, pair):
    key, cert = "/etc/keys/node.key", "/etc/keys/node.der"
    root = _root(tmp_path, pair, key, cert)
    later = root / "etc/dkms/framework.conf.d/zz-other.conf"
    later.parent.mkdir(parents=True, exist_ok=True)
    later.write_text('mok_signing_key="/root/other.key"\nmok_certificate="/root/other.der"\n')
    with pytest.raises(signing.SigningConfigConflict):
        signing.ensure(Host(str(root)), _cfg(key, cert))
    assert not (root / signing.DROPIN.lstrip("/")).exists()


@pytest.mark.parametrize("config_text,expect", [
    ("CONFIG_MODULE_SIG=y\n", True),
    ("# CONFIG_MODULE_SIG is not set\n", False),
    ("CONFIG_LOCALVERSION=\"\"\n", signing.KernelSigningUnknown),
    (None, signing.KernelSigningUnknown),
])
def test_kernel_signs_is_never_a_guess(tmp_path, config_text, expect):
    kernel = "6.17.0-1014-nvidia-64k"
    root = tmp_path / "root"
    (root / "boot").mkdir(parents=True)
    if config_text is not None:
        (root / f"boot/config-{kernel}").write_text(config_text)
    host = Host(str(root))
    if expect is signing.KernelSigningUnknown:
        with pytest.raises(signing.KernelSigningUnknown) as e:
            signing.kernel_signs(host, kernel)
        assert f"linux-headers-{kernel}" in e.value.remedy
    else:
        assert signing.kernel_signs(host, kernel) is expect


def test_bash_is_real():
    assert shutil.which("bash")


@pytest.mark.parametrize("live", [False, True])
@pytest.mark.parametrize("config", ["missing", "neither", "unreadable"])
def test_build_signing_question_is_named_never_unsigned(tmp_path, monkeypatch, config, live):
    """act/build.py's _signing_for asks act/signing.kernel_signs for a --root host AND the live one: a kernel
    config that cannot be read (absent, saying neither, a .config that is a directory) is KernelSigningUnknown
    with a remedy naming the headers. Before: --root built UNSIGNED on a guess (CONFIG_MODULE_SIG != "y"), the
    live host let the kotool's KernelConfigUnreadable escape as an internal error."""
    from spark_memsaver.act import build
    kernel = "6.17.0-1014-nvidia-64k"
    root = tmp_path / "root"
    (root / "boot").mkdir(parents=True)
    (root / f"lib/modules/{kernel}/build").mkdir(parents=True)
    if config == "neither":
        (root / f"boot/config-{kernel}").write_text("CONFIG_LOCALVERSION=\"\"\n")
    elif config == "unreadable":
        (root / f"lib/modules/{kernel}/build/.config").mkdir()
    if live:                       # the live host's kotool reads under $SPARK_MEMSAVER_KOTOOL_ROOT
        monkeypatch.setenv("SPARK_MEMSAVER_KOTOOL_ROOT", str(root))
        host = Host("/")
        assert host.is_live
    else:
        host = Host(str(root))
    with pytest.raises(signing.KernelSigningUnknown) as e:
        build._signing_for(host, None, kernel)
    assert e.value.code == "kernel-signing-unknown"
    assert f"linux-headers-{kernel}" in e.value.remedy
    # and a config that says "not set" is the one way to "does not sign"
    (root / f"boot/config-{kernel}").write_text("# CONFIG_MODULE_SIG is not set\n")
    if config == "unreadable":
        (root / f"lib/modules/{kernel}/build/.config").rmdir()
    assert build._signing_for(host, None, kernel)["applies"] is False


# --- purge and remove leave DKMS's signing as they found it (issue 35 item 2) ------------------------------

POSTRM = Path(__file__).resolve().parent.parent / "packaging/debian/spark-memsaver.postrm"
FLEET_KEY, FLEET_CERT = "/etc/spark-memsaver/private/fleet-signing.key", "/etc/spark-memsaver/fleet-signing.crt"


def _postrm(root: Path, action: str) -> subprocess.CompletedProcess:
    """The package's postrm as dpkg runs it for ``action``, under dpkg's root prefix ($DPKG_ROOT)."""
    r = subprocess.run(["sh", str(POSTRM), action], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, DPKG_ROOT=str(root)))
    assert r.returncode == 0, r.stderr
    return r


def _fleet_root(tmp_path: Path, pair) -> tuple[Path, Host]:
    """The Ansible role's layout: a fleet key under /etc/spark-memsaver/private, our drop-in pointing at it
    (written by act/signing.py, as a build does), DKMS's own default pair beside, another module's drop-in."""
    root = _root(tmp_path, pair, FLEET_KEY, FLEET_CERT)
    for rel, data, mode in (("var/lib/dkms/mok.key", pair[0], 0o600), ("var/lib/dkms/mok.pub", pair[1], 0o644)):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        os.chmod(root / rel, mode)
    other = root / "etc/dkms/framework.conf.d/10-other.conf"
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_text("sign_file=/usr/lib/linux-kbuild-6.1/scripts/sign-file\n")
    host = Host(str(root))
    res = signing.ensure(host, _cfg(FLEET_KEY, FLEET_CERT))
    assert res["changes_global_signing"] and (root / signing.DROPIN.lstrip("/")).is_file()
    return root, host


def test_purge_takes_our_dkms_dropin_with_the_fleet_key(tmp_path, pair):
    """apt purge deletes /etc/spark-memsaver (and the fleet key in private/): our framework.conf.d drop-in,
    which names that key for EVERY DKMS module, goes with it, and DKMS signs with its own default again
    (before: the drop-in stayed, and DKMS 3.0.10, unable to make a key in the missing directory, built every
    module unsigned). Another module's drop-in and DKMS's own key are untouched."""
    root, host = _fleet_root(tmp_path, pair)
    r = _postrm(root, "purge")
    assert not (root / "etc/spark-memsaver").exists()
    assert not (root / signing.DROPIN.lstrip("/")).exists(), "our drop-in outlived the key it names"
    assert "DKMS signs modules with its own default key again" in r.stderr
    assert (root / "etc/dkms/framework.conf.d/10-other.conf").read_text().startswith("sign_file=")
    assert (root / "var/lib/dkms/mok.key").is_file() and (root / "var/lib/dkms/mok.pub").is_file()
    # what DKMS sources now (bash, as DKMS does): no signing key of ours is named anywhere
    conf = root / "etc/dkms"
    r = subprocess.run(["bash", "-c", 'for f in "$1/framework.conf" "$1"/framework.conf.d/*.conf; do . "$f"; done; '
                        'printf "%s|%s" "${mok_signing_key:-}" "${mok_certificate:-}"', "_", str(conf)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout == "|", r.stdout + r.stderr
    p = signing.plan(host, Config())
    assert (p["key"], p["cert"], p["needs_dropin"]) == (signing.DKMS_KEY, signing.DKMS_CERT, False)


def test_remove_keeps_our_dropin_while_its_key_exists_and_drops_it_when_gone(tmp_path, pair):
    """apt remove keeps configuration (the fleet key stays, so the drop-in still names a usable key and DKMS
    keeps signing other modules with the enrolled key); one whose key or certificate is gone is removed."""
    root, host = _fleet_root(tmp_path, pair)
    dropin = root / signing.DROPIN.lstrip("/")
    _postrm(root, "remove")
    assert dropin.is_file() and (root / FLEET_KEY.lstrip("/")).is_file()
    (root / FLEET_KEY.lstrip("/")).unlink()
    _postrm(root, "remove")
    assert not dropin.exists()
    # a drop-in someone else wrote under our name is never removed (only a file with our mark)
    dropin.write_text("mok_signing_key=/nowhere/k.key\nmok_certificate=/nowhere/k.der\n")
    _postrm(root, "purge")
    assert dropin.is_file()
