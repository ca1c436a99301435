"""The scheduler step as the number of ranks grows (kvcm.ranks): one bookkeeping for all,
the page-table edits applied on every rank.

  python bench/bench_ranks.py                  # the CPU (ranks share the host tables)
  python bench/bench_ranks.py --device cuda    # ranks on cuda:{r % device_count}
  python bench/bench_ranks.py --context-parallel   # the ranks are Helix CP ranks instead

Workload: a tensor-parallel engine, every rank with the same 4 layers (2 full attention, 2 of
a 512-token window, 2 KV heads x 128 each rank, bf16, 16-token blocks), 256 running
requests with staggered lengths. One step: ``step_columns(extend=handles)`` (+1 token each;
about 1/16 of them cross a block boundary) then ``slot_mappings`` of all 256, which on CUDA
applies the step's edits on rank 0 fused with the mapping and on every other rank in one
launch each (``KVCacheManager._sync_other_ranks``), synchronised. Each row: the median of
repeated steps and its ratio to one rank (target: 8 ranks at most 2x one). With
``--context-parallel`` the ranks are context-parallel ranks (Helix, ``context_parallel`` = the
number of ranks): each holds every layer for its share of the blocks, and its tables take the
edits of its own blocks, translated on the host.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvcm import KVCacheManager

N = 256


def _manager(ranks: int, device: str, cp: bool) -> KVCacheManager:
    layers = [
        {"layer_id": i, "num_kv_heads": 2, "head_dim": 128, "dtype": "bf16"}
        | ({"sliding_window": 512} if i % 2 else {})
        for i in range(4)
    ]
    if device == "cuda":
        count = torch.cuda.device_count()
        devices = [f"cuda:{r % count}" for r in range(ranks)]
    else:
        devices = ["cpu"] * ranks
    return KVCacheManager(
        {
            "ranks": [
                {"device": d, "layers": layers, "cp_rank": r if cp else 0}
                for r, d in enumerate(devices)
            ],
            "context_parallel": ranks if cp else 1,
            "tokens_per_block": 16,
            "num_blocks": 40_000,
            "max_requests": N,
            "max_seq_len": 1 << 14,
        }
    )


def step_us(ranks: int, device: str, repeats: int, cp: bool = False) -> float:
    m = _manager(ranks, device, cp)
    ids = [f"r{i}" for i in range(N)]
    handles = np.array([m.allocate(r, 100 + i).handle for i, r in enumerate(ids)])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step() -> None:
        m.step_columns(extend=handles)
        m.slot_mappings(ids, 1)
        sync()

    for _ in range(20):
        step()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        step()
        samples.append((time.perf_counter_ns() - t0) / 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--context-parallel", action="store_true")
    args = parser.parse_args()
    repeats = 20 if args.quick else 400
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    kind = "context-parallel ranks" if args.context_parallel else "TP ranks"
    print(f"# bench_ranks {time.strftime('%Y-%m-%d')} {name}, {kind}")
    print("| ranks | step us (median) | vs 1 rank |")
    print("|---|---|---|")
    base = None
    for ranks in (1, 2, 4, 8):
        us = step_us(ranks, args.device, repeats, args.context_parallel)
        base = base or us
        print(f"| {ranks} | {us:.1f} | {us / base:.2f}x |")


if __name__ == "__main__":
    main()
