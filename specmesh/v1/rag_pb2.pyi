from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class IngestStart(_message.Message):
    __slots__ = ("corpus", "replace")
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    corpus: str
    replace: bool
    def __init__(self, corpus: _Optional[str] = ..., replace: _Optional[bool] = ...) -> None: ...

class DocumentChunk(_message.Message):
    __slots__ = ("document", "data")
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    document: str
    data: bytes
    def __init__(self, document: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class IngestRequest(_message.Message):
    __slots__ = ("start", "chunk")
    START_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    start: IngestStart
    chunk: DocumentChunk
    def __init__(self, start: _Optional[_Union[IngestStart, _Mapping]] = ..., chunk: _Optional[_Union[DocumentChunk, _Mapping]] = ...) -> None: ...

class CorpusInfo(_message.Message):
    __slots__ = ("name", "documents", "tokens", "tokenizer_hash", "updated_unix_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    documents: int
    tokens: int
    tokenizer_hash: str
    updated_unix_s: float
    def __init__(self, name: _Optional[str] = ..., documents: _Optional[int] = ..., tokens: _Optional[int] = ..., tokenizer_hash: _Optional[str] = ..., updated_unix_s: _Optional[float] = ...) -> None: ...

class IngestResponse(_message.Message):
    __slots__ = ("corpus", "documents_added", "tokens_added", "tokenize_ms", "index_ms")
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_ADDED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ADDED_FIELD_NUMBER: _ClassVar[int]
    TOKENIZE_MS_FIELD_NUMBER: _ClassVar[int]
    INDEX_MS_FIELD_NUMBER: _ClassVar[int]
    corpus: CorpusInfo
    documents_added: int
    tokens_added: int
    tokenize_ms: float
    index_ms: float
    def __init__(self, corpus: _Optional[_Union[CorpusInfo, _Mapping]] = ..., documents_added: _Optional[int] = ..., tokens_added: _Optional[int] = ..., tokenize_ms: _Optional[float] = ..., index_ms: _Optional[float] = ...) -> None: ...

class ListCorporaRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListCorporaResponse(_message.Message):
    __slots__ = ("corpora", "tokenizer_hash", "model")
    CORPORA_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    corpora: _containers.RepeatedCompositeFieldContainer[CorpusInfo]
    tokenizer_hash: str
    model: str
    def __init__(self, corpora: _Optional[_Iterable[_Union[CorpusInfo, _Mapping]]] = ..., tokenizer_hash: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...
