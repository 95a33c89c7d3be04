"""The one installability decision (decide/installability.py, issue #14 item 2) and the rule it exists for:
``status`` recommends ``spark-memsaver install`` exactly when ``install`` would proceed, and when it would not,
status, install and reconcile name the same missing piece with the same code and the same exact remedy.

Real parts: Spark-shaped roots (tests/support/sparkroot.py: real ELF modules, real depmod, real efivarfs bytes),
varied one piece at a time; the real CLI as a subprocess with --root (status, install, every command that takes
--kernel); the executor's real dry run; for the source variants a real APT repository of real .debs read by the
real apt in the root (tests/test_sources.py's helpers), and for the fetchable one install's real fetch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

from spark_memsaver import config as cfgmod
from spark_memsaver.act import executor, installable
from spark_memsaver.decide.installability import installability
from spark_memsaver.host import Host
from tests.support import needs, sparkroot
from tests.support.worlds import typed

installability = typed(installability)   # dict snapshots -> model.World (tests/support/worlds.py)

REPO = Path(__file__).resolve().parent.parent
K = sparkroot.SPARK_KERNEL
DRV = sparkroot.DRIVER
PKG = f"nvidia-kernel-source-{DRV.split('.')[0]}-open"
UBU = f"{DRV}-0ubuntu0.24.04.1"
GATE_PREFIX = "cannot install for kernel"        # act/installable.refusal: the refusal of a missing piece


def cli(root: Path, *args, config: Path | None = None) -> tuple[int, dict, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    cmd = ["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root)]
    if config:
        cmd += ["--config", str(config)]
    r = subprocess.run(cmd + list(args), capture_output=True, text=True, env=env, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    try:
        doc = json.loads(r.stdout) if r.stdout.strip() else {}
    except json.JSONDecodeError:
        doc = {"stdout": r.stdout}
    return r.returncode, doc, r.stderr


# --- the variants: one Spark root each, one piece changed ---------------------------------------------

def _tree(root: Path, version: str = DRV) -> None:
    """A well-formed open kernel-module tree at /usr/src/nvidia-<version> (what the build's lookup accepts)."""
    from tests.test_sources import nvidia_tree
    shutil.rmtree(root / f"usr/src/nvidia-{version}", ignore_errors=True)
    nvidia_tree(root / f"usr/src/nvidia-{version}", version)


def _dkms(root: Path) -> None:
    """The root has DKMS, as a node with the package does (the planner reads /usr/sbin/dkms under the root)."""
    needs.require("dkms", remedy="tools/deps/installability.txt")
    exe = needs.which("dkms")
    (root / "usr/sbin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(exe, root / "usr/sbin/dkms")


def _apt(tmp: Path, root: Path, debs: list[tuple[str, str]]) -> None:
    """A real APT repository with these (deb version, tree version) source packages, known to the root's apt."""
    needs.require("apt-get", "apt-ftparchive", "dpkg-deb", remedy="tools/deps/installability.txt")
    from tests.test_sources import apt_root, index, make_deb
    repo = tmp / "repo"
    repo.mkdir()
    os.chmod(tmp, 0o755)          # apt's _apt download sandbox reads it
    for deb_version, tree_version in debs:
        make_deb(repo, PKG, deb_version, tree_version)
    index(repo)
    apt_root(root, repo)


def _spark(tmp: Path, **kw) -> Path:
    root = sparkroot.make_spark_root(tmp / "root", **kw)
    _tree(root)
    _dkms(root)
    return root


def _config(tmp: Path, text: str) -> Path:
    p = tmp / "config.yaml"
    p.write_text(text)
    return p


def v_complete(tmp):
    return _spark(tmp), None


def v_no_source(tmp):
    root = _spark(tmp)
    shutil.rmtree(root / f"usr/src/nvidia-{DRV}")
    return root, None


def v_source_fetchable(tmp):
    root = v_no_source(tmp)[0]
    _apt(tmp, root, [(UBU, DRV)])
    return root, None


def v_source_fetch_never(tmp):
    root = v_no_source(tmp)[0]
    _apt(tmp, root, [(UBU, DRV)])
    return root, _config(tmp, "source_fetch: never\n")


def v_source_not_in_lists(tmp):
    root = v_no_source(tmp)[0]
    _apt(tmp, root, [("580.178.04-0ubuntu0.24.04.1", "580.178.04")])     # another version only
    return root, None


def v_unknown_driver(tmp):
    root = _spark(tmp)
    ko = root / f"lib/modules/{K}/kernel/nvidia-580-open/nvidia.ko"
    sparkroot.make_module(ko, [("version", "599.1.1"), ("license", "Dual MIT/GPL"), ("name", "nvidia"),
                               ("vermagic", f"{K} SMP preempt mod_unload modversions aarch64")])
    subprocess.run(["depmod", "-b", str(root), K], check=True, capture_output=True)
    sparkroot.write(root, "/sys/module/nvidia/version", "599.1.1\n")
    return root, None


def v_secure_boot_unknown(tmp):
    root = _spark(tmp, secure_boot=True)
    sparkroot.write(root, f"/sys/firmware/efi/efivars/SecureBoot-{sparkroot.EFI_GLOBAL}", b"\x06\x00")  # truncated
    return root, None


def v_headers_missing(tmp):
    return _spark(tmp, headers=False), None


def v_preempt_rt(tmp):
    root = _spark(tmp)
    cfg = root / f"boot/config-{K}"
    cfg.write_text(cfg.read_text() + "CONFIG_PREEMPT_RT=y\n")
    return root, None


def v_key_not_enrolled(tmp):
    root = _spark(tmp, secure_boot=True)
    key, crt = sparkroot.make_signing_key(tmp / "keys", "spark-memsaver test key")
    (root / "var/lib/dkms").mkdir(parents=True, exist_ok=True)
    shutil.copy2(crt, root / "var/lib/dkms/mok.pub")          # DKMS's default certificate, in no MOK list
    shutil.copy2(key, root / "var/lib/dkms/mok.key")          # and its key: DKMS keeps the pair
    return root, None


def v_key_incomplete(tmp):
    root, _ = v_key_not_enrolled(tmp)
    (root / "var/lib/dkms/mok.key").unlink()                  # the certificate alone: nothing would sign
    return root, None


# name -> (builder, can_install, needs_fetch, missing codes in order, "then" codes)
VARIANTS = {
    "complete": (v_complete, True, False, [], []),
    "no-source": (v_no_source, False, False, ["driver-source-missing"], []),
    "source-fetchable": (v_source_fetchable, True, True, [], []),
    "source-fetch-never": (v_source_fetch_never, False, False, ["driver-source-missing"], []),
    "source-not-in-lists": (v_source_not_in_lists, False, False, ["driver-source-missing"], []),
    # 599.1.1 is listed by no version; without its tree its content (vs r595's hooked files) decides: the
    # missing piece is its source
    "unknown-driver": (v_unknown_driver, False, False, ["driver-source-missing"], []),
    "secure-boot-unknown": (v_secure_boot_unknown, False, False, ["secure-boot-unknown"], []),
    "headers-missing": (v_headers_missing, False, False, ["headers-missing"], []),
    "preempt-rt": (v_preempt_rt, False, False, ["kernel-outside-policy"], []),
    "key-not-enrolled": (v_key_not_enrolled, True, False, [], ["mok-not-enrolled"]),
    "key-incomplete": (v_key_incomplete, False, False, ["signing-key-incomplete"], ["mok-not-enrolled"]),
}


def _decide(root: Path, cfgpath: Path | None) -> tuple[dict, object]:
    config = cfgmod.load(str(cfgpath) if cfgpath else None, root=str(root))
    snap, support = installable.observe(Host(root), config)
    return installability(snap, config, support, K), config


# --- the table: snapshot -> decision -------------------------------------------------------------------

@pytest.mark.parametrize("name", list(VARIANTS))
def test_decision_table(name, tmp_path):
    build, can, fetch, missing, then = VARIANTS[name]
    root, cfgpath = build(tmp_path)
    d, _ = _decide(root, cfgpath)
    assert (d["can_install"], d["needs_fetch"], [m["code"] for m in d["missing"]],
            [t["code"] for t in d["then"]]) == (can, fetch, missing, then), d
    assert d["kernel"] == K
    for m in d["missing"] + d["then"]:
        assert m["detail"] and m["remedy"] and "<" not in m["remedy"], m     # no placeholder
    by = {m["code"]: m for m in d["missing"]}
    if name == "no-source":        # no APT state under the root: which package to look for, and how
        assert f"apt-cache policy {PKG}" in by["driver-source-missing"]["remedy"]
    if name == "source-fetch-never":                 # the exact command, never a placeholder
        assert by["driver-source-missing"]["remedy"] == f"sudo apt-get install {PKG}={UBU}"
        assert "source_fetch is 'never'" in by["driver-source-missing"]["detail"]
    if name == "source-not-in-lists":
        assert f"apt-cache policy {PKG}" in by["driver-source-missing"]["remedy"]
    if name == "source-fetchable":
        assert d["fetch"] == {"driver": DRV, "package": PKG, "deb_version": UBU}
    if name == "headers-missing":
        assert by["headers-missing"]["remedy"] == f"sudo apt-get install linux-headers-{K}"
    if name == "unknown-driver":
        assert "599.1.1" in by["driver-source-missing"]["detail"] and "by the content" in \
            by["driver-source-missing"]["detail"]
    if name == "preempt-rt":
        assert "PREEMPT_RT" in by["kernel-outside-policy"]["detail"]
        assert "kernels: all" not in by["kernel-outside-policy"]["remedy"]      # it would not help
    if name == "key-not-enrolled":
        assert "sudo spark-memsaver mok enroll" in d["then"][0]["remedy"]


def test_unknown_kernel_decision(tmp_path):
    root = _spark(tmp_path)
    config = cfgmod.Config()
    snap, support = installable.observe(Host(root), config)
    d = installability(snap, config, support, "9.9.9-nope")
    assert not d["can_install"] and [m["code"] for m in d["missing"]] == ["unknown-kernel"]
    assert K in d["missing"][0]["detail"] and K in d["missing"][0]["remedy"]


# --- the rule: status recommends install <=> install proceeds; same code and remedy everywhere ------------

def _findings(doc: dict) -> dict[str, dict]:
    return {f["code"]: f for f in doc["findings"]}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_status_recommends_install_iff_install_proceeds(name, tmp_path):
    build = VARIANTS[name][0]
    root, cfgpath = build(tmp_path)
    d, config = _decide(root, cfgpath)

    # 1. status (the real CLI)
    rc, doc, err = cli(root, "status", "--json", "--direct", config=cfgpath)
    assert rc in (0, 1), err
    jsonschema.validate(doc, json.loads((REPO / "daemon/spark_memsaver/report/status.schema.json").read_text()))
    found = _findings(doc)
    recommends = [f["code"] for f in doc["findings"] if "spark-memsaver install" in f["remedy"]]
    if d["can_install"]:
        assert "stock" in recommends, doc["findings"]
    else:
        assert recommends == [], doc["findings"]         # no remedy says install while a piece is missing
        if any(m["code"] != "kernel-outside-policy" for m in d["missing"]):
            assert rc == 1                               # a problem was found (the policy alone is no problem)
    for m in d["missing"]:                               # one finding per missing piece, same code and remedy
        assert found[m["code"]]["remedy"] == m["remedy"], (m, found.get(m["code"]))
        assert sum(1 for f in doc["findings"] if f["code"] == m["code"]) == 1

    # 2. the executor's dry run (what reconcile and the daemon do)
    plan = executor.perform("reconcile", Host(root), config, dry_run=True, kernels=[K])
    mine = [s for s in plan["steps"] if s.get("kernel") == K]
    if d["can_install"] and not d["then"]:
        assert [s["action"] for s in mine] == (["fetch-source"] if d["needs_fetch"] else []) + ["build-install"]
        if d["needs_fetch"]:
            assert mine[0]["driver"] == DRV
    else:
        (s,) = mine
        piece = (d["missing"] or d["then"])[0]
        assert s["action"] == "stay-stock" and s["code"] == piece["code"], s
        if d["missing"]:
            assert s["remedy"] == piece["remedy"]

    # 3. install (the real CLI): proceeds past the decision, or is refused with status's code and remedy
    rc, doc, err = cli(root, "install", "--kernel", K, "--json", config=cfgpath)
    e = doc.get("error") or {}
    if d["can_install"]:
        # it went on to fetch/build (the fixture's tree is no real NVIDIA tree, so the build itself may refuse)
        assert not e.get("message", "").startswith(GATE_PREFIX), e
        if d["needs_fetch"]:
            assert (root / "var/cache/spark-memsaver/sources" / f"nvidia-{DRV}" / "nvidia-uvm/uvm.c").is_file()
    else:
        first = d["missing"][0]
        assert rc == 1 and e["code"] == first["code"] and e["remedy"] == found[first["code"]]["remedy"], doc
        assert e["message"].startswith(GATE_PREFIX)
        assert not (root / "var/lib/spark-memsaver/intents").exists() or \
            not list((root / "var/lib/spark-memsaver/intents").iterdir())        # refused before acting
        # build: the same refusal (a build loads nothing, so the Secure Boot state does not stop it)
        rc, doc, err = cli(root, "build", "--kernel", K, "--json", config=cfgpath)
        e = doc.get("error") or {}
        if first["code"] == "secure-boot-unknown":
            assert not e.get("message", "").startswith(GATE_PREFIX), e
        else:
            assert rc == 1 and e["code"] == first["code"] and e["remedy"] == first["remedy"], doc


# --- unknown kernel: one behaviour for every command ---------------------------------------------------

@pytest.mark.parametrize("args", [("install", "--kernel"), ("remove", "--kernel"), ("build", "--kernel"),
                                  ("rollback", "--kernel"), ("reconcile", "--kernel"),
                                  ("reconcile", "--dry-run", "--kernel")], ids=" ".join)
def test_unknown_kernel_is_one_behaviour(args, tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "root")
    rc, doc, err = cli(root, *args, "9.9.9-nope", "--json")
    e = doc.get("error") or {}
    assert rc == 2, (rc, doc, err)
    assert e["code"] == "unknown-kernel", doc
    assert K in e["message"] and K in e["remedy"]          # it names the kernels that exist


def test_activate_when_the_running_kernel_is_not_installed(tmp_path):
    """activate names no kernel: its kernel is the running one; with that kernel's modules gone it is the same
    unknown-kernel (exit 2) instead of 'run install first' (which would be refused)."""
    root = sparkroot.make_spark_root(tmp_path / "root", extra_kernels=("6.14.0-1020-nvidia-64k",))
    shutil.rmtree(root / f"lib/modules/{K}")
    rc, doc, err = cli(root, "activate", "--dry-run", "--json")
    e = doc.get("error") or {}
    assert rc == 2 and e["code"] == "unknown-kernel" and "6.14.0-1020-nvidia-64k" in e["message"], (rc, doc, err)


@pytest.mark.parametrize("cmd", ["install", "remove", "build", "rollback"])
def test_unknown_kernel_for_a_user_on_the_live_system(cmd):
    """A non-root user on the live system (the path that asks spark-memsaverd, or is refused as not-permitted):
    an unknown kernel is the same unknown-kernel, exit 2, before anything is asked of the daemon or of root."""
    needs.root("switching to an unprivileged user needs root")
    needs.require("setpriv", remedy="util-linux")
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-m",
                        "spark_memsaver", cmd, "--kernel", "9.9.9-nope", "--json"], capture_output=True, text=True,
                       env=env, timeout=60, cwd="/")
    assert r.returncode == 2, (r.stdout, r.stderr)
    e = json.loads(r.stdout)["error"]
    from spark_memsaver.observe.snapshot import installed_kernels
    assert e["code"] == "unknown-kernel"
    assert e["details"]["installed"] == sorted(installed_kernels(Host("/")))       # it names those that exist


