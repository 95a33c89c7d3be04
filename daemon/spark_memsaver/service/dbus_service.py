"""The D-Bus adaptor: the interface XML, the authorization markers, the Gio publication and the error
mapping. No logic: everything the methods do is in ``daemon.Daemon`` (the core; GetEvents: host/events.py, the
log's reader), argument checks are in ``checks``, who may call what in ``auth``.

Published with Gio directly (no pydbus): a method's reply is sent when its authorization, which is
asynchronous, has answered (issue 12 defect 6), and the idle daemon does not carry pydbus.

Secure by default (firewalld): ``secure_by_default`` wraps every method of the interface. A method marked
``@public`` is open to everyone (reads; the caller's uid is still looked up, since what a read shows
depends on it); a method marked ``@requires(action)`` needs uid 0 or that polkit action; any other method
gets ``names.ACTION_MANAGE``. Forgetting a marker therefore locks a method down, it never opens one.
"""

from __future__ import annotations

import logging
import re

from spark_memsaver.errors import MemsaverError
from spark_memsaver.service import auth, checks, limits, names
from spark_memsaver.service.auth import Caller, NotAuthorized, TooManyAuthorizations  # noqa: F401
from spark_memsaver.service.limits import RateLimited  # noqa: F401
from spark_memsaver.service.checks import InvalidArgument, check_options, check_password  # noqa: F401

log = logging.getLogger("spark_memsaver.dbus")

_EMITS = '<annotation name="org.freedesktop.DBus.Property.EmitsChangedSignal" value="{}"/>'


def _prop(name: str, sig: str, emits: str = "true") -> str:
    return f'<property name="{name}" type="{sig}" access="read">{_EMITS.format(emits)}</property>'


# name -> D-Bus type; the order is the order of GetAll.
PROPERTIES = {
    "Version": "s", "State": "s", "Findings": "a(ssss)", "KernelRelease": "s", "DriverVersion": "s",
    "UvmPatched": "b", "PackingActive": "b", "BackingBytes": "t", "SavedBytes": "t", "SecureBootState": "s",
    "LastError": "s", "LastErrorName": "s", "Interval": "u", "HeldBy": "s", "HeldSince": "s",
    "JobId": "u", "JobOperation": "s", "JobState": "s", "JobFraction": "d", "JobMessage": "s",
}

INTROSPECTION = f"""<node>
  <!-- spark-memsaverd: nvidia-uvm page-table packing on 64 KiB kernels. See docs/dbus-api.md. -->
  <interface name="{names.INTERFACE}">
    {_prop("Version", "s", "const")}
    {"".join(_prop(n, s) for n, s in PROPERTIES.items() if n != "Version")}
    <method name="GetStatus"><arg name="status_json" type="s" direction="out"/></method>
    <method name="GetHistory"><arg name="samples_json" type="s" direction="out"/></method>
    <method name="GetHistorySince"><arg name="since" type="d" direction="in"/><arg name="limit" type="u" direction="in"/><arg name="samples_json" type="s" direction="out"/></method>
    <method name="GetEvents"><arg name="since" type="d" direction="in"/><arg name="limit" type="u" direction="in"/><arg name="events_json" type="s" direction="out"/></method>
    <method name="GetMemory"><arg name="memory_json" type="s" direction="out"/></method>
    <method name="GetJob"><arg name="job_id" type="u" direction="in"/><arg name="job_json" type="s" direction="out"/></method>
    <method name="Build"><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <method name="Install"><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <method name="Remove"><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <method name="Activate"><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <method name="Rollback"><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <method name="RequestEnrollment"><arg name="password" type="s" direction="in"/><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <method name="Refresh"><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <method name="PrepareLaunch"><arg name="need_bytes" type="t" direction="in"/><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <signal name="JobProgress"><arg name="job_id" type="u"/><arg name="progress" type="d"/><arg name="message" type="s"/></signal>
    <signal name="JobFinished"><arg name="job_id" type="u"/><arg name="operation" type="s"/><arg name="success" type="b"/><arg name="error_name" type="s"/><arg name="message" type="s"/><arg name="result_json" type="s"/></signal>
  </interface>
</node>"""

