from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from kvcm import LayerSpec, ManagerConfig
from kvcm_client.models import (
    MAX_COUNT,
    MAX_REQUEST_ID,
    AllocateOp,
    CommitManyRequest,
    CommitOp,
    ConsumerRequest,
    Documented,
    ExtendManyRequest,
    ExtendOp,
    FreeOp,
    MultimodalInput,
    PageIndicesRequest,
    ProbeRequest,
    RequestIds,
    RequestRef,
    ResumeOp,
    RewindOp,
    SlotMappingRequest,
    StepRequest,
    SuspendOp,
)


def _error(exc: pytest.ExceptionInfo[ValidationError]) -> tuple[str, str]:
    err = exc.value.errors()[0]
    return err["type"], err["msg"]


def test_nvfp4_odd_head_dim_is_rejected_naming_layer_and_rule() -> None:
    with pytest.raises(ValidationError) as exc:
        LayerSpec(layer_id=3, num_kv_heads=16, head_dim=63, dtype="nvfp4")
    kind, msg = _error(exc)
    assert kind == "nvfp4_head_dim"
    assert "layer 3" in msg and "even head_dim" in msg and "63" in msg


def test_nvfp4_needs_heads_times_dim_divisible_by_16() -> None:
    with pytest.raises(ValidationError) as exc:
        LayerSpec(layer_id=1, num_kv_heads=1, head_dim=8, dtype="nvfp4")
    kind, msg = _error(exc)
    assert kind == "nvfp4_group" and "layer 1" in msg
    # 2 heads x 8 dims = 16 values is fine.
    assert LayerSpec(layer_id=1, num_kv_heads=2, head_dim=8, dtype="nvfp4").roles() == (
        "key",
        "value",
        "key_scale",
        "value_scale",
    )


def test_key_only_layer_has_no_value_role() -> None:
    spec = LayerSpec(layer_id=0, num_kv_heads=1, head_dim=576, kv_factor=1)
    assert spec.roles() == ("key",)
    assert LayerSpec(
        layer_id=0, num_kv_heads=1, head_dim=32, kv_factor=1, dtype="nvfp4"
    ).roles() == (
        "key",
        "key_scale",
    )


def test_sink_tokens_need_a_window() -> None:
    with pytest.raises(ValidationError) as exc:
        LayerSpec(layer_id=7, num_kv_heads=1, head_dim=8, sink_tokens=4)
    kind, msg = _error(exc)
    assert kind == "sink_without_window" and "layer 7" in msg
    assert LayerSpec(layer_id=7, num_kv_heads=1, head_dim=8, sink_tokens=4, sliding_window=64)


@pytest.mark.parametrize(
    "field,value",
    [
        ("sliding_window", 0),
        ("num_kv_heads", -1),
        ("head_dim", -1),
        ("dtype", "int8"),
        ("kv_factor", 3),
        ("sink_tokens", -1),
    ],
)
def test_out_of_range_fields_are_rejected(field: str, value: object) -> None:
    spec = {"layer_id": 0, "num_kv_heads": 1, "head_dim": 8, field: value}
    with pytest.raises(ValidationError) as exc:
        LayerSpec.model_validate(spec)
    assert exc.value.errors()[0]["loc"] == (field,)


def test_bytes_per_token_by_dtype() -> None:
    base = {"layer_id": 0, "num_kv_heads": 8, "head_dim": 128}
    assert LayerSpec(**base, dtype="fp32").bytes_per_token("key") == 4096
    assert LayerSpec(**base, dtype="bf16").bytes_per_token("value") == 2048
    assert LayerSpec(**base, dtype="fp8_e5m2").bytes_per_token("key") == 1024
    nv = LayerSpec(**base, dtype="nvfp4")
    assert nv.bytes_per_token("key") == 512
    assert nv.bytes_per_token("key_scale") == 64


def _cfg(**kw: object) -> dict[str, object]:
    cfg: dict[str, object] = {
        "layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}],
        "num_blocks": 4,
    }
    cfg.update(kw)
    return cfg


def test_layer_ids_must_be_unique() -> None:
    layers = [{"layer_id": 5, "num_kv_heads": 1, "head_dim": 8}] * 2
    with pytest.raises(ValidationError) as exc:
        ManagerConfig.model_validate(_cfg(layers=layers))
    kind, msg = _error(exc)
    assert kind == "duplicate_layer_id" and "layer 5" in msg


def test_at_least_one_layer() -> None:
    with pytest.raises(ValidationError) as exc:
        ManagerConfig.model_validate(_cfg(layers=[]))
    assert exc.value.errors()[0]["loc"] == ("layers",)


