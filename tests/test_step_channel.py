"""The step channel (docs/step-channel.md) against real ``kvcm serve`` processes: the same
answers as HTTP, the same typed errors, leases, metrics, limits and concurrent clients."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from helpers import FakeStepChannel
from servers import SyncOverAsync, serve_process

from kvcm_client import AsyncKVCacheClient, KVCacheClient
from kvcm_client.errors import (
    MalformedRequest,
    PayloadTooLarge,
    ServiceUnavailable,
    StaleGeneration,
    Unauthorized,
    UnknownRequest,
)
from kvcm_client.step_channel import HEADER, pack, unpack

pytestmark = pytest.mark.slow  # real kvcm serve processes over the step channel

ROOT = Path(__file__).resolve().parents[1]
ARGS = (
    "--default-model",
    "--num-blocks",
    "64",
    "--tokens-per-block",
    "16",
    "--log-level",
    "warning",
)


@pytest.fixture
def sock_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Unix socket paths are limited to ~107 bytes: keep it short.
    return Path(tmp_path_factory.mktemp("uds")) / "step.sock"


@pytest.fixture
def served(sock_path: Path) -> Iterator[tuple[str, Path]]:
    with serve_process(*ARGS, "--step-socket", str(sock_path)) as (url, _, _):
        yield url, sock_path


def _scenario(kv: KVCacheClient) -> list[Any]:
    """A few scheduler steps; everything they answer, in order."""
    out: list[Any] = [kv.allocate("a", 40, token_ids=list(range(40))).model_dump()]
    results = kv.step(
        [
            {"op": "extend", "request_id": "a", "num_new_tokens": 1},
            {"op": "allocate", "request_id": "b", "num_tokens": 33, "token_ids": list(range(33))},
            {"op": "extend", "request_id": "nope", "num_new_tokens": 1},
            {"op": "allocate", "request_id": "big", "num_tokens": 64 * 16},
        ]
    )
    out.append([r.model_dump() for r in results])
    kv.extend_many(["a", "b"], [3, 2])
    out.append(kv.slot_mappings(["a", "b"], [3, 2], pad_to=8))
    out.append(kv.slot_mapping(["a", "b"], 0, [3, 2]))
    out.append(kv.commit("a", list(range(44))).model_dump())
    out.append(kv.probe(list(range(40))))
    out.append(kv.extend("b", 5).model_dump())
    out.append(kv.rewind("b", 2).model_dump())
    kv.free("b")
    out.append([r.model_dump() for r in kv.step([{"op": "free", "request_id": "a"}])])
    return out


def _tables(url: str) -> Any:
    with KVCacheClient(url) as kv:
        stats = kv.stats()
        return stats.free_blocks, stats.num_requests, stats.prefix_cache


def test_the_same_scenario_gives_the_same_answers_over_http_and_the_socket(
    sock_path: Path,
) -> None:
    with serve_process(*ARGS) as (url, _, _), KVCacheClient(url) as kv:
        over_http = _scenario(kv)
        http_state = _tables(url)
    with (
        serve_process(*ARGS, "--step-socket", str(sock_path)) as (url, _, _),
        KVCacheClient(url, step_socket=sock_path) as kv,
    ):
        over_socket = _scenario(kv)
        assert _tables(url) == http_state
        kv.allocate("c", 20)
        with KVCacheClient(url) as http:
            assert kv.slot_mappings(["c"]) == http.slot_mappings(["c"])
    assert over_socket == over_http
    assert over_http[1][2]["error"]["code"] == "unknown_request"
    assert over_http[1][3]["error"]["code"] == "out_of_blocks"
    assert not sock_path.exists()  # removed at shutdown


def test_the_async_client_gives_the_same_answers(sock_path: Path) -> None:
    with serve_process(*ARGS) as (url, _, _), KVCacheClient(url) as kv:
        over_http = _scenario(kv)
    with serve_process(*ARGS) as (url, _, _), KVCacheClient(url) as kv:
        columnar_over_http = _columnar_scenario(kv)
    with serve_process(*ARGS, "--step-socket", str(sock_path)) as (url, _, _):
        kv = SyncOverAsync(AsyncKVCacheClient(url, step_socket=sock_path))
        try:
            assert _scenario(kv) == over_http
            with pytest.raises(UnknownRequest):
                kv.extend("ghost", 1)
        finally:
            kv.close()
        text = httpx.get(f"{url}/metrics").text
        assert 'kvcm_step_channel_frames_total{op="step",result="ok"} 2.0' in text
    sock_path.unlink(missing_ok=True)
    with serve_process(*ARGS, "--step-socket", str(sock_path)) as (url, _, _):
        kv = SyncOverAsync(AsyncKVCacheClient(url, step_socket=sock_path))
        try:
            assert _columnar_scenario(kv) == columnar_over_http
        finally:
            kv.close()


def test_socket_mode_and_a_live_or_stale_socket(served: tuple[str, Path], tmp_path: Path) -> None:
    url, path = served
    assert oct(path.stat().st_mode & 0o777) == "0o660"
    # A second service on the same, live, socket refuses to start.
    with (
        pytest.raises(RuntimeError, match="another process serves on it"),
        serve_process(*ARGS, "--step-socket", str(path)),
    ):
        pass
    with KVCacheClient(url, step_socket=path) as kv:  # the first one still serves
        assert kv.allocate("x", 3).num_tokens == 3
    # A stale socket (nobody listens) is replaced.
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    with (
        serve_process(*ARGS, "--step-socket", str(stale)) as (url2, _, _),
        KVCacheClient(url2, step_socket=stale) as kv,
    ):
        assert kv.allocate("x", 3).num_tokens == 3


def test_typed_errors_and_nothing_changed(served: tuple[str, Path]) -> None:
    url, path = served
    with KVCacheClient(url, step_socket=path) as kv:
        with pytest.raises(UnknownRequest) as err:
            kv.extend("ghost", 1)
        assert err.value.status == 404 and err.value.detail == {"request_id": "ghost"}
        kv.allocate("a", 10)
        with KVCacheClient(url) as http:
            http.free("a")
            layers = [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 16}]
            http.register_model(layers=layers, num_blocks=32)  # a new generation
        with pytest.raises(StaleGeneration):
            kv.step([{"op": "allocate", "request_id": "z", "num_tokens": 1}])
        with KVCacheClient(url) as http:
            assert http.request_ids() == []
        kv.reconnect()
        assert kv.allocate("z", 1).row == 0  # pinned to the new generation now


def _raw(path: Path, frame: bytes) -> tuple[dict[str, Any], bool]:
    """Send raw bytes; the answer and whether the service closed the connection after it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(path))
        s.sendall(frame)
        data = b""
        while len(data) < 4 or len(data) < 4 + HEADER.unpack(data[:4])[0]:
            chunk = s.recv(65536)
            assert chunk, "closed without an answer"
            data += chunk
        answer = unpack(data[4:])
        closed = bool(answer.get("close"))
        if closed:  # the flag says so, and the service did close
            assert s.recv(1) == b""
        return answer, closed


