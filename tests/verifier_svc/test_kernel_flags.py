"""The verifier's kernel switches: ``--attention {auto,triton,sdpa}`` and ``--device-accept
{auto,on,off}`` parse into the config (each defaulting to its ``SPECMESH_*`` variable, shown by
``--help``), and a kernel they force that cannot run here is refused at start-up, before the model
loads, with one line."""

from __future__ import annotations

import types

import pytest
import torch

from verifier_svc import server
from verifier_svc.config import VerifierConfig, build_flags, parse_args
from verifier_svc.kernel_paths import KernelUnavailable, check_kernel_device, check_kernel_model

CPU = torch.device("cpu")


@pytest.fixture
def no_kernel_env(monkeypatch):
    monkeypatch.delenv("SPECMESH_ATTENTION", raising=False)
    monkeypatch.delenv("SPECMESH_DEVICE_ACCEPT", raising=False)


@pytest.fixture
def no_interpreter(monkeypatch):
    """The kernels as a process without Triton's interpreter sees them: CPU tensors refused."""
    from specmesh_kernels import _runtime

    monkeypatch.setattr(_runtime, "interpreted", lambda kernel: False)


@pytest.mark.usefixtures("no_kernel_env")
@pytest.mark.parametrize(
    ("argv", "attention", "device_accept"),
    [
        ([], "auto", None),
        (["--attention", "triton", "--device-accept", "on"], "triton", True),
        (["--attention", "sdpa", "--device-accept", "off"], "sdpa", False),
        (["--attention", "auto", "--device-accept", "auto"], "auto", None),
    ],
)
def test_the_flags_set_the_attention_and_the_engines_acceptance(argv, attention, device_accept):
    config = parse_args(argv)
    assert (config.attention, config.engine.device_accept) == (attention, device_accept)
    assert VerifierConfig().attention == "auto" and VerifierConfig().engine.device_accept is None


def test_the_variables_set_the_defaults_and_the_flags_win(monkeypatch):
    monkeypatch.setenv("SPECMESH_ATTENTION", "sdpa")
    monkeypatch.setenv("SPECMESH_DEVICE_ACCEPT", "off")
    config = parse_args([])
    assert (config.attention, config.engine.device_accept) == ("sdpa", False)
    config = parse_args(["--attention", "triton", "--device-accept", "on"])
    assert (config.attention, config.engine.device_accept) == ("triton", True)


@pytest.mark.usefixtures("no_kernel_env")
def test_help_shows_each_default_and_its_variable():
    text = " ".join(build_flags().parser.format_help().split())
    assert "{auto,triton,sdpa}" in text and "[env SPECMESH_ATTENTION] (default: auto)" in text
    assert "{auto,on,off}" in text and "[env SPECMESH_DEVICE_ACCEPT] (default: auto)" in text


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        ({}, ["--attention", "flash"], "argument --attention: invalid choice: 'flash'"),
        ({}, ["--device-accept", "yes"], "argument --device-accept: invalid choice: 'yes'"),
        ({"SPECMESH_DEVICE_ACCEPT": "maybe"}, [], "SPECMESH_DEVICE_ACCEPT='maybe': choose from auto, on, off"),
    ],
)
def test_a_bad_value_is_one_error_line(monkeypatch, capsys, no_kernel_env, env, argv, message):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]


@pytest.mark.usefixtures("no_interpreter")
def test_a_forced_kernel_that_cannot_run_on_the_device_is_refused_naming_the_flag_and_the_fix():
    with pytest.raises(KernelUnavailable) as refused:
        check_kernel_device("triton", None, CPU)
    text = str(refused.value)
    assert text.startswith("--attention triton: ") and "TRITON_INTERPRET=1" in text and "--attention auto" in text
    with pytest.raises(KernelUnavailable, match=r"^--attention triton and --device-accept on: "):
        check_kernel_device("triton", True, CPU)
    with pytest.raises(KernelUnavailable, match=r"^--device-accept on: "):
        check_kernel_device("sdpa", True, CPU)
    for attention, device_accept in (("auto", None), ("sdpa", False), ("auto", False)):
        check_kernel_device(attention, device_accept, CPU)  # nothing forced: nothing to refuse
    check_kernel_device("triton", True, torch.device("cuda"))  # compiled kernels take CUDA tensors


