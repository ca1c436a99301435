"""Prometheus metrics of one service instance (its own registry, so tests can run several).

Block gauges are read from the manager at scrape time, so they can never drift from it (the
current one: a registered model replaces it; none while the service has no model); counters
and the latency histogram are updated by the routes and survive a new model.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..manager import KVCacheManager
from .leases import Leases

#: Manager time per route, 10 us to 0.5 s.
_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5)


Current = Callable[[], KVCacheManager | None]


class _StateCollector(Collector):
    def __init__(self, current: Current, leases: Leases, consumers: dict) -> None:
        self.current = current
        self.leases = leases
        self.consumers = consumers

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily("kvcm_sessions_active", "Open lease sessions", len(self.leases))
        yield GaugeMetricFamily(
            "kvcm_consumers_attached", "Processes that mapped the pools", len(self.consumers)
        )
        manager = self.current()
        yield GaugeMetricFamily(
            "kvcm_model_registered", "1 while the service has a model", int(manager is not None)
        )
        if manager is None:
            return
        stats = manager.stats()
        for name, values, text in (
            ("kvcm_blocks_free", stats.free_blocks, "Free blocks (slots) per pool group"),
            ("kvcm_blocks_used", stats.used_blocks, "Blocks in use per pool group"),
            ("kvcm_blocks_total", stats.total_blocks, "Usable slots per pool group"),
        ):
            family = GaugeMetricFamily(name, text, labels=["pool_group"])
            for pg, value in sorted(values.items()):
                family.add_metric([str(pg)], value)
            yield family
        yield GaugeMetricFamily(
            "kvcm_requests_running", "Requests holding a page-table row", stats.num_requests
        )
        cache = stats.prefix_cache
        if cache is None:
            return
        for name, value, text in (
            ("kvcm_prefix_queries", cache.queries, "Allocations with token ids"),
            ("kvcm_prefix_query_tokens", cache.query_tokens, "Prompt tokens of those"),
            ("kvcm_prefix_hit_tokens", cache.hit_tokens, "Prompt tokens served from cache"),
            ("kvcm_prefix_stored_blocks", cache.stored_blocks, "Blocks published for reuse"),
            ("kvcm_prefix_evictions", cache.evictions, "Cached blocks evicted"),
        ):
            yield CounterMetricFamily(name, text, value=value)
        family = GaugeMetricFamily(
            "kvcm_prefix_cached_blocks", "Blocks a hit could reuse now", labels=["pool_group"]
        )
        for pg, value in sorted(cache.cached_blocks.items()):
            family.add_metric([str(pg)], value)
        yield family
        host = stats.host_tier
        if host is None:
            return
        for name, value, text in (
            ("kvcm_host_offloaded_blocks", host.offloaded_blocks, "Blocks copied to the host"),
            ("kvcm_host_offloaded_bytes", host.offloaded_bytes, "Bytes copied to the host"),
            ("kvcm_host_onboarded_blocks", host.onboarded_blocks, "Blocks copied back"),
            ("kvcm_host_onboarded_bytes", host.onboarded_bytes, "Bytes copied back"),
            ("kvcm_host_dropped_blocks", host.dropped_blocks, "Host blocks dropped for room"),
            ("kvcm_host_copy_launches", host.copy_launches, "Batches of host copies launched"),
            (
                "kvcm_host_copy_hazard_launches",
                host.copy_hazard_launches,
                "Batches launched early: two copies of a step shared a slot",
            ),
            ("kvcm_host_copy_seconds", host.copy_seconds, "Time ops spent on host copies"),
            ("kvcm_host_offloaded_states", host.offloaded_states, "Live states suspended"),
            ("kvcm_host_onboarded_states", host.onboarded_states, "Live states resumed"),
        ):
            yield CounterMetricFamily(name, text, value=value)
        for name, values, text, label in (
            ("kvcm_host_slots", host.host_slots, "Host tier slots per pool group", "pool_group"),
            ("kvcm_host_used", host.host_used, "Host tier slots holding a block", "pool_group"),
            (
                "kvcm_host_state_slots",
                host.state_host_slots,
                "Host tier slots for suspended states per state group",
                "state_group",
            ),
            (
                "kvcm_host_state_used",
                host.state_host_used,
                "Host tier state slots holding a suspended state",
                "state_group",
            ),
        ):
            family = GaugeMetricFamily(name, text, labels=[label])
            for key, value in sorted(values.items()):
                family.add_metric([str(key)], value)
            yield family


class Metrics:
    def __init__(self, current: Current, leases: Leases, consumers: dict) -> None:
        """``current`` gives the manager now (None: no model yet)."""
        self.registry = CollectorRegistry()
        self._children: dict[tuple[Counter, tuple[str, ...]], Any] = {}
        #: Counts the step path added since the last scrape, by counter child (``later``).
        self._later: dict[Any, int] = {}
        #: Durations the step path observed since the last scrape (``observe_later``).
        self._observed: list[tuple[Any, float]] = []
        self._ok_ops: dict[str, Any] = {}  # section -> kvcm_ops_total{op, "ok"}'s child
        self.registry.register(_StateCollector(current, leases, consumers))
        self.ops = Counter(
            "kvcm_ops",
            "Ops run, by op and result (ok or the error code)",
            ["op", "result"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvcm_op_duration_seconds",
            "Time the manager spent per route (excludes HTTP parsing and encoding)",
            ["route"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.http = Counter(
            "kvcm_http_requests",
            "HTTP requests by route template and status code",
            ["route", "status"],
            registry=self.registry,
        )
        self.step_channel_frames = Counter(
            "kvcm_step_channel_frames",
            "Step channel frames by op and result (ok or the error code)",
            ["op", "result"],
            registry=self.registry,
        )
        self.step_channel_polls = Counter(
            "kvcm_step_channel_polls",
            "Polls for a client's next frame (docs/step-channel.md), by what came before "
            "(an answer, or the client's doorbell) and how they ended: frame, or timeout "
            "(the window spent on a core for nothing)",
            ["after", "ended"],
            registry=self.registry,
        )
        self.step_channel_connections = Counter(
            "kvcm_step_channel_connections",
            "Connections accepted on the step channel socket",
            registry=self.registry,
        )
        self.lease_sessions_expired = Counter(
            "kvcm_lease_sessions_expired",
            "Sessions whose lease ran out",
            registry=self.registry,
        )
        self.lease_requests_freed = Counter(
            "kvcm_lease_requests_freed",
            "Requests freed because their session's lease ran out",
            registry=self.registry,
        )

    def child(self, metric: Counter, *labels: str) -> Any:
        """``metric.labels(*labels)``, kept: prometheus builds the key anew at each call
        (microseconds, on every step). Labels are op names and error codes: a bounded set."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def later(self, metric: Counter, n: int, *labels: str) -> None:
        """Add ``n`` to ``metric{labels}`` at the next scrape (``render``): the step path's
        counts, a dict update here instead of prometheus' lock and call per count (a step
        over the step channel made five, ~2 us). Keyed by the counter's child, so the
        pending counts are bounded by the label sets, however long nobody scrapes."""
        child = self.child(metric, *labels)
        later = self._later
        later[child] = later.get(child, 0) + n

    #: Deferred observations that wait at most (``observe_later``): the bound on their
    #: memory, however long nobody scrapes.
    MAX_OBSERVED = 4096

    def observe_later(self, child: Any, seconds: float) -> None:
        """``child.observe(seconds)`` (a histogram's child) at the next scrape: a list
        append here instead of prometheus' bucket search and two locked adds (0.8 us a
        step). While ``MAX_OBSERVED`` wait, the next ones go to prometheus at once (one
        at a time: no step pays for the others)."""
        observed = self._observed
        if len(observed) < self.MAX_OBSERVED:
            observed.append((child, seconds))
        else:
            child.observe(seconds)

    def _flush_observed(self) -> None:
        observed, self._observed = self._observed, []
        for child, seconds in observed:
            child.observe(seconds)

    def ops_ok_later(self, status: dict[str, Any]) -> None:
        """``later`` of ``kvcm_ops_total{op=section, result="ok"}`` for each non-empty
        section of a step whose items all succeeded (its per-section status arrays)."""
        later, children = self._later, self._ok_ops
        for section, items in status.items():
            n = items.size
            if n:
                child = children.get(section)
                if child is None:
                    child = children[section] = self.child(self.ops, section, "ok")
                later[child] = later.get(child, 0) + n

    def count_ops(self, tally: Tally[tuple[str, str]]) -> None:
        """One ``inc`` per distinct (op, result): a 256-op step costs a handful of calls."""
        for (op, result), n in tally.items():
            self.child(self.ops, op, result).inc(n)

    def render(self) -> bytes:
        later, self._later = self._later, {}
        for child, n in later.items():
            child.inc(n)
        self._flush_observed()
        return generate_latest(self.registry)
