"""Malformed request bytes on a real in-process server (``new_server``): INVALID_ARGUMENT for
unary and streamed requests, one warning line and no traceback, and the server keeps serving."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from specmesh.v1 import admin_pb2, admin_pb2_grpc, proposer_pb2, proposer_pb2_grpc
from specmesh_server.serving import new_server

SET_POLICY = "/specmesh.v1.AdminService/SetPolicy"
PROPOSE = "/specmesh.v1.ProposerService/Propose"


class Admin(admin_pb2_grpc.AdminServiceServicer):
    async def SetPolicy(self, request, context):
        return admin_pb2.SetPolicyResponse(policy=request.policy)


class Proposer(proposer_pb2_grpc.ProposerServiceServicer):
    def __init__(self) -> None:
        self.seen: list[proposer_pb2.ProposeRequest] = []

    async def Propose(self, request_iterator, context):
        async for msg in request_iterator:
            self.seen.append(msg)
            yield proposer_pb2.ProposeResponse(context_length=len(msg.advance.accepted_token_ids))


def _policy_bytes(proposer: bytes) -> bytes:
    good = admin_pb2.SetPolicyRequest(policy=admin_pb2.SpeculationPolicy(proposer="ab")).SerializeToString()
    return good.replace(b"ab", proposer)


def _advance_bytes(tokens: list[int]) -> bytes:
    msg = proposer_pb2.ProposeRequest(advance=proposer_pb2.ProposeAdvance(accepted_token_ids=tokens))
    return msg.SerializeToString()


async def _exchange(proposer: Proposer) -> dict[str, object]:
    server = new_server()
    admin_pb2_grpc.add_AdminServiceServicer_to_server(Admin(), server)
    proposer_pb2_grpc.add_ProposerServiceServicer_to_server(proposer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out: dict[str, object] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            set_policy = ch.unary_unary(SET_POLICY)  # no serializers: raw bytes both ways
            propose = ch.stream_stream(PROPOSE)
            for name, raw in (
                ("garbage", b"\xff\xff\xff\xff"),
                ("truncated", _policy_bytes(b"ab")[:-1]),
                ("bad_utf8", _policy_bytes(b"\xff\xfe")),
            ):
                try:
                    out[name] = await set_policy(raw, timeout=10)
                except grpc.aio.AioRpcError as err:
                    out[name] = err
            out["good"] = admin_pb2.SetPolicyResponse.FromString(await set_policy(_policy_bytes(b"ab"), timeout=10))
            try:
                out["stream"] = [r async for r in propose(iter([_advance_bytes([1]), b"\xff\xff"]), timeout=10)]
            except grpc.aio.AioRpcError as err:
                out["stream"] = err
    finally:
        await server.stop(None)
    return out


def test_malformed_request_bytes_are_invalid_argument_with_one_warning_and_no_traceback(caplog):
    caplog.set_level(logging.DEBUG)
    proposer = Proposer()
    out = asyncio.run(_exchange(proposer))
    for name in ("garbage", "truncated", "bad_utf8", "stream"):
        err = out[name]
        assert isinstance(err, grpc.aio.AioRpcError), f"{name}: {err!r}"
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {err.code()} {err.details()}"
        assert err.details().startswith("malformed request message"), err.details()
    assert out["good"].policy.proposer == "ab"  # the server keeps serving
    assert [list(m.advance.accepted_token_ids) for m in proposer.seen] == [[1]]  # good messages before still arrive
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR or "Traceback" in r.getMessage()]
    warnings = [r for r in caplog.records if "malformed request message" in r.getMessage()]
    assert len(warnings) == 4 and all(r.levelno == logging.WARNING for r in warnings)


@pytest.mark.parametrize("kind", ["unary_unary", "stream_stream"])
def test_sync_behaviours_are_left_alone(kind):
    from specmesh_server.request_decoding import guarded

    def behave(request, context):
        return request

    make = getattr(grpc, f"{kind}_rpc_method_handler")
    handler = make(behave, request_deserializer=bytes)
    assert guarded(handler, "/m") is handler
