"""The test suite's GPU-only tests, run where they mean something: the kernel tests at GPU sizes (their
CPU-interpreter siblings skip on a CUDA host, with a reason). Tests that need the real model's weights
(the ``lm`` fixture) stay behind: the weights do not travel to the GPU machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from gpu_kit.context import CheckContext
from gpu_kit.report import Deadline, Section

# What runs on a GPU host without the real weights: the kernel tests (the CUDA sweeps; their interpreter
# siblings skip there), the flag checks, the host acceptance walk and the static step's CUDA-graph replay.
# Newest first: a run the box cuts short has run what earlier leases have not.
GPU_TESTS = (
    "tests/specmesh_server/test_staging.py", "tests/specmesh_server/test_static_step.py",
    "tests/kernels/test_tree_accept.py", "tests/kernels/test_tree_attention.py",
    "tests/verifier_svc/test_kernel_flags.py", "tests/verifier_svc/test_acceptance.py",
)  # fmt: skip
# The dry run runs this section's code over one cheap file: `make test` runs the kernel tests already.
QUICK_TESTS = ("tests/verifier_svc/test_kernel_flags.py",)


def suite_section(ctx: CheckContext, sec: Section, deadline: Deadline) -> None:
    try:
        import pytest  # noqa: F401
    except ImportError:
        sec.status = "skipped"
        sec.notes.append("skipped: pytest is not importable here (`make gpu-bundle` brings it)")
        return
    files = QUICK_TESTS if ctx.quick else GPU_TESTS
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-rs", *files]
    # SPECMESH_GPU_SUITE: the ``lm`` fixture skips where the model's weights are not (the GPU machine).
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "SPECMESH_GPU_SUITE": "1"}
    try:
        run = subprocess.run(
            cmd, cwd=ctx.root, env=env, capture_output=True, text=True, timeout=max(deadline.left(), 1.0)
        )
    except subprocess.TimeoutExpired as exc:  # what ran before the budget ended is still worth reading
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        sec.budget_spent(0, 1)
        sec.notes.append("pytest stopped by the budget; its output so far:\n```\n" + out[-3000:] + "\n```")
        return
    tail = run.stdout.strip().splitlines()
    summary = next((ln for ln in reversed(tail) if re.search(r"\d+ (passed|failed|error)", ln)), "no summary line")
    sec.summary = f"{' '.join(files)}: {summary.strip('= ')}"
    skipped = [ln for ln in tail if ln.startswith("SKIPPED")]
    t = sec.table("skipped, with their reasons", ["test"])
    t.rows += [[ln] for ln in skipped[:20]]
    if run.returncode != 0:
        sec.fail(f"pytest exited {run.returncode}")
        sec.notes.append("```\n" + "\n".join(tail[-40:]) + "\n" + run.stderr[-2000:] + "\n```")
