"""Status says one thing (issue 34, item 5): the first screen, -v, --json, -q and metrics against each other
and against the plans the commands' dry runs show, on Spark-shaped fixture roots (tests/support/sparkroot.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import sparkroot
from tests.support.inproc import cli
from tests.support.statespace import add_dkms_build

K = sparkroot.SPARK_KERNEL
REPO = Path(__file__).resolve().parent.parent


def first(text: str) -> dict:
    rows = {}
    for ln in text.splitlines():
        m = re.match(r"^([A-Za-z][A-Za-z -]*):\s+(.*)$", ln)
        if m:
            rows.setdefault(m.group(1), m.group(2))
    return rows


def test_the_running_tier_is_what_status_metrics_and_risk_say(tmp_path, bases):
    """Ours packing tier 256 with 'tier: leaf' configured: plain status never showed the running tier, metrics
    labelled it tier="leaf", Risk left out that 256 is not validated on hardware."""
    root = str(sparkroot.make_spark_root(tmp_path / "r", uvm_loaded="ours", ours_installed="580.142",
                                         stats=sparkroot.stats_text(tier="256")))
    _, text, _ = cli("--root", root, "status")
    rows = first(text)
    assert rows["nvidia-uvm"] == "ours (loaded, tier 256; configured: leaf)", rows
    assert "tier 256 is not validated on hardware" in rows["Risk"], rows
    _, metrics, _ = cli("--root", root, "metrics")
    assert re.search(r'^spark_memsaver_info\{[^}]*tier="256"', metrics, re.M), metrics
    assert 'tier="leaf"' not in metrics


def test_risk_comes_from_the_qualification_of_the_exact_tree(tmp_path, bases):
    """The fixture's driver tree has hooked files that differ from the manifest's record: -v said 'untested',
    Risk said 'compile- and qemu-verified'."""
    root = str(sparkroot.make_spark_root(tmp_path / "r"))
    _, verbose, _ = cli("--root", root, "status", "--verbose")
    rows = first(verbose)
    assert "580.142: untested" in rows["Driver sources"], rows
    assert "qemu-verified" not in rows["Risk"] and "driver 580.142's tree: untested" in rows["Risk"], rows
    assert "hooked files drifted" in rows["Risk"], rows


def test_built_says_next_install_as_its_dry_run_plans(tmp_path, bases):
    """A build of ours that is not installed: 'Next: nothing to do' while 'install --dry-run' planned the install
    (and 'reconcile --dry-run' said there was no build of our module)."""
    root = sparkroot.make_spark_root(tmp_path / "r")
    add_dkms_build(root, K, "580.142", installed=False)
    _, doc, _ = cli("--root", str(root), "status", "--json")
    doc = json.loads(doc)
    assert doc["state"] == "built", doc["state"]
    _, text, _ = cli("--root", str(root), "status")
    assert first(text)["Next"].startswith("Run 'sudo spark-memsaver install'"), text
    code, plan, err = cli("--root", str(root), "install", "--dry-run", "--json")
    plan = json.loads(plan)
    assert code == 0 and plan["steps"][0]["action"] == "build" and plan["steps"][0]["reason"].startswith("reuse"), plan
    _, rec, _ = cli("--root", str(root), "reconcile", "--dry-run", "--json")
    reasons = [s["reason"] for s in json.loads(rec)["steps"] if s["kernel"] == K]
    assert reasons and all("no build of our module" not in r for r in reasons), reasons


def test_activate_dry_run_on_an_inactive_node_does_not_say_active(tmp_path, bases):
    """Ours loaded with uvm_pt_pack=0 (state inactive): 'activate --dry-run' printed 'active: ...'."""
    root = str(sparkroot.make_spark_root(tmp_path / "r", uvm_loaded="ours", ours_installed="580.142",
                                         stats=sparkroot.stats_text(tier="off", packed=0, t256=0, t4k=0)))
    _, doc, _ = cli("--root", root, "status", "--json")
    assert json.loads(doc)["state"] == "inactive"
    code, out, _ = cli("--root", root, "activate", "--dry-run")
    assert not out.startswith("active:") and "packing nothing" in out, out


def _as_nobody(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    kw = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    return subprocess.run([sys.executable, "-m", "spark_memsaver", *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd="/", **kw)


def test_reconcile_without_root_is_not_permitted():
    """'spark-memsaver reconcile' by a user on the live system went on to the lock directory and ended as
    error[internal-error], exit 3 (every other mutating command refuses with not-permitted, exit 1)."""
    r = _as_nobody("reconcile")
    assert r.returncode == 1 and "error[not-permitted]" in r.stderr and "internal" not in r.stderr, r.stderr
    assert "sudo spark-memsaver reconcile" in r.stderr


def test_remove_plans_the_reload_it_does(tmp_path, bases):
    """Ours loaded: remove's plan had no reload step (rollback's has one, and reloads), and status then asked
    for 'modprobe -r ... &&' by hand. The plan names it and the run does it (act/steps.reload_uvm: here, under
    a root prefix, it is skipped and the result says so)."""
    root = str(sparkroot.make_spark_root(tmp_path / "r", uvm_loaded="ours", ours_installed="580.142"))
    _, plan, _ = cli("--root", root, "remove", "--dry-run", "--json")
    assert [s["action"] for s in json.loads(plan)["steps"]][-1] == "reload-uvm", plan
    code, done, err = cli("--root", root, "remove", "--json")
    done = json.loads(done)
    assert code == 0 and done["reload"] == {"ok": False, "skipped": "not the running system"}, (done, err)


def _agreement(root: str) -> tuple[dict, str, int, str]:
    _, doc, _ = cli("--root", root, "status", "--json")
    _, text, _ = cli("--root", root, "status")
    q, _, _ = cli("--root", root, "status", "--quiet")
    _, metrics, _ = cli("--root", root, "metrics")
    return json.loads(doc), text, q, metrics


def test_an_unreadable_hold_is_set_aside_by_the_reconcile_its_remedy_names(tmp_path, bases):
    """holds/all.json not valid JSON: the remedy said 'run reconcile', which never set it aside (the Hold line
    said held, metrics said held 0, -q stayed 1 for ever). Now metrics say held by "unreadable" while it is
    there; reconcile sets it aside and keeps the administrator's hold in a readable record."""
    root = sparkroot.make_spark_root(tmp_path / "r")
    sparkroot.write(root, "/var/lib/spark-memsaver/holds/all.json", "{not json")
    doc, text, q, metrics = _agreement(str(root))
    assert doc["hold"] and first(text).get("Hold"), text
    assert 'spark_memsaver_held{by="unreadable"} 1' in metrics, metrics
    assert q == 1 and any(f["code"] == "record-quarantined" for f in doc["findings"])
    code, out, err = cli("--root", str(root), "reconcile")
    assert code == 0, (out, err)
    assert list((root / "var/lib/spark-memsaver/holds").glob("all.json.bad-*")), out
    doc, text, q, metrics = _agreement(str(root))
    assert doc["hold"]["by"] == "remove" and doc["hold"]["kernel"] is None, doc["hold"]
    assert 'spark_memsaver_held{by="remove"} 1' in metrics and 'spark_memsaver_held{by="unreadable"} 0' in metrics
    assert q == 0 and not any(f["code"] == "record-quarantined" for f in doc["findings"]), doc["findings"]
    _, plan, _ = cli("--root", str(root), "reconcile", "--dry-run", "--json")
    assert [s["action"] for s in json.loads(plan)["steps"]] == ["held"], plan


