"""The host tier on CUDA: pinned host regions, copies on the tier's stream, the randomized
checksum run of tests/test_host_tier.py with the pools on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU tests run on the GPU machine only", allow_module_level=True)

from test_host_tier import run_cycles

#: KVCM_GPU_HOST_CYCLES=1000000 for the long run recorded in bench/RESULTS.md.
CYCLES = int(os.environ.get("KVCM_GPU_HOST_CYCLES", "100000"))


@pytest.mark.parametrize("windowed", [False, True])
def test_random_cycles_on_cuda_never_corrupt_a_block(windowed: bool) -> None:
    stats = run_cycles(7, CYCLES if not windowed else CYCLES // 5, windowed, "cuda:0")
    print(f"cuda host tier, windowed={windowed}: {stats}")
    assert stats["onboarded_blocks"] > 0
