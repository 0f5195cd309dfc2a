"""The Llama family's decoder forward in one function: the CPU step without transformers' modules.

On a CPU a batch-1 decode step of SmolLM2-135M spent more time between its linear layers than in
them: transformers' per-layer modules make ~60 operator calls and ~13 module calls a layer (a
RMSNorm alone is six operators, the rotary embedding ten), each paying Python and dispatch. This
forward computes the same thing with fewer calls, per layer:

    h = rms_norm(x)                         one operator (torch.rms_norm: the same bits as
                                            transformers' pow → mean → rsqrt → mul → mul)
    q, k, v = h · [Wq; Wk; Wv]ᵀ             one product for a step of ≤ GEMV_ROWS rows (the fused
                                            weight, of which the layer's q/k/v weights are views);
                                            three otherwise (oneDNN's packed weights)
    q, k = rope(q, k)                       both in one pass: x·cos + rotate_half(x)·sin
    x = x + o_proj(attention(q, cache ∪ (k, v)))
    h = rms_norm(x)
    x = x + down_proj(silu(g) · u)          [g; u] = h · [Wgate; Wup]ᵀ likewise fused

Every output is the same sum in the same order as transformers' forward over the same linears (a
fused product's rows are its parts' rows; the elementwise steps are the same per element), so the
logits equal theirs: lossless by construction, tested against the stock forward.

Where the paged cache is read in place (a CPU step, packed or not) the whole loop runs in one native
call instead (:class:`NativeLoop`, ``specmesh_kernels.cpu_linear.decode_layers``): the same operators in
the same order, so the same bits, without a Python call per operator. Its products: the fused ones on
the matrix-vector kernel for float32 steps of at most ``GEMV_ROWS`` rows, oneDNN's seven packed ones
for larger, the GGUF blocks' at any.

Only plain Llama layers take it (``supports``): SiLU MLP, no biases, the default or a scaled rotary
embedding transformers computes (its own module is called), no sliding window. Others keep
transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specmesh_kernels import cpu_linear
from specmesh_server import attention
from specmesh_server.gguf_weights import GGUFLinear
from specmesh_server.packed_linear import PackedLinear
from specmesh_server.paged_kv import PagedKVCache


def supports(model: Any) -> bool:
    """A Llama-architecture decoder whose layers this forward computes exactly."""
    cfg = model.config
    return (
        getattr(cfg, "model_type", "") == "llama"
        and getattr(cfg, "hidden_act", "") == "silu"
        and not getattr(cfg, "attention_bias", False)
        and not getattr(cfg, "mlp_bias", False)
        and attention.supports(cfg)
        and cfg._attn_implementation == attention.ATTN_NAME
    )


@dataclass(frozen=True)
class DecoderOutput:
    last_hidden_state: torch.Tensor  # [b, n, hidden]


@dataclass(frozen=True)
class Fused:
    """One product for several linear layers: float32 plain weights (the matrix-vector kernel, steps of at
    most ``GEMV_ROWS`` rows) or GGUF blocks of one kind (any step)."""

    weight: torch.Tensor  # float32 [Σ out, in], or uint8 blocks [Σ out / 8, in / 32 · record bytes]
    kind: int | None  # the blocks' GGUF kind; None: float32
    rows: int  # the most rows a step may bring to take it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is None:
            return cpu_linear.linear(x, self.weight, None)
        return cpu_linear.linear_gguf(x, self.weight, self.kind)


@dataclass(frozen=True)
class Layer:
    """One decoder layer's parts. ``qkv``/``gate_up``: the fused plain weights for small steps, or None."""

    attn: torch.nn.Module  # transformers' attention module (its attributes are read by the attention function)
    norm_in: torch.Tensor  # [hidden]
    norm_post: torch.Tensor  # [hidden]
    q: Any
    k: Any
    v: Any
    o: Any
    gate: Any
    up: Any
    down: Any
    qkv: Fused | None  # → [..., (H + 2·kv_heads)·D]
    gate_up: Fused | None  # → [..., 2·intermediate]


