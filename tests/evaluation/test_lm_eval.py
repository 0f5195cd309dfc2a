"""lm-evaluation-harness through SpecMesh scores what its own ``hf`` backend scores on the same model.

Real processes on loopback: a verifier (the default model, SmolLM2-135M-Instruct, on the CPU in fp32,
n-gram speculation on, every tree verified) and the OpenAI-compatible gateway in front of it.
``lm-eval run`` is run twice in subprocesses, as a user would, over two tasks this folder ships (local
YAML over JSONL questions written for this test; the harness cannot download datasets here, nor
tokenizers: offline):

- ``specmesh_mc``: multiple choice (30 questions × 4 choices: 120 loglikelihood requests; acc, acc_norm);
- ``specmesh_gen``: ``generate_until`` (16 short questions after 3 worked examples; greedy, stops at a
  newline, 16 tokens at most; exact_match). The answers restate the question ("The capital of Germany
  is Berlin."): n-gram drafts from the prompt are accepted, so the generations run through speculation.

Once with ``--model local-completions`` against the gateway's ``/v1/completions`` (the model's local
tokenizer, token-id prompts: ``tokenized_requests=True``, its default), once with ``--model hf`` on
the model's local HF folder (float32, ``--device cpu``). What it shows:

- the task scores (acc, acc_norm, exact_match) are equal;
- every loglikelihood the harness read from SpecMesh equals the ``hf`` backend's, sample by sample and
  choice by choice, within 1e-4, with the same is_greedy; the generated texts are identical;
- a few of them equal transformers' own, computed here from scratch: the sum of log_softmax over
  the continuation's tokens given the context, tokenized as the harness does;
- the gateway answered every request with 200 (none refused and retried), and drafted tokens were accepted.

Measured (2 CPU cores, lm-eval 0.4.13): acc 0.70, acc_norm 0.60, exact_match 0.75 both ways; the
largest loglikelihood difference from the ``hf`` backend 3.4e-5, from transformers' own 2e-5; 756
tokens drafted, 35 accepted; the module in about 1 minute (each lm-eval run 15–30 s; much longer when
other work shares the cores).

What ``local-completions`` (lm-eval 0.4.13) sends and reads, the contract this relies on: for a
loglikelihood, one ``POST /v1/completions`` per (context, continuation) pair with ``prompt`` a list
holding one list of token ids (context + continuation), ``echo: true``, ``logprobs: 1``,
``max_tokens: 1`` (not 0), ``temperature: 0``, ``seed: 1234``; it sums
``choices[i].logprobs.token_logprobs[ctxlen:-1]`` (the prompt's logprobs from the continuation's
first token on, the one generated token dropped: the response must hold exactly one logprob per
prompt token, then the generated one) and calls a continuation greedy when each of its tokens'
logprob equals ``max(top_logprobs[k].values())`` (a dict per position, the top-1 at least). For
``generate_until``: token-id prompts, ``max_tokens`` (max_gen_toks), ``temperature: 0``, ``stop``
(the task's ``until`` plus the tokenizer's EOS string ``<|im_end|>``), ``seed``; it reads
``choices[i].text``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support import start_gateway, start_verifier, stop_process, stop_verifier

pytestmark = pytest.mark.slow
TASKS = Path(__file__).resolve().parent
TASK_NAMES = ("specmesh_mc", "specmesh_gen")
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def verifier(tmp_path_factory, lm):
    v = start_verifier(
        tmp_path_factory.mktemp("verifier"), "--proposer", "ngram=inprocess:ngram", "--spec-gating", "always"
    )
    yield v
    stop_verifier(v)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, verifier):
    g = start_gateway(tmp_path_factory.mktemp("gateway"), verifier.address)
    yield g
    stop_process(g.proc)


def run_lm_eval(out: Path, model: str, model_args: str) -> tuple[dict, dict[str, list[dict]]]:
    """``lm-eval run`` over this folder's tasks, offline; returns its results and logged samples by task.

    It runs in this folder: ``datasets`` resolves the YAMLs' relative ``data_files`` against the
    working directory."""
    cmd = [
        *(sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args),
        *("--tasks", ",".join(TASK_NAMES), "--include_path", str(TASKS), "--batch_size", "1", "--device", "cpu"),
        *("--log_samples", "--output_path", str(out)),
    ]
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(out / "datasets-cache"),
        "TOKENIZERS_PARALLELISM": "false",
        "CUDA_VISIBLE_DEVICES": "",
    }
    log = out / "lm-eval.log"
    out.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as f:
        proc = subprocess.run(cmd, cwd=TASKS, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=400, check=False)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"lm-eval --model {model} failed ({proc.returncode}):\n{text[-4000:]}"
    (results_file,) = out.rglob("results_*.json")
    samples = {}
    for task in TASK_NAMES:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    return json.loads(results_file.read_text())["results"], samples


@pytest.fixture(scope="module")
def through_specmesh(tmp_path_factory, gateway, lm):
    served = httpx.get(f"{gateway.url}/models").json()["data"][0]["id"]
    args = ",".join(
        [
            f"model={served}",
            f"base_url={gateway.url}/completions",
            "tokenizer_backend=huggingface",
            f"tokenizer={lm.path}",
            "tokenized_requests=True",
            "max_retries=1",
            "timeout=300",
        ]
    )
    start = time.monotonic()
    results, samples = run_lm_eval(tmp_path_factory.mktemp("lm-eval-specmesh"), "local-completions", args)
    print(f"lm-eval local-completions through SpecMesh: {time.monotonic() - start:.1f} s")
    return results, samples


@pytest.fixture(scope="module")
def with_hf(tmp_path_factory, lm):
    start = time.monotonic()
    results, samples = run_lm_eval(tmp_path_factory.mktemp("lm-eval-hf"), "hf", f"pretrained={lm.path},dtype=float32")
    print(f"lm-eval hf: {time.monotonic() - start:.1f} s")
    return results, samples


def scores(results: dict) -> dict[str, float]:
    return {
        f"{task}/{metric}": results[task][metric]
        for task, metric in [
            ("specmesh_mc", "acc,none"),
            ("specmesh_mc", "acc_norm,none"),
            ("specmesh_gen", "exact_match,strip"),
        ]
    }


def loglikelihoods(sample: dict) -> list[tuple[float, bool]]:
    """A multiple-choice sample's (loglikelihood, is_greedy) per choice, as the harness logged them (strings)."""
    return [(float(ll), greedy == "True") for ll, greedy in sample["filtered_resps"]]


