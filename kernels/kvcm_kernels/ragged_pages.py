"""Ragged (CSR) kernel-mode page indices: FlashInfer's ``indptr`` / ``indices`` /
``last_page_len``, plus where a sliding window's pages start.

Request i lists, in order, the entries j of its page-table row ``rows[i]`` that hold a page
(slot >= ``min_live``) and whose block holds one of its ``lengths[i]`` tokens: global block
``j * cp + cp_rank`` below ``ceil(length / tokens_per_block)`` (``cp`` 1: block j). Each is
written as ``slot * multiplier + offset``, the kernel-mode index of ``kernel_page_indices``.
Per request also: ``last_page_len``, the tokens of its last listed page (0 when it lists none),
``num_sink_pages``, its listed pages whose block is below ``sink_blocks`` (they come first), and
``first_token``, the position of the first token of its first listed page past the sinks (0
when it lists none).

Worked example (tokens_per_block 4, cp 1, sink_blocks 1, min_live 0, multiplier 2, offset 1):
row [7, -1, -1, 5, 9, 3, -1, ...] of a request of 19 tokens: blocks 0..4 hold its tokens
(ceil(19 / 4) = 5), so entries 0, 3 and 4 are listed (entry 5 is a lookahead page: it holds
no token yet): indices [15, 11, 19], indptr [0, 3], last_page_len 19 - 4 * 4 = 3,
num_sink_pages 1, first_token 3 * 4 = 12.
"""

from __future__ import annotations

import torch

from ._dispatch import blocks, gpu_path, i32, launch, ptr

THREADS = 1024  # 32 warps: one request per warp, 32 requests a round (ragged_pages.cu)
WARPS_PLACED = 8  # warps a block of the kernel that takes the caller's indptr

#: (indptr, indices, last_page_len, first_token, num_sink_pages), all int32.
Ragged = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def ragged_page_indices_reference(
    table: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    tokens_per_block: int,
    multiplier: int,
    offset: int,
    sink_blocks: int = 0,
    min_live: int = 0,
    cp: int = 1,
    cp_rank: int = 0,
    total: int | None = None,
    indptr: torch.Tensor | None = None,
) -> Ragged:
    device = table.device
    if table.shape[1] == 0:  # no entries: one that holds no page lists nothing either
        table = torch.full((table.shape[0], 1), -1, dtype=table.dtype, device=device)
    cols = table.shape[1]
    pages = table.index_select(0, rows).to(torch.int64)  # [n, cols]
    lengths = lengths.to(device=device, dtype=torch.int64)
    block = torch.arange(cols, device=device, dtype=torch.int64) * cp + cp_rank  # [cols]
    blocks = (lengths + tokens_per_block - 1) // tokens_per_block  # [n]
    listed = (pages >= min_live) & (block[None, :] < blocks[:, None])
    counts = listed.sum(dim=1)
    given = indptr
    indptr = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=device)
    indptr[1:] = torch.cumsum(counts, dim=0)
    if (total is not None and int(indptr[-1]) != total) or (
        given is not None and not torch.equal(given.to(device=device, dtype=torch.int64), indptr)
    ):
        raise RuntimeError(
            "the page table and the caller's bookkeeping disagree on the pages listed (the "
            f"table lists {int(indptr[-1])} in all)"
        )
    indices = (pages * multiplier + offset)[listed]
    at = block.expand_as(pages)
    last = torch.where(listed, at, -1).amax(dim=1)
    tail = torch.clamp(lengths - last * tokens_per_block, max=tokens_per_block)
    last_page_len = torch.where(last >= 0, tail, 0)
    late = listed & (at >= sink_blocks)
    never = cols * cp + cp  # past every block
    first = torch.where(late, at, never).amin(dim=1)
    first_token = torch.where(first < never, first * tokens_per_block, 0)
    num_sink_pages = (listed & (at < sink_blocks)).sum(dim=1)
    return (
        indptr.to(torch.int32),
        indices.to(torch.int32),
        last_page_len.to(torch.int32),
        first_token.to(torch.int32),
        num_sink_pages.to(torch.int32),
    )


def ragged_page_indices_cuda(
    table: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    tokens_per_block: int,
    multiplier: int,
    offset: int,
    sink_blocks: int = 0,
    min_live: int = 0,
    cp: int = 1,
    cp_rank: int = 0,
    total: int | None = None,
    indptr: torch.Tensor | None = None,
) -> Ragged:
    n, cols = rows.numel(), table.shape[1]
    placed = None if indptr is None else indptr.to(torch.int64).contiguous()
    if placed is not None and total is None:
        total = int(placed[-1])
    capacity = n * cols if total is None else total
    # One allocation: indptr | last_page_len | first_token | num_sink_pages | indices.
    out = torch.empty(4 * n + 1 + capacity, dtype=torch.int32, device=table.device)
    indptr = out[: n + 1]
    last_page_len, first_token, num_sink_pages = (
        out[n + 1 + k * n : n + 1 + (k + 1) * n] for k in range(3)
    )
    indices = out[4 * n + 1 :]
    if n == 0:
        indptr.zero_()
    elif placed is not None:
        launch(
            "ragged_pages",
            "ragged_page_indices_placed",
            table.device,
            (blocks(n, WARPS_PLACED),),
            (32 * WARPS_PLACED,),
            (
                ptr(table),
                ptr(rows),
                ptr(lengths),
                ptr(placed),
                i32(n),
                i32(cols),
                i32(tokens_per_block),
                i32(cp),
                i32(cp_rank),
                i32(sink_blocks),
                i32(min_live),
                i32(multiplier),
                i32(offset),
                ptr(indptr),
                ptr(indices),
                ptr(last_page_len),
                ptr(first_token),
                ptr(num_sink_pages),
            ),
        )
    else:
        launch(
            "ragged_pages",
            "ragged_page_indices",
            table.device,
            (1,),
            (THREADS,),
            (
                ptr(table),
                ptr(rows),
                ptr(lengths),
                i32(n),
                i32(cols),
                i32(tokens_per_block),
                i32(cp),
                i32(cp_rank),
                i32(sink_blocks),
                i32(min_live),
                i32(multiplier),
                i32(offset),
                i32(capacity),
                ptr(indptr),
                ptr(indices),
                ptr(last_page_len),
                ptr(first_token),
                ptr(num_sink_pages),
            ),
        )
    if total is None:  # sized by the count: one wait for the device
        indices = indices[: int(indptr[-1])]
    return indptr, indices, last_page_len, first_token, num_sink_pages