def _fuse(modules: list[Any]) -> Fused | None:
    """One product for ``modules``: their float32 plain weights (``PackedLinear`` with the kernel) or their
    GGUF blocks of one kind, concatenated, each module's own then a view of it; None where neither."""
    if all(isinstance(m, PackedLinear) and m.plain is not None for m in modules):
        attr, kind, rows = "plain", None, min(m.gemv_rows for m in modules)
    elif all(isinstance(m, GGUFLinear) for m in modules) and len({m.kind for m in modules}) == 1:
        attr, kind, rows = "blocks", modules[0].kind, 1 << 62
    else:
        return None
    fused = torch.cat([getattr(m, attr) for m in modules])
    start = 0
    for m in modules:
        size = getattr(m, attr).shape[0]  # out_features rows, or out_features / 8 groups of blocks
        setattr(m, attr, fused[start : start + size])
        start += size
    return Fused(fused, kind, rows)


@dataclass(frozen=True)
class Products:
    """Every layer's products for ``decode_layers``, and the most rows a step may bring to take them."""

    weights: list[torch.Tensor]  # per layer: qkv, o, gate_up, down (fused) or q, k, v, o, gate, up, down
    kinds: list[int]
    rows: int


def _small(module: Any) -> tuple[torch.Tensor, int, int] | None:
    """(weight, kind, most rows) of a linear a small step multiplies in the native loop: float32 plain weights
    (up to the rows the matrix-vector kernel takes) or GGUF blocks (any rows); None otherwise."""
    if isinstance(module, GGUFLinear):
        return module.blocks, module.kind, 1 << 62
    if isinstance(module, PackedLinear) and module.plain is not None and module.bias is None:
        return module.plain, cpu_linear.FLOAT32, module.gemv_rows
    return None


def _small_products(layers: list[Layer], modules: list[list[Any]]) -> Products | None:
    """The fused products (q/k/v, gate/up), as a step of few rows takes them in Python."""
    weights, kinds, rows = [], [], 1 << 62
    for layer, (*_, o, _gate, _up, down) in zip(layers, modules, strict=True):
        parts = [_small(o), _small(down)]
        if layer.qkv is None or layer.gate_up is None or None in parts:
            return None
        (ow, ok, orows), (dw, dk, drows) = parts
        weights += [layer.qkv.weight, ow, layer.gate_up.weight, dw]
        kinds += [_kind(layer.qkv), ok, _kind(layer.gate_up), dk]
        rows = min(rows, layer.qkv.rows, layer.gate_up.rows, orows, drows)
    return Products(weights, kinds, rows)


def _large_products(modules: list[list[Any]]) -> Products | None:
    """oneDNN's seven products a layer, as a float32 step of more rows takes them in Python."""
    if not all(isinstance(m, PackedLinear) and m.bias is None for layer in modules for m in layer):
        return None
    return Products([m.packed for layer in modules for m in layer], [cpu_linear.ONEDNN] * 7 * len(modules), 1 << 62)


def _kind(fused: Fused) -> int:
    return cpu_linear.FLOAT32 if fused.kind is None else fused.kind


@dataclass(frozen=True)
class NativeLoop:
    """What ``decode_layers`` takes: the norms, and the products a step of few rows (``small``) or more
    (``large``) runs; a step neither takes keeps the Python loop."""

    norms: list[torch.Tensor]  # per layer: input, post-attention
    small: Products | None
    large: Products | None

    @staticmethod
    def of(layers: list[Layer], modules: list[list[Any]]) -> NativeLoop | None:
        """For ``layers`` (their linear modules ``modules``: q, k, v, o, gate, up, down); None where no step can run."""
        if not cpu_linear.decoder_loaded():
            return None
        small, large = _small_products(layers, modules), _large_products(modules)
        if small is None and large is None:
            return None
        return NativeLoop([w for layer in layers for w in (layer.norm_in, layer.norm_post)], small, large)

    def products(self, rows: int) -> Products | None:
        for products in (self.small, self.large):
            if products is not None and rows <= products.rows:
                return products
        return None


