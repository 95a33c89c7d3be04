"""spark-memsaverd on a private system bus: real dbus-daemon (stock system.conf + OUR shipped policy file),
real clients (busctl, gdbus, the CLI), an unprivileged caller through setpriv, polkit through python-dbusmock's
polkitd template.

The daemon inspects a Spark-like root (tests/support/sparkroot.py: real-format procfs/sysfs/efivarfs files,
real ELF modules, real depmod). That root stands in for a GB10 node with NVIDIA 580.142 and our nvidia-uvm
loaded (its counters file is byte-for-byte what the patched module prints): none of that can exist here.
The daemon runs with --no-reconcile so nothing on this shared machine is changed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support import needs, sparkroot
from tests.support.privatebus import REPO, PrivateSystemBus, start_daemon, stop_process

sys.path.insert(0, str(REPO / "daemon"))
from spark_memsaver.service import names  # noqa: E402

pytestmark = pytest.mark.dbus

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
MUTATING = {  # method -> gdbus arguments that are well-formed
    "Build": ["{}"], "Install": ["{}"], "Remove": ["{}"], "Activate": ["{}"], "Rollback": ["{}"],
    "RequestEnrollment": ["'secret-pass'", "{}"], "Refresh": ["{}"], "PrepareLaunch": ["1073741824", "{}"],
}


def _need(*tools):
    needs.require(*tools, remedy="tools/deps/dbus.txt")


# --- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bus():
    _need("dbus-daemon", "busctl", "gdbus", "setpriv")
    needs.root("the bus tests run the daemon as root and a caller as uid 65534 (run as root, as CI does)")
    d = Path(tempfile.mkdtemp(prefix="spark-memsaver-bus."))   # reachable by uid 65534 (pytest's tmp is 0700)
    b = PrivateSystemBus(d).start()
    yield b
    b.stop()
    shutil.rmtree(d, ignore_errors=True)


class Daemon:
    def __init__(self, bus, root: Path, log: Path, *args, env=None, prefix=()):
        self.bus, self.root, self.log = bus, root, log
        self.proc = start_daemon(bus, "--debug", "--no-reconcile", "--root", str(root), *args,
                                 log_path=log, env=env, prefix=prefix)
        try:
            self.name_after = bus.wait_for_name(names.BUS_NAME, timeout=20, proc=self.proc)
            self.wait(lambda: self.prop("State") != "starting", "the first status")
        except Exception:
            self.stop()
            raise

    def text(self) -> str:
        return self.log.read_text()

    def prop(self, name):
        return json.loads(busctl("get-property", names.BUS_NAME, names.OBJECT_PATH, names.INTERFACE, name,
                                 "--json=short", bus=self.bus).stdout)["data"]

    def wait(self, cond, what, timeout=30.0):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if cond():
                return
            assert self.proc.poll() is None, f"daemon exited ({self.proc.returncode}):\n{self.text()[-3000:]}"
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}\n{self.text()[-3000:]}")

    def wait_idle(self):
        self.wait(lambda: self.prop("JobState") != "running", "the running job to finish")

    def stop(self):
        return stop_process(self.proc)


def busctl(*args, bus, user=None, check=True):
    argv = (NOBODY if user == "nobody" else []) + ["busctl", f"--address={bus.address}", *args]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check:
        assert r.returncode == 0, f"{argv}: {r.stderr}"
    return r


def gdbus_call(bus, method, *args, user=None, iface=names.INTERFACE):
    argv = (NOBODY if user == "nobody" else []) + [
        "gdbus", "call", "--address", bus.address, "--dest", names.BUS_NAME, "--object-path", names.OBJECT_PATH,
        "--method", f"{iface}.{method}", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def dbus_error(r) -> str:
    m = re.search(r"GDBus\.Error:([\w.]+)", r.stderr)
    return m.group(1) if m else f"<no error: rc={r.returncode} out={r.stdout!r} err={r.stderr!r}>"


def job_id(r) -> int:
    m = re.match(r"\(uint32 (\d+),\)", r.stdout.strip())
    assert m, (r.stdout, r.stderr)
    return int(m.group(1))


class Monitor:
    """`gdbus monitor` on the bus, filtered to our name; its output is read after the fact."""

    def __init__(self, bus, tmp: Path):
        self.out = tmp / f"monitor-{time.monotonic_ns()}.txt"
        self.f = open(self.out, "w")
        self.proc = subprocess.Popen(["gdbus", "monitor", "--address", bus.address, "--dest", names.BUS_NAME],
                                     stdout=self.f, stderr=subprocess.STDOUT, env=bus.env(), start_new_session=True)
        t0 = time.monotonic()
        while "Monitoring signals" not in self.out.read_text() and time.monotonic() - t0 < 10:
            time.sleep(0.05)

    def text(self) -> str:
        return self.out.read_text()

    def wait_for(self, pattern, timeout=30.0) -> str:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            t = self.text()
            if re.search(pattern, t):
                return t
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not seen in gdbus monitor output:\n{self.text()[-3000:]}")

    def stop(self):
        stop_process(self.proc, timeout=5)
        self.f.close()


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    _need("depmod", "gcc")
    return sparkroot.make_spark_root(tmp_path_factory.mktemp("spark") / "root", uvm_loaded="ours",
                                     stats=sparkroot.stats_text(t256=52989, t4k=259))


@pytest.fixture(scope="module")
def daemon(bus, spark, tmp_path_factory):
    d = Daemon(bus, spark, tmp_path_factory.mktemp("log") / "daemon.log")
    yield d
    d.stop()


def cli(*args, bus, env=None):
    e = bus.env(PYTHONPATH=str(REPO / "daemon"))
    e.pop("SPARK_MEMSAVER_CONFIG", None)
    if env:
        e.update(env)
    return subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", *args], capture_output=True, text=True,
                          env=e, timeout=60)


# --- the bus API ---------------------------------------------------------------------------------

def test_name_owned_promptly_and_introspection_is_complete(daemon, bus):
    assert daemon.name_after < 10, daemon.name_after   # the benchmark reports the real figure
    r = busctl("introspect", names.BUS_NAME, names.OBJECT_PATH, bus=bus)
    for member in ("GetStatus", "GetHistory", "GetJob", "Build", "Install", "Remove", "Activate", "Rollback",
                   "RequestEnrollment", "Refresh", "JobProgress", "JobFinished", "State", "BackingBytes"):
        assert re.search(rf"^\.{member}\s", r.stdout, re.M), member
    assert re.search(r"^\.State\s+property\s+s\s+\S+\s+emits-change", r.stdout, re.M), r.stdout
    assert re.search(r"^\.Version\s+property\s+s\s+\S+\s+const", r.stdout, re.M), r.stdout
    g = subprocess.run(["gdbus", "introspect", "--address", bus.address, "--dest", names.BUS_NAME,
                        "--object-path", names.OBJECT_PATH], capture_output=True, text=True, timeout=30)
    assert g.returncode == 0, g.stderr
    assert f"interface {names.INTERFACE} {{" in g.stdout
    assert "RequestEnrollment(in  s password," in g.stdout
    assert "JobFinished(u job_id," in g.stdout
    assert "readonly t SavedBytes" in g.stdout


def test_properties_mirror_the_status_document(daemon, bus, spark):
    doc = json.loads(_get_status(bus))
    stats = sparkroot.stats_text(t256=52989, t4k=259)
    backing = int(re.search(r"^backing_bytes (\d+)", stats, re.M).group(1))
    saved = int(re.search(r"^saved_bytes (\d+)", stats, re.M).group(1))
    assert daemon.prop("State") == doc["state"]
    assert daemon.prop("KernelRelease") == sparkroot.SPARK_KERNEL == doc["host"]["kernel"]
    assert daemon.prop("DriverVersion") == sparkroot.DRIVER
    assert daemon.prop("UvmPatched") is True
    assert daemon.prop("PackingActive") is True
    assert daemon.prop("BackingBytes") == backing == doc["memory"]["pagetable_backing"]
    assert daemon.prop("SavedBytes") == saved == doc["memory"]["saved"]
    assert daemon.prop("SecureBootState") == doc["secure_boot"]["state"]
    assert [f[0] for f in daemon.prop("Findings")] == [f["code"] for f in doc["findings"]]
    # GetAll through gdbus returns every property in one round trip.
    r = gdbus_call(bus, "GetAll", f"'{names.INTERFACE}'", iface=names.PROPERTIES_IFACE)
    assert r.returncode == 0, r.stderr
    for p in ("'Version'", "'State'", "'Findings'", "'JobState'", "'LastError'", "'Interval': <uint32 60>"):
        assert p in r.stdout, p


def _get_status(bus, user=None) -> str:
    r = busctl("call", names.BUS_NAME, names.OBJECT_PATH, names.INTERFACE, "GetStatus", "--json=short",
               bus=bus, user=user)
    return json.loads(r.stdout)["data"][0]


def test_getstatus_is_the_cli_document(daemon, bus, spark):
    via_daemon = json.loads(_get_status(bus))
    assert via_daemon.pop("source") == "daemon"
    direct = cli("--root", str(spark), "status", "--json", "--direct", bus=bus)
    assert direct.returncode in (0, 1), direct.stderr
    direct_doc = json.loads(direct.stdout)
    assert direct_doc.pop("source") == "direct"
    # schema 2 stamps each document with the second it was made; the rest must be the same document
    for d in (via_daemon, direct_doc):
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", d.pop("generated_at", "1970-01-01T00:00:00Z"))
    assert via_daemon == direct_doc
    # The CLI asks the daemon when it runs (root "/"), and says so; the JSON is the same document.
    asked = cli("status", "--json", bus=bus)
    assert asked.returncode in (0, 1), asked.stderr
    asked_doc = json.loads(asked.stdout)
    assert asked_doc.pop("source") == "daemon"
    asked_doc.pop("generated_at", None)
    assert asked_doc == direct_doc
    text = cli("status", bus=bus)
    assert "(source: spark-memsaverd)" in text.stdout


def test_history_holds_samples(daemon, bus):
    hist = json.loads(json.loads(busctl("call", names.BUS_NAME, names.OBJECT_PATH, names.INTERFACE,
                                        "GetHistory", "--json=short", bus=bus).stdout)["data"][0])
    assert hist and hist[0]["reason"] == "start"
    assert hist[-1]["backing_bytes"] == daemon.prop("BackingBytes")
    assert hist[-1]["mem_total"] == 128452160 * 1024    # the root's /proc/meminfo
    r = cli("history", bus=bus)
    assert r.returncode == 0, r.stderr
    assert "start" in r.stdout


def test_counter_change_is_published_with_propertieschanged_and_job_signals(daemon, bus, spark, tmp_path):
    daemon.wait_idle()
    mon = Monitor(bus, tmp_path)
    stats = spark / "sys/module/nvidia_uvm/parameters/uvm_pt_pack_stats"
    old = stats.read_text()
    try:
        stats.write_text(sparkroot.stats_text(t256=90000, t4k=300))   # the GPU work grew
        new_backing = int(re.search(r"^backing_bytes (\d+)", stats.read_text(), re.M).group(1))
        assert new_backing != daemon.prop("BackingBytes")
        jid = job_id(gdbus_call(bus, "Refresh", "{}"))
        out = mon.wait_for(rf"JobFinished \(uint32 {jid}, 'refresh', true")
        out = mon.wait_for(rf"PropertiesChanged \('{re.escape(names.INTERFACE)}', \{{[^\n]*'BackingBytes': "
                           rf"<uint64 {new_backing}>")
        assert re.search(rf"JobProgress \(uint32 {jid}, 0\.050*\d*, 'reading the host'\)", out), out
        assert daemon.prop("BackingBytes") == new_backing
        assert daemon.prop("JobState") == "succeeded" and daemon.prop("JobId") == jid
        job = json.loads(json.loads(busctl("call", names.BUS_NAME, names.OBJECT_PATH, names.INTERFACE, "GetJob",
                                           "u", str(jid), "--json=short", bus=bus).stdout)["data"][0])
        assert job["state"] == "succeeded" and job["uid"] == 0 and job["result"]["state"]
    finally:
        stats.write_text(old)
        mon.stop()
        daemon.wait_idle()
        gdbus_call(bus, "Refresh", "{}")
        daemon.wait_idle()


def test_a_named_error_from_an_operation_travels_through_the_job_and_the_password_stays_secret(daemon, bus,
                                                                                                tmp_path):
    # The real enroll.request_enrollment on the fixture root: Secure Boot is off there, so it refuses with its
    # own named error before touching anything (and it never writes EFI variables under --root).
    daemon.wait_idle()
    mon = Monitor(bus, tmp_path)
    secret = "Sup3r-s3cret-MOK-pw"
    try:
        jid = job_id(gdbus_call(bus, "RequestEnrollment", f"'{secret}'", "{}"))
        out = mon.wait_for(rf"JobFinished \(uint32 {jid}, 'request-enrollment', false, '([\w.]+)'")
        name = re.search(rf"JobFinished \(uint32 {jid}, 'request-enrollment', false, '([\w.]+)'", out).group(1)
        assert name.startswith(names.ERROR_PREFIX) and name != names.ERROR_FAILED, name
        payload = re.search(rf"JobFinished \(uint32 {jid}, [^\n]*'(\{{.*\}})'\)", out).group(1)
        assert json.loads(payload)["dbus_name"] == name and json.loads(payload)["remedy"] is not None
        daemon.wait(lambda: daemon.prop("LastErrorName") == name, "LastErrorName")
        assert daemon.prop("JobState") == "failed"
    finally:
        mon.stop()
    assert secret not in mon.text() and secret not in daemon.text()
    assert "Traceback" not in daemon.text()
    # Through the client the same failure is the named error again, with its code, remedy and exit code.
    code = ("import json; from spark_memsaver.cli import client\n"
            "try:\n    client.call_job('RequestEnrollment', 'pw-2', {})\n"
            "except Exception as e:\n"
            "    print(json.dumps([type(e).__name__, e.code, e.exit_code, e.remedy]))\n")
    c = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=60,
                       env=bus.env(PYTHONPATH=str(REPO / "daemon")))
    cls, err_code, exit_code, remedy = json.loads(c.stdout)
    assert cls == names.error_short_name(name) and err_code == json.loads(payload)["code"]
    assert exit_code in (1, 2, 3, 4) and remedy == json.loads(payload)["remedy"]


# --- authorization -------------------------------------------------------------------------------

def test_unprivileged_caller_reads_but_every_mutation_is_refused(daemon, bus):
    assert busctl("get-property", names.BUS_NAME, names.OBJECT_PATH, names.INTERFACE, "State",
                  bus=bus, user="nobody").stdout.startswith("s ")
    assert json.loads(_get_status(bus, user="nobody"))["source"] == "daemon"
    r = gdbus_call(bus, "GetAll", f"'{names.INTERFACE}'", user="nobody", iface=names.PROPERTIES_IFACE)
    assert r.returncode == 0, r.stderr
    assert gdbus_call(bus, "Ping", user="nobody", iface=names.PEER_IFACE).returncode == 0
    for method, args in MUTATING.items():
        r = gdbus_call(bus, method, *args, user="nobody")
        assert dbus_error(r) == names.ERROR_NOT_AUTHORIZED, (method, r.stderr)
        assert "polkit" in r.stderr
    # The bus itself refuses: nobody may own our name (our policy file gives it to root only).
    r = subprocess.run(NOBODY + ["gdbus", "call", "--address", bus.address, "--dest", "org.freedesktop.DBus",
                                 "--object-path", "/org/freedesktop/DBus", "--method",
                                 "org.freedesktop.DBus.RequestName", names.BUS_NAME, "4"],
                       capture_output=True, text=True, timeout=30)
    assert dbus_error(r) == "org.freedesktop.DBus.Error.AccessDenied", r.stderr
    assert daemon.proc.poll() is None


@pytest.fixture
def polkit(bus, tmp_path):
    """python-dbusmock's polkitd template owning org.freedesktop.PolicyKit1 on the private bus."""
    needs.require_modules("dbusmock", interpreter="/usr/bin/python3", remedy="python3-dbusmock, tools/deps/dbus.txt")
    log = open(tmp_path / "polkitd-mock.log", "w")
    p = subprocess.Popen(["/usr/bin/python3", "-m", "dbusmock", "--system", "--template", "polkitd"],
                         env=bus.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        bus.wait_for_name(names.POLKIT_NAME, timeout=20, proc=p)

        def allow(*actions):
            arg = "[" + ", ".join(f"'{a}'" for a in actions) + "]"
            r = subprocess.run(["gdbus", "call", "--address", bus.address, "--dest", names.POLKIT_NAME,
                                "--object-path", names.POLKIT_PATH, "--method",
                                "org.freedesktop.DBus.Mock.SetAllowed", "@as " + arg],
                               capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
        yield allow
    finally:
        stop_process(p)
        log.close()


def test_polkit_grants_and_denials_are_obeyed(daemon, bus, polkit):
    daemon.wait_idle()
    polkit()   # nothing allowed
    r = gdbus_call(bus, "Refresh", "{}", user="nobody")
    assert dbus_error(r) == names.ERROR_NOT_AUTHORIZED and "is denied" in r.stderr, r.stderr
    polkit(names.ACTION_REFRESH)
    r = gdbus_call(bus, "Refresh", "{}", user="nobody")
    assert r.returncode == 0, r.stderr
    jid = job_id(r)
    daemon.wait(lambda: daemon.prop("JobState") != "running", "the refresh job")
    job = json.loads(json.loads(busctl("call", names.BUS_NAME, names.OBJECT_PATH, names.INTERFACE, "GetJob",
                                       "u", str(jid), "--json=short", bus=bus).stdout)["data"][0])
    assert job["uid"] == 65534 and job["state"] == "succeeded"
    # Granting refresh grants nothing else.
    for method in ("Build", "Install", "Rollback"):
        r = gdbus_call(bus, method, *MUTATING[method], user="nobody")
        assert dbus_error(r) == names.ERROR_NOT_AUTHORIZED and names.ACTION_PREFIX + method.lower() in r.stderr


# --- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("method,args,error", [
    ("Build", ["{'colour': <'red'>}"], names.ERROR_INVALID_ARGUMENT),
    ("Build", ["{'kernel': <'../../etc'>}"], names.ERROR_INVALID_ARGUMENT),
    ("Build", ["{'kernel': <42>}"], names.ERROR_INVALID_ARGUMENT),
    ("Build", ["{'driver_version': <'latest'>}"], names.ERROR_INVALID_ARGUMENT),
    ("Install", ["{'kernel': <'6.1.0-57-amd64'>, 'all_kernels': <true>}"], names.ERROR_INVALID_ARGUMENT),
    ("Remove", ["{'all_kernels': <'yes'>}"], names.ERROR_INVALID_ARGUMENT),
    ("Rollback", ["{'reason': <''>}"], names.ERROR_INVALID_ARGUMENT),
    ("RequestEnrollment", ["''", "{}"], names.ERROR_INVALID_ARGUMENT),
    ("RequestEnrollment", ["'pw'", "{'cert': <'relative.der'>}"], names.ERROR_INVALID_ARGUMENT),
    ("Refresh", ["{'now': <true>}"], names.ERROR_INVALID_ARGUMENT),
    ("GetJob", ["999999"], names.ERROR_NOT_FOUND),
    ("NoSuchMethod", [], "org.freedesktop.DBus.Error.UnknownMethod"),
])
def test_malformed_arguments_get_named_errors_and_the_daemon_stays_up(daemon, bus, method, args, error):
    r = gdbus_call(bus, method, *args)
    assert dbus_error(r) == error, r.stderr
    assert "Traceback" not in r.stderr
    assert daemon.proc.poll() is None
    assert gdbus_call(bus, "Ping", iface=names.PEER_IFACE).returncode == 0


