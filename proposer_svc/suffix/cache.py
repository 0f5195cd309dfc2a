"""The global cache: the outputs of recent requests, per ``cache_scope`` (``ScopeCache``), bounded
by tokens with FIFO eviction by request (``SuffixCache``).

Finished outputs are indexed by a truncated suffix array (``SealedIndex``), rebuilt in a
background thread as the cache grows; the newest not yet indexed ones sit in a ``tail`` buffer,
and the outputs of requests still running are scanned where they are, so an output feeds other
requests as it is generated.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from proposer_svc.suffix.buffer import TokenBuffer
from proposer_svc.suffix.calibration import Calibration
from proposer_svc.suffix.config import SuffixConfig
from proposer_svc.suffix.index import MAX_VOCAB, SEP, SealedIndex
from proposer_svc.suffix.matches import NO_MATCH, Matches, merged


@dataclass
class _Cached:
    """One request's span in its scope's logical coordinates (FIFO eviction unit)."""

    scope: str
    end: int  # logical position just past its tokens (and separator)
    tokens: int


@dataclass
class ScopeCache:
    """The global cache of one scope: a sealed index, the unindexed tail, the live requests.

    Logical positions count every token (and separator) ever cached in the scope; the sealed
    index covers [sealed_start, sealed_end), the tail [sealed_end, …); positions below
    ``watermark`` belong to evicted requests and never count.
    """

    levels: int
    sealed: SealedIndex | None = None
    sealed_start: int = 0
    sealed_end: int = 0
    tail: TokenBuffer = field(default_factory=TokenBuffer)
    watermark: int = 0
    live: dict[int, TokenBuffer] = field(default_factory=dict)  # request key → its cached tokens so far
    building: bool = False

    @property
    def logical_end(self) -> int:
        return self.sealed_end + self.tail.n

    def stored_tokens(self) -> int:
        return (self.sealed.size if self.sealed is not None else 0) + self.tail.n

    def nbytes(self) -> int:
        live = sum(b.nbytes() for b in self.live.values())
        return (self.sealed.nbytes if self.sealed is not None else 0) + self.tail.nbytes() + live

    def matches(self, ctx: np.ndarray, exclude: int | None, cfg: SuffixConfig) -> Matches:
        """The context suffix's occurrences in the sealed index, the tail and the other live requests."""
        parts = []
        if self.tail.n:  # the tail's evicted requests lie below the watermark
            parts.append(self.tail.matches(ctx, cfg, min_end=self.watermark - self.sealed_end))
        parts += [b.matches(ctx, cfg) for k, b in self.live.items() if k != exclude and b.n]
        if self.sealed is not None:
            parts.append(self.sealed.matches(ctx, self.watermark - self.sealed_start, cfg))
        return merged(parts)


