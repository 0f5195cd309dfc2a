"""Prompt logprobs, computed in the prefill forwards the request pays for anyway: equal to
transformers' log-softmax within 1e-4 through chunked prefill, with the prompt's prefix already in
the prefix cache (the request reads none of it), beside other requests, and with ``max_tokens`` 0
(prefill only: one event, no token)."""

from __future__ import annotations

import threading

import pytest
import torch
from support import workload_prompts

from verifier_svc.events import ErrorEvent, FinishEvent, TokenEvent
from verifier_svc.requests import GenerationRequest, SpecParams

pytestmark = pytest.mark.slow
NO_SPEC = SpecParams("none", 0, 0, "", "")


class _Events:
    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self.finish: FinishEvent | None = None
        self.done = threading.Event()

    def __call__(self, ev) -> None:
        assert not isinstance(ev, ErrorEvent), ev.message
        if isinstance(ev, TokenEvent):
            self.events.append(ev)
        else:
            self.finish = ev
            self.done.set()


def _submit(eng, ids: list[int], max_tokens: int, prompt_logprobs: int | None) -> _Events:
    got = _Events()
    req = GenerationRequest("r", ids, 0.0, 1.0, 0, 1, max_tokens, (), False, NO_SPEC, prompt_logprobs=prompt_logprobs)
    eng.submit(req, got)
    return got


def test_prompt_logprobs_equal_transformers_through_chunks_a_warm_prefix_cache_and_max_tokens_zero(
    lm, chat_ids, engine_factory
):
    eng = engine_factory(prefill_chunk_tokens=32)  # several chunks per prompt
    prompts = sorted((chat_ids(p) for p in workload_prompts(per_category=1, max_chars=600)), key=len)[::-1][:3]
    warm = _submit(eng, prompts[0], 2, None)  # caches prompt 0's blocks
    assert warm.done.wait(120)
    runs = [_submit(eng, prompts[0], 0, 3), _submit(eng, prompts[1], 4, 2), _submit(eng, prompts[2], 1, None)]
    assert all(r.done.wait(300) for r in runs)
    for ids, run, n_top in zip(prompts[:2], runs[:2], (3, 2), strict=True):
        with torch.inference_mode():
            want = torch.log_softmax(lm.model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [P, V]
        got = run.events[0].prompt_logprobs
        assert len(got) == len(ids) - 1 > 64  # over two chunks
        diff = max(abs(lp.logprob - float(want[q, ids[q + 1]])) for q, lp in enumerate(got))
        assert diff < 1e-4, diff
        for q, lp in enumerate(got):
            assert list(lp.top_ids) == torch.topk(want[q], n_top).indices.tolist()
            assert lp.rank == int((want[q] > want[q, ids[q + 1]]).sum()) + 1
        assert all(ev.prompt_logprobs is None for ev in run.events[1:])
    assert runs[0].finish.completion_tokens == 0 and runs[0].finish.finish_reason == "length"
    assert len(runs[0].events) == 1 and runs[0].events[0].token_ids == []
    assert runs[0].finish.cached_tokens == 0  # its prefix was cached, and it read none of it
    assert runs[1].finish.completion_tokens == 4
    assert runs[2].events[0].prompt_logprobs is None
