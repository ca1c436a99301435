"""Time to first token with a prefix fetched from a peer sidecar, against computing it.

  python bench/bench_fetch_ttft.py                # CPU: a small Llama-style model
  python bench/bench_fetch_ttft.py --prefix 512 1536 --repeat 5

Two ``kvcm serve --transfer nixl`` on loopback, each with an example engine (kvcm_engine) in
this process attached to its pools. The "prefill" engine computes a request whose prompt
starts with a long shared prefix, so its sidecar caches that prefix. Then, per trial, on the
other sidecar (its prefix cache emptied first, ``reset_prefix_cache``), the same engine runs a
new request with that prefix and its own tail, ``max_new_tokens`` 1, twice: once fetching the
prefix from the peer (``Request.fetch_from``: ``fetch`` then the tail's prefill), once
computing all of it. Its run time is the request's time to first token. Both answers are
checked against transformers' ``generate`` (one token). Prints a table of medians and the
ratio; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvcm_client import KVCacheClient
from kvcm_engine import Backend, Engine, build_model, reference_outputs
from kvcm_engine.scheduler import Request

#: The model: hidden 256, 4 layers, 8 heads / 4 KV heads of 32 (bench_engine.py's CPU shape).
SHAPE = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
}
TOKEN = "bench-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(name: str, peers: list[str]) -> tuple[subprocess.Popen[str], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "kvcm", "serve", "--port", str(port), "--transfer", "nixl"]
    cmd += ["--transfer-name", name, *(f"--peer={p}" for p in peers)]
    env = {**os.environ, "KVCM_API_TOKEN": TOKEN, "KVCM_PEER_TOKEN": TOKEN}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if re.search(r"serving on", line):
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"kvcm serve exited with {proc.wait()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefix", type=int, nargs="+", default=[512, 2048], help="prefix tokens")
    p.add_argument("--tail", type=int, default=32, help="the request's own tokens")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    built = build_model("llama", **SHAPE)
    longest = max(args.prefix) + args.tail + 16
    sizing = {
        "tokens_per_block": 16,
        "max_seq_len": longest,
        "num_blocks": 4 * (longest // 16 + 2),
        "max_requests": 4,
        "null_page": True,
        "share": True,
    }
    procs = []
    rows: list[dict[str, Any]] = []
    try:
        prefill_proc, prefill_url = _serve("prefill", [])
        procs.append(prefill_proc)
        decode_proc, decode_url = _serve("decode", [f"prefill={prefill_url}"])
        procs.append(decode_proc)
        clients = [KVCacheClient(url, token=TOKEN) for url in (prefill_url, decode_url)]
        for c in clients:
            c.register_model(hf_config=built.hf_config, **sizing)
        engines = [
            Engine(built, Backend.sidecar(c), chunk=args.chunk, max_batch_tokens=args.chunk)
            for c in clients
        ]
        source, local = engines
        for n in args.prefix:
            shared = [(7 * i + n) % 4000 + 1 for i in range(n)]
            seed = Request(f"seed-{n}", [*shared, 5], 1)
            source.run([seed])
            times: dict[str, list[float]] = {"fetch": [], "compute": []}
            fetched = 0
            for trial in range(args.repeat):
                tail = [(13 * i + trial) % 4000 + 1 for i in range(args.tail)]
                for way in ("fetch", "compute"):
                    clients[1].reset_prefix_cache()
                    r = Request(f"{way}-{n}-{trial}", [*shared, *tail], 1)
                    if way == "fetch":
                        r.fetch_from = "prefill"
                    before = local.scheduler.stats.fetched_tokens
                    begin = time.perf_counter()
                    (done,) = [x for x in local.run([r]) if x.request_id == r.request_id]
                    times[way].append(time.perf_counter() - begin)
                    want = reference_outputs(built, [Request(r.request_id, r.prompt, 1)])
                    assert done.output == want[r.request_id], (way, n, trial)
                    if way == "fetch":
                        fetched = local.scheduler.stats.fetched_tokens - before
                        assert fetched == n // 16 * 16, fetched
                    print(
                        f"prefix {n} trial {trial} {way}: {times[way][-1] * 1e3:.1f} ms",
                        file=sys.stderr,
                    )
            f, c = statistics.median(times["fetch"]), statistics.median(times["compute"])
            rows.append(
                {
                    "prefix_tokens": n,
                    "fetched_tokens": fetched,
                    "ttft_fetch_ms": round(f * 1e3, 1),
                    "ttft_compute_ms": round(c * 1e3, 1),
                    "compute_over_fetch": round(c / f, 2),
                }
            )
        for c in clients:
            c.close()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    print(
        f"# bench_fetch_ttft {datetime.date.today()} {platform.node()} "
        f"llama-style {SHAPE['num_hidden_layers']} layers, hidden {SHAPE['hidden_size']}, "
        f"tail {args.tail}, chunk {args.chunk}, median of {args.repeat}"
    )
    print("| prefix tokens | fetched | TTFT fetch ms | TTFT compute ms | compute / fetch |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['prefix_tokens']} | {row['fetched_tokens']} | {row['ttft_fetch_ms']} | "
            f"{row['ttft_compute_ms']} | {row['compute_over_fetch']}x |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
