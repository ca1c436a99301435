"""One scenario suite, three targets: the in-process manager, and a real uvicorn server on
loopback through ``KVCacheClient`` and through ``AsyncKVCacheClient``. Every call's outcome
(result, or error type and code) must be the same on all three.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from helpers import layer
from servers import SyncOverAsync, serve_in_thread

from kvcm import KVCacheManager
from kvcm.server.app import create_app
from kvcm_client import AsyncKVCacheClient, KVCacheClient
from kvcm_client.errors import KVCMError

Scenario = Callable[[Any], list[Any]]

HYBRID = {
    "layers": [
        layer(0, sliding_window=8, sink_tokens=2),
        layer(1),
        layer(2, kv_factor=1, head_dim=8),
        layer(3, sliding_window=8, sink_tokens=2),
    ],
    "tokens_per_block": 4,
    "max_requests": 6,
    "max_seq_len": 48,
    "num_blocks": 30,
}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # RaggedPages
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump())
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        # Addresses differ between two managers' allocations; everything else must agree.
        return {k: _plain(v) for k, v in value.items() if k != "base_address"}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_plain(v) for v in value]  # lists, and step's OpResults
    return value


class Recorder:
    """Runs calls on a target and records what came back."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.log: list[Any] = []

    def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            out = getattr(self.target, method)(*args, **kwargs)
        except KVCMError as exc:
            entry: tuple[Any, ...] = (method, "error", type(exc).__name__, exc.code)
            # Wire validation refuses malformed types before the manager sees them, so the
            # detail of those invalid_argument errors lists pydantic's errors instead.
            if exc.code != "invalid_argument":
                entry += (_plain(exc.detail),)
            self.log.append(entry)
            return None
        plain = _plain(out)
        if method == "events":  # each target is its own manager: its own generation
            plain = {k: v for k, v in plain.items() if k != "generation"}
        self.log.append((method, "ok", plain))
        return out


def lifecycle(kv: Recorder) -> None:
    kv("allocate", "a", 10, lookahead=2)
    kv("allocate", "a", 10, lookahead=2)  # identical retry: the first result again
    kv("allocate", "a", 11)  # other arguments: duplicate_request
    kv("extend", "a", 3)
    kv("commit", "a", [5, 6, 7])
    kv("commit", "a", list(range(20)))  # past the length
    kv("commit_many", ["a"], [[8]])
    kv("commit_many", ["a", "nope"], [[9], [1]])  # an unknown id: nothing is committed
    kv("commit_many", ["a", "a"], [[9], [1]])
    kv("commit_many", ["a"], [[9], [1]])
    kv("committed_tokens", "a")
    kv("block_table", "a")
    kv("request", "a")
    kv("rewind", "a", 11)  # keeps 2 tokens: the window never released anything
    kv("committed_tokens", "a")
    kv("allocate", "b", 48, lookahead=1)  # too long
    for bad in (0, -1, 2.5, True):
        kv("allocate", "c", bad)
    kv("allocate", "", 3)
    kv("allocate", "c", 3, lookahead=-1)
    kv("extend", "nope", 1)
    kv("rewind", "a", 0)
    kv("free", "nope")
    kv("request_ids")
    kv("stats")
    kv("num_free_blocks")
    kv("num_free_blocks", 0)
    kv("num_total_blocks")
    kv("num_free_blocks", 7)
    kv("free", "a")
    kv("request", "a")
    kv("num_free_blocks")


