"""A node upgraded from 0.1.0 keeps its records: records written by 0.1.0's OWN code are read unchanged.

0.1.0 is the tree of commit 89e99a7 (`git archive 89e99a7 daemon`), run in a subprocess with its own
PYTHONPATH on a Spark-shaped fixture root: its intents.write_intent / write_rollback, its signing.ensure
(a real key pair from openssl) and record_signed, and its dkms stock record (the fields of its
_install_one, taken from its own selected() of the real stock module, written by its _write_json). No
record is written by hand. Today's code must show them in status (nothing quarantined) and the executor
must recover the interrupted intent (its writer, a 0.1.0 process, is gone: the record has no start time).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from spark_memsaver.act import executor
from spark_memsaver.config import Config
from spark_memsaver.host import Host, events
from tests.support import sparkroot

REPO = Path(__file__).resolve().parent.parent
OLD = "89e99a7"
K = sparkroot.SPARK_KERNEL
S = "var/lib/spark-memsaver"

WRITER = textwrap.dedent("""
    import sys
    from spark_memsaver import intents, dkms, signing, config
    from spark_memsaver.host import Host
    root, K = sys.argv[1], sys.argv[2]
    h = Host(root)
    intents.write_intent(h, "remove", K, reason="requested")
    intents.write_rollback(h, K, "the NVIDIA driver is changing", code="driver-changing",
                           remedy="rebuilt after the upgrade", from_driver="580.142", to_driver="590.44.01")
    before = dkms.selected(h, K, dkms.MODULE)
    rec = {"kernel": K, "stock_path": before["path"], "stock_sha256": before["sha256"],
           "stock_version": before.get("version"), "stock_owner_dkms": None, "recorded": signing._now()}
    dkms._write_json(h, dkms._stock_record_path(K), rec)
    got = signing.ensure(h, config.load(None, root=root))
    signing.record_signed(h, {"module": "/lib/modules/%s/updates/dkms/nvidia-uvm.ko" % K, "kernel": K,
                              "serial": got["serial"], "sha256": got["sha256"]})
""")


@pytest.fixture(scope="module")
def old_root(tmp_path_factory):
    base = tmp_path_factory.mktemp("compat")
    old = base / "old"
    old.mkdir()
    arch = subprocess.run(["git", "-C", str(REPO), "archive", OLD, "daemon"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(old)], input=arch.stdout, check=True)
    # stock selected, as when 0.1.0 recorded the stock module (before its install); its remove intent is
    # then one killed after the removal, before the record was cleared
    root = sparkroot.make_spark_root(base / "root")
    env = dict(os.environ, PYTHONPATH=str(old / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    r = subprocess.run(["/usr/bin/python3", "-c", WRITER, str(root), K], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return root


def test_old_records_exist_as_written(old_root):
    for p in (f"intents/remove-{K}.json", f"rollbacks/{K}.json", f"dkms/{K}.json", "signing.json",
              "signed.json"):
        rec = json.loads((old_root / S / p).read_text())
        assert isinstance(rec, dict) and rec
    assert "start_time" not in json.loads((old_root / S / f"intents/remove-{K}.json").read_text())


def test_status_shows_old_records_and_quarantines_none(old_root, tmp_path):
    root = tmp_path / "root"
    subprocess.run(["cp", "-a", str(old_root), str(root)], check=True)
    e = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    e.pop("SPARK_MEMSAVER_CONFIG", None)
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), "status", "--json"],
                       capture_output=True, text=True, env=e, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    doc = json.loads(r.stdout)
    assert doc["records"]["quarantined"] == []
    assert [i["op"] for i in doc["records"]["intents"]] == ["remove"]
    assert [(x["kernel"], x["code"]) for x in doc["records"]["rollbacks"]] == [(K, "driver-changing")]
    codes = {f["code"] for f in doc["findings"]}
    assert "operation-interrupted" in codes and "record-quarantined" not in codes
    assert not list((root / S).rglob("*.bad-*"))


def test_executor_recovers_the_old_intent(old_root, tmp_path):
    root = tmp_path / "root"
    subprocess.run(["cp", "-a", str(old_root), str(root)], check=True)
    _, _, steps = executor.plan_now(Host(root), Config(), rebuild=False)
    mine = [s for s in steps if s.intent == f"remove-{K}"]
    assert [s.action for s in mine] == ["finish-intent"]       # its 0.1.0 writer is gone: not blocked
    done = executor.recover(Host(root), Config(), None, [])
    assert [(d["action"], d["ok"]) for d in done if d.get("intent") == f"remove-{K}"] == [("finish-intent", True)]
    assert not (root / S / f"intents/remove-{K}.json").exists()
    assert not list((root / S).rglob("*.bad-*"))


# The last main with two lifecycle logs: its intents.append_history wrote history.jsonl beside events.jsonl, from
# these call sites (act/steps: a step that acted; act/executor: the APT door; cli/lifecycle: a hook's run).
TWO_LOGS = "91e9702"
HISTORY_WRITER = textwrap.dedent("""
    import sys
    from spark_memsaver.host import Host, intents
    root, K = sys.argv[1], sys.argv[2]
    h = Host(root)
    intents.append_history(h, {"event": "remove-override", "time": intents.now(), "kernel": K,
                                "reason": "the NVIDIA driver is changing", "ok": True})
    intents.append_history(h, {"event": "apt-pre-install", "time": intents.now(),
                                "packages": ["nvidia-dkms-580-open 580.142-0ubuntu1 -> 590.44.01-0ubuntu1"],
                                "sources_seen": ["580.142"], "removed": [K], "kept": []})
    intents.append_history(h, {"event": "hook", "source": "dpkg-trigger", "time": intents.now(), "acting": 1,
                                "ok": True})
