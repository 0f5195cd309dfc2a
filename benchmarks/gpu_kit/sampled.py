"""Sampled acceptance through the verifier as it runs on the device (graphs, the acceptance kernel), against
the target's softmax: the chi-square test of ``tests/verifier_svc/test_speculation.py``, on the random-weight
target the check serves.

Seeded requests of 2 tokens each. The oracle drafts the greedy continuation, so a request whose first
(sampled) token is the greedy one gets its second token from a verification step over a drafted chain:
accepted with probability p(draft), else drawn from the residual. Over those requests the second token must
follow softmax(logits / T) after prompt + first (one stratum, Pearson chi-square at p = 0.001). A random
model's logits are flat, so T is the largest of ``TEMPERATURES`` at which both steps' top token has a
share worth testing.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from gpu_kit.context import CheckContext, suite_support
from gpu_kit.report import Section

TEMPERATURES = (1.0, 0.7, 0.5, 0.35, 0.25, 0.18, 0.12, 0.08, 0.05)


def pick_temperature(first: torch.Tensor, second: torch.Tensor) -> float:
    """The largest temperature at which the first step's top token takes ≥ 40 % (enough requests reach the
    verified step) and the second step's ≥ 25 % (cells worth testing); the smallest otherwise.

    >>> pick_temperature(torch.tensor([2.0, 0.0, 0.0]), torch.tensor([1.0, 0.0, 0.0]))
    0.7
    """
    for t in TEMPERATURES:
        if torch.softmax(first / t, -1).max() >= 0.4 and torch.softmax(second / t, -1).max() >= 0.25:
            return t
    return TEMPERATURES[-1]


@torch.inference_mode()
def sampled_check(ctx: CheckContext, sec: Section, ref: Any, address: str, oracle: Any, prompt: list[int]) -> None:
    from specmesh.client import Client
    from specmesh.params import SamplingParams, SpecDecodeParams

    support = suite_support(ctx.root)
    chi_square, chi_square_critical = support.chi_square, support.chi_square_critical
    continuation = ref.greedy(prompt, 8)
    first_token = continuation[0]
    logits = ref.model(torch.tensor([[*prompt, first_token]], device=ref.device)).logits[0, -2:].float().cpu()
    temperature = pick_temperature(logits[0], logits[1])
    oracle.servicer.set_continuation(tuple(prompt), continuation)
    n = 24 if ctx.quick else 800
    spec = SpecDecodeParams(proposer="oracle")
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=2, ignore_eos=True) for s in range(n)]
    with Client(address, token="") as c, ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda p: c.complete(prompt, p, spec, timeout=120), params))
    verified = [o for o in outs if o.token_ids[0] == first_token]
    drafted = sum(o.summary.speculation.drafted_tokens for o in verified if o.summary)
    seconds = torch.tensor([o.token_ids[1] for o in verified], dtype=torch.long)
    p = torch.softmax(logits[1] / temperature, -1)
    chi2, dof = chi_square(seconds, p) if len(seconds) else (float("nan"), 0)
    crit = chi_square_critical(dof) if dof > 0 else float("nan")
    t = sec.table(
        "sampled acceptance (graphs, acceptance kernel) vs the target's softmax: second tokens after the greedy first",
        ["temperature", "requests", "verified step", "drafted tokens", "chi2", "dof", "critical (p=0.001)", "verdict"],
    )
    testable = not ctx.quick and dof > 0 and len(seconds) >= 100 and drafted > 0
    verdict = ("pass" if chi2 < crit else "FAIL") if testable else "too few draws to test (dry run or flat logits)"
    t.rows.append([temperature, n, len(verified), drafted, chi2, dof, crit, verdict])
    if verdict == "FAIL":
        sec.fail(f"sampled second tokens do not follow the target's softmax: chi2 {chi2:.1f} over {dof} dof")
