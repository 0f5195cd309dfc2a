"""Runs benchmark requests and returns one record (a dict, one JSON line) per request.

Service modes go to a target with a per-request ``SpecDecodeParams``: the verifier through the
gRPC SDK (``GrpcTarget``) or an OpenAI-compatible server over HTTP (``http_target.HttpTarget``),
or both, each wave of a mode then running on every target in turn (the order alternating wave by
wave) with the same prompts and seeds; every service record says its ``transport``. Reference
modes (``hf-greedy``, ``hf-pld``) run transformers' ``generate()`` in this process on the same
model and prompts. At concurrency 1 the modes are interleaved request by request (``plain``
first, since the oracle needs its output, the others rotated); at concurrency c the same holds
wave by wave, each wave being c requests of one mode in flight together. With ``load="continuous"``
a "wave" is instead every prompt of a turn (of a category, unless mixed), served by c streams in a
closed loop: a stream that finishes takes the next prompt at once (a serving benchmark's
``--max-concurrency``), so the aggregate is throughput under a sustained load rather than the
makespan of c requests, which the slowest of them sets.

Every measured run of a service mode (mode, sampling, concurrency, and transport when there are
two) has its own ``cache_scope`` (``cache_scope``), random per bench invocation, and a prompt
sent again in the same run (to fill the last wave) goes to a scope of its own
(``<scope>-repeat<n>``): every request prefills its prompt cold, in every mode, so that no mode
reads the KV another mode's (or its own earlier) request cached, and modes differ only in how
they decode. Modes that learn from past outputs (``LEARNING_MODES``: the suffix proposer, and
``auto``, which may pick it) therefore cannot learn from the run itself either; their warm-up
prompts (if any) go through their scope, untimed, before the first measured request of its
(sampling, concurrency) block.
"""

from __future__ import annotations

import secrets
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

from specmesh.client import Client
from specmesh.params import SamplingParams, SpecDecodeParams, StructuredOutput
from specmesh_bench.workload import BenchPrompt

# mode → the proposer named in SpecDecodeParams
SERVICE_MODES = {
    "plain": "none",
    "ngram": "ngram",
    "ngram-local": "ngram-local",  # same algorithm inside the verifier: the pipeline-overhead baseline
    "suffix": "suffix",  # learns from the outputs of past requests (of the same cache_scope)
    "draft": "draft",
    "head": "head",  # the learned head over the target's hidden states
    "rag": "rag",
    "auto": "auto",
    "oracle": "oracle",
}
HF_MODES = ("hf-greedy", "hf-pld")
ALL_MODES = (*SERVICE_MODES, *HF_MODES)
# Modes whose proposer learns from the outputs it sees: each measured run gets its own cache scope
# and the warm-up; the others (plain, ngram, ngram-local, draft, head, rag, oracle, hf-*) learn nothing.
LEARNING_MODES = ("suffix", "auto")


def cache_scope(token: str, mode: str, sampling: str, concurrency: int, target: str = "") -> str:
    """The cache scope of one measured run of a mode: ``token`` is random per bench invocation,
    ``target`` the transport when a run has two.

    >>> cache_scope("5f3a", "suffix", "greedy", 8), cache_scope("5f3a", "auto", "sampled", 1, "http")
    ('bench-5f3a-suffix-greedy-c8', 'bench-5f3a-auto-sampled-c1-http')
    >>> cache_scope("5f3a", "plain", "greedy", 8)
    'bench-5f3a-plain-greedy-c8'
    """
    return f"bench-{token}-{mode}-{sampling}-c{concurrency}" + (f"-{target}" if target else "")


