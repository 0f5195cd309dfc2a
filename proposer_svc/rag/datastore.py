"""Named corpora on disk for the retrieval proposer: tokenized documents plus their suffix array.

Layout under the data dir, one folder per corpus::

    NAME/CURRENT            name of the live version folder (replaced atomically)
    NAME/v-<ns>-<pid>/      tokens.npy (uint32, documents separated by SEP), sa.npy, meta.json

A change writes a complete new version into a temporary folder, renames it to ``v-…`` and only
then swaps ``CURRENT`` (write-then-rename), so a crash at any point leaves the previous version
live; leftovers are removed at the next load. In memory a corpus is an immutable snapshot:
readers keep the one they took while an ingest builds the next.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from proposer_svc.rag.lookup import SEP, CorpusIndex, concat_documents

log = logging.getLogger(__name__)

CORPUS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
CURRENT = "CURRENT"
FORMAT_VERSION = 1


class InvalidDocument(ValueError):
    """A document that cannot be ingested; the message names it."""

    def __init__(self, document: str, reason: str) -> None:
        super().__init__(f"document {document!r}: {reason}")
        self.document = document


class InvalidCorpusName(ValueError):
    pass


class UnknownCorpus(KeyError):
    def __init__(self, name: str, known: Sequence[str]) -> None:
        super().__init__(name)
        self.message = f"unknown corpus {name!r} (known: {', '.join(known) or 'none; ingest one first'})"

    def __str__(self) -> str:
        return self.message


class TokenizerMismatch(RuntimeError):
    pass


def default_data_dir() -> Path:
    """$SPECMESH_RAG_DATA_DIR, else <specmesh cache dir>/rag."""
    if env := os.environ.get("SPECMESH_RAG_DATA_DIR"):
        return Path(env).expanduser()
    from specmesh.paths import cache_dir

    return cache_dir() / "rag"


def check_corpus_name(name: str) -> str:
    """A corpus name doubles as a folder name: letters, digits, ``._-``, at most 64 characters.

    >>> check_corpus_name("python-docs")
    'python-docs'
    >>> check_corpus_name("../etc")
    Traceback (most recent call last):
    ...
    proposer_svc.rag.datastore.InvalidCorpusName: corpus name '../etc': use letters, digits, '.', '_', '-' (max 64), starting with a letter or digit
    """  # noqa: E501
    if not CORPUS_NAME.fullmatch(name):
        raise InvalidCorpusName(
            f"corpus name {name!r}: use letters, digits, '.', '_', '-' (max 64), starting with a letter or digit"
        )
    return name


def decode_document(name: str, data: bytes) -> str:
    """The UTF-8 text of one document, or ``InvalidDocument`` saying why it is not text.

    >>> decode_document("a.txt", "héllo".encode())
    'héllo'
    >>> decode_document("b.bin", b"PK\\x03\\x04\\x00\\x00")
    Traceback (most recent call last):
    ...
    proposer_svc.rag.datastore.InvalidDocument: document 'b.bin': binary data (NUL byte at offset 4); only UTF-8 text can be ingested
    """  # noqa: E501
    if not data.strip():
        raise InvalidDocument(name, "empty" if not data else "only whitespace")
    if (nul := data.find(b"\x00")) >= 0:
        raise InvalidDocument(name, f"binary data (NUL byte at offset {nul}); only UTF-8 text can be ingested")
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        bad = data[exc.start : exc.start + 1].hex()
        raise InvalidDocument(name, f"not UTF-8 text (invalid byte 0x{bad} at offset {exc.start})") from None


def tokenize_documents(tokenizer: Any, documents: Sequence[tuple[str, str]]) -> list[np.ndarray]:
    """Token ids of each (name, text) with the target's tokenizer; special-token strings in the
    text stay text. ``InvalidDocument`` when the tokenizer fails, yields nothing or unknown tokens."""
    kwargs = {"add_special_tokens": False, "split_special_tokens": True}
    try:
        encoded = tokenizer([text for _, text in documents], **kwargs)["input_ids"]
    except Exception:  # find which document the tokenizer refuses
        for name, text in documents:
            try:
                tokenizer(text, **kwargs)
            except Exception as exc:
                raise InvalidDocument(name, f"the tokenizer cannot handle it: {type(exc).__name__}: {exc}") from None
        raise
    vocab_size = len(tokenizer)
    unk = getattr(tokenizer, "unk_token_id", None)
    out = []
    for (name, _), ids in zip(documents, encoded, strict=True):
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size == 0:
            raise InvalidDocument(name, "the tokenizer produced no tokens")
        if unk is not None and (n_unk := int((arr == unk).sum())):
            raise InvalidDocument(
                name, f"{n_unk} of {arr.size} tokens are the unknown token {tokenizer.unk_token!r}: text the "
                "tokenizer cannot represent"
            )  # fmt: skip
        if arr.min() < 0 or arr.max() >= min(vocab_size, SEP):
            raise InvalidDocument(name, f"the tokenizer produced ids outside [0, {vocab_size})")
        out.append(arr.astype(np.uint32))
    return out


@dataclass(frozen=True)
class DocumentInfo:
    name: str
    tokens: int


@dataclass(frozen=True)
class Corpus:
    name: str
    tokenizer_hash: str
    documents: tuple[DocumentInfo, ...]
    index: CorpusIndex
    updated_unix_s: float

    @property
    def num_tokens(self) -> int:
        return sum(d.tokens for d in self.documents)


class Datastore:
    """Every corpus under ``root``, loaded at construction; ``add_documents`` persists then swaps."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._corpora: dict[str, Corpus] = {}
        self._write_lock = threading.Lock()  # one ingest at a time; readers never wait
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            try:
                corpus = _load_corpus(folder)
            except Exception as exc:  # a damaged corpus must not keep the others from serving
                log.error("corpus %s not loaded: %s", folder.name, exc)
                continue
            if corpus is not None:
                self._corpora[corpus.name] = corpus
                log.info("corpus %s: %d documents, %d tokens", corpus.name, len(corpus.documents), corpus.num_tokens)

    def names(self) -> list[str]:
        return sorted(self._corpora)

    def corpora(self) -> list[Corpus]:
        return [self._corpora[n] for n in self.names()]

    def get(self, name: str) -> Corpus:
        corpus = self._corpora.get(name)
        if corpus is None:
            raise UnknownCorpus(name, self.names())
        return corpus

    def add_documents(
        self,
        name: str,
        tokenizer_hash: str,
        documents: Sequence[tuple[str, np.ndarray]],
        *,
        replace: bool = False,
    ) -> Corpus:
        """Append (or with ``replace``, set) documents of corpus ``name``, creating it if needed.

        A document whose name the corpus already holds replaces that document. The new version
        is on disk before it becomes visible; on any error the corpus stays as it was.
        """
        check_corpus_name(name)
        if not documents:
            raise InvalidDocument("(none)", "no documents to ingest")
        with self._write_lock:
            old = self._corpora.get(name)
            kept: list[tuple[DocumentInfo, np.ndarray]] = []
            if old is not None and not replace:
                if old.tokenizer_hash != tokenizer_hash:
                    raise TokenizerMismatch(
                        f"corpus {name!r} was tokenized with tokenizer {old.tokenizer_hash}, this proposer's is "
                        f"{tokenizer_hash}; ingest with replace to rebuild it"
                    )
                incoming = {doc_name for doc_name, _ in documents}
                kept = [(d, toks) for d, toks in _split_documents(old) if d.name not in incoming]
            docs = [*kept, *((DocumentInfo(n, len(t)), np.asarray(t, dtype=np.uint32)) for n, t in documents)]
            tokens = concat_documents([t for _, t in docs])
            index = CorpusIndex.build(tokens)
            corpus = Corpus(name, tokenizer_hash, tuple(d for d, _ in docs), index, time.time())
            _write_corpus(self.root / name, corpus)
            self._corpora[name] = corpus  # the swap readers see
            return corpus


