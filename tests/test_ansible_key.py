"""The role's fleet signing key (ansible/roles/spark_memsaver/tasks/signing_key.yml, issue 35 item 9).

Debian's ansible-playbook runs the role's key tasks unchanged (``import_role: tasks_from``) on localhost, with
the key, certificate and config.yaml paths under a test directory. Shown: the key's directory is created
root-only when absent and never changed when it exists (a shared /etc/ssl/private-like directory keeps its mode
and group; one that others can write to is refused); a rotation keeps the previous key and certificate as dated
copies, restarts the daemon and rebuilds and re-signs our module for the kernel that has it; a key that does not
match its certificate is refused before anything is written.

What stands in: ``systemctl`` (no systemd runs as PID 1 here: it answers ``show`` for a loaded unit and logs
each call) and the module build itself: ``spark-memsaver`` on the play's PATH is the checkout's real CLI with
``--root`` at a Spark fixture root whose override is ours (tests/support/sparkroot.py), logging each call;
``build``/``install`` run as their ``--dry-run`` (the plan of that build: a fixture root has no kernel tree to
build against).

SPARK_MEMSAVER_TEST_ROLES=DIR runs these against another copy of the roles (the previous role fails them).
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support import needs, sparkroot

pytestmark = pytest.mark.slow      # eight ansible-playbook runs (~1 min)

REPO = Path(__file__).resolve().parent.parent
K = sparkroot.SPARK_KERNEL

PLAY = """
- name: The fleet signing key alone
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Key
      ansible.builtin.import_role:
        name: spark_memsaver
        tasks_from: signing_key.yml
