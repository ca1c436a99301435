"""Stream-ordered steps where they cannot run: refusals that change nothing, on the CPU.

``step_columns(stream_ordered=True)`` and consumers' done events need page tables in shared
CUDA memory on one rank (docs/shared-memory.md#stream-ordered-steps); tests/gpu/
test_stream_order_gpu.py runs them. Here: the in-process manager, the typed client over HTTP
and over the step channel, and ``attach(stream_order=True)`` refuse with
``stream_order_unavailable`` (409, ``detail.reason``), and nothing changes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import layer, manager, manager_state, same
from servers import serve_process

from kvcm import KVCacheManager
from kvcm.columnar_parse import columns_from_wire
from kvcm_client import KVCacheClient
from kvcm_client.columns import wire_columns
from kvcm_client.errors import (
    STATUS_CODES,
    InvalidArgument,
    StreamOrderUnavailable,
    error_from_dict,
)
from kvcm_client.shared import Attachment


def _started(**kw: object) -> tuple[KVCacheManager, int]:
    """A CPU manager with one 5-token request; its handle."""
    m = manager([layer(0), layer(1, sliding_window=8)], **kw)
    out = m.step_columns(allocate=[{"request_id": "a", "num_tokens": 5}])
    return m, int(out.handles[0])


@pytest.mark.parametrize("share", [False, True])
def test_cpu_manager_refuses_and_changes_nothing(share: bool) -> None:
    m, h = _started(share=share)
    before = manager_state(m)
    with pytest.raises(StreamOrderUnavailable) as info:
        m.step_columns(extend=[h], map_slots=True, stream_ordered=True)
    assert info.value.code == "stream_order_unavailable" and info.value.status == 409
    assert info.value.detail["reason"] == "device"
    assert same(manager_state(m), before)
    assert m.request("a").num_tokens == 5
    # The same step without it runs: the refusal was the mode's alone.
    out = m.step_columns(extend=[h], map_slots=True)
    assert out.ok and m.request("a").num_tokens == 6


def test_cpu_manager_has_no_step_event() -> None:
    m, _ = _started(share=True)
    assert m.pools().step_event is None
    with pytest.raises(StreamOrderUnavailable) as info:
        m.watch_consumer("c", "A" * 88)
    assert info.value.detail["reason"] == "device"
    m.forget_consumer("c")  # no done event to forget: nothing happens
    m.close()


@pytest.mark.parametrize("value", [1, "yes", None, np.bool_(True)])
def test_stream_ordered_must_be_a_bool(value: object) -> None:
    m, h = _started()
    before = manager_state(m)
    with pytest.raises(InvalidArgument, match="stream_ordered must be a bool"):
        m.step_columns(extend=[h], stream_ordered=value)  # type: ignore[arg-type]
    assert same(manager_state(m), before)


def test_the_wire_carries_stream_ordered() -> None:
    assert wire_columns(extend=[1], stream_ordered=True)["stream_ordered"] is True
    assert "stream_ordered" not in wire_columns(extend=[1])
    # A non-bool goes on the wire as given, for the service to refuse (not dropped as off).
    assert wire_columns(extend=[1], stream_ordered=0)["stream_ordered"] == 0
    m, h = _started()
    args = columns_from_wire(wire_columns(extend=[h], stream_ordered=0))
    with pytest.raises(InvalidArgument, match="stream_ordered must be a bool"):
        m.step_columns(**args)
    assert m.request("a").num_tokens == 5
    assert columns_from_wire({"stream_ordered": True})["stream_ordered"] is True


def test_the_code_has_a_status_number() -> None:
    """Append only: the columnar statuses number codes by their place."""
    assert STATUS_CODES[-1] == "stream_order_unavailable"
    body = {"code": "stream_order_unavailable", "message": "m", "detail": {"reason": "device"}}
    assert isinstance(error_from_dict(body, 409), StreamOrderUnavailable)


@pytest.mark.slow
def test_typed_client_refuses_over_http_and_the_channel(tmp_path: Path) -> None:
    """A CPU sidecar: the step channel and HTTP answer ``stream_order_unavailable`` and run
    nothing; ``attach(stream_order=True)`` refuses before registering a consumer, and an
    attachment without it has no step events."""
    sock = tmp_path / "step.sock"
    args = ("--default-model", "--num-blocks", "64", "--step-socket", str(sock))
    with serve_process(*args) as (url, _, _):
        for step_socket in (sock, None):
            with KVCacheClient(url, step_socket=step_socket) as kv:
                h = kv.step_columns(allocate=[{"request_id": "r", "num_tokens": 3}]).handles[0]
                with pytest.raises(StreamOrderUnavailable) as info:
                    kv.step_columns(extend=[h], map_slots=True, stream_ordered=True)
                assert info.value.detail["reason"] == "device"
                assert kv.request("r").num_tokens == 3  # the extend never ran
                kv.free("r")
        with KVCacheClient(url) as kv:
            with pytest.raises(StreamOrderUnavailable) as info:
                kv.attach(stream_order=True)
            assert info.value.detail["reason"] == "no_step_event"
            assert kv.consumers() == []
            with pytest.raises(InvalidArgument, match="stream_order must be a bool"):
                kv.attach(stream_order=1)  # type: ignore[arg-type]
            with kv.attach() as att:
                with pytest.raises(StreamOrderUnavailable) as info:
                    att.wait_step()
                assert info.value.detail["reason"] == "not_attached"
                with pytest.raises(StreamOrderUnavailable):
                    att.step_done()


class _Events:
    """Stands in for ``StepEvents`` (CUDA only): records how it was closed."""

    def __init__(self) -> None:
        self.closed_with: list[bool] = []

    def close(self, keep_done: bool = False) -> None:
        self.closed_with.append(keep_done)


@pytest.mark.slow
def test_an_attachment_keeps_a_done_event_the_service_may_still_wait_on() -> None:
    """Closed without unregistering (the async client's attachment closed before its
    ``detach``), the done event is kept: the service still waits on it, and destroying an
    exported event that another process imported is undefined. Unregistered first (the sync
    client's close, the async ``detach``), it is destroyed."""
    with serve_process("--default-model", "--num-blocks", "64") as (url, _, _):
        with KVCacheClient(url) as kv:
            layout = kv.pools()
        bare, told, detached = _Events(), _Events(), _Events()
        Attachment(layout, events=bare).close()  # type: ignore[arg-type]
        unregistered: list[bool] = []

        def told_service() -> None:
            unregistered.append(True)

        Attachment(layout, on_close=told_service, events=told).close()  # type: ignore[arg-type]
        Attachment(layout, events=detached).close(unregistered=True)  # type: ignore[arg-type]
    assert bare.closed_with == [True]
    assert told.closed_with == [False] and unregistered == [True]
    assert detached.closed_with == [False]
