"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters and word-boundary spaces. A fast
(Rust-backed) tokenizer decodes incrementally with ``tokenizers``' own ``DecodeStream``
(:class:`StreamDetokenizer`: state kept in Rust, O(1) per token, primed with the prompt's tail so
the first output token decodes in context). Any other tokenizer takes the window method
(:class:`WindowDetokenizer`): each step decodes a short window (from ``prefix_offset``) and emits
only the text past what the window already produced, waiting while the tail is an incomplete
character (U+FFFD). :func:`detokenizer_for` picks one.

Text that could still be the start of a stop string is held back until it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

_REPLACEMENT = "\ufffd"
# How many prompt tokens seed the decoder, so the first output token decodes in context.
_CONTEXT_TOKENS = 5


class Detokenizer(Protocol):
    def push(self, new_ids: list[int]) -> str:
        """Append tokens and return the text they complete (possibly empty)."""
        ...

    def flush(self) -> str:
        """At the end of generation: whatever is left, replacement characters included."""
        ...


def detokenizer_for(tokenizer: Any, prompt_ids: list[int]) -> Detokenizer:
    """``DecodeStream`` where the tokenizer has a Rust backend, else the window method."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return StreamDetokenizer.for_prompt(tokenizer, backend, prompt_ids)
    return WindowDetokenizer.for_prompt(tokenizer, prompt_ids)


@dataclass
class StreamDetokenizer:
    tokenizer: Any  # the transformers tokenizer: decodes what the stream still holds at the end
    backend: Any  # its ``tokenizers.Tokenizer``
    stream: Any  # tokenizers.decoders.DecodeStream
    held: list[int] = field(default_factory=list)  # pushed ids whose text the stream has not returned yet

    @classmethod
    def for_prompt(cls, tokenizer: Any, backend: Any, prompt_ids: list[int]) -> StreamDetokenizer:
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(ids=list(prompt_ids[-_CONTEXT_TOKENS:]), skip_special_tokens=True)
        return cls(tokenizer, backend, stream)

    def push(self, new_ids: list[int]) -> str:
        if not new_ids:
            return ""
        text = self.stream.step(self.backend, new_ids)
        if text is None:
            self.held.extend(new_ids)
            return ""
        self.held.clear()
        return text

    def flush(self) -> str:
        held, self.held = self.held, []
        return self.tokenizer.decode(held, skip_special_tokens=True) if held else ""


@dataclass
class WindowDetokenizer:
    tokenizer: Any
    ids: list[int]  # prompt tail + output tokens
    prefix_offset: int = 0
    read_offset: int = 0

    @classmethod
    def for_prompt(cls, tokenizer: Any, prompt_ids: list[int]) -> WindowDetokenizer:
        tail = list(prompt_ids[-_CONTEXT_TOKENS:])
        return cls(tokenizer, tail, prefix_offset=0, read_offset=len(tail))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, new_ids: list[int]) -> str:
        """
        >>> class Bytes:  # a toy byte-level tokenizer: id = byte value
        ...     def decode(self, ids, **kw): return bytes(ids).decode("utf-8", errors="replace")
        >>> d = WindowDetokenizer.for_prompt(Bytes(), [])
        >>> [d.push([b]) for b in "é!".encode()]
        ['', 'é', '!']
        """
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


@dataclass
class StopStringFilter:
    """Finds stop strings across chunk boundaries and holds back possible stop prefixes.

    >>> f = StopStringFilter(["END"])
    >>> f.push("hello E"), f.push("N"), f.push("D and more")
    ('hello ', '', '')
    >>> f.matched
    'END'
    """

    stops: list[str]
    pending: str = ""
    matched: str | None = None
    _max_len: int = field(init=False)

    def __post_init__(self) -> None:
        self._max_len = max((len(s) for s in self.stops), default=0)

    def push(self, text: str, armed: bool = True) -> str:
        """Return the text safe to emit; after a match, nothing more. Not ``armed`` (before
        ``min_tokens``): no stop string matches in it, but a stop string's start at its end is still
        held back, so one that ends in armed text is found.

        >>> f = StopStringFilter(["END"])
        >>> f.push("END; E", armed=False), f.push("ND"), f.matched
        ('END; ', '', 'END')
        """
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        self.pending += text
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0] if armed else []
        if hits:
            index, self.matched = min(hits)
            out, self.pending = self.pending[:index], ""
            return out
        keep = self._held_suffix_len()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out

    def _held_suffix_len(self) -> int:
        """Length of the longest suffix of ``pending`` that is a proper prefix of a stop string."""
        for n in range(min(self._max_len - 1, len(self.pending)), 0, -1):
            tail = self.pending[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        out, self.pending = ("" if self.matched is not None else self.pending), ""
        return out
