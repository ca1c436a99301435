"""A real model generates through kvcm (in process): every token equals transformers' own
``generate``, under continuous batching with prefix hits, chunked prefill and preemption; a
hybrid (Qwen3-Next) too, its recurrent state in kvcm's state slots, restored from state
checkpoints at prefix hits and, preempted by suspend, from the host tier.

The oracle is transformers itself: ``reference_outputs`` runs ``model.generate`` (greedy, its
own dense cache) on each prompt alone; the engine runs all 16 requests interleaved on kvcm.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcm import KVCacheManager
from kvcm_engine import (
    FAMILIES,
    HYBRIDS,
    Backend,
    CacheMiss,
    Engine,
    Request,
    StepTables,
    build_model,
    hybrid_unsupported,
    kvcm_layers,
    make_requests,
    reference_outputs,
)

CHUNK = 16


def manager_for(
    built, num_blocks: int = 48, tokens_per_block: int = 4, null_page: bool = True
) -> KVCacheManager:
    return KVCacheManager(
        {
            **kvcm_layers(built.hf_config),
            "tokens_per_block": tokens_per_block,
            "num_blocks": num_blocks,
            "max_requests": 16,
            "max_seq_len": 256,
            "max_prefill_chunk": CHUNK,
            "null_page": null_page,
        }
    )


def _build(family: str):
    """The family's model; a hybrid is skipped where transformers cannot run it on kvcm."""
    if family in HYBRIDS and (why := hybrid_unsupported()) is not None:
        pytest.skip(why)
    return build_model(family)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def built(request):
    return _build(request.param)


@pytest.fixture(scope="module")
def expected(built):
    return reference_outputs(built, make_requests(16))


def test_tokens_equal_transformers_generate(built, expected) -> None:
    """16 requests of 8 to 100 tokens arriving over time, half with a shared 40-token system
    prompt, chunk 16, and a pool of 47 usable blocks of 4 tokens: less than two of the longest
    requests need, so the engine preempts; every token still equals transformers'."""
    requests = make_requests(16)
    assert max(len(r.prompt) for r in requests) > CHUNK > min(len(r.prompt) for r in requests)
    m = manager_for(built)
    # Uninitialised pool memory must not leak into attention: start from NaN everywhere but
    # the null page.
    for spec in m.config.layers:
        for role in ("key", "value")[: spec.kv_factor]:
            m.layer_view(spec.layer_id, role)[1:] = float("nan")
    engine = Engine(built, Backend.in_process(m), chunk=CHUNK, max_batch_tokens=48)
    done = engine.run(requests)
    assert [r.request_id for r in done] == sorted(expected)
    assert {r.request_id: r.output for r in done} == expected
    stats = engine.scheduler.stats
    assert stats.hit_tokens > 0
    assert stats.preemptions > 0
    assert (
        sum(len(r.output) for r in done)
        == engine.stats.tokens_generated
        == sum(len(v) for v in expected.values())
    )
    # Every request was freed: the pool is whole again, its blocks cached for reuse.
    assert m.request_ids() == []
    assert m.num_free_blocks() == m.num_total_blocks()


def test_without_the_null_page_masked_columns_are_zeroed() -> None:
    """No null page: columns past a request's end read a real slot, here full of NaN; the
    cache zeroes them, and the tokens stay exact."""
    built = build_model("mistral")
    expected = reference_outputs(built, make_requests(16))
    m = manager_for(built, null_page=False)
    for spec in m.config.layers:
        m.layer_view(spec.layer_id, "key")[:] = float("nan")
        m.layer_view(spec.layer_id, "value")[:] = float("nan")
    engine = Engine(built, Backend.in_process(m), chunk=CHUNK, max_batch_tokens=48)
    assert {r.request_id: r.output for r in engine.run(make_requests(16))} == expected
    assert engine.scheduler.stats.preemptions > 0


