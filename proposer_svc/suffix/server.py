"""``specmesh serve suffix``: the suffix proposer (SuffixDecoding), one ``Propose`` stream per request.

Every stream proposes from its own context and from the global cache of its ``cache_scope``
(``proposer_svc/suffix/cache.py``); its accepted tokens enter that cache as they arrive, so running
requests already learn from each other, and its whole output is kept (FIFO, bounded by
``--max-cached-tokens``) when the stream ends. ``Learn`` brings in the outputs of the requests
that another proposer (or none) served, so the cache sees all traffic, not only its own. With
``--redis-url`` finished outputs are shared with every other suffix replica
(``proposer_svc/suffix/share.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
import numpy as np
from prometheus_client import Counter, Gauge

from proposer_svc.core.process import ServingConfig, add_serving_flags, proposer_server, serve_proposer, serving_config
from proposer_svc.core.stream import Deliver, Opener, ProposeStream, StreamConfig, StreamRefused
from proposer_svc.suffix.cache import SuffixCache
from proposer_svc.suffix.config import SuffixConfig
from proposer_svc.suffix.index import MAX_VOCAB
from proposer_svc.suffix.request import SuffixRequest
from proposer_svc.suffix.share import OutputSharing, ShareConfig
from proposer_svc.suffix.trees import Proposal
from specmesh.v1 import proposer_pb2
from specmesh_server.flags import ServiceFlags, boolean
from specmesh_server.metrics import REGISTRY, ProposerMetrics

log = logging.getLogger("specmesh.suffix")
MAX_SCOPE_CHARS = 128  # as the verifier (verifier_svc/requests.py)

TREES = Counter(
    "specmesh_suffix_trees", "Suffix trees sent, by the source they were counted from", ["source"], registry=REGISTRY
)
CACHED_TOKENS = Gauge(
    "specmesh_suffix_cached_tokens", "Finished outputs' tokens in the global cache", registry=REGISTRY
)
CACHE_BYTES = Gauge("specmesh_suffix_cache_bytes", "Bytes of the global cache arrays, every scope", registry=REGISTRY)
SHARED = Counter(
    "specmesh_suffix_shared_outputs", "Outputs exchanged with other replicas", ["direction"], registry=REGISTRY
)
LEARNED = Counter(
    "specmesh_suffix_learned_outputs",
    "Outputs of requests served by other proposers (or none), taken in through Learn",
    registry=REGISTRY,
)


@dataclass(frozen=True)
class SuffixServerConfig:
    serving: ServingConfig = field(default_factory=lambda: ServingConfig("127.0.0.1:50064"))
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    share: ShareConfig | None = None  # None: learn from this replica's own streams only


class SuffixCore:
    """One stream: the request's ``SuffixRequest``; its output is shared when the stream ends."""

    def __init__(self, cache: SuffixCache, scope: str, metrics: ProposerMetrics, sharing: OutputSharing | None) -> None:
        self.request = SuffixRequest(cache, scope)
        self.metrics, self.sharing = metrics, sharing

    def start(self, prompt: list[int], budget: proposer_pb2.TreeBudget) -> proposer_pb2.ProposeResponse:
        return self.advance(prompt, budget)

    def advance(self, tokens: list[int], budget: proposer_pb2.TreeBudget) -> proposer_pb2.ProposeResponse:
        check_ids("token", tokens)
        req = self.request
        req.extend(tokens)
        t0 = time.perf_counter()
        tree: Proposal = req.propose(budget.max_nodes or None, budget.max_depth or None)
        self.metrics.proposal(len(tree.tokens), time.perf_counter() - t0)
        TREES.labels(tree.source or "none").inc()
        return proposer_pb2.ProposeResponse(
            context_length=req.context_length,
            tree=proposer_pb2.TokenTree(tokens=tree.tokens, parents=tree.parents, path_probs=tree.probs),
        )

    def close(self) -> None:
        publish(self.sharing, self.request.scope, self.request.close())


