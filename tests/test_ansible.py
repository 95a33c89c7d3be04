"""The Ansible rollout (ansible/) against three Debian nodes: systemd-nspawn containers with sshd, reached over
SSH as root on 127.0.0.2-4 with a key made for this test, the signed repository of packaging/build-repo served
over loopback HTTP. Debian's ansible-core and ansible-lint.

Shown: ansible-lint is clean; a rollout whose verdict is refused stops at the first node (the others stay
untouched); install -> a second install with changed=0 -> status table (one row per node) -> rollback -> a
second rollback with changed=0; status fails when a node disagrees; uninstall.

What stands in for what: the nodes share this machine's kernel and have no NVIDIA driver, so the accepted
state is ``not-applicable`` (``spark_memsaver_ok_states``) and the running kernel (this machine's) has no
headers package in Debian's archive (``spark_memsaver_headers: optional``: the role's lookup runs and says so).
The Secure Boot step needs EFI firmware; here ``mok status`` says ``not-needed`` and the step is skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.support import needs, nspawn
from tests.test_repo import PKG, build_repo, serve

pytestmark = [pytest.mark.package, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
ANSIBLE = REPO / "ansible"
ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
NODE_EXTRA = ("openssh-server", "python3-apt")


def _need(tool: str, pkg: str) -> str:
    needs.require(tool, remedy=f"apt-get install {pkg}; tools/deps/ops.txt")
    return needs.which(tool)


def test_ansible_lint_clean():
    lint = _need("ansible-lint", "ansible-lint")
    r = subprocess.run([lint, "--nocolor", "-p"], cwd=ANSIBLE, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, ANSIBLE_LOCAL_TEMP="/tmp", NO_COLOR="1"))
    assert r.returncode == 0, r.stdout + r.stderr


def _recap(out: str) -> dict[str, dict[str, int]]:
    rec = {}
    for m in re.finditer(r"^(\S+)\s*:\s*((?:\w+=\d+\s*)+)$", out.split("PLAY RECAP", 1)[-1], re.M):
        rec[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return rec


class Fleet:
    def __init__(self, tmp: Path, nodes, url: str, keyring: Path):
        self.tmp = tmp
        self.nodes = nodes
        key = tmp / "id_ed25519"
        inv = {"spark": {"hosts": {f"node{i + 1}": {"ansible_host": a} for i, a in enumerate(ADDRESSES)},
                         "vars": {
                             "ansible_user": "root",
                             "ansible_ssh_private_key_file": str(key),
                             "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null",
                             "ansible_python_interpreter": "/usr/bin/python3",
                             "spark_memsaver_repo_url": url,
                             "spark_memsaver_repo_keyring": str(keyring),
                             "spark_memsaver_headers": "optional",
                             "spark_memsaver_ok_states": ["not-applicable"],
                             "spark_memsaver_verdict_delay": 2,
                         }}}
        self.inventory = tmp / "inventory.yml"
        self.inventory.write_text(yaml.safe_dump(inv))
        self.times: dict[str, float] = {}

    def play(self, name: str, playbook: str, *extra: str, label: str | None = None) -> subprocess.CompletedProcess:
        env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
                   ANSIBLE_LOCAL_TEMP=str(self.tmp / "ansible-tmp"), ANSIBLE_HOME=str(self.tmp / "ansible-home"),
                   ANSIBLE_SSH_CONTROL_PATH_DIR=str(self.tmp / "cp"), ANSIBLE_HOST_KEY_CHECKING="False")
        t = time.monotonic()
        r = subprocess.run(["ansible-playbook", "-i", str(self.inventory), playbook, *extra], cwd=ANSIBLE, env=env,
                           capture_output=True, text=True, timeout=1200)
        self.times[label or name] = time.monotonic() - t
        (self.tmp / f"{label or name}.log").write_text(r.stdout + r.stderr)
        return r

    def dpkg(self, i: int) -> str:
        r = self.nodes[i].run(["dpkg-query", "-W", "-f=${db:Status-Abbrev}", PKG], check=False, timeout=30)
        return r.stdout.strip() if r.returncode == 0 else "absent"


def _ok(r, what):
    assert r.returncode == 0, f"{what} failed (rc={r.returncode}):\n" + "\n".join((r.stdout + r.stderr).splitlines()[-60:])


KEY_PATH = "/etc/spark-memsaver/private/fleet-signing.key"
CERT_PATH = "/etc/spark-memsaver/fleet-signing.crt"


def _fleet_key_vault(tmp: Path) -> list[str]:
    """A fleet key pair made here, in an ansible-vault encrypted vars file; the extra ansible-playbook args."""
    d = tmp / "fleet"
    d.mkdir(mode=0o700)
    subprocess.run(["openssl", "req", "-new", "-x509", "-nodes", "-days", "3650", "-subj",
                    "/CN=spark-memsaver test fleet key", "-newkey", "rsa:2048", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem"), "-addext", "extendedKeyUsage=codeSigning"],
                   check=True, capture_output=True)
    (d / "vault.yml").write_text(yaml.safe_dump({"spark_memsaver_signing_key": (d / "key.pem").read_text(),
                                                 "spark_memsaver_signing_cert": (d / "cert.pem").read_text()}))
    (d / "pw").write_text("test vault password\n")
    subprocess.run(["ansible-vault", "encrypt", "--vault-password-file", str(d / "pw"), str(d / "vault.yml")],
                   check=True, capture_output=True, env=dict(os.environ, ANSIBLE_LOCAL_TEMP=str(tmp / "vt")))
    assert b"$ANSIBLE_VAULT" in (d / "vault.yml").read_bytes()[:20]
    return ["--vault-password-file", str(d / "pw"), "-e", f"@{d / 'vault.yml'}"]


def _check_fleet_key(tmp: Path, nodes) -> str:
    """The key on each node: root-only 0600, the Vault's bytes, named in config.yaml, and what status reads."""
    import hashlib
    import json
    d = tmp / "fleet"
    der = subprocess.run(["openssl", "x509", "-in", str(d / "cert.pem"), "-outform", "DER"], check=True,
                         capture_output=True).stdout
    fp = hashlib.sha256(der).hexdigest()
    for c in nodes:
        assert c.run(["stat", "-c", "%a %U %G %F", KEY_PATH], timeout=30).stdout.split() == \
            ["600", "root", "root", "regular", "file"]
        assert c.run(["stat", "-c", "%a", os.path.dirname(KEY_PATH)], timeout=30).stdout.strip() == "700"
        assert c.read_text(KEY_PATH).strip() == (d / "key.pem").read_text().strip()
        conf = c.read_text("/etc/spark-memsaver/config.yaml")
        assert f"\nsigning_key: {KEY_PATH}\n" in "\n" + conf and f"\nsigning_cert: {CERT_PATH}\n" in "\n" + conf
        doc = json.loads(c.run(["spark-memsaver", "status", "--json"], check=False, timeout=120).stdout)
        cert = doc["secure_boot"]["certificate"]
        assert cert["path"] == CERT_PATH and cert["origin"] == "config signing_cert" and cert["sha256"] == fp, cert
    return fp


