from __future__ import annotations

import pytest
import torch
from helpers import layer, manager

from kvcm import InvalidArgument, UnknownLayer


def test_alternating_window_and_full_layers_share_one_pool_group() -> None:
    m = manager([layer(i, sliding_window=8) if i % 2 == 0 else layer(i) for i in range(4)])
    info = m.describe()
    assert [g.layer_ids for g in info.layer_groups] == [(0, 2), (1, 3)]
    assert [g.sliding_window for g in info.layer_groups] == [8, None]
    assert [g.pool_group for g in info.layer_groups] == [0, 0]
    # One physical pool: 4 buffers (K V K V) of 4 tokens x 2 heads x 4 dims x 2 bytes = 64 B.
    assert len(info.pools) == 1
    pool = info.pools[0]
    assert (pool.num_buffers, pool.bytes_per_buffer, pool.slot_bytes) == (4, 64, 256)
    assert (pool.num_slots, pool.nbytes) == (16, 16 * 256)
    offsets = {(b.layer_id, b.role): b.offset_bytes for b in info.buffers}
    assert offsets == {
        (0, "key"): 0,
        (0, "value"): 64,
        (2, "key"): 128,
        (2, "value"): 192,
        (1, "key"): 0,
        (1, "value"): 64,
        (3, "key"): 128,
        (3, "value"): 192,
    }


def test_different_shapes_get_separate_pool_groups() -> None:
    m = manager([layer(0), layer(1, num_kv_heads=4, sliding_window=8)], num_blocks=5)
    info = m.describe()
    assert [g.pool_group for g in info.layer_groups] == [0, 1]
    assert [pg.slot_bytes for pg in info.pool_groups] == [128, 256]
    assert m.num_total_blocks() == 5 and m.num_total_blocks(1) == 5


def test_draft_layers_form_their_own_layer_group() -> None:
    m = manager([layer(0), layer(1), layer(2, owner="draft")])
    groups = m.describe().layer_groups
    assert [(g.layer_ids, g.owner) for g in groups] == [((0, 1), "target"), ((2,), "draft")]
    assert [g.pool_group for g in groups] == [0, 1]


def test_coalescing_group_splits_pools_within_a_layer_group() -> None:
    m = manager([layer(0), layer(1, coalescing_group=1)])
    info = m.describe()
    assert len(info.layer_groups) == 1
    assert [p.num_buffers for p in info.pools] == [2, 2]
    assert [b.pool for b in info.buffers] == [0, 0, 1, 1]


def test_mixed_kv_factor_layers_never_share_a_pool() -> None:
    # key-only with 4 heads has the same bytes per buffer as key/value with 4 heads.
    m = manager([layer(0, num_kv_heads=4), layer(1, num_kv_heads=4, kv_factor=1)])
    info = m.describe()
    assert [(p.kv_factor, p.num_buffers) for p in info.pools] == [(2, 2), (1, 1)]


def test_nvfp4_scale_pool_is_heads_times_dim_over_16_bytes_per_token() -> None:
    m = manager([layer(0, num_kv_heads=2, head_dim=16, dtype="nvfp4")], tokens_per_block=8)
    info = m.describe()
    data, scale = info.pools
    assert (data.kind, scale.kind) == ("data", "scale")
    assert data.bytes_per_buffer == 8 * 2 * 16 // 2  # 4 bits per value
    assert scale.bytes_per_buffer == 8 * 2 * 16 // 16  # one fp8 scale per 16 values
    assert (data.num_buffers, scale.num_buffers) == (2, 2)
    assert info.layer_groups[0].bytes_per_token == 2 * (16 + 2)
    assert info.pool_groups[0].slot_bytes == 2 * 128 + 2 * 16
    ks = m.layer_view(0, "key_scale")
    assert ks.shape == (16, 8, 2) and ks.dtype == torch.float8_e4m3fn
    k = m.layer_view(0, "key")
    assert k.shape == (16, 8, 2, 8) and k.dtype == torch.uint8
    assert m.kv_view(0).shape == (16, 2, 8, 2, 8)


