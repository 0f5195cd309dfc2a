"""Runs benchmark requests and returns one record (a dict, one JSON line) per request.

Service modes go through the verifier with a per-request ``SpecDecodeParams``; reference modes
(``hf-greedy``, ``hf-pld``) run transformers' ``generate()`` in this process on the same model and
prompts. At concurrency 1 the modes are interleaved request by request (``plain`` first, since the
oracle needs its output, the others rotated); at concurrency c the same holds wave by wave, each
wave being c requests of one mode in flight together.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from specmesh.bench.workload import BenchPrompt
from specmesh.client import Client
from specmesh.params import SamplingParams, SpecDecodeParams

# mode → the proposer named in SpecDecodeParams
SERVICE_MODES = {
    "plain": "none",
    "ngram": "ngram",
    "ngram-local": "ngram-local",  # same algorithm inside the verifier: the pipeline-overhead baseline
    "draft": "draft",
    "rag": "rag",
    "auto": "auto",
    "oracle": "oracle",
}
HF_MODES = ("hf-greedy", "hf-pld")
ALL_MODES = (*SERVICE_MODES, *HF_MODES)


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


def spec_for(mode: str, corpus: str, tag: str = "") -> SpecDecodeParams:
    """The request's SpecDecodeParams in a mode; the corpus also goes to ``auto``, whose router
    may then choose the rag proposer. ``tag``: the workload tag the router keys its statistics by.

    >>> spec_for("auto", "docs").corpus, spec_for("ngram", "docs").corpus
    ('docs', '')
    >>> spec_for("auto", "", "code").workload_tag
    'code'
    """
    return SpecDecodeParams(
        proposer=SERVICE_MODES[mode], corpus=corpus if mode in ("rag", "auto") else "", workload_tag=tag
    )


def _service_request(
    client: Client, prompt: BenchPrompt, mode: str, sampling: SamplingParams, corpus: str, tag: bool = False
) -> dict[str, Any]:
    spec = spec_for(mode, corpus, prompt.category if tag else "")
    t0 = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    ids: list[int] = []
    stream = client.generate(list(prompt.token_ids), sampling, spec)
    for chunk in stream:
        arrivals.append((time.perf_counter(), len(chunk.token_ids)))
        ids.extend(chunk.token_ids)
    wall = time.perf_counter() - t0
    ttft, gaps = token_gaps(t0, arrivals)
    s = stream.summary
    sp = s.speculation if s else None
    return {
        "token_ids": ids,
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
        "proposer": next(iter(sp.per_proposer), "none") if sp else "none",
    }


class HfReference:
    """transformers' own decoding on the same model, in this process (greedy only)."""

    def __init__(self, model_path: str | None, threads: int) -> None:
        import torch

        from specmesh.model_loading import load_model

        if threads:
            torch.set_num_threads(threads)
        self.lm = load_model(model_path, "cpu" if not torch.cuda.is_available() else None)
        self._torch = torch

    def generate(self, prompt: BenchPrompt, max_tokens: int, pld_k: int = 0) -> dict[str, Any]:
        torch = self._torch
        x = torch.tensor([list(prompt.token_ids)], device=self.lm.device)
        kw = {"prompt_lookup_num_tokens": pld_k} if pld_k else {}
        pad = self.lm.tokenizer.pad_token_id
        pad = pad if pad is not None else self.lm.tokenizer.eos_token_id
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.lm.model.generate(x, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad, **kw)
            wall = time.perf_counter() - t0
        return {"token_ids": out[0, x.shape[1] :].tolist(), "wall_s": wall}


def _record(prompt: BenchPrompt, mode: str, sampling: str, concurrency: int, wave: int, **extra: Any) -> dict:
    rec = {
        "mode": mode,
        "category": prompt.category,
        "prompt_index": prompt.index,
        "row_id": prompt.row_id,
        "source": prompt.source,
        "sampling": sampling,
        "concurrency": concurrency,
        "wave": wave,
        "prompt_tokens": len(prompt.token_ids),
        **extra,
    }
    n = len(rec.get("token_ids", []))
    rec["completion_tokens"] = n
    rec["tokens_per_s"] = n / rec["wall_s"] if rec.get("wall_s") else 0.0
    return rec