METHODS = re.findall(r'<method name="(\w+)"', INTROSPECTION)
OUT_SIG = {m: "".join(re.findall(r'type="([^"]+)" direction="out"', body))
           for m, body in re.findall(r'<method name="(\w+)">(.*?)</method>', INTROSPECTION)}
SIGNALS = {n: "(" + "".join(re.findall(r'type="([^"]+)"', body)) + ")"
           for n, body in re.findall(r'<signal name="(\w+)">(.*?)</signal>', INTROSPECTION)}


class NotFound(MemsaverError):
    code = "not-found"


# --- authorization markers -------------------------------------------------------------------------
_MARK = "_spark_memsaver_action"
_PUBLIC = object()
AUTHORIZER: auth.Authorizer | None = None
READS = limits.ReadLimiter()
TARPIT = limits.Tarpit()
EVENTS_INDEX = None       # host/events.Index of the daemon's log, made on the first GetEvents
HISTORY_DEFAULT = 1440    # samples in a GetHistory reply (24 h at the default interval), newest first kept
HISTORY_MAX = 10000       # at most this many in a GetHistorySince reply (~3 MB of JSON)
EVENTS_DEFAULT = 100      # lifecycle events in a GetEvents reply with limit 0, newest kept
EVENTS_MAX = 5000         # at most this many (the log keeps ~1 MiB: about that many)


def public(fn):
    """Everyone may call this method (it changes nothing)."""
    setattr(fn, _MARK, _PUBLIC)
    return fn


def requires(action: str):
    """uid 0, or a non-interactive polkit grant of ``action``."""
    assert action in names.ACTIONS, action

    def mark(fn):
        setattr(fn, _MARK, action)
        return fn
    return mark


def authorize(con, sender: str, action: str | None, done) -> None:
    """Asynchronous: ``done(caller, None)`` or ``done(None, error)`` later (``action`` None: identify only)."""
    global AUTHORIZER
    if AUTHORIZER is None:
        AUTHORIZER = auth.Authorizer()
    AUTHORIZER.check(con, sender, action, done)


def secure_by_default(cls, methods=None):
    """Wrap every interface method: authorization first, then the call, then the reply or a named error."""
    for name in METHODS if methods is None else methods:
        impl = getattr(cls, name)
        action = getattr(impl, _MARK, names.ACTION_MANAGE)
        setattr(cls, name, _wrap(name, impl, action, OUT_SIG.get(name, "")))
    return cls


def _wrap(name, impl, action, out_sig):
    def method(self, invocation, *args):
        def done(caller, err):
            if err is not None:
                reply_error(invocation, name, err, logged=not isinstance(err, (NotAuthorized, TooManyAuthorizations)))
                return
            if action is _PUBLIC and not admitted(name, caller, invocation):
                return
            try:
                result = impl(self, *args, caller=caller)
            except Exception as e:
                reply_error(invocation, name, e)
                return
            if action is _PUBLIC:
                READS.charge(caller.uid, limits.reply_cost(result))
            reply(invocation, out_sig, result)
        authorize(invocation.get_connection(), invocation.get_sender(), None if action is _PUBLIC else action, done)
    method.__name__ = name
    method.__doc__ = impl.__doc__
    return method


def admitted(name: str, caller, invocation) -> bool:
    """An open read within its uid's and the shared allowance (limits.ReadLimiter); else it is refused with
    RateLimited, answered late (limits.Tarpit), and False."""
    if READS.allow(caller.uid):
        return True
    if AUTHORIZER is not None:
        AUTHORIZER._denied(caller.sender, caller.uid, f"{name} (rate limited)")
    err = RateLimited(f"{name}: {READS.why(caller.uid)} (answered {TARPIT.delay:g} s late)")
    if not TARPIT.hold(lambda: reply_error(invocation, name, err, logged=False)):
        reply_error(invocation, name, err, logged=False)
    return False


