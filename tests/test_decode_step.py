"""``KVCacheManager.decode_step``, a decode step's own path, against ``step_columns`` of the
same extends: equal outcomes (statuses and their sections' order, block counts, errors, slot
mappings, table edits) and equal manager state after every step, over random steps of the
shapes engines send, with the batches it must hand to the general path among them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from helpers import FakeTransport, engine_handles, layer, manager, manager_state, same

from kvcm import InvalidArgument, KVCacheManager, native, transfers
from kvcm import manager as manager_module
from kvcm.columnar_types import StepOutcome
from kvcm.server import step_channel
from kvcm.server.state import ServiceState
from kvcm.server.step_channel import StepChannel, _Connection
from kvcm.server.step_ring import ServiceRing
from kvcm_client.step_channel import HEADER, pack, unpack
from kvcm_client.step_ring import SLOT_BYTES, ClientRing
from kvcm_client.step_ring import supported as ring_supported

pytestmark = [
    pytest.mark.usefixtures("restore_native"),
    pytest.mark.skipif(not native.available(), reason="kvcm._native is not built"),
]

#: Layer groups alone and sharing a pool, windows with sinks, the null page, one token per
#: block, a host tier (evicted cached blocks offloaded).
_CONFIGS = [
    ([layer(0)], {}),
    ([layer(0), layer(1, owner="draft")], {"null_page": True}),
    ([layer(0, sliding_window=6, sink_tokens=2), layer(1, kv_factor=1)], {"null_page": True}),
    ([layer(0), layer(1, sliding_window=3)], {"tokens_per_block": 1, "num_blocks": 320}),
    (
        [layer(0, sliding_window=6, sink_tokens=2), layer(1)],
        {"tokens_per_block": 2, "num_blocks": 48, "host_memory_bytes": 1 << 14},
    ),
]


def _outcome(out: StepOutcome) -> list[Any]:
    """Everything a step answers, in a form ``same`` compares."""
    mapping = None if out.slot_mapping is None else out.slot_mapping.cpu().numpy()
    return [
        list(out.status),
        out.status,
        out.new_blocks.dtype.str,
        out.new_blocks,
        out.handles,
        out.hit_tokens,
        out.allocate_new_blocks,
        [(e.section, e.index, e.error.code) for e in out.errors],
        out.failed,
        mapping,
        out.table_edits,
        out.pulls,
        out.to_wire(),
    ]


def _extends(rng: np.random.Generator, live: list[int], stale: list[int]) -> dict[str, Any]:
    """The extends of a step: most of them a decode step's batch, some of them what only the
    general path runs (a stale, repeated or unknown handle, counts per item, a list)."""
    handles = engine_handles(rng, live, stale)
    args: dict[str, Any] = {"extend": np.array(handles, dtype=np.int64)}
    r = rng.random()
    if r < 0.05:
        args["extend"] = handles  # a list: the general path
    elif r < 0.1:
        args["num_new_tokens"] = rng.integers(1, 4, len(handles))  # per item: the general path
    elif r < 0.2:  # a chunk of a chunked prefill, or an accepted draft's tokens
        args["num_new_tokens"] = int(rng.integers(2, 9))
    if rng.random() < 0.3:  # speculative decoding's lookahead
        args["lookahead"] = int(rng.integers(0, 4))
    args["map_slots"] = bool(rng.random() < 0.5)
    args["table_edits"] = bool(rng.random() < 0.3)
    return args


@pytest.mark.parametrize("seed", [1234, 7])
@pytest.mark.parametrize("layers, kw", _CONFIGS)
def test_decode_step_equals_step_columns(
    layers: list[dict[str, Any]],
    kw: dict[str, Any],
    seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """300 random steps on two managers: the same frees, commits, rewinds, preemptions and
    allocates (prompts that hit and evict cached blocks) through ``step_columns``, then the
    step's extends through ``decode_step`` on one and ``step_columns`` on the other."""
    rng = np.random.default_rng(seed)
    ran = {"own": 0, "general": 0}
    decode = manager_module.decode

    def counted(*args: Any) -> Any:
        out = decode(*args)
        ran["own" if out is not None else "general"] += 1
        return out

    monkeypatch.setattr(manager_module, "decode", counted)
    cfg = {"num_blocks": 64, "max_requests": 12, "max_seq_len": 96, **kw}
    own, general = manager(layers, **cfg), manager(layers, **cfg)
    prompts = [rng.integers(0, 9, 24).tolist() for _ in range(3)]
    live: list[int] = []
    stale: list[int] = []
    suspended: list[int] = []
    for step in range(300):
        cols: dict[str, Any] = {}
        if live and rng.random() < 0.25:
            gone = live.pop(int(rng.integers(len(live))))
            cols["free"] = [gone]
            stale.append(gone)
        commit = [h for h in live if rng.random() < 0.2]
        if commit:
            cols["commit"] = commit
            cols["commit_tokens"] = [rng.integers(0, 9, 3).tolist() for _ in commit]
        if rng.random() < 0.35:
            prompt = prompts[int(rng.integers(3))][: int(rng.integers(1, 25))]
            cols["allocate"] = [
                {"request_id": f"q{step}", "num_tokens": len(prompt), "token_ids": prompt}
            ]
        if live and rng.random() < 0.15:  # a verified draft's rejected tokens
            cols["rewind"] = [live[int(rng.integers(len(live)))]]
            cols["rewind_tokens"] = int(rng.integers(1, 4))
        if "host_memory_bytes" in cfg:  # preemption, and back
            if live and rng.random() < 0.1:
                cols["suspend"] = [live[int(rng.integers(len(live)))]]
            if suspended and rng.random() < 0.3:
                cols["resume"] = [suspended[int(rng.integers(len(suspended)))]]
        before = [m.step_columns(**cols) for m in (own, general)]
        assert same(_outcome(before[0]), _outcome(before[1])), step
        out = before[0]
        if "suspend" in cols and out.status["suspend"][0] == 0:
            suspended.append(cols["suspend"][0])
        if "resume" in cols and out.status["resume"][0] == 0:
            suspended.remove(cols["resume"][0])
            live.append(cols["resume"][0])
        live = [h for h in live if own.parts.requests.handle[h & 0xFFFFFFFF] == h]
        live += [int(h) for h in out.handles if h]
        args = _extends(rng, live, stale)
        a = own.decode_step(**args)
        b = general.step_columns(**args)
        assert same(_outcome(a), _outcome(b)), step
        states = manager_state(own), manager_state(general)
        differ = [i for i, (x, y) in enumerate(zip(*states, strict=True)) if not same(x, y)]
        assert not differ, (step, differ)
        live = [h for h in live if own.parts.requests.handle[h & 0xFFFFFFFF] == h]
    # Many steps ran on the decode step's own path, the others (a stale, repeated or unknown
    # handle, a request at max_seq_len, a full pool) on the general one.
    assert ran["own"] > 60 and ran["general"] > 10, ran


