"""Rate-limited warnings for what can repeat per request or per step (invalid trees, a proposer
tier down): the first of a kind is logged, then at most one line per interval, carrying how many
were dropped since the last one. Exact counts live in the metrics; the log only has to say it
is happening without flooding (16 420 invalid-tree lines in 7 s before this).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable


class RateLimitedLog:
    """``logger`` with at most one line per ``key`` every ``interval_s``; thread-safe.

    Keys name a kind of message (e.g. ``("invalid tree", proposer)``), never a request: they are kept.

    >>> now = [0.0]
    >>> limited = RateLimitedLog(logging.getLogger("doc"), interval_s=10, clock=lambda: now[0])
    >>> [limited.warning("k", "bad tree") for _ in range(3)]
    [True, False, False]
    >>> now[0] = 10.0  # logs "bad tree (2 more like this in the last 10 s)"
    >>> limited.warning("k", "bad tree")
    True
    """

    def __init__(
        self, logger: logging.Logger, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._lock = threading.Lock()
        self._last: dict[Hashable, float] = {}  # key → when its last line was logged
        self._dropped: dict[Hashable, int] = {}  # key → lines dropped since

    def warning(self, key: Hashable, msg: str, *args: object, **kwargs: object) -> bool:
        """Log ``msg % args`` unless a line of ``key`` went out less than ``interval_s`` ago (then
        it is only counted, and the next line says how many). True when logged."""
        return self._log(logging.WARNING, key, msg, args, kwargs)

    def error(self, key: Hashable, msg: str, *args: object, **kwargs: object) -> bool:
        """As ``warning``, at ERROR (``exc_info=True`` for a traceback)."""
        return self._log(logging.ERROR, key, msg, args, kwargs)

    def _log(self, level: int, key: Hashable, msg: str, args: tuple, kwargs: dict) -> bool:
        dropped, since = self._take(key)
        if dropped < 0:
            return False
        if dropped:
            msg, args = f"{msg} (%d more like this in the last %.0f s)", (*args, dropped, since)
        self.logger.log(level, msg, *args, stacklevel=3, **kwargs)  # the caller's file and line
        return True

    def _take(self, key: Hashable) -> tuple[int, float]:
        """(lines dropped since the last one, seconds since it) when a line is due, else (-1, 0)."""
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._dropped[key] = self._dropped.get(key, 0) + 1
                return -1, 0.0
            self._last[key] = now
            return self._dropped.pop(key, 0), now - last if last is not None else 0.0
