"""The ONE list of lifecycle operations: their names, the D-Bus method that starts each, and which move toward
stock. A leaf (layer 0) so every layer reads the same list without importing act/:

* act/executor.perform dispatches through a table whose keys are exactly :data:`EXECUTOR` (tests/test_executor.py);
* host/events.py records exactly :data:`EVENT_KINDS` (the executor's operations and the enrollment's);
* service/operations.py runs :data:`DBUS_JOBS` (each executor operation with a D-Bus method, and the enrollment
  request), service/daemon.py runs :data:`DAEMON_SAFETY` on the last good config, the CLI :data:`SAFETY` on the
  built-in defaults when the config file cannot be used;
* cli/build.py asks the daemon with :func:`dbus_method`;
* docs/dbus-api.md (GetEvents), docs/architecture.md (events.jsonl) and ``spark-memsaver events --help`` name
  every event kind (tests/test_owners.py).
"""

from __future__ import annotations


class Operation:
    """One operation: ``dbus_method`` (the D-Bus method that starts it as a job; None: no D-Bus door),
    ``toward_stock`` (moves toward the stock module), ``safety`` (runs on the built-in defaults -- the daemon: on
    the last good config -- when the config file cannot be used: config.load_for_safety), ``doors`` (who starts
    it). A plain class: this module is on the status path, which imports no typing."""
    __slots__ = ("dbus_method", "toward_stock", "safety", "doors")

    def __init__(self, dbus_method: str | None, toward_stock: bool, safety: bool, doors: str):
        self.dbus_method, self.toward_stock, self.safety, self.doors = dbus_method, toward_stock, safety, doors


OPERATIONS: dict[str, Operation] = {
    "build": Operation("Build", False, False, "D-Bus Build, root `spark-memsaver build`"),
    "install": Operation("Install", False, False, "D-Bus Install, root `install`"),
    "remove": Operation("Remove", True, True, "D-Bus Remove, root `remove`"),
    "activate": Operation("Activate", False, False, "D-Bus Activate, root `activate`"),
    "rollback": Operation("Rollback", True, True, "D-Bus Rollback, root `rollback`"),
    "reconcile": Operation("Reconcile", False, True, "daemon start/events, dpkg/kernel hooks, CLI"),
    "apt-pre-install": Operation(None, True, True, "the APT door (systemd/apt/)"),
}
EXECUTOR = tuple(OPERATIONS)

# The Secure Boot path (act/enroll.py): not module mutations, so not the executor's, but lifecycle events all the
# same -- a request queued for the next boot and its cancellation.
ENROLL = "enroll"
ENROLL_CANCEL = "enroll-cancel"
ENROLLMENT = (ENROLL, ENROLL_CANCEL)
EVENT_KINDS = EXECUTOR + ENROLLMENT

# What an intent record may name (host/intents.py): the operations that write one before their engine runs, and
# DKMS's registration step of a build.
INTENT_KINDS = ("register", "build", "install", "remove", "rollback", "activate")
# The CLI commands that change the system (remedy.py puts sudo before them): every operation with a command of its
# own (apt-pre-install is `reconcile --apt-pre-install`), the enrollment's, validate (GPU work as root) and reclaim
# (memory.reclaim / drop_caches).
ROOT_COMMANDS = tuple(n for n, o in OPERATIONS.items() if o.dbus_method) + ("mok enroll", "mok cancel", "validate",
                                                                           "reclaim")

REQUEST_ENROLLMENT = "request-enrollment"          # the D-Bus job of RequestEnrollment (act/enroll.py)
PREPARE_LAUNCH = "prepare-launch"                  # the D-Bus job of PrepareLaunch (act/reclaim.py: memory, not a
#                                                    module mutation, so not the executor's nor a lifecycle event)
DBUS_JOBS = tuple(n for n, o in OPERATIONS.items() if o.dbus_method) + (REQUEST_ENROLLMENT, PREPARE_LAUNCH)
TOWARD_STOCK = tuple(n for n, o in OPERATIONS.items() if o.toward_stock)
SAFETY = tuple(n for n, o in OPERATIONS.items() if o.safety)                 # act/executor.SAFETY_OPS
DAEMON_SAFETY = tuple(n for n in SAFETY if OPERATIONS[n].dbus_method)        # service/daemon.REMOVAL_OPS


def dbus_method(op: str) -> str:
    """The D-Bus method that starts ``op`` (KeyError: none)."""
    m = OPERATIONS[op].dbus_method
    if m is None:
        raise KeyError(op)
    return m
