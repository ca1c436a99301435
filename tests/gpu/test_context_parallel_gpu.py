"""Decode context parallelism on CUDA (kvcm.context_parallel): logical CP ranks on the card(s),
each with its local device tables (edits translated for its class, applied by the fused
step kernel or alone), checked against the brute-force model of tests/test_context_parallel.py,
and Helix attention over every rank's pages, merged, against dense attention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from servers import serve_process
from test_context_parallel import (
    cp_config,
    helix_against_dense,
    helix_through_attachments,
    random_ops_against_the_model,
)


@pytest.mark.parametrize(
    ("cp", "null_page", "check_every"), [(2, False, 1), (4, True, 3), (3, False, 7)]
)
def test_cp_ranks_device_tables_match_the_model(cp: int, null_page: bool, check_every: int) -> None:
    device = f"cuda:{torch.cuda.current_device()}"
    random_ops_against_the_model(cp, null_page, 10 + cp, device, check_every)


@pytest.mark.parametrize("cp", [2, 4])
def test_helix_attention_on_the_gpu_equals_dense_attention(cp: int) -> None:
    helix_against_dense(cp, f"cuda:{torch.cuda.current_device()}")


def test_a_process_per_cp_rank_maps_its_rank_over_cuda_ipc(tmp_path: Path) -> None:
    """``kvcm serve`` with CP ranks on the GPU: every rank's pools and local tables through
    CUDA IPC, Helix attention over the attachments, and a process per rank."""
    pytest.importorskip("cupy")
    config = cp_config(tmp_path, 2, f"cuda:{torch.cuda.current_device()}")
    with serve_process("--config", str(config)) as (url, _, _):
        helix_through_attachments(url, 2)