def test_wrong_signature_is_refused_by_the_bus_layer(daemon, bus):
    # dbus-send sends what it is told (gdbus would refuse to build the message); GDBus checks the signature
    # against our introspection data before any of our code runs.
    for method, arg in (("Build", "string:not-a-dict"), ("RequestEnrollment", "string:only-a-password"),
                        ("GetJob", "string:seven")):
        r = subprocess.run(["dbus-send", "--system", "--print-reply", f"--dest={names.BUS_NAME}",
                            names.OBJECT_PATH, f"{names.INTERFACE}.{method}", arg],
                           capture_output=True, text=True, timeout=30, env=bus.env())
        assert r.returncode != 0
        assert r.stderr.startswith("Error org.freedesktop.DBus.Error.InvalidArgs"), r.stderr
    assert daemon.proc.poll() is None


def test_no_traceback_reached_the_log_for_expected_errors(daemon, bus):
    assert dbus_error(gdbus_call(bus, "Build", "{'kernel': <'a b'>}")) == names.ERROR_INVALID_ARGUMENT
    time.sleep(0.2)
    text = daemon.text()
    assert "Traceback" not in text, text[-3000:]
    assert "InvalidArgument" in text   # logged as one line each


# --- a long job: progress, Busy, completion ------------------------------------------------------

