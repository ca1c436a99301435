"""The Dockerfile and deploy/ manifests parse and agree with the CLI's flags and routes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcm import KVCacheManager
from kvcm.cli import build_parser
from kvcm.server.app import create_app
from kvcm.server.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes" / "kvcm-sidecar.yaml"
COMPOSE = ROOT / "deploy" / "compose" / "compose.yaml"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"


def _routes() -> set[str]:
    cfg = {"layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}], "num_blocks": 4}
    return {getattr(r, "path", "") for r in create_app(KVCacheManager(cfg)).routes}


def _serve_args(args: list[str]) -> Any:
    """Parse with the real CLI parser (raises SystemExit on an unknown flag)."""
    argv = args if args and args[0] == "serve" else ["serve", *args]
    return build_parser().parse_args(argv)


def _k8s_pod() -> dict[str, Any]:
    docs = list(yaml.safe_load_all(K8S.read_text()))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]


def test_kubernetes_sidecar_shares_gpu_processes_and_socket() -> None:
    pod = _k8s_pod()
    assert pod["shareProcessNamespace"] is True
    (kvcm,) = pod["initContainers"]
    assert kvcm["restartPolicy"] == "Always"  # a native sidecar
    (server,) = pod["containers"]
    claim = pod["resourceClaims"][0]["name"]
    for c in (kvcm, server):
        assert {"name": claim} in c["resources"]["claims"]  # the same GPU claim
    args = _serve_args(kvcm["args"])
    assert args.share is True and args.device.startswith("cuda")
    socket_dir = str(Path(args.uds).parent)
    mounts = {
        c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (kvcm, server)
    }
    assert mounts["kvcm"][socket_dir] == mounts["inference-server"][socket_dir]
    env = {e["name"]: e for e in server["env"]}
    assert env["KVCM_UDS"]["value"] == str(args.uds)
    assert env["KVCM_STEP_SOCKET"]["value"] == str(args.step_socket)
    assert str(Path(args.step_socket).parent) == socket_dir
    token_env = next(e for e in kvcm["env"] if e["name"] == "KVCM_API_TOKEN")
    assert "secretKeyRef" in token_env["valueFrom"]


def test_kubernetes_probes_hit_real_routes_on_the_probe_port() -> None:
    pod = _k8s_pod()
    (kvcm,) = pod["initContainers"]
    args = _serve_args(kvcm["args"])
    ports = {p["name"]: p["containerPort"] for p in kvcm["ports"]}
    routes = _routes()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = kvcm[probe]["httpGet"]
        assert get["path"] in routes and get["path"] in ("/livez", "/readyz")
        assert ports[get["port"]] == int(args.metrics_port)
    assert args.metrics_host == "0.0.0.0"  # kubelet reaches the pod IP, not loopback
    # No model until the inference server registers one, and it starts only once the sidecar
    # has: the startup probe must not wait for the model.
    assert (args.config, args.layers, args.hf_model_config, args.default_model) == (None,) * 4
    assert kvcm["startupProbe"]["httpGet"]["path"] == "/livez"


def test_compose_agrees_with_the_cli_and_shares_pid_gpu_and_socket() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    kvcm, server = doc["services"]["kvcm"], doc["services"]["inference-server"]
    args = _serve_args(kvcm["command"])
    assert server["pid"] == "service:kvcm" and server["ipc"] == "service:kvcm"
    assert args.share is True
    gpus = [
        s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in (kvcm, server)
    ]
    assert gpus[0] == gpus[1]
    socket_dir = str(Path(args.uds).parent)
    assert f"kvcm-run:{socket_dir}" in kvcm["volumes"]
    assert f"kvcm-run:{socket_dir}" in server["volumes"]
    assert server["environment"]["KVCM_UDS"] == str(args.uds)
    assert server["environment"]["KVCM_STEP_SOCKET"] == str(args.step_socket)
    assert str(Path(args.step_socket).parent) == socket_dir
    check = " ".join(kvcm["healthcheck"]["test"])
    port, path = re.search(r"127\.0\.0\.1:(\d+)(/\w+)", check).groups()  # type: ignore[union-attr]
    assert int(port) == int(args.metrics_port) and path in _routes()
    # kvcm waits for the inference server to register its model, which waits for kvcm's health.
    assert args.hf_model_config is None and path == "/livez"


def test_prometheus_scrapes_the_metrics_route_on_the_probe_port() -> None:
    doc = yaml.safe_load(PROMETHEUS.read_text())
    compose = yaml.safe_load(COMPOSE.read_text())
    port = int(_serve_args(compose["services"]["kvcm"]["command"]).metrics_port)
    static = next(j for j in doc["scrape_configs"] if "static_configs" in j)
    assert static["metrics_path"] in _routes()
    assert static["static_configs"][0]["targets"] == [f"kvcm:{port}"]
    pod_meta = next(d for d in yaml.safe_load_all(K8S.read_text()) if d["kind"] == "Deployment")
    notes = pod_meta["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/path"] in _routes()
    assert int(notes["prometheus.io/port"]) == port


def _dockerfile() -> tuple[str, dict[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for item in shlex.split(line[4:]):
                key, _, value = item.partition("=")
                env[key] = value
    return text, env


def test_dockerfile_runs_the_service_with_the_gpu_extra_and_a_health_check() -> None:
    text, env = _dockerfile()
    assert re.search(r"^FROM nvidia/cuda:12\.", text, re.M)
    assert 'pip install ".[gpu]"' in text
    # the C core is built (setup.py and a compiler there), and checked
    assert "COPY pyproject.toml setup.py" in text and "gcc" in text
    assert "native.available()" in text
    assert 'ENTRYPOINT ["kvcm", "serve"]' in text
    health = next(ln for ln in text.splitlines() if ln.startswith("HEALTHCHECK"))
    port = re.search(r"127\.0\.0\.1:(\d+)/livez", health).group(1)  # type: ignore[union-attr]
    assert port == env["KVCM_METRICS_PORT"] and f"EXPOSE {port}" in text
    # Every KVCM_* variable the image sets is a setting kvcm reads.
    fields = {f"KVCM_{name.upper()}" for name in Settings.model_fields}
    for key in env:
        if key.startswith("KVCM_"):
            assert key in fields, key
    assert "USER kvcm" in text  # not root


@pytest.mark.parametrize("path", [K8S, COMPOSE, PROMETHEUS], ids=lambda p: p.name)
def test_manifests_are_valid_yaml(path: Path) -> None:
    assert list(yaml.safe_load_all(path.read_text()))
