"""The house rules (docs/ARCHITECTURE.md) as import-linter contracts (pyproject's ``[tool.importlinter]``).

``lint-imports`` reads every import of every module, function-level ones included, so a lazy
import that climbs a floor fails as surely as a top-level one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
# folder → import name, for a copy of the tree that imports without the editable install's mapping
PACKAGES = {
    "specmesh": "specmesh", "specmesh_server": "specmesh_server", "specmesh_bench": "specmesh_bench",
    "router": "specmesh_router", "kernels": "specmesh_kernels",
    "verifier_svc": "verifier_svc", "proposer_svc": "proposer_svc", "gateway_svc": "gateway_svc",
}  # fmt: skip


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=cwd, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_every_layering_contract_is_kept() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "BROKEN" not in done.stdout and "0 broken" in done.stdout


def test_every_contract_catches_a_planted_violation(tmp_path: Path) -> None:
    """Negative control: the same contracts over a copy of the tree with one forbidden arrow planted
    per contract; each must be reported, naming its arrow."""
    for folder, name in PACKAGES.items():
        shutil.copytree(ROOT / folder, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    plants = {  # file → (source, its one import); one per contract, the floors twice (up and between siblings)
        "specmesh_server/_probe.py": "def f():\n    import verifier_svc.engine\n",  # floors: up a floor, lazily
        "verifier_svc/_probe.py": "import proposer_svc.core.stream\n",  # floors: between services
        "proposer_svc/ngram/_probe.py": "import proposer_svc.suffix.index\n",  # proposers are peers
        "specmesh/_probe.py": "import torch\n",  # the SDK
        "specmesh_kernels/_probe.py": "import specmesh_server.paged_kv\n",  # the kernels import nothing of ours
        "specmesh_router/_probe.py": "import numpy\n",  # the router is plain Python
    }
    for path, source in plants.items():
        (tmp_path / path).write_text(source)
    done = lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    for arrow in (
        "specmesh_server._probe -> verifier_svc.engine",
        "verifier_svc._probe -> proposer_svc.core.stream",
        "proposer_svc.ngram._probe -> proposer_svc.suffix.index",
        "specmesh._probe -> torch",
        "specmesh_kernels._probe -> specmesh_server.paged_kv",
        "specmesh_router._probe -> numpy",
    ):
        assert arrow in done.stdout, f"{arrow} not reported:\n{done.stdout}"
    assert done.stdout.count("BROKEN") == 5, done.stdout  # every contract broke


def test_every_proposer_folder_is_a_peer_under_the_contract() -> None:
    """The peers contract lists every proposer under ``proposer_svc`` but ``core`` (which all import), so
    a new proposer folder is covered the day it is added."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    peers = next(c for c in contracts if c["type"] == "independence" and "proposer_svc.ngram" in c["modules"])
    folders = {
        f"proposer_svc.{p.name}"
        for p in (ROOT / "proposer_svc").iterdir()
        if p.is_dir() and (p / "__init__.py").is_file() and p.name != "core"
    }
    modules = {f"proposer_svc.{p.stem}" for p in (ROOT / "proposer_svc").glob("*.py") if p.stem != "__init__"}
    assert folders | modules == set(peers["modules"])


def test_ruff_finds_nothing_and_the_tree_is_formatted() -> None:
    """``make lint``'s ruff, in ``make test`` (so in CI): its rules include the ban on importing
    ``router`` / ``kernels`` by folder name."""
    ruff = Path(sys.executable).with_name("ruff")
    for args in (["check", "."], ["format", "--check", "."]):
        done = subprocess.run([str(ruff), *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, f"ruff {' '.join(args)}:\n{done.stdout}{done.stderr}"
