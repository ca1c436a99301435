"""Pictures of the step's cost by path, measured here: bench/plots/*.png and a table.

  python bench/plots.py            # ~30 s on the 2-core VM: measures, prints, draws
  python bench/plots.py --quick    # a smoke run (small samples; writes to a temp folder)

The step is the 256-request columnar decode step, ``step_columns(extend=handles)`` (+1 token
for each of 256 requests, no replacements), through three paths: the project's own
``KVCacheManager`` in this process, and the typed ``KVCacheClient`` against a real
``kvcm serve`` (uvicorn on loopback, started here with ``--step-socket``: ``loadtest``'s
``start_server``), over HTTP and over the step channel. The paths alternate in blocks of 50
steps (``bench_cadence.Variant``), back to back and then at an engine's cadence (a call every
``--gap-ms``, 5 by default: a model's forward pass between steps). Each path's requests are
freed and allocated again, untimed, before they reach ``max_seq_len``.

Writes ``step_latency.png`` (the distribution of a step's wall time by path, log scale, one
panel per cadence) and ``path_ratios.png`` (each path's p50 and p99 as a multiple of the
in-process step's, same run). Needs matplotlib (``pip install -c constraints.txt
'.[bench]'``); draws with the Agg backend, no display.
"""

from __future__ import annotations

import argparse
import datetime
import os
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
from bench_cadence import Variant
from bench_step_channel import BLOCK, _serve_flags
from loadtest import _config, start_server

from kvcm_client import KVCacheClient

REQUESTS = 256
PROMPT = 32
#: Steps per fill of the 256 requests: 32 + 800 tokens stays under loadtest's max_seq_len
#: (1024) and each manager's pool (``_config(REQUESTS, 2)``: 50 blocks a row).
FILL = 800
OUT = Path(__file__).resolve().parent / "plots"
PATHS = ("in process", "step channel", "HTTP")
COLORS = {"in process": "#2a9d8f", "step channel": "#264fa8", "HTTP": "#e76f51"}


class Decode:
    """One path's 256 requests and their decode step; ``variant`` times it."""

    def __init__(self, name: str, step_columns: Callable[..., Any], pid: int) -> None:
        self.step_columns = step_columns
        self.name = name
        self.handles: array[int] | None = None
        self.left = 0
        self.fills = 0
        self.variant = Variant(name, pid, self.call, 0.0)

    def call(self) -> None:
        if not self.step_columns(extend=self.handles).ok:
            raise RuntimeError(f"{self.name}: a decode step failed")
        self.left -= 1

    def refill(self, n: int) -> None:
        """Untimed: fresh requests when fewer than ``n`` steps are left before the limit."""
        if self.left >= n:
            return
        if self.handles is not None:
            self.step_columns(free=self.handles)
        self.fills += 1
        tag = f"{self.name[0]}{self.fills}-"
        allocate = [{"request_id": f"{tag}{i}", "num_tokens": PROMPT} for i in range(REQUESTS)]
        out = self.step_columns(allocate=allocate)
        if not out.ok:
            raise RuntimeError(f"{self.name}: the allocate step failed")
        self.handles = array("q", out.handles)
        self.left = FILL

    def block(self, gap_s: float, n: int) -> None:
        self.refill(n)
        self.variant.block(gap_s, n)


def measure(steps: int, cadence_steps: int, gap_s: float) -> dict[float, dict[str, np.ndarray]]:
    """Each path's step times in microseconds, by gap (0: back to back)."""
    from kvcm import KVCacheManager

    with tempfile.TemporaryDirectory(prefix="kvcm-plots-") as tmp:
        sock = Path(tmp) / "step.sock"
        url, proc, _ = start_server(REQUESTS, 3, *_serve_flags(sock, None))
        try:
            manager = KVCacheManager(_config(REQUESTS, 2))
            http = KVCacheClient(url)
            fast = KVCacheClient(url, step_socket=sock)
            paths = [
                Decode(PATHS[0], manager.step_columns, os.getpid()),
                Decode(PATHS[1], fast.step_columns, proc.pid),
                Decode(PATHS[2], http.step_columns, proc.pid),
            ]
            for gap, total in ((0.0, steps), (gap_s, cadence_steps)):
                for p in paths:  # warm-up, not kept
                    p.block(gap, BLOCK)
                    p.variant.times[gap].clear()
                done = 0
                while done < total:
                    n = min(BLOCK, total - done)
                    for p in paths:
                        p.block(gap, n)
                    done += n
            http.close()
            fast.close()
        finally:
            proc.terminate()
            proc.wait()
    return {
        gap: {p.name: np.asarray(p.variant.times[gap]) * 1e6 for p in paths} for gap in (0.0, gap_s)
    }


def cadence_label(gap: float) -> str:
    return f"a call every {gap * 1000:g} ms" if gap else "back to back"


