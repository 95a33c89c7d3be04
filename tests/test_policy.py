"""decide/policy.py: the one kernel policy and the one tier vocabulary.

The agreement test runs the REAL dkms (the Debian package) on the dkms.conf that spark-memsaver renders
(act/render.py, the product path), against a kernel "source dir" holding only a .config: DKMS reads
BUILD_EXCLUSIVE before anything else and exits 77 when the kernel is excluded. The planner's verdict for
the same kernel configuration must be the same (FAULTS: PREEMPT_RT row).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from spark_memsaver.config import Config
from spark_memsaver.decide import plan as rc
from spark_memsaver.decide import policy
from spark_memsaver.host import Host
from tests.support import needs
from tests.support.worlds import typed

rc = typed(rc)   # dict snapshots -> model.World (tests/support/worlds.py)

K = "6.14.0-1015-nvidia-64k"
ARM64_64K = "CONFIG_ARM64=y\nCONFIG_ARM64_64K_PAGES=y\nCONFIG_MODVERSIONS=y\n"
ARM64_64K_RT = ARM64_64K + "CONFIG_PREEMPT_RT=y\n"
ARM64_4K = "CONFIG_ARM64=y\nCONFIG_ARM64_4K_PAGES=y\n# CONFIG_ARM64_64K_PAGES is not set\n"
X86 = "CONFIG_X86=y\nCONFIG_X86_64=y\n"
X86_RT = X86 + "CONFIG_PREEMPT_RT=y\n"


def _kconfig(text):
    return dict(line.split("=", 1) for line in text.splitlines() if line.startswith("CONFIG_"))


def _kernel(text, page):
    return {"release": K, "running": True, "page_size": page, "headers": True,
            "uvm_selected": {"path": "/x/nvidia-uvm.ko", "version": "550.163.01", "patched": False},
            "nvidia_selected": {"path": "/x/nvidia.ko", "version": "550.163.01"},
            **policy.kernel_facts(_kconfig(text))}


def _snap(k):
    return {"host": {"kernel": K, "arch": "aarch64", "page_size": k["page_size"]},
            "driver": {"loaded_version": None, "sources": [{"version": "550.163.01", "path": "/usr/src/nvidia-550.163.01",
                                                              "open": True}]},
            "uvm": {"loaded": False}, "kernels": [k], "dkms": {"available": True, "registrations": []},
            "secure_boot": {"state": "not-needed"}, "holders": [],
            "records": {"intents": [], "rollbacks": [], "unreadable": []}}


CASES = [  # kernels policy, kernel config, page size, arch DKMS is given, planner builds?
    ("64k-only", ARM64_64K, 65536, "aarch64", True),
    ("64k-only", ARM64_64K_RT, 65536, "aarch64", False),     # the PREEMPT_RT defect
    ("64k-only", ARM64_4K, 4096, "aarch64", False),
    ("64k-only", X86, 4096, "x86_64", False),
    ("all", X86, 4096, "x86_64", True),
    ("all", X86_RT, 4096, "x86_64", False),
    ("all", ARM64_64K_RT, 65536, "aarch64", False),
]


@pytest.mark.parametrize("kpol,text,page,arch,builds", CASES)
def test_planner_verdict(kpol, text, page, arch, builds):
    cfg = Config(kernels=kpol)
    steps = rc.plan(_snap(_kernel(text, page)), cfg, {"550.163.01": {"supported": True}})
    acts = [s.action for s in steps]
    assert acts == (["build-install"] if builds else ["stay-stock"]), [s.to_dict() for s in steps]
    ok, why = policy.kernel_in_policy(_kernel(text, page), cfg)
    assert ok is builds and (ok or why)
    if "PREEMPT_RT=y" in text:
        assert "PREEMPT_RT" in why
    v = policy.verdict(_kernel(text, page), cfg)
    assert (v.ok, v.why) == (ok, why) and v.rule == ("" if ok else "preempt-rt" if "PREEMPT_RT=y" in text
                                                      else "page-size")


def test_the_build_preflight_reads_the_same_verdict_and_the_remedy_follows_its_rule():
    """The DKMS engines' preflight (act/build._preflight, act/override's install targets) asks
    decide/policy.verdict over the kernel's configuration alone; installability's remedy follows the verdict's
    rule, not its message text."""
    from spark_memsaver.decide import installability
    unreadable = policy.kernel_of("6.8.0-x", None)
    v = policy.verdict(unreadable, Config(kernels="64k-only"))
    assert not v.ok and v.rule == "config-unreadable" and "configuration cannot be read" in v.why
    assert policy.verdict(unreadable, Config(kernels="all")).ok
    assert policy.verdict(policy.kernel_of("6.8.0-x", {"CONFIG_ARM64": "y", "CONFIG_ARM64_64K_PAGES": "y"}),
                          Config(kernels="64k-only")).ok
    rt = policy.verdict(policy.kernel_of("6.8.0-rt", {"CONFIG_ARM64": "y", "CONFIG_ARM64_64K_PAGES": "y",
                                                      "CONFIG_PREEMPT_RT": "y"}), Config(kernels="64k-only"))
    assert rt.rule == "preempt-rt" and "boot a kernel without PREEMPT_RT" in installability.policy_remedy(
        Config(kernels="64k-only"), rt)
    # the message text no longer steers the remedy: a page-size refusal that names PREEMPT_RT stays page-size's
    odd = policy.PolicyVerdict(False, "kernel PREEMPT_RT-named has 4 KiB pages", "page-size")
    assert "PREEMPT_RT" not in installability.policy_remedy(Config(kernels="64k-only"), odd)


def _dkms_excludes(tmp_path, kpol, text, arch) -> bool:
    """Render our DKMS tree as the product does, register it with the real dkms in a private tree and ask
    dkms to build for a kernel whose .config is ``text``: exit 77 = BUILD_EXCLUSIVE excluded it."""
    from spark_memsaver.act import render
    from spark_memsaver.observe.dkms import PACKAGE
    root = tmp_path / "root"
    (root / "usr/src").mkdir(parents=True, exist_ok=True)
    r = render.render(Host(root), Config(kernels=kpol), "550.163.01", "/usr/src/nvidia-550.163.01")
    src, tree, ksrc = root / "usr/src", tmp_path / "dkmstree", tmp_path / "ksrc"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir()
    ksrc.mkdir(exist_ok=True)
    (ksrc / ".config").write_text(text)
    common = ["--sourcetree", str(src), "--dkmstree", str(tree)]
    subprocess.run(["dkms", "add", "-m", PACKAGE, "-v", r["version"], *common], check=True,
                   capture_output=True, timeout=60)
    b = subprocess.run(["dkms", "build", "-m", PACKAGE, "-v", r["version"], "-k", K, "-a", arch,
                        "--kernelsourcedir", str(ksrc), *common], capture_output=True, text=True, timeout=120)
    assert b.returncode != 0, "dkms went on to build: the test kernel has no headers, it must stop early"
    return b.returncode == 77


@pytest.mark.parametrize("kpol,text,page,arch,builds", CASES)
def test_dkms_agrees_with_the_planner(tmp_path, kpol, text, page, arch, builds):
    needs.require("dkms", remedy="tools/deps/dkms.txt")
    assert _dkms_excludes(tmp_path, kpol, text, arch) is (not builds)


@pytest.mark.parametrize("kpol", ["64k-only", "all"])
def test_rendered_dkms_conf_carries_the_policy_rules(tmp_path, kpol):
    """The renderer passes policy.dkms_build_exclusive (RULES); the template has no rule of its own: without the
    values it does not render at all (StrictUndefined), so the two can never differ."""
    import jinja2
    from pathlib import Path
    from spark_memsaver.act import render
    from spark_memsaver.host import Host
    root = tmp_path / "root"
    (root / "usr/src").mkdir(parents=True)
    r = render.render(Host(root), Config(kernels=kpol), "580.142", "/usr/src/nvidia-580.142")
    text = (root / r["path"].lstrip("/") / "dkms.conf").read_text()
    arch, terms = policy.RULES[kpol]
    assert f'BUILD_EXCLUSIVE_CONFIG="{" ".join(terms)}"' in text
    assert (f'BUILD_EXCLUSIVE_ARCH="{arch}"' in text) is bool(arch) and text.count("BUILD_EXCLUSIVE_ARCH=") == bool(arch)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(__file__).parent.parent / "dkms/templates")),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    with pytest.raises(jinja2.UndefinedError):
        env.get_template("dkms.conf.j2").render(package="p", dkms_version="1", driver_version="d", our_version="o",
                                                nvidia_source="s", kernels_policy=kpol)


def test_tier_vocabulary():
    assert policy.DEFAULT_TIER == "leaf" == Config().tier
    assert {n: policy.tier_value(n) for n in ("leaf", "4k-all", "256", "4k")} == \
        {"leaf": 3, "4k-all": 1, "256": 2, "4k": 1}
    assert policy.normalize_tier(256) == "256" and policy.normalize_tier("4k") == "4k-all"
    for bad in ("512", "", None, True, "LEAF"):
        with pytest.raises(policy.TierInvalid) as e:
            policy.normalize_tier(bad)
        assert "leaf, 4k-all, 256" in e.value.message
    # the names the module's counters print for each value (uvm_pt_pack.c pt_pack_tier_str)
    assert all(policy.MODULE_TIERS[v] == n for n, v in policy.TIERS.items())


def test_apply_step_accepts_tier_3():
    from spark_memsaver.act import patch
    assert 3 in patch.TIERS and patch.TIERS[3] == "leaf"


def test_settings_changed():
    rec = {"tier": "4k", "kernels": "64k-only"}          # a 0.1.0 build: old tier name
    assert policy.settings_changed(rec, Config(tier="4k-all")) == []
    assert policy.settings_changed(rec, Config()) == ["tier 4k-all -> leaf"]
    assert policy.settings_changed(rec, Config(kernels="all", tier="4k-all")) == ["kernels 64k-only -> all"]
    assert policy.settings_changed(None, Config()) == []
