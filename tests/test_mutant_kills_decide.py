"""Decisions of decide/ that a mutation run (tools/mutation-run, issue 29 item 3) found unguarded by the fast
tests: each test pins one behaviour through the module's public entry point and names the mutant it kills."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from spark_memsaver import record
from spark_memsaver import world
from spark_memsaver.config import Config
from spark_memsaver.decide import hold, ours, packing, qualification
from spark_memsaver.decide.status import evaluate
from spark_memsaver.host import Host
from spark_memsaver.model import Records, world_of
from spark_memsaver.observe import mok as omok
from tests.test_decide import K, base_snapshot, module, ours_loaded
from tests.test_mok import certs, make_root, scenarios  # noqa: F401  (certs: the fixture, openssl-made)
from tests.support.worlds import typed

evaluate = typed(evaluate)   # dict snapshots -> model.World (tests/support/worlds.py)

REPO = Path(__file__).resolve().parent.parent


def _codes(v):
    return [f.code for f in v.findings]


# --- decide/status.py ----------------------------------------------------------------------------------------

def test_status_loaded_ours_is_not_outside_policy_on_a_4k_kernel():
    """A 4 KiB kernel (outside the default 64k-only policy) still runs our module, loaded before the policy
    changed, while the stock one is selected on disk: the finding is about ours (status goes on to the loaded
    module), not 'kernel-outside-policy' with an early not-applicable. (Kills: ``uvm.get("loaded")`` misread.)"""
    s = ours_loaded(base_snapshot())
    s["host"]["page_size"] = s["kernels"][0]["page_size"] = 4096
    s["kernels"][0]["uvm_selected"] = module()
    v = evaluate(s, Config())
    assert "kernel-outside-policy" not in _codes(v) and v.state != "not-applicable", (v.state, _codes(v))


def test_status_64k_kernel_outside_policy_for_another_reason_is_still_judged():
    """A 64 KiB PREEMPT_RT kernel is outside the policy, but the host is a 64 KiB host: the policy note is
    given and status carries on (stock, with the install advice), never not-applicable as for a 4 KiB host.
    (Kills: the host's ``page_size`` misread in the early return.)"""
    s = base_snapshot()
    s["kernels"][0]["kconfig"] = {"CONFIG_ARM64": "y", "CONFIG_ARM64_64K_PAGES": "y", "CONFIG_PREEMPT_RT": "y"}
    v = evaluate(s, Config())
    assert (v.state, _codes(v)) == ("stock", ["kernel-outside-policy", "stock"])


def test_status_rollback_advice_that_would_be_refused_is_replaced():
    """The rollback record says 'sudo spark-memsaver install --kernel K', but install would be refused now
    (no headers): the rolled-back finding's remedy is what is missing first, not the refused command.
    (Kills: ``remedy = None`` in place of the install advice.)"""
    s = base_snapshot()
    s["kernels"][0]["headers"] = False
    s["records"]["rollbacks"] = [{"kernel": K, "time": "2026-01-01T00:00:00Z", "code": "build-failed",
                                  "reason": "make failed", "remedy": f"sudo spark-memsaver install --kernel {K}"}]
    v = evaluate(s, Config())
    assert v.state == "rolled-back"
    (rb,) = [f for f in v.findings if f.code == "rolled-back"]
    assert rb.remedy.startswith("Nothing is broken: the stock nvidia-uvm is in use. Packing needs what the "
                                "findings above name first (headers-missing") and "install" not in rb.remedy


def test_status_what_install_lacks_is_a_warning():
    """No driver source for the loaded driver: the install finding is a warning with its remedy, for the
    kernel. (Kills: the install findings' severity mutated.)"""
    s = base_snapshot()
    s["driver"]["sources"] = []
    v = evaluate(s, Config())
    (m,) = [f for f in v.findings if f.code == "driver-source-missing"]
    assert (m.severity, m.kernel) == ("warning", K) and "580.142" in m.remedy


# --- decide/mok.py: the reasons 'mok status' and status print -------------------------------------------------

def test_mok_reasons_are_said_whole(tmp_path, certs):
    """Each verdict's reason is the sentence a user reads, whole: shim validation disabled says that the kernel
    does not enforce Secure Boot; an unreadable certificate names its path first; a request from before the
    last reboot says when it was made. (Kills: those three strings mutated.)"""
    sc = scenarios(certs)

    def reason(name, **extra):
        variables, cert, _, kw = sc[name]
        return world.secure_boot(Host(make_root(tmp_path / name, variables, cert, **kw, **extra)))["reason"]
    assert reason("validation-disabled") == ("shim validation is disabled (MokSBStateRT, 'mokutil "
                                             "--disable-validation'): the kernel does not enforce Secure Boot")
    assert reason("cert-garbage").startswith("signing certificate /var/lib/dkms/mok.pub: ")
    sha = hashlib.sha256(certs["ours"]).hexdigest()
    missed = reason("pending-enroll", extra={
        "/proc/sys/kernel/random/boot_id": "boot-B\n",
        omok.REQUEST_RECORD: json.dumps({"cert_sha256": sha, "boot_id": "boot-A",
                                        "requested_at": "2026-11-30T01:00Z"})})
    assert missed.startswith("an enrollment request (MokNew) is waiting: on the next boot confirm it at the console "
                             "in MokManager; it was requested at 2026-11-30T01:00Z, before the last reboot, so "
                             "MokManager did not run then ("), missed


# --- decide/qualification.py ----------------------------------------------------------------------------------

def test_hooked_paths_leave_out_a_deleted_file():
    """A hook patch that deletes a file ('+++ /dev/null') hooks no file of that name. (Kills: the /dev/null
    comparison mutated, which listed 'dev/null' as a hooked file.)"""
    diff = ("--- a/nvidia-uvm/uvm_gone.c\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n"
            "--- a/nvidia-uvm/uvm_mmu.c\n+++ b/nvidia-uvm/uvm_mmu.c\t2026-01-01\n@@ -1 +1 @@\n-a\n+b\n")
    assert qualification.hooked_paths(diff) == ["nvidia-uvm/uvm_mmu.c"]


def test_an_nvidia_tests_entry_without_runs_is_named():
    """(Kills: the message mutated.)"""
    for raw in (None, [], {"suite": "x"}):
        assert qualification.check_test_records(raw, "nvidia-tests") == (
            "nvidia-tests needs nvidia_tests: a list of runs (suite, kernel, page_size, tiers, date)")


# --- decide/ours.py --------------------------------------------------------------------------------------------

def test_selection_names_each_of_its_three_answers():
    """(Kills: the 'stock' answer mutated: no caller compares with it, but it is the documented value.)"""
    assert ours.selection(world_of(base_snapshot()).kernels[0]) == "stock"
    assert ours.selection(world_of(ours_loaded(base_snapshot())).kernels[0]) == "consistent"
    s = ours_loaded(base_snapshot())
    s["kernels"][0]["nvidia_selected"] = module(version="580.159")
    assert ours.selection(world_of(s).kernels[0]) == "mismatch"


# --- decide/packing.py: the one "packing active" reader --------------------------------------------------------

@pytest.mark.parametrize("uvm,active", [
    (None, False), ("garbage", False),
    ({"loaded": True, "patched": True, "packing": {"tier": "leaf", "trees_packed": 3}}, True),
    ({"loaded": True, "patched": True, "packing": {"tier": "leaf", "trees_packed": 0, "trees_unpacked": 0}}, True),
    ({"loaded": False, "patched": True, "packing": {"tier": "leaf", "trees_packed": 3}}, False),
    ({"loaded": True, "patched": False, "packing": {"tier": "leaf", "trees_packed": 3}}, False),
    ({"loaded": True, "patched": True, "packing": {}}, False),
    ({"loaded": True, "patched": True, "packing": "leaf"}, False),
    ({"loaded": True, "patched": True, "packing": {"error": "format 9", "tier": "leaf"}}, False),
    ({"loaded": True, "patched": True, "packing": {"tier": "off", "trees_packed": 3}}, False),
    ({"loaded": True, "patched": True, "packing": {"tier": "leaf", "trees_packed": 0, "trees_unpacked": 1}}, False),
    ({"loaded": True, "patched": True, "packing": {"tier": "leaf", "trees_unpacked": 2}}, False),
    ({"loaded": True, "patched": True, "packing": {"tier": "leaf", "trees_packed": 0}}, True),
    ({"loaded": True, "patched": True, "packing": {"tier": "leaf", "trees_packed": 3, "trees_unpacked": 2}}, True),
])
def test_packing_is_active_only_when_ours_packs(uvm, active):
    """Ours loaded, counters read, a tier on, and not 'every tree unpacked' (no GPU qualified). (Kills the
    mutants of each condition of decide/packing.py.)"""
    assert packing.packing_active(uvm) is active


# --- decide/hold.py ------------------------------------------------------------------------------------------

def test_which_hold_applies_and_how_it_is_said():
    """A kernel's own hold wins (the last one written), then a hold on every kernel unless install released
    this kernel; an unreadable hold record holds every kernel. Each is said with its origin and the command
    that resumes. (Kills the mutants of decide/hold.py's choices and wording.)"""
    k1, k2 = "6.8.0-50-generic", "6.8.0-60-generic"
    own_old = {"by": "remove", "kernel": k1, "since": "2026-12-01T00:00:00Z"}
    own = {"by": "rollback", "kernel": k1, "since": "2026-12-02T10:00:00Z"}
    every = {"by": "remove", "kernel": None, "since": "2026-12-02T11:00:00Z", "released": [k2]}
    recs = Records(holds=[own_old, "junk", own, every])
    assert hold.held(recs, k1) is own
    assert hold.held(recs, "6.8.0-70-generic") is every and hold.held(recs, k2) is None
    assert hold.held(None, k1) is None and hold.held(Records(holds=[own]), k2) is None
    assert hold.held(Records(holds=[own]), None) is None
    assert hold.describe(own, k1, k1) == ("held since 2026-12-02T10:00:00Z, by rollback; "
                                          "`sudo spark-memsaver install` resumes")
    assert hold.describe(own, k1, k2) == ("held since 2026-12-02T10:00:00Z, by rollback; "
                                          f"`sudo spark-memsaver install --kernel {k1}` resumes")
    assert hold.origin(every) == "held since 2026-12-02T11:00:00Z, by remove --all"
    assert hold.origin({"by": "rollback", "kernel": None}) == "held since ?, by rollback of every kernel"
    assert hold.origin({"kernel": k1}) == "held since ?, by the administrator"
    bad = hold.held(Records(quarantined=[{"kind": "hold", "path": "/var/h.json"}, {"kind": "intent", "path": "/x"}]),
                    k2)
    assert bad == {"by": hold.UNREADABLE, "kernel": None, "since": "?", "unreadable": "/var/h.json"}
    assert hold.UNREADABLE == "unreadable"                     # the metrics label: held{by="unreadable"}
    assert hold.describe(bad, k2, k1) == ("held by an unreadable hold record (/var/h.json; reconcile sets it aside "
                                          "and keeps the hold); `sudo spark-memsaver install --all` resumes")


# --- decide/step.py: which plan steps change the system ---------------------------------------------------------

ACTING = ["undo-intent", "finish-intent", "clear-intent", "drop-record", "remove-override", "record-rollback",
          "clear-rollback", "fetch-source", "build-install", "reload-uvm"]
INFO = ["ok", "stay-stock", "blocked", "config-changed", "held"]


def test_steps_that_change_the_system_are_counted_and_go_to_the_history():
    """The plan's summary counts exactly the steps that change the system (reconcile --dry-run's 'acting', the
    executor's history events); explaining steps count 0. (Kills: an action name
    mutated in ACTING or INFO, e.g. build-install no longer counted nor written to the history.)"""
    from spark_memsaver.decide import plan as rc
    rc = typed(rc)
    from spark_memsaver.decide.step import Step
    for a in ACTING:
        assert rc.summarize([Step(a, K)])["acting"] == 1, a
    for a in INFO:
        assert rc.summarize([Step(a, K)])["acting"] == 0, a
    # the planner keeps an explaining step only when its action is listed: none may be lost
    assert [a for a in INFO if a in rc.INFO] == INFO


# --- decide/plan.py ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,code", [({"sources": ()}, "driver-source-missing"),
                                     ({"nv": "555.58.99"}, "driver-unsupported"),
                                     ({"headers": False}, "headers-missing")])
