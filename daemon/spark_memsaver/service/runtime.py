"""The daemon as a process: arguments, logging, memory settings, the bus connection and name, the loop.

Kept small on purpose (the daemon exists to save memory): no argparse, no ctypes, no pydbus, no pyudev.
"""

from __future__ import annotations

import logging
import os
import sys

from spark_memsaver import __version__
from spark_memsaver.service import names

log = logging.getLogger("spark_memsaver.service.daemon")

USAGE = f"""usage: spark-memsaverd [--debug] [--root DIR] [--config FILE] [--no-reconcile] [--version]

spark-memsaver daemon: owns {names.BUS_NAME} on the system bus.

  --debug          log debug messages (every command, every uevent)
  --root DIR       inspect the system under this root prefix (tests, images)
  --config FILE    config file [default: /etc/spark-memsaver/config.yaml]
  --no-reconcile   do not run reconcile at start or on driver/kernel changes (observe only)
  --version        print the version and exit
"""


class Args:
    debug = False
    root = "/"
    config = None
    no_reconcile = False


def parse_args(argv: list[str]) -> Args:
    a, argv = Args(), list(argv)
    while argv:
        opt = argv.pop(0)
        opt, eq, val = opt.partition("=") if opt.startswith("--") else (opt, "", "")
        if opt in ("--root", "--config"):
            if not eq:
                if not argv:
                    _usage_error(f"{opt} needs a value")
                val = argv.pop(0)
            setattr(a, opt[2:], val)
        elif opt == "--debug" and not eq:
            a.debug = True
        elif opt == "--no-reconcile" and not eq:
            a.no_reconcile = True
        elif opt == "--version":
            print(f"spark-memsaverd {__version__}")
            sys.exit(0)
        elif opt in ("-h", "--help"):
            print(USAGE, end="")
            sys.exit(0)
        else:
            _usage_error(f"unrecognized argument: {opt}")
    return a


def _usage_error(msg: str):
    sys.stderr.write(USAGE + f"spark-memsaverd: error: {msg}\n")
    sys.exit(2)


def low_memory(argv: list[str]) -> None:
    """One malloc arena per process instead of one per thread (the job, status and GDBus threads would each
    get a 64 MiB arena whose touched pages stay resident). glibc reads MALLOC_ARENA_MAX at start only, so
    the process re-executes itself once with it set (the unit sets it and skips this). No OpenSSL: hashlib
    falls back to Python's built-in digests (nothing in the daemon needs an OpenSSL-only one)."""
    if os.environ.get("MALLOC_ARENA_MAX") is None and os.environ.get("SPARK_MEMSAVERD_NO_REEXEC") is None:
        os.environ["MALLOC_ARENA_MAX"] = "1"
        try:
            os.execv(sys.executable, [sys.executable, "-m", "spark_memsaver.service.runtime", *argv])
        except OSError:
            pass   # run on with the default arenas
    sys.modules.setdefault("_hashlib", None)


class _JournalFormatter(logging.Formatter):
    """``<N>`` syslog priority prefixes, which the journal reads from a service's stderr."""

    LEVELS = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def format(self, record):
        return f"<{self.LEVELS.get(record.levelno, 6)}>{super().format(record)}"


def setup_logging(debug: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(_JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)


def request_name(con) -> None:
    """Own BUS_NAME, refusing replacement and queueing (a second daemon fails instead of waiting)."""
    from gi.repository import Gio, GLib

    DO_NOT_QUEUE = 4
    reply = con.call_sync("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "RequestName",
                          GLib.Variant("(su)", (names.BUS_NAME, DO_NOT_QUEUE)), GLib.VariantType.new("(u)"),
                          Gio.DBusCallFlags.NONE, 10000, None).unpack()[0]
    if reply != 1:   # 1 = primary owner; 3 = exists; 4 = already ours
        raise RuntimeError({3: "the name is already owned by another process",
                            4: "this connection already owns it"}.get(reply, f"RequestName answered {reply}"))


def monitor_class():
    """service/monitor.py's Monitor, with module uevents read from a plain netlink socket (service/uevents.py)
    instead of pyudev, which would keep libudev and ctypes in the resident daemon."""
    from spark_memsaver.service.monitor import Monitor

    class DaemonMonitor(Monitor):
        def _start_udev(self) -> None:
            from gi.repository import GLib
            from spark_memsaver.service.uevents import KernelUevents

            try:
                mon = KernelUevents("module")
            except OSError as e:   # no netlink (sandbox): run on, say so once
                log.warning("module events unavailable (%s); module loads are seen at the next sample",
                            e.strerror or e)
                return
            self._udev = mon
            self._udev_watch = GLib.io_add_watch(mon.fileno(), GLib.PRIORITY_DEFAULT, GLib.IO_IN,
                                                 self._on_udev_ready)
            log.debug("listening for module uevents on kernel netlink")

    return DaemonMonitor


def serve(daemon) -> int:
    """Connect, publish, own the name, run the loop until a stop."""
    import signal
    from gi.repository import Gio, GLib

    from spark_memsaver.service import dbus_service

    try:
        con = Gio.bus_get_sync(Gio.BusType.SYSTEM, None)
    except GLib.Error as e:
        log.error("cannot connect to the system bus: %s", e.message)
        return 1
    daemon.loop = GLib.MainLoop()
    daemon.service = dbus_service.Publication(con, daemon)
    try:
        request_name(con)
    except (RuntimeError, GLib.Error) as e:
        log.error("cannot own %s on the system bus: %s", names.BUS_NAME, getattr(e, "message", e))
        daemon.service.unregister()
        return 1
    log.info("spark-memsaverd %s owns %s (object %s)", __version__, names.BUS_NAME, names.OBJECT_PATH)
    for sig in (signal.SIGTERM, signal.SIGINT):
        GLib.unix_signal_add(GLib.PRIORITY_HIGH, sig, daemon.stop)
    GLib.unix_signal_add(GLib.PRIORITY_HIGH, signal.SIGHUP, daemon.reload)
    from spark_memsaver.host import staging
    staging.sweep(daemon.host, lock=True)   # a fetch killed with the previous daemon left its staging directory
    GLib.idle_add(lambda: daemon.refresh_status("start") and False)
    try:
        daemon.loop.run()
    finally:
        if daemon.monitor is not None:
            daemon.monitor.stop()
        daemon.service.unregister()
        try:
            con.flush_sync(None)   # the last JobFinished/PropertiesChanged leave before the process does
        except GLib.Error:
            pass
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    low_memory(argv)
    setup_logging(args.debug)
    from spark_memsaver.service.daemon import Daemon

    d = Daemon(root=args.root, config_path=args.config, reconcile=not args.no_reconcile,
               monitor_factory=monitor_class())
    sys.exit(serve(d))


if __name__ == "__main__":
    main()
