from __future__ import annotations

import pytest
import torch
from helpers import layer, manager

from kvcm import InvalidArgument, UnknownLayer


def _three_blocks(m) -> list[int]:  # type: ignore[no-untyped-def]
    m.allocate("x", 1)  # takes slot 0, so the request below starts at slot 1
    m.allocate("a", 9)
    m.free("x")
    return m.block_table("a")[0]


def test_three_key_only_layers_in_one_pool_give_three_times_slot() -> None:
    m = manager([layer(i, kv_factor=1) for i in range(3)])
    assert [p.num_buffers for p in m.describe().pools] == [3]
    slots = _three_blocks(m)
    assert slots == [1, 2, 3]
    for lid in range(3):
        got = m.page_indices(["a"], lid, mode="kernel")[0].tolist()
        assert got[:3] == [3 * s for s in slots] and set(got[3:]) == {-1}
        per_layer = m.page_indices(["a"], lid, mode="kernel", per_layer=True)[0].tolist()
        assert per_layer[:3] == [3 * s + lid for s in slots] and set(per_layer[3:]) == {-1}
    assert m.page_indices(["a"], 1)[0].tolist()[:3] == slots


def test_one_key_value_layer_alone_in_its_pool_gives_slot() -> None:
    m = manager([layer(0)])
    slots = _three_blocks(m)
    for role in ("key", "value"):
        assert m.page_indices(["a"], 0, role, mode="kernel")[0].tolist()[:3] == slots
        assert (
            m.page_indices(["a"], 0, role, mode="kernel", per_layer=True)[0].tolist()[:3] == slots
        )


def test_l_key_value_layers_in_one_pool_give_l_times_slot() -> None:
    n = 5
    m = manager([layer(i) for i in range(n)])
    slots = _three_blocks(m)
    for lid in range(n):
        kernel = m.page_indices(["a"], lid, "value", mode="kernel")[0].tolist()
        assert kernel[:3] == [n * s for s in slots]
        per_layer = m.page_indices(["a"], lid, "value", mode="kernel", per_layer=True)
        assert per_layer[0].tolist()[:3] == [n * s + lid for s in slots]


def test_minus_one_stays_minus_one_in_released_and_empty_positions() -> None:
    m = manager([layer(0, kv_factor=1, sliding_window=4), layer(1, kv_factor=1, sliding_window=4)])
    m.allocate("a", 8)
    m.extend("a", 1)
    assert m.block_table("a") == [[-1, 1, 2]]
    got = m.page_indices(["a"], 1, mode="kernel", per_layer=True)[0].tolist()
    assert got[:3] == [-1, 2 * 1 + 1, 2 * 2 + 1] and set(got[3:]) == {-1}


def test_nvfp4_scale_roles_index_their_own_pool() -> None:
    # Two nvfp4 layers (data pool of 4 buffers, scale pool of 4) and an fp16 layer.
    m = manager(
        [
            layer(0, num_kv_heads=2, head_dim=16, dtype="nvfp4"),
            layer(1, num_kv_heads=2, head_dim=16, dtype="nvfp4"),
        ]
    )
    slots = _three_blocks(m)
    for role in ("key", "key_scale", "value_scale"):
        got = m.page_indices(["a"], 1, role, mode="kernel", per_layer=True)[0].tolist()
        assert got[:3] == [2 * s + 1 for s in slots]


def test_page_indices_batch_follows_request_order() -> None:
    m = manager([layer(0)])
    m.allocate("a", 5)
    m.allocate("b", 1)
    got = m.page_indices(["b", "a", "b"], 0)
    assert got.shape == (3, 16) and got.dtype == torch.int32
    assert got[:, :2].tolist() == [[2, -1], [0, 1], [2, -1]]


def test_page_index_errors() -> None:
    m = manager([layer(0, kv_factor=1)])
    m.allocate("a", 1)
    with pytest.raises(UnknownLayer):
        m.page_indices(["a"], 3)
    with pytest.raises(InvalidArgument):
        m.page_indices(["a"], 0, "value")
    with pytest.raises(InvalidArgument):
        m.page_indices(["a"], 0, mode="slot", per_layer=True)
    with pytest.raises(InvalidArgument):
        m.page_indices(["a"], 0, mode="pages")  # type: ignore[arg-type]


