"""The tensor-parallel verifier (``--tensor-parallel-size 2``, two ranks over gloo on the CPU): the
target sharded by heads (SmolLM2-135M's 3 key/value heads split 2 + 1) and MLP features, every
forward driven by rank 0. Greedy output identical to TP=1 and to transformers' ``generate()`` with
no proposer and with the n-gram and suffix proposers (their own processes) at 1 and 8 streams;
sampling through it distributed as the target; a rank killed mid-stream ends every stream
UNAVAILABLE and the verifier exits, and a restarted one serves; degrees it cannot run are refused
at start in one line."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
import torch
from support import (
    assert_greedy_equal,
    assert_second_tokens_chi_square,
    greedy_prompt_ids,
    metric,
    second_token_counts,
    start_verifier,
    stop_process,
    stop_verifier,
    tiny_llama,
)

from specmesh import Client, SamplingParams, SpecDecodeParams
from specmesh.deploy import free_port, wait_healthy
from specmesh_server.tensor_parallel import even_split, kv_split, plan_shard

pytestmark = pytest.mark.slow
TP2 = ("--tensor-parallel-size", "2", "--threads", "1")
TOKENS = 16
PROPOSERS = ("none", "ngram", "suffix")


def test_shards_keep_whole_key_value_groups_and_cover_every_feature():
    cfg = tiny_llama().config  # 6 query / 2 key/value heads, 64 MLP features
    shards = [plan_shard(cfg, r, 2) for r in range(2)]
    assert [s.kv_heads for s in shards] == [(0, 1), (1, 2)]
    assert [s.heads for s in shards] == [(0, 3), (3, 6)]
    assert [s.intermediate for s in shards] == [(0, 32), (32, 64)]
    uneven = kv_split(3, 9, 2)  # SmolLM2-135M's heads on two ranks
    assert [h for _, h in uneven] == [(0, 6), (6, 9)] and even_split(9, 4)[0] == (0, 3)


def _start(tmp, kind: str) -> tuple[str, subprocess.Popen]:
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "specmesh", "serve", kind, "--address", address]
    with (tmp / f"{kind}.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    wait_healthy(address, 120, proc)
    return address, proc


@dataclass
class Verifiers:
    tp2: object  # VerifierProcess: TP=2 with the n-gram and suffix proposers
    tp1: object  # VerifierProcess: TP=1, no proposer (the reference run)
    metrics_port: int  # tp2's /metrics


@pytest.fixture(scope="module")
def verifiers(tmp_path_factory, lm) -> Iterator[Verifiers]:
    tmp = tmp_path_factory.mktemp("tp")
    procs: list[subprocess.Popen] = []
    try:
        ngram, p = _start(tmp, "ngram")
        procs.append(p)
        suffix, p = _start(tmp, "suffix")
        procs.append(p)
        # Every tree verified and waited for: every step with a tree runs the sharded tree forward.
        metrics_port = free_port()
        tp2 = start_verifier(
            tmp, *TP2,
            "--proposer", f"ngram={ngram}",
            "--proposer", f"suffix={suffix}",
            "--spec-gating", "always",
            "--proposer-wait-ms", "200",
            "--metrics-port", str(metrics_port),
        )  # fmt: skip
        procs.append(tp2.proc)  # killed below if TP=1 fails to start (its ranks follow: PDEATHSIG)
        tp1 = start_verifier(tmp)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    procs.remove(tp2.proc)
    yield Verifiers(tp2, tp1, metrics_port)
    stop_verifier(tp2)
    stop_verifier(tp1)
    for p in procs:
        stop_process(p)


@pytest.fixture(scope="module")
def prompts(chat_ids) -> list[list[int]]:
    return greedy_prompt_ids(chat_ids)[::2]  # 10 short workload prompts, two per category


@pytest.fixture(scope="module")
def tp1_greedy(verifiers, prompts) -> list[list[int]]:
    with Client(verifiers.tp1.address) as c, ThreadPoolExecutor(8) as pool:
        outs = pool.map(lambda ids: c.complete(ids, SamplingParams(temperature=0.0, max_tokens=TOKENS)), prompts)
        return [o.token_ids for o in outs]


NEAR_TIES: dict[tuple[str, int], int] = {}  # (proposer, streams) → prompts that needed the near-tie rule


@pytest.mark.parametrize("streams", [1, 8])
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_tp2_is_identical_to_tp1_and_generate(lm, verifiers, prompts, tp1_greedy, hf_greedy, proposer, streams):
    spec = SpecDecodeParams(proposer=proposer)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    with Client(verifiers.tp2.address) as c, ThreadPoolExecutor(streams) as pool:
        outs = list(pool.map(lambda ids: c.complete(ids, params, spec), prompts))
    ties = 0
    for ids, out, tp1 in zip(prompts, outs, tp1_greedy, strict=True):
        want = hf_greedy(ids, TOKENS)
        for reference in (want, tp1):  # a difference is allowed only at a genuine near-tie of the target
            assert_greedy_equal(lm, ids, out.token_ids, reference)
        ties += out.token_ids != want or out.token_ids != tp1
    NEAR_TIES[(proposer, streams)] = ties
    print(f"TP=2 {proposer} at {streams} stream(s): {len(outs) - ties} of {len(outs)} identical, {ties} near-tie(s)")
    if proposer != "none":
        drafted = sum(o.summary.speculation.drafted_tokens for o in outs)
        accepted = sum(o.summary.speculation.accepted_tokens for o in outs)
        assert drafted > 0 and accepted > 0, f"{proposer}: no speculation happened ({drafted} drafted)"
    assert ties <= 2, f"{ties} of {len(outs)} prompts needed the near-tie rule"


def test_sampling_through_tp2_follows_the_target_softmax_chi_square(lm, verifiers):
    """Seeded 2-token requests, the second token decided by verifying an n-gram tree over both
    ranks, against the target's softmax after the first token (as ``test_speculation``'s)."""
    ids = lm.tokenizer.encode("red green blue, red green blue, red green")
    n = 400
    with Client(verifiers.tp2.address) as c:
        pairs, drafted = second_token_counts(c, ids, SpecDecodeParams(proposer="ngram"), n, 1.0)
    assert drafted >= n // 4, f"too few second steps verified a tree ({drafted} drafted tokens)"
    tested = assert_second_tokens_chi_square(lm, ids, pairs, 1.0, "ngram over TP=2")
    assert tested >= n // 3


def test_all_reduce_time_is_measured_per_step(verifiers, lm):
    port = verifiers.metrics_port
    with Client(verifiers.tp2.address) as c:  # decode steps of its own, whichever tests ran before
        c.complete(lm.tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=4, temperature=0.0))
    steps = metric(port, "specmesh_tensor_parallel_all_reduce_seconds_count", phase="decode")
    seconds = metric(port, "specmesh_tensor_parallel_all_reduce_seconds_sum", phase="decode")
    assert steps > 0 and seconds > 0


def _stream_until_error(address: str, ids: list[int], started: threading.Event, out: list) -> None:
    with Client(address) as c:
        try:
            for _ in c.generate(ids, SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)):
                started.set()
            out.append(("finished", time.monotonic()))
        except grpc.RpcError as exc:
            out.append((exc.code(), time.monotonic(), exc.details()))


def test_a_rank_killed_mid_stream_ends_every_stream_unavailable_and_a_restart_serves(tmp_path, lm, chat_ids):
    v = start_verifier(tmp_path, *TP2, "--tensor-parallel-timeout", "20")
    follower = int(re.search(r"spawned ranks' pids: (\d+)", v.log()).group(1))
    ids = chat_ids("Tell me a long story about a lighthouse keeper.")
    results: list = []
    started = [threading.Event() for _ in range(4)]
    threads = [
        threading.Thread(target=_stream_until_error, args=(v.address, ids, s, results), daemon=True) for s in started
    ]
    try:
        for t in threads:
            t.start()
        assert all(s.wait(120) for s in started), f"streams did not start:\n{v.log()[-2000:]}"
        killed = time.monotonic()
        os.kill(follower, signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert len(results) == 4, f"streams still open 30 s after the kill:\n{v.log()[-3000:]}"
        for code, at, *details in results:
            assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
            assert at - killed < 15, f"a stream ended {at - killed:.1f} s after the kill"
        assert v.proc.wait(60) != 0  # the process exits non-zero, for its supervisor to restart it
        log = v.log()
        assert "NOT_SERVING" in log and "exiting for a restart" in log, log[-3000:]
        print(f"rank killed: streams ended UNAVAILABLE after {max(at for _, at, *_ in results) - killed:.2f} s")
    finally:
        stop_verifier(v)
    again = start_verifier(tmp_path, *TP2)
    try:
        with Client(again.address) as c:
            out = c.complete(ids, SamplingParams(temperature=0.0, max_tokens=8))
        assert len(out.token_ids) == 8
    finally:
        stop_verifier(again)


def test_a_hung_rank_ends_every_stream_unavailable_at_the_timeout(tmp_path, chat_ids):
    """A follower stopped (SIGSTOP) mid-stream never answers: rank 0's next collective gives up at
    --tensor-parallel-timeout and the verifier fails its streams and exits, as for a dead rank."""
    v = start_verifier(tmp_path, *TP2, "--tensor-parallel-timeout", "4")
    follower = int(re.search(r"spawned ranks' pids: (\d+)", v.log()).group(1))
    results: list = []
    started = threading.Event()
    ids = chat_ids("Tell me a long story about a lighthouse keeper.")
    t = threading.Thread(target=_stream_until_error, args=(v.address, ids, started, results), daemon=True)
    try:
        t.start()
        assert started.wait(120), v.log()[-2000:]
        stopped = time.monotonic()
        os.kill(follower, signal.SIGSTOP)
        t.join(30)
        assert results and results[0][0] == grpc.StatusCode.UNAVAILABLE, (results, v.log()[-3000:])
        assert 3 < results[0][1] - stopped < 12, f"ended {results[0][1] - stopped:.1f} s after the stop"
        assert v.proc.wait(60) != 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(follower, signal.SIGKILL)
        stop_verifier(v)


def test_ranks_started_by_torchrun_serve_like_spawned_ones(tmp_path, chat_ids, hf_greedy):
    """torchrun starts both ranks (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE): the verifier spawns none, rank
    0 serves, and greedy output equals generate()'s."""
    address = f"127.0.0.1:{free_port()}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "-m", "specmesh", "serve", "verifier", *TP2, "--device", "cpu", "--address", address,
    ]  # fmt: skip
    log_path = tmp_path / "torchrun.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(address, 180, proc)
        assert "spawned ranks' pids: none (launcher-started)" in log_path.read_text()
        ids = chat_ids("Write a haiku about the sea.")
        with Client(address) as c:
            out = c.complete(ids, SamplingParams(temperature=0.0, max_tokens=12))
        assert out.token_ids == hf_greedy(ids, 12)
    finally:
        stop_process(proc)  # torchrun itself exits 1 when sent SIGTERM