# --- found by tests/test_state_space.py ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    from tests.support import statespace as ss
    return ss.make_bases(tmp_path_factory.mktemp("bases"))


def _state(tmp_path, bases, **dims):
    from tests.support import statespace as ss
    st = {n: v[0] for n, v in ss.DIMS}
    st.update(dims)
    return str(ss.build(st, bases, tmp_path / "node"))


def _next(root: str) -> str:
    from spark_memsaver.report.summary import next_step
    _, doc, _ = cli("--root", root, "status", "--json")
    return next_step(json.loads(doc)) or ""


def test_a_held_node_whose_install_would_be_refused_names_the_missing_piece_first(tmp_path, bases):
    """Held, and the driver's source gone: Next said 'Run sudo spark-memsaver install to resume', which install
    refuses (driver-source-missing)."""
    root = _state(tmp_path, bases, hold="kernel", source="absent")
    nxt = _next(root)
    assert "resume packing" in nxt and nxt.index("apt-get install") < nxt.index("spark-memsaver install"), nxt


def test_no_key_whose_install_would_be_refused_names_the_missing_piece_first(tmp_path, bases):
    """Secure Boot on, no key, driver source gone: mok-no-key's remedy began with 'run sudo spark-memsaver
    install' (it makes DKMS's key), which install refuses."""
    root = _state(tmp_path, bases, sb="on", source="absent")
    _, doc, _ = cli("--root", root, "status", "--json")
    f = next(f for f in json.loads(doc)["findings"] if f["code"] == "mok-no-key")
    assert f["remedy"].index("apt-get install") < f["remedy"].index("spark-memsaver install"), f["remedy"]


def test_activation_pending_while_in_use_says_stop_the_work_first(tmp_path, bases):
    """Installed, stock loaded and held by a CUDA process: Next said 'Run sudo spark-memsaver activate', whose dry
    run (and run) waits for the device to be free, exit 1."""
    root = _state(tmp_path, bases, base="ours", holders=1)
    nxt = _next(root)
    assert nxt.startswith("Stop the CUDA work holding /dev/nvidia-uvm (vllm-worker[4242])"), nxt


