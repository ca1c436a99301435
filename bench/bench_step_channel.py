"""The 256-request scheduler step through the typed client: HTTP against the step channel.

  python bench/bench_step_channel.py            # 600 measured steps per variant (~1 min)
  python bench/bench_step_channel.py --quick    # a smoke run
  python bench/bench_step_channel.py --by-replacements   # the channel alone, by replacements
  python bench/bench_step_channel.py --step-poll-us 0     # the service never polls (A/B)
  python bench/bench_step_channel.py --no-doorbell        # the clients never ring (A/B)
  python bench/bench_step_channel.py --by-replacements --gap-ms 5   # a model pass between steps

One ``kvcm serve`` (started here, with ``--step-socket``) and one in-process manager run the
load test's step sequence (``loadtest.Scheduler``: +1 token for each of 256 requests, about two
finished requests freed and replaced per step). Variants, each with its own requests and the
same seed: ``step_plain`` and ``step_columns`` in process (what the service runs per step: the
floor), the typed ``KVCacheClient.step`` over HTTP and over the step channel, each also with
``brief=True``, and the typed ``KVCacheClient.step_columns`` (frees and extends by handle, an
``array('q')`` of 256 handles; allocates by id; the result's ``ok`` and new ``handles`` read)
over HTTP and over the step channel.
Variants alternate in blocks of 50 steps, so the machine's drift hits them alike. The table is
p50 and p99 of the wall time per step call, in microseconds. A second table gives the
channel's typed ``step_columns`` by the step's place in its block: the first steps of a block
come after the other variants' blocks, the service's caches full of their HTTP calls, and
before the service polls for this client's next frame (docs/step-channel.md, "Waiting for
the next frame").
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadtest import Scheduler, _config, start_server

from kvcm_client import KVCacheClient, step_channel

BLOCK = 50
NAMES = (
    "in-process step_plain",
    "in-process step_columns",
    "typed client step, HTTP",
    "typed client step, step channel",
    "typed client step, HTTP, brief",
    "typed client step, step channel, brief",
    "typed client step_columns, HTTP",
    "typed client step_columns, step channel",
)
#: Measured after the others, alone: decode steps without replacements.
DECODE = "typed client step_columns, step channel, decode only"
#: Variants that take columns (handles) rather than op lists.
COLUMNAR = {NAMES[1], NAMES[6], NAMES[7]}


class Columns:
    """``loadtest.Scheduler``'s step sequence by handle: the same lengths, finishes and
    replacements, sent as a columnar step (frees and extends by handle, allocates by id).
    Translating the op list costs the scheduler, not the call, and is not timed."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner
        self.handle: dict[str, int] = {}
        self.pending: list[str] = []

    def _columns(self, ops: list[dict[str, Any]]) -> dict[str, Any]:
        free, extend, allocate = [], array("q"), []
        for op in ops:
            kind = op["op"]
            if kind == "extend":
                extend.append(self.handle[op["request_id"]])
            elif kind == "free":
                free.append(self.handle.pop(op["request_id"]))
            else:
                allocate.append({k: v for k, v in op.items() if k != "op"})
        self.pending = [a["request_id"] for a in allocate]
        return {"free": free, "extend": extend, "allocate": allocate}

    def start(self) -> dict[str, Any]:
        return self._columns(self.inner.start_ops())

    def next(self) -> dict[str, Any]:
        return self._columns(self.inner.next_ops())

    def record(self, handles: Any) -> None:
        for rid, h in zip(self.pending, handles, strict=True):
            self.handle[rid] = int(h)


def _wake_after(doorbell: bool) -> float | None:
    return step_channel.WAKE_AFTER_S if doorbell else None


def variants(
    url: str, sock: Path, num_requests: int, doorbell: bool
) -> dict[str, Callable[[list[Any]], Any]]:
    from kvcm import KVCacheManager
    from kvcm.ops import plain_ops

    manager = KVCacheManager(_config(num_requests, 1))
    http = KVCacheClient(url)
    fast = KVCacheClient(url, step_socket=sock, step_wake_after_s=_wake_after(doorbell))
    columnar = KVCacheManager(_config(num_requests, 1))

    def handles(result: Any) -> Any:
        if not result.ok:
            raise RuntimeError(f"step failed: {result.errors}")
        return result.handles

    return {
        NAMES[0]: lambda ops: manager.step_plain(plain_ops(ops) or []),
        NAMES[1]: lambda cols: handles(columnar.step_columns(**cols)),
        NAMES[2]: http.step,
        NAMES[3]: fast.step,
        NAMES[4]: lambda ops: http.step(ops, brief=True),
        NAMES[5]: lambda ops: fast.step(ops, brief=True),
        NAMES[6]: lambda cols: handles(http.step_columns(**cols)),
        NAMES[7]: lambda cols: handles(fast.step_columns(**cols)),
    }


