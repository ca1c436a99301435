"""The whole decode step as an engine pays for it on CUDA, host included (issue 35, item 1).

  python bench/bench_cuda_step.py   # cuda:0 (kernels and torch reference) and cpu
  python bench/bench_cuda_step.py --devices cpu   # the CPU path alone (no GPU needed)
  python bench/bench_cuda_step.py --profile   # also where the host time goes (cProfile)
  python bench/bench_cuda_step.py --phases    # ... in real time: each phase wrapped, us/step
  python bench/bench_cuda_step.py --gap-ms 5  # also steps 5 ms apart, as a busy-poll sidecar

One step is what an engine does once per forward pass: ``step_columns(extend=handles,
map_slots=True)`` (+1 token for each of 256 running requests, the slot mappings of every layer
group in the same call) and ``page_tables()`` (the tables its kernels read). No host
synchronize inside the step: the kernels are queued on torch's current stream, so the
engine's forward queued after them sees the tables and the mapping.

Variants on CUDA: the one-launch kernels (the default), the torch reference
(``KVCM_KERNELS=reference``), and stream-ordered steps (``stream_ordered=True`` on shared
tables: the mapping comes from the host's tables in C, the step's table edits are queued on
the stream after it, and the step copies the mapping to the device from pinned memory, as the
engine's forward needs it there).

Layouts: 1 layer group (full attention) and 4 (full plus windows of 256, 512 and 1024 tokens,
a Gemma-3-like mix: window rows release blocks as they slide, so each step has edits).

Columns: ``wall``: the whole run's wall time over its steps (the final synchronize included),
per step; ``host p50/p99``: each step's own host time; ``device``: the GPU's kernel and copy
time per step (torch.profiler's CUPTI records, which include CuPy's launches); ``span``: the
median CUDA-event time from before a step's first call to after its last, on the stream (the
device's view of a step, launch gaps included).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import time
from typing import Any

import numpy as np
import torch
from bench_kernels import decode_manager

from kvcm import KVCacheManager

N = 256


def manager(groups: int, device: str, share: bool = False) -> tuple[KVCacheManager, np.ndarray]:
    """bench_kernels' decode workload (256 requests of 500-4000 tokens) and its handles."""
    m, ids = decode_manager(groups, device, N, share)
    return m, np.array([m.request(rid).handle for rid in ids], dtype=np.int64)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _stepper(m: KVCacheManager, decode: bool) -> Any:
    """The step's call: ``decode_step(handles, ...)``, or ``step_columns(extend=handles,
    ...)``, the same step through the general path."""
    if decode:
        return m.decode_step

    def general(handles: np.ndarray, **kw: Any) -> Any:
        return m.step_columns(extend=handles, **kw)

    return general


def run(
    groups: int,
    device: str,
    steps: int,
    reference: bool = False,
    ordered: bool = False,
    decode: bool = False,
) -> dict[str, Any]:
    """``ordered``: ``step_columns(stream_ordered=True)`` on shared tables, whose mapping is
    computed on the host; the step then copies it to the device from pinned memory, as an
    engine's forward needs it there (a pageable copy would wait for the stream). ``decode``:
    the step as ``decode_step`` (docs/requests.md#the-decode-step)."""
    if reference:
        os.environ["KVCM_KERNELS"] = "reference"
    try:
        m, handles = manager(groups, device, share=ordered)
        call = _stepper(m, decode)

        def step() -> torch.Tensor:
            if ordered:
                out = call(handles, map_slots=True, stream_ordered=True)
                m.page_tables()
                return out.slot_mapping.pin_memory().to(device, non_blocking=True)
            out = call(handles, map_slots=True)
            m.page_tables()
            return out.slot_mapping

        for _ in range(50):
            step()
        _sync(device)
        host = []
        t0 = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            mapping = step()
            host.append(time.perf_counter() - t)
        _sync(device)
        wall = (time.perf_counter() - t0) / steps
        assert mapping.shape == (groups, N)
        row = {
            "groups": groups,
            "device": device
            + (" (torch reference)" if reference else "")
            + (" (stream-ordered, host mapping, pinned copy)" if ordered else "")
            + (", decode_step" if decode else ""),
            "wall_us": wall * 1e6,
            "host_p50_us": statistics.median(host) * 1e6,
            "host_p99_us": float(np.percentile(host, 99)) * 1e6,
            "device_us": None,
            "span_us": None,
        }
        if device.startswith("cuda"):
            row["device_us"] = _kernel_time(step, 200)
            row["span_us"] = _span(step, 200)
        return row
    finally:
        os.environ.pop("KVCM_KERNELS", None)