@dataclass(frozen=True)
class RunConfig:
    modes: tuple[str, ...]
    concurrency: tuple[int, ...] = (1,)
    samplings: tuple[str, ...] = ("greedy",)  # "greedy" | "sampled"
    max_tokens: int = 128
    temperature: float = 1.0  # for sampled runs
    pld_sweep: tuple[int, ...] = (3, 5, 10)
    corpus: str = ""  # SpecDecodeParams.corpus for the rag mode
    mix: bool = False  # concurrency > 1: waves mix every category (a realistic stream) instead of one each
    tag: bool = False  # each request carries its category as SpecDecodeParams.workload_tag
    load: str = "waves"  # concurrency > 1: "waves" of c requests, or "continuous" (c streams kept busy)
    repetition_penalty: float | None = None  # every request's (SamplingParams.repetition_penalty), hf-* modes too


def mode_order(modes: tuple[str, ...], turn: int) -> list[str]:
    """``plain`` first (the oracle replays its output), the rest rotated by ``turn``.

    >>> mode_order(("plain", "ngram", "oracle", "hf-greedy"), 1)
    ['plain', 'oracle', 'hf-greedy', 'ngram']
    """
    rest = [m for m in modes if m != "plain"]
    k = turn % len(rest) if rest else 0
    return (["plain"] if "plain" in modes else []) + rest[k:] + rest[:k]


def token_gaps(t0: float, arrivals: list[tuple[float, int]]) -> tuple[float, list[float]]:
    """Time to first token and per-token inter-token latencies from chunk arrivals.

    A chunk of n tokens arriving g seconds after the previous one gives n gaps of g / n: a step
    that emits several tokens lowers the latency of each.

    >>> token_gaps(0.0, [(0.5, 1), (0.7, 2), (1.0, 1)])
    (0.5, [0.09999999999999998, 0.09999999999999998, 0.30000000000000004])
    """
    if not arrivals:
        return 0.0, []
    gaps: list[float] = []
    prev = arrivals[0][0]
    for t, n in arrivals[1:]:
        gaps.extend([(t - prev) / n] * n if n else [])
        prev = t
    return arrivals[0][0] - t0, gaps


def spread_counts(known: list[int | None], total: int | None) -> list[int]:
    """Tokens per streamed event. SSE events carry text, not token counts: an event's count is
    known only when it carries logprobs. The tokens left (``total`` = ``usage.completion_tokens``
    minus the known counts) are spread evenly over the other events, in order (each gets the floor
    or the ceiling of the share); with no usable total, 1 each.

    Plain decoding emits one token per event, where this is exact; a speculative step emits its
    accepted tokens in one event, and spreading keeps the mean inter-token latency (the events'
    gaps over the tokens they brought) while smoothing its spread across events.

    >>> spread_counts([None, None, None], 7), spread_counts([2, None, None], 6)
    ([2, 2, 3], [2, 2, 2])
    >>> spread_counts([None, None], None), spread_counts([None, None, None], 2)
    ([1, 1], [1, 1, 1])
    >>> token_gaps(0.0, list(zip([0.5, 0.7, 1.0], spread_counts([None] * 3, 4))))[1]  # 0.3 s over 2 tokens
    [0.19999999999999996, 0.15000000000000002, 0.15000000000000002]
    """
    unknown = sum(n is None for n in known)
    left = (total or 0) - sum(n for n in known if n is not None)
    if unknown == 0 or left < unknown:
        return [1 if n is None else n for n in known]
    out, j = [], 0
    for n in known:
        if n is None:
            n = (j + 1) * left // unknown - j * left // unknown
            j += 1
        out.append(n)
    return out


def spec_for(mode: str, corpus: str, tag: str = "", scope: str = "") -> SpecDecodeParams:
    """The request's SpecDecodeParams in a mode; the corpus also goes to ``auto``, whose router
    may then choose the rag proposer. ``tag``: the workload tag the router keys its statistics by;
    ``scope``: the cache scope (``cache_scope``).

    >>> spec_for("auto", "docs").corpus, spec_for("ngram", "docs").corpus
    ('docs', '')
    >>> spec_for("auto", "", "code").workload_tag, spec_for("suffix", "", "", "bench-1-suffix").cache_scope
    ('code', 'bench-1-suffix')
    """
    return SpecDecodeParams(
        proposer=SERVICE_MODES[mode],
        corpus=corpus if mode in ("rag", "auto") else "",
        workload_tag=tag,
        cache_scope=scope,
    )


