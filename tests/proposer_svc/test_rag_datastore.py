"""Named corpora on disk: persist and reload, bad input refused with the document named, an
interrupted write (exception or killed process) leaves the previous version live, readers keep
serving while a corpus is rebuilt."""

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from proposer_svc.rag import datastore
from proposer_svc.rag.datastore import (
    Datastore,
    InvalidCorpusName,
    InvalidDocument,
    TokenizerMismatch,
    UnknownCorpus,
    decode_document,
    tokenize_documents,
)
from proposer_svc.rag.lookup import RagConfig, propose_tree

ROOT = Path(__file__).resolve().parents[2]
CFG = RagConfig(min_match=2)


def _docs(seed: int = 0, n: int = 5, length: int = 50) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(f"doc{seed}-{i}.txt", rng.integers(0, 500, length).astype(np.uint32)) for i in range(n)]


def _state(store: Datastore, name: str) -> tuple:
    c = store.get(name)
    return c.tokenizer_hash, c.documents, c.index.tokens.tolist(), c.index.sa.tolist()


@pytest.fixture
def word_tokenizer():
    """A real (tiny) word-level tokenizer with an unknown token, built with the tokenizers library."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "on": 4, "mat": 5, ".": 6}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")


def test_corpus_persists_and_reloads_with_identical_index_and_lookups(tmp_path):
    store = Datastore(tmp_path)
    docs = _docs()
    store.add_documents("books", "h1", docs)
    store.add_documents("code", "h1", _docs(seed=1))
    again = Datastore(tmp_path)
    assert again.names() == ["books", "code"]
    assert _state(again, "books") == _state(store, "books")
    assert [d.name for d in again.get("books").documents] == [n for n, _ in docs]
    ctx = docs[2][1][10:20].tolist()
    want = propose_tree(store.get("books").index, ctx, CFG, 8, 6)
    assert want[0] == docs[2][1][20:26].tolist()[: len(want[0])] and want[0]
    assert propose_tree(again.get("books").index, ctx, CFG, 8, 6) == want


def test_reingesting_a_document_replaces_it_and_replace_drops_the_others(tmp_path):
    store = Datastore(tmp_path)
    store.add_documents("c", "h1", [("a", np.array([1, 2, 3])), ("b", np.array([4, 5]))])
    store.add_documents("c", "h1", [("a", np.array([7, 8])), ("z", np.array([9]))])
    c = store.get("c")
    assert [(d.name, d.tokens) for d in c.documents] == [("b", 2), ("a", 2), ("z", 1)]
    assert propose_tree(c.index, [4, 5], RagConfig(min_match=1), 4, 2) == ([], [])  # b ends after 5
    assert propose_tree(c.index, [0, 7], RagConfig(min_match=1), 4, 2) == ([8], [-1])
    store.add_documents("c", "h1", [("only", np.array([1, 1]))], replace=True)
    assert [d.name for d in Datastore(tmp_path).get("c").documents] == ["only"]


def test_unknown_corpus_bad_names_and_tokenizer_mismatch_are_refused_clearly(tmp_path):
    store = Datastore(tmp_path)
    store.add_documents("c", "h1", _docs())
    with pytest.raises(UnknownCorpus, match=r"unknown corpus 'nope' \(known: c\)"):
        store.get("nope")
    for bad in ("", "../up", "a/b", ".hidden", "x" * 65):
        with pytest.raises(InvalidCorpusName):
            store.add_documents(bad, "h1", _docs())
    before = _state(store, "c")
    with pytest.raises(TokenizerMismatch, match="tokenizer h1, this proposer's is h2"):
        store.add_documents("c", "h2", _docs(seed=3))
    assert _state(store, "c") == before == _state(Datastore(tmp_path), "c")
    store.add_documents("c", "h2", _docs(seed=3), replace=True)  # an explicit rebuild is allowed
    assert store.get("c").tokenizer_hash == "h2"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty"),
        (b" \n\t\n", "only whitespace"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", r"binary data \(NUL byte at offset 8\)"),
        (b"caf\xe9 latin-1", r"not UTF-8 text \(invalid byte 0xe9 at offset 3\)"),
    ],
)
def test_empty_binary_and_non_utf8_documents_are_refused_naming_the_file(data, reason):
    with pytest.raises(InvalidDocument, match=rf"document 'notes/x\.txt': {reason}"):
        decode_document("notes/x.txt", data)


def test_text_the_tokenizer_cannot_represent_is_refused_naming_the_file(word_tokenizer):
    ok = tokenize_documents(word_tokenizer, [("a.txt", "the cat sat on the mat .")])
    assert ok[0].tolist() == [1, 2, 3, 4, 1, 5, 6]
    with pytest.raises(InvalidDocument, match=r"document 'b.txt': 2 of 6 tokens are the unknown token '\[UNK\]'"):
        tokenize_documents(word_tokenizer, [("a.txt", "the cat"), ("b.txt", "the dog sat on a mat")])


def test_a_tokenizer_that_raises_is_reported_with_the_document_name():
    class Refusing:  # a tokenizer front that rejects one text, as a broken custom tokenizer would
        def __call__(self, texts, **kw):
            if "\u202e" in (texts if isinstance(texts, str) else "".join(texts)):
                raise ValueError("unsupported bidi control")
            return {"input_ids": [[1] for _ in texts]}

    with pytest.raises(InvalidDocument, match=r"document 'rtl.txt': the tokenizer cannot handle it: ValueError"):
        tokenize_documents(Refusing(), [("a.txt", "fine"), ("rtl.txt", "abc\u202edef")])


@pytest.mark.slow
def test_target_tokenizer_keeps_special_token_strings_as_text():
    from transformers import AutoTokenizer

    from specmesh_server.model_loading import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path())
    [ids] = tokenize_documents(tok, [("chat.txt", "user says <|im_start|> here")])
    assert tok.convert_tokens_to_ids("<|im_start|>") not in ids.tolist()
    assert tok.decode(ids.tolist()) == "user says <|im_start|> here"


def test_a_write_failing_midway_leaves_the_previous_version_live(tmp_path, monkeypatch):
    store = Datastore(tmp_path)
    store.add_documents("c", "h1", _docs())
    before = _state(store, "c")
    real_save = datastore._save_array

    def failing_save(path, arr):
        if path.name == "sa.npy":
            raise OSError(28, "No space left on device")
        real_save(path, arr)

    monkeypatch.setattr(datastore, "_save_array", failing_save)
    with pytest.raises(OSError, match="No space left"):
        store.add_documents("c", "h1", _docs(seed=7))
    assert _state(store, "c") == before  # in memory: the old snapshot still serves
    assert sorted(p.name for p in (tmp_path / "c").iterdir() if p.name.startswith(".tmp")) == []
    assert _state(Datastore(tmp_path), "c") == before  # on disk too


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    from proposer_svc.rag import datastore
    point = sys.argv[2]
    if point == "mid-write":
        real = datastore._save_array
        def save(path, arr):
            real(path, arr)
            if path.name == "tokens.npy":
                os.kill(os.getpid(), signal.SIGKILL)
        datastore._save_array = save
    else:  # killed after the new version folder is complete, before CURRENT is swapped
        real_replace = os.replace
        def replace(src, dst):
            if str(dst).endswith("CURRENT"):
                os.kill(os.getpid(), signal.SIGKILL)
            real_replace(src, dst)
        os.replace = replace
    store = datastore.Datastore(sys.argv[1])
    store.add_documents("c", "h1", [("new", np.arange(1000, dtype=np.uint32))])
    """
)


