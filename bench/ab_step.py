"""The decode step of this tree against an earlier commit, alternating in one sitting.

  python bench/ab_step.py                 # against the commit before this session's work
  python bench/ab_step.py --base f10b454 --rounds 7

Each round runs ``bench_manager.bench_decode`` once per variant, each in a fresh process whose
``PYTHONPATH`` points at that variant's tree (the earlier commit is checked out in a temporary
git worktree). Variants alternate within a round, so the machine's drift hits them alike; the
table gives the median over rounds and the ratio to the base (noisy 2-core VMs: read ratios,
not absolute times).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys
sys.path.insert(0, {bench!r})
import bench_manager as b
out = {{}}
for hybrid in (False, True):
    for n in {sizes!r}:
        many, step, _ = b.bench_decode(n, hybrid, {steps}, **{config!r})
        out[f"{{'sliding+full' if hybrid else 'full'}} N={{n}}"] = [many, step]
print(json.dumps(out))
"""


def _run(tree: Path, sizes: list[int], steps: int, config: dict[str, object]) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(tree / d) for d in ("service", "client", "kernels"))
    code = CHILD.format(bench=str(ROOT / "bench"), sizes=sizes, steps=steps, config=config)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="f10b454", help="the earlier commit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base), args.base],
            check=True,
        )
        try:
            variants = {
                f"base {args.base}": (base, {}),
                "this tree": (ROOT, {}),
                "this tree, null page": (ROOT, {"null_page": True}),
            }
            runs: dict[str, list[dict]] = {name: [] for name in variants}
            for r in range(args.rounds):
                for name, (tree, config) in variants.items():
                    runs[name].append(_run(tree, args.sizes, args.steps, config))
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True
            )
    first = next(iter(runs))
    cases = list(runs[first][0])
    print(f"## decode step A/B, us per request per step, median of {args.rounds} rounds")
    print("| case | variant | extend_many | step(ops) | extend_many / base |")
    print("|---|---|---|---|---|")
    for case in cases:
        base_many = statistics.median(run[case][0] for run in runs[first])
        for name, results in runs.items():
            many = statistics.median(run[case][0] for run in results)
            step = statistics.median(run[case][1] for run in results)
            print(f"| {case} | {name} | {many:.3f} | {step:.3f} | {many / base_many:.2f} |")


if __name__ == "__main__":
    main()
