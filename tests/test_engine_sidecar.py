"""The engine and the sidecar in separate processes: a ``kvcm serve`` started with no model,
the engine registers its model's ``config.json``, attaches to the shared pools and page
tables and drives the service through the typed client; tokens equal transformers'. Then the
engine restarts with another model: it registers that one (a new generation, new pools)."""

from __future__ import annotations

from servers import serve_process

from kvcm_client import KVCacheClient
from kvcm_engine import Backend, Engine, build_model, make_requests, reference_outputs

SIZING = {
    "tokens_per_block": 4,
    "num_blocks": 48,
    "max_requests": 16,
    "max_seq_len": 256,
    "max_prefill_chunk": 16,
    "null_page": True,
}


def test_engine_through_the_sidecar_then_another_model() -> None:
    with serve_process(model=False) as (url, _, _):
        generations = []
        for family in ("gemma3", "deepseek_v3"):
            built = build_model(family)
            with KVCacheClient(url) as client:
                answer = client.register_model(hf_config=built.hf_config, share=True, **SIZING)
                generations.append(answer.generation)
                backend = Backend.sidecar(client)
                engine = Engine(built, backend, chunk=16, max_batch_tokens=48)
                done = engine.run(make_requests(16))
                assert client.request_ids() == []
                stats = client.stats()
                assert stats.num_requests == 0
                assert stats.request_free_blocks == stats.request_total_blocks
            expected = reference_outputs(built, make_requests(16))
            assert {r.request_id: r.output for r in done} == expected
            assert engine.scheduler.stats.hit_tokens > 0
            assert engine.scheduler.stats.preemptions > 0
        assert generations[0] != generations[1]
