"""Talking to spark-memsaverd from the CLI (and from other engineers' commands).

- ``get_status()``: the daemon's status document, or None when the daemon is not running/reachable (the
  caller then inspects directly and says so).
- ``daemon_running()``: whether the daemon owns its name (never starts it).
- ``call_job(method, *args, progress=cb, **options)``: start an operation through the daemon and wait for its
  JobFinished; returns the job as a dict, raises the named error the job failed with.
  Raises ``DaemonNotRunning`` when there is no daemon: callers fall back to acting directly.
- ``maybe_call_job(...)``: the same, but None when there is no daemon.

GLib is imported only when one of these is called, so ``spark-memsaver --help`` stays fast.
"""

from __future__ import annotations

import json
import logging
import os

from spark_memsaver import errors
from spark_memsaver.service import names

log = logging.getLogger("spark_memsaver.cli.client")

SYSTEM_SOCKET = "/run/dbus/system_bus_socket"
# Input signatures of the job methods (RequestEnrollment also takes the password first).
JOB_METHODS = {"Build": "(a{sv})", "Install": "(a{sv})", "Remove": "(a{sv})", "Activate": "(a{sv})",
               "Rollback": "(a{sv})", "Refresh": "(a{sv})", "RequestEnrollment": "(sa{sv})",
               "PrepareLaunch": "(ta{sv})"}


class DaemonNotRunning(errors.MemsaverError):
    code = "daemon-not-running"
    remedy = "Start it with 'sudo systemctl start spark-memsaverd.service', or see 'journalctl -u spark-memsaverd.service'."


class DaemonError(errors.MemsaverError):
    """A D-Bus error that is not one of ours (bus policy, timeouts)."""
    code = "daemon-error"


def _bus():
    """The system bus connection, or None when there is no bus to talk to."""
    if not os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") and not os.path.exists(SYSTEM_SOCKET):
        return None
    try:
        from gi.repository import Gio, GLib
    except ImportError:
        return None
    try:
        return Gio.bus_get_sync(Gio.BusType.SYSTEM, None)
    except GLib.Error as e:
        log.debug("no system bus: %s", e.message)
        return None


def _call(con, method: str, args=None, reply: str | None = None, timeout_ms: int = 10000,
          dest: str = names.BUS_NAME, path: str = names.OBJECT_PATH, iface: str = names.INTERFACE):
    from gi.repository import Gio, GLib

    r = con.call_sync(dest, path, iface, method, args, GLib.VariantType.new(reply) if reply else None,
                      Gio.DBusCallFlags.NO_AUTO_START, timeout_ms, None)
    return r.unpack() if r is not None else None


def _has_owner(con) -> bool:
    from gi.repository import GLib

    try:
        return bool(_call(con, "NameHasOwner", GLib.Variant("(s)", (names.BUS_NAME,)), "(b)", 3000,
                          "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus")[0])
    except GLib.Error as e:
        log.debug("NameHasOwner failed: %s", e.message)
        return False


def daemon_running() -> bool:
    con = _bus()
    return con is not None and _has_owner(con)


def error_from_dbus(e) -> errors.MemsaverError:
    """A GLib.Error from a call to the daemon -> the matching named error (message and remedy kept)."""
    from gi.repository import Gio

    name = Gio.DBusError.get_remote_error(e) or ""
    text = e.message or ""
    prefix = f"GDBus.Error:{name}: "
    if name and text.startswith(prefix):
        text = text[len(prefix):]
    message, _, remedy = text.partition("\nremedy: ")
    return _named(names.error_short_name(name), message, remedy or None, name)


_SHORT_TO_CLASS = {"NotAuthorized": errors.NotPermitted, "InvalidArgument": errors.UsageError,
                   "Failed": errors.CommandFailed}


def _named(short: str | None, message: str, remedy: str | None, dbus_name: str = "",
           detail: dict | None = None) -> errors.MemsaverError:
    """The error class of that name (errors.py, else a class made on the spot), with the daemon's code and
    exit code when a failed job reported them."""
    if short is None:
        return DaemonError(f"spark-memsaverd: {message} ({dbus_name or 'no error name'})", remedy=remedy)
    cls = _SHORT_TO_CLASS.get(short) or getattr(errors, short, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.MemsaverError)):
        cls = type(short, (errors.MemsaverError,), {"code": _kebab(short)})
    err = cls(message, remedy=remedy)
    detail = detail or {}
    if isinstance(detail.get("code"), str):
        err.code = detail["code"]
    if isinstance(detail.get("exit_code"), int):
        err.exit_code = detail["exit_code"]
    return err


