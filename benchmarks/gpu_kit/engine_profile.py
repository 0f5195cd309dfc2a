"""Host syncs and the profile of a decode step, in the verifier's own engine; the draft proposer's copies.

The engine runs in this process on the random-weight target (SmolLM2's shape; tiny in the dry run), 8
requests, each fed a 16-node tree every step by a synthetic proposer session (the shape a real
proposer sends; acceptance then runs on whatever the random tokens earn). A window of decode steps runs
under the torch profiler (all threads): device→host copies (CUDA ``Memcpy DtoH``) per step, against the
target of one per step for the whole batch, and where a step's time goes (Python and launches on the
host vs kernels on the device).
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import torch
from gpu_kit.context import CheckContext, random_model
from gpu_kit.report import Deadline, Section

ROWS, NODES = 8, 16


class SyntheticTrees:
    """A ``speculation.ProposerSession`` that has a ``NODES``-node tree (four chains of four) of random
    tokens ready for every context: the step shape without a proposer service's timing."""

    def __init__(self, vocab: int, seed: int) -> None:
        from verifier_svc.proposer_client import ProposerLimits

        self.name, self.limits = "synthetic", ProposerLimits(vocab, NODES, NODES)
        self.failed: str | None = None
        self.invalid_trees, self.last_response = 0, time.perf_counter()
        self.hidden_dtype: int | None = None
        self.sent = None
        self._rng, self._vocab = random.Random(seed), vocab
        self.parents = [-1 if j % 4 == 0 else j - 1 for j in range(NODES)]

    def take(self, context_length: int, recent: list[int] | None = None):
        from specmesh_server.tree import TokenTree

        self.last_response = time.perf_counter()
        self.sent = TokenTree([self._rng.randrange(self._vocab) for _ in range(NODES)], list(self.parents))
        return self.sent

    def has_tree_for(self, context_length: int) -> bool:
        return True

    def advance(self, tokens: list[int], hidden: object = None) -> None:
        self.last_response = time.perf_counter()

    def fail(self, reason: str) -> None:
        self.failed = self.failed or reason

    def close(self) -> None:
        pass


def profiler(cuda: bool) -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        from torch._C._profiler import _ExperimentalConfig

        cfg = _ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=cuda)
        return profile(activities=activities, experimental_config=cfg)
    except TypeError:  # an older torch: the calling thread only
        return profile(activities=activities)