def test_a_rollback_record_keeps_the_code_of_what_is_missing(kw, code):
    """Ours for 550.163.01 beside nvidia.ko 555.58.02 (or .99) that cannot be rebuilt: the rollback record carries
    the missing piece's code (docs/lifecycle.md), not the generic stock-selected. (Kills: a code mutated in
    ROLLBACK_CODES.)"""
    from tests.test_lifecycle import CFG, SUPPORT, kern, snap
    from spark_memsaver.decide import plan as rc
    rc = typed(rc)
    sources = kw.pop("sources", ("550.163.01", "555.58.02", "555.58.99"))
    s = snap(kern(ours="550.163.01", **{"nv": "555.58.02", **kw}), sources=sources)
    steps = rc.plan(s, CFG, SUPPORT, alive_pids=set())
    assert [(x.action, x.code) for x in steps] == [("remove-override", None), ("record-rollback", code)]


def test_a_stale_loaded_module_is_reloaded_and_said_with_both_versions():
    """Ours for 550.163.01 is loaded beside nvidia 555.58.02 with no users: the step says both versions.
    (Kills: the loaded module's version misread in the reason.)"""
    from tests.test_lifecycle import CFG, SUPPORT, kern, snap
    from spark_memsaver.decide import plan as rc
    rc = typed(rc)
    s = snap(kern(nv="555.58.02"), uvm={"loaded": True, "patched": True, "version": "550.163.01-spark1"},
             loaded_nv="555.58.02")
    (r,) = [x for x in rc.plan(s, CFG, SUPPORT, alive_pids=set()) if x.action == "reload-uvm"]
    assert r.reason.startswith("a patched nvidia-uvm for 550.163.01 is loaded beside nvidia 555.58.02: "), r.reason


