from __future__ import annotations

import pytest
import torch
from helpers import layer, manager

from kvcm import InvalidArgument


def _model(null_page: bool = False):  # type: ignore[no-untyped-def]
    return manager(
        [
            layer(0),
            layer(1, sliding_window=8),
            layer(2, kv_factor=1, num_kv_heads=1),
            layer(3, num_kv_heads=2, head_dim=16, dtype="nvfp4"),
        ],
        num_blocks=32,
        null_page=null_page,
    )


@pytest.mark.parametrize("null_page", [False, True])
def test_copy_tokens_moves_every_layer_role_and_scale(null_page: bool) -> None:
    m = _model(null_page)
    torch.manual_seed(0)
    for t in m.memory.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    m.allocate("a", 10, lookahead=3)  # capacity 13: positions 0..12
    m.allocate("b", 5)
    before = {
        (lid, role): m.layer_view(lid, role).clone()
        for lid, spec in m.layout.layers.items()
        for role in spec.roles()
    }
    tpb = m.tokens_per_block
    # Accepted drafts at 11 and 12 move to 9 and 10; b's token 4 moves to 0.
    m.copy_tokens(["a", "a", "b"], [11, 12, 4], [9, 10, 0])
    moves = {"a": [(11, 9), (12, 10)], "b": [(4, 0)]}
    for (lid, role), old in before.items():
        view = m.layer_view(lid, role)
        group = m.layer_group_of(lid)
        expect = old.clone()
        for rid, pairs in moves.items():
            blocks = m.block_table(rid)[group]
            for src, dst in pairs:
                expect[blocks[dst // tpb], dst % tpb] = old[blocks[src // tpb], src % tpb]
        assert torch.equal(view.view(torch.uint8), expect.view(torch.uint8)), (lid, role)


@pytest.mark.parametrize("null_page", [False, True])
def test_copy_tokens_validates_positions(null_page: bool) -> None:
    """With the null page a released block is 0 in the table: refused all the same."""
    m = _model(null_page)
    m.allocate("a", 16)
    m.extend("a", 1)  # window group: block 0 released ((16 + 1 - 8) // 4 = 2 -> blocks 0, 1)
    with pytest.raises(InvalidArgument):
        m.copy_tokens(["a"], [17], [2])  # past capacity
    with pytest.raises(InvalidArgument):
        m.copy_tokens(["a"], [16], [1])  # released block
    with pytest.raises(InvalidArgument):
        m.copy_tokens(["a", "a"], [14, 15], [12, 12])  # duplicate destination
    with pytest.raises(InvalidArgument):
        m.copy_tokens(["a", "a"], [14, 12], [12, 13])  # a destination is a source
    with pytest.raises(InvalidArgument):
        m.copy_tokens(["a"], [14, 15], [12])
    m.copy_tokens([], [], [])
