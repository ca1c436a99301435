"""The example engine as a benchmark: what kvcm adds to a real model's step.

  python bench/bench_engine.py                   # CPU, a small Llama-style model (~1 min)
  python bench/bench_engine.py --device cuda     # GPU, a larger one
  python bench/bench_engine.py --quick           # a smoke run
  python bench/bench_engine.py --device cuda --ways in-process --compare-gather

One workload (``--requests`` requests, all arriving at once, a shared system prompt, prefill
chunk ``--chunk``), three ways, in the same run:

- ``transformers``: the baseline, transformers' own ``generate`` with its dense cache on the
  whole batch at once (left-padded, greedy): no paging, no prefix reuse, static batching;
- ``kvcm in-process``: the example engine (kvcm_engine) with the manager in this process;
- ``kvcm sidecar, HTTP``: the same engine driving a ``kvcm serve`` process on loopback through
  the typed HTTP client, its pools and page tables attached (shared memory on the CPU, CUDA
  IPC on a GPU);
- ``kvcm sidecar, step channel``: the same with the client's step-path calls
  (``step_columns`` with the step's slot mapping, ``probe``) over the service's Unix-socket
  step channel (docs/step-channel.md);
- ``kvcm sidecar, step channel, busy-poll``: the same against a service in busy-poll mode
  (``--step-spin-s``), which needs a core of its own: on a machine whose cores the model's
  threads take, it competes with them;
- ``kvcm sidecar, step channel, stream-ordered`` (``ordered``, CUDA only): the step channel
  with stream-ordered steps (the service's table edits wait for the engine's forward on the
  device, its answers for nothing), so that the engine plans each decode step ahead as in
  process.

The engine's attention (``--attention``): ``auto`` runs the paged-attention kernel
(``kvcm_kernels.paged_attention``, Triton: the pages are read in place) on a CUDA device and the
gather (each request's history gathered out of the pages, then the model's SDPA) on the CPU;
``--compare-gather`` adds an in-process row on the gather path. ``--ways`` picks the kvcm ways
(default all four).

On CUDA the engine's decode forwards replay CUDA graphs (``kvcm_engine.graphs``; ``--cuda-graphs
off`` runs them launch by launch, ``--compare-eager`` adds an in-process row without them; a
row's name says ``graphs`` when its decodes replayed them). With the graphs, the engine plans
each decode step's successor (its kvcm call included) while the device computes the forward
(``Engine``'s ``overlap``; the row's name says ``overlap``); ``--compare-overlap`` adds an
in-process row with graphs and without it.

Per way: generated tokens per second, steps, mean and p50 step time, and kvcm's time per step
(the scheduler's planning, its ``step_columns`` call with the probes of new requests, the
mapping cut per forward, reading the tables): mean, the part inside the ``step_columns``
call, p50 and p99, its share of the step, the part of it the step waited for (``exposed``:
all but the calls planned ahead that the forward hid whole) and its share, and the calls
made. Every kvcm
run's tokens are checked against the baseline's (they must be equal; a mismatch is reported,
not hidden). ``--gap-ms`` sleeps after each step (untimed in the step): an engine whose model
pass is that much longer, so that the sidecar sleeps between steps as it does beside a GPU
(the sleep comes after the tokens are read back, so a call planned ahead does not overlap
it: the overlap rows' exposed time is then what a forward of the measured length hides).
The engine runs under ``GOMP_SPINCOUNT=10000`` (``--omp-spin``; ``default`` for libgomp's own
300,000), so that torch's idle OpenMP threads hand a core back to the sidecar soon after each
forward (docs/step-channel.md#beside-a-models-threads); the header line says which.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvcm_engine import Backend, Engine, build_model, make_requests

SHAPES = {
    # hidden 256, 4 layers, 8 heads / 4 KV heads of 32, vocab 4096: a CPU-sized model.
    "cpu": {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 4096,
    },
    # hidden 2048, 16 layers, 16 heads / 8 KV heads of 128, vocab 32000 (~1B parameters, fp16).
    "cuda": {
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
    },
}


#: The kvcm ways ``--ways`` picks from.
WAYS = ("in-process", "http", "channel", "busy-poll", "ordered")

#: libgomp's spin (``GOMP_SPINCOUNT``) the engine runs under unless ``--omp-spin`` says
#: otherwise. torch's OpenMP threads spin after each parallel region before they sleep;
#: libgomp's default, 300,000 spins, holds the core milliseconds after a forward, where the
#: sidecar needs it for the step call (it then waits for the spinner's time slice, up to
#: ~4 ms). 10,000 hands the core back within a fraction of a millisecond and leaves the
#: forward as fast (fewer spins slow it: its threads sleep between parallel regions).
#: Measured on the 2-core development VM: docs/step-channel.md, "Beside a model's threads".
OMP_SPIN = "10000"


def kv_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "tokens_per_block": 16,
        "num_blocks": args.num_blocks,
        "max_requests": args.requests,
        "max_seq_len": 1024,
        "max_prefill_chunk": args.chunk,
        "null_page": True,
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def baseline(built: Any, requests: list[Any], device: str) -> dict[str, Any]:
    """transformers' generate on the whole batch (left padding, its dense cache)."""
    model = built.model
    width = max(len(r.prompt) for r in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.long)
    mask = torch.zeros(len(requests), width, dtype=torch.long)
    for i, r in enumerate(requests):
        ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
        mask[i, width - len(r.prompt) :] = 1
    new = max(r.max_new_tokens for r in requests)
    _sync(device)
    begin = time.perf_counter()
    out = model.generate(
        ids.to(device),
        attention_mask=mask.to(device),
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
    )
    _sync(device)
    wall = time.perf_counter() - begin
    tokens = {
        r.request_id: out[i, width : width + r.max_new_tokens].tolist()
        for i, r in enumerate(requests)
    }
    useful = sum(r.max_new_tokens for r in requests)
    return {"tokens": tokens, "wall_s": wall, "tok_s": useful / wall, "steps": new}


