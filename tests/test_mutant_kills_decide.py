"""Decisions of decide/ that a mutation run (tools/mutation-run, issue 29 item 3) found unguarded by the fast
tests: each test pins one behaviour through the module's public entry point and names the mutant it kills."""

from __future__ import annotations

from spark_memsaver.config import Config
from spark_memsaver.decide.status import evaluate
from tests.test_decide import K, base_snapshot, module, ours_loaded


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
