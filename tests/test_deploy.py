"""The Dockerfile and deploy/ manifests parse and agree with the CLI's flags and routes.

No Docker engine runs here, so the image is checked as text: the command a container really
runs is the image's ENTRYPOINT combined with the manifest's command and args exactly as the
container runtime combines them, then parsed by kvcm's own parser (a manifest that repeated
``serve`` after the entry point ``kvcm serve`` once passed because the test added ``serve``
itself).
"""

from __future__ import annotations

import json
import re
import shlex
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcm import KVCacheManager
from kvcm.cli import build_parser
from kvcm.server.app import create_app
from kvcm.server.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
K8S = ROOT / "deploy" / "kubernetes" / "kvcm-sidecar.yaml"
COMPOSE = ROOT / "deploy" / "compose" / "compose.yaml"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
TEST_CONSTRAINTS = ROOT / "constraints.txt"
IMAGE_CONSTRAINTS = ROOT / "deploy" / "constraints-cuda12.txt"


def _routes() -> set[str]:
    cfg = {"layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}], "num_blocks": 4}
    return {getattr(r, "path", "") for r in create_app(KVCacheManager(cfg)).routes}


# -- the Dockerfile, as text -----------------------------------------------------------------


@dataclass
class Stage:
    """One ``FROM`` of the Dockerfile: its instructions, continuation lines joined."""

    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for rest in self.args("ENV"):
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
        return env

    def exec_form(self, keyword: str) -> list[str] | None:
        """The last ``keyword`` instruction's JSON (exec) form, as Docker keeps it."""
        found = self.args(keyword)
        if not found:
            return None
        value = json.loads(found[-1])
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), found[-1]
        return value

    def commands(self) -> list[list[str]]:
        """Each shell command of the stage's RUN instructions (split at ``&&``), as words."""
        out = []
        for rest in self.args("RUN"):
            for part in re.split(r"\s&&\s", rest):
                out.append(shlex.split(part))
        return out


def _stages() -> list[Stage]:
    """The stages, each ``FROM`` resolved with the defaults of the ARGs declared before it."""
    lines = DOCKERFILE.read_text().replace("\\\n", " ").splitlines()
    stages: list[Stage] = []
    global_args: dict[str, str] = {}
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        keyword, _, rest = line.strip().partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=base, name=name))
        elif stages:
            stages[-1].instructions.append((keyword, rest.strip()))
        elif keyword == "ARG":
            key, _, value = rest.strip().partition("=")
            global_args[key] = value
    return stages


def _final() -> Stage:
    return _stages()[-1]


def _image_argv(args: list[str] | None = None) -> list[str]:
    """What ``docker run IMAGE *args`` runs: ENTRYPOINT, then args or else the image's CMD."""
    final = _final()
    entrypoint = final.exec_form("ENTRYPOINT") or []
    return [*entrypoint, *(args if args else final.exec_form("CMD") or [])]


def _k8s_argv(container: dict[str, Any]) -> list[str]:
    """What Kubernetes runs: ``command`` replaces the image's ENTRYPOINT (and drops its CMD),
    ``args`` replaces its CMD."""
    final = _final()
    if "command" in container:
        return [*container["command"], *container.get("args", [])]
    entrypoint = final.exec_form("ENTRYPOINT") or []
    cmd = container["args"] if "args" in container else final.exec_form("CMD") or []
    return [*entrypoint, *cmd]


def _compose_words(value: str | list[str]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value)


def _compose_argv(service: dict[str, Any]) -> list[str]:
    """What docker compose runs: ``entrypoint`` replaces the image's ENTRYPOINT (and, like
    ``docker run --entrypoint``, drops its CMD), ``command`` replaces its CMD."""
    final = _final()
    if "entrypoint" in service:
        entrypoint = _compose_words(service["entrypoint"])
        cmd = _compose_words(service.get("command", []))
    else:
        entrypoint = final.exec_form("ENTRYPOINT") or []
        cmd = (
            _compose_words(service["command"])
            if "command" in service
            else final.exec_form("CMD") or []
        )
    return [*entrypoint, *cmd]


def _serve_args(argv: list[str]) -> Namespace:
    """Parse a container's argv with the real CLI parser: it must be ``kvcm serve ...``."""
    assert argv and argv[0] == "kvcm", f"the container runs {shlex.join(argv)}, not kvcm"
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"the container would run `{shlex.join(argv)}`, which kvcm refuses")
    assert args.command == "serve", shlex.join(argv)
    return args