# --- decide/c_expr.py: NVIDIA's #if expressions ------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [
    ("(NvU16)0x12345", 0x2345), ("(NvU8)0x1ff", 0xff), ("(NvU8)(0x1ff)", 0xff), ("(u8)-1", 0xff), ("(u8)~0", 0xff),
    ("(u8)!0", 1), ("(u8)+300", 44), ("(unsigned long long)-1", (1 << 64) - 1),
    ("1 + 1 == 2", 1), ("1 | 2 == 2", 1), ("3 == 3 && 2 != 3", 1),
    ("1 && U", None), ("U && 1", None), ("0 && U", 0), ("U && 0", 0), ("1 || U", 1), ("0 || U", None)])
def test_c_expressions_evaluate_as_the_preprocessor_does(text, value):
    """Casts to NVIDIA's and the kernel's unsigned types truncate (also before a parenthesis or a unary
    operator); '==' binds tighter than '|'; '&&'/'||' with an unknown operand are known only when the other
    decides (None: undecidable). (Kills: a cast name, '==' in the precedence table, the '&&' shortcut and the
    cast's unary-operand rule mutated.)"""
    from spark_memsaver.decide import c_expr

    def ident(name, defined=False):
        return None                     # U: a macro whose value cannot be known here
    assert c_expr.Expr(c_expr.tokens(text), ident, allow_defined=False).parse() == value


# --- decide/sources.py ----------------------------------------------------------------------------------------

def test_an_ubuntu_server_driver_on_a_debian_system_takes_ubuntus_source_first():
    """os-release says Debian, but the installed driver is Ubuntu's server flavour (nvidia-kernel-common-580-
    server): its own family's source package comes first; Debian's candidates keep their documented shape (the
    tarball package: no tree, the tarball's path). (Kills: the server package name and the 'tarball' key.)"""
    from spark_memsaver.decide import sources
    got = sources.source_package("580.142", {"os_id": "debian",
                                             "installed": {"nvidia-kernel-common-580-server": "580.142-0ubuntu1"}})
    assert [c["package"] for c in got][:2] == ["nvidia-kernel-source-580-server-open", "nvidia-kernel-source-580-open"]
    assert sources.source_package("580.142", {"os_id": "debian"})[:2] == [
        {"package": "nvidia-open-kernel-dkms", "layout": "debian-dkms", "tree": "/usr/src/nvidia-current-open-580.142",
         "tarball": None},
        {"package": "nvidia-open-kernel-source", "layout": "debian-tarball", "tree": None,
         "tarball": "/usr/src/nvidia-open-kernel.tar.xz"}]


def test_a_step_as_json_carries_only_what_was_said():
    """A step's JSON (reconcile --dry-run --json, the history) leaves out every field not given: no empty
    reason or remedy, no null. (Kills: the defaults and the 'not said' values of Step.to_dict mutated.)"""
    from spark_memsaver.decide.step import Step
    assert Step("ok", K).to_dict() == {"action": "ok", "kernel": K}
    assert Step("stay-stock", K, "why", remedy="sudo x").to_dict() == {"action": "stay-stock", "kernel": K,
                                                                      "reason": "why", "remedy": "sudo x"}


# --- decide/c_macros.py: the kernel's size macros and NVIDIA's limits ----------------------------------------

@pytest.mark.parametrize("macro,value", [("SZ_64K", 65536), ("SZ_4K", 4096), ("SZ_2M", 2 << 20), ("SZ_1G", 1 << 30),
                                         ("SZ_4G", 4 << 30), ("NV_U8_MAX", 255), ("NV_U16_MAX", 65535)])
def test_builtin_size_macros_have_the_kernels_values(macro, value):
    """nv-linux.h compares PAGE_SIZE with SZ_64K and friends (linux/sizes.h, not in the header itself).
    (Kills: a size or limit of the builtin table mutated, e.g. SZ_64K lost.)"""
    from spark_memsaver.decide import c_macros
    assert c_macros.macro_value(f"#define PROBE ({macro})\n", "PROBE", 65536) == value


def test_sizes_are_said_in_kib_or_mib():
    from spark_memsaver.decide import c_macros
    assert [c_macros.kib(n) for n in (4096, 65536, 2 << 20, 3 << 20)] == ["4 KiB", "64 KiB", "2 MiB", "3 MiB"]


# --- decide/policy.py: the refusal is said whole, naming the kernel --------------------------------------------

def test_policy_refusals_name_the_kernel_and_the_rule():
    """(Kills: the release dropped from the sentence, the page size miscomputed, the config-unreadable wording.)"""
    from spark_memsaver.decide import policy
    cfg = Config()
    x86 = {"release": "6.1.0-40-amd64", "page_size": 4096, "kconfig": {"CONFIG_X86_64": "y"}}
    assert policy.verdict(x86, cfg) == policy.PolicyVerdict(
        False, "kernel 6.1.0-40-amd64 has 4 KiB pages; policy 'kernels: 64k-only' builds only for 64 KiB kernels",
        "page-size")
    unread = policy.kernel_of("6.8.0-1-nvidia-64k", None)
    assert policy.verdict(unread, cfg) == policy.PolicyVerdict(
        False, "kernel 6.8.0-1-nvidia-64k is a kernel whose configuration cannot be read; policy 'kernels: "
        "64k-only' builds only for arm64 kernels with CONFIG_ARM64_64K_PAGES", "config-unreadable")