# --- the planner on pure snapshots: fetch-source once per driver; a rollback carries the piece's code ------

def _pure_snap(*releases, sources=(), by_driver=None, ours=None, nv=DRV):
    def kern(rel, running):
        sel = ({"path": f"/lib/modules/{rel}/updates/dkms/nvidia-uvm.ko", "version": ours, "patched": True}
               if ours else {"path": f"/lib/modules/{rel}/kernel/nvidia-580-open/nvidia-uvm.ko", "version": nv,
                             "patched": False})
        return {"release": rel, "running": running, "page_size": 65536, "headers": True, "uvm_selected": sel,
                "nvidia_selected": {"path": f"/lib/modules/{rel}/kernel/nvidia-580-open/nvidia.ko", "version": nv}}
    snap = {"host": {"kernel": releases[0], "arch": "aarch64", "page_size": 65536},
            "driver": {"loaded_version": nv, "sources": [{"version": v, "path": f"/usr/src/nvidia-{v}",
                                                          "open": True} for v in sources]},
            "uvm": {"loaded": False, "patched": False}, "kernels": [kern(r, i == 0) for i, r in enumerate(releases)],
            "dkms": {"available": True, "registrations": []}, "secure_boot": {"state": "not-needed"},
            "holders": [], "records": {"intents": [], "rollbacks": [], "unreadable": []}}
    if by_driver is not None:
        snap["driver_sources"] = {"mode": "auto", "by_driver": by_driver}
    return snap