@pytest.fixture
def slow_daemon(bus, daemon, spark, tmp_path):
    """A second daemon whose modinfo can be made to take 3 s per call (while ``d.slow`` exists), standing in
    for a node with many kernels and a slow disk: a status refresh then lasts ~6 s, long enough to overlap
    a second request even on a loaded machine. (The module daemon is stopped for the duration and restarted
    afterwards.) Root runs the system's tools first whatever PATH says (host/runner.py), so the wrapper is
    put in /usr/local/sbin, the first system directory, on a tmpfs in the daemon's own mount namespace."""
    daemon.stop()
    real = shutil.which("modinfo") or "/sbin/modinfo"
    wrap = tmp_path / "modinfo"
    slow = tmp_path / "slow"
    wrap.write_text(f"#!/bin/sh\n[ -e {slow} ] && sleep 3\nexec {real} \"$@\"\n")
    os.chmod(wrap, 0o755)
    ns = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
          'mount -t tmpfs -o mode=0755 spark-test /usr/local/sbin && cp "$0" /usr/local/sbin/modinfo && exec "$@"',
          str(wrap))
    d = Daemon(bus, spark, tmp_path / "slow.log", prefix=ns)
    d.slow = slow
    slow.touch()
    yield d
    d.stop()
    daemon.__init__(bus, spark, daemon.log)   # the module's daemon again, for the tests that follow