class SuffixCache:
    """Every scope's global cache, bounded by ``max_cached_tokens`` with FIFO eviction by request.

    Thread-safe: streams call ``begin``/``extend``/``finish``/``propose`` on the event loop,
    ``ingest`` comes from the Redis reader thread, re-indexing runs in a thread of its own.
    """

    def __init__(self, config: SuffixConfig, levels: int = 4, background: bool = True) -> None:
        self.config, self.levels, self.background = config, levels, background
        self.scopes: dict[str, ScopeCache] = {}
        self.fifo: deque[_Cached] = deque()
        self.cached_tokens = 0  # finished requests' tokens still cached (live ones not counted)
        self.lock = threading.RLock()
        self.builds = 0
        self._next_key = 0
        # Pooled over scopes, as the router's acceptance statistics are: rates per node kind, no text.
        self.calibration = Calibration(config.calibration_prior) if config.calibrate else None

    def scope(self, name: str) -> ScopeCache:
        s = self.scopes.get(name)
        if s is None:
            s = self.scopes[name] = ScopeCache(self.levels)
        return s

    def begin(self, scope: str) -> int:
        """A live request's key: its tokens (``extend``) are proposed from as they are generated."""
        with self.lock:
            self._next_key += 1
            self.scope(scope).live[self._next_key] = TokenBuffer()
            return self._next_key

    def extend(self, scope: str, key: int, tokens) -> None:
        with self.lock:
            buf = self.scope(scope).live.get(key)
            if buf is not None:
                buf.extend(tokens)

    def finish(self, scope: str, key: int) -> np.ndarray:
        """Moves a live request into the FIFO cache; returns its tokens (for sharing)."""
        with self.lock:
            s = self.scope(scope)
            buf = s.live.pop(key, None)
            tokens = buf.view().copy() if buf is not None else np.empty(0, np.int32)
            if len(tokens):
                self._append(scope, tokens)
            elif not s.live and s.watermark >= s.logical_end and not s.building:
                del self.scopes[scope]  # a scope with nothing (left) cached leaves nothing behind
            return tokens

    def ingest(self, scope: str, tokens) -> None:
        """A finished output from elsewhere (another replica) enters the cache."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if not len(tokens) or tokens.min() < 0 or tokens.max() >= MAX_VOCAB:
            return
        with self.lock:
            self._append(scope, tokens)

    def learn(self, scope: str, prompt: list[int], output: list[int]) -> np.ndarray:
        """A finished request that no stream followed enters the cache as its stream's would have
        (``SuffixRequest.extend``): its output, after its prompt with ``cache_prompts``. Returns the
        tokens cached (for sharing)."""
        tokens = np.asarray([*prompt, *output] if self.config.cache_prompts else output, dtype=np.int32)
        self.ingest(scope, tokens)
        return tokens

    def _append(self, scope: str, tokens: np.ndarray) -> None:
        s = self.scope(scope)
        s.tail.extend(tokens)
        s.tail.extend([SEP])
        self.fifo.append(_Cached(scope, s.logical_end, len(tokens)))
        self.cached_tokens += len(tokens)
        self._evict()
        self.reindex(s)

    def _evict(self) -> None:
        while self.cached_tokens > self.config.max_cached_tokens and len(self.fifo) > 1:
            old = self.fifo.popleft()
            self.cached_tokens -= old.tokens
            s = self.scopes[old.scope]
            s.watermark = old.end
            if s.watermark >= s.logical_end and not s.live and not s.building:
                del self.scopes[old.scope]  # nothing of the scope left
            else:
                self.reindex(s)

    def reindex(self, s: ScopeCache, force: bool = False) -> None:
        """Re-index when the tail is long or a quarter of what is stored is evicted (or ``force``)."""
        if s.building:
            return
        dead = max(0, s.watermark - s.sealed_start)
        stored = s.stored_tokens()
        if not force and s.tail.n < max(self.config.index_every, stored // 8) and dead * 4 < max(stored, 1):
            return
        start = max(s.watermark, s.sealed_start)
        parts = []
        if s.sealed is not None and start < s.sealed_end:
            parts.append(s.sealed.tokens[start - s.sealed_start :])
        tail_from = max(0, start - s.sealed_end)
        parts.append(s.tail.view()[tail_from:].copy())
        end = s.logical_end
        s.building = True
        tokens = np.concatenate(parts) if parts else np.empty(0, np.int32)

        def build() -> None:
            index = SealedIndex(tokens, self.levels) if len(tokens) else None
            with self.lock:
                s.building = False
                self.builds += 1
                consumed = end - s.sealed_end  # tail tokens now in the index
                rest = s.tail.view()[consumed:]
                s.tail = TokenBuffer(len(rest) + 256)
                s.tail.extend(rest)
                s.sealed, s.sealed_start, s.sealed_end = index, start, end
                if index is None:
                    s.sealed_start = s.sealed_end = end
                if s.watermark >= s.logical_end and not s.live:  # all evicted while it built: drop it
                    name = next((k for k, v in self.scopes.items() if v is s), None)
                    if name is not None:
                        del self.scopes[name]

        if self.background:
            threading.Thread(target=build, name="suffix-index", daemon=True).start()
        else:
            build()

    def nbytes(self) -> int:
        with self.lock:
            return sum(s.nbytes() for s in self.scopes.values())

    def matches(self, scope: str, ctx: np.ndarray, exclude: int | None) -> Matches:
        """``ctx``'s suffix in the scope's global cache (``exclude``: the asking request's live entry).
        The result reads arrays that re-indexing replaces but never changes: it may outlive the lock."""
        with self.lock:
            s = self.scopes.get(scope)
            return NO_MATCH if s is None else s.matches(ctx, exclude, self.config)
