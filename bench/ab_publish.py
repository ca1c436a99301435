"""Publishing an 8192-token request in this tree against an earlier commit, alternating.

  python bench/ab_publish.py                 # against the commit before issue 13 part 3
  python bench/ab_publish.py --base 17b59bc --rounds 5

Publishing is ``allocate`` with the prompt's token ids then ``commit`` of the prompt (512
blocks of 16 tokens; the cache is emptied, untimed, after each). Each round runs both variants,
each in a fresh process whose ``PYTHONPATH`` points at that variant's tree (the earlier commit
is checked out in a temporary git worktree), so the machine's drift hits them alike. The table
gives medians over rounds of each process's median, in microseconds per block.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from worktree import checked_out

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, statistics, time
import numpy as np
from kvcm import KVCacheManager
m = KVCacheManager({"layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8}],
                    "tokens_per_block": 16, "max_requests": 4, "max_seq_len": 8192,
                    "num_blocks": 513})
rng = np.random.default_rng(2)
total, commit = [], []
for _ in range(%(reps)d):
    prompt = [int(t) for t in rng.integers(0, 128_000, 8192)]
    t0 = time.perf_counter()
    m.allocate("r", 8192, token_ids=prompt)
    t1 = time.perf_counter()
    m.commit("r", prompt)
    t2 = time.perf_counter()
    total.append(t2 - t0)
    commit.append(t2 - t1)
    m.free("r")
    m.reset_prefix_cache()
print(json.dumps([statistics.median(total) / 512 * 1e6, statistics.median(commit) / 512 * 1e6]))
"""


def _run(tree: Path, reps: int) -> list[float]:
    env = dict(os.environ)
    paths = [str(tree / d) for d in ("service", "client", "kernels")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", CHILD % {"reps": reps}],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="17b59bc", help="the earlier commit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()
    with checked_out(args.base) as base:
        variants = {f"base {args.base}": base, "this tree": ROOT}
        runs: dict[str, list[list[float]]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, tree in variants.items():
                runs[name].append(_run(tree, args.reps))
    print(f"## publishing an 8192-token request, us per block, median of {args.rounds} rounds")
    print("| variant | allocate + commit | commit alone | allocate + commit / base |")
    print("|---|---|---|---|")
    first = statistics.median(r[0] for r in next(iter(runs.values())))
    for name, results in runs.items():
        total = statistics.median(r[0] for r in results)
        commit = statistics.median(r[1] for r in results)
        print(f"| {name} | {total:.3f} | {commit:.3f} | {total / first:.2f} |")


if __name__ == "__main__":
    main()
