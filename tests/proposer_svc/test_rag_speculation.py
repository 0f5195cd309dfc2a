"""Speculative decoding with the rag proposer through the real services: a corpus built (via the
CLI) from the passages of the dev workload's rag prompts makes the verifier accept drafted
tokens on rag prompts, and the output stays identical to plain greedy decoding."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import WORKLOAD, assert_greedy_equal, start_verifier, stop_verifier

from specmesh import Client, SamplingParams, SpecDecodeParams
from specmesh_bench.workload import rag_passages as passages

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def rag_rows() -> list[dict]:
    rows = [json.loads(x) for x in WORKLOAD.read_text().splitlines() if x.strip()]
    return [r for r in rows if r["category"] == "rag"]


def test_passages_are_parsed_from_every_rag_prompt():
    rows = rag_rows()
    assert len(rows) == 40
    for row in rows:
        found = passages(row["turns"][0])
        assert len(found) == 5 and all(text for _, text in found)
        assert row["gold_doc"] in {src for src, _ in found}


@pytest.fixture(scope="module")
def rag_verifier(tmp_path_factory, lm):
    from test_rag_server import cli, start_rag, stop

    files_dir = tmp_path_factory.mktemp("passages")
    files = {}
    for row in rag_rows():
        for source, text in passages(row["turns"][0]):
            digest = hashlib.sha256(text.encode()).hexdigest()[:12]
            path = files_dir / f"{source.replace('/', '_')}-{digest}.txt"
            files[path] = text
    for path, text in files.items():
        path.write_text(text)
    address, rag = start_rag(tmp_path_factory.mktemp("rag-data"))
    out = cli("ingest", *map(str, sorted(files)), "--corpus", "pydocs", "--target", address)
    assert out.returncode == 0, out.stderr
    # the test asserts the proposer served every step: a proposer starved by a loaded machine must not time out
    v = start_verifier(
        tmp_path_factory.mktemp("rag-spec"),
        "--proposer", f"rag={address}",
        "--spec-gating", "always",
        "--proposer-timeout", "60",
    )  # fmt: skip
    yield v
    stop_verifier(v)
    stop(rag)


def test_greedy_with_rag_proposer_is_token_identical_and_accepts_tokens_on_rag_prompts(
    lm, chat_ids, hf_greedy, rag_verifier
):
    prompts = sorted((r["turns"][0] for r in rag_rows()), key=len)[:1]  # the shortest (667 tokens) keeps it cheap
    spec = SpecDecodeParams(proposer="rag", corpus="pydocs")
    drafted = accepted = 0
    with Client(rag_verifier.address) as c:
        for text in prompts:
            ids = chat_ids(text)
            out = c.complete(ids, SamplingParams(temperature=0.0, max_tokens=40), spec)
            assert_greedy_equal(lm, ids, out.token_ids, hf_greedy(ids, 40))
            m = out.summary.speculation
            assert not m.fallback_reason, m.fallback_reason
            assert m.per_proposer["rag"].drafted_tokens == m.drafted_tokens
            drafted += m.drafted_tokens
            accepted += m.accepted_tokens
    print(f"rag proposer: drafted {drafted}, accepted {accepted}")
    assert drafted > 0 and accepted > 0


def test_an_unknown_corpus_named_by_the_client_is_invalid_argument_and_auto_skips_rag_without_corpus(
    chat_ids, rag_verifier
):
    import grpc

    ids = chat_ids("What is a suffix array?")
    with Client(rag_verifier.address) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.complete(ids, SamplingParams(temperature=0.0, max_tokens=4), SpecDecodeParams("rag", corpus="nope"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "nope" in err.value.details()
        out = c.complete(ids, SamplingParams(temperature=0.0, max_tokens=4), SpecDecodeParams("auto"))
        assert out.token_ids and "rag" not in out.summary.speculation.per_proposer


def test_cli_entry_point_prints_usage(tmp_path):
    out = subprocess.run([sys.executable, "-m", "specmesh", "rag", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "ingest" in out.stdout and "list" in out.stdout