def _entry(fetchable, remedy=None):
    return {"present": False, "path": None, "package": PKG, "deb_version": UBU, "in_lists": fetchable,
            "fetchable": fetchable, "remedy": remedy}


def test_plan_fetches_a_source_once_before_the_builds_that_need_it():
    from spark_memsaver.decide import plan as rc
    rc = typed(rc)
    k2 = "6.14.0-1020-nvidia-64k"
    s = _pure_snap(K, k2, by_driver={DRV: _entry(True)})
    steps = rc.plan(s, cfgmod.Config(), {DRV: {"supported": True}})
    assert [(x.action, x.kernel) for x in steps] == [("fetch-source", K), ("build-install", K), ("build-install", k2)]
    assert steps[0].driver == DRV and PKG in steps[0].reason and UBU in steps[0].reason
    # without the snapshot key: unknown, not fetchable -> stock, with the package to look for
    (st,) = [x for x in rc.plan(_pure_snap(K), cfgmod.Config(), {DRV: {"supported": True}}) if x.kernel == K]
    assert st.action == "stay-stock" and st.code == "driver-source-missing" and f"apt-cache policy {PKG}" in st.remedy


def test_rollback_after_a_driver_change_carries_the_missing_pieces_code_and_exact_remedy():
    from spark_memsaver.decide import plan as rc
    rc = typed(rc)
    exact = f"sudo apt-get install {PKG}={UBU}"
    s = _pure_snap(K, ours="580.95.05", by_driver={DRV: _entry(False, exact)})
    steps = rc.plan(s, cfgmod.Config(), {DRV: {"supported": True}})
    assert [x.action for x in steps] == ["remove-override", "record-rollback"]
    rec = steps[1]
    assert rec.code == "driver-source-missing" and rec.remedy == exact
    assert "changed from 580.95.05 to 580.142" in rec.reason


