"""The typed world (spark_memsaver/model.py): observe builds it, its JSON shape round-trips, bad input is named.

Round trip: ``World.from_json(x).as_json() == x`` for the snapshots observed on the suite's fixture roots (every
variant of tests/support/sparkroot.make_spark_root the status tests use), at each stage -- observe/'s, world's,
the planner's -- and, for the dict snapshots the decide tests write by hand (partial: a missing key takes its
default), the parse is a fixed point: parsing the rendering gives the same world (test_decide's cases,
test_lifecycle's plan table, test_installability's and test_mutant_kills' snapshots).
"""

from __future__ import annotations

import copy
import json

import pytest

from spark_memsaver import model, world
from spark_memsaver.config import Config
from spark_memsaver.errors import WorldInvalid
from spark_memsaver.host import Host
from spark_memsaver.model import ABSENT, World
from tests.support import sparkroot

VARIANTS = {
    "stock": {},
    "ours-packing": dict(uvm_loaded="ours", ours_installed=sparkroot.DRIVER, stats=sparkroot.stats_text()),
    "ours-mismatch": dict(uvm_loaded="ours", ours_installed="575.57.08"),
    "secure-boot": dict(secure_boot=True),
    "no-headers-holders": dict(headers=False, holders=2),
    "no-driver": dict(loaded_driver=None, uvm_loaded=None),
    "two-kernels-no-dkms": dict(extra_kernels=("6.8.0-50-generic",), dkms=False),
}


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("worlds")
    return {name: sparkroot.make_spark_root(base / name, **kw) for name, kw in VARIANTS.items()}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_observed_worlds_round_trip(roots, name):
    host = Host(roots[name])
    w = world.snapshot(host, Config())
    assert isinstance(w, World) and all(isinstance(k, model.Kernel) for k in w.kernels)
    assert isinstance(w.host, model.Host) and isinstance(w.records, model.Records)
    d = w.as_json()
    assert World.from_json(d).as_json() == d
    assert json.loads(json.dumps(d)) == d                     # the decided world is plain JSON
    planned, _ = world.facts(host, Config())
    p = planned.as_json()
    assert "kconfig" in p["kernels"][0] and "builds" in p["records"]
    assert "kconfig" not in d["kernels"][0] and "builds" not in d["records"]   # absent until world/ adds them
    assert World.from_json(p) == planned and World.from_json(p).as_json() == p


def test_the_shape_is_the_snapshots(roots):
    """Key for key and in order: what the dict snapshot had (the status document is built from it)."""
    d = world.snapshot(Host(roots["ours-packing"]), Config()).as_json()
    assert list(d) == ["host", "driver", "uvm", "kernels", "dkms", "secure_boot", "holders", "memory", "records",
                       "driver_sources", "hazard_inputs", "guard", "unknown", "programs_missing",
                       "observed_in_s"]
    assert list(d["host"]) == ["kernel", "arch", "page_size"]
    assert list(d["records"]) == ["intents", "rollbacks", "holds", "last_validation", "unreadable", "quarantined"]
    k = d["kernels"][0]
    assert list(k) == ["release", "running", "page_size", "headers", "uvm_selected", "nvidia_selected"]
    assert k["uvm_selected"]["state"] == "ours" and d["uvm"]["packing"]["tier"]
    assert d["memory"]["saved"] is not None


def test_hand_written_snapshots_parse_to_a_fixed_point():
    from tests import test_installability as ti
    from tests import test_mutant_kills as tm
    from tests.test_decide import CASES, base_snapshot
    from tests.test_lifecycle import PLAN_CASES
    snaps = [base_snapshot()] + [CASES[n]()[0] for n in sorted(CASES)] + [c[1] for c in PLAN_CASES] + [
        ti._pure_snap(ti.K, "6.14.0-1020-nvidia-64k", sources=[ti.DRV], by_driver={ti.DRV: ti._entry(True)}),
        ti._pure_snap(ti.K, ours="580.95.05"), tm._snap()]
    for s in snaps:
        before = copy.deepcopy(s)
        w = World.from_json(s)
        assert s == before                                       # the input is not touched
        assert World.from_json(w.as_json()) == w
        assert w.as_json() == World.from_json(w.as_json()).as_json()


def test_absent_is_not_null():
    """kconfig None (the configuration is unreadable) and kconfig absent (not gathered) stay apart."""
    w = World.from_json({"kernels": [{"release": "a", "kconfig": None}, {"release": "b"}]})
    assert w.kernels[0].kconfig is None and w.kernels[1].kconfig is ABSENT and not w.kernels[1].kconfig
    out = w.as_json()["kernels"]
    assert out[0]["kconfig"] is None and "kconfig" not in out[1]
    assert w.kernel("b") is w.kernels[1] and w.kernel("c") is None


BAD = [
    ([], "snapshot: expected an object, got list"),
    ({"host": "x"}, "snapshot.host: expected an object, got str"),
    ({"host": {"kernel": 6}}, "snapshot.host.kernel: expected str or null, got int"),
    ({"host": {"page_size": True}}, "snapshot.host.page_size: expected int or null, got bool"),
    ({"kernels": {}}, "snapshot.kernels: expected a list, got dict"),
    ({"kernels": [{"release": "k", "uvm_selected": []}]}, "snapshot.kernels[0].uvm_selected: expected an object"),
    ({"kernels": [{"release": "k", "uvm_selected": {"patched": "yes"}}]},
     "snapshot.kernels[0].uvm_selected.patched: expected bool or null, got str"),
    ({"dkms": {"registrations": [{"builds": [{"built": 1}]}]}},
     "snapshot.dkms.registrations[0].builds[0].built: expected bool, got int"),
    ({"holders": [{"pid": "1"}]}, "snapshot.holders[0].pid: expected int, got str"),
    ({"records": {"intents": None}}, "snapshot.records.intents: expected list, got NoneType"),
    ({"uvm": {"parameters": []}}, "snapshot.uvm.parameters: expected dict, got list"),
    ({"unknown": [1]}, "snapshot.unknown[0]: expected str, got int"),
    ({"hosts": {}}, "snapshot: unknown key 'hosts'"),
    ({"driver": {"sources": [{"version": "1", "color": "x"}]}}, "snapshot.driver.sources[0]: unknown key 'color'"),
]


@pytest.mark.parametrize("bad,message", BAD, ids=[m.split(":")[0] + f"-{i}" for i, (_, m) in enumerate(BAD)])
def test_a_malformed_section_is_a_named_error(bad, message):
    with pytest.raises(WorldInvalid) as e:
        model.world_of(bad)
    assert str(e.value).startswith(message)
    assert e.value.code == "world-invalid" and e.value.remedy


def test_world_of_keeps_a_world():
    w = World()
    assert model.world_of(w) is w
    assert model.world_of({}) == w


def test_no_reader_takes_the_world_as_a_dict():
    """The world is read by attribute everywhere: no ``snap["..."]`` / ``snap.get("...")`` in the package, and the
    classes have no mapping interface (a dict-style read would fail at once, not fall back)."""
    import re
    from pathlib import Path
    pkg = Path(model.__file__).parent
    pat = re.compile(r"\b(?:snap|world|w)(?:\[\"|\.get\(\")")
    bad = [f"{p.relative_to(pkg)}:{n}" for p in sorted(pkg.rglob("*.py"))
           for n, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line.split("#")[0])
           and not line.lstrip().startswith(('"', "'", "``"))]
    assert not bad, bad
    for name in ("__getitem__", "get", "keys", "__contains__"):
        assert not hasattr(World(), name), name