def decode_step_section(ctx: CheckContext, sec: Section, deadline: Deadline) -> None:
    from transformers import AutoTokenizer

    from specmesh_server.model_runner import ModelRunner
    from verifier_svc.engine import Engine, EngineConfig
    from verifier_svc.events import ErrorEvent, TokenEvent
    from verifier_svc.request_speculation import RequestSpeculation
    from verifier_svc.requests import GenerationRequest, SpecParams

    if ctx.tokenizer is None:
        sec.status = "skipped"
        sec.notes.append("skipped: no tokenizer files (the engine detokenizes); run `make gpu-bundle`")
        return
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    shape = ctx.target_shape
    model = random_model(shape, ctx.device, dtype)
    # The kernels' paths, as on CUDA by default (on a CPU they run in Triton's interpreter).
    runner = ModelRunner(model, ctx.device, dtype, max_context=4096, tree_kernel=True, block_size=16)
    runner.use_static(ROWS, 4096, graphs=True)  # as the verifier runs it: replayed CUDA graphs on a GPU
    tokenizer = AutoTokenizer.from_pretrained(ctx.tokenizer)
    engine = Engine(runner, tokenizer, {2}, 4096, EngineConfig(max_running=ROWS, max_waiting=0, device_accept=True))
    engine.start()
    tokens = [0] * ROWS
    errors: list[str] = []
    arrived = threading.Condition()

    def sink(i: int):
        def on(event: Any) -> None:
            with arrived:
                if isinstance(event, TokenEvent):
                    tokens[i] += len(event.token_ids)
                elif isinstance(event, ErrorEvent):
                    errors.append(event.message)
                arrived.notify_all()

        return on

    spec = SpecParams("synthetic", 0, NODES, "", "")
    n_steps = 2 if ctx.quick else 20
    rng = random.Random(1)
    try:
        for i in range(ROWS):
            prompt = [rng.randrange(3, shape["vocab_size"]) for _ in range(32 if ctx.quick else 512)]
            req = GenerationRequest(f"p{i}", prompt, 0.0, 1.0, 0, 0, 100_000, (), True, spec)
            engine.submit(req, sink(i), RequestSpeculation.start(SyntheticTrees(shape["vocab_size"], i)))
        with arrived:  # every request prefilled and decoding: the window holds decode steps only
            arrived.wait_for(lambda: min(tokens) > 1 or errors, timeout=deadline.left())
        if errors or min(tokens) <= 1:
            sec.fail(f"the engine did not get every request decoding: {errors[:1] or tokens}")
            return
        plain_steps, plain_wall = steps_window(engine, n_steps, ctx, deadline)  # no profiler: the real pace
        sites = sync_sites(engine, ctx, deadline) if ctx.cuda else None
        with profiler(ctx.cuda) as prof:
            steps, wall = steps_window(engine, n_steps, ctx, deadline)
    finally:
        engine.shutdown()
    if steps == 0 or plain_steps == 0:
        sec.fail("no decode step ran inside the profiling window")
        return
    report_profile(ctx, sec, prof, steps, wall)
    sec.tables[0].rows.insert(2, ["wall time without the profiler, ms", 1e3 * plain_wall / plain_steps])
    if sites is not None:
        t = sec.table("where the engine's thread waits for the device (torch's sync debug mode)", ["site", "per step"])
        n = max(sites.pop("steps", 1), 1)
        t.rows += [[site, count / n] for site, count in sorted(sites.items(), key=lambda kv: -kv[1])[:12]]


def steps_window(engine: Any, n_steps: int, ctx: CheckContext, deadline: Deadline) -> tuple[int, float]:
    """(decode steps, seconds) of a window of about ``n_steps`` of the engine's steps."""
    s0, t0 = engine.stats.steps, time.perf_counter()
    while engine.stats.steps - s0 < n_steps and not deadline.spent():
        time.sleep(0.002)
    ctx.sync()
    return engine.stats.steps - s0, time.perf_counter() - t0