def test_status_when_the_running_kernel_is_not_installed(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "root", extra_kernels=("6.14.0-1020-nvidia-64k",))
    shutil.rmtree(root / f"lib/modules/{K}")
    rc, doc, err = cli(root, "status", "--json", "--direct")
    found = _findings(doc)
    assert rc == 1 and "unknown-kernel" in found, doc["findings"]
    assert "6.14.0-1020-nvidia-64k" in found["unknown-kernel"]["remedy"]
    assert not [f for f in doc["findings"] if "spark-memsaver install" in f["remedy"]
                and "--kernel" not in f["remedy"]], doc["findings"]


def test_fetchable_source_beside_another_missing_piece_recommends_nothing(tmp_path):
    """The source is fetchable but the headers are missing: install would be refused, so no remedy says
    install (not even the note about the fetch), and the decision still says the source is fetchable."""
    root = sparkroot.make_spark_root(tmp_path / "root", headers=False)
    shutil.rmtree(root / f"usr/src/nvidia-{DRV}")
    _dkms(root)
    _apt(tmp_path, root, [(UBU, DRV)])
    d, _ = _decide(root, None)
    assert not d["can_install"] and d["needs_fetch"] and [m["code"] for m in d["missing"]] == ["headers-missing"]
    rc, doc, err = cli(root, "status", "--json", "--direct")
    assert rc == 1 and not [f for f in doc["findings"] if "spark-memsaver install" in f["remedy"]], doc["findings"]


