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


@pytest.mark.parametrize(
    ("windowed", "dma", "state"),
    [(False, False, False), (False, True, False), (True, False, False), (False, False, True)],
)
def test_random_cycles_on_cuda_never_corrupt_a_block(
    windowed: bool, dma: bool, state: bool
) -> None:
    """The kernel copies the test's small slots; ``dma`` sends every copy to the copy
    engines instead (what large slots get); ``state``: with a state layer, whose live
    states suspends and resumes copy too (docs/state-layers.md)."""
    cycles = CYCLES // 5 if windowed or dma or state else CYCLES
    stats = run_cycles(7, cycles, windowed, "cuda:0", dma_min_bytes=1 if dma else None, state=state)
    print(f"cuda host tier, windowed={windowed}, dma={dma}, state={state}: {stats}")
    assert stats["onboarded_blocks"] > 0
