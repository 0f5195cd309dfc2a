"""A request's stream (``streaming``): each step's tokens go to the client up to the first limit and
to the proposer, the request's end is told once, and an error ends a request only once."""

from verifier_svc.engine_observer import EngineObserver
from verifier_svc.events import EngineStats, ErrorEvent, FinishEvent, TokenEvent
from verifier_svc.intake import Intake
from verifier_svc.requests import GenerationRequest, SpecParams
from verifier_svc.streaming import Streams


class Bytes:  # a toy byte-level tokenizer: id = byte value
    def decode(self, ids, **kw) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class Speculation:
    def __init__(self) -> None:
        self.calls = []

    def emitted(self, seq, tokens, hidden, first=False) -> None:
        self.calls.append(("emitted", list(tokens), first, seq.done))

    def finish(self, seq) -> None:
        self.calls.append(("finish",))


def _seq(max_tokens: int, events: list):
    req = GenerationRequest("r", [72], 0.0, 1.0, 0, 1, max_tokens, (), False, SpecParams("none", 0, 0, "", ""))
    intake = Intake(1, EngineStats(), Bytes())
    intake.submit(req, events.append, None, None)
    return next(intake.drain(block=False))[1]


def test_tokens_stream_to_the_client_and_the_proposer_until_the_first_limit():
    events, stats, spec = [], EngineStats(), Speculation()
    streams = Streams({0}, 8192, stats, EngineObserver(), spec)
    seq = _seq(4, events)
    streams.append(seq, [105], None, None, first=True)
    streams.append(seq, [33, 33, 33, 33], None, None)  # the limit is 4 tokens: one of these is cut
    assert [type(e) for e in events] == [TokenEvent, TokenEvent, FinishEvent]
    assert events[0].text == "i" and events[1].token_ids == [33, 33, 33]
    assert events[2].finish_reason == "length" and events[2].completion_tokens == 4
    # the final step's tokens reach the proposer before its stream ends (it learns the whole output)
    assert spec.calls == [("emitted", [105], True, False), ("emitted", [33, 33, 33], False, False), ("finish",)]
    assert seq.done and stats.generated_tokens == 4 and stats.finished == 1


def test_an_error_ends_a_request_once():
    events = []
    seq = _seq(4, events)
    Streams.fail(seq, "boom")
    Streams.fail(seq, "again", "UNAVAILABLE")
    assert seq.done and events == [ErrorEvent("boom", "INTERNAL")]
