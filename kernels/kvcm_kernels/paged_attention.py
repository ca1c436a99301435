"""Paged attention over kvcm's pools: the keys and values are read in place, through the page
table, by a Triton kernel; no request's history is gathered into a dense tensor first.

Two kernels, each with the torch reference of the same signature (the CPU path and the oracle
of the tests), in the convention of this package:

- ``store_kv``: a forward's new keys and values ``[R, kv_heads, Q, dim]`` (the model's layout,
  left-padded: request i's ``count`` new tokens are its last columns) go to the pool views at
  kvcm's slot mapping (``view[slot // tokens_per_block, slot % tokens_per_block]``); a token
  mapped to -1 (its block already released by a window) is not written.
- ``paged_attention``: the queries ``[R, q_heads, Q, dim]`` attend to the request's history
  read through its page-table row, with causal masking against the history and among the new
  tokens (decode is Q = 1; prefill and chunked prefill are any Q), a sliding window and
  attention sinks, grouped-query attention (``q_heads`` a multiple of ``kv_heads``) and logit
  soft-capping. Output ``[R, Q, q_heads, dim]`` (what transformers' attention functions return);
  a padding query's row is zeros.

Both read per request one column of ``meta`` (int32 ``[4, R]``, see ``step_meta``): the
request's page-table row, its cached length ``start``, its new-token ``count`` and the index of
its first new token in the slot mapping. Query column j of request i is position
``start + j - (Q - count)``; it attends to positions p with ``p <= q`` and, with a window W,
``q - p < W`` or ``p < sinks`` (the first ``sinks`` positions stay visible: attention sinks).

The views are kvcm's slot-mode layer views ``[slots, tokens_per_block, kv_heads, dim]``, with
the page stride of a whole slot (DESIGN.md section 4: a kernel that takes strides uses the
slot-mode page table directly); the page table is the layer group's ``[max_requests,
max_blocks]`` int32 table, -1 (or the null page's 0) where there is no page.

A position the kernel needs whose page-table entry is empty (``<= empty``: -1, or 0 with the
null page) is not read: the kernel sets ``miss[0] = 1`` and the caller raises after the forward
(the example engine's ``CacheMiss``), so the check costs no synchronisation of its own.

Kernel design (``_attention_kernel``): grid ``(R, kv_heads, cdiv(Q * group, BLOCK_M))``. A
program takes one request, one KV head and a tile of BLOCK_M query rows, each row a (query
column, query head of the KV head's group) pair, so that a decode's ``group`` heads share the
loads of their one KV head. It walks the key positions in tiles of BLOCK_N: first the sink
positions below the window, then from the lowest position any of its rows can see
(``q_min - W + 1``, or 0) to the highest query position; per tile it loads the page-table
entries of the positions, the keys and values of the live pages (nothing past the history,
nothing out of the window), and runs the online softmax (fp32 statistics and accumulator;
``tl.dot`` in IEEE fp32 for fp32 models, the tensor cores' fp16/bf16 with fp32 accumulation
otherwise).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch

#: Query rows per program; a decode's group of query heads is padded up to this (tl.dot needs
#: 16 rows).
BLOCK_M = 16
#: Key positions per tile.
BLOCK_N = 32


def step_meta(
    rows: list[int], starts: list[int], counts: list[int], device: torch.device | str
) -> torch.Tensor:
    """The per-request column ``meta`` (int32 ``[4, R]``) both kernels read: page-table row,
    cached length, new tokens, first new token's index in the slot mapping. One copy to the
    device per forward."""
    firsts, total = [], 0
    for c in counts:
        firsts.append(total)
        total += c
    host = torch.tensor([rows, starts, counts, firsts], dtype=torch.int32)
    return host.to(device)


# -- the torch references (CPU path, oracle) -------------------------------------------------


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    meta: torch.Tensor,
) -> None:
    r, _, q, _ = key.shape
    tpb = key_cache.shape[1]
    counts = meta[2].long().cpu()
    firsts = meta[3].long().cpu()  # where each request's tokens start in the slot mapping
    req = torch.repeat_interleave(torch.arange(r), counts)
    first = torch.cumsum(counts, 0) - counts
    j = torch.arange(int(counts.sum())) - first[req]  # the token's index in its request
    cols = (q - counts)[req] + j
    slots = slot_mapping.to(key.device).long()[(firsts[req] + j).to(key.device)]
    new = slots >= 0
    req, cols, slots = req[new.cpu()], cols[new.cpu()], slots[new]
    for states, cache in ((key, key_cache), (value, value_cache)):
        cache[slots // tpb, slots % tpb] = states.transpose(1, 2)[req, cols].to(cache.dtype)


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: torch.Tensor,
    meta: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    sinks: int = 0,
    softcap: float | None = None,
    empty: int = -1,
    miss: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense attention on the history gathered through the page table (float32 softmax)."""
    r, heads, q, dim = query.shape
    kv_heads = key_cache.shape[2]
    tpb = key_cache.shape[1]
    scale = dim**-0.5 if scale is None else scale
    out = torch.zeros(r, q, heads, value_cache.shape[-1], dtype=query.dtype, device=query.device)
    m = meta.cpu().long()
    for i in range(r):
        row, start, count = int(m[0, i]), int(m[1, i]), int(m[2, i])
        end = start + count
        pos = torch.arange(end)
        pages = page_table[row, pos // tpb].long().cpu()
        qpos = torch.arange(start, end)
        allowed = pos[None, :] <= qpos[:, None]
        if window is not None:
            allowed &= (qpos[:, None] - pos[None, :] < window) | (pos[None, :] < sinks)
        needed = allowed.any(0)
        held = pages > empty
        if bool((needed & ~held).any()):
            if miss is not None:
                miss[0] = 1
            allowed &= held[None, :]
        safe = torch.where(held, pages, 0).to(key_cache.device)
        offs = (pos % tpb).to(key_cache.device)
        k = key_cache[safe, offs].float().transpose(0, 1)  # [kv_heads, end, dim]
        v = value_cache[safe, offs].float().transpose(0, 1)
        k = torch.where(held.to(k.device)[None, :, None], k, 0)
        v = torch.where(held.to(v.device)[None, :, None], v, 0)
        k = k.repeat_interleave(heads // kv_heads, 0)
        v = v.repeat_interleave(heads // kv_heads, 0)
        qi = query[i, :, q - count :].float()  # [heads, count, dim]
        s = qi @ k.transpose(1, 2) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~allowed.to(s.device)[None], float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        out[i, q - count :] = (p @ v).transpose(0, 1).to(out.dtype)
    return out


# -- Triton ------------------------------------------------------------------------------------


def triton_usable(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on these tensors: CUDA tensors with Triton installed,
    or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, for development)."""
    if _triton() is None:
        return False
    if all(t.is_cuda for t in tensors):
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and not any(t.is_cuda for t in tensors)


@functools.cache
def _triton() -> Any:
    """The module of the jitted kernels, or None without Triton (Triton is optional)."""
    try:
        from . import paged_attention_triton
    except ImportError:
        return None
    return paged_attention_triton


#: ``KVCM_TRITON_PREBOUND=0``: every launch through Triton's JIT dispatch (``kernel[grid]``).
PREBOUND = os.environ.get("KVCM_TRITON_PREBOUND", "1") != "0"


class _PreBound:
    """Launches of one jitted kernel without Triton's per-call dispatch.

    ``kernel[grid](...)`` binds the arguments, builds the specialisation key as a string, looks
    the compiled kernel up and computes launch metadata on every call: 25-50 us of host time,
    more than a decode's kernel takes on the device. Here the first launch of each
    specialisation goes through that path (it compiles, and returns the compiled kernel); the
    next ones call the compiled kernel's launcher directly with the same arguments. The key
    holds what Triton specialises on: each tensor's dtype and 16-byte alignment, each int's
    ``== 1``, ``% 16 == 0`` and 32-bit range, the constexprs and the device. With a launch hook
    set (a profiler) every launch takes the JIT path, which calls it.
    """

    __slots__ = ("compiled", "direct", "kernel", "launches")

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple[Any, ...], Any] = {}
        self.direct = PREBOUND
        #: Launches that went straight to the compiled kernel (tests read it).
        self.launches = 0

    def __call__(
        self,
        grid: tuple[int, int, int],
        args: tuple[Any, ...],
        constexprs: tuple[Any, ...],
        names: tuple[str, ...],
        tensors: int,
    ) -> None:
        device = torch.cuda.current_device()
        key = (
            device,
            constexprs,
            tuple((t.dtype, t.data_ptr() % 16 == 0) for t in args[:tensors]),
            tuple(
                None if isinstance(v, float) else (v == 1, v % 16 == 0, -(2**31) <= v < 2**31)
                for v in args[tensors:]
            ),
        )
        compiled = self.compiled.get(key) if self.direct else None
        if compiled is not None and not _hooked():
            stream = torch._C._cuda_getCurrentRawStream(device)  # noqa: SLF001
            compiled.run(
                grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                None, None, None, *args, *constexprs,
            )  # fmt: skip
            self.launches += 1
            return
        compiled = self.kernel[grid](*args, **dict(zip(names, constexprs, strict=True)))
        if self.direct and compiled is not None and hasattr(compiled, "packed_metadata"):
            self.compiled[key] = compiled


def _hooked() -> bool:
    """Whether Triton has a launch hook set (a profiler's), which only its JIT path calls: a
    hook that is not None, or (Triton 3.5 on) a ``HookChain`` with calls in it."""
    knobs = getattr(_triton().triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is None:
        return False
    hooks = (runtime.launch_enter_hook, runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


_LAUNCHERS: dict[int, _PreBound] = {}


def _launch(
    kernel: Any,
    grid: tuple[int, int, int],
    args: tuple[Any, ...],
    constexprs: tuple[Any, ...],
    names: tuple[str, ...],
    tensors: int,
) -> None:
    """Launch ``kernel`` on ``grid`` (``_PreBound``): ``args`` in its order, the first
    ``tensors`` of them tensors, then its constexprs ``names`` = ``constexprs``."""
    launcher = _LAUNCHERS.get(id(kernel))
    if launcher is None:
        launcher = _LAUNCHERS[id(kernel)] = _PreBound(kernel)
    launcher(grid, args, constexprs, names, tensors)


def launcher_of(kernel_name: str) -> _PreBound | None:
    """The pre-bound launcher of ``paged_attention_triton.<kernel_name>`` once it launched."""
    kernels = _triton()
    return None if kernels is None else _LAUNCHERS.get(id(getattr(kernels, kernel_name)))


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    meta: torch.Tensor,
) -> None:
    """Write the new keys and values ``[R, kv_heads, Q, dim]`` at ``slot_mapping`` (the
    forward's tokens, request after request; -1: not written) into the views ``[slots,
    tokens_per_block, kv_heads, dim]``. One launch for both."""
    if not triton_usable(key, key_cache, slot_mapping, meta):
        store_kv_reference(key, value, key_cache, value_cache, slot_mapping, meta)
        return
    kernels = _triton()
    r, heads, q, dim = key.shape
    v_dim = value.shape[-1]
    if r == 0 or q == 0:
        return
    assert slot_mapping.dtype == torch.int64 and slot_mapping.stride(-1) == 1
    _launch(
        kernels.store_kernel, (r, q, 1),
        (key, value, key_cache, value_cache, slot_mapping, meta, r, q,
         *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride()),
        (heads, dim, v_dim, _pow2(heads, 1), _pow2(dim, 1), _pow2(v_dim, 1), key_cache.shape[1]),
        ("KV_HEADS", "HEAD_DIM", "V_DIM", "BLOCK_H", "BLOCK_D", "BLOCK_DV", "TPB"),
        6,
    )  # fmt: skip


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: torch.Tensor,
    meta: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    sinks: int = 0,
    softcap: float | None = None,
    empty: int = -1,
    miss: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` ``[R, q_heads, Q, dim]`` (left-padded) over the paged history;
    returns ``[R, Q, q_heads, v_dim]`` (see the module docstring). ``page_table`` is the layer
    group's ``[max_requests, max_blocks]`` int32 table; ``empty`` the entry that means no page
    (-1, or 0 with the null page); ``miss`` (int32 ``[1]``) is set to 1 when a needed position
    has no page. Without Triton (or on CPU tensors outside the interpreter) the reference
    runs."""
    if not triton_usable(query, key_cache, page_table, meta):
        return paged_attention_reference(
            query, key_cache, value_cache, page_table, meta, scale=scale, window=window,
            sinks=sinks, softcap=softcap, empty=empty, miss=miss,
        )  # fmt: skip
    kernels = _triton()
    r, heads, q, dim = query.shape
    kv_heads = key_cache.shape[2]
    v_dim = value_cache.shape[-1]
    assert heads % kv_heads == 0, "query heads must be a multiple of the KV heads"
    assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1
    group = heads // kv_heads
    if out is None:
        out = torch.empty(r, q, heads, v_dim, dtype=query.dtype, device=query.device)
    if miss is None:
        miss = torch.zeros(1, dtype=torch.int32, device=query.device)
    if r == 0 or q == 0:
        return out
    windowed = window is not None
    # IEEE fp32 products for a float32 model (its tokens must be exact), not TF32.
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    block_m = BLOCK_M if q * group <= BLOCK_M else 64  # decode: one tile; prefill: 64 rows
    grid = (r, kv_heads, -(-q * group // block_m))
    _launch(
        kernels.attention_kernel, grid,
        (query, key_cache, value_cache, out, page_table, meta, miss,
         r, q, page_table.shape[-1], empty,
         dim**-0.5 if scale is None else scale, softcap or 0.0,
         window if windowed else 0, sinks if windowed else 0,
         *query.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(),
         page_table.stride(0)),
        (group, dim, v_dim, block_m, BLOCK_N, _pow2(dim), _pow2(v_dim), key_cache.shape[1],
         windowed, softcap is not None, precision),
        ("GROUP", "HEAD_DIM", "V_DIM", "BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_DV", "TPB",
         "WINDOWED", "SOFTCAP", "PRECISION"),
        7,
    )  # fmt: skip
    return out