def decode_only(url: str, sock: Path, num_requests: int, steps: int, doorbell: bool) -> list[float]:
    """The transport's share alone: ``step_columns(extend=handles)`` over the channel, +1
    token for each of the requests, no replacements (lengths stay below max_seq_len)."""
    fast = KVCacheClient(url, step_socket=sock, step_wake_after_s=_wake_after(doorbell))
    out = fast.step_columns(
        allocate=[{"request_id": f"d{i}", "num_tokens": 32} for i in range(num_requests)]
    )
    handles = array("q", out.handles)
    times = []
    for i in range(min(steps, 900) + BLOCK):
        t0 = time.perf_counter()
        ok = fast.step_columns(extend=handles).ok
        if i >= BLOCK:  # the first ones warm up
            times.append(time.perf_counter() - t0)
        if not ok:
            raise RuntimeError("a decode-only step failed")
    fast.step_columns(free=handles)
    return times


def _serve_flags(sock: Path, poll_us: float | None) -> list[str]:
    flags = ["--step-socket", str(sock)]
    return flags if poll_us is None else [*flags, "--step-poll-us", str(poll_us)]


def run(
    steps: int, num_requests: int, seed: int, poll_us: float | None = None, doorbell: bool = True
) -> tuple[dict[str, tuple[float, float]], str]:
    with tempfile.TemporaryDirectory(prefix="kvcm-sc-") as tmp:
        sock = Path(tmp) / "step.sock"
        # One more scheduler's room: the decode-only run.
        flags = _serve_flags(sock, poll_us)
        url, proc, _ = start_server(num_requests, len(NAMES) + 1, *flags)
        try:
            calls = variants(url, sock, num_requests, doorbell)
            scheds: dict[str, Any] = {}
            for i, name in enumerate(calls):
                inner = Scheduler(f"v{i}", num_requests, np.random.default_rng(seed))
                scheds[name] = Columns(inner) if name in COLUMNAR else inner
            times: dict[str, list[float]] = {name: [] for name in calls}
            positions: list[int] = []  # NAMES[7]'s steps' places in their blocks

            def one(name: str, first: bool = False) -> float:
                sched = scheds[name]
                if name in COLUMNAR:
                    cols = sched.start() if first else sched.next()
                    t0 = time.perf_counter()
                    sched.record(calls[name](cols))
                    return time.perf_counter() - t0
                ops = sched.start_ops() if first else sched.next_ops()
                t0 = time.perf_counter()
                results = calls[name](ops)
                elapsed = time.perf_counter() - t0
                if len(results) != len(ops):
                    raise RuntimeError(f"{name}: {len(results)} results")
                return elapsed

            for name in calls:
                one(name, first=True)
                for _ in range(BLOCK):  # warm-up
                    one(name)
            while any(len(t) < steps for t in times.values()):
                for name in calls:
                    for j in range(min(BLOCK, steps - len(times[name]))):
                        times[name].append(one(name))
                        if name == NAMES[7]:
                            positions.append(j)
            times[DECODE] = decode_only(url, sock, num_requests, steps, doorbell)
        finally:
            proc.terminate()
            proc.wait()
    out = {}
    for name, samples in times.items():
        p50, p99 = np.percentile(np.asarray(samples) * 1e6, [50, 99])
        out[name] = (float(p50), float(p99))
    return out, by_position(np.asarray(times[NAMES[7]]) * 1e6, np.asarray(positions))


