"""The verifier's side of one request's ``ProposerService.Propose`` stream.

I/O runs on the asyncio loop; the engine thread only calls the thread-safe methods
(``take``, ``advance``, ``close``, ``fail``). Trees are validated as they arrive, so the engine
never sees a malformed one; a stream that errors, ends or falls silent marks the session
failed with a reason, and the request goes on without speculation.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from specmesh.v1 import proposer_pb2, proposer_pb2_grpc
from specmesh_server import loop_posts
from specmesh_server.log_limit import RateLimitedLog
from specmesh_server.tree import InvalidTree, TokenTree, rebase, validate_tree

if TYPE_CHECKING:
    from verifier_svc.request_speculation import ProposerSession

log = logging.getLogger(__name__)
warn = RateLimitedLog(log)  # invalid trees and failures repeat per step / per request: one line per 10 s

# After End, how long a proposer has to end its side before the call is cancelled: a proposer
# that never does must not keep one stream per finished request open forever.
CLOSE_GRACE_S = 2.0


# A proposer ending a stream with these before its first tree refuses the request (bad corpus,
# foreign tokenizer): the client named it, so the client hears why.
_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


@dataclass(frozen=True)
class ProposerLimits:
    vocab_size: int
    max_nodes: int
    max_depth: int


class GrpcProposerSession:
    """One request's ``Propose`` stream (a ``speculation.ProposerSession``)."""

    def __init__(
        self,
        name: str,
        stub: proposer_pb2_grpc.ProposerServiceStub,
        loop: asyncio.AbstractEventLoop,
        start: proposer_pb2.ProposeStart,
        limits: ProposerLimits,
        arrived: threading.Condition,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.name, self.stub, self.loop, self.limits = name, stub, loop, limits
        self.metadata = metadata  # the tier token, if the proposers need one
        self._start = start
        self._outbox: asyncio.Queue[proposer_pb2.ProposeRequest | None] = asyncio.Queue()
        self._arrived = arrived  # shared with the engine: notified whenever a tree lands
        self._tree: tuple[int, TokenTree] | None = None
        self.sent: TokenTree | None = None  # what the last take() served from, as the proposer sent it
        self.failed: str | None = None
        self._ended = False  # End sent (request finished, cancelled or failed)
        self.invalid_trees = 0
        self.last_invalid = ""
        self._task: asyncio.Task | None = None
        self.last_response = time.perf_counter()  # liveness: any answer, even one for an old context
        self.first_reply: asyncio.Future[None] = loop.create_future()  # the first tree, or the stream's end
        self.refused: tuple[grpc.StatusCode, str] | None = None  # the proposer refused the request itself
        self.hidden_dtype: int | None = None  # set once the proposer asks for hidden states

    # --- asyncio side ---------------------------------------------------------------------
    def open(self) -> None:
        """Start the stream (call on the loop)."""
        self._outbox.put_nowait(proposer_pb2.ProposeRequest(start=self._start))
        self._task = self.loop.create_task(self._run())

    async def _requests(self) -> AsyncIterator[proposer_pb2.ProposeRequest]:
        while (msg := await self._outbox.get()) is not None:
            yield msg

    async def _run(self) -> None:
        call = self.stub.Propose(self._requests(), metadata=self.metadata)
        try:
            async for resp in call:
                self._receive(resp)
                if not self.first_reply.done():
                    self.first_reply.set_result(None)
            if self.failed is None and not self._closed():
                self.fail("proposer ended the stream")
        except asyncio.CancelledError:
            call.cancel()
        except grpc.aio.AioRpcError as exc:
            if not self.first_reply.done() and exc.code() in _REFUSALS:
                self.refused = (exc.code(), exc.details() or "")
            if not self._closed():
                self.fail(f"{exc.code().name}: {exc.details()}")
        finally:
            if not self.first_reply.done():
                self.first_reply.set_result(None)

    def _closed(self) -> bool:
        return self.failed is not None or self._ended

    def _receive(self, resp: proposer_pb2.ProposeResponse) -> None:
        if resp.HasField("hidden_states") and self.hidden_dtype is None:
            dtype = resp.hidden_states.dtype
            if dtype not in proposer_pb2.HiddenDtype.values():  # a newer or lying proposer: decode without it
                self.fail(f"asked for hidden states in an unknown dtype ({dtype})")
                return
            self.hidden_dtype = dtype  # the engine reads it; one int, never torn
        t = resp.tree
        dists = [(list(d.ids), list(d.probs)) for d in t.distributions] if t.distributions else None
        tree = TokenTree(list(t.tokens), list(t.parents), dists, list(t.path_probs) or None)
        try:
            validate_tree(tree, self.limits.vocab_size, self.limits.max_nodes, self.limits.max_depth)
        except InvalidTree as exc:
            self.invalid_trees += 1
            self.last_invalid = str(exc)
            warn.warning(("invalid tree", self.name), "proposer %s sent an invalid tree: %s", self.name, exc)
            tree = TokenTree([], [])  # answered, but nothing usable this step
        with self._arrived:
            self._tree = (resp.context_length, tree)
            self.last_response = time.perf_counter()
            self._arrived.notify_all()

    # --- engine thread --------------------------------------------------------------------
    def take(self, context_length: int, recent: list[int] | None = None) -> TokenTree | None:
        """The tree for exactly this context, if it has arrived (consumed).

        ``recent``: the context's last tokens, for a greedy request: a tree for an older context
        is then re-rooted below the tokens accepted since (``tree.rebase``), when it predicted them.
        """
        with self._arrived:
            got = self._tree
            tree, self._tree = serve_tree(got, context_length, recent)
            self.sent = got[1] if tree is not None and got is not None else None
            return tree

    def has_tree_for(self, context_length: int) -> bool:
        got = self._tree
        return got is not None and got[0] == context_length

    def advance(self, tokens: list[int], hidden: proposer_pb2.HiddenStates | None = None) -> None:
        advance = proposer_pb2.ProposeAdvance(accepted_token_ids=tokens, hidden_states=hidden)
        msg = proposer_pb2.ProposeRequest(advance=advance)
        loop_posts.post(self.loop, self._outbox.put_nowait, msg)

    def fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = f"proposer {self.name!r} failed: {reason}"
            warn.warning(("failed", self.name), "%s; request continues without speculation", self.failed)
        self.close()

    def close(self) -> None:
        """End the stream: End and half-close now, cancel the call after ``CLOSE_GRACE_S`` unless
        the proposer has ended its side by then. Any thread; once."""
        if self._ended:
            return
        self._ended = True
        loop_posts.post(self.loop, self._end)

    def _end(self) -> None:
        self._outbox.put_nowait(proposer_pb2.ProposeRequest(end=proposer_pb2.ProposeEnd()))
        self._outbox.put_nowait(None)
        self.loop.call_later(CLOSE_GRACE_S, self._cancel)

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()  # a no-op once the stream has ended; else _run cancels the call


Stored = tuple[int, TokenTree] | None  # (context length the tree was proposed for, tree)


def serve_tree(got: Stored, context_length: int, recent: list[int] | None) -> tuple[TokenTree | None, Stored]:
    """(the tree for ``context_length`` or None, what stays stored).

    An exact match is consumed; an older tree is re-rooted on the tokens accepted since (``recent``:
    the context's last tokens; deterministic trees only) and consumed; a newer one stays.

    >>> t = TokenTree([5, 6], [-1, 0])
    >>> serve_tree((10, t), 10, None)[0] is t
    True
    >>> serve_tree((10, t), 11, [9, 5])
    (TokenTree(tokens=[6], parents=[-1], dists=None, probs=None), None)
    >>> serve_tree((10, t), 11, None)[0] is None
    True
    """
    if got is None:
        return None, None
    ctx, tree = got
    if ctx == context_length:
        return tree, None
    behind = context_length - ctx
    if recent is None or not 0 < behind <= len(recent) or tree.dists is not None:
        return None, got if behind < 0 else None
    return rebase(tree, recent[-behind:]), None


def wait_for_trees(arrived: threading.Condition, wanted: list[tuple[ProposerSession, int]], budget_s: float) -> float:
    """Block until every session has its tree for the given context, or ``budget_s`` passes.

    Returns the seconds waited. Never waits on a failed session.
    """
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    with arrived:
        while True:
            if all(s.failed is not None or s.has_tree_for(n) for s, n in wanted):
                break
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            arrived.wait(left)
    return time.perf_counter() - t0
