"""The example engine's scheduler: when it commits a request's tokens, and the shape of its
step calls. No model runs: each test drives ``Scheduler`` against an in-process manager,
standing in for the forwards (``finish_step`` with made-up tokens), and records every
``step_columns`` call it makes."""

from __future__ import annotations

from typing import Any

import pytest

from kvcm import KVCacheManager
from kvcm_engine import Request
from kvcm_engine.scheduler import Scheduler

BLOCK = 4


class Recorder:
    """The KVCM protocol over a manager, keeping each ``step_columns`` call's keywords."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.calls: list[dict[str, Any]] = []

    def step_columns(self, **columns: Any) -> Any:
        self.calls.append(columns)
        return self.manager.step_columns(**columns)

    def probe(self, token_ids: Any) -> int:
        return self.manager.probe(token_ids)


def _manager(num_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(
        {
            "layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}],
            "num_blocks": num_blocks,
            "tokens_per_block": BLOCK,
            "max_requests": 4,
            "max_seq_len": 128,
        }
    )


def _run(scheduler: Scheduler, requests: list[Request], steps: int = 100) -> None:
    """Schedule and "compute" until every request is done: each forward's next token is
    1000 + the step's number."""
    for r in requests:
        scheduler.add(r)
    for step in range(steps):
        if scheduler.idle:
            return
        plan = scheduler.schedule()
        scheduler.finish_step(plan, {w.request.request_id: 1000 + step for w in plan})
    raise AssertionError("the requests did not finish")


def _commit_ends(calls: list[dict[str, Any]], lengths: dict[int, int]) -> list[int]:
    """Where each commit of the calls ends, per call (one request: its running length)."""
    ends = []
    for call in calls:
        for handle, tokens in zip(
            call.get("commit", ()), call.get("commit_tokens", ()), strict=True
        ):
            lengths[handle] = lengths.get(handle, 0) + len(tokens)
            ends.append(lengths[handle])
    return ends


@pytest.mark.parametrize(
    "policy,ends",
    [("at_end", [16, 32, 40, 44]), ("each_step", [16, 32, 40, 41, 42, 43, 44])],
)
def test_the_worked_example_commits(policy: str, ends: list[int]) -> None:
    """``Scheduler._commits``' example: a 40-token prompt in chunks of 16, 5 new tokens
    (positions 40-43 computed; the last token's KV is never needed). At the end, the output
    waits for the free and each decode step is bare extends of one token (the decode frame a
    client sends); each step, every computed token is committed the step after."""
    kvcm = Recorder(_manager())
    scheduler = Scheduler(kvcm, chunk=16, max_batch_tokens=16, max_running=4, commit_output=policy)
    r = Request("a", list(range(1, 41)), max_new_tokens=5)
    _run(scheduler, [r])
    assert _commit_ends(kvcm.calls, {}) == ends
    assert len(r.output) == 5
    decodes = [c for c in kvcm.calls if "allocate" not in c and c.get("num_new_tokens") == 1]
    assert len(decodes) == 4  # the steps that computed positions 40, 41, 42, 43
    bare = [c for c in decodes if c.keys() == {"extend", "num_new_tokens", "map_slots"}]
    assert len(bare) == (3 if policy == "at_end" else 0)  # the first commits the prompt's end
    # The free's call commits the rest first: all of the request's computed tokens are
    # published, 11 blocks of 4.
    assert kvcm.calls[-1]["free"] == kvcm.calls[-1]["commit"]
    assert kvcm.manager.probe(r.seq) == 44


def test_a_running_request_publishes_its_prompt_not_yet_its_output() -> None:
    """With ``at_end``, another request sees a running one's prompt blocks at once (chunk by
    chunk), its output's blocks once it ends."""
    kvcm = Recorder(_manager())
    scheduler = Scheduler(kvcm, chunk=8, max_batch_tokens=8, max_running=4)
    r = Request("a", list(range(1, 13)), max_new_tokens=9)
    scheduler.add(r)
    for step in range(6):  # 12 prompt tokens in 2 chunks, then decodes
        plan = scheduler.schedule()
        scheduler.finish_step(plan, {w.request.request_id: 1000 + step for w in plan})
    assert r.computed == 16 and len(r.output) == 5
    assert kvcm.manager.probe(r.seq) == 12  # the prompt's 3 blocks; 12..15 uncommitted
    _run(scheduler, [])
    assert kvcm.manager.probe(r.seq) == 20  # computed 20 of 21: 5 whole blocks


def test_a_preempted_request_commits_its_output_before_its_free() -> None:
    """A victim freed to make room commits what it computed in the same call, first, so its
    readmission hits its own output's blocks instead of recomputing them. Two 8-token
    prompts in a pool of 8 blocks of 4: after 8 decodes each holds 16 tokens (4 blocks),
    the ninth needs a fifth block each; b, the newest, is freed with its 8 outputs committed,
    and comes back (once a finishes) with all of its 16 computed tokens hit."""
    kvcm = Recorder(_manager(num_blocks=9))  # 8 usable blocks of 4
    scheduler = Scheduler(kvcm, chunk=16, max_batch_tokens=32, max_running=2)
    a = Request("a", list(range(1, 9)), max_new_tokens=12)
    b = Request("b", list(range(100, 108)), max_new_tokens=12)
    _run(scheduler, [a, b])
    assert scheduler.stats.preemptions == 1
    assert a.admissions == 1 and b.admissions == 2
    (preempt,) = [
        c
        for c in kvcm.calls
        if "free" in c
        and len(c.get("commit_tokens", [])) == 1
        and c["commit_tokens"][0] == list(range(1000, 1008))
    ]
    assert preempt["commit"] == preempt["free"]  # b's output, committed first in its free's call
    assert "extend" not in preempt  # a's extend no longer fails once b is gone: a later step's
    assert b.hit_tokens == 16 and a.hit_tokens == 0
    assert len(a.output) == len(b.output) == 12


def test_commit_output_is_checked() -> None:
    with pytest.raises(ValueError, match="commit_output"):
        Scheduler(
            Recorder(_manager()), chunk=8, max_batch_tokens=8, max_running=1, commit_output="never"
        )  # type: ignore[arg-type]
