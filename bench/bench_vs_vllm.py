"""vLLM's v1 KV-cache manager and kvcm's columnar step, side by side in one process.

  /tmp/vllm-venv/bin/python bench/bench_vs_vllm.py           # ~10 s
  /tmp/vllm-venv/bin/python bench/bench_vs_vllm.py --quick   # a smoke run

Needs vLLM importable next to kvcm (CPU torch is enough: only vLLM's scheduler-side Python
classes run, no model and no worker); RESULTS.md gives the install. Exits 2 without it.

Both sides: block size 16, one KV-cache group of 4 full-attention layers (kvcm: 4 layers of 1
KV head; vLLM: one ``FullAttentionSpec`` group naming 4 layers), every request has room (no
preemption, no eviction). The two sides are timed alternately, sample by sample, and each row
is the median of the samples, in microseconds.

What each side does, per workload:

- ``decode``: N = 256 running requests, +1 token each per step, prompt lengths 100..355 so
  that about 1/16 of the requests cross a block boundary at each step.

  - vLLM: ``KVCacheManager.new_step_starts()`` then one ``allocate_slots(request, 1)`` per
    running request: the calls its scheduler makes for a decode step (``Scheduler.schedule``,
    running-requests loop). Timed: those calls and the Python loop over the requests. Not
    timed: the scheduler's own bookkeeping between steps, done by this script as the scheduler
    and engine do it (``num_computed_tokens += 1`` and ``append_output_token_ids``); vLLM's
    manager reads the lengths from the ``Request``, kvcm's keeps them itself.
  - kvcm: one ``KVCacheManager.step_columns(extend=handles)`` for the 256 handles.
  - Prefix caching is OFF on both sides for the matched rows: vLLM with
    ``enable_caching=False``, and kvcm's extend publishes nothing (kvcm publishes at
    ``commit``). An extra vLLM-only row runs the same step with ``enable_caching=True`` (then
    ``allocate_slots`` also caches each block that fills, and ``append_output_token_ids``,
    untimed there, hashes it); it has no kvcm counterpart.

- ``publish``: one 8192-token prompt (512 blocks of 16), every block new (the cache is reset
  between samples), prefix caching ON on both sides, SHA-256 block keys on both sides (vLLM's
  default ``prefix_caching_hash_algo``; kvcm's keys are SHA-256 too). Reported per block.

  Matched rows (same work on both sides, ratio given):

  - hash: the prompt's 512 block hashes. vLLM: ``Request.update_block_hashes()`` with
    ``get_request_block_hasher(16, sha256)``, what ``Request.__init__`` runs in the engine
    core (or the frontend precomputes) before the request is scheduled. kvcm:
    ``kvcm.block_keys(prompt, 16)``, the hashing its ``allocate(token_ids=)`` does, timed on
    its own (allocate cannot skip it: keys passed in are hashed again at commit).
  - publish alone. vLLM: ``allocate_slots(..., delay_cache_blocks=True)`` untimed, then
    ``KVCacheManager.cache_blocks(request, 8192)`` timed. kvcm: ``commit(id, prompt)``, timed
    as the second half of the total row's sample: it records the 8192 tokens computed and
    publishes the 512 blocks, reusing the keys allocate computed.
  - total. vLLM: hash + ``get_computed_blocks(request)`` (a miss) + ``allocate_slots(request,
    8192, ...)``, as the scheduler admits a waiting request; vLLM caches (publishes) the
    prompt's full blocks inside that ``allocate_slots`` call, when the prefill is scheduled,
    not after it has run. kvcm: ``allocate(id, 8192, token_ids=prompt)`` (hashes, looks up,
    allocates) + ``commit(id, prompt)`` (publishes).

  A last row, not matched (no ratio), splits the totals the way each API does: vLLM's lookup +
  allocate_slots (no hashing, but caches) next to kvcm's allocate (hashes, but publishes
  nothing).

Not timed on either side: building the prompt list, ``free`` and the cache reset between
samples, and (kvcm) a probe that checks the blocks were published. Garbage collection stays on.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import statistics
import sys
import time

import numpy as np

try:
    import torch
    import vllm
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request, RequestStatus
except ImportError as exc:  # pragma: no cover - depends on the environment
    print(
        f"bench_vs_vllm: vLLM is not importable here ({exc}); run it in a venv that has vllm "
        "and kvcm (see bench/RESULTS.md)",
        file=sys.stderr,
    )
    sys.exit(2)

from kvcm import KVCacheManager, block_keys

TPB = 16
N = 256
LAYERS = 4
PUBLISH_TOKENS = 8192
HASH_ALGO = "sha256"


# --- construction ---------------------------------------------------------------------------


def _kvcm(num_blocks: int, max_seq_len: int) -> KVCacheManager:
    layers = [{"layer_id": i, "num_kv_heads": 1, "head_dim": 8} for i in range(LAYERS)]
    return KVCacheManager(
        {
            "layers": layers,
            "tokens_per_block": TPB,
            "num_blocks": num_blocks,
            "max_requests": 1024,
            "max_seq_len": max_seq_len,
        }
    )


def _vllm(num_blocks: int, max_model_len: int, enable_caching: bool) -> VllmManager:
    spec = FullAttentionSpec(block_size=TPB, num_kv_heads=1, head_size=8, dtype=torch.float16)
    group = KVCacheGroupSpec([f"model.layers.{i}.self_attn" for i in range(LAYERS)], spec)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[group])
    return VllmManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=TPB,
        hash_block_size=TPB,
        enable_caching=enable_caching,
    )


_HASH_FN = get_hash_fn_by_name(HASH_ALGO)
init_none_hash(_HASH_FN)
_HASHER = get_request_block_hasher(TPB, _HASH_FN)


def _request(request_id: str, prompt: list[int], hashed: bool) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=1 << 20),
        None,
        block_hasher=_HASHER if hashed else None,
    )


# --- decode ---------------------------------------------------------------------------------


class _VllmDecode:
    """256 running requests in a vLLM manager, prefilled; ``step`` times one decode step."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.m = _vllm(num_blocks, 1 << 20, enable_caching)
        rng = np.random.default_rng(1)
        self.reqs = []
        for i in range(N):
            req = _request(f"r{i}", rng.integers(0, 50_000, 100 + i).tolist(), enable_caching)
            blocks, hit, _ = self.m.get_computed_blocks(req)
            assert self.m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = req.num_tokens
            req.append_output_token_ids(7)  # the prefill's sampled token
            self.reqs.append(req)

    def _allocate_step(self) -> float:
        """The KV-manager calls of one decode step, timed (us): what the rows compare."""
        m = self.m
        allocate = m.allocate_slots
        t0 = time.perf_counter_ns()
        m.new_step_starts()
        for req in self.reqs:
            if allocate(req, 1) is None:
                raise RuntimeError("vLLM: out of blocks")
        return (time.perf_counter_ns() - t0) / 1000

    def step(self) -> float:
        took = self._allocate_step()
        # The scheduler's and the engine's bookkeeping after the step: not timed.
        for req in self.reqs:
            req.num_computed_tokens += 1
            req.append_output_token_ids(7)
        return took


