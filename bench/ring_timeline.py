"""Where a decode step's round trip through the shared-memory ring goes, at an engine's cadence.

  python bench/ring_timeline.py                 # 1000 steps 5 ms apart (~10 s)
  python bench/ring_timeline.py --gap-ms 0      # back to back
  PYTHONPATH=<tree>/service:<tree>/client python bench/ring_timeline.py   # another tree (A/B)

A ``kvcm serve`` in busy-poll mode (pinned to CPU 1 where there are two) serves a typed client
(pinned to CPU 0) whose 256-request decode step, ``decode_step(handles)``, goes
through the ring every ``--gap-ms``, as in ``bench_cadence.py``. Both processes stamp
``time.perf_counter_ns`` (CLOCK_MONOTONIC: one clock for both): the client as its frame is
posted and as it sees the answer, the service as it takes the frame out of the ring
(``ServiceRing.take``) and as it publishes the answer (``ServiceRing.reply``). Each step
splits into: the client's part before its frame is posted, the service seeing it, the
service's part (frame taken to answer published), the client seeing the answer, the
client's part after it, and the whole call. p50 / p90 / p99 in microseconds.

The stamps are two function wrappers per side; the service's are installed by running
``kvcm serve`` through this file (``--serve``), which patches ``ServiceRing`` and then runs the
CLI, so any tree whose ring has ``take`` and ``reply`` can be measured the same way.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import subprocess
import sys
import tempfile
import time
from array import array
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

REQUESTS = 256
WARMUP = 100


def _serve(stamps: str, argv: list[str]) -> None:
    """``kvcm serve`` with the ring's take and reply stamped, dumped to ``stamps`` at exit."""
    import kvcm.server.step_ring as ring
    from kvcm.cli import main

    taken: list[int] = []
    replied: list[int] = []
    take, reply = ring.ServiceRing.take, ring.ServiceRing.reply

    def stamped_take(self: ring.ServiceRing, limit: int) -> bytes | int:
        taken.append(time.perf_counter_ns())
        return take(self, limit)

    def stamped_reply(self: ring.ServiceRing, body: bytes) -> bool:
        out = reply(self, body)
        replied.append(time.perf_counter_ns())
        return out

    ring.ServiceRing.take, ring.ServiceRing.reply = stamped_take, stamped_reply  # type: ignore[method-assign]
    atexit.register(lambda: Path(stamps).write_text(json.dumps([taken, replied])))
    sys.argv = ["kvcm", *argv]
    main()


def _pin(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if len(os.sched_getaffinity(0)) > 1 else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gap-ms", type=float, default=5.0, help="the engine's cadence")
    parser.add_argument("--steps", type=int, default=1000, help="timed steps")
    parser.add_argument("--serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        _serve(args.serve[0], args.serve[1:])
        return
    from kvcm_client import KVCacheClient
    from kvcm_client import step_ring as client_ring

    tmp = Path(tempfile.mkdtemp())
    layers = tmp / "layers.json"
    layers.write_text(json.dumps([{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}]))
    sock, stamps = tmp / "step.sock", tmp / "stamps.json"
    seq = 32 + args.steps + WARMUP + 16
    serve = [
        *("serve", "--port", "0", "--layers", str(layers), "--max-requests", str(REQUESTS)),
        *("--num-blocks", str(REQUESTS * -(-seq // 16) + 64), "--max-seq-len", str(seq)),
        *("--step-socket", str(sock), "--log-level", "warning", "--step-spin-s", "0.1"),
    ]
    cmd = [*_pin(1), sys.executable, __file__, "--serve", str(stamps), *serve]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    url = ""
    for line in proc.stdout:
        if "serving on" in line:
            url = line.split("serving on", 1)[1].split()[0]
            break
    if not url:
        sys.exit(f"kvcm serve did not start:\n{proc.communicate()[0]}")
    if len(os.sched_getaffinity(0)) > 1:  # the service has CPU 1 to itself
        os.sched_setaffinity(0, {0})
    posted: list[int] = []
    seen: list[int] = []
    post, answered = client_ring.ClientRing.post, client_ring.ClientRing.answered

    def stamped_post(self: client_ring.ClientRing, *args: Any) -> int:  # (any tree's)
        out = post(self, *args)
        posted.append(time.perf_counter_ns())
        return out

    def stamped_answered(self: client_ring.ClientRing, seq: int) -> bool:
        out = answered(self, seq)
        if out:
            seen.append(time.perf_counter_ns())
        return out

    client_ring.ClientRing.post = stamped_post  # type: ignore[method-assign]
    client_ring.ClientRing.answered = stamped_answered  # type: ignore[method-assign]
    begun: list[int] = []
    ended: list[int] = []
    try:
        with KVCacheClient(url, step_socket=sock, step_ring=True) as kv:
            ops = [{"request_id": f"r{i}", "num_tokens": 32} for i in range(REQUESTS)]
            handles = array("q", kv.step_columns(allocate=ops).handles)
            if not kv.ring_attached:
                sys.exit("no step ring (busy-poll mode needs 2 CPUs, x86-64 Linux)")
            decode = (  # (a tree from before ``decode_step``: its step_columns, as cheaply)
                partial(kv.decode_step, handles)
                if hasattr(kv, "decode_step")
                else partial(kv.step_columns, extend=handles)
            )
            for _ in range(args.steps + WARMUP):
                begun.append(time.perf_counter_ns())
                decode()
                ended.append(time.perf_counter_ns())
                if args.gap_ms:
                    time.sleep(args.gap_ms / 1e3)
    finally:
        proc.terminate()
        proc.wait()
    taken, replied = (np.array(v[-args.steps :]) for v in json.loads(stamps.read_text()))
    c = {
        k: np.array(v[-args.steps :])
        for k, v in {"begun": begun, "posted": posted, "seen": seen, "ended": ended}.items()
    }
    parts = {
        "client, before its frame is posted": c["posted"] - c["begun"],
        "the service seeing it": taken - c["posted"],
        "the service's part (taken -> answer published)": replied - taken,
        "the client seeing the answer": c["seen"] - replied,
        "the client, after it": c["ended"] - c["seen"],
        "the whole call": c["ended"] - c["begun"],
    }
    print(
        f"# ring_timeline {time.strftime('%Y-%m-%d %H:%M')} gap {args.gap_ms} ms, "
        f"{args.steps} steps, load {os.getloadavg()[0]:.2f}"
    )
    print("| part | p50 us | p90 us | p99 us |")
    print("|---|---|---|---|")
    for name, ns in parts.items():
        p50, p90, p99 = np.percentile(ns / 1e3, [50, 90, 99])
        print(f"| {name} | {p50:.1f} | {p90:.1f} | {p99:.1f} |")


if __name__ == "__main__":
    main()
