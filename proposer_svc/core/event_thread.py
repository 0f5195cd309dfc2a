"""The thread a batching proposer's model state lives on (the draft model, the head): the streams
only queue events; the thread takes every queued one at once, applies them, and drafts in between.
``QueuedCore`` is the streams' side: a pushed ``ProposalCore`` numbered by its opener, whose ``close``
queues ``Close``."""

from __future__ import annotations

import itertools
import logging
import queue
from dataclasses import dataclass
from typing import Any

from proposer_svc.core.stream import Deliver, Opener
from specmesh.v1 import proposer_pb2
from specmesh_server.log_limit import RateLimitedLog
from specmesh_server.torch_thread import ThreadLoop, TorchThread

log = logging.getLogger(__name__)
errors = RateLimitedLog(log)  # a persistent failure repeats every event: one line per 10 s


class EventThread:
    """The streams ``submit`` events; the thread (``_run``, a subclass's) takes them in batches
    (``_events``) and drafts in between. ``thread``: the one that loaded the model, so the process
    has one OpenMP team (``specmesh_server.torch_thread``); default a new one."""

    def __init__(self, name: str, thread: TorchThread | None = None) -> None:
        self.name = name
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = ThreadLoop(self._run, name, thread)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def submit(self, event: Any) -> None:
        self._inbox.put(event)

    def _run(self) -> None:
        raise NotImplementedError

    def _apply(self, event: Any) -> None:
        """Apply one stream's event (a subclass's)."""
        raise NotImplementedError

    def _end(self, key: Any) -> None:
        """End the stream ``key`` (its deliver told None), after one of its events failed."""
        raise NotImplementedError

    def _apply_all(self, events: list[Any]) -> None:
        """Apply ``events`` in order. One that raises (a bug, a malformed message) is logged and ends its
        own stream (``_end(event.key)``); the others are still applied and the thread goes on serving."""
        for ev in events:
            try:
                self._apply(ev)
            except Exception:
                errors.error(type(ev), "%s: %s failed", self.name, type(ev).__name__, exc_info=True)
                try:
                    self._end(getattr(ev, "key", None))
                except Exception:
                    errors.error("end", "%s: ending the stream failed", self.name, exc_info=True)

    def _events(self) -> list[Any] | None:
        """Blocks for the next event, then takes every queued one; None once stopped."""
        events = [self._inbox.get()]
        while not self._inbox.empty():
            events.append(self._inbox.get())
        return None if any(e is None for e in events) else events

    def _pending(self) -> bool:
        return not self._inbox.empty()


@dataclass
class Close:
    """The stream ``key`` ended: its state leaves the thread."""

    key: int


class QueuedCore:
    """One stream's pushed ``ProposalCore`` over an ``EventThread``: its events go to ``loop.submit``
    under ``key`` (the stream's number, from ``opener``), its trees come back through ``deliver``. A
    subclass supplies ``start`` and ``advance``; ``close`` queues ``Close``."""

    def __init__(self, loop: Any, key: int, start: proposer_pb2.ProposeStart, deliver: Deliver) -> None:
        self.loop, self.key, self.start_msg, self.deliver = loop, key, start, deliver

    def close(self) -> None:
        self.loop.submit(Close(self.key))

    @classmethod
    def opener(cls, loop: EventThread) -> Opener:
        """The ``Opener`` that gives each stream a core of this class over ``loop``, numbered 0, 1, …"""
        keys = itertools.count()
        return lambda start, deliver: cls(loop, next(keys), start, deliver)
