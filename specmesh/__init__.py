"""SpecMesh client SDK. Imports grpc and protobuf only (no torch)."""

from specmesh.client import AsyncClient, Client, GenerationStream
from specmesh.credentials import TlsOptions
from specmesh.params import (
    Chunk,
    Completion,
    PromptLogprobs,
    SamplingParams,
    SpecDecodeParams,
    StructuredOutput,
    Summary,
    TokenLogprob,
    Tokens,
    TopLogprob,
)

__all__ = [
    "AsyncClient",
    "Chunk",
    "Client",
    "Completion",
    "GenerationStream",
    "PromptLogprobs",
    "SamplingParams",
    "SpecDecodeParams",
    "StructuredOutput",
    "Summary",
    "TlsOptions",
    "TokenLogprob",
    "Tokens",
    "TopLogprob",
]
__version__ = "0.1.0"