def _running(n: int = 3) -> tuple[KVCacheManager, np.ndarray]:
    m = manager([layer(0)], num_blocks=40)
    return m, np.array([m.allocate(f"r{i}", 4 * i + 3).handle for i in range(n)])


def test_a_decode_step_runs_no_general_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of live, distinct handles that fits never reaches the general step; the
    outcome is the exact one: row 0 (3 tokens) stays in its block, row 1 (7) too, row 2
    (11) too; then by 2 tokens: rows 0, 1 and 2 each cross into a new block."""
    m, handles = _running()

    def general(*args: Any, **kw: Any) -> None:
        raise AssertionError("the general step ran")

    monkeypatch.setattr(m, "step_columns", general)
    free = m.parts.coord.pools[0].num_free
    out = m.decode_step(handles)
    assert out.status["extend"].tolist() == [0, 0, 0] and out.new_blocks.tolist() == [0, 0, 0]
    assert m.parts.coord.num_tokens[handles & 0xFFFFFFFF].tolist() == [4, 8, 12]
    out = m.decode_step(handles, 2, map_slots=True)
    assert out.new_blocks.tolist() == [1, 1, 1]
    assert m.parts.coord.pools[0].num_free == free - 3
    tables = m.parts.coord.tables[0]
    rows = handles & 0xFFFFFFFF
    # Each request's two new tokens: the first two slots of its new block (4 per block).
    starts = [tables[r, b] * 4 for r, b in zip(rows.tolist(), (1, 2, 3), strict=True)]
    assert out.slot_mapping.tolist() == [[s + t for s in starts for t in (0, 1)]]


@pytest.mark.parametrize(
    "kw, code",
    [
        ({"num_new_tokens": 0}, "invalid_argument"),
        ({"num_new_tokens": True}, "invalid_argument"),
        ({"lookahead": -1}, "invalid_argument"),
        ({"map_slots": 1}, "invalid_argument"),
        ({"table_edits": "yes"}, "invalid_argument"),
        ({"stream_ordered": True}, "stream_order_unavailable"),
    ],
)
def test_bad_arguments_fail_as_step_columns_fails_and_change_nothing(
    kw: dict[str, Any], code: str
) -> None:
    m, handles = _running()
    state = manager_state(m)
    with pytest.raises(Exception) as raised:
        m.decode_step(handles, **kw)
    with pytest.raises(type(raised.value)) as general:
        m.step_columns(extend=handles, **kw)
    assert raised.value.code == general.value.code == code
    assert str(raised.value) == str(general.value)
    assert all(same(x, y) for x, y in zip(manager_state(m), state, strict=True))


# -- the step channel's decode frames ------------------------------------------------------


def _channel() -> tuple[StepChannel, list[int]]:
    """A step channel over a manager with four running requests (their handles)."""
    m = manager([layer(0), layer(1, sliding_window=5)], num_blocks=48)
    state = ServiceState(m, 30.0)
    handles = [int(m.allocate(f"r{i}", 3 * i + 2).handle) for i in range(4)]
    return StepChannel(state, None, lambda: 1 << 24, poll_us=0), handles


def _ops_counted(state: ServiceState) -> list[str]:
    return [
        line
        for line in state.metrics.render().decode().splitlines()
        if line.startswith("kvcm_ops_total")
    ]


def test_decode_frames_answer_as_the_general_path_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames of decode steps (int64 bytes of handles, int counts, bool flags) take
    ``decode_step``; every other frame of extends takes the general path. Each answer, the
    state after it and the op counts equal a twin's that runs every frame the general way."""
    fast, handles = _channel()
    twin, _ = _channel()
    taken: list[int] = []
    decode_step = fast.state.decode_step

    def spied(*args: Any) -> Any:
        taken.append(len(args[0]))
        return decode_step(*args)

    monkeypatch.setattr(fast.state, "decode_step", spied)

    monkeypatch.setattr(twin.state, "decode_step", lambda *a: pytest.fail("the twin's"))
    h = np.array(handles, dtype="<i8").tobytes()
    # (args, whether decode_step takes it, the error code of a refused frame or None)
    frames: list[tuple[dict[str, Any], bool, str | None]] = [
        ({"extend": h}, True, None),
        ({"extend": h, "num_new_tokens": 3, "lookahead": 2, "map_slots": True}, True, None),
        ({"extend": h, "table_edits": True}, True, None),
        ({"extend": h[:16], "num_new_tokens": 5}, True, None),
        ({"extend": h + h[:8]}, True, None),  # a row named twice: decode_step's general path
        ({"extend": h, "num_new_tokens": np.array([1, 2, 1, 1], "<i8").tobytes()}, False, None),
        ({"extend": h[:16], "lookahead": 1.5}, False, "invalid_argument"),
        ({"extend": h, "map_slots": 1}, False, "invalid_argument"),  # the general path
        ({"extend": h, "map_slots": b"abc"}, False, "invalid_argument"),  # names map_slots
        ({"extend": h[:12]}, False, "invalid_argument"),  # not whole int64s
        ({"extend": h, "stream_ordered": True}, True, "stream_order_unavailable"),
        ({"extend": h, "free": h[:8]}, False, None),  # the free first: h[0] is unknown
    ]
    for args, decode, refused in frames:
        before = len(taken)
        frame = pack({"op": "step_columns", "args": args})[HEADER.size :]
        answers = [fast.handle(frame)[0]]
        with monkeypatch.context() as general:  # the twin: no frame is a decode step's
            general.setattr(step_channel, "_DECODE_ARGS", frozenset())
            answers.append(twin.handle(frame)[0])
        for answer in answers:
            del answer["generation"]  # each service's own
        assert answers[0] == answers[1], args
        if refused is not None:
            assert answers[0]["error"]["code"] == refused, args
        elif "free" not in args:
            assert answers[0]["result"]["status"]["extend"] == bytes(len(args["extend"]) // 4)
        assert (len(taken) > before) == decode, args
        states = manager_state(fast.state.manager), manager_state(twin.state.manager)
        assert all(same(x, y) for x, y in zip(*states, strict=True)), args
    assert answers[0]["result"]["status"]["extend"][:2] == b"\x04\x00"  # unknown_request
    assert taken == [4, 4, 4, 2, 5, 4]
    assert _ops_counted(fast.state) == _ops_counted(twin.state)
    assert any('op="extend",result="ok"' in line for line in _ops_counted(fast.state))


def test_a_frame_is_answered_before_it_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step channel sends a step's answer first and counts it after
    (``StepChannel.answer_first``): when the op counts, the call's latency and the frame's
    count are taken, the answer is in the transport already; once the frames are answered,
    every count is in, as a twin's that counts each frame before answering it."""
    channel, handles = _channel()
    twin, _ = _channel()
    conn, tr = _Connection(channel), FakeTransport()
    conn.connection_made(tr)  # type: ignore[arg-type]
    sent_before: dict[str, list[int]] = {}
    metrics = channel.state.metrics

    def spy(name: str) -> Any:
        call = getattr(metrics, name)

        def counted(*args: Any) -> Any:
            sent_before.setdefault(name, []).append(len(tr.out))
            return call(*args)

        return counted

    for name in ("ops_ok_later", "observe_later", "later"):
        monkeypatch.setattr(metrics, name, spy(name))
    h = np.array(handles, dtype="<i8").tobytes()
    frames = [pack({"op": "step_columns", "args": {"extend": h}}) for _ in range(3)]
    conn.data_received(b"".join(frames))  # three frames in one read: answered in order
    answers, at = [], 0
    while at < len(tr.out):
        (n,) = HEADER.unpack_from(tr.out, at)
        answers.append(bytes(tr.out[at : at + HEADER.size + n]))
        at += HEADER.size + n
    ends = np.cumsum([len(a) for a in answers]).tolist()
    # each count after its own answer, before the next one's
    assert sent_before == {"ops_ok_later": ends, "observe_later": ends, "later": ends}
    for frame in frames:
        twin.handle(frame[HEADER.size :])
    assert _ops_counted(channel.state) == _ops_counted(twin.state)
    assert channel.due == [] and len(answers) == 3


@pytest.mark.skipif(not ring_supported(), reason="the step ring runs on x86-64 Linux only")
def test_a_ring_frame_is_answered_before_it_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on the socket, through the shared-memory ring: its answer is published before
    the step's op counts are taken."""
    channel, handles = _channel()
    conn = _Connection(channel)
    conn.connection_made(FakeTransport())  # type: ignore[arg-type]
    served = ServiceRing(SLOT_BYTES)
    conn.attach(served)
    client = ClientRing(served.give_fd(), SLOT_BYTES)
    seen: list[bool] = []
    count = channel.state.metrics.ops_ok_later
    monkeypatch.setattr(
        channel.state.metrics,
        "ops_ok_later",
        lambda status: (seen.append(client.answered(client.seq)), count(status)),
    )
    h = np.array(handles, dtype="<i8").tobytes()
    try:
        for _ in range(2):
            client.post(pack({"op": "step_columns", "args": {"extend": h}}), HEADER.size)
            conn.serve_ring()
            answer = unpack(client.answer_body())
            assert answer["result"]["status"]["extend"] == bytes(8)
        assert seen == [True, True] and channel.due == []
    finally:
        client.close()
        served.close()


def test_table_edits_that_device_tables_consume_are_refused_before_the_step() -> None:
    """Where device tables consume the edit log (a CUDA device: simulated here), a decode
    step asking for table edits is refused before it runs, as ``step_columns`` refuses it:
    no request grew."""
    m, handles = _running()
    m.parts.coord.edits = []  # as a CUDA manager's: its device tables take the log
    for step in (m.decode_step, lambda h, **kw: m.step_columns(extend=h, **kw)):
        with pytest.raises(InvalidArgument, match="table_edits needs page tables"):
            step(handles, table_edits=True)
        assert m.parts.coord.num_tokens[handles & 0xFFFFFFFF].tolist() == [3, 7, 11]


def test_a_step_while_transfers_run_takes_the_general_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While pulls or fetches run (``Transfers.busy``), the step polls them first (a pull
    that ended runs in this step): ``decode_step`` leaves that to ``step_columns``."""
    m, handles = _running()
    polled: list[object] = []
    monkeypatch.setattr(m.parts, "transfers", SimpleNamespace(busy=True, ended=False))
    monkeypatch.setattr(transfers, "poll", polled.append)
    out = m.decode_step(handles)
    assert out.ok and polled == [m.parts]
    assert m.parts.coord.num_tokens[handles & 0xFFFFFFFF].tolist() == [4, 8, 12]
