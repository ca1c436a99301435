"""A restart of the service cannot go unnoticed: generations on every answer, pinned by the
clients, checked by attachments; a killed service's shared segments are reclaimed at the next
start. Real ``kvcm serve`` processes, killed with SIGKILL together with their helpers."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from pathlib import Path

import httpx
import pytest
from servers import serve_process

from kvcm_client import KVCacheClient, attach
from kvcm_client.errors import StaleGeneration

pytestmark = pytest.mark.slow  # real kvcm serve processes killed and restarted

ARGS = ("--num-blocks", "64", "--max-seq-len", "256", "--layers")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _segments(layout: object) -> list[Path]:
    return [Path("/dev/shm") / s.name for s in (*layout.pools, layout.page_tables)]  # type: ignore[attr-defined]


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX shared memory lives in /dev/shm")
def test_a_restart_is_noticed_and_the_old_segments_reclaimed(tmp_path: Path) -> None:
    layers = tmp_path / "layers.json"
    layers.write_text('[{"layer_id": 0, "num_kv_heads": 2, "head_dim": 8}]')
    port = _free_port()
    with serve_process(*ARGS, str(layers), port=port, own_group=True) as (url, proc, _):
        client = KVCacheClient(url, retries=0)
        client.allocate("a", 4)
        first = client.generation
        assert first is not None and len(first) == 32
        assert httpx.get(f"{url}/livez").headers["x-kvcm-generation"] == first
        with_client = client.attach()
        alone = attach(client.pools())
        with_client.check()
        alone.check()
        old = _segments(with_client.layout)
        os.killpg(proc.pid, signal.SIGKILL)  # the service and its resource tracker
        proc.wait(10)
    assert all(p.exists() for p in old)  # nobody unlinked them
    with serve_process(*ARGS, str(layers), port=port, own_group=True) as (url2, _, _):
        assert url2 == url
        assert not any(p.exists() for p in old)  # reclaimed at start
        # Pinned to the old generation: refused before anything is applied.
        with pytest.raises(StaleGeneration):
            client.allocate("b", 4)
        with KVCacheClient(url) as fresh:
            assert fresh.request_ids() == []
            assert fresh.generation not in (None, first)
        for attachment in (with_client, alone):
            with pytest.raises(StaleGeneration):
                attachment.check()
        # The engine's reconnect: forget the pin, re-attach, rebuild its requests.
        client.reconnect()
        client.allocate("b", 4)
        assert client.generation not in (None, first)
        again = client.attach()
        again.check()
        again.close()
        alone.close()
        client.close()


def test_a_request_naming_another_generation_is_refused_with_409() -> None:
    from helpers import layer
    from servers import serve_in_thread

    from kvcm import KVCacheManager
    from kvcm.server.app import create_app

    m = KVCacheManager({"layers": [layer(0)], "num_blocks": 8, "max_seq_len": 32})
    with serve_in_thread(create_app(m)) as url, httpx.Client(base_url=url) as http:
        stale = {"X-KVCM-Generation": "0" * 32}
        r = http.post("/v1/allocate", json={"request_id": "a", "num_tokens": 2}, headers=stale)
        assert r.status_code == 409 and r.json()["code"] == "stale_generation"
        assert r.headers["x-kvcm-generation"] == m.generation
        assert m.request_ids() == []
        ok = {"X-KVCM-Generation": m.generation}
        r = http.post("/v1/allocate", json={"request_id": "a", "num_tokens": 2}, headers=ok)
        assert r.status_code == 200 and r.headers["x-kvcm-generation"] == m.generation
        # Errors carry it too.
        assert http.get("/v1/request", params={"request_id": "zz"}).headers["x-kvcm-generation"]


def test_sigterm_answers_open_long_polls_then_exits() -> None:
    import threading
    import time

    answers: list[httpx.Response] = []
    with serve_process("--default-model", "--num-blocks", "16") as (url, proc, _):

        def poll() -> None:
            answers.append(httpx.get(f"{url}/v1/events", params={"timeout_s": 50}, timeout=60))

        thread = threading.Thread(target=poll)
        thread.start()
        time.sleep(0.5)  # the poll is waiting in the service
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        thread.join(20)
        assert proc.wait(20) is not None
        assert time.monotonic() - start < 10  # not the poll's 50 s
    (answer,) = answers
    assert answer.status_code == 200 and answer.json()["events"] == []


def test_slow_and_silent_clients_are_cut_off_while_others_are_served() -> None:
    """Connections that send nothing, or their headers or body a byte at a time, are closed
    once --request-timeout passes; a normal client is served all along."""
    import time

    slow: list[tuple[socket.socket, bytes]] = []
    with serve_process("--default-model", "--num-blocks", "16", "--request-timeout", "1") as (
        url,
        _,
        _,
    ):
        host, port = url.removeprefix("http://").split(":")
        for kind in range(60):
            s = socket.create_connection((host, int(port)))
            if kind % 3 == 0:  # silent
                slow.append((s, b""))
            elif kind % 3 == 1:  # headers that never end
                s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")
                slow.append((s, b"X-More: y\r\n"))
            else:  # a body that never ends
                s.sendall(b"POST /v1/allocate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
                slow.append((s, b" "))
        start = time.monotonic()
        with httpx.Client(base_url=url) as http:
            while time.monotonic() - start < 2.5:
                assert http.get("/livez").status_code == 200
                for s, more in slow:  # trickling more does not reset the deadline
                    with contextlib.suppress(OSError):
                        s.send(more)
                time.sleep(0.2)
        for s, _ in slow:
            s.settimeout(2)
            try:
                data = s.recv(1024)
            except OSError:
                data = b""
            assert data == b""  # closed by the service, nothing answered
            s.close()


def test_without_httptools_the_service_still_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvcm.server.protocol as protocol

    monkeypatch.setattr(protocol, "HttpToolsProtocol", None)
    assert protocol.with_deadline(1.0) == "h11"