def test_task_scores_equal_the_hf_backend(through_specmesh, with_hf):
    got, want = scores(through_specmesh[0]), scores(with_hf[0])
    print(f"scores through SpecMesh {got}; hf backend {want}")
    assert got == want
    assert all(0 < v < 1 for v in want.values())  # neither task is trivially all right or all wrong


def test_every_loglikelihood_equals_the_hf_backend_and_the_generations_are_identical(through_specmesh, with_hf):
    got, want = through_specmesh[1], with_hf[1]
    assert [s["doc_id"] for s in got["specmesh_mc"]] == [s["doc_id"] for s in want["specmesh_mc"]] == list(range(30))
    worst = 0.0
    for a, b in zip(got["specmesh_mc"], want["specmesh_mc"], strict=True):
        assert a["arguments"] == b["arguments"]  # the same (context, continuation) pairs
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(loglikelihoods(a), loglikelihoods(b), strict=True):
            assert math.isfinite(ll_a) and ll_a < 0
            assert abs(ll_a - ll_b) <= TOLERANCE, f"doc {a['doc_id']}: {ll_a} through SpecMesh, {ll_b} with hf"
            assert greedy_a == greedy_b, f"doc {a['doc_id']}: is_greedy {greedy_a} vs {greedy_b}"
            worst = max(worst, abs(ll_a - ll_b))
    print(f"largest loglikelihood difference, SpecMesh vs hf backend: {worst:.3g} over 120 choices")
    texts = [s["resps"] for s in got["specmesh_gen"]]
    assert texts == [s["resps"] for s in want["specmesh_gen"]]
    assert any(t[0][0].strip() for t in texts)


def test_loglikelihoods_equal_transformers_own(through_specmesh, lm):
    """The first docs' choices from scratch: tokenized as the harness does (causal ``_encode_pair``: the
    whole string, the context's tokens split off), the continuation's log_softmax summed."""
    import torch

    tok = lm.tokenizer
    checked, worst = 0, 0.0
    for sample in through_specmesh[1]["specmesh_mc"][:4]:
        for args, (got, _) in zip(sample["arguments"].values(), loglikelihoods(sample), strict=True):
            context, continuation = args["arg_0"], args["arg_1"]
            whole = tok(context + continuation, add_special_tokens=False).input_ids
            ctx = tok(context, add_special_tokens=False).input_ids
            assert whole[: len(ctx)] == ctx and len(whole) > len(ctx)
            with torch.inference_mode():
                logits = lm.model(torch.tensor([whole])).logits[0].float()
            logp = torch.log_softmax(logits[len(ctx) - 1 : -1], -1)
            want = float(logp.gather(-1, torch.tensor(whole[len(ctx) :])[:, None]).sum())
            assert abs(got - want) <= TOLERANCE, f"{continuation!r} after {context!r}: {got} vs transformers {want}"
            checked, worst = checked + 1, max(worst, abs(got - want))
    print(f"largest difference from transformers' own over {checked} choices: {worst:.3g}")


def test_the_gateway_served_every_request_and_speculated(through_specmesh, gateway):
    metrics = httpx.get(gateway.url.removesuffix("/v1") + "/metrics").text
    counted = r'specmesh_gateway_requests_total\{endpoint="/v1/completions",status="(\d+)"\} (\S+)'
    by_status = dict(re.findall(counted, metrics))
    assert by_status == {"200": "136.0"}, by_status  # 120 loglikelihoods + 16 generations, none refused
    drafted = re.search(r"^specmesh_gateway_draft_tokens_total (\S+)$", metrics, re.M)
    accepted = re.search(r"^specmesh_gateway_accepted_draft_tokens_total (\S+)$", metrics, re.M)
    assert drafted and accepted and float(accepted.group(1)) > 0  # drafts were verified and kept
    print(f"drafted {drafted.group(1)} tokens, accepted {accepted.group(1)}")
