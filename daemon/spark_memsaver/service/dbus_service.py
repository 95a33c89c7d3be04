"""The D-Bus adaptor: the interface XML, authorization, argument checks and error mapping. No logic.

Everything the methods do is in ``daemon.Daemon`` (the core), which is testable without a bus. This module
turns D-Bus calls into core calls and named errors into ``<interface>.Error.<Name>`` replies.

Secure by default (firewalld): ``secure_by_default`` wraps every method of the interface. A method marked
``@public`` is open to everyone (reads); a method marked ``@requires(action)`` needs uid 0 or that polkit
action; any other method gets ``names.ACTION_MANAGE``. Forgetting a marker therefore locks a method down,
it never opens one.
"""

from __future__ import annotations

import logging
import re

from spark_memsaver.service import names
from spark_memsaver.errors import MemsaverError, NotPermitted, UsageError

log = logging.getLogger("spark_memsaver.dbus")

_EMITS = '<annotation name="org.freedesktop.DBus.Property.EmitsChangedSignal" value="{}"/>'


def _prop(name: str, sig: str, emits: str = "true") -> str:
    return f'<property name="{name}" type="{sig}" access="read">{_EMITS.format(emits)}</property>'


# name -> D-Bus type; the order is the order of GetAll.
PROPERTIES = {
    "Version": "s", "State": "s", "Findings": "a(ssss)", "KernelRelease": "s", "DriverVersion": "s",
    "UvmPatched": "b", "PackingActive": "b", "BackingBytes": "t", "SavedBytes": "t", "SecureBootState": "s",
    "LastError": "s", "LastErrorName": "s", "Interval": "u",
    "JobId": "u", "JobOperation": "s", "JobState": "s", "JobFraction": "d", "JobMessage": "s",
}

INTROSPECTION = f"""<node>
  <!-- spark-memsaverd: nvidia-uvm page-table packing on 64 KiB kernels. See docs/dbus-api.md. -->
  <interface name="{names.INTERFACE}">
    {_prop("Version", "s", "const")}
    {"".join(_prop(n, s) for n, s in PROPERTIES.items() if n != "Version")}
    <method name="GetStatus"><arg name="status_json" type="s" direction="out"/></method>
    <method name="GetHistory"><arg name="samples_json" type="s" direction="out"/></method>
    <method name="GetJob"><arg name="job_id" type="u" direction="in"/><arg name="job_json" type="s" direction="out"/></method>
    <method name="Build"><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <method name="Install"><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <method name="Remove"><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <method name="Activate"><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <method name="Rollback"><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <method name="RequestEnrollment"><arg name="password" type="s" direction="in"/><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <method name="Refresh"><arg name="options" type="a{{sv}}" direction="in"/><arg name="job_id" type="u" direction="out"/></method>
    <signal name="JobProgress"><arg name="job_id" type="u"/><arg name="progress" type="d"/><arg name="message" type="s"/></signal>
    <signal name="JobFinished"><arg name="job_id" type="u"/><arg name="operation" type="s"/><arg name="success" type="b"/><arg name="error_name" type="s"/><arg name="message" type="s"/><arg name="result_json" type="s"/></signal>
  </interface>
</node>"""

METHODS = re.findall(r'<method name="(\w+)"', INTROSPECTION)

# --- errors ----------------------------------------------------------------------------------------
_error_types: dict[str, type] = {}


def dbus_error(name: str, message: str) -> Exception:
    """An exception pydbus replies with as the D-Bus error ``name`` (pydbus sends the class name)."""
    t = _error_types.get(name)
    if t is None:
        t = _error_types[name] = type(name, (Exception,), {})
    return t(message)


def to_dbus_error(e: MemsaverError) -> Exception:
    text = e.message + (f"\nremedy: {e.remedy}" if e.remedy else "")
    return dbus_error(names.error_name(e), text)


class InvalidArgument(UsageError):
    code = "invalid-argument"


class NotAuthorized(NotPermitted):
    code = "not-authorized"


