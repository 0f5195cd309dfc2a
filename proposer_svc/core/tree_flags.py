"""The batched tree search's serving flags (``core.tree_search``), shared by the draft and the head
proposers: ``--max-batch``, ``--max-nodes``, ``--max-depth``, ``--width``, ``--branch``."""

from __future__ import annotations

import argparse
from typing import Any

from specmesh_server.flags import ServiceFlags

TREE_FIELDS = ("max_batch", "max_nodes", "max_depth", "width", "branch")


def add_tree_flags(f: ServiceFlags, d: Any, forward: str) -> None:
    """The tree flags, defaults from ``d``'s fields of the same names; ``forward``: what one drafting
    step runs (in ``--max-batch``'s help)."""
    f.add("--max-batch", d.max_batch, int, f"requests drafted together in one {forward}", minimum=1)
    f.add("--max-nodes", d.max_nodes, int, "tree nodes per proposal (caps the verifier's budget)", minimum=1)
    f.add("--max-depth", d.max_depth, int, "tree depth per proposal (caps the verifier's budget)", minimum=1)
    f.add("--width", d.width, int, "frontier nodes expanded per level", minimum=1)
    f.add("--branch", d.branch, int, "children per expanded node", minimum=1)


def tree_settings(a: argparse.Namespace) -> dict[str, int]:
    """The parsed ``add_tree_flags``, as config fields.

    >>> tree_settings(argparse.Namespace(max_batch=8, max_nodes=12, max_depth=3, width=4, branch=2, port=1))
    {'max_batch': 8, 'max_nodes': 12, 'max_depth': 3, 'width': 4, 'branch': 2}
    """
    return {k: getattr(a, k) for k in TREE_FIELDS}