def reply(invocation, out_sig: str, result) -> None:
    from gi.repository import GLib

    invocation.return_value(GLib.Variant(f"({out_sig})", (result,)) if out_sig else None)


def reply_error(invocation, name: str, e: BaseException, logged: bool = True) -> None:
    if isinstance(e, MemsaverError):
        if logged:
            log.info("%s() -> %s: %s", name, names.error_name(e), e.message)
        text = e.message + (f"\nremedy: {e.remedy}" if e.remedy else "")
        invocation.return_dbus_error(names.error_name(e), text)
        return
    log.error("%s() failed with an internal error", name, exc_info=e)   # a bug: log it fully, stay up
    invocation.return_dbus_error(names.ERROR_FAILED, f"internal error in {name}: {type(e).__name__}: {e}")


# --- the object ------------------------------------------------------------------------------------
@secure_by_default
class Manager:
    def __init__(self, core):
        self._core = core

    # reads -----------------------------------------------------------------------------------------
    @public
    def GetStatus(self, *, caller):
        return self._core.status_json(full=caller.privileged)

    @public
    def GetHistory(self, *, caller):
        """The newest HISTORY_DEFAULT samples (the reply is bounded whatever history_size is)."""
        return self._core.history_json(limit=HISTORY_DEFAULT)

    @public
    def GetHistorySince(self, since, limit, *, caller):
        """Samples at or after ``since`` (epoch seconds; 0: all), the newest ``limit`` of them (0: the
        default, at most HISTORY_MAX)."""
        if since != since or since in (float("inf"), float("-inf")):
            raise InvalidArgument(f"GetHistorySince: since must be a finite time in seconds, not {since}")
        limit = HISTORY_DEFAULT if limit == 0 else min(int(limit), HISTORY_MAX)
        return self._core.history_json(since=since if since > 0 else None, limit=limit)

    @public
    def GetEvents(self, since, limit, *, caller):
        """The one lifecycle event log (host/events.py, what `spark-memsaver events` shows): the events at or after
        ``since`` (epoch seconds; 0: all kept), the newest ``limit`` (0: EVENTS_DEFAULT, at most EVENTS_MAX)."""
        if since != since or since in (float("inf"), float("-inf")):
            raise InvalidArgument(f"GetEvents: since must be a finite time in seconds, not {since}")
        limit = EVENTS_DEFAULT if limit == 0 else min(int(limit), EVENTS_MAX)
        global EVENTS_INDEX
        if EVENTS_INDEX is None or EVENTS_INDEX.host is not self._core.host:
            from spark_memsaver.host import events     # the log's own reader, as an index kept up to date
            EVENTS_INDEX = events.Index(self._core.host)
        return EVENTS_INDEX.as_json(since if since > 0 else None, limit)

    @public
    def GetMemory(self, *, caller):
        """Where this node's memory goes (`spark-memsaver memory --json`, without NVML's per-process figures):
        read now from /proc (service/monitor.memory_json); no pids in it, so the same for every caller."""
        from spark_memsaver.service.monitor import memory_json
        return memory_json(self._core.host)

    @public
    def GetJob(self, job_id, *, caller):
        return self._core.job_json(job_id, full=caller.privileged)

    # operations ------------------------------------------------------------------------------------
    @requires(names.ACTION_BUILD)
    def Build(self, options, *, caller):
        return self._core.start_operation("build", check_options("Build", options), caller)

    @requires(names.ACTION_INSTALL)
    def Install(self, options, *, caller):
        return self._core.start_operation("install", check_options("Install", options), caller)

    @requires(names.ACTION_REMOVE)
    def Remove(self, options, *, caller):
        return self._core.start_operation("remove", check_options("Remove", options), caller)

    @requires(names.ACTION_ACTIVATE)
    def Activate(self, options, *, caller):
        return self._core.start_operation("activate", check_options("Activate", options), caller)

    @requires(names.ACTION_ROLLBACK)
    def Rollback(self, options, *, caller):
        return self._core.start_operation("rollback", check_options("Rollback", options), caller)

    @requires(names.ACTION_REQUEST_ENROLLMENT)
    def RequestEnrollment(self, password, options, *, caller):
        kwargs = check_options("RequestEnrollment", options)
        kwargs["password"] = check_password(password)
        return self._core.start_operation("request-enrollment", kwargs, caller)

    @requires(names.ACTION_REFRESH)
    def Refresh(self, options, *, caller):
        check_options("Refresh", options)
        return self._core.start_refresh(caller)


    @requires(names.ACTION_PREPARE_LAUNCH)
    def PrepareLaunch(self, need_bytes, options, *, caller):
        """`reclaim --need` as a job (act/reclaim.py): free need_bytes for a launch, then compact if needed."""
        check_options("PrepareLaunch", options)
        if not 0 < need_bytes <= 1 << 50:
            raise InvalidArgument(f"PrepareLaunch: need_bytes must be 1 to 2**50, not {need_bytes}")
        return self._core.start_operation("prepare-launch", {"need_bytes": int(need_bytes)}, caller)


