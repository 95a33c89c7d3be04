"""The Secure Boot path cannot strand a node (issue 23): order, refusals, the guard's refusal in status, and
trust as the running kernel sees it.

What stands in: **EFI firmware** (byte-exact efivarfs files, built by tests/test_mok.py's independent encoders),
**a GB10 node** (tests/support/sparkroot.py), and **the running kernel's /proc/keys**, as captured from real
kernels: debian-7.3.4-arm64-efi-db.txt from Debian's 7.3.4 arm64 kernel booted under AAVMF with
platform-key.pem in db (tests/test_kernel_guard_refused.py's VM; the kernel put it in .platform), and
debian-6.1.0-57-amd64-shim-mok-boot{1,3}.txt from Debian's signed 6.1 kernel under OVMF + shim with Secure
Boot on (tools/mok-e2e), before and after e2e-mok-key.pem was confirmed in MokManager (it is in .machine). The guard's log lines are the exact lines the guard wrote
in that VM (tests/test_guard_ours_refused.py checks the guard writes them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from spark_memsaver import world
from spark_memsaver import remedy as rm
from spark_memsaver.act import activate as act_activate
from spark_memsaver.act import executor
from spark_memsaver.config import Config
from spark_memsaver.decide import status as decide_status
from spark_memsaver.host import Host
from tests.support import sparkroot
from tests.test_mok import A_NV, A_VOLATILE, PAIRS, SB_ON, _openssl_cert, efivar, x509_list

pytestmark = pytest.mark.mok

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests/fixtures/proc-keys"
SHIM = "605dab50-e046-4300-abb6-3dd810dd8b23"
CFG = Config()
K = sparkroot.SPARK_KERNEL
REFUSED_KEY = (f"2026-12-02T12:05:05Z kernel={K} ours-load-failed: the kernel refused our nvidia-uvm "
               f"/lib/modules/{K}/updates/dkms/nvidia-uvm.ko: Key was rejected by service [key-not-trusted]\n")
REFUSED_ABI = (f"2026-12-02T12:05:27Z kernel={K} ours-load-failed: the kernel refused our nvidia-uvm "
               f"/lib/modules/{K}/updates/dkms/nvidia-uvm.ko: Unknown symbol in module, or unknown parameter "
               "(see dmesg) [abi-mismatch]\n")
# a remedy naming a command that needs root must carry sudo
ROOT_CMDS = re.compile(r"(?<!sudo )spark-memsaver (install|mok enroll|mok cancel|reconcile|activate|remove|rollback)")


def der(pem: Path) -> bytes:
    return subprocess.run(["openssl", "x509", "-in", str(pem), "-outform", "DER"], check=True,
                          capture_output=True).stdout


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("k")
    return {"ours": _openssl_cert(d, "ours", "/CN=DKMS module signing key").read_bytes(),
            "vendor": _openssl_cert(d, "vendor", "/O=Example/CN=Example Vendor CA").read_bytes()}


def node(base: Path, cert: bytes, variables: dict, *, uvm="stock", ours="580.142", files=None) -> Path:
    """A Spark root with Secure Boot on and ``cert`` as DKMS's certificate; ours, when installed, is signed with
    ``cert``'s own key where tests/test_mok._openssl_cert made that pair (what DKMS does: it signs with the
    certificate it has); unsigned for a certificate whose key the test does not have (tests/fixtures/proc-keys)."""
    pair = PAIRS.get(cert, False)
    root = sparkroot.make_spark_root(base, uvm_loaded=uvm, ours_installed=ours, secure_boot=True, signing=pair)
    vd = root / "sys/firmware/efi/efivars"
    for name, raw in variables.items():
        (vd / f"{name}-{SHIM}").write_bytes(raw)
    (root / "var/lib/dkms").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/dkms/mok.pub").write_bytes(cert)
    key = root / "var/lib/dkms/mok.key"      # DKMS keeps the pair: a certificate alone is signing-key-incomplete
    if pair:
        key.write_bytes(Path(pair[0]).read_bytes())
    else:                                     # a certificate whose key the test does not have: status only asks
        key.write_text("stands in for the private key of a fixture certificate; never read\n")   # whether it exists
    key.chmod(0o600)
    (root / "proc/sys/kernel/random").mkdir(parents=True, exist_ok=True)
    (root / "proc/sys/kernel/random/boot_id").write_text("6b1f0c8e-3a2d-4c5b-9e8f-7a6b5c4d3e2f\n")
    for rel, content in (files or {}).items():
        p = root / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content) if isinstance(content, bytes) else p.write_text(content)
    return root


def not_enrolled(keys) -> dict:
    return {"MokListRT": efivar(A_VOLATILE, x509_list(keys["vendor"]))}


def pending(keys) -> dict:
    return {**not_enrolled(keys), "MokNew": efivar(A_NV, x509_list(keys["ours"])),
            "MokAuth": efivar(A_NV, b"\x00" * 32)}


def cli(root: Path, *args):
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), *args], capture_output=True,
                       text=True, env=env, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def verdict(root: Path):
    return decide_status.evaluate(world.snapshot(Host(root), CFG), CFG)


def sudo_everywhere(findings) -> None:
    for f in findings:
        assert not ROOT_CMDS.search(f.remedy), f"{f.code}: {f.remedy}"


# --- activate refuses before the key is trusted ---------------------------------------------------------

def test_activate_refused_in_unverified_with_the_enrollment_remedy(tmp_path, keys):
    root = node(tmp_path / "r", keys["ours"], not_enrolled(keys))
    assert verdict(root).state == "unverified"
    with pytest.raises(act_activate.ActivationRefused) as e:
        executor.perform("activate", Host(root), CFG, dry_run=True)
    assert "not enrolled" in e.value.message and "stock nvidia-uvm stays loaded" in e.value.message
    assert e.value.remedy.startswith("Run 'sudo spark-memsaver mok enroll', then reboot with a person at the console")
    assert e.value.remedy.endswith("our module becomes active by itself at that boot.")
    # the CLI's dry run says the same, exit 1, nothing planned
    r = cli(root, "activate", "--dry-run", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["error"]["code"] == "activation-refused", r.stdout
    assert "sudo spark-memsaver mok enroll" in doc["error"]["remedy"] and "would_run" not in doc


def test_activate_refused_while_pending_says_confirm_at_the_console(tmp_path, keys):
    root = node(tmp_path / "r", keys["ours"], pending(keys))
    with pytest.raises(act_activate.ActivationRefused) as e:
        executor.perform("activate", Host(root), CFG)
    assert "the signing key's enrollment waits for the console at the next boot" in e.value.message
    assert e.value.remedy.startswith("Reboot with a person at the console and confirm the key in MokManager")


def test_activate_proceeds_once_enrolled(tmp_path, keys):
    root = node(tmp_path / "r", keys["ours"], {"MokListRT": efivar(A_VOLATILE, x509_list(keys["ours"]))})
    doc = executor.perform("activate", Host(root), CFG, dry_run=True)
    assert doc["would_run"][-1] == ["modprobe", "nvidia_uvm"]


# --- status: installed, awaiting the key; the order of the remedies ---------------------------------------

def test_installed_before_enrollment_says_when_it_becomes_active(tmp_path, keys):
    v = verdict(node(tmp_path / "r", keys["ours"], not_enrolled(keys)))
    assert v.state == "unverified"
    f = {x.code: x for x in v.findings}
    assert f["installed-awaiting-key"].message.startswith(
        "Our nvidia-uvm is installed — it becomes active after the key is enrolled and the node rebooted")
    assert f["installed-awaiting-key"].remedy == f["mok-not-enrolled"].remedy
    r = f["mok-not-enrolled"].remedy
    assert r.index("sudo spark-memsaver mok enroll") < r.index("reboot") < r.index("confirm") < r.index("by itself")
    sudo_everywhere(v.findings)


def test_new_key_pair_next_rebuilds_and_installs_before_enrolling(tmp_path, keys):
    """After the blocked key is replaced by a new pair (mok-blocked's remedy), the installed module is still
    signed with the old key: Next is 'build --force' then 'install' (signed with the new key), then the
    enrollment -- not 'mok enroll' alone, which would enroll a key nothing loaded is signed with. (Before:
    Next was 'mok enroll'; nothing compared the module's signer with the configured certificate.)"""
    old = keys["ours"]
    root = node(tmp_path / "r", old, {"MokListRT": efivar(A_VOLATILE, x509_list(keys["vendor"])),
                                      "MokListXRT": efivar(A_VOLATILE, x509_list(old))})
    doc = json.loads(cli(root, "status", "--json").stdout)
    assert doc["secure_boot"]["state"] == "blocked" and "signed-with-other-key" not in \
        {f["code"] for f in doc["findings"]}, doc["findings"]      # signed with the key it has: the pair comes first
    new = _openssl_cert(tmp_path, "new", "/CN=spark-memsaver-signing")
    (root / "var/lib/dkms/mok.pub").write_bytes(new.read_bytes())     # the new pair is the one DKMS signs with now
    doc = json.loads(cli(root, "status", "--json").stdout)
    assert doc["secure_boot"]["state"] == "not-enrolled", doc["secure_boot"]
    nxt = cli(root, "status").stdout.split("Next:", 1)[1].split("\n", 1)[0].strip()
    cmds = rm.commands_in(nxt)
    assert cmds[:2] == [f"sudo spark-memsaver build --kernel {K} --force && sudo spark-memsaver install --kernel {K}",
                        "sudo spark-memsaver mok enroll"], nxt
    f = {x["code"]: x for x in doc["findings"]}
    assert f["signed-with-other-key"]["remedy"] == f["installed-awaiting-key"]["remedy"], f
    assert "spark-memsaver fixture" not in f["signed-with-other-key"]["message"]
    plan = json.loads(cli(root, "build", "--kernel", K, "--force", "--dry-run", "--json").stdout)
    assert [s["action"] for s in plan["steps"]] == ["build"], plan          # the step Next names, not refused
    # the module signed with the new key: enrolling is what is left
    sparkroot.sign_module(root / f"lib/modules/{K}/updates/dkms/nvidia-uvm.ko", tmp_path / "new.key", new)
    doc = json.loads(cli(root, "status", "--json").stdout)
    assert "signed-with-other-key" not in {x["code"] for x in doc["findings"]}
    assert rm.commands_in(cli(root, "status").stdout.split("Next:", 1)[1].split("\n", 1)[0])[0] == \
        "sudo spark-memsaver mok enroll"


def test_stock_node_remedy_order_and_sudo(tmp_path, keys):
    # nothing installed yet, Secure Boot on, key not enrolled: install -> enroll -> reboot and confirm
    root = node(tmp_path / "r", keys["ours"], not_enrolled(keys), ours=None)
    v = verdict(root)
    remedies = " | ".join(x.remedy for x in v.findings)
    sudo_everywhere(v.findings)
    stock = next(x for x in v.findings if x.code == "stock")
    assert stock.remedy.startswith("Run 'sudo spark-memsaver install'"), stock.remedy
    assert stock.remedy.index("install") < stock.remedy.index("mok enroll") < stock.remedy.index("reboot"), remedies


def test_missed_prompt_stock_stays_and_status_says_re_request(tmp_path, keys):
    # enrolled was requested in an earlier boot; MokManager discarded it (no MokNew now); the guard loaded stock
    rec = {"cert_sha256": hashlib.sha256(keys["ours"]).hexdigest(),
           "boot_id": "0d9c8b7a-6f5e-4d3c-2b1a-0f9e8d7c6b5a", "requested_at": "2026-12-01T09:00:00Z"}
    root = node(tmp_path / "r", keys["ours"], not_enrolled(keys),
                files={"/var/lib/spark-memsaver/mok-request.json": json.dumps(rec),
                       "/run/spark-memsaver/guard.log": REFUSED_KEY})
    v = verdict(root)
    f = {x.code: x for x in v.findings}
    assert v.state == "unverified"
    assert "was not confirmed at the console on the following boot" in f["mok-not-enrolled"].message
    assert f["mok-not-enrolled"].remedy.startswith("Run 'sudo spark-memsaver mok enroll'")
    assert f["ours-load-failed"].message.startswith(
        "Our module was refused by the kernel: key not trusted; the stock module is in use")
    assert f["ours-load-failed"].remedy == f["mok-not-enrolled"].remedy
    sudo_everywhere(v.findings)


def test_request_still_pending_after_a_reboot_says_mokmanager_did_not_run(tmp_path, keys):
    rec = {"cert_sha256": hashlib.sha256(keys["ours"]).hexdigest(),
           "boot_id": "0d9c8b7a-6f5e-4d3c-2b1a-0f9e8d7c6b5a", "requested_at": "2026-12-01T09:00:00Z"}
    root = node(tmp_path / "r", keys["ours"], pending(keys),
                files={"/var/lib/spark-memsaver/mok-request.json": json.dumps(rec),
                       "/run/spark-memsaver/guard.log": REFUSED_KEY})
    v = verdict(root)
    f = {x.code: x for x in v.findings}
    assert "MokManager did not run then" in f["mok-pending-enroll"].message
    assert f["ours-load-failed"].remedy.startswith("Reboot with a person at the console and confirm the key")
    sudo_everywhere(v.findings)


def test_abi_refusal_remedy_is_reconcile_and_needs_attention(tmp_path, keys):
    root = node(tmp_path / "r", keys["ours"], {"MokListRT": efivar(A_VOLATILE, x509_list(keys["ours"]))},
                files={"/run/spark-memsaver/guard.log": REFUSED_KEY + REFUSED_ABI})
    v = verdict(root)
    f = {x.code: x for x in v.findings}
    assert v.state == "needs-attention"
    assert "built against another kernel or driver" in f["ours-load-failed"].message     # the newest line wins
    assert f["ours-load-failed"].remedy.startswith("Run 'sudo spark-memsaver reconcile'")


def test_refusal_of_another_kernel_or_with_ours_loaded_is_not_reported(tmp_path, keys):
    other = REFUSED_KEY.replace(f"kernel={K}", "kernel=6.14.0-1013-nvidia-64k")
    root = node(tmp_path / "a", keys["ours"], not_enrolled(keys), files={"/run/spark-memsaver/guard.log": other})
    assert "ours-load-failed" not in {x.code for x in verdict(root).findings}
    root = node(tmp_path / "b", keys["ours"], {"MokListRT": efivar(A_VOLATILE, x509_list(keys["ours"]))},
                uvm="ours", files={"/run/spark-memsaver/guard.log": REFUSED_KEY})
    assert "ours-load-failed" not in {x.code for x in verdict(root).findings}


# --- trust as the running kernel sees it (real /proc/keys text) ------------------------------------------

def _kernel_root(tmp_path, cert_pem: Path, keys_text: str | None, enrolled: bool = True):
    c = der(cert_pem)
    variables = {"MokListRT": efivar(A_VOLATILE, x509_list(c))} if enrolled else {}
    files = {"/proc/keys": keys_text} if keys_text is not None else {}
    return node(tmp_path, c, {**SB_ON, **variables}, files=files)


def test_key_in_platform_keyring_is_trusted_by_kernel(tmp_path):
    text = (FIX / "debian-7.3.4-arm64-efi-db.txt").read_text()
    sb = world.secure_boot(Host(_kernel_root(tmp_path / "r", FIX / "platform-key.pem", text)))
    k = sb["kernel"]
    assert k["key_description"] == "spark-memsaver test platform key: f0da1c47459a19fe1881249679a15c133e3e717c"
    assert k["key_loaded"] is True and k["trusted_by_kernel"] == "yes"
    assert k["keyrings"][".platform"] == {"present": True, "keys": 1}
    assert k["keyrings"][".machine"] == {"present": True, "keys": 0}
    assert sb["state"] == "enrolled" and "trusted by the running kernel" in sb["reason"] and sb["loadable"]
    # status shows the certificate's SHA-256 (the fleet key's fingerprint) and the kernel's trust
    fp = hashlib.sha256(der(FIX / "platform-key.pem")).hexdigest()
    r = cli(_kernel_root(tmp_path / "s", FIX / "platform-key.pem", text), "status")
    assert re.search(rf"Signing key: +sha256 {fp} \(/var/lib/dkms/mok.pub\); trusted by the running kernel: yes",
                     r.stdout), r.stdout
    doc = json.loads(cli(_kernel_root(tmp_path / "j", FIX / "platform-key.pem", text), "status", "--json").stdout)
    assert doc["secure_boot"]["certificate"]["sha256"] == fp
    assert doc["secure_boot"]["kernel"]["trusted_by_kernel"] == "yes"


def test_enrolled_in_firmware_but_not_in_the_kernel(tmp_path):
    text = (FIX / "debian-7.3.4-arm64-efi-db.txt").read_text()
    root = _kernel_root(tmp_path / "r", FIX / "untrusted-key.pem", text)
    sb = world.secure_boot(Host(root))
    assert sb["state"] == "enrolled" and sb["kernel"]["trusted_by_kernel"] == "no" and not sb["loadable"]
    assert "the running kernel does not trust it" in sb["reason"]
    v = verdict(root)
    f = {x.code: x for x in v.findings}
    assert "mok-not-trusted-by-kernel" in f and v.state == "needs-attention"
    assert "mokutil --trust-mok" in f["mok-not-trusted-by-kernel"].remedy
    with pytest.raises(act_activate.ActivationRefused, match="does not trust it"):
        executor.perform("activate", Host(root), CFG, dry_run=True)


def test_trusted_by_the_kernel_but_in_no_firmware_list(tmp_path):
    """The reverse disagreement (the key in a kernel keyring, in neither MokListRT nor db): the EFI view stays
    not-enrolled, status says the kernel trusts it with its own finding, and the remedy, mok enroll, is one the
    enroll step carries out: it passes --ignore-keyring, without which mokutil skips a key the kernel trusts."""
    text = (FIX / "debian-7.3.4-arm64-efi-db.txt").read_text()
    root = _kernel_root(tmp_path / "r", FIX / "platform-key.pem", text, enrolled=False)
    sb = world.secure_boot(Host(root))
    assert sb["state"] == "not-enrolled" and sb["kernel"]["trusted_by_kernel"] == "yes" and not sb["loadable"]
    assert "the running kernel trusts it all the same" in sb["reason"]
    f = {x.code: x for x in verdict(root).findings}
    assert "mok-trusted-by-kernel-only" in f and f["mok-trusted-by-kernel-only"].severity == "info"
    assert "sudo spark-memsaver mok enroll" in f["mok-trusted-by-kernel-only"].remedy
    assert "mok-not-trusted-by-kernel" not in f
    doc = json.loads(cli(root, "mok", "enroll", "--dry-run", "--json").stdout)
    assert doc["would_run"][0][:3] == ["mokutil", "--ignore-keyring", "--import"], doc


def test_key_enrolled_through_mokmanager_before_and_after(tmp_path):
    # real /proc/keys of Debian's signed 6.1.0-57-amd64 under OVMF + shim with Secure Boot (tools/mok-e2e):
    # boot 1 before the key was confirmed in MokManager, boot 3 after (the kernel put it in .machine)
    before = (FIX / "debian-6.1.0-57-amd64-shim-mok-boot1.txt").read_text()
    after = (FIX / "debian-6.1.0-57-amd64-shim-mok-boot3.txt").read_text()
    k1 = world.secure_boot(Host(_kernel_root(tmp_path / "a", FIX / "e2e-mok-key.pem", before,
                                             enrolled=False)))["kernel"]
    assert k1["trusted_by_kernel"] == "no" and k1["keyrings"][".machine"] == {"present": True, "keys": 2}
    sb = world.secure_boot(Host(_kernel_root(tmp_path / "b", FIX / "e2e-mok-key.pem", after)))
    k3 = sb["kernel"]
    assert k3["key_description"] == "spark-memsaver e2e module signing key: 265f68d499b5454e6a847e4b26339e722bccd079"
    assert k3["trusted_by_kernel"] == "yes" and k3["keyrings"][".machine"] == {"present": True, "keys": 3}
    assert sb["state"] == "enrolled" and sb["loadable"]


def test_trust_unknown_without_system_keyrings_or_proc_keys(tmp_path):
    # an unprivileged reader's /proc/keys: its own keyrings only (lines from the captured text)
    text = (FIX / "debian-7.3.4-arm64-efi-db.txt").read_text()
    own = "".join(ln + "\n" for ln in text.splitlines() if "_uid" in ln or "user " in ln)
    assert own and ".platform" not in own
    sb = world.secure_boot(Host(_kernel_root(tmp_path / "a", FIX / "platform-key.pem", own)))
    assert sb["kernel"]["trusted_by_kernel"] == "unknown" and sb["loadable"]
    sb = world.secure_boot(Host(_kernel_root(tmp_path / "b", FIX / "platform-key.pem", None)))
    assert sb["kernel"]["trusted_by_kernel"] == "unknown"


# a key that uid 65534 added to its own session keyring with our certificate's description and made visible to
# everyone, as root's /proc/keys then lists it (captured on this machine's kernel after, as nobody,
# `keyctl padd asymmetric "<CN>: <SKID>" @s < untrusted-key.der` and `keyctl setperm <id> 0x3f3f3f3f`)
NOBODYS_KEY = ("02c88047 I--Q---     1 perm 3f3f3f3f 65534 65534 asymmetri spark-memsaver test fleet key: "
               "9c2065e7417d5fd9c35dff1d0f099fe6121f25b2: X509.rsa 121f25b2 []\n")


def test_a_key_of_another_uid_is_never_trusted_by_the_kernel(tmp_path):
    """Issue 35 item 8: only root's keys count. Before, any uid's key with our description made status say
    'trusted by the running kernel: yes' (and the activation loadable) where keyctl is not installed."""
    text = (FIX / "debian-7.3.4-arm64-efi-db.txt").read_text() + NOBODYS_KEY
    root = _kernel_root(tmp_path / "r", FIX / "untrusted-key.pem", text)
    sb = world.secure_boot(Host(root))
    assert sb["kernel"]["key_description"] == NOBODYS_KEY.split("asymmetri ")[1].split(": X509")[0]
    assert sb["kernel"]["trusted_by_kernel"] == "no" and sb["kernel"]["key_loaded"] is False
    assert sb["state"] == "enrolled" and not sb["loadable"], sb
    assert "mok-not-trusted-by-kernel" in {x.code for x in verdict(root).findings}
    r = cli(_kernel_root(tmp_path / "s", FIX / "untrusted-key.pem", text), "status")
    assert "trusted by the running kernel: no" in r.stdout, r.stdout
    # the same line owned by root (a key the kernel loaded) counts: the uid, not the text, decides
    as_root = NOBODYS_KEY.replace(" 65534 65534 ", "     0     0 ")
    sb = world.secure_boot(Host(_kernel_root(tmp_path / "t", FIX / "untrusted-key.pem",
                                             (FIX / "debian-7.3.4-arm64-efi-db.txt").read_text() + as_root)))
    assert sb["kernel"]["trusted_by_kernel"] == "yes" and sb["kernel"]["key_loaded"] is True
    assert "keyutils" in sb["kernel"]["trust_reason"]


# --- MokManager's countdown: finite unless --wait-at-console is chosen ------------------------------------

@pytest.mark.parametrize("args", [("--console-timeout", "0"), ("--console-timeout", "32768"),
                                  ("--console-timeout", "300", "--wait-at-console")])
def test_console_timeout_is_checked_before_anything(tmp_path, keys, args):
    root = node(tmp_path / "r", keys["ours"], not_enrolled(keys))
    r = cli(root, "mok", "enroll", *args, "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 2 and doc["error"]["code"] == "mok-bad-timeout", r.stdout
    assert "--wait-at-console" in doc["error"]["remedy"] and "--console-timeout" in doc["error"]["remedy"]


@pytest.mark.parametrize("state", [s for s in ("no-key", "not-enrolled", "pending-enroll", "pending-delete", "blocked")])
def test_activate_refusal_says_the_state_as_status_does(state):
    """activate's refusal words the key's state as status's finding does (decide/installability.key_phrase),
    not 'our signing key is no key' / 'is pending enroll' (issue 27)."""
    from spark_memsaver.decide.installability import key_phrase
    with pytest.raises(act_activate.ActivationRefused) as e:
        act_activate.secure_boot_allows({"state": state})
    assert e.value.message.startswith(f"Secure Boot is enforcing and {key_phrase(state)}: "), e.value.message
    assert not re.search(r"is (no key|pending enroll|pending delete)\b", e.value.message), e.value.message
