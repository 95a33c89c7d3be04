"""The history ring's replies (GetHistory, GetHistorySince) as JSON text, each sample encoded once.

The ring keeps a sample as a tuple (service/monitor.py: a dict would cost ~2.5x the memory). A reply used to
rebuild a dict of each sample and encode them all at every call: ~10 ms of the main loop for the default 1440
samples, 60-150 ms for 10000 (history_size up to 100000), while root's calls waited (issue 35 item 5). Here each
sample's text is kept once a reply has needed it (the ring's tuples are immutable), so a reply is a join of kept
texts, found by the sample's identity, not its hash; at most ``cap`` texts are kept (the newest samples the ring
holds), none until someone asks.
"""

from __future__ import annotations

import itertools
import json


class HistoryText:
    def __init__(self, cap: int = 10000):
        self.cap = cap
        self._memo: dict[int, tuple] = {}     # id(sample) -> (sample, its text): the sample kept, its id not reused
        self.encoded = 0            # samples encoded so far (tests say how many a reply needed)

    def reply(self, ring, since: float | None = None, limit: int | None = None) -> str:
        """The newest ``limit`` samples of ``ring`` at or after ``since``, oldest first, as a JSON array."""
        from spark_memsaver.service.monitor import unpack
        out: list[str] = []
        memo = self._memo
        for r in reversed(ring):
            if (limit is not None and len(out) >= limit) or (since is not None and (r[0] or 0) < since):
                break
            e = memo.get(id(r))
            if e is None or e[0] is not r:
                e = memo[id(r)] = (r, json.dumps(unpack(r)))
                self.encoded += 1
            out.append(e[1])
        if len(memo) > self.cap:    # keep the texts of the newest samples the ring still holds
            self._memo = {id(r): memo[id(r)] for r in itertools.islice(reversed(ring), self.cap)
                          if memo.get(id(r), (None,))[0] is r}
        return "[" + ", ".join(reversed(out)) + "]"
