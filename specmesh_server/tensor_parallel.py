"""Tensor parallelism for the target model: N ranks over ``torch.distributed``, each holding a shard
of every layer, rank 0 driving them.

**Sharding** follows the model's own tensor-parallel plan (transformers' ``base_model_tp_plan``:
which linears are ``colwise`` and which ``rowwise``); the cut points are ours:

- attention: rank r holds whole key/value heads ``kv_split(kv_heads, N)[r]`` and the query heads
  that share them (GQA groups stay together), so q/k/v_proj keep those heads' output rows and
  ``o_proj`` the same heads' input columns;
- MLP: ``gate_proj``/``up_proj`` keep rank r's slice of the intermediate features
  (``even_split``), ``down_proj`` the same input columns;
- every ``rowwise`` linear (o_proj, down_proj) sums its partial products with one all-reduce
  (:class:`RowParallelLinear`), its bias added once after it;
- embedding, norms and LM head stay whole on every rank: hidden states are replicated after each
  all-reduce, so rank 0 computes logits alone and no collective carries a [tokens, vocab] tensor.

Why not transformers' ``tp_plan`` loading or DTensor's ``parallelize_module``: both split a
projection's output rows evenly, so a model whose key/value heads the degree does not divide
(the default SmolLM2-135M: 9 query / 3 key/value heads, at N = 2) would get half a head per rank;
and their DTensor parameters cannot be packed by oneDNN (``packed_linear``). Here the shards are
plain tensors, the packed linears and the attention kernels run on them unchanged, and a degree
that does not divide the key/value heads splits them unevenly by whole groups (3 → 2 + 1).

**Driving** (:class:`Leader`, :func:`follow`): rank 0 alone schedules; before each operation that
touches the model or the KV cache (a forward, a cache copy) it broadcasts the operation and its
inputs to the other ranks on a gloo group of its own (``control``), then runs it itself. The
other ranks run the same operation on their shard; their results are dropped (the all-reduces
made every rank's hidden states equal). While idle, rank 0 sends a heartbeat every
``timeout / 4`` so a follower's wait, bounded by ``timeout`` like every collective, never expires
on a healthy idle service. A collective that fails or times out raises :class:`RankFailure`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from specmesh_server.host_all_reduce import HostAllReduce, RankFailure, supported
from specmesh_server.metrics import ALL_REDUCES
from specmesh_server.model_loading import head_dim, text_config

__all__ = ["RankFailure"]  # raised here, caught by the engine

log = logging.getLogger(__name__)


class TensorParallelConfigError(ValueError):
    """A tensor-parallel degree this model or machine cannot run (a one-line start-up refusal)."""


def even_split(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of ``parts`` contiguous slices of ``range(n)``, the first ones longer by one.

    >>> even_split(1536, 2), even_split(3, 2), even_split(7, 3)
    ([(0, 768), (768, 1536)], [(0, 2), (2, 3)], [(0, 3), (3, 5), (5, 7)])
    """
    size, extra = divmod(n, parts)
    bounds, start = [], 0
    for r in range(parts):
        stop = start + size + (r < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def kv_split(kv_heads: int, heads: int, world: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per rank, its ([start, stop) of key/value heads, [start, stop) of query heads): whole KV heads,
    each with the ``heads / kv_heads`` query heads that read it.

    >>> kv_split(3, 9, 2)     # SmolLM2-135M on 2 ranks: 2 + 1 KV heads, 6 + 3 query heads
    [((0, 2), (0, 6)), ((2, 3), (6, 9))]
    >>> kv_split(8, 32, 4)[1]
    ((2, 4), (8, 16))
    """
    if world > kv_heads:
        raise TensorParallelConfigError(
            f"--tensor-parallel-size {world} exceeds the model's {kv_heads} key/value heads "
            "(a key/value head is never split across ranks)"
        )
    group = heads // kv_heads
    return [((a, b), (a * group, b * group)) for a, b in even_split(kv_heads, world)]


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``world`` holds of the model's layers."""

    rank: int
    world: int
    kv_heads: tuple[int, int]  # [start, stop) of the model's key/value heads
    heads: tuple[int, int]  # [start, stop) of its query heads
    intermediate: tuple[int, int]  # [start, stop) of the MLP's intermediate features
    max_kv_heads: int  # the most key/value heads any rank holds: every rank's KV cache is sized by it

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world}: key/value heads {self.kv_heads[0]}–{self.kv_heads[1] - 1}, "
            f"query heads {self.heads[0]}–{self.heads[1] - 1}, MLP features {self.intermediate[0]}–"
            f"{self.intermediate[1] - 1}"
        )


