"""What a request of the engine caches and may read from the prefix cache (``specmesh_server.kv_blocks``).

A request caches the KV of its first ``Sequence.cache_target`` tokens before it decodes: its prompt,
and after a preemption its output but the pending token (``cache_tokens``). When it joins it opens
its blocks from the longest cached prefix of the tokens it may read (``readable``), in the hash chain
that its scope seeds (``seed``): requests share cached blocks only within one model, ``cache_scope``
and ``cache_salt``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specmesh_server.kv_blocks import BlockHash, namespace

if TYPE_CHECKING:
    from verifier_svc.sequence import Sequence


def cache_tokens(seq: Sequence) -> list[int]:
    """The ``seq.cache_target`` tokens whose KV the request caches before it decodes (prompt, then
    output): a request with prompt [1, 2, 3] and output [7, 8, 9] caches [1, 2, 3, 7, 8] (9 is pending)."""
    return seq.req.prompt_ids + seq.output[: seq.cache_target - len(seq.req.prompt_ids)]


def readable(seq: Sequence) -> list[int]:
    """The tokens whose cached KV the request may read: all it caches, but a request that asks for
    prompt logprobs reads none of the prompt it has not scored yet (every row it needs is computed),
    as vLLM: with 2 prompt tokens scored, the first 3 (a prompt's first token has no logprob)."""
    cached = cache_tokens(seq)
    if seq.req.prompt_logprobs is None or seq.output:
        return cached
    return cached[: len(seq.prompt_logprobs) + 1]


def seed(model: str, seq: Sequence) -> BlockHash:
    """The request's hash-chain seed: cached prefixes are shared within one ``model``, ``cache_scope``
    (the gateway prefixes the scope with its API key's tenant, so tenants never share) and ``cache_salt``."""
    spec = seq.req.spec_params
    return namespace(model, spec.cache_scope, spec.cache_salt)
