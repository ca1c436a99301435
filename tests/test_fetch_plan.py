"""The router's fetch plan (``kvcm.router.service.fetch_plan``): run on the least loaded
sidecar, fetch the longer prefix from the one that holds it."""

from __future__ import annotations

from kvcm.router.service import fetch_plan
from kvcm_client.routing import SidecarScore


def score(name: str, hit: int, device: int, running: int | None, free: int | None) -> SidecarScore:
    return SidecarScore(
        sidecar=name,
        url=f"http://{name}:8470",
        generation="g",
        hit_blocks=hit,
        device_hit_blocks=device,
        hit_tokens=hit * 16,
        groups=[],
        free_blocks=free,
        running_requests=running,
    )


def test_run_on_the_least_loaded_and_fetch_from_the_longest() -> None:
    plan = fetch_plan([score("a", 10, 10, 8, 100), score("b", 2, 2, 1, 100)])
    assert plan is not None
    assert (plan.run_on, plan.fetch_from, plan.fetch_blocks, plan.hit_blocks) == ("b", "a", 8, 10)
    assert plan.run_on_url == "http://b:8470" and plan.fetch_from_url == "http://a:8470"


def test_no_fetch_when_the_least_loaded_holds_the_most() -> None:
    plan = fetch_plan([score("a", 10, 10, 1, 100), score("b", 2, 2, 3, 100)])
    assert plan is not None
    assert (plan.run_on, plan.fetch_from, plan.fetch_blocks, plan.hit_blocks) == ("a", None, 0, 10)


def test_ties_on_load_go_to_free_blocks_then_name() -> None:
    scores = [score("c", 0, 0, 2, 50), score("b", 0, 0, 2, 80), score("a", 0, 0, 2, 80)]
    plan = fetch_plan(scores)
    assert plan is not None and plan.run_on == "a" and plan.fetch_from is None


def test_host_hits_are_not_fetched_and_unknown_loads_are_not_run_on() -> None:
    # a's 10 blocks are on its host tier (device 0): nothing to fetch; c's load is unknown.
    plan = fetch_plan(
        [score("a", 10, 0, 5, 10), score("b", 1, 1, 0, 10), score("c", 12, 12, None, None)]
    )
    assert plan is not None
    assert (plan.run_on, plan.fetch_from, plan.fetch_blocks) == ("b", "c", 11)
    assert fetch_plan([score("c", 12, 12, None, None)]) is None
