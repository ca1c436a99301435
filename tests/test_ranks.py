"""One manager for the ranks of a tensor- and pipeline-parallel engine (kvcm.ranks,
docs/ranks.md), on CPU "devices": one allocator and one set of block ids, pools and views per
rank, consistency checks, budgets, edit queues, and consumers of every rank through a real
``kvcm serve`` process, checked against dense attention."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from servers import serve_process
from test_shared_consumer import dense

from kvcm import KVCacheManager
from kvcm.device_tables import EditQueues
from kvcm_client import KVCacheClient
from kvcm_client.errors import InsufficientMemory, InvalidArgument, OutOfBlocks
from kvcm_client.paged_attention import attention, write_kv

TPB = 4


def spec(i: int, heads: int = 2, window: int | None = None, **kw: Any) -> dict[str, Any]:
    out = {"layer_id": i, "num_kv_heads": heads, "head_dim": 8, "dtype": "fp32"}
    if window is not None:
        out |= {"sliding_window": window, "sink_tokens": 4}
    return out | kw


#: A 4-layer model (layers 0 and 2 full attention, 1 and 3 a window of 10 with 4 sink tokens,
#: 4 KV heads each) on TP 2 x PP 2: ranks 0 and 1 are stage 0 (global layers 0 and 1, two
#: heads each), ranks 2 and 3 stage 1 (global layers 2 and 3, rank-local ids 1 and 0, so
#: that its first layer is the window's: its groups are numbered like rank 0's anyway).
STAGE0 = [spec(0), spec(1, window=10)]
STAGE1 = [spec(1), spec(0, window=10)]
RANKS = [
    {"device": "cpu", "layers": STAGE0},
    {"device": "cpu", "layers": STAGE0},
    {"device": "cpu", "layers": STAGE1},
    {"device": "cpu", "layers": STAGE1},
]
#: (rank, rank-local layer id) -> the global layer and the heads this rank holds of it.
GLOBAL = {
    (0, 0): (0, slice(0, 2)),
    (0, 1): (1, slice(0, 2)),
    (1, 0): (0, slice(2, 4)),
    (1, 1): (1, slice(2, 4)),
    (2, 1): (2, slice(0, 2)),
    (2, 0): (3, slice(0, 2)),
    (3, 1): (2, slice(2, 4)),
    (3, 0): (3, slice(2, 4)),
}


def config(**kw: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "ranks": RANKS,
        "tokens_per_block": TPB,
        "max_requests": 4,
        "max_seq_len": 64,
        "num_blocks": 12,
    }
    return cfg | kw


# -- configuration ------------------------------------------------------------------------------


def test_layers_and_device_default_to_rank_zero() -> None:
    m = KVCacheManager(config())
    assert m.num_ranks == 4 and m.config.layers == m.config.ranks[0].layers
    assert m.config.device == "cpu"
    with pytest.raises(InvalidArgument) as exc:
        m.rank(4)
    assert exc.value.code == "invalid_argument" and exc.value.detail["num_ranks"] == 4
    assert KVCacheManager(config(ranks=[], layers=STAGE0)).num_ranks == 1  # one, as always


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"layers": [spec(0)]}, "rank_zero_mismatch"),
        ({"host_memory_bytes": 1 << 20}, "ranks_unsupported"),
        ({"ranks": [RANKS[0], {"device": "cpu", "layers": [spec(0, heads=0)]}]}, "no_kv_layers"),
        (
            {"ranks": [RANKS[0], {"device": "cpu", "layers": [spec(0), spec(0)]}]},
            "duplicate_layer_id",
        ),
    ],
)
def test_inconsistent_rank_configs_are_refused(change: dict[str, Any], code: str) -> None:
    with pytest.raises(ValidationError) as exc:
        KVCacheManager(config(**change))
    assert exc.value.errors()[0]["type"] == code


@pytest.mark.parametrize(
    ("layers", "says"),
    [
        ([spec(0), spec(1, window=12)], "same kinds of layers"),  # another window
        ([spec(0)], "same kinds of layers"),  # a stage without the window's group
        ([spec(0), spec(1, window=10, reuse="none")], "same kinds of layers"),
        # Equal page shapes put both groups in one pool group here, not on rank 0 (whose
        # window layer has 4 heads): one allocator could not serve both.
        ([spec(0), spec(1, window=10)], "pool groups"),
    ],
)
def test_ranks_must_agree_on_layer_groups_and_pool_groups(
    layers: list[dict[str, Any]], says: str
) -> None:
    first = [spec(0), spec(1, heads=4, window=10)]
    with pytest.raises(InvalidArgument, match=says) as exc:
        KVCacheManager(
            config(ranks=[{"device": "cpu", "layers": first}, {"device": "cpu", "layers": layers}])
        )
    assert exc.value.detail["rank"] == 1


# -- one bookkeeping, pools per rank ------------------------------------------------------------


def test_one_allocator_and_the_same_block_ids_on_every_rank() -> None:
    m = KVCacheManager(config())
    assert [m.rank(r).describe().layer_groups[1].sliding_window for r in range(4)] == [10] * 4
    assert [g.layer_ids for g in m.rank(2).describe().layer_groups] == [(1,), (0,)]
    a = m.allocate("a", 9)  # 3 blocks in each of the 2 groups of the one pool group
    b = m.allocate("b", 4)
    assert m.block_table("a") == [[0, 1, 2], [3, 4, 5]]
    assert m.block_table("b") == [[6], [7]]
    m.extend("b", 1)
    assert m.block_table("b") == [[6, 8], [7, 9]]
    assert m.num_free_blocks(0) == 2  # 12 slots, 10 held: one count for every rank
    for r in range(4):
        tables = m.rank(r).page_tables()
        assert tables[0, a.row, :3].tolist() == [0, 1, 2]
        assert tables[1, b.row, :3].tolist() == [7, 9, -1]
        assert torch.equal(m.rank(r).slot_mappings(["a", "b"]), m.slot_mappings(["a", "b"]))
    m.free("a")
    assert m.num_free_blocks(0) == 8 and int(m.rank(3).page_table(0)[a.row, 0]) == -1


def test_each_rank_has_its_own_pools_of_its_own_layers() -> None:
    m = KVCacheManager(
        config(
            ranks=[
                RANKS[0],
                {"device": "cpu", "layers": [spec(0, heads=1), spec(1, heads=1, window=10)]},
            ]
        )
    )
    assert m.kv_view(0).shape == (12, 2, TPB, 2, 8)
    assert m.rank(1).kv_view(0).shape == (12, 2, TPB, 1, 8)
    m.allocate("a", 4)
    slot = m.block_table("a")[0][0]
    m.kv_view(0)[slot] = 0.0
    m.rank(1).kv_view(0)[slot] = 7.0
    assert torch.all(m.kv_view(0)[slot] == 0.0)  # rank 1's write is not rank 0's
    m.kv_view(0)[slot] = 1.0
    assert torch.all(m.rank(1).kv_view(0)[slot] == 7.0)  # rank 0's write is not rank 1's
    assert m.rank(1).pointer_table()[0, 0] != m.pointer_table()[0, 0]


def test_copy_tokens_moves_the_kv_on_every_rank() -> None:
    m = KVCacheManager(config())
    m.allocate("a", 8)
    for r in range(4):
        m.rank(r).layer_view(0, "key")[m.block_table("a")[0][0], 1] = float(r + 1)
    m.copy_tokens(["a"], [1], [6])  # token 1 (block 0, offset 1) -> 6 (block 1, offset 2)
    dst = m.block_table("a")[0][1]
    for r in range(4):
        assert torch.all(m.rank(r).layer_view(0, "key")[dst, 2] == float(r + 1))


def test_a_budget_per_rank_gives_each_pool_group_the_fewest_slots_of_any_rank() -> None:
    """``memory_bytes`` is each rank's budget: a stage with twice the heads has slots twice
    as big, so its split has half the slots, and every rank gets that many."""
    small = [spec(0), spec(1, window=10)]
    big = [spec(0, heads=4), spec(1, heads=4, window=10)]
    budget = {"memory_bytes": 64 * 1024, "num_blocks": None}
    alone = [
        KVCacheManager(config(ranks=[], layers=ls, **budget)).num_total_blocks()
        for ls in (small, big)
    ]
    assert alone[0] > alone[1]
    both = KVCacheManager(
        config(
            ranks=[{"device": "cpu", "layers": small}, {"device": "cpu", "layers": big}], **budget
        )
    )
    assert both.num_total_blocks() == alone[1]
    fits = both.estimate(64).max_requests  # N fit, N + 1 do not, on every rank
    assert fits >= 1
    for i in range(fits):
        both.allocate(f"r{i}", 64)
    with pytest.raises(OutOfBlocks):
        both.allocate("one more", 64)


def test_edit_queues_give_every_rank_every_edit_once() -> None:
    """The CUDA ranks' tables take the coordinator's edits from per-rank queues: a rank that
    takes late gets everything since it last took, the last edit of each cell once. Run on
    the CPU's host tables: each rank replays its edits onto a copy of the tables."""
    m = KVCacheManager(config())
    c = m.parts.coord
    c.edits = []  # log edits as on CUDA
    queues = EditQueues(c, 3)
    copies = [c.tables.copy() for _ in range(3)]

    def replay(rank: int) -> None:
        edits = queues.take(rank)
        keys = edits[:, 0] * 10**6 + edits[:, 1] * 10**3 + edits[:, 2]
        assert np.unique(keys).size == keys.size  # one edit per cell
        copies[rank][edits[:, 0], edits[:, 1], edits[:, 2]] = edits[:, 3]

    m.allocate("a", 9)
    replay(0)
    m.extend("a", 4)
    m.free("a")
    m.allocate("b", 5)  # reuses cells "a" emptied: two edits of one cell to fold
    replay(0)
    replay(1)  # both batches at once
    assert np.array_equal(copies[0], c.tables) and np.array_equal(copies[1], c.tables)
    assert not np.array_equal(copies[2], c.tables)
    replay(2)
    assert np.array_equal(copies[2], c.tables)
    assert queues.take(0).shape == (0, 4)