def test_views_alias_pool_memory_at_the_described_offsets() -> None:
    m = manager([layer(0), layer(1), layer(2, kv_factor=1, num_kv_heads=4)])
    info = m.describe()
    pool = m.memory.tensors[0]
    pool.zero_()
    v1 = m.layer_view(1, "value")
    assert v1.shape == (16, 4, 2, 4)
    v1[5, 2, 1, 3] = 7.0
    # slot 5, buffer (1, value) at byte 192, token 2, head 1, dim 3, fp16.
    byte = 5 * 256 + 192 + ((2 * 2 + 1) * 4 + 3) * 2
    assert pool[5].view(torch.float16)[(byte - 5 * 256) // 2].item() == 7.0
    assert pool.view(-1)[byte : byte + 2].view(torch.float16).item() == 7.0
    kv = m.kv_view(1)
    assert kv.shape == (16, 2, 4, 2, 4)
    assert kv[5, 1, 2, 1, 3].item() == 7.0
    assert torch.equal(kv[:, 0], m.layer_view(1, "key"))
    for b in info.buffers:
        view = m.layer_view(b.layer_id, b.role)
        assert view.data_ptr() == b.base_address
        assert view.stride(0) * view.element_size() == b.page_stride_bytes
        assert view[3].data_ptr() == b.base_address + 3 * b.page_stride_bytes
    # key-only layer: its own pool, no kv dimension.
    assert m.kv_view(2).shape == (16, 4, 4, 4)


def test_view_errors() -> None:
    m = manager([layer(0, kv_factor=1)])
    with pytest.raises(UnknownLayer):
        m.kv_view(9)
    with pytest.raises(InvalidArgument) as exc:
        m.layer_view(0, "value")
    assert exc.value.code == "invalid_argument" and "no role 'value'" in exc.value.message


def test_groups_listing_dtypes_in_other_orders_share_one_pool_group() -> None:
    # Window group {fp8 layer 0, fp16 layer 2}, full group {fp16 layer 1, fp8 layer 3}: each
    # group holds one fp16 pool (K V of 4 tokens x 2 heads x 4 dims x 2 bytes = 64 B) and one
    # fp8 pool (K V of 32 B); the canonical order puts the larger first in both.
    m = manager(
        [
            layer(0, dtype="fp8_e4m3", sliding_window=8),
            layer(1),
            layer(2, sliding_window=8),
            layer(3, dtype="fp8_e4m3"),
        ]
    )
    info = m.describe()
    assert [g.layer_ids for g in info.layer_groups] == [(0, 2), (1, 3)]
    assert [g.pool_group for g in info.layer_groups] == [0, 0]
    assert len(info.pool_groups) == 1 and info.pool_groups[0].slot_bytes == 2 * 64 + 2 * 32
    assert [(p.bytes_per_buffer, p.num_buffers) for p in info.pools] == [(64, 2), (32, 2)]
    place = {(b.layer_id, b.role): (b.pool, b.offset_bytes) for b in info.buffers}
    assert place == {
        (0, "key"): (1, 0),
        (0, "value"): (1, 32),
        (1, "key"): (0, 0),
        (1, "value"): (0, 64),
        (2, "key"): (0, 0),
        (2, "value"): (0, 64),
        (3, "key"): (1, 0),
        (3, "value"): (1, 32),
    }
    assert m.layer_view(0, "key").dtype == torch.float8_e4m3fn
    assert m.layer_view(3, "value").shape == (16, 4, 2, 4)
    # Both groups draw slots from the one allocator; every (layer, role) written through its
    # view at its own group's slots reads back intact.
    m.allocate("a", 8)
    m.allocate("b", 5)
    written = {}
    for n, ((lid, role), _) in enumerate(sorted(place.items())):
        group = m.layer_group_of(lid)
        for rid in ("a", "b"):
            for slot in m.block_table(rid)[group]:
                m.layer_view(lid, role)[slot] = float(n + 1)
                written[(lid, role, slot)] = float(n + 1)
    assert len({slot for (_, _, slot) in written}) == m.num_total_blocks(0) - m.num_free_blocks(0)
    for (lid, role, slot), value in written.items():
        assert bool((m.layer_view(lid, role)[slot].float() == value).all()), (lid, role, slot)