def test_without_triton_a_forced_kernel_is_refused(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "specmesh_kernels", None)  # its import fails, as without triton
    with pytest.raises(KernelUnavailable, match="triton is not importable"):
        check_kernel_device("triton", None, CPU)


def test_triton_on_a_model_the_kernel_does_not_serve_is_refused():
    windowed = types.SimpleNamespace(model_type="mistral", sliding_window=4096)
    with pytest.raises(KernelUnavailable, match=r"--attention triton: .* does not serve mistral"):
        check_kernel_model("triton", windowed)
    check_kernel_model("auto", windowed)  # auto and sdpa leave such a model to transformers' attention
    check_kernel_model("sdpa", windowed)
    check_kernel_model("triton", types.SimpleNamespace(model_type="llama"))


@pytest.mark.usefixtures("no_interpreter", "no_kernel_env")
def test_the_verifier_refuses_before_loading_the_model_with_one_line(monkeypatch):
    from specmesh_server import model_loading

    monkeypatch.setattr(model_loading, "load_model", lambda *a: pytest.fail("loaded the model before the check"))
    with pytest.raises(SystemExit) as exit_:
        server.main(["--attention", "triton", "--device", "cpu"])
    assert str(exit_.value.code).startswith("specmesh serve verifier: --attention triton: ")
    assert "\n" not in str(exit_.value.code)


def test_cuda_graphs_flag_parses_defaults_from_its_variable_and_shows_in_help(monkeypatch):
    monkeypatch.delenv("SPECMESH_CUDA_GRAPHS", raising=False)
    assert parse_args([]).cuda_graphs == VerifierConfig().cuda_graphs == "auto"
    assert parse_args(["--cuda-graphs", "off"]).cuda_graphs == "off"
    monkeypatch.setenv("SPECMESH_CUDA_GRAPHS", "on")
    assert parse_args([]).cuda_graphs == "on" and parse_args(["--cuda-graphs", "auto"]).cuda_graphs == "auto"
    monkeypatch.delenv("SPECMESH_CUDA_GRAPHS")
    text = " ".join(build_flags().parser.format_help().split())
    assert "--cuda-graphs {auto,on,off}" in text and "[env SPECMESH_CUDA_GRAPHS] (default: auto)" in text


def test_static_steps_run_where_the_tree_kernel_reads_the_blocks_and_on_asks_only_for_what_can_run():
    from verifier_svc.kernel_paths import static_steps

    cuda = torch.device("cuda")
    assert static_steps("auto", True, cuda, 1) and not static_steps("auto", False, cuda, 1)
    assert not static_steps("auto", True, CPU, 1) and not static_steps("auto", True, cuda, 2)
    assert static_steps("on", True, CPU, 1) and not static_steps("off", True, cuda, 1)
    with pytest.raises(KernelUnavailable, match=r"^--cuda-graphs on: .*--attention triton"):
        static_steps("on", False, cuda, 1)
    with pytest.raises(KernelUnavailable, match=r"^--cuda-graphs on: .*--tensor-parallel-size 1"):
        static_steps("on", True, cuda, 2)


@pytest.mark.usefixtures("no_kernel_env")
def test_cuda_graphs_on_without_the_tree_kernel_is_refused_before_the_model_loads(monkeypatch):
    from specmesh_server import model_loading

    monkeypatch.delenv("SPECMESH_CUDA_GRAPHS", raising=False)
    monkeypatch.setattr(model_loading, "load_model", lambda *a: pytest.fail("loaded the model before the check"))
    with pytest.raises(SystemExit) as exit_:
        server.main(["--cuda-graphs", "on", "--attention", "sdpa", "--device", "cpu"])
    assert str(exit_.value.code).startswith("specmesh serve verifier: --cuda-graphs on: ")
    assert "\n" not in str(exit_.value.code)
