"""`make gpu-check` cannot rot: its dry run (``--device cpu --quick``: tiny shapes, Triton's interpreter)
runs every section's code on every CI run, the way the GPU machine runs it: a plain python3 with the
packages on its path but SpecMesh not installed (``-S``: no site hooks, so no editable install)."""

from __future__ import annotations

import doctest
import importlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def uninstalled_python() -> tuple[list[str], dict[str, str]]:
    """The base interpreter without site hooks, with this venv's packages on PYTHONPATH: torch and the rest
    import, ``specmesh`` does not (its editable install is a site hook), as on the GPU machine."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]
    return [str(base), "-S"], env


@pytest.mark.slow
def test_the_dry_run_runs_every_section_without_specmesh_installed(tmp_path):
    python, env = uninstalled_python()
    probe = subprocess.run([*python, "-c", "import specmesh"], env=env, capture_output=True, cwd=tmp_path)
    assert probe.returncode != 0, "specmesh importable: the run would not show what the GPU machine lacks"
    env["OUT"] = str(tmp_path / "out")
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    run = subprocess.run(
        [*python, script, "--device", "cpu", "--quick", "--work", str(tmp_path / "w")],
        env=env, capture_output=True, text=True, timeout=500, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "gpu-report.json").read_text())
    status = {s["name"]: s["status"] for s in report["sections"]}
    assert status == dict.fromkeys(
        ["environment", "tree_attention", "acceptance", "graphs", "end_to_end", "decode_step", "draft",
         "attention_numbers", "cost_curves", "gpu_tests"], "ok"
    ), status  # fmt: skip
    for key in ("device", "torch", "triton", "driver", "copy bandwidth"):
        assert key in report["header"]
    e2e = next(s for s in report["sections"] if s["name"] == "end_to_end")
    rows = e2e["tables"][0]["rows"]  # dtype, kernels, proposer, concurrent, requests, exact, near-tie, mismatch, …
    assert {(r[1], r[2], r[3]) for r in rows} >= {
        (k, p, c) for k in ("graphs", "off") for p in ("ngram", "oracle") for c in (1, 8)
    }
    assert all(r[5] == r[4] for r in rows), rows  # fp32 on a CPU: every output exactly generate()'s
    assert any("tree attention triton" in n for n in e2e["notes"]), e2e["notes"]  # the kernels really ran
    md = (tmp_path / "out" / "gpu-report.md").read_text()
    assert "## cost_curves: ok" in md and "oracle ceiling" in md
    graphs = next(s for s in report["sections"] if s["name"] == "graphs")
    titles = [t["title"] for t in graphs["tables"]]
    assert any("ms per decode step" in t for t in titles) and any("projected speed-up" in t for t in titles)
    equality = next(t for t in graphs["tables"] if t["title"].startswith("greedy equality"))
    assert [(r[0], r[2]) for r in equality["rows"]] == [("static step (eager)", 2), ("eager step", 2)]


def test_a_section_that_raises_fails_alone_and_a_spent_budget_skips(tmp_path):
    from gpu_kit.report import Deadline, Report

    report = Report({"device": "test"}, tmp_path)
    total = Deadline(60)
    report.run("boom", lambda ctx, sec, d: 1 / 0, None, 10, total)
    report.run("fine", lambda ctx, sec, d: None, None, 10, total)
    report.run("late", lambda ctx, sec, d: None, None, 10, Deadline(0))
    assert [s.status for s in report.sections] == ["error", "ok", "skipped"]
    assert "ZeroDivisionError" in report.sections[0].notes[0]
    assert not report.ok
    saved = json.loads((tmp_path / "gpu-report.json").read_text())
    assert [s["status"] for s in saved["sections"]] == ["error", "ok", "skipped"]


def test_the_bundle_knows_what_the_gpu_image_brings():
    from gpu_bundle import requirements_closure

    image = requirements_closure(("torch", "transformers"))
    assert {"torch", "transformers", "filelock", "huggingface-hub"} <= image
    assert "grpcio" not in image


@pytest.mark.parametrize("module", ["gpu_kit.report", "gpu_bundle"])
def test_doctests(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


def test_the_bundle_is_unzipped_once_and_only_for_the_python_it_was_made_for(tmp_path, monkeypatch):
    import zipfile

    import gpu_check

    (tmp_path / ".whl" / "fallback").mkdir(parents=True)
    with zipfile.ZipFile(tmp_path / ".whl" / "demo-1.0-py3-none-any.whl", "w") as z:
        z.writestr("demo/__init__.py", "VALUE = 1\n")
    with zipfile.ZipFile(tmp_path / ".whl" / "fallback" / "old-1.0-py3-none-any.whl", "w") as z:
        z.writestr("old/__init__.py", "")
    monkeypatch.setattr(gpu_check, "BUNDLE_PYTHON", (0, 0))
    gpu_check.unpack_bundle(tmp_path)
    assert not (tmp_path / ".whl" / "site").exists()  # cp312 wheels are not for this python
    monkeypatch.setattr(gpu_check, "BUNDLE_PYTHON", sys.version_info[:2])
    gpu_check.unpack_bundle(tmp_path)
    assert (tmp_path / ".whl" / "site" / "demo" / "__init__.py").read_text() == "VALUE = 1\n"
    assert (tmp_path / ".whl" / "fallback-site" / "old" / "__init__.py").is_file()
    (tmp_path / ".whl" / "site" / "demo" / "__init__.py").write_text("VALUE = 2\n")
    gpu_check.unpack_bundle(tmp_path)  # the same wheels: not unpacked again
    assert (tmp_path / ".whl" / "site" / "demo" / "__init__.py").read_text() == "VALUE = 2\n"
