"""The benchmark scripts keep running (smoke sizes; the figures live in bench/RESULTS.md)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every bench script's --quick mode, in subprocesses

ROOT = Path(__file__).resolve().parents[1]


def _bench(script: str, *args: str) -> str:
    """Run ``bench/<script>`` with ``args`` (smoke sizes); its output, after a zero exit."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_bench_manager_quick_prints_every_table() -> None:
    stdout = _bench("bench_manager.py", "--quick")
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert sum(line.startswith(("| full |", "| sliding+full |")) for line in rows) == 2
    assert any(line.endswith("x |") and "M |" in line for line in rows)  # allocate + free
    assert "construction" in stdout


def test_bench_prefix_quick_prints_its_table() -> None:
    stdout = _bench("bench_prefix.py", "--quick")
    assert "hashing, ns per token" in stdout and "probe + allocate" in stdout
    assert "publish an 8192-token request" in stdout and "commit_many" in stdout


def test_loadtest_quick_runs_both_clients_and_leaks_nothing() -> None:
    stdout = _bench("loadtest.py", "--quick")  # exit 1 on errors or leaks
    assert "after the run: 0 leaked blocks, 0 requests left" in stdout
    for client in ("httpx", "raw"):
        assert re.search(rf"^{client} +step closed c=1 ", stdout, re.M), client


def test_bench_step_channel_quick_prints_every_variant() -> None:
    stdout = _bench("bench_step_channel.py", "--quick")
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_step_channel import NAMES

    for variant in NAMES:
        assert f"| {variant} |" in stdout
    # --quick: 30 steps of the channel's step_columns, in one block (shorter than 50)
    places = dict(re.findall(r"^\| (1st|2nd|3rd to 5th|6th on) \| (\d+) \|", stdout, re.M))
    assert places == {"1st": "1", "2nd": "1", "3rd to 5th": "3", "6th on": "25"}


def test_bench_step_channel_by_replacements_counts_every_step() -> None:
    """Each row's steps add up to the steps run (30 with --quick), and the p50s are
    positive (a service that never polls: the A/B flag reaches ``kvcm serve``)."""
    stdout = _bench("bench_step_channel.py", "--by-replacements", "--quick", "--step-poll-us", "0")
    rows = re.findall(r"^\| (\d+|all) \| (\d+) \| (\d+)", stdout, re.M)
    counts = {k: int(n) for k, n, _ in rows}
    assert counts["all"] == 30 and sum(n for k, n in counts.items() if k != "all") <= 30
    assert all(int(p50) > 0 for _, _, p50 in rows)


def test_bench_columnar_quick_prints_every_workload() -> None:
    stdout = _bench("bench_columnar.py", "--quick")
    for workload in ("decode: step_columns, N=256", "typed step(ops), per op", "single extend()"):
        assert f"| {workload} |" in stdout


def test_bench_columnar_compares_the_c_core_with_the_numpy_path() -> None:
    from kvcm import native

    if not native.available():
        pytest.skip("kvcm._native is not built")
    stdout = _bench("bench_columnar.py", "--quick", "--compare-native")
    assert "| workload | C core us | numpy path us | numpy / C | target us |" in stdout
    assert "| decode: step_columns, N=256 |" in stdout


def test_the_client_package_needs_neither_torch_nor_numpy_nor_the_server() -> None:
    code = (
        "import sys, kvcm_client; "
        "print(sorted(m for m in ('torch', 'numpy', 'fastapi', 'uvicorn', 'kvcm') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_bench_engine_quick_runs_every_way_with_equal_tokens() -> None:
    stdout = _bench("bench_engine.py", "--quick", "--gap-ms", "1")
    assert " omp_spin=10000" in stdout  # the engine's OpenMP spin, capped (it ran again)
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and "---" not in line]
    ways = [row.split("|")[1].strip() for row in rows[1:]]
    # On the CPU each kvcm way gathers the history for SDPA (the paged kernel is CUDA's).
    assert ways == [
        "transformers (dense cache, static batch)",
        "kvcm in-process (gather)",
        "kvcm sidecar, HTTP (gather)",
        "kvcm sidecar, step channel (gather)",
        "kvcm sidecar, step channel, busy-poll (gather)",
    ]
    # Every kvcm way generated the baseline's tokens for all 4 requests, with one call per
    # step: the slot mappings come with the step's answer, and kvcm sizes the allocates.
    assert [row.split("|")[-2].strip() for row in rows[2:]] == ["4"] * 4
    steps = [row.split("|")[4].strip() for row in rows[2:]]
    assert [row.split("|")[-5].strip() for row in rows[2:]] == steps