def test_rollback_of_a_loaded_module_no_longer_selected_plans_and_records_the_reload(tmp_path, bases):
    """Ours loaded but the stock module selected (packing-predicates-unmet: Next is rollback): rollback's dry run
    planned nothing and the run did nothing, so following Next looped; the reload is the step."""
    root = _state(tmp_path, bases, loaded="ours-unmet")
    assert "spark-memsaver rollback" in _next(root)
    _, plan, _ = cli("--root", root, "rollback", "--dry-run", "--json")
    assert [s["action"] for s in json.loads(plan)["steps"]] == ["reload-uvm"], plan
    _, done, _ = cli("--root", root, "rollback", "--json")
    assert json.loads(done)["reload"] == {"ok": False, "skipped": "not the running system"}, done


def test_a_dry_run_lists_what_the_run_recovers_first(tmp_path, bases):
    """An interrupted remove: 'rollback --dry-run' planned to take ours away from the kernel the run's recovery
    finishes first (the run then acted on the others only)."""
    root = _state(tmp_path, bases, base="two-ours", intent="remove")
    _, plan, _ = cli("--root", root, "rollback", "--dry-run", "--json")
    plan = json.loads(plan)
    assert plan.get("recovery") == 1 and plan["steps"][0]["action"] == "finish-intent", plan
    _, done, _ = cli("--root", root, "rollback", "--json")
    assert [r["action"] for r in json.loads(done)["recovered"]] == ["finish-intent"], done


def test_activation_pending_beside_another_running_driver_says_reboot(tmp_path, bases):
    """Installed for the driver on disk while an older nvidia runs (found by a 2000-state run): Next said
    'Run sudo spark-memsaver activate', which refuses ('Reboot: nvidia.ko ... loads at boot')."""
    root = _state(tmp_path, bases, base="ours", nvidia="580.95.05")
    nxt = _next(root)
    assert nxt.startswith("Reboot: nvidia.ko 580.142 on disk"), nxt
    code, _, err = cli("--root", root, "activate", "--dry-run")
    assert code == 1 and "Reboot: nvidia.ko 580.142 on disk" in err, err


def test_loaded_driver_mismatch_next_reloads_without_a_hold(tmp_path, bases):
    """Ours loaded for 580.142 beside a loaded nvidia 580.95.05: Next was 'rollback', which writes the
    administrator's hold (automation then leaves the kernel stock for good) where nothing asked for one. The step
    is reconcile's reload (no hold), or a reboot; with the device in use, a person stops the work first."""
    root = _state(tmp_path, bases, base="ours", loaded="ours", nvidia="580.95.05")
    nxt = _next(root)
    assert nxt.startswith("Run 'sudo spark-memsaver reconcile'") and "rollback" not in nxt, nxt
    _, plan, _ = cli("--root", root, "reconcile", "--dry-run", "--json")
    assert "reload-uvm" in [s["action"] for s in json.loads(plan)["steps"]], plan
    code, done, _ = cli("--root", root, "reconcile", "--json")
    assert code == 0, done
    _, doc, _ = cli("--root", root, "status", "--json")
    assert json.loads(doc).get("hold") is None, doc
    busy = _state(tmp_path / "busy", bases, base="ours", loaded="ours", nvidia="580.95.05", holders=1)
    nxt = _next(busy)
    assert nxt.startswith("Stop the CUDA work using /dev/nvidia-uvm (vllm-worker[4242]), then run 'sudo "
                          "spark-memsaver reconcile'") and "rollback" not in nxt, nxt


def test_a_damaged_source_tree_is_named_by_status_and_refused_alike_by_install(tmp_path):
    """/usr/src/nvidia-580.142 with nvidia-uvm/uvm.c gone: status used to show no finding and say Next: install,
    whose dry run planned a build, while the real install refused with driver-source-corrupt. Now status, the
    dry run and the refusal apply the build's one completeness rule (world/tree.tree_problem)."""
    root = sparkroot.make_spark_root(tmp_path / "r")
    _, text, _ = cli("--root", str(root), "status", "--json")
    assert "driver-source-corrupt" not in [f["code"] for f in json.loads(text)["findings"]]
    (root / f"usr/src/nvidia-{sparkroot.DRIVER}/nvidia-uvm/uvm.c").unlink()
    _, text, _ = cli("--root", str(root), "status", "--json")
    doc = json.loads(text)
    found = {f["code"]: f for f in doc["findings"]}
    assert "nvidia-uvm/uvm.c is missing or empty" in found["driver-source-corrupt"]["message"], sorted(found)
    _, text, _ = cli("--root", str(root), "status")
    assert first(text)["Next"] == found["driver-source-corrupt"]["remedy"], (first(text), found)
    rc, out, err = cli("--root", str(root), "install", "--dry-run")
    assert rc != 0 and "error[driver-source-corrupt]" in out + err and "nvidia-uvm/uvm.c" in out + err, (rc, out, err)


