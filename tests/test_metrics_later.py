"""Counts the step path defers to the scrape (``Metrics.later``): exact at every scrape,
nothing in prometheus before it, and pending counts bounded by the label sets."""

from __future__ import annotations

from kvcm import KVCacheManager
from kvcm.server.state import ServiceState

CONFIG = {
    "layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}],
    "tokens_per_block": 4,
    "num_blocks": 32,
    "max_requests": 8,
    "max_seq_len": 64,
}


def _line(text: str, prefix: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(prefix))


def test_deferred_counts_show_exactly_at_each_scrape() -> None:
    state = ServiceState(KVCacheManager(CONFIG), 30.0)
    metrics = state.metrics
    out = state.step_columns({"allocate": [{"request_id": "a", "num_tokens": 5}]}, None)
    handle = int(out.handles[0])
    for _ in range(3):
        state.step_columns({"extend": [handle]}, None)
    child = metrics.child(metrics.ops, "extend", "ok")
    assert child._value.get() == 0  # pending: not yet in prometheus
    assert metrics._later == {child: 3, metrics.child(metrics.ops, "allocate", "ok"): 1}
    text = metrics.render().decode()
    assert _line(text, 'kvcm_ops_total{op="extend",result="ok"}').endswith(" 3.0")
    assert _line(text, 'kvcm_ops_total{op="allocate",result="ok"}').endswith(" 1.0")
    assert metrics._later == {}
    stale = handle + (1 << 32)  # the row's next request: not live
    state.step_columns({"extend": [handle, stale]}, None)  # not all ok: counted at once
    assert metrics._later == {}
    state.step_columns({"extend": [handle]}, None)
    state.step_columns({"extend": [handle]}, None)
    assert metrics._later == {child: 2}  # one entry however many steps
    text = metrics.render().decode()
    assert _line(text, 'kvcm_ops_total{op="extend",result="ok"}').endswith(" 6.0")
    assert _line(text, 'kvcm_ops_total{op="extend",result="unknown_request"}').endswith(" 1.0")
    again = metrics.render().decode()  # nothing pending: the same counts
    assert _line(again, 'kvcm_ops_total{op="extend",result="ok"}').endswith(" 6.0")
