"""Every remedy is runnable as printed by the person who reads it (spark_memsaver/remedy.py).

The walk: every finding code of every decide state (tests/test_decide.py's cases, and variants that reach the
other findings) and of the real CLI on fixture roots, and every named error's remedy. Each command a remedy
asks for must exist (a spark-memsaver command parses with the CLI's own click parser; a system program is
installed here or is a distribution's own tool named as such), carry sudo exactly when it needs root, and --
for spark-memsaver's install, build, activate, rollback, remove -- not be refused by the same code for the same
state (the installability decision, the state; on fixture roots the command's own --dry-run)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import click
import pytest

from spark_memsaver import remedy as rm
from spark_memsaver.config import Config
from spark_memsaver.decide import installability as inst
from spark_memsaver.decide.status import evaluate
from tests.support import needs, sparkroot
from tests.support.cliparse import parse, split
from tests.test_decide import CASES, K, base_snapshot, module, ours_loaded
from tests.test_exit_codes import _all_errors
from tests.support.worlds import typed

evaluate, inst = typed(evaluate), typed(inst)   # dict snapshots -> model.World (tests/support/worlds.py)

REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
ENV.pop("SPARK_MEMSAVER_CONFIG", None)
# programs of another distribution, named in a remedy for that distribution only ("on Ubuntu run ...")
OTHER_DISTRIBUTIONS = {"update-secureboot-policy": "Ubuntu's shim-signed"}


SUPPORT: dict = {}     # the manifest's verdict a variant is evaluated with (None: not consulted)


def _variants() -> dict:
    """The decide cases plus states that reach the findings the cases do not."""
    out = {n: fn() for n, fn in CASES.items()}

    def v(name, fn, config=None, support=None):
        s = base_snapshot()
        fn(s)
        out[name] = (s, config or Config(), None, None)
        SUPPORT[name] = support
    v("headers_missing", lambda s: s["kernels"][0].update(headers=False))
    v("other_kernel_headers_missing", lambda s: s["kernels"].append(dict(copy.deepcopy(s["kernels"][0]),
                                                                         release=K + "-old", running=False,
                                                                         headers=False)))
    v("interrupted", lambda s: s["records"].update(intents=[{"op": "install", "started": "t", "kernel": K}]))
    v("record_unreadable", lambda s: s["records"].update(unreadable=["/var/lib/spark-memsaver/x.json"]))
    v("secure_boot_unknown", lambda s: s.update(secure_boot={"state": "unknown", "reason": "r"}))
    v("not_enrolled_stock", lambda s: s.update(secure_boot={"state": "not-enrolled", "reason": "r"}))
    v("trusted_by_kernel_only", lambda s: s.update(secure_boot={"state": "not-enrolled", "reason": "r", "kernel": {
        "trusted_by_kernel": "yes", "trust_reason": "our certificate's key is in .secondary_trusted_keys"}}))
    v("dkms_missing", lambda s: s["dkms"].update(available=False))
    v("signing_key_incomplete", lambda s: s.update(secure_boot={**s["secure_boot"], "certificate": {
        "path": "/var/lib/dkms/mok.pub", "origin": "DKMS default", "present": True, "key_path": "/var/lib/dkms/mok.key",
        "key_present": False}}))
    # what the way back needs (decide/wayback.py): a program (kmod's, and dkms while DKMS still registers ours), a
    # selection that can be read (without and with an interrupted operation)
    v("depmod_missing", lambda s: s.update(programs_missing=[{"name": "depmod", "package": "kmod"}]))
    v("dkms_missing_registered", lambda s: s["dkms"].update(available=False, registrations=[
        {"module": "spark-memsaver-uvm", "version": "580.142-sm0.1.0", "source_present": True, "builds": []}]))
    gone = {"state": "unreadable", "path": None, "version": None, "patched": None, "error": "modinfo -k K nvidia_uvm "
            "failed (exit 1): modinfo: ERROR: could not get modinfo from 'nvidia_uvm': No such file or directory"}
    v("selection_unreadable", lambda s: s["kernels"][0].update(uvm_selected=gone))
    v("selection_unreadable_interrupted", lambda s: (s["kernels"][0].update(uvm_selected=gone), s["records"].update(
        intents=[{"op": "remove", "started": "t", "kernel": K}])))

    def changed(s):
        s["kernels"][0]["uvm_selected"] = module(patched=True)
        s["records"]["builds"] = [{"kernel": K, "tier": "4k-all", "kernels": "64k-only"}]
    v("config_changed_auto", changed)
    v("config_changed_manual", changed, Config(auto_build=False))
    # the install findings (decide/installability.py): each missing piece, and a fetchable source
    v("driver_source_missing", lambda s: s["driver"].update(sources=[]))
    v("driver_source_missing_in_lists", lambda s: s.update(driver={**s["driver"], "sources": []}, driver_sources={
        "mode": "never", "by_driver": {"580.142": {"package": "nvidia-kernel-source-580-open",
                                                   "deb_version": "580.142-0ubuntu1", "in_lists": True}}}))
    v("driver_source_corrupt", lambda s: s.update(driver={**s["driver"], "sources": [
        {"version": "580.142", "path": "/usr/src/nvidia-580.142", "open": False}]}, driver_sources={
        "by_driver": {"580.142": {"package": "nvidia-kernel-source-580-open", "deb_version": "580.142-0ubuntu1"}}}))
    v("driver_source_fetchable", lambda s: s.update(driver={**s["driver"], "sources": []}, driver_sources={
        "mode": "auto", "by_driver": {"580.142": {"fetchable": True, "package": "nvidia-kernel-source-580-open",
                                                  "deb_version": "580.142-0ubuntu1"}}}))
    v("driver_unsupported", lambda s: None, support={"580.142": {"supported": False,
                                                                 "reason": "driver 580.142 is not in the manifest"}})
    v("nvidia_ko_missing", lambda s: s["kernels"][0].update(nvidia_selected=None))
    v("unknown_kernel", lambda s: s["kernels"][0].update(release=K + "-other", running=False))
    # records: quarantined (set aside or not yet), the administrator's hold
    v("record_quarantined", lambda s: s["records"].update(quarantined=[
        {"path": "/var/lib/spark-memsaver/intents/x.json", "kind": "intent", "reason": "not JSON", "moved_to": None},
        {"path": "/var/lib/spark-memsaver/y.json", "kind": "build", "reason": "r", "moved_to": "/var/lib/y.bad"}]))
    def rolled_back_while_loaded(s):      # ours still loaded (in use), the stock module selected, held
        ours_loaded(s)
        s["kernels"][0]["uvm_selected"] = module()
        s["records"].update(holds=[{"by": "rollback", "kernel": K, "since": "2026-12-02T10:00:00Z", "reason": "r"}])
    v("rolled_back_while_loaded", rolled_back_while_loaded)
    v("held_after_rollback", lambda s: s["records"].update(
        holds=[{"by": "rollback", "kernel": K, "since": "2026-12-02T10:00:00Z", "reason": "r"}],
        rollbacks=[{"kernel": K, "time": "2026-12-02T10:00:00Z", "reason": "requested", "code": "requested"}]))
    # the known-hazards table (uvm_patch/hazards.yaml): a hazard met, a check that could not read its file,
    # a table not found, a table not valid
    table = (REPO / "uvm_patch/hazards.yaml").read_text()
    hz = {"table": {"path": "/usr/share/spark-memsaver/uvm_patch/hazards.yaml", "text": table},
          "driver_version": "590.48.01", "arch": "aarch64", "page_size": 65536, "sources": {},
          "source_path": "/usr/src/nvidia-590.48.01",
          "source_errors": {"common/inc/nv-linux.h": "Permission denied"}}
    v("hazard_met", lambda s: s.update(hazard_inputs=hz))
    v("hazards_table_unreadable", lambda s: s.update(hazard_inputs={**hz, "table": {"path": "h", "text": None}}))
    v("hazards_table_invalid", lambda s: s.update(hazard_inputs={**hz, "table": {"path": "h", "text": "- 7\n"}}))
    # a configuration read under an old name (the real loader's note)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.yaml").write_text("tier: 4k\n")
        from spark_memsaver import config as cfg
        v("config_renamed", lambda s: None, cfg.load(str(Path(d, "config.yaml"))))
        # a file that cannot be used: the defaults carry its error (the real loader of the safety paths)
        Path(d, "bad.yaml").write_text("tier: [oops\n")
        v("config_invalid", lambda s: None, cfg.load_for_safety(str(Path(d, "bad.yaml"))))
    return out


def _would_refuse(path: str, params: dict, snap: dict, config: Config, state: str,
                  support: dict | None = None) -> str | None:
    """Why the same code would refuse this spark-memsaver command in this state, or None."""
    kernels = {k["release"]: k for k in snap.get("kernels", [])}
    if params.get("kernel") and params["kernel"] not in kernels:
        return f"unknown kernel {params['kernel']}"
    k = params.get("kernel") or next((r for r, x in kernels.items() if x.get("running")), None)
    if path in ("install", "build") and (snap.get("dkms") or {}).get("available") is False:
        return f"{path} is refused: dkms-missing (DkmsMissing, act/dkms_run.py)"
    if path in ("install", "build") and k:
        d = inst.installability(snap, config, support, k)
        missing = [m["code"] for m in d["missing"] if path == "install" or m["code"] != "secure-boot-unknown"]
        if missing:
            return f"{path} is refused: {missing}"
    if path == "activate" and not (kernels.get(k, {}).get("uvm_selected") or {}).get("patched"):
        return "activate: ours is not installed"
    if path in ("rollback", "remove") and not any((x.get("uvm_selected") or {}).get("patched")
                                                  for x in kernels.values()) \
            and not (snap["uvm"].get("loaded") and snap["uvm"].get("patched")):
        return f"{path}: nothing of ours to take away"
    return None


def check_command(command: str) -> list[str]:
    """Problems of one command as printed: existence, parse, sudo."""
    sudo, argv = split(command)
    problems = []
    bare = " ".join(argv)
    if sudo != rm.needs_root(bare):
        problems.append(f"{command!r}: sudo {'missing' if not sudo else 'not needed'}")
    prog = argv[0] if argv else ""
    if prog == "spark-memsaver":
        try:
            parse(command)
        except click.exceptions.Exit:
            pass                          # '... --help': click answers and exits 0
        except click.ClickException as e:
            problems.append(f"{command!r}: {e.format_message()}")
    elif prog not in OTHER_DISTRIBUTIONS and shutil.which(prog) is None and \
            shutil.which(prog, path="/usr/sbin:/sbin:/usr/bin:/bin") is None:
        problems.append(f"{command!r}: no program {prog}")
    return problems


def walk_decide() -> tuple[list[tuple], list[str]]:
    rows, problems = [], []
    for name, (snap, config, _, _) in sorted(_variants().items()):
        v = evaluate(copy.deepcopy(snap), config, SUPPORT.get(name))
        for f in v.findings:
            cmds = rm.commands_in(f.remedy)
            rows.append((name, v.state, f.code, cmds))
            for m in rm.unquoted_root_mentions(f.remedy):
                problems.append(f"{name}/{f.code}: '{m}' outside quotes, without sudo: {f.remedy!r}")
            for c in cmds:
                problems += [f"{name}/{f.code}: {p}" for p in check_command(c)]
                _, argv = split(c)
                if argv[:1] == ["spark-memsaver"]:
                    path, params = parse(c)
                    why = _would_refuse(path, params, snap, config, v.state, SUPPORT.get(name))
                    if why:
                        problems.append(f"{name}/{f.code}: {c!r} would be refused: {why}")
    return rows, problems


def test_remedy_walk_over_every_decide_state():
    rows, problems = walk_decide()
    codes = {r[2] for r in rows}
    assert len(rows) > 30 and {"stock", "headers-missing", "override-driver-mismatch", "operation-interrupted",
                               "activation-pending", "config-changed", "secure-boot-unknown"} <= codes, codes
    print("\nremedy walk (decide state / state / code: commands):")
    for name, state, code, cmds in rows:
        print(f"  {name:<40} {state:<16} {code:<28} {' ; '.join(cmds) or '-'}")
    assert problems == []


def test_every_named_errors_remedy_is_runnable():
    problems = []
    for e in _all_errors():
        text = e.remedy or ""
        problems += [f"{e.__name__}: '{m}' outside quotes, without sudo" for m in rm.unquoted_root_mentions(text)]
        for c in rm.commands_in(text):
            problems += [f"{e.__name__}: {p}" for p in check_command(c)]
    assert problems == []


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    from spark_memsaver.host import Host, intents
    t = tmp_path_factory.mktemp("rw")
    r = {"stock": sparkroot.make_spark_root(t / "stock"),
         "stock-no-headers": sparkroot.make_spark_root(t / "nohdr", headers=False),
         "stock-no-dkms": sparkroot.make_spark_root(t / "nodkms", dkms=False),
         "installed": sparkroot.make_spark_root(t / "inst", ours_installed="580.142"),
         "active": sparkroot.make_spark_root(t / "active", uvm_loaded="ours", ours_installed="580.142"),
         "mismatch": sparkroot.make_spark_root(t / "bad", uvm_loaded="ours", ours_installed="580.95.05"),
         "unverified": sparkroot.make_spark_root(t / "unv", uvm_loaded="ours", ours_installed="580.142",
                                                 secure_boot=True),
         "rolled-back": sparkroot.make_spark_root(t / "rb")}
    sparkroot.write(r["unverified"], f"/sys/firmware/efi/efivars/SecureBoot-{sparkroot.EFI_GLOBAL}",
                    b"\x06\x00\x00\x00")
    intents.write_rollback(Host(r["rolled-back"]), sparkroot.SPARK_KERNEL, "the driver moved", code="requested")
    # every MOK state that keeps our module out, from byte-exact EFI variables (tests/test_mok.py's encoders);
    # the guard's refusal in this boot; a key the firmware has and the running kernel does not trust (a real
    # /proc/keys); the administrator's hold after a rollback
    from spark_memsaver.host import holds
    from tests.test_mok import A_NV, A_VOLATILE, SB_ON, _openssl_cert, efivar, x509_list
    from tests.test_secure_boot_path import FIX, REFUSED_KEY, der, node
    ours = _openssl_cert(t, "ours", "/CN=DKMS module signing key").read_bytes()
    vendor = x509_list(_openssl_cert(t, "vendor", "/O=Example/CN=Example Vendor CA").read_bytes())
    ne = {"MokListRT": efivar(A_VOLATILE, vendor)}
    r["not-enrolled"] = node(t / "ne", ours, ne)
    r["pending-enroll"] = node(t / "pe", ours, {**ne, "MokNew": efivar(A_NV, x509_list(ours)),
                                                "MokAuth": efivar(A_NV, b"\x00" * 32)})
    r["no-key"] = node(t / "nk", ours, ne, ours=None)
    (r["no-key"] / "var/lib/dkms/mok.pub").unlink()
    r["pending-delete"] = node(t / "pd", ours, {"MokListRT": efivar(A_VOLATILE, vendor + x509_list(ours)),
                                                "MokDel": efivar(A_NV, x509_list(ours)),
                                                "MokDelAuth": efivar(A_NV, b"\x00" * 32)})
    r["blocked"] = node(t / "bl", ours, {**ne, "MokListXRT": efivar(A_VOLATILE, x509_list(ours))})
    r["ours-load-failed"] = node(t / "lf", ours, ne, files={"/run/spark-memsaver/guard.log": REFUSED_KEY})
    # a new key pair made after ours was signed (mok-blocked's remedy): ours is signed with the old one
    r["signed-with-other-key"] = node(t / "ok", ours, ne)
    (r["signed-with-other-key"] / "var/lib/dkms/mok.pub").write_bytes(_openssl_cert(t, "new", "/CN=new").read_bytes())
    untrusted = der(FIX / "untrusted-key.pem")
    r["not-trusted-by-kernel"] = node(t / "nt", untrusted, {**SB_ON, "MokListRT": efivar(A_VOLATILE,
                                                                                         x509_list(untrusted))},
                                      files={"/proc/keys": (FIX / "debian-7.3.4-arm64-efi-db.txt").read_text()})
    r["held"] = sparkroot.make_spark_root(t / "held")
    intents.write_rollback(Host(r["held"]), sparkroot.SPARK_KERNEL, "requested by the administrator",
                           code="requested")
    holds.hold(Host(r["held"]), "rollback", sparkroot.SPARK_KERNEL, "requested by the administrator")
    return r


def every_finding_code() -> set[str]:
    """Every code status can give: the one list (decide/findings.CODES; tests/test_findings.py holds decide/ to
    it) and each hazard of the table."""
    from spark_memsaver.decide.findings import CODES
    from spark_memsaver.hazard_table import load_hazards
    return set(CODES) | {h.code for h in load_hazards((REPO / "uvm_patch/hazards.yaml").read_text())}


DRY = {"install", "build", "remove", "rollback", "activate", "reconcile", "mok enroll", "mok cancel"}   # --dry-run


def test_remedy_walk_on_fixture_roots(roots):
    """The real CLI's findings on each root; each spark-memsaver remedy that acts is run with --dry-run on the
    same root: the same code must not refuse it."""
    problems, seen = [], []
    for state, root in roots.items():
        doc = json.loads(subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), "status",
                                         "--json"], capture_output=True, text=True, env=ENV, timeout=120).stdout)
        for f in doc["findings"]:
            cmds = rm.commands_in(f["remedy"])
            seen.append((state, f["code"], cmds))
            problems += [f"{state}/{f['code']}: '{m}' unquoted" for m in rm.unquoted_root_mentions(f["remedy"])]
            first = True       # the remedy's first step acts in this state; a later one follows from it
            for c in cmds:     # ("install ..., then mok enroll": enroll has no key to enroll until install)
                problems += [f"{state}/{f['code']}: {p}" for p in check_command(c)]
                _, argv = split(c)
                if argv[:1] != ["spark-memsaver"]:
                    continue
                path, _ = parse(c)
                if path in DRY and first:
                    first = False
                    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), *argv[1:],
                                        "--dry-run"], capture_output=True, text=True, env=ENV, timeout=120)
                    if r.returncode != 0:
                        problems.append(f"{state}/{f['code']}: {c!r} --dry-run refused: {r.stderr.strip()}")
    print("\nremedy walk on fixture roots (state / code: commands):")
    for state, code, cmds in seen:
        print(f"  {state:<18} {code:<28} {' ; '.join(cmds) or '-'}")
    assert {s for s, _, _ in seen} >= {"stock", "installed", "mismatch", "unverified", "rolled-back"}
    assert problems == []
    walked = {c for _, c, _ in seen} | {r[2] for r in walk_decide()[0]}
    print(f"finding codes walked: {len(walked)} of {len(every_finding_code())}")
    assert every_finding_code() - walked == set(), "no state of the walk reaches these codes"


def test_the_builder():
    assert rm.cmd("spark-memsaver install --kernel K") == "sudo spark-memsaver install --kernel K"
    assert rm.cmd("sudo spark-memsaver status") == "spark-memsaver status"
    assert rm.cmd("spark-memsaver mok status") == "spark-memsaver mok status"
    assert rm.cmd("spark-memsaver mok enroll") == "sudo spark-memsaver mok enroll"
    assert rm.cmd("apt-get install dkms") == "sudo apt-get install dkms"
    assert rm.cmd("systemctl status spark-memsaverd.service") == "systemctl status spark-memsaverd.service"
    assert rm.RESTART_DAEMON == "sudo systemctl restart spark-memsaverd.service"
    assert rm.run("spark-memsaver activate") == "Run 'sudo spark-memsaver activate'"
    assert rm.commands_in("Run 'spark-memsaver reconcile' (or restart spark-memsaverd)") == \
        ["spark-memsaver reconcile"]
    assert rm.unquoted_root_mentions("then run spark-memsaver install again") == ["spark-memsaver install"]
    # an apostrophe is no quote: the command after "the driver's" and "spark-memsaverd's" is still read
    assert rm.commands_in("the NVIDIA 580 driver's kernel modules: 'sudo apt-get install x' (Ubuntu)") == \
        ["sudo apt-get install x"]
    assert rm.commands_in("spark-memsaverd's next reconcile sets it aside, or now: 'sudo spark-memsaver reconcile'."
                          ) == ["sudo spark-memsaver reconcile"]
    assert rm.unquoted_root_mentions("the daemon's next run, or 'sudo spark-memsaver reconcile' now") == []
    assert rm.unquoted_root_mentions("spark-memsaver rebuilds it by itself") == []


def test_every_known_hazards_remedy_names_a_runnable_command():
    """uvm_patch/hazards.yaml: each hazard's remedies (joined into its finding's remedy) name a command the
    reader can run (the #1269 remedy said 'stay on the 580 branch' and named none)."""
    from spark_memsaver.hazard_table import load_hazards
    hazards = load_hazards((REPO / "uvm_patch/hazards.yaml").read_text())
    assert hazards
    for h in hazards:
        text = "; or ".join(h.remedies)
        cmds = rm.commands_in(text)
        assert cmds, (h.code, text)
        problems = [p for c in cmds for p in check_command(c)] + rm.unquoted_root_mentions(text)
        assert problems == [], (h.code, problems)


# Instructions written into the code itself ("run 'X'", "recovered by 'X'"), also those that are no named
# error's class remedy and no finding (a refusal's remedy built on the spot, a message, the guard's log line).
_INSTRUCTION = re.compile(r"\b(?:[Rr]un|[Rr]ecovered by|[Tt]ry|[Uu]se|[Gg]ive one:|or)\s+'((?:sudo\s+)?[a-z][^']*)'")


def instructions_without_their_sudo(text: str) -> list[str]:
    out = []
    for m in _INSTRUCTION.finditer(text):
        if text[:m.start()].endswith("Also "):    # an option's help: what the program itself runs
            continue
        command = re.sub(r"\{[^}]*\}", "X", m.group(1))           # an f-string's field reads as a word
        if not rm._COMMAND_START.match(command):
            continue
        sudo, argv = split(command)
        if argv[:2] == ["spark-memsaver", "X"]:       # the command itself is a field: judged where it runs
            continue
        if sudo != rm.needs_root(" ".join(argv)):
            out.append(f"line {text[:m.start()].count(chr(10)) + 1}: {m.group(0)!r}")
    return out


def test_the_instruction_scan_finds_what_it_should():
    assert instructions_without_their_sudo("or run 'spark-memsaver activate' again") != []
    assert instructions_without_their_sudo("recovered by 'spark-memsaver reconcile'.") != []
    assert instructions_without_their_sudo("Run 'update-initramfs -u -k {kernel}' by hand") != []
    assert instructions_without_their_sudo("Give one: 'spark-memsaver install --kernel {k}' for that kernel, or "
                                           "'sudo spark-memsaver install --all'") != []
    assert instructions_without_their_sudo("Run 'sudo spark-memsaver reconcile' and 'spark-memsaver status'") == []
    assert instructions_without_their_sudo("Run 'sudo depmod -a {kernel}' by hand") == []
    assert instructions_without_their_sudo("help=\"Also run 'mokutil --timeout -1': MokManager waits\"") == []


def test_every_instruction_in_the_code_carries_its_sudo():
    """Every "run 'COMMAND'" the program's own text gives -- its Python package, the guard and hooks -- carries
    sudo exactly when the command needs root (a message and a refusal built on the spot are not walked above:
    activate's 'in use' message, the daemon-stopped remedy and update-initramfs's said none)."""
    files = sorted((REPO / "daemon/spark_memsaver").rglob("*.py")) + \
        sorted(p for p in (REPO / "systemd").rglob("*") if p.is_file())
    problems = [f"{p.relative_to(REPO)} {x}" for p in files for x in instructions_without_their_sudo(p.read_text())]
    assert len(files) > 100 and problems == []


def test_a_kernel_without_64k_pages_is_never_told_to_set_kernels_all(tmp_path):
    """With 4 or 16 KiB pages a page table's backing page is small already: 'kernels: all' saves nothing there.
    The installability decision said so; the build's own preflight (act/build.py, the DKMS engines' path) and
    DKMS's BUILD_EXCLUSIVE skip still sent the reader to 'kernels: all'."""
    from spark_memsaver.act import build as act_build
    from spark_memsaver.act.dkms_errors import KernelOutsidePolicy
    from spark_memsaver.decide import policy
    from spark_memsaver.host import Host
    advice = [e.__name__ for e in _all_errors() if "kernels: all" in (e.remedy or "")]
    assert advice == []
    k4 = "6.14.0-1015-nvidia"
    root = sparkroot.make_spark_root(tmp_path / "r", extra_kernels=(k4,))
    sparkroot.write(root, f"/boot/config-{k4}", "CONFIG_ARM64=y\nCONFIG_ARM64_4K_PAGES=y\nCONFIG_MODVERSIONS=y\n")
    with pytest.raises(KernelOutsidePolicy) as e:
        act_build._preflight(Host(root), Config(), k4, None)
    v = policy.verdict(policy.kernel_of(k4, {"CONFIG_ARM64": "y", "CONFIG_ARM64_4K_PAGES": "y"}), Config())
    assert e.value.remedy == inst.policy_remedy(Config(), v) and "kernels: all" not in e.value.remedy
    assert "without 64 KiB pages" in e.value.message


def test_no_key_and_bad_table_remedies_name_their_commands():
    """'Create the signing key first: build once with DKMS ...; or give --cert PATH' and 'Reinstall
    spark-memsaver' named no command to run (the no-key one is the first screen's Next on a Secure Boot node
    without a key)."""
    from spark_memsaver.decide.mok import MokNoKey
    from spark_memsaver.hazard_table import HazardsInvalid
    assert {"sudo spark-memsaver install", "sudo spark-memsaver mok enroll",
            "sudo spark-memsaver mok enroll --cert PATH"} <= set(rm.commands_in(MokNoKey.remedy)), MokNoKey.remedy
    assert "sudo apt-get install --reinstall spark-memsaver" in rm.commands_in(HazardsInvalid.remedy)
    for text in (MokNoKey.remedy, HazardsInvalid.remedy):
        assert all(check_command(c) == [] for c in rm.commands_in(text))


@pytest.mark.parametrize("op", ["install", "remove"])
def test_kernel_with_all_remedy_carries_sudo_whoever_asks(tmp_path, op):
    """The executor's own refusal of --kernel with --all (D-Bus callers reach it; the CLI refuses first, with
    sudo) gave 'spark-memsaver install --kernel K' without sudo."""
    from spark_memsaver.act import executor
    from spark_memsaver.errors import UsageError
    from spark_memsaver.host import Host
    root = sparkroot.make_spark_root(tmp_path / "r")
    with pytest.raises(UsageError) as e:
        executor.perform(op, Host(root), Config(), kernel=sparkroot.SPARK_KERNEL, all_kernels=True)
    cmds = rm.commands_in(e.value.remedy)
    assert len(cmds) == 2 and [p for c in cmds for p in check_command(c)] == [], e.value.remedy


def test_the_last_remedies_without_a_command_name_one():
    """packing-predicates-unmet, counters-unreadable and mok-blocked said what was wrong but named nothing to run
    (before: 'Packing applies only to integrated GPUs ...', 'Update spark-memsaver so it matches the module, or
    rebuild the module.', 'Create a new signing key, point DKMS at it ... and enroll that one.')."""
    from spark_memsaver.decide.mok import MokKeyBlocked
    rows = {code: cmds for _, _, code, cmds in walk_decide()[0]}
    assert rows["packing-predicates-unmet"] == ["sudo spark-memsaver rollback", "sudo spark-memsaver install"]
    unreadable = rows["counters-unreadable"]
    assert unreadable[0] == "sudo apt-get install --only-upgrade spark-memsaver", unreadable
    assert any(c.startswith("sudo spark-memsaver build --kernel ") and c.endswith("--force && sudo spark-memsaver "
               "install --kernel " + c.split("--kernel ")[1].split()[0]) for c in unreadable), unreadable
    assert unreadable[-1] == "sudo modprobe -r nvidia_uvm && sudo modprobe nvidia_uvm", unreadable
    assert rm.commands_in(MokKeyBlocked.remedy) == ["sudo spark-memsaver build --force", "sudo spark-memsaver install",
                                                    "sudo spark-memsaver mok enroll"]
    for c in unreadable + rm.commands_in(MokKeyBlocked.remedy):
        assert check_command(c) == [], c


def test_the_blocked_keys_new_pair_passes_the_signing_checks(tmp_path):
    """mok-blocked's remedy makes the new pair with the commands it quotes (run here with the real install and
    openssl, inside a root prefix): the key comes out root-only and the signing checks of act/signing.py take
    the pair its config lines would name. (Before: it pointed at ansible/README.md, which a node does not have.)"""
    import shlex
    from spark_memsaver.act import signing
    from spark_memsaver.decide.mok import MokKeyBlocked
    from spark_memsaver.host import Host
    needs.require("openssl", remedy="tools/deps/base.txt")
    quoted = re.findall(r"'(sudo (?:install|openssl) [^']*)'", MokKeyBlocked.remedy)
    assert [q.split()[1] for q in quoted] == ["install", "openssl"], MokKeyBlocked.remedy
    for q in quoted:
        argv = [a.replace("/etc/spark-memsaver", str(tmp_path / "etc/spark-memsaver")) if a.startswith("/etc/")
                else a for a in shlex.split(q)[1:]]
        if argv[0] == "install":
            (tmp_path / "etc/spark-memsaver").mkdir(parents=True, exist_ok=True)
        subprocess.run(argv, check=True, capture_output=True)
    host = Host(tmp_path)
    assert oct((tmp_path / "etc/spark-memsaver/private").stat().st_mode & 0o777) == "0o700"
    if os.geteuid() == 0:
        signing.check_key_file(host, "/etc/spark-memsaver/private/signing.key")
    assert (tmp_path / "etc/spark-memsaver/private/signing.key").stat().st_mode & 0o077 == 0
    assert signing.cert_info(host, "/etc/spark-memsaver/signing.crt")["subject"] == "spark-memsaver-signing"
    assert "ansible/" not in MokKeyBlocked.remedy
