"""State layers (docs/state-layers.md): specs, exactly sized state groups, a live slot per
request, checkpoints on commit boundaries, prefix hits restored from them, rewinds refused
past them, and a toy recurrent model run through the state views against the same model
run without kvcm."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from state_consumer import ToyRecurrence

from kvcm import KVCacheManager
from kvcm.state_pools import build_state_groups
from kvcm_client.errors import (
    InvalidArgument,
    InvalidRewind,
    OutOfBlocks,
    RequestLimitReached,
    StateNotRewindable,
    UnknownLayer,
    status_of,
)
from kvcm_client.state import StateLayerSpec

TPB = 4
ATTN = [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8, "dtype": "fp32"}]


def _state_layer(layer_id: int, d: int = 4, k: int = 3, **kw: object) -> dict[str, object]:
    """A toy state layer: a convolution window of k - 1 inputs and a d x d recurrent state."""
    return {
        "layer_id": layer_id,
        "buffers": [
            {"name": "conv", "shape": [d, k - 1], "dtype": "fp32"},
            {"name": "ssm", "shape": [d, d], "dtype": "fp32"},
        ],
        **kw,
    }


def _manager(**kw: object) -> KVCacheManager:
    cfg: dict[str, object] = {
        "layers": ATTN,
        "state_layers": [_state_layer(1)],
        "tokens_per_block": TPB,
        "num_blocks": 32,
        "max_requests": 4,
        "max_seq_len": 64,
    }
    cfg.update(kw)
    return KVCacheManager(cfg)


# -- specs and layout ---------------------------------------------------------------------------


def test_specs_refuse_bad_buffers_and_shared_layer_ids() -> None:
    with pytest.raises(ValidationError, match="duplicate_state_buffer"):
        StateLayerSpec.model_validate(
            {"layer_id": 1, "buffers": [{"name": "a", "shape": [2]}, {"name": "a", "shape": [3]}]}
        )
    with pytest.raises(ValidationError, match="state_buffer_name"):
        StateLayerSpec.model_validate({"layer_id": 1, "buffers": [{"name": "A", "shape": [2]}]})
    with pytest.raises(ValidationError):
        StateLayerSpec.model_validate({"layer_id": 1, "buffers": [{"name": "a", "shape": [0]}]})
    with pytest.raises(ValidationError):
        StateLayerSpec.model_validate({"layer_id": 1, "buffers": []})
    with pytest.raises(ValidationError, match="duplicate_layer_id"):
        _manager(state_layers=[_state_layer(0)])


def test_a_group_slot_is_its_buffers_back_to_back_16_byte_aligned() -> None:
    # The worked example of build_state_groups: conv [8, 3] bf16 = 48 bytes, ssm [2, 4, 16]
    # fp32 = 512 bytes, layers 1 and 3: offsets 0, 48, 560, 608, a 1120-byte slot.
    spec = {
        "buffers": [
            {"name": "conv", "shape": [8, 3]},
            {"name": "ssm", "shape": [2, 4, 16], "dtype": "fp32"},
        ]
    }
    specs = [StateLayerSpec.model_validate({"layer_id": i, **spec}) for i in (1, 3)]
    (group,) = build_state_groups(specs)
    assert [(b.layer_id, b.name, b.offset) for b in group.buffers] == [
        (1, "conv", 0),
        (1, "ssm", 48),
        (3, "conv", 560),
        (3, "ssm", 608),
    ]
    assert (group.slot_bytes, group.state_bytes) == (1120, 1120)
    # A draft layer, or one without reuse, is another group.
    draft = StateLayerSpec.model_validate({"layer_id": 5, "owner": "draft", **spec})
    assert [g.layers for g in build_state_groups([*specs, draft])] == [(1, 3), (5,)]


def test_mamba2_sized_state_is_within_5_percent_of_its_bytes() -> None:
    # Nemotron-H-8B-like Mamba-2 layer: conv_dim 4096 + 2 x 8 x 128 = 6144, d_conv 4 (3 kept),
    # bf16; ssm 128 heads x 64 x 128, fp32. 52 such layers.
    layers = [
        {
            "layer_id": i,
            "buffers": [
                {"name": "conv", "shape": [6144, 3], "dtype": "bf16"},
                {"name": "ssm", "shape": [128, 64, 128], "dtype": "fp32"},
            ],
        }
        for i in range(1, 53)
    ]
    m = _manager(state_layers=layers, max_requests=2, state_checkpoints=1)
    (group,) = m.parts.state.groups  # type: ignore[union-attr]
    theoretical = 52 * (6144 * 3 * 2 + 128 * 64 * 128 * 4)
    assert group.state_bytes == theoretical and group.slot_bytes <= 1.05 * theoretical
    est = m.estimate(16)
    assert est.state_bytes == 3 * group.slot_bytes  # 2 live slots and 1 checkpoint
    assert est.state_groups[0].layer_ids == tuple(range(1, 53))


def test_memory_bytes_pays_for_the_state_and_the_estimate_holds() -> None:
    """The state's bytes come out of the budget first; the KV pools get the rest, and the
    estimate's N fit and N + 1 do not."""
    state = [_state_layer(1, d=16)]  # 16 x 2 x 4 + 16 x 16 x 4 = 1152 bytes a slot
    kv_block = 2 * 8 * 4 * TPB  # one fp32 key/value head of 8 per token
    m = _manager(
        state_layers=state,
        num_blocks=None,
        memory_bytes=8 * 1152 + 40 * kv_block,
        max_requests=4,
        state_checkpoints=4,
    )
    assert m.estimate(8).state_bytes == 8 * 1152
    assert m.num_total_blocks() == 40
    est = m.estimate(32)  # 8 blocks each: 5 fit the pools, but only 4 rows exist
    assert (est.max_requests, est.limited_by) == (4, "max_requests")
    for i in range(4):
        m.allocate(f"r{i}", 32)
    with pytest.raises(RequestLimitReached):
        m.allocate("r4", 32)
    m2 = _manager(state_layers=state, num_blocks=None, memory_bytes=8 * 1152 + 20 * kv_block)
    est = m2.estimate(32)
    assert est.max_requests == 2
    m2.allocate("a", 32)
    m2.allocate("b", 32)
    with pytest.raises(OutOfBlocks):
        m2.allocate("c", 32)
    with pytest.raises(Exception, match="state layers"):
        _manager(state_layers=state, num_blocks=None, memory_bytes=8 * 1152)


