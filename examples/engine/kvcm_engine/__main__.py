"""``python -m kvcm_engine``: generate with a transformers model on kvcm and check every token
against transformers' own ``generate``.

    python -m kvcm_engine --model gemma3                       # kvcm in this process
    python -m kvcm_engine --model qwen3_next --preempt suspend # a hybrid, preempted to the host
    kvcm serve --port 8470 &                                   # a sidecar with no model yet
    python -m kvcm_engine --model llama --sidecar http://127.0.0.1:8470
    # with kvcm serve --step-socket /tmp/step.sock: the step-path calls over that socket
    python -m kvcm_engine --sidecar http://127.0.0.1:8470 --step-socket /tmp/step.sock

With ``--sidecar`` the engine registers its model with the sidecar (``register_model`` with
the model's ``config.json``), attaches to the pools and page tables it exposes (shared
memory on the CPU, CUDA IPC on a GPU; there with stream-ordered steps, so that each decode
step's call for the next one goes while the forward computes, as in process) and drives it
through the typed client. It prints one line per run and exits 1 if any token differs from
transformers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from .engine import Backend, Engine, reference_outputs
from .models import FAMILIES, BuiltModel, build_model, kvcm_layers
from .workload import make_requests

#: The host tier of ``--preempt suspend``.
HOST_MEMORY_BYTES = 64 << 20


def kv_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The sizing the engine registers with kvcm (same keys in process and over HTTP)."""
    settings = {
        "tokens_per_block": args.tokens_per_block,
        "num_blocks": args.num_blocks,
        "max_requests": args.max_running,
        "max_seq_len": args.max_seq_len,
        "max_prefill_chunk": args.chunk,
        "null_page": True,
    }
    if args.preempt == "suspend":  # suspended requests wait in a host tier
        settings["host_memory_bytes"] = HOST_MEMORY_BYTES
    return settings


def connect(built: BuiltModel, args: argparse.Namespace) -> tuple[Backend, Any]:
    """The backend, and what to close afterwards."""
    if args.sidecar:
        from kvcm_client import KVCacheClient

        client = KVCacheClient(args.sidecar, step_socket=args.step_socket)
        # share: pools the engine's process can map (on a GPU the service's default is off).
        client.register_model(hf_config=built.hf_config, share=True, **kv_settings(args))
        return Backend.sidecar(client, stream_order=args.device.startswith("cuda")), client
    from kvcm import KVCacheManager

    layers = kvcm_layers(built.hf_config)
    manager = KVCacheManager({**layers, "device": args.device, **kv_settings(args)})
    return Backend.in_process(manager), manager


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the workload on kvcm and on transformers; the summary line as a dict."""
    device = "cpu" if args.sidecar and args.device == "cpu" else args.device
    built = build_model(args.model, seed=args.seed, device=device)
    backend, owner = connect(built, args)
    try:
        engine = Engine(
            built,
            backend,
            chunk=args.chunk,
            max_batch_tokens=args.max_batch_tokens,
            max_running=args.max_running,
            preempt=args.preempt,
        )
        requests = make_requests(args.requests, seed=args.seed)
        begin = time.perf_counter()
        done = engine.run(requests)
        wall = time.perf_counter() - begin
    finally:
        owner.close()
    expected = reference_outputs(built, make_requests(args.requests, seed=args.seed))
    same = sum(r.output == expected[r.request_id] for r in done)
    s, e = engine.scheduler.stats, engine.stats
    return {
        "model": args.model,
        "backend": "sidecar" if args.sidecar else f"in-process ({args.device})",
        "requests": len(done),
        "tokens_generated": e.tokens_generated,
        "match": f"{same}/{len(done)}",
        "prefix_hit_tokens": s.hit_tokens,
        "preemptions": s.preemptions,
        "suspends": s.suspends,
        "steps": e.steps,
        "kvcm_calls": s.kvcm_calls,
        "kvcm_share": round(e.kvcm_s / wall, 3) if wall else 0.0,
        "kvcm_exposed_share": round(e.kvcm_exposed_s / wall, 3) if wall else 0.0,
        "wall_s": round(wall, 3),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvcm_engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(FAMILIES), default="llama")
    p.add_argument("--sidecar", help="URL of a kvcm service (default: kvcm in this process)")
    p.add_argument(
        "--step-socket", help="with --sidecar: its step channel (kvcm serve --step-socket)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens-per-block", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=48, help="small enough to preempt")
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--chunk", type=int, default=16, help="prefill chunk")
    p.add_argument("--max-batch-tokens", type=int, default=48)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument(
        "--preempt",
        choices=("free", "suspend"),
        default="free",
        help="free and recompute, or suspend to a host tier of 64 MiB",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    summary = run(args)
    if args.json:
        print(json.dumps(summary))
    else:
        print("  ".join(f"{k}={v}" for k, v in summary.items()))
    same, total = summary["match"].split("/")
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
