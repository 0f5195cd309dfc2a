"""OpenAI response fields built from the SDK's results (pure functions, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence

from specmesh.params import Summary


def finish(summary: Summary | None) -> dict:
    """A choice's ``finish_reason`` in OpenAI's vocabulary (end-of-sequence and stop strings are both
    ``stop``) and vLLM's ``stop_reason`` (the stop string that ended it)."""
    if summary is None:
        return {"finish_reason": None, "stop_reason": None}
    reason = "length" if summary.finish_reason == "length" else "stop"
    return {"finish_reason": reason, "stop_reason": summary.stop_string or None}


def usage_of(summaries_by_choice: dict[int, Summary], n: int) -> dict:
    """Token counts of a request whose prompt p was generated ``n`` times (choices p·n … p·n + n − 1):
    each prompt counts once (its cached part as its first choice found it), every choice's completion counts.

    >>> from specmesh.v1 import params_pb2
    >>> s = Summary("eos", 5, 3, 0.0, 0.0, params_pb2.SpeculationMetrics(), cached_tokens=4)
    >>> usage_of({0: s}, 1)
    {'prompt_tokens': 5, 'completion_tokens': 3, 'total_tokens': 8, 'prompt_tokens_details': {'cached_tokens': 4}}
    >>> usage_of({0: s, 1: s}, 2)["prompt_tokens"]
    5
    """
    firsts = [s for i, s in summaries_by_choice.items() if i % n == 0]
    prompt = sum(s.prompt_tokens for s in firsts)
    completion = sum(s.completion_tokens for s in summaries_by_choice.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)},
    }


def speculation(summaries: Sequence[Summary]) -> dict:
    """Per-request speculation metrics in vLLM's ``metrics.speculative_decoding`` shape, plus ours.

    num_spec_steps counts steps that carried a draft; mean_acceptance_length = 1 + accepted /
    num_spec_steps (tokens per drafted step, the bonus included); acceptance_histogram[k] = drafted
    steps that accepted exactly k tokens (so it sums to num_spec_steps); num_grammar_pruned_nodes: draft
    nodes a structured output's grammar forbade, cut before the verification forward. Over n choices: summed.

    >>> from specmesh.v1 import params_pb2
    >>> m = params_pb2.SpeculationMetrics(steps=5, drafted_tokens=8, accepted_tokens=6,
    ...     accepted_length_counts=[1, 0, 1, 0, 1], per_proposer={"ngram": params_pb2.ProposerMetrics(
    ...     steps=3, drafted_tokens=8, accepted_tokens=6)})
    >>> out = speculation([Summary("eos", 5, 11, 0.0, 0.0, m)])
    >>> out["num_spec_steps"], out["mean_acceptance_length"], out["draft_acceptance_rate"]
    (3, 3.0, 0.75)
    >>> out["acceptance_histogram"], out["proposers"]["ngram"]["num_accepted_draft_tokens"]
    ([1, 0, 1, 0, 1], 6)
    >>> speculation([Summary("eos", 5, 11, 0.0, 0.0, params_pb2.SpeculationMetrics(grammar_pruned_nodes=4))] * 2)[
    ...     "num_grammar_pruned_nodes"]
    8
    """
    hist: list[int] = []
    proposers: dict[str, dict[str, int]] = {}
    drafted = accepted = steps = pruned = 0
    reasons = []
    for s in summaries:
        m = s.speculation
        drafted, accepted, steps = drafted + m.drafted_tokens, accepted + m.accepted_tokens, steps + m.steps
        pruned += m.grammar_pruned_nodes
        for k, count in enumerate(m.accepted_length_counts):
            hist.extend([0] * (k + 1 - len(hist)))
            hist[k] += count
        for name, p in m.per_proposer.items():
            c = proposers.setdefault(name, {"num_spec_steps": 0, "num_draft_tokens": 0, "num_accepted_draft_tokens": 0})
            c["num_spec_steps"] += p.steps
            c["num_draft_tokens"] += p.drafted_tokens
            c["num_accepted_draft_tokens"] += p.accepted_tokens
        if m.fallback_reason:
            reasons.append(m.fallback_reason)
    spec_steps = sum(hist)
    return {
        "num_spec_steps": spec_steps,
        "num_draft_tokens": drafted,
        "num_accepted_draft_tokens": accepted,
        "mean_acceptance_length": 1 + accepted / spec_steps if spec_steps else 0.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": hist,
        "num_steps": steps,  # every verification step, drafted or not
        "num_grammar_pruned_nodes": pruned,
        "proposers": proposers,
        "fallback_reason": "; ".join(dict.fromkeys(reasons)) or None,
    }