# -- requests -----------------------------------------------------------------------------------


def test_a_new_request_starts_from_zeros_in_the_slot_of_its_row() -> None:
    m = _manager()
    ssm = m.state_view(1, "ssm")
    assert ssm.shape == (8, 4, 4) and ssm.dtype == torch.float32  # 4 live, 4 checkpoints
    a = m.allocate("a", 5)
    assert m.state_indices(["a"]).tolist() == [a.row]
    ssm[a.row] = 3.0
    m.free("a")
    b = m.allocate("b", 5)
    assert b.row == a.row and not ssm[b.row].any()
    with pytest.raises(UnknownLayer):
        m.state_view(1, "nope")
    with pytest.raises(InvalidArgument):
        m.state_indices(["b"], group=1)


def _commit_in_blocks(m: KVCacheManager, rid: str, tokens: list[int], value: float) -> None:
    """Commit block by block, the state set to value + the committed length each time (what
    an engine's chunked prefill leaves there)."""
    ssm = m.state_view(1, "ssm")
    row = m.request(rid).row
    done = m.request(rid).num_committed
    for end in range(done + TPB, len(tokens) + TPB, TPB):
        end = min(end, len(tokens))
        ssm[row] = value + end
        m.commit(rid, tokens[done:end])
        done = end


def test_commits_on_block_boundaries_save_checkpoints_and_a_hit_restores_them() -> None:
    m = _manager()
    ssm = m.state_view(1, "ssm")
    prompt = list(range(10))  # 2 full blocks and 2 tokens
    m.allocate("a", 10, token_ids=prompt)
    _commit_in_blocks(m, "a", prompt, 100)  # checkpoints at 4 and 8, not at 10
    assert m.parts.state.saves == 2 and m.parts.state.num_saved(0) == 2  # type: ignore[union-attr]
    assert m.probe(prompt) == 8
    b = m.allocate("b", 10, token_ids=prompt)
    assert b.num_hit_tokens == 8 and (ssm[b.row] == 108).all()
    c = m.allocate("c", 7, token_ids=prompt[:7])  # one full block of its own: hits 4
    assert c.num_hit_tokens == 4 and (ssm[c.row] == 104).all()
    # A commit of a whole prompt at once lands at 10: no checkpoint at 8 for that prompt.
    other = list(range(50, 60))
    m.allocate("d", 10, token_ids=other)
    m.commit("d", other)
    assert m.probe(other) == 0 and m.parts.state.saves == 2  # type: ignore[union-attr]


