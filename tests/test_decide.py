"""The evaluator is pure: snapshot dict + config in, state + findings out. Every state is reached here."""

import copy

import pytest

from spark_memsaver.config import Config
from spark_memsaver.decide.status import STATES, evaluate
from tests.support.sparkroot import stats_text
from spark_memsaver.observe.counters import parse_stats
from tests.support.worlds import typed

evaluate = typed(evaluate)   # dict snapshots -> model.World (tests/support/worlds.py)

K = "6.14.0-1015-nvidia-64k"


def module(version="580.142", patched=False, signer=None):
    return {"path": f"/lib/modules/{K}/x/nvidia-uvm.ko", "version": version, "patched": patched,
            "signer": signer, "srcversion": "S", "vermagic": K, "depends": ["nvidia"], "patch_id": None}


def base_snapshot():
    return {
        "host": {"kernel": K, "arch": "aarch64", "page_size": 65536},
        "driver": {"loaded_version": "580.142", "sources": [{"version": "580.142", "path": "/usr/src/nvidia-580.142",
                                                              "open": True}]},
        "uvm": {"loaded": True, "version": "580.142", "srcversion": "S", "patched": False, "parameters": {},
                "packing": None},
        "kernels": [{"release": K, "running": True, "page_size": 65536, "headers": True,
                     "uvm_selected": module(), "nvidia_selected": module()}],
        "dkms": {"available": True, "registrations": []},
        "secure_boot": {"state": "not-needed", "reason": "Secure Boot is off"},
        "holders": [],
        "memory": {},
        "records": {"intents": [], "rollbacks": [], "unreadable": []},
    }


def ours_loaded(snap, stats=None):
    snap["uvm"].update(patched=True, packing=parse_stats(stats or stats_text()))
    snap["kernels"][0]["uvm_selected"] = module(patched=True)
    return snap


def codes(v):
    return [f.code for f in v.findings]


CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


@case
def not_applicable_no_driver():
    s = base_snapshot()
    s["driver"] = {"loaded_version": None, "sources": []}
    s["kernels"][0]["nvidia_selected"] = None
    s["kernels"][0]["uvm_selected"] = None
    s["uvm"]["loaded"] = False
    return s, Config(), "not-applicable", "no-nvidia-driver"


@case
def not_applicable_4k_kernel_policy():
    s = base_snapshot()
    s["host"]["page_size"] = 4096
    s["kernels"][0]["page_size"] = 4096
    return s, Config(), "not-applicable", "kernel-outside-policy"


@case
def stock():
    return base_snapshot(), Config(), "stock", "stock"


@case
def stock_4k_kernel_policy_all():
    s = base_snapshot()
    s["host"]["page_size"] = 4096
    s["kernels"][0]["page_size"] = 4096
    return s, Config(kernels="all"), "stock", "stock"


@case
def built():
    s = base_snapshot()
    s["dkms"]["registrations"] = [{"module": "spark-memsaver-uvm", "version": "0.1.0-580.142",
                                   "builds": [{"kernel": K, "arch": "aarch64", "built": True, "installed": False}]}]
    return s, Config(), "built", None


@case
def installed():
    s = base_snapshot()
    s["kernels"][0]["uvm_selected"] = module(patched=True)
    return s, Config(), "installed", "activation-pending"


@case
def active():
    return ours_loaded(base_snapshot()), Config(), "active", None


@case
def inactive_disabled():
    return ours_loaded(base_snapshot(), stats_text(tier="off", packed=0, t256=0, t4k=0)), Config(), "inactive", \
        "packing-disabled"


@case
def inactive_predicates():
    return ours_loaded(base_snapshot(), stats_text(packed=0, unpacked=2, t256=0, t4k=0)), Config(), "inactive", \
        "packing-predicates-unmet"


@case
def rolled_back():
    s = base_snapshot()
    s["records"]["rollbacks"] = [{"time": "2026-11-30T02:00:00Z", "reason": "driver 590.48.01 has no patch",
                                  "kernel": K}]
    return s, Config(), "rolled-back", "rolled-back"


