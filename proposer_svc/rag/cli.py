"""``specmesh rag``: fill and inspect the retrieval proposer's datastore over ``RagService``.

    specmesh rag ingest FILE… --corpus NAME [--replace] [--text TEXT]… [--target host:port]
    specmesh rag list [--target host:port]

A file's document name is its path as given, so ingesting the same path again replaces that
document. Imports no torch or numpy: the server tokenizes and indexes. The upload shows a tqdm
bar on stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from tqdm import tqdm

from specmesh.credentials import TlsOptions, add_client_flags, bearer, client_tls, client_token, read_token
from specmesh.credentials import channel as open_channel
from specmesh.v1 import rag_pb2, rag_pb2_grpc

DEFAULT_RAG_ADDRESS = "127.0.0.1:50063"
CHUNK_BYTES = 1 << 20  # well under gRPC's 4 MiB message limit


def default_target() -> str:
    """$SPECMESH_RAG_ADDRESS, else the rag service of the running ``specmesh up``, else the default port."""
    if env := os.environ.get("SPECMESH_RAG_ADDRESS"):
        return env
    from specmesh.deploy import known_services

    return known_services().get("rag", DEFAULT_RAG_ADDRESS)


def ingest_requests(
    corpus: str, files: list[Path], texts: list[str], replace: bool, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[rag_pb2.IngestRequest]:
    """Start, then each document in chunks (an empty file still sends one, empty, chunk)."""
    yield rag_pb2.IngestRequest(start=rag_pb2.IngestStart(corpus=corpus, replace=replace))
    for path in files:
        with path.open("rb") as f:
            first = True
            while (data := f.read(chunk_bytes)) or first:
                first = False
                yield rag_pb2.IngestRequest(chunk=rag_pb2.DocumentChunk(document=str(path), data=data))
    for text in texts:
        name = "text-" + hashlib.sha256(text.encode()).hexdigest()[:12]
        data = text.encode()
        for i in range(0, max(len(data), 1), chunk_bytes):
            yield rag_pb2.IngestRequest(chunk=rag_pb2.DocumentChunk(document=name, data=data[i : i + chunk_bytes]))


def _with_upload_bar(requests: Iterator[rag_pb2.IngestRequest], total_bytes: int) -> Iterator[rag_pb2.IngestRequest]:
    """``requests``, counting their bytes on a bar that closes when the last one is sent: the
    server's tokenizing and indexing that follow are one step each, with nothing to count."""
    with tqdm(total=total_bytes, desc="upload", unit="B", unit_scale=True, leave=False) as bar:
        for req in requests:
            yield req
            bar.update(len(req.chunk.data))  # 0 for the start message


def _ingest(stub: rag_pb2_grpc.RagServiceStub, a: argparse.Namespace, md: tuple) -> None:
    files = [Path(f) for f in a.files]
    for f in files:
        if not f.is_file():
            sys.exit(f"specmesh rag ingest: {f}: not a file")
    if not files and not a.text:
        sys.exit("specmesh rag ingest: give FILES or --text")
    texts = a.text or []
    total_bytes = sum(f.stat().st_size for f in files) + sum(len(t.encode()) for t in texts)
    t0 = time.perf_counter()
    requests = _with_upload_bar(ingest_requests(a.corpus, files, texts, a.replace), total_bytes)
    resp = stub.Ingest(requests, timeout=a.timeout, metadata=md)
    c = resp.corpus
    print(
        f"corpus {c.name}: +{resp.documents_added} documents, +{resp.tokens_added} tokens -> {c.documents} documents, "
        f"{c.tokens} tokens (tokenize {resp.tokenize_ms:.0f} ms, index {resp.index_ms:.0f} ms, "
        f"total {(time.perf_counter() - t0) * 1e3:.0f} ms)"
    )


def _list(stub: rag_pb2_grpc.RagServiceStub, a: argparse.Namespace, md: tuple) -> None:
    resp = stub.ListCorpora(rag_pb2.ListCorporaRequest(), timeout=a.timeout, metadata=md)
    print(f"model {resp.model}, tokenizer {resp.tokenizer_hash}")
    print(f"{'corpus':<24} {'documents':>9} {'tokens':>12}  {'tokenizer':<16}  updated")
    for c in resp.corpora:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.updated_unix_s))
        print(f"{c.name:<24} {c.documents:>9} {c.tokens:>12}  {c.tokenizer_hash:<16}  {when}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specmesh rag", description="The retrieval proposer's corpora.")
    sub = p.add_subparsers(dest="cmd", required=True)
    ing = sub.add_parser("ingest", help="add files (UTF-8 text) to a corpus, creating it if needed")
    ing.add_argument("files", nargs="*", help="text files; a path ingested again replaces its document")
    ing.add_argument("--corpus", required=True)
    ing.add_argument("--text", action="append", help="literal text as one more document (repeatable)")
    ing.add_argument("--replace", action="store_true", help="drop the corpus's documents first")
    lst = sub.add_parser("list", help="corpora, documents and tokens")
    for q in (ing, lst):
        q.add_argument("--target", default=None, help=f"rag proposer host:port (default {DEFAULT_RAG_ADDRESS})")
        q.add_argument("--timeout", type=float, default=600.0, help="seconds")
        add_client_flags(q)  # the rag proposer's TLS, and its tier token (--auth-token-file) as --token-file
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    target = a.target or default_target()
    tls, token = client_tls(a), client_token(a)
    from specmesh.deploy import known_credentials, known_services

    if target == known_services().get("rag"):  # the running `specmesh up`: its certificates and tier token
        local_tls, local_tokens = known_credentials()
        if tls is None and local_tls:
            tls = TlsOptions(ca=local_tls["ca"], cert=local_tls["cert"], key=local_tls["key"])
        token = token or (read_token(local_tokens["proposer"]) if "proposer" in local_tokens else "")
    with open_channel(target, tls) as channel:
        stub = rag_pb2_grpc.RagServiceStub(channel)
        try:
            {"ingest": _ingest, "list": _list}[a.cmd](stub, a, bearer(token))
        except grpc.RpcError as exc:
            sys.exit(f"specmesh rag {a.cmd}: {exc.code().name}: {exc.details()}")