class RowParallelLinear(torch.nn.Module):
    """A row-parallel linear: this rank's input features × its columns of the weight, summed over the
    ranks by one all-reduce (``reduce``, in place), then the bias (once). ``linear`` holds the columns
    (no bias), so ``packed_linear.pack_linears`` may swap it for a packed one."""

    def __init__(
        self, linear: torch.nn.Module, bias: torch.Tensor | None, reduce: Callable[[torch.Tensor], None]
    ) -> None:
        super().__init__()
        self.linear = linear
        self.bias = bias
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in / N] → [..., out]
        y = self.linear(x).contiguous()
        t0 = time.perf_counter()
        self.reduce(y)
        ALL_REDUCES.add(time.perf_counter() - t0)
        return y if self.bias is None else y + self.bias


def all_reduce(t: torch.Tensor, group: Any) -> None:
    """Sum ``t`` over ``group`` in place (gloo or NCCL); a failure or timeout is a :class:`RankFailure`."""
    try:
        dist.all_reduce(t, group=group)
    except RuntimeError as exc:  # DistBackendError and gloo's timeouts are RuntimeErrors
        raise RankFailure(f"all-reduce failed: {exc}") from exc


def _linear_rows(linear: torch.nn.Linear, start: int, stop: int) -> torch.nn.Linear:
    """A linear keeping output features [start, stop) (column-parallel)."""
    out = torch.nn.Linear(linear.in_features, stop - start, bias=linear.bias is not None)
    out.weight = torch.nn.Parameter(linear.weight.data[start:stop].clone(), requires_grad=False)
    if linear.bias is not None:
        out.bias = torch.nn.Parameter(linear.bias.data[start:stop].clone(), requires_grad=False)
    return out.to(linear.weight.device)


def _linear_cols(linear: torch.nn.Linear, start: int, stop: int) -> torch.nn.Linear:
    """A linear keeping input features [start, stop), without bias (row-parallel's partial product)."""
    out = torch.nn.Linear(stop - start, linear.out_features, bias=False)
    out.weight = torch.nn.Parameter(linear.weight.data[:, start:stop].clone(), requires_grad=False)
    return out.to(linear.weight.device)


def _plan(config: Any) -> dict[str, str]:
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if not plan:
        raise TensorParallelConfigError(f"model type {config.model_type!r} has no tensor-parallel plan in transformers")
    return plan


# The Llama family's linears: transformers' style for each, and the part of the Shard it keeps (the
# heads' head_dim-wide rows or columns, or MLP features). colwise keeps output rows, rowwise input columns.
LAYOUT = {
    "q_proj": ("colwise", "heads"),
    "k_proj": ("colwise", "kv_heads"),
    "v_proj": ("colwise", "kv_heads"),
    "o_proj": ("rowwise", "heads"),
    "gate_proj": ("colwise", "intermediate"),
    "up_proj": ("colwise", "intermediate"),
    "down_proj": ("rowwise", "intermediate"),
}


def plan_shard(config: Any, rank: int, world: int) -> Shard:
    """Rank ``rank``'s :class:`Shard` of a model with this config, or a one-line refusal."""
    cfg = text_config(config)
    plan = _plan(cfg)
    styles = {name.rsplit(".", 1)[-1]: style for name, style in plan.items()}
    if any(styles.get(name) != style for name, (style, _) in LAYOUT.items()):
        raise TensorParallelConfigError(
            f"model type {cfg.model_type!r}: its tensor-parallel plan is not the Llama-family one this verifier shards "
            f"(q/k/v/gate/up colwise, o/down rowwise): {plan}"
        )
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    splits = kv_split(kv, heads, world)
    inter = even_split(cfg.intermediate_size, world)
    return Shard(rank, world, splits[rank][0], splits[rank][1], inter[rank], max(b - a for (a, b), _ in splits))