@case
def needs_attention_mismatch_on_disk():
    s = base_snapshot()
    s["kernels"][0]["uvm_selected"] = module(version="575.51.02", patched=True)
    return s, Config(), "needs-attention", "override-driver-mismatch"


@case
def needs_attention_mismatch_loaded():
    s = ours_loaded(base_snapshot())
    s["uvm"]["version"] = "575.51.02"
    s["kernels"][0]["uvm_selected"] = module(version="580.142", patched=True)
    return s, Config(), "needs-attention", "loaded-driver-mismatch"


@case
def needs_attention_counters_unreadable():
    s = ours_loaded(base_snapshot())
    s["uvm"]["packing"] = {"error": "counters format 2 is newer than this spark-memsaver understands"}
    return s, Config(), "needs-attention", "counters-unreadable"


@case
def unverified_not_enrolled():
    s = base_snapshot()
    s["kernels"][0]["uvm_selected"] = module(patched=True)
    s["secure_boot"] = {"state": "not-enrolled", "reason": "key not in MokListRT"}
    return s, Config(), "unverified", "mok-not-enrolled"


@case
def unverified_sb_unknown_while_loaded():
    s = ours_loaded(base_snapshot())
    s["secure_boot"] = {"state": "unknown", "reason": "MokListRT truncated"}
    return s, Config(), "unverified", "secure-boot-unknown"


@pytest.mark.parametrize("name", sorted(CASES))
def test_state(name):
    snap, config, state, code = CASES[name]()
    before = copy.deepcopy(snap)
    v = evaluate(snap, config)
    assert v.state == state, (v.state, codes(v))
    if code:
        assert code in codes(v)
    assert snap == before, "evaluate() must not modify its input"
    for f in v.findings:
        assert f.severity in ("info", "warning", "error") and f.message and f.remedy


def test_every_state_is_covered():
    reached = {CASES[n]()[2] for n in CASES}
    assert reached == set(STATES)


def test_interrupted_operation_is_reported():
    s = base_snapshot()
    s["records"]["intents"] = [{"op": "install", "started": "2026-11-30T01:00:00Z", "kernel": K}]
    v = evaluate(s, Config())
    assert "operation-interrupted" in codes(v) and v.problem


def test_missing_headers_for_running_kernel_is_a_warning():
    s = base_snapshot()
    s["kernels"][0]["headers"] = False
    v = evaluate(s, Config())
    f = [f for f in v.findings if f.code == "headers-missing"][0]
    assert f.severity == "warning" and K in f.remedy or "linux-headers" in f.remedy


def test_mismatch_wins_over_everything():
    s = ours_loaded(base_snapshot())
    s["kernels"][0]["nvidia_selected"] = module(version="590.48.01")
    s["records"]["rollbacks"] = [{"time": "t", "reason": "r"}]
    v = evaluate(s, Config())
    assert v.state == "needs-attention"
    assert [f for f in v.findings if f.code == "override-driver-mismatch"][0].severity == "error"


def test_a_suffixed_module_version_is_not_a_mismatch_in_status():
    """Status and the planner read "ours beside its driver" through decide/ours.py (by base_version, as the guard's
    driver_of()): before, status compared raw strings and called ours '580.142-sm1' beside nvidia.ko 580.142 an
    override-driver-mismatch (and the loaded module too), while the planner called it consistent."""
    from spark_memsaver.decide import plan as rc
    rc = typed(rc)
    s = ours_loaded(base_snapshot())
    s["uvm"]["version"] = "580.142-sm1"
    s["kernels"][0]["uvm_selected"]["version"] = "580.142-sm1"
    v = evaluate(s, Config())
    assert "override-driver-mismatch" not in codes(v) and "loaded-driver-mismatch" not in codes(v), codes(v)
    assert v.state == "active"
    assert [st.action for st in rc.plan(s, Config(), {"580.142": {"supported": True}})] == ["ok"]
    s["kernels"][0]["nvidia_selected"]["version"] = "590.44.01"     # a real mismatch is still one
    assert "override-driver-mismatch" in codes(evaluate(s, Config()))
