"""The 256-request scheduler step through the typed client: HTTP against the step channel.

  python bench/bench_step_channel.py            # 600 measured steps per variant (~1 min)
  python bench/bench_step_channel.py --quick    # a smoke run

One ``kvcm serve`` (started here, with ``--step-socket``) and one in-process manager run the
load test's step sequence (``loadtest.Scheduler``: +1 token for each of 256 requests, about two
finished requests freed and replaced per step). Variants, each with its own requests and the
same seed: ``step_plain`` in process (what the service runs per step: the floor), the typed
``KVCacheClient.step`` over HTTP and over the step channel, each also with ``brief=True``.
Variants alternate in blocks of 50 steps, so the machine's drift hits them alike. The table is
p50 and p99 of the wall time per step call, in microseconds.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadtest import Scheduler, _config, start_server

from kvcm_client import KVCacheClient

BLOCK = 50
NAMES = (
    "in-process step_plain",
    "typed client, HTTP",
    "typed client, step channel",
    "typed client, HTTP, brief",
    "typed client, step channel, brief",
)


def variants(url: str, sock: Path, num_requests: int) -> dict[str, Callable[[list[Any]], Any]]:
    from kvcm import KVCacheManager
    from kvcm.ops import plain_ops

    manager = KVCacheManager(_config(num_requests, 1))
    http = KVCacheClient(url)
    fast = KVCacheClient(url, step_socket=sock)
    return {
        NAMES[0]: lambda ops: manager.step_plain(plain_ops(ops) or []),
        NAMES[1]: http.step,
        NAMES[2]: fast.step,
        NAMES[3]: lambda ops: http.step(ops, brief=True),
        NAMES[4]: lambda ops: fast.step(ops, brief=True),
    }


def run(steps: int, num_requests: int, seed: int) -> dict[str, tuple[float, float]]:
    with tempfile.TemporaryDirectory(prefix="kvcm-sc-") as tmp:
        sock = Path(tmp) / "step.sock"
        url, proc, _ = start_server(num_requests, len(NAMES), "--step-socket", str(sock))
        try:
            calls = variants(url, sock, num_requests)
            scheds = {
                name: Scheduler(f"v{i}", num_requests, np.random.default_rng(seed))
                for i, name in enumerate(calls)
            }
            times: dict[str, list[float]] = {name: [] for name in calls}
            for name, call in calls.items():
                call(scheds[name].start_ops())
                for _ in range(BLOCK):  # warm-up
                    call(scheds[name].next_ops())
            while any(len(t) < steps for t in times.values()):
                for name, call in calls.items():
                    for _ in range(min(BLOCK, steps - len(times[name]))):
                        ops = scheds[name].next_ops()
                        t0 = time.perf_counter()
                        results = call(ops)
                        times[name].append(time.perf_counter() - t0)
                        if len(results) != len(ops):
                            raise RuntimeError(f"{name}: {len(results)} results")
        finally:
            proc.terminate()
            proc.wait()
    out = {}
    for name, samples in times.items():
        p50, p99 = np.percentile(np.asarray(samples) * 1e6, [50, 99])
        out[name] = (float(p50), float(p99))
    return out


def table(rows: dict[str, tuple[float, float]]) -> str:
    base = rows[NAMES[0]][0]
    lines = ["| variant | p50 us | p99 us | p50 / in-process |", "|---|---|---|---|"]
    for name, (p50, p99) in rows.items():
        lines.append(f"| {name} | {p50:.0f} | {p99:.0f} | {p50 / base:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="30 steps of 32 requests")
    args = parser.parse_args()
    steps, num_requests = (30, 32) if args.quick else (args.steps, args.requests)
    rows = run(steps, num_requests, args.seed)
    print(f"{num_requests} requests, {steps} steps per variant; {platform.processor() or ''}")
    print(table(rows))


if __name__ == "__main__":
    main()