class LeanLlama:
    """Callable as the runner's decoder: ``(input_ids, attention_mask, position_ids, cache, **kwargs)`` →
    ``DecoderOutput``. Holds transformers' decoder and reads its weights; fuses q/k/v and gate/up plain
    weights in place (the modules keep views)."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        self.decoder = decoder
        cfg = decoder.config
        self.hidden = int(cfg.hidden_size)
        self.eps = float(cfg.rms_norm_eps)
        self.layers = []
        for layer in decoder.layers[: cfg.num_hidden_layers]:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(
                Layer(
                    attn=a,
                    norm_in=layer.input_layernorm.weight,
                    norm_post=layer.post_attention_layernorm.weight,
                    q=a.q_proj.forward,
                    k=a.k_proj.forward,
                    v=a.v_proj.forward,
                    o=a.o_proj.forward,
                    gate=m.gate_proj.forward,
                    up=m.up_proj.forward,
                    down=m.down_proj.forward,
                    qkv=_fuse([a.q_proj, a.k_proj, a.v_proj]),
                    gate_up=_fuse([m.gate_proj, m.up_proj]),
                )
            )
        first = decoder.layers[0].self_attn
        self.head_dim, self.scaling = int(first.head_dim), first.scaling
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        modules = [  # q, k, v, o, gate, up, down
            [getattr(a, f"{n}_proj") for n in "qkvo"] + [getattr(m, f"{n}_proj") for n in ("gate", "up", "down")]
            for a, m in ((layer.self_attn, layer.mlp) for layer in decoder.layers[: cfg.num_hidden_layers])
        ]
        self.native = NativeLoop.of(self.layers, modules)

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> DecoderOutput:
        """input_ids, position_ids: int64 [b, n]; attention_mask: float [b, 1, n, kv_len] → hidden [b, n, hidden]."""
        d = self.decoder
        x = d.embed_tokens(input_ids)  # [b, n, hidden]
        b, n, _ = x.shape
        cos, sin = d.rotary_emb(x, position_ids=position_ids)  # [b, n, D] each
        cos, sin = cos[:, :, None], sin[:, :, None]  # [b, n, 1, D]: every head
        rows = b * n
        heads, kv, dim, shape = self.heads, self.kv_heads, self.head_dim, (self.hidden,)
        packing: attention.Packing | None = kwargs.get(attention.PACK_KWARG)
        plain = not kwargs.keys() - {attention.PACK_KWARG}  # no tree kernel's metadata
        products = self.native.products(rows) if self.native is not None and plain else None
        width = n if packing is None else packing.width  # the queries each row brings to attention
        if products is not None and isinstance(cache, PagedKVCache) and (reads := cache.in_place_reads()) is not None:
            x = cpu_linear.decode_layers(
                x, cos.reshape(rows, dim), sin.reshape(rows, dim), self.native.norms, products.weights,
                products.kinds, cache.pools, reads, attention.folded_mask(attention_mask, heads // kv), heads, kv,
                self.eps, self.scaling, None if packing is None else (packing.rows, packing.cols, packing.width),
                ordered=attention.in_key_order(self.layers[0].attn, x, width, paged=True),  # as the Python loop's
            )  # fmt: skip
            return DecoderOutput(torch.rms_norm(x, shape, d.norm.weight, self.eps))
        for i, layer in enumerate(self.layers):
            h = torch.rms_norm(x, shape, layer.norm_in, self.eps)
            if layer.qkv is not None and rows <= layer.qkv.rows:
                qkv = layer.qkv(h).view(b, n, heads + 2 * kv, dim)
                qk = _rope(qkv[:, :, : heads + kv], cos, sin)  # [b, n, H + kv_heads, D]
                q, k, v = qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, heads + kv :]
            else:
                q = _rope(layer.q(h).view(b, n, heads, dim), cos, sin)
                k = _rope(layer.k(h).view(b, n, kv, dim), cos, sin)
                v = layer.v(h).view(b, n, kv, dim)
            keys, values = cache.update(k.transpose(1, 2), v.transpose(1, 2), i)
            out, _ = attention.attention_forward(
                layer.attn, q.transpose(1, 2), keys, values, attention_mask, scaling=self.scaling, **kwargs
            )  # [b, n, H, D]
            x = x + layer.o(out.reshape(b, n, heads * dim))
            h = torch.rms_norm(x, shape, layer.norm_post, self.eps)
            if layer.gate_up is not None and rows <= layer.gate_up.rows:
                gate, up = layer.gate_up(h).chunk(2, dim=-1)
            else:
                gate, up = layer.gate(h), layer.up(h)
            x = x + layer.down(F.silu(gate.contiguous()) * up)  # contiguous: SiLU rounds as in transformers
        return DecoderOutput(torch.rms_norm(x, shape, d.norm.weight, self.eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, n, heads, D] rotated: x·cos + rotate_half(x)·sin, rotate_half(x) = [−x₂, x₁] (transformers' form).

    >>> x = torch.tensor([[[[1.0, 2.0]]]])          # one head, D = 2: x₁ = 1, x₂ = 2
    >>> _rope(x, torch.zeros(1, 1, 1, 2), torch.ones(1, 1, 1, 2)).tolist()
    [[[[-2.0, 1.0]]]]
    """
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
