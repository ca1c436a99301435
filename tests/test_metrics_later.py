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


def test_deferred_durations_show_exactly_at_each_scrape_and_wait_bounded() -> None:
    """The step channel's op durations wait in a list until the scrape, which replays each
    into the histogram (its count and sum exact); while ``MAX_OBSERVED`` wait, the next go
    in at once."""
    state = ServiceState(KVCacheManager(CONFIG), 30.0)
    metrics = state.metrics
    child = metrics.latency.labels("/v1/step_columns")
    for seconds in (0.001, 0.002, 0.004):
        metrics.observe_later(child, seconds)
    assert child._sum.get() == 0 and len(metrics._observed) == 3
    text = metrics.render().decode()
    route = 'route="/v1/step_columns"'
    assert _line(text, f"kvcm_op_duration_seconds_count{{{route}}}").endswith(" 3.0")
    total = float(_line(text, f"kvcm_op_duration_seconds_sum{{{route}}}").rsplit(" ", 1)[1])
    assert abs(total - 0.007) < 1e-12 and metrics._observed == []
    for _ in range(metrics.MAX_OBSERVED + 5):
        metrics.observe_later(child, 0.001)
    assert len(metrics._observed) == metrics.MAX_OBSERVED  # full: the last 5 went in at once
    assert abs(child._sum.get() - (0.007 + 5 * 0.001)) < 1e-12
    text = metrics.render().decode()
    count = _line(text, f"kvcm_op_duration_seconds_count{{{route}}}")
    assert count.endswith(f" {3 + metrics.MAX_OBSERVED + 5}.0")
