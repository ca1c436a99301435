"""``step_columns(ragged_layers=[...])`` on a CUDA manager: over random engine steps (chunked
prefill, decode with lookahead, rewinds, windows with sinks, prefix hits, frees) its answer's
ragged pages equal the CPU manager's given the same ops, as do the statuses, handles and slot
mappings (tests/test_step_ragged.py is the CPU test of the ragged pages themselves)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from helpers import manager
from test_step_ragged import ASKED, LAYERS, lists, workload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _ints(x: Any) -> list[int]:
    x = x.cpu() if isinstance(x, torch.Tensor) else x
    return [int(v) for v in np.asarray(x).ravel()]


class Twin:
    """The same ops to a CPU and a CUDA manager; every answer compared; the CUDA one returned."""

    def __init__(self, cpu: Any, cuda: Any) -> None:
        self.cpu, self.cuda, self.steps = cpu, cuda, 0

    def step_columns(self, **columns: Any) -> Any:
        a = self.cpu.step_columns(**columns)
        b = self.cuda.step_columns(**columns)
        assert {k: _ints(v) for k, v in a.status.items()} == {
            k: _ints(v) for k, v in b.status.items()
        }
        assert _ints(a.handles) == _ints(b.handles)
        if a.slot_mapping is not None:
            assert _ints(a.slot_mapping) == _ints(b.slot_mapping)
        if "ragged_layers" in columns:
            assert sorted(a.ragged) == sorted(b.ragged) == ASKED
            for k in ASKED:
                assert lists(a.ragged[k]) == lists(b.ragged[k]), (self.steps, k)
            self.steps += 1
        return b

    def ragged_page_indices(self, *args: Any, **kw: Any) -> Any:
        return self.cuda.ragged_page_indices(*args, **kw)


@pytest.mark.parametrize("null_page", [False, True])
def test_cuda_ragged_pages_equal_the_cpu_managers(null_page: bool) -> None:
    cpu = manager(LAYERS, num_blocks=40, null_page=null_page, max_requests=8)
    cuda = manager(LAYERS, num_blocks=40, null_page=null_page, max_requests=8, device="cuda:0")
    twin = Twin(cpu, cuda)
    assert workload(twin, random.Random(5), 40) > 50
    assert twin.steps == 40