@pytest.mark.parametrize("point", ["mid-write", "before-commit"])
def test_an_ingest_killed_halfway_leaves_the_old_index_usable(tmp_path, point):
    store = Datastore(tmp_path)
    store.add_documents("c", "h1", _docs())
    before = _state(store, "c")
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, str(tmp_path), point], cwd=ROOT, capture_output=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr.decode()
    leftovers = [p.name for p in (tmp_path / "c").iterdir() if p.is_dir()]
    assert len(leftovers) == 2  # the live version and the interrupted one
    reloaded = Datastore(tmp_path)
    assert _state(reloaded, "c") == before
    assert len([p for p in (tmp_path / "c").iterdir() if p.is_dir()]) == 1  # leftovers cleaned at load
    reloaded.add_documents("c", "h1", _docs(seed=2))  # and the store stays writable
    assert len(Datastore(tmp_path).get("c").documents) == 10


def test_a_corpus_killed_before_its_first_commit_does_not_exist(tmp_path):
    (tmp_path / "half" / ".tmp-abc").mkdir(parents=True)
    (tmp_path / "half" / ".tmp-abc" / "tokens.npy").write_bytes(b"partial")
    store = Datastore(tmp_path)
    assert store.names() == [] and not (tmp_path / "half").exists()


def test_a_damaged_corpus_is_skipped_and_the_others_load(tmp_path):
    store = Datastore(tmp_path)
    store.add_documents("good", "h1", _docs())
    store.add_documents("bad", "h1", _docs(seed=1))
    version = (tmp_path / "bad" / "CURRENT").read_text()
    np.save(tmp_path / "bad" / version / "sa.npy", np.arange(3, dtype=np.int32))
    assert Datastore(tmp_path).names() == ["good"]


def test_readers_keep_proposing_from_their_snapshot_while_an_ingest_rebuilds(tmp_path):
    store = Datastore(tmp_path)
    store.add_documents("c", "h1", [("seed", np.array([1, 2, 3, 4], dtype=np.uint32))])
    stop = threading.Event()
    answers: list[tuple[list[int], list[int]]] = []
    errors: list[BaseException] = []

    def reader():
        try:
            while not stop.is_set():
                answers.append(propose_tree(store.get("c").index, [1, 2], CFG, 4, 2))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    try:
        big = np.random.default_rng(0).integers(5, 40_000, 400_000).astype(np.uint32)
        store.add_documents("c", "h1", [("big", big), ("seed2", np.array([1, 2, 9], dtype=np.uint32))])
    finally:
        stop.set()
        t.join()
    assert not errors and len(answers) > 10
    assert all(a in (([3, 4], [-1, 0]), ([3, 9, 4], [-1, -1, 0]), ([9, 3, 4], [-1, -1, 1])) for a in answers)
    assert propose_tree(store.get("c").index, [1, 2], CFG, 4, 2)[0] in ([3, 9, 4], [9, 3, 4])