def sync_sites(engine: Any, ctx: CheckContext, deadline: Deadline, n_steps: int = 5) -> dict[str, int]:
    """Where (file:line of the Python frame) the engine's steps synchronise with the device, counted
    over a few steps under ``torch.cuda.set_sync_debug_mode("warn")`` (it warns at every synchronising
    call); the count of steps under ``"steps"``."""
    import warnings

    sites: dict[str, int] = {}
    shown = warnings.showwarning

    def record(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if "synchroniz" in str(message).lower():
            where = f"{'/'.join(filename.split('/')[-2:])}:{lineno}"
            sites[where] = sites.get(where, 0) + 1
        else:
            shown(message, category, filename, lineno, *rest)

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            steps, _ = steps_window(engine, n_steps, ctx, deadline)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    sites["steps"] = steps
    return sites


def device_events(prof: Any) -> list[Any]:
    """The profile's device-side activities (kernels, copies, memsets), without synchronization records:
    each kernel once (a CPU op's device time is its kernels' again)."""
    from torch.autograd import DeviceType

    return [e for e in prof.events() if e.device_type == DeviceType.CUDA and "sync" not in e.name.lower()]


def report_profile(ctx: CheckContext, sec: Section, prof: Any, steps: int, wall: float) -> None:
    events = prof.events()
    d2h = sum(1 for e in events if "Memcpy DtoH" in e.name)
    syncs = sum(1 for e in events if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    on_device = device_events(prof) if ctx.cuda else []
    device_ms = sum(e.time_range.elapsed_us() for e in on_device) / 1e3 / steps if ctx.cuda else None
    step_ms = 1e3 * wall / steps
    t = sec.table(f"decode step (static, CUDA graphs), batch {ROWS} × {NODES}-node trees", ["quantity", "per step"])
    t.rows.append(["device→host copies (Memcpy DtoH)", d2h / steps if ctx.cuda else None])
    t.rows.append(["stream/device synchronizations", syncs / steps if ctx.cuda else None])
    t.rows.append(["wall time under the profiler, ms", step_ms])
    t.rows.append(["device busy (kernels, copies), ms", device_ms])
    t.rows.append(
        ["host-bound share (1 − device busy / wall)", 1 - device_ms / step_ms if device_ms is not None else None]
    )
    t.rows.append(["steps in the window", steps])
    host = sec.table("top host operators by self CPU time", ["operator", "calls/step", "host ms/step"])
    cpu_ops = [e for e in prof.key_averages() if str(getattr(e, "device_type", "CPU")).endswith("CPU")]
    for e in sorted(cpu_ops, key=lambda e: -e.self_cpu_time_total)[:12]:
        host.rows.append([e.key, e.count / steps, e.self_cpu_time_total / 1e3 / steps])
    if ctx.cuda:
        by_name: dict[str, list[float]] = {}
        for e in on_device:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
        dev = sec.table("top device activities", ["kernel / copy", "calls/step", "device ms/step"])
        for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]:
            dev.rows.append([name[:90], len(times) / steps, sum(times) / 1e3 / steps])
        sec.summary = f"{d2h / steps:.1f} device→host copies per step (target 1), {step_ms:.2f} ms per step"
        if d2h / steps > 1.0:
            sec.notes.append(f"over the target: {d2h / steps:.1f} device→host copies per decode step")
    else:
        sec.summary = f"{step_ms:.1f} ms per step on the CPU (no device copies to count)"


def draft_section(ctx: CheckContext, sec: Section, deadline: Deadline) -> None:
    """The draft proposer on the device: device→host copies per proposal (one: the finished trees)."""
    from proposer_svc.draft.proposer import DraftConfig, Drafter, RequestState

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    from specmesh_server.model_runner import ModelRunner

    shape = ctx.target_shape
    model = random_model(shape, ctx.device, dtype, seed=1)
    runner = ModelRunner(model, ctx.device, dtype, max_context=4096, tree_kernel=False)  # as draft_server's
    drafter = Drafter(runner, DraftConfig(max_nodes=16, max_depth=6, width=4, branch=4))
    rng = random.Random(2)
    states = [
        RequestState(f"d{i}", [rng.randrange(3, shape["vocab_size"]) for _ in range(64)], 16, 6, slot=i)
        for i in range(ROWS)
    ]
    for s in states:
        drafter.prefill(s, len(s.context) - 1)
    drafter.draft(slice(0, ROWS), states, [True] * ROWS)  # warm-up (compiles, allocates)
    rounds = 2 if ctx.quick else 5
    with profiler(ctx.cuda) as prof:
        t0 = time.perf_counter()
        for s in states:
            s.advance([rng.randrange(3, shape["vocab_size"])], None)
        for _ in range(rounds):
            trees = drafter.draft(slice(0, ROWS), states, [True] * ROWS)
            for s in states:
                s.advance([rng.randrange(3, shape["vocab_size"])], None)
        ctx.sync()
        wall = time.perf_counter() - t0
    d2h = sum(1 for e in prof.events() if "Memcpy DtoH" in e.name)
    t = sec.table(f"draft proposals, {ROWS} requests × 16 nodes, depth 6", ["quantity", "per proposal"])
    t.rows.append(["device→host copies", d2h / rounds if ctx.cuda else None])
    t.rows.append(["wall time, ms", 1e3 * wall / rounds])
    t.rows.append(["trees returned", sum(x is not None for x in trees)])
    sec.summary = (
        f"{d2h / rounds:.1f} device→host copies per proposal (target 1)"
        if ctx.cuda
        else "ran (no device copies on a CPU)"
    )