def test_a_step_makes_its_state_copies_in_one_batch() -> None:
    """Three commits that each end on a block boundary save three checkpoints: one batch (a
    gather-scatter per group), made before the step answers."""
    m = _manager()
    ssm = m.state_view(1, "ssm")
    prompts = [list(range(100 * i, 100 * i + 9)) for i in range(3)]
    handles = []
    for i in range(3):
        info = m.allocate(f"r{i}", 9)
        ssm[info.row] = float(i + 1)
        handles.append(info.handle)
    st = m.parts.state
    assert st is not None
    before = st.batches
    out = m.step_columns(commit=handles, commit_tokens=[p[:4] for p in prompts])
    assert out.status["commit"].tolist() == [0, 0, 0]
    assert (st.batches - before, st.saves) == (1, 3)
    for i, p in enumerate(prompts):  # each checkpoint holds its own request's state
        hit = m.allocate(f"h{i}", 5, token_ids=p[:5])
        assert hit.num_hit_tokens == 4 and (ssm[hit.row] == i + 1).all()
        m.free(f"h{i}")


def test_hits_land_on_multiples_of_the_stride() -> None:
    m = _manager(state_checkpoint_stride=2)
    prompt = list(range(14))  # 3 full blocks
    m.allocate("a", 14, token_ids=prompt)
    _commit_in_blocks(m, "a", prompt, 0)
    assert m.parts.state.saves == 1  # type: ignore[union-attr]  # at 8 only (2 blocks)
    assert m.allocate("b", 14, token_ids=prompt).num_hit_tokens == 8  # not 12


def test_checkpoints_are_evicted_least_recently_used() -> None:
    m = _manager(state_checkpoints=1)
    p, q = list(range(9)), list(range(100, 109))
    m.allocate("a", 9, token_ids=p)
    _commit_in_blocks(m, "a", p[:8], 0)  # checkpoints at 4 then 8: only 8 stays
    assert m.probe(p) == 8 and m.probe(p[:5]) == 0
    m.allocate("b", 9, token_ids=q)
    _commit_in_blocks(m, "b", q[:8], 0)
    assert m.probe(p) == 0 and m.probe(q) == 8
    m.free("a")
    m.free("b")
    m.reset_prefix_cache()
    assert m.probe(q) == 0 and m.parts.state.num_saved(0) == 0  # type: ignore[union-attr]


def test_rewinds_go_back_to_a_checkpoint_or_the_start_or_are_refused() -> None:
    m = _manager()
    ssm = m.state_view(1, "ssm")
    prompt = list(range(12))
    a = m.allocate("a", 12, token_ids=prompt)
    _commit_in_blocks(m, "a", prompt[:10], 0)  # committed 10, checkpoints at 4 and 8
    m.extend("a", 2)  # 14 tokens, 10 committed: drafts
    m.rewind("a", 3)  # to 11 >= 10 committed: the state is untouched
    assert (ssm[a.row] == 10).all()
    with pytest.raises(StateNotRewindable) as err:
        m.rewind("a", 2)  # to 9: no checkpoint there
    assert err.value.code == "state_not_rewindable" and err.value.status == 409
    assert m.request("a").num_tokens == 11 and (ssm[a.row] == 10).all()  # nothing changed
    m.rewind("a", 3)  # to 8: the checkpoint
    assert m.request("a").num_committed == 8 and (ssm[a.row] == 8).all()
    with pytest.raises(InvalidArgument, match="all-or-nothing"), m.transaction():
        m.rewind("a", 4)  # would restore state: its copy cannot be undone
    assert m.request("a").num_tokens == 8 and (ssm[a.row] == 8).all()
    m.rewind("a", 4)  # to 4
    assert (ssm[a.row] == 4).all() and m.request("a").num_committed == 4


def test_the_columnar_step_reports_a_refused_rewind_as_its_status() -> None:
    m = _manager()
    prompt = list(range(10))
    a = m.allocate("a", 10, token_ids=prompt)
    m.commit("a", prompt)  # 10 at once: no checkpoint at 8 or 4
    out = m.step_columns(rewind=[a.handle], rewind_tokens=[3])
    assert out.status["rewind"].tolist() == [status_of("state_not_rewindable")]
    (item,) = out.errors
    assert (item.section, item.index, type(item.error)) == ("rewind", 0, StateNotRewindable)
    assert m.request("a").num_tokens == 10