def _kebab(name: str) -> str:
    return "".join("-" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


def get_status(timeout_ms: int = 10000) -> dict | None:
    """The daemon's status document (``"source": "daemon"``), or None to fall back to direct inspection."""
    con = _bus()
    if con is None or not _has_owner(con):
        return None
    from gi.repository import GLib

    try:
        doc = json.loads(_call(con, "GetStatus", None, "(s)", timeout_ms)[0])
    except (GLib.Error, ValueError, TypeError) as e:
        log.debug("GetStatus failed, inspecting directly: %s", e)
        return None
    return doc if isinstance(doc, dict) else None


FRESH_SLACK_S = 2   # generated_at has whole seconds; the daemon applies the document a moment after making it


def is_fresh(doc: dict, now: float | None = None) -> bool:
    """The daemon's document is fresh when it was made at most one sampling interval ago (its own
    ``config.interval``): within that the daemon has already re-made it for every event it watches (module
    load/unload, new driver sources or kernels, finished jobs, a reload). Older, the daemon refreshes it (a
    GetStatus of a stale document asks for that) and the CLI inspects directly meanwhile."""
    import time

    from spark_memsaver.timefmt import utc_epoch

    made = utc_epoch(doc.get("generated_at"))
    interval = (doc.get("config") or {}).get("interval")
    if made is None or not isinstance(interval, int) or isinstance(interval, bool):
        return False
    age = (time.time() if now is None else now) - made
    return -FRESH_SLACK_S <= age <= interval + FRESH_SLACK_S


def get_history() -> list:
    con = _bus()
    if con is None or not _has_owner(con):
        raise DaemonNotRunning("spark-memsaverd is not running, so there is no monitoring history")
    from gi.repository import GLib

    try:
        return json.loads(_call(con, "GetHistory", None, "(s)")[0])
    except GLib.Error as e:
        raise error_from_dbus(e) from None


def _variant_options(options: dict):
    from gi.repository import GLib

    out = {}
    for k, v in options.items():
        if v is None:
            continue
        if isinstance(v, bool):
            out[k] = GLib.Variant("b", v)
        elif isinstance(v, str):
            out[k] = GLib.Variant("s", v)
        elif isinstance(v, int):
            out[k] = GLib.Variant("x", v)
        else:
            raise errors.UsageError(f"option '{k}': unsupported value {v!r}")
    return out


def call_job(method: str, *args, progress=None, timeout: float | None = None, **options) -> dict:
    """Run ``method`` (Build, Install, Remove, Activate, Rollback, RequestEnrollment, Refresh) in the daemon
    and wait for it to finish. ``progress(fraction, message)`` is called as the daemon reports progress.

    Options are keyword arguments (``kernel=``, ``all_kernels=``, ...), or a dict as the last positional
    argument; RequestEnrollment takes the password as its first positional argument. Returns the finished
    job (``id``, ``operation``, ``state``, ``result``, ...); raises the job's named error if it failed,
    DaemonNotRunning when there is no daemon.
    """
    if method not in JOB_METHODS:
        raise errors.UsageError(f"unknown daemon operation {method!r} (known: {', '.join(JOB_METHODS)})")
    args = list(args)
    if args and isinstance(args[-1], dict):
        options = {**args.pop(), **options}
    if method == "RequestEnrollment":
        if len(args) != 1 or not isinstance(args[0], str):
            raise errors.UsageError("RequestEnrollment needs the one-time password as its only positional argument")
    elif method == "PrepareLaunch":
        if len(args) != 1 or not isinstance(args[0], int) or isinstance(args[0], bool):
            raise errors.UsageError("PrepareLaunch needs the bytes to free as its only positional argument")
    elif args:
        raise errors.UsageError(f"{method} takes options only")

    con = _bus()
    if con is None or not _has_owner(con):
        raise DaemonNotRunning("spark-memsaverd is not running")
    from gi.repository import Gio, GLib

    ctx = GLib.MainContext.new()
    ctx.push_thread_default()
    state: dict = {"job": None, "finished": None, "vanished": False}
    subs = []
    try:
        def on_signal(_con, _sender, _path, _iface, signal_name, params):
            p = params.unpack()
            if signal_name == "JobProgress" and p[0] == state["job"] and progress is not None:
                try:
                    progress(p[1], p[2])
                except Exception:
                    log.exception("progress callback failed")
            elif signal_name == "JobFinished":
                state.setdefault("early", {})[p[0]] = p
                if p[0] == state["job"]:
                    state["finished"] = p

        def on_owner(_con, _sender, _path, _iface, _name, params):
            name, _old, new = params.unpack()
            if name == names.BUS_NAME and not new:
                state["vanished"] = True

        subs.append(con.signal_subscribe(names.BUS_NAME, names.INTERFACE, None, names.OBJECT_PATH, None,
                                         Gio.DBusSignalFlags.NONE, on_signal))
        subs.append(con.signal_subscribe("org.freedesktop.DBus", "org.freedesktop.DBus", "NameOwnerChanged",
                                         "/org/freedesktop/DBus", names.BUS_NAME, Gio.DBusSignalFlags.NONE,
                                         on_owner))
        opts = _variant_options(options)
        variant = GLib.Variant(JOB_METHODS[method], (args[0], opts) if args else (opts,))
        try:
            job_id = _call(con, method, variant, "(u)", 30000)[0]
        except GLib.Error as e:
            raise error_from_dbus(e) from None
        state["job"] = job_id
        early = state.get("early", {}).get(job_id)
        if early:
            state["finished"] = early
        if timeout is not None:
            def on_timeout():
                state["timed_out"] = True
                return False
            src = GLib.timeout_source_new(int(timeout * 1000))
            src.set_callback(on_timeout)
            src.attach(ctx)
            state["timer"] = src
        while state["finished"] is None and not state["vanished"]:
            if state.get("timed_out"):
                raise errors.CommandTimedOut(f"job {job_id} ({method}) did not finish within {timeout:.0f} s",
                                             remedy="It keeps running in spark-memsaverd; "
                                                    "'spark-memsaver status' shows it.")
            ctx.iteration(True)
    finally:
        if state.get("timer") is not None:
            state["timer"].destroy()
        for s in subs:
            con.signal_unsubscribe(s)
        ctx.pop_thread_default()
    if state["finished"] is None:
        raise DaemonError(f"spark-memsaverd stopped while job {job_id} ({method}) ran",
                          remedy="See 'journalctl -u spark-memsaverd.service'; an interrupted operation is "
                                 "recovered by 'sudo spark-memsaver reconcile'.")
    jid, operation, success, error_name, message, payload = state["finished"]
    try:
        data = json.loads(payload) if payload else None
    except ValueError:
        data = payload
    if not success:
        d = data if isinstance(data, dict) else {}
        raise _named(names.error_short_name(error_name), d.get("message") or message, d.get("remedy") or None,
                     error_name, d)
    return {"id": jid, "operation": operation, "state": "succeeded", "message": message, "result": data}


def maybe_call_job(method: str, *args, progress=None, **options) -> dict | None:
    """call_job when spark-memsaverd runs, None when it does not (the caller then acts directly).

    For CLI commands: ``job = client.maybe_call_job("Install", kernel=k, progress=cb) if obj.root == "/" else
    None``; ``if job is None: <act directly>``. Errors of the job itself are raised as named errors."""
    try:
        return call_job(method, *args, progress=progress, **options)
    except DaemonNotRunning:
        return None


def act_unprivileged(host, method: str, progress=None, **options) -> dict | None:
    """For a mutating CLI command run by a non-root user on the live system: do it through spark-memsaverd
    (where polkit decides) and return the operation's result; None when the caller is root, inspects
    another root, or no daemon runs (the command then acts directly, or refuses with NotPermitted).
    Options that are None are not sent."""
    if not host.is_live or os.geteuid() == 0:
        return None
    job = maybe_call_job(method, progress=progress, **{k: v for k, v in options.items() if v is not None})
    if job is None:
        return None
    return job.get("result") if isinstance(job.get("result"), dict) else {"job": job}
