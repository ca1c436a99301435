"""The example engine's decode forwards on static buffers (``kvcm_engine.graphs``), the path
that a CUDA device captures in CUDA graphs and replays: on the CPU the same function runs
eagerly on the same buffers (the kernels' torch references), so everything but the capture is
checked here; tests/gpu/test_engine_graphs_gpu.py replays the captured graphs."""

from __future__ import annotations

import pytest
from test_paged_attention import _manager

from kvcm_engine import Backend, Engine, build_model, make_requests, reference_outputs
from kvcm_engine.graphs import buckets
from kvcm_engine.models import BuiltModel
from kvcm_engine.scheduler import UNKNOWN, Request, Scheduler


def test_buckets_worked_example() -> None:
    assert buckets(12) == [1, 2, 4, 8, 12]
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(1) == [1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "null_page", "overlap"),
    [("llama", True, True), ("mistral", False, True), ("llama", False, False)],
)
def test_decode_on_static_buffers_equals_generate(
    family: str, null_page: bool, overlap: bool
) -> None:
    """Prefix hits, chunked prefill, preemption, a window (Mistral), padded buckets
    (``max_running`` 12: buckets of 1, 2, 4, 8 and 12 requests): every token equals
    transformers' generate, and the decodes ran on the static buffers; with ``overlap``
    the decode steps planned the next step (and made its kvcm call) before their tokens were
    read, preemptions among those plans."""
    built = build_model(family)
    engine = Engine(
        built,
        Backend.in_process(_manager(built, null_page)),
        chunk=16,
        max_batch_tokens=48,
        max_running=12,
        attention="paged",
        cuda_graphs=True,
        overlap=overlap,
    )
    assert engine.graphs is not None and not engine.graphs.capture  # the CPU: no capture
    assert engine.overlap is overlap
    preempted_ahead = ahead_of_prefill = 0
    if overlap:  # count the preemptions made by a step planned ahead
        schedule = engine.scheduler.schedule

        def counted() -> list:
            nonlocal preempted_ahead, ahead_of_prefill
            before = engine.scheduler.stats.preemptions
            in_flight = [r.in_flight for r in engine.scheduler.running]
            plan = schedule()
            if any(in_flight):
                preempted_ahead += engine.scheduler.stats.preemptions - before
                ahead_of_prefill += max(in_flight) > 1  # a prefill chunk computes meanwhile
                # The forward in flight may not have written its KV: none of it committed.
                assert all(
                    r.committed <= r.computed - r.in_flight for r in engine.scheduler.running
                )
            return plan

        engine.scheduler.schedule = counted  # type: ignore[method-assign]
    prepared = prepared_ahead = 0
    computing = False  # inside ``_overlapped``: a forward launched and not read back
    prepare, overlapped = engine._prepare, engine._overlapped

    def counted_prepare(plan: list) -> object:
        nonlocal prepared, prepared_ahead
        prepared += 1
        prepared_ahead += computing
        return prepare(plan)

    def flagged(*args: object) -> None:
        nonlocal computing
        computing = True
        try:
            overlapped(*args)
        finally:
            computing = False

    engine._prepare = counted_prepare  # type: ignore[method-assign]
    engine._overlapped = flagged  # type: ignore[method-assign]
    # Arrivals every step: preemptions fall in decode steps too, planned ahead with overlap.
    done = engine.run(make_requests(16, arrival_every=1))
    assert {r.request_id: r.output for r in done} == reference_outputs(built, make_requests(16))
    assert engine.graphs.replays > 0
    assert engine.graphs.replays < engine.stats.forwards  # the prefills ran the usual way
    assert engine.scheduler.stats.preemptions > 0
    assert engine.scheduler.stats.hit_tokens > 0
    stats = engine.stats
    if overlap:
        # Every step (one forward: replayed decodes, eager prefills) planned the next one,
        # some of them while a prefill chunk computed; on the CPU none is hidden.
        assert stats.planned_ahead == stats.forwards and ahead_of_prefill > 0
        # Each plan made ahead had its slot mappings cut and its tables taken then too (the
        # last one, made during the last forward with nothing left, is no step).
        assert prepared_ahead == stats.planned_ahead and prepared == stats.steps + 1
        assert stats.hidden == 0 and stats.kvcm_exposed_s == pytest.approx(stats.kvcm_s)
        # Llama's run (this workload and pool) preempts in two decode steps planned ahead.
        assert preempted_ahead > 0 or family != "llama"
    else:
        assert stats.planned_ahead == 0 and prepared_ahead == 0 and prepared == stats.steps
    assert all(UNKNOWN not in r.output for r in done)


def test_overlap_choice() -> None:
    """auto: on wherever the decodes run on the graphs' buffers; forced on, it needs them;
    any other value is refused."""
    llama = build_model("llama")
    manager = _manager(llama)
    assert not Engine(llama, Backend.in_process(manager), attention="paged").overlap
    assert Engine(llama, Backend.in_process(manager), attention="paged", cuda_graphs=True).overlap
    with pytest.raises(ValueError, match="overlap needs the decode graphs"):
        Engine(llama, Backend.in_process(manager), attention="paged", overlap=True)
    with pytest.raises(ValueError, match="overlap must be"):
        Engine(llama, Backend.in_process(manager), overlap="yes")  # type: ignore[arg-type]