def test_the_check_refuses_what_kvcm_refuses() -> None:
    """The mistake this file once missed: ``serve`` again after the entry point's."""
    with pytest.raises(pytest.fail.Exception, match="kvcm serve serve"):
        _serve_args(["kvcm", "serve", "serve", "--uds", "/run/kvcm/kvcm.sock"])
    with pytest.raises(pytest.fail.Exception):
        _serve_args(["kvcm", "serve", "--no-such-flag"])
    assert _serve_args(["kvcm", "serve", "--share"]).share is True


def test_the_image_alone_runs_kvcm_serve() -> None:
    assert _final().exec_form("ENTRYPOINT") == ["kvcm", "serve"]
    _serve_args(_image_argv())


def test_the_docker_run_examples_in_the_dockerfile_parse() -> None:
    examples = [ln.lstrip("# ").split("#")[0] for ln in DOCKERFILE.read_text().splitlines()]
    runs = [shlex.split(ex) for ex in examples if ex.startswith("docker run ")]
    assert len(runs) >= 2
    for words in runs:
        image = words.index("kvcm")  # the tag `docker build -t kvcm .` gives
        _serve_args(_image_argv(words[image + 1 :]))


# -- the manifests ---------------------------------------------------------------------------


def _k8s_pod() -> dict[str, Any]:
    docs = list(yaml.safe_load_all(K8S.read_text()))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]


def _k8s_kvcm() -> dict[str, Any]:
    (kvcm,) = _k8s_pod()["initContainers"]
    return kvcm


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_kubernetes_sidecar_shares_gpu_processes_and_socket() -> None:
    pod = _k8s_pod()
    assert pod["shareProcessNamespace"] is True
    kvcm = _k8s_kvcm()
    assert kvcm["restartPolicy"] == "Always"  # a native sidecar
    (server,) = pod["containers"]
    claim = pod["resourceClaims"][0]["name"]
    for c in (kvcm, server):
        assert {"name": claim} in c["resources"]["claims"]  # the same GPU claim
    args = _serve_args(_k8s_argv(kvcm))
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
    kvcm = _k8s_kvcm()
    args = _serve_args(_k8s_argv(kvcm))
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


