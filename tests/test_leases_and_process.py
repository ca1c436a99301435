"""Leases, the ``kvcm serve`` process (TCP and Unix socket) and the clients' retry rules."""

from __future__ import annotations

import signal
import socket
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import layer
from servers import serve_in_thread, serve_process

from kvcm import KVCacheManager
from kvcm.server.app import create_app
from kvcm.server.state import ServiceState
from kvcm_client import KVCacheClient
from kvcm_client.errors import ServiceUnavailable, UnknownRequest, UnknownSession
from kvcm_client.models import AllocateOp, FreeOp, StepRequest

pytestmark = pytest.mark.slow  # real kvcm serve processes: leases, signals

CONFIG = {
    "layers": [layer(0)],
    "tokens_per_block": 4,
    "max_requests": 8,
    "max_seq_len": 64,
    "num_blocks": 32,
}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_expired_lease_frees_exactly_its_sessions_requests() -> None:
    clock = Clock()
    state = ServiceState(KVCacheManager(CONFIG), lease_ttl_s=10, clock=clock)
    m = state.manager
    s1 = state.open_session(None).session_id
    s2 = state.open_session(5).session_id
    state.allocate(AllocateOp(request_id="a", num_tokens=8), s1)
    ops = [
        AllocateOp(request_id="b", num_tokens=4),
        AllocateOp(request_id="c", num_tokens=4),
        FreeOp(request_id="c"),
    ]
    state.step_json(StepRequest(ops=ops).model_dump_json().encode(), s1)
    state.allocate(AllocateOp(request_id="d", num_tokens=4), s2)
    state.allocate(AllocateOp(request_id="e", num_tokens=4), None)  # no lease: never expires
    assert state.leases.info(s1).num_requests == 2
    clock.now += 6  # s2 (ttl 5) ran out; s1 (ttl 10) has 4 s left
    assert state.expire() == 1
    assert sorted(m.request_ids()) == ["a", "b", "e"]
    state.touch(s1)  # renewed at t + 6: lives until t + 16
    clock.now += 9
    assert state.expire() == 0
    clock.now += 2
    assert state.expire() == 2
    assert m.request_ids() == ["e"]
    assert m.num_free_blocks() == 32 - 1
    with pytest.raises(UnknownSession):
        state.touch(s1)
    assert state.metrics.lease_requests_freed._value.get() == 3
    assert state.metrics.lease_sessions_expired._value.get() == 2


def test_a_scheduler_that_stops_renewing_loses_its_requests_on_a_real_server() -> None:
    app = create_app(KVCacheManager(CONFIG), lease_ttl_s=1.0)
    with serve_in_thread(app) as url, KVCacheClient(url) as kv, KVCacheClient(url) as other:
        kv.open_session()
        kv.allocate("a", 8)
        kv.allocate("b", 4)
        other.allocate("mine", 4)
        for _ in range(10):  # 2 s of calls every 0.2 s, twice the TTL: the lease holds
            time.sleep(0.2)
            kv.extend("a", 1)
        assert sorted(kv.request_ids()) == ["a", "b", "mine"]
        time.sleep(2.5)  # silence past the TTL: the reaper frees a and b
        assert other.request_ids() == ["mine"]
        with pytest.raises(UnknownSession):
            kv.extend("a", 1)
        text = httpx.get(f"{url}/metrics").text
        assert "kvcm_lease_requests_freed_total 2.0" in text
        assert "kvcm_lease_sessions_expired_total 1.0" in text
        kv.session_id = None
        with pytest.raises(UnknownRequest):
            kv.extend("a", 1)


def test_closing_a_session_frees_its_requests_now() -> None:
    with serve_in_thread(create_app(KVCacheManager(CONFIG))) as url, KVCacheClient(url) as kv:
        info = kv.open_session(ttl_s=60)
        assert info.ttl_s == 60 and info.num_requests == 0
        kv.allocate("a", 5)
        assert kv.renew_session().num_requests == 1
        assert kv.close_session().freed_requests == 1
        assert kv.request_ids() == [] and kv.num_free_blocks() == 32


