"""The example engine's decode forwards on static buffers (``kvcm_engine.graphs``), the path
that a CUDA device captures in CUDA graphs and replays: on the CPU the same function runs
eagerly on the same buffers (the kernels' torch references), so everything but the capture is
checked here; tests/gpu/test_engine_graphs_gpu.py replays the captured graphs."""

from __future__ import annotations

import pytest
from test_paged_attention import _manager

from kvcm_engine import Backend, Engine, build_model, make_requests, reference_outputs
from kvcm_engine.graphs import buckets


def test_buckets_worked_example() -> None:
    assert buckets(12) == [1, 2, 4, 8, 12]
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(1) == [1]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "null_page"), [("llama", True), ("mistral", False)])
def test_decode_on_static_buffers_equals_generate(family: str, null_page: bool) -> None:
    """Prefix hits, chunked prefill, preemption, a window (Mistral), padded buckets
    (``max_running`` 12: buckets of 1, 2, 4, 8 and 12 requests): every token equals
    transformers' generate, and the decodes ran on the static buffers."""
    built = build_model(family)
    engine = Engine(
        built,
        Backend.in_process(_manager(built, null_page)),
        chunk=16,
        max_batch_tokens=48,
        max_running=12,
        attention="paged",
        cuda_graphs=True,
    )
    assert engine.graphs is not None and not engine.graphs.capture  # the CPU: no capture
    done = engine.run(make_requests(16))
    assert {r.request_id: r.output for r in done} == reference_outputs(built, make_requests(16))
    assert engine.graphs.replays > 0
    assert engine.graphs.replays < engine.stats.forwards  # the prefills ran the usual way
    assert engine.scheduler.stats.preemptions > 0
    assert engine.scheduler.stats.hit_tokens > 0


def test_cuda_graphs_choice() -> None:
    """auto: none on the CPU; forced on, it needs the paged path (the gather is refused)."""
    llama = build_model("llama")
    assert Engine(llama, Backend.in_process(_manager(llama))).graphs is None
    paged = Engine(llama, Backend.in_process(_manager(llama)), attention="paged")
    assert paged.graphs is None  # auto: a CPU tensor is never captured
    with pytest.raises(ValueError, match="paged attention path"):
        Engine(llama, Backend.in_process(_manager(llama)), attention="gather", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        Engine(llama, Backend.in_process(_manager(llama)), cuda_graphs="yes")  # type: ignore[arg-type]
