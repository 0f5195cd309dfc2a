"""``specmesh serve rag``: the retrieval proposer, one process serving two services.

- ``ProposerService.Propose``: per stream, the corpus named in ``ProposeStart.corpus`` (or the
  ``--default-corpus``) is looked up for every Start/Advance (``proposer_svc/rag/lookup.py``). An
  unknown or missing corpus aborts the stream with ``INVALID_ARGUMENT``; a verifier whose
  tokenizer differs from the corpus's with ``FAILED_PRECONDITION``.
- ``RagService.Ingest`` / ``ListCorpora``: the datastore (``proposer_svc/rag/datastore.py``),
  tokenized with the target model's tokenizer (only the tokenizer is loaded). Ingest work runs
  in a worker thread, so Propose streams keep being answered while a corpus is re-indexed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from proposer_svc.core.process import ServingConfig, add_serving_flags, proposer_server, serve_proposer, serving_config
from proposer_svc.core.stream import Opener, ProposeStream, StreamConfig, StreamRefused, inline
from proposer_svc.rag.datastore import (
    Corpus,
    Datastore,
    InvalidCorpusName,
    InvalidDocument,
    TokenizerMismatch,
    UnknownCorpus,
    check_corpus_name,
    decode_document,
    default_data_dir,
    tokenize_documents,
)
from proposer_svc.rag.lookup import CorpusIndex, RagConfig, RagRequest, concat_documents, propose_tree
from specmesh.v1 import proposer_pb2, rag_pb2, rag_pb2_grpc
from specmesh_server.flags import ServiceFlags, at_least
from specmesh_server.metrics import ProposerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RagServerConfig:
    serving: ServingConfig = field(default_factory=lambda: ServingConfig("127.0.0.1:50063"))
    model: str | None = None  # the target model: its tokenizer tokenizes the corpora
    data_dir: Path | None = None  # None = default_data_dir()
    default_corpus: str = ""  # for streams that name no corpus; "" = such streams are refused
    lookup: RagConfig = field(default_factory=RagConfig)
    max_ingest_bytes: int = 1 << 30  # per Ingest call


def rag_opener(
    store: Datastore, config: RagConfig, default_corpus: str = "", metrics: ProposerMetrics | None = None
) -> Opener:
    """Per-stream state: a lookup over the snapshot of the named corpus taken at Start."""

    def make(start: proposer_pb2.ProposeStart) -> RagRequest:
        name = start.corpus or default_corpus
        if not name:
            raise StreamRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"corpus: the rag proposer needs a corpus name (SpecDecodeParams.corpus); known: "
                f"{', '.join(store.names()) or 'none'}",
            )
        try:
            corpus = store.get(name)
        except UnknownCorpus as exc:
            raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, f"corpus: {exc}") from None
        want = start.vocab.tokenizer_hash
        if want and want != corpus.tokenizer_hash:
            raise StreamRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"corpus {name!r} was tokenized with tokenizer {corpus.tokenizer_hash}, the verifier's is {want}",
            )
        return RagRequest(corpus.index, config)

    return inline(make, metrics)


def corpus_info(corpus: Corpus) -> rag_pb2.CorpusInfo:
    return rag_pb2.CorpusInfo(
        name=corpus.name,
        documents=len(corpus.documents),
        tokens=corpus.num_tokens,
        tokenizer_hash=corpus.tokenizer_hash,
        updated_unix_s=corpus.updated_unix_s,
    )


class RagServicer(rag_pb2_grpc.RagServiceServicer):
    def __init__(self, store: Datastore, tokenizer: Any, tokenizer_hash: str, model: str, max_bytes: int) -> None:
        self.store, self.tokenizer, self.tokenizer_hash = store, tokenizer, tokenizer_hash
        self.model, self.max_bytes = model, max_bytes
        self._lock = threading.Lock()  # one ingest at a time (the tokenizer toggles backend state per call)

    async def Ingest(
        self, request_iterator: AsyncIterator[rag_pb2.IngestRequest], context: grpc.aio.ServicerContext
    ) -> rag_pb2.IngestResponse:
        start: rag_pb2.IngestStart | None = None
        docs: list[tuple[str, bytearray]] = []
        seen: set[str] = set()
        total = 0
        async for msg in request_iterator:
            kind = msg.WhichOneof("event")
            if kind == "start":
                if start is not None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "start: sent twice")
                try:
                    check_corpus_name(msg.start.corpus)
                except InvalidCorpusName as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"start.corpus: {exc}")
                start = msg.start
            elif kind == "chunk":
                name = msg.chunk.document
                if start is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "chunk before start")
                if not name:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "chunk.document: empty name")
                total += len(msg.chunk.data)
                if total > self.max_bytes:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, f"ingest over {self.max_bytes} bytes; split it into calls"
                    )
                if docs and docs[-1][0] == name:
                    docs[-1][1].extend(msg.chunk.data)
                elif name in seen:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"document {name!r}: sent twice")
                else:
                    seen.add(name)
                    docs.append((name, bytearray(msg.chunk.data)))
            else:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty message")
        if start is None or not docs:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an ingest needs a start and at least one document")
        code, message, resp = grpc.StatusCode.OK, "", None
        try:
            resp = await asyncio.to_thread(self._ingest, start.corpus, docs, start.replace)
        except (InvalidDocument, InvalidCorpusName) as exc:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except TokenizerMismatch as exc:
            code, message = grpc.StatusCode.FAILED_PRECONDITION, str(exc)
        if resp is None:
            log.warning("ingest into %s refused: %s", start.corpus, message)
            await context.abort(code, message)
        return resp

    def _ingest(self, corpus: str, docs: list[tuple[str, bytearray]], replace: bool) -> rag_pb2.IngestResponse:
        with self._lock:
            return self._ingest_locked(corpus, docs, replace)

    def _ingest_locked(self, corpus: str, docs: list[tuple[str, bytearray]], replace: bool) -> rag_pb2.IngestResponse:
        t0 = time.perf_counter()
        texts = [(name, decode_document(name, bytes(data))) for name, data in docs]
        tokens = tokenize_documents(self.tokenizer, texts)
        t1 = time.perf_counter()
        result = self.store.add_documents(
            corpus, self.tokenizer_hash, [(n, t) for (n, _), t in zip(texts, tokens, strict=True)], replace=replace
        )
        t2 = time.perf_counter()
        added = sum(len(t) for t in tokens)
        log.info("corpus %s: +%d documents, +%d tokens (tokenize %.0f ms, index %.0f ms)", corpus, len(docs), added,
                 (t1 - t0) * 1e3, (t2 - t1) * 1e3)  # fmt: skip
        return rag_pb2.IngestResponse(
            corpus=corpus_info(result),
            documents_added=len(docs),
            tokens_added=added,
            tokenize_ms=(t1 - t0) * 1e3,
            index_ms=(t2 - t1) * 1e3,
        )

    async def ListCorpora(
        self, request: rag_pb2.ListCorporaRequest, context: grpc.aio.ServicerContext
    ) -> rag_pb2.ListCorporaResponse:
        return rag_pb2.ListCorporaResponse(
            corpora=[corpus_info(c) for c in self.store.corpora()], tokenizer_hash=self.tokenizer_hash, model=self.model
        )


def build_flags() -> ServiceFlags:
    """The rag proposer's flags (``specmesh serve rag --help``)."""
    d = RagConfig()
    f = ServiceFlags("specmesh serve rag", "SpecMesh retrieval (RAG lookup) proposer.")
    add_serving_flags(f, RagServerConfig().serving.address)
    f.add("--model", None, str, "target model (HF folder or .gguf) whose tokenizer tokenizes the corpora")
    f.add("--data-dir", None, str, "corpora folder; unset: $SPECMESH_RAG_DATA_DIR, else the cache dir's rag/")
    f.add("--default-corpus", "", str, "corpus for streams that name none (empty: such streams are refused)")
    f.add("--min-match", d.min_match, int, "shortest context suffix looked up", minimum=1)
    f.add("--max-match", d.max_match, int, "longest context suffix looked up")
    f.add("--max-occurrences", d.max_occurrences, int, "occurrences merged per lookup", minimum=1)
    f.add("--max-nodes", d.max_nodes, int, "tree nodes per proposal when the verifier sets no budget", minimum=1)
    f.add("--max-depth", d.max_depth, int, "tree depth per proposal when the verifier sets no budget", minimum=1)
    f.add("--max-ingest-bytes", RagServerConfig.max_ingest_bytes, int, "largest Ingest call", minimum=1)
    return f


