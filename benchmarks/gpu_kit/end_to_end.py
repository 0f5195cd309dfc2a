"""End to end: the verifier process on the device, with and without the kernels, against ``generate()``.

Per dtype (fp32, and bf16 on a GPU) and kernel setting (graphs: ``--attention triton --device-accept on
--cuda-graphs on``; on: the same with ``--cuda-graphs off``; off: ``--attention sdpa --device-accept off``;
on a CPU, graphs runs the static step eagerly) one verifier process serves the random-weight target with three
proposers: n-gram (in process), suffix (its own service, where numba is importable) and the oracle
(this process; it proposes ``generate()``'s own continuation, so trees are deep and mostly accepted).
Every greedy output must equal ``generate()`` of the same model on the same device and dtype; and with
graphs in fp32, seeded sampled requests follow the target's softmax (``sampled``).

Near-tie rule: where an output first differs, the reference model scores that prefix; the difference is
a near-tie, not a failure, when the verifier's token is within ``NEAR_TIE[dtype] · max(1, |top logit|)``
of the reference's top logit (fp32 reductions in another order, or bf16 rounding, may flip such a tie).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from gpu_kit.context import CheckContext, model_folder
from gpu_kit.report import Deadline, Section
from gpu_kit.sampled import sampled_check

NEAR_TIE = {torch.float32: 1e-4, torch.bfloat16: 2**-5, torch.float16: 2**-8}
# kernels → (--attention, --device-accept, --cuda-graphs); "graphs" first: what a GPU verifier runs by default.
KERNELS = {"graphs": ("triton", "on", "on"), "on": ("triton", "on", "off"), "off": ("sdpa", "off", "off")}


@dataclass
class Service:
    proc: subprocess.Popen
    address: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-1500:]


def start(ctx: CheckContext, name: str, args: list[str], timeout_s: float) -> Service:
    from specmesh.deploy import free_port
    from specmesh.health import wait_healthy

    address = f"127.0.0.1:{free_port()}"
    log = ctx.work / f"{name}-{address.rsplit(':', 1)[1]}.log"
    cmd = [sys.executable, "-m", "specmesh", "serve", name, "--address", address, *args]
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    svc = Service(proc, address, log)
    try:
        wait_healthy(address, timeout_s, proc)
    except Exception as exc:
        svc.stop()
        raise RuntimeError(f"{name} did not start ({exc}):\n{svc.tail()}") from None
    return svc


def prompts(ctx: CheckContext, n: int) -> list[list[int]]:
    """Templated first turns of the vendored workload, one per category round-robin (random ids without a
    tokenizer); short in the dry run, where every forward runs in Triton's interpreter."""
    limit = 40 if ctx.quick else 400
    if ctx.tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, 49152, (limit,), generator=g).tolist() for _ in range(n)]
    from transformers import AutoTokenizer

    from specmesh_bench.workload import DEFAULT_WORKLOAD, read_rows

    tok = AutoTokenizer.from_pretrained(ctx.tokenizer)
    by_cat: dict[str, list[str]] = {}
    for row in read_rows(DEFAULT_WORKLOAD):
        by_cat.setdefault(row["category"], []).append(row["turns"][0])
    texts = [t for group in zip(*by_cat.values(), strict=False) for t in group][:n]
    out = []
    for text in texts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        out.append(list(ids)[-limit:])
    return out


class Reference:
    """``generate()`` of the saved model on the check's device and dtype; ``tie_gap`` scores a divergence."""

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        self.model.to(device).eval()
        self.model.generation_config.eos_token_id = None  # requests run with ignore_eos
        self.device, self.dtype = device, dtype
        self.cache: dict[tuple[int, ...], list[int]] = {}

    @torch.inference_mode()
    def greedy(self, ids: list[int], n: int) -> list[int]:
        key = (*ids, -n)
        if key not in self.cache:
            x = torch.tensor([ids], device=self.device)
            # An explicit mask: with no eos id, generate() would take the prompt's pad-id tokens for padding.
            out = self.model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=2
            )
            self.cache[key] = out[0, len(ids) :].tolist()
        return self.cache[key]

    @torch.inference_mode()
    def tie_gap(self, prefix: list[int], theirs: int) -> tuple[float, float]:
        """(top logit − logit of ``theirs``, |top logit|) after ``prefix``."""
        logits = self.model(torch.tensor([prefix], device=self.device)).logits[0, -1].float()
        top = float(logits.max())
        return top - float(logits[theirs]), abs(top)


def judge(ref: Reference, prompt: list[int], want: list[int], got: list[int]) -> str:
    """exact | near-tie | mismatch (see the module docstring)."""
    if got == want:
        return "exact"
    t = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
    if t is None:  # one is a prefix of the other: a length difference is never a tie
        return "mismatch"
    gap, scale = ref.tie_gap(prompt + want[:t], got[t])
    return "near-tie" if gap <= NEAR_TIE[ref.dtype] * max(1.0, scale) else "mismatch"


def run_requests(
    address: str, proposer: str, batch: list[list[int]], n: int, timeout_s: float
) -> list[tuple[list[int], float]]:
    """Greedy completions of ``batch``, all at once (one thread each): (tokens, mean accepted length)."""
    from specmesh.client import Client
    from specmesh.params import SamplingParams, SpecDecodeParams

    out: list[tuple[list[int], float] | None] = [None] * len(batch)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with Client(address, token="") as c:
                r = c.complete(
                    batch[i],
                    SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                    SpecDecodeParams(proposer=proposer),
                    timeout=timeout_s,
                )
            out[i] = (r.token_ids, r.summary.speculation.mean_accepted_length if r.summary else 0.0)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out  # type: ignore[return-value]