def test_a_service_registers_a_hybrid_model_and_answers_its_errors() -> None:
    import httpx
    from servers import serve_in_thread

    from kvcm.server.app import create_app
    from kvcm_client import KVCacheClient

    with serve_in_thread(create_app(None)) as url, KVCacheClient(url) as kv:
        kv.register_model(
            layers=ATTN,
            state_layers=[_state_layer(1)],
            tokens_per_block=TPB,
            num_blocks=16,
            max_requests=2,
            max_seq_len=32,
            state_checkpoints=2,
        )
        assert kv.estimate(8).state_bytes == 4 * 96  # (2 + 2) slots of 32 + 64 bytes
        kv.allocate("a", 6)
        kv.commit("a", [1, 2, 3, 4, 5, 6])
        with pytest.raises(StateNotRewindable):
            kv.rewind("a", 1)
        # One live state slot for the two rows, and a host tier for suspended states.
        kv.free("a")
        kv.register_model(
            layers=ATTN,
            state_layers=[_state_layer(1)],
            tokens_per_block=TPB,
            num_blocks=16,
            max_requests=2,
            max_seq_len=32,
            state_live_slots=1,
            host_memory_bytes=1 << 14,
        )
        assert kv.allocate("a", 6).state_slot == 0
        with pytest.raises(OutOfBlocks):
            kv.allocate("b", 6)
        assert kv.suspend("a").state_slot == -1
        assert kv.allocate("b", 6).state_slot == 0
        with pytest.raises(OutOfBlocks):
            kv.resume("a")
        kv.free("b")
        assert kv.resume("a").state_slot == 0
        host = kv.stats().host_tier
        assert host is not None and (host.offloaded_states, host.onboarded_states) == (1, 1)
        assert host.state_host_slots == {0: 2} and host.state_host_used == {0: 0}
        text = httpx.get(f"{url}/metrics").text
        assert "kvcm_host_onboarded_states_total 1.0" in text
        assert 'kvcm_host_state_slots{state_group="0"} 2.0' in text


def test_a_hybrid_hf_config_registers_with_its_state_layers() -> None:
    """A registration by Hugging Face config (``POST /v1/model``, ``kvcm serve
    --model-config``) of a hybrid family gets its state layers (kvcm.hf_state)."""
    import json
    from pathlib import Path

    path = Path(__file__).parent / "fixtures" / "models" / "nemotron-h-8b-base-8k.json"
    m = _manager()
    m.register_model(
        hf_config=json.loads(path.read_text()),
        num_blocks=8,
        max_requests=2,
        max_seq_len=256,
        state_checkpoints=0,
    )
    assert (len(m.config.layers), len(m.config.state_layers)) == (4, 24)
    # 24 Mamba-2 layers: conv (128 x 64 + 2 x 8 x 128) x 3 bf16, ssm 128 x 64 x 128 fp32.
    per_layer = (128 * 64 + 2 * 8 * 128) * 3 * 2 + 128 * 64 * 128 * 4
    assert m.estimate(64).state_bytes == 2 * 24 * per_layer


def test_an_undone_step_puts_back_the_state_of_the_rows_it_wrote() -> None:
    """An all-or-nothing step that frees a request, starts another in its row (zeroing it, or
    restoring a checkpoint into it), then fails: the undo gives the first request its row
    back, and its state as it was."""
    m = _manager(state_layers=[_state_layer(1)], max_requests=2)
    ssm = m.state_view(1, "ssm")
    p = list(range(6))
    a = m.allocate("a", 6, token_ids=p)
    ssm[a.row] = 7.0
    m.commit("a", p[:4])  # a checkpoint at 4 (7.0)
    ssm[a.row] = 9.0  # the engine ran two more tokens
    bad = {"op": "extend", "request_id": "nope", "num_new_tokens": 1}
    for allocate in (
        {"op": "allocate", "request_id": "b", "num_tokens": 5},  # zeroes the row
        {"op": "allocate", "request_id": "b", "num_tokens": 6, "token_ids": p},  # restores
    ):
        results = m.step([{"op": "free", "request_id": "a"}, allocate, bad], atomic=True)
        assert not any(r.ok for r in results) and m.request_ids() == ["a"]
        assert m.request("a").row == a.row and (ssm[a.row] == 9.0).all()
    out = m.step_columns(
        free=[a.handle],
        allocate=[{"request_id": "c", "num_tokens": 5}, {"request_id": "d", "num_tokens": 500}],
        atomic=True,
    )
    assert out.failed is not None and (ssm[a.row] == 9.0).all()


def test_a_rewind_the_window_refuses_leaves_the_state() -> None:
    """The state's checkpoint exists, but the sliding window released blocks the rewind
    needs: InvalidRewind, and the state is not restored either."""
    m = _manager(
        layers=[{**ATTN[0], "sliding_window": 8}], state_layers=[_state_layer(1)], max_requests=2
    )
    ssm = m.state_view(1, "ssm")
    p = list(range(21))
    a = m.allocate("a", 21, token_ids=p)
    _commit_in_blocks(m, "a", p, 0)  # checkpoints at 4 ... 20
    m.extend("a", 1)
    with pytest.raises(InvalidRewind):
        m.rewind("a", 6)  # to 16: a checkpoint, but blocks the window released
    assert m.request("a").num_tokens == 22 and (ssm[a.row] == 21).all()


