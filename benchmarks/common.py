"""What the benchmark scripts share: the machine's description and the vendored workload."""

from __future__ import annotations

import json
import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "workloads" / "specbench_offline_dev.jsonl"


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.processor())


def workload_rows() -> list[dict]:
    return [json.loads(x) for x in WORKLOAD.read_text().splitlines() if x.strip()]