def test_bad_frames_are_refused_and_the_connection_closed(served: tuple[str, Path]) -> None:
    url, path = served
    before = _tables(url)
    answer, closed = _raw(path, HEADER.pack(50 << 20))
    assert answer["error"]["code"] == PayloadTooLarge.code and answer["status"] == 413 and closed
    junk = b"\xc1\xc1\xc1"
    answer, closed = _raw(path, HEADER.pack(len(junk)) + junk)
    assert answer["error"]["code"] == MalformedRequest.code and answer["status"] == 400 and closed
    answer, closed = _raw(path, pack({"op": "teleport"}))
    assert answer["error"]["code"] == "invalid_argument" and not closed
    answer, closed = _raw(path, pack({"op": "step", "args": {"ops": [{"op": "extend"}]}}))
    assert answer["error"]["code"] == "invalid_argument" and answer["status"] == 422
    assert _tables(url) == before
    with KVCacheClient(url, step_socket=path) as kv:  # the typed client gets the typed error
        with pytest.raises(PayloadTooLarge):
            kv.probe([1] * 2_000_000)
        assert kv.allocate("after", 3).num_tokens == 3  # and reconnects


def test_token_is_required_where_http_requires_it(sock_path: Path) -> None:
    env = {"KVCM_API_TOKEN": "tok-123"}
    with serve_process(*ARGS, "--step-socket", str(sock_path), env=env) as (url, _, _):
        with KVCacheClient(url, step_socket=sock_path, token="wrong") as kv:
            with pytest.raises(Unauthorized):
                kv.step([{"op": "allocate", "request_id": "a", "num_tokens": 1}])
            assert kv.probe([1, 2, 3]) == 0  # a read: no token needed, as over HTTP
        with KVCacheClient(url, step_socket=sock_path, token="tok-123") as kv:
            assert kv.step([{"op": "allocate", "request_id": "a", "num_tokens": 1}])[0].ok