def test_a_group_without_checkpoints_refuses_rewinds_below_the_committed_length() -> None:
    for states in (
        [_state_layer(1, reuse="none")],
        [_state_layer(1), _state_layer(2, reuse="none")],
    ):
        m = _manager(state_layers=states)
        ssm = m.state_view(1, "ssm")
        p = list(range(12))
        a = m.allocate("a", 12, token_ids=p)
        _commit_in_blocks(m, "a", p, 0)
        with pytest.raises(StateNotRewindable):
            m.rewind("a", 4)
        assert m.request("a").num_tokens == 12 and (ssm[a.row] == 12).all()
    # A group without reuse holds no checkpoint slots: live slots only.
    assert m.state_view(2, "ssm").shape[0] == 4 and m.state_view(1, "ssm").shape[0] == 8


def test_a_budget_too_small_names_the_whole_budget_and_what_it_needs() -> None:
    state = [_state_layer(1, d=16)]  # 1152-byte slots: 8 of them, 9216 bytes
    kv_block = 2 * 8 * 4 * TPB
    with pytest.raises(Exception, match="memory_bytes=9728 cannot hold") as err:
        _manager(state_layers=state, num_blocks=None, memory_bytes=8 * 1152 + 2 * kv_block)
    # One 64-token request needs 16 blocks: 16 x 256 + the state's 9216 bytes.
    assert err.value.detail["needed_bytes"] == 16 * kv_block + 8 * 1152  # type: ignore[attr-defined]


def test_the_host_tier_onboards_nothing_past_the_last_checkpoint() -> None:
    m = _manager(num_blocks=6, host_memory_bytes=1 << 14)
    prompt = list(range(17))
    m.allocate("a", 17, token_ids=prompt)
    m.commit("a", prompt)  # 17 at once: blocks published, no checkpoint
    m.free("a")
    m.allocate("x", 24)  # the blocks go to the host
    m.free("x")
    assert m.probe_tiers(prompt) == (0, 0) and m.probe(prompt) == 0
    m.allocate("b", 17, token_ids=prompt)
    assert m.host_stats()["onboarded_blocks"] == 0


def test_a_group_without_reuse_never_gets_a_hit() -> None:
    m = _manager(state_layers=[_state_layer(1, reuse="none")])
    prompt = list(range(9))
    m.allocate("a", 9, token_ids=prompt)
    _commit_in_blocks(m, "a", prompt, 0)
    assert m.probe(prompt) == 0 and m.allocate("b", 9, token_ids=prompt).num_hit_tokens == 0


def test_hybrid_models_hit_as_much_as_pure_attention_below_528_tokens() -> None:
    """vLLM pads a hybrid model's attention pages to the state's size (528+ tokens), so
    shorter prompts never hit. Here: the same random workload of shared-prefix prompts of
    16 to 520 tokens, committed in 16-token chunks, on a pure-attention manager and on the
    same manager with a Mamba-like state layer: every allocate hits exactly as much."""
    rng = np.random.default_rng(0)
    cfg: dict[str, object] = {
        "layers": ATTN,
        "tokens_per_block": 16,
        "num_blocks": 2048,
        "max_requests": 8,
        "max_seq_len": 1024,
    }
    pure = KVCacheManager(cfg)
    # As many checkpoint slots as blocks: one per published block (stride 1).
    hybrid = KVCacheManager(
        {**cfg, "state_layers": [_state_layer(1, d=16)], "state_checkpoints": 2048}
    )
    bases = [rng.integers(0, 1000, 520).tolist() for _ in range(6)]
    hits = []
    for i in range(60):
        base = bases[int(rng.integers(0, 6))]
        n = int(rng.integers(16, 521))
        prompt = base[: int(rng.integers(0, n + 1))] + rng.integers(0, 1000, 520).tolist()
        prompt = prompt[:n]
        got = []
        for m in (pure, hybrid):
            info = m.allocate(f"r{i}", n, token_ids=prompt)
            for start in range(info.num_hit_tokens, n, 16):
                m.commit(f"r{i}", prompt[start : start + 16])
            got.append(info.num_hit_tokens)
            m.free(f"r{i}")
        assert got[0] == got[1], (i, n, got)
        hits.append(got[0])
    assert sum(h > 0 for h in hits) > 20 and max(hits) > 256


# -- live slots, suspend and resume (the host tier) ------------------------------------------------


def _suspending(**kw: object) -> KVCacheManager:
    """4 rows, 2 live state slots, a host tier: 8384 host bytes over the device's 32 KV slots
    of 256 bytes and 2 live state slots of 96 bytes (8384 bytes) give 32 host KV slots and
    2 host state slots (checkpoints stay on the device)."""
    cfg: dict[str, object] = {"state_live_slots": 2, "host_memory_bytes": 8384}
    cfg.update(kw)
    return _manager(**cfg)


