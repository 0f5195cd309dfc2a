"""What the benchmark scripts share with `specmesh bench`: the machine's description and the
vendored workload."""

from __future__ import annotations

from specmesh_bench.cli import cpu_name
from specmesh_bench.workload import DEFAULT_WORKLOAD as WORKLOAD
from specmesh_bench.workload import read_rows

__all__ = ["WORKLOAD", "cpu_name", "workload_rows"]


def workload_rows() -> list[dict]:
    return read_rows(WORKLOAD)