def test_pointer_tables_locate_every_page() -> None:
    m = manager(
        [
            layer(0),
            layer(1),
            layer(2, kv_factor=1, num_kv_heads=4),
            layer(3, num_kv_heads=2, head_dim=16, dtype="nvfp4"),
        ]
    )
    pools = m.describe().pools
    ptr, pool_map, layer_ptr = m.pointer_table(), m.layer_pool_map(), m.layer_pointer_table()
    assert ptr.shape == (len(pools), 2) and ptr.dtype == torch.int64
    assert pool_map.shape == (4, 4, 2) and layer_ptr.shape == (4, 4)
    from kvcm_client.models import ROLES

    for lid in range(4):
        spec = m.layout.layers[lid]
        for r, role in enumerate(ROLES):
            if role not in spec.roles():
                assert pool_map[lid, r].tolist() == [-1, -1] and int(layer_ptr[lid, r]) == 0
                continue
            pool_id, page_offset = pool_map[lid, r].tolist()
            pool = pools[pool_id]
            view = m.layer_view(lid, role)
            page_bytes = pool.kv_factor * pool.bytes_per_buffer
            assert int(layer_ptr[lid, r]) == view.data_ptr()
            for slot in (0, 1, 7, 15):
                index = slot * pool.num_buffers // pool.kv_factor + page_offset
                address = int(ptr[pool_id, r % 2]) + index * page_bytes
                assert address == view[slot].data_ptr(), (lid, role, slot)


@pytest.mark.parametrize("null_page", [False, True])
def test_slot_mapping_of_the_latest_tokens_padded(null_page: bool) -> None:
    m = manager([layer(0), layer(1, sliding_window=4)], null_page=null_page)
    k = int(null_page)  # with the null page every slot is one higher: slot 0 is never taken
    m.allocate("a", 6)  # group 0 blocks [0, 1]; group 1 blocks [2, 3] (plus k)
    m.allocate("b", 3)  # group 0 [4]; group 1 [5]
    # tokens_per_block 4: a's positions 0..5, b's 0..2; slot s + k starts at 4 * (s + k).
    got = m.slot_mapping(["a", "b"], 0, pad_to=12) - 4 * k * (torch.arange(12) < 9)
    assert got.dtype == torch.int64
    assert got.tolist() == [0, 1, 2, 3, 4, 5, 16, 17, 18, -1, -1, -1]
    got = m.slot_mapping(["b", "a"], 1) - 4 * k
    assert got.tolist() == [20, 21, 22, 8, 9, 10, 11, 12, 13]
    m.extend("a", 3)  # positions 6..8: group 0 block 1 then a new block (6)
    m.extend("b", 1)  # position 3
    assert m.block_table("a")[0] == [0 + k, 1 + k, 6 + k]
    assert (m.slot_mapping(["a", "b"], 0) - 4 * k).tolist() == [6, 7, 24, 19]
    assert (m.slot_mapping(["a"], 0, num_tokens=[1]) - 4 * k).tolist() == [24]
    with pytest.raises(InvalidArgument):
        m.slot_mapping(["a"], 0, pad_to=2)
    with pytest.raises(InvalidArgument):
        m.slot_mapping(["b"], 0, num_tokens=[5])


@pytest.mark.parametrize("null_page", [False, True])
def test_slot_mapping_of_released_positions_is_minus_one(null_page: bool) -> None:
    """-1 with the null page too: the table holds 0 there, and no token maps to slot 0."""
    m = manager([layer(0, sliding_window=4)], null_page=null_page)
    k = int(null_page)
    m.allocate("a", 8)
    m.extend("a", 1)
    assert m.block_table("a") == [[-1, 1 + k, 2 + k]]
    want = [-1] * 4 + [4 * (1 + k) + i for i in range(4)] + [4 * (2 + k)]
    assert m.slot_mapping(["a"], 0, num_tokens=[9]).tolist() == want