# --- decide/hazards.py ----------------------------------------------------------------------------------------------

def test_an_unreadable_hazards_table_is_said_whole():
    """(Kills: the sentence's end mutated.)"""
    from spark_memsaver.decide import hazards
    (f,) = hazards.findings_from_inputs({"table": {"text": None, "error": "bad YAML at line 3"}})
    assert (f["code"], f["message"]) == ("hazards-table-unreadable", "The known-hazards table could not be read "
                                         "(bad YAML at line 3): known NVIDIA driver faults are not checked.")


def test_hazard_reasons_say_how_they_were_decided():
    """Without a driver source: decided by the version, and the finding says so; without a readable version
    either: unknown, naming the unreadable version. (Kills: those two wordings mutated.)"""
    from spark_memsaver.decide import hazards as hz
    (h,) = [h for h in hz.load_hazards((REPO / "uvm_patch/hazards.yaml").read_text()) if h.reference.endswith("#1269")]
    kw = dict(arch="aarch64", page_size=65536, nv_linux_h_text=None)
    a = hz.assess(h, driver_version="590.44.01", **kw)
    assert hz.finding(h, a)["message"].endswith(
        "(decided by the driver version (590.44.01 and newer): no driver source on this node).")
    assert hz.assess(h, driver_version="garbage", **kw).reason == (
        "no driver source on this node and no readable driver version ('garbage')")


# --- decide/policy.py (full run, 3 December) -------------------------------------------------------------------

def test_policy_reads_exactly_its_symbols_and_its_verdict_is_frozen():
    """What the policy keeps of a kernel's configuration: the seven symbols, nothing else; a verdict cannot be
    changed once made (kills: each of the SYMBOLS misspelt, frozen=True -> False)."""
    from spark_memsaver.decide import policy
    syms = ("CONFIG_ARM64", "CONFIG_ARM64_64K_PAGES", "CONFIG_ARM64_16K_PAGES", "CONFIG_ARM64_4K_PAGES",
            "CONFIG_X86_64", "CONFIG_X86", "CONFIG_PREEMPT_RT")
    assert policy.kernel_facts({**{s: "y" for s in syms}, "CONFIG_OTHER": "y"}) == {"kconfig": {s: "y" for s in syms}}
    v = policy.verdict({"release": "k", "page_size": 65536}, Config())
    with pytest.raises(record.FrozenInstanceError):
        v.ok = False


def test_policy_refusals_name_the_kernel_and_the_rule():
    """Each refusal is one sentence naming the kernel, what it is and the policy; PREEMPT_RT and 64 KiB pages count
    built in or as modules (kills: the messages' wording, "m" in both tests, the default policy's name, the
    release's default '?', the model kernel's "release", the config-unreadable test's key and 'and',
    the page size's // 1024, ok False -> True)."""
    import types
    from spark_memsaver.decide import policy
    v = policy.verdict({"release": "k1", "kconfig": {"CONFIG_PREEMPT_RT": "m"}}, None)     # no config: 64k-only
    assert (v.ok, v.rule) == (False, "preempt-rt")
    assert v.why == ("kernel k1 is a PREEMPT_RT kernel; NVIDIA's kernel modules do not build for PREEMPT_RT, so "
                     "spark-memsaver leaves it stock (policy 'kernels: 64k-only')")
    assert policy.verdict({"release": "k", "kconfig": {"CONFIG_ARM64": "y", "CONFIG_ARM64_64K_PAGES": "m"}},
                          Config()).ok is True
    tail = "; policy 'kernels: 64k-only' builds only for 64 KiB kernels"
    for kernel, why in (
            ({"release": "k2", "kconfig": {"CONFIG_ARM64": "y", "CONFIG_ARM64_4K_PAGES": "y"}},
             "kernel k2 is an arm64 kernel without 64 KiB pages"),
            ({"release": "k3", "kconfig": {"CONFIG_X86_64": "y"}, "page_size": 4096}, "kernel k3 has 4 KiB pages"),
            ({"release": "k4", "kconfig": {"CONFIG_X86_64": "y"}}, "kernel k4 is not an arm64 64 KiB kernel"),
            ({"release": "k5", "kconfig": None, "page_size": 16384}, "kernel k5 has 16 KiB pages"),
            ({"release": "k6"}, "kernel k6 has an unknown page size"),
            ({"page_size": 4096}, "kernel ? has 4 KiB pages"),
            (types.SimpleNamespace(release="k7", page_size=4096, kconfig={}), "kernel k7 has 4 KiB pages")):
        v = policy.verdict(kernel, Config())
        assert (v.ok, v.rule, v.why) == (False, "page-size", why + tail), kernel
    v = policy.verdict({"release": "k8", "kconfig": None}, Config())
    assert (v.ok, v.rule) == (False, "config-unreadable") and v.why.startswith("kernel k8 is a kernel whose config")


def test_build_settings_and_what_changed_since():
    """A build records tier, tier value and kernels policy; a record of an older version names the policy
    kernels_policy (kills: the "tier_value" key, "kernels_policy"'s name)."""
    from spark_memsaver.decide import policy
    assert policy.build_settings(Config()) == {"tier": "leaf", "tier_value": 3, "kernels": "64k-only"}
    assert policy.settings_changed({"kernels_policy": "all"}, Config()) == ["kernels all -> 64k-only"]


# --- decide/qualification.py (full run, 3 December) -----------------------------------------------------------