# -- consumers of every rank, through the service -----------------------------------------------


def ranked_config(tmp_path: Path, device: str = "cpu") -> Path:
    """The TP 2 x PP 2 engine as a ``kvcm serve --config`` file, every rank on ``device``."""
    path = tmp_path / "cfg.json"
    ranks = [r | {"device": device} for r in RANKS]
    path.write_text(json.dumps(config(ranks=ranks, num_blocks=40, share=True)))
    return path


@pytest.fixture
def ranked_service(tmp_path: Path) -> Any:
    with serve_process("--config", str(ranked_config(tmp_path))) as (url, _proc, _):
        yield url


def _full_model_kv(gen: torch.Generator, n: int) -> dict[int, torch.Tensor]:
    """Per global layer, ``[2, n, 4 heads, 8]`` keys and values of n new tokens."""
    return {layer: torch.randn(2, n, 4, 8, generator=gen) for layer in range(4)}


def test_every_rank_attends_like_dense_attention_over_its_heads(ranked_service: str) -> None:
    every_rank_against_dense(ranked_service)


def every_rank_against_dense(url: str) -> None:
    """The scheduler steps the engine once (one sidecar; its slot mappings bring every
    rank's tables up to date); each rank writes its heads of its layers through its own
    attachment and its attention equals dense attention over those heads of the full
    model's keys and values, over prefill and 12 decode steps."""
    gen = torch.Generator().manual_seed(0)
    prompts = {"a": 9, "b": 6}
    history: dict[tuple[str, int], list[torch.Tensor]] = {}
    with KVCacheClient(url) as kv:
        atts = [kv.attach(rank=r) for r in range(4)]
        try:
            assert [a.layout.rank for a in atts] == [0, 1, 2, 3]
            for rid, n in prompts.items():
                kv.allocate(rid, n)
            new = dict(prompts)
            for step in range(13):
                if step:
                    kv.extend_many(list(prompts))
                    new = dict.fromkeys(prompts, 1)
                mappings = kv.slot_mappings(list(prompts))
                start = 0
                for rid, n in new.items():
                    info = kv.request(rid)
                    full = _full_model_kv(gen, n)
                    for layer in range(4):
                        history.setdefault((rid, layer), []).append(full[layer])
                    q = torch.randn(4, n, 8, 8, generator=gen)  # per global layer, 8 q heads
                    for (r, local), (layer, heads) in GLOBAL.items():
                        att = atts[r]
                        group = att.layout.layer_group_of[local]
                        slots = torch.tensor(mappings[group][start : start + n])
                        kv_new = full[layer][:, :, heads]
                        write_kv(att, local, slots, kv_new[0], kv_new[1])
                    for (r, local), (layer, heads) in GLOBAL.items():
                        att = atts[r]
                        q_heads = slice(heads.start * 2, heads.stop * 2)  # GQA 2:1
                        got = attention(att, local, info.row, info.num_tokens, q[layer][:, q_heads])
                        seen = torch.cat(history[(rid, layer)], dim=1)[:, :, heads]
                        spec_ = {"sliding_window": 10, "sink_tokens": 4} if layer % 2 else {}
                        want = dense(q[layer][:, q_heads], seen[0], seen[1], spec_)
                        assert torch.allclose(got.cpu(), want, atol=1e-5), (step, rid, r, local)
                    start += n
            for rid in prompts:
                kv.free(rid)
        finally:
            for att in atts:
                att.close()
        with pytest.raises(InvalidArgument):
            kv.pools(rank=4)


