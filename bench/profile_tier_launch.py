"""Where a one-block host-tier offload's fixed cost goes on CUDA: each piece of the launch
path timed alone, many times (microseconds per call, medians of 5 runs of 2000 calls).

  python bench/profile_tier_launch.py      # the GPU machine
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import kvcm_kernels
from kvcm import KVCacheManager
from kvcm.host_tier import HostTier


def _us(fn: Callable[[], object], n: int = 2000) -> float:
    fn()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    device = torch.device("cuda:0")
    m = KVCacheManager(
        {
            "layers": [
                {"layer_id": i, "num_kv_heads": 8, "head_dim": 128, "dtype": "bf16"}
                for i in range(32)
            ],
            "tokens_per_block": 16,
            "num_blocks": 9,
            "max_seq_len": 128,
            "device": "cuda:0",
            "host_memory_bytes": 1,
        },
        check_budget=False,
    )
    host = HostTier(m.layout, m.memory.tensors, {0: 8}, device, m.parts.coord.cache.log)
    c = host.copier
    rt = kvcm_kernels.block_copy.cuda_runtime()
    entries = [(1, (0, b"r", b"k"))]
    rows: dict[str, float] = {}

    def offload_and_finish() -> None:
        host.offload(0, entries)
        c.finish()
        host.clear()

    rows["offload + finish (2 MiB)"] = _us(offload_and_finish, 500)
    stream = c._stream
    pool = m.memory.tensors[0]
    n = int(pool.shape[1])
    src, dst = pool.data_ptr() + n, host.regions[0].chunks[0].data_ptr()
    c.immediate = False
    c._engines = {0: False}  # keep copies queued, to time the batch's pieces

    def queue_segments_reset() -> None:
        c.queue(0, True, [1], [0])
        c._segments()
        c.pending[0] = type(c.pending[0])()
        c.queued = 0

    rows["queue + _segments (numpy) + reset"] = _us(queue_segments_reset)

    def bookkeeping() -> None:
        host.offload(0, entries)
        c.pending[0] = type(c.pending[0])()
        c.queued = 0
        host.clear()

    rows["host.offload bookkeeping (queued, not launched)"] = _us(bookkeeping)
    c.queue(0, True, [1], [0])  # still queued: kept off the copy engines above
    desc = c._segments()
    c.pending[0] = type(c.pending[0])()
    c.queued = 0
    c._engines = {0: True}
    c.immediate = True
    rows["copy_segments, one 2 MiB segment (call only)"] = _us(
        lambda: kvcm_kernels.copy_segments(desc, device, stream_handle=stream), 200
    )
    torch.cuda.synchronize()
    rows["torch.cuda.current_stream().cuda_stream"] = _us(
        lambda: torch.cuda.current_stream(device).cuda_stream
    )
    rows["raw current stream (torch._C._cuda_getCurrentRawStream)"] = _us(
        lambda: torch._C._cuda_getCurrentRawStream(0)
    )
    current = torch.cuda.current_stream(device).cuda_stream
    rows["rt.streamQuery (current stream idle)"] = _us(lambda: rt.streamQuery(current))
    rows["rt.eventRecord"] = _us(lambda: rt.eventRecord(c._ready, stream))
    rows["rt.streamWaitEvent"] = _us(lambda: rt.streamWaitEvent(stream, c._ready, 0))
    small = 4096

    def memcpy_small() -> None:
        rt.memcpyAsync(dst, src, small, 4, stream)

    rows["rt.memcpyAsync 4 KiB (call only)"] = _us(memcpy_small)
    rt.streamSynchronize(stream)
    rows["rt.eventSynchronize (done)"] = _us(lambda: rt.eventSynchronize(c._done))
    rows["time.perf_counter"] = _us(time.perf_counter)

    def one_copy_wait() -> None:
        rt.memcpyAsync(dst, src, n, 4, stream)
        rt.eventRecord(c._done, stream)
        rt.eventSynchronize(c._done)

    rows["memcpyAsync 2 MiB + record + sync"] = _us(one_copy_wait, 500)

    def waited_copy_wait() -> None:
        rt.eventRecord(c._ready, current)
        rt.streamWaitEvent(stream, c._ready, 0)
        one_copy_wait()

    rows["the same after a wait for the current stream's event"] = _us(waited_copy_wait, 500)
    host_buf = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_buf = torch.empty(n, dtype=torch.uint8, device=device)

    def baseline() -> None:
        host_buf.copy_(dev_buf, non_blocking=True)
        torch.cuda.synchronize(device)

    rows["baseline: torch copy_ 2 MiB + synchronize"] = _us(baseline, 500)
    print(f"# profile_tier_launch {time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name(0)}")
    print("| piece | us per call |")
    print("|---|---|")
    for name, us in rows.items():
        if us:
            print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
