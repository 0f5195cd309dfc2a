"""A client-only install (`pip install specmesh`: grpcio + protobuf) imports the SDK and runs the
CLI's client commands; a server command names what is missing in one line, without a traceback.

Each check runs in a subprocess whose import system refuses everything that only `specmesh[serve]`
(and `[bench]`) brings and every server package of this distribution, so it proves the client-only
install on this full dev install.
"""

import ast
import importlib.metadata
import re
import subprocess
import sys
import textwrap
import tomllib
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specmesh import extras
from specmesh.deploy import free_port
from specmesh.health import check, check_health, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
REFUSED = (
    *("torch", "transformers", "prometheus_client", "redis", "fastapi", "uvicorn", "numpy"),
    *("grpc_health", "grpc_reflection", "matplotlib", "openai"),
    *("specmesh_server", "specmesh_bench", "verifier_svc", "proposer_svc", "gateway_svc"),
    *("specmesh_router", "specmesh_kernels"),
)
# The finder refuses at find_spec time; it also notes refused imports that specmesh's own code
# attempted (grpc probes grpc_health and grpc_reflection itself, inside a try).
PRELUDE = f"""
import sys
REFUSED = {REFUSED!r}
attempted_by_specmesh = []

def refused(name):
    return any(name == r or name.startswith(r + ".") for r in REFUSED)

def importer():
    f = sys._getframe(2)
    while f and (f.f_code.co_filename.startswith("<frozen") or f.f_globals.get("__name__", "").startswith("importlib")):
        f = f.f_back
    return f.f_globals.get("__name__", "") if f else ""

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if refused(name):
            if importer().startswith("specmesh"):
                attempted_by_specmesh.append(name)
            raise ModuleNotFoundError(f"No module named {{name!r}} (refused: client-only install)", name=name)
        return None

sys.meta_path.insert(0, Refuse())

def assert_no_server_modules_loaded():
    loaded = [m for m in sys.modules if refused(m)]
    assert not loaded, loaded
"""


def run_client_only(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "SPECMESH_CACHE_DIR": str(tmp_path), "HOME": str(tmp_path)}
    script = PRELUDE + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)


def test_sdk_and_client_commands_run_without_any_server_dependency(tmp_path):
    out = run_client_only(
        """
        import asyncio
        import specmesh, specmesh.cli, specmesh.deploy
        from specmesh import AsyncClient, Client, SamplingParams, SpecDecodeParams
        from specmesh.cli import main
        from specmesh.params import build_request

        Client("127.0.0.1:1").close()

        async def async_client():
            await AsyncClient("127.0.0.1:1").close()

        asyncio.run(async_client())
        req = build_request("hi", SamplingParams(temperature=0, max_tokens=4), SpecDecodeParams(proposer="ngram"), True)
        assert req.sampling.max_tokens == 4 and req.spec_decode.proposer == "ngram" and req.chat.messages

        def exit_code(argv):
            try:
                main(argv)
            except SystemExit as exc:
                print(f"exit {argv[0]}: {exc.code}")
                return exc.code
            return 0

        for argv in (["--help"], ["generate", "--help"], ["admin", "stats", "--help"], ["status", "--help"]):
            assert exit_code(argv) == 0, argv
        # Port 1 refuses at once: each command runs its whole client path up to the failed RPC.
        assert exit_code(["generate", "hi", "--target", "127.0.0.1:1"]) != 0
        assert exit_code(["admin", "--target", "127.0.0.1:1", "stats"]) != 0
        assert exit_code(["status", "--target", "127.0.0.1:1"]) == 1
        assert not attempted_by_specmesh, attempted_by_specmesh
        assert_no_server_modules_loaded()
        print("client-only ok")
        """,
        tmp_path,
    )
    assert out.returncode == 0 and "client-only ok" in out.stdout, out.stderr
    assert "usage: specmesh generate" in out.stdout and "pip install 'specmesh[serve]'" in out.stdout
    assert "specmesh generate: UNAVAILABLE" in out.stdout and "specmesh admin: UNAVAILABLE" in out.stdout
    assert re.search(r"target0 +127\.0\.0\.1:1 +UNREACHABLE", out.stdout)
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["serve", "ngram"], "serve"),
        (["serve", "verifier", "--help"], "serve"),
        (["serve", "head", "--help"], "serve"),
        (["up"], "serve"),
        (["demo"], "serve"),
        (["rag", "--help"], "serve"),
        (["bench", "--help"], "serve,bench"),
    ],
)
def test_server_command_on_a_client_install_prints_one_pip_line(argv, extra, tmp_path):
    out = run_client_only(
        f"""
        import subprocess

        def no_process(*args, **kwargs):
            raise AssertionError("a service process was started")

        subprocess.Popen = no_process  # `up` / `demo` must stop before starting anything
        from specmesh.cli import main
        try:
            main({argv!r})
        finally:
            assert_no_server_modules_loaded()
        """,
        tmp_path,
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    line = out.stderr.strip()
    assert "\n" not in line and line.startswith(f"specmesh {argv[0]}") and "needs " in line, line
    assert line.endswith(f"pip install 'specmesh[{extra}]'"), line


def test_the_guard_refuses_a_server_import_in_the_sdk(tmp_path):
    # The harness itself is honest: an SDK that imported specmesh_server would fail above.
    out = run_client_only("import specmesh\nimport specmesh_server\n", tmp_path)
    assert out.returncode != 0 and "refused: client-only install" in out.stderr


def _imports(folder: Path) -> set[str]:
    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    return names


def test_every_server_only_import_of_the_server_code_is_known_to_the_install_check():
    folders = ["verifier_svc", "proposer_svc", "gateway_svc", "router", "kernels", "specmesh_server", "specmesh_bench"]
    names = set().union(*(_imports(ROOT / f) for f in folders))
    client = {"grpc", "google", "specmesh", "typing_extensions"}  # the SDK's own dependencies
    unknown = {
        n for n in names if n.split(".")[0] not in sys.stdlib_module_names | client and not extras.server_only(n)
    }
    assert not unknown, f"add to specmesh.extras.SERVER_ONLY_MODULES: {sorted(unknown)}"


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _dist_names(requirements: list[str]) -> set[str]:
    return {_norm(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}


def test_the_base_install_is_grpcio_and_protobuf_and_serve_brings_what_the_check_requires():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert _dist_names(project["dependencies"]) == {"grpcio", "protobuf"}
    serve = _dist_names(project["optional-dependencies"]["serve"])
    owners = importlib.metadata.packages_distributions()
    third_party = [m for m in extras.SERVE_REQUIREMENTS if "specmesh" not in owners.get(m, ["specmesh"])]
    assert third_party and all(_norm(d) in serve for m in third_party for d in owners[m]), owners


@pytest.fixture
def health_server():
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    yield servicer, address
    server.stop(None)


def test_plain_grpcio_health_check_reads_what_grpc_health_serves(health_server):
    servicer, address = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("specmesh.v1.GenerationService", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert check_health(address) == "SERVING"
    wait_healthy(address, timeout_s=5)  # `specmesh up` and the service tests wait through the same check
    with grpc.insecure_channel(address) as channel:
        assert check(channel, "specmesh.v1.GenerationService") == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as err:
            check(channel, "no.such.Service")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert check_health(f"127.0.0.1:{free_port()}").startswith("UNREACHABLE")