def test_long_job_reports_progress_refuses_a_second_one_and_finishes(slow_daemon, bus, tmp_path):
    mon = Monitor(bus, tmp_path)
    try:
        r1 = gdbus_call(bus, "Refresh", "{}")
        jid = job_id(r1)
        r2 = gdbus_call(bus, "Refresh", "{}")
        assert dbus_error(r2) == names.ERROR_BUSY, r2.stderr
        assert f"job {jid} 'refresh'" in r2.stderr
        assert slow_daemon.prop("JobState") == "running"
        out = mon.wait_for(rf"JobFinished \(uint32 {jid}, 'refresh', true, '', 'done'", timeout=60)
        fractions = [float(x) for x in re.findall(rf"JobProgress \(uint32 {jid}, ([0-9.]+),", out)]
        assert fractions == sorted(fractions) and fractions[-1] >= 0.9 and len(fractions) >= 2, out
        assert re.search(r"'JobState': <'running'>", out) and re.search(r"'JobState': <'succeeded'>", out)
        slow_daemon.slow.unlink()
        # The CLI's call_job waits for JobFinished and relays progress.
        code = ("import json,sys; from spark_memsaver.cli import client; seen=[]; "
                "job=client.call_job('Refresh', progress=lambda f,m: seen.append((f,m))); "
                "print(json.dumps({'job': job, 'seen': seen}))")
        c = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=60,
                           env=bus.env(PYTHONPATH=str(REPO / "daemon")))
        assert c.returncode == 0, c.stderr
        res = json.loads(c.stdout)
        assert res["job"]["state"] == "succeeded" and res["job"]["operation"] == "refresh"
        assert [0.05, "reading the host"] in res["seen"]
    finally:
        mon.stop()


