"""The head proposer through real processes: a head trained in seconds (``specmesh head train``)
served by ``specmesh serve head`` to a verifier that sends it the target's hidden states.

Proves: greedy output token-identical to plain decoding at batch 1 and 8; sampled second tokens
distributed as the target on the head's sampled trees; a head trained for another target is
refused (the service does not start; a verifier with another tokenizer gets FAILED_PRECONDITION);
the hidden-state rows in every Advance equal the target's own final hidden states (fp16); and the
verifier copies them to the host once per step for the whole batch, not once per request.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from support import (
    VerifierProcess,
    assert_greedy_equal,
    assert_second_tokens_chi_square,
    greedy_prompt_ids,
    metric,
    second_token_counts,
    start_verifier,
    stop_verifier,
)

from proposer_svc.core.stream import ProposeStream, StreamConfig
from specmesh import Client, SamplingParams, SpecDecodeParams
from specmesh.deploy import free_port, wait_healthy
from specmesh.v1 import proposer_pb2, proposer_pb2_grpc

pytestmark = pytest.mark.slow
GREEDY_TOKENS = 16


@dataclass
class HeadService:
    address: str
    proc: subprocess.Popen
    log_path: Path


def specmesh(*args: str) -> list[str]:
    return [sys.executable, "-m", "specmesh", *args]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory) -> Path:
    """A head trained for ~20 s on 8 prompts (no generated answers): a real head, not a good one."""
    out = tmp_path_factory.mktemp("head") / "head"
    train = ["head", "train", "--minutes", "0.3", "--max-prompts", "8", "--generate-fraction", "0"]
    done = subprocess.run(
        specmesh(*train, "--batch", "256", "--out", str(out)), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads((out / "head.json").read_text())["training"]
    assert report["steps"] > 0 and len(report["heldout_top1_agreement_by_depth"]) == 4
    assert set(report["draft_vocab_coverage"]) >= {"1024", "8192"}
    return out


def start_head(tmp: Path, head: Path, *args: str) -> HeadService:
    address = f"127.0.0.1:{free_port()}"
    log_path = tmp / f"head-{address.rsplit(':', 1)[1]}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            specmesh("serve", "head", "--address", address, "--head", str(head), *args),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        wait_healthy(address, 120, proc)
    except Exception:
        proc.kill()
        raise AssertionError(f"head did not start:\n{log_path.read_text(errors='replace')[-3000:]}") from None
    return HeadService(address, proc, log_path)


@dataclass
class Deployment:
    verifier: VerifierProcess
    head: HeadService
    recorder: Recorder
    metrics_port: int


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, head_dir, lm) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("headsvc")
    head = start_head(tmp, head_dir)
    recorder = Recorder()
    port = free_port()
    try:
        v = start_verifier(
            tmp,
            "--proposer", f"head={head.address}",
            "--proposer", f"recorder={recorder.address}",
            "--spec-gating", "always",
            "--proposer-wait-ms", "200",
            "--proposer-timeout", "60",  # no fallback asserted: a proposer a loaded machine starves must not time out
            "--metrics-port", str(port),
        )  # fmt: skip
    except BaseException:
        head.proc.kill()
        recorder.stop()
        raise
    yield Deployment(v, head, recorder, port)
    stop_verifier(v)
    head.proc.kill()
    head.proc.wait(10)
    recorder.stop()


def complete(d: Deployment, ids: list[int], proposer: str, n: int = GREEDY_TOKENS):
    with Client(d.verifier.address) as client:
        out = client.complete(ids, SamplingParams(temperature=0.0, max_tokens=n), SpecDecodeParams(proposer))
    assert out.summary.finish_reason in ("length", "eos")
    assert not out.summary.speculation.fallback_reason, out.summary.speculation.fallback_reason
    return out


@pytest.fixture(scope="module")
def prompts(chat_ids) -> list[list[int]]:
    return greedy_prompt_ids(chat_ids)


@pytest.fixture(scope="module")
def plain(deployment, prompts) -> dict[tuple[int, ...], list[int]]:
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda ids: complete(deployment, ids, "none"), prompts))
    return {tuple(ids): out.token_ids for ids, out in zip(prompts, outs, strict=True)}


# ---------------------------------------------------------------------------------------------
# Lossless: greedy and sampled.


def test_greedy_with_the_head_is_token_identical_to_plain_decoding_at_batch_one(deployment, prompts, plain, lm):
    drafted = accepted = 0
    for ids in prompts:
        out = complete(deployment, ids, "head")
        assert_greedy_equal(lm, ids, out.token_ids, plain[tuple(ids)])
        drafted += out.summary.speculation.drafted_tokens
        accepted += out.summary.speculation.accepted_tokens
    assert drafted > 0, "the head never proposed: the check is vacuous"
    print(f"head, batch 1: {accepted}/{drafted} drafted tokens accepted")


def test_greedy_with_the_head_is_token_identical_with_eight_concurrent_requests(deployment, prompts, plain, lm):
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda ids: complete(deployment, ids, "head"), prompts))
    for ids, out in zip(prompts, outs, strict=True):
        assert_greedy_equal(lm, ids, out.token_ids, plain[tuple(ids)])
    assert sum(o.summary.speculation.drafted_tokens for o in outs) > 0


def test_sampled_second_tokens_verified_on_head_trees_follow_the_target_softmax_chi_square(deployment, lm, chat_ids):
    """Seeded 2-token requests: the second token is decided by verifying the head's sampled tree
    (drawn from its truncated softmax, each node sent with its distribution), stratified by the
    first; tested against the target's softmax after it (p = 0.001)."""
    n = 200
    ids = chat_ids("Name a colour of the rainbow.")
    with Client(deployment.verifier.address) as c:
        pairs, drafted = second_token_counts(c, ids, SpecDecodeParams("head"), n, 1.0)
    assert drafted >= n // 2, f"too few second steps verified a head tree ({drafted} drafted tokens)"
    tested = assert_second_tokens_chi_square(lm, ids, pairs, 1.0, "head")
    assert tested >= n // 3, f"first token too spread ({tested} of {n} tested)"


