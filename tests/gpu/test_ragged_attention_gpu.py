"""Decode attention through the CUDA manager's ragged pages (built by the CuPy kernel) equals
dense attention: tests/test_ragged_attention.py's check on cuda:0."""

from __future__ import annotations

import pytest
import torch
from test_ragged_attention import check_against_dense

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("null_page", [False, True])
def test_ragged_decode_attention_on_cuda_equals_dense_attention(null_page: bool) -> None:
    check_against_dense(null_page, 3, "cuda:0")