def table(times: dict[float, dict[str, np.ndarray]]) -> str:
    lines = [
        "| cadence | path | steps | p50 us | p90 us | p99 us "
        "| p50 / in process | p99 / in process |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for gap, by_path in times.items():
        b50, b99 = np.percentile(by_path[PATHS[0]], [50, 99])
        for name in PATHS:
            t = by_path[name]
            p50, p90, p99 = np.percentile(t, [50, 90, 99])
            lines.append(
                f"| {cadence_label(gap)} | {name} | {t.size} | {p50:.0f} | {p90:.0f} | "
                f"{p99:.0f} | {p50 / b50:.1f}x | {p99 / b99:.1f}x |"
            )
    return "\n".join(lines)


def _caption(fig: Any, note: str) -> None:
    fig.text(0.01, 0.01, note, fontsize=7.5, color="#555555", ha="left", va="bottom")


def plot_latency(times: dict[float, dict[str, np.ndarray]], note: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    gaps = list(times)
    every = np.concatenate([t for by_path in times.values() for t in by_path.values()])
    lo, hi = np.percentile(every, 0.05), np.percentile(every, 99.95)
    bins = np.geomspace(max(lo * 0.8, 1.0), hi * 1.25, 90)
    fig, axes = plt.subplots(len(gaps), 1, figsize=(8, 2.6 * len(gaps) + 0.6), sharex=True)
    for ax, gap in zip(np.atleast_1d(axes), gaps, strict=True):
        for name in PATHS:
            t = times[gap][name]
            weights = np.full(t.size, 100.0 / t.size)
            color = COLORS[name]
            ax.hist(t, bins=bins, weights=weights, color=color, alpha=0.35)
            ax.hist(t, bins=bins, weights=weights, color=color, histtype="step", lw=1.2)
            p50, p99 = np.percentile(t, [50, 99])
            ax.axvline(p50, color=color, lw=1.5)
            ax.axvline(p99, color=color, lw=1, ls=":")
            ax.plot(
                [],
                [],
                color=color,
                lw=6,
                alpha=0.5,
                label=f"{name}: p50 {p50:.0f}, p99 {p99:.0f} us",
            )
        ax.set_xscale("log")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.45)  # room for the legend above the peaks
        ax.set_ylabel("% of steps")
        ax.set_title(cadence_label(gap), fontsize=10, loc="left")
        ax.legend(fontsize=8, frameon=False, loc="upper center", ncol=3, handlelength=1.2)
        ax.grid(axis="x", which="both", alpha=0.2)
        ax.spines[["top", "right"]].set_visible(False)
    ax.set_xlabel("wall time of one step call, us (log; solid line p50, dotted p99)")
    fig.suptitle(f"The {REQUESTS}-request columnar decode step, by path", fontsize=11)
    _caption(fig, note)
    fig.tight_layout(rect=(0, 0.035, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_ratios(times: dict[float, dict[str, np.ndarray]], note: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    gaps = list(times)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6), sharey=True)
    height = 0.8 / len(PATHS)
    for ax, q in zip(axes, (50, 99), strict=True):
        top = 1.0
        for i, gap in enumerate(gaps):
            base = np.percentile(times[gap][PATHS[0]], q)
            for j, name in enumerate(PATHS):
                us = np.percentile(times[gap][name], q)
                ratio = us / base
                y = i + (j - (len(PATHS) - 1) / 2) * height
                ax.barh(y, ratio, height=height * 0.9, color=COLORS[name], alpha=0.85)
                ax.text(ratio * 1.08, y, f"{ratio:.1f}x  ({us:.0f} us)", va="center", fontsize=8)
                top = max(top, ratio)
        ax.set_xscale("log")
        ax.set_xlim(0.7, top * 8)
        ax.set_title(f"p{q}, as a multiple of in process", fontsize=10)
        ax.set_yticks(range(len(gaps)), [cadence_label(g) for g in gaps])
        ax.grid(axis="x", which="both", alpha=0.2)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].invert_yaxis()  # shared: once for both
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[n], alpha=0.85) for n in PATHS]
    fig.legend(
        handles,
        PATHS,
        ncol=3,
        fontsize=8.5,
        frameon=False,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.92),
    )
    fig.suptitle(f"What the path adds to the {REQUESTS}-request columnar decode step", fontsize=11)
    _caption(fig, note)
    fig.tight_layout(rect=(0, 0.035, 1, 0.9))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="back-to-back steps per path")
    parser.add_argument(
        "--cadence-steps", type=int, default=1000, help="steps per path at --gap-ms"
    )
    parser.add_argument("--gap-ms", type=float, default=5.0, help="the engine's cadence")
    parser.add_argument(
        "--out", type=Path, default=None, help=f"default {OUT} ({'--quick'}: a temp folder)"
    )
    parser.add_argument("--quick", action="store_true", help="100 + 50 steps per path")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    steps, cadence_steps = (100, 50) if args.quick else (args.steps, args.cadence_steps)
    out = args.out or (Path(tempfile.mkdtemp(prefix="kvcm-plots-")) if args.quick else OUT)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    times = measure(steps, cadence_steps, args.gap_ms / 1000)
    cpu = platform.processor() or platform.machine()
    note = (
        f"python bench/plots.py, {datetime.date.today()}, {platform.node()} "
        f"({os.cpu_count()} cores, {cpu}), Python {platform.python_version()}; "
        "client and service on the same machine"
    )
    print(f"# bench/plots.py {datetime.date.today()} {platform.node()} {cpu}")
    print(f"{REQUESTS}-request decode step_columns; measured in {time.perf_counter() - t0:.0f} s")
    print(table(times))
    plot_latency(times, note, out / "step_latency.png")
    plot_ratios(times, note, out / "path_ratios.png")
    for name in ("step_latency.png", "path_ratios.png"):
        f = out / name
        print(f"wrote {f} ({f.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
