"""Real servers for the service tests: uvicorn on loopback, in a thread or in a process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def serve_in_thread(app: FastAPI) -> Iterator[str]:
    """A real uvicorn server on 127.0.0.1 (a free port) in a thread; yields its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.005)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextmanager
def serve_process(
    *args: str,
    env: dict[str, str] | None = None,
    uds: Path | None = None,
    port: int = 0,
    own_group: bool = False,
    model: bool = True,
    command: str = "serve",
) -> Iterator[tuple[str, subprocess.Popen[str], list[str]]]:
    """``python -m kvcm serve ARGS`` in its own process, once ready (``model`` False: once
    up without a model, ``/readyz`` answering 503 ``no_model``). ``command="router"`` runs
    ``kvcm router ARGS`` the same way (its ``/readyz`` says ``no_model`` until a sidecar
    told it the model).

    Yields (url, process, the lines it printed: up to the "serving on" line, then more as a
    thread drains its output; once it exited, ``process.drain.join()`` completes them).
    ``own_group`` starts it in a process group of its own, so that a test can kill it together
    with its helpers (``os.killpg``), as a container kill would.
    """
    cmd = [sys.executable, "-m", "kvcm", command, *args]
    if uds is None:
        cmd += ["--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=own_group,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        match = None
        while match is None:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("kvcm did not start:\n" + "".join(lines))
            lines.append(line)
            match = re.search(r"serving on (\S+)", line)
        url = match.group(1)
        # Keep reading what it prints, so that a full pipe never blocks its logging.
        drain = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        drain.start()
        proc.drain = drain  # type: ignore[attr-defined]  # join it to read all it printed
        transport = httpx.HTTPTransport(uds=str(uds)) if uds else None
        base = "http://kvcm" if uds else url
        with httpx.Client(base_url=base, transport=transport) as http:
            deadline = time.monotonic() + 30
            while True:
                try:
                    ready = http.get("/readyz")
                    if ready.status_code == 200 or (
                        not model and ready.json()["status"] == "no_model"
                    ):
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("kvcm never became ready")
                time.sleep(0.05)
        yield url, proc, lines
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def small_model_args(tmp_path: Path, layers: list[dict[str, Any]]) -> tuple[list[str], Path]:
    """``kvcm serve`` arguments for a tiny model of ``layers`` (4 tokens a block, 40 blocks,
    8 requests of at most 64 tokens) with a step socket: (the arguments, the socket)."""
    spec = tmp_path / "layers.json"
    spec.write_text(json.dumps(layers))
    sock = tmp_path / "step.sock"
    args = ["--layers", str(spec), "--tokens-per-block", "4", "--num-blocks", "40"]
    args += ["--max-requests", "8", "--max-seq-len", "64", "--step-socket", str(sock)]
    return args, sock


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A real ``redis-server`` on loopback (a free port), without persistence, that a test
    can restart empty on the same port (``restart``). ``pytest.skip`` where the binary is
    missing (CI installs it: .ci/run)."""

    def __init__(self) -> None:
        import pytest

        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import redis

        assert self.binary is not None
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
        self.proc = subprocess.Popen(
            [self.binary, *args, "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        """Kill it and start an empty one on the same port (it saves nothing)."""
        self.stop()
        self.start()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SyncOverAsync:
    """Call an async client's methods synchronously (one private event loop), so that one
    scenario function drives the manager and both clients."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._loop = asyncio.new_event_loop()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._loop.run_until_complete(method(*args, **kwargs))

        return call

    def close(self) -> None:
        self._loop.run_until_complete(self._client.aclose())
        self._loop.close()
