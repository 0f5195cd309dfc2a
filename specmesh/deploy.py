"""Local deployment: every service its own process on loopback (``specmesh up``).

Each service is started with the same ``specmesh serve …`` command a container would run,
waited on through the standard gRPC health check, and stopped with SIGTERM (graceful drain).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# The gRPC health check is plain grpcio (specmesh.health): `specmesh status` runs on a client-only install.
from specmesh.health import wait_healthy
from specmesh.paths import cache_dir

# Ports handed out below the kernel's ephemeral range: a port chosen now and bound seconds later by a
# service must not be taken meanwhile by an outgoing connection or a listener on port 0 (gloo's, gRPC's),
# which the kernel places inside that range.
PORTS_BELOW_EPHEMERAL = (20000, 32768)


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return PORTS_BELOW_EPHEMERAL[1]


def free_port() -> int:
    """A loopback TCP port free now, outside the ephemeral range where it can be (see above)."""
    low, high = PORTS_BELOW_EPHEMERAL[0], min(PORTS_BELOW_EPHEMERAL[1], _ephemeral_start())
    rng = secrets.SystemRandom()
    for _ in range(64 if high > low else 0):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http_healthy(
    url: str,
    timeout_s: float,
    proc: subprocess.Popen | None = None,
    *,
    listening: bool = False,
    ca: str | Path | None = None,
) -> None:
    """Block until ``url`` (an HTTP health endpoint) answers 200, or with ``listening`` answers at
    all (a 503 too: the service is up, what it depends on is not); raise on timeout or exit."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"service at {url} exited with code {proc.returncode}")
        state = check_http_health(url, ca=ca)
        if state == "SERVING" or (listening and state.startswith("NOT_SERVING")):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


def check_http_health(url: str, timeout_s: float = 2.0, ca: str | Path | None = None) -> str:
    """SERVING / NOT_SERVING (an HTTP error status) / UNREACHABLE, for an HTTP health endpoint
    (``ca``: the CA that signed an https endpoint's certificate)."""
    import ssl
    import urllib.error
    import urllib.request

    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:
            return "SERVING" if resp.status == 200 else f"NOT_SERVING ({resp.status})"
    except urllib.error.HTTPError as exc:
        return f"NOT_SERVING ({exc.code})"
    except (urllib.error.URLError, OSError) as exc:
        return f"UNREACHABLE ({exc})"


def default_run_dir() -> Path:
    return cache_dir() / "run"


@dataclass(frozen=True)
class DeploymentConfig:
    model: str | None = None
    verifier_address: str = "127.0.0.1:50051"
    verifier_threads: int = 0
    tensor_parallel_size: int = 1  # the verifier's ranks (`--tensor-parallel-size`; it starts the others itself)
    ngram_address: str = "127.0.0.1:50061"  # "" = no n-gram proposer
    suffix_address: str = "127.0.0.1:50064"  # the suffix proposer (learns from every output); "" = none
    suffix_args: tuple[str, ...] = ()  # more `specmesh serve suffix` flags
    rag_address: str = ""  # e.g. 127.0.0.1:50063; "" = no rag proposer
    rag_data_dir: Path | None = None  # None = $SPECMESH_RAG_DATA_DIR or <cache>/rag
    draft_address: str = ""  # e.g. 127.0.0.1:50062; "" = no draft proposer
    draft_model: str | None = None  # the draft's HF folder (default: the target itself)
    draft_args: tuple[str, ...] = ()  # more `specmesh serve draft` flags (e.g. --weights gguf)
    head_address: str = ""  # the learned-head proposer, e.g. 127.0.0.1:50065; "" = none
    head_dir: str = ""  # its head folder (`specmesh head train --out`); "" = the target's cached head
    gateway_address: str = ""  # the OpenAI-compatible HTTP gateway, e.g. 127.0.0.1:8000; "" = none
    max_running: int = 32
    redis_url: str = ""  # router statistics; "" = in the verifier process
    extra_verifier_args: tuple[str, ...] = ()
    run_dir: Path = field(default_factory=default_run_dir)
    startup_timeout_s: float = 600.0  # the first start converts the GGUF
    tls: bool = False  # a throwaway CA under run_dir/tls: every hop mutual TLS, the gateway https
    auth: bool = False  # throwaway tokens under run_dir/secrets: client, admin, proposer tier, gateway API key


# Files of a secured local deployment, under its run_dir (written at start, 0600 for keys and tokens).
TLS_FILES = {"ca": "tls/ca.pem", "cert": "tls/cert.pem", "key": "tls/key.pem"}
TOKEN_FILES = {"client": "secrets/client.token", "admin": "secrets/admin.token", "proposer": "secrets/proposer.token"}
TOKEN_FILES |= {"api_key": "secrets/gateway-api.key"}
# The head proposer without a head folder trains one first (`specmesh serve head --train-minutes`, 10 by
# default, generation included): its start gets this much longer.
HEAD_TRAIN_WAIT_S = 20 * 60.0


