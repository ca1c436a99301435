"""The paged-attention kernels (``kvcm_kernels.paged_attention``, Triton) on CUDA: against
dense float64 SDPA on the history gathered through random page tables (null page or -1
entries, windows with released blocks and sinks, grouped-query attention, decode and
prefill, fp32, fp16 and bf16; the output poisoned first, unwritten pool memory NaN), the
fused store against its reference, the missing-page flag; then the example engine on the
kernel: float32 tokens equal transformers' ``generate``, float16 ones too except at near-ties
(below)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_paged_attention import CASES, dense_attention, random_case, rel_error, stored

from kvcm import KVCacheManager
from kvcm_engine import (
    HYBRIDS,
    Backend,
    Engine,
    build_model,
    hybrid_unsupported,
    kvcm_layers,
    make_requests,
    reference_outputs,
)
from kvcm_kernels.paged_attention import (
    paged_attention,
    step_meta,
    store_kv,
    store_kv_reference,
    triton_usable,
)

DEVICE = "cuda:0"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not triton_usable(torch.zeros(1, device="cuda")),
    reason="needs CUDA and Triton",
)


def _attend(case, key_cache, value_cache, softcap=None):
    r, heads, q, dim = case.query.shape
    out = torch.full((r, q, heads, dim), float("nan"), dtype=case.query.dtype, device=DEVICE)
    miss = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    paged_attention(
        case.query, key_cache, value_cache, case.page_table, case.meta, scale=case.scale,
        window=case.window, sinks=case.sinks, softcap=softcap, empty=case.empty, miss=miss,
        out=out,
    )  # fmt: skip
    torch.cuda.synchronize()
    return out, int(miss)


@pytest.mark.parametrize(("tpb", "heads", "kv_heads", "window", "sinks", "null_page", "new"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_equals_dense_attention(
    tpb: int,
    heads: int,
    kv_heads: int,
    window: int | None,
    sinks: int,
    null_page: bool,
    new: int,
    dtype: torch.dtype,
) -> None:
    for seed in range(4):
        case = random_case(
            seed, dtype=dtype, device=DEVICE, tokens_per_block=tpb, heads=heads,
            kv_heads=kv_heads, window=window, sinks=sinks, null_page=null_page, max_new=new,
        )  # fmt: skip
        kc, vc = case.key_cache.clone(), case.value_cache.clone()
        store_kv(case.key, case.value, kc, vc, case.slot_mapping, case.meta)  # the kernel
        out, miss = _attend(case, kc, vc)
        assert miss == 0
        assert not out.isnan().any(), "an output element was not written (or NaN leaked in)"
        assert rel_error(out, dense_attention(case)) < TOLERANCE[dtype], (seed, dtype)


@pytest.mark.parametrize("dim", [64, 128, 80])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kernel_head_dims_and_long_histories(dim: int, dtype: torch.dtype) -> None:
    """Model-sized heads (80: not a power of two), 16-token blocks, histories of hundreds
    of tokens, decode and 64-token chunks, 16 requests."""
    for seed, new in ((0, 1), (1, 64)):
        case = random_case(
            seed, dtype=dtype, device=DEVICE, tokens_per_block=16, heads=16, kv_heads=8,
            dim=dim, max_new=new, requests=16, max_blocks=24,
        )  # fmt: skip
        kc, vc = stored(case)
        out, miss = _attend(case, kc, vc)
        assert miss == 0 and not out.isnan().any()
        assert rel_error(out, dense_attention(case)) < TOLERANCE[dtype]


def test_kernel_softcap() -> None:
    case = random_case(7, device=DEVICE, max_new=9)
    kc, vc = stored(case)
    out, _ = _attend(case, kc, vc, softcap=3.0)
    assert rel_error(out, dense_attention(case, softcap=3.0)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kernel_equals_reference(dtype: torch.dtype) -> None:
    case = random_case(11, dtype=dtype, device=DEVICE, max_new=9, requests=6)
    case.slot_mapping[1] = -1  # released by a window: not written
    expected_k, expected_v = case.key_cache.clone(), case.value_cache.clone()
    store_kv_reference(case.key, case.value, expected_k, expected_v, case.slot_mapping, case.meta)
    kc, vc = case.key_cache.clone(), case.value_cache.clone()
    store_kv(case.key, case.value, kc, vc, case.slot_mapping, case.meta)
    assert torch.equal(kc.nan_to_num(7.0), expected_k.nan_to_num(7.0))
    assert torch.equal(vc.nan_to_num(7.0), expected_v.nan_to_num(7.0))


def test_kernel_flags_a_missing_page() -> None:
    tpb, dim = 4, 16
    kc = torch.randn(10, tpb, 2, dim, device=DEVICE)
    vc = torch.randn(10, tpb, 2, dim, device=DEVICE)
    table = torch.tensor([[3, 0, 5, 6, 0, 0]], dtype=torch.int32, device=DEVICE)
    meta = step_meta([0], [13], [1], DEVICE)
    q = torch.randn(1, 4, 1, dim, device=DEVICE)
    for window, flagged in ((None, 1), (8, 1), (6, 0)):
        miss = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        out = paged_attention(q, kc, vc, table, meta, window=window, empty=0, miss=miss)
        assert int(miss) == flagged, window
        assert not out.isnan().any()


# -- the engine on the kernel ------------------------------------------------------------------

SIZING = {
    "tokens_per_block": 4,
    "num_blocks": 48,
    "max_requests": 16,
    "max_seq_len": 256,
    "max_prefill_chunk": 16,
}


def _engine(built, null_page: bool = True) -> Engine:
    m = KVCacheManager(
        {**kvcm_layers(built.hf_config), "device": DEVICE, **SIZING, "null_page": null_page}
    )
    for spec in m.config.layers:  # unwritten memory must never enter attention
        for role in ("key", "value")[: spec.kv_factor]:
            m.layer_view(spec.layer_id, role)[1 if null_page else 0 :] = float("nan")
    engine = Engine(built, Backend.in_process(m), chunk=16, max_batch_tokens=48)
    assert engine.attention == "paged"  # auto on CUDA
    return engine


@pytest.mark.parametrize(
    ("family", "null_page"),
    [
        ("llama", True),
        ("qwen2", True),
        ("mistral", True),
        ("mistral", False),
        ("gemma3", True),
        ("qwen3_next", True),
        ("jamba", True),
    ],
)
def test_engine_on_the_kernel_equals_generate(family: str, null_page: bool) -> None:
    """float32: every token equals transformers' generate (one request at a time, its dense
    cache), under prefix hits, chunked prefill and preemption."""
    if family in HYBRIDS and (why := hybrid_unsupported()) is not None:
        pytest.skip(why)
    built = build_model(family, device=DEVICE)
    engine = _engine(built, null_page)
    done = engine.run(make_requests(16))
    assert {r.request_id: r.output for r in done} == reference_outputs(built, make_requests(16))
    assert engine.scheduler.stats.hit_tokens > 0
    assert engine.scheduler.stats.preemptions > 0


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_engine_on_the_kernel_float16_near_ties(family: str) -> None:
    """float16: a request's tokens equal generate's, or they first differ at a near-tie. The
    rule: at the first differing token, the float32 logits (the same weights, upcast) of the
    two tokens differ by no more than twice the float16 model's own largest logit error
    there; two float16 computations that sum in different orders (the kernel's online softmax
    and generate's SDPA, other batch shapes) may pick either of two tokens that close. A
    wrong key or value moves logits far more (the gain of models.py), and every request
    is checked."""
    built = build_model(family, device=DEVICE, dtype=torch.float16)
    model32 = copy.deepcopy(built.model).float()
    engine = _engine(built)
    requests = make_requests(16)
    done = {r.request_id: r.output for r in engine.run(requests)}
    expected = reference_outputs(built, make_requests(16))
    exact, ties = 0, []
    for r in requests:
        got, want = done[r.request_id], expected[r.request_id]
        if got == want:
            exact += 1
            continue
        j = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        ids = torch.tensor([r.prompt + want[:j]], device=DEVICE)
        with torch.no_grad():
            l16 = built.model(ids).logits[0, -1].float()
            l32 = model32(ids).logits[0, -1].float()
        error = float((l16 - l32).abs().max())
        gap = float((l32[want[j]] - l32[got[j]]).abs())
        ties.append((r.request_id, j, round(gap, 4), round(error, 4)))
        assert gap <= 2 * error, f"{r.request_id} differs at token {j}: not a near-tie {ties}"
    print(f"{family} float16: {exact}/16 exact, near-ties (id, token, gap, error): {ties}")