def _hit_outputs(built, corrupt: Callable[[KVCacheManager], None]) -> dict[bool, list[int]]:
    """A request's prompt run twice: the second request hits the first one's prefix; its
    tokens with kvcm's memory as it is (False) and after ``corrupt`` (True)."""
    prompt = make_requests(1)[0].prompt
    outputs = {}
    for corrupted in (False, True):
        m = manager_for(built, num_blocks=200)
        engine = Engine(built, Backend.in_process(m), chunk=CHUNK, max_batch_tokens=48)
        engine.run([Request("a", prompt, 8)])
        if corrupted:
            corrupt(m)
        second = engine.run([Request("b", prompt, 8)])
        b = next(r for r in second if r.request_id == "b")
        assert b.hit_tokens == (len(prompt) - 1) // 4 * 4
        outputs[corrupted] = b.output
    assert outputs[False] == reference_outputs(built, [Request("x", prompt, 8)])["x"]
    return outputs


def test_prefix_hit_reads_the_cached_kv(built) -> None:
    """The negative control: a second request with the same prompt reuses the first one's
    blocks (a prefix hit); with those blocks' KV zeroed in the pool its tokens change, so the
    hit tokens are read from kvcm's memory, not recomputed."""

    def zero_keys(m: KVCacheManager) -> None:
        for spec in m.config.layers:
            m.layer_view(spec.layer_id, "key").zero_()

    outputs = _hit_outputs(built, zero_keys)
    assert outputs[True] != outputs[False]


def test_a_hybrid_prefix_hit_restores_the_state_checkpoint() -> None:
    """The same for a hybrid's state: the second request's gated delta nets start from the
    state checkpoint kvcm saved at the hit; with the checkpoint slots overwritten its tokens
    change, so the hit's state is kvcm's checkpoint, not recomputed."""
    built = _build("qwen3_next")

    def overwrite_checkpoints(m: KVCacheManager) -> None:
        live = m.config.num_state_live_slots
        for spec in m.config.state_layers:
            m.state_view(spec.layer_id, "recurrent")[live:] = 0.5

    outputs = _hit_outputs(built, overwrite_checkpoints)
    assert outputs[True] != outputs[False]


def test_a_hybrid_preempted_to_the_host_tier_generates_the_same_tokens() -> None:
    """Preemption by suspend (``preempt="suspend"``): the victim's blocks and its gated delta
    nets' live state go to kvcm's host tier and come back at its resume, with 4 live state
    slots for the 16 rows (new requests wait for one); every token equals transformers'."""
    built = _build("qwen3_next")
    m = KVCacheManager(
        {
            **kvcm_layers(built.hf_config),
            "tokens_per_block": 4,
            "num_blocks": 48,
            "max_requests": 16,
            "max_seq_len": 256,
            "max_prefill_chunk": CHUNK,
            "state_live_slots": 4,
            "host_memory_bytes": 1 << 20,
        }
    )
    est = m.estimate(16)  # 4 blocks a request: 12 fit the pool, 4 the live state slots
    assert (est.max_requests, est.limited_by) == (4, "state_slots")
    engine = Engine(
        built, Backend.in_process(m), chunk=CHUNK, max_batch_tokens=48, preempt="suspend"
    )
    done = engine.run(make_requests(16))
    assert {r.request_id: r.output for r in done} == reference_outputs(built, make_requests(16))
    stats = engine.scheduler.stats
    assert stats.suspends > 0 and stats.resumes == stats.suspends
    host = m.host_stats()
    assert host["offloaded_states"] == host["onboarded_states"] == stats.suspends
    assert m.request_ids() == [] and m.num_free_blocks() == m.num_total_blocks()


def test_the_sidecar_backend_refuses_fewer_live_state_slots_than_rows() -> None:
    """Over the sidecar the engine reads a request's state slot as its row, which kvcm
    guarantees only with one live state slot per row."""
    from servers import serve_in_thread

    from kvcm.server.app import create_app
    from kvcm_client import KVCacheClient

    built = _build("qwen3_next")
    with serve_in_thread(create_app(None)) as url, KVCacheClient(url) as client:
        client.register_model(
            hf_config=built.hf_config,
            share=True,
            num_blocks=48,
            max_requests=16,
            state_live_slots=8,
        )
        with pytest.raises(ValueError, match="state_live_slots"):
            Backend.sidecar(client)