def test_qualification_levels_distance_and_manifest_messages():
    """The levels in order (an unknown one below them all); a version's distance: major apart, higher, then how
    far each later field is; each malformed manifest value named in words (kills: LEVELS misspelt (x2), the
    unknown rank's -1, the distance's '-' and '>' and index, each message's wording and separator)."""
    q = qualification
    assert [q.rank(x) for x in ("untested", "compile-verified", "nvidia-tests", "bogus")] == [0, 1, 2, -1]
    assert q.distance("580.142", "580.142") == (0, False, [0])
    assert q.distance("590.48.01", "580.142") == (10, True, [94])
    assert q.distance("570.86.15", "580.142") == (10, False, [56])
    assert q.check_test_records([{"suite": "x"}], "compile-verified") == \
        "nvidia_tests belong to nvidia-tests entries only"
    assert q.check_test_records([{"suite": "x"}], "nvidia-tests") == \
        "nvidia_tests[0] needs suite, kernel, page_size, tiers, date"
    h = "a" * 64
    assert q.check_hooked_files([], ["580.142"], ["u.c"]) == \
        "hooked_files is not a mapping of version -> {path: sha256}"
    assert q.check_hooked_files({"580.1": {}}, ["580.142"], ["u.c"]) == \
        "hooked_files names '580.1', which is not one of the entry's versions"
    assert q.check_hooked_files({"580.142": ["u.c"]}, ["580.142"], ["u.c"]) == \
        "hooked_files[580.142] is not a mapping of path -> sha256"
    assert q.check_hooked_files({"580.142": {"v.c": h}}, ["580.142"], ["u.c"]) == \
        "hooked_files[580.142] lists ['v.c'], but the branch's patch touches ['u.c']"
    assert q.check_hooked_files({"580.142": {"u.c": "xyz"}}, ["580.142"], ["u.c"]) == \
        "hooked_files[580.142]: not a sha256 for ['u.c']"


def test_qualification_verdicts_say_how_they_matched_and_whether_hashes_were_recorded():
    """An exact entry's verdict says match "exact" on each of its four ways; one found by content says
    "content" when nothing else matched; hashes_recorded is whether the manifest holds the hashes compared
    (kills: "exact" misspelt (x4), recorded True/False swapped in the drifted, content and nearest verdicts,
    ``match or "content"`` -> ``and`` or misspelt)."""
    import types
    a, b = {"u.c": "1" * 64}, {"u.c": "2" * 64}

    def entry(level, files):
        return types.SimpleNamespace(branch="r580", qualification=level, hooked_files=files, verified_on=["x"],
                                     nvidia_tests=[])
    cv = entry("compile-verified", {"580.142": a})
    nt = entry("nvidia-tests", {"580.95.05": a})
    d = qualification.decide
    got = d("580.142", cv, "exact", None, [cv])
    assert (got["match"], got["by"], got["hashes_recorded"]) == ("exact", "version", True)
    got = d("580.142", cv, "exact", b, [cv])                                  # drifted from its own hashes
    assert (got["qualification"], got["match"], got["hashes_recorded"]) == ("untested", "exact", True)
    got = d("580.142", cv, "exact", a, [cv, nt])                              # an identical tree ranks higher
    assert (got["qualification"], got["match"], got["inherited_from"]) == ("nvidia-tests", "exact", "580.95.05")
    got = d("580.142", cv, "exact", a, [cv])
    assert (got["qualification"], got["by"], got["match"]) == ("compile-verified", "version", "exact")
    got = d("580.178.04", None, None, a, [cv], nearest_branch="r580")        # unlisted, identical to 580.142
    assert (got["qualification"], got["match"], got["hashes_recorded"]) == ("compile-verified", "content", True)
    got = d("580.178.04", None, None, b, [cv], nearest_branch="r580")        # unlisted and different
    assert (got["qualification"], got["match"], got["hashes_recorded"]) == ("untested", "nearest", False)


# --- decide/sources.py (full run, 3 December) -----------------------------------------------------------------

def _layouts(driver="580.142", **layout):
    from spark_memsaver.decide import sources
    return [c["layout"] for c in sources.source_package(driver, layout)]


UBU = ["ubuntu", "ubuntu-server", "nvidia-repo", "debian-dkms", "debian-tarball"]
DEB = ["debian-dkms", "debian-tarball", "ubuntu", "ubuntu-server", "nvidia-repo"]


def test_source_candidates_are_exactly_these_packages_and_trees():
    """Where each candidate's tree lands (or its tarball), under its layout's name (kills: the layout names
    UBUNTU/UBUNTU_SERVER/NVIDIA_REPO, the "tree" and "tarball" of the Ubuntu and NVIDIA-repo entries)."""
    from spark_memsaver.decide import sources
    t = "/usr/src/nvidia-580.142"
    assert sources.source_package("580.142") == [
        {"package": "nvidia-kernel-source-580-open", "layout": "ubuntu", "tree": t, "tarball": None},
        {"package": "nvidia-kernel-source-580-server-open", "layout": "ubuntu-server", "tree": t, "tarball": None},
        {"package": "nvidia-kernel-source-open", "layout": "nvidia-repo", "tree": t, "tarball": None},
        {"package": "nvidia-open-kernel-dkms", "layout": "debian-dkms",
         "tree": "/usr/src/nvidia-current-open-580.142", "tarball": None},
        {"package": "nvidia-open-kernel-source", "layout": "debian-tarball", "tree": None,
         "tarball": "/usr/src/nvidia-open-kernel.tar.xz"}]


def test_source_family_from_packaging_then_os_release():
    """How the driver is installed outranks os-release: Ubuntu's per-kernel packages (linux-modules-/linux-objects-
    nvidia-*) on a Debian system mean Ubuntu's source first, Debian's DKMS/source packages on an Ubuntu system
    Debian's; with nothing installed, ID_LIKE counts as ID does (kills: each package name misspelt, ID_LIKE's key,
    its `or ""` -> `and`)."""
    assert _layouts(os_id="debian", installed={"linux-modules-nvidia-580-open-6.8.0-1-generic": "1"}) == UBU
    assert _layouts(os_id="debian", installed={"linux-objects-nvidia-580-open-6.8.0-1-generic": "1"}) == UBU
    for pkg in ("nvidia-open-kernel-dkms", "nvidia-kernel-dkms", "nvidia-open-kernel-source"):
        assert _layouts(os_id="ubuntu", installed={pkg: "580.142-1"}) == DEB, pkg
    assert _layouts(os_id="pop", os_id_like="Ubuntu Debian") == UBU
    assert _layouts(os_id="raspbian", os_id_like="debian") == DEB


