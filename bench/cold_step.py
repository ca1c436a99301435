"""What a cold step costs the service: ``StepChannel.handle`` hot, and after its caches were
evicted or its core slept, in one process.

  python bench/cold_step.py            # 150 calls per cell (~1 min)
  python bench/cold_step.py --quick    # a smoke run

The step channel's first step after other work (the benchmark's blocks of HTTP calls, an
engine's model pass) runs several times slower than in a loop. This splits the causes, for
the load test's frames (``step_channel_timeline``: a decode step of 256 requests, the same
with two frees, and with two frees and two allocates of 300 tokens, the load test's step):
between calls, nothing (hot); a sweep over 2 MiB (evicts the L2, the L3 keeps the step's
code and data); a sweep over 64 MiB and a little unrelated Python (evicts the L3 too); a
1 ms sleep (the core halts: on a virtual machine its caches go to other guests). Medians in
microseconds of the call alone (the eviction is not timed).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_channel_timeline import HEADER, _allocates, _channel, _Replacements

from kvcm_client.columns import wire_columns
from kvcm_client.step_channel import pack

_L2 = np.ones(2 << 20, dtype=np.uint8)
_L3 = np.ones(64 << 20, dtype=np.uint8)


def _sweep(buf: np.ndarray) -> None:
    buf[::64] += 1  # one write per cache line


def _far() -> None:
    _sweep(_L3)
    for i in range(200):  # and some Python that is not the step's
        json.dumps({"a": [i, str(i)], "b": {"c": i * 2.5}})


BETWEEN: dict[str, Callable[[], None]] = {
    "hot": lambda: None,
    "2 MiB sweep": lambda: _sweep(_L2),
    "64 MiB sweep": _far,
    "1 ms sleep": lambda: time.sleep(0.001),
}


def _cell(kind: str, between: Callable[[], None], calls: int) -> float:
    """The median ``handle`` of ``kind``'s frames, with ``between`` run before each."""
    state, channel = _channel()
    m = state.manager
    handles = array("q", m.step_columns(allocate=_allocates()).handles)
    turnover = _Replacements(handles)
    times = []
    for i in range(calls):
        if kind == "decode 256":
            body = pack({"op": "step_columns", "args": wire_columns(extend=handles)})
        elif kind == "+ 2 frees":
            two = [{"request_id": f"f{i}-{j}", "num_tokens": 300} for j in (0, 1)]
            new = list(m.step_columns(allocate=two).handles)
            body = pack({"op": "step_columns", "args": wire_columns(extend=handles, free=new)})
        else:
            body = turnover.frame()
        between()
        t0 = time.perf_counter_ns()
        answer, _, _ = channel.handle(body[HEADER.size :])
        times.append(time.perf_counter_ns() - t0)
        if kind == "+ 2 frees, 2 allocates":
            turnover.answered(pack(answer)[HEADER.size :])
    return statistics.median(times[calls // 8 :]) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    calls = 30 if args.quick else 150  # decodes stay below max_seq_len (1024 from 32)
    kinds = ("decode 256", "+ 2 frees", "+ 2 frees, 2 allocates")
    print(f"{platform.node()} {platform.processor() or platform.machine()}")
    print("| between calls | " + " | ".join(kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for name, between in BETWEEN.items():
        cells = [_cell(kind, between, calls) for kind in kinds]
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")


if __name__ == "__main__":
    main()