def test_step_tables_worked_example() -> None:
    """The cache.py docstring's example: tokens_per_block 4, a request with 6 cached tokens
    computing 2 in a batch of width 3 beside a new 3-token request; one full-attention group
    and one window-2 group whose block 0 is released (the null page, 0)."""
    tables = torch.zeros((2, 4, 8), dtype=torch.int32)
    tables[:, 1, :2] = torch.tensor([9, 5], dtype=torch.int32)  # row 1: positions 0..7
    tables[1, 1, 0] = 0  # released by the window
    tables[:, 2, 0] = 7  # row 2: the new request's block
    slots = torch.tensor([[22, 23, 28, 29, 30], [22, 23, 28, 29, 30]])
    t = StepTables.build(tables, slots, [1, 2], [6, 0], [2, 3], [None, 2], 4, True, torch.float32)
    full, win = t.groups
    # Columns past a request's end read the null page (slot 0, offset 0).
    assert full.read_blocks.tolist() == [[9] * 4 + [5] * 4, [7] * 3 + [0] * 5]
    assert full.read_offsets.tolist() == [[0, 1, 2, 3] * 2, [0, 1, 2] + [0] * 5]
    assert full.read_keep is None
    plain = StepTables.build(
        tables, slots, [1, 2], [6, 0], [2, 3], [None, 2], 4, False, torch.float32
    )
    keep = plain.groups[0].read_keep
    assert keep is not None and keep[..., 0, 0].tolist() == [[True] * 8, [True] * 3 + [False] * 5]
    # Left padding: request 0's queries are columns 1, 2 (positions 6, 7).
    assert full.write_rows.tolist() == [0, 0, 1, 1, 1]
    assert full.write_cols.tolist() == [1, 2, 0, 1, 2]
    assert full.write_blocks.tolist() == [5, 5, 7, 7, 7]
    assert full.write_offsets.tolist() == [2, 3, 0, 1, 2]
    assert (full.mask[0, 0] == 0).tolist() == [
        [True] + [False] * 7,  # a padding column sees column 0 only (no all-masked row)
        [True] * 7 + [False],
        [True] * 8,
    ]
    assert (full.mask[1, 0] == 0).tolist() == [
        [True] + [False] * 7,
        [True, True] + [False] * 6,
        [True] * 3 + [False] * 5,
    ]
    # Window 2 from position 6 - 2 + 1 = 5: request 0's columns are positions 5, 6, 7.
    assert win.read_blocks.tolist() == [[5, 5, 5], [7, 7, 7]]
    assert win.read_offsets.tolist() == [[1, 2, 3], [0, 1, 2]]
    assert (win.mask[0, 0] == 0).tolist() == [
        [True, False, False],
        [True, True, False],
        [False, True, True],
    ]
    assert (win.mask[1, 0] == 0).tolist() == [
        [True, False, False],
        [True, True, False],
        [False, True, True],
    ]


def test_cache_miss_when_a_needed_page_is_gone() -> None:
    """A page the model needs but kvcm does not hold is refused, not read as zeros."""
    tables = torch.zeros((1, 2, 4), dtype=torch.int32)
    tables[0, 0, :2] = torch.tensor([3, 0], dtype=torch.int32)  # block 1 missing
    slots = torch.tensor([[-1]])
    with pytest.raises(CacheMiss, match="position 4"):
        StepTables.build(tables, slots, [0], [5], [1], [None], 4, True, torch.float32)
    tables[0, 0, 1] = 6
    StepTables.build(tables, torch.tensor([[25]]), [0], [5], [1], [None], 4, True, torch.float32)


def test_a_request_that_cannot_fit_alone_is_an_error_not_a_hang() -> None:
    built = build_model("llama")
    m = manager_for(built, num_blocks=4)  # 3 usable blocks of 4 tokens
    engine = Engine(built, Backend.in_process(m), chunk=CHUNK, max_batch_tokens=48)
    with pytest.raises(RuntimeError, match="req-000 does not fit the pool"):
        engine.run([Request("req-000", list(range(1, 41)), 4)])
    assert m.request_ids() == []