def test_suspend_moves_the_state_to_the_host_and_resume_into_a_free_live_slot() -> None:
    m = _suspending()
    conv, ssm = m.state_view(1, "conv"), m.state_view(1, "ssm")
    assert ssm.shape[0] == 2 + 4  # 2 live slots, then 4 checkpoints
    a, b = m.allocate("a", 5), m.allocate("b", 5)  # 2 blocks each
    assert (a.row, a.state_slot, b.row, b.state_slot) == (0, 0, 1, 1)
    with pytest.raises(OutOfBlocks) as err:
        m.allocate("c", 5)  # a row is free, a live state slot is not: nothing changes
    assert err.value.detail == {"request_id": "c", "state_live_slots": 2, "free": 0}  # type: ignore[attr-defined]
    assert m.request_ids() == ["a", "b"] and m.num_free_blocks() == 28
    conv[0], ssm[0] = 3.0, 7.0
    assert m.suspend("a").state_slot == -1 and m.num_free_blocks() == 30
    assert m.host_stats()["state_host_used"] == {0: 1}
    c = m.allocate("c", 5)  # row 2 has no slot of its own: the lowest free, a's, zeroed
    assert (c.row, c.state_slot) == (2, 0) and not conv[0].any() and not ssm[0].any()
    ssm[0] = 9.0
    with pytest.raises(OutOfBlocks):
        m.resume("a")  # its blocks would fit, a live state slot does not: nothing changes
    assert m.request("a").state_slot == -1 and m.num_free_blocks() == 28
    assert m.parts.host is not None and m.parts.host.held[0] == 2
    assert m.host_stats()["state_host_used"] == {0: 1}
    m.free("b")
    back = m.resume("a")  # row 0's own slot is c's: the lowest free one, b's
    assert back.state_slot == 1 and m.state_indices(["a", "c"]).tolist() == [1, 0]
    assert (conv[1] == 3.0).all() and (ssm[1] == 7.0).all() and (ssm[0] == 9.0).all()
    stats = m.host_stats()
    assert (stats["offloaded_states"], stats["onboarded_states"]) == (1, 1)
    assert stats["state_host_slots"] == {0: 2} and stats["state_host_used"] == {0: 0}
    m.free("a")
    m.free("c")
    assert m.parts.state is not None and m.parts.state.num_free_live == 2


def test_a_suspend_without_a_free_host_state_slot_changes_nothing() -> None:
    m = _suspending(host_memory_bytes=4192)  # half: 16 host KV slots, 1 host state slot
    m.allocate("a", 5)
    b = m.allocate("b", 5)
    m.suspend("a")
    with pytest.raises(OutOfBlocks) as err:
        m.suspend("b")
    assert err.value.detail["tier"] == "host"  # type: ignore[attr-defined]
    assert m.request("b").state_slot == b.state_slot == 1
    assert m.block_table("b") == [[2, 3]] and m.num_free_blocks() == 30
    m.free("a")  # a suspended request freed: its host state slot too
    assert m.host_stats()["state_host_used"] == {0: 0}
    m.suspend("b")
    assert m.host_stats()["state_host_used"] == {0: 1}


def test_the_estimate_counts_live_state_slots_and_host_state_slots() -> None:
    """Fewer live slots than rows limit how many requests run: the estimate's N fit and
    N + 1 do not; the host holds ``host_max_requests`` suspended, one more is refused."""
    m = _suspending(host_memory_bytes=4192)
    est = m.estimate(8)
    assert (est.max_requests, est.limited_by, est.host_max_requests) == (2, "state_slots", 1)
    group = est.state_groups[0]
    assert (group.live_slots, group.checkpoint_slots, group.host_slots) == (2, 4, 1)
    assert est.state_bytes == (2 + 4) * 96
    for i in range(2):
        m.allocate(f"r{i}", 8)
    with pytest.raises(OutOfBlocks):
        m.allocate("r2", 8)
    m.suspend("r0")
    with pytest.raises(OutOfBlocks):
        m.suspend("r1")
    with pytest.raises(ValidationError, match="state_live_slots"):
        _manager(state_live_slots=5)  # more than the 4 rows


