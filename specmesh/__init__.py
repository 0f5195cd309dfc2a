"""SpecMesh client SDK. Imports grpc and protobuf only (no torch)."""

from specmesh.client import AsyncClient, Client, GenerationStream
from specmesh.params import Chunk, Completion, SamplingParams, SpecDecodeParams, Summary

__all__ = [
    "AsyncClient",
    "Chunk",
    "Client",
    "Completion",
    "GenerationStream",
    "SamplingParams",
    "SpecDecodeParams",
    "Summary",
]
__version__ = "0.1.0"
