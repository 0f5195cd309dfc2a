"""The continuous-batching engine in process, on the real model: outputs equal plain greedy
decoding while requests join, chunk their prefill, finish at different steps and get cancelled."""

import threading
import time

import pytest
from support import assert_greedy_equal, workload_prompts

from specmesh_server.model_runner import ModelRunner
from specmesh_server.torch_thread import TorchThread
from verifier_svc.engine import Engine, EngineConfig
from verifier_svc.events import EngineFull, ErrorEvent, FinishEvent, TokenEvent
from verifier_svc.request_speculation import RequestSpeculation
from verifier_svc.requests import GenerationRequest, SpecParams
from verifier_svc.speculation import SpeculationConfig, SpeculationControl

pytestmark = pytest.mark.slow
NO_SPEC = SpecParams("none", 0, 0, "", "")


class Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.text = ""
        self.finish: FinishEvent | None = None
        self.done = threading.Event()

    def __call__(self, ev) -> None:
        if isinstance(ev, TokenEvent):
            self.tokens += ev.token_ids
            self.text += ev.text
        else:
            assert not isinstance(ev, ErrorEvent), ev.message
            self.finish = ev
            self.done.set()


def _request(rid: str, ids: list[int], max_tokens: int, **kw) -> GenerationRequest:
    args = dict(temperature=0.0, top_p=1.0, top_k=0, seed=1, stop=(), ignore_eos=False, spec_params=NO_SPEC) | kw
    return GenerationRequest(rid, ids, max_tokens=max_tokens, **args)


