"""Disaggregated prefill and decode with the example engine: two engines, each on its own
``kvcm serve --transfer nixl`` (docs/disaggregation.md).

The prefill engine runs every request's prompt and its first token (``max_new_tokens`` 1)
and hands the request off; it writes what the decode engine needs (the request ids, the kv
ids it handed off, the first tokens) to a JSON file. The decode engine pulls each request's
KV from the prefill sidecar (its ``--peer``) and generates the rest; every ``fetch_every``-th
request never went to the prefill engine: the decode engine fetches the prefix the prefill
sidecar caches (the shared system prompt) and prefills the rest itself. The decode engine's
tokens are compared with transformers' ``generate`` of the whole request.

    KVCM_API_TOKEN=p kvcm serve --transfer nixl --transfer-name prefill --port 8470 &
    KVCM_API_TOKEN=d KVCM_PEER_TOKEN=p kvcm serve --transfer nixl --transfer-name decode \\
        --port 8471 --peer prefill=http://127.0.0.1:8470 &
    KVCM_API_TOKEN=p python -m kvcm_engine.disagg prefill --sidecar http://127.0.0.1:8470 \\
        --handoffs /tmp/handoffs.json
    KVCM_API_TOKEN=d python -m kvcm_engine.disagg decode --sidecar http://127.0.0.1:8471 \\
        --peer prefill --handoffs /tmp/handoffs.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .engine import Backend, Engine, reference_outputs
from .models import FAMILIES, build_model
from .scheduler import Request
from .workload import make_requests

#: Seconds the prefill sidecar keeps a handed-off request for its puller.
HAND_OFF_S = 120.0
SIZING = {"tokens_per_block": 4, "max_prefill_chunk": 16, "null_page": True}


def _requests(args: argparse.Namespace) -> list[Request]:
    return make_requests(args.requests, seed=args.seed)


def _fetched(i: int, every: int) -> bool:
    """Whether request i skips the prefill engine (it fetches its prefix instead): every
    ``every``-th from the first, which is the first to arrive, before the decode sidecar
    caches the shared system prompt (``make_requests``: even requests have it)."""
    return every > 0 and i % every == 0


def _engine(args: argparse.Namespace, hand_off_s: float | None) -> tuple[Engine, Any, Any]:
    from kvcm_client import KVCacheClient

    built = build_model(args.model, seed=args.seed, device="cpu")
    client = KVCacheClient(args.sidecar)
    sizing = {**SIZING, "num_blocks": args.num_blocks, "max_requests": 16, "max_seq_len": 256}
    client.register_model(hf_config=built.hf_config, share=True, **sizing)
    engine = Engine(
        built, Backend.sidecar(client), chunk=16, max_batch_tokens=48, hand_off_s=hand_off_s
    )
    return engine, client, built


def prefill(args: argparse.Namespace) -> dict[str, Any]:
    """Prompt and first token of each request, then a hand-off; the handoffs file."""
    engine, client, _ = _engine(args, HAND_OFF_S)
    try:
        requests = [r for i, r in enumerate(_requests(args)) if not _fetched(i, args.fetch_every)]
        for r in requests:
            r.max_new_tokens = 1
        begin = time.perf_counter()
        done = engine.run(requests)
        wall = time.perf_counter() - begin
    finally:
        client.close()
    handed = [
        {"request_id": r.request_id, "kv_id": r.kv_id, "first_token": r.output[0]}
        for r in engine.scheduler.handed_off
    ]
    Path(args.handoffs).write_text(json.dumps(handed))
    return {"role": "prefill", "requests": len(done), "handed_off": len(handed), "wall_s": wall}


def decode(args: argparse.Namespace) -> dict[str, Any]:
    """Pull each handed-off request and generate the rest; fetch the others' prefixes."""
    handed = {h["request_id"]: h for h in json.loads(Path(args.handoffs).read_text())}
    engine, client, built = _engine(args, None)
    try:
        requests = _requests(args)
        for i, r in enumerate(requests):
            if _fetched(i, args.fetch_every):
                r.fetch_from = args.peer
                continue
            h = handed[r.request_id]
            r.emit(h["first_token"])
            r.source = (args.peer, h["kv_id"])
        begin = time.perf_counter()
        done = engine.run(requests)
        wall = time.perf_counter() - begin
    finally:
        client.close()
    expected = reference_outputs(built, _requests(args))
    same = sum(r.output == expected[r.request_id] for r in done)
    s = engine.scheduler.stats
    return {
        "role": "decode",
        "requests": len(done),
        "match": f"{same}/{len(done)}",
        "pulls": s.pulls,
        "pulled_tokens": s.pulled_tokens,
        "fetched_tokens": s.fetched_tokens,
        "moved_blocks": s.moved_blocks,
        "pull_failures": s.pull_failures,
        "hit_tokens": s.hit_tokens,
        "preemptions": s.preemptions,
        "wall_s": round(wall, 3),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvcm_engine.disagg", description=__doc__.split("\n")[0]
    )
    p.add_argument("role", choices=("prefill", "decode"))
    p.add_argument("--sidecar", required=True, help="this engine's kvcm serve --transfer nixl")
    p.add_argument("--peer", default="prefill", help="decode: the prefill sidecar's --peer name")
    p.add_argument("--handoffs", required=True, help="the JSON file prefill writes, decode reads")
    p.add_argument("--model", choices=sorted(FAMILIES), default="llama")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=96)
    p.add_argument(
        "--fetch-every", type=int, default=4, help="every Nth request fetches its prefix (0: none)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    summary = (prefill if args.role == "prefill" else decode)(args)
    print(json.dumps(summary))
    if args.role == "decode":
        same, total = summary["match"].split("/")
        return 0 if same == total else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