@pytest.mark.parametrize("deferred", [False, True])
def test_a_slot_suspended_and_reused_in_one_step_keeps_each_state(deferred: bool) -> None:
    """A step's state copies and the tier's copies of the same live slot happen in the
    step's order, also with the tier's copies deferred to the op's end (as on CUDA): the
    host gets a request's state after the step's restore, not before it; a new request's
    zeroing of the slot comes after the copy out; a checkpoint of a slot comes before a
    resume's copy into it."""
    m = _suspending(state_live_slots=1)
    assert m.parts.host is not None
    m.parts.host.copier.immediate = not deferred
    ssm = m.state_view(1, "ssm")
    p = list(range(6))
    a = m.allocate("a", 6, token_ids=p)
    _commit_in_blocks(m, "a", p, 100)  # a checkpoint at 4 (104); the live state is 106
    # Rewind to 4 (its checkpoint is restored), suspend, and "b" takes the live slot.
    out = m.step_columns(
        rewind=[a.handle],
        rewind_tokens=2,
        suspend=[a.handle],
        allocate=[{"request_id": "b", "num_tokens": 5}],
    )
    assert out.ok and m.request("b").state_slot == 0 and not ssm[0].any()
    m.free("b")
    assert m.resume("a").state_slot == 0 and (ssm[0] == 104).all()
    # Suspended, and a new request zeroes the slot.
    ssm[0] = 5.0
    results = m.step(
        [
            {"op": "suspend", "request_id": "a"},
            {"op": "allocate", "request_id": "c", "num_tokens": 5},
        ]
    )
    assert all(r.ok for r in results) and not ssm[0].any()
    # c ran a block: committed (a checkpoint), c freed and a resumed into its slot.
    ssm[0] = 6.0
    out = m.step_columns(
        commit=[m.request("c").handle],
        commit_tokens=[[9, 9, 9, 9]],
        free=[m.request("c").handle],
        resume=[a.handle],
    )
    assert out.ok and (ssm[0] == 5.0).all()
    m.suspend("a")
    assert m.allocate("d", 5, token_ids=[9, 9, 9, 9, 1]).num_hit_tokens == 4
    assert (ssm[0] == 6.0).all()  # the checkpoint c's commit saved


def test_an_undone_step_gives_back_the_live_slots_it_took() -> None:
    m = _suspending(state_live_slots=1)
    bad = {"op": "extend", "request_id": "nope", "num_new_tokens": 1}
    results = m.step([{"op": "allocate", "request_id": "a", "num_tokens": 5}, bad], atomic=True)
    assert not any(r.ok for r in results)
    assert m.parts.state is not None and m.parts.state.num_free_live == 1
    assert m.allocate("b", 5).state_slot == 0


# -- a toy recurrent model through the state views ----------------------------------------------


def test_a_toy_recurrent_model_through_kvcm_equals_it_without() -> None:
    """Chunked prefill, decode, a prefix hit restored from a checkpoint, and a preemption
    (free, then recompute with a hit): the state kvcm keeps is bit for bit the state of the
    whole sequence run from zeros."""
    model = ToyRecurrence()
    m = _manager(num_blocks=64, max_seq_len=64)
    conv, ssm = m.state_view(1, "conv"), m.state_view(1, "ssm")

    def serve(rid: str, prompt: list[int], decode: list[int]) -> int:
        info = m.allocate(rid, len(prompt), token_ids=prompt)
        row = info.row
        for start in range(info.num_hit_tokens, len(prompt), TPB):  # chunked prefill
            chunk = prompt[start : start + TPB]
            model.run(conv[row], ssm[row], chunk)
            m.commit(rid, chunk)
        for t in decode:
            m.extend(rid, 1)
            model.run(conv[row], ssm[row], [t])
            m.commit(rid, [t])
        want = model.reference(prompt + decode)
        assert torch.equal(conv[row], want[0]) and torch.equal(ssm[row], want[1]), rid
        return info.num_hit_tokens

    prompt = list(range(100, 121))
    assert serve("a", prompt, [5, 6, 7]) == 0
    assert serve("b", [*prompt, 9], [1]) == 20  # restored from the checkpoint at 20
    m.free("a")  # preempted: recomputed from the longest checkpointed prefix
    # a committed 24 tokens (a checkpoint there); a hit keeps the last token to compute.
    assert serve("a2", [*prompt, 5, 6, 7, 8], [9]) == 24


@contextmanager
def _consumer(m: KVCacheManager) -> Iterator[Callable[[int, list[int]], None]]:
    """The toy recurrence in a process of its own (``state_consumer.py``), which maps the
    manager's shared state through ``kvcm_client.attach``; yields ``run(slot, tokens)``."""
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "state_consumer.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    stdin, stdout = child.stdin, child.stdout

    def run(slot: int, tokens: list[int]) -> None:
        stdin.write(" ".join(map(str, [slot, *tokens])) + "\n")
        stdin.flush()
        assert stdout.readline().strip() == "ok"

    try:
        stdin.write(m.pools().model_dump_json() + "\n")
        stdin.flush()
        assert stdout.readline().strip() == "attached"
        yield run
    finally:
        stdin.close()
        child.wait(10)