def steps(kv: Recorder) -> None:
    kv("step", [{"op": "allocate", "request_id": f"r{i}", "num_tokens": 4 + i} for i in range(4)])
    decode = [{"op": "extend", "request_id": f"r{i}", "num_new_tokens": 1} for i in range(4)]
    for i in range(6):
        kv("step", decode, brief=i % 2 == 1)  # the batched decode path
    kv("extend_many", ["r0", "r1"], [2, 3], lookahead=[0, 1])
    kv("extend_many", ["r0", "r0"])
    kv("step", [{"op": "extend", "request_id": "r0", "num_new_tokens": 30}, *decode])
    atomic_fail = [
        {"op": "free", "request_id": "r3"},
        {"op": "commit", "request_id": "r0", "token_ids": [1, 2]},
        {"op": "allocate", "request_id": "big", "num_tokens": 40},
    ]
    kv("step", atomic_fail, atomic=True)
    kv("block_table", "r3")
    kv("step", atomic_fail[:2], atomic=True)
    kv("step", [decode[0], {"op": "extend", "request_id": "r9", "num_new_tokens": 1}], brief=True)
    kv("step", decode, brief="yes")
    kv("step", [{"op": "explode", "request_id": "r0"}])
    kv(
        "step",
        [{"op": "rewind", "request_id": "r1", "num_tokens": 1}, {"op": "free", "request_id": "r2"}],
    )
    kv("stats")
    for rid in ("r0", "r1"):
        kv("block_table", rid)


def tables(kv: Recorder) -> None:
    kv("allocate", "x", 13)
    kv("allocate", "y", 5, lookahead=3)
    kv("extend", "x", 2)
    for layer_id in (0, 1, 2, 3):
        kv("page_indices", ["x", "y"], layer_id)
        kv("page_indices", ["y", "x"], layer_id, mode="kernel")
        kv("page_indices", ["x"], layer_id, mode="kernel", per_layer=True)
        kv("ragged_page_indices", ["y", "x", "y"], layer_id)
        kv("ragged_page_indices", ["x"], layer_id, "value", per_layer=True)
        kv("slot_mapping", ["x", "y"], layer_id)
        kv("slot_mapping", ["x", "y"], layer_id, num_tokens=[3, 1], pad_to=6)
    kv("page_indices", ["x"], 2, role="value")  # key-only layer
    kv("page_indices", ["x"], 9)
    kv("page_indices", ["x"], 0, mode="weird")
    kv("ragged_page_indices", ["x"], 2, role="value")  # key-only layer
    kv("ragged_page_indices", ["x", "nope"], 9)
    kv("ragged_page_indices", ["x", "nope"], 0)
    kv("slot_mapping", ["x"], 0, pad_to=1)
    kv("slot_mappings", ["x", "y"], pad_to=4)
    kv("describe")
    for seq_len in (1, 8, 48):
        kv("estimate", seq_len)
        kv("estimate", seq_len, num_requests=3)
    kv("estimate", 49)
    kv("estimate", 10, num_requests=-1)


def random_ops(kv: Recorder) -> None:
    rng = np.random.default_rng(7)
    live: list[str] = []
    for i in range(150):
        kind = int(rng.integers(0, 6))
        if kind == 0 or not live:
            kv("allocate", f"q{i}", int(rng.integers(1, 30)), lookahead=int(rng.integers(0, 3)))
        elif kind == 1:
            ids = sorted({live[int(j)] for j in rng.integers(0, len(live), 3)})
            kv("step", [{"op": "extend", "request_id": r, "num_new_tokens": 1} for r in ids])
        elif kind == 2:
            kv("extend", live[int(rng.integers(len(live)))], int(rng.integers(1, 8)))
        elif kind == 3:
            kv("rewind", live[int(rng.integers(len(live)))], int(rng.integers(1, 4)))
        elif kind == 4:
            kv("free", live[int(rng.integers(len(live)))])
        else:
            rid = live[int(rng.integers(len(live)))]
            kv("block_table", rid)
        live = sorted(kv.target.request_ids())
    kv("stats")


