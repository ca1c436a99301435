"""Extra buffers per layer (a sparse-attention indexer's keys beside an MLA latent) and layers
without KV heads: sizing, pools, views, indices, pointer tables, copies and sharing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import layer, manager
from pydantic import ValidationError
from servers import serve_process

from kvcm import InvalidArgument, LayerSpec, ManagerConfig, UnknownLayer
from kvcm.cli import report
from kvcm_client import KVCacheClient

INDEX_KEY = {"role": "index_key", "num_heads": 1, "head_dim": 128, "dtype": "fp8_e4m3"}


def _mla(i: int, **kw: object) -> dict[str, object]:
    """A DeepSeek-V3.2-like layer: a 576-dim bf16 latent (key only) and a 128-dim fp8 index key."""
    spec: dict[str, object] = {
        "layer_id": i,
        "num_kv_heads": 1,
        "head_dim": 576,
        "kv_factor": 1,
        "dtype": "bf16",
        "extra_buffers": [INDEX_KEY],
    }
    spec.update(kw)
    return spec


def _three_blocks(m) -> list[int]:  # type: ignore[no-untyped-def]
    m.allocate("x", 1)  # takes slot 0, so the request below starts at slot 1
    m.allocate("a", 9)
    m.free("x")
    return m.block_table("a")[0]


# -- specs ---------------------------------------------------------------------------------------


def test_extra_buffers_are_roles_with_their_own_shape_and_bytes() -> None:
    spec = LayerSpec.model_validate(_mla(0))
    assert spec.roles() == ("key", "index_key")
    # 576 x 2 bytes (bf16) for the latent, 128 x 1 byte (fp8) for the index key.
    assert (spec.bytes_per_token("key"), spec.bytes_per_token("index_key")) == (1152, 128)
    nv = LayerSpec.model_validate(
        layer(0, dtype="nvfp4", head_dim=16)
        | {"extra_buffers": [{"role": "idx", "num_heads": 1, "head_dim": 32, "dtype": "nvfp4"}]}
    )
    # Data roles first (key, value, extras), then the nvfp4 scales of each.
    assert nv.roles() == ("key", "value", "idx", "key_scale", "value_scale", "idx_scale")
    assert [nv.bytes_per_token(r) for r in nv.roles()] == [16, 16, 16, 2, 2, 2]
    idx = nv.buffer("idx")
    assert (idx.kind, idx.kv_factor) == ("data", 1)  # a key-only page, whatever the layer's
    assert nv.buffer("idx_scale").kind == "scale"
    with pytest.raises(KeyError):
        spec.bytes_per_token("value")


@pytest.mark.parametrize(
    "extras,code,words",
    [
        ([{"role": "value", "num_heads": 1, "head_dim": 8}], "extra_role_reserved", "standard"),
        ([{"role": "Index", "num_heads": 1, "head_dim": 8}], "extra_role_name", "lowercase"),
        ([{"role": "index-key", "num_heads": 1, "head_dim": 8}], "extra_role_name", "'index-key'"),
        ([{"role": "idx", "num_heads": 1, "head_dim": 8}] * 2, "duplicate_extra_role", "'idx'"),
        (
            [
                {"role": "idx", "num_heads": 1, "head_dim": 16, "dtype": "nvfp4"},
                {"role": "idx_scale", "num_heads": 1, "head_dim": 1, "dtype": "fp32"},
            ],
            "duplicate_extra_role",
            "'idx_scale'",
        ),
        (
            [{"role": "idx", "num_heads": 1, "head_dim": 7, "dtype": "nvfp4"}],
            "nvfp4_head_dim",
            "extra buffer 'idx'",
        ),
        (
            [{"role": "idx", "num_heads": 1, "head_dim": 8, "dtype": "nvfp4"}],
            "nvfp4_group",
            "extra buffer 'idx'",
        ),
    ],
)
def test_bad_extra_buffers_are_refused_naming_layer_and_rule(
    extras: list[dict[str, object]], code: str, words: str
) -> None:
    with pytest.raises(ValidationError) as exc:
        LayerSpec.model_validate(layer(4) | {"extra_buffers": extras})
    err = exc.value.errors()[0]
    assert err["type"] == code
    assert "layer 4" in err["msg"] and words in err["msg"], err["msg"]


def test_zero_kv_heads_is_allowed_but_not_with_extras_nor_for_every_layer() -> None:
    assert LayerSpec.model_validate(layer(1, num_kv_heads=0)).roles() == ()
    with pytest.raises(ValidationError) as exc:
        LayerSpec.model_validate(layer(1, num_kv_heads=0) | {"extra_buffers": [INDEX_KEY]})
    assert exc.value.errors()[0]["type"] == "extra_buffers_without_kv"
    with pytest.raises(ValidationError) as exc:
        ManagerConfig.model_validate(
            {"layers": [layer(0, num_kv_heads=0), layer(1, num_kv_heads=0)], "num_blocks": 4}
        )
    assert exc.value.errors()[0]["type"] == "no_kv_layers"


# -- layout, sizing, views -----------------------------------------------------------------------


def test_three_latent_layers_with_index_keys_get_two_pools_per_slot() -> None:
    m = manager([_mla(i) for i in range(3)])  # tokens_per_block 4, 16 slots
    info = m.describe()
    # Per token and layer: 1152 (latent) + 128 (index key) = 1280; 3 layers: 3840.
    assert m.estimate(64).bytes_per_token == {0: 3 * 1280}
    assert [(p.kind, p.kv_factor, p.num_buffers, p.bytes_per_buffer) for p in info.pools] == [
        ("data", 1, 3, 4 * 1152),  # K0 K1 K2: 4 tokens x 1152 bytes each
        ("data", 1, 3, 4 * 128),  # I0 I1 I2: 4 tokens x 128 bytes each
    ]
    assert info.pool_groups[0].slot_bytes == 3 * 4608 + 3 * 512 == 15360
    place = {(b.layer_id, b.role): (b.pool, b.offset_bytes) for b in info.buffers}
    assert place == {
        (0, "key"): (0, 0),
        (0, "index_key"): (1, 0),
        (1, "key"): (0, 4608),
        (1, "index_key"): (1, 512),
        (2, "key"): (0, 9216),
        (2, "index_key"): (1, 1024),
    }
    assert [b.role for b in info.buffers[:2]] == ["key", "index_key"]  # role index order
    key, idx = m.layer_view(1, "key"), m.layer_view(1, "index_key")
    assert (key.shape, key.stride(), key.dtype) == (
        (16, 4, 1, 576),
        (13824 // 2, 576, 576, 1),  # a slot is 13824 bytes of pool 0, in bf16 elements
        torch.bfloat16,
    )
    assert (idx.shape, idx.stride(), idx.dtype) == (
        (16, 4, 1, 128),
        (1536, 128, 128, 1),
        torch.float8_e4m3fn,
    )
    assert idx.data_ptr() == m.memory.base_address(1) + 512
    assert m.kv_view(1).shape == (16, 4, 1, 576)  # kv_view stays the key (and value)
    with pytest.raises(InvalidArgument) as exc:
        m.layer_view(1, "index_value")
    assert "index_key" in exc.value.message  # the message lists the layer's roles


def test_budget_and_estimate_count_extra_buffers() -> None:
    # One pool group of 15360-byte slots: 20 slots' worth of budget gives 20 slots.
    m = manager([_mla(i) for i in range(3)], memory_bytes=20 * 15360)
    est = m.estimate(64)
    assert [(p.num_slots, p.slot_bytes) for p in est.pool_groups] == [(20, 15360)]
    assert est.max_requests == 1  # 64 tokens = 16 blocks of 4, 20 slots
    assert m.estimate(40).max_requests == 2  # 10 blocks each


def test_extra_buffer_of_a_key_value_layer_pools_apart_from_its_kv() -> None:
    extra = {"role": "idx", "num_heads": 2, "head_dim": 4, "dtype": "fp16"}
    m = manager([layer(i) | {"extra_buffers": [extra]} for i in range(2)])
    info = m.describe()
    # K/V and idx have equal bytes per block (4 x 2 x 4 x 2 = 64) but kv_factor 2 vs 1.
    assert [(p.kv_factor, p.num_buffers, p.bytes_per_buffer) for p in info.pools] == [
        (2, 4, 64),
        (1, 2, 64),
    ]
    assert info.layer_groups[0].bytes_per_token == 2 * (16 + 16 + 16)


# -- indices and pointer tables ------------------------------------------------------------------


def test_kernel_mode_indices_of_an_extra_buffer_use_its_pool() -> None:
    m = manager([_mla(i) for i in range(3)])
    slots = _three_blocks(m)
    assert slots == [1, 2, 3]
    for lid in range(3):
        got = m.page_indices(["a"], lid, role="index_key", mode="kernel")[0].tolist()
        assert got[:3] == [3, 6, 9] and set(got[3:]) == {-1}  # 3 buffers per slot: 3 x slot
        per_layer = m.page_indices(["a"], lid, "index_key", mode="kernel", per_layer=True)
        assert per_layer[0, :3].tolist() == [3 * s + lid for s in slots]
        assert m.page_indices(["a"], lid, "index_key")[0, :3].tolist() == slots


def test_pointer_tables_index_extra_roles_after_the_standard_ones() -> None:
    m = manager([_mla(i) for i in range(3)])
    info = m.describe()
    assert info.roles == ("key", "value", "key_scale", "value_scale", "index_key")
    ptr, pool_map, layer_ptr = m.pointer_table(), m.layer_pool_map(), m.layer_pointer_table()
    base0, base1 = m.memory.base_address(0), m.memory.base_address(1)
    assert ptr.tolist() == [[base0, 0], [base1, 0]]  # key-only pools: no second column
    assert pool_map.shape == (3, 5, 2) and layer_ptr.shape == (3, 5)
    for lid in range(3):
        assert pool_map[lid].tolist() == [[0, lid], [-1, -1], [-1, -1], [-1, -1], [1, lid]]
        assert layer_ptr[lid].tolist() == [base0 + lid * 4608, 0, 0, 0, base1 + lid * 512]
    # Layer 2's index key in slot 3: (3 x 3 + 2) pages of 512 bytes past pool 1's base.
    assert m.layer_view(2, "index_key")[3].data_ptr() == base1 + (3 * 3 + 2) * 512
    assert base1 + 11 * 512 == base1 + 3 * 1536 + 2 * 512  # = slot 3 + layer 2's offset


def test_pointer_formula_holds_for_every_role_with_extras_and_nvfp4() -> None:
    nv_extra = {"role": "idx", "num_heads": 1, "head_dim": 16, "dtype": "nvfp4"}
    m = manager(
        [
            layer(0) | {"extra_buffers": [INDEX_KEY | {"dtype": "bf16"}]},
            layer(1, num_kv_heads=2, head_dim=16, dtype="nvfp4") | {"extra_buffers": [nv_extra]},
            _mla(2, head_dim=64),
        ]
    )
    info = m.describe()
    roles = info.roles
    assert roles == ("key", "value", "key_scale", "value_scale", "idx", "idx_scale", "index_key")
    ptr, pool_map, layer_ptr = m.pointer_table(), m.layer_pool_map(), m.layer_pointer_table()
    for lid, spec in m.layout.layers.items():
        for r, role in enumerate(roles):
            if role not in spec.roles():
                assert pool_map[lid, r].tolist() == [-1, -1] and int(layer_ptr[lid, r]) == 0
                continue
            pool_id, page_offset = pool_map[lid, r].tolist()
            pool = info.pools[pool_id]
            view = m.layer_view(lid, role)
            column = 1 if role in ("value", "value_scale") else 0
            assert int(layer_ptr[lid, r]) == view.data_ptr()
            for slot in (0, 5, 15):
                index = slot * pool.num_buffers // pool.kv_factor + page_offset
                address = int(ptr[pool_id, column]) + index * pool.kv_factor * pool.bytes_per_buffer
                assert address == view[slot].data_ptr(), (lid, role, slot)


# -- copies and sharing --------------------------------------------------------------------------


def test_copy_tokens_moves_extra_buffers() -> None:
    m = manager([_mla(i) for i in range(2)] + [layer(2)], num_blocks=32)
    torch.manual_seed(0)
    for t in m.memory.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    m.allocate("a", 10, lookahead=3)
    before = {lid: m.layer_view(lid, "index_key").view(torch.uint8).clone() for lid in (0, 1)}
    m.copy_tokens(["a", "a"], [11, 12], [9, 10])  # accepted drafts at 11, 12 move to 9, 10
    blocks = m.block_table("a")[0]
    for lid, old in before.items():
        new = m.layer_view(lid, "index_key").view(torch.uint8)
        expect = old.clone()
        for src, dst in ((11, 9), (12, 10)):
            expect[blocks[dst // 4], dst % 4] = old[blocks[src // 4], src % 4]
        assert torch.equal(new, expect), lid
        assert not torch.equal(new, old)


def test_a_consumer_process_maps_extra_roles_of_the_service(tmp_path: Path) -> None:
    config = {
        "layers": [_mla(0), layer(1, num_kv_heads=0), _mla(2)],
        "tokens_per_block": 4,
        "max_requests": 4,
        "max_seq_len": 64,
        "num_blocks": 16,
        "share": True,
    }
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config))
    with serve_process("--config", str(path)) as (url, _, _), KVCacheClient(url) as kv:
        info = kv.describe()  # the wire Layout carries the role order and the dropped layer
        assert info.roles[4:] == ("index_key",)
        assert [(d.layer_id, d.reason) for d in info.dropped_layers] == [(1, "no_kv_heads")]
        kv.allocate("x", 1)
        kv.allocate("a", 9)  # slots 1, 2, 3
        assert kv.page_indices(["a"], 2, role="index_key", mode="kernel")[0][:3] == [2, 4, 6]
        with pytest.raises(UnknownLayer):
            kv.page_indices(["a"], 1)
        with kv.attach() as first, kv.attach() as second:
            assert {b.role for b in first.layout.buffers} == {"key", "index_key"}
            assert {b.layer_id for b in first.layout.buffers} == {0, 2}
            view = first.layer_view(2, "index_key")
            # 2 index keys of 4 tokens x 128 fp8 per slot: 1024 bytes; layer 2 is the second.
            assert (view.shape, view.stride(), view.dtype) == (
                (16, 4, 1, 128),
                (1024, 128, 128, 1),
                torch.float8_e4m3fn,
            )
            assert view.storage_offset() == 512
            slots = torch.tensor(kv.slot_mapping(["a"], 2, num_tokens=[9]))
            keys = torch.randn(9, 1, 128).to(torch.float8_e4m3fn)
            view[slots // 4, slots % 4] = keys  # what an indexer kernel writes
            again = second.layer_view(2, "index_key")  # a second mapping of the service's pool
            assert torch.equal(
                again[slots // 4, slots % 4].view(torch.uint8), keys.view(torch.uint8)
            )
            assert bool((second.layer_view(0, "index_key")[1:4].float() == 0).all())


# -- layers without KV heads ---------------------------------------------------------------------


def test_a_layer_without_kv_heads_is_dropped_and_reported() -> None:
    m = manager([layer(0), layer(1, num_kv_heads=0), layer(2, kv_factor=1)])
    info = m.describe()
    assert [(d.layer_id, d.reason) for d in info.dropped_layers] == [(1, "no_kv_heads")]
    assert [g.layer_ids for g in info.layer_groups] == [(0, 2)]
    assert {b.layer_id for b in info.buffers} == {0, 2}
    # Layers 0 (K V, 2 heads x 4 x 2 bytes each) and 2 (K): 16 + 16 + 16 bytes per token.
    assert m.estimate(64).bytes_per_token == {0: 48}
    m.allocate("a", 5)
    calls = [
        lambda: m.layer_view(1, "key"),
        lambda: m.kv_view(1),
        lambda: m.page_indices(["a"], 1),
        lambda: m.slot_mapping(["a"], 1),
        lambda: m.layer_group_of(1),
    ]
    for call in calls:
        with pytest.raises(UnknownLayer) as exc:
            call()
        assert exc.value.code == "unknown_layer"
        assert "layer 1 has no KV cache" in exc.value.message and "dropped" in exc.value.message
        assert exc.value.detail == {"layer_id": 1, "reason": "no_kv_heads"}
    with pytest.raises(UnknownLayer) as exc:
        m.layer_view(7, "key")
    assert exc.value.message == "unknown layer 7"
    # The per-layer tables keep a row for the dropped id, with no pool and no address.
    assert m.layer_pool_map()[1].eq(-1).all() and m.layer_pointer_table()[1].eq(0).all()
    assert m.page_indices(["a"], 2, mode="kernel")[0, :2].tolist() == [0, 1]  # the rest works
    assert "dropped layers: 1 (no_kv_heads)" in report(m, [64])  # kvcm estimate's layout


def test_a_dropped_last_layer_still_has_a_table_row() -> None:
    m = manager([layer(0), layer(5, num_kv_heads=0)])
    assert m.layer_pool_map().shape == (6, 4, 2)
    assert [d.layer_id for d in m.describe().dropped_layers] == [5]
