"""A reference paged-attention consumer in torch: what an inference server does with kvcm.

It writes a step's new keys and values through the attached pool views at the slots of the
step's slot mapping, and computes attention by gathering each request's pages through its
page-table row. It is written for clarity and exactness (float32 math, explicit masks), as
the oracle that proves the index contract end to end; production kernels do the same with
fused loads.

Index arithmetic (tokens_per_block 4): slot-mapping value 22 is slot 22 // 4 = 5, offset
22 % 4 = 2, so the token's key goes to ``key_view[5, 2]``. A request of 10 tokens whose
page-table row starts [7, -1, 3] has keys 0..3 in slot 7, 4..7 released by its window, 8..9 in
slot 3 at offsets 0 and 1.

Masks: a query at position i sees key j if j <= i, j's block is held (not -1, and not the null
page 0 when the layout has ``null_page``), and, for a sliding window W with S sink tokens,
i - j < W or j < S.
"""

from __future__ import annotations

import math

import torch

from .shared import Attachment


def write_kv(
    attachment: Attachment,
    layer_id: int,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None = None,
) -> None:
    """Store ``key``/``value`` ``[tokens, heads, head_dim]`` at the slots (-1 = padding)."""
    tpb = attachment.layout.tokens_per_block
    view = attachment.layer_view(layer_id, "key")
    slot_mapping = slot_mapping.to(view.device)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // tpb, slots % tpb
    view[blocks, offsets] = key.to(view.device)[keep]
    if value is not None:
        values = attachment.layer_view(layer_id, "value")
        values[blocks, offsets] = value.to(values.device)[keep]


def _spec(attachment: Attachment, layer_id: int) -> object:
    return next(s for s in attachment.layout.layers if s.layer_id == layer_id)


def key_mask(
    num_tokens: int,
    num_queries: int,
    held: torch.Tensor,
    window: int | None,
    sink_tokens: int,
) -> torch.Tensor:
    """bool ``[num_queries, num_tokens]``: which key each of the last queries may see."""
    q = torch.arange(num_tokens - num_queries, num_tokens, device=held.device)[:, None]
    k = torch.arange(num_tokens, device=held.device)[None, :]
    allowed = (k <= q) & held[None, :num_tokens]
    if window is not None:
        allowed &= (q - k < window) | (k < sink_tokens)
    return allowed


def attention(
    attachment: Attachment,
    layer_id: int,
    row: int,
    num_tokens: int,
    query: torch.Tensor,
) -> torch.Tensor:
    """Attention of the request in page-table ``row`` for its last ``len(query)`` positions.

    ``query`` is ``[n, q_heads, head_dim]`` (q_heads a multiple of the KV heads: GQA); the
    result ``[n, q_heads, head_dim]`` in float32. Key-only layers use the keys as values.
    """
    spec = _spec(attachment, layer_id)
    tpb = attachment.layout.tokens_per_block
    group = attachment.layout.layer_group_of[layer_id]
    nblocks = -(-num_tokens // tpb)
    pages = attachment.page_tables[group, row, :nblocks].long()
    empty = 0 if attachment.layout.null_page else -1
    held = (pages > empty).repeat_interleave(tpb)
    gather = pages.clamp(min=0)
    keys = attachment.layer_view(layer_id, "key")[gather].flatten(0, 1)[:num_tokens]
    values = (
        attachment.layer_view(layer_id, "value")[gather].flatten(0, 1)[:num_tokens]
        if spec.kv_factor == 2  # type: ignore[attr-defined]
        else keys
    )
    mask = key_mask(
        num_tokens,
        query.shape[0],
        held,
        spec.sliding_window,  # type: ignore[attr-defined]
        spec.sink_tokens,  # type: ignore[attr-defined]
    )
    group_size = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group_size, dim=1)  # [T, Hq, D]
    v = values.float().repeat_interleave(group_size, dim=1)
    query = query.to(k.device)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) / math.sqrt(query.shape[-1])
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