def _split_documents(corpus: Corpus) -> list[tuple[DocumentInfo, np.ndarray]]:
    out, start = [], 0
    for d in corpus.documents:
        out.append((d, corpus.index.tokens[start : start + d.tokens]))
        start += d.tokens + 1  # + SEP
    return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_array(path: Path, arr: np.ndarray) -> None:
    with path.open("wb") as f:
        np.save(f, arr, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def _write_corpus(folder: Path, corpus: Corpus) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder))
    try:
        _save_array(tmp / "tokens.npy", corpus.index.tokens)
        _save_array(tmp / "sa.npy", corpus.index.sa)
        meta = {
            "format": FORMAT_VERSION,
            "name": corpus.name,
            "tokenizer_hash": corpus.tokenizer_hash,
            "updated_unix_s": corpus.updated_unix_s,
            "documents": [{"name": d.name, "tokens": d.tokens} for d in corpus.documents],
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
        _fsync_dir(tmp)
        version = f"v-{time.time_ns()}-{os.getpid()}"
        os.rename(tmp, folder / version)
        pointer = folder / f".{CURRENT}.tmp"
        pointer.write_text(version)
        os.replace(pointer, folder / CURRENT)  # the commit point
        _fsync_dir(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove_stale(folder, version)


def _remove_stale(folder: Path, live: str) -> None:
    for p in folder.iterdir():
        if p.is_dir() and p.name != live:
            shutil.rmtree(p, ignore_errors=True)


def _load_corpus(folder: Path) -> Corpus | None:
    """The live version of a corpus folder (None when no version was ever committed)."""
    pointer = folder / CURRENT
    if not pointer.is_file():
        log.warning("corpus folder %s has no committed version; removing leftovers", folder)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    version = pointer.read_text().strip()
    vdir = folder / version
    meta = json.loads((vdir / "meta.json").read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"unsupported datastore format {meta.get('format')!r}")
    tokens = np.load(vdir / "tokens.npy", allow_pickle=False)
    sa = np.load(vdir / "sa.npy", allow_pickle=False)
    docs = tuple(DocumentInfo(d["name"], int(d["tokens"])) for d in meta["documents"])
    expected = sum(d.tokens + 1 for d in docs)
    if tokens.dtype != np.uint32 or len(tokens) != expected or len(sa) != len(tokens):
        raise ValueError(f"{vdir}: {len(tokens)} tokens / {len(sa)} suffixes, meta says {expected}")
    _remove_stale(folder, version)  # versions of an interrupted or superseded write
    return Corpus(meta["name"], meta["tokenizer_hash"], docs, CorpusIndex(tokens, sa), float(meta["updated_unix_s"]))