def publish(sharing: OutputSharing | None, scope: str, tokens: np.ndarray) -> None:
    """A finished output, now in this replica's cache, to the other replicas (with Redis)."""
    if sharing is not None and len(tokens):
        sharing.publish(scope, tokens)
        SHARED.labels("out").inc()


def check_ids(what: str, tokens: list[int]) -> None:
    if tokens and (min(tokens) < 0 or max(tokens) >= MAX_VOCAB):
        bad = next(t for t in tokens if not 0 <= t < MAX_VOCAB)
        raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{what} id {bad} outside [0, {MAX_VOCAB})")


def check_scope(where: str, scope: str) -> None:
    if len(scope) > MAX_SCOPE_CHARS or not scope.isprintable():  # as the verifier checks
        raise StreamRefused(
            grpc.StatusCode.INVALID_ARGUMENT, f"{where}: must be printable and at most {MAX_SCOPE_CHARS} characters"
        )


def suffix_opener(cache: SuffixCache, metrics: ProposerMetrics, sharing: OutputSharing | None) -> Opener:
    def open_(start: proposer_pb2.ProposeStart, deliver: Deliver) -> SuffixCore:
        check_scope("start.cache_scope", start.cache_scope)
        return SuffixCore(cache, start.cache_scope, metrics, sharing)

    return open_


class SuffixService(ProposeStream):
    """``Propose`` streams, plus ``Learn``: a finished output this proposer did not follow enters the
    global cache of its scope (and, with Redis, every replica's), as a stream's output does at its end."""

    def __init__(
        self, config: StreamConfig, cache: SuffixCache, metrics: ProposerMetrics, sharing: OutputSharing | None
    ):
        super().__init__(config, suffix_opener(cache, metrics, sharing), metrics)
        self.cache, self.sharing = cache, sharing

    async def Learn(
        self, request: proposer_pb2.LearnRequest, context: grpc.aio.ServicerContext
    ) -> proposer_pb2.LearnResponse:
        prompt, output = list(request.prompt_token_ids), list(request.output_token_ids)
        try:
            check_scope("cache_scope", request.cache_scope)
            self._check_context(
                f"prompt_token_ids + output_token_ids: {len(prompt) + len(output)} tokens", len(prompt) + len(output)
            )
            check_ids("prompt_token_ids: token", prompt)
            check_ids("output_token_ids: token", output)
        except StreamRefused as exc:
            await context.abort(exc.code, exc.message)
        if not output:
            return proposer_pb2.LearnResponse()
        tokens = self.cache.learn(request.cache_scope, prompt, output)
        LEARNED.inc()
        publish(self.sharing, request.cache_scope, tokens)
        return proposer_pb2.LearnResponse(learned_tokens=len(tokens))