def test_kubernetes_can_verify_the_image_user_is_not_root() -> None:
    """``runAsNonRoot`` needs a numeric user (the pod's ``runAsUser`` or the image's USER):
    with a user name the kubelet refuses to start the container."""
    security = _k8s_kvcm()["securityContext"]
    if not security.get("runAsNonRoot"):
        return
    if "runAsUser" in security:
        assert int(security["runAsUser"]) != 0
        return
    user = _final().args("USER")[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, f"USER {user} is not a numeric non-root uid"


def test_compose_agrees_with_the_cli_and_shares_pid_gpu_and_socket() -> None:
    doc = _compose()
    kvcm, server = doc["services"]["kvcm"], doc["services"]["inference-server"]
    args = _serve_args(_compose_argv(kvcm))
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


def test_compose_argv_follows_docker_for_entrypoint_and_command() -> None:
    """The argv rules themselves, on the cases the manifests do not use."""
    assert _compose_argv({"entrypoint": ["kvcm"]}) == ["kvcm"]  # the image's CMD is dropped
    assert _compose_argv({"entrypoint": "kvcm serve", "command": "--share"}) == [
        "kvcm",
        "serve",
        "--share",
    ]
    assert _k8s_argv({"command": ["kvcm"], "args": ["serve"]}) == ["kvcm", "serve"]
    assert _k8s_argv({"args": ["--share"]}) == ["kvcm", "serve", "--share"]


def test_prometheus_scrapes_the_metrics_route_on_the_probe_port() -> None:
    doc = yaml.safe_load(PROMETHEUS.read_text())
    port = int(_serve_args(_compose_argv(_compose()["services"]["kvcm"])).metrics_port)
    static = next(j for j in doc["scrape_configs"] if "static_configs" in j)
    assert static["metrics_path"] in _routes()
    assert static["static_configs"][0]["targets"] == [f"kvcm:{port}"]
    pod_meta = next(d for d in yaml.safe_load_all(K8S.read_text()) if d["kind"] == "Deployment")
    notes = pod_meta["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/path"] in _routes()
    assert int(notes["prometheus.io/port"]) == port


@pytest.mark.parametrize("path", [K8S, COMPOSE, PROMETHEUS], ids=lambda p: p.name)
def test_manifests_are_valid_yaml(path: Path) -> None:
    assert list(yaml.safe_load_all(path.read_text()))


# -- the image: pins, stages, user ---------------------------------------------------------


def _pins(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def _pip_installs() -> list[list[str]]:
    return [words for words in _stages()[0].commands() if words[:2] == ["pip", "install"]]


def test_the_image_pins_the_tests_torch_as_its_cuda_12_build() -> None:
    tested, image = _pins(TEST_CONSTRAINTS), _pins(IMAGE_CONSTRAINTS)
    version, _, label = image["torch"].partition("+")
    assert version == tested["torch"]  # the version the tests run
    assert re.fullmatch(r"cu12\d", label), label  # a CUDA 12 build, not PyPI's CUDA 13 one
    # CuPy for the same CUDA major, and the gpu extra asks for that package.
    assert "cupy-cuda12x" in image
    assert "cupy-cuda12x" in (ROOT / "pyproject.toml").read_text()
    builder = _stages()[0]
    (index,) = [a for a in builder.args("ARG") if a.startswith("TORCH_INDEX=")]
    assert index.removeprefix("TORCH_INDEX=") == f"https://download.pytorch.org/whl/{label}"


def test_every_pip_install_of_the_image_uses_both_constraint_files() -> None:
    installs = _pip_installs()
    assert len(installs) >= 2  # the large dependencies, then kvcm
    for words in installs:
        constraints = [words[i + 1] for i, w in enumerate(words) if w == "-c"]
        assert constraints == ["constraints.txt", "deploy/constraints-cuda12.txt"], words
        assert words[words.index("--extra-index-url") + 1] == "$TORCH_INDEX"
    assert any("./client" in w and ".[gpu]" in w for w in installs)  # kvcm with its extra


def test_the_image_is_two_stages_and_ships_no_compiler() -> None:
    builder, final = _stages()[0], _final()
    assert len(_stages()) == 2 and builder.name == "builder"
    assert builder.base == final.base  # the venv's interpreter is at the same path in both
    assert final.base.startswith("python:3.11")  # the tests' Python; the wheels bring CUDA
    builder_text = " ".join(rest for _, rest in builder.instructions)
    final_text = " ".join(rest for _, rest in final.instructions)
    assert "gcc" in builder_text and "native.available()" in builder_text  # the C core, checked
    assert "gcc" not in final_text and "apt-get" not in final_text
    assert "--from=builder /opt/kvcm /opt/kvcm" in final.args("COPY")
    assert "native.available()" in final_text  # and still importable without the compiler


def test_the_image_user_has_a_writable_home_and_cupy_cache() -> None:
    final = _final()
    env = final.env()
    (useradd,) = [w for w in final.commands() if w and w[0] == "useradd"]
    uid = useradd[useradd.index("--uid") + 1]
    gid = useradd[useradd.index("--gid") + 1]
    home = useradd[useradd.index("--home-dir") + 1]
    assert "--create-home" in useradd and "--no-create-home" not in useradd
    assert env["HOME"] == home
    cache = env["CUPY_CACHE_DIR"]
    (mkdir,) = [w for w in final.commands() if w[:2] == ["mkdir", "-p"]]
    assert cache in mkdir[2:]
    (chown,) = [w for w in final.commands() if w and w[0] == "chown"]
    assert chown[1] == "-R" and chown[2] == f"{uid}:{gid}"
    paths = chown[3:]
    assert any(cache == p or cache.startswith(p.rstrip("/") + "/") for p in paths)
    assert "/run/kvcm" in paths  # the socket directory too
    assert final.args("USER")[-1] == f"{uid}:{gid}" and uid != "0"


def test_the_container_toolkit_mounts_the_cuda_driver() -> None:
    assert "compute" in _final().env()["NVIDIA_DRIVER_CAPABILITIES"].split(",")


def test_dockerfile_runs_the_service_with_a_health_check() -> None:
    final = _final()
    env = final.env()
    (health,) = final.args("HEALTHCHECK")
    port = re.search(r"127\.0\.0\.1:(\d+)/livez", health).group(1)  # type: ignore[union-attr]
    assert port == env["KVCM_METRICS_PORT"] and final.args("EXPOSE") == [port]
    assert env["KVCM_DEVICE"].startswith("cuda")
    # Every KVCM_* variable the image sets is a setting kvcm reads.
    fields = {f"KVCM_{name.upper()}" for name in Settings.model_fields}
    for key in env:
        if key.startswith("KVCM_"):
            assert key in fields, key


def test_the_build_context_holds_every_copy_source() -> None:
    """.dockerignore lets in only what the Dockerfile copies; a COPY of something it leaves
    out fails the build."""
    allowed = [
        ln[1:].rstrip("/") for ln in DOCKERIGNORE.read_text().splitlines() if ln.startswith("!")
    ]
    assert DOCKERIGNORE.read_text().splitlines().count("*") == 1  # all else stays out
    for stage in _stages():
        for rest in stage.args("COPY"):
            words = rest.split()
            if words[0].startswith("--from="):
                continue
            for source in words[:-1]:
                assert any(source == a or source.startswith(a + "/") for a in allowed), source
