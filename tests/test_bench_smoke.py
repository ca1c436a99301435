"""The benchmark scripts keep running (smoke sizes; the figures live in bench/RESULTS.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_manager_quick_prints_every_table() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_manager.py"), "--quick"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert sum(line.startswith(("| full |", "| sliding+full |")) for line in rows) == 2
    assert any(line.endswith("x |") and "M |" in line for line in rows)  # allocate + free
    assert "construction" in run.stdout