def shard_model(model: torch.nn.Module, shard: Shard, reduce: Callable[[torch.Tensor], None]) -> int:
    """Cut ``model``'s decoder layers in place down to ``shard`` (this module's docstring); returns the
    linears cut. ``reduce``: the row-parallel layers' all-reduce (``Ranks.all_reduce``)."""
    cfg = text_config(model.config)
    patterns = [re.compile(re.escape(name).replace(r"\*", r"\d+") + "$") for name in _plan(cfg)]
    done = 0
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if child_name not in LAYOUT or not any(p.search(full) for p in patterns):
                continue
            style, part = LAYOUT[child_name]
            unit = 1 if part == "intermediate" else head_dim(cfg)
            a, b = (x * unit for x in getattr(shard, part))
            if style == "colwise":
                new: torch.nn.Module = _linear_rows(child, a, b)
            else:
                bias = None if child.bias is None else child.bias.data.clone()
                new = RowParallelLinear(_linear_cols(child, a, b), bias, reduce)
            setattr(parent, child_name, new)
            done += 1
    if done == 0:
        raise TensorParallelConfigError("no linear of the model matched its tensor-parallel plan")
    return done


# --- driving the ranks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks, and the groups it talks on."""

    rank: int
    world: int
    group: Any  # the model's collectives (gloo on CPUs, NCCL on GPUs)
    control: Any  # rank 0's operations and heartbeats (always gloo: Python objects on the host)
    timeout_s: float
    host: HostAllReduce | None = None  # one host's CPU ranks: all-reduces through shared memory
    # Start-up's own meetings (the load's turns, the KV budget's agreement): gloo, bounded by
    # START_TIMEOUT_S, since a rank may load for longer than a serving collective may wait.
    start: Any = None

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks in place: through shared memory where it fits, else the group."""
        if self.host is not None and self.host.fits(t):
            self.host(t)
        else:
            all_reduce(t, self.group)

    def abort(self) -> None:
        """Make a pending shared-memory wait give up (rank 0's watch saw a rank fail)."""
        if self.host is not None:
            self.host.abort.set()


START_TIMEOUT_S = 120.0  # how long the ranks may take to meet at start-up

# A shared-memory operand's room: a [tokens, hidden] float32 activation of 4 MiB (SmolLM2-135M: 1,820
# tokens); larger ones (long prefill chunks of wide models) take gloo.
HOST_CAPACITY = 4 * 2**20


def init_ranks(
    rank: int, world: int, device: torch.device, timeout_s: float, init_method: str, one_host: bool = False
) -> Ranks:
    """Join the process group (every rank calls this); ``init_method`` e.g. ``tcp://127.0.0.1:PORT`` or
    ``env://`` (torchrun's variables). ``one_host``: every rank runs on this host, so CPU ranks
    all-reduce through shared memory (``host_all_reduce``) where the platform allows."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    # The ranks' first meeting waits for processes that are still importing torch (seconds on a busy host):
    # bounded by START_TIMEOUT_S, not by the collectives' timeout, which then bounds the store as well.
    start = timedelta(seconds=max(timeout_s, START_TIMEOUT_S))
    store, rank, world = next(dist.rendezvous(init_method, rank, world, timeout=start))
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    meet = dist.new_group(backend="gloo", timeout=start)
    host = None
    if one_host and device.type == "cpu" and supported():
        # One name per group: rank 0 draws it and tells the others.
        name = [f"/dev/shm/specmesh-tp-{os.getpid()}-{time.time_ns()}" if rank == 0 else None]
        dist.broadcast_object_list(name, src=0, group=meet)
        host = HostAllReduce(name[0], rank, world, HOST_CAPACITY, timeout_s)
        try:
            if rank == 0:
                host.create()
            dist.barrier(group=meet)
            if rank != 0:
                host.attach()
            dist.barrier(group=meet)
        finally:
            if rank == 0:
                host.unlink()  # mapped by every rank now (or start-up failed): nothing stays in /dev/shm
    return Ranks(rank, world, dist.group.WORLD, control, timeout_s, host, meet)


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor (and device) in it (tuples, lists, dicts, dataclasses) moved to ``device``.

    >>> to_device({"a": (torch.ones(1), 2)}, torch.device("cpu"))["a"][1]
    2
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, torch.device):  # where a field builds its tensors (``PagedRows``)
        return device
    if isinstance(obj, tuple | list):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **fields)
    return obj


class Leader:
    """Rank 0's side: :meth:`send` an operation before running it; heartbeats while idle; ``watch``
    (e.g. spawned ranks' liveness) polled four times a second. A reason ``watch`` returns, a heartbeat or a
    send that fails, or :meth:`fail` called by the owner, records the failure once: a pending
    shared-memory wait gives up and ``on_failure`` is told (at once if it is set after the failure)."""

    def __init__(
        self,
        ranks: Ranks,
        on_failure: Callable[[str], None] | None = None,
        watch: Callable[[], str | None] | None = None,
    ) -> None:
        self.ranks = ranks
        self._lock = threading.Lock()  # the control group: one broadcast at a time, in one order
        self._state = threading.Lock()  # _failed, _on_failure (never held while broadcasting)
        self._last = time.monotonic()
        self._failed: str | None = None
        self._closed = False
        self._on_failure = on_failure
        self._watch = watch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="specmesh-tp-heartbeat", daemon=True)

    @property
    def on_failure(self) -> Callable[[str], None] | None:
        return self._on_failure

    @on_failure.setter
    def on_failure(self, callback: Callable[[str], None] | None) -> None:
        with self._state:
            self._on_failure, failed = callback, self._failed
        if failed is not None and callback is not None:  # the failure came first: tell its owner now
            callback(failed)

    @property
    def failed(self) -> str | None:
        """Why the ranks failed, once they have."""
        return self._failed

    def start(self) -> None:
        """Start the heartbeat and the watch, once start-up is over: every later collective on the
        control group goes through :meth:`send`."""
        self._thread.start()

    def send(self, op: str, *args: Any) -> None:
        """Broadcast ``(op, args)`` to the other ranks (tensors moved to the host first)."""
        message = [(op, to_device(args, torch.device("cpu")))]
        with self._lock:
            if self._closed and op == "beat":
                return
            if self._failed is not None or self._closed:
                raise RankFailure(self._failed or "the ranks were stopped")
            try:
                dist.broadcast_object_list(message, src=0, group=self.ranks.control)
            except RuntimeError as exc:
                reason = f"broadcast to the ranks failed: {exc}"
                self.fail(reason)
                raise RankFailure(reason) from exc
            self._last = time.monotonic()

    def fail(self, reason: str) -> None:
        """Record that the ranks failed (any thread; the first reason counts)."""
        with self._state:
            first = self._failed is None
            if first:
                self._failed = reason
            callback = self._on_failure
        if not first:
            return
        log.error("tensor parallelism failed: %s", reason)
        self.ranks.abort()
        if callback is not None:
            callback(reason)

    def close(self) -> None:
        """Tell the other ranks to exit (unless they failed) and stop the heartbeat; no send after it."""
        self._stop.set()
        with self._lock:
            if self._failed is None and not self._closed:
                with contextlib.suppress(RuntimeError):
                    dist.broadcast_object_list([("stop", ())], src=0, group=self.ranks.control)
            self._closed = True
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _beat(self) -> None:
        interval = max(self.ranks.timeout_s / 4, 0.5)
        while not self._stop.wait(0.25):
            reason = self._watch() if self._watch is not None else None
            if reason is not None:
                self.fail(reason)
                return
            if time.monotonic() - self._last >= interval and self._failed is None:
                try:
                    self.send("beat")
                except RankFailure:
                    return


def follow(ranks: Ranks, device: torch.device, handlers: dict[str, Callable[..., Any]]) -> None:
    """The other ranks' loop: receive each operation rank 0 sends and run ``handlers[op](*args)``
    until ``stop``. Raises :class:`RankFailure` when rank 0 is gone or silent past the timeout."""
    while True:
        message: list[Any] = [None]
        try:
            dist.broadcast_object_list(message, src=0, group=ranks.control)
        except RuntimeError as exc:
            raise RankFailure(f"rank 0 is gone or silent: {exc}") from exc
        op, args = message[0]
        if op == "stop":
            return
        if op == "beat":
            continue
        handlers[op](*to_device(args, device))