def test_leases_and_metrics_count_socket_ops(served: tuple[str, Path]) -> None:
    url, path = served
    with KVCacheClient(url, step_socket=path) as kv:
        kv.open_session(ttl_s=30)
        kv.allocate("a", 5)
        kv.step([{"op": "allocate", "request_id": "b", "num_tokens": 5}])
        kv.step([{"op": "extend", "request_id": "a", "num_new_tokens": 1}])
        assert kv.close_session().freed_requests == 2
    text = httpx.get(f"{url}/metrics").text
    assert 'kvcm_ops_total{op="allocate",result="ok"} 2.0' in text
    assert 'kvcm_ops_total{op="extend",result="ok"} 1.0' in text
    assert 'kvcm_ops_total{op="free",result="ok"} 2.0' in text
    assert 'kvcm_step_channel_frames_total{op="step",result="ok"} 2.0' in text
    assert "kvcm_step_channel_connections_total 1.0" in text
    with KVCacheClient(url) as http:
        assert http.request_ids() == []


def test_a_silent_sessions_socket_requests_are_freed_when_it_expires(
    served: tuple[str, Path],
) -> None:
    url, path = served
    with KVCacheClient(url, step_socket=path) as kv:
        kv.open_session(ttl_s=0.5)
        kv.allocate("a", 5)
        kv.step([{"op": "allocate", "request_id": "b", "num_tokens": 5}])
    with KVCacheClient(url) as http:
        deadline = time.monotonic() + 10
        while http.request_ids() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert http.request_ids() == []
    assert "kvcm_lease_requests_freed_total 2.0" in httpx.get(f"{url}/metrics").text


def test_a_restarted_service_is_noticed_over_the_socket(sock_path: Path) -> None:
    kv = KVCacheClient("http://127.0.0.1:9", step_socket=sock_path, backoff_s=0.05)
    with kv:
        with serve_process(*ARGS, "--step-socket", str(sock_path)):
            kv.allocate("a", 5)
            pinned = kv.generation
        with serve_process(*ARGS, "--step-socket", str(sock_path)) as (url, _, _):
            # The old connection is gone: the step is sent again on a new one (it never
            # ran), and the new service refuses it before applying anything.
            with pytest.raises(StaleGeneration):
                kv.step([{"op": "allocate", "request_id": "b", "num_tokens": 5}])
            with KVCacheClient(url) as http:
                assert http.request_ids() == []
            kv.reconnect()
            assert kv.allocate("b", 5).row == 0
            assert kv.generation != pinned


def test_concurrent_clients_on_one_server(served: tuple[str, Path]) -> None:
    url, path = served
    errors: list[BaseException] = []

    def scheduler(name: str) -> None:
        try:
            with KVCacheClient(url, step_socket=path) as kv:
                for i in range(200):
                    rid = f"{name}-{i}"
                    results = kv.step(
                        [
                            {"op": "allocate", "request_id": rid, "num_tokens": 17},
                            {"op": "extend", "request_id": rid, "num_new_tokens": 1},
                            {"op": "free", "request_id": rid},
                        ]
                    )
                    assert [r.ok for r in results] == [True, True, True], results
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=scheduler, args=(n,)) for n in ("x", "y")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with KVCacheClient(url) as kv:
        assert kv.request_ids() == []
        assert kv.stats().num_requests == 0