""")


def test_the_older_lifecycle_history_is_read_and_folded_into_the_one_log(old_root, tmp_path):
    """history.jsonl as 0.1.0 (its write_rollback) and the last two-log main (its append_history) wrote it: status
    readers show it with the one log (events), nothing skipped, without changing the root; the next operation
    folds it into events.jsonl and removes it, its lines in order, the new ones after them."""
    root = tmp_path / "root"
    subprocess.run(["cp", "-a", str(old_root), str(root)], check=True)
    old = tmp_path / "two-logs"
    old.mkdir()
    arch = subprocess.run(["git", "-C", str(REPO), "archive", TWO_LOGS, "daemon"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(old)], input=arch.stdout, check=True)
    env = dict(os.environ, PYTHONPATH=str(old / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    r = subprocess.run(["/usr/bin/python3", "-c", HISTORY_WRITER, str(root), K], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    hist = root / S / "history.jsonl"
    assert len(hist.read_text().splitlines()) == 4 and not (root / S / "events.jsonl").exists()
    e = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    e.pop("SPARK_MEMSAVER_CONFIG", None)
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), "events", "--json"],
                       capture_output=True, text=True, env=e, timeout=120)
    assert r.returncode == 0 and "unreadable" not in r.stderr, r.stderr
    rows = json.loads(r.stdout)
    want = [("rolled-back", None), ("step", "remove-override"), ("apt-pre-install", None), ("hook", None)]
    assert [(x["op"], x.get("action")) for x in rows] == want, rows
    assert (rows[0]["kernel"], rows[0]["code"], rows[0]["from_driver"]) == (K, "driver-changing", "580.142")
    assert rows[2]["removed"] == [K] and rows[3]["source"] == "dpkg-trigger"
    assert hist.exists() and not (root / S / "events.jsonl").exists()        # an inspection wrote nothing
    done = executor.recover(Host(root), Config(), None, [])
    assert [d["action"] for d in done if d.get("intent") == f"remove-{K}"] == ["finish-intent"]
    assert not hist.exists()
    lines = (root / S / "events.jsonl").read_text().splitlines()
    assert [json.loads(x)["op"] for x in lines][:4] == [w[0] for w in want] and len(lines) >= 5
    assert all("event" not in json.loads(x) for x in lines)
    after = events.read(Host(root))
    assert after[:4] == rows and ("step", "finish-intent") in [(x["op"], x.get("action")) for x in after[4:]]
