"""The example engine's decode forwards replayed from CUDA graphs (``kvcm_engine.graphs``) and
the kernels' pre-bound launches (``kvcm_kernels.paged_attention._PreBound``) on CUDA: float32
tokens equal transformers' ``generate`` with the graphs on, in process (the manager's tables
and slot mappings on the device) and through a CUDA sidecar (IPC tables, host slot
mappings), with padded buckets, each decode step planning the next one while the device
computes it (``overlap``: in process, and through a sidecar with stream-ordered steps; a
sidecar without them never overlaps); a pre-bound launch gives the same bytes as Triton's own
dispatch, and the kernel still equals dense attention."""

from __future__ import annotations

import pytest
import torch
from servers import serve_process
from test_paged_attention import dense_attention, random_case, rel_error

from kvcm import KVCacheManager
from kvcm_client import KVCacheClient
from kvcm_engine import Backend, Engine, build_model, kvcm_layers, make_requests, reference_outputs
from kvcm_kernels import paged_attention as pa

DEVICE = "cuda:0"
SIZING = {
    "tokens_per_block": 4,
    "num_blocks": 48,
    "max_requests": 16,
    "max_seq_len": 256,
    "max_prefill_chunk": 16,
    "null_page": True,
}

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not pa.triton_usable(torch.zeros(1, device="cuda")),
    reason="needs CUDA and Triton",
)


def _check(engine: Engine, built, overlap: bool) -> None:
    assert engine.graphs is not None and engine.graphs.capture  # auto: on for CUDA, paged
    assert engine.overlap is overlap
    # Arrivals every step: preemptions fall in decode steps too (planned ahead, overlapping).
    done = engine.run(make_requests(16, arrival_every=1))
    assert {r.request_id: r.output for r in done} == reference_outputs(built, make_requests(16))
    assert engine.graphs.failed is None, engine.graphs.failed
    assert engine.graphs.captures > 0 and engine.graphs.replays > 0
    assert engine.scheduler.stats.preemptions > 0 and engine.scheduler.stats.hit_tokens > 0
    assert engine.stats.planned_ahead == (engine.stats.forwards if overlap else 0)


def _manager(built, null_page: bool, **settings: object) -> KVCacheManager:
    """A CUDA manager of ``SIZING`` (and ``settings``), its unwritten memory NaN (it must
    never enter attention)."""
    m = KVCacheManager(
        {
            **kvcm_layers(built.hf_config),
            "device": DEVICE,
            **SIZING,
            "null_page": null_page,
            **settings,
        }
    )
    for spec in m.config.layers:
        for role in ("key", "value"):
            m.layer_view(spec.layer_id, role)[1 if null_page else 0 :] = float("nan")
    return m


def _engine(built, m: KVCacheManager, **options: object) -> Engine:
    """The in-process engine of these tests: buckets of 1, 2, 4, 8 and 12 requests."""
    return Engine(
        built, Backend.in_process(m), chunk=16, max_batch_tokens=48, max_running=12, **options
    )


@pytest.mark.parametrize(
    ("family", "null_page", "overlap"),
    [("llama", True, True), ("mistral", False, True), ("llama", True, False)],
)
def test_graphs_in_process_equal_generate(family: str, null_page: bool, overlap: bool) -> None:
    """max_running 12: buckets of 1, 2, 4, 8 and 12 requests, most decodes padded."""
    built = build_model(family, device=DEVICE)
    engine = _engine(built, _manager(built, null_page), overlap="auto" if overlap else False)
    _check(engine, built, overlap)


def test_suspends_planned_ahead_on_cuda_equal_generate() -> None:
    """Victims suspended to the host tier by a step planned while a decode forward is in
    flight: the copy to the host is queued after that forward on the same stream."""
    built = build_model("llama", device=DEVICE)
    m = _manager(built, True, host_memory_bytes=1 << 22)
    engine = _engine(built, m, preempt="suspend")
    assert engine.overlap
    done = engine.run(make_requests(16, arrival_every=1))
    assert {r.request_id: r.output for r in done} == reference_outputs(built, make_requests(16))
    stats = engine.scheduler.stats
    assert stats.suspends > 0 and stats.resumes == stats.suspends
    assert engine.stats.planned_ahead == engine.stats.forwards > engine.graphs.replays > 0
    assert m.num_free_blocks() == m.num_total_blocks()


def test_graphs_through_a_cuda_sidecar_equal_generate() -> None:
    """Without stream-ordered steps the sidecar edits the tables on its own stream: the
    engine never plans ahead (auto), and refuses to when asked."""
    built = build_model("llama", device=DEVICE)
    with (
        serve_process("--device", DEVICE, model=False) as (url, _, _),
        KVCacheClient(url) as client,
    ):
        client.register_model(hf_config=built.hf_config, share=True, **SIZING)
        backend = Backend.sidecar(client)
        with pytest.raises(ValueError, match="stream_order"):
            Engine(built, backend, overlap=True)
        _check(Engine(built, backend, chunk=16, max_batch_tokens=48), built, False)


def test_overlap_through_a_stream_ordered_sidecar_equals_generate(tmp_path) -> None:
    """Stream-ordered steps over the step channel: each decode step's call for the next one
    goes while the forward runs; the sidecar's edits wait for it on the device."""
    built = build_model("llama", device=DEVICE)
    sock = tmp_path / "step.sock"
    with (
        serve_process("--device", DEVICE, "--step-socket", str(sock), model=False) as (
            url,
            _,
            _,
        ),
        KVCacheClient(url, step_socket=sock) as client,
    ):
        client.register_model(hf_config=built.hf_config, share=True, **SIZING)
        backend = Backend.sidecar(client, stream_order=True)
        engine = Engine(built, backend, chunk=16, max_batch_tokens=48)
        _check(engine, built, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prebound_launches_equal_tritons_dispatch(dtype: torch.dtype) -> None:
    """The same case launched through Triton's dispatch and pre-bound: the same bytes, and
    equal to dense attention."""
    case = random_case(3, dtype=dtype, device=DEVICE, tokens_per_block=16, heads=16, kv_heads=8,
                       dim=128, max_new=1, requests=16, max_blocks=24)  # fmt: skip
    outs = []
    for direct in (False, True, True):
        for launcher in pa._LAUNCHERS.values():
            launcher.direct = direct
        kc, vc = case.key_cache.clone(), case.value_cache.clone()
        pa.store_kv(case.key, case.value, kc, vc, case.slot_mapping, case.meta)
        out = pa.paged_attention(
            case.query, kc, vc, case.page_table, case.meta, scale=case.scale, empty=case.empty
        )
        torch.cuda.synchronize()
        outs.append((kc.nan_to_num(7.0), vc.nan_to_num(7.0), out))
    attention = pa.launcher_of("attention_kernel")
    store = pa.launcher_of("store_kernel")
    assert attention is not None and attention.launches > 0
    assert store is not None and store.launches > 0
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], got, strict=True))
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    assert rel_error(outs[-1][2], dense_attention(case)) < tolerance
