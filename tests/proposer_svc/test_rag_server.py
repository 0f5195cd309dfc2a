"""The rag proposer as its own process: corpora ingested through the CLI, Propose streams that
return the corpus's continuations as trees, clear statuses for bad corpora and bad files,
persistence across a restart, and streams answered while an ingest re-indexes."""

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from specmesh.deploy import free_port, wait_healthy
from specmesh.v1 import proposer_pb2, proposer_pb2_grpc, rag_pb2, rag_pb2_grpc

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ROOT / "workloads" / "specbench_offline_dev.jsonl"

DOC_A = (
    "The suffix array of a text lists the starting positions of all its suffixes in lexicographic order. "
    "Binary search over it finds every occurrence of a pattern in logarithmic time.\n"
)
DOC_B = "Speculative decoding drafts several tokens cheaply and verifies them with one forward pass of the target.\n"


def start_rag(data_dir: Path, *args: str) -> tuple[str, subprocess.Popen]:
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "specmesh", "serve", "rag", "--address", address, "--data-dir", str(data_dir), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(address, 120, proc)
    except Exception:
        proc.kill()
        raise
    return address, proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specmesh", "rag", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from specmesh_server.model_loading import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path())


@dataclass
class RagProcess:
    """The module's rag server; the restart test replaces it with the restarted one."""

    address: str
    proc: subprocess.Popen
    data: Path


@pytest.fixture(scope="module")
def rag(tmp_path_factory):
    data = tmp_path_factory.mktemp("rag-data")
    files = tmp_path_factory.mktemp("rag-files")
    (files / "a.txt").write_text(DOC_A)
    (files / "b.txt").write_text(DOC_B)
    server = RagProcess(*start_rag(data), data)
    out = cli("ingest", str(files / "a.txt"), str(files / "b.txt"), "--corpus", "algo", "--target", server.address)
    assert out.returncode == 0, out.stderr
    assert "corpus algo: +2 documents" in out.stdout
    yield server
    stop(server.proc)


def _start(prompt: list[int], corpus: str = "algo", tokenizer_hash: str = "", nodes: int = 8, depth: int = 6):
    return proposer_pb2.ProposeRequest(
        start=proposer_pb2.ProposeStart(
            request_id="t",
            prompt_token_ids=prompt,
            budget=proposer_pb2.TreeBudget(max_nodes=nodes, max_depth=depth),
            vocab=proposer_pb2.VocabIdentity(vocab_size=49152, tokenizer_hash=tokenizer_hash),
            corpus=corpus,
        )
    )


def _advance(tokens: list[int]) -> proposer_pb2.ProposeRequest:
    return proposer_pb2.ProposeRequest(advance=proposer_pb2.ProposeAdvance(accepted_token_ids=tokens))


def _first_chain(tree: proposer_pb2.TokenTree) -> list[int]:
    """Tokens along the path that always takes a node's first child (the heaviest branch)."""
    out, node = [], -1
    for i, p in enumerate(tree.parents):
        if p == node:
            out.append(tree.tokens[i])
            node = i
    return out


def test_cli_lists_the_ingested_corpus_with_the_target_tokenizer(rag, tokenizer):
    from specmesh_server.model_loading import tokenizer_hash

    out = cli("list", "--target", rag.address)
    assert out.returncode == 0, out.stderr
    assert f"tokenizer {tokenizer_hash(tokenizer)}" in out.stdout
    n_tokens = len(tokenizer(DOC_A, add_special_tokens=False).input_ids + tokenizer(DOC_B).input_ids)
    assert any(line.split()[:3] == ["algo", "2", str(n_tokens)] for line in out.stdout.splitlines()), out.stdout


def test_propose_stream_proposes_the_corpus_continuation_and_follows_advances(rag, tokenizer):
    from specmesh_server.model_loading import tokenizer_hash

    doc = tokenizer(DOC_A, add_special_tokens=False).input_ids
    prompt = tokenizer("Tell me: ", add_special_tokens=False).input_ids + doc[:12]
    with grpc.insecure_channel(rag.address) as ch:
        stub = proposer_pb2_grpc.ProposerServiceStub(ch)
        q = [_start(prompt, tokenizer_hash=tokenizer_hash(tokenizer)), _advance(doc[12:15]), _advance([7, 7])]
        replies = list(stub.Propose(iter(q), timeout=30))
    assert [r.context_length for r in replies] == [len(prompt), len(prompt) + 3, len(prompt) + 5]
    assert _first_chain(replies[0].tree) == doc[12:18]  # depth budget 6
    assert all(-1 <= p < i for i, p in enumerate(replies[0].tree.parents)) and len(replies[0].tree.tokens) <= 8
    assert _first_chain(replies[1].tree) == doc[15:21]
    assert list(replies[2].tree.tokens) == []  # "… 7 7" occurs nowhere: nothing proposed


