"""The opt-in free-memory floor (config memory_floor, service/floor.py): off by default; a PSI trigger on
/proc/pressure/memory watched by the main loop (no timer); under pressure with MemFree below the floor, one reclaim
job up to the floor, at most once a minute, never beside another job.

Real parts: this machine's /proc/pressure/memory takes the trigger (root, as CI runs), GLib's main loop watches it;
the daemon on a private bus writes the trigger into its root's pressure file. The job start is the daemon's; here a
recording callable stands in for it where only the decision is tested."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from spark_memsaver import config as cfg
from spark_memsaver.errors import Busy, ConfigError
from spark_memsaver.host import Host
from spark_memsaver.service import floor
from tests.support import needs

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures" / "memory"
GIB = 1 << 30


def test_off_by_default_and_checked_as_a_size():
    assert cfg.Config().memory_floor == "off" and floor.floor_bytes("off") is None
    assert cfg.parse("memory_floor: 8G", "f").memory_floor == "8G" and floor.floor_bytes("8G") == 8 * GIB
    assert floor.floor_bytes("1.5GiB") == 3 * GIB // 2
    for bad in ("8X", "0G", "-1G", "lots"):
        with pytest.raises(ConfigError, match="memory_floor"):
            cfg.parse(f"memory_floor: {bad}", "f")
    with pytest.raises(ConfigError):
        cfg.parse("memory_floor: 8", "f")     # an int: bytes must be written as a size string


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_below_the_floor_reclaims_once_a_minute_and_never_beside_a_job():
    host = Host(FIX / "gb10-64k")                  # MemFree 7.43 GiB
    asked, clock = [], Clock()
    f = floor.Floor(host, 8 * GIB, asked.append, clock=clock)
    assert f.check("memory pressure") == "reclaiming" and asked == [8 * GIB]
    clock.t += 30
    assert f.check("memory pressure") == "rate-limited" and len(asked) == 1
    clock.t += 31
    assert f.check("memory pressure") == "reclaiming" and len(asked) == 2 and f.actions == 2
    assert floor.Floor(host, 4 * GIB, asked.append).check("x") == "above" and len(asked) == 2

    def busy(_need):
        raise Busy("another operation is running")
    b = floor.Floor(host, 8 * GIB, busy, clock=clock)
    assert b.check("memory pressure") == "busy" and b.last is None    # the next wake-up tries again


def test_the_trigger_is_accepted_by_this_kernel_and_costs_no_wakeup_without_pressure():
    needs.root("writing a PSI trigger needs root here (run as root, as CI does)")
    if not Host("/").exists(floor.PSI_MEMORY):
        needs.not_applicable("this kernel has no PSI (/proc/pressure/memory)")
    from gi.repository import GLib
    quiet = "some avg10=0.00" in Host("/").read_text(floor.PSI_MEMORY)
    asked = []
    f = floor.Floor(Host("/"), 1, asked.append)     # a floor of 1 byte: never acted on, whatever the pressure
    assert f.start() and f.fd is not None and f.source is not None
    try:
        loop = GLib.MainLoop()
        GLib.timeout_add(2000, loop.quit)
        loop.run()
        if quiet and "some avg10=0.00" in Host("/").read_text(floor.PSI_MEMORY):
            assert f.wakeups == 0               # no pressure, no wake-up: there is no timer
        assert asked == [] and f.actions == 0
    finally:
        f.stop()
    assert f.fd is None and f.source is None


def test_no_psi_file_means_no_floor(tmp_path):
    f = floor.Floor(Host(tmp_path), 8 * GIB, [].append)
    assert f.start() is False and f.fd is None


@pytest.mark.dbus
def test_the_daemon_registers_the_trigger_when_the_floor_is_set(tmp_path):
    from tests.support import sparkroot
    from tests.support.privatebus import PrivateSystemBus
    from tests.test_dbus import Daemon, _need
    _need("dbus-daemon", "gdbus", "depmod", "gcc")
    needs.root("the bus tests run the daemon as root (run as root, as CI does)")
    d = Path(tempfile.mkdtemp(prefix="spark-memsaver-bus."))
    bus = PrivateSystemBus(d).start()
    spark = sparkroot.make_spark_root(tmp_path / "root")
    (spark / "proc/pressure").mkdir(parents=True, exist_ok=True)
    (spark / "proc/pressure/memory").write_text("")
    (spark / "etc/spark-memsaver").mkdir(parents=True, exist_ok=True)
    (spark / "etc/spark-memsaver/config.yaml").write_text("memory_floor: 8G\n")
    daemon = Daemon(bus, spark, tmp_path / "daemon.log")
    try:
        daemon.wait_idle()
        daemon.wait(lambda: "memory floor 8192 MiB: PSI trigger" in daemon.text(), "the floor's log line")
        assert (spark / "proc/pressure/memory").read_bytes() == floor.TRIGGER + b"\0"
    finally:
        daemon.stop()
        bus.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_without_a_floor_a_trigger_event_still_starts_the_black_box():
    from gi.repository import GLib
    seen, asked = [], []
    f = floor.Floor(Host(FIX / "gb10-64k"), None, asked.append, on_pressure=lambda: seen.append(1))
    assert f._on_event(None, GLib.IOCondition.PRI) is True
    assert seen == [1] and asked == [] and f.check("x") == "off" and f.wakeups == 1