class _Mute(FakeStepChannel):
    """A fake channel: reads a frame and closes each connection without answering."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.frames_read = 0

    def serve(self, conn: socket.socket) -> None:
        for _ in self.frames(conn):
            self.frames_read += 1
            return


def test_a_step_is_not_resent_once_sent_but_a_read_is(sock_path: Path) -> None:
    mute = _Mute(sock_path)
    mute.start()
    with KVCacheClient("http://127.0.0.1:9", step_socket=sock_path, backoff_s=0.001) as kv:
        with pytest.raises(ServiceUnavailable):
            kv.step([{"op": "extend", "request_id": "a", "num_new_tokens": 1}])
        assert mute.frames_read == 1
        with pytest.raises(ServiceUnavailable):
            kv.slot_mappings(["a"])
        assert mute.frames_read == 1 + 3  # retries=2: sent three times
    kv = SyncOverAsync(AsyncKVCacheClient("http://127.0.0.1:9", step_socket=sock_path))
    try:
        with pytest.raises(ServiceUnavailable):
            kv.extend_many(["a"])
        assert mute.frames_read == 4 + 1
        with pytest.raises(ServiceUnavailable):
            kv.probe([1, 2])
        assert mute.frames_read == 5 + 3
    finally:
        kv.close()
    mute.listener.close()


NO_TORCH = """
import sys
sys.modules["torch"] = None  # importing torch now fails
from kvcm_client import AsyncKVCacheClient, KVCacheClient
with KVCacheClient(sys.argv[1], step_socket=sys.argv[2]) as kv:
    kv.allocate("a", 20)
    results = kv.step([{"op": "extend", "request_id": "a", "num_new_tokens": 2}])
    kv.extend_many(["a"], 1)
    print(results[0].request.num_tokens, kv.slot_mappings(["a"]))