def engine_run(
    built: Any,
    backend: Backend,
    args: argparse.Namespace,
    attention: str | None = None,
    graphs: bool = True,
    overlap: bool = True,
) -> dict[str, Any]:
    engine = Engine(
        built,
        backend,
        chunk=args.chunk,
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.requests,
        attention=attention or args.attention,  # type: ignore[arg-type]
        cuda_graphs="auto" if graphs and args.cuda_graphs == "auto" else False,
        overlap="auto" if overlap else False,
    )
    gap = getattr(args, "gap_ms", 0.0) / 1000
    if gap:  # a longer model pass after each step (untimed): the engine's cadence
        step = engine.step

        def paced() -> None:
            step()
            time.sleep(gap)

        engine.step = paced  # type: ignore[method-assign]
    requests = make_requests(args.requests, seed=1, **_workload(args))
    _sync(args.device)
    begin = time.perf_counter()
    done = engine.run(requests)
    _sync(args.device)
    wall = time.perf_counter() - begin
    steps = np.array(engine.stats.step_s) * 1e3
    s = engine.stats
    kvcm = np.array(s.kvcm_step_s) * 1e3
    return {
        "attention": engine.attention,
        "kvcm_ms_p50": float(np.percentile(kvcm, 50)),
        "kvcm_ms_p99": float(np.percentile(kvcm, 99)),
        "tokens": {r.request_id: r.output for r in done},
        "wall_s": wall,
        "tok_s": s.tokens_generated / wall,
        "steps": s.steps,
        "step_ms_mean": float(steps.mean()),
        "step_ms_p50": float(np.percentile(steps, 50)),
        "kvcm_ms_per_step": s.kvcm_s * 1e3 / s.steps,
        "kvcm_call_ms_per_step": engine.scheduler.stats.call_s * 1e3 / s.steps,
        "graph_forwards": 0 if engine.graphs is None else engine.graphs.replays,
        # Why a capture failed (the decodes then ran eagerly on the static buffers), or None.
        "graph_failed": None if engine.graphs is None else engine.graphs.failed,
        "kvcm_share": s.kvcm_s / float(steps.sum() / 1e3),
        "exposed_ms_per_step": s.kvcm_exposed_s * 1e3 / s.steps,
        "exposed_share": s.kvcm_exposed_s / float(steps.sum() / 1e3),
        "planned_ahead": s.planned_ahead,
        "hidden": s.hidden,
        "hit_tokens": engine.scheduler.stats.hit_tokens,
        "preemptions": engine.scheduler.stats.preemptions,
        "kvcm_calls": engine.scheduler.stats.kvcm_calls,
    }


