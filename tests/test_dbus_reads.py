"""Open D-Bus reads of spark-memsaverd are rate limited per sender and their replies are bounded
(service/auth.ReadLimiter, service/dbus_service, service/daemon.history_json).

Real parts: spark-memsaverd on a private system bus (tests/support/privatebus.py) over a Spark-like root, a
caller as uid 65534 (setpriv) making its calls on ONE connection (one sender), and root. Before: no limit
(GetHistory cost ~11 ms of main-loop time per call at the defaults) and GetHistory replied with the whole
ring (0.66 s and 29 MB at history_size 100000).
"""

from __future__ import annotations

import ast
import json
import subprocess
import time

import pytest

from spark_memsaver import config as cfg, record
from spark_memsaver.host import Host
from spark_memsaver.service import auth, names
from spark_memsaver.service.monitor import Monitor, pack
from tests.support import sparkroot
from tests.test_dbus import NOBODY, bus, daemon, gdbus_call, spark  # noqa: F401  (module fixtures)

pytestmark = pytest.mark.dbus

CALLER = r"""
import json, sys, time
from gi.repository import Gio, GLib
con = Gio.DBusConnection.new_for_address_sync(sys.argv[1], Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT |
                                              Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION, None, None)
ok, errors, t0 = 0, {}, time.monotonic()
for _ in range(int(sys.argv[3])):
    try:
        con.call_sync(sys.argv[2], sys.argv[4], sys.argv[2], "GetHistory", None, GLib.VariantType("(s)"),
                      Gio.DBusCallFlags.NONE, 10000, None)
        ok += 1
    except GLib.Error as e:
        name = Gio.DBusError.get_remote_error(e) or e.message
        errors[name] = errors.get(name, 0) + 1
print(json.dumps({"ok": ok, "errors": errors, "seconds": time.monotonic() - t0, "me": con.get_unique_name()}))
"""


def _calls(bus, n: int, user=None) -> dict:
    argv = (NOBODY if user == "nobody" else []) + ["/usr/bin/python3", "-c", CALLER, bus.address, names.BUS_NAME,
                                                   str(n), names.OBJECT_PATH]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_open_reads_are_rate_limited_per_sender(daemon, bus):  # noqa: F811
    got = _calls(bus, 80, user="nobody")
    allowed = auth.READ_BURST + auth.READ_RATE * got["seconds"] + 1
    assert got["ok"] <= allowed, got
    assert got["ok"] >= auth.READ_BURST and set(got["errors"]) == {names.ERROR_PREFIX + "RateLimited"}, got
    again = _calls(bus, 5, user="nobody")          # another connection: another sender, its own bucket
    assert again["ok"] == 5, again
    root = _calls(bus, 80)                         # root is not limited
    assert root["ok"] == 80 and not root["errors"], root
    r = gdbus_call(bus, "GetHistory", user="nobody")
    assert r.returncode == 0, r.stderr
    log = daemon.text()
    assert log.count("GetHistory (rate limited)") == 1, log[-3000:]    # logged once, then summed up


def test_get_history_since_over_the_bus(daemon, bus):  # noqa: F811
    r = gdbus_call(bus, "GetHistorySince", "0", "2", user="nobody")
    assert r.returncode == 0, r.stderr
    rows = json.loads(ast.literal_eval(r.stdout.strip())[0])      # gdbus prints ('<json>',)
    assert 1 <= len(rows) <= 2
    r = gdbus_call(bus, "GetHistorySince", "nan", "2", user="nobody")
    assert names.ERROR_PREFIX + "InvalidArgument" in r.stderr, r.stderr
    future = gdbus_call(bus, "GetHistorySince", str(time.time() + 3600), "0")
    assert future.returncode == 0 and "'[]'" in future.stdout, future.stdout


def test_history_replies_are_bounded_whatever_history_size(tmp_path, spark):  # noqa: F811
    from spark_memsaver.service import dbus_service as ds
    from spark_memsaver.service.daemon import Daemon as Core
    c = record.replace(cfg.load(None, root=str(spark)), history_size=100_000)
    core = Core(root=str(spark))
    core.monitor = Monitor(Host(str(spark)), c, on_sample=lambda s: None, on_module_event=lambda a, b: None,
                           on_paths_changed=lambda p: None)
    t0 = 1_800_000_000.0
    for i in range(100_000):
        core.monitor.history.append(pack({"time": t0 + 60 * i, "reason": "interval", "mem_total": 1 << 37,
                                          "mem_available": 1 << 36, "backing_bytes": 1 << 28}))
    manager = ds.Manager.__new__(ds.Manager)
    manager._core = core
    t = time.monotonic()
    whole = json.loads(core.history_json(limit=ds.HISTORY_DEFAULT))
    assert len(whole) == ds.HISTORY_DEFAULT and whole[-1]["time"] == t0 + 60 * 99_999
    assert whole[0]["time"] < whole[-1]["time"]
    since = json.loads(core.history_json(since=t0 + 60 * 99_990, limit=ds.HISTORY_MAX))
    assert [s["time"] for s in since] == [t0 + 60 * i for i in range(99_990, 100_000)]
    assert len(json.loads(core.history_json(limit=ds.HISTORY_MAX))) == ds.HISTORY_MAX
    assert time.monotonic() - t < 10


def test_read_limiter_buckets():
    now = [0.0]
    lim = auth.ReadLimiter(rate=2.0, burst=3, max_senders=2, clock=lambda: now[0])
    assert [lim.allow(":1.5", 1000) for _ in range(4)] == [True, True, True, False]
    now[0] += 0.5                                                  # one token back
    assert [lim.allow(":1.5", 1000) for _ in range(2)] == [True, False]
    assert all(lim.allow(":1.5", 0) for _ in range(50))          # root
    assert lim.allow(":1.6", 1000) and lim.allow(":1.7", 1000)   # the table stays at 2 senders
    assert len(lim._b) == 2


def test_get_events_reads_the_one_lifecycle_log(daemon, bus, spark):  # noqa: F811
    """GetEvents answers from host/events.py's log, what `spark-memsaver events` prints: read at each call (a line
    written after the daemon started is there), since and limit applied, a bad since refused."""
    from spark_memsaver.host import events
    host = Host(str(spark))
    assert events.note(host, "rolled-back", kernel=sparkroot.SPARK_KERNEL, reason="GPU fault", code="requested")
    assert events.record(host, "rollback", {"kernel": sparkroot.SPARK_KERNEL, "reason": "GPU fault"}, result={"ok": True})
    want = events.read(host)
    r = gdbus_call(bus, "GetEvents", "0", "0", user="nobody")
    assert r.returncode == 0, r.stderr
    rows = json.loads(ast.literal_eval(r.stdout.strip())[0])
    assert rows == want[-100:] and [e["op"] for e in rows[-2:]] == ["rolled-back", "rollback"]
    r = gdbus_call(bus, "GetEvents", "0", "1", user="nobody")
    assert json.loads(ast.literal_eval(r.stdout.strip())[0]) == want[-1:]
    r = gdbus_call(bus, "GetEvents", str(time.time() + 3600), "0")
    assert r.returncode == 0 and "'[]'" in r.stdout, r.stdout
    r = gdbus_call(bus, "GetEvents", "inf", "2", user="nobody")
    assert names.ERROR_PREFIX + "InvalidArgument" in r.stderr, r.stderr
