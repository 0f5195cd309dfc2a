"""Helpers the tests share (not fixtures): real prompts, real verifier processes, the
losslessness and distribution checks. Test modules import them with ``from support import …``
(a name of its own: every conftest.py is imported as "conftest", so importing from it is
ambiguous once several directories have one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "workloads" / "specbench_offline_dev.jsonl"


def workload_prompts(per_category: int = 1, max_chars: int = 600, categories: tuple[str, ...] = ()) -> list[str]:
    """First turns of the vendored Spec-Bench-like workload, a few per category, kept short."""
    from specmesh.bench.workload import read_rows

    rows = read_rows(WORKLOAD)
    picked: dict[str, list[str]] = {}
    for row in rows:
        if categories and row["category"] not in categories:
            continue
        turn = row["turns"][0]
        if len(turn) <= max_chars and len(picked.setdefault(row["category"], [])) < per_category:
            picked[row["category"]].append(turn)
    return [p for prompts in picked.values() for p in prompts]


@dataclass
class VerifierProcess:
    address: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_verifier(tmp_path: Path, *args: str) -> VerifierProcess:
    from specmesh.deploy import free_port, wait_healthy

    address = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / f"verifier-{address.rsplit(':', 1)[1]}.log"
    cmd = [sys.executable, "-m", "specmesh", "serve", "verifier", "--address", address, "--threads", "2", *args]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(address, 300, proc)
    except Exception:
        proc.kill()
        raise AssertionError(f"verifier did not start:\n{log_path.read_text(errors='replace')[-3000:]}") from None
    return VerifierProcess(address, proc, log_path)


def stop_verifier(v: VerifierProcess) -> None:
    if v.proc.poll() is None:
        v.proc.terminate()
        try:
            v.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            v.proc.kill()


@dataclass
class GatewayProcess:
    url: str  # http://127.0.0.1:PORT/v1
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_gateway(tmp_path: Path, verifier: str, *args: str, healthy: bool = True) -> GatewayProcess:
    """``specmesh serve gateway`` in its own process; returns once it listens (and, with ``healthy``,
    once its /health reports the verifier SERVING)."""
    from specmesh.deploy import free_port, wait_http_healthy

    port = free_port()
    log_path = tmp_path / f"gateway-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "specmesh",
        "serve",
        "gateway",
        "--address",
        f"127.0.0.1:{port}",
        "--verifier",
        verifier,
        *args,
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_http_healthy(f"http://127.0.0.1:{port}/health", 60, proc, listening=not healthy)
    except (RuntimeError, TimeoutError):
        proc.kill()
        raise AssertionError(f"gateway did not start:\n{log_path.read_text(errors='replace')[-3000:]}") from None
    return GatewayProcess(f"http://127.0.0.1:{port}/v1", proc, log_path)


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def assert_greedy_equal(lm, prompt_ids: list[int], got: list[int], want: list[int]) -> None:
    """Token-identical, or the first difference is a genuine near-tie of the target.

    Batched fp32 arithmetic may flip a tie; the top-2 logit margin at the first difference must
    then be below 1e-4 of the logit scale. Anything else is a bug.
    """
    import torch

    if got == want:
        return
    n = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    assert n < min(len(got), len(want)), f"length differs without a token difference: {len(got)} vs {len(want)}"
    with torch.inference_mode():
        logits = lm.model(torch.tensor([prompt_ids + want[:n]])).logits[0, -1].float()
    top2 = torch.topk(logits, 2).values
    margin = float(top2[0] - top2[1])
    scale = float(logits.abs().max())
    assert margin < 1e-4 * scale, (
        f"greedy mismatch at token {n}: got {got[n]}, want {want[n]}, top-2 margin {margin:.3g} (scale {scale:.3g})"
    )


def second_token_counts(client, ids: list[int], spec, n: int, temperature: float) -> tuple[list[tuple[int, ...]], int]:
    """Sample 2 tokens n times (seeds 0..n-1); the second is decided by a verification step (with a
    tree when speculation is on). Returns the token pairs and the drafted tokens in all."""
    from concurrent.futures import ThreadPoolExecutor

    from specmesh import SamplingParams

    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=2, ignore_eos=True) for s in range(n)]
    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda p: client.complete(ids, p, spec), params))
    return [tuple(o.token_ids) for o in outs], sum(o.summary.speculation.drafted_tokens for o in outs)


def assert_chi_square(samples, p, label: str = "") -> None:
    """Pearson chi-square of sampled token ids against distribution ``p`` (cells with expected < 5
    pooled), at p = 0.001 (Wilson-Hilferty critical value)."""
    import torch

    counts = torch.bincount(samples, minlength=p.numel()).double()
    expected = p.double() * len(samples)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    dof = int(big.sum())
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2 < crit, f"{label}: chi2 {chi2:.1f} over {dof} dof (critical {crit:.1f})"


def start_redis(port: int) -> subprocess.Popen:
    """A throwaway, non-persistent redis-server on ``port``; returns once it answers PING."""
    import pytest
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not on PATH")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return proc
        except redis.exceptions.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"redis-server on port {port} did not start") from None
            time.sleep(0.05)
        finally:
            client.close()


def stop_redis(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


@asynccontextmanager
async def served_proposer(servicer) -> AsyncIterator:
    """``servicer`` as a ProposerService on a loopback port of this event loop; yields a stub to it."""
    import grpc

    from specmesh.v1 import proposer_pb2_grpc

    server = grpc.aio.server()
    proposer_pb2_grpc.add_ProposerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield proposer_pb2_grpc.ProposerServiceStub(channel)
    finally:
        await server.stop(None)
