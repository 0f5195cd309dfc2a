"""The static step: a decode or verification forward whose every input lives in one preallocated buffer,
so that on CUDA it is captured once per (batch, width) bucket as a CUDA graph and replayed.

A step of ``b`` rows, each its pending token and a tree of ``n_i`` nodes, runs in the smallest bucket
``(B, W)`` with ``B >= b`` and ``W >= max(n_i) + 1`` (:func:`pick`). Its inputs are written on the host,
vectorised per row, into one flat int64 staging buffer (pinned on CUDA) and reach the device in **one**
host→device copy; the forward reads them as views of the device copy (:class:`StepViews`):

    input_ids, positions, write_slots, row_prefix, bits   [B, W]  (slots flat: where each token's K/V goes)
    table                                                 [B, C]  (block tables, C = the capacity's columns)
    start                                                 [B]     (first new position of each row)
    gather                                                [B · W] (flat index of each real token, first N used)

Nothing inside the forward reads a length on the host, allocates by a length, or synchronises: write
slots are computed here, the tree-attention kernel's grid is planned for the table's capacity and each
row spreads its own keys over it (``row_chunks``), and its mask is the kernel's metadata (start,
row_prefix, ancestor bits). Padding rows and columns write into the cache's scratch block, and no real
query reads them (their bits are 0; a padding query sees key 0 only, so no softmax row is empty).

On CUDA every bucket of at most ``MAX_GRAPH_TOKENS`` tokens is captured at start-up, the largest first into
one memory pool, as vLLM and SGLang do, and a step runs static only as a replayed graph: any other step
(no bucket holds it, or capture failed) runs the eager path, which pads nothing. On a CPU the same code
runs eagerly for every step that fits a bucket: its tested form (``--cuda-graphs on``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specmesh_server.tree import TokenTree, depths

WIDTHS = (1, 2, 3, 5, 9, 17, 33, 64)  # tokens per row: the pending token and 0, 1, 2, 4, 8, 16, 32, 63 nodes
MAX_GRAPH_TOKENS = 2048  # buckets of more tokens (batch × width) are not captured: such steps run eagerly
FIELDS = ("input_ids", "positions", "write_slots", "row_prefix", "bits", "gather")  # [B, W] each


def batch_sizes(max_running: int) -> tuple[int, ...]:
    """Batch buckets up to ``max_running``: 1, 2, 4, then every multiple of 8, and the limit itself.

    >>> batch_sizes(32), batch_sizes(5)
    ((1, 2, 4, 8, 16, 24, 32), (1, 2, 4, 5))
    """
    sizes = {s for s in (1, 2, 4) if s <= max_running} | set(range(8, max_running + 1, 8)) | {max_running}
    return tuple(sorted(sizes))


def pick(sizes: Sequence[int], n: int) -> int | None:
    """The smallest size holding ``n``, or None.

    >>> pick((1, 2, 4, 8), 3), pick((1, 2, 4, 8), 9)
    (4, None)
    """
    return next((s for s in sizes if s >= n), None)


@dataclass(frozen=True)
class Layout:
    """Where a bucket's inputs lie in the flat buffer: the six [B, W] fields, then table [B, C], start [B].

    >>> Layout(2, 4, 3).size
    56
    """

    batch: int
    width: int
    columns: int

    @property
    def size(self) -> int:
        b, w = self.batch, self.width
        return len(FIELDS) * b * w + b * self.columns + b

    def views(self, flat: torch.Tensor | np.ndarray) -> StepViews:
        """The bucket's fields as views of ``flat`` (a device tensor, or the host staging array)."""
        b, w, c = self.batch, self.width, self.columns
        parts, at = [], 0
        for _ in FIELDS:
            parts.append(flat[at : at + b * w].reshape(b, w))
            at += b * w
        table = flat[at : at + b * c].reshape(b, c)
        start = flat[at + b * c : at + b * c + b]
        return StepViews(*parts, table, start)


@dataclass(frozen=True)
class StepViews:
    input_ids: Any  # [B, W]
    positions: Any  # [B, W] rotary positions: the row's length + each node's depth
    write_slots: Any  # [B, W] flat cache slots the new keys and values go to
    row_prefix: Any  # [B, W] keys below it always seen (the row's length; 1 for padding)
    bits: Any  # [B, W] ancestor bitmask over the row's new tokens
    gather: Any  # [B, W] viewed flat: row · W + column of each real token, first N used
    table: Any  # [B, C] block ids, padded with the scratch block
    start: Any  # [B] the row's length: its first new position


