"""Where SpecMesh keeps files on this machine: converted models, RAG data, the local deployment's state.

Client-side (stdlib only): ``specmesh status`` reads the run state on a client-only install.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$SPECMESH_CACHE_DIR, else $XDG_CACHE_HOME/specmesh (~/.cache/specmesh)."""
    if env := os.environ.get("SPECMESH_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "specmesh"
