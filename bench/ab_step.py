"""The decode step of this tree against an earlier commit, alternating in one sitting.

  python bench/ab_step.py                 # against the commit before this session's work
  python bench/ab_step.py --base f10b454 --rounds 7
  python bench/ab_step.py --base-tree ab-base --device cuda:0   # a checked-out tree, on a GPU

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
from contextlib import nullcontext
from pathlib import Path

from worktree import checked_out

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
#: On CUDA: bench_kernels' whole manager decode step (extend_many + slot_mappings, wall us)
#: for 1 and 4 layer groups, reported in both columns.
CHILD_CUDA = """
import json, sys
sys.path.insert(0, {bench!r})
import bench_kernels as b
out = {{}}
for groups in (1, 4):
    r = b.bench_manager_step(groups)
    out[f"cuda step, {{groups}} groups, wall us"] = [r["kvcm_wall_us"], r["reference_wall_us"]]
print(json.dumps(out))
"""


def _run(tree: Path, sizes: list[int], steps: int, config: dict[str, object], cuda: bool) -> dict:
    env = dict(os.environ)
    paths = [str(tree / d) for d in ("service", "client", "kernels")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    child = CHILD_CUDA if cuda else CHILD
    code = child.format(bench=str(ROOT / "bench"), sizes=sizes, steps=steps, config=config)
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
    parser.add_argument("--base-tree", type=Path, help="a checked-out base tree (no git needed)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:0 for the CUDA step")
    args = parser.parse_args()
    cuda = args.device != "cpu"
    tree_of_base = nullcontext(args.base_tree) if args.base_tree else checked_out(args.base)
    with tree_of_base as base:
        variants = {
            f"base {args.base}": (base, {}),
            "this tree": (ROOT, {}),
        }
        if not cuda:
            variants["this tree, null page"] = (ROOT, {"null_page": True})
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name, (tree, config) in variants.items():
                runs[name].append(_run(tree, args.sizes, args.steps, config, cuda))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    first = next(iter(runs))
    cases = list(runs[first][0])
    print(f"## decode step A/B, median of {args.rounds} rounds")
    columns = "kvcm kernels | torch reference" if cuda else "extend_many | step(ops)"
    print(f"| case | variant | {columns} | first column / base |")
    print("|---|---|---|---|---|")
    for case in cases:
        base_many = statistics.median(run[case][0] for run in runs[first])
        for name, results in runs.items():
            many = statistics.median(run[case][0] for run in results)
            step = statistics.median(run[case][1] for run in results)
            print(f"| {case} | {name} | {many:.3f} | {step:.3f} | {many / base_many:.2f} |")


if __name__ == "__main__":
    main()
