"""How long a small call waits while the largest calls the service accepts are running.

  python bench/loop_latency.py            # about 40 s
  python bench/loop_latency.py --quick    # a smoke run

A ``kvcm serve`` process (max_seq_len 131072, max_requests past ``MAX_STEP_OPS``, the default
body limit) on loopback. One thread sends small calls (``POST /v1/extend`` of one token to a
live request) back to back and records their latency; another sends maximal calls in a loop: a
probe of a max_seq_len prompt, a step of ``MAX_STEP_OPS`` allocates (then one freeing them),
and a body just under the limit that is refused after parsing (a prompt past max_seq_len).
Phases: small calls alone (the baseline, same run), then with each kind of maximal call.
Reports p50/p99 of the small calls and how long the maximal calls took.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from kvcm.manager import MAX_STEP_OTHER_OPS as MAX_STEP_OPS
from kvcm.server.app import default_body_limit

MAX_SEQ_LEN = 131072
LAYERS = [{"layer_id": i, "num_kv_heads": 1, "head_dim": 64} for i in range(4)]


def _serve(config: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcm", "serve", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        found = re.search(r"serving on (\S+)", line)
        if found:
            url = found.group(1)
            break
    else:
        raise RuntimeError("kvcm did not start")
    for _ in range(300):
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("kvcm never became ready")


def _heavy_calls() -> dict[str, Callable[[httpx.Client], None]]:
    prompt = list(range(MAX_SEQ_LEN))
    allocs = [
        {"op": "allocate", "request_id": f"h{i}", "num_tokens": 16} for i in range(MAX_STEP_OPS)
    ]
    frees = [{"op": "free", "request_id": f"h{i}"} for i in range(MAX_STEP_OPS)]
    # Just under the body limit (default_body_limit), refused after parsing: too long.
    limit = default_body_limit(MAX_SEQ_LEN)
    junk = b'{"token_ids": [' + b"1," * ((limit - 64) // 2) + b"-1]}"

    def probe(http: httpx.Client) -> None:
        assert http.post("/v1/probe", json={"token_ids": prompt}).status_code == 200

    def step(http: httpx.Client) -> None:
        assert http.post("/v1/step", json={"ops": allocs}).status_code == 200
        assert http.post("/v1/step", json={"ops": frees}).status_code == 200

    def refused(http: httpx.Client) -> None:
        r = http.post("/v1/probe", content=junk, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["code"] == "sequence_too_long", r.text

    return {
        f"probe of {MAX_SEQ_LEN} tokens": probe,
        f"step of {MAX_STEP_OPS} allocates + step of {MAX_STEP_OPS} frees": step,
        f"{len(junk) / 2**20:.1f} MiB body, refused": refused,
    }


def _phase(
    url: str, seconds: float, heavy: Callable[[httpx.Client], None] | None
) -> tuple[list[float], list[float]]:
    small: list[float] = []
    big: list[float] = []
    stop = threading.Event()

    def hammer() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert heavy is not None
                heavy(http)
                big.append(time.perf_counter() - t0)

    worker = threading.Thread(target=hammer) if heavy else None
    if worker:
        worker.start()
    with httpx.Client(base_url=url, timeout=60) as http:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            r = http.post("/v1/extend", json={"request_id": "small", "num_new_tokens": 1})
            small.append(time.perf_counter() - t0)
            assert r.status_code == 200
            http.post("/v1/rewind", json={"request_id": "small", "num_tokens": 1})
    stop.set()
    if worker:
        worker.join()
    return small, big


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    seconds = 2.0 if args.quick else 10.0
    config = {
        "layers": LAYERS,
        "max_seq_len": MAX_SEQ_LEN,
        "max_requests": MAX_STEP_OPS + 8,
        "num_blocks": 2 * MAX_STEP_OPS + 64,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(config))
        proc, url = _serve(path)
        try:
            with httpx.Client(base_url=url, timeout=60) as http:
                http.post("/v1/allocate", json={"request_id": "small", "num_tokens": 8})
            heavy = _heavy_calls()
            print(f"# {time.strftime('%Y-%m-%d')} {platform.machine()}, {seconds:.0f} s a phase")
            print("| running beside | small calls | p50 ms | p99 ms | max ms | big call ms (p50) |")
            print("|---|---|---|---|---|---|")
            phases = [("nothing (baseline)", None), *heavy.items()]
            for name, call in phases:
                small, big = _phase(url, seconds, call)
                p50, p99, top = np.percentile(np.array(small) * 1e3, [50, 99, 100])
                b50 = f"{np.median(big) * 1e3:.0f}" if big else "-"
                print(f"| {name} | {len(small)} | {p50:.2f} | {p99:.2f} | {top:.1f} | {b50} |")
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