def ragged_page_indices(
    table: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    tokens_per_block: int,
    multiplier: int,
    offset: int,
    sink_blocks: int = 0,
    min_live: int = 0,
    cp: int = 1,
    cp_rank: int = 0,
    total: int | None = None,
    indptr: torch.Tensor | None = None,
) -> Ragged:
    """The ragged pages of rows ``rows`` (int64) of the int32 page table ``[R, B]``, requests
    of ``lengths`` (int64) tokens: (indptr ``[n + 1]``, indices ``[indptr[-1]]``,
    last_page_len, first_token, num_sink_pages ``[n]``), int32 on the table's device.

    ``indptr`` (int64 ``[n + 1]``) and ``total`` (its last entry, on the host), when given,
    are what the caller's bookkeeping says the rows list. With ``indptr`` the CUDA path places
    each request's pages at once, with a warp per request over many blocks and no scan (it
    writes request i's pages inside ``[indptr[i], indptr[i + 1])`` only); without it one
    block counts and scans. With ``total`` it sizes ``indices`` with no wait for the device
    (without, it reads the count back). The reference checks both (``RuntimeError`` if the
    table disagrees).
    """
    if gpu_path(table, rows, lengths) and (indptr is None or indptr.is_cuda):
        return ragged_page_indices_cuda(
            table.contiguous(),
            rows.contiguous(),
            lengths.contiguous(),
            tokens_per_block,
            multiplier,
            offset,
            sink_blocks,
            min_live,
            cp,
            cp_rank,
            total,
            indptr,
        )
    return ragged_page_indices_reference(
        table,
        rows,
        lengths,
        tokens_per_block,
        multiplier,
        offset,
        sink_blocks,
        min_live,
        cp,
        cp_rank,
        total,
        indptr,
    )


def ragged_decode_attention_reference(
    query: torch.Tensor,
    kv_pages: torch.Tensor,
    ragged: Ragged,
    scale: float,
    window: int | None = None,
    sink_tokens: int = 0,
) -> torch.Tensor:
    """Decode attention through ragged page metadata, in FlashInfer's layout: the oracle of
    a kernel that takes it (FlashInfer's batch decode wrapper where it is installed).

    ``query`` ``[R, q_heads, dim]``: request i's one query, at its last token; ``kv_pages``
    ``[pages, 2, tokens_per_block, kv_heads, dim]`` (FlashInfer's NHD paged KV cache: the
    keys then the values of a page), indexed by ``ragged``'s kernel-mode indices. Request i's
    keys are its listed pages' tokens: a sink page j (``j < num_sink_pages[i]``) holds
    positions ``j * tokens_per_block + t``, the k-th page after them ``first_token[i] + k *
    tokens_per_block + t``, the last one only its first ``last_page_len[i]`` tokens. The
    query at the last position q sees p <= q with, under a ``window`` W, ``q - p < W`` or
    ``p < sink_tokens``. Grouped-query: ``q_heads`` a multiple of ``kv_heads``. Returns
    ``[R, q_heads, dim]`` (zeros for a request that lists no page).

    Example (tokens_per_block 4, W 6, sink_tokens 2): pages [p0 | p5 p6] with one sink page,
    first_token 20, last_page_len 3: keys at 0-3 and 20-26, q = 26; visible 0, 1 (sinks)
    and 21-26 (the window).
    """
    indptr, indices, last_page_len, first_token, num_sink_pages = (
        t.to(torch.int64).tolist() for t in ragged
    )
    tpb, kv_heads = kv_pages.shape[2], kv_pages.shape[3]
    out = torch.zeros_like(query)
    group = query.shape[1] // kv_heads
    for i in range(query.shape[0]):
        listed = indices[indptr[i] : indptr[i + 1]]
        if not listed:
            continue
        sinks = num_sink_pages[i]
        pages = kv_pages[torch.tensor(listed, dtype=torch.long, device=kv_pages.device)]
        starts = [
            j * tpb if j < sinks else first_token[i] + (j - sinks) * tpb for j in range(len(listed))
        ]
        positions = torch.tensor([s + t for s in starts for t in range(tpb)], device=query.device)
        keep = torch.ones(len(listed) * tpb, dtype=torch.bool, device=query.device)
        keep[(len(listed) - 1) * tpb + last_page_len[i] :] = False
        q_pos = int(positions[keep][-1])
        if window is not None:
            keep &= (q_pos - positions < window) | (positions < sink_tokens)
        k = pages[:, 0].reshape(-1, kv_heads, kv_pages.shape[-1])[keep]
        v = pages[:, 1].reshape(-1, kv_heads, kv_pages.shape[-1])[keep]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,khd->hk", query[i].float(), k.float()) * scale
        out[i] = torch.einsum("hk,khd->hd", logits.softmax(-1), v.float()).to(query.dtype)
    return out
