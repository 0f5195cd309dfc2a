"""The README and docs/ARCHITECTURE.md name only what exists: every command-line flag some service or
CLI of ours defines, every make target, every repository path and link, every Prometheus metric.

Fast and model-free: it reads text. Flags are the ``"--name"`` string literals of our source (outside
tests/), make targets the Makefile's rules, metrics the names our metrics modules register (with the
suffixes Prometheus adds), paths the filesystem.
"""

from __future__ import annotations

import re
import tomllib
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/ARCHITECTURE.md")
# markdown links only (tables of runs, mostly)
LINKED_DOCS = (*DOCS, "docs/bench/HISTORY.md", "docs/GPU.md")
SKIPPED_DIRS = {"tests", "build", "dist", "bench-results", "__pycache__", "node_modules"}

# Flags of other tools the docs show, each with the tool that defines it. Never one of ours.
OTHER_TOOLS_FLAGS = {
    "--index-url",  # pip install … --index-url (the CPU torch wheel)
}
# What Prometheus appends to a registered name (counters: _total, _created; histograms: _bucket, _sum, _count)
METRIC_SUFFIXES = ("", "_total", "_created", "_bucket", "_sum", "_count")
METRIC_CALL = re.compile(r"(?:Counter|Gauge|Histogram|Summary|Info|Enum|MetricFamily)\(\s*[\"'](specmesh_\w+)[\"']")
FLAG_LITERAL = re.compile(r"""["'](--[a-z][a-z0-9-]*)(?:[= ][^"']*)?["']""")
FLAG_IN_DOC = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
MAKE_IN_DOC = re.compile(r"(?:^|`|\$ )make ([a-z][\w-]*)", re.M)
MAKE_RULE = re.compile(r"^([A-Za-z][\w-]*)\s*:(?!=)", re.M)
METRIC_IN_DOC = re.compile(r"(?<![\w/.])(specmesh_\w+)(?![\w/.(])")
PATH_IN_DOC = re.compile(r"(?<![\w./~:<-])((?:[A-Za-z_][\w.-]*/)+[\w.-]*)")
LINK_IN_DOC = re.compile(r"\]\(([^)\s]+)\)")


def _read(rel: str) -> str:
    return (ROOT / rel).read_text(encoding="utf-8")


@cache
def _sources() -> tuple[Path, ...]:
    """Our Python source: every .py under the repository's folders but tests/, hidden and build ones."""
    tops = [p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name not in SKIPPED_DIRS]
    return tuple(f for top in tops for f in top.rglob("*.py") if "__pycache__" not in f.parts)


@cache
def defined_flags() -> frozenset[str]:
    return frozenset(m for f in _sources() for m in FLAG_LITERAL.findall(f.read_text(encoding="utf-8")))


@cache
def registered_metrics() -> frozenset[str]:
    names = {m for f in _sources() for m in METRIC_CALL.findall(f.read_text(encoding="utf-8"))}
    return frozenset(n + s for n in names for s in METRIC_SUFFIXES)


def package_names() -> set[str]:
    """Our import names that look like metric names (``specmesh_server``, ``specmesh_router``, …)."""
    pyproject = tomllib.loads(_read("pyproject.toml"))
    mapped = pyproject["tool"]["setuptools"]["package-dir"]
    return {p.name for p in ROOT.iterdir() if p.is_dir() and p.name.startswith("specmesh_")} | set(mapped)


def make_outputs() -> set[str]:
    """Folders a make rule writes (``--out PATH``): named in the docs, made by running, not committed."""
    return set(re.findall(r"--out (\S+)", _read("Makefile")))


def _top_dirs() -> set[str]:
    return {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}


def repo_paths(text: str) -> set[str]:
    """Repository paths named in ``text``: a run of ``name/`` segments starting at a top-level folder.

    >>> sorted(repo_paths("see `verifier_svc/engine.py::Engine`, docs/bench/x. and ~/.cache/specmesh/y"))
    ['docs/bench/x', 'verifier_svc/engine.py']
    """
    tops = _top_dirs()
    out = set()
    for m in PATH_IN_DOC.finditer(text):
        path = m.group(1).rstrip(".-")
        if path.split("/", 1)[0] in tops:
            out.add(path)
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading.

    >>> _slug("Coming from vLLM: the OpenAI-compatible API"), _slug("Tensor parallelism (`--tensor-parallel-size N`)")
    ('coming-from-vllm-the-openai-compatible-api', 'tensor-parallelism---tensor-parallel-size-n')
    """
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(rel: str) -> set[str]:
    text = re.sub(r"^```.*?^```", "", _read(rel), flags=re.M | re.S)  # no "# comments" of code blocks
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS)
def test_flags_exist(doc: str) -> None:
    named = set(FLAG_IN_DOC.findall(_read(doc)))
    missing = sorted(named - defined_flags() - OTHER_TOOLS_FLAGS)
    assert not missing, f"{doc} names flags nothing defines: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_make_targets_exist(doc: str) -> None:
    targets = set(MAKE_RULE.findall(_read("Makefile")))
    missing = sorted(set(MAKE_IN_DOC.findall(_read(doc))) - targets)
    assert not missing, f"{doc} names make targets the Makefile lacks: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_metrics_exist(doc: str) -> None:
    named = set(METRIC_IN_DOC.findall(_read(doc))) - package_names()
    missing = sorted(named - registered_metrics())
    assert not missing, f"{doc} names metrics nothing registers: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_paths_exist(doc: str) -> None:
    generated = make_outputs()
    missing = sorted(p for p in repo_paths(_read(doc)) if not (ROOT / p).exists() and p.rstrip("/") not in generated)
    assert not missing, f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", LINKED_DOCS)
def test_links_resolve(doc: str) -> None:
    """Every relative link's file exists, and its #anchor is one of that file's headings."""
    here = (ROOT / doc).parent
    broken = []
    for target in LINK_IN_DOC.findall(_read(doc)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (here / path).resolve() if path else ROOT / doc
        if not file.exists() or (
            anchor and file.suffix == ".md" and anchor not in anchors(file.relative_to(ROOT).as_posix())
        ):
            broken.append(target)
    assert not broken, f"{doc} links to what does not exist: {broken}"


def test_the_scans_find_what_they_look_for() -> None:
    """Negative control: each scan reads our own definitions (an empty scan would pass every doc)."""
    assert {"--metrics-port", "--proposer-timeout", "--max-tokens"} <= defined_flags()
    assert {"specmesh_requests_total", "specmesh_step_seconds_bucket"} <= registered_metrics()
    assert "specmesh_server" in package_names() and "specmesh_router" in package_names()
    assert {"demo", "test", "gpu-check"} <= set(MAKE_RULE.findall(_read("Makefile")))
    assert "measured" in anchors("README.md")
