"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters and word-boundary spaces, so each step
decodes a short window (from ``prefix_offset``) and emits only the text past what the window
already produced, waiting while the tail is an incomplete character (U+FFFD).
Text that could still be the start of a stop string is held back until it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_REPLACEMENT = "\ufffd"
# How many prompt tokens seed the decode window, so the first output token decodes in context.
_CONTEXT_TOKENS = 5


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    ids: list[int]  # prompt tail + output tokens
    prefix_offset: int = 0
    read_offset: int = 0

    @classmethod
    def for_prompt(cls, tokenizer: Any, prompt_ids: list[int]) -> IncrementalDetokenizer:
        tail = list(prompt_ids[-_CONTEXT_TOKENS:])
        return cls(tokenizer, tail, prefix_offset=0, read_offset=len(tail))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, new_ids: list[int]) -> str:
        """Append tokens and return the text they complete (possibly empty).

        >>> class Bytes:  # a toy byte-level tokenizer: id = byte value
        ...     def decode(self, ids, **kw): return bytes(ids).decode("utf-8", errors="replace")
        >>> d = IncrementalDetokenizer.for_prompt(Bytes(), [])
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
        """At the end of generation: whatever is left, replacement characters included."""
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

    def push(self, text: str) -> str:
        """Return the text safe to emit; after a match, nothing more."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        self.pending += text
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
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
