"""The engine's door, used from any thread: requests counted in flight against the engine's limit and
handed to the engine thread with their cancellations, and whether the engine still takes requests.

``submit`` counts a new request in flight and queues it as a ``Sequence``, or refuses it
(``EngineStopped`` where the engine failed or shuts down, ``EngineFull`` at ``limit`` requests in
flight); it stays counted until the engine thread says it ``left``. The engine thread ``drain``s what
arrived in order: ("submit", a ``Sequence``), ("cancel", a key) and ("wake", None), which only ends a
blocking wait.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from verifier_svc.detokenizer import StopStringFilter, detokenizer_for
from verifier_svc.events import EngineFull, EngineStats, EngineStopped, Event
from verifier_svc.request_speculation import RequestSpeculation
from verifier_svc.requests import GenerationRequest
from verifier_svc.sequence import Sequence

if TYPE_CHECKING:
    from verifier_svc.grammar import RequestGrammar

log = logging.getLogger("verifier_svc.engine")  # the engine's failure, logged under the engine's name


class Intake:
    """``limit``: requests in flight at most (running + waiting + not yet drained); ``stats``: the
    engine's counters (refused requests count as ``rejected``); ``tokenizer``: detokenizes outputs."""

    def __init__(self, limit: int, stats: EngineStats, tokenizer: Any) -> None:
        self.limit, self.stats, self.tokenizer = limit, stats, tokenizer
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._keys = itertools.count()
        self._admitted = 0  # running + waiting + in the inbox, guarded by _lock
        self._lock = threading.Lock()
        self._accepting = True
        self.failed: str | None = None  # why the engine can serve no more (a rank failed)

    def submit(
        self,
        req: GenerationRequest,
        sink: Callable[[Event], None],
        speculation: RequestSpeculation | None,
        grammar: RequestGrammar | None,
    ) -> int:
        """Count a new request in flight and queue it: its key, unique in this engine."""
        key = self._admit()
        seq = Sequence(
            key=key,
            req=req,
            sink=sink,
            detok=detokenizer_for(self.tokenizer, req.prompt_ids),
            stopper=StopStringFilter(list(req.stop)),
            arrival=time.perf_counter(),
            speculation=speculation or RequestSpeculation.start(),
            grammar=grammar,
        )
        self._inbox.put(("submit", seq))
        return key

    def _admit(self) -> int:
        with self._lock:
            if self.failed is not None:
                raise EngineStopped(f"the verifier failed: {self.failed}")
            if not self._accepting:
                raise EngineStopped("server is shutting down")
            if self._admitted >= self.limit:
                self.stats.rejected += 1
                raise EngineFull(f"{self._admitted} requests in flight, limit {self.limit}")
            self._admitted += 1
            return next(self._keys)

    def cancel(self, key: int) -> None:
        self._inbox.put(("cancel", key))

    def wake(self) -> None:
        self._inbox.put(("wake", None))

    def drain(self, block: bool) -> Iterator[tuple[str, Any]]:
        """What arrived, until the inbox is empty (``block``: waiting up to 0.5 s for the first)."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            yield item
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def left(self) -> None:
        """A request left the engine (finished, failed or cancelled)."""
        with self._lock:
            self._admitted -= 1

    def in_flight(self) -> int:
        with self._lock:
            return self._admitted

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def fail(self, reason: str) -> bool:
        """Take no requests any more, for ``reason`` (the first failure's is kept), and wake the engine
        thread to fail those it holds: whether this is the first failure."""
        with self._lock:
            first, self.failed = self.failed is None, self.failed or reason
            self._accepting = False
        if first:
            log.error("engine failed: %s", reason)
            self.wake()
        return first
