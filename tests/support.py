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


def tiny_llama(**overrides):
    """A 2-layer grouped-query Llama with random weights (seed 0), for runner-level tests without the model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**(cfg | overrides))).eval()


def runner_steps(runner):
    """A ``ModelRunner``'s logits of a prefill, a two-tree verification step (8 tokens), a plain decode
    step (2 rows), and one row's prefill and decode step (1 row)."""
    import torch

    from specmesh_server.model_runner import causal_mask

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 25), generator=gen)
    pos = torch.arange(20)[None].expand(2, 20)
    tree_pos = torch.tensor([[20, 21, 21, 22], [20, 21, 22, 22]])  # two trees, by depth
    tree_mask = causal_mask(torch.arange(20, 24)[None].expand(2, 4), 24)
    tree_mask[0, 2, 21], tree_mask[1, 3, 22] = False, False  # siblings do not see each other
    write = torch.arange(20, 24)[None].expand(2, 4)
    last = torch.full((2, 1), 24)
    with runner.cache.measurement_rows(2, 32) as rows:
        out = [
            runner.logits(runner.forward(rows, ids[:, :20], pos, causal_mask(pos, 20))),
            runner.logits(runner.forward(rows, ids[:, 20:24], tree_pos, tree_mask, write)),
            runner.logits(runner.forward(rows, ids[:, 24:], last, causal_mask(last, 25), last)),
        ]
    with runner.cache.measurement_rows(1, 32) as row:
        out.append(runner.logits(runner.forward(row, ids[:1, :20], pos[:1], causal_mask(pos[:1], 20))))
        out.append(runner.logits(runner.forward(row, ids[:1, 24:], last[:1] - 4, causal_mask(last[:1] - 4, 21))))
    return out


def greedy_prompt_ids(chat_ids) -> list[list[int]]:
    """The ≥ 20 templated workload prompts (4 per category, short) the greedy-equality tests run."""
    texts = workload_prompts(per_category=4, max_chars=600)
    assert len(texts) >= 20
    return [chat_ids(t) for t in texts]


def workload_prompts(per_category: int = 1, max_chars: int = 600, categories: tuple[str, ...] = ()) -> list[str]:
    """First turns of the vendored Spec-Bench-like workload, a few per category, kept short."""
    from specmesh_bench.workload import read_rows

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


def on_cpu(args: tuple[str, ...] | list[str]) -> list[str]:
    """A model-serving process's flags with ``--device cpu`` added unless they name a device: the
    tests compare its outputs with the ``lm`` fixture's, which runs on the CPU in fp32 on a GPU host too.

    >>> on_cpu(["--threads", "2"]), on_cpu(["--device=cuda"]), on_cpu(["--device-accept", "on"])[-2:]
    (['--threads', '2', '--device', 'cpu'], ['--device=cuda'], ['--device', 'cpu'])
    """
    named = any(a == "--device" or a.startswith("--device=") for a in args)
    return list(args) if named else [*args, "--device", "cpu"]