def end_to_end_section(ctx: CheckContext, sec: Section, deadline: Deadline) -> None:
    from proposer_svc.oracle import OracleServer

    n_tokens = 8 if ctx.quick else 48
    batch = prompts(ctx, 8)
    suffix = None
    try:
        import numba  # noqa: F401  (the suffix proposer's kernels)

        # the dry run leaves it out: its requests take the path the others' do, at a third of the section's time
        suffix = None if ctx.quick else start(ctx, "suffix", [], min(90.0, deadline.left() / 3))
    except ImportError:
        sec.notes.append("suffix proposer skipped: numba is not importable here (see `make gpu-bundle`)")
    except Exception as exc:  # the other proposers still run
        sec.notes.append(f"suffix proposer skipped: it did not start: {str(exc)[:500]}")
    t = sec.table(
        "greedy output vs generate()",
        ["dtype", "kernels", "proposer", "concurrent", "requests", "exact", "near-tie", "mismatch", "accepted/step"],
    )
    # The dry run leaves out "on": on a CPU "graphs" runs the same kernels (as the static step), eagerly.
    runs = [(d, k) for d in ctx.dtypes for k in KERNELS if not (ctx.quick and k == "on")]
    if os.environ.get("SPECMESH_CHECK_E2E_RUNS"):  # e.g. "float32:graphs,float32:on": a rerun of some items
        wanted = set(os.environ["SPECMESH_CHECK_E2E_RUNS"].split(","))
        runs = [(d, k) for d, k in runs if f"{str(d).removeprefix('torch.')}:{k}" in wanted]
    proposers = ["ngram", "oracle"] + (["suffix"] if suffix else [])
    done = 0
    try:
        with OracleServer() as oracle:
            for dtype, kernels in runs:
                if deadline.left() < 20:  # a verifier's start alone takes about that
                    break
                path = model_folder(ctx, ctx.target_shape, dtype, "target")
                ref = Reference(path, ctx.device, dtype)
                wants = [ref.greedy(p, n_tokens) for p in batch]
                for p, w in zip(batch, wants, strict=True):
                    oracle.servicer.set_continuation(tuple(p), w)
                attention, accept, graphs = KERNELS[kernels]
                args = [
                    "--model", str(path), "--device", str(ctx.device), "--dtype", str(dtype).removeprefix("torch."),
                    "--attention", attention, "--device-accept", accept, "--cuda-graphs", graphs,
                    "--spec-gating", "always",
                    "--max-running", "8", "--max-context", "2048", "--kv-cache-memory", "2GiB",
                    "--proposer", "ngram=inprocess:ngram", "--proposer", f"oracle={oracle.address}",
                    "--auto-proposers", "ngram",
                ]  # fmt: skip
                args += ["--proposer", f"suffix={suffix.address}"] if suffix else []
                args += ["--threads", "2"] if not ctx.cuda else []
                t0 = time.monotonic()
                verifier = start(ctx, "verifier", args, min(120.0, max(30.0, deadline.left())))
                lines = verifier.log.read_text().splitlines()
                paths = next((ln for ln in lines if "tree attention" in ln), "?")
                timed = [ln.removeprefix("verifier: ") for ln in lines if " in " in ln and " s" in ln][:4]
                sec.notes.append(
                    f"verifier {str(dtype).removeprefix('torch.')}, kernels {kernels}: up in "
                    f"{time.monotonic() - t0:.1f} s; {paths.removeprefix('verifier: ')}; start-up: {' | '.join(timed)}"
                )
                try:
                    if kernels == "graphs" and dtype == torch.float32 and deadline.left() > 40:
                        sampled_check(ctx, sec, ref, verifier.address, oracle, batch[0][-64:])
                    for proposer in proposers:
                        for concurrent in (1, 8):
                            if deadline.spent():
                                break
                            groups = [range(0, 1), range(1, 2)] if concurrent == 1 else [range(len(batch))]
                            groups = groups[:1] if ctx.quick else groups  # the dry run: one request alone
                            wait_s = deadline.left() + 30
                            verdicts, acc = [], []
                            for group in groups:
                                prompts_i = [batch[i] for i in group]
                                outs = run_requests(verifier.address, proposer, prompts_i, n_tokens, wait_s)
                                for i, (got, mal) in zip(group, outs, strict=True):
                                    verdicts.append(judge(ref, batch[i], wants[i], got))
                                    acc.append(mal)
                            counts = [verdicts.count(v) for v in ("exact", "near-tie", "mismatch")]
                            t.rows.append([
                                str(dtype).removeprefix("torch."), kernels, proposer, concurrent, len(verdicts),
                                *counts, sum(acc) / len(acc),
                            ])  # fmt: skip
                            if counts[2]:
                                sec.fail(f"{counts[2]} outputs differ from generate() beyond a near-tie: {t.rows[-1]}")
                finally:
                    verifier.stop()
                    if verifier.proc.returncode not in (0, -15, None):
                        sec.notes.append(f"verifier exited {verifier.proc.returncode}:\n{verifier.tail()}")
                done += 1
                del ref
                if ctx.cuda:
                    torch.cuda.empty_cache()
    finally:
        if suffix:
            suffix.stop()
    if done < len(runs):
        sec.budget_spent(done, len(runs))
    rows = t.rows
    sec.summary = (
        f"{sum(r[4] for r in rows)} requests: {sum(r[5] for r in rows)} exact, {sum(r[6] for r in rows)} near-tie, "
        f"{sum(r[7] for r in rows)} mismatch"
    )
