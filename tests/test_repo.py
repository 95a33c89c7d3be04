"""First contact and the signed APT repository, in real Debian containers (tests/support/nspawn.py).

- The README's first command, ``tools/run`` as root, on a node as a minimal Debian 12 / 13 install leaves it
  (debootstrap minbase + systemd + dbus: no sudo, no cpio, no compiler, no dpkg-dev).
- ``packaging/build-repo``: a reprepro repository signed with a key made on first use, served over loopback
  HTTP, added on a clean container with ``Signed-By``; ``apt install``, ``apt upgrade`` to a newer build,
  ``apt remove``; and apt refusing the same repository under another key.

What stands in for what: the containers share this machine's kernel and have no NVIDIA driver, so the package
settles at ``not-applicable`` (that it says so, and why, is part of what is checked).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.support import needs, nspawn

pytestmark = [pytest.mark.package, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
PKG = "spark-memsaver"
UNIT = "spark-memsaverd.service"


def _need_containers():
    needs.containers()


def _tail(text: str, n: int = 30) -> str:
    return "\n".join((text or "").strip().splitlines()[-n:])


def checkout_copy(dst: Path, version: str | None = None) -> Path:
    """A copy of this checkout as a user gets it (tracked + untracked-but-not-ignored files, no .git).
    With ``version``, ``__version__`` is changed in the copy (a newer build for the upgrade test)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.split(b"\0")
    files = [f for f in files if f and not f.startswith((b"build/", b"debian/")) and (REPO / os.fsdecode(f)).exists()]
    dst.mkdir(parents=True, exist_ok=True)
    tar = subprocess.run(["tar", "-C", str(REPO), "--null", "--no-recursion", "-T", "-", "-cf", "-"],
                         input=b"\0".join(files), capture_output=True, check=True).stdout
    subprocess.run(["tar", "-C", str(dst), "-xpf", "-"], input=tar, check=True)
    if version is not None:
        init = dst / "daemon/spark_memsaver/__init__.py"
        text, n = re.subn(r'(?m)^__version__ = "[^"]*"', f'__version__ = "{version}"', init.read_text())
        assert n == 1, "no __version__ line in daemon/spark_memsaver/__init__.py"
        init.write_text(text)
    return dst


def code_version() -> str:
    m = re.search(r'(?m)^__version__ = "([^"]*)"', (REPO / "daemon/spark_memsaver/__init__.py").read_text())
    assert m
    return m.group(1)


def _status_json(c) -> dict:
    r = c.run(["spark-memsaver", "status", "--json"], check=False, timeout=120)
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"status --json is not JSON (rc={r.returncode}):\n{_tail(r.stdout)}\n{_tail(r.stderr)}")


def _dpkg_status(c, pkg=PKG) -> tuple[str, str]:
    r = c.run(["dpkg-query", "-W", "-f=${db:Status-Abbrev}|${Version}", pkg], check=False, timeout=30)
    if r.returncode != 0:
        return ("absent", "")
    abbrev, _, ver = r.stdout.partition("|")
    return abbrev.strip(), ver.strip()


# --------------------------------------------------------------------------------------------------
# 1. first contact: tools/run on a minimal node, as root, no sudo

@pytest.mark.parametrize("suite", ["bookworm", "trixie"])
def test_first_contact_tools_run_on_minimal_debian(suite, tmp_path):
    _need_containers()
    src = checkout_copy(tmp_path / "spark-memsaver")
    with nspawn.Container(suite, base=nspawn.MINIMAL_PACKAGES, boot_timeout=120) as c:
        # the node is as minimal as claimed: none of what build-deb used to need without saying so
        missing = c.sh("for t in sudo cpio gcc dpkg-buildpackage dpkg-checkbuilddeps git; do "
                       "command -v $t >/dev/null || echo $t; done", timeout=30).stdout.split()
        assert set(missing) == {"sudo", "cpio", "gcc", "dpkg-buildpackage", "dpkg-checkbuilddeps", "git"}, missing
        c.copy_in(src, "/root/spark-memsaver")
        t = time.monotonic()
        r = c.run(["/root/spark-memsaver/tools/run"], check=False, timeout=1500, cwd="/root/spark-memsaver")
        took = time.monotonic() - t
        print(f"first contact {suite}: tools/run rc={r.returncode} in {took:.0f}s\n{_tail(r.stdout, 15)}")
        assert "not found" not in r.stderr, f"a tool is missing:\n{_tail(r.stderr)}"
        abbrev, ver = _dpkg_status(c)
        assert abbrev == "ii" and ver == code_version(), (abbrev, ver, _tail(r.stderr))
        # tools/run ends with `spark-memsaver status`: the status screen, not a traceback
        assert "Traceback" not in r.stdout + r.stderr
        assert r.stdout.strip(), "tools/run printed no status"
        assert c.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active", c.journal(UNIT, 40)
        doc = _status_json(c)
        assert doc["state"] == "not-applicable", doc["state"]   # no NVIDIA driver in the container
        if suite != "bookworm":
            return
        # as a user: without sudo it says to run it as root; with sudo it re-runs itself through sudo
        c.sh("useradd -m tester && cp -a /root/spark-memsaver /opt/ && rm -rf /opt/spark-memsaver/build", timeout=60)
        r = c.run(["runuser", "-u", "tester", "--", "/opt/spark-memsaver/tools/run"], check=False, timeout=60)
        assert r.returncode == 2 and "needs root" in r.stderr, (r.returncode, r.stderr)
        c.run(["apt-get", "install", "-y", "-q", "sudo"], timeout=300)
        c.sh("echo 'tester ALL=(ALL) NOPASSWD: ALL' > /etc/sudoers.d/tester && chmod 0440 /etc/sudoers.d/tester")
        r = c.run(["runuser", "-u", "tester", "--", "/opt/spark-memsaver/tools/run"], check=False, timeout=900,
                  cwd="/tmp")
        assert r.returncode == 0 and "State:" in r.stdout, (r.returncode, _tail(r.stdout), _tail(r.stderr))
        assert _dpkg_status(c) == ("ii", code_version())


