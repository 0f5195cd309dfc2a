"""How the `specmesh` CLI wires a proposer tier in, checked on the head proposer: a service
(`serve head`), a tool (`head train`), a `specmesh up` tier the verifier is told about, a bench
mode. No model is loaded and no process is started."""

from __future__ import annotations

import re

import pytest

from specmesh import cli
from specmesh.deploy import HEAD_TRAIN_WAIT_S, DeploymentConfig, LocalDeployment


def help_defaults(text: str) -> dict[str, str]:
    """``--flag`` → its ``(default: …)`` in an argparse help text."""
    out = {}
    for entry in re.split(r"\n  (?=-)", text.split("options:", 1)[1]):
        entry = " ".join(entry.split())
        flag = re.search(r"--[\w-]+", entry)
        default = re.search(r"\(default: (.*?)\)$", entry)
        if flag and default:
            out[flag.group(0)] = default.group(1)
    return out


def run_help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0, argv
    return capsys.readouterr().out


def test_serve_head_help_shows_its_flags_and_defaults(capsys):
    out = run_help(capsys, ["serve", "head", "--help"])
    assert out.startswith("usage: specmesh serve head")
    defaults = help_defaults(out)
    assert defaults["--address"] == "127.0.0.1:50065"
    assert defaults["--head"] == ""  # the target's cached head
    assert defaults["--target"] == "None"  # the default model
    assert defaults["--train-minutes"] == "10.0"
    assert (defaults["--threads"], defaults["--max-batch"]) == ("2", "32")
    assert [defaults[f] for f in ("--max-nodes", "--max-depth", "--width", "--branch")] == ["12", "3", "4", "4"]
    assert "--auth-token-file" in defaults and "--tls-cert" in defaults  # the common serving flags


def test_head_is_a_service_and_a_tool(capsys):
    assert cli.SERVICES["head"] == "proposer_svc.head.server"
    assert cli.TOOLS["head"] == "proposer_svc.head.train"
    cli.main(["serve", "--help"])  # the service list, without exiting
    assert "head" in capsys.readouterr().out.split("{", 1)[1].split("}", 1)[0].split(",")
    out = run_help(capsys, ["head", "train", "--help"])
    assert "--minutes" in out and "--out" in out
    assert "head" in cli.build_parser().format_help()
    gen = cli.build_parser().parse_args(["generate", "hi", "--proposer", "head"])
    assert gen.proposer == "head"


def test_up_head_starts_the_head_service_and_names_it_to_the_verifier(tmp_path):
    from proposer_svc.head.server import parse_args as head_args
    from verifier_svc.config import parse_args as verifier_args

    argv = ["up", "--head", "127.0.0.1:50065", "--head-dir", "heads/h", "--model", "m", "--run-dir", str(tmp_path)]
    dep = cli._deployment(cli.build_parser().parse_args(argv))
    assert (dep.config.head_address, dep.config.head_dir) == ("127.0.0.1:50065", "heads/h")
    names = [s.name for s in dep.services]
    assert names.index("head") < names.index("verifier")  # healthy before the verifier dials it
    head = dep.services_by_name["head"]
    assert head.argv[3:5] == ["serve", "head"] and head.address == "127.0.0.1:50065"
    h = head_args(head.argv[5:])  # [python, -m, specmesh, serve, head, …]
    assert (h.serving.address, h.head, h.target) == ("127.0.0.1:50065", "heads/h", "m")
    assert head.startup_timeout_s == dep.config.startup_timeout_s  # a given head folder: no training
    v = verifier_args(dep.services_by_name["verifier"].argv[5:])
    assert ("head", "127.0.0.1:50065") in v.proposers
    assert v.auto_proposers is None  # every configured proposer, the head included, is an `auto` candidate
    assert v.engine.speculation.proposer_wait_ms == 200  # its trees take ms on a CPU: wait for them


def test_up_head_without_a_folder_uses_the_cached_head_and_waits_for_its_training(tmp_path):
    dep = LocalDeployment(DeploymentConfig(run_dir=tmp_path, head_address="127.0.0.1:50065"))
    head = dep.services_by_name["head"]
    assert "--head" not in head.argv and "--target" not in head.argv  # the default model's cached head
    assert head.startup_timeout_s == dep.config.startup_timeout_s + HEAD_TRAIN_WAIT_S


def test_up_starts_no_head_unless_asked(tmp_path):
    args = cli.build_parser().parse_args(["up", "--run-dir", str(tmp_path)])
    assert (args.head, args.head_dir) == ("", "")
    dep = cli._deployment(args)
    assert "head" not in dep.services_by_name
    assert not [a for a in dep.services_by_name["verifier"].argv if a.startswith("head=")]


def test_bench_head_mode_starts_a_head_proposer_that_auto_may_pick(tmp_path):
    from specmesh_bench.cli import local_deployment, parse_args
    from specmesh_bench.runner import ALL_MODES, LEARNING_MODES, SERVICE_MODES

    assert SERVICE_MODES["head"] == "head" and "head" in ALL_MODES and "head" not in LEARNING_MODES
    a = parse_args(["--modes", "plain,ngram,head,auto", "--head", "heads/h"])
    cfg = local_deployment(a, ["plain", "ngram", "head", "auto"], "m", "127.0.0.1:1", tmp_path)
    assert cfg.head_dir == "heads/h" and cfg.head_address
    extra = list(cfg.extra_verifier_args)
    assert extra[extra.index("--auto-proposers") + 1].split(",") == ["ngram", "suffix", "head"]
    plain = local_deployment(parse_args(["--modes", "plain,ngram"]), ["plain", "ngram"], "m", "127.0.0.1:1", tmp_path)
    assert plain.head_address == "" and "head" not in plain.extra_verifier_args[-1]


def test_bench_head_mode_needs_a_head_folder_for_its_local_deployment(capsys):
    from specmesh_bench.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--modes", "plain,head"])
    assert "--head DIR" in capsys.readouterr().err
    assert parse_args(["--modes", "plain,head", "--target", "10.0.0.5:50051"]).head == ""  # its verifier has one


def test_up_tensor_parallel_size_reaches_the_verifier_only(tmp_path):
    """`specmesh up --tensor-parallel-size N`: the verifier starts its other ranks itself, so the flag
    goes to its command line alone (no extra service); N = 1 passes nothing."""
    from verifier_svc.config import parse_args as verifier_args

    argv = ["up", "--tensor-parallel-size", "2", "--draft", "127.0.0.1:50062", "--run-dir", str(tmp_path)]
    dep = cli._deployment(cli.build_parser().parse_args(argv))
    verifier = dep.services_by_name["verifier"].argv
    assert verifier[verifier.index("--tensor-parallel-size") + 1] == "2"
    assert verifier_args(verifier[5:]).tensor_parallel_size == 2  # [python, -m, specmesh, serve, verifier, …]
    assert [s.name for s in dep.services] == ["ngram", "suffix", "draft", "verifier", "gateway"]
    for s in dep.services:
        if s.name != "verifier":
            assert not [a for a in s.argv if "tensor-parallel" in a], s.argv
    default = cli._deployment(cli.build_parser().parse_args(["up", "--run-dir", str(tmp_path)]))
    assert default.config.tensor_parallel_size == 1
    assert not [a for a in default.services_by_name["verifier"].argv if "tensor-parallel" in a]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["up", "--tensor-parallel-size", "0"])
