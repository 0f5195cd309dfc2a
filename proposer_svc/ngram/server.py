"""``specmesh serve ngram``: the n-gram (prompt lookup) proposer, one ``Propose`` stream per request.

Per stream the proposer keeps its own index of the context (prompt + every accepted token,
``specmesh_server/ngram.py``) and answers each Start/Advance at once with a tree
(``proposer_svc/core/stream.py`` runs the stream).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from proposer_svc.core.process import ServingConfig, add_serving_flags, proposer_server, serve_proposer, serving_config
from proposer_svc.core.stream import Opener, ProposeStream, StreamConfig, inline
from specmesh_server.flags import ServiceFlags, at_least
from specmesh_server.metrics import ProposerMetrics
from specmesh_server.ngram import NgramConfig, NgramIndex


@dataclass(frozen=True)
class NgramServerConfig:
    serving: ServingConfig = field(default_factory=lambda: ServingConfig("127.0.0.1:50061"))
    ngram: NgramConfig = field(default_factory=NgramConfig)


def ngram_opener(config: NgramConfig, metrics: ProposerMetrics | None = None) -> Opener:
    return inline(lambda start: NgramIndex(config), metrics)


def build_flags() -> ServiceFlags:
    """The n-gram proposer's flags (``specmesh serve ngram --help``)."""
    d = NgramConfig()
    f = ServiceFlags("specmesh serve ngram", "SpecMesh n-gram (prompt lookup) proposer.")
    add_serving_flags(f, NgramServerConfig().serving.address)
    f.add("--min-n", d.min_n, int, "shortest context suffix (n-gram) looked up", minimum=1)
    f.add("--max-n", d.max_n, int, "longest context suffix (n-gram) looked up")
    f.add("--max-nodes", d.max_nodes, int, "tree nodes per proposal when the verifier sets no budget", minimum=1)
    f.add("--max-depth", d.max_depth, int, "tree depth per proposal when the verifier sets no budget", minimum=1)
    return f


def parse_args(argv: list[str] | None = None) -> NgramServerConfig:
    f = build_flags()
    a = f.parse(argv)
    serving = serving_config(f, a)
    at_least(f, "--max-n", a.max_n, a.min_n)
    ngram = NgramConfig(min_n=a.min_n, max_n=a.max_n, max_nodes=a.max_nodes, max_depth=a.max_depth)
    return NgramServerConfig(serving=serving, ngram=ngram)


async def run(cfg: NgramServerConfig) -> None:
    metrics = ProposerMetrics("ngram")
    config = StreamConfig(proposer="ngram", limits=cfg.serving.limits)
    servicer = ProposeStream(config, ngram_opener(cfg.ngram, metrics), metrics)
    await serve_proposer(proposer_server(cfg.serving), servicer, cfg.serving, "ngram")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(parse_args(argv)))
