"""kvcm-client is its own distribution (client/pyproject.toml): installed alone into a fresh
virtualenv (no system site-packages), it has no torch or numpy, and its clients drive a real
``kvcm serve`` over HTTP and over the step channel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from servers import serve_process

pytestmark = pytest.mark.slow  # the client installed alone into a fresh virtualenv

ROOT = Path(__file__).resolve().parents[1]

#: Run inside the client-only virtualenv: argv[1] the service's URL, argv[2] its step socket.
SCHEDULER = r"""
import json, sys

out = {"missing": []}
for heavy in ("torch", "numpy", "cupy", "kvcm"):
    try:
        __import__(heavy)
    except ModuleNotFoundError:
        out["missing"].append(heavy)

import kvcm_client
from kvcm_client import KVCacheClient
from kvcm_client.errors import UnknownRequest
from kvcm_client.router import RouterClient  # a gateway asks kvcm router with this alone

out["file"] = kvcm_client.__file__
url, step_socket = sys.argv[1], sys.argv[2]
with KVCacheClient(url) as kv:  # HTTP
    out["tokens_per_block"] = kv.describe().tokens_per_block
    out["allocate"] = kv.allocate("a", 40).num_tokens
    out["extend"] = kv.extend("a", 1).num_tokens
    out["row"] = len(kv.block_table("a")[0])
    kv.free("a")
    out["free_after"] = kv.num_free_blocks() == kv.num_total_blocks()
with KVCacheClient(url, step_socket=step_socket) as kv:  # msgpack frames on the Unix socket
    kv.allocate("b", 16)
    results = kv.step([{"op": "extend", "request_id": "b", "num_new_tokens": 1}])
    out["step"] = results[0].request.num_tokens
    kv.free("b")
    try:
        kv.free("b")
    except UnknownRequest as exc:
        out["error"] = exc.code
    try:
        kv.attach()  # needs the "attach" extra
    except ModuleNotFoundError as exc:
        out["attach"] = exc.name
    out["consumers"] = len(kv.consumers())  # a failed attach registered none
    cols = kv.step_columns(allocate=[{"request_id": "c", "num_tokens": 16}])
    done = kv.step_columns(extend=cols.handles, free=[])
    out["columns"] = [cols.ok, done.ok, done.new_blocks, kv.request("c").num_tokens]
    kv.step_columns(free=cols.handles)
out["router_client"] = RouterClient.__module__
out["loaded"] = sorted(
    {m.split(".")[0] for m in sys.modules} & {"torch", "numpy", "cupy", "kvcm"}
)
print(json.dumps(out))
"""


def _clean_env() -> dict[str, str]:
    """This environment without what would leak the test's own packages into the venv."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(cmd: list[str], cwd: Path, timeout: float) -> str:
    proc = subprocess.run(
        cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_client_distribution_declares_only_the_light_dependencies() -> None:
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = {d.split(">")[0].split("=")[0].split("[")[0] for d in client["dependencies"]}
    assert names == {"httpx", "pydantic", "msgpack"}
    assert {d.split(">")[0] for d in client["optional-dependencies"]["attach"]} == {
        "torch",
        "numpy",
    }
    # One owner of kvcm_client, and the service pins the client of its own version.
    assert "kvcm_client" not in root["tool"]["setuptools"]["packages"]
    assert "kvcm_client" not in root["tool"]["setuptools"]["package-dir"]
    assert f"kvcm-client=={client['version']}" in root["project"]["dependencies"]
    assert client["version"] == root["project"]["version"]


def test_client_alone_in_a_fresh_venv_drives_a_real_service(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # No --system-site-packages: only what pip installs below is importable.
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    _run([*pip, str(ROOT / "client")], tmp_path, 240)
    script = tmp_path / "scheduler.py"
    script.write_text(SCHEDULER)
    sock = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvcm-dist-{os.getpid()}.sock"
    args = ("--default-model", "--num-blocks", "64", "--tokens-per-block", "16")
    try:
        with serve_process(*args, "--step-socket", str(sock), "--log-level", "warning") as (
            url,
            _,
            _,
        ):
            # cwd: tmp_path, so that neither client/ nor the repository is on sys.path.
            out = json.loads(_run([str(python), str(script), url, str(sock)], tmp_path, 60))
    finally:
        sock.unlink(missing_ok=True)
    assert out["missing"] == ["torch", "numpy", "cupy", "kvcm"]
    assert Path(out["file"]).is_relative_to(venv)  # the installed copy, not client/
    assert out["tokens_per_block"] == 16
    assert (out["allocate"], out["extend"], out["row"]) == (40, 41, 3)
    assert out["free_after"] is True
    assert out["step"] == 17
    assert out["error"] == "unknown_request"
    assert out["attach"] == "torch" and out["consumers"] == 0
    assert out["columns"] == [True, True, [1], 17]
    assert out["router_client"] == "kvcm_client.router"
    assert out["loaded"] == []
