"""The batching proposers' event threads (``proposer_svc.core.event_thread``; the head's and the draft
model's loops): an event that fails ends its own stream and the thread goes on serving the others; the
streams' side (``QueuedCore``) numbers its streams and queues their close."""

from __future__ import annotations

import queue

from proposer_svc.core.event_thread import Close, EventThread, QueuedCore
from proposer_svc.core.tree_search import DraftConfig, SearchRow
from proposer_svc.head.server import HeadLoop, HeadRequest, _Advance, _Open
from specmesh.v1 import proposer_pb2


def _request(out: queue.SimpleQueue, key: int) -> HeadRequest:
    return HeadRequest(deliver=lambda msg: out.put((key, msg)), search=SearchRow(8, 4, 10), token=5)


def test_a_failing_event_ends_its_own_stream_and_the_head_loop_serves_the_others():
    out: queue.SimpleQueue = queue.SimpleQueue()
    loop = HeadLoop(head=None, config=DraftConfig(), max_batch=4, metrics=None)  # no head: no state to draft from
    loop.start()
    try:
        loop.submit(_Open(1, _request(out, 1)))
        loop.submit(_Open(2, _request(out, 2)))
        loop.submit(_Advance(1, [], None, proposer_pb2.TreeBudget()))  # no tokens: applying it raises
        assert out.get(timeout=10) == (1, None)  # its stream ended
        loop.submit(_Advance(2, [7, 8], None, proposer_pb2.TreeBudget()))  # the thread still serves stream 2
        key, msg = out.get(timeout=10)
        assert key == 2 and msg.context_length == 12  # answered: no state was sent, so an empty tree
        loop.submit(Close(2))
    finally:
        loop.stop()


class _Recorder(EventThread):
    """Applies nothing: records what the streams queue."""

    def __init__(self) -> None:
        super().__init__("recorder")
        self.queued: list[object] = []

    def submit(self, event: object) -> None:
        self.queued.append(event)


class _Core(QueuedCore):
    def start(self, prompt: list[int], budget: proposer_pb2.TreeBudget) -> None:
        self.loop.submit(("start", self.key, prompt))


def test_queued_cores_are_numbered_per_opener_and_close_queues_their_key():
    loop = _Recorder()
    opener = _Core.opener(loop)
    start = proposer_pb2.ProposeStart(request_id="r")
    delivered: list[object] = []
    first, second = opener(start, delivered.append), opener(start, delivered.append)
    assert (first.key, second.key) == (0, 1) and first.loop is loop and first.start_msg is start
    second.start([1, 2], proposer_pb2.TreeBudget())
    first.close()
    assert loop.queued == [("start", 1, [1, 2]), Close(0)]
    first.deliver(None)
    assert delivered == [None]
    assert _Core.opener(loop)(start, delivered.append).key == 0  # each opener counts from 0
