"""Who is calling, and may they: asynchronous, bounded, and quiet.

- :class:`Authorizer` answers "uid 0, or a non-interactive polkit grant of the action" without ever blocking
  the GLib loop (issue 12 defect 6): the caller's uid (``GetConnectionUnixUser``, cached per unique name,
  which the bus never reuses) and polkit's ``CheckAuthorization`` are asynchronous Gio calls; the method
  reply is sent from their callbacks. Property reads and signals never wait on them. At most
  ``MAX_PENDING_POLKIT`` polkit checks are in flight; one more is refused at once with
  :class:`TooManyAuthorizations`. Root needs no polkit slot.
- :class:`DenialLog` rate-limits what denials write to the log (defect 10): the first denial of a uid is
  logged, the rest of an interval are counted and summed up in one line per uid per interval (per uid, not per
  connection: reconnecting writes no more lines); the table is bounded.
- The read limits (per uid, one budget shared by all non-root callers, refusals answered late) are in
  ``limits``.
- Identification is shared and queued, never refused for want of a slot (issue 35 item 5): every call of a
  sender not yet identified waits on ONE ``GetConnectionUnixUser`` lookup of that sender; at most
  ``MAX_PENDING_IDENTIFY`` lookups are in flight, the next senders wait in order behind them (the bus answers
  them at once: a wait of milliseconds), and only past ``MAX_WAITING_IDENTIFY`` senders (more connections than
  dbus-daemon lets 16 users open, 256 each) is a call refused. A hundred connections of one user therefore
  delay root's first call by the time the bus takes to name them, and never refuse it; once identified, each
  uid's reads are limited per uid (``limits.ReadLimiter``), whatever number of connections it spreads them on.
"""

from __future__ import annotations

import collections
import logging
import time

from spark_memsaver.errors import Busy, NotPermitted
from spark_memsaver.service import names
from spark_memsaver.service.limits import READ_BURST, READ_RATE, RateLimited, ReadLimiter  # noqa: F401

log = logging.getLogger("spark_memsaver.dbus")

MAX_PENDING_POLKIT = 16
MAX_PENDING_IDENTIFY = 64        # uid lookups in flight at once
MAX_WAITING_IDENTIFY = 4096      # senders queued behind them
MAX_CALLS_PER_SENDER = 256       # calls of one unidentified sender waiting on its lookup (the bus allows 128)
UID_CACHE = 4096
BUS_TIMEOUT_MS = 5000


class NotAuthorized(NotPermitted):
    code = "not-authorized"


class TooManyAuthorizations(Busy):
    code = "too-many-authorizations"
    remedy = ("polkitd is slow to answer; retry in a few seconds, or run the command as root. "
              "'systemctl status polkit' shows whether it hangs.")


class Caller:
    __slots__ = ("sender", "uid")

    def __init__(self, sender: str | None, uid: int | None):
        self.sender, self.uid = sender, uid

    @property
    def privileged(self) -> bool:
        return self.uid == 0


class DenialLog:
    """First denial per sender logged; later ones in the same ``interval`` counted, then one summary line.

    ``flush()`` writes the summaries that are due; the owner arms a timer only while something is counted
    (so an idle daemon has no extra wake-up). ``clock`` and ``logger`` are injectable for tests."""

    def __init__(self, interval: float = 60.0, max_senders: int = 256, clock=time.monotonic, logger=None):
        self.interval, self.max_senders, self.clock = interval, max_senders, clock
        self.log = logger or log
        self._t: collections.OrderedDict[str, list] = collections.OrderedDict()   # sender -> [t0, n, uid, what]

    def denied(self, sender: str, uid, what: str) -> bool:
        """Record one denial; True when this one was logged. Counted per uid (per sender while the uid is not
        known): a user that reconnects gets no new log line for each connection (issue 35 item 5)."""
        now = self.clock()
        name, sender = sender, (f"uid {uid}" if uid is not None else sender)
        e = self._t.get(sender)
        if e is not None and now - e[0] < self.interval:
            e[1] += 1
            e[3] = what
            return False
        if e is not None:
            self._summary(sender, e)
        self._t[sender] = [now, 0, uid, what]
        self._t.move_to_end(sender)
        while len(self._t) > self.max_senders:
            old, oe = self._t.popitem(last=False)
            self._summary(old, oe)
        self.log.info("denied: %s (uid %s, %s)", what, uid, name)
        return True

    def _summary(self, sender: str, e: list) -> None:
        if e[1]:
            self.log.info("denied %d more call(s) of uid %s in %.0f s; last: %s", e[1], e[2], self.interval, e[3])

    def flush(self) -> bool:
        """Summaries for the intervals that ended; True while counts remain (keep the timer)."""
        now = self.clock()
        for sender in [s for s, e in self._t.items() if now - e[0] >= self.interval]:
            self._summary(sender, self._t.pop(sender))
        return any(e[1] for e in self._t.values())

    def pending(self) -> bool:
        return any(e[1] for e in self._t.values())