def test_staggered_joins_chunked_prefill_and_early_finishers_match_greedy(lm, chat_ids, hf_greedy, engine_factory):
    eng = engine_factory(prefill_chunk_tokens=48)  # forces chunked prefill and single-row prefills
    prompts = [chat_ids(p) for p in workload_prompts(per_category=1, max_chars=1500)][:6]
    max_tokens = [20, 7, 16, 3, 20, 11]
    results = [Collector() for _ in prompts]
    for i, (ids, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        eng.submit(_request(f"r{i}", ids, n), results[i])
        time.sleep(0.15 * (i % 3))  # some join while others decode
    for r in results:
        assert r.done.wait(120)
    for ids, n, r in zip(prompts, max_tokens, results, strict=True):
        assert_greedy_equal(lm, ids, r.tokens, hf_greedy(ids, n))
        assert r.finish.completion_tokens == len(r.tokens)
    assert eng.in_flight() == 0 and eng.counts() == (0, 0)


def test_cancel_mid_stream_frees_the_slot_and_others_are_unaffected(lm, chat_ids, hf_greedy, engine_factory):
    eng = engine_factory()
    ids = [chat_ids(p) for p in ("Count from one to fifty in words.", "Name the planets.", "Why is the sky blue?")]
    victim, others = Collector(), [Collector(), Collector()]
    key = eng.submit(_request("victim", ids[0], 200, ignore_eos=True), victim)
    for i, c in enumerate(others):
        eng.submit(_request(f"o{i}", ids[i + 1], 24), c)
    while len(victim.tokens) < 5:
        time.sleep(0.02)
    eng.cancel(key)
    for c in others:
        assert c.done.wait(120)
    assert not victim.done.is_set() and len(victim.tokens) < 200
    for i, c in enumerate(others):
        assert_greedy_equal(lm, ids[i + 1], c.tokens, hf_greedy(ids[i + 1], 24))
    assert eng.stats.cancelled == 1 and eng.in_flight() == 0


def test_the_engine_steps_on_the_thread_it_is_given_and_leaves_it_running_at_shutdown(lm, chat_ids, hf_greedy):
    # The verifier loads its model on this thread, then hands it to the engine: one OpenMP team.
    thread = TorchThread("specmesh-test-engine")
    runner = thread.submit(lambda: ModelRunner(lm.model, lm.device, lm.dtype, max_context=8192, block_size=16)).result(
        timeout=60
    )
    eng = Engine(runner, lm.tokenizer, {2}, 8192, EngineConfig(), thread=thread)
    eng.start()
    ids, names = chat_ids("Name three rivers."), set()
    out = Collector()
    eng.submit(_request("r", ids, 8), lambda ev: (names.add(threading.current_thread().name), out(ev)))
    assert out.done.wait(120)
    assert_greedy_equal(lm, ids, out.tokens, hf_greedy(ids, 8))
    assert names == {"specmesh-test-engine"}  # every event, hence every step, came from that thread
    eng.shutdown()
    assert thread.submit(lambda: "still serving").result(timeout=10) == "still serving"  # not the engine's to close
    thread.close()


def test_admission_limit_raises_and_stop_strings_end_generation(chat_ids, engine_factory):
    eng = engine_factory(max_running=1, max_waiting=1)
    ids = chat_ids("Write the numbers 1 to 30 separated by commas.")
    a, b = Collector(), Collector()
    eng.submit(_request("a", ids, 60, stop=("5",)), a)
    eng.submit(_request("b", ids, 4), b)
    with pytest.raises(EngineFull):
        eng.submit(_request("c", ids, 4), Collector())
    assert a.done.wait(120) and b.done.wait(120)
    assert a.finish.finish_reason == "stop" and a.finish.stop_string == "5"
    assert "5" not in a.text and a.text  # text before the stop string only
    assert b.finish.finish_reason == "length" and len(b.tokens) == 4


def test_a_request_the_router_starts_plain_turns_speculation_on_from_its_own_skipped_trees(lm, chat_ids, hf_greedy):
    """No cap and a poor prior (the router's "off"): the skipped n-gram trees keep guessing the
    emitted tokens, so the request's own estimate rises and the cost gate verifies trees again.
    The router is told every step the request spent on n-gram, as it went: what the tokens cost."""
    from specmesh_router.cost_model import LiveStepCost, StepCost
    from specmesh_router.estimate import RequestEstimate
    from specmesh_router.policy import PolicyStore
    from specmesh_router.selection import Router
    from specmesh_router.stats import InProcessStats, StatsConfig, StatsKey
    from verifier_svc.local_proposer import LocalProposerSession
    from verifier_svc.proposer_client import ProposerLimits

    runner = ModelRunner(lm.model, lm.device, lm.dtype, max_context=8192, block_size=16)
    # A CPU-like step cost: a 32-token step costs ~2.4x a plain one (the live steps refine it).
    cost = LiveStepCost(StepCost.by_tokens((1, 2, 4, 8, 16, 32, 64), (1.0, 1.6, 1.7, 1.8, 2.0, 2.4, 3.6)))
    router = Router(InProcessStats(StatsConfig(half_life_s=1e9)), "lm", ("ngram",), PolicyStore(("ngram",)), cost)
    control = SpeculationControl(SpeculationConfig(), router, cost)
    eng = Engine(runner, lm.tokenizer, {2}, 8192, EngineConfig(), control)
    eng.start()
    try:
        ids = chat_ids(workload_prompts(per_category=8, max_chars=2000, categories=("code_edit",))[0])
        limits = ProposerLimits(vocab_size=runner.vocab_size, max_nodes=32, max_depth=24)
        session = LocalProposerSession("ngram", ids, limits, control.trees_arrived)
        got = Collector()
        spec = SpecParams("ngram", 0, 0, "", "")
        req = GenerationRequest("r", ids, max_tokens=64, temperature=0.0, top_p=1.0, top_k=0, seed=1, stop=(),
                                ignore_eos=True, spec_params=spec)  # fmt: skip
        t0 = time.perf_counter()
        eng.submit(req, got, RequestSpeculation.start(session, estimate=RequestEstimate((0.05,))))
        assert got.done.wait(300)
        elapsed = time.perf_counter() - t0
    finally:
        eng.shutdown()
    assert_greedy_equal(lm, ids, got.tokens, hf_greedy(ids, 64))
    spec = got.finish.speculation
    assert spec.steps > 0 and spec.accepted > 0  # verified trees, and they paid
    assert got.finish.steps < 48, f"{got.finish.steps} steps for 64 tokens"  # well under one token per step
    stats = router.stats.snapshot()[StatsKey("lm", "ngram", "")]
    assert len(stats.served_steps) == 1  # all of it in batches of one row
    steps, tokens, nodes, trees, seconds = stats.served_in(0)
    assert steps == pytest.approx(got.finish.steps)  # every step, with a tree or not
    # Accepted + a bonus per step (before the request's end cuts the last step's: what the step gave).
    assert tokens == pytest.approx(got.finish.steps + spec.accepted) and tokens >= 63
    assert nodes == pytest.approx(spec.drafted)  # verified nodes only, not skipped ones
    assert spec.steps <= trees + 1e-9 and trees <= steps  # steps n-gram had a tree for: verified or cut by the gate
    assert 0 < seconds < elapsed  # the steps' measured time, within the request's


def test_packed_steps_verify_a_batch_of_ragged_trees_to_plain_greedy_computing_fewer_tokens(lm, chat_ids, hf_greedy):
    """Four n-gram requests and one plain one decode together, every tree verified (no cost gate),
    once with steps packed (real tokens only) and once padded to the widest tree."""
    from verifier_svc.local_proposer import LocalProposerSession
    from verifier_svc.proposer_client import ProposerLimits

    class CountingRunner(ModelRunner):
        tokens = 0  # tokens the decode forwards computed (padding included)

        def forward(self, rows, input_ids, positions, mask, write_pos=None, packing=None, **kw):
            out = super().forward(rows, input_ids, positions, mask, write_pos, packing, **kw)
            if write_pos is not None:  # decode steps (prefill passes none)
                self.tokens += out.shape[0] * out.shape[1]
            return out

    prompts = [chat_ids(p) for p in workload_prompts(per_category=1, max_chars=1200)[:5]]
    outputs, computed = {}, {}
    for packed in (True, False):
        runner = CountingRunner(lm.model, lm.device, lm.dtype, max_context=8192, block_size=16)
        eng = Engine(runner, lm.tokenizer, {2}, 8192, EngineConfig(speculation=SpeculationConfig(packed_steps=packed)))
        eng.start()
        try:
            limits = ProposerLimits(vocab_size=runner.vocab_size, max_nodes=16, max_depth=8)
            got = [Collector() for _ in prompts]
            for i, ids in enumerate(prompts):
                plain = i == len(prompts) - 1
                req = _request(f"r{i}", ids, 24, spec_params=NO_SPEC if plain else SpecParams("ngram", 0, 0, "", ""))
                arrived = eng.speculation.trees_arrived
                session = None if plain else LocalProposerSession("ngram", ids, limits, arrived)
                eng.submit(req, got[i], RequestSpeculation.start(session))
            assert all(c.done.wait(300) for c in got)
        finally:
            eng.shutdown()
        assert eng.packed == packed
        outputs[packed], computed[packed] = [c.tokens for c in got], runner.tokens
        assert sum(c.finish.speculation.drafted for c in got) > 0  # trees were verified
    for ids, a, b in zip(prompts, outputs[True], outputs[False], strict=True):
        assert_greedy_equal(lm, ids, a, hf_greedy(ids, 24))
        assert a == b
    assert computed[True] < 0.8 * computed[False], computed