"""


def _pair(d: Path, name: str) -> tuple[str, str]:
    d.mkdir(parents=True, exist_ok=True)
    subprocess.run(["openssl", "req", "-new", "-x509", "-nodes", "-days", "3650", "-subj", f"/CN=test fleet {name}",
                    "-newkey", "rsa:2048", "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.crt"),
                    "-addext", "extendedKeyUsage=codeSigning"], check=True, capture_output=True)
    return (d / f"{name}.key").read_text(), (d / f"{name}.crt").read_text()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    needs.require("openssl", remedy="tools/deps/base.txt")
    d = tmp_path_factory.mktemp("pairs")
    return {"a": _pair(d, "a"), "b": _pair(d, "b")}


class Node:
    def __init__(self, tmp: Path):
        needs.require("ansible-playbook", remedy="apt-get install ansible-core (tools/deps/ops.txt)")
        self.tmp = tmp
        self.etc = tmp / "etc"
        self.key_dir = self.etc / "spark-memsaver/private"
        self.key = self.key_dir / "fleet-signing.key"
        self.cert = self.etc / "spark-memsaver/fleet-signing.crt"
        self.config = self.etc / "spark-memsaver/config.yaml"
        self.calls = tmp / "calls.log"
        root = sparkroot.make_spark_root(tmp / "root", ours_installed="580.142")
        self.bin = tmp / "bin"
        self.bin.mkdir()
        (self.bin / "spark-memsaver").write_text(
            f"#!/bin/sh\nprintf 'spark-memsaver %s\\n' \"$*\" >> {self.calls}\n"
            f"case $1 in build | install) set -- \"$@\" --dry-run ;; esac\n"
            f"PYTHONPATH={REPO / 'daemon'} exec /usr/bin/python3 -m spark_memsaver --root {root} \"$@\"\n")
        (self.bin / "systemctl").write_text(
            f"#!/bin/sh\nprintf 'systemctl %s\\n' \"$*\" >> {self.calls}\n"
            "case $1 in show) u=$2; printf 'Id=%s\\nLoadState=loaded\\nActiveState=active\\nSubState=running\\n"
            "UnitFileState=enabled\\n' \"${u#\\'}\" ;; is-active) echo active ;; is-enabled) echo enabled ;; esac\n"
            "exit 0\n")
        for f in ("spark-memsaver", "systemctl"):
            (self.bin / f).chmod(0o755)
        (tmp / "play.yml").write_text(PLAY)

    def play(self, key: str, cert: str, **extra) -> subprocess.CompletedProcess:
        v = {"spark_memsaver_signing_key": key, "spark_memsaver_signing_cert": cert,
             "spark_memsaver_signing_key_path": str(extra.pop("key_path", self.key)),
             "spark_memsaver_signing_cert_path": str(self.cert), "spark_memsaver_config_path": str(self.config),
             "ansible_python_interpreter": "/usr/bin/python3", **extra}
        (self.tmp / "vars.yml").write_text(yaml.safe_dump(v))
        env = dict(os.environ, ANSIBLE_ROLES_PATH=os.environ.get("SPARK_MEMSAVER_TEST_ROLES") or str(REPO / "ansible/roles"), ANSIBLE_NOCOLOR="1",
                   ANSIBLE_LOCAL_TEMP=str(self.tmp / "at"), ANSIBLE_HOME=str(self.tmp / "ah"),
                   ANSIBLE_LOCALHOST_WARNING="False", ANSIBLE_INVENTORY_UNPARSED_WARNING="False",
                   PATH=f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}")
        if self.calls.exists():
            self.calls.unlink()
        return subprocess.run(["ansible-playbook", "-i", "localhost,", str(self.tmp / "play.yml"), "-e",
                               f"@{self.tmp / 'vars.yml'}"], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=300, env=env)

    def called(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


def _ok(r):
    assert r.returncode == 0, "\n".join((r.stdout + r.stderr).splitlines()[-40:])
    assert "BEGIN PRIVATE KEY" not in r.stdout + r.stderr      # no_log: the key never shows


def _changed(r) -> int:
    import re
    return int(re.search(r"changed=(\d+)", r.stdout.split("PLAY RECAP", 1)[1]).group(1))


def _mode(p: Path) -> str:
    return oct(stat.S_IMODE(p.stat().st_mode))


def test_new_key_then_the_same_then_a_rotation_keeps_the_previous_and_resigns(tmp_path, pairs):
    n = Node(tmp_path)
    r = n.play(*pairs["a"])
    _ok(r)
    assert _mode(n.key_dir) == "0o700" and n.key_dir.stat().st_uid == 0         # absent: created root-only
    assert _mode(n.key) == "0o600" and n.key.read_text().strip() == pairs["a"][0].strip()
    assert f"signing_key: {n.key}\n" in n.config.read_text()
    assert not [c for c in n.called() if c.startswith("spark-memsaver build")]   # nothing to re-sign yet
    # the same key again: nothing changes, nothing is restarted or rebuilt
    r = n.play(*pairs["a"])
    _ok(r)
    assert _changed(r) == 0 and n.called() == [], n.called()
    # a rotation: the new pair installed, the previous kept (dated, root-only), the daemon restarted, then our
    # module rebuilt and installed for the kernel that has it (DKMS signs it with the new key)
    r = n.play(*pairs["b"])
    _ok(r)
    assert n.key.read_text().strip() == pairs["b"][0].strip()
    old_keys = [p for p in n.key_dir.iterdir() if p.name.startswith("fleet-signing.key.")]
    assert len(old_keys) == 1 and old_keys[0].read_text().strip() == pairs["a"][0].strip(), old_keys
    assert _mode(old_keys[0]) == "0o600" and old_keys[0].stat().st_uid == 0
    old_certs = [p for p in n.cert.parent.iterdir() if p.name.startswith("fleet-signing.crt.")]
    assert len(old_certs) == 1 and old_certs[0].read_text().strip() == pairs["a"][1].strip()
    calls = n.called()
    assert calls.index("systemctl restart spark-memsaverd.service") \
        < calls.index(f"spark-memsaver build --force --kernel {K}") \
        < calls.index(f"spark-memsaver install --kernel {K}"), calls


def test_an_existing_directory_is_never_changed(tmp_path, pairs):
    """A shared key directory (like /etc/ssl/private: 0710 root:ssl-cert) keeps its mode and group; one that
    others can write to is refused with nothing written."""
    n = Node(tmp_path)
    shared = tmp_path / "ssl/private"
    shared.mkdir(parents=True)
    os.chmod(shared, 0o710)
    os.chown(shared, 0, 100)
    r = n.play(*pairs["a"], key_path=shared / "fleet.key")
    _ok(r)
    assert _mode(shared) == "0o710" and shared.stat().st_gid == 100
    assert _mode(shared / "fleet.key") == "0o600"
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    r = n.play(*pairs["a"], key_path=loose / "fleet.key")
    assert r.returncode != 0 and "the role never changes an existing" in r.stdout, r.stdout[-2000:]
    assert _mode(loose) == "0o777" and not (loose / "fleet.key").exists()


def test_a_key_that_does_not_match_its_certificate_is_refused(tmp_path, pairs):
    n = Node(tmp_path)
    r = n.play(pairs["a"][0], pairs["b"][1])
    assert r.returncode != 0 and "are not one key pair" in r.stdout, r.stdout[-2000:]
    assert "BEGIN PRIVATE KEY" not in r.stdout + r.stderr
    assert not n.key_dir.exists() and not n.cert.exists() and not n.config.exists()
    # after a good pair, a mismatched rotation leaves the installed pair as it was
    _ok(n.play(*pairs["a"]))
    r = n.play(pairs["b"][0], pairs["a"][1])
    assert r.returncode != 0 and n.key.read_text().strip() == pairs["a"][0].strip()
    assert not [p for p in n.key_dir.iterdir() if p.name != "fleet-signing.key"]
