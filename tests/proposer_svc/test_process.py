"""The proposer services' entry points: flags → one frozen config, each default from the
``SPECMESH_*`` variable named after its flag and shown by ``--help``, a bad value (flag or
variable) a one-line error with exit status 2."""

from __future__ import annotations

import dataclasses

import pytest

from proposer_svc.draft import server as draft_server
from proposer_svc.ngram import server
from proposer_svc.rag import server as rag_server

SERVICES = {"ngram": server, "draft": draft_server, "rag": rag_server}


def test_variables_named_after_the_flags_set_the_defaults_and_flags_win(monkeypatch):
    monkeypatch.setenv("SPECMESH_MAX_NODES", "8")
    monkeypatch.setenv("SPECMESH_ADDRESS", "0.0.0.0:7000")
    monkeypatch.setenv("SPECMESH_GRACE", "5")
    ngram = server.parse_args([])
    assert (ngram.ngram.max_nodes, ngram.serving.address, ngram.serving.grace_s) == (8, "0.0.0.0:7000", 5.0)
    assert server.parse_args(["--max-nodes", "4"]).ngram.max_nodes == 4
    monkeypatch.setenv("SPECMESH_LINEARS", "stock")
    monkeypatch.setenv("SPECMESH_THREADS", "3")
    draft = draft_server.parse_args(["--max-depth", "3"])
    assert (draft.max_nodes, draft.max_depth, draft.threads, draft.linears) == (8, 3, 3, "stock")
    monkeypatch.setenv("SPECMESH_DATA_DIR", "/tmp/corpora")
    rag = rag_server.parse_args(["--min-match", "3"])
    assert (rag.lookup.max_nodes, rag.lookup.min_match, str(rag.data_dir)) == (8, 3, "/tmp/corpora")


@pytest.mark.parametrize("name", SERVICES)
def test_the_config_is_one_frozen_dataclass(name):
    config = SERVICES[name].parse_args([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.serving = None


@pytest.mark.parametrize("name", SERVICES)
def test_help_shows_each_default_and_its_variable(name):
    text = " ".join(SERVICES[name].build_flags().parser.format_help().split())
    assert "[env SPECMESH_ADDRESS] (default: 127.0.0.1:5006" in text
    assert "[env SPECMESH_MAX_NODES] (default: 16)" in text
    assert "[env SPECMESH_METRICS_PORT] (default: 0)" in text


@pytest.mark.parametrize(
    ("name", "env", "argv", "message"),
    [
        ("draft", {"SPECMESH_THREADS": "abc"}, [], "SPECMESH_THREADS='abc' is not a valid integer"),
        ("rag", {"SPECMESH_MAX_NODES": "x"}, [], "SPECMESH_MAX_NODES='x' is not a valid integer"),
        ("ngram", {"SPECMESH_GRACE": "soon"}, [], "SPECMESH_GRACE='soon' is not a valid number"),
        ("ngram", {}, ["--max-nodes", "-1"], "--max-nodes must be >= 1, got -1"),
        ("ngram", {}, ["--min-n", "4", "--max-n", "3"], "--max-n must be >= 4, got 3"),
        ("draft", {}, ["--linears", "fast"], "argument --linears: invalid choice: 'fast'"),
        ("rag", {}, ["--address", "50063"], "--address expects HOST:PORT, got '50063'"),
    ],
)
def test_a_bad_value_is_one_error_line_and_exit_status_2(monkeypatch, capsys, name, env, argv, message):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as exit_:
        SERVICES[name].parse_args(argv)
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"specmesh serve {name}: error: ") and message in errors[0]
