"""In-process cost of the step-path calls (issue 13's targets), each timed in the same run.

  python bench/bench_columnar.py            # ~1 min
  python bench/bench_columnar.py --quick    # a smoke run
  python bench/bench_columnar.py --compare-native   # with the C core and without (~5 min)

Workloads (block size 16, 4 full-attention layers of 1 KV head; every request has room):

- ``decode``: ``step_columns(extend=handles)``, +1 token for each of N = 256 running requests
  whose lengths are staggered, so that about 1/16 of them cross a block boundary per step.
- ``decode + 256 one-token commits``: the decode step plus a commit of each request's last
  token (what the example engine sends: a request's computed tokens are committed every
  step); about 1/16 of the commits fill a block and publish it.
- ``decode, a window``: the same with a 128-token sliding window in layers 1 and 3 (two layer
  groups): about 1/16 of the rows also release a block per step.
- ``mixed``: the same 256 extends plus 2 frees, 2 allocates of 512-token prompts with prefix
  hashing (token ids given: each prompt is hashed, its first 256 tokens hit the cache) and 16
  commits of 16 tokens (one full block each, published), in one ``step_columns`` call.
- ``typed step``: ``step([ExtendOp] * 256)``, per op (models in, ``OpResult`` models out).
- ``extend()``: one single-op ``extend`` (returns a ``RequestInfo``).
- ``publish``: ``commit`` of a whole 8192-token request (512 blocks keyed and published),
  per block; allocate computed the prompt's keys, so commit reuses them.
- ``extend_many`` by string ids over the same 256 requests: the per-id baseline.
- ``decode with table_edits``: the decode step answering the page-table cells it changed
  (``kvcm.table_mirror``: one compare of the host tables against their shadow), beside the
  plain decode row.
- ``decode with one stale handle``: the decode step with a freed request's handle appended
  (a scheduler that missed a free): that item fails alone, the 256 others still run as one
  batch.

Each row is the median of repeated runs, in microseconds.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from kvcm import KVCacheManager
from kvcm_client.models import ExtendOp

TPB = 16
N = 256


def _manager(
    num_blocks: int = 400_000, max_seq_len: int = 1 << 20, window: int | None = None
) -> KVCacheManager:
    layers: list[dict[str, object]] = [
        {"layer_id": i, "num_kv_heads": 1, "head_dim": 8} for i in range(4)
    ]
    if window is not None:  # every other layer, as in Gemma or gpt-oss
        for spec in layers[1::2]:
            spec["sliding_window"] = window
    return KVCacheManager(
        {
            "layers": layers,
            "tokens_per_block": TPB,
            "num_blocks": num_blocks,
            "max_requests": 1024,
            "max_seq_len": max_seq_len,
        }
    )


def _median_us(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter_ns() - t0) / inner / 1000)
    return statistics.median(samples)


def _running(m: KVCacheManager, n: int) -> tuple[list[str], np.ndarray]:
    ids = [f"r{i}" for i in range(n)]
    handles = np.array([m.allocate(r, 100 + i).handle for i, r in enumerate(ids)])
    return ids, handles


def bench(repeats: int) -> dict[str, float]:
    rows: dict[str, float] = {}
    m = _manager()
    ids, handles = _running(m, N)
    rows["decode: step_columns, N=256"] = _median_us(
        lambda: m.step_columns(extend=handles), repeats, 20
    )
    rows["baseline: extend_many by id, N=256"] = _median_us(lambda: m.extend_many(ids), repeats, 20)
    # The example engine's decode step: every running request commits its last token.
    c = _manager()
    cids, chandles = _running(c, N)
    rng = np.random.default_rng(1)
    for i, rid in enumerate(cids):
        c.commit(rid, rng.integers(0, 50_000, 100 + i).tolist())
    token_lists = [[[int(t)] for t in rng.integers(0, 50_000, N)] for _ in range(64)]
    handle_list = chandles.tolist()
    turn = {"k": 0}

    def decode_commit() -> None:
        turn["k"] += 1
        c.step_columns(
            commit=handle_list, commit_tokens=token_lists[turn["k"] % 64], extend=chandles
        )

    rows["decode + 256 one-token commits, N=256"] = _median_us(decode_commit, repeats, 5)
    w = _manager(window=128)
    _, window_handles = _running(w, N)
    rows["decode, a 128-token window in every other layer, N=256"] = _median_us(
        lambda: w.step_columns(extend=window_handles), repeats, 20
    )
    e = _manager()
    if hasattr(e, "table_edits"):  # (ab_columnar runs this script against older trees too)
        _, edit_handles = _running(e, N)
        e.table_edits()  # the first answer lists every page; the steps' answers, changes
        rows["decode with table_edits (an engine's own copy of the tables), N=256"] = _median_us(
            lambda: e.step_columns(extend=edit_handles, table_edits=True), repeats, 20
        )
    stale = m.allocate("stale", 1).handle
    m.free("stale")
    with_stale = np.append(handles, stale)
    rows["decode with one stale handle, N=256 + 1"] = _median_us(
        lambda: m.step_columns(extend=with_stale), repeats, 20
    )

    # mixed: a long-lived cached prefix; each step frees the two requests it allocated last
    # step and allocates two new ones that share the prefix.
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 50_000, 256).tolist()
    m.allocate("prefix", 256, token_ids=prefix)
    m.commit("prefix", prefix)
    m.free("prefix")
    committers = [m.allocate(f"c{i}", 1 << 14).handle for i in range(16)]
    state = {"new": [m.allocate(f"n{i}", 512).handle for i in range(2)], "count": 0}
    block = list(range(TPB))

    # Prompts are made up front (the caller's work, not the step's): a shared 256-token
    # prefix, then 256 tokens of their own. Never committed, so they never hit each other.
    prompts = [prefix + rng.integers(0, 50_000, 256).tolist() for _ in range(64)]

    def next_allocs() -> list[dict[str, object]]:
        """This step's two 512-token allocates (fresh ids, the next two prompts)."""
        k = state["count"]
        state["count"] = k + 1
        return [
            {"request_id": f"p{k}-{j}", "num_tokens": 512, "token_ids": prompts[(2 * k + j) % 64]}
            for j in range(2)
        ]

    def mixed() -> None:
        allocs = next_allocs()
        out = m.step_columns(
            free=state["new"],
            commit=committers,
            commit_tokens=[block] * 16,
            extend=handles,
            allocate=allocs,
        )
        state["new"] = out.handles.tolist()

    rows["mixed: 256 extends + 2 frees + 2 allocates (512) + 16 commits"] = _median_us(
        mixed, repeats, 5
    )

    # The parts of the mixed step, each alone.
    def turnover() -> None:
        allocs = next_allocs()
        state["new"] = m.step_columns(free=state["new"], allocate=allocs).handles.tolist()

    rows["  part: 2 frees + 2 allocates (512, hashed)"] = _median_us(turnover, repeats, 5)
    rows["  part: 16 commits of one block each"] = _median_us(
        lambda: m.step_columns(commit=committers, commit_tokens=[block] * 16), repeats, 5
    )
    ops = [ExtendOp(request_id=r, num_new_tokens=1) for r in ids]
    rows["typed step(ops), per op"] = _median_us(lambda: m.step(ops), repeats, 2) / N
    rows["single extend()"] = _median_us(lambda: m.extend("r0", 1), repeats, 200)

    # publish: allocate keyed the prompt; commit publishes 512 blocks.
    p = _manager(num_blocks=4096, max_seq_len=8192)
    tokens = rng.integers(0, 50_000, 8192).tolist()
    times = []
    for i in range(max(repeats // 4, 3)):
        p.allocate(f"q{i}", 8192, token_ids=[*tokens[:-1], i])  # distinct last block
        t0 = time.perf_counter_ns()
        p.commit(f"q{i}", [*tokens[:-1], i])
        times.append((time.perf_counter_ns() - t0) / 1000 / (8192 // TPB))
        p.free(f"q{i}")
        p.reset_prefix_cache()
    rows["publish an 8k-token request, per block"] = statistics.median(times)
    return rows


TARGETS = {
    "decode: step_columns, N=256": 20.0,
    "mixed: 256 extends + 2 frees + 2 allocates (512) + 16 commits": 60.0,
    "typed step(ops), per op": 2.0,
    "single extend()": 3.0,
    "publish an 8k-token request, per block": 0.5,
}


def compare_native(repeats: int, rounds: int) -> None:
    """Every row with the C core and without it (``kvcm.native.use``), alternating whole
    runs ``rounds`` times, each side's median per row (the VM's speed drifts in minutes)."""
    from kvcm import native  # here: bench() also runs on trees without it (ab_columnar)

    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(rounds):
        for on in (True, False):
            native.use(on)
            runs[on].append(bench(repeats))
            print(f"round {r + 1}/{rounds}, C core {'on' if on else 'off'}", file=sys.stderr)
    native.use(True)
    print("| workload | C core us | numpy path us | numpy / C | target us |")
    print("|---|---|---|---|---|")
    for name in runs[True][0]:
        c = statistics.median(run[name] for run in runs[True])
        py = statistics.median(run[name] for run in runs[False])
        target = TARGETS.get(name)
        print(
            f"| {name} | {c:.2f} | {py:.2f} | {py / c:.2f}x | "
            f"{'' if target is None else f'{target:g}'} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--compare-native",
        action="store_true",
        help="each row with the C core (kvcm._native) and with the numpy path, same run",
    )
    args = parser.parse_args()
    from kvcm import native

    print(f"{platform.node()} {platform.processor() or platform.machine()}; {native.summary()}")
    if args.compare_native:
        if not native.available():
            sys.exit("kvcm._native is not built: nothing to compare")
        compare_native(5 if args.quick else 20, 1 if args.quick else 3)
        return
    rows = bench(5 if args.quick else 40)
    print("| workload | us | target us |")
    print("|---|---|---|")
    for name, us in rows.items():
        target = TARGETS.get(name)
        print(f"| {name} | {us:.2f} | {'' if target is None else f'{target:g}'} |")


if __name__ == "__main__":
    main()