class _VllmDecodeWithHashing(_VllmDecode):
    """The same step with prefix caching on; also times the hashing in the bookkeeping."""

    def step_and_append(self) -> tuple[float, float]:
        took = self._allocate_step()
        for req in self.reqs:
            req.num_computed_tokens += 1
        t2 = time.perf_counter_ns()
        for req in self.reqs:
            req.append_output_token_ids(7)
        return took, (time.perf_counter_ns() - t2) / 1000


def _check_decode(k: KVCacheManager, v: _VllmDecode, vc: _VllmDecode, steps: int) -> None:
    """Both sides did the work: every request grew by ``steps`` tokens and holds the blocks
    for them; vLLM with caching published every full block of the decoded tokens."""
    for i in range(N):
        info = k.request(f"r{i}")
        assert info.num_tokens == 100 + i + steps, (info.num_tokens, i, steps)
        assert len(k.block_table(f"r{i}")[0]) == -(-info.num_tokens // TPB)
        for side in (v, vc):
            req = side.reqs[i]
            assert req.num_computed_tokens == 100 + i + steps, (req.num_computed_tokens, i)
            held = side.m.get_block_ids(req.request_id)[0]
            assert len(held) == -(-req.num_computed_tokens // TPB)
    assert len(v.m.block_pool.cached_block_hash_to_block) == 0
    full = sum(req.num_computed_tokens // TPB for req in vc.reqs)
    assert len(vc.m.block_pool.cached_block_hash_to_block) == full


def bench_decode(repeats: int, inner: int) -> dict[str, tuple[float, float | None]]:
    num_blocks = N * (355 + 2 + (repeats + 2) * inner * 2) // TPB + 1024
    k = _kvcm(num_blocks, 1 << 20)
    handles = np.array([k.allocate(f"r{i}", 100 + i).handle for i in range(N)])
    v = _VllmDecode(num_blocks, enable_caching=False)
    vc = _VllmDecodeWithHashing(num_blocks, enable_caching=True)

    def kvcm_step() -> float:
        t0 = time.perf_counter_ns()
        k.step_columns(extend=handles)
        return (time.perf_counter_ns() - t0) / 1000

    for _ in range(inner):  # warm-up
        v.step()
        kvcm_step()
        vc.step_and_append()
    v_s, k_s, vc_s, vh_s = [], [], [], []
    for _ in range(repeats):
        v_s.append(sum(v.step() for _ in range(inner)) / inner)
        k_s.append(sum(kvcm_step() for _ in range(inner)) / inner)
        pairs = [vc.step_and_append() for _ in range(inner)]
        vc_s.append(sum(a for a, _ in pairs) / inner)
        vh_s.append(sum(b for _, b in pairs) / inner)
    _check_decode(k, v, vc, steps=inner * (repeats + 1))
    v_us, k_us = statistics.median(v_s), statistics.median(k_s)
    vc_us, vh_us = statistics.median(vc_s), statistics.median(vh_s)
    return {
        "decode step, N=256 (prefix caching off)": (v_us, k_us),
        "  the same, per request": (v_us / N, k_us / N),
        "decode step, vLLM with prefix caching on: allocate_slots (caches filled blocks)": (
            vc_us,
            None,
        ),
        "  + append_output_token_ids, untimed above (hashes the filled blocks)": (vh_us, None),
    }


# --- publish --------------------------------------------------------------------------------


def bench_publish(repeats: int) -> dict[str, tuple[float | None, float | None]]:
    nb = PUBLISH_TOKENS // TPB
    v = _vllm(4096, PUBLISH_TOKENS, enable_caching=True)
    k = _kvcm(4096, PUBLISH_TOKENS)
    cached = v.block_pool.cached_block_hash_to_block
    base = np.random.default_rng(0).integers(0, 50_000, PUBLISH_TOKENS).tolist()

    def vllm_full(i: int) -> tuple[float, float]:
        req = _request(f"v{i}", [*base[:-1], i], hashed=False)
        req._block_hasher = _HASHER  # what Request.__init__ runs, timed on its own here
        t0 = time.perf_counter_ns()
        req.update_block_hashes()
        t1 = time.perf_counter_ns()
        blocks, hit, _ = v.get_computed_blocks(req)
        out = v.allocate_slots(req, req.num_tokens - hit, hit, blocks)
        t2 = time.perf_counter_ns()
        assert out is not None and hit == 0 and len(req.block_hashes) == nb
        assert len(out.get_block_ids()[0]) == nb and len(cached) == nb, "not all published"
        v.free(req)
        assert v.reset_prefix_cache()
        return (t1 - t0) / 1000 / nb, (t2 - t1) / 1000 / nb

    def vllm_cache_alone(i: int) -> float:
        req = _request(f"w{i}", [*base[:-1], i], hashed=True)
        assert v.allocate_slots(req, req.num_tokens, delay_cache_blocks=True) is not None
        assert len(cached) == 0
        t0 = time.perf_counter_ns()
        v.cache_blocks(req, req.num_tokens)
        t1 = time.perf_counter_ns()
        assert len(cached) == nb
        v.free(req)
        assert v.reset_prefix_cache()
        return (t1 - t0) / 1000 / nb

    def kvcm_hash(i: int) -> float:
        # The hashing kvcm's allocate(token_ids=) does (token bytes, then the key chain),
        # timed on its own: allocate has no switch to skip it without commits hashing again.
        tokens = [*base[:-1], i]
        t0 = time.perf_counter_ns()
        keys = block_keys(tokens, TPB)
        t1 = time.perf_counter_ns()
        assert len(keys) == nb
        return (t1 - t0) / 1000 / nb

    def kvcm_full(i: int) -> tuple[float, float, float]:
        tokens = [*base[:-1], i]
        t0 = time.perf_counter_ns()
        info = k.allocate(f"q{i}", PUBLISH_TOKENS, token_ids=tokens)
        t1 = time.perf_counter_ns()
        k.commit(f"q{i}", tokens)
        t2 = time.perf_counter_ns()
        assert info.num_hit_tokens == 0
        # Published: the same prompt now hits all but its last block.
        probe = k.allocate(f"probe{i}", PUBLISH_TOKENS, token_ids=tokens)
        assert probe.num_hit_tokens == PUBLISH_TOKENS - TPB, probe.num_hit_tokens
        k.free(f"probe{i}")
        k.free(f"q{i}")
        k.reset_prefix_cache()
        return (t1 - t0) / 1000 / nb, (t2 - t1) / 1000 / nb, (t2 - t0) / 1000 / nb

    for i in range(3):  # warm-up
        vllm_full(i)
        kvcm_hash(i)
        vllm_cache_alone(i)
        kvcm_full(i)
    vh, va, vca, kh, ka, kc, kt = ([] for _ in range(7))
    for i in range(3, 3 + repeats):
        for column, x in zip((vh, va), vllm_full(i), strict=True):
            column.append(x)
        kh.append(kvcm_hash(i))
        vca.append(vllm_cache_alone(i))
        for column, x in zip((ka, kc, kt), kvcm_full(i), strict=True):
            column.append(x)
    med = statistics.median
    return {
        "publish 8k, hash the prompt's 512 blocks (SHA-256): vLLM"
        " Request.update_block_hashes | kvcm block_keys": (med(vh), med(kh)),
        "publish 8k, publish alone: vLLM cache_blocks | kvcm commit": (med(vca), med(kc)),
        "publish 8k, total: vLLM hash + get_computed_blocks + allocate_slots (allocates,"
        " caches) | kvcm allocate(token_ids) (hashes, looks up, allocates) + commit": (
            med(h + a for h, a in zip(vh, va, strict=True)),
            med(kt),
        ),
        "  part, not matched: vLLM get_computed_blocks + allocate_slots (no hashing, caches)"
        " | kvcm allocate(token_ids) (hashes, no publishing)": (med(va), med(ka)),
    }


# --- report ---------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats = 5 if args.quick else 40
    decode = bench_decode(repeats, 20)
    publish = bench_publish(5 if args.quick else 30)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"load {load:.2f}; Python {platform.python_version()}, vllm {vllm.__version__}, "
        f"kvcm {importlib.metadata.version('kvcm')}, torch {torch.__version__}, "
        f"numpy {np.__version__}"
    )
    print()
    print("| workload (vLLM \\| kvcm) | vLLM us | kvcm us | vLLM / kvcm |")
    print("|---|---|---|---|")
    for name, (a, b) in {**decode, **publish}.items():
        matched = a is not None and b is not None and "not matched" not in name
        ratio = f"{a / b:.2f}x" if matched else ""
        label = name.replace("|", "\\|")
        print(f"| {label} | {_fmt(a)} | {_fmt(b)} | {ratio} |")
    print()
    print("decode rows: per step unless marked per request; publish rows: per block.")


if __name__ == "__main__":
    main()