@pytest.mark.slow
def test_a_process_per_rank_maps_its_own_ranks_pools(ranked_service: str) -> None:
    a_process_per_rank(ranked_service)


def a_process_per_rank(url: str) -> None:
    """One consumer process per rank attaches its rank and reads back what this process
    wrote into that rank's pool at a request's first block: each sees its own rank's value."""
    with KVCacheClient(url) as kv:
        kv.allocate("p", 4)
        slot = kv.block_table("p")[0][0]
        atts = [kv.attach(rank=r) for r in range(4)]
        for r, att in enumerate(atts):
            att.layer_view(0, "key")[slot] = float(10 + r)
        if atts[0].layer_view(0, "key").is_cuda:
            torch.cuda.synchronize()  # the writes are done before another process reads
        code = (
            "import sys; from kvcm_client import KVCacheClient\n"
            "r, slot = int(sys.argv[2]), int(sys.argv[3])\n"
            "with KVCacheClient(sys.argv[1]) as kv, kv.attach(rank=r) as att:\n"
            "    print(float(att.layer_view(0, 'key')[slot].mean()), att.layout.rank)\n"
        )
        procs = [
            subprocess.run(
                [sys.executable, "-c", code, url, str(r), str(slot)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            for r in range(4)
        ]
        for att in atts:
            att.close()
    for r, proc in enumerate(procs):
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == [f"{10 + r:.1f}", str(r)]


def test_an_undo_after_a_rank_took_the_edits_edits_the_cells_back() -> None:
    """A read inside a transaction takes its edits to a rank's tables (and queues them for
    the others); the undo then logs edits that put every cell back, so no rank keeps a
    block the host no longer has."""
    m = KVCacheManager(config())
    c = m.parts.coord
    c.edits = []
    queues = EditQueues(c, 2)
    copies = [c.tables.copy() for _ in range(2)]

    def replay(rank: int) -> None:
        edits = queues.take(rank)
        copies[rank][edits[:, 0], edits[:, 1], edits[:, 2]] = edits[:, 3]

    m.allocate("a", 5)
    replay(0)
    with m.transaction() as undo:
        m.allocate("b", 9)
        m.extend("a", 4)
        replay(0)  # rank 0 applied b's blocks and a's new one; rank 1 has them queued
        assert copies[0][0, m.request("b").row, :3].tolist() == [4, 5, 6]
        undo()
    replay(0)
    replay(1)
    assert np.array_equal(copies[0], c.tables) and np.array_equal(copies[1], c.tables)
    assert m.request_ids() == ["a"] and m.block_table("a") == [[0, 1], [2, 3]]


def test_a_queue_nobody_reads_stays_bounded() -> None:
    m = KVCacheManager(config(num_blocks=64))
    c = m.parts.coord
    c.edits = []
    queues = EditQueues(c, 2)
    for i in range(300):
        m.allocate(f"r{i}", 5)
        queues.take(0)
        m.free(f"r{i}")
        queues.take(0)
    assert len(queues._queues[1]) <= EditQueues.FOLD
    copy = np.full_like(c.tables, c.empty)
    edits = queues.take(1)
    copy[edits[:, 0], edits[:, 1], edits[:, 2]] = edits[:, 3]
    assert np.array_equal(copy, c.tables)


def test_a_budget_too_small_for_another_rank_names_that_rank() -> None:
    """Rank 1 (16 heads) limits the split: the refusal gives its numbers, which a retry
    with ``max_seq_len_that_fits`` then satisfies."""
    ranks = [
        {"device": "cpu", "layers": [spec(0, heads=2)]},
        {"device": "cpu", "layers": [spec(0, heads=16)]},
    ]
    cfg = config(ranks=ranks, memory_bytes=40960, num_blocks=None)
    with pytest.raises(InsufficientMemory) as exc:
        KVCacheManager(cfg)
    fits = exc.value.detail["max_seq_len_that_fits"]
    assert exc.value.detail["rank"] == 1 and fits < 64
    KVCacheManager(cfg | {"max_seq_len": fits})