def build_flags() -> ServiceFlags:
    """The suffix proposer's flags (``specmesh serve suffix --help``)."""
    d = SuffixConfig()
    f = ServiceFlags("specmesh serve suffix", "SpecMesh suffix proposer (learns from every output; SuffixDecoding).")
    add_serving_flags(f, SuffixServerConfig().serving.address)
    f.add("--max-cached-tokens", d.max_cached_tokens, int, "global cache size in tokens, every scope together "
          "(FIFO eviction by request)", minimum=1)  # fmt: skip
    f.add("--min-token-prob", d.min_token_prob, float, "nodes whose estimated probability is lower are not proposed")
    f.add("--max-nodes", d.max_nodes, int, "tree nodes per proposal (the verifier's budget may cut more)", minimum=1)
    f.add("--max-depth", d.max_depth, int, "tree depth per proposal (the verifier's budget may cut more)", minimum=1)
    f.add("--spec-factor", d.spec_factor, float, "depth ≤ spec-factor × match length + spec-offset", minimum=0)
    f.add("--spec-offset", d.spec_offset, int, "see --spec-factor", minimum=0)
    f.add("--min-match", d.min_match, int, "shortest context suffix matched in the indexed cache (tokens; "
          "unindexed buffers match at least 2)", minimum=1)  # fmt: skip
    f.add("--max-match", d.max_match, int, "longest context suffix matched (tokens)", minimum=2)
    f.add("--max-occurrences", d.max_occurrences, int, "occurrences counted per tree", minimum=1)
    f.add("--cache-prompts", d.cache_prompts, boolean, "the global cache also learns prompts, not only outputs")
    f.add("--calibrate", d.calibrate, boolean, "send path probabilities calibrated by the acceptance measured per "
          "node kind (off: raw count ratios)")  # fmt: skip
    f.add("--calibration-prior", d.calibration_prior, float, "pseudo-trials behind each calibration bin's count "
          "ratio", minimum=0)  # fmt: skip
    f.add("--redis-url", "", str, "share finished outputs with the other suffix replicas through this Redis; "
          "empty: learn from this replica's own streams")  # fmt: skip
    f.add("--redis-prefix", ShareConfig("").prefix, str, "key prefix of the shared stream")
    f.add("--redis-max-len", ShareConfig("").max_len, int, "outputs the shared stream keeps", minimum=1)
    f.add("--replica-name", "", str, "this replica's name in the shared stream; empty: a random one")
    return f


def parse_args(argv: list[str] | None = None) -> SuffixServerConfig:
    f = build_flags()
    a = f.parse(argv)
    serving = serving_config(f, a)
    if a.max_match > 12:
        f.error("--max-match: at most 12 (the index resolves 12 tokens)")
    if a.min_match > a.max_match:
        f.error(f"--min-match: at most --max-match ({a.max_match})")
    suffix = SuffixConfig(
        max_depth=a.max_depth,
        max_nodes=a.max_nodes,
        min_token_prob=a.min_token_prob,
        spec_factor=a.spec_factor,
        spec_offset=a.spec_offset,
        min_match=a.min_match,
        max_match=a.max_match,
        max_occurrences=a.max_occurrences,
        max_cached_tokens=a.max_cached_tokens,
        cache_prompts=a.cache_prompts,
        calibrate=a.calibrate,
        calibration_prior=a.calibration_prior,
    )
    share = None
    if a.redis_url:
        share = ShareConfig(a.redis_url, prefix=a.redis_prefix, max_len=a.redis_max_len, replica=a.replica_name)
    return SuffixServerConfig(serving=serving, suffix=suffix, share=share)


def warm_up_compiled() -> None:
    """Compile (or load from numba's cache) every kernel before the port opens, not on a first request."""
    cache = SuffixCache(SuffixConfig(index_every=4, max_cached_tokens=64), background=False)
    for k in range(3):
        cache.ingest("", np.arange(1, 9, dtype=np.int32) + k)
    req = SuffixRequest(cache, "")
    req.extend([1, 2, 3])
    req.extend([4])
    req.propose(4, 4)
    req.close()


async def run(cfg: SuffixServerConfig) -> None:
    t0 = time.perf_counter()
    await asyncio.to_thread(warm_up_compiled)
    log.info("suffix kernels ready in %.1f s", time.perf_counter() - t0)
    metrics = ProposerMetrics("suffix")
    cache = SuffixCache(cfg.suffix)
    CACHED_TOKENS.set_function(lambda: cache.cached_tokens)
    CACHE_BYTES.set_function(cache.nbytes)

    def ingest(scope: str, tokens: np.ndarray) -> None:
        cache.ingest(scope, tokens)
        SHARED.labels("in").inc()

    sharing = OutputSharing(cfg.share, ingest) if cfg.share is not None else None
    config = StreamConfig(proposer="suffix", limits=cfg.serving.limits, vocab_size=0)
    servicer = SuffixService(config, cache, metrics, sharing)
    try:
        await serve_proposer(proposer_server(cfg.serving), servicer, cfg.serving, "suffix")
    finally:
        if sharing is not None:
            sharing.close()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(parse_args(argv)))
