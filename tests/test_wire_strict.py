"""A string of an op stays a string on every path: msgpack binary is refused, not decoded.

The step channel reads msgpack, which has a binary type besides str. Pydantic's lax mode turns
bytes into str, so ``{"request_id": b"a"}`` used to act on request "a" while the manager in
process refuses a non-str id. Every op of the step channel (``kvcm_client.step_channel.OPS``)
is sent here with a binary id (or other string) and must answer ``invalid_argument`` and
change nothing; the same frame with str in place of the binary must succeed on a fresh
service, so that each case would act if the binary were decoded. JSON strings over HTTP (the
strict str's other input) still work.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import layer, manager_state, same
from servers import serve_in_thread

from kvcm import KVCacheManager, block_keys
from kvcm.ops import OP_FIELDS
from kvcm.server.app import create_app
from kvcm.server.state import ServiceState
from kvcm.server.step_channel import StepChannel
from kvcm_client.errors import InvalidArgument, UnknownRequest
from kvcm_client.models import MAX_REQUEST_ID
from kvcm_client.step_channel import HEADER, OPS, pack

CONFIG = {
    "layers": [layer(0), layer(1, sliding_window=8)],
    "tokens_per_block": 4,
    "max_requests": 8,
    "max_seq_len": 64,
    "num_blocks": 64,
    "host_memory_bytes": 1 << 16,
}
PROMPT = list(range(100, 109))


def _service() -> tuple[StepChannel, KVCacheManager]:
    """A step channel over a manager with request "a" (9 tokens, 8 committed) and request
    "s" suspended on the host tier: what binary ids would name if they were decoded."""
    m = KVCacheManager(CONFIG)
    m.allocate("a", 9, token_ids=PROMPT)
    m.commit("a", PROMPT[:8])
    m.allocate("s", 5)
    m.suspend("s")
    state = ServiceState(m, 30.0)
    return StepChannel(state, None, lambda: 1 << 24), m


def _answer(channel: StepChannel, op: str, args: dict[str, Any]) -> dict[str, Any]:
    answer, close, _ = channel.handle(pack({"op": op, "args": args})[HEADER.size :])
    assert not close
    return answer


def _decoded(value: Any) -> Any:
    """``value`` with every bytes as the str pydantic's lax mode made of it."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, dict):
        return {k: _decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    return value


_KEYS_HEX = [k.hex().encode() for k in block_keys(PROMPT[:8], 4)]
#: One step op per kind, each naming a request by a binary id.
_STEP_OPS: list[dict[str, Any]] = [
    {"op": "allocate", "request_id": b"b", "num_tokens": 3},
    {"op": "extend", "request_id": b"a", "num_new_tokens": 1},
    {"op": "rewind", "request_id": b"a", "num_tokens": 1},
    {"op": "commit", "request_id": b"a", "token_ids": [7]},
    {"op": "free", "request_id": b"a"},
    {"op": "suspend", "request_id": b"a"},
    {"op": "resume", "request_id": b"s"},
]
#: Per step channel op, frames' args with a binary where a string goes.
CASES: dict[str, list[dict[str, Any]]] = {
    "allocate": [
        {"request_id": b"b", "num_tokens": 3},
        {"request_id": "b", "num_tokens": 9, "token_ids": PROMPT, "cache_salt": b"t"},
        {"request_id": "b", "num_tokens": 9, "token_ids": PROMPT, "lora_id": b"l"},
        {
            "request_id": "b",
            "num_tokens": 9,
            "token_ids": PROMPT,
            "multimodal": [{"digest": b"img", "start": 0, "length": 2}],
        },
        {"request_id": "b", "num_tokens": 9, "token_ids": PROMPT, "block_keys": _KEYS_HEX},
    ],
    "extend": [{"request_id": b"a", "num_new_tokens": 1}],
    "extend_many": [{"request_ids": [b"a"]}],
    "rewind": [{"request_id": b"a", "num_tokens": 1}],
    "commit": [{"request_id": b"a", "token_ids": [7]}],
    "free": [{"request_id": b"a"}],
    "suspend": [{"request_id": b"a"}],
    "resume": [{"request_id": b"s"}],
    "slot_mapping": [{"request_ids": [b"a"], "layer_id": 0}],
    "slot_mappings": [{"request_ids": [b"a"]}],
    "probe": [
        {"token_ids": PROMPT, "cache_salt": b"t"},
        {"token_ids": PROMPT, "lora_id": b"l"},
        {"token_ids": PROMPT, "multimodal": [{"digest": b"img", "start": 0, "length": 2}]},
        {"token_ids": PROMPT, "block_keys": _KEYS_HEX},
    ],
    "step": [{"ops": [op]} for op in _STEP_OPS]
    + [{"ops": [{"op": "extend", "request_id": "a", "num_new_tokens": 1}, _STEP_OPS[1]]}],
    "step_columns": [{"allocate": [{"request_id": b"c", "num_tokens": 3}]}],
}


def test_the_cases_cover_every_op_of_the_channel_and_of_a_step() -> None:
    channel, _ = _service()
    assert set(CASES) == set(OPS) == set(channel._handlers)
    assert {op["op"] for op in _STEP_OPS} == set(OP_FIELDS)


def _cases() -> Iterator[tuple[str, dict[str, Any]]]:
    for op, cases in CASES.items():
        for args in cases:
            yield op, args


@pytest.mark.parametrize(("op", "args"), list(_cases()), ids=lambda v: str(v)[:60])
def test_a_binary_string_is_refused_and_changes_nothing(op: str, args: dict[str, Any]) -> None:
    channel, m = _service()
    manager_state(m)  # drains the edits and op counts the setup left pending
    before = (manager_state(m), m.request_ids(), m.request("a"), m.last_event_seq)
    answer = _answer(channel, op, args)
    if op == "step_columns":  # a malformed item fails alone: its status
        errors = answer["result"]["errors"]
        assert [e["code"] for e in errors] == ["invalid_argument"], answer
        assert "request_id" in errors[0]["message"]
    else:
        assert answer["error"]["code"] == "invalid_argument", answer
        assert answer["status"] == 422
    after = (manager_state(m), m.request_ids(), m.request("a"), m.last_event_seq)
    assert same(list(before), list(after))

    # The same frame with text acts: the refusal above is about the type alone.
    channel, m = _service()
    text = _answer(channel, op, _decoded(args))
    assert "error" not in text, text
    if op == "step_columns":
        assert not text["result"].get("errors"), text
    if op == "step":
        assert all(r["ok"] for r in text["result"]), text


def test_in_process_steps_refuse_a_binary_id_as_allocate_does() -> None:
    """The models are the in-process ``step``'s validation too: a binary id used to be
    decoded there (extending "a"), while ``allocate`` refused it."""
    _, m = _service()
    with pytest.raises(InvalidArgument):
        m.allocate(b"b", 3)  # type: ignore[arg-type]
    for op in _STEP_OPS:
        manager_state(m)
        before = manager_state(m)
        with pytest.raises(InvalidArgument, match="request_id"):
            m.step([op])
        assert same(before, manager_state(m)), op
    length = m.request("a").num_tokens
    assert m.step([_decoded(_STEP_OPS[1])])[0].ok
    assert m.request("a").num_tokens == length + 1


def test_in_process_methods_refuse_a_binary_id_as_allocate_does() -> None:
    """The manager's per-request methods name a non-str id ``invalid_argument`` as
    ``allocate`` and the wire models do (they answered ``unknown_request``), and change
    nothing; a str id no request has stays ``unknown_request``."""
    _, m = _service()
    calls = {
        "extend": lambda rid: m.extend(rid, 1),
        "rewind": lambda rid: m.rewind(rid, 1),
        "commit": lambda rid: m.commit(rid, [1]),
        "free": lambda rid: m.free(rid),
        "suspend": lambda rid: m.suspend(rid),
        "resume": lambda rid: m.resume(rid),
        "request": lambda rid: m.request(rid),
        "block_table": lambda rid: m.block_table(rid),
        "committed_tokens": lambda rid: m.committed_tokens(rid),
        "extend_many": lambda rid: m.extend_many([rid]),
        "slot_mapping": lambda rid: m.slot_mapping([rid], layer_id=0),
    }
    for name, call in calls.items():
        for bad in (b"a", b"s", 7):
            before = manager_state(m)
            with pytest.raises(InvalidArgument, match="a request id is a string"):
                call(bad)
            assert same(before, manager_state(m)), (name, bad)
        with pytest.raises(UnknownRequest):
            call("nobody")


def test_json_strings_still_work_over_http() -> None:
    """Strict str takes JSON strings: ids up to ``MAX_REQUEST_ID`` characters, salts,
    digests, hex block keys, and a consumer's generation."""
    long_id = "x" * MAX_REQUEST_ID
    app = create_app(KVCacheManager(CONFIG | {"share": True}))
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as http:
        prompt = {
            "token_ids": PROMPT,
            "cache_salt": "t",
            "lora_id": "l",
            "multimodal": [{"digest": "img", "start": 0, "length": 2}],
        }
        body = {"request_id": long_id, "num_tokens": 9, **prompt}
        assert http.post("/v1/allocate", json=body).json()["request_id"] == long_id
        keyed = {"request_id": "k", "num_tokens": 9, "token_ids": PROMPT}
        keyed["block_keys"] = [k.decode() for k in _KEYS_HEX]
        assert http.post("/v1/allocate", json=keyed).status_code == 200
        steps = [
            ("/v1/extend", {"request_id": long_id, "num_new_tokens": 1}),
            ("/v1/extend_many", {"request_ids": [long_id, "k"]}),
            ("/v1/rewind", {"request_id": long_id, "num_tokens": 1}),
            ("/v1/commit", {"request_id": long_id, "token_ids": PROMPT}),
            ("/v1/commit_many", {"request_ids": ["k"], "token_ids": [PROMPT]}),
            ("/v1/slot_mappings", {"request_ids": [long_id]}),
            ("/v1/page_indices", {"request_ids": [long_id], "layer_id": 0, "role": "value"}),
            ("/v1/probe", prompt),
            ("/v1/step", {"ops": [{"op": "extend", "request_id": long_id, "num_new_tokens": 1}]}),
        ]
        for path, body in steps:
            resp = http.post(path, json=body)
            assert resp.status_code < 300, (path, resp.text)
        assert http.get("/v1/request", params={"request_id": long_id}).status_code == 200
        generation = http.get("/v1/pools").json()["generation"]
        consumer = {"pid": 1, "generation": generation}
        assert http.post("/v1/consumers", json=consumer).status_code == 200
        assert http.post("/v1/free", json={"request_id": long_id}).status_code == 204