def test_sigterm_lets_a_running_job_finish_then_exits(slow_daemon, bus, tmp_path):
    mon = Monitor(bus, tmp_path)
    try:
        jid = job_id(gdbus_call(bus, "Refresh", "{}"))
        os.kill(slow_daemon.proc.pid, signal.SIGTERM)
        slow_daemon.wait(lambda: "waiting up to" in slow_daemon.text(), "the stop notice")
        r = gdbus_call(bus, "Refresh", "{}")
        assert dbus_error(r) == names.ERROR_BUSY and "stopping" in r.stderr, r.stderr
        assert slow_daemon.proc.wait(60) == 0
        assert re.search(rf"JobFinished \(uint32 {jid}, 'refresh', true", mon.text()), mon.text()
    finally:
        mon.stop()


def test_client_without_a_daemon_says_so(tmp_path, monkeypatch):
    from spark_memsaver.cli import client
    from spark_memsaver.errors import UsageError

    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/no-bus-here")
    assert client.get_status() is None
    assert client.daemon_running() is False
    with pytest.raises(client.DaemonNotRunning):
        client.call_job("Refresh")
    assert client.maybe_call_job("Refresh") is None
    with pytest.raises(UsageError):
        client.call_job("Reboot")


# --- signals, config, events ---------------------------------------------------------------------

