"""One thread for all of a process's torch work.

OpenMP gives every thread that opens a parallel region a team of its own. Once two threads have
(the model loaded on the main thread, steps run on the engine's), the process holds more OpenMP
threads than the machine has cores, and libgomp stops spinning between regions: each of the
hundreds of regions in a forward then pays a futex wake-up. Measured on a 2-core EPYC with
SmolLM2-135M, one decode step: 40 ms on the thread that loaded the model, 50 ms on another. So a
serving process loads its model, measures it and steps it on one thread: this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
_Job = tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]


class TorchThread:
    """A daemon thread that runs the callables given to it one after another, in order.

    >>> worker = TorchThread("specmesh-doc")
    >>> worker.submit(lambda: threading.current_thread().name).result()
    'specmesh-doc'
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((fn, args, future))
        return future

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on this thread, awaited without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def close(self, timeout: float | None = 10.0) -> None:
        """End the thread once the callables submitted before have run; wait up to ``timeout`` for
        it to exit (its native thread-local state torn down before the interpreter goes)."""
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)


class ThreadLoop:
    """A serving loop (``fn`` runs until told to stop) on a ``TorchThread``: the one given (the
    thread that loaded the model, left running at ``join``) or one of its own (closed at ``join``).
    A loop that fails is logged as it ends.

    >>> stop = threading.Event()
    >>> loop = ThreadLoop(stop.wait, "specmesh-doc-loop"); loop.start()
    >>> stop.set(); loop.join()
    """

    def __init__(self, fn: Callable[[], object], name: str, thread: TorchThread | None = None) -> None:
        self._fn, self._name = fn, name
        self._own = thread is None
        self._thread = thread or TorchThread(name)
        self._running: Future[Any] | None = None

    def start(self) -> None:
        self._running = self._thread.submit(self._fn)
        self._running.add_done_callback(self._log_failure)

    def join(self, timeout: float = 10.0) -> None:
        """Wait up to ``timeout`` for the loop to return (the caller has told it to stop)."""
        if self._running is not None:
            with contextlib.suppress(Exception):  # a loop that failed was logged as it ended
                self._running.result(timeout=timeout)
        if self._own:
            self._thread.close()

    def _log_failure(self, running: Future[Any]) -> None:
        if not running.cancelled() and running.exception() is not None:
            log.error("%s ended", self._name, exc_info=running.exception())