def test_serve_on_a_unix_socket_with_a_token(tmp_path: Path) -> None:
    sock = tmp_path / "kvcm.sock"
    env = {"KVCM_API_TOKEN": "tok-123", "KVCM_NUM_BLOCKS": "16", "KVCM_DEFAULT_MODEL": "1"}
    with serve_process("--uds", str(sock), env=env, uds=sock) as (url, proc, lines):
        assert url == f"unix:{sock}"
        mode = stat.S_IMODE(sock.stat().st_mode)
        assert mode & 0o007 == 0  # no access for others
        with KVCacheClient(uds=sock, token="tok-123") as kv:
            assert kv.allocate("a", 20).num_tokens == 20
            # kvcm serve turns the null page on: 16 slots, 15 of them usable.
            assert kv.describe().null_page and kv.num_total_blocks() == 15
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
        proc.drain.join(5)  # type: ignore[attr-defined]
        out = "".join(lines)
        # A graceful shutdown, then exit status 0 (tests/test_cli_errors.py: SIGINT alike),
        # and the socket file removed.
        assert "Application shutdown complete" in out and proc.returncode == 0
        assert "tok-123" not in out and not sock.exists()


def test_serve_a_hugging_face_model_config_over_tcp() -> None:
    model = Path(__file__).parent / "fixtures" / "models" / "gpt-oss-20b.json"
    args = ("--model-config", str(model), "--memory", "256MiB", "--max-seq-len", "4096")
    args += ("--max-prefill-chunk", "512")
    with serve_process(*args) as (url, _, _), KVCacheClient(url) as kv:
        assert url.startswith("http://127.0.0.1:")
        layout = kv.describe()
        assert [g.sliding_window for g in layout.layer_groups] == [128, None]
        # One pool group of 682 slots of 384 KiB (12 layers x K+V x 16 tokens x 8 x 64 x 2 bytes
        # per layer group); a request of 4096 tokens in 512-token chunks peaks at 256 full
        # blocks + 41 window blocks (from h = 16k + r, 0 < r < 15: k + 33 held, k - 8 released).
        assert kv.estimate(4096).max_requests == 682 // 297 == 2
        # A whole 4096-token prompt per op takes 512 slots: one request.
        assert kv.estimate(4096, prefill_chunk=4096).max_requests == 1


def _closing_server() -> tuple[socket.socket, list[int]]:
    """Accepts connections, reads a request, closes without answering; counts them."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    seen = [0]

    def loop() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            seen[0] += 1
            conn.recv(65536)
            conn.close()

    threading.Thread(target=loop, daemon=True).start()
    return srv, seen


def test_only_idempotent_ops_are_resent_after_a_broken_connection() -> None:
    srv, seen = _closing_server()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"
    try:
        with KVCacheClient(url, retries=2, backoff_s=0.001) as kv:
            with pytest.raises(ServiceUnavailable) as exc:
                kv.extend("a", 1)  # may have been applied: never resent
            assert exc.value.detail["attempts"] == 1
            time.sleep(0.05)
            assert seen[0] == 1
            with pytest.raises(ServiceUnavailable) as exc:
                kv.allocate("a", 1)  # an identical allocate is idempotent: resent
            assert exc.value.detail["attempts"] == 3
            time.sleep(0.05)
            assert seen[0] == 4
    finally:
        srv.close()


def test_a_refused_connection_is_retried_for_any_op() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with KVCacheClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.001) as kv:
        with pytest.raises(ServiceUnavailable) as exc:
            kv.free("a")
        assert exc.value.code == "service_unavailable" and exc.value.detail["attempts"] == 3


def test_the_probe_port_serves_probes_and_metrics_but_not_the_api(tmp_path: Path) -> None:
    sock = tmp_path / "kvcm.sock"
    args = ("--uds", str(sock), "--metrics-port", "0", "--default-model", "--num-blocks", "8")
    with serve_process(*args, uds=sock) as (_, proc, lines):
        with KVCacheClient(uds=sock) as kv:
            kv.allocate("a", 5)
        probe = next(ln.split()[-1] for ln in lines if "probes and metrics on" in ln)
        assert httpx.get(f"{probe}/livez").json() == {"status": "ok", "detail": ""}
        assert httpx.get(f"{probe}/readyz").status_code == 200
        assert "kvcm_requests_running 1.0" in httpx.get(f"{probe}/metrics").text
        assert (
            httpx.post(
                f"{probe}/v1/allocate", json={"request_id": "b", "num_tokens": 1}
            ).status_code
            == 404
        )
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{probe}/livez", timeout=2)
