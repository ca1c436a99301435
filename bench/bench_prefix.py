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
3. Publishing an 8192-token request: ``allocate`` with its token ids, then ``commit`` of the
   prompt, microseconds per block (512 blocks). "Before" commits other tokens than the prompt
   (its first id differs), so the commit hashes every block as it did before commits reused the
   keys allocate computed; "after" commits the prompt itself. Also with ``kv_events`` off.
4. The commits of one decode step of 256 requests (one token each, every 16th step fills a
   block): a loop of ``commit`` against one ``commit_many``, microseconds per request.
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
PUBLISH = 8192


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


def _publisher(kv_events: bool = True) -> KVCacheManager:
    return KVCacheManager(
        {
            "layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}],
            "tokens_per_block": TPB,
            "max_requests": 4,
            "max_seq_len": PUBLISH,
            "num_blocks": PUBLISH // TPB + 1,
            "kv_events": kv_events,
        }
    )


def bench_publish(reps: int) -> dict[str, float]:
    """Allocate + commit of a fresh 8192-token prompt, us per block; the modes alternate, so
    that they see the same machine state, and the cache is emptied (untimed) after each."""
    rng = np.random.default_rng(2)
    modes = {"before": True, "after": True, "after_no_events": False}
    managers = {mode: _publisher(events) for mode, events in modes.items()}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    commit_times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(reps):
        prompt = [int(t) for t in rng.integers(0, 128_000, PUBLISH)]
        other = [prompt[0] + 1, *prompt[1:]]
        for mode, m in managers.items():
            committed = other if mode == "before" else prompt
            t0 = time.perf_counter()
            m.allocate("r", PUBLISH, token_ids=prompt)
            t1 = time.perf_counter()
            m.commit("r", committed)
            t2 = time.perf_counter()
            times[mode].append(t2 - t0)
            commit_times[mode].append(t2 - t1)
            m.free("r")
            m.reset_prefix_cache()
    blocks = PUBLISH // TPB
    out = {}
    for mode in modes:
        out[f"publish_us_per_block_{mode}"] = statistics.median(times[mode]) / blocks * 1e6
        out[f"commit_us_per_block_{mode}"] = statistics.median(commit_times[mode]) / blocks * 1e6
    return out


def bench_commit_many(steps: int, requests: int = 256) -> dict[str, float]:
    """Decode-step commits of ``requests`` requests: a loop of commit vs one commit_many, on
    two equal managers, alternating step by step; us per request (medians over steps)."""
    config = {
        "layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}],
        "tokens_per_block": TPB,
        "max_requests": requests,
        "max_seq_len": 64 + steps + 1,
        "num_blocks": requests * ((64 + steps) // TPB + 2),
    }
    managers = {"loop": KVCacheManager(config), "many": KVCacheManager(config)}
    ids = [f"r{i}" for i in range(requests)]
    for m in managers.values():
        for i, rid in enumerate(ids):
            m.allocate(rid, 64, token_ids=[i] * 64)
            m.commit(rid, [i] * 64)
    times: dict[str, list[float]] = {"loop": [], "many": []}
    for step in range(steps):
        tokens = [[step] for _ in ids]
        for mode, m in managers.items():
            m.extend_many(ids)
            t0 = time.perf_counter()
            if mode == "loop":
                for rid, toks in zip(ids, tokens, strict=True):
                    m.commit(rid, toks)
            else:
                m.commit_many(ids, tokens)
            times[mode].append(time.perf_counter() - t0)
    assert managers["loop"].events().events == managers["many"].events().events
    return {
        f"commit_us_per_request_{mode}": statistics.median(t) / requests * 1e6
        for mode, t in times.items()
    }


def bench_tombstones(reps: int) -> dict[str, float]:
    """pop(16) + push on a 1M-slot free queue whose middle lost 100k slots to prefix hits
    (tombstones behind the head): ``BlockPool.pop`` reads from the head until 16 are live;
    the baseline reads past every tombstone at each pop (kvcm before 2026-12-04)."""
    from kvcm.block_pool import BlockPool

    def queue() -> BlockPool:
        pool = BlockPool(1_000_000)
        pool.claim(np.arange(500_000, 700_000, 2, dtype=np.int32))
        return pool

    def baseline_pop(pool: BlockPool, k: int) -> np.ndarray:
        window = pool._entries(pool._head, min(pool._len, k + pool._len - pool._count))
        live = np.flatnonzero(window >= 0)[:k]
        used = int(live[-1]) + 1
        pool._head += used
        pool._len -= used
        pool._count -= k
        return window[live]

    ours, base = queue(), queue()
    return {
        "pop_push_us": timed(lambda: ours.push(ours.pop(16)), reps) * 1e6,
        "pop_push_us_baseline": timed(lambda: base.push(baseline_pop(base, 16)), reps) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    hashing = bench_hashing(5 if args.quick else 200)
    reuse = bench_reuse(8 if args.quick else REQUESTS)
    publish = bench_publish(3 if args.quick else 40)
    many = bench_commit_many(16 if args.quick else 64)
    tomb = bench_tombstones(50 if args.quick else 2000)
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
    print()
    print(
        f"{'publish an 8192-token request, us per block':<52}{'before':>9}{'after':>9}{'ratio':>8}"
    )
    for what, text in (("publish", "allocate + commit"), ("commit", "commit alone")):
        before, after = (
            publish[f"{what}_us_per_block_before"],
            publish[f"{what}_us_per_block_after"],
        )
        off = publish[f"{what}_us_per_block_after_no_events"]
        print(f"{text + ', events on':<52}{before:>9.3f}{after:>9.3f}{before / after:>7.2f}x")
        print(
            f"{text + ', after: events on vs off':<52}{after:>9.3f}{off:>9.3f}{after / off:>7.2f}x"
        )
    loop, batch = many["commit_us_per_request_loop"], many["commit_us_per_request_many"]
    print(f"{'decode commits of 256 requests, us per request':<52}{'loop':>9}{'many':>9}")
    ratio = loop / batch
    print(f"{'  a loop of commit vs one commit_many':<52}{loop:>9.3f}{batch:>9.3f}{ratio:>7.2f}x")
    ours, base = tomb["pop_push_us"], tomb["pop_push_us_baseline"]
    print(f"{'free queue with 100k tombstones, us per pop(16)+push':<52}{'kvcm':>9}{'base':>9}")
    text = "  read from the head vs past every tombstone"
    print(f"{text:<52}{ours:>9.2f}{base:>9.2f}{base / ours:>7.1f}x")
    if args.json:
        record = {"machine": platform.platform(), **hashing, **reuse, **publish, **many, **tomb}
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
