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
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

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

    @property
    def name(self) -> str:
        return self._thread.name

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