def _service_request(
    client: Client,
    prompt: BenchPrompt,
    mode: str,
    sampling: SamplingParams,
    corpus: str,
    tag: bool = False,
    spread: bool = False,
    scope: str = "",
) -> dict[str, Any]:
    spec = spec_for(mode, corpus, prompt.category if tag else "", scope)
    t0 = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    shown: list[float] = []  # arrivals of chunks with text: the events an SSE client would see
    ids: list[int] = []
    texts: list[str] = []
    stream = client.generate(list(prompt.token_ids), sampling, spec)
    for chunk in stream:
        arrivals.append((t := time.perf_counter(), len(chunk.token_ids)))
        ids.extend(chunk.token_ids)
        texts.append(chunk.text)
        if chunk.text:
            shown.append(t)
    wall = time.perf_counter() - t0
    ttft, gaps = token_gaps(t0, arrivals)
    s = stream.summary
    sp = s.speculation if s else None
    extra = {}
    if spread:  # the latencies as estimated over HTTP, from event times and the total alone
        counts = spread_counts([None] * len(shown), len(ids))
        extra["itl_spread_ms"] = [g * 1e3 for g in token_gaps(t0, list(zip(shown, counts, strict=True)))[1]]
    return {
        "transport": "grpc",
        "token_ids": ids,
        "text": "".join(texts),
        "wall_s": wall,
        "ttft_ms": ttft * 1e3,
        "itl_ms": [g * 1e3 for g in gaps],
        "finish_reason": s.finish_reason if s else "",
        "steps": sp.steps if sp else 0,
        "drafted": sp.drafted_tokens if sp else 0,
        "accepted": sp.accepted_tokens if sp else 0,
        "mean_accepted_length": sp.mean_accepted_length if sp else 0.0,
        "accepted_length_counts": list(sp.accepted_length_counts) if sp else [],
        "proposer_wait_ms": sp.proposer_wait_ms if sp else 0.0,
        "verify_ms": sp.verify_ms if sp else 0.0,
        "fallback_reason": sp.fallback_reason if sp else "",
        "grammar_pruned": sp.grammar_pruned_nodes if sp else 0,  # drafted nodes the grammar discarded
        # The proposer that drafted most of its steps (``auto`` may switch mid-request), and all of them.
        "proposer": max(sp.per_proposer, key=lambda p: sp.per_proposer[p].steps, default="none") if sp else "none",
        "proposers": {
            name: {"steps": m.steps, "drafted": m.drafted_tokens, "accepted": m.accepted_tokens}
            for name, m in (sp.per_proposer.items() if sp else ())
        },
        **extra,
    }


class Target(Protocol):
    """Where service modes run: one request, one record (with its ``transport``)."""

    name: str

    def request(
        self,
        prompt: BenchPrompt,
        mode: str,
        sampling: SamplingParams,
        corpus: str,
        tag: bool = False,
        scope: str = "",
    ) -> dict[str, Any]: ...


@dataclass(frozen=True)
class GrpcTarget:
    """The verifier through the gRPC SDK. ``spread``: records also get ``itl_spread_ms``, the
    inter-token latencies estimated as over HTTP (``spread_counts``), for a like-for-like
    comparison with a gateway."""

    client: Client
    spread: bool = False
    name: str = "grpc"

    def request(
        self,
        prompt: BenchPrompt,
        mode: str,
        sampling: SamplingParams,
        corpus: str,
        tag: bool = False,
        scope: str = "",
    ) -> dict[str, Any]:
        return _service_request(self.client, prompt, mode, sampling, corpus, tag, self.spread, scope)


