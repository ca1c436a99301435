"""GPU kernel benchmarks (needs CUDA and CuPy): kvcm kernels vs torch ops vs numpy + copy.

  python bench/bench_kernels.py [--json FILE]

1. Per-step page-table update + slot mapping for 256 decoding requests with 1 to 4 layer
   groups: the edits and slot-mapping inputs of a real decode step (taken from a manager), in
   one upload from pinned memory, applied by the fused kernel (one launch) and by the two
   separate kernels, timed as device time. Against: the same upload with torch ops on the GPU
   (index_put_ and the torch reference slot mapping), and numpy on the host plus a copy of the
   tables and the mapping (what a manager without kernels would do).
2. Kernel-mode page indices for 1024 requests x 1024 blocks (and 4096 x 8192), against torch
   ops on the GPU and numpy + copy, with the bandwidth reached over the copy bandwidth measured
   in the same run (a 1 GiB device copy and a copy of the same bytes).
3. The whole manager decode step (host bookkeeping + kernels), wall time, kvcm kernels vs the
   torch reference path (KVCM_KERNELS=reference).

Device time: a spin kernel holds the stream while the host queues K iterations, so CUDA events
around them measure the GPU's own time (launch gaps included), not the host's launch rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

import kvcm_kernels
from kvcm import KVCacheManager, request_rows
from kvcm_kernels.page_indices import kernel_page_indices_reference
from kvcm_kernels.slot_mapping import slot_mapping_reference

DEV = torch.device("cuda", 0)
TPB = 16


def device_us(fn: Callable[[], None], iters: int = 200, spin_cycles: int = 50_000_000) -> float:
    """Median over 5 trials of GPU time per iteration, queued behind a spin kernel."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    trials = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(spin_cycles)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        trials.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(trials)


