"""Prometheus metrics of one router (its own registry): routes answered and their latency,
events ingested; sidecars per follow state and snapshots loaded, read from the followers at
scrape time so they cannot drift."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvcm_client.routing import SidecarStatus

#: Route latency, 100 us to 1 s.
_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)


class _Followers(Collector):
    def __init__(self, statuses: Callable[[], list[SidecarStatus]]) -> None:
        self.statuses = statuses

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        statuses = self.statuses()
        states = GaugeMetricFamily(
            "kvcm_router_sidecars", "Sidecars by follow state", labels=["state"]
        )
        for state, n in sorted(Tally(s.state for s in statuses).items()):
            states.add_metric([state], n)
        yield states
        yield CounterMetricFamily(
            "kvcm_router_snapshots", "Snapshots loaded", sum(s.snapshots for s in statuses)
        )


class RouterMetrics:
    def __init__(self, statuses: Callable[[], list[SidecarStatus]]) -> None:
        self.registry = CollectorRegistry()
        self.routes = Histogram(
            "kvcm_router_route_seconds",
            "Time to score a prompt (hashing, index reads, ranking)",
            registry=self.registry,
            buckets=_BUCKETS,
        )
        self.events = Counter("kvcm_router_events", "KV events ingested", registry=self.registry)
        self.registry.register(_Followers(statuses))

    def render(self) -> bytes:
        return generate_latest(self.registry)
