"""The paged-attention path of the example engine on the CPU: the kernels' torch references
(``kvcm_kernels.paged_attention``, what the Triton kernels are checked against on the GPU, in
tests/gpu/test_paged_attention_gpu.py) against dense float64 SDPA on the history gathered
through random page tables (null page or not, windows and sinks, grouped-query attention,
decode and prefill), and the engine forced onto that path (``attention="paged"``: the
store, the attention function registered with transformers, the page tables read as they
are) generating transformers' own tokens.

``random_case`` and ``dense_attention`` are the GPU test's too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kvcm import KVCacheManager
from kvcm_engine import Backend, Engine, build_model, kvcm_layers, make_requests, reference_outputs
from kvcm_engine.cache import ATTENTION, missing_group, paged_attention_forward, register_attention
from kvcm_kernels.paged_attention import (
    paged_attention_reference,
    step_meta,
    store_kv,
    store_kv_reference,
)


@dataclass
class Case:
    """A forward's worth of paged attention: new keys/values to store, then queries."""

    query: torch.Tensor  # [R, heads, Q, dim]
    key: torch.Tensor  # [R, kv_heads, Q, dim]: the new tokens' (left-padded)
    value: torch.Tensor
    key_cache: torch.Tensor  # [slots, tpb, kv_heads, dim], NaN where nothing was written
    value_cache: torch.Tensor
    page_table: torch.Tensor  # [rows, max_blocks] int32
    meta: torch.Tensor
    slot_mapping: torch.Tensor  # [sum(counts)] int64
    rows: list[int]
    starts: list[int]
    counts: list[int]
    window: int | None
    sinks: int
    empty: int
    scale: float


