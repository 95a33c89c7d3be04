"""UTC timestamps as the status document writes them ('2026-12-02T12:00:05Z'), read without datetime, calendar
or time.strptime (which load _strptime, calendar, datetime and locale: the resident daemon reads one with every
sample, and the CLI's status path reads one too)."""

from __future__ import annotations

import re

_STAMP = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:Z|\+00:00)")


def utc_epoch(stamp) -> float | None:
    """'2026-12-02T12:00:05Z' (or '...+00:00') -> epoch seconds; None when not that form or not a real time."""
    m = _STAMP.fullmatch(stamp) if isinstance(stamp, str) else None
    if m is None:
        return None
    y, mo, d, h, mi, s = (int(g) for g in m.groups())
    if not (1 <= mo <= 12 and 1 <= d <= _days_in(y, mo) and h < 24 and mi < 60 and s < 62):
        return None
    y -= mo <= 2                                  # days from the civil date (proleptic Gregorian calendar)
    era, yoe = y // 400, y % 400
    doy = (153 * ((mo + 9) % 12) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return float((era * 146097 + doe - 719468) * 86400 + h * 3600 + mi * 60 + s)


def _days_in(y: int, mo: int) -> int:
    if mo == 2:
        return 29 if y % 4 == 0 and (y % 100 != 0 or y % 400 == 0) else 28
    return 30 if mo in (4, 6, 9, 11) else 31
