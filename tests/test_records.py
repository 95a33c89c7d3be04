"""Issue 12 defect 3: a record of the wrong type or fields never crashes a door.

For every record kind the product reads (intents, rollback records, stock records, build records, the
signing record and signed-module log, the validate report, the MOK request record) and for each bad shape
(`[]`, `"text"`, `{"kernel": 5}`, bytes that are not JSON): the real CLI's `status --json` on a Spark-shaped
fixture root exits 0/1 with the finding `record-quarantined` naming the file and the reason, no traceback,
and leaves the file as it is (an inspection never writes: issue 22 defect 4, `status --root IMAGE` renamed
records inside the image); the reconcile planner on such a root plans, and a root operation (the executor)
sets it aside (`<name>.bad-<UTC>`, content intact). A bad hold record still holds and is never set aside
by automation. 0.1.0's code (and this tree before host/records.py) crashed status on `[]`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from spark_memsaver.act import executor
from spark_memsaver.config import Config
from spark_memsaver.host import Host, records
from tests.support import sparkroot

REPO = Path(__file__).resolve().parent.parent
K = sparkroot.SPARK_KERNEL
S = "var/lib/spark-memsaver"
WHERE = {"intent": f"{S}/intents/build-{K}.json", "rollback": f"{S}/rollbacks/{K}.json",
         "stock": f"{S}/dkms/{K}.json", "build": f"{S}/builds/{K}.json", "signing": f"{S}/signing.json",
         "signed-log": f"{S}/signed.json", "validate": f"{S}/validate-last.json",
         "mok-request": f"{S}/mok-request.json", "hold": f"{S}/holds/{K}.json"}
BAD = {"array": b"[]", "string": b'"text"', "wrong-field": b'{"kernel": 5}', "garbage": b'{"op": "bu\xff\x00'}


def cli(*args):
    e = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    e.pop("SPARK_MEMSAVER_CONFIG", None)
    return subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", *args], capture_output=True, text=True,
                          env=e, timeout=120)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return sparkroot.make_spark_root(tmp_path_factory.mktemp("records") / "root", ours_installed="580.142")


def _root(template, tmp_path, kind, payload) -> Path:
    root = tmp_path / "root"
    subprocess.run(["cp", "-a", str(template), str(root)], check=True)
    f = root / WHERE[kind]
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(payload)
    return root


def _aside(root, kind):
    f = root / WHERE[kind]
    return sorted(f.parent.glob(f.name + ".bad-*"))


def test_every_kind_is_covered():
    assert set(WHERE) == set(records.DIRS) | set(records.FILES)


@pytest.mark.parametrize("shape", BAD)
@pytest.mark.parametrize("kind", WHERE)
def test_status_reports_a_bad_record_and_never_renames_it(template, tmp_path, kind, shape):
    root = _root(template, tmp_path, kind, BAD[shape])
    r = cli("--root", str(root), "status", "--json")
    assert r.returncode in (0, 1), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    doc = json.loads(r.stdout)
    found = [f for f in doc["findings"] if f["code"] == "record-quarantined"]
    assert len(found) == 1 and f"/{WHERE[kind]}" in found[0]["message"], doc["findings"]
    assert (root / WHERE[kind]).read_bytes() == BAD[shape] and not _aside(root, kind)   # the image is untouched
    q = doc["records"]["quarantined"][0]
    assert q["path"] == f"/{WHERE[kind]}" and q["kind"] == kind and q["reason"] and q["moved_to"] is None
    again = json.loads(cli("--root", str(root), "status", "--json").stdout)
    assert [f["code"] for f in again["findings"] if f["code"] == "record-quarantined"] == ["record-quarantined"]
    assert [k["release"] for k in again["kernels"]] == [k["release"] for k in doc["kernels"]]
    if kind == "hold":      # the administrator's word is never guessed: an unreadable hold holds every kernel
        assert again["hold"]["resume"] == "sudo spark-memsaver install --all"
    # a root operation (here reconcile without rebuilds, as the daemon runs at start) sets it aside
    r = cli("--root", str(root), "reconcile", "--no-rebuild", "--json")
    assert r.returncode in (0, 1, 3) and "Traceback" not in r.stderr, r.stderr
    if kind == "hold":      # ... and the hold stays, in a readable record of the same scope (issue 34)
        held = json.loads(cli("--root", str(root), "status", "--json").stdout)["hold"]
        assert held["by"] == "remove" and held["kernel"] == K and "unreadable" in held["reason"], held
    else:
        assert not (root / WHERE[kind]).exists()
    aside = _aside(root, kind)
    assert len(aside) == 1 and aside[0].read_bytes() == BAD[shape]        # renamed, never deleted
    after = json.loads(cli("--root", str(root), "status", "--json").stdout)
    assert not [f for f in after["findings"] if f["code"] == "record-quarantined"]


@pytest.mark.parametrize("shape", BAD)
@pytest.mark.parametrize("kind", WHERE)
def test_reconcile_plans_on_a_root_with_a_bad_record(template, tmp_path, kind, shape):
    root = _root(template, tmp_path, kind, BAD[shape])
    snap, _, steps = executor.plan_now(Host(root), Config(), rebuild=False)
    assert [q["path"] for q in snap.records.quarantined] == [f"/{WHERE[kind]}"]
    assert not [s for s in steps if s.action == "blocked"]
    assert not _aside(root, kind)                                          # planning reads only
    drops = [s.path for s in steps if s.action == "drop-record"]
    assert drops == [f"/{WHERE[kind]}"]          # a hold too: set aside, and kept readable (issue 34)


@pytest.mark.parametrize("kind", WHERE)
def test_reconcile_cli_dry_run_with_a_bad_record(template, tmp_path, kind):
    root = _root(template, tmp_path, kind, b"[]")
    r = cli("--root", str(root), "reconcile", "--dry-run", "--json")
    assert r.returncode in (0, 1), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    json.loads(r.stdout)
    assert not _aside(root, kind) and (root / WHERE[kind]).exists()


def test_field_checks():
    assert records.check("intent", {"op": "build", "pid": 7, "kernel": None})
    for bad in ([], "x", {"kernel": "k"}, {"op": "build", "pid": "7"}, {"op": "build", "pid": True},
                {"op": 3}):
        with pytest.raises(records.BadRecord):
            records.check("intent", bad)


def test_a_pending_fetch_record_is_typed(tmp_path):
    """sources-pending.json (a driver-source fetch deferred past apt) is read by host/records.py's typed reader
    ("sources-pending"), not parsed by observe/sources on its own: one whose drivers are not a list of versions is
    not trusted. Before: '"drivers": 5' was taken as a pending fetch, so `status --verbose` stopped with an
    internal error (TypeError) and the APT door's defer could not add its driver."""
    from spark_memsaver.act import source_fetch
    from spark_memsaver.observe import sources as osrc
    root = sparkroot.make_spark_root(tmp_path / "r")
    host = Host(root)
    p = root / "var/cache/spark-memsaver/sources-pending.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    for bad in ('{"format": 1, "drivers": 5, "reason": "x"}', '{"drivers": "580.142"}', '{"drivers": [5]}',
                '{"format": 1}', '["580.142"]', '{"drivers": ["580.142"], "kernel": 7}', '{"drivers": [', ''):
        p.write_text(bad)
        assert osrc.pending(host) is None, bad
    p.write_text('{"format": 1, "drivers": 5, "reason": "x"}')
    r = cli("--root", str(root), "status", "--verbose")
    assert r.returncode in (0, 1) and "internal" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert source_fetch.defer(host, "580.142", sparkroot.SPARK_KERNEL, "apt runs")["drivers"] == ["580.142"]
    rec = osrc.pending(host)
    assert rec["drivers"] == ["580.142"] and rec["kernel"] == sparkroot.SPARK_KERNEL and "_path" not in rec
    assert "Source fetch" in cli("--root", str(root), "status", "--verbose").stdout