def cpu_only_env() -> dict[str, str]:
    """This process's environment with no GPU visible (``CUDA_VISIBLE_DEVICES=""``): for a command
    (``specmesh bench``) whose own processes pick the default device, compared on the CPU."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def require_cpu_kernels() -> None:
    """Skip the calling test unless the Triton kernels can run on CPU tensors in this process: in
    Triton's interpreter, which a process that sees CUDA leaves off (the CUDA tests and
    ``make gpu-check`` cover the compiled kernels there)."""
    import pytest
    import torch

    from verifier_svc.kernel_paths import kernel_unavailable

    why = kernel_unavailable(torch.device("cpu"))
    if why is not None:
        cuda = " (a process that sees CUDA leaves it off: the CUDA tests cover the compiled kernels)"
        pytest.skip(f"runs the Triton kernels on CPU tensors: {why}{cuda if torch.cuda.is_available() else ''}")


def start_verifier(tmp_path: Path, *args: str, tls=None) -> VerifierProcess:
    """``specmesh serve verifier`` on a free loopback port, on the CPU unless ``args`` name a device
    (``on_cpu``); ``tls`` (``TlsOptions``): how to reach a TLS port."""
    from specmesh.deploy import free_port, wait_healthy

    address = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / f"verifier-{address.rsplit(':', 1)[1]}.log"
    cmd = [sys.executable, "-m", "specmesh", "serve", "verifier", "--address", address, "--threads", "2", *on_cpu(args)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(address, 300, proc, tls=tls)
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


def start_gateway(tmp_path: Path, verifier: str, *args: str, healthy: bool = True, ca=None) -> GatewayProcess:
    """``specmesh serve gateway`` in its own process; returns once it listens (and, with ``healthy``,
    once its /health reports the verifier SERVING). ``ca``: the gateway serves https (``--tls-cert`` in
    ``args``) with a certificate this CA signed."""
    from specmesh.deploy import free_port, wait_http_healthy

    port = free_port()
    scheme = "https" if ca else "http"
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
        wait_http_healthy(f"{scheme}://127.0.0.1:{port}/health", 60, proc, listening=not healthy, ca=ca)
    except (RuntimeError, TimeoutError):
        proc.kill()
        raise AssertionError(f"gateway did not start:\n{log_path.read_text(errors='replace')[-3000:]}") from None
    return GatewayProcess(f"{scheme}://127.0.0.1:{port}/v1", proc, log_path)


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


def chi_square(samples, p) -> tuple[float, int]:
    """Pearson chi-square statistic and degrees of freedom of sampled token ids against
    distribution ``p``: one cell per token expected >= 5 times, the rest pooled into one (none where
    the rest has no mass, e.g. after min-p: then any sample there is an infinite statistic)."""
    import torch

    counts = torch.bincount(samples, minlength=p.numel()).double()
    expected = p.double() * len(samples)
    big = expected >= 5
    rest_obs, rest_exp = counts[~big].sum(), expected[~big].sum()
    if rest_exp == 0:
        if rest_obs > 0:
            return float("inf"), max(int(big.sum()) - 1, 1)
        obs, exp, dof = counts[big], expected[big], int(big.sum()) - 1
    else:
        obs, exp, dof = (
            torch.cat([counts[big], rest_obs[None]]),
            torch.cat([expected[big], rest_exp[None]]),
            int(big.sum()),
        )
    return float(((obs - exp) ** 2 / exp).sum()), dof


def chi_square_critical(dof: int) -> float:
    """The chi-square value exceeded with probability 0.001 (Wilson-Hilferty approximation)."""
    return dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3


def assert_chi_square(samples, p, label: str = "") -> None:
    """Pearson chi-square of sampled token ids against distribution ``p`` (cells with expected < 5
    pooled), at p = 0.001 (Wilson-Hilferty critical value)."""
    chi2, dof = chi_square(samples, p)
    crit = chi_square_critical(dof)
    assert chi2 < crit, f"{label}: chi2 {chi2:.1f} over {dof} dof (critical {crit:.1f})"


def assert_second_tokens_chi_square(lm, ids: list[int], pairs, temperature: float, label: str = "") -> int:
    """The second tokens of sampled (first, second) pairs against the target's softmax after
    ``ids + [first]``, stratified by the first token: every first token drawn at least 20 times is a
    stratum (its own forward), the strata's chi-squares and degrees of freedom add up (independent
    given the first tokens), one test at p = 0.001. Returns the second tokens tested."""
    from collections import Counter

    import torch

    firsts = Counter(a for a, _ in pairs)
    strata = sorted(a for a, n in firsts.items() if n >= 20)
    assert strata, f"{label}: first token too spread for the conditional test"
    with torch.inference_mode():
        logits = lm.model(torch.tensor([[*ids, a] for a in strata])).logits[:, -1].float()
    ps = torch.softmax(logits / temperature, -1)
    chi2, dof, tested = 0.0, 0, 0
    for a, p in zip(strata, ps, strict=True):
        seconds = torch.tensor([b for first, b in pairs if first == a])
        c, d = chi_square(seconds, p)
        chi2, dof, tested = chi2 + c, dof + d, tested + len(seconds)
    crit = chi_square_critical(dof)
    assert chi2 < crit, f"{label}: chi2 {chi2:.1f} over {dof} dof in {len(strata)} strata (critical {crit:.1f})"
    return tested


def accepts_drafts_too_often(tree, probs, u):
    """A wrong acceptance rule, the negative control of the distribution tests: each child is
    accepted with probability min(1, 2 r(x) / q(x)) instead of min(1, r(x) / q(x))."""
    from verifier_svc.acceptance import sample_accept

    u = u.copy()
    u[:, 1:] *= 0.5  # columns 1.. test the children; column 0 (the residual draw) is left alone
    return sample_accept(tree, probs, u)


def forgets_the_residual(tree, probs, u):
    """A wrong acceptance rule, the negative control of the distribution tests: once every root
    child is rejected, the bonus is drawn from p itself instead of the residual max(p - q, 0)."""
    import numpy as np

    from verifier_svc.acceptance import sample_accept

    path, bonus = sample_accept(tree, probs, u)
    if path:
        return path, bonus
    cdf = np.cumsum(probs[0].double().numpy())
    return path, min(int(np.searchsorted(cdf, u[0, 0] * cdf[-1], side="right")), len(cdf) - 1)


def seeded_tree_walks(tree, context: list[int], logits, proposer: str, n: int, output: int = 0, **controls):
    """The verifier's sampled acceptance (temperature 1) of one deterministic ``tree`` after ``context``
    for seeds 0..n-1, on the target's ``logits`` (rows: the root, then each node). Returns the
    target's probabilities per row, every seed's emitted tokens (``sample_accept``) and
    ``emitted(rule, seeds)`` for other rules. The engine's acceptance dispatch (``accept_batch``) is
    checked equal to the walk, draw for draw, on the first 64 seeds. ``controls``: the requests'
    logits controls and min_p, applied as a decode step does (``logits_controls``), the last
    ``output`` tokens of ``context`` being the request's output so far."""
    import torch

    from specmesh_server.tree import depths
    from verifier_svc.acceptance import acceptance_uniforms, sample_accept, walk_shape
    from verifier_svc.batch_accept import accept_batch, target_probs
    from verifier_svc.logits_controls import process_logits
    from verifier_svc.requests import GenerationRequest, SpecParams

    depth = max(depths(tree.parents))
    spec = SpecParams(proposer, num_speculative_tokens=depth, max_tree_nodes=len(tree), workload_tag="", corpus="")
    sampled = dict(temperature=1.0, top_p=1.0, top_k=0, max_tokens=8, stop=(), ignore_eos=True, spec_params=spec)
    prompt = context[: len(context) - output]
    reqs = [GenerationRequest(str(s), prompt, seed=s, **sampled, **controls) for s in range(64)]
    logits = process_logits(logits.clone(), reqs[:1], [context[len(prompt) :]], [tree], {2})
    probs = target_probs(logits, reqs[:1], [len(logits)]).double()  # the same for every seed
    u = acceptance_uniforms(torch.arange(n), torch.full((n,), len(context)), *walk_shape(tree)).numpy()

    def emitted(rule, seeds: int) -> list[list[int]]:
        walks = (rule(tree, probs, u[s]) for s in range(seeds))
        return [[tree.tokens[j] for j in path] + [bonus] for path, bonus in walks]

    out = emitted(sample_accept, n)
    k = len(reqs)
    batch = accept_batch(reqs, [len(context)] * k, [tree] * k, logits.repeat(k, 1), [len(logits)] * k)
    assert [[tree.tokens[j] for j in path] + [bonus] for path, bonus in batch] == out[:k]
    return probs, out, emitted