class NotFound(MemsaverError):
    code = "not-found"


# --- authorization ---------------------------------------------------------------------------------
_MARK = "_spark_memsaver_action"
_PUBLIC = object()


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


class Caller:
    __slots__ = ("sender", "uid")

    def __init__(self, sender: str | None, uid: int | None):
        self.sender, self.uid = sender, uid


def _call_bus(con, dest, path, iface, method, args, reply_type, timeout_ms):
    from gi.repository import Gio, GLib

    return con.call_sync(dest, path, iface, method, args, GLib.VariantType.new(reply_type),
                         Gio.DBusCallFlags.NONE, timeout_ms, None).unpack()


def caller_uid(con, sender: str) -> int:
    from gi.repository import GLib

    return _call_bus(con, "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus",
                     "GetConnectionUnixUser", GLib.Variant("(s)", (sender,)), "(u)", 5000)[0]


def authorize(con, sender: str, action: str) -> Caller:
    """Allow uid 0; ask polkit (non-interactive) for anyone else; raise NotAuthorized otherwise."""
    from gi.repository import GLib

    try:
        uid = caller_uid(con, sender)
    except GLib.Error as e:
        raise NotAuthorized(f"cannot identify the caller {sender}: {e.message}")
    if uid == 0:
        return Caller(sender, uid)
    subject = ("system-bus-name", {"name": GLib.Variant("s", sender)})
    try:
        allowed, challenge, _details = _call_bus(
            con, names.POLKIT_NAME, names.POLKIT_PATH, names.POLKIT_IFACE, "CheckAuthorization",
            GLib.Variant("((sa{sv})sa{ss}us)", (subject, action, {}, 0, "")), "((bba{ss}))",
            names.POLKIT_TIMEOUT_MS)[0]
    except GLib.Error as e:
        log.warning("polkit check of %s for uid %d failed: %s", action, uid, e.message)
        raise NotAuthorized(f"uid {uid} is not root and polkit could not be asked about {action} "
                            f"({e.message})",
                            remedy="Run the command as root, or make sure polkitd is installed and running.")
    if not allowed:
        how = "needs authentication (interactive authentication is not offered)" if challenge else "is denied"
        log.info("denied %s to uid %d (%s)", action, uid, sender)
        raise NotAuthorized(f"polkit action {action} {how} for uid {uid}",
                            remedy="Run the command as root (sudo), or ask the administrator for a polkit rule "
                                   f"granting {action}.")
    return Caller(sender, uid)


def secure_by_default(cls, methods=None):
    """Wrap every interface method: authorization first (unless @public), then named-error mapping."""
    for name in METHODS if methods is None else methods:
        impl = getattr(cls, name)
        action = getattr(impl, _MARK, names.ACTION_MANAGE)
        setattr(cls, name, _wrap(name, impl, action))
    return cls


def _wrap(name, impl, action):
    def method(self, *args, dbus_context=None):
        try:
            sender = dbus_context.sender if dbus_context is not None else None
            if action is _PUBLIC:
                caller = Caller(sender, None)
            else:
                con = dbus_context.bus.con
                caller = authorize(con, sender, action)
            return impl(self, *args, caller=caller)
        except MemsaverError as e:
            log.info("%s() -> %s: %s", name, names.error_name(e), e.message)
            raise to_dbus_error(e) from None
        except Exception as e:  # a bug: log it fully, answer with a named error, stay up
            log.exception("%s() failed with an internal error", name)
            raise dbus_error(names.ERROR_FAILED, f"internal error in {name}: {type(e).__name__}: {e}") from None
    method.__name__ = name
    method.__doc__ = impl.__doc__
    return method


# --- argument checks -------------------------------------------------------------------------------
_KERNEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+~-]{0,127}$")
_DRIVER_RE = re.compile(r"^\d{3}\.\d{1,3}(?:\.\d{1,3})?$")


