"""The suffix proposer service as its own process (no model): streams with token ids it cannot
index or an unusable ``cache_scope`` are refused with INVALID_ARGUMENT while other streams keep
getting trees; an output enters its scope's global cache and never another scope's; ``--help``
documents every flag with its default."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from support import metric

from proposer_svc.suffix.index import MAX_VOCAB
from specmesh.deploy import free_port, wait_healthy
from specmesh.v1 import proposer_pb2, proposer_pb2_grpc

pytestmark = pytest.mark.slow


@dataclass
class Suffix:
    address: str
    metrics_port: int


@pytest.fixture(scope="module")
def suffix(tmp_path_factory) -> Iterator[Suffix]:
    address, metrics = f"127.0.0.1:{free_port()}", free_port()
    log_path = tmp_path_factory.mktemp("suffix") / "suffix.log"
    cmd = [sys.executable, "-m", "specmesh", "serve", "suffix", "--address", address, "--metrics-port", str(metrics)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(address, 120, proc)
    except Exception:
        proc.kill()
        raise AssertionError(f"suffix did not start:\n{log_path.read_text(errors='replace')[-3000:]}") from None
    yield Suffix(address, metrics)
    proc.kill()
    proc.wait(10)


def eventually(check, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def start(prompt: list[int], scope: str = "", nodes: int = 16, depth: int = 8) -> proposer_pb2.ProposeRequest:
    budget = proposer_pb2.TreeBudget(max_nodes=nodes, max_depth=depth)
    return proposer_pb2.ProposeRequest(
        start=proposer_pb2.ProposeStart(prompt_token_ids=prompt, budget=budget, cache_scope=scope)
    )


def advance(tokens: list[int]) -> proposer_pb2.ProposeRequest:
    return proposer_pb2.ProposeRequest(advance=proposer_pb2.ProposeAdvance(accepted_token_ids=tokens))


async def exchange(address: str, *msgs: proposer_pb2.ProposeRequest) -> list[proposer_pb2.ProposeResponse]:
    """One stream: each message followed by its reply; the stream then ends (its output is cached)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = proposer_pb2_grpc.ProposerServiceStub(channel).Propose(timeout=30)
        replies = []
        for msg in msgs:
            await call.write(msg)
            replies.append(await call.read())
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        return replies


def refused(address: str, *msgs: proposer_pb2.ProposeRequest) -> grpc.aio.AioRpcError:
    try:
        asyncio.run(exchange(address, *msgs))
    except grpc.aio.AioRpcError as err:
        return err
    raise AssertionError("the stream was not refused")


def trees(port: int) -> dict[str, float]:
    return {s: metric(port, "specmesh_suffix_trees_total", source=s) for s in ("request", "global", "request+global")}


def settled(port: int) -> None:
    """Every stream closed (its trees counted, its output cached)."""
    eventually(lambda: not metric(port, "specmesh_proposer_open_sessions", proposer="suffix"), "a stream stayed open")


def test_out_of_range_token_ids_and_bad_cache_scopes_are_refused_as_invalid_argument(suffix):
    rejected = metric(suffix.metrics_port, "specmesh_proposer_sessions_total", proposer="suffix", outcome="rejected")
    cases = [
        ((start([1, 2, MAX_VOCAB]),), f"token id {MAX_VOCAB} outside [0, {MAX_VOCAB})"),
        ((start([-1, 2, 3]),), "token id -1 outside"),
        ((start([1, 2, 3]), advance([4, 2**31 - 1])), f"token id {2**31 - 1} outside"),  # after a good start
        ((start([1, 2, 3], scope="s" * 129),), "start.cache_scope: must be printable and at most 128 characters"),
        ((start([1, 2, 3], scope="tenant\nb"),), "start.cache_scope: must be printable"),
    ]
    for msgs, message in cases:
        err = refused(suffix.address, *msgs)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (message, err)
        assert message in err.details(), err.details()
    # The boundary scope is fine, and the service still answers every well-formed stream.
    replies = asyncio.run(exchange(suffix.address, start([5, 6, 7, 5, 6], scope="s" * 128), advance([7])))
    assert list(replies[-1].tree.tokens[:2]) == [5, 6] and replies[-1].context_length == 6
    eventually(  # counted as the stream ends, just after the client saw the refusal
        lambda: (
            metric(suffix.metrics_port, "specmesh_proposer_sessions_total", proposer="suffix", outcome="rejected")
            == rejected + len(cases)
        ),
        "refused streams not counted as rejected",
    )