def test_a_rollback_record_advising_install_is_not_repeated_while_install_would_be_refused(tmp_path):
    """A rollback record written when a build failed says to retry with install; the source is gone since:
    status says rolled-back with what is missing now, never the stale 'spark-memsaver install'."""
    root = v_no_source(tmp_path)[0]
    sparkroot.write(root, f"/var/lib/spark-memsaver/rollbacks/{K}.json", json.dumps(
        {"kernel": K, "time": "2026-12-01T00:00:00Z", "reason": "building for driver 580.142 failed: make failed",
         "code": "build-failed", "remedy": f"spark-memsaver install --kernel {K}", "driver_to": DRV}))
    rc, doc, err = cli(root, "status", "--json", "--direct")
    assert doc["state"] == "rolled-back", doc
    assert not [f for f in doc["findings"] if "spark-memsaver install" in f["remedy"]], doc["findings"]
    assert "driver-source-missing" in _findings(doc)["rolled-back"]["remedy"]


def test_an_unlisted_driver_whose_source_is_fetchable_is_judged_by_content_after_the_fetch():
    """An unlisted version (a relabelled 550.163.01, say) without a tree: act/patch.support says unsupported with
    content_unchecked; with its source fetchable the plan fetches first (the build's apply then judges by content)
    instead of staying stock for 'not in the manifest'. Without a fetchable source it stays stock, unsupported."""
    from spark_memsaver.decide import plan as rc
    rc = typed(rc)
    unchecked = {"supported": False, "reason": f"NVIDIA driver {DRV} is not in this release's patch manifest",
                 "content_unchecked": True}
    s = _pure_snap(K, by_driver={DRV: _entry(True)})
    d = installability(s, cfgmod.Config(), {DRV: unchecked}, K)
    assert d["can_install"] and d["needs_fetch"] and d["qualification"] == "content-pending", d
    steps = rc.plan(s, cfgmod.Config(), {DRV: unchecked})
    assert [x.action for x in steps] == ["fetch-source", "build-install"]
    # not fetchable: what is missing is the source (its content decides), with the exact remedy, never
    # "update spark-memsaver"
    exact = f"sudo apt-get install {PKG}={UBU}"
    d2 = installability(_pure_snap(K, by_driver={DRV: _entry(False, exact)}), cfgmod.Config(), {DRV: unchecked}, K)
    assert not d2["can_install"] and [m["code"] for m in d2["missing"]] == ["driver-source-missing"], d2
    assert d2["missing"][0]["remedy"] == exact and "by the content" in d2["missing"][0]["detail"]
    # checked by content and drifted (content_unchecked False): unsupported even when fetchable
    drifted = dict(unchecked, content_unchecked=False)
    d3 = installability(s, cfgmod.Config(), {DRV: drifted}, K)
    assert not d3["can_install"] and [m["code"] for m in d3["missing"]] == ["driver-unsupported"], d3


@pytest.mark.parametrize("name", ["v_complete", "v_no_source"])
def test_activate_remedy_names_install_only_when_install_would_proceed(name, tmp_path):
    """activate with the stock nvidia-uvm selected is refused; its remedy says 'install' only where install
    would proceed, and otherwise the missing piece's remedy (act/activate._install_first)."""
    from spark_memsaver import config as cfgmod2
    from spark_memsaver.act import activate as act_activate
    from spark_memsaver.act.activate import ActivationRefused
    from spark_memsaver.host import Host
    root, _ = globals()[name](tmp_path)
    with pytest.raises(ActivationRefused) as e:
        act_activate.activate(Host(root), cfgmod2.Config(), dry_run=True)
    remedy = e.value.remedy
    if name == "v_complete":
        assert "spark-memsaver install" in remedy, remedy
    else:
        assert "spark-memsaver install" not in remedy and "apt-cache policy" in remedy, remedy
