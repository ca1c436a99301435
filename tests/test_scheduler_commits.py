"""The example engine's scheduler: when it commits a request's tokens, and the shape of its
step calls. No model runs: each test drives ``Scheduler`` against an in-process manager,
standing in for the forwards (``finish_step`` with made-up tokens), and records every
``step_columns`` call it makes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvcm import KVCacheManager
from kvcm_engine import Request
from kvcm_engine.scheduler import OUTPUT_COMMIT_STEPS, Scheduler, Work

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
    [("batched", [16, 32, 40, 44]), ("each_step", [16, 32, 40, 41, 42, 43, 44])],
)
def test_the_worked_example_commits(policy: str, ends: list[int]) -> None:
    """``Scheduler._commits``' example: a 40-token prompt in chunks of 16, 5 new tokens
    (positions 40-43 computed; the last token's KV is never needed). Batched, the output
    waits for the free and each decode step but the first (which commits the prompt's last
    chunk) is bare extends of one token (the decode frame a client sends); each step, every
    computed token is committed the step after."""
    kvcm = Recorder(_manager())
    scheduler = Scheduler(kvcm, chunk=16, max_batch_tokens=16, max_running=4, commit_output=policy)
    r = Request("a", list(range(1, 41)), max_new_tokens=5)
    _run(scheduler, [r])
    assert _commit_ends(kvcm.calls, {}) == ends
    assert len(r.output) == 5
    decodes = [c for c in kvcm.calls if "allocate" not in c and c.get("num_new_tokens") == 1]
    assert len(decodes) == 4  # the steps that computed positions 40, 41, 42, 43
    bare = [c for c in decodes if c.keys() == {"extend", "num_new_tokens", "map_slots"}]
    assert len(bare) == (3 if policy == "batched" else 0)  # the first commits the prompt's end
    # The free's call commits the rest first: all of the request's computed tokens are
    # published, 11 blocks of 4.
    assert kvcm.calls[-1]["free"] == kvcm.calls[-1]["commit"]
    assert kvcm.manager.probe(r.seq) == 44


def test_a_running_request_publishes_its_prompt_not_yet_its_output() -> None:
    """Batched, another request sees a running one's prompt blocks at once (chunk by chunk),
    its output's blocks once it ends."""
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


def test_every_64th_step_commits_the_running_outputs() -> None:
    """Batched, a running request's output is committed every ``OUTPUT_COMMIT_STEPS`` steps
    too (a commit holds at most that many steps' tokens of each request), and is then
    published while it runs: a 12-token prompt in chunks of 8 and 4 (steps 1-2), then a
    decode a step; step 64 commits what steps 3-63 computed, positions 12-72."""
    kvcm = Recorder(_manager())
    scheduler = Scheduler(kvcm, chunk=8, max_batch_tokens=8, max_running=4)
    r = Request("a", list(range(1, 13)), max_new_tokens=100)
    scheduler.add(r)
    for step in range(1, OUTPUT_COMMIT_STEPS + 1):
        plan = scheduler.schedule()
        if step == OUTPUT_COMMIT_STEPS - 1:
            assert kvcm.manager.probe(r.seq) == 12  # the prompt's blocks only, so far
        scheduler.finish_step(plan, {w.request.request_id: 1000 + step for w in plan})
    committed = [c for c in kvcm.calls if "commit" in c]
    assert [len(c["commit_tokens"][0]) for c in committed] == [8, 4, 61]
    assert kvcm.calls.index(committed[-1]) == OUTPUT_COMMIT_STEPS - 1
    assert r.committed == 73 and kvcm.manager.probe(r.seq) == 72  # 18 whole blocks
    bare = [c for c in kvcm.calls[3:-1] if c.keys() == {"extend", "num_new_tokens", "map_slots"}]
    assert len(bare) == OUTPUT_COMMIT_STEPS - 4  # every decode step between


def test_a_preempted_request_hits_its_own_output_when_readmitted() -> None:
    """A victim freed to make room commits what it computed first, in the same call, so its
    readmission hits its own output's blocks instead of recomputing them. Two 8-token
    prompts in a pool of 9 blocks of 4: after 8 decodes each holds 16 tokens (8 blocks);
    the ninth decode takes the last block for a, and b's extend fails. b, the newest, is
    freed with its 8 outputs committed, and comes back, once a finishes, with all of its 16
    computed tokens hit (its blocks stayed cached: a needed no more)."""
    kvcm = Recorder(_manager(num_blocks=9))
    scheduler = Scheduler(kvcm, chunk=16, max_batch_tokens=32, max_running=2)
    a = Request("a", list(range(1, 9)), max_new_tokens=12)
    b = Request("b", list(range(100, 108)), max_new_tokens=12)
    _run(scheduler, [a, b])
    assert scheduler.stats.preemptions == 1
    assert a.admissions == 1 and b.admissions == 2
    (preempt,) = [c for c in kvcm.calls if c.get("commit_tokens") == [list(range(1000, 1008))]]
    assert preempt["commit"] == preempt["free"]  # b's output, first in its free's call
    assert "extend" not in preempt  # a's extend ran in the step's own call
    assert b.hit_tokens == 16 and a.hit_tokens == 0
    assert len(a.output) == len(b.output) == 12


def test_a_victims_commit_goes_first_in_the_call_that_extends_the_others() -> None:
    """Three 8-token prompts, c admitted a step after a and b (the budget), in a pool of 12
    blocks of 4: when a and b hold 16 tokens each and c 15, their extends need a 13th block
    and fail (c's fits its fourth). c, the newest, is freed with its 7 computed outputs
    committed first, in the call that extends a and b again. Its blocks go to those
    extends (a freed request's last blocks are evicted first), so it comes back with its
    prompt's two blocks hit."""
    kvcm = Recorder(_manager(num_blocks=12))
    scheduler = Scheduler(kvcm, chunk=16, max_batch_tokens=32, max_running=3)
    requests = [
        Request(n, list(range(p, p + 8)), max_new_tokens=12)
        for n, p in (("a", 1), ("b", 100), ("c", 200))
    ]
    _run(scheduler, requests)
    a, b, c = requests
    assert scheduler.stats.preemptions == 1
    assert (a.admissions, b.admissions, c.admissions) == (1, 1, 2)
    (preempt,) = [call for call in kvcm.calls if "free" in call and "extend" in call]
    assert preempt["commit"] == preempt["free"]
    assert preempt["commit_tokens"] == [list(range(1001, 1008))]
    assert len(preempt["extend"]) == 2 and preempt["free"][0] not in preempt["extend"]
    assert c.hit_tokens == 8 and a.hit_tokens == b.hit_tokens == 0
    assert [len(r.output) for r in requests] == [12, 12, 12]


class _Scripted:
    """A KVCM whose ``step_columns`` answers are given: statuses per section, all else ok."""

    def __init__(self, answers: list[dict[str, list[int]]]) -> None:
        self.answers = answers
        self.calls: list[dict[str, Any]] = []

    def step_columns(self, **columns: Any) -> Any:
        self.calls.append(columns)
        status = self.answers[len(self.calls) - 1]
        return SimpleNamespace(
            status=status,
            ok=not any(any(v) for v in status.values()),
            errors=[
                SimpleNamespace(section=k, error=SimpleNamespace(code="out_of_blocks"))
                for k, v in status.items()
                for x in v
                if x
            ],
            failed=None,
            pulls=[],
            slot_mapping=f"mapping {len(self.calls)}",
        )


def test_a_failed_suspend_does_not_extend_again_what_its_call_extended() -> None:
    """A suspend the host cannot hold is retried as a free; the extends its call ran (its
    rewind gave a block back) are not sent again (they would grow twice), only those that
    still failed, and each request's slots come from the call that extended it."""
    kvcm = _Scripted(
        [
            {"suspend": [1], "extend": [0, 1]},  # a fits now, b not yet; c's suspend fails
            {"extend": [0]},  # c freed: b fits
        ]
    )
    scheduler = Scheduler(kvcm, chunk=8, max_batch_tokens=8, max_running=3, preempt="suspend")
    a, b, c = (Request(n, [1, 2, 3], max_new_tokens=4) for n in "abc")
    for i, r in enumerate((a, b, c)):
        r.handle, r.computed, r.held = 10 + i, 3, 4
        scheduler.running.append(r)
    plan = [Work(r, 3, 1) for r in (a, b, c)]
    left = scheduler._preempt_for([plan[0], plan[1], plan[2]], plan)
    assert [w.request for w in left] == [a, b]
    first, second = kvcm.calls
    assert first["suspend"] == [12] and first["extend"] == [10, 11]
    assert second["free"] == [12] and second["extend"] == [11]  # not a again
    assert (a.held, b.held) == (5, 5)
    assert scheduler.slots_of == {"a": ("mapping 1", 0), "b": ("mapping 2", 0)}
    assert c in scheduler.waiting and not scheduler.suspended


def test_commit_output_is_checked() -> None:
    assert (
        Scheduler(Recorder(_manager()), chunk=8, max_batch_tokens=8, max_running=1).commit_output
        == "batched"
    )
    hybrid = Scheduler(Recorder(_manager()), chunk=8, max_batch_tokens=8, max_running=1, align=4)
    assert hybrid.commit_output == "each_step"  # its state checkpoints need the commits
    with pytest.raises(ValueError, match="commit_output"):
        Scheduler(
            Recorder(_manager()), chunk=8, max_batch_tokens=8, max_running=1, commit_output="never"
        )  # type: ignore[arg-type]