def wall_us(fn: Callable[[], None], iters: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def copy_bandwidth(nbytes: int) -> float:
    """Bytes read + written per second by a device-to-device copy of ``nbytes``."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    us = device_us(lambda: dst.copy_(src), iters=50 if nbytes > 1 << 28 else 200)
    return 2 * nbytes / (us * 1e-6)


def decode_manager(
    groups: int, device: str, n: int = 256, share: bool = False
) -> tuple[KVCacheManager, list[str]]:
    """``n`` requests of 500-4000 tokens over ``groups`` layer groups (full, then windows of
    256, 512, 1024): the decode workload of this bench and bench/bench_cuda_step.py
    (``share``: the pools and tables in shared memory, as a sidecar's)."""
    windows = [None, 256, 512, 1024][:groups]
    # One small layer per layer group: the bookkeeping does not depend on KV bytes.
    layers = [
        {"layer_id": i, "num_kv_heads": 1, "head_dim": 64}
        | ({} if window is None else {"sliding_window": window})
        for i, window in enumerate(windows)
    ]
    m = KVCacheManager(
        {
            "layers": layers,
            "tokens_per_block": TPB,
            "max_requests": n,
            "max_seq_len": 8192,
            "num_blocks": groups * n * 8192 // TPB,
            "device": device,
            "share": share,
        }
    )
    rng = np.random.default_rng(0)
    ids = [f"r{i}" for i in range(n)]
    for rid, length in zip(ids, rng.integers(500, 4000, size=n), strict=True):
        m.allocate(rid, int(length))
    return m, ids


def bench_step(groups: int) -> dict[str, float]:
    n = 256
    host, ids = decode_manager(groups, "cpu", n)
    coord = host.parts.coord
    coord.edits = []
    for _ in range(15):  # warm: some requests cross block and window boundaries each step
        host.extend_many(ids)
        coord.take_edits()
    host.extend_many(ids)
    edits = coord.take_edits()
    rows = request_rows.rows_of(host.parts, ids)
    qsl = np.arange(n + 1, dtype=np.int64)
    positions = coord.num_tokens[rows] - 1
    # One upload per step, laid out as the manager does: rows | qsl | positions | edits.
    packed = np.concatenate([rows, qsl, positions, edits.reshape(-1)]).astype(np.int64)
    pinned = torch.from_numpy(packed).pin_memory()
    dev = torch.empty_like(pinned, device=DEV)
    rows_d, qsl_d = dev[:n], dev[n : 2 * n + 1]
    pos_d, edits_d = dev[2 * n + 1 : 3 * n + 1], dev[3 * n + 1 :].view(-1, 4)
    tables_host = torch.from_numpy(coord.tables)
    tables = tables_host.to(DEV)
    out = torch.empty((groups, n), dtype=torch.int64, device=DEV)

    rows_h, qsl_h = pinned[:n], pinned[n : 2 * n + 1]
    pos_h, edits_h = pinned[2 * n + 1 : 3 * n + 1], pinned[3 * n + 1 :].view(-1, 4)

    def kvcm_zero_copy() -> None:  # what the manager does: the kernel reads pinned inputs
        kvcm_kernels.apply_edits_and_map_slots(
            tables, edits_h, rows_h, qsl_h, pos_h, TPB, n, 0, groups, out
        )

    def kvcm_fused() -> None:
        dev.copy_(pinned, non_blocking=True)
        kvcm_kernels.apply_edits_and_map_slots(
            tables, edits_d, rows_d, qsl_d, pos_d, TPB, n, 0, groups, out
        )

    def kvcm_two_kernels() -> None:
        dev.copy_(pinned, non_blocking=True)
        kvcm_kernels.apply_page_table_edits(tables, edits_d)
        kvcm_kernels.slot_mapping(tables, rows_d, qsl_d, pos_d, TPB, n, out)

    def torch_step() -> None:
        dev.copy_(pinned, non_blocking=True)
        e = edits_d
        tables[e[:, 0], e[:, 1], e[:, 2]] = e[:, 3].int()
        slot_mapping_reference(tables, rows_d, qsl_d, pos_d, TPB, n, out)

    pinned_tables = tables_host.pin_memory()
    pinned_map = torch.empty((groups, n), dtype=torch.int64).pin_memory()

    def numpy_compute() -> None:
        slots = coord.tables[:, rows, positions // TPB].astype(np.int64)
        pinned_map.numpy()[:] = np.where(slots >= 0, slots * TPB + positions % TPB, -1)

    def numpy_copy() -> None:
        tables.copy_(pinned_tables, non_blocking=True)
        out.copy_(pinned_map, non_blocking=True)

    def numpy_step() -> None:
        numpy_compute()
        numpy_copy()

    # The timed kvcm work gives the numpy result of the same step.
    numpy_compute()
    for fn in (kvcm_zero_copy, kvcm_fused, kvcm_two_kernels, torch_step):
        out.fill_(-7)
        fn()
        assert torch.equal(out.cpu(), pinned_map), fn.__name__
    return {
        "groups": groups,
        "edits": int(edits.shape[0]),
        "kvcm_device_us": device_us(kvcm_zero_copy),
        "kvcm_copy_fused_device_us": device_us(kvcm_fused),
        "kvcm_two_kernels_device_us": device_us(kvcm_two_kernels),
        "torch_device_us": device_us(torch_step),
        "numpy_copy_device_us": device_us(numpy_copy),
        "numpy_wall_us": wall_us(numpy_step),
    }


def bench_indices(requests: int, blocks: int, copy_bw: float) -> dict[str, float]:
    rng = np.random.default_rng(1)
    table_np = rng.integers(0, 1 << 20, size=(requests, blocks)).astype(np.int32)
    table_np[rng.random(table_np.shape) < 0.3] = -1
    table = torch.from_numpy(table_np).to(DEV)
    rows_np = rng.permutation(requests).astype(np.int64)
    rows = torch.from_numpy(rows_np).to(DEV)
    out = torch.empty((requests, blocks), dtype=torch.int32, device=DEV)
    kvcm_kernels.kernel_page_indices(table, rows, 4, 1, out)
    ref = kernel_page_indices_reference(table, rows, 4, 1)
    assert torch.equal(out, ref)
    pinned_out = torch.empty((requests, blocks), dtype=torch.int32).pin_memory()

    def numpy_build() -> None:
        pages = table_np[rows_np]
        pinned_out.numpy()[:] = np.where(pages >= 0, pages * 4 + 1, -1)
        out.copy_(pinned_out, non_blocking=True)

    nbytes = 2 * table_np.nbytes + rows_np.nbytes
    kvcm_us = device_us(lambda: kvcm_kernels.kernel_page_indices(table, rows, 4, 1, out))
    same = torch.empty_like(table)
    same_us = device_us(lambda: same.copy_(table))
    return {
        "shape": f"{requests}x{blocks}",
        "kvcm_device_us": kvcm_us,
        "torch_device_us": device_us(lambda: kernel_page_indices_reference(table, rows, 4, 1)),
        "numpy_copy_wall_us": wall_us(numpy_build, iters=20),
        "kvcm_bandwidth": nbytes / (kvcm_us * 1e-6),
        "fraction_of_copy_bw": nbytes / (kvcm_us * 1e-6) / copy_bw,
        "fraction_of_same_size_copy": same_us / kvcm_us,
    }


def bench_manager_step(groups: int) -> dict[str, float]:
    m, ids = decode_manager(groups, "cuda:0")

    def step() -> None:
        m.extend_many(ids)
        m.slot_mappings(ids, pad_to=256)

    results = {}
    for mode in ("kvcm", "reference"):
        if mode == "reference":
            os.environ["KVCM_KERNELS"] = "reference"
        results[f"{mode}_wall_us"] = wall_us(step, iters=100)
        os.environ.pop("KVCM_KERNELS", None)
    return {"groups": groups, **results}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write all figures here")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(DEV)
    big_bw = copy_bandwidth(1 << 30)
    print(
        f"# {time.strftime('%Y-%m-%d')} {props.name}, torch {torch.__version__}, "
        f"copy bandwidth (read + write, 1 GiB) {big_bw / 1e12:.2f} TB/s"
    )
    steps = [bench_step(g) for g in (1, 2, 3, 4)]
    print("\n## per-step table update + slot mapping, 256 requests (device us per step)")
    print(
        "| layer groups | edits | kvcm (one launch, pinned inputs) | kvcm (copy + one launch) "
        "| kvcm (copy + two kernels) | torch ops | numpy + copy (device) | numpy + copy (wall) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in steps:
        print(
            f"| {r['groups']} | {r['edits']} | {r['kvcm_device_us']:.2f} | "
            f"{r['kvcm_copy_fused_device_us']:.2f} | {r['kvcm_two_kernels_device_us']:.2f} | "
            f"{r['torch_device_us']:.2f} | "
            f"{r['numpy_copy_device_us']:.2f} | {r['numpy_wall_us']:.1f} |"
        )
    builds = [bench_indices(1024, 1024, big_bw), bench_indices(4096, 8192, big_bw)]
    print("\n## kernel-mode page indices (device us)")
    print(
        "| requests x blocks | kvcm | torch ops | numpy + copy (wall) | kvcm TB/s "
        "| of 1 GiB copy BW | of same-size copy |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in builds:
        print(
            f"| {r['shape']} | {r['kvcm_device_us']:.2f} | {r['torch_device_us']:.2f} | "
            f"{r['numpy_copy_wall_us']:.0f} | {r['kvcm_bandwidth'] / 1e12:.2f} | "
            f"{r['fraction_of_copy_bw']:.0%} | {r['fraction_of_same_size_copy']:.0%} |"
        )
    managers = [bench_manager_step(g) for g in (1, 4)]
    print("\n## whole manager decode step on cuda:0, 256 requests (wall us, host + device)")
    print("| layer groups | kvcm kernels | torch reference path |\n|---|---|---|")
    for r in managers:
        print(f"| {r['groups']} | {r['kvcm_wall_us']:.0f} | {r['reference_wall_us']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"copy_bw": big_bw, "steps": steps, "indices": builds, "manager": managers},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
