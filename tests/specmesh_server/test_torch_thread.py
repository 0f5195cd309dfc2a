"""TorchThread: one named thread runs every callable given to it, in order, and hands back results
and exceptions through futures."""

import asyncio
import threading

import pytest

from specmesh_server.torch_thread import TorchThread


def test_callables_run_in_order_on_the_one_named_thread_and_errors_reach_the_caller():
    worker = TorchThread("specmesh-test-torch")
    seen: list[tuple[int, str]] = []
    futures = [worker.submit(lambda i=i: seen.append((i, threading.current_thread().name))) for i in range(5)]
    for f in futures:
        f.result(timeout=5)
    assert seen == [(i, "specmesh-test-torch") for i in range(5)]

    def fail() -> None:
        raise ValueError("bad shape")

    with pytest.raises(ValueError, match="bad shape"):
        worker.submit(fail).result(timeout=5)
    assert worker.submit(lambda: 7).result(timeout=5) == 7  # a failure does not end the thread
    worker.close()


def test_run_awaits_without_blocking_the_loop_and_close_ends_the_thread():
    worker = TorchThread("specmesh-test-torch-async")
    release = threading.Event()

    async def main() -> tuple[str, int]:
        job = asyncio.ensure_future(worker.run(lambda: release.wait(5) and threading.current_thread().name))
        ticks = 0
        while not job.done():  # the loop keeps running while the job waits on its thread
            ticks += 1
            if ticks == 3:
                release.set()
            await asyncio.sleep(0.01)
        return await job, ticks

    name, ticks = asyncio.run(main())
    assert name == "specmesh-test-torch-async" and ticks >= 3
    worker.close()
    assert not worker._thread.is_alive()