class HfReference:
    """transformers' own decoding on the same model, in this process (greedy only)."""

    def __init__(self, model_path: str | None, threads: int) -> None:
        import torch

        from specmesh_server.model_loading import load_model

        if threads:
            torch.set_num_threads(threads)
        self.lm = load_model(model_path, "cpu" if not torch.cuda.is_available() else None)
        self._torch = torch

    def generate(
        self, prompt: BenchPrompt, max_tokens: int, pld_k: int = 0, repetition_penalty: float | None = None
    ) -> dict[str, Any]:
        torch = self._torch
        x = torch.tensor([list(prompt.token_ids)], device=self.lm.device)
        kw: dict[str, Any] = {"prompt_lookup_num_tokens": pld_k} if pld_k else {}
        if repetition_penalty is not None:
            kw["repetition_penalty"] = repetition_penalty
        pad = self.lm.tokenizer.pad_token_id
        pad = pad if pad is not None else self.lm.tokenizer.eos_token_id
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.lm.model.generate(x, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad, **kw)
            wall = time.perf_counter() - t0
        ids = out[0, x.shape[1] :].tolist()
        text = self.lm.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return {"token_ids": ids, "text": text, "wall_s": wall}  # decoded as the verifier decodes


def _record(prompt: BenchPrompt, mode: str, sampling: str, concurrency: int, wave: int, **extra: Any) -> dict:
    """One request's record; a structured prompt's output is checked (``check_structured``)."""
    rec = {
        "mode": mode,
        "category": prompt.category,
        "prompt_index": prompt.index,
        "row_id": prompt.row_id,
        "turn": prompt.turn,
        "source": prompt.source,
        "sampling": sampling,
        "concurrency": concurrency,
        "wave": wave,
        "prompt_tokens": len(prompt.token_ids),
        **extra,
    }
    n = _tokens(rec)
    rec["completion_tokens"] = n
    rec["tokens_per_s"] = n / rec["wall_s"] if rec.get("wall_s") else 0.0
    if prompt.structured is not None:
        rec.update(check_structured(prompt, rec))
    return rec


def check_structured(prompt: BenchPrompt, rec: dict) -> dict[str, Any]:
    """The record's structured-output fields: ``structured`` (the workload kind), ``schema_valid``
    and, when not, ``schema_error``: the output (the called function's arguments, for a tool call
    over HTTP) parsed and validated against the prompt's schema; a call of another function than the
    forced one is invalid too.

    >>> from specmesh_bench.structured import tools_task
    >>> p = BenchPrompt("qa", 0, "q", "", "", (), structured=tools_task("qa"))
    >>> check_structured(p, {"text": '{"query": "books", "max_results": 3}'})
    {'structured': 'tools', 'schema_valid': True}
    >>> check_structured(p, {"text": '{"query": "books", "max_results": 3}', "tool_name": "reply"})["schema_error"]
    'called reply, not search_docs'
    """
    from specmesh_bench.structured import schema_error

    task = prompt.structured
    assert task is not None
    called = rec.get("tool_name")
    error = f"called {called}, not {task.tool}" if called is not None and called != task.tool else None
    error = error or schema_error(rec.get("text", ""), task)
    return {"structured": task.kind, "schema_valid": error is None, **({"schema_error": error} if error else {})}


def _tokens(out: dict) -> int:
    """Tokens generated: the server's count where given (HTTP usage), else the token ids'."""
    return out["completion_tokens"] if "completion_tokens" in out else len(out.get("token_ids", []))