def test_exactly_one_of_num_blocks_and_memory_bytes() -> None:
    for kw in ({"num_blocks": None}, {"memory_bytes": 1 << 20}):
        with pytest.raises(ValidationError) as exc:
            ManagerConfig.model_validate(_cfg(**kw))
        assert _error(exc)[0] == "blocks_or_memory"
    assert ManagerConfig.model_validate(_cfg(num_blocks=None, memory_bytes=1 << 20))


@pytest.mark.parametrize("field", ["tokens_per_block", "max_requests", "max_seq_len", "num_blocks"])
def test_sizes_must_be_positive(field: str) -> None:
    with pytest.raises(ValidationError):
        ManagerConfig.model_validate(_cfg(**{field: 0}))


def test_max_blocks_per_request_rounds_up() -> None:
    cfg = ManagerConfig.model_validate(_cfg(tokens_per_block=16, max_seq_len=33))
    assert cfg.max_blocks_per_request == 3


# -- wire models: strict strings, documented ranges ---------------------------------------------


@pytest.mark.parametrize(
    ("model", "data", "where"),
    [
        (AllocateOp, {"request_id": b"a", "num_tokens": 1}, ("request_id",)),
        (ExtendOp, {"request_id": b"a", "num_new_tokens": 1}, ("request_id",)),
        (RewindOp, {"request_id": b"a", "num_tokens": 1}, ("request_id",)),
        (CommitOp, {"request_id": b"a", "token_ids": []}, ("request_id",)),
        (FreeOp, {"request_id": b"a"}, ("request_id",)),
        (SuspendOp, {"request_id": b"a"}, ("request_id",)),
        (ResumeOp, {"request_id": b"a"}, ("request_id",)),
        (RequestRef, {"request_id": b"a"}, ("request_id",)),
        (ExtendManyRequest, {"request_ids": ["a", b"b"]}, ("request_ids", 1)),
        (CommitManyRequest, {"request_ids": [b"a"], "token_ids": [[]]}, ("request_ids", 0)),
        (PageIndicesRequest, {"request_ids": [b"a"], "layer_id": 0}, ("request_ids", 0)),
        (PageIndicesRequest, {"request_ids": [], "layer_id": 0, "role": b"key"}, ("role",)),
        (SlotMappingRequest, {"request_ids": [b"a"]}, ("request_ids", 0)),
        (RequestIds, {"request_ids": [b"a"]}, ("request_ids", 0)),
        (MultimodalInput, {"digest": b"d", "start": 0, "length": 1}, ("digest",)),
        (ProbeRequest, {"token_ids": [], "block_keys": [b"ab" * 32]}, ("block_keys", 0)),
        (ConsumerRequest, {"pid": 1, "generation": b"g"}, ("generation",)),
    ],
)
def test_wire_strings_refuse_bytes(
    model: type[BaseModel], data: dict[str, Any], where: tuple[str | int, ...]
) -> None:
    """Lax pydantic would decode bytes (msgpack binary on the step channel): refused."""
    with pytest.raises(ValidationError) as exc:
        model.model_validate(data)
    err = exc.value.errors()[0]
    assert err["type"] == "string_type" and err["loc"] == where, err
    assert model.model_validate(_text(data))  # the same with str passes


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, dict):
        return {k: _text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_text(v) for v in value]
    return value


def test_documented_ranges_are_published_but_left_to_the_manager() -> None:
    """``Documented`` puts its keywords in the schema only: the models take a count out of
    range (the manager refuses it with the error every path shares), but never a bool or a
    float, which are type errors."""
    schema = AllocateOp.model_json_schema()["properties"]
    assert schema["num_tokens"]["minimum"] == 1
    assert schema["num_tokens"]["maximum"] == MAX_COUNT
    assert schema["request_id"] == {
        "maxLength": MAX_REQUEST_ID,
        "minLength": 1,
        "title": "Request Id",
        "type": "string",
    }
    op = AllocateOp(request_id="", num_tokens=0, lookahead=-1, token_ids=[-1, 2**40])
    assert (op.num_tokens, op.lookahead, op.request_id) == (0, -1, "")
    for bad in (True, 2.0):
        with pytest.raises(ValidationError):
            AllocateOp.model_validate({"request_id": "a", "num_tokens": bad})
    assert repr(Documented({"minimum": 1})) == "Documented({'minimum': 1})"


def test_a_step_op_needs_its_op_in_the_schema_as_in_validation() -> None:
    """An op's own route may leave ``op`` out (it has a default); a step picks the model by
    it, so the step's schema requires it, as validation does."""
    assert "op" not in AllocateOp.model_json_schema().get("required", [])
    items = StepRequest.model_json_schema()["properties"]["ops"]["items"]
    assert items["required"] == ["op"] and len(items["oneOf"]) == 7
    with pytest.raises(ValidationError, match="discriminator"):
        StepRequest.model_validate({"ops": [{"request_id": "a", "num_tokens": 1}]})