def _refusal(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "specmesh", "serve", "verifier", "--device", "cpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_a_degree_over_the_cores_is_refused_in_one_line():
    cores = len(os.sched_getaffinity(0))
    run = _refusal("--tensor-parallel-size", str(cores + 1))
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == [
        f"specmesh serve verifier: --tensor-parallel-size {cores + 1} exceeds the {cores} CPU core(s) this process "
        "may use (one at least per rank)"
    ]


def test_a_degree_over_the_key_value_heads_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "one-kv-head"
    tiny_llama(num_attention_heads=2, num_key_value_heads=1, hidden_size=16).save_pretrained(folder)
    run = _refusal("--model", str(folder), "--tensor-parallel-size", "2")
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == [
        "specmesh serve verifier: --tensor-parallel-size 2 exceeds the model's 1 key/value heads "
        "(a key/value head is never split across ranks)"
    ], run.stderr


@pytest.mark.parametrize("one_host", ["shared memory", "gloo"])
def test_sharded_linears_sum_to_the_whole_model(tmp_path, one_host):
    """Both ranks' shards of a tiny model, run in two processes, all-reducing through shared memory
    or gloo, give the unsharded model's logits (the all-reduce order may differ in the last bits)."""
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS_SCRIPT)
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    env["ONE_HOST"] = "1" if one_host == "shared memory" else ""
    procs = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path)], env={**env, "RANK": str(r)}) for r in range(2)
    ]
    assert [p.wait(120) for p in procs] == [0, 0]
    got, want = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "whole.pt")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


_RANKS_SCRIPT = """
import sys, torch
sys.path.insert(0, TESTS)
from support import tiny_llama
from specmesh_server.tensor_parallel import init_ranks, plan_shard, shard_model
import os
rank = int(os.environ["RANK"])
ranks = init_ranks(rank, 2, torch.device("cpu"), 30.0, "env://", one_host=bool(os.environ["ONE_HOST"]))
assert (ranks.host is not None) == bool(os.environ["ONE_HOST"])
model = tiny_llama(num_attention_heads=6, num_key_value_heads=3)  # 3 key/value heads: split 2 + 1
ids = torch.arange(1, 11)[None]
with torch.inference_mode():
    whole = model(ids).logits
    shard_model(model, plan_shard(model.config, rank, 2), ranks.all_reduce)
    got = model(ids).logits
if rank == 0:
    torch.save(whole, sys.argv[1] + "/whole.pt")
    torch.save(got, sys.argv[1] + "/rank0.pt")
""".replace("TESTS", repr(os.path.dirname(os.path.dirname(__file__))))
