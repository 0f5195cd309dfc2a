"""The n-gram proposer service as its own process does not trust its callers: a huge prompt or
an absurd tree budget is refused naming the limit, and a well-behaved stream on the same
service keeps getting its trees meanwhile."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import pytest

from specmesh.deploy import free_port, wait_healthy
from specmesh.v1 import proposer_pb2, proposer_pb2_grpc


def start(prompt: list[int], nodes: int = 16, depth: int = 8) -> proposer_pb2.ProposeRequest:
    budget = proposer_pb2.TreeBudget(max_nodes=nodes, max_depth=depth)
    return proposer_pb2.ProposeRequest(start=proposer_pb2.ProposeStart(prompt_token_ids=prompt, budget=budget))


def advance(tokens: list[int]) -> proposer_pb2.ProposeRequest:
    return proposer_pb2.ProposeRequest(advance=proposer_pb2.ProposeAdvance(accepted_token_ids=tokens))


@pytest.fixture(scope="module")
def ngram():
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "specmesh", "serve", "ngram", "--address", address],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_healthy(address, 60, proc)
    yield address
    proc.kill()
    proc.wait(10)


async def refusal(stub, msg: proposer_pb2.ProposeRequest) -> grpc.aio.AioRpcError | None:
    try:
        async for _ in stub.Propose(iter([msg]), timeout=60):
            pass
    except grpc.aio.AioRpcError as err:
        return err
    return None


@pytest.mark.slow
def test_hostile_starts_are_refused_naming_the_limit_while_another_stream_keeps_getting_trees(ngram):
    huge = [i % 1000 for i in range(1_000_000)]  # ~2 MB on the wire, within gRPC's 4 MB message limit

    async def run():
        async with grpc.aio.insecure_channel(ngram) as channel:
            stub = proposer_pb2_grpc.ProposerServiceStub(channel)
            polite = stub.Propose(timeout=60)
            await polite.write(start([1, 2, 3, 1, 2]))
            await polite.read()
            hostile = asyncio.ensure_future(
                asyncio.gather(
                    refusal(stub, start(huge, nodes=10**9, depth=10**9)), refusal(stub, start([1, 2], 10**9))
                )
            )
            round_trips = []
            while not hostile.done() or len(round_trips) < 5:
                t0 = time.monotonic()
                await polite.write(advance([(len(round_trips) + 2) % 3 + 1]))  # 3 1 2 3 …: the cycle goes on
                reply = await polite.read()
                round_trips.append(time.monotonic() - t0)
                assert reply.tree.tokens  # the cycle keeps matching
            await polite.done_writing()
            return await hostile, round_trips

    (too_long, too_wide), round_trips = asyncio.run(run())
    assert too_long is not None and too_long.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, too_long
    assert "start.prompt_token_ids: 1000000 tokens" in too_long.details()
    assert "limit of 131072 (--max-stream-tokens)" in too_long.details()
    assert too_wide is not None and too_wide.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, too_wide
    assert "max_nodes: 1000000000, over the ngram proposer's limit of 1024 (--max-budget-nodes)" in too_wide.details()
    assert max(round_trips) < 0.5, f"the well-behaved stream waited {max(round_trips):.1f} s for a tree"