def parse_args(argv: list[str] | None = None) -> RagServerConfig:
    f = build_flags()
    a = f.parse(argv)
    serving = serving_config(f, a)
    at_least(f, "--max-match", a.max_match, a.min_match)
    return RagServerConfig(
        serving=serving,
        model=a.model,
        data_dir=Path(a.data_dir) if a.data_dir else None,
        default_corpus=a.default_corpus,
        lookup=RagConfig(a.min_match, a.max_match, a.max_occurrences, a.max_nodes, a.max_depth),
        max_ingest_bytes=a.max_ingest_bytes,
    )


def warm_up_compiled() -> None:
    """Compile (or load from numba's cache) the lookup's kernels before the port opens, not on a first request."""
    index = CorpusIndex.build(concat_documents([[1, 2, 3, 4], [1, 2, 3, 5]]))
    propose_tree(index, [1, 2, 3], RagConfig(), max_nodes=4, max_depth=2)


async def run(cfg: RagServerConfig) -> None:
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    await asyncio.to_thread(warm_up_compiled)
    log.info("rag kernels ready in %.1f s", time.perf_counter() - t0)

    from specmesh_server.model_loading import DEFAULT_MODEL, resolve_model_path, tokenizer_hash

    path = resolve_model_path(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    thash = tokenizer_hash(tokenizer)
    store = Datastore(cfg.data_dir or default_data_dir())
    log.info("datastore %s: corpora %s; tokenizer %s", store.root, store.names() or "none", thash)
    server = proposer_server(cfg.serving)
    model = cfg.model or DEFAULT_MODEL
    rag_pb2_grpc.add_RagServiceServicer_to_server(
        RagServicer(store, tokenizer, thash, model, cfg.max_ingest_bytes), server
    )
    metrics = ProposerMetrics("rag")
    opener = rag_opener(store, cfg.lookup, cfg.default_corpus, metrics)
    proposer = ProposeStream(StreamConfig(proposer="rag", limits=cfg.serving.limits), opener, metrics)
    rag = rag_pb2.DESCRIPTOR.services_by_name["RagService"].full_name
    await serve_proposer(server, proposer, cfg.serving, "rag", [rag])


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(parse_args(argv)))