def test_sighup_reloads_config_bad_config_is_reported_and_sigterm_exits(bus, daemon, spark, tmp_path):
    daemon.stop()
    cfg = tmp_path / "config.yaml"
    cfg.write_text("interval: 30\nprometheus_textfile: /var/lib/node_exporter/spark_memsaver.prom\n")
    (spark / "var/lib/node_exporter").mkdir(parents=True, exist_ok=True)
    d = Daemon(bus, spark, tmp_path / "hup.log", "--config", str(cfg))
    try:
        assert d.prop("Interval") == 30
        prom = (spark / "var/lib/node_exporter/spark_memsaver.prom")
        d.wait(prom.exists, "the Prometheus textfile")
        text = prom.read_text()
        assert f"spark_memsaver_pagetable_backing_bytes {d.prop('BackingBytes')}" in text
        # schema of the series: monitoring/README.md (packing_active carries driver/kernel/tier labels since #15)
        assert re.search(r'^spark_memsaver_packing_active\{driver="[^"]*",kernel="[^"]*",tier="[^"]*"\} 1$', text, re.M)
        assert stat.S_IMODE(prom.stat().st_mode) == 0o644
        assert not [p for p in prom.parent.iterdir() if p.name.endswith(".tmp")]
        cfg.write_text("interval: 120\n")
        os.kill(d.proc.pid, signal.SIGHUP)
        d.wait(lambda: d.prop("Interval") == 120, "Interval 120 after SIGHUP")
        cfg.write_text("interval: [not, a, number]\n")
        os.kill(d.proc.pid, signal.SIGHUP)
        d.wait(lambda: d.prop("LastErrorName") == names.ERROR_PREFIX + "ConfigError", "the config error")
        assert "interval" in d.prop("LastError")
        assert d.prop("Interval") == 120          # the previous config stays in force
        assert d.proc.poll() is None
        cfg.write_text("interval: 90\n")
        os.kill(d.proc.pid, signal.SIGHUP)
        d.wait(lambda: d.prop("Interval") == 90 and d.prop("LastErrorName") == "", "the repaired config")
        # An edit without SIGHUP is picked up before the next operation (here: Refresh) acts.
        cfg.write_text("interval: 45\n")
        jid = job_id(gdbus_call(bus, "Refresh", "{}"))
        d.wait(lambda: d.prop("Interval") == 45, f"Interval 45 after an edit and Refresh job {jid}")
    finally:
        rc = d.stop()
        daemon.__init__(bus, spark, daemon.log)
    assert rc == 0
    assert "INFO spark_memsaver.service.daemon: stopped" in d.text()


def test_second_instance_refuses_to_start(daemon, bus, spark, tmp_path):
    p = start_daemon(bus, "--no-reconcile", "--root", str(spark), log_path=tmp_path / "second.log")
    assert p.wait(30) == 1
    assert f"cannot own {names.BUS_NAME}" in (tmp_path / "second.log").read_text()
    assert daemon.proc.poll() is None


