"""Finished outputs reach the proposer tiers that learn from them (``verifier_svc/learning.py``),
over real gRPC servers on loopback: a suffix tier learns what it did not follow, a tier that learns
nothing (n-gram) is asked once, a followed tier is never sent the output again, and a dead tier
costs nothing but a counted error."""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client import CollectorRegistry

from proposer_svc.core.stream import SERVING_LIMITS, ProposeStream, StreamConfig
from proposer_svc.ngram.server import ngram_opener
from proposer_svc.suffix.cache import SuffixCache
from proposer_svc.suffix.config import SuffixConfig
from proposer_svc.suffix.request import SuffixRequest
from proposer_svc.suffix.server import SuffixService
from specmesh.deploy import free_port
from specmesh.v1 import proposer_pb2_grpc
from specmesh_server.metrics import ProposerMetrics, VerifierMetrics
from specmesh_server.ngram import NgramConfig
from verifier_svc.learning import LearnConfig, OutputLearning
from verifier_svc.requests import GenerationRequest, SpecParams
from verifier_svc.sessions import ProposerTiers


def request(rid: str, prompt: list[int], proposer: str, scope: str) -> GenerationRequest:
    spec = SpecParams(proposer, 0, 0, "", "", scope)
    return GenerationRequest(rid, prompt, max_tokens=16, temperature=0.0, top_p=1.0, top_k=0, seed=0, stop=(),
                             ignore_eos=False, spec_params=spec)  # fmt: skip


def calls(metrics: VerifierMetrics, proposer: str, outcome: str) -> float:
    value = metrics.learn_calls.labels(proposer, outcome, metrics.model)._value.get()
    return float(value)


async def until(check, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


async def scenario() -> None:
    cache = SuffixCache(SuffixConfig(), background=False)
    suffix_metrics = ProposerMetrics("suffix", CollectorRegistry())
    services = {
        "suffix": SuffixService(StreamConfig("suffix", SERVING_LIMITS), cache, suffix_metrics, None),
        "ngram": ProposeStream(StreamConfig("ngram", SERVING_LIMITS), ngram_opener(NgramConfig())),
    }
    servers, channels, stubs = [], [], {}
    for name, servicer in services.items():
        server = grpc.aio.server()
        proposer_pb2_grpc.add_ProposerServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
        stubs[name] = proposer_pb2_grpc.ProposerServiceStub(channels[-1])
    channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}"))  # nobody listens
    stubs["dead"] = proposer_pb2_grpc.ProposerServiceStub(channels[-1])
    metrics = VerifierMetrics(CollectorRegistry(), model="m", proposers=stubs)
    tiers = ProposerTiers(stubs, local=("ngram-local",))
    learning = OutputLearning(LearnConfig(timeout_s=2.0), tiers, "m", asyncio.get_running_loop(), metrics)
    try:
        prompt, output = [501, 502, 503], [600 + i for i in range(12)]
        # Served by the in-process n-gram: the suffix tier learns it; the n-gram tier answers
        # UNIMPLEMENTED (and is not asked again); the dead tier fails.
        learning.finished(request("a", prompt, "ngram-local", "tenant-a"), output, ("ngram-local",))
        await until(lambda: calls(metrics, "suffix", "ok") == 1, "suffix never learnt the n-gram request's output")
        await until(lambda: calls(metrics, "dead", "error") == 1, "the dead tier's failure was not counted")
        await until(lambda: calls(metrics, "ngram", "unimplemented") == 1, "n-gram's UNIMPLEMENTED was not counted")
        assert learning.not_learning == {"ngram"}

        asked = SuffixRequest(cache, "tenant-a")
        asked.extend([999, *output[:3]])
        tree = asked.propose(16, 8)
        assert tree.source == "global" and tree.tokens == output[3 : 3 + len(tree.tokens)] and len(tree.tokens) >= 4
        other = SuffixRequest(cache, "tenant-b")
        other.extend([999, *output[:3]])
        assert not other.propose(16, 8).tokens  # learnt for its own scope only

        # Served with no proposer: learnt too; n-gram is not asked again.
        learning.finished(request("b", [7, 8], "none", "tenant-a"), [40, 41, 42], ())
        await until(lambda: calls(metrics, "suffix", "ok") == 2, "a plain request's output was not learnt")
        await until(lambda: calls(metrics, "dead", "error") == 2, "the dead tier was not tried again")
        await asyncio.sleep(0.1)
        assert calls(metrics, "ngram", "unimplemented") == 1 and not calls(metrics, "ngram", "ok")

        # Followed by the suffix tier itself: it learnt from its stream; not sent twice.
        cached = cache.cached_tokens
        learning.finished(request("c", [7, 8], "suffix", "tenant-a"), [50, 51, 52], ("suffix",))
        await until(lambda: calls(metrics, "dead", "error") == 3, "the dead tier was not tried")
        assert calls(metrics, "suffix", "ok") == 2 and cache.cached_tokens == cached

        # Followed by the n-gram tier: not sent to it. Nothing generated: sent nowhere.
        learning.finished(request("d", [7, 8], "ngram", "tenant-a"), [60, 61], ("ngram",))
        await until(lambda: calls(metrics, "suffix", "ok") == 3, "suffix never learnt the n-gram tier's request")
        learning.finished(request("e", [7, 8], "none", "tenant-a"), [], ())
        await asyncio.sleep(0.2)
        assert calls(metrics, "dead", "error") == 4 and calls(metrics, "suffix", "ok") == 3
        assert calls(metrics, "ngram", "unimplemented") == 1
    finally:
        for ch in channels:
            await ch.close()
        for server in servers:
            await server.stop(None)


def test_outputs_reach_the_tiers_that_did_not_follow_them_and_a_tier_that_learns_nothing_is_asked_once():
    asyncio.run(scenario())


async def overflow() -> None:
    server = grpc.aio.server()

    class Slow(proposer_pb2_grpc.ProposerServiceServicer):
        async def Learn(self, request, context):
            await asyncio.sleep(0.5)
            return await super().Learn(request, context)

    proposer_pb2_grpc.add_ProposerServiceServicer_to_server(Slow(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stubs = {"slow": proposer_pb2_grpc.ProposerServiceStub(channel)}
    metrics = VerifierMetrics(CollectorRegistry(), model="m", proposers=stubs)
    learning = OutputLearning(
        LearnConfig(max_in_flight=2), ProposerTiers(stubs), "m", asyncio.get_running_loop(), metrics
    )
    try:
        for i in range(5):
            learning.finished(request(str(i), [1, 2], "none", ""), [3, 4], ())
        await until(lambda: calls(metrics, "slow", "dropped") == 3, "outputs beyond max_in_flight were not dropped")
        await until(lambda: calls(metrics, "slow", "unimplemented") == 2, "the calls in flight did not finish")
    finally:
        await channel.close()
        await server.stop(None)


def test_outputs_beyond_the_calls_in_flight_are_dropped_and_counted_not_queued():
    asyncio.run(overflow())
