"""The Triton kernels of ``paged_attention`` (imported only where Triton is installed; the
module docstring of ``paged_attention`` describes them)."""

from __future__ import annotations

import triton
import triton.language as tl

#: Per-forward sizes, not specialised on (a value of 1 or a multiple of 16 would otherwise
#: compile the kernel again for each: decode, batch sizes, chunk widths).
_SIZES = ["num_requests", "num_cols"]


@triton.jit(do_not_specialize=_SIZES)
def store_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    meta_ptr,
    num_requests,
    num_cols,
    s_kb,
    s_kh,
    s_km,
    s_kd,
    s_vb,
    s_vh,
    s_vm,
    s_vd,
    s_kcp,
    s_kct,
    s_kch,
    s_kcd,
    s_vcp,
    s_vct,
    s_vch,
    s_vcd,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    TPB: tl.constexpr,
):
    i = tl.program_id(0)
    col = tl.program_id(1)
    count = tl.load(meta_ptr + 2 * num_requests + i)
    first = tl.load(meta_ptr + 3 * num_requests + i)
    pad = num_cols - count
    t = first + col - pad
    live = col >= pad
    slot = tl.load(slots_ptr + tl.where(live, t, 0), mask=live, other=-1).to(tl.int64)
    ok = live & (slot >= 0)
    page = slot // TPB
    off = slot % TPB
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    m = ok & (h < KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + i * s_kb + h * s_kh + col * s_km + d * s_kd, mask=m)
    kc = kc_ptr + page * s_kcp + off * s_kct + h * s_kch + d * s_kcd
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=m)
    dv = tl.arange(0, BLOCK_DV)[None, :]
    mv = ok & (h < KV_HEADS) & (dv < V_DIM)
    v = tl.load(v_ptr + i * s_vb + h * s_vh + col * s_vm + dv * s_vd, mask=mv)
    vc = vc_ptr + page * s_vcp + off * s_vct + h * s_vch + dv * s_vcd
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _tile(
    acc,
    m_i,
    l_i,
    q,
    qpos,
    row_ok,
    n0,
    lo,
    hi,
    kc_ptr,
    vc_ptr,
    table_row_ptr,
    miss_ptr,
    kv_head,
    max_blocks,
    empty,
    qk_scale,
    softcap,
    window,
    sinks,
    s_kcp,
    s_kct,
    s_kch,
    s_kcd,
    s_vcp,
    s_vct,
    s_vch,
    s_vcd,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    TPB: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pos = n0 + tl.arange(0, BLOCK_N)
    # Positions some row of the program needs: [lo, hi) and the sinks.
    inside = (pos < hi) & ((pos >= lo) | (pos < sinks))
    block = pos // TPB
    page = tl.load(table_row_ptr + block, mask=inside & (block < max_blocks), other=empty).to(
        tl.int64
    )
    held = page > empty
    allowed = row_ok[:, None] & (pos[None, :] <= qpos[:, None]) & inside[None, :]
    if WINDOWED:
        allowed &= ((qpos[:, None] - pos[None, :]) < window) | (pos[None, :] < sinks)
    needed = tl.max(allowed.to(tl.int32), axis=0) > 0
    tl.store(miss_ptr + pos * 0, tl.full([BLOCK_N], 1, tl.int32), mask=needed & ~held)
    allowed &= held[None, :]
    load = inside & held
    off = pos % TPB
    d = tl.arange(0, BLOCK_D)
    k = tl.load(
        kc_ptr
        + page[:, None] * s_kcp
        + off[:, None] * s_kct
        + kv_head * s_kch
        + d[None, :] * s_kcd,
        mask=load[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    ).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    s = s * qk_scale
    if SOFTCAP:
        # softcap * tanh(s / softcap), tanh(x) = 2 sigmoid(2x) - 1
        s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    dv = tl.arange(0, BLOCK_DV)
    v = tl.load(
        vc_ptr
        + page[:, None] * s_vcp
        + off[:, None] * s_vct
        + kv_head * s_vch
        + dv[None, :] * s_vcd,
        mask=load[:, None] & (dv[None, :] < V_DIM),
        other=0.0,
    ).to(q.dtype)
    pv = tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit(do_not_specialize=[*_SIZES, "max_blocks", "empty", "window", "sinks"])
def attention_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    o_ptr,
    table_ptr,
    meta_ptr,
    miss_ptr,
    num_requests,
    num_cols,
    max_blocks,
    empty,
    qk_scale,
    softcap,
    window,
    sinks,
    s_qb,
    s_qh,
    s_qm,
    s_qd,
    s_kcp,
    s_kct,
    s_kch,
    s_kcd,
    s_vcp,
    s_vct,
    s_vch,
    s_vcd,
    s_ob,
    s_om,
    s_oh,
    s_od,
    s_tr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    TPB: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    row = tl.load(meta_ptr + i).to(tl.int64)
    start = tl.load(meta_ptr + num_requests + i)
    count = tl.load(meta_ptr + 2 * num_requests + i)
    pad = num_cols - count
    mm = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    col = mm // GROUP
    head = kv_head * GROUP + mm % GROUP
    in_range = mm < num_cols * GROUP
    row_ok = in_range & (col >= pad)
    qpos = start + col - pad
    d = tl.arange(0, BLOCK_D)
    q = tl.load(
        q_ptr + i * s_qb + head[:, None] * s_qh + col[:, None] * s_qm + d[None, :] * s_qd,
        mask=row_ok[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    hi = tl.max(tl.where(row_ok, qpos, -1), axis=0) + 1  # 0: no query row here
    q_min = tl.min(tl.where(row_ok, qpos, 2147483647), axis=0)
    table_row_ptr = table_ptr + row * s_tr
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    first = hi * 0
    lo = hi * 0
    if WINDOWED:
        lo = tl.minimum(tl.maximum(q_min - window + 1, 0), hi)
        sink_hi = tl.minimum(lo, sinks)
        for n0 in range(0, sink_hi, BLOCK_N):
            acc, m_i, l_i = _tile(
                acc, m_i, l_i, q, qpos, row_ok, n0, lo, hi, kc_ptr, vc_ptr, table_row_ptr,
                miss_ptr, kv_head, max_blocks, empty, qk_scale, softcap, window, sinks,
                s_kcp, s_kct, s_kch, s_kcd, s_vcp, s_vct, s_vch, s_vcd,
                HEAD_DIM, V_DIM, BLOCK_N, BLOCK_D, BLOCK_DV, TPB, WINDOWED, SOFTCAP, PRECISION,
            )  # fmt: skip
        # The sink tiles cover positions up to their end, window positions included.
        first = tl.maximum((lo // BLOCK_N) * BLOCK_N, tl.cdiv(sink_hi, BLOCK_N) * BLOCK_N)
    for n0 in range(first, hi, BLOCK_N):
        acc, m_i, l_i = _tile(
            acc, m_i, l_i, q, qpos, row_ok, n0, lo, hi, kc_ptr, vc_ptr, table_row_ptr,
            miss_ptr, kv_head, max_blocks, empty, qk_scale, softcap, window, sinks,
            s_kcp, s_kct, s_kch, s_kcd, s_vcp, s_vct, s_vch, s_vcd,
            HEAD_DIM, V_DIM, BLOCK_N, BLOCK_D, BLOCK_DV, TPB, WINDOWED, SOFTCAP, PRECISION,
        )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dv = tl.arange(0, BLOCK_DV)
    o = o_ptr + i * s_ob + col[:, None] * s_om + head[:, None] * s_oh + dv[None, :] * s_od
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=in_range[:, None] & (dv[None, :] < V_DIM))
