"""The engine and the sidecar in separate processes: a ``kvcm serve`` started with no model,
the engine registers its model's ``config.json``, attaches to the shared pools and page
tables and drives the service through the typed client; tokens equal transformers'. Then the
engine restarts with another model: it registers that one (a new generation, new pools), and
sends its step-path calls over the step channel this time; then with a hybrid model, whose
recurrent state it runs on the attached state slots."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from servers import serve_process

from kvcm_client import KVCacheClient
from kvcm_engine import (
    HYBRIDS,
    Backend,
    Engine,
    build_model,
    hybrid_unsupported,
    make_requests,
    reference_outputs,
)

pytestmark = pytest.mark.slow  # the example engine through a real kvcm serve

SIZING = {
    "tokens_per_block": 4,
    "num_blocks": 48,
    "max_requests": 16,
    "max_seq_len": 256,
    "max_prefill_chunk": 16,
    "null_page": True,
}


def test_engine_through_the_sidecar_then_another_model(tmp_path: Path) -> None:
    step_socket = tmp_path / "step.sock"
    with serve_process("--step-socket", str(step_socket), model=False) as (url, _, _):
        generations = []
        runs = [
            ("gemma3", None),
            ("deepseek_v3", step_socket),
            ("qwen3_next", step_socket),  # a hybrid: its state slots attached too
        ]
        # An older transformers cannot run the hybrid on kvcm (kvcm_engine.models).
        runs = [(f, ch) for f, ch in runs if f not in HYBRIDS or hybrid_unsupported() is None]
        for family, channel in runs:
            built = build_model(family)
            with KVCacheClient(url, step_socket=channel) as client:
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
        assert len(set(generations)) == len(runs)
        # The later engines' step-path calls went over the channel.
        frames = re.findall(
            r'kvcm_step_channel_frames_total\{op="(\w+)",result="ok"\} (\d+)',
            httpx.get(f"{url}/metrics").text,
        )
        ops = {op for op, n in frames if float(n) > 0}
        assert "step_columns" in ops
        # The slot mappings came with the step's answers (map_slots): no call of their own;
        # only the hybrid (qwen3_next: chunks end on block boundaries) probed.
        assert "slot_mappings" not in ops and "slot_mapping" not in ops
        assert ("probe" in ops) == any(f in HYBRIDS for f, _ in runs[1:])
