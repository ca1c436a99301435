"""A real model generates through kvcm (in process): every token equals transformers' own
``generate``, under continuous batching with prefix hits, chunked prefill and preemption; the
hybrids too (Qwen3-Next's gated delta nets, Granite-4.0-H's, Nemotron-H's and Falcon-H1's
Mamba-2, Jamba's Mamba-1), their recurrent state in kvcm's state slots, restored from state
checkpoints at prefix hits and, preempted by suspend, from the host tier. A model with
recurrent layers of a family the engine does not run (Zamba2, Bamba) is refused with
``UnsupportedFamily`` before it runs.

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
    STATE_PATHS,
    Backend,
    BuiltModel,
    CacheMiss,
    Engine,
    Request,
    StatePath,
    StepTables,
    UnsupportedFamily,
    build_model,
    hybrid_unsupported,
    kvcm_layers,
    make_requests,
    reference_outputs,
)

pytestmark = pytest.mark.slow  # the example engine against transformers' generate, model by model

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


# -- hybrid families: their layouts, Jamba's token-by-token chunks, refused families ----------


def _attention(layer_id: int, kv_heads: int = 2, head_dim: int = 16) -> dict:
    return {
        "layer_id": layer_id,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "kv_factor": 2,
        "dtype": "fp32",
    }


@pytest.mark.parametrize(
    "family,attention,state_ids,shapes",
    [
        # 3 gated delta nets: conv 2 * (2 key heads * 16) + 4 value heads * 16 = 128 channels,
        # recurrent [4 value heads, 16, 16].
        ("qwen3_next", [3], [0, 1, 2], {"conv": (128, 3), "recurrent": (4, 16, 16)}),
        # Mamba-2: d_inner 4 heads * 32 = 128; conv 128 + 2 * 1 group * d_state 8 = 144.
        ("granitemoehybrid", [1], [0, 2], {"conv": (144, 3), "ssm": (4, 32, 8)}),
        # "M*M-" (saved as layers_block_type, no num_hidden_layers): conv 128 + 2 * 2 * 8.
        ("nemotron_h", [1], [0, 2], {"conv": (160, 3), "ssm": (4, 32, 8)}),
        # Attention and a mixer in both layers: the mixers' states are kvcm layers 2 and 3.
        ("falcon_h1", [0, 1], [2, 3], {"conv": (144, 3), "ssm": (4, 32, 8)}),
        # Mamba-1: d_inner 2 * 64 = 128; conv [128, 4 - 1], ssm [128, d_state 8].
        ("jamba", [1], [0, 2], {"conv": (128, 3), "ssm": (128, 8)}),
    ],
)
def test_the_hybrid_families_layouts(
    family: str, attention: list[int], state_ids: list[int], shapes: dict
) -> None:
    """Each tiny hybrid's kvcm layout, from the config.json its transformers config class
    writes (so the spellings of transformers 5.x): attention layers of 2 KV heads x 16 in
    fp32, and state layers whose conv keeps kernel - 1 = 3 columns, the SSM state in fp32."""
    built = build_model(family)
    layout = kvcm_layers(built.hf_config)
    assert layout["layers"] == [_attention(i) for i in attention]
    assert [s.layer_id for s in layout["state_layers"]] == state_ids
    for spec in layout["state_layers"]:
        assert {b.name: (b.shape, b.dtype) for b in spec.buffers} == {
            name: (shape, "fp32") for name, shape in shapes.items()
        }


def test_jamba_runs_a_chunk_that_continues_a_state_token_by_token() -> None:
    """Jamba's Mamba-1 scan starts a multi-token forward from zeros: a chunk from position 0
    runs in one forward, a chunk that continues a state one forward per token. A 40-token
    prompt in chunks of 16 then 2 tokens: forwards 1 (0..15) + 16 (16..31) + 8 (32..39) + 1
    (decode) = 26. A second request with the same prompt hits the state checkpoint at 32
    (commits ended at 16, 32 and 40; the hit stays below the prompt's 40) and runs 8 + 1."""
    built = _build("jamba")
    prompt = list(range(1, 41))
    m = manager_for(built, num_blocks=200)
    engine = Engine(built, Backend.in_process(m), chunk=CHUNK, max_batch_tokens=48)
    (a,) = engine.run([Request("a", prompt, 2)])
    assert engine.stats.forwards == 26
    assert a.output == reference_outputs(built, [Request("x", prompt, 2)])["x"]
    (b,) = [r for r in engine.run([Request("b", prompt, 2)]) if r.request_id == "b"]
    assert b.hit_tokens == 32
    assert engine.stats.forwards == 26 + 8 + 1
    assert b.output == a.output


def test_jamba_without_token_by_token_chunks_generates_other_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The negative control: Jamba run as if its scan continued a cached state (one forward
    per chunk, as the gated delta net and Mamba-2 run) loses the state of every chunk after
    the first and of every prefix hit: some requests' tokens differ from transformers'."""
    built = _build("jamba")
    expected = reference_outputs(built, make_requests(16))
    monkeypatch.setitem(STATE_PATHS, "jamba", StatePath("Mamba-1", scan_continues=True))
    engine = Engine(built, Backend.in_process(manager_for(built)), chunk=CHUNK)
    got = {r.request_id: r.output for r in engine.run(make_requests(16))}
    assert sum(got[k] != expected[k] for k in expected) > 0


def _tiny(model_type: str, **fields) -> BuiltModel:
    """A tiny transformers model of a family kvcm_engine has no entry for."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=512, hidden_size=64, **fields)
    model = AutoModelForCausalLM.from_config(config).eval()
    return BuiltModel(model_type, model, {**config.to_dict(), "model_type": model_type})


@pytest.mark.parametrize(
    "built_fn,evidence",
    [
        # Mamba-2 layers and shared attention blocks ("hybrid"): it ended in a KeyError.
        (
            lambda: _tiny(
                "zamba2",
                num_hidden_layers=2,
                layers_block_type=["mamba", "hybrid"],
                num_attention_heads=4,
                mamba_d_state=8,
                n_mamba_heads=4,
                mamba_headdim=32,
            ),
            "layers_block_type has hybrid, linear_attention",  # "mamba", as Zamba2Config saves it
        ),
        (
            lambda: _tiny(
                "bamba",
                num_hidden_layers=2,
                attn_layer_indices=[1],
                num_attention_heads=4,
                num_key_value_heads=2,
                mamba_n_heads=4,
                mamba_d_head=32,
                mamba_d_state=8,
            ),
            "mamba_d_state is set",
        ),
    ],
    ids=["zamba2", "bamba"],
)
def test_a_family_whose_state_path_the_engine_lacks_is_refused(built_fn, evidence: str) -> None:
    """Not a KeyError deep in the model, nor wrong tokens: ``UnsupportedFamily``, naming the
    family, what shows its recurrent layers and the families the engine runs, from
    ``kvcm_layers`` (the in-process layout) and from the engine itself (any backend)."""
    built = built_fn()
    with pytest.raises(UnsupportedFamily) as exc:
        kvcm_layers(built.hf_config)
    assert exc.value.family == built.family and exc.value.evidence == evidence
    assert str(exc.value) == (
        f"the example engine does not run model_type {built.family!r}: it has recurrent "
        f"layers ({evidence}) and the engine implements the state of falcon_h1, "
        "granitemoehybrid, jamba, nemotron_h, qwen3_next only (besides attention-only models)"
    )
    llama = manager_for(build_model("llama"))  # whatever kvcm holds, the engine refuses
    with pytest.raises(UnsupportedFamily):
        Engine(built, Backend.in_process(llama))


def test_an_attention_model_on_a_hybrid_layout_and_a_hybrid_without_state_are_refused() -> None:
    qwen = _build("qwen3_next")
    llama = build_model("llama")
    with pytest.raises(UnsupportedFamily, match="kvcm holds state layers for it"):
        Engine(llama, Backend.in_process(manager_for(qwen)))
    with pytest.raises(ValueError, match="gated delta net layers: register it"):
        Engine(qwen, Backend.in_process(manager_for(llama)))