def mixed(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """Categories interleaved round-robin: a wave of c requests mixes c categories.

    >>> ps = [BenchPrompt(c, i, "", "", "", ()) for c, i in (("a", 0), ("a", 1), ("b", 0))]
    >>> [(p.category, p.index) for p in mixed(ps)]
    [('a', 0), ('b', 0), ('a', 1)]
    """
    by: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by.setdefault(p.category, []).append(p)
    out = []
    for i in range(max(len(v) for v in by.values())):
        out.extend(v[i] for v in by.values() if i < len(v))
    return out


def first_mismatch(reference: list[int], other: list[int]) -> int | None:
    """Index of the first differing token (or length difference); None if identical.

    >>> first_mismatch([1, 2, 3], [1, 2, 3]), first_mismatch([1, 2, 3], [1, 5, 3]), first_mismatch([1, 2], [1])
    (None, 1, 1)
    """
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def _mark_lossless(records: list[dict], corrupt: str | None) -> None:
    """Greedy: compare every mode's tokens with ``plain`` on the same prompt and wave."""
    plain = next((r for r in records if r["mode"] == "plain"), None)
    for r in records:
        if corrupt and r["mode"] == corrupt and r["token_ids"]:  # the harness's own self-test
            r["token_ids"][-1] = (r["token_ids"][-1] + 1) % 32000
        if r["mode"] == "plain" or plain is None or r["sampling"] != "greedy":
            continue
        at = first_mismatch(plain["token_ids"], r["token_ids"])
        r["lossless"] = at is None
        if at is not None:
            r["mismatch_at"] = at


class BenchRunner:
    def __init__(
        self,
        config: RunConfig,
        client: Client,
        hf: HfReference | None,
        set_oracle: Callable[[tuple[int, ...], list[int]], None] | None,
        corrupt_mode: str | None = None,
    ) -> None:
        self.config, self.client, self.hf, self.set_oracle = config, client, hf, set_oracle
        self.corrupt_mode = corrupt_mode

    def planned_requests(self, prompts: list[BenchPrompt]) -> int:
        total = 0
        for sampling in self.config.samplings:
            for c in self.config.concurrency:
                modes = self._modes(sampling, c)
                per_prompt = sum(len(self.config.pld_sweep) if m == "hf-pld" else 1 for m in modes)
                if c == 1:
                    total += len(prompts) * per_prompt
                else:
                    sizes = [sum(p.category == cat for p in prompts) for cat in {p.category for p in prompts}]
                    sizes = [len(prompts)] if self.config.mix else sizes
                    total += sum(-(-n // c) for n in sizes) * c * per_prompt
        return total

    def _modes(self, sampling: str, concurrency: int) -> list[str]:
        modes = list(self.config.modes)
        if sampling != "greedy":  # the oracle replays greedy output; the references are greedy
            modes = [m for m in modes if m != "oracle" and m not in HF_MODES]
        if concurrency > 1:  # transformers' generate() serves one request at a time
            modes = [m for m in modes if m not in HF_MODES]
        return modes

    def _sampling(self, sampling: str, seed: int) -> SamplingParams:
        if sampling == "greedy":
            return SamplingParams(temperature=0.0, max_tokens=self.config.max_tokens)
        return SamplingParams(temperature=self.config.temperature, seed=seed, max_tokens=self.config.max_tokens)

    def run(self, prompts: list[BenchPrompt]) -> Iterator[dict]:
        """Yields records as requests complete (one per request)."""
        for sampling in self.config.samplings:
            for c in self.config.concurrency:
                modes = self._modes(sampling, c)
                if c == 1:
                    for i, p in enumerate(prompts):
                        yield from self._group([p], mode_order(tuple(modes), i), sampling, 1, i)
                else:  # waves of c requests of one category (its prompts cycled to fill the wave), or mixed
                    w = 0
                    groups = (
                        [mixed(prompts)]
                        if self.config.mix
                        else [
                            [p for p in prompts if p.category == cat]
                            for cat in dict.fromkeys(p.category for p in prompts)
                        ]
                    )
                    for ps in groups:
                        for k in range(-(-len(ps) // c)):
                            wave = [ps[(k * c + j) % len(ps)] for j in range(c)]
                            yield from self._group(wave, mode_order(tuple(modes), w), sampling, c, w)
                            w += 1

    def _group(self, wave: list[BenchPrompt], order: list[str], sampling: str, c: int, w: int) -> Iterator[dict]:
        records: list[dict] = []
        for mode in order:
            if mode in HF_MODES:
                assert self.hf is not None and c == 1
                for k in self.config.pld_sweep if mode == "hf-pld" else (0,):
                    out = self.hf.generate(wave[0], self.config.max_tokens, k)
                    records.append(_record(wave[0], mode, sampling, c, w, pld_k=k, **out))
                continue
            if mode == "oracle" and self.set_oracle is not None:
                for r in records:
                    if r["mode"] == "plain":
                        prompt = next(p for p in wave if p.category == r["category"] and p.index == r["prompt_index"])
                        self.set_oracle(prompt.token_ids, r["token_ids"])
            seeds = [zlib.crc32(f"{p.row_id}/{w}/{j}".encode()) for j, p in enumerate(wave)]  # same for every mode
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(wave)) as pool:
                outs = list(
                    pool.map(
                        lambda p, s, m=mode: _service_request(
                            self.client, p, m, self._sampling(sampling, s), self.config.corpus, self.config.tag
                        ),
                        wave,
                        seeds,
                    )
                )
            wave_wall = time.perf_counter() - t0
            wave_tps = sum(len(o["token_ids"]) for o in outs) / wave_wall
            group = "mix" if self.config.mix and c > 1 else wave[0].category
            for j, (p, out) in enumerate(zip(wave, outs, strict=True)):
                records.append(_record(p, mode, sampling, c, w, slot=j, wave_tokens_per_s=wave_tps, group=group, **out))
        if sampling == "greedy":
            for j in range(len(wave)):  # each prompt of the wave against its own plain output
                _mark_lossless([r for r in records if r.get("slot", 0) == j], self.corrupt_mode)
        yield from records
