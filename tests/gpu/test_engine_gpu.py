"""The example engine on CUDA: the manager's GPU kernels build the slot mappings and tables,
the model runs on the GPU, and the sidecar's pools reach the engine over CUDA IPC; every
token equals transformers' own ``generate`` on the same GPU."""

from __future__ import annotations

import pytest
from servers import serve_process

from kvcm import KVCacheManager
from kvcm_client import KVCacheClient
from kvcm_engine import (
    FAMILIES,
    HYBRIDS,
    Backend,
    Engine,
    build_model,
    hybrid_unsupported,
    kvcm_layers,
    make_requests,
    reference_outputs,
)

DEVICE = "cuda:0"
SIZING = {
    "tokens_per_block": 4,
    "num_blocks": 48,
    "max_requests": 16,
    "max_seq_len": 256,
    "max_prefill_chunk": 16,
    "null_page": True,
}


def _build(family: str):
    """The family's model on the GPU; a hybrid needs transformers >= 5.24 (the image's 5.17
    has no linear-attention cache interface: carry the pinned wheel)."""
    if family in HYBRIDS and (why := hybrid_unsupported()) is not None:
        pytest.skip(why)
    return build_model(family, device=DEVICE)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def built(request):
    return _build(request.param)


def check(engine: Engine, built) -> None:
    done = engine.run(make_requests(16))
    expected = reference_outputs(built, make_requests(16))
    assert {r.request_id: r.output for r in done} == expected
    assert engine.scheduler.stats.hit_tokens > 0
    assert engine.scheduler.stats.preemptions > 0


def test_cuda_manager_in_process(built) -> None:
    m = KVCacheManager({**kvcm_layers(built.hf_config), "device": DEVICE, **SIZING})
    assert m.page_tables().is_cuda
    check(Engine(built, Backend.in_process(m), chunk=16, max_batch_tokens=48), built)


def test_cuda_sidecar_over_ipc(built) -> None:
    with (
        serve_process("--device", DEVICE, model=False) as (url, _, _),
        KVCacheClient(url) as client,
    ):
        client.register_model(hf_config=built.hf_config, share=True, **SIZING)
        backend = Backend.sidecar(client)
        assert backend.page_tables().is_cuda
        check(Engine(built, backend, chunk=16, max_batch_tokens=48), built)


def test_cuda_hybrid_preempted_to_the_host_tier() -> None:
    """Qwen3-Next on the GPU, preempted by suspend: its blocks and gated delta nets' state go
    to the pinned host tier on the tier's stream and come back (4 live state slots)."""
    built = _build("qwen3_next")
    m = KVCacheManager(
        {
            **kvcm_layers(built.hf_config),
            "device": DEVICE,
            **SIZING,
            "state_live_slots": 4,
            "host_memory_bytes": 1 << 20,
        }
    )
    engine = Engine(built, Backend.in_process(m), chunk=16, max_batch_tokens=48, preempt="suspend")
    done = engine.run(make_requests(16))
    assert {r.request_id: r.output for r in done} == reference_outputs(built, make_requests(16))
    assert engine.scheduler.stats.suspends > 0
    assert m.host_stats()["onboarded_states"] == engine.scheduler.stats.resumes > 0
