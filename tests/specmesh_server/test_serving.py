"""The shared SIGTERM drain (``serving.serve``): a response stream still open when the grace runs
out is cut with UNAVAILABLE telling its client to retry elsewhere, its servicer cleans up as on a
client's cancel, and the process logs one line for the cut, no traceback. gRPC's own cancel at the
end of ``server.stop``'s grace gave the client "Cancelling all calls" and logged an ERROR
``CancelledError`` traceback per stream, in the verifier and in every proposer alike."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys

import grpc
import pytest

from specmesh.v1 import proposer_pb2, proposer_pb2_grpc
from specmesh_server.serving import RETRY_ELSEWHERE, live_streams, new_server


class Endless(proposer_pb2_grpc.ProposerServiceServicer):
    """One tree per Start, then nothing until the client ends the stream; counts its cleanups."""

    def __init__(self) -> None:
        self.closed = 0

    async def Propose(self, request_iterator, context):
        try:
            async for _ in request_iterator:
                yield proposer_pb2.ProposeResponse(context_length=1)
        finally:
            self.closed += 1


def _start() -> proposer_pb2.ProposeRequest:
    start = proposer_pb2.ProposeStart(prompt_token_ids=[1, 2, 3, 1, 2], budget=proposer_pb2.TreeBudget(max_nodes=4))
    return proposer_pb2.ProposeRequest(start=start)


def test_a_cut_stream_ends_unavailable_after_its_servicer_cleaned_up_and_a_cancel_stays_a_cancel(caplog):
    servicer = Endless()

    async def run() -> tuple[grpc.aio.AioRpcError, int]:
        server = new_server()
        proposer_pb2_grpc.add_ProposerServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        live = live_streams(server)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = proposer_pb2_grpc.ProposerServiceStub(channel)
                left = stub.Propose(timeout=30)  # the client cancels this one: no cut for it
                await left.write(_start())
                await left.read()
                left.cancel()
                while servicer.closed < 1:
                    await asyncio.sleep(0.01)
                call = stub.Propose(timeout=30)
                await call.write(_start())
                await call.read()
                cut = live.cut()
                try:
                    await call.read()
                except grpc.aio.AioRpcError as err:
                    return err, sum(cut.values())
                raise AssertionError("the cut stream went on")
        finally:
            await server.stop(1)

    with caplog.at_level(logging.DEBUG, logger="grpc"):
        err, n = asyncio.run(run())
    assert (err.code(), err.details(), n) == (grpc.StatusCode.UNAVAILABLE, RETRY_ELSEWHERE, 1)
    assert servicer.closed == 2  # each servicer's own cleanup ran, once
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.slow
def test_sigterm_past_the_grace_cuts_an_open_proposer_stream_with_one_line_and_no_traceback(tmp_path):
    from specmesh.deploy import free_port, wait_healthy

    address = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "ngram.log"
    cmd = [sys.executable, "-m", "specmesh", "serve", "ngram", "--address", address, "--grace", "1"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(address, 60, proc)

        async def run() -> grpc.aio.AioRpcError:
            async with grpc.aio.insecure_channel(address) as channel:
                call = proposer_pb2_grpc.ProposerServiceStub(channel).Propose(timeout=30)
                await call.write(_start())
                await call.read()
                proc.send_signal(signal.SIGTERM)  # the verifier never ends this stream
                try:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                except grpc.aio.AioRpcError as err:
                    return err
                raise AssertionError("the stream ended without an error")

        err = asyncio.run(run())
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log_path.read_text(errors="replace")
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAVAILABLE, RETRY_ELSEWHERE), text
    assert "Traceback" not in text and "CancelledError" not in text, text
    assert text.count("drain grace") == 1 and "drain grace of 1 s over: cutting 1 streams" in text, text