class Authorizer:
    """Asynchronous authorization on one connection. ``check(con, sender, action, done)`` calls
    ``done(caller, None)`` or ``done(None, error)`` later, on the loop; ``action None`` only identifies."""

    def __init__(self, denials: DenialLog | None = None):
        self.denials = denials or DenialLog()
        self.pending_polkit = 0
        self.pending_identify = 0
        self._uids: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._waiting: dict[str, list] = {}             # sender -> [(action, done)] until its uid is known
        self._queue: collections.deque = collections.deque()   # (con, sender) whose lookup is not sent yet
        self._flush_timer = None

    # --- steps ----------------------------------------------------------------------------------------
    def check(self, con, sender: str, action: str | None, done) -> None:
        uid = self._uids.get(sender)
        if uid is not None:
            self._uids.move_to_end(sender)
            self._have_uid(con, sender, action, uid, done)
            return
        waiting = self._waiting.get(sender)
        if waiting is not None:                      # its lookup is under way: wait on it
            if len(waiting) >= MAX_CALLS_PER_SENDER:
                done(None, TooManyAuthorizations(f"{len(waiting)} calls of {sender} wait to be identified"))
                return
            waiting.append((action, done))
            return
        if len(self._waiting) >= MAX_PENDING_IDENTIFY + MAX_WAITING_IDENTIFY:
            done(None, TooManyAuthorizations(f"{len(self._waiting)} callers are being identified already"))
            return
        self._waiting[sender] = [(action, done)]
        self._queue.append((con, sender))
        self._pump()

    def _pump(self) -> None:
        while self._queue and self.pending_identify < MAX_PENDING_IDENTIFY:
            con, sender = self._queue.popleft()
            self._lookup(con, sender)

    def _lookup(self, con, sender: str) -> None:
        from gi.repository import Gio, GLib

        self.pending_identify += 1

        def got(c, res):
            self.pending_identify -= 1
            waiting = self._waiting.pop(sender, [])
            try:
                uid, err = c.call_finish(res).unpack()[0], None
            except GLib.Error as e:
                uid, err = None, e
            if err is None:
                self._uids[sender] = uid
                while len(self._uids) > UID_CACHE:
                    self._uids.popitem(last=False)
            for action, done in waiting:
                try:      # one caller's failure (a bug in a reply) never stalls the others or the queue
                    if err is not None:
                        done(None, NotAuthorized(f"cannot identify the caller {sender}: {err.message}"))
                    else:
                        self._have_uid(con, sender, action, uid, done)
                except Exception:
                    log.exception("answering a call of %s failed", sender)
            self._pump()

        con.call("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "GetConnectionUnixUser",
                 GLib.Variant("(s)", (sender,)), GLib.VariantType.new("(u)"), Gio.DBusCallFlags.NONE,
                 BUS_TIMEOUT_MS, None, got)

    def _have_uid(self, con, sender, action, uid, done) -> None:
        if action is None or uid == 0:
            done(Caller(sender, uid), None)
            return
        if self.pending_polkit >= MAX_PENDING_POLKIT:
            err = TooManyAuthorizations(f"{self.pending_polkit} polkit checks are pending already; "
                                        f"{action} for uid {uid} is refused without asking")
            self._denied(sender, uid, f"{action} (too many pending authorizations)")
            done(None, err)
            return
        from gi.repository import Gio, GLib

        self.pending_polkit += 1
        subject = ("system-bus-name", {"name": GLib.Variant("s", sender)})

        def answered(c, res):
            self.pending_polkit -= 1
            try:
                allowed, challenge, _details = c.call_finish(res).unpack()[0]
            except GLib.Error as e:
                self._denied(sender, uid, f"{action} (polkit could not be asked: {e.message})")
                done(None, NotAuthorized(
                    f"uid {uid} is not root and polkit could not be asked about {action} ({e.message})",
                    remedy="Run the command as root, or make sure polkitd is installed and running."))
                return
            if not allowed:
                how = "needs authentication (interactive authentication is not offered)" if challenge else "is denied"
                self._denied(sender, uid, action)
                done(None, NotAuthorized(f"polkit action {action} {how} for uid {uid}",
                                         remedy="Run the command as root (sudo), or ask the administrator for a "
                                                f"polkit rule granting {action}."))
                return
            done(Caller(sender, uid), None)

        con.call(names.POLKIT_NAME, names.POLKIT_PATH, names.POLKIT_IFACE, "CheckAuthorization",
                 GLib.Variant("((sa{sv})sa{ss}us)", (subject, action, {}, 0, "")),
                 GLib.VariantType.new("((bba{ss}))"), Gio.DBusCallFlags.NONE, names.POLKIT_TIMEOUT_MS, None,
                 answered)

    # --- quiet denials ------------------------------------------------------------------------------
    def _denied(self, sender, uid, what) -> None:
        self.denials.denied(sender, uid, what)
        if self._flush_timer is None and self.denials.pending():
            from gi.repository import GLib
            self._flush_timer = GLib.timeout_add_seconds(max(1, int(self.denials.interval)), self._flush)

    def _flush(self) -> bool:
        if self.denials.flush():
            return True
        self._flush_timer = None
        return False
