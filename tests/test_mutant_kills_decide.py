"""Decisions of decide/ that a mutation run (tools/mutation-run, issue 29 item 3) found unguarded by the fast
tests: each test pins one behaviour through the module's public entry point and names the mutant it kills."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from spark_memsaver import world
from spark_memsaver.config import Config
from spark_memsaver.decide import hold, ours, packing, qualification
from spark_memsaver.decide.status import evaluate
from spark_memsaver.host import Host
from spark_memsaver.observe import mok as omok
from tests.test_decide import K, base_snapshot, module, ours_loaded
from tests.test_mok import certs, make_root, scenarios  # noqa: F401  (certs: the fixture, openssl-made)

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
    s["kernels"][0]["preempt_rt"] = True
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
    assert ours.selection(base_snapshot()["kernels"][0]) == "stock"
    k = ours_loaded(base_snapshot())["kernels"][0]
    assert ours.selection(k) == "consistent"
    k["nvidia_selected"] = module(version="580.159")
    assert ours.selection(k) == "mismatch"


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
    recs = {"holds": [own_old, "junk", own, every]}
    assert hold.held(recs, k1) is own
    assert hold.held(recs, "6.8.0-70-generic") is every and hold.held(recs, k2) is None
    assert hold.held(None, k1) is None and hold.held({"holds": [own]}, k2) is None
    assert hold.held({"holds": [own]}, None) is None
    assert hold.describe(own, k1, k1) == ("held since 2026-12-02T10:00:00Z, by rollback; "
                                          "`sudo spark-memsaver install` resumes")
    assert hold.describe(own, k1, k2) == ("held since 2026-12-02T10:00:00Z, by rollback; "
                                          f"`sudo spark-memsaver install --kernel {k1}` resumes")
    assert hold.origin(every) == "held since 2026-12-02T11:00:00Z, by remove --all"
    assert hold.origin({"by": "rollback", "kernel": None}) == "held since ?, by rollback of every kernel"
    assert hold.origin({"kernel": k1}) == "held since ?, by the administrator"
    bad = hold.held({"quarantined": [{"kind": "hold", "path": "/var/h.json"}, {"kind": "intent", "path": "/x"}]}, k2)
    assert bad == {"by": "an unreadable hold record", "kernel": None, "since": "?", "unreadable": "/var/h.json"}
    assert hold.describe(bad, k2, k1) == ("held since ?, by an unreadable hold record; "
                                          "`sudo spark-memsaver install --all` resumes")


# --- decide/step.py: which plan steps change the system ---------------------------------------------------------

ACTING = ["undo-intent", "finish-intent", "clear-intent", "drop-record", "remove-override", "record-rollback",
          "clear-rollback", "fetch-source", "build-install", "reload-uvm"]
INFO = ["ok", "stay-stock", "blocked", "config-changed", "held"]


def test_steps_that_change_the_system_are_counted_and_go_to_the_history():
    """The plan's summary counts exactly the steps that change the system (reconcile --dry-run's 'acting', the
    executor's history events); explaining steps count 0. (Kills: an action name
    mutated in ACTING or INFO, e.g. build-install no longer counted nor written to the history.)"""
    from spark_memsaver.decide import plan as rc
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
    sources = kw.pop("sources", ("550.163.01", "555.58.02", "555.58.99"))
    s = snap(kern(ours="550.163.01", **{"nv": "555.58.02", **kw}), sources=sources)
    steps = rc.plan(s, CFG, SUPPORT, alive_pids=set())
    assert [(x.action, x.code) for x in steps] == [("remove-override", None), ("record-rollback", code)]


def test_a_stale_loaded_module_is_reloaded_and_said_with_both_versions():
    """Ours for 550.163.01 is loaded beside nvidia 555.58.02 with no users: the step says both versions.
    (Kills: the loaded module's version misread in the reason.)"""
    from tests.test_lifecycle import CFG, SUPPORT, kern, snap
    from spark_memsaver.decide import plan as rc
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