# --------------------------------------------------------------------------------------------------
# 2. the signed repository

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass


@contextlib.contextmanager
def serve(directory: Path, host: str = "127.0.0.1"):
    """A static HTTP server on a free loopback port for ``directory`` (what a release's static site is)."""
    srv = http.server.ThreadingHTTPServer((host, 0), functools.partial(_QuietHandler, directory=str(directory)))
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://{host}:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def build_repo(outdir: Path, keydir: Path, *args, cwd: Path = REPO, timeout=1500) -> subprocess.CompletedProcess:
    r = subprocess.run([str(cwd / "packaging/build-repo"), "--key-dir", str(keydir), *args, str(outdir)], cwd=cwd,
                       text=True, capture_output=True, timeout=timeout)
    assert r.returncode == 0, f"build-repo failed (rc={r.returncode}):\n{_tail(r.stdout)}\n{_tail(r.stderr)}"
    return r


@pytest.fixture(scope="module")
def keydir(tmp_path_factory) -> Path:
    needs.root("building the package needs root")
    needs.require("reprepro", "gpg", "dpkg-buildpackage", "dh", remedy="tools/deps/ops.txt, tools/deps/package.txt")
    d = tmp_path_factory.mktemp("repo-key") / "gnupg"
    yield d
    subprocess.run(["gpgconf", "--kill", "all"], env=dict(os.environ, GNUPGHOME=str(d)), capture_output=True)


def _add_repo(c, url: str, keyring_in_container: str, suite: str = "stable"):
    c.run(["sh", "-ec", "cat > /etc/apt/sources.list.d/spark-memsaver.sources"], input=(
        f"Types: deb\nURIs: {url}\nSuites: {suite}\nComponents: main\nSigned-By: {keyring_in_container}\n"))