def test_driver_of_and_install_command_edges():
    """An upstream holding a ':' or a '-' names no driver; a bad package or version is refused naming both; an
    entry with a package but no version has no remedy; a present tree's entry names its path (kills: split(":", 1)
    and rsplit("-", 1) -> 2, the refusal's wording, ``pkg and dv`` -> ``or``, the "path" key read)."""
    from spark_memsaver.decide import sources
    assert sources.driver_of("1:580.142-1") == "580.142"
    assert sources.driver_of("1:580.142:3-1") is None
    assert sources.driver_of("580.142-1-2") is None
    with pytest.raises(ValueError) as e:
        sources.install_command("Bad Name", "1.0")
    assert str(e.value) == "not a package name and version: 'Bad Name' '1.0'"
    got = sources.entry("580.142", "auto", None, {"package": "nvidia-kernel-source-580-open", "deb_version": None,
                                                  "in_lists": False}, True)
    assert got["remedy"] is None and got["package"] == "nvidia-kernel-source-580-open"
    got = sources.entry("580.142", "auto", {"path": "/var/cache/x/580.142", "origin": "cache"},
                        {"package": "nvidia-open-kernel-dkms", "deb_version": "580.142-1", "in_lists": True}, True)
    assert (got["present"], got["path"], got["origin"], got["fetchable"], got["remedy"]) == \
        (True, "/var/cache/x/580.142", "cache", False, None)


def test_source_version_from_the_installed_server_sibling():
    """Not in the lists: the version comes from the installed common package of the same source, the server one
    for the server flavour (kills: the server sibling's name)."""
    from spark_memsaver.decide import sources
    cands = sources.source_package("580.142", {"nvidia_ko": "/lib/modules/k/kernel/nvidia-580srv-open/nvidia.ko"})
    got = sources.choose("580.142", cands, {}, {"nvidia-kernel-common-580-server": "580.142-0ubuntu1"})
    assert got == {"package": "nvidia-kernel-source-580-server-open", "deb_version": "580.142-0ubuntu1",
                   "in_lists": False}


def test_driver_sources_section_per_driver():
    """World.driver_sources for three installed drivers: one in /usr/src (origin usr-src when unsaid), one fetched
    into the cache (its record names the package and version it came from), one missing but in APT's lists
    (fetchable, with the exact install command); the pending fetches carried (kills: the present tree's "path"
    and default origin, a present tree's chosen defaults (in_lists), the record lookup's `is not None`, `==`
    and `rec = None`, each key read from the record and its in_lists, the "pending" key)."""
    from spark_memsaver.decide import sources
    cached = "/var/cache/spark-memsaver/sources/580.178.04"
    facts = {"mode": "auto", "installed": {}, "cache": {"entries": []}, "pending": {"drivers": ["595.45.04"]},
             "trees": [{"version": "580.142", "path": "/usr/src/nvidia-580.142"},
                       {"version": "580.178.04", "path": cached, "origin": "cache"}],
             "entries": [{"path": cached, "package": "nvidia-kernel-source-580-open",
                          "deb_version": "580.178.04-0ubuntu1"},
                         {"path": "/somewhere/else", "package": "nvidia-open-kernel-dkms", "deb_version": "1.0-1"}],
             "versions": ["580.142", "580.178.04", "590.48.01"], "missing": ["590.48.01"],
             "layouts": {"590.48.01": {}}}
    got = sources.section(facts, {"nvidia-kernel-source-590-open": ["590.48.01-0ubuntu1"]}, True)
    assert got["pending"] == {"drivers": ["595.45.04"]} and got["apt"] == "read"
    assert got["by_driver"] == {
        "580.142": {"present": True, "path": "/usr/src/nvidia-580.142", "origin": "usr-src", "package": None,
                    "deb_version": None, "in_lists": False, "fetchable": False, "remedy": None},
        "580.178.04": {"present": True, "path": cached, "origin": "cache", "package": "nvidia-kernel-source-580-open",
                       "deb_version": "580.178.04-0ubuntu1", "in_lists": False, "fetchable": False, "remedy": None},
        "590.48.01": {"present": False, "path": None, "origin": None, "package": "nvidia-kernel-source-590-open",
                      "deb_version": "590.48.01-0ubuntu1", "in_lists": True, "fetchable": True,
                      "remedy": "sudo apt-get install nvidia-kernel-source-590-open=590.48.01-0ubuntu1"}}


# --- decide/hazards.py (full run, 3 December) -----------------------------------------------------------------

def _h1269():
    from spark_memsaver.decide import hazards as hz
    (h,) = [h for h in hz.load_hazards((REPO / "uvm_patch/hazards.yaml").read_text())
            if h.reference.endswith("#1269")]
    return h


def test_hazard_assessment_reasons_word_for_word():
    """`status` shows each assessment's reason as its finding's text: the platform refusals, the unobserved
    node, the content check that could not decide (with what the version alone says, when it says anything),
    a failed read decided by version, and the version-only verdicts inside and outside the range (kills: the
    state names, every reason's wording and separators, the page size shown raw at 0, ``by_version = ""``,
    the hint's "" and None, inside/outside and its ==, the missing version's "" -> "XXXX"; frozen Assessment)."""
    from spark_memsaver.decide import hazards as hz
    h = _h1269()
    ref = "NVIDIA/open-gpu-kernel-modules#1269"

    def a(**kw):
        kw = {"driver_version": "580.142", "arch": "aarch64", "page_size": 65536, "nv_linux_h_text": None, **kw}
        r = hz.assess(h, **kw)
        return r.state, r.decided_by, r.reason
    assert (hz.AFFECTED, hz.NOT_AFFECTED, hz.UNKNOWN) == ("affected", "not-affected", "unknown")
    assert a(arch="x86_64") == ("not-affected", "platform", f"{ref} needs aarch64; this node is x86_64")
    assert a(page_size=4096) == ("not-affected", "platform",
                                 f"{ref} needs 16 KiB or 64 KiB pages; this kernel uses 4 KiB")
    assert a(page_size=0)[2] == f"{ref} needs 16 KiB or 64 KiB pages; this kernel uses 0"
    assert a(arch=None) == ("unknown", None, "the node's architecture or page size was not observed")
    undefined = "the driver source could not be read for NV_DMA_SUBMAP_MAX_PAGES: NV_DMA_SUBMAP_MAX_PAGES is not " \
                "defined in this file"
    assert a(nv_linux_h_text="#define X 1\n") == ("unknown", "content", undefined + "; by version alone (590.44.01 "
                                                  "and newer) driver 580.142 would be not-affected")
    assert a(nv_linux_h_text="#define X 1\n", driver_version=None) == ("unknown", "content", undefined)
    assert a(read_error="too big", driver_version="590.48.01") == (
        "affected", "version", "hazard check could not read nv-linux.h: too big; decided by the version range "
        "590.44.01 and newer: driver 590.48.01 is inside it")
    assert a(read_error="too big")[2].endswith("driver 580.142 is outside it")
    assert a(read_error="too big", driver_version=None) == (
        "unknown", None, "hazard check could not read nv-linux.h: too big; no readable driver version")
    assert a(driver_version="590.48.01") == (
        "affected", "version", "no driver source on this node (precompiled modules): decided by the version range "
        "590.44.01 and newer, not by the source; driver 590.48.01 is inside it")
    assert a()[2].endswith("driver 580.142 is outside it")
    assert a(driver_version=None)[2] == "no driver source on this node and no readable driver version"
    assert a(driver_version="abc")[2] == "no driver source on this node and no readable driver version ('abc')"
    with pytest.raises(record.FrozenInstanceError):
        hz.assess(h, driver_version=None, arch=None, page_size=None, nv_linux_h_text=None).state = "affected"


