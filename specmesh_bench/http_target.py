"""Benchmark requests over HTTP: any OpenAI-compatible server, through the official ``openai`` client.

Prompts go as token ids to ``/v1/completions`` (streamed, ``stream_options.include_usage``), so
every server sees exactly the prompt the gRPC path sends; a structured prompt (``--structured``)
adds its ``response_format`` (json), or goes to ``/v1/chat/completions`` as one user message with
``tools`` and a ``tool_choice`` naming the function it must call (tools). A SpecMesh gateway (``owned_by:
"specmesh"`` in ``/v1/models``) takes each mode's speculation as ``extra_body={"spec_decode":
…}``; another server (vLLM, SGLang…) gets no extra body and is measured as it is configured.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from specmesh.params import SamplingParams
from specmesh_bench.runner import spec_for, spread_counts, token_gaps
from specmesh_bench.workload import BenchPrompt


def is_http(target: str) -> bool:
    """
    >>> is_http("http://127.0.0.1:8100/v1"), is_http("https://api.example/v1"), is_http("10.0.0.5:50051")
    (True, True, False)
    """
    return target.startswith(("http://", "https://"))


@dataclass
class SseTally:
    """What the events of one streamed completion add up to (``add`` each as it arrives).

    ``record`` gives the keys ``runner._service_request`` gives over gRPC, where HTTP tells them:
    no token ids, no proposer wait or verify time. ``mean_accepted_length`` is the verifier's
    (tokens emitted after the first ÷ verification steps), not the gateway's per-drafted-step
    ``mean_acceptance_length``; ``finish_reason`` is OpenAI's vocabulary (stop, length).

    >>> from openai.types import Completion
    >>> def ev(text, **kw):
    ...     return Completion.construct(id="c", object="text_completion", created=0, model="m",
    ...         choices=[{"index": 0, "text": text, "logprobs": None, "finish_reason": kw.get("fin")}])
    >>> tally = SseTally(t0=0.0)
    >>> for t, chunk in [(0.5, ev("He")), (0.7, ev("llo")), (1.0, ev(" world")), (1.0, ev("", fin="length"))]:
    ...     tally.add(t, chunk)
    >>> tally.add(1.0, Completion.construct(id="c", object="text_completion", created=0, model="m", choices=[],
    ...     usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    ...     metrics={"speculative_decoding": {"num_steps": 2, "num_draft_tokens": 4,
    ...         "num_accepted_draft_tokens": 2, "acceptance_histogram": [0, 0, 1], "proposers": {"ngram": {}},
    ...         "fallback_reason": None}}))
    >>> rec = tally.record(wall=1.0)
    >>> rec["text"], rec["completion_tokens"], rec["finish_reason"], rec["ttft_ms"]
    ('Hello world', 4, 'length', 500.0)
    >>> [round(g) for g in rec["itl_ms"]]  # counts [1, 1, 2]: 200 ms once, 300 ms over two tokens
    [200, 150, 150]
    >>> rec["steps"], rec["drafted"], rec["accepted"], rec["mean_accepted_length"], rec["proposer"]
    (2, 4, 2, 1.5, 'ngram')
    """

    t0: float
    times: list[float] = field(default_factory=list)
    counts: list[int | None] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reason: str = ""
    usage_tokens: int | None = None
    spec: dict[str, Any] | None = None
    tool_name: str | None = None  # the function a chat completion called (its arguments are the text)

    def add(self, t: float, chunk: Any) -> None:
        """One parsed event (an ``openai.types.Completion``, or a ``ChatCompletionChunk`` whose text is
        its content or its tool call's arguments); its extra fields are in ``model_extra``."""
        for choice in chunk.choices or ():
            text, tokens = _event_text(self, choice)
            if text:
                self.times.append(t)
                self.counts.append(len(tokens) if tokens else None)
                self.texts.append(text)
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
        if chunk.usage is not None:
            self.usage_tokens = chunk.usage.completion_tokens
        metrics = (getattr(chunk, "model_extra", None) or {}).get("metrics")
        if isinstance(metrics, dict) and isinstance(metrics.get("speculative_decoding"), dict):
            self.spec = metrics["speculative_decoding"]

    def record(self, wall: float) -> dict[str, Any]:
        n = self.usage_tokens if self.usage_tokens is not None else sum(spread_counts(self.counts, None))
        ttft, gaps = token_gaps(self.t0, list(zip(self.times, spread_counts(self.counts, n), strict=True)))
        sp = self.spec or {}
        steps = int(sp.get("num_steps") or 0)
        proposers = sp.get("proposers") or {}
        return {
            "transport": "http",
            "text": "".join(self.texts),
            "completion_tokens": n,
            "wall_s": wall,
            "ttft_ms": ttft * 1e3,
            "itl_ms": [g * 1e3 for g in gaps],
            "finish_reason": self.finish_reason,
            "steps": steps,
            "drafted": int(sp.get("num_draft_tokens") or 0),
            "accepted": int(sp.get("num_accepted_draft_tokens") or 0),
            "mean_accepted_length": max(n - 1, 0) / steps if steps else 0.0,
            "accepted_length_counts": list(sp.get("acceptance_histogram") or []),
            "fallback_reason": sp.get("fallback_reason") or "",
            **({"grammar_pruned": pruned} if (pruned := _pruned(sp)) is not None else {}),
            **({"tool_name": self.tool_name} if self.tool_name is not None else {}),
            "proposer": max(proposers, key=lambda p: proposers[p].get("num_spec_steps", 0), default="none"),
            "proposers": {
                name: {
                    "steps": p.get("num_spec_steps", 0),
                    "drafted": p.get("num_draft_tokens", 0),
                    "accepted": p.get("num_accepted_draft_tokens", 0),
                }
                for name, p in proposers.items()
            },
        }


def _pruned(spec: dict[str, Any]) -> int | None:
    """Drafted nodes the grammar discarded, where the gateway reports them (None: it does not).

    >>> _pruned({"num_grammar_pruned_nodes": 4}), _pruned({"grammar_pruned_nodes": 2}), _pruned({})
    (4, 2, None)
    """
    for key in ("num_grammar_pruned_nodes", "grammar_pruned_nodes"):
        if spec.get(key) is not None:
            return int(spec[key])
    return None


def _event_text(tally: SseTally, choice: Any) -> tuple[str, list | None]:
    """An event choice's text and its logprob tokens (None: not given): a completion's text, or a
    chat delta's content and tool-call arguments (the call's name noted in ``tally``).

    >>> from types import SimpleNamespace as NS
    >>> tally = SseTally(t0=0.0)
    >>> call = NS(function=NS(name="search_docs", arguments='{"query"'))
    >>> _event_text(tally, NS(delta=NS(content=None, tool_calls=[call]), logprobs=None)), tally.tool_name
    (('{"query"', None), 'search_docs')
    """
    if not hasattr(choice, "delta"):
        lp = getattr(choice, "logprobs", None)
        return choice.text or "", getattr(lp, "tokens", None) if lp is not None else None
    delta = choice.delta
    text = delta.content or ""
    for call in getattr(delta, "tool_calls", None) or ():
        fn = call.function
        if fn is not None:
            tally.tool_name = fn.name or tally.tool_name
            text += fn.arguments or ""
    lp = getattr(choice, "logprobs", None)
    content = getattr(lp, "content", None) if lp is not None else None
    return text, [x.token for x in content] if content else None


@dataclass
class HttpTarget:
    """An OpenAI-compatible server at ``base_url`` (``…/v1``), serving ``model``."""

    client: Any  # openai.OpenAI
    model: str
    owned_by: str = ""
    max_model_len: int | None = None
    name: str = "http"

    @property
    def specmesh(self) -> bool:
        """A SpecMesh gateway, which takes per-request speculation (``spec_decode``)."""
        return self.owned_by == "specmesh"

    @classmethod
    def connect(cls, base_url: str, served_model: str | None = None, timeout: float = 600.0) -> HttpTarget:
        """Asks ``/v1/models``: the served model (the first unless ``served_model``) and its owner.
        No retries: a retried request would be timed as one."""
        from openai import OpenAI

        client = OpenAI(
            base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"), max_retries=0, timeout=timeout
        )
        cards = client.models.list().data
        if not cards and not served_model:
            raise ValueError(f"{base_url}/models lists no model; name one with --served-model")
        card = next((c for c in cards if c.id == served_model), cards[0] if cards else None)
        extra = (card.model_extra or {}) if card is not None else {}
        max_len = extra.get("max_model_len")
        return cls(
            client,
            served_model or card.id,
            owned_by=getattr(card, "owned_by", "") or "",
            max_model_len=int(max_len) if max_len else None,
        )

    def request(
        self,
        prompt: BenchPrompt,
        mode: str,
        sampling: SamplingParams,
        corpus: str,
        tag: bool = False,
        scope: str = "",
    ) -> dict[str, Any]:
        """One streamed completion; the record of ``SseTally.record`` plus ``server`` (the owner). A
        structured prompt's output format is sent to any server: it is the workload, not speculation."""
        kw: dict[str, Any] = {}
        if sampling.seed is not None:
            kw["seed"] = sampling.seed
        extra: dict[str, Any] = {}
        if sampling.repetition_penalty is not None:  # vLLM's extra field, as SpecMesh's gateway takes it
            extra["repetition_penalty"] = sampling.repetition_penalty
        if self.specmesh:
            spec = spec_for(mode, corpus, prompt.category if tag else "", scope)
            extra["spec_decode"] = asdict(spec)
        elif mode != "plain":
            raise ValueError(f"mode {mode} needs a SpecMesh server; {self.owned_by or 'this server'} serves only plain")
        task = prompt.structured
        if task is not None and task.kind == "json":
            extra["response_format"] = task.response_format()  # the completions endpoint's: extra_body
        if extra:
            kw["extra_body"] = extra
        common = {
            "model": self.model,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            **kw,
        }
        t0 = time.perf_counter()
        tally = SseTally(t0)
        if task is not None and task.kind == "tools":
            messages = [{"role": "user", "content": prompt.text}]
            tools, choice = json.loads(task.tools), task.tool_choice()
            stream = self.client.chat.completions.create(messages=messages, tools=tools, tool_choice=choice, **common)
        else:
            stream = self.client.completions.create(prompt=list(prompt.token_ids), **common)
        with stream:
            for chunk in stream:
                tally.add(time.perf_counter(), chunk)
        chat = {"chat": True} if task is not None and task.kind == "tools" else {}  # a prompt of the server's making
        return {**tally.record(time.perf_counter() - t0), "server": self.owned_by, **chat}