def test_unknown_or_missing_corpus_and_foreign_tokenizer_abort_the_stream_clearly(rag):
    with grpc.insecure_channel(rag.address) as ch:
        stub = proposer_pb2_grpc.ProposerServiceStub(ch)
        cases = [  # "known: algo" and, once the re-index test ran, ", dev"
            (_start([1, 2], corpus="nope"), grpc.StatusCode.INVALID_ARGUMENT, "unknown corpus 'nope' (known: algo"),
            (_start([1, 2], corpus=""), grpc.StatusCode.INVALID_ARGUMENT, "needs a corpus name"),
            (_start([1, 2], tokenizer_hash="0123abcd"), grpc.StatusCode.FAILED_PRECONDITION, "the verifier's is 0123"),
        ]
        for msg, code, text in cases:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Propose(iter([msg]), timeout=30))
            assert err.value.code() == code and text in err.value.details()


def test_bad_files_fail_the_ingest_naming_the_file_and_leave_the_corpus_intact(rag, tmp_path):
    address = rag.address
    before = cli("list", "--target", address).stdout
    (tmp_path / "good.txt").write_text("fine text\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (tmp_path / "latin1.txt").write_bytes("naïve café".encode("latin-1"))
    for bad, why in (("empty.txt", "empty"), ("image.png", "binary data"), ("latin1.txt", "not UTF-8")):
        out = cli("ingest", str(tmp_path / "good.txt"), str(tmp_path / bad), "--corpus", "algo", "--target", address)
        assert out.returncode != 0
        assert "INVALID_ARGUMENT" in out.stderr and f"{tmp_path / bad}" in out.stderr and why in out.stderr
    bad_name = cli("ingest", str(tmp_path / "good.txt"), "--corpus", "no/slash", "--target", address)
    assert bad_name.returncode != 0 and "INVALID_ARGUMENT" in bad_name.stderr
    assert cli("list", "--target", address).stdout == before


def test_propose_streams_are_answered_while_an_ingest_reindexes(rag, tokenizer, tmp_path):
    from proposer_svc.rag.cli import ingest_requests

    address = rag.address
    files = []
    rows = [json.loads(x) for x in WORKLOAD.read_text().splitlines() if x.strip()]
    for copy in range(3):  # ~1 M tokens: the ingest lasts long enough to overlap many round trips
        for i, row in enumerate(rows):
            files.append(tmp_path / f"{copy}-{i:03d}.txt")
            files[-1].write_text("\n\n".join([*row["turns"], row.get("reference") or "", f"(copy {copy})"]))
    doc = tokenizer(DOC_B, add_special_tokens=False).input_ids
    latencies: list[float] = []
    ingest_done = threading.Event()
    with grpc.insecure_channel(address) as ch:
        fut = rag_pb2_grpc.RagServiceStub(ch).Ingest.future(ingest_requests("dev", files, [], False), timeout=300)
        fut.add_done_callback(lambda _: ingest_done.set())
        proposer = proposer_pb2_grpc.ProposerServiceStub(ch)
        t_start = time.perf_counter()
        while not ingest_done.is_set():  # a fresh stream per round trip: Start → tree
            t0 = time.perf_counter()
            [reply] = list(proposer.Propose(iter([_start(doc[:10])]), timeout=30))
            latencies.append(time.perf_counter() - t0)
            assert _first_chain(reply.tree) == doc[10:16]
        ingest_s = time.perf_counter() - t_start
        resp = fut.result()
    assert resp.corpus.name == "dev" and resp.documents_added == len(files) and resp.tokens_added > 300_000
    assert len(latencies) >= 20, (ingest_s, len(latencies))  # the streams really ran during the ingest
    print(f"ingest {ingest_s:.1f} s, {len(latencies)} round trips, max {max(latencies) * 1e3:.0f} ms")
    assert max(latencies) < 0.5, f"a Propose round trip took {max(latencies):.2f} s during the ingest"


def test_ingest_rpc_refuses_malformed_streams(rag):
    with grpc.insecure_channel(rag.address) as ch:
        stub = rag_pb2_grpc.RagServiceStub(ch)
        chunk = rag_pb2.IngestRequest(chunk=rag_pb2.DocumentChunk(document="x", data=b"text"))
        start = rag_pb2.IngestRequest(start=rag_pb2.IngestStart(corpus="algo"))
        other = rag_pb2.IngestRequest(chunk=rag_pb2.DocumentChunk(document="y", data=b"more"))
        for msgs, text in (
            ([chunk], "chunk before start"),
            ([start], "at least one document"),
            ([start, chunk, other, chunk], "document 'x': sent twice"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.Ingest(iter(msgs), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in err.value.details()


def test_corpora_are_reloaded_after_a_restart(rag, tokenizer):
    stop(rag.proc)
    rag.address, rag.proc = start_rag(rag.data)  # the module's other tests go on with the restarted server
    out = cli("list", "--target", rag.address)
    assert out.returncode == 0 and "algo" in out.stdout
    doc = tokenizer(DOC_A, add_special_tokens=False).input_ids
    with grpc.insecure_channel(rag.address) as ch:
        [reply] = list(proposer_pb2_grpc.ProposerServiceStub(ch).Propose(iter([_start(doc[:20])]), timeout=30))
    assert _first_chain(reply.tree) == doc[20:26]
    entries = sorted(os.listdir(rag.data / "algo"))  # the pointer and the one live version, nothing else
    assert len(entries) == 2 and entries[0] == "CURRENT" and entries[1].startswith("v-")