def measured(
    built: Any,
    backend: Backend,
    args: argparse.Namespace,
    attention: str | None = None,
    graphs: bool = True,
    overlap: bool = True,
) -> dict[str, Any]:
    """A warm-up run (first touches of the pools, allocator caches, the kernels' compiles, the
    decode graphs' captures), an emptied prefix cache, then the measured run: both ways start
    from the same cold prefix cache."""
    engine_run(built, backend, args, attention, graphs, overlap)
    backend.kvcm.reset_prefix_cache()
    return engine_run(built, backend, args, attention, graphs, overlap)


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "system_prompt": args.system_prompt,
        "prompt_range": (args.prompt_min, args.prompt_max),
        "new_tokens_range": (args.new_tokens, args.new_tokens),
        "arrival_every": 0,
        "vocab": SHAPES[_kind(args.device)]["vocab_size"],
    }


def _path(row: dict[str, Any]) -> str:
    """The engine's attention path in a row's name, whether decodes replayed graphs and
    whether steps were planned ahead."""
    graphs = ", graphs" if row["graph_forwards"] else ""
    if row["graph_failed"]:
        graphs = ", graphs failed (eager)"
    return row["attention"] + graphs + (", overlap" if row["planned_ahead"] else "")


def _kind(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sidecar(
    args: argparse.Namespace, step_socket: Path, flags: list[str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """``kvcm serve`` with no model, on loopback and with a step channel at ``step_socket``
    (and ``flags``); the engine registers its model."""
    port = _free_port()
    cmd = [sys.executable, "-m", "kvcm", "serve", "--port", str(port), "--device", args.device]
    cmd += ["--step-socket", str(step_socket), *(flags or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if re.search(r"serving on", line):
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"kvcm serve exited with {proc.wait()}")


def _omp_spin(choice: str) -> None:
    """Run under ``choice`` (a ``GOMP_SPINCOUNT``, or ``default``: libgomp's own). libgomp
    reads it once, when torch loads it, so a process that runs under another one executes
    itself again with it set (before any model is built)."""
    want = None if choice == "default" else choice
    if os.environ.get("GOMP_SPINCOUNT") == want:
        return
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if want is not None:
        env["GOMP_SPINCOUNT"] = want
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or float16 (CUDA)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--system-prompt", type=int, default=64)
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=192)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="sleep this long after each step (a longer model pass; tok/s then counts it)",
    )
    p.add_argument("--spin-s", type=float, default=0.1, help="the busy-poll sidecar's spin")
    p.add_argument(
        "--attention",
        choices=("auto", "paged", "gather"),
        default="auto",
        help="the engine's attention: the paged kernel (auto on CUDA) or the gather",
    )
    p.add_argument(
        "--ways",
        default=None,
        help=f"comma-separated kvcm ways to run, of {', '.join(WAYS)} (default: all, "
        "ordered only on CUDA)",
    )
    p.add_argument(
        "--compare-gather",
        action="store_true",
        help="add an in-process row on the gather path (the attention before the kernel)",
    )
    p.add_argument(
        "--cuda-graphs",
        choices=("auto", "off"),
        default="auto",
        help="decode forwards replayed from CUDA graphs (auto: on the paged path on CUDA)",
    )
    p.add_argument(
        "--compare-eager",
        action="store_true",
        help="add an in-process row on the paged path without CUDA graphs",
    )
    p.add_argument(
        "--compare-overlap",
        action="store_true",
        help="add an in-process row with the graphs, without planning steps ahead",
    )
    p.add_argument(
        "--omp-spin",
        default=OMP_SPIN,
        help=f"GOMP_SPINCOUNT for the engine's process, or 'default' for libgomp's own "
        f"(300,000); default {OMP_SPIN}, as docs/step-channel.md advises beside a sidecar",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args()
    _omp_spin(args.omp_spin)
    if args.quick:
        args.requests, args.new_tokens, args.prompt_max = 4, 4, 48
    kind = _kind(args.device)
    dtype = getattr(torch, args.dtype or ("float16" if kind == "cuda" else "float32"))
    built = build_model("llama", device=args.device, dtype=dtype, weight_gain=1.0, **SHAPES[kind])
    requests = make_requests(args.requests, seed=1, **_workload(args))
    base = baseline(built, requests, args.device)  # also warms up the model
    base = baseline(built, requests, args.device)
    rows = [{"way": "transformers (dense cache, static batch)", **base}]

    from kvcm import KVCacheManager
    from kvcm.model_config import layers_from_hf_config
    from kvcm_client import KVCacheClient

    ways = (
        args.ways.split(",") if args.ways else [w for w in WAYS if kind == "cuda" or w != "ordered"]
    )
    if unknown := set(ways) - set(WAYS):
        p.error(f"unknown ways {sorted(unknown)}; of {', '.join(WAYS)}")
    layers = layers_from_hf_config(built.hf_config)
    in_process: list[tuple[str | None, bool, bool]] = []
    if "in-process" in ways:
        in_process.append((None, True, True))
    if args.compare_overlap:
        in_process.append((None, True, False))
    if args.compare_eager:
        in_process.append(("paged", False, False))
    if args.compare_gather:
        in_process.append(("gather", False, False))
    for attention, graphs, overlap in in_process:
        manager = KVCacheManager({"layers": layers, "device": args.device, **kv_settings(args)})
        row = measured(built, Backend.in_process(manager), args, attention, graphs, overlap)
        rows.append({"way": f"kvcm in-process ({_path(row)})", **row})
        manager.close()
    sidecar_ways = [
        ("http", "kvcm sidecar, HTTP", [], False),
        ("channel", "kvcm sidecar, step channel", [], True),
        (
            "busy-poll",
            "kvcm sidecar, step channel, busy-poll",
            ["--step-spin-s", str(args.spin_s)],
            True,
        ),
        ("ordered", "kvcm sidecar, step channel, stream-ordered", [], True),
    ]
    for key, way, flags, channel in sidecar_ways:
        if key not in ways:
            continue
        step_socket = Path(tempfile.mkdtemp()) / "step.sock"
        proc, url = sidecar(args, step_socket, flags)
        try:
            with KVCacheClient(url, step_socket=step_socket if channel else None) as client:
                client.register_model(hf_config=built.hf_config, share=True, **kv_settings(args))
                backend = Backend.sidecar(client, stream_order=key == "ordered")
                row = measured(built, backend, args)
                rows.append({"way": f"{way} ({_path(row)})", **row})
        finally:
            proc.terminate()
            proc.wait(10)

    for row in rows:
        tokens = row.pop("tokens")
        row["match"] = (
            sum(tokens[k] == v for k, v in base["tokens"].items()) if row is not rows[0] else "-"
        )
    gpu = torch.cuda.get_device_name() if kind == "cuda" else platform.processor() or "cpu"
    print(
        f"# bench_engine {datetime.date.today()} {gpu} {dtype} requests={args.requests} "
        f"new_tokens={args.new_tokens} chunk={args.chunk} "
        f"max_batch_tokens={args.max_batch_tokens} gap_ms={args.gap_ms:g} "
        f"cpus={len(os.sched_getaffinity(0))} "
        f"omp_spin={os.environ.get('GOMP_SPINCOUNT', 'default')}"
    )
    print(
        "| way | tok/s | vs transformers | steps | step ms mean / p50 | kvcm ms/step "
        "| of it in the call | kvcm ms p50 / p99 | kvcm share | exposed ms/step | exposed share "
        "| hidden / planned | calls | hits | preempt | match |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        ratio = row["tok_s"] / rows[0]["tok_s"]
        if "step_ms_mean" in row:
            step = f"{row['step_ms_mean']:.2f} / {row['step_ms_p50']:.2f}"
            kv = (
                f"{row['kvcm_ms_per_step']:.3f} | {row['kvcm_call_ms_per_step']:.3f} | "
                f"{row['kvcm_ms_p50']:.3f} / "
                f"{row['kvcm_ms_p99']:.3f} | {row['kvcm_share']:.1%} | "
                f"{row['exposed_ms_per_step']:.3f} | {row['exposed_share']:.1%} | "
                f"{row['hidden']} / {row['planned_ahead']} | "
                f"{row['kvcm_calls']} | {row['hit_tokens']} | {row['preemptions']}"
            )
        else:
            step, kv = "-", "- | - | - | - | - | - | - | - | - | -"
        print(
            f"| {row['way']} | {row['tok_s']:.0f} | {ratio:.2f}x | {row['steps']} | {step} "
            f"| {kv} | {row['match']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": gpu, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