def assert_wrong_rules_fail(probs, out, emitted, control: int = 2_000) -> None:
    """The negative controls: on ``control`` seeds the right rule passes the first token's test,
    and rules that accept drafts too often or forget the residual fail it."""
    import pytest
    import torch

    assert_chi_square(torch.tensor([e[0] for e in out[:control]]), probs[0], "the right rule, control size")
    for rule in (accepts_drafts_too_often, forgets_the_residual):
        with pytest.raises(AssertionError, match="chi2"):
            assert_chi_square(torch.tensor([e[0] for e in emitted(rule, control)]), probs[0], rule.__name__)


def assert_walks_follow(paths, probs, out, emitted, want) -> None:
    """The tree-walk checks of the distribution tests: for each row (``paths[i]``: its node's path, the
    root's empty), its probabilities equal ``want(i, path)`` (float64 [V]) within 1e-6; the token
    emitted after the node, among walks that accepted its path, follows them (chi-square, nodes
    reached by ≥ 1,000 walks; the root's and a depth-1 node's at least); and the wrong rules fail."""
    from collections import Counter

    import torch

    tested = Counter()
    for index, path in enumerate(paths):
        expected = want(index, path)
        torch.testing.assert_close(probs[index], expected, rtol=0, atol=1e-6)
        sample = torch.tensor([e[len(path)] for e in out if len(e) > len(path) and e[: len(path)] == path])
        if len(sample) >= 1_000:
            assert_chi_square(sample, expected, f"token after {path} ({len(sample)} walks)")
            tested[len(path)] += 1
    assert set(tested) >= {0, 1}, dict(tested)
    assert_wrong_rules_fail(probs, out, emitted)


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


