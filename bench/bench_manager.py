"""In-process manager benchmarks, each against a per-block pure-Python baseline run alongside.

  python bench/bench_manager.py            # full run (about a minute)
  python bench/bench_manager.py --quick    # smoke run with small sizes

1. Decode step: +1 token for each of N running requests (block size 16, staggered lengths so
   that block boundaries fall on different steps), through ``extend_many`` and through
   ``step([ExtendOp, ...])``, for a full-attention model and a sliding+full hybrid.
2. allocate + free of one 8k-token request, in blocks per second.
3. Construction of a manager with a 1M-block pool.

The baseline is the classic Python design: a deque of free block ids, a list of blocks per
request, a Python loop over requests per step and over blocks per allocation. Ratios are
baseline time / kvcm time, measured in the same process.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections import deque

import numpy as np

from kvcm import KVCacheManager
from kvcm_client.models import ExtendOp

TPB = 16


def _layers(hybrid: bool) -> list[dict[str, object]]:
    layers: list[dict[str, object]] = []
    for i in range(4):
        spec: dict[str, object] = {"layer_id": i, "num_kv_heads": 1, "head_dim": 8}
        if hybrid and i % 2 == 0:
            spec |= {"sliding_window": 512, "sink_tokens": 4}
        layers.append(spec)
    return layers


class BaselineManager:
    """Per-block Python bookkeeping (one block list per request and layer group)."""

    def __init__(self, num_blocks: int, windows: list[int | None]) -> None:
        self.free = deque(range(num_blocks))
        self.windows = windows
        self.reqs: dict[str, tuple[list[int], list[list[int]], list[int]]] = {}

    def allocate(self, rid: str, n: int) -> None:
        blocks = []
        for _ in self.windows:
            row = [self.free.popleft() for _ in range(-(-n // TPB))]
            blocks.append(row)
        self.reqs[rid] = ([n], blocks, [1] * len(self.windows))

    def extend_one(self, rid: str) -> None:
        length, blocks, released = self.reqs[rid]
        h = length[0]
        for g, window in enumerate(self.windows):
            row = blocks[g]
            if window is not None:
                stale = (h + 1 - window) // TPB
                while released[g] < stale:  # the sink block 0 is never released
                    self.free.append(row[released[g]])
                    row[released[g]] = -1
                    released[g] += 1
            if len(row) * TPB < h + 1:
                row.append(self.free.popleft())
        length[0] = h + 1

    def free_request(self, rid: str) -> None:
        _, blocks, _ = self.reqs.pop(rid)
        for row in blocks:
            for b in reversed(row):
                if b >= 0:
                    self.free.append(b)


def _median_ns(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times)


def bench_decode(n: int, hybrid: bool, steps: int, **config: object) -> tuple[float, float, float]:
    """us per request per step: extend_many, step(ops), baseline; ``config`` adds manager
    settings (e.g. ``null_page=True``)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 2000, size=n)
    blocks = n * (2 * (2000 + 2 * steps) // TPB + 4)
    cfg = {
        "layers": _layers(hybrid),
        "tokens_per_block": TPB,
        "max_requests": n,
        "max_seq_len": 2000 + 3 * steps + 16,
        "num_blocks": blocks,
        **config,
    }
    ids = [f"req-{i}" for i in range(n)]

    m = KVCacheManager(cfg)
    for rid, length in zip(ids, lengths, strict=True):
        m.allocate(rid, int(length))
    t_many = _median_ns(lambda: m.extend_many(ids), steps)

    m = KVCacheManager(cfg)
    for rid, length in zip(ids, lengths, strict=True):
        m.allocate(rid, int(length))
    ops = [ExtendOp(request_id=rid, num_new_tokens=1) for rid in ids]
    t_step = _median_ns(lambda: m.step(ops), steps)

    base = BaselineManager(blocks, [512, None] if hybrid else [None])
    for rid, length in zip(ids, lengths, strict=True):
        base.allocate(rid, int(length))

    def base_step() -> None:
        for rid in ids:
            base.extend_one(rid)

    t_base = _median_ns(base_step, steps)
    return t_many / n / 1e3, t_step / n / 1e3, t_base / n / 1e3


def bench_alloc_free(tokens: int, repeats: int) -> tuple[float, float]:
    """Blocks per second for allocate + free of one request: kvcm, baseline."""
    cfg = {
        "layers": _layers(False),
        "tokens_per_block": TPB,
        "max_requests": 4,
        "max_seq_len": tokens,
        "num_blocks": 4 * tokens // TPB,
    }
    m = KVCacheManager(cfg)

    def kvcm_once() -> None:
        m.allocate("r", tokens)
        m.free("r")

    base = BaselineManager(4 * tokens // TPB, [None])

    def base_once() -> None:
        base.allocate("r", tokens)
        base.free_request("r")

    nblocks = tokens // TPB
    for _ in range(10):
        kvcm_once()
        base_once()
    return nblocks / (_median_ns(kvcm_once, repeats) / 1e9), nblocks / (
        _median_ns(base_once, repeats) / 1e9
    )


def bench_construct(num_blocks: int) -> tuple[float, float]:
    cfg = {
        "layers": _layers(False),
        "tokens_per_block": TPB,
        "max_requests": 1024,
        "max_seq_len": 32768,
        "num_blocks": num_blocks,
    }
    t0 = time.perf_counter()
    KVCacheManager(cfg)
    t_kvcm = time.perf_counter() - t0
    t0 = time.perf_counter()
    BaselineManager(num_blocks, [None])
    return t_kvcm, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args()
    steps = 20 if args.quick else 300
    sizes = [64] if args.quick else [64, 256, 1024]
    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.processor() or platform.machine()}, "
        f"python {platform.python_version()}, numpy {np.__version__}"
    )
    print("\n## decode step (+1 token per request, us per request per step, median)")
    print("| model | N | extend_many | step(ops) | baseline | baseline / extend_many |")
    print("|---|---|---|---|---|---|")
    for hybrid in (False, True):
        for n in sizes:
            many, step, base = bench_decode(n, hybrid, steps)
            name = "sliding+full" if hybrid else "full"
            print(f"| {name} | {n} | {many:.3f} | {step:.3f} | {base:.3f} | {base / many:.1f}x |")
    tokens = 1024 if args.quick else 8192
    kv, base = bench_alloc_free(tokens, 50 if args.quick else 2000)
    print(f"\n## allocate + free of a {tokens}-token request (blocks per second, median)")
    print("| kvcm | baseline | ratio |\n|---|---|---|")
    print(f"| {kv / 1e6:.1f}M | {base / 1e6:.1f}M | {kv / base:.1f}x |")
    nb = 10_000 if args.quick else 1_000_000
    t_kvcm, t_base = bench_construct(nb)
    print(f"\n## construction with a {nb}-block pool (seconds)")
    print(f"| kvcm | baseline (deque only) |\n|---|---|\n| {t_kvcm:.3f} | {t_base:.3f} |")


if __name__ == "__main__":
    main()