def test_build_repo_layout_and_key_handling(tmp_path, keydir):
    out = tmp_path / "repo"
    r = build_repo(out, keydir, "--no-lintian", "--url", "http://example.invalid/spark")
    assert Path(r.stdout.strip().splitlines()[-1]) == out
    ver = code_version()
    assert (out / f"pool/main/s/{PKG}/{PKG}_{ver}_all.deb").is_file()
    inrel = (out / "dists/stable/InRelease").read_text()
    assert inrel.startswith("-----BEGIN PGP SIGNED MESSAGE-----") and "Codename: stable" in inrel
    for arch in ("amd64", "arm64"):
        pk = (out / f"dists/stable/main/binary-{arch}/Packages").read_text()
        assert f"Package: {PKG}\n" in pk and f"Version: {ver}\n" in pk
    # signature verifies with the exported public key alone (what apt's Signed-By does)
    v = subprocess.run(["gpgv", "--keyring", str(out / "spark-memsaver-archive-keyring.gpg"),
                        str(out / "dists/stable/InRelease")], capture_output=True, text=True)
    assert v.returncode == 0, v.stderr
    assert "PRIVATE KEY" not in (out / "spark-memsaver-archive-keyring.asc").read_text()
    assert "Signed-By: /usr/share/keyrings/spark-memsaver-archive-keyring.gpg" in (out / "spark-memsaver.sources").read_text()
    # the key lives outside the tree, root-only; nothing secret was written into OUTDIR or the checkout
    assert (keydir.stat().st_mode & 0o777) == 0o700
    assert not list(out.rglob("private-keys-v1.d")) and not list(out.rglob("*.key"))
    # a second run reuses the key (same fingerprint) and the same content is accepted again
    fpr1 = (out / "spark-memsaver-archive-keyring.gpg").read_bytes()
    build_repo(out, keydir, "--deb", str(out / f"pool/main/s/{PKG}/{PKG}_{ver}_all.deb"))
    assert (out / "spark-memsaver-archive-keyring.gpg").read_bytes() == fpr1
    # refused, with the remedy: the same version with other contents (apt would never fetch it)
    x = tmp_path / "x"
    subprocess.run(["dpkg-deb", "-R", str(out / f"pool/main/s/{PKG}/{PKG}_{ver}_all.deb"), str(x)], check=True)
    with open(x / f"usr/share/doc/{PKG}/README.md", "a") as f:
        f.write("changed\n")
    subprocess.run(["dpkg-deb", "-b", str(x), str(tmp_path / "x.deb")], check=True, capture_output=True)
    same = subprocess.run([str(REPO / "packaging/build-repo"), "--key-dir", str(keydir), "--deb",
                           str(tmp_path / "x.deb"), str(out)], capture_output=True, text=True)
    assert same.returncode == 1 and "bump __version__" in same.stderr, same.stderr
    # refused: a key directory inside OUTDIR or the checkout
    bad = subprocess.run([str(REPO / "packaging/build-repo"), "--key-dir", str(out / "k"), "--deb",
                          str(out / f"pool/main/s/{PKG}/{PKG}_{ver}_all.deb"), str(out)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "outside" in bad.stderr, bad.stderr


def test_repo_install_upgrade_remove_in_clean_container(tmp_path, keydir):
    _need_containers()
    out = tmp_path / "repo"
    times = {}
    t = time.monotonic()
    build_repo(out, keydir, "--no-lintian")
    times["build-repo"] = time.monotonic() - t
    ver1 = code_version()
    ver2 = ver1 + "+1"
    with serve(out) as url, nspawn.Container(boot_timeout=120) as c:
        c.copy_in(out / "spark-memsaver-archive-keyring.gpg", "/usr/share/keyrings/")
        _add_repo(c, url, "/usr/share/keyrings/spark-memsaver-archive-keyring.gpg")
        t = time.monotonic()
        c.run(["apt-get", "update", "-q"], timeout=300)
        pol = c.run(["apt-cache", "policy", PKG], timeout=60).stdout
        assert f"Candidate: {ver1}" in pol and url in pol, pol
        c.run(["apt-get", "install", "-y", "-q", PKG], timeout=900)
        times["apt install"] = time.monotonic() - t
        assert _dpkg_status(c) == ("ii", ver1)
        assert c.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active", c.journal(UNIT, 40)
        assert _status_json(c)["state"] == "not-applicable"
        assert c.exists("/usr/bin/spark-memsaver") and c.exists("/lib/systemd/system/" + UNIT)

        # a newer build, republished into the same repository
        t = time.monotonic()
        newer = checkout_copy(tmp_path / "newer", version=ver2)
        r = build_repo(out, keydir, "--no-lintian", cwd=newer)
        times["rebuild + republish"] = time.monotonic() - t
        pk = (out / "dists/stable/main/binary-arm64/Packages").read_text()
        assert f"Version: {ver2}\n" in pk and f"Version: {ver1}\n" not in pk
        t = time.monotonic()
        c.run(["apt-get", "update", "-q"], timeout=300)
        up = c.run(["apt-get", "upgrade", "-y", "-q"], timeout=900)
        times["apt upgrade"] = time.monotonic() - t
        assert _dpkg_status(c) == ("ii", ver2), up.stdout[-2000:]
        assert c.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active", c.journal(UNIT, 40)
        assert _status_json(c)["state"] == "not-applicable"

        t = time.monotonic()
        c.run(["apt-get", "remove", "-y", "-q", PKG], timeout=600)
        times["apt remove"] = time.monotonic() - t
        assert _dpkg_status(c)[0] in ("rc", "absent")
        assert not c.exists("/usr/bin/spark-memsaver")
        assert c.run(["systemctl", "is-active", UNIT], check=False).stdout.strip() != "active"
        assert not c.exists("/usr/share/spark-memsaver")
    print("repository flow: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()))


def test_apt_refuses_the_repo_under_another_key(tmp_path, keydir):
    """The signature is what protects the nodes: the same repository, Signed-By a different key, is refused."""
    _need_containers()
    out = tmp_path / "repo"
    build_repo(out, keydir, "--no-lintian")
    other = tmp_path / "other-key"
    other.mkdir(mode=0o700)
    env = dict(os.environ, GNUPGHOME=str(other))
    subprocess.run(["gpg", "--batch", "--passphrase", "", "--quick-generate-key", "someone else", "ed25519",
                    "sign", "1d"], env=env, check=True, capture_output=True)
    (tmp_path / "other.gpg").write_bytes(subprocess.run(["gpg", "--export"], env=env, check=True,
                                                        capture_output=True).stdout)
    subprocess.run(["gpgconf", "--kill", "all"], env=env, capture_output=True)
    with serve(out) as url, nspawn.Container(boot_timeout=120) as c:
        c.copy_in(tmp_path / "other.gpg", "/usr/share/keyrings/wrong.gpg")
        _add_repo(c, url, "/usr/share/keyrings/wrong.gpg")
        r = c.run(["apt-get", "update", "-q"], check=False, timeout=300)
        assert "NO_PUBKEY" in r.stdout + r.stderr or "not signed" in r.stdout + r.stderr, r.stdout + r.stderr
        pol = c.run(["apt-cache", "policy", PKG], check=False, timeout=60).stdout
        assert "Candidate: (none)" in pol or not pol.strip(), pol