def mixed(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """Categories interleaved round-robin: a wave of c requests mixes c categories. Second turns
    come after every first turn (a conversation's turn 1 before its turn 2), mixed alike.

    >>> ps = [BenchPrompt(c, i, "", "", "", (), t) for c, i, t in (("a", 0, 1), ("a", 1, 1), ("a", 2, 2), ("b", 0, 1))]
    >>> [(p.category, p.index) for p in mixed(ps)]
    [('a', 0), ('b', 0), ('a', 1), ('a', 2)]
    """
    out = []
    for turn in sorted({p.turn for p in prompts}):
        by: dict[str, list[BenchPrompt]] = {}
        for p in prompts:
            if p.turn == turn:
                by.setdefault(p.category, []).append(p)
        for i in range(max(len(v) for v in by.values())):
            out.extend(v[i] for v in by.values() if i < len(v))
    return out


def first_mismatch(reference: Sequence, other: Sequence) -> int | None:
    """Index of the first differing token (or character, of texts; or length difference); None if identical.

    >>> first_mismatch([1, 2, 3], [1, 2, 3]), first_mismatch([1, 2, 3], [1, 5, 3]), first_mismatch([1, 2], [1])
    (None, 1, 1)
    >>> first_mismatch("def f(x):", "def f(x):"), first_mismatch("def f(x):", "def g(x):")
    (None, 4)
    """
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def compared_by(a: dict, b: dict) -> str | None:
    """What two outputs are compared by: token ids where both have them (gRPC, hf-*), else texts
    (HTTP returns no ids) where both come from SpecMesh; another server's greedy output may differ
    from ours by its numerics, which says nothing about speculation.

    >>> grpc, http = {"token_ids": [1], "text": "a"}, {"text": "a", "server": "specmesh"}
    >>> vllm = {"text": "a", "server": "vllm"}
    >>> compared_by(grpc, {"token_ids": [1]}), compared_by(grpc, http), compared_by(http, vllm)
    ('token_ids', 'text', None)
    """
    if "token_ids" in a and "token_ids" in b:
        return "token_ids"
    if "text" in a and "text" in b and a.get("server", "specmesh") == b.get("server", "specmesh") == "specmesh":
        return "text"
    return None


def _reference(r: dict, plains: dict[str | None, dict]) -> dict | None:
    """The plain output a record is checked against: its own transport's (the gRPC one for hf-*);
    the gateway's plain is checked against the verifier's over gRPC, unless it went to chat
    completions (``--structured tools``), where the gateway renders the prompt with its tools.

    >>> plains = {"grpc": {"text": "a"}, "http": {"text": "b"}}
    >>> [_reference({"mode": m, "transport": "http"}, plains) for m in ("plain", "ngram")]
    [{'text': 'a'}, {'text': 'b'}]
    >>> _reference({"mode": "plain", "transport": "http", "chat": True}, plains) is None
    True
    """
    if r["mode"] == "plain":
        return plains.get("grpc") if r.get("transport") == "http" and not r.get("chat") else None
    return plains.get(r.get("transport")) or plains.get("grpc") or plains.get("http")


def _corrupt(r: dict) -> None:
    """The harness's own self-test: the last token (and character) changed."""
    if r.get("token_ids"):
        r["token_ids"][-1] = (r["token_ids"][-1] + 1) % 32000
    if r.get("text"):
        r["text"] = r["text"][:-1] + chr(ord(r["text"][-1]) ^ 1)


def _mark_lossless(records: list[dict], corrupt: str | None) -> None:
    """Greedy: compare every mode's output with ``plain``'s on the same prompt and wave (see
    ``_reference``, ``compared_by``); ``mismatch_at`` counts characters where ``mismatch_in`` is text.

    >>> rs = [{"mode": m, "transport": t, "sampling": "greedy", "text": x, "server": "specmesh"}
    ...       for m, t, x in (("plain", "http", "ab"), ("ngram", "http", "ab"), ("auto", "http", "ax"))]
    >>> _mark_lossless(rs, None)
    >>> [(r["mode"], r.get("lossless"), r.get("mismatch_at")) for r in rs]
    [('plain', None, None), ('ngram', True, None), ('auto', False, 1)]
    """
    for r in records:
        if corrupt and r["mode"] == corrupt:
            _corrupt(r)
    plains = {r.get("transport"): r for r in records if r["mode"] == "plain"}
    for r in records:
        ref = _reference(r, plains)
        key = compared_by(ref, r) if ref is not None and r["sampling"] == "greedy" else None
        if key is None:
            continue
        at = first_mismatch(ref[key], r[key])
        r["lossless"] = at is None
        if at is not None:
            r["mismatch_at"] = at
            if key == "text":
                r["mismatch_in"] = "text"


class BenchRunner:
    """``warmup``: prompts sent (untimed, greedy, at the run's highest concurrency) through each
    learning mode's scope before its measured requests (see the module's docstring); ``run_token``
    names this invocation's scopes (random by default); ``log``: progress lines (stderr);
    ``block_done(sampling, concurrency)``: called after each block's last request, before the next
    block's warm-up (e.g. to read the router's statistics as that block left them); ``meter(mode,
    sampling, concurrency)``: a context around each wave's requests of a service mode (e.g. reading
    the verifier's metrics before and after them)."""

    def __init__(
        self,
        config: RunConfig,
        targets: Sequence[Target],
        hf: HfReference | None,
        set_oracle: Callable[[tuple[int, ...], list[int]], None] | None,
        corrupt_mode: str | None = None,
        warmup: Sequence[BenchPrompt] = (),
        run_token: str | None = None,
        log: Callable[[str], None] | None = None,
        block_done: Callable[[str, int], None] | None = None,
        meter: Callable[[str, str, int], AbstractContextManager] | None = None,
    ) -> None:
        self.config, self.targets, self.hf, self.set_oracle = config, list(targets), hf, set_oracle
        self.block_done, self.meter = block_done, meter
        self.corrupt_mode = corrupt_mode
        self.warmup = list(warmup)
        self.run_token = run_token or secrets.token_hex(4)
        self.log = log or (lambda line: print(line, file=sys.stderr))
        self.warmed: list[str] = []  # the scopes warmed so far, in order
        self._sent: dict[tuple[str, str], int] = {}  # (scope, row id) → requests sent so far

    def scope(self, mode: str, sampling: str, concurrency: int, target: Target) -> str:
        """The cache scope of a measured request (before ``_repeat_scope``)."""
        name = target.name if len(self.targets) > 1 else ""
        return cache_scope(self.run_token, mode, sampling, concurrency, name)

    def scopes(self) -> list[str]:
        """The scopes warm-ups go through: every measured run's of a learning mode, in run order."""
        return [
            self.scope(m, sampling, c, t)
            for sampling in self.config.samplings
            for c in self.config.concurrency
            for m in self._modes(sampling, c)
            if m in LEARNING_MODES
            for t in self.targets
        ]

    def _repeat_scope(self, scope: str, prompt: BenchPrompt) -> str:
        """``scope``, or for a prompt this scope has already been sent, a fresh scope of its own."""
        n = self._sent.get((scope, prompt.row_id), 0)
        self._sent[(scope, prompt.row_id)] = n + 1
        return f"{scope}-repeat{n}" if n else scope

    def _parallel(self, target: Target, prompts: list[BenchPrompt], mode: str, scope: str) -> list[dict]:
        """Untimed greedy requests, at the run's highest concurrency (warm-ups, first answers)."""
        cfg = self.config
        with ThreadPoolExecutor(max(cfg.concurrency)) as pool:
            return list(
                pool.map(
                    lambda p: target.request(p, mode, self._sampling("greedy", 0, p), cfg.corpus, cfg.tag, scope),
                    prompts,
                )
            )

    def first_answers(self, prompts: list[BenchPrompt]) -> dict[str, str]:
        """row id → the model's greedy answer to turn 1, for each multi-turn row among ``prompts``:
        plain decoding (a greedy answer is the same in every lossless mode) through the first
        target, untimed, in a scope of its own (``bench-<token>-answers``) that no measured run
        uses, and ``max_tokens`` as the run."""
        multi = [p for p in prompts if p.turn == 1 and len(p.turns) > 1]
        if not multi:
            return {}
        self.log(f"bench: answering the first turn of {len(multi)} multi-turn prompt(s) (untimed) …")
        outs = self._parallel(self.targets[0], multi, "plain", f"bench-{self.run_token}-answers")
        return {p.row_id: o["text"] for p, o in zip(multi, outs, strict=True)}

    def _warm_up(self, sampling: str, c: int, modes: list[str]) -> None:
        """The warm-up through every scope of this (sampling, concurrency) block, once each."""
        if not self.warmup:
            return
        for mode in modes:
            for target in self.targets if mode in LEARNING_MODES else ():
                scope = self.scope(mode, sampling, c, target)
                if scope in self.warmed:
                    continue
                self.log(f"bench: warm-up, {len(self.warmup)} prompts through {mode} in scope {scope} (untimed) …")
                self._parallel(target, self.warmup, mode, scope)
                self.warmed.append(scope)

    def planned_requests(self, prompts: list[BenchPrompt]) -> int:
        total = 0
        for sampling in self.config.samplings:
            for c in self.config.concurrency:
                modes = self._modes(sampling, c)
                per_prompt = sum(
                    len(self.config.pld_sweep) if m == "hf-pld" else 1 if m in HF_MODES else len(self.targets)
                    for m in modes
                )
                total += sum(len(wave) for wave in self.waves(prompts, c)) * per_prompt
        return total

    def waves(self, prompts: list[BenchPrompt], c: int) -> list[list[BenchPrompt]]:
        """What runs together, in order: at concurrency 1 each prompt; beyond, waves of c requests of
        one category (its prompts cycled to fill the last wave), or of all categories mixed. Second
        turns come after every first turn, in waves of their own, so that a conversation's turn 1
        has finished before its turn 2 starts.

        >>> ps = [BenchPrompt("a", i, f"a{i}", "", "", (), t) for i, t in ((0, 1), (1, 1), (2, 1), (3, 2))]
        >>> runner = BenchRunner(RunConfig(modes=("plain",)), [], None, None)
        >>> [[p.row_id for p in w] for w in runner.waves(ps, 2)]
        [['a0', 'a1'], ['a2', 'a0'], ['a3', 'a3']]
        >>> [[p.row_id for p in w] for w in runner.waves(ps[::-1], 1)]
        [['a2'], ['a1'], ['a0'], ['a3']]

        Under continuous load a wave is a whole turn's prompts, nothing repeated (``_wave`` keeps c
        of them in flight):

        >>> continuous = BenchRunner(RunConfig(modes=("plain",), load="continuous"), [], None, None)
        >>> [[p.row_id for p in w] for w in continuous.waves(ps, 2)]
        [['a0', 'a1', 'a2'], ['a3']]
        """
        prompts = sorted(prompts, key=lambda p: p.turn)  # stable: file order within a turn
        if c == 1:
            return [[p] for p in prompts]
        continuous = self.config.load == "continuous"
        out = []
        for turn in dict.fromkeys(p.turn for p in prompts):
            phase = [p for p in prompts if p.turn == turn]
            groups = (
                [mixed(phase)]
                if self.config.mix
                else [[p for p in phase if p.category == cat] for cat in dict.fromkeys(p.category for p in phase)]
            )
            for ps in groups:  # continuous: the group whole; waves: c at a time, the last one filled
                out += (
                    [ps]
                    if continuous
                    else [[ps[(k * c + j) % len(ps)] for j in range(c)] for k in range(-(-len(ps) // c))]
                )
        return out

    def _modes(self, sampling: str, concurrency: int) -> list[str]:
        modes = list(self.config.modes)
        if sampling != "greedy":  # the oracle replays greedy output; the references are greedy
            modes = [m for m in modes if m != "oracle" and m not in HF_MODES]
        if concurrency > 1:  # transformers' generate() serves one request at a time
            modes = [m for m in modes if m not in HF_MODES]
        return modes

    def _sampling(self, sampling: str, seed: int, prompt: BenchPrompt | None = None) -> SamplingParams:
        """A request's sampling; a structured prompt's carries its schema (``structured_output``)."""
        cfg = self.config
        task = prompt.structured if prompt is not None else None
        grammar = StructuredOutput(json_schema=task.schema) if task is not None else None
        if sampling == "greedy":
            return SamplingParams(
                temperature=0.0, max_tokens=cfg.max_tokens, repetition_penalty=cfg.repetition_penalty,
                structured_output=grammar,
            )  # fmt: skip
        return SamplingParams(
            temperature=cfg.temperature, seed=seed, max_tokens=cfg.max_tokens,
            repetition_penalty=cfg.repetition_penalty, structured_output=grammar,
        )  # fmt: skip

    def run(self, prompts: list[BenchPrompt]) -> Iterator[dict]:
        """Yields records as requests complete (one per request)."""
        for sampling in self.config.samplings:
            for c in self.config.concurrency:
                modes = self._modes(sampling, c)
                self._warm_up(sampling, c, modes)  # before this block's first measured request
                for w, wave in enumerate(self.waves(prompts, c)):
                    yield from self._group(wave, mode_order(tuple(modes), w), sampling, c, w)
                if self.block_done is not None:
                    self.block_done(sampling, c)

    def _group(self, wave: list[BenchPrompt], order: list[str], sampling: str, c: int, w: int) -> Iterator[dict]:
        records: list[dict] = []
        for mode in order:
            if mode in HF_MODES:
                assert self.hf is not None and c == 1
                for k in self.config.pld_sweep if mode == "hf-pld" else (0,):
                    out = self.hf.generate(wave[0], self.config.max_tokens, k, self.config.repetition_penalty)
                    records.append(_record(wave[0], mode, sampling, c, w, pld_k=k, **out))
                continue
            if mode == "oracle" and self.set_oracle is not None:
                for r in records:
                    if r["mode"] == "plain" and "token_ids" in r:
                        prompt = next(p for p in wave if p.category == r["category"] and p.index == r["prompt_index"])
                        self.set_oracle(prompt.token_ids, r["token_ids"])
            seeds = [zlib.crc32(f"{p.row_id}/{w}/{j}".encode()) for j, p in enumerate(wave)]  # same for every mode
            k = w % len(self.targets)
            with self.meter(mode, sampling, c) if self.meter is not None else nullcontext():
                for target in self.targets[k:] + self.targets[:k]:  # which transport goes first alternates
                    records.extend(self._wave(target, wave, mode, sampling, seeds, c, w))
        if sampling == "greedy":
            for j in range(len(wave)):  # each prompt of the wave against its own plain output
                _mark_lossless([r for r in records if r.get("slot", 0) == j], self.corrupt_mode)
        yield from records

    def _wave(
        self, target: Target, wave: list[BenchPrompt], mode: str, sampling: str, seeds: list[int], c: int, w: int
    ) -> list[dict]:
        """The wave's requests of one mode on one target, c in flight at a time (a wave of c: all
        together; under continuous load, each finished request's stream takes the next prompt)."""
        cfg = self.config
        scope = self.scope(mode, sampling, c, target)
        scopes = [self._repeat_scope(scope, p) for p in wave]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(min(c, len(wave))) as pool:
            outs = list(
                pool.map(
                    lambda p, s, sc: target.request(p, mode, self._sampling(sampling, s, p), cfg.corpus, cfg.tag, sc),
                    wave,
                    seeds,
                    scopes,
                )
            )
        wave_tps = sum(_tokens(o) for o in outs) / (time.perf_counter() - t0)
        group = "mix" if cfg.mix and c > 1 else wave[0].category
        return [
            _record(p, mode, sampling, c, w, slot=j, wave_tokens_per_s=wave_tps, group=group, cache_scope=sc, **out)
            for j, (p, sc, out) in enumerate(zip(wave, scopes, outs, strict=True))
        ]