def stage(
    views: StepViews,
    pending: Sequence[int],
    lengths: Sequence[int],
    trees: Sequence[TokenTree],
    tables: Sequence[Sequence[int]],
    block_size: int,
    scratch: int,
) -> int:
    """Write one step's inputs into host ``views`` (numpy, a bucket's); returns N, the real tokens.

    Row i: its pending token at position ``lengths[i]``, then its tree's nodes written right after it
    (slots through ``tables[i]``) at their depth's rotary position; padding to the scratch block.

    >>> L = Layout(2, 3, 2); flat = np.zeros(L.size, dtype=np.int64); v = L.views(flat)
    >>> stage(v, [9], [5], [TokenTree([7, 8], [-1, -1])], [[3, 0]], block_size=4, scratch=6)
    3
    >>> v.input_ids.tolist(), v.positions.tolist(), v.write_slots.tolist()
    ([[9, 7, 8], [0, 0, 0]], [[5, 6, 6], [0, 0, 0]], [[1, 2, 3], [24, 25, 26]])
    >>> v.bits.tolist(), v.row_prefix.tolist(), v.table.tolist(), v.gather.reshape(-1)[:3].tolist()
    ([[1, 3, 5], [0, 0, 0]], [[5, 5, 5], [1, 1, 1]], [[3, 0], [6, 6]], [0, 1, 2])
    """
    from specmesh_kernels.tree_attention import ancestor_bits

    rows, width = views.input_ids.shape
    if len(pending) > rows:
        raise ValueError(f"{len(pending)} rows staged into a bucket of {rows}")
    cols = np.arange(width)
    scratch_slots = scratch * block_size + cols % block_size  # [W]
    views.input_ids[:] = 0
    views.positions[:] = 0
    views.write_slots[:] = scratch_slots
    views.row_prefix[:] = 1
    views.bits[:] = 0
    views.table[:] = scratch
    views.start[:] = 0
    gather = views.gather.reshape(-1)
    n_real = 0
    for i, (tok, length, tree, blocks) in enumerate(zip(pending, lengths, trees, tables, strict=True)):
        n = len(tree) + 1
        table = np.asarray(blocks[: views.table.shape[1]], dtype=np.int64)  # the blocks up to the capacity
        views.table[i, : table.size] = table
        views.input_ids[i, :n] = [tok, *tree.tokens]
        views.positions[i, :n] = length + np.asarray([0, *depths(tree.parents)])
        at = length + cols[:n]
        views.write_slots[i, :n] = table[at // block_size] * block_size + at % block_size
        views.row_prefix[i, :n] = length
        views.bits[i, :n] = ancestor_bits(tree.parents)
        views.start[i] = length
        gather[n_real : n_real + n] = i * width + cols[:n]
        n_real += n
    return n_real


@dataclass(frozen=True)
class Captured:
    graph: Any  # torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [B, W, hidden]: the forward's output, rewritten by every replay


@dataclass
class StaticCounts:
    replayed: int = 0  # steps a captured graph ran
    static: int = 0  # static steps run eagerly (a CPU; a bucket not captured)


class StaticStep:
    """One runner's static decode and verification forwards (``ModelRunner.static``)."""

    def __init__(
        self, runner: Any, max_batch: int, max_context: int, widths: Sequence[int] = WIDTHS, graphs: bool = True
    ) -> None:
        """``runner``: a ``ModelRunner`` over a paged cache whose attention is the tree kernel (it reads
        blocks through the table). Buckets: :func:`batch_sizes` of ``max_batch`` × ``widths``; the table
        covers ``max_context`` positions plus the widest row. ``graphs``: capture them (CUDA only; there a
        step runs static only as a replayed graph). On a CPU every step that fits runs static, eagerly."""
        from specmesh_server.model_loading import text_config
        from specmesh_server.paged_kv import PagedKVCache

        if not isinstance(runner.cache, PagedKVCache) or not runner.tree_kernel:
            raise ValueError("a static step needs a paged cache read through the tree-attention kernel")
        self.runner, self.cache = runner, runner.cache
        self.batches = batch_sizes(max_batch)
        self.widths = tuple(sorted(widths))
        bs = self.cache.block_size
        self.columns = -(-(max_context + self.widths[-1]) // bs)
        dev = runner.device
        self.cuda = dev.type == "cuda"
        self.graphs = graphs and self.cuda
        size = max(Layout(b, w, self.columns).size for b in self.batches for w in self.widths)
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=self.cuda)
        self._host_np = self._host.numpy()
        self._device = torch.zeros(size, dtype=torch.long, device=dev) if self.cuda else self._host
        # The attention mask transformers passes along: unused by the kernel (its metadata is the mask).
        self._mask = torch.zeros(self.batches[-1], 1, self.widths[-1], 1, dtype=runner.dtype, device=dev)
        self._hidden_size = int(text_config(runner.model.config).hidden_size)
        self.captured: dict[tuple[int, int], Captured] = {}
        self.counts = StaticCounts()
        self._uploaded: Any = None  # a CUDA event after the last host→device copy
        self.failure: str | None = None  # why graphs were given up at start-up (steps then run the eager path)
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def bucket(self, batch: int, width: int, longest: int = 0) -> tuple[int, int] | None:
        """The bucket of a step of ``batch`` rows × ``width`` tokens whose longest row has ``longest`` cached
        positions, or None (more rows or tokens than any bucket, or past the table's capacity)."""
        b, w = pick(self.batches, batch), pick(self.widths, width)
        if b is None or w is None or longest + w > self.columns * self.cache.block_size:
            return None
        return b, w

    def fits(self, batch: int, width: int, longest: int = 0) -> bool:
        return self.bucket(batch, width, longest) is not None

    def replays(self, batch: int, width: int, longest: int = 0) -> bool:
        """Whether such a step replays a captured graph."""
        bucket = self.bucket(batch, width, longest)
        return bucket is not None and bucket in self.captured

    def serves(self, batch: int, width: int, longest: int = 0) -> bool:
        """Whether such a step runs here rather than on the eager path: on CUDA as a replayed graph (a
        static step run eagerly there would only pad), on a CPU whenever it fits (the tested form)."""
        return self.replays(batch, width, longest) if self.cuda else self.fits(batch, width, longest)

    def _on_device(self) -> Any:
        """Make the runner's GPU current (``--device cuda:1``: its streams, events and graphs, not cuda:0's)."""
        return torch.cuda.device(self.runner.device) if self.cuda else contextlib.nullcontext()

    @torch.inference_mode()
    def forward(
        self,
        pending: Sequence[int],
        lengths: Sequence[int],
        trees: Sequence[TokenTree],
        tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Hidden states of the step's real tokens, row by row ([N, hidden]); the step must ``fit``."""
        width = 1 + max(len(t) for t in trees)
        bucket = self.bucket(len(pending), width, max(lengths))
        if bucket is None:
            raise ValueError(f"{len(pending)} rows × {width} tokens after {max(lengths)} fit no bucket")
        layout = Layout(*bucket, self.columns)
        with self._on_device():
            if self._uploaded is not None:  # the last step's copy has left the staging buffer (it has, after
                self._uploaded.synchronize()  # its step's one device→host read; this guards callers that read none)
            n = stage(
                layout.views(self._host_np), pending, lengths, trees, tables, self.cache.block_size, self.cache.scratch
            )
            self._upload(layout)
            captured = self.captured.get(bucket)
            if captured is not None:
                captured.graph.replay()
                self.counts.replayed += 1
                hidden = captured.hidden
            else:
                hidden = self._forward(layout)
                self.counts.static += 1
            gather = layout.views(self._device).gather.reshape(-1)[:n]
            return hidden.reshape(-1, hidden.shape[-1]).index_select(0, gather)  # [N, hidden]

    def _upload(self, layout: Layout) -> None:
        """The one host→device copy of a step (none on a CPU: the staging buffer is the input)."""
        if self.cuda:
            stream = torch.cuda.current_stream(self.runner.device)
            self._device[: layout.size].copy_(self._host[: layout.size], non_blocking=True)
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(stream)

    def _forward(self, layout: Layout) -> torch.Tensor:
        """The forward over a bucket's device views: [B, W, hidden]. What a graph captures."""
        from specmesh_kernels.tree_attention import TreeMeta
        from specmesh_server.attention import META_KWARG

        v = layout.views(self._device)
        table = v.table.to(torch.int32)  # [B, C]
        meta = TreeMeta(v.start.to(torch.int32), v.row_prefix.to(torch.int32), v.bits)
        self.cache.begin_static(v.write_slots.reshape(-1), table)
        out = self.runner.decoder(
            input_ids=v.input_ids,
            attention_mask=self._mask[: layout.batch, :, : layout.width],
            position_ids=v.positions,
            cache=self.cache,
            use_cache=True,
            **{META_KWARG: meta},
        )
        return out.last_hidden_state

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the buckets' forwards as CUDA graphs (those of at most ``MAX_GRAPH_TOKENS`` tokens), the
        largest first into one memory pool, each after a warm-up run (Triton compiles, cuBLAS picks its
        kernels) over a step of padding only; every graph writes one shared output buffer. Then replay
        probe steps against the same steps run eagerly (``_probe``). A capture that fails, or a replay
        that disagrees, leaves no graph (every step then takes the eager path), and ``failure`` says why;
        an error that leaves the device unusable is raised."""
        if not self.graphs:
            return
        dev = self.runner.device
        t0 = time.perf_counter()
        with self._on_device():
            torch.cuda.synchronize(dev)
            before = torch.cuda.memory_reserved(dev)
            stream = torch.cuda.current_stream(dev)
            try:
                self._capture_all(dev)
                self.failure = self._probe()
            except Exception as exc:  # a forward that cannot be captured: served eagerly rather than not at all
                torch.cuda.set_stream(stream)  # a capture that failed inside may leave its own stream current
                self.failure = f"capture failed: {type(exc).__name__}: {exc}"[:500]
                try:
                    torch.cuda.synchronize(dev)
                except Exception as dead:  # an illegal access or an assert: no eager step would run either
                    raise RuntimeError(f"the device failed while capturing CUDA graphs: {dead}") from exc
            if self.failure is not None:
                self.captured.clear()
                torch.cuda.empty_cache()
            self.capture_seconds = time.perf_counter() - t0
            self.capture_bytes = max(torch.cuda.memory_reserved(dev) - before, 0)

    def _capture_all(self, dev: torch.device) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(dev)
        out = torch.empty(self.batches[-1], self.widths[-1], self._hidden_size, dtype=self.runner.dtype, device=dev)
        buckets = [(b, w) for b in self.batches for w in self.widths if b * w <= MAX_GRAPH_TOKENS]
        for bucket in sorted(buckets, key=lambda bw: (-bw[0] * bw[1], bw)):
            layout = Layout(*bucket, self.columns)
            stage(layout.views(self._host_np), [], [], [], [], self.cache.block_size, self.cache.scratch)
            self._upload(layout)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                self._forward(layout)  # warm-up
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            target = out[: bucket[0], : bucket[1]]
            with torch.cuda.graph(graph, pool=pool):
                target.copy_(self._forward(layout))  # the forward's own output goes back to the pool
            self.captured[bucket] = Captured(graph, target)
        torch.cuda.synchronize(dev)

    @torch.inference_mode()
    def _probe(self) -> str | None:
        """Replay every single-row bucket, and each batch size's widest, on chains of tokens in blocks taken
        for the while, against the same steps run eagerly; why one disagrees, or None."""
        probes = [bw for bw in self.captured if bw[0] == 1 or bw[1] == max(w for b, w in self.captured if b == bw[0])]
        for rows, width in sorted(probes):
            layout = Layout(rows, width, self.columns)
            if self.cache.pool.free_blocks < rows * -(-width // self.cache.block_size):
                continue  # a KV budget too small to lend the blocks: that bucket goes unprobed
            with self.cache.measurement_rows(rows, width) as where:
                tables = [self.cache.own_blocks(b) for b in where.blocks]
                vocab = self.runner.vocab_size
                chains = [TokenTree([(5 + 7 * i + j) % vocab for j in range(width - 1)], list(range(-1, width - 2)))
                          for i in range(rows)]  # fmt: skip
                stage(layout.views(self._host_np), [3] * rows, [0] * rows, chains, tables,
                      self.cache.block_size, self.cache.scratch)  # fmt: skip
                self._upload(layout)
                want = self._forward(layout).float()  # [B, W, hidden]
                captured = self.captured[(rows, width)]
                captured.graph.replay()
                got = captured.hidden.float()
            scale = float(want.abs().max().clamp(min=1.0))
            if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * scale):
                err = float((got - want).abs().max())
                return f"a replayed graph disagreed with the eager step ({rows} × {width} tokens, max error {err:.3g})"
        return None

    def describe(self) -> str:
        """The start-up line: the buckets, and (captured) their memory and capture time."""
        if self.captured:
            what = (
                f"CUDA graphs of {len(self.captured)} buckets (up to {MAX_GRAPH_TOKENS} tokens) captured in "
                f"{self.capture_seconds:.1f} s, {self.capture_bytes / 2**20:.0f} MiB reserved"
            )
        elif self.failure is not None:
            what = f"no CUDA graphs ({self.failure}): every step runs the eager path"
        else:
            what = "static steps run eagerly (no CUDA graphs off CUDA)"
        return (
            f"{what}: batch {', '.join(map(str, self.batches))} × tokens per row {', '.join(map(str, self.widths))}; "
            f"other steps run the eager path"
        )