def test_an_output_is_proposed_to_later_requests_of_its_scope_and_never_to_another_scope(suffix):
    port, base = suffix.metrics_port, 1000
    prompt, output = [base + 1, base + 2, base + 3], [base + 10 + i for i in range(12)]
    asyncio.run(exchange(suffix.address, start(prompt, scope="y"), advance(output[:1]), advance(output[1:])))
    settled(port)
    before = trees(port)
    assert metric(port, "specmesh_suffix_cached_tokens") >= len(output)

    asked = [base + 99, *output[:3]]  # a new request that has just generated the output's first tokens
    (in_x,) = asyncio.run(exchange(suffix.address, start(asked, scope="x")))
    settled(port)
    assert not in_x.tree.tokens  # its own context has no match and scope x learned nothing
    assert trees(port) == before
    (in_y,) = asyncio.run(exchange(suffix.address, start(asked, scope="y")))
    settled(port)
    assert list(in_y.tree.tokens) == output[3 : 3 + len(in_y.tree.tokens)] and len(in_y.tree.tokens) >= 4
    assert list(in_y.tree.parents) == [-1, *range(len(in_y.tree.tokens) - 1)]  # one past output: a chain
    assert list(in_y.tree.path_probs) == [1.0] * len(in_y.tree.tokens)
    assert trees(port)["global"] == before["global"] + 1
    # The prompt is not learned (only outputs, without --cache-prompts).
    (prompt_only,) = asyncio.run(exchange(suffix.address, start([base + 98, *prompt[:2]], scope="y")))
    assert not prompt_only.tree.tokens


async def learn(address: str, **fields) -> proposer_pb2.LearnResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await proposer_pb2_grpc.ProposerServiceStub(channel).Learn(
            proposer_pb2.LearnRequest(**fields), timeout=30
        )


def test_learn_takes_an_output_it_did_not_follow_into_its_scope_and_refuses_bad_input(suffix):
    port, base = suffix.metrics_port, 2000
    prompt, output = [base + 1, base + 2, base + 3], [base + 10 + i for i in range(12)]
    cases = [
        ({"output_token_ids": [1, MAX_VOCAB]}, f"output_token_ids: token id {MAX_VOCAB} outside"),
        ({"prompt_token_ids": [-1], "output_token_ids": [1, 2]}, "prompt_token_ids: token id -1 outside"),
        ({"cache_scope": "tenant\nb", "output_token_ids": [1, 2]}, "cache_scope: must be printable"),
    ]
    learned = metric(port, "specmesh_suffix_learned_outputs_total")
    for fields, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(learn(suffix.address, **fields))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details(), err.value
    with pytest.raises(grpc.aio.AioRpcError) as err:  # past --max-stream-tokens, as a stream would be
        asyncio.run(learn(suffix.address, output_token_ids=[7] * 131_073))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    assert metric(port, "specmesh_suffix_learned_outputs_total") == learned  # refusals learn nothing

    reply = asyncio.run(learn(suffix.address, cache_scope="learnt", prompt_token_ids=prompt, output_token_ids=output))
    assert reply.learned_tokens == len(output)  # the output only: no --cache-prompts
    assert metric(port, "specmesh_suffix_learned_outputs_total") == learned + 1
    asked = [base + 99, *output[:3]]
    (other,) = asyncio.run(exchange(suffix.address, start(asked, scope="elsewhere")))
    assert not other.tree.tokens
    (same,) = asyncio.run(exchange(suffix.address, start(asked, scope="learnt")))
    assert list(same.tree.tokens) == output[3 : 3 + len(same.tree.tokens)] and len(same.tree.tokens) >= 4
    settled(port)


def _option_blocks(help_text: str) -> dict[str, str]:
    """``--flag`` → its help paragraph, whitespace collapsed."""
    blocks, current = {}, None
    for line in help_text.split("options:", 1)[1].splitlines():
        m = re.match(r"\s{2}(-\S+)", line)
        if m:
            current = m.group(1).split(",")[-1].strip()
            blocks[current] = ""
        if current:
            blocks[current] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in blocks.items()}


def test_serve_suffix_help_lists_the_flags_with_their_defaults():
    out = subprocess.run(
        [sys.executable, "-m", "specmesh", "serve", "suffix", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    blocks = _option_blocks(out.stdout)
    defaults = {
        "--address": "127.0.0.1:50064",
        "--metrics-port": "0",
        "--max-cached-tokens": "1000000",
        "--min-token-prob": "0.05",
        "--max-nodes": "32",
        "--max-depth": "24",
        "--min-match": "1",
        "--max-match": "12",
        "--max-occurrences": "64",
        "--cache-prompts": "False",
        "--calibrate": "True",
        "--calibration-prior": "2.0",
        "--redis-url": "",
        "--redis-prefix": "specmesh:suffix",
        "--redis-max-len": "100000",
    }
    for flag, default in defaults.items():
        assert flag in blocks, f"{flag} missing from --help"
        assert blocks[flag].endswith(f"(default: {default})"), f"{flag}: {blocks[flag]}"
    assert "FIFO eviction" in blocks["--max-cached-tokens"]
    assert "empty: learn from this replica's own streams" in blocks["--redis-url"]