def _kernel(v: str) -> str:
    if not _KERNEL_RE.match(v):
        raise InvalidArgument(f"'kernel' is not a kernel release: {v!r}",
                              remedy="Give a release as listed under /lib/modules, e.g. 6.14.0-1015-nvidia-64k.")
    return v


def _driver(v: str) -> str:
    if not _DRIVER_RE.match(v):
        raise InvalidArgument(f"'driver_version' is not an NVIDIA driver version: {v!r}",
                              remedy="Give a version such as 580.142 or 550.163.01.")
    return v


def _reason(v: str) -> str:
    if not v.strip() or len(v) > 200 or any(ord(c) < 32 for c in v):
        raise InvalidArgument("'reason' must be 1-200 printable characters")
    return v


def _cert(v: str) -> str:
    if not v.startswith("/") or "\0" in v or len(v) > 4096:
        raise InvalidArgument(f"'cert' must be an absolute path: {v!r}")
    return v


# option name -> (python type, checker, kwarg name)
OPTIONS = {
    "Build": {"kernel": (str, _kernel, "kernel"), "driver_version": (str, _driver, "driver_version")},
    "Install": {"kernel": (str, _kernel, "kernel"), "all_kernels": (bool, None, "all_kernels")},
    "Remove": {"kernel": (str, _kernel, "kernel"), "all_kernels": (bool, None, "all_kernels")},
    "Activate": {},
    "Rollback": {"reason": (str, _reason, "reason")},
    "RequestEnrollment": {"cert": (str, _cert, "cert"), "wait_at_console": (bool, None, "wait_at_console")},
    "Refresh": {},
}
_TYPE_NAMES = {str: "a string (s)", bool: "a boolean (b)"}


def check_options(method: str, options) -> dict:
    """a{sv} options -> keyword arguments, or InvalidArgument naming the bad key."""
    spec = OPTIONS[method]
    if not isinstance(options, dict):
        raise InvalidArgument(f"{method}: options must be a dictionary (a{{sv}})")
    kwargs = {}
    for key, value in options.items():
        if key not in spec:
            known = ", ".join(sorted(spec)) or "none"
            raise InvalidArgument(f"{method}: unknown option '{key}' (known options: {known})")
        typ, check, kw = spec[key]
        if type(value) is not typ:
            raise InvalidArgument(f"{method}: option '{key}' must be {_TYPE_NAMES[typ]}, "
                                  f"got {type(value).__name__}")
        kwargs[kw] = check(value) if check else value
    if kwargs.get("all_kernels") and "kernel" in kwargs:
        raise InvalidArgument(f"{method}: give either 'kernel' or 'all_kernels', not both")
    return kwargs


def check_password(password) -> str:
    if not isinstance(password, str) or not password:
        raise InvalidArgument("RequestEnrollment: the one-time MOK password must not be empty",
                              remedy="Choose a password to type at the MOK manager on the next boot.")
    if len(password) > 256 or any(c in password for c in "\0\n\r"):
        raise InvalidArgument("RequestEnrollment: the password must be at most 256 characters on one line")
    return password


# --- the object ------------------------------------------------------------------------------------
def make_manager_class():
    """Build the published class (imports pydbus lazily; ``signal`` attributes must exist at publish time)."""
    from pydbus.generic import signal

    @secure_by_default
    class Manager:
        dbus = INTROSPECTION
        PropertiesChanged = signal()
        JobProgress = signal()
        JobFinished = signal()

        def __init__(self, core):
            self._core = core

        # reads -------------------------------------------------------------------------------------
        @public
        def GetStatus(self, *, caller):
            return self._core.status_json()

        @public
        def GetHistory(self, *, caller):
            return self._core.history_json()

        @public
        def GetJob(self, job_id, *, caller):
            return self._core.job_json(job_id)

        # operations ----------------------------------------------------------------------------------
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

    # Properties: cheap reads of the core's cache; a getter never raises (GetAll would fail whole).
    for _name in PROPERTIES:
        setattr(Manager, _name, property(lambda self, _n=_name: self._core.props[_n]))
    return Manager