def test_a_failing_content_check_is_cut_at_400_characters(monkeypatch):
    """Any failure of the content check leaves the version to decide, its reason cut at 400 characters
    (kills: [:400] -> [:401])."""
    from spark_memsaver.decide import hazards as hz

    def boom(*a):
        raise RuntimeError("x" * 1000)
    monkeypatch.setattr(hz, "content_verdict", boom)
    r = hz.assess(_h1269(), driver_version="580.142", arch="aarch64", page_size=65536, nv_linux_h_text="x")
    cut = ("RuntimeError: " + "x" * 1000)[:400]
    assert r.details["check_failed"] == "hazard check could not read nv-linux.h: " + cut


def test_content_verdict_reasons_and_details_word_for_word():
    """What nv-linux.h's NV_DMA_SUBMAP_MAX_PAGES says at a page size, in the finding's words: fixed (aligned),
    an older tree (no 2 MiB alignment to rely on), affected, and sizes that are no submap (0, past 4 GiB, exactly
    4 GiB allowed); an empty or binary file (kills: each reason's wording, b // ps -> b / ps, the bounds
    <= 0 / > 1 << 32, the details' keys, _lowbit's n & -n)."""
    from spark_memsaver.decide import hazards as hz
    sig = _h1269().signature
    m = "NV_DMA_SUBMAP_MAX_PAGES"

    def cv(text, ps):
        c = hz.content_verdict(sig, text, ps)
        return c.state, c.reason, c.details
    assert cv(f"#define {m} 512\n", 65536) == (
        "not-affected", f"this tree keeps 2 MiB alignment for {m} at 64 KiB pages (0x2000000 bytes): the fault is "
        "fixed in it", {"macro": m, "submap_bytes": 1 << 25, "reference_submap_bytes": 1 << 21, "alignment": 1 << 21})
    assert cv(f"#define {m} 32767\n", 65536)[:2] == (
        "not-affected", f"this tree keeps only 4 KiB alignment for {m} on 4 KiB kernels, so it does not rely on "
        "2 MiB alignment (as in older drivers)")
    split = (f"#if defined(CONFIG_ARM64_64K_PAGES)\n#define {m} 33\n#else\n#define {m} 512\n#endif\n")
    assert cv(split, 65536)[:2] == (
        "affected", f"{m} at 64 KiB pages gives a 0x210000-byte submap, not a multiple of 2 MiB, while this tree "
        "relies on 2 MiB alignment (0x200000 bytes at 4 KiB pages)")
    assert cv(f"#define {m} 0\n", 65536)[:2] == (
        "unknown", f"{m} is 0 pages at 4 KiB pages (0x0 bytes), not a submap size of at most 4 GiB")
    assert cv(f"#define {m} 1048577\n", 4096)[:2] == (
        "unknown", f"{m} is 1048577 pages at 4 KiB pages (0x100001000 bytes), not a submap size of at most 4 GiB")
    assert cv(f"#define {m} 1048576\n", 4096)[0] == "not-affected"              # 4 GiB itself is a submap size
    assert cv("  \n", 65536) == ("unknown", "the file is empty", {})
    assert cv("a\x00b", 65536) == ("unknown", "the file is not text (NUL bytes)", {})


def test_hazard_finding_message_and_remedy_word_for_word():
    """The status finding of an affected node: where (driver, arm64, page size; no driver when only the content
    decided), what, and how it was decided; the remedies joined by '; or ', capitalised, with the link (kills:
    the where parts and separator, "arm64" and its test, each "how" wording and its check_failed key, the
    remedies' separator)."""
    from spark_memsaver.decide import hazards as hz
    h = _h1269()
    m = "NV_DMA_SUBMAP_MAX_PAGES"
    split = (f"#if defined(CONFIG_ARM64_64K_PAGES)\n#define {m} 33\n#else\n#define {m} 512\n#endif\n")
    head = ("GPU allocations of 4 GiB or more made with cudaMalloc/cuMemCreate fault just below each 4 GiB boundary "
            "on this node (")
    mid = ("): NVIDIA/open-gpu-kernel-modules#1269, a fault in nvidia.ko, not in spark-memsaver; cudaMallocManaged "
           "is not affected (")

    def f(**kw):
        kw = {"driver_version": "590.48.01", "arch": "aarch64", "page_size": 65536, "nv_linux_h_text": None, **kw}
        return hz.finding(h, hz.assess(h, **kw))
    got = f(driver_version=None, nv_linux_h_text=split)
    assert got["message"] == head + "arm64, 64 KiB pages" + mid + "decided from nv-linux.h in the driver source)."
    assert got["remedy"] == (
        "Stay on (or go back to) the 580 driver branch: the DGX OS default and the branch validated on hardware "
        "(DGX OS and Ubuntu: 'sudo apt-get install nvidia-driver-580-open', then reboot); or boot a 4 KiB-page "
        "kernel (the fault needs 16 KiB or 64 KiB pages). Details: "
        "https://github.com/NVIDIA/open-gpu-kernel-modules/issues/1269.")
    assert (got["code"], got["severity"]) == ("driver-hazard-dma-submap", "warning")
    assert f(page_size=16384, read_error="x")["message"] == (
        head + "driver 590.48.01, arm64, 16 KiB pages" + mid + "decided by the driver version (590.44.01 and newer): "
        "the driver source's nv-linux.h could not be read).")
    assert f()["message"] == (head + "driver 590.48.01, arm64, 64 KiB pages" + mid + "decided by the driver version "
                              "(590.44.01 and newer): no driver source on this node).")


