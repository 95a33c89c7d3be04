"""Every D-Bus and polkit name of spark-memsaverd, in one place (firewalld's ``config/dbus.py`` habit).

The API is versioned from the first release: the bus name, the interface and the object path all carry
``API_VERSION``; a later incompatible API gets ``…Daemon2`` beside this one. Adding methods or properties
does not bump it (clients must cope with ``org.freedesktop.DBus.Error.UnknownMethod``).

Nothing here imports GLib or pydbus: the CLI, the tests and the packaging read these names cheaply.
"""

from __future__ import annotations

API_VERSION = 1

# Reverse-DNS prefix (project hosted under github.io naming rules: lower-case, no hyphen).
PREFIX = "io.github.sparkmemsaver"

BUS_NAME = f"{PREFIX}.Daemon{API_VERSION}"
INTERFACE = BUS_NAME                      # the bus name equals the main interface (firewalld style)
OBJECT_PATH = "/" + BUS_NAME.replace(".", "/")   # /io/github/sparkmemsaver/Daemon1 — never "/"

# Standard interfaces the D-Bus policy lets everyone send to.
PROPERTIES_IFACE = "org.freedesktop.DBus.Properties"
INTROSPECTABLE_IFACE = "org.freedesktop.DBus.Introspectable"
PEER_IFACE = "org.freedesktop.DBus.Peer"

# polkit's authority.
POLKIT_NAME = "org.freedesktop.PolicyKit1"
POLKIT_PATH = "/org/freedesktop/PolicyKit1/Authority"
POLKIT_IFACE = "org.freedesktop.PolicyKit1.Authority"
POLKIT_TIMEOUT_MS = 5000   # a hung polkitd must not stall the daemon's loop for long

# --- errors: <interface>.Error.<Name> -------------------------------------------------------------
ERROR_PREFIX = f"{INTERFACE}.Error."

ERROR_NOT_AUTHORIZED = ERROR_PREFIX + "NotAuthorized"
ERROR_BUSY = ERROR_PREFIX + "Busy"
ERROR_UNSUPPORTED = ERROR_PREFIX + "Unsupported"
ERROR_INVALID_ARGUMENT = ERROR_PREFIX + "InvalidArgument"
ERROR_NOT_FOUND = ERROR_PREFIX + "NotFound"
ERROR_FAILED = ERROR_PREFIX + "Failed"

# errors.MemsaverError subclasses whose D-Bus name differs from their class name.
_ALIASES = {
    "NotPermitted": "NotAuthorized",
    "UsageError": "InvalidArgument",
    "MemsaverError": "Failed",
}


def error_name(exc_or_class_name) -> str:
    """D-Bus error name for a MemsaverError subclass (or its class name): ``<interface>.Error.<ClassName>``.

    Aliases keep one name per meaning (``NotPermitted`` is ``NotAuthorized``); every other subclass —
    including those other modules define — maps by its own class name, so a new named error needs no
    change here.
    """
    name = exc_or_class_name if isinstance(exc_or_class_name, str) else type(exc_or_class_name).__name__
    return ERROR_PREFIX + _ALIASES.get(name, name)


def error_short_name(dbus_name: str) -> str | None:
    """``…Error.Busy`` -> ``Busy``; None for a name that is not ours."""
    if dbus_name.startswith(ERROR_PREFIX):
        return dbus_name[len(ERROR_PREFIX):]
    return None


# --- polkit actions: one per mutating method (fwupd's verb-noun, kebab-case ids) -------------------
ACTION_PREFIX = PREFIX + "."
ACTION_BUILD = ACTION_PREFIX + "build"
ACTION_INSTALL = ACTION_PREFIX + "install"
ACTION_REMOVE = ACTION_PREFIX + "remove"
ACTION_ACTIVATE = ACTION_PREFIX + "activate"
ACTION_ROLLBACK = ACTION_PREFIX + "rollback"
ACTION_REQUEST_ENROLLMENT = ACTION_PREFIX + "request-enrollment"
ACTION_REFRESH = ACTION_PREFIX + "refresh"
ACTION_PREPARE_LAUNCH = ACTION_PREFIX + "prepare-launch"     # reclaim memory for a launch (PrepareLaunch)
# The action applied to any method that was not explicitly marked (secure by default), and the one an
# administrator can grant to imply all of the above.
ACTION_MANAGE = ACTION_PREFIX + "manage"

ACTIONS = (ACTION_BUILD, ACTION_INSTALL, ACTION_REMOVE, ACTION_ACTIVATE, ACTION_ROLLBACK,
           ACTION_REQUEST_ENROLLMENT, ACTION_REFRESH, ACTION_PREPARE_LAUNCH, ACTION_MANAGE)

# --- shipped files (relative to the repository's systemd/ folder) --------------------------------
DBUS_POLICY_FILE = f"dbus/{BUS_NAME}.conf"           # -> /usr/share/dbus-1/system.d/
POLKIT_POLICY_FILE = f"polkit/{PREFIX}.policy"        # -> /usr/share/polkit-1/actions/
