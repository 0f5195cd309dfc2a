"""Posts from a worker thread onto a running event loop: order, one wake per burst, failures kept apart."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specmesh_server import loop_posts


class _Loop:
    """A real event loop running in its own thread, its wakes from other threads counted."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.wakes = 0
        self.errors: list[BaseException] = []
        self.loop.set_exception_handler(lambda _loop, ctx: self.errors.append(ctx["exception"]))
        real = self.loop.call_soon_threadsafe

        def counted(fn, *args):
            self.wakes += 1
            return real(fn, *args)

        self.loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def settle(self) -> None:
        """Wait until the loop has run everything handed to it so far."""
        done = threading.Event()
        self.loop.call_soon_threadsafe(done.set)
        assert done.wait(5)
        self.wakes -= 1

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def running():
    loops: list[_Loop] = []

    def make() -> _Loop:
        loops.append(_Loop())
        return loops[-1]

    yield make
    for lp in loops:
        lp.close()


def test_a_burst_wakes_the_loop_once_and_runs_in_the_order_posted(running):
    lp, seen = running(), []
    with loop_posts.batched():
        for i in range(50):
            loop_posts.post(lp.loop, seen.append, i)
        assert loop_posts.held() == 50 and seen == []  # nothing handed over inside the block
    lp.settle()
    assert seen == list(range(50)) and lp.wakes == 1


def test_outside_a_block_each_post_goes_straight_to_the_loop(running):
    lp, seen = running(), []
    loop_posts.post(lp.loop, seen.append, "a")
    loop_posts.post(lp.loop, seen.append, "b")
    lp.settle()
    assert seen == ["a", "b"] and lp.wakes == 2 and loop_posts.held() == 0


def test_flush_hands_over_mid_block_and_a_nested_block_hands_over_with_the_outer(running):
    lp, seen = running(), []
    with loop_posts.batched():
        loop_posts.post(lp.loop, seen.append, 1)
        loop_posts.flush()
        lp.settle()
        assert seen == [1] and lp.wakes == 1
        with loop_posts.batched():
            loop_posts.post(lp.loop, seen.append, 2)
        assert loop_posts.held() == 1  # still held: the outer block has not ended
        loop_posts.post(lp.loop, seen.append, 3)
    lp.settle()
    assert seen == [1, 2, 3] and lp.wakes == 2


def test_each_loop_gets_its_own_calls_and_a_closed_one_is_skipped(running):
    a, b, gone = running(), running(), running()
    seen_a, seen_b = [], []
    gone.close()
    with loop_posts.batched():
        loop_posts.post(a.loop, seen_a.append, 1)
        loop_posts.post(gone.loop, seen_a.append, "never")
        loop_posts.post(b.loop, seen_b.append, 2)
        loop_posts.post(a.loop, seen_a.append, 3)
    a.settle(), b.settle()
    assert (seen_a, seen_b, a.wakes, b.wakes) == ([1, 3], [2], 1, 1)


def test_a_failing_call_is_reported_and_the_rest_still_run(running):
    lp, seen = running(), []

    def boom() -> None:
        raise ValueError("boom")

    with loop_posts.batched():
        loop_posts.post(lp.loop, seen.append, 1)
        loop_posts.post(lp.loop, boom)
        loop_posts.post(lp.loop, seen.append, 2)
    lp.settle()
    assert seen == [1, 2] and [type(e) for e in lp.errors] == [ValueError]


def test_other_threads_are_not_held_by_this_threads_block(running):
    lp, seen = running(), []
    with loop_posts.batched():
        t = threading.Thread(target=loop_posts.post, args=(lp.loop, seen.append, "other"))
        t.start(), t.join()
        lp.settle()
        assert seen == ["other"] and loop_posts.held() == 0