def test_enrolling_on_a_stock_node_keeps_the_install_step(tmp_path):
    """Secure Boot enforcing, DKMS's key pair present but not enrolled, nothing of ours installed: Next said 'mok
    enroll, then reboot ...: our module becomes active by itself at that boot' -- but nothing of ours would be there
    to become active (the install step was lost). Now it is install's own order: install, then enroll."""
    root = sparkroot.make_spark_root(tmp_path / "r", secure_boot=True)
    key, crt = sparkroot.make_signing_key(tmp_path / "keys", "DKMS module signing key")
    (root / "var/lib/dkms").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/dkms/mok.pub").write_bytes(crt.read_bytes())
    (root / "var/lib/dkms/mok.key").write_bytes(key.read_bytes())
    (root / "var/lib/dkms/mok.key").chmod(0o600)
    _, text, _ = cli("--root", str(root), "status")
    nxt = first(text)["Next"]
    assert first(text)["Secure Boot"] == "not-enrolled", first(text)
    assert nxt.startswith("Run 'sudo spark-memsaver install'") and "mok enroll" in nxt, nxt
    assert nxt.index("install") < nxt.index("mok enroll") < nxt.index("becomes active"), nxt
    rc, out, err = cli("--root", str(root), "install", "--dry-run")
    assert rc == 0 and out.splitlines()[1].split()[0] == "build", (rc, out, err)


def test_a_certificate_without_its_key_is_named_by_status_and_refused_alike_by_install(tmp_path):
    """DKMS's certificate there, its private key gone: status said Next 'install' (Secure Boot off) or 'mok enroll'
    (on), install's dry run planned a build, and the real install refused signing-key-incomplete. Now the key is
    observed beside the certificate (never read), and status, the dry run and the refusal name the same pair."""
    for sb in (False, True):
        root = sparkroot.make_spark_root(tmp_path / f"r{sb}", secure_boot=sb)
        key, crt = sparkroot.make_signing_key(tmp_path / f"keys{sb}", "DKMS module signing key")
        (root / "var/lib/dkms").mkdir(parents=True, exist_ok=True)
        (root / "var/lib/dkms/mok.pub").write_bytes(crt.read_bytes())
        _, text, _ = cli("--root", str(root), "status", "--json")
        found = {f["code"]: f for f in json.loads(text)["findings"]}
        assert "mok.key does not" in found["signing-key-incomplete"]["message"], (sb, sorted(found))
        _, text, _ = cli("--root", str(root), "status")
        assert first(text)["Next"].startswith("Restore the missing file of the pair"), (sb, first(text))
        assert "becomes active" not in first(text)["Next"], (sb, first(text))
        rc, out, err = cli("--root", str(root), "install", "--dry-run")
        assert rc != 0 and "error[signing-key-incomplete]" in out + err, (sb, rc, out, err)
        (root / "var/lib/dkms/mok.key").write_bytes(key.read_bytes())       # the pair whole again
        _, text, _ = cli("--root", str(root), "status", "--json")
        assert "signing-key-incomplete" not in [f["code"] for f in json.loads(text)["findings"]], sb


def test_a_key_path_dkms_resolves_itself_is_not_called_missing(tmp_path):
    """A mok_signing_key with a shell variable (DKMS expands it, status cannot) is 'not known', never 'missing':
    no signing-key-incomplete on a guess; a plain path is probed as act/signing.plan probes it (host.exists)."""
    from spark_memsaver.host import Host
    from spark_memsaver.observe import mok
    root = sparkroot.make_spark_root(tmp_path / "r")
    _, crt = sparkroot.make_signing_key(tmp_path / "keys", "DKMS module signing key")
    (root / "var/lib/dkms").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/dkms/mok.pub").write_bytes(crt.read_bytes())
    conf = root / "etc/dkms/framework.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text('mok_signing_key="/var/lib/dkms/${kernelver}.key"\nmok_certificate=/var/lib/dkms/mok.pub\n')
    ci = mok.locate_certificate(Host(root))
    assert ci.present and ci.key_path == "/var/lib/dkms/${kernelver}.key" and ci.key_present is None, ci
    _, text, _ = cli("--root", str(root), "status", "--json")
    assert "signing-key-incomplete" not in [f["code"] for f in json.loads(text)["findings"]]
    conf.write_text('mok_signing_key=/var/lib/dkms/other.key\nmok_certificate=/var/lib/dkms/mok.pub\n')
    assert mok.locate_certificate(Host(root)).key_present is False