def _spin(seconds: float, rehearse: Any) -> None:
    """Spin ``seconds`` as busy-poll mode does between steps, calling ``rehearse`` (or
    nothing) every 100 us as its rehearsal does (``StepChannel.rehearse``)."""
    end = time.perf_counter() + seconds
    next_at = 0.0
    while (now := time.perf_counter()) < end:
        if rehearse is not None and now >= next_at:
            rehearse()
            next_at = now + 1e-4


def cadence(
    groups: int,
    device: str,
    steps: int,
    gap_ms: float,
    ordered: bool,
    rehearsed: bool,
    decode: bool = False,
) -> dict[str, Any]:
    """Host time per step when steps come ``gap_ms`` apart with the core kept busy between
    (a sidecar in busy-poll mode): each step run cold after the gap, as a sidecar's at an
    engine's cadence; ``rehearsed``: ``rehearse_columns`` of the step every 100 us of the gap,
    as busy-poll mode does. The same step as ``run``'s (stream-ordered as a sidecar's
    answer: the mapping stays on the host); ``decode``: as ``decode_step``, which a sidecar
    runs for a decode step's frame."""
    m, handles = manager(groups, device, share=ordered)
    columns = {"extend": handles}
    call = _stepper(m, decode)

    def step() -> Any:
        out = call(handles, map_slots=True, stream_ordered=ordered)
        m.page_tables()
        return out.slot_mapping

    def rehearse() -> None:
        m.rehearse_columns(columns)

    for _ in range(50):
        step()
    _sync(device)
    host = []
    for _ in range(steps):
        _spin(gap_ms / 1e3, rehearse if rehearsed else None)
        t = time.perf_counter()
        step()
        host.append(time.perf_counter() - t)
    _sync(device)
    return {
        "groups": groups,
        "device": device
        + (" (stream-ordered)" if ordered else "")
        + (", decode_step" if decode else ""),
        "rehearsed": rehearsed,
        "p50_us": statistics.median(host) * 1e6,
        "p90_us": float(np.percentile(host, 90)) * 1e6,
        "p99_us": float(np.percentile(host, 99)) * 1e6,
    }