def test_settle_and_unknown_tokens() -> None:
    """A token emitted unknown is settled once; a waiting request whose last token is still
    unknown is never allocated (its token ids would go to kvcm's prefix cache)."""
    r = Request("a", [5, 6], max_new_tokens=3)
    r.emit(UNKNOWN)
    r.settle(9)
    assert r.output == [9] and r.seq == [5, 6, 9]
    with pytest.raises(RuntimeError, match="already known"):
        r.settle(10)
    llama = build_model("llama")
    scheduler = Scheduler(
        Backend.in_process(_manager(llama)).kvcm, chunk=8, max_batch_tokens=8, max_running=2
    )
    waiting = Request("b", [1, 2, 3], max_new_tokens=2)
    waiting.emit(UNKNOWN)
    scheduler.add(waiting)
    with pytest.raises(RuntimeError, match="not known yet"):
        scheduler.schedule()


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


def _planning_engine(built: BuiltModel) -> Engine:
    """A small in-process engine on the static buffers that plans each step ahead (the CPU
    runs the graphs' forward eagerly): chunks of 16, 48 tokens a step, 4 requests."""
    return Engine(
        built,
        Backend.in_process(_manager(built)),
        chunk=16,
        max_batch_tokens=48,
        max_running=4,
        attention="paged",
        cuda_graphs=True,
    )


@pytest.mark.parametrize("replayed", [False, True])
def test_a_failed_plan_ahead_leaves_no_unknown_token(replayed: bool) -> None:
    """kvcm refuses the call planned ahead of the first forward that emits tokens (an eager
    prefill) or of the first replayed decode: the forward's tokens are still read back and
    settled (none stays ``UNKNOWN``, none in flight), and the error reaches the caller."""
    llama = build_model("llama")
    engine = _planning_engine(llama)
    assert engine.graphs is not None
    schedule = engine.scheduler.schedule

    def failing() -> list:
        unknown = any(r.output and r.output[-1] == UNKNOWN for r in engine.scheduler.running)
        if unknown and (engine.graphs.replays > 0) == replayed:
            raise RuntimeError("kvcm refused part of a step")
        return schedule()

    engine.scheduler.schedule = failing  # type: ignore[method-assign]
    requests = make_requests(4, arrival_every=0)
    with pytest.raises(RuntimeError, match="refused"):
        engine.run(requests)
    assert engine.graphs.replays == int(replayed)
    # The failed plan was made during the last forward, whose tokens were still counted.
    assert engine.stats.forwards == engine.stats.planned_ahead + 1
    decoded = [r for r in requests if r.output]
    assert decoded and all(UNKNOWN not in r.output for r in decoded)
    assert all(r.in_flight == 0 for r in requests)


@pytest.mark.slow
def test_suspends_planned_ahead_equal_generate() -> None:
    """Preemption by suspend (a host tier) with steps planned ahead: victims chosen while a
    decode forward is in flight (their last tokens uncommitted) go to the host tier and come
    back; every token equals transformers' generate and every block is back at the end."""
    llama = build_model("llama")
    m = _manager(llama, host_memory_bytes=1 << 22)
    engine = Engine(
        llama,
        Backend.in_process(m),
        chunk=16,
        max_batch_tokens=48,
        max_running=12,
        attention="paged",
        cuda_graphs=True,
        preempt="suspend",
    )
    schedule = engine.scheduler.schedule
    suspended_ahead = 0

    def counted() -> list:
        nonlocal suspended_ahead
        before = engine.scheduler.stats.suspends
        ahead = any(r.output and r.output[-1] == UNKNOWN for r in engine.scheduler.running)
        plan = schedule()
        suspended_ahead += (engine.scheduler.stats.suspends - before) if ahead else 0
        return plan

    engine.scheduler.schedule = counted  # type: ignore[method-assign]
    done = engine.run(make_requests(16, arrival_every=1))
    assert {r.request_id: r.output for r in done} == reference_outputs(llama, make_requests(16))
    stats = engine.scheduler.stats
    assert suspended_ahead > 0 and stats.resumes == stats.suspends
    assert m.request_ids() == [] and m.num_free_blocks() == m.num_total_blocks()


def test_a_plan_ahead_whose_preparing_fails_is_kept_and_runs_later() -> None:
    """Preparing a plan made ahead fails (its slot mappings cut while a forward computes):
    the error reaches the caller, the plan, whose kvcm call already ran, is kept, and the
    engine run again prepares it at its step and finishes with transformers' tokens."""
    llama = build_model("llama")
    engine = _planning_engine(llama)
    prepare = engine._prepare
    calls = 0

    def failing_once(plan: list) -> object:
        nonlocal calls
        calls += 1
        if calls == 6:
            raise RuntimeError("out of memory while cutting the mappings")
        return prepare(plan)

    engine._prepare = failing_once  # type: ignore[method-assign]
    requests = make_requests(4, arrival_every=0)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.run(requests)
    assert engine._ahead is not None and engine._ahead[3] is None  # kept, not prepared
    assert all(UNKNOWN not in r.output for r in requests)
    done = engine.run([])
    assert calls > 7
    assert {r.request_id: r.output for r in done} == reference_outputs(llama, make_requests(4))