@dataclass
class Service:
    name: str
    address: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    health_url: str = ""  # HTTP services: their health endpoint; gRPC ones use the gRPC health check
    startup_timeout_s: float = 0.0  # how long start() waits for it to be healthy; 0 = the config's


class LocalDeployment:
    """Start, describe and stop the local services; use as a context manager."""

    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        serve = [sys.executable, "-m", "specmesh", "serve"]
        verifier_args = ["--address", config.verifier_address, "--max-running", str(config.max_running)]
        tls, tokens = self.tls_files, self.token_files
        secure: list[str] = []  # every gRPC service's own: mutual TLS, the tier token
        if tls:
            secure += ["--tls-cert", str(tls["cert"]), "--tls-key", str(tls["key"]), "--tls-client-ca", str(tls["ca"])]
            verifier_args += ["--proposer-tls-ca", str(tls["ca"])]
        if tokens:
            verifier_args += ["--auth-token-file", str(tokens["client"]), "--admin-token-file", str(tokens["admin"])]
            verifier_args += ["--proposer-token-file", str(tokens["proposer"])]
        tier = [*secure, *(["--auth-token-file", str(tokens["proposer"])] if tokens else [])]
        verifier_args += secure
        proposers = []
        if config.ngram_address:
            proposers.append(
                Service("ngram", config.ngram_address, [*serve, "ngram", "--address", config.ngram_address, *tier])
            )
            verifier_args += ["--proposer", f"ngram={config.ngram_address}"]
        if config.suffix_address:
            suffix = [*serve, "suffix", "--address", config.suffix_address, *tier, *config.suffix_args]
            suffix += ["--redis-url", config.redis_url] if config.redis_url else []  # replicas share outputs
            proposers.append(Service("suffix", config.suffix_address, suffix))
            verifier_args += ["--proposer", f"suffix={config.suffix_address}"]
        if config.rag_address:
            rag = [*serve, "rag", "--address", config.rag_address, *tier]
            rag += ["--model", config.model] if config.model else []
            rag += ["--data-dir", str(config.rag_data_dir)] if config.rag_data_dir else []
            proposers.append(Service("rag", config.rag_address, rag))  # `specmesh rag` finds it by this name
            verifier_args += ["--proposer", f"rag={config.rag_address}"]
        if config.draft_address:
            draft = [*serve, "draft", "--address", config.draft_address, "--threads", "1", *tier]
            draft += ["--model", config.draft_model or config.model] if (config.draft_model or config.model) else []
            draft += config.draft_args
            proposers.append(Service("draft", config.draft_address, draft))
            verifier_args += ["--proposer", f"draft={config.draft_address}"]
        if config.head_address:
            head = [*serve, "head", "--address", config.head_address, *tier]
            head += ["--target", config.model] if config.model else []
            head += ["--head", config.head_dir] if config.head_dir else []
            # Without a head folder the service trains the target's cached head once before it listens.
            wait = config.startup_timeout_s + (0.0 if config.head_dir else HEAD_TRAIN_WAIT_S)
            proposers.append(Service("head", config.head_address, head, startup_timeout_s=wait))
            # It asks for the target's hidden states in its first response; the verifier sends them, no flag.
            verifier_args += ["--proposer", f"head={config.head_address}"]
        if config.draft_address or config.head_address:
            # A draft-model or head proposal takes ms to tens of ms on a CPU (an n-gram one ~1 ms): wait for it.
            verifier_args += ["--proposer-wait-ms", "200"]
        if config.model:
            verifier_args += ["--model", config.model]
        if config.redis_url:
            verifier_args += ["--redis-url", config.redis_url]
        if config.verifier_threads:
            verifier_args += ["--threads", str(config.verifier_threads)]
        if config.tensor_parallel_size > 1:
            verifier_args += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
        verifier = [*serve, "verifier", *verifier_args, *config.extra_verifier_args]
        self.services = [*proposers, Service("verifier", config.verifier_address, verifier)]
        if config.gateway_address:  # after the verifier: its /health reflects the verifier's
            gateway = [*serve, "gateway", "--address", config.gateway_address, "--verifier", config.verifier_address]
            if tls:  # https, and its certificate is its client certificate towards the verifier
                gateway += ["--tls-cert", str(tls["cert"]), "--tls-key", str(tls["key"])]
                gateway += ["--verifier-tls-ca", str(tls["ca"])]
            if tokens:
                gateway += ["--api-key-file", str(tokens["api_key"]), "--verifier-token-file", str(tokens["client"])]
            health = f"{self._scheme}://{config.gateway_address}/health"
            self.services.append(Service("gateway", config.gateway_address, gateway, health_url=health))

    @property
    def tls_files(self) -> dict[str, Path]:
        """ca / cert / key of a ``tls`` deployment (empty without)."""
        return {k: self.config.run_dir / v for k, v in TLS_FILES.items()} if self.config.tls else {}

    @property
    def token_files(self) -> dict[str, Path]:
        """client / admin / proposer / api_key token files of an ``auth`` deployment (empty without)."""
        return {k: self.config.run_dir / v for k, v in TOKEN_FILES.items()} if self.config.auth else {}

    @property
    def client_tls(self):
        """The SDK's ``TlsOptions`` for this deployment's gRPC ports (None: plaintext)."""
        from specmesh.credentials import TlsOptions

        tls = self.tls_files
        return TlsOptions(ca=tls["ca"], cert=tls["cert"], key=tls["key"]) if tls else None

    def token(self, kind: str = "client") -> str:
        """A token of this deployment (client, admin, api_key); "" without ``auth``."""
        from specmesh.credentials import read_token

        return read_token(self.token_files[kind]) if self.config.auth else ""

    @property
    def _scheme(self) -> str:
        return "https" if self.config.tls else "http"

    def _write_credentials(self) -> None:
        """Fresh throwaway certificates and tokens for this start (nothing reused from a previous one)."""
        if self.config.tls:
            from specmesh.certs import write_dev_pki

            write_dev_pki(self.config.run_dir / "tls")
        for path in self.token_files.values():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")

    @property
    def verifier_address(self) -> str:
        return self.services_by_name["verifier"].address

    @property
    def gateway_url(self) -> str:
        """The OpenAI base URL (http://host:port/v1), or "" without a gateway."""
        return f"{self._scheme}://{self.config.gateway_address}/v1" if self.config.gateway_address else ""

    @property
    def services_by_name(self) -> dict[str, Service]:
        return {s.name: s for s in self.services}

    def start(self) -> None:
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        self._write_credentials()
        try:
            for svc in self.services:
                svc.log_path = self.config.run_dir / f"{svc.name}.log"
                log = svc.log_path.open("wb")
                svc.proc = subprocess.Popen(svc.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            for svc in self.services:
                if svc.health_url:
                    ca = self.tls_files.get("ca")
                    wait_http_healthy(svc.health_url, self.config.startup_timeout_s, svc.proc, ca=ca)
                else:
                    timeout = svc.startup_timeout_s or self.config.startup_timeout_s
                    wait_healthy(svc.address, timeout, svc.proc, tls=self.client_tls)
        except BaseException:
            self.stop()
            for svc in self.services:
                if svc.log_path and svc.log_path.exists():
                    tail = svc.log_path.read_text(errors="replace")[-3000:]
                    print(f"--- {svc.name} log ({svc.log_path}) ---\n{tail}", file=sys.stderr)
            raise
        self._write_state()

    def stop(self, timeout_s: float = 40.0) -> None:
        for svc in self.services:
            if svc.proc and svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for svc in self.services:
            if svc.proc is None:
                continue
            try:
                svc.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                svc.proc.kill()
                svc.proc.wait()
        state = self.config.run_dir / "deployment.json"
        if state.exists() and json.loads(state.read_text()).get("pid") == os.getpid():
            state.unlink()

    def _write_state(self) -> None:
        state = {
            "pid": os.getpid(),
            "services": {s.name: s.address for s in self.services},
            "health_urls": {s.name: s.health_url for s in self.services if s.health_url},  # HTTP services
            "tls": {k: str(v) for k, v in self.tls_files.items()},  # the CLI connects with these
            "tokens": {k: str(v) for k, v in self.token_files.items()},
        }
        (self.config.run_dir / "deployment.json").write_text(json.dumps(state, indent=2))

    def __enter__(self) -> LocalDeployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def known_services(run_dir: Path | None = None) -> dict[str, str]:
    """Services of the running local deployment, from the state file ``specmesh up`` writes."""
    return dict(_state(run_dir).get("services", {}))


def known_health_urls(run_dir: Path | None = None) -> dict[str, str]:
    """The HTTP health endpoints of the running local deployment's HTTP services (the gateway)."""
    return dict(_state(run_dir).get("health_urls", {}))


def known_credentials(run_dir: Path | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The running local deployment's TLS files (ca, cert, key) and token files (client, admin, proposer, api_key)."""
    state = _state(run_dir)
    return dict(state.get("tls", {})), dict(state.get("tokens", {}))


def _state(run_dir: Path | None) -> dict:
    path = (run_dir or default_run_dir()) / "deployment.json"
    return json.loads(path.read_text()) if path.exists() else {}