"""


def test_the_client_needs_no_torch(served: tuple[str, Path]) -> None:
    url, path = served
    # The client's own dependencies may come from PYTHONPATH (the GPU machine installs them
    # in a directory there); the project's other packages may not.
    kept = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and not Path(p).resolve().is_relative_to(ROOT)
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "client"), *kept])}
    out = subprocess.run(
        [sys.executable, "-c", NO_TORCH, url, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    with KVCacheClient(url) as http:
        expected = http.slot_mappings(["a"])
    assert out.stdout.split(" ", 1) == ["22", f"{expected}\n"]


def test_msgpack_frame_format_is_documented() -> None:
    frame = pack({"op": "probe", "args": {"token_ids": [1]}})
    assert frame[:4] == struct.pack("<I", len(frame) - 4)
    assert msgpack.unpackb(frame[4:]) == {"op": "probe", "args": {"token_ids": [1]}}


def _columnar_scenario(kv: KVCacheClient) -> list[Any]:
    """A columnar decode loop: allocate by id, then handles only; every answer in order."""
    out: list[Any] = []
    first = kv.step_columns(
        allocate=[
            {"request_id": "a", "num_tokens": 20, "token_ids": list(range(20))},
            {"request_id": "b", "num_tokens": 40},
        ]
    )
    ha, hb = first.handles
    out.append((first.ok, first.status, first.hit_tokens, first.allocate_new_blocks))
    step = kv.step_columns(
        commit=[ha],
        commit_tokens=[list(range(20))],
        extend=[ha, hb],
        num_new_tokens=[1, 30],
        map_slots=True,
    )
    out.append((step.ok, step.status, step.new_blocks))
    # The step's own mapping: a's new token, then b's 30, as slot_mappings maps them.
    assert step.slot_mapping is not None
    mapped = [g.tolist() for g in step.slot_mapping]
    assert mapped == kv.slot_mappings(["a", "b"], [1, 30])
    out.append(mapped)
    # c reuses a's committed block; b's stale handle after its free names nothing.
    step = kv.step_columns(
        free=[hb],
        extend=[hb],
        allocate=[{"request_id": "c", "num_tokens": 17, "token_ids": list(range(17))}],
        map_slots=True,
    )
    out.append(
        (step.ok, step.codes("extend"), step.hit_tokens, [e.error.code for e in step.errors])
    )
    assert step.slot_mapping is not None  # c's one token past its 16-token hit only
    out.append([g.tolist() for g in step.slot_mapping])
    assert out[-1] == kv.slot_mappings(["c"], [1])
    out.append(kv.block_table("a"))
    out.append(kv.block_table("c"))
    return out


def test_columnar_steps_answer_the_same_over_http_and_the_socket(
    served: tuple[str, Path],
) -> None:
    url, path = served
    with KVCacheClient(url, step_socket=str(path)) as fast:
        over_socket = _columnar_scenario(fast)
        assert fast.stats().num_requests == 2
        metrics = httpx.get(f"{url}/metrics").text
    assert 'kvcm_ops_total{op="extend",result="unknown_request"} 1.0' in metrics
    with serve_process(*ARGS) as (http_url, _, _), KVCacheClient(http_url) as plain:
        over_http = _columnar_scenario(plain)
    assert over_socket == over_http
    none: dict[str, list[int]] = {
        s: [] for s in ("free", "rewind", "commit", "suspend", "resume", "extend")
    }
    assert over_socket[0] == (True, {**none, "allocate": [0, 0]}, [0, 0], [2, 3])
    assert over_socket[1] == (
        True,
        {**none, "commit": [0], "extend": [0, 0], "allocate": []},
        [0, 2],  # b: 40 -> 70 tokens, 3 -> 5 blocks
    )
    assert over_socket[3][1:] == (["unknown_request"], [16], ["unknown_request"])
    # The default model has the null page (slot 0). c hits a's first block and takes the
    # queue's head (b's blocks went to its tail).
    assert over_socket[5] == [[1, 2]] and over_socket[6] == [[1, 8]]


def test_columnar_bad_input_is_refused_whole_over_the_socket(served: tuple[str, Path]) -> None:
    from kvcm_client.errors import InvalidArgument

    url, path = served
    with KVCacheClient(url, step_socket=str(path)) as kv:
        h = kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 3}]).handles[0]
        for bad in (
            {"extend": [True]},
            {"extend": [h], "num_new_tokens": [1, 2]},
            {"commit": [h], "commit_tokens": []},
        ):
            with pytest.raises(InvalidArgument):
                kv.step_columns(**bad)
        frame = pack({"op": "step_columns", "args": {"extend": b"\x01\x02\x03"}})
        answer, _ = _raw(path, frame)
        assert answer["error"]["code"] == "invalid_argument"
        assert kv.request("a").num_tokens == 3


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads_cpu_seconds(leave_out: set[str]) -> float:
    """CPU seconds of this process's threads but ``leave_out`` (thread ids, as
    /proc/self/task names them): those threads that earlier tests of this worker left
    running are not the client's."""
    total = 0.0
    for task in Path("/proc/self/task").iterdir():
        if task.name in leave_out:
            continue
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def test_an_idle_channel_costs_no_cpu_on_either_side(sock_path: Path) -> None:
    """No busy waiting when idle: with a connection open (a call made, then nothing), the
    service and this client use under 1% of a core over 4 s. (CPU time comes in clock
    ticks of 10 ms, so a 4 s window at 1% allows four: a busy-waiting side would use
    hundreds.) The client's side is this test's thread and any thread the client starts:
    threads an earlier test of this pytest worker left behind are not counted."""
    main = str(threading.get_native_id())
    before = {t.name for t in Path("/proc/self/task").iterdir()} - {main}
    with (
        serve_process(*ARGS, "--step-socket", str(sock_path)) as (url, proc, _),
        KVCacheClient(url, step_socket=sock_path) as kv,
    ):
        kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 4}])
        time.sleep(1.0)  # the call's own tail (a loaded machine runs it late) is not idle
        server0, client0 = _cpu_seconds(proc.pid), _threads_cpu_seconds(before)
        time.sleep(4.0)
        server = _cpu_seconds(proc.pid) - server0
        client = _threads_cpu_seconds(before) - client0
        assert kv.request("a").num_tokens == 4  # still connected and served
    assert server < 0.04 and client < 0.04, (server, client)