def test_hazard_findings_from_inputs_word_for_word(monkeypatch):
    """The table missing or invalid is one info finding naming why and where; a file that could not be read is
    an info finding naming it under the source path, what decided instead, and how to restore it; no driver
    version but the source decides; a check that raises is cut at 400 characters; a platform refusal names every
    architecture; a content verdict is frozen (kills: every wording, key and separator of those findings, the
    table path's `or`/`and`, ``and not sources`` -> ``and sources``, the source path's key and files[0], the
    /usr/src test, the raise's [:400] and wording, '/'.join, ContentVerdict frozen)."""
    from spark_memsaver.decide import hazards as hz
    remedy = hz.HazardsInvalid.remedy
    tail = ": known NVIDIA driver faults are not checked."
    assert hz.findings_from_inputs({"table": {"path": "/usr/share/x/hazards.yaml", "text": None}}) == [
        {"code": "hazards-table-unreadable", "severity": "info",
         "message": "The known-hazards table could not be read (not found: /usr/share/x/hazards.yaml)" + tail,
         "remedy": remedy}]
    assert hz.findings_from_inputs({"table": {"text": None}})[0]["message"] == \
        "The known-hazards table could not be read (not found: hazards.yaml)" + tail
    assert hz.findings_from_inputs({"table": {"path": "/x/hazards.yaml", "text": "hazards: [\n"}}) == [
        {"code": "hazards-invalid", "severity": "info", "remedy": remedy,
         "message": "/x/hazards.yaml: not valid YAML (ParserError)" + tail}]
    assert hz.findings_from_inputs({"table": {"text": "hazards: [\n"}})[0]["message"].startswith("hazards.yaml: ")
    table = {"path": "/x/hazards.yaml", "text": (REPO / "uvm_patch/hazards.yaml").read_text()}
    src = "/usr/src/nvidia-590.48.01"
    inputs = {"table": table, "driver_version": "590.48.01", "arch": "aarch64", "page_size": 65536,
              "source_errors": {"common/inc/nv-linux.h": "too big"}, "source_path": src}
    restore = (f"Restore NVIDIA's file: sudo apt-get install --reinstall \"$(dpkg -S {src}/common/inc/nv-linux.h | "
               "cut -d: -f1)\". ")
    report = "If it is NVIDIA's file unchanged, report this as a spark-memsaver bug with the file attached."
    head = ("The known-hazard check of NVIDIA/open-gpu-kernel-modules#1269 skipped the driver source: hazard check "
            "could not read nv-linux.h: too big; ")
    got = hz.findings_from_inputs(inputs)
    assert got[0] == {"code": "hazard-check-failed", "severity": "info", "remedy": restore + report,
                      "message": head + "driver 590.48.01 was judged by its version (590.44.01 and newer) instead."}
    assert [f["code"] for f in got] == ["hazard-check-failed", "driver-hazard-dma-submap"]
    got = hz.findings_from_inputs(dict(inputs, driver_version=None, sources={"unrelated": "x"}, source_path="src"))
    assert got == [{"code": "hazard-check-failed", "severity": "info", "remedy": report,
                    "message": head + "no driver version to judge by either."}]
    m = "NV_DMA_SUBMAP_MAX_PAGES"
    split = f"#if defined(CONFIG_ARM64_64K_PAGES)\n#define {m} 33\n#else\n#define {m} 512\n#endif\n"
    got = hz.findings_from_inputs(dict(inputs, driver_version=None, source_errors={},
                                       sources={"common/inc/nv-linux.h": split}))
    assert [f["code"] for f in got] == ["driver-hazard-dma-submap"]         # the source decides without a version
    real = hz.assess

    def assess(h, **kw):
        if kw.get("nv_linux_h_text") is not None:
            raise RuntimeError("y" * 1000)
        return real(h, **kw)
    monkeypatch.setattr(hz, "assess", assess)
    got = hz.findings_from_inputs(dict(inputs, source_errors={}, sources={"common/inc/nv-linux.h": split}))
    assert got[0]["message"] == ("The known-hazard check of NVIDIA/open-gpu-kernel-modules#1269 skipped the driver "
                                 "source: hazard check could not read nv-linux.h: "
                                 + ("RuntimeError: " + "y" * 1000)[:400] + "; driver 590.48.01 was judged by its "
                                 "version (590.44.01 and newer) instead.")
    monkeypatch.setattr(hz, "assess", real)
    two = record.replace(_h1269(), arch=("aarch64", "x86_64"))
    assert hz.assess(two, driver_version=None, arch="riscv64", page_size=4096, nv_linux_h_text=None).reason == \
        "NVIDIA/open-gpu-kernel-modules#1269 needs aarch64/x86_64; this node is riscv64"
    with pytest.raises(record.FrozenInstanceError):
        hz.content_verdict(two.signature, "", 65536).state = "affected"


# --- decide/plan.py: held, ours still consistent, config changed ---------------------------------------------

def test_plan_held_kernel_with_ours_consistent_is_not_rebuilt_on_a_tier_change():
    """Our module for 550.163.01 beside nvidia.ko 550.163.01 (consistent), built with tier 'leaf'; the config now
    says '256' and the administrator's rollback holds the kernel: the plan says 'held' (no rebuild, the
    resume command as remedy), never build-install. Without the hold the same world rebuilds, so the test sees
    the hold decide it. (Kills: a held kernel rebuilt on a tier change, i.e. ``if hold and changed...`` -> a
    condition without ``hold``, or the held step dropped.)"""
    from spark_memsaver.decide import plan as rc
    from tests.test_lifecycle import K as LK, SUPPORT, kern, snap
    s = snap(kern(ours="550.163.01", nv="550.163.01"))
    s["records"]["builds"] = [{"kernel": LK, "driver_version": "550.163.01", "tier": "leaf", "kernels": "64k-only"}]
    cfg = Config(tier="256")
    free = typed(rc.plan)(s, cfg, SUPPORT)
    assert [(x.action, x.kernel) for x in free] == [("build-install", LK)], [x.to_dict() for x in free]
    assert "configuration changed since the build (tier leaf -> " in free[0].reason
    s["records"]["holds"] = [{"by": "rollback", "kernel": LK, "since": "2026-12-01T00:00:00Z"}]
    steps = typed(rc.plan)(s, cfg, SUPPORT)
    assert [(x.action, x.kernel) for x in steps] == [("held", LK)], [x.to_dict() for x in steps]
    assert "no rebuild" in steps[0].reason and "tier leaf -> " in steps[0].reason
    assert steps[0].remedy == "sudo spark-memsaver install"
