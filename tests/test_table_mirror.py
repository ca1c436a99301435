"""An engine's own copy of the page tables, kept by the edits each step answers
(``step_columns(..., table_edits=True)``, kvcm.table_mirror): after every step of an
engine-like workload (chunked prefill, decode with lookahead and rejected drafts in the same
step, sliding windows with sinks, prefix hits, frees, out_of_blocks, all-or-nothing steps
undone) the mirror equals the
manager's kernel-facing tables, in process, over HTTP and over the step channel."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import layer, manager
from servers import serve_process, small_model_args

from kvcm_client import KVCacheClient
from kvcm_client.errors import InvalidArgument

LAYERS = [layer(0), layer(1, sliding_window=8, sink_tokens=4), layer(2, kv_factor=1)]


def workload(kv: Any, tables: Any, empty: int, rng: random.Random, steps: int = 60) -> int:
    """Random engine steps through ``kv`` (a manager or a client); after each, the mirror
    built from the answers' edits equals ``tables()``. Returns the edits applied."""
    mirror = np.full(np.asarray(tables()).shape, empty, dtype=np.int64)
    live: dict[int, int] = {}  # handle -> tokens
    prompts: dict[int, list[int]] = {}  # allocated last step: their prompts commit now
    applied = 0
    serial = 0
    for _ in range(steps):
        commit, commit_tokens = list(prompts), list(prompts.values())
        prompts = {}
        free = [h for h in live if rng.random() < 0.15]
        extend = [h for h in live if h not in free]
        counts = [rng.choice([1, 1, 1, 4, 8]) for _ in extend]
        rewind = [h for h in extend if rng.random() < 0.2 and live[h] > 3 and h not in commit]
        allocate = []
        for _ in range(rng.randint(0, 2)):
            serial += 1
            n = rng.randint(1, 20)
            prompt = [rng.choice([1, 2]) for _ in range(n)]  # shared prefixes: hits
            allocate.append({"request_id": f"r{serial}", "num_tokens": n, "token_ids": prompt})
        out = kv.step_columns(
            commit=commit,
            commit_tokens=commit_tokens,
            free=free,
            rewind=rewind,
            rewind_tokens=[2] * len(rewind) or 1,
            extend=extend,
            num_new_tokens=counts or 1,
            lookahead=[rng.choice([0, 2]) for _ in extend] or 0,
            allocate=allocate,
            atomic=rng.random() < 0.2,  # all or nothing: an undone step edits nothing
            table_edits=True,
        )
        if out.failed is not None:  # undone: nothing happened
            edits = np.asarray(out.table_edits, dtype=np.int64).reshape(-1, 4)
            mirror[edits[:, 0], edits[:, 1], edits[:, 2]] = edits[:, 3]
            assert np.array_equal(mirror, np.asarray(tables())), "an undone step drifted"
            continue
        for h, s in zip(free, out.status["free"], strict=True):
            if s == 0:
                del live[h]
        status_rewind = list(out.status["rewind"])
        for h, s in zip(rewind, status_rewind, strict=True):
            if s == 0:
                live[h] -= 2
        for h, n, s in zip(extend, counts, out.status["extend"], strict=True):
            if s == 0:
                live[h] += n
        done = zip(allocate, out.status["allocate"], out.handles, out.hit_tokens, strict=True)
        for op, s, h, hit in done:
            if s == 0:
                live[int(h)] = op["num_tokens"]
                if op["token_ids"][hit:]:
                    prompts[int(h)] = op["token_ids"][hit:]  # computed: committed next step
        edits = np.asarray(out.table_edits, dtype=np.int64).reshape(-1, 4)
        mirror[edits[:, 0], edits[:, 1], edits[:, 2]] = edits[:, 3]
        applied += edits.shape[0]
        assert np.array_equal(mirror, np.asarray(tables())), "the mirror drifted"
        for h in [h for h in prompts if h not in live]:
            del prompts[h]
        while sum(live.values()) > 160:  # keep it mostly fitting: free the longest
            h = max(live, key=live.__getitem__)
            kv.step_columns(free=[h])
            del live[h]
    return applied


@pytest.mark.parametrize("null_page", [False, True])
def test_in_process_mirror_follows_every_step(null_page: bool) -> None:
    m = manager(LAYERS, num_blocks=40, null_page=null_page, max_requests=8)
    empty = 0 if null_page else -1
    applied = workload(m, lambda: m.page_tables().numpy(), empty, random.Random(7))
    assert applied > 50
    m.table_edits()  # the workload's last frees
    # Nothing changed since: a take, and a step that changes nothing, answer nothing.
    assert m.table_edits().shape == (0, 4)
    assert m.step_columns(table_edits=True).table_edits.shape == (0, 4)


def test_the_first_answer_lists_every_page_and_then_only_changes() -> None:
    """tokens_per_block 4: a 6-token request holds blocks 0 and 1 in each group; the first
    edits list them (a mirror that starts empty converges); freeing it empties them."""
    m = manager([layer(0)], num_blocks=8)
    m.allocate("a", 6)
    first = m.table_edits()
    slots = m.block_table("a")[0]
    assert first.tolist() == [[0, 0, 0, slots[0]], [0, 0, 1, slots[1]]]
    m.free("a")
    assert m.table_edits().tolist() == [[0, 0, 0, -1], [0, 0, 1, -1]]
    assert m.table_edits().tolist() == []


@pytest.mark.parametrize("channel", [False, True])
def test_the_mirror_over_the_sidecar(channel: bool, tmp_path: Path) -> None:
    args, sock = small_model_args(tmp_path, LAYERS)
    with (
        serve_process(*args) as (url, _, _),
        KVCacheClient(url, step_socket=sock if channel else None) as kv,
        kv.attach() as att,
    ):
        empty = 0 if kv.model().config.null_page else -1
        applied = workload(kv, lambda: att.page_tables.numpy(), empty, random.Random(11), 40)
        assert applied > 30


def test_refused_where_device_tables_consume_the_edits() -> None:
    """Context-parallel ranks keep tables of their own, fed by the edit log: no mirror."""
    ranks = [{"device": "cpu", "layers": [layer(0)], "cp_rank": c} for c in range(2)]
    m = manager([layer(0)], num_blocks=16, context_parallel=2, ranks=ranks)
    with pytest.raises(InvalidArgument, match="table_edits needs page tables"):
        m.table_edits()
    # A step that asks for them fails whole, before it runs: nothing allocated.
    with pytest.raises(InvalidArgument, match="table_edits needs page tables"):
        m.step_columns(allocate=[{"request_id": "a", "num_tokens": 4}], table_edits=True)
    assert m.request_ids() == []
    out = m.step_columns(allocate=[{"request_id": "a", "num_tokens": 4}])
    assert out.ok  # the refusal changed nothing
    handles = np.array([out.handles[0], m.allocate("b", 4).handle])
    with pytest.raises(InvalidArgument, match="table_edits needs page tables"):
        m.decode_step(handles, table_edits=True)
    assert m.request("a").num_tokens == m.request("b").num_tokens == 4
