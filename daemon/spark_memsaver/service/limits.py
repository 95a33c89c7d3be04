"""What the open reads may cost the daemon's main loop, whoever calls and however often they reconnect.

- :class:`ReadLimiter`: the open reads (``GetStatus``, ``GetHistory``, ``GetHistorySince``, ``GetEvents``,
  ``GetJob``) cost main-loop time. Each non-root **uid** (never the unique bus name: a new connection is a new
  name, issue 35 item 5) has a token bucket of ``READ_BURST`` calls refilled at ``READ_RATE`` a second, and all
  non-root uids together draw on one more bucket, ``SHARED_BURST``/``SHARED_RATE``: a hundred local users, or
  one with a hundred connections, get no more of the loop than that. A call needs a token in both; a large reply
  is charged more afterwards (:func:`reply_cost`: one token per started ``COST_BYTES`` of reply), so the buckets
  bound bytes as well as calls. uid 0 is never limited. The tables are bounded.
- :class:`Tarpit`: a refused read is answered after ``REFUSAL_DELAY_S`` rather than at once, so a caller that
  loops (waiting for each reply, as every D-Bus proxy does) is slowed to one refused call per delay and
  connection instead of spinning the loop with refusals. At most ``MAX_HELD`` refusals wait; past that they are
  sent at once. One timer, armed only while something waits.
"""

from __future__ import annotations

import collections
import logging
import time

from spark_memsaver.errors import Busy

log = logging.getLogger("spark_memsaver.dbus")

READ_RATE = 5.0           # open reads per second and non-root uid, sustained
READ_BURST = 20           # ... and at once
SHARED_RATE = 20.0        # open reads per second of all non-root uids together
SHARED_BURST = 40
COST_BYTES = 256 * 1024   # a reply is charged one token per started 256 KiB
REFUSAL_DELAY_S = 0.5     # a refused read is answered this much later
MAX_HELD = 2048           # refusals waiting at most (dbus-daemon lets a connection wait for 128 replies)


class RateLimited(Busy):
    code = "rate-limited"
    remedy = (f"Call the daemon's reads at most {READ_RATE:.0f} times a second (bursts of {READ_BURST}) per user, "
              "or watch the PropertiesChanged and JobFinished signals instead of polling; root is not limited.")


def reply_cost(reply) -> float:
    """Tokens a reply costs beyond the call's own one: one per started COST_BYTES past the first."""
    n = len(reply) if isinstance(reply, (str, bytes)) else 0
    return float(max(0, -(-n // COST_BYTES) - 1))


class ReadLimiter:
    """Token buckets per uid plus one shared by every non-root uid. ``allow(uid)`` spends one token of each or
    says no; ``charge(uid, n)`` takes ``n`` more after the fact (a bucket may go below zero: the debt is paid
    by waiting). ``clock`` injectable."""

    def __init__(self, rate: float = READ_RATE, burst: int = READ_BURST, shared_rate: float = SHARED_RATE,
                 shared_burst: int = SHARED_BURST, max_uids: int = 4096, clock=time.monotonic):
        self.rate, self.burst, self.max_uids, self.clock = rate, burst, max_uids, clock
        self.shared_rate, self.shared_burst = shared_rate, shared_burst
        self._b: collections.OrderedDict[int, list] = collections.OrderedDict()   # uid -> [tokens, t]
        self._shared = [float(shared_burst), clock()]

    def _fill(self, uid) -> list:
        now = self.clock()
        key = -1 if uid is None else int(uid)     # an unknown uid is one more caller, never root
        b = self._b.get(key)
        if b is None:
            b = self._b[key] = [float(self.burst), now]
            while len(self._b) > self.max_uids:    # the oldest uid forgets its debt: bounded memory
                self._b.popitem(last=False)
        else:
            self._b.move_to_end(key)
        b[0] = min(float(self.burst), b[0] + (now - b[1]) * self.rate)
        b[1] = now
        s = self._shared
        s[0] = min(float(self.shared_burst), s[0] + (now - s[1]) * self.shared_rate)
        s[1] = now
        return b

    def allow(self, uid) -> bool:
        if uid == 0:
            return True
        b = self._fill(uid)
        if b[0] < 1.0 or self._shared[0] < 1.0:
            return False
        b[0] -= 1.0
        self._shared[0] -= 1.0
        return True

    def charge(self, uid, tokens: float) -> None:
        if uid == 0 or tokens <= 0:
            return
        b = self._fill(uid)
        b[0] -= tokens
        self._shared[0] -= tokens

    def why(self, uid) -> str:
        """Which allowance a refused call ran past (for its message)."""
        b = self._fill(uid)
        if b[0] < 1.0:
            return (f"uid {uid} made more than {self.burst} reads at once or {self.rate:.0f} a second, over all "
                    "of its connections")
        return (f"the non-root callers together made more than {self.shared_burst} reads at once or "
                f"{self.shared_rate:.0f} a second")


class Tarpit:
    """Refusals answered ``delay`` seconds late, in order; ``hold(fn)`` queues ``fn`` (it sends the refusal)
    and says False when the queue is full (the caller then sends it at once). ``flush(now)`` runs the due ones.
    ``timer`` (``GLib.timeout_add``-like) is injectable; None: flushed only by hand (tests)."""

    def __init__(self, delay: float = REFUSAL_DELAY_S, max_held: int = MAX_HELD, clock=time.monotonic,
                 timer="glib"):
        self.delay, self.max_held, self.clock = delay, max_held, clock
        self._q: collections.deque = collections.deque()
        self._timer = timer
        self._armed = False

    def __len__(self) -> int:
        return len(self._q)

    def hold(self, fn) -> bool:
        if len(self._q) >= self.max_held or self.delay <= 0:
            return False
        self._q.append((self.clock() + self.delay, fn))
        if not self._armed and self._timer is not None:
            self._armed = True
            add = self._timer
            if add == "glib":
                from gi.repository import GLib
                add = GLib.timeout_add
            add(max(10, int(self.delay * 1000 / 5)), self._tick)
        return True

    def flush(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        n = 0
        while self._q and self._q[0][0] <= now:
            _t, fn = self._q.popleft()
            try:
                fn()
            except Exception:      # a caller gone away, a bug in one reply: the others are still sent
                log.exception("a delayed refusal could not be sent")
            n += 1
        return n

    def _tick(self) -> bool:
        self.flush()
        if self._q:
            return True
        self._armed = False
        return False