def test_new_driver_source_is_noticed_by_inotify_and_settled(daemon, bus, spark):
    # Stands in for 'apt install nvidia-kernel-source-590-open': a new tree appears under /usr/src.
    new, other = spark / "usr/src/nvidia-590.44", spark / "usr/src/spark-memsaver-uvm-0.1"
    try:
        other.mkdir()
        new.mkdir()
        (new / "nvidia-uvm").mkdir()
        (new / "Kbuild").write_text("# NVIDIA Kbuild\n")
        t0 = time.monotonic()
        daemon.wait(lambda: "590.44" in [s["version"] for s in json.loads(_get_status(bus))["driver"]["sources"]],
                    "the new driver source in GetStatus", timeout=30)
        assert time.monotonic() - t0 < daemon.prop("Interval")   # an event, not the sampling timer
        assert "spark-memsaver-uvm-0.1 (ignored)" in daemon.text()
        assert re.search(r"driver sources / kernels changed: .*nvidia-590\.44", daemon.text())
    finally:
        shutil.rmtree(new, ignore_errors=True)
        shutil.rmtree(other, ignore_errors=True)


def _uevent_sockets(pid: int) -> list[str]:
    """Groups of the NETLINK_KOBJECT_UEVENT (protocol 15) sockets process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            t = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if t.startswith("socket:["):
            inodes.add(t[8:-1])
    out = []
    for line in Path("/proc/net/netlink").read_text().splitlines()[1:]:
        f = line.split()
        if f[1] == "15" and f[9] in inodes:
            out.append(f[3])
    return out


def test_module_uevents_come_from_kernel_netlink_and_other_subsystems_are_filtered(daemon):
    # The daemon listens to the kernel's uevent multicast group 1 (no udevd needed).
    groups = _uevent_sockets(daemon.proc.pid)
    assert groups and any(int(g, 16) & 1 for g in groups), groups
    # A real uevent from another subsystem is filtered before it reaches Python. (A *module* uevent cannot be
    # produced on this machine: modules cannot be loaded and built-in ones have no uevent attribute.)
    lo = Path("/sys/devices/virtual/net/lo/uevent")
    try:
        lo.write_text("change")
    except OSError as e:
        needs.not_applicable(f"cannot write {lo}: {e.strerror} (read-only sysfs: a container)")
    time.sleep(0.5)
    assert "uevent: change" not in daemon.text()
    assert daemon.proc.poll() is None


# --- the pieces, in-process ----------------------------------------------------------------------

def test_module_event_handler_reacts_to_nvidia_modules_only(spark):
    from spark_memsaver.config import Config
    from spark_memsaver.host import Host
    from spark_memsaver.service.monitor import Monitor as M

    class FakeDevice:   # stands in for pyudev Devices of a loaded nvidia.ko (cannot exist here)
        def __init__(self, name, action):
            self.sys_name, self.action = name, action

    class Queue:
        def __init__(self, devices):
            self.devices = list(devices)

        def poll(self, timeout=0):
            return self.devices.pop(0) if self.devices else None

    seen = []
    m = M(Host(str(spark)), Config(), on_sample=lambda s: None, on_module_event=lambda a, n: seen.append((a, n)),
          on_paths_changed=lambda p: None)
    m._udev = Queue([FakeDevice("nvidia_uvm", "add"), FakeDevice("loop", "change"), FakeDevice("nvidia", "remove"),
                     FakeDevice("nvidia_uvm", "change")])
    assert m._on_udev_ready(None, None) is True
    assert seen == [("add", "nvidia_uvm"), ("remove", "nvidia")]
    assert m.events_seen == 4
    s = m.sample("test")
    assert s["packing_active"] and s["backing_bytes"] > 0
    assert m.samples()[-1] == {k: v for k, v in s.items() if k != "_uvm"}
    for _ in range(Config().history_size + 5):   # the ring is bounded
        m.sample("interval")
    assert len(m.samples()) == Config().history_size and m.samples()[0]["reason"] == "interval"


def test_every_method_is_authorized_unless_marked_public():
    from spark_memsaver.service import dbus_service as ds

    cls = ds.make_manager_class()
    public = {"GetStatus", "GetHistory", "GetHistorySince", "GetEvents", "GetMemory", "GetJob"}
    assert set(ds.METHODS) == public | set(MUTATING)

    class Probe:   # a method nobody marked gets the catch-all action
        def Unmarked(self, *, caller):
            return caller

    wrapped = ds.secure_by_default(Probe, ["Unmarked"])
    asked = []
    orig = ds.authorize
    # authorization is asynchronous: authorize(con, sender, action, done) answers through done(caller, error)
    ds.authorize = lambda con, sender, action, done: asked.append(action) or done(ds.Caller(sender, 0), None)
    replies = []

    class Invocation:   # what Gio hands the adaptor for one call
        def get_sender(self):
            return ":1.1"

        def get_connection(self):
            return None

        def return_value(self, v):
            replies.append(v)

        def return_dbus_error(self, name, text):
            replies.append((name, text))
    try:
        wrapped().Unmarked(Invocation())
    finally:
        ds.authorize = orig
    assert asked == [names.ACTION_MANAGE]
    assert cls.GetStatus.__name__ == "GetStatus"


def test_names_and_shipped_files_agree():
    import xml.dom.minidom

    assert names.BUS_NAME.endswith("1") and names.INTERFACE.endswith("1") and names.OBJECT_PATH != "/"
    assert (REPO / "systemd/BUSNAME").read_text().strip() == names.BUS_NAME
    pol = xml.dom.minidom.parse(str(REPO / "systemd" / names.POLKIT_POLICY_FILE))
    ids = {a.getAttribute("id") for a in pol.getElementsByTagName("action")}
    assert ids == set(names.ACTIONS)
    for a in pol.getElementsByTagName("action"):
        if a.getAttribute("id") != names.ACTION_REFRESH:
            any_ = a.getElementsByTagName("allow_any")[0].firstChild.data
            assert any_ == "auth_admin", a.getAttribute("id")
    conf = xml.dom.minidom.parse(str(REPO / "systemd" / names.DBUS_POLICY_FILE))
    owners = [p for p in conf.getElementsByTagName("policy") if p.getElementsByTagName("allow")[0].getAttribute("own")]
    assert [p.getAttribute("user") for p in owners] == ["root"]
    sends = {e.getAttribute("send_interface") for e in conf.getElementsByTagName("allow") if e.hasAttribute("send_interface")}
    assert sends == {names.INTERFACE, names.PROPERTIES_IFACE, names.INTROSPECTABLE_IFACE, names.PEER_IFACE}
    assert all(e.getAttribute("send_destination") == names.BUS_NAME
               for e in conf.getElementsByTagName("allow") if e.hasAttribute("send_interface"))
    from spark_memsaver.errors import Busy, ConfigError, NotPermitted
    assert names.error_name(NotPermitted("x")) == names.ERROR_NOT_AUTHORIZED
    assert names.error_name(Busy("x")) == names.ERROR_BUSY
    assert names.error_name(ConfigError("x")) == names.ERROR_PREFIX + "ConfigError"


def test_unsupported_when_an_operation_module_is_absent(monkeypatch):
    """Operations are plain imports done in the worker (no importlib registry): an absent engine module fails
    the job with Unsupported (named); a present one is called as executor.perform(op, host, config,
    progress=..., **options)."""
    import types

    import spark_memsaver.act as act_pkg
    from spark_memsaver.service import operations as ops
    from spark_memsaver.errors import Unsupported

    monkeypatch.delattr(act_pkg, "executor", raising=False)
    monkeypatch.setitem(sys.modules, "spark_memsaver.act.executor", None)
    for op in ops.MUTATIONS:
        with pytest.raises(Unsupported):
            ops.run(op, None, None, None)
    with pytest.raises(Unsupported):
        ops.run("no-such-op", None, None, None)
    calls = []

    def perform(op, host, config, *, progress=None, **args):
        calls.append((op, host, config, progress, args))
        return {"ok": True}

    fake = types.ModuleType("spark_memsaver.act.executor")
    fake.perform = perform
    monkeypatch.setitem(sys.modules, "spark_memsaver.act.executor", fake)
    monkeypatch.setattr(act_pkg, "executor", fake, raising=False)
    assert ops.run("build", "H", "C", "P", kernel="k") == {"ok": True}
    assert calls == [("build", "H", "C", "P", {"kernel": "k"})]

    def no_progress(host, config, password, wait_at_console=False):   # enroll.request_enrollment's shape
        return password == "pw"
    enroll = types.ModuleType("spark_memsaver.act.enroll")
    enroll.request_enrollment = no_progress
    monkeypatch.setitem(sys.modules, "spark_memsaver.act.enroll", enroll)
    monkeypatch.setattr(act_pkg, "enroll", enroll, raising=False)
    assert ops.run("request-enrollment", "H", "C", "P", password="pw") is True


def test_unprivileged_cli_mutations_go_through_the_daemon(daemon, bus, tmp_path):
    """A non-root `spark-memsaver install/remove/rollback/activate` asks spark-memsaverd (where polkit decides)
    instead of failing locally; without a daemon it refuses locally, naming root."""
    env = bus.env(PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    for argv in (["install", "--json"], ["remove", "--all", "--json"], ["rollback", "--json"],
                 ["activate", "--json"]):
        r = subprocess.run(NOBODY + ["/usr/bin/python3", "-m", "spark_memsaver", *argv], capture_output=True,
                           text=True, env=env, timeout=60, cwd="/")
        assert r.returncode == 1, (argv, r.stdout, r.stderr)
        err = json.loads(r.stdout)["error"]
        assert err["name"] == "NotPermitted" and "polkit" in err["message"], (argv, err)
        assert "Traceback" not in r.stderr
    env["DBUS_SYSTEM_BUS_ADDRESS"] = f"unix:path={tmp_path}/no-bus-here"
    r = subprocess.run(NOBODY + ["/usr/bin/python3", "-m", "spark_memsaver", "install", "--json"],
                       capture_output=True, text=True, env=env, timeout=60, cwd="/")
    err = json.loads(r.stdout)["error"]
    assert r.returncode == 1 and err["name"] == "NotPermitted" and "polkit" not in err["message"], err
    assert daemon.proc.poll() is None