def by_position(t: np.ndarray, pos: np.ndarray) -> str:
    """The channel's typed ``step_columns`` by the step's place in its block of 50: the
    first ones follow the other variants' blocks (the service ran HTTP calls, or slept, and
    has not yet seen this client's steps come back to back: ``step_poll``)."""
    lines = ["| place in its block | steps | p50 us | p99 us |", "|---|---|---|---|"]
    for name, sel in (
        ("1st", pos == 0),
        ("2nd", pos == 1),
        ("3rd to 5th", (pos >= 2) & (pos < 5)),
        ("6th on", pos >= 5),
    ):
        if sel.any():
            p50, p99 = np.percentile(t[sel], [50, 99])
            lines.append(f"| {name} | {sel.sum()} | {p50:.0f} | {p99:.0f} |")
    return "\n".join(lines)


def table(rows: dict[str, tuple[float, float]]) -> str:
    base = rows[NAMES[0]][0]
    http = rows[NAMES[2]][0]
    lines = [
        "| variant | p50 us | p99 us | p50 / in-process step_plain | HTTP step p50 / p50 |",
        "|---|---|---|---|---|",
    ]
    for name, (p50, p99) in rows.items():
        lines.append(f"| {name} | {p50:.0f} | {p99:.0f} | {p50 / base:.2f}x | {http / p50:.1f}x |")
    return "\n".join(lines)


def by_replacements(
    steps: int,
    num_requests: int,
    seed: int,
    poll_us: float | None = None,
    doorbell: bool = True,
    gap_s: float = 0.0,
) -> str:
    """The typed ``step_columns`` over the step channel alone (no other variant between its
    steps), its p50 by the step's number of replacements: what a replacement adds, and what
    a decode step costs when the scheduler's own work runs between steps (the decode-only
    variant has none). ``gap_s``: a sleep after each step, untimed (an engine's model pass:
    the service is asleep when the next step comes)."""
    with tempfile.TemporaryDirectory(prefix="kvcm-sc-") as tmp:
        sock = Path(tmp) / "step.sock"
        url, proc, _ = start_server(num_requests, 1, *_serve_flags(sock, poll_us))
        try:
            fast = KVCacheClient(url, step_socket=sock, step_wake_after_s=_wake_after(doorbell))
            sched = Columns(Scheduler("r", num_requests, np.random.default_rng(seed)))
            sched.record(fast.step_columns(**sched.start()).handles)
            times, counts = [], []
            for i in range(steps + BLOCK):
                cols = sched.next()
                t0 = time.perf_counter()
                sched.record(fast.step_columns(**cols).handles)
                if i >= BLOCK:  # the first ones warm up
                    times.append(time.perf_counter() - t0)
                    counts.append(len(cols["allocate"]))
                if gap_s:
                    time.sleep(gap_s)
        finally:
            proc.terminate()
            proc.wait()
    t, n = np.asarray(times) * 1e6, np.asarray(counts)
    lines = ["| replacements in the step | steps | p50 us |", "|---|---|---|"]
    for k in range(int(n.max()) + 1):
        if (n == k).sum() >= 10:
            lines.append(f"| {k} | {(n == k).sum()} | {np.median(t[n == k]):.0f} |")
    p50, p99 = np.percentile(t, [50, 99])
    lines.append(f"| all | {t.size} | {p50:.0f} (p99 {p99:.0f}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="30 steps of 32 requests")
    parser.add_argument(
        "--by-replacements",
        action="store_true",
        help="the step channel's typed step_columns alone, p50 by replacements per step",
    )
    parser.add_argument(
        "--step-poll-us",
        type=float,
        default=None,
        help="the service's --step-poll-us (default: its own, 300; 0: it never polls)",
    )
    parser.add_argument(
        "--no-doorbell",
        action="store_true",
        help="the clients never ring the step channel's doorbell (step_wake_after_s=None)",
    )
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="with --by-replacements: sleep this long after each step (a model pass)",
    )
    args = parser.parse_args()
    doorbell = not args.no_doorbell
    steps, num_requests = (30, 32) if args.quick else (args.steps, args.requests)
    if args.by_replacements:
        print(f"{num_requests} requests, {steps} steps; {platform.processor() or ''}")
        gap_s = args.gap_ms / 1000
        print(by_replacements(steps, num_requests, args.seed, args.step_poll_us, doorbell, gap_s))
        return
    rows, places = run(steps, num_requests, args.seed, args.step_poll_us, doorbell)
    print(f"{num_requests} requests, {steps} steps per variant; {platform.processor() or ''}")
    print(table(rows))
    print()
    print(places)


if __name__ == "__main__":
    main()
