"""A private *system-type* D-Bus for spark-memsaverd tests and benchmarks (harness brief §4).

The bus is the real dbus-daemon running Debian's stock system.conf (strict default policy: nobody owns a
name or sends a method call unless a policy file allows it), with the system.d include replaced by the
repository's own ``systemd/dbus/`` folder, so the policy file we ship is the one under test. A second,
test-only policy lets root own ``org.freedesktop.PolicyKit1`` (python-dbusmock's polkitd template) and
drive the mock; it is written next to the bus, never into the repository.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "daemon"))

from spark_memsaver.service import names  # noqa: E402

STOCK_SYSTEM_CONF = Path("/usr/share/dbus-1/system.conf")

_TEST_POLICY = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<!-- test only: root runs the polkitd mock and may drive it -->
<busconfig>
  <policy user="root">
    <allow own="org.freedesktop.PolicyKit1"/>
    <allow send_destination="org.freedesktop.PolicyKit1"/>
  </policy>
</busconfig>
"""


def bus_config(workdir: Path, policy_dirs: list[Path]) -> str:
    text = STOCK_SYSTEM_CONF.read_text()
    text = re.sub(r"<user>[^<]*</user>", "", text)
    text = text.replace("<fork/>", "").replace("<syslog/>", "")
    text = re.sub(r"<servicehelper>[^<]*</servicehelper>", "", text)
    text = text.replace("<standard_system_servicedirs/>", "")
    text = re.sub(r"<pidfile>[^<]*</pidfile>", f"<pidfile>{workdir}/pid</pidfile>", text)
    text = re.sub(r"<listen>[^<]*</listen>", f"<listen>unix:path={workdir}/system_bus_socket</listen>", text)
    includes = "".join(f"<includedir>{d}</includedir>" for d in policy_dirs)
    # Drop the stock includes (the host's installed policies are not under test) and add ours.
    text = re.sub(r"<includedir>[^<]*</includedir>", "", text)
    text = re.sub(r"<include [^>]*>[^<]*</include>", "", text)
    return text.replace("</busconfig>", includes + "</busconfig>")


class PrivateSystemBus:
    def __init__(self, workdir: Path, with_test_policy: bool = True):
        self.workdir = Path(workdir)
        self.proc: subprocess.Popen | None = None
        self.with_test_policy = with_test_policy

    @property
    def address(self) -> str:
        return f"unix:path={self.workdir}/system_bus_socket"

    def env(self, **extra) -> dict:
        e = dict(os.environ)
        e["DBUS_SYSTEM_BUS_ADDRESS"] = self.address
        e.pop("DBUS_SESSION_BUS_ADDRESS", None)
        e.update(extra)
        return e

    def start(self) -> "PrivateSystemBus":
        if not shutil.which("dbus-daemon"):
            raise RuntimeError("dbus-daemon is not installed (apt install dbus-daemon)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        # the socket directory must be reachable by the unprivileged test user
        os.chmod(self.workdir, 0o755)
        dirs = [REPO / "systemd" / "dbus"]
        if self.with_test_policy:
            t = self.workdir / "test-policy"
            t.mkdir(exist_ok=True)
            (t / "test-polkit-mock.conf").write_text(_TEST_POLICY)
            dirs.append(t)
        conf = self.workdir / "system.conf"
        conf.write_text(bus_config(self.workdir, dirs))
        self.proc = subprocess.Popen(["dbus-daemon", f"--config-file={conf}", "--nofork", "--print-address=1"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()   # printed once the socket listens
        if not line.startswith("unix:"):
            self.stop()
            raise RuntimeError("dbus-daemon did not start")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def has_owner(self, name: str) -> bool:
        r = subprocess.run(["busctl", f"--address={self.address}", "status", name],
                           capture_output=True, text=True, timeout=10)
        return r.returncode == 0

    def wait_for_name(self, name: str, timeout: float = 10.0, proc: subprocess.Popen | None = None) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode} before owning {name}")
            if self.has_owner(name):
                return time.monotonic() - t0
            time.sleep(0.02)
        raise TimeoutError(f"{name} did not appear on the bus within {timeout} s")


def start_daemon(bus: PrivateSystemBus, *args: str, log_path: Path | None = None,
                 env: dict | None = None, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """spark-memsaverd from the checkout, on ``bus``, with /usr/bin/python3 (as in production). ``prefix``:
    argv that execs the rest (e.g. ``unshare --mount ... sh -c '...; exec "$@"'``)."""
    e = bus.env(PYTHONPATH=str(REPO / "daemon"), PYTHONDONTWRITEBYTECODE="1")
    e.pop("JOURNAL_STREAM", None)
    if env:
        e.update(env)
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    return subprocess.Popen([*prefix, "/usr/bin/python3", "-m", "spark_memsaver.service.runtime", *args], env=e,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_process(p: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 10.0) -> int:
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return p.returncode


__all__ = ["PrivateSystemBus", "start_daemon", "stop_process", "names", "REPO"]
