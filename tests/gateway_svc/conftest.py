"""One n-gram verifier and one gateway on loopback for the gateway's client tests (structured outputs,
tools, LangChain): started once for the session, which saves a model load per module. ``oai`` and
``model`` serve any module that defines ``gateway`` (its own, or this one)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from support import (
    MAX_N,
    GatewayProcess,
    VerifierProcess,
    start_gateway,
    start_verifier,
    stop_process,
    stop_verifier,
)


@pytest.fixture(scope="session")
def ngram_verifier(tmp_path_factory, lm) -> Iterator[VerifierProcess]:
    v = start_verifier(tmp_path_factory.mktemp("ngram-verifier"), "--proposer", "ngram=inprocess:ngram")
    yield v
    stop_verifier(v)


@pytest.fixture(scope="session")
def ngram_gateway(tmp_path_factory, ngram_verifier) -> Iterator[GatewayProcess]:
    g = start_gateway(tmp_path_factory.mktemp("ngram-gateway"), ngram_verifier.address, "--max-n", str(MAX_N))
    yield g
    stop_process(g.proc)


@pytest.fixture(scope="module")
def oai(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id
