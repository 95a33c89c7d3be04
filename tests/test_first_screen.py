"""`status`'s first screen answers 'what do I gain, what do I do' (report/summary.py), on real fixture roots:
State, then Gain (measured when active; an estimate with its basis otherwise), Risk (not yet run on a GB10;
validate), Next (one step); the internals (driver-source drift, the source cache) only with --verbose."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from spark_memsaver.host import Host, intents
from tests.support import sparkroot

REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
ENV.pop("SPARK_MEMSAVER_CONFIG", None)


def status(root, *args):
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), "status", *args],
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert "Traceback" not in r.stderr
    return r.stdout


def first(text: str) -> dict:
    rows = {}
    for ln in text.split("\n\n", 1)[0].splitlines():
        k, v = ln.split(":", 1)
        rows[k] = v.strip()
    return rows


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    t = tmp_path_factory.mktemp("fs")
    r = {"stock": sparkroot.make_spark_root(t / "stock"),
         "unverified": sparkroot.make_spark_root(t / "unv", uvm_loaded="ours", ours_installed="580.142",
                                                 secure_boot=True),
         "active": sparkroot.make_spark_root(t / "active", uvm_loaded="ours", ours_installed="580.142"),
         "rolled-back": sparkroot.make_spark_root(t / "rb")}
    sparkroot.write(r["unverified"], f"/sys/firmware/efi/efivars/SecureBoot-{sparkroot.EFI_GLOBAL}",
                    b"\x06\x00\x00\x00")
    intents.write_rollback(Host(r["rolled-back"]), sparkroot.SPARK_KERNEL, "requested by the administrator",
                           code="requested")
    return r


@pytest.mark.parametrize("state", ["stock", "unverified", "active", "rolled-back"])
def test_first_screen_order_and_content(roots, state):
    text = status(roots[state])
    rows = first(text)
    assert list(rows) == ["State", "Gain", "Risk", "Next"], text
    assert rows["State"] == state
    assert "not yet run on a GB10" in rows["Risk"] and "sudo spark-memsaver validate" in rows["Risk"]
    if state in ("active", "unverified"):      # ours is loaded and packing in both: measured
        assert re.match(r"page-table backing saved now: \d+\.\d\d GiB \(measured", rows["Gain"]), rows
        assert "usable memory gained: about" in rows["Gain"] and "not measured here" in rows["Gain"], rows
    if state == "active":
        assert "sudo spark-memsaver validate" in rows["Next"]
    if state in ("stock", "rolled-back"):
        assert "estimate" in rows["Gain"] and "seed project" in rows["Gain"], rows
    assert "Driver sources:" not in text and "Source cache:" not in text
    assert "Saved:              n/a" not in text and "Page-table backing: n/a" not in text
    verbose = status(roots[state], "--verbose")
    assert "Driver sources:" in verbose and "Source cache:" in verbose


def test_next_is_the_stock_nodes_install(roots):
    assert "spark-memsaver install" in first(status(roots["stock"]))["Next"]


def test_a_validated_active_node_says_so(roots, tmp_path):
    from spark_memsaver.report.summary import next_step, risk
    doc = {"state": "active", "findings": [], "config": {"tier": "leaf"}, "memory": {"saved": 1 << 30},
           "records": {"last_validation": {"outcome": "passed", "finished_at": "2026-12-01T10:00:00Z"}}}
    assert risk(doc) == "validated on this node (2026-12-01T10:00:00Z)" and next_step(doc) is None
    doc["config"]["tier"] = "256"
    assert "tier 256 is not validated on hardware" in risk(doc)


@pytest.mark.parametrize("by", ["rollback", "remove"])
def test_next_on_a_held_node_is_the_holds_resume(tmp_path, by):
    """The administrator's hold (decide/hold.py) is the one thing between this node and packing: Next is the
    held finding's resume command (sudo, via remedy.py) with who held it and since when, not 'install to build'
    nor the rolled-back finding's prose."""
    import json

    from spark_memsaver.host import holds
    root = sparkroot.make_spark_root(tmp_path / by)
    if by == "rollback":
        intents.write_rollback(Host(root), sparkroot.SPARK_KERNEL, "requested by the administrator",
                               code="requested")
        rec = holds.hold(Host(root), "rollback", sparkroot.SPARK_KERNEL, "requested by the administrator")
    else:
        rec = holds.hold(Host(root), "remove", None, "requested by the administrator")
    rows = first(status(root))
    assert "Hold" in rows
    doc = json.loads(status(root, "--json"))
    held = [f for f in doc["findings"] if f["code"] == "held"]
    assert len(held) == 1 and held[0]["remedy"] == "sudo spark-memsaver install"
    what = "rollback" if by == "rollback" else "remove --all"
    assert rows["Next"] == (f"Run 'sudo spark-memsaver install' to resume packing (held since {rec['since']}, "
                            f"by {what})."), rows
    from spark_memsaver.report.summary import next_step
    assert next_step(doc) == rows["Next"]


@pytest.mark.parametrize("why", ["disabled", "predicates-unmet"])
def test_inactive_node_gains_nothing_now_and_is_not_sent_to_validate(tmp_path, why):
    """Ours loaded but packing nothing (uvm_pt_pack=0, or a GPU that does not qualify): the first screen said
    '0.00 GiB saved now (measured ...)' and 'Next: run validate'. It says packing is not on, what it would give,
    and the inactive finding's step."""
    stats = sparkroot.stats_text(tier="off", packed=0, t256=0, t4k=0) if why == "disabled" else \
        sparkroot.stats_text(packed=0, unpacked=2, t256=0, t4k=0)
    root = sparkroot.make_spark_root(tmp_path / why, uvm_loaded="ours", ours_installed="580.142", stats=stats)
    rows = first(status(root))
    assert rows["State"] == "inactive", rows
    assert "saved now" not in rows["Gain"] and "nothing now" in rows["Gain"] and "estimate" in rows["Gain"], rows
    assert "validate" not in rows["Next"] and "validated on this node" not in rows["Risk"], rows
    finding = "packing-disabled" if why == "disabled" else "packing-predicates-unmet"
    import json
    doc = json.loads(status(root, "--json"))
    remedy = next(f["remedy"] for f in doc["findings"] if f["code"] == finding)
    assert rows["Next"] == remedy, (rows, remedy)
    if why == "disabled":         # it named no command ("Remove the uvm_pt_pack=0 option and reload the module.")
        assert "'sudo modprobe -r nvidia_uvm && sudo modprobe nvidia_uvm'" in remedy, remedy