def make_manager_class():
    return Manager


class Publication:
    """``Manager`` on a connection: dispatch of method calls and property reads, and the signals."""

    def __init__(self, con, core):
        from gi.repository import Gio

        self.con, self.core, self.manager = con, core, Manager(core)
        self._info = Gio.DBusNodeInfo.new_for_xml(INTROSPECTION).interfaces[0]
        self._id = con.register_object(names.OBJECT_PATH, self._info, self._on_call, None, None)

    def unregister(self) -> None:
        if self._id:
            self.con.unregister_object(self._id)
            self._id = 0

    def _on_call(self, _con, _sender, _path, iface, method, params, invocation) -> None:
        if iface == names.PROPERTIES_IFACE:   # open reads too: the caller's uid, then its allowance
            args = params.unpack()

            def done(caller, err):
                if err is not None:
                    reply_error(invocation, method, err, logged=False)
                elif caller.uid == 0 or admitted(f"Properties.{method}", caller, invocation):
                    self._properties(method, args, invocation)
            authorize(invocation.get_connection(), invocation.get_sender(), None, done)
            return
        getattr(self.manager, method)(invocation, *params.unpack())

    def _properties(self, method, args, invocation) -> None:
        """Reads from the core's cache: never blocks, never waits on polkit (only on the bus naming the caller's
        uid, once per connection); limited like the other open reads (a flood of GetAll from one user held
        root's GetStatus at 175 ms: issue 35 item 5)."""
        from gi.repository import GLib

        props = self.core.props
        if method == "GetAll":
            values = {n: GLib.Variant(s, props[n]) for n, s in PROPERTIES.items()} if args[0] == names.INTERFACE else {}
            invocation.return_value(GLib.Variant("(a{sv})", (values,)))
        elif method == "Get" and args[1] in PROPERTIES and args[0] == names.INTERFACE:
            invocation.return_value(GLib.Variant("(v)", (GLib.Variant(PROPERTIES[args[1]], props[args[1]]),)))
        elif method == "Get":
            invocation.return_dbus_error("org.freedesktop.DBus.Error.UnknownProperty", f"no property {args[1]!r}")
        else:
            invocation.return_dbus_error("org.freedesktop.DBus.Error.PropertyReadOnly", "every property is read-only")

    # signals (main loop only) ---------------------------------------------------------------------------
    def emit(self, name: str, *args) -> None:
        from gi.repository import GLib

        self.con.emit_signal(None, names.OBJECT_PATH, names.INTERFACE, name, GLib.Variant(SIGNALS[name], args))

    def properties_changed(self, changed: dict) -> None:
        from gi.repository import GLib

        values = {k: GLib.Variant(PROPERTIES[k], v) for k, v in changed.items()}
        self.con.emit_signal(None, names.OBJECT_PATH, names.PROPERTIES_IFACE, "PropertiesChanged",
                             GLib.Variant("(sa{sv}as)", (names.INTERFACE, values, [])))
