"""Prefix-reuse benchmarks: block hashing, and probe + allocate on a warm cache.

  python bench/bench_prefix.py            # full run (about 20 s)
  python bench/bench_prefix.py --quick    # smoke run

1. Hashing: ``kvcm.block_keys`` of a 4352-token prompt (16-token blocks), nanoseconds per
   token, against the classic Python baseline measured in the same run: per block,
   ``sha256(pickle.dumps((parent, tuple(block_tokens), extra_keys)))``.
2. 64 requests share a 4096-token prefix plus 256 unique tokens each. The prefix is cached
   (one request computed and committed it). Per request: ``probe`` then ``allocate`` with
   the prompt, (a) given the request's block keys (computed once, as a scheduler keeps them
   per request), and (b) hashing the prompt inside each call. Microseconds per request.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from kvcm import KVCacheManager, block_keys

TPB = 16
PREFIX, UNIQUE, REQUESTS = 4096, 256, 64


def baseline_keys(tokens: list[int], extra: tuple[object, ...] | None = None) -> list[bytes]:
    parent = b""
    out = []
    for i in range(len(tokens) // TPB):
        block = tuple(tokens[i * TPB : (i + 1) * TPB])
        parent = hashlib.sha256(pickle.dumps((parent, block, extra))).digest()
        out.append(parent)
    return out


def timed(fn: object, reps: int) -> float:
    """Median seconds of ``reps`` calls."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_hashing(reps: int) -> dict[str, float]:
    """Medians of alternating repetitions, so that both see the same machine state."""
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, 128_000, PREFIX + UNIQUE)]
    assert len(block_keys(tokens, TPB)) == len(baseline_keys(tokens))
    ours, theirs = [], []
    for _ in range(reps):
        ours.append(timed(lambda: block_keys(tokens, TPB), 1))
        theirs.append(timed(lambda: baseline_keys(tokens), 1))
    kvcm_s, base_s = statistics.median(ours), statistics.median(theirs)
    n = len(tokens)
    return {
        "kvcm_ns_per_token": kvcm_s / n * 1e9,
        "baseline_ns_per_token": base_s / n * 1e9,
        "speedup": base_s / kvcm_s,
    }


def bench_reuse(requests: int) -> dict[str, float]:
    rng = np.random.default_rng(1)
    prefix = [int(t) for t in rng.integers(0, 128_000, PREFIX)]
    prompts = [prefix + [int(t) for t in rng.integers(0, 128_000, UNIQUE)] for _ in range(requests)]
    per_request = (PREFIX + UNIQUE) // TPB + 1
    m = KVCacheManager(
        {
            "layers": [{"layer_id": i, "num_kv_heads": 1, "head_dim": 64} for i in range(4)],
            "tokens_per_block": TPB,
            "max_requests": 2 * requests + 2,
            "max_seq_len": PREFIX + UNIQUE + TPB,
            "num_blocks": per_request * (2 * requests + 2),
        }
    )
    warm = prefix + [7] * UNIQUE
    m.allocate("warm", len(warm), token_ids=warm)
    m.commit("warm", warm)
    out: dict[str, float] = {}
    for mode in ("keys", "hashing"):
        times, hits = [], []
        for i, prompt in enumerate(prompts):
            keys = block_keys(prompt, TPB) if mode == "keys" else None
            rid = f"{mode}-{i}"
            t0 = time.perf_counter()
            hit = m.probe(prompt, block_keys=keys)
            info = m.allocate(rid, len(prompt), token_ids=prompt, block_keys=keys)
            times.append(time.perf_counter() - t0)
            assert hit == info.num_hit_tokens == PREFIX
            hits.append(hit)
        out[f"probe_allocate_us_{mode}_median"] = statistics.median(times) * 1e6
        out[f"probe_allocate_us_{mode}_mean"] = statistics.fmean(times) * 1e6
        for i in range(len(prompts)):
            m.free(f"{mode}-{i}")
    stats = m.stats().prefix_cache
    assert stats is not None
    out["hit_rate"] = stats.hit_rate
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    hashing = bench_hashing(5 if args.quick else 200)
    reuse = bench_reuse(8 if args.quick else REQUESTS)
    print(f"{'measure':<44}{'kvcm':>12}{'baseline':>12}{'ratio':>8}")
    print(
        f"{'hashing, ns per token (4352-token prompt)':<44}"
        f"{hashing['kvcm_ns_per_token']:>12.1f}{hashing['baseline_ns_per_token']:>12.1f}"
        f"{hashing['speedup']:>7.1f}x"
    )
    for mode, text in (("keys", "given its block keys"), ("hashing", "hashing inside")):
        print(
            f"{'probe + allocate, us per request, ' + text:<44}"
            f"{reuse[f'probe_allocate_us_{mode}_median']:>12.1f}{'':>12}{'':>8}"
        )
    print(f"prefix hit rate over the run: {reuse['hit_rate']:.3f}")
    if args.json:
        record = {"machine": platform.platform(), **hashing, **reuse}
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