@pytest.mark.slow
def test_a_consumer_process_runs_the_model_on_the_shared_state() -> None:
    """The same, with the model in a process of its own that maps the state through
    ``kvcm_client.attach`` (POSIX shared memory): the scheduler here allocates and commits,
    the consumer writes the state, and a prefix hit's restored checkpoint is what it reads."""
    model = ToyRecurrence()
    m = _manager(num_blocks=64, share=True)
    try:
        with _consumer(m) as run:
            conv, ssm = m.state_view(1, "conv"), m.state_view(1, "ssm")
            prompt = list(range(200, 213))
            for rid in ("a", "b"):
                info = m.allocate(rid, len(prompt), token_ids=prompt)
                for start in range(info.num_hit_tokens, len(prompt), TPB):
                    run(info.state_slot, prompt[start : start + TPB])
                    m.commit(rid, prompt[start : start + TPB])
                want = model.reference(prompt)
                slot = info.state_slot
                assert torch.equal(conv[slot], want[0]) and torch.equal(ssm[slot], want[1])
            assert m.request("b").num_hit_tokens == 12
    finally:
        m.close()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["in_process", "consumer_process"])
def test_the_toy_recurrence_survives_a_suspend_while_others_fill_the_device(where: str) -> None:
    """Prefill "a", suspend it to the host, fill the device with two other requests (every
    KV block and both live state slots, one of them a's old slot, their states run by the
    model), resume "a" once one is freed (into the other slot), decode: every state is bit
    for bit the recurrence run without kvcm; in process, and from a consumer process."""
    model = ToyRecurrence()
    m = _manager(
        num_blocks=12, state_live_slots=2, host_memory_bytes=1 << 14, share=where != "in_process"
    )
    conv, ssm = m.state_view(1, "conv"), m.state_view(1, "ssm")

    def check(rid: str, tokens: list[int]) -> None:
        slot = m.request(rid).state_slot
        want = model.reference(tokens)
        assert torch.equal(conv[slot], want[0]) and torch.equal(ssm[slot], want[1]), rid

    def serve(run: Callable[[int, list[int]], None]) -> None:
        def prefill(rid: str, prompt: list[int]) -> None:
            info = m.allocate(rid, len(prompt), token_ids=prompt)
            for start in range(info.num_hit_tokens, len(prompt), TPB):
                run(info.state_slot, prompt[start : start + TPB])
                m.commit(rid, prompt[start : start + TPB])

        prompt = list(range(100, 113))  # 4 blocks
        prefill("a", prompt)
        m.suspend("a")
        others = {"x": list(range(200, 224)), "y": list(range(300, 324))}  # 6 blocks each
        for rid, tokens in others.items():
            prefill(rid, tokens)
        assert m.num_free_blocks() == 0 and m.state_indices(["x", "y"]).tolist() == [1, 0]
        with pytest.raises(OutOfBlocks):
            m.resume("a")
        m.free("x")
        assert m.resume("a").state_slot == 1  # y holds a's old slot 0
        decode = [5, 6, 7]
        for t in decode:
            m.extend("a", 1)
            run(m.request("a").state_slot, [t])
            m.commit("a", [t])
        check("a", prompt + decode)
        check("y", others["y"])
        assert m.host_stats()["offloaded_blocks"] > 0  # a's cached blocks were evicted too

    if where == "in_process":
        serve(lambda slot, tokens: model.run(conv[slot], ssm[slot], tokens))
        return
    try:
        with _consumer(m) as run:
            serve(run)
    finally:
        m.close()


def test_an_allocate_in_a_step_zeroes_a_suspended_request_s_slot_after_its_copy_out() -> None:
    """One op step: a suspend of x (its live slot's copy out queued, deferred as on CUDA),
    an allocate that takes x's slot (its zeroing queued), then a resume in a later piece
    (whose state flush would make the zeroing first). The allocate settles as the single op
    does, so x comes back with its state."""
    m = _suspending(state_live_slots=2)
    m.parts.host.copier.immediate = False  # as on CUDA: the tier's copies wait for a settle
    ssm = m.state_view(1, "ssm")
    m.allocate("x", 5)
    m.allocate("z", 5)
    m.suspend("z")
    ssm[0] = 7.0  # x's state, in live slot 0
    results = m.step(
        [
            {"op": "suspend", "request_id": "x"},
            {"op": "allocate", "request_id": "y", "num_tokens": 5},
            {"op": "resume", "request_id": "z"},
        ]
    )
    assert [r.ok for r in results] == [True, True, True] and m.request("y").state_slot == 0
    m.free("y")
    m.free("z")
    slot = m.resume("x").state_slot
    assert float(ssm[slot].flatten()[0]) == 7.0