def _kernel_time(step: Any, steps: int) -> float:
    """GPU kernel + copy time per step, from the profiler's device records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total = 0.0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            total += evt.device_time
    return total / steps


def _span(step: Any, steps: int) -> float:
    pairs = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs)


def profile_host(groups: int, device: str, steps: int) -> None:
    m, handles = manager(groups, device)
    for _ in range(50):
        m.step_columns(extend=handles, map_slots=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        m.step_columns(extend=handles, map_slots=True)
        m.page_tables()
    prof.disable()
    _sync(device)
    print(f"\n## where the host time goes: {groups} group(s), {device}, {steps} steps")
    pstats.Stats(prof).sort_stats("tottime").print_stats(28)


#: The phases ``--phases`` times: (module, owner's name or "", attribute, label). Nested
#: phases count in their callers too (``map_tokens`` holds ``map_launch``, which holds
#: ``torch.empty``); the wrappers add ~0.2 us each.
PHASES = (
    ("kvcm.manager", "", "parse_columns", "parse_columns"),
    ("kvcm.manager", "", "run_columns", "run_columns (the bookkeeping)"),
    ("kvcm.manager", "", "mapped_tokens", "mapped_tokens"),
    ("kvcm.views", "TablesAndViews", "map_tokens", "map_tokens (the mapping, all of it)"),
    ("kvcm.device_tables", "DeviceTables", "take_pending", "take_pending (the edits)"),
    ("kvcm.device_tables", "DeviceTables", "map_launch", "map_launch (CUDA: the C launch)"),
    ("kvcm.views", "TablesAndViews", "_map_host", "_map_host (CPU: the C mapping)"),
    ("kvcm.device_tables", "Uploader", "reserve_unwaited", "reserve_unwaited (staging)"),
    ("kvcm.device_tables", "Outputs", "take", "Outputs.take (the output)"),
    ("kvcm.device_tables", "torch", "empty", "torch.empty (a fresh output)"),
    ("kvcm_kernels", "", "current_stream_handle", "current_stream_handle"),
    ("kvcm.views", "TablesAndViews", "page_tables", "page_tables"),
    ("kvcm.device_tables", "DeviceTables", "publish", "publish (stream-ordered: edits, event)"),
    ("kvcm.device_tables", "DeviceTables", "_c_launch", "_c_launch (the C call and its fences)"),
)


def phases(
    groups: int, device: str, steps: int, gap_ms: float | None = None, ordered: bool = False
) -> None:
    """Where a step's host time goes in real time (cProfile's own cost distorts calls this
    short): each phase of ``PHASES`` wrapped with ``perf_counter_ns`` for the run, then
    put back; us per step, beside the plain step's wall time of the same manager.
    ``gap_ms``: the steps that far apart, rehearsed while spinning (as ``cadence``);
    ``ordered``: stream-ordered steps on shared tables (a sidecar's, as ``cadence``)."""
    import importlib

    spent: dict[str, int] = {}

    def timed(fn: Any, label: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0) + time.perf_counter_ns() - t

        return wrapper

    m, handles = manager(groups, device, share=ordered)
    columns = {"extend": handles}

    def step() -> None:
        m.step_columns(extend=handles, map_slots=True, stream_ordered=ordered)
        m.page_tables()

    def timed_run() -> float:
        for _ in range(50):
            step()
        _sync(device)
        spent.clear()  # the phases of the measured steps alone
        took = 0
        for _ in range(steps):
            if gap_ms:
                _spin(gap_ms / 1e3, lambda: m.rehearse_columns(columns))
            t = time.perf_counter_ns()
            step()
            took += time.perf_counter_ns() - t
        _sync(device)
        return took / steps / 1e3

    plain = timed_run()
    saved = []
    for module, owner, name, label in PHASES:
        target: Any = importlib.import_module(module)
        if owner == "torch":  # the module's own torch: a copy whose empty is timed
            proxy = type(target)("torch_timed")
            proxy.__dict__.update(torch.__dict__)
            proxy.empty = timed(torch.empty, label)
            saved.append((target, "torch", target.torch))
            target.torch = proxy
            continue
        if owner:
            target = getattr(target, owner)
        saved.append((target, name, target.__dict__[name]))
        setattr(target, name, timed(getattr(target, name), label))
    try:
        wrapped = timed_run()
    finally:
        for target, name, value in reversed(saved):
            setattr(target, name, value)
    runs = steps
    apart = (", stream-ordered" if ordered else "") + (
        f", {gap_ms} ms apart (rehearsed)" if gap_ms else ""
    )
    print(f"\n## host time by phase: {groups} group(s), {device}, {steps} steps{apart}")
    print(f"plain step {plain:.1f} us, wrapped {wrapped:.1f} us")
    print("| phase | us/step |\n|---|---|")
    for label, ns in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {ns / runs / 1e3:.2f} |")


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--phases", action="store_true", help="host time by phase, real time")
    parser.add_argument("--gap-ms", type=float, help="also steps this far apart (spinning)")
    parser.add_argument("--gap-steps", type=int, default=500, help="steps at --gap-ms")
    parser.add_argument("--json")
    args = parser.parse_args()
    devices = args.devices or (["cuda:0", "cpu"] if torch.cuda.is_available() else ["cpu"])
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} {card}, torch {torch.__version__}, "
        f"{N} decoding requests, {args.steps} steps"
    )
    rows = []
    for groups in (1, 4):
        for device in devices:
            rows.append(run(groups, device, args.steps))
            rows.append(run(groups, device, args.steps, decode=True))
            if device.startswith("cuda"):
                rows.append(run(groups, device, args.steps, reference=True))
                rows.append(run(groups, device, args.steps, ordered=True))
                rows.append(run(groups, device, args.steps, ordered=True, decode=True))
    print("| groups | device | wall us/step | host p50 | host p99 | device us | span us |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['groups']} | {r['device']} | {r['wall_us']:.1f} | {r['host_p50_us']:.1f} | "
            f"{r['host_p99_us']:.1f} | {_fmt(r['device_us'])} | {_fmt(r['span_us'])} |"
        )
    if args.gap_ms:
        print(f"\n## steps {args.gap_ms} ms apart, spinning between, {args.gap_steps} steps: us")
        print("| groups | device | rehearsed | p50 | p90 | p99 |\n|---|---|---|---|---|---|")
        for groups in (1, 4):
            for device in devices:
                for ordered in (False, True) if device.startswith("cuda") else (False,):
                    for rehearsed, decode in ((False, False), (True, False), (True, True)):
                        r = cadence(
                            groups, device, args.gap_steps, args.gap_ms, ordered, rehearsed, decode
                        )
                        rows.append(r)
                        print(
                            f"| {groups} | {r['device']} | {'yes' if rehearsed else 'no'} | "
                            f"{r['p50_us']:.1f} | {r['p90_us']:.1f} | {r['p99_us']:.1f} |"
                        )
    if args.profile:
        for groups in (1, 4):
            profile_host(groups, devices[0], 300)
    if args.phases:
        for groups in (1, 4):
            for ordered in (False, True) if devices[0].startswith("cuda") else (False,):
                phases(groups, devices[0], args.steps, None, ordered)
                if args.gap_ms:
                    phases(groups, devices[0], args.gap_steps, args.gap_ms, ordered)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