def test_bench_host_tier_quick_compares_with_a_plain_copy() -> None:
    stdout = _bench("bench_host_tier.py", "--quick")
    rows = [line for line in stdout.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 1 and rows[0].count("%") == 2


def test_bench_ranks_quick_prints_a_row_per_rank_count() -> None:
    stdout = _bench("bench_ranks.py", "--quick")
    lines = stdout.splitlines()
    rows = [
        line.split("|")[1].strip() for line in lines if line[:3] in ("| 1", "| 2", "| 4", "| 8")
    ]
    assert rows == ["1", "2", "4", "8"]


def test_bench_router_quick_prints_its_table() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    stdout = _bench("bench_router.py", "--quick")
    rows = [line.split(" | ")[0] for line in stdout.splitlines() if line.startswith("| ")]
    scores = [r for r in rows if r.startswith("| score")]
    assert len(scores) == 3 and scores[0].startswith("| score p50 / p99 ms, 20 req/s open loop")
    assert scores[1:] == [
        "| score p50 / p99 ms, the same prompts one at a time",
        "| score p50 / p99 ms, all 64 hold the whole prompt",
    ]
    assert any(r.startswith("| event-to-index visibility") for r in rows)
    assert any(r.startswith("| restart to complete") for r in rows)


def test_step_channel_timeline_quick_splits_every_frame() -> None:
    stdout = _bench("step_channel_timeline.py", "--quick")
    for frame in ("bad op", "empty step", "decode 256"):
        for client in ("sleeps", "spins"):
            row = re.search(rf"^\| {frame}, client {client} \|(.*)\|$", stdout, re.M)
            assert row is not None, (frame, client, stdout)
            wake, handle, write, back, total, hot = (float(v) for v in row.group(1).split("|"))
            # The server's parts are positive and inside the round trip. The wakes are
            # differences of two processes' stamps: either may run before the other's
            # call returns, so only their bounds are checked.
            assert min(handle, write, hot) > 0 and total > handle + write
            assert abs(wake) < total and abs(back) < total


def test_cold_step_quick_prints_every_cell() -> None:
    stdout = _bench("cold_step.py", "--quick")
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([\d.]+ \| [\d.]+ \| [\d.]+) \|$", stdout, re.M))
    assert set(rows) == {"hot", "2 MiB sweep", "64 MiB sweep", "1 ms sleep"}, stdout


def test_bench_step_channel_by_replacements_takes_a_gap_and_no_doorbell() -> None:
    stdout = _bench(
        "bench_step_channel.py", "--quick", "--by-replacements", "--gap-ms", "1", "--no-doorbell"
    )
    assert re.search(r"^\| all \| \d+ \| \d+ \(p99 \d+\) \|$", stdout, re.M), stdout


def test_bench_cadence_quick_measures_the_step_against_its_echo() -> None:
    stdout = _bench("bench_cadence.py", "--gap-ms", "2", "--steps", "50")
    row = r"^\| (kvcm step channel, [\w -]+) \| .* \| ([\d.]+)x / ([\d.]+)x \| ([\d.]+) \|$"
    rows = re.findall(row, stdout, re.M)
    names = [r[0] for r in rows]
    # Both modes at both cadences, each against its echo, with the server's CPU (how much
    # a spinning server gets depends on what else runs: it yields between looks).
    assert names == ["kvcm step channel, default", "kvcm step channel, busy-poll mode"] * 2
    assert all(float(p50) > 0 and float(p99) > 0 for _, p50, p99, _ in rows), stdout


def test_bench_transfer_tiny_pulls_every_way() -> None:
    """Two sidecars over NIXL: every way's row, each after its bytes were verified (a
    mismatch exits non-zero)."""
    pytest.importorskip("nixl_cu12", reason="the transfer extra (nixl-cu12) is not installed")
    stdout = _bench(
        "bench_transfer.py", "--gib", "0.01", "--tokens", "64", "--repeat", "1", "--skip-32k"
    )
    ways = re.findall(r"^\| ([^|]+?) \| \d+ \| [\d-]+ \| [\d.]+ \| [\d.]+ \|", stdout, re.M)
    assert [w.split(" (")[0] if w.startswith("torch") else w for w in ways] == [
        "kvcm pull, 10 MiB (80 tokens)",
        "raw NIXL READ, same 5 descriptors",
        "raw NIXL READ, one contiguous descriptor",
        "memcpy in one process (numpy.copyto)",
        "torch copy_ in one process",  # (N threads)
        "kvcm pull, 64-token request",
        "raw NIXL READ, same 4 descriptors",
    ], stdout
    assert "kvcm / raw NIXL (same descriptors), 10 MiB: " in stdout
