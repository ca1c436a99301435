"""``bench_columnar``'s workloads in this tree against an earlier commit, alternating.

  python bench/ab_columnar.py --base b1f0985            # ~3 min
  python bench/ab_columnar.py --base b1f0985 --rounds 5 --repeats 20

Each round runs ``bench_columnar.bench`` once per variant, each in a fresh process whose
``PYTHONPATH`` points at that variant's tree (the earlier commit is checked out in a temporary
git worktree, its C core built there when it has one). The workloads are this tree's, so
their definitions are the same on both sides. Variants alternate within a round, so the
machine's drift hits them alike; the table gives each variant's median over rounds, in
microseconds, and the ratio.
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
import json, sys
sys.path.insert(0, {bench!r})
import bench_columnar
print(json.dumps(bench_columnar.bench({repeats})))
"""


def _run(tree: Path, repeats: int) -> dict[str, float]:
    env = dict(os.environ)
    paths = [str(tree / d) for d in ("service", "client", "kernels")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    code = CHILD.format(bench=str(ROOT / "bench"), repeats=repeats)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _build(tree: Path) -> None:
    """Build the tree's C core in place, if it has one (quietly: a failure leaves numpy)."""
    if (tree / "setup.py").exists():
        subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
            cwd=tree,
            capture_output=True,
            check=False,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the earlier commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with checked_out(args.base) as base:
        _build(base)
        variants = {f"base {args.base}": base, "this tree": ROOT}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name, tree in variants.items():
                runs[name].append(_run(tree, args.repeats))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    base_runs, head_runs = runs.values()
    print(f"## bench_columnar A/B, median of {args.rounds} rounds (us)")
    print(f"| workload | base {args.base} | this tree | base / this |")
    print("|---|---|---|---|")
    for name in head_runs[0]:
        if name not in base_runs[0]:  # a row the base tree cannot run
            h = statistics.median(run[name] for run in head_runs)
            print(f"| {name} | - | {h:.2f} | - |")
            continue
        b = statistics.median(run[name] for run in base_runs)
        h = statistics.median(run[name] for run in head_runs)
        print(f"| {name} | {b:.2f} | {h:.2f} | {b / h:.2f}x |")


if __name__ == "__main__":
    main()
