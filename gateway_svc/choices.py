"""The choices of one request: each a Generate stream on the verifier, read one by one or merged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from specmesh.params import Chunk, Summary, TokenLogprob


@dataclass
class Choice:
    """One generation of a request: its stream and what it produced."""

    index: int
    stream: AsyncIterator[Chunk | Summary]
    first: Chunk | Summary | None = None
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    summary: Summary | None = None
    prompt_tokens: int = 0  # from the first chunk
    completion_tokens: int = 0  # so far

    def take(self, item: Chunk | Summary) -> None:
        if isinstance(item, Summary):
            self.summary = item
        else:
            self.text += item.text
            self.logprobs.extend(item.logprobs or ())
            self.prompt_tokens = item.prompt_tokens or self.prompt_tokens
            self.completion_tokens += len(item.token_ids)

    def usage(self) -> dict:
        """Its token counts so far (vLLM's ``continuous_usage_stats``: every chunk carries them)."""
        p, c = self.prompt_tokens or getattr(self.first, "prompt_tokens", 0), self.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def close_choices(choices: list[Choice]) -> None:
    for c in choices:
        await c.stream.aclose()  # cancels the RPC if it is still running


async def _items(c: Choice) -> AsyncIterator[Chunk | Summary]:
    if c.first is not None:
        yield c.first
    async for item in c.stream:
        yield item


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Chunk | Summary]]:
    """Items of every choice as they come (one choice: read directly, no task hop)."""
    if len(choices) == 1:
        async for item in _items(choices[0]):
            yield choices[0], item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async for item in _items(c):
                await queue.put((c, item))
            await queue.put((c, None))
        except BaseException as exc:  # handed to the reader
            await queue.put((c, exc))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        live = len(choices)
        while live:
            c, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield c, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
