"""Decode attention through ``ragged_page_indices`` in FlashInfer's paged-KV layout equals dense
attention: the oracle a FlashInfer-style kernel is held to (issue 35, item 2).

Two key/value layers share one pool group (so the per-layer kernel-mode index is ``slot x 2 +
the layer's page``): one with a window of 10 tokens and 5 sink tokens, one full. Requests
arrive, grow by chunks of 1-5 tokens (chunked prefill, then decode) and finish; each step's
new keys and values go into the pools at the slot mappings, and into a dense copy by
position. After every step, each layer's decode attention of every request, read through its
ragged pages, equals attention over the dense copy with the window and sinks masked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcm import KVCacheManager
from kvcm_kernels.ragged_pages import ragged_decode_attention_reference

TPB, HEADS, Q_HEADS, DIM = 4, 2, 4, 8
WINDOW, SINKS = 10, 5
LAYERS = [
    {
        "layer_id": 0,
        "num_kv_heads": HEADS,
        "head_dim": DIM,
        "dtype": "fp32",
        "sliding_window": WINDOW,
        "sink_tokens": SINKS,
    },
    {"layer_id": 1, "num_kv_heads": HEADS, "head_dim": DIM, "dtype": "fp32"},
]


def pages_of(m: KVCacheManager, layer: int) -> torch.Tensor:
    """The layer's pool seen as FlashInfer's ``[pages, 2, tokens_per_block, heads, dim]``, in
    which the layer's per-layer kernel-mode indices index its pages."""
    kv = m.kv_view(layer)  # [slots, 2, tpb, heads, dim], a slot's stride apart
    place = m.parts.views.placement(layer, "key")
    per_slot = place.num_buffers // place.kv_factor
    page = 2 * TPB * HEADS * DIM
    assert kv.stride(0) == per_slot * page and kv.stride()[1:] == (
        TPB * HEADS * DIM,
        HEADS * DIM,
        DIM,
        1,
    )
    base = kv.storage_offset() - place.page_offset * page
    return torch.as_strided(
        kv, (kv.shape[0] * per_slot, 2, TPB, HEADS, DIM), (page, *kv.stride()[1:]), base
    )


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """q ``[q_heads, dim]`` at the last of the ``len(k)`` positions."""
    last = k.shape[0] - 1
    p = torch.arange(k.shape[0])
    seen = (
        torch.ones_like(p, dtype=torch.bool)
        if window is None
        else (last - p < window) | (p < SINKS)
    )
    group = Q_HEADS // HEADS
    k, v = k[seen].repeat_interleave(group, 1), v[seen].repeat_interleave(group, 1)
    logits = torch.einsum("hd,khd->hk", q, k) / DIM**0.5
    return torch.einsum("hk,khd->hd", logits.softmax(-1), v)


@pytest.mark.parametrize("null_page", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_ragged_decode_attention_equals_dense_attention(null_page: bool, seed: int) -> None:
    check_against_dense(null_page, seed, "cpu")


def check_against_dense(null_page: bool, seed: int, device: str) -> None:
    """The module's check on a manager on ``device`` (tests/gpu runs it on cuda:0)."""
    m = KVCacheManager(
        {
            "device": device,
            "layers": LAYERS,
            "tokens_per_block": TPB,
            "max_requests": 6,
            "max_seq_len": 64,
            "num_blocks": 160,
            "null_page": null_page,
        }
    )
    assert (
        m.parts.views.placement(0, "key").layer_group
        != m.parts.views.placement(1, "key").layer_group
    )
    assert pages_of(m, 0).data_ptr() == pages_of(m, 1).data_ptr()  # one pool group
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    dense: dict[tuple[str, int], list[torch.Tensor]] = {}  # (request, layer) -> [k, v] by position
    live: list[str] = []
    checked = released = 0
    for step in range(60):
        new: dict[str, int] = {}
        for rid in list(live):
            if m.request(rid).num_tokens > 50:
                m.free(rid)
                live.remove(rid)
            else:
                new[rid] = int(rng.integers(1, 6)) if rng.random() < 0.3 else 1
                m.extend(rid, new[rid])
        if len(live) < 5 and rng.random() < 0.5:
            rid = f"r{step}"
            new[rid] = int(rng.integers(1, 14))
            m.allocate(rid, new[rid])
            live.append(rid)
        ids = list(new)
        for layer in (0, 1):
            mapping = m.slot_mapping(ids, layer).tolist()
            kv = m.kv_view(layer)
            at = 0
            for rid in ids:
                k = torch.randn(new[rid], HEADS, DIM, generator=gen)
                v = torch.randn(new[rid], HEADS, DIM, generator=gen)
                for t in range(new[rid]):
                    slot = mapping[at + t]
                    if slot >= 0:
                        kv[slot // TPB, 0, slot % TPB] = k[t].to(device)
                        kv[slot // TPB, 1, slot % TPB] = v[t].to(device)
                at += new[rid]
                old = dense.get((rid, layer), [k[:0], v[:0]])
                dense[(rid, layer)] = [torch.cat([old[0], k]), torch.cat([old[1], v])]
        if not live:
            continue
        for layer, window in ((0, WINDOW), (1, None)):
            rag = m.ragged_page_indices(live, layer, per_layer=True)
            q = torch.randn(len(live), Q_HEADS, DIM, generator=gen)
            ragged = (
                rag.indptr,
                rag.indices,
                rag.last_page_len,
                rag.first_token,
                rag.num_sink_pages,
            )
            out = ragged_decode_attention_reference(
                q.to(device), pages_of(m, layer), ragged, DIM**-0.5, window, SINKS if window else 0
            ).cpu()
            for i, rid in enumerate(live):
                k, v = dense[(rid, layer)]
                # The listed pages end at the request's last token (first_token places them).
                pages, sinks = int(rag.indptr[i + 1] - rag.indptr[i]), int(rag.num_sink_pages[i])
                last = (
                    (pages - 1) * TPB
                    if pages <= sinks
                    else int(rag.first_token[i]) + (pages - 1 - sinks) * TPB
                )
                assert last + int(rag.last_page_len[i]) == k.shape[0], (step, rid, layer)
                assert torch.allclose(out[i], dense_attention(q[i], k, v, window), atol=1e-5), (
                    step,
                    rid,
                    layer,
                )
                checked += 1
                listed = int(rag.indptr[i + 1] - rag.indptr[i])
                released += layer == 0 and listed < -(-k.shape[0] // TPB)
    assert checked > 200 and released > 20  # windows released pages the attention never reads
