"""The engine's observer (``engine_observer``): without metrics every call is ignored (and touches no
request); with them each event lands in its ``/metrics`` series."""

import pytest
from prometheus_client import CollectorRegistry

from specmesh_server.metrics import VerifierMetrics
from verifier_svc.engine_observer import EngineObserver, MetricsObserver, observer_for
from verifier_svc.requests import GenerationRequest, SpecParams
from verifier_svc.sequence import Sequence


def _seq(prompt: list[int], output: list[int] = ()) -> Sequence:
    req = GenerationRequest("r", prompt, 0.0, 1.0, 0, 1, 64, (), False, SpecParams("none", 0, 0, "", ""))
    return Sequence(key=0, req=req, sink=print, detok=None, stopper=None, arrival=10.0, output=list(output))


def _every_event(observer: EngineObserver, seq: Sequence) -> None:
    observer.step_started(3)
    observer.preempted(seq)
    observer.joined(seq, first=True)
    observer.step("prefill", 0.5, 40, 2)
    observer.first_token(seq)
    observer.grammar_step(0.01, 2)
    observer.streamed(seq, 4)
    observer.finished(seq, 12.0)


def test_without_metrics_the_observer_ignores_every_event():
    observer = observer_for(None)
    assert type(observer) is EngineObserver
    seq = _seq([1, 2, 3])
    _every_event(observer, seq)
    assert seq.last_chunk is None  # the inter-token clock runs only for metrics


def test_with_metrics_each_event_lands_in_its_series():
    registry = CollectorRegistry()
    observer = observer_for(VerifierMetrics(registry, model="m"))
    assert isinstance(observer, MetricsObserver)
    value = lambda name, **labels: registry.get_sample_value(name, {"model": "m", **labels})  # noqa: E731
    seq = _seq([1, 2, 3, 4], [7, 8])  # a returning request: 5 tokens to cache
    seq.length, seq.prefill_start, seq.first_token = 4, 10.25, 11.0
    _every_event(observer, seq)
    observer.step_started(5)  # evictions are counted as they grow
    observer.step("decode", 0.1, 8, 2, "eager")
    assert value("specmesh_kv_cache_evictions_total") == 5
    assert value("specmesh_preemptions_total") == 1
    assert value("specmesh_prefix_cache_queries_total") == 5 and value("specmesh_prefix_cache_hits_total") == 4
    assert value("specmesh_request_queue_time_seconds_sum") == pytest.approx(0.25)
    assert value("specmesh_time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert value("specmesh_grammar_pruned_nodes_total") == 2
    assert value("specmesh_generated_tokens_total") == 4
    assert value("specmesh_requests_total", status="ok") == 1
    assert value("specmesh_e2e_request_latency_seconds_sum") == pytest.approx(2.0)


def test_a_request_joining_again_is_not_counted_as_queued_twice_and_chunks_give_gaps_from_the_second():
    registry = CollectorRegistry()
    observer = MetricsObserver(VerifierMetrics(registry, model="m"))
    value = lambda name: registry.get_sample_value(name, {"model": "m"})  # noqa: E731
    seq = _seq([1, 2])
    seq.prefill_start = 11.0
    observer.joined(seq, first=True)
    observer.joined(seq, first=False)
    assert value("specmesh_request_queue_time_seconds_count") == 1
    assert value("specmesh_prefix_cache_queries_total") == 4
    observer.streamed(seq, 1)
    assert seq.last_chunk is not None and value("specmesh_inter_token_latency_seconds_count") == 0
    observer.streamed(seq, 2)
    assert value("specmesh_inter_token_latency_seconds_count") == 1
