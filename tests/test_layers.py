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


def test_an_import_up_a_floor_or_between_peers_breaks_a_contract(tmp_path: Path) -> None:
    # negative control: the same contracts over a copy of the tree with three forbidden arrows added
    for folder, name in PACKAGES.items():
        shutil.copytree(ROOT / folder, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (tmp_path / "specmesh_server" / "_probe.py").write_text("def f():\n    import verifier_svc.engine\n")
    (tmp_path / "verifier_svc" / "_probe.py").write_text("import proposer_svc.core.stream\n")
    (tmp_path / "specmesh" / "_probe.py").write_text("import torch\n")
    done = lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "specmesh_server._probe -> verifier_svc.engine" in done.stdout
    assert "verifier_svc._probe -> proposer_svc.core.stream" in done.stdout
    assert "specmesh._probe -> torch" in done.stdout
