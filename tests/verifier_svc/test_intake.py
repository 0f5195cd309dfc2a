"""The engine's door (``intake``): requests counted in flight against the limit, refused when full or
stopped, handed over in order with their cancellations; a failure keeps its first reason."""

import pytest

from verifier_svc.events import EngineFull, EngineStats, EngineStopped
from verifier_svc.intake import Intake
from verifier_svc.requests import GenerationRequest, SpecParams


class Bytes:  # a toy byte-level tokenizer: id = byte value
    def decode(self, ids, **kw) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _req(rid: str = "r") -> GenerationRequest:
    return GenerationRequest(rid, [72, 105], 0.0, 1.0, 0, 1, 8, (), False, SpecParams("none", 0, 0, "", ""))


def test_requests_are_counted_in_flight_up_to_the_limit_and_handed_over_in_order():
    stats = EngineStats()
    intake = Intake(2, stats, Bytes())
    keys = [intake.submit(_req("a"), print, None, None), intake.submit(_req("b"), print, None, None)]
    assert keys == [0, 1] and intake.in_flight() == 2
    with pytest.raises(EngineFull, match="2 requests in flight, limit 2"):
        intake.submit(_req("c"), print, None, None)
    assert stats.rejected == 1
    intake.cancel(keys[0])
    arrived = list(intake.drain(block=False))
    assert [k for k, _ in arrived] == ["submit", "submit", "cancel"]
    first = arrived[0][1]
    assert first.key == 0 and first.req.request_id == "a" and first.slot == -1
    assert first.speculation.session is None and first.grammar is None  # plain decoding
    assert arrived[2][1] == 0
    assert list(intake.drain(block=False)) == []
    intake.left()
    assert intake.in_flight() == 1
    assert intake.submit(_req("d"), print, None, None) == 2  # keys are never reused


def test_a_stopped_or_failed_intake_refuses_and_a_failure_keeps_its_first_reason():
    intake = Intake(4, EngineStats(), Bytes())
    intake.stop_accepting()
    with pytest.raises(EngineStopped, match="shutting down"):
        intake.submit(_req(), print, None, None)
    failed = Intake(4, EngineStats(), Bytes())
    assert failed.fail("rank 1 died") and not failed.fail("rank 2 died")
    assert failed.failed == "rank 1 died"
    with pytest.raises(EngineStopped, match="the verifier failed: rank 1 died"):
        failed.submit(_req(), print, None, None)
    assert [k for k, _ in failed.drain(block=True)] == ["wake"]  # the engine thread is woken once
