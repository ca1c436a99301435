"""Host tier copy bandwidth: offload and onboard against a plain pinned copy of the same bytes.

  python bench/bench_host_tier.py --device cuda     # the GPU machine
  python bench/bench_host_tier.py --quick           # a smoke run on the CPU

Layout: Llama-3-8B-like, 32 layers of 8 KV heads x 128, bf16, 16-token blocks, one pool group
(a block's slot is 32 x 2 x 16 x 8 x 128 x 2 bytes = 2 MiB, one contiguous row). For batches of
1 to 64 blocks:

- ``offload``: ``HostTier.offload`` of that many cached blocks (device -> pinned host, one copy
  per block on the tier's stream, then a wait), as an eviction does;
- ``onboard``: ``HostTier.onboard`` of as many host blocks into device slots (host -> device);
- ``baseline``: one ``copy_`` of the same number of bytes between a contiguous device buffer
  and a pinned host buffer, each way, synchronised: what a single cudaMemcpy of that size
  costs in the same run.

Each row: median time of the kvcm copy, its bandwidth, and its fraction of the baseline's
bandwidth the same way (target: >= 80% for batches of 2 MiB or more). On the CPU both sides
are plain memory copies.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from kvcm import KVCacheManager


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, device: torch.device, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    layers = 4 if args.quick else 32
    batches = [1, 4] if args.quick else [1, 2, 4, 8, 16, 32, 64]
    repeats = 3 if args.quick else 20
    top = max(batches)
    m = KVCacheManager(
        {
            "layers": [
                {"layer_id": i, "num_kv_heads": 8, "head_dim": 128, "dtype": "bf16"}
                for i in range(layers)
            ],
            "tokens_per_block": 16,
            "num_blocks": 2 * top + 1,
            "max_seq_len": 16 * top,
            "device": args.device,
            "host_memory_bytes": 1,  # sized below
        },
        check_budget=False,
    )
    slot_bytes = m.layout.pool_groups[0].slot_bytes
    from kvcm.host_tier import HostTier

    host = HostTier(m.layout, m.memory.tensors, {0: 2 * top}, device, m._coord.cache.log)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# bench_host_tier {time.strftime('%Y-%m-%d')} {name}, slot {slot_bytes >> 10} KiB")
    print(
        "| blocks | MiB | offload ms | GB/s | of pinned copy | onboard ms | GB/s | of pinned copy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in batches:
        print(_row(host, n, slot_bytes, device, repeats))


def _row(host: Any, n: int, slot_bytes: int, device: torch.device, repeats: int) -> str:
    """One batch size: the tier's copies against a pinned copy of the same bytes."""
    nbytes = n * slot_bytes
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    d2h = _median_s(lambda: host_buf.copy_(dev_buf, non_blocking=True), device, repeats)
    h2d = _median_s(lambda: dev_buf.copy_(host_buf, non_blocking=True), device, repeats)
    keys = [(0, b"r", i.to_bytes(4, "little")) for i in range(n)]
    entries = list(zip(range(1, n + 1), keys, strict=True))

    def offload() -> None:
        host.offload(0, entries)
        host.clear()  # the next round offloads again

    out_s = _median_s(offload, device, repeats)
    host.offload(0, entries)
    held = [host.lru[0][k] for k in keys]
    slots = [slot for slot, _ in entries]
    in_s = _median_s(lambda: host._copy(0, slots, held, out=False), device, repeats)
    host.clear()
    gbs = [nbytes / s / 1e9 for s in (out_s, d2h, in_s, h2d)]
    return (
        f"| {n} | {nbytes / 2**20:.0f} | {out_s * 1e3:.3f} | {gbs[0]:.1f} | "
        f"{gbs[0] / gbs[1]:.0%} | {in_s * 1e3:.3f} | {gbs[2]:.1f} | {gbs[2] / gbs[3]:.0%} |"
    )


if __name__ == "__main__":
    main()
