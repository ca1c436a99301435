"""The host tier's copy kernel on CUDA (kvcm_kernels.block_copy, kvcm.tier_copies): random
segments between device memory and pinned host memory against the CPU reference, and random
copy batches with every kind of hazard against running each copy alone, in order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU tests run on the GPU machine only", allow_module_level=True)

from test_tier_copies import run_random_copies

import kvcm_kernels
from kvcm.tier_copies import TierCopier

DEV = torch.device("cuda:0")


@pytest.mark.parametrize("dma", [False, True])
@pytest.mark.parametrize("slot_bytes", [40, 4096, 100_000, 2 << 20])
def test_copy_segments_matches_the_reference(slot_bytes: int, dma: bool) -> None:
    """Device -> pinned host and back: 40-byte slots (not 16-byte aligned: the byte loop),
    100,000 (three 32 KiB pieces and one of 1,696 bytes), 2 MiB (a Llama-8B block)."""
    rng = np.random.default_rng(slot_bytes)
    n_dev, n_host, k = 40, 24, 16
    dev = torch.randint(0, 256, (n_dev, slot_bytes), dtype=torch.uint8, device=DEV)
    host = torch.zeros((n_host, slot_bytes), dtype=torch.uint8, pin_memory=True)
    d = rng.choice(n_dev, k, replace=False)
    h = rng.choice(n_host, k, replace=False)
    desc = kvcm_kernels.segments(
        dev.data_ptr() + d * slot_bytes, host.data_ptr() + h * slot_bytes, slot_bytes
    )
    dma_min = 1 if dma else 1 << 62  # every segment to the copy engines, or none
    kvcm_kernels.copy_segments(desc, DEV, dma_min_bytes=dma_min)
    torch.cuda.synchronize()
    want = torch.zeros_like(host)
    want[torch.from_numpy(h)] = dev[torch.from_numpy(d).to(DEV)].cpu()
    assert torch.equal(host, want)
    # Back: host rows into other device slots.
    d2 = rng.choice(n_dev, k, replace=False)
    before = dev.clone()
    desc = kvcm_kernels.segments(
        host.data_ptr() + h * slot_bytes, dev.data_ptr() + d2 * slot_bytes, slot_bytes
    )
    kvcm_kernels.copy_segments(desc, DEV, dma_min_bytes=dma_min)
    torch.cuda.synchronize()
    before[torch.from_numpy(d2).to(DEV)] = host[torch.from_numpy(h)].to(DEV)
    assert torch.equal(dev, before)


@pytest.mark.parametrize(("seed", "dma"), [(0, False), (1, False), (2, True)])
def test_random_copy_batches_on_cuda_equal_copies_one_by_one(seed: int, dma: bool) -> None:
    """Batches run their segments in parallel: only the copier's hazard launches keep a copy
    that reads or rewrites a slot of an earlier queued copy after it."""
    rng = np.random.default_rng(seed)
    slot_bytes = 4096
    device = torch.randint(0, 256, (12, slot_bytes), dtype=torch.uint8, device=DEV)
    chunks = [
        torch.randint(0, 256, (3, slot_bytes), dtype=torch.uint8).pin_memory() for _ in range(3)
    ]
    copier = TierCopier([device], {0: chunks}, {0: [0]}, DEV)
    copier.dma_min_bytes = 1 if dma else 1 << 62
    copier._engines = {0: dma}  # decided at construction from the slot size: decide here
    run_random_copies(copier, device, chunks, rng, 400, 4, 9)
    if dma:  # each copy launched as it was queued: stream order alone keeps them right
        assert (copier.stats.copy_launches, copier.stats.copy_hazard_launches) == (400, 0)
    else:
        assert copier.stats.copy_hazard_launches > 10