# ---------------------------------------------------------------------------------------------
# Another target's head is refused.


def test_a_head_trained_for_another_target_is_refused(tmp_path, head_dir, deployment):
    other = tmp_path / "other"
    shutil.copytree(head_dir, other)
    meta = json.loads((other / "head.json").read_text())
    meta["arch"]["tokenizer_hash"] = "0123456789abcdef"
    (other / "head.json").write_text(json.dumps(meta))
    address = f"127.0.0.1:{free_port()}"
    done = subprocess.run(
        specmesh("serve", "head", "--address", address, "--head", str(other)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "trained for target" in done.stderr and "0123456789abcdef" in done.stderr

    async def propose_as_another_target() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(deployment.head.address) as channel:
            stub = proposer_pb2_grpc.ProposerServiceStub(channel)
            start = proposer_pb2.ProposeStart(
                request_id="x",
                prompt_token_ids=[1, 2, 3],
                vocab=proposer_pb2.VocabIdentity(vocab_size=49152, tokenizer_hash="0123456789abcdef"),
            )
            call = stub.Propose(iter([proposer_pb2.ProposeRequest(start=start)]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            return err.value

    err = asyncio.run(propose_as_another_target())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "tokenizer hash" in err.details()


# ---------------------------------------------------------------------------------------------
# The hidden states on the wire.


class RecordingCore:
    """A proposer core that asks for fp16 hidden states and records every Advance (no trees)."""

    def __init__(self, log: list) -> None:
        self.log, self.pending, self.context = log, None, 0

    def start(self, prompt, budget):
        self.log.append(("start", list(prompt), None))
        self.context = len(prompt)
        want = proposer_pb2.HiddenStateRequest(dtype=proposer_pb2.HIDDEN_DTYPE_FLOAT16)
        return proposer_pb2.ProposeResponse(context_length=len(prompt), hidden_states=want)

    def take_states(self, states, tokens):
        from specmesh_server.hidden import decode

        self.pending = decode(states, tokens, states.hidden_size)

    def advance(self, tokens, budget):
        states, self.pending = self.pending, None
        self.log.append(("advance", list(tokens), states))
        self.context += len(tokens)
        return proposer_pb2.ProposeResponse(context_length=self.context)  # an empty tree: no wait

    def close(self):
        pass


class Recorder:
    """``RecordingCore`` streams served from a thread of this test process."""

    def __init__(self) -> None:
        self.streams: list[list] = []
        ready = threading.Event()
        self.port = 0

        def open_core(start, deliver):
            log: list = []
            self.streams.append(log)
            return RecordingCore(log)

        async def serve() -> None:
            server = grpc.aio.server()
            proposer_pb2_grpc.add_ProposerServiceServicer_to_server(
                ProposeStream(StreamConfig(proposer="recorder"), open_core), server
            )
            self.port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self._stop = asyncio.Event()
            ready.set()
            await self._stop.wait()
            await server.stop(None)

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(serve(),), daemon=True)
        self.thread.start()
        assert ready.wait(30)
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)


def test_the_hidden_states_in_each_advance_are_the_targets_own_final_states(deployment, lm, chat_ids):
    """Row i of an Advance is the state that predicted its token i: the target's final hidden
    state (after its last norm) at the position before that token, as transformers computes it."""
    import torch

    ids = chat_ids("Explain what a hash table is.")
    before = len(deployment.recorder.streams)
    out = complete(deployment, ids, "recorder", 24)
    log = deployment.recorder.streams[before]
    assert log[0][:2] == ("start", ids)
    advances = [(toks, states) for kind, toks, states in log if kind == "advance"]
    advanced = [t for toks, _ in advances for t in toks]  # the last step's tokens end the request instead
    assert advanced == out.token_ids[: len(advanced)] and len(advanced) >= len(out.token_ids) // 2
    assert all(states is not None and len(states) == len(toks) for toks, states in advances)
    sequence = ids + advanced
    with torch.inference_mode():
        want = lm.model.get_decoder()(input_ids=torch.tensor([sequence])).last_hidden_state[0].float()  # [T, H]
    got = torch.cat([states for _, states in advances])  # [n, H]
    # The state that predicted sequence[j] sits at position j - 1.
    torch.testing.assert_close(got, want[len(ids) - 1 : len(sequence) - 1], rtol=1e-2, atol=2e-2)


def test_the_verifier_copies_hidden_states_to_the_host_once_per_step_not_once_per_request(
    deployment, prompts, chat_ids
):
    port, name = deployment.metrics_port, "specmesh_hidden_state_copies_total"
    copies0, rows0 = metric(port, name), metric(port, "specmesh_hidden_state_rows_total")
    forwards0 = metric(port, "specmesh_step_seconds_count")
    before = len(deployment.recorder.streams)
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda ids: complete(deployment, ids, "recorder", 12), prompts[:8]))
    logs = deployment.recorder.streams[before:]
    with_states = sum(1 for log in logs for kind, _, states in log if kind == "advance" and states is not None)
    copies = metric(port, name) - copies0
    forwards = metric(port, "specmesh_step_seconds_count") - forwards0
    assert with_states >= sum(len(o.token_ids) > 0 for o in outs)
    assert 0 < copies <= forwards  # at most one per forward …
    assert copies < with_states / 2  # … shared by the batch: far fewer than one per request and step
    assert metric(port, "specmesh_hidden_state_rows_total") - rows0 >= sum(len(o.token_ids) for o in outs)