def prefix(kv: Recorder) -> None:
    prompt = list(range(200, 240))  # 10 blocks of 4 tokens
    kv("allocate", "p", 40, token_ids=prompt)
    kv("commit", "p", prompt)
    kv("events")
    kv("probe", [*prompt, 1])
    kv("probe", prompt[:9])
    kv("probe", [*prompt, 1], cache_salt="other")
    kv("allocate", "q", 44, token_ids=[*prompt, 1, 2, 3, 4], lookahead=2)
    kv("allocate", "q", 44, token_ids=[*prompt, 1, 2, 3, 4], lookahead=2)  # idempotent
    kv("block_table", "q")
    kv("rewind", "q", 20)  # into shared blocks
    kv("free", "p")
    kv("rewind", "q", 20)  # now only q holds them
    kv("allocate", "s", 9, token_ids=prompt[:9], cache_salt="t", lora_id=3)
    kv("commit", "s", prompt[:9])
    kv(
        "allocate",
        "m",
        12,
        token_ids=prompt[:12],
        multimodal=[{"digest": "img", "start": 2, "length": 5}],
    )
    kv("allocate", "bad", 3, token_ids=[1, 2])
    kv("allocate", "bad", 3, token_ids=[1, 2, -5])
    kv("reset_prefix_cache")
    for rid in ("q", "s", "m"):
        kv("free", rid)
    kv("reset_prefix_cache")
    kv("probe", [*prompt, 1])
    kv("events", after=2)
    kv("events", after=0, limit=2)
    kv("stats")


SCENARIOS: dict[str, Callable[[Recorder], None]] = {
    "prefix": prefix,
    "lifecycle": lifecycle,
    "steps": steps,
    "tables": tables,
    "random_ops": random_ops,
}


@pytest.fixture
def targets() -> Iterator[dict[str, Callable[[], Any]]]:
    """Factories of fresh targets, each with its own manager of the same config."""
    cleanups: list[Callable[[], None]] = []
    servers: list[Any] = []

    def served(kind: str) -> Any:
        ctx = serve_in_thread(create_app(KVCacheManager(HYBRID)))
        url = ctx.__enter__()
        servers.append(ctx)
        if kind == "sync":
            client: Any = KVCacheClient(url)
            cleanups.append(client.close)
            return client
        wrapped = SyncOverAsync(AsyncKVCacheClient(url))
        cleanups.append(wrapped.close)
        return wrapped

    yield {
        "manager": lambda: KVCacheManager(HYBRID),
        "sync": lambda: served("sync"),
        "async": lambda: served("async"),
    }
    for fn in cleanups:
        fn()
    for ctx in servers:
        ctx.__exit__(None, None, None)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_gives_identical_results_everywhere(
    name: str, targets: dict[str, Callable[[], Any]]
) -> None:
    logs = {}
    for kind, make in targets.items():
        rec = Recorder(make())
        SCENARIOS[name](rec)
        logs[kind] = rec.log
    assert len(logs["manager"]) > 10
    assert any(entry[1] == "error" for entry in logs["manager"]) or name == "random_ops"
    for kind in ("sync", "async"):
        for i, (want, got) in enumerate(zip(logs["manager"], logs[kind], strict=True)):
            assert got == want, f"{kind} differs from the manager at call {i}"


MIRRORED = [
    "allocate",
    "decode_step",
    "extend",
    "extend_many",
    "rewind",
    "commit",
    "commit_many",
    "free",
    "step",
    "request",
    "request_ids",
    "block_table",
    "committed_tokens",
    "page_indices",
    "ragged_page_indices",
    "slot_mapping",
    "slot_mappings",
    "describe",
    "estimate",
    "stats",
    "num_free_blocks",
    "num_total_blocks",
    "probe",
    "reset_prefix_cache",
]


@pytest.mark.parametrize("client", [KVCacheClient, AsyncKVCacheClient])
def test_clients_have_the_managers_method_names_and_parameters(client: type) -> None:
    for name in MIRRORED:
        want = inspect.signature(getattr(KVCacheManager, name)).parameters
        got = inspect.signature(getattr(client, name)).parameters
        assert [(p.name, p.default) for p in got.values()] == [
            (p.name, p.default) for p in want.values()
        ], name
        assert inspect.iscoroutinefunction(getattr(client, name)) == (client is AsyncKVCacheClient)
    # events: the client adds the long-poll wait after the manager's parameters.
    want = list(inspect.signature(KVCacheManager.events).parameters)
    assert list(inspect.signature(client.events).parameters) == [*want, "timeout_s"]