def test_three_node_rollout_status_rollback(tmp_path):
    needs.containers()
    _need("ansible-playbook", "ansible-core")
    _need("ssh", "openssh-client")
    keydir = tmp_path / "repo-key"
    out = tmp_path / "repo"
    t0 = time.monotonic()
    build_repo(out, keydir, "--no-lintian")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "spark-memsaver test only",
                    "-f", str(tmp_path / "id_ed25519")], check=True)
    pub = (tmp_path / "id_ed25519.pub").read_text()
    try:
        with serve(out) as url, nspawn.containers(3, extra=NODE_EXTRA, boot_timeout=120) as nodes:
            for c, addr in zip(nodes, ADDRESSES):
                c.start_sshd(addr, pub)
            setup = time.monotonic() - t0
            f = Fleet(tmp_path, nodes, url, out / "spark-memsaver-archive-keyring.gpg")

            # 1. a verdict the node cannot meet: the rollout stops at node1; node2 and node3 are untouched
            r = f.play("refused", "install.yml", "-e", '{"spark_memsaver_ok_states": ["active"]}')
            assert r.returncode != 0, r.stdout[-3000:]
            assert "node1 is not-applicable (accepted: active)" in r.stdout, r.stdout[-3000:]
            assert f.dpkg(0) == "ii" and f.dpkg(1) == "absent" and f.dpkg(2) == "absent"
            rec = _recap(r.stdout)
            assert rec["node1"]["failed"] == 1 and "node2" not in rec and "node3" not in rec, rec

            # 2. the rollout with the fleet signing key from Vault, then again: nothing changes the second time
            vault = _fleet_key_vault(tmp_path)
            r = f.play("install", "install.yml", *vault)
            _ok(r, "install.yml")
            rec = _recap(r.stdout)
            assert set(rec) == {"node1", "node2", "node3"} and all(v["failed"] == 0 for v in rec.values()), rec
            assert rec["node2"]["changed"] > 0 and rec["node3"]["changed"] > 0, rec
            assert [f.dpkg(i) for i in range(3)] == ["ii"] * 3
            assert "is not available: the node stays stock" in r.stdout  # the headers lookup ran
            for c in nodes:
                assert c.read_text("/etc/apt/sources.list.d/spark-memsaver.sources").count(f"URIs: {url}") == 1
                assert c.run(["systemctl", "is-active", "spark-memsaverd.service"], check=False).stdout.strip() == "active"
            fp = _check_fleet_key(tmp_path, nodes)
            stamps = [nodes[i].run(["stat", "-c", "%i %Y", KEY_PATH], timeout=30).stdout for i in range(3)]
            r = f.play("install", "install.yml", *vault, label="install again")
            _ok(r, "install.yml (second run)")
            rec = _recap(r.stdout)
            assert all(v["changed"] == 0 and v["failed"] == 0 for v in rec.values()), rec
            # reused: the same file (inode, mtime) and the same certificate on every node
            assert [nodes[i].run(["stat", "-c", "%i %Y", KEY_PATH], timeout=30).stdout for i in range(3)] == stamps
            assert _check_fleet_key(tmp_path, nodes) == fp

            # 3. the status table
            r = f.play("status", "status.yml")
            _ok(r, "status.yml")
            rows = [l.strip().strip('",') for l in r.stdout.splitlines() if re.search(r'"(HOST|spark-test|node\d)\s', l)]
            assert rows[0].split()[:3] == ["HOST", "STATE", "DRIVER"], rows
            body = rows[1:]
            assert len(body) == 3 and all(l.split()[1] == "not-applicable" for l in body), rows
            assert rows[0].split()[-5:] == ["BOOT", "SIGNING", "CERTIFICATE", "SHA-256", "TRUSTED"], rows
            # the fleet certificate on every node; these nodes share the test machine's kernel, which does not
            # trust it (it is in none of its keyrings): "no"
            assert all(l.split()[-3:] == ["not-needed", fp, "no"] for l in body), rows
            assert "3 nodes agree: driver -" in r.stdout
            print("\n".join(rows))

            # 4. rollback, twice
            r = f.play("rollback", "rollback.yml")
            _ok(r, "rollback.yml")
            r = f.play("rollback", "rollback.yml", label="rollback again")
            _ok(r, "rollback.yml (second run)")
            rec = _recap(r.stdout)
            assert set(rec) == {"node1", "node2", "node3"} and all(v["changed"] == 0 for v in rec.values()), rec

            # 5. a node that disagrees (here: its package removed by hand) fails the status playbook
            nodes[2].run(["apt-get", "remove", "-y", "-q", PKG], timeout=600)
            r = f.play("status", "status.yml", label="status (node3 differs)")
            assert r.returncode != 0 and "The nodes disagree" in r.stdout, r.stdout[-3000:]
            assert re.search(r'"node3\s+unreachable\s', r.stdout), r.stdout[-3000:]

            # 6. uninstall everywhere
            r = f.play("rollback", "rollback.yml", "-e", "spark_memsaver_uninstall=true", label="uninstall")
            _ok(r, "rollback.yml -e spark_memsaver_uninstall=true")
            assert [f.dpkg(i) for i in range(3)] == ["rc"] * 2 + [f.dpkg(2)] and f.dpkg(2) in ("rc", "absent")
            for c in nodes:
                assert not c.exists("/etc/apt/sources.list.d/spark-memsaver.sources")
        print(f"setup (repo, key, 3 nodes with sshd) {setup:.0f}s; "
              + ", ".join(f"{k} {v:.0f}s" for k, v in f.times.items()))
    finally:
        subprocess.run(["gpgconf", "--kill", "all"], env=dict(os.environ, GNUPGHOME=str(keydir)), capture_output=True)