def metric(port: int, name: str, **labels: str) -> float:
    """The sum of a metric's samples on a service's /metrics whose labels include ``labels`` (0: none)."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if (
            m
            and m.group(1) == name
            and labels.items() <= dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")).items()
        ):
            total += float(m.group(3))
    return total


def first_token_tv(n: int, stochastic: bool, device: str = "cpu", vocab: int = 8) -> tuple[float, float, list[tuple]]:
    """The sampled-acceptance convergence test: (TV distance of the first emitted token's empirical
    distribution to the target p over ``n`` seeded walks of one tree, the TV of the nearest of 20 unrelated
    distributions, each walk's (path, bonus)). The tree has 3 root children, then 1–3 children each; all
    ``n`` walks run as the requests of a single kernel launch. Shared by tests/kernels and ``make gpu-check``."""
    import random

    import torch

    from specmesh_kernels.tree_accept import PackedTrees, tree_accept_kernel_launch, unpack_result
    from specmesh_server.tree import TokenTree
    from verifier_svc.acceptance import acceptance_uniforms

    gen = torch.Generator().manual_seed(4)
    parents = [-1, -1, -1, 0, 0, 1, 2, 2, 2]
    p = torch.rand(len(parents) + 1, vocab, generator=gen, dtype=torch.float64) ** 2
    p = p / p.sum(-1, keepdim=True)  # [nodes + 1, V] target rows
    q = torch.rand(len(parents), vocab, generator=gen, dtype=torch.float64) ** 2
    q = q / q.sum(-1, keepdim=True)  # each node's proposal distribution
    rng = random.Random(4)
    trees = []
    for _ in range(n):
        if stochastic:  # every node drawn from its own q, as a stochastic proposer does
            tokens = [rng.choices(range(vocab), weights=q[i].tolist())[0] for i in range(len(parents))]
            dists = [(list(range(vocab)), q[i].tolist()) for i in range(len(parents))]
            trees.append(TokenTree(tokens, parents, dists))
        else:
            trees.append(TokenTree([1, 3, 5, 0, 2, 4, 6, 7, 1], parents))
    probs = p.float().repeat(n, 1).to(device)
    greedy = torch.zeros(n, dtype=torch.bool, device=device)
    seeds, positions = torch.arange(n, device=device), torch.full((n,), 7, device=device)
    packed = PackedTrees.from_lists(
        [t.tokens for t in trees], [t.parents for t in trees], [t.dists for t in trees], device=device
    )
    u = acceptance_uniforms(seeds, positions, len(parents) + 1, len(parents) + 1)
    results = unpack_result(tree_accept_kernel_launch(probs, probs.argmax(-1), packed, greedy, u).cpu())
    counts = torch.zeros(vocab, dtype=torch.float64)
    for tree, (path, bonus) in zip(trees, results, strict=True):
        counts[tree.tokens[path[0]] if path else bonus] += 1
    tv = 0.5 * float((counts / n - p[0].float().double()).abs().sum())
    other = torch.Generator().manual_seed(99)
    unrelated = min(
        0.5 * float((d / d.sum() - p[0]).abs().sum())
        for d in (torch.rand(vocab, generator=other, dtype=torch.float64) ** 2 for _ in range(20))
    )
    return tv, unrelated, results


MAX_N = 10  # the shared n-gram gateway's --max-n (tests/gateway_svc/conftest.py): 10 choices a request


def langchain_chat(gateway, max_tokens: int):
    """LangChain's ChatOpenAI on ``gateway``, greedy."""
    import langchain_openai
    import openai

    model = openai.OpenAI(base_url=gateway.url, api_key="unused").models.list().data[0].id
    return langchain_openai.ChatOpenAI(
        base_url=gateway.url, api_key="unused", model=model, temperature=0, max_tokens=max_tokens, max_retries=0,
        timeout=300,
    )  # fmt: skip


def tree_path(tree, node: int) -> list[int]:
    """The tokens from the root to ``node`` of a ``TokenTree`` (its ancestors, then itself)."""
    out = []
    while node >= 0:
        out.append(tree.tokens[node])
        node = tree.parents[node]
    return out[::-1]
