"""What kvcm's time in the example engine's step is made of: cProfile over the scheduler's
``schedule`` (its planning and the ``step_columns`` call) of bench_engine's workload, in
process, on ``--device``; prints the functions with the most time of their own.

  python bench/profile_engine_kvcm.py --device cuda
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import SHAPES, _kind, _workload, kv_settings

from kvcm import KVCacheManager
from kvcm.model_config import layers_from_hf_config
from kvcm_engine import Backend, Engine, build_model, make_requests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    defaults = {"requests": 16, "system_prompt": 64, "prompt_min": 32, "prompt_max": 192}
    defaults |= {"new_tokens": 32, "chunk": 128, "max_batch_tokens": 512, "num_blocks": 1024}
    for k, v in defaults.items():
        setattr(args, k, v)
    kind = _kind(args.device)
    dtype = torch.float16 if kind == "cuda" else torch.float32
    built = build_model("llama", device=args.device, dtype=dtype, weight_gain=1.0, **SHAPES[kind])
    layers = layers_from_hf_config(built.hf_config)
    manager = KVCacheManager({"layers": layers, "device": args.device, **kv_settings(args)})
    profile = cProfile.Profile()
    for run in range(2):  # a warm-up run, then the profiled one
        engine = Engine(built, Backend.in_process(manager), chunk=128, max_batch_tokens=512,
                        max_running=16)  # fmt: skip
        schedule = engine.scheduler.schedule
        if run:

            def profiled(schedule=schedule):  # type: ignore[no-untyped-def]
                profile.enable()
                try:
                    return schedule()
                finally:
                    profile.disable()

            engine.scheduler.schedule = profiled  # type: ignore[method-assign]
        engine.run(make_requests(16, seed=1, **_workload(args)))
        manager.reset_prefix_cache()
    s = engine.stats
    print(f"steps {s.steps}: kvcm {s.kvcm_s * 1e3 / s.steps:.3f} ms/step (profiled)")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