def random_case(
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    tokens_per_block: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    dim: int = 16,
    window: int | None = None,
    sinks: int = 0,
    null_page: bool = True,
    max_new: int = 7,
    requests: int = 4,
    max_blocks: int = 12,
) -> Case:
    """Requests at random page-table rows, each with a random history (written at shuffled
    slots) and 1..max_new new tokens; a windowed case releases the blocks kvcm would
    (DESIGN.md section 5: ``[S, (h + 1 - W) // tpb)`` past S sink blocks). Unwritten pool
    memory is NaN, the null page (slot 0) zeros."""
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tpb = tokens_per_block
    slots = max_blocks * requests + 2
    key_cache = torch.full((slots, tpb, kv_heads, dim), float("nan"), dtype=dtype)
    value_cache = torch.full((slots, tpb, kv_heads, dim), float("nan"), dtype=dtype)
    empty = 0 if null_page else -1
    if null_page:
        key_cache[0] = value_cache[0] = 0
    free = list(range(1 if null_page else 0, slots))
    rnd.shuffle(free)
    table = torch.full((requests + 3, max_blocks), empty, dtype=torch.int32)
    rows = rnd.sample(range(requests + 3), requests)
    starts, counts = [], []
    for row in rows:
        count = rnd.randint(1, max_new)
        start = rnd.randint(0, max_blocks * tpb - count)
        for b in range(-(-(start + count) // tpb)):
            table[row, b] = free.pop()
        for p in range(start):
            s = int(table[row, p // tpb])
            key_cache[s, p % tpb] = torch.randn(kv_heads, dim, generator=gen).to(dtype)
            value_cache[s, p % tpb] = torch.randn(kv_heads, dim, generator=gen).to(dtype)
        if window is not None:
            sink_blocks = -(-sinks // tpb)
            for b in range(sink_blocks, max(sink_blocks, (start + 1 - window) // tpb)):
                table[row, b] = empty
        starts.append(start)
        counts.append(count)
    q = max(counts)
    mapping = [
        int(table[row, p // tpb]) * tpb + p % tpb
        for row, start, count in zip(rows, starts, counts, strict=True)
        for p in range(start, start + count)
    ]
    return Case(
        query=torch.randn(requests, heads, q, dim, generator=gen).to(dtype).to(device),
        key=torch.randn(requests, kv_heads, q, dim, generator=gen).to(dtype).to(device),
        value=torch.randn(requests, kv_heads, q, dim, generator=gen).to(dtype).to(device),
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        page_table=table.to(device),
        meta=step_meta(rows, starts, counts, device),
        slot_mapping=torch.tensor(mapping, dtype=torch.int64, device=device),
        rows=rows,
        starts=starts,
        counts=counts,
        window=window,
        sinks=sinks,
        empty=empty,
        scale=dim**-0.5 * rnd.uniform(0.5, 2.0),
    )


def dense_attention(case: Case, softcap: float | None = None) -> torch.Tensor:
    """The oracle, float64 on the CPU: each request's keys and values as a dense sequence
    (history from the pools as they were, then its new tokens), SDPA with a boolean mask
    (causal, the window, the sinks); padding rows zero. ``[R, Q, heads, dim]``."""
    r, heads, q, dim = case.query.shape
    tpb = case.key_cache.shape[1]
    kv_heads = case.key_cache.shape[2]
    out = torch.zeros(r, q, heads, dim, dtype=torch.float64)
    table = case.page_table.cpu()
    kc, vc = case.key_cache.cpu().double(), case.value_cache.cpu().double()
    for i, (row, start, count) in enumerate(zip(case.rows, case.starts, case.counts, strict=True)):
        pos = torch.arange(start)
        pages = table[row, pos // tpb].long()
        keys = torch.cat(
            [kc[pages, pos % tpb], case.key[i, :, q - count :].cpu().double().transpose(0, 1)]
        )
        values = torch.cat(
            [vc[pages, pos % tpb], case.value[i, :, q - count :].cpu().double().transpose(0, 1)]
        )
        kpos = torch.arange(start + count)
        qpos = torch.arange(start, start + count)
        allowed = kpos[None, :] <= qpos[:, None]
        if case.window is not None:
            allowed &= (qpos[:, None] - kpos[None, :] < case.window) | (kpos[None, :] < case.sinks)
        # Positions no query sees may hold anything (a released page): zero them.
        seen = allowed.any(0)[:, None, None]
        keys, values = torch.where(seen, keys, 0), torch.where(seen, values, 0)
        k = keys.transpose(0, 1).repeat_interleave(heads // kv_heads, 0)  # [heads, L, dim]
        v = values.transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        qi = case.query[i, :, q - count :].cpu().double()
        if softcap is None:
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=allowed, scale=case.scale)
        else:
            s = torch.tanh(qi @ k.transpose(1, 2) * case.scale / softcap) * softcap
            o = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v
        out[i, q - count :] = o.transpose(0, 1)
    return out


def stored(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools after ``store_kv_reference`` of the case's new tokens."""
    kc, vc = case.key_cache.clone(), case.value_cache.clone()
    store_kv_reference(case.key, case.value, kc, vc, case.slot_mapping, case.meta)
    return kc, vc


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.cpu().double(), ref.cpu().double()
    return float((out - ref).norm() / ref.norm())


CASES = [
    # (tokens_per_block, heads, kv_heads, window, sinks, null_page, max_new)
    (4, 4, 2, None, 0, True, 1),  # decode, GQA 2
    (4, 4, 2, None, 0, False, 7),  # prefill, no null page (-1 entries)
    (16, 8, 8, None, 0, True, 20),  # MHA, chunk across blocks
    (4, 6, 2, 8, 0, True, 1),  # window, released blocks, GQA 3
    (4, 4, 1, 9, 4, True, 12),  # window and sinks, MQA
    (16, 8, 2, 20, 16, False, 33),  # window and a sink block, no null page
]


@pytest.mark.parametrize(("tpb", "heads", "kv_heads", "window", "sinks", "null_page", "new"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_equals_dense_attention(
    tpb: int,
    heads: int,
    kv_heads: int,
    window: int | None,
    sinks: int,
    null_page: bool,
    new: int,
    dtype: torch.dtype,
) -> None:
    for seed in range(3):
        case = random_case(
            seed, dtype=dtype, tokens_per_block=tpb, heads=heads, kv_heads=kv_heads,
            window=window, sinks=sinks, null_page=null_page, max_new=new,
        )  # fmt: skip
        kc, vc = stored(case)
        miss = torch.zeros(1, dtype=torch.int32)
        out = paged_attention_reference(
            case.query, kc, vc, case.page_table, case.meta, scale=case.scale,
            window=window, sinks=sinks, empty=case.empty, miss=miss,
        )  # fmt: skip
        assert int(miss) == 0
        assert not out.isnan().any()
        assert rel_error(out, dense_attention(case)) < (1e-6 if dtype == torch.float32 else 2e-3)


def test_reference_softcap() -> None:
    case = random_case(5, max_new=5)
    kc, vc = stored(case)
    out = paged_attention_reference(
        case.query, kc, vc, case.page_table, case.meta, scale=case.scale, softcap=2.0
    )
    assert rel_error(out, dense_attention(case, softcap=2.0)) < 1e-6


def test_store_writes_the_slot_mapping_and_skips_minus_one() -> None:
    case = random_case(3, max_new=6)
    case.slot_mapping[0] = -1  # a token whose block a window released
    kc, vc = case.key_cache.clone(), case.value_cache.clone()
    store_kv(case.key, case.value, kc, vc, case.slot_mapping, case.meta)  # the reference here
    q, tpb = case.query.shape[2], kc.shape[1]
    t = 0
    for i, count in enumerate(case.counts):
        for c in range(q - count, q):
            slot = int(case.slot_mapping[t])
            t += 1
            if slot < 0:
                continue
            assert torch.equal(kc[slot // tpb, slot % tpb], case.key[i, :, c])
            assert torch.equal(vc[slot // tpb, slot % tpb], case.value[i, :, c])
    written = case.slot_mapping[case.slot_mapping >= 0]
    untouched = torch.ones(kc.shape[0] * tpb, dtype=torch.bool)
    untouched[written] = False
    flat = kc.reshape(-1, *kc.shape[2:])
    assert torch.equal(
        flat[untouched].nan_to_num(7.0),
        case.key_cache.reshape(-1, *kc.shape[2:])[untouched].nan_to_num(7.0),
    )


def test_a_missing_page_is_flagged() -> None:
    """Position 4..7's block is gone: a query at 13 needs it without a window, and with a
    window of 8 (positions 6..13) too; a window of 6 (8..13) does not."""
    tpb, dim = 4, 16
    kc, vc = torch.randn(10, tpb, 2, dim), torch.randn(10, tpb, 2, dim)
    table = torch.tensor([[3, 0, 5, 6, 0, 0]], dtype=torch.int32)
    meta = step_meta([0], [13], [1], "cpu")
    q = torch.randn(1, 4, 1, dim)
    for window, flagged in ((None, 1), (8, 1), (6, 0)):
        miss = torch.zeros(1, dtype=torch.int32)
        paged_attention_reference(q, kc, vc, table, meta, window=window, empty=0, miss=miss)
        assert int(miss) == flagged, window
    assert missing_group([0, 0]) is None and missing_group([0, 1]) == 1


# -- the engine on the paged path (the kernels' references on the CPU) -------------------------


def _manager(built, null_page: bool = True, **settings: object) -> KVCacheManager:
    """The engine tests' manager (``settings`` added: a host tier, say), its unwritten
    memory NaN."""
    m = KVCacheManager(
        {
            **kvcm_layers(built.hf_config),
            "tokens_per_block": 4,
            "num_blocks": 48,
            "max_requests": 16,
            "max_seq_len": 256,
            "max_prefill_chunk": 16,
            "null_page": null_page,
            **settings,
        }
    )
    for spec in m.config.layers:  # unwritten memory must never enter attention
        for role in ("key", "value")[: spec.kv_factor]:
            m.layer_view(spec.layer_id, role)[1 if null_page else 0 :] = float("nan")
    return m


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "null_page"),
    [("llama", True), ("mistral", False), ("gemma3", True), ("qwen2", True)],
)
def test_engine_on_the_paged_path_equals_generate(family: str, null_page: bool) -> None:
    """Prefix hits, chunked prefill, preemption, windows (Mistral; Gemma 3's sliding and full
    layers in two kvcm groups): every token equals transformers' generate."""
    built = build_model(family)
    m = _manager(built, null_page)
    engine = Engine(built, Backend.in_process(m), chunk=16, max_batch_tokens=48, attention="paged")
    assert engine.attention == "paged"
    done = engine.run(make_requests(16))
    assert {r.request_id: r.output for r in done} == reference_outputs(built, make_requests(16))
    assert engine.scheduler.stats.hit_tokens > 0
    assert engine.scheduler.stats.preemptions > 0
    # The model's configs name their own attention again after every forward.
    assert built.model.config._attn_implementation != ATTENTION


def test_attention_choice() -> None:
    """auto: the gather on the CPU, and always for MLA (DeepSeek's key-only latent);
    paged is refused for MLA."""
    llama = build_model("llama")
    assert Engine(llama, Backend.in_process(_manager(llama))).attention == "gather"
    deepseek = build_model("deepseek_v3")
    backend = Backend.in_process(_manager(deepseek))
    assert Engine(deepseek, backend).attention == "gather"
    with pytest.raises(ValueError, match="MLA"):
        Engine(deepseek, backend, attention="paged")
    with pytest.raises(ValueError, match="auto, paged or gather"):
        Engine(llama, Backend.in_process(_manager(llama)), attention="flash")  # type: ignore[arg-type]


def test_the_registered_attention_is_sdpa_outside_a_paged_forward() -> None:
    """transformers' generate on a model whose config names ``kvcm_paged`` (it never does
    outside the engine's forward, but another thread might see it) runs SDPA."""
    built = build_model("llama")
    requests = make_requests(2)
    expected = reference_outputs(built, requests)
    register_attention()
    saved = built.model.config._attn_implementation
    built.model.config._attn_implementation = ATTENTION
    try:
        assert reference_outputs(built, requests) == expected
    finally:
        built.model.config._attn_implementation = saved
    assert callable(paged_attention_forward)
