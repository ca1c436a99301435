"""Host tier copy bandwidth: offload and onboard against a plain pinned copy of the same bytes.

  python bench/bench_host_tier.py --device cuda     # the GPU machine
  python bench/bench_host_tier.py --quick           # a smoke run on the CPU

Layout: Llama-3-8B-like, 32 layers of 8 KV heads x 128, bf16, 16-token blocks, one pool group
(a block's slot is 32 x 2 x 16 x 8 x 128 x 2 bytes = 2 MiB, one contiguous row). For batches of
1 to 64 blocks:

- ``offload``: ``HostTier.offload`` of that many cached blocks (device -> pinned host) and the
  wait for its copies, as a step that evicts them does (``kvcm.tier_copies``: 2 MiB slots
  go to the copy engines as they are queued); the ``clear`` that makes room for the next
  round is not timed, nor a synchronize after ``finish`` (which waits for the copies);
- ``onboard``: as many host blocks copied into device slots (host -> device) and the wait;
- ``baseline``: one ``copy_`` of the same number of bytes between a contiguous device buffer
  and a pinned host buffer, each way, synchronised: what a single cudaMemcpy of that size
  costs in the same run.

Each row: median time of the kvcm copy, its bandwidth, and its fraction of the baseline's
bandwidth the same way (target: >= 80% for batches of 2 MiB or more). On the CPU both sides
are plain memory copies.

On CUDA (not ``--quick``), two more tables, with a Llama-3-8B-shaped model from transformers
(random bf16 weights, SDPA attention):

- decode beside offloading: the model's forward of a batch of 64 single tokens (every weight
  read once, what dominates a decode step; no KV attention), replayed as a CUDA graph on an
  engine stream of its own (the sidecar's current stream stays idle, as in its own process)
  and timed by CUDA events, alone and while the CPU offloads 8 blocks (16 MiB) per step and
  waits for them (also timed: the offload's wall time beside the decode): on the copy
  engines (the default for 2 MiB slots), or by the copy kernel capped at 16, 64 or 256
  thread blocks (target: at most 3% slower);
- host hit against recompute: onboarding a prompt's blocks from the host (queue and wait)
  against the model's prefill of the same tokens, for 512 to 8192 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import kvcm_kernels
from kvcm import KVCacheManager


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, device: torch.device, repeats: int, reset=None, waits: bool = False) -> float:  # type: ignore[no-untyped-def]
    """Median wall time of ``fn`` and the device work it waits for: a synchronize after it,
    unless ``fn`` waits for its own work (``waits``: kvcm's ``finish``; then the device is
    synchronised after the sample, untimed). ``reset`` (untimed) runs after each call."""
    fn()
    _sync(device)
    if reset is not None:
        reset()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if not waits:
            _sync(device)
        samples.append(time.perf_counter() - t0)
        _sync(device)
        if reset is not None:
            reset()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--copies-only", action="store_true", help="skip the model tables (decode, prefill)"
    )
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

    host = HostTier(m.layout, m.memory.tensors, {0: 2 * top}, device, m.parts.coord.cache.log)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# bench_host_tier {time.strftime('%Y-%m-%d')} {name}, slot {slot_bytes >> 10} KiB")
    print(
        "| blocks | MiB | offload ms | GB/s | of pinned copy | onboard ms | GB/s | of pinned copy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in batches:
        print(_row(host, n, slot_bytes, device, repeats))
    _fixed_cost(host, device, repeats)
    if device.type == "cuda" and not (args.quick or args.copies_only):
        _model_tables(device)


def _llama_8b(device: torch.device) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        attn_implementation="sdpa",
    )
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.eval()


def _event_ms(fn, device: torch.device, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median GPU time of ``fn``'s work (CUDA events on the current stream)."""
    samples = []
    for i in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        if i >= 3:
            samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def _beside_ms(fn, stream: torch.cuda.Stream, beside=None) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """GPU time of ``fn``'s work launched on ``stream`` (an engine's stream: the sidecar's
    own current stream stays idle, as in its own process), with ``beside`` run on the CPU
    right after the launch, while that work runs; and the wall time ``beside`` took."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        fn()
        end.record(stream)
    t0 = time.perf_counter()
    if beside is not None:
        beside()
    wall = time.perf_counter() - t0
    end.synchronize()
    return start.elapsed_time(end), wall * 1e3


def _model_tables(device: torch.device) -> None:
    model = _llama_8b(device)
    blocks, top = 8, 512
    m = KVCacheManager(
        {
            "layers": [
                {"layer_id": i, "num_kv_heads": 8, "head_dim": 128, "dtype": "bf16"}
                for i in range(32)
            ],
            "tokens_per_block": 16,
            "num_blocks": top + 1,
            "max_seq_len": 16 * top,
            "device": str(device),
            "host_memory_bytes": 1,
        },
        check_budget=False,
    )
    from kvcm.host_tier import HostTier

    host = HostTier(m.layout, m.memory.tensors, {0: top}, device, m.parts.coord.cache.log)
    ids = torch.randint(0, 128256, (64, 1), device=device)
    # The decode forward as a CUDA graph: GPU-bound, as an engine runs it (eager, this
    # model's thousand launches would leave the GPU idle and time the CPU instead).
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(ids, use_cache=False)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        model(ids, use_cache=False)

    keys = [(0, b"r", i.to_bytes(4, "little")) for i in range(blocks)]
    entries = list(zip(range(1, blocks + 1), keys, strict=True))

    def offload() -> None:
        host.offload(0, entries)
        host.copier.finish()
        host.clear()

    # Variants interleaved round by round, so that a drift of the GPU's clocks hits all.
    engine = torch.cuda.Stream(device)
    variants = {"alone": None, "copy engines": (64, 1)}
    for cap in (16, 64, 256):
        variants[f"copy kernel <= {cap} blocks"] = (cap, 1 << 62)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for round_ in range(43):
        for name, how in variants.items():
            if how is not None:
                host.copier.max_blocks, host.copier.dma_min_bytes = how
            sample = _beside_ms(graph.replay, engine, None if how is None else offload)
            if round_ >= 3:
                samples[name].append(sample)
    host.copier.max_blocks = kvcm_kernels.block_copy.MAX_BLOCKS
    host.copier.dma_min_bytes = kvcm_kernels.block_copy.DMA_MIN_BYTES
    alone = statistics.median(t for t, _ in samples["alone"])
    print("\n| decode step (batch 64, CUDA graph) | ms | vs alone | offload wall ms |")
    print("|---|---|---|---|")
    for name, pairs in samples.items():
        label = name if name == "alone" else f"beside offloading 16 MiB/step, {name}"
        ms = statistics.median(t for t, _ in pairs)
        wall = "" if name == "alone" else f"{statistics.median(w for _, w in pairs):.3f}"
        print(f"| {label} | {ms:.3f} | {ms / alone:.3f} | {wall} |")

    print("\n| prompt tokens | host hit: onboard ms | recompute: prefill ms | prefill / onboard |")
    print("|---|---|---|---|")
    for tokens in (512, 2048, 8192):
        n = tokens // 16
        prompt = torch.randint(0, 128256, (1, tokens), device=device)

        def prefill(prompt: torch.Tensor = prompt) -> None:
            with torch.no_grad():
                model(prompt, use_cache=False, logits_to_keep=1)

        entries_n = [(1 + i, (0, b"p", i.to_bytes(4, "little"))) for i in range(n)]
        host.offload(0, entries_n)
        host.copier.finish()
        held = list(host.lru[0].values())
        slots = list(range(1, n + 1))

        def onboard(slots: list[int] = slots, held: list[int] = held) -> None:
            host.copier.queue(0, False, slots, held)
            host.copier.finish()

        on_ms = _median_s(onboard, device, 10) * 1e3
        pre_ms = _event_ms(prefill, device, 5)
        host.clear()
        print(f"| {tokens} | {on_ms:.3f} | {pre_ms:.2f} | {pre_ms / on_ms:.1f}x |")


def _fixed_cost(host: Any, device: torch.device, repeats: int) -> None:
    """Where a one-block offload's time goes: the tier's bookkeeping (queueing the copy)
    and the launch of its batch with the wait for it."""
    entries = [(1, (0, b"r", b"fixed"))]
    queue, wait = [], []
    for _ in range(repeats + 3):
        _sync(device)
        t0 = time.perf_counter()
        host.offload(0, entries)
        t1 = time.perf_counter()
        host.copier.finish()
        t2 = time.perf_counter()
        host.clear()
        queue.append(t1 - t0)
        wait.append(t2 - t1)
    print(
        f"\none-block offload: queueing {statistics.median(queue[3:]) * 1e6:.1f} us, "
        f"launch and wait {statistics.median(wait[3:]) * 1e6:.1f} us"
    )


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
        host.copier.finish()

    out_s = _median_s(offload, device, repeats, reset=host.clear, waits=True)
    host.offload(0, entries)
    host.copier.finish()
    held = [host.lru[0][k] for k in keys]
    slots = [slot for slot, _ in entries]

    def onboard() -> None:
        host.copier.queue(0, False, slots, held)
        host.copier.finish()

    in_s = _median_s(onboard, device, repeats, waits=True)
    host.clear()
    gbs = [nbytes / s / 1e9 for s in (out_s, d2h, in_s, h2d)]
    return (
        f"| {n} | {nbytes / 2**20:.0f} | {out_s * 1e3:.3f} | {gbs[0]:.1f} | "
        f"{gbs[0] / gbs[1]:.0%} | {in_s * 1e3:.3f} | {gbs[2]:.1f} | {gbs[2] / gbs[3]:.0%} |"
    )


if __name__ == "__main__":
    main()
